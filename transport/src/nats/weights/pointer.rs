//! The `weights` pointer in the run's KV bucket (what the newest version is and how to rebuild
//! it), the bounds a follower holds it to, and the background reader that keeps the newest
//! pointer written (direct gets, woken by notices on the key's subject).

use std::collections::VecDeque;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use async_nats::jetstream::{self, kv};
use futures::StreamExt;
use tracing::{debug, info, warn};
use volley_core::ids::PolicyVersion;
use volley_core::subjects;
use volley_core::wire;

use crate::nats::run::open_kv;
use crate::nats::{call, Backoff};
use crate::rejection_log::RejectionLog;
use crate::TransportError;

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
pub(super) struct WeightsPointer {
    pub(super) version: u64,
    /// The version the newest delta applies to (`None` for an anchor).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub(super) parent: Option<u64>,
    pub(super) anchor: u64,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub(super) deltas: Vec<u64>,
    /// [`wire::checksum`] of the parameters of `version` (XXH3-64), hex.
    pub(super) digest: String,
    pub(super) layout_hash: String,
    /// Bytes of this version's frame.
    pub(super) size_bytes: u64,
    /// The full frame of `version`, base64 (small weights only).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub(super) inline: Option<String>,
    /// The publisher writes the pointer at least every this many versions; the versions in
    /// between travel by the live path only ([`NatsConfig::weights_pointer_every`](crate::nats::NatsConfig::weights_pointer_every)). Followers
    /// take a live version at most this many plus one versions above the pointer
    /// ([`live_lead`]). Absent (1) from publishers that write every version.
    #[serde(default = "one", skip_serializing_if = "is_one")]
    pub(super) pointer_every: u64,
    /// The learner's Ed25519 signature of `version` ([`crate::signing`]), base64; absent from
    /// a learner without a signing key.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub(super) signature: Option<String>,
}

fn one() -> u64 {
    1
}

fn is_one(n: &u64) -> bool {
    *n == 1
}

/// Largest pointer interval a follower honours ([`NatsConfig::weights_pointer_every`](crate::nats::NatsConfig::weights_pointer_every) is
/// checked against it; a pointer claiming more is taken as claiming this).
pub const MAX_POINTER_EVERY: u64 = 64;

/// How far a live version may run ahead of the pointer written last, for a pointer written at
/// least every `pointer_every` versions: up to `pointer_every - 1` versions travel live
/// between two pointers, the next version's pointer is written after that version is sent
/// live, and one more leaves room for a pointer read that lags. A live version further ahead waits
/// (at most [`LIVE_FRAMES_KEPT`](super::live::LIVE_FRAMES_KEPT) of them) until the pointer catches up, so a forged live
/// version cannot claim a version far above the learner's and make the follower ignore the
/// real ones.
pub(super) fn live_lead(pointer_every: u64) -> u64 {
    pointer_interval(pointer_every) + 1
}

/// A pointer interval as honoured: at least 1, at most [`MAX_POINTER_EVERY`] (a configured
/// one, or what a pointer claims).
pub(super) fn pointer_interval(pointer_every: u64) -> u64 {
    pointer_every.clamp(1, MAX_POINTER_EVERY)
}

/// Versions a pointer may take a follower past the highest version it verified, plus
/// [`MAX_VERSIONS_PER_SEC`] for every second since it last verified one ([`max_version_jump`]).
/// Issue 46: a well-formed pointer to a real frame relabelled +10⁶, or to version 2⁶⁴ − 1, was
/// adopted, every later (lower) honest version was ignored, and every segment the actors sent
/// was refused as a future version until they restarted. An honest learner moves the pointer
/// by one version per update (by its pointer interval, at most [`MAX_POINTER_EVERY`]), so a
/// follower that keeps up sees small steps; one that was cut off for a while may jump by what
/// the learner can have published meanwhile.
pub const MAX_VERSION_JUMP: u64 = 4096;

