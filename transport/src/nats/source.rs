//! The trajectory source: the learner's durable pull consumer (and the replay consumer),
//! with explicit acks, redelivery handling and the backlog reading behind pacing.

use std::collections::{HashMap, VecDeque};
use std::fmt;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use async_nats::jetstream::{self, consumer, AckKind};
use bytes::Bytes;
use futures::{FutureExt, StreamExt};
use tokio::runtime::Handle;
use tracing::{debug, info, warn};
use volley_core::subjects;
use volley_core::wire::{self, TrajectorySegment};

use super::run::learner_consumer_config;
use super::{
    call, failed, Backoff, NatsBus, Shared, ABANDON_ACK_DEADLINE, BACKLOG_CACHE, BACKLOG_DEADLINE,
    REPLAY_INACTIVE_THRESHOLD,
};
use crate::{Delivery, DeliveryToken, TrajectorySource, TransportError};

impl NatsBus {
    /// Learner side: the durable consumer `learner` (created if missing; the stream must
    /// exist, see [`NatsBus::ensure_run`]).
    pub fn trajectory_source(&self) -> Result<NatsTrajectorySource, TransportError> {
        let shared = self.shared.clone();
        let timeout = shared.config.request_timeout;
        let consumer = shared.block_on(async {
            let stream_name = subjects::trajectory_stream(&shared.config.run);
            let stream = call("open trajectory stream", timeout, shared.js.get_stream_no_info(&stream_name)).await?;
            call(
                "open learner consumer",
                timeout,
                stream.get_or_create_consumer(subjects::LEARNER_CONSUMER, learner_consumer_config(&shared.config)),
            )
            .await
        })?;
        Ok(NatsTrajectorySource::new(shared, consumer, SourceMode::Durable))
    }

    /// Every segment the stream holds, from the first, in stream order, through an ephemeral
    /// consumer that does not disturb the learner's. Acks and rejects are no-ops; `recv`
    /// returns [`TransportError::Closed`] once it has delivered the last segment the stream
    /// held when the replay started.
    pub fn replay_source(&self) -> Result<NatsTrajectorySource, TransportError> {
        let shared = self.shared.clone();
        let timeout = shared.config.request_timeout;
        let (consumer, end_sequence, n_messages) = shared.block_on(async {
            let stream_name = subjects::trajectory_stream(&shared.config.run);
            let stream = call("open trajectory stream", timeout, shared.js.get_stream(&stream_name)).await?;
            let state = &stream.cached_info().state;
            let (end_sequence, n_messages) = (state.last_sequence, state.messages);
            let config = consumer::pull::Config {
                description: Some("volley replay".to_string()),
                deliver_policy: consumer::DeliverPolicy::All,
                ack_policy: consumer::AckPolicy::None,
                inactive_threshold: REPLAY_INACTIVE_THRESHOLD,
                memory_storage: true,
                ..Default::default()
            };
            let consumer = call("create replay consumer", timeout, stream.create_consumer(config)).await?;
            Ok::<_, TransportError>((consumer, end_sequence, n_messages))
        })?;
        info!(run = %shared.config.run, end_sequence, n_messages, "replay started");
        let finished = n_messages == 0;
        Ok(NatsTrajectorySource::new(shared, consumer, SourceMode::Replay { end_sequence, finished }))
    }
}

#[derive(Debug, Clone, Copy)]
enum SourceMode {
    /// The durable consumer `learner`, explicit acks.
    Durable,
    /// An ephemeral consumer over the whole stream, no acks, ending at `end_sequence`.
    Replay { end_sequence: u64, finished: bool },
}

/// A delivered message the learner has not settled yet.
struct Held {
    message: jetstream::Message,
    /// When the server last heard about it (delivery or progress signal).
    touched: Instant,
    /// The connection it arrived on (the bus's connection count at receipt). After a
    /// reconnect the server may no longer know the delivery (a restarted broker drops pending
    /// state it had not yet written), and then it never answers a double ack for it.
    connection: u64,
    /// Its segments (deliveries) the learner has not acked or rejected yet: the message is
    /// settled with the server when this reaches 0.
    open: u32,
    /// Whether any of its segments was acked (then the message is acked, else terminated).
    acked: bool,
    /// Its deliveries' tokens: `n_tokens` consecutive ones from `first_token`.
    first_token: u64,
    n_tokens: u32,
}

#[derive(Debug, Default)]
struct BacklogReading {
    at: Option<Instant>,
    value: Option<u64>,
}

