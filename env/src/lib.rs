//! `volley-env`: the environments. Depends on no other Volley crate.
//!
//! Environments: the [`Env`] trait, the built-in tasks and a vectorised stepper.
//!
//! Every environment can [`Env::snapshot`] its complete state to bytes and [`Env::restore`] it,
//! including its random-number generator, so a restored environment has an identical future
//! under the same actions. This is the basis of save-load of long episodes.
#![warn(missing_docs)]

pub mod cartpole;
mod frame_stack;
pub mod memory;
pub mod milestones;
pub mod minatar;
pub mod pendulum;
mod service_name;
mod vec_env;

pub use cartpole::CartPole;
pub use frame_stack::{FrameStack, MAX_FRAME_STACK};
pub use memory::{Memory, MemoryConfig};
pub use milestones::{Milestones, MilestonesConfig};
pub use minatar::{MinAtar, MinatarConfig, MinatarGame};
pub use pendulum::Pendulum;
pub use vec_env::{derive_env_seed, FinishedEpisode, VecEnv, VecStep, VectorEnv};

pub use service_name::{EnvServiceName, InvalidServiceName};

/// Errors an environment reports. Messages are lowercase and name the offending value.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum EnvError {
    /// The action index is outside `0..n_actions`.
    #[error("action {action} out of range for {n_actions} actions")]
    ActionOutOfRange {
        /// The action that was given.
        action: usize,
        /// The number of discrete actions.
        n_actions: usize,
    },
    /// A discrete action for a continuous environment, or the other way round.
    #[error("expected a {expected} action")]
    WrongActionKind {
        /// `"discrete"` or `"continuous"`.
        expected: &'static str,
    },
    /// `step` was called on an episode that already ended (reset first).
    #[error("step called after the episode ended; call reset first")]
    EpisodeOver,
    /// A snapshot could not be decoded or belongs to another environment.
    #[error("undecodable snapshot: {0}")]
    BadSnapshot(String),
    /// The environment produced a non-finite observation or reward.
    #[error("non-finite {what} from environment {env}")]
    NonFinite {
        /// `"observation"`, `"reward"` or `"action"`.
        what: &'static str,
        /// The environment's name.
        env: &'static str,
    },
    /// An output buffer has the wrong length.
    #[error("{field}: expected {expected} elements, got {got}")]
    Shape {
        /// Which buffer.
        field: &'static str,
        /// Expected length.
        expected: usize,
        /// Actual length.
        got: usize,
    },
    /// An invalid configuration (e.g. a zero-length task).
    #[error("invalid environment config: {0}")]
    Config(String),
    /// An environment name no build of Volley knows.
    #[error(
        "unknown environment {0:?} (known: cartpole, memory, milestones, pendulum, minatar-asterix, minatar-breakout, \
         minatar-freeway, minatar-seaquest, minatar-space-invaders, remote:<service>)"
    )]
    Unknown(String),
    /// A remote environment (served over NATS, see `volley_transport::envsvc`) failed, timed out or
    /// could not be reached; the episodes it hosted were aborted.
    #[error("remote environment {service}: {message}")]
    Remote {
        /// The environment service's name.
        service: String,
        /// A short, bounded label (see `volley_transport::envsvc::EnvServiceError::reason`).
        reason: &'static str,
        /// What happened.
        message: String,
    },
}

impl EnvError {
    /// A short, bounded label for metrics (`reason` label).
    pub fn reason(&self) -> &'static str {
        match self {
            EnvError::ActionOutOfRange { .. } => "action_out_of_range",
            EnvError::WrongActionKind { .. } => "wrong_action_kind",
            EnvError::EpisodeOver => "episode_over",
            EnvError::BadSnapshot(_) => "bad_snapshot",
            EnvError::NonFinite { .. } => "non_finite",
            EnvError::Shape { .. } => "shape",
            EnvError::Config(_) => "config",
            EnvError::Unknown(_) => "unknown_env",
            EnvError::Remote { reason, .. } => reason,
        }
    }
}

/// The observation space: a flat box of `f32` values with per-dimension bounds
/// (`f32::INFINITY` where unbounded), or an image of whole numbers in `0..=255`.
#[derive(Debug, Clone, PartialEq)]
pub struct ObservationSpace {
    /// Lower bound per dimension.
    pub low: Vec<f32>,
    /// Upper bound per dimension.
    pub high: Vec<f32>,
    /// For an image, its `[C, H, W]` shape (channel-major, so the flat observation is `C·H·W`
    /// values): every value is then a whole number in `0..=255` (a `u8` pixel or plane cell),
    /// which travels as one byte on the wire (segments, and environment protocol version 3).
    pub image: Option<[usize; 3]>,
}

