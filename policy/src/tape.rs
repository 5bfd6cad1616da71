//! Sequence forward and backward-through-time for the learner.

use super::inference::split_heads;
use super::layout::{DenseOffsets, ParamLayout};
use super::linalg::{act_backward_in_place, column_sums, dense_forward, gemm, Mat};
use super::{gru, Activation, PolicyError};

/// Forward over a time-major `[T][B]` sequence that records every activation, and the matching
/// backward pass (backprop through time) into a flat gradient buffer.
///
/// Work is batched as widely as the data dependencies allow: the torso, the GRU's input
/// projection and the heads each run as one GEMM over all `T·B` rows; only the GRU's
/// hidden-to-hidden product runs per time step, over all `B` columns at once. Backward mirrors
/// this, so weight gradients are single `T·B`-deep GEMMs.
///
/// Buffers grow to the largest `T·B` seen and are reused, so steady-state calls allocate nothing
/// of their own (`matrixmultiply` takes a short-lived packing buffer per product internally).
///
/// `episode_start[t][b]` non-zero (1.0 by convention) means a new episode begins at step `t` in
/// column `b`: the recurrent state entering step `t` is replaced by zeros, and no gradient flows
/// back across that boundary. No gradient flows into `h0`.
///
/// ```
/// use volley_policy::{Activation, ParamLayout, PolicySpec, PolicyTape};
/// let layout = ParamLayout::new(&PolicySpec::gru(4, 2, &[16], Activation::Tanh, 8)).unwrap();
/// let params = layout.init_params(0);
/// let (t_len, b_len) = (5, 3);
/// let obs = vec![0.5f32; t_len * b_len * 4];
/// let episode_start = vec![0.0f32; t_len * b_len];
/// let h0 = vec![0.0f32; b_len * 8];
/// let mut tape = PolicyTape::new(&layout);
/// tape.forward(&params, &obs, &episode_start, &h0, t_len, b_len);
/// assert_eq!(tape.logits().len(), t_len * b_len * 2);
/// // d(Σ values)/dparams:
/// let dlogits = vec![0.0f32; t_len * b_len * 2];
/// let dvalues = vec![1.0f32; t_len * b_len];
/// let mut grads = vec![0.0f32; layout.n_params()];
/// tape.backward(&params, &dlogits, &dvalues, &mut grads);
/// assert!(grads.iter().all(|g| g.is_finite()));
/// ```
#[derive(Debug, Clone)]
pub struct PolicyTape {
    layout: ParamLayout,
    t_len: usize,
    b_len: usize,
    /// Whether the recorded activations belong to a completed forward.
    forwarded: bool,
    /// Copies of the forward inputs that backward needs: `[T·B][obs_dim]` and `[T·B]`.
    obs: Vec<f32>,
    episode_start: Vec<f32>,
    /// Post-activation output of each torso layer, `[T·B][torso[i]]`.
    torso_out: Vec<Vec<f32>>,
    /// GRU records, `[T·B][3H]`: input projection `x W_iᵀ + b_i`, hidden projection
    /// `h W_hᵀ + b_h`, gate activations `[r, z, n]`.
    gi: Vec<f32>,
    gh: Vec<f32>,
    gates: Vec<f32>,
    /// GRU state entering each step (after resets) and leaving it, `[T·B][H]`.
    h_prev: Vec<f32>,
    h_out: Vec<f32>,
    /// Post-activation output of each layer of the separate value network, `[T·B][critic[i]]`.
    critic_out: Vec<Vec<f32>>,
    /// Head output, `[T·B][A + 1]` fused (`[T·B][A]` with a separate value network), and its
    /// split into logits `[T·B][A]` and values `[T·B]`.
    heads_out: Vec<f32>,
    logits: Vec<f32>,
    values: Vec<f32>,
    /// Backward scratch.
    d_heads: Vec<f32>,
    d_a: Vec<f32>,
    d_b: Vec<f32>,
    d_gi: Vec<f32>,
    d_gh: Vec<f32>,
    d_h: Vec<f32>,
}

/// Grow `buffer` to at least `len` elements; never shrinks, so a smaller call reuses it as is.
fn ensure_len(buffer: &mut Vec<f32>, len: usize) {
    if buffer.len() < len {
        buffer.resize(len, 0.0);
    }
}

impl PolicyTape {
    /// An empty tape for `layout`; buffers are sized by the first forward.
    ///
    /// # Panics
    /// If the layout has a conv torso: the tape is the dense and recurrent reference; conv
    /// torsos are trained by the learner's generic network (`volley_learner::net`), which is
    /// checked against finite differences and against [`PolicyInference`](super::PolicyInference).
    pub fn new(layout: &ParamLayout) -> Self {
        assert!(layout.conv().is_empty(), "PolicyTape does not support conv torsos");
        PolicyTape {
            layout: layout.clone(),
            t_len: 0,
            b_len: 0,
            forwarded: false,
            obs: Vec::new(),
            episode_start: Vec::new(),
            torso_out: vec![Vec::new(); layout.torso().len()],
            critic_out: vec![Vec::new(); layout.critic().len()],
            gi: Vec::new(),
            gh: Vec::new(),
            gates: Vec::new(),
            h_prev: Vec::new(),
            h_out: Vec::new(),
            heads_out: Vec::new(),
            logits: Vec::new(),
            values: Vec::new(),
            d_heads: Vec::new(),
            d_a: Vec::new(),
            d_b: Vec::new(),
            d_gi: Vec::new(),
            d_gh: Vec::new(),
            d_h: Vec::new(),
        }
    }

    /// The layout this tape was built for.
    pub fn layout(&self) -> &ParamLayout {
        &self.layout
    }

