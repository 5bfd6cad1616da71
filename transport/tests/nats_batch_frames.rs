//! Batch frames (several segments per JetStream message, issue 16) against a real
//! `nats-server` (`volley_testkit::TestNats`): the sink packs a call's segments into one
//! message, the source hands out one delivery per segment and settles the message once all of
//! them are settled, a bad segment inside a frame is rejected alone, an unsettled frame is
//! redelivered whole, and pacing counts segments.
//!
//! No assertion depends on timing; waits are bounded only so that a broken build fails
//! instead of hanging.

#[allow(dead_code)] // this test uses only part of the shared fixtures
mod common;

use std::sync::atomic::AtomicBool;
use std::sync::{mpsc, Arc};
use std::thread;
use std::time::{Duration, Instant};

use bytes::Bytes;
use common::{consumer_pending, learner_bus, stream_messages};
use volley_core::ids::{ActorId, RunId};
use volley_core::subjects;
use volley_core::wire::{self, batch, TrajectorySegment};
use volley_testkit::TestNats;
use volley_transport::nats::{NatsBus, NatsConfig, NatsTls, NatsTrajectorySource};
use volley_transport::{Delivery, TrajectorySink, TrajectorySource};

/// Bound on any wait: only there so that a regression fails instead of hanging.
const GUARD: Duration = Duration::from_secs(60);

fn actor(name: &str) -> ActorId {
    ActorId::new(name).expect("a valid actor id")
}

fn config(server: &TestNats, run_name: &str) -> NatsConfig {
    let mut config = NatsConfig::new(server.url(), RunId::new(run_name).expect("a valid run id"))
        .with_tls(NatsTls::with_ca(server.ca_file()));
    config.request_timeout = Duration::from_secs(2);
    config.ack_wait = Duration::from_secs(1);
    config
}

fn segment(env_idx: u32, segment_idx: u64) -> TrajectorySegment {
    common::segment("test", "a", env_idx, segment_idx)
}

fn recv_at_least(source: &mut NatsTrajectorySource, n: usize, max: usize) -> Vec<Delivery> {
    let started = Instant::now();
    let mut out = Vec::new();
    while out.len() < n {
        assert!(started.elapsed() < GUARD, "received {} of {n} deliveries", out.len());
        let got = source.recv(max, Duration::from_millis(200), &mut out).expect("recv");
        assert!(got <= max, "recv handed out {got} deliveries, asked for at most {max}");
    }
    out
}

/// A subscription to the run's pace notices.
fn subscribe_notices(bus: &NatsBus) -> async_nats::Subscriber {
    bus.block_on(bus.client().subscribe(subjects::pace(&bus.config().run))).expect("subscribed to the pace subject")
}

/// The next pace notice on `notices`, within the guard.
fn next_notice(bus: &NatsBus, notices: &mut async_nats::Subscriber) -> wire::pace::PaceNotice {
    let message = bus
        .block_on(async { tokio::time::timeout(GUARD, futures::StreamExt::next(notices)).await })
        .expect("a notice within the guard")
        .expect("subscription open");
    wire::pace::decode_pace_notice(&message.payload).expect("a well-formed notice")
}

fn outcome(delivery: &Delivery) -> Result<u64, &'static str> {
    delivery.segment.as_ref().map(|s| s.segment_idx).map_err(|err| err.reason())
}

fn publish_raw(bus: &NatsBus, payload: Vec<u8>) {
    let subject = subjects::trajectories(&bus.config().run, &actor("raw"));
    bus.block_on(async {
        let ack = bus.jetstream().publish(subject, Bytes::from(payload)).await.expect("publish raw");
        ack.await.expect("stored");
    });
}

