//! Vectorised rollout: N environments, batched CPU inference, one segment per environment
//! per `segment_len` steps.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use rand::SeedableRng;
use rand_pcg::Pcg64Mcg;
use tracing::{debug, info, warn};
use volley_core::ids::{ActorId, PolicyVersion};
use volley_core::spec::{RunSpec, SpecError};
use volley_core::wire::{EpisodeSummary, ObsElement, Observations, RestoredState, TrajectorySegment, Weights};
use volley_core::work::SnapshotInfo;
use volley_env::{Actions, EnvError, VecEnv, VecStep, VectorEnv};
use volley_policy::head::{AnyHead, PolicyHead};
use volley_policy::{gaussian, ActionHead, ParamLayout, PolicyInference};
use volley_transport::rejection_log::RejectionLog;
use volley_transport::work::{SnapshotStore, WorkSource};
use volley_transport::{TrajectorySink, TransportError, WeightsFollower};

use crate::counters::{ActorCounters, RETURN_WINDOW};
use crate::episode_start::{EpisodeStarts, FreshStarts, RunningEpisode, SlotView, WorkStarts};
use crate::error::ActorError;

/// Per-environment segment under construction.
#[derive(Debug, Default)]
struct SegmentBuilder {
    episode_id: u64,
    segment_idx: u64,
    episode: RunningEpisode,
    episode_id_at_start: u64,
    /// In the observation space's element type: bytes for images (issue 44 item 3).
    observations: Observations,
    actions: Vec<u32>,
    continuous_actions: Vec<f32>,
    rewards: Vec<f32>,
    terminated: Vec<u8>,
    truncated: Vec<u8>,
    behaviour_log_probs: Vec<f32>,
    truncation_values: Vec<f32>,
    initial_hidden: Vec<f32>,
    /// Episodes that started from a saved, non-zero recurrent state inside this segment.
    restored_states: Vec<RestoredState>,
    finished_episodes: Vec<EpisodeSummary>,
    saved_snapshots: Vec<SnapshotInfo>,
    task_id_at_start: u32,
    start_at_start: Option<String>,
    /// The group of each episode piece so far ([`TrajectorySegment::episode_groups`]).
    episode_groups: Vec<Option<volley_core::work::GroupMember>>,
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
    values: Vec<f32>,
    /// The head's draws, `[n_envs][action_width]` words (`volley_policy::head`).
    action_words: Vec<f32>,
    /// What discrete environments get: the drawn indices.
    actions: Vec<usize>,
    /// What continuous environments get: the draws, or squashed ones scaled to the action box.
    env_actions: Vec<f32>,
    /// The action box `(low, high)` of a continuous environment.
    action_box: Option<(Vec<f32>, Vec<f32>)>,
    step: VecStep,
    /// Per environment: its episode was aborted this step (valid while `step.env_errors` is
    /// not empty).
    aborted: Vec<bool>,
    builders: Vec<SegmentBuilder>,
    /// Image observations of the current step as bytes, `[n_envs][obs_dim]`, which the
    /// segments store and the policy reads (empty for vector observations).
    frames: Vec<u8>,
    rng: Pcg64Mcg,
    // Scratch for bootstrapping truncated episodes.
    trunc_obs: Vec<f32>,
    trunc_hidden: Vec<f32>,
    trunc_logits: Vec<f32>,
    trunc_values: Vec<f32>,
    /// Returns of the last [`RETURN_WINDOW`] finished episodes, oldest first.
    recent_returns: VecDeque<f32>,
    counters: Arc<ActorCounters>,
    /// Logs this worker's rejections (refused weights, policy fallbacks, environment
    /// failures) at a bounded rate; each is counted in `counters` as well.
    rejections: RejectionLog,
    /// Where episodes start: fresh, or scheduled through work items.
    starts: Box<dyn EpisodeStarts>,
    /// Rounds handed to the sink in one `publish` call, at most (see
    /// [`RolloutWorker::with_rounds_per_publish`]); 1: every round on its own.
    rounds_per_publish: usize,
    /// A round is held for the next one only while the round before it took less than this.
    hold_within: Duration,
}