    /// Run the network over a sequence and record what backward needs.
    ///
    /// * `obs`: `[T][B][obs_dim]`.
    /// * `episode_start`: `[T][B]`; non-zero zeroes the recurrent state before step `t`.
    /// * `h0`: `[B][H]`, the recurrent state before step 0 (empty for a feed-forward policy).
    ///
    /// # Panics
    /// If a length disagrees with the layout, or `t_len` or `b_len` is 0; these are caller
    /// invariants. Use [`try_forward`](Self::try_forward) to get a [`PolicyError`] instead.
    pub fn forward(
        &mut self,
        params: &[f32],
        obs: &[f32],
        episode_start: &[f32],
        h0: &[f32],
        t_len: usize,
        b_len: usize,
    ) {
        if let Err(err) = self.try_forward(params, obs, episode_start, h0, t_len, b_len) {
            panic!("PolicyTape::forward: {err}");
        }
    }

    /// [`forward`](Self::forward) that reports bad sizes as [`PolicyError`] instead of panicking.
    pub fn try_forward(
        &mut self,
        params: &[f32],
        obs: &[f32],
        episode_start: &[f32],
        h0: &[f32],
        t_len: usize,
        b_len: usize,
    ) -> Result<(), PolicyError> {
        for (field, value) in [("t_len", t_len), ("b_len", b_len)] {
            if value == 0 {
                return Err(PolicyError::BatchSize { field, value, rule: "at least 1".into() });
            }
        }
        let rows = t_len.checked_mul(b_len).ok_or_else(|| PolicyError::BatchSize {
            field: "t_len * b_len",
            value: usize::MAX,
            rule: "representable".into(),
        })?;
        let layout = &self.layout;
        let checks = [
            ("params", Some(layout.n_params()), params.len()),
            ("obs", rows.checked_mul(layout.obs_dim()), obs.len()),
            ("episode_start", Some(rows), episode_start.len()),
            ("h0", b_len.checked_mul(layout.recurrent_size()), h0.len()),
        ];
        for (field, expected, got) in checks {
            if expected != Some(got) {
                return Err(shape_error(field, expected.unwrap_or(usize::MAX), got));
            }
        }
        self.forwarded = false;
        self.run_forward(params, obs, episode_start, h0, t_len, b_len);
        self.forwarded = true;
        Ok(())
    }

    /// Logits of the last forward, `[T][B][n_actions]`.
    pub fn logits(&self) -> &[f32] {
        &self.logits[..self.t_len * self.b_len * self.layout.n_actions()]
    }

    /// Values of the last forward, `[T][B]`.
    pub fn values(&self) -> &[f32] {
        &self.values[..self.t_len * self.b_len]
    }

    /// The recurrent state after the last step of the last forward, `[B][H]` (empty for a
    /// feed-forward policy).
    pub fn last_hidden(&self) -> &[f32] {
        let block = self.b_len * self.layout.recurrent_size();
        let rows_end = self.t_len * block;
        &self.h_out[rows_end - block..rows_end]
    }

    /// Backprop `∂L/∂logits` (`[T][B][n_actions]`) and `∂L/∂values` (`[T][B]`) through the
    /// recorded sequence and overwrite `grads` (`n_params` long) with `∂L/∂params`.
    ///
    /// `params` must be the buffer the last forward ran with.
    ///
    /// # Panics
    /// If a length disagrees with the last forward, or no forward ran yet. Use
    /// [`try_backward`](Self::try_backward) to get a [`PolicyError`] instead.
    pub fn backward(&mut self, params: &[f32], dlogits: &[f32], dvalues: &[f32], grads: &mut [f32]) {
        if let Err(err) = self.try_backward(params, dlogits, dvalues, grads) {
            panic!("PolicyTape::backward: {err}");
        }
    }

    /// [`backward`](Self::backward) that reports bad sizes as [`PolicyError`] instead of
    /// panicking.
    pub fn try_backward(
        &mut self,
        params: &[f32],
        dlogits: &[f32],
        dvalues: &[f32],
        grads: &mut [f32],
    ) -> Result<(), PolicyError> {
        if !self.forwarded {
            return Err(PolicyError::BackwardBeforeForward);
        }
        let rows = self.t_len * self.b_len;
        let n_params = self.layout.n_params();
        let checks = [
            ("params", n_params, params.len()),
            ("dlogits", rows * self.layout.n_actions(), dlogits.len()),
            ("dvalues", rows, dvalues.len()),
            ("grads", n_params, grads.len()),
        ];
        for (field, expected, got) in checks {
            if expected != got {
                return Err(shape_error(field, expected, got));
            }
        }
        self.run_backward(params, dlogits, dvalues, grads);
        Ok(())
    }

