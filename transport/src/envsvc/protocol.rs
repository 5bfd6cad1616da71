//! The messages of the environment protocol (docs/ENV_PROTOCOL.md) and their MessagePack codec.
//!
//! Every request and reply is one MessagePack map with string keys (`rmp_serde::to_vec_named`),
//! so a server in any language writes them with a stock MessagePack library. Arrays of `f32`
//! travel as `bin` values holding little-endian IEEE-754 floats, row-major, which numpy reads
//! and writes without a loop (`np.frombuffer(b, "<f4")`, `a.astype("<f4").tobytes()`).
//! Keys a reader does not know are ignored, and keys marked optional may be left out, so
//! adding a key never needs a new [`PROTOCOL_VERSION`].
//!
//! Errors are not messages: a server answers a failed request with an empty body and the NATS
//! service-API headers `Nats-Service-Error` (a description) and `Nats-Service-Error-Code`
//! (one of the [`ErrorCode`]s).

use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};

/// The newest protocol version, which every request of this build carries in `v` to an instance
/// announcing it. Version 2 added continuous (`Box`) actions: the `spaces` reply's
/// `action_space` and `f32` actions in `step`. Version 3 added image observations: the
/// `spaces` reply's `obs_space` and observations of one byte per value (docs/ENV_PROTOCOL.md,
/// "Versioning").
pub const PROTOCOL_VERSION: u32 = 3;

/// The oldest version that carries image observations (`obs_space` kind `image`).
pub const IMAGE_PROTOCOL_VERSION: u32 = 3;

/// The oldest version this build speaks. Version 1 messages are version 2's for `Discrete`
/// environments, so keeping it costs one comparison: a server answers version 1 requests for a
/// discrete environment (and [`ErrorCode::UnsupportedVersion`] for a continuous one), and a
/// client talks version 1 to a version-1 instance when it needs discrete actions.
pub const MIN_PROTOCOL_VERSION: u32 = 1;

/// Service metadata key announcing the protocol version (value: the version in decimal).
pub const METADATA_PROTOCOL: &str = "volley_env_protocol";

/// Service metadata key holding the environment service's name.
pub const METADATA_ENV: &str = "volley_env";

/// Reply header with the error description (NATS service API, ADR-32).
pub const ERROR_HEADER: &str = "Nats-Service-Error";

/// Reply header with the error code (NATS service API, ADR-32).
pub const ERROR_CODE_HEADER: &str = "Nats-Service-Error-Code";

/// The operations, by endpoint name (the name an instance lists in its `$SRV.INFO` reply).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Op {
    /// Observation and action spaces and limits of the environment.
    Spaces,
    /// Create a session of N environments and reset them.
    Open,
    /// Reset every environment of a session.
    Reset,
    /// Step every environment of a session (auto-reset).
    Step,
    /// The state of one environment of a session.
    Snapshot,
    /// Restore one environment of a session.
    Restore,
    /// Drop a session.
    Close,
}

impl Op {
    /// Every operation, in the order of the protocol document.
    pub const ALL: [Op; 7] = [Op::Spaces, Op::Open, Op::Reset, Op::Step, Op::Snapshot, Op::Restore, Op::Close];

    /// The endpoint name (and last subject token).
    pub fn name(self) -> &'static str {
        match self {
            Op::Spaces => "spaces",
            Op::Open => "open",
            Op::Reset => "reset",
            Op::Step => "step",
            Op::Snapshot => "snapshot",
            Op::Restore => "restore",
            Op::Close => "close",
        }
    }

    /// The operation of an endpoint name.
    pub fn from_name(name: &str) -> Option<Op> {
        Op::ALL.into_iter().find(|op| op.name() == name)
    }
}

/// The error codes of error replies (HTTP-like, as the NATS service API suggests).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ErrorCode {
    /// The request did not decode, or a field is out of range (wrong number of actions).
    BadRequest,
    /// The session does not exist (closed, expired after its idle timeout, or the server
    /// restarted).
    UnknownSession,
    /// The operation is not supported by this environment (snapshot/restore).
    Unsupported,
    /// The server is at its session or environment limit; try another instance.
    Capacity,
    /// The environment failed outside a step (e.g. while opening a session).
    Internal,
    /// The request's protocol version is not served here.
    UnsupportedVersion,
}

impl ErrorCode {
    /// The numeric code sent in [`ERROR_CODE_HEADER`].
    pub fn code(self) -> u16 {
        match self {
            ErrorCode::BadRequest => 400,
            ErrorCode::UnknownSession => 404,
            ErrorCode::Unsupported => 501,
            ErrorCode::Capacity => 503,
            ErrorCode::Internal => 500,
            ErrorCode::UnsupportedVersion => 505,
        }
    }

    /// The code of a numeric value, if it is one of ours.
    pub fn from_code(code: u16) -> Option<ErrorCode> {
        [
            ErrorCode::BadRequest,
            ErrorCode::UnknownSession,
            ErrorCode::Unsupported,
            ErrorCode::Capacity,
            ErrorCode::Internal,
            ErrorCode::UnsupportedVersion,
        ]
        .into_iter()
        .find(|c| c.code() == code)
    }
}

