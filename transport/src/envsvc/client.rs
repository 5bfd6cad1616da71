//! The client side of the environment protocol: discovery and one call per operation, each
//! with a deadline.

use std::future::Future;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

use async_nats::{ConnectOptions, RequestErrorKind, Subject};
use bytes::Bytes;
use futures::StreamExt;
use serde::de::DeserializeOwned;
use serde::Serialize;
use tokio::runtime::Handle;
use tracing::{debug, warn};

use super::protocol::{
    self, CloseRequest, EmptyReply, ObsEncoding, ObsReply, Op, OpenReply, OpenRequest, ResetRequest, RestoreRequest,
    ServiceInfo, SnapshotReply, SnapshotRequest, SpacesReply, SpacesRequest, StepActions, StepReply, StepRequest,
    ERROR_CODE_HEADER, ERROR_HEADER, METADATA_PROTOCOL, MIN_PROTOCOL_VERSION, PROTOCOL_VERSION,
};
use super::{EnvServiceError, EnvServiceName, OwnedRuntime, RemoteEnvCounters};
use crate::nats::{NatsAuth, NatsTls, TlsFileError};
use volley_core::subjects;

/// How long discovery collects `$SRV.INFO` replies by default. Instances answer within a
/// millisecond on a LAN; the window is for a busy Python server whose event loop is stepping.
pub const DEFAULT_DISCOVERY_WINDOW: Duration = Duration::from_millis(300);

/// One running server of an environment service, with the subject of each operation.
#[derive(Debug, Clone, PartialEq)]
pub struct Instance {
    /// The instance id (unique per running server).
    pub id: String,
    /// The server's own version string; informative.
    pub version: String,
    /// The environment protocol version the instance announces, which every request to it
    /// carries (`MIN_PROTOCOL_VERSION..=PROTOCOL_VERSION`).
    pub protocol: u32,
    subjects: Vec<Subject>,
}

impl Instance {
    /// Check a `$SRV.INFO` reply: the service name, the protocol version in the metadata and
    /// an endpoint for every [`Op`].
    pub fn from_info(name: &EnvServiceName, info: ServiceInfo) -> Result<Instance, EnvServiceError> {
        let incompatible = |message: String| EnvServiceError::Incompatible { instance: info.id.clone(), message };
        if info.name != subjects::env_service(name) {
            return Err(incompatible(format!("it is service {:?}, not {}", info.name, subjects::env_service(name))));
        }
        // A version-1 instance serves discrete environments with the messages version 2 has
        // for them, so it stays usable; newer (or unparsable) versions are skipped.
        let version = info.metadata.get(METADATA_PROTOCOL).map(String::as_str);
        let protocol = match version.and_then(|v| v.parse::<u32>().ok()) {
            Some(v) if (MIN_PROTOCOL_VERSION..=PROTOCOL_VERSION).contains(&v) => v,
            _ => {
                return Err(incompatible(format!(
                    "it speaks environment protocol {version:?}, this build speaks \
                     {MIN_PROTOCOL_VERSION} to {PROTOCOL_VERSION}"
                )))
            }
        };
        let mut subjects = Vec::with_capacity(Op::ALL.len());
        for op in Op::ALL {
            let endpoint = info
                .endpoints
                .iter()
                .find(|e| e.name == op.name())
                .ok_or_else(|| incompatible(format!("it lists no {:?} endpoint", op.name())))?;
            subjects.push(Subject::from(endpoint.subject.as_str()));
        }
        Ok(Instance { id: info.id.clone(), version: info.version, protocol, subjects })
    }

    /// The subject requests for `op` go to.
    pub fn subject(&self, op: Op) -> &Subject {
        let index = Op::ALL.iter().position(|o| *o == op).expect("every op is in Op::ALL");
        &self.subjects[index]
    }
}

/// A connection to NATS for talking to environment services. Cloning shares the connection.
///
/// The async methods may be awaited on any runtime; [`EnvServiceClient::block_on`] runs them
/// from a plain thread.
#[derive(Debug, Clone)]
pub struct EnvServiceClient {
    client: async_nats::Client,
    handle: Handle,
    request_timeout: Duration,
    discovery_window: Duration,
    counters: Arc<RemoteEnvCounters>,
    _runtime: Arc<OwnedRuntime>,
}

