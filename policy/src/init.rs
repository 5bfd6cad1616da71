//! Parameter initialisation: orthogonal weights (Saxe et al. 2014) with cleanrl's gains, zero
//! biases.

use rand::{Rng, SeedableRng};
use rand_pcg::Pcg64;

use super::layout::{InitRule, ParamLayout};

/// See [`ParamLayout::init_params`].
pub(crate) fn init_params(layout: &ParamLayout, seed: u64) -> Vec<f32> {
    let mut params = vec![0.0; layout.n_params()];
    let mut rng = Pcg64::seed_from_u64(seed);
    let mut scratch = Vec::new();
    for (entry, rule) in layout.entries().iter().zip(layout.init_rules()) {
        match *rule {
            InitRule::Zeros => {}
            InitRule::Ones => params[entry.range()].fill(1.0),
            InitRule::Orthogonal { gain, blocks } => {
                let block_rows = entry.rows / blocks;
                for block in params[entry.range()].chunks_exact_mut(block_rows * entry.cols) {
                    orthogonal(block_rows, entry.cols, gain, &mut rng, &mut scratch, block);
                }
            }
        }
    }
    params
}

/// Fill the row-major `rows × cols` matrix `out` with `gain · Q`, where `Q` has orthonormal
/// columns (`rows ≥ cols`) or orthonormal rows (`rows < cols`).
///
/// This is `torch.nn.init.orthogonal_`: the QR factor of a standard Gaussian matrix with the
/// signs fixed so that `R` has a positive diagonal, which makes `Q` Haar-distributed
/// (Mezzadri 2007). Modified Gram–Schmidt produces exactly that factor; each vector is
/// orthogonalised twice ("twice is enough", Giraud et al. 2005) in `f64`, so the result is
/// orthogonal to `f32` precision even for large square blocks.
fn orthogonal(rows: usize, cols: usize, gain: f32, rng: &mut Pcg64, scratch: &mut Vec<f64>, out: &mut [f32]) {
    debug_assert_eq!(out.len(), rows * cols);
    let (long, short) = (rows.max(cols), rows.min(cols));
    // `short` orthonormal vectors of length `long`, stored contiguously one after another.
    scratch.clear();
    scratch.resize(long * short, 0.0);
    for vec_idx in 0..short {
        let (done, rest) = scratch.split_at_mut(vec_idx * long);
        let v = &mut rest[..long];
        loop {
            for x in v.iter_mut() {
                *x = standard_normal(rng);
            }
            for _pass in 0..2 {
                for u in done.chunks_exact(long) {
                    let dot: f64 = u.iter().zip(v.iter()).map(|(a, b)| a * b).sum();
                    for (x, &u) in v.iter_mut().zip(u) {
                        *x -= dot * u;
                    }
                }
            }
            let norm = v.iter().map(|x| x * x).sum::<f64>().sqrt();
            // A Gaussian vector lies in the span of the others with probability zero; redraw in
            // the (astronomically unlikely) near-degenerate case rather than divide by ~0.
            if norm > 1e-6 {
                for x in v.iter_mut() {
                    *x /= norm;
                }
                break;
            }
        }
    }
    let gain = f64::from(gain);
    for (row_idx, out_row) in out.chunks_exact_mut(cols).enumerate() {
        for (col_idx, w) in out_row.iter_mut().enumerate() {
            let q = if rows >= cols {
                // Column `col_idx` of a tall Q is stored vector `col_idx`.
                scratch[col_idx * long + row_idx]
            } else {
                // Row `row_idx` of a wide Q is stored vector `row_idx`.
                scratch[row_idx * long + col_idx]
            };
            *w = (gain * q) as f32;
        }
    }
}

/// One standard normal draw by the Box–Muller transform (Box & Muller 1958).
fn standard_normal(rng: &mut Pcg64) -> f64 {
    // `random::<f64>()` is in [0, 1); flip it to (0, 1] so the logarithm is finite.
    let u1 = 1.0 - rng.random::<f64>();
    let u2 = rng.random::<f64>();
    (-2.0 * u1.ln()).sqrt() * (std::f64::consts::TAU * u2).cos()
}

#[cfg(test)]
mod tests {
    use super::super::{Activation, PolicySpec};
    use super::*;

