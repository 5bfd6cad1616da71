//! The live weights path against a real nats-server (issue 16, docs/ARCHITECTURE.md "Weights:
//! live path and durable path"): connected followers take versions from the core-NATS fan-out
//! without touching the object store; late joiners and followers that missed versions rebuild
//! the learner's exact weights from the store; corrupted and forged live chunks are refused or
//! overruled by the pointer, and never leave a follower with weights the learner did not
//! publish once the pointer has spoken.

// Only `common::spec` is needed here.
#[allow(dead_code)]
mod common;

use std::sync::Arc;
use std::thread;
use std::time::{Duration, Instant};

use common::publish_live;
use volley_core::ids::{PolicyVersion, RunId};
use volley_core::subjects;
use volley_core::wire::{frame, live, Weights};
use volley_testkit::TestNats;
use volley_transport::nats::{NatsBus, NatsConfig, NatsTls, NatsWeightsFollower};
use volley_transport::{BackgroundPublisher, WeightsFollower, WeightsPublisher};

/// Bound on any wait: only there so a regression fails instead of hanging.
const GUARD: Duration = Duration::from_secs(60);
/// Long enough for both the live chunks and the pointer of a version to have been processed
/// by the follower's background tasks on a loaded machine.
const SETTLE: Duration = Duration::from_millis(300);
/// 256 KiB of parameters: objects in the store (nothing inline); the learner sends a version
/// live as one chunk at the test server's 1 MiB `max_payload`, the forgeries below as three.
const N_PARAMS: usize = 1 << 16;
const LAYOUT: u64 = 0x6c697665;

fn stepped(version: u64) -> Arc<Weights> {
    common::stepped_weights(version, N_PARAMS, LAYOUT)
}

fn assert_exact(got: &Weights, want: &Weights) {
    assert_eq!(got.version, want.version);
    assert_eq!(got.checksum, want.checksum, "digest of the rebuilt weights");
    assert!(got.params.iter().zip(&want.params).all(|(a, b)| a.to_bits() == b.to_bits()), "bit for bit");
}

/// Call `latest` until it yields a version above `have`.
fn next_version(follower: &mut NatsWeightsFollower, have: Option<u64>) -> Arc<Weights> {
    let started = Instant::now();
    loop {
        assert!(started.elapsed() < GUARD, "no version above {have:?}");
        match follower.latest(have.map(PolicyVersion)) {
            Ok(Some(weights)) => return weights,
            Ok(None) => thread::sleep(Duration::from_millis(2)),
            Err(err) => panic!("unexpected error: {err}"),
        }
    }
}

/// Wait until `follower` has reassembled `frames` live versions and seen the pointer to
/// `version`, so the next `latest` chooses between both paths deterministically.
fn both_arrived(follower: &NatsWeightsFollower, frames: u64, version: u64) {
    let started = Instant::now();
    while follower.live_received() < frames || follower.announced_version() != Some(PolicyVersion(version)) {
        assert!(started.elapsed() < GUARD, "v{version} did not arrive: {follower:?}");
        thread::sleep(Duration::from_millis(2));
    }
}

fn live_chunks(frame: &[u8]) -> Vec<Vec<u8>> {
    let (header, _) = frame::decode_frame_header(frame).expect("a frame");
    live::encode_live_chunks(frame, &header, 100_000)
}

#[test]
fn connected_followers_take_versions_live_without_the_object_store() {
    let server = TestNats::start();
    let learner = common::delta_bus(&server, "live");
    let mut publisher = learner.weights_publisher().expect("publisher");
    let actor = common::delta_bus(&server, "live");
    let mut follower = actor.weights_follower(LAYOUT, N_PARAMS).expect("follower");
    assert!(follower.is_live());

    for version in 0..10 {
        publisher.publish(stepped(version)).expect("published");
        // Once both paths have arrived, the live frame is looked at first.
        both_arrived(&follower, version + 1, version);
        let got = next_version(&mut follower, version.checked_sub(1));
        assert_exact(&got, &stepped(version));
    }
    // Anchors (0, 4, 8) and deltas alike came live, the first version included (its frame
    // waited for the first pointer); the store was never read.
    assert_eq!(follower.live_applied(), 10, "{follower:?}");
    assert_eq!(follower.durable_fetches(), 0, "{follower:?}");
    assert_eq!((follower.live_refused(), follower.live_chunks_refused(), follower.refusals()), (0, 0, 0));

    // Without settling: a follower polling as an actor does still gets every version exactly.
    for version in 10..16 {
        publisher.publish(stepped(version)).expect("published");
        assert_exact(&next_version(&mut follower, Some(version - 1)), &stepped(version));
    }
    assert_eq!(follower.refusals(), 0);
}

