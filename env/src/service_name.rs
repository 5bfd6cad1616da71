//! The name of an environment served over NATS (see `volley_transport::envsvc`).

use std::fmt;

/// A service name outside `[a-z0-9_-]{1,48}`.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("invalid environment service name {0:?}: expected [a-z0-9_-]{{1,48}}")]
pub struct InvalidServiceName(pub String);

/// The name of an environment service: `[a-z0-9_-]{1,48}`. Its NATS micro service is
/// `volley-env-<name>` and its subjects `volley.env.<name>.<instance>.<op>`.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord, serde::Serialize, serde::Deserialize)]
#[serde(try_from = "String", into = "String")]
pub struct EnvServiceName(String);

impl EnvServiceName {
    /// Longest accepted name.
    pub const MAX_LEN: usize = 48;

    /// Validate a name.
    pub fn new(name: impl Into<String>) -> Result<Self, InvalidServiceName> {
        let name = name.into();
        let valid = !name.is_empty()
            && name.len() <= Self::MAX_LEN
            && name.bytes().all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-' || b == b'_');
        if valid {
            Ok(EnvServiceName(name))
        } else {
            Err(InvalidServiceName(name))
        }
    }

    /// The name as a string.
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl fmt::Display for EnvServiceName {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl TryFrom<String> for EnvServiceName {
    type Error = InvalidServiceName;
    fn try_from(name: String) -> Result<Self, Self::Error> {
        EnvServiceName::new(name)
    }
}

impl From<EnvServiceName> for String {
    fn from(name: EnvServiceName) -> String {
        name.0
    }
}