    fn run_forward(
        &mut self,
        params: &[f32],
        obs: &[f32],
        episode_start: &[f32],
        h0: &[f32],
        t_len: usize,
        b_len: usize,
    ) {
        let rows = t_len * b_len;
        self.t_len = t_len;
        self.b_len = b_len;
        let layout = &self.layout;
        ensure_len(&mut self.obs, obs.len());
        self.obs[..obs.len()].copy_from_slice(obs);
        ensure_len(&mut self.episode_start, rows);
        self.episode_start[..rows].copy_from_slice(episode_start);

        // Torso (and the separate value network): no recurrence, so each layer is one GEMM over
        // all T·B rows.
        let activation = layout.spec().activation;
        dense_stack_forward(layout.torso(), params, &self.obs, rows, activation, &mut self.torso_out);
        dense_stack_forward(layout.critic(), params, &self.obs, rows, activation, &mut self.critic_out);
        let torso_features: &[f32] = self.torso_out.last().unwrap_or(&self.obs);

        let features: &[f32] = match layout.gru() {
            None => torso_features,
            Some(gru) => {
                let hidden = gru.hidden;
                let (state, gates) = (b_len * hidden, b_len * 3 * hidden);
                for buffer in [&mut self.gi, &mut self.gh, &mut self.gates] {
                    ensure_len(buffer, rows * 3 * hidden);
                }
                ensure_len(&mut self.h_prev, rows * hidden);
                ensure_len(&mut self.h_out, rows * hidden);
                // The input projection does not depend on h: one GEMM for the whole sequence.
                dense_forward(torso_features, rows, gru.weight_ih(params), gru.bias_ih(params), None, &mut self.gi);
                for t in 0..t_len {
                    let (h_done, h_rest) = self.h_out.split_at_mut(t * state);
                    let source = if t == 0 { h0 } else { &h_done[(t - 1) * state..] };
                    let h_prev = &mut self.h_prev[t * state..(t + 1) * state];
                    let starts = &episode_start[t * b_len..(t + 1) * b_len];
                    for ((h_prev, source), &start) in
                        h_prev.chunks_exact_mut(hidden).zip(source.chunks_exact(hidden)).zip(starts)
                    {
                        if start != 0.0 {
                            h_prev.fill(0.0);
                        } else {
                            h_prev.copy_from_slice(source);
                        }
                    }
                    let gh = &mut self.gh[t * gates..(t + 1) * gates];
                    dense_forward(h_prev, b_len, gru.weight_hh(params), gru.bias_hh(params), None, gh);
                    gru::cell_forward(
                        &self.gi[t * gates..(t + 1) * gates],
                        gh,
                        h_prev,
                        hidden,
                        &mut self.gates[t * gates..(t + 1) * gates],
                        &mut h_rest[..state],
                    );
                }
                &self.h_out
            }
        };

        // Both heads in one GEMM over all T·B rows.
        let heads = layout.heads();
        let n_actions = layout.n_actions();
        ensure_len(&mut self.heads_out, rows * heads.n_out);
        ensure_len(&mut self.logits, rows * n_actions);
        ensure_len(&mut self.values, rows);
        let heads_out = &mut self.heads_out[..rows * heads.n_out];
        dense_forward(features, rows, heads.weight(params), heads.bias(params), None, heads_out);
        match (layout.value_head(), self.critic_out.last()) {
            (Some(value), Some(critic_features)) => {
                self.logits[..rows * n_actions].copy_from_slice(heads_out);
                let values = &mut self.values[..rows];
                dense_forward(critic_features, rows, value.weight(params), value.bias(params), None, values);
            }
            _ => split_heads(heads_out, n_actions, &mut self.logits[..rows * n_actions], &mut self.values[..rows]),
        }
    }

    fn run_backward(&mut self, params: &[f32], dlogits: &[f32], dvalues: &[f32], grads: &mut [f32]) {
        let (t_len, b_len) = (self.t_len, self.b_len);
        let rows = t_len * b_len;
        let layout = &self.layout;
        let n_actions = layout.n_actions();
        let heads = layout.heads();
        let torso = layout.torso();
        let obs = &self.obs[..rows * layout.obs_dim()];
        let torso_features: &[f32] = match (self.torso_out.last(), torso.last()) {
            (Some(out), Some(last)) => &out[..rows * last.n_out],
            _ => obs,
        };
        let features: &[f32] = match layout.gru() {
            Some(gru) => &self.h_out[..rows * gru.hidden],
            None => torso_features,
        };

        let activation = layout.spec().activation;
        let mut d_cur = std::mem::take(&mut self.d_a);
        let mut d_next = std::mem::take(&mut self.d_b);
        let d_heads: &[f32] = match (layout.value_head(), layout.critic().last()) {
            (Some(value), Some(last)) => {
                // The separate value network: its head, then its layers back to the observations.
                let critic_features = &self.critic_out[layout.critic().len() - 1][..rows * last.n_out];
                dense_param_grads(&value, dvalues, critic_features, rows, grads);
                let d_values = Mat::row_major(dvalues, rows, 1);
                let widest = layout.critic().iter().map(|layer| layer.n_out).max().unwrap_or(0);
                ensure_len(&mut d_cur, rows * widest);
                ensure_len(&mut d_next, rows * widest);
                let weight = Mat::row_major(value.weight(params), 1, value.n_in);
                gemm(1.0, d_values, weight, 0.0, &mut d_cur[..rows * value.n_in]);
                let critic = (layout.critic(), self.critic_out.as_slice());
                dense_stack_backward(critic, obs, params, rows, activation, &mut d_cur, &mut d_next, grads);
                // The policy head alone.
                dlogits
            }
            _ => {
                // Heads: assemble ∂L/∂[logits, value] and take both heads' gradients at once.
                ensure_len(&mut self.d_heads, rows * heads.n_out);
                let d_heads = &mut self.d_heads[..rows * heads.n_out];
                for ((d_row, dlogits), &dvalue) in
                    d_heads.chunks_exact_mut(heads.n_out).zip(dlogits.chunks_exact(n_actions)).zip(dvalues)
                {
                    d_row[..n_actions].copy_from_slice(dlogits);
                    d_row[n_actions] = dvalue;
                }
                &*d_heads
            }
        };
        dense_param_grads(&heads, d_heads, features, rows, grads);

        // ∂L/∂features is only needed if something upstream has parameters.
        if torso.is_empty() && layout.gru().is_none() {
            self.d_a = d_cur;
            self.d_b = d_next;
            return;
        }
        // `d_cur` always holds ∂L/∂(output of the layer being processed).
        let widest = layout.max_torso_width().max(heads.n_in);
        ensure_len(&mut d_cur, rows * widest);
        ensure_len(&mut d_next, rows * widest);
        gemm(
            1.0,
            Mat::row_major(d_heads, rows, heads.n_out),
            Mat::row_major(heads.weight(params), heads.n_out, heads.n_in),
            0.0,
            &mut d_cur[..rows * heads.n_in],
        );

        if let Some(gru) = layout.gru() {
            let hidden = gru.hidden;
            let (state, gates) = (b_len * hidden, b_len * 3 * hidden);
            ensure_len(&mut self.d_gi, rows * 3 * hidden);
            ensure_len(&mut self.d_gh, rows * 3 * hidden);
            ensure_len(&mut self.d_h, state);
            // `d_h` carries ∂L/∂h_t backwards through time; nothing flows in after step T−1.
            let d_h = &mut self.d_h[..state];
            d_h.fill(0.0);
            let weight_hh = Mat::row_major(gru.weight_hh(params), 3 * hidden, hidden);
            for t in (0..t_len).rev() {
                for (d, &from_heads) in d_h.iter_mut().zip(&d_cur[t * state..(t + 1) * state]) {
                    *d += from_heads;
                }
                let step_gates = t * gates..(t + 1) * gates;
                gru::cell_backward(
                    d_h,
                    &self.gates[step_gates.clone()],
                    &self.gh[step_gates.clone()],
                    &self.h_prev[t * state..(t + 1) * state],
                    hidden,
                    &mut self.d_gi[step_gates.clone()],
                    &mut self.d_gh[step_gates.clone()],
                );
                if t == 0 {
                    // No gradient into h0.
                    break;
                }
                gemm(1.0, Mat::row_major(&self.d_gh[step_gates], b_len, 3 * hidden), weight_hh, 1.0, d_h);
                // A reset at step t replaced h_{t−1} with zeros, so it receives no gradient.
                let starts = &self.episode_start[t * b_len..(t + 1) * b_len];
                for (d_row, &start) in d_h.chunks_exact_mut(hidden).zip(starts) {
                    if start != 0.0 {
                        d_row.fill(0.0);
                    }
                }
            }
            // Weight gradients summed over all steps: one T·B-deep GEMM each.
            let d_gi = &self.d_gi[..rows * 3 * hidden];
            let d_gh = &self.d_gh[..rows * 3 * hidden];
            gemm(
                1.0,
                Mat::row_major(d_gi, rows, 3 * hidden).t(),
                Mat::row_major(torso_features, rows, gru.n_in),
                0.0,
                &mut grads[gru.weight_ih..gru.weight_ih + 3 * hidden * gru.n_in],
            );
            column_sums(d_gi, &mut grads[gru.bias_ih..gru.bias_ih + 3 * hidden]);
            gemm(
                1.0,
                Mat::row_major(d_gh, rows, 3 * hidden).t(),
                Mat::row_major(&self.h_prev[..rows * hidden], rows, hidden),
                0.0,
                &mut grads[gru.weight_hh..gru.weight_hh + 3 * hidden * hidden],
            );
            column_sums(d_gh, &mut grads[gru.bias_hh..gru.bias_hh + 3 * hidden]);
            if !torso.is_empty() {
                gemm(
                    1.0,
                    Mat::row_major(d_gi, rows, 3 * hidden),
                    Mat::row_major(gru.weight_ih(params), 3 * hidden, gru.n_in),
                    0.0,
                    &mut d_cur[..rows * gru.n_in],
                );
            }
        }

        let torso = (torso, self.torso_out.as_slice());
        dense_stack_backward(torso, obs, params, rows, activation, &mut d_cur, &mut d_next, grads);
        self.d_a = d_cur;
        self.d_b = d_next;
    }
}

