//! The learner's Prometheus metrics: the only place they are declared. Counters and gauges of
//! time and backlog follow the loop's [`LearnerReport`] on every pass ([`LearnerMetrics::tick`]);
//! the update's own statistics ([`UpdateStats`]) are recorded per update.

use std::time::Duration;

use prometheus::core::{Collector, MetricVec, MetricVecBuilder};
use prometheus::{Counter, Gauge, GaugeVec, Histogram, HistogramOpts, IntCounter, IntCounterVec, Opts, Registry};

use crate::ingest::admission::Rejection;
use crate::learner::{Learner, UpdateStats};
use crate::report::LearnerReport;
use crate::scheduler::{Scheduler, SchedulerObserver};
use crate::select::selection::DropReason;
use crate::select::windows::WindowOutcome;
use volley_core::wire::DecodeError;
use volley_transport::work::LeaseCounts;

/// Makes metrics and registers each as it is made, so that one expression names, documents and
/// registers a metric.
struct Registrar<'a>(&'a Registry);

impl Registrar<'_> {
    fn add<M: Collector + Clone + 'static>(&self, metric: prometheus::Result<M>) -> prometheus::Result<M> {
        let metric = metric?;
        self.0.register(Box::new(metric.clone()))?;
        Ok(metric)
    }

    fn int(&self, name: &str, help: &str) -> prometheus::Result<IntCounter> {
        self.add(IntCounter::with_opts(Opts::new(name, help)))
    }

    fn counter(&self, name: &str, help: &str) -> prometheus::Result<Counter> {
        self.add(Counter::with_opts(Opts::new(name, help)))
    }

    fn gauge(&self, name: &str, help: &str) -> prometheus::Result<Gauge> {
        self.add(Gauge::with_opts(Opts::new(name, help)))
    }

    fn histogram(&self, name: &str, help: &str, buckets: Vec<f64>) -> prometheus::Result<Histogram> {
        self.add(Histogram::with_opts(HistogramOpts::new(name, help).buckets(buckets)))
    }

    /// Counters by `label`, each of `values` created at 0 (so that it reads 0, not no data).
    fn ints(&self, name: &str, help: &str, label: &str, values: &[&str]) -> prometheus::Result<IntCounterVec> {
        self.labelled(IntCounterVec::new(Opts::new(name, help), &[label]), values)
    }

    /// Gauges by `label`, each of `values` created at 0.
    fn gauges(&self, name: &str, help: &str, label: &str, values: &[&str]) -> prometheus::Result<GaugeVec> {
        self.labelled(GaugeVec::new(Opts::new(name, help), &[label]), values)
    }

    fn labelled<T: MetricVecBuilder + 'static>(
        &self,
        metrics: prometheus::Result<MetricVec<T>>,
        values: &[&str],
    ) -> prometheus::Result<MetricVec<T>> {
        let metrics = self.add(metrics)?;
        for value in values {
            metrics.with_label_values(&[value]);
        }
        Ok(metrics)
    }
}

/// Handles to every learner metric.
pub struct LearnerMetrics {
    segments: IntCounterVec,
    rejected: IntCounterVec,
    windows: IntCounterVec,
    window_held: Gauge,
    samples: IntCounter,
    env_steps: IntCounter,
    episodes: IntCounter,
    updates: IntCounter,
    weights_published: IntCounter,
    run_spec_restored: IntCounter,
    update_duration: Histogram,
    policy_lag: Histogram,
    wait_seconds: Counter,
    compute_seconds: Counter,
    loss: GaugeVec,
    entropy: Gauge,
    grad_norm: Gauge,
    learning_rate: Gauge,
    policy_version: Gauge,
    mean_return: Gauge,
    backlog: Gauge,
    pool: Gauge,
    checkpoint_age: Gauge,
    since_progress: Gauge,
    max_policy_lag: Gauge,
    rho_clipped: Gauge,
    c_clipped: Gauge,
    behaviour_kl: Gauge,
    effective_samples: Gauge,
    explained_variance: Gauge,
    importance_ratio: Histogram,
    group_segments: IntCounterVec,
    groups: IntCounterVec,
    group_duplicates: IntCounter,
    group_held_segments: Gauge,
    group_held_bytes: Gauge,
    /// The report as of the last [`LearnerMetrics::tick`]: counters move by the difference.
    previous: LearnerReport,
    /// Compute time at the last update, for the update's duration.
    compute_at_update: Duration,
}

