//! Weights frames: one policy version as a full parameter buffer (an *anchor*) or as a
//! lossless delta against an earlier version (its *parent*), with the digest of the
//! parameters the frame produces.
//!
//! A frame is an ordinary message: the [`super::Envelope`] (kind [`MessageKind::WeightsFull`]
//! or [`MessageKind::WeightsDelta`], body checksum) and then a fixed little-endian body:
//!
//! | bytes | field |
//! | --- | --- |
//! | 8 | version |
//! | 8 | parent version (`u64::MAX` in a full frame) |
//! | 8 | layout hash |
//! | 8 | digest of the resulting parameters ([`super::checksum`]) |
//! | 8 | number of parameters `n` |
//! | … | full: `4n` bytes, the parameters little-endian; delta: four byte planes |
//!
//! A delta holds `bits(new) XOR bits(parent)` per parameter, split into its four little-endian
//! byte planes. An optimiser step moves most parameters by a small relative amount, so the
//! high planes (sign, exponent, top of the mantissa) are mostly zero; each plane is stored
//! dense (`0`, then `n` bytes) or sparse (`1`, then a bitmap of its non-zero bytes, `⌈n/8⌉`
//! bytes, then those bytes), whichever is smaller. XOR is exact, so the follower reconstructs
//! the learner's parameters bit for bit, and the digest proves it.

use super::{body_checksum, checksum, DecodeError, MessageKind, Weights, FORMAT_VERSION, HEADER_BYTES, MAGIC};
use crate::ids::PolicyVersion;

/// Bytes of the frame header after the envelope: version, parent, layout hash, digest, n.
pub const FRAME_HEADER_BYTES: usize = 40;

const NO_PARENT: u64 = u64::MAX;
const PLANE_DENSE: u8 = 0;
const PLANE_SPARSE: u8 = 1;

/// What a frame says about itself (read before its payload is decoded).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FrameHeader {
    /// The version the frame produces.
    pub version: PolicyVersion,
    /// The version a delta applies to; `None` for a full frame.
    pub parent: Option<PolicyVersion>,
    /// Architecture hash of the layout.
    pub layout_hash: u64,
    /// [`super::checksum`] of the parameters the frame produces.
    pub digest: u64,
    /// Number of parameters.
    pub n_params: usize,
}

impl FrameHeader {
    /// The header of `weights`' full frame, as [`encode_full_frame`] writes it.
    pub fn of_full(weights: &Weights) -> Self {
        FrameHeader {
            version: weights.version,
            parent: None,
            layout_hash: weights.layout_hash,
            digest: weights.checksum,
            n_params: weights.params.len(),
        }
    }
}

/// Encode `weights` as a full frame (an anchor).
pub fn encode_full_frame(weights: &Weights) -> Vec<u8> {
    let n = weights.params.len();
    let mut out = frame_start(MessageKind::WeightsFull, weights, None, 4 * n);
    let start = out.len();
    out.resize(start + 4 * n, 0);
    for (bytes, p) in out[start..].chunks_exact_mut(4).zip(&weights.params) {
        bytes.copy_from_slice(&p.to_bits().to_le_bytes());
    }
    seal(out)
}

