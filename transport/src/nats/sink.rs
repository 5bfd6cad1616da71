//! The trajectory sink: actors publish segments with pacing by the learner's backlog and
//! bounded in-flight acknowledgements.

use std::collections::VecDeque;
use std::fmt;
use std::future::{Future, IntoFuture};
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use async_nats::jetstream;
use async_nats::Subject;
use bytes::Bytes;
use tokio::runtime::Handle;
use tracing::{debug, info, warn};
use volley_core::ids::ActorId;
use volley_core::subjects;
use volley_core::wire::{self, TrajectorySegment};

use super::pacing::{
    follow_pace_notices, pace_contradiction, PaceBoard, Pacing, Reading, PACE_DISTRUST, PACING_CACHE, PACING_POLL,
};
use super::{call, denied, failed, incarnation, reconnected_since, source, Backoff, NatsBus, Shared, BACKLOG_DEADLINE};
use crate::{TrajectorySink, TransportError};

impl NatsBus {
    /// Actor side: a sink publishing as `actor`. `stop` ends its retries and waits with
    /// [`TransportError::Closed`]. The stream need not exist yet: publishes retry until it does.
    pub fn trajectory_sink(
        &self,
        actor: &ActorId,
        stop: Arc<AtomicBool>,
    ) -> Result<NatsTrajectorySink, TransportError> {
        let shared = self.shared.clone();
        let timeout = shared.config.request_timeout;
        let stream = shared.block_on(call(
            "open trajectory stream",
            timeout,
            shared.js.get_stream_no_info(subjects::trajectory_stream(&shared.config.run)),
        ))?;
        let notices = Arc::new(PaceBoard::default());
        let listener = follow_pace_notices(&shared, notices.clone());
        Ok(NatsTrajectorySink {
            notices,
            listener,
            last_stored: 0,
            verified_at: None,
            distrusted_until: None,
            notice_reading: false,
            published_since_verified: 0,
            notice_prefetch: 0,
            blocked_on_notices_since: None,
            subject: Subject::from(subjects::trajectories(&shared.config.run, actor)),
            incarnation: incarnation(),
            actor: actor.clone(),
            stop,
            stream,
            in_flight: VecDeque::with_capacity(shared.config.publish_window.max(1)),
            max_backlog_segments: shared.config.max_backlog_segments,
            pacing: Pacing::default(),
            round_segments_per_message: None,
            stats: SinkStats::default(),
            clock: Arc::default(),
            shared,
        })
    }
}

/// Counters of one [`NatsTrajectorySink`].
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct SinkStats {
    /// Segments the stream has acknowledged (stored, or recognised as a duplicate of a stored
    /// retry).
    pub published: u64,
    /// Publish attempts repeated after a failure or a missing ack.
    pub publish_retries: u64,
    /// Time spent waiting for the learner's backlog to fall (pacing), a wait in progress
    /// included (read from the sink's [`crate::PacingClock`]).
    pub throttled: Duration,
    /// Pace notices ([`wire::pace`]) taken as the learner's position.
    pub pace_notices_used: u64,
    /// Pace notices that did not decode (corrupt, malformed).
    pub pace_notices_refused: u64,
    /// Times a reading of the consumer contradicted the notices, which were then ignored for
    /// a second.
    pub pace_notices_distrusted: u64,
}

/// A publish ack on its way, or why it will not come: the client's deadline (counted from the
/// first poll), or a reconnect since the message was sent.
type AckFuture = Pin<Box<dyn Future<Output = Result<jetstream::publish::PublishAck, String>> + Send>>;

/// `ack`, or an error as soon as the connection is not the one `sent_on` counted: the ack of a
/// message sent before a reconnect never comes when the server that should send it died, and
/// the client's deadline only starts when the ack is first awaited, so the sink, which awaits
/// its in-flight acks one after another, waited a whole deadline for each (after a broker
/// restart, an actor with four messages in flight stalled about 20 s at the 5 s default).
/// Resending at once is safe: the message keeps its id, and the stream stores it once.
fn unless_sent_before_a_reconnect(
    ack: jetstream::context::PublishAckFuture,
    connections: tokio::sync::watch::Receiver<u64>,
    sent_on: u64,
) -> AckFuture {
    Box::pin(async move {
        tokio::select! {
            // An ack already here is taken, whatever happened to the connection since.
            biased;
            ack = ack.into_future() => ack.map_err(|err| err.to_string()),
            () = reconnected_since(&connections, sent_on) => {
                Err("sent before a reconnect; its ack will not come".to_string())
            }
        }
    })
}

/// A published message whose ack has not arrived yet; kept so it can be sent again.
struct InFlight {
    msg_id: String,
    payload: Bytes,
    /// Segments the message holds (more than one in a batch frame).
    n_segments: u64,
    ack: AckFuture,
}

