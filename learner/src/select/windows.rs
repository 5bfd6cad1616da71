//! Stitching consecutive segments of one environment stream into windows for longer
//! backpropagation through time (`hyper.bptt.segments`, `--bptt-segments K`).
//!
//! A **window** is up to K segments of one `(actor, incarnation, env_idx)` stream that continue
//! each other: segment indices `n, n+1, …`, the episode counter advanced by exactly the episodes
//! that ended in between, and each segment's first observation equal to the last one's final
//! observation (an actor that replaced a running episode at a boundary, a restart, or a segment
//! dropped in between breaks the chain). The learner trains on a window as one column of K·T
//! steps ([`crate::batch::SegmentBatch::fill_windows`]), starting from the first segment's
//! `initial_hidden` and carrying the recurrent state across the boundaries inside it, so credit
//! reaches back K·T steps instead of T.
//!
//! [`WindowAssembler`] holds the segments of incomplete windows. What it holds is bounded:
//! at most K − 1 segments per stream, at most `max_held_segments` in all (a segment beyond
//! that flushes the stream that has waited longest first), and no segment longer than
//! `stream_timeout` or until its lag reaches `max_policy_lag`. A stream that breaks (a gap, a
//! discontinuity, eviction, a timeout, the lag bound) is not lost: what it holds is flushed as
//! a shorter window, which the batch pads in front with weight-0 steps, and counted by
//! [`WindowOutcome`] (`volley_learner_windows_total{outcome}`).
//!
//! Invariant: every segment offered leaves the assembler exactly once, inside a window.

use std::collections::HashMap;
use std::time::{Duration, Instant};

use volley_core::ids::PolicyVersion;
use volley_core::spec::BpttConfig;
use volley_core::wire::{id_hash, TrajectorySegment};
use volley_transport::DeliveryToken;

/// Up to K consecutive segments of one stream, in stream order, with their deliveries.
#[derive(Debug)]
pub struct Window {
    /// The segments, oldest first (1 to K of them).
    pub segments: Vec<TrajectorySegment>,
    /// One delivery per segment, to acknowledge once the window is used or dropped.
    pub tokens: Vec<DeliveryToken>,
}

impl Window {
    /// A window of one segment.
    pub fn single(segment: TrajectorySegment, token: DeliveryToken) -> Self {
        Window { segments: vec![segment], tokens: vec![token] }
    }

    /// The oldest behaviour version in the window (its lag is measured by it).
    pub fn oldest_version(&self) -> PolicyVersion {
        self.segments.iter().map(|s| s.policy_version).min().unwrap_or_default()
    }
}

/// How a window left the assembler (the `outcome` label of `volley_learner_windows_total`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum WindowOutcome {
    /// K consecutive segments.
    Full,
    /// Shorter: the next segment of the stream did not continue it (a gap, a restart, a
    /// replaced episode, a segment dropped before it arrived here).
    Gap,
    /// Shorter: the assembler was full and this stream had waited longest.
    Evicted,
    /// Shorter: no segment arrived for the stream within the timeout.
    Timeout,
    /// Shorter: its oldest segment reached the lag bound while waiting.
    Lag,
}

impl WindowOutcome {
    /// Every outcome, in label order.
    pub const ALL: [WindowOutcome; 5] =
        [WindowOutcome::Full, WindowOutcome::Gap, WindowOutcome::Evicted, WindowOutcome::Timeout, WindowOutcome::Lag];

    /// The metric label value.
    pub fn as_str(self) -> &'static str {
        match self {
            WindowOutcome::Full => "full",
            WindowOutcome::Gap => "gap",
            WindowOutcome::Evicted => "evicted",
            WindowOutcome::Timeout => "timeout",
            WindowOutcome::Lag => "lag",
        }
    }

    fn index(self) -> usize {
        self as usize
    }
}

/// (hash of the actor id, incarnation, env_idx): one environment stream, in a fixed 24 bytes
/// whatever the actor id's length.
type StreamKey = (u64, u64, u32);

/// The held segments of one stream's incomplete window.
#[derive(Debug)]
struct Stream {
    /// The incomplete window.
    window: Window,
    first_arrival: Instant,
    last_arrival: Instant,
}

/// Holds segments until K consecutive ones of a stream form a window (see the module docs).
#[derive(Debug)]
pub struct WindowAssembler {
    window_segments: usize,
    max_held_segments: usize,
    stream_timeout: Duration,
    max_policy_lag: u64,
    streams: HashMap<StreamKey, Stream>,
    held: usize,
    outcomes: [u64; WindowOutcome::ALL.len()],
}