/// Encode `weights` as a lossless delta against `parent` (same number of parameters).
///
/// # Panics
/// If `parent` has another number of parameters: both come from the same learner.
pub fn encode_delta_frame(parent: &Weights, weights: &Weights) -> Vec<u8> {
    let n = weights.params.len();
    assert_eq!(parent.params.len(), n, "a delta needs two buffers of one layout");
    // Each plane takes at most `n + 1` bytes: sparse only where that is smaller than dense.
    let mut out = frame_start(MessageKind::WeightsDelta, weights, Some(parent.version), 4 * (n + 1));
    // The four planes split in one pass over both buffers (a pass per plane read the 8n bytes
    // of parameters four times: 20 ms for 16 MiB of weights, on the cores the followers decode
    // on), each then counted and packed a group of eight parameters at a time (issue 16:
    // packing byte by byte, into a buffer sized for a quarter of the frame, took 3 ms for
    // 1 MiB of weights).
    let mut planes = vec![0u8; 4 * n];
    let (p0, rest) = planes.split_at_mut(n);
    let (p1, rest) = rest.split_at_mut(n);
    let (p2, p3) = rest.split_at_mut(n);
    let split = p0.iter_mut().zip(p1.iter_mut()).zip(p2.iter_mut()).zip(p3.iter_mut());
    for ((((b0, b1), b2), b3), (new, old)) in split.zip(weights.params.iter().zip(&parent.params)) {
        [*b0, *b1, *b2, *b3] = (new.to_bits() ^ old.to_bits()).to_le_bytes();
    }
    for k in 0..4 {
        let plane = &planes[k * n..(k + 1) * n];
        let nonzero = count_nonzero(plane);
        if n.div_ceil(8) + nonzero < n {
            out.push(PLANE_SPARSE);
            push_sparse_plane(&mut out, plane, nonzero);
        } else {
            out.push(PLANE_DENSE);
            out.extend_from_slice(plane);
        }
    }
    seal(out)
}

/// The non-zero bytes of `bytes`, counted in 32-bit lanes (four to a vector register on any
/// x86-64; a `usize` count takes two).
fn count_nonzero(bytes: &[u8]) -> usize {
    bytes.chunks(1 << 20).map(|chunk| chunk.iter().map(|&byte| u32::from(byte != 0)).sum::<u32>() as usize).sum()
}

/// A sparse plane: the bitmap of its non-zero bytes (eight parameters per byte, bit `i` for
/// the `i`-th of the eight), then those bytes in order, `nonzero` of them. A group of eight is
/// read as one word: all zero (most of a sparse plane) it is skipped; otherwise its bitmap
/// byte comes from the word's bits and its bytes are packed without a branch per byte.
fn push_sparse_plane(out: &mut Vec<u8>, plane: &[u8], nonzero: usize) {
    const LOW7: u64 = 0x7f7f_7f7f_7f7f_7f7f;
    const HIGH: u64 = 0x8080_8080_8080_8080;
    // Moves bit 8i (the flag of byte i) to bit 56 + i, with no two products overlapping.
    const GATHER: u64 = 0x0102_0408_1020_4080;
    let start = out.len();
    let bitmap_bytes = plane.len().div_ceil(8);
    // Eight bytes of slack: each byte of a group is written before it is known to be kept.
    out.resize(start + bitmap_bytes + nonzero + 8, 0);
    let (bitmap, values) = out[start..].split_at_mut(bitmap_bytes);
    let mut at = 0;
    for (mask, group) in bitmap.iter_mut().zip(plane.chunks(8)) {
        let mut word = [0u8; 8];
        word[..group.len()].copy_from_slice(group);
        let x = u64::from_le_bytes(word);
        if x == 0 {
            continue;
        }
        // The high bit of each byte, set where the byte is non-zero (no carry crosses bytes).
        let flags = (((x & LOW7) + LOW7) | x) & HIGH;
        *mask = ((flags >> 7).wrapping_mul(GATHER) >> 56) as u8;
        for byte in word {
            values[at] = byte;
            at += usize::from(byte != 0);
        }
    }
    debug_assert_eq!(at, nonzero, "the counting pass and the packing pass agree");
    out.truncate(start + bitmap_bytes + nonzero);
}

/// The first bytes of `weights`' full frame (envelope and frame header), its checksum still
/// zero: the parameters' `4n` bytes follow, and the checksum covers all after the envelope.
pub(super) fn full_frame_head(weights: &Weights) -> Vec<u8> {
    frame_start(MessageKind::WeightsFull, weights, None, 0)
}

/// Where a frame's envelope checksum sits.
pub(super) const CHECKSUM_AT: std::ops::Range<usize> = 7..HEADER_BYTES;

