//! Volley's learner: receives segments, checks and batches them, computes the V-trace or PPO
//! loss, updates the policy with Adam and publishes versioned weights.
//!
//! Invariant: the learner's policy version increases by exactly one per published update and
//! never goes backwards; every sample's lag is measured against it.
//! Start reading at [`learner::Learner`] (one update) and [`consume::run_learner`] (the loop).
//!
//! Folders follow a segment's path: [`ingest`] (admission, the duplicate filter) → [`select`]
//! (the pool, its filters and the draw) → the update ([`learner`],
//! [`train`], [`losses`], [`net`], [`optim`] on a [`backend`]) → [`publish`] (weights versions,
//! checkpoints); [`consume`] runs the loop and [`report`] keeps its report, [`scheduler`]
//! plans the actors' next episodes from the same segments, and [`metrics`] and
//! [`tensorboard`] export what they report.

pub mod backend;
pub mod batch;
pub mod consume;
pub mod ingest;
pub mod learner;
pub mod losses;
pub mod metrics;
pub mod net;
pub mod optim;
pub mod publish;
pub mod report;
pub mod scheduler;
pub mod select;
pub mod telemetry;
pub mod tensorboard;
pub mod train;

pub use consume::{run_learner, LearnerControl, RunLimits};
pub use learner::{AbsurdVersion, Learner, LearnerError, UpdateStats};
pub use metrics::LearnerMetrics;
pub use publish::checkpoint::{Checkpoint, CheckpointError};
pub use report::{LearnerReport, StopReason};
pub use select::selection::{DropReason, Selector, ValueSource};