impl LearnerMetrics {
    /// Register the learner's metrics.
    pub fn register(registry: &Registry) -> prometheus::Result<Self> {
        let r = Registrar(registry);
        // Every label value from the start, so rates and "no rejections" read 0, not "no data".
        let segment_outcomes: Vec<&str> =
            ["used", "duplicate"].into_iter().chain(DropReason::ALL.map(DropReason::as_str)).collect();
        let rejections: Vec<&str> = DecodeError::REASONS.iter().chain(Rejection::REASONS).copied().collect();
        Ok(LearnerMetrics {
            segments: r.ints(
                "volley_learner_segments_total",
                "Valid segments received, by outcome (used, duplicate, or dropped by selection: stale, non_finite, out_of_range, zero_variance).",
                "outcome",
                &segment_outcomes,
            )?,
            windows: r.ints(
                "volley_learner_windows_total",
                "Stitched BPTT windows formed (hyper.bptt), by outcome: full (K consecutive segments; every segment without stitching), or shorter because the stream broke: gap, evicted, timeout, lag.",
                "outcome",
                &WindowOutcome::ALL.map(WindowOutcome::as_str),
            )?,
            window_held: r.gauge(
                "volley_learner_window_held_segments",
                "Segments held (unacknowledged) for incomplete stitched BPTT windows.",
            )?,
            rejected: r.ints(
                "volley_learner_segments_rejected_total",
                "Malformed or foreign segments dropped, by reason.",
                "reason",
                &rejections,
            )?,
            samples: r.int("volley_learner_samples_total", "Samples (steps) used in gradient updates.")?,
            env_steps: r.int("volley_learner_env_steps_total", "Environment steps received in valid segments.")?,
            episodes: r.int("volley_learner_episodes_total", "Episodes reported finished inside segments.")?,
            updates: r.int("volley_learner_updates_total", "Learner updates applied.")?,
            weights_published: r.int("volley_learner_weights_published_total", "Policy versions published.")?,
            run_spec_restored: r.int(
                "volley_learner_run_spec_restored_total",
                "Times the run bucket's spec key held something other than this learner's spec (e.g. an answer an actor had stored there) and the spec was written again.",
            )?,
            update_duration: r.histogram(
                "volley_learner_update_duration_seconds",
                "Wall time of one update (batch to publish).",
                prometheus::exponential_buckets(1e-4, 2.0, 16)?,
            )?,
            policy_lag: r.histogram(
                "volley_learner_policy_lag",
                "Lag of received segments in policy versions.",
                vec![0.0, 1.0, 2.0, 3.0, 4.0, 6.0, 8.0, 12.0, 16.0],
            )?,
            wait_seconds: r.counter(
                "volley_learner_wait_seconds_total",
                "Time spent waiting for segments (starvation).",
            )?,
            compute_seconds: r.counter("volley_learner_compute_seconds_total", "Time spent computing updates.")?,
            loss: r.gauges(
                "volley_learner_loss",
                "Loss of the last update, by term (total, policy, value).",
                "term",
                &["total", "policy", "value"],
            )?,
            entropy: r.gauge("volley_learner_entropy", "Mean policy entropy in the last update (nats).")?,
            grad_norm: r.gauge("volley_learner_grad_norm", "Global gradient norm before clipping, last update.")?,
            learning_rate: r.gauge("volley_learner_learning_rate", "Learning rate of the last update.")?,
            policy_version: r.gauge("volley_learner_policy_version", "The learner's current policy version.")?,
            mean_return: r.gauge("volley_learner_episode_return_mean", "Mean return of the last 100 episodes.")?,
            backlog: r.gauge(
                "volley_learner_backlog_segments",
                "Segments stored but not yet delivered to the learner.",
            )?,
            pool: r.gauge(
                "volley_learner_selection_pool_segments",
                "Segments received and waiting in the selection pool (not yet used or dropped).",
            )?,
            checkpoint_age: r.gauge(
                "volley_learner_checkpoint_age_seconds",
                "Time since the last checkpoint was written.",
            )?,
            since_progress: r.gauge(
                "volley_learner_seconds_since_progress",
                "Time since the learner loop last made progress: an update, or a pass that found no new data (so it grows only while data arrives and no update follows: a stall).",
            )?,
            max_policy_lag: r.gauge(
                "volley_learner_max_policy_lag",
                "The run's lag bound: segments more versions behind than this are dropped as stale.",
            )?,
            rho_clipped: r.gauge(
                "volley_learner_rho_clipped_fraction",
                "Share of the last update's sample weight whose importance ratio pi/mu exceeded rho-bar (V-trace; PPO: the behaviour IS clip).",
            )?,
            c_clipped: r.gauge(
                "volley_learner_c_clipped_fraction",
                "Share of the last update's sample weight whose importance ratio exceeded c-bar, cutting the V-trace traces (PPO: the behaviour IS clip).",
            )?,
            behaviour_kl: r.gauge(
                "volley_learner_behaviour_kl",
                "Estimated KL(behaviour || learner) over the last update's batch, nats (k3 estimator on the behaviour's samples).",
            )?,
            effective_samples: r.gauge(
                "volley_learner_effective_sample_fraction",
                "Kish effective sample size of the last update's importance ratios over its sample count: 1 on-policy, near 0 when few samples dominate.",
            )?,
            explained_variance: r.gauge(
                "volley_learner_value_explained_variance",
                "1 - Var(target - V)/Var(target) of the value head on the last update's value targets.",
            )?,
            importance_ratio: r.histogram(
                "volley_learner_importance_ratio",
                "Importance ratios pi/mu (learner over behaviour) of the samples of every update.",
                vec![0.1, 0.25, 0.5, 0.67, 0.8, 0.9, 1.0, 1.11, 1.25, 1.5, 2.0, 4.0, 10.0],
            )?,
            group_segments: r.ints(
                "volley_learner_group_segments_total",
                "Group rollouts: segments that left the group hold, by outcome (grouped: their groups complete; critic_lag, critic_capacity, critic_lost: released without group advantages at the lag bound, over the hold's bounds, or with a forgotten or broken group).",
                "outcome",
                &GROUP_SEGMENT_OUTCOMES,
            )?,
            groups: r.ints(
                "volley_learner_groups_total",
                "Group rollouts: groups of continuations by outcome (completed, evicted before completing, broken: members reported different starts).",
                "outcome",
                &GROUP_OUTCOMES,
            )?,
            group_duplicates: r.int(
                "volley_learner_group_members_duplicate_total",
                "Group rollouts: member returns reported again (a redelivered member replaying its tail); the first counts.",
            )?,
            group_held_segments: r.gauge(
                "volley_learner_group_held_segments",
                "Group rollouts: segments waiting in the group hold for their groups to complete.",
            )?,
            group_held_bytes: r.gauge(
                "volley_learner_group_held_bytes",
                "Group rollouts: approximate bytes of the segments in the group hold.",
            )?,
            previous: LearnerReport::default(),
            compute_at_update: Duration::ZERO,
        })
    }

