//! Observations as a process holds them and as they travel: `f32` values, or one byte per value
//! for image observations (8-bit frames, MinAtar's 0/1 planes).
//!
//! # Design (issue 44 item 3: `u8` frames end to end)
//!
//! [`Observations`] is a store of `[rows][obs_dim]` values in one of two element types,
//! `F32(Vec<f32>)` or `U8(Vec<u8>)`. The element type is chosen from the environment's
//! observation space, never from the values: an image space (`ObservationSpace::image`,
//! which MinAtar's planes and served Atari frames declare, protocol version 3, and which
//! `EnvConfig::image_shape` reports) gives `U8`, every other space `F32`. The actor fills its
//! segment buffers in that type, a [`TrajectorySegment`](super::TrajectorySegment) carries it
//! unconverted, the learner's batch keeps it, and the network converts bytes to `f32` inside
//! its first layer (the conv unfolding reads bytes; a dense first layer widens one batch into
//! a scratch). Pixel memory is a quarter of the `f32` form everywhere on that path.
//!
//! Code that reads observations branches on the variant once per segment or batch, never per
//! element, so the vector (MLP) path is the same loop over `&[f32]` as before.
//!
//! On the wire this is the two-variant enum of format 5, unchanged: `F32` (index 0; since
//! format 7 the values' little-endian bytes as one byte string, like every `f32` column:
//! `f32_bytes`) or `U8` (index 1, the bytes). Before this type a segment held `f32` values and
//! the encoder sent them as bytes when every value was a whole number in `0..=255`; such a
//! message now decodes as `U8` holding the same values, and a reader that needs `f32` widens
//! them losslessly ([`Observations::widen_into`]). An 84×84×4 stacked frame is 28 224 bytes,
//! so a 32-step segment (33 observations) is 0.93 MB (docs/ARCHITECTURE.md, "Image
//! observations").

use std::ops::Range;

use serde::{Deserialize, Deserializer, Serialize, Serializer};

/// `[rows][obs_dim]` observations in the element type of the observation space (see the
/// module documentation).
#[derive(Debug, Clone, PartialEq)]
pub enum Observations {
    /// Vector observations.
    F32(Vec<f32>),
    /// Image observations, one byte per value (pixels `0..=255`, or 0/1 planes).
    U8(Vec<u8>),
}

impl Default for Observations {
    fn default() -> Self {
        Observations::F32(Vec::new())
    }
}

/// Which element type an [`Observations`] store holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ObsElement {
    /// `f32` values.
    F32,
    /// One byte per value.
    U8,
}

impl ObsElement {
    /// `U8` for an image observation space, else `F32`.
    pub fn for_image(image: bool) -> Self {
        if image {
            ObsElement::U8
        } else {
            ObsElement::F32
        }
    }

    /// Bytes per value.
    pub fn size_bytes(self) -> usize {
        match self {
            ObsElement::F32 => 4,
            ObsElement::U8 => 1,
        }
    }
}

impl Observations {
    /// An empty store of element type `element`.
    pub fn empty(element: ObsElement) -> Self {
        match element {
            ObsElement::F32 => Observations::F32(Vec::new()),
            ObsElement::U8 => Observations::U8(Vec::new()),
        }
    }

    /// The element type.
    pub fn element(&self) -> ObsElement {
        match self {
            Observations::F32(_) => ObsElement::F32,
            Observations::U8(_) => ObsElement::U8,
        }
    }

    /// Number of values.
    pub fn len(&self) -> usize {
        match self {
            Observations::F32(values) => values.len(),
            Observations::U8(bytes) => bytes.len(),
        }
    }

    /// Whether there are no values.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Bytes the values take in memory.
    pub fn size_bytes(&self) -> usize {
        self.len() * self.element().size_bytes()
    }

    /// The values, when they are `f32`.
    pub fn as_f32(&self) -> Option<&[f32]> {
        match self {
            Observations::F32(values) => Some(values),
            Observations::U8(_) => None,
        }
    }

    /// The bytes, when they are `u8`.
    pub fn as_u8(&self) -> Option<&[u8]> {
        match self {
            Observations::F32(_) => None,
            Observations::U8(bytes) => Some(bytes),
        }
    }

    /// The values as `f32`, mutably, when they are `f32` (tests and tools edit them).
    pub fn as_f32_mut(&mut self) -> Option<&mut Vec<f32>> {
        match self {
            Observations::F32(values) => Some(values),
            Observations::U8(_) => None,
        }
    }

