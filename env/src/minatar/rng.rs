//! numpy's legacy `RandomState`: the 32-bit Mersenne Twister MT19937 (Matsumoto and Nishimura
//! 1998) with numpy's seeding and exactly the draws the reference MinAtar makes, so a game seeded
//! here produces the same stream as `numpy.random.RandomState(seed)` in Python.
//!
//! The draws reproduced:
//! - [`RandomState::rand`] is `RandomState.rand()` / `random_sample()`: a 53-bit double from two
//!   32-bit outputs, `((a >> 5) * 2^26 + (b >> 6)) / 2^53`.
//! - [`RandomState::randint`] is `RandomState.randint(low, high)` for the default `int64` dtype:
//!   numpy's legacy bounded integers (`random_bounded_uint64_fill` with `use_masked = true`).
//!   For a range `rng = high - 1 - low` below `2^32 - 1` it draws 32-bit outputs, masks them with
//!   the smallest all-ones mask covering `rng` and rejects values above `rng`; a range of zero
//!   returns `low` without drawing.
//!
//! Seeding follows numpy's `_legacy_seeding`: an integer seed in `0..2^32` goes through
//! `init_genrand`, an array of 32-bit words through `init_by_array`.

use serde::{Deserialize, Serialize};

/// Words in the MT19937 state.
pub const STATE_WORDS: usize = 624;
/// The twist offset `m` of MT19937.
const SHIFT_M: usize = 397;
const MATRIX_A: u32 = 0x9908_b0df;
const UPPER_MASK: u32 = 0x8000_0000;
const LOWER_MASK: u32 = 0x7fff_ffff;

/// numpy's `RandomState` over MT19937 (see the [module documentation](self)).
#[derive(Clone, PartialEq, Eq)]
pub struct RandomState {
    key: [u32; STATE_WORDS],
    /// Index of the next word of `key` to temper; `STATE_WORDS` means "twist first".
    pos: usize,
}

impl std::fmt::Debug for RandomState {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RandomState").field("key[0]", &self.key[0]).field("pos", &self.pos).finish_non_exhaustive()
    }
}

impl RandomState {
    /// `numpy.random.RandomState(seed)` for an integer seed (`init_genrand`).
    pub fn from_seed(seed: u32) -> Self {
        let mut key = [0u32; STATE_WORDS];
        key[0] = seed;
        for idx in 1..STATE_WORDS {
            let prev = key[idx - 1];
            key[idx] = 1_812_433_253u32.wrapping_mul(prev ^ (prev >> 30)).wrapping_add(idx as u32);
        }
        Self { key, pos: STATE_WORDS }
    }

    /// `numpy.random.RandomState([w0, w1, ...])` for a non-empty array of 32-bit words
    /// (`init_by_array`). An empty slice, which numpy refuses, is treated as `[0]`.
    pub fn from_words(words: &[u32]) -> Self {
        let words = if words.is_empty() { &[0u32][..] } else { words };
        let mut state = Self::from_seed(19_650_218);
        let key = &mut state.key;
        let (mut i, mut j) = (1usize, 0usize);
        for _ in 0..STATE_WORDS.max(words.len()) {
            let prev = key[i - 1];
            key[i] =
                (key[i] ^ (prev ^ (prev >> 30)).wrapping_mul(1_664_525)).wrapping_add(words[j]).wrapping_add(j as u32);
            i += 1;
            j += 1;
            if i >= STATE_WORDS {
                key[0] = key[STATE_WORDS - 1];
                i = 1;
            }
            if j >= words.len() {
                j = 0;
            }
        }
        for _ in 0..STATE_WORDS - 1 {
            let prev = key[i - 1];
            key[i] = (key[i] ^ (prev ^ (prev >> 30)).wrapping_mul(1_566_083_941)).wrapping_sub(i as u32);
            i += 1;
            if i >= STATE_WORDS {
                key[0] = key[STATE_WORDS - 1];
                i = 1;
            }
        }
        // The most significant bit is set so the state is never all zeros.
        key[0] = 0x8000_0000;
        state.pos = STATE_WORDS;
        state
    }

    /// Volley's seeding of a 64-bit environment seed: numpy's integer seeding for seeds below
    /// `2^32` (so `reset(7)` equals `RandomState(7)`), and for larger seeds the array seeding of
    /// the two 32-bit halves, `RandomState([seed & 0xffffffff, seed >> 32])`.
    pub fn from_u64_seed(seed: u64) -> Self {
        match u32::try_from(seed) {
            Ok(small) => Self::from_seed(small),
            Err(_) => Self::from_words(&[seed as u32, (seed >> 32) as u32]),
        }
    }

    /// Regenerate all 624 words (the MT19937 "twist").
    fn twist(&mut self) {
        let key = &mut self.key;
        for idx in 0..STATE_WORDS {
            let y = (key[idx] & UPPER_MASK) | (key[(idx + 1) % STATE_WORDS] & LOWER_MASK);
            let mag = if y & 1 == 1 { MATRIX_A } else { 0 };
            key[idx] = key[(idx + SHIFT_M) % STATE_WORDS] ^ (y >> 1) ^ mag;
        }
        self.pos = 0;
    }