    /// The counter of writes of the run spec over a value that was not it
    /// (`volley_learner_run_spec_restored_total`), for whoever checks the spec.
    pub fn run_spec_restored(&self) -> IntCounter {
        self.run_spec_restored.clone()
    }

    /// Record one update (its losses, statistics and duration), then [`LearnerMetrics::tick`].
    /// `published` says whether this update's version was published.
    pub fn observe(&mut self, learner: &Learner, report: &LearnerReport, stats: &UpdateStats, published: bool) {
        if published {
            self.weights_published.inc();
        }
        let compute = report.compute_time.saturating_sub(self.compute_at_update);
        self.compute_at_update = report.compute_time;
        self.update_duration.observe(compute.as_secs_f64());
        self.loss.with_label_values(&["total"]).set(stats.loss.total as f64);
        self.loss.with_label_values(&["policy"]).set(stats.loss.policy as f64);
        self.loss.with_label_values(&["value"]).set(stats.loss.value as f64);
        self.entropy.set(stats.loss.entropy as f64);
        self.grad_norm.set(stats.grad_norm as f64);
        self.learning_rate.set(stats.learning_rate as f64);
        if let Some(off) = &stats.off_policy {
            self.rho_clipped.set(off.rho_clipped_fraction as f64);
            self.c_clipped.set(off.c_clipped_fraction as f64);
            self.behaviour_kl.set(off.behaviour_kl as f64);
            self.effective_samples.set(off.effective_sample_fraction as f64);
            if off.explained_variance.is_finite() {
                self.explained_variance.set(off.explained_variance as f64);
            }
            // Every weighted sample's ratio, a few hundred per update: counted locally and added
            // to the shared histogram once, not with three atomic updates per observation.
            let ratios = self.importance_ratio.local();
            for &ratio in &off.ratios {
                ratios.observe(ratio as f64);
            }
            ratios.flush();
        }
        self.policy_version.set(learner.version().0 as f64);
        self.tick(report);
    }

