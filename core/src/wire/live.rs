//! Live weights chunks: one version's [`super::frame`] cut into core-NATS messages for the
//! followers that are connected now (the *live* path), and their bounded reassembly.
//!
//! The durable path (object store and KV pointer) stays the source of truth; the live path
//! only gets a version to connected followers sooner (issue 16). A version travels live as
//! exactly the frame the object store gets (a full frame or a delta against its parent), cut
//! into chunks of at most `chunk_bytes` bytes. Each chunk is a message of its own:
//!
//! | bytes | field |
//! | --- | --- |
//! | 4 | magic `b"VLYW"` |
//! | 2 | live format version ([`LIVE_FORMAT_VERSION`], little-endian) |
//! | 8 | version the frame produces |
//! | 8 | parent version (`u64::MAX` for a full frame) |
//! | 8 | layout hash |
//! | 8 | digest of the parameters the frame produces ([`super::checksum`], as in the pointer) |
//! | 8 | frame length in bytes |
//! | 4 | chunk length `c` (every chunk but the last carries exactly `c` bytes) |
//! | 4 | chunk index |
//! | 4 | chunk count (`⌈frame length / c⌉`) |
//! | 64 | Ed25519 signature of the version, all zero when unsigned (format 2) |
//! | 8 | XXH3-64 of every header byte above |
//! | … | the payload: frame bytes `index · c ..` |
//!
//! All integers little-endian. The header checksum catches a corrupted header on arrival,
//! before it can place bytes anywhere; the payload needs no checksum of its own, because the
//! reassembled frame's envelope checksum covers every payload byte and the digest of the
//! rebuilt parameters is checked after that (hashing 16 MiB once more per follower would cost
//! more than the fan-out saves on a busy machine). None of these checksums proves who sent the
//! chunks: authenticity comes from the signature, which the learner makes over the version
//! it rebuilds (`volley_transport::signing`; every chunk of a version carries the same one,
//! and the follower checks it after rebuilding the parameters), and from broker permissions
//! (only the learner may publish on the live subject, as only it may write the pointer;
//! docs/SECURITY.md).
//!
//! [`LiveAssembler`] follows the hostile-input rule: everything it holds is bounded by what
//! the follower knows, never by what a chunk claims. At most [`MAX_ASSEMBLING`] versions are
//! assembled at once, each at most the size of a full frame of the follower's layout, so a
//! follower holds at most `MAX_ASSEMBLING` full frames of partial versions, whatever it is sent
//! (and one spare buffer of at most that size, a finished frame's given back for reuse).

use super::frame::FrameHeader;
use super::{body_checksum, check_format, DecodeError, Weights, MAX_MESSAGE_BYTES};
use crate::ids::PolicyVersion;

/// First bytes of a live chunk.
pub const LIVE_MAGIC: [u8; 4] = *b"VLYW";

/// Version of the chunk layout (the frame inside carries the wire format version itself).
pub const LIVE_FORMAT_VERSION: u16 = 2;

/// Bytes of a chunk's header, checksum included.
pub const CHUNK_HEADER_BYTES: usize = 4 + 2 + 5 * 8 + 3 * 4 + SIGNATURE_BYTES + 8;

/// Bytes of the signature field of a chunk's header.
pub const SIGNATURE_BYTES: usize = 64;

/// Versions a [`LiveAssembler`] assembles at once; a chunk of another version evicts the one
/// fed least recently when this many are open (completing a version drops the older ones).
pub const MAX_ASSEMBLING: usize = 2;

/// The most chunks one frame may be cut into (a frame of 64 MiB in 1 KiB chunks).
pub const MAX_CHUNKS: u32 = 1 << 16;

const NO_PARENT: u64 = u64::MAX;

/// What one chunk says about itself and its frame.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ChunkHeader {
    /// The version the frame produces.
    pub version: PolicyVersion,
    /// The version a delta applies to; `None` for a full frame.
    pub parent: Option<PolicyVersion>,
    /// Architecture hash of the layout.
    pub layout_hash: u64,
    /// [`super::checksum`] of the parameters the frame produces: the pointer's digest.
    pub digest: u64,
    /// Length of the whole frame in bytes.
    pub frame_len: u64,
    /// Payload bytes of every chunk but the last.
    pub chunk_bytes: u32,
    /// This chunk's position, `0..count`.
    pub index: u32,
    /// Chunks of the frame.
    pub count: u32,
    /// The version's signature (`None`: the field was all zero, unsigned). Checked by the
    /// follower against the rebuilt parameters, not here.
    pub signature: Option<[u8; SIGNATURE_BYTES]>,
}

