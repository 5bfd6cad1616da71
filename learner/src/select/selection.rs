//! Trajectory selection: which received segments feed a gradient step, and with what weight.
//!
//! Validated, de-duplicated segments enter through [`Selector::offer`]; with stitched BPTT
//! windows (`hyper.bptt.segments` K > 1) they wait in a [`WindowAssembler`] until K consecutive
//! segments of their stream are there, and the pool's unit is then a window (one batch column
//! of K·T steps; a batch is `batch_segments / K` windows). Before each step
//! [`Selector::prepare`] runs the filters over the pool, [`Selector::draw`] picks the batch's
//! columns and their loss weights, and [`Selector::settle_drawn`] hands back the drawn
//! segments' tokens once the update is published. The filters, in order (a segment is dropped
//! and counted by the first one it fails; docs/ARCHITECTURE.md, "Trajectory selection"):
//!
//! 1. **lag bound** ([`DropReason::Stale`]): lag above `max_policy_lag`, on arrival and again
//!    before every step for segments still waiting in the pool;
//! 2. **guard** ([`DropReason::OutOfRange`], [`DropReason::NonFinite`]): a raw reward above
//!    `max_abs_reward`, a scaled-and-bootstrapped reward or episode return that is not finite,
//!    on arrival; with priority sampling also a non-finite learner-side value or advantage,
//!    found by the priority forward of step 4;
//! 3. **zero variance** ([`DropReason::ZeroVariance`]): the segment's start group has recent
//!    returns that are all equal;
//! 4. **priority sampling**: draw `batch_segments` columns from the pool with probability
//!    `p_i ∝ priority_i^α` and weight each by its normalised importance weight.
//!
//! **Group rollouts** (`work.group_size > 1`, with `hyper.baseline` a group baseline or the
//! zero-variance filter on): a segment with steps of a group member waits in a **hold**,
//! outside the pool, until every group it touches is complete ([`crate::select::groups`]); then it
//! enters the pool with its group advantages, or is dropped as zero-variance when every step
//! belongs to a group whose returns are all equal. The hold is bounded: a segment whose lag
//! reaches `max_policy_lag`, whose group was forgotten, or that is the oldest when the hold
//! exceeds `work.group_hold_segments` or `work.group_hold_bytes`, enters the pool without
//! group advantages (the critic's), counted in [`GroupStats`].
//!
//! Acknowledgement invariant: every token offered leaves the selector exactly once, either in
//! `dropped` (a final decision: ack it now) or from [`Selector::settle_drawn`] (ack it once
//! the update it fed is published); until then it waits in the pool, unacknowledged, and a
//! networked transport redelivers it if the learner dies.

use std::collections::{HashMap, VecDeque};
use std::time::Instant;

use rand::SeedableRng;
use rand_pcg::Pcg64Mcg;
use tracing::debug;
use volley_core::ids::PolicyVersion;
use volley_core::spec::{Baseline, GuardConfig, PriorityConfig, RunSpec, ZeroVarianceConfig};
use volley_core::wire::TrajectorySegment;
use volley_core::work::GroupMember;
use volley_transport::DeliveryToken;

use crate::batch::SegmentBatch;
use crate::select::groups::{GroupCounters, GroupState, GroupTable, MAX_TRACKED_GROUPS};
use crate::select::priority::{importance_weights, sample_with_replacement, sampling_probabilities};
use crate::select::windows::{Window, WindowAssembler, WindowOutcome};
use crate::train::ValueEstimates;

/// Why selection dropped a segment for good (the `outcome` label of
/// `volley_learner_segments_total`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum DropReason {
    /// Lag above `max_policy_lag`.
    Stale,
    /// A derived value (scaled reward, episode return, learner value or advantage) is not finite.
    NonFinite,
    /// A raw reward exceeds `max_abs_reward`.
    OutOfRange,
    /// The segment's start group has recent returns with zero variance, or (group rollouts)
    /// every step belongs to a complete group of continuations whose returns are all equal.
    ZeroVariance,
}