    /// The next raw 32-bit output (`genrand_int32`).
    #[inline]
    pub fn next_u32(&mut self) -> u32 {
        if self.pos >= STATE_WORDS {
            self.twist();
        }
        let mut y = self.key[self.pos];
        self.pos += 1;
        y ^= y >> 11;
        y ^= (y << 7) & 0x9d2c_5680;
        y ^= (y << 15) & 0xefc6_0000;
        y ^= y >> 18;
        y
    }

    /// `RandomState.rand()`: a double uniform in `[0, 1)` with 53 random bits.
    #[inline]
    pub fn rand(&mut self) -> f64 {
        let a = self.next_u32() >> 5;
        let b = self.next_u32() >> 6;
        (f64::from(a) * 67_108_864.0 + f64::from(b)) / 9_007_199_254_740_992.0
    }

    /// `RandomState.randint(low, high)`: an integer uniform in `low..high` by numpy's legacy
    /// masked rejection sampling. Requires `low < high` and `high - low <= 2^32`, the ranges
    /// MinAtar uses; `high <= low` returns `low` without drawing.
    #[inline]
    pub fn randint(&mut self, low: i64, high: i64) -> i64 {
        let range = high.saturating_sub(low).saturating_sub(1);
        if range <= 0 {
            return low;
        }
        let range = u32::try_from(range).unwrap_or(u32::MAX);
        if range == u32::MAX {
            return low + i64::from(self.next_u32());
        }
        let mask = u32::MAX >> range.leading_zeros();
        loop {
            let value = self.next_u32() & mask;
            if value <= range {
                return low + i64::from(value);
            }
        }
    }

    /// The generator's state as a snapshot: the 624 words (little-endian) and the position.
    pub fn to_snapshot(&self) -> RandomStateSnapshot {
        let mut key = Vec::with_capacity(STATE_WORDS * 4);
        for word in &self.key {
            key.extend_from_slice(&word.to_le_bytes());
        }
        RandomStateSnapshot { key, pos: self.pos as u16 }
    }

    /// Rebuild a generator from [`RandomState::to_snapshot`]; `None` when the words are not 624
    /// or the position is past the end.
    pub fn from_snapshot(snapshot: &RandomStateSnapshot) -> Option<Self> {
        if snapshot.key.len() != STATE_WORDS * 4 || usize::from(snapshot.pos) > STATE_WORDS {
            return None;
        }
        let mut key = [0u32; STATE_WORDS];
        for (word, bytes) in key.iter_mut().zip(snapshot.key.chunks_exact(4)) {
            *word = u32::from_le_bytes(bytes.try_into().expect("chunks of four bytes"));
        }
        Some(Self { key, pos: usize::from(snapshot.pos) })
    }
}

/// A [`RandomState`] as snapshot bytes: the key as raw little-endian bytes (2,496) rather than
/// 624 varints, which would take up to 3,120.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct RandomStateSnapshot {
    #[serde(with = "serde_bytes")]
    key: Vec<u8>,
    pos: u16,
}

#[cfg(test)]
mod tests {
    use super::*;

    // Golden values printed by numpy 2.4.6 (legacy RandomState, unchanged since numpy 1.17):
    //
    //   import struct, numpy as np
    //   bits = lambda x: hex(struct.unpack('<Q', struct.pack('<d', float(x)))[0])
    //   r = np.random.RandomState(5489); r.randint(0, 2**32, size=5, dtype=np.uint64)
    //   r = np.random.RandomState(0); s = r.get_state(); s[1][:3], s[1][-1], s[2]
    //   r = np.random.RandomState(0); [bits(x) for x in r.rand(4)]
    //   r = np.random.RandomState(42); [int(r.randint(2)) for _ in range(10)]
    //   r = np.random.RandomState(42); [int(r.randint(low=1, high=9)) for _ in range(10)]
    //   r = np.random.RandomState(42); r.randint(1, 6, 8).tolist(), r.rand()
    //   r = np.random.RandomState(42); [int(r.randint(1)) for _ in range(3)], bits(r.rand())
    //   r = np.random.RandomState(42); [int(r.randint(5)) for _ in range(10)]
    //   r = np.random.RandomState([0x12345678, 0x9abcdef0]); [bits(x) for x in r.rand(3)]
    //   r = np.random.RandomState(2**32 - 1); [bits(x) for x in r.rand(2)]
    //   r = np.random.RandomState(1)
    //   bits(r.rand()), int(r.randint(7)), bits(r.rand()), int(r.randint(3)), [bits(x) for x in r.rand(2)]

    fn rand_bits(rng: &mut RandomState, n: usize) -> Vec<u64> {
        (0..n).map(|_| rng.rand().to_bits()).collect()
    }