/// One message to publish: a single segment, or a batch frame of several
/// ([`wire::batch`]), with its deduplication id.
struct Outgoing {
    msg_id: String,
    payload: Bytes,
    n_segments: u64,
}

/// Actor side of the NATS transport: publishes segments to `volley.<run>.traj.<actor>`.
///
/// - A segment whose encoded size plus headers exceeds the server's `max_payload` is refused
///   with [`TransportError::Failed`] naming both sizes; nothing from that call is published.
/// - The segments of one `publish` call travel together: up to
///   [`NatsConfig::max_segments_per_message`](super::NatsConfig::max_segments_per_message) of them in one message (a batch frame,
///   [`wire::batch`], each segment still encoded and checksummed on its own), as many as fit
///   in [`NatsConfig::max_frame_bytes`](super::NatsConfig::max_frame_bytes) and `max_payload`. A call's segments are never held
///   back for a later call's, so batching adds no latency here (an actor may hand over two
///   fast rounds in one call: `RolloutWorker::with_rounds_per_publish`). A lone segment is
///   sent as a plain segment message.
/// - Up to [`NatsConfig::publish_window`](super::NatsConfig::publish_window) publish acks are in flight; `publish` returns once
///   every segment was sent and all but that many were acknowledged. [`NatsTrajectorySink::flush`]
///   (and drop, best effort) waits for the rest.
/// - A failed publish or a missing ack is retried with backoff, under the same message id so
///   the stream stores it once (a batch frame keeps its id and its bytes), until it succeeds or `stop` is set ([`TransportError::Closed`]).
///   The sink never drops a segment on its own. A retried segment may land after later ones.
/// - Pacing: before each message it waits while the learner's backlog (undelivered segments,
///   read from the consumer at most every 2 ms while waiting and every 20 ms otherwise,
///   counting this sink's own publishes since the reading and those not acknowledged when it
///   was taken, which it may not include yet, predicted in between from the learner's measured
///   drain rate, never draining more than one bound per reading) is at or above
///   [`NatsConfig::max_backlog_segments`](super::NatsConfig::max_backlog_segments) (see [`NatsTrajectorySink::set_max_backlog_segments`]);
///   the time is counted in [`TrajectorySink::throttled`]. With no learner consumer yet it does
///   not wait (the stream keeps the segments). With many actors the bound is approximate:
///   each may overshoot by what the others published since its last reading. A sink that
///   published the newest message leaves the next slots to actors that have waited longer
///   (`Pacing::slots_left_to_others`), so one drain does not wake them all into one slot.
/// - Pushed pacing (issue 16): the learner's pace notices ([`wire::pace`], on
///   `volley.<run>.pace`) are readings too, newer than any poll, and a throttled sink wakes on
///   one; consumer readings remain the fallback (no notice for 2 ms while waiting) and check
///   the notices (see `absorb_notice`).
pub struct NatsTrajectorySink {
    shared: Arc<Shared>,
    actor: ActorId,
    /// Shared bytes, so each publish clones a reference count rather than the string.
    subject: Subject,
    incarnation: String,
    stop: Arc<AtomicBool>,
    stream: jetstream::stream::Stream<()>,
    in_flight: VecDeque<InFlight>,
    max_backlog_segments: u64,
    pacing: Pacing,
    /// The most segments one message of the last `publish` call held: what its round was
    /// packed into, so `wait_for_room` paces the next round as `publish` will.
    round_segments_per_message: Option<u64>,
    stats: SinkStats,
    /// Live view of the time blocked by pacing, for other threads (metrics, liveness).
    clock: Arc<crate::PacingClock>,
    /// The learner's pace notices, received in the background.
    notices: Arc<PaceBoard>,
    listener: Option<tokio::task::JoinHandle<()>>,
    /// Stream sequence of this sink's newest acknowledged message.
    last_stored: u64,
    /// When a consumer reading last checked the notices.
    verified_at: Option<Instant>,
    /// Notices are ignored until then (a reading contradicted them).
    distrusted_until: Option<Instant>,
    /// Whether the last reading in `pacing` came from a notice (else from the consumer).
    notice_reading: bool,
    /// Messages published since a consumer reading last checked the notices.
    published_since_verified: u64,
    /// The learner's prefetch from the newest notice taken (at most the largest it uses).
    notice_prefetch: u64,
    /// Since when notices alone (no room by them) have held the sink back.
    blocked_on_notices_since: Option<Instant>,
}

impl fmt::Debug for NatsTrajectorySink {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("NatsTrajectorySink")
            .field("subject", &self.subject)
            .field("in_flight", &self.in_flight.len())
            .field("stats", &self.stats)
            .finish()
    }
}