/// Learner side of the NATS transport: a pull consumer on the trajectory stream.
///
/// Guarantee: delivery is at least once. [`TrajectorySource::ack`] uses double acks: when it
/// returns `Ok`, the server has recorded the acks and will not deliver those segments again
/// (the consumer state is on disk, so this survives a broker restart). A segment not
/// acknowledged within [`NatsConfig::ack_wait`](super::NatsConfig::ack_wait) of its last sign of life is delivered again
/// with a higher `delivery_count`; while the learner holds a delivery and keeps calling `recv`,
/// `recv` sends a progress signal for it every `ack_wait / 2`, so a slow batch is not
/// redelivered under the learner's feet. [`TrajectorySource::reject`] terminates a delivery
/// (`+TERM`): it is never delivered again. Bytes that do not decode come back as a
/// [`Delivery`] holding the [`wire::DecodeError`], to be counted and rejected by the learner.
///
/// A message holding a batch frame ([`wire::batch`]) becomes one delivery per segment, each
/// decoded and checked on its own (a bad segment is one rejected delivery; the frame's other
/// segments are delivered as usual; a frame whose own header is bad is one rejected
/// delivery). The message is acknowledged once every one of its segments is acked or
/// rejected: with an ack if any was acked, else terminated. Until then it is held (and kept
/// alive), so a crash redelivers all its segments, those already used included (at least
/// once). `recv` hands out at most `max` deliveries and keeps the rest of a frame for the
/// next call.
pub struct NatsTrajectorySource {
    shared: Arc<Shared>,
    consumer: consumer::PullConsumer,
    mode: SourceMode,
    /// Held messages, by message key.
    held: HashMap<u64, Held>,
    /// The message key of every delivery handed out and not yet settled, by token.
    parts: HashMap<u64, u64>,
    /// Deliveries unpacked from a frame beyond what `recv` was asked for, handed out first.
    ready: VecDeque<Delivery>,
    /// Segments per message lately (a moving average), to size pull requests and to report
    /// the backlog in segments.
    segments_per_message: f64,
    /// Whether a message has been seen, so `segments_per_message` is measured, not assumed.
    measured_message_size: bool,
    next_token: u64,
    next_message: u64,
    backlog: Mutex<BacklogReading>,
    /// Acks given up on because the connection their delivery came on was lost.
    abandoned_acks: u64,
    /// Acknowledgements sent by [`TrajectorySource::ack_later`], confirmed in the background.
    background_acks: VecDeque<tokio::task::JoinHandle<Settled>>,
    /// The durable consumer's continuous pull: it asks for the next deliveries while the
    /// learner computes, so a `recv` after an update usually finds them already here.
    prefetch: Option<consumer::pull::Stream>,
    /// Messages the continuous pull yielded after a `recv` had what it wanted ([`prime_pull`]):
    /// delivered to this client, not yet handed to the learner.
    early: VecDeque<jetstream::Message>,
    /// The connection `early` arrived on.
    early_connection: u64,
    /// Pace notices ([`wire::pace`]) for the actors: the stream sequence of the newest message
    /// taken, and the stream's newest sequence as deliveries reported it. Durable mode only.
    pace: Option<PaceAnnouncer>,
}

/// What the learner announces on `volley.<run>.pace` each time it takes messages.
#[derive(Debug)]
struct PaceAnnouncer {
    subject: async_nats::Subject,
    taken: u64,
    stored: u64,
    /// Messages the continuous pull asks for at a time (0 before it opens).
    prefetch: u32,
}

impl PaceAnnouncer {
    /// Take the stream positions of `messages` into account; the notice to send (subject and
    /// bytes), if any message carried them.
    fn announce(&mut self, messages: &[jetstream::Message]) -> Option<(async_nats::Subject, Bytes)> {
        let mut seen = false;
        for info in messages.iter().filter_map(|message| message.info().ok()) {
            seen = true;
            self.taken = self.taken.max(info.stream_sequence);
            self.stored = self.stored.max(info.stream_sequence.saturating_add(info.pending));
        }
        seen.then(|| {
            let notice = wire::pace::PaceNotice {
                taken: self.taken,
                stored: self.stored.max(self.taken),
                prefetch: self.prefetch,
            };
            (self.subject.clone(), Bytes::copy_from_slice(&wire::pace::encode_pace_notice(&notice)))
        })
    }
}

impl fmt::Debug for NatsTrajectorySource {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("NatsTrajectorySource").field("mode", &self.mode).field("held", &self.held.len()).finish()
    }
}

impl NatsTrajectorySource {
    fn new(shared: Arc<Shared>, consumer: consumer::PullConsumer, mode: SourceMode) -> Self {
        let pace = matches!(mode, SourceMode::Durable).then(|| PaceAnnouncer {
            subject: subjects::pace(&shared.config.run).into(),
            taken: 0,
            stored: 0,
            prefetch: 0,
        });
        NatsTrajectorySource {
            shared,
            consumer,
            mode,
            held: HashMap::new(),
            parts: HashMap::new(),
            ready: VecDeque::new(),
            segments_per_message: 1.0,
            measured_message_size: false,
            next_token: 0,
            next_message: 0,
            backlog: Mutex::new(BacklogReading::default()),
            abandoned_acks: 0,
            background_acks: VecDeque::new(),
            prefetch: None,
            early: VecDeque::new(),
            early_connection: 0,
            pace,
        }
    }

