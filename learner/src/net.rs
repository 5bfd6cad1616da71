//! The policy network's forward over a time-major sequence and its backward through time,
//! written once over [`Backend`] operations (so the CPU and CUDA backends run the same steps).
//!
//! ```text
//! obs ─► [conv: (im2col ─► dense ─► ReLU) × n] ─► torso: (dense ─► activation) × n ─► [GRU over time] ─► heads: dense ─► [logits | value]
//! ```
//!
//! With a separate value network (`PolicySpec::critic`) the value column comes from its own
//! stack instead, and the two heads' outputs are joined into the same `[logits | value]` block:
//!
//! ```text
//! obs ─► torso: (dense ─► activation) × n ─► policy head: dense ─► logits ─┐
//! obs ─► critic: (dense ─► activation) × m ─► value head: dense ─► value ──┴─► [logits | value]
//! ```
//!
//! A conv layer is an `im2col` unfolding followed by the dense product over all `T·B·OH·OW`
//! output positions (`volley_policy`'s `conv.rs` has the layouts); its backward is the two dense
//! gradient products over the same unfolding and `col2im`. The forward's unfoldings are kept
//! for the backward, from the last conv layer towards the first, as far as
//! [`KEPT_UNFOLDINGS_BYTES`] allows; the others are recomputed.
//!
//! Work is batched as widely as the data dependencies allow: the torso, the GRU's input
//! projection and the heads each run as one product over all `T·B` rows; only the GRU's
//! hidden-to-hidden product runs per time step. Backward mirrors this, so each weight gradient
//! is one `T·B`-deep product. This is the same computation as `volley_policy::PolicyTape`
//! (the tests below check it to rounding).
//!
//! Image observations may arrive as bytes ([`Input::U8`]): the first conv layer unfolds them
//! with [`Backend::im2col_u8`] (forward, and again in backward for its weight gradient), and a
//! dense first layer reads them widened by [`Backend::widen_u8`] into a buffer kept for the
//! backward. The input has no gradient, so nothing flows back into the bytes.
//!
//! A new layer is composed here: its forward records what its backward needs in buffers of this
//! struct, and its backward runs between its neighbours' (see [`crate::backend`]).

use std::ops::Range;

use volley_policy::{Activation, ConvGeometry, CoreKind, ParamLayout};

use crate::backend::{
    Backend, BackendError, Col2im, CopyColumns, DenseForward, GruCarryGrad, GruCellBackward, GruCellForward,
    GruResetCopy, Im2col, Im2colU8, MatmulDw, MatmulDx, TakeColumn, View, ViewMut, WidenU8,
};
pub use crate::batch::StateRestore;

/// Where one dense layer's parameters sit in the flat buffer.
#[derive(Debug, Clone)]
struct Dense {
    weight: Range<usize>,
    bias: Range<usize>,
    n_in: usize,
    n_out: usize,
}

impl Dense {
    /// `y = act(x · Wᵀ + b)` over `rows` rows of `x`.
    fn forward<B: Backend>(
        &self,
        backend: &mut B,
        params: &B::Floats,
        rows: usize,
        x: View<'_, B>,
        act: Option<Activation>,
        y: ViewMut<'_, B>,
    ) -> Result<(), BackendError> {
        let (weight, bias) = (View::range(params, self.weight.clone()), View::range(params, self.bias.clone()));
        backend.dense_forward(DenseForward { x, rows, n_in: self.n_in, weight, bias, n_out: self.n_out, act, y })
    }

    /// The weight and bias gradients from `rows` rows of `dy = ∂L/∂(pre-activation)` and the
    /// layer's input `x`, written into their ranges of `grads`.
    fn param_grads<B: Backend>(
        &self,
        backend: &mut B,
        dy: View<'_, B>,
        x: View<'_, B>,
        rows: usize,
        grads: &mut B::Floats,
    ) -> Result<(), BackendError> {
        let (n_out, n_in) = (self.n_out, self.n_in);
        backend.matmul_dw(MatmulDw { dy, x, rows, n_out, n_in, dw: ViewMut::range(grads, self.weight.clone()) })?;
        backend.column_sums(dy, rows, ViewMut::range(grads, self.bias.clone()))
    }

    /// `dx = dy · W` over `rows` rows (added to `dx` when `accumulate`).
    fn input_grad<B: Backend>(
        &self,
        backend: &mut B,
        params: &B::Floats,
        dy: View<'_, B>,
        rows: usize,
        dx: ViewMut<'_, B>,
        accumulate: bool,
    ) -> Result<(), BackendError> {
        let weight = View::range(params, self.weight.clone());
        backend.matmul_dx(MatmulDx { dy, rows, n_out: self.n_out, weight, n_in: self.n_in, dx, accumulate })
    }
}

/// Bytes of conv unfoldings a network keeps from its forward for its backward's weight
/// gradients instead of unfolding again (issue 44: the second `im2col` of every layer was 10 %
/// of the Nature-DQN update). Layers are kept from the last towards the first, whose unfolding is
/// the largest and the cheapest to redo per byte: for Nature-DQN over `T·B` = 21·8 images all
/// three (116 MB), over 21·32 the last two (187 MB; the first's 275 MB is recomputed).
pub const KEPT_UNFOLDINGS_BYTES: usize = 256 << 20;

/// One conv layer: its product over the unfolding (`[OC][C·K·K]` and `[OC]`, read by every
/// output position), and its geometry.
#[derive(Debug, Clone)]
struct ConvLayer {
    dense: Dense,
    geometry: ConvGeometry,
}

/// The GRU core: its input projection (`[3H][n_in]`) and hidden projection (`[3H][H]`).
#[derive(Debug, Clone)]
struct GruLayer {
    input_proj: Dense,
    hidden_proj: Dense,
    hidden: usize,
}

/// The network's shape, read from the public layout entries.
#[derive(Debug, Clone)]
struct Shape {
    obs_dim: usize,
    n_actions: usize,
    conv: Vec<ConvLayer>,
    torso: Vec<Dense>,
    gru: Option<GruLayer>,
    /// Policy and value heads fused: `[A + 1][F']`, bias `[A + 1]`; with a separate value
    /// network, the policy head alone: `[A][F']`.
    heads: Dense,
    /// The separate value network's layers (empty without one).
    critic: Vec<Dense>,
    /// The value head over the separate value network, `[1][C]` (`None`: fused into `heads`).
    value: Option<Dense>,
    activation: Activation,
}

