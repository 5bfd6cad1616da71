//! The NATS JetStream transport: the four transport traits over a real broker.
//!
//! Layout of one run (all names from [`volley_core::subjects`]):
//! - Actors publish encoded segments to `volley.<run>.traj.<actor>`, the segments of one call
//!   packed into batch frames ([`volley_core::wire::batch`]), each message with a
//!   `Nats-Msg-Id`, so a retried publish is stored once (server-side dedup inside the
//!   stream's duplicate window).
//! - The stream `volley-<run>-traj` (file storage, limits retention) keeps segments after
//!   they were consumed, bounded by bytes and age, so a run can be replayed.
//! - The learner reads through the durable pull consumer `learner` with explicit acks.
//! - The KV bucket `volley-<run>` holds the run spec (key `spec`), a pointer to the newest
//!   weights (key `weights`) and, once the run is over, its end (key `ended`, [`crate::run_end`]); the object store `volley-<run>-wts` holds the weights buffers
//!   (chunked, so any size works with the default 1 MiB `max_payload`).
//!
//! The traits are blocking, because actors and the learner are CPU threads. [`NatsBus`] owns a
//! small tokio runtime (or borrows one through [`NatsBus::connect_with_handle`]) and every
//! blocking method runs its async work through [`NatsBus::block_on`]: on its own runtime, by
//! default one without worker threads, the calling thread runs the connection while it waits
//! ([`NatsConfig::runtime_workers`]). Never call them from inside a tokio worker thread (tokio
//! panics); call them from plain threads or `spawn_blocking`.
//!
//! Every network call has a deadline, so a stalled broker surfaces as
//! [`TransportError::Timeout`] within seconds, and every failure is logged with its operation.
//! async-nats reconnects by itself; the components here retry across a broker restart:
//! the sink until its segment is stored (or `stop`), ack/reject/weights publish for
//! [`NatsConfig::retry_deadline`], the learner's fetch on its next `recv`, and the weights
//! follower reads the weights pointer again after every reconnect.
//!
//! This module holds the connection ([`NatsBus`], its config, auth, retries and the helpers
//! every component uses); the run's broker objects (creating them, the spec and the end marker,
//! opening a bucket) are in `run`, and each component lives in its own file with the `NatsBus`
//! method that makes it: [`sink`] (actors' segments, paced by the learner's backlog in
//! `pacing`), [`source`] (the learner's consumer and replay), [`weights`] (publisher and
//! follower) and [`work`] (work queue and snapshot store).

use std::collections::VecDeque;
use std::fmt;
use std::future::Future;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use async_nats::jetstream;
use async_nats::{ConnectErrorKind, ConnectOptions, Event, ServerError};
use tokio::runtime::Handle;
use tracing::{debug, info, warn};

use super::TransportError;
use volley_core::ids::RunId;

mod dispatch;
mod gets;
pub mod identity;
mod pacing;
mod run;
pub mod sink;
pub mod source;
pub mod tls;
pub mod weights;
pub mod work;

pub use run::CONSUMER_MAX_ACK_PENDING;
pub use sink::{NatsTrajectorySink, SinkStats};
pub use source::NatsTrajectorySource;
pub use tls::{NatsTls, TlsFileError};
pub use weights::{NatsWeightsFollower, NatsWeightsPublisher};
pub use work::{NatsSnapshotStore, NatsWorkQueue, NatsWorkSource};

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
    /// An NKey identity (issue 46 item 3): one actor's own user, whose public key the server
    /// config names ([`identity`]). The name is the identity's (the actor id), used for the
    /// inbox prefix and in logs; the server knows the user by its key alone.
    Nkey {
        /// The identity's name.
        name: String,
        /// The NKey user seed (`SU…`).
        seed: String,
    },
}

impl fmt::Debug for NatsAuth {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            NatsAuth::UserPassword { user, .. } => {
                f.debug_struct("UserPassword").field("user", user).field("password", &"<redacted>").finish()
            }
            NatsAuth::Token(_) => f.write_str("Token(<redacted>)"),
            NatsAuth::Nkey { name, .. } => {
                f.debug_struct("Nkey").field("name", name).field("seed", &"<redacted>").finish()
            }
        }
    }
}

