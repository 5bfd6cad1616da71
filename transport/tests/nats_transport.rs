//! The NATS JetStream transport against a real `nats-server` (one per test, see
//! `volley_testkit::TestNats`): delivery, acks, redelivery, rejects, bad bytes, dedup, pacing,
//! size limits, weights, the run spec, replay and a broker restart.
//!
//! No assertion depends on timing; waits are bounded only so that a broken build fails
//! instead of hanging.

#[allow(dead_code)] // this test uses only part of the shared fixtures
mod common;

use std::collections::BTreeSet;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{mpsc, Arc};
use std::thread;
use std::time::{Duration, Instant};

use bytes::Bytes;
use common::{consumer_pending, learner_bus, stream_messages};
use futures::StreamExt;
use volley_core::ids::{ActorId, PolicyVersion, RunId};
use volley_core::spec::{RunSpec, StoreLimits};
use volley_core::subjects;
use volley_core::wire::{self, TrajectorySegment, Weights};
use volley_testkit::{TestNats, TestNatsOptions};
use volley_transport::nats::{NatsBus, NatsConfig, NatsTls, NatsTrajectorySource};
use volley_transport::{Delivery, TrajectorySink, TrajectorySource, TransportError, WeightsFollower, WeightsPublisher};

/// Bound on any wait in these tests: far above what a healthy run needs, only there so a
/// regression fails instead of hanging.
const GUARD: Duration = Duration::from_secs(60);

fn run(name: &str) -> RunId {
    RunId::new(name).expect("a valid run id")
}

fn actor(name: &str) -> ActorId {
    ActorId::new(name).expect("a valid actor id")
}

fn config(server: &TestNats, run_name: &str) -> NatsConfig {
    let mut config = NatsConfig::new(server.url(), run(run_name)).with_tls(NatsTls::with_ca(server.ca_file()));
    config.request_timeout = Duration::from_secs(2);
    config.retry_deadline = Duration::from_secs(30);
    config
}

/// Every version a full object in the store (no inline pointer, no deltas), as before issue 16:
/// for the tests of the object store's bookkeeping and of refused objects.
fn full_objects_config(server: &TestNats, run_name: &str) -> NatsConfig {
    let mut config = config(server, run_name);
    config.weights_inline_max_bytes = 0;
    config.weights_anchor_every = 1;
    config
}

fn spec(run_name: &str) -> RunSpec {
    common::spec(run_name)
}

fn segment(actor: &str, env_idx: u32, segment_idx: u64) -> TrajectorySegment {
    common::segment("test", actor, env_idx, segment_idx)
}

/// Receive until `n` deliveries arrived (transport errors, e.g. during a restart, are retried).
fn recv_at_least(source: &mut NatsTrajectorySource, n: usize) -> Vec<Delivery> {
    let started = Instant::now();
    let mut out = Vec::new();
    while out.len() < n {
        assert!(started.elapsed() < GUARD, "received {} of {n} deliveries", out.len());
        let _ = source.recv(n - out.len(), Duration::from_millis(200), &mut out);
    }
    out
}

fn segment_idx(delivery: &Delivery) -> u64 {
    delivery.segment.as_ref().expect("a valid segment").segment_idx
}

fn publish_raw(bus: &NatsBus, subject: &str, payload: Vec<u8>) {
    bus.block_on(async {
        let ack = bus.jetstream().publish(subject.to_string(), Bytes::from(payload)).await.expect("publish raw");
        ack.await.expect("stored");
    });
}

