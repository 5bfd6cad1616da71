//! Weights: the publisher (object store + KV pointer) and the follower (KV watch, verified
//! fetches, backoff on unverifiable pointers).

use super::*;

impl NatsBus {
    /// Learner side: publishes weights to the object store and the `weights` pointer to KV.
    /// Needs the run's buckets ([`NatsBus::ensure_run`]).
    pub fn weights_publisher(&self) -> Result<NatsWeightsPublisher, TransportError> {
        let shared = self.shared.clone();
        let timeout = shared.config.request_timeout;
        let (kv, objects, backing, pointer, mut kept) = shared.block_on(async {
            let run = &shared.config.run;
            let missing = |what: &str| {
                failed("open weights publisher", format!("{what} of run {run} is missing; call ensure_run first"))
            };
            let kv =
                open_kv(&shared.js, &subjects::run_bucket(run), timeout).await?.ok_or_else(|| missing("kv bucket"))?;
            let objects = open_objects(&shared.js, &subjects::weights_bucket(run), timeout)
                .await?
                .ok_or_else(|| missing("weights store"))?;
            let pointer = read_pointer(&kv, timeout).await?;
            let (kept, deleted) = list_weight_objects(&objects, timeout).await?;
            let bucket = subjects::weights_bucket(run);
            let backing = call(
                "open weights store stream",
                timeout,
                shared.js.get_stream_no_info(subjects::object_backing_stream(&bucket)),
            )
            .await?;
            // Markers left by an earlier learner (or a failed purge).
            for object in &deleted {
                purge_weights_marker(&backing, &bucket, object, timeout).await;
            }
            Ok::<_, TransportError>((kv, objects, backing, pointer, kept))
        })?;
        kept.sort();
        if let Some(pointer) = &pointer {
            info!(run = %shared.config.run, version = pointer.version.0, "weights already published in this run");
        }
        Ok(NatsWeightsPublisher {
            kv,
            objects,
            backing,
            published_before: pointer.map(|p| p.version),
            last_version: None,
            kept: kept.into(),
            shared,
        })
    }

    /// Actor side: follows the `weights` pointer (a background watch) and fetches and verifies
    /// new versions on demand. The run's bucket need not exist yet.
    pub fn weights_follower(&self, layout_hash: u64, n_params: usize) -> Result<NatsWeightsFollower, TransportError> {
        let shared = self.shared.clone();
        let slot = Arc::new(PointerSlot::default());
        let mut connections = shared.connections.clone();
        connections.borrow_and_update();
        let task = shared.handle.spawn(follow_pointer(
            shared.js.clone(),
            shared.client.clone(),
            subjects::run_bucket(&shared.config.run),
            shared.config.request_timeout,
            slot.clone(),
            connections,
        ));
        Ok(NatsWeightsFollower {
            shared,
            layout_hash,
            n_params,
            slot,
            objects: None,
            newest: None,
            settled_write: 0,
            retry: None,
            refusals: 0,
            task,
        })
    }
}

/// The KV value under `weights`: where the newest weights are and what to expect of them.
/// JSON, so operators can read it; hashes as hex strings so no JSON reader rounds them.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
struct WeightsPointer {
    version: PolicyVersion,
    object: String,
    checksum: String,
    layout_hash: String,
    size_bytes: u64,
}

impl WeightsPointer {
    fn new(weights: &Weights, object: String, size_bytes: usize) -> Self {
        WeightsPointer {
            version: weights.version,
            object,
            checksum: format!("{:016x}", weights.checksum),
            layout_hash: format!("{:016x}", weights.layout_hash),
            size_bytes: size_bytes as u64,
        }
    }
}

async fn read_pointer(kv: &kv::Store, timeout: Duration) -> Result<Option<WeightsPointer>, TransportError> {
    let Some(bytes) = call("read weights pointer", timeout, kv.get(subjects::WEIGHTS_KEY)).await? else {
        return Ok(None);
    };
    serde_json::from_slice(&bytes).map(Some).map_err(|err| failed("decode weights pointer", err))
}

