//! The learner loop: receive, check, batch, update, publish, acknowledge.
//!
//! Acknowledgement guarantee: a segment is acknowledged only after the update it fed has been
//! applied to the parameters and the resulting version published (a publisher that publishes
//! in the background says when, [`WeightsPublisher::is_published`]; the segments wait until
//! then, while the learner goes on with the next updates) (or after it was dropped by
//! trajectory selection or rejected as malformed, which are final decisions). A crash before
//! that point leaves the segment unacknowledged, so a networked transport redelivers it. Which
//! segments feed an update, and with what weight, is [`crate::select::selection`]'s decision.

use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use tracing::{debug, info, warn};
use volley_core::ids::PolicyVersion;
use volley_core::wire::TrajectorySegment;
use volley_transport::nats::CONSUMER_MAX_ACK_PENDING;
use volley_transport::rejection_log::RejectionLog;
use volley_transport::{Delivery, DeliveryToken, TrajectorySource, TransportError, WeightsPublisher};

use crate::batch::SegmentBatch;
use crate::ingest::admission::Admission;
use crate::ingest::seen::{SeenSegments, SEEN_STREAMS};
use crate::learner::{Learner, UpdateStats};
use crate::select::selection::{DropReason, Dropped, GroupStats, Selector};
use crate::select::windows::WindowOutcome;

/// When the learner loop stops by itself.
#[derive(Debug, Clone, Default)]
pub struct RunLimits {
    /// Stop after consuming this many environment steps.
    pub max_env_steps: Option<u64>,
    /// Stop after this much wall time.
    pub max_duration: Option<Duration>,
    /// Stop once the mean return of the last 100 episodes reaches this.
    pub target_return: Option<f32>,
    /// Stop after this many updates.
    pub max_updates: Option<u64>,
    /// Publish weights every this many updates (1 = every update).
    pub publish_every: u64,
    /// Environment steps consumed before this loop started (a resumed learner's budget).
    pub resume_env_steps: u64,
}

/// Why the loop stopped.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StopReason {
    /// The target return was reached.
    Solved,
    /// The environment-step budget is spent.
    EnvStepBudget,
    /// The wall-time budget is spent.
    TimeBudget,
    /// The update budget is spent.
    UpdateBudget,
    /// The caller asked to stop (Ctrl-C, SIGTERM).
    Interrupted,
    /// The transport closed.
    SourceClosed,
}

impl std::fmt::Display for StopReason {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            StopReason::Solved => "solved",
            StopReason::EnvStepBudget => "env_step_budget",
            StopReason::TimeBudget => "time_budget",
            StopReason::UpdateBudget => "update_budget",
            StopReason::Interrupted => "interrupted",
            StopReason::SourceClosed => "source_closed",
        })
    }
}

/// Callbacks the loop makes; the CLI uses them for progress, metrics files and checkpoints.
pub trait LearnerControl {
    /// Called after every update, once the new version is published.
    fn on_update(&mut self, learner: &mut Learner, report: &LearnerReport, stats: &UpdateStats);

    /// Called for every valid, first-seen segment (also stale ones, whose episode results
    /// still count), before it is batched; the budget scheduler learns from it here.
    fn on_segment(&mut self, segment: &TrajectorySegment) {
        let _ = segment;
    }

    /// Called once per pass of the loop (at least every ~100 ms while nothing arrives, since
    /// receiving waits at most that long), updates or not: signals that measure time, age or
    /// backlog are refreshed here, so they move while the learner starves or stalls.
    fn on_tick(&mut self, learner: &Learner, report: &LearnerReport) {
        let _ = (learner, report);
    }
}

impl<F: FnMut(&mut Learner, &LearnerReport, &UpdateStats)> LearnerControl for F {
    fn on_update(&mut self, learner: &mut Learner, report: &LearnerReport, stats: &UpdateStats) {
        self(learner, report, stats)
    }
}

