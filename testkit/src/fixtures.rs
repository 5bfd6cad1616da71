//! Fixtures: run specs and trajectory segments built from a few named choices, so a test
//! states only what it is about.
//!
//! ```
//! use volley_testkit::fixtures::{SegmentBuilder, SpecBuilder};
//!
//! let spec = SpecBuilder::cartpole(8).run("trust").build();
//! let segment = SegmentBuilder::for_spec(&spec).actor("actor-3").version(3).terminal_at(7).episode(8.0, 8).build();
//! assert_eq!(segment.len(), 8);
//! let layout = spec.validate().expect("a valid spec");
//! segment.validate(&spec, layout.hash(), 0).expect("a spec-valid segment");
//! ```

use volley_core::ids::{ActorId, PolicyVersion, RunId};
use volley_core::spec::{HyperParams, LossKind, RunSpec};
use volley_core::wire::{EpisodeSummary, Observations, TrajectorySegment};
use volley_core::work::SnapshotInfo;
use volley_env::EnvConfig;
use volley_policy::{ActionHead, Activation, CoreKind, ParamLayout, PolicySpec};

/// Builds a [`RunSpec`]; starts from [`SpecBuilder::cartpole`].
#[derive(Debug, Clone)]
pub struct SpecBuilder {
    spec: RunSpec,
}

impl SpecBuilder {
    /// `policy` on `env`, `segment_len` steps per segment, default hyper-parameters, seed 0, run
    /// `test`.
    pub fn new(env: EnvConfig, policy: PolicySpec, segment_len: usize) -> Self {
        let run = RunId::new("test").expect("a valid run id");
        SpecBuilder { spec: RunSpec { run, env, policy, segment_len, hyper: HyperParams::default(), seed: 0 } }
    }

    /// CartPole (4 observations, 2 actions) with an 8-unit tanh MLP, `segment_len` steps per
    /// segment, default hyper-parameters, seed 0, run `test`.
    pub fn cartpole(segment_len: usize) -> Self {
        Self::new(EnvConfig::Cartpole, PolicySpec::mlp(4, 2, &[8], Activation::Tanh), segment_len)
    }

    /// Pendulum (3 observations, one continuous action) with an unsquashed Gaussian head on an
    /// 8-unit tanh MLP, `segment_len` steps per segment, default hyper-parameters.
    pub fn pendulum(segment_len: usize) -> Self {
        Self::cartpole(segment_len).env(EnvConfig::Pendulum, 3, 1).head(ActionHead::Gaussian { squash: false })
    }

    /// The run's name.
    ///
    /// # Panics
    /// If `name` is not a valid [`RunId`].
    pub fn run(mut self, name: &str) -> Self {
        self.spec.run = RunId::new(name).expect("a valid run id");
        self
    }

    /// The policy's action head.
    pub fn head(mut self, head: ActionHead) -> Self {
        self.spec.policy.head = head;
        self
    }

    /// Observation normalisation on or off.
    pub fn normalize_obs(mut self, on: bool) -> Self {
        self.spec.policy.normalize_obs = on;
        self
    }

    /// Another environment, with its observation width and number of actions.
    pub fn env(mut self, env: EnvConfig, obs_dim: usize, n_actions: usize) -> Self {
        self.spec.env = env;
        self.spec.policy.obs_dim = obs_dim;
        self.spec.policy.n_actions = n_actions;
        self
    }

    /// Hidden layer widths of the torso.
    pub fn torso(mut self, torso: Vec<usize>) -> Self {
        self.spec.policy.torso = torso;
        self
    }

    /// The recurrent core (or MLP).
    pub fn core(mut self, core: CoreKind) -> Self {
        self.spec.policy.core = core;
        self
    }

    /// The torso's activation.
    pub fn activation(mut self, activation: Activation) -> Self {
        self.spec.policy.activation = activation;
        self
    }

    /// Training with `loss` on batches of `batch_segments` segments at the constant learning
    /// rate `learning_rate`; the other hyper-parameters stay.
    pub fn training(mut self, loss: LossKind, batch_segments: usize, learning_rate: f32) -> Self {
        let hyper = &mut self.spec.hyper;
        (hyper.loss, hyper.batch_segments) = (loss, batch_segments);
        (hyper.learning_rate, hyper.final_learning_rate) = (learning_rate, learning_rate);
        self
    }

    /// PPO's passes over each batch and minibatches per pass.
    pub fn ppo(mut self, epochs: u32, minibatches: u32) -> Self {
        (self.spec.hyper.ppo_epochs, self.spec.hyper.ppo_minibatches) = (epochs, minibatches);
        self
    }

    /// Hyper-parameters.
    pub fn hyper(mut self, hyper: HyperParams) -> Self {
        self.spec.hyper = hyper;
        self
    }

    /// The run's seed.
    pub fn seed(mut self, seed: u64) -> Self {
        self.spec.seed = seed;
        self
    }

    /// The spec (not validated: tests of validation build invalid ones on purpose).
    pub fn build(self) -> RunSpec {
        self.spec
    }
}

