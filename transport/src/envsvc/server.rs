//! [`EnvServer`]: serves any Rust [`Env`] as an environment service (docs/ENV_PROTOCOL.md).
//!
//! One server is one instance of the NATS micro service `volley-env-<name>`: it answers
//! `$SRV.PING`, `$SRV.INFO` and `$SRV.STATS` (async-nats' service API), and serves the seven
//! operations on `volley.env.<name>.<instance>.<op>`. A session is a [`VecEnv`] of the
//! requested size; sessions idle for longer than the idle timeout are dropped.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use async_nats::service::{self, ServiceExt};
use futures::StreamExt;
use tokio::task::JoinHandle;
use tracing::{debug, info, warn};

use super::protocol::{
    self, ActionSpaceMsg, CloseRequest, EmptyReply, EnvFailure, ErrorCode, ObsBin, ObsEncoding, ObsReply, ObsSpaceMsg,
    Op, OpenReply, OpenRequest, ResetRequest, RestoreRequest, SnapshotReply, SnapshotRequest, SpacesReply, StepActions,
    StepReply, StepRequest, VersionProbe, IMAGE_PROTOCOL_VERSION, METADATA_ENV, METADATA_PROTOCOL,
    MIN_PROTOCOL_VERSION, PROTOCOL_VERSION,
};
use super::{EnvServiceError, EnvServiceName};
use volley_core::subjects;
use volley_env::{ActionSpace, Actions, Env, EnvError, VecEnv, VecStep};

/// Builds one environment of the served kind.
pub type EnvFactory = Arc<dyn Fn() -> Result<Box<dyn Env>, EnvError> + Send + Sync>;

/// What an [`EnvServer`] serves and its limits.
#[derive(Debug, Clone)]
pub struct EnvServerConfig {
    /// The service name.
    pub name: EnvServiceName,
    /// What runs behind it, for `spaces` and the service description (`"cartpole"`).
    pub env_label: String,
    /// Sessions held at once; more `open`s are refused with code 503.
    pub max_sessions: usize,
    /// Largest session.
    pub max_envs_per_session: usize,
    /// A session without requests for this long is dropped.
    pub idle_timeout: Duration,
    /// Declared in `spaces`: the solved threshold.
    pub reward_threshold: Option<f32>,
    /// Declared in `spaces`: the episode time limit.
    pub max_episode_steps: Option<u32>,
    /// Declared in `spaces`: the largest |reward| of one step.
    pub max_abs_reward: Option<f32>,
    /// Serve the observations as `u8` images of this `[C, H, W]` shape (protocol version 3);
    /// `None`: as the environment's observation space declares (images for MinAtar's planes,
    /// flat `f32` vectors otherwise). Every value the environment produces must then be a
    /// whole number in `0..=255` (checked at start on the first observation).
    pub image_shape: Option<[usize; 3]>,
}

impl EnvServerConfig {
    /// Defaults: 1024 sessions of at most 4096 environments, a 5-minute idle timeout.
    pub fn new(name: EnvServiceName, env_label: impl Into<String>) -> Self {
        EnvServerConfig {
            name,
            env_label: env_label.into(),
            max_sessions: 1024,
            max_envs_per_session: 4096,
            idle_timeout: Duration::from_secs(300),
            reward_threshold: None,
            max_episode_steps: None,
            max_abs_reward: None,
            image_shape: None,
        }
    }
}

/// One session: a vector of environments and its reusable step buffers.
struct Session {
    envs: VecEnv<Box<dyn Env>>,
    step: VecStep,
    last_used: Instant,
}

/// Counters of a server (for logs and tests).
#[derive(Debug, Default)]
pub struct ServerCounters {
    /// Requests answered (including errors).
    pub requests: AtomicU64,
    /// Requests that did not decode or were out of range (answered with code 400).
    pub rejected: AtomicU64,
    /// Sessions dropped after their idle timeout.
    pub expired: AtomicU64,
}

