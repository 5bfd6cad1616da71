//! Batched one-step inference for actors.

use super::conv::{byte_table, im2col, im2col_u8_scaled, ConvGeometry};
use super::layout::{DenseOffsets, ParamLayout};
use super::linalg::{
    dense_forward, large_dense_forward, small_chain_fits, small_dense_chain_forward, SmallLayer, LARGE_PRODUCT_MACS,
    LARGE_WEIGHTS,
};
use super::{gru, Activation, PolicyError};

/// Dense layers (torso and heads) that one forward pass chains through the small-batch kernel
/// at most; a deeper network goes layer by layer.
const SMALL_CHAIN_MAX: usize = 8;

/// Batched one-step policy evaluation for actors: observations (and recurrent state) in,
/// logits and values out.
///
/// It owns a workspace sized for `max_batch` agents at construction, so [`forward`](Self::forward)
/// allocates nothing of its own (the `matrixmultiply` GEMMs still take one short-lived packing
/// buffer per product internally). Over a large batch every layer is one GEMM over the whole
/// batch followed by a fused bias + activation pass; over a small one (at most
/// [`SMALL_BATCH_ROWS`](super::linalg::SMALL_BATCH_ROWS) agents, layers of at most
/// [`SMALL_BATCH_MAX_IN`](super::linalg::SMALL_BATCH_MAX_IN) inputs) the dense layers run as one chain
/// through a kernel without packing, bit-identical to the GEMM path. The policy and value heads
/// are one layer.
///
/// Recurrent state is the caller's: `hidden` is `[n][H]`, read and advanced in place. An actor
/// starts an agent's state at zeros and zeroes it again when that agent's episode ends, which is
/// exactly what `episode_start` does in [`PolicyTape`](super::PolicyTape).
///
/// ```
/// use volley_policy::{Activation, ParamLayout, PolicyInference, PolicySpec};
/// let layout = ParamLayout::new(&PolicySpec::mlp(4, 2, &[64, 64], Activation::Tanh)).unwrap();
/// let params = layout.init_params(0);
/// let mut inference = PolicyInference::new(&layout, 8);
/// let obs = [0.1f32; 3 * 4];
/// let (mut logits, mut values) = ([0.0f32; 3 * 2], [0.0f32; 3]);
/// inference.forward(&params, &obs, 3, &mut [], &mut logits, &mut values);
/// assert!(logits.iter().chain(&values).all(|x| x.is_finite()));
/// ```
#[derive(Debug, Clone)]
pub struct PolicyInference {
    layout: ParamLayout,
    max_batch: usize,
    /// The unfolded receptive fields of one chunk of images ([`unfolding_chunk`]) of one conv
    /// layer, `[images·OH·OW][C·K·K]`, for the largest layer (empty without a conv torso).
    conv_cols: Vec<f32>,
    /// Ping-pong conv feature maps, `[max_batch][OH·OW·OC]` of the largest layer each.
    conv_a: Vec<f32>,
    conv_b: Vec<f32>,
    /// Ping-pong torso activations, `[max_batch][max torso width]` each.
    act_a: Vec<f32>,
    act_b: Vec<f32>,
    /// GRU input and hidden projections, `[max_batch][3H]` each (empty without a GRU).
    gi: Vec<f32>,
    gh: Vec<f32>,
    /// Fused head output, `[max_batch][n_actions + 1]`.
    heads_out: Vec<f32>,
    /// Normalised observations, `[max_batch][obs_dim]` (empty without `normalize_obs`).
    obs_normalized: Vec<f32>,
    /// Image observations widened to `f32`, `[max_batch][obs_dim]`, for a first layer that
    /// reads `f32` (dense, or after normalisation); sized by the first such call.
    obs_widened: Vec<f32>,
}

/// One step's observations: `f32` rows, or rows of bytes (image observations,
/// `volley_core::wire::Observations::U8`), which the first layer converts as it reads them.
#[derive(Debug, Clone, Copy)]
pub enum ObsRows<'a> {
    /// `[n][obs_dim]` values.
    F32(&'a [f32]),
    /// `[n][obs_dim]` bytes; value `v` enters the network as `f32::from(v)` (times the conv
    /// torso's pixel scale), exactly what the `f32` path computes for the widened values.
    U8(&'a [u8]),
}

impl ObsRows<'_> {
    fn len(&self) -> usize {
        match self {
            ObsRows::F32(values) => values.len(),
            ObsRows::U8(bytes) => bytes.len(),
        }
    }
}

