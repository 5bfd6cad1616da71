//! Command-line arguments, validated once into the types the rest of the code trusts.

use std::path::PathBuf;
use std::time::Duration;

use anyhow::{bail, Context};
use clap::{Args, Parser, Subcommand, ValueEnum};
use volley_core::ids::RunId;
use volley_core::spec::{
    Baseline, BpttConfig, HyperParams, LossKind, PriorityConfig, RunSpec, SelectionConfig, TrustConfig,
    ZeroVarianceConfig,
};
use volley_core::work::{BudgetPolicy, WorkConfig};
use volley_env::{
    EnvConfig, MemoryConfig, MilestonesConfig, MinatarConfig, MinatarGame, RemoteEnvConfig, REMOTE_PREFIX,
};
use volley_learner::backend::BackendKind;
use volley_learner::Checkpoint;
use volley_policy::{ActionHead, Activation, ConvInput, ConvSpec, CoreKind, PolicySpec};
use volley_transport::envsvc::EnvServiceName;
use volley_transport::nats::{NatsAuth, NatsConfig};

/// Volley: a distributed actor-learner system for reinforcement learning.
#[derive(Debug, Parser)]
#[command(name = "volley", version, about, mut_subcommands = negative_numbers_are_values)]
pub struct Cli {
    /// What to do.
    #[command(subcommand)]
    pub command: Command,
}

/// Every flag of `command` that takes a value also takes a negative number as its value:
/// `--target-return -250` reads as the flag and its value, not as an unknown flag `-2`
/// (issue 48). The value's own parser then accepts it or names the flag in its error; no flag
/// of `volley` is a short option, so a leading `-` and a digit can mean nothing else.
fn negative_numbers_are_values(command: clap::Command) -> clap::Command {
    command.mut_args(|arg| if arg.get_action().takes_values() { arg.allow_negative_numbers(true) } else { arg })
}

/// Subcommands.
#[derive(Debug, Subcommand)]
pub enum Command {
    /// Train in one process: a learner and several actor threads on the embedded bus.
    Train(TrainArgs),
    /// Run the learner of a distributed run over NATS.
    Learner(LearnerArgs),
    /// Run an actor that joins a run over NATS.
    Actor(ActorArgs),
    /// Measure weight-broadcast latency over NATS: publish to N follower processes.
    BenchWeights(BenchWeightsArgs),
    /// Serve a built-in environment over NATS (docs/ENV_PROTOCOL.md), for actors started with
    /// `--env remote:<name>`.
    EnvServe(EnvServeArgs),
}

/// Which built-in environment.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum EnvName {
    /// Gymnasium CartPole-v1.
    Cartpole,
    /// Recall a cue after a delay (needs --core gru).
    Memory,
    /// Chain of rooms with keys (long horizon, sparse reward).
    Milestones,
    /// Gymnasium Pendulum-v1 (continuous actions, Gaussian head).
    Pendulum,
    /// MinAtar Asterix (10×10×4 image, flattened for the MLP).
    #[value(name = "minatar-asterix")]
    MinatarAsterix,
    /// MinAtar Breakout (10×10×4 image, flattened for the MLP).
    #[value(name = "minatar-breakout")]
    MinatarBreakout,
    /// MinAtar Freeway (10×10×7 image, flattened for the MLP).
    #[value(name = "minatar-freeway")]
    MinatarFreeway,
    /// MinAtar Seaquest (10×10×10 image, flattened for the MLP).
    #[value(name = "minatar-seaquest")]
    MinatarSeaquest,
    /// MinAtar Space Invaders (10×10×6 image, flattened for the MLP).
    #[value(name = "minatar-space-invaders")]
    MinatarSpaceInvaders,
}

impl EnvName {
    /// The environment's name (`"cartpole"`).
    pub fn as_str(self) -> &'static str {
        match self {
            EnvName::Cartpole => "cartpole",
            EnvName::Memory => "memory",
            EnvName::Milestones => "milestones",
            EnvName::Pendulum => "pendulum",
            EnvName::MinatarAsterix => MinatarGame::Asterix.env_name(),
            EnvName::MinatarBreakout => MinatarGame::Breakout.env_name(),
            EnvName::MinatarFreeway => MinatarGame::Freeway.env_name(),
            EnvName::MinatarSeaquest => MinatarGame::Seaquest.env_name(),
            EnvName::MinatarSpaceInvaders => MinatarGame::SpaceInvaders.env_name(),
        }
    }
}

/// An environment on the command line: a built-in one, or `remote:<service>` (served over
/// NATS by `volley env-serve` or the Python `volley-envs` package).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum EnvChoice {
    /// A built-in environment, stepped in the actor's process.
    Builtin(EnvName),
    /// An environment service.
    Remote(EnvServiceName),
}

/// Parse `--env`: `cartpole`, `memory`, `milestones`, `minatar-<game>` or `remote:<service>`.
pub fn parse_env_choice(text: &str) -> Result<EnvChoice, String> {
    if let Some(service) = text.strip_prefix(REMOTE_PREFIX) {
        return EnvServiceName::new(service).map(EnvChoice::Remote).map_err(|err| err.to_string());
    }
    EnvName::from_str(text, true).map(EnvChoice::Builtin).map_err(|_| {
        format!(
            "unknown environment {text:?} (expected cartpole, memory, milestones, pendulum, minatar-asterix, \
             minatar-breakout, minatar-freeway, minatar-seaquest, minatar-space-invaders or remote:<service>)"
        )
    })
}

/// The recurrent core.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum CoreName {
    /// Feed-forward only.
    Mlp,
    /// A GRU after the MLP torso.
    Gru,
}

/// The convolutional torso in front of the dense torso (image observations only).
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum ConvName {
    /// No conv torso: the observation feeds the dense torso as a vector.
    None,
    /// The MinAtar network: one 3×3 conv with 16 filters (use with --torso 128).
    Minatar,
    /// The Nature-DQN / IMPALA-shallow network: 32 8×8/4, 64 4×4/2, 64 3×3/1 (use with --torso 512).
    Nature,
}

/// Torso activation.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum ActivationName {
    /// tanh.
    Tanh,
    /// ReLU.
    Relu,
}

/// The loss.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum LossName {
    /// IMPALA V-trace actor-critic.
    Vtrace,
    /// PPO-clip with behaviour importance weights.
    Ppo,
}

/// Where the learner's update runs (`--backend`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum BackendName {
    /// CUDA when a GPU works, otherwise the CPU (a warning only if a GPU is there but fails).
    Auto,
    /// The CPU backend (one thread).
    Cpu,
    /// CUDA; fail if no GPU works.
    Cuda,
}

impl From<BackendName> for BackendKind {
    fn from(name: BackendName) -> Self {
        match name {
            BackendName::Auto => BackendKind::Auto,
            BackendName::Cpu => BackendKind::Cpu,
            BackendName::Cuda => BackendKind::Cuda,
        }
    }
}

/// When to draw a progress bar.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum ProgressMode {
    /// A bar on a terminal, log lines otherwise.
    Auto,
    /// Always log lines.
    Lines,
    /// Nothing but the summary.
    Quiet,
}