#[test]
fn lagging_late_and_unsubscribed_followers_get_the_learners_exact_weights() {
    let server = TestNats::start();
    let learner = common::delta_bus(&server, "lagging");
    let mut publisher = learner.weights_publisher().expect("publisher");
    let actor = common::delta_bus(&server, "lagging");
    let mut lagging = actor.weights_follower(LAYOUT, N_PARAMS).expect("follower");
    // A follower that receives nothing live (as one whose live chunks were all lost).
    let (_blind_bus, mut blind) = blind_follower(&actor, N_PARAMS);
    publisher.publish(stepped(0)).expect("v0");
    both_arrived(&lagging, 1, 0);
    assert_exact(&next_version(&mut lagging, None), &stepped(0));
    assert_exact(&next_version(&mut blind, None), &stepped(0));

    // Neither looks while 1..=6 go out (an anchor at 4, deltas between). Live versions are
    // full frames, so the lagging one takes v6 live whatever it missed; the blind one
    // rebuilds v6 from the store: from its v0 across the anchor at 4.
    for version in 1..=6 {
        publisher.publish(stepped(version)).expect("published");
    }
    both_arrived(&lagging, 7, 6);
    assert_exact(&next_version(&mut lagging, Some(0)), &stepped(6));
    assert_eq!((lagging.live_applied(), lagging.durable_fetches()), (2, 0), "{lagging:?}");
    // The blind follower's pointer watch is its own: wait for it to announce v6 too, or it
    // may rightly answer with v5 (a race the CI run once lost).
    both_arrived(&blind, 0, 6);
    assert_exact(&next_version(&mut blind, Some(0)), &stepped(6));
    assert_eq!((blind.live_applied(), blind.durable_fetches()), (0, 2), "{blind:?}");

    // A follower joining now has no live frame at all: the store gives it v6.
    let late_bus = common::delta_bus(&server, "lagging");
    let mut late = late_bus.weights_follower(LAYOUT, N_PARAMS).expect("follower");
    assert_exact(&late.wait_first(GUARD).expect("first weights"), &stepped(6));
    assert_eq!((late.durable_fetches(), late.live_applied()), (1, 0));

    // From then on it is live too: v7 (a delta in the store) reaches it as a full frame.
    publisher.publish(stepped(7)).expect("v7");
    both_arrived(&lagging, 8, 7);
    both_arrived(&late, 1, 7);
    for follower in [&mut lagging, &mut late] {
        assert_exact(&next_version(follower, Some(6)), &stepped(7));
        assert_eq!(follower.durable_fetches(), u64::from(follower.live_applied() == 1), "v7 came live: {follower:?}");
    }
    both_arrived(&blind, 0, 7);
    assert_exact(&next_version(&mut blind, Some(6)), &stepped(7));
}

/// A run whose learner published v0 and whose follower holds it (taken live).
fn holding_v0(server: &TestNats, run: &str) -> (NatsBus, Box<dyn WeightsPublisher>, NatsBus, NatsWeightsFollower) {
    let learner = common::delta_bus(server, run);
    let mut publisher = learner.weights_publisher().expect("publisher");
    let actor = common::delta_bus(server, run);
    let mut follower = actor.weights_follower(LAYOUT, N_PARAMS).expect("follower");
    publisher.publish(stepped(0)).expect("v0");
    both_arrived(&follower, 1, 0);
    assert_exact(&next_version(&mut follower, None), &stepped(0));
    (learner, Box::new(publisher), actor, follower)
}

/// Nothing newer than v0 after the follower had time to see what was sent.
fn still_v0(follower: &mut NatsWeightsFollower) {
    // Waiting on the follower, not sleeping: its bus reads the socket while a thread waits on it.
    assert!(follower.wait_newer(Some(PolicyVersion(0)), SETTLE).expect("no error").is_none());
    assert_eq!(follower.verified_version(), Some(PolicyVersion(0)));
    assert_eq!(follower.durable_fetches(), 0);
}

