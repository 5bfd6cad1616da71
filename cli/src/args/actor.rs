//! `volley actor`: its flags.

use clap::Args;

use super::{parse_env_choice, EnvChoice, MetricsArgs, NatsArgs, RemoteEnvArgs, WeightsTrustArgs};

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
    /// This actor's id (default: the name of its `--nats-nkey-file` identity, else the pod name
    /// from $POD_NAME or $HOSTNAME, else generated).
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
    /// The public keys weights must be signed with.
    #[command(flatten)]
    pub weights_trust: WeightsTrustArgs,
}