/// Bytes the `Nats-Msg-Id` header adds to a message on the wire
/// (`NATS/1.0\r\nNats-Msg-Id: <id>\r\n\r\n`), which counts against `max_payload`.
fn msg_id_header_bytes(msg_id: &str) -> usize {
    "NATS/1.0\r\n".len() + "Nats-Msg-Id".len() + ": ".len() + msg_id.len() + "\r\n".len() + "\r\n".len()
}

/// How [`pack_segments`] bounds a message.
#[derive(Debug, Clone, Copy)]
struct FrameLimits {
    /// The server's limit on a message, headers included.
    max_payload: usize,
    /// [`NatsConfig::max_segments_per_message`](super::NatsConfig::max_segments_per_message).
    max_segments: usize,
    /// [`NatsConfig::max_frame_bytes`](super::NatsConfig::max_frame_bytes).
    max_frame_bytes: usize,
}

/// Encode a `publish` call's segments into messages: runs of up to `max_segments`
/// consecutive segments, each run as long as its frame and id header fit in `max_frame_bytes`
/// and `max_payload`; a run of one is a plain segment message. Fails, publishing nothing, if
/// a segment does not fit in `max_payload` on its own.
///
/// Each segment is encoded straight into the message it travels in
/// ([`wire::batch::FrameBuilder`]), so packing copies no segment bytes, except a segment that
/// turned out not to fit in the frame before it, which moves (once) to the next.
fn pack_segments(
    segments: &[TrajectorySegment],
    incarnation: &str,
    limits: FrameLimits,
) -> Result<Vec<Outgoing>, TransportError> {
    let FrameLimits { max_payload, max_segments, max_frame_bytes } = limits;
    let max_per_message = max_segments.clamp(1, wire::batch::MAX_SEGMENTS_PER_BATCH);
    let frame_limit = max_frame_bytes.min(max_payload);
    // Room reserved per message (a hint: a buffer that falls short grows): the segments it may
    // hold, up to the frame's bound, but always the whole of its first segment, which a
    // segment over the bound fills alone.
    let builder = |from: usize| {
        let parts = (segments.len() - from).min(max_per_message);
        let hints = segments[from..from + parts].iter().map(|s| wire::segment_size_hint(s) + 64);
        let first = wire::segment_size_hint(&segments[from]) + 64;
        let room = hints.sum::<usize>().min(frame_limit.saturating_add(1 << 10).max(first));
        wire::batch::FrameBuilder::new(parts, room)
    };
    let close = |frame: wire::batch::FrameBuilder, run: &[TrajectorySegment]| {
        let first = &run[0];
        let msg_id = if run.len() == 1 {
            subjects::trajectory_msg_id(&first.actor, incarnation, first.env_idx, first.segment_idx)
        } else {
            subjects::trajectory_batch_msg_id(&first.actor, incarnation, first.env_idx, first.segment_idx, run.len())
        };
        let (buffer, start) = frame.finish();
        Outgoing { msg_id, payload: Bytes::from(buffer).slice(start..), n_segments: run.len() as u64 }
    };
    let mut messages = Vec::new();
    if segments.is_empty() {
        return Ok(messages);
    }
    let mut start = 0;
    let mut frame = builder(0);
    // Bytes of the id header a frame starting at `start` may need: the longest single id plus
    // `+` and the count, bounded here by 24 bytes.
    let mut id_bytes = 0;
    for (idx, segment) in segments.iter().enumerate() {
        if !frame.has_room() {
            messages.push(close(std::mem::replace(&mut frame, builder(idx)), &segments[start..idx]));
            start = idx;
        }
        let len = frame.push_with(|out| wire::encode_segment_into(segment, out));
        let single_id = subjects::trajectory_msg_id(&segment.actor, incarnation, segment.env_idx, segment.segment_idx);
        let wire_bytes = len + msg_id_header_bytes(&single_id);
        if wire_bytes > max_payload {
            return Err(failed(
                "publish segment",
                format!(
                    "segment {single_id} encodes to {wire_bytes} bytes (with headers), over the server's max_payload of \
                     {max_payload} bytes; shorten segment_len or raise max_payload"
                ),
            ));
        }
        if idx == start {
            id_bytes = msg_id_header_bytes(&single_id) + 24;
        } else if frame.message_len() + id_bytes > frame_limit {
            // It made the frame too large: it starts the next one.
            let part = frame.pop();
            messages.push(close(std::mem::replace(&mut frame, builder(idx)), &segments[start..idx]));
            start = idx;
            id_bytes = msg_id_header_bytes(&single_id) + 24;
            frame.push_with(|out| out.extend_from_slice(&part));
        }
    }
    if start < segments.len() {
        messages.push(close(frame, &segments[start..]));
    }
    Ok(messages)
}

