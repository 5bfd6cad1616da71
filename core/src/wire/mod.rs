//! Wire types: the only serializable values that cross process boundaries, and their codec.
//!
//! Every encoded message starts with an [`Envelope`] header (magic, [`FORMAT_VERSION`], kind,
//! XXH3-64 checksum of the body). The checksum is verified before the body is decoded, so a
//! corrupted message is rejected as `corrupt` and never reaches the decoder (docs/SECURITY.md).
//! Decoding validates sizes, shapes against the run spec, finiteness and limits, so a bad
//! message becomes a [`DecodeError`] with a bounded [`DecodeError::reason`] label, never a panic.

mod codec;
mod f32_bytes;
pub mod observations;

pub use codec::*;
pub use observations::{ObsElement, Observations};

use crate::ids::{ActorId, PolicyVersion, RunId};
use crate::spec::RunSpec;

pub mod batch;
pub mod frame;
pub mod live;
pub mod pace;

/// Bumped on any incompatible change of a wire type (3: the envelope carries a body checksum;
/// 4: the weights checksum is XXH3-64, weights travel as [`frame`]s; 5: segments carry
/// continuous actions, [`TrajectorySegment::continuous_actions`], and byte-valued
/// observations, such as images, travel as one byte each: [`observations`]; 6: group
/// rollouts, [`TrajectorySegment::episode_groups`] and [`EpisodeSummary::group`], and the
/// recurrent states of episodes resumed mid-segment, [`TrajectorySegment::restored_states`];
/// 7: a segment's `f32` columns travel as one byte string each, `f32_bytes`).
pub const FORMAT_VERSION: u16 = 7;

/// Largest |value| of a recorded continuous action the learner accepts (an unsquashed
/// Gaussian sample is recorded before the environment clips it; anything this far out is a
/// broken actor, and would overflow the log-density in `f32`).
pub const MAX_ABS_CONTINUOUS_ACTION: f32 = 1e6;

/// Largest |value| of an observation the learner accepts (issue 46): far above any
/// environment's observations (pixels are at most 255), and small enough that the learner's
/// observation statistics (`volley_policy::obs_norm`, whose variance is the square) and a
/// forward through weights of ordinary size stay finite in `f32`. A segment of 3e38
/// observations would have made the published statistics infinite, and every actor refuse
/// every later version.
pub const MAX_ABS_OBSERVATION: f32 = 1e9;

/// Largest |value| of a recurrent state (`initial_hidden`, `restored_states`) the learner
/// accepts (issue 46: a GRU learner crashed on one segment whose state was 3e38). A GRU state
/// is a convex combination of `tanh` outputs and the state before it, so an honest actor's
/// states lie within ±1 (`volley_policy::gru`); the margin covers rounding.
pub const MAX_ABS_HIDDEN: f32 = 1.0 + 1e-3;

/// Largest |value| of a weights parameter a follower applies ([`check_params`], issue 46: a
/// live anchor of NaN parameters with a valid digest crashed every actor's sampler). Trained
/// weights are many orders of magnitude smaller; the bound leaves room for the observation
/// statistics that travel inside the parameters (a sample count, and variances of
/// observations up to [`MAX_ABS_OBSERVATION`]).
pub const MAX_ABS_PARAM: f32 = 1e19;

/// First bytes of every message: "VLLY".
pub const MAGIC: [u8; 4] = *b"VLLY";

/// Upper bound on one decoded message (64 MiB), so a hostile length prefix cannot allocate more.
pub const MAX_MESSAGE_BYTES: usize = 64 << 20;

/// What a message carries.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub enum MessageKind {
    /// A [`TrajectorySegment`].
    Segment = 1,
    /// A [`Weights`] buffer.
    Weights = 2,
    /// A full weights [`frame`] (an anchor).
    WeightsFull = 3,
    /// A delta weights [`frame`] against its parent version.
    WeightsDelta = 4,
}

/// The fixed header in front of every message.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Envelope {
    /// Wire format version.
    pub format_version: u16,
    /// What follows.
    pub kind: MessageKind,
    /// XXH3-64 of the body ([`body_checksum`]), verified before the body is decoded.
    pub checksum: u64,
}

/// Magic (4) + format version (2, little-endian) + kind (1) + body checksum (8, little-endian).
pub const HEADER_BYTES: usize = 15;

/// A fixed-size stand-in for an untrusted id in the learner's tables (XXH3-64), so a table's
/// bytes do not depend on how long the ids are that actors send.
pub fn id_hash(id: &[u8]) -> u64 {
    xxhash_rust::xxh3::xxh3_64_with_seed(id, 0x766f_6c6c_6579)
}

/// Check the first six bytes of a container format (batch frames, live weights chunks): its
/// 4-byte magic, then its little-endian format version. `what` names the format in the error.
pub(crate) fn check_format(head: &[u8; 6], magic: [u8; 4], version: u16, what: &str) -> Result<(), DecodeError> {
    let got: [u8; 4] = head[..4].try_into().expect("4 bytes");
    if got != magic {
        return Err(DecodeError::BadMagic(got));
    }
    let format = u16::from_le_bytes([head[4], head[5]]);
    if format != version {
        return Err(DecodeError::Malformed(format!("{what} format version {format}, this build reads {version}")));
    }
    Ok(())
}

/// The integrity checksum of a message body: XXH3-64 with seed 0 over the bytes that follow
/// the header. Not a defence against forgery (anyone who can publish can compute it), only
/// against corruption in transit or at rest; authenticity comes from broker permissions.
pub fn body_checksum(body: &[u8]) -> u64 {
    xxhash_rust::xxh3::xxh3_64(body)
}

