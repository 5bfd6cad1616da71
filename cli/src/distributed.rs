//! `volley learner` and `volley actor`: the two halves of a distributed run over NATS.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::thread;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use anyhow::{bail, Context};
use tracing::{debug, info, warn};
use volley_actor::{ActorCounters, ActorMetrics, RolloutWorker};
use volley_core::ids::{ActorId, PolicyVersion, RunId};
use volley_env::{EnvConfig, RemoteEnvConfig};
use volley_learner::metrics::{ActorLag, WorkMetrics};
use volley_learner::scheduler::{Planned, Scheduler, WorkPlanner};
use volley_learner::tensorboard::TensorBoardLog;
use volley_learner::{
    run_learner, Checkpoint, Learner, LearnerControl, LearnerMetrics, LearnerReport, RunLimits, StopReason, UpdateStats,
};
use volley_transport::envsvc::{EnvServiceClient, RemoteVecEnv, RemoteVecEnvConfig};
use volley_transport::local::weights_channel;
use volley_transport::nats::{weights, NatsAuth, NatsBus};
use volley_transport::rejection_log::RejectionLog;
use volley_transport::run_end::{RunEnd, RunEndReason};
use volley_transport::signing::WeightsPublicKeys;
use volley_transport::{BackgroundPublisher, TrajectorySink, TrajectorySource, WeightsPublisher};

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
    pub policy_version: PolicyVersion,
    /// Version this process started from.
    pub resumed_from_version: Option<PolicyVersion>,
    /// Segments used, dropped stale, skipped as duplicates and rejected.
    pub segments_used: u64,
    /// Stale segments dropped.
    pub segments_stale: u64,
    /// Duplicate segments skipped.
    pub segments_duplicate: u64,
    /// Rejected segments by reason.
    pub segments_rejected: std::collections::BTreeMap<String, u64>,
    /// Stitched BPTT windows by outcome (`--bptt-segments`; every segment is one `full` window
    /// without it).
    pub windows: std::collections::BTreeMap<&'static str, u64>,
    /// Fraction of loop time spent waiting for data.
    pub learner_wait_ratio: f64,
    /// Loop seconds spent receiving segments (waiting for data included).
    pub learner_recv_secs: f64,
    /// Loop seconds spent in updates.
    pub learner_update_secs: f64,
    /// Loop seconds spent handing weights to the publisher.
    pub learner_publish_secs: f64,
    /// Loop seconds spent acknowledging segments.
    pub learner_ack_secs: f64,
    /// Segments by their lag on arrival, in versions: `lag_histogram[k]` counts lag k, the last
    /// bucket lag ≥ 64. The progress lines' `lag_max` is the lag the last update trained on (a
    /// batch column's oldest segment), which stitched BPTT windows make larger.
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
    check_segment_fits(&spec, bus.max_payload())?;
    let checkpoint = if config.replay {
        None
    } else {
        Checkpoint::load(&config.checkpoint_path)
            .with_context(|| format!("loading checkpoint {}", config.checkpoint_path.display()))?
    };
    let (mut learner, resume_env_steps, resumed_from) = match checkpoint {
        Some(checkpoint) => {
            let (version, env_steps) = (checkpoint.version, checkpoint.env_steps);
            info!(version = version.0, updates = checkpoint.updates, path = %config.checkpoint_path.display(), "resuming from checkpoint");
            let learner = Learner::from_checkpoint(spec.clone(), checkpoint, &config.checkpoint_path)
                .context("resuming the learner")?;
            (learner, env_steps, Some(version))
        }
        None => (Learner::new(spec.clone()).context("building the learner")?, 0, None),
    };
    learner.set_cpu_threads(config.learner_threads).context("--learner-threads")?;
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
        let mut publisher = bus.weights_publisher().context("opening the weights store")?;
        match &config.weights_signing_key {
            Some(key) => publisher.sign_with(key.clone()),
            None => warn!(
                "weights are not signed (no --weights-signing-key): actors given --weights-public-key refuse them, \
                 and the others cannot tell them from forged ones"
            ),
        }
        // A checkpoint bounds how far the run's pointer can honestly be ahead of it: what a
        // learner can publish in the checkpoint's age (issue 46: a forged pointer far ahead
        // was followed, and then nothing the learner published after a restart was newer).
        // Followers go back to this learner's versions after a few pointers
        // (`REWIND_AFTER_WRITES`), so keeping the checkpoint's version recovers the run.
        let checkpoint_age = resumed_from.and_then(|_| {
            std::fs::metadata(&config.checkpoint_path).and_then(|meta| meta.modified()).ok()?.elapsed().ok()
        });
        match publisher.published_before() {
            Some(published) if !weights::continue_above_published(published, learner.version(), checkpoint_age) => {
                warn!(
                    published = published.0,
                    next = learner.version().0,
                    "refusing to continue above a published version no learner can have published since the checkpoint"
                )
            }
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
        // Publishing runs on its own thread: the learner goes on with the next update while a
        // version is stored and announced (issue 16); segments are acknowledged once their
        // update's version is out.
        let publisher = BackgroundPublisher::new(publisher).context("starting the weights publisher")?;
        (Box::new(bus.trajectory_source().context("opening the learner consumer")?), Box::new(publisher))
    };

    let registry = serve::registry_for("learner")?;
    let metrics = LearnerMetrics::register(&registry).context("registering learner metrics")?;
    metrics.set_max_policy_lag(spec.hyper.max_policy_lag);
    // Ready: connected, the run and its consumer exist (created above), and the first
    // weights are published (the loop's first pass). Live: the loop made progress lately.
    let heartbeat = serve::Heartbeat::new();
    let weights_out = Arc::new(AtomicBool::new(false));
    let ready = {
        let weights_out = weights_out.clone();
        serve::connected_and(
            bus.client().clone(),
            move || weights_out.load(Ordering::Acquire),
            "the first weights are not published yet",
        )
    };
    serve::serve(
        &config.metrics_addr,
        registry.clone(),
        ready,
        heartbeat.probe(config.liveness_timeout, "learner loop"),
    )?;

    let limits = RunLimits {
        max_env_steps: Some(config.max_env_steps),
        max_duration: config.max_duration,
        target_return: config.target_return,
        max_updates: None,
        publish_every: config.publish_every,
        resume_env_steps,
    };
    let replay = config.replay;
    // Save-load and budget assignment: the scheduler plans every episode into the work queue.
    // Item ids start at the clock (µs), so a restarted learner never reuses one.
    let mut planner = if spec.hyper.work.enabled && !replay {
        let first_item_id = SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_micros() as u64);
        let scheduler = Scheduler::new(&spec.hyper.work, &spec.env, spec.seed, first_item_id);
        let queue = bus.work_queue(&spec.hyper.work).context("opening the work queue")?;
        let target = u64::from(spec.hyper.work.queue_per_slot) * spec.hyper.batch_segments.max(8) as u64;
        let work_metrics = WorkMetrics::register(&registry).context("registering work metrics")?;
        let mut planner = WorkPlanner::new(scheduler, Box::new(queue), target).with_metrics(work_metrics);
        planner.top_up();
        Some(planner)
    } else {
        None
    };
    let tensorboard =
        config.tensorboard.as_deref().map(|dir| TensorBoardLog::create(dir).context("--tensorboard")).transpose()?;
    // Replay writes no run, so it has no spec to keep.
    let keeper_stop = Arc::new(AtomicBool::new(false));
    if !replay {
        let (nats, stored_spec, restored) = (config.nats.clone(), spec.encode_stored(), metrics.run_spec_restored());
        let stop = keeper_stop.clone();
        thread::Builder::new()
            .name("volley-spec-keeper".to_string())
            .spawn(move || keep_spec(nats, stored_spec, restored, &stop))
            .context("spawning the spec keeper")?;
    }
    let mut control = LearnerOps {
        metrics,
        tensorboard,
        actor_lag: ActorLag::register(&registry).context("registering learner metrics")?,
        version: learner.version().0,
        heartbeat,
        weights_out,
        progress_at: Duration::ZERO,
        last_checkpoint: Instant::now(),
        last_log: Instant::now(),
        last_lag_max: None,
        checkpoint_error: None,
        checkpoint_path: config.checkpoint_path.clone(),
        checkpoint_every: config.checkpoint_every,
        checkpoint_every_updates: config.checkpoint_every_updates,
        publish_every: config.publish_every,
        replay,
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
    .context("learner loop");
    keeper_stop.store(true, Ordering::Release);
    let report = report?;
    if !config.replay {
        learner
            .checkpoint(report.env_steps)
            .save(&config.checkpoint_path)
            .with_context(|| format!("writing the final checkpoint {}", config.checkpoint_path.display()))?;
        info!(version = learner.version().0, path = %config.checkpoint_path.display(), "final checkpoint written");
    }
    // The run is over (solved, a budget spent): tell the actors, which stop instead of waiting
    // for weights that will not come (issue 48 item 6). A signal is no end: the learner
    // resumes when started again.
    let over = report.stop_reason.and_then(run_end_reason);
    if let (Some(reason), false) = (over, config.replay) {
        match bus.mark_run_ended(reason, config.weights_signing_key.as_deref()) {
            Ok(()) => info!(run = %spec.run, %reason, "run over; told the actors to stop"),
            Err(err) => warn!(run = %spec.run, %reason, %err, "run over, but telling the actors failed"),
        }
    }
    if let Some(tensorboard) = control.tensorboard.take() {
        // The run's result stands without its TensorBoard copy: a failed log is a warning.
        match tensorboard.finish() {
            Ok(path) => info!(path = %path.display(), "TensorBoard log written"),
            Err(err) => warn!(%err, "the TensorBoard log is incomplete"),
        }
    }
    if let Some(err) = control.checkpoint_error {
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
        policy_version: learner.version(),
        resumed_from_version: resumed_from,
        segments_used: report.segments_used,
        segments_stale: report.segments_stale,
        segments_duplicate: report.segments_duplicate,
        segments_rejected: report.segments_rejected.iter().map(|(k, v)| (k.to_string(), *v)).collect(),
        windows: volley_learner::select::windows::WindowOutcome::ALL
            .iter()
            .zip(report.windows)
            .map(|(outcome, n)| (outcome.as_str(), n))
            .collect(),
        learner_wait_ratio: if loop_secs > 0.0 { report.wait_time.as_secs_f64() / loop_secs } else { 0.0 },
        learner_recv_secs: report.wait_time.as_secs_f64(),
        learner_update_secs: report.update_time.as_secs_f64(),
        learner_publish_secs: report.publish_time.as_secs_f64(),
        learner_ack_secs: report.ack_time.as_secs_f64(),
        lag_histogram: report.lag_histogram.clone(),
        stop_reason: report.stop_reason.map(|r| r.to_string()).unwrap_or_default(),
    })
}