/// Names of the weights objects in the store (ours only: `v` + 20 digits): the live ones, and
/// the deleted ones whose delete marker is still stored.
async fn list_weight_objects(
    objects: &object_store::ObjectStore,
    timeout: Duration,
) -> Result<(Vec<String>, Vec<String>), TransportError> {
    timed("list weights objects", timeout, async {
        let mut list = objects.list().await.map_err(|err| failed("list weights objects", err))?;
        let (mut live, mut deleted) = (Vec::new(), Vec::new());
        while let Some(info) = list.next().await {
            let info = info.map_err(|err| failed("list weights objects", err))?;
            let ours = info.name.len() == 21
                && info.name.starts_with('v')
                && info.name[1..].bytes().all(|b| b.is_ascii_digit());
            match (ours, info.deleted) {
                (true, false) => live.push(info.name),
                (true, true) => deleted.push(info.name),
                (false, _) => {}
            }
        }
        Ok((live, deleted))
    })
    .await?
}

/// Purge the delete marker of weights object `object`: `ObjectStore::delete` purges the chunks
/// but leaves one metadata message per deleted name, and every version has its own name, so
/// without this the store grows by one marker per publish (issue 11: 35k markers, 201 MB in a
/// 7-minute soak). Best effort: a marker left behind is purged by the next learner's start.
async fn purge_weights_marker(backing: &stream::Stream<()>, bucket: &str, object: &str, timeout: Duration) {
    let subject = subjects::object_meta_subject(bucket, object);
    if let Err(err) = call("purge weights marker", timeout, backing.purge().filter(subject).into_future()).await {
        debug!(object, %err, "weights delete marker not purged");
    }
}

/// Learner side: publishes each version as an object, then points KV key `weights` at it.
///
/// Versions must increase (a version not newer than this publisher's last is refused, like the
/// in-process publisher). A publish retries through a broker outage for
/// [`NatsConfig::retry_deadline`]. Objects beyond the newest
/// [`NatsConfig::keep_weight_versions`] are deleted. If the run already had a newer version
/// (a learner restarted from an older checkpoint), followers ignore the new versions until
/// they pass it; this is logged.
pub struct NatsWeightsPublisher {
    shared: Arc<Shared>,
    kv: kv::Store,
    objects: object_store::ObjectStore,
    /// The stream behind `objects`, for purging delete markers.
    backing: stream::Stream<()>,
    /// Newest version in KV when this publisher started.
    published_before: Option<PolicyVersion>,
    last_version: Option<u64>,
    /// Our objects, oldest first.
    kept: VecDeque<String>,
}

impl fmt::Debug for NatsWeightsPublisher {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("NatsWeightsPublisher")
            .field("last_version", &self.last_version)
            .field("kept", &self.kept)
            .finish()
    }
}

impl NatsWeightsPublisher {
    /// The newest version this run had published when the publisher opened (read from the KV
    /// pointer, no waiting): a restarted learner continues above it.
    pub fn published_before(&self) -> Option<PolicyVersion> {
        self.published_before
    }
}

