//! Element-wise GRU cell math (Cho et al. 2014, PyTorch gate convention), forward and backward.
//!
//! The matrix products `gi = x W_iᵀ + b_i` and `gh = h W_hᵀ + b_h` are done by the caller with
//! one GEMM each over the whole batch; these kernels take their `[rows][3H]` results (gate
//! blocks `r, z, n` side by side) and do the rest:
//!
//! ```text
//! r  = σ(gi_r + gh_r)        z = σ(gi_z + gh_z)
//! n  = tanh(gi_n + r ⊙ gh_n)
//! h' = (1 − z) ⊙ n + z ⊙ h
//! ```
//!
//! All three functions share [`unit_forward`], so inference and training agree bit for bit.

// Several parallel per-unit slices are clearer indexed by unit than zipped six deep; every slice
// is re-sliced to exactly `hidden` first, so the bounds checks are elided.
#![allow(clippy::needless_range_loop)]

use super::linalg::{fast_sigmoid, fast_tanh};

/// One unit: returns `(r, z, n, h')`.
#[inline(always)]
fn unit_forward(gi_r: f32, gi_z: f32, gi_n: f32, gh_r: f32, gh_z: f32, gh_n: f32, h: f32) -> (f32, f32, f32, f32) {
    let r = fast_sigmoid(gi_r + gh_r);
    let z = fast_sigmoid(gi_z + gh_z);
    let n = fast_tanh(gi_n + r * gh_n);
    (r, z, n, (1.0 - z) * n + z * h)
}

/// Split one `[3H]` gate row into its `r, z, n` blocks.
#[inline(always)]
fn gate_blocks(row: &[f32], hidden: usize) -> (&[f32], &[f32], &[f32]) {
    (&row[..hidden], &row[hidden..2 * hidden], &row[2 * hidden..3 * hidden])
}

/// Advance the hidden state in place (inference: no activations are kept).
///
/// `gi`, `gh`: `[rows][3H]`; `h`: `[rows][H]`, read as `h` and overwritten with `h'`.
pub(crate) fn cell_forward_in_place(gi: &[f32], gh: &[f32], h: &mut [f32], hidden: usize) {
    debug_assert_eq!(gi.len(), 3 * h.len());
    debug_assert_eq!(gh.len(), 3 * h.len());
    for ((gi, gh), h) in gi.chunks_exact(3 * hidden).zip(gh.chunks_exact(3 * hidden)).zip(h.chunks_exact_mut(hidden)) {
        let (gi_r, gi_z, gi_n) = gate_blocks(gi, hidden);
        let (gh_r, gh_z, gh_n) = gate_blocks(gh, hidden);
        let h = &mut h[..hidden];
        for j in 0..hidden {
            let (_, _, _, h_new) = unit_forward(gi_r[j], gi_z[j], gi_n[j], gh_r[j], gh_z[j], gh_n[j], h[j]);
            h[j] = h_new;
        }
    }
}

/// One step that records the gate activations for backprop.
///
/// `gi`, `gh`: `[rows][3H]`; `h_prev`: `[rows][H]`; writes `gates = [r, z, n]` (`[rows][3H]`)
/// and `h_out` (`[rows][H]`).
pub(crate) fn cell_forward(
    gi: &[f32],
    gh: &[f32],
    h_prev: &[f32],
    hidden: usize,
    gates: &mut [f32],
    h_out: &mut [f32],
) {
    debug_assert_eq!(gi.len(), 3 * h_prev.len());
    debug_assert_eq!(gh.len(), 3 * h_prev.len());
    debug_assert_eq!(gates.len(), 3 * h_prev.len());
    debug_assert_eq!(h_out.len(), h_prev.len());
    for ((((gi, gh), h_prev), gates), h_out) in gi
        .chunks_exact(3 * hidden)
        .zip(gh.chunks_exact(3 * hidden))
        .zip(h_prev.chunks_exact(hidden))
        .zip(gates.chunks_exact_mut(3 * hidden))
        .zip(h_out.chunks_exact_mut(hidden))
    {
        let (gi_r, gi_z, gi_n) = gate_blocks(gi, hidden);
        let (gh_r, gh_z, gh_n) = gate_blocks(gh, hidden);
        let h_prev = &h_prev[..hidden];
        let h_out = &mut h_out[..hidden];
        let (r_out, rest) = gates.split_at_mut(hidden);
        let (z_out, n_out) = rest.split_at_mut(hidden);
        let n_out = &mut n_out[..hidden];
        for j in 0..hidden {
            let (r, z, n, h_new) = unit_forward(gi_r[j], gi_z[j], gi_n[j], gh_r[j], gh_z[j], gh_n[j], h_prev[j]);
            r_out[j] = r;
            z_out[j] = z;
            n_out[j] = n;
            h_out[j] = h_new;
        }
    }
}

