//! Byte fuzzing of every decoder that reads untrusted input (issue 12, docs/SECURITY.md,
//! "Fuzzing"): the segment (alone and in batch frames), weights, work item and episode snapshot codecs, the environment
//! protocol's requests and replies, and the run spec.
//!
//! Each target starts from real messages (encoded by the same code that sends them) and
//! applies a proptest-chosen stack of mutations: bit flips, byte overwrites, truncation,
//! insertion of random bytes, splicing with another corpus entry, and huge length prefixes.
//! A decoder must never panic; a checksummed message (envelope, work item, snapshot) that was
//! changed must be rejected. The number of cases per target is `VOLLEY_FUZZ_CASES` (default
//! 20,000, so the normal suite runs in about a second); CI can raise it for a longer bounded run.

use std::cell::RefCell;
use std::collections::BTreeSet;
use std::time::Instant;

use proptest::prelude::*;
use proptest::test_runner::{Config, TestRunner};
use rand::{Rng, SeedableRng};
use rand_pcg::Pcg64Mcg;
use volley_core::ids::PolicyVersion;
use volley_core::spec::RunSpec;
use volley_core::wire::{self, TrajectorySegment, Weights};
use volley_core::work::{EpisodeSnapshot, Start, WorkItem};
use volley_policy::ParamLayout;
use volley_testkit::fixtures::{SegmentBuilder, SpecBuilder};
use volley_transport::envsvc::protocol::{self, CloseRequest, OpenRequest, ResetRequest, StepRequest};
use volley_transport::envsvc::protocol::{
    EnvFailure, ObsReply, OpenReply, RestoreRequest, SnapshotReply, SpacesReply, StepReply,
};

const T: usize = 4;

fn cases() -> u32 {
    std::env::var("VOLLEY_FUZZ_CASES").ok().and_then(|v| v.parse().ok()).unwrap_or(20_000)
}

fn spec() -> RunSpec {
    SpecBuilder::cartpole(T).run("fuzz").build()
}

fn layout() -> ParamLayout {
    ParamLayout::new(&spec().policy).expect("valid")
}

fn segment(idx: u64) -> TrajectorySegment {
    SegmentBuilder::for_spec(&spec())
        .actor(&format!("actor-{idx}"))
        .incarnation(idx)
        .episode_id(idx)
        .segment_idx(idx)
        .start_snapshot((idx % 2 == 1).then_some("w1-e0-s8"))
        .version(idx)
        .observations_from(|i| (i as f32 * 0.3).sin())
        .actions(vec![0, 1, 1, 0])
        .terminal_at(3)
        .log_prob(-0.7)
        .episode(4.0, 4)
        .build()
}

/// One mutation of a message.
#[derive(Debug, Clone)]
enum Mutation {
    FlipBit(usize),
    SetByte(usize, u8),
    Truncate(usize),
    Insert(usize, Vec<u8>),
    Splice(usize, usize),
    /// Overwrite 8 bytes with a huge little-endian length (0xff…), as a hostile prefix would.
    HugeLength(usize),
}

fn mutations() -> impl Strategy<Value = Vec<Mutation>> {
    let one = prop_oneof![
        any::<usize>().prop_map(Mutation::FlipBit),
        (any::<usize>(), any::<u8>()).prop_map(|(at, byte)| Mutation::SetByte(at, byte)),
        any::<usize>().prop_map(Mutation::Truncate),
        (any::<usize>(), proptest::collection::vec(any::<u8>(), 1..16)).prop_map(|(at, b)| Mutation::Insert(at, b)),
        (any::<usize>(), any::<usize>()).prop_map(|(at, other)| Mutation::Splice(at, other)),
        any::<usize>().prop_map(Mutation::HugeLength),
    ];
    proptest::collection::vec(one, 1..4)
}

