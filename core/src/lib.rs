//! Volley's shared vocabulary: what every process agrees on and what crosses a process
//! boundary — ids ([`ids`]), the run spec ([`spec`]), NATS subject names ([`subjects`]), the
//! wire types and their codecs ([`wire`]) and work items for save-load ([`work`]).
//!
//! Invariant: core performs no I/O and knows nothing of NATS or CUDA; it depends only on the
//! environment and policy crates (whose configs the run spec embeds). Transports live in
//! `volley-transport`, the environments in `volley-env`, the policy math in `volley-policy`.
//! Start reading at [`spec::RunSpec`] and [`wire::TrajectorySegment`].
#![warn(missing_docs)]

pub mod ids;
pub mod spec;
pub mod subjects;
pub mod wire;
pub mod work;
