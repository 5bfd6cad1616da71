//! Select: which received data the learner trains on, and with what weight.
//!
//! - [`selection`]: the pool of admitted segments, its filters (lag bound, guard, zero
//!   variance) and the draw of each batch, with priority sampling ([`priority`]);
//! - [`windows`]: consecutive segments stitched into windows for longer backpropagation
//!   through time;
//! - [`groups`]: group rollouts, their returns and group-relative advantages.
//!
//! The drawn batch ([`crate::batch::SegmentBatch`]) is the input of the update
//! ([`crate::learner::Learner::update`]).

pub mod groups;
pub mod priority;
pub mod selection;
pub mod windows;