impl NatsTrajectorySink {
    /// Counters so far.
    pub fn stats(&self) -> SinkStats {
        SinkStats {
            throttled: self.clock.total(),
            pace_notices_refused: self.notices.refused.load(Ordering::Relaxed),
            ..self.stats
        }
    }

    /// The subject this sink publishes to.
    pub fn subject(&self) -> &str {
        &self.subject
    }

    /// Override the pacing bound of this sink ([`NatsConfig::max_backlog_segments`](super::NatsConfig::max_backlog_segments) by
    /// default), e.g. with the value from the run spec read after connecting.
    pub fn set_max_backlog_segments(&mut self, max_backlog_segments: u64) {
        self.max_backlog_segments = max_backlog_segments;
    }

    /// Wait until every published segment is acknowledged by the stream (retrying as
    /// `publish` does). On failure the segments not acknowledged are given up on (counted in
    /// the warning), so that dropping the sink does not wait on them again: a stopping actor
    /// whose broker is gone exits after one request timeout, not two (issue 48).
    pub fn flush(&mut self) -> Result<(), TransportError> {
        let shared = self.shared.clone();
        let outcome = shared.block_on(async {
            while !self.in_flight.is_empty() {
                self.settle_oldest().await?;
            }
            Ok(())
        });
        if outcome.is_err() {
            warn!(actor = %self.actor, unacknowledged = self.in_flight.len(), "giving up on segments not acknowledged");
            self.in_flight.clear();
        }
        outcome
    }

    fn stopped(&self) -> bool {
        self.stop.load(Ordering::Acquire)
    }

    async fn publish_all(&mut self, segments: Vec<TrajectorySegment>) -> Result<(), TransportError> {
        let max_payload = self.shared.client.max_payload();
        let limits = FrameLimits {
            max_payload,
            max_segments: self.shared.config.max_segments_per_message,
            max_frame_bytes: self.shared.config.max_frame_bytes,
        };
        let messages = pack_segments(&segments, &self.incarnation, limits)?;
        self.round_segments_per_message = messages.iter().map(|m| m.n_segments).max();
        drop(segments);
        let window = self.shared.config.publish_window.max(1);
        for Outgoing { msg_id, payload, n_segments } in messages {
            if self.stopped() {
                return Err(TransportError::Closed);
            }
            self.pace(n_segments).await?;
            let ack = self.send(&msg_id, payload.clone()).await?;
            self.pacing.published_since += 1;
            self.published_since_verified += 1;
            self.in_flight.push_back(InFlight { msg_id, payload, n_segments, ack });
            while self.in_flight.len() >= window {
                self.settle_oldest().await?;
            }
        }
        Ok(())
    }

    /// Hand one message to the client, retrying until the client accepts it (the ack comes
    /// later). Only an oversize message fails for good.
    async fn send(&mut self, msg_id: &str, payload: Bytes) -> Result<AckFuture, TransportError> {
        let timeout = self.shared.config.request_timeout;
        let mut backoff = Backoff::new();
        let mut attempts = 0u32;
        loop {
            if self.stopped() {
                return Err(TransportError::Closed);
            }
            attempts += 1;
            // The connection the message goes out on (a message the client buffers while
            // disconnected counts as sent before the reconnect: resent, then deduplicated).
            let connections = self.shared.connections.clone();
            let sent_on = *connections.borrow();
            let message = jetstream::message::PublishMessage::build().payload(payload.clone()).message_id(msg_id);
            let problem =
                match tokio::time::timeout(timeout, self.shared.js.send_publish(self.subject.clone(), message)).await {
                    Ok(Ok(ack)) => {
                        if attempts > 1 {
                            info!(actor = %self.actor, msg_id, attempts, "segment publish recovered");
                        }
                        return Ok(unless_sent_before_a_reconnect(ack, connections, sent_on));
                    }
                    Ok(Err(err)) if err.kind() == jetstream::context::PublishErrorKind::MaxPayloadExceeded => {
                        return Err(failed("publish segment", format!("segment {msg_id} refused: {err}")));
                    }
                    Ok(Err(err)) => err.to_string(),
                    Err(_) => format!("no answer within {timeout:?}"),
                };
            self.stats.publish_retries += 1;
            self.log_retry(msg_id, attempts, &problem);
            tokio::time::sleep(backoff.next()).await;
        }
    }

    fn log_retry(&self, msg_id: &str, attempts: u32, problem: &str) {
        // First failure and every tenth after it: an outage logs about once per 10 s per actor.
        if attempts == 1 || attempts.is_multiple_of(10) {
            warn!(operation = "publish segment", actor = %self.actor, msg_id, attempts, error = problem, "segment publish failed; retrying");
        } else {
            debug!(operation = "publish segment", actor = %self.actor, msg_id, attempts, error = problem, "segment publish failed; retrying");
        }
    }

