//! `volley-policy`: the policy network's CPU math, its action distributions and the return
//! estimators (V-trace, GAE), shared by actors (inference) and the learner's CPU backend.
//! No I/O, no knowledge of transports or environments.
//!
//! The policy network: its spec, the flat parameter layout, initialisation and the CPU math.
//!
//! One actor-critic network (as in cleanrl's `ppo.py` `Agent` and IMPALA, Espeholt et al. 2018):
//!
//! ```text
//! obs ─► [conv: (Conv2d ─► ReLU) × n] ─► torso: (Linear ─► activation) × torso.len() ─► [GRU core] ─┬─► policy head: Linear ─► logits [A]
//!                                                                                                  └─► value head:  Linear ─► value  [1]
//! ```
//!
//! * The optional conv torso ([`ConvSpec`], module `conv`) reads the observation as an image
//!   `[C][H][W]` and is lowered to im2col + the same GEMM as the dense layers.
//! * The torso may be empty, in which case the observation feeds the core (or the heads) directly.
//! * The optional GRU core ([`CoreKind::Gru`]) is the standard GRU (Cho et al. 2014) with PyTorch's
//!   gate convention (see [`ParamLayout`] for the equations).
//! * All parameters live in one flat `f32` buffer described by [`ParamLayout`]; weights are
//!   row-major `[out][in]` (PyTorch's `nn.Linear` convention), so a layer computes `Y = X Wᵀ + b`.
//!
//! Two entry points run the network:
//!
//! * [`PolicyInference`] — batched one-step inference for actors (reusable workspace, no
//!   allocation of its own per call).
//! * [`PolicyTape`] — forward over a time-major `[T][B]` sequence that records activations,
//!   and backward through time (BPTT) for the learner's CPU backend.
//!
//! Every matrix product goes through `matrixmultiply::sgemm` with strides, so transposes are
//! free; element-wise work (bias + activation, GRU gates) happens in fused loops over contiguous
//! slices that LLVM vectorises. `tanh` uses a branch-free rational approximation
//! (see `fast_tanh` in `linalg.rs`) shared by inference and training, so actors and the
//! learner compute exactly the same function.
//!
//! Invariant: parameters are only ever addressed through [`ParamLayout`] offsets; the layout's
//! [`hash`](ParamLayout::hash) changes whenever the meaning of any offset changes.
//!
//! Start reading at [`PolicySpec`], then [`ParamLayout`], then [`PolicyTape::forward`].
#![warn(missing_docs)]

mod conv;
pub mod distributions;
pub mod gaussian;
mod gru;
pub mod head;
mod inference;
mod init;
mod layout;
mod linalg;
pub mod obs_norm;
pub mod returns;
mod tape;

pub use conv::{ConvGeometry, ConvInput, ConvLayerSpec, ConvSpec, MAX_CONV_LAYERS};
pub use inference::{ObsRows, PolicyInference};
pub use layout::{ParamEntry, ParamLayout};
pub use tape::PolicyTape;

/// The CPU math primitives behind [`PolicyTape`] and [`PolicyInference`]: a checked `sgemm`,
/// fused bias + activation, their backward passes and the GRU cell. The learner's CPU backend
/// (`volley_learner::backend::cpu`) runs its layers on these, so actors and learner compute the
/// same function.
pub mod ops {
    pub use super::conv::{byte_table, col2im, im2col, im2col_u8, im2col_u8_scaled};
    pub use super::gru::{cell_backward as gru_cell_backward, cell_forward as gru_cell_forward};
    pub use super::linalg::{
        act_backward_in_place, bias_act_rows, bias_rows, column_sums, dense_forward, fast_sigmoid, fast_tanh, gemm,
        small_chain_fits, small_dense_chain_forward, Mat, SmallLayer, SMALL_BATCH_MAX_IN, SMALL_BATCH_ROWS,
    };
}

use serde::{Deserialize, Serialize};

