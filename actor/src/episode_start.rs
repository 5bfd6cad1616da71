//! Where each environment slot's episodes start, behind one interface the rollout loop calls.
//!
//! The loop in [`crate::rollout::RolloutWorker::collect_segments`] steps environments and
//! builds segments; it does not know whether episodes are scheduled. At fixed points it asks
//! an [`EpisodeStarts`]:
//!
//! - at every segment boundary, per slot ([`EpisodeStarts::at_segment_boundary`]): a start
//!   that had to wait for a boundary happens now;
//! - for the tags of the running episode ([`EpisodeStarts::tags`]): its task, work item and
//!   saved start, which go into the segment and into finished-episode summaries;
//! - for the action-sampling generator of the running episode ([`EpisodeStarts::action_rng`]),
//!   when it has its own (so a resumed episode replays exactly);
//! - after every step that did not end the episode ([`EpisodeStarts::after_step`]), which may
//!   save a snapshot;
//! - after every episode end ([`EpisodeStarts::episode_ended`]), once the slot holds a fresh
//!   zero-state episode: the next start (a work item's next episode, a new item, a restored
//!   snapshot);
//! - after the segment ([`EpisodeStarts::segment_done`]).
//!
//! [`FreshStarts`] runs fresh episodes back to back (the environment's own auto-reset).
//! [`WorkStarts`] takes work items from a queue, restores saved states, saves snapshots at
//! milestones and every `work.snapshot_every_steps` steps, and continues an interrupted item
//! from its newest snapshot (docs/ARCHITECTURE.md, "Save-load and budget assignment").

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use rand::SeedableRng;
use rand_pcg::Pcg64Mcg;
use tracing::{debug, info, warn};
use volley_core::ids::{ActorId, PolicyVersion};
use volley_core::spec::{RunSpec, SpecError};
use volley_core::work::{group_stream_seed, EpisodeSnapshot, GroupMember, SnapshotInfo, Start, WorkItem};
use volley_env::{EnvConfig, VectorEnv};
use volley_transport::work::{SnapshotStore, WorkSource, WorkToken};

use crate::counters::ActorCounters;
use crate::error::ActorError;

/// Mixed into a restart's episode seed for its action-sampling stream.
const RESTART_STREAM: u64 = 0x7e57_a2e5_0f0e_5eed;

/// Return and length of the episode running in a slot, so far.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct RunningEpisode {
    /// Undiscounted return so far.
    pub episode_return: f32,
    /// Steps so far.
    pub episode_len: u32,
}

/// The parts of one environment slot that starting or saving an episode touches.
pub struct SlotView<'a> {
    /// Which environment of the vector.
    pub env_idx: usize,
    /// The actor's environments.
    pub envs: &'a mut dyn VectorEnv,
    /// This slot's recurrent state `[H]` (empty for feed-forward policies).
    pub hidden: &'a mut [f32],
    /// This slot's running episode.
    pub episode: &'a mut RunningEpisode,
}

/// What the running episode of a slot serves: recorded in segments and episode summaries.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct EpisodeTags {
    /// Task index (0 with one task).
    pub task_id: u32,
    /// The work item the episode belongs to, when it is scheduled.
    pub work_item: Option<u64>,
    /// The saved state the episode started from (`None`: a fresh start).
    pub start: Option<String>,
    /// The group of continuations the episode belongs to (group rollouts).
    pub group: Option<GroupMember>,
}

