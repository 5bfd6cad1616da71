//! Weights pointer trust against a real nats-server (issue 12, docs/SECURITY.md): a forged,
//! corrupted or unfetchable pointer is refused, counted and retried with backoff, and never
//! blocks a later valid pointer, whatever version it claimed.

// Only `common::spec` is needed here.
#[allow(dead_code)]
mod common;

use std::sync::Arc;
use std::thread;
use std::time::{Duration, Instant};

use base64::engine::general_purpose::STANDARD;
use base64::Engine as _;
use bytes::Bytes;
use common::next_outcome;
use volley_core::ids::{PolicyVersion, RunId};
use volley_core::subjects;
use volley_core::wire::{frame, Weights};
use volley_testkit::TestNats;
use volley_transport::nats::{NatsBus, NatsConfig, NatsTls, NatsWeightsFollower};
use volley_transport::{WeightsFollower, WeightsPublisher};

/// Bound on any wait: far above what a healthy run needs, only there so a regression fails
/// instead of hanging.
const GUARD: Duration = Duration::from_secs(60);
const N_PARAMS: usize = 16;
const LAYOUT: u64 = 42;

fn learner_bus(server: &TestNats, run_name: &str) -> NatsBus {
    let mut config =
        NatsConfig::new(server.url(), RunId::new(run_name).unwrap()).with_tls(NatsTls::with_ca(server.ca_file()));
    config.request_timeout = Duration::from_secs(2);
    config.retry_deadline = Duration::from_secs(30);
    let bus = NatsBus::connect(config).expect("connect to the test server");
    bus.ensure_run(&common::spec(run_name)).expect("create the run");
    bus
}

fn weights(version: u64) -> Arc<Weights> {
    let params = (0..N_PARAMS).map(|i| (i as f32 * 0.001 + version as f32).sin()).collect();
    Arc::new(Weights::new(PolicyVersion(version), LAYOUT, params))
}

