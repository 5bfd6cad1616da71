//! Volley's shared vocabulary: environments, the policy network and its CPU math, return
//! estimators, wire types and the transport traits with their in-process implementation.
//!
//! Invariant: core performs no I/O except through `transport` and `envsvc` (the environment
//! protocol over NATS); it knows nothing of CUDA.
//! Start reading at [`env::Env`], [`policy::ParamLayout`] and [`transport`].
#![warn(missing_docs)]

pub mod distributions;
pub mod env;
pub mod envsvc;
pub mod ids;
pub mod policy;
pub mod returns;
pub mod spec;
pub mod subjects;
pub mod transport;
pub mod wire;
pub mod work;
