//! The trajectory sink: actors publish segments with pacing by the learner's backlog and
//! bounded in-flight acknowledgements.

use super::*;

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
        Ok(NatsTrajectorySink {
            subject: Subject::from(subjects::trajectories(&shared.config.run, actor)),
            incarnation: incarnation(),
            actor: actor.clone(),
            stop,
            stream,
            in_flight: VecDeque::with_capacity(shared.config.publish_window.max(1)),
            max_backlog_segments: shared.config.max_backlog_segments,
            pacing: Pacing::default(),
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
}

type AckFuture =
    Pin<Box<dyn Future<Output = Result<jetstream::publish::PublishAck, jetstream::context::PublishError>> + Send>>;

/// A published segment whose ack has not arrived yet; kept so it can be sent again.
struct InFlight {
    msg_id: String,
    payload: Bytes,
    ack: AckFuture,
}

/// The last reading of the learner consumer's backlog.
#[derive(Debug, Default)]
struct Pacing {
    checked_at: Option<Instant>,
    /// The consumer's `num_pending` (stored, not yet delivered); `None` when the consumer does
    /// not exist (yet) or the reading failed, which does not block. Deliveries held by the
    /// learner (`num_ack_pending`, at most about one batch) are not counted: after a learner
    /// crash they stay unacknowledged until `ack_wait`, and counting them would stall every
    /// actor for that long.
    backlog: Option<u64>,
    /// Segments this sink published since the reading.
    published_since: u64,
}

/// Actor side of the NATS transport: publishes segments to `volley.<run>.traj.<actor>`.
///
/// - A segment whose encoded size plus headers exceeds the server's `max_payload` is refused
///   with [`TransportError::Failed`] naming both sizes; nothing from that call is published.
/// - Up to [`NatsConfig::publish_window`] publish acks are in flight; `publish` returns once
///   every segment was sent and all but that many were acknowledged. [`NatsTrajectorySink::flush`]
///   (and drop, best effort) waits for the rest.
/// - A failed publish or a missing ack is retried with backoff, under the same message id so
///   the stream stores it once, until it succeeds or `stop` is set ([`TransportError::Closed`]).
///   The sink never drops a segment on its own. A retried segment may land after later ones.
/// - Pacing: before each segment it waits while the learner's backlog (undelivered plus
///   unacknowledged segments, read from the consumer at most every 50 ms while waiting and
///   every 250 ms otherwise, counting this sink's own publishes in between) is at or above
///   [`NatsConfig::max_backlog_segments`] (see [`NatsTrajectorySink::set_max_backlog_segments`]);
///   the time is counted in [`TrajectorySink::throttled`]. With no learner consumer yet it does
///   not wait (the stream keeps the segments). With many actors the bound is approximate:
///   each may overshoot by what the others published since its last reading.
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
    stats: SinkStats,
    /// Live view of the time blocked by pacing, for other threads (metrics, liveness).
    clock: Arc<crate::PacingClock>,
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

impl NatsTrajectorySink {
    /// Counters so far.
    pub fn stats(&self) -> SinkStats {
        SinkStats { throttled: self.clock.total(), ..self.stats }
    }

    /// The subject this sink publishes to.
    pub fn subject(&self) -> &str {
        &self.subject
    }

    /// Override the pacing bound of this sink ([`NatsConfig::max_backlog_segments`] by
    /// default), e.g. with the value from the run spec read after connecting.
    pub fn set_max_backlog_segments(&mut self, max_backlog_segments: u64) {
        self.max_backlog_segments = max_backlog_segments;
    }

    /// Wait until every published segment is acknowledged by the stream (retrying as
    /// `publish` does).
    pub fn flush(&mut self) -> Result<(), TransportError> {
        let shared = self.shared.clone();
        shared.block_on(async {
            while !self.in_flight.is_empty() {
                self.settle_oldest().await?;
            }
            Ok(())
        })
    }

    fn stopped(&self) -> bool {
        self.stop.load(Ordering::Acquire)
    }

    async fn publish_all(&mut self, segments: Vec<TrajectorySegment>) -> Result<(), TransportError> {
        let max_payload = self.shared.client.max_payload();
        let mut encoded = Vec::with_capacity(segments.len());
        for segment in &segments {
            let msg_id =
                subjects::trajectory_msg_id(&segment.actor, &self.incarnation, segment.env_idx, segment.segment_idx);
            let payload = wire::encode_segment(segment);
            let wire_bytes = payload.len() + msg_id_header_bytes(&msg_id);
            if wire_bytes > max_payload {
                return Err(failed(
                    "publish segment",
                    format!(
                        "segment {msg_id} encodes to {wire_bytes} bytes (with headers), over the server's max_payload of \
                         {max_payload} bytes; shorten segment_len or raise max_payload"
                    ),
                ));
            }
            encoded.push((msg_id, Bytes::from(payload)));
        }
        let window = self.shared.config.publish_window.max(1);
        for (msg_id, payload) in encoded {
            if self.stopped() {
                return Err(TransportError::Closed);
            }
            self.pace().await?;
            let ack = self.send(&msg_id, payload.clone()).await?;
            self.pacing.published_since += 1;
            self.in_flight.push_back(InFlight { msg_id, payload, ack });
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
            let message = jetstream::message::PublishMessage::build().payload(payload.clone()).message_id(msg_id);
            let problem =
                match tokio::time::timeout(timeout, self.shared.js.send_publish(self.subject.clone(), message)).await {
                    Ok(Ok(ack)) => {
                        if attempts > 1 {
                            info!(actor = %self.actor, msg_id, attempts, "segment publish recovered");
                        }
                        return Ok(ack.into_future());
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
        let Some(InFlight { msg_id, payload, mut ack }) = self.in_flight.pop_front() else {
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
                    self.stats.published += 1;
                    return Ok(());
                }
                Err(err) => err.to_string(),
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
    async fn pace(&mut self) -> Result<(), TransportError> {
        let limit = self.max_backlog_segments;
        let result = loop {
            if self.stopped() {
                break Err(TransportError::Closed);
            }
            let estimate = self.pacing.backlog.map(|backlog| backlog + self.pacing.published_since);
            let room = estimate.is_none_or(|estimate| estimate < limit);
            let trusted_for = if room { PACING_CACHE } else { PACING_POLL };
            match self.pacing.checked_at.map(|at| at.elapsed()) {
                Some(age) if age < trusted_for => {
                    if room {
                        break Ok(());
                    }
                    self.clock.block();
                    tokio::time::sleep(trusted_for - age).await;
                }
                _ => self.read_backlog().await,
            }
        };
        self.clock.unblock();
        result
    }

    async fn read_backlog(&mut self) {
        let reading =
            tokio::time::timeout(BACKLOG_DEADLINE, self.stream.consumer_info(subjects::LEARNER_CONSUMER)).await;
        self.pacing.backlog = match reading {
            Ok(Ok(info)) => Some(info.num_pending),
            Ok(Err(err)) if matches!(err.kind(), jetstream::context::ConsumerInfoErrorKind::NotFound) => None,
            Ok(Err(err)) => {
                debug!(operation = "read learner backlog", error = %err, "backlog unknown; not pacing");
                None
            }
            Err(_) => {
                debug!(operation = "read learner backlog", "backlog reading timed out; not pacing");
                None
            }
        };
        self.pacing.checked_at = Some(Instant::now());
        self.pacing.published_since = 0;
    }
}

impl TrajectorySink for NatsTrajectorySink {
    fn publish(&mut self, segments: Vec<TrajectorySegment>) -> Result<(), TransportError> {
        let shared = self.shared.clone();
        shared.block_on(self.publish_all(segments))
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
}

impl Drop for NatsTrajectorySink {
    fn drop(&mut self) {
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

    #[test]
    fn header_size_matches_the_nats_framing() {
        let id = "actor-1-ab-0-7";
        let header = format!("NATS/1.0\r\nNats-Msg-Id: {id}\r\n\r\n");
        assert_eq!(msg_id_header_bytes(id), header.len());
    }
}