/// The run-end marker's reason for a learner that stopped for `reason`, or `None` when the run
/// is not over (a signal, the transport closed: the learner resumes when started again).
fn run_end_reason(reason: StopReason) -> Option<RunEndReason> {
    match reason {
        StopReason::Solved => Some(RunEndReason::Solved),
        StopReason::EnvStepBudget => Some(RunEndReason::EnvStepBudget),
        StopReason::TimeBudget => Some(RunEndReason::TimeBudget),
        StopReason::UpdateBudget => Some(RunEndReason::UpdateBudget),
        StopReason::Interrupted | StopReason::SourceClosed => None,
    }
}

/// How often the learner checks that the run bucket's `spec` key still holds its spec.
const SPEC_CHECK_EVERY: Duration = Duration::from_secs(5);

/// Keep the run spec in the run bucket until `stop`: every [`SPEC_CHECK_EVERY`] (one get), write
/// `stored_spec` again when the `spec` key holds something else, counting it in `restored`. An
/// actor can have an answer to its request stored there (docs/SECURITY.md, "Relays that
/// remain"), and actors started after that could not read the spec (issue 46). Runs on a thread
/// and connection of its own, so a slow or absent broker never holds the learner loop.
fn keep_spec(
    config: volley_transport::nats::NatsConfig,
    stored_spec: Vec<u8>,
    restored: prometheus::IntCounter,
    stop: &AtomicBool,
) {
    let mut bus = None;
    let mut last_check = Instant::now();
    while !stop.load(Ordering::Acquire) {
        thread::sleep(Duration::from_millis(100));
        if last_check.elapsed() < SPEC_CHECK_EVERY {
            continue;
        }
        last_check = Instant::now();
        if bus.is_none() {
            bus = NatsBus::connect(config.clone())
                .inspect_err(|err| debug!(%err, "spec keeper: connecting failed; trying again"))
                .ok();
        }
        match bus.as_ref().map(|bus| bus.reassert_spec(&stored_spec)) {
            Some(Ok(true)) => {
                restored.inc();
                warn!("the run spec key held something other than this learner's spec; wrote the spec again");
            }
            Some(Err(err)) => debug!(%err, "spec keeper: checking the run spec failed; trying again later"),
            _ => {}
        }
    }
}