#[test]
fn segments_roundtrip_and_acked_ones_are_not_redelivered() {
    let server = TestNats::start();
    let mut config = config(&server, "roundtrip");
    config.ack_wait = Duration::from_secs(1);
    let bus = learner_bus(config);
    let mut sink = bus.trajectory_sink(&actor("Actor_A"), Arc::new(AtomicBool::new(false))).expect("sink");
    let sent: Vec<TrajectorySegment> = (0..5).map(|i| segment("Actor_A", 1, i)).collect();
    sink.publish(sent.clone()).expect("publish");
    sink.flush().expect("all acknowledged");
    assert_eq!(sink.stats().published, 5);
    assert_eq!(sink.subject(), "volley.roundtrip.traj.actor_a");

    let mut source = bus.trajectory_source().expect("source");
    let deliveries = recv_at_least(&mut source, 5);
    assert_eq!(deliveries.len(), 5);
    for (delivery, expected) in deliveries.iter().zip(&sent) {
        assert_eq!(delivery.segment.as_ref().expect("decodes"), expected);
        assert_eq!(delivery.delivery_count, 1);
    }
    let tokens: Vec<_> = deliveries.iter().map(|d| d.token).collect();
    source.ack(&tokens).expect("ack");
    assert_eq!(source.held(), 0);
    assert_eq!(consumer_pending(&bus), (0, 0), "double acks are recorded when ack returns");
    // Longer than ack_wait: an acked segment would have been redelivered by now.
    let mut again = Vec::new();
    assert_eq!(source.recv(10, Duration::from_millis(2500), &mut again).expect("open"), 0);
    assert_eq!(source.backlog(), Some(0));
}

#[test]
fn unacked_delivery_is_redelivered_to_the_next_learner() {
    let server = TestNats::start();
    let mut config = config(&server, "redeliver");
    config.ack_wait = Duration::from_secs(1);
    let bus = learner_bus(config);
    let mut sink = bus.trajectory_sink(&actor("a"), Arc::new(AtomicBool::new(false))).expect("sink");
    sink.publish(vec![segment("a", 0, 0)]).expect("publish");
    sink.flush().expect("acknowledged");

    let first = {
        let mut source = bus.trajectory_source().expect("source");
        let deliveries = recv_at_least(&mut source, 1);
        assert_eq!(deliveries[0].delivery_count, 1);
        segment_idx(&deliveries[0])
        // The learner "crashes": the source is dropped without acking.
    };
    let mut source = bus.trajectory_source().expect("a restarted learner's source");
    let deliveries = recv_at_least(&mut source, 1);
    assert_eq!(segment_idx(&deliveries[0]), first);
    assert_eq!(deliveries[0].delivery_count, 2);
    source.ack(&[deliveries[0].token]).expect("ack");
}

#[test]
fn held_deliveries_are_kept_alive_while_the_learner_polls() {
    let server = TestNats::start();
    let mut config = config(&server, "keepalive");
    config.ack_wait = Duration::from_secs(1);
    let bus = learner_bus(config);
    let mut sink = bus.trajectory_sink(&actor("a"), Arc::new(AtomicBool::new(false))).expect("sink");
    sink.publish(vec![segment("a", 0, 0)]).expect("publish");
    sink.flush().expect("acknowledged");
    let mut source = bus.trajectory_source().expect("source");
    let held = recv_at_least(&mut source, 1);
    // Poll for three ack waits while holding the delivery: progress signals keep it ours.
    let mut redelivered = Vec::new();
    for _ in 0..15 {
        source.recv(1, Duration::from_millis(200), &mut redelivered).expect("open");
    }
    assert!(redelivered.is_empty(), "held delivery was redelivered: {redelivered:?}");
    source.ack(&[held[0].token]).expect("ack");
    assert_eq!(consumer_pending(&bus), (0, 0));
}

#[test]
fn rejected_delivery_is_never_redelivered() {
    let server = TestNats::start();
    let mut config = config(&server, "reject");
    config.ack_wait = Duration::from_secs(1);
    // One message per segment: a batch frame settles as a whole (tests/nats_batch_frames.rs).
    config.max_segments_per_message = 1;
    let bus = learner_bus(config);
    let mut sink = bus.trajectory_sink(&actor("a"), Arc::new(AtomicBool::new(false))).expect("sink");
    sink.publish(vec![segment("a", 0, 0), segment("a", 0, 1)]).expect("publish");
    sink.flush().expect("acknowledged");
    let mut source = bus.trajectory_source().expect("source");
    let deliveries = recv_at_least(&mut source, 2);
    source.reject(deliveries[0].token).expect("reject");
    drop(source);
    // A fresh source (no progress signals), waiting past ack_wait: only the unsettled one returns.
    let mut source = bus.trajectory_source().expect("source");
    let again = recv_at_least(&mut source, 1);
    assert_eq!(segment_idx(&again[0]), segment_idx(&deliveries[1]));
    source.ack(&[again[0].token]).expect("ack");
    let mut more = Vec::new();
    assert_eq!(source.recv(10, Duration::from_millis(2500), &mut more).expect("open"), 0);
    assert_eq!(consumer_pending(&bus), (0, 0));
}