/// A dense layer's weight and bias gradients from `rows` rows of `dy` (∂L/∂ its pre-activation
/// output) and of its input `x`, written into their ranges of `grads`.
fn dense_param_grads(layer: &DenseOffsets, dy: &[f32], x: &[f32], rows: usize, grads: &mut [f32]) {
    let (weight, bias) = (layer.weight..layer.weight + layer.n_out * layer.n_in, layer.bias..layer.bias + layer.n_out);
    gemm(1.0, Mat::row_major(dy, rows, layer.n_out).t(), Mat::row_major(x, rows, layer.n_in), 0.0, &mut grads[weight]);
    column_sums(dy, &mut grads[bias]);
}

/// Run a stack of dense layers with `activation` over `rows` rows of `input`, keeping each
/// layer's output in `outs` for the backward.
fn dense_stack_forward(
    layers: &[DenseOffsets],
    params: &[f32],
    input: &[f32],
    rows: usize,
    activation: Activation,
    outs: &mut [Vec<f32>],
) {
    for (layer_idx, layer) in layers.iter().enumerate() {
        let (before, rest) = outs.split_at_mut(layer_idx);
        let x: &[f32] = if layer_idx == 0 { input } else { &before[layer_idx - 1] };
        let y = &mut rest[0];
        ensure_len(y, rows * layer.n_out);
        dense_forward(x, rows, layer.weight(params), layer.bias(params), Some(activation), y);
    }
}

/// Backprop through a stack of dense layers (`layers` and the outputs their forward kept) from
/// `d_cur` = ∂L/∂(last layer's output), writing each layer's weight and bias gradients. The
/// stack's input (`input`, the observations) gets no gradient. `d_cur` and `d_next` are
/// scratch at least as wide as the widest layer; they may swap.
#[allow(clippy::too_many_arguments)]
fn dense_stack_backward(
    (layers, outs): (&[DenseOffsets], &[Vec<f32>]),
    input: &[f32],
    params: &[f32],
    rows: usize,
    activation: Activation,
    d_cur: &mut Vec<f32>,
    d_next: &mut Vec<f32>,
    grads: &mut [f32],
) {
    for (layer_idx, layer) in layers.iter().enumerate().rev() {
        let y = &outs[layer_idx][..rows * layer.n_out];
        let d_pre = &mut d_cur[..rows * layer.n_out];
        act_backward_in_place(d_pre, y, activation);
        let x: &[f32] = if layer_idx == 0 { input } else { &outs[layer_idx - 1][..rows * layer.n_in] };
        dense_param_grads(layer, d_pre, x, rows, grads);
        if layer_idx > 0 {
            gemm(
                1.0,
                Mat::row_major(d_pre, rows, layer.n_out),
                Mat::row_major(layer.weight(params), layer.n_out, layer.n_in),
                0.0,
                &mut d_next[..rows * layer.n_in],
            );
            std::mem::swap(d_cur, d_next);
        }
    }
}

#[cold]
fn shape_error(field: &'static str, expected: usize, got: usize) -> PolicyError {
    PolicyError::Shape { field, expected, got }
}

#[cfg(test)]
mod tests {
    use super::super::{Activation, PolicyInference, PolicySpec};
    use super::*;
    use crate::layout::tests::arb_spec;
    use proptest::prelude::*;
    use rand::{Rng, SeedableRng};
    use rand_pcg::Pcg64;