/// What the learner process does around the loop: metrics, progress lines, checkpoints and the
/// liveness heartbeat. Time-based signals are refreshed on every pass ([`LearnerControl::on_tick`]),
/// so they move while the learner starves or stalls.
struct LearnerOps {
    metrics: LearnerMetrics,
    /// `--tensorboard`: scalars per update.
    tensorboard: Option<TensorBoardLog>,
    actor_lag: ActorLag,
    /// The learner's version at the last tick (it changes only at updates, each followed by one).
    version: u64,
    heartbeat: Arc<serve::Heartbeat>,
    /// Set once the loop runs (the first weights are published before its first pass).
    weights_out: Arc<AtomicBool>,
    /// The report's `progress_at` at the last tick.
    progress_at: Duration,
    last_checkpoint: Instant,
    last_log: Instant,
    /// Largest lag of the last update's batch, for progress lines between updates.
    last_lag_max: Option<u64>,
    checkpoint_error: Option<anyhow::Error>,
    checkpoint_path: std::path::PathBuf,
    checkpoint_every: Duration,
    checkpoint_every_updates: u64,
    publish_every: u64,
    replay: bool,
}

impl LearnerControl for LearnerOps {
    fn on_update(&mut self, learner: &mut Learner, report: &LearnerReport, stats: &UpdateStats) {
        self.metrics.observe(learner, report, stats, learner.updates().is_multiple_of(self.publish_every));
        self.last_lag_max = Some(stats.lag_max);
        if let Some(tensorboard) = &mut self.tensorboard {
            tensorboard.on_update(report, stats);
        }
        let due = learner.updates().is_multiple_of(self.checkpoint_every_updates)
            || self.last_checkpoint.elapsed() >= self.checkpoint_every;
        if due && !self.replay {
            if let Err(err) = learner.checkpoint(report.env_steps).save(&self.checkpoint_path) {
                warn!(%err, "checkpoint failed; will retry at the next update");
                self.checkpoint_error.get_or_insert(err.into());
            } else {
                self.last_checkpoint = Instant::now();
                self.checkpoint_error = None;
            }
        }
    }