/// Flags that define the run spec (shared by `volley train` and `volley learner`).
#[derive(Debug, Clone, Args)]
pub struct SpecArgs {
    /// Environment: cartpole, memory, milestones, pendulum (continuous actions), minatar-GAME
    /// (asterix, breakout, freeway, seaquest, space-invaders), or remote:SERVICE for one served
    /// over NATS (docs/ENV_PROTOCOL.md; `volley learner` asks its servers for the spaces).
    #[arg(long, default_value = "cartpole", env = "VOLLEY_ENV", value_parser = parse_env_choice)]
    pub env: EnvChoice,
    /// Run name ([a-z0-9-]{1,16}).
    #[arg(long, default_value = "local", env = "VOLLEY_RUN")]
    pub run: String,
    /// Base seed of the run.
    #[arg(long, default_value_t = 1, env = "VOLLEY_SEED")]
    pub seed: u64,
    /// Steps per segment (T) [default: 32; pendulum: 64].
    #[arg(long, env = "VOLLEY_SEGMENT_LEN")]
    pub segment_len: Option<usize>,
    /// Segments per learner batch (B) [default: 8; pendulum: 32].
    #[arg(long, env = "VOLLEY_BATCH_SEGMENTS")]
    pub batch_segments: Option<usize>,
    /// Credit across segments: train on windows of K consecutive segments of one environment
    /// stream, backpropagating through K·T steps with the recurrent state carried across the
    /// boundaries (needs --core gru; K divides --batch-segments, and a batch is
    /// batch-segments / K windows, so samples per update stay the same). 1: single segments.
    #[arg(long, default_value_t = 1, env = "VOLLEY_BPTT_SEGMENTS")]
    pub bptt_segments: usize,
    /// Seconds an incomplete BPTT window waits for its stream's next segment before the
    /// learner trains on it as a shorter window (with --bptt-segments above 1).
    #[arg(long, default_value_t = 10.0, env = "VOLLEY_BPTT_STREAM_TIMEOUT_SECS")]
    pub bptt_stream_timeout_secs: f64,
    /// Stop after this many environment steps.
    #[arg(long, default_value_t = 300_000, env = "VOLLEY_MAX_ENV_STEPS")]
    pub max_env_steps: u64,
    /// Loss [default: vtrace; pendulum: ppo].
    #[arg(long, value_enum, env = "VOLLEY_LOSS")]
    pub loss: Option<LossName>,
    /// Torso widths, comma-separated (empty for none).
    #[arg(long, default_value = "64,64", env = "VOLLEY_TORSO")]
    pub torso: String,
    /// Torso activation.
    #[arg(long, value_enum, default_value = "tanh", env = "VOLLEY_ACTIVATION")]
    pub activation: ActivationName,
    /// Recurrent core.
    #[arg(long, value_enum, default_value = "mlp", env = "VOLLEY_CORE")]
    pub core: CoreName,
    /// Continuous actions: squash the Gaussian head's samples through tanh into the action
    /// box (default: unsquashed samples, clipped by the environment).
    #[arg(long, env = "VOLLEY_SQUASH_ACTIONS")]
    pub squash_actions: bool,
    /// Normalise observations by running statistics that travel with the weights.
    #[arg(long, env = "VOLLEY_NORMALIZE_OBS")]
    pub normalize_obs: bool,
    /// GRU width (with --core gru).
    #[arg(long, default_value_t = 64, env = "VOLLEY_GRU_HIDDEN")]
    pub gru_hidden: usize,
    /// Convolutional torso preset in front of --torso (image observations, e.g. MinAtar).
    #[arg(long, value_enum, default_value = "none", env = "VOLLEY_CONV")]
    pub conv: ConvName,
    /// Frames the actors stack along the channel axis for a remote environment (e.g. 4 for
    /// Atari through `volley-envs serve atari:Pong`); servers send single frames.
    #[arg(long, default_value_t = 1, env = "VOLLEY_FRAME_STACK")]
    pub frame_stack: usize,
    /// Adam learning rate at the start (decays linearly to --final-learning-rate over
    /// --max-env-steps) [default: 2e-3; pendulum: 1e-3].
    #[arg(long, env = "VOLLEY_LEARNING_RATE")]
    pub learning_rate: Option<f32>,
    /// Learning rate reached at the end of the step budget (linear decay).
    #[arg(long, default_value_t = 0.0, env = "VOLLEY_FINAL_LEARNING_RATE")]
    pub final_learning_rate: f32,
    /// Adam ε, added to the root of the second-moment estimate (default: 1e-3 for cartpole,
    /// 1e-8 otherwise). Large for CartPole on purpose: once a run is solved its gradients
    /// shrink by 100x, and with a tiny ε Adam still takes full learning-rate steps on what is
    /// then noise, which drove the policy to a saturated, unrecoverable collapse
    /// (docs/STABILITY.md).
    #[arg(long, env = "VOLLEY_ADAM_EPS")]
    pub adam_eps: Option<f32>,
    /// Discount γ [default: 0.99; pendulum: 0.9].
    #[arg(long, env = "VOLLEY_GAMMA")]
    pub gamma: Option<f32>,
    /// Multiply rewards by this before computing returns [default: 0.05; pendulum: 0.1].
    #[arg(long, env = "VOLLEY_REWARD_SCALE")]
    pub reward_scale: Option<f32>,
    /// Entropy bonus coefficient [default: 0.01 with PPO on discrete actions; 0 otherwise].
    /// PPO runs ten epochs on each batch; with actors several versions behind, those steps
    /// pushed a policy that was still improving to a deterministic wrong one (CartPole stuck at
    /// a return of ~9) in 2 of 32 runs with 4 and 6 actor processes, and in 1 of 64 with 0.01
    /// (docs/benchmarks/long-runs.md, issue 11).
    #[arg(long, env = "VOLLEY_ENT_COEF")]
    pub ent_coef: Option<f32>,
    /// PPO epochs per batch.
    #[arg(long, default_value_t = 10, env = "VOLLEY_PPO_EPOCHS")]
    pub ppo_epochs: u32,
    /// PPO minibatches per epoch [default: 1; pendulum: 8].
    #[arg(long, env = "VOLLEY_PPO_MINIBATCHES")]
    pub ppo_minibatches: Option<u32>,
    /// GAE λ.
    #[arg(long, default_value_t = 0.95, env = "VOLLEY_GAE_LAMBDA")]
    pub gae_lambda: f32,
    /// PPO: truncation of the behaviour importance weight π_prox/μ of each sample.
    #[arg(long, default_value_t = HyperParams::default().behaviour_is_clip, env = "VOLLEY_BEHAVIOUR_IS_CLIP")]
    pub behaviour_is_clip: f32,
    /// Drop segments whose lag exceeds this many versions. 32 is inside what V-trace's
    /// truncated importance weights (and PPO's behaviour weights) correct, and above the lag
    /// that several actor processes produce on a busy machine (each actor's round of one batch
    /// spans about N versions with N actors, and a descheduled actor falls further behind), so
    /// scale-out does not throw actor work away (issue 11: with 4, 4-6 actors lost 34-46 % of
    /// their segments as stale; with 16, 6 actors on a loaded 2-core machine still lost 7-16 %).
    #[arg(long, default_value_t = 32, env = "VOLLEY_MAX_POLICY_LAG")]
    pub max_policy_lag: u64,
    /// Largest share (0, 1] of the 100-episode return window (and so of the solved stop) one
    /// actor id may hold; 1/k requires k actors to agree (docs/SECURITY.md).
    #[arg(long, default_value_t = 1.0, env = "VOLLEY_MAX_ACTOR_RETURN_SHARE")]
    pub max_actor_return_share: f32,
    /// Trajectory selection: drop segments with a raw reward of larger magnitude (default: no bound).
    #[arg(long, env = "VOLLEY_SELECT_MAX_ABS_REWARD")]
    pub select_max_abs_reward: Option<f32>,
    /// Trajectory selection: drop segments whose start group's last N returns are all equal
    /// (zero variance: no signal for group-relative methods); N >= 2 (default: off).
    #[arg(long, env = "VOLLEY_SELECT_ZERO_VARIANCE_MIN_GROUP")]
    pub select_zero_variance_min_group: Option<usize>,
    /// Trajectory selection: sample each batch from a pool by |advantage|^ALPHA with
    /// importance weights (prioritised selection; default: off, every segment used in order).
    #[arg(long, env = "VOLLEY_SELECT_PRIORITY_ALPHA")]
    pub select_priority_alpha: Option<f32>,
    /// Prioritised selection: importance-correction exponent β in [0, 1] (default 0.4).
    #[arg(long, env = "VOLLEY_SELECT_PRIORITY_BETA", requires = "select_priority_alpha")]
    pub select_priority_beta: Option<f32>,
    /// Prioritised selection: pool size in batches (default 2).
    #[arg(long, env = "VOLLEY_SELECT_POOL_FACTOR", requires = "select_priority_alpha")]
    pub select_pool_factor: Option<usize>,
    /// Memory task: number of cues.
    #[arg(long, default_value_t = 2, env = "VOLLEY_MEMORY_CUES")]
    pub memory_cues: usize,
    /// Memory task: steps between cue and query.
    #[arg(long, default_value_t = 6, env = "VOLLEY_MEMORY_DELAY")]
    pub memory_delay: usize,
    /// Milestones task: rooms.
    #[arg(long, default_value_t = 4, env = "VOLLEY_ROOMS")]
    pub rooms: usize,
    /// Milestones task: cells per room.
    #[arg(long, default_value_t = 8, env = "VOLLEY_ROOM_LEN")]
    pub room_len: usize,
    /// Milestones task: steps before truncation (at least rooms × (room length + 1)).
    #[arg(long, default_value_t = 128, env = "VOLLEY_ROOM_MAX_STEPS")]
    pub room_max_steps: usize,
    /// Milestones task: steps allowed in each room (0: no limit); a room that takes longer
    /// ends the episode (the long sparse chain where restarts from saved states pay;
    /// docs/AGENTIC.md).
    #[arg(long, default_value_t = 0, env = "VOLLEY_ROOM_STEPS")]
    pub room_steps: usize,
    /// Milestones task: the observation also says the chain's size (for task families; the
    /// `--task` entries must set `task_features=true` too).
    #[arg(long, env = "VOLLEY_MILESTONES_TASK_FEATURES")]
    pub milestones_task_features: bool,
    /// Schedule every episode through work items: budget assignment across `--task`s and
    /// saved states, snapshots at milestones (save-load).
    #[arg(long, env = "VOLLEY_WORK")]
    pub work: bool,
    /// A task for `--work` runs, repeatable: `NAME[:key=value,...]` with the environment's
    /// config keys, e.g. `--task memory:delay=2 --task memory:delay=8` (default: `--env` alone).
    /// Several tasks in one value (and in `VOLLEY_TASK`) are separated by `;`.
    #[arg(long = "task", requires = "work", env = "VOLLEY_TASK", value_delimiter = ';')]
    pub tasks: Vec<String>,
    /// How `--work` splits episodes between tasks.
    #[arg(long, value_enum, default_value = "uniform", env = "VOLLEY_BUDGET")]
    pub budget: BudgetName,
    /// Share of work items that restart from a saved state (Go-Explore-style), in [0, 1].
    #[arg(long, default_value_t = 0.0, env = "VOLLEY_RESTART_SHARE")]
    pub restart_share: f32,
    /// Episodes per work item.
    #[arg(long, default_value_t = 1, env = "VOLLEY_EPISODES_PER_ITEM")]
    pub episodes_per_item: u32,
    /// Save a snapshot every this many steps of a scheduled episode (0: at milestones only).
    #[arg(long, default_value_t = 0, env = "VOLLEY_SNAPSHOT_EVERY")]
    pub snapshot_every: u32,
    /// Seconds a taken work item may go without progress before another actor gets it.
    #[arg(long, default_value_t = 30.0, env = "VOLLEY_WORK_ACK_WAIT_SECS")]
    pub work_ack_wait_secs: f64,
    /// Work items one actor identity may hold at once (taken and not yet confirmed by the
    /// learner); give each actor at least twice its environments.
    #[arg(long, default_value_t = 64, env = "VOLLEY_WORK_MAX_ITEMS_PER_ACTOR")]
    pub work_max_items_per_actor: u32,
    /// Seconds the learner waits, after an actor reports an item done, for its episodes to
    /// arrive before another actor gets the item.
    #[arg(long, default_value_t = 120.0, env = "VOLLEY_WORK_CONFIRM_WAIT_SECS")]
    pub work_confirm_wait_secs: f64,
    /// Group rollouts: continuations per group, K (1: no groups). A group is K work items of
    /// one episode each from one start (a fresh reset seed or a saved state), each sampling
    /// actions from its own stream; needs --work.
    #[arg(long, default_value_t = 1, env = "VOLLEY_GROUP_SIZE", requires = "work")]
    pub group_size: u32,
    /// Group rollouts: share of the scheduler's draws that become a group rather than a
    /// single item, in [0, 1].
    #[arg(long, default_value_t = 1.0, env = "VOLLEY_GROUP_SHARE")]
    pub group_share: f32,
    /// The policy gradient's baseline: the critic, or the group's mean return (group rollouts;
    /// group-std also divides by the group's standard deviation, as GRPO does).
    #[arg(long, value_enum, default_value = "critic", env = "VOLLEY_BASELINE")]
    pub baseline: BaselineName,
    /// Group rollouts: segments the learner holds back until their groups complete; beyond
    /// it the oldest are trained on with the critic's advantages.
    #[arg(long, default_value_t = 256, env = "VOLLEY_GROUP_HOLD_SEGMENTS")]
    pub group_hold_segments: u32,
}

/// The policy gradient's baseline (`--baseline`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum BaselineName {
    /// The learned value function.
    Critic,
    /// The group's mean return: A = G_k − mean(G) (Dr. GRPO).
    Group,
    /// (G_k − mean(G)) / std(G) (GRPO).
    GroupStd,
}

/// Budget policy between tasks (`--budget`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum BudgetName {
    /// Every task equally often.
    Uniform,
    /// In proportion to p(1 − p) of each task's success rate.
    Learnability,
    /// UCB1 on learnability.
    Ucb,
}

/// Parse `NAME[:key=value,...]` into an environment config (the keys of its JSON form).
pub fn parse_task(text: &str) -> anyhow::Result<EnvConfig> {
    let (name, rest) = text.split_once(':').unwrap_or((text, ""));
    let mut object = serde_json::Map::new();
    object.insert("name".into(), serde_json::Value::String(name.trim().to_string()));
    for pair in rest.split(',').filter(|p| !p.trim().is_empty()) {
        let (key, value) =
            pair.split_once('=').with_context(|| format!("--task {text:?}: {pair:?} is not key=value"))?;
        let value: serde_json::Value =
            serde_json::from_str(value.trim()).unwrap_or_else(|_| serde_json::Value::String(value.trim().to_string()));
        object.insert(key.trim().to_string(), value);
    }
    let config: EnvConfig = serde_json::from_value(serde_json::Value::Object(object))
        .with_context(|| format!("--task {text:?}: not an environment config"))?;
    config.build().with_context(|| format!("--task {text:?}"))?;
    Ok(config)
}

/// `volley train`.
#[derive(Debug, Args)]
pub struct TrainArgs {
    /// The run spec.
    #[command(flatten)]
    pub spec: SpecArgs,
    /// Actor threads.
    #[arg(long, default_value_t = 1, env = "VOLLEY_ACTORS")]
    pub actors: usize,
    /// Environments per actor.
    #[arg(long, default_value_t = 8, env = "VOLLEY_ENVS_PER_ACTOR")]
    pub envs_per_actor: usize,
    /// Stop after this many seconds of wall time (default: no time limit; the run stops at
    /// --max-env-steps, the target return or Ctrl-C, so a slower machine takes longer rather
    /// than training less).
    #[arg(long, env = "VOLLEY_MAX_SECS")]
    pub max_secs: Option<f64>,
    /// Stop when the mean return of the last 100 episodes reaches this (default: the
    /// environment's solved threshold; pass a huge value to train to the budget).
    #[arg(long, env = "VOLLEY_TARGET_RETURN")]
    pub target_return: Option<f32>,
    /// Directory for metrics, curve and summary (default: runs/RUN-ENV-SEED, with ENV the
    /// service for remote:SERVICE; when it exists, the first free runs/RUN-ENV-SEED-N, said in
    /// the log). A directory given here that already holds a run is refused, never overwritten.
    #[arg(long, env = "VOLLEY_RUN_DIR")]
    pub run_dir: Option<PathBuf>,
    /// Also write TensorBoard scalars (return, episode length, losses, entropy, KL, learning
    /// rate, env steps/s, lag; one event per update) to an event file in this directory.
    #[arg(long, env = "VOLLEY_TENSORBOARD", value_name = "DIR")]
    pub tensorboard: Option<PathBuf>,
    /// Progress output.
    #[arg(long, value_enum, default_value = "auto", env = "VOLLEY_PROGRESS")]
    pub progress: ProgressMode,
    /// Where the learner's update runs; `cpu` is faster for the tiny default network, whose
    /// batches are too small to occupy a GPU.
    #[arg(long, value_enum, default_value = "auto", env = "VOLLEY_BACKEND")]
    pub backend: BackendName,
    /// Threads of the CPU learner's update (default: the cores this process may use less one
    /// per actor thread, at least 1, so actors and learner do not share a core).
    #[arg(long, env = "VOLLEY_LEARNER_THREADS")]
    pub learner_threads: Option<usize>,
    /// NATS, for `--env remote:<service>` only (the embedded run itself needs no broker).
    #[command(flatten)]
    pub nats: NatsArgs,
    /// Remote environment settings (`--env remote:<service>`).
    #[command(flatten)]
    pub remote_env: RemoteEnvArgs,
    /// With `--env remote:<service>`: how long to wait for a server of the service to tell the
    /// environment's spaces.
    #[arg(long, env = "VOLLEY_ENV_WAIT_SECS", default_value_t = 120.0)]
    pub env_wait_secs: f64,
}

/// Where the actor threads of an embedded run find a remote environment's servers.
#[derive(Debug, Clone)]
pub struct TrainRemote {
    /// The NATS connection.
    pub nats: NatsArgs,
    /// Deadlines, batching and concurrency of environment requests.
    pub remote_env: RemoteEnvArgs,
}

