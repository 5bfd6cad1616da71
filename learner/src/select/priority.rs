//! Prioritized sampling (Schaul et al. 2016, "Prioritized Experience Replay"): probabilities
//! from priorities, draws with replacement, and the importance weights that correct the bias
//! of drawing by priority. Pure functions over caller-owned buffers; [`super::selection`]
//! runs them over its pool.

use rand::Rng;

/// Sampling probabilities `p_i = priority_i^α / Σ_j priority_j^α` (Schaul et al. 2016, eq. 1),
/// in `f64` so a large pool's small probabilities keep their precision.
///
/// # Panics
/// If a priority is not finite and positive: callers add ε and drop non-finite segments first.
pub fn sampling_probabilities(priorities: &[f32], alpha: f32, out: &mut Vec<f64>) {
    assert!(priorities.iter().all(|&p| p.is_finite() && p > 0.0), "priorities must be finite and positive");
    out.clear();
    out.extend(priorities.iter().map(|&p| f64::from(p).powf(f64::from(alpha))));
    let total: f64 = out.iter().sum();
    out.iter_mut().for_each(|p| *p /= total);
}

/// Draw `n` indices with replacement, index `i` with probability `probs[i]` (inverse CDF by
/// binary search over the running sum).
pub fn sample_with_replacement(
    probs: &[f64],
    n: usize,
    rng: &mut impl Rng,
    cumulative: &mut Vec<f64>,
    out: &mut Vec<usize>,
) {
    out.clear();
    if probs.is_empty() {
        return;
    }
    cumulative.clear();
    let mut running = 0.0;
    cumulative.extend(probs.iter().map(|&p| {
        running += p;
        running
    }));
    let total = running;
    for _ in 0..n {
        let u = rng.random::<f64>() * total;
        // The first index whose running sum exceeds u; `min` guards against rounding at the top.
        let idx = cumulative.partition_point(|&c| c <= u).min(probs.len() - 1);
        out.push(idx);
    }
}

/// Importance weights `w_i = (N·p_i)^(−β) / max_j (N·p_j)^(−β)` of the drawn indices
/// (Schaul et al. 2016, sec. 3.4), where the max runs over the whole pool, so every weight is
/// in (0, 1] and the pool's least likely segment would get exactly 1. The `N` cancels:
/// `w_i = (p_min / p_i)^β`.
pub fn importance_weights(probs: &[f64], drawn: &[usize], beta: f32, out: &mut Vec<f32>) {
    out.clear();
    let p_min = probs.iter().copied().fold(f64::INFINITY, f64::min);
    out.extend(drawn.iter().map(|&i| (p_min / probs[i]).powf(f64::from(beta)) as f32));
}