    /// Wait for the oldest ack; on failure send that segment again until it is acknowledged.
    async fn settle_oldest(&mut self) -> Result<(), TransportError> {
        let Some(InFlight { msg_id, payload, n_segments, mut ack }) = self.in_flight.pop_front() else {
            return Ok(());
        };
        let mut attempts = 0u32;
        let mut backoff = Backoff::new();
        loop {
            attempts += 1;
            // The ack future has its deadline built in (the JetStream context's timeout,
            // `request_timeout`), so no second timer per segment.
            let problem = match (&mut ack).await {
                Ok(publish_ack) => {
                    if publish_ack.duplicate {
                        debug!(actor = %self.actor, msg_id, "stream already had this segment");
                    }
                    self.last_stored = self.last_stored.max(publish_ack.sequence);
                    self.stats.published += n_segments;
                    return Ok(());
                }
                Err(problem) => problem,
            };
            // A denied publish is never acknowledged; retrying it cannot help.
            let window = Instant::now().checked_sub(self.shared.config.request_timeout * 2);
            let subject = format!("\"{}\"", self.subject);
            if let Some(violation) = window.and_then(|since| self.shared.denials.since(since, &subject)) {
                return Err(denied("publish segment", &violation));
            }
            if self.stopped() {
                return Err(TransportError::Closed);
            }
            self.stats.publish_retries += 1;
            self.log_retry(&msg_id, attempts, &problem);
            tokio::time::sleep(backoff.next()).await;
            ack = self.send(&msg_id, payload.clone()).await?;
        }
    }

    /// Wait while the learner's backlog is at or above the bound (see [`Pacing`]).
    ///
    /// Between readings the backlog is predicted from the learner's drain rate (issue 16: with
    /// a reading every 2 ms while blocked, a learner that drains a batch in about a millisecond
    /// spent half its time waiting for an actor that was waiting for its next reading).
    ///
    /// The backlog is read in messages; a sink whose messages hold `segments_per_message`
    /// segments waits at the bound divided by that many messages.
    async fn pace(&mut self, segments_per_message: u64) -> Result<(), TransportError> {
        let limit = self.max_backlog_segments.div_ceil(segments_per_message.max(1));
        let result = loop {
            if self.stopped() {
                break Err(TransportError::Closed);
            }
            if let Err(err) = self.absorb_notice(limit).await {
                break Err(err);
            }
            let Some(age) = self.pacing.checked_at.map(|at| at.elapsed()) else {
                if let Err(err) = self.read_backlog().await {
                    break Err(err);
                }
                continue;
            };
            // A notice counts what the learner's client prefetched and has not taken yet, which
            // a consumer reading (undelivered messages only) does not: allow for it, so both
            // keep the same bound.
            let base_limit = limit;
            let bound = if self.notice_reading { limit + self.notice_prefetch } else { limit };
            let limit = bound - self.pacing.slots_left_to_others(bound, self.messages_after_own());
            let estimate = self.pacing.estimate(age, limit);
            let room = estimate.is_none_or(|estimate| estimate < limit);
            // Only the bound itself says the notices hold the sink back: slots left to other
            // actors may be held by the learner's prefetch alone, with nothing undelivered, which
            // the check below would take for a lie.
            let full = estimate.is_some_and(|estimate| estimate >= bound);
            if room || !full || !self.notice_reading {
                self.blocked_on_notices_since = None;
            } else if let Some(since) = self.blocked_on_notices_since {
                // Held back by notices alone for a while: a consumer reading that shows the
                // stream drained means the notices lie (a forger freezing actors).
                if since.elapsed() >= PACING_CACHE {
                    self.blocked_on_notices_since = None;
                    if let Err(err) = self.check_notices_hold(base_limit).await {
                        break Err(err);
                    }
                    continue;
                }
            } else {
                self.blocked_on_notices_since = Some(Instant::now());
            }
            let trusted_for = if room { PACING_CACHE } else { PACING_POLL };
            if age >= trusted_for {
                if let Err(err) = self.read_backlog().await {
                    break Err(err);
                }
                continue;
            }
            if room {
                break Ok(());
            }
            self.clock.block();
            let wait = self.pacing.time_to_room(estimate.unwrap_or(limit), limit, trusted_for - age);
            if self.notices_trusted() {
                // A notice (the learner took messages) wakes the sink at once.
                tokio::select! {
                    _ = self.notices.arrived.notified() => {}
                    _ = tokio::time::sleep(wait) => {}
                }
            } else {
                tokio::time::sleep(wait).await;
            }
        };
        self.clock.unblock();
        result
    }