#[test]
fn a_frame_is_one_message_of_deliveries_acked_once_all_are_settled() {
    let server = TestNats::start();
    let bus = learner_bus(config(&server, "frames"));
    let mut sink = bus.trajectory_sink(&actor("a"), Arc::new(AtomicBool::new(false))).expect("sink");
    let sent: Vec<_> = (0..5).map(|idx| segment(idx as u32, idx)).collect();
    sink.publish(sent.clone()).expect("publish");
    sink.flush().expect("acknowledged");
    assert_eq!(sink.stats().published, 5, "published counts segments");
    assert_eq!(stream_messages(&bus), 1, "one call's segments travel in one message");

    let mut source = bus.trajectory_source().expect("source");
    // At most `max` per call: the rest of the frame waits for the next call.
    let deliveries = recv_at_least(&mut source, 5, 2);
    let received: Vec<_> = deliveries.iter().map(|d| d.segment.clone().expect("decodes")).collect();
    assert_eq!(received, sent);
    assert!(deliveries.iter().all(|d| d.delivery_count == 1));
    assert_eq!((source.held(), source.held_messages()), (5, 1));

    let tokens: Vec<_> = deliveries.iter().map(|d| d.token).collect();
    source.ack(&tokens[..4]).expect("ack four");
    assert_eq!(consumer_pending(&bus), (0, 1), "the frame stays unacknowledged while a segment is open");
    assert_eq!((source.held(), source.held_messages()), (1, 1));
    // A rejected last segment settles a frame whose others were used with an ack.
    source.reject(tokens[4]).expect("reject the fifth");
    assert_eq!(consumer_pending(&bus), (0, 0));
    assert_eq!((source.held(), source.held_messages()), (0, 0));
    let mut again = Vec::new();
    assert_eq!(source.recv(10, Duration::from_millis(2500), &mut again).expect("open"), 0, "nothing redelivered");
}

#[test]
fn a_bad_segment_inside_a_frame_is_rejected_alone_and_a_bad_frame_once() {
    let server = TestNats::start();
    let bus = learner_bus(config(&server, "badpart"));
    let parts: Vec<Vec<u8>> = (0..3).map(|idx| wire::encode_segment(&segment(0, idx))).collect();
    let mut corrupted = parts.clone();
    let last = corrupted[1].len() - 1;
    corrupted[1][last] ^= 0x01;
    publish_raw(&bus, batch::encode_segment_batch(&corrupted));
    let mut bad_header = batch::encode_segment_batch(&parts[..2]);
    bad_header[10] ^= 0x01; // the first part's length
    publish_raw(&bus, bad_header);
    publish_raw(&bus, wire::encode_segment(&segment(0, 3)));

    let mut source = bus.trajectory_source().expect("source");
    let deliveries = recv_at_least(&mut source, 5, 64);
    let outcomes: Vec<_> = deliveries.iter().map(outcome).collect();
    assert_eq!(outcomes, [Ok(0), Err("corrupt"), Ok(2), Err("corrupt"), Ok(3)]);
    for delivery in &deliveries {
        match delivery.segment {
            Ok(_) => source.ack(&[delivery.token]).expect("ack"),
            Err(_) => source.reject(delivery.token).expect("reject"),
        }
    }
    assert_eq!(consumer_pending(&bus), (0, 0));
    // Nothing comes back past ack_wait: the bad frame was terminated, the others acked.
    let mut again = Vec::new();
    assert_eq!(source.recv(10, Duration::from_millis(2500), &mut again).expect("open"), 0);
}

#[test]
fn a_frame_not_fully_settled_is_redelivered_whole_to_the_next_learner() {
    let server = TestNats::start();
    let bus = learner_bus(config(&server, "partial"));
    let mut sink = bus.trajectory_sink(&actor("a"), Arc::new(AtomicBool::new(false))).expect("sink");
    sink.publish((0..3).map(|idx| segment(0, idx)).collect()).expect("publish");
    sink.flush().expect("acknowledged");
    {
        let mut source = bus.trajectory_source().expect("source");
        let deliveries = recv_at_least(&mut source, 3, 64);
        source.ack(&[deliveries[0].token, deliveries[1].token]).expect("ack two of three");
        assert_eq!(consumer_pending(&bus), (0, 1));
        // The learner "crashes" holding the third.
    }
    let mut source = bus.trajectory_source().expect("a restarted learner's source");
    let deliveries = recv_at_least(&mut source, 3, 64);
    assert_eq!(deliveries.iter().map(outcome).collect::<Vec<_>>(), [Ok(0), Ok(1), Ok(2)]);
    assert!(deliveries.iter().all(|d| d.delivery_count == 2), "at least once: the whole frame again");
    source.ack(&deliveries.iter().map(|d| d.token).collect::<Vec<_>>()).expect("ack");
    assert_eq!(consumer_pending(&bus), (0, 0));
}