    /// Bring every counter up to `report` (segments by outcome, rejections, env steps,
    /// episodes, samples, updates, lag, wait and compute time) and refresh the gauges of
    /// backlog, pool, mean return and time since progress. Called on every pass of the learner
    /// loop, updates or not ([`crate::LearnerControl::on_tick`]), so nothing waits for an update
    /// to move: a stalled learner's stale segments are counted as they arrive.
    pub fn tick(&mut self, report: &LearnerReport) {
        let prev = &self.previous;
        let delta = |now: u64, before: u64| now.saturating_sub(before);
        self.segments.with_label_values(&["used"]).inc_by(delta(report.segments_used, prev.segments_used));
        for ((reason, count), (_, before)) in report.segments_dropped().into_iter().zip(prev.segments_dropped()) {
            self.segments.with_label_values(&[reason.as_str()]).inc_by(delta(count, before));
        }
        self.segments
            .with_label_values(&["duplicate"])
            .inc_by(delta(report.segments_duplicate, prev.segments_duplicate));
        for (reason, &count) in &report.segments_rejected {
            let before = prev.segments_rejected.get(reason).copied().unwrap_or(0);
            self.rejected.with_label_values(&[reason]).inc_by(delta(count, before));
        }
        self.samples.inc_by(delta(report.samples_trained, prev.samples_trained));
        self.env_steps.inc_by(delta(report.env_steps, prev.env_steps));
        self.episodes.inc_by(delta(report.episodes, prev.episodes));
        self.updates.inc_by(delta(report.updates, prev.updates));
        let lags = self.policy_lag.local();
        for (lag, &count) in report.lag_histogram.iter().enumerate() {
            let before = prev.lag_histogram.get(lag).copied().unwrap_or(0);
            for _ in 0..delta(count, before) {
                lags.observe(lag as f64);
            }
        }
        lags.flush();
        self.compute_seconds.inc_by(report.compute_time.saturating_sub(prev.compute_time).as_secs_f64());
        self.wait_seconds.inc_by(report.wait_time.saturating_sub(prev.wait_time).as_secs_f64());
        let mean = report.mean_return(100);
        if mean.is_finite() {
            self.mean_return.set(mean as f64);
        }
        if let Some(backlog) = report.backlog {
            self.backlog.set(backlog as f64);
        }
        self.pool.set(report.pool_segments as f64);
        let (now, before) = (&report.groups, &prev.groups);
        let segment_counts = [
            (now.segments_grouped, before.segments_grouped),
            (now.segments_critic_lag, before.segments_critic_lag),
            (now.segments_critic_capacity, before.segments_critic_capacity),
            (now.segments_critic_lost, before.segments_critic_lost),
        ];
        for (outcome, (count, was)) in GROUP_SEGMENT_OUTCOMES.iter().zip(segment_counts) {
            self.group_segments.with_label_values(&[outcome]).inc_by(delta(count, was));
        }
        let group_counts = [
            (now.groups.completed, before.groups.completed),
            (now.groups.evicted_incomplete, before.groups.evicted_incomplete),
            (now.groups.broken, before.groups.broken),
        ];
        for (outcome, (count, was)) in GROUP_OUTCOMES.iter().zip(group_counts) {
            self.groups.with_label_values(&[outcome]).inc_by(delta(count, was));
        }
        self.group_duplicates.inc_by(delta(now.groups.duplicate_members, before.groups.duplicate_members));
        self.group_held_segments.set(now.held_segments as f64);
        self.group_held_bytes.set(now.held_bytes as f64);
        self.window_held.set(report.window_held_segments as f64);
        for ((outcome, &count), &before) in
            crate::select::windows::WindowOutcome::ALL.iter().zip(&report.windows).zip(&prev.windows)
        {
            self.windows.with_label_values(&[outcome.as_str()]).inc_by(delta(count, before));
        }
        self.since_progress.set(report.elapsed.saturating_sub(report.progress_at).as_secs_f64());
        self.previous = report.clone();
    }

