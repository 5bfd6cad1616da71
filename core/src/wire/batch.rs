//! Segment batch frames: several already-encoded segments in one message, so an actor pays the
//! broker's per-message costs (the publish, its ack, the `Nats-Msg-Id` deduplication entry, the
//! learner's delivery and ack) once per batch rather than once per segment (issue 16).
//!
//! The frame is a layer around the segment encoding, which it does not look into: each part is
//! a complete segment message ([`super::encode_segment`]: envelope, format version, its own
//! XXH3-64 body checksum). A corrupted part is rejected on its own when the learner decodes
//! it, and the other parts of the frame are still used. The frame's own header (count and part
//! lengths) carries a checksum of its own, so a corrupted header is refused as a whole instead
//! of cutting the parts at the wrong places.
//!
//! | bytes | field |
//! | --- | --- |
//! | 4 | magic `b"VLYB"` |
//! | 2 | batch format version ([`BATCH_FORMAT_VERSION`], little-endian) |
//! | 4 | number of parts `n`, 1 to [`MAX_SEGMENTS_PER_BATCH`] |
//! | 4n | the length of each part in bytes |
//! | 8 | XXH3-64 ([`super::body_checksum`]) of every byte above |
//! | … | the parts, back to back; their lengths add up to exactly the rest of the message |
//!
//! A message that does not start with the batch magic is a single segment, as before batch
//! frames existed, so a learner reads both. A learner from before batch frames refuses a frame
//! as `bad_magic` (run actors and learner from one build, docs/OPERATIONS.md).

use super::{body_checksum, check_format, DecodeError, MAX_MESSAGE_BYTES};

/// First bytes of a segment batch frame.
pub const BATCH_MAGIC: [u8; 4] = *b"VLYB";

/// Version of the frame layout (the parts carry the segment format version themselves).
pub const BATCH_FORMAT_VERSION: u16 = 1;

/// The most parts one frame may hold, so a hostile count cannot make the learner allocate
/// or hand out more than this many deliveries per message.
pub const MAX_SEGMENTS_PER_BATCH: usize = 1024;

/// Magic, version and count: the bytes before the part lengths.
const FIXED_BYTES: usize = 4 + 2 + 4;

/// Bytes of the frame header for `n_parts` parts (magic, version, count, lengths, checksum):
/// what a frame adds to its parts.
pub fn batch_header_bytes(n_parts: usize) -> usize {
    FIXED_BYTES + 4 * n_parts + 8
}

/// Whether `bytes` claim to be a batch frame (start with [`BATCH_MAGIC`]); anything else is
/// read as a single segment.
pub fn is_segment_batch(bytes: &[u8]) -> bool {
    bytes.starts_with(&BATCH_MAGIC)
}

/// Put encoded segments into one frame.
///
/// # Panics
/// If there are no parts, more than [`MAX_SEGMENTS_PER_BATCH`], or one longer than `u32::MAX`
/// bytes: the sink packs its own segments within those bounds.
///
/// ```
/// # use volley_core::wire::batch::{encode_segment_batch, split_segment_batch};
/// let frame = encode_segment_batch(&[b"first".as_slice(), b"second"]);
/// let parts: Vec<&[u8]> = split_segment_batch(&frame).unwrap().collect();
/// assert_eq!(parts, [b"first".as_slice(), b"second"]);
/// ```
pub fn encode_segment_batch<P: AsRef<[u8]>>(parts: &[P]) -> Vec<u8> {
    let n = parts.len();
    assert!(
        (1..=MAX_SEGMENTS_PER_BATCH).contains(&n),
        "a batch frame holds 1 to {MAX_SEGMENTS_PER_BATCH} parts, not {n}"
    );
    let body_bytes: usize = parts.iter().map(|part| part.as_ref().len()).sum();
    let mut out = Vec::with_capacity(batch_header_bytes(n) + body_bytes);
    out.extend_from_slice(&BATCH_MAGIC);
    out.extend_from_slice(&BATCH_FORMAT_VERSION.to_le_bytes());
    out.extend_from_slice(&(n as u32).to_le_bytes());
    for part in parts {
        let len = u32::try_from(part.as_ref().len()).expect("a segment part is shorter than 4 GiB");
        out.extend_from_slice(&len.to_le_bytes());
    }
    let checksum = body_checksum(&out);
    out.extend_from_slice(&checksum.to_le_bytes());
    for part in parts {
        out.extend_from_slice(part.as_ref());
    }
    out
}