#[test]
fn a_batching_sink_paces_by_segments() {
    let server = TestNats::start();
    let bus = learner_bus(config(&server, "framepace"));
    let mut sink = bus.trajectory_sink(&actor("a"), Arc::new(AtomicBool::new(false))).expect("sink");
    // 16 segments: two frames of 8.
    sink.set_max_backlog_segments(16);
    let (done_tx, done_rx) = mpsc::channel();
    let publisher = thread::spawn(move || {
        for call in 0..5u64 {
            sink.publish((0..8).map(|env| segment(env, call)).collect()).expect("publish");
        }
        sink.flush().expect("acknowledged");
        done_tx.send(()).expect("main thread waits");
        sink.stats()
    });
    let started = Instant::now();
    while stream_messages(&bus) < 2 {
        assert!(started.elapsed() < GUARD, "the first frames never arrived");
        thread::sleep(Duration::from_millis(20));
    }
    // Give a misbehaving sink the chance to run past the bound; a correct one stays blocked.
    thread::sleep(Duration::from_millis(300));
    assert_eq!(done_rx.try_recv(), Err(mpsc::TryRecvError::Empty), "publish finished with the backlog full");
    assert_eq!(stream_messages(&bus), 2, "the sink published past 16 segments of backlog");

    let mut source = bus.trajectory_source().expect("source");
    let mut received = 0;
    let mut done = false;
    while !done || received < 40 {
        assert!(started.elapsed() < GUARD, "publisher never finished; received {received}");
        done = done || done_rx.try_recv().is_ok();
        let mut out = Vec::new();
        source.recv(64, Duration::from_millis(100), &mut out).expect("open");
        received += out.len();
        source.ack(&out.iter().map(|d| d.token).collect::<Vec<_>>()).expect("ack");
    }
    let stats = publisher.join().expect("publisher thread");
    assert!(stats.throttled > Duration::ZERO, "the sink must have waited: {stats:?}");
    assert_eq!((stats.published, received), (40, 40));
}

/// A sink's `wait_for_room` (which signals `done_rx` when it returns) stays blocked while the
/// 16 segments it waits behind are there, and returns once a learner took and acked them.
fn held_until_drained(bus: &NatsBus, done_rx: &mpsc::Receiver<()>) {
    thread::sleep(Duration::from_millis(300));
    assert_eq!(done_rx.try_recv(), Err(mpsc::TryRecvError::Empty), "wait_for_room returned with the backlog full");
    let mut source = bus.trajectory_source().expect("source");
    let deliveries = recv_at_least(&mut source, 16, 16);
    source.ack(&deliveries.iter().map(|d| d.token).collect::<Vec<_>>()).expect("ack");
    done_rx.recv_timeout(GUARD).expect("wait_for_room returns once the learner drained the backlog");
}

#[test]
fn wait_for_room_blocks_while_the_backlog_is_full_and_returns_once_it_drains() {
    // The actor waits here before it takes the newest weights and collects its round (issue 11).
    let server = TestNats::start();
    let bus = learner_bus(config(&server, "roomwait"));
    let mut sink = bus.trajectory_sink(&actor("a"), Arc::new(AtomicBool::new(false))).expect("sink");
    sink.set_max_backlog_segments(16);
    for call in 0..2u64 {
        sink.publish((0..8).map(|env| segment(env, call)).collect()).expect("publish");
    }
    sink.flush().expect("acknowledged");
    let (done_tx, done_rx) = mpsc::channel();
    let waiter = thread::spawn(move || {
        sink.wait_for_room(8).expect("room");
        done_tx.send(()).expect("main thread waits");
        sink.stats()
    });
    held_until_drained(&bus, &done_rx);
    let stats = waiter.join().expect("waiter thread");
    assert!(stats.throttled > Duration::ZERO, "the wait counts as throttled time: {stats:?}");
}

