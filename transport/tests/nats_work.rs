//! The work queue and snapshot store over a real nats-server: items go to one actor at a time,
//! an item its actor neither completes nor keeps alive is delivered again, a completed and
//! confirmed one is not, one reported done but never confirmed is, an actor holds at most its
//! limit of items, garbage on the work subject is dropped, and snapshots round-trip through
//! the store and its per-item index.

#[allow(dead_code)] // this test uses only part of the shared fixtures
mod common;

use std::time::{Duration, Instant};

use rand::SeedableRng;
use volley_core::ids::{ActorId, RunId};
use volley_core::subjects;
use volley_core::work::{EpisodeSnapshot, GroupMember, Start, WorkConfig, WorkItem};
use volley_testkit::TestNats;
use volley_transport::nats::{NatsBus, NatsConfig, NatsTls};
use volley_transport::work::{LeaseCounts, SnapshotStore, WorkQueue, WorkSource, WorkToken};

fn work_config(ack_wait_secs: f64) -> WorkConfig {
    WorkConfig { enabled: true, ack_wait_secs, ..WorkConfig::default() }
}

fn bus_with(server: &TestNats, work: &WorkConfig) -> NatsBus {
    let mut spec = common::spec("work");
    spec.hyper.work = work.clone();
    let bus = NatsBus::connect(
        NatsConfig::new(server.url(), RunId::new("work").unwrap()).with_tls(NatsTls::with_ca(server.ca_file())),
    )
    .expect("connect");
    bus.ensure_run(&spec).expect("run with work objects");
    bus
}

fn bus(server: &TestNats, ack_wait_secs: f64) -> NatsBus {
    bus_with(server, &work_config(ack_wait_secs))
}

fn actor(name: &str) -> ActorId {
    ActorId::new(name).expect("a valid actor id")
}

fn item(id: u64) -> WorkItem {
    WorkItem { id, task_id: 0, start: Start::Fresh { seed: id }, episodes: 1, group: None }
}