impl DropReason {
    /// Every reason, in filter order.
    pub const ALL: [DropReason; 4] =
        [DropReason::Stale, DropReason::NonFinite, DropReason::OutOfRange, DropReason::ZeroVariance];

    /// The metric label value.
    pub fn as_str(self) -> &'static str {
        match self {
            DropReason::Stale => "stale",
            DropReason::NonFinite => "non_finite",
            DropReason::OutOfRange => "out_of_range",
            DropReason::ZeroVariance => "zero_variance",
        }
    }
}

/// Drop a whole window: one [`Dropped`] per segment delivery, all for `reason`.
fn drop_window(window: &Window, reason: DropReason, dropped: &mut Vec<Dropped>) {
    debug!(reason = reason.as_str(), segments = window.segments.len(), "window dropped by selection");
    dropped.extend(window.tokens.iter().map(|&token| Dropped { token, reason }));
}

/// A segment selection dropped; its token is to be acknowledged at once.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Dropped {
    /// The delivery to acknowledge.
    pub token: DeliveryToken,
    /// Why it was dropped.
    pub reason: DropReason,
}

/// Where priority sampling gets its values: the learner's forward pass on its own backend
/// ([`crate::Learner::values_and_advantages`]), so no weights leave the device for it.
pub trait ValueSource {
    /// Values and GAE(γ, `gae_lambda`) advantages of `batch` under the current parameters, into
    /// `out` (resized).
    fn values_and_advantages(&mut self, batch: &SegmentBatch, gae_lambda: f32, out: &mut ValueEstimates);
}

impl ValueSource for crate::Learner {
    fn values_and_advantages(&mut self, batch: &SegmentBatch, gae_lambda: f32, out: &mut ValueEstimates) {
        crate::Learner::values_and_advantages(self, batch, gae_lambda, out);
    }
}

/// The columns of the next batch: windows of consecutive segments (one segment each without
/// stitching; a window drawn twice appears twice) and their loss weights (the
/// `column_weights` of [`SegmentBatch::fill_windows`]).
#[derive(Debug)]
pub struct Draw<'a> {
    /// One window per column.
    pub windows: Vec<&'a [TrajectorySegment]>,
    /// One weight per column, in (0, 1].
    pub column_weights: &'a [f32],
    /// Segments per full window (K): the batch's columns are K·T steps long.
    pub window_segments: usize,
    /// Per column, the group advantages of its steps (`[T]`, NaN: the critic's), for
    /// [`SegmentBatch::set_advantage_override`].
    pub advantages: Vec<Option<&'a [f32]>>,
}

/// What the group hold did (exported as `volley_learner_group_segments_total{outcome}` and
/// the group gauges; docs/OPERATIONS.md).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct GroupStats {
    /// Segments that entered the pool once their groups were complete.
    pub segments_grouped: u64,
    /// Segments released to the critic because their lag reached `max_policy_lag`.
    pub segments_critic_lag: u64,
    /// Segments released to the critic because the hold exceeded its segment or byte bound.
    pub segments_critic_capacity: u64,
    /// Segments released to the critic because a group they touch was forgotten or broken.
    pub segments_critic_lost: u64,
    /// Segments waiting in the hold now.
    pub held_segments: u64,
    /// Approximate bytes of the segments waiting in the hold now.
    pub held_bytes: u64,
    /// The group table's counters.
    pub groups: GroupCounters,
}

/// Why a held segment left the hold.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Release {
    /// Every group it touches is complete (or broken).
    Resolved,
    /// Its lag reached the bound.
    Lag,
    /// The hold was over its bounds and it was the oldest.
    Capacity,
    /// A group it touches is no longer known.
    Lost,
}

