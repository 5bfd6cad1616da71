//! Vectorised rollout: N environments, batched CPU inference, one segment per environment
//! per `segment_len` steps.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use rand::{Rng, SeedableRng};
use rand_pcg::Pcg64Mcg;
use tracing::{debug, info, warn};
use volley_core::ids::{ActorId, PolicyVersion};
use volley_core::spec::{RunSpec, SpecError};
use volley_core::wire::{EpisodeSummary, TrajectorySegment, Weights};
use volley_core::work::{EpisodeSnapshot, SnapshotInfo, Start, WorkItem};
use volley_env::{Actions, EnvError, VecEnv, VecStep, VectorEnv};
use volley_policy::distributions::{log_softmax, sample_categorical};
use volley_policy::{ParamLayout, PolicyInference};
use volley_transport::envsvc::RemoteEnvCounters;
use volley_transport::work::{SnapshotStore, WorkSource, WorkToken};
use volley_transport::{TrajectorySink, TransportError, WeightsFollower};

/// Why an actor stopped with an error.
#[derive(Debug, thiserror::Error)]
pub enum ActorError {
    /// This build cannot serve the run spec.
    #[error("cannot serve run spec: {0}")]
    Spec(#[from] SpecError),
    /// An environment could not be built or reset.
    #[error("environment: {0}")]
    Env(#[from] EnvError),
    /// The weights do not fit this actor's layout.
    #[error("weights v{version} rejected: {reason}")]
    Weights {
        /// The version offered.
        version: u64,
        /// Why.
        reason: String,
    },
    /// The transport failed for good.
    #[error("transport: {0}")]
    Transport(#[from] TransportError),
}

/// Counters an actor updates as it runs; shared with whoever reports progress.
#[derive(Debug, Default)]
pub struct ActorCounters {
    /// Segment publishes that failed (retried by the transport, or fatal).
    pub publish_errors: AtomicU64,
    /// Nanoseconds spent fetching new weight versions (download and verification).
    pub weight_fetch_nanos: AtomicU64,
    /// Weight fetches timed in `weight_fetch_nanos`.
    pub weight_fetches: AtomicU64,
    /// Weights pointers refused (wrong layout, size, checksum or version) or not fetchable
    /// (missing object, timeout); the actor keeps its verified version (docs/SECURITY.md).
    pub weights_refused: AtomicU64,
    /// Work items finished (save-load / budget assignment).
    pub work_items_completed: AtomicU64,
    /// Episode snapshots saved.
    pub snapshots_saved: AtomicU64,
    /// Episodes continued from a saved state (scheduled restarts and interrupted items).
    pub episodes_resumed: AtomicU64,
    /// Saved states that could not be loaded (expired or undecodable); a fresh start was
    /// run instead.
    pub resume_failures: AtomicU64,
    /// Episodes run without a work item because the queue was empty.
    pub unscheduled_episodes: AtomicU64,
    /// Run specs read from the broker that failed their checksum or did not decode (never
    /// used; the actor reads the spec again).
    pub spec_rejected: AtomicU64,
    /// Environment steps taken.
    pub env_steps: AtomicU64,
    /// Segments published.
    pub segments_published: AtomicU64,
    /// Episodes finished.
    pub episodes: AtomicU64,
    /// Environment failures (error or non-finite output), each followed by a reset.
    pub env_errors: AtomicU64,
    /// Episodes cut short by an environment failure (an error, or a lost remote environment
    /// server); they are not reported as finished episodes.
    pub episodes_aborted: AtomicU64,
    /// Counters of the remote environment client, when the environments are remote.
    pub remote_env: Arc<RemoteEnvCounters>,
    /// Weight versions switched to.
    pub weight_updates: AtomicU64,
    /// Policy version in use.
    pub policy_version: AtomicU64,
    /// Nanoseconds spent blocked by transport backpressure.
    pub throttled_nanos: AtomicU64,
    /// Nanoseconds spent stepping environments.
    pub env_nanos: AtomicU64,
    /// Nanoseconds spent in policy inference.
    pub inference_nanos: AtomicU64,
    /// Mean return of this actor's last [`RETURN_WINDOW`] finished episodes, as `f64` bits
    /// (0.0 until the first episode ends).
    pub episode_return_mean_bits: AtomicU64,
    /// The sink's live pacing clock, when its transport has one: the throttled time then
    /// includes a wait still in progress (set once, by whoever opened the sink).
    pub pacing: std::sync::OnceLock<Arc<volley_transport::PacingClock>>,
    /// Whether the loop is inside [`TrajectorySink::publish`] now (waiting on pacing or on the
    /// broker's acknowledgements: the actor is waiting on others, not stuck).
    pub publishing: std::sync::atomic::AtomicBool,
}

impl ActorCounters {
    /// Time blocked by backpressure so far, a wait in progress included when the sink's
    /// transport reports it live.
    pub fn throttled(&self) -> Duration {
        let counted = Duration::from_nanos(self.throttled_nanos.load(Ordering::Relaxed));
        self.pacing.get().map_or(counted, |clock| clock.total().max(counted))
    }
}

/// How many of an actor's most recent episodes its mean return covers (the learner's window).
pub const RETURN_WINDOW: usize = 100;

/// Per-environment segment under construction.
#[derive(Debug, Default)]
struct SegmentBuilder {
    episode_id: u64,
    segment_idx: u64,
    episode_return: f32,
    episode_len: u32,
    episode_id_at_start: u64,
    observations: Vec<f32>,
    actions: Vec<u32>,
    rewards: Vec<f32>,
    terminated: Vec<u8>,
    truncated: Vec<u8>,
    behaviour_log_probs: Vec<f32>,
    truncation_values: Vec<f32>,
    initial_hidden: Vec<f32>,
    finished_episodes: Vec<EpisodeSummary>,
    saved_snapshots: Vec<SnapshotInfo>,
    task_id_at_start: u32,
    start_at_start: Option<String>,
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

/// Save-load state of one environment slot.
#[derive(Default)]
struct Slot {
    item: Option<ActiveItem>,
    task_id: u32,
    /// The saved state the current episode started from (`None`: fresh).
    start: Option<String>,
    /// The current scheduled episode's action-sampling generator (saved in its snapshots).
    rng: Option<Pcg64Mcg>,
    /// The current episode belongs to `item`.
    scheduled: bool,
    episode_index: u32,
    steps_since_save: u32,
    /// Waiting for a segment boundary to start (a resume that restores recurrent state).
    needs_start: bool,
}

/// Work queue, snapshot store and per-slot state of an actor whose episodes are scheduled.
struct WorkState {
    source: Box<dyn WorkSource>,
    store: Box<dyn SnapshotStore>,
    tasks: Vec<volley_env::EnvConfig>,
    slots: Vec<Slot>,
}

/// Steps `n_envs` environments with the latest policy and produces segments.
pub struct RolloutWorker {
    spec: RunSpec,
    layout: ParamLayout,
    actor: ActorId,
    /// Distinguishes this worker's segments from an earlier one with the same actor id, whose
    /// segment indices also started at 0.
    incarnation: u64,
    envs: Box<dyn VectorEnv>,
    inference: PolicyInference,
    weights: Option<Arc<Weights>>,
    hidden: Vec<f32>,
    logits: Vec<f32>,
    log_probs: Vec<f32>,
    values: Vec<f32>,
    actions: Vec<usize>,
    step: VecStep,
    /// Per environment: its episode was aborted this step (valid while `step.env_errors` is
    /// not empty).
    aborted: Vec<bool>,
    builders: Vec<SegmentBuilder>,
    rng: Pcg64Mcg,
    // Scratch for bootstrapping truncated episodes.
    trunc_obs: Vec<f32>,
    trunc_hidden: Vec<f32>,
    trunc_logits: Vec<f32>,
    trunc_values: Vec<f32>,
    /// Returns of the last [`RETURN_WINDOW`] finished episodes, oldest first.
    recent_returns: VecDeque<f32>,
    counters: Arc<ActorCounters>,
    work: Option<WorkState>,
}

impl RolloutWorker {
    /// Build the environments and policy for `spec`; refuses a spec this build cannot serve.
    /// The environments run in this process; for remote ones see [`RolloutWorker::with_envs`].
    pub fn new(
        spec: RunSpec,
        actor: ActorId,
        n_envs: usize,
        seed: u64,
        counters: Arc<ActorCounters>,
    ) -> Result<Self, ActorError> {
        spec.validate()?;
        if n_envs == 0 {
            return Err(ActorError::Env(EnvError::Config("n_envs must be at least 1".into())));
        }
        let envs = (0..n_envs).map(|_| spec.env.build()).collect::<Result<Vec<_>, _>>()?;
        let envs = VecEnv::new(envs, seed)?;
        Self::with_envs(spec, actor, Box::new(envs), seed, counters)
    }

    /// Act in `envs` (e.g. a [`volley_transport::envsvc::RemoteVecEnv`]), whose spaces must match
    /// the spec's policy.
    pub fn with_envs(
        spec: RunSpec,
        actor: ActorId,
        envs: Box<dyn VectorEnv>,
        seed: u64,
        counters: Arc<ActorCounters>,
    ) -> Result<Self, ActorError> {
        let layout = spec.validate()?;
        let n_envs = envs.n_envs();
        for (what, policy, env) in
            [("obs_dim", spec.policy.obs_dim, envs.obs_dim()), ("n_actions", spec.policy.n_actions, envs.n_actions())]
        {
            if policy != env {
                return Err(ActorError::Spec(SpecError::Mismatch { what, policy, env, env_name: spec.env.describe() }));
            }
        }
        let obs_dim = envs.obs_dim();
        let n_actions = envs.n_actions();
        let h = layout.recurrent_size();
        let t_len = spec.segment_len;
        let builders = (0..n_envs).map(|_| SegmentBuilder::with_capacity(t_len, obs_dim, h)).collect();
        Ok(RolloutWorker {
            inference: PolicyInference::new(&layout, n_envs),
            hidden: vec![0.0; n_envs * h],
            logits: vec![0.0; n_envs * n_actions],
            log_probs: vec![0.0; n_actions],
            values: vec![0.0; n_envs],
            actions: vec![0; n_envs],
            step: VecStep::new(n_envs, obs_dim),
            aborted: vec![false; n_envs],
            builders,
            rng: Pcg64Mcg::seed_from_u64(seed ^ 0x5eed_ac70),
            trunc_obs: Vec::new(),
            trunc_hidden: Vec::new(),
            trunc_logits: Vec::new(),
            trunc_values: Vec::new(),
            recent_returns: VecDeque::with_capacity(RETURN_WINDOW),
            envs,
            spec,
            layout,
            actor,
            incarnation: new_incarnation(),
            weights: None,
            counters,
            work: None,
        })
    }

    /// Run scheduled episodes: take work items from `source` (the run's spec must have
    /// `work.enabled`), save snapshots to `store` at milestones and every
    /// `work.snapshot_every_steps` steps, and continue interrupted items from their newest
    /// snapshot.
    pub fn with_work(mut self, source: Box<dyn WorkSource>, store: Box<dyn SnapshotStore>) -> Result<Self, ActorError> {
        let work = &self.spec.hyper.work;
        if !work.enabled {
            return Err(ActorError::Spec(SpecError::Work("the run spec does not enable work items".into())));
        }
        let tasks = work.task_list(&self.spec.env);
        let slots = (0..self.envs.n_envs()).map(|_| Slot { needs_start: true, ..Slot::default() }).collect();
        self.work = Some(WorkState { source, store, tasks, slots });
        Ok(self)
    }

    /// Give slot `env_idx` its next scheduled episode: the next episode of its item, or a new
    /// item. Mid-segment (`at_boundary` false) a start that must restore recurrent state waits
    /// for the next segment (the learner resets that state to zero at episode starts); the slot
    /// runs an unscheduled episode meanwhile.
    fn start_next(&mut self, env_idx: usize, at_boundary: bool) {
        let h = self.layout.recurrent_size();
        let Some(work) = self.work.as_mut() else { return };
        let slot = &mut work.slots[env_idx];
        slot.scheduled = false;
        slot.rng = None;
        slot.start = None;
        loop {
            if let Some(active) = &slot.item {
                if active.episodes_done < active.item.episodes {
                    break;
                }
                let active = slot.item.take().expect("checked above");
                if let Err(err) = work.source.complete(active.token) {
                    warn!(actor = %self.actor, item = active.item.id, %err, "could not complete a work item; it may run again");
                }
                self.counters.work_items_completed.fetch_add(1, Ordering::Relaxed);
            }
            let wait = if at_boundary { Duration::from_millis(20) } else { Duration::ZERO };
            match work.source.take(wait) {
                Ok(Some((item, token))) => {
                    // An item taken again after its actor died continues from its newest snapshot.
                    let continue_from = match work.store.latest_for_item(item.id) {
                        Ok(Some(key)) => match work.store.load(&key) {
                            Ok(Some(snapshot)) if snapshot.work_item == item.id => Some(snapshot),
                            Ok(_) => None,
                            Err(err) => {
                                warn!(actor = %self.actor, item = item.id, %err, "newest snapshot unusable; restarting the item");
                                None
                            }
                        },
                        Ok(None) => None,
                        Err(err) => {
                            warn!(actor = %self.actor, item = item.id, %err, "snapshot index unreadable; restarting the item");
                            None
                        }
                    };
                    let episodes_done = continue_from.as_ref().map_or(0, |s| s.episode_index);
                    if continue_from.is_some() {
                        info!(actor = %self.actor, item = item.id, "continuing an interrupted work item from its newest snapshot");
                    }
                    slot.item = Some(ActiveItem { item, token, episodes_done, continue_from });
                }
                Ok(None) => {
                    slot.needs_start = !at_boundary;
                    self.counters.unscheduled_episodes.fetch_add(1, Ordering::Relaxed);
                    return;
                }
                Err(err) => {
                    warn!(actor = %self.actor, %err, "taking work failed; running an unscheduled episode");
                    slot.needs_start = !at_boundary;
                    self.counters.unscheduled_episodes.fetch_add(1, Ordering::Relaxed);
                    return;
                }
            }
        }
        let active = slot.item.as_mut().expect("an item is active here");
        let restores_state = active.continue_from.is_some() || matches!(active.item.start, Start::Resume { .. });
        if !at_boundary && h > 0 && restores_state {
            slot.needs_start = true;
            return;
        }
        slot.needs_start = false;
        // Where this episode starts: the interrupted run's newest state, the item's saved
        // state, or a fresh reset.
        let (snapshot, origin) = if let Some(snapshot) = active.continue_from.take() {
            let origin = snapshot.origin.clone();
            (Some(snapshot), origin)
        } else {
            match &active.item.start {
                Start::Fresh { .. } => (None, None),
                Start::Resume { snapshot: key } => match work.store.load(key) {
                    Ok(Some(snapshot)) => (Some(snapshot), Some(key.clone())),
                    Ok(None) | Err(_) => {
                        warn!(actor = %self.actor, snapshot = %key, "saved state gone; fresh start instead");
                        self.counters.resume_failures.fetch_add(1, Ordering::Relaxed);
                        (None, None)
                    }
                },
            }
        };
        let episode_index = active.episodes_done;
        let item_id = active.item.id;
        let item_task = active.item.task_id;
        let seed = match active.item.start {
            Start::Fresh { seed } => seed.wrapping_add(u64::from(episode_index)),
            Start::Resume { .. } => item_id.wrapping_mul(0x9e37_79b9_7f4a_7c15) ^ u64::from(episode_index),
        };
        let builder = &mut self.builders[env_idx];
        let hidden = &mut self.hidden[env_idx * h..(env_idx + 1) * h];
        let restored = snapshot.and_then(|snapshot| {
            let task = work.tasks.get(snapshot.task_id as usize)?;
            if snapshot.hidden.len() != h {
                return None;
            }
            if snapshot.task_id != slot.task_id {
                if let Err(err) = self.envs.switch_task(env_idx, task, seed) {
                    warn!(actor = %self.actor, %err, "cannot switch task for a saved state");
                    return None;
                }
                slot.task_id = snapshot.task_id;
            }
            if let Err(err) = self.envs.restore_env(env_idx, &snapshot.env) {
                warn!(actor = %self.actor, %err, "saved state does not restore; fresh start instead");
                return None;
            }
            hidden.copy_from_slice(&snapshot.hidden);
            builder.episode_return = snapshot.episode_return;
            builder.episode_len = snapshot.episode_len;
            Some(snapshot.rng)
        });
        let rng = match restored {
            Some(rng) => {
                self.counters.episodes_resumed.fetch_add(1, Ordering::Relaxed);
                slot.start = origin;
                rng
            }
            None => {
                let task_id = item_task.min(work.tasks.len().saturating_sub(1) as u32);
                let reset = if task_id != slot.task_id {
                    self.envs.switch_task(env_idx, &work.tasks[task_id as usize], seed)
                } else {
                    self.envs.reset_env(env_idx, seed)
                };
                if let Err(err) = reset {
                    warn!(actor = %self.actor, %err, "scheduled reset failed; running an unscheduled episode");
                    return;
                }
                slot.task_id = task_id;
                hidden.fill(0.0);
                builder.episode_return = 0.0;
                builder.episode_len = 0;
                slot.start = None;
                Pcg64Mcg::seed_from_u64(seed ^ 0x5a3e_ed01)
            }
        };
        slot.rng = Some(rng);
        slot.scheduled = true;
        slot.episode_index = episode_index;
        slot.steps_since_save = 0;
        debug!(actor = %self.actor, item = item_id, env_idx, "scheduled episode started");
    }

    /// Save slot `env_idx`'s episode if it is at a milestone or due by step count.
    fn maybe_save(&mut self, env_idx: usize, policy_version: u64) {
        let h = self.layout.recurrent_size();
        let config = &self.spec.hyper.work;
        let Some(work) = self.work.as_mut() else { return };
        let slot = &mut work.slots[env_idx];
        let (Some(active), true) = (&slot.item, slot.scheduled) else { return };
        slot.steps_since_save += 1;
        let at_milestone = config.snapshot_at_milestones && self.envs.env_at_milestone(env_idx);
        let due = config.snapshot_every_steps > 0 && slot.steps_since_save >= config.snapshot_every_steps;
        if !(at_milestone || due) {
            return;
        }
        let env = match self.envs.snapshot_env(env_idx) {
            Ok(env) => env,
            Err(err) => {
                debug!(actor = %self.actor, %err, "environment cannot snapshot");
                return;
            }
        };
        let builder = &mut self.builders[env_idx];
        let snapshot = EpisodeSnapshot {
            work_item: active.item.id,
            episode_index: slot.episode_index,
            task_id: slot.task_id,
            origin: slot.start.clone(),
            env,
            hidden: self.hidden[env_idx * h..(env_idx + 1) * h].to_vec(),
            episode_return: builder.episode_return,
            episode_len: builder.episode_len,
            policy_version,
            rng: slot.rng.clone().expect("a scheduled episode has its generator"),
            progress: self.envs.env_progress(env_idx),
        };
        match work.store.save(&snapshot) {
            Ok(key) => {
                slot.steps_since_save = 0;
                self.counters.snapshots_saved.fetch_add(1, Ordering::Relaxed);
                builder.saved_snapshots.push(SnapshotInfo {
                    key,
                    task_id: snapshot.task_id,
                    progress: snapshot.progress,
                    episode_return: snapshot.episode_return,
                    episode_len: snapshot.episode_len,
                });
            }
            Err(err) => warn!(actor = %self.actor, %err, "snapshot not saved"),
        }
    }

    /// Tell the work queue every running item is still alive.
    fn heartbeat(&mut self) {
        let Some(work) = self.work.as_mut() else { return };
        for slot in &work.slots {
            if let Some(active) = &slot.item {
                if let Err(err) = work.source.progress(active.token) {
                    debug!(actor = %self.actor, %err, "work progress signal failed");
                }
            }
        }
    }

    /// The policy version in use, if any weights arrived yet.
    pub fn policy_version(&self) -> Option<PolicyVersion> {
        self.weights.as_ref().map(|w| w.version)
    }

    /// Switch to new weights after checking layout and checksum.
    pub fn set_weights(&mut self, weights: Arc<Weights>) -> Result<(), ActorError> {
        weights
            .verify(self.layout.hash(), self.layout.n_params())
            .map_err(|err| ActorError::Weights { version: weights.version.0, reason: err.to_string() })?;
        self.counters.policy_version.store(weights.version.0, Ordering::Relaxed);
        self.weights = Some(weights);
        self.counters.weight_updates.fetch_add(1, Ordering::Relaxed);
        Ok(())
    }

    /// Step every environment `segment_len` times with the current weights and return one
    /// segment per environment.
    ///
    /// # Panics
    /// If no weights were set: callers wait for the first version before collecting.
    pub fn collect_segments(&mut self) -> Vec<TrajectorySegment> {
        let weights = self.weights.clone().expect("collect_segments needs weights: call set_weights first");
        let params = &weights.params[..];
        let n_envs = self.envs.n_envs();
        let obs_dim = self.envs.obs_dim();
        let n_actions = self.envs.n_actions();
        let h = self.layout.recurrent_size();
        if self.work.is_some() {
            for env_idx in 0..n_envs {
                if self.work.as_ref().is_some_and(|w| w.slots[env_idx].needs_start) {
                    self.start_next(env_idx, true);
                }
            }
        }
        for (env_idx, builder) in self.builders.iter_mut().enumerate() {
            builder.begin(&self.hidden[env_idx * h..(env_idx + 1) * h]);
            if let Some(work) = &self.work {
                let slot = &work.slots[env_idx];
                builder.task_id_at_start = slot.task_id;
                builder.start_at_start = if slot.scheduled { slot.start.clone() } else { None };
            }
        }
        let mut env_time = Duration::ZERO;
        let mut inference_time = Duration::ZERO;
        for _ in 0..self.spec.segment_len {
            let started = Instant::now();
            let obs = self.envs.obs();
            for (env_idx, builder) in self.builders.iter_mut().enumerate() {
                builder.observations.extend_from_slice(&obs[env_idx * obs_dim..(env_idx + 1) * obs_dim]);
            }
            self.inference.forward(params, obs, n_envs, &mut self.hidden, &mut self.logits, &mut self.values);
            for env_idx in 0..n_envs {
                let row = &self.logits[env_idx * n_actions..(env_idx + 1) * n_actions];
                log_softmax(row, &mut self.log_probs);
                let slot_rng = self.work.as_mut().and_then(|w| w.slots[env_idx].rng.as_mut());
                let u = match slot_rng {
                    Some(rng) => rng.random::<f32>(),
                    None => self.rng.random::<f32>(),
                };
                let action = sample_categorical(row, u);
                self.actions[env_idx] = action;
                let builder = &mut self.builders[env_idx];
                builder.actions.push(action as u32);
                builder.behaviour_log_probs.push(self.log_probs[action]);
            }
            let stepped = Instant::now();
            inference_time += stepped - started;
            self.envs
                .step(Actions::Discrete(&self.actions), &mut self.step)
                .expect("actions has one entry per environment");
            env_time += stepped.elapsed();
            let any_failed = !self.step.env_errors.is_empty();
            if any_failed {
                self.aborted.fill(false);
                for (env_idx, error) in &self.step.env_errors {
                    let env_idx = *env_idx;
                    self.counters.env_errors.fetch_add(1, Ordering::Relaxed);
                    warn!(actor = %self.actor, env_idx, %error, reason = error.reason(), "environment failed; reset");
                    // A failure right after an episode ended (a failed reset) aborts nothing.
                    let finished = self.step.finished_episodes.iter().any(|e| e.env_idx == env_idx);
                    if !finished && !self.aborted[env_idx] {
                        self.aborted[env_idx] = true;
                        self.counters.episodes_aborted.fetch_add(1, Ordering::Relaxed);
                    }
                }
            }
            self.bootstrap_truncated(params);
            for env_idx in 0..n_envs {
                let builder = &mut self.builders[env_idx];
                let reward = self.step.rewards[env_idx];
                let terminated = self.step.terminated[env_idx];
                let truncated = self.step.truncated[env_idx];
                builder.rewards.push(reward);
                builder.terminated.push(terminated as u8);
                builder.truncated.push(truncated as u8);
                builder.episode_return += reward;
                builder.episode_len += 1;
                if terminated || truncated {
                    // An aborted episode did not end on its own: its return is no measure of
                    // the policy, so it is not reported.
                    if !(any_failed && self.aborted[env_idx]) {
                        let (task_id, work_item, start) = match &self.work {
                            Some(work) => {
                                let slot = &work.slots[env_idx];
                                let item = slot.item.as_ref().filter(|_| slot.scheduled).map(|a| a.item.id);
                                (slot.task_id, item, if slot.scheduled { slot.start.clone() } else { None })
                            }
                            None => (0, None, None),
                        };
                        builder.finished_episodes.push(EpisodeSummary {
                            episode_return: builder.episode_return,
                            episode_len: builder.episode_len,
                            task_id,
                            work_item,
                            start,
                        });
                        if self.recent_returns.len() == RETURN_WINDOW {
                            self.recent_returns.pop_front();
                        }
                        self.recent_returns.push_back(builder.episode_return);
                        let mean = self.recent_returns.iter().map(|&r| r as f64).sum::<f64>()
                            / self.recent_returns.len() as f64;
                        self.counters.episode_return_mean_bits.store(mean.to_bits(), Ordering::Relaxed);
                    }
                    if let Some(active) = self.work.as_mut().and_then(|w| {
                        let slot = &mut w.slots[env_idx];
                        slot.item.as_mut().filter(|_| slot.scheduled)
                    }) {
                        active.episodes_done += 1;
                    }
                    builder.episode_return = 0.0;
                    builder.episode_len = 0;
                    builder.episode_id += 1;
                    // A new episode starts with a zero recurrent state.
                    self.hidden[env_idx * h..(env_idx + 1) * h].fill(0.0);
                    if self.work.is_some() {
                        self.start_next(env_idx, false);
                    }
                } else if self.work.is_some() {
                    self.maybe_save(env_idx, weights.version.0);
                }
            }
            self.counters.episodes.fetch_add(self.step.finished_episodes.len() as u64, Ordering::Relaxed);
        }
        let obs = self.envs.obs();
        let mut segments = Vec::with_capacity(n_envs);
        for (env_idx, builder) in self.builders.iter_mut().enumerate() {
            builder.observations.extend_from_slice(&obs[env_idx * obs_dim..(env_idx + 1) * obs_dim]);
            segments.push(builder.finish(&self.spec, &self.actor, self.incarnation, env_idx, &weights, obs_dim));
        }
        self.heartbeat();
        let steps = (self.spec.segment_len * n_envs) as u64;
        self.counters.env_steps.fetch_add(steps, Ordering::Relaxed);
        self.counters.env_nanos.fetch_add(env_time.as_nanos() as u64, Ordering::Relaxed);
        self.counters.inference_nanos.fetch_add(inference_time.as_nanos() as u64, Ordering::Relaxed);
        segments
    }

    /// For environments truncated this step, store the behaviour value of the final
    /// observation so the learner can bootstrap through the time limit.
    fn bootstrap_truncated(&mut self, params: &[f32]) {
        let n_envs = self.envs.n_envs();
        let obs_dim = self.envs.obs_dim();
        let h = self.layout.recurrent_size();
        let n_actions = self.envs.n_actions();
        let truncated: usize = self.step.truncated.iter().filter(|&&t| t).count();
        if truncated > 0 {
            self.trunc_obs.clear();
            self.trunc_hidden.clear();
            for env_idx in (0..n_envs).filter(|&i| self.step.truncated[i]) {
                self.trunc_obs.extend_from_slice(&self.step.final_obs[env_idx * obs_dim..(env_idx + 1) * obs_dim]);
                self.trunc_hidden.extend_from_slice(&self.hidden[env_idx * h..(env_idx + 1) * h]);
            }
            self.trunc_logits.resize(truncated * n_actions, 0.0);
            self.trunc_values.resize(truncated, 0.0);
            self.inference.forward(
                params,
                &self.trunc_obs,
                truncated,
                &mut self.trunc_hidden,
                &mut self.trunc_logits,
                &mut self.trunc_values,
            );
        }
        let mut next_value = 0;
        for env_idx in 0..n_envs {
            let value = if self.step.truncated[env_idx] {
                next_value += 1;
                self.trunc_values[next_value - 1]
            } else {
                0.0
            };
            self.builders[env_idx].truncation_values.push(value);
        }
    }

    /// Run until `stop` is set or the sink closes: follow weights between segments, collect,
    /// publish. Waits for the first weights for up to `first_weights_timeout` per attempt,
    /// logging while it waits.
    pub fn run(
        mut self,
        sink: &mut dyn TrajectorySink,
        follower: &mut dyn WeightsFollower,
        stop: &AtomicBool,
    ) -> Result<(), ActorError> {
        let wait_step = Duration::from_millis(200);
        while self.weights.is_none() {
            if stop.load(Ordering::Acquire) {
                return Ok(());
            }
            match follower.wait_first(wait_step) {
                Ok(weights) => self.set_weights(weights)?,
                Err(TransportError::Timeout { .. }) => debug!(actor = %self.actor, "waiting for the first weights"),
                Err(TransportError::Closed) => return Ok(()),
                // A forged or broken pointer must not stop the actor (issue 12): the follower
                // reports each bad pointer once (retries with backoff) and waits for the next.
                Err(err) => {
                    self.counters.weights_refused.fetch_add(1, Ordering::Relaxed);
                    warn!(actor = %self.actor, %err, "first weights refused; waiting for valid ones");
                }
            }
        }
        info!(actor = %self.actor, version = ?self.policy_version(), n_envs = self.envs.n_envs(), "actor started");
        let mut throttled_before = sink.throttled();
        let mut retries_before = sink.publish_retries();
        while !stop.load(Ordering::Acquire) {
            let fetch_started = Instant::now();
            match follower.latest(self.policy_version()) {
                Ok(Some(weights)) => {
                    self.counters
                        .weight_fetch_nanos
                        .fetch_add(fetch_started.elapsed().as_nanos() as u64, Ordering::Relaxed);
                    self.counters.weight_fetches.fetch_add(1, Ordering::Relaxed);
                    if let Err(err) = self.set_weights(weights) {
                        // Keep acting with the old version; the learner decides what is too stale.
                        warn!(actor = %self.actor, %err, "ignoring unusable weights");
                    }
                }
                Ok(None) => {}
                Err(TransportError::Closed) => break,
                Err(err) => {
                    self.counters.weights_refused.fetch_add(1, Ordering::Relaxed);
                    warn!(actor = %self.actor, %err, "weights check failed; keeping current version");
                }
            }
            let segments = self.collect_segments();
            let n = segments.len() as u64;
            self.counters.publishing.store(true, Ordering::Release);
            let published = sink.publish(segments);
            self.counters.publishing.store(false, Ordering::Release);
            match published {
                Ok(()) => {
                    self.counters.segments_published.fetch_add(n, Ordering::Relaxed);
                }
                Err(TransportError::Closed) => break,
                Err(err) => {
                    self.counters.publish_errors.fetch_add(1, Ordering::Relaxed);
                    return Err(err.into());
                }
            }
            let retries = sink.publish_retries();
            self.counters.publish_errors.fetch_add(retries.saturating_sub(retries_before), Ordering::Relaxed);
            retries_before = retries;
            let throttled = sink.throttled();
            self.counters
                .throttled_nanos
                .fetch_add((throttled - throttled_before).as_nanos() as u64, Ordering::Relaxed);
            throttled_before = throttled;
        }
        info!(actor = %self.actor, "actor stopped");
        Ok(())
    }
}

/// A number that differs between workers started at different times or in different processes.
fn new_incarnation() -> u64 {
    let nanos =
        std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_nanos() as u64).unwrap_or(0);
    static COUNTER: AtomicU64 = AtomicU64::new(0);
    nanos
        ^ ((std::process::id() as u64) << 32)
        ^ COUNTER.fetch_add(1, Ordering::Relaxed).wrapping_mul(0x9e37_79b9_7f4a_7c15)
}

impl SegmentBuilder {
    fn with_capacity(t_len: usize, obs_dim: usize, h: usize) -> Self {
        let mut builder = SegmentBuilder::default();
        builder.reserve(t_len, obs_dim, h);
        builder
    }

    fn reserve(&mut self, t_len: usize, obs_dim: usize, h: usize) {
        self.observations.reserve((t_len + 1) * obs_dim);
        self.actions.reserve(t_len);
        self.rewards.reserve(t_len);
        self.terminated.reserve(t_len);
        self.truncated.reserve(t_len);
        self.behaviour_log_probs.reserve(t_len);
        self.truncation_values.reserve(t_len);
        self.initial_hidden.reserve(h);
    }

    fn begin(&mut self, hidden: &[f32]) {
        self.episode_id_at_start = self.episode_id;
        self.initial_hidden.extend_from_slice(hidden);
    }

    /// Move the collected arrays into a segment and leave fresh buffers behind.
    fn finish(
        &mut self,
        spec: &RunSpec,
        actor: &ActorId,
        incarnation: u64,
        env_idx: usize,
        weights: &Weights,
        obs_dim: usize,
    ) -> TrajectorySegment {
        let h = self.initial_hidden.len();
        let segment = TrajectorySegment {
            run: spec.run.to_string(),
            actor: actor.to_string(),
            incarnation,
            env_idx: env_idx as u32,
            episode_id: self.episode_id_at_start,
            segment_idx: self.segment_idx,
            task_id: self.task_id_at_start,
            start_snapshot: self.start_at_start.take(),
            policy_version: weights.version,
            layout_hash: weights.layout_hash,
            obs_dim: obs_dim as u32,
            observations: std::mem::take(&mut self.observations),
            actions: std::mem::take(&mut self.actions),
            rewards: std::mem::take(&mut self.rewards),
            terminated: std::mem::take(&mut self.terminated),
            truncated: std::mem::take(&mut self.truncated),
            behaviour_log_probs: std::mem::take(&mut self.behaviour_log_probs),
            truncation_values: std::mem::take(&mut self.truncation_values),
            initial_hidden: std::mem::take(&mut self.initial_hidden),
            finished_episodes: std::mem::take(&mut self.finished_episodes),
            saved_snapshots: std::mem::take(&mut self.saved_snapshots),
        };
        self.segment_idx += 1;
        self.reserve(spec.segment_len, obs_dim, h);
        segment
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use volley_core::ids::RunId;
    use volley_core::spec::HyperParams;
    use volley_env::{EnvConfig, MemoryConfig};
    use volley_policy::{Activation, CoreKind, PolicySpec};

    fn worker(env: EnvConfig, obs_dim: usize, n_actions: usize, core: CoreKind, t_len: usize) -> RolloutWorker {
        let spec = RunSpec {
            run: RunId::new("actor-test").expect("valid"),
            env,
            policy: PolicySpec { obs_dim, n_actions, torso: vec![8], activation: Activation::Tanh, core },
            segment_len: t_len,
            hyper: HyperParams::default(),
            seed: 1,
        };
        let layout = spec.validate().expect("valid spec");
        let weights = Arc::new(Weights::new(PolicyVersion(4), layout.hash(), layout.init_params(2)));
        let mut worker =
            RolloutWorker::new(spec, ActorId::new("a-0").expect("valid"), 3, 17, Arc::new(ActorCounters::default()))
                .expect("buildable");
        worker.set_weights(weights).expect("matching layout");
        worker
    }

    #[test]
    fn consecutive_segments_are_valid_and_continue_each_other() {
        let mut worker = worker(EnvConfig::Cartpole, 4, 2, CoreKind::Mlp, 64);
        let first = worker.collect_segments();
        let second = worker.collect_segments();
        assert_eq!(first.len(), 3);
        let hash = worker.layout.hash();
        for (a, b) in first.iter().zip(&second) {
            a.validate(&worker.spec, hash, 0).expect("valid segment");
            b.validate(&worker.spec, hash, 0).expect("valid segment");
            assert_eq!(&a.observations[64 * 4..], &b.observations[..4], "the next segment starts where this one ended");
            assert_eq!((a.segment_idx, b.segment_idx), (0, 1));
            assert_eq!(a.policy_version, PolicyVersion(4));
            let dones = a.terminated.iter().zip(&a.truncated).filter(|(&te, &tr)| te == 1 || tr == 1).count();
            assert_eq!(dones, a.finished_episodes.len());
            assert_eq!(b.episode_id, a.episode_id + dones as u64);
            assert!(a.behaviour_log_probs.iter().all(|&lp| lp <= 0.0 && lp > -10.0));
        }
        // A random-ish CartPole policy fails within 64 steps in some of the 3 environments.
        assert!(first.iter().any(|s| !s.finished_episodes.is_empty()));
        let returns: f32 = first.iter().flat_map(|s| &s.finished_episodes).map(|e| e.episode_return).sum();
        let lengths: u32 = first.iter().flat_map(|s| &s.finished_episodes).map(|e| e.episode_len).sum();
        assert_eq!(returns, lengths as f32, "CartPole pays 1 per step");
        assert_eq!(worker.counters.env_steps.load(Ordering::Relaxed), 2 * 64 * 3);
    }

    #[test]
    fn mean_return_covers_the_last_hundred_episodes() {
        // One environment, so segments list episodes in the order they finished.
        let template = worker(EnvConfig::Cartpole, 4, 2, CoreKind::Mlp, 64);
        let counters = Arc::new(ActorCounters::default());
        let mut worker =
            RolloutWorker::new(template.spec.clone(), ActorId::new("a-1").expect("valid"), 1, 5, counters.clone())
                .expect("buildable");
        worker.set_weights(template.weights.clone().expect("set")).expect("matching layout");
        let mut all_returns = Vec::new();
        while all_returns.len() < RETURN_WINDOW + 20 {
            for segment in worker.collect_segments() {
                all_returns.extend(segment.finished_episodes.iter().map(|e| e.episode_return as f64));
            }
        }
        let last = &all_returns[all_returns.len() - RETURN_WINDOW..];
        let expected = last.iter().sum::<f64>() / RETURN_WINDOW as f64;
        let exported = f64::from_bits(worker.counters.episode_return_mean_bits.load(Ordering::Relaxed));
        assert!((exported - expected).abs() < 1e-6, "exported {exported}, expected {expected}");
        assert_eq!(worker.recent_returns.len(), RETURN_WINDOW, "the window stays bounded");
    }

    #[test]
    fn recurrent_state_is_carried_across_segments_and_reset_at_episode_start() {
        // Memory episodes last delay + 2 = 4 steps; segments of 3 steps cut them mid-way.
        let env = EnvConfig::Memory(MemoryConfig { n_cues: 2, delay: 2 });
        let mut worker = worker(env, 3, 2, CoreKind::Gru { hidden: 5 }, 3);
        let first = worker.collect_segments();
        let second = worker.collect_segments();
        for (a, b) in first.iter().zip(&second) {
            assert_eq!(a.initial_hidden, vec![0.0; 5], "the first segment starts a fresh episode");
            assert!(b.initial_hidden.iter().any(|&h| h != 0.0), "mid-episode state is carried over");
            a.validate(&worker.spec, worker.layout.hash(), 5).expect("valid");
        }
        // Episodes start at steps 0, 4, 8, 12 and segments at 0, 3, 6, 9, 12: only the first
        // and the fifth segment begin an episode.
        for _ in 0..2 {
            let mid_episode = worker.collect_segments();
            assert!(mid_episode.iter().all(|s| s.initial_hidden.iter().any(|&h| h != 0.0)));
        }
        let fifth = worker.collect_segments();
        assert!(fifth.iter().all(|s| s.initial_hidden.iter().all(|&h| h == 0.0)));
    }

    /// Wraps an in-process vec env and fails environment 0 every 10th step, as a lost remote
    /// server would: a truncation with reward 0 and an error, not a finished episode.
    struct FlakyEnvs {
        inner: VecEnv<volley_env::CartPole>,
        steps: usize,
    }

    impl VectorEnv for FlakyEnvs {
        fn n_envs(&self) -> usize {
            self.inner.n_envs()
        }
        fn obs_dim(&self) -> usize {
            self.inner.obs_dim()
        }
        fn n_actions(&self) -> usize {
            self.inner.n_actions()
        }
        fn obs(&self) -> &[f32] {
            self.inner.obs()
        }
        fn step(&mut self, actions: Actions<'_>, out: &mut VecStep) -> Result<(), EnvError> {
            self.inner.step(actions, out)?;
            self.steps += 1;
            if self.steps.is_multiple_of(10) {
                out.rewards[0] = 0.0;
                out.terminated[0] = false;
                out.truncated[0] = true;
                out.finished_episodes.retain(|e| e.env_idx != 0);
                out.env_errors
                    .push((0, EnvError::Remote { service: "x".into(), reason: "remote_gone", message: "gone".into() }));
            }
            Ok(())
        }
        fn snapshot_env(&mut self, env_idx: usize) -> Result<Vec<u8>, EnvError> {
            VectorEnv::snapshot_env(&mut self.inner, env_idx)
        }
        fn restore_env(&mut self, env_idx: usize, bytes: &[u8]) -> Result<(), EnvError> {
            VectorEnv::restore_env(&mut self.inner, env_idx, bytes)
        }
    }

    #[test]
    fn aborted_episodes_are_counted_and_not_reported_as_finished() {
        let spec = worker(EnvConfig::Cartpole, 4, 2, CoreKind::Mlp, 20).spec.clone();
        let layout = spec.validate().expect("valid");
        let envs = FlakyEnvs { inner: VecEnv::new(vec![volley_env::CartPole::new(); 2], 5).unwrap(), steps: 0 };
        let counters = Arc::new(ActorCounters::default());
        let mut worker =
            RolloutWorker::with_envs(spec, ActorId::new("flaky").unwrap(), Box::new(envs), 5, counters.clone())
                .expect("matching spaces");
        worker.set_weights(Arc::new(Weights::new(PolicyVersion(1), layout.hash(), layout.init_params(3)))).unwrap();
        let segments = worker.collect_segments();
        assert_eq!(counters.episodes_aborted.load(Ordering::Relaxed), 2);
        assert_eq!(counters.env_errors.load(Ordering::Relaxed), 2);
        let first = &segments[0];
        assert_eq!((first.truncated[9], first.truncated[19], first.rewards[9]), (1, 1, 0.0));
        let dones = first.terminated.iter().zip(&first.truncated).filter(|(&te, &tr)| te == 1 || tr == 1).count();
        assert_eq!(first.finished_episodes.len(), dones - 2, "the two aborted episodes are not reported");
        first.validate(&worker.spec, layout.hash(), 0).expect("a valid segment");
    }

    #[test]
    fn envs_whose_spaces_differ_from_the_policy_are_refused() {
        let spec = worker(EnvConfig::Cartpole, 4, 2, CoreKind::Mlp, 8).spec.clone();
        let memory = VecEnv::new(vec![volley_env::Memory::new(MemoryConfig::default()).unwrap()], 0).unwrap();
        let result = RolloutWorker::with_envs(spec, ActorId::new("a").unwrap(), Box::new(memory), 0, Arc::default());
        assert!(matches!(result, Err(ActorError::Spec(SpecError::Mismatch { what: "obs_dim", .. }))));
    }

    #[test]
    fn weights_of_another_architecture_are_refused() {
        let mut worker = worker(EnvConfig::Cartpole, 4, 2, CoreKind::Mlp, 8);
        let n = worker.layout.n_params();
        let foreign = Arc::new(Weights::new(PolicyVersion(9), worker.layout.hash() ^ 1, vec![0.0; n]));
        assert!(matches!(worker.set_weights(foreign), Err(ActorError::Weights { version: 9, .. })));
        let mut corrupt = Weights::new(PolicyVersion(9), worker.layout.hash(), vec![0.0; n]);
        corrupt.params[0] = 1.0;
        assert!(worker.set_weights(Arc::new(corrupt)).is_err());
        assert_eq!(worker.policy_version(), Some(PolicyVersion(4)), "the old version stays in use");
    }

    #[test]
    fn a_spec_this_build_cannot_serve_is_refused() {
        let spec = RunSpec {
            run: RunId::new("x").expect("valid"),
            env: EnvConfig::Cartpole,
            policy: PolicySpec {
                obs_dim: 5,
                n_actions: 2,
                torso: vec![8],
                activation: Activation::Tanh,
                core: CoreKind::Mlp,
            },
            segment_len: 8,
            hyper: HyperParams::default(),
            seed: 0,
        };
        let result = RolloutWorker::new(spec, ActorId::new("a").expect("valid"), 1, 0, Arc::default());
        assert!(matches!(result, Err(ActorError::Spec(_))));
    }
}