#[test]
fn corrupted_and_forged_live_chunks_are_refused() {
    let server = TestNats::start();
    let forged_v1 = Weights::new(PolicyVersion(1), LAYOUT, vec![0.25; N_PARAMS]);

    // A bit flipped in a chunk's header: refused on arrival; its version never completes.
    let (learner, _publisher, _actor, mut follower) = holding_v0(&server, "corrupt");
    let mut chunks = live_chunks(&frame::encode_full_frame(&forged_v1));
    assert!(chunks.len() >= 2);
    chunks[1][10] ^= 1;
    publish_live(&learner, chunks);
    still_v0(&mut follower);
    assert_eq!(follower.live_chunks_refused(), 1);

    // A bit flipped in a chunk's payload: the version completes, the frame's checksum refuses it.
    let (learner, _publisher, _actor, mut follower) = holding_v0(&server, "corrupt-payload");
    let mut chunks = live_chunks(&frame::encode_full_frame(&forged_v1));
    chunks[1][live::CHUNK_HEADER_BYTES + 10] ^= 1;
    publish_live(&learner, chunks);
    still_v0(&mut follower);
    assert_eq!((follower.live_chunks_refused(), follower.live_refused()), (0, 1));

    // Sealed chunks whose header digest is not the digest of the frame they carry: the frame
    // rebuilds, the digest check refuses it.
    let (learner, _publisher, _actor, mut follower) = holding_v0(&server, "digest");
    let full = frame::encode_full_frame(&forged_v1);
    let (mut header, _) = frame::decode_frame_header(&full).expect("a frame");
    header.digest ^= 1;
    publish_live(&learner, live::encode_live_chunks(&full, &header, 100_000));
    still_v0(&mut follower);
    assert_eq!(follower.live_refused(), 1);

    // A delta against a version the follower does not hold: a gap, not applied.
    let (learner, _publisher, _actor, mut follower) = holding_v0(&server, "gap");
    let v2 = Weights::new(PolicyVersion(2), LAYOUT, vec![0.5; N_PARAMS]);
    publish_live(&learner, live_chunks(&frame::encode_delta_frame(&stepped(1), &v2)));
    still_v0(&mut follower);

    // A version far above the pointer's waits for a pointer that never comes: never applied,
    // so it cannot make the follower ignore the learner's next versions, which it takes live.
    let (learner, mut publisher, _actor, mut follower) = holding_v0(&server, "far");
    let far = Weights::new(PolicyVersion(1 << 40), LAYOUT, vec![0.75; N_PARAMS]);
    publish_live(&learner, live_chunks(&frame::encode_full_frame(&far)));
    still_v0(&mut follower);
    publisher.publish(stepped(1)).expect("v1");
    both_arrived(&follower, 3, 1);
    assert_exact(&next_version(&mut follower, Some(0)), &stepped(1));
    assert_eq!((follower.live_applied(), follower.durable_fetches()), (2, 0));

    // A well-formed forged anchor at the next version is taken provisionally (a checksum is
    // no signature; the broker's permissions keep forgers off the subject), but the pointer
    // is the source of truth: the learner's v1 pointer carries another digest, so the
    // follower drops the forgery and rebuilds the learner's v1 from the store.
    let (learner, mut publisher, _actor, mut follower) = holding_v0(&server, "overruled");
    publish_live(&learner, live_chunks(&frame::encode_full_frame(&forged_v1)));
    both_arrived(&follower, 2, 0);
    assert_eq!(next_version(&mut follower, Some(0)).checksum, forged_v1.checksum);
    publisher.publish(stepped(1)).expect("v1");
    let started = Instant::now();
    while follower.durable_fetches() == 0 {
        assert!(started.elapsed() < GUARD, "the learner's v1 never replaced the forgery");
        follower.latest(Some(PolicyVersion(1))).expect("no error");
        thread::sleep(Duration::from_millis(5));
    }
    assert_exact(&follower.latest(None).expect("no error").expect("v1"), &stepped(1));
    assert_eq!(follower.live_refused(), 1, "the pointer contradicted the live version");
    // The follower's chain is the learner's again: v2 arrives live against v1.
    publisher.publish(stepped(2)).expect("v2");
    both_arrived(&follower, 3, 2);
    assert_exact(&next_version(&mut follower, Some(1)), &stepped(2));
    assert_eq!(follower.durable_fetches(), 1);
}

