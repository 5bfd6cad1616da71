//! Categorical-distribution helpers on one row of logits: log-softmax, entropy and sampling.
//!
//! A row is the `n_actions` logits the policy head produced for one observation. Every function
//! subtracts the row maximum before exponentiating (the log-sum-exp trick), so logits of any
//! finite magnitude neither overflow nor lose the distribution. A logit of `−∞` is allowed and
//! means the action has probability zero. A row with no finite maximum (all `−∞`, or a `+∞`
//! or NaN in it) has no distribution: the samplers return `None` and [`log_softmax`] writes NaN,
//! never a panic, because such a row comes from weights or inputs off the network (issue 46: a
//! NaN live anchor crashed every actor here, a recurrent state of 3e38 the learner).

use rand::Rng;

/// Returns `(max, Σ_j exp(logits_j − max))`, the stable pieces of `log Σ_j exp(logits_j)`, or
/// `None` when `logits` is empty or has no finite maximum (all `−∞`, a `+∞`, or a NaN).
#[inline]
fn shifted_exp_sum(logits: &[f32]) -> Option<(f32, f32)> {
    // `f32::max` ignores NaN, so NaN is looked for on its own.
    let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    if !max.is_finite() || logits.iter().any(|z| z.is_nan()) {
        return None;
    }
    let sum = logits.iter().map(|&z| (z - max).exp()).sum();
    Some((max, sum))
}

/// Whether `logits` define a distribution: not empty, no NaN or `+∞`, at least one finite
/// value. Rows that do not are what [`sample_categorical`] refuses.
pub fn is_distribution(logits: &[f32]) -> bool {
    shifted_exp_sum(logits).is_some()
}

/// Writes `log softmax(logits)` into `out`: `out_j = (z_j − max) − log Σ_k exp(z_k − max)`.
///
/// Subtracting the maximum keeps every exponent `≤ 0`, so the sum lies in `[1, n]` and neither
/// overflows nor underflows, whatever the logits' magnitude.
///
/// A row with no distribution ([`is_distribution`]) gives NaN everywhere: the learner's
/// non-finite gradient check then skips the step, as for any other non-finite loss.
///
/// # Panics
///
/// If `out.len() != logits.len()`.
///
/// # Example
///
/// ```
/// use volley_policy::distributions::log_softmax;
///
/// let mut log_probs = [0.0; 2];
/// log_softmax(&[1000.0, 1000.0], &mut log_probs);
/// assert!((log_probs[0] - 0.5f32.ln()).abs() < 1e-6);
/// ```
pub fn log_softmax(logits: &[f32], out: &mut [f32]) {
    assert!(out.len() == logits.len(), "out: expected {} elements, got {}", logits.len(), out.len());
    let Some((max, sum)) = shifted_exp_sum(logits) else {
        out.fill(f32::NAN);
        return;
    };
    // Subtract the maximum before the log-sum so that a small `log sum` is not absorbed by a
    // huge maximum (1e30 + ln 2 == 1e30 in f32).
    let log_sum = sum.ln();
    for (o, &z) in out.iter_mut().zip(logits) {
        *o = (z - max) - log_sum;
    }
}

/// Entropy `H = −Σ_j p_j log p_j` of a categorical distribution given its log-probabilities
/// (for example the output of [`log_softmax`]), in nats.
///
/// Zero-probability entries (`log p = −∞`) contribute `0`, the limit of `p log p`.
pub fn entropy_from_log_probs(log_probs: &[f32]) -> f32 {
    -log_probs
        .iter()
        .map(|&lp| {
            let p = lp.exp();
            if p > 0.0 {
                p * lp
            } else {
                0.0
            }
        })
        .sum::<f32>()
}

/// Walks the unnormalised CDF `Σ_{k≤j} exp(z_k − max)` until it passes `u · sum`.
#[inline]
fn inverse_cdf(logits: &[f32], max: f32, sum: f32, u: f32) -> usize {
    let target = u * sum;
    let mut cumulative = 0.0f32;
    let mut last_positive = 0;
    for (action, &z) in logits.iter().enumerate() {
        let weight = (z - max).exp();
        if weight > 0.0 {
            cumulative += weight;
            last_positive = action;
            if cumulative > target {
                return action;
            }
        }
    }
    // Rounding can leave the running sum a hair below `u · sum` when `u` is close to 1; the
    // answer is then the last action with non-zero probability, never a masked one.
    last_positive
}