fn apply(mut bytes: Vec<u8>, mutations: &[Mutation], corpus: &[Vec<u8>]) -> Vec<u8> {
    for mutation in mutations {
        let len = bytes.len().max(1);
        match mutation {
            Mutation::FlipBit(bit) if !bytes.is_empty() => {
                let bit = bit % (bytes.len() * 8);
                bytes[bit / 8] ^= 1 << (bit % 8);
            }
            Mutation::SetByte(at, byte) if !bytes.is_empty() => {
                let at = at % bytes.len();
                bytes[at] = *byte;
            }
            Mutation::Truncate(at) => bytes.truncate(at % len),
            Mutation::Insert(at, extra) => {
                let at = at % (bytes.len() + 1);
                bytes.splice(at..at, extra.iter().copied());
            }
            Mutation::Splice(at, other) => {
                let other = &corpus[other % corpus.len()];
                let at = at % (bytes.len() + 1);
                bytes.truncate(at);
                bytes.extend_from_slice(&other[at.min(other.len())..]);
            }
            Mutation::HugeLength(at) if bytes.len() >= 8 => {
                let at = at % (bytes.len() - 7);
                bytes[at..at + 8].copy_from_slice(&[0xff; 8]);
            }
            _ => {}
        }
    }
    bytes
}

/// Run `check` on mutated corpus entries for the configured number of cases; returns
/// (cases, seconds) and prints them for docs/SECURITY.md.
fn fuzz(target: &str, corpus: Vec<Vec<u8>>, check: impl Fn(&[u8], bool)) {
    let cases = cases();
    let mut runner = TestRunner::new(Config { cases, failure_persistence: None, ..Config::default() });
    let started = Instant::now();
    let strategy = (0..corpus.len(), mutations());
    runner
        .run(&strategy, |(entry, mutations)| {
            let mutated = apply(corpus[entry].clone(), &mutations, &corpus);
            // Changed: not byte for byte one of the real messages (a splice can rebuild one).
            let changed = !corpus.contains(&mutated);
            check(&mutated, changed);
            Ok(())
        })
        .unwrap_or_else(|err| panic!("{target}: {err}"));
    let secs = started.elapsed().as_secs_f64();
    eprintln!("fuzz {target}: {cases} cases in {secs:.2} s ({:.0} cases/s)", f64::from(cases) / secs);
}

