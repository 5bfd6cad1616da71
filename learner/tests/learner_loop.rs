//! The learner loop over the in-process bus: bad segments are counted and dropped, stale ones
//! are dropped by lag, and training carries on with the valid data.

use std::sync::atomic::AtomicBool;

use rand::{Rng, SeedableRng};
use rand_pcg::Pcg64Mcg;
use volley_core::env::EnvConfig;
use volley_core::ids::{PolicyVersion, RunId};
use volley_core::policy::{Activation, CoreKind, PolicySpec};
use volley_core::spec::{HyperParams, LossKind, RunSpec};
use volley_core::transport::local::{trajectory_channel, weights_channel};
use volley_core::transport::{TrajectorySink, WeightsFollower};
use volley_core::wire::{EpisodeSummary, TrajectorySegment};
use volley_learner::{run_learner, Learner, LearnerReport, RunLimits, StopReason, UpdateStats};

const T: usize = 8;
const B: usize = 4;

fn spec(loss: LossKind, max_policy_lag: u64) -> RunSpec {
    RunSpec {
        run: RunId::new("loop").expect("valid run id"),
        env: EnvConfig::Cartpole,
        policy: PolicySpec {
            obs_dim: 4,
            n_actions: 2,
            torso: vec![16],
            activation: Activation::Tanh,
            core: CoreKind::Mlp,
        },
        segment_len: T,
        hyper: HyperParams { loss, batch_segments: B, max_policy_lag, ppo_minibatches: 2, ..HyperParams::default() },
        seed: 3,
    }
}

fn valid_segment(learner: &Learner, rng: &mut Pcg64Mcg, version: u64, idx: u64) -> TrajectorySegment {
    TrajectorySegment {
        run: learner.spec().run.to_string(),
        actor: "actor-0".into(),
        incarnation: 0,
        env_idx: 0,
        episode_id: idx,
        segment_idx: idx,
        task_id: 0,
        start_snapshot: None,
        policy_version: PolicyVersion(version),
        layout_hash: learner.layout().hash(),
        obs_dim: 4,
        observations: (0..(T + 1) * 4).map(|_| rng.random_range(-0.1..0.1)).collect(),
        actions: (0..T).map(|_| rng.random_range(0..2)).collect(),
        rewards: vec![1.0; T],
        terminated: (0..T).map(|t| (t == T - 1) as u8).collect(),
        truncated: vec![0; T],
        behaviour_log_probs: vec![-std::f32::consts::LN_2; T],
        truncation_values: vec![0.0; T],
        initial_hidden: vec![],
        finished_episodes: vec![EpisodeSummary {
            episode_return: T as f32,
            episode_len: T as u32,
            ..EpisodeSummary::default()
        }],
        saved_snapshots: Vec::new(),
    }
}

fn run(learner: &mut Learner, segments: Vec<TrajectorySegment>, max_updates: u64) -> (LearnerReport, u64) {
    let (mut sink, mut source) = trajectory_channel(segments.len());
    sink.publish(segments).expect("room for every segment");
    drop(sink);
    let (mut publisher, mut follower) = weights_channel();
    let limits = RunLimits { max_updates: Some(max_updates), publish_every: 1, ..RunLimits::default() };
    let mut losses = Vec::new();
    let report = run_learner(
        learner,
        &mut source,
        &mut publisher,
        &limits,
        &AtomicBool::new(false),
        &mut |_: &mut Learner, _: &LearnerReport, stats: &UpdateStats| losses.push(stats.loss.total),
    )
    .expect("learner loop");
    assert!(losses.iter().all(|l| l.is_finite()), "losses must stay finite: {losses:?}");
    let published = follower.latest(None).expect("open").expect("weights published").version.0;
    (report, published)
}

#[test]
fn malformed_segments_are_counted_and_dropped_while_training_continues() {
    let mut learner = Learner::new(spec(LossKind::Vtrace, 100)).expect("valid spec");
    let mut rng = Pcg64Mcg::seed_from_u64(9);
    let mut segments = Vec::new();
    for idx in 0..(2 * B as u64) {
        let mut bad = valid_segment(&learner, &mut rng, 0, 100 + idx);
        match idx % 4 {
            0 => bad.rewards[2] = f32::NAN,
            1 => bad.run = "another-run".into(),
            2 => {
                bad.observations.pop();
            }
            _ => bad.actions[0] = 7,
        }
        segments.push(bad);
        segments.push(valid_segment(&learner, &mut rng, 0, idx));
    }
    let (report, published) = run(&mut learner, segments, 2);
    assert_eq!(report.updates, 2, "both batches of valid segments were trained on");
    assert_eq!(report.segments_used, 2 * B as u64);
    assert_eq!(published, 2, "every update was published");
    let rejected = &report.segments_rejected;
    assert_eq!(rejected.get("non_finite"), Some(&2));
    assert_eq!(rejected.get("mismatch"), Some(&2));
    assert_eq!(rejected.get("shape"), Some(&2));
    assert_eq!(rejected.get("action_out_of_range"), Some(&2));
    assert_eq!(report.episodes, 2 * B as u64, "only valid segments count episodes");
    assert_eq!(report.stop_reason, Some(StopReason::UpdateBudget));
}

#[test]
fn segments_beyond_max_policy_lag_are_dropped_and_counted() {
    let fresh_spec = spec(LossKind::Ppo, 2);
    let mut template = Learner::new(fresh_spec.clone()).expect("valid spec");
    let params = template.params().to_vec();
    let mut learner = Learner::with_state(fresh_spec, params, PolicyVersion(10), 10).expect("valid state");
    let mut rng = Pcg64Mcg::seed_from_u64(4);
    let mut segments = Vec::new();
    for idx in 0..B as u64 {
        segments.push(valid_segment(&learner, &mut rng, 3, idx)); // lag 7: too stale
        segments.push(valid_segment(&learner, &mut rng, 9, 50 + idx)); // lag 1: fine
    }
    let (report, _) = run(&mut learner, segments, 11);
    assert_eq!(report.updates, 11);
    assert_eq!(report.segments_stale, B as u64);
    assert_eq!(report.segments_used, B as u64);
    assert_eq!(report.lag_histogram[1], B as u64);
    assert_eq!(report.lag_histogram[7], B as u64);
    assert!(report.segments_rejected.is_empty());
}

#[test]
fn source_closing_ends_the_loop_cleanly() {
    let mut learner = Learner::new(spec(LossKind::Vtrace, 4)).expect("valid spec");
    let mut rng = Pcg64Mcg::seed_from_u64(5);
    let segments = (0..B as u64 + 1).map(|i| valid_segment(&learner, &mut rng, 0, i)).collect();
    let (report, _) = run(&mut learner, segments, 100);
    assert_eq!(report.stop_reason, Some(StopReason::SourceClosed));
    assert_eq!(report.updates, 1, "one full batch; the leftover segment stays unacknowledged");
}

#[test]
fn a_redelivered_segment_is_learned_from_once() {
    let mut learner = Learner::new(spec(LossKind::Vtrace, 4)).expect("valid spec");
    let mut rng = Pcg64Mcg::seed_from_u64(6);
    let mut segments: Vec<_> = (0..B as u64).map(|i| valid_segment(&learner, &mut rng, 0, i)).collect();
    segments.insert(1, segments[0].clone());
    segments.push(segments[2].clone());
    let (report, _) = run(&mut learner, segments, 100);
    assert_eq!(report.segments_duplicate, 2);
    assert_eq!(report.segments_used, B as u64);
    assert_eq!(report.episodes, B as u64, "duplicates do not count episodes twice");
}