/// Running totals of the learner loop.
#[derive(Debug, Clone, Default)]
pub struct LearnerReport {
    /// Updates applied.
    pub updates: u64,
    /// Current policy version.
    pub policy_version: PolicyVersion,
    /// Environment steps in accepted or stale-dropped segments.
    pub env_steps: u64,
    /// Samples used in gradient updates.
    pub samples_trained: u64,
    /// Distinct segments used in updates (a segment drawn twice into one batch counts once).
    pub segments_used: u64,
    /// Segments dropped because their lag exceeded `max_policy_lag` (on arrival, or while
    /// waiting in the selection pool).
    pub segments_stale: u64,
    /// Segments dropped by the selection guard: a derived value was not finite.
    pub segments_non_finite: u64,
    /// Segments dropped by the selection guard: a reward exceeded `max_abs_reward`.
    pub segments_out_of_range: u64,
    /// Segments dropped because their start group's recent returns had zero variance.
    pub segments_zero_variance: u64,
    /// Segments waiting in the selection pool at the last update (received, not yet used,
    /// not acknowledged).
    pub pool_segments: u64,
    /// Group rollouts: the group hold and the group table (refreshed every pass of the loop).
    pub groups: GroupStats,
    /// Segments held for incomplete stitched windows (`hyper.bptt`; received, not yet in the
    /// pool, not acknowledged).
    pub window_held_segments: u64,
    /// Windows formed, by outcome (`full`, or shorter because the stream broke: `gap`,
    /// `evicted`, `timeout`, `lag`); one `full` window per segment without stitching.
    /// In [`WindowOutcome::ALL`] order.
    pub windows: [u64; WindowOutcome::ALL.len()],
    /// Segments skipped because the same (actor, incarnation, env, segment index) was already used.
    pub segments_duplicate: u64,
    /// Segments rejected as malformed, by reason.
    pub segments_rejected: HashMap<&'static str, u64>,
    /// Episodes finished (reported inside segments).
    pub episodes: u64,
    /// Returns of the most recent episodes (at most [`RETURN_WINDOW`]), of admitted
    /// segments only, at most `max_returns_per_actor` of them from any one actor id.
    pub recent_returns: VecDeque<f32>,
    /// `recent_returns[i]` came from the actor whose id hashes to `recent_actors[i]`.
    pub recent_actors: VecDeque<u64>,
    /// How many entries of the window one actor id may hold (`hyper.trust`; 0 = the window).
    pub max_returns_per_actor: usize,
    /// Wall time since the loop started.
    pub elapsed: Duration,
    /// Time spent waiting for data.
    pub wait_time: Duration,
    /// Time spent computing updates (selection, batching, the update, publishing, acks).
    pub compute_time: Duration,
    /// Part of `compute_time` spent in the update itself.
    pub update_time: Duration,
    /// Part of `compute_time` spent handing weights to the publisher.
    pub publish_time: Duration,
    /// Part of `compute_time` spent acknowledging segments.
    pub ack_time: Duration,
    /// First (env steps, seconds) at which the last-20 mean reached the target.
    pub target_reached_20: Option<(u64, f64)>,
    /// First (env steps, seconds) at which the last-100 mean reached the target.
    pub target_reached_100: Option<(u64, f64)>,
    /// Histogram of segment lag in versions: `lag_histogram[k]` counts lag k (last bucket: ≥).
    pub lag_histogram: Vec<u64>,
    /// Backlog reported by the transport (refreshed every pass of the loop).
    pub backlog: Option<u64>,
    /// Valid, first-seen segments received (used, stale or dropped by selection).
    pub segments_received: u64,
    /// Loop time of the last progress: an update applied, or a pass that found no new data
    /// while none had arrived since the last update (waiting for actors, or for the broker, is
    /// not the learner's fault; segments held for an incomplete stitched window are not data
    /// yet). Once valid data has arrived, only an update is progress: data
    /// arriving without an update following (everything stale, say) is a stall, and this stops
    /// moving while [`LearnerReport::elapsed`] goes on, empty passes in between or not.
    pub progress_at: Duration,
    /// Why the loop stopped (set at the end).
    pub stop_reason: Option<StopReason>,
}

impl LearnerReport {
    /// Mean return of the last `n` episodes (fewer if fewer finished); NaN with none.
    pub fn mean_return(&self, n: usize) -> f32 {
        let take = n.min(self.recent_returns.len());
        if take == 0 {
            return f32::NAN;
        }
        self.recent_returns.iter().rev().take(take).sum::<f32>() / take as f32
    }

