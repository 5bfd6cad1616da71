//! The learner loop's report: running totals, returns and timings ([`LearnerReport`]), and the
//! bookkeeping that keeps them (`Bookkeeping`), so the loop in [`crate::consume`] reads as
//! its stages.

use std::collections::{HashMap, VecDeque};
use std::time::{Duration, Instant};

use volley_core::ids::PolicyVersion;
use volley_core::wire::TrajectorySegment;
use volley_transport::TrajectorySource;

use crate::ingest::admission::identity_key;
use crate::learner::{Learner, UpdateStats};
use crate::select::selection::{DropReason, GroupStats, Selector};
use crate::select::windows::WindowOutcome;

/// Episodes in the return window behind `mean_return(100)` and the solved stop.
pub const RETURN_WINDOW: usize = 100;

/// Buckets of [`LearnerReport::lag_histogram`] (the last counts every larger lag).
const LAG_BUCKETS: usize = 65;

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
    /// segments only, at most `max_returns_per_actor` of them from any one actor identity.
    pub recent_returns: VecDeque<f32>,
    /// `recent_returns[i]` came from the actor identity whose key
    /// ([`crate::ingest::admission::identity_key`]) is `recent_actors[i]`.
    pub recent_actors: VecDeque<u64>,
    /// How many entries of the window one actor identity may hold (`hyper.trust`; 0 = the window).
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

    pub(crate) fn count_drop(&mut self, reason: DropReason) {
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
        // The identity, not the id as written: ids that differ in case share a subject and so
        // a credential (issue 46 item 3).
        let actor = identity_key(segment);
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

/// Where the loop's time goes, besides waiting for data (the parts of
/// [`LearnerReport::compute_time`] the report breaks out).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Phase {
    /// The update itself ([`LearnerReport::update_time`]).
    Update,
    /// Handing weights to the publisher, or waiting for it ([`LearnerReport::publish_time`]).
    Publish,
    /// Acknowledging segments ([`LearnerReport::ack_time`]).
    Ack,
}

/// The learner loop's bookkeeping: the [`LearnerReport`] it keeps, the clock behind its
/// timings, and the progress signal ([`LearnerReport::progress_at`]).
#[derive(Debug)]
pub(crate) struct Bookkeeping {
    /// The report so far.
    pub(crate) report: LearnerReport,
    started: Instant,
    /// Whether valid data arrived since the last update (then only an update is progress).
    received_since_update: bool,
}

impl Bookkeeping {
    /// Start the clock: the report of a loop at `learner`'s version, `resume_env_steps`
    /// consumed before it, with at most `max_actor_return_share` of the return window from
    /// any one actor id.
    pub(crate) fn start(learner: &Learner, resume_env_steps: u64, max_actor_return_share: f32) -> Self {
        let report = LearnerReport {
            policy_version: learner.version(),
            env_steps: resume_env_steps,
            lag_histogram: vec![0; LAG_BUCKETS],
            max_returns_per_actor: ((max_actor_return_share as f64 * RETURN_WINDOW as f64).ceil() as usize)
                .clamp(1, RETURN_WINDOW),
            ..LearnerReport::default()
        };
        Bookkeeping { report, started: Instant::now(), received_since_update: false }
    }

    /// Bring [`LearnerReport::elapsed`] up to now.
    pub(crate) fn tick(&mut self) {
        self.report.elapsed = self.started.elapsed();
    }

    /// A receive that began at `since` returned; with `nothing_new` (nothing arrived, or it
    /// failed) and no data since the last update, waiting for actors or for the broker is
    /// not the learner's fault, so it counts as progress.
    pub(crate) fn waited(&mut self, since: Instant, nothing_new: bool) {
        self.report.wait_time += since.elapsed();
        self.tick();
        if nothing_new && !self.received_since_update {
            self.report.progress_at = self.report.elapsed;
        }
    }

    /// Data the learner can decide on (pooled or dropped) arrived: until the next update, the
    /// loop is not making progress.
    pub(crate) fn data_arrived(&mut self) {
        self.received_since_update = true;
    }

    /// An admitted, first-seen segment: its steps, its episodes' returns (towards
    /// `target_return`) and its lag behind `version`.
    pub(crate) fn admitted(&mut self, segment: &TrajectorySegment, version: PolicyVersion, target_return: Option<f32>) {
        let report = &mut self.report;
        report.segments_received += 1;
        report.env_steps += segment.len() as u64;
        report.record_episodes(segment, target_return);
        let lag = version.lag_of(segment.policy_version);
        report.lag_histogram[(lag as usize).min(LAG_BUCKETS - 1)] += 1;
    }

    /// Run `work`, counting its time in `phase`.
    pub(crate) fn time<T>(&mut self, phase: Phase, work: impl FnOnce() -> T) -> T {
        let started = Instant::now();
        let outcome = work();
        let spent = started.elapsed();
        *match phase {
            Phase::Update => &mut self.report.update_time,
            Phase::Publish => &mut self.report.publish_time,
            Phase::Ack => &mut self.report.ack_time,
        } += spent;
        outcome
    }

    /// A pass that computed from `compute_started` without an update (the pool not ready).
    pub(crate) fn pass_without_update(
        &mut self,
        compute_started: Instant,
        selector: &Selector,
        source: &dyn TrajectorySource,
    ) {
        self.report.compute_time += compute_started.elapsed();
        self.tick();
        self.refresh_pool(selector, source);
    }

    /// A pass that computed from `compute_started` and applied an update: `learner`'s new
    /// version, the update's `stats`, and `used` distinct segments. An update is progress.
    pub(crate) fn pass_with_update(
        &mut self,
        compute_started: Instant,
        learner: &Learner,
        stats: &UpdateStats,
        used: usize,
        selector: &Selector,
        source: &dyn TrajectorySource,
    ) {
        let report = &mut self.report;
        report.compute_time += compute_started.elapsed();
        report.updates = learner.updates();
        report.policy_version = learner.version();
        report.samples_trained += stats.samples as u64;
        report.segments_used += used as u64;
        self.refresh_pool(selector, source);
        self.tick();
        self.report.progress_at = self.report.elapsed;
        self.received_since_update = false;
    }

    /// What the selector holds and the transport's backlog, as of now.
    fn refresh_pool(&mut self, selector: &Selector, source: &dyn TrajectorySource) {
        let report = &mut self.report;
        report.pool_segments = selector.len() as u64;
        report.window_held_segments = selector.held_segments() as u64;
        report.windows = selector.window_outcomes().map(|(_, n)| n);
        report.backlog = source.backlog();
    }

    /// The loop stopped for `reason`: the final report, its clock and pool brought up to now.
    pub(crate) fn stopped(&mut self, reason: StopReason, selector: &Selector) {
        self.report.stop_reason = Some(reason);
        self.tick();
        self.report.pool_segments = selector.len() as u64;
    }
}
