//! The learner's duplicate filter: skips a segment the broker delivers again after the learner
//! used it (at-least-once delivery: an ack lost in a broker restart, a redelivery after
//! `ack_wait`).
//!
//! A segment is identified by its stream, (actor, incarnation, env_idx), and its
//! `segment_idx`, which the actor counts up by one per segment of that environment. So the
//! filter keeps, per stream, the newest index seen and a bitmap of the [`STREAM_WINDOW`]
//! indices below it, and a bounded table of streams, the least recently used forgotten first.
//! One honest run has a few streams per actor, and the table stays in the cache: issue 16
//! measured the filter it replaces (a set of the last 100,000 keys, 7.5 MB touched at random)
//! at 0.6 µs per segment in the learner's loop.
//!
//! What it cannot tell it lets through: a segment further behind its stream's newest than the
//! window, or of a stream forgotten, is taken as new. Both happen to honest runs only when a
//! segment is so old that the lag bound drops it as stale anyway. A forged segment index
//! (2⁶⁴ − 1, say) moves its stream's window past the honest segments, which are then let
//! through unfiltered: it can never make the filter refuse them (docs/SECURITY.md).

use std::collections::HashMap;

use volley_core::wire::TrajectorySegment;

/// Segment indices remembered per stream, back from the newest one seen.
pub const STREAM_WINDOW: u64 = 256;

const WORDS: usize = (STREAM_WINDOW / 64) as usize;

/// Streams remembered by default: 16,384, twice the environments of 64 actors of 128.
pub const SEEN_STREAMS: usize = 16_384;

/// (XXH3 of the actor id, incarnation, env_idx): one environment's segments in one actor
/// process, in a fixed 24 bytes whatever the actor id's length.
type StreamKey = (u64, u64, u32);

/// What the filter says of a segment.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Seen {
    /// Not seen before: learn from it.
    New,
    /// Seen before: skip it.
    Duplicate,
    /// Further behind its stream's newest index than [`STREAM_WINDOW`]: the filter cannot
    /// tell, and lets it through.
    BeyondWindow,
}

/// One stream's recent segment indices.
#[derive(Debug, Clone, Copy)]
struct Stream {
    /// The highest segment index seen.
    newest: u64,
    /// Bit `age` (word `age / 64`, bit `age % 64`): segment `newest - age` seen.
    bits: [u64; WORDS],
}

impl Stream {
    fn first(idx: u64) -> Self {
        let mut bits = [0; WORDS];
        bits[0] = 1;
        Stream { newest: idx, bits }
    }

    fn insert(&mut self, idx: u64) -> Seen {
        if idx > self.newest {
            self.advance(idx - self.newest);
            self.newest = idx;
            self.bits[0] |= 1;
            return Seen::New;
        }
        let age = self.newest - idx;
        if age >= STREAM_WINDOW {
            return Seen::BeyondWindow;
        }
        let (word, bit) = ((age / 64) as usize, 1u64 << (age % 64));
        if self.bits[word] & bit != 0 {
            return Seen::Duplicate;
        }
        self.bits[word] |= bit;
        Seen::New
    }

    /// Ages every remembered index by `by` (the bitmap shifted towards the old end).
    fn advance(&mut self, by: u64) {
        if by >= STREAM_WINDOW {
            self.bits = [0; WORDS];
            return;
        }
        let (words, bits) = ((by / 64) as usize, (by % 64) as u32);
        for i in (0..WORDS).rev() {
            let from = |j: usize| if j >= words { self.bits[j - words] } else { 0 };
            let high = from(i) << bits;
            let carried = if bits > 0 && i > words { from(i - 1) >> (64 - bits) } else { 0 };
            self.bits[i] = high | carried;
        }
    }
}

/// The duplicate filter (see the module's doc). Bounded in streams, and so in bytes: at most
/// [`SeenSegments::max_bytes`] whatever the segments claim (issue 12).
///
/// The table is two generations of at most half the streams each: a stream is looked up in
/// the recent one, then in the older one (and moved to the recent one); when the recent one
/// is full it becomes the older one and the older one is emptied. So a stream is forgotten
/// only after half the table's worth of other streams came without it in between, at O(1)
/// per segment, with no per-entry bookkeeping.
pub struct SeenSegments {
    recent: HashMap<StreamKey, Stream>,
    older: HashMap<StreamKey, Stream>,
    /// Streams per generation.
    generation: usize,
}

