//! The learner's work dispatcher: the one client that pulls work items from the run's work
//! stream, and the only way actors get them (issue 46).
//!
//! Actors used to pull from a consumer they all shared, so one actor could take every item
//! (and hold it for `ack_wait`, again and again) or take and acknowledge items without running
//! them. Now an actor asks the dispatcher for an item on `volley.<run>.work.take.<actor>` and
//! the dispatcher leases one to it:
//!
//! - at most `work.max_items_per_actor` leases per actor identity (the subject's last token,
//!   which broker permissions can bind to the actor's credentials); takes beyond it are refused;
//! - a lease without a progress signal (`work.progress.<actor>`) for `work.ack_wait_secs` is
//!   taken back and its item handed to the next actor that asks, at once; the actor then gets
//!   nothing for `ack_wait_secs`, so an actor that hoards items cannot take the same ones back
//!   before an honest actor does;
//! - an actor's `work.done.<actor>` does not acknowledge the item: the learner does, when the
//!   item's episode summaries arrive from that same actor
//!   ([`WorkQueue::confirm`](crate::work::WorkQueue::confirm)). A done item whose episodes
//!   do not arrive within `work.confirm_wait_secs` is handed out again, so an item
//!   acknowledged but never run is delayed, not lost.
//!
//! The dispatcher keeps the leased stream messages alive with progress acknowledgements, so
//! if the learner dies its leased items come back from the stream after `ack_wait`.
//!
//! It counts what it does ([`LeaseCounts`]: leases, refusals, reclaimed and unconfirmed
//! leases, leases in flight and the most one identity holds), which the learner exports as
//! `volley_learner_work_leases_total{outcome}` and gauges.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use async_nats::jetstream::{self, consumer, AckKind};
use async_nats::Subject;
use bytes::Bytes;
use futures::StreamExt;
use tracing::{debug, warn};
use volley_core::subjects;
use volley_core::work::WorkConfig;

use super::source::fetch_into;
use super::{call, failed, NatsBus, NatsConfig, Shared};
use crate::work::LeaseCounts;
use crate::TransportError;

/// Header of a take reply carrying the lease id of the item in its body.
pub(super) const LEASE_HEADER: &str = "Volley-Lease";
/// Header of a take reply that refuses the take, with the reason.
pub(super) const REFUSED_HEADER: &str = "Volley-Work-Refused";
/// Confirmations queued for the dispatcher beyond which new ones are dropped (their items then
/// run again after `confirm_wait_secs`).
const CONFIRM_QUEUE: usize = 4096;

/// What the work queue tells its dispatcher.
#[derive(Debug)]
pub(super) struct Confirmation {
    pub(super) item: u64,
    /// The reporting actor, lowercased as in its subjects.
    pub(super) actor: String,
}

/// The dispatcher's settings, from the run's [`WorkConfig`].
#[derive(Debug, Clone, Copy)]
struct Limits {
    max_items_per_actor: usize,
    ack_wait: Duration,
    confirm_wait: Duration,
}

struct Lease {
    actor: String,
    item: u64,
    message: jetstream::Message,
    /// Taken back (and handed out again) when this passes.
    deadline: Instant,
    /// The actor reported the item done.
    done: bool,
    /// An episode summary of the item reached the learner from the actor. The lease ends
    /// (and the item is acknowledged) when both hold: done comes straight from the actor and
    /// usually first, but an item of several episodes is confirmed by its first one.
    confirmed: bool,
}

/// The dispatcher's state: leases by id, with indexes by actor and by work item.
#[derive(Default)]
struct Leases {
    by_id: HashMap<u64, Lease>,
    per_actor: HashMap<String, usize>,
    by_item: HashMap<u64, u64>,
    next_id: u64,
    /// Actors one of whose leases expired, and until when they get nothing.
    cooling: HashMap<String, Instant>,
}

impl Leases {
    fn held_by(&self, actor: &str) -> usize {
        self.per_actor.get(actor).copied().unwrap_or(0)
    }

    fn insert(&mut self, lease: Lease) -> u64 {
        self.next_id = self.next_id.wrapping_add(1);
        let id = self.next_id;
        *self.per_actor.entry(lease.actor.clone()).or_default() += 1;
        self.by_item.insert(lease.item, id);
        self.by_id.insert(id, lease);
        id
    }

