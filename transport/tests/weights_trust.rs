//! Weights pointer trust against a real nats-server (issue 12, docs/SECURITY.md): a forged,
//! corrupted or unfetchable pointer is refused, counted and retried with backoff, and never
//! blocks a later valid pointer, whatever version it claimed.

// Only `common::spec` is needed here.
#[allow(dead_code)]
mod common;

use std::sync::Arc;
use std::thread;
use std::time::{Duration, Instant};

use bytes::Bytes;
use volley_core::ids::{PolicyVersion, RunId};
use volley_core::subjects;
use volley_core::wire::Weights;
use volley_testkit::TestNats;
use volley_transport::nats::{NatsBus, NatsConfig, NatsWeightsFollower};
use volley_transport::{WeightsFollower, WeightsPublisher};

/// Bound on any wait: far above what a healthy run needs, only there so a regression fails
/// instead of hanging.
const GUARD: Duration = Duration::from_secs(60);
const N_PARAMS: usize = 16;
const LAYOUT: u64 = 42;

fn learner_bus(server: &TestNats, run_name: &str) -> NatsBus {
    let mut config = NatsConfig::new(server.url(), RunId::new(run_name).unwrap());
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

/// Write a pointer as an attacker with write access to the run's KV bucket would.
fn forge_pointer(bus: &NatsBus, version: u64, object: &str, checksum: &str) {
    let json = format!(
        r#"{{"version":{version},"object":"{object}","checksum":"{checksum}","layout_hash":"{LAYOUT:016x}","size_bytes":100}}"#
    );
    let bucket = subjects::run_bucket(&bus.config().run);
    bus.handle().block_on(async {
        let kv = bus.jetstream().get_key_value(bucket).await.expect("run bucket");
        kv.put(subjects::WEIGHTS_KEY, Bytes::from(json)).await.expect("forged pointer written");
    });
}

/// Call `latest` until the pointer written last has been judged: weights, or an error.
fn next_outcome(follower: &mut NatsWeightsFollower, have: u64) -> Result<Arc<Weights>, String> {
    let started = Instant::now();
    loop {
        assert!(started.elapsed() < GUARD, "no outcome");
        match follower.latest(Some(PolicyVersion(have))) {
            Ok(Some(weights)) => return Ok(weights),
            Ok(None) => thread::sleep(Duration::from_millis(5)),
            Err(err) => return Err(err.to_string()),
        }
    }
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
        // The real v1 object exists under another name; the pointer claims a huge version.
        forge_pointer(&bus, forged_version, &subjects::weights_object(0), "0123456789abcdef");
        let err = next_outcome(&mut follower, 0).expect_err("forged pointer refused");
        assert!(err.contains("refused"), "{err}");
    }
    assert_eq!(follower.refusals(), 3);
    assert_eq!(follower.verified_version(), Some(PolicyVersion(0)));

    // The learner's next real publish is taken at once.
    publisher.publish(weights(1)).expect("v1");
    assert_eq!(next_outcome(&mut follower, 0).expect("v1 taken").version, PolicyVersion(1));

    // So is a later one after a forged pointer to a missing object.
    forge_pointer(&bus, u64::MAX - 1, "v-missing", "0123456789abcdef");
    let err = next_outcome(&mut follower, 1).expect_err("missing object");
    assert!(err.contains("weights fetch"), "{err}");
    publisher.publish(weights(2)).expect("v2");
    assert_eq!(next_outcome(&mut follower, 1).expect("v2 taken").version, PolicyVersion(2));

    // A late joiner that first sees a forged pointer waits for the real one.
    forge_pointer(&bus, 1 << 40, &subjects::weights_object(2), "0123456789abcdef");
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

    forge_pointer(&bus, 5, "v-missing", "0123456789abcdef");
    next_outcome(&mut follower, 0).expect_err("missing object");
    let failed_at = Instant::now();
    assert_eq!(follower.refusals(), 1);
    assert_eq!(follower.retry_pause(), Some(Duration::from_millis(250)));
    // Right after a failure, within the pause: no fetch, no report (checked only for calls
    // made well within the pause, so a slow machine cannot fail the test).
    for _ in 0..100 {
        let outcome = follower.latest(Some(PolicyVersion(0)));
        if failed_at.elapsed() < Duration::from_millis(200) {
            assert!(outcome.expect("within the pause").is_none());
        }
    }
    // After the pause: one more attempt, and the pause doubles.
    thread::sleep(Duration::from_millis(300));
    follower.latest(Some(PolicyVersion(0))).expect_err("still missing");
    assert_eq!(follower.refusals(), 2);
    assert_eq!(follower.retry_pause(), Some(Duration::from_millis(500)));
}