impl PolicyInference {
    /// A workspace for batches of up to `max_batch` agents.
    pub fn new(layout: &ParamLayout, max_batch: usize) -> Self {
        let width = layout.max_torso_width().max(layout.critic().iter().map(|layer| layer.n_out).max().unwrap_or(0));
        let gates = 3 * layout.recurrent_size();
        let geometries = layout.conv_geometries();
        let widest_cols = geometries.iter().map(|g| unfolding_chunk(g, max_batch) * g.cols_len()).max().unwrap_or(0);
        let widest_map = geometries.iter().map(|g| g.output_len()).max().unwrap_or(0);
        PolicyInference {
            layout: layout.clone(),
            max_batch,
            conv_cols: vec![0.0; widest_cols],
            conv_a: vec![0.0; max_batch * widest_map],
            conv_b: vec![0.0; max_batch * widest_map],
            act_a: vec![0.0; max_batch * width],
            act_b: vec![0.0; max_batch * width],
            gi: vec![0.0; max_batch * gates],
            gh: vec![0.0; max_batch * gates],
            heads_out: vec![0.0; max_batch * (layout.n_actions() + 1)],
            obs_normalized: vec![0.0; if scaled_input(layout) { max_batch * layout.obs_dim() } else { 0 }],
            obs_widened: Vec::new(),
        }
    }

    /// The layout this workspace was built for.
    pub fn layout(&self) -> &ParamLayout {
        &self.layout
    }

    /// The largest batch [`forward`](Self::forward) accepts.
    pub fn max_batch(&self) -> usize {
        self.max_batch
    }

    /// One step for `n` agents.
    ///
    /// * `params`: the flat buffer, `n_params` long.
    /// * `obs`: `[n][obs_dim]`.
    /// * `hidden`: `[n][H]` with `H = layout.recurrent_size()`, advanced in place (pass `&mut []`
    ///   for a feed-forward policy).
    /// * `logits`: `[n][n_actions]`, overwritten.
    /// * `values`: `[n]`, overwritten.
    ///
    /// # Panics
    /// If a length disagrees with the layout or `n > max_batch`; these are caller invariants.
    /// Use [`try_forward`](Self::try_forward) to get a [`PolicyError`] instead.
    pub fn forward(
        &mut self,
        params: &[f32],
        obs: &[f32],
        n: usize,
        hidden: &mut [f32],
        logits: &mut [f32],
        values: &mut [f32],
    ) {
        if let Err(err) = self.try_forward(params, obs, n, hidden, logits, values) {
            panic!("PolicyInference::forward: {err}");
        }
    }

    /// [`forward`](Self::forward) that reports bad lengths as [`PolicyError`] instead of
    /// panicking.
    pub fn try_forward(
        &mut self,
        params: &[f32],
        obs: &[f32],
        n: usize,
        hidden: &mut [f32],
        logits: &mut [f32],
        values: &mut [f32],
    ) -> Result<(), PolicyError> {
        self.try_forward_rows(params, ObsRows::F32(obs), n, hidden, logits, values)
    }

    /// [`forward`](Self::forward) over image observations of one byte per value: the first
    /// conv layer unfolds the bytes directly; a dense first layer (or normalisation) reads them
    /// widened. The outputs are bit for bit those of [`forward`](Self::forward) over
    /// `f32::from(v)` for every byte `v`.
    ///
    /// # Panics
    /// As [`forward`](Self::forward).
    pub fn forward_u8(
        &mut self,
        params: &[f32],
        obs: &[u8],
        n: usize,
        hidden: &mut [f32],
        logits: &mut [f32],
        values: &mut [f32],
    ) {
        if let Err(err) = self.try_forward_rows(params, ObsRows::U8(obs), n, hidden, logits, values) {
            panic!("PolicyInference::forward_u8: {err}");
        }
    }

