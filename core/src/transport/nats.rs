//! The NATS JetStream transport: the four transport traits over a real broker.
//!
//! Layout of one run (all names from [`crate::subjects`]):
//! - Actors publish encoded segments to `volley.<run>.traj.<actor>`, each with a
//!   `Nats-Msg-Id`, so a retried publish is stored once (server-side dedup inside the
//!   stream's duplicate window).
//! - The stream `volley-<run>-traj` (file storage, limits retention) keeps segments after
//!   they were consumed, bounded by bytes and age, so a run can be replayed.
//! - The learner reads through the durable pull consumer `learner` with explicit acks.
//! - The KV bucket `volley-<run>` holds the run spec (key `spec`) and a pointer to the newest
//!   weights (key `weights`); the object store `volley-<run>-wts` holds the weights buffers
//!   (chunked, so any size works with the default 1 MiB `max_payload`).
//!
//! The traits are blocking, because actors and the learner are CPU threads. [`NatsBus`] owns a
//! small tokio runtime (or borrows one through [`NatsBus::connect_with_handle`]) and every
//! blocking method runs its async work with `Handle::block_on`. Never call them from inside
//! a tokio worker thread (tokio panics); call them from plain threads or `spawn_blocking`.
//!
//! Every network call has a deadline, so a stalled broker surfaces as
//! [`TransportError::Timeout`] within seconds, and every failure is logged with its operation.
//! async-nats reconnects by itself; the components here retry across a broker restart:
//! the sink until its segment is stored (or `stop`), ack/reject/weights publish for
//! [`NatsConfig::retry_deadline`], the learner's fetch on its next `recv`, and the weights
//! follower re-creates its KV watch after every reconnect.

use std::collections::{HashMap, VecDeque};
use std::fmt;
use std::future::{Future, IntoFuture};
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use async_nats::jetstream::{self, consumer, kv, object_store, stream, AckKind, ErrorCode};
use async_nats::{ConnectErrorKind, ConnectOptions, Event, ServerError, Subject};
use bytes::Bytes;
use futures::StreamExt;
use tokio::io::AsyncReadExt;
use tokio::runtime::Handle;
use tracing::{debug, info, warn};

use super::{
    Delivery, DeliveryToken, TrajectorySink, TrajectorySource, TransportError, WeightsFollower, WeightsPublisher,
};
use crate::ids::{ActorId, PolicyVersion, RunId};
use crate::spec::RunSpec;
use crate::subjects;
use crate::wire::{self, TrajectorySegment, Weights};

/// How often a throttled sink re-reads the learner's backlog. Short, because a fast learner
/// drains a batch in well under a millisecond; one consumer-info request costs the server
/// about as much as one small publish.
const PACING_POLL: Duration = Duration::from_millis(2);
/// How long a backlog reading that showed room is trusted (counting the sink's own publishes
/// since), so a burst of segments does not cost one consumer-info request each. Short: other
/// actors publish meanwhile too, and every segment of overshoot adds policy lag.
const PACING_CACHE: Duration = Duration::from_millis(20);
/// Deadline of the consumer-info request behind pacing and `backlog()`: short, because a slow
/// answer must not stall the caller (an unknown backlog does not block).
const BACKLOG_DEADLINE: Duration = Duration::from_millis(500);
/// How long `TrajectorySource::backlog` trusts its last reading.
const BACKLOG_CACHE: Duration = Duration::from_secs(1);
/// How long an ack for a delivery from a lost connection may take to hand to the client.
const ABANDON_ACK_DEADLINE: Duration = Duration::from_secs(1);
/// First and longest pause between retries.
const BACKOFF_FIRST: Duration = Duration::from_millis(50);
const BACKOFF_MAX: Duration = Duration::from_secs(1);
/// Weights transfers get `request_timeout` plus the time to move their bytes at this rate
/// (far below loopback or LAN speed, so only a stalled transfer hits the deadline).
const MIN_TRANSFER_BYTES_PER_SEC: f64 = 8.0 * 1024.0 * 1024.0;
/// An ephemeral replay consumer is removed by the server after this long without a fetch.
const REPLAY_INACTIVE_THRESHOLD: Duration = Duration::from_secs(300);
/// How a permission violation reported by the server starts (`-ERR 'Permissions Violation for
/// Publish to "<subject>"'`, or `... for Subscription to ...`).
const PERMISSION_VIOLATION: &str = "permissions violation";
/// Start of the message of a [`TransportError::Failed`] caused by a permission violation.
const PERMISSION_DENIED: &str = "permission denied by the nats server";
/// Permission violations remembered per connection (the newest ones).
const DENIALS_KEPT: usize = 16;

/// How a [`NatsBus`] authenticates to the server. `Debug` never shows a secret.
#[derive(Clone, PartialEq, Eq)]
pub enum NatsAuth {
    /// A user name and password (a `users` entry in the server config, see `broker-config/`).
    UserPassword {
        /// The user name.
        user: String,
        /// The password (plain text; the server may store a bcrypt hash of it).
        password: String,
    },
    /// A token (`authorization { token }` in the server config).
    Token(String),
}

impl fmt::Debug for NatsAuth {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            NatsAuth::UserPassword { user, .. } => {
                f.debug_struct("UserPassword").field("user", user).field("password", &"<redacted>").finish()
            }
            NatsAuth::Token(_) => f.write_str("Token(<redacted>)"),
        }
    }
}

impl NatsAuth {
    /// Who connects, for logs and errors (never the secret).
    fn describe(&self) -> String {
        match self {
            NatsAuth::UserPassword { user, .. } => format!("user {user}"),
            NatsAuth::Token(_) => "a token".to_string(),
        }
    }
}

/// Permission violations the server reported on one connection, newest last.
///
/// The server answers a denied publish (a JetStream API request included) with an
/// asynchronous `-ERR` and drops the message, so the request behind it only times out. The
/// transport remembers the violations so that such a timeout is reported as the denial it is
/// (see [`timed`] and [`call`]), and so that retry loops give up instead of retrying a denial.
#[derive(Debug, Default)]
struct Denials {
    recent: Mutex<VecDeque<(Instant, String)>>,
}

impl Denials {
    fn record(&self, message: String) {
        let mut recent = self.recent.lock().expect("denials lock is never poisoned");
        if recent.len() == DENIALS_KEPT {
            recent.pop_front();
        }
        recent.push_back((Instant::now(), message));
    }

    /// The newest violation reported at or after `since` whose message contains `subject`
    /// (any violation when `subject` is empty).
    fn since(&self, since: Instant, subject: &str) -> Option<String> {
        let recent = self.recent.lock().expect("denials lock is never poisoned");
        recent.iter().rev().find(|(at, message)| *at >= since && message.contains(subject)).map(|(_, m)| m.clone())
    }
}

tokio::task_local! {
    /// The denials of the bus whose `block_on` runs the current future; lets [`timed`] and
    /// [`call`] explain a timeout without a reference to the bus.
    static DENIALS: Arc<Denials>;
}

/// A [`TransportError::Failed`] for a permission violation reported while `operation` ran.
#[cold]
fn denied(operation: &'static str, violation: &str) -> TransportError {
    let message = format!("{PERMISSION_DENIED}: {violation} (check the NATS user's permissions, see broker-config/)");
    warn!(operation, error = %message, "nats operation denied");
    TransportError::Failed { operation, message }
}

/// Whether `err` reports a permission violation (retrying it cannot help).
fn is_denied(err: &TransportError) -> bool {
    matches!(err, TransportError::Failed { message, .. } if message.starts_with(PERMISSION_DENIED))
}

/// The permission violation reported since `started` on the connection of the bus running
/// this future, if any.
fn denial_since(started: Instant) -> Option<String> {
    DENIALS.try_with(|denials| denials.since(started, "")).ok().flatten()
}

/// Connection and run-layout settings of a [`NatsBus`].
#[derive(Debug, Clone, PartialEq)]
pub struct NatsConfig {
    /// Server URL, e.g. `nats://127.0.0.1:4222`.
    pub url: String,
    /// The run whose subjects, stream and buckets this bus uses.
    pub run: RunId,
    /// How long [`NatsBus::connect`] keeps trying to reach the server.
    pub connect_timeout: Duration,
    /// Deadline of one request to the server (stream admin, KV, acks, publish acks).
    pub request_timeout: Duration,
    /// How long learner-side operations (ack, reject, weights publish) keep retrying through a
    /// broker outage before they return an error.
    pub retry_deadline: Duration,
    /// Upper bound on the bytes the trajectory stream keeps; the oldest segments go first.
    pub stream_max_bytes: i64,
    /// Segments older than this are removed from the trajectory stream.
    pub stream_max_age: Duration,
    /// The window in which the server drops a second message with the same `Nats-Msg-Id`.
    pub duplicate_window: Duration,
    /// Publish acks a sink keeps in flight before it waits for the oldest.
    pub publish_window: usize,
    /// Pacing: a sink waits while the learner consumer's backlog (undelivered plus
    /// delivered-but-unacknowledged segments) is at or above this.
    pub max_backlog_segments: u64,
    /// A delivery not acknowledged within this is delivered again (held deliveries are kept
    /// alive by `recv`, see [`NatsTrajectorySource`]).
    pub ack_wait: Duration,
    /// Deliveries of one segment before the server gives up on it (-1: no limit).
    pub max_deliver: i64,
    /// Weights objects kept in the object store (the newest ones); older ones are deleted.
    pub keep_weight_versions: usize,
    /// Copies JetStream keeps of the run's streams and buckets (trajectories, run KV, weights,
    /// and with work items the work queue and snapshot stores): 1 on a single server, 3 on a
    /// 3-node cluster so that losing one server loses nothing. Applied when they are created;
    /// the two streams are also updated to it when they exist.
    pub replicas: usize,
    /// How to authenticate (`None`: anonymous, for a server without auth).
    pub auth: Option<NatsAuth>,
}

impl NatsConfig {
    /// Defaults sized for one learner and tens of actors on a LAN: 5 s requests, 30 s retry
    /// budget and ack wait, a 1 GiB / 24 h trajectory stream, 32 publish acks in flight,
    /// a backlog bound of 256 segments, 10 deliveries, 3 weights versions kept, one replica.
    pub fn new(url: impl Into<String>, run: RunId) -> Self {
        NatsConfig {
            url: url.into(),
            run,
            connect_timeout: Duration::from_secs(10),
            request_timeout: Duration::from_secs(5),
            retry_deadline: Duration::from_secs(30),
            stream_max_bytes: 1 << 30,
            stream_max_age: Duration::from_secs(24 * 3600),
            duplicate_window: Duration::from_secs(120),
            publish_window: 32,
            max_backlog_segments: 256,
            ack_wait: Duration::from_secs(30),
            max_deliver: 10,
            keep_weight_versions: 3,
            replicas: 1,
            auth: None,
        }
    }

    fn transfer_deadline(&self, size_bytes: usize) -> Duration {
        self.request_timeout + Duration::from_secs_f64(size_bytes as f64 / MIN_TRANSFER_BYTES_PER_SEC)
    }
}

/// Shuts an owned runtime down without waiting for its tasks, so dropping the bus never
/// blocks (and works even from inside another runtime).
struct OwnedRuntime(Option<tokio::runtime::Runtime>);

impl Drop for OwnedRuntime {
    fn drop(&mut self) {
        if let Some(runtime) = self.0.take() {
            runtime.shutdown_background();
        }
    }
}

