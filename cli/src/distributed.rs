//! `volley learner` and `volley actor`: the two halves of a distributed run over NATS.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::thread;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use anyhow::{bail, Context};
use tracing::{info, warn};
use volley_actor::{ActorCounters, ActorMetrics, RolloutWorker};
use volley_core::env::{EnvConfig, RemoteEnvConfig};
use volley_core::envsvc::{EnvServiceClient, RemoteVecEnv, RemoteVecEnvConfig};
use volley_core::ids::{ActorId, RunId};
use volley_core::transport::local::weights_channel;
use volley_core::transport::nats::NatsBus;
use volley_core::transport::{TrajectorySource, WeightsPublisher};
use volley_learner::metrics::WorkMetrics;
use volley_learner::scheduler::{Planned, Scheduler, WorkPlanner};
use volley_learner::{run_learner, Checkpoint, Learner, LearnerMetrics, LearnerReport, RunLimits, UpdateStats};

use crate::args::{ActorArgs, EnvChoice, LearnerConfig};
use crate::serve;

/// The summary `volley learner` prints as one JSON line when it stops.
#[derive(Debug, serde::Serialize)]
pub struct LearnerSummary {
    /// Run name.
    pub run: String,
    /// Environment steps consumed (including those before a resume).
    pub env_steps: u64,
    /// Wall time of this process's loop.
    pub wall_secs: f64,
    /// Mean return of the last 100 episodes.
    pub final_mean_return: f32,
    /// Whether the target was reached.
    pub solved: bool,
    /// Updates applied (including those before a resume).
    pub updates: u64,
    /// Final policy version.
    pub policy_version: u64,
    /// Version this process started from.
    pub resumed_from_version: Option<u64>,
    /// Segments used, dropped stale, skipped as duplicates and rejected.
    pub segments_used: u64,
    /// Stale segments dropped.
    pub segments_stale: u64,
    /// Duplicate segments skipped.
    pub segments_duplicate: u64,
    /// Rejected segments by reason.
    pub segments_rejected: std::collections::BTreeMap<String, u64>,
    /// Fraction of loop time spent waiting for data.
    pub learner_wait_ratio: f64,
    /// Segments by lag in versions: `lag_histogram[k]` counts lag k, the last bucket lag ≥ 15.
    pub lag_histogram: Vec<u64>,
    /// Why the learner stopped.
    pub stop_reason: String,
}

