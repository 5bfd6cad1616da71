//! Weights: the publisher (live core-NATS fan-out, then object store + KV pointer) and the
//! follower (live reassembly, KV watch, verified fetches, backoff on unverifiable pointers).
//! The live path gets a version to connected followers first; the durable path (store and
//! pointer) serves everyone else and stays the source of truth (docs/ARCHITECTURE.md).

use base64::Engine as _;

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
            info!(run = %shared.config.run, version = pointer.version, "weights already published in this run");
        }
        Ok(NatsWeightsPublisher {
            kv,
            objects,
            backing,
            published_before: pointer.map(|pointer| PolicyVersion(pointer.newest_possible())),
            last_version: None,
            parent: None,
            anchor: 0,
            deltas: Vec::new(),
            // An earlier learner's objects: one old chain, deleted once enough new ones exist.
            kept: if kept.is_empty() { VecDeque::new() } else { VecDeque::from([kept]) },
            last_frame_bytes: 0,
            pointer_written: None,
            deferred: None,
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
        let live = if shared.config.weights_live { open_live(&shared, layout_hash, n_params) } else { None };
        Ok(NatsWeightsFollower {
            shared,
            layout_hash,
            n_params,
            slot,
            objects: None,
            newest: None,
            confirmed: None,
            settled_write: 0,
            settled_live: 0,
            retry: None,
            refusals: 0,
            durable_fetches: 0,
            live_applied: 0,
            live_refused: 0,
            contradicted: false,
            live,
            task,
        })
    }
}

/// Subscribe to the run's live weights subject and start reassembling its chunks in the
/// background; `None` (logged) when the subscription fails, e.g. a broker whose permissions
/// predate the live path: the follower then uses the pointer alone.
fn open_live(shared: &Arc<Shared>, layout_hash: u64, n_params: usize) -> Option<LiveFeed> {
    let subject = subjects::weights_live(&shared.config.run);
    let client = shared.client.clone();
    let timeout = shared.config.request_timeout;
    let bucket = subjects::run_bucket(&shared.config.run);
    let subscribed = shared.block_on(call("subscribe to live weights", timeout, async {
        let subscriber = client.subscribe(subject).await.map_err(|err| err.to_string())?;
        // `flush` only writes the subscription out; an answered request (any answer, the
        // bucket need not exist yet) shows the server has processed it, so no version
        // published after `weights_follower` returns is missed for want of it.
        client.flush().await.map_err(|err| err.to_string())?;
        let _ = open_kv(&shared.js, &bucket, timeout).await;
        Ok::<_, String>(subscriber)
    }));
    let subscriber = match subscribed {
        Ok(subscriber) => subscriber,
        Err(err) => {
            warn!(%err, "live weights unavailable; following the pointer only, which may trail small weights by up to the learner's pointer interval");
            return None;
        }
    };
    let slot = Arc::new(LiveSlot::default());
    let max_frame = full_frame_bytes(n_params);
    let assembler = wire::live::LiveAssembler::new(layout_hash, max_frame);
    let task = shared.handle.spawn(follow_live(subscriber, assembler, slot.clone()));
    Some(LiveFeed { slot, task })
}

/// Completed live frames waiting for the follower, and what the reassembly refused.
#[derive(Debug, Default)]
struct LiveSlot {
    /// Completed frames, oldest first, at most [`LIVE_FRAMES_KEPT`].
    frames: Mutex<VecDeque<wire::live::LiveFrame>>,
    /// Frames completed so far: lets `latest` answer "nothing new" with one load.
    completed: AtomicU64,
    /// Chunks refused (unreadable, corrupt, another layout, too large, inconsistent).
    refused_chunks: AtomicU64,
    changed: tokio::sync::Notify,
    /// A decoded frame's bytes, handed back to the reassembly task for the next version.
    spare: Mutex<Option<Vec<u8>>>,
}

/// Completed live frames kept for the follower: the newest two, so a follower that polls
/// less often than versions arrive can still apply a version and then its child delta.
const LIVE_FRAMES_KEPT: usize = 2;

/// The background half of the live path: its slot and reassembly task.
#[derive(Debug)]
struct LiveFeed {
    slot: Arc<LiveSlot>,
    task: tokio::task::JoinHandle<()>,
}

/// Reassemble live chunks into frames until the subscription ends (async-nats re-subscribes
/// by itself after a reconnect).
async fn follow_live(
    mut subscriber: async_nats::Subscriber,
    mut assembler: wire::live::LiveAssembler,
    slot: Arc<LiveSlot>,
) {
    use wire::live::Offered;
    while let Some(message) = subscriber.next().await {
        if let Some(bytes) = slot.spare.lock().expect("live lock is never poisoned").take() {
            assembler.recycle(bytes);
        }
        match assembler.offer(&message.payload) {
            Offered::Complete(frame) => {
                let mut frames = slot.frames.lock().expect("live lock is never poisoned");
                if frames.len() >= LIVE_FRAMES_KEPT {
                    frames.pop_front();
                }
                frames.push_back(frame);
                drop(frames);
                slot.completed.fetch_add(1, Ordering::AcqRel);
                slot.changed.notify_waiters();
            }
            Offered::Refused(err) => {
                slot.refused_chunks.fetch_add(1, Ordering::Relaxed);
                debug!(reason = err.reason(), %err, "live weights chunk refused");
            }
            Offered::Pending | Offered::Stale => {}
        }
    }
}

/// The KV value under `weights`: what the newest version is and how to rebuild it.
///
/// JSON, so operators can read it; hashes as hex strings so no JSON reader rounds them.
/// Versions form chains: an *anchor* (a full frame, object `v<version>`) and then deltas
/// (object `d<version>`, each against the version before it in the chain). `deltas` lists the
/// chain's delta versions after `anchor`, ascending, the last being `version`; empty when
/// `version` is itself an anchor. A follower holding a version of the chain fetches only the
/// deltas after it; any other follower fetches the anchor and the whole chain. Small weights
/// travel `inline` instead: the full frame, base64, and no object at all.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
struct WeightsPointer {
    version: u64,
    /// The version the newest delta applies to (`None` for an anchor).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    parent: Option<u64>,
    anchor: u64,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    deltas: Vec<u64>,
    /// [`wire::checksum`] of the parameters of `version` (XXH3-64), hex.
    digest: String,
    layout_hash: String,
    /// Bytes of this version's frame.
    size_bytes: u64,
    /// The full frame of `version`, base64 (small weights only).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    inline: Option<String>,
    /// The publisher writes the pointer at least every this many versions; the versions in
    /// between travel by the live path only ([`NatsConfig::weights_pointer_every`]). Followers
    /// take a live version at most this many plus one versions above the pointer
    /// ([`live_lead`]). Absent (1) from publishers that write every version.
    #[serde(default = "one", skip_serializing_if = "is_one")]
    pointer_every: u64,
}