    /// Segments dropped by trajectory selection, by reason (filter order).
    pub fn segments_dropped(&self) -> [(DropReason, u64); 4] {
        DropReason::ALL.map(|reason| (reason, self.dropped(reason)))
    }

    fn dropped(&self, reason: DropReason) -> u64 {
        match reason {
            DropReason::Stale => self.segments_stale,
            DropReason::NonFinite => self.segments_non_finite,
            DropReason::OutOfRange => self.segments_out_of_range,
            DropReason::ZeroVariance => self.segments_zero_variance,
        }
    }

    fn count_drop(&mut self, reason: DropReason) {
        *match reason {
            DropReason::Stale => &mut self.segments_stale,
            DropReason::NonFinite => &mut self.segments_non_finite,
            DropReason::OutOfRange => &mut self.segments_out_of_range,
            DropReason::ZeroVariance => &mut self.segments_zero_variance,
        } += 1;
    }

    /// Add one episode's return to the window. An actor at its cap replaces its own oldest
    /// entry, so one actor id moves the windowed mean by at most its cap's share of the
    /// environment's return range (docs/SECURITY.md).
    fn push_return(&mut self, actor: u64, episode_return: f32) {
        let cap = match self.max_returns_per_actor {
            0 => RETURN_WINDOW,
            cap => cap.min(RETURN_WINDOW),
        };
        let held = self.recent_actors.iter().filter(|&&a| a == actor).count();
        let evict = if held >= cap {
            self.recent_actors.iter().position(|&a| a == actor)
        } else if self.recent_returns.len() >= RETURN_WINDOW {
            Some(0)
        } else {
            None
        };
        if let Some(idx) = evict {
            self.recent_returns.remove(idx);
            self.recent_actors.remove(idx);
        }
        self.recent_returns.push_back(episode_return);
        self.recent_actors.push_back(actor);
    }

    /// Episodes count towards the returns only when they started fresh: an episode resumed
    /// from a saved state (save-load exploration) did not face the task from its start.
    /// The segment has passed admission, so every return is finite and bounded.
    fn record_episodes(&mut self, segment: &TrajectorySegment, target: Option<f32>) {
        let actor = volley_core::wire::id_hash(segment.actor.as_str().as_bytes());
        for episode in segment.finished_episodes.iter().filter(|e| e.start.is_none()) {
            self.episodes += 1;
            // Admission rejects non-finite returns; this keeps the means safe regardless.
            if !episode.episode_return.is_finite() {
                continue;
            }
            self.push_return(actor, episode.episode_return);
            if let Some(target) = target {
                let now = (self.env_steps, self.elapsed.as_secs_f64());
                if self.target_reached_20.is_none() && self.episodes >= 20 && self.mean_return(20) >= target {
                    self.target_reached_20 = Some(now);
                }
                if self.target_reached_100.is_none() && self.episodes >= 100 && self.mean_return(100) >= target {
                    self.target_reached_100 = Some(now);
                }
            }
        }
    }
}

const LAG_BUCKETS: usize = 65;

/// The most deliveries the learner's NATS consumer hands out unacknowledged, as a `usize`.
const NATS_MAX_ACK_PENDING: usize = CONSUMER_MAX_ACK_PENDING as usize;

/// Versions the learner may be ahead of what its publisher has put out before it waits: half
/// the lag bound (at least 2), so a publisher that fell behind costs lag, never stale data.
fn max_unpublished_versions(max_policy_lag: u64) -> usize {
    usize::try_from(max_policy_lag / 2).unwrap_or(usize::MAX).max(2)
}

/// How long a stopping learner waits on its transport (the last weights publish, the last
/// acks) before it returns, so the caller's final checkpoint follows within seconds.
pub const STOP_WAIT: Duration = Duration::from_secs(3);

/// Episodes in the return window behind `mean_return(100)` and the solved stop.
pub const RETURN_WINDOW: usize = 100;