/// An episode that finished inside a segment (for return statistics).
#[derive(Debug, Clone, Default, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct EpisodeSummary {
    /// Undiscounted return.
    pub episode_return: f32,
    /// Steps.
    pub episode_len: u32,
    /// Task index (0 with one task).
    pub task_id: u32,
    /// The work item the episode served, when the learner schedules episodes.
    pub work_item: Option<u64>,
    /// The saved state the episode started from (`None`: a fresh start).
    pub start: Option<String>,
    /// The group of continuations the episode belongs to (group rollouts).
    pub group: Option<crate::work::GroupMember>,
}

/// An episode that started mid-segment from a saved recurrent state (save-load): the learner
/// starts step `step` from `hidden` instead of the zero state of a fresh episode.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct RestoredState {
    /// The step the resumed episode starts at (`1..T`; the step before it ended an episode).
    /// A resume at step 0 is the segment's `initial_hidden`.
    pub step: u32,
    /// `[H]` the recurrent state entering that step.
    #[serde(with = "f32_bytes")]
    pub hidden: Vec<f32>,
}

/// T steps of one environment stream of one actor, time-major.
///
/// Step `t` goes from `observations[t]` with `actions[t]` to `observations[t + 1]`. When step
/// `t` ends an episode (`terminated[t] || truncated[t]`), `observations[t + 1]` is the first
/// observation of the next episode (auto-reset), and for truncation `truncation_values[t]`
/// holds the behaviour policy's value of the final observation, so the learner can bootstrap
/// through the time limit.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct TrajectorySegment {
    /// The run this segment belongs to.
    pub run: RunId,
    /// The actor that produced it.
    pub actor: ActorId,
    /// Which incarnation of the actor (a restarted actor with the same id gets a new one, so
    /// its segment indices, which restart at 0, do not collide with the old ones).
    pub incarnation: u64,
    /// Which environment stream of the actor.
    pub env_idx: u32,
    /// Episode counter of this stream at the segment's first step.
    pub episode_id: u64,
    /// Index of this segment within the (actor, incarnation, env_idx) stream; with those a
    /// unique key used to drop duplicates.
    pub segment_idx: u64,
    /// Task this segment served (0 when the run has one task).
    pub task_id: u32,
    /// Snapshot the episode started from, when it was resumed (save-load).
    pub start_snapshot: Option<String>,
    /// Behaviour policy version (actors switch versions only between segments).
    pub policy_version: PolicyVersion,
    /// Layout hash of the behaviour policy.
    pub layout_hash: u64,
    /// Observation width.
    pub obs_dim: u32,
    /// `[T + 1][obs_dim]`, one byte per value for an image observation space, else `f32`
    /// ([`observations`]).
    pub observations: Observations,
    /// `[T]` discrete action indices; empty when the policy's actions are continuous.
    pub actions: Vec<u32>,
    /// `[T][action_dim]` continuous actions as the policy drew them (a Gaussian sample before
    /// the environment clipped it, or the `tanh`-squashed value in `(−1, 1)` before it was
    /// scaled to the action box: `volley_policy::gaussian`); empty for discrete actions.
    #[serde(with = "f32_bytes")]
    pub continuous_actions: Vec<f32>,
    /// `[T]`.
    #[serde(with = "f32_bytes")]
    pub rewards: Vec<f32>,
    /// `[T]`, 1 where the step reached a terminal state.
    #[serde(with = "serde_bytes")]
    pub terminated: Vec<u8>,
    /// `[T]`, 1 where the step hit a time limit.
    #[serde(with = "serde_bytes")]
    pub truncated: Vec<u8>,
    /// `[T]` log μ(a_t | x_t) of the behaviour policy.
    #[serde(with = "f32_bytes")]
    pub behaviour_log_probs: Vec<f32>,
    /// `[T]` behaviour value of the final observation where `truncated[t]`, else 0.
    #[serde(with = "f32_bytes")]
    pub truncation_values: Vec<f32>,
    /// `[H]` recurrent state before step 0 (empty for feed-forward policies).
    #[serde(with = "f32_bytes")]
    pub initial_hidden: Vec<f32>,
    /// Episodes that started inside this segment from a saved, non-zero recurrent state, by
    /// step (strictly increasing; empty for feed-forward policies and fresh episodes).
    pub restored_states: Vec<RestoredState>,
    /// Episodes that ended inside this segment.
    pub finished_episodes: Vec<EpisodeSummary>,
    /// Episode snapshots saved during this segment (save-load), for the learner's scheduler.
    pub saved_snapshots: Vec<crate::work::SnapshotInfo>,
    /// Group rollouts: the group of each episode piece in the segment, in order (`None`: not
    /// a group member). Piece 0 starts at step 0; piece `i + 1` starts after the `i`-th step
    /// that ends an episode, among steps `0..T − 1` (an end at the last step starts the next
    /// segment's piece 0). Empty when no piece belongs to a group.
    pub episode_groups: Vec<Option<crate::work::GroupMember>>,
}

impl TrajectorySegment {
    /// Number of steps T.
    pub fn len(&self) -> usize {
        self.rewards.len()
    }

    /// Whether the segment has no steps.
    pub fn is_empty(&self) -> bool {
        self.rewards.is_empty()
    }

    /// Episode pieces in the segment: 1 plus the episode ends among steps `0..T − 1`
    /// (see [`TrajectorySegment::episode_groups`]).
    pub fn episode_pieces(&self) -> usize {
        let t_len = self.len();
        1 + (0..t_len.saturating_sub(1)).filter(|&t| self.terminated[t] != 0 || self.truncated[t] != 0).count()
    }