/// Versions per second a learner is assumed able to publish at most, for the jump a follower
/// allows after a pause ([`MAX_VERSION_JUMP`]); far above any measured update rate.
pub const MAX_VERSIONS_PER_SEC: u64 = 10_000;

/// Consecutive pointer writes below the version a follower holds, each above the one before,
/// after which it takes the newest of them (see [`NatsWeightsFollower`](super::NatsWeightsFollower)): an honest learner
/// never writes a lower version than it wrote before, so a run of them means the version held
/// was not the learner's, or the learner restarted below it (issue 46: restarting the learner
/// did not recover actors stuck on a forged version).
pub const REWIND_AFTER_WRITES: u32 = 3;

/// Whether a learner that resumes at `resumed` (from a checkpoint `checkpoint_age` old, or from
/// nothing) continues above the run's `published` version, as it does to keep versions going
/// forward across restarts. Not above one a learner cannot have published: beyond
/// [`PolicyVersion::MAX_PLAUSIBLE`], or further above the checkpoint than [`max_version_jump`] of
/// its age. Issue 46: after a forged pointer far ahead, a restarted learner continued above
/// it, or could not (2⁶⁴ − 1) and was then ignored as older by every actor; keeping its own
/// version, its pointers take followers back ([`REWIND_AFTER_WRITES`]).
pub fn continue_above_published(
    published: PolicyVersion,
    resumed: PolicyVersion,
    checkpoint_age: Option<Duration>,
) -> bool {
    published <= PolicyVersion::MAX_PLAUSIBLE
        && checkpoint_age.is_none_or(|age| published.0.saturating_sub(resumed.0) <= max_version_jump(age))
}

/// The largest forward jump in versions a follower (or a restarting learner, against its
/// checkpoint) takes after `since_verified` without a verified version: [`MAX_VERSION_JUMP`]
/// plus [`MAX_VERSIONS_PER_SEC`] per second.
pub fn max_version_jump(since_verified: Duration) -> u64 {
    MAX_VERSION_JUMP.saturating_add(MAX_VERSIONS_PER_SEC.saturating_mul(since_verified.as_secs()))
}

/// Longest delta chain a pointer may list (a pointer listing more is refused): far above any
/// sensible anchor interval, and it bounds the fetches one pointer can cause.
const MAX_CHAIN: usize = 1024;

impl WeightsPointer {
    /// The newest version that may have been published when this pointer was the last one
    /// written: versions after it travel live only until the next pointer is due.
    pub(super) fn newest_possible(&self) -> u64 {
        self.version.saturating_add(pointer_interval(self.pointer_every) - 1)
    }