    /// Deliveries received and not yet acknowledged or rejected, those waiting for the next
    /// `recv` included.
    pub fn held(&self) -> usize {
        self.parts.len()
    }

    /// Messages received and not yet settled with the server (a batch frame holds several
    /// deliveries).
    pub fn held_messages(&self) -> usize {
        self.held.len()
    }

    /// Acks and rejects sent once without waiting for the server's confirmation, because the
    /// connection their delivery arrived on had been lost (see [`TrajectorySource::ack`]).
    pub fn abandoned_acks(&self) -> u64 {
        self.abandoned_acks
    }

    fn connection(&self) -> u64 {
        *self.shared.connections.borrow()
    }

    /// Tell the server that held deliveries are still being worked on, so they are not
    /// redelivered after `ack_wait` (fire-and-forget `+WPI`).
    async fn keep_held_alive(&mut self) {
        let refresh_after = self.shared.config.ack_wait / 2;
        for held in self.held.values_mut() {
            if held.touched.elapsed() >= refresh_after {
                if let Err(err) = held.message.ack_with(AckKind::Progress).await {
                    debug!(operation = "progress signal", error = %err, "progress signal not sent");
                }
                held.touched = Instant::now();
            }
        }
    }

    /// Confirm (or give up on) the acks sent earlier in the background, then ack `tokens`.
    async fn ack_all(&mut self, tokens: &[DeliveryToken]) -> Result<(), TransportError> {
        let background = std::mem::take(&mut self.background_acks);
        for outcome in futures::future::join_all(background).await {
            match outcome {
                Ok(outcome) => {
                    if let Err(err) = self.absorb(outcome) {
                        warn!(%err, "acknowledging segments failed; they may be redelivered");
                    }
                }
                Err(err) => warn!(%err, "an acknowledgement task failed; its segments may be redelivered"),
            }
        }
        self.settle("ack", tokens, AckKind::Ack).await
    }

    async fn settle(
        &mut self,
        operation: &'static str,
        tokens: &[DeliveryToken],
        kind: AckKind,
    ) -> Result<(), TransportError> {
        let settling = self.take_held(operation, tokens, kind);
        // A terminated segment of a frame whose other segments were acked settles the frame
        // with an ack: the learner used them.
        let (acks, terms): (Vec<_>, Vec<_>) =
            settling.into_iter().partition(|(_, held)| held.acked || !matches!(kind, AckKind::Term));
        let mut result = Ok(());
        for (settling, kind) in [(acks, kind_or_ack(kind)), (terms, AckKind::Term)] {
            if !settling.is_empty() {
                let outcome = settle_detached(self.shared.clone(), operation, settling, kind).await;
                result = result.and(self.absorb(outcome));
            }
        }
        result
    }

    /// Mark `tokens` settled (`kind`: acked or rejected) and remove the messages none of whose
    /// deliveries is open any more from the held ones (unknown tokens are logged and skipped).
    fn take_held(&mut self, operation: &'static str, tokens: &[DeliveryToken], kind: AckKind) -> Vec<(u64, Held)> {
        let mut settling: Vec<(u64, Held)> = Vec::with_capacity(tokens.len());
        for token in tokens {
            let Some(key) = self.parts.remove(&token.0) else {
                debug!(operation, token = token.0, "token not held (already settled or replayed); ignored");
                continue;
            };
            let Some(held) = self.held.get_mut(&key) else { continue };
            held.open = held.open.saturating_sub(1);
            held.acked |= matches!(kind, AckKind::Ack);
            if held.open == 0 {
                if let Some(held) = self.held.remove(&key) {
                    settling.push((key, held));
                }
            }
        }
        settling
    }

    /// Take in what a [`settle_detached`] did: count the abandoned, keep the unsettled.
    fn absorb(&mut self, outcome: Settled) -> Result<(), TransportError> {
        self.abandoned_acks += outcome.abandoned;
        // Keep the unsettled, with every delivery of theirs open again, so a later call settling
        // their tokens settles them; the server redelivers them otherwise.
        for (key, mut held) in outcome.unsettled {
            for token in held.first_token..held.first_token + u64::from(held.n_tokens) {
                self.parts.insert(token, key);
            }
            held.open = held.n_tokens;
            self.held.insert(key, held);
        }
        outcome.result
    }

