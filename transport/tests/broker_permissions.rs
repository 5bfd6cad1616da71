//! The repo's broker config (`broker-config/`) against a real `nats-server` and the real
//! transport: the learner user `learner-local` and the actor identities `actor-<i>` (one NKey
//! user per actor, issue 46 item 3) can do their jobs and nothing else, and a denied operation comes back as a clear [`TransportError`], not a hang.
//!
//! The server runs `broker-config/accounts.conf` verbatim (its text in the test's config) on a
//! loopback port, with the passwords and actor public keys it reads from the environment set to
//! test values.
//! Every allowed flow also checks that the server logged no permission violation, so a grant
//! that async-nats needs but the config lacks fails here even where the transport tolerates
//! the failure (e.g. the pacing read).

#[allow(dead_code)] // this test uses only part of the shared fixtures
mod common;
use common::{actor_identity, repo_broker, repo_broker_environment, repo_file, ENV_PASSWORD, LEARNER_PASSWORD};

use std::sync::atomic::AtomicBool;
use std::sync::{mpsc, Arc};
use std::thread;
use std::time::Duration;

use bytes::Bytes;
use volley_core::ids::{ActorId, PolicyVersion, RunId};
use volley_core::spec::RunSpec;
use volley_core::subjects;
use volley_core::wire::{TrajectorySegment, Weights};
use volley_testkit::TestNats;
use volley_transport::nats::{NatsAuth, NatsBus, NatsConfig, NatsTls, NatsWorkQueue};
use volley_transport::{TrajectorySink, TrajectorySource, TransportError, WeightsFollower, WeightsPublisher};

/// The run `broker-config/accounts.conf` has users for.
const RUN: &str = "local";
/// The environment service `broker-config/accounts.conf` has a server user for.
const ENV_SERVICE: &str = "cartpole";
/// Bound on any wait: only there so that a regression (e.g. a denial retried forever) fails
/// instead of hanging.
const GUARD: Duration = Duration::from_secs(60);
/// What a denial turns into (see `volley_transport::nats`).
const DENIED: &str = "permission denied by the nats server";

fn config(server: &TestNats, run: &str, user: &str, password: &str) -> NatsConfig {
    config_as(server, run, NatsAuth::UserPassword { user: user.to_string(), password: password.to_string() })
}

fn config_as(server: &TestNats, run: &str, auth: NatsAuth) -> NatsConfig {
    let mut config = NatsConfig::new(server.url(), RunId::new(run).expect("a valid run id"))
        .with_tls(NatsTls::with_ca(server.ca_file()));
    config.connect_timeout = Duration::from_secs(10);
    config.request_timeout = Duration::from_secs(2);
    config.retry_deadline = Duration::from_secs(4);
    config.auth = Some(auth);
    config
}

fn learner(server: &TestNats) -> NatsBus {
    NatsBus::connect(config(server, RUN, "learner-local", LEARNER_PASSWORD)).expect("learner connects")
}

/// Actor identity `actor-0` on `run`.
/// The learner on `server` with the run created for work items and the work queue open, so
/// every stream and store of the run exists (the relay tests aim at all of them).
fn learner_with_work_run(server: &TestNats) -> (NatsBus, NatsWorkQueue) {
    let learner = learner(server);
    let mut spec = spec();
    spec.hyper.work = volley_core::work::WorkConfig { enabled: true, ..Default::default() };
    learner.ensure_run(&spec).expect("the learner creates the run");
    let queue = learner.work_queue(&spec.hyper.work).expect("the learner opens the work queue");
    (learner, queue)
}

fn actor_on(server: &TestNats, run: &str) -> NatsBus {
    actor_as(server, run, 0)
}

/// Actor identity `actor-<index>` on `run`.
fn actor_as(server: &TestNats, run: &str, index: usize) -> NatsBus {
    NatsBus::connect(config_as(server, run, actor_identity(index).auth())).expect("actor connects")
}

/// The id of actor identity `actor-0`, the one [`actor_on`] connects as.
const ACTOR: &str = "actor-0";

fn spec() -> RunSpec {
    common::spec(RUN)
}

fn segment(actor: &str, segment_idx: u64) -> TrajectorySegment {
    common::segment(RUN, actor, 0, segment_idx)
}

fn weights(version: u64) -> Arc<Weights> {
    let params = (0..300_000).map(|i| (i as f32 * 0.001 + version as f32).sin()).collect();
    Arc::new(Weights::new(PolicyVersion(version), 42, params))
}

/// Run `work` on its own thread and fail the test if it does not return within [`GUARD`].
fn within_guard<T: Send + 'static>(what: &str, work: impl FnOnce() -> T + Send + 'static) -> T {
    let (tx, rx) = mpsc::channel();
    thread::spawn(move || {
        let _ = tx.send(work());
    });
    rx.recv_timeout(GUARD).unwrap_or_else(|_| panic!("{what} did not return within {GUARD:?}"))
}

fn assert_denied(what: &str, result: Result<(), TransportError>) {
    match result {
        Err(TransportError::Failed { message, .. }) if message.starts_with(DENIED) => {}
        other => panic!("{what}: expected a permission denial, got {other:?}"),
    }
}

/// The permission violations in the server's log, one per line.
fn violations(server: &TestNats) -> String {
    server.log().lines().filter(|line| line.contains("Violation")).collect::<Vec<_>>().join("\n")
}

fn assert_no_violations(server: &TestNats) {
    let violations = violations(server);
    assert!(violations.is_empty(), "the server reported violations:\n{violations}");
}

#[test]
fn repo_broker_config_passes_the_servers_config_check() {
    // `-t` parses only; the store directory is not created. It does load the TLS certificate
    // and key the config names (issue 46): a throwaway pair.
    let store = std::env::temp_dir().join("volley-broker-config-check");
    let tls = tempfile::tempdir().expect("temp dir");
    let pki = volley_testkit::tls::TestPki::generate(tls.path());
    let output = std::process::Command::new(volley_testkit::find_nats_server())
        .arg("-t")
        .arg("-c")
        .arg(repo_file("broker-config/nats.conf"))
        .env("VOLLEY_NATS_STORE_DIR", &store)
        .envs(repo_broker_environment())
        .env("VOLLEY_NATS_TLS_CERT", pki.server_cert_file())
        .env("VOLLEY_NATS_TLS_KEY", pki.server_key_file())
        .output()
        .expect("run nats-server -t");
    assert!(
        output.status.success(),
        "{}{}",
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    );
}

