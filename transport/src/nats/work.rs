//! Save-load and budget assignment over JetStream: the work queue, the actors' work source
//! and the snapshot store.

use std::fmt;
use std::future::IntoFuture;
use std::sync::Arc;
use std::time::{Duration, Instant};

use async_nats::jetstream::{consumer, kv, object_store, stream};
use bytes::Bytes;
use tracing::{debug, warn};
use volley_core::ids::ActorId;
use volley_core::subjects;

use super::run::{open_kv, open_objects};
use super::{call, denial_since, denied, failed, gets, is_denied, retry_for, unless_reconnected, NatsBus, Shared};
use crate::TransportError;

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
    for written_by_actors in [subjects::object_backing_stream(&snapshots), subjects::kv_backing_stream(&index)] {
        refuse_direct_gets(shared, &written_by_actors).await?;
    }
    Ok(())
}

/// Turn direct gets off on `stream`, one that actors write (the snapshot store and its index).
///
/// Issue 46: the answer to a direct get is the stored message itself, published on whatever
/// reply subject the request names, and nats-server checks no request's reply subject against
/// the requester's permissions; so an actor that may direct-get a message it wrote can have the
/// server publish its own bytes on any subject of the account, among them subjects a stream
/// captures (another actor's trajectory subject, the run bucket's keys). A message get
/// (`$JS.API.STREAM.MSG.GET`) answers with a JSON document instead, which nothing reading the
/// run takes for its own messages; async-nats reads a store with message gets when its stream
/// does not allow direct gets, and the actor user is granted those only.
async fn refuse_direct_gets(shared: &Shared, stream: &str) -> Result<(), TransportError> {
    let timeout = shared.config.request_timeout;
    let mut handle = call("look up snapshot stream", timeout, shared.js.get_stream(stream)).await?;
    let info = call("look up snapshot stream", timeout, handle.info()).await?;
    if !info.config.allow_direct {
        return Ok(());
    }
    let config = stream::Config { allow_direct: false, ..info.config.clone() };
    call("turn off direct gets", timeout, shared.js.update_stream(config)).await?;
    Ok(())
}

impl NatsBus {
    /// Learner side: where the scheduler queues work items (the run must exist with
    /// `work.enabled`; see [`NatsBus::ensure_run`]), with the work dispatcher that leases them
    /// to actors under `work`'s limits (`transport/src/nats/dispatch.rs`); the dispatcher runs on a thread
    /// and a connection of its own until the queue is dropped.
    pub fn work_queue(&self, work: &volley_core::work::WorkConfig) -> Result<NatsWorkQueue, TransportError> {
        let shared = self.shared.clone();
        let timeout = shared.config.request_timeout;
        let stream = shared.block_on(call(
            "open work stream",
            timeout,
            shared.js.get_stream_no_info(subjects::work_stream(&shared.config.run)),
        ))?;
        let (dispatcher, lease_counts) = super::dispatch::start(&shared.config, work)?;
        Ok(NatsWorkQueue { shared, stream, dispatcher, lease_counts, confirmations_dropped: 0 })
    }

    /// Actor side: lease work items from the learner's work dispatcher as `actor`.
    pub fn work_source(&self, actor: &ActorId) -> Result<NatsWorkSource, TransportError> {
        Ok(NatsWorkSource { shared: self.shared.clone(), actor: actor.clone(), refused: 0, undecodable: 0 })
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
    /// The dispatcher stops when this is dropped.
    dispatcher: tokio::sync::mpsc::Sender<super::dispatch::Confirmation>,
    /// What the dispatcher has done, as its thread counts it.
    lease_counts: Arc<super::dispatch::SharedLeaseCounts>,
    confirmations_dropped: u64,
}

impl NatsWorkQueue {
    /// Confirmations dropped because the dispatcher fell behind (their items run again).
    pub fn confirmations_dropped(&self) -> u64 {
        self.confirmations_dropped
    }
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
                        let publish_and_confirm = async {
                            let ack = call(
                                "publish work item",
                                timeout,
                                shared.js.publish_with_headers(subject, headers, payload),
                            )
                            .await?;
                            call("confirm work item", timeout, ack.into_future()).await
                        };
                        // A denied publish is never acked; the server's violation can arrive
                        // before the confirmation is awaited, so look for it since the publish.
                        // An ack the server lost in a restart never comes: retried at once on
                        // the reconnect, not after the request timeout. The connection is
                        // noted before the publish, not after it returns: the client may send
                        // the item, and the server die, before the publish call returns, and
                        // a reconnect noted as the connection the item went out on left its
                        // confirmation to wait out the whole request timeout.
                        unless_reconnected(&shared.connections, "confirm work item", publish_and_confirm)
                            .await
                            .map(|_| ())
                            .map_err(|err| match denial_since(published_at) {
                                Some(violation) if !is_denied(&err) => denied("confirm work item", &violation),
                                _ => err,
                            })
                    }
                })
                .await?;
            }
            Ok(())
        })
    }

    fn confirm(&mut self, item: u64, actor: &ActorId) {
        let confirmation = super::dispatch::Confirmation { item, actor: actor.as_str().to_ascii_lowercase() };
        if self.dispatcher.try_send(confirmation).is_err() {
            self.confirmations_dropped += 1;
        }
    }

    fn leases(&self) -> Option<crate::work::LeaseCounts> {
        Some(self.lease_counts.get())
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

/// An actor's end of the work queue: leases items from the learner's work dispatcher
/// (`transport/src/nats/dispatch.rs`) with a request on `volley.<run>.work.take.<actor>`, keeps them alive
/// with progress signals while it runs them, and reports them done. An item whose actor goes
/// quiet is handed to another actor after `work.ack_wait_secs`.
pub struct NatsWorkSource {
    shared: Arc<Shared>,
    actor: ActorId,
    refused: u64,
    undecodable: u64,
}

impl fmt::Debug for NatsWorkSource {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("NatsWorkSource").field("actor", &self.actor).finish()
    }
}