impl ObservationSpace {
    /// A flat vector box with these bounds.
    pub fn vector(low: Vec<f32>, high: Vec<f32>) -> Self {
        ObservationSpace { low, high, image: None }
    }

    /// A `[C, H, W]` image whose values are whole numbers in `0..=max` (`max <= 255`).
    pub fn image(shape: [usize; 3], max: f32) -> Self {
        let dim = shape.iter().product();
        ObservationSpace { low: vec![0.0; dim], high: vec![max.min(255.0); dim], image: Some(shape) }
    }

    /// Number of dimensions.
    pub fn dim(&self) -> usize {
        self.low.len()
    }
}

/// The action space: discrete actions `0..n`, or a box of continuous actions.
#[derive(Debug, Clone, PartialEq)]
pub enum ActionSpace {
    /// `n` discrete actions `0..n`.
    Discrete {
        /// Number of actions.
        n: usize,
    },
    /// Continuous actions: `product(shape)` `f32` values, flat in row-major order of `shape`,
    /// value `i` within `[low[i], high[i]]` (Gymnasium's `Box`).
    Box {
        /// Lower bound per value (finite).
        low: Vec<f32>,
        /// Upper bound per value (finite, `>= low`).
        high: Vec<f32>,
        /// The action's shape (`[dim]` for a vector).
        shape: Vec<usize>,
    },
}

/// What [`ActionSpace::repair`] changed in one continuous action.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ActionRepair {
    /// Values that were NaN or infinite.
    pub non_finite: u32,
    /// Finite values outside `[low, high]`.
    pub out_of_range: u32,
}

impl ActionRepair {
    /// Whether anything was changed.
    pub fn any(&self) -> bool {
        self.non_finite > 0 || self.out_of_range > 0
    }
}

impl ActionSpace {
    /// A one-dimensional box `[low, high]`, checked: equal lengths, at least one value, every
    /// bound finite and `low <= high`.
    pub fn continuous(low: Vec<f32>, high: Vec<f32>) -> Result<Self, EnvError> {
        let dim = low.len();
        if dim == 0 || high.len() != dim {
            return Err(EnvError::Config(format!("box action space: {} low and {} high bounds", dim, high.len())));
        }
        if let Some(i) = (0..dim).find(|&i| !(low[i].is_finite() && high[i].is_finite() && low[i] <= high[i])) {
            return Err(EnvError::Config(format!(
                "box action space: bounds [{}, {}] of value {i} must be finite with low <= high",
                low[i], high[i]
            )));
        }
        Ok(ActionSpace::Box { low, high, shape: vec![dim] })
    }

    /// The number of discrete actions, or `None` for a box.
    pub fn discrete_n(&self) -> Option<usize> {
        match self {
            ActionSpace::Discrete { n } => Some(*n),
            ActionSpace::Box { .. } => None,
        }
    }

    /// Whether actions are continuous.
    pub fn is_continuous(&self) -> bool {
        matches!(self, ActionSpace::Box { .. })
    }

    /// Width of the policy's action head: the number of discrete actions, or the number of
    /// values of a continuous action (the mean of a diagonal Gaussian).
    pub fn n_actions(&self) -> usize {
        match self {
            ActionSpace::Discrete { n } => *n,
            ActionSpace::Box { low, .. } => low.len(),
        }
    }

    /// Make a continuous action valid in place, as documented in docs/SECURITY.md ("bad
    /// actions"): a NaN becomes the middle of its range, an infinite or out-of-range value is
    /// clipped to the nearest bound. Never fails; returns what it changed so callers can count
    /// it. A discrete space or a wrong length changes nothing (the step reports those).
    pub fn repair(&self, action: &mut [f32]) -> ActionRepair {
        let mut repair = ActionRepair::default();
        let ActionSpace::Box { low, high, .. } = self else {
            return repair;
        };
        for ((value, &lo), &hi) in action.iter_mut().zip(low).zip(high) {
            if value.is_nan() {
                repair.non_finite += 1;
                *value = lo + 0.5 * (hi - lo);
            } else if !value.is_finite() {
                repair.non_finite += 1;
                *value = value.clamp(lo, hi);
            } else if *value < lo || *value > hi {
                repair.out_of_range += 1;
                *value = value.clamp(lo, hi);
            }
        }
        repair
    }
}

/// One environment's action for one step.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Action<'a> {
    /// A discrete action index.
    Discrete(usize),
    /// The values of a continuous action.
    Continuous(&'a [f32]),
}

