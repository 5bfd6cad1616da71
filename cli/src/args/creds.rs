//! `volley creds`: its flags.

use std::path::PathBuf;

use clap::{Args, Subcommand};

/// `volley creds`: make credentials for a run's broker config.
#[derive(Debug, Args)]
pub struct CredsArgs {
    /// What to make.
    #[command(subcommand)]
    pub command: CredsCommand,
}

/// What `volley creds` makes.
#[derive(Debug, Subcommand)]
pub enum CredsCommand {
    /// One NKey identity per actor (issue 46): a seed file `<id>.nk` for each actor, and the
    /// broker-config user blocks that let each publish under its own id only.
    Actors(CredsActorsArgs),
}

/// `volley creds actors`.
#[derive(Debug, Args)]
pub struct CredsActorsArgs {
    /// The run the identities join (their subjects are the run's).
    #[arg(long, env = "VOLLEY_CREDS_RUN", default_value = "local")]
    pub run: String,
    /// Identities to make: `<prefix><first>` to `<prefix><first + count − 1>`.
    #[arg(long, env = "VOLLEY_CREDS_COUNT", value_parser = clap::value_parser!(u32).range(1..=10_000))]
    pub count: u32,
    /// Index of the first identity.
    #[arg(long, env = "VOLLEY_CREDS_FIRST", default_value_t = 0)]
    pub first: u32,
    /// Start of every identity's name (the actor id; a StatefulSet's pods are `<name>-<ordinal>`).
    #[arg(long, env = "VOLLEY_CREDS_PREFIX", default_value = "actor-")]
    pub prefix: String,
    /// Environment services the actors may call (comma-separated; empty for none).
    #[arg(long, env = "VOLLEY_CREDS_ENV_SERVICES", value_delimiter = ',', default_value = "cartpole")]
    pub env_services: Vec<String>,
    /// Directory for the seed files and the broker-config files (created if missing; existing
    /// seed files are never overwritten).
    #[arg(long, env = "VOLLEY_CREDS_OUT")]
    pub out: PathBuf,
}
