//! The run spec: everything an actor needs to join a run, and the hyper-parameters the learner
//! uses, in one serializable value (written to a KV bucket by the learner in distributed runs).

use crate::ids::RunId;
use volley_env::{EnvConfig, EnvError};
use volley_policy::{ActionHead, ParamLayout, PolicyError, PolicySpec};

/// Which loss the learner optimises.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum LossKind {
    /// IMPALA V-trace actor-critic (Espeholt et al. 2018).
    Vtrace,
    /// PPO-clip with behaviour-policy importance weights (Schulman et al. 2017; Hilton et al. 2021).
    Ppo,
}

/// What the policy gradient's advantage is measured against (`hyper.baseline`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Baseline {
    /// The learned value function (V-trace or GAE advantages): the default.
    #[default]
    Critic,
    /// Group-relative (Shao et al. 2024, GRPO, without the division by the group's standard
    /// deviation, as Liu et al. 2025 "Dr. GRPO" recommend): every step of member `k`'s episode
    /// in a complete group of continuations gets the advantage `c·(G_k − mean_j G_j)` (`c` the
    /// reward scale). Steps outside complete groups keep the critic's advantage, and the critic
    /// is trained on every step either way. Needs group rollouts (`work.group_size > 1`).
    Group,
    /// As [`Baseline::Group`], divided by the group's standard deviation plus 1e-6 (GRPO as
    /// published).
    GroupStd,
}

impl Baseline {
    /// Whether advantages come from groups.
    pub fn uses_groups(self) -> bool {
        !matches!(self, Baseline::Critic)
    }
}

impl std::str::FromStr for Baseline {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "critic" => Ok(Baseline::Critic),
            "group" => Ok(Baseline::Group),
            "group-std" => Ok(Baseline::GroupStd),
            other => Err(format!("unknown baseline {other:?} (expected critic, group or group-std)")),
        }
    }
}

impl std::str::FromStr for LossKind {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "vtrace" => Ok(LossKind::Vtrace),
            "ppo" => Ok(LossKind::Ppo),
            other => Err(format!("unknown loss {other:?} (expected vtrace or ppo)")),
        }
    }
}

/// The default Adam ε for a run on `env`: 1e-3 for CartPole, the paper's 1e-8 otherwise.
///
/// With 1e-8, a solved CartPole run (gradients ~100x smaller than while learning) kept taking
/// learning-rate-sized steps on noise, drifted to a near-deterministic policy and collapsed for
/// good (issue 11, docs/STABILITY.md); where the gradient's RMS is below ε, Adam acts like
/// momentum SGD with rate `lr / ε`, so steps shrink with the signal. ε is not scale-free,
/// though: the memory and milestones tasks learn from gradients far smaller than CartPole's, and
/// with 1e-3 the memory task needed ~25x the env steps to solve, so they keep 1e-8 (no collapse
/// was seen there in 2M-step runs).
pub fn default_adam_eps(env: &EnvConfig) -> f32 {
    match env {
        EnvConfig::Cartpole => 1e-3,
        _ => 1e-8,
    }
}

/// Whether `env`'s actions are continuous (a remote environment's spec says so with its
/// `action_box`).
pub fn env_is_continuous(env: &EnvConfig) -> Result<bool, EnvError> {
    match env {
        EnvConfig::Remote(remote) => Ok(remote.action_space()?.is_continuous()),
        builtin => Ok(builtin.build()?.action_space().is_continuous()),
    }
}

/// The policy head a run on `env` uses unless told otherwise: categorical for discrete
/// actions, an unsquashed diagonal Gaussian for continuous ones (the environment clips).
pub fn default_action_head(env: &EnvConfig) -> Result<ActionHead, EnvError> {
    Ok(if env_is_continuous(env)? { ActionHead::Gaussian { squash: false } } else { ActionHead::Categorical })
}

/// Learner hyper-parameters, named as in the papers.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct HyperParams {
    /// The loss.
    pub loss: LossKind,
    /// Discount factor γ.
    pub gamma: f32,
    /// Rewards are multiplied by this before the return estimators see them, so value targets
    /// stay of order one for a network whose torso the policy and value heads share.
    pub reward_scale: f32,
    /// Adam learning rate at the first update.
    pub learning_rate: f32,
    /// Learning rate at `lr_decay_updates` (linear decay; equal to `learning_rate` for constant).
    pub final_learning_rate: f32,
    /// Number of updates over which the learning rate decays linearly.
    pub lr_decay_updates: u64,
    /// Adam β1.
    pub adam_beta1: f32,
    /// Adam β2.
    pub adam_beta2: f32,
    /// Adam ε.
    pub adam_eps: f32,
    /// Global gradient-norm clip.
    pub max_grad_norm: f32,
    /// Entropy bonus coefficient at the first update.
    pub ent_coef: f32,
    /// The entropy bonus at `lr_decay_updates`, reached by linear decay from `ent_coef` over the
    /// same updates as the learning rate's (`None`: constant). Absent in specs written before it
    /// existed.
    #[serde(default)]
    pub final_ent_coef: Option<f32>,
    /// Value-loss coefficient.
    pub value_coef: f32,
    /// V-trace ρ̄ for value targets.
    pub clip_rho_threshold: f32,
    /// V-trace ρ̄ for policy-gradient advantages.
    pub clip_pg_rho_threshold: f32,
    /// V-trace c̄.
    pub clip_c_threshold: f32,
    /// V-trace λ.
    pub vtrace_lambda: f32,
    /// GAE λ (PPO).
    pub gae_lambda: f32,
    /// PPO clip ε.
    pub clip_coef: f32,
    /// PPO: truncation of the behaviour importance weight π_prox/μ.
    pub behaviour_is_clip: f32,
    /// PPO epochs over each batch.
    pub ppo_epochs: u32,
    /// PPO minibatches per epoch (split over batch columns, so recurrent sequences stay whole).
    pub ppo_minibatches: u32,
    /// PPO: normalise advantages per minibatch.
    pub normalize_advantages: bool,
    /// Segments per learner batch (B).
    pub batch_segments: usize,
    /// Segments whose lag exceeds this are dropped and counted.
    pub max_policy_lag: u64,
    /// Pacing over NATS: actors wait while the learner's backlog exceeds this many segments.
    pub max_backlog_segments: u64,
    /// Save-load and budget assignment across tasks and saved states (off by default).
    #[serde(default)]
    pub work: crate::work::WorkConfig,
    /// The policy gradient's baseline: the critic, or groups of continuations (group
    /// rollouts, `work.group_size`). Absent in specs written before it existed: the critic.
    #[serde(default)]
    pub baseline: Baseline,
    /// Trajectory selection: which received segments feed gradient steps, and with what weight.
    /// Absent in specs written before it existed; the default keeps the old behaviour.
    #[serde(default)]
    pub selection: SelectionConfig,
    /// How much the learner trusts any one actor (docs/SECURITY.md). Absent in specs written
    /// before it existed; the default trusts one actor with the whole return window.
    #[serde(default)]
    pub trust: TrustConfig,
    /// Size, age and history limits of the run's broker stores (issue 11: nothing the run
    /// writes grows without bound). Absent in specs written before it existed.
    #[serde(default)]
    pub stores: StoreLimits,
    /// Backpropagation through time across segments: stitched windows of consecutive
    /// segments. Absent in specs written before it existed; the default trains on single
    /// segments, as before.
    #[serde(default)]
    pub bptt: BpttConfig,
}