impl<'a> Action<'a> {
    /// The discrete index, checked against `n_actions`.
    #[inline]
    pub fn discrete(self, n_actions: usize) -> Result<usize, EnvError> {
        match self {
            Action::Discrete(action) if action < n_actions => Ok(action),
            Action::Discrete(action) => Err(EnvError::ActionOutOfRange { action, n_actions }),
            Action::Continuous(_) => Err(EnvError::WrongActionKind { expected: "discrete" }),
        }
    }

    /// The continuous values, checked to be `dim` long.
    #[inline]
    pub fn continuous(self, dim: usize) -> Result<&'a [f32], EnvError> {
        match self {
            Action::Continuous(values) if values.len() == dim => Ok(values),
            Action::Continuous(values) => Err(EnvError::Shape { field: "action", expected: dim, got: values.len() }),
            Action::Discrete(_) => Err(EnvError::WrongActionKind { expected: "continuous" }),
        }
    }
}

/// The actions of every environment of a [`VectorEnv`] for one step.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Actions<'a> {
    /// One index per environment, `[n_envs]`.
    Discrete(&'a [usize]),
    /// `dim` values per environment, `[n_envs][dim]`.
    Continuous {
        /// The values.
        values: &'a [f32],
        /// Values per environment.
        dim: usize,
    },
}

impl<'a> Actions<'a> {
    /// Number of environments these actions are for (a continuous batch whose length is not
    /// a multiple of `dim` counts its whole rows only; [`Actions::check`] refuses it).
    pub fn n_envs(&self) -> usize {
        match *self {
            Actions::Discrete(actions) => actions.len(),
            Actions::Continuous { values, dim } => values.len().checked_div(dim).unwrap_or(0),
        }
    }

    /// Refuse a batch for other than `n_envs` environments.
    pub fn check(&self, n_envs: usize) -> Result<(), EnvError> {
        match *self {
            Actions::Discrete(actions) if actions.len() != n_envs => {
                Err(EnvError::Shape { field: "actions", expected: n_envs, got: actions.len() })
            }
            Actions::Continuous { values, dim } if dim == 0 || values.len() != n_envs * dim => {
                Err(EnvError::Shape { field: "actions", expected: n_envs * dim.max(1), got: values.len() })
            }
            _ => Ok(()),
        }
    }

    /// The action of environment `env_idx` (after [`Actions::check`]).
    #[inline]
    pub fn get(&self, env_idx: usize) -> Action<'a> {
        match *self {
            Actions::Discrete(actions) => Action::Discrete(actions[env_idx]),
            Actions::Continuous { values, dim } => Action::Continuous(&values[env_idx * dim..(env_idx + 1) * dim]),
        }
    }
}

/// What one step produced (the observation is written into the caller's buffer).
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct StepOutcome {
    /// Reward for the transition.
    pub reward: f32,
    /// The episode reached a terminal state (no bootstrap).
    pub terminated: bool,
    /// The episode was cut by a time limit (bootstrap from the final observation).
    pub truncated: bool,
}

impl StepOutcome {
    /// The episode ended, by termination or truncation.
    pub fn done(&self) -> bool {
        self.terminated || self.truncated
    }
}

/// A reinforcement-learning environment with a flat `f32` observation and discrete or
/// continuous actions ([`ActionSpace`]).
///
/// Implementations write observations into caller-owned buffers of length
/// `observation_space().dim()` and never allocate per step.
pub trait Env: Send {
    /// A stable, lowercase name (`"cartpole"`).
    fn name(&self) -> &'static str;
    /// The observation space.
    fn observation_space(&self) -> ObservationSpace;
    /// The action space.
    fn action_space(&self) -> ActionSpace;
    /// Start a new episode whose randomness derives from `seed`, writing the first observation.
    fn reset(&mut self, seed: u64, obs: &mut [f32]) -> Result<(), EnvError>;
    /// Start a new episode drawing randomness from the environment's own generator.
    fn reset_next(&mut self, obs: &mut [f32]) -> Result<(), EnvError>;
    /// Apply `action`, write the next observation and return reward and episode flags. An
    /// action of the wrong kind or out of range is an error (a continuous one is clipped by
    /// [`VecEnv`] before it gets here; see [`ActionSpace::repair`]).
    fn step(&mut self, action: Action<'_>, obs: &mut [f32]) -> Result<StepOutcome, EnvError>;
    /// The complete state (dynamics, step counter, random generator) as bytes.
    fn snapshot(&self) -> Vec<u8>;
    /// Restore a state written by [`Env::snapshot`] and write the current observation.
    fn restore(&mut self, bytes: &[u8], obs: &mut [f32]) -> Result<(), EnvError>;
    /// Whether the current state is a natural checkpoint worth saving (save-load). Default: never.
    fn at_milestone(&self) -> bool {
        false
    }
    /// How far the current episode got, environment-defined and comparable across states of
    /// the same task (the scheduler restarts from the furthest). Default: 0.
    fn progress(&self) -> f32 {
        0.0
    }
}

impl<E: Env + ?Sized> Env for Box<E> {
    fn name(&self) -> &'static str {
        (**self).name()
    }
    fn observation_space(&self) -> ObservationSpace {
        (**self).observation_space()
    }
    fn action_space(&self) -> ActionSpace {
        (**self).action_space()
    }
    fn reset(&mut self, seed: u64, obs: &mut [f32]) -> Result<(), EnvError> {
        (**self).reset(seed, obs)
    }
    fn reset_next(&mut self, obs: &mut [f32]) -> Result<(), EnvError> {
        (**self).reset_next(obs)
    }
    fn step(&mut self, action: Action<'_>, obs: &mut [f32]) -> Result<StepOutcome, EnvError> {
        (**self).step(action, obs)
    }
    fn snapshot(&self) -> Vec<u8> {
        (**self).snapshot()
    }
    fn restore(&mut self, bytes: &[u8], obs: &mut [f32]) -> Result<(), EnvError> {
        (**self).restore(bytes, obs)
    }
    fn at_milestone(&self) -> bool {
        (**self).at_milestone()
    }
    fn progress(&self) -> f32 {
        (**self).progress()
    }
}

