//! `f32` columns on the wire as one byte string: the length in bytes (bincode's varint),
//! then the values' little-endian bytes (wire format 7).
//!
//! Format 6 wrote a `Vec<f32>` as serde's sequence: the element count, then each value by
//! its own call into bincode's writer (and read it back the same way). As one byte string a
//! column is copied in one piece each way: 8 segments of 64 KB encode in half the time, and
//! an 84×84 `f32` frame segment decodes without 233 K calls, about twice as fast
//! (docs/benchmarks/distributed.md, "`f32` columns as bytes"). A byte length that is not a
//! whole number of values is refused as malformed.

use serde::de::{Error, Visitor};
use serde::{Deserializer, Serializer};
use std::fmt;

/// `#[serde(serialize_with)]` for a `Vec<f32>` (or `[f32]`) column.
pub(crate) fn serialize<S: Serializer>(values: &[f32], serializer: S) -> Result<S::Ok, S::Error> {
    #[cfg(target_endian = "little")]
    {
        use zerocopy::IntoBytes;
        serializer.serialize_bytes(values.as_bytes())
    }
    #[cfg(not(target_endian = "little"))]
    {
        let bytes: Vec<u8> = values.iter().flat_map(|value| value.to_le_bytes()).collect();
        serializer.serialize_bytes(&bytes)
    }
}

/// `#[serde(deserialize_with)]` for a `Vec<f32>` column.
pub(crate) fn deserialize<'de, D: Deserializer<'de>>(deserializer: D) -> Result<Vec<f32>, D::Error> {
    deserializer.deserialize_bytes(F32Bytes)
}

/// The values of `bytes`, little-endian, or `None` if they are not a whole number of values.
fn from_le_bytes(bytes: &[u8]) -> Option<Vec<f32>> {
    if !bytes.len().is_multiple_of(4) {
        return None;
    }
    Some(bytes.chunks_exact(4).map(|c| f32::from_le_bytes(c.try_into().expect("4 bytes"))).collect())
}

struct F32Bytes;

impl Visitor<'_> for F32Bytes {
    type Value = Vec<f32>;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("a byte string of little-endian f32 values")
    }

    fn visit_bytes<E: Error>(self, bytes: &[u8]) -> Result<Vec<f32>, E> {
        from_le_bytes(bytes)
            .ok_or_else(|| E::custom(format!("{} bytes of f32 values (not a multiple of 4)", bytes.len())))
    }
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;
    use serde::{Deserialize, Serialize};

    #[derive(Debug, Serialize, Deserialize)]
    struct Holder(#[serde(with = "super")] Vec<f32>);

    fn config() -> bincode::config::Configuration {
        bincode::config::standard()
    }

    #[test]
    fn the_layout_is_the_byte_length_then_the_little_endian_values() {
        let bytes = bincode::serde::encode_to_vec(Holder(vec![1.0, -2.5]), config()).expect("encodes");
        let mut expected = vec![8u8];
        expected.extend_from_slice(&1.0f32.to_le_bytes());
        expected.extend_from_slice(&(-2.5f32).to_le_bytes());
        assert_eq!(bytes, expected);
    }

    #[test]
    fn a_length_that_is_not_whole_values_is_refused() {
        // Length 5, five bytes: one value and a stray byte.
        let bytes = [5u8, 0, 0, 128, 63, 7];
        let err = bincode::serde::decode_from_slice::<Holder, _>(&bytes, config()).expect_err("refused");
        assert!(err.to_string().contains("not a multiple of 4"), "{err}");
    }

    proptest! {
        #[test]
        fn values_round_trip_bit_for_bit(bits in proptest::collection::vec(any::<u32>(), 0..300)) {
            let values: Vec<f32> = bits.iter().map(|&b| f32::from_bits(b)).collect();
            let bytes = bincode::serde::encode_to_vec(Holder(values), config()).expect("encodes");
            let (Holder(decoded), used) =
                bincode::serde::decode_from_slice::<Holder, _>(&bytes, config()).expect("decodes");
            prop_assert_eq!(used, bytes.len());
            prop_assert_eq!(decoded.iter().map(|v| v.to_bits()).collect::<Vec<_>>(), bits);
        }
    }
}
