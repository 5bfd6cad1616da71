//! [`ActorError`]: why an actor stopped with an error.

use volley_core::ids::PolicyVersion;
use volley_core::spec::SpecError;
use volley_env::EnvError;
use volley_transport::TransportError;

/// Why an actor stopped with an error.
#[derive(Debug, thiserror::Error)]
pub enum ActorError {
    /// This build cannot serve the run spec.
    #[error("cannot serve run spec: {0}")]
    Spec(#[from] SpecError),
    /// An environment could not be built or reset.
    #[error("environment: {0}")]
    Env(#[from] EnvError),
    /// The weights do not fit this actor's layout.
    #[error("weights {version} rejected: {reason}")]
    Weights {
        /// The version offered.
        version: PolicyVersion,
        /// Why.
        reason: String,
    },
    /// The transport failed for good.
    #[error("transport: {0}")]
    Transport(#[from] TransportError),
}