fn one() -> u64 {
    1
}

fn is_one(n: &u64) -> bool {
    *n == 1
}

/// Largest pointer interval a follower honours ([`NatsConfig::weights_pointer_every`] is
/// checked against it; a pointer claiming more is taken as claiming this).
pub const MAX_POINTER_EVERY: u64 = 64;

/// How far a live version may run ahead of the pointer written last, for a pointer written at
/// least every `pointer_every` versions: up to `pointer_every - 1` versions travel live
/// between two pointers, the next version's pointer is written after that version is sent
/// live, and one more leaves room for a watch that lags. A live version further ahead waits
/// (at most [`LIVE_FRAMES_KEPT`] of them) until the pointer catches up, so a forged live
/// version cannot claim a version far above the learner's and make the follower ignore the
/// real ones.
fn live_lead(pointer_every: u64) -> u64 {
    pointer_interval(pointer_every) + 1
}

/// A pointer interval as honoured: at least 1, at most [`MAX_POINTER_EVERY`] (a configured
/// one, or what a pointer claims).
fn pointer_interval(pointer_every: u64) -> u64 {
    pointer_every.clamp(1, MAX_POINTER_EVERY)
}

/// Deadline of one attempt to put the weights pointer (see `NatsWeightsPublisher::publish`).
const POINTER_PUT_DEADLINE: Duration = Duration::from_millis(500);

/// Longest delta chain a pointer may list (a pointer listing more is refused): far above any
/// sensible anchor interval, and it bounds the fetches one pointer can cause.
const MAX_CHAIN: usize = 1024;

impl WeightsPointer {
    /// The newest version that may have been published when this pointer was the last one
    /// written: versions after it travel live only until the next pointer is due.
    fn newest_possible(&self) -> u64 {
        self.version.saturating_add(pointer_interval(self.pointer_every) - 1)
    }

    /// Check the chain arithmetic: `deltas` strictly ascending above `anchor`, ending at
    /// `version`, `parent` the entry before the last; an anchor has neither. Comparisons only,
    /// no arithmetic, so a forged `u64::MAX` cannot overflow anything.
    fn check_chain(&self) -> Result<(), String> {
        if self.deltas.len() > MAX_CHAIN {
            return Err(format!("lists {} deltas, more than {MAX_CHAIN}", self.deltas.len()));
        }
        let Some(&last) = self.deltas.last() else {
            return match (self.anchor == self.version, self.parent) {
                (true, None) => Ok(()),
                _ => Err(format!("anchor {} without deltas but version {}", self.anchor, self.version)),
            };
        };
        if self.inline.is_some() {
            return Err("a delta version carries an inline frame".into());
        }
        if last != self.version {
            return Err(format!("the chain ends at {last}, not at version {}", self.version));
        }
        let mut previous = self.anchor;
        for &delta in &self.deltas {
            if delta <= previous {
                return Err(format!("the chain is not ascending ({previous} then {delta})"));
            }
            if delta == self.version && self.parent != Some(previous) {
                return Err(format!("parent {:?} is not the chain's {previous}", self.parent));
            }
            previous = delta;
        }
        Ok(())
    }

    /// The objects to read, in order, to rebuild `version` starting from `have` (a verified
    /// version of this chain), or from the anchor when `have` is not in the chain.
    fn plan(&self, have: Option<PolicyVersion>) -> (bool, Vec<String>) {
        let from = have.map(|have| have.0).filter(|&have| have == self.anchor || self.deltas.contains(&have));
        let mut objects = Vec::with_capacity(self.deltas.len() + 1);
        if from.is_none() {
            objects.push(subjects::weights_object(self.anchor));
        }
        let after = from.unwrap_or(self.anchor);
        objects.extend(self.deltas.iter().filter(|&&v| v > after).map(|&v| subjects::weights_delta_object(v)));
        (from.is_some(), objects)
    }
}

async fn read_pointer(kv: &kv::Store, timeout: Duration) -> Result<Option<WeightsPointer>, TransportError> {
    let Some(bytes) = call("read weights pointer", timeout, kv.get(subjects::WEIGHTS_KEY)).await? else {
        return Ok(None);
    };
    match serde_json::from_slice(&bytes) {
        Ok(pointer) => Ok(Some(pointer)),
        Err(err) => {
            // An older build's pointer, or garbage: the learner starts as on a fresh run (its
            // versions still only go up; followers judge every pointer).
            warn!(operation = "read weights pointer", error = %err, "unreadable weights pointer ignored");
            Ok(None)
        }
    }
}

/// Whether `name` is one of our weights objects: `v` (anchor) or `d` (delta) and 20 digits.
fn is_weights_object(name: &str) -> bool {
    name.len() == 21
        && (name.starts_with('v') || name.starts_with('d'))
        && name[1..].bytes().all(|b| b.is_ascii_digit())
}