impl WeightsPublisher for NatsWeightsPublisher {
    fn publish(&mut self, weights: Arc<Weights>) -> Result<(), TransportError> {
        let version = weights.version.0;
        if let Some(last) = self.last_version {
            if version <= last {
                return Err(failed("weights publish", format!("version {version} is not newer than v{last}")));
            }
        }
        if self.last_version.is_none() {
            if let Some(before) = self.published_before.filter(|before| before.0 >= version).map(|before| before.0) {
                warn!(
                    version,
                    newest_in_run = before,
                    "the run's pointer claims a newer version; followers that verified it ignore versions up to it"
                );
            }
        }
        let shared = self.shared.clone();
        let config = &shared.config;
        let bytes = wire::encode_weights(&weights);
        let object = subjects::weights_object(version);
        let pointer = WeightsPointer::new(&weights, object.clone(), bytes.len());
        let pointer_json =
            Bytes::from(serde_json::to_vec(&pointer).map_err(|err| failed("encode weights pointer", err))?);
        let transfer = config.transfer_deadline(bytes.len());
        let (objects, kv) = (&self.objects, &self.kv);
        shared.block_on(async {
            retry_for("put weights object", config.retry_deadline, || {
                let mut reader = bytes.as_slice();
                let object = object.as_str();
                async move { call("put weights object", transfer, objects.put(object, &mut reader)).await.map(|_| ()) }
            })
            .await?;
            retry_for("put weights pointer", config.retry_deadline, || {
                call("put weights pointer", config.request_timeout, kv.put(subjects::WEIGHTS_KEY, pointer_json.clone()))
            })
            .await?;
            Ok::<_, TransportError>(())
        })?;
        debug!(version, size_bytes = bytes.len(), "weights published");
        self.last_version = Some(version);
        if self.kept.back() != Some(&object) {
            self.kept.push_back(object);
        }
        let keep = config.keep_weight_versions.max(1);
        while self.kept.len() > keep {
            let Some(old) = self.kept.pop_front() else { break };
            // Best effort: a failed delete leaves an object behind, nothing worse.
            let bucket = subjects::weights_bucket(&config.run);
            shared.block_on(async {
                if call("delete old weights", config.request_timeout, self.objects.delete(&old)).await.is_ok() {
                    purge_weights_marker(&self.backing, &bucket, &old, config.request_timeout).await;
                }
            });
        }
        Ok(())
    }
}

/// The pointer most recently written to KV, as the watch delivered it.
///
/// Not the highest version ever announced: a forged pointer with a huge version must not
/// hide the real pointers written after it (issue 12, docs/SECURITY.md). Whether a pointer
/// is worth fetching is the follower's decision, against the newest version it verified.
#[derive(Debug, Default)]
struct PointerSlot {
    /// The pointer and its write number (1 = the first the watch delivered).
    pointer: Mutex<Option<(WeightsPointer, u64)>>,
    /// Writes seen (0 = none yet): lets `latest` answer "nothing new" with one load.
    writes: AtomicU64,
    changed: tokio::sync::Notify,
}

impl PointerSlot {
    fn offer(&self, pointer: WeightsPointer) {
        let mut slot = self.pointer.lock().expect("pointer lock is never poisoned");
        // A re-created watch delivers the current value again: not a new write.
        if slot.as_ref().is_some_and(|(current, _)| *current == pointer) {
            return;
        }
        debug!(version = pointer.version.0, "new weights pointer");
        let write = self.writes.load(Ordering::Acquire).saturating_add(1);
        *slot = Some((pointer, write));
        self.writes.store(write, Ordering::Release);
        self.changed.notify_waiters();
    }

    fn newest(&self) -> Option<(WeightsPointer, u64)> {
        self.pointer.lock().expect("pointer lock is never poisoned").clone()
    }
}

/// First pause before fetching an unfetchable pointer (missing object, timeout) again.
const FETCH_RETRY_FIRST: Duration = Duration::from_millis(250);
/// Longest pause between fetches of an unfetchable pointer.
const FETCH_RETRY_MAX: Duration = Duration::from_secs(30);