#[test]
fn undecodable_bytes_arrive_as_decode_errors_between_valid_segments() {
    let server = TestNats::start();
    let bus = learner_bus(config(&server, "garbage"));
    let subject = subjects::trajectories(&bus.config().run, &actor("raw"));
    let valid = wire::encode_segment(&segment("raw", 0, 0));
    let mut wrong_version = valid.clone();
    wrong_version[4] = 99;
    publish_raw(&bus, &subject, valid.clone());
    publish_raw(&bus, &subject, b"hello, not a segment".to_vec());
    publish_raw(&bus, &subject, valid[..valid.len() / 2].to_vec());
    publish_raw(&bus, &subject, wrong_version);
    publish_raw(&bus, &subject, wire::encode_segment(&segment("raw", 0, 1)));

    let mut source = bus.trajectory_source().expect("source");
    let deliveries = recv_at_least(&mut source, 5);
    let outcome: Vec<Result<u64, &str>> =
        deliveries.iter().map(|d| d.segment.as_ref().map(|s| s.segment_idx).map_err(|e| e.reason())).collect();
    // A segment cut in half fails the envelope checksum before its body is decoded (issue 12).
    assert_eq!(outcome, vec![Ok(0), Err("bad_magic"), Err("corrupt"), Err("wrong_version"), Ok(1)]);
    for delivery in &deliveries {
        match delivery.segment {
            Ok(_) => source.ack(&[delivery.token]).expect("ack"),
            Err(_) => source.reject(delivery.token).expect("reject"),
        }
    }
    assert_eq!(consumer_pending(&bus), (0, 0));
}

#[test]
fn same_segment_published_twice_is_stored_once() {
    let server = TestNats::start();
    let bus = learner_bus(config(&server, "dedup"));
    let mut sink = bus.trajectory_sink(&actor("a"), Arc::new(AtomicBool::new(false))).expect("sink");
    sink.publish(vec![segment("a", 3, 9)]).expect("first");
    sink.publish(vec![segment("a", 3, 9)]).expect("second, a retry");
    sink.flush().expect("acknowledged");
    assert_eq!(sink.stats().published, 2, "both acknowledged");
    assert_eq!(stream_messages(&bus), 1, "one stored");
    // A restarted actor (a new sink) counting segments from the same index is not a retry.
    let mut restarted = bus.trajectory_sink(&actor("a"), Arc::new(AtomicBool::new(false))).expect("sink");
    restarted.publish(vec![segment("a", 3, 9)]).expect("after restart");
    restarted.flush().expect("acknowledged");
    assert_eq!(stream_messages(&bus), 2);
}

#[test]
fn sink_waits_while_the_backlog_is_full_and_resumes_as_the_learner_drains() {
    let server = TestNats::start();
    let mut config = config(&server, "pacing");
    // One message per segment, so the stream's message count is the backlog in segments
    // (batch frames: tests/nats_batch_frames.rs).
    config.max_segments_per_message = 1;
    let bus = learner_bus(config);
    let mut sink = bus.trajectory_sink(&actor("a"), Arc::new(AtomicBool::new(false))).expect("sink");
    sink.set_max_backlog_segments(4);
    let (done_tx, done_rx) = mpsc::channel();
    let publisher = thread::spawn(move || {
        sink.publish((0..10).map(|i| segment("a", 0, i)).collect()).expect("publish");
        sink.flush().expect("acknowledged");
        done_tx.send(()).expect("main thread waits");
        sink.stats()
    });

    let started = Instant::now();
    while stream_messages(&bus) < 4 {
        assert!(started.elapsed() < GUARD, "the first segments never arrived");
        thread::sleep(Duration::from_millis(20));
    }
    // Give a misbehaving sink the chance to run past the bound; a correct one stays blocked.
    thread::sleep(Duration::from_millis(300));
    assert_eq!(done_rx.try_recv(), Err(mpsc::TryRecvError::Empty), "publish finished with the backlog full");
    assert_eq!(stream_messages(&bus), 4, "the sink published past max_backlog_segments");

    let mut source = bus.trajectory_source().expect("source");
    let mut seen = BTreeSet::new();
    let mut done = false;
    while !done || seen.len() < 10 {
        assert!(started.elapsed() < GUARD, "publisher never finished; saw {seen:?}");
        done = done || done_rx.try_recv().is_ok();
        let mut out = Vec::new();
        source.recv(10, Duration::from_millis(100), &mut out).expect("open");
        let tokens: Vec<_> = out.iter().map(|d| d.token).collect();
        seen.extend(out.iter().map(segment_idx));
        source.ack(&tokens).expect("ack");
    }
    let stats = publisher.join().expect("publisher thread");
    assert!(stats.throttled > Duration::ZERO, "the sink must have waited: {stats:?}");
    assert_eq!(stats.published, 10);
    assert_eq!(seen, (0..10).collect());
}

