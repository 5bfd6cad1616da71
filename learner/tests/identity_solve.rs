//! Issue 46, "forged-summary solve": admissible forged episode summaries under ten
//! self-declared actor ids ended a memory run as solved in 0.5 s while the honest agents were
//! at 0.5 of a 0.95 target, because actor ids were bound to nothing and the per-actor return
//! share bounded an id, not a client.
//!
//! Here the learner runs over a real nats-server with the repo's broker config
//! (`broker-config/accounts.conf`, its actor identity slots filled with generated NKeys) and
//! `hyper.trust.max_actor_return_share = 0.5`. One actor identity forges the largest summaries
//! admission allows: under ten other ids on its own subject (refused as `actor_mismatch`),
//! under an honest actor's id on that actor's subject (denied by the broker), and under its own
//! id (at most half the return window). Three honest identities report returns far below the
//! target. The run must not stop as solved; before identities it did.

mod common;

use std::sync::atomic::AtomicBool;
use std::sync::Arc;
use std::thread;
use std::time::Duration;

use volley_core::ids::{ActorId, RunId};
use volley_core::spec::{HyperParams, LossKind, RunSpec, StoreLimits};
use volley_core::wire::TrajectorySegment;
use volley_learner::{Learner, LearnerReport, RunLimits, StopReason, UpdateStats};
use volley_testkit::fixtures::SpecBuilder;
use volley_testkit::TestNats;
use volley_transport::nats::identity::{actor_nkey_variable, ActorIdentity};
use volley_transport::nats::{NatsAuth, NatsBus, NatsConfig, NatsTls};
use volley_transport::TrajectorySink;

const T: usize = 8;
/// The run and the identity slots of `broker-config/accounts.conf`.
const RUN: &str = "local";
const IDENTITIES: usize = 4;
const LEARNER_PASSWORD: &str = "learner-test-password";
/// Honest identities `actor-0` to `actor-2`; the forger is `actor-3`.
const HONEST: usize = 3;
const FORGER: usize = 3;
/// Self-declared ids the forger writes into its segments' bodies, and segments under each.
const FORGED_IDS: u64 = 10;
const SEGMENTS_PER_FORGED_ID: u64 = 15;
/// Segments the forger sends under its own id, and each honest identity.
const FORGER_OWN_SEGMENTS: u64 = 60;
const HONEST_SEGMENTS: u64 = 20;
/// The largest claim admission allows for a CartPole episode (8 steps here, 492 before), and
/// what honest actors earn: far below the target. With a share of 0.5 the forger can lift
/// the window's mean to at most (500 + 8) / 2 = 254.
const FORGED_RETURN: f32 = 500.0;
const HONEST_RETURN: f32 = 8.0;
const TARGET: f32 = 300.0;

fn spec() -> RunSpec {
    // Small store bounds: JetStream reserves each stream's bytes when it is created.
    let stores = StoreLimits {
        trajectory_max_bytes: 64 << 20,
        weights_max_bytes: 128 << 20,
        kv_max_bytes: 16 << 20,
        ..StoreLimits::default()
    };
    let mut hyper = HyperParams {
        loss: LossKind::Vtrace,
        batch_segments: 4,
        max_policy_lag: 1000,
        stores,
        ..HyperParams::default()
    };
    hyper.trust.max_actor_return_share = 0.5;
    SpecBuilder::cartpole(T).run(RUN).torso(vec![16]).hyper(hyper).seed(5).build()
}

fn segment(learner: &Learner, actor: &str, idx: u64, episode_return: f32, episode_len: u32) -> TrajectorySegment {
    common::ended_episode_segment(learner.spec(), actor, idx, episode_return, episode_len)
}

fn bus(server: &TestNats, auth: NatsAuth) -> NatsBus {
    let mut config = NatsConfig::new(server.url(), RunId::new(RUN).expect("a valid run id"))
        .with_tls(NatsTls::with_ca(server.ca_file()));
    config.connect_timeout = Duration::from_secs(10);
    config.request_timeout = Duration::from_secs(2);
    config.retry_deadline = Duration::from_secs(4);
    config.auth = Some(auth);
    NatsBus::connect(config).expect("connect")
}

/// Publish `segments` as `identity` under the id `as_actor` (the sink's subject), and wait
/// until the stream has them; the broker's answer.
fn publish(server: &TestNats, identity: &ActorIdentity, as_actor: &str, segments: Vec<TrajectorySegment>) -> bool {
    let bus = bus(server, identity.auth());
    let mut sink = bus
        .trajectory_sink(&ActorId::new(as_actor).expect("valid"), Arc::new(AtomicBool::new(false)))
        .expect("opening a sink sends nothing");
    sink.publish(segments).and_then(|()| sink.flush()).is_ok()
}