struct ServerState {
    config: EnvServerConfig,
    factory: EnvFactory,
    spaces: Vec<u8>,
    obs_dim: usize,
    /// How observations travel: `U8` for an image environment.
    obs_encoding: ObsEncoding,
    action_space: ActionSpace,
    sessions: Mutex<HashMap<u64, Arc<Mutex<Session>>>>,
    next_session: AtomicU64,
    counters: Arc<ServerCounters>,
    /// Logs rejected requests at a bounded rate (each is counted in `counters` as well;
    /// issue 46: one line per hostile request multiplied its bytes).
    rejections: Mutex<crate::rejection_log::RejectionLog>,
}

type Failure = (ErrorCode, String);

/// A running environment server (one service instance). Stopped by [`EnvServer::stop`] or
/// on drop; either way its endpoints and `$SRV` subscriptions go away at once.
pub struct EnvServer {
    id: String,
    client: async_nats::Client,
    service: Option<service::Service>,
    tasks: Vec<JoinHandle<()>>,
    state: Arc<ServerState>,
}

impl std::fmt::Debug for EnvServer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EnvServer").field("id", &self.id).field("name", &self.state.config.name).finish()
    }
}

impl EnvServer {
    /// Build one environment to learn the spaces, register the service and start serving.
    /// Must be called within a multi-thread tokio runtime.
    pub async fn start(
        client: async_nats::Client,
        factory: EnvFactory,
        config: EnvServerConfig,
    ) -> Result<EnvServer, EnvServiceError> {
        let incompatible = |message: String| EnvServiceError::Incompatible { instance: String::new(), message };
        let mut probe = factory().map_err(|err| incompatible(format!("cannot build the environment: {err}")))?;
        let space = probe.observation_space();
        // An image environment is served as images unless the config says otherwise.
        let mut config = config;
        config.image_shape = config.image_shape.or(space.image);
        if let Some(shape) = config.image_shape {
            if shape.iter().product::<usize>() != space.dim() {
                return Err(incompatible(format!("image shape {shape:?} for {} observation values", space.dim())));
            }
            let mut obs = vec![0.0; space.dim()];
            probe.reset(0, &mut obs).map_err(|err| incompatible(format!("cannot reset the environment: {err}")))?;
            if !obs.iter().all(|&v| volley_core::wire::observations::is_byte_valued(v)) {
                return Err(incompatible("image observations must be whole numbers in 0..=255".to_string()));
            }
        }
        let obs_encoding = if config.image_shape.is_some() { ObsEncoding::U8 } else { ObsEncoding::F32 };
        let action_space = probe.action_space();
        // 0 for a box: a version-1 reader refuses the reply instead of stepping integers.
        let n_actions = action_space.discrete_n().unwrap_or(0);
        let spaces = SpacesReply {
            env: config.env_label.clone(),
            obs_dim: space.dim() as u32,
            obs_low: space.low.clone(),
            obs_high: space.high.clone(),
            n_actions: n_actions as u32,
            action_space: Some(ActionSpaceMsg::from_space(&action_space)),
            reward_threshold: config.reward_threshold,
            max_episode_steps: config.max_episode_steps,
            max_abs_reward: config.max_abs_reward,
            snapshot: true,
            max_envs_per_session: config.max_envs_per_session as u32,
            obs_space: config.image_shape.map(ObsSpaceMsg::image),
        };
        let service_name = subjects::env_service(&config.name);
        let metadata = HashMap::from([
            (METADATA_PROTOCOL.to_string(), PROTOCOL_VERSION.to_string()),
            (METADATA_ENV.to_string(), config.name.to_string()),
        ]);
        let service = client
            .service_builder()
            .description(format!("volley environment server: {}", config.env_label))
            .metadata(metadata)
            .start(service_name.clone(), env!("CARGO_PKG_VERSION"))
            .await
            .map_err(|err| EnvServiceError::Nats { operation: "register service", message: err.to_string() })?;
        let id = service.info().await.id;
        let nanos = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_nanos() as u64)
            .unwrap_or(0);
        let state = Arc::new(ServerState {
            obs_dim: space.dim(),
            obs_encoding,
            action_space,
            spaces: protocol::encode(&spaces),
            factory,
            sessions: Mutex::new(HashMap::new()),
            // Session ids stay below 2^53 (exact in any JSON or JavaScript reader) and start
            // at a different place per server, so a restarted server does not reuse them.
            next_session: AtomicU64::new((nanos ^ ((std::process::id() as u64) << 20)) & ((1 << 52) - 1)),
            counters: Arc::new(ServerCounters::default()),
            rejections: Mutex::new(crate::rejection_log::RejectionLog::new("environment request")),
            config,
        });
        let mut tasks = Vec::with_capacity(Op::ALL.len() + 1);
        for op in Op::ALL {
            let subject = subjects::env_endpoint(&state.config.name, &id, op.name());
            let endpoint = service
                .endpoint_builder()
                .name(op.name())
                .add(subject)
                .await
                .map_err(|err| EnvServiceError::Nats { operation: "add endpoint", message: err.to_string() })?;
            tasks.push(tokio::spawn(serve_endpoint(state.clone(), op, endpoint)));
        }
        tasks.push(tokio::spawn(expire_idle_sessions(state.clone())));
        // A round trip, so the subscriptions are in place before anyone is told we are up.
        client.flush().await.map_err(|err| EnvServiceError::Nats { operation: "flush", message: err.to_string() })?;
        info!(service = %service_name, instance = %id, env = %state.config.env_label, obs_dim = space.dim(),
              n_actions, "environment server ready");
        Ok(EnvServer { id, client, service: Some(service), tasks, state })
    }

    /// The instance id.
    pub fn id(&self) -> &str {
        &self.id
    }

    /// Sessions held now.
    pub fn n_sessions(&self) -> usize {
        self.state.sessions.lock().expect("sessions lock is never poisoned").len()
    }

    /// The server's counters.
    pub fn counters(&self) -> &Arc<ServerCounters> {
        &self.state.counters
    }

    /// Stop serving: unsubscribe every endpoint and the `$SRV` verbs, drop the sessions.
    /// Returns once the server has processed the unsubscriptions, so a request sent after
    /// this returns finds no responder.
    pub async fn stop(mut self) {
        let tasks: Vec<JoinHandle<()>> = self.tasks.drain(..).collect();
        self.shutdown();
        for task in tasks {
            task.abort();
            let _ = task.await;
        }
        // A request nobody answers, on the same connection: the server handles it after the
        // unsubscriptions sent before it, and answers "no responders" at once.
        let barrier = self.client.new_inbox();
        let _ = tokio::time::timeout(Duration::from_secs(5), self.client.request(barrier, bytes::Bytes::new())).await;
    }

    fn shutdown(&mut self) {
        if let Some(service) = self.service.take() {
            // `Service::stop` only signals and aborts its verb task; nothing in it waits.
            let _ = futures::executor::block_on(service.stop());
        }
        for task in self.tasks.drain(..) {
            task.abort();
        }
        self.state.sessions.lock().expect("sessions lock is never poisoned").clear();
    }
}