    /// [`forward`](Self::forward) over either kind of observation rows, reporting bad lengths
    /// as [`PolicyError`].
    pub fn try_forward_rows(
        &mut self,
        params: &[f32],
        obs: ObsRows<'_>,
        n: usize,
        hidden: &mut [f32],
        logits: &mut [f32],
        values: &mut [f32],
    ) -> Result<(), PolicyError> {
        self.check_shapes(params, obs.len(), n, hidden, logits, values)?;
        self.run(params, obs, n, hidden, logits, values);
        Ok(())
    }

    #[cold]
    fn shape_error(field: &'static str, expected: usize, got: usize) -> PolicyError {
        PolicyError::Shape { field, expected, got }
    }

    fn check_shapes(
        &self,
        params: &[f32],
        obs_len: usize,
        n: usize,
        hidden: &[f32],
        logits: &[f32],
        values: &[f32],
    ) -> Result<(), PolicyError> {
        if n > self.max_batch {
            return Err(PolicyError::BatchSize {
                field: "n",
                value: n,
                rule: format!("at most max_batch = {}", self.max_batch),
            });
        }
        let layout = &self.layout;
        let expected = [
            ("params", layout.n_params(), params.len()),
            ("obs", n * layout.obs_dim(), obs_len),
            ("hidden", n * layout.recurrent_size(), hidden.len()),
            ("logits", n * layout.n_actions(), logits.len()),
            ("values", n, values.len()),
        ];
        for (field, expected, got) in expected {
            if expected != got {
                return Err(Self::shape_error(field, expected, got));
            }
        }
        Ok(())
    }

