//! Issue 46, item 5: one actor cannot starve the work queue. With the repo's broker config, a
//! hostile client holding only actor credentials takes work items as fast as it can (straight
//! from the work stream's consumer, as actors once could, and through the learner's work
//! dispatcher), either never acknowledging them or acknowledging them without running them,
//! while honest actors run theirs; the honest actors still complete at least 90 % of the
//! groups within a budget of episodes.
//!
//! Before the fix the hostile client pulled every queued item from the shared consumer: held
//! ones came back only to be pulled again, acknowledged ones were gone, and the honest actors
//! ran unscheduled episodes until their budget ran out.

#[allow(dead_code)] // this test uses only part of the shared fixtures
mod common;
use common::{actor_identity, repo_broker, LEARNER_PASSWORD};

use std::collections::{HashMap, HashSet};
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{mpsc, Arc};
use std::thread;
use std::time::Duration;

use bytes::Bytes;
use futures::StreamExt;
use volley_core::ids::{ActorId, RunId};
use volley_core::subjects;
use volley_core::work::{GroupMember, Start, WorkConfig, WorkItem};
use volley_testkit::TestNats;
use volley_transport::nats::{NatsAuth, NatsBus, NatsConfig, NatsTls};
use volley_transport::work::{WorkQueue, WorkSource};

/// The run `broker-config/accounts.conf` has users for.
const RUN: &str = "local";
/// Groups of [`GROUP_SIZE`] members each, all queued at the start.
const GROUPS: u64 = 48;
const GROUP_SIZE: u32 = 4;
const HONEST_ACTORS: usize = 3;
/// Environment steps of one episode (a work item is one episode).
const EPISODE_STEPS: usize = 20;
/// Episodes each honest actor may run, scheduled or not: three times its share of the items.
const EPISODE_BUDGET: usize = 3 * (GROUPS as usize * GROUP_SIZE as usize) / HONEST_ACTORS;
/// Bound on any wait: only there so that a regression fails instead of hanging.
const GUARD: Duration = Duration::from_secs(120);

#[derive(Debug, Clone, Copy)]
enum Hostility {
    /// Take items and never acknowledge them or signal progress.
    Hoard,
    /// Take items and acknowledge them at once, without running them.
    AckUnrun,
}

fn connect(server: &TestNats, auth: NatsAuth) -> NatsBus {
    let mut config = NatsConfig::new(server.url(), RunId::new(RUN).expect("a valid run id"))
        .with_tls(NatsTls::with_ca(server.ca_file()));
    config.connect_timeout = Duration::from_secs(10);
    config.request_timeout = Duration::from_secs(2);
    config.auth = Some(auth);
    NatsBus::connect(config).expect("connect")
}

/// The identity slot of the hostile client: the honest actors hold the slots before it.
const HOSTILE_IDENTITY: usize = HONEST_ACTORS;

fn work_config() -> WorkConfig {
    WorkConfig {
        enabled: true,
        group_size: GROUP_SIZE,
        ack_wait_secs: 1.0,
        confirm_wait_secs: 1.0,
        max_items_per_actor: 4,
        ..WorkConfig::default()
    }
}

fn items() -> Vec<WorkItem> {
    (0..GROUPS)
        .flat_map(|group| {
            let first = 100 + group * u64::from(GROUP_SIZE);
            (0..GROUP_SIZE).map(move |member| WorkItem {
                id: first + u64::from(member),
                task_id: 0,
                start: Start::Fresh { seed: first },
                episodes: 1,
                group: Some(GroupMember { group: first, member, size: GROUP_SIZE }),
            })
        })
        .collect()
}

/// Items the hostile client got: straight from the stream, and leased from the dispatcher.
#[derive(Debug, Default, Clone, Copy)]
struct Taken {
    direct: u64,
    leased: u64,
}