impl ChunkHeader {
    /// Whether two chunks describe the same frame (everything but the index).
    fn same_frame(&self, other: &ChunkHeader) -> bool {
        ChunkHeader { index: 0, ..*self } == ChunkHeader { index: 0, ..*other }
    }
}

/// Cut `frame` (described by `header`, which the publisher built with the frame) into live
/// chunks of at most `chunk_bytes` payload bytes each (at least one chunk).
///
/// # Panics
/// If `chunk_bytes` is 0 or the frame needs more than [`MAX_CHUNKS`] chunks of it: the
/// publisher sizes chunks from the server's `max_payload`.
pub fn encode_live_chunks(frame: &[u8], header: &FrameHeader, chunk_bytes: usize) -> Vec<Vec<u8>> {
    encode_signed_live_chunks(frame, header, None, chunk_bytes)
}

/// [`encode_live_chunks`] with the version's `signature` in every chunk's header.
///
/// # Panics
/// As [`encode_live_chunks`].
pub fn encode_signed_live_chunks(
    frame: &[u8],
    header: &FrameHeader,
    signature: Option<&[u8; SIGNATURE_BYTES]>,
    chunk_bytes: usize,
) -> Vec<Vec<u8>> {
    let count = chunk_count(frame.len(), chunk_bytes);
    let mut parts: Vec<&[u8]> = frame.chunks(chunk_bytes).collect();
    if parts.is_empty() {
        parts.push(&[]);
    }
    parts
        .into_iter()
        .enumerate()
        .map(|(index, payload)| {
            let mut out = chunk_start(header, signature, frame.len(), chunk_bytes, index, count);
            out.extend_from_slice(payload);
            out
        })
        .collect()
}

/// The live chunks of `weights`' full frame, as [`encode_live_chunks`] cuts the frame
/// [`super::frame::encode_full_frame`] encodes, written straight into the chunks: one pass over
/// the parameters that copies them once and computes the frame's envelope checksum and their
/// digest as it goes (issue 16: encoding the frame, hashing its payload again to check the
/// digest, then copying it into chunks took three passes over 16 MiB before the first chunk
/// went out). Returns the chunks and the digest of the parameters as encoded, for the caller to
/// compare with `weights.checksum` (a mismatch means the parameters changed after it was taken).
///
/// # Panics
/// As [`encode_live_chunks`].
pub fn encode_full_frame_chunks(weights: &Weights, chunk_bytes: usize) -> (Vec<Vec<u8>>, u64) {
    encode_signed_full_frame_chunks(weights, None, chunk_bytes)
}

/// [`encode_full_frame_chunks`] with the version's `signature` in every chunk's header.
///
/// # Panics
/// As [`encode_live_chunks`].
pub fn encode_signed_full_frame_chunks(
    weights: &Weights,
    signature: Option<&[u8; SIGNATURE_BYTES]>,
    chunk_bytes: usize,
) -> (Vec<Vec<u8>>, u64) {
    use xxhash_rust::xxh3::Xxh3Default;
    let head = super::frame::full_frame_head(weights);
    let frame_len = head.len() + 4 * weights.params.len();
    let count = chunk_count(frame_len, chunk_bytes);
    let header = FrameHeader::of_full(weights);
    let mut chunks: Vec<Vec<u8>> =
        (0..count).map(|index| chunk_start(&header, signature, frame_len, chunk_bytes, index, count)).collect();
    // Appends frame bytes in order, each chunk taking `chunk_bytes` of them.
    let mut at = 0;
    let mut write = |mut bytes: &[u8]| {
        while !bytes.is_empty() {
            let room = chunk_bytes - at % chunk_bytes;
            let (now, rest) = bytes.split_at(room.min(bytes.len()));
            chunks[at / chunk_bytes].extend_from_slice(now);
            at += now.len();
            bytes = rest;
        }
    };
    let mut envelope = Xxh3Default::new();
    let mut digest = Xxh3Default::new();
    write(&head);
    envelope.update(&head[super::HEADER_BYTES..]);
    super::for_le_blocks(&weights.params, |bytes| {
        envelope.update(bytes);
        digest.update(bytes);
        write(bytes);
    });
    for (at, byte) in super::frame::CHECKSUM_AT.zip(envelope.digest().to_le_bytes()) {
        chunks[at / chunk_bytes][CHUNK_HEADER_BYTES + at % chunk_bytes] = byte;
    }
    (chunks, digest.digest())
}

