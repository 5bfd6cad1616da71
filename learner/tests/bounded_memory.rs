//! Issue 12, bounded memory under hostile input (docs/SECURITY.md, "Limits"): 200 valid
//! segments with ~1 MB actor ids took the learner from 44 MB to 450 MB of resident memory, and
//! it stayed there. One test in its own binary, so no other test's allocations move the
//! process's resident set while it measures.

mod common;

use std::thread;

use volley_core::spec::{HyperParams, LossKind, RunSpec};
use volley_core::wire::{Observations, TrajectorySegment};
use volley_core::work::SnapshotInfo;
use volley_learner::ingest::seen::{SeenSegments, SEEN_STREAMS};
use volley_learner::{Learner, LearnerReport, RunLimits, StopReason, UpdateStats};
use volley_testkit::fixtures::SpecBuilder;
use volley_transport::local::{trajectory_channel, weights_channel};
use volley_transport::TrajectorySink;

const T: usize = 8;
/// The stated bound: hostile input may grow the learner's resident set by at most this much.
const MAX_RSS_GROWTH_BYTES: u64 = 64 << 20;
const HOSTILE_ID_BYTES: usize = 1 << 20;

fn spec() -> RunSpec {
    let hyper =
        HyperParams { loss: LossKind::Vtrace, batch_segments: 4, max_policy_lag: 1000, ..HyperParams::default() };
    SpecBuilder::cartpole(T).run("memory").torso(vec![16]).hyper(hyper).seed(5).build()
}

fn segment(spec: &RunSpec, actor: &str, idx: u64) -> TrajectorySegment {
    TrajectorySegment { incarnation: idx, ..common::ended_episode_segment(spec, actor, idx, 8.0, 8) }
}

/// Resident set size of this process, from /proc (None where there is no /proc).
fn rss_bytes() -> Option<u64> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let line = status.lines().find(|line| line.starts_with("VmRSS:"))?;
    let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kib * 1024)
}

#[test]
fn hostile_ids_and_keys_do_not_grow_the_learner() {
    // The duplicate filter, the one table keyed by actor-chosen ids of every segment: its
    // accounted bytes stay within its stated bound whatever the ids, and whatever their number
    // (each segment here claims a stream of its own: a new incarnation).
    // (The longest actor id that decodes: `ActorId` bounds it; longer ones are `bad_id`.)
    let mut seen = SeenSegments::new(SEEN_STREAMS);
    let long_id = "x".repeat(64);
    let run_spec = spec();
    for idx in 0..250_000u64 {
        let mut s = segment(&run_spec, &long_id, idx);
        s.observations = Observations::F32(Vec::new());
        assert!(seen.insert(&s));
        assert!(seen.len() <= SEEN_STREAMS);
    }
    // Full to its bound: a whole generation of the newest streams and part of the next.
    assert!(seen.len() > SEEN_STREAMS / 2, "{} streams remembered", seen.len());
    assert!(
        seen.allocated_bytes() <= SeenSegments::max_bytes(SEEN_STREAMS),
        "{} bytes > {}",
        seen.allocated_bytes(),
        SeenSegments::max_bytes(SEEN_STREAMS)
    );
    assert!(SeenSegments::max_bytes(SEEN_STREAMS) < 16 << 20, "the bound itself is small");
    drop(seen);

    // The learner loop, fed hostile segments one at a time (so the input never piles up):
    // 1 MiB saved-snapshot keys, start keys and episode start keys, between honest segments.
    // (A 1 MiB actor id no longer decodes: `wire::DecodeError::BadId`, tested in core.)
    let mut learner = Learner::new(spec()).expect("valid spec");
    let spec = learner.spec().clone();
    let (mut sink, mut source) = trajectory_channel(2);
    let (mut publisher, _follower) = weights_channel();
    let Some(before) = rss_bytes() else {
        eprintln!("skipping the resident-set check: no /proc/self/status");
        return;
    };
    let producer = thread::spawn(move || {
        for idx in 0..600u64 {
            let huge = || "a".repeat(HOSTILE_ID_BYTES);
            let mut hostile = segment(&spec, "actor-h", 10_000 + idx);
            match idx % 3 {
                0 => {
                    hostile.saved_snapshots = vec![SnapshotInfo {
                        key: huge(),
                        task_id: 0,
                        progress: 0.0,
                        episode_return: 1.0,
                        episode_len: 1,
                    }]
                }
                1 => hostile.start_snapshot = Some(huge()),
                _ => hostile.finished_episodes[0].start = Some(huge()),
            }
            let honest = segment(&spec, "honest", idx);
            if sink.publish(vec![hostile, honest]).is_err() {
                return;
            }
        }
    });
    let limits = RunLimits { publish_every: 1, ..RunLimits::default() };
    let no_control = &mut |_: &mut Learner, _: &LearnerReport, _: &UpdateStats| {};
    let report = common::run_to_end(&mut learner, &mut source, &mut publisher, &limits, no_control);
    producer.join().expect("producer");
    let after = rss_bytes().expect("readable before, readable after");
    assert_eq!(report.stop_reason, Some(StopReason::SourceClosed));
    assert_eq!(report.segments_rejected.get("bad_id"), Some(&600), "{:?}", report.segments_rejected);
    assert!(report.updates >= 600 / 4 - 1, "training carried on: {} updates", report.updates);
    let growth = after.saturating_sub(before);
    eprintln!("resident set: {before} bytes before, {after} after, growth {growth}");
    assert!(growth <= MAX_RSS_GROWTH_BYTES, "resident set grew by {growth} bytes (bound {MAX_RSS_GROWTH_BYTES})");
}
