//! Rollout budget assignment: which task, and which start, the next episodes run.
//!
//! The learner owns one [`Scheduler`]. It reads the results of finished episodes and the
//! snapshots actors saved, both carried inside trajectory segments
//! ([`Scheduler::observe_segment`]), and keeps the run's work queue topped up
//! ([`Scheduler::top_up`]) with [`WorkItem`]s chosen by the run's [`BudgetPolicy`]:
//!
//! - **task choice**: uniform; *learnability*, `p (1 − p)` of the task's recent success rate
//!   (the variance of a Bernoulli outcome: highest where the policy succeeds half the time,
//!   zero where it always or never does), plus a floor so no task starves; or UCB1 on that
//!   learnability (Auer et al. 2002), which also tries tasks that were rarely tried.
//! - **save-load as exploration** (Go-Explore, Ecoffet et al. 2021): with probability
//!   `restart_share`, an item resumes from a saved state instead: first a cell (the states of
//!   one task at one progress) with weight `(1 + progress)² / √(1 + visits of the cell)`,
//!   then the cell's least visited state, so the furthest cells are tried most. Episodes
//!   report the state they started from, so each saved state's visits and successes are kept.
//!
//! Success rates use a window of the last `stats_window` episodes, with a Beta(1, 1) prior
//! (`(s + 1) / (n + 2)`) so a task with no results counts as `p = ½`, the most learnable.

use std::collections::{BTreeMap, BTreeSet, HashMap, VecDeque};
use std::io::Write;
use std::time::{Duration, Instant};

use rand::{Rng, SeedableRng};
use rand_pcg::Pcg64Mcg;
use volley_core::wire::TrajectorySegment;
use volley_core::work::{episode_success, BudgetPolicy, GroupMember, Start, WorkConfig, WorkItem};
use volley_env::EnvConfig;
use volley_transport::work::WorkQueue;
use volley_transport::TransportError;

/// Weight every task keeps under [`BudgetPolicy::Learnability`], as a fraction of the largest
/// possible `p (1 − p)` (¼), so a solved or hopeless task is still visited now and then.
const LEARNABILITY_FLOOR: f64 = 0.1;
/// Saved states the scheduler remembers at most (the least promising are forgotten first).
const MAX_KNOWN_SNAPSHOTS: usize = 4096;

/// Recent outcomes of one task or one saved state.
#[derive(Debug, Clone, Default)]
pub struct OutcomeWindow {
    outcomes: VecDeque<(bool, f32)>,
    /// Episodes ever reported.
    pub episodes: u64,
}

impl OutcomeWindow {
    fn push(&mut self, success: bool, episode_return: f32, window: usize) {
        self.outcomes.push_back((success, episode_return));
        while self.outcomes.len() > window {
            self.outcomes.pop_front();
        }
        self.episodes += 1;
    }

    /// Success rate with a Beta(1, 1) prior: `(s + 1) / (n + 2)`.
    pub fn success_rate(&self) -> f64 {
        let successes = self.outcomes.iter().filter(|(s, _)| *s).count();
        (successes as f64 + 1.0) / (self.outcomes.len() as f64 + 2.0)
    }

    /// Mean return over the window (0 when empty).
    pub fn mean_return(&self) -> f64 {
        if self.outcomes.is_empty() {
            return 0.0;
        }
        self.outcomes.iter().map(|(_, r)| f64::from(*r)).sum::<f64>() / self.outcomes.len() as f64
    }

    /// Mean absolute deviation of returns from their mean: how much outcomes from here vary,
    /// a cheap stand-in for advantage magnitude.
    pub fn return_spread(&self) -> f64 {
        let mean = self.mean_return();
        if self.outcomes.is_empty() {
            return 0.0;
        }
        self.outcomes.iter().map(|(_, r)| (f64::from(*r) - mean).abs()).sum::<f64>() / self.outcomes.len() as f64
    }

    /// `p (1 − p)` of the success rate.
    pub fn learnability(&self) -> f64 {
        let p = self.success_rate();
        p * (1.0 - p)
    }
}

/// What the scheduler knows about one task.
#[derive(Debug, Clone, Default)]
pub struct TaskStats {
    /// Recent outcomes of episodes of this task (any start).
    pub outcomes: OutcomeWindow,
    /// Recent outcomes of episodes that started fresh: the task's own difficulty, without
    /// the help of restarts from saved states (what evaluation reports).
    pub fresh: OutcomeWindow,
    /// Work items issued for this task.
    pub items_issued: u64,
}

