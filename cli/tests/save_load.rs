//! Save-load over a real nats-server: an actor process killed with SIGKILL in the middle of a
//! scheduled episode loses nothing; its work item is redelivered and another actor continues
//! the episode from the last snapshot, ending with exactly the return and length of an
//! uninterrupted run (the snapshot holds the environment, recurrent state, episode statistics
//! and the action-sampling generator).

use std::path::Path;
use std::sync::Arc;
use std::thread;
use std::time::{Duration, Instant};

use volley_actor::RolloutWorker;
use volley_core::ids::{ActorId, PolicyVersion, RunId};
use volley_core::spec::{HyperParams, LossKind, RunSpec};
use volley_core::wire::{EpisodeSummary, Weights};
use volley_core::work::{Start, WorkConfig, WorkItem};
use volley_env::{EnvConfig, MilestonesConfig};
use volley_policy::{Activation, CoreKind, PolicySpec};
use volley_testkit::TestNats;
use volley_transport::nats::{NatsBus, NatsConfig, NatsTls};
use volley_transport::work::{local_work_queue, LocalSnapshotStore, SnapshotStore, WorkQueue};
use volley_transport::{Delivery, TrajectorySource, WeightsPublisher};

mod common;
use common::{volley_args, Proc};

/// A safety net against hangs, not a timed assertion.
const PATIENCE: Duration = Duration::from_secs(120);
const ITEM: u64 = 1;
const SEGMENT_LEN: usize = 16;

fn spec() -> RunSpec {
    RunSpec {
        run: RunId::new("saveload").expect("valid run id"),
        env: EnvConfig::Milestones(MilestonesConfig {
            n_rooms: 2,
            room_len: 6,
            max_steps: 3000,
            ..MilestonesConfig::default()
        }),
        policy: PolicySpec {
            obs_dim: 5,
            n_actions: 3,
            torso: vec![16],
            activation: Activation::Tanh,
            core: CoreKind::Mlp,
            head: volley_policy::ActionHead::Categorical,
            conv: None,
            normalize_obs: false,
            critic: Vec::new(),
        },
        segment_len: SEGMENT_LEN,
        hyper: HyperParams {
            loss: LossKind::Vtrace,
            batch_segments: 4,
            // Nobody consumes while the first actor runs: it stops after a few segments.
            max_backlog_segments: 4,
            work: WorkConfig {
                enabled: true,
                snapshot_every_steps: SEGMENT_LEN as u32,
                ack_wait_secs: 2.0,
                ..WorkConfig::default()
            },
            ..HyperParams::default()
        },
        seed: 11,
    }
}

fn item(seed: u64) -> WorkItem {
    WorkItem { id: ITEM, task_id: 0, start: Start::Fresh { seed }, episodes: 1, group: None }
}

fn weights(spec: &RunSpec) -> Arc<Weights> {
    let layout = spec.validate().expect("valid spec");
    Arc::new(Weights::new(PolicyVersion(0), layout.hash(), layout.init_params(spec.seed)))
}

/// The episode of the work item run in process without interruption.
fn uninterrupted(spec: &RunSpec, seed: u64) -> EpisodeSummary {
    let (mut queue, source) = local_work_queue();
    queue.submit(&[item(seed)]).expect("queued");
    let mut worker = RolloutWorker::new(spec.clone(), ActorId::new("reference").expect("id"), 1, 999, Arc::default())
        .expect("worker")
        .with_work(Box::new(source), Box::new(LocalSnapshotStore::new(64)))
        .expect("work enabled");
    worker.set_weights(weights(spec)).expect("weights");
    for _ in 0..10_000 {
        for segment in worker.collect_segments() {
            if let Some(episode) = segment.finished_episodes.iter().find(|e| e.work_item == Some(ITEM)) {
                return episode.clone();
            }
        }
    }
    panic!("the reference episode did not end");
}