#[test]
fn wait_for_room_paces_at_the_packing_of_the_last_round() {
    // Segments too large to share a message (here: a one-byte frame limit) travel one per
    // message; waiting for room must count them as `publish` does, not as one frame of 8.
    let server = TestNats::start();
    let mut config = config(&server, "roomsplit");
    config.max_frame_bytes = 1;
    let bus = learner_bus(config);
    let mut sink = bus.trajectory_sink(&actor("a"), Arc::new(AtomicBool::new(false))).expect("sink");
    sink.set_max_backlog_segments(16);
    sink.publish((0..8).map(|env| segment(env, 0)).collect()).expect("publish");
    sink.flush().expect("acknowledged");
    assert_eq!(stream_messages(&bus), 8, "one message per segment");
    let (done_tx, done_rx) = mpsc::channel();
    let waiter = thread::spawn(move || {
        // 8 of 16 segments waiting: room for the next round.
        sink.wait_for_room(8).expect("room");
        done_tx.send(()).expect("main thread waits");
        sink.publish((0..8).map(|env| segment(env, 1)).collect()).expect("publish");
        sink.flush().expect("acknowledged");
        // 16 of 16: now it waits.
        sink.wait_for_room(8).expect("room");
        done_tx.send(()).expect("main thread waits");
    });
    done_rx.recv_timeout(GUARD).expect("room for a second round with half the bound waiting");
    held_until_drained(&bus, &done_rx);
    waiter.join().expect("waiter thread");
}

#[test]
fn the_learner_asks_for_the_next_messages_before_its_next_recv() {
    // Issue 16: async-nats sends a pull request only from inside a poll of the pull, so a
    // learner taking one message per update found the next ones stored but not asked for, and
    // waited a round trip for them after each update. The source polls once more after a
    // `recv` has what it wanted: the messages behind the one taken reach the learner's client
    // while it computes.
    let server = TestNats::start();
    let bus = learner_bus(config(&server, "prime"));
    let mut sink = bus.trajectory_sink(&actor("a"), Arc::new(AtomicBool::new(false))).expect("sink");
    for idx in 0..4 {
        sink.publish(vec![segment(0, idx)]).expect("publish");
    }
    sink.flush().expect("acknowledged");
    assert_eq!(stream_messages(&bus), 4);
    let mut source = bus.trajectory_source().expect("source");
    // The first recv fetches one message (to learn the segments per message); the second opens
    // the continuous pull, two messages per request, and takes one of them.
    let mut taken = recv_at_least(&mut source, 1, 1);
    taken.extend(recv_at_least(&mut source, 1, 1));
    // No recv now: the pull has already asked for the rest, so nothing stays undelivered.
    let started = Instant::now();
    while consumer_pending(&bus).0 != 0 {
        assert!(started.elapsed() < GUARD, "the fourth message was never asked for: {:?}", consumer_pending(&bus));
        thread::sleep(Duration::from_millis(10));
    }
    taken.extend(recv_at_least(&mut source, 2, 1));
    assert_eq!(taken.iter().map(outcome).collect::<Vec<_>>(), [Ok(0), Ok(1), Ok(2), Ok(3)], "in stream order");
    source.ack(&taken.iter().map(|d| d.token).collect::<Vec<_>>()).expect("ack");
    assert_eq!(consumer_pending(&bus), (0, 0));
}