/// Run the learner of a distributed run until a limit or a signal; checkpoints on the way and
/// at the end.
pub fn learner(config: LearnerConfig, interrupted: Arc<AtomicBool>) -> anyhow::Result<LearnerSummary> {
    let mut spec = config.spec.clone();
    if config.replay {
        info!("replay: lag is not meaningful for recorded segments; max_policy_lag disabled");
        spec.hyper.max_policy_lag = u64::MAX;
    }
    let bus =
        NatsBus::connect(config.nats.clone()).with_context(|| format!("connecting to NATS at {}", config.nats.url))?;
    let checkpoint = if config.replay {
        None
    } else {
        Checkpoint::load(&config.checkpoint_path)
            .with_context(|| format!("loading checkpoint {}", config.checkpoint_path.display()))?
    };
    let (mut learner, resume_env_steps, resumed_from) = match checkpoint {
        Some(checkpoint) => {
            let (version, env_steps) = (checkpoint.version, checkpoint.env_steps);
            info!(version, updates = checkpoint.updates, path = %config.checkpoint_path.display(), "resuming from checkpoint");
            let learner = Learner::from_checkpoint(spec.clone(), checkpoint, &config.checkpoint_path)
                .context("resuming the learner")?;
            (learner, env_steps, Some(version))
        }
        None => (Learner::new(spec.clone()).context("building the learner")?, 0, None),
    };
    learner.use_backend(config.backend).context("--backend")?;
    let layout = learner.layout().clone();
    info!(run = %spec.run, env = %spec.env.describe(), loss = ?spec.hyper.loss, policy = ?spec.policy,
          layout_hash = format!("{:016x}", layout.hash()), replay = config.replay, "learner starting");

    let (mut source, mut publisher): (Box<dyn TrajectorySource>, Box<dyn WeightsPublisher>) = if config.replay {
        // Replay trains from the record only: weights stay in this process.
        let (local_publisher, _) = weights_channel();
        (Box::new(bus.replay_source().context("opening the trajectory record")?), Box::new(local_publisher))
    } else {
        bus.ensure_run(&spec).context("creating the run's streams and buckets")?;
        // Versions never go backwards: continue above whatever this run already published.
        let publisher = bus.weights_publisher().context("opening the weights store")?;
        match publisher.published_before() {
            Some(published) => match learner.advance_version_past(published) {
                Ok(()) => {
                    info!(published = published.0, next = learner.version().0, "continuing above the published version")
                }
                // A forged or corrupted pointer (docs/SECURITY.md): keep the checkpoint's version.
                Err(absurd) => warn!(published = published.0, next = learner.version().0, %absurd,
                                     "refusing to continue above an absurd published version"),
            },
            None => info!("no weights published yet for this run"),
        }
        (Box::new(bus.trajectory_source().context("opening the learner consumer")?), Box::new(publisher))
    };

    let registry = serve::registry_for("learner")?;
    let mut metrics = LearnerMetrics::register(&registry).context("registering learner metrics")?;
    // Ready once the run exists on NATS and the first weights are about to be published.
    serve::serve(&config.metrics_addr, registry.clone(), Arc::new(|| true))?;

    let limits = RunLimits {
        max_env_steps: Some(config.max_env_steps),
        max_duration: config.max_duration,
        target_return: config.target_return,
        max_updates: None,
        publish_every: config.publish_every,
        resume_env_steps,
    };
    let mut last_checkpoint = Instant::now();
    let mut last_log = Instant::now();
    let mut checkpoint_error: Option<anyhow::Error> = None;
    let checkpoint_path = config.checkpoint_path.clone();
    let replay = config.replay;
    // Save-load and budget assignment: the scheduler plans every episode into the work queue.
    // Item ids start at the clock (µs), so a restarted learner never reuses one.
    let mut planner = if spec.hyper.work.enabled && !replay {
        let first_item_id = SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_micros() as u64);
        let scheduler = Scheduler::new(&spec.hyper.work, &spec.env, spec.seed, first_item_id);
        let queue = bus.work_queue().context("opening the work queue")?;
        let target = u64::from(spec.hyper.work.queue_per_slot) * spec.hyper.batch_segments.max(8) as u64;
        let work_metrics = WorkMetrics::register(&registry).context("registering work metrics")?;
        let mut planner = WorkPlanner::new(scheduler, Box::new(queue), target).with_metrics(work_metrics);
        planner.top_up();
        Some(planner)
    } else {
        None
    };
    let mut control = |learner: &mut Learner, report: &LearnerReport, stats: &UpdateStats| {
        metrics.observe(learner, report, stats, learner.updates().is_multiple_of(config.publish_every));
        metrics.set_checkpoint_age(last_checkpoint.elapsed());
        let due = learner.updates().is_multiple_of(config.checkpoint_every_updates)
            || last_checkpoint.elapsed() >= config.checkpoint_every;
        if due && !replay {
            if let Err(err) = learner.checkpoint(report.env_steps).save(&checkpoint_path) {
                warn!(%err, "checkpoint failed; will retry at the next update");
                checkpoint_error.get_or_insert(err.into());
            } else {
                last_checkpoint = Instant::now();
                checkpoint_error = None;
            }
        }
        if last_log.elapsed() >= Duration::from_secs(2) {
            last_log = Instant::now();
            let loop_secs = report.elapsed.as_secs_f64().max(1e-9);
            info!(
                env_steps = report.env_steps,
                version = report.policy_version,
                mean_return_100 = report.mean_return(100),
                lag_max = stats.lag_max,
                backlog = report.backlog,
                wait_ratio = report.wait_time.as_secs_f64() / loop_secs,
                stale = report.segments_stale,
                rejected = report.segments_rejected.values().sum::<u64>(),
                "learner progress"
            );
        }
    };
    let report = match planner.as_mut() {
        Some(planner) => run_learner(
            &mut learner,
            source.as_mut(),
            publisher.as_mut(),
            &limits,
            &interrupted,
            &mut Planned { inner: &mut control, planner },
        ),
        None => run_learner(&mut learner, source.as_mut(), publisher.as_mut(), &limits, &interrupted, &mut control),
    }
    .context("learner loop")?;
    if !config.replay {
        learner
            .checkpoint(report.env_steps)
            .save(&config.checkpoint_path)
            .with_context(|| format!("writing the final checkpoint {}", config.checkpoint_path.display()))?;
        info!(version = learner.version().0, path = %config.checkpoint_path.display(), "final checkpoint written");
    }
    if let Some(err) = checkpoint_error {
        warn!(%err, "the last periodic checkpoint had failed");
    }
    let loop_secs = report.elapsed.as_secs_f64();
    let mean_100 = report.mean_return(100);
    Ok(LearnerSummary {
        run: spec.run.to_string(),
        env_steps: report.env_steps,
        wall_secs: loop_secs,
        final_mean_return: mean_100,
        solved: config.target_return.is_some_and(|t| report.recent_returns.len() >= 100 && mean_100 >= t),
        updates: learner.updates(),
        policy_version: learner.version().0,
        resumed_from_version: resumed_from,
        segments_used: report.segments_used,
        segments_stale: report.segments_stale,
        segments_duplicate: report.segments_duplicate,
        segments_rejected: report.segments_rejected.iter().map(|(k, v)| (k.to_string(), *v)).collect(),
        learner_wait_ratio: if loop_secs > 0.0 { report.wait_time.as_secs_f64() / loop_secs } else { 0.0 },
        lag_histogram: report.lag_histogram.clone(),
        stop_reason: report.stop_reason.map(|r| r.to_string()).unwrap_or_default(),
    })
}