/// What every component of one bus shares. Background tasks never hold it, so the runtime is
/// never dropped from inside itself.
struct Shared {
    config: NatsConfig,
    client: async_nats::Client,
    js: jetstream::Context,
    handle: Handle,
    /// Counts (re)connections; the weights follower re-creates its watch when it changes.
    connections: tokio::sync::watch::Receiver<u64>,
    /// Permission violations the server reported on this connection.
    denials: Arc<Denials>,
    /// Declared last: dropped after the client.
    _runtime: OwnedRuntime,
}

impl Shared {
    fn block_on<F: Future>(&self, future: F) -> F::Output {
        self.handle.block_on(DENIALS.scope(self.denials.clone(), future))
    }
}

/// A connection to a NATS server for one run; the factory of sinks, sources, publishers and
/// followers. Cheap to keep around; every component it makes shares its connection.
pub struct NatsBus {
    shared: Arc<Shared>,
}

impl fmt::Debug for NatsBus {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("NatsBus").field("url", &self.shared.config.url).field("run", &self.shared.config.run).finish()
    }
}

impl NatsBus {
    /// Connect with a runtime of its own (two worker threads), retrying for
    /// [`NatsConfig::connect_timeout`]; the error names the URL and the last failure.
    pub fn connect(config: NatsConfig) -> Result<Self, TransportError> {
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .thread_name("volley-nats")
            .enable_all()
            .build()
            .map_err(|err| failed("start nats runtime", err))?;
        let handle = runtime.handle().clone();
        Self::connect_inner(config, handle, OwnedRuntime(Some(runtime)))
    }

    /// Connect using an existing multi-thread tokio runtime (a current-thread runtime cannot
    /// drive I/O for `Handle::block_on`). The blocking methods must still be called from
    /// outside its worker threads.
    pub fn connect_with_handle(config: NatsConfig, handle: Handle) -> Result<Self, TransportError> {
        Self::connect_inner(config, handle, OwnedRuntime(None))
    }

    fn connect_inner(config: NatsConfig, handle: Handle, runtime: OwnedRuntime) -> Result<Self, TransportError> {
        let (connections_tx, connections) = tokio::sync::watch::channel(0u64);
        let connections_tx = Arc::new(connections_tx);
        let denials = Arc::new(Denials::default());
        // Our own retry loop instead of `retry_on_initial_connect`: that option returns at once
        // and leaves a task retrying forever, while a bounded loop gives a clear error.
        let client = handle.block_on(async {
            let started = Instant::now();
            let mut backoff = Backoff::new();
            let mut attempts = 0u32;
            loop {
                attempts += 1;
                let remaining = config.connect_timeout.saturating_sub(started.elapsed());
                let (events, event_denials) = (connections_tx.clone(), denials.clone());
                let mut options = ConnectOptions::new()
                    .name("volley")
                    .connection_timeout(config.request_timeout.min(remaining).max(Duration::from_millis(10)))
                    .request_timeout(Some(config.request_timeout))
                    .reconnect_delay_callback(reconnect_delay)
                    .event_callback(move |event| {
                        let (events, denials) = (events.clone(), event_denials.clone());
                        async move { on_connection_event(&events, &denials, event) }
                    });
                options = match &config.auth {
                    Some(NatsAuth::UserPassword { user, password }) => {
                        options.user_and_password(user.clone(), password.clone())
                    }
                    Some(NatsAuth::Token(token)) => options.token(token.clone()),
                    None => options,
                };
                let problem = match tokio::time::timeout(remaining, options.connect(config.url.as_str())).await {
                    Ok(Ok(client)) => break Ok(client),
                    // Wrong credentials do not get better with retries.
                    Ok(Err(err)) if err.kind() == ConnectErrorKind::AuthorizationViolation => {
                        let who = config.auth.as_ref().map_or_else(|| "anonymous".to_string(), NatsAuth::describe);
                        break Err(failed(
                            "connect",
                            format!("nats server {} refused {who}: {err} (wrong user or password?)", config.url),
                        ));
                    }
                    Ok(Err(err)) => err.to_string(),
                    Err(_) => "timed out".to_string(),
                };
                if started.elapsed() >= config.connect_timeout {
                    let message = format!(
                        "cannot reach nats server {} within {:?} ({attempts} attempts): {problem}",
                        config.url, config.connect_timeout
                    );
                    warn!(operation = "connect", url = %config.url, %message, "nats connect failed");
                    break Err(TransportError::Failed { operation: "connect", message });
                }
                debug!(url = %config.url, attempts, %problem, "nats connect failed; retrying");
                let pause = backoff.next().min(config.connect_timeout.saturating_sub(started.elapsed()));
                tokio::time::sleep(pause).await;
            }
        })?;
        // Building the context spawns its acker task, which needs the runtime entered.
        let js = {
            let _entered = handle.enter();
            jetstream::ContextBuilder::new().timeout(config.request_timeout).build(client.clone())
        };
        info!(url = %config.url, run = %config.run, max_payload = client.max_payload(), "connected to nats");
        Ok(NatsBus { shared: Arc::new(Shared { config, client, js, handle, connections, denials, _runtime: runtime }) })
    }

    /// The bus configuration.
    pub fn config(&self) -> &NatsConfig {
        &self.shared.config
    }

    /// The largest message the server accepts, headers included (`max_payload`, 1 MiB by
    /// default). Segments must fit; weights need not (the object store chunks them).
    pub fn max_payload(&self) -> usize {
        self.shared.client.max_payload()
    }

    /// The underlying async-nats client (for tests and tools; the transport does not need it).
    pub fn client(&self) -> &async_nats::Client {
        &self.shared.client
    }

    /// The JetStream context the bus uses (request timeout = [`NatsConfig::request_timeout`]).
    pub fn jetstream(&self) -> &jetstream::Context {
        &self.shared.js
    }

    /// The runtime the bus runs its async work on.
    pub fn handle(&self) -> &Handle {
        &self.shared.handle
    }

    /// Learner side: idempotently create the run's broker objects and publish the run spec.
    ///
    /// Creates or updates the trajectory stream (file storage, limits retention so consumed
    /// segments stay for replay, [`NatsConfig::stream_max_bytes`] / `stream_max_age` bounds
    /// discarding the oldest, a [`NatsConfig::duplicate_window`] for `Nats-Msg-Id` dedup), the
    /// durable pull consumer `learner` (explicit ack, `ack_wait`, `max_deliver`), the KV bucket
    /// and the object store, all with [`NatsConfig::replicas`] copies, then puts `spec` as JSON
    /// under key `spec`. Safe to call again,
    /// e.g. by a restarted learner; changed limits are applied to the existing stream and
    /// consumer.
    pub fn ensure_run(&self, spec: &RunSpec) -> Result<(), TransportError> {
        let shared = &self.shared;
        let config = &shared.config;
        if spec.run != config.run {
            return Err(failed(
                "ensure run",
                format!("spec is for run {} but the bus serves run {}", spec.run, config.run),
            ));
        }
        let spec_json = serde_json::to_vec_pretty(spec).map_err(|err| failed("encode run spec", err))?;
        let timeout = config.request_timeout;
        let stores = &spec.hyper.stores;
        shared.block_on(async {
            let stream_name = subjects::trajectory_stream(&config.run);
            let stream_config = stream::Config {
                name: stream_name.clone(),
                description: Some(format!("volley run {} trajectory segments", config.run)),
                subjects: vec![subjects::trajectories_all(&config.run)],
                retention: stream::RetentionPolicy::Limits,
                storage: stream::StorageType::File,
                discard: stream::DiscardPolicy::Old,
                max_bytes: config.stream_max_bytes,
                max_age: config.stream_max_age,
                duplicate_window: config.duplicate_window,
                num_replicas: config.replicas,
                ..Default::default()
            };
            call("create trajectory stream", timeout, shared.js.create_or_update_stream(stream_config)).await?;
            let stream = call("open trajectory stream", timeout, shared.js.get_stream_no_info(&stream_name)).await?;
            call("create learner consumer", timeout, stream.create_consumer(learner_consumer_config(config))).await?;

            let bucket = subjects::run_bucket(&config.run);
            let kv = match open_kv(&shared.js, &bucket, timeout).await? {
                Some(kv) => kv,
                None => {
                    let kv_config = kv::Config {
                        bucket: bucket.clone(),
                        description: format!("volley run {}: spec and weights pointer", config.run),
                        history: stores.kv_history as i64,
                        max_bytes: stores.kv_max_bytes as i64,
                        storage: stream::StorageType::File,
                        num_replicas: config.replicas,
                        ..Default::default()
                    };
                    match call("create run bucket", timeout, shared.js.create_key_value(kv_config)).await {
                        Ok(kv) => kv,
                        // Another learner may have created it in between.
                        Err(err) => open_kv(&shared.js, &bucket, timeout).await?.ok_or(err)?,
                    }
                }
            };
            let weights_bucket = subjects::weights_bucket(&config.run);
            if open_objects(&shared.js, &weights_bucket, timeout).await?.is_none() {
                let objects_config = object_store::Config {
                    bucket: weights_bucket.clone(),
                    description: Some(format!("volley run {}: weights buffers", config.run)),
                    max_bytes: stores.weights_max_bytes as i64,
                    storage: stream::StorageType::File,
                    num_replicas: config.replicas,
                    ..Default::default()
                };
                if let Err(err) =
                    call("create weights store", timeout, shared.js.create_object_store(objects_config)).await
                {
                    open_objects(&shared.js, &weights_bucket, timeout).await?.ok_or(err)?;
                }
            }
            if spec.hyper.work.enabled {
                ensure_work_objects(shared, &spec.hyper.work, stores).await?;
            }
            call("put run spec", timeout, kv.put(subjects::SPEC_KEY, Bytes::from(spec_json))).await?;
            info!(run = %config.run, stream = %stream_name, "run ready on nats");
            Ok(())
        })
    }

    /// Actor side: the run spec, or `Ok(None)` when the run's bucket or its `spec` key does not
    /// exist (yet).
    pub fn read_spec(&self) -> Result<Option<RunSpec>, TransportError> {
        let shared = &self.shared;
        let timeout = shared.config.request_timeout;
        shared.block_on(async {
            let Some(kv) = open_kv(&shared.js, &subjects::run_bucket(&shared.config.run), timeout).await? else {
                return Ok(None);
            };
            let Some(bytes) = call("read run spec", timeout, kv.get(subjects::SPEC_KEY)).await? else {
                return Ok(None);
            };
            serde_json::from_slice(&bytes).map(Some).map_err(|err| failed("decode run spec", err))
        })
    }

    /// Actor side: a sink publishing as `actor`. `stop` ends its retries and waits with
    /// [`TransportError::Closed`]. The stream need not exist yet: publishes retry until it does.
    pub fn trajectory_sink(
        &self,
        actor: &ActorId,
        stop: Arc<AtomicBool>,
    ) -> Result<NatsTrajectorySink, TransportError> {
        let shared = self.shared.clone();
        let timeout = shared.config.request_timeout;
        let stream = shared.block_on(call(
            "open trajectory stream",
            timeout,
            shared.js.get_stream_no_info(subjects::trajectory_stream(&shared.config.run)),
        ))?;
        Ok(NatsTrajectorySink {
            subject: Subject::from(subjects::trajectories(&shared.config.run, actor)),
            incarnation: incarnation(),
            actor: actor.clone(),
            stop,
            stream,
            in_flight: VecDeque::with_capacity(shared.config.publish_window.max(1)),
            max_backlog_segments: shared.config.max_backlog_segments,
            pacing: Pacing::default(),
            stats: SinkStats::default(),
            clock: Arc::default(),
            shared,
        })
    }