    /// The group of the episode piece each step belongs to, step by step (`None`: no group),
    /// following [`TrajectorySegment::episode_groups`]; all `None` when that is empty.
    pub fn step_groups(&self) -> impl Iterator<Item = Option<crate::work::GroupMember>> + '_ {
        let mut piece = 0;
        (0..self.len()).map(move |t| {
            let group = self.episode_groups.get(piece).copied().flatten();
            if self.terminated[t] != 0 || self.truncated[t] != 0 {
                piece += 1;
            }
            group
        })
    }

    /// Check the segment against the run spec: run, layout, shapes, action range, finiteness.
    pub fn validate(&self, spec: &RunSpec, layout_hash: u64, hidden_size: usize) -> Result<(), DecodeError> {
        if self.run != spec.run {
            return Err(DecodeError::Mismatch {
                what: "run",
                got: self.run.to_string(),
                expected: spec.run.to_string(),
            });
        }
        if self.layout_hash != layout_hash {
            return Err(DecodeError::Mismatch {
                what: "layout hash",
                got: format!("{:016x}", self.layout_hash),
                expected: format!("{layout_hash:016x}"),
            });
        }
        let t_len = spec.segment_len;
        let obs_dim = spec.policy.obs_dim;
        let n_actions = spec.policy.n_actions;
        let continuous = spec.policy.head.is_continuous();
        let (discrete_len, continuous_len) = if continuous { (0, t_len * n_actions) } else { (t_len, 0) };
        let shapes = [
            ("obs_dim", obs_dim, self.obs_dim as usize),
            ("observations", (t_len + 1) * obs_dim, self.observations.len()),
            ("actions", discrete_len, self.actions.len()),
            ("continuous_actions", continuous_len, self.continuous_actions.len()),
            ("rewards", t_len, self.rewards.len()),
            ("terminated", t_len, self.terminated.len()),
            ("truncated", t_len, self.truncated.len()),
            ("behaviour_log_probs", t_len, self.behaviour_log_probs.len()),
            ("truncation_values", t_len, self.truncation_values.len()),
            ("initial_hidden", hidden_size, self.initial_hidden.len()),
        ];
        for (field, expected, got) in shapes {
            if expected != got {
                return Err(DecodeError::Shape { field, expected, got });
            }
        }
        if !self.episode_groups.is_empty() && self.episode_groups.len() != self.episode_pieces() {
            return Err(DecodeError::Shape {
                field: "episode_groups",
                expected: self.episode_pieces(),
                got: self.episode_groups.len(),
            });
        }
        // Group tags name the run's group size: a peer cannot make a group of another size.
        let group_size = spec.hyper.work.group_size;
        let tags =
            self.episode_groups.iter().flatten().chain(self.finished_episodes.iter().filter_map(|e| e.group.as_ref()));
        for tag in tags {
            if !tag.is_valid() || tag.size != group_size {
                return Err(DecodeError::Mismatch {
                    what: "group tag",
                    got: format!("member {} of {}", tag.member, tag.size),
                    expected: format!("a member below the run's group size {group_size}"),
                });
            }
        }
        if let Some((step, &action)) = self.actions.iter().enumerate().find(|(_, &a)| a as usize >= n_actions) {
            return Err(DecodeError::ActionOutOfRange { action, step, n_actions });
        }
        // Bytes are finite and within every bound; only `f32` observations are checked.
        let observations = self.observations.as_f32().unwrap_or(&[]);
        let floats: [(&'static str, &[f32]); 6] = [
            ("observations", observations),
            ("continuous_actions", &self.continuous_actions),
            ("rewards", &self.rewards),
            ("behaviour_log_probs", &self.behaviour_log_probs),
            ("truncation_values", &self.truncation_values),
            ("initial_hidden", &self.initial_hidden),
        ];
        for (field, values) in floats {
            if let Some(index) = first_non_finite(values) {
                return Err(DecodeError::NonFinite { field, index });
            }
        }
        for (field, values, bound) in [
            ("observations", observations, MAX_ABS_OBSERVATION),
            ("initial_hidden", &self.initial_hidden, MAX_ABS_HIDDEN),
        ] {
            if let Some(index) = first_beyond(values, bound) {
                return Err(DecodeError::OutOfBounds { field, index, value: values[index], bound });
            }
        }
        if let Some(index) = self.finished_episodes.iter().position(|e| !e.episode_return.is_finite()) {
            return Err(DecodeError::NonFinite { field: "finished_episodes.episode_return", index });
        }
        self.validate_restored_states(hidden_size)?;
        if let volley_policy::ActionHead::Gaussian { squash } = spec.policy.head {
            let bound = if squash { 1.0 } else { MAX_ABS_CONTINUOUS_ACTION };
            if let Some(index) = self.continuous_actions.iter().position(|a| a.abs() > bound) {
                return Err(DecodeError::Mismatch {
                    what: "continuous action",
                    got: format!("{} at index {index}", self.continuous_actions[index]),
                    expected: format!("|a| <= {bound}"),
                });
            }
        }
        // A density can exceed 1, so a continuous log-probability may be positive; it is
        // bounded per value by the narrowest Gaussian the head allows (log-std >= -20: 19.1)
        // plus the squashing correction at the clamp (13.1).
        let max_log_prob = if continuous { 40.0 * n_actions as f32 } else { 1e-4 };
        if let Some(index) = self.behaviour_log_probs.iter().position(|&lp| lp > max_log_prob) {
            return Err(DecodeError::Mismatch {
                what: "behaviour log-prob",
                got: format!("{} at step {index}", self.behaviour_log_probs[index]),
                expected: format!("<= {max_log_prob}"),
            });
        }
        Ok(())
    }
}