/// Approximate heap bytes of a segment (its arrays; the hold's byte bound).
fn segment_bytes(segment: &TrajectorySegment) -> usize {
    segment.observations.size_bytes()
        + 4 * (segment.actions.len()
            + segment.continuous_actions.len()
            + 3 * segment.rewards.len()
            + segment.initial_hidden.len())
        + 2 * segment.rewards.len()
        + 64 * (segment.finished_episodes.len() + segment.saved_snapshots.len() + segment.episode_groups.len())
}

/// `(task_id, start_snapshot)`: segments that share a start.
type GroupKey = (u32, Option<String>);

/// How many start groups the zero-variance filter remembers; the oldest is forgotten first.
const MAX_GROUPS: usize = 4096;

/// The returns of the last `window` finished episodes of each start group, for the
/// zero-variance filter. Bounded: at most `capacity` groups, evicted oldest first.
#[derive(Debug, Clone)]
pub struct GroupReturns {
    window: usize,
    capacity: usize,
    groups: HashMap<GroupKey, VecDeque<f32>>,
    order: VecDeque<GroupKey>,
}

impl GroupReturns {
    /// Remember `window` returns per group for at most `capacity` groups.
    pub fn new(window: usize, capacity: usize) -> Self {
        GroupReturns {
            window: window.max(1),
            capacity: capacity.max(1),
            groups: HashMap::new(),
            order: VecDeque::new(),
        }
    }

    /// Record one finished episode of the group `(task_id, start_snapshot)`.
    pub fn record(&mut self, task_id: u32, start_snapshot: Option<&str>, episode_return: f32) {
        let key = (task_id, start_snapshot.map(str::to_owned));
        if !self.groups.contains_key(&key) {
            if self.groups.len() == self.capacity {
                if let Some(oldest) = self.order.pop_front() {
                    self.groups.remove(&oldest);
                }
            }
            self.order.push_back(key.clone());
        }
        let returns = self.groups.entry(key).or_default();
        if returns.len() == self.window {
            returns.pop_front();
        }
        returns.push_back(episode_return);
    }

    /// Whether the group's window is full and its returns spread by at most `tolerance`.
    pub fn is_zero_variance(&self, task_id: u32, start_snapshot: Option<&str>, tolerance: f32) -> bool {
        let key = (task_id, start_snapshot.map(str::to_owned));
        let Some(returns) = self.groups.get(&key) else {
            return false;
        };
        if returns.len() < self.window {
            return false;
        }
        let (min, max) = returns.iter().fold((f32::INFINITY, f32::NEG_INFINITY), |(lo, hi), &r| (lo.min(r), hi.max(r)));
        max - min <= tolerance
    }

    /// Groups remembered.
    pub fn len(&self) -> usize {
        self.groups.len()
    }

    /// Whether no group is remembered.
    pub fn is_empty(&self) -> bool {
        self.groups.is_empty()
    }
}

/// A window (one segment without stitching) waiting in the pool.
#[derive(Debug)]
struct Candidate {
    window: Window,
    /// `mean_t |A_t| + ε` over the window's steps, computed by the priority forward
    /// (priority sampling only).
    priority: Option<f32>,
    /// Group advantages per step (`[T]`, NaN: the critic's), when any step has one.
    advantages: Option<Vec<f32>>,
}