/// Which environment, with its configuration; what a run spec names.
///
/// In JSON the variant is the `name` field: `{"name":"cartpole"}`,
/// `{"name":"memory","n_cues":2,"delay":6}`, or for an environment served over NATS
/// `{"name":"remote","service":"cartpole-v1","obs_dim":4,"n_actions":2,"reward_threshold":475.0}`.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
#[serde(tag = "name", rename_all = "lowercase")]
pub enum EnvConfig {
    /// Gymnasium CartPole-v1.
    Cartpole,
    /// Recall a cue after a delay (needs memory).
    Memory(MemoryConfig),
    /// A chain of rooms with keys (long horizon, sparse reward).
    Milestones(MilestonesConfig),
    /// Gymnasium Pendulum-v1 (continuous actions).
    Pendulum,
    /// One of the five MinAtar games (Young and Tian 2019), identical to the reference package
    /// for the same seed and actions: `{"name":"minatar","game":"breakout"}`.
    Minatar(MinatarConfig),
    /// An environment served by other processes over NATS (docs/ENV_PROTOCOL.md); actors step
    /// it through `volley_transport::envsvc::RemoteVecEnv`.
    Remote(RemoteEnvConfig),
}

/// A remote environment as a run spec names it: the service, and the spaces its servers
/// declared when the run was created (so the spec validates without the network, and actors
/// can refuse servers that changed).
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct RemoteEnvConfig {
    /// The environment service's name (`volley env-serve --name`, `volley-envs serve --name`).
    pub service: EnvServiceName,
    /// Observation length.
    pub obs_dim: usize,
    /// Number of discrete actions, or for a box action space the number of values of one
    /// action (the width of the policy's head, as [`ActionSpace::n_actions`]).
    pub n_actions: usize,
    /// The bounds of a continuous (box) action space, `n_actions` values each; absent for
    /// discrete actions, so specs written before box actions still parse.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub action_box: Option<RemoteActionBox>,
    /// The mean return at which the environment counts as solved, if its server declares one
    /// (Gymnasium's `spec.reward_threshold`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reward_threshold: Option<f32>,
    /// The largest |reward| of one step its servers declare; the learner rejects segments
    /// beyond it. Undeclared: [`REMOTE_DEFAULT_MAX_ABS_REWARD`] (docs/SECURITY.md).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_abs_reward: Option<f32>,
    /// The episode time limit its servers declare, if any; longer claimed episodes are rejected.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_episode_steps: Option<u64>,
    /// The `[C, H, W]` shape of one served frame when the servers send `u8` images (protocol
    /// version 3); absent for flat vectors. `obs_dim` is then `C·H·W`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub image: Option<[usize; 3]>,
    /// Frames the actor stacks along the channel axis ([`FrameStack`]): the policy sees the
    /// last `frame_stack` frames, `frame_stack·obs_dim` values. 1 (absent): no stacking.
    #[serde(default = "one", skip_serializing_if = "is_one")]
    pub frame_stack: usize,
    /// Whether its servers declared `snapshot: true` (save-load works, so scheduled episodes,
    /// `--work`, can run on it); absent: false.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub snapshot: bool,
    /// What its servers said they run (`"gymnasium:Walker2d-v5"`, `"pendulum"`), at most
    /// [`REMOTE_ENV_LABEL_MAX`] bytes; informative, and it picks the family of training defaults
    /// (a served MuJoCo task trains with MuJoCo's, not Pendulum's). Absent in older specs.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub env: Option<String>,
}