    fn remove(&mut self, id: u64) -> Option<Lease> {
        let lease = self.by_id.remove(&id)?;
        if let Some(count) = self.per_actor.get_mut(&lease.actor) {
            *count -= 1;
            if *count == 0 {
                self.per_actor.remove(&lease.actor);
            }
        }
        if self.by_item.get(&lease.item) == Some(&id) {
            self.by_item.remove(&lease.item);
        }
        Some(lease)
    }

    /// The lease `id` if `actor` holds it.
    fn held(&mut self, id: u64, actor: &str) -> Option<&mut Lease> {
        self.by_id.get_mut(&id).filter(|lease| lease.actor == actor)
    }
}

/// The dispatcher's [`LeaseCounts`], shared with the learner's work queue, which reads them.
#[derive(Debug, Default)]
pub(super) struct SharedLeaseCounts(Mutex<LeaseCounts>);

impl SharedLeaseCounts {
    pub(super) fn get(&self) -> LeaseCounts {
        *self.0.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Apply `change`, and take the state of `leases` now.
    fn update(&self, leases: &Leases, change: impl FnOnce(&mut LeaseCounts)) {
        let mut counts = self.0.lock().unwrap_or_else(PoisonError::into_inner);
        change(&mut counts);
        counts.in_flight = leases.by_id.len() as u64;
        counts.most_held = leases.per_actor.values().copied().max().unwrap_or(0) as u64;
    }
}

/// Start the dispatcher of `config`'s run on a thread with a connection of its own; it stops
/// when the returned sender is dropped. The counts are what it has done so far.
pub(super) fn start(
    config: &NatsConfig,
    work: &WorkConfig,
) -> Result<(tokio::sync::mpsc::Sender<Confirmation>, Arc<SharedLeaseCounts>), TransportError> {
    let limits = Limits {
        max_items_per_actor: work.max_items_per_actor as usize,
        ack_wait: Duration::from_secs_f64(work.ack_wait_secs),
        confirm_wait: Duration::from_secs_f64(work.confirm_wait_secs),
    };
    let bus = NatsBus::connect(NatsConfig { runtime_workers: 0, ..config.clone() })?;
    let (confirmations, receiver) = tokio::sync::mpsc::channel(CONFIRM_QUEUE);
    // Subscribe before returning, so a take sent right after `work_queue` returns is answered.
    let shared = bus.shared.clone();
    let run = &shared.config.run;
    let timeout = shared.config.request_timeout;
    let (consumer, subscriptions) = shared.block_on(async {
        let stream =
            call("open work stream", timeout, shared.js.get_stream_no_info(subjects::work_stream(run))).await?;
        let consumer =
            call("open work consumer", timeout, stream.get_consumer::<consumer::pull::Config>(subjects::WORK_CONSUMER))
                .await?;
        let client = &shared.client;
        let subscribe = |verb: &'static str| {
            let subject = subjects::work_lease_all(run, verb);
            async move { client.subscribe(subject).await.map_err(|err| failed("subscribe to work leases", err)) }
        };
        let [take, progress, done] = subjects::WORK_LEASE_VERBS;
        let subscriptions = Subscriptions {
            take: subscribe(take).await?,
            progress: subscribe(progress).await?,
            done: subscribe(done).await?,
        };
        call("confirm work lease subscriptions", timeout, shared.client.flush()).await?;
        Ok::<_, TransportError>((consumer, subscriptions))
    })?;
    let counts = Arc::new(SharedLeaseCounts::default());
    let dispatcher_counts = counts.clone();
    std::thread::Builder::new()
        .name("volley-work-dispatch".into())
        .spawn(move || {
            let shared = bus.shared.clone();
            // Lease ids start at the clock (ns), so an actor still holding a lease of a
            // previous learner's dispatcher cannot name one of this dispatcher's.
            let first_id = SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_nanos() as u64);
            let leases = Leases { next_id: first_id, ..Leases::default() };
            let dispatcher = Dispatcher { shared: shared.clone(), consumer, limits, leases, counts: dispatcher_counts };
            shared.block_on(dispatcher.run(subscriptions, receiver));
        })
        .map_err(|err| failed("start work dispatcher", err))?;
    Ok((confirmations, counts))
}