    /// Inputs for one sequence, with the scalar loss `L = Σ c_logits·logits + Σ c_values·values`.
    struct Sequence {
        t_len: usize,
        b_len: usize,
        obs: Vec<f32>,
        episode_start: Vec<f32>,
        h0: Vec<f32>,
        c_logits: Vec<f32>,
        c_values: Vec<f32>,
    }

    fn uniform(rng: &mut Pcg64, n: usize, scale: f32) -> Vec<f32> {
        (0..n).map(|_| rng.random_range(-scale..scale)).collect()
    }

    /// Parameters large enough that every path carries signal (the cleanrl init's 0.01 policy
    /// head would hide torso errors behind tiny gradients).
    fn random_params(layout: &ParamLayout, rng: &mut Pcg64) -> Vec<f32> {
        let mut params = vec![0.0; layout.n_params()];
        for entry in layout.entries() {
            let scale =
                if entry.rows == 1 && entry.name.contains("bias") { 0.5 } else { 1.5 / (entry.cols as f32).sqrt() };
            for p in &mut params[entry.range()] {
                *p = rng.random_range(-scale..scale);
            }
        }
        params
    }

    fn sequence(
        layout: &ParamLayout,
        t_len: usize,
        b_len: usize,
        resets: &[(usize, usize)],
        rng: &mut Pcg64,
    ) -> Sequence {
        let rows = t_len * b_len;
        let mut episode_start = vec![0.0; rows];
        for &(t, b) in resets {
            episode_start[t * b_len + b] = 1.0;
        }
        Sequence {
            t_len,
            b_len,
            obs: uniform(rng, rows * layout.obs_dim(), 1.0),
            episode_start,
            h0: uniform(rng, b_len * layout.recurrent_size(), 0.8),
            c_logits: uniform(rng, rows * layout.n_actions(), 1.0),
            c_values: uniform(rng, rows, 1.0),
        }
    }

    fn loss(tape: &mut PolicyTape, params: &[f32], seq: &Sequence) -> f64 {
        tape.forward(params, &seq.obs, &seq.episode_start, &seq.h0, seq.t_len, seq.b_len);
        let logit_part: f64 = tape.logits().iter().zip(&seq.c_logits).map(|(&x, &c)| f64::from(x) * f64::from(c)).sum();
        let value_part: f64 = tape.values().iter().zip(&seq.c_values).map(|(&x, &c)| f64::from(x) * f64::from(c)).sum();
        logit_part + value_part
    }

    fn analytic_grads(tape: &mut PolicyTape, params: &[f32], seq: &Sequence) -> Vec<f32> {
        tape.forward(params, &seq.obs, &seq.episode_start, &seq.h0, seq.t_len, seq.b_len);
        // NaN-filled so any parameter backward forgets to write shows up as a mismatch.
        let mut grads = vec![f32::NAN; params.len()];
        tape.backward(params, &seq.c_logits, &seq.c_values, &mut grads);
        grads
    }

    /// Which ReLU units are active; a central difference straddling a kink is meaningless.
    fn relu_pattern(tape: &PolicyTape) -> Vec<bool> {
        tape.torso_out.iter().flat_map(|out| out.iter().map(|&y| y > 0.0)).collect()
    }

    /// Central differences `(L(p + ε) − L(p − ε)) / 2ε` with `ε = 1e-3 · max(1, |p|)`; `None`
    /// where the perturbation flips a ReLU.
    fn numeric_grads(tape: &mut PolicyTape, params: &[f32], seq: &Sequence) -> Vec<Option<f64>> {
        let relu = tape.layout.spec().activation == Activation::Relu;
        loss(tape, params, seq);
        let base_pattern = relu_pattern(tape);
        let mut perturbed = params.to_vec();
        (0..params.len())
            .map(|idx| {
                let p = params[idx];
                let eps = 1e-3 * p.abs().max(1.0);
                let (p_plus, p_minus) = (p + eps, p - eps);
                perturbed[idx] = p_plus;
                let loss_plus = loss(tape, &perturbed, seq);
                let kink_plus = relu && relu_pattern(tape) != base_pattern;
                perturbed[idx] = p_minus;
                let loss_minus = loss(tape, &perturbed, seq);
                let kink_minus = relu && relu_pattern(tape) != base_pattern;
                perturbed[idx] = p;
                let step = f64::from(p_plus) - f64::from(p_minus);
                (!(kink_plus || kink_minus)).then(|| (loss_plus - loss_minus) / step)
            })
            .collect()
    }

    const GRAD_ATOL: f64 = 2e-3;
    const GRAD_RTOL: f64 = 1e-2;

    fn gradient_mismatches(analytic: &[f32], numeric: &[Option<f64>]) -> Vec<usize> {
        analytic
            .iter()
            .zip(numeric)
            .enumerate()
            .filter_map(|(idx, (&a, n))| {
                let n = (*n)?;
                let a = f64::from(a);
                let ok = (a - n).abs() <= GRAD_ATOL + GRAD_RTOL * a.abs().max(n.abs());
                (!ok).then_some(idx)
            })
            .collect()
    }