impl WindowAssembler {
    /// An assembler for windows of `config.segments` segments, flushing held segments before
    /// their lag exceeds `max_policy_lag`.
    pub fn new(config: &BpttConfig, max_policy_lag: u64) -> Self {
        WindowAssembler {
            window_segments: config.segments.max(1),
            max_held_segments: config.max_held_segments.max(1),
            stream_timeout: Duration::from_secs_f64(config.stream_timeout_secs.max(0.0)),
            max_policy_lag,
            streams: HashMap::new(),
            held: 0,
            outcomes: [0; WindowOutcome::ALL.len()],
        }
    }

    /// Segments per full window (K).
    pub fn window_segments(&self) -> usize {
        self.window_segments
    }

    /// Segments held in incomplete windows.
    pub fn held_segments(&self) -> usize {
        self.held
    }

    /// Streams with an incomplete window.
    pub fn held_streams(&self) -> usize {
        self.streams.len()
    }

    /// Windows emitted so far, by outcome (in [`WindowOutcome::ALL`] order).
    pub fn outcomes(&self) -> [(WindowOutcome, u64); WindowOutcome::ALL.len()] {
        WindowOutcome::ALL.map(|outcome| (outcome, self.outcomes[outcome.index()]))
    }

    /// Take a validated, admitted segment that arrived at `now`; windows it completes or
    /// breaks are appended to `out`.
    pub fn offer(&mut self, segment: TrajectorySegment, token: DeliveryToken, now: Instant, out: &mut Vec<Window>) {
        if self.window_segments == 1 {
            self.emit(WindowOutcome::Full, Window::single(segment, token), out);
            return;
        }
        let key = (id_hash(segment.actor.as_str().as_bytes()), segment.incarnation, segment.env_idx);
        if let Some(stream) = self.streams.get(&key) {
            let last = stream.window.segments.last().expect("a held stream holds a segment");
            if !continues(last, &segment) {
                self.flush(key, WindowOutcome::Gap, out);
            }
        }
        // At the bound, the stream that has waited longest goes (possibly this one: then this
        // segment starts its stream afresh).
        while self.held >= self.max_held_segments {
            let oldest = self.streams.iter().min_by_key(|(_, s)| s.first_arrival).map(|(key, _)| *key);
            match oldest {
                Some(oldest) => self.flush(oldest, WindowOutcome::Evicted, out),
                None => break,
            }
        }
        let stream = self.streams.entry(key).or_insert_with(|| Stream {
            window: Window {
                segments: Vec::with_capacity(self.window_segments),
                tokens: Vec::with_capacity(self.window_segments),
            },
            first_arrival: now,
            last_arrival: now,
        });
        stream.window.segments.push(segment);
        stream.window.tokens.push(token);
        stream.last_arrival = now;
        self.held += 1;
        if stream.window.segments.len() == self.window_segments {
            self.flush(key, WindowOutcome::Full, out);
        }
    }

    /// Flush the streams that waited past the timeout since their last segment, or whose
    /// oldest segment's lag at learner `version` reached the lag bound.
    pub fn expire(&mut self, now: Instant, version: PolicyVersion, out: &mut Vec<Window>) {
        if self.streams.is_empty() {
            return;
        }
        let mut expired: Vec<(StreamKey, WindowOutcome)> = Vec::new();
        for (key, stream) in &self.streams {
            if version.lag_of(stream.window.oldest_version()) >= self.max_policy_lag {
                expired.push((*key, WindowOutcome::Lag));
            } else if now.saturating_duration_since(stream.last_arrival) >= self.stream_timeout {
                expired.push((*key, WindowOutcome::Timeout));
            }
        }
        // Oldest first, so windows enter the pool in arrival order.
        expired.sort_by_key(|(key, _)| self.streams[key].first_arrival);
        for (key, outcome) in expired {
            self.flush(key, outcome, out);
        }
    }

    /// Flush every held stream (as [`WindowOutcome::Timeout`]), oldest first.
    pub fn flush_all(&mut self, out: &mut Vec<Window>) {
        let mut keys: Vec<StreamKey> = self.streams.keys().copied().collect();
        keys.sort_by_key(|key| self.streams[key].first_arrival);
        for key in keys {
            self.flush(key, WindowOutcome::Timeout, out);
        }
    }

    fn flush(&mut self, key: StreamKey, outcome: WindowOutcome, out: &mut Vec<Window>) {
        if let Some(stream) = self.streams.remove(&key) {
            self.held -= stream.window.segments.len();
            self.emit(outcome, stream.window, out);
        }
    }