/// Credit across segments (issue 18): the learner stitches K consecutive segments of one
/// environment stream into a window and backpropagates through its K·T steps, carrying the
/// recurrent state across the segment boundaries inside it (docs/ARCHITECTURE.md, "Stitched
/// BPTT windows"). A batch then has `batch_segments / K` columns of K·T steps, so the samples
/// per update stay the same.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
#[serde(default)]
pub struct BpttConfig {
    /// Segments per window (K, 1..=64; 1 = every segment is a column of its own, truncated
    /// BPTT over T steps). Needs a recurrent core when above 1, and divides `batch_segments`.
    pub segments: usize,
    /// The most segments the learner holds in incomplete windows, over all streams (at least
    /// `segments`); beyond it, the stream that has waited longest is flushed as a shorter
    /// window. Held segments are unacknowledged deliveries, so over NATS this plus the
    /// selection pool must fit the consumer's 1000 unacknowledged deliveries.
    pub max_held_segments: usize,
    /// Seconds an incomplete window waits for its stream's next segment before it is flushed
    /// as a shorter window (an actor that stopped).
    pub stream_timeout_secs: f64,
}

impl Default for BpttConfig {
    fn default() -> Self {
        BpttConfig { segments: 1, max_held_segments: 512, stream_timeout_secs: 10.0 }
    }
}

/// The largest `bptt.segments` a spec accepts.
pub const MAX_BPTT_SEGMENTS: usize = 64;

/// Limits on how far one actor can move what the learner reports (docs/SECURITY.md).
///
/// Segments are validated against the environment's [`volley_env::EnvBounds`] whatever these
/// say; this bounds what valid-looking data from one actor id can do to the mean return that
/// the solved stop and every report read.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
#[serde(default)]
pub struct TrustConfig {
    /// The largest share (0, 1] of the 100-episode return window that one actor id may hold:
    /// a newer episode of an actor at its cap replaces that actor's oldest. With share `s`,
    /// one actor moves the windowed mean return by at most `s` times the environment's return
    /// range, and the solved stop needs episodes from at least `1 / s` actors. 1 (the
    /// default) suits single-actor runs; set `1 / k` to require `k` actors to agree.
    pub max_actor_return_share: f32,
}

impl Default for TrustConfig {
    fn default() -> Self {
        TrustConfig { max_actor_return_share: 1.0 }
    }
}

/// Explicit bounds on every JetStream store a distributed run creates (applied when the store
/// is created; the trajectory stream's bounds also when the learner starts again).
///
/// Weights objects are additionally purged by the learner: only the newest
/// `weights_keep_versions` stay, and the delete marker of each removed version is purged
/// too, so the weights store holds about `weights_keep_versions` objects however long the run.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
#[serde(default)]
pub struct StoreLimits {
    /// Upper bound on the trajectory stream's bytes; the oldest segments are discarded first.
    /// Segments stay after they were consumed (for replay), so on a long run this is the
    /// stream's size.
    pub trajectory_max_bytes: u64,
    /// Age after which a segment is removed from the trajectory stream (0: never).
    pub trajectory_max_age_secs: f64,
    /// Weights versions kept in the object store (the newest ones).
    pub weights_keep_versions: usize,
    /// Upper bound on the weights object store's bytes (chunks and metadata).
    pub weights_max_bytes: u64,
    /// Values kept per key in the run's KV bucket (spec, weights pointer).
    pub kv_history: u32,
    /// Upper bound on the run's KV bucket's bytes.
    pub kv_max_bytes: u64,
    /// Upper bound on queued work items (the work-queue stream's messages).
    pub work_max_messages: u64,
    /// Upper bound on the work-queue stream's bytes.
    pub work_max_bytes: u64,
    /// Age after which an unclaimed work item is discarded (0: never).
    pub work_max_age_secs: f64,
    /// Upper bound on the snapshot object store's bytes (its age bound is
    /// `work.snapshot_ttl_secs`).
    pub snapshot_max_bytes: u64,
    /// Upper bound on the snapshot index KV bucket's bytes.
    pub snapshot_index_max_bytes: u64,
}

impl Default for StoreLimits {
    fn default() -> Self {
        StoreLimits {
            trajectory_max_bytes: 1 << 30,
            trajectory_max_age_secs: 24.0 * 3600.0,
            weights_keep_versions: 3,
            weights_max_bytes: 1 << 30,
            kv_history: 1,
            kv_max_bytes: 64 << 20,
            work_max_messages: 1_000_000,
            work_max_bytes: 256 << 20,
            work_max_age_secs: 24.0 * 3600.0,
            snapshot_max_bytes: 4 << 30,
            snapshot_index_max_bytes: 256 << 20,
        }
    }
}

/// Longest age limit a store may have: one year.
const MAX_STORE_AGE_SECS: f64 = 365.0 * 24.0 * 3600.0;

impl StoreLimits {
    fn validate(&self, weights_bytes: u64) -> Result<(), SpecError> {
        let hyper = |name: &'static str, value: String, rule: &'static str| Err(SpecError::Hyper { name, value, rule });
        if !(1..=1024).contains(&self.weights_keep_versions) {
            return hyper("stores.weights_keep_versions", self.weights_keep_versions.to_string(), "1..=1024");
        }
        // The kept versions plus the one being written must fit, with room for metadata.
        let needed = (self.weights_keep_versions as u64 + 1).saturating_mul(weights_bytes).saturating_add(1 << 20);
        if self.weights_max_bytes < needed {
            return hyper(
                "stores.weights_max_bytes",
                self.weights_max_bytes.to_string(),
                ">= (weights_keep_versions + 1) x the weights' size + 1 MiB",
            );
        }
        if !(1..=64).contains(&self.kv_history) {
            return hyper("stores.kv_history", self.kv_history.to_string(), "1..=64");
        }
        for (name, value) in [
            ("stores.trajectory_max_bytes", self.trajectory_max_bytes),
            ("stores.kv_max_bytes", self.kv_max_bytes),
            ("stores.work_max_messages", self.work_max_messages),
            ("stores.work_max_bytes", self.work_max_bytes),
            ("stores.snapshot_max_bytes", self.snapshot_max_bytes),
            ("stores.snapshot_index_max_bytes", self.snapshot_index_max_bytes),
        ] {
            if value == 0 || value > i64::MAX as u64 {
                return hyper(name, value.to_string(), "1..=i64::MAX");
            }
        }
        for (name, value) in [
            ("stores.trajectory_max_age_secs", self.trajectory_max_age_secs),
            ("stores.work_max_age_secs", self.work_max_age_secs),
        ] {
            // Below a year, so the broker's nanosecond durations cannot overflow.
            if !(value.is_finite() && (0.0..=MAX_STORE_AGE_SECS).contains(&value)) {
                return hyper(name, value.to_string(), "finite, 0..=31536000 (0: no age limit)");
            }
        }
        Ok(())
    }
}

