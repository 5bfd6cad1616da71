//! Fixtures shared by the NATS integration tests, built with `volley_testkit::fixtures`.

use std::path::PathBuf;
use std::sync::Arc;
use std::thread;
use std::time::{Duration, Instant};

use volley_core::ids::{ActorId, PolicyVersion, RunId};
use volley_core::spec::{HyperParams, RunSpec, StoreLimits};
use volley_core::subjects;
use volley_core::wire::{TrajectorySegment, Weights};
use volley_testkit::fixtures::{SegmentBuilder, SpecBuilder};
use volley_testkit::TestNats;
use volley_transport::nats::identity::{actor_nkey_variable, ActorIdentity};
use volley_transport::nats::{NatsBus, NatsConfig, NatsTls, NatsWeightsFollower};
use volley_transport::WeightsFollower;

pub mod roles;

/// A small CartPole run spec for `run`, with small store bounds: JetStream reserves every
/// stream's `max_bytes` when it is created, and a test broker may use at most 75 % of the free
/// disk, which the defaults (about 7 GB in all with work items) can exceed on a full machine.
pub fn spec(run: &str) -> RunSpec {
    let stores = StoreLimits {
        trajectory_max_bytes: 64 << 20,
        weights_max_bytes: 128 << 20,
        kv_max_bytes: 16 << 20,
        work_max_bytes: 16 << 20,
        snapshot_max_bytes: 64 << 20,
        snapshot_index_max_bytes: 16 << 20,
        ..StoreLimits::default()
    };
    SpecBuilder::cartpole(4).run(run).hyper(HyperParams { stores, ..HyperParams::default() }).seed(7).build()
}

/// A one-step segment whose observations carry its index (not valid against a spec: the
/// transport does not validate, the learner does).
pub fn segment(run: &str, actor: &str, env_idx: u32, segment_idx: u64) -> TrajectorySegment {
    SegmentBuilder::new(1, 1)
        .run(run)
        .actor(actor)
        .env_idx(env_idx)
        .segment_idx(segment_idx)
        .observations_from(|_| segment_idx as f32)
        .log_prob(-0.5)
        .build()
}

/// A connected bus with the run created (the learner's start).
pub fn learner_bus(config: NatsConfig) -> NatsBus {
    let run_name = config.run.to_string();
    let bus = NatsBus::connect(config).expect("connect to the test server");
    bus.ensure_run(&spec(&run_name)).expect("create the run");
    bus
}

/// The messages in the run's trajectory stream.
pub fn stream_messages(bus: &NatsBus) -> u64 {
    let name = subjects::trajectory_stream(&bus.config().run);
    bus.block_on(async {
        let mut stream = bus.jetstream().get_stream(name).await.expect("the stream exists");
        stream.info().await.expect("stream info").state.messages
    })
}

/// (messages not yet delivered, messages delivered and not yet acknowledged) of the learner's
/// consumer.
pub fn consumer_pending(bus: &NatsBus) -> (u64, usize) {
    let name = subjects::trajectory_stream(&bus.config().run);
    bus.block_on(async {
        let stream = bus.jetstream().get_stream(name).await.expect("the stream exists");
        let info = stream.consumer_info(subjects::LEARNER_CONSUMER).await.expect("consumer info");
        (info.num_pending, info.num_ack_pending)
    })
}

/// Publish raw bytes on the run's live weights subject, as anyone with publish rights on it
/// could, and flush.
pub fn publish_live(bus: &NatsBus, chunks: Vec<Vec<u8>>) {
    let subject = subjects::weights_live(&bus.config().run);
    let client = bus.client().clone();
    bus.block_on(async move {
        for chunk in chunks {
            client.publish(subject.clone(), bytes::Bytes::from(chunk)).await.expect("published");
        }
        client.flush().await.expect("flushed");
    });
}