/// Builds a [`TrajectorySegment`]; starts from [`SegmentBuilder::new`],
/// [`SegmentBuilder::cartpole`] or [`SegmentBuilder::for_spec`].
///
/// Setters of per-step fields check their length against the segment's, so a fixture cannot
/// be malformed by accident (set a field on the built segment to make one on purpose).
#[derive(Debug, Clone)]
pub struct SegmentBuilder {
    segment: TrajectorySegment,
}

impl SegmentBuilder {
    /// `t_len` steps with `obs_dim` observations each: zero observations, action 0, reward 1
    /// and log-probability ln ½ at every step, no episode end, no recurrent state; run `test`,
    /// actor `actor-0`, incarnation 0, environment 0, segment 0, policy version 0, layout hash 0.
    pub fn new(t_len: usize, obs_dim: usize) -> Self {
        SegmentBuilder {
            segment: TrajectorySegment {
                run: RunId::new("test").expect("a valid run id"),
                actor: ActorId::new("actor-0").expect("a valid actor id"),
                incarnation: 0,
                env_idx: 0,
                episode_id: 0,
                segment_idx: 0,
                task_id: 0,
                start_snapshot: None,
                policy_version: PolicyVersion(0),
                layout_hash: 0,
                obs_dim: obs_dim as u32,
                observations: Observations::F32(vec![0.0; (t_len + 1) * obs_dim]),
                actions: vec![0; t_len],
                continuous_actions: Vec::new(),
                rewards: vec![1.0; t_len],
                terminated: vec![0; t_len],
                truncated: vec![0; t_len],
                behaviour_log_probs: vec![-std::f32::consts::LN_2; t_len],
                truncation_values: vec![0.0; t_len],
                initial_hidden: Vec::new(),
                restored_states: Vec::new(),
                finished_episodes: Vec::new(),
                saved_snapshots: Vec::new(),
                episode_groups: Vec::new(),
            },
        }
    }

    /// [`SegmentBuilder::new`] with CartPole's 4 observations.
    pub fn cartpole(t_len: usize) -> Self {
        Self::new(t_len, 4)
    }

    /// A segment that `spec` accepts: its run, segment length, observation width, layout
    /// hash and (zero) recurrent state size.
    ///
    /// # Panics
    /// If the spec's policy has no valid layout.
    pub fn for_spec(spec: &RunSpec) -> Self {
        let layout = ParamLayout::new(&spec.policy).expect("a valid policy spec");
        let mut builder = Self::new(spec.segment_len, spec.policy.obs_dim);
        builder.segment.run = spec.run.clone();
        builder.segment.layout_hash = layout.hash();
        builder.segment.initial_hidden = vec![0.0; layout.recurrent_size()];
        if spec.policy.head.is_continuous() {
            builder.segment.actions.clear();
            builder.segment.continuous_actions = vec![0.0; spec.segment_len * spec.policy.n_actions];
        }
        builder
    }

    /// The run's name.
    ///
    /// # Panics
    /// If `name` is not a valid [`RunId`].
    pub fn run(mut self, name: &str) -> Self {
        self.segment.run = RunId::new(name).expect("a valid run id");
        self
    }

    /// The actor's name.
    ///
    /// # Panics
    /// If `name` is not a valid [`ActorId`].
    pub fn actor(mut self, name: &str) -> Self {
        self.segment.actor = ActorId::new(name).expect("a valid actor id");
        self
    }

    /// The actor's incarnation.
    pub fn incarnation(mut self, incarnation: u64) -> Self {
        self.segment.incarnation = incarnation;
        self
    }

    /// The environment stream.
    pub fn env_idx(mut self, env_idx: u32) -> Self {
        self.segment.env_idx = env_idx;
        self
    }

    /// The episode counter at the first step.
    pub fn episode_id(mut self, episode_id: u64) -> Self {
        self.segment.episode_id = episode_id;
        self
    }

    /// The index within the stream.
    pub fn segment_idx(mut self, segment_idx: u64) -> Self {
        self.segment.segment_idx = segment_idx;
        self
    }

    /// The task served.
    pub fn task_id(mut self, task_id: u32) -> Self {
        self.segment.task_id = task_id;
        self
    }

    /// The snapshot the episode at the first step started from.
    pub fn start_snapshot(mut self, key: Option<&str>) -> Self {
        self.segment.start_snapshot = key.map(str::to_owned);
        self
    }

    /// The behaviour policy version.
    pub fn version(mut self, version: u64) -> Self {
        self.segment.policy_version = PolicyVersion(version);
        self
    }

    /// The behaviour policy's layout hash.
    pub fn layout_hash(mut self, layout_hash: u64) -> Self {
        self.segment.layout_hash = layout_hash;
        self
    }

    /// Observations `[T + 1][obs_dim]`, element `i` from `value(i)`.
    pub fn observations_from(mut self, value: impl FnMut(usize) -> f32) -> Self {
        let n = self.segment.observations.len();
        self.segment.observations = Observations::F32((0..n).map(value).collect());
        self
    }

