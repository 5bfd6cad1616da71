//! The wire codec: every encoder and decoder of a serialized Volley type, and the one error
//! type they share.
//!
//! | type | encoding | decoder |
//! | --- | --- | --- |
//! | [`TrajectorySegment`] | envelope + bincode | [`decode_segment`], [`decode_segment_body`] |
//! | [`Weights`] | envelope + bincode | [`decode_weights`] |
//! | [`WorkItem`] | JSON with an XXH3-64 `checksum` field | [`decode_work_item`] |
//! | [`EpisodeSnapshot`] | `b"VLYE"` + XXH3-64 + bincode | [`decode_episode_snapshot`] |
//!
//! Every decoder takes untrusted bytes and returns a [`DecodeError`], never panics, and bounds
//! what it allocates. [`DecodeError::reason`] is a bounded label for metrics; a new failure
//! gets a new variant (and label) rather than a message inside an old one.

use super::{
    body_checksum, Envelope, MessageKind, TrajectorySegment, Weights, FORMAT_VERSION, HEADER_BYTES, MAGIC,
    MAX_MESSAGE_BYTES,
};
use crate::ids::IdError;
use crate::spec::RunSpec;
use crate::work::{EpisodeSnapshot, WorkItem};

/// Why a message was rejected.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum DecodeError {
    /// Shorter than the header, or truncated body.
    #[error("truncated message: {0}")]
    Truncated(String),
    /// The magic bytes are wrong: not a Volley message.
    #[error("bad magic {0:02x?}: not a volley message")]
    BadMagic([u8; 4]),
    /// A format version this build does not read: the sender is another build (mixed actor and
    /// learner images), so the message names the fix.
    #[error(
        "unsupported format version {got} (this build reads {FORMAT_VERSION}): sender and receiver are \
         different builds; run actors and learner from one build (on Kubernetes pin both images by \
         digest, docs/OPERATIONS.md)"
    )]
    WrongVersion {
        /// The version in the message.
        got: u16,
    },
    /// The kind byte names another message type.
    #[error("unexpected message kind {got} (expected {expected})")]
    WrongKind {
        /// The kind byte found.
        got: u8,
        /// The kind expected.
        expected: u8,
    },
    /// The body does not decode.
    #[error("malformed body: {0}")]
    Malformed(String),
    /// A field has the wrong number of elements.
    #[error("{field}: expected {expected} elements, got {got}")]
    Shape {
        /// Which field.
        field: &'static str,
        /// Expected length.
        expected: usize,
        /// Actual length.
        got: usize,
    },
    /// A float field holds NaN or ±inf.
    #[error("{field}: non-finite value at index {index}")]
    NonFinite {
        /// Which field.
        field: &'static str,
        /// First bad index.
        index: usize,
    },
    /// An action outside the action space.
    #[error("action {action} at step {step} out of range for {n_actions} actions")]
    ActionOutOfRange {
        /// The action.
        action: u32,
        /// The step.
        step: usize,
        /// Number of actions.
        n_actions: usize,
    },
    /// The message belongs to another run or architecture.
    #[error("{what} mismatch: message has {got}, run has {expected}")]
    Mismatch {
        /// What differs.
        what: &'static str,
        /// The message's value.
        got: String,
        /// The run's value.
        expected: String,
    },
    /// Checksum over the weights does not match.
    #[error("checksum mismatch: header {expected:016x}, computed {got:016x}")]
    Checksum {
        /// Checksum in the message.
        expected: u64,
        /// Checksum computed.
        got: u64,
    },
    /// Larger than the limit of its kind ([`MAX_MESSAGE_BYTES`] for envelope messages).
    #[error("message of {got_bytes} bytes exceeds the limit of {limit_bytes}")]
    TooLarge {
        /// The size.
        got_bytes: usize,
        /// The limit.
        limit_bytes: usize,
    },
    /// The body's checksum does not match the envelope's: corrupted in transit or at rest.
    #[error("corrupt message: envelope checksum {expected:016x}, body hashes to {got:016x}")]
    Corrupt {
        /// Checksum in the envelope.
        expected: u64,
        /// Checksum of the body received.
        got: u64,
    },
    /// An id (run or actor) of the wrong length or charset ([`crate::ids::IdError`]).
    #[error("{0}")]
    BadId(String),
    /// A finite value beyond the magnitude its field can honestly hold (issue 46: a recurrent
    /// state of 3e38 overflowed the learner's forward; weights of 3e38 the actor's).
    #[error("{field}: value {value} at index {index} exceeds the bound {bound}")]
    OutOfBounds {
        /// Which field.
        field: &'static str,
        /// First bad index.
        index: usize,
        /// The value.
        value: f32,
        /// The largest magnitude the field allows.
        bound: f32,
    },
}