/// Keep `slot` at the newest `weights` pointer: open the bucket (waiting until it exists),
/// watch the key (the watch yields the current value first), and start over after an error,
/// the end of the watch, or a reconnect.
async fn follow_pointer(
    js: jetstream::Context,
    client: async_nats::Client,
    bucket: String,
    timeout: Duration,
    slot: Arc<PointerSlot>,
    mut connections: tokio::sync::watch::Receiver<u64>,
) {
    let mut backoff = Backoff::new();
    loop {
        connections.borrow_and_update();
        let watch = async {
            if open_kv(&js, &bucket, timeout).await?.is_none() {
                return Err(TransportError::Failed {
                    operation: "watch weights",
                    message: format!("bucket {bucket} does not exist yet"),
                });
            }
            // A named consumer filtered on the key, which the actor's permissions grant
            // (`consumers`), rather than async-nats' unnamed KV watch.
            call("watch weights", timeout, consumers::watch_key(&js, &client, &bucket, subjects::WEIGHTS_KEY)).await
        };
        let mut watch = match watch.await {
            Ok(watch) => watch,
            Err(err) => {
                debug!(operation = "watch weights", %err, "retrying");
                tokio::select! {
                    _ = tokio::time::sleep(backoff.next()) => {}
                    changed = connections.changed() => {
                        if changed.is_err() {
                            return;
                        }
                    }
                }
                continue;
            }
        };
        backoff = Backoff::new();
        loop {
            tokio::select! {
                entry = watch.next() => match entry {
                    Some(Ok(change)) if !change.deleted => {
                        match serde_json::from_slice::<WeightsPointer>(&change.value) {
                            Ok(pointer) => slot.offer(pointer),
                            Err(err) => warn!(operation = "decode weights pointer", error = %err, "ignoring bad weights pointer"),
                        }
                    }
                    Some(Ok(_)) => {}
                    Some(Err(err)) => {
                        warn!(operation = "watch weights", error = %err, "weights watch failed; re-creating it");
                        break;
                    }
                    None => {
                        warn!(operation = "watch weights", "weights watch ended; re-creating it");
                        break;
                    }
                },
                changed = connections.changed() => {
                    if changed.is_err() {
                        return;
                    }
                    info!("reconnected; re-creating the weights watch");
                    break;
                }
            }
        }
        tokio::time::sleep(backoff.next()).await;
    }
}

/// Actor side: follows the newest weights.
///
/// A background task watches the `weights` pointer (re-creating the watch after errors and
/// reconnects; a late joiner gets the current pointer at once). [`WeightsFollower::latest`]
/// costs one atomic load when nothing was written; otherwise it looks at the pointer written
/// last and, when its version is above the newest version this follower has *verified*,
/// fetches the object with a deadline and verifies layout, size, checksum and version.
///
/// Trust (docs/SECURITY.md): the pointer is a claim, the verified object the fact. Refused
/// weights are a [`TransportError::Failed`] naming the reason, reported once per pointer
/// write and counted ([`refusals`](Self::refusals)); the follower keeps its verified version,
/// and the next pointer written is judged afresh, whatever version the refused one claimed,
/// so a forged pointer never blocks a later valid one. A failed download (timeout, missing
/// object) is retried with exponential backoff (250 ms doubling to 30 s), each failure
/// reported once, so a missing object costs a few requests and warnings a minute.
pub struct NatsWeightsFollower {
    shared: Arc<Shared>,
    layout_hash: u64,
    n_params: usize,
    slot: Arc<PointerSlot>,
    objects: Option<object_store::ObjectStore>,
    /// The newest weights verified so far.
    newest: Option<Arc<Weights>>,
    /// The last pointer write dealt with for good (adopted, refused, or not newer).
    settled_write: u64,
    /// A pointer write whose fetch failed, and when to try it again.
    retry: Option<(u64, Instant, Duration)>,
    /// Pointers refused or not fetchable, in total.
    refusals: u64,
    task: tokio::task::JoinHandle<()>,
}

impl fmt::Debug for NatsWeightsFollower {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("NatsWeightsFollower")
            .field("layout_hash", &format_args!("{:016x}", self.layout_hash))
            .field("n_params", &self.n_params)
            .field("pointer_version", &self.announced_version())
            .field("verified_version", &self.newest.as_ref().map(|w| w.version))
            .field("refusals", &self.refusals)
            .finish()
    }
}

impl Drop for NatsWeightsFollower {
    fn drop(&mut self) {
        self.task.abort();
    }
}

impl NatsWeightsFollower {
    /// The version the pointer written last claims (fetched or not, verified or not).
    pub fn announced_version(&self) -> Option<PolicyVersion> {
        self.slot.newest().map(|(pointer, _)| pointer.version)
    }

    /// The newest version this follower fetched and verified.
    pub fn verified_version(&self) -> Option<PolicyVersion> {
        self.newest.as_ref().map(|w| w.version)
    }