    #[test]
    fn raw_outputs_match_the_reference_mt19937() {
        // 5489 is MT19937's default seed; these are its well-known first outputs.
        let mut rng = RandomState::from_seed(5489);
        let outputs: Vec<u32> = (0..5).map(|_| rng.next_u32()).collect();
        assert_eq!(outputs, [3_499_211_612, 581_869_302, 3_890_346_734, 3_586_334_585, 545_404_204]);
        // numpy's 64-bit-range randint takes a raw 32-bit output.
        let mut rng = RandomState::from_seed(5489);
        assert_eq!(rng.randint(0, 1 << 32), 3_499_211_612);
    }

    #[test]
    fn integer_seeding_matches_numpy_state() {
        let rng = RandomState::from_seed(0);
        assert_eq!(rng.key[..3], [0, 1, 1_812_433_255]);
        assert_eq!(rng.key[STATE_WORDS - 1], 1_796_872_496);
        assert_eq!(rng.pos, STATE_WORDS);
    }

    #[test]
    fn rand_matches_numpy() {
        let mut rng = RandomState::from_seed(0);
        assert_eq!(
            rand_bits(&mut rng, 4),
            [0x3fe18fe1565f12a8, 0x3fe6e2d4cf608733, 0x3fe349d66b6e894b, 0x3fe16faedb6395f5]
        );
        let mut rng = RandomState::from_seed(u32::MAX);
        assert_eq!(rand_bits(&mut rng, 2), [0x3fb8fe69a3924820, 0x3fed323d824032b1]);
    }

    #[test]
    fn array_seeding_matches_numpy() {
        let mut rng = RandomState::from_words(&[0x1234_5678, 0x9abc_def0]);
        assert_eq!(rand_bits(&mut rng, 3), [0x3feb6e44c0a90254, 0x3fe1f5a0ae8bb77b, 0x3fe51356627e0d1f]);
        let mut rng = RandomState::from_u64_seed(0x9abc_def0_1234_5678);
        assert_eq!(rand_bits(&mut rng, 1), [0x3feb6e44c0a90254]);
        assert_eq!(RandomState::from_u64_seed(7), RandomState::from_seed(7));
    }

    #[test]
    fn randint_matches_numpy_masked_rejection() {
        let mut rng = RandomState::from_seed(42);
        let draws: Vec<i64> = (0..10).map(|_| rng.randint(0, 2)).collect();
        assert_eq!(draws, [0, 1, 0, 0, 0, 1, 0, 0, 0, 1]);
        let mut rng = RandomState::from_seed(42);
        let draws: Vec<i64> = (0..10).map(|_| rng.randint(1, 9)).collect();
        assert_eq!(draws, [7, 4, 5, 7, 3, 8, 5, 5, 7, 2]);
        // A range of 5 needs mask 7 and rejects 5, 6 and 7.
        let mut rng = RandomState::from_seed(42);
        let draws: Vec<i64> = (0..10).map(|_| rng.randint(0, 5)).collect();
        assert_eq!(draws, [3, 4, 2, 4, 4, 1, 2, 2, 2, 4]);
        let mut rng = RandomState::from_seed(42);
        let draws: Vec<i64> = (0..8).map(|_| rng.randint(1, 6)).collect();
        assert_eq!(draws, [4, 5, 3, 5, 5, 2, 3, 3]);
        assert_eq!(rng.rand().to_bits(), 0x3fdd645576ededc2);
    }

    #[test]
    fn randint_of_one_value_draws_nothing() {
        let mut rng = RandomState::from_seed(42);
        assert_eq!([rng.randint(0, 1), rng.randint(0, 1), rng.randint(0, 1)], [0, 0, 0]);
        assert_eq!(rng.rand().to_bits(), 0x3fd7f8771e5f51ec);
        assert_eq!(rng, {
            let mut fresh = RandomState::from_seed(42);
            fresh.rand();
            fresh
        });
    }

    #[test]
    fn interleaved_draws_match_numpy() {
        let mut rng = RandomState::from_seed(1);
        assert_eq!(rng.rand().to_bits(), 0x3fdab07d0ffa3c06);
        assert_eq!(rng.randint(0, 7), 4);
        assert_eq!(rng.rand().to_bits(), 0x3fedd78288001dfb);
        assert_eq!(rng.randint(0, 3), 1);
        assert_eq!(rand_bits(&mut rng, 2), [0x3fd3596ab7fe08f4, 0x3fc2c8e5a3c7053c]);
    }

    #[test]
    fn long_streams_cross_twists_and_snapshots_resume_them() {
        let mut rng = RandomState::from_seed(3);
        for _ in 0..1000 {
            rng.next_u32();
        }
        let snapshot = rng.to_snapshot();
        let mut restored = RandomState::from_snapshot(&snapshot).expect("own snapshot");
        let expected: Vec<u32> = (0..2000).map(|_| rng.next_u32()).collect();
        let replayed: Vec<u32> = (0..2000).map(|_| restored.next_u32()).collect();
        assert_eq!(expected, replayed);
        let bad = RandomStateSnapshot { key: vec![0; 12], pos: 0 };
        assert!(RandomState::from_snapshot(&bad).is_none());
        let bad = RandomStateSnapshot { key: vec![0; STATE_WORDS * 4], pos: 625 };
        assert!(RandomState::from_snapshot(&bad).is_none());
    }
}