#[test]
fn stop_releases_a_throttled_sink() {
    let server = TestNats::start();
    let mut config = config(&server, "stop");
    config.max_backlog_segments = 1;
    config.max_segments_per_message = 1;
    let bus = learner_bus(config);
    let stop = Arc::new(AtomicBool::new(false));
    let mut sink = bus.trajectory_sink(&actor("a"), stop.clone()).expect("sink");
    let publisher = thread::spawn(move || sink.publish((0..3).map(|i| segment("a", 0, i)).collect()));
    let started = Instant::now();
    while stream_messages(&bus) < 1 {
        assert!(started.elapsed() < GUARD, "the first segment never arrived");
        thread::sleep(Duration::from_millis(20));
    }
    stop.store(true, Ordering::Release);
    assert_eq!(publisher.join().expect("publisher thread"), Err(TransportError::Closed));
}

#[test]
fn segment_over_max_payload_is_refused_with_both_sizes() {
    let server = TestNats::start_with(TestNatsOptions { max_payload_bytes: Some(64 * 1024), ..Default::default() });
    let bus = learner_bus(config(&server, "oversize"));
    assert_eq!(bus.max_payload(), 64 * 1024);
    let mut sink = bus.trajectory_sink(&actor("a"), Arc::new(AtomicBool::new(false))).expect("sink");
    let mut big = segment("a", 0, 1);
    big.observations = wire::Observations::F32(vec![0.5; 20_000]);
    let err = sink.publish(vec![segment("a", 0, 0), big]).expect_err("over max_payload");
    let TransportError::Failed { message, .. } = &err else { panic!("expected Failed, got {err:?}") };
    assert!(message.contains("65536") && message.contains("max_payload"), "{message}");
    let size = wire::encode_segment(&segment("a", 0, 1)).len();
    assert!(size < 65536);
    assert_eq!(stream_messages(&bus), 0, "nothing from the refused call is published");
    sink.publish(vec![segment("a", 0, 0)]).expect("a normal segment still goes through");
    sink.flush().expect("acknowledged");
    assert_eq!(stream_messages(&bus), 1);
}

/// A run whose store limits do not fit the broker's storage is refused with an error that names
/// the limits to lower, and the same run with smaller limits is then created on that broker.
#[test]
fn run_larger_than_the_brokers_storage_is_refused_with_the_limits_to_change() {
    let server = TestNats::start_with(TestNatsOptions { max_file_store_bytes: Some(256 << 20), ..Default::default() });
    let bus = NatsBus::connect(config(&server, "too-big")).expect("connect");
    let mut spec = spec("too-big");
    spec.hyper.stores = StoreLimits::default();
    assert!(spec.hyper.stores.trajectory_max_bytes > 256 << 20, "the default limits exceed this broker");
    let err = bus.ensure_run(&spec).expect_err("over the broker's storage");
    let TransportError::Failed { message, .. } = &err else { panic!("expected Failed, got {err:?}") };
    for part in ["10047", "stores.trajectory_max_bytes 1073741824", "max_file_store"] {
        assert!(message.contains(part), "{part} not in {message}");
    }
    spec.hyper.stores.trajectory_max_bytes = 64 << 20;
    spec.hyper.stores.weights_max_bytes = 64 << 20;
    bus.ensure_run(&spec).expect("smaller limits fit");
}