/// The reasons of the rejections a target saw: each must be a listed label, and a long enough
/// run must have reached each of `expected` (so the typed error paths are exercised).
#[derive(Default)]
struct Reasons(RefCell<BTreeSet<&'static str>>);

impl Reasons {
    fn record<T>(&self, decoded: &Result<T, wire::DecodeError>) {
        if let Err(err) = decoded {
            let reason = err.reason();
            assert!(wire::DecodeError::REASONS.contains(&reason), "unlisted reason {reason}");
            self.0.borrow_mut().insert(reason);
        }
    }

    fn assert_reached(&self, target: &str, expected: &[&str]) {
        if cases() < 5_000 {
            return;
        }
        let seen = self.0.borrow();
        for reason in expected {
            assert!(seen.contains(reason), "{target}: no mutation was rejected as {reason}; saw {seen:?}");
        }
    }
}

#[test]
fn fuzz_segment_decoder() {
    let spec = spec();
    let hash = layout().hash();
    let corpus: Vec<Vec<u8>> = (0..4).map(|i| wire::encode_segment(&segment(i))).collect();
    let reasons = Reasons::default();
    fuzz("segment", corpus, |mutated, changed| {
        let decoded = wire::decode_segment(mutated, &spec, hash, 0);
        reasons.record(&decoded);
        if changed {
            assert!(decoded.is_err(), "a changed segment was accepted");
        }
    });
    reasons.assert_reached("segment", &["bad_magic", "wrong_version", "wrong_kind", "truncated", "corrupt"]);
}

/// Batch frames (issue 16): a frame's header has its own checksum, each part its envelope's,
/// so whatever the mutation, a part the learner accepts is byte for byte a real segment.
#[test]
fn fuzz_segment_batch_frames() {
    let spec = spec();
    let hash = layout().hash();
    let parts: Vec<Vec<u8>> = (0..4).map(|i| wire::encode_segment(&segment(i))).collect();
    let corpus: Vec<Vec<u8>> = (1..=4).map(|n| wire::batch::encode_segment_batch(&parts[..n])).collect();
    let reasons = Reasons::default();
    fuzz("segment batch", corpus, |mutated, _| match wire::batch::split_segment_batch(mutated) {
        Ok(split) => {
            for part in split {
                let decoded = wire::decode_segment(part, &spec, hash, 0);
                reasons.record(&decoded);
                if decoded.is_ok() {
                    assert!(
                        parts.iter().any(|p| p.as_slice() == part),
                        "a changed segment inside a frame was accepted"
                    );
                }
            }
        }
        Err(err) => reasons.record::<()>(&Err(err)),
    });
    reasons.assert_reached("segment batch", &["bad_magic", "truncated", "corrupt", "malformed"]);
}

#[test]
fn fuzz_weights_decoder() {
    let layout = layout();
    let corpus: Vec<Vec<u8>> = (0..3)
        .map(|v| wire::encode_weights(&Weights::new(PolicyVersion(v), layout.hash(), layout.init_params(v))))
        .collect();
    let reasons = Reasons::default();
    fuzz("weights", corpus, |mutated, changed| {
        let decoded = wire::decode_weights(mutated, layout.hash(), layout.n_params());
        reasons.record(&decoded);
        if changed {
            assert!(decoded.is_err(), "changed weights were accepted");
        }
    });
    reasons.assert_reached("weights", &["bad_magic", "truncated", "corrupt"]);
}

#[test]
fn fuzz_work_item_and_snapshot_decoders() {
    let items = [
        WorkItem { id: 1, task_id: 0, start: Start::Fresh { seed: 9 }, episodes: 2, group: None },
        WorkItem {
            id: u64::MAX,
            task_id: 3,
            start: Start::Resume { snapshot: "w1-e0-s8".into() },
            episodes: 1,
            group: None,
        },
    ];
    let reasons = Reasons::default();
    fuzz("work item", items.iter().map(WorkItem::to_json).collect(), |mutated, _| {
        let decoded = wire::decode_work_item(mutated);
        reasons.record(&decoded);
        if let Ok(item) = decoded {
            // A change that still decodes (JSON whitespace) must leave a real item's content.
            assert!(items.contains(&item), "a changed work item was accepted: {item:?}");
        }
    });
    reasons.assert_reached("work item", &["malformed", "truncated", "corrupt"]);
    let mut rng = Pcg64Mcg::seed_from_u64(3);
    let _: u64 = rng.random();
    let snapshots: Vec<Vec<u8>> = (0..2)
        .map(|i| {
            EpisodeSnapshot {
                work_item: i,
                episode_index: 0,
                task_id: 0,
                origin: None,
                env: vec![1, 2, 3, i as u8],
                hidden: vec![0.5],
                episode_return: 2.0,
                episode_len: 8,
                policy_version: volley_core::ids::PolicyVersion(4),
                rng: rng.clone(),
                progress: 0.5,
            }
            .encode()
        })
        .collect();
    let reasons = Reasons::default();
    fuzz("episode snapshot", snapshots, |mutated, changed| {
        let decoded = wire::decode_episode_snapshot(mutated);
        reasons.record(&decoded);
        if changed {
            assert!(decoded.is_err(), "a changed snapshot was accepted");
        }
    });
    reasons.assert_reached("episode snapshot", &["bad_magic", "truncated", "corrupt"]);
}

#[test]
fn fuzz_env_protocol_messages() {
    let v = protocol::PROTOCOL_VERSION;
    let requests = vec![
        protocol::encode(&OpenRequest { v, n_envs: 2, seeds: vec![1, 2] }),
        protocol::encode(&StepRequest { v, session: 7, actions: protocol::StepActions::Discrete(vec![0, 1]) }),
        protocol::encode(&StepRequest { v, session: 7, actions: protocol::StepActions::Box(vec![0.5, -2.0]) }),
        protocol::encode(&ResetRequest { v, session: 7, seeds: vec![Some(3), None], envs: None }),
        protocol::encode(&ResetRequest { v, session: 7, seeds: vec![Some(3)], envs: Some(vec![1]) }),
        protocol::encode(&RestoreRequest { v, session: 7, env: 1, state: vec![1, 2, 3] }),
        protocol::encode(&CloseRequest { v, session: 7 }),
    ];
    fuzz("env protocol requests", requests, |mutated, _| {
        let _ = protocol::decode::<protocol::VersionProbe>("probe", mutated);
        let _ = protocol::decode::<OpenRequest>("open", mutated);
        let _ = protocol::decode::<StepRequest>("step", mutated);
        let _ = protocol::decode::<ResetRequest>("reset", mutated);
        let _ = protocol::decode::<RestoreRequest>("restore", mutated);
        let _ = protocol::decode::<CloseRequest>("close", mutated);
    });
    let replies = vec![
        protocol::encode(&SpacesReply {
            env: "cartpole".into(),
            obs_dim: 4,
            obs_low: vec![f32::NEG_INFINITY; 4],
            obs_high: vec![f32::INFINITY; 4],
            n_actions: 2,
            action_space: Some(protocol::ActionSpaceMsg::from_space(&volley_env::ActionSpace::Discrete { n: 2 })),
            reward_threshold: Some(475.0),
            max_episode_steps: Some(500),
            max_abs_reward: Some(1.0),
            snapshot: true,
            max_envs_per_session: 16,
            obs_space: None,
        }),
        protocol::encode(&SpacesReply {
            env: "gymnasium:Pendulum-v1".into(),
            obs_dim: 3,
            obs_low: vec![-8.0; 3],
            obs_high: vec![8.0; 3],
            n_actions: 0,
            action_space: Some(protocol::ActionSpaceMsg::from_space(
                &volley_env::ActionSpace::continuous(vec![-2.0], vec![2.0]).unwrap(),
            )),
            reward_threshold: None,
            max_episode_steps: Some(200),
            max_abs_reward: None,
            snapshot: false,
            max_envs_per_session: 16,
            obs_space: Some(protocol::ObsSpaceMsg { kind: "box".into(), ..Default::default() }),
        }),
        protocol::encode(&SpacesReply {
            env: "atari:Pong".into(),
            obs_dim: 84 * 84,
            obs_low: vec![0.0; 84 * 84],
            obs_high: vec![255.0; 84 * 84],
            n_actions: 6,
            action_space: None,
            reward_threshold: None,
            max_episode_steps: Some(27_000),
            max_abs_reward: None,
            snapshot: false,
            max_envs_per_session: 16,
            obs_space: Some(protocol::ObsSpaceMsg::image([1, 84, 84])),
        }),
        protocol::encode(&OpenReply { session: 7, obs: f32_obs(&[0.5; 8]), idle_timeout_ms: 300_000 }),
        protocol::encode(&StepReply {
            obs: protocol::ObsBin::encode(&[7.0; 16], protocol::ObsEncoding::U8),
            rewards: vec![1.0, 1.0],
            terminated: vec![false, true],
            truncated: vec![false, false],
            final_obs: f32_obs(&[0.2; 4]),
            errors: vec![EnvFailure { env: 1, message: "kaboom".into() }],
        }),
        protocol::encode(&ObsReply { obs: f32_obs(&[0.3; 8]) }),
        protocol::encode(&SnapshotReply { state: vec![9; 32] }),
    ];
    fuzz("env protocol replies", replies, |mutated, _| {
        if let Ok(spaces) = protocol::decode::<SpacesReply>("spaces", mutated) {
            let _ = (spaces.image_shape(), spaces.action_space());
        }
        let _ = protocol::decode::<OpenReply>("open", mutated);
        let _ = protocol::decode::<StepReply>("step", mutated);
        let _ = protocol::decode::<ObsReply>("obs", mutated);
        let _ = protocol::decode::<SnapshotReply>("snapshot", mutated);
    });
}

#[test]
fn fuzz_run_spec() {
    let mut remote = spec();
    remote.env = serde_json::from_str(
        r#"{"name":"remote","service":"cartpole-v1","obs_dim":4,"n_actions":2,"max_abs_reward":1.0}"#,
    )
    .expect("remote env config");
    // Stored envelopes as the learner writes them (checksummed), and plain JSON specs as older
    // learners wrote them (read for compatibility, no checksum to verify).
    let corpus = vec![
        spec().encode_stored(),
        remote.encode_stored(),
        serde_json::to_vec(&spec()).expect("json"),
        serde_json::to_vec_pretty(&remote).expect("json"),
    ];
    let envelopes = corpus[..2].to_vec();
    fuzz("run spec", corpus, |mutated, changed| {
        let decoded = RunSpec::decode_stored(mutated);
        // A changed envelope never decodes (unless the mutations happened to turn it into one
        // of the plain specs, which carry no checksum).
        if changed && envelopes.iter().any(|e| mutated.starts_with(&e[..10])) {
            assert!(decoded.is_err(), "a changed stored spec was accepted");
        }
        if let Ok(spec) = decoded {
            let _ = spec.validate();
        }
    });
}

/// Float observations as they travel.
fn f32_obs(values: &[f32]) -> protocol::ObsBin {
    protocol::ObsBin::encode(values, protocol::ObsEncoding::F32)
}