/// The dispatcher's subscriptions, one per verb of the lease protocol.
struct Subscriptions {
    take: async_nats::Subscriber,
    progress: async_nats::Subscriber,
    done: async_nats::Subscriber,
}

struct Dispatcher {
    shared: Arc<Shared>,
    consumer: consumer::PullConsumer,
    limits: Limits,
    leases: Leases,
    counts: Arc<SharedLeaseCounts>,
}

impl Dispatcher {
    async fn run(mut self, subscriptions: Subscriptions, mut confirmations: tokio::sync::mpsc::Receiver<Confirmation>) {
        let Subscriptions { take: mut takes, mut progress, mut done } = subscriptions;
        // Expiry is checked this often; keep-alives go to the stream every ack_wait / 3.
        let mut tick =
            tokio::time::interval((self.limits.ack_wait / 4).clamp(Duration::from_millis(50), Duration::from_secs(1)));
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let mut last_keepalive = Instant::now();
        loop {
            tokio::select! {
                message = takes.next() => match message {
                    Some(message) => self.take(message).await,
                    None => break,
                },
                message = progress.next() => match message {
                    Some(message) => self.progress(&message),
                    None => break,
                },
                message = done.next() => match message {
                    Some(message) => self.done(&message).await,
                    None => break,
                },
                confirmation = confirmations.recv() => match confirmation {
                    Some(confirmation) => self.confirm(confirmation).await,
                    // The learner's work queue is gone: stop; the stream redelivers what was leased.
                    None => break,
                },
                _ = tick.tick() => {
                    self.expire().await;
                    if last_keepalive.elapsed() >= self.limits.ack_wait / 3 {
                        last_keepalive = Instant::now();
                        self.keep_alive().await;
                    }
                }
            }
        }
        debug!(leases = self.leases.by_id.len(), "work dispatcher stopped");
    }

    /// Answer one take: a lease on the next item, nothing, or a refusal.
    async fn take(&mut self, request: async_nats::Message) {
        let Some(reply) = request.reply.clone() else { return };
        let Some(actor) = actor_of(&request.subject) else { return };
        let mut headers = async_nats::HeaderMap::new();
        let mut body = Bytes::new();
        if self.leases.held_by(&actor) >= self.limits.max_items_per_actor {
            debug!(%actor, "work take refused: the actor holds its limit of items");
            headers.insert(REFUSED_HEADER, "in-flight limit");
            self.counts.update(&self.leases, |counts| counts.refused_limit += 1);
        } else if self.leases.cooling.get(&actor).is_some_and(|until| *until > Instant::now()) {
            debug!(%actor, "work take refused: an item of the actor was taken back");
            headers.insert(REFUSED_HEADER, "item taken back");
            self.counts.update(&self.leases, |counts| counts.refused_cooling += 1);
        } else if let Some((item, message)) = self.next_item().await {
            let lease = Lease {
                actor: actor.clone(),
                item,
                message,
                deadline: Instant::now() + self.limits.ack_wait,
                done: false,
                confirmed: false,
            };
            body = lease.message.payload.clone();
            let id = self.leases.insert(lease);
            self.counts.update(&self.leases, |counts| counts.leased += 1);
            headers.insert(LEASE_HEADER, id.to_string().as_str());
            debug!(%actor, item, lease = id, "work item leased");
        }
        if let Err(err) = self.shared.client.publish_with_headers(reply, headers, body).await {
            // The lease stays; without progress it expires and the item goes to another actor.
            debug!(%actor, error = %err, "work take reply not sent");
        }
    }

    /// The next decodable item of the stream, if one is queued now.
    async fn next_item(&mut self) -> Option<(u64, jetstream::Message)> {
        let request_timeout = self.shared.config.request_timeout;
        loop {
            let mut messages = Vec::with_capacity(1);
            if let Err(err) = fetch_into(&self.consumer, 1, Duration::ZERO, request_timeout, &mut messages).await {
                warn!(error = %err, "could not fetch a work item");
                return None;
            }
            let message = messages.pop()?;
            match volley_core::work::WorkItem::from_json(&message.payload) {
                Ok(item) => return Some((item.id, message)),
                Err(err) => {
                    warn!(error = %err, "work item dropped");
                    if let Err(err) = message.ack_with(AckKind::Term).await {
                        debug!(error = %err, "could not terminate an undecodable work item");
                    }
                }
            }
        }
    }