/// Trajectory selection (learner `selection.rs`; docs/ARCHITECTURE.md, "Trajectory
/// selection"). The filters run in this order before every gradient step: the lag bound
/// ([`HyperParams::max_policy_lag`]), the [`GuardConfig`], [`ZeroVarianceConfig`], then the
/// [`PriorityConfig`] sampler. A segment is dropped (and counted) by the first filter it fails.
#[derive(Debug, Clone, PartialEq, Default, serde::Serialize, serde::Deserialize)]
#[serde(default)]
pub struct SelectionConfig {
    /// Drop segments with non-finite derived values or absurd rewards (on by default).
    pub guard: GuardConfig,
    /// Drop segments of start groups whose recent returns are all equal (off by default).
    pub zero_variance: Option<ZeroVarianceConfig>,
    /// Sample each batch from a larger pool by |advantage| with importance weights (off by default).
    pub priority: Option<PriorityConfig>,
}

/// The non-finite / out-of-range guard.
///
/// Decode already rejects non-finite wire fields; this guards what decode cannot see: rewards
/// that overflow once scaled and bootstrapped (`reward_scale · r + γ · V(x_final)`), non-finite
/// episode returns, learner-side value estimates and advantages (with priority sampling), and
/// finite but absurd rewards (`|r| > max_abs_reward`, e.g. an environment bug returning 1e30).
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
#[serde(default)]
pub struct GuardConfig {
    /// Whether the guard runs.
    pub enabled: bool,
    /// Drop segments with any raw reward of larger magnitude (`None`: no bound).
    pub max_abs_reward: Option<f32>,
}

impl Default for GuardConfig {
    fn default() -> Self {
        GuardConfig { enabled: true, max_abs_reward: None }
    }
}

/// The zero-variance group filter ("dynamic sampling", Yu et al. 2025, DAPO; the motivation is
/// GRPO's group-relative advantage, Shao et al. 2024).
///
/// A group is the segments that share a start: `(task_id, start_snapshot)`. The learner keeps
/// the returns of the last `min_group` finished episodes of each group; when that window is
/// full and `max − min ≤ tolerance`, segments of the group are dropped before the step: with
/// every recent rollout from that start scoring the same, a group-relative advantage is zero.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
#[serde(default)]
pub struct ZeroVarianceConfig {
    /// Finished episodes a group needs (its window length) before the rule applies.
    pub min_group: usize,
    /// Largest spread `max − min` of the window's returns that counts as zero variance.
    pub tolerance: f32,
}

impl Default for ZeroVarianceConfig {
    fn default() -> Self {
        ZeroVarianceConfig { min_group: 8, tolerance: 0.0 }
    }
}

/// Prioritised selection by |advantage| with importance correction (Schaul et al. 2016, PER).
///
/// The learner holds a pool of `pool_factor × batch_segments` segments, computes each new
/// segment's priority `mean_t |A_t| + epsilon` (GAE advantages under its current value head),
/// draws `batch_segments` columns with replacement with probability `p_i ∝ priority_i^alpha`,
/// and weights each drawn column by `(N·p_i)^(−beta)`, normalised so the largest possible
/// weight in the pool is 1. Segments not drawn stay in the pool until the lag bound drops them.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
#[serde(default)]
pub struct PriorityConfig {
    /// Pool size in batches (N = pool_factor × batch_segments).
    pub pool_factor: usize,
    /// Priority exponent α (0 = uniform).
    pub alpha: f32,
    /// Importance-correction exponent β (0 = none, 1 = full).
    pub beta: f32,
    /// Added to every priority so no segment has zero probability.
    pub epsilon: f32,
}

impl Default for PriorityConfig {
    fn default() -> Self {
        PriorityConfig { pool_factor: 2, alpha: 0.6, beta: 0.4, epsilon: 1e-3 }
    }
}

impl SelectionConfig {
    /// Segments held before a batch is drawn: `batch_segments`, or the priority pool.
    pub fn pool_segments(&self, batch_segments: usize) -> usize {
        self.priority.as_ref().map_or(batch_segments, |p| p.pool_factor.saturating_mul(batch_segments))
    }

    fn validate(&self, batch_segments: usize) -> Result<(), SpecError> {
        let hyper = |name: &'static str, value: String, rule: &'static str| Err(SpecError::Hyper { name, value, rule });
        if let Some(bound) = self.guard.max_abs_reward {
            if !(bound.is_finite() && bound > 0.0) {
                return hyper("selection.guard.max_abs_reward", bound.to_string(), "finite and > 0");
            }
        }
        if let Some(zero) = &self.zero_variance {
            if !(2..=65536).contains(&zero.min_group) {
                return hyper("selection.zero_variance.min_group", zero.min_group.to_string(), "2..=65536");
            }
            if !(zero.tolerance.is_finite() && zero.tolerance >= 0.0) {
                return hyper("selection.zero_variance.tolerance", zero.tolerance.to_string(), "finite and >= 0");
            }
        }
        if let Some(priority) = &self.priority {
            if !(1..=64).contains(&priority.pool_factor) || priority.pool_factor * batch_segments > 1 << 20 {
                return hyper(
                    "selection.priority.pool_factor",
                    priority.pool_factor.to_string(),
                    "1..=64 and pool_factor * batch_segments <= 1048576",
                );
            }
            if !(0.0..=10.0).contains(&priority.alpha) {
                return hyper("selection.priority.alpha", priority.alpha.to_string(), "in [0, 10]");
            }
            if !(0.0..=1.0).contains(&priority.beta) {
                return hyper("selection.priority.beta", priority.beta.to_string(), "in [0, 1]");
            }
            if !(priority.epsilon.is_finite() && priority.epsilon > 0.0) {
                return hyper("selection.priority.epsilon", priority.epsilon.to_string(), "finite and > 0");
            }
        }
        Ok(())
    }
}