/// Run the learner until a limit, `stop`, or the source closing.
pub fn run_learner(
    learner: &mut Learner,
    source: &mut dyn TrajectorySource,
    publisher: &mut dyn WeightsPublisher,
    limits: &RunLimits,
    stop: &AtomicBool,
    control: &mut dyn LearnerControl,
) -> Result<LearnerReport, TransportError> {
    let started = Instant::now();
    let spec = learner.spec().clone();
    let layout_hash = learner.layout().hash();
    let hidden_size = learner.layout().recurrent_size();
    let mut selector = Selector::new(&spec);
    let admission = Admission::new(&spec);
    info!(selection = ?spec.hyper.selection, pool_segments = selector.pool_target(), "trajectory selection");
    if spec.hyper.bptt.segments > 1 {
        info!(bptt = ?spec.hyper.bptt, "stitched BPTT windows");
    }
    let max_held = if spec.hyper.bptt.segments > 1 { spec.hyper.bptt.max_held_segments } else { 0 };
    if selector.pool_target() + max_held > NATS_MAX_ACK_PENDING {
        warn!(
            pool_segments = selector.pool_target(),
            max_held_segments = max_held,
            max_ack_pending = NATS_MAX_ACK_PENDING,
            "the selection pool and held window segments exceed what a NATS consumer delivers unacknowledged; over NATS the pool may never fill"
        );
    }
    let publish_every = limits.publish_every.max(1);
    let mut report = LearnerReport {
        policy_version: learner.version(),
        env_steps: limits.resume_env_steps,
        lag_histogram: vec![0; LAG_BUCKETS],
        max_returns_per_actor: ((spec.hyper.trust.max_actor_return_share as f64 * RETURN_WINDOW as f64).ceil()
            as usize)
            .clamp(1, RETURN_WINDOW),
        ..LearnerReport::default()
    };
    publisher.publish(learner.weights())?;
    let mut incoming: Vec<Delivery> = Vec::with_capacity(selector.pool_target());
    let mut dropped: Vec<Dropped> = Vec::new();
    let mut settled: Vec<DeliveryToken> = Vec::new();
    let mut batch = SegmentBatch::default();
    let mut seen = SeenSegments::new(SEEN_STREAMS);
    // Every rejection is counted by reason; the log says the first few of each reason per
    // window and then how many it left out (issue 46: one line per rejected part was 9.6 times
    // the bytes of the hostile traffic).
    let mut rejections = RejectionLog::new("segment");
    // Segments behind updates whose version is not published yet, by version, oldest first.
    let mut unpublished: VecDeque<(PolicyVersion, Vec<DeliveryToken>)> = VecDeque::new();
    let max_unpublished = max_unpublished_versions(spec.hyper.max_policy_lag);
    // Whether valid data arrived since the last update (then only an update is progress).
    let mut received_since_update = false;
    let stop_reason = loop {
        report.elapsed = started.elapsed();
        if stop.load(Ordering::Acquire) {
            break StopReason::Interrupted;
        }
        if let Some(reason) = limit_reached(limits, &report) {
            break reason;
        }
        let wait_started = Instant::now();
        let want = selector.pool_target().saturating_sub(selector.len());
        match source.recv(want, Duration::from_millis(100), &mut incoming) {
            Ok(_) => {}
            Err(TransportError::Closed) => break StopReason::SourceClosed,
            Err(err) => {
                // Waiting on the broker is not the learner's fault: progress, and a tick so
                // the signals keep moving through an outage.
                warn!(%err, "receiving segments failed; retrying");
                report.wait_time += wait_started.elapsed();
                report.elapsed = started.elapsed();
                if !received_since_update {
                    report.progress_at = report.elapsed;
                }
                control.on_tick(learner, &report);
                continue;
            }
        }
        report.wait_time += wait_started.elapsed();
        report.elapsed = started.elapsed();
        if incoming.is_empty() && !received_since_update {
            report.progress_at = report.elapsed;
        }
        for delivery in incoming.drain(..) {
            let Delivery { segment, token, .. } = delivery;
            let checked =
                segment.and_then(|segment| segment.validate(&spec, layout_hash, hidden_size).map(|()| segment));
            // Admission: what an actor could claim falsely within the format (docs/SECURITY.md).
            let admitted = match checked {
                Ok(segment) => admission
                    .check(&segment, learner.version())
                    .map(|()| segment)
                    .map_err(|rejection| (rejection.reason(), rejection.to_string())),
                Err(err) => Err((err.reason(), err.to_string())),
            };
            let segment = match admitted {
                Ok(segment) => segment,
                Err((reason, err)) => {
                    *report.segments_rejected.entry(reason).or_default() += 1;
                    if rejections.record(reason) {
                        warn!(reason, %err, "segment rejected");
                    }
                    if let Err(err) = source.reject(token) {
                        if rejections.record("reject_failed") {
                            warn!(%err, "could not reject a segment; it may be redelivered and rejected again");
                        }
                    }
                    continue;
                }
            };
            if !seen.insert(&segment) {
                report.segments_duplicate += 1;
                debug!(actor = %segment.actor, segment_idx = segment.segment_idx, "duplicate segment skipped");
                settled.push(token);
                continue;
            }
            report.segments_received += 1;
            report.env_steps += segment.len() as u64;
            report.record_episodes(&segment, limits.target_return);
            control.on_segment(&segment);
            let lag = learner.version().lag_of(segment.policy_version);
            report.lag_histogram[(lag as usize).min(LAG_BUCKETS - 1)] += 1;
            let (pool_before, dropped_before) = (selector.len(), dropped.len());
            selector.offer(segment, token, learner.version(), &mut dropped);
            // Data the learner could decide on (pooled or dropped) and no update following is a
            // stall; a segment that only waits for its stitched window's next ones is not.
            if selector.len() != pool_before || dropped.len() != dropped_before {
                received_since_update = true;
            }
        }
        let compute_started = Instant::now();
        let version = learner.version();
        // Priority sampling scores new segments with the learner's own forward pass, on its
        // backend: no weights leave the device for it.
        let ready = selector.prepare(version, learner, &mut dropped);
        for drop in dropped.drain(..) {
            report.count_drop(drop.reason);
            settled.push(drop.token);
        }
        report.groups = selector.group_stats();
        release_published(&*publisher, &mut unpublished, &mut settled);
        if !settled.is_empty() {
            let ack_started = Instant::now();
            ack_or_warn(source, &mut settled);
            report.ack_time += ack_started.elapsed();
        }
        if !ready {
            report.compute_time += compute_started.elapsed();
            report.elapsed = started.elapsed();
            report.pool_segments = selector.len() as u64;
            report.window_held_segments = selector.held_segments() as u64;
            report.windows = selector.window_outcomes().map(|(_, n)| n);
            report.backlog = source.backlog();
            rejections.tick();
            control.on_tick(learner, &report);
            continue;
        }
        let draw = selector.draw();
        batch.fill_windows(
            &draw.windows,
            draw.window_segments,
            spec.hyper.gamma,
            spec.hyper.reward_scale,
            draw.column_weights,
        );
        batch.set_advantage_override(&draw.advantages);
        let update_started = Instant::now();
        let stats = learner.update(&batch);
        report.update_time += update_started.elapsed();
        let published = learner.updates().is_multiple_of(publish_every);
        if published {
            let publish_started = Instant::now();
            publisher.publish(learner.weights())?;
            report.publish_time += publish_started.elapsed();
        }
        let used = selector.settle_drawn(&mut settled);
        if published && !publisher.is_published(learner.version()) {
            unpublished.push_back((learner.version(), std::mem::take(&mut settled)));
            // A publisher that fell behind (a broker outage, a slow store) holds the learner
            // back, as a synchronous one did: otherwise it runs `max_policy_lag` versions ahead
            // of what actors can have, and every segment after that is dropped as stale.
            if unpublished.len() > max_unpublished {
                let publish_started = Instant::now();
                publisher.flush()?;
                report.publish_time += publish_started.elapsed();
            }
        }
        release_published(&*publisher, &mut unpublished, &mut settled);
        let ack_started = Instant::now();
        ack_or_warn(source, &mut settled);
        report.ack_time += ack_started.elapsed();
        report.compute_time += compute_started.elapsed();
        report.updates = learner.updates();
        report.policy_version = learner.version();
        report.samples_trained += stats.samples as u64;
        report.segments_used += used as u64;
        report.pool_segments = selector.len() as u64;
        report.window_held_segments = selector.held_segments() as u64;
        report.windows = selector.window_outcomes().map(|(_, n)| n);
        report.backlog = source.backlog();
        report.elapsed = started.elapsed();
        report.progress_at = report.elapsed;
        received_since_update = false;
        if stats.skipped_steps > 0 && rejections.record("non_finite_gradient") {
            warn!(skipped = stats.skipped_steps, "non-finite gradient; step skipped");
        }
        rejections.tick();
        control.on_update(learner, &report, &stats);
        control.on_tick(learner, &report);
    };
    // Whatever was received but not used (the selection pool) is left unacknowledged: a
    // networked transport redelivers it to the next learner.
    report.stop_reason = Some(stop_reason);
    report.elapsed = started.elapsed();
    report.pool_segments = selector.len() as u64;
    // Stopping waits on the transport for a few seconds at most: with the broker gone the
    // retries would hold the caller's final checkpoint back for their whole deadline (issue 48,
    // deliver 3). What is not confirmed is redelivered to the next learner, never lost.
    info!(reason = %stop_reason, at_most_secs = STOP_WAIT.as_secs(),
          "learner stopping: publishing the last weights and acknowledging the segments used");
    let last =
        if learner.updates().is_multiple_of(publish_every) { Ok(()) } else { publisher.publish(learner.weights()) };
    match last.and_then(|()| publisher.flush_within(STOP_WAIT)) {
        Ok(()) => {
            settled.extend(unpublished.into_iter().flat_map(|(_, tokens)| tokens));
            // `ack` also settles what `ack_later` queued.
            if let Err(err) = source.ack_within(&settled, STOP_WAIT) {
                warn!(%err, n = settled.len(), "acknowledging segments failed; they may be redelivered");
            }
        }
        // The segments behind unpublished versions stay unacknowledged: the next learner
        // trains on them again rather than never.
        Err(err) => warn!(%err, "the last weights did not go out; stopping without them (segments since the last \
                           published version will be redelivered)"),
    }
    info!(
        reason = %stop_reason,
        updates = report.updates,
        env_steps = report.env_steps,
        mean_return_100 = report.mean_return(100),
        "learner stopped"
    );
    Ok(report)
}