    /// Value `index` as `f32` (a slow path for tests and checks; loops use the slices).
    pub fn value(&self, index: usize) -> f32 {
        match self {
            Observations::F32(values) => values[index],
            Observations::U8(bytes) => f32::from(bytes[index]),
        }
    }

    /// Values `range` as `f32`, widened where they are bytes (lossless).
    pub fn widen_into(&self, range: Range<usize>, out: &mut [f32]) {
        match self {
            Observations::F32(values) => out.copy_from_slice(&values[range]),
            Observations::U8(bytes) => {
                for (out, &byte) in out.iter_mut().zip(&bytes[range]) {
                    *out = f32::from(byte);
                }
            }
        }
    }

    /// All values as `f32` (widened where they are bytes).
    pub fn to_f32_vec(&self) -> Vec<f32> {
        let mut out = vec![0.0; self.len()];
        self.widen_into(0..self.len(), &mut out);
        out
    }

    /// Clear the values, keeping the allocation and the element type.
    pub fn clear(&mut self) {
        match self {
            Observations::F32(values) => values.clear(),
            Observations::U8(bytes) => bytes.clear(),
        }
    }

    /// Reserve room for `additional` more values.
    pub fn reserve(&mut self, additional: usize) {
        match self {
            Observations::F32(values) => values.reserve(additional),
            Observations::U8(bytes) => bytes.reserve(additional),
        }
    }

    /// Append one row of `f32` values read from an environment: as they are for `F32`, as
    /// bytes for `U8` (an image space's values are whole numbers in `0..=255`, which convert
    /// exactly; anything else saturates, and [`is_byte_valued`] says which would).
    pub fn extend_from_f32(&mut self, row: &[f32]) {
        match self {
            Observations::F32(values) => values.extend_from_slice(row),
            Observations::U8(bytes) => bytes.extend(row.iter().map(|&value| value as u8)),
        }
    }

    /// Append one row of bytes: as they are for `U8`, widened for `F32`.
    pub fn extend_from_u8(&mut self, row: &[u8]) {
        match self {
            Observations::F32(values) => values.extend(row.iter().map(|&byte| f32::from(byte))),
            Observations::U8(bytes) => bytes.extend_from_slice(row),
        }
    }

    /// Make this store `len` zeros of element type `element`, keeping its allocation when the
    /// type stays the same.
    pub fn reset(&mut self, element: ObsElement, len: usize) {
        if self.element() != element {
            *self = Observations::empty(element);
        }
        match self {
            Observations::F32(values) => {
                values.clear();
                values.resize(len, 0.0);
            }
            Observations::U8(bytes) => {
                bytes.clear();
                bytes.resize(len, 0);
            }
        }
    }

    /// Overwrite the values from `dst_start` on with values `range` of `other`: a copy when the
    /// element types agree, else converted as [`extend_from`](Self::extend_from) converts.
    ///
    /// # Panics
    /// If either range is out of bounds.
    pub fn write_from(&mut self, dst_start: usize, other: &Observations, range: Range<usize>) {
        let dst_range = dst_start..dst_start + range.len();
        match (self, other) {
            (Observations::F32(dst), Observations::F32(src)) => dst[dst_range].copy_from_slice(&src[range]),
            (Observations::U8(dst), Observations::U8(src)) => dst[dst_range].copy_from_slice(&src[range]),
            (Observations::F32(dst), Observations::U8(src)) => {
                for (value, &byte) in dst[dst_range].iter_mut().zip(&src[range]) {
                    *value = f32::from(byte);
                }
            }
            (Observations::U8(dst), Observations::F32(src)) => {
                for (byte, &value) in dst[dst_range].iter_mut().zip(&src[range]) {
                    *byte = value as u8;
                }
            }
        }
    }

    /// Whether values `range` of `self` are values `other_range` of `other`, bit for bit (a
    /// byte compares as the `f32` it widens to).
    pub fn same_values(&self, range: Range<usize>, other: &Observations, other_range: Range<usize>) -> bool {
        fn mixed(floats: &[f32], bytes: &[u8]) -> bool {
            floats.len() == bytes.len()
                && floats.iter().zip(bytes).all(|(value, &byte)| value.to_bits() == f32::from(byte).to_bits())
        }
        match (self, other) {
            (Observations::F32(a), Observations::F32(b)) => {
                let (a, b) = (&a[range], &b[other_range]);
                a.len() == b.len() && a.iter().zip(b).all(|(x, y)| x.to_bits() == y.to_bits())
            }
            (Observations::U8(a), Observations::U8(b)) => a[range] == b[other_range],
            (Observations::F32(a), Observations::U8(b)) => mixed(&a[range], &b[other_range]),
            (Observations::U8(a), Observations::F32(b)) => mixed(&b[other_range], &a[range]),
        }
    }