/// The learner's trajectory selection: the pool of candidate segments and the filters and
/// sampler over it (see the module docs for the order and the acknowledgement invariant).
pub struct Selector {
    /// Windows per batch (`batch_segments / K`).
    batch_windows: usize,
    /// Windows the pool holds before a batch is drawn.
    pool_target: usize,
    window_segments: usize,
    assembler: WindowAssembler,
    assembled: Vec<Window>,
    max_policy_lag: u64,
    gamma: f32,
    reward_scale: f32,
    gae_lambda: f32,
    guard: GuardConfig,
    zero_variance: Option<ZeroVarianceConfig>,
    priority: Option<PriorityConfig>,
    groups: GroupReturns,
    /// Group rollouts: the returns of recent groups of continuations.
    group_table: Option<GroupTable>,
    baseline: Baseline,
    /// Whether group segments wait in the hold (group baselines or the zero-variance filter).
    hold_enabled: bool,
    hold: VecDeque<(Candidate, usize)>,
    hold_max_segments: usize,
    hold_max_bytes: usize,
    group_stats: GroupStats,
    pool: Vec<Candidate>,
    rng: Pcg64Mcg,
    // Scratch, reused across steps.
    scratch: SegmentBatch,
    ones: Vec<f32>,
    estimates: ValueEstimates,
    unscored: Vec<usize>,
    priorities: Vec<f32>,
    probs: Vec<f64>,
    cumulative: Vec<f64>,
    drawn: Vec<usize>,
    weights: Vec<f32>,
    taken: Vec<bool>,
}

impl std::fmt::Debug for Selector {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Selector")
            .field("pool", &self.pool.len())
            .field("held_segments", &self.assembler.held_segments())
            .field("pool_target", &self.pool_target)
            .field("guard", &self.guard)
            .field("zero_variance", &self.zero_variance)
            .field("priority", &self.priority)
            .finish()
    }
}

impl Selector {
    /// A selector for a validated run spec and its parameter layout.
    pub fn new(spec: &RunSpec) -> Self {
        let h = &spec.hyper;
        let selection = &h.selection;
        let window = selection.zero_variance.as_ref().map_or(1, |z| z.min_group);
        let work = &h.work;
        let grouped = work.enabled && work.group_size > 1;
        let window_segments = h.bptt.segments.max(1);
        Selector {
            group_table: grouped.then(|| GroupTable::new(work.group_size, MAX_TRACKED_GROUPS)),
            baseline: h.baseline,
            hold_enabled: grouped && (h.baseline.uses_groups() || selection.zero_variance.is_some()),
            hold: VecDeque::new(),
            hold_max_segments: work.group_hold_segments as usize,
            hold_max_bytes: usize::try_from(work.group_hold_bytes).unwrap_or(usize::MAX),
            group_stats: GroupStats::default(),
            batch_windows: (h.batch_segments / window_segments).max(1),
            pool_target: (selection.pool_segments(h.batch_segments) / window_segments).max(1),
            window_segments,
            assembler: WindowAssembler::new(&h.bptt, h.max_policy_lag),
            assembled: Vec::new(),
            max_policy_lag: h.max_policy_lag,
            gamma: h.gamma,
            reward_scale: h.reward_scale,
            gae_lambda: h.gae_lambda,
            guard: selection.guard.clone(),
            zero_variance: selection.zero_variance.clone(),
            priority: selection.priority.clone(),
            groups: GroupReturns::new(window, MAX_GROUPS),
            pool: Vec::new(),
            rng: Pcg64Mcg::seed_from_u64(spec.seed ^ 0x5e1e_c7ed),
            scratch: SegmentBatch::default(),
            ones: Vec::new(),
            estimates: ValueEstimates::default(),
            unscored: Vec::new(),
            priorities: Vec::new(),
            probs: Vec::new(),
            cumulative: Vec::new(),
            drawn: Vec::new(),
            weights: Vec::new(),
            taken: Vec::new(),
        }
    }

    /// Segments the pool holds before a batch is drawn (`batch_segments`, or
    /// `pool_factor × batch_segments` with priority sampling), counted as full windows.
    pub fn pool_target(&self) -> usize {
        self.pool_target * self.window_segments
    }

    /// Segments waiting in the pool (in windows ready to be drawn; not those held for
    /// incomplete windows: [`Selector::held_segments`]).
    pub fn len(&self) -> usize {
        self.pool.iter().map(|c| c.window.segments.len()).sum()
    }

    /// Segments held for incomplete stitched windows (unacknowledged, not yet in the pool).
    pub fn held_segments(&self) -> usize {
        self.assembler.held_segments()
    }