/// Move the tokens of updates whose version is now published to `settled`.
fn release_published(
    publisher: &dyn WeightsPublisher,
    unpublished: &mut VecDeque<(PolicyVersion, Vec<DeliveryToken>)>,
    settled: &mut Vec<DeliveryToken>,
) {
    while let Some((version, _)) = unpublished.front() {
        if !publisher.is_published(*version) {
            break;
        }
        if let Some((_, tokens)) = unpublished.pop_front() {
            settled.extend(tokens);
        }
    }
}

/// Acknowledge settled deliveries, with the next receive ([`TrajectorySource::ack_later`]).
/// A failure (broker unreachable past the transport's retry deadline) is not fatal: the
/// deliveries are redelivered later and the duplicate filter or the lag bound takes care of
/// them.
fn ack_or_warn(source: &mut dyn TrajectorySource, settled: &mut Vec<DeliveryToken>) {
    if let Err(err) = source.ack_later(settled) {
        warn!(%err, n = settled.len(), "acknowledging segments failed; they may be redelivered");
    }
    settled.clear();
}

fn limit_reached(limits: &RunLimits, report: &LearnerReport) -> Option<StopReason> {
    if let Some(target) = limits.target_return {
        if report.recent_returns.len() >= RETURN_WINDOW && report.mean_return(RETURN_WINDOW) >= target {
            return Some(StopReason::Solved);
        }
    }
    if limits.max_env_steps.is_some_and(|max| report.env_steps >= max) {
        return Some(StopReason::EnvStepBudget);
    }
    if limits.max_duration.is_some_and(|max| report.elapsed >= max) {
        return Some(StopReason::TimeBudget);
    }
    if limits.max_updates.is_some_and(|max| report.updates >= max) {
        return Some(StopReason::UpdateBudget);
    }
    None
}