impl Default for HyperParams {
    fn default() -> Self {
        HyperParams {
            loss: LossKind::Ppo,
            gamma: 0.99,
            reward_scale: 1.0,
            learning_rate: 3e-3,
            final_learning_rate: 3e-3,
            lr_decay_updates: 1,
            adam_beta1: 0.9,
            adam_beta2: 0.999,
            adam_eps: 1e-8,
            max_grad_norm: 0.5,
            ent_coef: 0.0,
            final_ent_coef: None,
            value_coef: 0.5,
            clip_rho_threshold: 1.0,
            clip_pg_rho_threshold: 1.0,
            clip_c_threshold: 1.0,
            vtrace_lambda: 0.95,
            gae_lambda: 0.95,
            clip_coef: 0.2,
            behaviour_is_clip: 2.0,
            ppo_epochs: 4,
            ppo_minibatches: 4,
            normalize_advantages: true,
            batch_segments: 32,
            max_policy_lag: 8,
            max_backlog_segments: 64,
            work: crate::work::WorkConfig::default(),
            baseline: Baseline::Critic,
            selection: SelectionConfig::default(),
            trust: TrustConfig::default(),
            stores: StoreLimits::default(),
            bptt: BpttConfig::default(),
        }
    }
}

/// Why a run spec is invalid.
#[derive(Debug, thiserror::Error)]
pub enum SpecError {
    /// The save-load / budget settings are invalid.
    #[error("invalid work settings: {0}")]
    Work(String),
    /// The environment config is invalid.
    #[error(transparent)]
    Env(#[from] EnvError),
    /// The policy spec is invalid.
    #[error(transparent)]
    Policy(#[from] PolicyError),
    /// The policy's input/output sizes do not match the environment.
    #[error("policy {what} is {policy} but environment {env_name} has {env}")]
    Mismatch {
        /// `"obs_dim"` or `"n_actions"`.
        what: &'static str,
        /// The policy's value.
        policy: usize,
        /// The environment's value.
        env: usize,
        /// The environment's name.
        env_name: String,
    },
    /// A combination this build cannot train.
    #[error("unsupported: {0}")]
    Unsupported(String),
    /// A hyper-parameter is out of range.
    #[error("invalid hyper-parameter {name} = {value}: {rule}")]
    Hyper {
        /// The parameter.
        name: &'static str,
        /// Its value, formatted.
        value: String,
        /// What it must satisfy.
        rule: &'static str,
    },
}

impl RunSpec {
    /// Stitched windows: K in range, a recurrent core to carry state across segments, whole
    /// windows per batch and per PPO minibatch, bounds that can hold a window.
    fn validate_bptt(&self) -> Result<(), SpecError> {
        let h = &self.hyper;
        let bptt = &h.bptt;
        let k = bptt.segments;
        let hyper = |name: &'static str, value: String, rule: &'static str| Err(SpecError::Hyper { name, value, rule });
        if !(1..=MAX_BPTT_SEGMENTS).contains(&k) {
            return hyper("bptt.segments", k.to_string(), "1..=64");
        }
        if k == 1 {
            return Ok(());
        }
        if matches!(self.policy.core, volley_policy::CoreKind::Mlp) {
            return Err(SpecError::Unsupported(format!(
                "bptt.segments = {k} (--bptt-segments) needs a recurrent core (--core gru): a feed-forward policy \
                 carries no state across steps, so stitching segments would change nothing"
            )));
        }
        if !h.batch_segments.is_multiple_of(k) {
            return Err(SpecError::Unsupported(format!(
                "batch_segments = {} (--batch-segments) is not a multiple of bptt.segments = {k} (--bptt-segments): \
                 a batch is batch_segments / K windows of K segments",
                h.batch_segments
            )));
        }
        if h.loss == LossKind::Ppo && h.ppo_minibatches as usize > h.batch_segments / k {
            return Err(SpecError::Unsupported(format!(
                "ppo_minibatches = {} (--ppo-minibatches) exceeds the {} windows of a batch \
                 (batch_segments {} / bptt.segments {k}); minibatches split whole windows",
                h.ppo_minibatches,
                h.batch_segments / k,
                h.batch_segments
            )));
        }
        // Group rollouts hold segments until their groups complete and give them per-segment
        // advantages; windows of several segments would need both holds to agree. Not built.
        if k > 1 && h.work.enabled && h.work.group_size > 1 {
            return Err(SpecError::Unsupported(format!(
                "bptt.segments = {k} (--bptt-segments) with group rollouts (work.group_size = {}, --group-size): \
                 stitched windows and groups cannot be combined yet; use one of them",
                h.work.group_size
            )));
        }
        if !(k..=100_000).contains(&bptt.max_held_segments) {
            return hyper("bptt.max_held_segments", bptt.max_held_segments.to_string(), "bptt.segments..=100000");
        }
        if !(bptt.stream_timeout_secs.is_finite() && bptt.stream_timeout_secs > 0.0) {
            return hyper("bptt.stream_timeout_secs", bptt.stream_timeout_secs.to_string(), "> 0");
        }
        Ok(())
    }
}

/// Version of the stored run spec's envelope ([`RunSpec::encode_stored`]).
pub const STORED_SPEC_FORMAT: u32 = 1;
/// Start of a stored run spec, up to its checksum's 16 hex digits.
const STORED_SPEC_HEAD: &[u8] = b"{\"format\":1,\"xxh3\":\"";
/// Between the checksum and the spec itself.
const STORED_SPEC_MIDDLE: &[u8] = b"\",\"spec\":";
/// How every stored envelope starts, whatever its format number.
const STORED_SPEC_ANY_FORMAT: &[u8] = b"{\"format\":";

/// Why a stored run spec was refused ([`RunSpec::decode_stored`]).
#[derive(Debug, thiserror::Error)]
pub enum StoredSpecError {
    /// The spec's bytes do not match the checksum stored with them.
    #[error("run spec checksum mismatch: stored {stored:016x}, computed {computed:016x}")]
    Corrupt {
        /// The checksum in the envelope.
        stored: u64,
        /// XXH3-64 of the spec bytes as read.
        computed: u64,
    },
    /// The bytes are not a stored run spec (bad envelope, unknown format, or JSON that is
    /// not a run spec).
    #[error("run spec does not decode: {0}")]
    Malformed(String),
}

impl StoredSpecError {
    /// The `reason` label this error is counted under.
    pub fn reason(&self) -> &'static str {
        match self {
            StoredSpecError::Corrupt { .. } => "corrupt",
            StoredSpecError::Malformed(_) => "malformed",
        }
    }
}

/// Everything shared across the processes of one run.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct RunSpec {
    /// The run's name.
    pub run: RunId,
    /// The environment every actor builds.
    pub env: EnvConfig,
    /// The policy architecture.
    pub policy: PolicySpec,
    /// Steps per segment (T).
    pub segment_len: usize,
    /// Learner hyper-parameters.
    pub hyper: HyperParams,
    /// Base seed of the run.
    pub seed: u64,
}