/// Chunks of `chunk_bytes` for a frame of `frame_len` bytes (at least one).
fn chunk_count(frame_len: usize, chunk_bytes: usize) -> usize {
    assert!(chunk_bytes > 0 && chunk_bytes <= u32::MAX as usize, "chunk length {chunk_bytes} out of range");
    let count = frame_len.div_ceil(chunk_bytes).max(1);
    assert!(count <= MAX_CHUNKS as usize, "a frame of {frame_len} bytes in {chunk_bytes}-byte chunks");
    count
}

/// A chunk's header, checksum included: the payload follows.
fn chunk_start(
    header: &FrameHeader,
    signature: Option<&[u8; SIGNATURE_BYTES]>,
    frame_len: usize,
    chunk_bytes: usize,
    index: usize,
    count: usize,
) -> Vec<u8> {
    let mut out =
        Vec::with_capacity(CHUNK_HEADER_BYTES + frame_len.saturating_sub(index * chunk_bytes).min(chunk_bytes));
    out.extend_from_slice(&LIVE_MAGIC);
    out.extend_from_slice(&LIVE_FORMAT_VERSION.to_le_bytes());
    for field in [
        header.version.0,
        header.parent.map_or(NO_PARENT, |p| p.0),
        header.layout_hash,
        header.digest,
        frame_len as u64,
    ] {
        out.extend_from_slice(&field.to_le_bytes());
    }
    for field in [chunk_bytes as u32, index as u32, count as u32] {
        out.extend_from_slice(&field.to_le_bytes());
    }
    out.extend_from_slice(signature.unwrap_or(&[0; SIGNATURE_BYTES]));
    let checksum = body_checksum(&out);
    out.extend_from_slice(&checksum.to_le_bytes());
    out
}

/// Check a chunk (magic, version, checksum, and that index, count, lengths add up) and return
/// its header and payload. Comparisons and checked arithmetic only: no claimed length is
/// trusted for anything but comparing.
pub fn decode_live_chunk(bytes: &[u8]) -> Result<(ChunkHeader, &[u8]), DecodeError> {
    let Some((head, payload)) = bytes.split_first_chunk::<CHUNK_HEADER_BYTES>() else {
        return Err(DecodeError::Truncated(format!("{} bytes, a live chunk needs {CHUNK_HEADER_BYTES}", bytes.len())));
    };
    check_format(head.first_chunk().expect("6 bytes"), LIVE_MAGIC, LIVE_FORMAT_VERSION, "live chunk")?;
    let u64_at = |at: usize| u64::from_le_bytes(head[at..at + 8].try_into().expect("8 bytes"));
    let u32_at = |at: usize| u32::from_le_bytes(head[at..at + 4].try_into().expect("4 bytes"));
    let sealed = CHUNK_HEADER_BYTES - 8;
    let expected = u64_at(sealed);
    let got = body_checksum(&head[..sealed]);
    if got != expected {
        return Err(DecodeError::Corrupt { expected, got });
    }
    let header = ChunkHeader {
        version: PolicyVersion(u64_at(6)),
        parent: match u64_at(14) {
            NO_PARENT => None,
            parent => Some(PolicyVersion(parent)),
        },
        layout_hash: u64_at(22),
        digest: u64_at(30),
        frame_len: u64_at(38),
        chunk_bytes: u32_at(46),
        index: u32_at(50),
        count: u32_at(54),
        signature: {
            let signature: [u8; SIGNATURE_BYTES] = head[58..58 + SIGNATURE_BYTES].try_into().expect("64 bytes");
            (signature != [0; SIGNATURE_BYTES]).then_some(signature)
        },
    };
    if header.frame_len > MAX_MESSAGE_BYTES as u64 {
        return Err(DecodeError::TooLarge { got_bytes: header.frame_len as usize, limit_bytes: MAX_MESSAGE_BYTES });
    }
    if header.chunk_bytes == 0 || header.count == 0 || header.count > MAX_CHUNKS || header.index >= header.count {
        return Err(DecodeError::Malformed(format!(
            "chunk {} of {} ({} bytes each)",
            header.index, header.count, header.chunk_bytes
        )));
    }
    // Both fit in u64 (count ≤ 2¹⁶, chunk_bytes < 2³²), so no overflow.
    let chunk = u64::from(header.chunk_bytes);
    let count = header.frame_len.div_ceil(chunk).max(1);
    if count != u64::from(header.count) {
        return Err(DecodeError::Malformed(format!(
            "{} chunks claimed for {} bytes in chunks of {chunk}",
            header.count, header.frame_len
        )));
    }
    let offset = u64::from(header.index) * chunk;
    let expected_len = header.frame_len.saturating_sub(offset).min(chunk);
    if payload.len() as u64 != expected_len {
        return Err(DecodeError::Shape { field: "live chunk", expected: expected_len as usize, got: payload.len() });
    }
    if let Some(parent) = header.parent {
        if parent >= header.version {
            return Err(DecodeError::Malformed(format!("delta {} against the later {parent}", header.version)));
        }
    }
    Ok((header, payload))
}