/// The actor identity slots of `broker-config/accounts.conf` are exactly what
/// `volley creds actors` writes (`identity::actor_user_block`), with the public keys read from
/// the environment, so the tool and the committed config grant the same.
#[test]
fn the_repo_configs_actor_identities_are_the_generators_blocks() {
    use volley_transport::nats::identity::{actor_nkey_variable, actor_user_block};
    let accounts = std::fs::read_to_string(repo_file("broker-config/accounts.conf")).expect("read accounts.conf");
    let run = RunId::new(RUN).expect("valid");
    let services = [volley_env::EnvServiceName::new(ENV_SERVICE).expect("valid")];
    for index in 0..common::ACTOR_IDENTITIES {
        let actor = ActorId::new(format!("actor-{index}")).expect("valid");
        let block = actor_user_block(&run, &actor, &format!("${}", actor_nkey_variable(index)), &services);
        assert!(accounts.contains(&block), "accounts.conf lacks the block of {actor}:\n{block}");
    }
    assert!(!accounts.contains("user: actor-"), "no shared actor user is left");
}

/// The development identities of `deploy/dev-identities/` are whole (each seed file's public
/// key is the one its `actors-local.env` names), and `deploy/compose.yaml` gives the broker
/// those keys by default, so the compose stack's actors can connect out of the box.
#[test]
fn the_development_identities_match_their_public_keys_and_compose() {
    use volley_transport::nats::identity::{actor_nkey_variable, ActorIdentity};
    let env = std::fs::read_to_string(repo_file("deploy/dev-identities/actors-local.env")).expect("actors-local.env");
    let compose = std::fs::read_to_string(repo_file("deploy/compose.yaml")).expect("compose.yaml");
    for index in 0..common::ACTOR_IDENTITIES {
        let path = repo_file(&format!("deploy/dev-identities/actor-{index}.nk"));
        let identity = ActorIdentity::read(&path).unwrap_or_else(|err| panic!("{err}"));
        let variable = actor_nkey_variable(index);
        assert!(env.contains(&format!("{variable}={}\n", identity.public_key())), "{variable} in actors-local.env");
        assert!(
            compose.contains(&format!("{variable}: ${{{variable}:-{}}}", identity.public_key())),
            "{variable} in compose"
        );
    }
}

/// The example credentials of `k8s/components/example-credentials` are the development
/// identities: each seed under its identity's file name, each public key under `actor-<i>-nkey`.
#[test]
fn the_example_kubernetes_credentials_are_the_development_identities() {
    use volley_transport::nats::identity::ActorIdentity;
    let secret = ["secret.yaml", "actor-identities.yaml"]
        .map(|file| std::fs::read_to_string(repo_file(&format!("k8s/components/example-credentials/{file}"))))
        .map(|text| text.expect("an example Secret"))
        .concat();
    for index in 0..common::ACTOR_IDENTITIES {
        let path = repo_file(&format!("deploy/dev-identities/actor-{index}.nk"));
        let identity = ActorIdentity::read(&path).unwrap_or_else(|err| panic!("{err}"));
        let seed = std::fs::read_to_string(&path).expect("seed file");
        let seed = seed.lines().find(|line| line.starts_with("SU")).expect("a seed line");
        assert!(secret.contains(&format!("  actor-{index}.nk: {seed}\n")), "seed of actor-{index}");
        assert!(secret.contains(&format!("  actor-{index}-nkey: {}\n", identity.public_key())), "key of actor-{index}");
    }
}

#[test]
fn learner_and_actor_users_can_do_their_jobs() {
    let server = repo_broker();
    let learner = learner(&server);
    learner.ensure_run(&spec()).expect("the learner creates the run");
    let mut publisher = learner.weights_publisher().expect("the learner opens the weights publisher");
    publisher.publish(weights(0)).expect("the learner publishes weights");

    let actor = actor_on(&server, RUN);
    let read = actor.read_spec().expect("the actor reads the spec").expect("stored");
    assert_eq!(read.expect("verified"), spec());
    let mut follower = actor.weights_follower(42, 300_000).expect("follower");
    let first = follower.wait_first(GUARD);
    let first = first.unwrap_or_else(|err| panic!("the actor fetches weights: {err}\n{}", violations(&server)));
    assert_eq!(first.version, PolicyVersion(0));
    let mut sink = actor
        .trajectory_sink(&ActorId::new(ACTOR).expect("valid"), Arc::new(AtomicBool::new(false)))
        .expect("the actor opens its sink");
    sink.publish((0..3).map(|i| segment(ACTOR, i)).collect()).expect("the actor publishes segments");
    sink.flush().expect("the segments are stored");

    let mut source = learner.trajectory_source().expect("the learner opens its consumer");
    let mut deliveries = Vec::new();
    while deliveries.len() < 3 {
        let received = source.recv(3, Duration::from_millis(500), &mut deliveries);
        received.unwrap_or_else(|err| panic!("the learner consumes: {err}\n{}", violations(&server)));
    }
    // Each delivery names the identity of the subject it came on, which the learner trusts.
    assert!(deliveries.iter().all(|d| d.subject_actor.as_deref() == Some(ACTOR)), "{deliveries:?}");
    let tokens: Vec<_> = deliveries.iter().map(|d| d.token).collect();
    source.ack(&tokens).expect("the learner acks");
    let live_before = follower.live_received();
    publisher.publish(weights(1)).expect("the learner publishes the next version");
    // Until the live frame is reassembled, so it is the one taken: a follower takes a waiting
    // live frame before it looks at the pointer. (After a fixed sleep instead, a loaded
    // machine could take v1 from the pointer before its live frame was complete.)
    let started = std::time::Instant::now();
    while follower.live_received() == live_before {
        assert!(started.elapsed() < GUARD, "v1's live frame never arrived\n{}", violations(&server));
        thread::sleep(Duration::from_millis(10));
    }
    let newest = within_guard("following v1", move || loop {
        if let Some(newest) = follower.latest(Some(PolicyVersion(0))).expect("the actor follows") {
            return (newest.version, follower.is_live(), follower.live_applied());
        }
        thread::sleep(Duration::from_millis(10));
    });
    assert_eq!(newest.0, PolicyVersion(1));
    // The actor user may receive the learner's live weights: v1 came by fan-out.
    assert!(newest.1, "the actor follows the live subject");
    assert!(newest.2 >= 1, "v1 came live ({} versions taken live)", newest.2);

    // The pointer path alone (issue 46 item 4), as an actor that missed the live chunks:
    // notices on the key's subject, direct gets of the pointer and of each object's chunks,
    // no consumer; three more versions, as identity `actor-1` over TLS.
    let mut durable_config = config_as(&server, RUN, actor_identity(1).auth());
    durable_config.weights_live = false;
    let durable_actor = NatsBus::connect(durable_config).expect("actor-1 connects");
    let mut durable = durable_actor.weights_follower(42, 300_000).expect("follower");
    assert!(!durable.is_live());
    let first = durable.wait_first(GUARD).unwrap_or_else(|err| panic!("{err}\n{}", violations(&server)));
    assert_eq!(first.version, PolicyVersion(1));
    for version in 2..=4 {
        publisher.publish(weights(version)).expect("the learner publishes");
        let next = durable.wait_newer(Some(PolicyVersion(version - 1)), GUARD);
        let next = next.unwrap_or_else(|err| panic!("v{version}: {err}\n{}", violations(&server)));
        assert_eq!(next.map(|w| w.version), Some(PolicyVersion(version)), "v{version} within {GUARD:?}");
    }
    assert_eq!(durable.durable_fetches(), 4);
    assert_eq!((durable.refusals(), durable.live_applied()), (0, 0));
    assert_no_violations(&server);
}

