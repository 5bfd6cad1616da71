//! `volley train`: the learner on this thread, actors on their own threads, the embedded bus
//! between them; progress on stderr, a run directory with metrics and a learning curve, and a
//! one-line JSON summary on stdout.

use std::fs::{self, File};
use std::io::{BufWriter, IsTerminal, Write};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::thread;
use std::time::{Duration, Instant};

use anyhow::Context;
use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};
use tracing::{info, warn};
use volley_actor::{ActorCounters, RolloutWorker};
use volley_core::ids::{ActorId, PolicyVersion};
use volley_env::EnvConfig;
use volley_learner::scheduler::{Planned, Scheduler, WorkPlanner};
use volley_learner::tensorboard::TensorBoardLog;
use volley_learner::{run_learner, Learner, LearnerControl, LearnerReport, RunLimits, UpdateStats};
use volley_transport::envsvc::{EnvServiceClient, RemoteVecEnv, RemoteVecEnvConfig};
use volley_transport::local::{trajectory_channel, weights_channel};
use volley_transport::work::{local_work_queue, LocalSnapshotStore};

use crate::args::{ProgressMode, RunDir, TrainConfig, TrainRemote};
use crate::curve;

/// Snapshots the embedded run keeps (its retention bound).
const LOCAL_SNAPSHOT_CAPACITY: usize = 4096;

/// The files a run directory holds; a directory with any of them holds a run.
const RUN_FILES: [&str; 5] = ["spec.json", "metrics.jsonl", "curve.svg", "summary.json", "work.jsonl"];

/// Suffixes a rerun tries after the default run directory (`-2`, `-3`, ...) before giving up.
const MAX_RUN_DIR_SUFFIX: u32 = 10_000;

/// The summary printed as one JSON line at the end.
#[derive(Debug, serde::Serialize)]
pub struct TrainSummary {
    /// Environment name.
    pub env: String,
    /// Where the learner ran: `cpu` or `cuda: <device>`.
    pub backend: String,
    /// Seed.
    pub seed: u64,
    /// Environment steps consumed by the learner.
    pub env_steps: u64,
    /// Wall time of the training loop.
    pub wall_secs: f64,
    /// Mean return of the last 100 episodes.
    pub final_mean_return: f32,
    /// Mean return of the last 20 episodes.
    pub final_mean_return_20: f32,
    /// Whether the last-100 mean reached the solved threshold.
    pub solved: bool,
    /// Solved threshold used.
    pub target_return: Option<f32>,
    /// Updates applied.
    pub updates: u64,
    /// Final policy version.
    pub policy_version: PolicyVersion,
    /// Episodes finished.
    pub episodes: u64,
    /// Env steps and seconds when the last-20 mean first reached the threshold.
    pub steps_to_target_20: Option<u64>,
    /// Seconds to the same.
    pub secs_to_target_20: Option<f64>,
    /// Env steps when the last-100 mean first reached the threshold.
    pub steps_to_target_100: Option<u64>,
    /// Seconds to the same.
    pub secs_to_target_100: Option<f64>,
    /// Segments dropped as too stale.
    pub segments_stale: u64,
    /// Segments rejected as malformed.
    pub segments_rejected: u64,
    /// Segments dropped by trajectory selection, by reason (`stale` repeats `segments_stale`).
    pub segments_dropped: std::collections::BTreeMap<&'static str, u64>,
    /// Segments received but neither used nor dropped when training stopped (the selection
    /// pool and segments held for incomplete stitched windows).
    pub segments_unused: u64,
    /// Group rollouts: segments out of the group hold by outcome (`grouped`, `critic_lag`,
    /// `critic_capacity`, `critic_lost`), and groups completed; empty without group rollouts.
    pub group_segments: std::collections::BTreeMap<&'static str, u64>,
    /// Stitched BPTT windows by outcome (`full`, or shorter: `gap`, `evicted`, `timeout`,
    /// `lag`); every segment is one `full` window without `--bptt-segments`.
    pub windows: std::collections::BTreeMap<&'static str, u64>,
    /// Environment failures that were reset.
    pub env_errors: u64,
    /// Largest policy lag the learner trained on (versions): its version at an update minus
    /// the behaviour policy's version of a batch column's oldest segment, the `lag` of the
    /// progress line and of `metrics.jsonl`. With `--bptt-segments K` a window's first segment
    /// waits for the other K − 1, so this exceeds `lag_max_on_arrival`.
    pub lag_max: u64,
    /// Largest lag of a segment when it reached the learner (versions), before it waited in
    /// the selection pool or for its window.
    pub lag_max_on_arrival: u64,
    /// Fraction of loop time the learner waited for data.
    pub learner_wait_ratio: f64,
    /// Why training stopped.
    pub stop_reason: String,
    /// Where the run's files are.
    pub run_dir: String,
}

