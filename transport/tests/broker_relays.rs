//! Relays through the repo's broker config (issue 46): NATS checks neither a push consumer's
//! deliver subject nor a request's reply subject, so an actor that may create a consumer, or
//! whose get is answered onto another subject, can have the server deliver bytes as if a learner
//! or another actor had published them. Against a real `nats-server` running
//! `broker-config/accounts.conf` and the real transport: actors may create no consumer and read
//! by gets and notices instead, the stores they write allow no direct gets, and what a relay can
//! still deliver (onto the live weights, pace, `ended` and `spec` subjects) is refused on
//! receipt or undone by the learner. Who may do what is in `broker_permissions.rs`.

#[allow(dead_code)] // this test uses only part of the shared fixtures
mod common;
use common::roles::{
    actor_as, actor_on, assert_no_violations, assert_violation, config_as, has_violation, js_request, learner,
    learner_with_work_run, push_consumer, raw_request, spec, violations, weights, within_guard, ACTOR, GUARD, RUN,
};
use common::{actor_identity, repo_broker, repo_broker_environment, repo_file};

use std::sync::atomic::AtomicBool;
use std::sync::Arc;
use std::thread;
use std::time::Duration;

use bytes::Bytes;
use volley_core::ids::{ActorId, PolicyVersion, RunId};
use volley_core::subjects;
use volley_core::wire::Weights;
use volley_testkit::TestNats;
use volley_transport::nats::NatsBus;
use volley_transport::{TrajectorySink, TrajectorySource, WeightsFollower, WeightsPublisher};

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