    /// Collect the acks sent in the background that have finished ([`TrajectorySource::ack_later`]).
    fn reap_background_acks(&mut self) {
        while self.background_acks.front().is_some_and(|task| task.is_finished()) {
            let Some(task) = self.background_acks.pop_front() else { break };
            match task.now_or_never() {
                Some(Ok(outcome)) => {
                    if let Err(err) = self.absorb(outcome) {
                        warn!(%err, "acknowledging segments failed; they may be redelivered");
                    }
                }
                Some(Err(err)) => warn!(%err, "an acknowledgement task failed; its segments may be redelivered"),
                None => {}
            }
        }
    }

    fn record_backlog(&self, value: u64) {
        let mut reading = self.backlog.lock().expect("backlog lock is never poisoned");
        *reading = BacklogReading { at: Some(Instant::now()), value: Some(value) };
    }
}

/// The kind that settles a message one of whose segments was acked: `Term` becomes `Ack`.
fn kind_or_ack(kind: AckKind) -> AckKind {
    match kind {
        AckKind::Term => AckKind::Ack,
        kind => kind,
    }
}

/// Fetch up to `max` messages, waiting at most `wait` for the first (server-side: a no-wait
/// pull request with an expiry returns as soon as it has anything). Messages received before a
/// deadline or a mid-batch error are kept, never dropped.
pub(super) async fn fetch_into(
    consumer: &consumer::PullConsumer,
    max: usize,
    wait: Duration,
    request_timeout: Duration,
    out: &mut Vec<jetstream::Message>,
) -> Result<(), TransportError> {
    const OPERATION: &str = "fetch segments";
    let mut request = consumer.fetch().max_messages(max);
    if wait >= Duration::from_millis(1) {
        request = request.expires(wait);
    }
    let deadline = wait + request_timeout;
    let collected = tokio::time::timeout(deadline, async {
        let mut batch = request.messages().await.map_err(|err| failed(OPERATION, err))?;
        while let Some(item) = batch.next().await {
            match item {
                Ok(message) => out.push(message),
                Err(err) if out.is_empty() => return Err(failed(OPERATION, err)),
                Err(err) => {
                    debug!(operation = OPERATION, error = %err, "batch ended early");
                    break;
                }
            }
        }
        Ok(())
    })
    .await;
    match collected {
        Ok(result) => result,
        Err(_) if !out.is_empty() => Ok(()),
        Err(_) => {
            warn!(operation = OPERATION, after = ?deadline, "nats operation timed out");
            Err(TransportError::Timeout { operation: OPERATION, after: deadline })
        }
    }
}

/// What settling some deliveries came to.
struct Settled {
    result: Result<(), TransportError>,
    /// Deliveries from a lost connection settled without confirmation.
    abandoned: u64,
    /// Deliveries not settled before the retry deadline.
    unsettled: Vec<(u64, Held)>,
}

/// Settle deliveries with double acks (or terms), retrying with backoff for
/// [`NatsConfig::retry_deadline`](super::NatsConfig::retry_deadline). Deliveries from a lost connection get one plain
/// (unconfirmed) ack or term instead: a broker that still knows a delivery applies it; one that
/// restarted without it redelivers the segment later, which the learner's duplicate filter
/// skips (issue 11: waiting for confirmations the server never sends stalled training for the
/// whole retry deadline, ~30 s, after every broker restart). Owns what it needs, so it can run
/// as a task of its own.
async fn settle_detached(
    shared: Arc<Shared>,
    operation: &'static str,
    mut settling: Vec<(u64, Held)>,
    kind: AckKind,
) -> Settled {
    let timeout = shared.config.request_timeout;
    let started = Instant::now();
    let mut backoff = Backoff::new();
    let mut abandoned = 0;
    loop {
        let connection = *shared.connections.borrow();
        let (current, stale): (Vec<_>, Vec<_>) =
            settling.into_iter().partition(|(_, held)| held.connection >= connection);
        if !stale.is_empty() {
            let deadline = timeout.min(ABANDON_ACK_DEADLINE);
            let sent = futures::future::join_all(
                stale.iter().map(|(_, held)| tokio::time::timeout(deadline, held.message.ack_with(kind))),
            )
            .await;
            let unsent = sent.iter().filter(|outcome| !matches!(outcome, Ok(Ok(())))).count();
            abandoned += stale.len() as u64;
            info!(
                operation,
                abandoned = stale.len(),
                unsent,
                "deliveries from before a reconnect settled without confirmation; the server may deliver them again"
            );
        }
        settling = current;
        if settling.is_empty() {
            return Settled { result: Ok(()), abandoned, unsettled: Vec::new() };
        }
        let outcomes = futures::future::join_all(
            settling
                .iter()
                .map(|(_, held)| tokio::time::timeout(timeout, double_ack(&shared.client, &held.message, kind))),
        )
        .await;
        let mut problem = None;
        let mut still = Vec::new();
        for ((token, held), outcome) in settling.into_iter().zip(outcomes) {
            match outcome {
                Ok(Ok(())) => {}
                Ok(Err(err)) => {
                    problem = Some(err.to_string());
                    still.push((token, held));
                }
                Err(_) => {
                    problem = Some(format!("no confirmation within {timeout:?}"));
                    still.push((token, held));
                }
            }
        }
        settling = still;
        let Some(problem) = problem else {
            return Settled { result: Ok(()), abandoned, unsettled: Vec::new() };
        };
        if started.elapsed() >= shared.config.retry_deadline {
            let unsettled = settling.len();
            warn!(operation, unsettled, error = %problem, "giving up; these deliveries may be delivered again");
            let result = Err(TransportError::Timeout { operation, after: shared.config.retry_deadline });
            return Settled { result, abandoned, unsettled: settling };
        }
        debug!(operation, unsettled = settling.len(), error = %problem, "retrying");
        tokio::time::sleep(backoff.next()).await;
    }
}