/// The hostile client: a plain NATS connection with the actors' credentials, speaking the
/// protocols by hand.
fn hostile(server_url: String, ca_file: PathBuf, hostility: Hostility, stop: Arc<AtomicBool>) -> Taken {
    let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build().expect("runtime");
    runtime.block_on(async move {
        // An actor identity of its own (issue 46 item 3), with that identity's inbox prefix.
        let identity = actor_identity(HOSTILE_IDENTITY);
        let NatsAuth::Nkey { seed, .. } = identity.auth() else { unreachable!("an identity's auth is an nkey") };
        let client = async_nats::ConnectOptions::with_nkey(seed)
            .custom_inbox_prefix(identity.auth().inbox_prefix())
            .request_timeout(Some(Duration::from_millis(500)))
            .add_root_certificates(ca_file)
            .connect(server_url)
            .await
            .expect("the hostile client connects");
        let run = RunId::new(RUN).expect("valid");
        let me = identity.name().clone();
        let take = subjects::work_lease(&run, "take", &me);
        let done = subjects::work_lease(&run, "done", &me);
        let next = format!("$JS.API.CONSUMER.MSG.NEXT.{}.{}", subjects::work_stream(&run), subjects::WORK_CONSUMER);
        let mut taken = Taken::default();
        while !stop.load(Ordering::Relaxed) {
            // Straight from the stream's consumer, a batch at a time, as actors once could.
            let inbox = client.new_inbox();
            let mut deliveries = client.subscribe(inbox.clone()).await.expect("subscribe");
            let pull = Bytes::from_static(br#"{"batch":100,"expires":50000000}"#);
            if client.publish_with_reply(next.clone(), inbox, pull).await.is_ok() {
                while let Ok(Some(message)) = tokio::time::timeout(Duration::from_millis(60), deliveries.next()).await {
                    let Some(reply) = message.reply.clone() else { continue };
                    if !reply.starts_with("$JS.ACK") {
                        continue;
                    }
                    taken.direct += 1;
                    if let Hostility::AckUnrun = hostility {
                        let _ = client.publish(reply, Bytes::from_static(b"+ACK")).await;
                    }
                }
            }
            drop(deliveries);
            // Through the learner's dispatcher, as fast as it answers.
            for _ in 0..20 {
                let Ok(reply) = client.request(take.clone(), Bytes::new()).await else { break };
                let Some(lease) =
                    reply.headers.as_ref().and_then(|h| h.get("Volley-Lease")).map(|v| v.as_str().to_string())
                else {
                    continue;
                };
                taken.leased += 1;
                if let Hostility::AckUnrun = hostility {
                    let _ = client.publish(done.clone(), Bytes::from(lease)).await;
                }
            }
        }
        taken
    })
}

/// One honest actor: runs at most [`EPISODE_BUDGET`] episodes, each a taken item when there is
/// one and an unscheduled episode otherwise, and reports every item it ran.
fn honest(bus: NatsBus, name: String, report: mpsc::Sender<(u64, ActorId)>, finished: Arc<AtomicBool>) -> u64 {
    let actor = ActorId::new(name).expect("valid");
    let mut source = bus.work_source(&actor).expect("work source");
    let mut unscheduled = 0;
    for _ in 0..EPISODE_BUDGET {
        if finished.load(Ordering::Relaxed) {
            break;
        }
        let taken = source.take(Duration::from_millis(20)).expect("take");
        for step in 0..EPISODE_STEPS {
            thread::sleep(Duration::from_millis(1));
            if let (Some((_, token)), true) = (&taken, step % 5 == 4) {
                source.progress(*token).expect("progress");
            }
        }
        match taken {
            Some((item, token)) => {
                source.complete(token).expect("done");
                if report.send((item.id, actor.clone())).is_err() {
                    break;
                }
            }
            None => unscheduled += 1,
        }
    }
    unscheduled
}

fn honest_actors_complete_groups_despite(hostility: Hostility) {
    let server = repo_broker();
    let learner =
        connect(&server, NatsAuth::UserPassword { user: "learner-local".into(), password: LEARNER_PASSWORD.into() });
    let mut spec = common::spec(RUN);
    spec.hyper.work = work_config();
    learner.ensure_run(&spec).expect("the learner creates the run");
    let mut queue = learner.work_queue(&spec.hyper.work).expect("work queue");
    let items = items();
    queue.submit(&items).expect("items queued");
    let member_of: HashMap<u64, GroupMember> =
        items.iter().map(|item| (item.id, item.group.expect("grouped"))).collect();

    let stop = Arc::new(AtomicBool::new(false));
    let hostile_thread = {
        let (url, ca_file, stop) = (server.url(), server.ca_file(), stop.clone());
        thread::spawn(move || hostile(url, ca_file, hostility, stop))
    };
    let (report, reports) = mpsc::channel();
    let honest_threads: Vec<_> = (0..HONEST_ACTORS)
        .map(|idx| {
            let identity = actor_identity(idx);
            let (bus, report, stop) = (connect(&server, identity.auth()), report.clone(), stop.clone());
            thread::spawn(move || honest(bus, identity.name().to_string(), report, stop))
        })
        .collect();
    drop(report);

    // The learner's part: confirm each item whose episode arrived, and count whole groups.
    let mut members: HashMap<u64, HashSet<u32>> = HashMap::new();
    while let Ok((item, actor)) = reports.recv_timeout(GUARD) {
        queue.confirm(item, &actor);
        let member = member_of[&item];
        members.entry(member.group).or_default().insert(member.member);
        if members.values().filter(|done| done.len() == GROUP_SIZE as usize).count() == GROUPS as usize {
            stop.store(true, Ordering::Relaxed);
        }
    }
    stop.store(true, Ordering::Relaxed);
    let unscheduled: u64 = honest_threads.into_iter().map(|t| t.join().expect("honest actor")).sum();
    let taken = hostile_thread.join().expect("hostile client");
    let complete = members.values().filter(|done| done.len() == GROUP_SIZE as usize).count();
    eprintln!(
        "{hostility:?}: {complete} of {GROUPS} groups complete; honest unscheduled episodes {unscheduled}; \
         items the hostile client got {taken:?}"
    );
    assert!(
        complete * 10 >= GROUPS as usize * 9,
        "{hostility:?}: honest actors completed {complete} of {GROUPS} groups within {EPISODE_BUDGET} episodes each \
         ({unscheduled} unscheduled; the hostile client got {taken:?})"
    );
    assert_eq!(taken.direct, 0, "actors cannot pull from the work stream");
}

#[test]
fn honest_actors_complete_groups_while_a_hostile_actor_hoards_items() {
    honest_actors_complete_groups_despite(Hostility::Hoard);
}

#[test]
fn honest_actors_complete_groups_while_a_hostile_actor_acks_items_unrun() {
    honest_actors_complete_groups_despite(Hostility::AckUnrun);
}