impl TrajectorySegment {
    /// Restored states: each at a step that starts an episode inside the segment (`1..T`, the
    /// step before ended one), in strictly increasing order, `hidden_size` finite values each.
    fn validate_restored_states(&self, hidden_size: usize) -> Result<(), DecodeError> {
        let mut previous = 0;
        for (index, restored) in self.restored_states.iter().enumerate() {
            let step = restored.step as usize;
            let episode_start =
                step > 0 && step < self.len() && (self.terminated[step - 1] != 0 || self.truncated[step - 1] != 0);
            if !episode_start || (index > 0 && step <= previous) {
                return Err(DecodeError::Mismatch {
                    what: "restored state step",
                    got: format!("{step} (entry {index})"),
                    expected: "a step after an episode end, increasing".into(),
                });
            }
            previous = step;
            if restored.hidden.len() != hidden_size {
                return Err(DecodeError::Shape {
                    field: "restored_states.hidden",
                    expected: hidden_size,
                    got: restored.hidden.len(),
                });
            }
            if let Some(position) = first_non_finite(&restored.hidden) {
                return Err(DecodeError::NonFinite { field: "restored_states", index: index * hidden_size + position });
            }
            if let Some(position) = first_beyond(&restored.hidden, MAX_ABS_HIDDEN) {
                return Err(DecodeError::OutOfBounds {
                    field: "restored_states",
                    index: index * hidden_size + position,
                    value: restored.hidden[position],
                    bound: MAX_ABS_HIDDEN,
                });
            }
        }
        Ok(())
    }
}

/// A versioned, checksummed copy of the policy parameters.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct Weights {
    /// Version this publish produced.
    pub version: PolicyVersion,
    /// Architecture hash of the layout the parameters follow.
    pub layout_hash: u64,
    /// Checksum of `params` ([`checksum`]).
    pub checksum: u64,
    /// The flat parameter buffer.
    pub params: Vec<f32>,
}

impl Weights {
    /// Wrap parameters, computing the checksum.
    pub fn new(version: PolicyVersion, layout_hash: u64, params: Vec<f32>) -> Self {
        let checksum = checksum(&params);
        Weights { version, layout_hash, checksum, params }
    }

    /// Verify the checksum, the layout and the parameters' values ([`check_params`]).
    pub fn verify(&self, layout_hash: u64, n_params: usize) -> Result<(), DecodeError> {
        if self.layout_hash != layout_hash {
            return Err(DecodeError::Mismatch {
                what: "layout hash",
                got: format!("{:016x}", self.layout_hash),
                expected: format!("{layout_hash:016x}"),
            });
        }
        if self.params.len() != n_params {
            return Err(DecodeError::Shape { field: "params", expected: n_params, got: self.params.len() });
        }
        let got = checksum(&self.params);
        if got != self.checksum {
            return Err(DecodeError::Checksum { expected: self.checksum, got });
        }
        check_params(&self.params)
    }
}

/// Check weights parameters before anything runs them: every value finite and within
/// [`MAX_ABS_PARAM`]. A digest proves only that the parameters are the ones their sender
/// hashed, not that they are usable (issue 46: a NaN anchor with a valid digest was applied,
/// and every actor's sampler panicked), so every path that produces weights for a follower
/// (full and delta frames, live or stored, and [`Weights::verify`]) ends here.
pub fn check_params(params: &[f32]) -> Result<(), DecodeError> {
    if let Some(index) = first_non_finite(params) {
        return Err(DecodeError::NonFinite { field: "params", index });
    }
    if let Some(index) = first_beyond(params, MAX_ABS_PARAM) {
        return Err(DecodeError::OutOfBounds { field: "params", index, value: params[index], bound: MAX_ABS_PARAM });
    }
    Ok(())
}

/// XXH3-64 over the little-endian bytes of the parameters: stable across platforms and builds,
/// and about ten times faster than the byte-wise FNV-1a it replaced (issue 16), so verifying a
/// 16 MiB buffer costs about a millisecond.
pub fn checksum(params: &[f32]) -> u64 {
    let mut hasher = xxhash_rust::xxh3::Xxh3Default::new();
    for_le_blocks(params, |bytes| hasher.update(bytes));
    hasher.digest()
}

/// Hand `params`' little-endian bytes to `f` in order, a few KiB at a time, through a small
/// stack buffer (so big-endian hosts see the same bytes): what [`checksum`] hashes, and what
/// a weights signature covers.
pub fn for_le_blocks(params: &[f32], mut f: impl FnMut(&[u8])) {
    const CHUNK: usize = 1024;
    let mut buffer = [0u8; 4 * CHUNK];
    for chunk in params.chunks(CHUNK) {
        for (bytes, p) in buffer.chunks_exact_mut(4).zip(chunk) {
            bytes.copy_from_slice(&p.to_bits().to_le_bytes());
        }
        f(&buffer[..4 * chunk.len()]);
    }
}

/// The crate's one segment fixture for its own unit tests: `volley_testkit::fixtures` builds
/// segments for every other crate and for integration tests, but a unit test inside core
/// would see testkit's copy of core as another crate.
#[cfg(test)]
pub(crate) fn test_segment(run: &str, t_len: usize, obs_dim: usize, segment_idx: u64) -> TrajectorySegment {
    TrajectorySegment {
        run: RunId::new(run).expect("a valid test run id"),
        actor: ActorId::new("actor-0").expect("a valid test actor id"),
        incarnation: 0,
        env_idx: 0,
        episode_id: 0,
        segment_idx,
        task_id: 0,
        start_snapshot: None,
        policy_version: PolicyVersion(0),
        layout_hash: 0,
        obs_dim: obs_dim as u32,
        observations: Observations::F32(vec![0.0; (t_len + 1) * obs_dim]),
        actions: vec![0; t_len],
        continuous_actions: Vec::new(),
        rewards: vec![0.0; t_len],
        terminated: vec![0; t_len],
        truncated: vec![0; t_len],
        behaviour_log_probs: vec![0.0; t_len],
        truncation_values: vec![0.0; t_len],
        initial_hidden: Vec::new(),
        restored_states: Vec::new(),
        finished_episodes: Vec::new(),
        saved_snapshots: Vec::new(),
        episode_groups: Vec::new(),
    }
}