    /// Pointers refused for their content or not fetchable, in total (each failure once).
    pub fn refusals(&self) -> u64 {
        self.refusals
    }

    /// The pause before the pointer written last is fetched again, when its fetch failed.
    pub fn retry_pause(&self) -> Option<Duration> {
        self.retry.map(|(_, _, pause)| pause)
    }

    /// Refuse `pointer` for its content (see the type's docs).
    #[cold]
    fn refuse(&mut self, pointer: &WeightsPointer, reason: String) -> TransportError {
        warn!(version = pointer.version.0, object = %pointer.object, %reason, "weights pointer refused");
        failed("weights fetch", reason)
    }

    fn fetch(&mut self, pointer: &WeightsPointer) -> Result<Arc<Weights>, FetchError> {
        const OPERATION: &str = "weights fetch";
        let expected_layout = format!("{:016x}", self.layout_hash);
        if pointer.layout_hash != expected_layout {
            return Err(FetchError::Refused(self.refuse(
                pointer,
                format!(
                    "weights {} refused: layout hash {} does not match this actor's {expected_layout}",
                    pointer.object, pointer.layout_hash
                ),
            )));
        }
        // The pointer's size is a claim: never reserve more than a message may hold.
        if pointer.size_bytes as usize > wire::MAX_MESSAGE_BYTES {
            return Err(FetchError::Refused(self.refuse(
                pointer,
                format!(
                    "weights {} refused: claimed size {} bytes exceeds the limit",
                    pointer.object, pointer.size_bytes
                ),
            )));
        }
        let shared = self.shared.clone();
        let config = &shared.config;
        let bucket = subjects::weights_bucket(&config.run);
        let deadline = config.transfer_deadline(pointer.size_bytes as usize);
        let objects = &mut self.objects;
        let bytes = shared.block_on(async {
            if objects.is_none() {
                *objects = open_objects(&shared.js, &bucket, config.request_timeout).await?;
            }
            let Some(store) = objects.as_ref() else {
                return Err(failed(OPERATION, format!("object store {bucket} does not exist")));
            };
            // At most one byte past the limit is read: an oversized object is refused below.
            let read = consumers::read_object(
                &shared.js,
                &shared.client,
                store,
                &bucket,
                &pointer.object,
                wire::MAX_MESSAGE_BYTES,
            );
            call(OPERATION, deadline, read)
                .await?
                .ok_or_else(|| failed(OPERATION, format!("weights object {} does not exist", pointer.object)))
        });
        let bytes = match bytes {
            Ok(bytes) => bytes,
            Err(err) => {
                warn!(version = pointer.version.0, object = %pointer.object, %err, "weights object not fetchable; retrying with backoff");
                return Err(FetchError::Unavailable(err));
            }
        };
        let weights = match wire::decode_weights(&bytes, self.layout_hash, self.n_params) {
            Ok(weights) => weights,
            Err(err) => {
                let reason = format!("weights {} refused ({}): {err}", pointer.object, err.reason());
                return Err(FetchError::Refused(self.refuse(pointer, reason)));
            }
        };
        let checksum = format!("{:016x}", weights.checksum);
        if weights.version != pointer.version || checksum != pointer.checksum {
            return Err(FetchError::Refused(self.refuse(
                pointer,
                format!(
                    "weights {} refused: object holds {} with checksum {checksum}, pointer says v{} with checksum {}",
                    pointer.object, weights.version, pointer.version.0, pointer.checksum
                ),
            )));
        }
        let weights = Arc::new(weights);
        self.newest = Some(weights.clone());
        Ok(weights)
    }
}