#[test]
fn one_identity_forging_summaries_cannot_end_a_run_as_solved() {
    let identities: Vec<ActorIdentity> = (0..IDENTITIES)
        .map(|index| ActorIdentity::generate(ActorId::new(format!("actor-{index}")).expect("valid")).expect("identity"))
        .collect();
    let accounts = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/../broker-config/accounts.conf"))
        .expect("read the repo's accounts.conf");
    let mut environment = vec![
        ("VOLLEY_LEARNER_PASSWORD".to_string(), LEARNER_PASSWORD.to_string()),
        ("VOLLEY_ENV_SERVER_PASSWORD".to_string(), "env-test-password".to_string()),
    ];
    for (index, identity) in identities.iter().enumerate() {
        environment.push((actor_nkey_variable(index), identity.public_key().to_string()));
    }
    let environment: Vec<(&str, &str)> = environment.iter().map(|(k, v)| (k.as_str(), v.as_str())).collect();
    let server = TestNats::start_with_config(&accounts, &environment);

    let mut learner = Learner::new(spec()).expect("valid spec");
    let learner_bus =
        bus(&server, NatsAuth::UserPassword { user: "learner-local".into(), password: LEARNER_PASSWORD.into() });
    learner_bus.ensure_run(learner.spec()).expect("the learner creates the run");
    let mut source = learner_bus.trajectory_source().expect("the learner's consumer");
    let mut publisher = learner_bus.weights_publisher().expect("the learner's weights publisher");

    // The segments, in the order they reach the stream: every forgery before the honest data,
    // so the forged summaries would fill the return window first.
    let forged_ids: Vec<TrajectorySegment> = (0..FORGED_IDS * SEGMENTS_PER_FORGED_ID)
        .map(|k| segment(&learner, &format!("forger-{}", k % FORGED_IDS), k, FORGED_RETURN, 500))
        .collect();
    let as_honest: Vec<TrajectorySegment> =
        (0..10).map(|k| segment(&learner, "actor-0", 1_000 + k, FORGED_RETURN, 500)).collect();
    let own: Vec<TrajectorySegment> =
        (0..FORGER_OWN_SEGMENTS).map(|k| segment(&learner, "actor-3", k, FORGED_RETURN, 500)).collect();
    let honest: Vec<Vec<TrajectorySegment>> = (0..HONEST)
        .map(|index| {
            (0..HONEST_SEGMENTS)
                .map(|k| segment(&learner, &format!("actor-{index}"), k, HONEST_RETURN, T as u32))
                .collect()
        })
        .collect();
    let outcome = {
        thread::scope(|scope| {
            let forger = &identities[FORGER];
            let sent = scope.spawn(|| {
                // Ten self-declared ids on its own subject (the broker lets it publish there).
                let forged_ids_sent = publish(&server, forger, "actor-3", forged_ids);
                // An honest actor's id on that actor's subject: denied by the broker.
                let as_honest_sent = publish(&server, forger, "actor-0", as_honest);
                let own_sent = publish(&server, forger, "actor-3", own);
                let honest_sent: Vec<bool> = honest
                    .into_iter()
                    .enumerate()
                    .map(|(index, segments)| publish(&server, &identities[index], &format!("actor-{index}"), segments))
                    .collect();
                (forged_ids_sent, as_honest_sent, own_sent, honest_sent)
            });
            // The learner consumes meanwhile, until it has taken every admissible step (the
            // forger's own segments and the honest ones) or stops as solved; the time limit
            // only bounds a hang.
            let admissible_steps = (FORGER_OWN_SEGMENTS + HONEST as u64 * HONEST_SEGMENTS) * T as u64;
            let limits = RunLimits {
                target_return: Some(TARGET),
                max_env_steps: Some(admissible_steps),
                max_duration: Some(Duration::from_secs(300)),
                publish_every: 1,
                ..RunLimits::default()
            };
            let no_control = &mut |_: &mut Learner, _: &LearnerReport, _: &UpdateStats| {};
            let report = common::run_to_end(&mut learner, &mut source, &mut publisher, &limits, no_control);
            (report, sent.join().expect("publisher thread"))
        })
    };
    let (report, (forged_ids_sent, as_honest_sent, own_sent, honest_sent)) = outcome;
    let rejected = &report.segments_rejected;
    eprintln!(
        "stop {:?}, mean of the last 100 {:.1}, rejected {rejected:?}, episodes {}",
        report.stop_reason,
        report.mean_return(100),
        report.episodes
    );
    assert!(forged_ids_sent && own_sent, "the forger may publish on its own subject");
    assert!(!as_honest_sent, "the broker denies the forger an honest actor's subject");
    assert!(honest_sent.iter().all(|&sent| sent), "honest actors publish: {honest_sent:?}");
    assert_ne!(report.stop_reason, Some(StopReason::Solved), "forged summaries ended the run as solved");
    assert_eq!(report.stop_reason, Some(StopReason::EnvStepBudget), "every admissible segment was taken");
    assert_eq!(
        rejected.get("actor_mismatch"),
        Some(&(FORGED_IDS * SEGMENTS_PER_FORGED_ID)),
        "every segment naming another id than its subject's is refused: {rejected:?}"
    );
    let forged_in_window = report.recent_returns.iter().filter(|&&r| r == FORGED_RETURN).count();
    assert!(forged_in_window <= 50, "the forger holds {forged_in_window} of the window, more than its share");
    assert!(report.mean_return(100) < TARGET, "mean {}", report.mean_return(100));
}