/// Samples an action index from `softmax(logits)` by inverting the CDF at `u`, a uniform draw
/// in `[0, 1)`.
///
/// Action `j` is returned when `Σ_{k<j} p_k ≤ u < Σ_{k≤j} p_k`, so a fixed `u` gives a
/// deterministic, monotone choice (useful for common random numbers and for tests). The CDF is
/// accumulated on `exp(z − max)`, which is stable for large logits, and an action of probability
/// zero is never returned.
///
/// `None` when the row has no distribution ([`is_distribution`]): the caller counts it and
/// acts without this row's policy.
///
/// # Panics
///
/// In debug builds, if `u` is outside `[0, 1)`.
///
/// # Example
///
/// ```
/// use volley_policy::distributions::sample_categorical;
///
/// // Probabilities [0.5, 0.5]: u below one half picks action 0.
/// assert_eq!(sample_categorical(&[3.0, 3.0], 0.25), Some(0));
/// assert_eq!(sample_categorical(&[3.0, 3.0], 0.75), Some(1));
/// assert_eq!(sample_categorical(&[f32::NAN, 3.0], 0.75), None);
/// ```
pub fn sample_categorical(logits: &[f32], u: f32) -> Option<usize> {
    debug_assert!((0.0..1.0).contains(&u), "u must lie in [0, 1), got {u}");
    let (max, sum) = shifted_exp_sum(logits)?;
    Some(inverse_cdf(logits, max, sum, u))
}

