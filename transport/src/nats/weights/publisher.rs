//! Learner side: [`NatsWeightsPublisher`] (object store, KV pointer) and its live sender.

use std::collections::VecDeque;
use std::fmt;
use std::future::IntoFuture;
use std::sync::Arc;
use std::time::{Duration, Instant};

use async_nats::jetstream::{kv, object_store, stream};
use async_nats::Subject;
use base64::Engine as _;
use bytes::Bytes;
use futures::StreamExt;
use tracing::{debug, info, warn};
use volley_core::ids::PolicyVersion;
use volley_core::subjects;
use volley_core::wire::{self, Weights};

use super::pointer::{full_frame_bytes, is_weights_object, pointer_interval, read_pointer, WeightsPointer};
use crate::nats::run::{open_kv, open_objects};
use crate::nats::{call, failed, retry_for, timed, unless_reconnected, NatsBus, Shared};
use crate::signing::{SignedVersion, WeightsSigningKey, SIGNATURE_BYTES};
use crate::{LiveWeightsSender, TransportError, WeightsPublisher};

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
            signer: None,
            shared,
        })
    }
}

/// Deadline of one attempt to put the weights pointer (see `NatsWeightsPublisher::publish`).
const POINTER_PUT_DEADLINE: Duration = Duration::from_millis(500);

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
/// - Weights whose full frame fits [`NatsConfig::weights_inline_max_bytes`](crate::nats::NatsConfig::weights_inline_max_bytes) go inline in the
///   pointer: one KV put per version, one message to each follower.
/// - Larger weights go to the object store: a full frame (anchor, `v<version>`) every
///   [`NatsConfig::weights_anchor_every`](crate::nats::NatsConfig::weights_anchor_every) versions, lossless deltas (`d<version>`) against the
///   previous version in between, so a follower that is one version behind downloads only the
///   delta. A version whose checksum does not match its parameters (a corrupted buffer) is
///   published as an anchor and never used as a delta's parent, so it cannot poison a chain.
/// - Versions must increase (a version not newer than this publisher's last is refused, like
///   the in-process publisher). A publish retries through a broker outage for
///   [`NatsConfig::retry_deadline`](crate::nats::NatsConfig::retry_deadline).
/// - Chains beyond the newest [`NatsConfig::keep_weight_versions`](crate::nats::NatsConfig::keep_weight_versions) (each an anchor and its
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
    /// The key every version is signed with ([`NatsWeightsPublisher::sign_with`]).
    signer: Option<Arc<WeightsSigningKey>>,
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
    /// and less than [`NatsConfig::weights_pointer_within`](crate::nats::NatsConfig::weights_pointer_within) old.
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
        self.shared.config.weights_live.then(|| {
            Box::new(NatsLiveSender { shared: self.shared.clone(), signer: self.signer.clone() })
                as Box<dyn LiveWeightsSender>
        })
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
        let signature = self.signature_of(weights);
        let pointer = self.pointer_of(weights, None, version, Vec::new(), frame_bytes, true, signature.as_ref());
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

/// The signature of `weights` in this run with `signer`, if there is one: one SHA-256 pass over
/// the parameters and one Ed25519 signature.
fn sign(signer: Option<&WeightsSigningKey>, shared: &Shared, weights: &Weights) -> Option<[u8; SIGNATURE_BYTES]> {
    signer.map(|key| key.sign(&SignedVersion::of(shared.config.run.as_str(), weights)))
}

/// Payload bytes of each live chunk: each message at most half the server's `max_payload`
/// (and 1 MiB).
fn live_chunk_bytes(shared: &Shared) -> usize {
    let message_bytes = (shared.client.max_payload() / 2).min(1 << 20);
    message_bytes.saturating_sub(wire::live::CHUNK_HEADER_BYTES).max(1024)
}

/// [`NatsWeightsPublisher`]'s live path on the thread that hands versions over
/// ([`WeightsPublisher::live_sender`]), for weights small enough to go inline
/// ([`NatsConfig::weights_inline_max_bytes`](crate::nats::NatsConfig::weights_inline_max_bytes); larger ones stay on the publisher's thread).
///
/// It encodes the version's live chunks from the parameters and queues them on the
/// connection without running its writer: they leave with that thread's next call on the bus
/// (the learner's next `recv`) or with any other thread's, before the durable path's writes,
/// which the publisher queues after them. No hand-off to the publisher's thread and no trip of
/// that thread into the runtime stand between an update and its live message
/// (docs/benchmarks/distributed.md, issue 16, item 1).
struct NatsLiveSender {
    shared: Arc<Shared>,
    signer: Option<Arc<WeightsSigningKey>>,
}

impl LiveWeightsSender for NatsLiveSender {
    fn send_live(&mut self, weights: &Weights) -> Option<bool> {
        let shared = &self.shared;
        if full_frame_bytes(weights.params.len()) > shared.config.weights_inline_max_bytes {
            // Larger weights are encoded on the publisher's thread: megabytes of copying
            // and hashing would hold up the learner's next update.
            return None;
        }
        let signature = sign(self.signer.as_deref(), shared, weights);
        let (chunks, digest) =
            wire::live::encode_signed_full_frame_chunks(weights, signature.as_ref(), live_chunk_bytes(shared));
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
        let signature = self.signature_of(&weights);
        // With each, the digest of the parameters as encoded.
        let (full, live, digest) = match (live_here, delta_parent.is_some()) {
            (true, true) => {
                let (chunks, digest) =
                    wire::live::encode_signed_full_frame_chunks(&weights, signature.as_ref(), chunk_bytes);
                (None, Some(chunks), digest)
            }
            (false, true) => (None, None, wire::checksum(&weights.params)),
            (live, false) => {
                let frame = wire::frame::encode_full_frame(&weights);
                let digest = wire::body_checksum(&frame[wire::HEADER_BYTES + wire::frame::FRAME_HEADER_BYTES..]);
                let header = wire::frame::FrameHeader::of_full(&weights);
                let chunks = live
                    .then(|| wire::live::encode_signed_live_chunks(&frame, &header, signature.as_ref(), chunk_bytes));
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
        let pointer =
            self.pointer_of(&weights, parent, anchor, deltas.clone(), frame_bytes, inline, signature.as_ref());
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
    /// the chain of `anchor` and `deltas`, signed with `signature`), without the frame inline.
    #[allow(clippy::too_many_arguments)]
    fn pointer_of(
        &self,
        weights: &Weights,
        parent: Option<u64>,
        anchor: u64,
        deltas: Vec<u64>,
        size_bytes: usize,
        inline: bool,
        signature: Option<&[u8; SIGNATURE_BYTES]>,
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
            signature: signature.map(|signature| base64::engine::general_purpose::STANDARD.encode(signature)),
        }
    }

    /// Sign every version from now on with `key` (pointer and live chunks alike), so that
    /// followers holding its public key take them (docs/SECURITY.md, "signed weights").
    pub fn sign_with(&mut self, key: Arc<WeightsSigningKey>) {
        info!(public_key_id = %key.public_key_id(), "signing weights");
        self.signer = Some(key);
    }

    /// The signature of `weights` with this publisher's key, if it has one.
    fn signature_of(&self, weights: &Weights) -> Option<[u8; SIGNATURE_BYTES]> {
        sign(self.signer.as_deref(), &self.shared, weights)
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