/// What the scheduler knows about one saved state.
#[derive(Debug, Clone)]
struct KnownSnapshot {
    task_id: u32,
    progress: f32,
    visits: u64,
    outcomes: OutcomeWindow,
    seen_at: Instant,
}

impl KnownSnapshot {
    fn weight(&self) -> f64 {
        (1.0 + f64::from(self.progress.max(0.0))).powi(2) / (1.0 + self.visits as f64).sqrt()
    }

    fn cell(&self) -> CellKey {
        (self.task_id, self.progress.to_bits())
    }
}

/// A cell: the saved states of one task at one progress.
type CellKey = (u32, u32);

/// The saved states of one cell, kept up to date as states are saved, visited and forgotten,
/// so choosing a restart costs a walk over the cells (a handful), not over every state.
#[derive(Debug, Default)]
struct Cell {
    progress: f32,
    /// Restarts issued from the cell's states (those still known).
    visits: u64,
    /// The cell's states by (visits, key): the first is the least visited.
    states: BTreeSet<(u64, String)>,
}

/// Issues work items by the run's budget policy; see the module docs.
#[derive(Debug)]
pub struct Scheduler {
    config: WorkConfig,
    tasks: Vec<EnvConfig>,
    rng: Pcg64Mcg,
    next_id: u64,
    seed_base: u64,
    stats: Vec<TaskStats>,
    snapshots: HashMap<String, KnownSnapshot>,
    cells: BTreeMap<CellKey, Cell>,
    items_fresh: u64,
    items_resume: u64,
    groups_issued: u64,
    last_forget: Option<Instant>,
}