/// Builds one message in place: a batch frame, or a single segment message when it holds one
/// part. Parts are appended behind room kept for the largest header the frame may need, and
/// [`FrameBuilder::finish`] writes the header just in front of the parts, so no part is copied
/// into a frame after it was encoded (issue 16, item 4). The message is
/// `buffer[start..]`; the bytes before `start` are unused room.
///
/// ```
/// # use volley_core::wire::batch::{encode_segment_batch, FrameBuilder};
/// let mut frame = FrameBuilder::new(4, 64);
/// frame.push_with(|out| out.extend_from_slice(b"first"));
/// frame.push_with(|out| out.extend_from_slice(b"second"));
/// let (buffer, start) = frame.finish();
/// assert_eq!(&buffer[start..], encode_segment_batch(&[b"first".as_slice(), b"second"]));
/// ```
#[derive(Debug)]
pub struct FrameBuilder {
    buffer: Vec<u8>,
    /// Bytes kept at the front for the header: [`batch_header_bytes`] of `max_parts`.
    room: usize,
    max_parts: usize,
    /// Where each part ends in `buffer`.
    ends: Vec<usize>,
}

impl FrameBuilder {
    /// A builder for up to `max_parts` parts (1 to [`MAX_SEGMENTS_PER_BATCH`]) with room for
    /// `capacity` bytes of parts reserved (more only costs the buffer growing).
    ///
    /// # Panics
    /// If `max_parts` is out of that range.
    pub fn new(max_parts: usize, capacity: usize) -> Self {
        assert!(
            (1..=MAX_SEGMENTS_PER_BATCH).contains(&max_parts),
            "a batch frame holds 1 to {MAX_SEGMENTS_PER_BATCH} parts, not {max_parts}"
        );
        let room = batch_header_bytes(max_parts);
        let mut buffer = Vec::with_capacity(room + capacity);
        buffer.resize(room, 0);
        FrameBuilder { buffer, room, max_parts, ends: Vec::with_capacity(max_parts) }
    }

    /// Parts so far.
    pub fn parts(&self) -> usize {
        self.ends.len()
    }

    /// Whether another part may be pushed (the builder holds fewer than its `max_parts`).
    pub fn has_room(&self) -> bool {
        self.ends.len() < self.max_parts
    }

    /// Bytes of the message [`FrameBuilder::finish`] would return now: the parts plus the
    /// header of a frame of that many parts (none for a single part).
    pub fn message_len(&self) -> usize {
        let parts = self.buffer.len() - self.room;
        match self.ends.len() {
            0 | 1 => parts,
            n => batch_header_bytes(n) + parts,
        }
    }

    /// Append a part: `write` appends its bytes to the buffer it is given (and must not touch
    /// what is already there). Returns the part's length.
    ///
    /// # Panics
    /// If the builder is full ([`FrameBuilder::has_room`]), `write` shortened the buffer, or
    /// the part is 4 GiB or longer.
    pub fn push_with(&mut self, write: impl FnOnce(&mut Vec<u8>)) -> usize {
        assert!(self.has_room(), "a frame builder for {} parts is full", self.max_parts);
        let start = self.buffer.len();
        write(&mut self.buffer);
        assert!(self.buffer.len() >= start, "a part's writer only appends");
        let len = self.buffer.len() - start;
        u32::try_from(len).expect("a segment part is shorter than 4 GiB");
        self.ends.push(self.buffer.len());
        len
    }

    /// Take the last part back out (copied), for a frame that it made too large.
    ///
    /// # Panics
    /// If there are no parts.
    pub fn pop(&mut self) -> Vec<u8> {
        self.ends.pop().expect("a part to take back");
        let start = self.ends.last().copied().unwrap_or(self.room);
        let part = self.buffer[start..].to_vec();
        self.buffer.truncate(start);
        part
    }

    /// The message and where it starts in the returned buffer: one part alone as it is, two
    /// or more behind the frame's header ([`encode_segment_batch`]'s bytes exactly).
    ///
    /// # Panics
    /// If there are no parts.
    pub fn finish(mut self) -> (Vec<u8>, usize) {
        let n = self.ends.len();
        assert!(n > 0, "a message holds at least one part");
        if n == 1 {
            return (self.buffer, self.room);
        }
        let start = self.room - batch_header_bytes(n);
        let mut header = Vec::with_capacity(batch_header_bytes(n));
        header.extend_from_slice(&BATCH_MAGIC);
        header.extend_from_slice(&BATCH_FORMAT_VERSION.to_le_bytes());
        header.extend_from_slice(&(n as u32).to_le_bytes());
        let mut part_start = self.room;
        for &end in &self.ends {
            header.extend_from_slice(&((end - part_start) as u32).to_le_bytes());
            part_start = end;
        }
        let checksum = body_checksum(&header);
        header.extend_from_slice(&checksum.to_le_bytes());
        self.buffer[start..self.room].copy_from_slice(&header);
        (self.buffer, start)
    }
}