impl NatsAuth {
    /// Who connects, for logs and errors (never the secret).
    fn describe(&self) -> String {
        match self {
            NatsAuth::UserPassword { user, .. } => format!("user {user}"),
            NatsAuth::Token(_) => "a token".to_string(),
            NatsAuth::Nkey { name, .. } => format!("nkey identity {name}"),
        }
    }

    /// The inbox prefix of this identity's connections: `_INBOX_<user>` for a user whose name
    /// is one subject token, else NATS's shared `_INBOX`.
    ///
    /// Replies, API answers and consumer deliveries travel on inbox subjects. With one prefix
    /// for everyone, a user allowed to subscribe to `_INBOX.>` read the other roles' replies
    /// (issue 46: an actor sniffed 17,406 of them in 3 s, weights included); with a prefix per
    /// user, `broker-config/accounts.conf` grants each user its own inboxes only (the NATS
    /// "private inbox" pattern).
    pub fn inbox_prefix(&self) -> String {
        match self {
            NatsAuth::UserPassword { user, .. } if is_subject_token(user) => format!("{PRIVATE_INBOX_PREFIX}{user}"),
            NatsAuth::Nkey { name, .. } if is_subject_token(name) => format!("{PRIVATE_INBOX_PREFIX}{name}"),
            _ => "_INBOX".to_string(),
        }
    }
}

/// Start of a user's private inbox prefix ([`NatsAuth::inbox_prefix`]).
pub const PRIVATE_INBOX_PREFIX: &str = "_INBOX_";