    /// Windows formed so far, by outcome (all `full` without stitching).
    pub fn window_outcomes(&self) -> [(WindowOutcome, u64); WindowOutcome::ALL.len()] {
        self.assembler.outcomes()
    }

    /// Whether the pool is empty.
    pub fn is_empty(&self) -> bool {
        self.pool.is_empty()
    }

    /// Segments waiting in the group hold (not in the pool, not acknowledged).
    pub fn held(&self) -> usize {
        self.hold.len()
    }

    /// What the group hold and the group table did so far.
    pub fn group_stats(&self) -> GroupStats {
        GroupStats {
            held_segments: self.hold.len() as u64,
            held_bytes: self.hold.iter().map(|(_, bytes)| *bytes as u64).sum(),
            groups: self.group_table.as_ref().map(GroupTable::counters).unwrap_or_default(),
            ..self.group_stats
        }
    }

    /// Whether [`prepare`](Self::prepare) asks its [`ValueSource`] for values (priority sampling).
    pub fn needs_values(&self) -> bool {
        self.priority.is_some()
    }

    /// Offer a validated, de-duplicated segment received while the learner is at `version`.
    /// Its finished episodes are recorded for the zero-variance filter whatever happens next;
    /// then the lag bound and the guard run, and a segment that fails is appended to `dropped`.
    /// One that passes joins its stream's window (or the pool directly, without stitching).
    pub fn offer(
        &mut self,
        segment: TrajectorySegment,
        token: DeliveryToken,
        version: PolicyVersion,
        dropped: &mut Vec<Dropped>,
    ) {
        self.offer_at(segment, token, version, Instant::now(), dropped);
    }

    /// [`offer`](Self::offer), arriving at `now` (stitched windows time out by it).
    pub fn offer_at(
        &mut self,
        segment: TrajectorySegment,
        token: DeliveryToken,
        version: PolicyVersion,
        now: Instant,
        dropped: &mut Vec<Dropped>,
    ) {
        if let Some(table) = &mut self.group_table {
            for episode in &segment.finished_episodes {
                table.record(episode);
            }
        }
        if self.zero_variance.is_some() {
            // Episodes of a group of continuations count towards their group, not their start.
            let ungrouped = |e: &&volley_core::wire::EpisodeSummary| e.group.is_none() || self.group_table.is_none();
            for episode in segment.finished_episodes.iter().filter(|e| e.episode_return.is_finite()).filter(ungrouped) {
                self.groups.record(segment.task_id, segment.start_snapshot.as_deref(), episode.episode_return);
            }
        }
        let lag = version.lag_of(segment.policy_version);
        let reason = if lag > self.max_policy_lag {
            Some(DropReason::Stale)
        } else if self.guard.enabled {
            guard_check(&segment, &self.guard, self.gamma, self.reward_scale)
        } else {
            None
        };
        match reason {
            Some(reason) => {
                debug!(reason = reason.as_str(), lag, actor = %segment.actor, segment_idx = segment.segment_idx, "segment dropped by selection");
                dropped.push(Dropped { token, reason });
            }
            None if self.hold_enabled && segment.episode_groups.iter().any(Option::is_some) => {
                let table = self.group_table.as_mut().expect("the hold needs the group table");
                for tag in segment.episode_groups.iter().flatten() {
                    table.touch(tag);
                }
                let bytes = segment_bytes(&segment);
                let window = Window::single(segment, token);
                self.hold.push_back((Candidate { window, priority: None, advantages: None }, bytes));
            }
            None => {
                self.assembler.offer(segment, token, now, &mut self.assembled);
                self.pool.extend(self.assembled.drain(..).map(|window| Candidate {
                    window,
                    priority: None,
                    advantages: None,
                }));
            }
        }
    }