#[test]
fn live_off_leaves_the_pointer_alone() {
    let server = TestNats::start();
    let mut config =
        NatsConfig::new(server.url(), RunId::new("off").unwrap()).with_tls(NatsTls::with_ca(server.ca_file()));
    config.weights_inline_max_bytes = 0;
    config.weights_live = false;
    let learner = NatsBus::connect(config.clone()).expect("connect");
    learner.ensure_run(&common::spec("off")).expect("create the run");
    let mut publisher = learner.weights_publisher().expect("publisher");
    let actor = NatsBus::connect(config).expect("connect");
    let mut follower = actor.weights_follower(LAYOUT, N_PARAMS).expect("follower");
    assert!(!follower.is_live());
    for version in 0..3 {
        publisher.publish(stepped(version)).expect("published");
        assert_exact(&next_version(&mut follower, version.checked_sub(1)), &stepped(version));
    }
    assert_eq!((follower.durable_fetches(), follower.live_applied()), (3, 0));
}

#[test]
fn a_waiting_follower_wakes_for_each_new_version_and_times_out_without_one() {
    // `wait_newer` (what `volley bench-weights --poll-ms 0` followers use): woken by the live
    // frame or the pointer, not by polling; `None` when no newer version comes in time.
    let server = TestNats::start();
    let learner = common::delta_bus(&server, "livewait");
    let mut publisher = learner.weights_publisher().expect("publisher");
    let actor = common::delta_bus(&server, "livewait");
    let mut follower = actor.weights_follower(LAYOUT, N_PARAMS).expect("follower");
    publisher.publish(stepped(0)).expect("published");
    let first = follower.wait_newer(None, GUARD).expect("no error").expect("version 0 within the guard");
    assert_exact(&first, &stepped(0));
    let started = Instant::now();
    let none = follower.wait_newer(Some(PolicyVersion(0)), Duration::from_millis(200)).expect("no error");
    assert!(none.is_none(), "no version above 0 was published");
    assert!(started.elapsed() >= Duration::from_millis(200), "returned before its timeout");
    let later = thread::spawn(move || {
        thread::sleep(Duration::from_millis(100));
        for version in 1..=3 {
            publisher.publish(stepped(version)).expect("published");
        }
        publisher
    });
    let mut have = 0;
    while have < 3 {
        let next = follower.wait_newer(Some(PolicyVersion(have)), GUARD).expect("no error").expect("a newer version");
        assert!(next.version.0 > have);
        assert_exact(&next, &stepped(next.version.0));
        have = next.version.0;
    }
    later.join().expect("publisher thread");
}

/// Parameters small enough to travel inside the pointer (a CartPole MLP has about 4,700).
const SMALL_PARAMS: usize = 4096;

fn small(version: u64) -> Arc<Weights> {
    common::stepped_weights(version, SMALL_PARAMS, LAYOUT)
}

/// A bus for inline weights whose pointer is written for every `every`-th version, or after
/// `within` without a newer one.
fn inline_bus(server: &TestNats, run: &str, every: u64, within: Duration) -> NatsBus {
    let mut config =
        NatsConfig::new(server.url(), RunId::new(run).unwrap()).with_tls(NatsTls::with_ca(server.ca_file()));
    config.request_timeout = Duration::from_secs(2);
    config.weights_pointer_every = every;
    config.weights_pointer_within = within;
    let bus = NatsBus::connect(config).expect("connect to the test server");
    bus.ensure_run(&common::spec(run)).expect("create the run");
    bus
}

/// A follower of `bus`'s run, for `n_params` parameters, that receives nothing live.
fn blind_follower(bus: &NatsBus, n_params: usize) -> (NatsBus, NatsWeightsFollower) {
    let mut config = bus.config().clone();
    config.weights_live = false;
    let blind_bus = NatsBus::connect(config).expect("connect");
    let blind = blind_bus.weights_follower(LAYOUT, n_params).expect("follower");
    (blind_bus, blind)
}

