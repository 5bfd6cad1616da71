//! Signed weights against a real nats-server (issue 46 item 2, docs/SECURITY.md "signed
//! weights"): a follower given the learner's public key takes only versions signed with it.
//! An unsigned version, one signed with another key, and one whose signature was made for
//! another run or another version are refused and counted, on the durable path (the KV pointer
//! and the object store) and on the live path alike, and the learner's next version is taken
//! right after them.

// Only `common::spec` and `common::delta_bus` are needed here.
#[allow(dead_code)]
mod common;

use std::sync::Arc;
use std::time::{Duration, Instant};

use base64::engine::general_purpose::STANDARD;
use base64::Engine as _;
use bytes::Bytes;
use common::next_outcome;
use volley_core::ids::{PolicyVersion, RunId};
use volley_core::subjects;
use volley_core::wire::{frame, live, Weights};
use volley_testkit::TestNats;
use volley_transport::nats::{NatsBus, NatsConfig, NatsTls, NatsWeightsFollower};
use volley_transport::signing::{SignedVersion, WeightsSigningKey};
use volley_transport::{WeightsFollower, WeightsPublisher};

/// Bound on any wait: only there so a regression fails instead of hanging.
const GUARD: Duration = Duration::from_secs(60);
const LAYOUT: u64 = 0x5167;
/// Small weights: inline in the pointer, and sent live.
const N_INLINE: usize = 16;
/// Weights in the object store (see `common::delta_bus`).
const N_STORED: usize = 4096;

fn weights(version: u64, n_params: usize) -> Arc<Weights> {
    common::stepped_weights(version, n_params, LAYOUT)
}

/// A bus whose small weights go inline and whose every pointer is written (no deferral).
fn inline_bus(server: &TestNats, run: &str) -> NatsBus {
    let mut config =
        NatsConfig::new(server.url(), RunId::new(run).unwrap()).with_tls(NatsTls::with_ca(server.ca_file()));
    config.request_timeout = Duration::from_secs(2);
    config.weights_pointer_every = 1;
    let bus = NatsBus::connect(config).expect("connect to the test server");
    bus.ensure_run(&common::spec(run)).expect("create the run");
    bus
}

/// The run's pointer JSON as the learner wrote it.
fn read_pointer(bus: &NatsBus) -> serde_json::Value {
    let bucket = subjects::run_bucket(&bus.config().run);
    let bytes = bus.block_on(async {
        let kv = bus.jetstream().get_key_value(bucket).await.expect("run bucket");
        kv.get(subjects::WEIGHTS_KEY).await.expect("read").expect("a pointer")
    });
    serde_json::from_slice(&bytes).expect("json")
}

/// Write an inline pointer to `weights` as a client with write access to the run's KV bucket
/// could, with `signature` (base64) when given.
fn forge_pointer(bus: &NatsBus, weights: &Weights, signature: Option<String>) {
    let mut pointer = serde_json::json!({
        "version": weights.version.0,
        "anchor": weights.version.0,
        "digest": format!("{:016x}", weights.checksum),
        "layout_hash": format!("{LAYOUT:016x}"),
        "size_bytes": 100,
        "inline": STANDARD.encode(frame::encode_full_frame(weights)),
    });
    if let Some(signature) = signature {
        pointer["signature"] = serde_json::Value::String(signature);
    }
    let bucket = subjects::run_bucket(&bus.config().run);
    bus.block_on(async {
        let kv = bus.jetstream().get_key_value(bucket).await.expect("run bucket");
        kv.put(subjects::WEIGHTS_KEY, Bytes::from(pointer.to_string())).await.expect("forged pointer written");
    });
}

/// Publish the live chunks of `weights`' full frame with `signature`, as a client with publish
/// rights on the live subject could.
fn forge_live(bus: &NatsBus, weights: &Weights, signature: Option<&[u8; 64]>) {
    let (chunks, _) = live::encode_signed_full_frame_chunks(weights, signature, 100_000);
    common::publish_live(bus, chunks);
}

/// Wait (on the follower, which reads its socket meanwhile) until `follower` has reassembled
/// `frames` live versions and judged them.
fn live_judged(follower: &mut NatsWeightsFollower, frames: u64, have: u64) {
    let started = Instant::now();
    while follower.live_received() < frames {
        assert!(started.elapsed() < GUARD, "{frames} live frames never arrived: {follower:?}");
        let _ = follower.wait_newer(Some(PolicyVersion(have)), Duration::from_millis(20));
    }
    let _ = follower.latest(Some(PolicyVersion(have)));
}