    /// Record the run's lag bound (`u64::MAX`, replay's "no bound", is exported as +Inf).
    pub fn set_max_policy_lag(&self, max_policy_lag: u64) {
        self.max_policy_lag.set(if max_policy_lag == u64::MAX { f64::INFINITY } else { max_policy_lag as f64 });
    }

    /// Record the time since the last checkpoint.
    pub fn set_checkpoint_age(&self, age: Duration) {
        self.checkpoint_age.set(age.as_secs_f64());
    }
}

/// The `outcome` labels of `volley_learner_group_segments_total`.
const GROUP_SEGMENT_OUTCOMES: [&str; 4] = ["grouped", "critic_lag", "critic_capacity", "critic_lost"];
/// The `outcome` labels of `volley_learner_groups_total`.
const GROUP_OUTCOMES: [&str; 3] = ["completed", "evicted", "broken"];

/// Most actors [`ActorLag`] keeps a label for; the least recently heard-from one is dropped
/// first (the label set is keyed by what peers send, so it is bounded).
pub const MAX_ACTOR_LABELS: usize = 256;

/// `volley_learner_actor_policy_lag{actor}`: each actor's lag in versions as the learner
/// measures it on arrival (an exponential moving average over its segments). Measured in one
/// process at one instant, so unlike "learner version minus actor version" across two scrapes
/// it can never be negative.
pub struct ActorLag {
    gauge: GaugeVec,
    /// Actor id → (smoothed lag, segments seen when last heard from).
    actors: std::collections::HashMap<String, (f64, u64)>,
    seen: u64,
}

impl ActorLag {
    /// Weight of the newest segment in the moving average.
    const ALPHA: f64 = 0.2;

    /// Register on `registry`.
    pub fn register(registry: &Registry) -> prometheus::Result<Self> {
        let gauge = Registrar(registry).gauges(
            "volley_learner_actor_policy_lag",
            "Lag in versions of each actor's segments as the learner receives them (moving average; at most 256 actors, least recently heard-from dropped first).",
            "actor",
            &[],
        )?;
        Ok(ActorLag { gauge, actors: std::collections::HashMap::new(), seen: 0 })
    }

    /// A segment from `actor` arrived `lag` versions behind the learner.
    pub fn observe(&mut self, actor: &str, lag: u64) {
        // Bounded in bytes too: a label is at most 64 bytes of the id.
        let actor = &actor[..(0..=actor.len().min(64)).rev().find(|&i| actor.is_char_boundary(i)).unwrap_or(0)];
        self.seen += 1;
        let seen = self.seen;
        if !self.actors.contains_key(actor) && self.actors.len() >= MAX_ACTOR_LABELS {
            let oldest = self.actors.iter().min_by_key(|(_, (_, at))| *at).map(|(id, _)| id.clone());
            if let Some(oldest) = oldest {
                self.actors.remove(&oldest);
                let _ = self.gauge.remove_label_values(&[&oldest]);
            }
        }
        let entry = self.actors.entry(actor.to_string()).or_insert((lag as f64, seen));
        entry.0 += Self::ALPHA * (lag as f64 - entry.0);
        entry.1 = seen;
        self.gauge.with_label_values(&[actor]).set(entry.0);
    }

    /// Actors with a label now.
    pub fn len(&self) -> usize {
        self.actors.len()
    }

    /// Whether no actor has a label.
    pub fn is_empty(&self) -> bool {
        self.actors.is_empty()
    }
}

impl SchedulerObserver for WorkMetrics {
    fn observe(&self, scheduler: &Scheduler) {
        WorkMetrics::observe(self, scheduler);
    }

    fn observe_leases(&self, leases: &LeaseCounts) {
        WorkMetrics::observe_leases(self, leases);
    }
}

/// The budget scheduler's metrics (learners of runs with `work.enabled`): each task's share of
/// the work items and its recent success rate (label `task` = task index, bounded by the
/// run's task list), work items issued by kind of start, and saved states known.
pub struct WorkMetrics {
    share: GaugeVec,
    success: GaugeVec,
    fresh_success: GaugeVec,
    frontier: GaugeVec,
    items: IntCounterVec,
    groups: IntCounter,
    snapshots: Gauge,
    leases: IntCounterVec,
    leases_in_flight: Gauge,
    leases_most_held: Gauge,
}