    /// Gradient-check `spec` on a random sequence with `resets`, and check that the check itself
    /// catches a 3 % error in the largest gradient of every parameter entry.
    fn assert_gradients_match(spec: PolicySpec, t_len: usize, b_len: usize, resets: &[(usize, usize)]) {
        let layout = ParamLayout::new(&spec).unwrap();
        let mut rng = Pcg64::seed_from_u64(layout.hash());
        let params = random_params(&layout, &mut rng);
        let seq = sequence(&layout, t_len, b_len, resets, &mut rng);
        let mut tape = PolicyTape::new(&layout);
        let analytic = analytic_grads(&mut tape, &params, &seq);
        let numeric = numeric_grads(&mut tape, &params, &seq);

        let skipped = numeric.iter().filter(|n| n.is_none()).count();
        assert!(
            skipped * 10 <= numeric.len(),
            "{spec:?}: {skipped} of {} parameters straddle a ReLU kink",
            numeric.len()
        );
        let bad = gradient_mismatches(&analytic, &numeric);
        let describe = |idx: usize| {
            let entry = layout.entries().iter().find(|e| e.range().contains(&idx)).unwrap();
            format!("{}[{}]: analytic {} numeric {:?}", entry.name, idx - entry.offset, analytic[idx], numeric[idx])
        };
        assert!(
            bad.is_empty(),
            "{spec:?}: {} gradient mismatches, e.g. {}",
            bad.len(),
            bad.iter().take(5).map(|&idx| describe(idx)).collect::<Vec<_>>().join("; ")
        );

        // Negative control: the comparison must detect a small error in every entry.
        for entry in layout.entries() {
            let (idx, g) = entry
                .range()
                .filter_map(|idx| numeric[idx].map(|n| (idx, n)))
                .max_by(|a, b| a.1.abs().total_cmp(&b.1.abs()))
                .expect("entry has a checkable parameter");
            assert!(g.abs() > 10.0 * GRAD_ATOL, "{}: gradient {g} too small to check", entry.name);
            let mut wrong = analytic.clone();
            wrong[idx] += (0.03 * g.abs() + 3.0 * GRAD_ATOL) as f32;
            assert_eq!(gradient_mismatches(&wrong, &numeric), [idx], "{} not sensitive", entry.name);
        }
    }

    #[test]
    fn gradients_match_finite_differences_for_tanh_mlp() {
        assert_gradients_match(PolicySpec::mlp(5, 3, &[7, 6], Activation::Tanh), 4, 3, &[]);
    }

    #[test]
    fn gradients_match_finite_differences_for_relu_mlp() {
        assert_gradients_match(PolicySpec::mlp(5, 3, &[7, 6], Activation::Relu), 4, 3, &[]);
    }

    #[test]
    fn gradients_match_finite_differences_for_linear_policy() {
        assert_gradients_match(PolicySpec::mlp(4, 2, &[], Activation::Tanh), 3, 2, &[]);
    }

    #[test]
    fn gradients_match_finite_differences_with_a_separate_value_network() {
        assert_gradients_match(PolicySpec::mlp(5, 3, &[7, 6], Activation::Tanh).with_critic(&[6, 5]), 4, 3, &[]);
        assert_gradients_match(PolicySpec::mlp(5, 3, &[7], Activation::Relu).with_critic(&[8]), 4, 3, &[]);
        // A linear policy beside a value network.
        assert_gradients_match(PolicySpec::mlp(4, 2, &[], Activation::Tanh).with_critic(&[5]), 3, 2, &[]);
    }

    #[test]
    fn a_separate_value_network_keeps_the_value_loss_out_of_the_policy_torso() {
        let layout = ParamLayout::new(&PolicySpec::mlp(5, 3, &[7, 6], Activation::Tanh).with_critic(&[6])).unwrap();
        let mut rng = Pcg64::seed_from_u64(7);
        let params = random_params(&layout, &mut rng);
        let mut seq = sequence(&layout, 4, 3, &[], &mut rng);
        // A loss on the values alone moves only the value network; one on the logits alone
        // only the policy's.
        seq.c_logits.fill(0.0);
        let value_grads = analytic_grads(&mut PolicyTape::new(&layout), &params, &seq);
        for entry in layout.entries() {
            let moved = value_grads[entry.range()].iter().any(|&g| g != 0.0);
            let critic = entry.name.starts_with("critic.") || entry.name.starts_with("value.");
            assert_eq!(moved, critic, "{}", entry.name);
        }
    }

    #[test]
    fn gradients_match_finite_differences_for_tanh_mlp_gru_with_resets() {
        let resets = [(0, 1), (2, 0), (3, 2), (4, 0)];
        assert_gradients_match(PolicySpec::gru(4, 3, &[6], Activation::Tanh, 5), 6, 3, &resets);
    }

    #[test]
    fn gradients_match_finite_differences_for_relu_mlp_gru_with_resets() {
        let resets = [(1, 0), (3, 1), (3, 2)];
        assert_gradients_match(PolicySpec::gru(4, 2, &[6, 5], Activation::Relu, 4), 6, 3, &resets);
    }

    #[test]
    fn gradients_match_finite_differences_for_gru_without_torso() {
        let resets = [(2, 1), (4, 0)];
        assert_gradients_match(PolicySpec::gru(3, 4, &[], Activation::Tanh, 6), 7, 2, &resets);
    }

    #[test]
    fn recurrent_gradient_does_not_cross_an_episode_start() {
        // Every column resets at t = 2 and the loss only weighs outputs at t ≥ 2, so steps 0 and 1
        // cannot influence the loss. The gradient must then equal that of a tape that only ever
        // saw steps 2.. from a zero state; gradient leaking across the reset would differ.
        let spec = PolicySpec::gru(3, 2, &[4], Activation::Tanh, 5);
        let layout = ParamLayout::new(&spec).unwrap();
        let mut rng = Pcg64::seed_from_u64(5);
        let params = random_params(&layout, &mut rng);
        let (t_len, b_len, reset_t) = (5, 2, 2);
        let resets: Vec<(usize, usize)> = (0..b_len).map(|b| (reset_t, b)).collect();
        let mut seq = sequence(&layout, t_len, b_len, &resets, &mut rng);
        for c in &mut seq.c_logits[..reset_t * b_len * 2] {
            *c = 0.0;
        }
        for c in &mut seq.c_values[..reset_t * b_len] {
            *c = 0.0;
        }
        let mut tape = PolicyTape::new(&layout);
        let full = analytic_grads(&mut tape, &params, &seq);
        let tail = Sequence {
            t_len: t_len - reset_t,
            b_len,
            obs: seq.obs[reset_t * b_len * 3..].to_vec(),
            episode_start: seq.episode_start[reset_t * b_len..].to_vec(),
            h0: vec![0.0; b_len * 5],
            c_logits: seq.c_logits[reset_t * b_len * 2..].to_vec(),
            c_values: seq.c_values[reset_t * b_len..].to_vec(),
        };
        let tail_grads = analytic_grads(&mut PolicyTape::new(&layout), &params, &tail);
        for (a, b) in full.iter().zip(&tail_grads) {
            assert!((a - b).abs() <= 1e-5 * (1.0 + b.abs()), "{a} vs {b}");
        }
    }

