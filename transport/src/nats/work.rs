//! Save-load and budget assignment over JetStream: the work queue, the actors' work source
//! and the snapshot store.

use super::*;

/// Create (or update) the work-queue stream, the actors' shared consumer, the snapshot object
/// store and its per-item index, bounded by the run's snapshot retention.
pub(super) async fn ensure_work_objects(
    shared: &Shared,
    work: &volley_core::work::WorkConfig,
    stores: &volley_core::spec::StoreLimits,
) -> Result<(), TransportError> {
    let config = &shared.config;
    let timeout = config.request_timeout;
    let ttl = Duration::from_secs_f64(work.snapshot_ttl_secs);
    let stream_name = subjects::work_stream(&config.run);
    let stream_config = stream::Config {
        name: stream_name.clone(),
        description: Some(format!("volley run {} work items", config.run)),
        subjects: vec![subjects::work(&config.run)],
        retention: stream::RetentionPolicy::WorkQueue,
        storage: stream::StorageType::File,
        max_messages: stores.work_max_messages as i64,
        max_bytes: stores.work_max_bytes as i64,
        max_age: Duration::from_secs_f64(stores.work_max_age_secs),
        duplicate_window: config.duplicate_window,
        num_replicas: config.replicas,
        ..Default::default()
    };
    call("create work stream", timeout, shared.js.create_or_update_stream(stream_config)).await?;
    let stream = call("open work stream", timeout, shared.js.get_stream_no_info(&stream_name)).await?;
    let consumer_config = consumer::pull::Config {
        durable_name: Some(subjects::WORK_CONSUMER.to_string()),
        description: Some(format!("volley run {} actors' work", config.run)),
        ack_policy: consumer::AckPolicy::Explicit,
        ack_wait: Duration::from_secs_f64(work.ack_wait_secs),
        max_deliver: -1,
        ..Default::default()
    };
    call("create work consumer", timeout, stream.create_consumer(consumer_config)).await?;
    let snapshots = subjects::snapshot_bucket(&config.run);
    if open_objects(&shared.js, &snapshots, timeout).await?.is_none() {
        let objects_config = object_store::Config {
            bucket: snapshots.clone(),
            description: Some(format!("volley run {}: episode snapshots", config.run)),
            storage: stream::StorageType::File,
            max_age: ttl,
            max_bytes: stores.snapshot_max_bytes as i64,
            num_replicas: config.replicas,
            ..Default::default()
        };
        if let Err(err) = call("create snapshot store", timeout, shared.js.create_object_store(objects_config)).await {
            open_objects(&shared.js, &snapshots, timeout).await?.ok_or(err)?;
        }
    }
    let index = subjects::snapshot_index_bucket(&config.run);
    if open_kv(&shared.js, &index, timeout).await?.is_none() {
        let kv_config = kv::Config {
            bucket: index.clone(),
            description: format!("volley run {}: newest snapshot per work item", config.run),
            history: 1,
            max_age: ttl,
            max_bytes: stores.snapshot_index_max_bytes as i64,
            storage: stream::StorageType::File,
            num_replicas: config.replicas,
            ..Default::default()
        };
        if let Err(err) = call("create snapshot index", timeout, shared.js.create_key_value(kv_config)).await {
            open_kv(&shared.js, &index, timeout).await?.ok_or(err)?;
        }
    }
    Ok(())
}

impl NatsBus {
    /// Learner side: where the scheduler queues work items (the run must exist with
    /// `work.enabled`; see [`NatsBus::ensure_run`]).
    pub fn work_queue(&self) -> Result<NatsWorkQueue, TransportError> {
        let shared = self.shared.clone();
        let timeout = shared.config.request_timeout;
        let stream = shared.block_on(call(
            "open work stream",
            timeout,
            shared.js.get_stream_no_info(subjects::work_stream(&shared.config.run)),
        ))?;
        Ok(NatsWorkQueue { shared, stream })
    }

    /// Actor side: take work items from the run's shared work consumer.
    pub fn work_source(&self) -> Result<NatsWorkSource, TransportError> {
        let shared = self.shared.clone();
        let timeout = shared.config.request_timeout;
        let consumer = shared.block_on(async {
            let stream = call(
                "open work stream",
                timeout,
                shared.js.get_stream_no_info(subjects::work_stream(&shared.config.run)),
            )
            .await?;
            call("open work consumer", timeout, stream.get_consumer::<consumer::pull::Config>(subjects::WORK_CONSUMER))
                .await
        })?;
        Ok(NatsWorkSource { shared, consumer, held: HashMap::new(), next_token: 0, undecodable: 0 })
    }

