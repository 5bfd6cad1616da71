//! The diagonal Gaussian action head: sampling, log-density, entropy and the per-row gradient
//! of the policy loss, on one row of means and the state-independent log-std vector.
//!
//! The policy head outputs the means `μ` (`A` values per observation); the standard deviations
//! are `σ = exp(s)` with `s` the `policy.log_std` parameters (cleanrl's `ppo_continuous_action.py`
//! and Stable-Baselines3's default). The log-std is clamped to `[LOG_STD_MIN, LOG_STD_MAX]`
//! before use, so the density, its gradient and the entropy stay finite in `f32` however far the
//! parameters drift; outside that range the clamp's gradient is zero.
//!
//! **Squashing** (`squash = true`, Haarnoja et al. 2018, "Soft Actor-Critic", appendix C): a
//! sample `u ~ N(μ, σ²)` becomes `a = tanh(u)` in `(−1, 1)`, and
//!
//! ```text
//! log π(a) = Σ_j [ log N(u_j; μ_j, σ_j) − log(1 − tanh²(u_j)) ],   u = atanh(a),
//! ```
//!
//! with `log(1 − tanh²(u)) = 2 (ln 2 − u − softplus(−2u))`, which is exact and finite for any `u`.
//! The action recorded in a segment is `a` itself (clamped to `±SQUASH_LIMIT`, where `atanh` is
//! finite); the actor scales it to the environment's box `[low, high]` only when stepping,
//! and the constant `Σ log((high − low)/2)` of that affine map is left out of both the
//! behaviour and the learner's log-density, so their ratio is unchanged.
//! The entropy reported and used for the bonus is the Gaussian's (of `u`), which has a closed
//! form; the squashed distribution's has none.
//!
//! **Convention shared by actor and learner** (issue 14): the behaviour log-probability an
//! actor records is [`log_prob`] of the recorded action, computed by the same function the
//! learner's CPU backend uses to re-evaluate it, so the two agree bit for bit under the same
//! weights. Unsquashed actions are recorded before the environment clips them to its bounds:
//! the clip is the environment's business (`ActionSpace::repair`), not the policy's.

use rand::Rng;

/// Smallest log-std used (σ ≈ 2·10⁻⁹): `((a − μ)/σ)²` stays finite for any `|a − μ| < 10¹⁰`.
pub const LOG_STD_MIN: f32 = -20.0;
/// Largest log-std used (σ ≈ 7.4).
pub const LOG_STD_MAX: f32 = 2.0;
/// Squashed actions are kept within `±SQUASH_LIMIT`, where `atanh` is finite (≈ ±7.25).
pub const SQUASH_LIMIT: f32 = 1.0 - 1e-6;

/// `½ ln(2π)`.
const HALF_LN_2PI: f32 = 0.918_938_5;

/// The log-std actually used for parameter value `log_std`.
#[inline]
pub fn clamp_log_std(log_std: f32) -> f32 {
    log_std.clamp(LOG_STD_MIN, LOG_STD_MAX)
}

/// `log(1 + exp(x))` without overflow.
#[inline]
fn softplus(x: f32) -> f32 {
    x.max(0.0) + (-x.abs()).exp().ln_1p()
}

/// `log(1 − tanh²(u))`, exact and finite for every finite `u`.
#[inline]
fn log_one_minus_tanh_sq(u: f32) -> f32 {
    2.0 * (std::f32::consts::LN_2 - u - softplus(-2.0 * u))
}

/// The Gaussian variable `u` behind a recorded action value: `atanh(a)` when squashed (with
/// `a` clamped to `±SQUASH_LIMIT`), else `a`.
#[inline]
pub fn pre_squash(action: f32, squash: bool) -> f32 {
    if squash {
        action.clamp(-SQUASH_LIMIT, SQUASH_LIMIT).atanh()
    } else {
        action
    }
}

#[track_caller]
fn check_row(mean: &[f32], log_std: &[f32], action: &[f32]) {
    assert!(
        mean.len() == log_std.len() && mean.len() == action.len(),
        "gaussian row: {} means, {} log-stds, {} action values",
        mean.len(),
        log_std.len(),
        action.len()
    );
}

/// `log π(action)` of the diagonal Gaussian `N(mean, exp(2 log_std))`, squashed or not (see
/// the [module docs](self)). Finite for any finite inputs.
///
/// # Panics
///
/// If the three slices differ in length.
///
/// # Example
///
/// ```
/// use volley_policy::gaussian::log_prob;
/// // A standard normal at its mean: −½ ln(2π) per dimension.
/// let lp = log_prob(&[0.0, 0.0], &[0.0, 0.0], &[0.0, 0.0], false);
/// assert!((lp + (2.0 * std::f32::consts::PI).ln()).abs() < 1e-6);
/// ```
pub fn log_prob(mean: &[f32], log_std: &[f32], action: &[f32], squash: bool) -> f32 {
    check_row(mean, log_std, action);
    let mut total = 0.0f32;
    for ((&mu, &s), &a) in mean.iter().zip(log_std).zip(action) {
        let s = clamp_log_std(s);
        let u = pre_squash(a, squash);
        let z = (u - mu) * (-s).exp();
        total += -0.5 * z * z - s - HALF_LN_2PI;
        if squash {
            total -= log_one_minus_tanh_sq(u);
        }
    }
    total
}