/// Settle `message` with `kind` and wait for the server's confirmation: a request on the
/// client's shared reply subscription. `jetstream::Message::double_ack_with` subscribes to a
/// fresh inbox for each confirmation and unsubscribes after it, two more protocol operations
/// (and subscription-table changes in the server) per acknowledged frame (issue 16). As with
/// it, any reply counts as the confirmation, a "no responders" status too. A request the
/// server never answers keeps its entry in the client's table of awaited replies (async-nats
/// removes an entry when its reply comes); deliveries from an earlier connection get plain
/// acks (`settle_detached`), so that is at most the acks in flight when a broker restarts.
async fn double_ack(client: &async_nats::Client, message: &jetstream::Message, kind: AckKind) -> Result<(), String> {
    let Some(reply) = message.reply.clone() else {
        return Err("no reply subject, not a JetStream message".into());
    };
    match client.request(reply, Bytes::from(kind)).await {
        Ok(_) => Ok(()),
        Err(err) if matches!(err.kind(), async_nats::RequestErrorKind::NoResponders) => Ok(()),
        Err(err) => Err(err.to_string()),
    }
}

/// Take up to `max` deliveries from the consumer's continuous pull (opened on first use with
/// room for [`NatsConfig::prefetch_calls`](super::NatsConfig::prefetch_calls) calls' worth,
/// and at most [`PREFETCH_MAX_BYTES`] or two messages of `max_payload` per pull request),
/// waiting at most `wait` for the first. An error closes the pull;
/// the next call opens a new one (deliveries it had buffered are redelivered after `ack_wait`).
/// Returns the messages per pull request when this call opened the pull.
async fn pull_into(
    prefetch: &mut Option<consumer::pull::Stream>,
    consumer: &consumer::PullConsumer,
    max: usize,
    wait: Duration,
    config: &super::NatsConfig,
    max_payload: usize,
    out: &mut Vec<jetstream::Message>,
) -> Result<Option<u32>, TransportError> {
    const OPERATION: &str = "fetch segments";
    let (calls, request_timeout) = (config.prefetch_calls, config.request_timeout);
    let mut opened_batch = None;
    let stream = match prefetch {
        Some(stream) => stream,
        None => {
            let batch = max.saturating_mul(calls.max(1)).clamp(PREFETCH_MIN, PREFETCH_MAX);
            opened_batch = Some(batch as u32);
            let max_bytes = PREFETCH_MAX_BYTES.max(2 * max_payload);
            let pull = consumer.stream().max_messages_per_batch(batch).max_bytes_per_batch(max_bytes);
            let opened = call(OPERATION, request_timeout, pull.messages());
            prefetch.insert(opened.await?)
        }
    };
    let first = match tokio::time::timeout(wait, stream.next()).await {
        Err(_) => return Ok(opened_batch),
        Ok(first) => first,
    };
    match first {
        Some(Ok(message)) => out.push(message),
        Some(Err(err)) => {
            *prefetch = None;
            return Err(failed(OPERATION, err));
        }
        None => {
            *prefetch = None;
            return Err(failed(OPERATION, "the consumer's pull ended"));
        }
    }
    take_ready(prefetch, max.saturating_sub(out.len()), |message| out.push(message));
    Ok(opened_batch)
}