fn frame_start(kind: MessageKind, weights: &Weights, parent: Option<PolicyVersion>, payload: usize) -> Vec<u8> {
    let mut out = Vec::with_capacity(HEADER_BYTES + FRAME_HEADER_BYTES + payload);
    out.extend_from_slice(&MAGIC);
    out.extend_from_slice(&FORMAT_VERSION.to_le_bytes());
    out.push(kind as u8);
    out.extend_from_slice(&[0; 8]);
    for field in [
        weights.version.0,
        parent.map_or(NO_PARENT, |p| p.0),
        weights.layout_hash,
        weights.checksum,
        weights.params.len() as u64,
    ] {
        out.extend_from_slice(&field.to_le_bytes());
    }
    out
}

fn seal(mut out: Vec<u8>) -> Vec<u8> {
    let checksum = body_checksum(&out[HEADER_BYTES..]);
    out[CHECKSUM_AT].copy_from_slice(&checksum.to_le_bytes());
    out
}

/// Read a frame's envelope (checksum included) and header; returns the header and payload.
pub fn decode_frame_header(bytes: &[u8]) -> Result<(FrameHeader, &[u8]), DecodeError> {
    let (header, payload, _) = frame_header(bytes, true)?;
    Ok((header, payload))
}

/// The frame's header and payload, and the envelope's claimed checksum; the body is hashed
/// and checked against it only when `verify` is set.
fn frame_header(bytes: &[u8], verify: bool) -> Result<(FrameHeader, &[u8], u64), DecodeError> {
    let kind = match bytes.get(6) {
        Some(&kind) if kind == MessageKind::WeightsDelta as u8 => MessageKind::WeightsDelta,
        _ => MessageKind::WeightsFull,
    };
    let (envelope, body) = if verify {
        super::decode_envelope(bytes, kind)?
    } else {
        super::codec::decode_envelope_unverified(bytes, kind)?
    };
    let Some((header, payload)) = body.split_first_chunk::<FRAME_HEADER_BYTES>() else {
        return Err(DecodeError::Truncated(format!(
            "weights frame body of {} bytes, its header needs {FRAME_HEADER_BYTES}",
            body.len()
        )));
    };
    let field = |idx: usize| u64::from_le_bytes(header[8 * idx..8 * idx + 8].try_into().expect("8 bytes"));
    let parent = match (kind, field(1)) {
        (MessageKind::WeightsFull, NO_PARENT) => None,
        (MessageKind::WeightsDelta, parent) if parent != NO_PARENT => Some(PolicyVersion(parent)),
        (_, parent) => return Err(DecodeError::Malformed(format!("{kind:?} frame with parent field {parent:#x}"))),
    };
    let n_params = usize::try_from(field(4))
        .map_err(|_| DecodeError::Malformed(format!("parameter count {} does not fit", field(4))))?;
    let header =
        FrameHeader { version: PolicyVersion(field(0)), parent, layout_hash: field(2), digest: field(3), n_params };
    Ok((header, payload, envelope.checksum))
}