/// A validated `volley train` configuration.
#[derive(Debug, Clone)]
pub struct TrainConfig {
    /// The run spec shared by learner and actors.
    pub spec: RunSpec,
    /// Actor threads.
    pub actors: usize,
    /// Environments per actor.
    pub envs_per_actor: usize,
    /// Environment-step budget.
    pub max_env_steps: u64,
    /// Wall-time budget (none by default).
    pub max_duration: Option<Duration>,
    /// Stop at this mean return (last 100 episodes).
    pub target_return: Option<f32>,
    /// Where outputs go: the directory given, or the default to claim (see [`RunDir`]).
    pub run_dir: RunDir,
    /// Progress output.
    pub progress: ProgressMode,
    /// Learner backend.
    pub backend: BackendKind,
    /// Threads of the CPU learner's update.
    pub learner_threads: usize,
    /// How actor threads reach a remote environment's servers (`--env remote:<service>`).
    pub remote: Option<TrainRemote>,
    /// Where TensorBoard event files go (`--tensorboard`).
    pub tensorboard: Option<PathBuf>,
}

/// The defaults of the flags whose best value depends on the environment (a flag given on the
/// command line always wins).
#[derive(Debug, Clone, PartialEq)]
struct EnvDefaults {
    /// Which family of environments these defaults were chosen for (logged).
    family: &'static str,
    loss: LossName,
    gamma: f32,
    reward_scale: f32,
    learning_rate: f32,
    ppo_minibatches: u32,
    segment_len: usize,
    batch_segments: usize,
    /// The entropy bonus; `None`: 0.01 for a categorical head under PPO, else 0.
    ent_coef: Option<f32>,
}

impl EnvDefaults {
    /// Issue 14 (docs/benchmarks/solve.md, "Pendulum-v1"): PPO with γ 0.9 over 2048-step
    /// batches of 8 minibatches reaches a last-100 mean of −250 in ~75 K steps on 5/5 seeds; the
    /// CartPole defaults (V-trace, γ 0.99) did not learn in 500 K steps.
    const CONTINUOUS: EnvDefaults = EnvDefaults {
        family: "continuous (box actions, Pendulum-like)",
        loss: LossName::Ppo,
        gamma: 0.9,
        reward_scale: 0.1,
        learning_rate: 1e-3,
        ppo_minibatches: 8,
        segment_len: 64,
        batch_segments: 32,
        ent_coef: None,
    };

    /// What `bench/atari.sh` trains Pong with (issue 15): V-trace on unscaled clipped rewards
    /// with an entropy bonus.
    const IMAGES: EnvDefaults = EnvDefaults {
        family: "image observations (Atari-like)",
        loss: LossName::Vtrace,
        gamma: 0.99,
        reward_scale: 1.0,
        learning_rate: 6e-4,
        ppo_minibatches: 1,
        segment_len: 32,
        batch_segments: 8,
        ent_coef: Some(0.01),
    };

    /// CartPole's, for discrete actions on vector observations.
    const DISCRETE: EnvDefaults = EnvDefaults {
        family: "discrete actions, vector observations (CartPole-like)",
        loss: LossName::Vtrace,
        gamma: 0.99,
        reward_scale: 0.05,
        learning_rate: 2e-3,
        ppo_minibatches: 1,
        segment_len: 32,
        batch_segments: 8,
        ent_coef: None,
    };

    /// MinAtar (issue 45, item 2; docs/benchmarks/minatar.md, "The Breakout seed-11 collapse"):
    /// V-trace on unscaled rewards with an entropy bonus of 0.01, as for Atari. With CartPole's
    /// defaults (reward scale 0.05, no entropy bonus) Breakout seed 11 went deterministic
    /// (entropy 1.10 → 0.0009 by 0.8M frames) and its return fell to 0 for good; with these its
    /// entropy stays above 0.08 and it ends at 6.7 after 5M frames, 97 % of its best.
    const MINATAR: EnvDefaults = EnvDefaults {
        family: "MinAtar",
        loss: LossName::Vtrace,
        gamma: 0.99,
        reward_scale: 1.0,
        learning_rate: 2e-3,
        ppo_minibatches: 1,
        segment_len: 32,
        batch_segments: 8,
        ent_coef: Some(0.01),
    };

    /// The defaults for `env`. A served environment (`--env remote:<service>`) gets them from the
    /// spaces its servers declared, as a built-in one of the same family would (issue 48:
    /// served Pendulum trained with CartPole's defaults and did not learn).
    fn for_env(env: &EnvConfig) -> Self {
        match env {
            EnvConfig::Pendulum => Self::CONTINUOUS,
            EnvConfig::Minatar(_) => Self::MINATAR,
            EnvConfig::Remote(remote) if remote.action_box.is_some() => Self::CONTINUOUS,
            EnvConfig::Remote(remote) if remote.image.is_some() => Self::IMAGES,
            _ => Self::DISCRETE,
        }
    }
}

/// The solved threshold of a built-in environment (mean return over 100 episodes).
pub fn solved_return(env: &EnvConfig) -> Option<f32> {
    match env {
        EnvConfig::Cartpole => Some(475.0),
        EnvConfig::Memory(_) => Some(0.95),
        EnvConfig::Milestones(_) => Some(0.9),
        // Gymnasium declares none for Pendulum-v1; -250 is issue 14's target.
        EnvConfig::Pendulum => Some(-250.0),
        // MinAtar has no solved score; runs go to their step or time budget.
        EnvConfig::Minatar(_) => None,
        EnvConfig::Remote(remote) => remote.reward_threshold,
    }
}

fn parse_widths(text: &str) -> anyhow::Result<Vec<usize>> {
    let text = text.trim();
    if text.is_empty() {
        return Ok(Vec::new());
    }
    text.split(',')
        .map(|w| {
            let width: usize = w.trim().parse().with_context(|| format!("--torso: {w:?} is not a width"))?;
            if width == 0 || width > 4096 {
                bail!("--torso: width {width} out of range 1..=4096");
            }
            Ok(width)
        })
        .collect()
}

impl SpecArgs {
    /// Build and validate the run spec these flags describe; refuses a remote environment
    /// (whose spaces only its servers know: see [`SpecArgs::to_spec_with`]). For tests: the
    /// commands resolve remote environments over NATS.
    #[cfg(test)]
    pub fn to_spec(&self) -> anyhow::Result<RunSpec> {
        self.to_spec_with(&|service| bail!("--env remote:{service}: remote environments need NATS"))
    }

    /// Build and validate the run spec these flags describe, asking `resolve_remote` for the
    /// spaces of a remote environment.
    pub fn to_spec_with(
        &self,
        resolve_remote: &dyn Fn(&EnvServiceName) -> anyhow::Result<RemoteEnvConfig>,
    ) -> anyhow::Result<RunSpec> {
        let run = RunId::new(self.run.clone()).context("--run")?;
        if self.max_env_steps == 0 {
            bail!("--max-env-steps must be at least 1");
        }
        if self.gru_hidden == 0 || self.gru_hidden > 4096 {
            bail!("--gru-hidden: {} out of range 1..=4096", self.gru_hidden);
        }
        if self.frame_stack == 0 || self.frame_stack > volley_env::MAX_FRAME_STACK {
            bail!("--frame-stack: {} out of range 1..={}", self.frame_stack, volley_env::MAX_FRAME_STACK);
        }
        let env = match &self.env {
            EnvChoice::Builtin(_) if self.frame_stack > 1 => {
                bail!("--frame-stack is for remote environments (built-in ones send what their policy reads)")
            }
            EnvChoice::Builtin(name) => self.builtin_env(*name),
            EnvChoice::Remote(service) => {
                let mut remote = resolve_remote(service)?;
                remote.frame_stack = self.frame_stack;
                EnvConfig::Remote(remote)
            }
        };
        let (obs_dim, n_actions) = env.spaces().context("environment config")?;
        let policy = PolicySpec {
            obs_dim,
            n_actions,
            torso: parse_widths(&self.torso)?,
            activation: match self.activation {
                ActivationName::Tanh => Activation::Tanh,
                ActivationName::Relu => Activation::Relu,
            },
            core: match self.core {
                CoreName::Mlp => CoreKind::Mlp,
                CoreName::Gru => CoreKind::Gru { hidden: self.gru_hidden },
            },
            head: match volley_core::spec::default_action_head(&env).context("environment config")? {
                ActionHead::Gaussian { .. } => ActionHead::Gaussian { squash: self.squash_actions },
                categorical => categorical,
            },
            conv: self.conv_spec(&env)?,
            normalize_obs: self.normalize_obs,
        };
        let preset = EnvDefaults::for_env(&env);
        if let EnvConfig::Remote(remote) = &env {
            tracing::info!(service = %remote.service, family = preset.family, loss = ?preset.loss, gamma = preset.gamma,
                           reward_scale = preset.reward_scale, learning_rate = preset.learning_rate,
                           segment_len = preset.segment_len, batch_segments = preset.batch_segments,
                           "defaults for a served environment chosen from its declared spaces (flags override)");
        }
        let segment_len = self.segment_len.unwrap_or(preset.segment_len);
        let batch_segments = self.batch_segments.unwrap_or(preset.batch_segments);
        let steps_per_update = (segment_len * batch_segments) as u64;
        let hyper = HyperParams {
            loss: match self.loss.unwrap_or(preset.loss) {
                LossName::Vtrace => LossKind::Vtrace,
                LossName::Ppo => LossKind::Ppo,
            },
            gamma: self.gamma.unwrap_or(preset.gamma),
            reward_scale: self.reward_scale.unwrap_or(preset.reward_scale),
            learning_rate: self.learning_rate.unwrap_or(preset.learning_rate),
            final_learning_rate: self.final_learning_rate,
            lr_decay_updates: (self.max_env_steps / steps_per_update.max(1)).max(1),
            ent_coef: self.ent_coef.or(preset.ent_coef).unwrap_or(
                match (&policy.head, self.loss.unwrap_or(preset.loss)) {
                    (ActionHead::Categorical, LossName::Ppo) => 0.01,
                    _ => 0.0,
                },
            ),
            adam_eps: self.adam_eps.unwrap_or_else(|| volley_core::spec::default_adam_eps(&env)),
            ppo_epochs: self.ppo_epochs,
            ppo_minibatches: self.ppo_minibatches.unwrap_or(preset.ppo_minibatches),
            gae_lambda: self.gae_lambda,
            behaviour_is_clip: self.behaviour_is_clip,
            batch_segments,
            max_policy_lag: self.max_policy_lag,
            work: WorkConfig {
                enabled: self.work,
                tasks: self.tasks.iter().map(|t| parse_task(t)).collect::<anyhow::Result<_>>()?,
                policy: match self.budget {
                    BudgetName::Uniform => BudgetPolicy::Uniform,
                    BudgetName::Learnability => BudgetPolicy::Learnability,
                    BudgetName::Ucb => BudgetPolicy::Ucb,
                },
                restart_share: self.restart_share,
                episodes_per_item: self.episodes_per_item,
                snapshot_every_steps: self.snapshot_every,
                ack_wait_secs: self.work_ack_wait_secs,
                max_items_per_actor: self.work_max_items_per_actor,
                confirm_wait_secs: self.work_confirm_wait_secs,
                group_size: self.group_size,
                group_share: self.group_share,
                group_hold_segments: self.group_hold_segments,
                ..WorkConfig::default()
            },
            baseline: match self.baseline {
                BaselineName::Critic => Baseline::Critic,
                BaselineName::Group => Baseline::Group,
                BaselineName::GroupStd => Baseline::GroupStd,
            },
            selection: self.selection(),
            trust: TrustConfig { max_actor_return_share: self.max_actor_return_share },
            bptt: BpttConfig {
                segments: self.bptt_segments,
                stream_timeout_secs: self.bptt_stream_timeout_secs,
                ..BpttConfig::default()
            },
            ..HyperParams::default()
        };
        let spec = RunSpec { run, env, policy, segment_len, hyper, seed: self.seed };
        spec.validate().context("invalid training configuration")?;
        Ok(spec)
    }
}

impl SpecArgs {
    /// The conv torso `--conv` asks for, shaped by the environment's image observations.
    fn conv_spec(&self, env: &EnvConfig) -> anyhow::Result<Option<ConvSpec>> {
        if self.conv == ConvName::None {
            return Ok(None);
        }
        let Some([channels, height, width]) = env.image_shape() else {
            bail!("--conv {:?} needs image observations; {} has vector observations", self.conv, env.describe());
        };
        let mut spec = match self.conv {
            ConvName::None => unreachable!("handled above"),
            ConvName::Minatar => ConvSpec::minatar(channels, height, width),
            ConvName::Nature => ConvSpec::nature(channels, height, width),
        };
        // Served images are 8-bit frames (protocol version 3), read as pixels; MinAtar's
        // planes are 0/1 and read as they are.
        if matches!(env, EnvConfig::Remote(_)) {
            spec.input = ConvInput::Pixels;
        }
        Ok(Some(spec))
    }