/// Whether `name` can be one token of a subject (no dots, wildcards or whitespace).
fn is_subject_token(name: &str) -> bool {
    !name.is_empty() && !name.chars().any(|c| c == '.' || c == '*' || c == '>' || c.is_whitespace())
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
    /// The window in which the server drops a second message with the same `Nats-Msg-Id`.
    pub duplicate_window: Duration,
    /// Publish acks a sink keeps in flight before it waits for the oldest.
    pub publish_window: usize,
    /// A sink packs up to this many segments of one `publish` call into one message (a batch
    /// frame, [`volley_core::wire::batch`], within the server's `max_payload`): one publish,
    /// one ack and one deduplication id per message instead of per segment (issue 16). 1 sends
    /// every segment as a message of its own, as before batch frames.
    pub max_segments_per_message: usize,
    /// A batch frame grows only while it stays within this many bytes (and `max_payload`); a
    /// segment this large or larger travels alone. 1 MiB by default (the server's default
    /// `max_payload`): 64 KB segments then travel 8 to a frame, and publish faster than one to
    /// a message (`cargo bench -p volley-transport --bench nats`, issue 16 item 4); it bounds
    /// what one retry resends and what one delivery holds until its last segment is settled.
    pub max_frame_bytes: usize,
    /// The learner's continuous pull asks for this many `recv` calls' worth of messages per
    /// pull request (at least two messages, at most 256 and 16 MiB). 1 by default: deliveries
    /// waiting in the learner's client add to what the actors' pacing allows, so each call's
    /// worth more adds about a batch of policy lag. A learner whose update is much faster than
    /// a round trip to the broker (a GPU learner at large batches) takes more per second with
    /// 2–4: the next messages are on their way while it computes (issue 16 item 5,
    /// docs/benchmarks/distributed.md).
    pub prefetch_calls: usize,
    /// Pacing: a sink waits while the learner consumer's backlog (undelivered plus
    /// delivered-but-unacknowledged segments) is at or above this.
    pub max_backlog_segments: u64,
    /// A delivery not acknowledged within this is delivered again (held deliveries are kept
    /// alive by `recv`, see [`NatsTrajectorySource`]).
    pub ack_wait: Duration,
    /// Deliveries of one segment before the server gives up on it (-1: no limit).
    pub max_deliver: i64,
    /// Weights chains kept in the object store (the newest ones: each an anchor and the deltas
    /// published against it); older chains are deleted.
    pub keep_weight_versions: usize,
    /// A full weights frame (an anchor) every this many published versions; deltas in between
    /// (1 = every version full). See [`weights`].
    pub weights_anchor_every: u64,
    /// Weights whose full frame is at most this many bytes travel inside the KV pointer itself
    /// (one message to every follower, no object); larger ones go through the object store.
    pub weights_inline_max_bytes: usize,
    /// Also fan every weights version out by core NATS to the followers connected now (the
    /// *live* path, [`volley_core::wire::live`]), before storing it; the object store and the
    /// pointer stay the durable path for late joiners and for followers that missed a chunk.
    /// On by default; off, followers see a version only through the pointer.
    pub weights_live: bool,
    /// With the live path on, the pointer of inline weights is written for at least every
    /// this many versions (and the first); the versions in between reach connected followers
    /// by the live path alone, and their pointer is written only if nothing newer comes within
    /// [`weights_pointer_within`](Self::weights_pointer_within). Each pointer is a stored KV
    /// write of the whole frame, base64, and a delivery to every follower: writing it for
    /// every eighth version took 15 % off the CPU of distributed CartPole (issue 16,
    /// docs/benchmarks/distributed.md). A follower without the live path trails by up to this many
    /// versions less one. 1 writes every pointer; at most [`weights::MAX_POINTER_EVERY`].
    /// Object-stored weights write every pointer.
    pub weights_pointer_every: u64,
    /// The pointer written last is never older than this while versions go out (a slow
    /// learner writes every pointer), and a deferred pointer is written this long after the
    /// last one when no newer version comes.
    pub weights_pointer_within: Duration,
    /// Copies JetStream keeps of the run's streams and buckets (trajectories, run KV, weights,
    /// and with work items the work queue and snapshot stores): 1 on a single server, 3 on a
    /// 3-node cluster so that losing one server loses nothing. Applied when they are created;
    /// the two streams are also updated to it when they exist.
    pub replicas: usize,
    /// How to authenticate (`None`: anonymous, for a server without auth).
    pub auth: Option<NatsAuth>,
    /// TLS: the CA to trust, a client certificate (default: TLS when the server asks for it,
    /// trusting the system's CAs).
    pub tls: NatsTls,
    /// Worker threads of the runtime [`NatsBus::connect`] makes. 0 (the default): none; the
    /// threads that call the bus run the connection and its background tasks while they
    /// block on it, so a message is handed from the socket to the caller without waking
    /// another thread (issue 16: distributed CartPole took 7 % less CPU and loop time per env
    /// step than with 2 workers, docs/benchmarks/distributed.md). Between calls nothing is read,
    /// which suits actors and learners (they call the bus every round or update); a process that
    /// must keep answering while it computes for minutes (the server drops a client that
    /// misses two pings, 2 min apart by default) takes workers. Ignored by
    /// [`NatsBus::connect_with_handle`].
    pub runtime_workers: usize,
}

impl NatsConfig {
    /// Defaults sized for one learner and tens of actors on a LAN: 5 s requests, 30 s retry
    /// budget and ack wait, 32 publish acks in flight, up to 64 segments (1 MiB) per message,
    /// a backlog bound of 256 segments, 10 deliveries, 3 weights versions kept, one replica.
    pub fn new(url: impl Into<String>, run: RunId) -> Self {
        NatsConfig {
            url: url.into(),
            run,
            connect_timeout: Duration::from_secs(10),
            request_timeout: Duration::from_secs(5),
            retry_deadline: Duration::from_secs(30),
            duplicate_window: Duration::from_secs(120),
            publish_window: 32,
            max_segments_per_message: 64,
            max_frame_bytes: 1 << 20,
            max_backlog_segments: 256,
            ack_wait: Duration::from_secs(30),
            max_deliver: 10,
            keep_weight_versions: 3,
            weights_anchor_every: 16,
            weights_inline_max_bytes: 256 << 10,
            weights_live: true,
            weights_pointer_every: 8,
            weights_pointer_within: Duration::from_millis(100),
            prefetch_calls: 1,
            replicas: 1,
            auth: None,
            tls: NatsTls::default(),
            runtime_workers: 0,
        }
    }

    /// This config with TLS settings `tls`.
    pub fn with_tls(mut self, tls: NatsTls) -> Self {
        self.tls = tls;
        self
    }