    fn progress(&mut self, message: &async_nats::Message) {
        let ack_wait = self.limits.ack_wait;
        if let Some(lease) = self.lease_of(message) {
            if !lease.done {
                lease.deadline = Instant::now() + ack_wait;
            }
        }
    }

    async fn done(&mut self, message: &async_nats::Message) {
        let confirm_wait = self.limits.confirm_wait;
        let Some(id) = lease_id(message) else { return };
        let Some(actor) = actor_of(&message.subject) else { return };
        let Some(lease) = self.leases.held(id, &actor) else { return };
        if lease.confirmed {
            self.acknowledge(id).await;
        } else if !lease.done {
            lease.done = true;
            lease.deadline = Instant::now() + confirm_wait;
        }
    }

    /// The lease a progress message names, if its sender holds it.
    fn lease_of(&mut self, message: &async_nats::Message) -> Option<&mut Lease> {
        let actor = actor_of(&message.subject)?;
        self.leases.held(lease_id(message)?, &actor)
    }

    /// An episode of the item reached the learner from the actor holding it.
    async fn confirm(&mut self, confirmation: Confirmation) {
        let Some(&id) = self.leases.by_item.get(&confirmation.item) else { return };
        let Some(lease) = self.leases.held(id, &confirmation.actor) else { return };
        if lease.done {
            self.acknowledge(id).await;
        } else {
            lease.confirmed = true;
        }
    }

    /// End lease `id` and acknowledge its item to the stream.
    async fn acknowledge(&mut self, id: u64) {
        let Some(lease) = self.leases.remove(id) else { return };
        self.counts.update(&self.leases, |counts| counts.confirmed += 1);
        let request_timeout = self.shared.config.request_timeout;
        if let Err(err) = call("complete work item", request_timeout, lease.message.double_ack()).await {
            // Not acknowledged: the stream delivers it again after ack_wait; it runs twice.
            warn!(item = lease.item, error = %err, "could not acknowledge a confirmed work item");
        }
    }

    /// Take back every lease past its deadline and hand its item out again at once.
    async fn expire(&mut self) {
        let now = Instant::now();
        self.leases.cooling.retain(|_, until| *until > now);
        let expired: Vec<u64> =
            self.leases.by_id.iter().filter(|(_, lease)| lease.deadline <= now).map(|(&id, _)| id).collect();
        for id in expired {
            let lease = self.leases.remove(id).expect("listed above");
            self.counts.update(&self.leases, |counts| {
                if lease.done {
                    counts.unconfirmed += 1;
                } else {
                    counts.reclaimed += 1;
                }
            });
            self.leases.cooling.insert(lease.actor.clone(), now + self.limits.ack_wait);
            debug!(actor = %lease.actor, item = lease.item, done = lease.done, "work lease expired; item handed out again");
            if let Err(err) = lease.message.ack_with(AckKind::Nak(None)).await {
                debug!(item = lease.item, error = %err, "could not release a work item; the stream redelivers it after ack_wait");
            }
        }
    }

    /// Push back the stream's redelivery of every leased item.
    async fn keep_alive(&mut self) {
        for lease in self.leases.by_id.values() {
            if let Err(err) = lease.message.ack_with(AckKind::Progress).await {
                debug!(item = lease.item, error = %err, "work keep-alive failed");
            }
        }
    }
}

/// The lease id in the body of a progress or done message.
fn lease_id(message: &async_nats::Message) -> Option<u64> {
    std::str::from_utf8(&message.payload).ok()?.trim().parse().ok()
}

/// The actor token of `volley.<run>.work.<verb>.<actor>`.
fn actor_of(subject: &Subject) -> Option<String> {
    subject.rsplit('.').next().filter(|token| !token.is_empty()).map(str::to_string)
}