/// Where episodes start (see the module docs for when the rollout loop calls each method).
pub trait EpisodeStarts: Send {
    /// A segment begins: start the slot's episode if its start waited for a boundary. Returns
    /// whether the running episode was replaced (without ending) by another.
    fn at_segment_boundary(&mut self, slot: SlotView<'_>) -> bool;
    /// Tags of the episode running in `env_idx`.
    fn tags(&self, env_idx: usize) -> EpisodeTags;
    /// The running episode's own action-sampling generator; `None`: use the worker's.
    fn action_rng(&mut self, env_idx: usize) -> Option<&mut Pcg64Mcg>;
    /// A step that did not end the episode was taken with `policy_version`; returns the
    /// snapshot saved, if any.
    fn after_step(&mut self, slot: SlotView<'_>, policy_version: PolicyVersion) -> Option<SnapshotInfo>;
    /// The slot's episode ended and the slot now holds a fresh episode with zero recurrent
    /// state and zero return: replace it with the next scheduled start, if any.
    fn episode_ended(&mut self, slot: SlotView<'_>);
    /// A segment was cut from every slot.
    fn segment_done(&mut self);
}

/// Fresh episodes back to back: every hook leaves the environment's own auto-reset alone.
#[derive(Debug, Clone, Copy, Default)]
pub struct FreshStarts;

impl EpisodeStarts for FreshStarts {
    fn at_segment_boundary(&mut self, _slot: SlotView<'_>) -> bool {
        false
    }

    fn tags(&self, _env_idx: usize) -> EpisodeTags {
        EpisodeTags::default()
    }

    fn action_rng(&mut self, _env_idx: usize) -> Option<&mut Pcg64Mcg> {
        None
    }

    fn after_step(&mut self, _slot: SlotView<'_>, _policy_version: PolicyVersion) -> Option<SnapshotInfo> {
        None
    }

    fn episode_ended(&mut self, _slot: SlotView<'_>) {}

    fn segment_done(&mut self) {}
}

/// A work item an environment slot is running.
struct ActiveItem {
    item: WorkItem,
    token: WorkToken,
    /// Episodes of the item finished (or, for an interrupted item, finished before the crash).
    episodes_done: u32,
    /// The newest snapshot of an interrupted run of this item, to continue from.
    continue_from: Option<EpisodeSnapshot>,
}

impl ActiveItem {
    /// Reset seed of the item's next episode.
    fn episode_seed(&self) -> u64 {
        let episode_index = u64::from(self.episodes_done);
        match self.item.start {
            Start::Fresh { seed } => seed.wrapping_add(episode_index),
            Start::Resume { .. } => self.item.id.wrapping_mul(0x9e37_79b9_7f4a_7c15) ^ episode_index,
        }
    }
}

/// Save-load state of one environment slot.
#[derive(Default)]
struct Slot {
    item: Option<ActiveItem>,
    /// The task the slot's environment runs: `None` while it still runs the run spec's own
    /// environment, which need not be any task of the list (issue 48: the first scheduled
    /// episode of each slot ran the run's default environment labelled with its item's task).
    env_task: Option<u32>,
    /// The saved state the current episode started from (`None`: fresh).
    start: Option<String>,
    /// The group the current scheduled episode is a member of.
    group: Option<GroupMember>,
    /// The current scheduled episode's action-sampling generator (saved in its snapshots).
    rng: Option<Pcg64Mcg>,
    /// The current episode belongs to `item`.
    scheduled: bool,
    episode_index: u32,
    steps_since_save: u32,
    /// Waiting for a segment boundary to start (a resume that restores recurrent state).
    needs_start: bool,
}

impl Slot {
    /// The item of the running episode, when the episode is scheduled.
    fn scheduled_item(&self) -> Option<&ActiveItem> {
        self.item.as_ref().filter(|_| self.scheduled)
    }

    /// The task label of the running episode: unscheduled episodes of the run's own
    /// environment are reported as task 0, which admission knows to check against the run
    /// environment's limits too.
    fn task_label(&self) -> u32 {
        self.env_task.unwrap_or(0)
    }
}

/// Scheduled episodes: work items from a queue, snapshots to and from a store.
pub struct WorkStarts {
    source: Box<dyn WorkSource>,
    store: Box<dyn SnapshotStore>,
    tasks: Vec<EnvConfig>,
    snapshot_at_milestones: bool,
    snapshot_every_steps: u32,
    slots: Vec<Slot>,
    actor: ActorId,
    counters: Arc<ActorCounters>,
}

impl WorkStarts {
    /// Scheduled starts for `n_envs` slots of a run whose spec has `work.enabled`.
    pub fn new(
        spec: &RunSpec,
        n_envs: usize,
        source: Box<dyn WorkSource>,
        store: Box<dyn SnapshotStore>,
        actor: ActorId,
        counters: Arc<ActorCounters>,
    ) -> Result<Self, ActorError> {
        let work = &spec.hyper.work;
        if !work.enabled {
            return Err(ActorError::Spec(SpecError::Work("the run spec does not enable work items".into())));
        }
        let tasks = work.task_list(&spec.env);
        // The slots' environments were built from the run's environment; they run a task of
        // the list without switching only when the list holds that very configuration.
        let env_task = tasks.iter().position(|task| *task == spec.env).map(|idx| idx as u32);
        Ok(WorkStarts {
            source,
            store,
            tasks,
            snapshot_at_milestones: work.snapshot_at_milestones,
            snapshot_every_steps: work.snapshot_every_steps,
            // Every slot takes its first item at the first segment boundary.
            slots: (0..n_envs).map(|_| Slot { needs_start: true, env_task, ..Slot::default() }).collect(),
            actor,
            counters,
        })
    }

    /// Give the slot its next scheduled episode: the next episode of its item, or a new item.
    /// A start mid-segment (`at_boundary` false) that restores a recurrent state happens at
    /// once: the segment records the restored state at that step (`restored_states`) and the
    /// learner starts the step from it. Only when no item is available does the slot run an
    /// unscheduled episode until the next segment boundary. Returns whether the slot's
    /// episode was replaced (reset or restored).
    fn start_next(&mut self, mut slot_view: SlotView<'_>, at_boundary: bool) -> bool {
        let env_idx = slot_view.env_idx;
        let slot = &mut self.slots[env_idx];
        slot.scheduled = false;
        slot.rng = None;
        slot.start = None;
        slot.group = None;
        if !self.ensure_item(env_idx, at_boundary) {
            self.slots[env_idx].needs_start = !at_boundary;
            self.counters.unscheduled_episodes.fetch_add(1, Ordering::Relaxed);
            return false;
        }
        let slot = &mut self.slots[env_idx];
        let active = slot.item.as_mut().expect("ensure_item leaves an active item");
        slot.needs_start = false;
        let episode_index = active.episodes_done;
        let item_id = active.item.id;
        let item_task = active.item.task_id;
        let seed = active.episode_seed();
        let group = active.item.group;
        // Where this episode starts: the interrupted run's newest state, the item's saved
        // state, or a fresh reset.
        // An interrupted episode (a group member's too) continues exactly, with the sampling
        // generator it was saved with. A restart from a saved state (Go-Explore's "return, then
        // explore") draws a new stream: a group member its member stream, any other item one
        // from its seed. With the saved generator every restart of a state would replay the
        // actions the original episode took after it, and explore nothing.
        let (snapshot, origin, continues) = if let Some(snapshot) = active.continue_from.take() {
            let origin = snapshot.origin.clone();
            (Some(snapshot), origin, true)
        } else {
            match &active.item.start {
                Start::Fresh { .. } => (None, None, false),
                Start::Resume { snapshot: key } => match self.store.load(key) {
                    Ok(Some(snapshot)) => (Some(snapshot), Some(key.clone()), false),
                    Ok(None) | Err(_) => {
                        warn!(actor = %self.actor, snapshot = %key, "saved state gone; fresh start instead");
                        self.counters.resume_failures.fetch_add(1, Ordering::Relaxed);
                        (None, None, false)
                    }
                },
            }
        };
        let restored = snapshot
            .and_then(|snapshot| restore(&self.tasks, &self.actor, slot, &mut slot_view, snapshot, seed))
            .map(|saved| match group {
                _ if continues => saved,
                Some(member) => Pcg64Mcg::seed_from_u64(group_stream_seed(member.group, member.member)),
                None => Pcg64Mcg::seed_from_u64(seed ^ RESTART_STREAM),
            });
        let rng = match restored {
            Some(rng) => {
                self.counters.episodes_resumed.fetch_add(1, Ordering::Relaxed);
                slot.start = origin;
                rng
            }
            None => {
                let task_id = item_task.min(self.tasks.len().saturating_sub(1) as u32);
                let envs = &mut *slot_view.envs;
                let reset = if Some(task_id) != slot.env_task {
                    envs.switch_task(env_idx, &self.tasks[task_id as usize], seed)
                } else {
                    envs.reset_env(env_idx, seed)
                };
                if let Err(err) = reset {
                    warn!(actor = %self.actor, %err, "scheduled reset failed; running an unscheduled episode");
                    return false;
                }
                slot.env_task = Some(task_id);
                slot_view.hidden.fill(0.0);
                *slot_view.episode = RunningEpisode::default();
                slot.start = None;
                // Members of a fresh group share the reset seed, so they start from one
                // state, and sample from their own streams.
                match group {
                    Some(member) => Pcg64Mcg::seed_from_u64(group_stream_seed(member.group, member.member)),
                    None => Pcg64Mcg::seed_from_u64(seed ^ 0x5a3e_ed01),
                }
            }
        };
        slot.group = group;
        slot.rng = Some(rng);
        slot.scheduled = true;
        slot.episode_index = episode_index;
        slot.steps_since_save = 0;
        debug!(actor = %self.actor, item = item_id, env_idx, "scheduled episode started");
        true
    }

    /// Make sure slot `env_idx` has an item with episodes left: complete a finished one, take
    /// a new one. `false` when the queue had none (or could not be read).
    fn ensure_item(&mut self, env_idx: usize, at_boundary: bool) -> bool {
        let slot = &mut self.slots[env_idx];
        loop {
            if let Some(active) = &slot.item {
                if active.episodes_done < active.item.episodes {
                    return true;
                }
                let active = slot.item.take().expect("checked above");
                if let Err(err) = self.source.complete(active.token) {
                    warn!(actor = %self.actor, item = active.item.id, %err, "could not complete a work item; it may run again");
                }
                self.counters.work_items_completed.fetch_add(1, Ordering::Relaxed);
            }
            let wait = if at_boundary { Duration::from_millis(20) } else { Duration::ZERO };
            match self.source.take(wait) {
                Ok(Some((item, token))) => {
                    // An item taken again after its actor died continues from its newest snapshot.
                    let continue_from = newest_snapshot(self.store.as_mut(), &self.actor, item.id);
                    let episodes_done = continue_from.as_ref().map_or(0, |s| s.episode_index);
                    if continue_from.is_some() {
                        info!(actor = %self.actor, item = item.id, "continuing an interrupted work item from its newest snapshot");
                    }
                    slot.item = Some(ActiveItem { item, token, episodes_done, continue_from });
                }
                Ok(None) => return false,
                Err(err) => {
                    warn!(actor = %self.actor, %err, "taking work failed; running an unscheduled episode");
                    return false;
                }
            }
        }
    }
}

/// The newest snapshot of an interrupted run of `item`, if one is kept and loads.
fn newest_snapshot(store: &mut dyn SnapshotStore, actor: &ActorId, item: u64) -> Option<EpisodeSnapshot> {
    match store.latest_for_item(item) {
        Ok(Some(key)) => match store.load(&key) {
            Ok(Some(snapshot)) if snapshot.work_item == item => Some(snapshot),
            Ok(_) => None,
            Err(err) => {
                warn!(%actor, item, %err, "newest snapshot unusable; restarting the item");
                None
            }
        },
        Ok(None) => None,
        Err(err) => {
            warn!(%actor, item, %err, "snapshot index unreadable; restarting the item");
            None
        }
    }
}

/// Put `snapshot`'s episode into the slot (task, environment state, recurrent state, running
/// statistics) and return its action-sampling generator; `None` when it does not fit, with
/// the slot then needing a fresh reset.
fn restore(
    tasks: &[EnvConfig],
    actor: &ActorId,
    slot: &mut Slot,
    view: &mut SlotView<'_>,
    snapshot: EpisodeSnapshot,
    seed: u64,
) -> Option<Pcg64Mcg> {
    let SlotView { env_idx, envs, hidden, episode } = view;
    let env_idx = *env_idx;
    let task = tasks.get(snapshot.task_id as usize)?;
    if snapshot.hidden.len() != hidden.len() {
        return None;
    }
    if Some(snapshot.task_id) != slot.env_task {
        if let Err(err) = envs.switch_task(env_idx, task, seed) {
            warn!(%actor, %err, "cannot switch task for a saved state");
            return None;
        }
        slot.env_task = Some(snapshot.task_id);
    }
    if let Err(err) = envs.restore_env(env_idx, &snapshot.env) {
        warn!(%actor, %err, "saved state does not restore; fresh start instead");
        return None;
    }
    hidden.copy_from_slice(&snapshot.hidden);
    **episode = RunningEpisode { episode_return: snapshot.episode_return, episode_len: snapshot.episode_len };
    Some(snapshot.rng)
}

impl EpisodeStarts for WorkStarts {
    fn at_segment_boundary(&mut self, slot: SlotView<'_>) -> bool {
        if !self.slots[slot.env_idx].needs_start {
            return false;
        }
        self.start_next(slot, true)
    }

    fn tags(&self, env_idx: usize) -> EpisodeTags {
        let slot = &self.slots[env_idx];
        EpisodeTags {
            task_id: slot.task_label(),
            work_item: slot.scheduled_item().map(|active| active.item.id),
            start: if slot.scheduled { slot.start.clone() } else { None },
            group: if slot.scheduled { slot.group } else { None },
        }
    }

    fn action_rng(&mut self, env_idx: usize) -> Option<&mut Pcg64Mcg> {
        self.slots[env_idx].rng.as_mut()
    }

    /// Save the slot's episode if it is at a milestone or due by step count.
    fn after_step(&mut self, slot_view: SlotView<'_>, policy_version: PolicyVersion) -> Option<SnapshotInfo> {
        let SlotView { env_idx, envs, hidden, episode } = slot_view;
        let slot = &mut self.slots[env_idx];
        let item_id = slot.scheduled_item()?.item.id;
        slot.steps_since_save += 1;
        let at_milestone = self.snapshot_at_milestones && envs.env_at_milestone(env_idx);
        let due = self.snapshot_every_steps > 0 && slot.steps_since_save >= self.snapshot_every_steps;
        if !(at_milestone || due) {
            return None;
        }
        let env = match envs.snapshot_env(env_idx) {
            Ok(env) => env,
            Err(err) => {
                debug!(actor = %self.actor, %err, "environment cannot snapshot");
                return None;
            }
        };
        let snapshot = EpisodeSnapshot {
            work_item: item_id,
            episode_index: slot.episode_index,
            task_id: slot.task_label(),
            origin: slot.start.clone(),
            env,
            hidden: hidden.to_vec(),
            episode_return: episode.episode_return,
            episode_len: episode.episode_len,
            policy_version,
            rng: slot.rng.clone().expect("a scheduled episode has its generator"),
            progress: envs.env_progress(env_idx),
        };
        match self.store.save(&snapshot) {
            Ok(key) => {
                slot.steps_since_save = 0;
                self.counters.snapshots_saved.fetch_add(1, Ordering::Relaxed);
                Some(SnapshotInfo {
                    key,
                    task_id: snapshot.task_id,
                    progress: snapshot.progress,
                    episode_return: snapshot.episode_return,
                    episode_len: snapshot.episode_len,
                })
            }
            Err(err) => {
                warn!(actor = %self.actor, %err, "snapshot not saved");
                None
            }
        }
    }

    fn episode_ended(&mut self, slot: SlotView<'_>) {
        let env_slot = &mut self.slots[slot.env_idx];
        if env_slot.scheduled {
            if let Some(active) = env_slot.item.as_mut() {
                active.episodes_done += 1;
            }
        }
        self.start_next(slot, false);
    }

    /// Tell the work queue every running item is still alive.
    fn segment_done(&mut self) {
        for slot in &self.slots {
            if let Some(active) = &slot.item {
                if let Err(err) = self.source.progress(active.token) {
                    debug!(actor = %self.actor, %err, "work progress signal failed");
                }
            }
        }
    }
}