/// The parts of a batch frame, in order, as slices of the frame ([`split_segment_batch`]).
#[derive(Debug, Clone)]
pub struct BatchParts<'a> {
    /// The remaining part lengths, 4 bytes each.
    lengths: &'a [u8],
    /// The remaining parts' bytes.
    rest: &'a [u8],
}

impl<'a> Iterator for BatchParts<'a> {
    type Item = &'a [u8];

    fn next(&mut self) -> Option<&'a [u8]> {
        let (len, lengths) = self.lengths.split_first_chunk::<4>()?;
        self.lengths = lengths;
        // The lengths were checked to add up to the parts' bytes, so this split cannot fail.
        let (part, rest) = self.rest.split_at(u32::from_le_bytes(*len) as usize);
        self.rest = rest;
        Some(part)
    }

    fn size_hint(&self) -> (usize, Option<usize>) {
        let n = self.lengths.len() / 4;
        (n, Some(n))
    }
}

impl ExactSizeIterator for BatchParts<'_> {}

/// Check a batch frame's header (magic, version, count, checksum, lengths) and return its
/// parts, not yet decoded: each is a segment message for [`super::decode_segment_body`].
///
/// ```
/// # use volley_core::wire::batch::split_segment_batch;
/// assert_eq!(split_segment_batch(b"VLYB").unwrap_err().reason(), "truncated");
/// ```
pub fn split_segment_batch(bytes: &[u8]) -> Result<BatchParts<'_>, DecodeError> {
    if bytes.len() > MAX_MESSAGE_BYTES {
        return Err(DecodeError::TooLarge { got_bytes: bytes.len(), limit_bytes: MAX_MESSAGE_BYTES });
    }
    let Some(fixed) = bytes.first_chunk::<FIXED_BYTES>() else {
        return Err(DecodeError::Truncated(format!("{} bytes, a batch frame needs {FIXED_BYTES}", bytes.len())));
    };
    check_format(fixed.first_chunk().expect("6 bytes"), BATCH_MAGIC, BATCH_FORMAT_VERSION, "segment batch")?;
    let n = u32::from_le_bytes(fixed[6..10].try_into().expect("4 bytes")) as usize;
    if n == 0 || n > MAX_SEGMENTS_PER_BATCH {
        return Err(DecodeError::Malformed(format!(
            "segment batch of {n} parts, allowed 1 to {MAX_SEGMENTS_PER_BATCH}"
        )));
    }
    let header_bytes = batch_header_bytes(n);
    if bytes.len() < header_bytes {
        return Err(DecodeError::Truncated(format!(
            "{} bytes, the header of a batch of {n} needs {header_bytes}",
            bytes.len()
        )));
    }
    let checked = header_bytes - 8;
    let expected = u64::from_le_bytes(bytes[checked..header_bytes].try_into().expect("8 bytes"));
    let got = body_checksum(&bytes[..checked]);
    if got != expected {
        return Err(DecodeError::Corrupt { expected, got });
    }
    let lengths = &bytes[FIXED_BYTES..checked];
    let rest = &bytes[header_bytes..];
    let total: usize =
        lengths.chunks_exact(4).map(|len| u32::from_le_bytes(len.try_into().expect("4 bytes")) as usize).sum();
    if total != rest.len() {
        return Err(DecodeError::Malformed(format!(
            "segment batch parts add up to {total} bytes, the frame holds {}",
            rest.len()
        )));
    }
    Ok(BatchParts { lengths, rest })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::wire::{decode_segment_body, encode_segment, test_segment};
    use proptest::prelude::*;

    fn segments(n: usize) -> Vec<Vec<u8>> {
        (0..n).map(|idx| encode_segment(&test_segment("batch", 3 + idx % 2, 4, idx as u64))).collect()
    }

    proptest! {
        #[test]
        fn parts_roundtrip(parts in proptest::collection::vec(proptest::collection::vec(any::<u8>(), 0..64), 1..20)) {
            let frame = encode_segment_batch(&parts);
            prop_assert!(is_segment_batch(&frame));
            let split: Vec<&[u8]> = split_segment_batch(&frame).expect("a frame splits").collect();
            prop_assert_eq!(split.len(), parts.len());
            for (got, want) in split.iter().zip(&parts) {
                prop_assert_eq!(*got, want.as_slice());
            }
        }

        #[test]
        fn split_never_panics_on_arbitrary_bytes(tail in proptest::collection::vec(any::<u8>(), 0..256)) {
            let mut bytes = BATCH_MAGIC.to_vec();
            bytes.extend(tail);
            if let Ok(parts) = split_segment_batch(&bytes) {
                prop_assert!(parts.map(<[u8]>::len).sum::<usize>() < bytes.len());
            }
        }

        #[test]
        fn every_truncation_is_an_error(cut in 0usize..10_000) {
            let frame = encode_segment_batch(&segments(3));
            let cut = cut % frame.len();
            prop_assert!(split_segment_batch(&frame[..cut]).is_err());
        }
    }

    proptest! {
        #[test]
        fn a_frame_built_in_place_is_the_same_bytes(
            parts in proptest::collection::vec(proptest::collection::vec(any::<u8>(), 0..64), 1..20),
            spare in 0usize..4,
            popped in proptest::collection::vec(any::<u8>(), 0..64),
        ) {
            let mut builder = FrameBuilder::new(parts.len() + spare, 16);
            for part in &parts[..parts.len() - 1] {
                builder.push_with(|out| out.extend_from_slice(part));
            }
            // A part taken back out leaves the frame as if it had never been pushed.
            builder.push_with(|out| out.extend_from_slice(&popped));
            prop_assert_eq!(builder.pop(), popped);
            let last = &parts[parts.len() - 1];
            prop_assert_eq!(builder.push_with(|out| out.extend_from_slice(last)), last.len());
            let expected = if parts.len() == 1 { parts[0].clone() } else { encode_segment_batch(&parts) };
            prop_assert_eq!(builder.message_len(), expected.len());
            let (buffer, start) = builder.finish();
            prop_assert_eq!(&buffer[start..], &expected[..]);
        }
    }

    #[test]
    fn a_full_builder_says_so() {
        let mut builder = FrameBuilder::new(2, 0);
        assert!(builder.has_room());
        builder.push_with(|out| out.push(1));
        builder.push_with(|out| out.push(2));
        assert!(!builder.has_room());
        assert_eq!(builder.parts(), 2);
        assert!(std::panic::catch_unwind(move || builder.push_with(|out| out.push(3))).is_err());
    }

    #[test]
    fn segments_come_back_whole_and_in_order() {
        let parts = segments(5);
        let frame = encode_segment_batch(&parts);
        assert_eq!(frame.len(), batch_header_bytes(5) + parts.iter().map(Vec::len).sum::<usize>());
        let decoded: Vec<_> = split_segment_batch(&frame)
            .expect("splits")
            .map(|part| decode_segment_body(part).expect("decodes").segment_idx)
            .collect();
        assert_eq!(decoded, [0, 1, 2, 3, 4]);
    }

    /// One bad segment must not lose the others: a bit flipped in a part's bytes fails only
    /// that part's own checksum.
    #[test]
    fn a_flipped_bit_in_one_part_rejects_only_that_part() {
        let parts = segments(3);
        let frame = encode_segment_batch(&parts);
        let second_at = batch_header_bytes(3) + parts[0].len();
        for offset in [20, parts[1].len() - 1] {
            let mut flipped = frame.clone();
            flipped[second_at + offset] ^= 0x10;
            let outcomes: Vec<_> = split_segment_batch(&flipped)
                .expect("the header is intact")
                .map(|part| decode_segment_body(part).map(|s| s.segment_idx).map_err(|e| e.reason()))
                .collect();
            assert_eq!(outcomes, [Ok(0), Err("corrupt"), Ok(2)], "offset {offset}");
        }
    }

    #[test]
    fn a_flipped_bit_in_the_header_rejects_the_frame_with_a_reason() {
        let frame = encode_segment_batch(&segments(3));
        for bit in 0..batch_header_bytes(3) * 8 {
            let mut flipped = frame.clone();
            flipped[bit / 8] ^= 1 << (bit % 8);
            let err = split_segment_batch(&flipped).expect_err("a flipped header bit is refused");
            assert!(DecodeError::REASONS.contains(&err.reason()), "bit {bit}: {err}");
        }
    }

    #[test]
    fn counts_out_of_bounds_and_foreign_versions_are_refused() {
        let mut frame = encode_segment_batch(&segments(1));
        let reseal = |frame: &mut Vec<u8>| {
            let at = batch_header_bytes(1) - 8;
            let checksum = body_checksum(&frame[..at]);
            frame[at..at + 8].copy_from_slice(&checksum.to_le_bytes());
        };
        frame[4] = 2;
        reseal(&mut frame);
        assert_eq!(split_segment_batch(&frame).unwrap_err().reason(), "malformed");
        frame[4] = 1;
        reseal(&mut frame);
        frame[9] = 0x10; // n = 1 + 2^28
        assert_eq!(split_segment_batch(&frame).unwrap_err().reason(), "malformed");
        assert!(!is_segment_batch(&segments(1)[0]));
    }

    #[test]
    #[should_panic(expected = "parts")]
    fn an_empty_batch_is_a_bug() {
        encode_segment_batch::<Vec<u8>>(&[]);
    }
}