impl EnvServiceClient {
    /// Connect with a runtime of its own (two worker threads), trying for `connect_timeout`.
    /// `request_timeout` is the deadline of every request.
    pub fn connect(
        url: &str,
        auth: Option<&NatsAuth>,
        tls: &NatsTls,
        connect_timeout: Duration,
        request_timeout: Duration,
    ) -> Result<Self, EnvServiceError> {
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .thread_name("volley-envsvc")
            .enable_all()
            .build()
            .map_err(|err| EnvServiceError::Nats { operation: "start runtime", message: err.to_string() })?;
        let handle = runtime.handle().clone();
        let client = handle.block_on(connect_nats(url, auth, tls, connect_timeout, request_timeout))?;
        Ok(Self::from_parts(client, handle, request_timeout, OwnedRuntime(Some(runtime))))
    }

    /// Use an existing connection and multi-thread runtime (e.g. an actor's `NatsBus`).
    pub fn with_client(client: async_nats::Client, handle: Handle, request_timeout: Duration) -> Self {
        Self::from_parts(client, handle, request_timeout, OwnedRuntime(None))
    }

    fn from_parts(client: async_nats::Client, handle: Handle, request_timeout: Duration, rt: OwnedRuntime) -> Self {
        EnvServiceClient {
            client,
            handle,
            request_timeout,
            discovery_window: DEFAULT_DISCOVERY_WINDOW,
            counters: Arc::new(RemoteEnvCounters::default()),
            _runtime: Arc::new(rt),
        }
    }

    /// Count into `counters` instead of the client's own.
    pub fn with_counters(mut self, counters: Arc<RemoteEnvCounters>) -> Self {
        self.counters = counters;
        self
    }

    /// Collect `$SRV.INFO` replies for `window` when discovering.
    pub fn with_discovery_window(mut self, window: Duration) -> Self {
        self.discovery_window = window;
        self
    }

    /// The counters this client updates.
    pub fn counters(&self) -> &Arc<RemoteEnvCounters> {
        &self.counters
    }

    /// The deadline of every request.
    pub fn request_timeout(&self) -> Duration {
        self.request_timeout
    }

    /// The discovery window.
    pub fn discovery_window(&self) -> Duration {
        self.discovery_window
    }

    /// The largest message the server accepts (requests and replies must fit).
    pub fn max_payload(&self) -> usize {
        self.client.server_info().max_payload
    }

    /// The underlying connection.
    pub fn nats(&self) -> &async_nats::Client {
        &self.client
    }

    /// The runtime the client runs on.
    pub fn handle(&self) -> &Handle {
        &self.handle
    }

    /// Run `future` on the client's runtime from a plain (non-tokio) thread.
    pub fn block_on<F: Future>(&self, future: F) -> F::Output {
        self.handle.block_on(future)
    }