impl Shape {
    fn new(layout: &ParamLayout) -> Self {
        let spec = layout.spec();
        // A validated layout always has these entries (ParamLayout::new builds them).
        let entry = |name: &str| layout.entry(name).unwrap_or_else(|| panic!("layout has no `{name}` entry")).range();
        let dense =
            |weight: &str, bias: &str, n_in, n_out| Dense { weight: entry(weight), bias: entry(bias), n_in, n_out };
        let conv: Vec<ConvLayer> = layout
            .conv_geometries()
            .iter()
            .enumerate()
            .map(|(i, &geometry)| ConvLayer {
                dense: dense(
                    &format!("conv.{i}.weight"),
                    &format!("conv.{i}.bias"),
                    geometry.patch_len(),
                    geometry.out_channels,
                ),
                geometry,
            })
            .collect();
        // The layers `{name}.{i}.*` of a dense stack of `widths` over `n_in` inputs.
        let stack = |name: &str, widths: &[usize], mut n_in: usize| -> Vec<Dense> {
            let layer = |(i, &n_out): (usize, &usize)| {
                let layer = dense(&format!("{name}.{i}.weight"), &format!("{name}.{i}.bias"), n_in, n_out);
                n_in = n_out;
                layer
            };
            widths.iter().enumerate().map(layer).collect()
        };
        let torso_in = conv.last().map_or(spec.obs_dim, |layer| layer.geometry.output_len());
        let torso = stack("torso", &spec.torso, torso_in);
        let n_in = torso.last().map_or(torso_in, |d| d.n_out);
        let gru = match spec.core {
            CoreKind::Mlp => None,
            CoreKind::Gru { hidden } => Some(GruLayer {
                input_proj: dense("gru.weight_ih", "gru.bias_ih", n_in, 3 * hidden),
                hidden_proj: dense("gru.weight_hh", "gru.bias_hh", hidden, 3 * hidden),
                hidden,
            }),
        };
        let features = gru.as_ref().map_or(n_in, |g| g.hidden);
        let critic = stack("critic", &spec.critic, spec.obs_dim);
        let critic_in = critic.last().map_or(spec.obs_dim, |d| d.n_out);
        let (heads, value) = if critic.is_empty() {
            let n_out = spec.n_actions + 1;
            // The layout keeps the value head's rows right after the policy head's (its
            // fused-head invariant), so the two form one `[A + 1][F']` matrix and one `[A + 1]`
            // bias.
            let weight = entry("policy.weight");
            let bias = entry("policy.bias");
            let heads = Dense {
                weight: weight.start..weight.start + n_out * features,
                bias: bias.start..bias.start + n_out,
                n_in: features,
                n_out,
            };
            (heads, None)
        } else {
            let heads = dense("policy.weight", "policy.bias", features, spec.n_actions);
            (heads, Some(dense("value.weight", "value.bias", critic_in, 1)))
        };
        Shape {
            obs_dim: spec.obs_dim,
            n_actions: spec.n_actions,
            conv,
            torso,
            gru,
            heads,
            critic,
            value,
            activation: spec.activation,
        }
    }

    fn widest(&self) -> usize {
        let conv = self.conv.iter().map(|layer| layer.geometry.output_len()).max().unwrap_or(0);
        let dense = self.torso.iter().chain(&self.critic).map(|d| d.n_out).max().unwrap_or(0);
        dense.max(self.heads.n_in).max(self.obs_dim).max(conv)
    }

    /// The width the dense torso reads: the last conv layer's `OH·OW·OC`, else `obs_dim`.
    fn conv_width(&self) -> usize {
        self.conv.last().map_or(self.obs_dim, |layer| layer.geometry.output_len())
    }

    /// The first conv layer whose unfolding over `rows` images is kept from the forward for the
    /// backward (it and every later one are; `self.conv.len()` for none): layers from the last
    /// towards the first while their unfoldings total at most `budget_bytes`.
    fn first_kept_unfolding(&self, rows: usize, budget_bytes: usize) -> usize {
        let mut total_bytes = 0usize;
        for (i, layer) in self.conv.iter().enumerate().rev() {
            total_bytes += rows * layer.geometry.cols_len() * std::mem::size_of::<f32>();
            if total_bytes > budget_bytes {
                return i + 1;
            }
        }
        0
    }

    /// The floats the shared unfolding scratch needs per image: the unfoldings of the layers
    /// before `first_kept` and the unfolding gradients of every layer but the first.
    fn scratch_cols(&self, first_kept: usize) -> usize {
        let layers = self.conv.iter().enumerate();
        layers.filter(|&(i, _)| i < first_kept || i > 0).map(|(_, layer)| layer.geometry.cols_len()).max().unwrap_or(0)
    }
}

/// The observations a forward (and the backward after it) reads.
pub enum Input<'a, B: Backend> {
    /// `[rows][obs_dim]` floats, as the first layer reads them (already scaled or normalised).
    F32(View<'a, B>),
    /// `[rows][packed_words(obs_dim)]`: image observations packed four bytes to a word
    /// ([`crate::backend::pack_byte_rows`]); the first layer reads byte `v` as
    /// `f32::from(v) · scale`.
    U8 {
        /// The packed rows.
        packed: View<'a, B>,
        /// The factor every value is read with (`ParamLayout::input_scale`).
        scale: f32,
    },
}

impl<B: Backend> Clone for Input<'_, B> {
    fn clone(&self) -> Self {
        *self
    }
}

impl<B: Backend> Copy for Input<'_, B> {}

/// The steps of a sequence whose entering recurrent state is a restored one rather than zero:
/// an episode resumed from a saved state mid-sequence, or the start of a stitched window's data
/// after padding ([`crate::batch::SegmentBatch`]). The caller sets `starts` at every restored
/// step, so backward treats the restored state as a constant (no gradient flows across it).
pub struct Restores<'a, B: Backend> {
    /// Sorted by `t`: the state entering step `t` of column `b` is row `state` of `states`.
    pub steps: &'a [StateRestore],
    /// `[n][H]`: the restored states.
    pub states: View<'a, B>,
}

impl<'a, B: Backend> From<View<'a, B>> for Input<'a, B> {
    fn from(obs: View<'a, B>) -> Self {
        Input::F32(obs)
    }
}

/// Grow `buffer` to at least `len` floats (never shrinks; a smaller call reuses it).
pub(crate) fn ensure<B: Backend>(backend: &mut B, buffer: &mut B::Floats, len: usize) -> Result<(), BackendError> {
    if B::len(buffer) < len {
        *buffer = backend.alloc(len)?;
    }
    Ok(())
}