    /// Messages stored after this sink's newest as of the current reading: 0 while one of its
    /// own may not be in the reading yet, `None` before it has published any.
    fn messages_after_own(&self) -> Option<u64> {
        let (reading, _) = self.pacing.last?;
        let own_unconfirmed =
            !self.in_flight.is_empty() || self.pacing.published_since > 0 || self.pacing.unconfirmed > 0;
        if own_unconfirmed {
            Some(0)
        } else if self.last_stored == 0 {
            None
        } else {
            Some(reading.stored.saturating_sub(self.last_stored))
        }
    }

    /// A consumer reading after notices held the sink back for [`PACING_CACHE`]: if nothing is
    /// undelivered at all, the notices (which claim at least `limit` plus the learner's prefetch
    /// not taken) lie, and they are distrusted for [`PACE_DISTRUST`]; either way the reading
    /// becomes the current one. Nothing undelivered, not merely fewer than the bound: the
    /// learner's client may hold a little more than its prefetch while it computes, so an
    /// honest notice can show more than the consumer does.
    async fn check_notices_hold(&mut self, limit: u64) -> Result<(), TransportError> {
        self.read_backlog().await?;
        if self.pacing.backlog == Some(0) {
            self.distrust_notices(limit, "nothing is undelivered while the notices hold actors back");
        }
        Ok(())
    }

    fn distrust_notices(&mut self, limit: u64, why: &str) {
        self.stats.pace_notices_distrusted += 1;
        self.distrusted_until = Some(Instant::now() + PACE_DISTRUST);
        let latest = *self.notices.latest.lock().expect("pace board lock is never poisoned");
        warn!(
            actor = %self.actor,
            pending = ?self.pacing.backlog,
            limit,
            notice = ?latest.map(|(notice, _)| notice),
            "pace notices contradicted: {why}; ignoring them for {PACE_DISTRUST:?}"
        );
    }

    fn notices_trusted(&self) -> bool {
        self.listener.is_some() && self.distrusted_until.is_none_or(|until| Instant::now() >= until)
    }

    /// Take the newest pace notice, if it is newer than the last reading, as a reading of the
    /// learner's backlog: the stream's newest sequence (the notice's, or this sink's own newest
    /// acknowledged message if later) less what the learner has taken, plus this sink's
    /// messages not acknowledged yet (which may not be in either). The backlog so counted
    /// includes what the learner's client holds and has not taken yet.
    ///
    /// A consumer reading checks the notices every [`PACING_CACHE`] and after every
    /// [`pace_contradiction`] messages this sink published: more undelivered messages than
    /// notice-paced actors leave means a notice lied, and notices are ignored for
    /// [`PACE_DISTRUST`] (pacing falls back to readings alone). So a forger, who needs the
    /// learner's credentials to publish notices at all, can make one sink overshoot the
    /// bound by at most twice [`pace_contradiction`] messages (plus its publish window in
    /// flight) before it falls back to readings.
    async fn absorb_notice(&mut self, limit: u64) -> Result<(), TransportError> {
        if !self.notices_trusted() {
            return Ok(());
        }
        let latest = *self.notices.latest.lock().expect("pace board lock is never poisoned");
        let Some((notice, arrived)) = latest else { return Ok(()) };
        if self.pacing.checked_at.is_some_and(|checked| checked >= arrived) {
            return Ok(());
        }
        let bound = pace_contradiction(limit);
        if self.verified_at.is_none_or(|at| at.elapsed() >= PACING_CACHE) || self.published_since_verified >= bound {
            self.verified_at = Some(Instant::now());
            self.published_since_verified = 0;
            if let Some(Reading { pending, .. }) = self.read_consumer().await {
                if pending >= bound {
                    self.distrust_notices(limit, &format!("{pending} messages undelivered, over {bound}"));
                    return Ok(());
                }
            }
        }
        let unacknowledged = self.settle_ready().await?;
        let stored = notice.stored.max(self.last_stored);
        let reading = Reading {
            pending: stored - notice.taken + unacknowledged,
            delivered: notice.taken,
            stored: stored + unacknowledged,
        };
        if !self.notice_reading {
            // Rates only between readings of one kind: a notice counts the learner's position
            // as taken, a consumer reading as delivered.
            self.pacing.last = None;
        }
        // `pending` above already counts the messages not acknowledged yet.
        self.pacing.record(Some(reading), 0, arrived);
        self.notice_reading = true;
        self.notice_prefetch = u64::from(notice.prefetch).min(source::PREFETCH_MAX as u64);
        self.stats.pace_notices_used += 1;
        Ok(())
    }

    /// Settle the in-flight messages whose acks have arrived (oldest first, without waiting);
    /// the messages still unacknowledged after that, which a reading may not include.
    async fn settle_ready(&mut self) -> Result<u64, TransportError> {
        while let Some(front) = self.in_flight.front_mut() {
            match futures::FutureExt::now_or_never(&mut front.ack) {
                None => break,
                Some(outcome) => {
                    // Settle it through the usual path (retries included), with its outcome.
                    front.ack = Box::pin(std::future::ready(outcome));
                    self.settle_oldest().await?;
                }
            }
        }
        Ok(self.in_flight.len() as u64)
    }

