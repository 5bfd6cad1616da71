//! Issue 12 over the learner loop (docs/SECURITY.md): forged segments from an actor with valid
//! credentials cannot stop the run as solved, move the reported returns without bound, be
//! trained on with absurd rewards, or pass as lag 0 with a future version. Every rejection is
//! counted under its reason, and training carries on with the honest data.

use std::sync::atomic::AtomicBool;

use volley_core::ids::PolicyVersion;
use volley_core::spec::{HyperParams, LossKind, RunSpec};
use volley_core::wire::{EpisodeSummary, TrajectorySegment};
use volley_learner::{run_learner, Learner, LearnerReport, RunLimits, StopReason, UpdateStats};
use volley_testkit::fixtures::{SegmentBuilder, SpecBuilder};
use volley_transport::local::{trajectory_channel, weights_channel};
use volley_transport::TrajectorySink;

const T: usize = 8;
const B: usize = 4;

fn spec() -> RunSpec {
    let hyper =
        HyperParams { loss: LossKind::Vtrace, batch_segments: B, max_policy_lag: 100, ..HyperParams::default() };
    SpecBuilder::cartpole(T).run("trust").torso(vec![16]).hyper(hyper).seed(5).build()
}

/// A CartPole segment whose one episode ends at the last step with `episode_return` over
/// `episode_len` steps (the steps before the segment are the actor's claim).
fn segment(learner: &Learner, actor: &str, idx: u64, episode_return: f32, episode_len: u32) -> TrajectorySegment {
    SegmentBuilder::for_spec(learner.spec())
        .actor(actor)
        .episode_id(idx)
        .segment_idx(idx)
        .observations_from(|i| (i as f32 * 0.37).sin() * 0.1)
        .actions((0..T).map(|t| (t % 2) as u32).collect())
        .terminal_at(T - 1)
        .episode(episode_return, episode_len)
        .build()
}

fn run(learner: &mut Learner, segments: Vec<TrajectorySegment>, limits: RunLimits) -> (LearnerReport, Vec<f32>) {
    let (mut sink, mut source) = trajectory_channel(segments.len());
    sink.publish(segments).expect("room for every segment");
    drop(sink);
    let (mut publisher, _follower) = weights_channel();
    let mut grad_norms = Vec::new();
    let report = run_learner(
        learner,
        &mut source,
        &mut publisher,
        &limits,
        &AtomicBool::new(false),
        &mut |_: &mut Learner, _: &LearnerReport, stats: &UpdateStats| {
            assert!(stats.loss.total.is_finite(), "loss {}", stats.loss.total);
            grad_norms.push(stats.grad_norm);
        },
    )
    .expect("learner loop");
    (report, grad_norms)
}

/// Issue 12: one segment whose summary claimed a return of 1e30 stopped the learner as solved;
/// 20,000 fake episodes in one segment set the mean return; a reward of 1e30 was trained on
/// (gradient norm 1.2e28, loss inf); future versions (+1000, 2^63, 2^64 − 1) were used as lag
/// 0 and counted nowhere.
#[test]
fn forged_segments_are_rejected_by_reason_and_cannot_stop_the_run() {
    let mut learner = Learner::new(spec()).expect("valid spec");
    let mut segments = Vec::new();
    // The honest actor: 120 episodes of return 20 (8 steps here, 12 before).
    for idx in 0..120 {
        segments.push(segment(&learner, "honest", idx, 20.0, 20));
    }
    let mut huge_return = segment(&learner, "attacker", 1, 1e30, 20);
    huge_return.finished_episodes[0].episode_len = 500;
    let mut many_episodes = segment(&learner, "attacker", 2, 1.0, 8);
    many_episodes.finished_episodes =
        vec![EpisodeSummary { episode_return: 1.0, episode_len: 1, ..EpisodeSummary::default() }; 20_000];
    let mut huge_reward = segment(&learner, "attacker", 3, 8.0, 8);
    huge_reward.rewards[2] = 1e30;
    let mut future = Vec::new();
    for (k, version) in [1000, 1 << 63, u64::MAX].into_iter().enumerate() {
        let mut s = segment(&learner, "attacker", 10 + k as u64, 8.0, 8);
        s.policy_version = PolicyVersion(version);
        future.push(s);
    }
    // Interleave the forgeries early, so they arrive before the window is full.
    let mut all: Vec<TrajectorySegment> = vec![huge_return, many_episodes, huge_reward];
    all.extend(future);
    all.extend(segments);

    let limits = RunLimits { target_return: Some(100.0), publish_every: 1, ..RunLimits::default() };
    let (report, grad_norms) = run(&mut learner, all, limits);
    assert_eq!(report.stop_reason, Some(StopReason::SourceClosed), "not solved by forged returns");
    let rejected = &report.segments_rejected;
    assert_eq!(rejected.get("episode_summary"), Some(&2), "{rejected:?}");
    assert_eq!(rejected.get("reward_bound"), Some(&1), "{rejected:?}");
    assert_eq!(rejected.get("future_version"), Some(&3), "{rejected:?}");
    assert_eq!(report.lag_histogram.iter().sum::<u64>(), 120, "only admitted segments have a lag");
    assert_eq!(report.episodes, 120, "only admitted episodes count");
    assert_eq!(report.mean_return(100), 20.0, "the mean is the honest actor's");
    assert!(report.updates >= 120 / B as u64 - 1, "training carried on: {} updates", report.updates);
    assert!(grad_norms.iter().all(|g| g.is_finite() && *g < 1e6), "gradient norms {grad_norms:?}");
}

/// With `trust.max_actor_return_share = 0.5` one actor id holds at most half the return
/// window: alone, it can never fill the window the solved stop needs, and its claims (even
/// the largest the bounds allow, 500 per CartPole episode) move the windowed mean by at most
/// half the return range.
#[test]
fn one_actor_moves_the_return_window_by_at_most_its_share() {
    let mut spec = spec();
    spec.hyper.trust.max_actor_return_share = 0.5;
    let mut learner = Learner::new(spec).expect("valid spec");
    let mut segments = Vec::new();
    for idx in 0..300 {
        // The largest claim admission allows: 8 steps here, 492 before, 1 per step.
        segments.push(segment(&learner, "attacker", idx, 500.0, 500));
    }
    for idx in 0..30 {
        segments.push(segment(&learner, "honest", idx, 8.0, 8));
    }
    let limits = RunLimits { target_return: Some(100.0), publish_every: 1, ..RunLimits::default() };
    let (report, _) = run(&mut learner, segments, limits);
    assert_eq!(report.stop_reason, Some(StopReason::SourceClosed), "one actor cannot solve the run");
    assert_eq!(report.episodes, 330);
    assert_eq!(report.recent_returns.len(), 80, "50 from the attacker, 30 honest");
    let attacker_share = report.recent_returns.iter().filter(|&&r| r == 500.0).count();
    assert_eq!(attacker_share, 50);
}