    /// The built-in environment `name` with the task flags.
    pub fn builtin_env(&self, name: EnvName) -> EnvConfig {
        match name {
            EnvName::Cartpole => EnvConfig::Cartpole,
            EnvName::Memory => EnvConfig::Memory(MemoryConfig { n_cues: self.memory_cues, delay: self.memory_delay }),
            EnvName::Milestones => EnvConfig::Milestones(MilestonesConfig {
                n_rooms: self.rooms,
                room_len: self.room_len,
                max_steps: self.room_max_steps,
                room_steps: self.room_steps,
                task_features: self.milestones_task_features,
            }),
            EnvName::Pendulum => EnvConfig::Pendulum,
            EnvName::MinatarAsterix
            | EnvName::MinatarBreakout
            | EnvName::MinatarFreeway
            | EnvName::MinatarSeaquest
            | EnvName::MinatarSpaceInvaders => {
                let game = MinatarGame::from_env_name(name.as_str()).expect("every minatar EnvName is a game");
                EnvConfig::Minatar(MinatarConfig::new(game))
            }
        }
    }

    /// The trajectory-selection config these flags describe (validated with the run spec).
    fn selection(&self) -> SelectionConfig {
        let mut selection = SelectionConfig::default();
        selection.guard.max_abs_reward = self.select_max_abs_reward;
        selection.zero_variance = self
            .select_zero_variance_min_group
            .map(|min_group| ZeroVarianceConfig { min_group, ..ZeroVarianceConfig::default() });
        selection.priority = self.select_priority_alpha.map(|alpha| {
            let defaults = PriorityConfig::default();
            PriorityConfig {
                alpha,
                beta: self.select_priority_beta.unwrap_or(defaults.beta),
                pool_factor: self.select_pool_factor.unwrap_or(defaults.pool_factor),
                ..defaults
            }
        });
        selection
    }
}

fn check_target(target_return: Option<f32>) -> anyhow::Result<()> {
    if target_return.is_some_and(|t| t.is_nan()) {
        bail!("--target-return must be a number");
    }
    Ok(())
}

fn check_secs(flag: &str, secs: f64) -> anyhow::Result<Duration> {
    if !(secs.is_finite() && secs > 0.0) {
        bail!("{flag}: {secs} must be a positive number of seconds");
    }
    Ok(Duration::from_secs_f64(secs))
}

impl TryFrom<TrainArgs> for TrainConfig {
    type Error = anyhow::Error;

    fn try_from(args: TrainArgs) -> anyhow::Result<Self> {
        if args.actors == 0 || args.actors > 256 {
            bail!("--actors: {} out of range 1..=256", args.actors);
        }
        if args.envs_per_actor == 0 || args.envs_per_actor > 4096 {
            bail!("--envs-per-actor: {} out of range 1..=4096", args.envs_per_actor);
        }
        let max_duration = args.max_secs.map(|secs| check_secs("--max-secs", secs)).transpose()?;
        check_target(args.target_return)?;
        let env_wait = check_secs("--env-wait-secs", args.env_wait_secs)?;
        let spec = args.spec.to_spec_with(&|service| {
            crate::env_serve::remote_env_config(&args.nats, service, env_wait)
                .with_context(|| format!("asking the servers of environment service {service} for its spaces"))
        })?;
        let remote = match spec.env {
            volley_env::EnvConfig::Remote(_) => {
                args.remote_env.validate()?;
                Some(TrainRemote { nats: args.nats.clone(), remote_env: args.remote_env.clone() })
            }
            _ => None,
        };
        let target_return = args.target_return.or_else(|| solved_return(&spec.env));
        let run_dir = match args.run_dir {
            Some(dir) => RunDir::Given(dir),
            None => RunDir::Default(default_run_dir(&spec)),
        };
        Ok(TrainConfig {
            actors: args.actors,
            envs_per_actor: args.envs_per_actor,
            max_env_steps: args.spec.max_env_steps,
            max_duration,
            target_return,
            run_dir,
            progress: args.progress,
            backend: args.backend.into(),
            learner_threads: learner_threads(args.learner_threads, args.actors)?,
            remote,
            tensorboard: args.tensorboard,
            spec,
        })
    }
}

/// The learner's thread count: `flag` when given (checked against the CPU backend's range),
/// else the cores this process may use (`std::thread::available_parallelism`, which honours
/// the CPU affinity mask and cgroup quota) less `other_threads` busy ones, at least 1.
pub fn learner_threads(flag: Option<usize>, other_threads: usize) -> anyhow::Result<usize> {
    let max = volley_learner::backend::cpu::MAX_THREADS;
    match flag {
        Some(threads) if (1..=max).contains(&threads) => Ok(threads),
        Some(threads) => bail!("--learner-threads: {threads} out of range 1..={max}"),
        None => {
            let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
            Ok(cores.saturating_sub(other_threads).max(1))
        }
    }
}

/// Where `volley train` writes its run directory.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum RunDir {
    /// `--run-dir`: used as given; refused if it already holds a run.
    Given(PathBuf),
    /// The default `runs/RUN-ENV-SEED`: a rerun takes the first free `runs/RUN-ENV-SEED-N`.
    Default(PathBuf),
}

/// The default run directory, `runs/RUN-ENV-SEED`, where ENV names what was trained: a built-in
/// environment's name, or the service of a remote one (`runs/local-pong-1`, not
/// `runs/local-remote-1` for every service).
pub fn default_run_dir(spec: &RunSpec) -> PathBuf {
    let env = match &spec.env {
        // Service names are [a-z0-9_-]{1,48}: safe as part of a file name.
        EnvConfig::Remote(remote) => remote.service.as_str(),
        other => other.name(),
    };
    PathBuf::from(format!("runs/{}-{}-{}", spec.run, env, spec.seed))
}

/// How to reach NATS (shared by `volley learner` and `volley actor`).
/// `Debug` shows no password.
#[derive(Clone, Args)]
pub struct NatsArgs {
    /// NATS server to connect to.
    #[arg(long = "nats", env = "VOLLEY_NATS_URL", default_value = "nats://127.0.0.1:4222")]
    pub nats_url: String,
    /// Deadline for every NATS request, fetch and publish ack.
    #[arg(long, env = "VOLLEY_NATS_TIMEOUT_SECS", default_value_t = 5.0)]
    pub nats_timeout_secs: f64,
    /// NATS user name (see broker-config/: `learner-<run>` or `actor-<run>`); needs a password.
    #[arg(long, env = "VOLLEY_NATS_USER", requires = "nats_password")]
    pub nats_user: Option<String>,
    /// Password of `--nats-user`; prefer the environment variable over the flag (flags show up
    /// in process listings). Never logged.
    #[arg(long, env = "VOLLEY_NATS_PASSWORD", hide_env_values = true, requires = "nats_user")]
    pub nats_password: Option<String>,
    /// Weights also travel by core-NATS fan-out to connected actors (the live path), besides
    /// the object store and pointer; `false` turns it off (the learner does not send, actors
    /// do not subscribe), e.g. for a broker whose permissions lack the live subject.
    #[arg(long, env = "VOLLEY_NATS_WEIGHTS_LIVE", default_value_t = true, action = clap::ArgAction::Set)]
    pub nats_weights_live: bool,
    /// Learner: with the live path on, write the weights pointer (KV) of small, inline
    /// weights for at least every this many versions; the versions between reach connected
    /// actors by the live path alone (15 % less CPU for distributed CartPole at 8). An actor
    /// without the live path trails by up to this many versions less one; 1 writes every one.
    #[arg(long, env = "VOLLEY_NATS_WEIGHTS_POINTER_EVERY", default_value_t = 8,
          value_parser = clap::value_parser!(u64).range(1..=volley_transport::nats::weights::MAX_POINTER_EVERY))]
    pub nats_weights_pointer_every: u64,
    /// Learner: `recv` calls' worth of messages its pull asks for at a time. 1 keeps the
    /// policy lag lowest; 2–4 let a learner whose update is faster than a broker round trip
    /// (a GPU learner at large batches) take segments faster, at about a batch of lag each.
    #[arg(long, env = "VOLLEY_NATS_PREFETCH_CALLS", default_value_t = 1,
          value_parser = clap::value_parser!(u16).range(1..=64))]
    pub nats_prefetch_calls: u16,
    /// Worker threads of this process's NATS client runtime. 0: none, the threads that use
    /// NATS run it while they wait on it (fewer thread hand-offs per message; distributed
    /// CartPole 7 % less CPU per env step). Give 1–2 to a process that computes for minutes
    /// between NATS calls, so its connection keeps answering the server's pings.
    #[arg(long, env = "VOLLEY_NATS_RUNTIME_WORKERS", default_value_t = 0,
          value_parser = clap::value_parser!(u16).range(0..=64))]
    pub nats_runtime_workers: u16,
}

impl std::fmt::Debug for NatsArgs {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NatsArgs")
            .field("nats_url", &self.nats_url)
            .field("nats_timeout_secs", &self.nats_timeout_secs)
            .field("nats_user", &self.nats_user)
            .field("nats_password", &self.nats_password.as_ref().map(|_| "<redacted>"))
            .field("nats_weights_live", &self.nats_weights_live)
            .field("nats_weights_pointer_every", &self.nats_weights_pointer_every)
            .field("nats_prefetch_calls", &self.nats_prefetch_calls)
            .field("nats_runtime_workers", &self.nats_runtime_workers)
            .finish()
    }
}

impl NatsArgs {
    /// The transport config for `run`.
    pub fn config(&self, run: RunId) -> anyhow::Result<NatsConfig> {
        let mut config = NatsConfig::new(self.nats_url.clone(), run);
        config.request_timeout = self.timeout()?;
        config.auth = self.auth()?;
        config.weights_live = self.nats_weights_live;
        config.weights_pointer_every = self.nats_weights_pointer_every;
        config.prefetch_calls = usize::from(self.nats_prefetch_calls);
        config.runtime_workers = usize::from(self.nats_runtime_workers);
        Ok(config)
    }

    /// The deadline of every NATS request.
    pub fn timeout(&self) -> anyhow::Result<Duration> {
        check_secs("--nats-timeout-secs", self.nats_timeout_secs)
    }

    /// The credentials, if any.
    pub fn auth(&self) -> anyhow::Result<Option<NatsAuth>> {
        nats_auth(&self.nats_user, &self.nats_password)
    }
}

/// How an actor steps a remote environment (shared by `volley actor` and the learner's
/// lookup of the environment's spaces).
#[derive(Debug, Clone, Args)]
pub struct RemoteEnvArgs {
    /// Deadline of every request to an environment server; a server that misses it is
    /// treated as lost (its episodes are aborted and restarted elsewhere).
    #[arg(long, env = "VOLLEY_ENV_TIMEOUT_SECS", default_value_t = 5.0)]
    pub env_timeout_secs: f64,
    /// Environments per session, i.e. per step request (0: spread the actor's environments over
    /// the servers found at start, one session each).
    #[arg(long, env = "VOLLEY_ENVS_PER_SESSION", default_value_t = 0)]
    pub envs_per_session: usize,
    /// Step requests in flight at once.
    #[arg(long, env = "VOLLEY_ENV_MAX_IN_FLIGHT", default_value_t = 8)]
    pub env_max_in_flight: usize,
}

impl RemoteEnvArgs {
    /// The per-request deadline.
    pub fn timeout(&self) -> anyhow::Result<Duration> {
        check_secs("--env-timeout-secs", self.env_timeout_secs)
    }

    /// Check the ranges once.
    pub fn validate(&self) -> anyhow::Result<()> {
        self.timeout()?;
        if self.envs_per_session > 4096 {
            bail!("--envs-per-session: {} out of range 0..=4096", self.envs_per_session);
        }
        if self.env_max_in_flight == 0 || self.env_max_in_flight > 1024 {
            bail!("--env-max-in-flight: {} out of range 1..=1024", self.env_max_in_flight);
        }
        Ok(())
    }
}

