//! Pace notices: how far the learner has taken the trajectory stream, fanned out by core NATS
//! to the actors so that pacing is pushed, not polled (issue 16).
//!
//! Before, a blocked actor learned that the learner had made room by asking the server for the
//! learner consumer's info, at most every 2 ms: a round trip and a JetStream API call per
//! reading, and a learner that drained a batch in half a millisecond then waited for an actor
//! that was waiting for its next reading. Now the learner publishes a notice each time it takes
//! messages from the stream, on `volley.<run>.pace` ([`crate::subjects::pace`]); an actor
//! compares it with the stream sequence of its own last message and knows the backlog at once.
//!
//! | bytes | field |
//! | --- | --- |
//! | 4 | magic `b"VLYP"` |
//! | 2 | pace format version ([`PACE_FORMAT_VERSION`], little-endian) |
//! | 8 | taken: stream sequence of the newest message the learner has taken |
//! | 8 | stored: the stream's newest sequence as the learner last saw it (a delivery's stream sequence plus the server's pending count) |
//! | 4 | prefetch: messages the learner's continuous pull asks for at a time (delivered to it, not yet taken, so counted in `stored - taken` but not in the consumer's undelivered count) |
//! | 8 | XXH3-64 of every byte above |
//!
//! The checksum catches corruption, not forgery: only the learner may publish on the subject
//! (broker permissions, docs/SECURITY.md), and an actor checks notices against the server's own
//! consumer readings at least every 20 ms and stops trusting them when they disagree
//! (`transport::nats::sink`), so even a forger with learner credentials can only let the
//! backlog overshoot by a bounded amount.

use super::{body_checksum, check_format, DecodeError};

/// First bytes of a pace notice.
pub const PACE_MAGIC: [u8; 4] = *b"VLYP";

/// Version of the notice layout.
pub const PACE_FORMAT_VERSION: u16 = 1;

/// Bytes of a notice, checksum included.
pub const PACE_NOTICE_BYTES: usize = 4 + 2 + 8 + 8 + 4 + 8;

/// Byte offset of the checksum.
const SEALED: usize = PACE_NOTICE_BYTES - 8;

/// What the learner has taken from the trajectory stream, in stream sequences.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PaceNotice {
    /// Stream sequence of the newest message the learner has taken (0: none yet).
    pub taken: u64,
    /// The stream's newest sequence as the learner last saw it (at least `taken`).
    pub stored: u64,
    /// Messages the learner's continuous pull asks for at a time: what its client may hold
    /// delivered and not yet taken.
    pub prefetch: u32,
}

impl PaceNotice {
    /// Messages stored and not yet taken by the learner, as of this notice.
    pub fn backlog(&self) -> u64 {
        self.stored - self.taken
    }
}

/// Encode a notice.
///
/// # Panics
/// If `taken > stored` (the learner never takes a message the stream does not hold).
pub fn encode_pace_notice(notice: &PaceNotice) -> [u8; PACE_NOTICE_BYTES] {
    assert!(notice.taken <= notice.stored, "taken {} beyond stored {}", notice.taken, notice.stored);
    let mut out = [0u8; PACE_NOTICE_BYTES];
    out[..4].copy_from_slice(&PACE_MAGIC);
    out[4..6].copy_from_slice(&PACE_FORMAT_VERSION.to_le_bytes());
    out[6..14].copy_from_slice(&notice.taken.to_le_bytes());
    out[14..22].copy_from_slice(&notice.stored.to_le_bytes());
    out[22..26].copy_from_slice(&notice.prefetch.to_le_bytes());
    let checksum = body_checksum(&out[..SEALED]);
    out[SEALED..].copy_from_slice(&checksum.to_le_bytes());
    out
}

/// Check a notice (length, magic, version, checksum, `taken ≤ stored`) and decode it.
pub fn decode_pace_notice(bytes: &[u8]) -> Result<PaceNotice, DecodeError> {
    let Ok(bytes) = <&[u8; PACE_NOTICE_BYTES]>::try_from(bytes) else {
        return Err(if bytes.len() < PACE_NOTICE_BYTES {
            DecodeError::Truncated(format!("{} bytes, a pace notice has {PACE_NOTICE_BYTES}", bytes.len()))
        } else {
            DecodeError::Shape { field: "pace notice", expected: PACE_NOTICE_BYTES, got: bytes.len() }
        });
    };
    check_format(bytes.first_chunk().expect("6 bytes"), PACE_MAGIC, PACE_FORMAT_VERSION, "pace notice")?;
    let u64_at = |at: usize| u64::from_le_bytes(bytes[at..at + 8].try_into().expect("8 bytes"));
    let expected = u64_at(SEALED);
    let got = body_checksum(&bytes[..SEALED]);
    if got != expected {
        return Err(DecodeError::Corrupt { expected, got });
    }
    let prefetch = u32::from_le_bytes(bytes[22..26].try_into().expect("4 bytes"));
    let notice = PaceNotice { taken: u64_at(6), stored: u64_at(14), prefetch };
    if notice.taken > notice.stored {
        return Err(DecodeError::Malformed(format!("taken {} beyond stored {}", notice.taken, notice.stored)));
    }
    Ok(notice)
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn every_bit_flip_is_refused() {
        let bytes = encode_pace_notice(&PaceNotice { taken: 41, stored: 57, prefetch: 2 });
        for bit in 0..PACE_NOTICE_BYTES * 8 {
            let mut flipped = bytes;
            flipped[bit / 8] ^= 1 << (bit % 8);
            assert!(decode_pace_notice(&flipped).is_err(), "bit {bit} flipped was accepted");
        }
    }

    #[test]
    fn wrong_lengths_and_a_taken_beyond_stored_are_refused() {
        let bytes = encode_pace_notice(&PaceNotice { taken: 3, stored: 3, prefetch: 2 });
        assert!(matches!(decode_pace_notice(&bytes[..PACE_NOTICE_BYTES - 1]), Err(DecodeError::Truncated(_))));
        let mut longer = bytes.to_vec();
        longer.push(0);
        assert!(matches!(decode_pace_notice(&longer), Err(DecodeError::Shape { .. })));
        // Well sealed, but inconsistent: taken 9 of a stream that holds 3.
        let mut forged = bytes;
        forged[6..14].copy_from_slice(&9u64.to_le_bytes());
        let checksum = body_checksum(&forged[..SEALED]);
        forged[SEALED..].copy_from_slice(&checksum.to_le_bytes());
        assert!(matches!(decode_pace_notice(&forged), Err(DecodeError::Malformed(_))));
    }

    proptest! {
        #[test]
        fn notices_round_trip(taken in any::<u64>(), extra in any::<u64>(), prefetch in any::<u32>()) {
            let notice = PaceNotice { taken, stored: taken.saturating_add(extra), prefetch };
            prop_assert_eq!(decode_pace_notice(&encode_pace_notice(&notice)).unwrap(), notice);
        }

        #[test]
        fn decoding_never_panics(bytes in proptest::collection::vec(any::<u8>(), 0..64)) {
            let _ = decode_pace_notice(&bytes);
        }
    }
}