/// Entropy of the (unsquashed) diagonal Gaussian in nats: `Σ_j (s_j + ½ (1 + ln 2π))`.
pub fn entropy(log_std: &[f32]) -> f32 {
    log_std.iter().map(|&s| clamp_log_std(s) + 0.5 + HALF_LN_2PI).sum()
}

/// The gradient of `−pg_scale · log π(action) − ent_scale · H` with respect to the means
/// (written to `d_mean`) and the log-std parameters (written to `d_log_std`):
///
/// ```text
/// ∂/∂μ_j = −pg_scale · z_j / σ_j,        ∂/∂s_j = −pg_scale · (z_j² − 1) − ent_scale,
/// ```
///
/// with `z = (u − μ)/σ`; the squashing term does not depend on `μ` or `s`. Where `s_j` is
/// clamped, its gradient is zero. Returns `log π(action)`.
///
/// # Panics
///
/// If the slices differ in length.
#[allow(clippy::too_many_arguments)]
pub fn row_gradient(
    mean: &[f32],
    log_std: &[f32],
    action: &[f32],
    squash: bool,
    pg_scale: f32,
    ent_scale: f32,
    d_mean: &mut [f32],
    d_log_std: &mut [f32],
) -> f32 {
    check_row(mean, log_std, action);
    assert!(d_mean.len() == mean.len() && d_log_std.len() == mean.len(), "gaussian row gradient: output lengths");
    let mut total = 0.0f32;
    let rows = mean.iter().zip(log_std).zip(action).zip(d_mean.iter_mut().zip(d_log_std.iter_mut()));
    for (((&mu, &s_raw), &a), (dm, ds)) in rows {
        let s = clamp_log_std(s_raw);
        let inv_sigma = (-s).exp();
        let u = pre_squash(a, squash);
        let z = (u - mu) * inv_sigma;
        total += -0.5 * z * z - s - HALF_LN_2PI;
        if squash {
            total -= log_one_minus_tanh_sq(u);
        }
        *dm = -pg_scale * z * inv_sigma;
        *ds = if (LOG_STD_MIN..=LOG_STD_MAX).contains(&s_raw) { -pg_scale * (z * z - 1.0) - ent_scale } else { 0.0 };
    }
    total
}

/// A standard normal draw (Box–Muller on two uniforms from `rng`).
#[inline]
pub fn standard_normal(rng: &mut (impl Rng + ?Sized)) -> f32 {
    // 1 − U lies in (0, 1], so the logarithm is finite.
    let u1 = 1.0 - rng.random::<f64>();
    let u2 = rng.random::<f64>();
    ((-2.0 * u1.ln()).sqrt() * (std::f64::consts::TAU * u2).cos()) as f32
}

/// Draw an action from the head into `action` and return its log-probability, which is
/// exactly [`log_prob`] of the written action (what the actor records as the behaviour
/// log-probability). Squashed actions lie within `±SQUASH_LIMIT`.
///
/// # Panics
///
/// If the slices differ in length.
///
/// # Example
///
/// ```
/// use rand::{rngs::SmallRng, SeedableRng};
/// use volley_policy::gaussian::{log_prob, sample};
/// let mut rng = SmallRng::seed_from_u64(3);
/// let mut action = [0.0f32; 2];
/// let lp = sample(&[0.5, -1.0], &[-1.0, 0.0], true, &mut rng, &mut action);
/// assert!(action.iter().all(|a| a.abs() < 1.0));
/// assert_eq!(lp, log_prob(&[0.5, -1.0], &[-1.0, 0.0], &action, true));
/// ```
pub fn sample(mean: &[f32], log_std: &[f32], squash: bool, rng: &mut (impl Rng + ?Sized), action: &mut [f32]) -> f32 {
    check_row(mean, log_std, action);
    for ((a, &mu), &s) in action.iter_mut().zip(mean).zip(log_std) {
        let u = mu + clamp_log_std(s).exp() * standard_normal(rng);
        *a = if squash { u.tanh().clamp(-SQUASH_LIMIT, SQUASH_LIMIT) } else { u };
    }
    log_prob(mean, log_std, action, squash)
}