impl Scheduler {
    /// A scheduler for the run's tasks (`config.task_list(env)`); item ids start at
    /// `first_item_id` (a restarted learner passes a value above any earlier id, e.g. a clock).
    pub fn new(config: &WorkConfig, env: &EnvConfig, seed: u64, first_item_id: u64) -> Self {
        let tasks = config.task_list(env);
        Scheduler {
            stats: vec![TaskStats::default(); tasks.len()],
            tasks,
            config: config.clone(),
            rng: Pcg64Mcg::seed_from_u64(seed ^ 0x5c4e_d01e),
            next_id: first_item_id,
            seed_base: seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) ^ first_item_id,
            snapshots: HashMap::new(),
            cells: BTreeMap::new(),
            items_fresh: 0,
            items_resume: 0,
            groups_issued: 0,
            last_forget: None,
        }
    }

    /// The tasks, indexed by `task_id`.
    pub fn tasks(&self) -> &[EnvConfig] {
        &self.tasks
    }

    /// Per-task statistics.
    pub fn task_stats(&self) -> &[TaskStats] {
        &self.stats
    }

    /// Groups of continuations issued so far (each counts once in [`Scheduler::items_issued`]).
    pub fn groups_issued(&self) -> u64 {
        self.groups_issued
    }

    /// Starts issued so far: `(fresh starts, resumes from saved states)`; a group is one start.
    pub fn items_issued(&self) -> (u64, u64) {
        (self.items_fresh, self.items_resume)
    }

    /// Saved states known.
    pub fn known_snapshots(&self) -> usize {
        self.snapshots.len()
    }

    /// Per task, the furthest progress among the saved states known (`None` without any) and
    /// how many are known: how far restarts can reach.
    pub fn frontier(&self) -> Vec<(Option<f32>, usize)> {
        let mut out = vec![(None::<f32>, 0usize); self.tasks.len()];
        for known in self.snapshots.values() {
            let (furthest, saved) = &mut out[known.task_id as usize];
            *furthest = Some(furthest.map_or(known.progress, |f| f.max(known.progress)));
            *saved += 1;
        }
        out
    }

    /// Each task's share of the items issued so far.
    pub fn budget_shares(&self) -> Vec<f64> {
        let total: u64 = self.stats.iter().map(|s| s.items_issued).sum();
        self.stats.iter().map(|s| if total == 0 { 0.0 } else { s.items_issued as f64 / total as f64 }).collect()
    }

    /// Learn from a segment: its finished episodes' outcomes and its saved snapshots.
    pub fn observe_segment(&mut self, segment: &TrajectorySegment) {
        let window = self.config.stats_window as usize;
        for episode in &segment.finished_episodes {
            let Some(task) = self.tasks.get(episode.task_id as usize) else { continue };
            let success = episode_success(task, episode.episode_return);
            let stats = &mut self.stats[episode.task_id as usize];
            stats.outcomes.push(success, episode.episode_return, window);
            if episode.start.is_none() {
                stats.fresh.push(success, episode.episode_return, window);
            }
            if let Some(known) = episode.start.as_ref().and_then(|key| self.snapshots.get_mut(key)) {
                known.outcomes.push(success, episode.episode_return, window);
            }
        }
        for info in &segment.saved_snapshots {
            if (info.task_id as usize) >= self.tasks.len() || !info.progress.is_finite() {
                continue;
            }
            if self.snapshots.contains_key(&info.key) {
                continue;
            }
            let known = KnownSnapshot {
                task_id: info.task_id,
                progress: info.progress,
                visits: 0,
                outcomes: OutcomeWindow::default(),
                seen_at: Instant::now(),
            };
            let cell =
                self.cells.entry(known.cell()).or_insert_with(|| Cell { progress: info.progress, ..Cell::default() });
            cell.states.insert((0, info.key.clone()));
            self.snapshots.insert(info.key.clone(), known);
        }
        self.forget_snapshots();
    }

    /// Forget one saved state (and its cell once empty).
    fn forget(&mut self, key: &str) {
        let Some(known) = self.snapshots.remove(key) else { return };
        if let Some(cell) = self.cells.get_mut(&known.cell()) {
            cell.states.remove(&(known.visits, key.to_string()));
            cell.visits -= known.visits;
            if cell.states.is_empty() {
                self.cells.remove(&known.cell());
            }
        }
    }

    /// Drop saved states the store has expired (checked at most once a second: it walks the
    /// whole table), and the least promising beyond the bound.
    fn forget_snapshots(&mut self) {
        if self.snapshots.len() <= MAX_KNOWN_SNAPSHOTS
            && self.last_forget.is_some_and(|at| at.elapsed() < Duration::from_secs(1))
        {
            return;
        }
        self.last_forget = Some(Instant::now());
        // Keep a margin: a state chosen just before its expiry would fail to load.
        let ttl = Duration::from_secs_f64(self.config.snapshot_ttl_secs * 0.9);
        let now = Instant::now();
        let expired: Vec<String> = self
            .snapshots
            .iter()
            .filter(|(_, s)| now.duration_since(s.seen_at) >= ttl)
            .map(|(k, _)| k.clone())
            .collect();
        for key in &expired {
            self.forget(key);
        }
        if self.snapshots.len() > MAX_KNOWN_SNAPSHOTS {
            // Down to 7/8 of the bound, so the sort runs once per 512 new states, not per state.
            let mut by_weight: Vec<(f64, String)> =
                self.snapshots.iter().map(|(k, s)| (s.weight(), k.clone())).collect();
            by_weight.sort_by(|a, b| a.0.total_cmp(&b.0).then_with(|| a.1.cmp(&b.1)));
            let excess = self.snapshots.len() - MAX_KNOWN_SNAPSHOTS * 7 / 8;
            for (_, key) in by_weight.into_iter().take(excess) {
                self.forget(&key);
            }
        }
    }

    fn choose_task(&mut self) -> usize {
        let n = self.tasks.len();
        if n == 1 {
            return 0;
        }
        match self.config.policy {
            BudgetPolicy::Uniform => self.rng.random_range(0..n),
            BudgetPolicy::Learnability => {
                let weights: Vec<f64> =
                    self.stats.iter().map(|s| s.outcomes.learnability() + LEARNABILITY_FLOOR * 0.25).collect();
                sample_weighted(&mut self.rng, &weights)
            }
            BudgetPolicy::Ucb => {
                let total: u64 = self.stats.iter().map(|s| s.items_issued).sum();
                let c = f64::from(self.config.ucb_c);
                let scores: Vec<f64> = self
                    .stats
                    .iter()
                    .map(|s| {
                        // Learnability scaled to [0, 1], plus the UCB1 bonus.
                        4.0 * s.outcomes.learnability()
                            + c * ((total as f64 + 1.0).ln() / (s.items_issued as f64 + 1.0)).sqrt()
                    })
                    .collect();
                let best = scores.iter().copied().fold(f64::NEG_INFINITY, f64::max);
                let ties: Vec<usize> = (0..n).filter(|&i| scores[i] >= best - 1e-12).collect();
                ties[self.rng.random_range(0..ties.len())]
            }
        }
    }

    /// A saved state to restart from, Go-Explore style: first a cell, the states of one task
    /// at one progress, with weight `(1 + progress)² / √(1 + visits of the cell)`; then the
    /// cell's least visited state (ties: the smallest key). Counts the visit.
    ///
    /// Weighing states one by one (as before issue 18) let the many states of early progress
    /// outweigh the few at the frontier: on a 6-room chain with thousands of saved room-1
    /// entries, the furthest rooms were almost never chosen and restarts never reached the
    /// end. Call only with saved states known.
    fn choose_snapshot(&mut self) -> String {
        let weights: Vec<f64> = self
            .cells
            .values()
            .map(|cell| (1.0 + f64::from(cell.progress.max(0.0))).powi(2) / (1.0 + cell.visits as f64).sqrt())
            .collect();
        let chosen = sample_weighted(&mut self.rng, &weights);
        let cell = self.cells.values_mut().nth(chosen).expect("sampled among the cells");
        let (visits, key) = cell.states.pop_first().expect("cells are never empty");
        cell.states.insert((visits + 1, key.clone()));
        cell.visits += 1;
        self.snapshots.get_mut(&key).expect("a cell's states are known").visits += 1;
        key
    }

    /// The next work items, at least `n` of them: single items, and with group rollouts
    /// (`work.group_size` K > 1) groups of K items, drawn with probability `work.group_share`
    /// per draw and issued whole (so up to `n + K − 1` items). A group's items have
    /// consecutive ids, the same task and start (one fresh reset seed or one saved state), one
    /// episode each, and member tags `0..K`; the group's id is its first item's id.
    pub fn next_items(&mut self, n: usize) -> Vec<WorkItem> {
        let mut items = Vec::with_capacity(n);
        let group_size = self.config.group_size;
        while items.len() < n {
            let id = self.next_id;
            let restart = self.config.restart_share > 0.0
                && !self.snapshots.is_empty()
                && self.rng.random::<f32>() < self.config.restart_share;
            let (task_id, start) = if restart {
                let key = self.choose_snapshot();
                let task_id = self.snapshots[&key].task_id;
                self.items_resume += 1;
                (task_id, Start::Resume { snapshot: key })
            } else {
                let task_id = self.choose_task() as u32;
                self.items_fresh += 1;
                let seed = self.seed_base ^ id.wrapping_mul(0xd1b5_4a32_d192_ed03);
                (task_id, Start::Fresh { seed })
            };
            self.stats[task_id as usize].items_issued += 1;
            let grouped = group_size > 1 && self.rng.random::<f32>() < self.config.group_share;
            if !grouped {
                self.next_id += 1;
                items.push(WorkItem { id, task_id, start, episodes: self.config.episodes_per_item, group: None });
                continue;
            }
            self.groups_issued += 1;
            for member in 0..group_size {
                items.push(WorkItem {
                    id: self.next_id,
                    task_id,
                    start: start.clone(),
                    episodes: 1,
                    group: Some(GroupMember { group: id, member, size: group_size }),
                });
                self.next_id += 1;
            }
        }
        items
    }

    /// Submit items until `target` are queued; returns how many were submitted.
    pub fn top_up(&mut self, queue: &mut dyn WorkQueue, target: u64) -> Result<usize, TransportError> {
        let queued = queue.queued()?;
        if queued >= target {
            return Ok(0);
        }
        let items = self.next_items((target - queued) as usize);
        queue.submit(&items)?;
        Ok(items.len())
    }
}

