//! Newtypes that carry meaning across process boundaries.

use std::fmt;

/// A policy version: what one weights publish produces. Versions only ever increase.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Default, serde::Serialize, serde::Deserialize)]
pub struct PolicyVersion(pub u64);

impl PolicyVersion {
    /// The largest version a run can plausibly reach (2^48: a thousand years at ten thousand
    /// updates a second). A claimed version above it is absurd: a learner refuses to continue
    /// above it, so no forged or corrupted pointer can push versions to a wrap (docs/SECURITY.md).
    pub const MAX_PLAUSIBLE: PolicyVersion = PolicyVersion(1 << 48);

    /// Lag of data produced by `behaviour` as seen by a learner at `self` (saturating at 0).
    pub fn lag_of(self, behaviour: PolicyVersion) -> u64 {
        self.0.saturating_sub(behaviour.0)
    }

    /// The version after this one, unless that would be above [`PolicyVersion::MAX_PLAUSIBLE`].
    pub fn next(self) -> Option<PolicyVersion> {
        self.0.checked_add(1).map(PolicyVersion).filter(|next| *next <= Self::MAX_PLAUSIBLE)
    }
}

impl fmt::Display for PolicyVersion {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "v{}", self.0)
    }
}

/// An identifier that failed validation.
///
/// The offending value is kept cut to [`IdError::MAX_SHOWN_CHARS`] characters, with its full
/// length: ids arrive from the network, and a 200 KB actor id must not become a 200 KB log line.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("invalid {kind} {value:?} ({len_bytes} bytes): expected {rule}")]
pub struct IdError {
    kind: &'static str,
    value: String,
    len_bytes: usize,
    rule: &'static str,
}

impl IdError {
    /// The most characters of an invalid value an error keeps.
    pub const MAX_SHOWN_CHARS: usize = 64;

    /// Every `kind` an [`IdError`] names; its message starts with `invalid <kind> `.
    pub const KINDS: &'static [&'static str] = &["run id", "actor id"];

    fn new(kind: &'static str, value: &str, rule: &'static str) -> Self {
        let shown = match value.char_indices().nth(Self::MAX_SHOWN_CHARS) {
            Some((end, _)) => &value[..end],
            None => value,
        };
        IdError { kind, value: shown.to_owned(), len_bytes: value.len(), rule }
    }

    /// Which kind of id failed (one of [`IdError::KINDS`]).
    pub fn kind(&self) -> &'static str {
        self.kind
    }

    /// Whether `message` is the text of an [`IdError`]: how a codec recognises an id that
    /// failed its `Deserialize` (serde formats carry custom errors as text only).
    pub fn is_message(message: &str) -> bool {
        Self::KINDS.iter().any(|kind| message.strip_prefix("invalid ").is_some_and(|rest| rest.starts_with(kind)))
    }
}

/// A run name: `[a-z0-9-]{1,16}`, so every subject, stream and bucket name built from it is valid.
#[derive(Debug, Clone, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
#[serde(try_from = "String", into = "String")]
pub struct RunId(String);

impl RunId {
    /// Validate and wrap a run name.
    pub fn new(name: impl Into<String>) -> Result<Self, IdError> {
        let name = name.into();
        let valid = !name.is_empty()
            && name.len() <= 16
            && name.bytes().all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-');
        if valid {
            Ok(RunId(name))
        } else {
            Err(IdError::new("run id", &name, "1-16 characters of [a-z0-9-]"))
        }
    }

    /// The name as a string slice.
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl TryFrom<String> for RunId {
    type Error = IdError;
    fn try_from(value: String) -> Result<Self, Self::Error> {
        RunId::new(value)
    }
}

impl From<RunId> for String {
    fn from(id: RunId) -> String {
        id.0
    }
}

impl PartialEq<&str> for RunId {
    fn eq(&self, other: &&str) -> bool {
        self.0 == *other
    }
}

impl fmt::Display for RunId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

/// An actor's identity: `[A-Za-z0-9_-]{1,64}` (a pod name fits), unique within a run.
#[derive(Debug, Clone, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
#[serde(try_from = "String", into = "String")]
pub struct ActorId(String);

impl ActorId {
    /// Validate and wrap an actor name.
    pub fn new(name: impl Into<String>) -> Result<Self, IdError> {
        let name = name.into();
        let valid = !name.is_empty()
            && name.len() <= 64
            && name.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_');
        if valid {
            Ok(ActorId(name))
        } else {
            Err(IdError::new("actor id", &name, "1-64 characters of [A-Za-z0-9_-]"))
        }
    }

    /// The name as a string slice.
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl TryFrom<String> for ActorId {
    type Error = IdError;
    fn try_from(value: String) -> Result<Self, Self::Error> {
        ActorId::new(value)
    }
}

impl From<ActorId> for String {
    fn from(id: ActorId) -> String {
        id.0
    }
}

impl PartialEq<&str> for ActorId {
    fn eq(&self, other: &&str) -> bool {
        self.0 == *other
    }
}

impl fmt::Display for ActorId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn run_id_accepts_lowercase_digits_and_hyphens_only() {
        assert!(RunId::new("cartpole-1").is_ok());
        assert!(RunId::new("").is_err());
        assert!(RunId::new("a.b").is_err());
        assert!(RunId::new("UPPER").is_err());
        assert!(RunId::new("seventeen-chars-x").is_err());
        assert!(RunId::new("run>").is_err());
    }

    #[test]
    fn actor_id_accepts_pod_names() {
        assert!(ActorId::new("volley-actor-7f9c6d-x2kq").is_ok());
        assert!(ActorId::new("a b").is_err());
        assert!(ActorId::new("a.b").is_err());
    }

    #[test]
    fn errors_cut_long_values_and_are_recognisable_as_text() {
        let err = ActorId::new("x".repeat(200_000)).expect_err("too long");
        let message = err.to_string();
        assert!(message.len() < 200, "{message}");
        assert!(message.contains("200000 bytes"), "{message}");
        assert!(IdError::is_message(&message));
        assert!(IdError::is_message(&RunId::new("A").expect_err("uppercase").to_string()));
        assert!(!IdError::is_message("invalid value: integer `7`"));
    }

    #[test]
    fn next_is_checked_and_stops_at_the_plausible_maximum() {
        assert_eq!(PolicyVersion(4).next(), Some(PolicyVersion(5)));
        assert_eq!(PolicyVersion::MAX_PLAUSIBLE.next(), None);
        assert_eq!(PolicyVersion(u64::MAX).next(), None);
    }

    #[test]
    fn lag_saturates_at_zero() {
        assert_eq!(PolicyVersion(5).lag_of(PolicyVersion(3)), 2);
        assert_eq!(PolicyVersion(3).lag_of(PolicyVersion(5)), 0);
    }

    #[test]
    fn run_id_deserialization_validates() {
        let config = bincode::config::standard();
        let bytes = bincode::serde::encode_to_vec("Bad.Name", config).expect("encode a string");
        let decoded: Result<(RunId, usize), _> = bincode::serde::decode_from_slice(&bytes, config);
        assert!(decoded.is_err());
        let bytes = bincode::serde::encode_to_vec("good-name", config).expect("encode a string");
        let (id, _): (RunId, usize) = bincode::serde::decode_from_slice(&bytes, config).expect("valid");
        assert_eq!(id.as_str(), "good-name");
    }
}
