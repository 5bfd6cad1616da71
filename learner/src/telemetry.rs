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
//!
//! Both backends compute them from the same per-sample terms ([`OffPolicySums::add`]) in one
//! pass per update ([`crate::backend::Backend::off_policy_sums`]), so a GPU learner reports them too.

use volley_policy::head::importance;

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
    /// Subtracted from `log_rhos` per sample when given (`log π` and `log μ` apart).
    pub reference: Option<&'a [f32]>,
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

/// The weighted sums behind [`OffPolicyStats`], each over the samples with `w > 0`: what both
/// backends accumulate per update ([`crate::backend::Backend::off_policy_sums`]; the CUDA kernel
/// `off_policy_sums` in `learner/kernels/loss.cu` adds the same terms per sample).
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct OffPolicySums {
    /// `Σ w`.
    pub weight: f64,
    /// `Σ w [ρ > ρ̄]`.
    pub rho_clipped: f64,
    /// `Σ w [ρ > c̄]`.
    pub c_clipped: f64,
    /// `Σ w ((ρ − 1) − log ρ)`.
    pub kl: f64,
    /// `Σ w ρ`.
    pub ratio: f64,
    /// `Σ w ρ²`.
    pub ratio_sq: f64,
    /// `Σ w target`.
    pub target: f64,
    /// `Σ w target²`.
    pub target_sq: f64,
    /// `Σ w (target − V)`.
    pub error: f64,
    /// `Σ w (target − V)²`.
    pub error_sq: f64,
}

/// The number of sums in [`OffPolicySums`], in the order of its fields (the layout the CUDA
/// kernel writes).
pub const OFF_POLICY_SUMS: usize = 10;

/// What a backend writes for a sample of weight 0 in the ratios buffer of
/// [`crate::backend::Backend::off_policy_sums`] (a ratio is never negative).
pub const NO_RATIO: f32 = -1.0;

impl OffPolicySums {
    /// Add one sample of weight `w > 0`; returns its ratio `ρ`.
    #[inline]
    pub fn add(&mut self, w: f64, log_rho: f64, value: f64, target: f64, rho_bar: f32, c_bar: f32) -> f64 {
        let (rho, kl) = importance(log_rho);
        self.weight += w;
        self.rho_clipped += if rho > f64::from(rho_bar) { w } else { 0.0 };
        self.c_clipped += if rho > f64::from(c_bar) { w } else { 0.0 };
        self.kl += w * kl;
        self.ratio += w * rho;
        self.ratio_sq += w * rho * rho;
        let error = target - value;
        self.target += w * target;
        self.target_sq += w * target * target;
        self.error += w * error;
        self.error_sq += w * error * error;
        rho
    }

    /// The sums in field order.
    pub fn to_array(&self) -> [f64; OFF_POLICY_SUMS] {
        [
            self.weight,
            self.rho_clipped,
            self.c_clipped,
            self.kl,
            self.ratio,
            self.ratio_sq,
            self.target,
            self.target_sq,
            self.error,
            self.error_sq,
        ]
    }

    /// The sums from field order.
    pub fn from_array(a: &[f64; OFF_POLICY_SUMS]) -> Self {
        OffPolicySums {
            weight: a[0],
            rho_clipped: a[1],
            c_clipped: a[2],
            kl: a[3],
            ratio: a[4],
            ratio_sq: a[5],
            target: a[6],
            target_sq: a[7],
            error: a[8],
            error_sq: a[9],
        }
    }

    /// The statistics, with `ratios` the weighted samples' `ρ` for the histogram.
    pub fn finish(&self, ratios: Vec<f32>) -> OffPolicyStats {
        let w_sum = self.weight;
        if w_sum <= 0.0 {
            return OffPolicyStats { explained_variance: f32::NAN, ..OffPolicyStats::default() };
        }
        let var = |sum: f64, sq: f64| (sq / w_sum - (sum / w_sum).powi(2)).max(0.0);
        let target_var = var(self.target, self.target_sq);
        let (wr, wr2) = (self.ratio, self.ratio_sq);
        OffPolicyStats {
            rho_clipped_fraction: (self.rho_clipped / w_sum) as f32,
            c_clipped_fraction: (self.c_clipped / w_sum) as f32,
            behaviour_kl: (self.kl / w_sum) as f32,
            effective_sample_fraction: if wr2 > 0.0 { (wr * wr / wr2 / w_sum) as f32 } else { 0.0 },
            explained_variance: if target_var > 0.0 {
                (1.0 - var(self.error, self.error_sq) / target_var) as f32
            } else {
                f32::NAN
            },
            ratios,
        }
    }
}

/// The sums of `inputs` into `sums`, and each sample's `ρ` into `ratios` ([`NO_RATIO`] where its
/// weight is 0): the CPU backend's off-policy pass.
///
/// # Panics
/// If the slices differ in length.
pub fn off_policy_sums(inputs: &OffPolicyInputs<'_>, sums: &mut OffPolicySums, ratios: &mut [f32]) {
    let n = inputs.weights.len();
    for (name, len) in [
        ("log_rhos", inputs.log_rhos.len()),
        ("reference", inputs.reference.map_or(n, <[f32]>::len)),
        ("values", inputs.values.len()),
        ("value_targets", inputs.value_targets.len()),
        ("ratios", ratios.len()),
    ] {
        assert!(len == n, "{name}: expected {n} elements, got {len}");
    }
    for (i, ratio) in ratios.iter_mut().enumerate() {
        let w = f64::from(inputs.weights[i]);
        *ratio = if w <= 0.0 {
            NO_RATIO
        } else {
            let log_rho = inputs.log_rhos[i] - inputs.reference.map_or(0.0, |r| r[i]);
            let (value, target) = (inputs.values[i], inputs.value_targets[i]);
            sums.add(w, f64::from(log_rho), f64::from(value), f64::from(target), inputs.rho_bar, inputs.c_bar) as f32
        };
    }
}

/// Compute the statistics; sums in `f64`.
///
/// # Panics
/// If the slices differ in length.
pub fn off_policy_stats(inputs: &OffPolicyInputs<'_>) -> OffPolicyStats {
    let mut sums = OffPolicySums::default();
    let mut ratios = vec![0.0; inputs.weights.len()];
    off_policy_sums(inputs, &mut sums, &mut ratios);
    ratios.retain(|&r| r != NO_RATIO);
    sums.finish(ratios)
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn stats_of(target: &[f32], behaviour: &[f32], weights: &[f32], values: &[f32], targets: &[f32]) -> OffPolicyStats {
        let log_rhos: Vec<f32> = target.iter().zip(behaviour).map(|(t, b)| t - b).collect();
        off_policy_stats(&OffPolicyInputs {
            log_rhos: &log_rhos,
            reference: None,
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