    /// Move held segments whose groups are complete into the pool (with their group
    /// advantages, or dropped as zero-variance), and release to the critic those at the lag
    /// bound, those whose group is gone, and the oldest beyond the hold's bounds.
    fn release_held(&mut self, version: PolicyVersion, dropped: &mut Vec<Dropped>) {
        if self.hold.is_empty() {
            return;
        }
        let table = self.group_table.as_ref().expect("the hold needs the group table");
        let max_lag = self.max_policy_lag;
        let mut kept = VecDeque::with_capacity(self.hold.len());
        let mut released = Vec::new();
        for (candidate, bytes) in self.hold.drain(..) {
            // Held windows are single segments: the spec refuses groups with stitched windows.
            let states = candidate
                .window
                .segments
                .iter()
                .flat_map(|s| s.episode_groups.iter().flatten())
                .map(|tag| table.state(tag.group));
            let (mut unknown, mut waiting) = (false, false);
            for state in states {
                match state {
                    GroupState::Unknown | GroupState::Broken => unknown = true,
                    GroupState::Incomplete => waiting = true,
                    GroupState::Complete => {}
                }
            }
            let lag = version.lag_of(candidate.window.oldest_version());
            if unknown {
                released.push((candidate, Release::Lost));
            } else if !waiting {
                released.push((candidate, Release::Resolved));
            } else if lag >= max_lag {
                released.push((candidate, Release::Lag));
            } else {
                kept.push_back((candidate, bytes));
            }
        }
        let mut held_bytes: usize = kept.iter().map(|(_, bytes)| bytes).sum();
        while kept.len() > self.hold_max_segments || held_bytes > self.hold_max_bytes {
            let Some((candidate, bytes)) = kept.pop_front() else { break };
            held_bytes -= bytes;
            released.push((candidate, Release::Capacity));
        }
        self.hold = kept;
        for (candidate, why) in released {
            self.release(candidate, why, dropped);
        }
    }

    /// One held segment leaves the hold: counted, its group advantages computed, and into the
    /// pool, unless every step belongs to a zero-variance group and the filter is on.
    fn release(&mut self, mut candidate: Candidate, why: Release, dropped: &mut Vec<Dropped>) {
        let table = self.group_table.as_ref().expect("the hold needs the group table");
        let stats = &mut self.group_stats;
        match why {
            Release::Resolved => stats.segments_grouped += 1,
            Release::Lag => stats.segments_critic_lag += 1,
            Release::Capacity => stats.segments_critic_capacity += 1,
            Release::Lost => stats.segments_critic_lost += 1,
        }
        let segments = &candidate.window.segments;
        if let Some(zero) = &self.zero_variance {
            let all_flat = segments
                .iter()
                .flat_map(|s| s.step_groups())
                .all(|tag| tag.is_some_and(|tag| table.is_zero_variance(tag.group, zero.tolerance)));
            if all_flat {
                drop_window(&candidate.window, DropReason::ZeroVariance, dropped);
                return;
            }
        }
        if self.baseline.uses_groups() {
            let divide_by_std = self.baseline == Baseline::GroupStd;
            let scale = self.reward_scale;
            let advantage = |tag: Option<GroupMember>| {
                tag.and_then(|tag| table.advantage(&tag, scale, divide_by_std)).unwrap_or(f32::NAN)
            };
            let advantages: Vec<f32> = segments.iter().flat_map(|s| s.step_groups()).map(advantage).collect();
            if advantages.iter().any(|a| a.is_finite()) {
                candidate.advantages = Some(advantages);
            }
        }
        self.pool.push(candidate);
    }

    /// Run the filters over the pool at learner `version`, appending what they drop to
    /// `dropped`; true when a batch can be drawn. With priority sampling, new segments are scored
    /// with values and advantages from `values` (the learner's backend).
    pub fn prepare(
        &mut self,
        version: PolicyVersion,
        values: &mut dyn ValueSource,
        dropped: &mut Vec<Dropped>,
    ) -> bool {
        self.prepare_at(version, Instant::now(), values, dropped)
    }