    /// The forward pass proper; lengths were checked by the caller.
    fn run(
        &mut self,
        params: &[f32],
        rows: ObsRows<'_>,
        n: usize,
        hidden: &mut [f32],
        logits: &mut [f32],
        values: &mut [f32],
    ) {
        if n == 0 {
            return;
        }
        let layout = &self.layout;
        // Bytes enter the first conv layer's unfolding as they are; for any other first layer
        // they are widened (and scaled) into a scratch first, and then take the `f32` path.
        // The branch is taken once per call, never per value.
        let (obs, direct_bytes): (&[f32], Option<&[u8]>) = match rows {
            ObsRows::F32(obs) => (obs, None),
            ObsRows::U8(bytes) if !layout.conv().is_empty() && layout.obs_norm_range().is_none() => (&[], Some(bytes)),
            ObsRows::U8(bytes) => {
                if self.obs_widened.len() < bytes.len() {
                    self.obs_widened.resize(self.max_batch * layout.obs_dim(), 0.0);
                }
                let widened = &mut self.obs_widened[..bytes.len()];
                let table = byte_table(1.0);
                for (value, &byte) in widened.iter_mut().zip(bytes) {
                    *value = table[usize::from(byte)];
                }
                (&self.obs_widened[..bytes.len()], None)
            }
        };
        let obs: &[f32] = match (layout.obs_norm_range(), layout.input_scale()) {
            _ if direct_bytes.is_some() => obs,
            (Some(stats), _) => {
                let out = &mut self.obs_normalized[..obs.len()];
                crate::obs_norm::normalize(&params[stats], obs, out);
                out
            }
            // Pixels become [0, 1] here, inside the network (conv `input = pixels`).
            (None, scale) if scale != 1.0 => {
                let out = &mut self.obs_normalized[..obs.len()];
                for (scaled, &value) in out.iter_mut().zip(obs) {
                    *scaled = value * scale;
                }
                out
            }
            (None, _) => obs,
        };
        let activation = layout.spec().activation;
        // Conv layer i unfolds what layer i−1 wrote (obs for i = 0), then one GEMM over the
        // unfolded positions (the `gemm` crate's for large products, as in the learner) writes
        // the other ping-pong buffer, channel-last. Both run over chunks of images whose
        // unfolding fits in a core's L2 cache ([`unfolding_chunk`]), so the product reads the
        // unfolding where `im2col` just wrote it.
        for (layer_idx, (layer, geometry)) in layout.conv().iter().zip(layout.conv_geometries()).enumerate() {
            let (input, output) =
                if layer_idx % 2 == 0 { (&self.conv_b, &mut self.conv_a) } else { (&self.conv_a, &mut self.conv_b) };
            let (weight, bias) = (layer.weight(params), layer.bias(params));
            let chunk = unfolding_chunk(geometry, n);
            let large = n * geometry.out_positions() * weight.len() >= LARGE_PRODUCT_MACS;
            for first in (0..n).step_by(chunk) {
                let images = chunk.min(n - first);
                let cols = &mut self.conv_cols[..images * geometry.cols_len()];
                let inputs = first * geometry.input_len()..(first + images) * geometry.input_len();
                match direct_bytes {
                    Some(bytes) if layer_idx == 0 => {
                        im2col_u8_scaled(geometry, &bytes[inputs], images, layout.input_scale(), cols)
                    }
                    _ if layer_idx == 0 => im2col(geometry, &obs[inputs], images, cols),
                    _ => im2col(geometry, &input[inputs], images, cols),
                }
                .expect("conv input and cols are sized by the layout (checked)");
                let positions = images * geometry.out_positions();
                let output = &mut output[first * geometry.output_len()..(first + images) * geometry.output_len()];
                if large {
                    large_dense_forward(cols, positions, weight, bias, Some(Activation::Relu), output);
                } else {
                    dense_forward(cols, positions, weight, bias, Some(Activation::Relu), output);
                }
            }
        }
        let conv_features: &[f32] = match layout.conv().len() {
            0 => obs,
            n_layers if n_layers % 2 == 1 => &self.conv_a[..n * layout.torso_input_dim()],
            _ => &self.conv_b[..n * layout.torso_input_dim()],
        };
        if layout.value_head().is_some() {
            // The separate value network reads the (normalised) observations; its values are
            // done before the torso reuses the scratch.
            critic_values(layout, params, conv_features, n, [&mut self.act_a, &mut self.act_b], values);
        }
        let torso = layout.torso();
        let heads = layout.heads();
        // A small batch through the dense layers (an actor's step over its environments): one
        // chain whose activations stay in the kernel's lanes from layer to layer, through the
        // heads too when no recurrent core stands between; bit-identical to layer by layer.
        let fused_heads = layout.gru().is_none();
        let mut torso_done = false;
        let links = small_chain(params, torso, activation, fused_heads.then_some(heads)).filter(|_| !torso.is_empty());
        if let Some((links, chain_len)) = links {
            let chain = &links[..chain_len];
            if small_chain_fits(n, chain) {
                if fused_heads {
                    let heads_out = &mut self.heads_out[..n * heads.n_out];
                    small_dense_chain_forward(conv_features, n, chain, heads_out);
                    emit_heads(layout, heads_out, logits, values);
                    return;
                }
                // Where the layer-by-layer loop below leaves the torso's features.
                let out = if torso.len() % 2 == 1 { &mut self.act_a } else { &mut self.act_b };
                small_dense_chain_forward(conv_features, n, chain, out);
                torso_done = true;
            }
        }
        if !torso_done {
            dense_stack_forward(params, torso, activation, conv_features, n, [&mut self.act_a, &mut self.act_b]);
        }
        let torso_features: &[f32] = match torso.len() {
            0 => conv_features,
            n_layers if n_layers % 2 == 1 => &self.act_a,
            _ => &self.act_b,
        };
        let features: &[f32] = match layout.gru() {
            None => torso_features,
            Some(gru) => {
                let gates = 3 * gru.hidden;
                let gi = &mut self.gi[..n * gates];
                let gh = &mut self.gh[..n * gates];
                dense_forward(torso_features, n, gru.weight_ih(params), gru.bias_ih(params), None, gi);
                dense_forward(hidden, n, gru.weight_hh(params), gru.bias_hh(params), None, gh);
                gru::cell_forward_in_place(gi, gh, hidden, gru.hidden);
                hidden
            }
        };
        let heads_out = &mut self.heads_out[..n * heads.n_out];
        dense_forward(features, n, heads.weight(params), heads.bias(params), None, heads_out);
        emit_heads(layout, heads_out, logits, values);
    }
}