/// `spaces` request.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SpacesRequest {
    /// Protocol version.
    pub v: u32,
}

/// `spaces` reply: what every session of this instance looks like.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SpacesReply {
    /// What the server runs (`"cartpole"`, `"gymnasium:CartPole-v1"`); informative.
    pub env: String,
    /// Observation length (a flat `f32` box).
    pub obs_dim: u32,
    /// Lower bounds, `obs_dim` floats (`-inf` where unbounded).
    #[serde(with = "f32_bin")]
    pub obs_low: Vec<f32>,
    /// Upper bounds, `obs_dim` floats (`inf` where unbounded).
    #[serde(with = "f32_bin")]
    pub obs_high: Vec<f32>,
    /// Number of discrete actions `0..n_actions`; 0 for a `Box` action space (a version-1 reader
    /// then refuses the reply instead of stepping integers).
    #[serde(default)]
    pub n_actions: u32,
    /// The action space (version 2); absent (a version-1 server): `Discrete { n: n_actions }`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub action_space: Option<ActionSpaceMsg>,
    /// Mean return at which the environment counts as solved, if known.
    #[serde(default)]
    pub reward_threshold: Option<f32>,
    /// Time limit of an episode in steps, if any.
    #[serde(default)]
    pub max_episode_steps: Option<u32>,
    /// Largest |reward| of one step, if declared; the learner rejects segments beyond it
    /// (docs/SECURITY.md).
    #[serde(default)]
    pub max_abs_reward: Option<f32>,
    /// Whether `snapshot` and `restore` work.
    #[serde(default)]
    pub snapshot: bool,
    /// Largest `n_envs` an `open` may ask for.
    pub max_envs_per_session: u32,
    /// The observation space (version 3): absent or kind `box` for flat `f32` vectors, kind
    /// `image` for `u8` images, whose observations travel one byte per value.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub obs_space: Option<ObsSpaceMsg>,
}

/// The `obs_space` of a `spaces` reply: `{kind: "box"}` (flat `f32` vectors, as without the
/// key) or `{kind: "image", shape: [C, H, W], dtype: "u8"}`.
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
pub struct ObsSpaceMsg {
    /// `"box"` or `"image"`.
    pub kind: String,
    /// Image: `[C, H, W]`, channel-major; `C·H·W` is `obs_dim`.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub shape: Vec<u32>,
    /// Image: the element type, `"u8"`.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub dtype: String,
}

/// The `kind` of a flat vector [`ObsSpaceMsg`].
pub const OBS_KIND_BOX: &str = "box";
/// The `kind` of an image [`ObsSpaceMsg`].
pub const OBS_KIND_IMAGE: &str = "image";
/// The `dtype` of an image [`ObsSpaceMsg`].
pub const OBS_DTYPE_U8: &str = "u8";

/// How observations travel: little-endian `f32`s, or one byte per value (images).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum ObsEncoding {
    /// Four bytes per value, little-endian IEEE-754.
    #[default]
    F32,
    /// One byte per value, `0..=255`.
    U8,
}

impl ObsSpaceMsg {
    /// The message for a `u8` image of shape `[C, H, W]`.
    pub fn image(shape: [usize; 3]) -> Self {
        ObsSpaceMsg {
            kind: OBS_KIND_IMAGE.into(),
            shape: shape.iter().map(|&d| d as u32).collect(),
            dtype: OBS_DTYPE_U8.into(),
        }
    }
}

impl SpacesReply {
    /// The image shape `[C, H, W]` for an image observation space, `None` for flat vectors;
    /// an unknown kind or dtype, or a shape that is not `obs_dim` values, is an error.
    pub fn image_shape(&self) -> Result<Option<[usize; 3]>, String> {
        let Some(msg) = &self.obs_space else { return Ok(None) };
        match msg.kind.as_str() {
            OBS_KIND_BOX => Ok(None),
            OBS_KIND_IMAGE => {
                if msg.dtype != OBS_DTYPE_U8 {
                    return Err(format!("image observations of dtype {:?} (only \"u8\" is known)", msg.dtype));
                }
                let [c, h, w] = msg.shape[..] else {
                    return Err(format!("image shape {:?} is not [C, H, W]", msg.shape));
                };
                let len = (c as usize).checked_mul(h as usize).and_then(|n| n.checked_mul(w as usize));
                if len != Some(self.obs_dim as usize) || len == Some(0) {
                    return Err(format!("image shape {:?} for obs_dim {}", msg.shape, self.obs_dim));
                }
                Ok(Some([c as usize, h as usize, w as usize]))
            }
            other => Err(format!("unknown observation space kind {other:?}")),
        }
    }

    /// How this instance's observations travel.
    pub fn obs_encoding(&self) -> ObsEncoding {
        match self.image_shape() {
            Ok(Some(_)) => ObsEncoding::U8,
            _ => ObsEncoding::F32,
        }
    }
}