/// A reassembled frame: its chunks' header (index 0) and its bytes, not yet decoded.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LiveFrame {
    /// What the chunks said about the frame.
    pub header: ChunkHeader,
    /// The frame, for [`super::frame::decode_frame`].
    pub bytes: Vec<u8>,
}

/// What happened to one chunk offered to a [`LiveAssembler`].
#[derive(Debug, Clone, PartialEq)]
pub enum Offered {
    /// Taken; its version is not complete yet.
    Pending,
    /// Taken, and it completed its version.
    Complete(LiveFrame),
    /// A valid chunk not worth keeping: a version already completed or older, or one already
    /// received (the same index twice).
    Stale,
    /// Refused (unreadable, corrupt, another layout, larger than a full frame, or
    /// inconsistent with the other chunks of its version, whose assembly is then dropped).
    Refused(DecodeError),
}

/// One version being assembled.
#[derive(Debug)]
struct Assembly {
    header: ChunkHeader,
    bytes: Vec<u8>,
    received: Vec<bool>,
    missing: usize,
    /// When it last took a chunk (the assembler's chunk count): the least recently fed
    /// assembly is the one evicted, so versions that are no longer sent make room.
    touched: u64,
}

/// Reassembles live chunks into frames, within fixed bounds (see the module docs).
#[derive(Debug)]
pub struct LiveAssembler {
    layout_hash: u64,
    max_frame_bytes: usize,
    assembling: Vec<Assembly>,
    /// The version completed last: its chunks are stale (a re-sent chunk must not start it
    /// again). Only that one version: a forged far-future version must not make the real
    /// ones stale.
    completed: Option<PolicyVersion>,
    /// Chunks taken so far (the clock of [`Assembly::touched`]).
    taken: u64,
    /// Incomplete versions dropped (evicted by newer ones or refused midway).
    dropped: u64,
    /// A finished frame's buffer given back ([`LiveAssembler::recycle`]), reused for the next
    /// version so a large frame does not fault in fresh pages every version.
    spare: Vec<u8>,
}

impl LiveAssembler {
    /// An assembler for frames of layout `layout_hash` of at most `max_frame_bytes` bytes (the
    /// size of a full frame of the follower's layout).
    pub fn new(layout_hash: u64, max_frame_bytes: usize) -> Self {
        LiveAssembler {
            layout_hash,
            max_frame_bytes: max_frame_bytes.min(MAX_MESSAGE_BYTES),
            assembling: Vec::with_capacity(MAX_ASSEMBLING),
            completed: None,
            taken: 0,
            dropped: 0,
            spare: Vec::new(),
        }
    }

    /// Give back the bytes of a frame this assembler completed, once decoded: the next
    /// version is assembled in them (one buffer is kept; it is never larger than the frame
    /// limit, so the bound on held bytes grows by one frame at most).
    /// Its bytes are kept as they are: every byte of a frame assembled into it is overwritten
    /// by a chunk before the frame completes (the chunks' lengths tile the frame exactly), so
    /// only a longer frame's tail needs zeroing.
    pub fn recycle(&mut self, bytes: Vec<u8>) {
        if bytes.capacity() <= self.max_frame_bytes && bytes.capacity() > self.spare.capacity() {
            self.spare = bytes;
        }
    }

    /// Incomplete versions dropped so far: evicted by a newer one, or refused midway.
    pub fn dropped(&self) -> u64 {
        self.dropped
    }

    /// Bytes held by versions being assembled (at most `MAX_ASSEMBLING` × the frame limit).
    pub fn held_bytes(&self) -> usize {
        self.assembling.iter().map(|a| a.bytes.len() + a.received.len()).sum()
    }

