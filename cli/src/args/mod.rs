//! Command-line arguments, validated once into the types the rest of the code trusts.

use clap::{Parser, Subcommand};

mod actor;
mod bench;
mod creds;
mod env;
mod env_serve;
mod keys;
mod learner;
mod nats;
mod spec;
mod tls_certs;
mod train;

pub use self::actor::ActorArgs;
pub use self::bench::{BenchPattern, BenchRole, BenchWeightsArgs, BenchWeightsConfig};
pub use self::creds::{CredsActorsArgs, CredsArgs, CredsCommand};
pub use self::env::{
    parse_env_choice, parse_task, solved_return, ActivationName, BackendName, BaselineName, BudgetName, ConvName,
    CoreName, EnvChoice, EnvName, LossName,
};
pub use self::env_serve::EnvServeArgs;
pub use self::keys::{KeysArgs, KeysCommand, WeightsSigningArgs, WeightsTrustArgs};
pub use self::learner::{LearnerArgs, LearnerConfig};
pub use self::nats::{MetricsArgs, NatsArgs, NatsConnectArgs, RemoteEnvArgs};
pub use self::spec::SpecArgs;
use self::spec::{check_secs, check_target};
pub use self::tls_certs::TlsCertsArgs;
pub use self::train::{learner_threads, ProgressMode, RunDir, TrainArgs, TrainConfig, TrainRemote};

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
    /// Make credentials for a run's broker config: `volley creds actors` makes one NKey
    /// identity per actor (docs/SECURITY.md).
    Creds(CredsArgs),
    /// Write a development CA, a NATS server certificate and client certificates (PEM) for
    /// TLS where no cert-manager issues them (deploy/local-run.sh, deploy/compose.yaml).
    TlsCerts(TlsCertsArgs),
    /// Make the keys that sign weights: `volley keys generate --out DIR`.
    Keys(KeysArgs),
}

#[cfg(test)]
mod tests {
    use super::*;

    pub(super) fn learner_config(flags: &[&str]) -> anyhow::Result<LearnerConfig> {
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
        // Where `volley keys generate` writes: named after the command, not a bare `OUT`.
        ("keys generate", "out", "VOLLEY_KEYS_OUT"),
        ("keys generate", "public-out", "VOLLEY_KEYS_PUBLIC_OUT"),
        ("keys generate", "if-missing", "VOLLEY_KEYS_IF_MISSING"),
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
        } else if subcommand.starts_with("creds") {
            // A tool run by an operator, not a process of a run: its own prefix, so it never
            // picks up a run's `VOLLEY_RUN`.
            format!("VOLLEY_CREDS_{flag}")
        } else {
            format!("VOLLEY_{flag}")
        }
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
        assert_eq!(stack.len(), 8, "train, learner, actor, bench-weights, env-serve, creds, tls-certs, keys");
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
}