/// What reads the scheduler's state at every top-up of a [`WorkPlanner`]: its metrics
/// (`metrics::WorkMetrics`), which know the scheduler, not the other way round.
pub trait SchedulerObserver: Send {
    /// Read the scheduler's state.
    fn observe(&self, scheduler: &Scheduler);
    /// Read what the work queue's lease dispatcher has done (NATS runs; issue 46).
    fn observe_leases(&self, _leases: &volley_transport::work::LeaseCounts) {}
}

/// A [`Scheduler`] wired to the run's work queue: learns from every segment the learner
/// accepts and keeps `target` items queued. Wrap the learner loop's control in
/// [`Planned`] to drive it.
pub struct WorkPlanner {
    /// The scheduler.
    pub scheduler: Scheduler,
    queue: Box<dyn WorkQueue>,
    target: u64,
    last_top_up: Option<Instant>,
    /// Scheduled episodes reported finished since the last top-up: items the queue has lost.
    finished_since_top_up: u64,
    log: Option<Box<dyn std::io::Write + Send>>,
    metrics: Option<Box<dyn SchedulerObserver>>,
}

impl std::fmt::Debug for WorkPlanner {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("WorkPlanner").field("target", &self.target).finish()
    }
}

impl WorkPlanner {
    /// Plan into `queue`, keeping `target` items queued (e.g. `queue_per_slot` × actor slots).
    pub fn new(scheduler: Scheduler, queue: Box<dyn WorkQueue>, target: u64) -> Self {
        WorkPlanner {
            scheduler,
            queue,
            target: target.max(1),
            last_top_up: None,
            finished_since_top_up: 0,
            log: None,
            metrics: None,
        }
    }