    /// Check the chain arithmetic: `deltas` strictly ascending above `anchor`, ending at
    /// `version`, `parent` the entry before the last; an anchor has neither. Comparisons only,
    /// no arithmetic, so a forged `u64::MAX` cannot overflow anything.
    pub(super) fn check_chain(&self) -> Result<(), String> {
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
    pub(super) fn plan(&self, have: Option<PolicyVersion>) -> (bool, Vec<String>) {
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

pub(super) async fn read_pointer(kv: &kv::Store, timeout: Duration) -> Result<Option<WeightsPointer>, TransportError> {
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
pub(super) fn is_weights_object(name: &str) -> bool {
    name.len() == 21
        && (name.starts_with('v') || name.starts_with('d'))
        && name[1..].bytes().all(|b| b.is_ascii_digit())
}

/// Bytes of the full frame of `n_params` parameters (whether weights go inline, the largest
/// frame a follower accepts).
pub(super) fn full_frame_bytes(n_params: usize) -> usize {
    wire::HEADER_BYTES + wire::frame::FRAME_HEADER_BYTES + 4 * n_params
}

/// The pointer most recently written to KV, as the follower's reads found it.
///
/// Not the highest version ever announced: a forged pointer with a huge version must not
/// hide the real pointers written after it (issue 12, docs/SECURITY.md). Whether a pointer
/// is worth fetching is the follower's decision, against the newest version it verified.
#[derive(Debug, Default)]
pub(super) struct PointerSlot {
    /// The pointer and its write number (1 = the first read).
    pub(super) pointer: Mutex<Option<(WeightsPointer, u64)>>,
    /// Writes seen (0 = none yet): lets `latest` answer "nothing new" with one load.
    pub(super) writes: AtomicU64,
    pub(super) changed: tokio::sync::Notify,
}

impl PointerSlot {
    pub(super) fn offer(&self, pointer: WeightsPointer) {
        let mut slot = self.pointer.lock().expect("pointer lock is never poisoned");
        // The current value read again (after a reconnect, say): not a new write.
        if slot.as_ref().is_some_and(|(current, _)| *current == pointer) {
            return;
        }
        debug!(version = pointer.version, "new weights pointer");
        let write = self.writes.load(Ordering::Acquire).saturating_add(1);
        *slot = Some((pointer, write));
        self.writes.store(write, Ordering::Release);
        self.changed.notify_waiters();
    }

    pub(super) fn newest(&self) -> Option<(WeightsPointer, u64)> {
        self.pointer.lock().expect("pointer lock is never poisoned").clone()
    }
}

/// First pause before fetching an unfetchable pointer (missing object, timeout) again.
pub(super) const FETCH_RETRY_FIRST: Duration = Duration::from_millis(250);
/// Longest pause between fetches of an unfetchable pointer.
pub(super) const FETCH_RETRY_MAX: Duration = Duration::from_secs(30);

/// How long a follower goes without reading the pointer when no notice of a write came: the
/// bound on how late it sees a version whose notice was lost (a reconnect, a notice dropped by
/// a slow subscription).
pub(super) const POINTER_REREAD: Duration = Duration::from_secs(1);

/// Notices taken at once before one read: a burst of writes (or of messages relayed onto the
/// key's subject) costs one read of the pointer, not one per message.
const NOTICES_PER_READ: usize = 1024;

/// Pointer values a follower remembers having judged: a read that returns one of them (a
/// periodic read of an unchanged key, or a get that raced a newer write it already took from
/// a notice) is not a new write.
const RECENT_VALUES: usize = 8;

/// Keep `slot` at the newest `weights` pointer, with no consumer (issue 46: the actor user may
/// create none, as its deliver subject could be any subject): read the key by direct get
/// (`$JS.API.DIRECT.GET.KV_<bucket>.$KV.<bucket>.weights`, the last message on it), and read
/// it again when a message arrives on the key's subject (a core-NATS subscription to
/// `$KV.<bucket>.weights`, where the learner's put goes), after a reconnect, and at least every
/// [`POINTER_REREAD`].
///
/// The learner's put itself arrives as the notice, so the notice's body is taken at once, as a
/// pointer read from the bucket would be (the follower judges every pointer the same way:
/// layout, chain, size, digest, signature, version bounds); waiting for the get's answer would
/// let the live path run a version ahead of every pointer, which looks like the learner
/// writing lower versions. A notice with headers or a status (the answer to a get that an actor
/// sent there; a client put carries neither) only causes the read.
pub(super) async fn follow_pointer(
    js: jetstream::Context,
    client: async_nats::Client,
    bucket: String,
    timeout: Duration,
    slot: Arc<PointerSlot>,
    mut connections: tokio::sync::watch::Receiver<u64>,
) {
    // Subscribed before the first read, so no write after that read goes unnoticed. The
    // subscription outlives reconnects (the client subscribes again by itself); one denied
    // by a broker config that predates it leaves the periodic reads.
    let notice_subject = subjects::kv_key_subject(&bucket, subjects::WEIGHTS_KEY);
    let mut notices = match client.subscribe(notice_subject).await {
        Ok(notices) => Some(notices),
        Err(err) => {
            warn!(operation = "subscribe to weights notices", %err, "reading the weights pointer periodically only");
            None
        }
    };
    let mut backoff = Backoff::new();
    let mut values = PointerValues { recent: VecDeque::new(), rejections: RejectionLog::new("weights pointer") };
    let mut store: Option<kv::Store> = None;
    loop {
        connections.borrow_and_update();
        let read = async {
            if store.is_none() {
                store = open_kv(&js, &bucket, timeout).await?;
            }
            let Some(kv) = &store else {
                return Err(TransportError::Failed {
                    operation: "read weights pointer",
                    message: format!("bucket {bucket} does not exist yet"),
                });
            };
            call("read weights pointer", timeout, kv.entry(subjects::WEIGHTS_KEY)).await
        };
        let pause = match read.await {
            Ok(entry) => {
                backoff = Backoff::new();
                // A delete or purge leaves the pointer held.
                if let Some(entry) = entry.filter(|entry| entry.operation == kv::Operation::Put) {
                    values.judge(&entry.value, &slot);
                }
                POINTER_REREAD
            }
            Err(err) => {
                debug!(operation = "read weights pointer", %err, "retrying");
                backoff.next()
            }
        };
        let notice = async {
            match notices.as_mut() {
                Some(notices) => notices.next().await,
                None => std::future::pending().await,
            }
        };
        tokio::select! {
            _ = tokio::time::sleep(pause) => {}
            received = notice => match received {
                Some(first) => {
                    // Writes that arrived together need one read; the newest is taken now.
                    let mut newest = first;
                    if let Some(notices) = notices.as_mut() {
                        for _ in 0..NOTICES_PER_READ {
                            match futures::FutureExt::now_or_never(notices.next()).flatten() {
                                Some(next) => newest = next,
                                None => break,
                            }
                        }
                    }
                    if newest.headers.is_none() && newest.status.is_none() {
                        values.judge(&newest.payload, &slot);
                    }
                }
                // The client is going away.
                None => return,
            },
            changed = connections.changed() => {
                if changed.is_err() {
                    return;
                }
                info!("reconnected; reading the weights pointer again");
            }
        }
    }
}

/// What [`follow_pointer`] has read lately.
struct PointerValues {
    /// The last [`RECENT_VALUES`] values judged, newest last.
    recent: VecDeque<bytes::Bytes>,
    rejections: RejectionLog,
}

impl PointerValues {
    /// Offer `value` to `slot` as the pointer written last, unless it was judged lately.
    fn judge(&mut self, value: &bytes::Bytes, slot: &PointerSlot) {
        if self.recent.contains(value) {
            return;
        }
        if self.recent.len() >= RECENT_VALUES {
            self.recent.pop_front();
        }
        self.recent.push_back(value.clone());
        match serde_json::from_slice::<WeightsPointer>(value) {
            Ok(pointer) => slot.offer(pointer),
            Err(err) => {
                if self.rejections.record("undecodable") {
                    warn!(operation = "decode weights pointer", error = %err, "ignoring bad weights pointer");
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    /// Issue 46: a restarting learner continues above what the run published, but not above a
    /// version no learner can have published since its checkpoint, nor beyond the plausible.
    #[test]
    fn a_restarting_learner_continues_above_plausible_published_versions_only() {
        use super::{continue_above_published, max_version_jump};
        use volley_core::ids::PolicyVersion as V;
        let minute = Some(Duration::from_secs(60));
        assert!(continue_above_published(V(5_000), V(4_000), minute));
        assert!(continue_above_published(V(4_000 + max_version_jump(Duration::from_secs(60))), V(4_000), minute));
        assert!(!continue_above_published(V(4_001 + max_version_jump(Duration::from_secs(60))), V(4_000), minute));
        assert!(!continue_above_published(V(1_000_000_000), V(4_000), minute));
        // Without a checkpoint there is nothing to measure against but the plausible bound.
        assert!(continue_above_published(V(1_000_000), V(0), None));
        assert!(continue_above_published(V::MAX_PLAUSIBLE, V(0), None));
        assert!(!continue_above_published(V(V::MAX_PLAUSIBLE.0 + 1), V(0), None));
        assert!(!continue_above_published(V(u64::MAX), V(0), None));
        assert!(!continue_above_published(V(u64::MAX), V(u64::MAX - 5), Some(Duration::from_secs(1 << 40))));
    }

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
            signature: None,
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