    /// Take one chunk message.
    pub fn offer(&mut self, message: &[u8]) -> Offered {
        let (header, payload) = match decode_live_chunk(message) {
            Ok(chunk) => chunk,
            Err(err) => return Offered::Refused(err),
        };
        if header.layout_hash != self.layout_hash {
            return Offered::Refused(DecodeError::Mismatch {
                what: "layout hash",
                got: format!("{:016x}", header.layout_hash),
                expected: format!("{:016x}", self.layout_hash),
            });
        }
        if header.frame_len > self.max_frame_bytes as u64 {
            return Offered::Refused(DecodeError::TooLarge {
                got_bytes: header.frame_len as usize,
                limit_bytes: self.max_frame_bytes,
            });
        }
        if self.completed == Some(header.version) {
            return Offered::Stale;
        }
        self.taken += 1;
        let at = match self.assembling.iter().position(|a| a.header.version == header.version) {
            Some(at) if !self.assembling[at].header.same_frame(&header) => {
                self.assembling.swap_remove(at);
                self.dropped += 1;
                return Offered::Refused(DecodeError::Mismatch {
                    what: "live chunk",
                    got: format!("{header:?}"),
                    expected: "the frame of the version's first chunk".to_string(),
                });
            }
            Some(at) => at,
            None => {
                if self.assembling.len() >= MAX_ASSEMBLING {
                    let idle = (0..self.assembling.len())
                        .min_by_key(|&at| self.assembling[at].touched)
                        .expect("at least one assembly");
                    self.assembling.swap_remove(idle);
                    self.dropped += 1;
                }
                // Bounded above: frame_len ≤ max_frame_bytes, count ≤ frame_len (or 1).
                // A recycled buffer is not zeroed first (16 MiB of `memset` per version in each
                // follower, issue 16): its old bytes are all overwritten before completion.
                let frame_len = header.frame_len as usize;
                let bytes = if self.spare.capacity() >= frame_len {
                    let mut bytes = std::mem::take(&mut self.spare);
                    bytes.truncate(frame_len);
                    bytes.resize(frame_len, 0);
                    bytes
                } else {
                    vec![0; frame_len]
                };
                self.assembling.push(Assembly {
                    header,
                    bytes,
                    received: vec![false; header.count as usize],
                    missing: header.count as usize,
                    touched: 0,
                });
                self.assembling.len() - 1
            }
        };
        let assembly = &mut self.assembling[at];
        assembly.touched = self.taken;
        let index = header.index as usize;
        if assembly.received[index] {
            return Offered::Stale;
        }
        let offset = index * header.chunk_bytes as usize;
        assembly.bytes[offset..offset + payload.len()].copy_from_slice(payload);
        assembly.received[index] = true;
        assembly.missing -= 1;
        if assembly.missing > 0 {
            return Offered::Pending;
        }
        let done = self.assembling.swap_remove(at);
        let version = done.header.version;
        let before = self.assembling.len();
        self.assembling.retain(|a| a.header.version > version);
        self.dropped += (before - self.assembling.len()) as u64;
        self.completed = Some(version);
        Offered::Complete(LiveFrame { header: ChunkHeader { index: 0, ..done.header }, bytes: done.bytes })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::wire::frame::{decode_frame, decode_frame_header, encode_delta_frame, encode_full_frame};
    use crate::wire::Weights;
    use proptest::prelude::*;

    const LAYOUT: u64 = 7;

    fn weights(version: u64, n: usize) -> Weights {
        Weights::new(PolicyVersion(version), LAYOUT, (0..n).map(|i| (i as f32 * 0.01 + version as f32).sin()).collect())
    }

    fn chunks_of(frame: &[u8], chunk: usize) -> Vec<Vec<u8>> {
        let (header, _) = decode_frame_header(frame).expect("a frame");
        encode_live_chunks(frame, &header, chunk)
    }

    fn limit(n: usize) -> usize {
        crate::wire::HEADER_BYTES + crate::wire::frame::FRAME_HEADER_BYTES + 4 * n
    }

    #[test]
    fn header_roundtrips() {
        let parent = weights(4, 300);
        let child = weights(5, 300);
        let frame = encode_delta_frame(&parent, &child);
        let chunks = chunks_of(&frame, 256);
        assert_eq!(chunks.len(), frame.len().div_ceil(256));
        for (index, chunk) in chunks.iter().enumerate() {
            let (header, payload) = decode_live_chunk(chunk).expect("decodes");
            assert_eq!(
                header,
                ChunkHeader {
                    version: PolicyVersion(5),
                    parent: Some(PolicyVersion(4)),
                    layout_hash: LAYOUT,
                    digest: child.checksum,
                    frame_len: frame.len() as u64,
                    chunk_bytes: 256,
                    index: index as u32,
                    count: chunks.len() as u32,
                    signature: None,
                }
            );
            assert_eq!(payload, &frame[index * 256..(index * 256 + 256).min(frame.len())]);
        }
    }

    #[test]
    fn chunks_in_any_order_rebuild_the_frame() {
        let w = weights(9, 1000);
        let frame = encode_full_frame(&w);
        let mut chunks = chunks_of(&frame, 1000);
        chunks.reverse();
        let mut assembler = LiveAssembler::new(LAYOUT, limit(1000));
        let last = chunks.pop().expect("chunks");
        for chunk in &chunks {
            assert_eq!(assembler.offer(chunk), Offered::Pending);
        }
        // The same chunk twice is stale, not counted twice.
        assert_eq!(assembler.offer(&chunks[0]), Offered::Stale);
        let Offered::Complete(done) = assembler.offer(&last) else { panic!("complete") };
        assert_eq!(done.bytes, frame);
        assert_eq!(decode_frame(&done.bytes, None, LAYOUT, 1000).expect("decodes"), w);
        assert_eq!(assembler.offer(&last), Offered::Stale, "a completed version is stale");
        assert_eq!(assembler.held_bytes(), 0);
    }

    #[test]
    fn a_recycled_frame_buffer_is_assembled_into_again_and_oversize_ones_are_not_kept() {
        let mut assembler = LiveAssembler::new(LAYOUT, limit(1000));
        let mut reuse = None;
        for version in 1..=3 {
            let w = weights(version, 1000);
            let frame = encode_full_frame(&w);
            let mut done = None;
            for chunk in chunks_of(&frame, 700) {
                if let Offered::Complete(frame) = assembler.offer(&chunk) {
                    done = Some(frame);
                }
            }
            let done = done.expect("complete");
            assert_eq!(decode_frame(&done.bytes, None, LAYOUT, 1000).expect("decodes"), w);
            if let Some(ptr) = reuse {
                assert_eq!(done.bytes.as_ptr(), ptr, "version {version} was not assembled in the recycled buffer");
            }
            reuse = Some(done.bytes.as_ptr());
            assembler.recycle(done.bytes);
        }
        // A recycled buffer is not zeroed: frames shorter and longer than the one before
        // still come out byte for byte (the chunks overwrite all of a frame).
        for (version, n) in [(4, 300), (5, 1000), (6, 999), (7, 0)] {
            let frame = encode_full_frame(&weights(version, n));
            let mut done = None;
            for chunk in chunks_of(&frame, 700) {
                if let Offered::Complete(frame) = assembler.offer(&chunk) {
                    done = Some(frame);
                }
            }
            let done = done.expect("complete");
            assert_eq!(done.bytes, frame, "version {version}");
            assembler.recycle(done.bytes);
        }
        // A buffer larger than any frame this assembler takes is not kept.
        let mut small = LiveAssembler::new(LAYOUT, 100);
        small.recycle(Vec::with_capacity(1 << 20));
        assert_eq!(small.spare.capacity(), 0);
    }

    #[test]
    fn a_newer_version_evicts_the_oldest_incomplete_one() {
        let mut assembler = LiveAssembler::new(LAYOUT, limit(500));
        let chunks: Vec<_> = (1..=3).map(|v| chunks_of(&encode_full_frame(&weights(v, 500)), 700)).collect();
        assert_eq!(assembler.offer(&chunks[0][0]), Offered::Pending);
        assert_eq!(assembler.offer(&chunks[1][0]), Offered::Pending);
        assert_eq!(assembler.offer(&chunks[2][0]), Offered::Pending);
        assert_eq!(assembler.dropped(), 1);
        assert!(assembler.held_bytes() <= MAX_ASSEMBLING * (limit(500) + 3));
        for chunk in &chunks[2][1..] {
            let _ = assembler.offer(chunk);
        }
        // Completing 3 drops 2 (older, incomplete); a re-sent chunk of 3 is stale.
        assert_eq!(assembler.dropped(), 2);
        assert_eq!(assembler.held_bytes(), 0);
        assert_eq!(assembler.offer(&chunks[2][0]), Offered::Stale);
    }

    #[test]
    fn a_far_future_version_does_not_shut_out_the_real_ones() {
        let mut assembler = LiveAssembler::new(LAYOUT, limit(500));
        let far = chunks_of(&encode_full_frame(&weights(1 << 40, 500)), 700);
        let other_far = chunks_of(&encode_full_frame(&weights(1 << 41, 500)), 700);
        assert!(matches!(assembler.offer(&far[0]), Offered::Pending));
        assert!(matches!(assembler.offer(&other_far[0]), Offered::Pending));
        for version in 1..4 {
            let chunks = chunks_of(&encode_full_frame(&weights(version, 500)), 700);
            let mut done = false;
            for chunk in &chunks {
                done = matches!(assembler.offer(chunk), Offered::Complete(_));
            }
            assert!(done, "v{version} completes");
        }
        // A completed forged far version does not make the real ones stale either.
        for chunk in &far {
            let _ = assembler.offer(chunk);
        }
        let chunks = chunks_of(&encode_full_frame(&weights(4, 500)), 700);
        let last = chunks.iter().map(|chunk| assembler.offer(chunk)).last();
        assert!(matches!(last, Some(Offered::Complete(_))));
    }

    #[test]
    fn hostile_chunks_are_refused_before_anything_is_allocated() {
        let frame = encode_full_frame(&weights(1, 100));
        let mut assembler = LiveAssembler::new(LAYOUT, limit(100));
        // A frame longer than a full frame of this layout.
        let big = encode_full_frame(&weights(2, 101));
        assert_eq!(
            assembler.offer(&chunks_of(&big, 64)[0]),
            Offered::Refused(DecodeError::TooLarge { got_bytes: big.len(), limit_bytes: limit(100) })
        );
        // Another layout.
        let other = Weights::new(PolicyVersion(3), LAYOUT + 1, vec![0.0; 100]);
        let refused = assembler.offer(&chunks_of(&encode_full_frame(&other), 64)[0]);
        assert!(matches!(refused, Offered::Refused(DecodeError::Mismatch { .. })), "{refused:?}");
        // A chunk of the right version that disagrees with the first: the assembly goes.
        let chunks = chunks_of(&frame, 64);
        assert_eq!(assembler.offer(&chunks[0]), Offered::Pending);
        let liar = chunks_of(&encode_full_frame(&Weights::new(PolicyVersion(1), LAYOUT, vec![1.0; 100])), 64);
        assert!(matches!(assembler.offer(&liar[1]), Offered::Refused(DecodeError::Mismatch { .. })));
        assert_eq!(assembler.held_bytes(), 0);
        assert_eq!(assembler.dropped(), 1);
        // A flipped bit anywhere in a chunk's header.
        for at in 0..CHUNK_HEADER_BYTES {
            let mut bad = chunks[1].clone();
            bad[at] ^= 0x10;
            assert!(matches!(assembler.offer(&bad), Offered::Refused(_)), "flip at {at}");
        }
        assert_eq!(assembler.held_bytes(), 0);
    }

    #[test]
    fn every_chunk_carries_the_signature_and_one_that_differs_is_refused() {
        let w = weights(3, 100);
        let frame = encode_full_frame(&w);
        let header = decode_frame_header(&frame).expect("a frame").0;
        let signature = [7u8; SIGNATURE_BYTES];
        let (chunks, _) = encode_signed_full_frame_chunks(&w, Some(&signature), 64);
        assert_eq!(chunks, encode_signed_live_chunks(&frame, &header, Some(&signature), 64));
        for chunk in &chunks {
            assert_eq!(decode_live_chunk(chunk).expect("decodes").0.signature, Some(signature));
        }
        let mut assembler = LiveAssembler::new(LAYOUT, limit(100));
        assert_eq!(assembler.offer(&chunks[0]), Offered::Pending);
        let resigned = encode_signed_live_chunks(&frame, &header, Some(&[8; SIGNATURE_BYTES]), 64);
        assert!(matches!(assembler.offer(&resigned[1]), Offered::Refused(DecodeError::Mismatch { .. })));
        let done = chunks.iter().map(|chunk| assembler.offer(chunk)).last();
        let Some(Offered::Complete(done)) = done else { panic!("complete: {done:?}") };
        assert_eq!(done.header.signature, Some(signature));
    }

    #[test]
    fn chunks_of_parameters_changed_after_their_checksum_say_so() {
        let mut w = weights(1, 100);
        w.params[40] += 1.0;
        let (chunks, digest) = encode_full_frame_chunks(&w, 64);
        assert_ne!(digest, w.checksum, "the digest is of the parameters as encoded");
        // The frame they make up decodes to parameters that fail the claimed digest.
        let mut assembler = LiveAssembler::new(LAYOUT, limit(100));
        let done = chunks.iter().map(|chunk| assembler.offer(chunk)).last();
        let Some(Offered::Complete(done)) = done else { panic!("complete: {done:?}") };
        assert!(decode_frame(&done.bytes, None, LAYOUT, 100).is_err());
    }

    #[test]
    fn a_flipped_payload_bit_is_caught_by_the_frame() {
        let w = weights(1, 100);
        let frame = encode_full_frame(&w);
        let mut chunks = chunks_of(&frame, 64);
        chunks[2][CHUNK_HEADER_BYTES + 3] ^= 0x10;
        let mut assembler = LiveAssembler::new(LAYOUT, limit(100));
        let done = chunks.iter().map(|chunk| assembler.offer(chunk)).last();
        let Some(Offered::Complete(done)) = done else { panic!("complete: {done:?}") };
        assert_eq!(decode_frame(&done.bytes, None, LAYOUT, 100).unwrap_err().reason(), "corrupt");
    }

    /// A sealed chunk with any header values (as a forger with publish rights would write).
    fn forged(fields: [u64; 5], small: [u32; 3], payload: &[u8]) -> Vec<u8> {
        let mut out = LIVE_MAGIC.to_vec();
        out.extend_from_slice(&LIVE_FORMAT_VERSION.to_le_bytes());
        for field in fields {
            out.extend_from_slice(&field.to_le_bytes());
        }
        for field in small {
            out.extend_from_slice(&field.to_le_bytes());
        }
        out.extend_from_slice(&[0; SIGNATURE_BYTES]);
        let checksum = body_checksum(&out);
        out.extend_from_slice(&checksum.to_le_bytes());
        out.extend_from_slice(payload);
        out
    }

    proptest! {
        #[test]
        fn chunks_written_from_the_weights_are_those_cut_from_the_frame(
            n in 0usize..2000, chunk in 1usize..3000, version in 0u64..1000,
        ) {
            let w = weights(version, n);
            let header = decode_frame_header(&encode_full_frame(&w)).expect("a frame").0;
            let (chunks, digest) = encode_full_frame_chunks(&w, chunk);
            prop_assert_eq!(chunks, encode_live_chunks(&encode_full_frame(&w), &header, chunk));
            prop_assert_eq!(digest, w.checksum);
        }

        #[test]
        fn roundtrip_through_the_assembler(n in 0usize..2000, chunk in 1usize..3000, version in 0u64..1000) {
            let w = weights(version, n);
            let frame = encode_full_frame(&w);
            let chunks = chunks_of(&frame, chunk);
            let mut assembler = LiveAssembler::new(LAYOUT, limit(n));
            let mut done = None;
            for c in &chunks {
                match assembler.offer(c) {
                    Offered::Pending => {}
                    Offered::Complete(frame) => done = Some(frame),
                    other => prop_assert!(false, "{:?}", other),
                }
            }
            let done = done.expect("complete");
            prop_assert_eq!(&done.bytes, &frame);
            prop_assert_eq!(done.header.digest, w.checksum);
        }

        /// Sealed chunks with arbitrary header values never panic and never hold more than the
        /// bound, whatever lengths, counts and indices they claim.
        #[test]
        fn forged_headers_stay_within_the_bounds(
            chunks in proptest::collection::vec(
                (0u64..6, any::<u64>(), any::<u32>(), any::<u32>(), any::<u32>(), 0usize..300),
                1..40,
            ),
        ) {
            let max = limit(200);
            let mut assembler = LiveAssembler::new(LAYOUT, max);
            for (version, frame_len, chunk_bytes, index, count, payload) in chunks {
                // Small values often, so that some chunks pass the structural checks.
                let frame_len = frame_len % 2000;
                let chunk_bytes = chunk_bytes % 400;
                let (index, count) = (index % 8, count % 8);
                let bytes = forged([version, NO_PARENT, LAYOUT, 0, frame_len], [chunk_bytes, index, count], &vec![3; payload]);
                let _ = assembler.offer(&bytes);
                prop_assert!(assembler.held_bytes() <= MAX_ASSEMBLING * (max + max));
            }
        }

        #[test]
        fn decoding_never_panics(bytes in proptest::collection::vec(any::<u8>(), 0..200)) {
            let _ = decode_live_chunk(&bytes);
            let mut with_magic = LIVE_MAGIC.to_vec();
            with_magic.extend(bytes);
            let _ = decode_live_chunk(&with_magic);
        }
    }
}
