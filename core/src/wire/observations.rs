//! How a segment's observations travel: as one byte each when every value is a whole number in
//! `0..=255` (image observations such as MinAtar's 0/1 planes or 8-bit frames), else as `f32`.
//!
//! The choice is made per segment when it is encoded and is lossless either way: a value
//! travels as a byte only if that byte converts back to the identical `f32` bits (so `-0.0`,
//! `0.5` or `256.0` keep the segment in `f32`). On the wire this is a two-variant enum,
//! `F32(Vec<f32>)` (index 0; since format 7 the values' little-endian bytes as one byte
//! string, like every `f32` column: `f32_bytes`) or `U8(Vec<u8>)` (index 1), in place of the
//! plain `Vec<f32>` of format 4. Pixel observations are a quarter of the bytes this way: an
//! 84×84×4 stacked frame is 28 224 bytes, so a 32-step segment (33 observations) is 0.93 MB
//! (docs/ARCHITECTURE.md, "Image observations").

use serde::{Deserialize, Deserializer, Serialize, Serializer};

/// The serialized form (variant order is the wire format).
///
/// The bytes go as one byte string (`serde_bytes`), which bincode lays out exactly as the
/// sequence of `u8` that format 5 wrote (the length, then the bytes), but copies in one piece
/// instead of one call per byte: an 84×84×4 segment encodes in about a tenth of the time.
#[derive(Serialize)]
enum WireObservationsRef<'a> {
    F32(#[serde(serialize_with = "super::f32_bytes::serialize")] &'a [f32]),
    U8(#[serde(with = "serde_bytes")] Vec<u8>),
}

/// Both variants decode straight into the `f32` values the learner uses: bytes are widened
/// from the message as they are read, with no intermediate `Vec<u8>`.
#[derive(Deserialize)]
enum WireObservations {
    F32(#[serde(deserialize_with = "super::f32_bytes::deserialize")] Vec<f32>),
    U8(#[serde(deserialize_with = "widen_bytes")] Vec<f32>),
}

/// A byte string, each byte widened to its `f32` value.
fn widen_bytes<'de, D: Deserializer<'de>>(deserializer: D) -> Result<Vec<f32>, D::Error> {
    struct Widen;
    impl serde::de::Visitor<'_> for Widen {
        type Value = Vec<f32>;

        fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
            f.write_str("a byte string of observations")
        }

        fn visit_bytes<E: serde::de::Error>(self, bytes: &[u8]) -> Result<Vec<f32>, E> {
            Ok(bytes.iter().map(|&byte| f32::from(byte)).collect())
        }
    }
    deserializer.deserialize_bytes(Widen)
}

/// Whether `value` survives a round trip through a byte bit for bit.
#[inline]
pub fn is_byte_valued(value: f32) -> bool {
    // `as u8` saturates, so 256.0, NaN and negative values fail the comparison.
    f32::from(value as u8).to_bits() == value.to_bits()
}

/// `#[serde(serialize_with)]` for `TrajectorySegment::observations`.
pub(crate) fn serialize<S: Serializer>(observations: &[f32], serializer: S) -> Result<S::Ok, S::Error> {
    if observations.iter().all(|&value| is_byte_valued(value)) {
        WireObservationsRef::U8(observations.iter().map(|&value| value as u8).collect()).serialize(serializer)
    } else {
        WireObservationsRef::F32(observations).serialize(serializer)
    }
}

/// `#[serde(deserialize_with)]` for `TrajectorySegment::observations`.
pub(crate) fn deserialize<'de, D: Deserializer<'de>>(deserializer: D) -> Result<Vec<f32>, D::Error> {
    Ok(match WireObservations::deserialize(deserializer)? {
        WireObservations::F32(values) | WireObservations::U8(values) => values,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::wire::{decode_segment_body, encode_segment, test_segment};
    use proptest::prelude::*;

    #[derive(Debug, PartialEq, Serialize, Deserialize)]
    struct Holder(#[serde(serialize_with = "serialize", deserialize_with = "deserialize")] Vec<f32>);

    fn round_trip(values: Vec<f32>) -> (Vec<f32>, usize) {
        let config = bincode::config::standard();
        let bytes = bincode::serde::encode_to_vec(Holder(values), config).expect("encodes");
        let (Holder(decoded), used) = bincode::serde::decode_from_slice(&bytes, config).expect("decodes");
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
    fn image_observations_take_a_byte_each_and_others_four() {
        let planes: Vec<f32> = (0..400).map(|i| f32::from(u8::from(i % 7 == 0))).collect();
        let (decoded, len) = round_trip(planes.clone());
        assert_eq!(decoded, planes);
        // Variant tag (1) + length varint (3) + 400 bytes.
        assert_eq!(len, 1 + 3 + 400);
        let mut vector = planes.clone();
        vector[3] = 0.25;
        let (decoded, len) = round_trip(vector.clone());
        assert_eq!(decoded, vector);
        assert_eq!(len, 1 + 3 + 4 * 400);
    }

    #[test]
    fn byte_observations_keep_the_layout_of_a_byte_sequence() {
        // The byte string is the bytes a `Vec<u8>` sequence encodes to (the form before it),
        // both ways, with a length that needs a multi-byte varint; `f32` values are their
        // little-endian bytes as one byte string (format 7).
        #[derive(Serialize, Deserialize)]
        enum SequenceForm {
            F32(#[serde(with = "serde_bytes")] Vec<u8>),
            U8(Vec<u8>),
        }
        let config = bincode::config::standard();
        let pixels: Vec<u8> = (0..=255).chain(0..100).collect();
        let values: Vec<f32> = pixels.iter().map(|&p| f32::from(p)).collect();
        let new = bincode::serde::encode_to_vec(Holder(values.clone()), config).expect("encodes");
        let sequence = bincode::serde::encode_to_vec(SequenceForm::U8(pixels), config).expect("encodes");
        assert_eq!(new, sequence);
        let (Holder(decoded), used) =
            bincode::serde::decode_from_slice::<Holder, _>(&sequence, config).expect("decodes");
        assert_eq!((decoded, used), (values, sequence.len()));
        let floats = vec![0.5f32, -1.0];
        let new = bincode::serde::encode_to_vec(Holder(floats.clone()), config).expect("encodes");
        let le_bytes: Vec<u8> = floats.iter().flat_map(|v| v.to_le_bytes()).collect();
        assert_eq!(new, bincode::serde::encode_to_vec(SequenceForm::F32(le_bytes), config).expect("encodes"));
    }

    #[test]
    fn a_minatar_segment_encodes_in_about_a_quarter_of_the_bytes() {
        let mut segment = test_segment("pixels", 32, 400, 0);
        segment.observations = (0..33 * 400).map(|i| f32::from(u8::from(i % 5 == 0))).collect();
        let bytes = encode_segment(&segment);
        let decoded = decode_segment_body(&bytes).expect("decodes");
        assert_eq!(decoded, segment);
        let mut as_floats = segment.clone();
        as_floats.observations[0] = 0.5;
        let float_bytes = encode_segment(&as_floats).len();
        assert!(bytes.len() * 3 < float_bytes, "{} bytes as u8, {float_bytes} as f32", bytes.len());
    }

    proptest! {
        /// Any observations decode to the identical bits, whichever form they travel in.
        #[test]
        fn observations_round_trip_bit_for_bit(
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
            let (decoded, _) = round_trip(values.clone());
            prop_assert_eq!(bits(&decoded), bits(&values));
        }

        /// Byte-valued observations (pixels) round-trip and always travel as bytes.
        #[test]
        fn pixels_round_trip_as_bytes(pixels in prop::collection::vec(any::<u8>(), 0..300)) {
            let values: Vec<f32> = pixels.iter().map(|&p| f32::from(p)).collect();
            let (decoded, len) = round_trip(values.clone());
            prop_assert_eq!(&decoded, &values);
            prop_assert!(len <= 1 + 3 + values.len());
        }
    }
}
