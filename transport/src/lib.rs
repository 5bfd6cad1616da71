//! `volley-transport`: how processes talk. The transport traits with the in-process bus
//! ([`local`]) and NATS JetStream ([`nats`]), work queues and snapshot stores ([`work`]), and
//! environments as NATS services ([`envsvc`]). Depends on `volley-core` (what is sent),
//! `volley-env` and `volley-policy`; nothing depends on it but the processes (actor, learner, cli).
//!
//! The transport traits between actors and the learner, and the in-process implementation.
//!
//! Actor and learner code is written against these traits only, so the same code runs on the
//! embedded bus ([`local`]) and on NATS. The traits are blocking: actors and the learner are
//! CPU-bound threads, and a networked implementation owns its async runtime behind them.
//!
//! Semantics every implementation keeps:
//! - [`TrajectorySink::publish`] applies backpressure (blocks) when the learner is behind, up to
//!   a deadline, and returns [`TransportError::Closed`] once the run is over.
//! - [`TrajectorySource::recv`] delivers each segment at least once; a delivery that is not
//!   acked may be delivered again (networked transports), so consumers deduplicate by key.
//! - [`WeightsFollower::latest`] returns the newest published version; versions only increase.
#![warn(missing_docs)]

mod background;
pub mod envsvc;
pub mod local;
pub mod nats;
pub mod rejection_log;
pub mod run_end;
pub mod signing;
pub mod work;

use std::sync::Arc;
use std::time::Duration;

use volley_core::ids::PolicyVersion;

pub use background::BackgroundPublisher;
use volley_core::wire::{DecodeError, TrajectorySegment, Weights};

/// Transport failures. None is fatal to a process by itself: callers retry, count or stop.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum TransportError {
    /// The other side has shut down; the run is over.
    #[error("transport closed")]
    Closed,
    /// A deadline passed.
    #[error("{operation} timed out after {after:?}")]
    Timeout {
        /// What was waited for.
        operation: &'static str,
        /// How long.
        after: Duration,
    },
    /// The peer or broker answered with an error.
    #[error("{operation} failed: {message}")]
    Failed {
        /// What failed.
        operation: &'static str,
        /// The underlying error.
        message: String,
    },
}

/// Opaque handle to acknowledge one delivery.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct DeliveryToken(pub u64);

/// A segment as delivered to the learner.
#[derive(Debug)]
pub struct Delivery {
    /// The decoded segment, or why its bytes did not decode. Validation against the run spec
    /// is the consumer's job; a decode error is counted and the delivery rejected.
    pub segment: Result<TrajectorySegment, DecodeError>,
    /// Ack handle.
    pub token: DeliveryToken,
    /// How many times this segment was delivered (1 on first delivery).
    pub delivery_count: u64,
    /// The actor id the segment's subject carries (`volley.<run>.traj.<actor>`, lowercase),
    /// for transports that route by subject; `None` for the in-process bus. Broker
    /// permissions bind it to the publisher's credentials (a per-actor identity, issue 46
    /// item 3), so the learner trusts it over the id in the segment's body, which it must
    /// equal.
    pub subject_actor: Option<String>,
}

/// Where actors send segments.
pub trait TrajectorySink: Send {
    /// Publish segments, blocking while the transport applies backpressure.
    fn publish(&mut self, segments: Vec<TrajectorySegment>) -> Result<(), TransportError>;
    /// Block until the transport has room for a round of `n_segments` segments, so a producer
    /// can wait *before* it collects them: data collected after the wait, with the weights
    /// fetched after it, does not age in the producer's hands while the consumer catches up
    /// (issue 11: an actor that collected first and then waited held its round for several
    /// learner versions). Counted in [`TrajectorySink::throttled`]. Default: no backpressure.
    fn wait_for_room(&mut self, n_segments: usize) -> Result<(), TransportError> {
        let _ = n_segments;
        Ok(())
    }
    /// Time this sink spent blocked by backpressure so far.
    fn throttled(&self) -> Duration;
    /// Publish attempts that failed and were retried so far (a lost ack, a broker error).
    /// Default: 0, for transports that cannot fail.
    fn publish_retries(&self) -> u64 {
        0
    }
    /// A live view of the time spent blocked by backpressure, readable from other threads
    /// while [`TrajectorySink::publish`] is still waiting (metrics, liveness). Default: none.
    fn pacing_clock(&self) -> Option<Arc<PacingClock>> {
        None
    }
    /// Pushed-pacing notices from the consumer so far (a NATS sink: the learner's pace
    /// notices). Default: none.
    fn pace_notices(&self) -> PaceNoticeCounts {
        PaceNoticeCounts::default()
    }
}

/// What a sink did with the consumer's pace notices ([`TrajectorySink::pace_notices`]).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct PaceNoticeCounts {
    /// Notices taken as the consumer's position.
    pub used: u64,
    /// Notices that did not decode (corrupt, malformed).
    pub refused: u64,
    /// Times a reading of the consumer contradicted the notices, which were then ignored for a while.
    pub distrusted: u64,
}