/// Largest accepted `obs_dim`, `n_actions`, torso width or GRU hidden size.
///
/// Anything larger is almost certainly a unit or parsing mistake, and would make the per-layer
/// matrices (`width²` floats) unreasonably large for a CPU actor.
pub const MAX_LAYER_WIDTH: usize = 1 << 16;

/// Largest accepted number of torso layers.
pub const MAX_TORSO_LAYERS: usize = 64;

/// Largest accepted total parameter count (2²⁸ floats = 1 GiB).
pub const MAX_PARAMS: usize = 1 << 28;

/// Element-wise non-linearity applied after each torso layer.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Activation {
    /// Hyperbolic tangent (cleanrl's default for classic-control PPO).
    Tanh,
    /// Rectified linear unit, `max(x, 0)`.
    Relu,
}

impl Activation {
    /// The lowercase name used in specs and in the layout hash.
    pub fn name(self) -> &'static str {
        match self {
            Activation::Tanh => "tanh",
            Activation::Relu => "relu",
        }
    }
}

/// What sits between the torso and the heads.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum CoreKind {
    /// Nothing: the heads read the torso output directly (a feed-forward policy).
    Mlp,
    /// A single-layer GRU (Cho et al. 2014) with `hidden` units after the torso; the heads read
    /// its new hidden state.
    Gru {
        /// Number of GRU units (the recurrent state size per agent).
        hidden: usize,
    },
}

/// The policy head's distribution over actions.
///
/// In JSON: `"categorical"` for discrete actions, `{"gaussian":{"squash":false}}` for
/// continuous ones; specs written before continuous actions existed have no `head` field and
/// are categorical. (Externally tagged, so bincode can encode a [`PolicySpec`] too.)
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum ActionHead {
    /// A categorical distribution over `n_actions` logits.
    #[default]
    Categorical,
    /// A diagonal Gaussian over `n_actions` values ([`gaussian`]): the head outputs the means,
    /// and a state-independent log-std vector (`policy.log_std` in the [`ParamLayout`]) gives
    /// the standard deviations.
    Gaussian {
        /// Squash samples through `tanh` into `(−1, 1)` (the actor rescales them to the action
        /// box), with the change-of-variables correction in the log-density.
        squash: bool,
    },
}

impl ActionHead {
    /// Whether actions are continuous.
    pub fn is_continuous(&self) -> bool {
        matches!(self, ActionHead::Gaussian { .. })
    }

    /// Floats per recorded action for a head of `n_actions` outputs: 1 (the index's bit
    /// pattern) for a categorical head, `n_actions` values for a Gaussian one.
    pub fn action_width(&self, n_actions: usize) -> usize {
        match self {
            ActionHead::Categorical => 1,
            ActionHead::Gaussian { .. } => n_actions,
        }
    }

    /// The head's own parameters (outside the output layer): none for a categorical head, the
    /// `n_actions` log-stds of a Gaussian one (`policy.log_std` in the [`ParamLayout`]).
    pub fn n_params(&self, n_actions: usize) -> usize {
        match self {
            ActionHead::Categorical => 0,
            ActionHead::Gaussian { .. } => n_actions,
        }
    }
}

/// The architecture of a policy network; see the [module docs](self) for the picture.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct PolicySpec {
    /// Length of one flat observation vector.
    pub obs_dim: usize,
    /// Number of discrete actions (the length of the logits vector), or for a Gaussian head
    /// the number of values of one continuous action.
    pub n_actions: usize,
    /// Output width of each torso layer, input side first; may be empty.
    pub torso: Vec<usize>,
    /// Non-linearity after every torso layer.
    pub activation: Activation,
    /// Optional recurrent core between torso and heads.
    pub core: CoreKind,
    /// The action distribution (categorical unless the spec says otherwise).
    #[serde(default)]
    pub head: ActionHead,
    /// Optional convolutional torso in front of the dense torso (image observations); absent in
    /// specs written before it existed.
    #[serde(default)]
    pub conv: Option<ConvSpec>,
    /// Normalise observations by running statistics that live in the parameter buffer
    /// ([`obs_norm`]), so every weights version carries the statistics its policy was trained
    /// with. Off in specs written before it existed.
    #[serde(default)]
    pub normalize_obs: bool,
    /// Hidden widths of a separate value network (CleanRL's and SB3's MuJoCo critic): a dense
    /// stack with the torso's activation that reads the observations (normalised with
    /// `normalize_obs`) and feeds the value head, so the value loss no longer shapes the
    /// policy's features. Empty (the default, and specs written before it existed): the value
    /// head reads the policy torso's features. Needs the MLP core and no conv torso.
    #[serde(default)]
    pub critic: Vec<usize>,
}