impl DecodeError {
    /// Every value [`DecodeError::reason`] can return (metrics export each at 0 from the start).
    pub const REASONS: &'static [&'static str] = &[
        "truncated",
        "bad_magic",
        "wrong_version",
        "wrong_kind",
        "malformed",
        "shape",
        "non_finite",
        "action_out_of_range",
        "mismatch",
        "checksum",
        "too_large",
        "corrupt",
        "bad_id",
        "out_of_bounds",
    ];

    /// Bounded label for the `reason` of `…_rejected_total`; one of [`DecodeError::REASONS`].
    pub fn reason(&self) -> &'static str {
        match self {
            DecodeError::Truncated(_) => "truncated",
            DecodeError::BadMagic(_) => "bad_magic",
            DecodeError::WrongVersion { .. } => "wrong_version",
            DecodeError::WrongKind { .. } => "wrong_kind",
            DecodeError::Malformed(_) => "malformed",
            DecodeError::Shape { .. } => "shape",
            DecodeError::NonFinite { .. } => "non_finite",
            DecodeError::ActionOutOfRange { .. } => "action_out_of_range",
            DecodeError::Mismatch { .. } => "mismatch",
            DecodeError::Checksum { .. } => "checksum",
            DecodeError::TooLarge { .. } => "too_large",
            DecodeError::Corrupt { .. } => "corrupt",
            DecodeError::BadId(_) => "bad_id",
            DecodeError::OutOfBounds { .. } => "out_of_bounds",
        }
    }
}

/// bincode's writer for [`encode`]: appends to a `Vec` whose capacity is reserved up front.
struct AppendWriter<'a>(&'a mut Vec<u8>);

impl bincode::enc::write::Writer for AppendWriter<'_> {
    #[inline]
    fn write(&mut self, bytes: &[u8]) -> Result<(), bincode::error::EncodeError> {
        self.0.extend_from_slice(bytes);
        Ok(())
    }
}

/// Envelope and body. bincode appends the body to a buffer with room for `size_hint` bytes
/// reserved (a hint that falls short only costs the `Vec` growing). Nothing is zeroed first:
/// the bulk of a segment is its `f32` and byte columns, each one write of its bytes
/// ([`f32_bytes`](super::f32_bytes), format 7), so the few small writes per step cost less
/// than zeroing a buffer for a slice writer did (docs/benchmarks/distributed.md, "`f32` columns
/// as bytes").
fn encode<T: serde::Serialize>(kind: MessageKind, value: &T, size_hint: usize) -> Vec<u8> {
    let mut out = Vec::with_capacity(HEADER_BYTES + size_hint);
    encode_into(kind, value, &mut out);
    out
}

/// [`encode`] appending to `out` (what is already there is left as it is).
fn encode_into<T: serde::Serialize>(kind: MessageKind, value: &T, out: &mut Vec<u8>) {
    let start = out.len();
    out.extend_from_slice(&MAGIC);
    out.extend_from_slice(&FORMAT_VERSION.to_le_bytes());
    out.push(kind as u8);
    out.resize(start + HEADER_BYTES, 0);
    bincode::serde::encode_into_writer(value, AppendWriter(out), bincode::config::standard())
        .expect("plain data always encodes");
    let checksum = body_checksum(&out[start + HEADER_BYTES..]);
    out[start + 7..start + HEADER_BYTES].copy_from_slice(&checksum.to_le_bytes());
}