    /// Learner side: the durable consumer `learner` (created if missing; the stream must
    /// exist, see [`NatsBus::ensure_run`]).
    pub fn trajectory_source(&self) -> Result<NatsTrajectorySource, TransportError> {
        let shared = self.shared.clone();
        let timeout = shared.config.request_timeout;
        let consumer = shared.block_on(async {
            let stream_name = subjects::trajectory_stream(&shared.config.run);
            let stream = call("open trajectory stream", timeout, shared.js.get_stream_no_info(&stream_name)).await?;
            call(
                "open learner consumer",
                timeout,
                stream.get_or_create_consumer(subjects::LEARNER_CONSUMER, learner_consumer_config(&shared.config)),
            )
            .await
        })?;
        Ok(NatsTrajectorySource::new(shared, consumer, SourceMode::Durable))
    }

    /// Every segment the stream holds, from the first, in stream order, through an ephemeral
    /// consumer that does not disturb the learner's. Acks and rejects are no-ops; `recv`
    /// returns [`TransportError::Closed`] once it has delivered the last segment the stream
    /// held when the replay started.
    pub fn replay_source(&self) -> Result<NatsTrajectorySource, TransportError> {
        let shared = self.shared.clone();
        let timeout = shared.config.request_timeout;
        let (consumer, end_sequence, n_messages) = shared.block_on(async {
            let stream_name = subjects::trajectory_stream(&shared.config.run);
            let stream = call("open trajectory stream", timeout, shared.js.get_stream(&stream_name)).await?;
            let state = &stream.cached_info().state;
            let (end_sequence, n_messages) = (state.last_sequence, state.messages);
            let config = consumer::pull::Config {
                description: Some("volley replay".to_string()),
                deliver_policy: consumer::DeliverPolicy::All,
                ack_policy: consumer::AckPolicy::None,
                inactive_threshold: REPLAY_INACTIVE_THRESHOLD,
                memory_storage: true,
                ..Default::default()
            };
            let consumer = call("create replay consumer", timeout, stream.create_consumer(config)).await?;
            Ok::<_, TransportError>((consumer, end_sequence, n_messages))
        })?;
        info!(run = %shared.config.run, end_sequence, n_messages, "replay started");
        let finished = n_messages == 0;
        Ok(NatsTrajectorySource::new(shared, consumer, SourceMode::Replay { end_sequence, finished }))
    }

    /// Learner side: publishes weights to the object store and the `weights` pointer to KV.
    /// Needs the run's buckets ([`NatsBus::ensure_run`]).
    pub fn weights_publisher(&self) -> Result<NatsWeightsPublisher, TransportError> {
        let shared = self.shared.clone();
        let timeout = shared.config.request_timeout;
        let (kv, objects, backing, pointer, mut kept) = shared.block_on(async {
            let run = &shared.config.run;
            let missing = |what: &str| {
                failed("open weights publisher", format!("{what} of run {run} is missing; call ensure_run first"))
            };
            let kv =
                open_kv(&shared.js, &subjects::run_bucket(run), timeout).await?.ok_or_else(|| missing("kv bucket"))?;
            let objects = open_objects(&shared.js, &subjects::weights_bucket(run), timeout)
                .await?
                .ok_or_else(|| missing("weights store"))?;
            let pointer = read_pointer(&kv, timeout).await?;
            let (kept, deleted) = list_weight_objects(&objects, timeout).await?;
            let bucket = subjects::weights_bucket(run);
            let backing = call(
                "open weights store stream",
                timeout,
                shared.js.get_stream_no_info(subjects::object_backing_stream(&bucket)),
            )
            .await?;
            // Markers left by an earlier learner (or a failed purge).
            for object in &deleted {
                purge_weights_marker(&backing, &bucket, object, timeout).await;
            }
            Ok::<_, TransportError>((kv, objects, backing, pointer, kept))
        })?;
        kept.sort();
        if let Some(pointer) = &pointer {
            info!(run = %shared.config.run, version = pointer.version, "weights already published in this run");
        }
        Ok(NatsWeightsPublisher {
            kv,
            objects,
            backing,
            published_before: pointer.map(|p| p.version),
            last_version: None,
            kept: kept.into(),
            shared,
        })
    }

    /// Actor side: follows the `weights` pointer (a background watch) and fetches and verifies
    /// new versions on demand. The run's bucket need not exist yet.
    pub fn weights_follower(&self, layout_hash: u64, n_params: usize) -> Result<NatsWeightsFollower, TransportError> {
        let shared = self.shared.clone();
        let slot = Arc::new(PointerSlot::default());
        let mut connections = shared.connections.clone();
        connections.borrow_and_update();
        let task = shared.handle.spawn(follow_pointer(
            shared.js.clone(),
            subjects::run_bucket(&shared.config.run),
            shared.config.request_timeout,
            slot.clone(),
            connections,
        ));
        Ok(NatsWeightsFollower {
            shared,
            layout_hash,
            n_params,
            slot,
            objects: None,
            newest: None,
            settled_write: 0,
            retry: None,
            refusals: 0,
            task,
        })
    }
}

fn learner_consumer_config(config: &NatsConfig) -> consumer::pull::Config {
    consumer::pull::Config {
        durable_name: Some(subjects::LEARNER_CONSUMER.to_string()),
        description: Some(format!("volley run {} learner", config.run)),
        deliver_policy: consumer::DeliverPolicy::All,
        ack_policy: consumer::AckPolicy::Explicit,
        ack_wait: config.ack_wait,
        max_deliver: config.max_deliver,
        ..Default::default()
    }
}

fn reconnect_delay(attempts: usize) -> Duration {
    // Exponential from 0 like async-nats' default, but capped at 2 s instead of 4 s, so a
    // restarted broker is picked up quickly.
    let exponent = attempts.saturating_sub(1).min(16) as u32;
    Duration::from_millis(if attempts <= 1 { 0 } else { 2u64.pow(exponent) }).min(Duration::from_secs(2))
}

fn on_connection_event(connections: &tokio::sync::watch::Sender<u64>, denials: &Denials, event: Event) {
    match event {
        Event::ServerError(ServerError::Other(message)) if message.to_lowercase().starts_with(PERMISSION_VIOLATION) => {
            warn!(error = %message, "nats server denied an operation");
            denials.record(message);
        }
        Event::Connected => {
            connections.send_modify(|n| *n += 1);
            info!("nats connected");
        }
        Event::Disconnected => warn!("nats disconnected; reconnecting"),
        Event::Closed => warn!("nats connection closed"),
        Event::SlowConsumer(sid) => warn!(sid, "nats slow consumer"),
        other => debug!(event = %other, "nats connection event"),
    }
}

/// A per-sink id for message ids: time-based, so a restarted actor gets a new one.
fn incarnation() -> String {
    let nanos = SystemTime::now().duration_since(UNIX_EPOCH).map(|d| d.as_nanos()).unwrap_or(0);
    format!("{:x}", (nanos as u64) ^ ((std::process::id() as u64) << 48))
}

/// Log and wrap a failure.
#[cold]
fn failed(operation: &'static str, err: impl fmt::Display) -> TransportError {
    let message = err.to_string();
    warn!(operation, error = %message, "nats operation failed");
    TransportError::Failed { operation, message }
}

/// Run `future` with a deadline; log and map an expiry to [`TransportError::Timeout`].
/// A timeout after a permission violation reported meanwhile becomes that denial.
async fn timed<F: Future>(operation: &'static str, after: Duration, future: F) -> Result<F::Output, TransportError> {
    let started = Instant::now();
    tokio::time::timeout(after, future).await.map_err(|_| {
        if let Some(violation) = denial_since(started) {
            return denied(operation, &violation);
        }
        warn!(operation, ?after, "nats operation timed out");
        TransportError::Timeout { operation, after }
    })
}

/// [`timed`] for a fallible call: both the deadline and the call's error become a
/// [`TransportError`] naming `operation`.
async fn call<T, E: fmt::Display>(
    operation: &'static str,
    after: Duration,
    future: impl Future<Output = Result<T, E>>,
) -> Result<T, TransportError> {
    let started = Instant::now();
    // async-nats times its requests out after the same `request_timeout`: a denied request
    // usually fails here, as an error of the call, rather than in `timed`.
    timed(operation, after, future).await?.map_err(|err| match denial_since(started) {
        Some(violation) => denied(operation, &violation),
        None => failed(operation, err),
    })
}

/// Exponential backoff between retries: 50 ms doubling to 1 s.
#[derive(Debug)]
struct Backoff(Duration);

impl Backoff {
    fn new() -> Self {
        Backoff(BACKOFF_FIRST)
    }

    fn next(&mut self) -> Duration {
        let pause = self.0;
        self.0 = (self.0 * 2).min(BACKOFF_MAX);
        pause
    }
}

/// Retry `attempt` with backoff until it succeeds or `budget` has passed; returns the last
/// error then. Each failure is logged (by `call`/`timed`) with its operation.
async fn retry_for<T, F, Fut>(operation: &'static str, budget: Duration, mut attempt: F) -> Result<T, TransportError>
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Result<T, TransportError>>,
{
    let started = Instant::now();
    let mut backoff = Backoff::new();
    let mut attempts = 0u32;
    loop {
        attempts += 1;
        match attempt().await {
            Ok(value) => {
                if attempts > 1 {
                    info!(operation, attempts, "nats operation succeeded after retries");
                }
                return Ok(value);
            }
            Err(err) if is_denied(&err) => return Err(err),
            Err(err) if started.elapsed() >= budget => {
                warn!(operation, attempts, %err, "nats operation failed; giving up");
                return Err(err);
            }
            Err(_) => tokio::time::sleep(backoff.next()).await,
        }
    }
}

/// Whether the JetStream stream `name` exists.
async fn stream_exists(js: &jetstream::Context, name: &str, timeout: Duration) -> Result<bool, TransportError> {
    match timed("look up stream", timeout, js.get_stream(name)).await? {
        Ok(_) => Ok(true),
        Err(err) => match err.kind() {
            jetstream::context::GetStreamErrorKind::JetStream(js_err)
                if js_err.error_code() == ErrorCode::STREAM_NOT_FOUND =>
            {
                Ok(false)
            }
            _ => Err(failed("look up stream", err)),
        },
    }
}

/// The KV bucket, or `None` when it does not exist.
async fn open_kv(
    js: &jetstream::Context,
    bucket: &str,
    timeout: Duration,
) -> Result<Option<kv::Store>, TransportError> {
    if !stream_exists(js, &subjects::kv_backing_stream(bucket), timeout).await? {
        return Ok(None);
    }
    call("open kv bucket", timeout, js.get_key_value(bucket)).await.map(Some)
}

/// The object store, or `None` when it does not exist.
async fn open_objects(
    js: &jetstream::Context,
    bucket: &str,
    timeout: Duration,
) -> Result<Option<object_store::ObjectStore>, TransportError> {
    if !stream_exists(js, &subjects::object_backing_stream(bucket), timeout).await? {
        return Ok(None);
    }
    call("open object store", timeout, js.get_object_store(bucket)).await.map(Some)
}

// ---------------------------------------------------------------------------------------------
// Trajectory sink

/// Counters of one [`NatsTrajectorySink`].
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct SinkStats {
    /// Segments the stream has acknowledged (stored, or recognised as a duplicate of a stored
    /// retry).
    pub published: u64,
    /// Publish attempts repeated after a failure or a missing ack.
    pub publish_retries: u64,
    /// Time spent waiting for the learner's backlog to fall (pacing), a wait in progress
    /// included (read from the sink's [`super::PacingClock`]).
    pub throttled: Duration,
}

type AckFuture =
    Pin<Box<dyn Future<Output = Result<jetstream::publish::PublishAck, jetstream::context::PublishError>> + Send>>;

/// A published segment whose ack has not arrived yet; kept so it can be sent again.
struct InFlight {
    msg_id: String,
    payload: Bytes,
    ack: AckFuture,
}

/// The last reading of the learner consumer's backlog.
#[derive(Debug, Default)]
struct Pacing {
    checked_at: Option<Instant>,
    /// The consumer's `num_pending` (stored, not yet delivered); `None` when the consumer does
    /// not exist (yet) or the reading failed, which does not block. Deliveries held by the
    /// learner (`num_ack_pending`, at most about one batch) are not counted: after a learner
    /// crash they stay unacknowledged until `ack_wait`, and counting them would stall every
    /// actor for that long.
    backlog: Option<u64>,
    /// Segments this sink published since the reading.
    published_since: u64,
}

/// Actor side of the NATS transport: publishes segments to `volley.<run>.traj.<actor>`.
///
/// - A segment whose encoded size plus headers exceeds the server's `max_payload` is refused
///   with [`TransportError::Failed`] naming both sizes; nothing from that call is published.
/// - Up to [`NatsConfig::publish_window`] publish acks are in flight; `publish` returns once
///   every segment was sent and all but that many were acknowledged. [`NatsTrajectorySink::flush`]
///   (and drop, best effort) waits for the rest.
/// - A failed publish or a missing ack is retried with backoff, under the same message id so
///   the stream stores it once, until it succeeds or `stop` is set ([`TransportError::Closed`]).
///   The sink never drops a segment on its own. A retried segment may land after later ones.
/// - Pacing: before each segment it waits while the learner's backlog (undelivered plus
///   unacknowledged segments, read from the consumer at most every 50 ms while waiting and
///   every 250 ms otherwise, counting this sink's own publishes in between) is at or above
///   [`NatsConfig::max_backlog_segments`] (see [`NatsTrajectorySink::set_max_backlog_segments`]);
///   the time is counted in [`TrajectorySink::throttled`]. With no learner consumer yet it does
///   not wait (the stream keeps the segments). With many actors the bound is approximate:
///   each may overshoot by what the others published since its last reading.
pub struct NatsTrajectorySink {
    shared: Arc<Shared>,
    actor: ActorId,
    /// Shared bytes, so each publish clones a reference count rather than the string.
    subject: Subject,
    incarnation: String,
    stop: Arc<AtomicBool>,
    stream: jetstream::stream::Stream<()>,
    in_flight: VecDeque<InFlight>,
    max_backlog_segments: u64,
    pacing: Pacing,
    stats: SinkStats,
    /// Live view of the time blocked by pacing, for other threads (metrics, liveness).
    clock: Arc<super::PacingClock>,
}

impl fmt::Debug for NatsTrajectorySink {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("NatsTrajectorySink")
            .field("subject", &self.subject)
            .field("in_flight", &self.in_flight.len())
            .field("stats", &self.stats)
            .finish()
    }
}