    /// Actor side: the run's snapshot store (object store plus per-item index).
    pub fn snapshot_store(&self) -> Result<NatsSnapshotStore, TransportError> {
        let shared = self.shared.clone();
        let timeout = shared.config.request_timeout;
        let (objects, index) = shared.block_on(async {
            let objects_bucket = subjects::snapshot_bucket(&shared.config.run);
            let index_bucket = subjects::snapshot_index_bucket(&shared.config.run);
            let objects = open_objects(&shared.js, &objects_bucket, timeout).await?.ok_or_else(|| {
                failed("open snapshot store", format!("object store {objects_bucket} does not exist"))
            })?;
            let index = open_kv(&shared.js, &index_bucket, timeout)
                .await?
                .ok_or_else(|| failed("open snapshot index", format!("kv bucket {index_bucket} does not exist")))?;
            Ok::<_, TransportError>((objects, index))
        })?;
        Ok(NatsSnapshotStore { shared, objects, index })
    }
}

/// The learner's end of the work queue: publishes work items (JSON) with their id as
/// `Nats-Msg-Id`, so a retried publish is stored once.
pub struct NatsWorkQueue {
    shared: Arc<Shared>,
    stream: stream::Stream<()>,
}

impl fmt::Debug for NatsWorkQueue {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("NatsWorkQueue").field("run", &self.shared.config.run).finish()
    }
}

impl crate::work::WorkQueue for NatsWorkQueue {
    fn submit(&mut self, items: &[volley_core::work::WorkItem]) -> Result<(), TransportError> {
        let shared = &self.shared;
        let subject = subjects::work(&shared.config.run);
        let timeout = shared.config.request_timeout;
        shared.block_on(async {
            for item in items {
                let payload = Bytes::from(item.to_json());
                let msg_id = format!("item-{}", item.id);
                retry_for("publish work item", shared.config.retry_deadline, || {
                    let mut headers = async_nats::HeaderMap::new();
                    headers.insert("Nats-Msg-Id", msg_id.as_str());
                    let (subject, payload) = (subject.clone(), payload.clone());
                    async move {
                        let published_at = Instant::now();
                        let ack = call(
                            "publish work item",
                            timeout,
                            shared.js.publish_with_headers(subject, headers, payload),
                        )
                        .await?;
                        // A denied publish is never acked; the server's violation can arrive
                        // before the confirmation is awaited, so look for it since the publish.
                        // An ack the server lost in a restart never comes: retried at once on
                        // the reconnect, not after the request timeout.
                        let confirm = call("confirm work item", timeout, ack.into_future());
                        unless_reconnected(&shared.connections, "confirm work item", confirm).await.map(|_| ()).map_err(
                            |err| match denial_since(published_at) {
                                Some(violation) if !is_denied(&err) => denied("confirm work item", &violation),
                                _ => err,
                            },
                        )
                    }
                })
                .await?;
            }
            Ok(())
        })
    }

    fn queued(&mut self) -> Result<u64, TransportError> {
        let shared = self.shared.clone();
        let timeout = shared.config.request_timeout;
        shared.block_on(async {
            let info = call("read work queue", timeout, self.stream.consumer_info(subjects::WORK_CONSUMER)).await?;
            Ok(info.num_pending)
        })
    }
}

/// An actor's end of the work queue: one item at a time per environment slot, kept alive with
/// progress signals while it runs, double-acked when done. An item whose actor dies is
/// redelivered by the server after the consumer's `ack_wait`.
pub struct NatsWorkSource {
    shared: Arc<Shared>,
    consumer: consumer::PullConsumer,
    held: HashMap<u64, jetstream::Message>,
    next_token: u64,
    undecodable: u64,
}

impl fmt::Debug for NatsWorkSource {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("NatsWorkSource").field("held", &self.held.len()).finish()
    }
}

impl NatsWorkSource {
    /// Work messages that did not decode (terminated so they are not redelivered).
    pub fn undecodable(&self) -> u64 {
        self.undecodable
    }
}

