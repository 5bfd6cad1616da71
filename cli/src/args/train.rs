//! `volley train`: its flags, their validated config, and the default run directory.

use std::path::PathBuf;
use std::time::Duration;

use anyhow::bail;
use clap::{Args, ValueEnum};
use volley_core::spec::RunSpec;
use volley_env::EnvConfig;
use volley_learner::backend::BackendKind;

use super::{check_secs, check_target, solved_return, BackendName, NatsArgs, RemoteEnvArgs, SpecArgs};

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
    /// per actor thread, at least 1, so actors and learner do not share a core; with
    /// `--env remote:<service>` every core, since the actor threads mostly wait for the servers).
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
        let spec = args.spec.to_spec_with(&|service| args.nats.remote_env_config(service, env_wait))?;
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
            learner_threads: learner_threads(args.learner_threads, busy_actor_threads(args.actors, remote.is_some()))?,
            remote,
            tensorboard: args.tensorboard,
            spec,
        })
    }
}

/// The actor threads of `volley train` that keep a core busy: every one on a built-in
/// environment, none on a served one, whose actor threads spend most of their time waiting for
/// the servers (Pong: the Nature-DQN policy step runs at 1.5–2.6 K agent steps/s per core, so
/// at the few hundred a second that the learner keeps up with it takes a fifth of a core or
/// less), so the learner's update gets every core.
fn busy_actor_threads(actors: usize, served: bool) -> usize {
    if served {
        0
    } else {
        actors
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

#[cfg(test)]
mod tests {
    use clap::Parser;
    use volley_env::RemoteEnvConfig;
    use volley_transport::envsvc::EnvServiceName;

    use super::*;
    use crate::args::tests::learner_config;
    use crate::args::{Cli, Command};

    /// Issue 44: the learner's threads are the flag when given (in range), else the cores this
    /// process may use less the actor threads (none for a served environment), never fewer than one.
    #[test]
    fn learner_threads_default_to_the_cores_the_actors_leave() {
        let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
        assert_eq!(learner_threads(Some(3), 1).unwrap(), 3);
        assert_eq!(learner_threads(None, 0).unwrap(), cores);
        assert_eq!(learner_threads(None, 1).unwrap(), cores.saturating_sub(1).max(1));
        assert_eq!(learner_threads(None, cores + 8).unwrap(), 1);
        assert!(learner_threads(Some(0), 1).is_err());
        assert_eq!(busy_actor_threads(2, false), 2);
        assert_eq!(learner_threads(None, busy_actor_threads(1, true)).unwrap(), cores);
        let err = learner_config(&["--learner-threads", "0"]).unwrap_err();
        assert!(err.to_string().contains("--learner-threads: 0"), "{err}");
        assert_eq!(learner_config(&["--learner-threads", "2"]).unwrap().learner_threads, 2);
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
}