/// The network over one backend: its shape, the activations of the last forward, and the
/// backward's scratch. Buffers grow to the largest `T·B` seen and are reused.
pub struct Network<B: Backend> {
    shape: Shape,
    t_len: usize,
    b_len: usize,
    /// Post-ReLU output of each conv layer, `[T·B][OH·OW·OC]` (channel-last).
    conv_out: Vec<B::Floats>,
    /// The unfolding of each conv layer kept from the forward for the backward,
    /// `[T·B·OH·OW][C·K·K]` (empty for a layer whose unfolding is recomputed).
    kept_cols: Vec<B::Floats>,
    /// Scratch for the unfolding of a layer that is not kept, and for any layer's unfolding
    /// gradient in the backward.
    scratch_cols: B::Floats,
    /// [`KEPT_UNFOLDINGS_BYTES`] (tests change it to exercise both paths).
    kept_unfoldings_bytes: usize,
    /// Post-activation output of each torso layer, `[T·B][width]`.
    torso_out: Vec<B::Floats>,
    /// GRU records, `[T·B][3H]`: input projection, hidden projection, gates `[r, z, n]`.
    gru_input_proj: B::Floats,
    gru_hidden_proj: B::Floats,
    gru_gates: B::Floats,
    /// GRU state entering each step (after resets) and leaving it, `[T·B][H]`.
    gru_h_prev: B::Floats,
    gru_h_out: B::Floats,
    /// The fused heads `[T·B][A + 1]` and their value column `[T·B]`.
    heads_out: B::Floats,
    values: B::Floats,
    /// With a separate value network: its layers' post-activation outputs, `[T·B][critic[i]]`;
    /// the policy head's own output `[T·B][A]` (forward) and its gradient (backward); and the
    /// value column's gradient `[T·B]`.
    critic_out: Vec<B::Floats>,
    policy_head: B::Floats,
    d_values: B::Floats,
    /// Backward scratch: `∂L/∂(layer output)` for two layers in turn, and the GRU's gradients.
    d_features: [B::Floats; 2],
    d_gru_input_proj: B::Floats,
    d_gru_hidden_proj: B::Floats,
    d_gru_h: B::Floats,
    /// Byte observations widened for a dense first layer, `[T·B][obs_dim]` (kept from the
    /// forward for the backward's weight gradient).
    widened_obs: B::Floats,
}

impl<B: Backend> Network<B> {
    /// A network for `layout` whose buffers are sized by the first forward.
    pub fn new(backend: &mut B, layout: &ParamLayout) -> Result<Self, BackendError> {
        let shape = Shape::new(layout);
        let mut empty = || backend.alloc(0);
        Ok(Network {
            conv_out: shape.conv.iter().map(|_| empty()).collect::<Result<_, _>>()?,
            kept_cols: shape.conv.iter().map(|_| empty()).collect::<Result<_, _>>()?,
            scratch_cols: empty()?,
            kept_unfoldings_bytes: KEPT_UNFOLDINGS_BYTES,
            torso_out: shape.torso.iter().map(|_| empty()).collect::<Result<_, _>>()?,
            gru_input_proj: empty()?,
            gru_hidden_proj: empty()?,
            gru_gates: empty()?,
            gru_h_prev: empty()?,
            gru_h_out: empty()?,
            heads_out: empty()?,
            values: empty()?,
            critic_out: shape.critic.iter().map(|_| empty()).collect::<Result<_, _>>()?,
            policy_head: empty()?,
            d_values: empty()?,
            d_features: [empty()?, empty()?],
            d_gru_input_proj: empty()?,
            d_gru_hidden_proj: empty()?,
            d_gru_h: empty()?,
            widened_obs: empty()?,
            shape,
            t_len: 0,
            b_len: 0,
        })
    }

    /// This network keeping at most `bytes` of conv unfoldings for the backward (tests: 0
    /// recomputes every one, as before issue 44).
    #[cfg(test)]
    pub(crate) fn with_kept_unfoldings_bytes(mut self, bytes: usize) -> Self {
        self.kept_unfoldings_bytes = bytes;
        self
    }

    /// The number of actions.
    pub fn n_actions(&self) -> usize {
        self.shape.n_actions
    }

    /// The observation width.
    pub fn obs_dim(&self) -> usize {
        self.shape.obs_dim
    }

    /// The recurrent state width (0 without a GRU).
    pub fn hidden(&self) -> usize {
        self.shape.gru.as_ref().map_or(0, |g| g.hidden)
    }

