//! Ingest: what a received segment passes before the learner lets it count. Decoding and the
//! run spec's shape checks happen in `volley_core::wire`; then [`admission`] applies the
//! learner's trust checks (versions, rewards, returns) and [`seen`] skips a segment delivered
//! again. Only a segment that passes both reaches the report, the scheduler and selection
//! ([`crate::select`]).

pub mod admission;
pub mod seen;