    fn on_segment(&mut self, segment: &volley_core::wire::TrajectorySegment) {
        self.actor_lag.observe(segment.actor.as_str(), self.version.saturating_sub(segment.policy_version.0));
        if let Some(tensorboard) = &mut self.tensorboard {
            tensorboard.on_segment(segment);
        }
    }

    fn on_tick(&mut self, learner: &Learner, report: &LearnerReport) {
        self.version = learner.version().0;
        self.weights_out.store(true, Ordering::Release);
        if report.progress_at > self.progress_at {
            self.progress_at = report.progress_at;
            self.heartbeat.beat();
        }
        self.metrics.tick(report);
        self.metrics.set_checkpoint_age(self.last_checkpoint.elapsed());
        if self.last_log.elapsed() >= Duration::from_secs(2) {
            self.last_log = Instant::now();
            let loop_secs = report.elapsed.as_secs_f64().max(1e-9);
            info!(
                env_steps = report.env_steps,
                version = report.policy_version.0,
                updates = report.updates,
                mean_return_100 = report.mean_return(100),
                lag_max = self.last_lag_max,
                backlog = report.backlog,
                wait_ratio = report.wait_time.as_secs_f64() / loop_secs,
                secs_since_progress = report.elapsed.saturating_sub(report.progress_at).as_secs_f64(),
                stale = report.segments_stale,
                rejected = report.segments_rejected.values().sum::<u64>(),
                "learner progress"
            );
        }
    }
}