fn weights(version: u64, n_params: usize) -> Arc<Weights> {
    let params = (0..n_params).map(|i| (i as f32 * 0.001 + version as f32).sin()).collect();
    Arc::new(Weights::new(PolicyVersion(version), 42, params))
}

fn weight_objects(bus: &NatsBus) -> Vec<String> {
    let bucket = subjects::weights_bucket(&bus.config().run);
    bus.block_on(async {
        let store = bus.jetstream().get_object_store(bucket).await.expect("weights store");
        let mut list = store.list().await.expect("list");
        let mut names = Vec::new();
        while let Some(info) = list.next().await {
            let info = info.expect("object info");
            if !info.deleted {
                names.push(info.name);
            }
        }
        names.sort();
        names
    })
}

/// Issue 11: deleting an old version left one delete marker per version in the weights store
/// (35k messages after a 7-minute soak). The publisher purges them, so the store's message
/// count stays that of the kept versions however many were published.
#[test]
fn the_weights_store_holds_only_the_kept_versions_and_no_delete_markers() {
    let server = TestNats::start();
    let bus = learner_bus(full_objects_config(&server, "markers"));
    let mut publisher = bus.weights_publisher().expect("publisher");
    let backing = subjects::object_backing_stream(&subjects::weights_bucket(&bus.config().run));
    let store_messages = || {
        bus.block_on(async {
            let mut stream = bus.jetstream().get_stream(backing.as_str()).await.expect("the weights stream");
            stream.info().await.expect("stream info").state.messages
        })
    };
    publisher.publish(weights(0, 16)).expect("publish");
    // One version: its metadata and one chunk.
    let per_version = store_messages();
    for version in 1..40 {
        publisher.publish(weights(version, 16)).expect("publish");
    }
    assert_eq!(weight_objects(&bus), (37..40).map(subjects::weights_object).collect::<Vec<_>>(), "keeps 3 versions");
    assert_eq!(store_messages(), 3 * per_version, "no delete markers are left for the 37 removed versions");
}

#[test]
fn late_follower_gets_the_newest_weights_at_once() {
    let server = TestNats::start();
    let bus = learner_bus(full_objects_config(&server, "weights"));
    let mut publisher = bus.weights_publisher().expect("publisher");
    for version in 0..4 {
        publisher.publish(weights(version, 16)).expect("publish");
    }
    assert!(publisher.publish(weights(3, 16)).is_err(), "versions must increase");
    assert_eq!(weight_objects(&bus), (1..4).map(subjects::weights_object).collect::<Vec<_>>(), "keeps 3 versions");

    let actor_bus = NatsBus::connect(config(&server, "weights")).expect("actor connects");
    let mut follower = actor_bus.weights_follower(42, 16).expect("follower");
    let first = follower.wait_first(GUARD).expect("the newest version");
    assert_eq!(*first, *weights(3, 16));
    assert!(follower.latest(Some(PolicyVersion(3))).expect("ok").is_none());
    assert_eq!(follower.latest(Some(PolicyVersion(2))).expect("ok").map(|w| w.version), Some(PolicyVersion(3)));

    publisher.publish(weights(4, 16)).expect("publish v4");
    let started = Instant::now();
    let newer = loop {
        assert!(started.elapsed() < GUARD, "v4 never arrived");
        if let Some(newer) = follower.latest(Some(PolicyVersion(3))).expect("ok") {
            break newer;
        }
        thread::sleep(Duration::from_millis(10));
    };
    assert_eq!(*newer, *weights(4, 16));
}

#[test]
fn sixteen_mib_weights_roundtrip() {
    let server = TestNats::start();
    let bus = learner_bus(config(&server, "big-weights"));
    let n_params = 4 << 20;
    let big = weights(0, n_params);
    bus.weights_publisher().expect("publisher").publish(big.clone()).expect("publish 16 MiB");
    let mut follower = bus.weights_follower(42, n_params).expect("follower");
    let received = follower.wait_first(GUARD).expect("weights");
    assert_eq!(received.params.len(), n_params);
    assert!(received == big, "16 MiB of weights changed on the way");
}

