//! Volley's actor runtime: steps a vector of environments with the latest policy, cuts the
//! experience into segments and publishes them through a [`volley_transport::TrajectorySink`].
//!
//! Invariant: an actor holds no state that matters beyond its current segment; it switches
//! policy versions only between segments, so every segment has exactly one behaviour version.
//! Start reading at [`rollout::RolloutWorker`].

pub mod metrics;
pub mod rollout;

pub use metrics::ActorMetrics;
pub use rollout::{ActorCounters, ActorError, RolloutWorker};