/// Read and check the envelope and the body's checksum, returning the body.
pub fn decode_envelope(bytes: &[u8], expected: MessageKind) -> Result<(Envelope, &[u8]), DecodeError> {
    let (envelope, body) = decode_envelope_unverified(bytes, expected)?;
    let got = body_checksum(body);
    if got != envelope.checksum {
        return Err(DecodeError::Corrupt { expected: envelope.checksum, got });
    }
    Ok((envelope, body))
}

/// [`decode_envelope`] without hashing the body: `Envelope::checksum` is what the envelope
/// claims, for a caller that hashes the body in a pass of its own (a full weights frame, whose
/// payload is hashed, parsed and hashed again for its digest in one pass) and must compare it.
pub(crate) fn decode_envelope_unverified(
    bytes: &[u8],
    expected: MessageKind,
) -> Result<(Envelope, &[u8]), DecodeError> {
    if bytes.len() > MAX_MESSAGE_BYTES {
        return Err(DecodeError::TooLarge { got_bytes: bytes.len(), limit_bytes: MAX_MESSAGE_BYTES });
    }
    // Field by field, each as soon as its bytes are there: a message that is not Volley's, or
    // of another format version (an older build's shorter header), says so however short.
    if let Some(magic) = bytes.first_chunk::<4>().filter(|magic| **magic != MAGIC) {
        return Err(DecodeError::BadMagic(*magic));
    }
    let format_version = match bytes.get(4..6) {
        Some(&[low, high]) => u16::from_le_bytes([low, high]),
        _ => FORMAT_VERSION,
    };
    if format_version != FORMAT_VERSION {
        return Err(DecodeError::WrongVersion { got: format_version });
    }
    if let Some(&kind) = bytes.get(6).filter(|&&kind| kind != expected as u8) {
        return Err(DecodeError::WrongKind { got: kind, expected: expected as u8 });
    }
    if bytes.len() < HEADER_BYTES {
        return Err(DecodeError::Truncated(format!("{} bytes, header needs {HEADER_BYTES}", bytes.len())));
    }
    let checksum = u64::from_le_bytes(bytes[7..HEADER_BYTES].try_into().expect("length checked above"));
    Ok((Envelope { format_version, kind: expected, checksum }, &bytes[HEADER_BYTES..]))
}

/// Decode a bincode body that must fill `body` exactly, allocating at most `LIMIT` bytes.
fn decode_body_limited<T: serde::de::DeserializeOwned, const LIMIT: usize>(body: &[u8]) -> Result<T, DecodeError> {
    let config = bincode::config::standard().with_limit::<LIMIT>();
    match bincode::serde::decode_from_slice::<T, _>(body, config) {
        Ok((value, used)) if used == body.len() => Ok(value),
        Ok((_, used)) => Err(DecodeError::Malformed(format!("{} trailing bytes", body.len() - used))),
        Err(bincode::error::DecodeError::UnexpectedEnd { additional }) => {
            Err(DecodeError::Truncated(format!("body needs {additional} more bytes")))
        }
        // A typed id refused its value in `Deserialize`; serde hands the error over as text.
        Err(bincode::error::DecodeError::OtherString(message)) if IdError::is_message(&message) => {
            Err(DecodeError::BadId(message))
        }
        Err(err) => Err(DecodeError::Malformed(err.to_string())),
    }
}

fn decode_body<T: serde::de::DeserializeOwned>(body: &[u8]) -> Result<T, DecodeError> {
    decode_body_limited::<T, MAX_MESSAGE_BYTES>(body)
}

/// Encode a segment with its envelope.
pub fn encode_segment(segment: &TrajectorySegment) -> Vec<u8> {
    encode(MessageKind::Segment, segment, segment_size_hint(segment))
}

/// [`encode_segment`] appending to `out`, e.g. a batch frame being built in place
/// ([`super::batch::FrameBuilder`]); the bytes appended are `encode_segment`'s exactly. It
/// reserves nothing itself: the caller sizes `out` (from [`segment_size_hint`] of the segments
/// it will hold), and a buffer that falls short grows as a `Vec` does.
pub fn encode_segment_into(segment: &TrajectorySegment, out: &mut Vec<u8>) {
    encode_into(MessageKind::Segment, segment, out);
}

