//! The learner loop: receive, check, batch, update, publish, acknowledge.
//!
//! Acknowledgement guarantee: a segment is acknowledged only after the update it fed has been
//! applied to the parameters and the resulting version published (a publisher that publishes
//! in the background says when, [`WeightsPublisher::is_published`]; the segments wait until
//! then, while the learner goes on with the next updates) (or after it was dropped by
//! trajectory selection or rejected as malformed, which are final decisions). A crash before
//! that point leaves the segment unacknowledged, so a networked transport redelivers it. Which
//! segments feed an update, and with what weight, is [`crate::select::selection`]'s decision.

use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use tracing::{info, warn};
use volley_core::spec::RunSpec;
use volley_core::wire::TrajectorySegment;
use volley_transport::nats::CONSUMER_MAX_ACK_PENDING;
use volley_transport::{Delivery, DeliveryToken, TrajectorySource, TransportError, WeightsPublisher};

use crate::batch::SegmentBatch;
use crate::ingest::Intake;
use crate::learner::{Learner, UpdateStats};
use crate::publish::Unpublished;
use crate::report::{Bookkeeping, LearnerReport, Phase, StopReason, RETURN_WINDOW};
use crate::select::selection::{Dropped, Selector};

/// When the learner loop stops by itself.
#[derive(Debug, Clone, Default)]
pub struct RunLimits {
    /// Stop after consuming this many environment steps.
    pub max_env_steps: Option<u64>,
    /// Stop after this much wall time.
    pub max_duration: Option<Duration>,
    /// Stop once the mean return of the last 100 episodes reaches this ("solved"). The window
    /// holds only admitted, fresh episodes, at most `hyper.trust.max_actor_return_share` of it
    /// from any one actor identity (the actor id of the subject a segment came on, which broker
    /// permissions bind to its credentials), so a full window needs at least ⌈1/share⌉
    /// identities and one identity moves its mean by at most its share of the return range
    /// (docs/SECURITY.md, "Actor identities").
    pub target_return: Option<f32>,
    /// Stop after this many updates.
    pub max_updates: Option<u64>,
    /// Publish weights every this many updates (1 = every update).
    pub publish_every: u64,
    /// Environment steps consumed before this loop started (a resumed learner's budget).
    pub resume_env_steps: u64,
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

/// The most deliveries the learner's NATS consumer hands out unacknowledged, as a `usize`.
const NATS_MAX_ACK_PENDING: usize = CONSUMER_MAX_ACK_PENDING as usize;

/// How long one receive waits for data: the loop's tick while nothing arrives.
const RECV_WAIT: Duration = Duration::from_millis(100);

/// How long a stopping learner waits on its transport (the last weights publish, the last
/// acks) before it returns, so the caller's final checkpoint follows within seconds.
pub const STOP_WAIT: Duration = Duration::from_secs(3);

/// Run the learner until a limit, `stop`, or the source closing.
///
/// Each pass reads recv → admit (`Intake`) → select ([`Selector`]) → update
/// ([`Learner::update`]) → publish → ack; the report's bookkeeping is `Bookkeeping`'s.
pub fn run_learner(
    learner: &mut Learner,
    source: &mut dyn TrajectorySource,
    publisher: &mut dyn WeightsPublisher,
    limits: &RunLimits,
    stop: &AtomicBool,
    control: &mut dyn LearnerControl,
) -> Result<LearnerReport, TransportError> {
    let spec = learner.spec().clone();
    let mut book = Bookkeeping::start(learner, limits.resume_env_steps, spec.hyper.trust.max_actor_return_share);
    let mut selector = Selector::new(&spec);
    let mut intake = Intake::new(learner);
    log_selection(&spec, &selector);
    let publish_every = limits.publish_every.max(1);
    publisher.publish(learner.weights())?;
    let mut incoming: Vec<Delivery> = Vec::with_capacity(selector.pool_target());
    let mut dropped: Vec<Dropped> = Vec::new();
    let mut settled: Vec<DeliveryToken> = Vec::new();
    let mut batch = SegmentBatch::default();
    let mut unpublished = Unpublished::new(spec.hyper.max_policy_lag);
    let stop_reason = loop {
        book.tick();
        if stop.load(Ordering::Acquire) {
            break StopReason::Interrupted;
        }
        if let Some(reason) = limit_reached(limits, &book.report) {
            break reason;
        }
        // Receive.
        let wait_started = Instant::now();
        let want = selector.pool_target().saturating_sub(selector.len());
        match source.recv(want, RECV_WAIT, &mut incoming) {
            Ok(_) => book.waited(wait_started, incoming.is_empty()),
            Err(TransportError::Closed) => break StopReason::SourceClosed,
            Err(err) => {
                // A tick, so the signals keep moving through an outage.
                warn!(%err, "receiving segments failed; retrying");
                book.waited(wait_started, true);
                control.on_tick(learner, &book.report);
                continue;
            }
        }
        // Admit, and offer to selection.
        for delivery in incoming.drain(..) {
            let Some((segment, token)) =
                intake.admit(delivery, learner.version(), source, &mut book.report, &mut settled)
            else {
                continue;
            };
            book.admitted(&segment, learner.version(), limits.target_return);
            control.on_segment(&segment);
            let (pool_before, dropped_before) = (selector.len(), dropped.len());
            selector.offer(segment, token, learner.version(), &mut dropped);
            // Data the learner could decide on (pooled or dropped) and no update following is a
            // stall; a segment that only waits for its stitched window's next ones is not.
            if selector.len() != pool_before || dropped.len() != dropped_before {
                book.data_arrived();
            }
        }
        // Select. Priority sampling scores new segments with the learner's own forward pass,
        // on its backend: no weights leave the device for it.
        let compute_started = Instant::now();
        let ready = selector.prepare(learner.version(), learner, &mut dropped);
        for drop in dropped.drain(..) {
            book.report.count_drop(drop.reason);
            settled.push(drop.token);
        }
        book.report.groups = selector.group_stats();
        unpublished.release_published(&*publisher, &mut settled);
        if !settled.is_empty() {
            book.time(Phase::Ack, || ack_or_warn(source, &mut settled));
        }
        if !ready {
            book.pass_without_update(compute_started, &selector, source);
            intake.rejections.tick();
            control.on_tick(learner, &book.report);
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
        // Update.
        let stats = book.time(Phase::Update, || learner.update(&batch));
        // Publish.
        let published = learner.updates().is_multiple_of(publish_every);
        if published {
            book.time(Phase::Publish, || publisher.publish(learner.weights()))?;
        }
        let used = selector.settle_drawn(&mut settled);
        // A publisher that fell behind (a broker outage, a slow store) holds the learner back,
        // as a synchronous one did: otherwise it runs `max_policy_lag` versions ahead of what
        // actors can have, and every segment after that is dropped as stale.
        if published && !publisher.is_published(learner.version()) && unpublished.hold(learner.version(), &mut settled)
        {
            book.time(Phase::Publish, || publisher.flush())?;
        }
        // Acknowledge what the published versions used.
        unpublished.release_published(&*publisher, &mut settled);
        book.time(Phase::Ack, || ack_or_warn(source, &mut settled));
        book.pass_with_update(compute_started, learner, &stats, used, &selector, source);
        if stats.skipped_steps > 0 && intake.rejections.record("non_finite_gradient") {
            warn!(skipped = stats.skipped_steps, "non-finite gradient; step skipped");
        }
        intake.rejections.tick();
        control.on_update(learner, &book.report, &stats);
        control.on_tick(learner, &book.report);
    };
    // Whatever was received but not used (the selection pool) is left unacknowledged: a
    // networked transport redelivers it to the next learner.
    book.stopped(stop_reason, &selector);
    finish(learner, source, publisher, publish_every, unpublished, settled, stop_reason);
    let report = book.report;
    info!(
        reason = %stop_reason,
        updates = report.updates,
        env_steps = report.env_steps,
        mean_return_100 = report.mean_return(100),
        "learner stopped"
    );
    Ok(report)
}

/// Say how selection runs, and warn when its pool cannot fill over NATS.
fn log_selection(spec: &RunSpec, selector: &Selector) {
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
}

/// Publish the last weights and acknowledge the segments used, waiting on the transport for
/// [`STOP_WAIT`] at most: with the broker gone the retries would hold the caller's final
/// checkpoint back for their whole deadline (issue 48, deliver 3). What is not confirmed is
/// redelivered to the next learner, never lost.
fn finish(
    learner: &mut Learner,
    source: &mut dyn TrajectorySource,
    publisher: &mut dyn WeightsPublisher,
    publish_every: u64,
    unpublished: Unpublished,
    mut settled: Vec<DeliveryToken>,
    stop_reason: StopReason,
) {
    info!(reason = %stop_reason, at_most_secs = STOP_WAIT.as_secs(),
          "learner stopping: publishing the last weights and acknowledging the segments used");
    let last =
        if learner.updates().is_multiple_of(publish_every) { Ok(()) } else { publisher.publish(learner.weights()) };
    match last.and_then(|()| publisher.flush_within(STOP_WAIT)) {
        Ok(()) => {
            unpublished.release_all(&mut settled);
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