/// Decode a frame into the weights it produces, checking the layout, the parameter count and,
/// after reconstruction, the digest and the parameters' values ([`super::check_params`]:
/// finite and within [`super::MAX_ABS_PARAM`]).
///
/// A full frame needs no `base`; a delta needs `base` to be its parent version (a delta
/// against anything else is refused, [`DecodeError::Mismatch`]). The result's `checksum` is
/// the digest, verified.
pub fn decode_frame(
    bytes: &[u8],
    base: Option<&Weights>,
    layout_hash: u64,
    n_params: usize,
) -> Result<Weights, DecodeError> {
    // A full frame's body is hashed in the same pass that parses it (below); anything else,
    // and any frame that fails a check before that pass, has its envelope checked first, so
    // a corrupted frame is reported as corrupt whatever field the damage hit.
    let full = bytes.get(6) == Some(&(MessageKind::WeightsFull as u8));
    let (header, payload, claimed) = match frame_header(bytes, !full) {
        Ok(parts) => parts,
        Err(err) if full => {
            frame_header(bytes, true)?;
            return Err(err);
        }
        Err(err) => return Err(err),
    };
    let consistent = header.layout_hash == layout_hash && header.n_params == n_params && payload.len() == 4 * n_params;
    if full && !(consistent && header.parent.is_none()) {
        frame_header(bytes, true)?;
    }
    if header.layout_hash != layout_hash {
        return Err(DecodeError::Mismatch {
            what: "layout hash",
            got: format!("{:016x}", header.layout_hash),
            expected: format!("{layout_hash:016x}"),
        });
    }
    if header.n_params != n_params {
        return Err(DecodeError::Shape { field: "params", expected: n_params, got: header.n_params });
    }
    let (params, got) = match header.parent {
        // The payload is the parameters' little-endian bytes, exactly what `checksum` hashes:
        // hashing it directly gives the same digest without a second pass over the floats.
        None => decode_full_payload(&bytes[HEADER_BYTES..], payload, n_params, claimed)?,
        Some(parent) => {
            let base = base.filter(|base| base.version == parent).ok_or_else(|| DecodeError::Mismatch {
                what: "delta parent",
                got: parent.to_string(),
                expected: base.map_or_else(|| "a full frame".to_string(), |base| base.version.to_string()),
            })?;
            if base.params.len() != n_params {
                return Err(DecodeError::Shape { field: "params", expected: n_params, got: base.params.len() });
            }
            let params = apply_delta_payload(payload, &base.params)?;
            let got = checksum(&params);
            (params, got)
        }
    };
    if got != header.digest {
        return Err(DecodeError::Checksum { expected: header.digest, got });
    }
    // The digest proves the parameters are the sender's, not that they can be run (issue 46).
    super::check_params(&params)?;
    Ok(Weights { version: header.version, layout_hash, checksum: got, params })
}

/// Parse a full frame's parameters from `payload` (the tail of `body`) and return them with
/// their digest, in one pass over the bytes: each block is hashed into the envelope checksum
/// (of `body`, compared with `claimed`), hashed into the digest, and parsed while it is in
/// cache (issue 16: four passes over 16 MiB per follower were a third of a broadcast on two
/// cores).
fn decode_full_payload(
    body: &[u8],
    payload: &[u8],
    n_params: usize,
    claimed: u64,
) -> Result<(Vec<f32>, u64), DecodeError> {
    if payload.len() != 4 * n_params {
        return Err(DecodeError::Malformed(format!(
            "full frame of {n_params} parameters has {} payload bytes, expected {}",
            payload.len(),
            4 * n_params
        )));
    }
    const BLOCK: usize = 64 << 10;
    let mut envelope = xxhash_rust::xxh3::Xxh3Default::new();
    envelope.update(&body[..body.len() - payload.len()]);
    let mut digest = xxhash_rust::xxh3::Xxh3Default::new();
    let mut params = Vec::with_capacity(n_params);
    for block in payload.chunks(BLOCK) {
        envelope.update(block);
        digest.update(block);
        params
            .extend(block.chunks_exact(4).map(|b| f32::from_bits(u32::from_le_bytes(b.try_into().expect("4 bytes")))));
    }
    let got = envelope.digest();
    if got != claimed {
        return Err(DecodeError::Corrupt { expected: claimed, got });
    }
    Ok((params, digest.digest()))
}

