//! Volley's actor runtime: steps a vector of environments with the latest policy, cuts the
//! experience into segments and publishes them through a [`volley_transport::TrajectorySink`].
//!
//! Invariant: an actor holds no state that matters beyond its current segment; it switches
//! policy versions only between segments, so every segment has exactly one behaviour version.
//! Invariant: the rollout loop knows nothing of work items or snapshots; it asks an
//! [`episode_start::EpisodeStarts`] where episodes start.
//! Start reading at [`rollout::RolloutWorker`], then [`episode_start`].

pub mod counters;
pub mod episode_start;
pub mod error;
pub mod metrics;
pub mod rollout;

pub use counters::ActorCounters;
pub use episode_start::{EpisodeStarts, FreshStarts, WorkStarts};
pub use error::ActorError;
pub use metrics::ActorMetrics;
pub use rollout::RolloutWorker;