/// Names of the weights objects in the store (ours only, see [`is_weights_object`]): the live
/// ones, and the deleted ones whose delete marker is still stored.
async fn list_weight_objects(
    objects: &object_store::ObjectStore,
    timeout: Duration,
) -> Result<(Vec<String>, Vec<String>), TransportError> {
    timed("list weights objects", timeout, async {
        let mut list = objects.list().await.map_err(|err| failed("list weights objects", err))?;
        let (mut live, mut deleted) = (Vec::new(), Vec::new());
        while let Some(info) = list.next().await {
            let info = info.map_err(|err| failed("list weights objects", err))?;
            match (is_weights_object(&info.name), info.deleted) {
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

/// Learner side: publishes each version as a frame and points KV key `weights` at it.
///
/// - Weights whose full frame fits [`NatsConfig::weights_inline_max_bytes`] go inline in the
///   pointer: one KV put per version, one message to each follower.
/// - Larger weights go to the object store: a full frame (anchor, `v<version>`) every
///   [`NatsConfig::weights_anchor_every`] versions, lossless deltas (`d<version>`) against the
///   previous version in between, so a follower that is one version behind downloads only the
///   delta. A version whose checksum does not match its parameters (a corrupted buffer) is
///   published as an anchor and never used as a delta's parent, so it cannot poison a chain.
/// - Versions must increase (a version not newer than this publisher's last is refused, like
///   the in-process publisher). A publish retries through a broker outage for
///   [`NatsConfig::retry_deadline`].
/// - Chains beyond the newest [`NatsConfig::keep_weight_versions`] (each an anchor and its
///   deltas) are deleted, with their delete markers.
/// - If the run already had a newer version (a learner restarted from an older checkpoint),
///   followers ignore the new versions until they pass it; this is logged.
///
/// `publish` returns once the version is stored and pointed to; the learner wraps it in a
/// [`crate::BackgroundPublisher`] so that it does not wait.
pub struct NatsWeightsPublisher {
    shared: Arc<Shared>,
    kv: kv::Store,
    objects: object_store::ObjectStore,
    /// The stream behind `objects`, for purging delete markers.
    backing: stream::Stream<()>,
    /// Newest version in KV when this publisher started.
    published_before: Option<PolicyVersion>,
    last_version: Option<u64>,
    /// The last version published, when it may be a delta's parent.
    parent: Option<Arc<Weights>>,
    /// The current chain: its anchor and deltas.
    anchor: u64,
    deltas: Vec<u64>,
    /// Stored objects by chain, oldest chain first (the current chain last).
    kept: VecDeque<Vec<String>>,
    /// Bytes of the last frame published.
    last_frame_bytes: usize,
    /// The version of the pointer written last, and when.
    pointer_written: Option<(u64, Instant)>,
    /// A version sent live whose pointer is not written yet, with its weights (the pointer
    /// carries their full frame inline): written with the next pointer due, or by
    /// [`WeightsPublisher::flush`].
    deferred: Option<(WeightsPointer, Arc<Weights>)>,
}

impl fmt::Debug for NatsWeightsPublisher {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("NatsWeightsPublisher")
            .field("last_version", &self.last_version)
            .field("anchor", &self.anchor)
            .field("deltas", &self.deltas.len())
            .field("kept_chains", &self.kept.len())
            .field("deferred", &self.deferred.as_ref().map(|(pointer, _)| pointer.version))
            .finish()
    }
}

impl NatsWeightsPublisher {
    /// The newest version this run may have published when the publisher opened (read from the
    /// KV pointer, no waiting): the pointer's version, or up to `pointer_every − 1` versions
    /// above it that went out live while their pointer waited (a learner killed without a
    /// flush). A restarted learner continues above it, so actors holding such a version take
    /// the new learner's versions at once and their segments are not from its future.
    pub fn published_before(&self) -> Option<PolicyVersion> {
        self.published_before
    }

    /// Bytes of the frame of the last version published (full or delta; inline or object).
    pub fn last_frame_bytes(&self) -> usize {
        self.last_frame_bytes
    }

    fn store_object(&self, name: &str, frame: &[u8]) -> Result<(), TransportError> {
        let config = &self.shared.config;
        let transfer = config.transfer_deadline(frame.len());
        let objects = &self.objects;
        // A put in flight across a broker restart is retried at once (issue 11).
        let connections = &self.shared.connections;
        self.shared.block_on(retry_for("put weights object", config.retry_deadline, || {
            let mut reader = frame;
            async move {
                let put = call("put weights object", transfer, objects.put(name, &mut reader));
                unless_reconnected(connections, "put weights object", put).await.map(|_| ())
            }
        }))
    }

    /// Put `pointer` (with `frame` inline when the pointer carries it) under the run's
    /// `weights` key, retrying through a broker outage.
    fn write_pointer(&mut self, mut pointer: WeightsPointer, inline: Option<&[u8]>) -> Result<(), TransportError> {
        let shared = self.shared.clone();
        let config = &shared.config;
        pointer.inline = inline.map(|frame| base64::engine::general_purpose::STANDARD.encode(frame));
        let pointer_json =
            Bytes::from(serde_json::to_vec(&pointer).map_err(|err| failed("encode weights pointer", err))?);
        let kv = &self.kv;
        // A put in flight across a broker restart is retried at once (issue 11), and each attempt
        // has a short deadline: a put whose ack was lost is sent again after half a second
        // instead of the whole request timeout, during which actors would act with ever staler
        // weights. Putting the same pointer twice is harmless.
        let connections = &shared.connections;
        let attempt = config.request_timeout.min(POINTER_PUT_DEADLINE);
        shared.block_on(retry_for("put weights pointer", config.retry_deadline, || {
            let put = call("put weights pointer", attempt, kv.put(subjects::WEIGHTS_KEY, pointer_json.clone()));
            unless_reconnected(connections, "put weights pointer", put)
        }))?;
        self.pointer_written = Some((pointer.version, Instant::now()));
        Ok(())
    }

    /// Whether `pointer` may wait: its weights went out live, and the pointer written last is
    /// fewer than the interval it announces (1 for any pointer that must not wait) versions
    /// and less than [`NatsConfig::weights_pointer_within`] old.
    fn may_defer(&self, pointer: &WeightsPointer, sent_live: bool) -> bool {
        sent_live
            && self.pointer_written.is_some_and(|(written, at)| {
                pointer.version.saturating_sub(written) < pointer.pointer_every
                    && at.elapsed() < self.shared.config.weights_pointer_within
            })
    }

    /// Delete the objects of chains beyond the newest `keep_weight_versions` (best effort: a
    /// failed delete leaves an object behind, nothing worse).
    fn purge_old_chains(&mut self) {
        let config = &self.shared.config;
        let keep = config.keep_weight_versions.max(1);
        let bucket = subjects::weights_bucket(&config.run);
        while self.kept.len() > keep {
            let Some(chain) = self.kept.pop_front() else { break };
            if chain.is_empty() {
                // Inline weights: nothing stored (and no trip into the runtime, which would
                // write what the learner's thread queued for its own next call).
                continue;
            }
            self.shared.block_on(async {
                for old in &chain {
                    let delete = call("delete old weights", config.request_timeout, self.objects.delete(old));
                    if unless_reconnected(&self.shared.connections, "delete old weights", delete).await.is_ok() {
                        purge_weights_marker(&self.backing, &bucket, old, config.request_timeout).await;
                    }
                }
            });
        }
    }
}

impl WeightsPublisher for NatsWeightsPublisher {
    fn publish(&mut self, weights: Arc<Weights>) -> Result<(), TransportError> {
        self.publish_with(weights, None)
    }

    fn live_sender(&self) -> Option<Box<dyn LiveWeightsSender>> {
        self.shared
            .config
            .weights_live
            .then(|| Box::new(NatsLiveSender { shared: self.shared.clone() }) as Box<dyn LiveWeightsSender>)
    }

    fn publish_after_live(&mut self, weights: Arc<Weights>, sent_live: bool) -> Result<(), TransportError> {
        self.publish_with(weights, Some(sent_live))
    }

    /// Write the pointer of the last version if it was deferred.
    fn flush(&mut self) -> Result<(), TransportError> {
        let Some((pointer, weights)) = self.deferred.take() else { return Ok(()) };
        let frame = wire::frame::encode_full_frame(&weights);
        match self.write_pointer(pointer.clone(), Some(&frame)) {
            Ok(()) => {
                debug!(version = pointer.version, "deferred weights pointer written");
                Ok(())
            }
            Err(err) => {
                // Kept: the next flush tries again, unless a newer version replaces it.
                self.deferred = Some((pointer, weights));
                Err(err)
            }
        }
    }

    fn take_without_writing(&mut self, weights: &Arc<Weights>, sent_live: bool) -> bool {
        let config = &self.shared.config;
        let version = weights.version.0;
        let n_params = weights.params.len();
        // Only inline weights that went out live, after a first version, and only when
        // dropping the oldest chain would not touch the store (inline weights store nothing).
        let keep = config.keep_weight_versions.max(1);
        let purged = (self.kept.len() + 1).saturating_sub(keep);
        if !sent_live
            || !config.weights_live
            || full_frame_bytes(n_params) > config.weights_inline_max_bytes
            || self.last_version.is_none_or(|last| version <= last)
            || self.kept.iter().take(purged).any(|chain| !chain.is_empty())
        {
            return false;
        }
        // The pointer `publish_after_live` would write for it: an anchor of its own (inline
        // weights never chain deltas). A version that went out live matched its checksum.
        let frame_bytes = full_frame_bytes(n_params);
        let pointer = self.pointer_of(weights, None, version, Vec::new(), frame_bytes, true);
        if !self.may_defer(&pointer, true) {
            return false;
        }
        debug!(version, "weights published live; pointer deferred");
        self.deferred = Some((pointer, weights.clone()));
        self.kept.push_back(Vec::new());
        self.published(version, frame_bytes, version, Vec::new(), Some(weights.clone()));
        true
    }

    fn deferred_until(&self) -> Option<Instant> {
        let (_, written_at) = self.pointer_written?;
        self.deferred.as_ref().map(|_| written_at + self.shared.config.weights_pointer_within)
    }
}

/// Bytes of the full frame of `n_params` parameters (whether weights go inline, the largest
/// frame a follower accepts).
fn full_frame_bytes(n_params: usize) -> usize {
    wire::HEADER_BYTES + wire::frame::FRAME_HEADER_BYTES + 4 * n_params
}

/// Payload bytes of each live chunk: each message at most half the server's `max_payload`
/// (and 1 MiB).
fn live_chunk_bytes(shared: &Shared) -> usize {
    let message_bytes = (shared.client.max_payload() / 2).min(1 << 20);
    message_bytes.saturating_sub(wire::live::CHUNK_HEADER_BYTES).max(1024)
}

/// [`NatsWeightsPublisher`]'s live path on the thread that hands versions over
/// ([`WeightsPublisher::live_sender`]), for weights small enough to go inline
/// ([`NatsConfig::weights_inline_max_bytes`]; larger ones stay on the publisher's thread).
///
/// It encodes the version's live chunks from the parameters and queues them on the
/// connection without running its writer: they leave with that thread's next call on the bus
/// (the learner's next `recv`) or with any other thread's, before the durable path's writes,
/// which the publisher queues after them. No hand-off to the publisher's thread and no trip of
/// that thread into the runtime stand between an update and its live message
/// (docs/benchmarks/distributed.md, issue 16, item 1).
struct NatsLiveSender {
    shared: Arc<Shared>,
}

impl LiveWeightsSender for NatsLiveSender {
    fn send_live(&mut self, weights: &Weights) -> Option<bool> {
        let shared = &self.shared;
        if full_frame_bytes(weights.params.len()) > shared.config.weights_inline_max_bytes {
            // Larger weights are encoded on the publisher's thread: megabytes of copying
            // and hashing would hold up the learner's next update.
            return None;
        }
        let (chunks, digest) = wire::live::encode_full_frame_chunks(weights, live_chunk_bytes(shared));
        if digest != weights.checksum {
            // Corrupted parameters never go out live; the durable path publishes them as an
            // anchor that no delta builds on.
            return Some(false);
        }
        Some(send_live_chunks(shared, chunks, weights.version.0, false))
    }
}

/// Fan `chunks` (the live chunks of `version`'s full frame, [`wire::live`]) out on the run's
/// live subject: whether they went out. Best effort and not waited for: a follower that misses
/// a chunk takes the version from the store, which the publisher writes after them (the chunks
/// leave first, on the same connection). `write`: run the connection's writer before
/// returning (the publisher's thread); otherwise only queue them for the caller's next call on
/// the bus ([`Shared::queue`]).
fn send_live_chunks(shared: &Shared, chunks: Vec<Vec<u8>>, version: u64, write: bool) -> bool {
    let subject = Subject::from(subjects::weights_live(&shared.config.run));
    let client = &shared.client;
    let send = call("publish live weights", shared.config.request_timeout, async {
        for chunk in chunks {
            client.publish(subject.clone(), Bytes::from(chunk)).await?;
        }
        Ok::<_, async_nats::PublishError>(())
    });
    let sent = if write { shared.block_on(send) } else { shared.queue(send) };
    if let Err(err) = &sent {
        debug!(version, %err, "live weights not sent; followers fetch them from the store");
    }
    sent.is_ok()
}

impl NatsWeightsPublisher {
    /// [`WeightsPublisher::publish`]; `caller_live`: the caller sent the version live itself
    /// ([`NatsLiveSender`]), and whether it went out.
    fn publish_with(&mut self, weights: Arc<Weights>, caller_live: Option<bool>) -> Result<(), TransportError> {
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
        let inline = full_frame_bytes(weights.params.len()) <= config.weights_inline_max_bytes;
        let delta_parent = self
            .parent
            .as_ref()
            .filter(|parent| !inline && parent.params.len() == weights.params.len())
            .filter(|_| (self.deltas.len() as u64).saturating_add(1) < config.weights_anchor_every.max(1));
        // The live path first, and always a full frame: cheap to encode (a copy), cheap to
        // decode, and applicable by any follower whatever it holds, so neither the delta's
        // encoding nor a missed version stands between a connected follower and this version.
        // Its chunks are written straight from the parameters unless the durable path needs
        // the full frame too (an anchor, or inline weights). Not here when the caller ran
        // the live path itself (`caller_live`).
        let chunk_bytes = live_chunk_bytes(&shared);
        let live_here = config.weights_live && caller_live.is_none();
        // With each, the digest of the parameters as encoded.
        let (full, live, digest) = match (live_here, delta_parent.is_some()) {
            (true, true) => {
                let (chunks, digest) = wire::live::encode_full_frame_chunks(&weights, chunk_bytes);
                (None, Some(chunks), digest)
            }
            (false, true) => (None, None, wire::checksum(&weights.params)),
            (live, false) => {
                let frame = wire::frame::encode_full_frame(&weights);
                let digest = wire::body_checksum(&frame[wire::HEADER_BYTES + wire::frame::FRAME_HEADER_BYTES..]);
                let header = wire::frame::FrameHeader::of_full(&weights);
                let chunks = live.then(|| wire::live::encode_live_chunks(&frame, &header, chunk_bytes));
                (Some(frame), chunks, digest)
            }
        };
        // Whether the parameters match their checksum.
        let sound = digest == weights.checksum;
        let sent_live = match (sound, live, caller_live) {
            (true, Some(chunks), _) => send_live_chunks(&shared, chunks, version, true),
            (true, None, Some(sent)) => sent,
            _ => false,
        };
        // Then the durable path: the chain's delta, or the full frame (encoded once).
        let (frame, parent) = match delta_parent {
            Some(parent) => (wire::frame::encode_delta_frame(parent, &weights), Some(parent.version.0)),
            None => (full.unwrap_or_else(|| wire::frame::encode_full_frame(&weights)), None),
        };
        if inline {
            self.kept.push_back(Vec::new());
        } else {
            let object = match parent {
                Some(_) => subjects::weights_delta_object(version),
                None => subjects::weights_object(version),
            };
            self.store_object(&object, &frame)?;
            match (parent, self.kept.back_mut()) {
                (Some(_), Some(chain)) => chain.push(object),
                _ => self.kept.push_back(vec![object]),
            }
        }
        let (anchor, deltas) = match parent {
            Some(_) => (self.anchor, self.deltas.iter().copied().chain([version]).collect()),
            None => (version, Vec::new()),
        };
        let frame_bytes = frame.len();
        let pointer = self.pointer_of(&weights, parent, anchor, deltas.clone(), frame_bytes, inline);
        // Inline weights that went out live: their pointer (a stored KV write of the whole
        // frame, and a delivery to every follower) may wait for the next one due, since
        // connected followers have the version already (issue 16). Only inline weights (the
        // only pointers announcing an interval above 1): the pointer of an object-stored
        // version is small, and its chain needs every version.
        if self.may_defer(&pointer, sent_live) {
            self.deferred = Some((pointer, weights.clone()));
        } else {
            self.deferred = None;
            self.write_pointer(pointer, inline.then_some(&frame[..]))?;
        }
        debug!(
            version,
            parent,
            size_bytes = frame_bytes,
            inline,
            deferred = self.deferred.is_some(),
            "weights published"
        );
        self.published(version, frame_bytes, anchor, deltas, sound.then_some(weights));
        Ok(())
    }

    /// The pointer to `weights` (its frame `size_bytes` long, `parent` its delta's parent, in
    /// the chain of `anchor` and `deltas`), without the frame inline.
    fn pointer_of(
        &self,
        weights: &Weights,
        parent: Option<u64>,
        anchor: u64,
        deltas: Vec<u64>,
        size_bytes: usize,
        inline: bool,
    ) -> WeightsPointer {
        let config = &self.shared.config;
        WeightsPointer {
            version: weights.version.0,
            parent,
            anchor,
            deltas,
            digest: format!("{:016x}", weights.checksum),
            layout_hash: format!("{:016x}", weights.layout_hash),
            size_bytes: size_bytes as u64,
            inline: None,
            // Only inline weights sent live skip pointers; any other pointer promises the next.
            pointer_every: match inline && config.weights_live {
                true => pointer_interval(config.weights_pointer_every),
                false => 1,
            },
        }
    }

    /// Record `version` as published (its frame `frame_bytes` long, in the chain of `anchor`
    /// and `deltas`; `parent`: the weights a next delta may build on), after its chain entry
    /// was pushed onto `kept`, and drop the chains beyond the newest kept.
    fn published(
        &mut self,
        version: u64,
        frame_bytes: usize,
        anchor: u64,
        deltas: Vec<u64>,
        parent: Option<Arc<Weights>>,
    ) {
        self.last_version = Some(version);
        self.last_frame_bytes = frame_bytes;
        self.anchor = anchor;
        self.deltas = deltas;
        self.parent = parent;
        self.purge_old_chains();
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
        debug!(version = pointer.version, "new weights pointer");
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
/// Live path (unless [`NatsConfig::weights_live`] is off): a second background task
/// reassembles the chunks fanned out on `volley.<run>.weights.live`, and `latest` first
/// applies a completed live frame when it verifies and extends what this follower holds
/// (see `apply_live`); a pointer for a version it took live confirms it or, with another
/// digest, overrules it. Counters: [`live_applied`](Self::live_applied),
/// [`durable_fetches`](Self::durable_fetches), [`live_refused`](Self::live_refused),
/// [`live_chunks_refused`](Self::live_chunks_refused).
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
    /// The newest weights verified so far (by the pointer, or by the live path alone).
    newest: Option<Arc<Weights>>,
    /// The newest weights whose version and digest a pointer announced: the base of object
    /// fetches, and what a live version the pointer contradicts is replaced by.
    confirmed: Option<Arc<Weights>>,
    /// The last pointer write dealt with for good (adopted, refused, or not newer).
    settled_write: u64,
    /// Live frames completed when `latest` last looked.
    settled_live: u64,
    /// A pointer write whose fetch failed, and when to try it again.
    retry: Option<(u64, Instant, Duration)>,
    /// Pointers refused or not fetchable, in total.
    refusals: u64,
    /// Versions rebuilt through the durable path (object store or inline pointer).
    durable_fetches: u64,
    /// Versions taken from the live path.
    live_applied: u64,
    /// Complete live frames refused (frame, digest or pointer mismatch), in total.
    live_refused: u64,
    /// The pointer contradicted the live version the caller may run: fetch the pointer's
    /// version even if the caller claims to have it (until fetched or refused).
    contradicted: bool,
    live: Option<LiveFeed>,
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
            .field("live", &self.live.is_some())
            .field("live_received", &self.live_received())
            .field("live_applied", &self.live_applied)
            .field("live_refused", &self.live_refused)
            .field("live_chunks_refused", &self.live_chunks_refused())
            .field("durable_fetches", &self.durable_fetches)
            .finish()
    }
}

impl Drop for NatsWeightsFollower {
    fn drop(&mut self) {
        self.task.abort();
        if let Some(live) = &self.live {
            live.task.abort();
        }
    }
}

impl NatsWeightsFollower {
    /// The version the pointer written last claims (fetched or not, verified or not). Like the
    /// other counts of what arrived, it first lets the connection take what the socket holds.
    pub fn announced_version(&self) -> Option<PolicyVersion> {
        self.shared.drive();
        self.slot.newest().map(|(pointer, _)| PolicyVersion(pointer.version))
    }

    /// The newest version this follower fetched and verified.
    pub fn verified_version(&self) -> Option<PolicyVersion> {
        self.newest.as_ref().map(|w| w.version)
    }

    /// Pointers refused for their content or not fetchable, in total (each failure once).
    pub fn refusals(&self) -> u64 {
        self.refusals
    }

    /// Versions this follower rebuilt through the durable path: objects from the store, or
    /// the frame inline in the pointer.
    pub fn durable_fetches(&self) -> u64 {
        self.durable_fetches
    }

    /// Versions this follower took from the live path (core-NATS fan-out).
    pub fn live_applied(&self) -> u64 {
        self.live_applied
    }

    /// Live versions refused after reassembly: the frame did not decode onto the version this
    /// follower holds, its digest or version disagreed with its chunks, or the pointer
    /// announced another digest for it. Each fell back to the durable path.
    pub fn live_refused(&self) -> u64 {
        self.live_refused
    }

    /// Live versions reassembled so far (applied or not).
    pub fn live_received(&self) -> u64 {
        self.shared.drive();
        self.live.as_ref().map_or(0, |live| live.slot.completed.load(Ordering::Acquire))
    }

    /// Live chunks refused on arrival (corrupt, unreadable, another layout, larger than a
    /// full frame, inconsistent with the rest of their version).
    pub fn live_chunks_refused(&self) -> u64 {
        self.shared.drive();
        self.live.as_ref().map_or(0, |live| live.slot.refused_chunks.load(Ordering::Relaxed))
    }

    /// Whether this follower receives the live path (it is on, and the subscription worked).
    pub fn is_live(&self) -> bool {
        self.live.is_some()
    }

    /// Take the completed live frames that extend what this follower holds: a frame is
    /// applied when its version is above the newest verified one and at most
    /// [`live_lead`] above the pointer written last, it is a full frame or a delta whose
    /// parent is exactly the newest verified version, it decodes (envelope checksum, layout,
    /// parameter count, parent), and the rebuilt parameters' digest equals the digest its
    /// chunks carried, which is the digest the pointer will carry. Anything else is left to
    /// the durable path. A live version stays provisional until a pointer announces it; a
    /// pointer that announces that version with another digest replaces it (see `latest`).
    fn apply_live(&mut self) {
        let Some(slot) = self.live.as_ref().map(|live| live.slot.clone()) else { return };
        let announced = self.slot.newest().map(|(pointer, _)| (pointer.version, live_lead(pointer.pointer_every)));
        let mut frames = std::mem::take(&mut *slot.frames.lock().expect("live lock is never poisoned"));
        let ahead = |header: &wire::live::ChunkHeader| {
            announced.is_none_or(|(announced, lead)| header.version.0 > announced.saturating_add(lead))
        };
        // Frames before the newest full frame that may be applied are not needed.
        if let Some(last_full) = frames.iter().rposition(|f| f.header.parent.is_none() && !ahead(&f.header)) {
            frames.drain(..last_full);
        }
        let mut waiting = VecDeque::new();
        for frame in frames {
            let header = frame.header;
            let held = self.newest.as_ref().map(|w| w.version);
            if held.is_some_and(|held| header.version <= held) {
                continue;
            }
            // A version far ahead of the pointer waits for it (or for eviction by newer frames).
            if ahead(&header) {
                waiting.push_back(frame);
                continue;
            }
            let base = match header.parent {
                None => None,
                Some(parent) if held == Some(parent) => self.newest.clone(),
                // A gap: the version this delta needs never arrived live. The durable path
                // rebuilds it.
                Some(_) => continue,
            };
            let decoded = wire::frame::decode_frame(&frame.bytes, base.as_deref(), self.layout_hash, self.n_params)
                .map_err(|err| err.to_string())
                .and_then(|weights| match weights.version == header.version && weights.checksum == header.digest {
                    true => Ok(weights),
                    false => Err(format!(
                        "frame rebuilt {} with digest {:016x}, its chunks said {} with {:016x}",
                        weights.version, weights.checksum, header.version, header.digest
                    )),
                });
            match decoded {
                Ok(weights) => {
                    debug!(version = header.version.0, "weights taken from the live path");
                    self.newest = Some(Arc::new(weights));
                    self.live_applied += 1;
                }
                Err(reason) => {
                    warn!(version = header.version.0, %reason, "live weights refused; using the weights store");
                    self.live_refused += 1;
                }
            }
            // Its bytes are assembled into again for a later version.
            *slot.spare.lock().expect("live lock is never poisoned") = Some(frame.bytes);
        }
        if !waiting.is_empty() {
            // Frames that completed meanwhile are newer: they go behind, and the bound holds.
            let mut frames = slot.frames.lock().expect("live lock is never poisoned");
            waiting.extend(frames.drain(..));
            while waiting.len() > LIVE_FRAMES_KEPT {
                waiting.pop_front();
            }
            *frames = waiting;
        }
    }

    /// The pause before the pointer written last is fetched again, when its fetch failed.
    pub fn retry_pause(&self) -> Option<Duration> {
        self.retry.map(|(_, _, pause)| pause)
    }

    /// Hold a live version against the pointer: a pointer announcing the version this
    /// follower took live confirms it when the digests agree; when they do not, the live
    /// version was not the learner's (or the pointer is not), and the follower drops back to
    /// the newest confirmed version, from which the pointer's version is then fetched and
    /// verified as usual.
    /// Returns whether it dropped a live version; the caller then fetches the pointer's
    /// version even if the caller runs that version number.
    fn reconcile(&mut self, pointer: &WeightsPointer) -> bool {
        let Some(newest) = self.newest.clone() else { return false };
        if newest.version.0 != pointer.version || self.confirmed.as_ref().is_some_and(|c| Arc::ptr_eq(c, &newest)) {
            return false;
        }
        if format!("{:016x}", newest.checksum) == pointer.digest {
            self.confirmed = Some(newest);
            return false;
        }
        warn!(
            version = pointer.version,
            live_digest = format_args!("{:016x}", newest.checksum),
            pointer_digest = %pointer.digest,
            "the pointer contradicts the live version; using the weights store"
        );
        self.live_refused += 1;
        self.newest = self.confirmed.clone();
        true
    }

    /// Refuse `pointer` for its content (see the type's docs).
    #[cold]
    fn refuse(&mut self, pointer: &WeightsPointer, reason: String) -> TransportError {
        warn!(version = pointer.version, %reason, "weights pointer refused");
        failed("weights fetch", reason)
    }

    fn fetch(&mut self, pointer: &WeightsPointer) -> Result<Arc<Weights>, FetchError> {
        let expected_layout = format!("{:016x}", self.layout_hash);
        let refused = |this: &mut Self, reason: String| {
            FetchError::Refused(this.refuse(pointer, format!("weights v{} refused: {reason}", pointer.version)))
        };
        if pointer.layout_hash != expected_layout {
            let reason = format!("layout hash {} does not match this actor's {expected_layout}", pointer.layout_hash);
            return Err(refused(self, reason));
        }
        // The pointer's size is a claim: never reserve more than a message may hold.
        if pointer.size_bytes as usize > wire::MAX_MESSAGE_BYTES {
            return Err(refused(self, format!("claimed size {} bytes exceeds the limit", pointer.size_bytes)));
        }
        if let Err(reason) = pointer.check_chain() {
            return Err(refused(self, format!("bad chain: {reason}")));
        }
        let (from_have, frames) = match &pointer.inline {
            Some(inline) => match base64::engine::general_purpose::STANDARD.decode(inline) {
                Ok(frame) => (false, vec![frame]),
                Err(err) => return Err(refused(self, format!("inline frame is not base64: {err}"))),
            },
            None => {
                let (from_have, names) = pointer.plan(self.confirmed.as_ref().map(|w| w.version));
                (from_have, self.download(pointer, &names).map_err(FetchError::Unavailable)?)
            }
        };
        let mut base = if from_have { self.confirmed.clone() } else { None };
        for frame in &frames {
            match wire::frame::decode_frame(frame, base.as_deref(), self.layout_hash, self.n_params) {
                Ok(weights) => base = Some(Arc::new(weights)),
                Err(err) => return Err(refused(self, format!("frame ({}): {err}", err.reason()))),
            }
        }
        let Some(weights) = base.filter(|_| !frames.is_empty()) else {
            return Err(refused(self, "no frame to rebuild it from".into()));
        };
        let digest = format!("{:016x}", weights.checksum);
        if weights.version.0 != pointer.version || digest != pointer.digest {
            return Err(refused(
                self,
                format!(
                    "rebuilt {} with digest {digest}, pointer says v{} with digest {}",
                    weights.version, pointer.version, pointer.digest
                ),
            ));
        }
        self.newest = Some(weights.clone());
        self.confirmed = Some(weights.clone());
        self.durable_fetches += 1;
        Ok(weights)
    }

    /// Read `names` from the object store, all at once, each bounded by the largest frame of
    /// this layout (a full frame), under one deadline.
    fn download(&mut self, pointer: &WeightsPointer, names: &[String]) -> Result<Vec<Vec<u8>>, TransportError> {
        const OPERATION: &str = "weights fetch";
        let shared = self.shared.clone();
        let config = &shared.config;
        let bucket = subjects::weights_bucket(&config.run);
        let frame_limit = full_frame_bytes(self.n_params);
        let deadline = config.transfer_deadline(frame_limit.saturating_mul(names.len()));
        let objects = &mut self.objects;
        let downloaded = shared.block_on(async {
            if objects.is_none() {
                *objects = open_objects(&shared.js, &bucket, config.request_timeout).await?;
            }
            let Some(store) = objects.as_ref() else {
                return Err(failed(OPERATION, format!("object store {bucket} does not exist")));
            };
            call(OPERATION, deadline, async {
                let (js, client, bucket) = (&shared.js, &shared.client, bucket.as_str());
                let reads = names.iter().map(|name| async move {
                    // At most one byte past the limit is read: an oversized object is refused when decoded.
                    match consumers::read_object(js, client, store, bucket, name, frame_limit).await {
                        Ok(Some(bytes)) => Ok(bytes),
                        Ok(None) => Err(format!("weights object {name} does not exist")),
                        Err(err) => Err(format!("{name}: {err}")),
                    }
                });
                futures::future::try_join_all(reads).await
            })
            .await
        });
        downloaded.inspect_err(|err| {
            warn!(version = pointer.version, %err, "weights objects not fetchable; retrying with backoff");
        })
    }
}

impl WeightsFollower for NatsWeightsFollower {
    fn paths(&self) -> crate::WeightsPaths {
        crate::WeightsPaths {
            live: self.live_applied,
            durable: self.durable_fetches,
            live_refused: self.live_refused,
            // Without driving the connection first (as `live_chunks_refused` does): an actor
            // reads these for its metrics right after `latest`, which just drove it.
            live_chunks_refused: self.live.as_ref().map_or(0, |live| live.slot.refused_chunks.load(Ordering::Relaxed)),
        }
    }

    fn latest(&mut self, have: Option<PolicyVersion>) -> Result<Option<Arc<Weights>>, TransportError> {
        self.shared.drive();
        let newer = |newest: &Option<Arc<Weights>>| {
            newest.clone().filter(|newest| have.is_none_or(|have| newest.version > have))
        };
        let writes = self.slot.writes.load(Ordering::Acquire);
        let lives = self.live.as_ref().map_or(0, |live| live.slot.completed.load(Ordering::Acquire));
        if writes == self.settled_write && lives == self.settled_live {
            return Ok(newer(&self.newest));
        }
        // A new frame, or a new pointer that a waiting frame may have been ahead of.
        self.settled_live = lives;
        self.apply_live();
        let Some((pointer, write)) = self.slot.newest() else {
            return Ok(newer(&self.newest));
        };
        if write == self.settled_write {
            // Only a live frame is new; the pointer written last was judged already.
            return Ok(newer(&self.newest));
        }
        self.contradicted |= self.reconcile(&pointer);
        let contradicted = self.contradicted;
        // Only a version above everything verified (and above what the caller runs) is worth
        // fetching; an older or equal claim is settled at once (versions never go back). After
        // a contradiction the caller runs the refused live version: what it has no longer counts.
        let held = self.newest.as_ref().map(|w| w.version);
        let current = if contradicted { held } else { held.max(have) };
        if current.is_some_and(|current| PolicyVersion(pointer.version) <= current) {
            self.settled_write = write;
            self.retry = None;
            return Ok(newer(&self.newest));
        }
        if let Some((retry_write, at, _)) = self.retry {
            if retry_write == write && Instant::now() < at {
                return Ok(newer(&self.newest));
            }
        }
        match self.fetch(&pointer) {
            Ok(weights) => {
                self.settled_write = write;
                self.retry = None;
                self.contradicted = false;
                Ok(Some(weights))
            }
            Err(FetchError::Refused(err)) => {
                self.contradicted = false;
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
        self.wait_newer(None, timeout)?.ok_or(TransportError::Timeout { operation: "first weights", after: timeout })
    }
}

impl NatsWeightsFollower {
    /// Block until a version newer than `have` is verified (`Some`, as
    /// [`WeightsFollower::latest`] returns it) or `timeout` passes (`None`), waking on each new
    /// pointer write or live frame instead of polling.
    pub fn wait_newer(
        &mut self,
        have: Option<PolicyVersion>,
        timeout: Duration,
    ) -> Result<Option<Arc<Weights>>, TransportError> {
        let slot = self.slot.clone();
        let started = Instant::now();
        loop {
            if let Some(weights) = self.latest(have)? {
                return Ok(Some(weights));
            }
            let left = timeout.saturating_sub(started.elapsed());
            if left.is_zero() {
                return Ok(None);
            }
            // Wait for a new pointer write or live frame, or until a failed fetch may be retried.
            let (settled, settled_live) = (self.settled_write, self.settled_live);
            let live = self.live.as_ref().map(|live| live.slot.clone());
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
                let arrived = async {
                    let Some(live) = &live else { return std::future::pending().await };
                    loop {
                        let notified = live.changed.notified();
                        if live.completed.load(Ordering::Acquire) != settled_live {
                            return;
                        }
                        notified.await;
                    }
                };
                let _ = tokio::time::timeout(wake, futures::future::select(Box::pin(written), Box::pin(arrived))).await;
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

    fn pointer(version: u64) -> WeightsPointer {
        WeightsPointer {
            version,
            parent: None,
            anchor: version,
            deltas: Vec::new(),
            digest: "0".into(),
            layout_hash: "0".into(),
            size_bytes: 0,
            inline: None,
            pointer_every: 1,
        }
    }

    #[test]
    fn a_pointer_without_an_interval_means_every_version_and_the_lead_is_bounded() {
        let json = serde_json::to_string(&pointer(7)).expect("serializable");
        assert!(!json.contains("pointer_every"), "an older follower reads it unchanged: {json}");
        let every8 = WeightsPointer { pointer_every: 8, ..pointer(7) };
        let json8 = serde_json::to_string(&every8).expect("serializable");
        assert!(json8.contains("\"pointer_every\":8"), "{json8}");
        assert_eq!(serde_json::from_str::<WeightsPointer>(&json8).expect("roundtrip"), every8);
        // A live version may lead the pointer by its interval plus one, never by more than the cap.
        assert_eq!(live_lead(1), 2);
        assert_eq!(live_lead(0), 2);
        assert_eq!(live_lead(8), 9);
        assert_eq!(live_lead(u64::MAX), MAX_POINTER_EVERY + 1);
    }

    #[test]
    fn pointer_slot_keeps_the_last_write_whatever_its_version() {
        let slot = PointerSlot::default();
        slot.offer(pointer(3));
        // Issue 12: a forged pointer with a huge version must not hide later real ones.
        slot.offer(pointer(u64::MAX));
        slot.offer(pointer(2));
        assert_eq!(slot.newest().map(|(p, write)| (p.version, write)), Some((2, 3)));
        slot.offer(pointer(2));
        assert_eq!(slot.writes.load(Ordering::Acquire), 3, "a re-delivered value is not a new write");
        slot.offer(pointer(4));
        assert_eq!(slot.newest().map(|(p, _)| p.version), Some(4));
    }

    #[test]
    fn weights_pointer_is_readable_json() {
        let pointer = WeightsPointer { parent: Some(5), anchor: 3, deltas: vec![5, 7], ..pointer(7) };
        let json = serde_json::to_string(&pointer).expect("serializable");
        assert!(json.contains("\"version\":7"), "{json}");
        assert!(json.contains("\"deltas\":[5,7]"), "{json}");
        assert!(!json.contains("inline"), "{json}");
        assert_eq!(serde_json::from_str::<WeightsPointer>(&json).expect("roundtrip"), pointer);
    }

    #[test]
    fn chain_arithmetic_is_checked() {
        let delta = |anchor, deltas: Vec<u64>, parent| WeightsPointer {
            version: deltas.last().copied().unwrap_or(anchor),
            parent,
            anchor,
            deltas,
            ..pointer(0)
        };
        assert!(pointer(9).check_chain().is_ok());
        assert!(delta(3, vec![5, 7], Some(5)).check_chain().is_ok());
        assert!(delta(3, vec![4], Some(3)).check_chain().is_ok());
        // Not ascending, starting at or below the anchor, wrong parent, wrong end.
        assert!(delta(3, vec![7, 5], Some(7)).check_chain().is_err());
        assert!(delta(3, vec![3, 7], Some(3)).check_chain().is_err());
        assert!(delta(3, vec![5, 7], Some(3)).check_chain().is_err());
        assert!(delta(3, vec![5, 7], None).check_chain().is_err());
        assert!(WeightsPointer { version: u64::MAX, ..delta(3, vec![5, 7], Some(5)) }.check_chain().is_err());
        assert!(WeightsPointer { anchor: 2, ..pointer(9) }.check_chain().is_err());
        assert!(WeightsPointer { parent: Some(8), ..pointer(9) }.check_chain().is_err());
        // Forged extremes neither overflow nor pass.
        assert!(delta(u64::MAX, vec![u64::MAX], Some(u64::MAX)).check_chain().is_err());
        assert!(delta(0, (1..=MAX_CHAIN as u64 + 1).collect(), Some(MAX_CHAIN as u64)).check_chain().is_err());
        assert!(WeightsPointer { inline: Some(String::new()), ..delta(3, vec![5], Some(3)) }.check_chain().is_err());
    }

    #[test]
    fn plan_fetches_only_the_deltas_after_a_verified_version() {
        let p = WeightsPointer { parent: Some(5), anchor: 3, deltas: vec![4, 5, 7], ..pointer(7) };
        let (from_have, names) = p.plan(Some(PolicyVersion(4)));
        assert!(from_have);
        assert_eq!(names, vec![subjects::weights_delta_object(5), subjects::weights_delta_object(7)]);
        // A version outside the chain (missed an anchor, or a late joiner) starts at the anchor.
        for have in [None, Some(PolicyVersion(6)), Some(PolicyVersion(1))] {
            let (from_have, names) = p.plan(have);
            assert!(!from_have);
            assert_eq!(names.len(), 4);
            assert_eq!(names[0], subjects::weights_object(3));
        }
        assert!(is_weights_object(&subjects::weights_delta_object(7)));
        assert!(!is_weights_object("x00000000000000000007"));
    }
}