impl PolicySpec {
    /// A feed-forward spec: `obs_dim → torso… → heads`.
    pub fn mlp(obs_dim: usize, n_actions: usize, torso: &[usize], activation: Activation) -> Self {
        PolicySpec {
            obs_dim,
            n_actions,
            torso: torso.to_vec(),
            activation,
            core: CoreKind::Mlp,
            head: ActionHead::Categorical,
            conv: None,
            normalize_obs: false,
            critic: Vec::new(),
        }
    }

    /// This spec with action head `head`.
    pub fn with_head(mut self, head: ActionHead) -> Self {
        self.head = head;
        self
    }

    /// This spec with a separate value network of these hidden widths (empty: the value head
    /// shares the torso).
    pub fn with_critic(mut self, widths: &[usize]) -> Self {
        self.critic = widths.to_vec();
        self
    }

    /// This spec with observation normalisation on or off.
    pub fn with_obs_normalization(mut self, on: bool) -> Self {
        self.normalize_obs = on;
        self
    }

    /// A recurrent spec: `obs_dim → torso… → GRU(hidden) → heads`.
    pub fn gru(obs_dim: usize, n_actions: usize, torso: &[usize], activation: Activation, hidden: usize) -> Self {
        PolicySpec {
            obs_dim,
            n_actions,
            torso: torso.to_vec(),
            activation,
            core: CoreKind::Gru { hidden },
            head: ActionHead::Categorical,
            conv: None,
            normalize_obs: false,
            critic: Vec::new(),
        }
    }

    /// This spec with a convolutional torso in front of its dense torso; `obs_dim` becomes the
    /// image's `C·H·W`.
    pub fn with_conv(mut self, conv: ConvSpec) -> Self {
        self.obs_dim = conv.input_dim();
        self.conv = Some(conv);
        self
    }
}

/// Why a policy spec, or the buffers handed to the policy math, are invalid.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PolicyError {
    /// A size in the spec is zero or absurdly large.
    #[error("invalid policy spec: {field} = {value}, must be {rule}")]
    InvalidSpec {
        /// The offending field, e.g. `"obs_dim"` or `"torso[1]"`.
        field: String,
        /// Its value.
        value: usize,
        /// What it must satisfy.
        rule: &'static str,
    },
    /// The spec is valid field by field but has too many parameters in total.
    #[error("invalid policy spec: {n_params} parameters exceed the limit of {max}")]
    TooManyParams {
        /// Parameter count of the spec (saturated at `u64::MAX`).
        n_params: u64,
        /// [`MAX_PARAMS`].
        max: usize,
    },
    /// A buffer has the wrong length for the layout and batch.
    #[error("{field}: expected {expected} elements, got {got}")]
    Shape {
        /// The argument, e.g. `"obs"` or `"params"`.
        field: &'static str,
        /// Length implied by the layout and batch sizes.
        expected: usize,
        /// Length passed.
        got: usize,
    },
    /// A batch or sequence size is out of range.
    #[error("{field} = {value} out of range, must be {rule}")]
    BatchSize {
        /// The argument, e.g. `"n"`, `"t_len"` or `"b_len"`.
        field: &'static str,
        /// Its value.
        value: usize,
        /// What it must satisfy.
        rule: String,
    },
    /// [`PolicyTape::backward`] was called before any [`PolicyTape::forward`].
    #[error("backward called before forward")]
    BackwardBeforeForward,
}