/// Write a pointer as an attacker with write access to the run's KV bucket would: an anchor at
/// `version` (whose object `v<version>` may or may not exist), carrying `inline` when given.
fn forge_pointer(bus: &NatsBus, version: u64, inline: Option<&Weights>, digest: &str) {
    let inline = inline.map_or(String::new(), |weights| {
        format!(r#","inline":"{}""#, STANDARD.encode(frame::encode_full_frame(weights)))
    });
    let json = format!(
        r#"{{"version":{version},"anchor":{version},"digest":"{digest}","layout_hash":"{LAYOUT:016x}","size_bytes":100{inline}}}"#
    );
    forge_json(bus, json);
}

/// Write `json` under the weights key.
fn forge_json(bus: &NatsBus, json: String) {
    let bucket = subjects::run_bucket(&bus.config().run);
    bus.block_on(async {
        let kv = bus.jetstream().get_key_value(bucket).await.expect("run bucket");
        kv.put(subjects::WEIGHTS_KEY, Bytes::from(json)).await.expect("forged pointer written");
    });
}

/// Issue 12: a pointer with a higher version and a wrong checksum (or a missing object) was
/// refused, but from then on actors ignored every real pointer not newer than the bogus one,
/// and writing the real pointer back did not help.
#[test]
fn a_forged_pointer_never_blocks_a_later_valid_one() {
    let server = TestNats::start();
    let bus = learner_bus(&server, "forged");
    let mut publisher = bus.weights_publisher().expect("publisher");
    publisher.publish(weights(0)).expect("v0");
    let mut follower = bus.weights_follower(LAYOUT, N_PARAMS).expect("follower");
    assert_eq!(follower.wait_first(GUARD).expect("v0").version, PolicyVersion(0));

    for forged_version in [1000, 1 << 63, u64::MAX] {
        // Real weights (v0's) inline; the pointer claims a huge version.
        forge_pointer(&bus, forged_version, Some(&weights(0)), "0123456789abcdef");
        let err = next_outcome(&mut follower, 0).expect_err("forged pointer refused");
        assert!(err.contains("refused"), "{err}");
    }
    assert_eq!(follower.refusals(), 3);
    assert_eq!(follower.verified_version(), Some(PolicyVersion(0)));

    // The learner's next real publish is taken at once.
    publisher.publish(weights(1)).expect("v1");
    assert_eq!(next_outcome(&mut follower, 0).expect("v1 taken").version, PolicyVersion(1));

    // So is a later one after a forged pointer to a missing object.
    forge_pointer(&bus, u64::MAX - 1, None, "0123456789abcdef");
    let err = next_outcome(&mut follower, 1).expect_err("missing object");
    assert!(err.contains("weights fetch"), "{err}");
    publisher.publish(weights(2)).expect("v2");
    assert_eq!(next_outcome(&mut follower, 1).expect("v2 taken").version, PolicyVersion(2));

    // A late joiner that first sees a forged pointer waits for the real one.
    forge_pointer(&bus, 1 << 40, Some(&weights(2)), "0123456789abcdef");
    let mut late = bus.weights_follower(LAYOUT, N_PARAMS).expect("follower");
    assert!(late.wait_first(GUARD).is_err(), "the forged pointer is refused");
    publisher.publish(weights(3)).expect("v3");
    assert_eq!(late.wait_first(GUARD).expect("the real pointer").version, PolicyVersion(3));
}

/// Issue 12: a pointer to a missing object produced ~130 warnings a second, with no backoff.
/// Each failed fetch now doubles the pause before the next one (250 ms up to 30 s), and a
/// call within the pause fetches nothing.
#[test]
fn an_unfetchable_pointer_is_retried_with_backoff() {
    let server = TestNats::start();
    let bus = learner_bus(&server, "missing");
    let mut publisher = bus.weights_publisher().expect("publisher");
    publisher.publish(weights(0)).expect("v0");
    let mut follower = bus.weights_follower(LAYOUT, N_PARAMS).expect("follower");
    assert_eq!(follower.wait_first(GUARD).expect("v0").version, PolicyVersion(0));

    forge_pointer(&bus, 5, None, "0123456789abcdef");
    // Before the failed fetch, so its pause ends at least `pause` after this instant.
    let before_failure = Instant::now();
    next_outcome(&mut follower, 0).expect_err("missing object");
    let pause = Duration::from_millis(250);
    assert_eq!(follower.refusals(), 1);
    assert_eq!(follower.retry_pause(), Some(pause));
    // Asked again and again: no fetch and no report within the pause, then one more attempt,
    // which fails again, and the pause doubles. Waiting for that attempt rather than sleeping
    // past the pause: on a loaded machine a fixed sleep's calls could fall after the pause, so
    // the attempt came early and the next call fell within the doubled pause. A call that
    // returned less than `pause` after `before_failure` was made within the pause, however
    // slow the machine.
    let started = Instant::now();
    let mut calls_within_pause = 0;
    loop {
        assert!(started.elapsed() < GUARD, "the pointer was never fetched again");
        match follower.latest(Some(PolicyVersion(0))) {
            Ok(outcome) => {
                assert!(outcome.is_none(), "nothing new while the object is missing");
                if before_failure.elapsed() < pause {
                    calls_within_pause += 1;
                }
            }
            Err(_) => {
                assert!(before_failure.elapsed() >= pause, "fetched again within the pause");
                break;
            }
        }
        thread::sleep(Duration::from_millis(2));
    }
    eprintln!("{calls_within_pause} calls within the pause found no fetch");
    assert_eq!(follower.refusals(), 2);
    assert_eq!(follower.retry_pause(), Some(Duration::from_millis(500)));
}

fn stepped(version: u64) -> Arc<Weights> {
    common::stepped_weights(version, N_PARAMS, LAYOUT)
}

fn put_object(bus: &NatsBus, name: &str, bytes: &[u8]) {
    let bucket = subjects::weights_bucket(&bus.config().run);
    bus.block_on(async {
        let store = bus.jetstream().get_object_store(bucket).await.expect("weights store");
        store.put(name, &mut &bytes[..]).await.expect("object written");
    });
}

/// Wait until the follower's watch has delivered the pointer to `version`, so the next
/// `latest` jumps there directly (skipping the versions in between).
fn wait_announced(follower: &NatsWeightsFollower, version: u64) {
    let started = Instant::now();
    while follower.announced_version() != Some(PolicyVersion(version)) {
        assert!(started.elapsed() < GUARD, "v{version} never announced");
        thread::sleep(Duration::from_millis(2));
    }
}

/// The follower's weights are the learner's, bit for bit.
fn assert_exact(got: &Weights, want: &Weights) {
    assert_eq!(got.version, want.version);
    assert_eq!(got.checksum, want.checksum, "digest of the rebuilt weights");
    let bits = |w: &Weights| w.params.iter().map(|p| p.to_bits()).collect::<Vec<_>>();
    assert_eq!(bits(got), bits(want));
}

/// Issue 16: an actor that missed versions (inside the chain, and across an anchor) and an
/// actor joining late both rebuild the learner's exact weights from anchors and deltas.
#[test]
fn late_and_lagging_followers_rebuild_the_learners_exact_weights_from_deltas() {
    let server = TestNats::start();
    let bus = common::delta_bus(&server, "deltas");
    let mut publisher = bus.weights_publisher().expect("publisher");
    publisher.publish(stepped(0)).expect("v0");
    let mut early = bus.weights_follower(LAYOUT, N_PARAMS).expect("follower");
    assert_exact(&early.wait_first(GUARD).expect("v0"), &stepped(0));
    publisher.publish(stepped(1)).expect("v1");
    assert_exact(&next_outcome(&mut early, 0).expect("v1 from one delta"), &stepped(1));
    let delta_bytes = publisher.last_frame_bytes();
    assert!(delta_bytes < 4 * N_PARAMS + 55, "a small step makes a delta smaller than a full frame: {delta_bytes}");

    // The early actor misses v2..v5; v4 is an anchor, so it starts again from there.
    for version in 2..=5 {
        publisher.publish(stepped(version)).expect("publish");
    }
    wait_announced(&early, 5);
    assert_exact(&next_outcome(&mut early, 1).expect("v5 across an anchor"), &stepped(5));

    // A late joiner starts from the anchor (v4) and applies d5.
    let mut late = bus.weights_follower(LAYOUT, N_PARAMS).expect("follower");
    assert_exact(&late.wait_first(GUARD).expect("v5"), &stepped(5));
    // It then misses v6 and gets v7 from d6 and d7.
    publisher.publish(stepped(6)).expect("v6");
    publisher.publish(stepped(7)).expect("v7");
    wait_announced(&late, 7);
    assert_exact(&next_outcome(&mut late, 5).expect("v7 from two deltas"), &stepped(7));
    assert_eq!(late.refusals() + early.refusals(), 0);

    // The pointer says how to rebuild v7: the chain since its anchor and the digest.
    let bucket = subjects::run_bucket(&bus.config().run);
    let pointer: serde_json::Value = bus.block_on(async {
        let kv = bus.jetstream().get_key_value(bucket).await.expect("run bucket");
        let bytes = kv.get(subjects::WEIGHTS_KEY).await.expect("read").expect("pointer");
        serde_json::from_slice(&bytes).expect("json")
    });
    assert_eq!(pointer["version"], 7);
    assert_eq!(pointer["parent"], 6);
    assert_eq!(pointer["anchor"], 4);
    assert_eq!(pointer["deltas"], serde_json::json!([5, 6, 7]));
    assert_eq!(pointer["digest"], format!("{:016x}", stepped(7).checksum));
}

/// Issue 16, docs/SECURITY.md: a forged delta object, a missing delta and a chain whose
/// rebuilt weights do not match the pointer's digest are each refused (or retried) and
/// counted, the follower keeps its verified version, and the learner's next real version is
/// taken at once.
#[test]
fn forged_or_missing_deltas_and_a_digest_mismatch_are_refused() {
    let server = TestNats::start();
    let bus = common::delta_bus(&server, "bad-deltas");
    let mut publisher = bus.weights_publisher().expect("publisher");
    for version in 0..=2 {
        publisher.publish(stepped(version)).expect("publish");
    }
    let mut follower = bus.weights_follower(LAYOUT, N_PARAMS).expect("follower");
    assert_exact(&follower.wait_first(GUARD).expect("v2"), &stepped(2));
    let layout = format!("{LAYOUT:016x}");
    let delta_pointer = |version: u64, digest: u64| {
        format!(
            r#"{{"version":{version},"parent":2,"anchor":0,"deltas":[1,2,{version}],"digest":"{digest:016x}","layout_hash":"{layout}","size_bytes":100}}"#
        )
    };

    // Garbage under the delta object the pointer implies.
    put_object(&bus, &subjects::weights_delta_object(3), b"garbage");
    forge_json(&bus, delta_pointer(3, stepped(3).checksum));
    let err = next_outcome(&mut follower, 2).expect_err("forged delta");
    assert!(err.contains("refused") && err.contains("bad_magic"), "{err}");

    // A delta that is not there: retried with backoff, not refused for good.
    forge_json(&bus, delta_pointer(5, stepped(5).checksum));
    let err = next_outcome(&mut follower, 2).expect_err("missing delta");
    assert!(err.contains("weights fetch"), "{err}");
    assert_eq!(follower.retry_pause(), Some(Duration::from_millis(250)));

    // A well-formed delta whose rebuilt weights are not what the pointer promises.
    put_object(&bus, &subjects::weights_delta_object(6), &frame::encode_delta_frame(&stepped(2), &stepped(6)));
    forge_json(&bus, delta_pointer(6, stepped(7).checksum));
    let err = next_outcome(&mut follower, 2).expect_err("digest mismatch");
    assert!(err.contains("refused") && err.contains("digest"), "{err}");

    // A delta frame whose own digest does not match what applying it produces.
    let mut lying = (*stepped(7)).clone();
    lying.checksum ^= 1;
    put_object(&bus, &subjects::weights_delta_object(7), &frame::encode_delta_frame(&stepped(2), &lying));
    forge_json(&bus, delta_pointer(7, lying.checksum));
    let err = next_outcome(&mut follower, 2).expect_err("frame digest mismatch");
    assert!(err.contains("refused") && err.contains("checksum"), "{err}");

    // A chain that does not add up is refused before anything is fetched.
    forge_json(
        &bus,
        format!(
            r#"{{"version":9,"parent":2,"anchor":0,"deltas":[1,2,2,9],"digest":"0","layout_hash":"{layout}","size_bytes":100}}"#
        ),
    );
    let err = next_outcome(&mut follower, 2).expect_err("bad chain");
    assert!(err.contains("bad chain"), "{err}");

    assert_eq!(follower.verified_version(), Some(PolicyVersion(2)));
    assert_eq!(follower.refusals(), 5);
    // The learner's real v3 (a delta against v2, replacing the forged object) is taken at once.
    publisher.publish(stepped(3)).expect("v3");
    assert_exact(&next_outcome(&mut follower, 2).expect("v3 taken"), &stepped(3));
}