/// Take up to `max` deliveries the continuous pull has ready, without waiting; an error or the
/// end of the pull closes it (the next call opens a new one).
fn take_ready(prefetch: &mut Option<consumer::pull::Stream>, max: usize, mut take: impl FnMut(jetstream::Message)) {
    let Some(stream) = prefetch.as_mut() else { return };
    for _ in 0..max {
        match stream.next().now_or_never() {
            Some(Some(Ok(message))) => take(message),
            Some(Some(Err(err))) => {
                debug!(operation = "fetch segments", error = %err, "pull interrupted; reopening it next time");
                *prefetch = None;
                return;
            }
            Some(None) => {
                *prefetch = None;
                return;
            }
            None => return,
        }
    }
}

/// Poll the continuous pull once more without waiting, so that it sends its next pull request
/// now, while the learner computes, instead of at the next `recv`: async-nats asks the server for
/// more only from inside a poll, once its outstanding requests run low. Before this, a learner
/// that took its one message per update found the next ones stored but not yet asked for, and
/// waited a round trip for them with the actor held back meanwhile (issue 16: 1.5 ms waits with
/// four messages stored). What the poll yields waits in `early`, which holds no more than the
/// pull's buffer would have: the outstanding requests bound both.
fn prime_pull(prefetch: &mut Option<consumer::pull::Stream>, early: &mut VecDeque<jetstream::Message>) {
    take_ready(prefetch, PREFETCH_MAX, |message| early.push_back(message));
}

/// The actor token of a trajectory subject `volley.<run>.traj.<actor>`: everything after the
/// run's trajectory prefix (a subject of more tokens yields a token with dots, which no actor
/// id equals, so the learner refuses its segments). `None` for a subject outside the run's
/// trajectories, which the stream does not hold.
fn subject_actor(run: &volley_core::ids::RunId, subject: &str) -> Option<String> {
    let all = subjects::trajectories_all(run);
    let prefix = all.strip_suffix('>')?;
    subject.strip_prefix(prefix).map(str::to_string)
}

/// Turn one delivered message into deliveries, calling `deliver` with each segment (decoded,
/// or why not) and a fresh token: one for a plain segment message, one per part of a batch
/// frame, one error for a frame whose header does not check out.
fn unpack_message(
    payload: &[u8],
    stream_sequence: u64,
    next_token: &mut u64,
    mut deliver: impl FnMut(Result<TrajectorySegment, wire::DecodeError>, DeliveryToken),
) {
    let mut token = || {
        *next_token += 1;
        DeliveryToken(*next_token)
    };
    let decode = |bytes: &[u8]| {
        let segment = wire::decode_segment_body(bytes);
        if let Err(err) = &segment {
            debug!(reason = err.reason(), stream_sequence, "undecodable segment delivered");
        }
        segment
    };
    if !wire::batch::is_segment_batch(payload) {
        let segment = decode(payload);
        deliver(segment, token());
        return;
    }
    match wire::batch::split_segment_batch(payload) {
        Ok(parts) => {
            for part in parts {
                let segment = decode(part);
                deliver(segment, token());
            }
        }
        Err(err) => {
            debug!(reason = err.reason(), stream_sequence, "undecodable segment batch delivered");
            deliver(Err(err), token());
        }
    }
}

/// Bounds on the learner's continuous pull: messages asked for per pull request. One call's
/// worth, not more: deliveries waiting in the learner's client are invisible to the actors'
/// pacing, and each batch of them adds a version of lag (issue 11); with batch frames one
/// message holds an actor's whole round, so the floor is two messages.
const PREFETCH_MIN: usize = 2;
pub(super) const PREFETCH_MAX: usize = 256;
/// Bytes asked for per pull request (at least two messages of `max_payload`). Without a byte
/// bound, 256 messages of ~1 MiB (84×84 frames) were more than the server lets wait for one
/// client (`max_pending`, 64 MiB by default): it dropped deliveries, which came again only
/// after `ack_wait`, and the learner stalled (issue 16, `cargo bench --bench ingest`).
const PREFETCH_MAX_BYTES: usize = 16 << 20;