/// The `action_space` of a `spaces` reply: `{kind: "discrete", n}` or
/// `{kind: "box", shape, low, high}`. A flat map with a `kind` string rather than a tagged
/// enum, so that any MessagePack library writes it without knowing serde's enum layouts.
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
pub struct ActionSpaceMsg {
    /// `"discrete"` or `"box"`.
    pub kind: String,
    /// Discrete: the number of actions.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub n: u32,
    /// Box: the action's shape; the values travel flat, row-major (`product(shape)` of them).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub shape: Vec<u32>,
    /// Box: lower bound per value (finite).
    #[serde(default, skip_serializing_if = "Vec::is_empty", with = "f32_bin")]
    pub low: Vec<f32>,
    /// Box: upper bound per value (finite, `>= low`).
    #[serde(default, skip_serializing_if = "Vec::is_empty", with = "f32_bin")]
    pub high: Vec<f32>,
}

fn is_zero(n: &u32) -> bool {
    *n == 0
}

/// The `kind` of a discrete [`ActionSpaceMsg`].
pub const ACTION_KIND_DISCRETE: &str = "discrete";
/// The `kind` of a continuous [`ActionSpaceMsg`].
pub const ACTION_KIND_BOX: &str = "box";

impl ActionSpaceMsg {
    /// The message for an action space.
    pub fn from_space(space: &volley_env::ActionSpace) -> Self {
        match space {
            volley_env::ActionSpace::Discrete { n } => {
                ActionSpaceMsg { kind: ACTION_KIND_DISCRETE.into(), n: *n as u32, ..Default::default() }
            }
            volley_env::ActionSpace::Box { low, high, shape } => ActionSpaceMsg {
                kind: ACTION_KIND_BOX.into(),
                n: 0,
                shape: shape.iter().map(|&d| d as u32).collect(),
                low: low.clone(),
                high: high.clone(),
            },
        }
    }
}

impl SpacesReply {
    /// The action space, checked: a known kind, at least one action, and for a box a shape
    /// whose product is the number of bounds, every bound finite with `low <= high` (what
    /// [`volley_env::ActionSpace::continuous`] accepts). A reply without `action_space` (a
    /// version-1 server) is `Discrete { n: n_actions }`.
    pub fn action_space(&self) -> Result<volley_env::ActionSpace, String> {
        let Some(msg) = &self.action_space else {
            if self.n_actions == 0 {
                return Err("no actions (n_actions 0 and no action_space)".to_string());
            }
            return Ok(volley_env::ActionSpace::Discrete { n: self.n_actions as usize });
        };
        match msg.kind.as_str() {
            ACTION_KIND_DISCRETE if msg.n > 0 => Ok(volley_env::ActionSpace::Discrete { n: msg.n as usize }),
            ACTION_KIND_DISCRETE => Err("a discrete action space of 0 actions".to_string()),
            ACTION_KIND_BOX => {
                let dim = msg.shape.iter().try_fold(1usize, |acc, &d| acc.checked_mul(d as usize));
                if msg.shape.is_empty() || dim != Some(msg.low.len()) {
                    return Err(format!("box action shape {:?} for {} bounds", msg.shape, msg.low.len()));
                }
                match volley_env::ActionSpace::continuous(msg.low.clone(), msg.high.clone()) {
                    Ok(volley_env::ActionSpace::Box { low, high, .. }) => Ok(volley_env::ActionSpace::Box {
                        low,
                        high,
                        shape: msg.shape.iter().map(|&d| d as usize).collect(),
                    }),
                    Ok(other) => Ok(other),
                    Err(err) => Err(err.to_string()),
                }
            }
            other => Err(format!("unknown action space kind {other:?}")),
        }
    }
}

/// `open` request: create a session of `n_envs` environments, reset environment `i` with
/// `seeds[i]`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct OpenRequest {
    /// Protocol version.
    pub v: u32,
    /// Number of environments in the session.
    pub n_envs: u32,
    /// One seed per environment.
    pub seeds: Vec<u64>,
}

/// `open` reply.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct OpenReply {
    /// The session id (unique within this instance).
    pub session: u64,
    /// First observations, `n_envs × obs_dim` values ([`ObsBin`]).
    pub obs: ObsBin,
    /// The server drops a session that received no request for this long.
    #[serde(default)]
    pub idle_timeout_ms: u64,
}

/// `reset` request: start a new episode in every environment of the session.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ResetRequest {
    /// Protocol version.
    pub v: u32,
    /// The session.
    pub session: u64,
    /// One entry per environment reset: a seed, or nil to continue the environment's own
    /// generator.
    pub seeds: Vec<Option<u64>>,
    /// Version 3: the environments to reset, distinct indices within the session (one seed
    /// each); absent: every environment. The reply holds every environment's observation.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub envs: Option<Vec<u32>>,
}

/// Reply of `reset` and `restore`: observations.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ObsReply {
    /// `reset`: `n_envs × obs_dim` values; `restore`: the restored environment's `obs_dim`.
    pub obs: ObsBin,
}

