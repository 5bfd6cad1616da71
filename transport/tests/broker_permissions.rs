//! The repo's broker config (`broker-config/`) against a real `nats-server` and the real
//! transport: the learner user `learner-local`, the actor identities `actor-<i>` (one NKey user
//! per actor, issue 46 item 3) and the environment server users can do their jobs and nothing
//! else, each reads its own inboxes only, and a denied operation comes back as a clear
//! [`TransportError`], not a hang. What an actor could still have the server deliver for it
//! (consumers, get answers relayed onto other subjects) is in `broker_relays.rs`.
//!
//! The server runs `broker-config/accounts.conf` verbatim (its text in the test's config) on a
//! loopback port, with the passwords and actor public keys it reads from the environment set to
//! test values.
//! Every allowed flow also checks that the server logged no permission violation, so a grant
//! that async-nats needs but the config lacks fails here even where the transport tolerates
//! the failure (e.g. the pacing read).

#[allow(dead_code)] // this test uses only part of the shared fixtures
mod common;
use common::roles::{
    actor_on, assert_denied, assert_no_violations, assert_violation, config, config_as, has_violation, learner,
    segment, spec, violations, weights, within_guard, ACTOR, ENV_SERVICE, GUARD, RUN,
};
use common::{actor_identity, repo_broker, repo_broker_environment, repo_file, ENV_PASSWORD, LEARNER_PASSWORD};

use std::sync::atomic::AtomicBool;
use std::sync::Arc;
use std::thread;
use std::time::Duration;

use bytes::Bytes;
use volley_core::ids::{ActorId, PolicyVersion, RunId};
use volley_core::subjects;
use volley_transport::nats::{NatsAuth, NatsBus, NatsTls};
use volley_transport::{TrajectorySink, TrajectorySource, WeightsFollower, WeightsPublisher};

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