/// Draw an action from the standard normal (`μ = 0`, `s = 0`; squashed or not) into `action`
/// and return its log-probability: the fallback of a head whose outputs are not finite
/// (issue 46), with no means or log-stds to borrow.
pub fn sample_standard(squash: bool, rng: &mut (impl Rng + ?Sized), action: &mut [f32]) -> f32 {
    let mut total = 0.0f32;
    for a in action.iter_mut() {
        let u = standard_normal(rng);
        *a = if squash { u.tanh().clamp(-SQUASH_LIMIT, SQUASH_LIMIT) } else { u };
        let u = pre_squash(*a, squash);
        total += -0.5 * u * u - HALF_LN_2PI;
        if squash {
            total -= log_one_minus_tanh_sq(u);
        }
    }
    total
}

/// Map squashed action values in `[−1, 1]` onto the box `[low, high]` (into `out`).
///
/// # Panics
///
/// If the slices differ in length.
pub fn scale_to_box(squashed: &[f32], low: &[f32], high: &[f32], out: &mut [f32]) {
    assert!(squashed.len() == low.len() && low.len() == high.len() && out.len() == low.len(), "box lengths");
    for (((o, &a), &lo), &hi) in out.iter_mut().zip(squashed).zip(low).zip(high) {
        *o = lo + 0.5 * (a + 1.0) * (hi - lo);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use rand::{rngs::SmallRng, SeedableRng};

    /// The log-density in f64, written independently from the definition.
    fn log_prob_f64(mean: &[f64], log_std: &[f64], action: &[f64], squash: bool) -> f64 {
        let mut total = 0.0;
        for ((&mu, &s), &a) in mean.iter().zip(log_std).zip(action) {
            let u = if squash { a.atanh() } else { a };
            let sigma = s.exp();
            total += -0.5 * ((u - mu) / sigma).powi(2) - s - 0.5 * (2.0 * std::f64::consts::PI).ln();
            if squash {
                total -= (1.0 - a * a).ln();
            }
        }
        total
    }

    #[test]
    fn log_prob_matches_the_f64_definition() {
        let mean = [0.3f32, -1.2, 2.0];
        let log_std = [-0.5f32, 0.0, 1.0];
        for squash in [false, true] {
            let action = if squash { [0.2f32, -0.7, 0.95] } else { [0.1f32, -3.0, 4.0] };
            let expected = log_prob_f64(&mean.map(f64::from), &log_std.map(f64::from), &action.map(f64::from), squash);
            let got = log_prob(&mean, &log_std, &action, squash);
            assert!((f64::from(got) - expected).abs() < 1e-4, "squash {squash}: {got} vs {expected}");
        }
    }

    /// The squashed density integrates to one over (−1, 1): the log-det-Jacobian is right.
    #[test]
    fn squashed_density_integrates_to_one() {
        for (mu, s) in [(0.0f32, 0.0f32), (1.5, -1.0), (-0.5, 0.8)] {
            let n = 200_000;
            let h = 2.0 / n as f64;
            let integral: f64 = (0..n)
                .map(|i| {
                    let a = -1.0 + (i as f64 + 0.5) * h;
                    f64::from(log_prob(&[mu], &[s], &[a as f32], true)).exp() * h
                })
                .sum();
            assert!((integral - 1.0).abs() < 2e-3, "μ {mu}, s {s}: ∫ = {integral}");
        }
    }

    #[test]
    fn entropy_matches_the_closed_form() {
        let h = entropy(&[0.0, 1.0]);
        let expected = 2.0 * (0.5 + 0.5 * (2.0 * std::f64::consts::PI).ln()) + 1.0;
        assert!((f64::from(h) - expected).abs() < 1e-6);
    }

    /// Gradients against central finite differences of the f64 loss, for the means and the
    /// log-std parameters, squashed and not.
    #[test]
    fn row_gradient_matches_finite_differences() {
        let (pg_scale, ent_scale) = (0.7f64, 0.05f64);
        let loss = |mean: &[f64], log_std: &[f64], action: &[f64], squash: bool| {
            let h: f64 = log_std.iter().map(|s| s + 0.5 + 0.5 * (2.0 * std::f64::consts::PI).ln()).sum();
            -pg_scale * log_prob_f64(mean, log_std, action, squash) - ent_scale * h
        };
        let mean = [0.3f64, -1.2, 0.8];
        let log_std = [-0.5f64, 0.2, -1.5];
        for squash in [false, true] {
            let action = if squash { [0.2f64, -0.7, 0.5] } else { [0.1f64, -3.0, 1.0] };
            let (mut dm, mut ds) = ([0.0f32; 3], [0.0f32; 3]);
            row_gradient(
                &mean.map(|x| x as f32),
                &log_std.map(|x| x as f32),
                &action.map(|x| x as f32),
                squash,
                pg_scale as f32,
                ent_scale as f32,
                &mut dm,
                &mut ds,
            );
            let eps = 1e-6;
            for j in 0..3 {
                let (mut plus, mut minus) = (mean, mean);
                plus[j] += eps;
                minus[j] -= eps;
                let fd =
                    (loss(&plus, &log_std, &action, squash) - loss(&minus, &log_std, &action, squash)) / (2.0 * eps);
                assert!((f64::from(dm[j]) - fd).abs() < 1e-3 * (1.0 + fd.abs()), "dμ[{j}] {} vs {fd}", dm[j]);
                let (mut plus, mut minus) = (log_std, log_std);
                plus[j] += eps;
                minus[j] -= eps;
                let fd = (loss(&mean, &plus, &action, squash) - loss(&mean, &minus, &action, squash)) / (2.0 * eps);
                assert!((f64::from(ds[j]) - fd).abs() < 1e-3 * (1.0 + fd.abs()), "ds[{j}] {} vs {fd}", ds[j]);
            }
        }
    }

    #[test]
    fn tiny_and_huge_stds_stay_finite_and_clamped_log_stds_get_no_gradient() {
        for s in [-1e6f32, -50.0, -20.0, 2.0, 30.0, 1e6] {
            for squash in [false, true] {
                let action = if squash { [0.999_999_9f32] } else { [1e3f32] };
                let lp = log_prob(&[-1e3], &[s], &action, squash);
                assert!(lp.is_finite(), "log-std {s}, squash {squash}: {lp}");
                assert!(entropy(&[s]).is_finite());
                let (mut dm, mut ds) = ([0.0f32], [0.0f32]);
                row_gradient(&[-1e3], &[s], &action, squash, 1.0, 0.1, &mut dm, &mut ds);
                assert!(dm[0].is_finite() && ds[0].is_finite(), "log-std {s}: {dm:?} {ds:?}");
                if !(LOG_STD_MIN..=LOG_STD_MAX).contains(&s) {
                    assert_eq!(ds[0], 0.0);
                }
            }
        }
        // Squashed actions at ±1 (a tanh that rounded to 1 in f32) are finite too.
        assert!(log_prob(&[0.0], &[0.0], &[1.0], true).is_finite());
        assert!(log_prob(&[0.0], &[0.0], &[-1.0], true).is_finite());
    }

    #[test]
    fn samples_have_the_head_mean_and_std_and_record_their_own_log_prob() {
        let mut rng = SmallRng::seed_from_u64(11);
        let (mean, log_std) = ([1.5f32, -0.5], [0.5f32, -1.0]);
        let n = 100_000;
        let (mut sum, mut sum_sq) = ([0.0f64; 2], [0.0f64; 2]);
        let mut action = [0.0f32; 2];
        for _ in 0..n {
            let lp = sample(&mean, &log_std, false, &mut rng, &mut action);
            assert_eq!(lp, log_prob(&mean, &log_std, &action, false));
            for j in 0..2 {
                sum[j] += f64::from(action[j]);
                sum_sq[j] += f64::from(action[j]).powi(2);
            }
        }
        for j in 0..2 {
            let m = sum[j] / n as f64;
            let sd = (sum_sq[j] / n as f64 - m * m).sqrt();
            let sigma = f64::from(log_std[j]).exp();
            // 5 standard errors.
            assert!((m - f64::from(mean[j])).abs() < 5.0 * sigma / (n as f64).sqrt(), "mean {m}");
            assert!((sd - sigma).abs() < 0.01 * sigma + 5.0 * sigma / (2.0 * n as f64).sqrt(), "sd {sd}");
        }
    }

    #[test]
    fn squashed_samples_scale_onto_the_box() {
        let mut out = [0.0f32; 2];
        scale_to_box(&[-1.0, 1.0], &[-2.0, 0.0], &[2.0, 1.0], &mut out);
        assert_eq!(out, [-2.0, 1.0]);
        scale_to_box(&[0.0, 0.0], &[-2.0, 0.0], &[2.0, 1.0], &mut out);
        assert_eq!(out, [0.0, 0.5]);
    }

    proptest! {
        #[test]
        fn sampled_log_probs_are_finite_and_reproduced_by_log_prob(
            mean in prop::collection::vec(-1e3f32..1e3, 1..6),
            seed in any::<u64>(),
            squash in any::<bool>(),
            log_std_base in -40.0f32..10.0,
        ) {
            let log_std: Vec<f32> = (0..mean.len()).map(|j| log_std_base + j as f32).collect();
            let mut rng = SmallRng::seed_from_u64(seed);
            let mut action = vec![0.0f32; mean.len()];
            let lp = sample(&mean, &log_std, squash, &mut rng, &mut action);
            prop_assert!(lp.is_finite());
            prop_assert!(action.iter().all(|a| a.is_finite()));
            prop_assert_eq!(lp, log_prob(&mean, &log_std, &action, squash));
        }
    }
}