/// Bytes to reserve for a segment's body: observations in their element type plus room for the per-step
/// columns and the ids; an unusual segment (long ids, many finished episodes) that does not
/// fit grows the buffer.
pub fn segment_size_hint(segment: &TrajectorySegment) -> usize {
    let steps = segment.rewards.len();
    segment.observations.size_bytes() + 4 * segment.continuous_actions.len() + 64 * steps + 1024
}

/// Decode a segment and validate it against the run spec.
///
/// ```
/// # use volley_core::wire::{decode_segment, DecodeError};
/// # fn check(spec: &volley_core::spec::RunSpec) {
/// let err = decode_segment(b"garbage", spec, 0, 0).unwrap_err();
/// assert_eq!(err.reason(), "bad_magic");
/// # }
/// ```
pub fn decode_segment(
    bytes: &[u8],
    spec: &RunSpec,
    layout_hash: u64,
    hidden_size: usize,
) -> Result<TrajectorySegment, DecodeError> {
    let segment = decode_segment_body(bytes)?;
    segment.validate(spec, layout_hash, hidden_size)?;
    Ok(segment)
}

/// Decode a segment's envelope and body without validating it against a run spec.
///
/// Transports use this (they do not know the spec); the learner validates afterwards with
/// [`TrajectorySegment::validate`]. [`decode_segment`] is this plus that validation.
///
/// ```
/// # use volley_core::wire::decode_segment_body;
/// assert_eq!(decode_segment_body(b"VLL").unwrap_err().reason(), "truncated");
/// ```
pub fn decode_segment_body(bytes: &[u8]) -> Result<TrajectorySegment, DecodeError> {
    let (_, body) = decode_envelope(bytes, MessageKind::Segment)?;
    decode_body(body)
}

/// Encode weights with their envelope.
pub fn encode_weights(weights: &Weights) -> Vec<u8> {
    encode(MessageKind::Weights, weights, 4 * weights.params.len() + 64)
}

/// Decode weights and verify layout and checksum.
pub fn decode_weights(bytes: &[u8], layout_hash: u64, n_params: usize) -> Result<Weights, DecodeError> {
    let (_, body) = decode_envelope(bytes, MessageKind::Weights)?;
    let weights: Weights = decode_body(body)?;
    weights.verify(layout_hash, n_params)?;
    Ok(weights)
}

/// A work item as the work queue carries it: the item's fields plus `checksum`, the XXH3-64
/// (hex) of the item's own JSON encoding, so a corrupted item is refused (docs/SECURITY.md).
#[derive(serde::Serialize, serde::Deserialize)]
struct SealedWorkItem {
    #[serde(flatten)]
    item: WorkItem,
    checksum: String,
}

/// Largest work-queue message accepted (64 KiB; an item is well under 1 KiB).
pub const MAX_WORK_ITEM_BYTES: usize = 64 << 10;

fn work_item_checksum(item: &WorkItem) -> String {
    let json = serde_json::to_vec(item).expect("a work item always serializes");
    format!("{:016x}", body_checksum(&json))
}

/// JSON, the work queue's message body (readable with `nats stream view`), with the item's
/// checksum.
pub fn encode_work_item(item: &WorkItem) -> Vec<u8> {
    let sealed = SealedWorkItem { item: item.clone(), checksum: work_item_checksum(item) };
    serde_json::to_vec(&sealed).expect("a work item always serializes")
}

/// Parse a work-queue message body and verify its checksum.
///
/// ```
/// # use volley_core::wire::decode_work_item;
/// assert_eq!(decode_work_item(b"{\"id\":1}").unwrap_err().reason(), "malformed");
/// ```
pub fn decode_work_item(bytes: &[u8]) -> Result<WorkItem, DecodeError> {
    if bytes.len() > MAX_WORK_ITEM_BYTES {
        return Err(DecodeError::TooLarge { got_bytes: bytes.len(), limit_bytes: MAX_WORK_ITEM_BYTES });
    }
    let sealed: SealedWorkItem = serde_json::from_slice(bytes).map_err(|err| match err.classify() {
        serde_json::error::Category::Eof => DecodeError::Truncated(format!("work item: {err}")),
        _ => DecodeError::Malformed(format!("work item: {err}")),
    })?;
    let computed = work_item_checksum(&sealed.item);
    if sealed.checksum != computed {
        // A claimed checksum that is not even hex reads as 0: it matches no item either.
        let claimed = u64::from_str_radix(&sealed.checksum, 16).unwrap_or(0);
        let computed = u64::from_str_radix(&computed, 16).expect("formatted as 16 hex digits above");
        return Err(DecodeError::Corrupt { expected: claimed, got: computed });
    }
    Ok(sealed.item)
}