    /// The instances of service `name` that answer `$SRV.INFO` within the discovery window and
    /// speak this protocol (others are logged and skipped). May be empty.
    pub async fn discover(&self, name: &EnvServiceName) -> Result<Vec<Instance>, EnvServiceError> {
        let service = subjects::env_service(name);
        let nats = |operation: &'static str| {
            move |err: async_nats::Error| EnvServiceError::Nats { operation, message: err.to_string() }
        };
        let inbox = self.client.new_inbox();
        let mut replies =
            self.client.subscribe(inbox.clone()).await.map_err(|e| nats("discovery subscribe")(e.into()))?;
        self.client
            .publish_with_reply(subjects::service_info(&service), inbox, Bytes::new())
            .await
            .map_err(|e| nats("discovery publish")(e.into()))?;
        self.client.flush().await.map_err(|e| nats("discovery flush")(e.into()))?;
        let deadline = tokio::time::Instant::now() + self.discovery_window;
        let mut instances: Vec<Instance> = Vec::new();
        while let Ok(Some(message)) = tokio::time::timeout_at(deadline, replies.next()).await {
            // With no instance at all the server answers the inbox with an empty
            // "no responders" status at once: nothing more will come.
            if message.status == Some(async_nats::StatusCode::NO_RESPONDERS) {
                break;
            }
            if message.payload.is_empty() {
                continue;
            }
            let info = match serde_json::from_slice::<ServiceInfo>(&message.payload) {
                Ok(info) => info,
                Err(err) => {
                    warn!(service = %name, %err, "undecodable $SRV.INFO reply; skipped");
                    continue;
                }
            };
            match Instance::from_info(name, info) {
                Ok(instance) if !instances.iter().any(|known| known.id == instance.id) => instances.push(instance),
                Ok(_) => {}
                Err(err) => warn!(service = %name, %err, reason = err.reason(), "skipping an environment server"),
            }
        }
        let _ = replies.unsubscribe().await;
        debug!(service = %name, n_instances = instances.len(), "discovered environment servers");
        Ok(instances)
    }

    /// The instance's spaces and limits.
    pub async fn spaces(&self, instance: &Instance) -> Result<SpacesReply, EnvServiceError> {
        let reply: SpacesReply = self.call(instance, Op::Spaces, &SpacesRequest { v: instance.protocol }).await?;
        let dim = reply.obs_dim as usize;
        let bad = |message: String| EnvServiceError::BadReply { instance: instance.id.clone(), op: "spaces", message };
        if reply.obs_low.len() != dim || reply.obs_high.len() != dim || dim == 0 {
            return Err(bad(format!(
                "obs_dim {dim} with {} low and {} high bounds",
                reply.obs_low.len(),
                reply.obs_high.len()
            )));
        }
        let actions = reply.action_space().map_err(&bad)?;
        if actions.is_continuous() && instance.protocol < 2 {
            return Err(bad("a box action space from a version-1 instance".to_string()));
        }
        if reply.image_shape().map_err(&bad)?.is_some() && instance.protocol < protocol::IMAGE_PROTOCOL_VERSION {
            return Err(bad(format!("image observations from a version-{} instance", instance.protocol)));
        }
        Ok(reply)
    }

    /// Open a session of `seeds.len()` environments, environment `i` reset with `seeds[i]`.
    /// The caller checks the observation length.
    pub async fn open(&self, instance: &Instance, seeds: &[u64]) -> Result<OpenReply, EnvServiceError> {
        let request = OpenRequest { v: instance.protocol, n_envs: seeds.len() as u32, seeds: seeds.to_vec() };
        self.call(instance, Op::Open, &request).await
    }

    /// Reset environments of a session (`None` seeds: the environment's own generator): every
    /// one, one seed each, or with `envs` (version-3 instances) those listed, one seed each.
    /// Returns every environment's observation, decoded as `encoding` (the instance's
    /// [`SpacesReply::obs_encoding`]).
    pub async fn reset(
        &self,
        instance: &Instance,
        session: u64,
        seeds: Vec<Option<u64>>,
        envs: Option<Vec<u32>>,
        encoding: ObsEncoding,
    ) -> Result<Vec<f32>, EnvServiceError> {
        if envs.is_some() && instance.protocol < protocol::IMAGE_PROTOCOL_VERSION {
            return Err(EnvServiceError::Incompatible {
                instance: instance.id.clone(),
                message: format!(
                    "resetting single environments needs protocol version 3; the instance speaks {}",
                    instance.protocol
                ),
            });
        }
        let request = ResetRequest { v: instance.protocol, session, seeds, envs };
        let reply: ObsReply = self.call(instance, Op::Reset, &request).await?;
        decode_obs(instance, "reset", &reply, encoding)
    }

    /// Step every environment of a session. The caller checks lengths and values.
    pub async fn step(
        &self,
        instance: &Instance,
        session: u64,
        actions: StepActions,
    ) -> Result<StepReply, EnvServiceError> {
        self.call(instance, Op::Step, &StepRequest { v: instance.protocol, session, actions }).await
    }

    /// The state of environment `env` of a session.
    pub async fn snapshot(&self, instance: &Instance, session: u64, env: u32) -> Result<Vec<u8>, EnvServiceError> {
        let reply: SnapshotReply =
            self.call(instance, Op::Snapshot, &SnapshotRequest { v: instance.protocol, session, env }).await?;
        Ok(reply.state)
    }

    /// Restore environment `env` of a session; returns its observation, decoded as `encoding`.
    pub async fn restore(
        &self,
        instance: &Instance,
        session: u64,
        env: u32,
        state: Vec<u8>,
        encoding: ObsEncoding,
    ) -> Result<Vec<f32>, EnvServiceError> {
        let request = RestoreRequest { v: instance.protocol, session, env, state };
        let reply: ObsReply = self.call(instance, Op::Restore, &request).await?;
        decode_obs(instance, "restore", &reply, encoding)
    }

    /// Drop a session (succeeds for an unknown one).
    pub async fn close(&self, instance: &Instance, session: u64) -> Result<(), EnvServiceError> {
        let _: EmptyReply = self.call(instance, Op::Close, &CloseRequest { v: instance.protocol, session }).await?;
        Ok(())
    }

    /// One request with the deadline; error replies become [`EnvServiceError::Server`].
    async fn call<Req: Serialize, Rep: DeserializeOwned>(
        &self,
        instance: &Instance,
        op: Op,
        request: &Req,
    ) -> Result<Rep, EnvServiceError> {
        self.counters.requests.fetch_add(1, Ordering::Relaxed);
        let payload = Bytes::from(protocol::encode(request));
        let subject = instance.subject(op).clone();
        let op_name = op.name();
        let started = Instant::now();
        let message = match tokio::time::timeout(self.request_timeout, self.client.request(subject, payload)).await {
            Err(_) => {
                return Err(EnvServiceError::Timeout {
                    instance: instance.id.clone(),
                    op: op_name,
                    after: self.request_timeout,
                })
            }
            Ok(Err(err)) => {
                return Err(match err.kind() {
                    RequestErrorKind::NoResponders => {
                        EnvServiceError::Gone { instance: instance.id.clone(), op: op_name }
                    }
                    RequestErrorKind::TimedOut => EnvServiceError::Timeout {
                        instance: instance.id.clone(),
                        op: op_name,
                        after: started.elapsed(),
                    },
                    _ => EnvServiceError::Nats { operation: op_name, message: err.to_string() },
                })
            }
            Ok(Ok(message)) => message,
        };
        if let Some(code) = message.headers.as_ref().and_then(|h| h.get(ERROR_CODE_HEADER)) {
            let description = message
                .headers
                .as_ref()
                .and_then(|h| h.get(ERROR_HEADER))
                .map(|v| v.as_str().to_string())
                .unwrap_or_default();
            return Err(EnvServiceError::Server {
                instance: instance.id.clone(),
                op: op_name,
                // A code that is not a number is still an error; report it as internal.
                code: code.as_str().trim().parse().unwrap_or(500),
                message: description,
            });
        }
        protocol::decode(op_name, &message.payload)
            .map_err(|err| EnvServiceError::bad_reply(&instance.id, op_name, err))
    }
}

