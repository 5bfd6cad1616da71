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
//! outside the pool, until every group it touches is complete ([`crate::groups`]); then it
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

use rand::{Rng, SeedableRng};
use rand_pcg::Pcg64Mcg;
use tracing::debug;
use volley_core::ids::PolicyVersion;
use volley_core::spec::{Baseline, GuardConfig, PriorityConfig, RunSpec, ZeroVarianceConfig};
use volley_core::wire::TrajectorySegment;
use volley_core::work::GroupMember;

use crate::groups::{GroupCounters, GroupState, GroupTable, MAX_TRACKED_GROUPS};
use volley_transport::DeliveryToken;

use crate::batch::SegmentBatch;
use crate::windows::{Window, WindowAssembler, WindowOutcome};

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
    /// Values `[T+1][B]` and GAE(γ, `gae_lambda`) advantages `[T][B]` of `batch` under the
    /// current parameters, into `values` and `advantages` (resized).
    fn values_and_advantages(
        &mut self,
        batch: &SegmentBatch,
        gae_lambda: f32,
        values: &mut Vec<f32>,
        advantages: &mut Vec<f32>,
    );
}

impl ValueSource for crate::Learner {
    fn values_and_advantages(
        &mut self,
        batch: &SegmentBatch,
        gae_lambda: f32,
        values: &mut Vec<f32>,
        advantages: &mut Vec<f32>,
    ) {
        crate::Learner::values_and_advantages(self, batch, gae_lambda, values, advantages);
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
    4 * (segment.observations.len()
        + segment.actions.len()
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

/// Sampling probabilities `p_i = priority_i^α / Σ_j priority_j^α` (Schaul et al. 2016, eq. 1),
/// in `f64` so a large pool's small probabilities keep their precision.
///
/// # Panics
/// If a priority is not finite and positive: callers add ε and drop non-finite segments first.
pub fn sampling_probabilities(priorities: &[f32], alpha: f32, out: &mut Vec<f64>) {
    assert!(priorities.iter().all(|&p| p.is_finite() && p > 0.0), "priorities must be finite and positive");
    out.clear();
    out.extend(priorities.iter().map(|&p| f64::from(p).powf(f64::from(alpha))));
    let total: f64 = out.iter().sum();
    out.iter_mut().for_each(|p| *p /= total);
}

/// Draw `n` indices with replacement, index `i` with probability `probs[i]` (inverse CDF by
/// binary search over the running sum).
pub fn sample_with_replacement(
    probs: &[f64],
    n: usize,
    rng: &mut impl Rng,
    cumulative: &mut Vec<f64>,
    out: &mut Vec<usize>,
) {
    out.clear();
    if probs.is_empty() {
        return;
    }
    cumulative.clear();
    let mut running = 0.0;
    cumulative.extend(probs.iter().map(|&p| {
        running += p;
        running
    }));
    let total = running;
    for _ in 0..n {
        let u = rng.random::<f64>() * total;
        // The first index whose running sum exceeds u; `min` guards against rounding at the top.
        let idx = cumulative.partition_point(|&c| c <= u).min(probs.len() - 1);
        out.push(idx);
    }
}

/// Importance weights `w_i = (N·p_i)^(−β) / max_j (N·p_j)^(−β)` of the drawn indices
/// (Schaul et al. 2016, sec. 3.4), where the max runs over the whole pool, so every weight is
/// in (0, 1] and the pool's least likely segment would get exactly 1. The `N` cancels:
/// `w_i = (p_min / p_i)^β`.
pub fn importance_weights(probs: &[f64], drawn: &[usize], beta: f32, out: &mut Vec<f32>) {
    out.clear();
    let p_min = probs.iter().copied().fold(f64::INFINITY, f64::min);
    out.extend(drawn.iter().map(|&i| (p_min / probs[i]).powf(f64::from(beta)) as f32));
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
    values: Vec<f32>,
    advantages: Vec<f32>,
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
            values: Vec::new(),
            advantages: Vec::new(),
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
        source.values_and_advantages(batch, self.gae_lambda, &mut self.values, &mut self.advantages);
        let values = &self.values;
        for (col, &pool_idx) in self.unscored.iter().enumerate() {
            // Over the window's data, not its padding.
            let first = t_len - self.pool[pool_idx].window.segments.len() * (t_len / self.window_segments);
            let values_finite = (first..=t_len).all(|t| values[t * b_len + col].is_finite());
            let mean_abs = (first..t_len).map(|t| self.advantages[t * b_len + col].abs()).sum::<f32>()
                / (t_len - first).max(1) as f32;
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
mod tests {
    use super::*;
    use proptest::prelude::*;
    use volley_core::ids::RunId;
    use volley_core::spec::{BpttConfig, HyperParams, SelectionConfig};
    use volley_core::wire::EpisodeSummary;
    use volley_env::EnvConfig;
    use volley_policy::{Activation, PolicySpec};
    use volley_testkit::fixtures::SegmentBuilder;

    const T: usize = 4;

    fn spec(batch_segments: usize, selection: SelectionConfig) -> RunSpec {
        RunSpec {
            run: RunId::new("select").expect("valid run id"),
            env: EnvConfig::Cartpole,
            policy: PolicySpec::mlp(4, 2, &[8], Activation::Tanh),
            segment_len: T,
            hyper: HyperParams {
                batch_segments,
                ppo_minibatches: 1,
                max_policy_lag: 2,
                selection,
                ..HyperParams::default()
            },
            seed: 7,
        }
    }

    fn learner_with(spec: &RunSpec, params: Vec<f32>) -> crate::Learner {
        crate::Learner::with_state(spec.clone(), params, PolicyVersion(0), 0).expect("valid state")
    }

    fn learner_for(spec: &RunSpec) -> crate::Learner {
        crate::Learner::new(spec.clone()).expect("valid spec")
    }

    fn selector(spec: &RunSpec) -> Selector {
        Selector::new(spec)
    }

    fn segment(idx: u64, version: u64, reward: f32) -> TrajectorySegment {
        SegmentBuilder::cartpole(T)
            .episode_id(idx)
            .segment_idx(idx)
            .version(version)
            .observations_from(|i| (i as f32 * 0.1 + idx as f32).sin() * 0.1)
            .reward(reward)
            .log_prob(-0.7)
            .build()
    }

    fn with_return(mut segment: TrajectorySegment, task_id: u32, start: Option<&str>, ret: f32) -> TrajectorySegment {
        segment.task_id = task_id;
        segment.start_snapshot = start.map(str::to_owned);
        segment.finished_episodes =
            vec![EpisodeSummary { episode_return: ret, episode_len: 3, ..EpisodeSummary::default() }];
        segment
    }

    /// A spec with group rollouts of `K = 4` and `baseline`.
    fn group_spec(batch_segments: usize, baseline: Baseline, selection: SelectionConfig) -> RunSpec {
        let mut spec = spec(batch_segments, selection);
        spec.hyper.baseline = baseline;
        spec.hyper.reward_scale = 0.5;
        spec.hyper.work = volley_core::work::WorkConfig {
            enabled: true,
            group_size: 4,
            group_hold_segments: 8,
            ..volley_core::work::WorkConfig::default()
        };
        spec
    }

    fn tag(group: u64, member: u32) -> GroupMember {
        GroupMember { group, member, size: 4 }
    }

    /// Segment `idx` of member `member` of `group`: the episode runs through the segment, and
    /// with `ret` it ends at the last step with that return.
    fn member_segment(idx: u64, version: u64, group: u64, member: u32, ret: Option<f32>) -> TrajectorySegment {
        let mut segment = segment(idx, version, 0.0);
        segment.episode_groups = vec![Some(tag(group, member))];
        if let Some(ret) = ret {
            segment.terminated[T - 1] = 1;
            segment.finished_episodes = vec![EpisodeSummary {
                episode_return: ret,
                episode_len: 9,
                group: Some(tag(group, member)),
                ..EpisodeSummary::default()
            }];
        }
        segment
    }

    fn reasons(dropped: &[Dropped]) -> Vec<(u64, &'static str)> {
        dropped.iter().map(|d| (d.token.0, d.reason.as_str())).collect()
    }

    #[test]
    fn the_default_config_takes_the_first_batch_in_arrival_order_with_unit_weights() {
        let spec = spec(3, SelectionConfig::default());
        let mut selector = selector(&spec);
        assert_eq!(selector.pool_target(), 3);
        assert!(!selector.needs_values());
        let mut dropped = Vec::new();
        for idx in 0..3 {
            selector.offer(segment(idx, 0, 1.0), DeliveryToken(idx), PolicyVersion(0), &mut dropped);
        }
        assert!(selector.prepare(PolicyVersion(0), &mut learner_for(&spec), &mut dropped));
        let draw = selector.draw();
        assert_eq!(draw.windows.iter().map(|w| w[0].segment_idx).collect::<Vec<_>>(), vec![0, 1, 2]);
        assert_eq!(draw.column_weights, &[1.0; 3]);
        let mut settled = Vec::new();
        assert_eq!(selector.settle_drawn(&mut settled), 3);
        assert_eq!(settled, vec![DeliveryToken(0), DeliveryToken(1), DeliveryToken(2)]);
        assert!(selector.is_empty() && dropped.is_empty());
    }

    #[test]
    fn lag_bound_drops_on_arrival_and_again_in_the_pool() {
        let spec = spec(2, SelectionConfig::default());
        let mut selector = selector(&spec);
        let mut dropped = Vec::new();
        selector.offer(segment(0, 1, 1.0), DeliveryToken(0), PolicyVersion(4), &mut dropped); // lag 3 > 2
        selector.offer(segment(1, 2, 1.0), DeliveryToken(1), PolicyVersion(4), &mut dropped); // lag 2: kept
        assert_eq!(reasons(&dropped), vec![(0, "stale")]);
        assert_eq!(selector.len(), 1);
        // Two updates later it has aged past the bound while waiting.
        assert!(!selector.prepare(PolicyVersion(5), &mut learner_for(&spec), &mut dropped));
        assert_eq!(reasons(&dropped), vec![(0, "stale"), (1, "stale")]);
        assert!(selector.is_empty());
    }

    #[test]
    fn guard_drops_absurd_and_overflowing_rewards_and_non_finite_returns() {
        let selection = SelectionConfig {
            guard: GuardConfig { enabled: true, max_abs_reward: Some(1e6) },
            ..SelectionConfig::default()
        };
        let mut spec = spec(4, selection);
        // A scale this large makes c·r + γ·V overflow for a raw reward within the bound.
        spec.hyper.reward_scale = 1e33;
        let mut selector = selector(&spec);
        let mut dropped = Vec::new();
        let mut absurd = segment(0, 0, 1.0);
        absurd.rewards[1] = -1e30;
        // A truncation bootstrap that overflows once added: the raw reward is within the bound.
        let mut overflowing = segment(1, 0, 1.0);
        overflowing.truncated[2] = 1;
        overflowing.truncation_values[2] = f32::MAX;
        overflowing.rewards[2] = 1e5;
        let mut bad_return = with_return(segment(2, 0, 1.0), 0, None, f32::NAN);
        bad_return.finished_episodes.push(EpisodeSummary {
            episode_return: 1.0,
            episode_len: 1,
            ..EpisodeSummary::default()
        });
        let fine = segment(3, 0, 1.0);
        for (idx, s) in [absurd, overflowing, bad_return, fine].into_iter().enumerate() {
            selector.offer(s, DeliveryToken(idx as u64), PolicyVersion(0), &mut dropped);
        }
        assert_eq!(reasons(&dropped), vec![(0, "out_of_range"), (1, "non_finite"), (2, "non_finite")]);
        assert_eq!(selector.len(), 1);

        // Without a raw bound an overflowing scaled reward is caught as non-finite.
        let mut spec = spec.clone();
        spec.hyper.selection.guard.max_abs_reward = None;
        let mut selector = Selector::new(&spec);
        let mut overflowing = segment(5, 0, 1.0);
        overflowing.rewards[0] = f32::MAX / 2.0;
        let mut dropped = Vec::new();
        selector.offer(overflowing, DeliveryToken(5), PolicyVersion(0), &mut dropped);
        assert_eq!(reasons(&dropped), vec![(5, "non_finite")]);

        // Switched off, nothing is checked.
        spec.hyper.selection.guard.enabled = false;
        let mut selector = Selector::new(&spec);
        let mut overflowing = segment(6, 0, 1.0);
        overflowing.rewards[0] = f32::MAX / 2.0;
        let mut dropped = Vec::new();
        selector.offer(overflowing, DeliveryToken(6), PolicyVersion(0), &mut dropped);
        assert!(dropped.is_empty());
    }

    #[test]
    fn group_returns_window_and_spread() {
        let mut groups = GroupReturns::new(3, 2);
        groups.record(0, None, 1.0);
        groups.record(0, None, 1.0);
        assert!(!groups.is_zero_variance(0, None, 0.0), "window not full yet");
        groups.record(0, None, 1.0);
        assert!(groups.is_zero_variance(0, None, 0.0));
        groups.record(0, None, 1.5);
        assert!(!groups.is_zero_variance(0, None, 0.0));
        assert!(groups.is_zero_variance(0, None, 0.5), "spread within tolerance");
        groups.record(0, Some("s1"), 0.0);
        assert!(!groups.is_zero_variance(0, Some("s1"), 0.0), "another start is another group");
        groups.record(1, None, 0.0);
        assert_eq!(groups.len(), 2, "bounded: the oldest group was forgotten");
        assert!(!groups.is_zero_variance(0, None, 10.0));
    }

    #[test]
    fn zero_variance_groups_are_dropped_once_the_group_is_large_enough() {
        let selection = SelectionConfig {
            zero_variance: Some(ZeroVarianceConfig { min_group: 3, tolerance: 0.0 }),
            ..SelectionConfig::default()
        };
        let spec = spec(2, selection);
        let mut selector = selector(&spec);
        let mut dropped = Vec::new();
        let v = PolicyVersion(0);
        // Start "a": three rollouts, all return 1 → no signal. Start "b": returns 0 and 1.
        // Task 1 from "a": only two rollouts, below min_group, kept.
        let offers = [
            with_return(segment(0, 0, 1.0), 0, Some("a"), 1.0),
            with_return(segment(1, 0, 1.0), 0, Some("b"), 0.0),
            with_return(segment(2, 0, 1.0), 0, Some("a"), 1.0),
            with_return(segment(3, 0, 1.0), 0, Some("b"), 1.0),
            with_return(segment(4, 0, 1.0), 1, Some("a"), 1.0),
            with_return(segment(5, 0, 1.0), 0, Some("a"), 1.0),
            segment(6, 0, 1.0), // "a" without a finished episode of its own: still its group
            with_return(segment(7, 0, 1.0), 1, Some("a"), 1.0),
        ];
        for (idx, mut s) in offers.into_iter().enumerate() {
            if idx == 6 {
                s.start_snapshot = Some("a".into());
            }
            selector.offer(s, DeliveryToken(idx as u64), v, &mut dropped);
        }
        assert!(dropped.is_empty(), "the filter runs before the step, not on arrival");
        assert!(selector.prepare(v, &mut learner_for(&spec), &mut dropped));
        assert_eq!(
            reasons(&dropped),
            vec![(0, "zero_variance"), (2, "zero_variance"), (5, "zero_variance"), (6, "zero_variance")]
        );
        let kept: Vec<u64> = selector.draw().windows.iter().map(|w| w[0].segment_idx).collect();
        assert_eq!(kept, vec![1, 3]);
    }

    #[test]
    fn priority_sampling_scores_draws_and_weights_columns() {
        let selection = SelectionConfig {
            priority: Some(PriorityConfig { pool_factor: 2, alpha: 1.0, beta: 1.0, epsilon: 1e-3 }),
            ..SelectionConfig::default()
        };
        let spec = spec(3, selection);
        let layout = spec.validate().expect("valid");
        let params = layout.init_params(3);
        let mut learner = learner_with(&spec, params.clone());
        let mut selector = Selector::new(&spec);
        assert_eq!(selector.pool_target(), 6);
        assert!(selector.needs_values());
        let mut dropped = Vec::new();
        for idx in 0..5 {
            // Rewards of growing size: larger advantages under a near-zero initial value head.
            selector.offer(segment(idx, 0, idx as f32), DeliveryToken(idx), PolicyVersion(0), &mut dropped);
        }
        assert!(!selector.prepare(PolicyVersion(0), &mut learner, &mut dropped), "pool not full");
        selector.offer(segment(5, 0, 5.0), DeliveryToken(5), PolicyVersion(0), &mut dropped);
        assert!(selector.prepare(PolicyVersion(0), &mut learner, &mut dropped));
        let priorities: Vec<f32> = selector.pool.iter().map(|c| c.priority.expect("scored")).collect();
        assert!(priorities.windows(2).all(|w| w[0] < w[1]), "priority grows with |advantage|: {priorities:?}");
        let draw = selector.draw();
        assert_eq!(draw.windows.len(), 3);
        assert!(draw.column_weights.iter().all(|&w| w > 0.0 && w <= 1.0));
        let mut settled = Vec::new();
        let distinct = selector.settle_drawn(&mut settled);
        assert_eq!(distinct, settled.len());
        assert_eq!(selector.len(), 6 - distinct);
        assert!(selector.pool.iter().all(|c| c.priority.is_some()), "leftovers keep their scores");

        // Non-finite parameters make every new value non-finite: dropped by the guard.
        let mut nan_learner = learner_with(&spec, vec![f32::NAN; params.len()]);
        for idx in 10..10 + distinct as u64 {
            selector.offer(segment(idx, 0, 1.0), DeliveryToken(idx), PolicyVersion(0), &mut dropped);
        }
        assert!(!selector.prepare(PolicyVersion(0), &mut nan_learner, &mut dropped));
        assert_eq!(dropped.len(), distinct);
        assert!(dropped.iter().all(|d| d.reason == DropReason::NonFinite && d.token.0 >= 10));
    }

    #[test]
    fn importance_weights_are_one_for_the_least_likely_and_shrink_with_probability() {
        let probs = [0.1, 0.2, 0.3, 0.4];
        let mut weights = Vec::new();
        importance_weights(&probs, &[0, 1, 3, 3], 1.0, &mut weights);
        let expected = [1.0, 0.5, 0.25, 0.25];
        for (w, e) in weights.iter().zip(expected) {
            assert!((w - e).abs() < 1e-6, "{weights:?}");
        }
        importance_weights(&probs, &[3], 0.0, &mut weights);
        assert_eq!(weights, vec![1.0], "β = 0: no correction");
    }

    #[test]
    fn alpha_zero_is_uniform() {
        let mut probs = Vec::new();
        sampling_probabilities(&[0.1, 5.0, 100.0], 0.0, &mut probs);
        assert!(probs.iter().all(|&p| (p - 1.0 / 3.0).abs() < 1e-12));
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(32))]

        #[test]
        fn sampling_frequencies_match_the_probabilities(
            priorities in prop::collection::vec(0.01f32..10.0, 1..12),
            alpha in 0.0f32..2.0,
            seed in any::<u64>(),
        ) {
            let mut probs = Vec::new();
            sampling_probabilities(&priorities, alpha, &mut probs);
            prop_assert!((probs.iter().sum::<f64>() - 1.0).abs() < 1e-9);
            let n = 40_000;
            let mut rng = Pcg64Mcg::seed_from_u64(seed);
            let (mut cumulative, mut drawn) = (Vec::new(), Vec::new());
            sample_with_replacement(&probs, n, &mut rng, &mut cumulative, &mut drawn);
            let mut counts = vec![0usize; probs.len()];
            drawn.iter().for_each(|&i| counts[i] += 1);
            for (&count, &p) in counts.iter().zip(&probs) {
                // Five binomial standard deviations (plus a little slack for tiny p).
                let sd = (n as f64 * p * (1.0 - p)).sqrt();
                prop_assert!((count as f64 - n as f64 * p).abs() <= 5.0 * sd + 2.0,
                    "count {} vs expected {} (p = {})", count, n as f64 * p, p);
            }
        }

        #[test]
        fn importance_weights_are_normalised_to_at_most_one(
            priorities in prop::collection::vec(0.001f32..100.0, 1..16),
            alpha in 0.0f32..2.0,
            beta in 0.0f32..=1.0,
        ) {
            let mut probs = Vec::new();
            sampling_probabilities(&priorities, alpha, &mut probs);
            let all: Vec<usize> = (0..probs.len()).collect();
            let mut weights = Vec::new();
            importance_weights(&probs, &all, beta, &mut weights);
            prop_assert!(weights.iter().all(|&w| w > 0.0 && w <= 1.0 + 1e-6));
            let max = weights.iter().copied().fold(0.0f32, f32::max);
            prop_assert!((max - 1.0).abs() < 1e-5, "the least likely segment has weight 1, max = {}", max);
            // A more likely segment never gets a larger weight.
            for i in 0..probs.len() {
                for j in 0..probs.len() {
                    if probs[i] > probs[j] {
                        prop_assert!(weights[i] <= weights[j] + 1e-6);
                    }
                }
            }
        }

        /// Random offers (some stale, some absurd, some of zero-variance groups), versions and
        /// draws: every token leaves the selector exactly once (dropped or settled) or is still
        /// in the pool, never twice.
        #[test]
        fn pool_bookkeeping_never_loses_or_double_acks_a_segment(
            ops in prop::collection::vec((0usize..6, 0u64..4, 0u8..4, prop::bool::ANY), 1..80),
            priority_on in prop::bool::ANY,
        ) {
            let selection = SelectionConfig {
                guard: GuardConfig { enabled: true, max_abs_reward: Some(100.0) },
                zero_variance: Some(ZeroVarianceConfig { min_group: 2, tolerance: 0.0 }),
                priority: priority_on.then(|| PriorityConfig { pool_factor: 2, ..PriorityConfig::default() }),
            };
            let spec = spec(2, selection);
            let layout = spec.validate().expect("valid");
            let mut learner = learner_with(&spec, layout.init_params(1));
            let mut selector = Selector::new(&spec);
            let mut version = 0u64;
            let mut next_token = 0u64;
            let mut offered = Vec::new();
            let mut dropped = Vec::new();
            let mut settled = Vec::new();
            for (n_offers, behind, kind, step) in ops {
                for _ in 0..n_offers {
                    let reward = if kind == 3 { 1e4 } else { 1.0 };
                    let mut s = segment(next_token, version.saturating_sub(behind), reward);
                    if kind == 1 {
                        s = with_return(s, 0, Some("same"), 1.0);
                    } else if kind == 2 {
                        s = with_return(s, 0, Some("varied"), next_token as f32);
                    }
                    selector.offer(s, DeliveryToken(next_token), PolicyVersion(version), &mut dropped);
                    offered.push(next_token);
                    next_token += 1;
                }
                if selector.prepare(PolicyVersion(version), &mut learner, &mut dropped) {
                    let draw = selector.draw();
                    prop_assert_eq!(draw.windows.len(), 2);
                    let n = selector.settle_drawn(&mut settled);
                    prop_assert!((1..=2).contains(&n));
                    if step {
                        version += 1;
                    }
                }
            }
            let mut seen: Vec<u64> = dropped.iter().map(|d| d.token.0).chain(settled.iter().map(|t| t.0)).collect();
            seen.extend(selector.pool.iter().flat_map(|c| c.window.tokens.iter().map(|t| t.0)));
            seen.sort_unstable();
            prop_assert_eq!(seen, offered);
        }

        /// Issue 18, stitched windows of 2 segments from 3 streams with gaps, stale segments
        /// and priority sampling or not: every draw is `batch_segments / K` windows of
        /// consecutive segments, and every token leaves exactly once (dropped, settled, or still
        /// in the pool or held for a window).
        #[test]
        fn stitched_windows_never_lose_or_double_ack_a_segment(
            ops in prop::collection::vec((0usize..6, 0u64..4, prop::bool::ANY, prop::bool::ANY), 1..60),
            priority_on in prop::bool::ANY,
        ) {
            let selection = SelectionConfig {
                priority: priority_on.then(|| PriorityConfig { pool_factor: 2, ..PriorityConfig::default() }),
                ..SelectionConfig::default()
            };
            let mut spec = spec(4, selection);
            spec.policy = PolicySpec::gru(4, 2, &[8], Activation::Tanh, 3);
            spec.hyper.bptt = BpttConfig { segments: 2, ..BpttConfig::default() };
            let layout = spec.validate().expect("valid");
            let mut learner = learner_with(&spec, layout.init_params(1));
            let mut selector = Selector::new(&spec);
            let (mut version, mut next_token) = (0u64, 0u64);
            let mut next_idx = [0u64; 3];
            let (mut offered, mut dropped, mut settled) = (Vec::new(), Vec::new(), Vec::new());
            for (n_offers, behind, gap, step) in ops {
                for _ in 0..n_offers {
                    let env = (next_token % 3) as usize;
                    next_idx[env] += u64::from(gap && next_token % 5 == 0);
                    let idx = next_idx[env];
                    next_idx[env] += 1;
                    let mut s = SegmentBuilder::cartpole(T)
                        .env_idx(env as u32)
                        .segment_idx(idx)
                        .version(version.saturating_sub(behind))
                        .observations_from(|i| ((idx as usize * T + i / 4) as f32 * 0.1).sin())
                        .log_prob(-0.7)
                        .initial_hidden(vec![0.1; 3])
                        .build();
                    s.env_idx = env as u32;
                    selector.offer(s, DeliveryToken(next_token), PolicyVersion(version), &mut dropped);
                    offered.push(next_token);
                    next_token += 1;
                }
                if selector.prepare(PolicyVersion(version), &mut learner, &mut dropped) {
                    let draw = selector.draw();
                    prop_assert_eq!((draw.windows.len(), draw.window_segments), (2, 2));
                    for window in &draw.windows {
                        for pair in window.windows(2) {
                            prop_assert!(crate::windows::continues(&pair[0], &pair[1]));
                        }
                    }
                    selector.settle_drawn(&mut settled);
                    if step {
                        version += 1;
                    }
                }
            }
            let mut held = Vec::new();
            selector.assembler.flush_all(&mut held);
            let mut seen: Vec<u64> = dropped.iter().map(|d| d.token.0).chain(settled.iter().map(|t| t.0)).collect();
            seen.extend(selector.pool.iter().flat_map(|c| c.window.tokens.iter().map(|t| t.0)));
            seen.extend(held.iter().flat_map(|w| w.tokens.iter().map(|t| t.0)));
            seen.sort_unstable();
            prop_assert_eq!(seen, offered);
        }
    }

    /// Issue 18, item 2: on a hand-built group (returns 1, 0, 0, 3, so the mean is 1), every
    /// step of member k gets `reward_scale · (G_k − mean G)`, and nothing is trained on before
    /// the group is complete.
    #[test]
    fn group_advantages_are_each_members_return_minus_the_group_mean() {
        let spec = group_spec(9, Baseline::Group, SelectionConfig::default());
        let mut selector = selector(&spec);
        let mut learner = learner_for(&spec);
        let mut dropped = Vec::new();
        let returns = [1.0, 0.0, 0.0, 3.0];
        // Each member's episode spans two segments; the first ones arrive before any return.
        for member in 0..4u32 {
            let idx = u64::from(member) * 2;
            selector.offer(
                member_segment(idx, 0, 50, member, None),
                DeliveryToken(idx),
                PolicyVersion(0),
                &mut dropped,
            );
        }
        for member in 0..3u32 {
            let idx = u64::from(member) * 2 + 1;
            let last = member_segment(idx, 0, 50, member, Some(returns[member as usize]));
            selector.offer(last, DeliveryToken(idx), PolicyVersion(0), &mut dropped);
        }
        // An ungrouped segment goes straight to the pool.
        selector.offer(segment(99, 0, 1.0), DeliveryToken(99), PolicyVersion(0), &mut dropped);
        assert!(!selector.prepare(PolicyVersion(0), &mut learner, &mut dropped));
        assert_eq!((selector.held(), selector.len()), (7, 1), "the incomplete group waits outside the pool");
        selector.offer(member_segment(7, 0, 50, 3, Some(3.0)), DeliveryToken(7), PolicyVersion(0), &mut dropped);
        assert!(selector.prepare(PolicyVersion(0), &mut learner, &mut dropped));
        assert!(dropped.is_empty());
        assert_eq!(selector.held(), 0);
        let draw = selector.draw();
        let segments: Vec<&TrajectorySegment> = draw.windows.iter().map(|w| &w[0]).collect();
        for (segment, advantages) in segments.iter().zip(&draw.advantages) {
            match segment.episode_groups.first().copied().flatten() {
                Some(tag) => {
                    let expected = 0.5 * (returns[tag.member as usize] - 1.0);
                    assert_eq!(advantages.expect("a grouped segment has advantages"), &[expected; T][..]);
                }
                None => assert!(advantages.is_none(), "the ungrouped segment keeps the critic's"),
            }
        }
        let mut batch = SegmentBatch::default();
        batch.fill(&segments, 0.99, 0.5, draw.column_weights);
        batch.set_advantage_override(&draw.advantages);
        let column = segments.iter().position(|s| s.segment_idx == 7).expect("member 3's last segment");
        assert_eq!(batch.advantage_override[(T - 1) * 9 + column], 1.0);
        let stats = selector.group_stats();
        assert_eq!((stats.segments_grouped, stats.groups.completed), (8, 1));
    }

    /// The zero-variance filter on groups: a complete group whose returns are all equal is
    /// dropped, whatever the baseline; a group with spread is kept.
    #[test]
    fn zero_variance_groups_of_continuations_are_dropped_when_complete() {
        let zero = SelectionConfig {
            zero_variance: Some(ZeroVarianceConfig { min_group: 2, tolerance: 0.0 }),
            ..SelectionConfig::default()
        };
        let spec = group_spec(4, Baseline::Critic, zero);
        let mut selector = selector(&spec);
        let mut learner = learner_for(&spec);
        let mut dropped = Vec::new();
        for member in 0..4u32 {
            let flat = member_segment(u64::from(member), 0, 1, member, Some(0.0));
            selector.offer(flat, DeliveryToken(u64::from(member)), PolicyVersion(0), &mut dropped);
            let spread = member_segment(10 + u64::from(member), 0, 2, member, Some(member as f32));
            selector.offer(spread, DeliveryToken(10 + u64::from(member)), PolicyVersion(0), &mut dropped);
        }
        assert!(selector.prepare(PolicyVersion(0), &mut learner, &mut dropped));
        assert_eq!(reasons(&dropped), (0..4).map(|t| (t, "zero_variance")).collect::<Vec<_>>());
        let draw = selector.draw();
        assert!(draw.windows.iter().all(|w| w[0].segment_idx >= 10));
        assert!(draw.advantages.iter().all(Option::is_none), "the critic baseline adds no group advantages");
    }

    /// docs/SECURITY.md: segments naming groups that never complete (forged ids, or members
    /// that never report) cannot pile up: the hold keeps at most `group_hold_segments`, the
    /// oldest go to the critic (counted), and a segment at the lag bound goes too.
    #[test]
    fn a_flood_of_forged_group_ids_stays_bounded_and_falls_back_to_the_critic() {
        let spec = group_spec(4, Baseline::Group, SelectionConfig::default());
        let mut selector = selector(&spec);
        let mut learner = learner_for(&spec);
        let mut dropped = Vec::new();
        for idx in 0..1000u64 {
            let forged = member_segment(idx, 0, 1_000_000 + idx, (idx % 4) as u32, None);
            selector.offer(forged, DeliveryToken(idx), PolicyVersion(0), &mut dropped);
            selector.prepare(PolicyVersion(0), &mut learner, &mut dropped);
            assert!(selector.held() <= 8, "the hold stays within its bound");
        }
        let stats = selector.group_stats();
        assert_eq!(stats.segments_critic_capacity, 1000 - 8);
        assert_eq!(selector.len(), 1000 - 8, "released segments are trained on with the critic");
        assert!(dropped.is_empty(), "nothing is dropped silently");
        // Two versions later (the test spec's lag bound) the rest go to the critic as well.
        selector.prepare(PolicyVersion(2), &mut learner, &mut dropped);
        assert_eq!(selector.held(), 0);
        assert_eq!(selector.group_stats().segments_critic_lag, 8);
    }
}