    /// Write one JSON line per update to `log`: env steps, seconds, and per task the
    /// fresh-start success rate (Beta(1, 1)-smoothed over the window), the success rate over
    /// all starts, the mean fresh return and the budget share so far.
    pub fn with_log(mut self, log: Box<dyn std::io::Write + Send>) -> Self {
        self.log = Some(log);
        self
    }

    fn log_row(&mut self, report: &crate::LearnerReport) {
        let Some(log) = self.log.as_mut() else { return };
        let scheduler = &self.scheduler;
        let shares = scheduler.budget_shares();
        let frontier = scheduler.frontier();
        let tasks: Vec<serde_json::Value> = scheduler
            .stats
            .iter()
            .zip(shares)
            .zip(frontier)
            .map(|((s, share), (frontier, saved))| {
                serde_json::json!({
                    "fresh_success": s.fresh.success_rate(),
                    "fresh_episodes": s.fresh.episodes,
                    "fresh_return": s.fresh.mean_return(),
                    "success": s.outcomes.success_rate(),
                    "share": share,
                    "frontier": frontier,
                    "saved": saved,
                })
            })
            .collect();
        let row = serde_json::json!({
            "updates": report.updates,
            "env_steps": report.env_steps,
            "secs": report.elapsed.as_secs_f64(),
            "items_fresh": scheduler.items_fresh,
            "items_resume": scheduler.items_resume,
            "groups": scheduler.groups_issued,
            "snapshots": scheduler.snapshots.len(),
            "tasks": tasks,
        });
        if let Err(err) = writeln!(log, "{row}") {
            tracing::warn!(%err, "work log not written");
            self.log = None;
        }
    }

    /// Export the scheduler's state (as Prometheus metrics: `metrics::WorkMetrics`), refreshed
    /// at every top-up.
    pub fn with_metrics(mut self, metrics: impl SchedulerObserver + 'static) -> Self {
        self.metrics = Some(Box::new(metrics));
        self
    }

    /// Fill the queue to its target now; failures are logged and retried on the next call.
    pub fn top_up(&mut self) {
        if let Some(metrics) = &self.metrics {
            metrics.observe(&self.scheduler);
            if let Some(leases) = self.queue.leases() {
                metrics.observe_leases(&leases);
            }
        }
        self.last_top_up = Some(Instant::now());
        self.finished_since_top_up = 0;
        match self.scheduler.top_up(self.queue.as_mut(), self.target) {
            Ok(0) => {}
            Ok(n) => tracing::debug!(submitted = n, "work items queued"),
            Err(err) => tracing::warn!(%err, "could not queue work items; retrying later"),
        }
    }

    /// Tell the queue which items `segment`'s actor has run: its finished scheduled episodes.
    /// On NATS only a confirmed item is done; one an actor reported done without its episodes
    /// arriving goes to another actor (issue 46).
    fn confirm(&mut self, segment: &TrajectorySegment) {
        for episode in &segment.finished_episodes {
            if let Some(item) = episode.work_item {
                self.queue.confirm(item, &segment.actor);
            }
        }
    }

    /// Top up after `segment` if due: at most every 50 ms (reading the queue depth is a broker
    /// round trip on NATS), or at once when scheduled episodes reported since the last top-up
    /// could have emptied half the queue. Without the second rule, fast actors drained the
    /// queue between top-ups whenever the learner did not update (the zero-variance filter
    /// dropping everything), and ran unscheduled episodes instead of the scheduler's.
    fn top_up_soon(&mut self, segment: &TrajectorySegment) {
        let finished = segment.finished_episodes.iter().filter(|e| e.work_item.is_some()).count() as u64;
        self.finished_since_top_up += finished;
        let drained = 2 * self.finished_since_top_up >= self.target;
        if drained || self.last_top_up.is_none_or(|at| at.elapsed() >= Duration::from_millis(50)) {
            self.top_up();
        }
    }
}

/// A learner-loop control that also drives a [`WorkPlanner`]: every accepted segment feeds the
/// scheduler, and the queue is topped up after every segment batch and update.
pub struct Planned<'a, C: crate::LearnerControl + ?Sized> {
    /// The wrapped control (progress, metrics, checkpoints).
    pub inner: &'a mut C,
    /// The planner.
    pub planner: &'a mut WorkPlanner,
}