impl RunSpec {
    /// The spec as the learner stores it in the run's KV bucket: a JSON envelope
    /// `{"format":1,"xxh3":"<16 hex digits>","spec":<the spec as pretty JSON>}` whose checksum
    /// is XXH3-64 (seed 0) of the spec's bytes exactly as they follow `"spec":`, so operators
    /// can still read it and a reader can verify it without re-serialising.
    ///
    /// ```
    /// # use volley_core::spec::RunSpec;
    /// # fn round_trip(spec: &RunSpec) {
    /// let stored = spec.encode_stored();
    /// assert_eq!(&RunSpec::decode_stored(&stored).unwrap(), spec);
    /// # }
    /// ```
    pub fn encode_stored(&self) -> Vec<u8> {
        let body = serde_json::to_vec_pretty(self).expect("a run spec always serialises to JSON");
        let checksum = format!("{:016x}", xxhash_rust::xxh3::xxh3_64(&body));
        let mut stored = Vec::with_capacity(body.len() + 48);
        stored.extend_from_slice(STORED_SPEC_HEAD);
        stored.extend_from_slice(checksum.as_bytes());
        stored.extend_from_slice(STORED_SPEC_MIDDLE);
        stored.extend_from_slice(&body);
        stored.push(b'}');
        stored
    }