impl Drop for EnvServer {
    fn drop(&mut self) {
        self.shutdown();
    }
}

/// Answer the requests of one endpoint; each runs on the blocking pool (stepping is CPU work).
async fn serve_endpoint(state: Arc<ServerState>, op: Op, mut endpoint: service::endpoint::Endpoint) {
    while let Some(request) = endpoint.next().await {
        let state = state.clone();
        tokio::spawn(async move {
            let payload = request.message.payload.clone();
            let worker_state = state.clone();
            let reply = tokio::task::spawn_blocking(move || worker_state.handle(op, &payload))
                .await
                .unwrap_or_else(|err| Err((ErrorCode::Internal, format!("handler panicked: {err}"))));
            state.counters.requests.fetch_add(1, Ordering::Relaxed);
            let response = match reply {
                Ok(bytes) => Ok(bytes.into()),
                Err((code, message)) => {
                    if code == ErrorCode::BadRequest {
                        state.counters.rejected.fetch_add(1, Ordering::Relaxed);
                        let log = state.rejections.lock().map(|mut log| log.record("bad_request")).unwrap_or(false);
                        if log {
                            warn!(op = op.name(), %message, reason = "bad_request", "malformed environment request rejected");
                        }
                    }
                    // Header values cannot hold line breaks.
                    let status = message.replace(['\r', '\n'], " ");
                    Err(service::error::Error { status, code: code.code() as usize })
                }
            };
            if let Err(err) = request.respond(response).await {
                debug!(op = op.name(), %err, "could not send a reply");
            }
        });
    }
}