    fn assert_close(a: &[f32], b: &[f32], tol: f32, what: &str) {
        assert_eq!(a.len(), b.len(), "{what} lengths");
        for (idx, (x, y)) in a.iter().zip(b).enumerate() {
            assert!((x - y).abs() <= tol, "{what}[{idx}]: {x} vs {y}");
        }
    }

    /// Step `PolicyInference` through the sequence, zeroing an agent's state where its episode
    /// starts, as an actor does; returns `(logits, values, final hidden)`.
    fn run_inference(layout: &ParamLayout, params: &[f32], seq: &Sequence) -> (Vec<f32>, Vec<f32>, Vec<f32>) {
        let (n_actions, hidden_size, obs_dim) = (layout.n_actions(), layout.recurrent_size(), layout.obs_dim());
        let b_len = seq.b_len;
        let mut inference = PolicyInference::new(layout, b_len);
        let mut hidden = seq.h0.clone();
        let mut logits = vec![0.0; seq.t_len * b_len * n_actions];
        let mut values = vec![0.0; seq.t_len * b_len];
        for t in 0..seq.t_len {
            for (h_row, &start) in
                hidden.chunks_exact_mut(hidden_size.max(1)).zip(&seq.episode_start[t * b_len..(t + 1) * b_len])
            {
                if start != 0.0 {
                    h_row.fill(0.0);
                }
            }
            inference.forward(
                params,
                &seq.obs[t * b_len * obs_dim..(t + 1) * b_len * obs_dim],
                b_len,
                &mut hidden,
                &mut logits[t * b_len * n_actions..(t + 1) * b_len * n_actions],
                &mut values[t * b_len..(t + 1) * b_len],
            );
        }
        (logits, values, hidden)
    }

    fn assert_inference_matches_tape(
        spec: &PolicySpec,
        t_len: usize,
        b_len: usize,
        resets: &[(usize, usize)],
        seed: u64,
    ) {
        let layout = ParamLayout::new(spec).unwrap();
        let mut rng = Pcg64::seed_from_u64(seed);
        let params = random_params(&layout, &mut rng);
        let seq = sequence(&layout, t_len, b_len, resets, &mut rng);
        let mut tape = PolicyTape::new(&layout);
        tape.forward(&params, &seq.obs, &seq.episode_start, &seq.h0, t_len, b_len);
        let (logits, values, hidden) = run_inference(&layout, &params, &seq);
        assert_close(tape.logits(), &logits, 1e-5, "logits");
        assert_close(tape.values(), &values, 1e-5, "values");
        assert_close(tape.last_hidden(), &hidden, 1e-5, "hidden");
    }

    #[test]
    fn inference_steps_match_tape_forward_for_mlp() {
        let spec = PolicySpec::mlp(4, 2, &[64, 64], Activation::Tanh);
        assert_inference_matches_tape(&spec, 5, 8, &[(2, 3)], 1);
    }

    #[test]
    fn inference_steps_match_tape_forward_with_a_separate_value_network() {
        let spec = PolicySpec::mlp(4, 2, &[64, 64], Activation::Tanh).with_critic(&[64, 64]);
        assert_inference_matches_tape(&spec, 5, 8, &[(2, 3)], 1);
        // Wide enough that inference goes layer by layer instead of one small chain.
        let wide = PolicySpec::mlp(4, 2, &[64], Activation::Relu).with_critic(&[300, 20, 300]);
        assert_inference_matches_tape(&wide, 3, 40, &[], 2);
    }

    #[test]
    fn inference_steps_match_tape_forward_for_gru_with_resets() {
        let spec = PolicySpec::gru(4, 3, &[32], Activation::Relu, 16);
        assert_inference_matches_tape(&spec, 7, 5, &[(0, 0), (3, 1), (3, 4), (5, 1)], 2);
        let no_torso = PolicySpec::gru(4, 3, &[], Activation::Tanh, 16);
        assert_inference_matches_tape(&no_torso, 7, 5, &[(4, 2)], 3);
    }

    #[test]
    fn episode_start_makes_the_rest_of_the_sequence_equal_to_a_fresh_one() {
        let spec = PolicySpec::gru(3, 2, &[8], Activation::Tanh, 6);
        let layout = ParamLayout::new(&spec).unwrap();
        let mut rng = Pcg64::seed_from_u64(9);
        let params = random_params(&layout, &mut rng);
        let (t_len, b_len, reset_t, col) = (6, 3, 2, 1);
        let seq = sequence(&layout, t_len, b_len, &[(reset_t, col)], &mut rng);
        let mut tape = PolicyTape::new(&layout);
        tape.forward(&params, &seq.obs, &seq.episode_start, &seq.h0, t_len, b_len);
        let (full_logits, full_values) = (tape.logits().to_vec(), tape.values().to_vec());

        // Column `col` alone, from step `reset_t`, starting from a zero state.
        let tail_len = t_len - reset_t;
        let obs: Vec<f32> =
            (reset_t..t_len).flat_map(|t| seq.obs[(t * b_len + col) * 3..(t * b_len + col + 1) * 3].to_vec()).collect();
        let mut fresh = PolicyTape::new(&layout);
        fresh.forward(&params, &obs, &vec![0.0; tail_len], &[0.0; 6], tail_len, 1);
        for (step, t) in (reset_t..t_len).enumerate() {
            let row = t * b_len + col;
            assert_close(&full_logits[row * 2..row * 2 + 2], &fresh.logits()[step * 2..step * 2 + 2], 1e-6, "logits");
            assert_close(&full_values[row..row + 1], &fresh.values()[step..step + 1], 1e-6, "values");
        }
        // And without the reset the same column differs (the state really is carried).
        let mut no_reset = PolicyTape::new(&layout);
        no_reset.forward(&params, &seq.obs, &vec![0.0; t_len * b_len], &seq.h0, t_len, b_len);
        let row = reset_t * b_len + col;
        assert!((no_reset.values()[row] - full_values[row]).abs() > 1e-4);
    }