/// How fast a round must be for [`RolloutWorker::with_rounds_per_publish`] to hold it for the
/// next one: rounds this quick put one message through the broker per update, and at that rate
/// the broker's per-message cost, not the bytes, sets the pace (issue 16); holding a slower
/// round would add its whole collection time to the policy lag of its data for little gain.
pub const HOLD_ROUND_WITHIN: Duration = Duration::from_millis(5);

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
        let action_box = match envs.action_space() {
            volley_env::ActionSpace::Box { low, high, .. } => Some((low, high)),
            volley_env::ActionSpace::Discrete { .. } => None,
        };
        if action_box.is_some() != spec.policy.head.is_continuous() {
            return Err(ActorError::Spec(SpecError::Unsupported(format!(
                "environment {} and the policy head {:?} disagree on continuous actions",
                spec.env.describe(),
                spec.policy.head
            ))));
        }
        let obs_dim = envs.obs_dim();
        let n_actions = envs.n_actions();
        let h = layout.recurrent_size();
        let n_continuous = if action_box.is_some() { n_envs * n_actions } else { 0 };
        let t_len = spec.segment_len;
        // Image observation spaces (MinAtar's planes, served frames) keep their observations a
        // byte per value from here to the learner's first layer.
        let image = spec.env.image_shape().is_some();
        let element = ObsElement::for_image(image);
        let builders = (0..n_envs).map(|_| SegmentBuilder::with_capacity(t_len, obs_dim, h, element)).collect();
        Ok(RolloutWorker {
            inference: PolicyInference::new(&layout, n_envs),
            hidden: vec![0.0; n_envs * h],
            logits: vec![0.0; n_envs * n_actions],
            values: vec![0.0; n_envs],
            action_words: vec![0.0; n_envs * spec.policy.head.action_width(n_actions)],
            actions: vec![0; n_envs],
            env_actions: vec![0.0; n_continuous],
            action_box,
            step: VecStep::new(n_envs, obs_dim),
            aborted: vec![false; n_envs],
            builders,
            frames: if image { vec![0; n_envs * obs_dim] } else { Vec::new() },
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
            rejections: RejectionLog::new("actor"),
            starts: Box::new(FreshStarts),
            rounds_per_publish: 1,
            hold_within: Duration::ZERO,
        })
    }

    /// Run scheduled episodes: take work items from `source` (the run's spec must have
    /// `work.enabled`), save snapshots to `store` at milestones and every
    /// `work.snapshot_every_steps` steps, and continue interrupted items from their newest
    /// snapshot.
    pub fn with_work(self, source: Box<dyn WorkSource>, store: Box<dyn SnapshotStore>) -> Result<Self, ActorError> {
        let starts =
            WorkStarts::new(&self.spec, self.envs.n_envs(), source, store, self.actor.clone(), self.counters.clone())?;
        Ok(self.with_episode_starts(Box::new(starts)))
    }

    /// Hand up to `rounds` rounds to the sink in one `publish` call (a NATS sink packs them into
    /// one message): a round is held for the next one while the round before it took less than
    /// `within` (so a slow environment still publishes every round). Backpressure is waited for
    /// once per publish, before its first round, and its other rounds follow at once, so all of
    /// them act with the weights the wait brought. Each message costs the broker about the same
    /// whatever its size (store, publish ack, delivery, ack and its confirmation, pace notice),
    /// so for CartPole's rounds of 256 steps two to a message took about a fifth off the
    /// broker's CPU and a tenth off the time per env step of distributed CartPole (issue 16,
    /// docs/benchmarks/distributed.md). The cost: the first round of each message reaches the
    /// learner one round later (at most `within`), and a stop drops a held round as it drops the
    /// round in progress. `rounds` below 1 counts as 1.
    pub fn with_rounds_per_publish(mut self, rounds: usize, within: Duration) -> Self {
        self.rounds_per_publish = rounds.max(1);
        self.hold_within = within;
        self
    }

    /// Take episode starts from `starts` instead of running fresh episodes back to back.
    pub fn with_episode_starts(mut self, starts: Box<dyn EpisodeStarts>) -> Self {
        self.starts = starts;
        self
    }

    /// The policy version in use, if any weights arrived yet.
    pub fn policy_version(&self) -> Option<PolicyVersion> {
        self.weights.as_ref().map(|w| w.version)
    }

    /// Switch to new weights after checking layout and checksum.
    pub fn set_weights(&mut self, weights: Arc<Weights>) -> Result<(), ActorError> {
        weights
            .verify(self.layout.hash(), self.layout.n_params())
            .map_err(|err| ActorError::Weights { version: weights.version, reason: err.to_string() })?;
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
        for (env_idx, builder) in self.builders.iter_mut().enumerate() {
            let replaced = self.starts.at_segment_boundary(SlotView {
                env_idx,
                envs: self.envs.as_mut(),
                hidden: &mut self.hidden[env_idx * h..(env_idx + 1) * h],
                episode: &mut builder.episode,
            });
            // The running episode was replaced without ending: this segment does not continue
            // the last one (the learner stitches only continuing segments into windows).
            if replaced {
                builder.episode_id += 1;
            }
        }
        for (env_idx, builder) in self.builders.iter_mut().enumerate() {
            builder.begin(&self.hidden[env_idx * h..(env_idx + 1) * h]);
            let tags = self.starts.tags(env_idx);
            builder.task_id_at_start = tags.task_id;
            builder.start_at_start = tags.start;
            builder.episode_groups.push(tags.group);
        }
        let mut env_time = Duration::ZERO;
        let mut inference_time = Duration::ZERO;
        // The environment's action space (the head agrees with it: checked in `new`).
        let continuous = self.action_box.is_some();
        let segment_len = self.spec.segment_len;
        for step in 0..segment_len {
            let started = Instant::now();
            let obs = self.envs.obs();
            if self.frames.is_empty() {
                for (env_idx, builder) in self.builders.iter_mut().enumerate() {
                    builder.observations.extend_from_f32(&obs[env_idx * obs_dim..(env_idx + 1) * obs_dim]);
                }
                self.inference.forward(params, obs, n_envs, &mut self.hidden, &mut self.logits, &mut self.values);
            } else {
                // One conversion per value, which the segment needs anyway; the policy's first
                // layer reads the same bytes.
                to_frames(obs, &mut self.frames);
                for (builder, row) in self.builders.iter_mut().zip(self.frames.chunks_exact(obs_dim)) {
                    builder.observations.extend_from_u8(row);
                }
                let frames = &self.frames;
                self.inference.forward_u8(params, frames, n_envs, &mut self.hidden, &mut self.logits, &mut self.values);
            }
            self.sample_actions(params, weights.version);
            let stepped = Instant::now();
            inference_time += stepped - started;
            let actions = if continuous {
                Actions::Continuous { values: &self.env_actions, dim: n_actions }
            } else {
                Actions::Discrete(&self.actions)
            };
            self.envs.step(actions, &mut self.step).expect("actions has one entry per environment");
            env_time += stepped.elapsed();
            let any_failed = !self.step.env_errors.is_empty();
            if any_failed {
                self.count_env_errors();
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
                builder.episode.episode_return += reward;
                builder.episode.episode_len += 1;
                let hidden = &mut self.hidden[env_idx * h..(env_idx + 1) * h];
                if !(terminated || truncated) {
                    let slot = SlotView { env_idx, envs: self.envs.as_mut(), hidden, episode: &mut builder.episode };
                    if let Some(saved) = self.starts.after_step(slot, weights.version) {
                        builder.saved_snapshots.push(saved);
                    }
                    continue;
                }
                // An aborted episode did not end on its own: its return is no measure of the
                // policy, so it is not reported.
                if !(any_failed && self.aborted[env_idx]) {
                    let tags = self.starts.tags(env_idx);
                    builder.finished_episodes.push(EpisodeSummary {
                        episode_return: builder.episode.episode_return,
                        episode_len: builder.episode.episode_len,
                        task_id: tags.task_id,
                        work_item: tags.work_item,
                        start: tags.start,
                        group: tags.group,
                    });
                    record_return(&mut self.recent_returns, &self.counters, builder.episode.episode_return);
                }
                builder.episode = RunningEpisode::default();
                builder.episode_id += 1;
                // A new episode starts with a zero recurrent state.
                hidden.fill(0.0);
                let slot = SlotView { env_idx, envs: self.envs.as_mut(), hidden, episode: &mut builder.episode };
                self.starts.episode_ended(slot);
                // The next piece of this segment (an end at the last step starts the next
                // segment's first piece instead), and a resumed episode that starts mid-segment
                // from its saved recurrent state: the learner starts that step from it (at step
                // T it is the next segment's `initial_hidden`).
                if step + 1 < segment_len {
                    builder.episode_groups.push(self.starts.tags(env_idx).group);
                    let hidden = &self.hidden[env_idx * h..(env_idx + 1) * h];
                    if hidden.iter().any(|&x| x != 0.0) {
                        builder
                            .restored_states
                            .push(RestoredState { step: (step + 1) as u32, hidden: hidden.to_vec() });
                    }
                }
            }
            self.counters.episodes.fetch_add(self.step.finished_episodes.len() as u64, Ordering::Relaxed);
        }
        let obs = self.envs.obs();
        let mut segments = Vec::with_capacity(n_envs);
        for (env_idx, builder) in self.builders.iter_mut().enumerate() {
            builder.observations.extend_from_f32(&obs[env_idx * obs_dim..(env_idx + 1) * obs_dim]);
            segments.push(builder.finish(&self.spec, &self.actor, self.incarnation, env_idx, &weights, obs_dim));
        }
        self.starts.segment_done();
        let steps = (self.spec.segment_len * n_envs) as u64;
        self.counters.env_steps.fetch_add(steps, Ordering::Relaxed);
        self.counters.env_nanos.fetch_add(env_time.as_nanos() as u64, Ordering::Relaxed);
        self.counters.inference_nanos.fetch_add(inference_time.as_nanos() as u64, Ordering::Relaxed);
        segments
    }

    /// Draw every environment's action from the policy head over its row of outputs (one
    /// sampler for every head, `volley_policy::head`), record it with its log-probability (the
    /// learner re-evaluates exactly this), and write what the environments get: the index, the
    /// draw itself (a continuous environment clips it to its box and counts the repair) or,
    /// squashed, the draw scaled from `(−1, 1)` to the box. A row whose outputs are no
    /// distribution (finite weights can still overflow a forward) draws from the head's fallback
    /// (uniform, or the standard normal) and records that density, so the step is honest
    /// off-policy data (issue 46: this was a panic).
    fn sample_actions(&mut self, params: &[f32], version: PolicyVersion) {
        let n_actions = self.envs.n_actions();
        let head_params = self.layout.log_std_range().map_or(&[][..], |range| &params[range]);
        let head = AnyHead::new(self.spec.policy.head, n_actions, head_params);
        let width = head.action_width();
        let squashed = self.spec.policy.head == (ActionHead::Gaussian { squash: true });
        for env_idx in 0..self.envs.n_envs() {
            let outputs = &self.logits[env_idx * n_actions..(env_idx + 1) * n_actions];
            let action = &mut self.action_words[env_idx * width..(env_idx + 1) * width];
            // A scheduled episode samples from its own generator, so a resumed episode replays
            // exactly; otherwise all slots share the worker's.
            let sampled = match self.starts.action_rng(env_idx) {
                Some(rng) => head.sample(outputs, rng, action),
                None => head.sample(outputs, &mut self.rng, action),
            };
            if sampled.fell_back {
                self.counters.policy_fallbacks.fetch_add(1, Ordering::Relaxed);
                if self.rejections.record("non_finite_policy_output") {
                    warn!(actor = %self.actor, env_idx, version = version.0,
                          "policy output has no distribution; acting from the head's fallback for this step");
                }
            }
            let builder = &mut self.builders[env_idx];
            builder.behaviour_log_probs.push(sampled.log_prob);
            let row = env_idx * n_actions..(env_idx + 1) * n_actions;
            match &self.action_box {
                None => {
                    let index = action[0].to_bits();
                    self.actions[env_idx] = index as usize;
                    builder.actions.push(index);
                }
                Some((low, high)) => {
                    builder.continuous_actions.extend_from_slice(action);
                    if squashed {
                        gaussian::scale_to_box(action, low, high, &mut self.env_actions[row]);
                    } else {
                        self.env_actions[row].copy_from_slice(action);
                    }
                }
            }
        }
    }

    /// Count this step's environment failures and mark the episodes they aborted.
    #[cold]
    fn count_env_errors(&mut self) {
        self.aborted.fill(false);
        for (env_idx, error) in &self.step.env_errors {
            let env_idx = *env_idx;
            self.counters.env_errors.fetch_add(1, Ordering::Relaxed);
            if self.rejections.record(error.reason()) {
                warn!(actor = %self.actor, env_idx, %error, reason = error.reason(), "environment failed; reset");
            }
            // A failure right after an episode ended (a failed reset) aborts nothing.
            let finished = self.step.finished_episodes.iter().any(|e| e.env_idx == env_idx);
            if !finished && !self.aborted[env_idx] {
                self.aborted[env_idx] = true;
                self.counters.episodes_aborted.fetch_add(1, Ordering::Relaxed);
            }
        }
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
                    if self.rejections.record("weights_refused") {
                        warn!(actor = %self.actor, %err, "first weights refused; waiting for valid ones");
                    }
                }
            }
            // Versions refused for their signature show while the actor waits, too.
            let paths = follower.paths();
            self.counters.weights_unsigned.store(paths.unsigned, Ordering::Relaxed);
            self.counters.weights_bad_signature.store(paths.bad_signature, Ordering::Relaxed);
        }
        info!(actor = %self.actor, version = ?self.policy_version(), n_envs = self.envs.n_envs(), "actor started");
        let mut throttled_before = sink.throttled();
        let mut retries_before = sink.publish_retries();
        // Rounds collected and not yet handed to the sink (`with_rounds_per_publish`).
        let mut held: Vec<TrajectorySegment> = Vec::new();
        let mut held_rounds = 0;
        let mut last_round: Option<Duration> = None;
        while !stop.load(Ordering::Acquire) {
            let fast = last_round.is_some_and(|took| took < self.hold_within);
            let publish = !fast || held_rounds + 1 >= self.rounds_per_publish;
            // Wait for room first, then take the newest weights and collect: a round collected
            // before the wait would age by every version the learner makes while this actor
            // waits (issue 11: mean lag 9.6 versions with 4 actors on CartPole). So the wait
            // comes before the first round of a publish, for all its rounds, and the rounds
            // after it follow at once: waiting before the last one instead let the held round
            // age through the wait, and 4 actors needed a third more env steps.
            if held_rounds == 0 {
                let rounds = if fast { self.rounds_per_publish } else { 1 };
                match sink.wait_for_room(rounds * self.envs.n_envs()) {
                    Ok(()) => {}
                    Err(TransportError::Closed) => break,
                    Err(err) => {
                        self.counters.publish_errors.fetch_add(1, Ordering::Relaxed);
                        return Err(err.into());
                    }
                }
            }
            let fetch_started = Instant::now();
            match follower.latest(self.policy_version()) {
                Ok(Some(weights)) => {
                    self.counters
                        .weight_fetch_nanos
                        .fetch_add(fetch_started.elapsed().as_nanos() as u64, Ordering::Relaxed);
                    self.counters.weight_fetches.fetch_add(1, Ordering::Relaxed);
                    if let Err(err) = self.set_weights(weights) {
                        // Keep acting with the old version; the learner decides what is too stale.
                        self.counters.weights_refused.fetch_add(1, Ordering::Relaxed);
                        if self.rejections.record("weights_unusable") {
                            warn!(actor = %self.actor, %err, "ignoring unusable weights");
                        }
                    }
                }
                Ok(None) => {}
                Err(TransportError::Closed) => break,
                Err(err) => {
                    self.counters.weights_refused.fetch_add(1, Ordering::Relaxed);
                    if self.rejections.record("weights_refused") {
                        warn!(actor = %self.actor, %err, "weights check failed; keeping current version");
                    }
                }
            }
            let paths = follower.paths();
            let c = &self.counters;
            c.weights_live.store(paths.live, Ordering::Relaxed);
            c.weights_durable.store(paths.durable, Ordering::Relaxed);
            c.weights_live_refused.store(paths.live_refused, Ordering::Relaxed);
            c.weights_live_chunks_refused.store(paths.live_chunks_refused, Ordering::Relaxed);
            c.weights_unsigned.store(paths.unsigned, Ordering::Relaxed);
            c.weights_bad_signature.store(paths.bad_signature, Ordering::Relaxed);
            let started = Instant::now();
            let round = self.collect_segments();
            last_round = Some(started.elapsed());
            held_rounds += 1;
            if held.is_empty() {
                held = round;
            } else {
                held.extend(round);
            }
            if !publish {
                continue;
            }
            held_rounds = 0;
            let segments = std::mem::take(&mut held);
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
            let notices = sink.pace_notices();
            self.counters.pace_notices_used.store(notices.used, Ordering::Relaxed);
            self.counters.pace_notices_refused.store(notices.refused, Ordering::Relaxed);
            self.counters.pace_notices_distrusted.store(notices.distrusted, Ordering::Relaxed);
            let retries = sink.publish_retries();
            self.counters.publish_errors.fetch_add(retries.saturating_sub(retries_before), Ordering::Relaxed);
            retries_before = retries;
            let throttled = sink.throttled();
            self.counters
                .throttled_nanos
                .fetch_add((throttled - throttled_before).as_nanos() as u64, Ordering::Relaxed);
            throttled_before = throttled;
        }
        if !held.is_empty() {
            debug!(actor = %self.actor, segments = held.len(), "stopped with a held round; dropped like the round in progress");
        }
        info!(actor = %self.actor, "actor stopped");
        Ok(())
    }
}