    fn transfer_deadline(&self, size_bytes: usize) -> Duration {
        self.request_timeout + Duration::from_secs_f64(size_bytes as f64 / MIN_TRANSFER_BYTES_PER_SEC)
    }
}

/// Rounds of [`Shared::drive`]: socket polls, each followed by the tasks it woke.
const DRIVE_ROUNDS: usize = 4;

/// Shuts an owned runtime down without waiting for its tasks, so dropping the bus never
/// blocks (and works even from inside another runtime).
struct OwnedRuntime(Option<tokio::runtime::Runtime>);

impl OwnedRuntime {
    /// A current-thread runtime of our own, run by whichever thread blocks on it.
    fn caller_driven(&self) -> bool {
        self.0.as_ref().is_some_and(|runtime| {
            matches!(runtime.handle().runtime_flavor(), tokio::runtime::RuntimeFlavor::CurrentThread)
        })
    }

    /// `Runtime::block_on` for a runtime driven by its callers: the calling thread runs the
    /// connection, the timers and the spawned tasks while it waits (another thread that blocks
    /// meanwhile waits for its turn or for its own future). `Handle::block_on` for worker
    /// threads, which drive everything themselves.
    ///
    /// A future that completes without ever waiting (a publish only queues its message for the
    /// connection's writer) would leave what it queued unsent until the next call that waits,
    /// so the caller-driven call yields once after it: the tasks it woke, the writer among
    /// them, run before it returns.
    fn block_on<F: Future>(&self, handle: &Handle, future: F) -> F::Output {
        if !self.caller_driven() {
            return self.run(handle, future);
        }
        self.run(handle, async {
            let output = future.await;
            tokio::task::yield_now().await;
            output
        })
    }

    /// [`block_on`](Self::block_on) without the yield after the future: what the future
    /// queued for the writer stays queued until the next call that runs it.
    fn run<F: Future>(&self, handle: &Handle, future: F) -> F::Output {
        match &self.0 {
            Some(runtime) if self.caller_driven() => runtime.block_on(future),
            _ => handle.block_on(future),
        }
    }
}

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
    /// Counts (re)connections; the weights follower reads the pointer again when it changes.
    connections: tokio::sync::watch::Receiver<u64>,
    /// Permission violations the server reported on this connection.
    denials: Arc<Denials>,
    /// Declared last: dropped after the client.
    runtime: OwnedRuntime,
}

impl Shared {
    fn block_on<F: Future>(&self, future: F) -> F::Output {
        self.runtime.block_on(&self.handle, DENIALS.scope(self.denials.clone(), future))
    }

    /// Run a future that only queues messages for the connection's writer (a publish), without
    /// running the writer when the runtime is driven by its callers: what it queued leaves with
    /// the next call on this bus that drives the connection, in the same write as what that
    /// call sends. A queue that is full waits, running the writer meanwhile.
    fn queue<F: Future>(&self, future: F) -> F::Output {
        self.runtime.run(&self.handle, DENIALS.scope(self.denials.clone(), future))
    }