/// `volley learner`.
#[derive(Debug, Args)]
pub struct LearnerArgs {
    /// NATS connection.
    #[command(flatten)]
    pub nats: NatsArgs,
    /// Metrics endpoint.
    #[command(flatten)]
    pub metrics: MetricsArgs,
    /// The run spec this learner creates (or resumes).
    #[command(flatten)]
    pub spec: SpecArgs,
    /// Stop after this many seconds (default: run until the step budget, the target, or SIGTERM).
    #[arg(long, env = "VOLLEY_MAX_SECS")]
    pub max_secs: Option<f64>,
    /// Stop when the mean return of the last 100 episodes reaches this (default: the
    /// environment's solved threshold; not with --replay, whose returns are the recorded
    /// actors').
    #[arg(long, env = "VOLLEY_TARGET_RETURN")]
    pub target_return: Option<f32>,
    /// Directory for checkpoints (the file is learner-RUN.ckpt); a checkpoint found there is
    /// resumed. The default is under runs/, which git ignores, beside `volley train`'s run
    /// directories.
    #[arg(long, env = "VOLLEY_CHECKPOINT_DIR", default_value = DEFAULT_CHECKPOINT_DIR)]
    pub checkpoint_dir: PathBuf,
    /// Checkpoint every this many updates.
    #[arg(long, env = "VOLLEY_CHECKPOINT_EVERY_UPDATES", default_value_t = 200)]
    pub checkpoint_every_updates: u64,
    /// Checkpoint at least every this many seconds.
    #[arg(long, env = "VOLLEY_CHECKPOINT_EVERY_SECS", default_value_t = 30.0)]
    pub checkpoint_every_secs: f64,
    /// Publish weights every this many updates.
    #[arg(long, env = "VOLLEY_PUBLISH_EVERY", default_value_t = 1)]
    pub publish_every: u64,
    /// Copies JetStream keeps of the run's stream and buckets (1-5): 1 on a single
    /// nats-server, 3 on a 3-node cluster. Applied when they are created.
    #[arg(long, env = "VOLLEY_NATS_REPLICAS", default_value_t = 1)]
    pub nats_replicas: usize,
    /// Actors pause publishing while the learner's backlog exceeds this many segments
    /// (default: two batches; one batch with PPO). The backlog divided by the batch size bounds
    /// the policy lag, so keep it at most `--max-policy-lag` batches or data goes stale while
    /// it waits. PPO's ten epochs per batch keep its learner the slower side, so its backlog
    /// is always full: with two batches, PPO on CartPole with 6 actor processes trained on data
    /// 13 versions old and took up to 3.8x the embedded run's env steps; with one batch (and actors
    /// that wait for room before they collect), 5 versions and at most 1.45x
    /// (docs/benchmarks/long-runs.md, issue 11).
    #[arg(long, env = "VOLLEY_MAX_BACKLOG_SEGMENTS")]
    pub max_backlog_segments: Option<u64>,
    /// Upper bound on the bytes the run's trajectory stream keeps on the broker (segments stay
    /// after they were consumed, for `--replay`; the oldest are discarded first).
    #[arg(long, env = "VOLLEY_TRAJECTORY_MAX_BYTES", default_value_t = 1 << 30)]
    pub trajectory_max_bytes: u64,
    /// Segments older than this are removed from the trajectory stream (0: no age limit).
    #[arg(long, env = "VOLLEY_TRAJECTORY_MAX_AGE_SECS", default_value_t = 24.0 * 3600.0)]
    pub trajectory_max_age_secs: f64,
    /// Train from the run's recorded trajectory stream instead of live actors (no weights are
    /// published and no checkpoint is written). A replay stops at the end of the record or at
    /// --max-env-steps, never "solved": the returns in the record are those of the actors'
    /// policies when it was recorded, not of the policy being trained.
    #[arg(long, env = "VOLLEY_REPLAY")]
    pub replay: bool,
    /// Also write TensorBoard scalars (return, episode length, losses, entropy, KL, learning
    /// rate, env steps/s, lag; one event per update) to an event file in this directory.
    #[arg(long, env = "VOLLEY_TENSORBOARD", value_name = "DIR")]
    pub tensorboard: Option<PathBuf>,
    /// Where the update runs: `auto` uses the GPU when one works and otherwise the CPU (a
    /// warning only when a GPU is there but fails); `cuda` fails without a GPU.
    #[arg(long, value_enum, default_value = "auto", env = "VOLLEY_BACKEND")]
    pub backend: BackendName,
    /// Threads of the CPU learner's update (default: the cores this process may use).
    #[arg(long, env = "VOLLEY_LEARNER_THREADS")]
    pub learner_threads: Option<usize>,
    /// With `--env remote:<service>`: how long to wait for a server of the service to tell the
    /// environment's spaces.
    #[arg(long, env = "VOLLEY_ENV_WAIT_SECS", default_value_t = 120.0)]
    pub env_wait_secs: f64,
}

/// `volley learner`'s checkpoint directory when `--checkpoint-dir` is not given: inside `runs/`
/// (ignored by git), not in the working tree (issue 48).
pub const DEFAULT_CHECKPOINT_DIR: &str = "runs/checkpoints";

/// Where `volley learner` wrote checkpoints by default before issue 48.
const OLD_DEFAULT_CHECKPOINT_DIR: &str = "checkpoints";

/// A validated `volley learner` configuration.
#[derive(Debug, Clone)]
pub struct LearnerConfig {
    /// Transport config.
    pub nats: NatsConfig,
    /// The run spec.
    pub spec: RunSpec,
    /// Step budget.
    pub max_env_steps: u64,
    /// Wall-time budget.
    pub max_duration: Option<Duration>,
    /// Target return.
    pub target_return: Option<f32>,
    /// Checkpoint file.
    pub checkpoint_path: PathBuf,
    /// Checkpoint cadence in updates.
    pub checkpoint_every_updates: u64,
    /// Checkpoint cadence in time.
    pub checkpoint_every: Duration,
    /// Weights cadence.
    pub publish_every: u64,
    /// Replay mode.
    pub replay: bool,
    /// Metrics endpoint address.
    pub metrics_addr: String,
    /// `/healthz` fails after this long without progress.
    pub liveness_timeout: Duration,
    /// Learner backend.
    pub backend: BackendKind,
    /// Threads of the CPU learner's update.
    pub learner_threads: usize,
    /// Where TensorBoard event files go (`--tensorboard`).
    pub tensorboard: Option<PathBuf>,
}

impl TryFrom<LearnerArgs> for LearnerConfig {
    type Error = anyhow::Error;

    fn try_from(args: LearnerArgs) -> anyhow::Result<Self> {
        let env_wait = check_secs("--env-wait-secs", args.env_wait_secs)?;
        let mut spec = args.spec.to_spec_with(&|service| {
            crate::env_serve::remote_env_config(&args.nats, service, env_wait)
                .with_context(|| format!("asking the servers of environment service {service} for its spaces"))
        })?;
        let batch_segments = spec.hyper.batch_segments as u64;
        let default_backlog_batches = if spec.hyper.loss == LossKind::Ppo { 1 } else { 2 };
        let max_backlog_segments = args.max_backlog_segments.unwrap_or(default_backlog_batches * batch_segments);
        if max_backlog_segments < batch_segments {
            bail!(
                "--max-backlog-segments: {max_backlog_segments} is below --batch-segments {batch_segments}: \
                 the learner could never fill a batch"
            );
        }
        spec.hyper.max_backlog_segments = max_backlog_segments;
        spec.hyper.stores.trajectory_max_bytes = args.trajectory_max_bytes;
        spec.hyper.stores.trajectory_max_age_secs = args.trajectory_max_age_secs;
        spec.validate().context("--trajectory-max-bytes / --trajectory-max-age-secs")?;
        check_target(args.target_return)?;
        if args.replay && args.target_return.is_some() {
            bail!(
                "--target-return with --replay: the returns in the record are those of the actors' policies when it \
                 was recorded, not of the policy this replay trains, so they cannot say it solved the task; a replay \
                 runs to the end of the record or --max-env-steps"
            );
        }
        if args.checkpoint_every_updates == 0 || args.publish_every == 0 {
            bail!("--checkpoint-every-updates and --publish-every must be at least 1");
        }
        if !args.replay {
            // A replay publishes nothing and bounds no lag.
            check_learner_progress(&spec, args.publish_every)?;
        }
        let max_duration = args.max_secs.map(|s| check_secs("--max-secs", s)).transpose()?;
        let checkpoint_every = check_secs("--checkpoint-every-secs", args.checkpoint_every_secs)?;
        let mut nats = args.nats.config(spec.run.clone())?;
        nats.max_backlog_segments = max_backlog_segments;
        nats.keep_weight_versions = spec.hyper.stores.weights_keep_versions;
        if !(1..=5).contains(&args.nats_replicas) {
            bail!("--nats-replicas: {} out of range 1..=5 (JetStream keeps at most 5 copies)", args.nats_replicas);
        }
        nats.replicas = args.nats_replicas;
        let checkpoint_path = Checkpoint::path_in(&args.checkpoint_dir, spec.run.as_str());
        let old_default = Checkpoint::path_in(std::path::Path::new(OLD_DEFAULT_CHECKPOINT_DIR), spec.run.as_str());
        if args.checkpoint_dir.as_os_str() == DEFAULT_CHECKPOINT_DIR
            && !checkpoint_path.exists()
            && old_default.exists()
        {
            tracing::warn!(
                found = %old_default.display(),
                "a checkpoint of run {} is at the old default location; this learner starts afresh in {} \
                 unless started with --checkpoint-dir {OLD_DEFAULT_CHECKPOINT_DIR}",
                spec.run,
                checkpoint_path.display()
            );
        }
        Ok(LearnerConfig {
            checkpoint_path,
            // A replay's returns are the recorded actors', not the trained policy's.
            target_return: if args.replay { None } else { args.target_return.or_else(|| solved_return(&spec.env)) },
            max_env_steps: args.spec.max_env_steps,
            max_duration,
            checkpoint_every_updates: args.checkpoint_every_updates,
            checkpoint_every,
            publish_every: args.publish_every,
            replay: args.replay,
            liveness_timeout: args.metrics.liveness_timeout(),
            metrics_addr: args.metrics.metrics_addr,
            backend: args.backend.into(),
            learner_threads: learner_threads(args.learner_threads, 0)?,
            tensorboard: args.tensorboard,
            nats,
            spec,
        })
    }
}

/// Deliveries the learner's NATS consumer hands out unacknowledged (the server's default
/// `max_ack_pending`; the consumer does not set its own).
const CONSUMER_MAX_ACK_PENDING: u64 = 1000;

/// Refuse learner settings under which no update could ever happen (issue 11): every
/// combination either trains or is refused here, naming the values that conflict.
///
/// - Between two publishes the learner's version runs `publish_every − 1` ahead of the newest
///   published one, and actors act only with published versions. So just before a publish
///   the freshest segment has lag `publish_every − 1`; above `max_policy_lag` every segment
///   is stale and the next publish never comes.
/// - The learner holds its selection pool unacknowledged; the consumer stops delivering at
///   [`CONSUMER_MAX_ACK_PENDING`], so a larger pool never fills.
///
/// Batch size against the backlog bound is checked with `--max-backlog-segments`; envs per
/// actor and the number of actors cannot stall the learner (pacing admits any publish while
/// the backlog is below one batch, and a segment's lag does not depend on them), they only
/// change how much data goes stale, which the pacing bound keeps small.
pub fn check_learner_progress(spec: &RunSpec, publish_every: u64) -> anyhow::Result<()> {
    let max_policy_lag = spec.hyper.max_policy_lag;
    if publish_every.saturating_sub(1) > max_policy_lag {
        bail!(
            "--publish-every {publish_every} conflicts with --max-policy-lag {max_policy_lag}: actors only act with \
             published weights, so just before each publish the freshest segment is {} versions old and every \
             segment is dropped as stale, and no further update (or publish) would ever happen; use \
             --publish-every <= {} or --max-policy-lag >= {}",
            publish_every - 1,
            max_policy_lag.saturating_add(1),
            publish_every - 1
        );
    }
    let pool_segments = spec.hyper.selection.pool_segments(spec.hyper.batch_segments) as u64;
    let work = &spec.hyper.work;
    let holds = work.enabled
        && work.group_size > 1
        && (spec.hyper.baseline.uses_groups() || spec.hyper.selection.zero_variance.is_some());
    if holds && pool_segments + u64::from(work.group_hold_segments) > CONSUMER_MAX_ACK_PENDING {
        bail!(
            "a selection pool of {pool_segments} segments plus --group-hold-segments {} exceeds the {CONSUMER_MAX_ACK_PENDING} \
             unacknowledged segments the learner's NATS consumer delivers, so held groups could stop deliveries; \
             lower --group-hold-segments to at most {}",
            work.group_hold_segments,
            CONSUMER_MAX_ACK_PENDING.saturating_sub(pool_segments)
        );
    }
    if pool_segments > CONSUMER_MAX_ACK_PENDING {
        bail!(
            "--batch-segments {} (x --select-pool-factor {}) = a selection pool of {pool_segments} segments, but the \
             learner's NATS consumer delivers at most {CONSUMER_MAX_ACK_PENDING} unacknowledged segments, so the \
             pool would never fill and no update would happen",
            spec.hyper.batch_segments,
            spec.hyper.selection.priority.as_ref().map_or(1, |p| p.pool_factor),
        );
    }
    let bptt = &spec.hyper.bptt;
    if bptt.segments > 1 && pool_segments + bptt.max_held_segments as u64 > CONSUMER_MAX_ACK_PENDING {
        bail!(
            "--bptt-segments {}: a selection pool of {pool_segments} segments plus up to {} segments held for \
             incomplete windows (bptt.max_held_segments) exceeds the {CONSUMER_MAX_ACK_PENDING} unacknowledged \
             segments the learner's NATS consumer delivers, so incomplete windows could wait for their timeout \
             instead of filling; lower bptt.max_held_segments or --batch-segments",
            bptt.segments,
            bptt.max_held_segments,
        );
    }
    Ok(())
}