impl WeightsFollower for NatsWeightsFollower {
    fn latest(&mut self, have: Option<PolicyVersion>) -> Result<Option<Arc<Weights>>, TransportError> {
        let writes = self.slot.writes.load(Ordering::Acquire);
        if writes == self.settled_write {
            return Ok(self.newest.clone().filter(|newest| have.is_none_or(|have| newest.version > have)));
        }
        let Some((pointer, write)) = self.slot.newest() else {
            return Ok(None);
        };
        // Only a version above everything verified (and above what the caller runs) is worth
        // fetching; an older or equal claim is settled at once (versions never go back).
        let current = self.newest.as_ref().map(|w| w.version).max(have);
        if current.is_some_and(|current| pointer.version <= current) {
            self.settled_write = write;
            self.retry = None;
            return Ok(self.newest.clone().filter(|newest| have.is_none_or(|have| newest.version > have)));
        }
        if let Some((retry_write, at, _)) = self.retry {
            if retry_write == write && Instant::now() < at {
                return Ok(None);
            }
        }
        match self.fetch(&pointer) {
            Ok(weights) => {
                self.settled_write = write;
                self.retry = None;
                Ok(Some(weights))
            }
            Err(FetchError::Refused(err)) => {
                self.settled_write = write;
                self.retry = None;
                self.refusals += 1;
                Err(err)
            }
            Err(FetchError::Unavailable(err)) => {
                let pause = match self.retry {
                    Some((retry_write, _, pause)) if retry_write == write => (pause * 2).min(FETCH_RETRY_MAX),
                    _ => FETCH_RETRY_FIRST,
                };
                self.retry = Some((write, Instant::now() + pause, pause));
                self.refusals += 1;
                Err(err)
            }
        }
    }

    fn wait_first(&mut self, timeout: Duration) -> Result<Arc<Weights>, TransportError> {
        let slot = self.slot.clone();
        let started = Instant::now();
        loop {
            if let Some(weights) = self.latest(None)? {
                return Ok(weights);
            }
            let left = timeout.saturating_sub(started.elapsed());
            if left.is_zero() {
                return Err(TransportError::Timeout { operation: "first weights", after: timeout });
            }
            // Wait for a new pointer write, or until a failed fetch may be retried.
            let settled = self.settled_write;
            let wake = self.retry.map_or(left, |(_, at, _)| at.saturating_duration_since(Instant::now()).min(left));
            self.shared.block_on(async {
                let written = async {
                    loop {
                        let notified = slot.changed.notified();
                        if slot.writes.load(Ordering::Acquire) != settled {
                            return;
                        }
                        notified.await;
                    }
                };
                let _ = tokio::time::timeout(wake, written).await;
            });
        }
    }
}

/// Why a fetch gave no weights: the content is wrong (final for this pointer write), or the
/// object could not be read (tried again later).
enum FetchError {
    Refused(TransportError),
    Unavailable(TransportError),
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pointer_slot_keeps_the_last_write_whatever_its_version() {
        let slot = PointerSlot::default();
        let pointer = |version| WeightsPointer {
            version: PolicyVersion(version),
            object: subjects::weights_object(version),
            checksum: "0".into(),
            layout_hash: "0".into(),
            size_bytes: 0,
        };
        slot.offer(pointer(3));
        // Issue 12: a forged pointer with a huge version must not hide later real ones.
        slot.offer(pointer(u64::MAX));
        slot.offer(pointer(2));
        assert_eq!(slot.newest().map(|(p, write)| (p.version.0, write)), Some((2, 3)));
        slot.offer(pointer(2));
        assert_eq!(slot.writes.load(Ordering::Acquire), 3, "a re-delivered value is not a new write");
        slot.offer(pointer(4));
        assert_eq!(slot.newest().map(|(p, _)| p.version.0), Some(4));
    }

    #[test]
    fn weights_pointer_is_readable_json() {
        let weights = Weights::new(PolicyVersion(7), 0xdead_beef, vec![1.0, 2.0]);
        let pointer = WeightsPointer::new(&weights, subjects::weights_object(7), 123);
        let json = serde_json::to_string(&pointer).expect("serializable");
        assert!(json.contains("\"version\":7"), "{json}");
        assert!(json.contains("\"layout_hash\":\"00000000deadbeef\""), "{json}");
        assert_eq!(serde_json::from_str::<WeightsPointer>(&json).expect("roundtrip"), pointer);
    }
}