impl SeenSegments {
    /// Remember at most `streams` streams (at least 2).
    pub fn new(streams: usize) -> Self {
        SeenSegments { recent: HashMap::new(), older: HashMap::new(), generation: (streams / 2).max(1) }
    }

    /// Record a segment; false if it was seen before.
    pub fn insert(&mut self, segment: &TrajectorySegment) -> bool {
        self.check(segment) != Seen::Duplicate
    }

    /// Record a segment and say what the filter knew of it.
    pub fn check(&mut self, segment: &TrajectorySegment) -> Seen {
        let actor = volley_core::wire::id_hash(segment.actor.as_str().as_bytes());
        self.check_key((actor, segment.incarnation, segment.env_idx), segment.segment_idx)
    }

    fn check_key(&mut self, key: StreamKey, idx: u64) -> Seen {
        if let Some(stream) = self.recent.get_mut(&key) {
            return stream.insert(idx);
        }
        let (stream, seen) = match self.older.remove(&key) {
            Some(mut stream) => {
                let seen = stream.insert(idx);
                (stream, seen)
            }
            None => (Stream::first(idx), Seen::New),
        };
        if self.recent.len() >= self.generation {
            std::mem::swap(&mut self.recent, &mut self.older);
            self.recent.clear();
        }
        self.recent.insert(key, stream);
        seen
    }

    /// Streams remembered.
    pub fn len(&self) -> usize {
        self.recent.len() + self.older.len()
    }

    /// Whether no stream is remembered.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Heap bytes the filter holds: its two tables' buckets (an entry and a control byte
    /// each, from their allocated capacity). At most [`SeenSegments::max_bytes`].
    pub fn allocated_bytes(&self) -> usize {
        table_bytes(self.recent.capacity()) + table_bytes(self.older.capacity())
    }

    /// The most bytes a filter of `streams` streams can hold: two tables that never hold
    /// more than half of them each.
    pub fn max_bytes(streams: usize) -> usize {
        2 * table_bytes((streams / 2).max(1))
    }
}

/// Bytes of a hash table able to hold `capacity` entries (hashbrown keeps at most 7/8 of its
/// power-of-two buckets full, and 16 trailing control bytes).
fn table_bytes(capacity: usize) -> usize {
    if capacity == 0 {
        return 0;
    }
    let buckets =
        if capacity < 8 { (capacity + 1).next_power_of_two() } else { (capacity * 8).div_ceil(7).next_power_of_two() };
    buckets * (std::mem::size_of::<(StreamKey, Stream)>() + 1) + 16
}

#[cfg(test)]
mod tests {
    use std::collections::{HashSet, VecDeque};

    use proptest::prelude::*;

    use super::*;

    #[test]
    fn a_redelivered_segment_is_a_duplicate_in_any_order() {
        let mut seen = SeenSegments::new(16);
        let key = (1, 2, 3);
        for idx in [5, 3, 9, 4, 200] {
            assert_eq!(seen.check_key(key, idx), Seen::New, "{idx}");
        }
        for idx in [5, 3, 9, 4, 200] {
            assert_eq!(seen.check_key(key, idx), Seen::Duplicate, "{idx}");
        }
        assert_eq!(seen.check_key(key, 300), Seen::New);
        assert_eq!(seen.check_key(key, 200), Seen::Duplicate, "still in the window after a step of 100");
        // Index 45 is 255 behind 300: the oldest the window holds. 44 is beyond it.
        assert_eq!(seen.check_key(key, 45), Seen::New);
        assert_eq!(seen.check_key(key, 45), Seen::Duplicate);
        assert_eq!(seen.check_key(key, 44), Seen::BeyondWindow);
        assert_eq!(seen.check_key(key, 9), Seen::BeyondWindow);
        // Other streams, the same index: each its own.
        assert_eq!(seen.check_key((1, 2, 4), 5), Seen::New);
        assert_eq!(seen.check_key((1, 7, 3), 5), Seen::New);
        assert_eq!(seen.check_key((8, 2, 3), 5), Seen::New);
    }

