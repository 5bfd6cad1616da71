//! Publish: what leaves the learner after an update. Weights versions go out through a
//! [`volley_transport::WeightsPublisher`] (the loop in [`crate::consume`] hands them over and
//! acknowledges the segments behind a version once it is out); [`checkpoint`] writes the
//! learner's whole state to disk.

pub mod checkpoint;