/// `volley actor`.
#[derive(Debug, Args)]
pub struct ActorArgs {
    /// NATS connection.
    #[command(flatten)]
    pub nats: NatsArgs,
    /// Metrics endpoint.
    #[command(flatten)]
    pub metrics: MetricsArgs,
    /// The run to join.
    #[arg(long, env = "VOLLEY_RUN", default_value = "local")]
    pub run: String,
    /// This actor's identity (default: the pod name from $POD_NAME or $HOSTNAME, else generated).
    #[arg(long, env = "VOLLEY_ACTOR_ID")]
    pub actor_id: Option<String>,
    /// Environments stepped by this actor.
    #[arg(long, env = "VOLLEY_ENVS_PER_ACTOR", default_value_t = 8)]
    pub envs: usize,
    /// Rounds put in one message at most. A round quicker than 5 ms is held for the next one,
    /// so a fast environment (a CartPole round of 8 × 32 steps takes under 1 ms) costs the
    /// broker one message per this many rounds, for one round more of lag on the first; slower
    /// rounds are published as they come. 1 publishes every round. Scheduled episodes (work
    /// items) publish every round.
    #[arg(long, env = "VOLLEY_ROUNDS_PER_PUBLISH", default_value_t = 2,
          value_parser = clap::value_parser!(u16).range(1..=16))]
    pub rounds_per_publish: u16,
    /// Seed of this actor's environments and sampling (default: derived from the actor id).
    #[arg(long, env = "VOLLEY_ACTOR_SEED")]
    pub seed: Option<u64>,
    /// Step this environment instead of the run spec's: remote:SERVICE for one served over
    /// NATS, or a built-in name. Its spaces must match the run's policy.
    #[arg(long, env = "VOLLEY_ACTOR_ENV", value_parser = parse_env_choice)]
    pub env: Option<EnvChoice>,
    /// Remote environment settings.
    #[command(flatten)]
    pub remote_env: RemoteEnvArgs,
}

/// How an environment server reaches NATS: the connection only. The weights and prefetch
/// settings of [`NatsArgs`] are the learner's and actors' and mean nothing to a server.
/// `Debug` shows no password.
#[derive(Clone, Args)]
pub struct NatsConnectArgs {
    /// NATS server to connect to.
    #[arg(long = "nats", env = "VOLLEY_NATS_URL", default_value = "nats://127.0.0.1:4222")]
    pub nats_url: String,
    /// Deadline for connecting and for every NATS request.
    #[arg(long, env = "VOLLEY_NATS_TIMEOUT_SECS", default_value_t = 5.0)]
    pub nats_timeout_secs: f64,
    /// NATS user name (see broker-config/: `env-<service>`, e.g. `env-cartpole`); needs a password.
    #[arg(long, env = "VOLLEY_NATS_USER", requires = "nats_password")]
    pub nats_user: Option<String>,
    /// Password of `--nats-user`; prefer the environment variable over the flag (flags show up
    /// in process listings). Never logged.
    #[arg(long, env = "VOLLEY_NATS_PASSWORD", hide_env_values = true, requires = "nats_user")]
    pub nats_password: Option<String>,
}

impl std::fmt::Debug for NatsConnectArgs {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NatsConnectArgs")
            .field("nats_url", &self.nats_url)
            .field("nats_timeout_secs", &self.nats_timeout_secs)
            .field("nats_user", &self.nats_user)
            .field("nats_password", &self.nats_password.as_ref().map(|_| "<redacted>"))
            .finish()
    }
}

impl NatsConnectArgs {
    /// The deadline of every NATS request.
    pub fn timeout(&self) -> anyhow::Result<Duration> {
        check_secs("--nats-timeout-secs", self.nats_timeout_secs)
    }

    /// The credentials, if any.
    pub fn auth(&self) -> anyhow::Result<Option<NatsAuth>> {
        nats_auth(&self.nats_user, &self.nats_password)
    }
}

/// `--nats-user` and `--nats-password` as credentials.
fn nats_auth(user: &Option<String>, password: &Option<String>) -> anyhow::Result<Option<NatsAuth>> {
    Ok(match (user, password) {
        (Some(user), Some(password)) => Some(NatsAuth::UserPassword { user: user.clone(), password: password.clone() }),
        (None, None) => None,
        _ => bail!("--nats-user and --nats-password go together"),
    })
}

/// `volley env-serve`: one environment server (one instance of the service); start several
/// for more capacity, on any machine that reaches NATS.
#[derive(Debug, Args)]
pub struct EnvServeArgs {
    /// NATS connection.
    #[command(flatten)]
    pub nats: NatsConnectArgs,
    /// The built-in environment to serve (default configuration).
    #[arg(long, value_enum, default_value = "cartpole", env = "VOLLEY_ENV")]
    pub env: EnvName,
    /// Service name actors ask for with `--env remote:<name>` ([a-z0-9_-]{1,48}; default: the
    /// environment's name).
    #[arg(long, env = "VOLLEY_ENV_SERVICE")]
    pub name: Option<String>,
    /// Sessions held at once; more are refused so actors go to other servers.
    #[arg(long, env = "VOLLEY_ENV_MAX_SESSIONS", default_value_t = 1024)]
    pub max_sessions: usize,
    /// Largest session (environments per step request).
    #[arg(long, env = "VOLLEY_ENV_MAX_ENVS_PER_SESSION", default_value_t = 4096)]
    pub max_envs_per_session: usize,
    /// Drop a session that received no request for this long.
    #[arg(long, env = "VOLLEY_ENV_IDLE_TIMEOUT_SECS", default_value_t = 300.0)]
    pub idle_timeout_secs: f64,
}

impl EnvServeArgs {
    /// The service name and the server config.
    pub fn server_config(&self) -> anyhow::Result<volley_transport::envsvc::EnvServerConfig> {
        let env_name = self.env.as_str().to_string();
        let name = EnvServiceName::new(self.name.clone().unwrap_or_else(|| env_name.clone())).context("--name")?;
        let mut config = volley_transport::envsvc::EnvServerConfig::new(name, env_name);
        if self.max_sessions == 0 || self.max_envs_per_session == 0 {
            bail!("--max-sessions and --max-envs-per-session must be at least 1");
        }
        config.max_sessions = self.max_sessions;
        config.max_envs_per_session = self.max_envs_per_session;
        config.idle_timeout = check_secs("--idle-timeout-secs", self.idle_timeout_secs)?;
        let builtin = EnvConfig::from_name(&config.env_label).context("--env")?;
        config.reward_threshold = solved_return(&builtin);
        config.max_episode_steps = match builtin {
            EnvConfig::Cartpole => Some(volley_env::cartpole::MAX_EPISODE_STEPS),
            _ => None,
        };
        config.max_abs_reward = Some(builtin.bounds().max_abs_reward);
        Ok(config)
    }
}

/// Where a long-running process serves `/metrics`, `/healthz` and `/readyz`.
#[derive(Debug, Clone, Args)]
pub struct MetricsArgs {
    /// Address for the metrics endpoint (port 0 picks a free port, logged at start; in
    /// Kubernetes use 0.0.0.0:9100).
    #[arg(long, env = "VOLLEY_METRICS_ADDR", default_value = "127.0.0.1:0")]
    pub metrics_addr: String,
    /// `/healthz` fails (503) once the main loop has made no progress for this many seconds:
    /// for the learner, no update while data arrives; for an actor, no env step while it is
    /// not waiting on pacing, the broker or the first weights. Waiting for actors or for the
    /// learner is not a failure.
    #[arg(long, env = "VOLLEY_LIVENESS_TIMEOUT_SECS", default_value_t = 120, value_parser = clap::value_parser!(u64).range(1..))]
    pub liveness_timeout_secs: u64,
}

impl MetricsArgs {
    /// The liveness limit.
    pub fn liveness_timeout(&self) -> Duration {
        Duration::from_secs(self.liveness_timeout_secs)
    }
}

/// The part `volley bench-weights` plays.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum BenchRole {
    /// Start the followers, publish versions, report latencies.
    Driver,
    /// Follow the weights like an actor; print `version,unix_nanos` per new version.
    Follower,
}

/// How `volley bench-weights` moves the weights: Volley's path, or a raw NATS pattern that
/// moves the same bytes (the baselines of issue 16, item 2).
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum BenchPattern {
    /// Volley's weights publisher and followers (frames, pointer, deltas, verification).
    Volley,
    /// A plain JetStream object-store put per version, a core-NATS notice, and an object get in
    /// every follower (no decoding, no verification beyond the object store's own digest).
    RawObject,
    /// Core-NATS fan-out: the frame's bytes published in chunks on one subject that every
    /// follower subscribes to (no persistence, no acknowledgement).
    RawCore,
}

impl BenchPattern {
    /// The flag's value.
    pub fn name(self) -> &'static str {
        match self {
            BenchPattern::Volley => "volley",
            BenchPattern::RawObject => "raw-object",
            BenchPattern::RawCore => "raw-core",
        }
    }
}

/// `volley bench-weights`: weight-broadcast latency from the learner's publish to every actor
/// holding the version (see `cli/src/bench.rs`). Needs a running nats-server; starts none.
#[derive(Debug, Args)]
pub struct BenchWeightsArgs {
    /// NATS connection.
    #[command(flatten)]
    pub nats: NatsArgs,
    /// Run whose buckets the benchmark uses; the driver deletes and re-creates its KV bucket
    /// and weights store, so never point it at a real run (hence not `VOLLEY_RUN`: the
    /// benchmark's own flags read `VOLLEY_BENCH_*` variables).
    #[arg(long, default_value = "bench-weights", env = "VOLLEY_BENCH_RUN")]
    pub run: String,
    /// Driver (the default) or one follower (started by the driver).
    #[arg(long, value_enum, default_value = "driver", env = "VOLLEY_BENCH_ROLE")]
    pub role: BenchRole,
    /// Follower processes the driver starts.
    #[arg(long, default_value_t = 8, env = "VOLLEY_BENCH_FOLLOWERS")]
    pub followers: usize,
    /// Size of the weights buffer in MiB (f32 parameters).
    #[arg(long, default_value_t = 1.0, env = "VOLLEY_BENCH_SIZE_MIB")]
    pub size_mib: f64,
    /// Timed versions, after one warm-up version.
    #[arg(long, default_value_t = 30, env = "VOLLEY_BENCH_VERSIONS")]
    pub versions: u64,
    /// Pause after every follower holds a version, before the next publish.
    #[arg(long, default_value_t = 200, env = "VOLLEY_BENCH_PAUSE_MS")]
    pub pause_ms: u64,
    /// How often a follower asks for a newer version (an actor asks between segments); 0: it
    /// waits for each version (woken by the pointer watch or a completed live frame), as the
    /// raw patterns' followers wait on their subscription.
    #[arg(long, default_value_t = 1.0, env = "VOLLEY_BENCH_POLL_MS")]
    pub poll_ms: f64,
    /// Layout hash (hex) driver and followers agree on; the buffer is not a real policy.
    #[arg(long, default_value = "62656e6368776774", env = "VOLLEY_BENCH_LAYOUT_HASH")]
    pub layout_hash: String,
    /// Give up when a version has not reached every follower (driver), or no new version came
    /// (follower), within this many seconds.
    #[arg(long, default_value_t = 60.0, env = "VOLLEY_BENCH_TIMEOUT_SECS")]
    pub timeout_secs: f64,
    /// A full frame every this many versions, deltas in between (1: every version full).
    #[arg(long, default_value_t = 16, env = "VOLLEY_BENCH_ANCHOR_EVERY")]
    pub anchor_every: u64,
    /// Weights whose full frame is at most this many KiB go inline in the pointer (0: never).
    #[arg(long, default_value_t = 256, env = "VOLLEY_BENCH_INLINE_MAX_KIB")]
    pub inline_max_kib: usize,
    /// Volley's weights path, or a raw NATS pattern moving the same bytes.
    #[arg(long, value_enum, default_value = "volley", env = "VOLLEY_BENCH_PATTERN")]
    pub pattern: BenchPattern,
}

/// A validated `volley bench-weights` configuration.
#[derive(Debug, Clone)]
pub struct BenchWeightsConfig {
    /// Transport config (its run is the benchmark's).
    pub nats: NatsConfig,
    /// Driver or follower.
    pub role: BenchRole,
    /// Follower processes.
    pub followers: usize,
    /// Buffer size in MiB, as given (passed on to the followers).
    pub size_mib: f64,
    /// Parameters per version: `size_mib` MiB of f32.
    pub n_params: usize,
    /// The agreed layout hash.
    pub layout_hash: u64,
    /// Timed versions (the last version number).
    pub versions: u64,
    /// Pause between versions.
    pub pause: Duration,
    /// Follower poll interval.
    pub poll: Duration,
    /// Per-version (driver) or idle (follower) limit.
    pub timeout: Duration,
    /// Volley's path or a raw pattern.
    pub pattern: BenchPattern,
}

impl TryFrom<BenchWeightsArgs> for BenchWeightsConfig {
    type Error = anyhow::Error;

