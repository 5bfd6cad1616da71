//! Which environment (`--env`, `--task`), its solved return, and the value enums of the spec flags.

use anyhow::Context;
use clap::ValueEnum;
use volley_env::{EnvConfig, MinatarGame, REMOTE_PREFIX};
use volley_learner::backend::BackendKind;
use volley_transport::envsvc::EnvServiceName;

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

#[cfg(test)]
mod tests {
    use volley_env::MinatarConfig;

    use super::*;
    use crate::args::Cli;

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
}