    /// Lets the connection and the background tasks take what has arrived, without waiting.
    /// With a runtime driven by its callers ([`NatsConfig::runtime_workers`] 0) they run only
    /// while some thread blocks on the bus; a non-blocking read such as the weights
    /// follower's `latest` calls this first, so it sees what the socket holds.
    fn drive(&self) {
        if self.runtime.caller_driven() {
            // Each yield polls the socket once and then runs the tasks that woke (the
            // connection's reader, then the subscriptions' consumers): a few rounds carry a
            // message from the socket to the component that waits for it.
            self.block_on(async {
                for _ in 0..DRIVE_ROUNDS {
                    tokio::task::yield_now().await;
                }
            });
        }
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
    /// Connect with a runtime of its own ([`NatsConfig::runtime_workers`]: by default run by
    /// the threads that call the bus), retrying for [`NatsConfig::connect_timeout`]; the
    /// error names the URL and the last failure.
    pub fn connect(config: NatsConfig) -> Result<Self, TransportError> {
        let mut builder = match config.runtime_workers {
            0 => tokio::runtime::Builder::new_current_thread(),
            workers => {
                let mut builder = tokio::runtime::Builder::new_multi_thread();
                builder.worker_threads(workers).thread_name("volley-nats");
                builder
            }
        };
        let runtime = builder.enable_all().build().map_err(|err| failed("start nats runtime", err))?;
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
        config.tls.check().map_err(|err| failed("connect", err))?;
        // Our own retry loop instead of `retry_on_initial_connect`: that option returns at once
        // and leaves a task retrying forever, while a bounded loop gives a clear error.
        let client = runtime.block_on(&handle, async {
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
                    Some(NatsAuth::Nkey { seed, .. }) => options.nkey(seed.clone()),
                    None => options,
                };
                if let Some(auth) = &config.auth {
                    options = options.custom_inbox_prefix(auth.inbox_prefix());
                }
                options = config.tls.apply(options).map_err(|err| failed("connect", err))?;
                let problem = match tokio::time::timeout(remaining, options.connect(config.url.as_str())).await {
                    Ok(Ok(client)) => break Ok(client),

                    // Wrong credentials do not get better with retries.
                    Ok(Err(err)) if err.kind() == ConnectErrorKind::AuthorizationViolation => {
                        let who = config.auth.as_ref().map_or_else(|| "anonymous".to_string(), NatsAuth::describe);
                        break Err(failed(
                            "connect",
                            format!("nats server {} refused {who}: {err} (wrong user, password or nkey?)", config.url),
                        ));
                    }
                    Ok(Err(err)) => {
                        // Nor does a failed TLS handshake (a certificate the other side refuses,
                        // a server without TLS).
                        if let Some(explained) = config.tls.explain_failure(err.kind(), &err.to_string()) {
                            break Err(failed("connect", format!("nats server {}: {explained}", config.url)));
                        }
                        err.to_string()
                    }
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
        Ok(NatsBus { shared: Arc::new(Shared { config, client, js, handle, connections, denials, runtime }) })
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

    /// The runtime the bus runs its async work on, for spawning on it. To wait for a future use
    /// [`NatsBus::block_on`]: `Handle::block_on` does not run a caller-driven runtime's
    /// connection, and would wait forever for anything that needs it.
    pub fn handle(&self) -> &Handle {
        &self.shared.handle
    }

    /// Run `future` to completion on the bus's runtime from a plain (non-tokio) thread. Use this,
    /// not `handle().block_on`: a runtime driven by its callers ([`NatsConfig::runtime_workers`]
    /// 0) runs its connection only inside this call.
    pub fn block_on<F: Future>(&self, future: F) -> F::Output {
        self.shared.block_on(future)
    }

    /// Whether the bus's runtime runs only while a thread blocks on it (no worker threads).
    /// A component that waits on `handle()` by itself then needs a connection of its own.
    pub fn caller_driven(&self) -> bool {
        self.shared.runtime.caller_driven()
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

/// Wait for `request`, but give up waiting, with a retryable error, once the connection has been
/// re-established meanwhile: a request in flight across a reconnect may never be answered (the
/// publish acks of chunks sent to the server that died), and waiting out its deadline only
/// delays the retry (issue 11: the learner's first update after a broker restart came 4-5 s
/// late, the request timeout of a weights put).
async fn unless_reconnected<T>(
    connections: &tokio::sync::watch::Receiver<u64>,
    operation: &'static str,
    request: impl Future<Output = Result<T, TransportError>>,
) -> Result<T, TransportError> {
    let since = *connections.borrow();
    tokio::select! {
        result = request => result,
        () = reconnected_since(connections, since) => {
            info!(operation, "reconnected while waiting for an answer; retrying at once");
            Err(TransportError::Failed { operation, message: "interrupted by a reconnect".to_string() })
        }
    }
}

/// Completes once the connection is no longer the one `connections` counted as `since` (at
/// once if it already is not); never while the bus is going away.
async fn reconnected_since(connections: &tokio::sync::watch::Receiver<u64>, since: u64) {
    let mut connections = connections.clone();
    while *connections.borrow_and_update() == since {
        if connections.changed().await.is_err() {
            // The bus is going away; only what waits beside this can end the wait.
            std::future::pending::<()>().await;
        }
    }
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

#[cfg(test)]
mod tests {
    use super::*;

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
}