impl TrajectorySource for NatsTrajectorySource {
    fn recv(&mut self, max: usize, timeout: Duration, out: &mut Vec<Delivery>) -> Result<usize, TransportError> {
        if max == 0 {
            return Ok(0);
        }
        // Segments of a frame left over from the last call go first.
        let mut n = 0;
        while n < max {
            let Some(delivery) = self.ready.pop_front() else { break };
            out.push(delivery);
            n += 1;
        }
        if n == max {
            return Ok(n);
        }
        if let SourceMode::Replay { finished: true, .. } = self.mode {
            return if n == 0 { Err(TransportError::Closed) } else { Ok(n) };
        }
        // Ask for about as many messages as hold the segments wanted.
        let want_messages = (((max - n) as f64 / self.segments_per_message.max(1.0)).ceil() as usize).max(1);
        let wait = if n > 0 { Duration::ZERO } else { timeout };
        let shared = self.shared.clone();
        let connection = self.connection();
        let mut messages = Vec::with_capacity(want_messages);
        self.reap_background_acks();
        let durable = matches!(self.mode, SourceMode::Durable);
        let request_timeout = shared.config.request_timeout;
        let fetched = shared.block_on(async {
            let fetched = async {
                if durable && self.prefetch.is_none() && !self.measured_message_size {
                    // The continuous pull's request size is fixed when it opens, so learn the
                    // segments per message from one fetched message first: opened on the guess of
                    // one segment per message, it asked for 8 messages of 8-segment frames, and the
                    // 64 segments waiting in the client added 8 versions of lag (issue 11).
                    fetch_into(&self.consumer, 1, wait, request_timeout, &mut messages).await
                } else if durable {
                    self.keep_held_alive().await;
                    // What the last call's early poll took comes first (a reconnect since then
                    // dropped it: the server redelivers it after `ack_wait`).
                    if self.early_connection != connection {
                        self.early.clear();
                    }
                    while messages.len() < want_messages {
                        let Some(message) = self.early.pop_front() else { break };
                        messages.push(message);
                    }
                    if messages.len() < want_messages {
                        let max_payload = shared.client.max_payload();
                        let wait = if messages.is_empty() { wait } else { Duration::ZERO };
                        let pulled = pull_into(
                            &mut self.prefetch,
                            &self.consumer,
                            want_messages,
                            wait,
                            &shared.config,
                            max_payload,
                            &mut messages,
                        )
                        .await;
                        match pulled {
                            Ok(opened) => {
                                if let (Some(batch), Some(pace)) = (opened, self.pace.as_mut()) {
                                    pace.prefetch = batch;
                                }
                            }
                            // The messages in hand go out; the error comes again next call.
                            Err(err) if !messages.is_empty() => debug!(%err, "pull failed after early deliveries"),
                            Err(err) => return Err(err),
                        }
                    }
                    prime_pull(&mut self.prefetch, &mut self.early);
                    self.early_connection = connection;
                    // The continuous pull waits through an outage quietly; say so, as a fetch would.
                    let state = shared.client.connection_state();
                    if messages.is_empty() && state != async_nats::connection::State::Connected {
                        return Err(failed("fetch segments", format!("not connected to the server ({state})")));
                    }
                    Ok(())
                } else if wait.is_zero() {
                    // Replay: a fetch always waits for the server, so none while deliveries are in hand.
                    Ok(())
                } else {
                    fetch_into(&self.consumer, want_messages, wait, request_timeout, &mut messages).await
                }
            }
            .await;
            // Tell the actors what was taken (issue 16: pushed pacing), in the same trip into
            // the runtime. Fire and forget: a lost notice costs an actor one consumer reading.
            if let Some((subject, bytes)) = self.pace.as_mut().and_then(|pace| pace.announce(&messages)) {
                if let Err(err) = shared.client.publish(subject, bytes).await {
                    debug!(operation = "pace notice", error = %err, "not sent");
                }
            }
            fetched
        });
        if let Err(err) = fetched {
            // Deliveries already handed out this call stay handed out; the error comes next time.
            return if n > 0 { Ok(n) } else { Err(err) };
        }
        let mut last_pending = 0;
        let received = messages.len();
        let mut unpacked = 0usize;
        for message in messages {
            let (delivered, pending, stream_sequence) = match message.info() {
                Ok(info) => (info.delivered.max(1) as u64, info.pending, info.stream_sequence),
                Err(err) => {
                    debug!(error = %err, "delivery without jetstream metadata");
                    (1, 0, 0)
                }
            };
            last_pending = pending;
            if let SourceMode::Replay { end_sequence, .. } = self.mode {
                if stream_sequence > end_sequence {
                    // Published after the replay started: past its end.
                    self.mode = SourceMode::Replay { end_sequence, finished: true };
                    break;
                }
            }
            let before = self.ready.len();
            let subject_actor = subject_actor(&shared.config.run, &message.subject);
            unpack_message(&message.payload, stream_sequence, &mut self.next_token, |segment, token| {
                let subject_actor = subject_actor.clone();
                self.ready.push_back(Delivery { segment, token, delivery_count: delivered, subject_actor });
            });
            let n_parts = self.ready.len() - before;
            unpacked += n_parts;
            match &mut self.mode {
                SourceMode::Durable => {
                    self.next_message += 1;
                    let key = self.next_message;
                    for delivery in self.ready.range(before..) {
                        self.parts.insert(delivery.token.0, key);
                    }
                    let open = u32::try_from(n_parts).expect("a frame holds at most MAX_SEGMENTS_PER_BATCH segments");
                    // `unpack_message` hands out at least one delivery per message, with consecutive tokens.
                    let first_token = self.ready.get(before).map_or(0, |delivery| delivery.token.0);
                    let held = Held {
                        message,
                        touched: Instant::now(),
                        connection,
                        open,
                        acked: false,
                        first_token,
                        n_tokens: open,
                    };
                    self.held.insert(key, held);
                }
                SourceMode::Replay { end_sequence, finished } => {
                    if stream_sequence == *end_sequence || pending == 0 {
                        *finished = true;
                        break;
                    }
                }
            }
        }
        if received > 0 {
            // A moving average over recent calls, so one odd message does not swing it.
            let this_call = unpacked as f64 / received as f64;
            self.segments_per_message = if self.measured_message_size {
                0.75 * self.segments_per_message + 0.25 * this_call
            } else {
                this_call
            };
            self.measured_message_size = true;
        }
        while n < max {
            let Some(delivery) = self.ready.pop_front() else { break };
            out.push(delivery);
            n += 1;
        }
        // Each delivery carries the consumer's pending count (in messages), so the backlog is
        // known for free; an empty fetch means nothing was pending.
        let pending_segments = if received == 0 { 0 } else { (last_pending as f64 * self.segments_per_message) as u64 };
        self.record_backlog(pending_segments);
        if n == 0 {
            if let SourceMode::Replay { finished: true, .. } = self.mode {
                return Err(TransportError::Closed);
            }
        }
        Ok(n)
    }