/// Connect to `url` (with `auth`, if any, over TLS as `tls` says), retrying until
/// `connect_timeout`; every request on the connection gets `request_timeout`.
pub async fn connect_nats(
    url: &str,
    auth: Option<&NatsAuth>,
    tls: &NatsTls,
    connect_timeout: Duration,
    request_timeout: Duration,
) -> Result<async_nats::Client, EnvServiceError> {
    connect_with_inbox(url, auth, tls, connect_timeout, request_timeout, None).await
}

/// The inbox prefix of environment servers' connections. Their NATS user may use this prefix
/// and not `_INBOX.>`, where actors' and learners' replies (weights included) travel
/// (broker-config/accounts.conf, docs/SECURITY.md).
pub const ENV_SERVER_INBOX_PREFIX: &str = "_INBOX_ENV";

/// [`connect_nats`] for an environment server: its own requests (only the stop barrier of
/// [`EnvServer::stop`](super::EnvServer::stop)) use [`ENV_SERVER_INBOX_PREFIX`].
pub async fn connect_env_server(
    url: &str,
    auth: Option<&NatsAuth>,
    tls: &NatsTls,
    connect_timeout: Duration,
    request_timeout: Duration,
) -> Result<async_nats::Client, EnvServiceError> {
    connect_with_inbox(url, auth, tls, connect_timeout, request_timeout, Some(ENV_SERVER_INBOX_PREFIX)).await
}

