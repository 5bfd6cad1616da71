//! The learner loop over the in-process bus: bad segments are counted and dropped, stale ones
//! are dropped by lag, trajectory selection drops and counts by reason, and training carries on
//! with the valid data.

mod common;

use std::collections::{HashMap, HashSet};
use std::time::Duration;

use rand::{Rng, SeedableRng};
use rand_pcg::Pcg64Mcg;
use volley_core::ids::{PolicyVersion, RunId};
use volley_core::spec::{GuardConfig, HyperParams, LossKind, PriorityConfig, RunSpec, ZeroVarianceConfig};
use volley_core::wire::{EpisodeSummary, TrajectorySegment};
use volley_env::{EnvConfig, RemoteEnvConfig};
use volley_learner::{Learner, LearnerMetrics, LearnerReport, RunLimits, StopReason, UpdateStats};
use volley_testkit::fixtures::{SegmentBuilder, SpecBuilder};
use volley_transport::envsvc::EnvServiceName;
use volley_transport::local::{trajectory_channel, weights_channel, LocalTrajectorySource};
use volley_transport::{Delivery, DeliveryToken, TrajectorySink, TrajectorySource, TransportError, WeightsFollower};

const T: usize = 8;
const B: usize = 4;

fn spec(loss: LossKind, max_policy_lag: u64) -> RunSpec {
    let hyper = HyperParams { loss, batch_segments: B, max_policy_lag, ppo_minibatches: 2, ..HyperParams::default() };
    SpecBuilder::cartpole(T).run("loop").torso(vec![16]).hyper(hyper).seed(3).build()
}

/// A fresh learner's parameters at policy version `version` (after as many updates), so
/// segments of older versions arrive that far behind.
fn learner_at(spec: RunSpec, version: u64) -> Learner {
    let params = Learner::new(spec.clone()).expect("valid spec").params().to_vec();
    Learner::with_state(spec, params, PolicyVersion(version), version).expect("valid state")
}

/// Segment `idx` of environment `idx / 1000`: each environment's segments carry a run of
/// consecutive indices, as an actor counts them per environment (the duplicate filter keeps a
/// window of indices per environment).
fn valid_segment(learner: &Learner, rng: &mut Pcg64Mcg, version: u64, idx: u64) -> TrajectorySegment {
    SegmentBuilder::for_spec(learner.spec())
        .env_idx((idx / 1000) as u32)
        .episode_id(idx)
        .segment_idx(idx)
        .version(version)
        .observations_from(|_| rng.random_range(-0.1..0.1))
        .actions((0..T).map(|_| rng.random_range(0..2)).collect())
        .terminal_at(T - 1)
        .episode(T as f32, T as u32)
        .build()
}