/// `step` request: one action per environment of the session.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct StepRequest {
    /// Protocol version.
    pub v: u32,
    /// The session.
    pub session: u64,
    /// The actions: an array of `n_envs` integers, or a `bin` of `n_envs × action_dim` floats.
    pub actions: StepActions,
}

/// The `actions` of a [`StepRequest`], told apart by their MessagePack type, as observations
/// are: an **array** of `u32` (discrete), or a **bin** of little-endian `f32`s,
/// `[n_envs][action_dim]` row-major (box).
#[derive(Debug, Clone, PartialEq)]
pub enum StepActions {
    /// One action in `0..n` per environment.
    Discrete(Vec<u32>),
    /// `action_dim` values per environment, flat.
    Box(Vec<f32>),
}

impl Serialize for StepActions {
    fn serialize<S: serde::Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        match self {
            StepActions::Discrete(actions) => actions.serialize(serializer),
            StepActions::Box(values) => f32_bin::serialize(values, serializer),
        }
    }
}

impl<'de> Deserialize<'de> for StepActions {
    fn deserialize<D: serde::Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        struct Visitor;
        impl<'de> serde::de::Visitor<'de> for Visitor {
            type Value = StepActions;

            fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
                f.write_str("an array of u32 actions or a bin of little-endian f32 actions")
            }

            fn visit_seq<A: serde::de::SeqAccess<'de>>(self, mut seq: A) -> Result<StepActions, A::Error> {
                // At most what the message can hold: a hostile length prefix allocates nothing.
                let mut actions = Vec::with_capacity(seq.size_hint().unwrap_or(0).min(4096));
                while let Some(action) = seq.next_element::<u32>()? {
                    actions.push(action);
                }
                Ok(StepActions::Discrete(actions))
            }

            fn visit_bytes<E: serde::de::Error>(self, bytes: &[u8]) -> Result<StepActions, E> {
                f32_bin::from_bytes(bytes).map(StepActions::Box).map_err(E::custom)
            }

            fn visit_byte_buf<E: serde::de::Error>(self, bytes: Vec<u8>) -> Result<StepActions, E> {
                self.visit_bytes(&bytes)
            }
        }
        deserializer.deserialize_any(Visitor)
    }
}

/// One environment that failed during a step; the server started it again.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct EnvFailure {
    /// Index of the environment within the session.
    pub env: u32,
    /// What went wrong.
    pub message: String,
}

/// `step` reply. Environments whose episode ended (terminated or truncated) were reset by the
/// server: their row of `obs` is the next episode's first observation, and their last
/// observation is in `final_obs`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct StepReply {
    /// Current observations, `n_envs × obs_dim` values.
    pub obs: ObsBin,
    /// `n_envs` rewards.
    #[serde(with = "f32_bin")]
    pub rewards: Vec<f32>,
    /// `n_envs` flags: the episode reached a terminal state.
    pub terminated: Vec<bool>,
    /// `n_envs` flags: the episode was cut by a time limit (or by a failure).
    pub truncated: Vec<bool>,
    /// One `obs_dim` row per environment whose episode ended, in environment order: the
    /// observation before the reset (the last valid one for a failed environment).
    #[serde(default)]
    pub final_obs: ObsBin,
    /// Environments that failed this step (reported truncated with reward 0, then reset).
    #[serde(default)]
    pub errors: Vec<EnvFailure>,
}

/// `snapshot` request.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SnapshotRequest {
    /// Protocol version.
    pub v: u32,
    /// The session.
    pub session: u64,
    /// Index of the environment within the session.
    pub env: u32,
}

/// `snapshot` reply.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SnapshotReply {
    /// Opaque state bytes, restorable on any instance of the same service.
    #[serde(with = "serde_bytes")]
    pub state: Vec<u8>,
}

/// `restore` request.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RestoreRequest {
    /// Protocol version.
    pub v: u32,
    /// The session.
    pub session: u64,
    /// Index of the environment within the session.
    pub env: u32,
    /// Bytes from a `snapshot` reply.
    #[serde(with = "serde_bytes")]
    pub state: Vec<u8>,
}

/// `close` request. Closing an unknown session succeeds.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct CloseRequest {
    /// Protocol version.
    pub v: u32,
    /// The session.
    pub session: u64,
}

/// An empty reply map (`close`).
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
pub struct EmptyReply {}

/// Just the version of a request, read before the rest so that a request of another version
/// gets [`ErrorCode::UnsupportedVersion`] rather than a decode error.
#[derive(Debug, Clone, Deserialize)]
pub struct VersionProbe {
    /// The request's `v`, if it has one.
    #[serde(default)]
    pub v: Option<u32>,
}