    /// Max |(M Mᵀ or Mᵀ M) − gain² I| over the smaller Gram matrix of a row-major block.
    fn orthogonality_error(block: &[f32], rows: usize, cols: usize, gain: f32) -> f64 {
        let at = |i: usize, j: usize| f64::from(block[i * cols + j]);
        let target = f64::from(gain) * f64::from(gain);
        let mut max_err = 0.0f64;
        if rows >= cols {
            for a in 0..cols {
                for b in 0..cols {
                    let dot: f64 = (0..rows).map(|i| at(i, a) * at(i, b)).sum();
                    let expected = if a == b { target } else { 0.0 };
                    max_err = max_err.max((dot - expected).abs());
                }
            }
        } else {
            for a in 0..rows {
                for b in 0..rows {
                    let dot: f64 = (0..cols).map(|j| at(a, j) * at(b, j)).sum();
                    let expected = if a == b { target } else { 0.0 };
                    max_err = max_err.max((dot - expected).abs());
                }
            }
        }
        max_err
    }

    #[test]
    fn init_is_deterministic_per_seed_and_differs_across_seeds() {
        let layout = ParamLayout::new(&PolicySpec::gru(4, 2, &[16], Activation::Tanh, 8)).unwrap();
        let a = layout.init_params(7);
        let b = layout.init_params(7);
        let c = layout.init_params(8);
        assert_eq!(a.len(), layout.n_params());
        assert_eq!(
            a.iter().map(|x| x.to_bits()).collect::<Vec<_>>(),
            b.iter().map(|x| x.to_bits()).collect::<Vec<_>>()
        );
        assert_ne!(a, c);
    }

    #[test]
    fn init_first_weights_are_golden() {
        // Pins the RNG stream and the Gram–Schmidt order: the same seed must give the same
        // network on every platform and release.
        let layout = ParamLayout::new(&PolicySpec::mlp(4, 2, &[64, 64], Activation::Tanh)).unwrap();
        let params = layout.init_params(1);
        let first: Vec<f32> = params[..4].to_vec();
        assert_eq!(first, [0.355_723_02, -0.318_247_7, -0.039_881_23, 0.008_575_339]);
    }

    #[test]
    fn weights_are_orthogonal_with_cleanrl_gains_and_biases_are_zero() {
        let spec = PolicySpec::gru(8, 6, &[64, 32, 48], Activation::Relu, 24);
        let layout = ParamLayout::new(&spec).unwrap();
        let params = layout.init_params(3);
        let sqrt2 = std::f32::consts::SQRT_2;
        for (entry, rule) in layout.entries().iter().zip(layout.init_rules()) {
            let block = &params[entry.range()];
            match *rule {
                InitRule::Zeros => {
                    assert!(entry.name.contains("bias"), "{}", entry.name);
                    assert!(block.iter().all(|&x| x == 0.0), "{} not zero", entry.name);
                }
                InitRule::Ones => unreachable!("only obs_norm.var starts at one; this spec has none"),
                InitRule::Orthogonal { gain, blocks } => {
                    let expected_gain = match entry.name.as_str() {
                        "gru.weight_hh" | "value.weight" => 1.0,
                        "policy.weight" => 0.01,
                        _ => sqrt2,
                    };
                    assert_eq!(gain, expected_gain, "{}", entry.name);
                    let block_rows = entry.rows / blocks;
                    for gate in block.chunks_exact(block_rows * entry.cols) {
                        let err = orthogonality_error(gate, block_rows, entry.cols, gain);
                        assert!(err < 1e-5 * f64::from(gain * gain).max(1.0), "{}: {err}", entry.name);
                    }
                }
            }
        }
    }

    #[test]
    fn standard_normal_has_unit_moments() {
        let mut rng = Pcg64::seed_from_u64(0);
        let n = 200_000;
        let draws: Vec<f64> = (0..n).map(|_| standard_normal(&mut rng)).collect();
        let mean = draws.iter().sum::<f64>() / n as f64;
        let var = draws.iter().map(|x| (x - mean) * (x - mean)).sum::<f64>() / n as f64;
        assert!(mean.abs() < 0.01, "mean {mean}");
        assert!((var - 1.0).abs() < 0.02, "variance {var}");
    }
}