    fn try_from(args: BenchWeightsArgs) -> anyhow::Result<Self> {
        let run = RunId::new(args.run.clone()).context("--run")?;
        if args.followers == 0 || args.followers > 256 {
            bail!("--followers: {} out of range 1..=256", args.followers);
        }
        if !(args.size_mib.is_finite() && args.size_mib > 0.0 && args.size_mib <= 1024.0) {
            bail!("--size-mib: {} out of range (0, 1024]", args.size_mib);
        }
        let n_params = ((args.size_mib * 1024.0 * 1024.0 / 4.0).round() as usize).max(1);
        if args.versions == 0 {
            bail!("--versions must be at least 1");
        }
        let layout_hash = u64::from_str_radix(args.layout_hash.trim_start_matches("0x"), 16)
            .with_context(|| format!("--layout-hash: {:?} is not a 64-bit hex number", args.layout_hash))?;
        // 0: each follower waits for the next version instead of polling.
        let poll = if args.poll_ms == 0.0 { Duration::ZERO } else { check_secs("--poll-ms", args.poll_ms * 1e-3)? };
        let timeout = check_secs("--timeout-secs", args.timeout_secs)?;
        if args.anchor_every == 0 {
            bail!("--anchor-every must be at least 1");
        }
        let mut nats = args.nats.config(run)?;
        nats.weights_anchor_every = args.anchor_every;
        nats.weights_inline_max_bytes = args.inline_max_kib.saturating_mul(1024);
        Ok(BenchWeightsConfig {
            nats,
            role: args.role,
            followers: args.followers,
            size_mib: args.size_mib,
            n_params,
            layout_hash,
            versions: args.versions,
            pause: Duration::from_millis(args.pause_ms),
            poll,
            timeout,
            pattern: args.pattern,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn learner_config(flags: &[&str]) -> anyhow::Result<LearnerConfig> {
        let cli = Cli::try_parse_from(["volley", "learner"].iter().chain(flags))?;
        match cli.command {
            Command::Learner(args) => LearnerConfig::try_from(args),
            other => panic!("parsed {other:?}"),
        }
    }

    /// Flags whose variable is not `VOLLEY_<FLAG>`, and why.
    const ENV_NAME_EXCEPTIONS: &[(&str, &str, &str)] = &[
        // Every NATS-connected subcommand: the variable says the value is a URL.
        ("learner", "nats", "VOLLEY_NATS_URL"),
        ("actor", "nats", "VOLLEY_NATS_URL"),
        ("bench-weights", "nats", "VOLLEY_NATS_URL"),
        ("env-serve", "nats", "VOLLEY_NATS_URL"),
        ("train", "nats", "VOLLEY_NATS_URL"),
        // The same setting as `train --envs-per-actor`: one ConfigMap key for both.
        ("actor", "envs", "VOLLEY_ENVS_PER_ACTOR"),
        // VOLLEY_SEED and VOLLEY_ENV are the run's, in the ConfigMap every actor reads: an
        // actor must not take the run seed as its own, nor the run's environment as an override.
        ("actor", "seed", "VOLLEY_ACTOR_SEED"),
        ("actor", "env", "VOLLEY_ACTOR_ENV"),
        // An environment server's settings are named after the service, not the flag.
        ("env-serve", "name", "VOLLEY_ENV_SERVICE"),
        ("env-serve", "max-sessions", "VOLLEY_ENV_MAX_SESSIONS"),
        ("env-serve", "max-envs-per-session", "VOLLEY_ENV_MAX_ENVS_PER_SESSION"),
        ("env-serve", "idle-timeout-secs", "VOLLEY_ENV_IDLE_TIMEOUT_SECS"),
    ];

    /// The variable a flag should read: the exception if listed, else `VOLLEY_<FLAG>` in upper
    /// snake case; the benchmark's own flags are `VOLLEY_BENCH_<FLAG>`, so it never picks up a
    /// real run's `VOLLEY_RUN` (its driver deletes the run's buckets).
    fn expected_env(subcommand: &str, long: &str) -> String {
        if let Some((_, _, env)) = ENV_NAME_EXCEPTIONS.iter().find(|(s, l, _)| *s == subcommand && *l == long) {
            return env.to_string();
        }
        let flag = long.to_uppercase().replace('-', "_");
        if subcommand == "bench-weights" && !long.starts_with("nats") {
            format!("VOLLEY_BENCH_{flag}")
        } else {
            format!("VOLLEY_{flag}")
        }
    }

    /// Issue 44: the learner's threads are the flag when given (in range), else the cores this
    /// process may use less the actor threads, never fewer than one.
    #[test]
    fn learner_threads_default_to_the_cores_the_actors_leave() {
        let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
        assert_eq!(learner_threads(Some(3), 1).unwrap(), 3);
        assert_eq!(learner_threads(None, 0).unwrap(), cores);
        assert_eq!(learner_threads(None, 1).unwrap(), cores.saturating_sub(1).max(1));
        assert_eq!(learner_threads(None, cores + 8).unwrap(), 1);
        assert!(learner_threads(Some(0), 1).is_err());
        let err = learner_config(&["--learner-threads", "0"]).unwrap_err();
        assert!(err.to_string().contains("--learner-threads: 0"), "{err}");
        assert_eq!(learner_config(&["--learner-threads", "2"]).unwrap().learner_threads, 2);
    }

    #[test]
    fn minatar_env_names_parse_to_their_games() {
        for game in MinatarGame::ALL {
            let choice = parse_env_choice(game.env_name()).unwrap();
            let EnvChoice::Builtin(name) = choice else { panic!("{} is built in", game.env_name()) };
            assert_eq!(name.as_str(), game.env_name());
            assert_eq!(EnvConfig::from_name(name.as_str()).unwrap(), EnvConfig::Minatar(MinatarConfig::new(game)));
        }
        let err = parse_env_choice("minatar-pong").unwrap_err();
        assert!(err.contains("minatar-space-invaders"), "{err}");
    }

    // Issue 17: docs/OPERATIONS.md and the `volley-run` ConfigMap rely on every flag having a
    // variable, and --task, --rooms, --room-len, --memory-cues, --memory-delay and
    // --episodes-per-item had none.
    #[test]
    fn every_flag_of_every_subcommand_has_a_volley_env_var_named_after_it() {
        use clap::CommandFactory;
        let cli = Cli::command();
        let mut problems = Vec::new();
        let mut used_exceptions = std::collections::HashSet::new();
        let mut n_flags = 0;
        let mut stack: Vec<(String, &clap::Command)> =
            cli.get_subcommands().map(|c| (c.get_name().to_string(), c)).collect();
        assert_eq!(stack.len(), 5, "train, learner, actor, bench-weights, env-serve");
        while let Some((name, command)) = stack.pop() {
            stack.extend(command.get_subcommands().map(|c| (format!("{name} {}", c.get_name()), c)));
            let mut envs = std::collections::HashMap::new();
            for arg in command.get_arguments() {
                let id = arg.get_id().as_str();
                if id == "help" || id == "version" {
                    continue;
                }
                let Some(long) = arg.get_long() else {
                    problems.push(format!("{name}: argument {id} has no long flag"));
                    continue;
                };
                n_flags += 1;
                let Some(env) = arg.get_env().and_then(|e| e.to_str()) else {
                    problems.push(format!("{name} --{long}: no VOLLEY_* env var"));
                    continue;
                };
                let expected = expected_env(&name, long);
                if env != expected {
                    problems.push(format!("{name} --{long}: env var {env}, expected {expected}"));
                }
                if ENV_NAME_EXCEPTIONS.iter().any(|(s, l, _)| *s == name && *l == long) {
                    used_exceptions.insert((name.clone(), long.to_string()));
                }
                if let Some(other) = envs.insert(env.to_string(), long.to_string()) {
                    problems.push(format!("{name}: --{other} and --{long} both read {env}"));
                }
            }
        }
        for (subcommand, long, _) in ENV_NAME_EXCEPTIONS {
            if !used_exceptions.contains(&(subcommand.to_string(), long.to_string())) {
                problems.push(format!("exception for {subcommand} --{long} matches no flag"));
            }
        }
        assert!(n_flags > 80, "walked only {n_flags} flags");
        assert!(problems.is_empty(), "{}", problems.join("\n"));
    }

    /// Issue 48: `--target-return -250` failed with "unexpected argument '-2' found"; only
    /// `--target-return=-250` worked. Every flag of every subcommand that takes a value now
    /// takes a negative number as its value: its own parser accepts it or names the flag.
    #[test]
    fn every_value_flag_takes_a_negative_number_as_its_value() {
        use clap::CommandFactory;
        for subcommand in ["train", "learner"] {
            let cli = Cli::try_parse_from(["volley", subcommand, "--env", "pendulum", "--target-return", "-250"])
                .unwrap_or_else(|err| panic!("{subcommand}: {err}"));
            let target = match cli.command {
                Command::Train(args) => args.target_return,
                Command::Learner(args) => args.target_return,
                other => panic!("parsed {other:?}"),
            };
            assert_eq!(target, Some(-250.0), "{subcommand}");
        }
        let cli = Cli::command();
        let mut n_checked = 0;
        for command in cli.get_subcommands() {
            for arg in command.get_arguments().filter(|a| a.get_action().takes_values()) {
                let long = arg.get_long().expect("every flag is long");
                let flag = format!("--{long}");
                let parsed = Cli::try_parse_from(["volley", command.get_name(), flag.as_str(), "-1"]);
                if let Err(err) = parsed {
                    assert_ne!(
                        err.kind(),
                        clap::error::ErrorKind::UnknownArgument,
                        "{} {flag} -1: {err}",
                        command.get_name()
                    );
                }
                n_checked += 1;
            }
        }
        assert!(n_checked > 80, "checked only {n_checked} flags");
    }

    /// Issue 48: `volley --help` said "train, learner, actor, bench" and left env-serve out.
    #[test]
    fn top_level_help_names_every_subcommand() {
        use clap::CommandFactory;
        let mut cli = Cli::command();
        let about = cli.get_about().map(|a| a.to_string()).unwrap_or_default();
        let help = cli.render_help().to_string();
        for command in Cli::command().get_subcommands() {
            let name = command.get_name();
            assert!(about.contains(name), "the about line {about:?} leaves out {name}");
            assert!(help.contains(name), "volley --help leaves out {name}");
        }
    }

    /// Issue 48: `--env` help left out pendulum. Every built-in environment is named in the
    /// help of `--env` and in the error for an unknown one.
    #[test]
    fn env_help_and_errors_name_every_builtin_environment() {
        use clap::CommandFactory;
        let cli = Cli::command();
        let train = cli.find_subcommand("train").expect("train");
        let env = train.get_arguments().find(|a| a.get_long() == Some("env")).expect("--env");
        let help = env.get_help().map(|h| h.to_string()).unwrap_or_default();
        let error = parse_env_choice("nonesuch").expect_err("unknown");
        for name in EnvName::value_variants() {
            let name = name.as_str();
            // MinAtar games are listed as minatar-GAME with the games' names.
            let listed = name.strip_prefix("minatar-").unwrap_or(name);
            assert!(help.contains(listed), "--env help leaves out {name}: {help}");
            assert!(error.contains(name), "the unknown-env error leaves out {name}: {error}");
        }
    }

    /// Issue 48: `env-serve --help` listed the weights and prefetch flags of learners and
    /// actors, which mean nothing to a server; it has the connection flags only.
    #[test]
    fn env_serve_has_only_the_nats_connection_flags() {
        use clap::CommandFactory;
        let cli = Cli::command();
        let longs = |name: &str| -> Vec<String> {
            let command = cli.find_subcommand(name).expect("subcommand");
            command.get_arguments().filter_map(|a| a.get_long().map(str::to_string)).collect()
        };
        let serve = longs("env-serve");
        let nats: Vec<&String> = serve.iter().filter(|l| l.starts_with("nats")).collect();
        assert_eq!(nats, ["nats", "nats-timeout-secs", "nats-user", "nats-password"], "{serve:?}");
        let actor = longs("actor");
        assert!(actor.iter().any(|l| l == "nats-weights-live"), "actors keep the weights flags: {actor:?}");
        let cli = Cli::try_parse_from(["volley", "env-serve", "--env", "pendulum", "--nats-timeout-secs", "2"])
            .expect("valid flags");
        let Command::EnvServe(args) = cli.command else { panic!("parsed {:?}", cli.command) };
        assert_eq!(args.nats.timeout().expect("valid"), Duration::from_secs(2));
        assert!(Cli::try_parse_from(["volley", "env-serve", "--nats-prefetch-calls", "2"]).is_err());
    }

    /// Issue 48: every remote environment's default run directory was `runs/local-remote-1`.
    #[test]
    fn default_run_dir_is_named_after_the_environment_or_the_service() {
        let cli = Cli::try_parse_from(["volley", "train", "--env", "pendulum", "--seed", "3"]).expect("valid flags");
        let Command::Train(args) = cli.command else { panic!("parsed {:?}", cli.command) };
        let mut spec = args.spec.to_spec().expect("a valid spec");
        assert_eq!(default_run_dir(&spec), PathBuf::from("runs/local-pendulum-3"));
        let service = EnvServiceName::new("pong").expect("valid name");
        spec.env = EnvConfig::Remote(RemoteEnvConfig::new(service, 84 * 84, 6));
        assert_eq!(default_run_dir(&spec), PathBuf::from("runs/local-pong-3"));
    }

    /// Issue 48: `train` stopped at a default `--max-secs 300`, which cut step-budgeted runs
    /// on slower machines; the wall-time cap is there only when asked for.
    #[test]
    fn train_has_no_wall_time_cap_unless_asked() {
        let config = |flags: &[&str]| {
            let cli = Cli::try_parse_from(["volley", "train"].iter().chain(flags)).expect("valid flags");
            let Command::Train(args) = cli.command else { panic!("parsed {:?}", cli.command) };
            TrainConfig::try_from(args).expect("a valid config")
        };
        assert_eq!(config(&["--max-env-steps", "5000000"]).max_duration, None);
        assert_eq!(config(&["--max-secs", "30"]).max_duration, Some(Duration::from_secs(30)));
    }

    /// Issue 48: `volley learner` without `--checkpoint-dir` wrote `./checkpoints/` into the
    /// working tree; the default is under `runs/`, which the repository's .gitignore ignores.
    #[test]
    fn the_default_checkpoint_is_under_git_ignored_runs() {
        let config = learner_config(&["--run", "demo"]).expect("defaults are valid");
        assert_eq!(config.checkpoint_path, PathBuf::from("runs/checkpoints/learner-demo.ckpt"));
        let gitignore = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/../.gitignore"))
            .expect("the repository's .gitignore");
        assert!(gitignore.lines().any(|line| line.trim() == "/runs"), "runs/ is not ignored:\n{gitignore}");
        assert!(gitignore.lines().any(|line| line.trim() == "/checkpoints"), "the old default is not ignored");
    }

    /// Issue 48: a replay stopped "solved" on the recorded actors' returns after 157K of 12M
    /// recorded steps. A replay has no target: `--target-return` is refused with the reason.
    #[test]
    fn a_replay_never_stops_solved() {
        let config = learner_config(&["--replay"]).expect("valid");
        assert_eq!(config.target_return, None);
        assert_eq!(learner_config(&[]).expect("valid").target_return, Some(475.0));
        let err = learner_config(&["--replay", "--target-return", "400"]).expect_err("refused").to_string();
        assert!(err.contains("--target-return with --replay"), "{err}");
    }

    #[test]
    fn several_tasks_fit_in_one_value_separated_by_semicolons() {
        let cli = Cli::try_parse_from([
            "volley",
            "train",
            "--env",
            "memory",
            "--work",
            "--task",
            "memory:delay=2,n_cues=2;memory:delay=8",
            "--task",
            "memory:delay=16",
        ])
        .expect("valid flags");
        let Command::Train(args) = cli.command else { panic!("parsed {:?}", cli.command) };
        assert_eq!(args.spec.tasks, ["memory:delay=2,n_cues=2", "memory:delay=8", "memory:delay=16"]);
    }

    /// Issue 14: `volley train --env pendulum` gets the defaults that learn pendulum (PPO,
    /// γ 0.9, ...), a flag given on the command line still wins, and other environments keep
    /// theirs; the policy head is Gaussian.
    #[test]
    fn pendulum_gets_its_own_defaults_and_flags_still_win() {
        let spec = |flags: &[&str]| {
            let cli = Cli::try_parse_from(["volley", "train"].iter().chain(flags)).expect("valid flags");
            let Command::Train(args) = cli.command else { panic!("parsed {:?}", cli.command) };
            args.spec.to_spec().expect("a valid spec")
        };
        let pendulum = spec(&["--env", "pendulum"]);
        assert_eq!(pendulum.hyper.loss, LossKind::Ppo);
        assert_eq!((pendulum.hyper.gamma, pendulum.hyper.reward_scale), (0.9, 0.1));
        assert_eq!((pendulum.segment_len, pendulum.hyper.batch_segments, pendulum.hyper.ppo_minibatches), (64, 32, 8));
        assert_eq!(pendulum.policy.head, ActionHead::Gaussian { squash: false });
        let tuned = spec(&["--env", "pendulum", "--gamma", "0.95", "--loss", "vtrace", "--squash-actions"]);
        assert_eq!((tuned.hyper.gamma, tuned.hyper.loss), (0.95, LossKind::Vtrace));
        assert_eq!(tuned.policy.head, ActionHead::Gaussian { squash: true });
        let cartpole = spec(&[]);
        assert_eq!((cartpole.hyper.loss, cartpole.hyper.gamma, cartpole.segment_len), (LossKind::Vtrace, 0.99, 32));
        assert_eq!(cartpole.policy.head, ActionHead::Categorical);
    }

    /// Issue 48, item 3: a served environment gets the defaults of its family from the spaces
    /// its servers declare: `volley env-serve --env pendulum` (box actions) trains with exactly
    /// the built-in `--env pendulum`'s run settings, a served image environment with the
    /// Atari-like ones, and a served discrete vector environment keeps CartPole's.
    #[test]
    fn a_served_environment_gets_the_defaults_of_its_declared_family() {
        let spec = |flags: &[&str], served: Option<RemoteEnvConfig>| {
            let cli = Cli::try_parse_from(["volley", "train"].iter().chain(flags)).expect("valid flags");
            let Command::Train(args) = cli.command else { panic!("parsed {:?}", cli.command) };
            args.spec
                .to_spec_with(&|_| served.clone().ok_or_else(|| anyhow::anyhow!("not served")))
                .expect("a valid spec")
        };
        let builtin = spec(&["--env", "pendulum"], None);
        // What env-serve's servers declare for the built-in pendulum.
        let pendulum = EnvConfig::Pendulum.build().expect("builds");
        let volley_env::ActionSpace::Box { low, high, .. } = pendulum.action_space() else {
            panic!("pendulum has box actions")
        };
        let service = EnvServiceName::new("pendulum").expect("valid");
        let served = RemoteEnvConfig {
            action_box: Some(volley_env::RemoteActionBox { low, high }),
            ..RemoteEnvConfig::new(service.clone(), pendulum.observation_space().dim(), 1)
        };
        let remote = spec(&["--env", "remote:pendulum"], Some(served));
        assert_eq!(remote.hyper, builtin.hyper);
        assert_eq!((remote.segment_len, &remote.policy), (builtin.segment_len, &builtin.policy));
        let image = RemoteEnvConfig { image: Some([1, 84, 84]), ..RemoteEnvConfig::new(service.clone(), 84 * 84, 6) };
        let pong = spec(&["--env", "remote:pong", "--frame-stack", "4", "--conv", "nature"], Some(image));
        assert_eq!((pong.hyper.loss, pong.hyper.reward_scale, pong.hyper.ent_coef), (LossKind::Vtrace, 1.0, 0.01));
        let discrete = spec(&["--env", "remote:cartpole"], Some(RemoteEnvConfig::new(service, 4, 2)));
        let cartpole = spec(&[], None);
        assert_eq!(discrete.hyper.loss, cartpole.hyper.loss);
        assert_eq!(
            (discrete.hyper.gamma, discrete.hyper.reward_scale),
            (cartpole.hyper.gamma, cartpole.hyper.reward_scale)
        );
        assert_eq!(
            (discrete.segment_len, discrete.hyper.batch_segments),
            (cartpole.segment_len, cartpole.hyper.batch_segments)
        );
    }

    /// Issue 45, item 2: MinAtar games train on unscaled rewards with an entropy bonus (without
    /// it Breakout seed 11 collapsed to a deterministic policy that scored 0), and flags still win.
    #[test]
    fn minatar_gets_an_entropy_bonus_on_unscaled_rewards() {
        let spec = |flags: &[&str]| {
            let cli = Cli::try_parse_from(["volley", "train"].iter().chain(flags)).expect("valid flags");
            let Command::Train(args) = cli.command else { panic!("parsed {:?}", cli.command) };
            args.spec.to_spec().expect("a valid spec")
        };
        for game in
            ["minatar-breakout", "minatar-asterix", "minatar-freeway", "minatar-seaquest", "minatar-space-invaders"]
        {
            let minatar = spec(&["--env", game]);
            assert_eq!(
                (minatar.hyper.loss, minatar.hyper.reward_scale, minatar.hyper.ent_coef),
                (LossKind::Vtrace, 1.0, 0.01)
            );
        }
        let tuned = spec(&["--env", "minatar-breakout", "--ent-coef", "0", "--reward-scale", "0.05"]);
        assert_eq!((tuned.hyper.ent_coef, tuned.hyper.reward_scale), (0.0, 0.05));
        let cartpole = spec(&[]);
        assert_eq!((cartpole.hyper.ent_coef, cartpole.hyper.reward_scale), (0.0, 0.05));
    }

    /// Issue 11: PPO on discrete actions gets an entropy bonus of 0.01 by default (without it,
    /// distributed CartPole runs collapsed to a deterministic policy); V-trace and the Gaussian
    /// head keep 0, and the flag still wins.
    #[test]
    fn ppo_on_discrete_actions_defaults_to_an_entropy_bonus() {
        let ent_coef = |flags: &[&str]| {
            let cli = Cli::try_parse_from(["volley", "train"].iter().chain(flags)).expect("valid flags");
            let Command::Train(args) = cli.command else { panic!("parsed {:?}", cli.command) };
            args.spec.to_spec().expect("a valid spec").hyper.ent_coef
        };
        assert_eq!(ent_coef(&["--loss", "ppo"]), 0.01);
        assert_eq!(ent_coef(&[]), 0.0);
        assert_eq!(ent_coef(&["--env", "pendulum"]), 0.0);
        assert_eq!(ent_coef(&["--loss", "ppo", "--ent-coef", "0"]), 0.0);
        assert_eq!(ent_coef(&["--ent-coef", "0.02"]), 0.02);
    }

    /// Regression for issue 11: `--publish-every 6` with the default `--max-policy-lag 4`
    /// stalled after five updates (99.6 % of segments stale); now it is refused at start.
    #[test]
    fn publish_every_beyond_the_lag_bound_is_refused_naming_both_values() {
        let err = learner_config(&["--publish-every", "6", "--max-policy-lag", "4"]).expect_err("refused");
        let message = err.to_string();
        assert!(message.contains("--publish-every 6") && message.contains("--max-policy-lag 4"), "{message}");
        let err = learner_config(&["--publish-every", "34"]).expect_err("refused at the default lag bound");
        assert!(err.to_string().contains("--max-policy-lag 32"), "{err}");
        // The largest cadence the lag bound allows, and a raised bound, are accepted.
        learner_config(&["--publish-every", "5", "--max-policy-lag", "4"]).expect("max-policy-lag + 1 trains");
        learner_config(&["--publish-every", "6", "--max-policy-lag", "5"]).expect("a raised bound allows it");
        learner_config(&["--publish-every", "33"]).expect("the default lag bound allows 33");
    }

    #[test]
    fn a_selection_pool_larger_than_the_consumer_delivers_is_refused() {
        let err = learner_config(&[
            "--batch-segments",
            "400",
            "--max-backlog-segments",
            "800",
            "--select-priority-alpha",
            "0.6",
            "--select-pool-factor",
            "3",
        ])
        .expect_err("refused");
        assert!(err.to_string().contains("--batch-segments 400"), "{err}");
        learner_config(&["--batch-segments", "400", "--max-backlog-segments", "800"]).expect("a 400-segment pool fits");
    }

    #[test]
    fn nats_replicas_reach_the_transport_config() {
        assert_eq!(learner_config(&[]).expect("defaults are valid").nats.replicas, 1);
        assert_eq!(learner_config(&["--nats-replicas", "3"]).expect("valid").nats.replicas, 3);
        for out_of_range in ["0", "6"] {
            let err = learner_config(&["--nats-replicas", out_of_range]).expect_err("refused");
            assert!(err.to_string().contains("--nats-replicas"), "{err}");
        }
    }

    #[test]
    fn group_flags_reach_the_spec_and_bad_combinations_are_refused() {
        let config =
            learner_config(&["--work", "--group-size", "8", "--group-share", "0.5", "--baseline", "group-std"])
                .expect("valid");
        let hyper = &config.spec.hyper;
        assert_eq!((hyper.work.group_size, hyper.work.group_share), (8, 0.5));
        assert_eq!(hyper.baseline, Baseline::GroupStd);
        let err = format!("{:#}", learner_config(&["--baseline", "group"]).expect_err("refused"));
        assert!(err.contains("needs group rollouts"), "{err}");
        let err = format!("{:#}", learner_config(&["--work", "--baseline", "group"]).expect_err("refused"));
        assert!(err.contains("group_size 1"), "{err}");
        let err =
            learner_config(&["--work", "--group-size", "4", "--baseline", "group", "--group-hold-segments", "995"])
                .expect_err("refused");
        assert!(err.to_string().contains("--group-hold-segments 995"), "{err}");
        let err = format!("{:#}", learner_config(&["--work", "--group-size", "65"]).expect_err("refused"));
        assert!(err.contains("work.group_size 65"), "{err}");
    }
}
