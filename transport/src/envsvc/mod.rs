//! Environments as services: the NATS environment protocol (docs/ENV_PROTOCOL.md), its
//! client and a server for any [`Env`](volley_env::Env).
//!
//! - [`protocol`]: the MessagePack messages and error codes.
//! - [`EnvServer`]: serves a built-in (or any Rust) environment as the NATS micro service
//!   `volley-env-<name>`; what `volley env-serve` runs.
//! - [`EnvServiceClient`]: discovers the instances of a service (`$SRV.INFO`) and talks to
//!   them with a deadline on every request.
//! - [`RemoteVecEnv`]: a [`VectorEnv`](volley_env::VectorEnv) whose environments live in
//!   sessions on remote instances, stepped in batches with bounded concurrency; a lost
//!   instance aborts the episodes it hosted and the actor carries on elsewhere.
//!
//! Like [`crate::nats`], this module owns (or borrows) a tokio runtime and offers
//! blocking calls to CPU threads; never call them from inside a tokio worker thread.

pub mod client;
pub mod protocol;
mod remote_vec;
pub mod server;

use std::fmt;
use std::sync::atomic::AtomicU64;
use std::time::Duration;

pub use client::{connect_env_server, connect_nats, EnvServiceClient, Instance, ENV_SERVER_INBOX_PREFIX};
pub use remote_vec::{RemoteVecEnv, RemoteVecEnvConfig};
pub use server::{EnvFactory, EnvServer, EnvServerConfig};

use protocol::{ErrorCode, ProtocolError};
pub use volley_env::{EnvServiceName, InvalidServiceName};

impl From<InvalidServiceName> for EnvServiceError {
    fn from(err: InvalidServiceName) -> Self {
        EnvServiceError::InvalidName(err.0)
    }
}

/// Failures talking to or serving an environment service.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum EnvServiceError {
    /// A service name outside `[a-z0-9_-]{1,48}`.
    #[error("invalid environment service name {0:?}: expected [a-z0-9_-]{{1,48}}")]
    InvalidName(String),
    /// No instance of the service answered discovery.
    #[error("no instance of environment service {service} answered within {after:?}")]
    NoInstances {
        /// The service.
        service: String,
        /// The discovery window.
        after: Duration,
    },
    /// Nobody listens on the instance's subject any more (the server is gone).
    #[error("instance {instance} is gone ({op}: no responders)")]
    Gone {
        /// The instance id.
        instance: String,
        /// The operation.
        op: &'static str,
    },
    /// A request got no reply within its deadline.
    #[error("{op} to instance {instance} timed out after {after:?}")]
    Timeout {
        /// The instance id.
        instance: String,
        /// The operation.
        op: &'static str,
        /// The deadline.
        after: Duration,
    },
    /// The server answered with an error reply.
    #[error("{op} to instance {instance} failed with code {code}: {message}")]
    Server {
        /// The instance id.
        instance: String,
        /// The operation.
        op: &'static str,
        /// The `Nats-Service-Error-Code`.
        code: u16,
        /// The `Nats-Service-Error` description.
        message: String,
    },
    /// A reply that does not decode or does not fit the request (lengths, non-finite values).
    #[error("{op} reply from instance {instance}: {message}")]
    BadReply {
        /// The instance id.
        instance: String,
        /// The operation.
        op: &'static str,
        /// What is wrong.
        message: String,
    },
    /// The instance does not serve what the caller needs (spaces, protocol version, endpoints).
    #[error("instance {instance} is unusable: {message}")]
    Incompatible {
        /// The instance id.
        instance: String,
        /// Why.
        message: String,
    },
    /// NATS itself failed (connect, subscribe, publish).
    #[error("{operation} failed: {message}")]
    Nats {
        /// What failed.
        operation: &'static str,
        /// The underlying error.
        message: String,
    },
}

impl EnvServiceError {
    /// A short, bounded label for metrics and logs (`reason`).
    pub fn reason(&self) -> &'static str {
        match self {
            EnvServiceError::InvalidName(_) => "remote_invalid_name",
            EnvServiceError::NoInstances { .. } => "remote_no_instances",
            EnvServiceError::Gone { .. } => "remote_gone",
            EnvServiceError::Timeout { .. } => "remote_timeout",
            EnvServiceError::Server { code, .. } => match ErrorCode::from_code(*code) {
                Some(ErrorCode::UnknownSession) => "remote_unknown_session",
                Some(ErrorCode::Capacity) => "remote_capacity",
                Some(ErrorCode::Unsupported) => "remote_unsupported",
                _ => "remote_server_error",
            },
            EnvServiceError::BadReply { .. } => "remote_bad_reply",
            EnvServiceError::Incompatible { .. } => "remote_incompatible",
            EnvServiceError::Nats { .. } => "remote_nats",
        }
    }

    /// Whether the error is the server saying the operation is not supported.
    pub fn is_unsupported(&self) -> bool {
        matches!(self, EnvServiceError::Server { code, .. } if *code == ErrorCode::Unsupported.code())
    }

    fn bad_reply(instance: &str, op: &'static str, err: ProtocolError) -> Self {
        EnvServiceError::BadReply { instance: instance.to_string(), op, message: err.to_string() }
    }
}

/// Counters a [`RemoteVecEnv`] keeps; an actor exports them as metrics.
#[derive(Debug, Default)]
pub struct RemoteEnvCounters {
    /// Sessions opened (including re-opened after a loss).
    pub sessions_opened: AtomicU64,
    /// Sessions lost: the instance died, timed out, forgot the session or sent a bad reply.
    /// Each aborts the episodes the session hosted.
    pub sessions_lost: AtomicU64,
    /// Requests sent to environment servers.
    pub requests: AtomicU64,
}

/// Shuts an owned runtime down without waiting for its tasks (see `transport::nats`).
pub(crate) struct OwnedRuntime(pub(crate) Option<tokio::runtime::Runtime>);

impl Drop for OwnedRuntime {
    fn drop(&mut self) {
        if let Some(runtime) = self.0.take() {
            runtime.shutdown_background();
        }
    }
}

impl fmt::Debug for OwnedRuntime {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(if self.0.is_some() { "OwnedRuntime(owned)" } else { "OwnedRuntime(borrowed)" })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn service_names_are_lowercase_tokens() {
        for good in ["cartpole", "cartpole-v1", "a_b", "0", &"x".repeat(48)] {
            assert_eq!(EnvServiceName::new(good).unwrap().as_str(), good);
        }
        for bad in ["", "CartPole-v1", "a.b", "a b", "a*", "a>", "gymnasium:x", &"x".repeat(49)] {
            assert!(matches!(EnvServiceName::new(bad), Err(InvalidServiceName(_))), "{bad:?}");
        }
        let json = serde_json::to_string(&EnvServiceName::new("x-1").unwrap()).unwrap();
        assert_eq!(json, "\"x-1\"");
        assert!(serde_json::from_str::<EnvServiceName>("\"X\"").is_err());
    }

    #[test]
    fn reasons_are_bounded_labels() {
        let server = |code| EnvServiceError::Server { instance: "i".into(), op: "step", code, message: String::new() };
        assert_eq!(server(404).reason(), "remote_unknown_session");
        assert_eq!(server(503).reason(), "remote_capacity");
        assert_eq!(server(999).reason(), "remote_server_error");
        assert!(server(501).is_unsupported());
        assert_eq!(EnvServiceError::Gone { instance: "i".into(), op: "step" }.reason(), "remote_gone");
    }
}