impl<C: crate::LearnerControl + ?Sized> crate::LearnerControl for Planned<'_, C> {
    fn on_update(&mut self, learner: &mut crate::Learner, report: &crate::LearnerReport, stats: &crate::UpdateStats) {
        self.planner.top_up();
        self.planner.log_row(report);
        self.inner.on_update(learner, report, stats);
    }

    fn on_segment(&mut self, segment: &TrajectorySegment) {
        self.planner.confirm(segment);
        self.planner.scheduler.observe_segment(segment);
        self.planner.top_up_soon(segment);
        self.inner.on_segment(segment);
    }

    fn on_tick(&mut self, learner: &crate::Learner, report: &crate::LearnerReport) {
        self.inner.on_tick(learner, report);
    }
}

/// Index drawn with probability proportional to `weights` (uniform if they sum to 0).
fn sample_weighted(rng: &mut Pcg64Mcg, weights: &[f64]) -> usize {
    let total: f64 = weights.iter().sum();
    if !(total > 0.0 && total.is_finite()) {
        return rng.random_range(0..weights.len());
    }
    let mut u = rng.random::<f64>() * total;
    for (i, &w) in weights.iter().enumerate() {
        if u < w {
            return i;
        }
        u -= w;
    }
    weights.len() - 1
}

#[cfg(test)]
mod tests {
    use super::*;
    use volley_core::wire::EpisodeSummary;
    use volley_core::work::SnapshotInfo;
    use volley_env::MemoryConfig;
    use volley_testkit::fixtures::SegmentBuilder;
    use volley_transport::work::local_work_queue;

    fn memory_tasks() -> Vec<EnvConfig> {
        (1..=3).map(|delay| EnvConfig::Memory(MemoryConfig { n_cues: 2, delay })).collect()
    }

    fn config(policy: BudgetPolicy) -> WorkConfig {
        WorkConfig { enabled: true, tasks: memory_tasks(), policy, stats_window: 100, ..WorkConfig::default() }
    }

    fn segment(episodes: Vec<EpisodeSummary>, snapshots: Vec<SnapshotInfo>) -> TrajectorySegment {
        SegmentBuilder::new(0, 0).finished_episodes(episodes).saved_snapshots(snapshots).build()
    }

    fn outcome(task_id: u32, success: bool, start: Option<&str>) -> EpisodeSummary {
        EpisodeSummary {
            episode_return: if success { 1.0 } else { 0.0 },
            episode_len: 4,
            task_id,
            work_item: None,
            start: start.map(str::to_string),
            group: None,
        }
    }

    /// Task 0 always succeeds, task 1 half the time, task 2 never.
    fn feed(scheduler: &mut Scheduler) {
        let mut episodes = Vec::new();
        for i in 0..100 {
            episodes.push(outcome(0, true, None));
            episodes.push(outcome(1, i % 2 == 0, None));
            episodes.push(outcome(2, false, None));
        }
        scheduler.observe_segment(&segment(episodes, vec![]));
    }

    fn shares(scheduler: &mut Scheduler, n: usize) -> Vec<f64> {
        let mut counts = [0usize; 3];
        for item in scheduler.next_items(n) {
            counts[item.task_id as usize] += 1;
        }
        counts.iter().map(|&c| c as f64 / n as f64).collect()
    }

    #[test]
    fn uniform_spreads_items_evenly() {
        let mut scheduler = Scheduler::new(&config(BudgetPolicy::Uniform), &memory_tasks()[0], 1, 0);
        feed(&mut scheduler);
        for share in shares(&mut scheduler, 6000) {
            assert!((share - 1.0 / 3.0).abs() < 0.03, "{share}");
        }
    }

    #[test]
    fn learnability_puts_the_budget_where_success_is_uncertain() {
        let mut scheduler = Scheduler::new(&config(BudgetPolicy::Learnability), &memory_tasks()[0], 2, 0);
        feed(&mut scheduler);
        let shares = shares(&mut scheduler, 6000);
        // Weights: p(1-p) with p = 101/102, 51/102, 1/102, plus 0.025 each.
        let w = |p: f64| p * (1.0 - p) + 0.025;
        let expected = [w(101.0 / 102.0), w(0.5), w(1.0 / 102.0)];
        let total: f64 = expected.iter().sum();
        for (share, e) in shares.iter().zip(expected) {
            assert!((share - e / total).abs() < 0.03, "{shares:?}");
        }
        assert!(shares[1] > 0.7);
    }

    #[test]
    fn ucb_prefers_the_learnable_task_but_still_tries_the_others() {
        let mut scheduler = Scheduler::new(&config(BudgetPolicy::Ucb), &memory_tasks()[0], 3, 0);
        feed(&mut scheduler);
        let shares = shares(&mut scheduler, 3000);
        assert!(shares[1] > shares[0] && shares[1] > shares[2], "{shares:?}");
        assert!(shares[0] > 0.0 && shares[2] > 0.0, "{shares:?}");
    }