#[test]
fn the_learner_prefetches_as_many_calls_worth_as_configured() {
    // `NatsConfig::prefetch_calls` (issue 16 item 5): the continuous pull asks for that many
    // calls' worth of messages per request, and the pace notices tell the actors so (their
    // pacing allows for the learner's prefetch on top of the bound).
    for (calls, expected) in [(1, 2), (8, 8)] {
        let server = TestNats::start();
        let mut config = config(&server, "prefetchcalls");
        config.prefetch_calls = calls;
        let bus = learner_bus(config);
        let mut sink = bus.trajectory_sink(&actor("a"), Arc::new(AtomicBool::new(false))).expect("sink");
        for idx in 0..12 {
            sink.publish(vec![segment(0, idx)]).expect("publish");
        }
        sink.flush().expect("acknowledged");
        let mut notices = subscribe_notices(&bus);
        let mut source = bus.trajectory_source().expect("source");
        // The first recv fetches one message to learn the segments per message; the second
        // opens the continuous pull for one message per call.
        let mut taken = recv_at_least(&mut source, 1, 1);
        taken.extend(recv_at_least(&mut source, 1, 1));
        let notice = loop {
            let notice = next_notice(&bus, &mut notices);
            if notice.prefetch > 0 {
                break notice;
            }
        };
        assert_eq!(notice.prefetch, expected, "prefetch_calls {calls}: {notice:?}");
        // Deliveries reach the learner in stream order either way.
        taken.extend(recv_at_least(&mut source, 10, 10));
        assert_eq!(taken.iter().map(outcome).collect::<Vec<_>>(), (0..12).map(Ok).collect::<Vec<_>>());
        source.ack(&taken.iter().map(|d| d.token).collect::<Vec<_>>()).expect("ack");
    }
}

#[test]
fn the_learner_announces_what_it_took_and_a_sink_paces_on_it() {
    // Pushed pacing (issue 16): the learner announces what it took on `volley.<run>.pace`, and
    // a sink takes the newest notice as the backlog instead of polling the consumer.
    let server = TestNats::start();
    let bus = learner_bus(config(&server, "pacenotice"));
    let mut sink = bus.trajectory_sink(&actor("a"), Arc::new(AtomicBool::new(false))).expect("sink");
    sink.set_max_backlog_segments(16);
    for call in 0..2u64 {
        sink.publish((0..8).map(|env| segment(env, call)).collect()).expect("publish");
    }
    sink.flush().expect("acknowledged");
    let mut notices = subscribe_notices(&bus);
    let mut source = bus.trajectory_source().expect("source");
    let deliveries = recv_at_least(&mut source, 16, 16);
    source.ack(&deliveries.iter().map(|d| d.token).collect::<Vec<_>>()).expect("ack");
    // The learner took both frames (stream sequences 1 and 2): some notice says so.
    let started = Instant::now();
    let last = loop {
        assert!(started.elapsed() < GUARD, "no notice that both frames were taken");
        let notice = next_notice(&bus, &mut notices);
        assert!(notice.taken <= notice.stored && notice.stored <= 2, "{notice:?}");
        if notice.taken == 2 {
            break notice;
        }
    };
    assert_eq!(last.stored, 2, "{last:?}");
    // The sink's next pacing takes the newest notice when it arrived after the sink's last
    // consumer reading (one that arrived while a reading was under way is older than it, and
    // rightly ignored): round by round, the learner taking each, until one is taken.
    let started = Instant::now();
    let mut round = 2;
    while sink.stats().pace_notices_used == 0 {
        assert!(started.elapsed() < GUARD, "the sink never took a notice: {:?}", sink.stats());
        sink.wait_for_room(8).expect("room: the learner took everything");
        sink.publish((0..8).map(|env| segment(env, round)).collect()).expect("publish");
        sink.flush().expect("acknowledged");
        let deliveries = recv_at_least(&mut source, 8, 8);
        source.ack(&deliveries.iter().map(|d| d.token).collect::<Vec<_>>()).expect("ack");
        thread::sleep(Duration::from_millis(10));
        round += 1;
    }
    let stats = sink.stats();
    assert_eq!((stats.pace_notices_refused, stats.pace_notices_distrusted), (0, 0), "{stats:?}");
}