    fn emit(&mut self, outcome: WindowOutcome, window: Window, out: &mut Vec<Window>) {
        self.outcomes[outcome.index()] += 1;
        out.push(window);
    }
}

/// Whether `next` continues `last` in one stream: the next segment index, the episode counter
/// advanced by the episodes that ended in `last`, and the same observation at the boundary
/// (bit for bit).
pub fn continues(last: &TrajectorySegment, next: &TrajectorySegment) -> bool {
    let ended = last.terminated.iter().zip(&last.truncated).filter(|(&te, &tr)| te != 0 || tr != 0).count() as u64;
    let obs_dim = last.obs_dim as usize;
    let boundary = last.observations.len().saturating_sub(obs_dim);
    Some(next.segment_idx) == last.segment_idx.checked_add(1)
        && Some(next.episode_id) == last.episode_id.checked_add(ended)
        && next.obs_dim == last.obs_dim
        && next.observations.len() >= obs_dim
        && last.observations.same_values(boundary..last.observations.len(), &next.observations, 0..obs_dim)
}

#[cfg(test)]
mod tests {
    use super::*;
    use volley_testkit::fixtures::SegmentBuilder;

    const T: usize = 4;

    /// Segment `idx` of stream (actor-0, incarnation, env 0): observation `idx·T + t` at step
    /// `t`, so consecutive segments share their boundary observation.
    fn segment(incarnation: u64, idx: u64, version: u64) -> TrajectorySegment {
        let mut segment =
            SegmentBuilder::new(T, 1).version(version).observations_from(|t| (idx as usize * T + t) as f32).build();
        segment.incarnation = incarnation;
        segment.segment_idx = idx;
        segment
    }

    fn token(i: u64) -> DeliveryToken {
        DeliveryToken(i)
    }

    fn config(segments: usize, max_held_segments: usize) -> BpttConfig {
        BpttConfig { segments, max_held_segments, stream_timeout_secs: 10.0 }
    }

    /// An assembler of `segments`-segment windows holding at most `max_held_segments`, over
    /// streams lagging at most `max_lag` versions; the instant it starts at; and its output.
    fn assembler(segments: usize, max_held_segments: usize, max_lag: u64) -> (WindowAssembler, Instant, Vec<Window>) {
        (WindowAssembler::new(&config(segments, max_held_segments), max_lag), Instant::now(), Vec::new())
    }

    fn indices(window: &Window) -> Vec<u64> {
        window.segments.iter().map(|s| s.segment_idx).collect()
    }

    #[test]
    fn consecutive_segments_of_a_stream_form_a_full_window() {
        let (mut assembler, now, mut out) = assembler(3, 64, 32);
        for idx in 0..7 {
            assembler.offer(segment(0, idx, 0), token(idx), now, &mut out);
        }
        assert_eq!(out.iter().map(indices).collect::<Vec<_>>(), vec![vec![0, 1, 2], vec![3, 4, 5]]);
        assert_eq!(out[1].tokens, vec![token(3), token(4), token(5)]);
        assert_eq!(assembler.held_segments(), 1);
        assert_eq!(assembler.outcomes()[0], (WindowOutcome::Full, 2));
    }

    #[test]
    fn a_gap_flushes_the_held_segments_as_a_short_window() {
        let (mut assembler, now, mut out) = assembler(4, 64, 32);
        assembler.offer(segment(0, 0, 0), token(0), now, &mut out);
        assembler.offer(segment(0, 1, 0), token(1), now, &mut out);
        // Segment 2 never arrives (dropped, say).
        assembler.offer(segment(0, 3, 0), token(3), now, &mut out);
        assert_eq!(out.iter().map(indices).collect::<Vec<_>>(), vec![vec![0, 1]]);
        assert_eq!(assembler.held_segments(), 1);
        let outcomes: HashMap<_, _> = assembler.outcomes().into_iter().collect();
        assert_eq!(outcomes[&WindowOutcome::Gap], 1);
    }