    #[test]
    fn restarts_prefer_far_and_rarely_visited_states_and_credit_them() {
        let work = WorkConfig { restart_share: 1.0, ..config(BudgetPolicy::Uniform) };
        let mut scheduler = Scheduler::new(&work, &memory_tasks()[0], 4, 100);
        let info = |key: &str, progress: f32| SnapshotInfo {
            key: key.into(),
            task_id: 1,
            progress,
            episode_return: 0.0,
            episode_len: 3,
        };
        scheduler.observe_segment(&segment(vec![], vec![info("near", 0.0), info("far", 3.0)]));
        let items = scheduler.next_items(400);
        assert_eq!(items[0].id, 100);
        let far = items.iter().filter(|i| i.start == Start::Resume { snapshot: "far".into() }).count();
        assert!(far > 300, "far chosen {far} of 400");
        assert!(items.iter().all(|i| i.task_id == 1));
        assert_eq!(scheduler.items_issued(), (0, 400));
        scheduler.observe_segment(&segment(vec![outcome(1, true, Some("far"))], vec![]));
        assert_eq!(scheduler.snapshots["far"].outcomes.episodes, 1);
    }

    /// Regression for issue 18: weighed one by one, 1000 saved states at progress 1 outweighed
    /// the one frontier state at progress 3 (16 against 4000: chosen 0.4 % of the time), and
    /// restarts on a long chain never got past the early rooms.
    #[test]
    fn restarts_choose_the_frontier_cell_however_many_early_states_are_saved() {
        let work = WorkConfig { restart_share: 1.0, ..config(BudgetPolicy::Uniform) };
        let mut scheduler = Scheduler::new(&work, &memory_tasks()[0], 7, 0);
        let info = |key: String, progress: f32| SnapshotInfo {
            key,
            task_id: 0,
            progress,
            episode_return: 0.0,
            episode_len: 3,
        };
        let mut saved: Vec<SnapshotInfo> = (0..1000).map(|i| info(format!("room1-{i}"), 1.0)).collect();
        saved.push(info("room3".into(), 3.0));
        scheduler.observe_segment(&segment(vec![], saved));
        let items = scheduler.next_items(400);
        let frontier = items.iter().filter(|i| i.start == Start::Resume { snapshot: "room3".into() }).count();
        // Cells weigh 4/√(1+v₁) and 16/√(1+v₃): the frontier takes most items, and the early
        // cell still gets some, spread over its states (least visited first).
        assert!(frontier > 200, "the frontier was chosen {frontier} of 400 times");
        let early: std::collections::HashSet<_> = items
            .iter()
            .filter_map(|i| match &i.start {
                Start::Resume { snapshot } if snapshot != "room3" => Some(snapshot),
                _ => None,
            })
            .collect();
        assert!(early.len() as f64 >= 0.9 * (400 - frontier) as f64, "{} distinct early states", early.len());
    }

    #[test]
    fn top_up_fills_the_queue_to_its_target() {
        let (mut queue, _source) = local_work_queue();
        let mut scheduler = Scheduler::new(&config(BudgetPolicy::Uniform), &memory_tasks()[0], 5, 0);
        assert_eq!(scheduler.top_up(&mut queue, 8).unwrap(), 8);
        assert_eq!(scheduler.top_up(&mut queue, 8).unwrap(), 0);
        assert_eq!(queue.queued().unwrap(), 8);
        let shares = scheduler.budget_shares();
        assert!((shares.iter().sum::<f64>() - 1.0).abs() < 1e-9);
    }

    #[test]
    fn unknown_tasks_and_bad_progress_are_ignored() {
        let mut scheduler = Scheduler::new(&config(BudgetPolicy::Uniform), &memory_tasks()[0], 6, 0);
        let bad = SnapshotInfo { key: "x".into(), task_id: 99, progress: 1.0, episode_return: 0.0, episode_len: 1 };
        let nan = SnapshotInfo { key: "y".into(), task_id: 0, progress: f32::NAN, episode_return: 0.0, episode_len: 1 };
        scheduler.observe_segment(&segment(vec![outcome(42, true, None)], vec![bad, nan]));
        assert_eq!(scheduler.known_snapshots(), 0);
        assert!(scheduler.task_stats().iter().all(|s| s.outcomes.episodes == 0));
    }

