//! Issue 12 over the learner loop (docs/SECURITY.md): forged segments from an actor with valid
//! credentials cannot stop the run as solved, move the reported returns without bound, be
//! trained on with absurd rewards, or pass as lag 0 with a future version. Every rejection is
//! counted under its reason, and training carries on with the honest data.

mod common;

use volley_core::ids::PolicyVersion;
use volley_core::spec::{HyperParams, LossKind, RunSpec};
use volley_core::wire::{EpisodeSummary, TrajectorySegment};
use volley_learner::{Learner, LearnerReport, RunLimits, StopReason, UpdateStats};
use volley_testkit::fixtures::SpecBuilder;
use volley_transport::local::{trajectory_channel, weights_channel};
use volley_transport::TrajectorySink;

const T: usize = 8;
const B: usize = 4;

fn spec() -> RunSpec {
    let hyper =
        HyperParams { loss: LossKind::Vtrace, batch_segments: B, max_policy_lag: 100, ..HyperParams::default() };
    SpecBuilder::cartpole(T).run("trust").torso(vec![16]).hyper(hyper).seed(5).build()
}

fn segment(learner: &Learner, actor: &str, idx: u64, episode_return: f32, episode_len: u32) -> TrajectorySegment {
    common::ended_episode_segment(learner.spec(), actor, idx, episode_return, episode_len)
}

/// Serialises the learner loops of this file: one test captures the log through a scoped
/// subscriber, and a loop on another thread registering the same log call sites meanwhile can
/// leave them cached as disabled for it.
static LOOPS: std::sync::Mutex<()> = std::sync::Mutex::new(());

fn one_loop_at_a_time() -> std::sync::MutexGuard<'static, ()> {
    LOOPS.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

fn run(learner: &mut Learner, segments: Vec<TrajectorySegment>, limits: RunLimits) -> (LearnerReport, Vec<f32>) {
    let _one = one_loop_at_a_time();
    run_alone(learner, segments, limits)
}