    /// A consumer reading as the current one. The acks that have arrived are settled first, so
    /// the messages still unacknowledged, which the reading may not include, are counted on
    /// top of it ([`Pacing::unconfirmed`]).
    async fn read_backlog(&mut self) -> Result<(), TransportError> {
        let unconfirmed = self.settle_ready().await?;
        let reading = self.read_consumer().await;
        if self.notice_reading {
            self.pacing.last = None;
        }
        self.pacing.record(reading, unconfirmed, Instant::now());
        self.notice_reading = false;
        Ok(())
    }

    /// One reading of the learner consumer, or `None` when unknown (no consumer yet, an
    /// error, no answer within [`BACKLOG_DEADLINE`]).
    async fn read_consumer(&mut self) -> Option<Reading> {
        let reading =
            tokio::time::timeout(BACKLOG_DEADLINE, self.stream.consumer_info(subjects::LEARNER_CONSUMER)).await;
        match reading {
            Ok(Ok(info)) => Some(Reading {
                pending: info.num_pending,
                // Stream sequences, as pace notices count (redeliveries do not drain).
                delivered: info.delivered.stream_sequence,
                stored: info.delivered.stream_sequence.saturating_add(info.num_pending),
            }),
            Ok(Err(err)) if matches!(err.kind(), jetstream::context::ConsumerInfoErrorKind::NotFound) => None,
            Ok(Err(err)) => {
                debug!(operation = "read learner backlog", error = %err, "backlog unknown; not pacing");
                None
            }
            Err(_) => {
                debug!(operation = "read learner backlog", "backlog reading timed out; not pacing");
                None
            }
        }
    }
}

impl TrajectorySink for NatsTrajectorySink {
    fn publish(&mut self, segments: Vec<TrajectorySegment>) -> Result<(), TransportError> {
        let shared = self.shared.clone();
        shared.block_on(self.publish_all(segments))
    }

    fn wait_for_room(&mut self, n_segments: usize) -> Result<(), TransportError> {
        // The backlog is read in messages (see `pace`): pace at the packing of the last round
        // (bytes and `max_payload` can split a round of large segments into several
        // messages), or before the first one at the count limit alone.
        let per_message = self
            .round_segments_per_message
            .unwrap_or_else(|| n_segments.clamp(1, self.shared.config.max_segments_per_message.max(1)) as u64);
        let shared = self.shared.clone();
        shared.block_on(self.pace(per_message))
    }

    fn throttled(&self) -> Duration {
        self.clock.total()
    }

    fn publish_retries(&self) -> u64 {
        self.stats.publish_retries
    }

    fn pacing_clock(&self) -> Option<Arc<crate::PacingClock>> {
        Some(self.clock.clone())
    }

    fn pace_notices(&self) -> crate::PaceNoticeCounts {
        let stats = self.stats();
        crate::PaceNoticeCounts {
            used: stats.pace_notices_used,
            refused: stats.pace_notices_refused,
            distrusted: stats.pace_notices_distrusted,
        }
    }
}