    /// Read a stored spec ([`RunSpec::encode_stored`]), verifying its checksum before the spec
    /// is decoded. A plain JSON spec, as learners before the envelope wrote it, is still read
    /// (it has no checksum to verify). Does not [`validate`](RunSpec::validate).
    pub fn decode_stored(bytes: &[u8]) -> Result<RunSpec, StoredSpecError> {
        let malformed = |what: String| StoredSpecError::Malformed(what);
        if !bytes.starts_with(STORED_SPEC_ANY_FORMAT) {
            return serde_json::from_slice(bytes).map_err(|err| malformed(err.to_string()));
        }
        let rest = bytes.strip_prefix(STORED_SPEC_HEAD).ok_or_else(|| {
            let format: String = bytes[STORED_SPEC_ANY_FORMAT.len()..].iter().take(8).map(|&b| b as char).collect();
            malformed(format!("unknown envelope or format {format:?} (this build reads format {STORED_SPEC_FORMAT})"))
        })?;
        let (hex, rest) = rest.split_at_checked(16).ok_or_else(|| malformed("truncated envelope".into()))?;
        let stored = std::str::from_utf8(hex)
            .ok()
            .filter(|hex| hex.bytes().all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b)))
            .and_then(|hex| u64::from_str_radix(hex, 16).ok())
            .ok_or_else(|| malformed("the checksum is not 16 lowercase hex digits".into()))?;
        let body = rest
            .strip_prefix(STORED_SPEC_MIDDLE)
            .and_then(|rest| rest.strip_suffix(b"}"))
            .ok_or_else(|| malformed("bad envelope around the spec".into()))?;
        let computed = xxhash_rust::xxh3::xxh3_64(body);
        if computed != stored {
            return Err(StoredSpecError::Corrupt { stored, computed });
        }
        serde_json::from_slice(body).map_err(|err| malformed(err.to_string()))
    }

    /// Check cross-field consistency once; the rest of the code trusts a validated spec.
    pub fn validate(&self) -> Result<ParamLayout, SpecError> {
        let (obs_dim, n_actions) = self.env.spaces()?;
        let env_continuous = env_is_continuous(&self.env)?;
        if env_continuous != self.policy.head.is_continuous() {
            return Err(SpecError::Unsupported(format!(
                "environment {} has {} actions but the policy head is {:?} (a Gaussian head for \
                 continuous actions, a categorical one for discrete actions)",
                self.env.describe(),
                if env_continuous { "continuous" } else { "discrete" },
                self.policy.head,
            )));
        }
        let layout = ParamLayout::new(&self.policy)?;
        if self.policy.obs_dim != obs_dim {
            return Err(SpecError::Mismatch {
                what: "obs_dim",
                policy: self.policy.obs_dim,
                env: obs_dim,
                env_name: self.env.describe(),
            });
        }
        if self.policy.n_actions != n_actions {
            return Err(SpecError::Mismatch {
                what: "n_actions",
                policy: self.policy.n_actions,
                env: n_actions,
                env_name: self.env.describe(),
            });
        }
        let h = &self.hyper;
        let checks: [(&'static str, f64, bool, &'static str); 14] = [
            ("segment_len", self.segment_len as f64, (1..=4096).contains(&self.segment_len), "1..=4096"),
            ("gamma", h.gamma as f64, (0.0..=1.0).contains(&h.gamma), "in [0, 1]"),
            ("learning_rate", h.learning_rate as f64, h.learning_rate > 0.0 && h.learning_rate < 1.0, "in (0, 1)"),
            (
                "final_learning_rate",
                h.final_learning_rate as f64,
                h.final_learning_rate >= 0.0 && h.final_learning_rate < 1.0,
                "in [0, 1)",
            ),
            ("max_grad_norm", h.max_grad_norm as f64, h.max_grad_norm > 0.0, "> 0"),
            ("ent_coef", h.ent_coef as f64, h.ent_coef >= 0.0, ">= 0"),
            ("final_ent_coef", h.final_ent_coef.unwrap_or(0.0) as f64, h.final_ent_coef.unwrap_or(0.0) >= 0.0, ">= 0"),
            ("value_coef", h.value_coef as f64, h.value_coef >= 0.0, ">= 0"),
            ("gae_lambda", h.gae_lambda as f64, (0.0..=1.0).contains(&h.gae_lambda), "in [0, 1]"),
            ("vtrace_lambda", h.vtrace_lambda as f64, (0.0..=1.0).contains(&h.vtrace_lambda), "in [0, 1]"),
            ("clip_coef", h.clip_coef as f64, h.clip_coef > 0.0, "> 0"),
            ("batch_segments", h.batch_segments as f64, (1..=65536).contains(&h.batch_segments), "1..=65536"),
            (
                "trust.max_actor_return_share",
                h.trust.max_actor_return_share as f64,
                h.trust.max_actor_return_share > 0.0 && h.trust.max_actor_return_share <= 1.0,
                "in (0, 1]",
            ),
            (
                "ppo_minibatches",
                h.ppo_minibatches as f64,
                h.ppo_minibatches >= 1 && h.ppo_minibatches as usize <= h.batch_segments,
                "1..=batch_segments",
            ),
        ];
        for (name, value, ok, rule) in checks {
            if !ok || !value.is_finite() {
                return Err(SpecError::Hyper { name, value: value.to_string(), rule });
            }
        }
        let positive = [
            ("clip_rho_threshold", h.clip_rho_threshold),
            ("clip_pg_rho_threshold", h.clip_pg_rho_threshold),
            ("clip_c_threshold", h.clip_c_threshold),
            ("behaviour_is_clip", h.behaviour_is_clip),
            ("reward_scale", h.reward_scale),
            ("adam_eps", h.adam_eps),
        ];
        for (name, value) in positive {
            if value.is_nan() || value <= 0.0 {
                return Err(SpecError::Hyper { name, value: value.to_string(), rule: "> 0" });
            }
        }
        if h.ppo_epochs == 0 {
            return Err(SpecError::Hyper { name: "ppo_epochs", value: "0".into(), rule: ">= 1" });
        }
        h.work.validate().map_err(SpecError::Work)?;
        self.validate_bptt()?;
        h.stores.validate(layout.n_params() as u64 * 4)?;
        // Every task must fit the one policy: same spaces as the run's env. Save-load needs
        // environments that snapshot: built-in ones, or remote ones whose servers declared it.
        if let EnvConfig::Remote(remote) = &self.env {
            if h.work.enabled && !remote.snapshot {
                return Err(SpecError::Work(format!(
                    "work items need environments that snapshot; the servers of {} declare snapshot: false",
                    remote.service
                )));
            }
            if !h.work.tasks.is_empty() {
                return Err(SpecError::Work("work.tasks are built-in environments; the run's env is remote".into()));
            }
        }
        for task in &h.work.tasks {
            if matches!(task, EnvConfig::Remote(_)) {
                return Err(SpecError::Work("work.tasks must be built-in environments".into()));
            }
            let task_env = task.build()?;
            if task_env.action_space().is_continuous() != env_continuous {
                return Err(SpecError::Work(format!("work task {} has another kind of actions", task_env.name())));
            }
            for (what, want, got) in [
                ("obs_dim", obs_dim, task_env.observation_space().dim()),
                ("n_actions", n_actions, task_env.action_space().n_actions()),
            ] {
                if want != got {
                    return Err(SpecError::Mismatch {
                        what,
                        policy: want,
                        env: got,
                        env_name: task_env.name().to_string(),
                    });
                }
            }
        }
        h.selection.validate(h.batch_segments)?;
        if h.baseline.uses_groups() && !(h.work.enabled && h.work.group_size > 1) {
            return Err(SpecError::Work(format!(
                "baseline {:?} needs group rollouts: work items on (--work) and work.group_size above 1 \
                 (got work {} and group_size {})",
                h.baseline,
                if h.work.enabled { "on" } else { "off" },
                h.work.group_size
            )));
        }
        Ok(layout)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use volley_env::EnvServiceName;
    use volley_env::RemoteEnvConfig;
    use volley_policy::{Activation, CoreKind};

    fn spec(env: EnvConfig, obs_dim: usize) -> RunSpec {
        RunSpec {
            run: RunId::new("spec-test").expect("valid"),
            env,
            policy: PolicySpec {
                obs_dim,
                n_actions: 2,
                torso: vec![8],
                activation: Activation::Tanh,
                core: CoreKind::Mlp,
                head: volley_policy::ActionHead::Categorical,
                conv: None,
                normalize_obs: false,
                critic: Vec::new(),
            },
            segment_len: 8,
            hyper: HyperParams::default(),
            seed: 3,
        }
    }

    /// Issue 18: stitched BPTT windows need a recurrent core and whole windows per batch and
    /// per PPO minibatch; a spec written before `bptt` existed trains on single segments.
    #[test]
    fn bptt_windows_are_checked_and_default_to_single_segments() {
        let mut spec = spec(EnvConfig::Cartpole, 4);
        let mut json = serde_json::to_value(&spec).expect("serialisable");
        json["hyper"].as_object_mut().expect("an object").remove("bptt");
        let old: RunSpec = serde_json::from_value(json).expect("an older spec parses");
        assert_eq!(old.hyper.bptt, BpttConfig::default());
        assert_eq!(old.hyper.bptt.segments, 1);
        spec.hyper.batch_segments = 8;
        spec.hyper.loss = LossKind::Vtrace;
        spec.hyper.bptt.segments = 4;
        let err = spec.validate().unwrap_err().to_string();
        assert!(err.contains("needs a recurrent core") && err.contains("--bptt-segments"), "{err}");
        spec.policy.core = CoreKind::Gru { hidden: 8 };
        spec.validate().expect("a GRU with 8 segments per batch in windows of 4");
        spec.hyper.bptt.segments = 3;
        let err = spec.validate().unwrap_err().to_string();
        assert!(err.contains("batch_segments = 8") && err.contains("not a multiple"), "{err}");
        spec.hyper.bptt.segments = 4;
        spec.hyper.loss = LossKind::Ppo;
        spec.hyper.ppo_minibatches = 4;
        let err = spec.validate().unwrap_err().to_string();
        assert!(err.contains("ppo_minibatches = 4") && err.contains("2 windows"), "{err}");
        spec.hyper.ppo_minibatches = 2;
        spec.validate().expect("two windows, two minibatches");
        spec.hyper.bptt.max_held_segments = 3;
        assert!(spec.validate().unwrap_err().to_string().contains("bptt.max_held_segments"));
        spec.hyper.bptt = BpttConfig { segments: 65, ..BpttConfig::default() };
        assert!(spec.validate().unwrap_err().to_string().contains("bptt.segments"));
    }

    /// Issue 11: every store has explicit limits; specs written before they existed parse with
    /// the defaults, and limits that cannot hold the run's weights are refused by name.
    #[test]
    fn store_limits_default_when_absent_and_are_checked_against_the_weights() {
        let spec = spec(EnvConfig::Cartpole, 4);
        let mut json = serde_json::to_value(&spec).unwrap();
        json["hyper"].as_object_mut().unwrap().remove("stores");
        let old: RunSpec = serde_json::from_value(json).unwrap();
        assert_eq!(old.hyper.stores, StoreLimits::default());
        let mut small = spec.clone();
        small.hyper.stores.weights_max_bytes = 1000;
        let err = small.validate().expect_err("1000 bytes cannot hold 4 versions plus metadata").to_string();
        assert!(err.contains("stores.weights_max_bytes"), "{err}");
        let mut zero = spec.clone();
        zero.hyper.stores.work_max_messages = 0;
        assert!(zero.validate().expect_err("unbounded").to_string().contains("stores.work_max_messages"));
        let mut unbounded = spec.clone();
        unbounded.hyper.stores.trajectory_max_bytes = 0;
        let err = unbounded.validate().expect_err("no byte bound").to_string();
        assert!(err.contains("stores.trajectory_max_bytes"), "{err}");
        for age in [-1.0, f64::NAN, 1e12] {
            let mut aged = spec.clone();
            aged.hyper.stores.trajectory_max_age_secs = age;
            let err = aged.validate().expect_err("not a usable age").to_string();
            assert!(err.contains("stores.trajectory_max_age_secs"), "{age}: {err}");
        }
        let mut small_stream = spec;
        small_stream.hyper.stores.trajectory_max_bytes = 64 << 20;
        small_stream.hyper.stores.trajectory_max_age_secs = 0.0;
        small_stream.validate().expect("64 MiB and no age limit is a bounded stream");
    }

    /// Issue 12: the stored spec carries a checksum that is verified before it is decoded;
    /// every single-bit flip of the stored bytes is refused, and a plain JSON spec from an
    /// older learner is still read.
    #[test]
    fn stored_spec_round_trips_and_every_bit_flip_is_refused() {
        let spec = spec(EnvConfig::Cartpole, 4);
        let stored = spec.encode_stored();
        assert_eq!(RunSpec::decode_stored(&stored).expect("round trip"), spec);
        let envelope: serde_json::Value = serde_json::from_slice(&stored).expect("the envelope is JSON");
        assert_eq!(envelope["format"], STORED_SPEC_FORMAT);
        let inner: RunSpec = serde_json::from_value(envelope["spec"].clone()).expect("the spec is readable JSON");
        assert_eq!(inner, spec);
        let (mut corrupt, mut malformed) = (0, 0);
        for bit in 0..stored.len() * 8 {
            let mut flipped = stored.clone();
            flipped[bit / 8] ^= 1 << (bit % 8);
            match RunSpec::decode_stored(&flipped) {
                Ok(decoded) => panic!("bit {bit} flipped and still decoded: {decoded:?}"),
                Err(err @ StoredSpecError::Corrupt { .. }) => {
                    assert_eq!(err.reason(), "corrupt");
                    corrupt += 1;
                }
                Err(err) => {
                    assert_eq!(err.reason(), "malformed");
                    malformed += 1;
                }
            }
        }
        // Flips inside the spec or its checksum fail the checksum; flips in the envelope's
        // framing fail to parse.
        assert!(corrupt > stored.len() * 8 * 9 / 10, "{corrupt} corrupt, {malformed} malformed");
        let legacy = serde_json::to_vec_pretty(&spec).expect("json");
        assert_eq!(RunSpec::decode_stored(&legacy).expect("a plain spec still reads"), spec);
        let future = String::from_utf8(stored.clone()).expect("utf8").replacen("\"format\":1", "\"format\":2", 1);
        let err = RunSpec::decode_stored(future.as_bytes()).expect_err("an unknown format");
        assert!(err.to_string().contains("format"), "{err}");
        for cut in [0, 5, 20, 40, stored.len() - 1] {
            assert!(RunSpec::decode_stored(&stored[..cut]).is_err(), "truncated at {cut}");
        }
    }

    /// Issue 14: a continuous environment trains with a Gaussian head; a head that does not
    /// fit the environment's actions is refused by name, and specs written before heads
    /// existed parse as categorical.
    #[test]
    fn the_action_head_must_fit_the_environment() {
        let mut pendulum = spec(EnvConfig::Pendulum, 3);
        pendulum.policy.n_actions = 1;
        let err = pendulum.validate().expect_err("a categorical head on pendulum").to_string();
        assert!(err.contains("continuous") && err.contains("pendulum"), "{err}");
        assert_eq!(default_action_head(&EnvConfig::Pendulum).unwrap(), ActionHead::Gaussian { squash: false });
        for squash in [false, true] {
            pendulum.policy.head = ActionHead::Gaussian { squash };
            let layout = pendulum.validate().expect("a Gaussian head on pendulum");
            assert_eq!(layout.log_std_range().map(|r| r.len()), Some(1));
        }
        let mut cartpole = spec(EnvConfig::Cartpole, 4);
        let mut old = serde_json::to_value(&cartpole).unwrap();
        assert_eq!(old["policy"]["head"], "categorical");
        old["policy"].as_object_mut().unwrap().remove("head");
        assert_eq!(serde_json::from_value::<RunSpec>(old).unwrap(), cartpole);
        cartpole.policy.head = ActionHead::Gaussian { squash: false };
        assert!(cartpole.validate().expect_err("a Gaussian head on cartpole").to_string().contains("discrete"));
        let json = serde_json::to_value(&pendulum).unwrap();
        assert_eq!(json["policy"]["head"], serde_json::json!({"gaussian": {"squash": true}}));
        assert_eq!(serde_json::from_value::<RunSpec>(json).unwrap(), pendulum);
    }

    /// Specs written before remote environments existed still parse, unchanged.
    #[test]
    fn built_in_env_json_is_unchanged() {
        let json = serde_json::to_value(spec(EnvConfig::Cartpole, 4)).unwrap();
        assert_eq!(json["env"], serde_json::json!({"name": "cartpole"}));
        let memory: EnvConfig = serde_json::from_str(r#"{"name":"memory","n_cues":2,"delay":6}"#).unwrap();
        assert!(matches!(memory, EnvConfig::Memory(_)));
    }

    #[test]
    fn a_remote_env_validates_without_the_network_and_round_trips() {
        let remote = EnvConfig::Remote(RemoteEnvConfig {
            reward_threshold: Some(475.0),
            ..RemoteEnvConfig::new(EnvServiceName::new("cartpole-v1").unwrap(), 4, 2)
        });
        let spec = spec(remote.clone(), 4);
        spec.validate().expect("declared spaces match the policy");
        let json = serde_json::to_string(&spec).unwrap();
        assert!(json.contains(
            r#""env":{"name":"remote","service":"cartpole-v1","obs_dim":4,"n_actions":2,"reward_threshold":475.0}"#
        ));
        assert_eq!(serde_json::from_str::<RunSpec>(&json).unwrap(), spec);
        assert_eq!(remote.describe(), "remote:cartpole-v1");
        assert!(remote.build().is_err(), "a remote environment is not built in-process");
        let mismatch = self::spec(remote, 5).validate().unwrap_err();
        assert!(mismatch.to_string().contains("remote:cartpole-v1"), "{mismatch}");
        let bad_name = r#"{"name":"remote","service":"Bad.Name","obs_dim":4,"n_actions":2}"#;
        assert!(serde_json::from_str::<EnvConfig>(bad_name).is_err());
    }

    /// Scheduled episodes (`--work`) run on a remote environment only if its servers snapshot;
    /// its successes are returns at the declared threshold.
    #[test]
    fn work_items_on_a_remote_env_need_snapshots() {
        let mut remote = RemoteEnvConfig {
            reward_threshold: Some(475.0),
            ..RemoteEnvConfig::new(EnvServiceName::new("cartpole-v1").unwrap(), 4, 2)
        };
        let mut with_work = spec(EnvConfig::Remote(remote.clone()), 4);
        with_work.hyper.work.enabled = true;
        let err = with_work.validate().unwrap_err().to_string();
        assert!(err.contains("declare snapshot: false"), "{err}");
        remote.snapshot = true;
        with_work.env = EnvConfig::Remote(remote.clone());
        with_work.validate().expect("servers that snapshot can run work items");
        with_work.hyper.work.tasks = vec![EnvConfig::Cartpole];
        assert!(with_work.validate().is_err(), "tasks are built-in environments");
        let json = serde_json::to_string(&EnvConfig::Remote(remote.clone())).unwrap();
        assert!(json.contains(r#""snapshot":true"#), "{json}");
        let env = EnvConfig::Remote(remote);
        assert!(crate::work::episode_success(&env, 500.0) && !crate::work::episode_success(&env, 474.0));
    }

    /// A remote environment with box actions (docs/ENV_PROTOCOL.md, version 2) gets a Gaussian
    /// head by default, and its bounds must fit its `n_actions`.
    #[test]
    fn a_remote_env_with_box_actions_is_continuous() {
        let json = r#"{"name":"remote","service":"pendulum-v1","obs_dim":3,"n_actions":1,
            "action_box":{"low":[-2.0],"high":[2.0]}}"#;
        let env: EnvConfig = serde_json::from_str(json).unwrap();
        assert!(env_is_continuous(&env).unwrap());
        assert_eq!(default_action_head(&env).unwrap(), ActionHead::Gaussian { squash: false });
        assert_eq!(env.spaces().unwrap(), (3, 1));
        let mut spec = spec(env.clone(), 3);
        spec.policy = PolicySpec::mlp(3, 1, &[8], Activation::Tanh);
        assert!(spec.validate().is_err(), "a categorical head on box actions is refused");
        spec.policy.head = ActionHead::Gaussian { squash: false };
        spec.validate().expect("a Gaussian head fits box actions");
        let EnvConfig::Remote(mut remote) = env else { unreachable!() };
        remote.n_actions = 2;
        assert!(EnvConfig::Remote(remote.clone()).spaces().is_err(), "1 bound for 2 action values");
        remote.n_actions = 1;
        remote.action_box = Some(volley_env::RemoteActionBox { low: vec![1.0], high: vec![-1.0] });
        assert!(EnvConfig::Remote(remote).spaces().is_err(), "low > high");
    }

    fn small_spec() -> RunSpec {
        RunSpec {
            run: RunId::new("spec").expect("valid run id"),
            env: EnvConfig::Cartpole,
            policy: PolicySpec::mlp(4, 2, &[8], Activation::Tanh),
            segment_len: 8,
            hyper: HyperParams { batch_segments: 4, ppo_minibatches: 1, ..HyperParams::default() },
            seed: 1,
        }
    }

    /// Issue 15: specs written before the conv torso existed still parse, without one.
    #[test]
    fn a_spec_written_before_conv_torsos_existed_parses_without_one() {
        let mut json = serde_json::to_value(small_spec()).expect("serializes");
        assert!(json["policy"]["conv"].is_null());
        json["policy"].as_object_mut().expect("policy is an object").remove("conv");
        let parsed: RunSpec = serde_json::from_value(json).expect("old specs still parse");
        assert_eq!(parsed, small_spec());
    }

    #[test]
    fn a_spec_written_before_selection_existed_parses_with_the_default() {
        let mut json = serde_json::to_value(small_spec()).expect("serializes");
        json["hyper"].as_object_mut().expect("hyper is an object").remove("selection");
        let parsed: RunSpec = serde_json::from_value(json).expect("old specs still parse");
        assert_eq!(parsed.hyper.selection, SelectionConfig::default());
        assert!(parsed.hyper.selection.guard.enabled, "the guard is on by default");
        assert!(parsed.hyper.selection.zero_variance.is_none() && parsed.hyper.selection.priority.is_none());
        assert_eq!(parsed, small_spec());
    }

    #[test]
    fn partial_selection_configs_fill_in_defaults() {
        let mut json = serde_json::to_value(small_spec()).expect("serializes");
        json["hyper"]["selection"] = serde_json::json!({ "priority": { "alpha": 1.0 } });
        let parsed: RunSpec = serde_json::from_value(json).expect("parses");
        let priority = parsed.hyper.selection.priority.expect("priority on");
        assert_eq!(priority, PriorityConfig { alpha: 1.0, ..PriorityConfig::default() });
        assert_eq!(parsed.hyper.selection.guard, GuardConfig::default());
    }

    #[test]
    fn pool_segments_is_the_batch_unless_priority_sampling_is_on() {
        let mut selection = SelectionConfig::default();
        assert_eq!(selection.pool_segments(8), 8);
        selection.priority = Some(PriorityConfig { pool_factor: 3, ..PriorityConfig::default() });
        assert_eq!(selection.pool_segments(8), 24);
    }

    #[test]
    fn invalid_selection_parameters_are_refused_by_name() {
        type Breaker = fn(&mut SelectionConfig);
        let cases: [(&str, Breaker); 7] = [
            ("selection.guard.max_abs_reward", |s| s.guard.max_abs_reward = Some(f32::INFINITY)),
            ("selection.zero_variance.min_group", |s| {
                s.zero_variance = Some(ZeroVarianceConfig { min_group: 1, ..ZeroVarianceConfig::default() })
            }),
            ("selection.zero_variance.tolerance", |s| {
                s.zero_variance = Some(ZeroVarianceConfig { tolerance: -1.0, ..ZeroVarianceConfig::default() })
            }),
            ("selection.priority.pool_factor", |s| {
                s.priority = Some(PriorityConfig { pool_factor: 0, ..PriorityConfig::default() })
            }),
            ("selection.priority.alpha", |s| {
                s.priority = Some(PriorityConfig { alpha: f32::NAN, ..PriorityConfig::default() })
            }),
            ("selection.priority.beta", |s| {
                s.priority = Some(PriorityConfig { beta: 1.5, ..PriorityConfig::default() })
            }),
            ("selection.priority.epsilon", |s| {
                s.priority = Some(PriorityConfig { epsilon: 0.0, ..PriorityConfig::default() })
            }),
        ];
        for (name, break_it) in cases {
            let mut bad = small_spec();
            break_it(&mut bad.hyper.selection);
            match bad.validate() {
                Err(SpecError::Hyper { name: got, .. }) => assert_eq!(got, name),
                other => panic!("{name}: expected a hyper-parameter error, got {other:?}"),
            }
        }
        let mut good = small_spec();
        good.hyper.selection = SelectionConfig {
            guard: GuardConfig { enabled: true, max_abs_reward: Some(100.0) },
            zero_variance: Some(ZeroVarianceConfig::default()),
            priority: Some(PriorityConfig::default()),
        };
        good.validate().expect("every filter on with valid parameters");
    }
}
