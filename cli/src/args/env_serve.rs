//! `volley env-serve`: its flags and the environment server config they make.

use anyhow::{bail, Context};
use clap::Args;
use volley_env::EnvConfig;
use volley_transport::envsvc::EnvServiceName;

use super::{check_secs, solved_return, EnvName, NatsConnectArgs};

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

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use clap::Parser;

    use crate::args::{Cli, Command};

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
        assert_eq!(
            nats,
            [
                "nats",
                "nats-timeout-secs",
                "nats-user",
                "nats-password",
                "nats-tls-ca",
                "nats-tls-cert",
                "nats-tls-key",
                "nats-tls-required"
            ],
            "{serve:?}"
        );
        let actor = longs("actor");
        assert!(actor.iter().any(|l| l == "nats-weights-live"), "actors keep the weights flags: {actor:?}");
        let cli = Cli::try_parse_from(["volley", "env-serve", "--env", "pendulum", "--nats-timeout-secs", "2"])
            .expect("valid flags");
        let Command::EnvServe(args) = cli.command else { panic!("parsed {:?}", cli.command) };
        assert_eq!(args.nats.timeout().expect("valid"), Duration::from_secs(2));
        assert!(Cli::try_parse_from(["volley", "env-serve", "--nats-prefetch-calls", "2"]).is_err());
    }
}