    /// The heads block of the last forward, `[T·B][A + 1]` (logits, then the value).
    pub fn heads(&self) -> View<'_, B> {
        View::range(&self.heads_out, 0..self.t_len * self.b_len * (self.shape.n_actions + 1))
    }

    /// The values of the last forward, `[T·B]`.
    pub fn values(&self) -> View<'_, B> {
        View::range(&self.values, 0..self.t_len * self.b_len)
    }

    /// Run the network over a time-major `[t_len][b_len]` sequence and record what backward
    /// needs: `obs: [T][B][obs_dim]` (floats, a [`View`], or either kind of [`Input`]),
    /// `starts: [T][B]` (non-zero zeroes the recurrent state before that step), `h0: [B][H]`,
    /// and the steps that start from a restored state instead ([`Restores`]; `None` for none).
    #[allow(clippy::too_many_arguments)]
    pub fn forward<'a>(
        &mut self,
        backend: &mut B,
        params: &B::Floats,
        obs: impl Into<Input<'a, B>>,
        starts: View<'_, B>,
        h0: View<'_, B>,
        restores: Option<Restores<'_, B>>,
        t_len: usize,
        b_len: usize,
    ) -> Result<(), BackendError>
    where
        B::Floats: 'a,
    {
        let Restores { steps: restores, states: restore_states } =
            restores.unwrap_or(Restores { steps: &[], states: h0.slice(0..0) });
        let input = obs.into();
        let hidden = self.hidden();
        if let Some(bad) =
            restores.iter().find(|r| r.t >= t_len || r.b >= b_len || (r.state + 1) * hidden > restore_states.len())
        {
            return Err(BackendError::Shape {
                op: "forward",
                operand: "restore (step, column or state row out of range; `got` is its step)",
                expected: t_len,
                got: bad.t,
            });
        }
        if !restores.is_sorted_by_key(|r| r.t) {
            return Err(BackendError::Shape {
                op: "forward",
                operand: "restores (not sorted by step)",
                expected: 0,
                got: 1,
            });
        }
        let rows = t_len * b_len;
        let shape = &self.shape;
        self.t_len = t_len;
        self.b_len = b_len;
        // Bytes for a dense first layer are widened once here; for a conv torso the first
        // unfolding reads them (`byte_scale`).
        if let (Input::U8 { packed, scale }, true) = (input, shape.conv.is_empty()) {
            let len = rows * shape.obs_dim;
            ensure(backend, &mut self.widened_obs, len)?;
            let out = ViewMut::range(&mut self.widened_obs, 0..len);
            backend.widen_u8(WidenU8 { x: packed, rows, width: shape.obs_dim, scale, out })?;
        }
        let (obs, byte_scale) = first_layer_input(input, shape, &self.widened_obs, rows);

        let first_kept = shape.first_kept_unfolding(rows, self.kept_unfoldings_bytes);
        if !shape.conv.is_empty() {
            ensure(backend, &mut self.scratch_cols, rows * shape.scratch_cols(first_kept))?;
        }
        for (i, layer) in shape.conv.iter().enumerate() {
            let geometry = &layer.geometry;
            let (before, rest) = self.conv_out.split_at_mut(i);
            let y = &mut rest[0];
            ensure(backend, y, rows * geometry.output_len())?;
            let x = if i == 0 { obs } else { View::range(&before[i - 1], 0..rows * geometry.input_len()) };
            let cols_len = rows * geometry.cols_len();
            let cols_buffer = if i >= first_kept { &mut self.kept_cols[i] } else { &mut self.scratch_cols };
            ensure(backend, cols_buffer, cols_len)?;
            let cols = ViewMut::range(cols_buffer, 0..cols_len);
            unfold(backend, x, rows, geometry, byte_scale.filter(|_| i == 0), cols)?;
            let (cols, y) = (View::range(cols_buffer, 0..cols_len), ViewMut::range(y, 0..rows * geometry.output_len()));
            layer.dense.forward(backend, params, rows * geometry.out_positions(), cols, Some(Activation::Relu), y)?;
        }
        let conv_features = match self.conv_out.last() {
            Some(out) => View::range(out, 0..rows * shape.conv_width()),
            None => obs,
        };

        dense_stack_forward(backend, params, &shape.torso, conv_features, rows, shape.activation, &mut self.torso_out)?;
        let torso_width = shape.torso.last().map_or(shape.conv_width(), |d| d.n_out);
        let torso_features = match self.torso_out.last() {
            Some(out) => View::range(out, 0..rows * torso_width),
            None => conv_features,
        };

        if let Some(gru) = &shape.gru {
            let hidden = gru.hidden;
            let (state, gates) = (b_len * hidden, b_len * 3 * hidden);
            for buffer in [&mut self.gru_input_proj, &mut self.gru_hidden_proj, &mut self.gru_gates] {
                ensure(backend, buffer, rows * 3 * hidden)?;
            }
            ensure(backend, &mut self.gru_h_prev, rows * hidden)?;
            ensure(backend, &mut self.gru_h_out, rows * hidden)?;
            // The input projection does not depend on h: one product for the whole sequence.
            let input_proj = ViewMut::range(&mut self.gru_input_proj, 0..rows * 3 * hidden);
            gru.input_proj.forward(backend, params, rows, torso_features, None, input_proj)?;
            let mut pending = restores.iter().peekable();
            for t in 0..t_len {
                let source = if t == 0 { h0 } else { View::range(&self.gru_h_out, (t - 1) * state..t * state) };
                let step_state = t * state..(t + 1) * state;
                let step_gates = t * gates..(t + 1) * gates;
                backend.gru_reset_copy(GruResetCopy {
                    src: source,
                    starts: starts.slice(t * b_len..(t + 1) * b_len),
                    hidden,
                    dst: ViewMut::range(&mut self.gru_h_prev, step_state.clone()),
                })?;
                while let Some(restore) = pending.next_if(|r| r.t == t) {
                    let row = step_state.start + restore.b * hidden;
                    backend.copy(
                        restore_states.slice(restore.state * hidden..(restore.state + 1) * hidden),
                        ViewMut::range(&mut self.gru_h_prev, row..row + hidden),
                    )?;
                }
                let h_prev = View::range(&self.gru_h_prev, step_state.clone());
                let hidden_proj = ViewMut::range(&mut self.gru_hidden_proj, step_gates.clone());
                gru.hidden_proj.forward(backend, params, b_len, h_prev, None, hidden_proj)?;
                backend.gru_cell_forward(GruCellForward {
                    gi: View::range(&self.gru_input_proj, step_gates.clone()),
                    gh: View::range(&self.gru_hidden_proj, step_gates.clone()),
                    h_prev,
                    hidden,
                    gates: ViewMut::range(&mut self.gru_gates, step_gates),
                    h_out: ViewMut::range(&mut self.gru_h_out, step_state),
                })?;
            }
        }

        let heads = &shape.heads;
        let n_actions = shape.n_actions;
        let width = n_actions + 1;
        ensure(backend, &mut self.heads_out, rows * width)?;
        ensure(backend, &mut self.values, rows)?;
        let features = match &shape.gru {
            Some(gru) => View::range(&self.gru_h_out, 0..rows * gru.hidden),
            None => torso_features,
        };
        let Some(value) = &shape.value else {
            heads.forward(
                backend,
                params,
                rows,
                features,
                None,
                ViewMut::range(&mut self.heads_out, 0..rows * width),
            )?;
            return backend.take_column(TakeColumn {
                src: View::range(&self.heads_out, 0..rows * width),
                rows,
                width,
                column: n_actions,
                dst: ViewMut::range(&mut self.values, 0..rows),
            });
        };
        // The separate value network reads the observations (no conv torso with one).
        dense_stack_forward(backend, params, &shape.critic, obs, rows, shape.activation, &mut self.critic_out)?;
        let critic_width = value.n_in;
        let critic_features =
            View::range(self.critic_out.last().expect("a value network has layers"), 0..rows * critic_width);
        value.forward(backend, params, rows, critic_features, None, ViewMut::range(&mut self.values, 0..rows))?;
        ensure(backend, &mut self.policy_head, rows * n_actions)?;
        let policy_head = ViewMut::range(&mut self.policy_head, 0..rows * n_actions);
        heads.forward(backend, params, rows, features, None, policy_head)?;
        let heads_out = ViewMut::range(&mut self.heads_out, 0..rows * width);
        let logits = View::range(&self.policy_head, 0..rows * n_actions);
        join_columns(backend, rows, [(logits, n_actions), (View::range(&self.values, 0..rows), 1)], heads_out)
    }

    /// [`forward`](Self::forward) over float observations, with the restores apart.
    #[allow(clippy::too_many_arguments)]
    pub fn forward_restoring(
        &mut self,
        backend: &mut B,
        params: &B::Floats,
        obs: View<'_, B>,
        starts: View<'_, B>,
        h0: View<'_, B>,
        restores: &[StateRestore],
        restore_states: View<'_, B>,
        t_len: usize,
        b_len: usize,
    ) -> Result<(), BackendError> {
        let restores = Some(Restores { steps: restores, states: restore_states });
        self.forward(backend, params, obs, starts, h0, restores, t_len, b_len)
    }

    /// Backprop `d_heads` (`∂L/∂[logits | value]`, `[T·B][A + 1]`) through the last forward and
    /// overwrite `grads` with `∂L/∂params`. `params`, `obs` and `starts` must be what the last
    /// forward ran with. No gradient flows into `h0`, nor across an episode start.
    pub fn backward<'a>(
        &mut self,
        backend: &mut B,
        params: &B::Floats,
        d_heads: View<'_, B>,
        obs: impl Into<Input<'a, B>>,
        starts: View<'_, B>,
        grads: &mut B::Floats,
    ) -> Result<(), BackendError>
    where
        B::Floats: 'a,
    {
        let (t_len, b_len) = (self.t_len, self.b_len);
        let rows = t_len * b_len;
        let shape = &self.shape;
        let (obs, byte_scale) = first_layer_input(obs.into(), shape, &self.widened_obs, rows);
        let conv_features = match self.conv_out.last() {
            Some(out) => View::range(out, 0..rows * shape.conv_width()),
            None => obs,
        };
        let torso_width = shape.torso.last().map_or(shape.conv_width(), |d| d.n_out);
        let torso_features = match self.torso_out.last() {
            Some(out) => View::range(out, 0..rows * torso_width),
            None => conv_features,
        };
        let features = match &shape.gru {
            Some(gru) => View::range(&self.gru_h_out, 0..rows * gru.hidden),
            None => torso_features,
        };

        let heads = &shape.heads;
        let widest = shape.widest();
        let [d_a, d_b] = &mut self.d_features;
        ensure(backend, d_a, rows * widest)?;
        ensure(backend, d_b, rows * widest)?;
        // `d_cur` always holds ∂L/∂(output of the layer being processed).
        let (mut d_cur, mut d_next) = (d_a, d_b);
        let d_policy_head = match &shape.value {
            None => d_heads,
            Some(value) => {
                // Split ∂L/∂[logits | value] into the two heads' gradients, then take the value
                // network's back to the observations.
                let n_actions = shape.n_actions;
                ensure(backend, &mut self.policy_head, rows * n_actions)?;
                ensure(backend, &mut self.d_values, rows)?;
                let split = [
                    (ViewMut::range(&mut self.policy_head, 0..rows * n_actions), n_actions),
                    (ViewMut::range(&mut self.d_values, 0..rows), 1),
                ];
                split_columns(backend, rows, d_heads, split)?;
                let d_values = View::range(&self.d_values, 0..rows);
                let critic_features =
                    View::range(self.critic_out.last().expect("a value network has layers"), 0..rows * value.n_in);
                value.param_grads(backend, d_values, critic_features, rows, grads)?;
                value.input_grad(
                    backend,
                    params,
                    d_values,
                    rows,
                    ViewMut::range(d_cur, 0..rows * value.n_in),
                    false,
                )?;
                let stack = (&shape.critic[..], &self.critic_out[..]);
                dense_stack_backward(
                    backend,
                    params,
                    stack,
                    obs,
                    rows,
                    shape.activation,
                    false,
                    [&mut d_cur, &mut d_next],
                    grads,
                )?;
                View::range(&self.policy_head, 0..rows * n_actions)
            }
        };
        heads.param_grads(backend, d_policy_head, features, rows, grads)?;
        // ∂L/∂features is only needed if something upstream has parameters.
        if shape.conv.is_empty() && shape.torso.is_empty() && shape.gru.is_none() {
            return Ok(());
        }
        heads.input_grad(backend, params, d_policy_head, rows, ViewMut::range(d_cur, 0..rows * heads.n_in), false)?;

        if let Some(gru) = &shape.gru {
            let hidden = gru.hidden;
            let (state, gates) = (b_len * hidden, b_len * 3 * hidden);
            ensure(backend, &mut self.d_gru_input_proj, rows * 3 * hidden)?;
            ensure(backend, &mut self.d_gru_hidden_proj, rows * 3 * hidden)?;
            ensure(backend, &mut self.d_gru_h, state)?;
            // `d_gru_h` carries ∂L/∂h_t backwards through time; nothing flows in after step T−1.
            for t in (0..t_len).rev() {
                let last = t + 1 == t_len;
                if last {
                    backend.fill(ViewMut::range(&mut self.d_gru_h, 0..state), 0.0)?;
                }
                // A reset at step t+1 replaced h_t with zeros there, so no gradient reaches it.
                let starts_next = (!last).then(|| starts.slice((t + 1) * b_len..(t + 2) * b_len));
                backend.gru_carry_grad(GruCarryGrad {
                    d_h: ViewMut::range(&mut self.d_gru_h, 0..state),
                    starts_next,
                    from_heads: View::range(d_cur, t * state..(t + 1) * state),
                    hidden,
                })?;
                let step_gates = t * gates..(t + 1) * gates;
                backend.gru_cell_backward(GruCellBackward {
                    d_h: ViewMut::range(&mut self.d_gru_h, 0..state),
                    gates: View::range(&self.gru_gates, step_gates.clone()),
                    gh: View::range(&self.gru_hidden_proj, step_gates.clone()),
                    h_prev: View::range(&self.gru_h_prev, t * state..(t + 1) * state),
                    hidden,
                    d_gi: ViewMut::range(&mut self.d_gru_input_proj, step_gates.clone()),
                    d_gh: ViewMut::range(&mut self.d_gru_hidden_proj, step_gates.clone()),
                })?;
                if t == 0 {
                    break; // no gradient into h0
                }
                let (d_hidden_proj, d_h) =
                    (View::range(&self.d_gru_hidden_proj, step_gates), ViewMut::range(&mut self.d_gru_h, 0..state));
                gru.hidden_proj.input_grad(backend, params, d_hidden_proj, b_len, d_h, true)?;
            }
            // Weight gradients summed over all steps: one T·B-deep product each.
            let d_input_proj = View::range(&self.d_gru_input_proj, 0..rows * 3 * hidden);
            let d_hidden_proj = View::range(&self.d_gru_hidden_proj, 0..rows * 3 * hidden);
            gru.input_proj.param_grads(backend, d_input_proj, torso_features, rows, grads)?;
            let h_prev = View::range(&self.gru_h_prev, 0..rows * hidden);
            gru.hidden_proj.param_grads(backend, d_hidden_proj, h_prev, rows, grads)?;
            if !shape.torso.is_empty() || !shape.conv.is_empty() {
                let d_torso = ViewMut::range(d_cur, 0..rows * gru.input_proj.n_in);
                gru.input_proj.input_grad(backend, params, d_input_proj, rows, d_torso, false)?;
            }
        }

        let (stack, into_conv) = ((&shape.torso[..], &self.torso_out[..]), !shape.conv.is_empty());
        let d = [&mut d_cur, &mut d_next];
        dense_stack_backward(backend, params, stack, conv_features, rows, shape.activation, into_conv, d, grads)?;

        let first_kept = shape.first_kept_unfolding(rows, self.kept_unfoldings_bytes);
        for (i, layer) in shape.conv.iter().enumerate().rev() {
            let geometry = &layer.geometry;
            let (positions, out_len, cols_len) =
                (rows * geometry.out_positions(), rows * geometry.output_len(), rows * geometry.cols_len());
            backend.act_backward(
                ViewMut::range(d_cur, 0..out_len),
                View::range(&self.conv_out[i], 0..out_len),
                Activation::Relu,
            )?;
            // The forward's unfolding where it was kept (`KEPT_UNFOLDINGS_BYTES`), else the
            // unfolding again: it is the largest activation of a conv torso (K² times its input
            // over the stride squared).
            let cols_buffer = if i >= first_kept {
                &self.kept_cols[i]
            } else {
                let x = if i == 0 { obs } else { View::range(&self.conv_out[i - 1], 0..rows * geometry.input_len()) };
                let cols = ViewMut::range(&mut self.scratch_cols, 0..cols_len);
                unfold(backend, x, rows, geometry, byte_scale.filter(|_| i == 0), cols)?;
                &self.scratch_cols
            };
            let d_pre = View::range(d_cur, 0..out_len);
            layer.dense.param_grads(backend, d_pre, View::range(cols_buffer, 0..cols_len), positions, grads)?;
            if i > 0 {
                let d_cols = ViewMut::range(&mut self.scratch_cols, 0..cols_len);
                layer.dense.input_grad(backend, params, d_pre, positions, d_cols, false)?;
                backend.col2im(Col2im {
                    d_cols: View::range(&self.scratch_cols, 0..cols_len),
                    n: rows,
                    geometry,
                    dx: ViewMut::range(d_next, 0..rows * geometry.input_len()),
                })?;
                std::mem::swap(&mut d_cur, &mut d_next);
            }
        }
        Ok(())
    }
}