/// Bytes the `Nats-Msg-Id` header adds to a message on the wire
/// (`NATS/1.0\r\nNats-Msg-Id: <id>\r\n\r\n`), which counts against `max_payload`.
fn msg_id_header_bytes(msg_id: &str) -> usize {
    "NATS/1.0\r\n".len() + "Nats-Msg-Id".len() + ": ".len() + msg_id.len() + "\r\n".len() + "\r\n".len()
}

impl NatsTrajectorySink {
    /// Counters so far.
    pub fn stats(&self) -> SinkStats {
        SinkStats { throttled: self.clock.total(), ..self.stats }
    }

    /// The subject this sink publishes to.
    pub fn subject(&self) -> &str {
        &self.subject
    }

    /// Override the pacing bound of this sink ([`NatsConfig::max_backlog_segments`] by
    /// default), e.g. with the value from the run spec read after connecting.
    pub fn set_max_backlog_segments(&mut self, max_backlog_segments: u64) {
        self.max_backlog_segments = max_backlog_segments;
    }

    /// Wait until every published segment is acknowledged by the stream (retrying as
    /// `publish` does).
    pub fn flush(&mut self) -> Result<(), TransportError> {
        let shared = self.shared.clone();
        shared.block_on(async {
            while !self.in_flight.is_empty() {
                self.settle_oldest().await?;
            }
            Ok(())
        })
    }

    fn stopped(&self) -> bool {
        self.stop.load(Ordering::Acquire)
    }

    async fn publish_all(&mut self, segments: Vec<TrajectorySegment>) -> Result<(), TransportError> {
        let max_payload = self.shared.client.max_payload();
        let mut encoded = Vec::with_capacity(segments.len());
        for segment in &segments {
            let msg_id =
                subjects::trajectory_msg_id(&segment.actor, &self.incarnation, segment.env_idx, segment.segment_idx);
            let payload = wire::encode_segment(segment);
            let wire_bytes = payload.len() + msg_id_header_bytes(&msg_id);
            if wire_bytes > max_payload {
                return Err(failed(
                    "publish segment",
                    format!(
                        "segment {msg_id} encodes to {wire_bytes} bytes (with headers), over the server's max_payload of \
                         {max_payload} bytes; shorten segment_len or raise max_payload"
                    ),
                ));
            }
            encoded.push((msg_id, Bytes::from(payload)));
        }
        let window = self.shared.config.publish_window.max(1);
        for (msg_id, payload) in encoded {
            if self.stopped() {
                return Err(TransportError::Closed);
            }
            self.pace().await?;
            let ack = self.send(&msg_id, payload.clone()).await?;
            self.pacing.published_since += 1;
            self.in_flight.push_back(InFlight { msg_id, payload, ack });
            while self.in_flight.len() >= window {
                self.settle_oldest().await?;
            }
        }
        Ok(())
    }

    /// Hand one message to the client, retrying until the client accepts it (the ack comes
    /// later). Only an oversize message fails for good.
    async fn send(&mut self, msg_id: &str, payload: Bytes) -> Result<AckFuture, TransportError> {
        let timeout = self.shared.config.request_timeout;
        let mut backoff = Backoff::new();
        let mut attempts = 0u32;
        loop {
            if self.stopped() {
                return Err(TransportError::Closed);
            }
            attempts += 1;
            let message = jetstream::message::PublishMessage::build().payload(payload.clone()).message_id(msg_id);
            let problem =
                match tokio::time::timeout(timeout, self.shared.js.send_publish(self.subject.clone(), message)).await {
                    Ok(Ok(ack)) => {
                        if attempts > 1 {
                            info!(actor = %self.actor, msg_id, attempts, "segment publish recovered");
                        }
                        return Ok(ack.into_future());
                    }
                    Ok(Err(err)) if err.kind() == jetstream::context::PublishErrorKind::MaxPayloadExceeded => {
                        return Err(failed("publish segment", format!("segment {msg_id} refused: {err}")));
                    }
                    Ok(Err(err)) => err.to_string(),
                    Err(_) => format!("no answer within {timeout:?}"),
                };
            self.stats.publish_retries += 1;
            self.log_retry(msg_id, attempts, &problem);
            tokio::time::sleep(backoff.next()).await;
        }
    }

    fn log_retry(&self, msg_id: &str, attempts: u32, problem: &str) {
        // First failure and every tenth after it: an outage logs about once per 10 s per actor.
        if attempts == 1 || attempts.is_multiple_of(10) {
            warn!(operation = "publish segment", actor = %self.actor, msg_id, attempts, error = problem, "segment publish failed; retrying");
        } else {
            debug!(operation = "publish segment", actor = %self.actor, msg_id, attempts, error = problem, "segment publish failed; retrying");
        }
    }

    /// Wait for the oldest ack; on failure send that segment again until it is acknowledged.
    async fn settle_oldest(&mut self) -> Result<(), TransportError> {
        let Some(InFlight { msg_id, payload, mut ack }) = self.in_flight.pop_front() else {
            return Ok(());
        };
        let mut attempts = 0u32;
        let mut backoff = Backoff::new();
        loop {
            attempts += 1;
            // The ack future has its deadline built in (the JetStream context's timeout,
            // `request_timeout`), so no second timer per segment.
            let problem = match (&mut ack).await {
                Ok(publish_ack) => {
                    if publish_ack.duplicate {
                        debug!(actor = %self.actor, msg_id, "stream already had this segment");
                    }
                    self.stats.published += 1;
                    return Ok(());
                }
                Err(err) => err.to_string(),
            };
            // A denied publish is never acknowledged; retrying it cannot help.
            let window = Instant::now().checked_sub(self.shared.config.request_timeout * 2);
            let subject = format!("\"{}\"", self.subject);
            if let Some(violation) = window.and_then(|since| self.shared.denials.since(since, &subject)) {
                return Err(denied("publish segment", &violation));
            }
            if self.stopped() {
                return Err(TransportError::Closed);
            }
            self.stats.publish_retries += 1;
            self.log_retry(&msg_id, attempts, &problem);
            tokio::time::sleep(backoff.next()).await;
            ack = self.send(&msg_id, payload.clone()).await?;
        }
    }

    /// Wait while the learner's backlog is at or above the bound (see [`Pacing`]).
    async fn pace(&mut self) -> Result<(), TransportError> {
        let limit = self.max_backlog_segments;
        let result = loop {
            if self.stopped() {
                break Err(TransportError::Closed);
            }
            let estimate = self.pacing.backlog.map(|backlog| backlog + self.pacing.published_since);
            let room = estimate.is_none_or(|estimate| estimate < limit);
            let trusted_for = if room { PACING_CACHE } else { PACING_POLL };
            match self.pacing.checked_at.map(|at| at.elapsed()) {
                Some(age) if age < trusted_for => {
                    if room {
                        break Ok(());
                    }
                    self.clock.block();
                    tokio::time::sleep(trusted_for - age).await;
                }
                _ => self.read_backlog().await,
            }
        };
        self.clock.unblock();
        result
    }

    async fn read_backlog(&mut self) {
        let reading =
            tokio::time::timeout(BACKLOG_DEADLINE, self.stream.consumer_info(subjects::LEARNER_CONSUMER)).await;
        self.pacing.backlog = match reading {
            Ok(Ok(info)) => Some(info.num_pending),
            Ok(Err(err)) if matches!(err.kind(), jetstream::context::ConsumerInfoErrorKind::NotFound) => None,
            Ok(Err(err)) => {
                debug!(operation = "read learner backlog", error = %err, "backlog unknown; not pacing");
                None
            }
            Err(_) => {
                debug!(operation = "read learner backlog", "backlog reading timed out; not pacing");
                None
            }
        };
        self.pacing.checked_at = Some(Instant::now());
        self.pacing.published_since = 0;
    }
}

impl TrajectorySink for NatsTrajectorySink {
    fn publish(&mut self, segments: Vec<TrajectorySegment>) -> Result<(), TransportError> {
        let shared = self.shared.clone();
        shared.block_on(self.publish_all(segments))
    }

    fn throttled(&self) -> Duration {
        self.clock.total()
    }

    fn publish_retries(&self) -> u64 {
        self.stats.publish_retries
    }

    fn pacing_clock(&self) -> Option<Arc<super::PacingClock>> {
        Some(self.clock.clone())
    }
}