/// Add a finished episode's return to the window behind the exported mean return.
fn record_return(recent_returns: &mut VecDeque<f32>, counters: &ActorCounters, episode_return: f32) {
    if recent_returns.len() == RETURN_WINDOW {
        recent_returns.pop_front();
    }
    recent_returns.push_back(episode_return);
    let mean = recent_returns.iter().map(|&r| r as f64).sum::<f64>() / recent_returns.len() as f64;
    counters.episode_return_mean_bits.store(mean.to_bits(), Ordering::Relaxed);
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

/// Environment observations (whole numbers in `0..=255` for an image space) as bytes.
fn to_frames(obs: &[f32], frames: &mut [u8]) {
    for (frame, &value) in frames.iter_mut().zip(obs) {
        *frame = value as u8;
    }
}

impl SegmentBuilder {
    fn with_capacity(t_len: usize, obs_dim: usize, h: usize, element: ObsElement) -> Self {
        let mut builder = SegmentBuilder { observations: Observations::empty(element), ..SegmentBuilder::default() };
        builder.reserve(t_len, obs_dim, h);
        builder
    }

    fn reserve(&mut self, t_len: usize, obs_dim: usize, h: usize) {
        self.observations.reserve((t_len + 1) * obs_dim);
        self.actions.reserve(t_len);
        self.continuous_actions.reserve(t_len);
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
        let element = self.observations.element();
        let segment = TrajectorySegment {
            run: spec.run.clone(),
            actor: actor.clone(),
            incarnation,
            env_idx: env_idx as u32,
            episode_id: self.episode_id_at_start,
            segment_idx: self.segment_idx,
            task_id: self.task_id_at_start,
            start_snapshot: self.start_at_start.take(),
            policy_version: weights.version,
            layout_hash: weights.layout_hash,
            obs_dim: obs_dim as u32,
            observations: std::mem::replace(&mut self.observations, Observations::empty(element)),
            actions: std::mem::take(&mut self.actions),
            continuous_actions: std::mem::take(&mut self.continuous_actions),
            rewards: std::mem::take(&mut self.rewards),
            terminated: std::mem::take(&mut self.terminated),
            truncated: std::mem::take(&mut self.truncated),
            behaviour_log_probs: std::mem::take(&mut self.behaviour_log_probs),
            truncation_values: std::mem::take(&mut self.truncation_values),
            initial_hidden: std::mem::take(&mut self.initial_hidden),
            restored_states: std::mem::take(&mut self.restored_states),
            finished_episodes: std::mem::take(&mut self.finished_episodes),
            saved_snapshots: std::mem::take(&mut self.saved_snapshots),
            // Segments with no group member carry none, as before groups existed.
            episode_groups: if self.episode_groups.iter().any(Option::is_some) {
                std::mem::take(&mut self.episode_groups)
            } else {
                self.episode_groups.clear();
                Vec::new()
            },
        };
        self.segment_idx += 1;
        self.reserve(spec.segment_len, obs_dim, h);
        segment
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use volley_core::work::{GroupMember, Start, WorkConfig, WorkItem};
    use volley_env::{EnvConfig, MemoryConfig};
    use volley_policy::CoreKind;
    use volley_testkit::fixtures::SpecBuilder;
    use volley_transport::work::{local_work_queue, LocalSnapshotStore, WorkQueue};

    fn worker(env: EnvConfig, obs_dim: usize, n_actions: usize, core: CoreKind, t_len: usize) -> RolloutWorker {
        let gaussian = matches!(env, EnvConfig::Pendulum);
        let mut builder =
            SpecBuilder::cartpole(t_len).run("actor-test").env(env, obs_dim, n_actions).core(core).seed(1);
        if gaussian {
            builder = builder.head(volley_policy::ActionHead::Gaussian { squash: false });
        }
        let spec = builder.build();
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
            assert_eq!(a.observations.element(), ObsElement::F32, "vector observations stay f32");
            assert!(a.observations.same_values(64 * 4..65 * 4, &b.observations, 0..4), "b starts where a ended");
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

    /// Issue 44 item 3: an image observation space (MinAtar's planes) fills segments with
    /// bytes, which validate and continue each other; the policy reads the same bytes.
    #[test]
    fn image_observations_travel_in_segments_as_bytes() {
        let env = EnvConfig::Minatar(volley_env::MinatarConfig::new(volley_env::MinatarGame::Breakout));
        let (obs_dim, n_actions) = env.spaces().expect("MinAtar's spaces");
        let mut worker = worker(env, obs_dim, n_actions, CoreKind::Mlp, 16);
        let first = worker.collect_segments();
        let second = worker.collect_segments();
        let hash = worker.layout.hash();
        for (a, b) in first.iter().zip(&second) {
            a.validate(&worker.spec, hash, 0).expect("valid segment");
            let frames = a.observations.as_u8().expect("image observations are bytes");
            assert_eq!(frames.len(), 17 * obs_dim);
            assert!(frames.iter().all(|&v| v <= 1) && frames.contains(&1), "0/1 planes");
            let boundary = 16 * obs_dim..17 * obs_dim;
            assert!(a.observations.same_values(boundary, &b.observations, 0..obs_dim), "b starts where a ended");
            assert!(a.behaviour_log_probs.iter().all(|&lp| lp <= 0.0 && lp > -10.0));
        }
    }

    /// A sink under backpressure whose learner publishes a new version while the actor waits.
    struct FullSink {
        newest: Arc<std::sync::Mutex<Arc<Weights>>>,
        next: Option<Arc<Weights>>,
        published: Vec<PolicyVersion>,
        stop: Arc<AtomicBool>,
    }

    impl TrajectorySink for FullSink {
        fn publish(&mut self, segments: Vec<TrajectorySegment>) -> Result<(), TransportError> {
            // Backpressure here, after the round was collected, would be too late: the test
            // publishes the new version only in `wait_for_room`.
            self.published.extend(segments.iter().map(|s| s.policy_version));
            self.stop.store(true, Ordering::Release);
            Ok(())
        }

        fn wait_for_room(&mut self, _n_segments: usize) -> Result<(), TransportError> {
            if let Some(next) = self.next.take() {
                *self.newest.lock().expect("unpoisoned") = next;
            }
            Ok(())
        }

        fn throttled(&self) -> Duration {
            Duration::ZERO
        }
    }

    struct SharedFollower(Arc<std::sync::Mutex<Arc<Weights>>>);

    impl WeightsFollower for SharedFollower {
        fn latest(&mut self, have: Option<PolicyVersion>) -> Result<Option<Arc<Weights>>, TransportError> {
            let newest = self.0.lock().expect("unpoisoned").clone();
            Ok((Some(newest.version) != have).then_some(newest))
        }

        fn wait_first(&mut self, _timeout: Duration) -> Result<Arc<Weights>, TransportError> {
            Ok(self.0.lock().expect("unpoisoned").clone())
        }
    }

    #[test]
    fn a_round_is_collected_after_the_backpressure_wait_with_the_weights_published_during_it() {
        // Issue 11: an actor that collected its round and then waited for room held data that
        // aged by every version the learner made meanwhile (mean lag 9.6 versions with 4
        // actors); it now waits first and collects with what the wait brought.
        let worker = worker(EnvConfig::Cartpole, 4, 2, CoreKind::Mlp, 8);
        let v4 = worker.weights.clone().expect("weights set");
        let v5 = Arc::new(Weights::new(PolicyVersion(5), v4.layout_hash, v4.params.clone()));
        let newest = Arc::new(std::sync::Mutex::new(v4));
        let stop = Arc::new(AtomicBool::new(false));
        let mut sink = FullSink { newest: newest.clone(), next: Some(v5), published: Vec::new(), stop: stop.clone() };
        worker.run(&mut sink, &mut SharedFollower(newest), &stop).expect("runs");
        assert_eq!(sink.published, vec![PolicyVersion(5); 3], "every segment of the round acts with version 5");
    }

    /// A sink that records what the worker asks of it, makes a new weights version in every
    /// wait for room (as a learner would while an actor waits), and stops the worker after
    /// `publishes` publish calls.
    struct RecordingSink {
        calls: Vec<(&'static str, usize)>,
        /// Per publish call: each segment's (segment_idx, env_idx, policy version).
        rounds: Vec<Vec<(u64, u32, u64)>>,
        newest: Arc<std::sync::Mutex<Arc<Weights>>>,
        publishes: usize,
        stop: Arc<AtomicBool>,
    }

    impl TrajectorySink for RecordingSink {
        fn publish(&mut self, segments: Vec<TrajectorySegment>) -> Result<(), TransportError> {
            self.calls.push(("publish", segments.len()));
            self.rounds.push(segments.iter().map(|s| (s.segment_idx, s.env_idx, s.policy_version.0)).collect());
            if self.rounds.len() == self.publishes {
                self.stop.store(true, Ordering::Release);
            }
            Ok(())
        }

        fn wait_for_room(&mut self, n_segments: usize) -> Result<(), TransportError> {
            self.calls.push(("wait", n_segments));
            let mut newest = self.newest.lock().expect("unpoisoned");
            let next = PolicyVersion(newest.version.0 + 1);
            *newest = Arc::new(Weights::new(next, newest.layout_hash, newest.params.clone()));
            Ok(())
        }

        fn throttled(&self) -> Duration {
            Duration::ZERO
        }
    }

    fn run_recorded(rounds_per_publish: usize, within: Duration, publishes: usize) -> RecordingSink {
        let worker =
            worker(EnvConfig::Cartpole, 4, 2, CoreKind::Mlp, 8).with_rounds_per_publish(rounds_per_publish, within);
        let newest = Arc::new(std::sync::Mutex::new(worker.weights.clone().expect("weights set")));
        let stop = Arc::new(AtomicBool::new(false));
        let mut sink = RecordingSink {
            calls: Vec::new(),
            rounds: Vec::new(),
            newest: newest.clone(),
            publishes,
            stop: stop.clone(),
        };
        worker.run(&mut sink, &mut SharedFollower(newest), &stop).expect("runs");
        // Every round of a publish acts with the version its wait for room brought (issue 11:
        // a round held through a wait would act with one the learner has moved on from).
        let first = sink.rounds[0][0].2;
        for (i, call) in sink.rounds.iter().enumerate() {
            assert!(call.iter().all(|s| s.2 == first + i as u64), "publish {i}: {call:?}");
        }
        sink
    }

    #[test]
    fn fast_rounds_are_published_two_to_a_call_with_one_wait_for_room_before_the_first() {
        // Issue 16: a message per round put the broker's per-message cost on every update.
        let sink = run_recorded(2, Duration::from_secs(60), 4);
        // The first round has no measured predecessor, so it goes alone; then pairs.
        let expected: Vec<(&str, usize)> = vec![
            ("wait", 3),
            ("publish", 3),
            ("wait", 6),
            ("publish", 6),
            ("wait", 6),
            ("publish", 6),
            ("wait", 6),
            ("publish", 6),
        ];
        assert_eq!(sink.calls, expected);
        // Each environment's segments follow each other, in order, across and within calls.
        let mut next = [0u64; 3];
        for call in &sink.rounds {
            for &(segment_idx, env_idx, _) in call {
                assert_eq!(segment_idx, next[env_idx as usize], "env {env_idx}: {:?}", sink.rounds);
                next[env_idx as usize] += 1;
            }
        }
        assert_eq!(next, [7, 7, 7]);
    }

    #[test]
    fn slow_rounds_and_one_round_per_publish_are_never_held() {
        let every_round: Vec<(&str, usize)> = [("wait", 3), ("publish", 3)].repeat(3);
        // No round is quicker than zero: each is published as it comes.
        assert_eq!(run_recorded(2, Duration::ZERO, 3).calls, every_round);
        assert_eq!(run_recorded(1, Duration::from_secs(60), 3).calls, every_round);
        // Never more than asked: three rounds to a call.
        let sink = run_recorded(3, Duration::from_secs(60), 3);
        assert_eq!(
            sink.calls,
            vec![("wait", 3), ("publish", 3), ("wait", 9), ("publish", 9), ("wait", 9), ("publish", 9)]
        );
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
        assert!(matches!(worker.set_weights(foreign), Err(ActorError::Weights { version: PolicyVersion(9), .. })));
        let mut corrupt = Weights::new(PolicyVersion(9), worker.layout.hash(), vec![0.0; n]);
        corrupt.params[0] = 1.0;
        assert!(worker.set_weights(Arc::new(corrupt)).is_err());
        assert_eq!(worker.policy_version(), Some(PolicyVersion(4)), "the old version stays in use");
    }

    /// Issue 46: a NaN anchor with a valid digest was applied, and the actor then panicked in
    /// its sampler. Weights holding a non-finite value or one beyond `MAX_ABS_PARAM` are refused
    /// whatever their digest, and the actor keeps acting with the version it had.
    #[test]
    fn weights_with_unusable_values_and_a_valid_digest_are_refused() {
        for core in [CoreKind::Mlp, CoreKind::Gru { hidden: 8 }] {
            let mut worker = worker(EnvConfig::Cartpole, 4, 2, core, 8);
            let n = worker.layout.n_params();
            for bad in [f32::NAN, f32::INFINITY, f32::NEG_INFINITY, 3e38, -2e19] {
                let mut params = vec![0.01; n];
                params[n / 2] = bad;
                let forged = Arc::new(Weights::new(PolicyVersion(9), worker.layout.hash(), params));
                assert!(worker.set_weights(forged).is_err(), "{core:?}: {bad} was applied");
                assert_eq!(worker.policy_version(), Some(PolicyVersion(4)), "the old version stays in use");
            }
            let segments = worker.collect_segments();
            assert!(segments.iter().all(|s| s.behaviour_log_probs.iter().all(|p| p.is_finite())));
        }
    }

    /// Issue 46: weights at the bound (every parameter ±`MAX_ABS_PARAM`) are applied, and
    /// the actor acts with them without panicking: what it records is finite, and any step
    /// whose policy output had no distribution is counted as a fallback.
    #[test]
    fn weights_at_the_bound_are_acted_on_without_a_panic() {
        use volley_core::wire::MAX_ABS_PARAM;
        for (env, obs_dim, n_actions) in [(EnvConfig::Cartpole, 4, 2), (EnvConfig::Pendulum, 3, 1)] {
            for core in [CoreKind::Mlp, CoreKind::Gru { hidden: 4 }] {
                let mut worker = worker(env.clone(), obs_dim, n_actions, core, 8);
                let n = worker.layout.n_params();
                let params = (0..n).map(|i| if i % 3 == 0 { -MAX_ABS_PARAM } else { MAX_ABS_PARAM }).collect();
                let huge = Arc::new(Weights::new(PolicyVersion(5), worker.layout.hash(), params));
                worker.set_weights(huge).expect("finite and within the bound");
                for segment in worker.collect_segments() {
                    assert!(segment.behaviour_log_probs.iter().all(|p| p.is_finite()), "{env:?} {core:?}");
                    assert!(segment.continuous_actions.iter().all(|a| a.is_finite()), "{env:?} {core:?}");
                }
            }
        }
    }

    proptest::proptest! {
        #![proptest_config(proptest::prelude::ProptestConfig { cases: 64, ..Default::default() })]
        /// Issue 46: whatever values weights carry (finite, huge, NaN, infinite), an actor
        /// (MLP and GRU, discrete and continuous) applies them or refuses them, and then
        /// collects segments without panicking; what it records is finite.
        #[test]
        fn no_weights_values_panic_an_actor(
            recurrent in proptest::bool::ANY,
            continuous in proptest::bool::ANY,
            values in proptest::collection::vec(
                proptest::prop_oneof![
                    proptest::num::f32::ANY,
                    proptest::sample::select(vec![f32::NAN, f32::INFINITY, 3e38, 1e19, 1e18, -1e10, 0.0]),
                ],
                1..8,
            ),
            at in proptest::collection::vec(proptest::num::usize::ANY, 8),
        ) {
            let core = if recurrent { CoreKind::Gru { hidden: 4 } } else { CoreKind::Mlp };
            let (env, obs_dim, n_actions) =
                if continuous { (EnvConfig::Pendulum, 3, 1) } else { (EnvConfig::Cartpole, 4, 2) };
            let mut worker = worker(env, obs_dim, n_actions, core, 4);
            let n = worker.layout.n_params();
            let mut params = worker.layout.init_params(3);
            for (value, at) in values.iter().zip(&at) {
                params[at % n] = *value;
            }
            let _ = worker.set_weights(Arc::new(Weights::new(PolicyVersion(7), worker.layout.hash(), params)));
            for segment in worker.collect_segments() {
                proptest::prop_assert!(segment.behaviour_log_probs.iter().all(|p| p.is_finite()));
                proptest::prop_assert!(segment.continuous_actions.iter().all(|a| a.is_finite()));
            }
        }
    }

    #[test]
    fn a_spec_this_build_cannot_serve_is_refused() {
        let spec = SpecBuilder::cartpole(8).run("x").env(EnvConfig::Cartpole, 5, 2).build();
        let result = RolloutWorker::new(spec, ActorId::new("a").expect("valid"), 1, 0, Arc::default());
        assert!(matches!(result, Err(ActorError::Spec(_))));
    }

    fn work_spec(segment_len: usize, snapshot_every_steps: u32) -> RunSpec {
        let mut spec = worker(EnvConfig::Cartpole, 4, 2, CoreKind::Mlp, segment_len).spec.clone();
        spec.hyper.work =
            WorkConfig { enabled: true, snapshot_every_steps, snapshot_at_milestones: false, ..WorkConfig::default() };
        spec
    }

    /// One environment taking `items` from a fresh queue, saving to `store`.
    fn work_worker(spec: &RunSpec, items: &[WorkItem], store: &LocalSnapshotStore) -> RolloutWorker {
        let (mut queue, source) = local_work_queue();
        queue.submit(items).expect("in-process queue");
        let layout = spec.validate().expect("valid");
        let mut worker = RolloutWorker::new(spec.clone(), ActorId::new("w-0").expect("valid"), 1, 3, Arc::default())
            .expect("buildable")
            .with_work(Box::new(source), Box::new(store.clone()))
            .expect("work enabled");
        worker.set_weights(Arc::new(Weights::new(PolicyVersion(2), layout.hash(), layout.init_params(2)))).unwrap();
        worker
    }

    /// Segments until `n` episodes of work item `item` finished.
    fn until_item_episodes(
        worker: &mut RolloutWorker,
        item: u64,
        n: usize,
    ) -> (Vec<EpisodeSummary>, Vec<SnapshotInfo>) {
        let (mut episodes, mut saved) = (Vec::new(), Vec::new());
        for _ in 0..1000 {
            for segment in worker.collect_segments() {
                episodes.extend(segment.finished_episodes.into_iter().filter(|e| e.work_item == Some(item)));
                saved.extend(segment.saved_snapshots);
            }
            if episodes.len() >= n {
                return (episodes, saved);
            }
        }
        panic!("work item {item} did not finish {n} episodes");
    }

    #[test]
    fn scheduled_episodes_are_tagged_snapshotted_and_completed() {
        let spec = work_spec(8, 3);
        let store = LocalSnapshotStore::new(1000);
        let item = WorkItem { id: 7, task_id: 0, start: Start::Fresh { seed: 11 }, episodes: 2, group: None };
        let mut worker = work_worker(&spec, &[item], &store);
        let (episodes, saved) = until_item_episodes(&mut worker, 7, 2);
        assert!(episodes.iter().all(|e| e.start.is_none() && e.task_id == 0));
        assert!(!saved.is_empty() && saved.iter().all(|s| s.key.starts_with("w7-")), "{saved:?}");
        assert!(saved.iter().all(|s| s.episode_len % 3 == 0), "saved every 3 steps: {saved:?}");
        let mut store_reader = store.clone();
        let snapshot = store_reader.load(&saved[0].key).expect("readable").expect("kept");
        assert_eq!(snapshot.policy_version, PolicyVersion(2));
        // The second episode's end completed the item; the queue was empty after it.
        assert_eq!(worker.counters.work_items_completed.load(Ordering::Relaxed), 1);
        assert!(worker.counters.unscheduled_episodes.load(Ordering::Relaxed) >= 1);
    }

    /// Issue 48, item 2: every scheduled episode runs the task of its label, the first one of
    /// each slot included. The slots' environments are built from the run's own environment
    /// (here a delay the task list does not hold); the first item of task 0 used to run that
    /// environment while labelled task 0, so its summary claimed 8 steps of a 4-step task.
    #[test]
    fn scheduled_episodes_run_exactly_the_task_of_their_label() {
        let memory = |delay| EnvConfig::Memory(MemoryConfig { n_cues: 2, delay });
        let tasks = [memory(2), memory(9)];
        let task_len = [4u32, 11];
        let mut spec = worker(memory(6), 3, 2, CoreKind::Mlp, 8).spec.clone();
        spec.hyper.work = WorkConfig {
            enabled: true,
            tasks: tasks.to_vec(),
            snapshot_every_steps: 0,
            snapshot_at_milestones: false,
            ..WorkConfig::default()
        };
        let layout = spec.validate().expect("valid");
        // Task 0 first, so each of the two slots starts on a different task.
        let items: Vec<WorkItem> = (0..8)
            .map(|id| WorkItem {
                id,
                task_id: (id % 2) as u32,
                start: Start::Fresh { seed: 40 + id },
                episodes: 2,
                group: None,
            })
            .collect();
        let (mut queue, source) = local_work_queue();
        queue.submit(&items).expect("in-process queue");
        let n_envs = 2;
        let mut worker =
            RolloutWorker::new(spec.clone(), ActorId::new("w-0").expect("valid"), n_envs, 3, Arc::default())
                .expect("buildable")
                .with_work(Box::new(source), Box::new(LocalSnapshotStore::new(100)))
                .expect("work enabled");
        worker.set_weights(Arc::new(Weights::new(PolicyVersion(1), layout.hash(), layout.init_params(2)))).unwrap();
        // Per stream: steps and reward since the last episode end.
        let mut running = vec![(0u32, 0.0f32); n_envs];
        let mut scheduled = Vec::new();
        for _ in 0..100 {
            for segment in worker.collect_segments() {
                segment.validate(&spec, layout.hash(), layout.recurrent_size()).expect("the segment validates");
                let (steps, reward) = &mut running[segment.env_idx as usize];
                let mut summaries = segment.finished_episodes.iter();
                for t in 0..segment.len() {
                    *steps += 1;
                    *reward += segment.rewards[t];
                    if segment.terminated[t] == 0 && segment.truncated[t] == 0 {
                        continue;
                    }
                    let summary = summaries.next().expect("every episode end has its summary");
                    assert_eq!((summary.episode_len, summary.episode_return), (*steps, *reward), "{summary:?}");
                    (*steps, *reward) = (0, 0.0);
                    if let Some(item) = summary.work_item {
                        scheduled.push(summary.clone());
                        let task = items[item as usize].task_id;
                        assert_eq!(summary.task_id, task, "item {item}'s episode is labelled with its task");
                        assert_eq!(
                            summary.episode_len, task_len[task as usize],
                            "item {item} runs task {task}: {summary:?}"
                        );
                    }
                }
                assert!(summaries.next().is_none(), "no summary without an episode end");
            }
            if scheduled.len() == 2 * items.len() {
                break;
            }
        }
        assert_eq!(scheduled.len(), 2 * items.len(), "every item ran both its episodes");
        assert_eq!(worker.counters.work_items_completed.load(Ordering::Relaxed), items.len() as u64);
    }

    /// Issue 18: an episode resumed from a saved recurrent state starts right where the previous
    /// episode ended, mid-segment (it used to wait for the next segment boundary), and the
    /// segment records the restored state at that step for the learner.
    #[test]
    fn a_resumed_recurrent_episode_starts_mid_segment_and_records_its_state() {
        let memory = MemoryConfig { n_cues: 2, delay: 6 };
        let mut spec = worker(EnvConfig::Memory(memory), 3, 2, CoreKind::Gru { hidden: 4 }, 16).spec.clone();
        spec.hyper.work = WorkConfig {
            enabled: true,
            snapshot_every_steps: 3,
            snapshot_at_milestones: false,
            ..WorkConfig::default()
        };
        let store = LocalSnapshotStore::new(100);
        let fresh = WorkItem { id: 1, task_id: 0, start: Start::Fresh { seed: 11 }, episodes: 1, group: None };
        let saved = work_worker(&spec, &[fresh], &store).collect_segments().remove(0).saved_snapshots;
        let key = saved[0].key.clone();
        let snapshot = store.clone().load(&key).expect("readable").expect("kept");
        assert!(snapshot.hidden.iter().any(|&h| h != 0.0), "a GRU's state after 3 steps");
        let items = [
            WorkItem { id: 2, task_id: 0, start: Start::Fresh { seed: 12 }, episodes: 1, group: None },
            WorkItem { id: 3, task_id: 0, start: Start::Resume { snapshot: key.clone() }, episodes: 1, group: None },
        ];
        let mut worker = work_worker(&spec, &items, &store);
        let segment = worker.collect_segments().remove(0);
        // The fresh episode lasts delay + 2 = 8 steps; the resumed one starts at step 8 with the
        // saved state and the 3 steps it had done, so it ends after 5 more, at step 13.
        let ends: Vec<usize> = (0..16).filter(|&t| segment.terminated[t] != 0).collect();
        assert_eq!(ends, vec![7, 12]);
        assert_eq!(segment.restored_states.len(), 1);
        assert_eq!(segment.restored_states[0].step, 8);
        assert_eq!(segment.restored_states[0].hidden, snapshot.hidden);
        let resumed = segment.finished_episodes.iter().find(|e| e.work_item == Some(3)).expect("finished");
        assert_eq!((resumed.episode_len, resumed.start.as_deref()), (8, Some(key.as_str())));
        assert_eq!(worker.counters.episodes_resumed.load(Ordering::Relaxed), 1);
        segment.validate(&spec, spec.validate().expect("valid").hash(), 4).expect("the segment validates");
    }

    /// The in-process version of `cli/tests/save_load.rs`: an item taken again after its actor
    /// stopped mid-episode continues from the newest snapshot to the same return and length.
    #[test]
    fn an_interrupted_item_continues_to_the_uninterrupted_outcome() {
        let spec = work_spec(4, 2);
        let item = WorkItem { id: 7, task_id: 0, start: Start::Fresh { seed: 11 }, episodes: 1, group: None };
        let (uninterrupted, _) = until_item_episodes(
            &mut work_worker(&spec, std::slice::from_ref(&item), &LocalSnapshotStore::new(100)),
            7,
            1,
        );
        let store = LocalSnapshotStore::new(100);
        // Four steps: shorter than any CartPole episode, so the episode is cut mid-way.
        let first = work_worker(&spec, std::slice::from_ref(&item), &store).collect_segments();
        assert!(first[0].finished_episodes.is_empty());
        assert_eq!(first[0].saved_snapshots.len(), 2);
        let mut resumed = work_worker(&spec, &[item], &store);
        let (continued, _) = until_item_episodes(&mut resumed, 7, 1);
        assert_eq!(resumed.counters.episodes_resumed.load(Ordering::Relaxed), 1);
        assert_eq!(
            (continued[0].episode_return, continued[0].episode_len),
            (uninterrupted[0].episode_return, uninterrupted[0].episode_len)
        );
    }

    /// Restarts from a saved state (Go-Explore's "return, then explore") sample their actions
    /// from a stream of their own: with the generator saved in the snapshot, every restart
    /// would replay the original episode's continuation, so restarts explored nothing.
    #[test]
    fn restarts_from_one_saved_state_explore_with_their_own_sampling_streams() {
        let spec = work_spec(4, 2);
        let store = LocalSnapshotStore::new(100);
        let item = WorkItem { id: 7, task_id: 0, start: Start::Fresh { seed: 11 }, episodes: 1, group: None };
        let (original, saved) = until_item_episodes(&mut work_worker(&spec, &[item], &store), 7, 1);
        let key = saved.iter().find(|s| s.episode_len == 2).expect("saved after 2 steps").key.clone();
        let restarts: Vec<WorkItem> = (20..26)
            .map(|id| WorkItem {
                id,
                task_id: 0,
                start: Start::Resume { snapshot: key.clone() },
                episodes: 1,
                group: None,
            })
            .collect();
        let mut worker = work_worker(&spec, &restarts, &store);
        let mut lengths = Vec::new();
        for id in 20..26 {
            let (episodes, _) = until_item_episodes(&mut worker, id, 1);
            assert_eq!(episodes[0].start.as_deref(), Some(key.as_str()));
            lengths.push(episodes[0].episode_len);
        }
        assert_eq!(worker.counters.episodes_resumed.load(Ordering::Relaxed), 6);
        lengths.sort_unstable();
        lengths.dedup();
        assert!(
            lengths.len() > 1,
            "six restarts of one state all ran {lengths:?} steps (the original ran {})",
            original[0].episode_len
        );
    }

    /// Member `member` of group 100 (four continuations of one start).
    fn member_item(member: u32, start: &Start) -> WorkItem {
        WorkItem {
            id: 100 + u64::from(member),
            task_id: 0,
            start: start.clone(),
            episodes: 1,
            group: Some(GroupMember { group: 100, member, size: 4 }),
        }
    }

    /// Start the worker's one slot on its item and return the environment's snapshot bytes and
    /// the recurrent state at the episode's first step.
    fn state_at_start(worker: &mut RolloutWorker) -> (Vec<u8>, Vec<u32>) {
        let h = worker.layout.recurrent_size();
        let builder = &mut worker.builders[0];
        worker.starts.at_segment_boundary(SlotView {
            env_idx: 0,
            envs: worker.envs.as_mut(),
            hidden: &mut worker.hidden[..h],
            episode: &mut builder.episode,
        });
        let env = worker.envs.snapshot_env(0).expect("CartPole snapshots");
        (env, worker.hidden[..h].iter().map(|v| v.to_bits()).collect())
    }

    /// The actions and return of `item`'s episode, read from the segments' group tags.
    fn member_episode(worker: &mut RolloutWorker, item: u64) -> (Vec<u32>, f32) {
        let mut actions = Vec::new();
        for _ in 0..1000 {
            for segment in worker.collect_segments() {
                let tags: Vec<_> = segment.step_groups().collect();
                actions.extend(
                    segment
                        .actions
                        .iter()
                        .zip(&tags)
                        .filter(|(_, g)| g.is_some_and(|g| 100 + u64::from(g.member) == item))
                        .map(|(a, _)| *a),
                );
                if let Some(done) = segment.finished_episodes.iter().find(|e| e.work_item == Some(item)) {
                    assert_eq!(done.group.map(|g| g.group), Some(100));
                    // Every step of the episode is tagged with the member: the steps before
                    // a resumed start are the saved state's.
                    let before = if worker.counters.episodes_resumed.load(Ordering::Relaxed) > 0 { 10 } else { 0 };
                    assert_eq!(done.episode_len as usize, before + actions.len());
                    return (actions, done.episode_return);
                }
            }
        }
        panic!("member {item} did not finish");
    }

    /// Issue 18, item 2: the continuations of a group start from bit-identical environment and
    /// recurrent states, whether the start is a fresh reset or a saved state, and differ only
    /// through their sampling streams: the same member run twice takes the same actions, and
    /// different members take different ones.
    #[test]
    fn group_members_start_bit_identical_and_diverge_only_through_their_streams() {
        let mut spec = worker(EnvConfig::Cartpole, 4, 2, CoreKind::Gru { hidden: 8 }, 8).spec.clone();
        spec.hyper.work = WorkConfig {
            enabled: true,
            snapshot_every_steps: 5,
            snapshot_at_milestones: false,
            group_size: 4,
            ..WorkConfig::default()
        };
        let store = LocalSnapshotStore::new(1000);
        // A saved state mid-episode, with a non-zero recurrent state.
        let single = WorkItem { id: 7, task_id: 0, start: Start::Fresh { seed: 11 }, episodes: 1, group: None };
        let (_, saved) = until_item_episodes(&mut work_worker(&spec, &[single], &store), 7, 1);
        let key = saved.iter().find(|s| s.episode_len == 10).expect("saved at step 10").key.clone();
        let snapshot = store.clone().load(&key).expect("readable").expect("kept");
        assert!(snapshot.hidden.iter().any(|&h| h != 0.0));
        for start in [Start::Fresh { seed: 42 }, Start::Resume { snapshot: key }] {
            let mut states = Vec::new();
            let mut episodes = Vec::new();
            // Members 0..4, and member 0 again on another actor (a redelivery's fresh start).
            for member in [0, 1, 2, 3, 0] {
                // Each run on its own store holding only the saved state (a store shared with
                // member 0's first run would make the second one continue that run).
                let own = LocalSnapshotStore::new(1000);
                own.clone().save(&snapshot).expect("in-process store");
                let mut worker = work_worker(&spec, &[member_item(member, &start)], &own);
                states.push(state_at_start(&mut worker));
                episodes.push(member_episode(&mut worker, 100 + u64::from(member)));
            }
            for (i, state) in states.iter().enumerate() {
                assert_eq!(*state, states[0], "run {i} starts from the first run's state ({start:?})");
            }
            if let Start::Resume { .. } = start {
                assert_eq!(states[0].0, snapshot.env);
                assert_eq!(states[0].1, snapshot.hidden.iter().map(|v| v.to_bits()).collect::<Vec<_>>());
            }
            assert_eq!(episodes[4], episodes[0], "the same stream replays the same episode ({start:?})");
            let distinct: std::collections::HashSet<&Vec<u32>> = episodes[..4].iter().map(|(a, _)| a).collect();
            // Short CartPole tails can coincide by chance; different streams must not all do.
            assert!(distinct.len() > 1, "different streams take different actions ({start:?})");
        }
    }

    /// A group member taken again after its actor stopped mid-episode continues from its
    /// newest snapshot with its own stream, to the outcome of an uninterrupted run.
    #[test]
    fn an_interrupted_group_member_continues_to_its_uninterrupted_outcome() {
        let mut spec = work_spec(4, 2);
        spec.hyper.work.group_size = 4;
        let item = member_item(2, &Start::Fresh { seed: 5 });
        let (uninterrupted, _) = until_item_episodes(
            &mut work_worker(&spec, std::slice::from_ref(&item), &LocalSnapshotStore::new(100)),
            item.id,
            1,
        );
        let store = LocalSnapshotStore::new(100);
        let first = work_worker(&spec, std::slice::from_ref(&item), &store).collect_segments();
        assert!(first[0].finished_episodes.is_empty(), "cut mid-episode");
        let mut resumed = work_worker(&spec, std::slice::from_ref(&item), &store);
        let (continued, _) = until_item_episodes(&mut resumed, item.id, 1);
        assert_eq!(resumed.counters.episodes_resumed.load(Ordering::Relaxed), 1);
        assert_eq!(continued[0].group, item.group);
        assert_eq!(
            (continued[0].episode_return, continued[0].episode_len),
            (uninterrupted[0].episode_return, uninterrupted[0].episode_len)
        );
    }
}