/// The index of the first value of `values` that is NaN or infinite.
///
/// Checked a block at a time with no early exit inside a block, a loop over the exponent bits
/// the compiler can vectorise (issue 16: an element-by-element search was the largest part of
/// validating a stacked-frame segment, 931 K observations); only a block that holds a bad value
/// is searched again for its position.
pub(crate) fn first_non_finite(values: &[f32]) -> Option<usize> {
    const BLOCK: usize = 1024;
    const EXPONENT: u32 = 0x7f80_0000;
    values.chunks(BLOCK).enumerate().find_map(|(block, chunk)| {
        let bad = chunk.iter().fold(false, |bad, value| bad | (value.to_bits() & EXPONENT == EXPONENT));
        bad.then(|| block * BLOCK + chunk.iter().position(|value| !value.is_finite()).unwrap_or(0))
    })
}

/// The index of the first value of `values` whose magnitude exceeds `bound` (values are
/// finite here: [`first_non_finite`] ran first). Checked a block at a time like
/// [`first_non_finite`], so the loop vectorises.
pub(crate) fn first_beyond(values: &[f32], bound: f32) -> Option<usize> {
    const BLOCK: usize = 1024;
    values.chunks(BLOCK).enumerate().find_map(|(block, chunk)| {
        let bad = chunk.iter().fold(false, |bad, value| bad | (value.abs() > bound));
        bad.then(|| block * BLOCK + chunk.iter().position(|value| value.abs() > bound).unwrap_or(0))
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ids::RunId;
    use crate::spec::HyperParams;
    use proptest::prelude::*;
    use proptest::strategy::ValueTree;
    use volley_env::EnvConfig;
    use volley_policy::{Activation, CoreKind, ParamLayout, PolicySpec};

    const T: usize = 4;

    proptest! {
        #[test]
        fn first_non_finite_finds_what_a_linear_search_finds(
            values in proptest::collection::vec(-1e30f32..1e30, 0..5000),
            bad in proptest::collection::vec((0usize..5000, 0usize..3), 0..3),
        ) {
            let mut values = values;
            for (at, kind) in bad {
                if let Some(value) = values.get_mut(at) {
                    *value = [f32::NAN, f32::INFINITY, f32::NEG_INFINITY][kind];
                }
            }
            prop_assert_eq!(first_non_finite(&values), values.iter().position(|v| !v.is_finite()));
        }
    }

    fn spec() -> RunSpec {
        RunSpec {
            run: RunId::new("wire").expect("valid"),
            env: EnvConfig::Cartpole,
            policy: PolicySpec {
                obs_dim: 4,
                n_actions: 2,
                torso: vec![8],
                activation: Activation::Tanh,
                core: CoreKind::Mlp,
                head: volley_policy::ActionHead::Categorical,
                conv: None,
                normalize_obs: false,
                critic: Vec::new(),
            },
            segment_len: T,
            hyper: HyperParams::default(),
            seed: 0,
        }
    }

    fn layout_hash() -> u64 {
        ParamLayout::new(&spec().policy).expect("valid").hash()
    }

    fn segment_strategy() -> impl Strategy<Value = TrajectorySegment> {
        (
            proptest::collection::vec(-10.0f32..10.0, (T + 1) * 4),
            proptest::collection::vec(0u32..2, T),
            proptest::collection::vec(-1.0f32..1.0, T),
            proptest::collection::vec(0u8..2, T),
            proptest::collection::vec(-5.0f32..0.0, T),
            any::<u64>(),
            any::<u64>(),
            any::<bool>(),
        )
            .prop_map(|(observations, actions, rewards, terminated, logp, version, idx, pixels)| {
                TrajectorySegment {
                    env_idx: 1,
                    episode_id: idx / 3,
                    policy_version: PolicyVersion(version),
                    layout_hash: layout_hash(),
                    // Image observations travel as bytes (wire::observations).
                    observations: if pixels {
                        Observations::U8(observations.iter().map(|v| v.abs().floor() as u8).collect())
                    } else {
                        Observations::F32(observations)
                    },
                    actions,
                    rewards,
                    terminated,
                    behaviour_log_probs: logp,
                    finished_episodes: vec![EpisodeSummary {
                        episode_return: 3.0,
                        episode_len: 3,
                        ..EpisodeSummary::default()
                    }],
                    ..test_segment("wire", T, 4, idx)
                }
            })
    }

    proptest! {
        #[test]
        fn segment_roundtrips(segment in segment_strategy()) {
            let bytes = encode_segment(&segment);
            // The encoding into a sized buffer writes exactly bincode's bytes.
            let plain = bincode::serde::encode_to_vec(&segment, bincode::config::standard()).expect("encodes");
            prop_assert_eq!(&bytes[HEADER_BYTES..], &plain[..]);
            let decoded = decode_segment(&bytes, &spec(), layout_hash(), 0).expect("valid segment decodes");
            prop_assert_eq!(decoded, segment);
        }

        #[test]
        fn decode_never_panics_on_arbitrary_bytes(bytes in proptest::collection::vec(any::<u8>(), 0..512)) {
            let _ = decode_segment(&bytes, &spec(), layout_hash(), 0);
            let _ = decode_weights(&bytes, layout_hash(), 10);
        }

        #[test]
        fn every_truncation_is_an_error(segment in segment_strategy(), cut in 0usize..1000) {
            let bytes = encode_segment(&segment);
            let cut = cut % bytes.len();
            prop_assert!(decode_segment(&bytes[..cut], &spec(), layout_hash(), 0).is_err());
        }

        #[test]
        fn weights_roundtrip(params in proptest::collection::vec(-1.0f32..1.0, 1..64), version in any::<u64>()) {
            let weights = Weights::new(PolicyVersion(version), 42, params.clone());
            let decoded = decode_weights(&encode_weights(&weights), 42, params.len()).expect("valid weights");
            prop_assert_eq!(decoded, weights);
        }
    }

    const HIDDEN: usize = 3;

    /// A GRU run: segments carry `HIDDEN` recurrent values.
    fn recurrent_spec() -> RunSpec {
        let policy = PolicySpec { core: CoreKind::Gru { hidden: HIDDEN }, ..spec().policy };
        RunSpec { policy, ..spec() }
    }

    fn recurrent_hash() -> u64 {
        ParamLayout::new(&recurrent_spec().policy).expect("valid").hash()
    }

    /// Segments whose episodes end at random steps, some followed by an episode resumed from a
    /// saved state at the next step.
    fn recurrent_segment_strategy() -> impl Strategy<Value = TrajectorySegment> {
        (
            proptest::collection::vec(0u8..2, T),
            proptest::collection::vec(prop::bool::ANY, T),
            proptest::collection::vec(-1.0f32..1.0, T * HIDDEN),
            proptest::collection::vec(-1.0f32..1.0, HIDDEN),
            any::<u64>(),
        )
            .prop_map(|(terminated, resumes, states, initial_hidden, idx)| {
                let restored_states = (1..T)
                    .filter(|&t| terminated[t - 1] != 0 && resumes[t])
                    .map(|t| RestoredState { step: t as u32, hidden: states[t * HIDDEN..(t + 1) * HIDDEN].to_vec() })
                    .collect();
                TrajectorySegment {
                    layout_hash: recurrent_hash(),
                    terminated,
                    initial_hidden,
                    restored_states,
                    ..test_segment("wire", T, 4, idx)
                }
            })
    }

    proptest! {
        /// Issue 18: restored recurrent states (format 6) round-trip bit for bit and validate.
        #[test]
        fn restored_states_roundtrip(segment in recurrent_segment_strategy()) {
            let bytes = encode_segment(&segment);
            let decoded = decode_segment(&bytes, &recurrent_spec(), recurrent_hash(), HIDDEN)
                .expect("a valid recurrent segment decodes");
            prop_assert_eq!(decoded, segment);
        }
    }

    /// Issue 18: a restored state must follow an episode end, in increasing order, with the
    /// run's state width and finite values.
    #[test]
    fn restored_states_are_validated() {
        let spec = recurrent_spec();
        let mut segment = TrajectorySegment {
            layout_hash: recurrent_hash(),
            initial_hidden: vec![0.0; HIDDEN],
            ..test_segment("wire", T, 4, 0)
        };
        segment.terminated[0] = 1;
        segment.terminated[1] = 1;
        let state = |step: u32| RestoredState { step, hidden: vec![0.5; HIDDEN] };
        let check = |restored: Vec<RestoredState>| {
            TrajectorySegment { restored_states: restored, ..segment.clone() }.validate(&spec, recurrent_hash(), HIDDEN)
        };
        assert_eq!(check(vec![state(1), state(2)]), Ok(()));
        for (bad, reason) in [
            (vec![state(0)], "mismatch"),           // step 0 is the segment's initial_hidden
            (vec![state(3)], "mismatch"),           // no episode ended at step 2
            (vec![state(T as u32)], "mismatch"),    // beyond the segment
            (vec![state(2), state(1)], "mismatch"), // not increasing
            (vec![state(1), state(1)], "mismatch"), // twice
            (vec![RestoredState { step: 1, hidden: vec![0.5; HIDDEN + 1] }], "shape"),
            (vec![RestoredState { step: 1, hidden: vec![f32::NAN; HIDDEN] }], "non_finite"),
        ] {
            assert_eq!(check(bad.clone()).map_err(|e| e.reason()), Err(reason), "{bad:?}");
        }
    }

    const ACTION_DIM: usize = 2;

    /// A run on a continuous environment: a Gaussian head with `ACTION_DIM` values.
    fn continuous_spec(squash: bool) -> RunSpec {
        let policy = PolicySpec::mlp(4, ACTION_DIM, &[8], Activation::Tanh)
            .with_head(volley_policy::ActionHead::Gaussian { squash });
        RunSpec { policy, ..spec() }
    }

    fn continuous_hash(squash: bool) -> u64 {
        ParamLayout::new(&continuous_spec(squash).policy).expect("valid").hash()
    }

    fn continuous_segment_strategy(squash: bool) -> impl Strategy<Value = TrajectorySegment> {
        let bound = if squash { 1.0f32 } else { 1e3 };
        (
            proptest::collection::vec(-bound..bound, T * ACTION_DIM),
            proptest::collection::vec(-1.0f32..1.0, T),
            proptest::collection::vec(-20.0f32..20.0, T),
            any::<u64>(),
        )
            .prop_map(move |(continuous_actions, rewards, logp, idx)| TrajectorySegment {
                layout_hash: continuous_hash(squash),
                actions: Vec::new(),
                continuous_actions,
                rewards,
                behaviour_log_probs: logp,
                ..test_segment("wire", T, 4, idx)
            })
    }

    proptest! {
        /// Issue 14: continuous actions round-trip bit for bit, squashed or not.
        #[test]
        fn continuous_segment_roundtrips(segment in continuous_segment_strategy(false), squashed in continuous_segment_strategy(true)) {
            let decoded = decode_segment(&encode_segment(&segment), &continuous_spec(false), continuous_hash(false), 0)
                .expect("valid continuous segment decodes");
            prop_assert_eq!(decoded, segment);
            let decoded = decode_segment(&encode_segment(&squashed), &continuous_spec(true), continuous_hash(true), 0)
                .expect("valid squashed segment decodes");
            prop_assert_eq!(decoded, squashed);
        }
    }

    /// Issue 14: the learner refuses non-finite, absurd or misshapen continuous actions, and
    /// discrete actions where the run's are continuous (and the other way round), by name.
    #[test]
    fn continuous_actions_are_validated() {
        let spec = continuous_spec(true);
        let hash = continuous_hash(true);
        let mut runner = proptest::test_runner::TestRunner::deterministic();
        let valid = continuous_segment_strategy(true).new_tree(&mut runner).expect("strategy").current();
        let check = |segment: &TrajectorySegment| segment.validate(&spec, hash, 0).map_err(|e| e.to_string());
        assert_eq!(check(&valid), Ok(()));
        let mut s = valid.clone();
        s.continuous_actions[3] = f32::NAN;
        assert!(check(&s).unwrap_err().contains("continuous_actions: non-finite value at index 3"));
        let mut s = valid.clone();
        s.continuous_actions[1] = 1.5;
        assert!(check(&s).unwrap_err().contains("continuous action"));
        let mut s = valid.clone();
        s.continuous_actions.pop();
        assert!(check(&s).unwrap_err().contains("continuous_actions: expected 8 elements, got 7"));
        let mut s = valid.clone();
        s.actions = vec![0; T];
        assert!(check(&s).unwrap_err().contains("actions: expected 0 elements"));
        let mut s = valid.clone();
        s.behaviour_log_probs[0] = 1e6;
        assert!(check(&s).unwrap_err().contains("behaviour log-prob"));
        let mut unsquashed = valid.clone();
        unsquashed.layout_hash = continuous_hash(false);
        unsquashed.continuous_actions[0] = 2e6;
        let err = unsquashed.validate(&continuous_spec(false), continuous_hash(false), 0).unwrap_err();
        assert_eq!(err.reason(), "mismatch", "{err}");
        // A discrete segment is refused by a continuous run, and a continuous one by a discrete run.
        let discrete = valid_segment();
        assert_eq!(discrete.validate(&spec, discrete.layout_hash, 0).unwrap_err().reason(), "shape");
        let err = TrajectorySegment { layout_hash: layout_hash(), ..valid }.validate(&self::spec(), layout_hash(), 0);
        assert_eq!(err.unwrap_err().reason(), "shape");
    }

    fn valid_segment() -> TrajectorySegment {
        let mut runner = proptest::test_runner::TestRunner::deterministic();
        segment_strategy().new_tree(&mut runner).expect("strategy").current()
    }

    #[test]
    fn wrong_version_garbage_and_kind_have_distinct_reasons() {
        let mut bytes = encode_segment(&valid_segment());
        let spec = spec();
        assert_eq!(decode_segment(b"hello world", &spec, layout_hash(), 0).unwrap_err().reason(), "bad_magic");
        assert_eq!(decode_segment(b"VLL", &spec, layout_hash(), 0).unwrap_err().reason(), "truncated");
        bytes[4] = 99;
        let err = decode_segment(&bytes, &spec, layout_hash(), 0).unwrap_err();
        assert_eq!(err.reason(), "wrong_version");
        // The learner logs this for every segment of a mixed deployment: it says what to do (issue 17).
        let message = err.to_string();
        assert!(message.contains("different builds") && message.contains("digest"), "{message}");
        bytes[4] = FORMAT_VERSION.to_le_bytes()[0];
        bytes[6] = MessageKind::Weights as u8;
        assert_eq!(decode_segment(&bytes, &spec, layout_hash(), 0).unwrap_err().reason(), "wrong_kind");
    }

    #[test]
    fn validation_catches_shape_range_nan_and_foreign_runs() {
        let spec = spec();
        let check = |segment: &TrajectorySegment| segment.validate(&spec, layout_hash(), 0).map_err(|e| e.reason());
        let mut s = valid_segment();
        s.actions.pop();
        assert_eq!(check(&s), Err("shape"));
        let mut s = valid_segment();
        s.actions[0] = 2;
        assert_eq!(check(&s), Err("action_out_of_range"));
        let mut s = valid_segment();
        s.rewards[1] = f32::NAN;
        assert_eq!(check(&s), Err("non_finite"));
        let mut s = valid_segment();
        s.run = RunId::new("other").expect("valid");
        assert_eq!(check(&s), Err("mismatch"));
        let mut s = valid_segment();
        s.layout_hash ^= 1;
        assert_eq!(check(&s), Err("mismatch"));
        assert_eq!(check(&valid_segment()), Ok(()));
    }

    /// Issue 12: 20 of 20 bit-flipped copies of a real segment decoded as valid. Every single
    /// bit flip is now rejected: in the body as `corrupt`, before the body is decoded.
    #[test]
    fn every_bit_flip_of_a_segment_or_weights_is_rejected() {
        let spec = spec();
        let bytes = encode_segment(&valid_segment());
        for bit in 0..bytes.len() * 8 {
            let mut flipped = bytes.clone();
            flipped[bit / 8] ^= 1 << (bit % 8);
            let err = decode_segment(&flipped, &spec, layout_hash(), 0).expect_err("a flipped bit is rejected");
            if bit / 8 >= 7 {
                assert_eq!(err.reason(), "corrupt", "bit {bit}: {err}");
            }
        }
        let weights = encode_weights(&Weights::new(PolicyVersion(3), 7, vec![0.5; 16]));
        for bit in (HEADER_BYTES * 8)..weights.len() * 8 {
            let mut flipped = weights.clone();
            flipped[bit / 8] ^= 1 << (bit % 8);
            assert_eq!(decode_weights(&flipped, 7, 16).expect_err("rejected").reason(), "corrupt");
        }
    }

    #[test]
    fn every_reason_is_listed_in_reasons() {
        let errors = [
            DecodeError::Truncated(String::new()),
            DecodeError::BadMagic(*b"ABCD"),
            DecodeError::WrongVersion { got: 0 },
            DecodeError::WrongKind { got: 0, expected: 1 },
            DecodeError::Malformed(String::new()),
            DecodeError::Shape { field: "x", got: 0, expected: 1 },
            DecodeError::NonFinite { field: "x", index: 0 },
            DecodeError::ActionOutOfRange { action: 2, step: 0, n_actions: 2 },
            DecodeError::Mismatch { what: "x", got: String::new(), expected: String::new() },
            DecodeError::Checksum { expected: 0, got: 1 },
            DecodeError::TooLarge { got_bytes: 0, limit_bytes: 0 },
            DecodeError::Corrupt { expected: 0, got: 1 },
            DecodeError::BadId(String::new()),
            DecodeError::OutOfBounds { field: "x", index: 0, value: 2.0, bound: 1.0 },
        ];
        let reasons: Vec<_> = errors.iter().map(DecodeError::reason).collect();
        assert_eq!(reasons, DecodeError::REASONS);
    }

    /// An id the typed `Deserialize` refuses is `bad_id`, the label admission used for it
    /// before ids were typed (issue 13), and its message stays short however long the id.
    #[test]
    fn an_invalid_id_in_a_checksummed_segment_is_bad_id() {
        let bytes = encode_segment(&valid_segment());
        let resealed = |from: &[u8], to: &[u8]| {
            let mut body = bytes[HEADER_BYTES..].to_vec();
            let at = body.windows(from.len()).position(|w| w == from).expect("the id is in the body");
            body.splice(at..at + from.len(), to.iter().copied());
            let mut out = bytes[..HEADER_BYTES].to_vec();
            out[7..HEADER_BYTES].copy_from_slice(&body_checksum(&body).to_le_bytes());
            out.extend(body);
            out
        };
        let bad_actor = resealed(b"actor-0", b"actor.0");
        let err = decode_segment_body(&bad_actor).expect_err("a dot is not allowed in an actor id");
        assert_eq!(err.reason(), "bad_id", "{err}");
        let bad_run = resealed(b"wire", b"WIRE");
        assert_eq!(decode_segment_body(&bad_run).expect_err("uppercase run").reason(), "bad_id");
    }

    #[test]
    fn corrupted_weights_fail_the_checksum() {
        let mut weights = Weights::new(PolicyVersion(3), 7, vec![0.5; 16]);
        weights.params[3] = 0.25;
        assert_eq!(weights.verify(7, 16).unwrap_err().reason(), "checksum");
        assert_eq!(Weights::new(PolicyVersion(3), 7, vec![0.5; 16]).verify(8, 16).unwrap_err().reason(), "mismatch");
    }

    /// Group rollouts: each step maps to the group of its episode piece (pieces start after
    /// episode ends, an end at the last step starts the next segment's piece), the tags
    /// round-trip, and decode refuses a wrong piece count or a tag of another group size.
    #[test]
    fn episode_groups_map_steps_to_pieces_and_are_validated() {
        use crate::work::GroupMember;
        let tag = |group, member| Some(GroupMember { group, member, size: 4 });
        let mut spec = spec();
        spec.hyper.work.group_size = 4;
        let mut segment = TrajectorySegment { layout_hash: layout_hash(), ..test_segment("wire", T, 4, 0) };
        segment.terminated[1] = 1;
        segment.truncated[3] = 1;
        assert_eq!(segment.episode_pieces(), 2, "the end at the last step starts no piece here");
        segment.episode_groups = vec![tag(7, 1), None];
        assert_eq!(segment.step_groups().collect::<Vec<_>>(), vec![tag(7, 1), tag(7, 1), None, None]);
        segment.finished_episodes =
            vec![EpisodeSummary { episode_return: 2.0, episode_len: 2, group: tag(7, 1), ..EpisodeSummary::default() }];
        assert_eq!(segment.validate(&spec, layout_hash(), 0).map_err(|e| e.to_string()), Ok(()));
        let decoded =
            codec::decode_segment(&codec::encode_segment(&segment), &spec, layout_hash(), 0).expect("round trip");
        assert_eq!(decoded.episode_groups, segment.episode_groups);
        assert_eq!(decoded.finished_episodes[0].group, tag(7, 1));
        let too_many = TrajectorySegment { episode_groups: vec![tag(7, 1), None, None], ..segment.clone() };
        assert_eq!(too_many.validate(&spec, layout_hash(), 0).unwrap_err().reason(), "shape");
        let other_size = TrajectorySegment {
            episode_groups: vec![Some(GroupMember { group: 7, member: 1, size: 8 }), None],
            ..segment.clone()
        };
        assert_eq!(other_size.validate(&spec, layout_hash(), 0).unwrap_err().reason(), "mismatch");
        let mut bad_member = segment.clone();
        bad_member.finished_episodes[0].group = Some(GroupMember { group: 7, member: 4, size: 4 });
        assert_eq!(bad_member.validate(&spec, layout_hash(), 0).unwrap_err().reason(), "mismatch");
    }
}