/// The head rows of a forward into the caller's logits and values: split `[logits…, value]`
/// rows, or, with a separate value network (whose values are already written), copy the logits.
fn emit_heads(layout: &ParamLayout, heads_out: &[f32], logits: &mut [f32], values: &mut [f32]) {
    if layout.value_head().is_some() {
        logits.copy_from_slice(heads_out);
    } else {
        split_heads(heads_out, layout.n_actions(), logits, values);
    }
}

/// The separate value network over `n` rows of observations, written to `values` (`[n]`): one
/// chain through its layers and the value head when it fits the small-batch kernel, else layer
/// by layer through the two scratch buffers.
fn critic_values(
    layout: &ParamLayout,
    params: &[f32],
    obs: &[f32],
    n: usize,
    [a, b]: [&mut Vec<f32>; 2],
    values: &mut [f32],
) {
    let (critic, activation) = (layout.critic(), layout.spec().activation);
    let value = layout.value_head().expect("a separate value network has a value head");
    if let Some((links, chain_len)) = small_chain(params, critic, activation, Some(value)) {
        let chain = &links[..chain_len];
        if small_chain_fits(n, chain) {
            small_dense_chain_forward(obs, n, chain, values);
            return;
        }
    }
    dense_stack_forward(params, critic, activation, obs, n, [&mut *a, &mut *b]);
    let features = if critic.len() % 2 == 1 { &a[..] } else { &b[..] };
    dense_forward(&features[..n * value.n_in], n, value.weight(params), value.bias(params), None, values);
}