    /// Append values `range` of `other`, converting between element types where they differ
    /// (bytes widen exactly; `f32` narrows as [`extend_from_f32`](Self::extend_from_f32) does).
    pub fn extend_from(&mut self, other: &Observations, range: Range<usize>) {
        match other {
            Observations::F32(values) => self.extend_from_f32(&values[range]),
            Observations::U8(bytes) => self.extend_from_u8(&bytes[range]),
        }
    }
}

/// The serialized form (variant order is the wire format).
///
/// The bytes go as one byte string (`serde_bytes`), which bincode lays out exactly as the
/// sequence of `u8` that format 5 wrote (the length, then the bytes), but copies in one piece
/// instead of one call per byte: an 84×84×4 segment encodes in about a tenth of the time.
#[derive(Serialize)]
enum WireObservationsRef<'a> {
    F32(#[serde(serialize_with = "super::f32_bytes::serialize")] &'a [f32]),
    U8(#[serde(with = "serde_bytes")] &'a [u8]),
}

/// Both variants decode into their own element type, the bytes copied from the message in one
/// piece.
#[derive(Deserialize)]
enum WireObservations {
    F32(#[serde(deserialize_with = "super::f32_bytes::deserialize")] Vec<f32>),
    U8(#[serde(with = "serde_bytes")] Vec<u8>),
}

impl Serialize for Observations {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        match self {
            Observations::F32(values) => WireObservationsRef::F32(values),
            Observations::U8(bytes) => WireObservationsRef::U8(bytes),
        }
        .serialize(serializer)
    }
}

impl<'de> Deserialize<'de> for Observations {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        Ok(match WireObservations::deserialize(deserializer)? {
            WireObservations::F32(values) => Observations::F32(values),
            WireObservations::U8(bytes) => Observations::U8(bytes),
        })
    }
}

/// Whether `value` survives a round trip through a byte bit for bit.
#[inline]
pub fn is_byte_valued(value: f32) -> bool {
    // `as u8` saturates, so 256.0, NaN and negative values fail the comparison.
    f32::from(value as u8).to_bits() == value.to_bits()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::wire::{decode_segment_body, encode_segment, test_segment};
    use proptest::prelude::*;

    fn round_trip(observations: Observations) -> (Observations, usize) {
        let config = bincode::config::standard();
        let bytes = bincode::serde::encode_to_vec(&observations, config).expect("encodes");
        let (decoded, used) = bincode::serde::decode_from_slice(&bytes, config).expect("decodes");
        assert_eq!(used, bytes.len());
        (decoded, bytes.len())
    }

    fn bits(values: &[f32]) -> Vec<u32> {
        values.iter().map(|v| v.to_bits()).collect()
    }

    #[test]
    fn byte_valued_means_exactly_the_whole_numbers_0_to_255() {
        for value in [0.0, 1.0, 17.0, 255.0] {
            assert!(is_byte_valued(value), "{value}");
        }
        for value in [-0.0, 0.5, 255.5, 256.0, -1.0, f32::NAN, f32::INFINITY, 1e-30] {
            assert!(!is_byte_valued(value), "{value}");
        }
    }

    #[test]
    fn image_observations_take_a_byte_each_and_vectors_four() {
        let planes: Vec<u8> = (0..400).map(|i| u8::from(i % 7 == 0)).collect();
        let (decoded, len) = round_trip(Observations::U8(planes.clone()));
        assert_eq!(decoded, Observations::U8(planes.clone()));
        // Variant tag (1) + length varint (3) + 400 bytes.
        assert_eq!(len, 1 + 3 + 400);
        // A vector store travels as `f32` whatever its values: the element type is the
        // space's, not the values'.
        let vector: Vec<f32> = planes.iter().map(|&p| f32::from(p)).collect();
        let (decoded, len) = round_trip(Observations::F32(vector.clone()));
        assert_eq!(decoded, Observations::F32(vector));
        assert_eq!(len, 1 + 3 + 4 * 400);
    }

    /// The wire form is format 5's (and 7's): a message written by the encoder before
    /// [`Observations`] existed, which sent byte-valued `f32` observations as a sequence of
    /// `u8`, decodes as bytes holding the same values; `f32` values are their little-endian
    /// bytes as one byte string.
    #[test]
    fn messages_of_the_earlier_form_decode_to_the_same_values() {
        #[derive(Serialize, Deserialize)]
        enum SequenceForm {
            F32(#[serde(with = "serde_bytes")] Vec<u8>),
            U8(Vec<u8>),
        }
        let config = bincode::config::standard();
        let pixels: Vec<u8> = (0..=255).chain(0..100).collect();
        let sequence = bincode::serde::encode_to_vec(SequenceForm::U8(pixels.clone()), config).expect("encodes");
        let new = bincode::serde::encode_to_vec(Observations::U8(pixels.clone()), config).expect("encodes");
        assert_eq!(new, sequence);
        let (decoded, used) = bincode::serde::decode_from_slice::<Observations, _>(&sequence, config).expect("decodes");
        assert_eq!(used, sequence.len());
        let widened: Vec<f32> = pixels.iter().map(|&p| f32::from(p)).collect();
        assert_eq!(decoded.to_f32_vec(), widened, "the values the earlier decoder widened them to");
        let floats = vec![0.5f32, -1.0];
        let new = bincode::serde::encode_to_vec(Observations::F32(floats.clone()), config).expect("encodes");
        let le_bytes: Vec<u8> = floats.iter().flat_map(|v| v.to_le_bytes()).collect();
        assert_eq!(new, bincode::serde::encode_to_vec(SequenceForm::F32(le_bytes), config).expect("encodes"));
    }

    #[test]
    fn a_minatar_segment_encodes_in_about_a_quarter_of_the_bytes() {
        let mut segment = test_segment("pixels", 32, 400, 0);
        let planes: Vec<u8> = (0..33 * 400).map(|i| u8::from(i % 5 == 0)).collect();
        segment.observations = Observations::U8(planes.clone());
        let bytes = encode_segment(&segment);
        let decoded = decode_segment_body(&bytes).expect("decodes");
        assert_eq!(decoded, segment);
        let mut as_floats = segment.clone();
        as_floats.observations = Observations::F32(planes.iter().map(|&p| f32::from(p)).collect());
        let float_bytes = encode_segment(&as_floats).len();
        assert!(bytes.len() * 3 < float_bytes, "{} bytes as u8, {float_bytes} as f32", bytes.len());
    }

    #[test]
    fn rows_convert_between_element_types_exactly() {
        let mut bytes = Observations::empty(ObsElement::U8);
        bytes.extend_from_f32(&[0.0, 1.0, 255.0]);
        assert_eq!(bytes, Observations::U8(vec![0, 1, 255]));
        let mut floats = Observations::empty(ObsElement::F32);
        floats.extend_from(&bytes, 1..3);
        assert_eq!(floats, Observations::F32(vec![1.0, 255.0]));
        bytes.extend_from(&floats, 0..1);
        assert_eq!(bytes.as_u8(), Some(&[0, 1, 255, 1][..]));
        assert_eq!((bytes.len(), bytes.size_bytes(), floats.size_bytes()), (4, 4, 8));
    }

    proptest! {
        /// Any `f32` observations decode to the identical bits.
        #[test]
        fn vector_observations_round_trip_bit_for_bit(
            values in prop::collection::vec(
                prop_oneof![
                    (0u8..=255).prop_map(f32::from),
                    Just(-0.0f32),
                    Just(256.0f32),
                    (-300.0f32..300.0),
                    any::<f32>().prop_filter("finite", |v| v.is_finite()),
                ],
                0..64,
            ),
        ) {
            let (decoded, _) = round_trip(Observations::F32(values.clone()));
            let decoded = decoded.as_f32().expect("f32 stays f32").to_vec();
            prop_assert_eq!(bits(&decoded), bits(&values));
        }

        /// Frames round-trip as bytes, a byte each plus the tag and length.
        #[test]
        fn frames_round_trip_as_bytes(pixels in prop::collection::vec(any::<u8>(), 0..300)) {
            let (decoded, len) = round_trip(Observations::U8(pixels.clone()));
            prop_assert_eq!(decoded, Observations::U8(pixels.clone()));
            prop_assert!(len <= 1 + 3 + pixels.len());
        }

        /// Decoding arbitrary bytes as observations never panics.
        #[test]
        fn decoding_arbitrary_bytes_never_panics(bytes in prop::collection::vec(any::<u8>(), 0..64)) {
            let config = bincode::config::standard().with_limit::<4096>();
            let _ = bincode::serde::decode_from_slice::<Observations, _>(&bytes, config);
        }
    }
}