/// One instance as its `$SRV.INFO` reply (JSON, NATS service API) describes it.
#[derive(Debug, Clone, PartialEq, Deserialize)]
pub struct ServiceInfo {
    /// The service name (`volley-env-<name>`).
    pub name: String,
    /// The instance id, unique per running server.
    pub id: String,
    /// The server's own version (semver); informative.
    #[serde(default)]
    pub version: String,
    /// Service metadata; carries [`METADATA_PROTOCOL`].
    #[serde(default, deserialize_with = "null_as_default")]
    pub metadata: std::collections::HashMap<String, String>,
    /// The endpoints, one per [`Op`].
    #[serde(default, deserialize_with = "null_as_default")]
    pub endpoints: Vec<ServiceEndpoint>,
}

/// One endpoint of a [`ServiceInfo`].
#[derive(Debug, Clone, PartialEq, Deserialize)]
pub struct ServiceEndpoint {
    /// The endpoint name ([`Op::name`]).
    pub name: String,
    /// The subject requests go to.
    pub subject: String,
}

fn null_as_default<'de, D, T>(deserializer: D) -> Result<T, D::Error>
where
    D: serde::Deserializer<'de>,
    T: Default + Deserialize<'de>,
{
    Ok(Option::<T>::deserialize(deserializer)?.unwrap_or_default())
}

/// Why a message did not decode.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[error("undecodable {what}: {message}")]
pub struct ProtocolError {
    /// Which message.
    pub what: &'static str,
    /// The decoder's complaint.
    pub message: String,
}

/// Encode a message as a MessagePack map with string keys.
pub fn encode<T: Serialize>(message: &T) -> Vec<u8> {
    rmp_serde::to_vec_named(message).expect("protocol messages always encode")
}

/// Decode a message (`what` names it in the error). Never panics on arbitrary bytes.
pub fn decode<T: DeserializeOwned>(what: &'static str, bytes: &[u8]) -> Result<T, ProtocolError> {
    rmp_serde::from_slice(bytes).map_err(|err| ProtocolError { what, message: err.to_string() })
}