/// Save-load and budget assignment with the repo's permissions: the learner creates the work
/// queue and snapshot store and plans items; the actor takes an item, saves and reloads a
/// snapshot through the index, and completes the item; the actor cannot plan work itself.
#[test]
fn work_queue_and_snapshots_work_with_role_credentials() {
    use volley_core::work::{EpisodeSnapshot, Start, WorkConfig, WorkItem};
    use volley_transport::work::{SnapshotStore, WorkQueue, WorkSource};
    let server = repo_broker();
    let learner = learner(&server);
    let mut spec = spec();
    spec.hyper.work = WorkConfig { enabled: true, ..WorkConfig::default() };
    learner
        .ensure_run(&spec)
        .unwrap_or_else(|err| panic!("the learner creates the run: {err}\n{}", violations(&server)));
    let mut queue = learner.work_queue(&spec.hyper.work).expect("the learner opens the work queue");
    let item = WorkItem { id: 9, task_id: 0, start: Start::Fresh { seed: 1 }, episodes: 1, group: None };
    queue.submit(std::slice::from_ref(&item)).unwrap_or_else(|err| panic!("plan: {err}\n{}", violations(&server)));

    let actor = actor_on(&server, RUN);
    let mut source = actor
        .work_source(&ActorId::new(ACTOR).expect("valid"))
        .unwrap_or_else(|err| panic!("work source: {err}\n{}", violations(&server)));
    let (taken, token) = source
        .take(Duration::from_secs(5))
        .unwrap_or_else(|err| panic!("take: {err}\n{}", violations(&server)))
        .expect("the planned item");
    assert_eq!(taken, item);
    let mut store = actor.snapshot_store().unwrap_or_else(|err| panic!("store: {err}\n{}", violations(&server)));
    let snapshot = EpisodeSnapshot {
        work_item: 9,
        episode_index: 0,
        task_id: 0,
        origin: None,
        env: vec![1, 2, 3],
        hidden: vec![],
        episode_return: 1.0,
        episode_len: 5,
        policy_version: volley_core::ids::PolicyVersion(0),
        rng: rand_pcg::Pcg64Mcg::new(7),
        progress: 0.0,
    };
    let key = store.save(&snapshot).unwrap_or_else(|err| panic!("save: {err}\n{}", violations(&server)));
    assert_eq!(store.latest_for_item(9).expect("index").as_deref(), Some(key.as_str()));
    assert_eq!(store.load(&key).expect("load"), Some(snapshot));
    source.progress(token).expect("progress");
    source.complete(token).unwrap_or_else(|err| panic!("complete: {err}\n{}", violations(&server)));
    assert_no_violations(&server);

    // The actor may not run a work dispatcher (issue 46): its subscriptions to the lease
    // subjects are denied, so opening the queue fails or its submit is denied.
    let work = spec.hyper.work.clone();
    let denied = within_guard("actor planning work", move || actor.work_queue(&work)?.submit(&[item]));
    assert!(denied.is_err(), "the actor planned work");
}

#[test]
fn actor_user_is_denied_weights_writes_and_other_runs() {
    let server = repo_broker();
    let learner = learner(&server);
    learner.ensure_run(&spec()).expect("the learner creates the run");
    let actor = actor_on(&server, RUN);

    // Weights through the transport: even opening the publisher is refused (it lists the
    // store through an unnamed consumer, issue 12), and a direct object put is refused too.
    let opened = within_guard("actor opening the weights publisher", {
        let actor = actor_on(&server, RUN);
        move || actor.weights_publisher().map(|_| ())
    });
    assert!(opened.is_err(), "the actor opened the weights publisher");
    assert!(has_violation(&server, "$JS.API.CONSUMER.CREATE.OBJ_volley-local-wts"), "{}", server.log());
    let denied_object = actor.block_on(async {
        let store = actor
            .jetstream()
            .get_object_store(subjects::weights_bucket(&actor.config().run))
            .await
            .expect("store opens");
        store.put(subjects::weights_object(5).as_str(), &mut &b"forged"[..]).await
    });
    assert!(denied_object.is_err(), "the actor wrote a weights object");

    // The weights pointer straight in KV, and deleting the stream.
    let denied_put = actor.block_on(async {
        let kv = actor.jetstream().get_key_value(subjects::run_bucket(&actor.config().run)).await.expect("kv opens");
        kv.put(subjects::WEIGHTS_KEY, Bytes::from_static(b"{}")).await
    });
    assert!(denied_put.is_err(), "the actor wrote the weights pointer");
    let denied_delete = actor
        .block_on(async { actor.jetstream().delete_stream(subjects::trajectory_stream(&actor.config().run)).await });
    assert!(denied_delete.is_err(), "the actor deleted the trajectory stream");

    // Another run's trajectory subject: the sink gives up with a denial instead of retrying.
    let other = actor_on(&server, "other");
    let mut sink = other
        .trajectory_sink(&ActorId::new(ACTOR).expect("valid"), Arc::new(AtomicBool::new(false)))
        .expect("opening the sink sends nothing");
    let result = within_guard("publish to another run", move || {
        sink.publish(vec![segment(ACTOR, 0)])?;
        sink.flush()
    });
    assert_denied("actor publishing to another run", result);

    // The live weights subject: the actor may receive, never send.
    let live = subjects::weights_live(&actor.config().run);
    let client = actor.client().clone();
    actor.block_on(async move {
        client.publish(live, Bytes::from_static(b"forged")).await.expect("handed to the client");
        client.flush().await.expect("flushed");
    });
    assert_violation(&server, "volley.local.weights.live");

    // Pace notices: the actor may receive them, never send one (a forged notice could let
    // actors overfill the learner's backlog until a consumer reading contradicts it).
    let pace = subjects::pace(&actor.config().run);
    let client = actor.client().clone();
    actor.block_on(async move {
        let notice = volley_core::wire::pace::encode_pace_notice(&volley_core::wire::pace::PaceNotice {
            taken: 1 << 40,
            stored: 1 << 40,
            prefetch: 2,
        });
        client.publish(pace, Bytes::copy_from_slice(&notice)).await.expect("handed to the client");
        client.flush().await.expect("flushed");
    });
    assert_violation(&server, "volley.local.pace");

    let log = server.log();
    for subject in ["$KV.volley-local.weights", "$JS.API.STREAM.DELETE.volley-local-traj", "volley.other.traj.actor-0"]
    {
        assert!(
            log.contains(&format!("Publish Violation - Subject \"{subject}\"")),
            "no violation for {subject}:\n{log}"
        );
    }
    assert!(log.contains("Subject \"$O.volley-local-wts."), "no violation for the object store:\n{log}");
}