/// One line of `metrics.jsonl`, written after every update.
#[derive(Debug, serde::Serialize)]
struct MetricsRow {
    update: u64,
    policy_version: PolicyVersion,
    env_steps: u64,
    wall_secs: f64,
    episodes: u64,
    mean_return_20: Option<f32>,
    mean_return_100: Option<f32>,
    loss_total: f32,
    loss_policy: f32,
    loss_value: f32,
    entropy: f32,
    grad_norm: f32,
    learning_rate: f32,
    ent_coef: f32,
    lag_max: u64,
    lag_mean: f32,
    segments_stale: u64,
    backlog: Option<u64>,
    /// Off-policy health (docs/OPERATIONS.md); absent on the CUDA backend.
    rho_clipped_fraction: Option<f32>,
    behaviour_kl: Option<f32>,
    effective_sample_fraction: Option<f32>,
    explained_variance: Option<f32>,
}

fn finite(x: f32) -> Option<f32> {
    x.is_finite().then_some(x)
}

/// Run `volley train`.
pub fn train(config: TrainConfig, interrupted: Arc<AtomicBool>) -> anyhow::Result<TrainSummary> {
    let spec = config.spec.clone();
    let run_dir = claim_run_dir(&config.run_dir)?;
    fs::write(run_dir.join("spec.json"), serde_json::to_string_pretty(&spec)?).context("writing spec.json")?;
    info!(
        env = spec.env.name(),
        seed = spec.seed,
        actors = config.actors,
        envs_per_actor = config.envs_per_actor,
        segment_len = spec.segment_len,
        batch_segments = spec.hyper.batch_segments,
        loss = ?spec.hyper.loss,
        policy = ?spec.policy,
        run_dir = %run_dir.display(),
        "training"
    );
    let mut learner = Learner::new(spec.clone()).context("building the learner")?;
    learner.set_cpu_threads(config.learner_threads).context("--learner-threads")?;
    learner.use_backend(config.backend).context("--backend")?;
    // Room for one batch in flight besides the one being trained on: actors run at most about
    // one version ahead, which bounds the lag (pacing by backpressure).
    let capacity = spec.hyper.batch_segments.max(config.envs_per_actor);
    let (sink, mut source) = trajectory_channel(capacity);
    let (mut publisher, follower) = weights_channel();
    let stop_actors = Arc::new(AtomicBool::new(false));
    let counters: Vec<Arc<ActorCounters>> = (0..config.actors).map(|_| Arc::new(ActorCounters::default())).collect();
    let mut handles = Vec::with_capacity(config.actors);
    // Save-load and budget assignment: the learner schedules every episode.
    let work = &spec.hyper.work;
    let (work_queue, work_source) = local_work_queue();
    let snapshot_store = LocalSnapshotStore::new(LOCAL_SNAPSHOT_CAPACITY);
    let mut planner = work.enabled.then(|| {
        let scheduler = Scheduler::new(work, &spec.env, spec.seed, 0);
        let target = u64::from(work.queue_per_slot) * (config.actors * config.envs_per_actor) as u64;
        let mut planner = WorkPlanner::new(scheduler, Box::new(work_queue), target);
        if let Ok(file) = File::create(run_dir.join("work.jsonl")) {
            planner = planner.with_log(Box::new(BufWriter::new(file)));
        }
        planner.top_up();
        planner
    });
    for (actor_idx, actor_counters) in counters.iter().enumerate() {
        let actor_id = ActorId::new(format!("actor-{actor_idx}")).expect("generated actor ids are valid");
        let seed = spec.seed.wrapping_mul(1_000_003).wrapping_add(actor_idx as u64);
        let worker = match (&spec.env, &config.remote) {
            // A remote environment: each actor thread steps its own sessions on the servers.
            (EnvConfig::Remote(remote), Some(nats)) => {
                let envs = remote_envs(remote, nats, config.envs_per_actor, seed, actor_counters, &interrupted)
                    .and_then(|envs| crate::remote_env::actor_envs(envs, remote))
                    .with_context(|| format!("remote environment {} for actor {actor_id}", remote.service))?;
                RolloutWorker::with_envs(spec.clone(), actor_id.clone(), envs, seed, actor_counters.clone())
            }
            _ => {
                RolloutWorker::new(spec.clone(), actor_id.clone(), config.envs_per_actor, seed, actor_counters.clone())
            }
        }
        .with_context(|| format!("building actor {actor_id}"))?;
        let worker = if work.enabled {
            worker
                .with_work(Box::new(work_source.clone()), Box::new(snapshot_store.clone()))
                .context("scheduling the actor's episodes")?
        } else {
            worker
        };
        let mut sink = sink.clone();
        let mut follower = follower.clone();
        let stop = stop_actors.clone();
        let handle = thread::Builder::new()
            .name(format!("volley-{actor_id}"))
            .spawn(move || worker.run(&mut sink, &mut follower, &stop))
            .context("spawning an actor thread")?;
        handles.push(handle);
    }
    drop(sink);

    let limits = RunLimits {
        max_env_steps: Some(config.max_env_steps),
        max_duration: config.max_duration,
        target_return: config.target_return,
        max_updates: None,
        publish_every: 1,
        resume_env_steps: 0,
    };
    let metrics_file = File::create(run_dir.join("metrics.jsonl")).context("creating metrics.jsonl")?;
    let tensorboard =
        config.tensorboard.as_deref().map(|dir| TensorBoardLog::create(dir).context("--tensorboard")).transpose()?;
    let mut progress = Progress::new(config.progress, config.max_env_steps, metrics_file, tensorboard);
    let report = match planner.as_mut() {
        Some(planner) => run_learner(
            &mut learner,
            &mut source,
            &mut publisher,
            &limits,
            &interrupted,
            &mut Planned { inner: &mut progress, planner },
        ),
        None => run_learner(&mut learner, &mut source, &mut publisher, &limits, &interrupted, &mut progress),
    };
    if let Some(planner) = &planner {
        let scheduler = &planner.scheduler;
        let (fresh, resumed) = scheduler.items_issued();
        let tasks: Vec<String> = scheduler
            .task_stats()
            .iter()
            .zip(scheduler.budget_shares())
            .map(|(s, share)| format!("{:.2}@{:.2}", s.outcomes.success_rate(), share))
            .collect();
        info!(fresh, resumed, snapshots = scheduler.known_snapshots(), tasks = ?tasks, "work items (task success@budget share)");
    }
    stop_actors.store(true, Ordering::Release);
    source.close();
    for handle in handles {
        match handle.join() {
            Ok(Ok(())) => {}
            Ok(Err(err)) => warn!(%err, "actor stopped with an error"),
            Err(_) => warn!("actor thread panicked"),
        }
    }
    let report = report.context("learner loop")?;
    progress.finish()?;
    let points = std::mem::take(&mut progress.points);
    curve::write_svg(&run_dir.join("curve.svg"), &points, config.target_return, spec.env.name())
        .context("writing curve.svg")?;

    let env_errors = counters.iter().map(|c| c.env_errors.load(Ordering::Relaxed)).sum();
    let mean_100 = report.mean_return(100);
    let loop_secs = report.elapsed.as_secs_f64();
    let summary = TrainSummary {
        env: spec.env.name().to_string(),
        backend: learner.backend().to_string(),
        seed: spec.seed,
        env_steps: report.env_steps,
        wall_secs: loop_secs,
        final_mean_return: mean_100,
        final_mean_return_20: report.mean_return(20),
        solved: config.target_return.is_some_and(|t| report.recent_returns.len() >= 100 && mean_100 >= t),
        target_return: config.target_return,
        updates: report.updates,
        policy_version: report.policy_version,
        episodes: report.episodes,
        steps_to_target_20: report.target_reached_20.map(|(s, _)| s),
        secs_to_target_20: report.target_reached_20.map(|(_, t)| t),
        steps_to_target_100: report.target_reached_100.map(|(s, _)| s),
        secs_to_target_100: report.target_reached_100.map(|(_, t)| t),
        segments_stale: report.segments_stale,
        segments_rejected: report.segments_rejected.values().sum(),
        segments_dropped: report.segments_dropped().iter().map(|&(reason, n)| (reason.as_str(), n)).collect(),
        segments_unused: report.pool_segments + report.groups.held_segments + report.window_held_segments,
        group_segments: if spec.hyper.work.group_size > 1 {
            let g = &report.groups;
            [
                ("grouped", g.segments_grouped),
                ("critic_lag", g.segments_critic_lag),
                ("critic_capacity", g.segments_critic_capacity),
                ("critic_lost", g.segments_critic_lost),
                ("groups_completed", g.groups.completed),
            ]
            .into_iter()
            .collect()
        } else {
            Default::default()
        },
        windows: volley_learner::select::windows::WindowOutcome::ALL
            .iter()
            .zip(report.windows)
            .map(|(outcome, n)| (outcome.as_str(), n))
            .collect(),
        env_errors,
        lag_max: progress.lag_max,
        lag_max_on_arrival: report.lag_histogram.iter().rposition(|&n| n > 0).unwrap_or(0) as u64,
        learner_wait_ratio: if loop_secs > 0.0 { report.wait_time.as_secs_f64() / loop_secs } else { 0.0 },
        stop_reason: report.stop_reason.map(|r| r.to_string()).unwrap_or_default(),
        run_dir: run_dir.display().to_string(),
    };
    fs::write(run_dir.join("summary.json"), serde_json::to_string_pretty(&summary)?).context("writing summary.json")?;
    Ok(summary)
}