    #[test]
    fn a_replaced_episode_or_another_incarnation_does_not_continue_a_stream() {
        let last = segment(0, 0, 0);
        assert!(continues(&last, &segment(0, 1, 0)));
        // The actor replaced its running episode at the boundary: the episode counter moved.
        let mut replaced = segment(0, 1, 0);
        replaced.episode_id += 1;
        assert!(!continues(&last, &replaced));
        // An episode that ended at the last step moves the counter by one.
        let mut ended = segment(0, 0, 0);
        ended.terminated[T - 1] = 1;
        assert!(continues(&ended, &replaced));
        // A different first observation (a restored state) breaks the chain.
        let mut jumped = segment(0, 1, 0);
        jumped.observations.as_f32_mut().expect("f32 observations")[0] = -1.0;
        assert!(!continues(&last, &jumped));
        // Another incarnation is another stream: both wait apart.
        let (mut assembler, _, mut out) = assembler(2, 64, 32);
        assembler.offer(segment(0, 0, 0), token(0), Instant::now(), &mut out);
        assembler.offer(segment(1, 1, 0), token(1), Instant::now(), &mut out);
        assert!(out.is_empty());
        assert_eq!((assembler.held_streams(), assembler.held_segments()), (2, 2));
    }

    #[test]
    fn held_segments_are_bounded_by_evicting_the_longest_waiting_stream() {
        let (mut assembler, start, mut out) = assembler(4, 3, 32);
        for env in 0..5u32 {
            let mut s = segment(0, 0, 0);
            s.env_idx = env;
            assembler.offer(s, token(env as u64), start + Duration::from_millis(env as u64), &mut out);
            assert!(assembler.held_segments() <= 3);
        }
        // Streams 0 and 1 were flushed, oldest first, one segment each.
        assert_eq!(out.iter().map(|w| w.segments[0].env_idx).collect::<Vec<_>>(), vec![0, 1]);
        let outcomes: HashMap<_, _> = assembler.outcomes().into_iter().collect();
        assert_eq!(outcomes[&WindowOutcome::Evicted], 2);
    }

    #[test]
    fn timeouts_and_the_lag_bound_flush_held_streams() {
        let (mut assembler, start, mut out) = assembler(4, 64, 8);
        assembler.offer(segment(0, 0, 5), token(0), start, &mut out);
        let mut other = segment(0, 0, 10);
        other.env_idx = 1;
        assembler.offer(other, token(1), start + Duration::from_secs(5), &mut out);
        assembler.expire(start + Duration::from_secs(9), PolicyVersion(12), &mut out);
        assert!(out.is_empty(), "nothing timed out or reached lag 8 yet");
        // Version 13: the first stream's segment reaches lag 8.
        assembler.expire(start + Duration::from_secs(9), PolicyVersion(13), &mut out);
        assert_eq!(out.len(), 1);
        assert_eq!(out[0].segments[0].env_idx, 0);
        // Ten seconds after its arrival the second stream times out.
        assembler.expire(start + Duration::from_secs(15), PolicyVersion(13), &mut out);
        assert_eq!(out.len(), 2);
        let outcomes: HashMap<_, _> = assembler.outcomes().into_iter().collect();
        assert_eq!((outcomes[&WindowOutcome::Lag], outcomes[&WindowOutcome::Timeout]), (1, 1));
        assert_eq!(assembler.held_segments(), 0);
    }

    #[test]
    fn one_segment_windows_pass_straight_through() {
        let (mut assembler, _, mut out) = assembler(1, 64, 32);
        assembler.offer(segment(0, 0, 0), token(0), Instant::now(), &mut out);
        assert_eq!(out.len(), 1);
        assert_eq!(assembler.held_segments(), 0);
    }

    proptest::proptest! {
        /// Whatever order, gaps and streams segments arrive in, every segment leaves exactly
        /// once (in a window or in the final flush), never more than the bound is held, and
        /// every window's segments continue each other.
        #[test]
        fn every_segment_leaves_once_and_held_segments_stay_bounded(
            arrivals in proptest::collection::vec((0u32..4, 0u64..12), 1..80),
            k in 1usize..5,
            bound in 1usize..10,
        ) {
            let (mut assembler, start, mut out) = assembler(k, bound, 1000);
            for (i, &(env, idx)) in arrivals.iter().enumerate() {
                let mut s = segment(0, idx, 0);
                s.env_idx = env;
                assembler.offer(s, token(i as u64), start + Duration::from_millis(i as u64), &mut out);
                proptest::prop_assert!(assembler.held_segments() <= bound);
            }
            assembler.flush_all(&mut out);
            let mut tokens: Vec<DeliveryToken> = out.iter().flat_map(|w| w.tokens.iter().copied()).collect();
            tokens.sort_by_key(|t| t.0);
            proptest::prop_assert_eq!(tokens, (0..arrivals.len() as u64).map(token).collect::<Vec<_>>());
            for window in &out {
                proptest::prop_assert!(!window.segments.is_empty() && window.segments.len() <= k);
                for pair in window.segments.windows(2) {
                    proptest::prop_assert!(continues(&pair[0], &pair[1]));
                }
            }
        }
    }
}
