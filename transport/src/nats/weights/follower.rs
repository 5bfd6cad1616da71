//! Actor side: [`NatsWeightsFollower`], which applies live frames and verified pointers.

use std::collections::VecDeque;
use std::fmt;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

use async_nats::jetstream::object_store;
use base64::Engine as _;
use tracing::{debug, info, warn};
use volley_core::ids::PolicyVersion;
use volley_core::subjects;
use volley_core::wire::{self, Weights};

use super::live::{open_live, LiveFeed, LIVE_FRAMES_KEPT};
use super::pointer::{
    follow_pointer, full_frame_bytes, live_lead, max_version_jump, PointerSlot, WeightsPointer, FETCH_RETRY_FIRST,
    FETCH_RETRY_MAX, REWIND_AFTER_WRITES,
};
use crate::nats::run::open_objects;
use crate::nats::{call, failed, gets, NatsBus, Shared};
use crate::rejection_log::RejectionLog;
use crate::signing::{SignatureError, SignedVersion, WeightsPublicKeys, SIGNATURE_BYTES};
use crate::{TransportError, WeightsFollower};

impl NatsBus {
    /// Actor side: follows the `weights` pointer (a background reader) and fetches and verifies
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
            highest: None,
            below: None,
            jumps_refused: 0,
            rewinds: 0,
            rejections: RejectionLog::new("weights"),
            trusted: None,
            unsigned: 0,
            bad_signature: 0,
            live,
            task,
        })
    }
}