impl WorkMetrics {
    /// Register on `registry`.
    pub fn register(registry: &Registry) -> prometheus::Result<Self> {
        let r = Registrar(registry);
        let lease_outcomes = LeaseCounts::default().outcomes().map(|(outcome, _)| outcome);
        Ok(WorkMetrics {
            share: r.gauges(
                "volley_learner_task_budget_share",
                "Share of work items issued for each task so far.",
                "task",
                &[],
            )?,
            success: r.gauges(
                "volley_learner_task_success_rate",
                "Recent success rate of each task's episodes, any start (Beta(1,1)-smoothed window).",
                "task",
                &[],
            )?,
            fresh_success: r.gauges(
                "volley_learner_task_fresh_success_rate",
                "Recent success rate of each task's episodes that started fresh (no save-load help).",
                "task",
                &[],
            )?,
            frontier: r.gauges(
                "volley_learner_task_restart_frontier",
                "Furthest progress (Env::progress) among each task's saved states; -1 with none saved.",
                "task",
                &[],
            )?,
            items: r.ints(
                "volley_learner_work_items_total",
                "Work items issued, by start: fresh or resume.",
                "start",
                &["fresh", "resume"],
            )?,
            groups: r.int(
                "volley_learner_work_groups_total",
                "Groups of continuations issued (group rollouts); each is work.group_size items.",
            )?,
            snapshots: r.gauge("volley_learner_snapshots_known", "Saved states the scheduler can restart from.")?,
            leases: r.ints(
                "volley_learner_work_leases_total",
                "Work dispatcher (NATS runs): actors' takes and leases by outcome: leased, refused_limit (the actor held work.max_items_per_actor), refused_cooling (an item of the actor was taken back), confirmed (its episodes arrived), reclaimed (no progress for work.ack_wait_secs), unconfirmed (reported done, no episodes within work.confirm_wait_secs).",
                "outcome",
                &lease_outcomes,
            )?,
            leases_in_flight: r.gauge(
                "volley_learner_work_leases_in_flight",
                "Work items leased to actors now (NATS runs).",
            )?,
            leases_most_held: r.gauge(
                "volley_learner_work_leases_most_held",
                "The most work items one actor identity holds now (at most work.max_items_per_actor; NATS runs).",
            )?,
        })
    }

    /// Copy the work dispatcher's counts.
    pub fn observe_leases(&self, leases: &LeaseCounts) {
        for (outcome, total) in leases.outcomes() {
            let counter = self.leases.with_label_values(&[outcome]);
            if total > counter.get() {
                counter.inc_by(total - counter.get());
            }
        }
        self.leases_in_flight.set(leases.in_flight as f64);
        self.leases_most_held.set(leases.most_held as f64);
    }

    /// Copy the scheduler's state.
    pub fn observe(&self, scheduler: &Scheduler) {
        for (task, (stats, share)) in scheduler.task_stats().iter().zip(scheduler.budget_shares()).enumerate() {
            let label = task.to_string();
            self.share.with_label_values(&[&label]).set(share);
            self.success.with_label_values(&[&label]).set(stats.outcomes.success_rate());
            self.fresh_success.with_label_values(&[&label]).set(stats.fresh.success_rate());
        }
        for (task, (furthest, _)) in scheduler.frontier().into_iter().enumerate() {
            self.frontier.with_label_values(&[&task.to_string()]).set(furthest.map_or(-1.0, f64::from));
        }
        let (fresh, resumed) = scheduler.items_issued();
        for (start, total) in [("fresh", fresh), ("resume", resumed)] {
            let counter = self.items.with_label_values(&[start]);
            if total > counter.get() {
                counter.inc_by(total - counter.get());
            }
        }
        self.snapshots.set(scheduler.known_snapshots() as f64);
        let groups = scheduler.groups_issued();
        if groups > self.groups.get() {
            self.groups.inc_by(groups - self.groups.get());
        }
    }
}

#[cfg(test)]
mod actor_lag_tests {
    use super::*;

