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

pub mod local;
pub mod nats;
pub mod work;

use std::sync::Arc;
use std::time::Duration;

use crate::ids::PolicyVersion;
use crate::wire::{DecodeError, TrajectorySegment, Weights};

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
}

/// Where actors send segments.
pub trait TrajectorySink: Send {
    /// Publish segments, blocking while the transport applies backpressure.
    fn publish(&mut self, segments: Vec<TrajectorySegment>) -> Result<(), TransportError>;
    /// Time this sink spent blocked by backpressure so far.
    fn throttled(&self) -> Duration;
    /// Publish attempts that failed and were retried so far (a lost ack, a broker error).
    /// Default: 0, for transports that cannot fail.
    fn publish_retries(&self) -> u64 {
        0
    }
}

/// Where the learner receives segments.
pub trait TrajectorySource: Send {
    /// Append up to `max` deliveries to `out`, waiting at most `timeout` for the first one.
    /// Returns how many were appended (0 on timeout).
    fn recv(&mut self, max: usize, timeout: Duration, out: &mut Vec<Delivery>) -> Result<usize, TransportError>;
    /// Acknowledge deliveries whose contribution is safe; they will not be delivered again.
    fn ack(&mut self, tokens: &[DeliveryToken]) -> Result<(), TransportError>;
    /// Reject a delivery for good (malformed or unusable): it is not redelivered.
    fn reject(&mut self, token: DeliveryToken) -> Result<(), TransportError>;
    /// Segments published but not yet delivered, when the transport knows.
    fn backlog(&self) -> Option<u64>;
}

/// Where the learner publishes new policy versions.
pub trait WeightsPublisher: Send {
    /// Make `weights` the latest version.
    fn publish(&mut self, weights: Arc<Weights>) -> Result<(), TransportError>;
}

/// How actors follow the latest policy version.
pub trait WeightsFollower: Send {
    /// The latest weights if newer than `have` (`None` = have nothing yet); `Ok(None)` when
    /// there is nothing newer. Never blocks for long.
    fn latest(&mut self, have: Option<PolicyVersion>) -> Result<Option<Arc<Weights>>, TransportError>;
    /// Wait up to `timeout` for the first version to appear.
    fn wait_first(&mut self, timeout: Duration) -> Result<Arc<Weights>, TransportError>;
}