/// The longest declared environment label a run spec keeps ([`RemoteEnvConfig::env`]); a longer
/// one is cut at a character boundary.
pub const REMOTE_ENV_LABEL_MAX: usize = 128;

fn one() -> usize {
    1
}

fn is_one(n: &usize) -> bool {
    *n == 1
}

/// The bounds of a remote environment's box action space (docs/ENV_PROTOCOL.md).
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct RemoteActionBox {
    /// Lower bound per value.
    pub low: Vec<f32>,
    /// Upper bound per value.
    pub high: Vec<f32>,
}

impl RemoteEnvConfig {
    /// A remote environment of `obs_dim` flat observations and `n_actions` discrete actions
    /// (or action values, with `action_box`), with nothing else declared.
    pub fn new(service: EnvServiceName, obs_dim: usize, n_actions: usize) -> Self {
        RemoteEnvConfig {
            service,
            obs_dim,
            n_actions,
            action_box: None,
            reward_threshold: None,
            max_abs_reward: None,
            max_episode_steps: None,
            image: None,
            frame_stack: 1,
            snapshot: false,
            env: None,
        }
    }

    /// `label` as a run spec keeps it in [`RemoteEnvConfig::env`]: at most
    /// [`REMOTE_ENV_LABEL_MAX`] bytes, cut at a character boundary.
    pub fn env_label(label: &str) -> String {
        let mut end = label.len().min(REMOTE_ENV_LABEL_MAX);
        while !label.is_char_boundary(end) {
            end -= 1;
        }
        label[..end].to_string()
    }

    /// The length of the observation the policy sees: `frame_stack` frames of `obs_dim`.
    pub fn policy_obs_dim(&self) -> usize {
        self.obs_dim.saturating_mul(self.frame_stack)
    }

    /// The action space the spec declares, checked (a box needs `n_actions` finite bounds
    /// with `low <= high`).
    pub fn action_space(&self) -> Result<ActionSpace, EnvError> {
        match &self.action_box {
            None => Ok(ActionSpace::Discrete { n: self.n_actions }),
            Some(bounds) => {
                if bounds.low.len() != self.n_actions {
                    return Err(EnvError::Config(format!(
                        "remote environment {}: {} action bounds for {} action values",
                        self.service,
                        bounds.low.len(),
                        self.n_actions
                    )));
                }
                ActionSpace::continuous(bounds.low.clone(), bounds.high.clone())
            }
        }
    }
}

/// The per-step reward bound of a remote environment whose servers declare none.
pub const REMOTE_DEFAULT_MAX_ABS_REWARD: f32 = 1e4;

/// What one step and one episode of an environment can yield at most. The learner rejects a
/// segment whose rewards, truncation values or episode summaries lie outside them, so no
/// actor can claim a return its environment cannot produce (docs/SECURITY.md).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct EnvBounds {
    /// Largest |reward| of one step.
    pub max_abs_reward: f32,
    /// Longest episode in steps, when the environment has a time limit.
    pub max_episode_len: Option<u64>,
}

/// Prefix of a remote environment's name on the command line: `remote:<service>`.
pub const REMOTE_PREFIX: &str = "remote:";

impl EnvConfig {
    /// Parse a built-in name with default configuration. Remote environments are not built
    /// from a name alone (their spaces come from their servers): see [`RemoteEnvConfig`].
    pub fn from_name(name: &str) -> Result<Self, EnvError> {
        match name {
            "cartpole" => Ok(EnvConfig::Cartpole),
            "memory" => Ok(EnvConfig::Memory(MemoryConfig::default())),
            "milestones" => Ok(EnvConfig::Milestones(MilestonesConfig::default())),
            "pendulum" => Ok(EnvConfig::Pendulum),
            other => match MinatarGame::from_env_name(other) {
                Some(game) => Ok(EnvConfig::Minatar(MinatarConfig::new(game))),
                None => Err(EnvError::Unknown(other.to_string())),
            },
        }
    }