    #[test]
    fn labelled_counters_are_exported_at_zero_with_every_label_from_the_start() {
        let registry = Registry::new();
        let _metrics = LearnerMetrics::register(&registry).expect("register");
        let _work = WorkMetrics::register(&registry).expect("register");
        let families = registry.gather();
        let values = |name: &str| -> Vec<(String, f64)> {
            let family = families.iter().find(|f| f.name() == name).unwrap_or_else(|| panic!("{name} not exported"));
            family
                .get_metric()
                .iter()
                .map(|m| (m.get_label()[0].value().to_string(), m.get_counter().get_value()))
                .collect()
        };
        let rejected = values("volley_learner_segments_rejected_total");
        // Decoding and admission share `bad_id` (a typed id that does not decode, a bad key).
        let reasons: std::collections::BTreeSet<_> = volley_core::wire::DecodeError::REASONS
            .iter()
            .chain(crate::ingest::admission::Rejection::REASONS)
            .collect();
        assert_eq!(rejected.len(), reasons.len());
        let outcomes = values("volley_learner_segments_total");
        let mut names: Vec<_> = outcomes.iter().map(|(label, _)| label.as_str()).collect();
        names.sort_unstable();
        assert_eq!(names, ["duplicate", "non_finite", "out_of_range", "stale", "used", "zero_variance"]);
        assert_eq!(values("volley_learner_work_items_total").len(), 2);
        assert_eq!(values("volley_learner_group_segments_total").len(), 4);
        assert_eq!(values("volley_learner_groups_total").len(), 3);
        let windows = values("volley_learner_windows_total");
        let mut outcomes_of_windows: Vec<_> = windows.iter().map(|(label, _)| label.as_str()).collect();
        outcomes_of_windows.sort_unstable();
        assert_eq!(outcomes_of_windows, ["evicted", "full", "gap", "lag", "timeout"]);
        for (label, value) in rejected.iter().chain(&outcomes) {
            assert_eq!(*value, 0.0, "{label}");
        }
    }

    #[test]
    fn work_lease_counts_are_exported_by_outcome_and_never_go_back() {
        let registry = Registry::new();
        let work = WorkMetrics::register(&registry).expect("register");
        let value = |name: &str, outcome: Option<&str>| -> f64 {
            let families = registry.gather();
            let family = families.iter().find(|f| f.name() == name).unwrap_or_else(|| panic!("{name} not exported"));
            let metric = family
                .get_metric()
                .iter()
                .find(|m| outcome.is_none_or(|outcome| m.get_label()[0].value() == outcome))
                .unwrap_or_else(|| panic!("{name}{{{outcome:?}}} not exported"));
            match outcome {
                Some(_) => metric.get_counter().get_value(),
                None => metric.get_gauge().get_value(),
            }
        };
        // Every outcome from the start, at zero.
        let families = registry.gather();
        let leases = families.iter().find(|f| f.name() == "volley_learner_work_leases_total").expect("exported");
        assert_eq!(leases.get_metric().len(), 6);
        assert!(leases.get_metric().iter().all(|m| m.get_counter().get_value() == 0.0));

        let counts = LeaseCounts {
            leased: 40,
            refused_limit: 7,
            refused_cooling: 3,
            confirmed: 30,
            reclaimed: 5,
            unconfirmed: 2,
            in_flight: 3,
            most_held: 2,
        };
        work.observe_leases(&counts);
        // Lower counts (a queue opened again counts from zero) never move a counter back.
        work.observe_leases(&LeaseCounts { leased: 1, in_flight: 1, most_held: 1, ..LeaseCounts::default() });
        let later = LeaseCounts { reclaimed: 6, ..counts };
        work.observe_leases(&later);
        for (outcome, total) in later.outcomes() {
            assert_eq!(value("volley_learner_work_leases_total", Some(outcome)), total as f64, "{outcome}");
        }
        assert_eq!(value("volley_learner_work_leases_in_flight", None), 3.0);
        assert_eq!(value("volley_learner_work_leases_most_held", None), 2.0);
    }

    #[test]
    fn actor_lag_is_smoothed_and_its_labels_bounded() {
        let registry = Registry::new();
        let mut lag = ActorLag::register(&registry).expect("register");
        lag.observe("a", 0);
        lag.observe("a", 10);
        assert!((lag.gauge.with_label_values(&["a"]).get() - 2.0).abs() < 1e-9);
        for i in 0..(MAX_ACTOR_LABELS + 10) {
            lag.observe(&format!("actor-{i}"), 1);
        }
        assert_eq!(lag.len(), MAX_ACTOR_LABELS);
        let families = registry.gather();
        let exported = families.iter().find(|f| f.name() == "volley_learner_actor_policy_lag").expect("family");
        assert_eq!(exported.get_metric().len(), MAX_ACTOR_LABELS, "evicted actors leave the exposition");
        assert!(!lag.actors.contains_key("a"), "the least recently heard-from actor went first");
    }
}