/// Create the run directory and return it: a given `--run-dir` unless it already holds a run
/// (refused with the reason), the default one, or for a rerun the first free `DEFAULT-N`, said
/// in the log (issue 48: reruns overwrote `runs/<run>-<env>-<seed>` without a word).
fn claim_run_dir(run_dir: &RunDir) -> anyhow::Result<PathBuf> {
    match run_dir {
        RunDir::Given(dir) => {
            if let Some(file) = RUN_FILES.iter().map(|f| dir.join(f)).find(|f| f.exists()) {
                anyhow::bail!(
                    "--run-dir {}: it already holds a run ({} exists); a run never overwrites another, so remove it \
                     or choose another directory",
                    dir.display(),
                    file.display()
                );
            }
            fs::create_dir_all(dir).with_context(|| format!("creating run directory {}", dir.display()))?;
            Ok(dir.clone())
        }
        RunDir::Default(dir) => {
            if let Some(parent) = dir.parent().filter(|p| !p.as_os_str().is_empty()) {
                fs::create_dir_all(parent).with_context(|| format!("creating {}", parent.display()))?;
            }
            // `create_dir` fails on an existing directory, so two runs started at once never
            // share one.
            for n in 1..=MAX_RUN_DIR_SUFFIX {
                let candidate = if n == 1 { dir.clone() } else { suffixed(dir, n) };
                match fs::create_dir(&candidate) {
                    Ok(()) => {
                        if n > 1 {
                            info!(
                                taken = %dir.display(),
                                run_dir = %candidate.display(),
                                "the default run directory exists; this run writes to {} (pass --run-dir to choose)",
                                candidate.display()
                            );
                        }
                        return Ok(candidate);
                    }
                    Err(err) if err.kind() == std::io::ErrorKind::AlreadyExists => continue,
                    Err(err) => {
                        return Err(err).with_context(|| format!("creating run directory {}", candidate.display()))
                    }
                }
            }
            anyhow::bail!(
                "{} and {} suffixed versions of it exist; pass --run-dir or clear runs/",
                dir.display(),
                MAX_RUN_DIR_SUFFIX - 1
            )
        }
    }
}