impl Drop for NatsTrajectorySink {
    fn drop(&mut self) {
        if let Some(listener) = self.listener.take() {
            listener.abort();
        }
        if self.in_flight.is_empty() || Handle::try_current().is_ok() {
            return;
        }
        // Best effort: give the outstanding acks one request timeout, then let go. With `stop`
        // set, the first failed ack ends it (no retries).
        let shared = self.shared.clone();
        let deadline = shared.config.request_timeout;
        let outcome = shared.block_on(async {
            tokio::time::timeout(deadline, async {
                while !self.in_flight.is_empty() {
                    self.settle_oldest().await?;
                }
                Ok::<_, TransportError>(())
            })
            .await
        });
        if !matches!(outcome, Ok(Ok(()))) {
            warn!(actor = %self.actor, unacknowledged = self.in_flight.len(), "sink dropped with segments not acknowledged");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    use volley_testkit::fixtures::SegmentBuilder;

    fn segments(n: usize, obs_dim: usize) -> Vec<TrajectorySegment> {
        (0..n)
            .map(|idx| SegmentBuilder::new(8, obs_dim).frames_from(|_| 0).env_idx(idx as u32).segment_idx(7).build())
            .collect()
    }

    fn limits(max_payload: usize, max_segments: usize) -> FrameLimits {
        FrameLimits { max_payload, max_segments, max_frame_bytes: usize::MAX }
    }

    fn parts_of(message: &Outgoing) -> Vec<TrajectorySegment> {
        if wire::batch::is_segment_batch(&message.payload) {
            let parts = wire::batch::split_segment_batch(&message.payload).expect("a valid frame");
            parts.map(|part| wire::decode_segment_body(part).expect("a valid segment")).collect()
        } else {
            vec![wire::decode_segment_body(&message.payload).expect("a valid segment")]
        }
    }

    #[test]
    fn a_calls_segments_are_packed_in_order_within_the_count_and_the_payload() {
        let input = segments(10, 4);
        let packed = pack_segments(&input, "0f", limits(1 << 20, 4)).expect("fits");
        assert_eq!(packed.iter().map(|m| m.n_segments).collect::<Vec<_>>(), [4, 4, 2]);
        let unpacked: Vec<_> = packed.iter().flat_map(parts_of).collect();
        assert_eq!(unpacked, input);
        assert!(packed[0].msg_id.ends_with("-0-7+4") && packed[2].msg_id.ends_with("-8-7+2"), "{}", packed[0].msg_id);
        // The frame bound: three segments' worth of bytes holds at most three per message.
        let one = wire::encode_segment(&input[0]).len();
        let limit = wire::batch::batch_header_bytes(3) + 3 * one + 60;
        let packed = pack_segments(&input[..5], "0f", FrameLimits { max_frame_bytes: limit, ..limits(1 << 20, 64) })
            .expect("fits");
        assert!(packed.iter().all(|m| m.payload.len() + msg_id_header_bytes(&m.msg_id) <= limit));
        assert_eq!(packed.iter().map(|m| m.n_segments).sum::<u64>(), 5);
        assert!(packed.iter().all(|m| m.n_segments <= 3));
        assert_eq!(packed.iter().flat_map(parts_of).collect::<Vec<_>>(), input[..5]);
        // Built in place, the messages are the bytes of segments encoded alone and framed.
        let mut from = 0;
        for message in &packed {
            let run = &input[from..from + message.n_segments as usize];
            let parts: Vec<Vec<u8>> = run.iter().map(wire::encode_segment).collect();
            let expected = if parts.len() == 1 { parts[0].clone() } else { wire::batch::encode_segment_batch(&parts) };
            assert_eq!(message.payload[..], expected[..]);
            from += run.len();
        }
    }

    #[test]
    fn by_default_a_round_of_64_kb_segments_is_one_message() {
        // Issue 16 item 4: with the default frame bound (1 MiB) and the server's default
        // `max_payload` (1 MiB), 8 segments of 64 KB travel as one frame, not one per message.
        let defaults = super::super::NatsConfig::new(
            "nats://127.0.0.1:4222",
            volley_core::ids::RunId::new("r").expect("valid run id"),
        );
        // The fixture's observations are frames, sent as one byte each.
        let input = segments(8, 7_600);
        let one = wire::encode_segment(&input[0]).len();
        assert!((60_000..70_000).contains(&one), "a segment of about 64 KB, not {one} bytes");
        let limits = FrameLimits {
            max_payload: 1 << 20,
            max_segments: defaults.max_segments_per_message,
            max_frame_bytes: defaults.max_frame_bytes,
        };
        let packed = pack_segments(&input, "0f", limits).expect("fits");
        assert_eq!(packed.iter().map(|m| m.n_segments).collect::<Vec<_>>(), [8]);
        assert_eq!(packed.iter().flat_map(parts_of).collect::<Vec<_>>(), input);
    }

    #[test]
    fn an_empty_call_packs_nothing() {
        assert!(pack_segments(&[], "0f", limits(1 << 20, 64)).expect("nothing to pack").is_empty());
    }

    #[test]
    fn one_segment_per_message_sends_plain_segments_with_their_own_ids() {
        let input = segments(3, 4);
        let packed = pack_segments(&input, "0f", limits(1 << 20, 1)).expect("fits");
        assert_eq!(packed.len(), 3);
        for (message, segment) in packed.iter().zip(&input) {
            assert!(!wire::batch::is_segment_batch(&message.payload));
            assert_eq!(message.msg_id, subjects::trajectory_msg_id(&segment.actor, "0f", segment.env_idx, 7));
        }
    }

    #[test]
    fn a_segment_over_max_payload_fails_the_whole_call() {
        let input = segments(3, 4);
        let one = wire::encode_segment(&input[0]).len();
        let err = pack_segments(&input, "0f", limits(one, 64)).err().expect("a segment plus its header does not fit");
        assert!(matches!(&err, TransportError::Failed { message, .. } if message.contains("max_payload")), "{err}");
    }

    #[test]
    fn header_size_matches_the_nats_framing() {
        let id = "actor-1-ab-0-7";
        let header = format!("NATS/1.0\r\nNats-Msg-Id: {id}\r\n\r\n");
        assert_eq!(msg_id_header_bytes(id), header.len());
    }
}