/// Run a stack of dense layers with `act` over `rows` rows of `input`, writing each layer's
/// output (grown as needed) into `outs` for the backward.
fn dense_stack_forward<B: Backend>(
    backend: &mut B,
    params: &B::Floats,
    layers: &[Dense],
    input: View<'_, B>,
    rows: usize,
    act: Activation,
    outs: &mut [B::Floats],
) -> Result<(), BackendError> {
    for (i, layer) in layers.iter().enumerate() {
        let (before, rest) = outs.split_at_mut(i);
        let y = &mut rest[0];
        ensure(backend, y, rows * layer.n_out)?;
        let x = if i == 0 { input } else { View::range(&before[i - 1], 0..rows * layer.n_in) };
        layer.forward(backend, params, rows, x, Some(act), ViewMut::range(y, 0..rows * layer.n_out))?;
    }
    Ok(())
}

/// Backprop through a stack of dense layers (`layers` and the outputs their forward kept) from
/// `d_cur` = ∂L/∂(last layer's output), writing each layer's weight and bias gradients. The
/// stack's input gets its gradient in `d_cur` only when `input_grad` (a conv torso below);
/// `[d_cur, d_next]` are scratch as wide as the widest layer, and may swap.
#[allow(clippy::too_many_arguments)]
fn dense_stack_backward<B: Backend>(
    backend: &mut B,
    params: &B::Floats,
    (layers, outs): (&[Dense], &[B::Floats]),
    input: View<'_, B>,
    rows: usize,
    act: Activation,
    input_grad: bool,
    [d_cur, d_next]: [&mut &mut B::Floats; 2],
    grads: &mut B::Floats,
) -> Result<(), BackendError> {
    for (i, layer) in layers.iter().enumerate().rev() {
        let n = rows * layer.n_out;
        backend.act_backward(ViewMut::range(&mut **d_cur, 0..n), View::range(&outs[i], 0..n), act)?;
        let x = if i == 0 { input } else { View::range(&outs[i - 1], 0..rows * layer.n_in) };
        let d_pre = View::range(&**d_cur, 0..n);
        layer.param_grads(backend, d_pre, x, rows, grads)?;
        if i > 0 || input_grad {
            let d_input = ViewMut::range(&mut **d_next, 0..rows * layer.n_in);
            layer.input_grad(backend, params, d_pre, rows, d_input, false)?;
            std::mem::swap(d_cur, d_next);
        }
    }
    Ok(())
}