    /// [`prepare`](Self::prepare) at `now`: first flush incomplete windows that timed out or
    /// reached the lag bound into the pool, as shorter windows.
    pub fn prepare_at(
        &mut self,
        version: PolicyVersion,
        now: Instant,
        values: &mut dyn ValueSource,
        dropped: &mut Vec<Dropped>,
    ) -> bool {
        self.assembler.expire(now, version, &mut self.assembled);
        self.pool.extend(self.assembled.drain(..).map(|window| Candidate { window, priority: None, advantages: None }));
        self.release_held(version, dropped);
        let max_lag = self.max_policy_lag;
        self.pool.retain(|candidate| {
            let lag = version.lag_of(candidate.window.oldest_version());
            if lag <= max_lag {
                return true;
            }
            debug!(lag, "window aged out of the selection pool");
            drop_window(&candidate.window, DropReason::Stale, dropped);
            false
        });
        if let Some(zero) = &self.zero_variance {
            let groups = &self.groups;
            let by_fork = self.group_table.is_some();
            self.pool.retain(|candidate| {
                // Group segments were judged by their groups when they left the hold.
                let segments = &candidate.window.segments;
                if by_fork && segments.iter().any(|s| s.episode_groups.iter().any(Option::is_some)) {
                    return true;
                }
                // A window goes only when none of its segments' groups has signal.
                let all_zero = segments.iter().all(|segment| {
                    groups.is_zero_variance(segment.task_id, segment.start_snapshot.as_deref(), zero.tolerance)
                });
                if !all_zero {
                    return true;
                }
                drop_window(&candidate.window, DropReason::ZeroVariance, dropped);
                false
            });
        }
        if self.pool.len() < self.pool_target {
            return false;
        }
        if self.priority.is_some() {
            self.score_new(values);
            self.pool.retain(|candidate| {
                if candidate.priority.is_some_and(f32::is_finite) {
                    return true;
                }
                drop_window(&candidate.window, DropReason::NonFinite, dropped);
                false
            });
            if self.pool.len() < self.pool_target {
                return false;
            }
        }
        true
    }

    /// Priorities of the pool's unscored segments under the learner's current parameters: one
    /// forward over all of them as a batch on the learner's backend, GAE(γ, λ) against its value
    /// head, and the mean |advantage| of each column plus ε; NaN where a value or advantage is
    /// not finite.
    fn score_new(&mut self, source: &mut dyn ValueSource) {
        let Some(priority) = &self.priority else {
            return;
        };
        self.unscored.clear();
        self.unscored.extend(self.pool.iter().enumerate().filter(|(_, c)| c.priority.is_none()).map(|(i, _)| i));
        if self.unscored.is_empty() {
            return;
        }
        let windows: Vec<&[TrajectorySegment]> =
            self.unscored.iter().map(|&i| self.pool[i].window.segments.as_slice()).collect();
        self.ones.clear();
        self.ones.resize(windows.len(), 1.0);
        self.scratch.fill_windows(&windows, self.window_segments, self.gamma, self.reward_scale, &self.ones);
        let batch = &self.scratch;
        let (t_len, b_len) = (batch.t_len, batch.b_len);
        source.values_and_advantages(batch, self.gae_lambda, &mut self.estimates);
        let (values, advantages) = (&self.estimates.values, &self.estimates.advantages);
        for (col, &pool_idx) in self.unscored.iter().enumerate() {
            // Over the window's data, not its padding.
            let first = t_len - self.pool[pool_idx].window.segments.len() * (t_len / self.window_segments);
            let values_finite = (first..=t_len).all(|t| values[t * b_len + col].is_finite());
            let mean_abs =
                (first..t_len).map(|t| advantages[t * b_len + col].abs()).sum::<f32>() / (t_len - first).max(1) as f32;
            let score = if values_finite && mean_abs.is_finite() { mean_abs + priority.epsilon } else { f32::NAN };
            self.pool[pool_idx].priority = Some(score);
        }
    }

