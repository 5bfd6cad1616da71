//! Off-policy health of one update: how far the batch's behaviour policy `μ` (recorded by the
//! actors) is from the learner's policy `π`, and how well the value head fits its targets.
//! These are what tell a lagging, collapsing or healthy asynchronous run apart; they are
//! exported per update (docs/OPERATIONS.md, "Off-policy health").
//!
//! All statistics are over the samples with weight `w > 0`, weighted by `w`, from the
//! per-sample log importance ratio `log ρ = log π(a|x) − log μ(a|x)`:
//!
//! - `rho_clipped_fraction`: share of weight with `ρ > ρ̄` (V-trace's value-target clip; for PPO
//!   the behaviour IS clip);
//! - `c_clipped_fraction`: share of weight with `ρ > c̄` (V-trace's trace cut; for PPO the same
//!   IS clip, since PPO has no traces);
//! - `behaviour_kl`: the `k3` estimate `E_μ[(ρ − 1) − log ρ]` of `KL(μ ‖ π)` (Schulman's
//!   low-variance, always non-negative estimator), from the behaviour's own samples;
//! - `effective_sample_fraction`: Kish's effective sample size of importance weights `ρ`,
//!   `(Σ w ρ)² / (Σ w ρ²)`, divided by `Σ w`: 1 on-policy, near 0 when a few samples dominate;
//! - `explained_variance`: `1 − Var(target − V) / Var(target)` of the value head against the
//!   update's value targets (V-trace `v_s`, PPO returns): 1 is a perfect fit, 0 no better than a
//!   constant, negative worse.
//!
//! `ratios` keeps every weighted sample's `ρ` for the importance-ratio histogram.

/// Off-policy statistics of one update (see the module docs).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct OffPolicyStats {
    /// Share of weight whose ratio exceeds `ρ̄`.
    pub rho_clipped_fraction: f32,
    /// Share of weight whose ratio exceeds `c̄`.
    pub c_clipped_fraction: f32,
    /// `k3` estimate of `KL(μ ‖ π)` in nats.
    pub behaviour_kl: f32,
    /// Kish effective sample size of the ratios over the weight sum, in `(0, 1]`.
    pub effective_sample_fraction: f32,
    /// `1 − Var(target − V) / Var(target)`; NaN when the targets have no variance.
    pub explained_variance: f32,
    /// `ρ` of every weighted sample.
    pub ratios: Vec<f32>,
}

/// Inputs of [`off_policy_stats`], all `[T][B]` and of equal length.
#[derive(Debug, Clone, Copy)]
pub struct OffPolicyInputs<'a> {
    /// `log ρ = log π(a|x) − log μ(a|x)`: the learner's parameters before this update against
    /// the behaviour log-probabilities the actors recorded.
    pub log_rhos: &'a [f32],
    /// Sample weights (0 drops a sample).
    pub weights: &'a [f32],
    /// The value head's outputs.
    pub values: &'a [f32],
    /// The value targets the update regresses on.
    pub value_targets: &'a [f32],
    /// `ρ̄`.
    pub rho_bar: f32,
    /// `c̄`.
    pub c_bar: f32,
}