impl Drop for NatsTrajectorySink {
    fn drop(&mut self) {
        if self.in_flight.is_empty() || Handle::try_current().is_ok() {
            return;
        }
        // Best effort: give the outstanding acks one request timeout, then let go. With `stop`
        // set, the first failed ack ends it (no retries).
        let shared = self.shared.clone();
        let deadline = shared.config.request_timeout;
        let outcome = shared.block_on(async {
            tokio::time::timeout(deadline, async {
                while !self.in_flight.is_empty() {
                    self.settle_oldest().await?;
                }
                Ok::<_, TransportError>(())
            })
            .await
        });
        if !matches!(outcome, Ok(Ok(()))) {
            warn!(actor = %self.actor, unacknowledged = self.in_flight.len(), "sink dropped with segments not acknowledged");
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Trajectory source

#[derive(Debug, Clone, Copy)]
enum SourceMode {
    /// The durable consumer `learner`, explicit acks.
    Durable,
    /// An ephemeral consumer over the whole stream, no acks, ending at `end_sequence`.
    Replay { end_sequence: u64, finished: bool },
}

/// A delivery the learner has not settled yet.
struct Held {
    message: jetstream::Message,
    /// When the server last heard about it (delivery or progress signal).
    touched: Instant,
    /// The connection it arrived on (the bus's connection count at receipt). After a
    /// reconnect the server may no longer know the delivery (a restarted broker drops pending
    /// state it had not yet written), and then it never answers a double ack for it.
    connection: u64,
}

#[derive(Debug, Default)]
struct BacklogReading {
    at: Option<Instant>,
    value: Option<u64>,
}

/// Learner side of the NATS transport: a pull consumer on the trajectory stream.
///
/// Guarantee: delivery is at least once. [`TrajectorySource::ack`] uses double acks: when it
/// returns `Ok`, the server has recorded the acks and will not deliver those segments again
/// (the consumer state is on disk, so this survives a broker restart). A segment not
/// acknowledged within [`NatsConfig::ack_wait`] of its last sign of life is delivered again
/// with a higher `delivery_count`; while the learner holds a delivery and keeps calling `recv`,
/// `recv` sends a progress signal for it every `ack_wait / 2`, so a slow batch is not
/// redelivered under the learner's feet. [`TrajectorySource::reject`] terminates a delivery
/// (`+TERM`): it is never delivered again. Bytes that do not decode come back as a
/// [`Delivery`] holding the [`wire::DecodeError`], to be counted and rejected by the learner.
pub struct NatsTrajectorySource {
    shared: Arc<Shared>,
    consumer: consumer::PullConsumer,
    mode: SourceMode,
    held: HashMap<u64, Held>,
    next_token: u64,
    backlog: Mutex<BacklogReading>,
    /// Acks given up on because the connection their delivery came on was lost.
    abandoned_acks: u64,
}

impl fmt::Debug for NatsTrajectorySource {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("NatsTrajectorySource").field("mode", &self.mode).field("held", &self.held.len()).finish()
    }
}

impl NatsTrajectorySource {
    fn new(shared: Arc<Shared>, consumer: consumer::PullConsumer, mode: SourceMode) -> Self {
        NatsTrajectorySource {
            shared,
            consumer,
            mode,
            held: HashMap::new(),
            next_token: 0,
            backlog: Mutex::new(BacklogReading::default()),
            abandoned_acks: 0,
        }
    }

    /// Deliveries received and not yet acknowledged or rejected.
    pub fn held(&self) -> usize {
        self.held.len()
    }

    /// Acks and rejects sent once without waiting for the server's confirmation, because the
    /// connection their delivery arrived on had been lost (see [`TrajectorySource::ack`]).
    pub fn abandoned_acks(&self) -> u64 {
        self.abandoned_acks
    }

    fn connection(&self) -> u64 {
        *self.shared.connections.borrow()
    }

    /// Settle deliveries from a lost connection with one plain (unconfirmed) ack or term and
    /// forget them. A broker that still knows a delivery applies it; one that restarted without
    /// it redelivers the segment later, which the learner's duplicate filter skips (issue 11:
    /// waiting for confirmations the server never sends stalled training for the whole retry
    /// deadline, ~30 s, after every broker restart).
    async fn abandon(&mut self, operation: &'static str, stale: Vec<(u64, Held)>, kind: AckKind) {
        if stale.is_empty() {
            return;
        }
        let timeout = self.shared.config.request_timeout.min(ABANDON_ACK_DEADLINE);
        let sent = futures::future::join_all(
            stale.iter().map(|(_, held)| tokio::time::timeout(timeout, held.message.ack_with(kind))),
        )
        .await;
        let unsent = sent.iter().filter(|outcome| !matches!(outcome, Ok(Ok(())))).count();
        self.abandoned_acks += stale.len() as u64;
        info!(
            operation,
            abandoned = stale.len(),
            unsent,
            "deliveries from before a reconnect settled without confirmation; the server may deliver them again"
        );
    }

    /// Tell the server that held deliveries are still being worked on, so they are not
    /// redelivered after `ack_wait` (fire-and-forget `+WPI`).
    async fn keep_held_alive(&mut self) {
        let refresh_after = self.shared.config.ack_wait / 2;
        for held in self.held.values_mut() {
            if held.touched.elapsed() >= refresh_after {
                if let Err(err) = held.message.ack_with(AckKind::Progress).await {
                    debug!(operation = "progress signal", error = %err, "progress signal not sent");
                }
                held.touched = Instant::now();
            }
        }
    }

    async fn settle(
        &mut self,
        operation: &'static str,
        tokens: &[DeliveryToken],
        kind: AckKind,
    ) -> Result<(), TransportError> {
        let mut settling: Vec<(u64, Held)> = Vec::with_capacity(tokens.len());
        for token in tokens {
            match self.held.remove(&token.0) {
                Some(held) => settling.push((token.0, held)),
                None => debug!(operation, token = token.0, "token not held (already settled or replayed); ignored"),
            }
        }
        let timeout = self.shared.config.request_timeout;
        let started = Instant::now();
        let mut backoff = Backoff::new();
        loop {
            let connection = self.connection();
            let (current, stale): (Vec<_>, Vec<_>) =
                settling.into_iter().partition(|(_, held)| held.connection >= connection);
            self.abandon(operation, stale, kind).await;
            settling = current;
            if settling.is_empty() {
                return Ok(());
            }
            let outcomes = futures::future::join_all(
                settling.iter().map(|(_, held)| tokio::time::timeout(timeout, held.message.double_ack_with(kind))),
            )
            .await;
            let mut problem = None;
            let mut still = Vec::new();
            for ((token, held), outcome) in settling.into_iter().zip(outcomes) {
                match outcome {
                    Ok(Ok(())) => {}
                    Ok(Err(err)) => {
                        problem = Some(err.to_string());
                        still.push((token, held));
                    }
                    Err(_) => {
                        problem = Some(format!("no confirmation within {timeout:?}"));
                        still.push((token, held));
                    }
                }
            }
            settling = still;
            let Some(problem) = problem else {
                return Ok(());
            };
            if started.elapsed() >= self.shared.config.retry_deadline {
                let unsettled = settling.len();
                // Keep them, so a later call may settle them; the server redelivers them otherwise.
                self.held.extend(settling);
                warn!(operation, unsettled, error = %problem, "giving up; these deliveries may be delivered again");
                return Err(TransportError::Timeout { operation, after: self.shared.config.retry_deadline });
            }
            debug!(operation, unsettled = settling.len(), error = %problem, "retrying");
            tokio::time::sleep(backoff.next()).await;
        }
    }

    fn record_backlog(&self, value: u64) {
        let mut reading = self.backlog.lock().expect("backlog lock is never poisoned");
        *reading = BacklogReading { at: Some(Instant::now()), value: Some(value) };
    }
}

/// Fetch up to `max` messages, waiting at most `wait` for the first (server-side: a no-wait
/// pull request with an expiry returns as soon as it has anything). Messages received before a
/// deadline or a mid-batch error are kept, never dropped.
async fn fetch_into(
    consumer: &consumer::PullConsumer,
    max: usize,
    wait: Duration,
    request_timeout: Duration,
    out: &mut Vec<jetstream::Message>,
) -> Result<(), TransportError> {
    const OPERATION: &str = "fetch segments";
    let mut request = consumer.fetch().max_messages(max);
    if wait >= Duration::from_millis(1) {
        request = request.expires(wait);
    }
    let deadline = wait + request_timeout;
    let collected = tokio::time::timeout(deadline, async {
        let mut batch = request.messages().await.map_err(|err| failed(OPERATION, err))?;
        while let Some(item) = batch.next().await {
            match item {
                Ok(message) => out.push(message),
                Err(err) if out.is_empty() => return Err(failed(OPERATION, err)),
                Err(err) => {
                    debug!(operation = OPERATION, error = %err, "batch ended early");
                    break;
                }
            }
        }
        Ok(())
    })
    .await;
    match collected {
        Ok(result) => result,
        Err(_) if !out.is_empty() => Ok(()),
        Err(_) => {
            warn!(operation = OPERATION, after = ?deadline, "nats operation timed out");
            Err(TransportError::Timeout { operation: OPERATION, after: deadline })
        }
    }
}

impl TrajectorySource for NatsTrajectorySource {
    fn recv(&mut self, max: usize, timeout: Duration, out: &mut Vec<Delivery>) -> Result<usize, TransportError> {
        if let SourceMode::Replay { finished: true, .. } = self.mode {
            return Err(TransportError::Closed);
        }
        if max == 0 {
            return Ok(0);
        }
        let shared = self.shared.clone();
        let connection = self.connection();
        let mut messages = Vec::with_capacity(max);
        shared.block_on(async {
            if matches!(self.mode, SourceMode::Durable) {
                self.keep_held_alive().await;
            }
            fetch_into(&self.consumer, max, timeout, shared.config.request_timeout, &mut messages).await
        })?;
        let mut n = 0;
        let mut last_pending = 0;
        let received = messages.len();
        for message in messages {
            let (delivered, pending, stream_sequence) = match message.info() {
                Ok(info) => (info.delivered.max(1) as u64, info.pending, info.stream_sequence),
                Err(err) => {
                    debug!(error = %err, "delivery without jetstream metadata");
                    (1, 0, 0)
                }
            };
            last_pending = pending;
            let segment = wire::decode_segment_body(&message.payload);
            if let Err(err) = &segment {
                debug!(reason = err.reason(), stream_sequence, "undecodable segment delivered");
            }
            self.next_token += 1;
            let token = DeliveryToken(self.next_token);
            match &mut self.mode {
                SourceMode::Durable => {
                    self.held.insert(token.0, Held { message, touched: Instant::now(), connection });
                }
                SourceMode::Replay { end_sequence, finished } => {
                    if stream_sequence > *end_sequence {
                        // Published after the replay started: past its end.
                        *finished = true;
                        break;
                    }
                    if stream_sequence == *end_sequence || pending == 0 {
                        *finished = true;
                    }
                }
            }
            out.push(Delivery { segment, token, delivery_count: delivered });
            n += 1;
            if let SourceMode::Replay { finished: true, .. } = self.mode {
                break;
            }
        }
        // Each delivery carries the consumer's pending count, so the backlog is known for free;
        // an empty fetch means nothing was pending.
        self.record_backlog(if received == 0 { 0 } else { last_pending });
        if n == 0 {
            if let SourceMode::Replay { finished: true, .. } = self.mode {
                return Err(TransportError::Closed);
            }
        }
        Ok(n)
    }

    fn ack(&mut self, tokens: &[DeliveryToken]) -> Result<(), TransportError> {
        if let SourceMode::Replay { .. } = self.mode {
            return Ok(());
        }
        let shared = self.shared.clone();
        shared.block_on(self.settle("ack", tokens, AckKind::Ack))
    }

    fn reject(&mut self, token: DeliveryToken) -> Result<(), TransportError> {
        if let SourceMode::Replay { .. } = self.mode {
            return Ok(());
        }
        let shared = self.shared.clone();
        shared.block_on(self.settle("reject", &[token], AckKind::Term))
    }

    fn backlog(&self) -> Option<u64> {
        let mut reading = self.backlog.lock().expect("backlog lock is never poisoned");
        let fresh = reading.at.is_some_and(|at| at.elapsed() < BACKLOG_CACHE);
        if fresh || Handle::try_current().is_ok() {
            return reading.value;
        }
        let reply =
            self.shared.block_on(async { tokio::time::timeout(BACKLOG_DEADLINE, self.consumer.get_info()).await });
        if let Ok(Ok(info)) = reply {
            reading.value = Some(info.num_pending);
        }
        reading.at = Some(Instant::now());
        reading.value
    }
}

// ---------------------------------------------------------------------------------------------
// Weights

/// The KV value under `weights`: where the newest weights are and what to expect of them.
/// JSON, so operators can read it; hashes as hex strings so no JSON reader rounds them.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
struct WeightsPointer {
    version: u64,
    object: String,
    checksum: String,
    layout_hash: String,
    size_bytes: u64,
}

impl WeightsPointer {
    fn new(weights: &Weights, object: String, size_bytes: usize) -> Self {
        WeightsPointer {
            version: weights.version.0,
            object,
            checksum: format!("{:016x}", weights.checksum),
            layout_hash: format!("{:016x}", weights.layout_hash),
            size_bytes: size_bytes as u64,
        }
    }
}

async fn read_pointer(kv: &kv::Store, timeout: Duration) -> Result<Option<WeightsPointer>, TransportError> {
    let Some(bytes) = call("read weights pointer", timeout, kv.get(subjects::WEIGHTS_KEY)).await? else {
        return Ok(None);
    };
    serde_json::from_slice(&bytes).map(Some).map_err(|err| failed("decode weights pointer", err))
}

/// Names of the weights objects in the store (ours only: `v` + 20 digits): the live ones, and
/// the deleted ones whose delete marker is still stored.
async fn list_weight_objects(
    objects: &object_store::ObjectStore,
    timeout: Duration,
) -> Result<(Vec<String>, Vec<String>), TransportError> {
    timed("list weights objects", timeout, async {
        let mut list = objects.list().await.map_err(|err| failed("list weights objects", err))?;
        let (mut live, mut deleted) = (Vec::new(), Vec::new());
        while let Some(info) = list.next().await {
            let info = info.map_err(|err| failed("list weights objects", err))?;
            let ours = info.name.len() == 21
                && info.name.starts_with('v')
                && info.name[1..].bytes().all(|b| b.is_ascii_digit());
            match (ours, info.deleted) {
                (true, false) => live.push(info.name),
                (true, true) => deleted.push(info.name),
                (false, _) => {}
            }
        }
        Ok((live, deleted))
    })
    .await?
}

/// Purge the delete marker of weights object `object`: `ObjectStore::delete` purges the chunks
/// but leaves one metadata message per deleted name, and every version has its own name, so
/// without this the store grows by one marker per publish (issue 11: 35k markers, 201 MB in a
/// 7-minute soak). Best effort: a marker left behind is purged by the next learner's start.
async fn purge_weights_marker(backing: &stream::Stream<()>, bucket: &str, object: &str, timeout: Duration) {
    let subject = subjects::object_meta_subject(bucket, object);
    if let Err(err) = call("purge weights marker", timeout, backing.purge().filter(subject).into_future()).await {
        debug!(object, %err, "weights delete marker not purged");
    }
}

/// Learner side: publishes each version as an object, then points KV key `weights` at it.
///
/// Versions must increase (a version not newer than this publisher's last is refused, like the
/// in-process publisher). A publish retries through a broker outage for
/// [`NatsConfig::retry_deadline`]. Objects beyond the newest
/// [`NatsConfig::keep_weight_versions`] are deleted. If the run already had a newer version
/// (a learner restarted from an older checkpoint), followers ignore the new versions until
/// they pass it; this is logged.
pub struct NatsWeightsPublisher {
    shared: Arc<Shared>,
    kv: kv::Store,
    objects: object_store::ObjectStore,
    /// The stream behind `objects`, for purging delete markers.
    backing: stream::Stream<()>,
    /// Newest version in KV when this publisher started.
    published_before: Option<u64>,
    last_version: Option<u64>,
    /// Our objects, oldest first.
    kept: VecDeque<String>,
}

impl fmt::Debug for NatsWeightsPublisher {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("NatsWeightsPublisher")
            .field("last_version", &self.last_version)
            .field("kept", &self.kept)
            .finish()
    }
}

impl NatsWeightsPublisher {
    /// The newest version this run had published when the publisher opened (read from the KV
    /// pointer, no waiting): a restarted learner continues above it.
    pub fn published_before(&self) -> Option<PolicyVersion> {
        self.published_before.map(PolicyVersion)
    }
}

impl WeightsPublisher for NatsWeightsPublisher {
    fn publish(&mut self, weights: Arc<Weights>) -> Result<(), TransportError> {
        let version = weights.version.0;
        if let Some(last) = self.last_version {
            if version <= last {
                return Err(failed("weights publish", format!("version {version} is not newer than v{last}")));
            }
        }
        if self.last_version.is_none() {
            if let Some(before) = self.published_before.filter(|&before| before >= version) {
                warn!(
                    version,
                    newest_in_run = before,
                    "the run's pointer claims a newer version; followers that verified it ignore versions up to it"
                );
            }
        }
        let shared = self.shared.clone();
        let config = &shared.config;
        let bytes = wire::encode_weights(&weights);
        let object = subjects::weights_object(version);
        let pointer = WeightsPointer::new(&weights, object.clone(), bytes.len());
        let pointer_json =
            Bytes::from(serde_json::to_vec(&pointer).map_err(|err| failed("encode weights pointer", err))?);
        let transfer = config.transfer_deadline(bytes.len());
        let (objects, kv) = (&self.objects, &self.kv);
        shared.block_on(async {
            retry_for("put weights object", config.retry_deadline, || {
                let mut reader = bytes.as_slice();
                let object = object.as_str();
                async move { call("put weights object", transfer, objects.put(object, &mut reader)).await.map(|_| ()) }
            })
            .await?;
            retry_for("put weights pointer", config.retry_deadline, || {
                call("put weights pointer", config.request_timeout, kv.put(subjects::WEIGHTS_KEY, pointer_json.clone()))
            })
            .await?;
            Ok::<_, TransportError>(())
        })?;
        debug!(version, size_bytes = bytes.len(), "weights published");
        self.last_version = Some(version);
        if self.kept.back() != Some(&object) {
            self.kept.push_back(object);
        }
        let keep = config.keep_weight_versions.max(1);
        while self.kept.len() > keep {
            let Some(old) = self.kept.pop_front() else { break };
            // Best effort: a failed delete leaves an object behind, nothing worse.
            let bucket = subjects::weights_bucket(&config.run);
            shared.block_on(async {
                if call("delete old weights", config.request_timeout, self.objects.delete(&old)).await.is_ok() {
                    purge_weights_marker(&self.backing, &bucket, &old, config.request_timeout).await;
                }
            });
        }
        Ok(())
    }
}

/// The pointer most recently written to KV, as the watch delivered it.
///
/// Not the highest version ever announced: a forged pointer with a huge version must not
/// hide the real pointers written after it (issue 12, docs/SECURITY.md). Whether a pointer
/// is worth fetching is the follower's decision, against the newest version it verified.
#[derive(Debug, Default)]
struct PointerSlot {
    /// The pointer and its write number (1 = the first the watch delivered).
    pointer: Mutex<Option<(WeightsPointer, u64)>>,
    /// Writes seen (0 = none yet): lets `latest` answer "nothing new" with one load.
    writes: AtomicU64,
    changed: tokio::sync::Notify,
}

impl PointerSlot {
    fn offer(&self, pointer: WeightsPointer) {
        let mut slot = self.pointer.lock().expect("pointer lock is never poisoned");
        // A re-created watch delivers the current value again: not a new write.
        if slot.as_ref().is_some_and(|(current, _)| *current == pointer) {
            return;
        }
        debug!(version = pointer.version, "new weights pointer");
        let write = self.writes.load(Ordering::Acquire).saturating_add(1);
        *slot = Some((pointer, write));
        self.writes.store(write, Ordering::Release);
        self.changed.notify_waiters();
    }