#[test]
fn learner_user_cannot_publish_trajectories() {
    let server = repo_broker();
    let learner = learner(&server);
    learner.ensure_run(&spec()).expect("the learner creates the run");
    let mut sink = learner
        .trajectory_sink(&ActorId::new("a1").expect("valid"), Arc::new(AtomicBool::new(false)))
        .expect("opening the sink sends nothing");
    let result = within_guard("learner publishing trajectories", move || {
        sink.publish(vec![segment("a1", 0)])?;
        sink.flush()
    });
    assert_denied("learner publishing trajectories", result);
}

#[test]
fn wrong_password_fails_fast_with_a_clear_error() {
    let server = repo_broker();
    let mut config = config(&server, RUN, "learner-local", "not-the-password");
    config.connect_timeout = GUARD;
    let err = within_guard("connect", move || NatsBus::connect(config).expect_err("a wrong password"));
    let message = err.to_string();
    assert!(message.contains("refused user learner-local"), "{message}");
    assert!(!message.contains("not-the-password"), "the password leaked into {message}");
}

/// Issue 46 item 3: the shared actor user is gone, and an NKey the config does not name (an
/// identity made for another broker, or by an attacker) is refused at once.
#[test]
fn an_unknown_actor_identity_or_the_old_shared_actor_user_is_refused() {
    use volley_transport::nats::identity::ActorIdentity;
    let server = repo_broker();
    let stranger = ActorIdentity::generate(ActorId::new(ACTOR).expect("valid")).expect("an identity");
    let mut unknown = config_as(&server, RUN, stranger.auth());
    unknown.connect_timeout = GUARD;
    let err = within_guard("connect", move || NatsBus::connect(unknown).expect_err("an unknown nkey"));
    assert!(err.to_string().contains("refused nkey identity actor-0"), "{err}");
    let mut shared = config(&server, RUN, "actor-local", "actor-test-password");
    shared.connect_timeout = GUARD;
    let err = within_guard("connect", move || NatsBus::connect(shared).expect_err("no shared actor user"));
    assert!(err.to_string().contains("refused user actor-local"), "{err}");
}

/// Issue 46 item 3: an actor identity publishes and leases under its own id only. Before,
/// every actor connected as `actor-<run>`, which could publish on `volley.<run>.traj.>`, so
/// one client published under any number of ids; here `actor-0` is denied every subject of
/// `actor-1` (segments, the three work-lease verbs, its inboxes) next to its own, granted.
#[test]
fn actor_a_cannot_publish_or_lease_under_actor_bs_subjects() {
    let server = repo_broker();
    let learner = learner(&server);
    learner.ensure_run(&spec()).expect("the learner creates the run");
    let actor = actor_on(&server, RUN);
    let run = actor.config().run.clone();
    let (me, other) = (ActorId::new(ACTOR).expect("valid"), ActorId::new("actor-1").expect("valid"));

    // Its own trajectory subject: granted. Another's, through the real sink: a denial.
    let mut own = actor.trajectory_sink(&me, Arc::new(AtomicBool::new(false))).expect("sink");
    within_guard("publish as itself", move || {
        own.publish(vec![segment(ACTOR, 0)])?;
        own.flush()
    })
    .unwrap_or_else(|err| panic!("actor-0 publishes as itself: {err}\n{}", violations(&server)));
    assert_no_violations(&server);
    let mut forged = actor.trajectory_sink(&other, Arc::new(AtomicBool::new(false))).expect("sink");
    let result = within_guard("publish as another actor", move || {
        forged.publish(vec![segment("actor-1", 0)])?;
        forged.flush()
    });
    assert_denied("actor-0 publishing as actor-1", result);

    // Work-lease signals and inboxes of the other actor: denied; its own: granted.
    let client = actor.client().clone();
    let (own_take, other_subjects) = (
        subjects::work_lease(&run, "take", &me),
        subjects::WORK_LEASE_VERBS.map(|verb| subjects::work_lease(&run, verb, &other)),
    );
    let signals = other_subjects.clone();
    actor.block_on(async move {
        client.publish(own_take, Bytes::new()).await.expect("sent");
        for subject in signals {
            client.publish(subject, Bytes::from_static(b"1")).await.expect("sent");
        }
        let _other_inbox = client.subscribe("_INBOX_actor-1.>").await.expect("sent");
        let _own_inbox = client.subscribe("_INBOX_actor-0.x").await.expect("sent");
        client.flush().await.expect("flushed");
    });
    for subject in other_subjects.iter().map(String::as_str).chain(["_INBOX_actor-1.>"]) {
        assert_violation(&server, subject);
    }
    for granted in ["volley.local.work.take.actor-0", "_INBOX_actor-0.x"] {
        assert!(!has_violation(&server, granted), "{granted} was denied:\n{}", violations(&server));
    }
}

/// Whether the server logged a violation for `subject` (publish or subscription).
fn has_violation(server: &TestNats, subject: &str) -> bool {
    server.log().lines().any(|line| line.contains("Violation") && line.contains(&format!("\"{subject}\"")))
}

/// Poll the server log until it shows a violation for `subject` (bounded by [`GUARD`]).
fn assert_violation(server: &TestNats, subject: &str) {
    let started = std::time::Instant::now();
    while !has_violation(server, subject) {
        assert!(started.elapsed() < GUARD, "no violation for {subject}:\n{}", server.log());
        thread::sleep(Duration::from_millis(20));
    }
}