/// Drop sessions idle for longer than the idle timeout.
async fn expire_idle_sessions(state: Arc<ServerState>) {
    let timeout = state.config.idle_timeout;
    let mut ticks = tokio::time::interval((timeout / 4).clamp(Duration::from_millis(50), Duration::from_secs(10)));
    loop {
        ticks.tick().await;
        let mut sessions = state.sessions.lock().expect("sessions lock is never poisoned");
        let before = sessions.len();
        sessions.retain(|_, session| match session.try_lock() {
            Ok(session) => session.last_used.elapsed() < timeout,
            // Busy right now, so not idle.
            Err(_) => true,
        });
        let expired = before - sessions.len();
        if expired > 0 {
            state.counters.expired.fetch_add(expired as u64, Ordering::Relaxed);
            info!(expired, remaining = sessions.len(), "idle environment sessions dropped");
        }
    }
}

fn bad(message: impl Into<String>) -> Failure {
    (ErrorCode::BadRequest, message.into())
}

fn decode<T: serde::de::DeserializeOwned>(what: &'static str, payload: &[u8]) -> Result<T, Failure> {
    protocol::decode(what, payload).map_err(|err| bad(err.to_string()))
}

impl ServerState {
    /// Answer one request: the encoded reply, or an error code and description.
    fn handle(&self, op: Op, payload: &[u8]) -> Result<Vec<u8>, Failure> {
        let probe: VersionProbe = decode("request", payload)?;
        // Version 1 is version 2 without box actions: served for discrete environments only.
        let continuous = self.action_space.is_continuous();
        // Versions 1 and 2 are version 3 without image observations.
        let image = self.obs_encoding == ObsEncoding::U8;
        match probe.v {
            Some(v) if image && v < IMAGE_PROTOCOL_VERSION => {
                return Err((
                    ErrorCode::UnsupportedVersion,
                    format!(
                        "protocol version {v} is not served here (image observations need {IMAGE_PROTOCOL_VERSION})"
                    ),
                ))
            }
            Some(1) if continuous => {
                return Err((
                    ErrorCode::UnsupportedVersion,
                    format!("protocol version 1 is not served here (box actions need {PROTOCOL_VERSION})"),
                ))
            }
            Some(MIN_PROTOCOL_VERSION..=PROTOCOL_VERSION) => {}
            Some(other) => {
                return Err((
                    ErrorCode::UnsupportedVersion,
                    format!(
                        "protocol version {other} is not served here (this server speaks \
                         {MIN_PROTOCOL_VERSION} to {PROTOCOL_VERSION})"
                    ),
                ))
            }
            None => return Err(bad("request without a protocol version \"v\"")),
        }
        match op {
            Op::Spaces => Ok(self.spaces.clone()),
            Op::Open => self.open(decode("open request", payload)?),
            Op::Reset => {
                let request: ResetRequest = decode("reset request", payload)?;
                self.with_session(request.session, |session| {
                    let n_envs = session.envs.n_envs();
                    // Version 3: a subset of the environments (distinct, in range), else all.
                    let envs: Vec<usize> = match &request.envs {
                        None => (0..n_envs).collect(),
                        Some(envs) => {
                            let envs: Vec<usize> = envs.iter().map(|&e| e as usize).collect();
                            let distinct = envs.iter().collect::<std::collections::HashSet<_>>().len() == envs.len();
                            if envs.is_empty() || !distinct || envs.iter().any(|&e| e >= n_envs) {
                                return Err(bad(format!("reset envs must be distinct indices below {n_envs}")));
                            }
                            envs
                        }
                    };
                    if request.seeds.len() != envs.len() {
                        return Err(bad(format!("{} seeds for {} environments", request.seeds.len(), envs.len())));
                    }
                    for (&env_idx, seed) in envs.iter().zip(&request.seeds) {
                        session
                            .envs
                            .reset_env(env_idx, *seed)
                            .map_err(|err| (ErrorCode::Internal, format!("reset of environment {env_idx}: {err}")))?;
                    }
                    Ok(protocol::encode(&ObsReply { obs: ObsBin::encode(session.envs.obs(), self.obs_encoding) }))
                })
            }
            Op::Step => {
                let request: StepRequest = decode("step request", payload)?;
                self.with_session(request.session, |session| {
                    step(session, &request.actions, self.obs_dim, self.obs_encoding, &self.action_space)
                })
            }
            Op::Snapshot => {
                let request: SnapshotRequest = decode("snapshot request", payload)?;
                self.with_session(request.session, |session| {
                    let env_idx = env_index(request.env, session.envs.n_envs())?;
                    Ok(protocol::encode(&SnapshotReply { state: session.envs.snapshot_env(env_idx) }))
                })
            }
            Op::Restore => {
                let request: RestoreRequest = decode("restore request", payload)?;
                self.with_session(request.session, |session| {
                    let env_idx = env_index(request.env, session.envs.n_envs())?;
                    session.envs.restore_env(env_idx, &request.state).map_err(|err| match err {
                        EnvError::BadSnapshot(_) => bad(err.to_string()),
                        other => (ErrorCode::Internal, other.to_string()),
                    })?;
                    let dim = self.obs_dim;
                    let obs = &session.envs.obs()[env_idx * dim..(env_idx + 1) * dim];
                    Ok(protocol::encode(&ObsReply { obs: ObsBin::encode(obs, self.obs_encoding) }))
                })
            }
            Op::Close => {
                let request: CloseRequest = decode("close request", payload)?;
                self.sessions.lock().expect("sessions lock is never poisoned").remove(&request.session);
                Ok(protocol::encode(&EmptyReply {}))
            }
        }
    }