    fn newest(&self) -> Option<(WeightsPointer, u64)> {
        self.pointer.lock().expect("pointer lock is never poisoned").clone()
    }
}

/// First pause before fetching an unfetchable pointer (missing object, timeout) again.
const FETCH_RETRY_FIRST: Duration = Duration::from_millis(250);
/// Longest pause between fetches of an unfetchable pointer.
const FETCH_RETRY_MAX: Duration = Duration::from_secs(30);

/// Keep `slot` at the newest `weights` pointer: open the bucket (waiting until it exists),
/// watch the key (the watch yields the current value first), and start over after an error,
/// the end of the watch, or a reconnect.
async fn follow_pointer(
    js: jetstream::Context,
    bucket: String,
    timeout: Duration,
    slot: Arc<PointerSlot>,
    mut connections: tokio::sync::watch::Receiver<u64>,
) {
    let mut backoff = Backoff::new();
    loop {
        connections.borrow_and_update();
        let watch = async {
            let kv = match open_kv(&js, &bucket, timeout).await? {
                Some(kv) => kv,
                None => {
                    return Err(TransportError::Failed {
                        operation: "watch weights",
                        message: format!("bucket {bucket} does not exist yet"),
                    })
                }
            };
            call("watch weights", timeout, kv.watch_with_history(subjects::WEIGHTS_KEY)).await
        };
        let mut watch = match watch.await {
            Ok(watch) => watch,
            Err(err) => {
                debug!(operation = "watch weights", %err, "retrying");
                tokio::select! {
                    _ = tokio::time::sleep(backoff.next()) => {}
                    changed = connections.changed() => {
                        if changed.is_err() {
                            return;
                        }
                    }
                }
                continue;
            }
        };
        backoff = Backoff::new();
        loop {
            tokio::select! {
                entry = watch.next() => match entry {
                    Some(Ok(entry)) if entry.operation == kv::Operation::Put => {
                        match serde_json::from_slice::<WeightsPointer>(&entry.value) {
                            Ok(pointer) => slot.offer(pointer),
                            Err(err) => warn!(operation = "decode weights pointer", error = %err, "ignoring bad weights pointer"),
                        }
                    }
                    Some(Ok(_)) => {}
                    Some(Err(err)) => {
                        warn!(operation = "watch weights", error = %err, "weights watch failed; re-creating it");
                        break;
                    }
                    None => {
                        warn!(operation = "watch weights", "weights watch ended; re-creating it");
                        break;
                    }
                },
                changed = connections.changed() => {
                    if changed.is_err() {
                        return;
                    }
                    info!("reconnected; re-creating the weights watch");
                    break;
                }
            }
        }
        tokio::time::sleep(backoff.next()).await;
    }
}

/// Actor side: follows the newest weights.
///
/// A background task watches the `weights` pointer (re-creating the watch after errors and
/// reconnects; a late joiner gets the current pointer at once). [`WeightsFollower::latest`]
/// costs one atomic load when nothing was written; otherwise it looks at the pointer written
/// last and, when its version is above the newest version this follower has *verified*,
/// fetches the object with a deadline and verifies layout, size, checksum and version.
///
/// Trust (docs/SECURITY.md): the pointer is a claim, the verified object the fact. Refused
/// weights are a [`TransportError::Failed`] naming the reason, reported once per pointer
/// write and counted ([`refusals`](Self::refusals)); the follower keeps its verified version,
/// and the next pointer written is judged afresh, whatever version the refused one claimed,
/// so a forged pointer never blocks a later valid one. A failed download (timeout, missing
/// object) is retried with exponential backoff (250 ms doubling to 30 s), each failure
/// reported once, so a missing object costs a few requests and warnings a minute.
pub struct NatsWeightsFollower {
    shared: Arc<Shared>,
    layout_hash: u64,
    n_params: usize,
    slot: Arc<PointerSlot>,
    objects: Option<object_store::ObjectStore>,
    /// The newest weights verified so far.
    newest: Option<Arc<Weights>>,
    /// The last pointer write dealt with for good (adopted, refused, or not newer).
    settled_write: u64,
    /// A pointer write whose fetch failed, and when to try it again.
    retry: Option<(u64, Instant, Duration)>,
    /// Pointers refused or not fetchable, in total.
    refusals: u64,
    task: tokio::task::JoinHandle<()>,
}

impl fmt::Debug for NatsWeightsFollower {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("NatsWeightsFollower")
            .field("layout_hash", &format_args!("{:016x}", self.layout_hash))
            .field("n_params", &self.n_params)
            .field("pointer_version", &self.announced_version())
            .field("verified_version", &self.newest.as_ref().map(|w| w.version))
            .field("refusals", &self.refusals)
            .finish()
    }
}