/// `dir` with `-n` appended to its last component.
fn suffixed(dir: &Path, n: u32) -> PathBuf {
    let mut name = dir.file_name().unwrap_or_default().to_os_string();
    name.push(format!("-{n}"));
    dir.with_file_name(name)
}

/// Progress on stderr (bar or lines) plus the metrics file and, with `--tensorboard`, the
/// TensorBoard log.
struct Progress {
    bar: Option<ProgressBar>,
    lines: bool,
    last_line: Instant,
    metrics: BufWriter<File>,
    tensorboard: Option<TensorBoardLog>,
    points: Vec<curve::Point>,
    /// Largest `lag_max` of an update so far (the summary's `lag_max`).
    lag_max: u64,
    write_error: Option<std::io::Error>,
}

impl LearnerControl for Progress {
    fn on_update(&mut self, _: &mut Learner, report: &LearnerReport, stats: &UpdateStats) {
        Progress::on_update(self, report, stats);
    }

    fn on_segment(&mut self, segment: &volley_core::wire::TrajectorySegment) {
        if let Some(tensorboard) = &mut self.tensorboard {
            tensorboard.on_segment(segment);
        }
    }
}

impl Progress {
    fn new(mode: ProgressMode, max_env_steps: u64, metrics: File, tensorboard: Option<TensorBoardLog>) -> Self {
        let terminal = std::io::stderr().is_terminal();
        let bar = (mode == ProgressMode::Auto && terminal).then(|| {
            let bar = ProgressBar::with_draw_target(Some(max_env_steps), ProgressDrawTarget::stderr_with_hz(10));
            bar.set_style(
                ProgressStyle::with_template("{bar:30} {human_pos}/{human_len} steps {per_sec} {msg}")
                    .expect("the template is valid"),
            );
            bar
        });
        Progress {
            lines: mode == ProgressMode::Lines || (mode == ProgressMode::Auto && !terminal),
            bar,
            last_line: Instant::now() - Duration::from_secs(10),
            metrics: BufWriter::new(metrics),
            tensorboard,
            points: Vec::new(),
            lag_max: 0,
            write_error: None,
        }
    }