/// This actor's id: the flag, else the name of its NKey identity (which may publish under that
/// id only, so a flag naming another is refused here rather than denied by the broker), else
/// the pod name, else a generated one.
fn actor_identity(flag: Option<String>, auth: Option<&NatsAuth>) -> anyhow::Result<ActorId> {
    let identity = match auth {
        Some(NatsAuth::Nkey { name, .. }) => Some(name.as_str()),
        _ => None,
    };
    if let Some(id) = flag {
        let id = ActorId::new(id).context("--actor-id")?;
        if let Some(identity) = identity.filter(|name| !id.as_str().eq_ignore_ascii_case(name)) {
            bail!("--actor-id {id}: the NKey identity {identity} may publish only as actor {identity}");
        }
        return Ok(id);
    }
    if let Some(name) = identity {
        return ActorId::new(name).context("the NKey identity's name");
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
/// First and longest pause between an actor's reads of a run spec that is not there yet.
const SPEC_POLL_FIRST: Duration = Duration::from_millis(10);
const SPEC_POLL_MAX: Duration = Duration::from_millis(500);

pub fn actor(args: ActorArgs, interrupted: Arc<AtomicBool>) -> anyhow::Result<()> {
    let run = RunId::new(args.run.clone()).context("--run")?;
    let actor_id = actor_identity(args.actor_id.clone(), args.nats.auth()?.as_ref())?;
    if args.envs == 0 || args.envs > 4096 {
        bail!("--envs: {} out of range 1..=4096", args.envs);
    }
    args.remote_env.validate()?;
    // Read the public keys before anything else: a bad key file stops the actor at once.
    let trusted_keys = args.weights_trust.load()?;
    // Serve health and metrics from the start: /readyz turns ready once weights are loaded.
    let counters = Arc::new(ActorCounters::default());
    let registry = serve::registry_for("actor")?;
    ActorMetrics::register(&registry, counters.clone()).context("registering actor metrics")?;
    let config = args.nats.config(run.clone())?;
    let bus = NatsBus::connect(config.clone()).with_context(|| format!("connecting to NATS at {}", config.url))?;
    // Ready: connected and acting with a policy. Live: stepping environments, or waiting on
    // others (the run spec, the first weights, pacing or the broker's acknowledgements).
    let heartbeat = serve::Heartbeat::new();
    let ready = {
        let counters = counters.clone();
        serve::connected_and(
            bus.client().clone(),
            move || counters.weight_updates.load(Ordering::Relaxed) > 0,
            "no policy weights received yet",
        )
    };
    serve::serve(
        &args.metrics.metrics_addr,
        registry,
        ready,
        heartbeat.probe(args.metrics.liveness_timeout(), "actor loop"),
    )?;
    let mut last_wait_log: Option<Instant> = None;
    // Read again soon, then less often: an actor started beside its learner joins within
    // milliseconds of the spec being written (a fixed 500 ms poll cost a distributed CartPole
    // run up to half a second of an idle learner, issue 16), and one started long before it
    // reads twice a second.
    let mut spec_poll = SPEC_POLL_FIRST;
    let spec = loop {
        heartbeat.beat();
        if interrupted.load(Ordering::Acquire) {
            return Ok(());
        }
        match bus.read_spec() {
            Ok(Some(Ok(spec))) => break spec,
            // Issue 12: a spec that fails its checksum (or does not decode) is never used; it
            // is counted and read again, since the learner rewrites it when it starts.
            Ok(Some(Err(err))) => {
                counters.spec_rejected.fetch_add(1, Ordering::Relaxed);
                if last_wait_log.is_none_or(|t| t.elapsed() >= Duration::from_secs(5)) {
                    warn!(run = %run, reason = err.reason(), %err, "run spec refused; reading it again");
                    last_wait_log = Some(Instant::now());
                }
            }
            Ok(None) => {
                if last_wait_log.is_none_or(|t| t.elapsed() >= Duration::from_secs(5)) {
                    info!(run = %run, "waiting for run {run}: no run spec on NATS yet (start `volley learner --run {run}`)");
                    last_wait_log = Some(Instant::now());
                }
            }
            Err(err) => warn!(run = %run, %err, "reading the run spec failed; retrying"),
        }
        thread::sleep(spec_poll);
        spec_poll = (spec_poll * 2).min(SPEC_POLL_MAX);
    };
    // Stops the actor on a signal, or once the learner says the run is over.
    let stop = Arc::new(AtomicBool::new(false));
    let watcher = {
        let (config, interrupted, stop) = (config.clone(), interrupted.clone(), stop.clone());
        let (trusted, counters) = (trusted_keys.clone(), counters.clone());
        thread::Builder::new()
            .name("volley-run-end".to_string())
            .spawn(move || watch_run_end(config, trusted.as_ref(), &counters, &interrupted, &stop))
            .context("spawning the run-end watcher")?
    };
    let seed = args.seed.unwrap_or_else(|| seed_from(&actor_id));
    // The environment: the spec's, or the one --env names (its spaces must fit the policy).
    let env = match &args.env {
        None => spec.env.clone(),
        Some(EnvChoice::Builtin(name)) => EnvConfig::from_name(name.as_str())?,
        // Only the service changes: the servers' spaces are checked against the spec's.
        Some(EnvChoice::Remote(service)) => EnvConfig::Remote(match &spec.env {
            EnvConfig::Remote(remote) => RemoteEnvConfig { service: service.clone(), ..remote.clone() },
            builtin => RemoteEnvConfig {
                // A built-in image environment (MinAtar) is served as images.
                image: builtin.image_shape(),
                ..RemoteEnvConfig::new(service.clone(), spec.policy.obs_dim, spec.policy.n_actions)
            },
        }),
    };
    let worker = match &env {
        EnvConfig::Remote(remote) => {
            let timeout = args.remote_env.timeout()?;
            // A bus run by its callers reads the socket only while this thread waits on it;
            // the env client waits on its runtime by itself, so it gets a connection and
            // worker threads of its own.
            let client = if bus.caller_driven() {
                EnvServiceClient::connect(
                    &config.url,
                    config.auth.as_ref(),
                    &config.tls,
                    config.connect_timeout,
                    timeout,
                )
                .with_context(|| format!("connecting the environment client to NATS at {}", config.url))?
            } else {
                EnvServiceClient::with_client(bus.client().clone(), bus.handle().clone(), timeout)
            }
            .with_counters(counters.remote_env.clone());
            let mut config = RemoteVecEnvConfig::new(remote.service.clone(), args.envs, seed);
            config.envs_per_session = args.remote_env.envs_per_session;
            config.max_in_flight = args.remote_env.env_max_in_flight;
            config.expected_spaces = Some((remote.obs_dim, spec.policy.n_actions));
            config.expected_continuous = Some(spec.policy.head.is_continuous());
            config.stop = stop.clone();
            let envs = match RemoteVecEnv::new(client, config) {
                Ok(envs) => envs,
                // Interrupted (or the run ended) while waiting for an environment server.
                Err(_) if stop.load(Ordering::Acquire) => return Ok(()),
                Err(err) => return Err(err).with_context(|| format!("remote environment {}", remote.service)),
            };
            let envs = crate::remote_env::actor_envs(envs, remote)
                .with_context(|| format!("remote environment {}", remote.service))?;
            RolloutWorker::with_envs(spec.clone(), actor_id.clone(), envs, seed, counters.clone())
        }
        local => {
            let mut local_spec = spec.clone();
            local_spec.env = local.clone();
            RolloutWorker::new(local_spec, actor_id.clone(), args.envs, seed, counters.clone())
        }
    }
    .with_context(|| format!("this build cannot serve run {run}"))?;
    let worker = if spec.hyper.work.enabled {
        let source = bus.work_source(&actor_id).context("opening the work queue")?;
        let store = bus.snapshot_store().context("opening the snapshot store")?;
        worker.with_work(Box::new(source), Box::new(store)).context("scheduled episodes")?
    } else {
        // Work items wait on the queue inside a round: a held round could wait with them.
        worker.with_rounds_per_publish(usize::from(args.rounds_per_publish), volley_actor::rollout::HOLD_ROUND_WITHIN)
    };
    let layout = spec.validate().context("run spec")?;
    let mut sink = bus.trajectory_sink(&actor_id, stop.clone()).context("opening the trajectory sink")?;
    sink.set_max_backlog_segments(spec.hyper.max_backlog_segments);
    if let Some(clock) = sink.pacing_clock() {
        let _ = counters.pacing.set(clock);
    }
    let mut follower = bus.weights_follower(layout.hash(), layout.n_params()).context("following weights")?;
    match trusted_keys {
        Some(keys) => follower.require_signatures(keys),
        None => warn!(
            "weights are not verified (no --weights-public-key): this actor takes unsigned weights, and any client \
             that can write the run's weights pointer or live subject can make it act on weights of its choosing"
        ),
    }
    info!(run = %run, actor = %actor_id, env = %env.describe(), envs = args.envs, "actor joined the run");
    let reporter_stop = Arc::new(AtomicBool::new(false));
    let reporter = {
        let counters = counters.clone();
        let stop = reporter_stop.clone();
        let actor_id = actor_id.clone();
        let heartbeat = heartbeat.clone();
        thread::spawn(move || report_progress(&actor_id, &counters, &heartbeat, &stop))
    };
    let result = worker.run(&mut sink, &mut follower, &stop);
    if let Err(err) = sink.flush() {
        warn!(%err, "some segments may not have reached the stream");
    }
    reporter_stop.store(true, Ordering::Release);
    let _ = reporter.join();
    // Ends the watcher when the worker stopped for another reason. A watcher that ended the
    // run has returned long before the worker noticed; one waiting on a broker that is gone
    // is left behind rather than waited for.
    stop.store(true, Ordering::Release);
    let run_ended = if watcher.is_finished() { watcher.join().ok().flatten() } else { None };
    result.with_context(|| format!("actor {actor_id}"))?;
    let secs = |nanos: &std::sync::atomic::AtomicU64| nanos.load(Ordering::Relaxed) as f64 * 1e-9;
    info!(
        actor = %actor_id,
        env_steps = counters.env_steps.load(Ordering::Relaxed),
        weight_fetches = counters.weight_fetches.load(Ordering::Relaxed),
        weight_fetch_secs = secs(&counters.weight_fetch_nanos),
        throttled_secs = secs(&counters.throttled_nanos),
        run_ended = run_ended.map(RunEndReason::as_str),
        "actor stopped"
    );
    Ok(())
}

/// How often an actor asks whether its run is over.
const RUN_END_POLL: Duration = Duration::from_secs(1);

/// Set `stop` on a signal (`interrupted`) or once the learner says the run is over
/// ([`NatsBus::mark_run_ended`]), and return the learner's reason in that case (issue 48
/// item 6: actors of a finished run stayed up forever, throttled, without a word). Returns
/// when `stop` is set by anyone. Reads over a connection of its own, so the actor's hot path
/// keeps its connection to itself. A value of the `ended` key that is not a marker (signed by
/// one of `trusted`, when given) is counted in `counters` and the run goes on (issue 46).
fn watch_run_end(
    config: volley_transport::nats::NatsConfig,
    trusted: Option<&WeightsPublicKeys>,
    counters: &ActorCounters,
    interrupted: &AtomicBool,
    stop: &AtomicBool,
) -> Option<RunEndReason> {
    let run = config.run.clone();
    let mut bus = None;
    let mut rejections = RejectionLog::new("run end");
    let mut last_poll: Option<Instant> = None;
    while !stop.load(Ordering::Acquire) {
        if interrupted.load(Ordering::Acquire) {
            stop.store(true, Ordering::Release);
            return None;
        }
        if last_poll.is_none_or(|t| t.elapsed() >= RUN_END_POLL) {
            last_poll = Some(Instant::now());
            if bus.is_none() {
                bus = NatsBus::connect(config.clone())
                    .inspect_err(|err| debug!(%err, "run-end watcher: connecting failed; trying again"))
                    .ok();
            }
            match bus.as_ref().map(|bus| bus.read_run_ended(trusted)) {
                Some(Ok(RunEnd::Ended(reason))) => {
                    info!(run = %run, %reason, "run finished: the learner says run {run} is over ({reason}); stopping");
                    stop.store(true, Ordering::Release);
                    return Some(reason);
                }
                Some(Ok(RunEnd::Refused(refusal))) => {
                    // Read again each poll while the value stays: counted each time, logged
                    // at the log's bounded rate.
                    counters.run_end_refused(refusal).fetch_add(1, Ordering::Relaxed);
                    if rejections.record(refusal.reason()) {
                        warn!(run = %run, reason = refusal.reason(), %refusal, "run-end value refused; the run goes on");
                    }
                }
                Some(Err(err)) => debug!(%err, "run-end watcher: reading failed; trying again"),
                _ => {}
            }
        }
        thread::sleep(Duration::from_millis(100));
    }
    None
}

/// Progress lines every 10 s, and the liveness heartbeat: the actor is live while its env
/// steps move or it waits on others (no weights yet, inside a publish: pacing or acks).
fn report_progress(actor: &ActorId, counters: &ActorCounters, heartbeat: &serve::Heartbeat, stop: &AtomicBool) {
    let mut last = Instant::now();
    let mut last_steps = 0;
    let mut steps_seen = 0;
    while !stop.load(Ordering::Acquire) {
        thread::sleep(Duration::from_millis(200));
        let steps = counters.env_steps.load(Ordering::Relaxed);
        let waiting =
            counters.weight_updates.load(Ordering::Relaxed) == 0 || counters.publishing.load(Ordering::Acquire);
        if steps != steps_seen || waiting {
            heartbeat.beat();
            steps_seen = steps;
        }
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
            throttled_secs = counters.throttled().as_secs_f64(),
            env_errors = counters.env_errors.load(Ordering::Relaxed),
            episodes_aborted = counters.episodes_aborted.load(Ordering::Relaxed),
            env_sessions_lost = counters.remote_env.sessions_lost.load(Ordering::Relaxed),
            "actor progress"
        );
        last = Instant::now();
        last_steps = steps;
    }
}

/// Refuse at start a run whose image segments cannot fit in one message: every segment carries
/// `segment_len + 1` observations, one byte per value at best (docs/ARCHITECTURE.md, "Image
/// observations"), and the actors' sink refuses a segment over `max_payload`.
fn check_segment_fits(spec: &volley_core::spec::RunSpec, max_payload: usize) -> anyhow::Result<()> {
    if spec.env.image_shape().is_none() {
        return Ok(());
    }
    let t = spec.segment_len;
    // Observations as bytes, plus the per-step fields and the envelope (generous).
    let bytes = (t + 1) * spec.policy.obs_dim + 64 * t + 4096;
    if bytes > max_payload {
        let fits = (max_payload.saturating_sub(4096) / (spec.policy.obs_dim + 64)).saturating_sub(1);
        bail!(
            "--segment-len {t}: a segment of {t} steps of {}-value image observations is about {bytes} bytes, over \
             the NATS server's max_payload of {max_payload}; use --segment-len {fits} or less, or raise max_payload \
             (broker-config/nats.conf sets 8 MB)",
            spec.policy.obs_dim
        );
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::{actor_identity, check_segment_fits, watch_run_end, NatsAuth};
    use volley_env::{EnvConfig, EnvServiceName, RemoteEnvConfig};
    use volley_testkit::fixtures::SpecBuilder;

    /// Pong with 4 stacked 84×84 frames: 32-step segments fit the 1 MiB default `max_payload`,
    /// 64-step ones are refused at start with the longest that fits; vector envs are not
    /// checked.
    /// Issue 46 item 3: an actor with an NKey identity is that identity's actor: its id
    /// defaults to the identity's name, and an `--actor-id` naming another actor (whose
    /// subjects the broker would deny it) is refused at start.
    #[test]
    fn an_nkey_identity_names_the_actor_and_refuses_another_id() {
        let auth = NatsAuth::Nkey { name: "actor-2".into(), seed: "unused".into() };
        assert_eq!(actor_identity(None, Some(&auth)).expect("its name").as_str(), "actor-2");
        assert_eq!(actor_identity(Some("actor-2".into()), Some(&auth)).expect("the same").as_str(), "actor-2");
        let err = actor_identity(Some("actor-1".into()), Some(&auth)).expect_err("another actor's id");
        assert!(err.to_string().contains("may publish only as actor actor-2"), "{err}");
        assert_eq!(actor_identity(Some("any".into()), None).expect("no identity").as_str(), "any");
    }

    #[test]
    fn image_segments_over_max_payload_are_refused_at_start() {
        let pong = RemoteEnvConfig {
            image: Some([1, 84, 84]),
            frame_stack: 4,
            ..RemoteEnvConfig::new(EnvServiceName::new("pong").unwrap(), 84 * 84, 6)
        };
        let spec = |t: usize| SpecBuilder::cartpole(t).env(EnvConfig::Remote(pong.clone()), 4 * 84 * 84, 6).build();
        let mib = 1 << 20;
        check_segment_fits(&spec(32), mib).expect("32 steps fit 1 MiB");
        let err = check_segment_fits(&spec(64), mib).unwrap_err().to_string();
        assert!(err.contains("--segment-len 35 or less"), "{err}");
        check_segment_fits(&spec(64), 8 << 20).expect("64 steps fit 8 MiB");
        check_segment_fits(&SpecBuilder::cartpole(4096).build(), 1024).expect("vector observations are not checked");
    }

    /// Issue 46: a value of the `ended` key that is not the learner's marker (here bytes put
    /// there directly; `transport/tests/broker_relays.rs` stores the relayed answers an
    /// actor can cause) is counted and the watcher goes on, until the learner's marker ends
    /// the run.
    #[test]
    fn the_run_end_watcher_counts_a_value_that_is_not_a_marker_and_goes_on() {
        use std::sync::atomic::{AtomicBool, Ordering};
        use std::sync::{mpsc, Arc};
        use std::time::{Duration, Instant};
        use volley_actor::ActorCounters;
        use volley_core::ids::RunId;
        use volley_transport::nats::{NatsBus, NatsConfig, NatsTls};
        use volley_transport::run_end::RunEndReason;

        // Bounds the waits: only there so that a regression fails instead of hanging.
        const GUARD: Duration = Duration::from_secs(60);
        let server = volley_testkit::TestNats::start();
        let config = NatsConfig::new(server.url(), RunId::new("ends").expect("valid"))
            .with_tls(NatsTls::with_ca(server.ca_file()));
        let learner = NatsBus::connect(config.clone()).expect("connects");
        learner.ensure_run(&SpecBuilder::cartpole(8).run("ends").build()).expect("run");
        let client = learner.client().clone();
        learner.block_on(async move {
            let js = async_nats::jetstream::new(client);
            let kv = js.get_key_value("volley-ends").await.expect("bucket");
            kv.put("ended", "{\"type\":\"io.nats.jetstream.api.v1.stream_msg_get_response\"}".into())
                .await
                .expect("put");
        });
        let counters = Arc::new(ActorCounters::default());
        let (interrupted, stop) = (Arc::new(AtomicBool::new(false)), Arc::new(AtomicBool::new(false)));
        let (done, ended) = mpsc::channel();
        {
            let (counters, interrupted, stop) = (counters.clone(), interrupted.clone(), stop.clone());
            std::thread::spawn(move || {
                let _ = done.send(watch_run_end(config, None, &counters, &interrupted, &stop));
            });
        }
        let started = Instant::now();
        while counters.run_end_malformed.load(Ordering::Relaxed) == 0 {
            assert!(started.elapsed() < GUARD, "the refused value was not counted");
            std::thread::sleep(Duration::from_millis(20));
        }
        assert!(!stop.load(Ordering::Acquire), "a value that is not a marker stopped the actor");
        learner.mark_run_ended(RunEndReason::UpdateBudget, None).expect("marker");
        let reason = ended.recv_timeout(GUARD).expect("the watcher saw the learner's marker");
        assert_eq!(reason, Some(RunEndReason::UpdateBudget));
        assert!(stop.load(Ordering::Acquire));
    }
}
