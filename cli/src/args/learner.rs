//! `volley learner`: its flags, their validated config, and the check that updates can happen.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use anyhow::{bail, Context};
use clap::Args;
use volley_core::spec::{LossKind, RunSpec};
use volley_learner::backend::BackendKind;
use volley_learner::Checkpoint;
use volley_transport::nats::{NatsConfig, CONSUMER_MAX_ACK_PENDING};
use volley_transport::signing::WeightsSigningKey;

use super::{
    check_secs, check_target, learner_threads, solved_return, BackendName, MetricsArgs, NatsArgs, SpecArgs,
    WeightsSigningArgs,
};

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
    /// The key weights are signed with.
    #[command(flatten)]
    pub weights_signing: WeightsSigningArgs,
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
    /// The key every weights version is signed with (`--weights-signing-key`).
    pub weights_signing_key: Option<Arc<WeightsSigningKey>>,
}

impl TryFrom<LearnerArgs> for LearnerConfig {
    type Error = anyhow::Error;

    fn try_from(args: LearnerArgs) -> anyhow::Result<Self> {
        let env_wait = check_secs("--env-wait-secs", args.env_wait_secs)?;
        let mut spec = args.spec.to_spec_with(&|service| args.nats.remote_env_config(service, env_wait))?;
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
            weights_signing_key: args.weights_signing.load()?,
            nats,
            spec,
        })
    }
}

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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::args::tests::learner_config;

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
}