    fn open(&self, request: OpenRequest) -> Result<Vec<u8>, Failure> {
        let n_envs = request.n_envs as usize;
        let max = self.config.max_envs_per_session;
        if n_envs == 0 || n_envs > max {
            return Err(bad(format!("n_envs {n_envs} out of range 1..={max}")));
        }
        if request.seeds.len() != n_envs {
            return Err(bad(format!("{} seeds for {n_envs} environments", request.seeds.len())));
        }
        if self.sessions.lock().expect("sessions lock is never poisoned").len() >= self.config.max_sessions {
            return Err((ErrorCode::Capacity, format!("{} sessions already open", self.config.max_sessions)));
        }
        let internal = |err: EnvError| (ErrorCode::Internal, err.to_string());
        let envs = (0..n_envs).map(|_| (self.factory)()).collect::<Result<Vec<_>, _>>().map_err(internal)?;
        let mut envs = VecEnv::new(envs, 0).map_err(internal)?;
        for (env_idx, &seed) in request.seeds.iter().enumerate() {
            envs.reset_env(env_idx, Some(seed)).map_err(internal)?;
        }
        let obs = ObsBin::encode(envs.obs(), self.obs_encoding);
        let session_id = self.next_session.fetch_add(1, Ordering::Relaxed);
        let session = Session { step: VecStep::new(n_envs, self.obs_dim), envs, last_used: Instant::now() };
        self.sessions
            .lock()
            .expect("sessions lock is never poisoned")
            .insert(session_id, Arc::new(Mutex::new(session)));
        debug!(session = session_id, n_envs, "session opened");
        Ok(protocol::encode(&OpenReply {
            session: session_id,
            obs,
            idle_timeout_ms: self.config.idle_timeout.as_millis() as u64,
        }))
    }

    fn with_session(
        &self,
        session_id: u64,
        work: impl FnOnce(&mut Session) -> Result<Vec<u8>, Failure>,
    ) -> Result<Vec<u8>, Failure> {
        let session = self
            .sessions
            .lock()
            .expect("sessions lock is never poisoned")
            .get(&session_id)
            .cloned()
            .ok_or_else(|| (ErrorCode::UnknownSession, format!("unknown session {session_id}")))?;
        let mut session = session.lock().expect("a session lock is never poisoned");
        session.last_used = Instant::now();
        work(&mut session)
    }
}

fn env_index(env: u32, n_envs: usize) -> Result<usize, Failure> {
    let env_idx = env as usize;
    if env_idx >= n_envs {
        return Err(bad(format!("environment {env_idx} out of range for {n_envs} environments")));
    }
    Ok(env_idx)
}