#[test]
fn unsigned_and_wrongly_signed_pointers_are_refused_counted_and_never_block_the_next_signed_one() {
    let server = TestNats::start();
    let key = Arc::new(WeightsSigningKey::generate());
    let stranger = WeightsSigningKey::generate();
    let learner = inline_bus(&server, "signed");
    let mut publisher = learner.weights_publisher().expect("publisher");
    publisher.sign_with(key.clone());
    publisher.publish(weights(0, N_INLINE)).expect("v0");
    let v0_signature = read_pointer(&learner)["signature"].as_str().expect("the pointer is signed").to_string();

    let actor = inline_bus(&server, "signed");
    let mut follower = actor.weights_follower(LAYOUT, N_INLINE).expect("follower");
    follower.require_signatures(key.public_keys());
    assert_eq!(follower.wait_first(GUARD).expect("v0 is signed").version, PolicyVersion(0));

    // Real-looking weights at v1: valid frame, valid digest, no signature.
    let forged = weights(1, N_INLINE);
    forge_pointer(&learner, &forged, None);
    let err = next_outcome(&mut follower, 0).expect_err("unsigned");
    assert!(err.contains("no signature"), "{err}");
    assert_eq!((follower.unsigned(), follower.bad_signature()), (1, 0));

    // Signed, but by a key the follower does not trust.
    let sign = |key: &WeightsSigningKey, run: &str, weights: &Weights| {
        STANDARD.encode(key.sign(&SignedVersion::of(run, weights)))
    };
    let bad = Weights::new(PolicyVersion(2), LAYOUT, vec![0.5; N_INLINE]);
    forge_pointer(&learner, &bad, Some(sign(&stranger, "signed", &bad)));
    assert!(next_outcome(&mut follower, 0).expect_err("another key").contains("no trusted key"));
    // The learner's own v0 signature on v0's parameters relabelled v3: the version is signed.
    let relabelled = Weights::new(PolicyVersion(3), LAYOUT, weights(0, N_INLINE).params.clone());
    forge_pointer(&learner, &relabelled, Some(v0_signature));
    assert!(next_outcome(&mut follower, 0).expect_err("another version").contains("no trusted key"));
    // The learner's key, but made for another run (a learner of another run sharing the key).
    let elsewhere = weights(4, N_INLINE);
    forge_pointer(&learner, &elsewhere, Some(sign(&key, "other-run", &elsewhere)));
    assert!(next_outcome(&mut follower, 0).expect_err("another run").contains("no trusted key"));
    // Not base64 of 64 bytes at all.
    forge_pointer(&learner, &weights(5, N_INLINE), Some("not a signature".into()));
    next_outcome(&mut follower, 0).expect_err("garbage");
    assert_eq!((follower.unsigned(), follower.bad_signature()), (1, 4));
    assert_eq!(follower.paths().bad_signature, 4);
    assert_eq!(follower.verified_version(), Some(PolicyVersion(0)));

    // The learner's next version is taken at once.
    publisher.publish(weights(1, N_INLINE)).expect("v1");
    let v1 = next_outcome(&mut follower, 0).expect("the signed v1");
    assert_eq!((v1.version, v1.checksum), (PolicyVersion(1), weights(1, N_INLINE).checksum));

    // A follower without keys takes unsigned versions (the default: docs/SECURITY.md).
    forge_pointer(&learner, &weights(9, N_INLINE), None);
    let mut open = actor.weights_follower(LAYOUT, N_INLINE).expect("follower");
    assert_eq!(next_outcome(&mut open, 0).expect("unsigned taken").version, PolicyVersion(9));
}