impl NatsWorkSource {
    /// Work items that did not decode (the lease lapses and the dispatcher drops nothing: the
    /// item goes to another actor).
    pub fn undecodable(&self) -> u64 {
        self.undecodable
    }

    /// Takes the dispatcher refused because this actor held its limit of items.
    pub fn refused(&self) -> u64 {
        self.refused
    }

    fn signal(&mut self, verb: &'static str, token: crate::work::WorkToken) -> Result<(), TransportError> {
        let shared = &self.shared;
        let subject = subjects::work_lease(&shared.config.run, verb, &self.actor);
        let payload = Bytes::from(token.0.to_string());
        shared
            .block_on(shared.client.publish(subject, payload))
            .map_err(|err| failed(if verb == "done" { "complete work item" } else { "work progress" }, err))
    }
}

impl crate::work::WorkSource for NatsWorkSource {
    fn take(
        &mut self,
        timeout: Duration,
    ) -> Result<Option<(volley_core::work::WorkItem, crate::work::WorkToken)>, TransportError> {
        let shared = self.shared.clone();
        let subject = subjects::work_lease(&shared.config.run, "take", &self.actor);
        // The dispatcher answers at once (an item, nothing, or a refusal); `timeout` is how long
        // an empty queue may be waited on, which a lease request does not do.
        let bound = shared.config.request_timeout.max(timeout);
        let request = shared.client.request(subject, Bytes::new());
        let reply = match shared.block_on(async { tokio::time::timeout(bound, request).await }) {
            Ok(Ok(reply)) => reply,
            // No dispatcher (the learner is not running): nothing to take.
            Ok(Err(err)) if err.kind() == async_nats::RequestErrorKind::NoResponders => return Ok(None),
            Ok(Err(err)) => return Err(failed("take work item", err)),
            Err(_) => return Err(failed("take work item", format!("no answer within {bound:?}"))),
        };
        let header = |name: &str| {
            reply.headers.as_ref().and_then(|headers| headers.get(name)).map(|value| value.as_str().to_string())
        };
        if let Some(reason) = header(super::dispatch::REFUSED_HEADER) {
            self.refused += 1;
            debug!(actor = %self.actor, %reason, "work take refused");
            return Ok(None);
        }
        let Some(lease) = header(super::dispatch::LEASE_HEADER).and_then(|lease| lease.parse::<u64>().ok()) else {
            return Ok(None);
        };
        match volley_core::work::WorkItem::from_json(&reply.payload) {
            Ok(item) => Ok(Some((item, crate::work::WorkToken(lease)))),
            Err(err) => {
                self.undecodable += 1;
                warn!(actor = %self.actor, error = %err, "work item dropped");
                Ok(None)
            }
        }
    }

    fn progress(&mut self, token: crate::work::WorkToken) -> Result<(), TransportError> {
        self.signal("progress", token)
    }

    fn complete(&mut self, token: crate::work::WorkToken) -> Result<(), TransportError> {
        self.signal("done", token)
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
        // it writes (`gets::read_object_by_gets`); an oversized snapshot is refused by
        // its decoder.
        let read = gets::read_object_by_gets(
            &shared.js,
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
