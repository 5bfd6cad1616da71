//! The trajectory source: the learner's durable pull consumer (and the replay consumer),
//! with explicit acks, redelivery handling and the backlog reading behind pacing.

use super::*;

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

/// A delivery the learner has not settled yet.
struct Held {
    message: jetstream::Message,
    /// When the server last heard about it (delivery or progress signal).
    touched: Instant,
    /// The connection it arrived on (the bus's connection count at receipt). After a
    /// reconnect the server may no longer know the delivery (a restarted broker drops pending
    /// state it had not yet written), and then it never answers a double ack for it.
    connection: u64,
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
/// acknowledged within [`NatsConfig::ack_wait`] of its last sign of life is delivered again
/// with a higher `delivery_count`; while the learner holds a delivery and keeps calling `recv`,
/// `recv` sends a progress signal for it every `ack_wait / 2`, so a slow batch is not
/// redelivered under the learner's feet. [`TrajectorySource::reject`] terminates a delivery
/// (`+TERM`): it is never delivered again. Bytes that do not decode come back as a
/// [`Delivery`] holding the [`wire::DecodeError`], to be counted and rejected by the learner.
pub struct NatsTrajectorySource {
    shared: Arc<Shared>,
    consumer: consumer::PullConsumer,
    mode: SourceMode,
    held: HashMap<u64, Held>,
    next_token: u64,
    backlog: Mutex<BacklogReading>,
    /// Acks given up on because the connection their delivery came on was lost.
    abandoned_acks: u64,
}

impl fmt::Debug for NatsTrajectorySource {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("NatsTrajectorySource").field("mode", &self.mode).field("held", &self.held.len()).finish()
    }
}

impl NatsTrajectorySource {
    fn new(shared: Arc<Shared>, consumer: consumer::PullConsumer, mode: SourceMode) -> Self {
        NatsTrajectorySource {
            shared,
            consumer,
            mode,
            held: HashMap::new(),
            next_token: 0,
            backlog: Mutex::new(BacklogReading::default()),
            abandoned_acks: 0,
        }
    }

    /// Deliveries received and not yet acknowledged or rejected.
    pub fn held(&self) -> usize {
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

    /// Settle deliveries from a lost connection with one plain (unconfirmed) ack or term and
    /// forget them. A broker that still knows a delivery applies it; one that restarted without
    /// it redelivers the segment later, which the learner's duplicate filter skips (issue 11:
    /// waiting for confirmations the server never sends stalled training for the whole retry
    /// deadline, ~30 s, after every broker restart).
    async fn abandon(&mut self, operation: &'static str, stale: Vec<(u64, Held)>, kind: AckKind) {
        if stale.is_empty() {
            return;
        }
        let timeout = self.shared.config.request_timeout.min(ABANDON_ACK_DEADLINE);
        let sent = futures::future::join_all(
            stale.iter().map(|(_, held)| tokio::time::timeout(timeout, held.message.ack_with(kind))),
        )
        .await;
        let unsent = sent.iter().filter(|outcome| !matches!(outcome, Ok(Ok(())))).count();
        self.abandoned_acks += stale.len() as u64;
        info!(
            operation,
            abandoned = stale.len(),
            unsent,
            "deliveries from before a reconnect settled without confirmation; the server may deliver them again"
        );
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

    async fn settle(
        &mut self,
        operation: &'static str,
        tokens: &[DeliveryToken],
        kind: AckKind,
    ) -> Result<(), TransportError> {
        let mut settling: Vec<(u64, Held)> = Vec::with_capacity(tokens.len());
        for token in tokens {
            match self.held.remove(&token.0) {
                Some(held) => settling.push((token.0, held)),
                None => debug!(operation, token = token.0, "token not held (already settled or replayed); ignored"),
            }
        }
        let timeout = self.shared.config.request_timeout;
        let started = Instant::now();
        let mut backoff = Backoff::new();
        loop {
            let connection = self.connection();
            let (current, stale): (Vec<_>, Vec<_>) =
                settling.into_iter().partition(|(_, held)| held.connection >= connection);
            self.abandon(operation, stale, kind).await;
            settling = current;
            if settling.is_empty() {
                return Ok(());
            }
            let outcomes = futures::future::join_all(
                settling.iter().map(|(_, held)| tokio::time::timeout(timeout, held.message.double_ack_with(kind))),
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
                return Ok(());
            };
            if started.elapsed() >= self.shared.config.retry_deadline {
                let unsettled = settling.len();
                // Keep them, so a later call may settle them; the server redelivers them otherwise.
                self.held.extend(settling);
                warn!(operation, unsettled, error = %problem, "giving up; these deliveries may be delivered again");
                return Err(TransportError::Timeout { operation, after: self.shared.config.retry_deadline });
            }
            debug!(operation, unsettled = settling.len(), error = %problem, "retrying");
            tokio::time::sleep(backoff.next()).await;
        }
    }

    fn record_backlog(&self, value: u64) {
        let mut reading = self.backlog.lock().expect("backlog lock is never poisoned");
        *reading = BacklogReading { at: Some(Instant::now()), value: Some(value) };
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

impl TrajectorySource for NatsTrajectorySource {
    fn recv(&mut self, max: usize, timeout: Duration, out: &mut Vec<Delivery>) -> Result<usize, TransportError> {
        if let SourceMode::Replay { finished: true, .. } = self.mode {
            return Err(TransportError::Closed);
        }
        if max == 0 {
            return Ok(0);
        }
        let shared = self.shared.clone();
        let connection = self.connection();
        let mut messages = Vec::with_capacity(max);
        shared.block_on(async {
            if matches!(self.mode, SourceMode::Durable) {
                self.keep_held_alive().await;
            }
            fetch_into(&self.consumer, max, timeout, shared.config.request_timeout, &mut messages).await
        })?;
        let mut n = 0;
        let mut last_pending = 0;
        let received = messages.len();
        for message in messages {
            let (delivered, pending, stream_sequence) = match message.info() {
                Ok(info) => (info.delivered.max(1) as u64, info.pending, info.stream_sequence),
                Err(err) => {
                    debug!(error = %err, "delivery without jetstream metadata");
                    (1, 0, 0)
                }
            };
            last_pending = pending;
            let segment = wire::decode_segment_body(&message.payload);
            if let Err(err) = &segment {
                debug!(reason = err.reason(), stream_sequence, "undecodable segment delivered");
            }
            self.next_token += 1;
            let token = DeliveryToken(self.next_token);
            match &mut self.mode {
                SourceMode::Durable => {
                    self.held.insert(token.0, Held { message, touched: Instant::now(), connection });
                }
                SourceMode::Replay { end_sequence, finished } => {
                    if stream_sequence > *end_sequence {
                        // Published after the replay started: past its end.
                        *finished = true;
                        break;
                    }
                    if stream_sequence == *end_sequence || pending == 0 {
                        *finished = true;
                    }
                }
            }
            out.push(Delivery { segment, token, delivery_count: delivered });
            n += 1;
            if let SourceMode::Replay { finished: true, .. } = self.mode {
                break;
            }
        }
        // Each delivery carries the consumer's pending count, so the backlog is known for free;
        // an empty fetch means nothing was pending.
        self.record_backlog(if received == 0 { 0 } else { last_pending });
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
        shared.block_on(self.settle("ack", tokens, AckKind::Ack))
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
            reading.value = Some(info.num_pending);
        }
        reading.at = Some(Instant::now());
        reading.value
    }
}