/// Compute the statistics; sums in `f64`.
///
/// # Panics
/// If the slices differ in length.
pub fn off_policy_stats(inputs: &OffPolicyInputs<'_>) -> OffPolicyStats {
    let n = inputs.weights.len();
    for (name, len) in [
        ("log_rhos", inputs.log_rhos.len()),
        ("values", inputs.values.len()),
        ("value_targets", inputs.value_targets.len()),
    ] {
        assert!(len == n, "{name}: expected {n} elements, got {len}");
    }
    let mut ratios = Vec::with_capacity(n);
    let (mut w_sum, mut rho_clipped, mut c_clipped, mut kl, mut wr, mut wr2) = (0f64, 0f64, 0f64, 0f64, 0f64, 0f64);
    let (mut t_sum, mut t_sq, mut e_sum, mut e_sq) = (0f64, 0f64, 0f64, 0f64);
    for i in 0..n {
        let w = f64::from(inputs.weights[i]);
        if w <= 0.0 {
            continue;
        }
        let log_rho = f64::from(inputs.log_rhos[i]);
        let rho = log_rho.exp();
        ratios.push(rho as f32);
        w_sum += w;
        rho_clipped += if rho > f64::from(inputs.rho_bar) { w } else { 0.0 };
        c_clipped += if rho > f64::from(inputs.c_bar) { w } else { 0.0 };
        // exp_m1 keeps (ρ − 1) − log ρ exact near ρ = 1, where both terms cancel.
        kl += w * (log_rho.exp_m1() - log_rho);
        wr += w * rho;
        wr2 += w * rho * rho;
        let target = f64::from(inputs.value_targets[i]);
        let error = target - f64::from(inputs.values[i]);
        t_sum += w * target;
        t_sq += w * target * target;
        e_sum += w * error;
        e_sq += w * error * error;
    }
    if w_sum <= 0.0 {
        return OffPolicyStats { explained_variance: f32::NAN, ..OffPolicyStats::default() };
    }
    let var = |sum: f64, sq: f64| (sq / w_sum - (sum / w_sum).powi(2)).max(0.0);
    let target_var = var(t_sum, t_sq);
    OffPolicyStats {
        rho_clipped_fraction: (rho_clipped / w_sum) as f32,
        c_clipped_fraction: (c_clipped / w_sum) as f32,
        behaviour_kl: (kl / w_sum) as f32,
        effective_sample_fraction: if wr2 > 0.0 { (wr * wr / wr2 / w_sum) as f32 } else { 0.0 },
        explained_variance: if target_var > 0.0 { (1.0 - var(e_sum, e_sq) / target_var) as f32 } else { f32::NAN },
        ratios,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn stats_of(target: &[f32], behaviour: &[f32], weights: &[f32], values: &[f32], targets: &[f32]) -> OffPolicyStats {
        let log_rhos: Vec<f32> = target.iter().zip(behaviour).map(|(t, b)| t - b).collect();
        off_policy_stats(&OffPolicyInputs {
            log_rhos: &log_rhos,
            weights,
            values,
            value_targets: targets,
            rho_bar: 1.0,
            c_bar: 1.0,
        })
    }

    #[test]
    fn on_policy_data_is_unclipped_with_full_sample_size_and_no_kl() {
        let lp = [-0.7, -0.2, -1.5, -0.1];
        let stats = stats_of(&lp, &lp, &[1.0; 4], &[0.0, 1.0, 2.0, 3.0], &[0.0, 1.0, 2.0, 3.0]);
        assert_eq!(stats.rho_clipped_fraction, 0.0);
        assert_eq!(stats.c_clipped_fraction, 0.0);
        assert_eq!(stats.behaviour_kl, 0.0);
        assert!((stats.effective_sample_fraction - 1.0).abs() < 1e-6);
        assert_eq!(stats.explained_variance, 1.0);
        assert_eq!(stats.ratios, vec![1.0; 4]);
    }

    #[test]
    fn hand_worked_batch() {
        // ρ = e^1, 1, e^-1 (weights 1, 1, 2; the last sample is dropped).
        let target = [0.0, -1.0, -2.0, 5.0];
        let behaviour = [-1.0, -1.0, -1.0, 0.0];
        let weights = [1.0, 1.0, 2.0, 0.0];
        let values = [1.0, 1.0, 1.0, 100.0];
        let targets = [2.0, 0.0, 1.0, -100.0];
        let stats = stats_of(&target, &behaviour, &weights, &values, &targets);
        let e = std::f64::consts::E;
        assert!((stats.rho_clipped_fraction - 0.25).abs() < 1e-6, "{stats:?}");
        let kl = ((e - 1.0 - 1.0) + 0.0 + 2.0 * (1.0 / e - 1.0 + 1.0)) / 4.0;
        assert!((f64::from(stats.behaviour_kl) - kl).abs() < 1e-6, "{stats:?} vs {kl}");
        let (wr, wr2) = (e + 1.0 + 2.0 / e, e * e + 1.0 + 2.0 / (e * e));
        assert!((f64::from(stats.effective_sample_fraction) - wr * wr / wr2 / 4.0).abs() < 1e-6);
        // targets 2, 0, 1(×2): mean 1, var 0.5; errors 1, −1, 0(×2): mean 0, var 0.5.
        assert!(stats.explained_variance.abs() < 1e-6, "{stats:?}");
        assert_eq!(stats.ratios.len(), 3);
    }

    #[test]
    fn no_weight_gives_zeros_and_undefined_explained_variance() {
        let stats = stats_of(&[0.0], &[0.0], &[0.0], &[0.0], &[0.0]);
        assert_eq!(stats.effective_sample_fraction, 0.0);
        assert!(stats.explained_variance.is_nan());
        assert!(stats.ratios.is_empty());
    }

    proptest! {
        #[test]
        fn fractions_are_bounded_and_kl_non_negative(
            rows in proptest::collection::vec((-8.0f32..0.0, -8.0f32..0.0, 0.0f32..2.0, -5.0f32..5.0, -5.0f32..5.0), 1..64)
        ) {
            let col = |k: usize| -> Vec<f32> { rows.iter().map(|r| [r.0, r.1, r.2, r.3, r.4][k]).collect() };
            let (target, behaviour, weights, values, targets) = (col(0), col(1), col(2), col(3), col(4));
            let stats = stats_of(&target, &behaviour, &weights, &values, &targets);
            prop_assert!((0.0..=1.0).contains(&stats.rho_clipped_fraction));
            prop_assert!((0.0..=1.0).contains(&stats.c_clipped_fraction));
            prop_assert!(stats.behaviour_kl >= -1e-6, "{}", stats.behaviour_kl);
            prop_assert!((0.0..=1.0 + 1e-5).contains(&stats.effective_sample_fraction));
            prop_assert!(stats.explained_variance.is_nan() || stats.explained_variance <= 1.0 + 1e-5);
        }
    }
}