async fn connect_with_inbox(
    url: &str,
    auth: Option<&NatsAuth>,
    tls: &NatsTls,
    connect_timeout: Duration,
    request_timeout: Duration,
    inbox_prefix: Option<&str>,
) -> Result<async_nats::Client, EnvServiceError> {
    let started = Instant::now();
    let mut pause = Duration::from_millis(50);
    let tls_error = |err: TlsFileError| EnvServiceError::Nats { operation: "connect", message: err.to_string() };
    tls.check().map_err(tls_error)?;
    loop {
        let remaining = connect_timeout.saturating_sub(started.elapsed());
        let mut options = ConnectOptions::new()
            .name("volley-envsvc")
            .connection_timeout(request_timeout.min(remaining).max(Duration::from_millis(10)))
            .request_timeout(Some(request_timeout));
        options = match auth {
            Some(NatsAuth::UserPassword { user, password }) => {
                options.user_and_password(user.clone(), password.clone())
            }
            Some(NatsAuth::Token(token)) => options.token(token.clone()),
            Some(NatsAuth::Nkey { seed, .. }) => options.nkey(seed.clone()),
            None => options,
        };
        // A server's own prefix, else its user's private one (`NatsAuth::inbox_prefix`).
        match (inbox_prefix, auth) {
            (Some(prefix), _) => options = options.custom_inbox_prefix(prefix),
            (None, Some(auth)) => options = options.custom_inbox_prefix(auth.inbox_prefix()),
            (None, None) => {}
        }
        options = tls.apply(options).map_err(tls_error)?;
        let problem = match tokio::time::timeout(remaining, options.connect(url)).await {
            Ok(Ok(client)) => return Ok(client),
            Ok(Err(err)) => {
                // Retrying cannot fix a failed TLS handshake.
                if let Some(explained) = tls.explain_failure(err.kind(), &err.to_string()) {
                    return Err(EnvServiceError::Nats {
                        operation: "connect",
                        message: format!("nats server {url}: {explained}"),
                    });
                }
                err.to_string()
            }
            Err(_) => "timed out".to_string(),
        };
        if started.elapsed() >= connect_timeout {
            return Err(EnvServiceError::Nats {
                operation: "connect",
                message: format!("cannot reach nats server {url} within {connect_timeout:?}: {problem}"),
            });
        }
        debug!(url, %problem, "nats connect failed; retrying");
        tokio::time::sleep(pause.min(connect_timeout.saturating_sub(started.elapsed()))).await;
        pause = (pause * 2).min(Duration::from_secs(1));
    }
}

/// The observations of a `reset` or `restore` reply, decoded as `encoding`.
fn decode_obs(
    instance: &Instance,
    op: &'static str,
    reply: &ObsReply,
    encoding: ObsEncoding,
) -> Result<Vec<f32>, EnvServiceError> {
    reply.obs.decode(encoding).map_err(|message| EnvServiceError::BadReply {
        instance: instance.id.clone(),
        op,
        message,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::envsvc::protocol::ServiceEndpoint;

    fn info(protocol: Option<&str>) -> ServiceInfo {
        ServiceInfo {
            name: "volley-env-x".into(),
            id: "i1".into(),
            version: "0.1.0".into(),
            metadata: protocol.map(|p| (METADATA_PROTOCOL.to_string(), p.to_string())).into_iter().collect(),
            endpoints: Op::ALL
                .iter()
                .map(|op| ServiceEndpoint { name: op.name().into(), subject: format!("volley.env.x.i1.{}", op.name()) })
                .collect(),
        }
    }

    /// Version-1 instances stay usable (their requests carry `v: 1`); unknown versions are
    /// skipped (docs/ENV_PROTOCOL.md, "Versioning").
    #[test]
    fn instances_of_versions_one_to_three_are_used_and_others_skipped() {
        let name = EnvServiceName::new("x").unwrap();
        assert_eq!(Instance::from_info(&name, info(Some("1"))).unwrap().protocol, 1);
        assert_eq!(Instance::from_info(&name, info(Some("2"))).unwrap().protocol, 2);
        assert_eq!(Instance::from_info(&name, info(Some("3"))).unwrap().protocol, PROTOCOL_VERSION);
        for bad in [Some("4"), Some("0"), Some("two"), None] {
            let err = Instance::from_info(&name, info(bad)).unwrap_err();
            assert_eq!(err.reason(), "remote_incompatible", "{bad:?}: {err}");
        }
    }
}