fn run_alone(learner: &mut Learner, segments: Vec<TrajectorySegment>, limits: RunLimits) -> (LearnerReport, Vec<f32>) {
    let (mut sink, mut source) = trajectory_channel(segments.len());
    sink.publish(segments).expect("room for every segment");
    drop(sink);
    let (mut publisher, _follower) = weights_channel();
    let mut grad_norms = Vec::new();
    let report = common::run_to_end(
        learner,
        &mut source,
        &mut publisher,
        &limits,
        &mut |_: &mut Learner, _: &LearnerReport, stats: &UpdateStats| {
            assert!(stats.loss.total.is_finite(), "loss {}", stats.loss.total);
            grad_norms.push(stats.grad_norm);
        },
    );
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

// Issue 46: no message crashes the learner, and rejections are logged at a bounded rate.

const H: usize = 8;

fn gru_spec() -> RunSpec {
    let hyper =
        HyperParams { loss: LossKind::Vtrace, batch_segments: B, max_policy_lag: 100, ..HyperParams::default() };
    SpecBuilder::cartpole(T)
        .run("trust")
        .torso(vec![16])
        .core(volley_policy::CoreKind::Gru { hidden: H })
        .hyper(hyper)
        .seed(5)
        .build()
}

/// A GRU segment with an episode ending at step 3 and another at the last step, so a state
/// may be restored at step 4.
fn gru_segment(learner: &Learner, actor: &str, idx: u64) -> TrajectorySegment {
    let mut segment = segment(learner, actor, idx, 8.0, 8);
    segment.terminated[3] = 1;
    segment.finished_episodes.clear();
    segment
}

/// Issue 46: a GRU learner panicked in the sampler's assert ("logits must hold at least one
/// finite value") on one segment whose `initial_hidden` or `restored_states` was 3e38 (finite).
/// Both are refused as `out_of_bounds` and counted; training carries on with honest segments.
#[test]
fn a_gru_learner_refuses_recurrent_states_of_3e38_and_trains_on() {
    let mut learner = Learner::new(gru_spec()).expect("valid spec");
    let mut segments: Vec<_> = (0..40).map(|idx| gru_segment(&learner, "honest", idx)).collect();
    let mut initial = gru_segment(&learner, "attacker", 1);
    initial.initial_hidden = vec![3e38; H];
    let mut restored = gru_segment(&learner, "attacker", 2);
    restored.restored_states = vec![volley_core::wire::RestoredState { step: 4, hidden: vec![3e38; H] }];
    segments.insert(3, initial);
    segments.insert(9, restored);
    let (report, grad_norms) = run(&mut learner, segments, RunLimits { publish_every: 1, ..RunLimits::default() });
    assert_eq!(report.segments_rejected.get("out_of_bounds"), Some(&2), "{:?}", report.segments_rejected);
    assert_eq!(report.segments_received, 40);
    assert!(report.updates >= 9, "{} updates", report.updates);
    assert!(grad_norms.iter().all(|g| g.is_finite()), "{grad_norms:?}");
}

/// Defence in depth behind decode (issue 46): an update on states that were never validated
/// (3e38) does not panic; a step whose gradient is not finite is skipped, and the parameters
/// stay finite. Before, `log_softmax` asserted and the learner process died.
#[test]
fn an_update_on_unvalidated_states_of_3e38_skips_the_step_instead_of_panicking() {
    for core in [volley_policy::CoreKind::Gru { hidden: H }, volley_policy::CoreKind::Mlp] {
        let mut spec = gru_spec();
        spec.policy.core = core;
        let mut learner = Learner::new(spec).expect("valid spec");
        let hidden = learner.layout().recurrent_size();
        let mut segments: Vec<_> = (0..B as u64).map(|idx| gru_segment(&learner, "a", idx)).collect();
        for segment in &mut segments {
            segment.initial_hidden = vec![0.0; hidden];
        }
        segments[0].initial_hidden = vec![3e38; hidden];
        segments[1].observations.as_f32_mut().expect("f32 observations").fill(3e38);
        segments[2].rewards[1] = 3e38;
        let batch = volley_learner::batch::SegmentBatch::from_segments(&segments, 0.99, 1.0, &[1.0; B]);
        let _stats = learner.update(&batch);
        assert!(learner.params().iter().all(|p| p.is_finite()), "{core:?}: parameters stayed finite");
    }
}

/// Issue 46, bounded logs: rejected parts were logged one by one (9.6 times the bytes of the
/// hostile traffic). 3,000 rejected segments of two reasons log the first few of each, and
/// every one is still counted.
#[test]
fn a_flood_of_rejected_segments_logs_a_bounded_number_of_lines() {
    let mut learner = Learner::new(spec()).expect("valid spec");
    let mut segments = Vec::new();
    for idx in 0..3_000 {
        let mut bad = segment(&learner, "attacker", idx, 8.0, 8);
        if idx % 2 == 0 {
            bad.rewards[1] = f32::NAN;
        } else {
            bad.policy_version = PolicyVersion(1 << 40);
        }
        segments.push(bad);
    }
    for idx in 0..8 {
        segments.push(segment(&learner, "honest", idx, 8.0, 8));
    }
    let _one = one_loop_at_a_time();
    let (report, lines) = volley_testkit::logs::capture_logs(|| {
        run_alone(&mut learner, segments, RunLimits { publish_every: 1, ..RunLimits::default() }).0
    });
    assert_eq!(report.segments_rejected.get("non_finite"), Some(&1_500));
    assert_eq!(report.segments_rejected.get("future_version"), Some(&1_500));
    let rejected_lines = lines.iter().filter(|line| line.contains("segment rejected")).count();
    let first = volley_transport::rejection_log::DEFAULT_FIRST_PER_WINDOW as usize;
    // A window is 30 s: a slow machine may start a second one during the run.
    assert!(rejected_lines >= 2 * first && rejected_lines <= 2 * 2 * first, "{rejected_lines} lines:\n{lines:#?}");
    assert!(lines.len() < 100, "{} lines in all", lines.len());
}

/// Float values as they may come off the bus: any bit pattern, and the awkward ones.
fn any_float() -> impl proptest::strategy::Strategy<Value = f32> {
    use proptest::prelude::*;
    prop_oneof![
        proptest::num::f32::ANY,
        proptest::sample::select(vec![f32::NAN, f32::INFINITY, f32::NEG_INFINITY, 3e38, -3e38, 1e19, 1e10, -0.0]),
    ]
}

proptest::proptest! {
    #![proptest_config(proptest::prelude::ProptestConfig { cases: 48, ..Default::default() })]
    /// Issue 46: random finite and non-finite values in any float field of a segment
    /// (observations, rewards, behaviour log-probabilities, truncation values, the initial and
    /// restored recurrent states, episode returns) never panic a learner, MLP or GRU: the
    /// segment is refused and counted, or trained on, and the parameters stay finite.
    #[test]
    fn no_float_in_a_segment_panics_a_learner(
        recurrent in proptest::bool::ANY,
        field in 0..7usize,
        values in proptest::collection::vec(any_float(), 1..6),
        at in proptest::collection::vec(proptest::num::usize::ANY, 6),
    ) {
        let mut spec = gru_spec();
        if !recurrent {
            spec.policy.core = volley_policy::CoreKind::Mlp;
        }
        let mut learner = Learner::new(spec).expect("valid spec");
        let hidden = learner.layout().recurrent_size();
        let mut segments: Vec<_> = (0..2 * B as u64).map(|idx| gru_segment(&learner, "a", idx)).collect();
        let forged = &mut segments[1];
        let put = |target: &mut Vec<f32>| {
            for (value, at) in values.iter().zip(&at) {
                if !target.is_empty() {
                    let len = target.len();
                    target[at % len] = *value;
                }
            }
        };
        match field {
            0 => put(forged.observations.as_f32_mut().expect("f32 observations")),
            1 => put(&mut forged.rewards),
            2 => put(&mut forged.behaviour_log_probs),
            3 => {
                forged.truncation_values = vec![0.0; T];
                put(&mut forged.truncation_values);
            }
            4 => put(&mut forged.initial_hidden),
            5 => {
                let mut state = vec![0.0; hidden];
                put(&mut state);
                forged.restored_states = vec![volley_core::wire::RestoredState { step: 4, hidden: state }];
            }
            _ => {
                forged.finished_episodes =
                    vec![EpisodeSummary { episode_return: values[0], episode_len: 4, ..EpisodeSummary::default() }];
            }
        }
        let _one = one_loop_at_a_time();
        let (mut sink, mut source) = trajectory_channel(segments.len());
        sink.publish(segments).expect("room for every segment");
        drop(sink);
        let (mut publisher, _follower) = weights_channel();
        let limits = RunLimits { publish_every: 1, ..RunLimits::default() };
        let no_control = &mut |_: &mut Learner, _: &LearnerReport, _: &UpdateStats| {};
        let report = common::run_to_end(&mut learner, &mut source, &mut publisher, &limits, no_control);
        proptest::prop_assert!(report.updates >= 1, "the honest segments are trained on");
        proptest::prop_assert!(learner.params().iter().all(|p| p.is_finite()));
    }
}