#[test]
fn corrupted_or_mismatched_weights_are_refused() {
    let server = TestNats::start();
    let bus = learner_bus(full_objects_config(&server, "bad-weights"));
    let mut publisher = bus.weights_publisher().expect("publisher");
    publisher.publish(weights(0, 16)).expect("publish");

    let mut other_layout = bus.weights_follower(43, 16).expect("follower");
    let err = other_layout.wait_first(GUARD).expect_err("layout mismatch");
    assert!(err.to_string().contains("layout hash"), "{err}");

    let mut wrong_size = bus.weights_follower(42, 17).expect("follower");
    let err = wrong_size.wait_first(GUARD).expect_err("size mismatch");
    assert!(err.to_string().contains("shape"), "{err}");

    let mut follower = bus.weights_follower(42, 16).expect("follower");
    assert_eq!(follower.wait_first(GUARD).expect("good weights").version, PolicyVersion(0));

    let mut corrupted = (*weights(1, 16)).clone();
    corrupted.params[3] += 1.0;
    publisher.publish(Arc::new(corrupted)).expect("the publisher does not check");
    let started = Instant::now();
    let err = loop {
        assert!(started.elapsed() < GUARD, "v1 never announced");
        match follower.latest(Some(PolicyVersion(0))) {
            Ok(None) => thread::sleep(Duration::from_millis(10)),
            Ok(Some(w)) => panic!("corrupted weights accepted: {:?}", w.version),
            Err(err) => break err,
        }
    };
    assert!(err.to_string().contains("checksum"), "{err}");
    assert!(follower.latest(Some(PolicyVersion(0))).expect("reported once").is_none());

    // Garbage bytes under the object the pointer names.
    publisher.publish(weights(2, 16)).expect("publish v2");
    let bucket = subjects::weights_bucket(&bus.config().run);
    bus.block_on(async {
        let store = bus.jetstream().get_object_store(bucket).await.expect("weights store");
        store.put(subjects::weights_object(2).as_str(), &mut &b"garbage"[..]).await.expect("overwrite");
    });
    let mut fresh = bus.weights_follower(42, 16).expect("follower");
    let err = fresh.wait_first(GUARD).expect_err("garbage weights");
    assert!(err.to_string().contains("bad_magic"), "{err}");
}

#[test]
fn spec_is_none_before_the_run_exists_and_readable_after() {
    let server = TestNats::start();
    let actor_bus = NatsBus::connect(config(&server, "spec")).expect("connect");
    assert!(actor_bus.read_spec().expect("no error").is_none());
    let learner = learner_bus(config(&server, "spec"));
    let read = actor_bus.read_spec().expect("readable").expect("stored");
    assert_eq!(read.expect("verified"), spec("spec"));
    learner.ensure_run(&spec("spec")).expect("idempotent");
    assert!(learner.ensure_run(&spec("other")).is_err(), "a spec for another run is refused");
}

/// Issue 12: a run spec corrupted in KV is refused as `corrupt` before it is decoded, a plain
/// JSON spec (as older learners wrote it) still reads, and the learner's next write repairs it.
#[test]
fn a_corrupted_run_spec_is_refused_and_a_plain_one_still_reads() {
    let server = TestNats::start();
    let learner = learner_bus(config(&server, "spec"));
    let actor_bus = NatsBus::connect(config(&server, "spec")).expect("connect");
    let put = |value: Vec<u8>| {
        learner.block_on(async {
            let kv = learner.jetstream().get_key_value(subjects::run_bucket(&learner.config().run)).await.expect("kv");
            kv.put(subjects::SPEC_KEY, value.into()).await.expect("put");
        })
    };
    let mut stored = spec("spec").encode_stored();
    // Flip one bit inside the spec (a digit of the seed keeps it valid JSON).
    let at = stored.len() - 10;
    stored[at] ^= 0x01;
    put(stored);
    let err = actor_bus.read_spec().expect("the broker answered").expect("stored").expect_err("corrupt");
    assert_eq!(err.reason(), "corrupt", "{err}");
    put(serde_json::to_vec(&spec("spec")).expect("json"));
    assert_eq!(actor_bus.read_spec().expect("read").expect("stored").expect("plain json"), spec("spec"));
    learner.ensure_run(&spec("spec")).expect("rewrite");
    assert_eq!(actor_bus.read_spec().expect("read").expect("stored").expect("verified"), spec("spec"));
}