#[test]
fn forged_pace_notices_cannot_overfill_the_learners_backlog() {
    // A forger (it needs the learner's credentials, docs/SECURITY.md) claims the learner took
    // everything, over and over, while the learner takes nothing. The sink's consumer readings
    // contradict the notices, so it stops trusting them: the backlog stays bounded.
    let server = TestNats::start();
    let bus = learner_bus(config(&server, "paceforged"));
    let stop = Arc::new(AtomicBool::new(false));
    let mut sink = bus.trajectory_sink(&actor("a"), stop.clone()).expect("sink");
    let bound = 8u64;
    sink.set_max_backlog_segments(bound);
    let forging = Arc::new(AtomicBool::new(true));
    let forger =
        forge_pace_notices(&bus, wire::pace::PaceNotice { taken: 1 << 40, stored: 1 << 40, prefetch: 2 }, &forging);
    let contradictions = Contradictions::default();
    let counted = contradictions.clone();
    let publisher = thread::spawn(move || {
        let _counting = counted.count_on_this_thread();
        for idx in 0..2_000u64 {
            match sink.publish(vec![segment(0, idx)]) {
                Ok(()) => {}
                Err(volley_transport::TransportError::Closed) => break,
                Err(err) => panic!("publish: {err}"),
            }
        }
        sink.stats()
    });
    // Until a reading contradicted the notices twice: once the sink had published past the
    // bound on the forger's word, and again when the first distrust period ran out. A fixed
    // 1.5 s wait instead could end before the first one on a loaded machine. The sink
    // publishes nothing after a contradiction: every later reading finds the backlog it left.
    let started = Instant::now();
    while contradictions.seen() < 2 {
        assert!(
            started.elapsed() < GUARD,
            "{} contradictions; {} messages stored",
            contradictions.seen(),
            stream_messages(&bus)
        );
        thread::sleep(Duration::from_millis(10));
    }
    let stored = stream_messages(&bus);
    stop.store(true, std::sync::atomic::Ordering::Release);
    let stats = publisher.join().expect("publisher thread");
    forging.store(false, std::sync::atomic::Ordering::Release);
    forger.join().expect("forger thread");
    // At most twice the contradiction bound (4 * 8 + 16 = 48 messages), plus the messages in
    // flight when a reading was taken (the publish window), before a reading shows it; then
    // consumer readings hold the sink at the bound.
    let window = bus.config().publish_window as u64;
    assert!(stored <= 2 * (4 * bound + 16) + window, "the backlog grew to {stored} messages: {stats:?}");
    assert!(stored >= bound, "the sink published {stored} messages, fewer than the bound");
    assert!(stats.pace_notices_distrusted >= 2, "fewer than two readings contradicted the forged notices: {stats:?}");
}

/// Counts a sink's "pace notices contradicted" warnings (`NatsTrajectorySink` distrusting the
/// notices) on the thread that publishes: a sink paces on the thread that calls `publish`.
/// Its stats say the same, but only once `publish` returns, and a sink that distrusts the
/// notices, with nobody draining the stream, does not return until it is stopped.
#[derive(Clone, Default)]
struct Contradictions(Arc<std::sync::atomic::AtomicU64>);

impl Contradictions {
    fn count_on_this_thread(&self) -> tracing::subscriber::DefaultGuard {
        use tracing_subscriber::layer::SubscriberExt;
        tracing::subscriber::set_default(tracing_subscriber::registry().with(self.clone()))
    }

    fn seen(&self) -> u64 {
        self.0.load(std::sync::atomic::Ordering::Acquire)
    }
}