    #[test]
    fn a_forged_index_cannot_make_honest_segments_refused() {
        let mut seen = SeenSegments::new(16);
        let key = (1, 2, 3);
        for idx in 0..10 {
            assert_eq!(seen.check_key(key, idx), Seen::New);
        }
        assert_eq!(seen.check_key(key, u64::MAX), Seen::New);
        assert_eq!(seen.check_key(key, u64::MAX), Seen::Duplicate);
        for idx in 10..20 {
            assert_ne!(seen.check_key(key, idx), Seen::Duplicate, "honest segment {idx} refused");
        }
    }

    #[test]
    fn a_flood_of_streams_stays_bounded_and_keeps_a_busy_stream() {
        let streams = 64;
        let mut seen = SeenSegments::new(streams);
        let busy = (7, 7, 7);
        for i in 0..100_000u64 {
            assert_eq!(seen.check_key((i, i, 0), 0), Seen::New);
            // The honest stream sends a segment every 8 forged streams: never forgotten.
            if i % 8 == 0 {
                let idx = i / 8;
                assert_eq!(seen.check_key(busy, idx), Seen::New);
                assert_eq!(seen.check_key(busy, idx), Seen::Duplicate);
            }
            assert!(seen.len() <= streams);
        }
        assert!(seen.allocated_bytes() <= SeenSegments::max_bytes(streams));
        // A stream forgotten is new again (the filter's documented blind spot).
        assert_eq!(seen.check_key((0, 0, 0), 0), Seen::New);
    }

    #[test]
    fn the_default_bound_is_small() {
        assert!(SeenSegments::max_bytes(SEEN_STREAMS) < 4 << 20, "{}", SeenSegments::max_bytes(SEEN_STREAMS));
    }

    /// The reference: every (stream, index) ever seen, and each stream's newest index.
    #[derive(Default)]
    struct Model {
        keys: HashSet<(StreamKey, u64)>,
        newest: HashMap<StreamKey, u64>,
    }

    impl Model {
        fn check(&mut self, key: StreamKey, idx: u64) -> Seen {
            let newest = self.newest.entry(key).or_insert(idx);
            if idx + STREAM_WINDOW <= *newest {
                return Seen::BeyondWindow;
            }
            *newest = (*newest).max(idx);
            if self.keys.insert((key, idx)) {
                Seen::New
            } else {
                Seen::Duplicate
            }
        }
    }

    proptest! {
        /// With the table large enough to forget no stream, the filter answers exactly as a
        /// set of every key ever seen does, within the window: streams arriving interleaved,
        /// out of order, with gaps, jumps beyond the window and redeliveries.
        #[test]
        fn the_filter_agrees_with_a_set_of_every_key(
            steps in proptest::collection::vec((0u32..4, 0u64..8, 0u64..600), 1..600),
        ) {
            let mut seen = SeenSegments::new(16);
            let mut model = Model::default();
            let mut recent: VecDeque<(StreamKey, u64)> = VecDeque::new();
            for (env, kind, value) in steps {
                let key = (11, 22, env);
                // Mostly the next index of the stream; sometimes a redelivery of a recent
                // one, a small step back, or a jump.
                let newest = model.newest.get(&key).copied().unwrap_or(0);
                let idx = match kind {
                    0..=3 => newest + 1,
                    4 | 5 => match recent.get(value as usize % recent.len().max(1)) {
                        Some(&(k, idx)) if k == key => idx,
                        _ => newest.saturating_sub(value % 40),
                    },
                    6 => newest.saturating_sub(value),
                    _ => newest + value,
                };
                recent.push_back((key, idx));
                if recent.len() > 64 {
                    recent.pop_front();
                }
                prop_assert_eq!(seen.check_key(key, idx), model.check(key, idx), "stream {:?} index {}", key, idx);
            }
        }
    }
}