    fn ack(&mut self, tokens: &[DeliveryToken]) -> Result<(), TransportError> {
        if let SourceMode::Replay { .. } = self.mode {
            return Ok(());
        }
        let shared = self.shared.clone();
        shared.block_on(self.ack_all(tokens))
    }

    /// [`ack`](TrajectorySource::ack), giving up after `timeout` (the retries through a broker
    /// outage included): what is not confirmed by then may be redelivered.
    fn ack_within(&mut self, tokens: &[DeliveryToken], timeout: Duration) -> Result<(), TransportError> {
        if let SourceMode::Replay { .. } = self.mode {
            return Ok(());
        }
        let shared = self.shared.clone();
        shared.block_on(async {
            tokio::time::timeout(timeout, self.ack_all(tokens))
                .await
                .unwrap_or(Err(TransportError::Timeout { operation: "ack", after: timeout }))
        })
    }

    /// Sends the double acks at once and confirms them on a task of their own (with the same
    /// retries as [`ack`](TrajectorySource::ack)); the next `recv` collects the outcome, and a
    /// delivery whose ack was not confirmed goes back to the held ones.
    fn ack_later(&mut self, tokens: &[DeliveryToken]) -> Result<(), TransportError> {
        if let SourceMode::Replay { .. } = self.mode {
            return Ok(());
        }
        let settling = self.take_held("ack", tokens, AckKind::Ack);
        if !settling.is_empty() {
            let task = settle_detached(self.shared.clone(), "ack", settling, AckKind::Ack);
            // Its first step runs here: that queues the acks on the connection, so they leave
            // in the same write as what this thread queued before them (the update's live
            // weights) instead of in one of their own; the task then waits for the
            // confirmations (issue 16).
            let first = self.shared.queue(async move {
                let mut task = Box::pin(task);
                match futures::poll!(task.as_mut()) {
                    std::task::Poll::Ready(settled) => futures::future::Either::Left(settled),
                    std::task::Poll::Pending => futures::future::Either::Right(task),
                }
            });
            let task = match first {
                futures::future::Either::Left(settled) => self.shared.handle.spawn(async move { settled }),
                futures::future::Either::Right(task) => self.shared.handle.spawn(task),
            };
            self.background_acks.push_back(task);
        }
        Ok(())
    }

    fn reject(&mut self, token: DeliveryToken) -> Result<(), TransportError> {
        if let SourceMode::Replay { .. } = self.mode {
            return Ok(());
        }
        let shared = self.shared.clone();
        shared.block_on(self.settle("reject", &[token], AckKind::Term))
    }

    fn backlog(&self) -> Option<u64> {
        let mut reading = self.backlog.lock().expect("backlog lock is never poisoned");
        let fresh = reading.at.is_some_and(|at| at.elapsed() < BACKLOG_CACHE);
        if fresh || Handle::try_current().is_ok() {
            return reading.value;
        }
        let reply =
            self.shared.block_on(async { tokio::time::timeout(BACKLOG_DEADLINE, self.consumer.get_info()).await });
        if let Ok(Ok(info)) = reply {
            // The server counts messages; a batch frame holds several segments.
            reading.value = Some((info.num_pending as f64 * self.segments_per_message.max(1.0)) as u64);
        }
        reading.at = Some(Instant::now());
        reading.value
    }
}