    fn on_update(&mut self, report: &LearnerReport, stats: &UpdateStats) {
        let row = MetricsRow {
            update: report.updates,
            policy_version: report.policy_version,
            env_steps: report.env_steps,
            wall_secs: report.elapsed.as_secs_f64(),
            episodes: report.episodes,
            mean_return_20: finite(report.mean_return(20)),
            mean_return_100: finite(report.mean_return(100)),
            loss_total: stats.loss.total,
            loss_policy: stats.loss.policy,
            loss_value: stats.loss.value,
            entropy: stats.loss.entropy,
            grad_norm: stats.grad_norm,
            learning_rate: stats.learning_rate,
            ent_coef: stats.ent_coef,
            lag_max: stats.lag_max,
            lag_mean: stats.lag_mean,
            segments_stale: report.segments_stale,
            backlog: report.backlog,
            rho_clipped_fraction: stats.off_policy.as_ref().map(|o| o.rho_clipped_fraction),
            behaviour_kl: stats.off_policy.as_ref().map(|o| o.behaviour_kl),
            effective_sample_fraction: stats.off_policy.as_ref().map(|o| o.effective_sample_fraction),
            explained_variance: stats.off_policy.as_ref().and_then(|o| finite(o.explained_variance)),
        };
        if let Err(err) = serde_json::to_writer(&mut self.metrics, &row)
            .map_err(std::io::Error::from)
            .and_then(|()| self.metrics.write_all(b"\n"))
        {
            self.write_error.get_or_insert(err);
        }
        if let Some(tensorboard) = &mut self.tensorboard {
            tensorboard.on_update(report, stats);
        }
        self.lag_max = self.lag_max.max(stats.lag_max);
        if let Some(mean) = row.mean_return_20 {
            self.points.push(curve::Point { env_steps: report.env_steps, mean_return: mean });
        }
        let steps_per_sec = report.env_steps as f64 / report.elapsed.as_secs_f64().max(1e-9);
        let message = format!(
            "return {:.1} (last 100 {:.1}) v{} lag {}",
            report.mean_return(20),
            report.mean_return(100),
            report.policy_version.0,
            stats.lag_max
        );
        if let Some(bar) = &self.bar {
            bar.set_position(report.env_steps);
            bar.set_message(message);
        } else if self.lines && self.last_line.elapsed() >= Duration::from_secs(1) {
            self.last_line = Instant::now();
            info!(env_steps = report.env_steps, steps_per_sec = steps_per_sec as u64, "{message}");
        }
    }