impl Drop for NatsWeightsFollower {
    fn drop(&mut self) {
        self.task.abort();
    }
}

impl NatsWeightsFollower {
    /// The version the pointer written last claims (fetched or not, verified or not).
    pub fn announced_version(&self) -> Option<PolicyVersion> {
        self.slot.newest().map(|(pointer, _)| PolicyVersion(pointer.version))
    }

    /// The newest version this follower fetched and verified.
    pub fn verified_version(&self) -> Option<PolicyVersion> {
        self.newest.as_ref().map(|w| w.version)
    }

    /// Pointers refused for their content or not fetchable, in total (each failure once).
    pub fn refusals(&self) -> u64 {
        self.refusals
    }

    /// The pause before the pointer written last is fetched again, when its fetch failed.
    pub fn retry_pause(&self) -> Option<Duration> {
        self.retry.map(|(_, _, pause)| pause)
    }

    /// Refuse `pointer` for its content (see the type's docs).
    #[cold]
    fn refuse(&mut self, pointer: &WeightsPointer, reason: String) -> TransportError {
        warn!(version = pointer.version, object = %pointer.object, %reason, "weights pointer refused");
        failed("weights fetch", reason)
    }

    fn fetch(&mut self, pointer: &WeightsPointer) -> Result<Arc<Weights>, FetchError> {
        const OPERATION: &str = "weights fetch";
        let expected_layout = format!("{:016x}", self.layout_hash);
        if pointer.layout_hash != expected_layout {
            return Err(FetchError::Refused(self.refuse(
                pointer,
                format!(
                    "weights {} refused: layout hash {} does not match this actor's {expected_layout}",
                    pointer.object, pointer.layout_hash
                ),
            )));
        }
        // The pointer's size is a claim: never reserve more than a message may hold.
        if pointer.size_bytes as usize > wire::MAX_MESSAGE_BYTES {
            return Err(FetchError::Refused(self.refuse(
                pointer,
                format!(
                    "weights {} refused: claimed size {} bytes exceeds the limit",
                    pointer.object, pointer.size_bytes
                ),
            )));
        }
        let shared = self.shared.clone();
        let config = &shared.config;
        let bucket = subjects::weights_bucket(&config.run);
        let deadline = config.transfer_deadline(pointer.size_bytes as usize);
        let objects = &mut self.objects;
        let bytes = shared.block_on(async {
            if objects.is_none() {
                *objects = open_objects(&shared.js, &bucket, config.request_timeout).await?;
            }
            let Some(store) = objects.as_ref() else {
                return Err(failed(OPERATION, format!("object store {bucket} does not exist")));
            };
            call(OPERATION, deadline, async {
                let object = store.get(&pointer.object).await?;
                let mut bytes = Vec::with_capacity(pointer.size_bytes as usize);
                // Read at most one byte past the limit: an oversized object is refused below.
                object.take(wire::MAX_MESSAGE_BYTES as u64 + 1).read_to_end(&mut bytes).await?;
                Ok::<_, Box<dyn std::error::Error + Send + Sync>>(bytes)
            })
            .await
        });
        let bytes = match bytes {
            Ok(bytes) => bytes,
            Err(err) => {
                warn!(version = pointer.version, object = %pointer.object, %err, "weights object not fetchable; retrying with backoff");
                return Err(FetchError::Unavailable(err));
            }
        };
        let weights = match wire::decode_weights(&bytes, self.layout_hash, self.n_params) {
            Ok(weights) => weights,
            Err(err) => {
                let reason = format!("weights {} refused ({}): {err}", pointer.object, err.reason());
                return Err(FetchError::Refused(self.refuse(pointer, reason)));
            }
        };
        let checksum = format!("{:016x}", weights.checksum);
        if weights.version.0 != pointer.version || checksum != pointer.checksum {
            return Err(FetchError::Refused(self.refuse(
                pointer,
                format!(
                    "weights {} refused: object holds {} with checksum {checksum}, pointer says v{} with checksum {}",
                    pointer.object, weights.version, pointer.version, pointer.checksum
                ),
            )));
        }
        let weights = Arc::new(weights);
        self.newest = Some(weights.clone());
        Ok(weights)
    }
}

impl WeightsFollower for NatsWeightsFollower {
    fn latest(&mut self, have: Option<PolicyVersion>) -> Result<Option<Arc<Weights>>, TransportError> {
        let writes = self.slot.writes.load(Ordering::Acquire);
        if writes == self.settled_write {
            return Ok(self.newest.clone().filter(|newest| have.is_none_or(|have| newest.version > have)));
        }
        let Some((pointer, write)) = self.slot.newest() else {
            return Ok(None);
        };
        // Only a version above everything verified (and above what the caller runs) is worth
        // fetching; an older or equal claim is settled at once (versions never go back).
        let current = self.newest.as_ref().map(|w| w.version).max(have);
        if current.is_some_and(|current| pointer.version <= current.0) {
            self.settled_write = write;
            self.retry = None;
            return Ok(self.newest.clone().filter(|newest| have.is_none_or(|have| newest.version > have)));
        }
        if let Some((retry_write, at, _)) = self.retry {
            if retry_write == write && Instant::now() < at {
                return Ok(None);
            }
        }
        match self.fetch(&pointer) {
            Ok(weights) => {
                self.settled_write = write;
                self.retry = None;
                Ok(Some(weights))
            }
            Err(FetchError::Refused(err)) => {
                self.settled_write = write;
                self.retry = None;
                self.refusals += 1;
                Err(err)
            }
            Err(FetchError::Unavailable(err)) => {
                let pause = match self.retry {
                    Some((retry_write, _, pause)) if retry_write == write => (pause * 2).min(FETCH_RETRY_MAX),
                    _ => FETCH_RETRY_FIRST,
                };
                self.retry = Some((write, Instant::now() + pause, pause));
                self.refusals += 1;
                Err(err)
            }
        }
    }

    fn wait_first(&mut self, timeout: Duration) -> Result<Arc<Weights>, TransportError> {
        let slot = self.slot.clone();
        let started = Instant::now();
        loop {
            if let Some(weights) = self.latest(None)? {
                return Ok(weights);
            }
            let left = timeout.saturating_sub(started.elapsed());
            if left.is_zero() {
                return Err(TransportError::Timeout { operation: "first weights", after: timeout });
            }
            // Wait for a new pointer write, or until a failed fetch may be retried.
            let settled = self.settled_write;
            let wake = self.retry.map_or(left, |(_, at, _)| at.saturating_duration_since(Instant::now()).min(left));
            self.shared.block_on(async {
                let written = async {
                    loop {
                        let notified = slot.changed.notified();
                        if slot.writes.load(Ordering::Acquire) != settled {
                            return;
                        }
                        notified.await;
                    }
                };
                let _ = tokio::time::timeout(wake, written).await;
            });
        }
    }
}

/// Why a fetch gave no weights: the content is wrong (final for this pointer write), or the
/// object could not be read (tried again later).
enum FetchError {
    Refused(TransportError),
    Unavailable(TransportError),
}

// ---------------------------------------------------------------------------------------------
// Save-load and budget assignment: the work queue and the snapshot store

/// Create (or update) the work-queue stream, the actors' shared consumer, the snapshot object
/// store and its per-item index, bounded by the run's snapshot retention.
async fn ensure_work_objects(
    shared: &Shared,
    work: &crate::work::WorkConfig,
    stores: &crate::spec::StoreLimits,
) -> Result<(), TransportError> {
    let config = &shared.config;
    let timeout = config.request_timeout;
    let ttl = Duration::from_secs_f64(work.snapshot_ttl_secs);
    let stream_name = subjects::work_stream(&config.run);
    let stream_config = stream::Config {
        name: stream_name.clone(),
        description: Some(format!("volley run {} work items", config.run)),
        subjects: vec![subjects::work(&config.run)],
        retention: stream::RetentionPolicy::WorkQueue,
        storage: stream::StorageType::File,
        max_messages: stores.work_max_messages as i64,
        max_bytes: stores.work_max_bytes as i64,
        max_age: Duration::from_secs_f64(stores.work_max_age_secs),
        duplicate_window: config.duplicate_window,
        num_replicas: config.replicas,
        ..Default::default()
    };
    call("create work stream", timeout, shared.js.create_or_update_stream(stream_config)).await?;
    let stream = call("open work stream", timeout, shared.js.get_stream_no_info(&stream_name)).await?;
    let consumer_config = consumer::pull::Config {
        durable_name: Some(subjects::WORK_CONSUMER.to_string()),
        description: Some(format!("volley run {} actors' work", config.run)),
        ack_policy: consumer::AckPolicy::Explicit,
        ack_wait: Duration::from_secs_f64(work.ack_wait_secs),
        max_deliver: -1,
        ..Default::default()
    };
    call("create work consumer", timeout, stream.create_consumer(consumer_config)).await?;
    let snapshots = subjects::snapshot_bucket(&config.run);
    if open_objects(&shared.js, &snapshots, timeout).await?.is_none() {
        let objects_config = object_store::Config {
            bucket: snapshots.clone(),
            description: Some(format!("volley run {}: episode snapshots", config.run)),
            storage: stream::StorageType::File,
            max_age: ttl,
            max_bytes: stores.snapshot_max_bytes as i64,
            num_replicas: config.replicas,
            ..Default::default()
        };
        if let Err(err) = call("create snapshot store", timeout, shared.js.create_object_store(objects_config)).await {
            open_objects(&shared.js, &snapshots, timeout).await?.ok_or(err)?;
        }
    }
    let index = subjects::snapshot_index_bucket(&config.run);
    if open_kv(&shared.js, &index, timeout).await?.is_none() {
        let kv_config = kv::Config {
            bucket: index.clone(),
            description: format!("volley run {}: newest snapshot per work item", config.run),
            history: 1,
            max_age: ttl,
            max_bytes: stores.snapshot_index_max_bytes as i64,
            storage: stream::StorageType::File,
            num_replicas: config.replicas,
            ..Default::default()
        };
        if let Err(err) = call("create snapshot index", timeout, shared.js.create_key_value(kv_config)).await {
            open_kv(&shared.js, &index, timeout).await?.ok_or(err)?;
        }
    }
    Ok(())
}