impl crate::work::WorkSource for NatsWorkSource {
    fn take(
        &mut self,
        timeout: Duration,
    ) -> Result<Option<(volley_core::work::WorkItem, crate::work::WorkToken)>, TransportError> {
        let shared = self.shared.clone();
        let request_timeout = shared.config.request_timeout;
        loop {
            let mut messages = Vec::with_capacity(1);
            shared.block_on(fetch_into(&self.consumer, 1, timeout, request_timeout, &mut messages))?;
            let Some(message) = messages.pop() else { return Ok(None) };
            match volley_core::work::WorkItem::from_json(&message.payload) {
                Ok(item) => {
                    let token = self.next_token;
                    self.next_token += 1;
                    self.held.insert(token, message);
                    return Ok(Some((item, crate::work::WorkToken(token))));
                }
                Err(err) => {
                    self.undecodable += 1;
                    warn!(error = %err, "work item dropped");
                    if let Err(err) = shared.block_on(message.ack_with(AckKind::Term)) {
                        debug!(error = %err, "could not terminate an undecodable work item");
                    }
                }
            }
        }
    }

    fn progress(&mut self, token: crate::work::WorkToken) -> Result<(), TransportError> {
        let Some(message) = self.held.get(&token.0) else { return Ok(()) };
        self.shared.block_on(message.ack_with(AckKind::Progress)).map_err(|err| failed("work progress", err))
    }

    fn complete(&mut self, token: crate::work::WorkToken) -> Result<(), TransportError> {
        let Some(message) = self.held.remove(&token.0) else { return Ok(()) };
        let shared = self.shared.clone();
        let timeout = shared.config.request_timeout;
        shared.block_on(retry_for("complete work item", shared.config.retry_deadline, || {
            call("complete work item", timeout, message.double_ack())
        }))
    }
}

/// Episode snapshots in the run's object store, with a KV index of each work item's newest
/// snapshot; both expire after the run's `snapshot_ttl_secs`.
pub struct NatsSnapshotStore {
    shared: Arc<Shared>,
    objects: object_store::ObjectStore,
    index: kv::Store,
}

impl fmt::Debug for NatsSnapshotStore {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("NatsSnapshotStore").field("run", &self.shared.config.run).finish()
    }
}

impl crate::work::SnapshotStore for NatsSnapshotStore {
    fn save(&mut self, snapshot: &volley_core::work::EpisodeSnapshot) -> Result<String, TransportError> {
        let key = snapshot.key();
        let bytes = snapshot.encode();
        let shared = &self.shared;
        let config = &shared.config;
        let transfer = config.transfer_deadline(bytes.len());
        let (objects, index) = (&self.objects, &self.index);
        let index_key = subjects::snapshot_index_key(snapshot.work_item);
        shared.block_on(async {
            retry_for("put snapshot", config.retry_deadline, || {
                let mut reader = bytes.as_slice();
                let name = key.as_str();
                async move { call("put snapshot", transfer, objects.put(name, &mut reader)).await.map(|_| ()) }
            })
            .await?;
            retry_for("index snapshot", config.retry_deadline, || {
                call("index snapshot", config.request_timeout, index.put(&index_key, Bytes::from(key.clone())))
            })
            .await
        })?;
        Ok(key)
    }

    fn latest_for_item(&mut self, work_item: u64) -> Result<Option<String>, TransportError> {
        let shared = &self.shared;
        let timeout = shared.config.request_timeout;
        let value = shared.block_on(call(
            "read snapshot index",
            timeout,
            self.index.get(subjects::snapshot_index_key(work_item)),
        ))?;
        Ok(value.map(|bytes| String::from_utf8_lossy(&bytes).into_owned()))
    }

    fn load(&mut self, key: &str) -> Result<Option<volley_core::work::EpisodeSnapshot>, TransportError> {
        let shared = &self.shared;
        let deadline = shared.config.transfer_deadline(volley_core::work::MAX_EPISODE_SNAPSHOT_BYTES);
        let bucket = subjects::snapshot_bucket(&shared.config.run);
        // A message get per chunk, no consumer: the actor user may create none on the store
        // it writes (`consumers::read_object_by_gets`); an oversized snapshot is refused by
        // its decoder.
        let read = consumers::read_object_by_gets(
            &shared.js,
            &shared.client,
            &self.objects,
            &bucket,
            key,
            volley_core::work::MAX_EPISODE_SNAPSHOT_BYTES,
        );
        let bytes = shared.block_on(call("get snapshot", deadline, read))?;
        bytes
            .map(|bytes| {
                volley_core::work::EpisodeSnapshot::decode(&bytes)
                    .map_err(|err| TransportError::Failed { operation: "decode snapshot", message: err.to_string() })
            })
            .transpose()
    }
}