/// Actor side: follows the newest weights.
///
/// Live path (unless [`NatsConfig::weights_live`](crate::nats::NatsConfig::weights_live) is off): a second background task
/// reassembles the chunks fanned out on `volley.<run>.weights.live`, and `latest` first
/// applies a completed live frame when it verifies and extends what this follower holds
/// (see `apply_live`); a pointer for a version it took live confirms it or, with another
/// digest, overrules it. Counters: [`live_applied`](Self::live_applied),
/// [`durable_fetches`](Self::durable_fetches), [`live_refused`](Self::live_refused),
/// [`live_chunks_refused`](Self::live_chunks_refused).
///
/// A background task reads the `weights` pointer by direct get, again on each notice of a
/// write (a core-NATS subscription to the key's subject), after errors and reconnects, and at
/// least every second; a late joiner gets the current pointer at once. No consumer is created:
/// the actor user may create none (issue 46). Objects are read by direct gets too. [`WeightsFollower::latest`]
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
    /// The highest version this follower verified, and when it last verified one: what a
    /// pointer's jump is measured from ([`max_version_jump`]).
    highest: Option<(PolicyVersion, Instant)>,
    /// Pointer writes in a row below the version held, each above the one before: how many,
    /// and the last one's version ([`REWIND_AFTER_WRITES`]).
    below: Option<(u32, u64)>,
    /// Pointers refused for jumping too far.
    jumps_refused: u64,
    /// Times the follower went back to a lower version the learner kept writing.
    rewinds: u64,
    /// Logs refusals at a bounded rate (each is counted in the fields above as well).
    rejections: RejectionLog,
    /// The public keys versions must be signed with ([`Self::require_signatures`]); `None`
    /// takes unsigned versions.
    trusted: Option<WeightsPublicKeys>,
    /// Versions refused for carrying no signature (pointer or live frame).
    unsigned: u64,
    /// Versions refused for a signature no trusted key made over them.
    bad_signature: u64,
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

    /// Take only versions signed by one of `keys` from now on: a version without a signature,
    /// or with one no key made over this run, version and parameters, is refused and counted
    /// ([`unsigned`](Self::unsigned), [`bad_signature`](Self::bad_signature)), live or durable
    /// alike, and the next version is judged afresh (docs/SECURITY.md, "signed weights").
    pub fn require_signatures(&mut self, keys: WeightsPublicKeys) {
        info!(public_key_ids = ?keys.ids(), "weights must be signed");
        self.trusted = Some(keys);
    }

    /// Versions refused for carrying no signature (pointers and live frames).
    pub fn unsigned(&self) -> u64 {
        self.unsigned
    }

    /// Versions refused for a signature no trusted key made over them (pointers and live frames).
    pub fn bad_signature(&self) -> u64 {
        self.bad_signature
    }

    /// Check `signature` of `weights` against the trusted keys (any signature, or none, when
    /// there are none), counting a refusal.
    fn check_signature(
        &mut self,
        weights: &Weights,
        signature: Option<&[u8; SIGNATURE_BYTES]>,
    ) -> Result<(), SignatureError> {
        let Some(trusted) = &self.trusted else { return Ok(()) };
        let signed = SignedVersion::of(self.shared.config.run.as_str(), weights);
        let checked = trusted.verify(&signed, signature);
        match checked {
            Err(SignatureError::Unsigned) => self.unsigned += 1,
            Err(SignatureError::Invalid) => self.bad_signature += 1,
            Ok(()) => {}
        }
        checked
    }

    /// Pointers refused because they claimed a version too far above the highest verified
    /// ([`MAX_VERSION_JUMP`](super::MAX_VERSION_JUMP)); counted in [`refusals`](Self::refusals) too.
    pub fn jumps_refused(&self) -> u64 {
        self.jumps_refused
    }

    /// Times this follower went back to a lower version the learner kept writing
    /// ([`REWIND_AFTER_WRITES`]).
    pub fn rewinds(&self) -> u64 {
        self.rewinds
    }

    /// Note `version` as verified now (the jump bound is measured from the highest).
    fn verified(&mut self, version: PolicyVersion) {
        let highest = self.highest.map_or(version, |(highest, _)| highest.max(version));
        self.highest = Some((highest, Instant::now()));
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
        // Nor beyond the jump a pointer may make (a forged pointer is refused, but it is still
        // the write announced last).
        let jump_limit = self.highest.map(|(highest, at)| highest.0.saturating_add(max_version_jump(at.elapsed())));
        let ahead = |header: &wire::live::ChunkHeader| {
            announced.is_none_or(|(announced, lead)| header.version.0 > announced.saturating_add(lead))
                || jump_limit.is_some_and(|limit| header.version.0 > limit)
                || header.version > PolicyVersion::MAX_PLAUSIBLE
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
            let decoded = decoded.and_then(|weights| match self.check_signature(&weights, header.signature.as_ref()) {
                Ok(()) => Ok(weights),
                Err(err) => Err(format!("{err} ({})", err.reason())),
            });
            match decoded {
                Ok(weights) => {
                    debug!(version = header.version.0, "weights taken from the live path");
                    self.verified(weights.version);
                    self.newest = Some(Arc::new(weights));
                    self.live_applied += 1;
                }
                Err(reason) => {
                    if self.rejections.record("live_refused") {
                        warn!(version = header.version.0, %reason, "live weights refused; using the weights store");
                    }
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
        if self.trusted.is_some() {
            // The live version's signature was verified: a pointer that disagrees with it is
            // not the learner's, and must not take the follower back (docs/SECURITY.md).
            if self.rejections.record("pointer_contradicts_signed") {
                warn!(version = pointer.version, pointer_digest = %pointer.digest, "a pointer contradicts a signed live version; ignored");
            }
            return false;
        }
        if self.rejections.record("live_contradicted") {
            warn!(
                version = pointer.version,
                live_digest = format_args!("{:016x}", newest.checksum),
                pointer_digest = %pointer.digest,
                "the pointer contradicts the live version; using the weights store"
            );
        }
        self.live_refused += 1;
        self.newest = self.confirmed.clone();
        true
    }

    /// Refuse `pointer` for its content (see the type's docs).
    #[cold]
    fn refuse(&mut self, pointer: &WeightsPointer, reason: String) -> TransportError {
        if self.rejections.record("pointer_refused") {
            warn!(version = pointer.version, %reason, "weights pointer refused");
        }
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
        let signature = match pointer.signature.as_deref().map(decode_signature) {
            None => None,
            Some(Ok(signature)) => Some(signature),
            // Unreadable: no trusted key made it.
            Some(Err(())) => Some([0; SIGNATURE_BYTES]),
        };
        if let Err(err) = self.check_signature(&weights, signature.as_ref()) {
            if self.rejections.record(err.reason()) {
                warn!(version = pointer.version, reason = err.reason(), %err, "weights pointer refused: signature");
            }
            return Err(FetchError::Refused(failed(
                "weights fetch",
                format!("weights v{} refused: {err}", pointer.version),
            )));
        }
        self.newest = Some(weights.clone());
        self.confirmed = Some(weights.clone());
        self.durable_fetches += 1;
        self.verified(weights.version);
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
                let (js, bucket) = (&shared.js, bucket.as_str());
                let reads = names.iter().map(|name| async move {
                    // Direct gets, no consumer (issue 46). At most one byte past the limit is
                    // read: an oversized object is refused when decoded.
                    match gets::read_object_by_direct_gets(js, store, bucket, name, frame_limit).await {
                        Ok(Some(bytes)) => Ok(bytes),
                        Ok(None) => Err(format!("weights object {name} does not exist")),
                        Err(err) => Err(format!("{name}: {err}")),
                    }
                });
                futures::future::try_join_all(reads).await
            })
            .await
        });
        let rejections = &mut self.rejections;
        downloaded.inspect_err(|err| {
            if rejections.record("not_fetchable") {
                warn!(version = pointer.version, %err, "weights objects not fetchable; retrying with backoff");
            }
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
            unsigned: self.unsigned,
            bad_signature: self.bad_signature,
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
        let mut rewind = false;
        if current.is_some_and(|current| PolicyVersion(pointer.version) <= current) {
            // Versions below the one held, written again and again in increasing order, are the
            // learner's: go back to them (see `REWIND_AFTER_WRITES`). Any other claim of an
            // older or equal version is settled at once.
            let below = current.is_some_and(|current| PolicyVersion(pointer.version) < current);
            let run = match (below, self.below) {
                (false, _) => None,
                (true, Some((n, last))) if pointer.version > last => Some((n.saturating_add(1), pointer.version)),
                (true, _) => Some((1, pointer.version)),
            };
            self.below = run;
            rewind = run.is_some_and(|(n, _)| n >= REWIND_AFTER_WRITES);
            if !rewind {
                self.settled_write = write;
                self.retry = None;
                return Ok(newer(&self.newest));
            }
        } else {
            self.below = None;
        }
        // A pointer may move the follower forward by a bounded jump only (`MAX_VERSION_JUMP`).
        // And never beyond `PolicyVersion::MAX_PLAUSIBLE`, even as the first version.
        let jump = self.highest.map(|(highest, at)| (highest.0, max_version_jump(at.elapsed())));
        let (from, allowed) = jump.unwrap_or((0, PolicyVersion::MAX_PLAUSIBLE.0));
        if pointer.version > PolicyVersion::MAX_PLAUSIBLE.0 || pointer.version.saturating_sub(from) > allowed {
            self.settled_write = write;
            self.retry = None;
            self.refusals += 1;
            self.jumps_refused += 1;
            let reason = if pointer.version > PolicyVersion::MAX_PLAUSIBLE.0 {
                format!(
                    "weights v{} refused: beyond v{}, no learner's version",
                    pointer.version,
                    PolicyVersion::MAX_PLAUSIBLE.0
                )
            } else {
                format!(
                    "weights v{} refused: more than {allowed} versions above v{from}, the highest verified",
                    pointer.version
                )
            };
            return Err(self.refuse(&pointer, reason));
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
                if rewind {
                    self.rewinds += 1;
                    self.below = None;
                    // Jumps are measured from the learner's versions again, not the one left.
                    self.highest = Some((weights.version, Instant::now()));
                    warn!(version = pointer.version, held = ?held, "the learner keeps writing a lower version; going back to it");
                }
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

/// A pointer's base64 signature as bytes (`Err` when it is not 64 bytes of base64).
fn decode_signature(text: &str) -> Result<[u8; SIGNATURE_BYTES], ()> {
    let bytes = base64::engine::general_purpose::STANDARD.decode(text).map_err(|_| ())?;
    bytes.try_into().map_err(|_| ())
}