    #[test]
    fn reused_tape_gives_the_same_results_as_a_fresh_one_after_a_larger_call() {
        let spec = PolicySpec::gru(4, 3, &[8, 8], Activation::Tanh, 5);
        let layout = ParamLayout::new(&spec).unwrap();
        let mut rng = Pcg64::seed_from_u64(4);
        let params = random_params(&layout, &mut rng);
        let big = sequence(&layout, 9, 6, &[(3, 3)], &mut rng);
        let small = sequence(&layout, 3, 2, &[(1, 1)], &mut rng);
        let mut reused = PolicyTape::new(&layout);
        analytic_grads(&mut reused, &params, &big);
        let reused_grads = analytic_grads(&mut reused, &params, &small);
        let mut fresh = PolicyTape::new(&layout);
        let fresh_grads = analytic_grads(&mut fresh, &params, &small);
        assert_eq!(reused.logits(), fresh.logits());
        assert_eq!(reused.values(), fresh.values());
        assert_eq!(reused_grads, fresh_grads);
    }

    #[test]
    fn bad_sizes_are_errors_not_panics() {
        let layout = ParamLayout::new(&PolicySpec::gru(3, 2, &[4], Activation::Tanh, 5)).unwrap();
        let params = layout.init_params(0);
        let mut tape = PolicyTape::new(&layout);
        let (obs, es, h0) = (vec![0.0; 2 * 3 * 3], vec![0.0; 2 * 3], vec![0.0; 3 * 5]);
        let mut grads = vec![0.0; layout.n_params()];
        assert_eq!(
            tape.try_backward(&params, &[0.0; 12], &[0.0; 6], &mut grads),
            Err(PolicyError::BackwardBeforeForward)
        );
        let forward_err = |tape: &mut PolicyTape, obs: &[f32], es: &[f32], h0: &[f32], t: usize, b: usize| {
            tape.try_forward(&params, obs, es, h0, t, b).unwrap_err()
        };
        assert!(matches!(forward_err(&mut tape, &obs, &es, &h0, 0, 3), PolicyError::BatchSize { field: "t_len", .. }));
        assert!(matches!(forward_err(&mut tape, &[], &[], &[], 2, 0), PolicyError::BatchSize { field: "b_len", .. }));
        assert!(matches!(forward_err(&mut tape, &obs[1..], &es, &h0, 2, 3), PolicyError::Shape { field: "obs", .. }));
        assert!(matches!(
            forward_err(&mut tape, &obs, &es[1..], &h0, 2, 3),
            PolicyError::Shape { field: "episode_start", .. }
        ));
        assert!(matches!(forward_err(&mut tape, &obs, &es, &[], 2, 3), PolicyError::Shape { field: "h0", .. }));
        assert!(matches!(
            forward_err(&mut tape, &obs, &es, &h0, usize::MAX, 3),
            PolicyError::BatchSize { .. } | PolicyError::Shape { .. }
        ));
        assert!(matches!(
            tape.try_forward(&params[1..], &obs, &es, &h0, 2, 3),
            Err(PolicyError::Shape { field: "params", .. })
        ));
        tape.forward(&params, &obs, &es, &h0, 2, 3);
        assert!(matches!(
            tape.try_backward(&params, &[0.0; 11], &[0.0; 6], &mut grads),
            Err(PolicyError::Shape { field: "dlogits", expected: 12, got: 11 })
        ));
        assert!(matches!(
            tape.try_backward(&params, &[0.0; 12], &[0.0; 5], &mut grads),
            Err(PolicyError::Shape { field: "dvalues", .. })
        ));
        assert!(matches!(
            tape.try_backward(&params, &[0.0; 12], &[0.0; 6], &mut grads[1..]),
            Err(PolicyError::Shape { field: "grads", .. })
        ));
        assert!(tape.try_backward(&params, &[0.0; 12], &[0.0; 6], &mut grads).is_ok());
        assert!(grads.iter().all(|&g| g == 0.0));
    }

    #[test]
    #[should_panic(expected = "PolicyTape::forward: h0: expected 15 elements, got 0")]
    fn forward_panics_with_the_shape_error() {
        let layout = ParamLayout::new(&PolicySpec::gru(3, 2, &[4], Activation::Tanh, 5)).unwrap();
        let params = layout.init_params(0);
        PolicyTape::new(&layout).forward(&params, &[0.0; 18], &[0.0; 6], &[], 2, 3);
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(48))]

        #[test]
        fn inference_matches_tape_for_any_small_spec(
            spec in arb_spec(6, 5, 9, 3, 7),
            t_len in 1usize..6,
            b_len in 1usize..5,
            seed in any::<u64>(),
            reset_bits in any::<u32>(),
        ) {
            let resets: Vec<(usize, usize)> = (0..t_len * b_len)
                .filter(|i| reset_bits >> (i % 32) & 1 == 1)
                .map(|i| (i / b_len, i % b_len))
                .collect();
            assert_inference_matches_tape(&spec, t_len, b_len, &resets, seed);
        }

        #[test]
        fn try_forward_never_panics_on_arbitrary_lengths(
            obs_len in 0usize..40,
            es_len in 0usize..10,
            h0_len in 0usize..20,
            t_len in 0usize..4,
            b_len in 0usize..4,
        ) {
            let layout = ParamLayout::new(&PolicySpec::gru(3, 2, &[4], Activation::Tanh, 5)).unwrap();
            let params = layout.init_params(0);
            let mut tape = PolicyTape::new(&layout);
            let ok = tape
                .try_forward(&params, &vec![0.1; obs_len], &vec![0.0; es_len], &vec![0.0; h0_len], t_len, b_len)
                .is_ok();
            let rows = t_len * b_len;
            prop_assert_eq!(ok, rows > 0 && obs_len == rows * 3 && es_len == rows && h0_len == b_len * 5);
        }
    }
}