fn apply_delta_payload(mut payload: &[u8], base: &[f32]) -> Result<Vec<f32>, DecodeError> {
    let n = base.len();
    let mut bits: Vec<u32> = base.iter().map(|p| p.to_bits()).collect();
    for shift in [0u32, 8, 16, 24] {
        let truncated = || DecodeError::Truncated(format!("delta byte plane at bit {shift}"));
        let (&mode, rest) = payload.split_first().ok_or_else(truncated)?;
        payload = match mode {
            PLANE_DENSE => {
                let (plane, rest) = rest.split_at_checked(n).ok_or_else(truncated)?;
                for (word, &byte) in bits.iter_mut().zip(plane) {
                    *word ^= u32::from(byte) << shift;
                }
                rest
            }
            PLANE_SPARSE => {
                let (bitmap, mut rest) = rest.split_at_checked(n.div_ceil(8)).ok_or_else(truncated)?;
                // Eight parameters per bitmap byte; zero bytes (most, in a sparse plane) skip
                // all eight. Bits past the last parameter are ignored, as ever.
                for (words, &mask) in bits.chunks_mut(8).zip(bitmap) {
                    let mut mask = mask;
                    while mask != 0 {
                        let bit = mask.trailing_zeros() as usize;
                        mask &= mask - 1;
                        let Some(word) = words.get_mut(bit) else { break };
                        let (&byte, tail) = rest.split_first().ok_or_else(truncated)?;
                        *word ^= u32::from(byte) << shift;
                        rest = tail;
                    }
                }
                rest
            }
            other => return Err(DecodeError::Malformed(format!("delta byte plane mode {other}"))),
        };
    }
    if !payload.is_empty() {
        return Err(DecodeError::Malformed(format!("{} trailing bytes after the delta planes", payload.len())));
    }
    Ok(bits.into_iter().map(f32::from_bits).collect())
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn weights(version: u64, params: Vec<f32>) -> Weights {
        Weights::new(PolicyVersion(version), 7, params)
    }

    /// The delta encoder as first written (a pass per plane to split, count and pack), kept
    /// as the reference the faster one must match byte for byte.
    fn reference_delta_frame(parent: &Weights, weights: &Weights) -> Vec<u8> {
        let n = weights.params.len();
        let mut out = frame_start(MessageKind::WeightsDelta, weights, Some(parent.version), n + 4);
        let xor: Vec<u32> =
            weights.params.iter().zip(&parent.params).map(|(new, old)| new.to_bits() ^ old.to_bits()).collect();
        let mut plane = vec![0u8; n];
        for shift in [0u32, 8, 16, 24] {
            for (byte, word) in plane.iter_mut().zip(&xor) {
                *byte = (word >> shift) as u8;
            }
            let nonzero = plane.iter().filter(|&&byte| byte != 0).count();
            if n.div_ceil(8) + nonzero < n {
                out.push(PLANE_SPARSE);
                out.extend(plane.chunks(8).map(|group| {
                    group.iter().enumerate().fold(0u8, |mask, (bit, &byte)| mask | (u8::from(byte != 0) << bit))
                }));
                out.extend(plane.iter().copied().filter(|&byte| byte != 0));
            } else {
                out.push(PLANE_DENSE);
                out.extend_from_slice(&plane);
            }
        }
        seal(out)
    }

    #[test]
    fn full_frame_roundtrips_exactly() {
        let w = weights(3, vec![1.0, -0.0, f32::MIN_POSITIVE, 3.5e-12]);
        let bytes = encode_full_frame(&w);
        assert_eq!(decode_frame(&bytes, None, 7, 4).expect("decodes"), w);
        let (header, _) = decode_frame_header(&bytes).expect("header");
        assert_eq!(header.parent, None);
        assert_eq!(header.digest, w.checksum);
    }

    #[test]
    fn a_full_payload_hashes_to_the_parameters_checksum() {
        let w = weights(3, (0..5000).map(|i| (i as f32).sin()).collect());
        let bytes = encode_full_frame(&w);
        assert_eq!(body_checksum(&bytes[HEADER_BYTES + FRAME_HEADER_BYTES..]), checksum(&w.params));
    }

    #[test]
    fn small_steps_make_small_deltas() {
        let parent = weights(1, (0..4096).map(|i| (i as f32 * 0.37).sin()).collect());
        let child = weights(2, parent.params.iter().map(|p| p * (1.0 + 1e-4)).collect());
        let delta = encode_delta_frame(&parent, &child);
        let full = encode_full_frame(&child);
        assert!(delta.len() < full.len() * 3 / 4, "delta {} vs full {}", delta.len(), full.len());
        assert_eq!(decode_frame(&delta, Some(&parent), 7, 4096).expect("applies"), child);
        // Only a few parameters change: the delta is mostly bitmaps.
        let mut sparse = parent.params.clone();
        sparse[17] += 1.0;
        let sparse = weights(3, sparse);
        let delta = encode_delta_frame(&parent, &sparse);
        assert!(delta.len() < 4 * 4096 / 8 + 100, "{}", delta.len());
        assert_eq!(decode_frame(&delta, Some(&parent), 7, 4096).expect("applies"), sparse);
    }

    #[test]
    fn delta_against_the_wrong_parent_is_refused() {
        let a = weights(1, vec![1.0, 2.0]);
        let b = weights(2, vec![1.5, 2.0]);
        let c = weights(5, vec![9.0, 9.0]);
        let delta = encode_delta_frame(&a, &b);
        assert_eq!(decode_frame(&delta, Some(&c), 7, 2).unwrap_err().reason(), "mismatch");
        assert_eq!(decode_frame(&delta, None, 7, 2).unwrap_err().reason(), "mismatch");
        // Same version number, other content: the digest after reconstruction catches it.
        let forged_base = weights(1, vec![1.0, 2.5]);
        assert_eq!(decode_frame(&delta, Some(&forged_base), 7, 2).unwrap_err().reason(), "checksum");
    }

    #[test]
    fn every_bit_flip_of_a_full_frame_is_refused_and_past_the_kind_byte_reported_corrupt() {
        // The one-pass decode of full frames checks the envelope after parsing: a flip must
        // still be refused, and one in the body reported as corruption, not as whatever field
        // it hit (more than one 64 KiB block, so the pass is blocked).
        let w = weights(4, (0..40_000).map(|i| (i as f32 * 0.01).cos()).collect());
        let bytes = encode_full_frame(&w);
        let n = w.params.len();
        assert_eq!(decode_frame(&bytes, None, 7, n).expect("decodes"), w);
        let positions =
            (0..(HEADER_BYTES + FRAME_HEADER_BYTES) * 8).chain((0..64).map(|k| bytes.len() * 8 - 1 - k * 997));
        for bit in positions {
            let mut flipped = bytes.clone();
            flipped[bit / 8] ^= 1 << (bit % 8);
            let err = decode_frame(&flipped, None, 7, n).expect_err(&format!("bit {bit} flipped was accepted"));
            if bit / 8 >= HEADER_BYTES {
                assert_eq!(err.reason(), "corrupt", "bit {bit}: {err}");
            }
        }
    }

    /// Issue 46: a frame whose digest is right but whose parameters cannot be run (NaN, ±inf,
    /// or beyond `MAX_ABS_PARAM`) is refused, full or delta, so no follower applies it.
    #[test]
    fn frames_of_unusable_parameters_are_refused_despite_a_valid_digest() {
        let parent = weights(1, vec![0.5; 8]);
        for (bad, reason) in
            [(f32::NAN, "non_finite"), (f32::INFINITY, "non_finite"), (3e38, "out_of_bounds"), (-2e19, "out_of_bounds")]
        {
            let mut params = vec![0.5; 8];
            params[5] = bad;
            let child = weights(2, params);
            let full = decode_frame(&encode_full_frame(&child), None, 7, 8).expect_err("a full frame is refused");
            assert_eq!(full.reason(), reason, "{bad}: {full}");
            let delta = decode_frame(&encode_delta_frame(&parent, &child), Some(&parent), 7, 8)
                .expect_err("a delta is refused");
            assert_eq!(delta.reason(), reason, "{bad}: {delta}");
        }
        let mut edge = vec![0.5; 8];
        edge[0] = -super::super::MAX_ABS_PARAM;
        assert!(decode_frame(&encode_full_frame(&weights(3, edge)), None, 7, 8).is_ok(), "the bound itself is allowed");
    }

    #[test]
    fn frames_of_another_layout_or_size_are_refused() {
        let w = weights(1, vec![1.0, 2.0]);
        let bytes = encode_full_frame(&w);
        assert_eq!(decode_frame(&bytes, None, 8, 2).unwrap_err().reason(), "mismatch");
        assert_eq!(decode_frame(&bytes, None, 7, 3).unwrap_err().reason(), "shape");
    }

    proptest! {
        #[test]
        fn delta_reconstructs_bit_for_bit(
            base in proptest::collection::vec(any::<u32>(), 0..300),
            flips in proptest::collection::vec(any::<u32>(), 0..300),
        ) {
            let n = base.len().min(flips.len());
            // The top exponent bit cleared: finite values below 2, which `check_params` passes
            // (the flips leave that bit alone).
            let parent = weights(4, base[..n].iter().map(|&b| f32::from_bits(b & 0xbfff_ffff)).collect());
            let child = weights(9, base[..n].iter().zip(&flips).map(|(&b, &f)| f32::from_bits((b & 0xbfff_ffff) ^ (f & 0x00ff_f0ff))).collect());
            let delta = encode_delta_frame(&parent, &child);
            let got = decode_frame(&delta, Some(&parent), 7, n).expect("applies");
            prop_assert_eq!(got.params.iter().map(|p| p.to_bits()).collect::<Vec<_>>(),
                            child.params.iter().map(|p| p.to_bits()).collect::<Vec<_>>());
            prop_assert_eq!(got.checksum, child.checksum);
        }

        #[test]
        fn delta_frames_are_the_reference_encoders_bytes(
            base in proptest::collection::vec(any::<u32>(), 0..600),
            flips in proptest::collection::vec(any::<u32>(), 0..600),
            masks in proptest::collection::vec(prop_oneof![Just(0u32), Just(0xffu32), Just(0x00ff_f0ffu32), Just(u32::MAX), any::<u32>()], 4),
            sparsity in 1usize..40,
        ) {
            // Planes from all zero through sparse to dense, and lengths that leave a partial
            // group of eight at the end.
            let n = base.len().min(flips.len());
            let parent = weights(4, base[..n].iter().map(|&b| f32::from_bits(b)).collect());
            let child = weights(9, base[..n].iter().zip(&flips).enumerate().map(|(i, (&b, &f))| {
                let flip = if i % sparsity == 0 { f & masks[i % 4] } else { f & masks[0] & 0xff };
                f32::from_bits(b ^ flip)
            }).collect());
            prop_assert_eq!(encode_delta_frame(&parent, &child), reference_delta_frame(&parent, &child));
        }

        #[test]
        fn frame_decoding_never_panics(bytes in proptest::collection::vec(any::<u8>(), 0..200), n in 0usize..40) {
            let base = weights(0, vec![0.5; n]);
            let _ = decode_frame(&bytes, Some(&base), 7, n);
        }

        #[test]
        fn corrupted_deltas_are_refused(seed in proptest::collection::vec(any::<u8>(), 64), at in 0usize..10_000, bit in 0u8..8) {
            let parent = weights(1, seed.iter().map(|&b| f32::from(b) * 0.1).collect());
            let child = weights(2, seed.iter().map(|&b| f32::from(b) * 0.1 + 0.01).collect());
            let mut delta = encode_delta_frame(&parent, &child);
            let at = at % delta.len();
            delta[at] ^= 1 << bit;
            prop_assert!(decode_frame(&delta, Some(&parent), 7, 64).is_err());
        }
    }
}