/// Call `latest` on `follower`, which holds version `have`, until the pointer written last has
/// been judged: the weights it took, or the error it refused them with. Bounded by a minute, only
/// so that a regression fails instead of hanging.
pub fn next_outcome(follower: &mut NatsWeightsFollower, have: u64) -> Result<Arc<Weights>, String> {
    let started = Instant::now();
    loop {
        assert!(started.elapsed() < Duration::from_secs(60), "no outcome: {follower:?}");
        match follower.latest(Some(PolicyVersion(have))) {
            Ok(Some(weights)) => return Ok(weights),
            Ok(None) => thread::sleep(Duration::from_millis(5)),
            Err(err) => return Err(err.to_string()),
        }
    }
}

/// A bus for `run_name` whose weights always go through the object store (nothing inline), as
/// anchors every 4 versions and deltas in between.
pub fn delta_bus(server: &TestNats, run_name: &str) -> NatsBus {
    let mut config =
        NatsConfig::new(server.url(), RunId::new(run_name).unwrap()).with_tls(NatsTls::with_ca(server.ca_file()));
    config.request_timeout = Duration::from_secs(2);
    config.weights_inline_max_bytes = 0;
    config.weights_anchor_every = 4;
    let bus = NatsBus::connect(config).expect("connect to the test server");
    bus.ensure_run(&spec(run_name)).expect("create the run");
    bus
}

/// Version `version` of `n_params` parameters that move a little per version, as an
/// optimiser's do.
pub fn stepped_weights(version: u64, n_params: usize, layout_hash: u64) -> Arc<Weights> {
    let params = (0..n_params).map(|i| (i as f32 * 0.37).sin() * (1.0 + version as f32 * 1e-4)).collect();
    Arc::new(Weights::new(PolicyVersion(version), layout_hash, params))
}

/// The passwords the repo's broker config reads from its environment, in `repo_broker`.
pub const LEARNER_PASSWORD: &str = "learner-test-password";
pub const ENV_PASSWORD: &str = "env-test-password";

/// Actor identity slots in the repo's broker config (`actor-0` to `actor-3`, whose public keys
/// it reads from `VOLLEY_ACTOR_<i>_NKEY`; issue 46 item 3).
pub const ACTOR_IDENTITIES: usize = 4;

/// Test identity `actor-<index>` of the repo's broker config: a fixed NKey pair per slot, so
/// every broker `repo_broker` starts knows it.
pub fn actor_identity(index: usize) -> ActorIdentity {
    let raw = [index as u8 + 1; 32];
    let pair = nkeys::KeyPair::new_from_raw(nkeys::KeyPairType::User, raw).expect("a user key from 32 bytes");
    let name = ActorId::new(format!("actor-{index}")).expect("a valid actor id");
    ActorIdentity::from_seed(name, &pair.seed().expect("a seed"), "test").expect("a user seed")
}

/// A file of the repository, from the transport crate's tests.
pub fn repo_file(relative: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("..").join(relative)
}

/// A server running the repo's accounts and permissions (broker-config/accounts.conf) with
/// the passwords above.
pub fn repo_broker() -> TestNats {
    // Verbatim: nats-server resolves `include` relative to the including file, even for
    // absolute paths, so the text is copied rather than included.
    let accounts = std::fs::read_to_string(repo_file("broker-config/accounts.conf")).expect("read accounts.conf");
    TestNats::start_with_config(
        &accounts,
        &repo_broker_environment().iter().map(|(k, v)| (k.as_str(), v.as_str())).collect::<Vec<_>>(),
    )
}

/// What the repo's broker config reads from its environment: passwords and the actor
/// identities' public keys.
pub fn repo_broker_environment() -> Vec<(String, String)> {
    let mut variables = vec![
        ("VOLLEY_LEARNER_PASSWORD".to_string(), LEARNER_PASSWORD.to_string()),
        ("VOLLEY_ENV_SERVER_PASSWORD".to_string(), ENV_PASSWORD.to_string()),
    ];
    for index in 0..ACTOR_IDENTITIES {
        variables.push((actor_nkey_variable(index), actor_identity(index).public_key().to_string()));
    }
    variables
}