/// This actor's identity: the flag, else the pod name, else a generated one.
fn actor_identity(flag: Option<String>) -> anyhow::Result<ActorId> {
    if let Some(id) = flag {
        return ActorId::new(id).context("--actor-id");
    }
    for var in ["POD_NAME", "HOSTNAME"] {
        if let Ok(name) = std::env::var(var) {
            if let Ok(id) = ActorId::new(name) {
                return Ok(id);
            }
        }
    }
    let nanos = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_nanos()).unwrap_or(0);
    Ok(ActorId::new(format!("actor-{:08x}-{}", (nanos as u64) ^ 0x9e37_79b9_7f4a_7c15, std::process::id()))
        .expect("generated ids are valid"))
}

/// Seed derived from the actor id, so restarted pods with the same name differ from others.
fn seed_from(id: &ActorId) -> u64 {
    id.as_str().bytes().fold(0xcbf2_9ce4_8422_2325u64, |h, b| (h ^ b as u64).wrapping_mul(0x0100_0000_01b3))
}

/// Run an actor: wait for the run spec, then act until a signal.
pub fn actor(args: ActorArgs, interrupted: Arc<AtomicBool>) -> anyhow::Result<()> {
    let run = RunId::new(args.run.clone()).context("--run")?;
    let actor_id = actor_identity(args.actor_id.clone())?;
    if args.envs == 0 || args.envs > 4096 {
        bail!("--envs: {} out of range 1..=4096", args.envs);
    }
    args.remote_env.validate()?;
    // Serve health and metrics from the start: /readyz turns ready once weights are loaded.
    let counters = Arc::new(ActorCounters::default());
    let registry = serve::registry_for("actor")?;
    ActorMetrics::register(&registry, counters.clone()).context("registering actor metrics")?;
    let ready_counters = counters.clone();
    serve::serve(
        &args.metrics.metrics_addr,
        registry,
        Arc::new(move || ready_counters.weight_updates.load(Ordering::Relaxed) > 0),
    )?;
    let config = args.nats.config(run.clone())?;
    let bus = NatsBus::connect(config.clone()).with_context(|| format!("connecting to NATS at {}", config.url))?;
    let mut last_wait_log: Option<Instant> = None;
    let spec = loop {
        if interrupted.load(Ordering::Acquire) {
            return Ok(());
        }
        match bus.read_spec() {
            Ok(Some(spec)) => break spec,
            Ok(None) => {
                if last_wait_log.is_none_or(|t| t.elapsed() >= Duration::from_secs(5)) {
                    info!(run = %run, "waiting for run {run}: no run spec on NATS yet (start `volley learner --run {run}`)");
                    last_wait_log = Some(Instant::now());
                }
            }
            Err(err) => warn!(run = %run, %err, "reading the run spec failed; retrying"),
        }
        thread::sleep(Duration::from_millis(500));
    };
    let seed = args.seed.unwrap_or_else(|| seed_from(&actor_id));
    // The environment: the spec's, or the one --env names (its spaces must fit the policy).
    let env = match &args.env {
        None => spec.env.clone(),
        Some(EnvChoice::Builtin(name)) => EnvConfig::from_name(name.as_str())?,
        Some(EnvChoice::Remote(service)) => EnvConfig::Remote(RemoteEnvConfig {
            service: service.clone(),
            obs_dim: spec.policy.obs_dim,
            n_actions: spec.policy.n_actions,
            reward_threshold: None,
            max_abs_reward: None,
            max_episode_steps: None,
        }),
    };
    let worker = match &env {
        EnvConfig::Remote(remote) => {
            let client =
                EnvServiceClient::with_client(bus.client().clone(), bus.handle().clone(), args.remote_env.timeout()?)
                    .with_counters(counters.remote_env.clone());
            let mut config = RemoteVecEnvConfig::new(remote.service.clone(), args.envs, seed);
            config.envs_per_session = args.remote_env.envs_per_session;
            config.max_in_flight = args.remote_env.env_max_in_flight;
            config.expected_spaces = Some((spec.policy.obs_dim, spec.policy.n_actions));
            config.stop = interrupted.clone();
            let envs = match RemoteVecEnv::new(client, config) {
                Ok(envs) => envs,
                // Interrupted while waiting for an environment server.
                Err(_) if interrupted.load(Ordering::Acquire) => return Ok(()),
                Err(err) => return Err(err).with_context(|| format!("remote environment {}", remote.service)),
            };
            RolloutWorker::with_envs(spec.clone(), actor_id.clone(), Box::new(envs), seed, counters.clone())
        }
        local => {
            let mut local_spec = spec.clone();
            local_spec.env = local.clone();
            RolloutWorker::new(local_spec, actor_id.clone(), args.envs, seed, counters.clone())
        }
    }
    .with_context(|| format!("this build cannot serve run {run}"))?;
    let worker = if spec.hyper.work.enabled {
        let source = bus.work_source().context("opening the work queue")?;
        let store = bus.snapshot_store().context("opening the snapshot store")?;
        worker.with_work(Box::new(source), Box::new(store)).context("scheduled episodes")?
    } else {
        worker
    };
    let layout = spec.validate().context("run spec")?;
    let mut sink = bus.trajectory_sink(&actor_id, interrupted.clone()).context("opening the trajectory sink")?;
    sink.set_max_backlog_segments(spec.hyper.max_backlog_segments);
    let mut follower = bus.weights_follower(layout.hash(), layout.n_params()).context("following weights")?;
    info!(run = %run, actor = %actor_id, env = %env.describe(), envs = args.envs, "actor joined the run");
    let reporter_stop = Arc::new(AtomicBool::new(false));
    let reporter = {
        let counters = counters.clone();
        let stop = reporter_stop.clone();
        let actor_id = actor_id.clone();
        thread::spawn(move || report_progress(&actor_id, &counters, &stop))
    };
    let result = worker.run(&mut sink, &mut follower, &interrupted);
    if let Err(err) = sink.flush() {
        warn!(%err, "some segments may not have reached the stream");
    }
    reporter_stop.store(true, Ordering::Release);
    let _ = reporter.join();
    result.with_context(|| format!("actor {actor_id}"))?;
    info!(actor = %actor_id, env_steps = counters.env_steps.load(Ordering::Relaxed), "actor stopped");
    Ok(())
}

fn report_progress(actor: &ActorId, counters: &ActorCounters, stop: &AtomicBool) {
    let mut last = Instant::now();
    let mut last_steps = 0;
    while !stop.load(Ordering::Acquire) {
        thread::sleep(Duration::from_millis(200));
        if last.elapsed() < Duration::from_secs(10) {
            continue;
        }
        let steps = counters.env_steps.load(Ordering::Relaxed);
        let secs = last.elapsed().as_secs_f64();
        info!(
            actor = %actor,
            env_steps = steps,
            steps_per_sec = ((steps - last_steps) as f64 / secs) as u64,
            segments = counters.segments_published.load(Ordering::Relaxed),
            weight_updates = counters.weight_updates.load(Ordering::Relaxed),
            throttled_secs = counters.throttled_nanos.load(Ordering::Relaxed) as f64 * 1e-9,
            env_errors = counters.env_errors.load(Ordering::Relaxed),
            episodes_aborted = counters.episodes_aborted.load(Ordering::Relaxed),
            env_sessions_lost = counters.remote_env.sessions_lost.load(Ordering::Relaxed),
            "actor progress"
        );
        last = Instant::now();
        last_steps = steps;
    }
}