    /// The environment's name (`"remote"` for every remote environment).
    pub fn name(&self) -> &'static str {
        match self {
            EnvConfig::Cartpole => "cartpole",
            EnvConfig::Memory(_) => "memory",
            EnvConfig::Milestones(_) => "milestones",
            EnvConfig::Pendulum => "pendulum",
            EnvConfig::Minatar(config) => config.game.env_name(),
            EnvConfig::Remote(_) => "remote",
        }
    }

    /// A name for logs: the built-in name, or `remote:<service>`.
    pub fn describe(&self) -> String {
        match self {
            EnvConfig::Remote(remote) => format!("{REMOTE_PREFIX}{}", remote.service),
            other => other.name().to_string(),
        }
    }

    /// Build one in-process environment. A remote environment needs a NATS connection and is
    /// stepped through `volley_transport::envsvc::RemoteVecEnv`; here it is an [`EnvError::Config`].
    pub fn build(&self) -> Result<Box<dyn Env>, EnvError> {
        Ok(match self {
            EnvConfig::Cartpole => Box::new(CartPole::new()),
            EnvConfig::Memory(config) => Box::new(Memory::new(config.clone())?),
            EnvConfig::Milestones(config) => Box::new(Milestones::new(config.clone())?),
            EnvConfig::Pendulum => Box::new(Pendulum::new()),
            EnvConfig::Minatar(config) => config.build()?,
            EnvConfig::Remote(remote) => {
                return Err(EnvError::Config(format!(
                    "remote environment {} is served over nats; step it with envsvc::RemoteVecEnv",
                    remote.service
                )))
            }
        })
    }

    /// The reward and episode-length bounds of this environment: exact for the built-in ones,
    /// declared by the servers (or the defaults) for a remote one.
    pub fn bounds(&self) -> EnvBounds {
        match self {
            EnvConfig::Cartpole => {
                EnvBounds { max_abs_reward: 1.0, max_episode_len: Some(cartpole::MAX_EPISODE_STEPS as u64) }
            }
            // The cue, `delay` blank steps and the query: the episode ends at the query.
            EnvConfig::Memory(config) => {
                EnvBounds { max_abs_reward: 1.0, max_episode_len: Some(config.delay as u64 + 2) }
            }
            EnvConfig::Milestones(config) => {
                EnvBounds { max_abs_reward: 1.0, max_episode_len: Some(config.max_steps as u64) }
            }
            EnvConfig::Pendulum => EnvBounds {
                max_abs_reward: pendulum::MAX_COST as f32 * (1.0 + f32::EPSILON),
                max_episode_len: Some(pendulum::MAX_EPISODE_STEPS as u64),
            },
            EnvConfig::Minatar(config) => EnvBounds {
                max_abs_reward: config.game.max_step_reward(),
                max_episode_len: config.game.max_episode_steps(),
            },
            EnvConfig::Remote(remote) => EnvBounds {
                max_abs_reward: remote
                    .max_abs_reward
                    .filter(|bound| bound.is_finite() && *bound > 0.0)
                    .unwrap_or(REMOTE_DEFAULT_MAX_ABS_REWARD),
                max_episode_len: remote.max_episode_steps.filter(|&steps| steps > 0),
            },
        }
    }

    /// Observation length and number of actions, without the network: built-in environments
    /// are built to ask them, remote ones declare them in the spec.
    pub fn spaces(&self) -> Result<(usize, usize), EnvError> {
        match self {
            EnvConfig::Remote(remote) => {
                if remote.obs_dim == 0 || remote.n_actions == 0 {
                    return Err(EnvError::Config(format!(
                        "remote environment {}: obs_dim {} and n_actions {} must be at least 1",
                        remote.service, remote.obs_dim, remote.n_actions
                    )));
                }
                remote.action_space()?;
                if remote.frame_stack == 0 || remote.frame_stack > MAX_FRAME_STACK {
                    return Err(EnvError::Config(format!(
                        "remote environment {}: frame_stack {} out of range 1..={MAX_FRAME_STACK}",
                        remote.service, remote.frame_stack
                    )));
                }
                if let Some(shape) = remote.image {
                    if shape.iter().product::<usize>() != remote.obs_dim || shape[0] == 0 {
                        return Err(EnvError::Config(format!(
                            "remote environment {}: image shape {shape:?} for obs_dim {}",
                            remote.service, remote.obs_dim
                        )));
                    }
                }
                Ok((remote.policy_obs_dim(), remote.n_actions))
            }
            builtin => {
                let env = builtin.build()?;
                Ok((env.observation_space().dim(), env.action_space().n_actions()))
            }
        }
    }

    /// The observation's image shape `[C, H, W]` (channel-major, so `C·H·W` is the
    /// observation length) for environments whose observations are images, else `None`. For a
    /// remote environment with frame stacking, the stacked shape the policy sees.
    pub fn image_shape(&self) -> Option<[usize; 3]> {
        match self {
            // Stacked frames are more channels.
            EnvConfig::Remote(remote) => {
                remote.image.map(|[channels, height, width]| [channels * remote.frame_stack, height, width])
            }
            // Declared by the environment (its observation space): MinAtar's planes.
            builtin => builtin.build().ok()?.observation_space().image,
        }
    }
}