#[test]
fn inline_pointers_trail_the_live_path_by_fewer_than_every_versions_and_a_flush_writes_the_last() {
    let server = TestNats::start();
    let learner = inline_bus(&server, "trail", 4, Duration::from_secs(600));
    let mut publisher = learner.weights_publisher().expect("publisher");
    let actor = inline_bus(&server, "trail", 4, Duration::from_secs(600));
    let mut live = actor.weights_follower(LAYOUT, SMALL_PARAMS).expect("follower");
    let (_blind_bus, mut blind) = blind_follower(&actor, SMALL_PARAMS);

    publisher.publish(small(0)).expect("v0");
    both_arrived(&live, 1, 0);
    assert_exact(&next_version(&mut live, None), &small(0));
    // Pointers for 0, 4 and 8 only; the connected follower takes every version live, 5–7 up
    // to three versions above the pointer written last.
    for version in 1..10 {
        publisher.publish(small(version)).expect("published");
        assert_exact(&next_version(&mut live, Some(version - 1)), &small(version));
    }
    assert_eq!((live.live_applied(), live.durable_fetches(), live.refusals()), (10, 0, 0), "{live:?}");
    // The follower without the live path sees the pointers: v8 is the newest it can have.
    both_arrived(&blind, 0, 8);
    assert_exact(&next_version(&mut blind, None), &small(8));
    assert!(blind.wait_newer(Some(PolicyVersion(8)), SETTLE).expect("no error").is_none(), "v9's pointer waits");
    // A flush writes the deferred pointer, and the late follower takes v9 from it.
    publisher.flush().expect("flushed");
    assert_exact(&next_version(&mut blind, Some(8)), &small(9));
    let late_bus = inline_bus(&server, "trail", 4, Duration::from_secs(600));
    let mut late = late_bus.weights_follower(LAYOUT, SMALL_PARAMS).expect("follower");
    assert_exact(&late.wait_first(GUARD).expect("first weights"), &small(9));
    // Nothing left to write: a second flush changes nothing, and the next version's pointer
    // is due by count again (10 is fewer than 4 versions after 9).
    publisher.flush().expect("flushed");
    publisher.publish(small(10)).expect("v10");
    assert_exact(&next_version(&mut live, Some(9)), &small(10));
    assert!(blind.wait_newer(Some(PolicyVersion(9)), SETTLE).expect("no error").is_none(), "v10's pointer waits");
}

#[test]
fn a_learner_killed_between_pointers_restarts_above_what_may_have_gone_out_live() {
    let server = TestNats::start();
    let learner = inline_bus(&server, "killed", 4, Duration::from_secs(600));
    let mut publisher = learner.weights_publisher().expect("publisher");
    assert_eq!(publisher.published_before(), None);
    // Pointers for 0 and 4; 5 and 6 go out live only, and the learner dies without a flush.
    for version in 0..7 {
        publisher.publish(small(version)).expect("published");
    }
    drop(publisher);
    // Up to 4 + 3 may have reached actors: the next learner continues above 7, not above 4,
    // or actors holding 5 or 6 would ignore its first versions and their segments would come
    // from its future.
    let restarted = inline_bus(&server, "killed", 4, Duration::from_secs(600));
    assert_eq!(restarted.weights_publisher().expect("publisher").published_before(), Some(PolicyVersion(7)));
    // With every pointer written, the pointer's version is the newest.
    let every = inline_bus(&server, "every", 1, Duration::from_secs(600));
    let mut publisher = every.weights_publisher().expect("publisher");
    for version in 0..3 {
        publisher.publish(small(version)).expect("published");
    }
    assert_eq!(every.weights_publisher().expect("publisher").published_before(), Some(PolicyVersion(2)));
    // Weights in the object store write every pointer whatever the setting, and say so.
    let mut config = every.config().clone();
    config.run = RunId::new("objects").unwrap();
    config.weights_pointer_every = 4;
    config.weights_inline_max_bytes = 0;
    let objects = NatsBus::connect(config).expect("connect");
    objects.ensure_run(&common::spec("objects")).expect("create the run");
    let mut publisher = objects.weights_publisher().expect("publisher");
    for version in 0..3 {
        publisher.publish(small(version)).expect("published");
    }
    assert_eq!(objects.weights_publisher().expect("publisher").published_before(), Some(PolicyVersion(2)));
}