#[test]
fn object_store_versions_are_signed_through_their_delta_chain() {
    let server = TestNats::start();
    let key = Arc::new(WeightsSigningKey::generate());
    let learner = common::delta_bus(&server, "signed-chain");
    let mut publisher = learner.weights_publisher().expect("publisher");
    publisher.sign_with(key.clone());
    let actor = common::delta_bus(&server, "signed-chain");
    let mut follower = actor.weights_follower(LAYOUT, N_STORED).expect("follower");
    follower.require_signatures(key.public_keys());
    for version in 0..6 {
        publisher.publish(weights(version, N_STORED)).expect("published");
    }
    // A late joiner rebuilds v5 from the anchor v4 and the delta v5, and verifies it.
    let mut late = actor.weights_follower(LAYOUT, N_STORED).expect("late follower");
    late.require_signatures(key.public_keys());
    assert_eq!(late.wait_first(GUARD).expect("v5").checksum, weights(5, N_STORED).checksum);
    let mut have = None;
    while have != Some(PolicyVersion(5)) {
        have = Some(follower.wait_newer(have, GUARD).expect("no refusal").expect("a version").version);
    }
    assert_eq!((follower.unsigned(), follower.bad_signature(), late.unsigned(), late.bad_signature()), (0, 0, 0, 0));

    // The same chain from an unsigned learner (its key lost, say) is refused, durable or live.
    let mut unsigned = learner.weights_publisher().expect("publisher");
    unsigned.publish(weights(6, N_STORED)).expect("v6");
    let started = Instant::now();
    while follower.unsigned() < 2 {
        assert!(started.elapsed() < GUARD, "the unsigned v6 was not refused on both paths: {follower:?}");
        let _ = follower.wait_newer(Some(PolicyVersion(5)), Duration::from_millis(20));
    }
    assert_eq!(follower.verified_version(), Some(PolicyVersion(5)));
}

#[test]
fn unsigned_and_wrongly_signed_live_versions_are_refused_and_the_next_signed_one_is_taken() {
    let server = TestNats::start();
    let key = Arc::new(WeightsSigningKey::generate());
    let stranger = WeightsSigningKey::generate();
    let learner = common::delta_bus(&server, "signed-live");
    let mut publisher = learner.weights_publisher().expect("publisher");
    publisher.sign_with(key.clone());
    let actor = common::delta_bus(&server, "signed-live");
    let mut follower = actor.weights_follower(LAYOUT, N_STORED).expect("follower");
    follower.require_signatures(key.public_keys());
    publisher.publish(weights(0, N_STORED)).expect("v0");
    let mut have = None;
    while have.is_none() {
        have = follower.wait_newer(None, GUARD).expect("v0").map(|w| w.version);
    }

    // A well-formed anchor at the next version with a valid digest: without a signature a
    // follower that requires them never takes it, not even provisionally. (Each forgery is of
    // a version of its own: the reassembly completes each version once.)
    let forged = |version| Weights::new(PolicyVersion(version), LAYOUT, vec![0.25; N_STORED]);
    forge_live(&learner, &forged(1), None);
    live_judged(&mut follower, 2, 0);
    // Signed by another key.
    forge_live(&learner, &forged(2), Some(&stranger.sign(&SignedVersion::of("signed-live", &forged(2)))));
    live_judged(&mut follower, 3, 0);
    assert_eq!(follower.verified_version(), Some(PolicyVersion(0)));
    assert_eq!((follower.unsigned(), follower.bad_signature(), follower.live_refused()), (1, 1, 2));

    // The learner's v1 is taken right after.
    publisher.publish(weights(1, N_STORED)).expect("v1");
    let v1 = follower.wait_newer(Some(PolicyVersion(0)), GUARD).expect("no refusal").expect("v1");
    assert_eq!((v1.version, v1.checksum), (PolicyVersion(1), weights(1, N_STORED).checksum));

    // The learner's own key over another run's version.
    forge_live(&learner, &forged(3), Some(&key.sign(&SignedVersion::of("other-run", &forged(3)))));
    // Judged once counted: waiting for one more received frame than before raced with the
    // follower's reader, which may have taken the forgery (or v1's own late live frame) already.
    let started = Instant::now();
    while follower.bad_signature() < 2 {
        assert!(started.elapsed() < GUARD, "the other run's signature was never judged: {follower:?}");
        let _ = follower.wait_newer(Some(PolicyVersion(1)), Duration::from_millis(20));
        let _ = follower.latest(Some(PolicyVersion(1)));
    }
    assert_eq!(follower.verified_version(), Some(PolicyVersion(1)));
    assert_eq!((follower.unsigned(), follower.bad_signature()), (1, 2));
    publisher.publish(weights(2, N_STORED)).expect("v2");
    let mut have = PolicyVersion(1);
    while have < PolicyVersion(2) {
        have = follower.wait_newer(Some(have), GUARD).expect("no refusal").expect("v2").version;
    }
    assert_eq!(follower.latest(None).expect("no error").expect("v2").checksum, weights(2, N_STORED).checksum);
}