impl NatsBus {
    /// Learner side: where the scheduler queues work items (the run must exist with
    /// `work.enabled`; see [`NatsBus::ensure_run`]).
    pub fn work_queue(&self) -> Result<NatsWorkQueue, TransportError> {
        let shared = self.shared.clone();
        let timeout = shared.config.request_timeout;
        let stream = shared.block_on(call(
            "open work stream",
            timeout,
            shared.js.get_stream_no_info(subjects::work_stream(&shared.config.run)),
        ))?;
        Ok(NatsWorkQueue { shared, stream })
    }

    /// Actor side: take work items from the run's shared work consumer.
    pub fn work_source(&self) -> Result<NatsWorkSource, TransportError> {
        let shared = self.shared.clone();
        let timeout = shared.config.request_timeout;
        let consumer = shared.block_on(async {
            let stream = call(
                "open work stream",
                timeout,
                shared.js.get_stream_no_info(subjects::work_stream(&shared.config.run)),
            )
            .await?;
            call("open work consumer", timeout, stream.get_consumer::<consumer::pull::Config>(subjects::WORK_CONSUMER))
                .await
        })?;
        Ok(NatsWorkSource { shared, consumer, held: HashMap::new(), next_token: 0, undecodable: 0 })
    }

    /// Actor side: the run's snapshot store (object store plus per-item index).
    pub fn snapshot_store(&self) -> Result<NatsSnapshotStore, TransportError> {
        let shared = self.shared.clone();
        let timeout = shared.config.request_timeout;
        let (objects, index) = shared.block_on(async {
            let objects_bucket = subjects::snapshot_bucket(&shared.config.run);
            let index_bucket = subjects::snapshot_index_bucket(&shared.config.run);
            let objects = open_objects(&shared.js, &objects_bucket, timeout).await?.ok_or_else(|| {
                failed("open snapshot store", format!("object store {objects_bucket} does not exist"))
            })?;
            let index = open_kv(&shared.js, &index_bucket, timeout)
                .await?
                .ok_or_else(|| failed("open snapshot index", format!("kv bucket {index_bucket} does not exist")))?;
            Ok::<_, TransportError>((objects, index))
        })?;
        Ok(NatsSnapshotStore { shared, objects, index })
    }
}

/// The learner's end of the work queue: publishes work items (JSON) with their id as
/// `Nats-Msg-Id`, so a retried publish is stored once.
pub struct NatsWorkQueue {
    shared: Arc<Shared>,
    stream: stream::Stream<()>,
}

impl fmt::Debug for NatsWorkQueue {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("NatsWorkQueue").field("run", &self.shared.config.run).finish()
    }
}

impl super::work::WorkQueue for NatsWorkQueue {
    fn submit(&mut self, items: &[crate::work::WorkItem]) -> Result<(), TransportError> {
        let shared = &self.shared;
        let subject = subjects::work(&shared.config.run);
        let timeout = shared.config.request_timeout;
        shared.block_on(async {
            for item in items {
                let payload = Bytes::from(item.to_json());
                let msg_id = format!("item-{}", item.id);
                retry_for("publish work item", shared.config.retry_deadline, || {
                    let mut headers = async_nats::HeaderMap::new();
                    headers.insert("Nats-Msg-Id", msg_id.as_str());
                    let (subject, payload) = (subject.clone(), payload.clone());
                    async move {
                        let ack = call(
                            "publish work item",
                            timeout,
                            shared.js.publish_with_headers(subject, headers, payload),
                        )
                        .await?;
                        call("confirm work item", timeout, ack.into_future()).await.map(|_| ())
                    }
                })
                .await?;
            }
            Ok(())
        })
    }

    fn queued(&mut self) -> Result<u64, TransportError> {
        let shared = self.shared.clone();
        let timeout = shared.config.request_timeout;
        shared.block_on(async {
            let info = call("read work queue", timeout, self.stream.consumer_info(subjects::WORK_CONSUMER)).await?;
            Ok(info.num_pending)
        })
    }
}

/// An actor's end of the work queue: one item at a time per environment slot, kept alive with
/// progress signals while it runs, double-acked when done. An item whose actor dies is
/// redelivered by the server after the consumer's `ack_wait`.
pub struct NatsWorkSource {
    shared: Arc<Shared>,
    consumer: consumer::PullConsumer,
    held: HashMap<u64, jetstream::Message>,
    next_token: u64,
    undecodable: u64,
}

impl fmt::Debug for NatsWorkSource {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("NatsWorkSource").field("held", &self.held.len()).finish()
    }
}

impl NatsWorkSource {
    /// Work messages that did not decode (terminated so they are not redelivered).
    pub fn undecodable(&self) -> u64 {
        self.undecodable
    }
}

impl super::work::WorkSource for NatsWorkSource {
    fn take(
        &mut self,
        timeout: Duration,
    ) -> Result<Option<(crate::work::WorkItem, super::work::WorkToken)>, TransportError> {
        let shared = self.shared.clone();
        let request_timeout = shared.config.request_timeout;
        loop {
            let mut messages = Vec::with_capacity(1);
            shared.block_on(fetch_into(&self.consumer, 1, timeout, request_timeout, &mut messages))?;
            let Some(message) = messages.pop() else { return Ok(None) };
            match crate::work::WorkItem::from_json(&message.payload) {
                Ok(item) => {
                    let token = self.next_token;
                    self.next_token += 1;
                    self.held.insert(token, message);
                    return Ok(Some((item, super::work::WorkToken(token))));
                }
                Err(err) => {
                    self.undecodable += 1;
                    warn!(error = %err, "work item dropped");
                    if let Err(err) = shared.block_on(message.ack_with(AckKind::Term)) {
                        debug!(error = %err, "could not terminate an undecodable work item");
                    }
                }
            }
        }
    }

    fn progress(&mut self, token: super::work::WorkToken) -> Result<(), TransportError> {
        let Some(message) = self.held.get(&token.0) else { return Ok(()) };
        self.shared.block_on(message.ack_with(AckKind::Progress)).map_err(|err| failed("work progress", err))
    }

    fn complete(&mut self, token: super::work::WorkToken) -> Result<(), TransportError> {
        let Some(message) = self.held.remove(&token.0) else { return Ok(()) };
        let shared = self.shared.clone();
        let timeout = shared.config.request_timeout;
        shared.block_on(retry_for("complete work item", shared.config.retry_deadline, || {
            call("complete work item", timeout, message.double_ack())
        }))
    }
}

/// Episode snapshots in the run's object store, with a KV index of each work item's newest
/// snapshot; both expire after the run's `snapshot_ttl_secs`.
pub struct NatsSnapshotStore {
    shared: Arc<Shared>,
    objects: object_store::ObjectStore,
    index: kv::Store,
}

impl fmt::Debug for NatsSnapshotStore {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("NatsSnapshotStore").field("run", &self.shared.config.run).finish()
    }
}

impl super::work::SnapshotStore for NatsSnapshotStore {
    fn save(&mut self, snapshot: &crate::work::EpisodeSnapshot) -> Result<String, TransportError> {
        let key = snapshot.key();
        let bytes = snapshot.encode();
        let shared = &self.shared;
        let config = &shared.config;
        let transfer = config.transfer_deadline(bytes.len());
        let (objects, index) = (&self.objects, &self.index);
        let index_key = subjects::snapshot_index_key(snapshot.work_item);
        shared.block_on(async {
            retry_for("put snapshot", config.retry_deadline, || {
                let mut reader = bytes.as_slice();
                let name = key.as_str();
                async move { call("put snapshot", transfer, objects.put(name, &mut reader)).await.map(|_| ()) }
            })
            .await?;
            retry_for("index snapshot", config.retry_deadline, || {
                call("index snapshot", config.request_timeout, index.put(&index_key, Bytes::from(key.clone())))
            })
            .await
        })?;
        Ok(key)
    }

    fn latest_for_item(&mut self, work_item: u64) -> Result<Option<String>, TransportError> {
        let shared = &self.shared;
        let timeout = shared.config.request_timeout;
        let value = shared.block_on(call(
            "read snapshot index",
            timeout,
            self.index.get(subjects::snapshot_index_key(work_item)),
        ))?;
        Ok(value.map(|bytes| String::from_utf8_lossy(&bytes).into_owned()))
    }

    fn load(&mut self, key: &str) -> Result<Option<crate::work::EpisodeSnapshot>, TransportError> {
        let shared = &self.shared;
        let deadline = shared.config.transfer_deadline(crate::work::MAX_EPISODE_SNAPSHOT_BYTES);
        let objects = &self.objects;
        let bytes = shared.block_on(async {
            match timed("get snapshot", deadline, objects.get(key)).await? {
                Ok(mut object) => {
                    let mut bytes = Vec::new();
                    object.read_to_end(&mut bytes).await.map_err(|err| failed("read snapshot", err))?;
                    Ok(Some(bytes))
                }
                Err(err) if matches!(err.kind(), object_store::GetErrorKind::NotFound) => Ok(None),
                Err(err) => Err(failed("get snapshot", err)),
            }
        })?;
        bytes
            .map(|bytes| {
                crate::work::EpisodeSnapshot::decode(&bytes)
                    .map_err(|err| TransportError::Failed { operation: "decode snapshot", message: err.to_string() })
            })
            .transpose()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn header_size_matches_the_nats_framing() {
        let id = "actor-1-ab-0-7";
        let header = format!("NATS/1.0\r\nNats-Msg-Id: {id}\r\n\r\n");
        assert_eq!(msg_id_header_bytes(id), header.len());
    }

    #[test]
    fn backoff_doubles_up_to_the_cap() {
        let mut backoff = Backoff::new();
        let pauses: Vec<Duration> = (0..8).map(|_| backoff.next()).collect();
        assert_eq!(pauses[0], BACKOFF_FIRST);
        assert_eq!(pauses[1], BACKOFF_FIRST * 2);
        assert!(pauses.windows(2).all(|w| w[1] >= w[0]));
        assert_eq!(*pauses.last().expect("eight pauses"), BACKOFF_MAX);
    }

    #[test]
    fn reconnect_delay_starts_at_zero_and_is_capped() {
        assert_eq!(reconnect_delay(0), Duration::ZERO);
        assert_eq!(reconnect_delay(1), Duration::ZERO);
        assert_eq!(reconnect_delay(2), Duration::from_millis(2));
        assert_eq!(reconnect_delay(100), Duration::from_secs(2));
    }

    #[test]
    fn pointer_slot_keeps_the_last_write_whatever_its_version() {
        let slot = PointerSlot::default();
        let pointer = |version| WeightsPointer {
            version,
            object: subjects::weights_object(version),
            checksum: "0".into(),
            layout_hash: "0".into(),
            size_bytes: 0,
        };
        slot.offer(pointer(3));
        // Issue 12: a forged pointer with a huge version must not hide later real ones.
        slot.offer(pointer(u64::MAX));
        slot.offer(pointer(2));
        assert_eq!(slot.newest().map(|(p, write)| (p.version, write)), Some((2, 3)));
        slot.offer(pointer(2));
        assert_eq!(slot.writes.load(Ordering::Acquire), 3, "a re-delivered value is not a new write");
        slot.offer(pointer(4));
        assert_eq!(slot.newest().map(|(p, _)| p.version), Some(4));
    }

    #[test]
    fn weights_pointer_is_readable_json() {
        let weights = Weights::new(PolicyVersion(7), 0xdead_beef, vec![1.0, 2.0]);
        let pointer = WeightsPointer::new(&weights, subjects::weights_object(7), 123);
        let json = serde_json::to_string(&pointer).expect("serializable");
        assert!(json.contains("\"version\":7"), "{json}");
        assert!(json.contains("\"layout_hash\":\"00000000deadbeef\""), "{json}");
        assert_eq!(serde_json::from_str::<WeightsPointer>(&json).expect("roundtrip"), pointer);
    }
}