/// `out[r] = [parts[0][r] | parts[1][r] | …]`: row-major blocks of the given widths side by side.
fn join_columns<B: Backend, const N: usize>(
    backend: &mut B,
    rows: usize,
    parts: [(View<'_, B>, usize); N],
    mut out: ViewMut<'_, B>,
) -> Result<(), BackendError> {
    let dst_width = parts.iter().map(|&(_, width)| width).sum();
    let mut dst_column = 0;
    for (src, width) in parts {
        let dst = out.reborrow();
        backend.copy_columns(CopyColumns {
            src,
            src_width: width,
            src_column: 0,
            dst,
            dst_width,
            dst_column,
            columns: width,
            rows,
        })?;
        dst_column += width;
    }
    Ok(())
}

/// The inverse of [`join_columns`]: `parts[i][r]` = the `i`-th block of columns of `src[r]`.
fn split_columns<B: Backend, const N: usize>(
    backend: &mut B,
    rows: usize,
    src: View<'_, B>,
    parts: [(ViewMut<'_, B>, usize); N],
) -> Result<(), BackendError> {
    let src_width = parts.iter().map(|(_, width)| width).sum();
    let mut src_column = 0;
    for (dst, width) in parts {
        backend.copy_columns(CopyColumns {
            src,
            src_width,
            src_column,
            dst,
            dst_width: width,
            dst_column: 0,
            columns: width,
            rows,
        })?;
        src_column += width;
    }
    Ok(())
}

/// Unfold `n` images of `x` for a conv layer into `cols`: floats, or packed bytes read with
/// `byte_scale` (the first layer over byte observations).
fn unfold<B: Backend>(
    backend: &mut B,
    x: View<'_, B>,
    n: usize,
    geometry: &ConvGeometry,
    byte_scale: Option<f32>,
    cols: ViewMut<'_, B>,
) -> Result<(), BackendError> {
    match byte_scale {
        Some(scale) => backend.im2col_u8(Im2colU8 { x, n, geometry, scale, cols }),
        None => backend.im2col(Im2col { x, n, geometry, cols }),
    }
}

/// What the first layer reads: the floats (the caller's, or bytes widened into `widened` for a
/// dense first layer), or the packed bytes with their scale for a conv torso's first unfolding.
fn first_layer_input<'a, B: Backend>(
    input: Input<'a, B>,
    shape: &Shape,
    widened: &'a B::Floats,
    rows: usize,
) -> (View<'a, B>, Option<f32>) {
    match input {
        Input::F32(obs) => (obs, None),
        Input::U8 { packed, scale } if !shape.conv.is_empty() => (packed, Some(scale)),
        Input::U8 { .. } => (View::range(widened, 0..rows * shape.obs_dim), None),
    }
}

/// Random inputs and parameters for the network's tests.
#[cfg(test)]
mod test_data {
    use rand::Rng;
    use rand_pcg::Pcg64;
    use volley_policy::ParamLayout;

    /// `n` values uniform in `±scale`.
    pub(super) fn random(rng: &mut Pcg64, n: usize, scale: f32) -> Vec<f32> {
        (0..n).map(|_| rng.random_range(-scale..scale)).collect()
    }

    /// Parameters with signal on every path (scaled by fan-in), biases in ±0.5.
    pub(super) fn random_params(layout: &ParamLayout, rng: &mut Pcg64) -> Vec<f32> {
        let mut params = vec![0.0; layout.n_params()];
        for entry in layout.entries() {
            let scale = if entry.rows == 1 { 0.5 } else { 1.5 / (entry.cols as f32).sqrt() };
            for p in &mut params[entry.range()] {
                *p = rng.random_range(-scale..scale);
            }
        }
        params
    }
}

#[cfg(test)]
mod tests {
    use rand::SeedableRng;
    use rand_pcg::Pcg64;
    use volley_policy::{PolicySpec, PolicyTape};

    use super::test_data::random;
    use super::*;
    use crate::backend::CpuBackend;

    /// The generic network on the CPU backend computes what `PolicyTape` computes, forward and
    /// backward, for an MLP and a GRU core with episode starts in the middle of the sequence.
    #[test]
    fn cpu_network_matches_the_policy_tape_forward_and_backward() {
        let specs = [
            PolicySpec::mlp(5, 3, &[16, 8], Activation::Tanh),
            PolicySpec::mlp(5, 3, &[], Activation::Relu),
            PolicySpec::gru(5, 3, &[16], Activation::Relu, 8),
            PolicySpec::gru(5, 3, &[], Activation::Tanh, 6),
            // A separate value network: the heads' outputs are joined and their gradients split.
            PolicySpec::mlp(5, 3, &[16, 8], Activation::Tanh).with_critic(&[12, 20]),
            PolicySpec::mlp(5, 3, &[], Activation::Relu).with_critic(&[7]),
        ];
        for spec in specs {
            let layout = ParamLayout::new(&spec).expect("valid spec");
            let mut rng = Pcg64::seed_from_u64(7);
            let params = random(&mut rng, layout.n_params(), 0.5);
            let (t_len, b_len) = (6, 4);
            let rows = t_len * b_len;
            let hidden = layout.recurrent_size();
            let obs = random(&mut rng, rows * 5, 1.0);
            let mut starts = vec![0.0; rows];
            starts[2 * b_len + 1] = 1.0;
            starts[4 * b_len + 3] = 1.0;
            let h0 = random(&mut rng, b_len * hidden, 1.0);
            let d_heads = random(&mut rng, rows * 4, 1.0);

            let mut tape = PolicyTape::new(&layout);
            tape.forward(&params, &obs, &starts, &h0, t_len, b_len);
            let dlogits: Vec<f32> = d_heads.chunks_exact(4).flat_map(|row| row[..3].to_vec()).collect();
            let dvalues: Vec<f32> = d_heads.chunks_exact(4).map(|row| row[3]).collect();
            let mut tape_grads = vec![0.0; layout.n_params()];
            tape.backward(&params, &dlogits, &dvalues, &mut tape_grads);

            let mut cpu = CpuBackend::new();
            let mut net = Network::new(&mut cpu, &layout).unwrap();
            net.forward(&mut cpu, &params, View::of(&obs), View::of(&starts), View::of(&h0), None, t_len, b_len)
                .unwrap();
            let heads = net.heads().parts();
            let heads = &heads.0[heads.1];
            for (i, row) in heads.chunks_exact(4).enumerate() {
                for (j, (&logit, &expected)) in row[..3].iter().zip(&tape.logits()[i * 3..i * 3 + 3]).enumerate() {
                    assert!((logit - expected).abs() < 1e-5, "{spec:?} logit {i},{j}");
                }
                assert!((row[3] - tape.values()[i]).abs() < 1e-5, "{spec:?} value {i}");
            }
            let mut grads = vec![0.0; layout.n_params()];
            net.backward(&mut cpu, &params, View::of(&d_heads), View::of(&obs), View::of(&starts), &mut grads).unwrap();
            for (k, (g, e)) in grads.iter().zip(&tape_grads).enumerate() {
                assert!((g - e).abs() <= 1e-4 * (1.0 + e.abs()), "{spec:?} grad {k}: {g} vs {e}");
            }
        }
    }
}

#[cfg(test)]
mod window_tests {
    use rand::{Rng, SeedableRng};
    use rand_pcg::Pcg64;
    use volley_core::wire::{Observations, RestoredState, TrajectorySegment};
    use volley_policy::PolicySpec;
    use volley_testkit::fixtures::SegmentBuilder;

    use super::*;
    use crate::backend::CpuBackend;
    use crate::batch::SegmentBatch;

    const T: usize = 3;
    const K: usize = 3;
    const OBS: usize = 3;
    const HIDDEN: usize = 4;

    fn segment(rng: &mut Pcg64, idx: u64) -> TrajectorySegment {
        let mut segment = SegmentBuilder::new(T, OBS)
            .observations_from(|_| 0.0)
            .initial_hidden((0..HIDDEN).map(|_| rng.random_range(-0.5..0.5)).collect())
            .build();
        let n = segment.observations.len();
        segment.observations = Observations::F32((0..n).map(|_| rng.random_range(-1.0..1.0)).collect());
        segment.segment_idx = idx;
        segment
    }

    /// A stitched window of K segments (an episode end and a resume from a saved state inside
    /// it, the state carried across the other boundary) and a short, padded window.
    fn stitched_batch(rng: &mut Pcg64) -> SegmentBatch {
        let mut window: Vec<TrajectorySegment> = (0..K as u64).map(|idx| segment(rng, idx)).collect();
        window[1].terminated[0] = 1;
        window[1].restored_states =
            vec![RestoredState { step: 1, hidden: (0..HIDDEN).map(|_| rng.random_range(-0.5..0.5)).collect() }];
        let short = [segment(rng, 9)];
        let mut batch = SegmentBatch::default();
        batch.fill_windows(&[&window[..], &short[..]], K, 0.99, 1.0, &[1.0, 1.0]);
        assert_eq!(batch.restores.len(), 2, "one mid-segment resume, one padded start");
        batch
    }

    /// `Σ d_heads ⊙ heads` over the first `rows` rows of `batch` (and the network's forward),
    /// and its gradient with respect to `params`.
    fn loss_and_gradient(
        layout: &ParamLayout,
        params: &[f32],
        batch: &SegmentBatch,
        starts: &[f32],
        d_heads: &[f32],
    ) -> (f64, Vec<f32>) {
        let (rows, b_len) = (batch.t_len, batch.b_len);
        let mut cpu = CpuBackend::new();
        let mut net = Network::new(&mut cpu, layout).expect("network");
        let obs = batch.observations.to_f32_vec()[..rows * b_len * OBS].to_vec();
        let (params, starts, d_heads) = (params.to_vec(), starts.to_vec(), d_heads.to_vec());
        let (obs, starts) = (View::of(&obs), View::of(&starts));
        let restores = Restores { steps: &batch.restores, states: View::of(&batch.restore_states) };
        let h0 = View::of(&batch.initial_hidden);
        net.forward(&mut cpu, &params, obs, starts, h0, Some(restores), rows, b_len).expect("forward");
        let (heads, range) = net.heads().parts();
        let loss = heads[range].iter().zip(&d_heads).map(|(&h, &d)| f64::from(h) * f64::from(d)).sum();
        let mut grads = vec![0.0; params.len()];
        net.backward(&mut cpu, &params, View::of(&d_heads), obs, starts, &mut grads).expect("backward");
        (loss, grads)
    }

    /// Issue 18: backpropagation through a stitched window of K·T steps, with the state
    /// carried across a segment boundary, an episode resumed from a saved state mid-window and a
    /// padded short window, matches central finite differences for every parameter.
    #[test]
    fn bptt_through_a_stitched_window_matches_finite_differences() {
        let mut rng = Pcg64::seed_from_u64(18);
        let spec = PolicySpec::gru(OBS, 2, &[5], Activation::Tanh, HIDDEN);
        let layout = ParamLayout::new(&spec).expect("valid spec");
        let params: Vec<f32> = (0..layout.n_params()).map(|_| rng.random_range(-0.6..0.6)).collect();
        let batch = stitched_batch(&mut rng);
        let rows = batch.t_len * batch.b_len;
        let starts = batch.episode_start[..rows].to_vec();
        // Padding carries no loss, as its weight-0 rows give none.
        let d_heads: Vec<f32> = (0..rows * 3)
            .map(|i| if batch.sample_weights[i / 3] == 0.0 { 0.0 } else { rng.random_range(-1.0..1.0) })
            .collect();
        let (_, analytic) = loss_and_gradient(&layout, &params, &batch, &starts, &d_heads);
        let eps = 1e-2f32;
        for (k, &g) in analytic.iter().enumerate() {
            let (mut plus, mut minus) = (params.clone(), params.clone());
            plus[k] += eps;
            minus[k] -= eps;
            let loss = |params: &[f32]| loss_and_gradient(&layout, params, &batch, &starts, &d_heads).0;
            let numeric = (loss(&plus) - loss(&minus)) / (2.0 * f64::from(eps));
            let error = (f64::from(g) - numeric).abs();
            assert!(error <= 2e-3 + 2e-2 * numeric.abs(), "param {k}: backward {g}, finite differences {numeric}");
        }
    }

    /// Credit crosses the boundaries inside a window: a loss on the window's last step alone
    /// has a gradient from the earlier segments' steps, which truncation at the boundaries
    /// (single-segment training) cuts off.
    #[test]
    fn a_loss_at_the_end_of_a_window_reaches_its_first_segment() {
        let mut rng = Pcg64::seed_from_u64(19);
        let spec = PolicySpec::gru(OBS, 2, &[], Activation::Tanh, HIDDEN);
        let layout = ParamLayout::new(&spec).expect("valid spec");
        let params: Vec<f32> = (0..layout.n_params()).map(|_| rng.random_range(-0.6..0.6)).collect();
        // One full window with no episode end: the state flows from step 0 to step K·T − 1.
        let window: Vec<TrajectorySegment> = (0..K as u64).map(|idx| segment(&mut rng, idx)).collect();
        let mut batch = SegmentBatch::default();
        batch.fill_windows(&[&window[..]], K, 0.99, 1.0, &[1.0]);
        let rows = batch.t_len;
        let mut d_heads = vec![0.0; rows * 3];
        d_heads[(rows - 1) * 3] = 1.0;
        let stitched = batch.episode_start[..rows].to_vec();
        let mut truncated = stitched.clone();
        for boundary in (T..rows).step_by(T) {
            truncated[boundary] = 1.0;
        }
        let weight_ih = layout.entry("gru.weight_ih").expect("a GRU").range();
        let (_, through) = loss_and_gradient(&layout, &params, &batch, &stitched, &d_heads);
        let (_, cut) = loss_and_gradient(&layout, &params, &batch, &truncated, &d_heads);
        let difference: f32 = through[weight_ih.clone()].iter().zip(&cut[weight_ih]).map(|(a, b)| (a - b).abs()).sum();
        assert!(difference > 1e-3, "the first segments' steps contribute to the gradient: {difference}");
    }
}

#[cfg(test)]
#[path = "net_conv_tests.rs"]
mod conv_tests;

#[cfg(test)]
#[path = "net_u8_tests.rs"]
mod u8_tests;