/// The dense layers `layers` (with `activation`), then `tail` (without one), as the links of
/// one small-batch chain: the first `len` of the array; `None` when they are more than
/// [`SMALL_CHAIN_MAX`].
fn small_chain<'p>(
    params: &'p [f32],
    layers: &[DenseOffsets],
    activation: Activation,
    tail: Option<DenseOffsets>,
) -> Option<([SmallLayer<'p>; SMALL_CHAIN_MAX], usize)> {
    let len = layers.len() + usize::from(tail.is_some());
    if len > SMALL_CHAIN_MAX {
        return None;
    }
    let mut links = [SmallLayer { weight: &[], bias: &[], act: None }; SMALL_CHAIN_MAX];
    for (link, layer) in links.iter_mut().zip(layers) {
        *link = SmallLayer { weight: layer.weight(params), bias: layer.bias(params), act: Some(activation) };
    }
    if let Some(tail) = tail {
        links[layers.len()] = SmallLayer { weight: tail.weight(params), bias: tail.bias(params), act: None };
    }
    Some((links, len))
}

/// `layers` with `activation` over `n` rows of `input`, layer by layer: layer `i` reads what
/// layer `i − 1` wrote (`input` for `i = 0`) and writes the other scratch buffer, `a` for even
/// `i`, so the last layer's output is in `a` for an odd number of layers, else in `b`. Large
/// weights go through the `gemm` crate's product.
fn dense_stack_forward(
    params: &[f32],
    layers: &[DenseOffsets],
    activation: Activation,
    input: &[f32],
    n: usize,
    [a, b]: [&mut Vec<f32>; 2],
) {
    for (layer_idx, layer) in layers.iter().enumerate() {
        let (prev, output) = if layer_idx % 2 == 0 { (&*b, &mut *a) } else { (&*a, &mut *b) };
        let x = if layer_idx == 0 { input } else { &prev[..] };
        let (weight, bias) = (layer.weight(params), layer.bias(params));
        if weight.len() >= LARGE_WEIGHTS {
            large_dense_forward(x, n, weight, bias, Some(activation), output);
        } else {
            dense_forward(x, n, weight, bias, Some(activation), output);
        }
    }
}

/// Bytes of unfolded receptive fields that one chunk of inference's conv products reads: half
/// a core's L2 cache (1 MiB on the Zen 4 cores we measure on), leaving room for the packed
/// weights and the output rows.
const UNFOLDING_CHUNK_BYTES: usize = 512 << 10;

/// How many of `n` images one chunk of a conv layer unfolds and multiplies at a time: as many
/// as [`UNFOLDING_CHUNK_BYTES`] hold, at least one (issue 44: unfolding all 8 Nature-DQN frames
/// at once wrote 3.3 MB for the first layer, which the product then read back from L3, and
/// the step cost more per frame over 8 environments than over one).
fn unfolding_chunk(geometry: &ConvGeometry, n: usize) -> usize {
    let image_bytes = geometry.cols_len() * std::mem::size_of::<f32>();
    (UNFOLDING_CHUNK_BYTES / image_bytes.max(1)).clamp(1, n.max(1))
}

/// Split fused head rows `[logits…, value]` into the caller's logits and values.
pub(crate) fn split_heads(heads_out: &[f32], n_actions: usize, logits: &mut [f32], values: &mut [f32]) {
    for ((row, logits), value) in
        heads_out.chunks_exact(n_actions + 1).zip(logits.chunks_exact_mut(n_actions)).zip(values.iter_mut())
    {
        logits.copy_from_slice(&row[..n_actions]);
        *value = row[n_actions];
    }
}

/// Whether the forward pass rewrites the observations first (normalisation or scaling).
fn scaled_input(layout: &ParamLayout) -> bool {
    layout.spec().normalize_obs || layout.input_scale() != 1.0
}

#[cfg(test)]
mod tests {
    use super::super::{Activation, PolicySpec};
    use super::*;

    #[test]
    fn wrong_lengths_are_shape_errors() {
        let layout = ParamLayout::new(&PolicySpec::gru(3, 2, &[4], Activation::Tanh, 5)).unwrap();
        let params = layout.init_params(0);
        let mut inference = PolicyInference::new(&layout, 4);
        let obs = vec![0.0; 2 * 3];
        let mut hidden = vec![0.0; 2 * 5];
        let mut logits = vec![0.0; 2 * 2];
        let mut values = vec![0.0; 2];
        assert!(inference.try_forward(&params, &obs, 2, &mut hidden, &mut logits, &mut values).is_ok());
        let err = inference.try_forward(&params[1..], &obs, 2, &mut hidden, &mut logits, &mut values).unwrap_err();
        assert!(matches!(err, PolicyError::Shape { field: "params", .. }));
        let err = inference.try_forward(&params, &obs[1..], 2, &mut hidden, &mut logits, &mut values).unwrap_err();
        assert!(matches!(err, PolicyError::Shape { field: "obs", .. }));
        let err = inference.try_forward(&params, &obs, 2, &mut [], &mut logits, &mut values).unwrap_err();
        assert!(matches!(err, PolicyError::Shape { field: "hidden", .. }));
        let err = inference.try_forward(&params, &obs, 2, &mut hidden, &mut logits[1..], &mut values).unwrap_err();
        assert!(matches!(err, PolicyError::Shape { field: "logits", .. }));
        let err = inference.try_forward(&params, &obs, 2, &mut hidden, &mut logits, &mut values[1..]).unwrap_err();
        assert!(matches!(err, PolicyError::Shape { field: "values", .. }));
        let err = inference.try_forward(&params, &[], 5, &mut [], &mut [], &mut []).unwrap_err();
        assert!(matches!(err, PolicyError::BatchSize { field: "n", value: 5, .. }));
        assert_eq!(err.to_string(), "n = 5 out of range, must be at most max_batch = 4");
    }

    #[test]
    #[should_panic(expected = "PolicyInference::forward: obs: expected 6 elements, got 5")]
    fn forward_panics_with_the_shape_error() {
        let layout = ParamLayout::new(&PolicySpec::mlp(3, 2, &[4], Activation::Tanh)).unwrap();
        let params = layout.init_params(0);
        let mut inference = PolicyInference::new(&layout, 4);
        inference.forward(&params, &[0.0; 5], 2, &mut [], &mut [0.0; 4], &mut [0.0; 2]);
    }

    /// A conv torso that reads pixels sees `obs / 255`: the same outputs as a raw torso fed the
    /// scaled values, and the caller's observations are left as they were.
    #[test]
    fn pixel_input_is_scaled_inside_the_network() {
        let conv = crate::ConvSpec::nature(2, 36, 36);
        let raw = PolicySpec::mlp(0, 3, &[16], Activation::Relu).with_conv(conv.clone());
        let pixels = raw.clone().with_conv(crate::ConvSpec { input: crate::ConvInput::Pixels, ..conv });
        let (raw, pixels) = (ParamLayout::new(&raw).unwrap(), ParamLayout::new(&pixels).unwrap());
        assert_eq!((raw.input_scale(), pixels.input_scale()), (1.0, 1.0 / 255.0));
        let params = raw.init_params(3);
        assert_eq!(params.len(), pixels.n_params(), "the scale adds no parameters");
        let n = 2;
        let obs: Vec<f32> = (0..n * 2 * 36 * 36).map(|i| ((i * 37) % 256) as f32).collect();
        let scaled: Vec<f32> = obs.iter().map(|&v| v * (1.0 / 255.0)).collect();
        let run = |layout: &ParamLayout, obs: &[f32]| {
            let (mut logits, mut values) = (vec![0.0; n * 3], vec![0.0; n]);
            PolicyInference::new(layout, n).forward(&params, obs, n, &mut [], &mut logits, &mut values);
            (logits, values)
        };
        let before = obs.clone();
        assert_eq!(run(&pixels, &obs), run(&raw, &scaled));
        assert_ne!(run(&raw, &obs), run(&raw, &scaled), "the scale matters");
        assert_eq!(obs, before);
        // Pixels and running normalisation do not combine.
        let both = PolicySpec { normalize_obs: true, ..pixels.spec().clone() };
        assert!(ParamLayout::new(&both).is_err());
    }

    /// Issue 44 item 3: frames of one byte per value give the `f32` path's outputs bit for bit
    /// (so the same sampled actions and log-probabilities) for the Nature and MinAtar conv
    /// presets, with normalisation (applied after widening), and for a dense first layer.
    #[test]
    fn byte_frames_give_the_bits_of_their_float_values() {
        let nature = crate::ConvSpec { input: crate::ConvInput::Pixels, ..crate::ConvSpec::nature(4, 84, 84) };
        let minatar = crate::ConvSpec::minatar(4, 10, 10);
        let specs = [
            PolicySpec::mlp(0, 6, &[512], Activation::Relu).with_conv(nature),
            PolicySpec::mlp(0, 6, &[128], Activation::Relu).with_conv(minatar.clone()),
            PolicySpec::mlp(0, 6, &[128], Activation::Relu).with_conv(minatar).with_obs_normalization(true),
            PolicySpec::mlp(400, 6, &[16], Activation::Tanh),
            PolicySpec::mlp(400, 6, &[16], Activation::Tanh).with_obs_normalization(true),
        ];
        for spec in specs {
            let layout = ParamLayout::new(&spec).unwrap();
            let obs_dim = layout.obs_dim();
            let mut params = layout.init_params(5);
            if let Some(stats) = layout.obs_norm_range() {
                // Statistics of some seen data, so normalisation changes the values.
                let seen: Vec<f32> = (0..3 * obs_dim).map(|i| (i % 7) as f32).collect();
                crate::obs_norm::update(&mut params[stats], &seen);
            }
            let n = 3;
            let bytes: Vec<u8> = (0..n * obs_dim)
                .map(|i| if obs_dim > 400 { (i * 37 % 256) as u8 } else { (i % 3 == 0) as u8 })
                .collect();
            let floats: Vec<f32> = bytes.iter().map(|&b| f32::from(b)).collect();
            let mut inference = PolicyInference::new(&layout, n);
            let (mut logits_f, mut values_f) = (vec![0.0; n * 6], vec![0.0; n]);
            inference.forward(&params, &floats, n, &mut [], &mut logits_f, &mut values_f);
            let (mut logits_u, mut values_u) = (vec![0.0; n * 6], vec![0.0; n]);
            inference.forward_u8(&params, &bytes, n, &mut [], &mut logits_u, &mut values_u);
            let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
            assert_eq!(bits(&logits_u), bits(&logits_f), "{spec:?}");
            assert_eq!(bits(&values_u), bits(&values_f), "{spec:?}");
            assert!(logits_f.iter().any(|&l| l != logits_f[0]), "outputs that depend on the input");
        }
    }

    /// Issue 44: the conv layers run over chunks of images ([`unfolding_chunk`]); over 84×84×4
    /// frames that is one frame per chunk in the first layer and several in the others, and
    /// every agent's outputs are those of a batch of one.
    #[test]
    fn conv_chunks_give_each_agent_the_outputs_of_a_batch_of_one() {
        let conv = crate::ConvSpec { input: crate::ConvInput::Pixels, ..crate::ConvSpec::nature(4, 84, 84) };
        let layout = ParamLayout::new(&PolicySpec::mlp(0, 6, &[32], Activation::Relu).with_conv(conv)).unwrap();
        let chunks: Vec<_> = layout.conv_geometries().iter().map(|g| unfolding_chunk(g, 5)).collect();
        assert_eq!(chunks, [1, 3, 4], "chunks of one, several and all but one frame");
        let params = layout.init_params(7);
        let n = 5;
        let bytes: Vec<u8> = (0..n * layout.obs_dim()).map(|i| (i * 7919 % 256) as u8).collect();
        let mut inference = PolicyInference::new(&layout, n);
        let (mut logits, mut values) = (vec![0.0; n * 6], vec![0.0; n]);
        inference.forward_u8(&params, &bytes, n, &mut [], &mut logits, &mut values);
        for (agent, frame) in bytes.chunks_exact(layout.obs_dim()).enumerate() {
            let (mut l, mut v) = (vec![0.0; 6], vec![0.0; 1]);
            inference.forward_u8(&params, frame, 1, &mut [], &mut l, &mut v);
            for (a, b) in l.iter().chain(&v).zip(logits[agent * 6..(agent + 1) * 6].iter().chain(&values[agent..])) {
                assert!((a - b).abs() <= 1e-5 * (1.0 + b.abs()), "agent {agent}: {a} vs {b}");
            }
        }
        assert!(logits.chunks_exact(6).any(|row| row != &logits[..6]), "outputs that depend on the frame");
    }

    #[test]
    fn empty_batch_is_a_no_op() {
        let layout = ParamLayout::new(&PolicySpec::mlp(3, 2, &[4], Activation::Relu)).unwrap();
        let params = layout.init_params(0);
        let mut inference = PolicyInference::new(&layout, 0);
        inference.forward(&params, &[], 0, &mut [], &mut [], &mut []);
    }

    #[test]
    fn batch_rows_are_independent() {
        // Each agent's output must not depend on which other agents share its batch.
        let spec = PolicySpec::gru(3, 4, &[8, 6], Activation::Tanh, 5);
        let layout = ParamLayout::new(&spec).unwrap();
        let params = layout.init_params(11);
        let n = 6;
        let obs: Vec<f32> = (0..n * 3).map(|i| (i as f32 * 0.37).sin()).collect();
        let hidden0: Vec<f32> = (0..n * 5).map(|i| (i as f32 * 0.11).cos() * 0.5).collect();
        let mut inference = PolicyInference::new(&layout, n);
        let mut hidden = hidden0.clone();
        let (mut logits, mut values) = (vec![0.0; n * 4], vec![0.0; n]);
        inference.forward(&params, &obs, n, &mut hidden, &mut logits, &mut values);
        for agent in 0..n {
            let mut h = hidden0[agent * 5..(agent + 1) * 5].to_vec();
            let (mut l, mut v) = (vec![0.0; 4], vec![0.0; 1]);
            inference.forward(&params, &obs[agent * 3..(agent + 1) * 3], 1, &mut h, &mut l, &mut v);
            for (a, b) in l.iter().zip(&logits[agent * 4..(agent + 1) * 4]) {
                assert!((a - b).abs() < 1e-6);
            }
            assert!((v[0] - values[agent]).abs() < 1e-6);
            for (a, b) in h.iter().zip(&hidden[agent * 5..(agent + 1) * 5]) {
                assert!((a - b).abs() < 1e-6);
            }
        }
    }
}