/// Samples an action from `softmax(logits)` with a uniform draw from `rng` and returns it with
/// its log-probability `log π(a)`, which the actor records as the behaviour log-probability.
///
/// `None` when the row has no distribution ([`is_distribution`]).
///
/// # Example
///
/// ```
/// use rand::{rngs::SmallRng, SeedableRng};
/// use volley_policy::distributions::sample_categorical_with_rng;
///
/// let mut rng = SmallRng::seed_from_u64(7);
/// let sampled = sample_categorical_with_rng(&[0.0, f32::NEG_INFINITY], &mut rng);
/// assert_eq!(sampled, Some((0, 0.0)));
/// ```
pub fn sample_categorical_with_rng(logits: &[f32], rng: &mut impl Rng) -> Option<(usize, f32)> {
    let u: f32 = rng.random();
    let (max, sum) = shifted_exp_sum(logits)?;
    let action = inverse_cdf(logits, max, sum, u);
    Some((action, (logits[action] - max) - sum.ln()))
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use rand::{rngs::SmallRng, SeedableRng};

    fn log_softmax_vec(logits: &[f32]) -> Vec<f32> {
        let mut out = vec![0.0; logits.len()];
        log_softmax(logits, &mut out);
        out
    }

    #[test]
    fn log_softmax_matches_hand_computation() {
        // logits [0, ln 3]: probabilities [1/4, 3/4].
        let lp = log_softmax_vec(&[0.0, 3f32.ln()]);
        assert!((lp[0] - 0.25f32.ln()).abs() < 1e-6);
        assert!((lp[1] - 0.75f32.ln()).abs() < 1e-6);
    }

    #[test]
    fn large_logits_do_not_overflow() {
        // Probabilities [1/2, 1/2, 0, 0]; a naive exp(1e30) would be +inf and give NaN.
        let logits = [1e30, 1e30, -1e30, 88.0];
        let lp = log_softmax_vec(&logits);
        assert!(lp.iter().all(|x| !x.is_nan()), "{lp:?}");
        assert!((lp[0] + 2f32.ln()).abs() < 1e-6, "{lp:?}");
        assert!((lp[1] + 2f32.ln()).abs() < 1e-6, "{lp:?}");
        assert!(lp[2] < -1e29 && lp[3] < -1e29, "{lp:?}");
        assert!((entropy_from_log_probs(&lp) - 2f32.ln()).abs() < 1e-6);
        assert_eq!(sample_categorical(&logits, 0.0), Some(0));
        assert_eq!(sample_categorical(&logits, 0.99), Some(1));
        let mut rng = SmallRng::seed_from_u64(1);
        let (_, log_prob) = sample_categorical_with_rng(&logits, &mut rng).expect("a distribution");
        assert!((log_prob + 2f32.ln()).abs() < 1e-6);
        assert_eq!(sample_categorical(&[1e38, -1e38, 3e38], 0.5), Some(2));
    }

    #[test]
    fn masked_actions_get_zero_probability_and_are_never_sampled() {
        let logits = [f32::NEG_INFINITY, 0.0, f32::NEG_INFINITY];
        let lp = log_softmax_vec(&logits);
        assert_eq!(lp, [f32::NEG_INFINITY, 0.0, f32::NEG_INFINITY]);
        assert_eq!(entropy_from_log_probs(&lp), 0.0);
        for u in [0.0, 0.5, 0.999_999_94] {
            assert_eq!(sample_categorical(&logits, u), Some(1));
        }
    }

    #[test]
    fn entropy_of_uniform_is_log_n() {
        let lp = log_softmax_vec(&[2.0; 5]);
        assert!((entropy_from_log_probs(&lp) - 5f32.ln()).abs() < 1e-6);
    }

    #[test]
    fn inverse_cdf_picks_the_bucket_containing_u() {
        // Probabilities [0.2, 0.3, 0.5]: buckets [0, 0.2), [0.2, 0.5), [0.5, 1).
        let logits = [0.2f32.ln(), 0.3f32.ln(), 0.5f32.ln()];
        assert_eq!(sample_categorical(&logits, 0.0), Some(0));
        assert_eq!(sample_categorical(&logits, 0.19), Some(0));
        assert_eq!(sample_categorical(&logits, 0.21), Some(1));
        assert_eq!(sample_categorical(&logits, 0.49), Some(1));
        assert_eq!(sample_categorical(&logits, 0.51), Some(2));
        assert_eq!(sample_categorical(&logits, 1.0 - f32::EPSILON / 2.0), Some(2));
    }

    #[test]
    fn sampling_frequencies_match_probabilities() {
        let logits = [1.0f32, -0.5, 2.0, 0.0, -3.0];
        let lp = log_softmax_vec(&logits);
        let mut rng = SmallRng::seed_from_u64(0x5eed);
        let n_draws = 200_000;
        let mut counts = [0usize; 5];
        for _ in 0..n_draws {
            let (action, log_prob) = sample_categorical_with_rng(&logits, &mut rng).expect("a distribution");
            assert!((log_prob - lp[action]).abs() < 1e-6);
            counts[action] += 1;
        }
        // Pearson's χ² with 4 degrees of freedom: P(χ² > 25) ≈ 5e-5, so a correct sampler with
        // this fixed seed passes and a biased one (say one bucket off by 1%) fails.
        let chi_square: f64 = counts
            .iter()
            .zip(&lp)
            .map(|(&count, &log_p)| {
                let expected = n_draws as f64 * f64::from(log_p).exp();
                (count as f64 - expected).powi(2) / expected
            })
            .sum();
        assert!(chi_square < 25.0, "χ² = {chi_square}, counts {counts:?}");
    }

    /// Issue 46: rows with no distribution were an assert (a NaN anchor crashed every actor,
    /// a recurrent state of 3e38 the GRU learner). Now the samplers say `None` and
    /// `log_softmax` writes NaN, which the learner's non-finite gradient check skips.
    #[test]
    fn rows_without_a_distribution_are_refused_without_a_panic() {
        let mut rng = SmallRng::seed_from_u64(3);
        for row in [
            vec![f32::NEG_INFINITY; 3],
            vec![f32::NAN, 0.0, 1.0],
            vec![0.0, f32::INFINITY],
            vec![f32::NAN; 2],
            vec![f32::INFINITY, f32::NEG_INFINITY],
            Vec::new(),
        ] {
            assert!(!is_distribution(&row), "{row:?}");
            assert_eq!(sample_categorical(&row, 0.5), None, "{row:?}");
            assert_eq!(sample_categorical_with_rng(&row, &mut rng), None, "{row:?}");
            assert!(log_softmax_vec(&row).iter().all(|lp| lp.is_nan()), "{row:?}");
        }
        assert!(is_distribution(&[f32::NEG_INFINITY, -3e38]));
    }

    proptest! {
        #[test]
        fn probabilities_sum_to_one(
            logits in prop::collection::vec(-1e4f32..1e4, 1..32),
            shift in -1e6f32..1e6,
        ) {
            let shifted: Vec<f32> = logits.iter().map(|z| z + shift).collect();
            let lp = log_softmax_vec(&shifted);
            let total: f64 = lp.iter().map(|&x| f64::from(x).exp()).sum();
            prop_assert!((total - 1.0).abs() < 1e-5, "sum {}", total);
            prop_assert!(lp.iter().all(|&x| x <= 0.0));
            let h = entropy_from_log_probs(&lp);
            prop_assert!(h >= -1e-6 && h <= (lp.len() as f32).ln() + 1e-5, "entropy {}", h);
        }

        #[test]
        fn sampling_is_monotone_in_u_and_never_picks_a_masked_action(
            logits in prop::collection::vec(
                prop_oneof![3 => -50f32..50.0, 1 => Just(f32::NEG_INFINITY)], 1..16),
            u1 in 0.0f32..1.0,
            u2 in 0.0f32..1.0,
        ) {
            prop_assume!(logits.iter().any(|z| z.is_finite()));
            let (lo, hi) = if u1 <= u2 { (u1, u2) } else { (u2, u1) };
            let sample = |u| sample_categorical(&logits, u).expect("one logit is finite");
            let (a_lo, a_hi) = (sample(lo), sample(hi));
            prop_assert!(a_lo <= a_hi);
            prop_assert!(logits[a_lo].is_finite() && logits[a_hi].is_finite());
        }
    }
}
