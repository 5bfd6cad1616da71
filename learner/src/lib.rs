//! Volley's learner: receives segments, checks and batches them, computes the V-trace or PPO
//! loss, updates the policy with Adam and publishes versioned weights.
//!
//! Invariant: the learner's policy version increases by exactly one per published update and
//! never goes backwards; every sample's lag is measured against it.
//! Start reading at [`learner::Learner`] (one update) and [`consume::run_learner`] (the loop).

pub mod admission;
pub mod backend;
pub mod batch;
pub mod checkpoint;
pub mod consume;
pub mod groups;
pub mod learner;
pub mod losses;
pub mod metrics;
pub mod net;
pub mod optim;
pub mod scheduler;
pub mod seen;
pub mod selection;
pub mod telemetry;
pub mod tensorboard;
pub mod train;
pub mod windows;

pub use checkpoint::{Checkpoint, CheckpointError};
pub use consume::{run_learner, LearnerControl, LearnerReport, RunLimits, StopReason};
pub use learner::{AbsurdVersion, Learner, LearnerError, UpdateStats};
pub use metrics::LearnerMetrics;
pub use selection::{DropReason, Selector, ValueSource};