/// The dispatcher's counts once `done` holds for them (it counts on its own thread; the wait
/// only bounds a hang).
fn lease_counts_when(queue: &impl WorkQueue, done: impl Fn(&LeaseCounts) -> bool) -> LeaseCounts {
    let started = Instant::now();
    loop {
        let counts = queue.leases().expect("a NATS work queue counts its leases");
        if done(&counts) {
            return counts;
        }
        assert!(started.elapsed() < Duration::from_secs(30), "the dispatcher's counts stayed at {counts:?}");
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// Take an item, retrying within a generous safety net (redelivery happens after ack_wait).
fn take_within(source: &mut impl WorkSource, patience: Duration) -> Option<(WorkItem, WorkToken)> {
    let started = Instant::now();
    while started.elapsed() < patience {
        if let Some(taken) = source.take(Duration::from_millis(200)).expect("take") {
            return Some(taken);
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    None
}

#[test]
fn items_go_to_one_actor_and_an_abandoned_one_is_redelivered() {
    let server = TestNats::start();
    let bus = bus(&server, 1.0);
    let mut queue = bus.work_queue(&work_config(1.0)).expect("queue");
    queue.submit(&[item(1), item(2)]).expect("submit");
    // A retried publish of the same item is stored once (Nats-Msg-Id).
    queue.submit(&[item(2)]).expect("resubmit");
    assert_eq!(queue.queued().expect("depth"), 2);

    let mut first = bus.work_source(&actor("a")).expect("actor a");
    let mut second = bus.work_source(&actor("b")).expect("actor b");
    let (a, token_a) = first.take(Duration::from_secs(5)).expect("take").expect("an item");
    let (b, token_b) = second.take(Duration::from_secs(5)).expect("take").expect("another item");
    assert_ne!(a.id, b.id, "each item goes to one actor");
    second.complete(token_b).expect("complete");
    queue.confirm(b.id, &actor("b"));
    first.progress(token_a).expect("progress");
    // Actor a dies holding its item: nobody completes it; it comes back after ack_wait.
    drop(first);
    let (again, token) = take_within(&mut second, Duration::from_secs(30)).expect("the abandoned item is redelivered");
    assert_eq!(again.id, a.id);
    second.complete(token).expect("complete");
    queue.confirm(a.id, &actor("b"));
    // Counted: three leases, the abandoned one reclaimed, two confirmed.
    let counts = lease_counts_when(&queue, |counts| counts.confirmed == 2);
    assert_eq!((counts.leased, counts.reclaimed, counts.unconfirmed, counts.in_flight), (3, 1, 0, 0), "{counts:?}");
    // Completed and confirmed items never come back.
    std::thread::sleep(Duration::from_millis(1500));
    assert!(second.take(Duration::from_millis(200)).expect("take").is_none());
}

#[test]
fn an_item_whose_ack_a_restart_lost_is_published_again_at_once() {
    // The server stops reading while an item goes out, then dies and comes back: the item's
    // ack never comes, and `submit` publishes it again on the reconnect instead of waiting out
    // its 120 s request timeout.
    let mut server = TestNats::start();
    let mut spec = common::spec("work");
    spec.hyper.work = WorkConfig { enabled: true, ..WorkConfig::default() };
    let mut config =
        NatsConfig::new(server.url(), RunId::new("work").unwrap()).with_tls(NatsTls::with_ca(server.ca_file()));
    config.request_timeout = Duration::from_secs(120);
    let bus = NatsBus::connect(config).expect("connect");
    bus.ensure_run(&spec).expect("run with work objects");
    let mut queue = bus.work_queue(&spec.hyper.work).expect("queue");
    queue.submit(&[item(1)]).expect("before the pause");
    server.pause();
    // Messages the bus's client has sent (its dispatcher has a connection of its own).
    let sent = bus.client().statistics();
    let sent_before = sent.out_messages.load(std::sync::atomic::Ordering::Relaxed);
    let (done, submitted) = std::sync::mpsc::channel();
    let submitter = std::thread::spawn(move || {
        done.send(queue.submit(&[item(2)])).expect("the test waits");
        queue
    });
    // The restart comes only once the client has sent item 2 to the paused server. Waiting a
    // fixed time instead could restart it, on a loaded machine, before the submitter had run:
    // the item then simply went to the new server and nothing was sent again.
    let started = Instant::now();
    while sent.out_messages.load(std::sync::atomic::Ordering::Relaxed) == sent_before {
        assert!(started.elapsed() < Duration::from_secs(60), "item 2 was never sent");
        std::thread::sleep(Duration::from_millis(10));
    }
    server.restart();
    let outcome = submitted.recv_timeout(Duration::from_secs(60)).expect("submit waited for an ack the restart lost");
    outcome.expect("submitted after the restart");
    drop(submitter.join().expect("submitter"));
    // Counted on a connection of its own, with the default timeout: a consumer-info request on
    // the submitter's reconnected connection once went unanswered for its whole 120 s timeout in
    // CI (after the item had been confirmed); this test is about the item, not that request.
    let observer = NatsBus::connect(
        NatsConfig::new(server.url(), RunId::new("work").unwrap()).with_tls(NatsTls::with_ca(server.ca_file())),
    )
    .expect("connect");
    let mut queue = observer.work_queue(&spec.hyper.work).expect("queue");
    let started = Instant::now();
    let depth = loop {
        match queue.queued() {
            Ok(depth) => break depth,
            Err(err) if started.elapsed() < Duration::from_secs(60) => {
                eprintln!("reading the queue's depth failed ({err}); retrying");
                std::thread::sleep(Duration::from_millis(500));
            }
            Err(err) => panic!("depth: {err}"),
        }
    };
    assert_eq!(depth, 2, "each item stored once");
}

/// Group rollouts (issue 18, item 2): the members of a group are separate items, so they spread
/// over actors and an abandoned member comes back on its own, with its group tag, while the
/// other members complete.
#[test]
fn group_members_spread_over_actors_and_an_abandoned_member_is_redelivered_alone() {
    let server = TestNats::start();
    let bus = bus(&server, 1.0);
    let members: Vec<WorkItem> = (0..4u32)
        .map(|member| WorkItem {
            id: 40 + u64::from(member),
            group: Some(GroupMember { group: 40, member, size: 4 }),
            ..item(40)
        })
        .collect();
    let mut queue = bus.work_queue(&work_config(1.0)).expect("queue");
    queue.submit(&members).expect("submit");
    let mut first = bus.work_source(&actor("a")).expect("actor a");
    let mut second = bus.work_source(&actor("b")).expect("actor b");
    let (abandoned, token) = first.take(Duration::from_secs(5)).expect("take").expect("a member");
    first.progress(token).expect("progress");
    let mut completed = Vec::new();
    while let Some((member, token)) = second.take(Duration::from_millis(300)).expect("take") {
        assert_eq!(member.start, Start::Fresh { seed: 40 }, "members share the start");
        completed.push(member.group.expect("tagged").member);
        second.complete(token).expect("complete");
        queue.confirm(member.id, &actor("b"));
        if completed.len() == 3 {
            break;
        }
    }
    assert_eq!(completed.len(), 3, "the other members went to the other actor");
    drop(first);
    let (again, token) = take_within(&mut second, Duration::from_secs(30)).expect("the abandoned member comes back");
    assert_eq!(again, abandoned, "redelivered whole, group tag included");
    second.complete(token).expect("complete");
    queue.confirm(again.id, &actor("b"));
    let mut all: Vec<u32> = completed.into_iter().chain(again.group.map(|g| g.member)).collect();
    all.sort_unstable();
    assert_eq!(all, vec![0, 1, 2, 3]);
    std::thread::sleep(Duration::from_millis(1500));
    assert!(second.take(Duration::from_millis(200)).expect("take").is_none());
}

/// Issue 46: an actor holds at most `max_items_per_actor` items; takes beyond it are refused
/// while another actor still gets items, and an item reported done whose episodes never reach
/// the learner goes to another actor after `confirm_wait_secs`.
#[test]
fn an_actor_holds_at_most_its_limit_and_an_unconfirmed_item_is_handed_out_again() {
    let server = TestNats::start();
    let work = WorkConfig { max_items_per_actor: 2, confirm_wait_secs: 1.0, ..work_config(30.0) };
    let bus = bus_with(&server, &work);
    let mut queue = bus.work_queue(&work).expect("queue");
    queue.submit(&(1..=4).map(item).collect::<Vec<_>>()).expect("submit");
    let mut greedy = bus.work_source(&actor("greedy")).expect("greedy actor");
    let (first, first_token) = greedy.take(Duration::ZERO).expect("take").expect("an item");
    let (second, _) = greedy.take(Duration::ZERO).expect("take").expect("a second item");
    assert!(greedy.take(Duration::ZERO).expect("take").is_none(), "a third item is refused");
    assert_eq!(greedy.refused(), 1);
    let mut honest = bus.work_source(&actor("honest")).expect("honest actor");
    for _ in 0..2 {
        let (other, token) = honest.take(Duration::ZERO).expect("take").expect("the other actor still gets items");
        assert!(![first.id, second.id].contains(&other.id));
        honest.complete(token).expect("done");
        queue.confirm(other.id, &actor("honest"));
    }
    // Reported done without its episodes: handed out again after confirm_wait.
    greedy.complete(first_token).expect("done");
    let (again, token) = take_within(&mut honest, Duration::from_secs(30)).expect("the unconfirmed item comes back");
    assert_eq!(again.id, first.id);
    honest.complete(token).expect("done");
    queue.confirm(again.id, &actor("honest"));
    // The greedy actor's item was taken back: it gets nothing for ack_wait (30 s here).
    assert!(greedy.take(Duration::ZERO).expect("take").is_none(), "refused while cooling");
    assert_eq!(greedy.refused(), 2);
    // What the dispatcher counted (the learner's `volley_learner_work_leases_total` and gauges):
    // 2 + 2 + 1 leases, one take refused at the limit and one while cooling, the unrun item
    // unconfirmed, three confirmed; the greedy actor still holds its second item.
    let counts = lease_counts_when(&queue, |counts| counts.confirmed == 3);
    let expected = LeaseCounts {
        leased: 5,
        refused_limit: 1,
        refused_cooling: 1,
        confirmed: 3,
        reclaimed: 0,
        unconfirmed: 1,
        in_flight: 1,
        most_held: 1,
    };
    assert_eq!(counts, expected);
}

#[test]
fn garbage_on_the_work_subject_is_dropped_and_valid_items_still_flow() {
    let server = TestNats::start();
    let bus = bus(&server, 30.0);
    let subject = subjects::work(&RunId::new("work").unwrap());
    bus.block_on(async {
        let ack = bus.jetstream().publish(subject, "not json".into()).await.expect("publish");
        ack.await.expect("stored");
    });
    let mut queue = bus.work_queue(&work_config(30.0)).expect("queue");
    queue.submit(&[item(7)]).expect("submit");
    let mut source = bus.work_source(&actor("a")).expect("source");
    let (got, _) = take_within(&mut source, Duration::from_secs(10)).expect("the valid item arrives");
    assert_eq!(got.id, 7, "the dispatcher dropped the garbage");
    assert_eq!(source.undecodable(), 0);
}

#[test]
fn snapshots_round_trip_through_the_store_and_its_index() {
    let server = TestNats::start();
    let bus = bus(&server, 30.0);
    let mut store = bus.snapshot_store().expect("store");
    assert_eq!(store.latest_for_item(3).expect("index"), None);
    assert!(store.load("w3-e0-s1").expect("load").is_none(), "a missing snapshot is None, not an error");
    let mut snapshot = EpisodeSnapshot {
        work_item: 3,
        episode_index: 0,
        task_id: 1,
        origin: Some("w1-e0-s4".into()),
        env: vec![9; 300_000],
        hidden: vec![0.25; 8],
        episode_return: 2.5,
        episode_len: 16,
        policy_version: volley_core::ids::PolicyVersion(4),
        rng: rand_pcg::Pcg64Mcg::seed_from_u64(5),
        progress: 1.5,
    };
    let first = store.save(&snapshot).expect("save");
    snapshot.episode_len = 32;
    let second = store.save(&snapshot).expect("save");
    assert_eq!(store.latest_for_item(3).expect("index").as_deref(), Some(second.as_str()));
    assert_eq!(store.load(&second).expect("load").expect("present"), snapshot);
    assert_eq!(store.load(&first).expect("load").expect("present").episode_len, 16);
}