/// A raw JetStream API request as `bus`'s user: the server's JSON answer, or `None` when the
/// request was dropped (denied by permissions: the request times out).
fn js_request(bus: &NatsBus, subject: &str, body: serde_json::Value) -> Option<serde_json::Value> {
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
fn push_consumer(stream: &str, name: &str, filter: &str, deliver: &str) -> serde_json::Value {
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

/// Issue 46 item 4: an actor may create no consumer on any stream, since a push consumer's
/// deliver subject is not checked by NATS: a consumer aimed at the live weights or pace subject,
/// or at another actor's inbox, would have the server relay stream messages there. Every create
/// (push or pull, named or not, the old durable API) and delete is denied by the broker, as are
/// flow-control replies; and the actor's reads without a consumer are granted next to them: the
/// pointer by direct get, notices of new pointers on the key's subject, the weights chunks by
/// direct gets. Before this change the named creates on the run bucket and the weights store
/// were granted (issue 12), so the relay creates of this test were answered.
#[test]
fn actors_may_create_no_consumer_and_read_by_gets_and_notices() {
    let server = repo_broker();
    let (learner, _queue) = learner_with_work_run(&server);
    let mut publisher = learner.weights_publisher().expect("publisher");
    publisher.publish(weights(0)).expect("v0");
    let actor = actor_on(&server, RUN);
    let run = RunId::new(RUN).expect("valid");

    // Denied: every consumer create, whatever it delivers to, on every stream of the run.
    let own_inbox = actor.client().new_inbox();
    let relay_targets = [subjects::weights_live(&run), subjects::pace(&run), "_INBOX_actor-1.relay".to_string()];
    let streams = [
        ("KV_volley-local", "$KV.volley-local.weights"),
        ("OBJ_volley-local-wts", "$O.volley-local-wts.C.abc"),
        ("OBJ_volley-local-snap", "$O.volley-local-snap.C.abc"),
        ("KV_volley-local-snapidx", "$KV.volley-local-snapidx.1"),
        ("volley-local-traj", "volley.local.traj.actor-0"),
        ("volley-local-work", "volley.local.work"),
    ];
    let mut denied = Vec::new();
    for (stream, filter) in streams {
        // Push consumers delivering onto the learner's subjects and another actor's inbox.
        for (idx, deliver) in relay_targets.iter().enumerate() {
            let create = format!("$JS.API.CONSUMER.CREATE.{stream}.relay{idx}.{filter}");
            denied.push((create, push_consumer(stream, &format!("relay{idx}"), filter, deliver)));
        }
        // An ordered consumer as async-nats makes one (unnamed, to the actor's own inbox).
        denied.push((format!("$JS.API.CONSUMER.CREATE.{stream}"), push_consumer(stream, "", filter, &own_inbox)));
        // Pull consumers: named, and through the older durable API.
        let mut pull = push_consumer(stream, "pull", filter, "");
        pull["config"].as_object_mut().expect("an object").remove("deliver_subject");
        pull["config"]["ack_policy"] = "explicit".into();
        denied.push((format!("$JS.API.CONSUMER.CREATE.{stream}.pull.{filter}"), pull.clone()));
        pull["config"]["durable_name"] = "pull".into();
        denied.push((format!("$JS.API.CONSUMER.DURABLE.CREATE.{stream}.pull"), pull));
        denied.push((format!("$JS.API.CONSUMER.DELETE.{stream}.learner"), serde_json::json!({})));
    }
    denied.push(("$JS.FC.KV_volley-local.relay0.1".to_string(), serde_json::json!({})));
    let requests = denied.clone();
    let client = actor.client().clone();
    actor.block_on(async move {
        for (subject, body) in requests {
            let reply = client.new_inbox();
            let body = Bytes::from(serde_json::to_vec(&body).expect("json"));
            client.publish_with_reply(subject, reply, body).await.expect("handed to the client");
        }
        client.flush().await.expect("flushed");
    });
    for (subject, _) in &denied {
        assert_violation(&server, subject);
    }
    // Granted: the pointer's last message, the first weights chunk (the next message on the
    // store's chunk subjects), and the notices on the pointer key's subject.
    let pointer = raw_request(&actor, "$JS.API.DIRECT.GET.KV_volley-local.$KV.volley-local.weights", Bytes::new())
        .unwrap_or_else(|| panic!("the pointer get was not answered:\n{}", violations(&server)));
    assert!(pointer.status.is_none(), "{pointer:?}");
    assert!(serde_json::from_slice::<serde_json::Value>(&pointer.payload).is_ok_and(|p| p["version"] == 0));
    let next_chunk = serde_json::json!({ "seq": 1, "next_by_subj": "$O.volley-local-wts.C.>" });
    let chunk = raw_request(&actor, "$JS.API.DIRECT.GET.OBJ_volley-local-wts", Bytes::from(next_chunk.to_string()))
        .unwrap_or_else(|| panic!("the chunk get was not answered:\n{}", violations(&server)));
    let subject = chunk.headers.as_ref().and_then(|headers| headers.get("Nats-Subject")).map(|s| s.to_string());
    assert!(subject.is_some_and(|s| s.starts_with("$O.volley-local-wts.C.")), "{:?}", chunk.headers);
    assert!(!chunk.payload.is_empty());
    let notices = actor.block_on({
        let client = actor.client().clone();
        async move {
            let notices = client.subscribe("$KV.volley-local.weights").await.expect("sent");
            client.flush().await.expect("flushed");
            notices
        }
    });
    publisher.publish(weights(1)).expect("v1");
    let notice = actor.block_on(async move {
        let mut notices = notices;
        tokio::time::timeout(GUARD, futures::StreamExt::next(&mut notices)).await
    });
    assert!(notice.is_ok_and(|notice| notice.is_some()), "no notice of v1's pointer");
    for granted in [
        "$JS.API.DIRECT.GET.KV_volley-local.$KV.volley-local.weights",
        "$JS.API.DIRECT.GET.OBJ_volley-local-wts",
        "$KV.volley-local.weights",
    ] {
        assert!(!has_violation(&server, granted), "{granted} was denied:\n{}", violations(&server));
    }

    // And through async-nats' own API: its KV watch creates an unnamed ordered consumer.
    let watched = within_guard("an actor's KV watch", {
        let actor = actor_as(&server, RUN, 1);
        move || {
            actor.block_on(async {
                let kv = actor.jetstream().get_key_value("volley-local").await.expect("kv opens");
                tokio::time::timeout(Duration::from_secs(10), kv.watch("weights")).await.map(|watch| watch.is_ok())
            })
        }
    });
    assert!(!matches!(watched, Ok(true)), "the actor created a KV watch");
}

/// Issue 46 item 4: notices on the pointer key's subject only make a follower quicker. With
/// that subscription denied (a broker config that predates it; or every notice lost), an actor
/// identity still follows each version, through its periodic reads of the pointer.
#[test]
fn an_actor_without_pointer_notices_still_follows_every_version() {
    let accounts = std::fs::read_to_string(repo_file("broker-config/accounts.conf")).expect("read accounts.conf");
    let without_notices = accounts.replace(", \"$KV.volley-local.weights\"] }", "] }");
    assert_ne!(without_notices, accounts, "the notice grant is where the test expects it");
    let environment = repo_broker_environment();
    let server = TestNats::start_with_config(
        &without_notices,
        &environment.iter().map(|(k, v)| (k.as_str(), v.as_str())).collect::<Vec<_>>(),
    );
    let learner = learner(&server);
    learner.ensure_run(&spec()).expect("the learner creates the run");
    let mut publisher = learner.weights_publisher().expect("publisher");
    publisher.publish(weights(0)).expect("v0");
    let mut config = config_as(&server, RUN, actor_identity(2).auth());
    config.weights_live = false;
    let actor = NatsBus::connect(config).expect("actor-2 connects");
    let mut follower = actor.weights_follower(42, 300_000).expect("follower");
    assert_eq!(follower.wait_first(GUARD).expect("v0").version, PolicyVersion(0));
    for version in 1..=3 {
        publisher.publish(weights(version)).expect("the learner publishes");
        let next = follower.wait_newer(Some(PolicyVersion(version - 1)), GUARD).expect("no error");
        assert_eq!(next.map(|w| w.version), Some(PolicyVersion(version)), "v{version} within {GUARD:?}");
    }
    assert_violation(&server, "$KV.volley-local.weights");
    assert_eq!(follower.refusals(), 0);
}

/// Issue 46: nats-server checks no request's reply subject, and JetStream answers a direct get
/// with the stored message itself, so an actor that could direct-get bytes it wrote into the
/// snapshot store could have the server store them on another actor's trajectory subject (or
/// any subject a stream captures) as if that actor had published them. The snapshot store and
/// its index now allow no direct gets, and the actor user may not send one there; its message
/// gets, still granted, are answered with a JSON document, which is what such a relay stores.
#[test]
fn an_actor_cannot_relay_bytes_it_wrote_through_a_get_answer() {
    let server = repo_broker();
    let (learner, _queue) = learner_with_work_run(&server);
    let actor = actor_on(&server, RUN);
    let forged: &[u8] = b"VOLLEY-FORGED-SEGMENT-OF-ACTOR-1";
    let client = actor.client().clone();
    let sequence = actor.block_on(async move {
        let js = async_nats::jetstream::new(client);
        let ack = js.publish("$O.volley-local-snap.C.forged", Bytes::from_static(forged)).await.expect("sent");
        ack.await.expect("stored").sequence
    });
    let victim = "volley.local.traj.actor-1";
    let client = actor.client().clone();
    let get = Bytes::from(serde_json::json!({ "seq": sequence }).to_string());
    actor.block_on(async move {
        for subject in ["$JS.API.DIRECT.GET.OBJ_volley-local-snap", "$JS.API.STREAM.MSG.GET.OBJ_volley-local-snap"] {
            client.publish_with_reply(subject, victim, get.clone()).await.expect("sent");
        }
        let last = "$JS.API.DIRECT.GET.OBJ_volley-local-snap.$O.volley-local-snap.C.forged";
        client.publish_with_reply(last, victim, Bytes::new()).await.expect("sent");
        client.flush().await.expect("flushed");
    });
    assert_violation(&server, "$JS.API.DIRECT.GET.OBJ_volley-local-snap");
    assert_violation(&server, "$JS.API.DIRECT.GET.OBJ_volley-local-snap.$O.volley-local-snap.C.forged");
    // The stores actors write allow no direct gets.
    learner.block_on({
        let client = learner.client().clone();
        async move {
            let js = async_nats::jetstream::new(client);
            for stream in ["OBJ_volley-local-snap", "KV_volley-local-snapidx"] {
                let info = js.get_stream(stream).await.expect("stream").info().await.expect("info").config.clone();
                assert!(!info.allow_direct, "{stream} allows direct gets");
            }
        }
    });
    // What reached the victim's subject: the message get's JSON answer, which the learner
    // cannot decode as a segment, never the actor's bytes.
    let mut source = learner.trajectory_source().expect("the learner opens its consumer");
    let mut deliveries = Vec::new();
    let started = std::time::Instant::now();
    while deliveries.is_empty() {
        assert!(started.elapsed() < GUARD, "nothing reached {victim}");
        source.recv(8, Duration::from_millis(200), &mut deliveries).expect("the learner consumes");
    }
    assert_eq!(deliveries.len(), 1, "{deliveries:?}");
    assert_eq!(deliveries[0].subject_actor.as_deref(), Some("actor-1"));
    assert!(deliveries[0].segment.is_err(), "a get answer decoded as a segment: {:?}", deliveries[0].segment);
}

/// A raw request as `bus`'s user: the answer, or `None` when none came (a denied request is
/// dropped by the server).
fn raw_request(bus: &NatsBus, subject: &str, body: Bytes) -> Option<async_nats::Message> {
    let client = bus.client().clone();
    let subject = subject.to_string();
    bus.block_on(
        async move { tokio::time::timeout(Duration::from_secs(2), client.request(subject, body)).await.ok()?.ok() },
    )
}

/// Issue 12: the environment server user `env-<service>` serves its service (endpoints, the
/// `$SRV` verbs, replies) and nothing else; actors and the learner may discover and call it
/// but not serve it.
#[test]
fn env_server_user_serves_its_service_and_nothing_else() {
    use volley_transport::envsvc::protocol::Op;
    use volley_transport::envsvc::{
        connect_env_server, EnvFactory, EnvServer, EnvServerConfig, EnvServiceClient, EnvServiceName,
    };
    let server = repo_broker();
    let auth = |user: &str, password: &str| NatsAuth::UserPassword { user: user.into(), password: password.into() };
    let runtime = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().expect("runtime");
    let env_user = auth(&format!("env-{ENV_SERVICE}"), ENV_PASSWORD);
    let timeout = Duration::from_secs(5);
    let env_client = runtime
        .block_on(connect_env_server(
            &server.url(),
            Some(&env_user),
            &NatsTls::with_ca(server.ca_file()),
            timeout,
            timeout,
        ))
        .expect("the env server connects");
    let factory: EnvFactory = Arc::new(|| volley_env::EnvConfig::Cartpole.build());
    let name = EnvServiceName::new(ENV_SERVICE).expect("valid");
    let env_server = runtime
        .block_on(EnvServer::start(env_client.clone(), factory.clone(), EnvServerConfig::new(name.clone(), "cartpole")))
        .expect("the env server starts");

    // Actors step it, the learner asks it for the spaces.
    for (user, credentials) in
        [(ACTOR, actor_identity(0).auth()), ("learner-local", auth("learner-local", LEARNER_PASSWORD))]
    {
        let client = EnvServiceClient::connect(
            &server.url(),
            Some(&credentials),
            &NatsTls::with_ca(server.ca_file()),
            timeout,
            timeout,
        )
        .unwrap_or_else(|err| panic!("{user} connects: {err}"));
        let instances = client.block_on(client.discover(&name)).expect("discovery");
        assert_eq!(instances.len(), 1, "{user} finds the server:\n{}", violations(&server));
        let spaces = client.block_on(client.spaces(&instances[0])).expect("spaces");
        assert_eq!((spaces.obs_dim, spaces.n_actions), (4, 2));
        let opened = client.block_on(client.open(&instances[0], &[1, 2])).expect("open");
        let stepped = client
            .block_on(client.step(
                &instances[0],
                opened.session,
                volley_transport::envsvc::protocol::StepActions::Discrete(vec![0, 1]),
            ))
            .expect("step");
        assert_eq!(stepped.rewards, vec![1.0; 2]);
        client.block_on(client.close(&instances[0], opened.session)).expect("close");
        assert_eq!(
            instances[0].subject(Op::Step).as_str(),
            format!("volley.env.{ENV_SERVICE}.{}.step", env_server.id())
        );
    }
    // Stopping uses its own inbox prefix: no violation, and it returns well before the
    // barrier's 5-second cap.
    let started = std::time::Instant::now();
    runtime.block_on(env_server.stop());
    assert!(started.elapsed() < Duration::from_secs(4), "the stop barrier was not answered");
    assert_no_violations(&server);

    // Denied next to the grants: the run's data, replies meant for others, other services.
    runtime.block_on(async {
        env_client.publish("volley.local.traj.a1", Bytes::from_static(b"x")).await.expect("sent");
        env_client.publish("$JS.API.INFO", Bytes::new()).await.expect("sent");
        let _inbox = env_client.subscribe("_INBOX.>").await.expect("sent");
        let _other = env_client.subscribe("volley.env.other.>").await.expect("sent");
        env_client.flush().await.expect("flushed");
    });
    for subject in ["volley.local.traj.a1", "$JS.API.INFO", "_INBOX.>", "volley.env.other.>"] {
        assert_violation(&server, subject);
    }
    let other = EnvServerConfig::new(EnvServiceName::new("other").expect("valid"), "cartpole");
    let _impostor = runtime.block_on(EnvServer::start(env_client.clone(), factory, other));
    assert_violation(&server, "$SRV.PING.volley-env-other");

    // Actors may call the service but not serve it.
    let actor = actor_on(&server, RUN);
    actor.block_on(async {
        let _serve = actor.client().subscribe(format!("volley.env.{ENV_SERVICE}.>")).await.expect("sent");
        actor.client().flush().await.expect("flushed");
    });
    assert_violation(&server, &format!("volley.env.{ENV_SERVICE}.>"));
}

/// Issue 46: each role reads its own inboxes only. The transport connects a user with the
/// private inbox prefix `_INBOX_<user>` (`NatsAuth::inbox_prefix`), and the config grants each
/// user that prefix alone: before, learner and actors shared `_INBOX.>` and an actor read the
/// learner's replies (17,406 messages in 3 s). Their jobs run with no violation on the private
/// prefixes (`learner_and_actor_users_can_do_their_jobs`); here, the grants next to the denials.
#[test]
fn each_role_subscribes_to_its_own_private_inboxes_only() {
    let server = repo_broker();
    let learner = learner(&server);
    let actor = actor_on(&server, RUN);
    assert!(actor.client().new_inbox().starts_with("_INBOX_actor-0."), "{}", actor.client().new_inbox());
    assert!(learner.client().new_inbox().starts_with("_INBOX_learner-local."));
    // The server names an NKey user by its public key in violations.
    let actor_key = actor_identity(0).public_key().to_string();
    let cases = [
        (&actor, actor_key.as_str(), "_INBOX_actor-0.>", ["_INBOX.>", "_INBOX_learner-local.>", "_INBOX_actor-1.abc"]),
        (&learner, "learner-local", "_INBOX_learner-local.>", ["_INBOX.>", "_INBOX_actor-0.>", "_INBOX_actor-0.abc"]),
    ];
    for (bus, user, granted, denied) in cases {
        let client = bus.client().clone();
        bus.block_on(async move {
            let _granted = client.subscribe(granted).await.expect("sent");
            for subject in denied {
                let _denied = client.subscribe(subject).await.expect("sent");
            }
            client.flush().await.expect("flushed");
        });
        for subject in denied {
            assert_violation(&server, subject);
        }
        let own = violations(&server)
            .lines()
            .any(|line| line.contains(&format!("user:{user}\"")) && line.contains(&format!("\"{granted}\"")));
        assert!(!own, "{granted} was denied to {user}:\n{}", violations(&server));
    }
}

/// Issue 46, relays: NATS checks no permission on a push consumer's deliver subject, so an
/// actor that may create a consumer can make the server deliver stream messages on the
/// learner's live weights or pace subject; 4 of 4 such relays reached every actor. Now the
/// actor may create no consumer (`actors_may_create_no_consumer_and_read_by_gets_and_notices`;
/// before, these creates on the weights store were answered), but NATS checks no request's
/// reply subject either, so the answer to an actor's direct get can still be sent there, and a
/// leaked learner credential can still create a relay consumer. Both kinds of message carry
/// what no learner publish does (a consumer's `$JS.ACK` reply subject, a get answer's
/// `Nats-Stream` headers), and followers and sinks refuse and count them: here a well-formed
/// live frame for the next version and a well-formed pace notice (written into the weights
/// store with learner credentials), which a follower would otherwise take.
#[test]
fn relays_onto_the_learners_subjects_are_denied_or_refused_on_receipt() {
    use volley_core::wire::{frame, live, pace};
    let server = repo_broker();
    let learner = learner(&server);
    learner.ensure_run(&spec()).expect("the learner creates the run");
    let mut publisher = learner.weights_publisher().expect("publisher");
    publisher.publish(weights(0)).expect("v0");
    let actor = actor_on(&server, RUN);
    let mut follower = actor.weights_follower(42, 300_000).expect("follower");
    assert_eq!(follower.wait_first(GUARD).expect("v0").version, PolicyVersion(0));
    assert!(follower.is_live());
    let sink =
        actor.trajectory_sink(&ActorId::new(ACTOR).expect("valid"), Arc::new(AtomicBool::new(false))).expect("sink");

    let stream = "OBJ_volley-local-wts";
    let forged = Weights::new(PolicyVersion(1), 42, vec![0.5; 300_000]);
    let full = frame::encode_full_frame(&forged);
    let (header, _) = frame::decode_frame_header(&full).expect("a frame");
    let chunks = live::encode_live_chunks(&full, &header, 100_000);
    let notice = pace::encode_pace_notice(&pace::PaceNotice { taken: 0, stored: 0, prefetch: 1 });
    let run = RunId::new(RUN).expect("valid");
    let relays = [
        ("relay1", subjects::weights_live(&run), chunks.clone()),
        ("relay2", subjects::pace(&run), vec![notice.to_vec(); 3]),
    ];
    // The attacker: actor credentials, its own connection, and bytes in the store.
    let attacker = actor_as(&server, RUN, 1);
    for (name, deliver, payloads) in relays {
        let filter = format!("$O.volley-local-wts.C.{name}");
        let client = learner.client().clone();
        let subject = filter.clone();
        let sequences = learner.block_on(async move {
            let js = async_nats::jetstream::new(client);
            let mut sequences = Vec::new();
            for payload in payloads {
                let ack = js.publish(subject.clone(), Bytes::from(payload)).await.expect("sent").await;
                sequences.push(ack.expect("stored").sequence);
            }
            sequences
        });
        let create = format!("$JS.API.CONSUMER.CREATE.{stream}.{name}.{filter}");
        let relay = push_consumer(stream, name, &filter, &deliver);
        assert!(js_request(&attacker, &create, relay.clone()).is_none(), "the actor created a relay consumer");
        assert_violation(&server, &create);
        // A leaked learner credential can: its deliveries are refused on receipt.
        let answer = js_request(&learner, &create, relay)
            .unwrap_or_else(|| panic!("{create} was not answered:\n{}", violations(&server)));
        assert!(answer.get("error").is_none(), "the learner creates the relay consumer: {answer}");
        // The actor's own gets, answered onto the learner's subject: refused on receipt too.
        let client = attacker.client().clone();
        attacker.block_on(async move {
            for sequence in sequences {
                let get = Bytes::from(serde_json::json!({ "seq": sequence }).to_string());
                client
                    .publish_with_reply(format!("$JS.API.DIRECT.GET.{stream}"), deliver.clone(), get)
                    .await
                    .expect("sent");
            }
            client.flush().await.expect("flushed");
        });
    }
    let n_chunks = chunks.len() as u64;
    let outcome = within_guard("the relayed messages arriving", move || loop {
        let pace_refused = sink.pace_notices().refused;
        if follower.live_chunks_refused() >= 2 * n_chunks && pace_refused >= 6 {
            let latest = follower.latest(Some(PolicyVersion(0))).expect("no error").map(|w| w.version);
            return (follower.live_received(), latest, follower.verified_version(), sink.pace_notices().used);
        }
        thread::sleep(Duration::from_millis(10));
    });
    assert_eq!(outcome, (0, None, Some(PolicyVersion(0)), 0), "(frames reassembled, taken, held, notices used)");
}

/// Have the server answer `request` (sent by `bus`'s user with `body`) onto `reply`.
fn relay(bus: &NatsBus, request: &str, body: Bytes, reply: &str) {
    let client = bus.client().clone();
    let (request, reply) = (request.to_string(), reply.to_string());
    bus.block_on(async move {
        client.publish_with_reply(request, reply, body).await.expect("sent");
        client.flush().await.expect("flushed");
    });
}

/// The revision of the run bucket's newest value of `key`, read as `bus`'s user.
fn run_key_revision(bus: &NatsBus, key: &str) -> Option<u64> {
    let client = bus.client().clone();
    let key = key.to_string();
    bus.block_on(async move {
        let js = async_nats::jetstream::new(client);
        let kv = js.get_key_value(subjects::run_bucket(&RunId::new(RUN).expect("valid"))).await.expect("bucket");
        kv.entry(key).await.expect("entry").map(|entry| entry.revision)
    })
}

/// Wait (bounded by [`GUARD`]) until the run bucket's `key` has a revision other than `before`.
fn wait_for_new_revision(bus: &NatsBus, key: &str, before: Option<u64>) {
    let started = std::time::Instant::now();
    while run_key_revision(bus, key) == before {
        assert!(started.elapsed() < GUARD, "nothing was stored under {key}");
        thread::sleep(Duration::from_millis(20));
    }
}

/// Issue 46: an actor's direct get (of the weights pointer) and message get (of the snapshot
/// index), with the run bucket's `ended` key as their reply subject, have the server store the
/// answer (the learner's pointer bytes, a JSON document) as the key's newest value. Every actor used to take any value there as the end of
/// the run and stop. Such a value is now refused (no marker), and the learner's own marker,
/// unsigned or signed, is still read as the end.
#[test]
fn answers_relayed_onto_the_ended_key_do_not_end_the_run() {
    use volley_transport::run_end::{RunEnd, RunEndReason, RunEndRefusal};
    use volley_transport::signing::WeightsSigningKey;
    let server = repo_broker();
    let (learner, _queue) = learner_with_work_run(&server);
    let mut publisher = learner.weights_publisher().expect("publisher");
    publisher.publish(weights(0)).expect("v0");
    let actor = actor_on(&server, RUN);
    assert_eq!(actor.read_run_ended(None).expect("read"), RunEnd::Ongoing);
    let ended = format!("$KV.volley-{RUN}.ended");
    let pointer = format!("$KV.volley-{RUN}.weights");

    relay(&actor, &format!("$JS.API.DIRECT.GET.KV_volley-{RUN}.{pointer}"), Bytes::new(), &ended);
    wait_for_new_revision(&learner, subjects::ENDED_KEY, None);
    assert_eq!(actor.read_run_ended(None).expect("read"), RunEnd::Refused(RunEndRefusal::Malformed));

    let before = run_key_revision(&learner, subjects::ENDED_KEY);
    // The message gets actors may send (the snapshot index) are answered with JSON documents.
    let get = Bytes::from(serde_json::json!({ "seq": 1 }).to_string());
    relay(&actor, &format!("$JS.API.STREAM.MSG.GET.KV_volley-{RUN}-snapidx"), get, &ended);
    wait_for_new_revision(&learner, subjects::ENDED_KEY, before);
    assert_eq!(actor.read_run_ended(None).expect("read"), RunEnd::Refused(RunEndRefusal::Malformed));
    assert_no_violations(&server);

    // The learner's markers: unsigned, taken by an actor without public keys only; signed,
    // taken by both, and refused under another key.
    let key = WeightsSigningKey::generate();
    let other = WeightsSigningKey::generate().public_keys();
    learner.mark_run_ended(RunEndReason::EnvStepBudget, None).expect("unsigned marker");
    assert_eq!(actor.read_run_ended(None).expect("read"), RunEnd::Ended(RunEndReason::EnvStepBudget));
    assert_eq!(actor.read_run_ended(Some(&key.public_keys())).expect("read"), RunEnd::Refused(RunEndRefusal::Unsigned));
    learner.mark_run_ended(RunEndReason::Solved, Some(&key)).expect("signed marker");
    assert_eq!(actor.read_run_ended(None).expect("read"), RunEnd::Ended(RunEndReason::Solved));
    assert_eq!(actor.read_run_ended(Some(&key.public_keys())).expect("read"), RunEnd::Ended(RunEndReason::Solved));
    assert_eq!(actor.read_run_ended(Some(&other)).expect("read"), RunEnd::Refused(RunEndRefusal::BadSignature));
}

/// Issue 46: an actor's direct get of the weights pointer answered onto the `spec` key leaves
/// actors started later unable to read the spec; the learner's check writes it again, and
/// costs no write while the key holds the spec.
#[test]
fn an_answer_relayed_onto_the_spec_key_is_undone_by_the_learner() {
    let server = repo_broker();
    let learner = learner(&server);
    let spec = spec();
    learner.ensure_run(&spec).expect("the learner creates the run");
    let stored_spec = spec.encode_stored();
    assert!(!learner.reassert_spec(&stored_spec).expect("check"), "the spec was written over itself");
    let mut publisher = learner.weights_publisher().expect("publisher");
    publisher.publish(weights(0)).expect("v0");
    let actor = actor_on(&server, RUN);
    assert!(matches!(actor.read_spec().expect("read"), Some(Ok(_))));

    let before = run_key_revision(&learner, subjects::SPEC_KEY);
    let pointer = format!("$KV.volley-{RUN}.weights");
    relay(
        &actor,
        &format!("$JS.API.DIRECT.GET.KV_volley-{RUN}.{pointer}"),
        Bytes::new(),
        &format!("$KV.volley-{RUN}.spec"),
    );
    wait_for_new_revision(&learner, subjects::SPEC_KEY, before);
    assert!(matches!(actor.read_spec().expect("read"), Some(Err(_))), "the relayed answer read as a spec");

    assert!(learner.reassert_spec(&stored_spec).expect("check"), "the learner did not write its spec again");
    assert_eq!(actor.read_spec().expect("read").expect("a spec").expect("the learner's spec"), spec);
    assert!(!learner.reassert_spec(&stored_spec).expect("check"), "the spec was written over itself");
    assert_no_violations(&server);
}