/// Backward through one step's element-wise part.
///
/// On entry `dh` holds `∂L/∂h'` (`[rows][H]`); on exit it holds the *direct* part of `∂L/∂h`,
/// `∂L/∂h' ⊙ z` (the caller adds `dgh W_h` for the path through the gates). Writes the gradients
/// of the pre-activation sums: `dgi = ∂L/∂gi` and `dgh = ∂L/∂gh` (both `[rows][3H]`). With
/// `a_r, a_z` the sigmoid inputs and `a_n = gi_n + r ⊙ gh_n`:
///
/// ```text
/// ∂a_n = ∂h' ⊙ (1 − z) ⊙ (1 − n²)     → dgi_n = ∂a_n,  dgh_n = ∂a_n ⊙ r
/// ∂a_r = ∂a_n ⊙ gh_n ⊙ r (1 − r)      → dgi_r = dgh_r = ∂a_r
/// ∂a_z = ∂h' ⊙ (h − n) ⊙ z (1 − z)    → dgi_z = dgh_z = ∂a_z
/// ```
pub(crate) fn cell_backward(
    dh: &mut [f32],
    gates: &[f32],
    gh: &[f32],
    h_prev: &[f32],
    hidden: usize,
    dgi: &mut [f32],
    dgh: &mut [f32],
) {
    debug_assert_eq!(gates.len(), 3 * dh.len());
    debug_assert_eq!(gh.len(), 3 * dh.len());
    debug_assert_eq!(h_prev.len(), dh.len());
    debug_assert_eq!(dgi.len(), 3 * dh.len());
    debug_assert_eq!(dgh.len(), 3 * dh.len());
    for ((((dh, gates), gh), h_prev), (dgi, dgh)) in dh
        .chunks_exact_mut(hidden)
        .zip(gates.chunks_exact(3 * hidden))
        .zip(gh.chunks_exact(3 * hidden))
        .zip(h_prev.chunks_exact(hidden))
        .zip(dgi.chunks_exact_mut(3 * hidden).zip(dgh.chunks_exact_mut(3 * hidden)))
    {
        let (r, z, n) = gate_blocks(gates, hidden);
        let gh_n = &gh[2 * hidden..3 * hidden];
        let dh = &mut dh[..hidden];
        let h_prev = &h_prev[..hidden];
        let (dgi_r, rest) = dgi.split_at_mut(hidden);
        let (dgi_z, dgi_n) = rest.split_at_mut(hidden);
        let dgi_n = &mut dgi_n[..hidden];
        let (dgh_r, rest) = dgh.split_at_mut(hidden);
        let (dgh_z, dgh_n) = rest.split_at_mut(hidden);
        let dgh_n = &mut dgh_n[..hidden];
        for j in 0..hidden {
            let (r, z, n, d) = (r[j], z[j], n[j], dh[j]);
            let da_n = d * (1.0 - z) * (1.0 - n * n);
            let da_r = da_n * gh_n[j] * r * (1.0 - r);
            let da_z = d * (h_prev[j] - n) * z * (1.0 - z);
            dgi_r[j] = da_r;
            dgi_z[j] = da_z;
            dgi_n[j] = da_n;
            dgh_r[j] = da_r;
            dgh_z[j] = da_z;
            dgh_n[j] = da_n * r;
            dh[j] = d * z;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn in_place_and_recording_forward_agree_bitwise() {
        let hidden = 5;
        let rows = 3;
        let gi: Vec<f32> = (0..rows * 3 * hidden).map(|i| ((i * 37 % 11) as f32 - 5.0) * 0.3).collect();
        let gh: Vec<f32> = (0..rows * 3 * hidden).map(|i| ((i * 17 % 13) as f32 - 6.0) * 0.2).collect();
        let h_prev: Vec<f32> = (0..rows * hidden).map(|i| ((i * 7 % 5) as f32 - 2.0) * 0.4).collect();
        let mut gates = vec![0.0; rows * 3 * hidden];
        let mut h_out = vec![0.0; rows * hidden];
        cell_forward(&gi, &gh, &h_prev, hidden, &mut gates, &mut h_out);
        let mut h = h_prev.clone();
        cell_forward_in_place(&gi, &gh, &mut h, hidden);
        assert_eq!(h, h_out);
    }

    #[test]
    fn cell_matches_gru_equations_for_one_unit() {
        let (gi, gh, h) = ([0.3f32, -0.2, 0.5], [0.1f32, 0.4, -0.7], [0.25f32]);
        let sigmoid = |x: f64| 1.0 / (1.0 + (-x).exp());
        let r = sigmoid(0.3 + 0.1);
        let z = sigmoid(-0.2 + 0.4);
        let n = (0.5 + r * -0.7).tanh();
        let expected = (1.0 - z) * n + z * 0.25;
        let mut gates = [0.0; 3];
        let mut h_out = [0.0; 1];
        cell_forward(&gi, &gh, &h, 1, &mut gates, &mut h_out);
        assert!((f64::from(h_out[0]) - expected).abs() < 1e-6);
        assert!((f64::from(gates[0]) - r).abs() < 1e-6);
        assert!((f64::from(gates[1]) - z).abs() < 1e-6);
        assert!((f64::from(gates[2]) - n).abs() < 1e-6);
    }
}