#[test]
fn connect_to_a_dead_server_names_the_url() {
    let port = volley_testkit::free_port();
    let mut config = NatsConfig::new(format!("nats://127.0.0.1:{port}"), run("dead"));
    config.connect_timeout = Duration::from_millis(300);
    let err = NatsBus::connect(config).expect_err("nobody listens");
    assert!(err.to_string().contains(&format!("127.0.0.1:{port}")), "{err}");
}

#[test]
fn replay_yields_every_segment_in_order_then_closed() {
    let server = TestNats::start();
    let bus = learner_bus(config(&server, "replay"));
    let mut sink = bus.trajectory_sink(&actor("a"), Arc::new(AtomicBool::new(false))).expect("sink");
    sink.publish((0..6).map(|i| segment("a", 0, i)).collect()).expect("publish");
    sink.flush().expect("acknowledged");
    let mut source = bus.trajectory_source().expect("source");
    let consumed = recv_at_least(&mut source, 6);
    source.ack(&consumed.iter().map(|d| d.token).collect::<Vec<_>>()).expect("ack");

    let mut replay = bus.replay_source().expect("replay");
    sink.publish(vec![segment("a", 0, 6)]).expect("published after the replay started");
    sink.flush().expect("acknowledged");
    let started = Instant::now();
    let mut replayed = Vec::new();
    loop {
        assert!(started.elapsed() < GUARD, "replay never closed; got {} segments", replayed.len());
        match replay.recv(4, Duration::from_millis(200), &mut replayed) {
            Ok(_) => {}
            Err(TransportError::Closed) => break,
            Err(err) => panic!("replay failed: {err}"),
        }
    }
    assert_eq!(replayed.iter().map(segment_idx).collect::<Vec<_>>(), (0..6).collect::<Vec<_>>());
    replay.ack(&[replayed[0].token]).expect("acks are no-ops");
    assert_eq!(replay.recv(4, Duration::from_millis(10), &mut replayed), Err(TransportError::Closed));

    let mut empty = learner_bus(config(&server, "replay-empty")).replay_source().expect("replay");
    assert_eq!(empty.recv(4, Duration::from_millis(10), &mut Vec::new()), Err(TransportError::Closed));
}

#[test]
fn publishes_whose_acks_a_restart_lost_are_sent_again_at_once() {
    // Messages the server never read before it died are never acknowledged. The sink resends
    // them as soon as the client has reconnected, not one ack deadline after another: with a
    // 120 s deadline and three such messages, waiting them out would take six minutes.
    let mut server = TestNats::start();
    let mut actor_config = config(&server, "lost-acks");
    actor_config.request_timeout = Duration::from_secs(120);
    let bus = learner_bus(config(&server, "lost-acks"));
    let actor_bus = NatsBus::connect(actor_config).expect("actor connects");
    let mut sink = actor_bus.trajectory_sink(&actor("a"), Arc::new(AtomicBool::new(false))).expect("sink");
    let mut source = bus.trajectory_source().expect("source");
    sink.publish(vec![segment("a", 0, 0)]).expect("before the pause");
    sink.flush().expect("acknowledged");

    // The server stops reading: three messages go out (one per call) and stay unread.
    server.pause();
    let (sent, handed_over) = mpsc::channel();
    let (done, finished) = mpsc::channel();
    let actor_thread = thread::spawn(move || {
        for i in 1..4 {
            sink.publish(vec![segment("a", 0, i)]).expect("handed to the client");
        }
        sent.send(()).expect("the test waits");
        done.send(sink.flush()).expect("the test waits");
        sink
    });
    // The restart comes only once all three were sent on the connection it ends (a publish
    // returns once its message is handed to the client; the sink counts it as sent on the
    // connection it had before the call). Waiting a fixed time instead let a loaded machine
    // restart the server before the actor thread had run, so nothing was lost and nothing
    // was sent again.
    handed_over.recv_timeout(GUARD).expect("the three publishes returned while the server was paused");
    server.restart();
    let flushed = finished.recv_timeout(GUARD).expect("the sink waited for acks that a restart had lost");
    flushed.expect("acknowledged after the restart");
    let sink = actor_thread.join().expect("actor thread");
    assert!(sink.stats().published >= 4);
    assert!(sink.publish_retries() >= 1, "the unread messages were sent again");

    // Each segment is in the stream once (resent under its id; the server had none of them).
    let mut seen = Vec::new();
    let started = Instant::now();
    while seen.len() < 4 {
        assert!(started.elapsed() < GUARD, "segments missing: {seen:?}");
        let mut out = Vec::new();
        let _ = source.recv(4, Duration::from_millis(200), &mut out);
        seen.extend(out.iter().map(segment_idx));
    }
    seen.sort_unstable();
    assert_eq!(seen, vec![0, 1, 2, 3]);
    // Counted in the stream, not by waiting for more deliveries: a duplicate would be a fifth
    // message.
    assert_eq!(stream_messages(&bus), 4, "each segment stored once");
}

