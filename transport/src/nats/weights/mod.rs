//! Weights: the publisher (live core-NATS fan-out, then object store + KV pointer) and the
//! follower (live reassembly, pointer reads, verified fetches, backoff on unverifiable pointers).
//! The live path gets a version to connected followers first; the durable path (store and
//! pointer) serves everyone else and stays the source of truth (docs/ARCHITECTURE.md).
//!
//! - `pointer`: the KV pointer, the bounds on versions a follower accepts, the pointer reader.
//! - `publisher`: [`NatsWeightsPublisher`] and its live sender (learner side).
//! - `follower`: [`NatsWeightsFollower`] (actor side), fed by `live` (the live subscription and
//!   reassembly) and the pointer reader.

mod follower;
mod live;
mod pointer;
mod publisher;

pub use follower::NatsWeightsFollower;
pub(crate) use live::relayed;
pub use pointer::{
    continue_above_published, max_version_jump, MAX_POINTER_EVERY, MAX_VERSIONS_PER_SEC, MAX_VERSION_JUMP,
    REWIND_AFTER_WRITES,
};
pub use publisher::NatsWeightsPublisher;