    /// Choose the next batch's columns from a pool that [`prepare`](Self::prepare) declared
    /// ready: without priority sampling, the first `batch_segments / K` windows in arrival
    /// order with weight 1 (the behaviour from before selection existed); with it, as many
    /// draws with replacement by priority, weighted by normalised importance weights.
    ///
    /// # Panics
    /// If the pool holds fewer than `batch_segments / K` windows.
    pub fn draw(&mut self) -> Draw<'_> {
        assert!(self.pool.len() >= self.batch_windows, "draw needs a prepared pool");
        self.drawn.clear();
        self.weights.clear();
        match &self.priority {
            None => {
                self.drawn.extend(0..self.batch_windows);
                self.weights.resize(self.batch_windows, 1.0);
            }
            Some(priority) => {
                self.priorities.clear();
                self.priorities.extend(self.pool.iter().map(|c| c.priority.expect("prepare scored every segment")));
                sampling_probabilities(&self.priorities, priority.alpha, &mut self.probs);
                sample_with_replacement(
                    &self.probs,
                    self.batch_windows,
                    &mut self.rng,
                    &mut self.cumulative,
                    &mut self.drawn,
                );
                importance_weights(&self.probs, &self.drawn, priority.beta, &mut self.weights);
            }
        }
        Draw {
            windows: self.drawn.iter().map(|&i| self.pool[i].window.segments.as_slice()).collect(),
            column_weights: &self.weights,
            window_segments: self.window_segments,
            advantages: self.drawn.iter().map(|&i| self.pool[i].advantages.as_deref()).collect(),
        }
    }

    /// After the update fed by the last [`draw`](Self::draw) is published: remove the drawn
    /// windows from the pool (each once, however often it was drawn) and append their
    /// segments' tokens to `settled`. Returns how many distinct segments that was.
    pub fn settle_drawn(&mut self, settled: &mut Vec<DeliveryToken>) -> usize {
        self.taken.clear();
        self.taken.resize(self.pool.len(), false);
        for &i in &self.drawn {
            self.taken[i] = true;
        }
        self.drawn.clear();
        let before = settled.len();
        let mut idx = 0;
        let taken = &self.taken;
        self.pool.retain(|candidate| {
            let keep = !taken[idx];
            idx += 1;
            if !keep {
                settled.extend_from_slice(&candidate.window.tokens);
            }
            keep
        });
        settled.len() - before
    }
}

/// The guard's arrival-time checks, in order: a raw reward above `max_abs_reward`
/// (out of range), then a reward that is not finite once scaled and bootstrapped through a
/// time limit, or a non-finite episode return (non-finite).
fn guard_check(segment: &TrajectorySegment, guard: &GuardConfig, gamma: f32, reward_scale: f32) -> Option<DropReason> {
    if let Some(bound) = guard.max_abs_reward {
        if segment.rewards.iter().any(|r| r.abs() > bound) {
            return Some(DropReason::OutOfRange);
        }
    }
    let steps =
        segment.rewards.iter().zip(&segment.truncation_values).zip(segment.terminated.iter().zip(&segment.truncated));
    for ((&reward, &truncation_value), (&terminated, &truncated)) in steps {
        // The same expression SegmentBatch::fill computes.
        let bootstrap = if truncated != 0 && terminated == 0 { gamma * truncation_value } else { 0.0 };
        if !(reward * reward_scale + bootstrap).is_finite() {
            return Some(DropReason::NonFinite);
        }
    }
    if segment.finished_episodes.iter().any(|e| !e.episode_return.is_finite()) {
        return Some(DropReason::NonFinite);
    }
    None
}

#[cfg(test)]
#[path = "selection_tests.rs"]
mod tests;