/// Time a sink has spent blocked by backpressure, including a wait still in progress; shared
/// between the publishing thread and readers on other threads.
#[derive(Debug)]
pub struct PacingClock {
    epoch: std::time::Instant,
    /// Nanoseconds of finished waits.
    finished_nanos: std::sync::atomic::AtomicU64,
    /// Nanoseconds after `epoch` at which the current wait began, plus one; 0 when not blocked.
    blocked_since: std::sync::atomic::AtomicU64,
}

impl Default for PacingClock {
    fn default() -> Self {
        PacingClock {
            epoch: std::time::Instant::now(),
            finished_nanos: Default::default(),
            blocked_since: Default::default(),
        }
    }
}

impl PacingClock {
    fn now_nanos(&self) -> u64 {
        self.epoch.elapsed().as_nanos() as u64
    }

    /// A wait begins (no-op when one is already in progress).
    pub fn block(&self) {
        use std::sync::atomic::Ordering;
        let _ = self.blocked_since.compare_exchange(0, self.now_nanos() + 1, Ordering::AcqRel, Ordering::Acquire);
    }

    /// The wait in progress (if any) ends and is added to the total.
    pub fn unblock(&self) {
        use std::sync::atomic::Ordering;
        let since = self.blocked_since.swap(0, Ordering::AcqRel);
        if since > 0 {
            self.finished_nanos.fetch_add(self.now_nanos().saturating_sub(since - 1), Ordering::AcqRel);
        }
    }

    /// How long the wait in progress has lasted, if the sink is blocked now.
    pub fn blocked_for(&self) -> Option<Duration> {
        let since = self.blocked_since.load(std::sync::atomic::Ordering::Acquire);
        (since > 0).then(|| Duration::from_nanos(self.now_nanos().saturating_sub(since - 1)))
    }

    /// Total time blocked, the wait in progress included.
    pub fn total(&self) -> Duration {
        let finished = Duration::from_nanos(self.finished_nanos.load(std::sync::atomic::Ordering::Acquire));
        finished + self.blocked_for().unwrap_or_default()
    }
}

/// Where the learner receives segments.
pub trait TrajectorySource: Send {
    /// Append up to `max` deliveries to `out`, waiting at most `timeout` for the first one.
    /// Returns how many were appended (0 on timeout).
    fn recv(&mut self, max: usize, timeout: Duration, out: &mut Vec<Delivery>) -> Result<usize, TransportError>;
    /// Acknowledge deliveries whose contribution is safe; they will not be delivered again.
    /// Acknowledgements queued by [`ack_later`](Self::ack_later) are settled first.
    fn ack(&mut self, tokens: &[DeliveryToken]) -> Result<(), TransportError>;
    /// [`ack`](Self::ack), waiting at most `timeout` on the transport: a stopping learner
    /// writes its checkpoint without waiting out the retries on a broker that is gone (issue
    /// 48). What is not confirmed may be delivered again. By default: `ack`.
    fn ack_within(&mut self, tokens: &[DeliveryToken], timeout: Duration) -> Result<(), TransportError> {
        let _ = timeout;
        self.ack(tokens)
    }
    /// Acknowledge deliveries without waiting for the confirmation (a networked transport
    /// confirms in the background; the next [`recv`](Self::recv) or [`ack`](Self::ack)
    /// collects the outcome, and an unconfirmed delivery is held again). Until confirmed, a
    /// crash leaves them unacknowledged, so they may be delivered again. By default: at once.
    fn ack_later(&mut self, tokens: &[DeliveryToken]) -> Result<(), TransportError> {
        self.ack(tokens)
    }
    /// Reject a delivery for good (malformed or unusable): it is not redelivered.
    fn reject(&mut self, token: DeliveryToken) -> Result<(), TransportError>;
    /// Segments published but not yet delivered, when the transport knows.
    fn backlog(&self) -> Option<u64>;
}

/// Where the learner publishes new policy versions.
pub trait WeightsPublisher: Send {
    /// Make `weights` the latest version.
    fn publish(&mut self, weights: Arc<Weights>) -> Result<(), TransportError>;

    /// Whether `version` (or a newer one) is published, so followers can get it. A publisher
    /// whose `publish` returns only once the version is out (the default) says yes to every
    /// version it was handed; [`BackgroundPublisher`] says yes once its thread is done.
    fn is_published(&self, version: PolicyVersion) -> bool {
        let _ = version;
        true
    }

    /// Wait until every version handed to `publish` is out, including any write the
    /// publisher deferred (or return why not).
    fn flush(&mut self) -> Result<(), TransportError> {
        Ok(())
    }