impl<S: tracing::Subscriber> tracing_subscriber::Layer<S> for Contradictions {
    fn on_event(&self, event: &tracing::Event<'_>, _: tracing_subscriber::layer::Context<'_, S>) {
        struct Message(bool);
        impl tracing::field::Visit for Message {
            fn record_debug(&mut self, field: &tracing::field::Field, value: &dyn std::fmt::Debug) {
                if field.name() == "message" {
                    self.0 |= format!("{value:?}").contains("pace notices contradicted");
                }
            }
        }
        let mut message = Message(false);
        event.record(&mut message);
        if message.0 {
            self.0.fetch_add(1, std::sync::atomic::Ordering::Release);
        }
    }
}

/// Publish `notice` on the run's pace subject every 200 µs until `forging` is cleared.
fn forge_pace_notices(
    bus: &NatsBus,
    notice: wire::pace::PaceNotice,
    forging: &Arc<AtomicBool>,
) -> thread::JoinHandle<()> {
    // A peer of its own: a connection of its own, driven by this thread.
    let forger = NatsBus::connect(bus.config().clone()).expect("the forger connects");
    let subject = subjects::pace(&bus.config().run);
    let forging = forging.clone();
    thread::spawn(move || {
        let notice = Bytes::copy_from_slice(&wire::pace::encode_pace_notice(&notice));
        while forging.load(std::sync::atomic::Ordering::Acquire) {
            forger.block_on(forger.client().publish(subject.clone(), notice.clone())).expect("published");
            thread::sleep(Duration::from_micros(200));
        }
    })
}

#[test]
fn forged_pace_notices_cannot_freeze_a_sink_while_the_learner_drains() {
    // The other lie: notices claiming a huge backlog, while the learner takes everything. The
    // sink, held back by notices alone, checks the consumer, finds the stream drained, and stops
    // trusting them.
    let server = TestNats::start();
    let bus = learner_bus(config(&server, "pacefreeze"));
    let mut sink = bus.trajectory_sink(&actor("a"), Arc::new(AtomicBool::new(false))).expect("sink");
    sink.set_max_backlog_segments(8);
    let forging = Arc::new(AtomicBool::new(true));
    let forger = forge_pace_notices(&bus, wire::pace::PaceNotice { taken: 0, stored: 1 << 40, prefetch: 2 }, &forging);
    let draining = Arc::new(AtomicBool::new(true));
    let learner = {
        let mut source = bus.trajectory_source().expect("source");
        let draining = draining.clone();
        thread::spawn(move || {
            let mut taken = 0;
            while draining.load(std::sync::atomic::Ordering::Acquire) {
                let mut out = Vec::new();
                source.recv(16, Duration::from_millis(50), &mut out).expect("recv");
                taken += out.len();
                source.ack(&out.iter().map(|d| d.token).collect::<Vec<_>>()).expect("ack");
            }
            taken
        })
    };
    let (done_tx, done_rx) = mpsc::channel();
    let publisher = thread::spawn(move || {
        // Not before a forged notice was taken (a pacing check takes the newest one): on a
        // loaded machine the forger's thread may run too late for the sink to see any notice
        // while it publishes.
        let started = Instant::now();
        while sink.stats().pace_notices_used == 0 {
            assert!(started.elapsed() < GUARD, "no forged notice reached the sink");
            sink.wait_for_room(1).expect("room");
            thread::sleep(Duration::from_millis(1));
        }
        for idx in 0..64u64 {
            sink.publish(vec![segment(0, idx)]).expect("publish");
        }
        done_tx.send(()).expect("main thread waits");
        sink.stats()
    });
    done_rx.recv_timeout(GUARD).expect("the sink published all 64 segments despite the forged notices");
    let stats = publisher.join().expect("publisher thread");
    forging.store(false, std::sync::atomic::Ordering::Release);
    forger.join().expect("forger thread");
    draining.store(false, std::sync::atomic::Ordering::Release);
    learner.join().expect("learner thread");
    // How it got through depends on the machine: a reading that found the stream drained
    // (the notices distrusted), or a reading taken whenever the forger's notices paused for
    // 2 ms. Either way the forged notices were taken at first.
    assert!(stats.pace_notices_used >= 1, "the forged notices were never taken: {stats:?}");
}