#[test]
fn a_deferred_pointer_is_written_when_no_newer_version_comes() {
    // The learner's publisher runs in the background: a version whose pointer was deferred
    // gets it `weights_pointer_within` after the last pointer, without a flush.
    let server = TestNats::start();
    let within = Duration::from_millis(200);
    let learner = inline_bus(&server, "idle", 4, within);
    let mut publisher = BackgroundPublisher::new(learner.weights_publisher().expect("publisher")).expect("thread");
    let actor = inline_bus(&server, "idle", 4, within);
    let (_blind_bus, mut blind) = blind_follower(&actor, SMALL_PARAMS);
    publisher.publish(small(0)).expect("v0");
    assert_exact(&blind.wait_first(GUARD).expect("first weights"), &small(0));
    let handed = Instant::now();
    publisher.publish(small(1)).expect("v1");
    let got = blind.wait_newer(Some(PolicyVersion(0)), GUARD).expect("no error").expect("v1 within the guard");
    assert_exact(&got, &small(1));
    assert!(handed.elapsed() >= within / 2, "v1's pointer was deferred, not written at once ({:?})", handed.elapsed());
    publisher.flush().expect("nothing left to write");
}

#[test]
fn versions_taken_on_the_learners_thread_reach_live_blind_and_late_followers_exactly() {
    // Through the background publisher, a version whose pointer may wait is taken on the
    // caller's thread when the publisher's thread is idle (no hand-off): followers must not
    // tell the difference.
    let server = TestNats::start();
    let learner = inline_bus(&server, "taken", 4, Duration::from_secs(600));
    let mut publisher = BackgroundPublisher::new(learner.weights_publisher().expect("publisher")).expect("thread");
    let actor = inline_bus(&server, "taken", 4, Duration::from_secs(600));
    let mut live = actor.weights_follower(LAYOUT, SMALL_PARAMS).expect("follower");
    let (_blind_bus, mut blind) = blind_follower(&actor, SMALL_PARAMS);
    for version in 0..10 {
        publisher.publish(small(version)).expect("published");
        // Taken at once, unless its pointer is due (0, 4, 8: the thread writes it).
        assert!(version % 4 == 0 || publisher.is_published(PolicyVersion(version)), "v{version} not taken at once");
        // The learner's next call on the bus (its `recv`) writes what the publish queued.
        learner.block_on(async {});
        assert_exact(&next_version(&mut live, version.checked_sub(1)), &small(version));
        let started = Instant::now();
        while !publisher.is_published(PolicyVersion(version)) {
            assert!(started.elapsed() < GUARD, "v{version} not published");
            thread::sleep(Duration::from_millis(1));
        }
    }
    assert_eq!((live.live_applied(), live.durable_fetches(), live.refusals()), (10, 0, 0), "{live:?}");
    // The follower without the live path sees the pointers the thread wrote: v8 is the newest.
    both_arrived(&blind, 0, 8);
    assert_exact(&next_version(&mut blind, None), &small(8));
    // A flush writes v9's pointer, deferred on the caller's thread, with its frame inline.
    publisher.flush().expect("flushed");
    assert_exact(&next_version(&mut blind, Some(8)), &small(9));
    let late_bus = inline_bus(&server, "taken", 4, Duration::from_secs(600));
    let mut late = late_bus.weights_follower(LAYOUT, SMALL_PARAMS).expect("follower");
    assert_exact(&late.wait_first(GUARD).expect("first weights"), &small(9));
}

/// Issue 46: a well-formed live anchor whose parameters are NaN (or infinite, or 3e38), its
/// digest valid, was applied, and every actor then panicked in its action sampler. Such a
/// frame is refused and counted; the learner's next version is still taken.
#[test]
fn a_live_anchor_of_unusable_parameters_with_a_valid_digest_is_refused() {
    let server = TestNats::start();
    for (k, bad) in [f32::NAN, f32::INFINITY, 3e38].into_iter().enumerate() {
        let (learner, mut publisher, _actor, mut follower) = holding_v0(&server, &format!("nan-anchor-{k}"));
        let mut params = vec![0.25; N_PARAMS];
        params[17] = bad;
        let forged = Weights::new(PolicyVersion(1), LAYOUT, params);
        publish_live(&learner, live_chunks(&frame::encode_full_frame(&forged)));
        let started = Instant::now();
        while follower.live_received() < 2 {
            assert!(started.elapsed() < GUARD, "the forged frame never completed: {follower:?}");
            thread::sleep(Duration::from_millis(2));
        }
        still_v0(&mut follower);
        assert_eq!(follower.live_refused(), 1, "{bad}");
        // The learner's own v1: its live frame has the refused frame's version, so it comes
        // by the pointer and the store.
        publisher.publish(stepped(1)).expect("v1");
        both_arrived(&follower, 2, 1);
        assert_exact(&next_version(&mut follower, Some(0)), &stepped(1));
    }
}