fn run(learner: &mut Learner, segments: Vec<TrajectorySegment>, max_updates: u64) -> (LearnerReport, u64) {
    let (mut sink, mut source) = trajectory_channel(segments.len());
    sink.publish(segments).expect("room for every segment");
    drop(sink);
    let (mut publisher, mut follower) = weights_channel();
    let limits = RunLimits { max_updates: Some(max_updates), publish_every: 1, ..RunLimits::default() };
    let mut losses = Vec::new();
    let record = &mut |_: &mut Learner, _: &LearnerReport, stats: &UpdateStats| losses.push(stats.loss.total);
    let report = common::run_to_end(learner, &mut source, &mut publisher, &limits, record);
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
            1 => bad.run = RunId::new("another-run").expect("valid run id"),
            2 => {
                bad.observations.as_f32_mut().expect("f32 observations").pop();
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
    let mut learner = learner_at(spec(LossKind::Ppo, 2), 10);
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

/// `final_ent_coef` decays the entropy bonus linearly on the learning rate's ramp: each update's
/// total loss is `policy + value_coef · value − ent_coef · entropy` with that update's
/// coefficient (0.4, 0.3, 0.2, 0.1, then 0 from the fourth update on).
#[test]
fn the_entropy_bonus_decays_on_the_learning_rate_ramp() {
    let hyper = HyperParams {
        loss: LossKind::Vtrace,
        batch_segments: B,
        ent_coef: 0.4,
        final_ent_coef: Some(0.0),
        learning_rate: 1e-3,
        final_learning_rate: 0.0,
        lr_decay_updates: 4,
        ..HyperParams::default()
    };
    let spec = SpecBuilder::cartpole(T).run("entropy").torso(vec![16]).hyper(hyper).seed(3).build();
    let mut learner = Learner::new(spec).expect("valid spec");
    let mut rng = Pcg64Mcg::seed_from_u64(2);
    let segments: Vec<_> = (0..6 * B as u64).map(|i| valid_segment(&learner, &mut rng, 0, i)).collect();
    let (mut sink, mut source) = trajectory_channel(segments.len());
    sink.publish(segments).expect("room for every segment");
    drop(sink);
    let (mut publisher, _follower) = weights_channel();
    let limits = RunLimits { max_updates: Some(6), publish_every: 1, ..RunLimits::default() };
    let mut coefficients = Vec::new();
    let record = &mut |_: &mut Learner, _: &LearnerReport, stats: &UpdateStats| {
        let loss = &stats.loss;
        coefficients.push((loss.policy + 0.5 * loss.value - loss.total) / loss.entropy);
    };
    common::run_to_end(&mut learner, &mut source, &mut publisher, &limits, record);
    let expected = [0.4, 0.3, 0.2, 0.1, 0.0, 0.0];
    assert_eq!(coefficients.len(), expected.len());
    for (update, (got, want)) in coefficients.iter().zip(expected).enumerate() {
        assert!((got - want).abs() < 1e-3, "update {update}: entropy coefficient {got}, expected {want}");
    }
}

/// The in-process source, recording every token delivered, acknowledged and rejected, so the
/// acknowledgement invariant can be checked at the loop level.
struct RecordingSource {
    inner: LocalTrajectorySource,
    delivered: Vec<u64>,
    acked: Vec<u64>,
    rejected: Vec<u64>,
}

impl TrajectorySource for RecordingSource {
    fn recv(&mut self, max: usize, timeout: Duration, out: &mut Vec<Delivery>) -> Result<usize, TransportError> {
        let start = out.len();
        let n = self.inner.recv(max, timeout, out)?;
        self.delivered.extend(out[start..].iter().map(|d| d.token.0));
        Ok(n)
    }

    fn ack(&mut self, tokens: &[DeliveryToken]) -> Result<(), TransportError> {
        self.acked.extend(tokens.iter().map(|t| t.0));
        self.inner.ack(tokens)
    }

    fn reject(&mut self, token: DeliveryToken) -> Result<(), TransportError> {
        self.rejected.push(token.0);
        self.inner.reject(token)
    }

    fn backlog(&self) -> Option<u64> {
        self.inner.backlog()
    }
}

#[test]
fn selection_drops_are_counted_by_reason_while_training_continues() {
    let mut selection_spec = spec(LossKind::Vtrace, 100);
    // An environment with a wide declared reward bound and no time limit, so segments the
    // guard drops (|r| = 1e4 > 100) pass admission (docs/SECURITY.md) and reach selection.
    selection_spec.env = EnvConfig::Remote(RemoteEnvConfig {
        max_abs_reward: Some(1e4),
        ..RemoteEnvConfig::new(EnvServiceName::new("loop").expect("valid service name"), 4, 2)
    });
    selection_spec.hyper.selection.guard = GuardConfig { enabled: true, max_abs_reward: Some(100.0) };
    selection_spec.hyper.selection.zero_variance = Some(ZeroVarianceConfig { min_group: 2, tolerance: 0.0 });
    selection_spec.hyper.selection.priority = Some(PriorityConfig { pool_factor: 2, ..PriorityConfig::default() });
    let template = Learner::new(selection_spec.clone()).expect("valid spec");
    let params = template.layout().init_params(selection_spec.seed);
    // Start at version 200, so segments of version 50 are beyond the lag bound of 100 and the
    // valid ones (version 200) never age out during the few updates of this test.
    let mut learner = Learner::with_state(selection_spec, params, PolicyVersion(200), 200).expect("valid state");
    let mut rng = Pcg64Mcg::seed_from_u64(11);
    const VALID: u64 = 24;
    let mut segments = Vec::new();
    for idx in 0..VALID {
        let mut good = valid_segment(&learner, &mut rng, 200, idx);
        good.start_snapshot = Some("varied".into());
        // Returns differ (a signal); the episodes began long before the segment, so its own
        // rewards need not add up to them.
        good.finished_episodes[0].episode_return = idx as f32;
        good.finished_episodes[0].episode_len = 1000;
        segments.push(good);
        if idx % 8 == 0 {
            let mut absurd = valid_segment(&learner, &mut rng, 200, 1000 + idx);
            absurd.rewards[3] = 1e4;
            absurd.finished_episodes[0].episode_len = 1000;
            // Validation rejects a non-finite return (as every non-finite float in a segment,
            // issue 46) before selection sees it.
            let mut infinite = valid_segment(&learner, &mut rng, 200, 2000 + idx);
            infinite.finished_episodes[0].episode_return = f32::INFINITY;
            // Two rollouts with the same return 4: one that began 4 steps before the segment
            // and earned nothing then, and a fresh one of the last 4 steps.
            let mut flat = valid_segment(&learner, &mut rng, 200, 3000 + idx);
            flat.start_snapshot = Some("flat".into());
            flat.terminated[3] = 1;
            flat.finished_episodes = vec![
                EpisodeSummary { episode_return: 4.0, episode_len: 8, ..EpisodeSummary::default() },
                EpisodeSummary { episode_return: 4.0, episode_len: 4, ..EpisodeSummary::default() },
            ];
            let stale = valid_segment(&learner, &mut rng, 50, 4000 + idx);
            segments.extend([absurd, infinite, flat, stale]);
        }
        if idx % 12 == 5 {
            segments.push(segments[segments.len() - 2].clone()); // a redelivery
        }
    }
    let total = segments.len() as u64;
    let (mut sink, inner) = trajectory_channel(segments.len());
    sink.publish(segments).expect("room for every segment");
    drop(sink);
    let mut source = RecordingSource { inner, delivered: Vec::new(), acked: Vec::new(), rejected: Vec::new() };
    let (mut publisher, _follower) = weights_channel();
    let registry = prometheus::Registry::new();
    let mut metrics = LearnerMetrics::register(&registry).expect("metrics register");
    let mut last_observed = LearnerReport::default();
    let mut losses = Vec::new();
    let limits = RunLimits { publish_every: 1, ..RunLimits::default() };
    let report = common::run_to_end(
        &mut learner,
        &mut source,
        &mut publisher,
        &limits,
        &mut |learner: &mut Learner, report: &LearnerReport, stats: &UpdateStats| {
            losses.push(stats.loss.total);
            metrics.observe(learner, report, stats, true);
            last_observed = report.clone();
        },
    );
    assert_eq!(report.stop_reason, Some(StopReason::SourceClosed));
    assert!(losses.iter().all(|l| l.is_finite()), "losses stay finite: {losses:?}");

    // Every drop is counted by its reason.
    assert_eq!(report.segments_out_of_range, 3);
    assert_eq!(report.segments_non_finite, 0);
    assert_eq!(report.segments_zero_variance, 3);
    assert_eq!(report.segments_stale, 3);
    assert_eq!(report.segments_duplicate, 2);
    assert_eq!(report.segments_rejected, HashMap::from([("non_finite", 3)]));
    // Training continued on the valid segments: each update used at least one new segment, and
    // what is left is less than a pool (the loop stops when the closed source cannot refill it).
    assert!(report.pool_segments < 8, "pool left: {}", report.pool_segments);
    assert_eq!(report.segments_used + report.pool_segments, VALID);
    let updates = report.updates - 200;
    assert!(updates >= (VALID - 7) / 4, "updates: {updates}");
    assert!(updates <= report.segments_used, "updates: {updates}, used: {}", report.segments_used);

    // Acknowledgement invariant: every delivered segment is acknowledged at most once, and
    // exactly the ones still in the pool are not acknowledged.
    assert_eq!(source.delivered.len() as u64, total);
    let acked: HashSet<u64> = source.acked.iter().copied().collect();
    assert_eq!(acked.len(), source.acked.len(), "no segment is acknowledged twice");
    assert_eq!(source.rejected.len(), 3);
    let dropped: u64 = report.segments_dropped().iter().map(|(_, n)| n).sum();
    assert_eq!(acked.len() as u64, report.segments_used + dropped + report.segments_duplicate);
    assert_eq!(total - acked.len() as u64 - 3, report.pool_segments);

    // The Prometheus counters agree with the report as of the last update.
    let families = registry.gather();
    let segments_total =
        families.iter().find(|f| f.name() == "volley_learner_segments_total").expect("segments counter exported");
    for (reason, count) in last_observed.segments_dropped() {
        let metric = segments_total
            .get_metric()
            .iter()
            .find(|m| m.get_label().iter().any(|l| l.value() == reason.as_str()))
            .unwrap_or_else(|| panic!("outcome {} exported", reason.as_str()));
        assert_eq!(metric.get_counter().get_value() as u64, count, "outcome {}", reason.as_str());
    }
}

/// Counts the loop's callbacks and keeps the last report seen by `on_tick`.
#[derive(Default)]
struct Ticks {
    updates: u64,
    ticks: u64,
    last: Option<LearnerReport>,
}

impl volley_learner::LearnerControl for Ticks {
    fn on_update(&mut self, _: &mut Learner, _: &LearnerReport, _: &UpdateStats) {
        self.updates += 1;
    }

    fn on_tick(&mut self, _: &Learner, report: &LearnerReport) {
        self.ticks += 1;
        self.last = Some(report.clone());
    }
}

/// A stalled learner: data arrives but every segment is too stale to use, so no update
/// follows. The loop still ticks on every pass (signals stay live) and never marks progress,
/// not even on the empty passes after the data ran out (once data came, only an update counts).
#[test]
fn a_learner_fed_only_stale_data_ticks_but_makes_no_progress() {
    let mut learner = learner_at(spec(LossKind::Vtrace, 2), 50);
    let mut rng = Pcg64Mcg::seed_from_u64(5);
    let n = 40 * B as u64;
    let segments: Vec<_> = (0..n).map(|idx| valid_segment(&learner, &mut rng, 1, idx)).collect();
    let (mut sink, mut source) = trajectory_channel(segments.len());
    sink.publish(segments).expect("room for every segment");
    let (mut publisher, _follower) = weights_channel();
    let limits = RunLimits { max_duration: Some(Duration::from_millis(500)), publish_every: 1, ..RunLimits::default() };
    let mut ticks = Ticks::default();
    let report = common::run_to_end(&mut learner, &mut source, &mut publisher, &limits, &mut ticks);
    drop(sink);
    assert_eq!(report.stop_reason, Some(StopReason::TimeBudget));
    assert_eq!((report.updates, ticks.updates), (0, 0));
    assert_eq!(report.segments_received, n);
    assert_eq!(report.segments_stale, n);
    assert!(ticks.ticks > n / B as u64, "a tick per pass, empty ones too: {} ticks for {n} segments", ticks.ticks);
    assert!(report.wait_time > Duration::from_millis(100), "empty passes followed: {:?}", report.wait_time);
    assert_eq!(report.progress_at, Duration::ZERO, "data came and no update followed: no progress");
    let last = ticks.last.expect("ticked");
    assert_eq!(last.segments_stale, report.segments_stale, "ticks see the counts as they grow");
}

/// A starving learner (no actors): every pass finds nothing, which is progress (waiting is not
/// the learner's fault), and the wait time reaches the ticks although no update happens.
#[test]
fn a_starving_learner_ticks_counts_its_wait_and_makes_progress() {
    let mut learner = Learner::new(spec(LossKind::Vtrace, 2)).expect("valid spec");
    let (_sink, mut source) = trajectory_channel(8);
    let (mut publisher, _follower) = weights_channel();
    let limits = RunLimits { max_duration: Some(Duration::from_millis(350)), publish_every: 1, ..RunLimits::default() };
    let mut ticks = Ticks::default();
    let report = common::run_to_end(&mut learner, &mut source, &mut publisher, &limits, &mut ticks);
    assert_eq!(report.stop_reason, Some(StopReason::TimeBudget));
    assert_eq!(report.updates, 0);
    assert!(ticks.ticks >= 2, "{} ticks", ticks.ticks);
    let last = ticks.last.expect("ticked");
    assert!(last.wait_time > Duration::ZERO, "the wait reaches on_tick: {:?}", last.wait_time);
    assert!(last.progress_at > Duration::ZERO && last.progress_at <= last.elapsed);
}