    /// [`flush`](Self::flush), waiting at most `timeout` (or return
    /// [`TransportError::Timeout`]): a stopping learner does not wait out the retries on a
    /// broker that is gone. By default: `flush`.
    fn flush_within(&mut self, timeout: Duration) -> Result<(), TransportError> {
        let _ = timeout;
        self.flush()
    }

    /// When a write this publisher deferred is due (the NATS publisher's pointer of a version
    /// that went out live, [`nats::NatsConfig::weights_pointer_every`]): if nothing is published
    /// before then, the caller calls [`flush`](Self::flush). `None`: nothing deferred.
    fn deferred_until(&self) -> Option<std::time::Instant> {
        None
    }

    /// The publisher's live path as a sender of its own, for the thread that hands versions
    /// over to run itself: [`BackgroundPublisher`] sends each version live on the learner's
    /// thread, where it leaves with the learner's next call on the bus, and then calls
    /// [`publish_after_live`](Self::publish_after_live) on its own thread for the rest.
    /// `None` (the default): no live path, `publish` does everything.
    fn live_sender(&self) -> Option<Box<dyn LiveWeightsSender>> {
        None
    }

    /// [`publish`](Self::publish) for a version the caller already sent through
    /// [`live_sender`](Self::live_sender) (`sent_live`: whether it went out): everything but
    /// the live path.
    fn publish_after_live(&mut self, weights: Arc<Weights>, sent_live: bool) -> Result<(), TransportError> {
        let _ = sent_live;
        self.publish(weights)
    }

    /// Take a version the caller already sent live whose durable write may wait (the NATS
    /// publisher's pointer of inline weights between two that are due), without any I/O:
    /// true when it is taken, and then it counts as published, as after
    /// [`publish_after_live`](Self::publish_after_live); false (the default): nothing was done,
    /// and the version goes to `publish_after_live`. [`BackgroundPublisher`] asks this on the
    /// caller's thread, so such a version costs no hand-off to its own thread.
    fn take_without_writing(&mut self, weights: &Arc<Weights>, sent_live: bool) -> bool {
        let _ = (weights, sent_live);
        false
    }
}

/// A publisher's live path, run by the thread that hands versions over
/// ([`WeightsPublisher::live_sender`]).
pub trait LiveWeightsSender: Send {
    /// Queue `weights` for the followers without waiting for anything: whether it was queued
    /// (not when its parameters do not match their checksum, or the connection is closed), or
    /// `None` when this sender leaves the version to the publisher's own thread (weights too
    /// large to encode on the caller's thread without holding it up).
    fn send_live(&mut self, weights: &Weights) -> Option<bool>;
}

/// How actors follow the latest policy version.
pub trait WeightsFollower: Send {
    /// The latest weights if newer than `have` (`None` = have nothing yet); `Ok(None)` when
    /// there is nothing newer. Never blocks for long.
    fn latest(&mut self, have: Option<PolicyVersion>) -> Result<Option<Arc<Weights>>, TransportError>;
    /// Wait up to `timeout` for the first version to appear.
    fn wait_first(&mut self, timeout: Duration) -> Result<Arc<Weights>, TransportError>;
    /// How the versions so far arrived, for metrics. Default: all zero, for followers with a
    /// single path.
    fn paths(&self) -> WeightsPaths {
        WeightsPaths::default()
    }
}

/// Counts of how a follower's versions arrived (docs/ARCHITECTURE.md, "live path and durable
/// path"), totals since it started.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct WeightsPaths {
    /// Versions taken from the live path (core-NATS fan-out to connected followers).
    pub live: u64,
    /// Versions rebuilt through the durable path (object store, or inline in the pointer).
    pub durable: u64,
    /// Reassembled live versions refused (frame, digest or pointer mismatch); each fell back
    /// to the durable path.
    pub live_refused: u64,
    /// Live chunks refused on arrival (corrupt, unreadable, another layout, too large,
    /// inconsistent with their version).
    pub live_chunks_refused: u64,
    /// Versions refused for carrying no signature, from a follower that requires them
    /// ([`signing`]); pointers and live frames alike.
    pub unsigned: u64,
    /// Versions refused for a signature no trusted key made over them.
    pub bad_signature: u64,
}

#[cfg(test)]
mod pacing_clock_tests {
    use super::*;

    #[test]
    fn pacing_clock_counts_a_wait_in_progress() {
        let clock = PacingClock::default();
        assert_eq!(clock.blocked_for(), None);
        assert_eq!(clock.total(), Duration::ZERO);
        clock.block();
        std::thread::sleep(Duration::from_millis(5));
        let during = clock.total();
        assert!(during >= Duration::from_millis(5), "{during:?}");
        assert!(clock.blocked_for().is_some());
        clock.block(); // a second block keeps the first start
        clock.unblock();
        assert_eq!(clock.blocked_for(), None);
        assert!(clock.total() >= during);
        let after = clock.total();
        clock.unblock(); // no wait in progress: nothing added
        assert_eq!(clock.total(), after);
    }
}