fn spawn_actor(nats: &TestNats, dir: &Path, id: &str) -> Proc {
    let args = volley_args("actor", nats, &["--run", "saveload", "--actor-id", id, "--envs", "1"]);
    Proc::volley(dir, id, &args, PATIENCE)
}

#[test]
fn an_episode_interrupted_by_a_killed_actor_finishes_on_another_with_the_same_return() {
    let spec = spec();
    // A seed whose episode is long enough to be cut: the first actor stops (pacing) after
    // about 5 segments of 16 steps.
    let seed = 5;
    let reference = uninterrupted(&spec, seed);
    assert!(
        reference.episode_len > 6 * SEGMENT_LEN as u32,
        "the reference episode ({} steps) must outlast what the first actor can publish",
        reference.episode_len
    );

    let nats = TestNats::start();
    let dir = tempfile::tempdir().expect("temp dir");
    let bus =
        NatsBus::connect(NatsConfig::new(nats.url(), spec.run.clone()).with_tls(NatsTls::with_ca(nats.ca_file())))
            .expect("connect");
    bus.ensure_run(&spec).expect("run created");
    bus.weights_publisher().expect("publisher").publish(weights(&spec)).expect("weights published");
    // The queue runs the work dispatcher the actors lease items from: kept until the end.
    let mut queue = bus.work_queue(&spec.hyper.work).expect("work queue");
    queue.submit(&[item(seed)]).expect("item queued");
    let mut store = bus.snapshot_store().expect("snapshot store");

    // Actor A runs the item until pacing stops it, saving a snapshot every segment.
    let mut a = spawn_actor(&nats, dir.path(), "actor-a");
    let started = Instant::now();
    let saved_steps = loop {
        if let Some(key) = store.latest_for_item(ITEM).expect("index readable") {
            let snapshot = store.load(&key).expect("store readable").expect("indexed snapshot exists");
            if snapshot.episode_len >= 3 * SEGMENT_LEN as u32 {
                break snapshot.episode_len;
            }
        }
        assert!(started.elapsed() < PATIENCE, "actor A saved no snapshot:\n{}", a.log());
        thread::sleep(Duration::from_millis(50));
    };
    a.kill9();
    let a_log = a.log();
    assert!(saved_steps < reference.episode_len, "A was killed mid-episode");

    // Actor B gets the item once A's claim expires and continues from A's newest snapshot. The
    // test drains the trajectory stream meanwhile, as a learner would.
    let b = spawn_actor(&nats, dir.path(), "actor-b");
    let mut source = bus.trajectory_source().expect("learner consumer");
    let mut deliveries: Vec<Delivery> = Vec::new();
    let started = Instant::now();
    let finished = 'drain: loop {
        deliveries.clear();
        source.recv(64, Duration::from_millis(200), &mut deliveries).expect("recv");
        let tokens: Vec<_> = deliveries.iter().map(|d| d.token).collect();
        for delivery in &deliveries {
            let segment = delivery.segment.as_ref().expect("valid segment");
            if segment.actor != "actor-b" {
                continue;
            }
            if let Some(episode) = segment.finished_episodes.iter().find(|e| e.work_item == Some(ITEM)) {
                break 'drain episode.clone();
            }
        }
        source.ack(&tokens).expect("ack");
        assert!(started.elapsed() < PATIENCE, "the item never finished on actor B:\nA:\n{a_log}\nB:\n{}", b.log());
    };
    let b_log = b.log();
    assert!(
        b_log.contains("continuing an interrupted work item"),
        "B restarted the item instead of continuing it:\n{b_log}"
    );
    assert_eq!(
        (finished.episode_return, finished.episode_len),
        (reference.episode_return, reference.episode_len),
        "the resumed episode differs from the uninterrupted one:\nA:\n{a_log}\nB:\n{b_log}"
    );
    assert_eq!(finished.task_id, 0);
    assert_eq!(finished.start, None, "a fresh-start item keeps reporting a fresh start after a resume");
    drop(b);
    drop(queue);
}