/// Leading bytes of an encoded [`EpisodeSnapshot`].
const EPISODE_SNAPSHOT_MAGIC: [u8; 4] = *b"VLYE";
/// Largest encoded episode snapshot accepted (16 MiB).
pub const MAX_EPISODE_SNAPSHOT_BYTES: usize = 16 << 20;

/// `b"VLYE"`, the XXH3-64 of the body (8 bytes, little-endian), then the bincode body.
pub fn encode_episode_snapshot(snapshot: &EpisodeSnapshot) -> Vec<u8> {
    let body = bincode::serde::encode_to_vec(snapshot, bincode::config::standard()).expect("plain data always encodes");
    let mut bytes = EPISODE_SNAPSHOT_MAGIC.to_vec();
    bytes.extend_from_slice(&body_checksum(&body).to_le_bytes());
    bytes.extend(body);
    bytes
}

/// Decode an episode snapshot from untrusted bytes (a snapshot store's object).
///
/// ```
/// # use volley_core::wire::decode_episode_snapshot;
/// assert_eq!(decode_episode_snapshot(b"VLYS....").unwrap_err().reason(), "bad_magic");
/// ```
pub fn decode_episode_snapshot(bytes: &[u8]) -> Result<EpisodeSnapshot, DecodeError> {
    if bytes.len() > MAX_EPISODE_SNAPSHOT_BYTES {
        return Err(DecodeError::TooLarge { got_bytes: bytes.len(), limit_bytes: MAX_EPISODE_SNAPSHOT_BYTES });
    }
    if let Some(magic) = bytes.first_chunk::<4>().filter(|magic| **magic != EPISODE_SNAPSHOT_MAGIC) {
        return Err(DecodeError::BadMagic(*magic));
    }
    let sealed = bytes
        .strip_prefix(&EPISODE_SNAPSHOT_MAGIC)
        .ok_or_else(|| DecodeError::Truncated(format!("episode snapshot of {} bytes, header needs 12", bytes.len())))?;
    let (checksum, body) = sealed
        .split_first_chunk::<8>()
        .ok_or_else(|| DecodeError::Truncated(format!("episode snapshot of {} bytes, header needs 12", bytes.len())))?;
    let (expected, got) = (u64::from_le_bytes(*checksum), body_checksum(body));
    if expected != got {
        return Err(DecodeError::Corrupt { expected, got });
    }
    let snapshot: EpisodeSnapshot = decode_body_limited::<_, MAX_EPISODE_SNAPSHOT_BYTES>(body)?;
    if !snapshot.episode_return.is_finite() {
        return Err(DecodeError::NonFinite { field: "episode_return", index: 0 });
    }
    if let Some(index) = super::first_non_finite(&snapshot.hidden) {
        return Err(DecodeError::NonFinite { field: "hidden", index });
    }
    Ok(snapshot)
}

#[cfg(test)]
mod encode_tests {
    use super::*;
    use crate::wire::{test_segment, Observations};

    #[test]
    fn a_short_size_hint_falls_back_to_the_same_bytes() {
        let mut segment = test_segment("hint", 32, 480, 3);
        segment.observations = Observations::F32((0..33 * 480).map(|i| i as f32 * 0.25).collect());
        let sized = encode_segment(&segment);
        for hint in [0, 100, 5_000] {
            assert_eq!(encode(MessageKind::Segment, &segment, hint), sized, "hint {hint}");
        }
        assert_eq!(decode_segment_body(&sized).expect("decodes"), segment);
    }

    #[test]
    fn encoding_into_a_buffer_appends_the_same_bytes() {
        let segment = test_segment("into", 8, 4, 1);
        let mut out = b"before".to_vec();
        encode_segment_into(&segment, &mut out);
        assert_eq!(&out[..6], b"before");
        assert_eq!(out[6..], encode_segment(&segment));
    }
}
