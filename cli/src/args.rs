//! Command-line arguments, validated once into the types the rest of the code trusts.

use std::path::PathBuf;
use std::time::Duration;

use anyhow::{bail, Context};
use clap::{Args, Parser, Subcommand, ValueEnum};
use volley_core::env::{EnvConfig, MemoryConfig, MilestonesConfig};
use volley_core::ids::RunId;
use volley_core::policy::{Activation, CoreKind, PolicySpec};
use volley_core::spec::{HyperParams, LossKind, RunSpec};

/// Volley: a distributed actor-learner system for reinforcement learning.
#[derive(Debug, Parser)]
#[command(name = "volley", version, about)]
pub struct Cli {
    /// What to do.
    #[command(subcommand)]
    pub command: Command,
}

/// Subcommands.
#[derive(Debug, Subcommand)]
pub enum Command {
    /// Train in one process: a learner and several actor threads on the embedded bus.
    Train(TrainArgs),
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
}

/// The recurrent core.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum CoreName {
    /// Feed-forward only.
    Mlp,
    /// A GRU after the MLP torso.
    Gru,
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

/// `volley train`.
#[derive(Debug, Args)]
pub struct TrainArgs {
    /// Environment.
    #[arg(long, value_enum, default_value = "cartpole", env = "VOLLEY_ENV")]
    pub env: EnvName,
    /// Run name ([a-z0-9-]{1,16}).
    #[arg(long, default_value = "local", env = "VOLLEY_RUN")]
    pub run: String,
    /// Base seed of the run.
    #[arg(long, default_value_t = 1, env = "VOLLEY_SEED")]
    pub seed: u64,
    /// Actor threads.
    #[arg(long, default_value_t = 1, env = "VOLLEY_ACTORS")]
    pub actors: usize,
    /// Environments per actor.
    #[arg(long, default_value_t = 8, env = "VOLLEY_ENVS_PER_ACTOR")]
    pub envs_per_actor: usize,
    /// Steps per segment (T).
    #[arg(long, default_value_t = 32, env = "VOLLEY_SEGMENT_LEN")]
    pub segment_len: usize,
    /// Segments per learner batch (B).
    #[arg(long, default_value_t = 8, env = "VOLLEY_BATCH_SEGMENTS")]
    pub batch_segments: usize,
    /// Stop after this many environment steps.
    #[arg(long, default_value_t = 300_000, env = "VOLLEY_MAX_ENV_STEPS")]
    pub max_env_steps: u64,
    /// Stop after this many seconds of wall time.
    #[arg(long, default_value_t = 300.0, env = "VOLLEY_MAX_SECS")]
    pub max_secs: f64,
    /// Stop when the mean return of the last 100 episodes reaches this (default: the
    /// environment's solved threshold; pass a huge value to train to the budget).
    #[arg(long, env = "VOLLEY_TARGET_RETURN")]
    pub target_return: Option<f32>,
    /// Loss.
    #[arg(long, value_enum, default_value = "vtrace", env = "VOLLEY_LOSS")]
    pub loss: LossName,
    /// Torso widths, comma-separated (empty for none).
    #[arg(long, default_value = "64,64", env = "VOLLEY_TORSO")]
    pub torso: String,
    /// Torso activation.
    #[arg(long, value_enum, default_value = "tanh", env = "VOLLEY_ACTIVATION")]
    pub activation: ActivationName,
    /// Recurrent core.
    #[arg(long, value_enum, default_value = "mlp", env = "VOLLEY_CORE")]
    pub core: CoreName,
    /// GRU width (with --core gru).
    #[arg(long, default_value_t = 64, env = "VOLLEY_GRU_HIDDEN")]
    pub gru_hidden: usize,
    /// Adam learning rate at the start (decays linearly to --final-learning-rate over --max-env-steps).
    #[arg(long, default_value_t = 2e-3, env = "VOLLEY_LEARNING_RATE")]
    pub learning_rate: f32,
    /// Learning rate reached at the end of the step budget (linear decay).
    #[arg(long, default_value_t = 0.0, env = "VOLLEY_FINAL_LEARNING_RATE")]
    pub final_learning_rate: f32,
    /// Discount γ.
    #[arg(long, default_value_t = 0.99, env = "VOLLEY_GAMMA")]
    pub gamma: f32,
    /// Multiply rewards by this before computing returns.
    #[arg(long, default_value_t = 0.05, env = "VOLLEY_REWARD_SCALE")]
    pub reward_scale: f32,
    /// Entropy bonus coefficient.
    #[arg(long, default_value_t = 0.0, env = "VOLLEY_ENT_COEF")]
    pub ent_coef: f32,
    /// PPO epochs per batch.
    #[arg(long, default_value_t = 10, env = "VOLLEY_PPO_EPOCHS")]
    pub ppo_epochs: u32,
    /// PPO minibatches per epoch.
    #[arg(long, default_value_t = 1, env = "VOLLEY_PPO_MINIBATCHES")]
    pub ppo_minibatches: u32,
    /// GAE λ.
    #[arg(long, default_value_t = 0.95, env = "VOLLEY_GAE_LAMBDA")]
    pub gae_lambda: f32,
    /// Drop segments whose lag exceeds this many versions.
    #[arg(long, default_value_t = 4, env = "VOLLEY_MAX_POLICY_LAG")]
    pub max_policy_lag: u64,
    /// Memory task: number of cues.
    #[arg(long, default_value_t = 2)]
    pub memory_cues: usize,
    /// Memory task: steps between cue and query.
    #[arg(long, default_value_t = 6)]
    pub memory_delay: usize,
    /// Milestones task: rooms.
    #[arg(long, default_value_t = 4)]
    pub rooms: usize,
    /// Milestones task: cells per room.
    #[arg(long, default_value_t = 8)]
    pub room_len: usize,
    /// Directory for metrics, curve and summary (default: runs/RUN-ENV-SEED).
    #[arg(long, env = "VOLLEY_RUN_DIR")]
    pub run_dir: Option<PathBuf>,
    /// Progress output.
    #[arg(long, value_enum, default_value = "auto", env = "VOLLEY_PROGRESS")]
    pub progress: ProgressMode,
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
    /// Wall-time budget.
    pub max_duration: Duration,
    /// Stop at this mean return (last 100 episodes).
    pub target_return: Option<f32>,
    /// Where outputs go.
    pub run_dir: PathBuf,
    /// Progress output.
    pub progress: ProgressMode,
}

