//! The `volley` command. Start at [`args::Command`].

mod args;
mod bench;
mod creds;
mod curve;
mod distributed;
mod env_serve;
mod remote_env;
mod serve;
mod tls_certs;
mod train;

use std::io::IsTerminal;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, LazyLock};

use clap::Parser;
use tracing::warn;
use tracing_subscriber::EnvFilter;

use crate::args::{BenchWeightsConfig, Cli, Command, KeysArgs, KeysCommand, LearnerConfig, ProgressMode, TrainConfig};

/// Exit status of a learner stopped by a signal before its run ended, after its final
/// checkpoint: EX_TEMPFAIL ("try again"). Exit 0 means the run is over (solved, a budget spent,
/// the replay done), so a Kubernetes Job completes on 0 and restarts the learner, which resumes,
/// on this (docs/OPERATIONS.md, "When a run ends").
const EXIT_LEARNER_INTERRUPTED: i32 = 75;

/// Set by the first SIGINT or SIGTERM. Every wait of the process checks it, those inside
/// config validation too (a learner asking an environment server for its spaces), so one
/// signal is enough (issue 48 item 4).
static INTERRUPTED: LazyLock<Arc<AtomicBool>> = LazyLock::new(|| Arc::new(AtomicBool::new(false)));

/// Whether a signal asked the process to stop.
pub(crate) fn interrupted() -> bool {
    INTERRUPTED.load(Ordering::Acquire)
}

/// A wait given up because a signal asked the process to stop: not a failure. `main` ends the
/// process with one line saying what was interrupted and the status of an interrupted run.
#[derive(Debug)]
pub(crate) struct Interrupted(pub String);

impl std::fmt::Display for Interrupted {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "interrupted while {}", self.0)
    }
}

impl std::error::Error for Interrupted {}

/// Log to stderr at `default_level` unless `RUST_LOG` says otherwise (an explicit `RUST_LOG`
/// always wins, also over `--progress quiet`).
fn init_tracing(default_level: &str) {
    let filter = EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new(default_level));
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_ansi(std::io::stderr().is_terminal())
        .with_writer(std::io::stderr);
    if std::env::var("VOLLEY_LOG_FORMAT").is_ok_and(|f| f == "json") {
        builder.json().init();
    } else {
        builder.init();
    }
}

fn main() -> anyhow::Result<()> {
    let cli = Cli::parse();
    // `volley train --progress quiet` prints the summary and nothing else unless something
    // fails (issue 48: it printed every INFO and WARN line).
    let quiet = matches!(&cli.command, Command::Train(args) if args.progress == ProgressMode::Quiet);
    init_tracing(if quiet { "error" } else { "info" });
    let interrupted = INTERRUPTED.clone();
    {
        let interrupted = interrupted.clone();
        ctrlc::set_handler(move || {
            if interrupted.swap(true, Ordering::AcqRel) {
                // Second Ctrl-C: the user wants out now.
                std::process::exit(130);
            }
            warn!("interrupted; stopping (signal again to abort at once)");
        })?;
    }
    let learner = matches!(cli.command, Command::Learner(_));
    match run(cli.command, interrupted) {
        Err(err) if err.chain().any(|cause| cause.is::<Interrupted>()) => {
            let what = err.chain().find_map(|cause| cause.downcast_ref::<Interrupted>()).map(|i| i.0.clone());
            warn!("interrupted while {}; stopped", what.unwrap_or_default());
            // A learner stopped before its run ended exits as one stopped mid-run does, so a
            // Kubernetes Job starts it again; the other commands end as on a signal mid-run.
            if learner {
                std::process::exit(EXIT_LEARNER_INTERRUPTED);
            }
            Ok(())
        }
        other => other,
    }
}

/// Run one subcommand until it is done or interrupted.
fn run(command: Command, interrupted: Arc<AtomicBool>) -> anyhow::Result<()> {
    match command {
        Command::Train(args) => {
            let config = TrainConfig::try_from(args)?;
            let summary = train::train(config, interrupted)?;
            println!("{}", serde_json::to_string(&summary)?);
        }
        Command::Learner(args) => {
            let config = LearnerConfig::try_from(args)?;
            let summary = distributed::learner(config, interrupted)?;
            println!("{}", serde_json::to_string(&summary)?);
            if summary.stop_reason == "interrupted" {
                std::process::exit(EXIT_LEARNER_INTERRUPTED);
            }
        }
        Command::Actor(args) => distributed::actor(args, interrupted)?,
        Command::EnvServe(args) => env_serve::env_serve(args, interrupted)?,
        Command::Creds(args) => match args.command {
            args::CredsCommand::Actors(args) => println!("{}", serde_json::to_string(&creds::creds_actors(&args)?)?),
        },
        Command::TlsCerts(args) => tls_certs::tls_certs(args)?,
        Command::Keys(KeysArgs { command: KeysCommand::Generate(args) }) => {
            let (private, public) =
                volley_transport::signing::generate_key_files(&args.out, args.public_out.as_deref(), args.if_missing)?;
            println!("{}", serde_json::json!({ "signing_key": private, "public_key": public }));
        }
        Command::BenchWeights(args) => {
            let config = BenchWeightsConfig::try_from(args)?;
            if let Some(summary) = bench::bench_weights(&config, &interrupted)? {
                println!("{}", serde_json::to_string(&summary)?);
            }
        }
    }
    Ok(())
}
