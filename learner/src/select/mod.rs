//! Select: which data the learner trains on and which data actors generate next.
//!
//! - [`selection`]: the pool of admitted segments, its filters (lag bound, guard, zero
//!   variance) and the draw of each batch, with priority sampling ([`priority`]);
//! - [`windows`]: consecutive segments stitched into windows for longer backpropagation
//!   through time;
//! - [`groups`]: group rollouts, their returns and group-relative advantages;
//! - [`scheduler`]: the rollout budget (which task and which start the next episodes run),
//!   fed by the same segments and handed to actors through the work queue.
//!
//! The drawn batch ([`crate::batch::SegmentBatch`]) is the input of the update
//! ([`crate::learner::Learner::update`]).

pub mod groups;
pub mod priority;
pub mod scheduler;
pub mod selection;
pub mod windows;