/// The solved threshold of a built-in environment (mean return over 100 episodes).
pub fn solved_return(env: &EnvConfig) -> Option<f32> {
    match env {
        EnvConfig::Cartpole => Some(475.0),
        EnvConfig::Memory(_) => Some(0.95),
        EnvConfig::Milestones(_) => Some(0.9),
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

impl TryFrom<TrainArgs> for TrainConfig {
    type Error = anyhow::Error;

    fn try_from(args: TrainArgs) -> anyhow::Result<Self> {
        let run = RunId::new(args.run.clone()).context("--run")?;
        if args.actors == 0 || args.actors > 256 {
            bail!("--actors: {} out of range 1..=256", args.actors);
        }
        if args.envs_per_actor == 0 || args.envs_per_actor > 4096 {
            bail!("--envs-per-actor: {} out of range 1..=4096", args.envs_per_actor);
        }
        if !(args.max_secs.is_finite() && args.max_secs > 0.0) {
            bail!("--max-secs: {} must be a positive number of seconds", args.max_secs);
        }
        if args.max_env_steps == 0 {
            bail!("--max-env-steps must be at least 1");
        }
        if args.target_return.is_some_and(|t| t.is_nan()) {
            bail!("--target-return must be a number");
        }
        if args.gru_hidden == 0 || args.gru_hidden > 4096 {
            bail!("--gru-hidden: {} out of range 1..=4096", args.gru_hidden);
        }
        let env = match args.env {
            EnvName::Cartpole => EnvConfig::Cartpole,
            EnvName::Memory => EnvConfig::Memory(MemoryConfig { n_cues: args.memory_cues, delay: args.memory_delay }),
            EnvName::Milestones => EnvConfig::Milestones(MilestonesConfig {
                n_rooms: args.rooms,
                room_len: args.room_len,
                ..MilestonesConfig::default()
            }),
        };
        let probe = env.build().context("environment config")?;
        let policy = PolicySpec {
            obs_dim: probe.observation_space().dim(),
            n_actions: probe.action_space().n,
            torso: parse_widths(&args.torso)?,
            activation: match args.activation {
                ActivationName::Tanh => Activation::Tanh,
                ActivationName::Relu => Activation::Relu,
            },
            core: match args.core {
                CoreName::Mlp => CoreKind::Mlp,
                CoreName::Gru => CoreKind::Gru { hidden: args.gru_hidden },
            },
        };
        let steps_per_update = (args.segment_len * args.batch_segments) as u64;
        let hyper = HyperParams {
            loss: match args.loss {
                LossName::Vtrace => LossKind::Vtrace,
                LossName::Ppo => LossKind::Ppo,
            },
            gamma: args.gamma,
            reward_scale: args.reward_scale,
            learning_rate: args.learning_rate,
            final_learning_rate: args.final_learning_rate,
            lr_decay_updates: (args.max_env_steps / steps_per_update.max(1)).max(1),
            ent_coef: args.ent_coef,
            ppo_epochs: args.ppo_epochs,
            ppo_minibatches: args.ppo_minibatches,
            gae_lambda: args.gae_lambda,
            batch_segments: args.batch_segments,
            max_policy_lag: args.max_policy_lag,
            ..HyperParams::default()
        };
        let spec = RunSpec { run, env, policy, segment_len: args.segment_len, hyper, seed: args.seed };
        spec.validate().context("invalid training configuration")?;
        let target_return = args.target_return.or_else(|| solved_return(&spec.env));
        let run_dir = args
            .run_dir
            .unwrap_or_else(|| PathBuf::from(format!("runs/{}-{}-{}", spec.run, spec.env.name(), spec.seed)));
        Ok(TrainConfig {
            actors: args.actors,
            envs_per_actor: args.envs_per_actor,
            max_env_steps: args.max_env_steps,
            max_duration: Duration::from_secs_f64(args.max_secs),
            target_return,
            run_dir,
            progress: args.progress,
            spec,
        })
    }
}