/// Leading bytes of every environment snapshot: magic, then the snapshot format version.
const SNAPSHOT_MAGIC: [u8; 4] = *b"VLYS";
/// Version of the snapshot framing; bump it when a snapshot state struct changes.
const SNAPSHOT_FORMAT_VERSION: u8 = 1;
/// Upper bound on a snapshot body that `decode_snapshot` accepts (bincode decode limit).
const MAX_SNAPSHOT_BODY_BYTES: usize = 4096;

/// Frame `state` as a snapshot of environment `env_name`:
/// `b"VLYS"`, format version, name length, name bytes, then the bincode (standard config) body.
pub(crate) fn encode_snapshot<T: serde::Serialize>(env_name: &'static str, state: &T) -> Vec<u8> {
    let body =
        bincode::serde::encode_to_vec(state, bincode::config::standard()).expect("plain state structs always encode");
    let name_len = u8::try_from(env_name.len()).expect("environment names are short");
    let mut bytes = Vec::with_capacity(SNAPSHOT_MAGIC.len() + 2 + env_name.len() + body.len());
    bytes.extend_from_slice(&SNAPSHOT_MAGIC);
    bytes.push(SNAPSHOT_FORMAT_VERSION);
    bytes.push(name_len);
    bytes.extend_from_slice(env_name.as_bytes());
    bytes.extend_from_slice(&body);
    bytes
}

/// Decode a snapshot written by [`encode_snapshot`] for `env_name`. Untrusted input: every
/// failure (wrong magic, version or environment, truncated or trailing bytes, oversized body) is
/// an [`EnvError::BadSnapshot`], never a panic. The caller still validates the decoded values.
pub(crate) fn decode_snapshot<T: serde::de::DeserializeOwned>(
    env_name: &'static str,
    bytes: &[u8],
) -> Result<T, EnvError> {
    let header_len = SNAPSHOT_MAGIC.len() + 2;
    if bytes.len() < header_len || bytes[..SNAPSHOT_MAGIC.len()] != SNAPSHOT_MAGIC {
        return Err(EnvError::BadSnapshot("missing snapshot magic".to_string()));
    }
    let version = bytes[SNAPSHOT_MAGIC.len()];
    if version != SNAPSHOT_FORMAT_VERSION {
        return Err(EnvError::BadSnapshot(format!(
            "snapshot format version {version}, expected {SNAPSHOT_FORMAT_VERSION}"
        )));
    }
    let name_len = usize::from(bytes[SNAPSHOT_MAGIC.len() + 1]);
    let name = bytes
        .get(header_len..header_len + name_len)
        .ok_or_else(|| EnvError::BadSnapshot("truncated snapshot header".to_string()))?;
    if name != env_name.as_bytes() {
        return Err(EnvError::BadSnapshot(format!(
            "snapshot of environment {:?}, expected {env_name:?}",
            String::from_utf8_lossy(name)
        )));
    }
    let body = &bytes[header_len + name_len..];
    let config = bincode::config::standard().with_limit::<MAX_SNAPSHOT_BODY_BYTES>();
    let (state, used) = bincode::serde::decode_from_slice::<T, _>(body, config)
        .map_err(|err| EnvError::BadSnapshot(format!("{env_name} snapshot body: {err}")))?;
    if used != body.len() {
        return Err(EnvError::BadSnapshot(format!("{} trailing bytes after {env_name} snapshot", body.len() - used)));
    }
    Ok(state)
}

/// The error for an observation buffer of the wrong length.
#[cold]
pub(crate) fn obs_shape_error(expected: usize, got: usize) -> EnvError {
    EnvError::Shape { field: "obs", expected, got }
}

/// Helpers shared by the environments' property tests.
#[cfg(test)]
pub(crate) mod testing {
    use super::{Action, Env};

    /// Everything one step produced, as bits, so comparisons are exact (NaN-safe).
    #[derive(Debug, Clone, PartialEq, Eq)]
    pub(crate) struct StepRecord {
        pub(crate) obs_bits: Vec<u32>,
        pub(crate) reward_bits: u32,
        pub(crate) terminated: bool,
        pub(crate) truncated: bool,
    }

    /// Step `env` with `actions`, starting a new episode with `reset_next` whenever one ends,
    /// and record every step (the recorded observation is the one before any auto-reset,
    /// followed by the reset observation as an extra record).
    pub(crate) fn run_with_auto_reset<E: Env>(env: &mut E, actions: &[usize]) -> Vec<StepRecord> {
        let dim = env.observation_space().dim();
        let mut obs = vec![0.0f32; dim];
        let mut records = Vec::with_capacity(actions.len() * 2);
        for &action in actions {
            let outcome = env.step(Action::Discrete(action), &mut obs).expect("in-range action on a live episode");
            records.push(StepRecord {
                obs_bits: obs.iter().map(|v| v.to_bits()).collect(),
                reward_bits: outcome.reward.to_bits(),
                terminated: outcome.terminated,
                truncated: outcome.truncated,
            });
            if outcome.done() {
                env.reset_next(&mut obs).expect("reset_next succeeds");
                records.push(StepRecord {
                    obs_bits: obs.iter().map(|v| v.to_bits()).collect(),
                    reward_bits: 0,
                    terminated: false,
                    truncated: false,
                });
            }
        }
        records
    }