    fn finish(&mut self) -> anyhow::Result<()> {
        if let Some(bar) = self.bar.take() {
            bar.finish_and_clear();
        }
        if let Some(tensorboard) = self.tensorboard.take() {
            let path = tensorboard.finish().context("--tensorboard")?;
            info!(path = %path.display(), "TensorBoard log written");
        }
        if let Some(err) = self.write_error.take() {
            return Err(err).context("writing metrics.jsonl");
        }
        self.metrics.flush().context("writing metrics.jsonl")
    }
}

/// The vector of remote environments one actor thread steps: its own NATS connection and
/// sessions, checked against the run's policy (observation size, action width and kind).
fn remote_envs(
    remote: &volley_env::RemoteEnvConfig,
    train_remote: &TrainRemote,
    n_envs: usize,
    seed: u64,
    counters: &Arc<ActorCounters>,
    interrupted: &Arc<AtomicBool>,
) -> anyhow::Result<RemoteVecEnv> {
    let nats = &train_remote.nats;
    let client = EnvServiceClient::connect(
        &nats.connect.nats_url,
        nats.auth()?.as_ref(),
        &nats.connect.tls.tls(),
        Duration::from_secs(10),
        train_remote.remote_env.timeout()?,
    )
    .with_context(|| format!("connecting to NATS at {}", nats.connect.nats_url))?
    .with_counters(counters.remote_env.clone());
    let mut config = RemoteVecEnvConfig::new(remote.service.clone(), n_envs, seed);
    config.envs_per_session = train_remote.remote_env.envs_per_session;
    config.max_in_flight = train_remote.remote_env.env_max_in_flight;
    config.expected_spaces = Some((remote.obs_dim, remote.n_actions));
    config.expected_continuous = Some(remote.action_box.is_some());
    config.stop = interrupted.clone();
    match RemoteVecEnv::new(client, config) {
        Ok(envs) => Ok(envs),
        // Stopped waiting for a server: one signal is enough (issue 48 item 4).
        Err(_) if interrupted.load(Ordering::Acquire) => {
            Err(crate::Interrupted(format!("waiting for a server of environment service {}", remote.service)).into())
        }
        Err(err) => Err(err.into()),
    }
}