    /// The scheduler's table of saved states is keyed by what actors report: bounded, with the
    /// cells (kept incrementally for cheap restarts) always matching the states.
    #[test]
    fn saved_states_stay_bounded_and_cells_match_them() {
        let work = WorkConfig { restart_share: 1.0, ..config(BudgetPolicy::Uniform) };
        let mut scheduler = Scheduler::new(&work, &memory_tasks()[0], 9, 0);
        for batch in 0..12u32 {
            let saved = (0..1000u32)
                .map(|i| SnapshotInfo {
                    key: format!("b{batch}-{i}"),
                    task_id: i % 3,
                    progress: (i % 5) as f32,
                    episode_return: 0.0,
                    episode_len: 1,
                })
                .collect();
            scheduler.observe_segment(&segment(vec![], saved));
            scheduler.next_items(300);
            assert!(scheduler.known_snapshots() <= MAX_KNOWN_SNAPSHOTS);
            let in_cells: usize = scheduler.cells.values().map(|c| c.states.len()).sum();
            assert_eq!(in_cells, scheduler.known_snapshots());
            for cell in scheduler.cells.values() {
                assert!(!cell.states.is_empty());
                assert_eq!(cell.visits, cell.states.iter().map(|(v, _)| v).sum::<u64>());
                assert!(cell.states.iter().all(|(v, k)| scheduler.snapshots[k].visits == *v));
            }
        }
        // The frontier (progress 4) survives the bound: the least promising states go first.
        assert!(scheduler.frontier().iter().all(|(furthest, _)| *furthest == Some(4.0)));
    }

    #[test]
    fn groups_are_whole_share_a_start_and_have_consecutive_ids() {
        let work = WorkConfig { group_size: 4, group_share: 0.5, restart_share: 0.5, ..config(BudgetPolicy::Uniform) };
        let mut scheduler = Scheduler::new(&work, &memory_tasks()[0], 8, 1000);
        let info = SnapshotInfo { key: "s".into(), task_id: 2, progress: 1.0, episode_return: 0.0, episode_len: 3 };
        scheduler.observe_segment(&segment(vec![], vec![info]));
        let items = scheduler.next_items(2000);
        assert!(items.windows(2).all(|w| w[1].id == w[0].id + 1), "ids count up");
        let (mut groups, mut singles, mut i) = (0, 0, 0);
        while i < items.len() {
            let Some(tag) = items[i].group else {
                singles += 1;
                i += 1;
                continue;
            };
            assert_eq!((tag.group, tag.member, tag.size), (items[i].id, 0, 4), "a group starts at its first member");
            let members = &items[i..i + 4];
            for (k, member) in members.iter().enumerate() {
                assert_eq!(member.group, Some(GroupMember { group: tag.group, member: k as u32, size: 4 }));
                assert_eq!((member.task_id, &member.start, member.episodes), (items[i].task_id, &items[i].start, 1));
            }
            groups += 1;
            i += 4;
        }
        assert_eq!(groups, scheduler.groups_issued());
        let share = groups as f64 / (groups + singles) as f64;
        assert!((share - 0.5).abs() < 0.06, "groups are {share} of the draws");
        let (fresh, resume) = scheduler.items_issued();
        assert_eq!(fresh + resume, groups + singles);
    }

    /// Fast actors must not drain the queue between top-ups: scheduled episodes reported since
    /// the last top-up trigger one at once when they could have emptied half the queue.
    #[test]
    fn the_planner_tops_up_at_once_when_reported_episodes_may_have_drained_the_queue() {
        use volley_transport::work::WorkSource;
        let (queue, mut source) = local_work_queue();
        let scheduler = Scheduler::new(&config(BudgetPolicy::Uniform), &memory_tasks()[0], 9, 0);
        let mut planner = WorkPlanner::new(scheduler, Box::new(queue), 8);
        planner.top_up();
        for _ in 0..8 {
            let (_, token) = source.take(Duration::ZERO).expect("local").expect("queued");
            source.complete(token).expect("local");
        }
        // A top-up "in the future": the 50 ms rule cannot fire, only the drain rule.
        planner.last_top_up = Some(Instant::now() + Duration::from_secs(3600));
        let done = |id| EpisodeSummary { work_item: Some(id), ..outcome(0, true, None) };
        planner.top_up_soon(&segment(vec![done(0), done(1), done(2), outcome(0, true, None)], vec![]));
        assert_eq!(planner.queue.queued().unwrap(), 0, "three items may have been taken: not yet");
        planner.top_up_soon(&segment(vec![done(3)], vec![]));
        assert_eq!(planner.queue.queued().unwrap(), 8, "four of eight: topped up at once");
    }
}