    /// Image observations (one byte per value) `[T + 1][obs_dim]`, element `i` from `value(i)`.
    pub fn frames_from(mut self, value: impl FnMut(usize) -> u8) -> Self {
        let n = self.segment.observations.len();
        self.segment.observations = Observations::U8((0..n).map(value).collect());
        self
    }

    /// Actions, one per step.
    pub fn actions(mut self, actions: Vec<u32>) -> Self {
        self.check_steps("actions", actions.len());
        self.segment.actions = actions;
        self
    }

    /// Continuous actions, `[T][action_dim]` (the segment's discrete actions are removed).
    pub fn continuous_actions(mut self, values: Vec<f32>) -> Self {
        let steps = self.segment.rewards.len();
        assert!(
            steps > 0 && values.len().is_multiple_of(steps),
            "continuous actions: {} values for {steps} steps",
            values.len()
        );
        self.segment.actions.clear();
        self.segment.continuous_actions = values;
        self
    }

    /// Continuous actions `[T][action_dim]` of a segment that has them (from
    /// [`SegmentBuilder::for_spec`] with a continuous head), element `i` from `value(i)`.
    ///
    /// # Panics
    /// If the segment has no continuous actions.
    pub fn continuous_actions_from(mut self, value: impl FnMut(usize) -> f32) -> Self {
        let n = self.segment.continuous_actions.len();
        assert!(n > 0, "continuous_actions_from: the segment has no continuous actions");
        self.segment.continuous_actions = (0..n).map(value).collect();
        self
    }

    /// Rewards, one per step.
    pub fn rewards(mut self, rewards: Vec<f32>) -> Self {
        self.check_steps("rewards", rewards.len());
        self.segment.rewards = rewards;
        self
    }

    /// The same reward at every step.
    pub fn reward(mut self, reward: f32) -> Self {
        self.segment.rewards.fill(reward);
        self
    }

    /// Terminal flags, one per step.
    pub fn terminated(mut self, terminated: Vec<u8>) -> Self {
        self.check_steps("terminated", terminated.len());
        self.segment.terminated = terminated;
        self
    }

    /// An episode terminates at `step`.
    ///
    /// # Panics
    /// If `step` is not a step of the segment.
    pub fn terminal_at(mut self, step: usize) -> Self {
        self.segment.terminated[step] = 1;
        self
    }

    /// Behaviour log-probabilities, one per step.
    pub fn log_probs(mut self, log_probs: Vec<f32>) -> Self {
        self.check_steps("behaviour_log_probs", log_probs.len());
        self.segment.behaviour_log_probs = log_probs;
        self
    }

    /// The same behaviour log-probability at every step.
    pub fn log_prob(mut self, log_prob: f32) -> Self {
        self.segment.behaviour_log_probs.fill(log_prob);
        self
    }

    /// The recurrent state before step 0.
    pub fn initial_hidden(mut self, hidden: Vec<f32>) -> Self {
        self.segment.initial_hidden = hidden;
        self
    }

    /// One more finished episode with this return and length.
    pub fn episode(mut self, episode_return: f32, episode_len: u32) -> Self {
        self.segment.finished_episodes.push(EpisodeSummary {
            episode_return,
            episode_len,
            ..EpisodeSummary::default()
        });
        self
    }

    /// The group of each episode piece ([`TrajectorySegment::episode_groups`]).
    pub fn episode_groups(mut self, groups: Vec<Option<volley_core::work::GroupMember>>) -> Self {
        self.segment.episode_groups = groups;
        self
    }

    /// The finished episodes.
    pub fn finished_episodes(mut self, episodes: Vec<EpisodeSummary>) -> Self {
        self.segment.finished_episodes = episodes;
        self
    }

    /// The snapshots saved during the segment.
    pub fn saved_snapshots(mut self, snapshots: Vec<SnapshotInfo>) -> Self {
        self.segment.saved_snapshots = snapshots;
        self
    }

    /// The segment.
    pub fn build(self) -> TrajectorySegment {
        self.segment
    }

    fn check_steps(&self, field: &str, got: usize) {
        let expected = self.segment.rewards.len();
        assert_eq!(got, expected, "{field}: a segment of {expected} steps needs {expected} values");
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_segment_for_a_spec_passes_its_validation() {
        let spec = SpecBuilder::cartpole(6).core(CoreKind::Gru { hidden: 5 }).build();
        let layout = spec.validate().expect("a valid spec");
        let segment = SegmentBuilder::for_spec(&spec).terminal_at(5).episode(6.0, 6).build();
        segment.validate(&spec, layout.hash(), 5).expect("spec-valid");
        assert_eq!(segment.initial_hidden, vec![0.0; 5]);
    }

    #[test]
    #[should_panic(expected = "rewards: a segment of 4 steps needs 4 values")]
    fn a_per_step_field_of_the_wrong_length_is_refused() {
        let _ = SegmentBuilder::cartpole(4).rewards(vec![1.0; 3]);
    }
}