/// Overwrite the run's weights pointer with the pointer written last, its version set to
/// `version` and its inline frame relabelled to match (the digest stays right: the parameters
/// are the learner's), as a holder of KV write access could.
fn forge_pointer(bus: &NatsBus, version: u64) {
    use base64::Engine as _;
    let bucket = subjects::run_bucket(&bus.config().run);
    let client = bus.client().clone();
    bus.block_on(async move {
        let js = async_nats::jetstream::new(client);
        let kv = js.get_key_value(bucket).await.expect("the run's bucket");
        let current = kv.get(subjects::WEIGHTS_KEY).await.expect("read").expect("a pointer");
        let mut pointer: serde_json::Value = serde_json::from_slice(&current).expect("json");
        let engine = base64::engine::general_purpose::STANDARD;
        let inline = engine.decode(pointer["inline"].as_str().expect("inline weights")).expect("base64");
        let mut weights = frame::decode_frame(&inline, None, LAYOUT, SMALL_PARAMS).expect("the learner's frame");
        weights.version = PolicyVersion(version);
        pointer["version"] = version.into();
        pointer["anchor"] = version.into();
        pointer["inline"] = engine.encode(frame::encode_full_frame(&weights)).into();
        kv.put(subjects::WEIGHTS_KEY, serde_json::to_vec(&pointer).expect("json").into()).await.expect("put");
    });
}

/// Issue 46, the forged pointer stall: a well-formed pointer to a real frame relabelled
/// +10⁶, or to version 2⁶⁴ − 1, was adopted; every honest version after it was older, so
/// actors kept it until they restarted, and the learner refused their segments as future
/// versions. Now a following actor refuses the jump and counts it, and takes the learner's
/// next version; one that joined right after the forgery (it has nothing to measure a jump
/// from) goes back to the learner's versions after `REWIND_AFTER_WRITES` pointers.
#[test]
fn a_forged_pointer_far_ahead_is_refused_and_cannot_stall_the_followers() {
    use volley_transport::nats::weights::{MAX_VERSION_JUMP, REWIND_AFTER_WRITES};
    let server = TestNats::start();
    let learner = inline_bus(&server, "forged-ptr", 1, Duration::from_secs(600));
    let mut publisher = learner.weights_publisher().expect("publisher");
    let actor = inline_bus(&server, "forged-ptr", 1, Duration::from_secs(600));
    let (_blind_bus, mut follower) = blind_follower(&actor, SMALL_PARAMS);
    publisher.publish(small(0)).expect("v0");
    assert_exact(&next_version(&mut follower, None), &small(0));
    let mut version = 0;
    for (k, forged) in [1_000_000, u64::MAX].into_iter().enumerate() {
        assert!(forged > MAX_VERSION_JUMP);
        forge_pointer(&learner, forged);
        both_arrived(&follower, 0, forged);
        let err = follower.latest(Some(PolicyVersion(version))).expect_err("the jump is refused");
        assert!(err.to_string().contains("versions above") || err.to_string().contains("beyond"), "{err}");
        assert_eq!(follower.jumps_refused(), k as u64 + 1);
        assert_eq!(follower.verified_version(), Some(PolicyVersion(version)));
        version += 1;
        publisher.publish(small(version)).expect("the learner's next version");
        assert_exact(&next_version(&mut follower, Some(version - 1)), &small(version));
    }

    // An actor that starts right after a forgery takes it (nothing to measure it against),
    // and goes back to the learner's versions once the learner kept writing lower ones.
    forge_pointer(&learner, 1_000_000);
    let (_late_bus, mut late) = blind_follower(&actor, SMALL_PARAMS);
    assert_eq!(late.wait_first(GUARD).expect("first weights").version, PolicyVersion(1_000_000));
    let mut got = None;
    for _ in 0..REWIND_AFTER_WRITES {
        version += 1;
        publisher.publish(small(version)).expect("published");
        both_arrived(&late, 0, version);
        got = late.latest(Some(PolicyVersion(1_000_000))).expect("no error");
    }
    assert_exact(&got.expect("the learner's version after the rewind"), &small(version));
    assert_eq!(late.rewinds(), 1);
    version += 1;
    publisher.publish(small(version)).expect("published");
    assert_exact(&next_version(&mut late, Some(version - 1)), &small(version));
}