/// Observations as they travel: a MessagePack `bin` whose element type the instance's
/// `obs_space` fixes ([`SpacesReply::obs_encoding`]): little-endian `f32`s, or one byte per
/// value for images. The reader decodes them with the encoding it learnt from `spaces`.
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
#[serde(transparent)]
pub struct ObsBin(#[serde(with = "serde_bytes")] pub Vec<u8>);

impl ObsBin {
    /// Encode `values` as `encoding` says. For [`ObsEncoding::U8`] every value must be a whole
    /// number in `0..=255` (what an image environment produces); others saturate.
    pub fn encode(values: &[f32], encoding: ObsEncoding) -> Self {
        match encoding {
            ObsEncoding::F32 => ObsBin(values.iter().flat_map(|v| v.to_le_bytes()).collect()),
            ObsEncoding::U8 => ObsBin(values.iter().map(|&v| v as u8).collect()),
        }
    }

    /// Whether there are no bytes (no observations).
    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    /// The number of values the bytes hold in `encoding`, or an error for a length that is not
    /// a whole number of values.
    pub fn n_values(&self, encoding: ObsEncoding) -> Result<usize, String> {
        match encoding {
            ObsEncoding::U8 => Ok(self.0.len()),
            ObsEncoding::F32 if self.0.len().is_multiple_of(4) => Ok(self.0.len() / 4),
            ObsEncoding::F32 => Err(format!("f32 array of {} bytes is not a multiple of 4", self.0.len())),
        }
    }

    /// The values, decoded as `encoding` says.
    pub fn decode(&self, encoding: ObsEncoding) -> Result<Vec<f32>, String> {
        match encoding {
            ObsEncoding::F32 => f32_bin::from_bytes(&self.0),
            ObsEncoding::U8 => Ok(self.0.iter().map(|&b| f32::from(b)).collect()),
        }
    }
}

/// `Vec<f32>` as a MessagePack `bin` of little-endian `f32`s.
pub(crate) mod f32_bin {
    use serde::de::Error;
    use serde::{Deserialize, Deserializer, Serializer};

    pub(crate) fn serialize<S: Serializer>(values: &[f32], serializer: S) -> Result<S::Ok, S::Error> {
        let mut bytes = Vec::with_capacity(values.len() * 4);
        for value in values {
            bytes.extend_from_slice(&value.to_le_bytes());
        }
        serializer.serialize_bytes(&bytes)
    }

    pub(crate) fn deserialize<'de, D: Deserializer<'de>>(deserializer: D) -> Result<Vec<f32>, D::Error> {
        let bytes = serde_bytes::ByteBuf::deserialize(deserializer)?;
        from_bytes(&bytes).map_err(D::Error::custom)
    }

    /// Little-endian `f32`s of `bytes`; a length that is not a multiple of 4 is an error.
    pub(crate) fn from_bytes(bytes: &[u8]) -> Result<Vec<f32>, String> {
        if !bytes.len().is_multiple_of(4) {
            return Err(format!("f32 array of {} bytes is not a multiple of 4", bytes.len()));
        }
        Ok(bytes.chunks_exact(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn step_reply_round_trips_with_infinite_and_negative_values() {
        let obs = vec![1.5, -0.0, f32::INFINITY, -3.25];
        let reply = StepReply {
            obs: ObsBin::encode(&obs, ObsEncoding::F32),
            rewards: vec![1.0, 0.0],
            terminated: vec![true, false],
            truncated: vec![false, true],
            final_obs: ObsBin::encode(&[9.0, 8.0, 7.0, 6.0], ObsEncoding::F32),
            errors: vec![EnvFailure { env: 1, message: "boom".into() }],
        };
        let bytes = encode(&reply);
        let decoded = decode::<StepReply>("step reply", &bytes).unwrap();
        assert_eq!(decoded, reply);
        let bits = |values: &[f32]| values.iter().map(|v| v.to_bits()).collect::<Vec<_>>();
        assert_eq!(bits(&decoded.obs.decode(ObsEncoding::F32).unwrap()), bits(&obs));
    }

    /// Image observations travel one byte per value and decode to the same whole numbers.
    #[test]
    fn image_observations_are_one_byte_per_value() {
        let values: Vec<f32> = (0..=255).map(|v| v as f32).collect();
        let reply = ObsReply { obs: ObsBin::encode(&values, ObsEncoding::U8) };
        let bytes = encode(&reply);
        // fixmap of 1, "obs", then bin16 of 256 bytes.
        assert_eq!(&bytes[..8], &[0x81, 0xa3, b'o', b'b', b's', 0xc5, 1, 0]);
        assert_eq!(bytes.len(), 8 + 256);
        let decoded: ObsReply = decode("obs reply", &bytes).unwrap();
        assert_eq!(decoded.obs.n_values(ObsEncoding::U8), Ok(256));
        assert_eq!(decoded.obs.decode(ObsEncoding::U8).unwrap(), values);
        // The same bytes read as floats are 64 values, so a reader that ignored obs_space would
        // fail the length check.
        assert_eq!(decoded.obs.n_values(ObsEncoding::F32), Ok(64));
    }

    #[test]
    fn image_obs_spaces_are_checked() {
        let mut spaces = spaces_reply();
        assert_eq!(spaces.image_shape(), Ok(None));
        assert_eq!(spaces.obs_encoding(), ObsEncoding::F32);
        spaces.obs_space = Some(ObsSpaceMsg { kind: OBS_KIND_BOX.into(), ..Default::default() });
        assert_eq!(spaces.image_shape(), Ok(None));
        spaces.obs_dim = 2 * 84 * 84;
        spaces.obs_space = Some(ObsSpaceMsg::image([2, 84, 84]));
        assert_eq!(spaces.image_shape(), Ok(Some([2, 84, 84])));
        assert_eq!(spaces.obs_encoding(), ObsEncoding::U8);
        let decoded: SpacesReply = decode("spaces", &encode(&spaces)).unwrap();
        assert_eq!(decoded.image_shape(), Ok(Some([2, 84, 84])));
        for (shape, dtype, kind) in [
            (vec![1, 84, 84], "u8", "image"),
            (vec![2, 84], "u8", "image"),
            (vec![2, 84, 84], "f32", "image"),
            (vec![2, 84, 84], "u8", "voxels"),
            (vec![0, 84, 84], "u8", "image"),
        ] {
            spaces.obs_space = Some(ObsSpaceMsg { kind: kind.into(), shape, dtype: dtype.into() });
            assert!(spaces.image_shape().is_err(), "{:?}", spaces.obs_space);
        }
    }

    /// The layout other languages must produce: a map with string keys, floats as `bin`.
    #[test]
    fn open_reply_bytes_are_a_named_map_with_f32_bins() {
        let bytes =
            encode(&OpenReply { session: 7, obs: ObsBin::encode(&[1.0], ObsEncoding::F32), idle_timeout_ms: 0 });
        // fixmap of 3 entries, then "session" as fixstr, 7 as positive fixint.
        assert_eq!(&bytes[..10], &[0x83, 0xa7, b's', b'e', b's', b's', b'i', b'o', b'n', 7]);
        // "obs" then bin8 of 4 bytes holding 1.0f32 little-endian.
        assert_eq!(&bytes[10..20], &[0xa3, b'o', b'b', b's', 0xc4, 4, 0, 0, 0x80, 0x3f]);
    }

    /// What Python's `msgpack.packb` writes for a `step` reply with Python floats and without the
    /// optional keys decodes (floats widen from f64, optional keys default).
    #[test]
    fn a_reply_without_optional_keys_decodes() {
        // {"obs": b"", "rewards": b"", "terminated": [], "truncated": []}
        let mut bytes = vec![0x84];
        for (key, value) in
            [("obs", &[0xc4u8, 0][..]), ("rewards", &[0xc4, 0]), ("terminated", &[0x90]), ("truncated", &[0x90])]
        {
            bytes.push(0xa0 | key.len() as u8);
            bytes.extend_from_slice(key.as_bytes());
            bytes.extend_from_slice(value);
        }
        let reply: StepReply = decode("step reply", &bytes).unwrap();
        assert!(reply.final_obs.is_empty() && reply.errors.is_empty());
        // {"env": "x", "obs_dim": 1, "obs_low": bin, "obs_high": bin, "n_actions": 2,
        //  "reward_threshold": 475.0 as float64, "max_envs_per_session": 4}
        let mut spaces = vec![0x87];
        let key = |bytes: &mut Vec<u8>, k: &str| {
            bytes.push(0xa0 | k.len() as u8);
            bytes.extend_from_slice(k.as_bytes());
        };
        key(&mut spaces, "env");
        spaces.extend_from_slice(&[0xa1, b'x']);
        key(&mut spaces, "obs_dim");
        spaces.push(1);
        key(&mut spaces, "obs_low");
        spaces.extend_from_slice(&[0xc4, 4, 0, 0, 0x80, 0xff]);
        key(&mut spaces, "obs_high");
        spaces.extend_from_slice(&[0xc4, 4, 0, 0, 0x80, 0x7f]);
        key(&mut spaces, "n_actions");
        spaces.push(2);
        key(&mut spaces, "reward_threshold");
        spaces.push(0xcb);
        spaces.extend_from_slice(&475.0f64.to_be_bytes());
        key(&mut spaces, "max_envs_per_session");
        spaces.push(4);
        let spaces: SpacesReply = decode("spaces reply", &spaces).unwrap();
        assert_eq!(spaces.obs_low, vec![f32::NEG_INFINITY]);
        assert_eq!(spaces.obs_high, vec![f32::INFINITY]);
        assert_eq!(spaces.reward_threshold, Some(475.0));
        assert!(!spaces.snapshot && spaces.max_episode_steps.is_none());
    }

    #[test]
    fn a_float_array_of_odd_length_is_refused() {
        let mut bytes = encode(&ObsReply { obs: ObsBin::encode(&[1.0], ObsEncoding::F32) });
        // Shorten the bin from 4 to 3 bytes.
        let len_at = bytes.len() - 5;
        bytes[len_at] = 3;
        bytes.pop();
        let reply = decode::<ObsReply>("obs reply", &bytes).unwrap();
        let err = reply.obs.decode(ObsEncoding::F32).unwrap_err();
        assert!(err.contains("multiple of 4"), "{err}");
    }

    fn spaces_reply() -> SpacesReply {
        SpacesReply {
            env: "x".into(),
            obs_dim: 3,
            obs_low: vec![-1.0; 3],
            obs_high: vec![1.0; 3],
            n_actions: 0,
            action_space: None,
            reward_threshold: None,
            max_episode_steps: None,
            max_abs_reward: None,
            snapshot: false,
            max_envs_per_session: 8,
            obs_space: None,
        }
    }

    /// What Python writes for Pendulum: `{"kind": "box", "shape": [1], "low": bin, "high": bin}`
    /// with the key order and widths msgpack picks.
    #[test]
    fn a_box_action_space_from_python_bytes_decodes_and_bad_ones_are_refused() {
        let msg = |kind: &str, shape: &[u32], low: &[f32], high: &[f32]| ActionSpaceMsg {
            kind: kind.into(),
            n: 0,
            shape: shape.to_vec(),
            low: low.to_vec(),
            high: high.to_vec(),
        };
        let with = |m: ActionSpaceMsg| SpacesReply { action_space: Some(m), ..spaces_reply() };
        let pendulum = with(msg("box", &[1], &[-2.0], &[2.0]));
        assert_eq!(
            pendulum.action_space().unwrap(),
            volley_env::ActionSpace::Box { low: vec![-2.0], high: vec![2.0], shape: vec![1] }
        );
        let matrix = with(msg("box", &[2, 2], &[-1.0; 4], &[1.0; 4]));
        assert_eq!(matrix.action_space().unwrap().n_actions(), 4);
        for (bad, why) in [
            (with(msg("box", &[2], &[-1.0], &[1.0])), "shape"),
            (with(msg("box", &[], &[], &[])), "shape"),
            (with(msg("box", &[1], &[f32::NEG_INFINITY], &[1.0])), "finite"),
            (with(msg("box", &[1], &[1.0], &[-1.0])), "low <= high"),
            (with(msg("box", &[1], &[-1.0], &[])), "bounds"),
            (with(msg("multibinary", &[1], &[0.0], &[1.0])), "unknown"),
            (with(ActionSpaceMsg { kind: "discrete".into(), ..Default::default() }), "0 actions"),
            (spaces_reply(), "no actions"),
        ] {
            let err = bad.action_space().unwrap_err();
            assert!(err.contains(why), "{err} should mention {why}");
        }
        // A version-1 reply: discrete by n_actions.
        let v1 = SpacesReply { n_actions: 2, ..spaces_reply() };
        assert_eq!(v1.action_space().unwrap(), volley_env::ActionSpace::Discrete { n: 2 });
    }

    /// The wire form of both kinds of actions: an array of integers, or a bin of floats.
    #[test]
    fn step_actions_are_an_array_or_a_bin() {
        let discrete = encode(&StepRequest { v: 2, session: 1, actions: StepActions::Discrete(vec![1, 0]) });
        // ... "actions" fixstr, then fixarray of 2: 1, 0.
        assert!(discrete.ends_with(&[0xa7, b'a', b'c', b't', b'i', b'o', b'n', b's', 0x92, 1, 0]));
        let continuous = encode(&StepRequest { v: 2, session: 1, actions: StepActions::Box(vec![1.0]) });
        assert!(continuous.ends_with(&[0xa7, b'a', b'c', b't', b'i', b'o', b'n', b's', 0xc4, 4, 0, 0, 0x80, 0x3f]));
        // A bin whose length is not a multiple of 4, or an array of non-integers, is refused.
        let mut odd = continuous.clone();
        let at = odd.len() - 5;
        odd[at] = 3;
        odd.pop();
        assert!(decode::<StepRequest>("step request", &odd).unwrap_err().message.contains("multiple of 4"));
        let mut floats = discrete[..discrete.len() - 3].to_vec();
        floats.extend_from_slice(&[0x91, 0xca, 0, 0, 0x80, 0x3f]);
        assert!(decode::<StepRequest>("step request", &floats).is_err());
    }

    #[test]
    fn ops_and_codes_round_trip() {
        for op in Op::ALL {
            assert_eq!(Op::from_name(op.name()), Some(op));
        }
        assert_eq!(Op::from_name("nope"), None);
        for code in [400, 404, 500, 501, 503, 505] {
            assert_eq!(ErrorCode::from_code(code).map(ErrorCode::code), Some(code));
        }
        assert_eq!(ErrorCode::from_code(418), None);
    }

    #[test]
    fn service_info_from_the_nats_micro_json_decodes() {
        let json = r#"{"type":"io.nats.micro.v1.info_response","name":"volley-env-x","id":"AbC1",
            "description":"","version":"0.1.0","metadata":{"volley_env_protocol":"1"},
            "endpoints":[{"name":"step","subject":"volley.env.x.AbC1.step","queue_group":"q","metadata":null}]}"#;
        let info: ServiceInfo = serde_json::from_str(json).unwrap();
        assert_eq!(info.id, "AbC1");
        assert_eq!(info.metadata[METADATA_PROTOCOL], "1");
        assert_eq!(info.endpoints[0].subject, "volley.env.x.AbC1.step");
        let bare: ServiceInfo =
            serde_json::from_str(r#"{"name":"n","id":"i","metadata":null,"endpoints":null}"#).unwrap();
        assert!(bare.endpoints.is_empty() && bare.metadata.is_empty());
    }

    proptest! {
        #[test]
        fn decode_never_panics_on_arbitrary_bytes(bytes in proptest::collection::vec(any::<u8>(), 0..256)) {
            let _ = decode::<StepReply>("step reply", &bytes);
            let _ = decode::<StepRequest>("step request", &bytes);
            let _ = decode::<SpacesReply>("spaces reply", &bytes);
        }

        #[test]
        fn step_requests_round_trip(session in any::<u64>(), actions in proptest::collection::vec(any::<u32>(), 0..64)) {
            let request = StepRequest { v: PROTOCOL_VERSION, session, actions: StepActions::Discrete(actions) };
            prop_assert_eq!(decode::<StepRequest>("step request", &encode(&request)).unwrap(), request);
        }

        /// Box actions round-trip bit for bit, NaN and infinities included (the server, not
        /// the codec, decides what a non-finite action means).
        #[test]
        fn box_step_requests_round_trip(session in any::<u64>(), bits in proptest::collection::vec(any::<u32>(), 0..64)) {
            let values: Vec<f32> = bits.iter().map(|&b| f32::from_bits(b)).collect();
            let request = StepRequest { v: PROTOCOL_VERSION, session, actions: StepActions::Box(values) };
            let decoded = decode::<StepRequest>("step request", &encode(&request)).unwrap();
            let StepActions::Box(decoded_values) = &decoded.actions else {
                return Err(TestCaseError::fail("box actions decoded as discrete"));
            };
            let decoded_bits: Vec<u32> = decoded_values.iter().map(|v| v.to_bits()).collect();
            prop_assert_eq!(decoded_bits, bits);
            prop_assert_eq!(decoded.session, session);
        }

        #[test]
        fn box_action_spaces_round_trip(
            bounds in proptest::collection::vec((-1e6f32..1e6, 0f32..1e6), 1..8),
        ) {
            let low: Vec<f32> = bounds.iter().map(|&(lo, _)| lo).collect();
            let high: Vec<f32> = bounds.iter().map(|&(lo, width)| lo + width).collect();
            let space = volley_env::ActionSpace::continuous(low, high).unwrap();
            let reply = SpacesReply { action_space: Some(ActionSpaceMsg::from_space(&space)), ..spaces_reply() };
            let decoded: SpacesReply = decode("spaces reply", &encode(&reply)).unwrap();
            prop_assert_eq!(decoded.action_space().unwrap(), space);
        }
    }
}
