//! Connections as the roles of the repo's broker config (`broker-config/accounts.conf`, run
//! [`RUN`]) and what the server logged about them: the fixtures of the broker permission and
//! relay tests.

use std::sync::mpsc;
use std::sync::Arc;
use std::thread;
use std::time::Duration;

use bytes::Bytes;
use volley_core::ids::{PolicyVersion, RunId};
use volley_core::spec::RunSpec;
use volley_core::wire::{TrajectorySegment, Weights};
use volley_testkit::TestNats;
use volley_transport::nats::{NatsAuth, NatsBus, NatsConfig, NatsTls, NatsWorkQueue};
use volley_transport::TransportError;

use super::{actor_identity, LEARNER_PASSWORD};

/// The run `broker-config/accounts.conf` has users for.
pub const RUN: &str = "local";
/// The environment service `broker-config/accounts.conf` has a server user for.
pub const ENV_SERVICE: &str = "cartpole";
/// Bound on any wait: only there so that a regression (e.g. a denial retried forever) fails
/// instead of hanging.
pub const GUARD: Duration = Duration::from_secs(60);
/// What a denial turns into (see `volley_transport::nats`).
pub const DENIED: &str = "permission denied by the nats server";

pub fn config(server: &TestNats, run: &str, user: &str, password: &str) -> NatsConfig {
    config_as(server, run, NatsAuth::UserPassword { user: user.to_string(), password: password.to_string() })
}

pub fn config_as(server: &TestNats, run: &str, auth: NatsAuth) -> NatsConfig {
    let mut config = NatsConfig::new(server.url(), RunId::new(run).expect("a valid run id"))
        .with_tls(NatsTls::with_ca(server.ca_file()));
    config.connect_timeout = Duration::from_secs(10);
    config.request_timeout = Duration::from_secs(2);
    config.retry_deadline = Duration::from_secs(4);
    config.auth = Some(auth);
    config
}

pub fn learner(server: &TestNats) -> NatsBus {
    NatsBus::connect(config(server, RUN, "learner-local", LEARNER_PASSWORD)).expect("learner connects")
}

/// The learner on `server` with the run created for work items and the work queue open, so
/// every stream and store of the run exists (the relay tests aim at all of them).
pub fn learner_with_work_run(server: &TestNats) -> (NatsBus, NatsWorkQueue) {
    let learner = learner(server);
    let mut spec = spec();
    spec.hyper.work = volley_core::work::WorkConfig { enabled: true, ..Default::default() };
    learner.ensure_run(&spec).expect("the learner creates the run");
    let queue = learner.work_queue(&spec.hyper.work).expect("the learner opens the work queue");
    (learner, queue)
}

/// Actor identity `actor-0` on `run`.
pub fn actor_on(server: &TestNats, run: &str) -> NatsBus {
    actor_as(server, run, 0)
}

/// Actor identity `actor-<index>` on `run`.
pub fn actor_as(server: &TestNats, run: &str, index: usize) -> NatsBus {
    NatsBus::connect(config_as(server, run, actor_identity(index).auth())).expect("actor connects")
}

/// The id of actor identity `actor-0`, the one [`actor_on`] connects as.
pub const ACTOR: &str = "actor-0";

pub fn spec() -> RunSpec {
    super::spec(RUN)
}

pub fn segment(actor: &str, segment_idx: u64) -> TrajectorySegment {
    super::segment(RUN, actor, 0, segment_idx)
}

pub fn weights(version: u64) -> Arc<Weights> {
    let params = (0..300_000).map(|i| (i as f32 * 0.001 + version as f32).sin()).collect();
    Arc::new(Weights::new(PolicyVersion(version), 42, params))
}

/// Run `work` on its own thread and fail the test if it does not return within [`GUARD`].
pub fn within_guard<T: Send + 'static>(what: &str, work: impl FnOnce() -> T + Send + 'static) -> T {
    let (tx, rx) = mpsc::channel();
    thread::spawn(move || {
        let _ = tx.send(work());
    });
    rx.recv_timeout(GUARD).unwrap_or_else(|_| panic!("{what} did not return within {GUARD:?}"))
}

pub fn assert_denied(what: &str, result: Result<(), TransportError>) {
    match result {
        Err(TransportError::Failed { message, .. }) if message.starts_with(DENIED) => {}
        other => panic!("{what}: expected a permission denial, got {other:?}"),
    }
}

/// The permission violations in the server's log, one per line.
pub fn violations(server: &TestNats) -> String {
    server.log().lines().filter(|line| line.contains("Violation")).collect::<Vec<_>>().join("\n")
}

pub fn assert_no_violations(server: &TestNats) {
    let violations = violations(server);
    assert!(violations.is_empty(), "the server reported violations:\n{violations}");
}

/// Whether the server logged a violation for `subject` (publish or subscription).
pub fn has_violation(server: &TestNats, subject: &str) -> bool {
    server.log().lines().any(|line| line.contains("Violation") && line.contains(&format!("\"{subject}\"")))
}

/// Poll the server log until it shows a violation for `subject` (bounded by [`GUARD`]).
pub fn assert_violation(server: &TestNats, subject: &str) {
    let started = std::time::Instant::now();
    while !has_violation(server, subject) {
        assert!(started.elapsed() < GUARD, "no violation for {subject}:\n{}", server.log());
        thread::sleep(Duration::from_millis(20));
    }
}

/// A raw JetStream API request as `bus`'s user: the server's JSON answer, or `None` when the
/// request was dropped (denied by permissions: the request times out).
pub fn js_request(bus: &NatsBus, subject: &str, body: serde_json::Value) -> Option<serde_json::Value> {
    let client = bus.client().clone();
    let subject = subject.to_string();
    bus.block_on(async move {
        let reply = tokio::time::timeout(
            Duration::from_secs(2),
            client.request(subject, Bytes::from(serde_json::to_vec(&body).expect("json"))),
        )
        .await;
        match reply {
            Ok(Ok(message)) => Some(serde_json::from_slice(&message.payload).expect("a JSON answer")),
            _ => None,
        }
    })
}

/// An ephemeral push consumer's create request body (as async-nats' ordered consumers send it).
pub fn push_consumer(stream: &str, name: &str, filter: &str, deliver: &str) -> serde_json::Value {
    serde_json::json!({
        "stream_name": stream,
        "config": {
            "name": name,
            "deliver_subject": deliver,
            "filter_subject": filter,
            "deliver_policy": "all",
            "ack_policy": "none",
            "flow_control": true,
            "idle_heartbeat": 5_000_000_000u64,
            "inactive_threshold": 30_000_000_000u64,
            "mem_storage": true,
            "num_replicas": 1
        },
        "action": ""
    })
}

/// A raw request as `bus`'s user: the answer, or `None` when none came (a denied request is
/// dropped by the server).
pub fn raw_request(bus: &NatsBus, subject: &str, body: Bytes) -> Option<async_nats::Message> {
    let client = bus.client().clone();
    let subject = subject.to_string();
    bus.block_on(
        async move { tokio::time::timeout(Duration::from_secs(2), client.request(subject, body)).await.ok()?.ok() },
    )
}