    /// Reset `env` with `seed`, run `prefix`, snapshot, run `suffix`; then restore the snapshot
    /// into `fresh` and run `suffix` again. Returns both suffix records and the observations
    /// written by the snapshot-time state and by `restore`, which must all agree.
    pub(crate) fn replay_after_restore<E: Env>(
        env: &mut E,
        fresh: &mut E,
        seed: u64,
        prefix: &[usize],
        suffix: &[usize],
    ) -> (Vec<StepRecord>, Vec<StepRecord>, Vec<u32>, Vec<u32>) {
        let dim = env.observation_space().dim();
        let mut obs = vec![0.0f32; dim];
        env.reset(seed, &mut obs).expect("reset succeeds");
        let prefix_records = run_with_auto_reset(env, prefix);
        let obs_at_snapshot = prefix_records
            .last()
            .map(|record| record.obs_bits.clone())
            .unwrap_or_else(|| obs.iter().map(|v| v.to_bits()).collect());
        let bytes = env.snapshot();
        let original = run_with_auto_reset(env, suffix);
        let mut restored_obs = vec![f32::NAN; dim];
        fresh.restore(&bytes, &mut restored_obs).expect("own snapshot restores");
        let restored_obs_bits = restored_obs.iter().map(|v| v.to_bits()).collect();
        let replayed = run_with_auto_reset(fresh, suffix);
        (original, replayed, obs_at_snapshot, restored_obs_bits)
    }

    /// Reset `env` with `seed`, snapshot it, overwrite the byte at `flip_idx` with `flip_value`,
    /// and restore that into `target`; when it is accepted, step `actions` through it (a new
    /// episode wherever a step fails). A corrupted snapshot must be refused or give a state the
    /// dynamics accept: nothing here may panic.
    pub(crate) fn restore_corrupted_snapshot<E: Env>(
        env: &mut E,
        target: &mut E,
        seed: u64,
        flip_idx: proptest::sample::Index,
        flip_value: u8,
        actions: &[usize],
    ) {
        let mut obs = vec![0.0f32; env.observation_space().dim()];
        env.reset(seed, &mut obs).expect("reset succeeds");
        let mut bytes = env.snapshot();
        let idx = flip_idx.index(bytes.len());
        bytes[idx] = flip_value;
        if target.restore(&bytes, &mut obs).is_ok() {
            for &action in actions {
                if target.step(Action::Discrete(action), &mut obs).is_err() {
                    target.reset_next(&mut obs).expect("reset after a restored episode");
                }
            }
        }
    }
}

#[cfg(test)]
mod remote_tests {
    use super::{EnvServiceName, RemoteEnvConfig, REMOTE_ENV_LABEL_MAX};

    /// A server's label is kept whole when short, cut to at most `REMOTE_ENV_LABEL_MAX` bytes at
    /// a character boundary when long, and a spec without it (written before it existed) parses.
    #[test]
    fn a_declared_label_is_bounded_and_optional_in_specs() {
        assert_eq!(RemoteEnvConfig::env_label("gymnasium:Walker2d-v5"), "gymnasium:Walker2d-v5");
        for long in ["x".repeat(10_000), "é".repeat(1_000)] {
            let kept = RemoteEnvConfig::env_label(&long);
            assert!(kept.len() <= REMOTE_ENV_LABEL_MAX && kept.len() >= REMOTE_ENV_LABEL_MAX - 3, "{}", kept.len());
            assert!(long.starts_with(&kept));
        }
        let old = r#"{"service": "pendulum-v1", "obs_dim": 3, "n_actions": 1}"#;
        let parsed: RemoteEnvConfig = serde_json::from_str(old).expect("an older spec parses");
        assert_eq!(parsed.env, None);
        let service = EnvServiceName::new("walker").expect("valid");
        let labelled =
            RemoteEnvConfig { env: Some("gymnasium:Walker2d-v5".into()), ..RemoteEnvConfig::new(service, 17, 6) };
        let json = serde_json::to_string(&labelled).expect("serialises");
        assert_eq!(serde_json::from_str::<RemoteEnvConfig>(&json).expect("round trip"), labelled);
    }
}