#[test]
fn sink_source_publisher_and_follower_survive_a_server_restart() {
    let mut server = TestNats::start();
    let bus = learner_bus(config(&server, "restart"));
    let actor_bus = NatsBus::connect(config(&server, "restart")).expect("actor connects");
    let mut sink = actor_bus.trajectory_sink(&actor("a"), Arc::new(AtomicBool::new(false))).expect("sink");
    let mut source = bus.trajectory_source().expect("source");
    let mut publisher = bus.weights_publisher().expect("publisher");
    let mut follower = actor_bus.weights_follower(42, 16).expect("follower");

    publisher.publish(weights(0, 16)).expect("v0");
    assert_eq!(follower.wait_first(GUARD).expect("v0").version, PolicyVersion(0));
    sink.publish((0..3).map(|i| segment("a", 0, i)).collect()).expect("before the restart");
    sink.flush().expect("acknowledged");
    let before = recv_at_least(&mut source, 3);
    source.ack(&before.iter().map(|d| d.token).collect::<Vec<_>>()).expect("ack");

    // Publish segments and weights while the broker is down; both go through once it is back.
    server.kill();
    let actor_thread = thread::spawn(move || {
        sink.publish((3..6).map(|i| segment("a", 0, i)).collect()).expect("published across the outage");
        sink.flush().expect("acknowledged after the restart");
        sink
    });
    let learner_thread = thread::spawn(move || {
        publisher.publish(weights(1, 16)).expect("v1 across the outage");
        publisher
    });
    // No broker, no segments: an error once the client has seen the connection drop, or
    // nothing within the wait before it has (a loaded machine may not have run it yet).
    let mut out = Vec::new();
    let outcome = source.recv(3, Duration::from_millis(100), &mut out);
    assert!(matches!(outcome, Err(_) | Ok(0)) && out.is_empty(), "no broker, no segments: {outcome:?}");
    server.restart();
    let sink = actor_thread.join().expect("actor thread");
    let mut publisher = learner_thread.join().expect("learner thread");
    let mut seen = BTreeSet::new();
    let started = Instant::now();
    let new: BTreeSet<u64> = (3..6).collect();
    while !seen.is_superset(&new) {
        assert!(started.elapsed() < GUARD, "segments after the restart never arrived: {seen:?}");
        let mut out = Vec::new();
        let _ = source.recv(3, Duration::from_millis(200), &mut out);
        source.ack(&out.iter().map(|d| d.token).collect::<Vec<_>>()).expect("ack after the restart");
        seen.extend(out.iter().map(segment_idx));
    }
    // JetStream's file store syncs consumer state asynchronously, so a SIGKILL can lose the
    // newest acks and an acked segment may come once more (the learner's duplicate filter
    // drops it). Nothing else may appear, and nothing published may be missing.
    assert!(seen.iter().all(|&idx| idx < 6), "only segments that were published: {seen:?}");

    publisher.publish(weights(2, 16)).expect("v2 after the restart");
    let started = Instant::now();
    loop {
        assert!(started.elapsed() < GUARD, "the follower never saw v2");
        match follower.latest(Some(PolicyVersion(1))) {
            Ok(Some(newer)) => {
                assert_eq!(*newer, *weights(2, 16));
                break;
            }
            Ok(None) | Err(_) => thread::sleep(Duration::from_millis(20)),
        }
    }
    assert!(sink.stats().published >= 6);
}