/// One step of a session, encoded as a [`StepReply`].
///
/// Box actions follow docs/ENV_PROTOCOL.md ("Continuous actions"): a row with a non-finite
/// value fails its environment (reported, truncated with reward 0, its previous observation
/// final, reset) and the environment never sees the value (it is stepped with the repaired row
/// and then reset, which the client cannot tell apart); finite rows are clipped by the
/// [`VecEnv`], as in-process.
fn step(
    session: &mut Session,
    actions: &StepActions,
    obs_dim: usize,
    obs_encoding: ObsEncoding,
    action_space: &ActionSpace,
) -> Result<Vec<u8>, Failure> {
    let n_envs = session.envs.n_envs();
    // Environments whose action was not finite, with the observation they had.
    let mut failed: Vec<(usize, Vec<f32>)> = Vec::new();
    match (actions, action_space) {
        (StepActions::Discrete(actions), ActionSpace::Discrete { .. }) => {
            if actions.len() != n_envs {
                return Err(bad(format!("{} actions for {n_envs} environments", actions.len())));
            }
            let actions: Vec<usize> = actions.iter().map(|&a| a as usize).collect();
            session.envs.step(Actions::Discrete(&actions), &mut session.step).map_err(|err| bad(err.to_string()))?;
        }
        (StepActions::Box(values), ActionSpace::Box { low, .. }) => {
            let dim = low.len();
            if values.len() != n_envs * dim {
                return Err(bad(format!("{} action values for {n_envs} environments of {dim}", values.len())));
            }
            let mut values = values.clone();
            for (env_idx, row) in values.chunks_exact_mut(dim).enumerate() {
                if !row.iter().all(|v| v.is_finite()) {
                    failed.push((env_idx, session.envs.obs()[env_idx * obs_dim..(env_idx + 1) * obs_dim].to_vec()));
                    action_space.repair(row);
                }
            }
            session
                .envs
                .step(Actions::Continuous { values: &values, dim }, &mut session.step)
                .map_err(|err| bad(err.to_string()))?;
        }
        (StepActions::Box(_), ActionSpace::Discrete { .. }) => {
            return Err(bad("box actions for an environment with discrete actions"))
        }
        (StepActions::Discrete(_), ActionSpace::Box { .. }) => {
            return Err(bad("integer actions for an environment with box actions"))
        }
    }
    let mut errors: Vec<EnvFailure> = Vec::new();
    for (env_idx, previous) in &failed {
        let env_idx = *env_idx;
        let out = &mut session.step;
        let ended = out.terminated[env_idx] || out.truncated[env_idx];
        out.rewards[env_idx] = 0.0;
        out.terminated[env_idx] = false;
        out.truncated[env_idx] = true;
        out.final_obs[env_idx * obs_dim..(env_idx + 1) * obs_dim].copy_from_slice(previous);
        errors.push(EnvFailure { env: env_idx as u32, message: "non-finite action".to_string() });
        // An episode that ended in this step was reset by the vector env already.
        if !ended {
            if let Err(err) = session.envs.reset_env(env_idx, None) {
                errors.push(EnvFailure { env: env_idx as u32, message: err.to_string() });
            }
        }
    }
    let out = &session.step;
    let mut final_obs = Vec::new();
    for (env_idx, row) in out.final_obs.chunks_exact(obs_dim).enumerate() {
        if out.terminated[env_idx] || out.truncated[env_idx] {
            final_obs.extend_from_slice(row);
        }
    }
    for (env_idx, error) in &out.env_errors {
        // A reset failure right after an episode ended is reported once per environment.
        if !errors.iter().any(|f| f.env as usize == *env_idx) {
            errors.push(EnvFailure { env: *env_idx as u32, message: error.to_string() });
        }
    }
    errors.sort_by_key(|failure| failure.env);
    Ok(protocol::encode(&StepReply {
        obs: ObsBin::encode(session.envs.obs(), obs_encoding),
        rewards: out.rewards.clone(),
        terminated: out.terminated.clone(),
        truncated: out.truncated.clone(),
        final_obs: ObsBin::encode(&final_obs, obs_encoding),
        errors,
    }))
}
