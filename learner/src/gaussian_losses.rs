//! The V-trace and PPO losses for a diagonal Gaussian head (issue 14): the same objectives as
//! [`crate::losses`], with `log π(a|x)` and `H(π(·|x))` from [`volley_policy::gaussian`]
//! instead of a softmax, and a second gradient output: `∂L/∂s` per sample for the
//! state-independent log-std parameters `s` (the caller sums the rows into the parameter
//! gradient, [`crate::backend::Backend::column_sums`]).
//!
//! The heads block is the network's `[rows][A + 1]`: the `A` means, then the value. Actions are
//! `[n][A]` floats as the actor recorded them (see [`volley_policy::gaussian`] for the
//! squashing convention), so the behaviour log-probability and the learner's re-evaluation
//! are the same function of the same numbers.
//!
//! These are the CPU backend's implementations; the CUDA kernels in `learner/kernels/gaussian.cu`
//! compute the same sums and gradients.

use volley_policy::gaussian;
use volley_policy::returns::vtrace;

use crate::losses::{PpoLossConfig, VTraceLossConfig, WeightedSums};

/// A time-major batch (or a PPO minibatch, with `t_len = 1`) for a Gaussian head; every
/// per-sample slice is `[T][B]`, `actions` is `[T][B][A]`.
#[derive(Debug, Clone, Copy)]
pub struct GaussianBatch<'a> {
    /// `T`.
    pub t_len: usize,
    /// `B`.
    pub b_len: usize,
    /// `A`, the values of one action.
    pub action_dim: usize,
    /// Whether actions are `tanh`-squashed.
    pub squash: bool,
    /// The log-std parameters, `[A]`.
    pub log_std: &'a [f32],
    /// The actions as recorded, `[T][B][A]`.
    pub actions: &'a [f32],
    /// `log μ(a|x)` (V-trace only; empty for PPO).
    pub behaviour_log_probs: &'a [f32],
    /// Rewards (V-trace only).
    pub rewards: &'a [f32],
    /// `γ (1 − terminated)` (V-trace only).
    pub discounts: &'a [f32],
    /// Per-sample weights.
    pub sample_weights: &'a [f32],
}

impl GaussianBatch<'_> {
    fn n_samples(&self) -> usize {
        self.t_len * self.b_len
    }
}

#[track_caller]
fn assert_len(name: &str, got: usize, expected: usize) {
    assert!(got == expected, "{name}: expected {expected} elements, got {got}");
}

/// `out[i] = log π(a_i|x_i) − reference[i]` (or without the reference) for `n` heads rows of
/// stride `A + 1`.
///
/// # Panics
/// If a length disagrees with `n` and `A`.
pub fn gaussian_log_probs(
    heads: &[f32],
    log_std: &[f32],
    actions: &[f32],
    squash: bool,
    reference: Option<&[f32]>,
    out: &mut [f32],
) {
    let (n, a) = (out.len(), log_std.len());
    assert_len("heads", heads.len(), n * (a + 1));
    assert_len("actions", actions.len(), n * a);
    if let Some(reference) = reference {
        assert_len("reference", reference.len(), n);
    }
    for (i, ((row, action), o)) in
        heads.chunks_exact(a + 1).zip(actions.chunks_exact(a)).zip(out.iter_mut()).enumerate()
    {
        let log_prob = gaussian::log_prob(&row[..a], log_std, action, squash);
        *o = log_prob - reference.map_or(0.0, |r| r[i]);
    }
}

/// The IMPALA V-trace loss for a Gaussian head over `[T+1][B]` heads rows (row `T` supplies
/// the bootstrap value only), as [`crate::losses::vtrace_loss`] does for a categorical one:
/// writes `log_rhos`, `vs`, `pg_advantages` (`[T][B]`), `d_heads` (`[T+1][B][A + 1]`, zero on
/// the bootstrap row) and `d_log_std_rows` (`[T][B][A]`). Returns the weighted sums and `W`.
///
/// # Panics
/// If a length disagrees with the batch shape.
#[allow(clippy::too_many_arguments)]
pub fn gaussian_vtrace_loss_heads(
    batch: &GaussianBatch<'_>,
    heads: &[f32],
    values: &[f32],
    config: &VTraceLossConfig,
    advantage_override: Option<&[f32]>,
    log_rhos: &mut [f32],
    vs: &mut [f32],
    pg_advantages: &mut [f32],
    d_heads: &mut [f32],
    d_log_std_rows: &mut [f32],
) -> (WeightedSums, f64) {
    let n = batch.n_samples();
    let a = batch.action_dim;
    let stride = a + 1;
    let rows = n + batch.b_len;
    assert_len("log_std", batch.log_std.len(), a);
    for (name, len) in [
        ("behaviour_log_probs", batch.behaviour_log_probs.len()),
        ("rewards", batch.rewards.len()),
        ("discounts", batch.discounts.len()),
        ("sample_weights", batch.sample_weights.len()),
        ("log_rhos", log_rhos.len()),
        ("vs", vs.len()),
        ("pg_advantages", pg_advantages.len()),
    ] {
        assert_len(name, len, n);
    }
    assert_len("heads", heads.len(), rows * stride);
    assert_len("values", values.len(), rows);
    assert_len("d_heads", d_heads.len(), rows * stride);
    assert_len("d_log_std_rows", d_log_std_rows.len(), n * a);

    let (d_heads, d_heads_bootstrap) = d_heads.split_at_mut(n * stride);
    d_heads_bootstrap.fill(0.0);
    let (values, bootstrap_value) = values.split_at(n);
    gaussian_log_probs(
        &heads[..n * stride],
        batch.log_std,
        batch.actions,
        batch.squash,
        Some(batch.behaviour_log_probs),
        log_rhos,
    );
    vtrace(
        batch.t_len,
        batch.b_len,
        log_rhos,
        batch.discounts,
        batch.rewards,
        values,
        bootstrap_value,
        &config.vtrace,
        vs,
        pg_advantages,
    );
    if let Some(advantage_override) = advantage_override {
        crate::losses::override_pg_advantages(
            advantage_override,
            log_rhos,
            config.vtrace.clip_pg_rho_threshold,
            pg_advantages,
        );
    }
    let weight_sum: f64 = batch.sample_weights.iter().map(|&w| f64::from(w)).sum();
    let mut sums = WeightedSums::default();
    if weight_sum <= 0.0 {
        d_heads.fill(0.0);
        d_log_std_rows.fill(0.0);
        return (sums, weight_sum);
    }
    let inv_weight_sum = (1.0 / weight_sum) as f32;
    let entropy = gaussian::entropy(batch.log_std);
    for i in 0..n {
        let (grad_row, d_log_std) =
            (&mut d_heads[i * stride..(i + 1) * stride], &mut d_log_std_rows[i * a..(i + 1) * a]);
        let weight = batch.sample_weights[i];
        if weight == 0.0 {
            grad_row.fill(0.0);
            d_log_std.fill(0.0);
            continue;
        }
        let scale = weight * inv_weight_sum;
        let (value, target, pg_advantage, log_rho) = (values[i], vs[i], pg_advantages[i], log_rhos[i]);
        let (d_mean, d_value) = grad_row.split_at_mut(a);
        let log_prob = gaussian::row_gradient(
            &heads[i * stride..i * stride + a],
            batch.log_std,
            &batch.actions[i * a..(i + 1) * a],
            batch.squash,
            scale * pg_advantage,
            scale * config.ent_coef,
            d_mean,
            d_log_std,
        );
        d_value[0] = -config.value_coef * scale * (target - value);
        let w = f64::from(weight);
        let rho = log_rho.exp();
        sums.policy += w * f64::from(-pg_advantage * log_prob);
        sums.value += w * 0.5 * f64::from(target - value).powi(2);
        sums.entropy += w * f64::from(entropy);
        sums.add_ratio(w, f64::from(rho), f64::from(log_rho), rho > config.vtrace.clip_rho_threshold);
    }
    (sums, weight_sum)
}

/// What the Gaussian PPO loss needs beyond the batch, all `[n]`.
#[derive(Debug, Clone, Copy)]
pub struct GaussianPpoTargets<'a> {
    /// Advantages.
    pub advantages: &'a [f32],
    /// Value targets.
    pub returns: &'a [f32],
    /// `log π_prox(a|x)`.
    pub prox_log_probs: &'a [f32],
    /// `min(π_prox/μ, clip)`.
    pub is_weights: &'a [f32],
}

/// The decoupled PPO-clip loss for a Gaussian head over `n = T·B` independent samples, as
/// [`crate::losses::ppo_loss`] does for a categorical one: writes `d_heads` (`[n][A + 1]`)
/// and `d_log_std_rows` (`[n][A]`). Returns the weighted sums and `W`.
///
/// # Panics
/// If a length disagrees with the batch shape.
pub fn gaussian_ppo_loss_heads(
    batch: &GaussianBatch<'_>,
    targets: &GaussianPpoTargets<'_>,
    heads: &[f32],
    values: &[f32],
    config: &PpoLossConfig,
    d_heads: &mut [f32],
    d_log_std_rows: &mut [f32],
) -> (WeightedSums, f64) {
    let n = batch.n_samples();
    let a = batch.action_dim;
    let stride = a + 1;
    assert_len("log_std", batch.log_std.len(), a);
    assert_len("actions", batch.actions.len(), n * a);
    for (name, len) in [
        ("sample_weights", batch.sample_weights.len()),
        ("advantages", targets.advantages.len()),
        ("returns", targets.returns.len()),
        ("prox_log_probs", targets.prox_log_probs.len()),
        ("is_weights", targets.is_weights.len()),
        ("values", values.len()),
    ] {
        assert_len(name, len, n);
    }
    assert_len("heads", heads.len(), n * stride);
    assert_len("d_heads", d_heads.len(), n * stride);
    assert_len("d_log_std_rows", d_log_std_rows.len(), n * a);

    let weight_sum: f64 = batch.sample_weights.iter().map(|&w| f64::from(w)).sum();
    let mut sums = WeightedSums::default();
    if weight_sum <= 0.0 {
        d_heads.fill(0.0);
        d_log_std_rows.fill(0.0);
        return (sums, weight_sum);
    }
    let inv_weight_sum = (1.0 / weight_sum) as f32;
    let (adv_shift, adv_scale) = if config.normalize_advantages {
        let weighted = || {
            batch
                .sample_weights
                .iter()
                .zip(targets.advantages)
                .filter(|(&w, _)| w != 0.0)
                .map(|(&w, &adv)| (f64::from(w), f64::from(adv)))
        };
        let mean = weighted().map(|(w, adv)| w * adv).sum::<f64>() / weight_sum;
        let variance = weighted().map(|(w, adv)| w * (adv - mean).powi(2)).sum::<f64>() / weight_sum;
        (mean as f32, (1.0 / (variance.sqrt() + 1e-8)) as f32)
    } else {
        (0.0, 1.0)
    };
    let (clip_low, clip_high) = (1.0 - config.clip_coef, 1.0 + config.clip_coef);
    let entropy = gaussian::entropy(batch.log_std);
    for i in 0..n {
        let (grad_row, d_log_std) =
            (&mut d_heads[i * stride..(i + 1) * stride], &mut d_log_std_rows[i * a..(i + 1) * a]);
        let weight = batch.sample_weights[i];
        if weight == 0.0 {
            grad_row.fill(0.0);
            d_log_std.fill(0.0);
            continue;
        }
        let scale = weight * inv_weight_sum;
        let mean = &heads[i * stride..i * stride + a];
        let action = &batch.actions[i * a..(i + 1) * a];
        let log_prob = gaussian::log_prob(mean, batch.log_std, action, batch.squash);
        let log_ratio = log_prob - targets.prox_log_probs[i];
        let ratio = log_ratio.exp();
        let advantage = (targets.advantages[i] - adv_shift) * adv_scale;
        // PPO-clip surrogate (Schulman et al. 2017, eq. (7)); d(r Â)/d log π = r Â.
        let unclipped = ratio * advantage;
        let clipped = ratio.clamp(clip_low, clip_high) * advantage;
        let (surrogate, surrogate_grad) = if unclipped <= clipped { (unclipped, unclipped) } else { (clipped, 0.0) };
        let is_weight = targets.is_weights[i];
        let (d_mean, d_value) = grad_row.split_at_mut(a);
        gaussian::row_gradient(
            mean,
            batch.log_std,
            action,
            batch.squash,
            scale * is_weight * surrogate_grad,
            scale * config.ent_coef,
            d_mean,
            d_log_std,
        );
        let (value, ret) = (values[i], targets.returns[i]);
        d_value[0] = -config.value_coef * scale * (ret - value);
        let w = f64::from(weight);
        sums.policy -= w * f64::from(is_weight * surrogate);
        sums.value += w * 0.5 * f64::from(ret - value).powi(2);
        sums.entropy += w * f64::from(entropy);
        sums.add_ratio(w, f64::from(ratio), f64::from(log_ratio), (ratio - 1.0).abs() > config.clip_coef);
    }
    (sums, weight_sum)
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::{rngs::SmallRng, Rng, SeedableRng};
    use volley_policy::returns::VTraceConfig;

    /// A random Gaussian batch: `[T+1][B]` heads rows, actions drawn from the head (so the
    /// behaviour log-probabilities are those of a nearby policy).
    struct Fixture {
        t_len: usize,
        b_len: usize,
        a: usize,
        squash: bool,
        heads: Vec<f32>,
        log_std: Vec<f32>,
        actions: Vec<f32>,
        behaviour: Vec<f32>,
        rewards: Vec<f32>,
        discounts: Vec<f32>,
        weights: Vec<f32>,
    }

    impl Fixture {
        fn new(squash: bool, seed: u64) -> Self {
            let (t_len, b_len, a) = (4, 3, 2);
            let mut rng = SmallRng::seed_from_u64(seed);
            let rows = (t_len + 1) * b_len;
            let heads: Vec<f32> = (0..rows * (a + 1)).map(|_| rng.random_range(-0.8..0.8)).collect();
            let log_std: Vec<f32> = (0..a).map(|_| rng.random_range(-0.7..0.3)).collect();
            let n = t_len * b_len;
            let mut actions = vec![0.0; n * a];
            let mut behaviour = vec![0.0; n];
            for i in 0..n {
                // A behaviour policy a little off the current one.
                let mean: Vec<f32> = heads[i * (a + 1)..i * (a + 1) + a].iter().map(|m| m + 0.1).collect();
                behaviour[i] = gaussian::sample(&mean, &log_std, squash, &mut rng, &mut actions[i * a..(i + 1) * a]);
            }
            let rewards = (0..n).map(|_| rng.random_range(-1.0..1.0)).collect();
            let discounts = (0..n).map(|i| if i == 7 { 0.0 } else { 0.9 }).collect();
            let weights = (0..n).map(|i| if i == 4 { 0.0 } else { 1.0 }).collect();
            Fixture { t_len, b_len, a, squash, heads, log_std, actions, behaviour, rewards, discounts, weights }
        }

        fn batch(&self) -> GaussianBatch<'_> {
            GaussianBatch {
                t_len: self.t_len,
                b_len: self.b_len,
                action_dim: self.a,
                squash: self.squash,
                log_std: &self.log_std,
                actions: &self.actions,
                behaviour_log_probs: &self.behaviour,
                rewards: &self.rewards,
                discounts: &self.discounts,
                sample_weights: &self.weights,
            }
        }

        fn values(&self, heads: &[f32]) -> Vec<f32> {
            heads.chunks_exact(self.a + 1).map(|row| row[self.a]).collect()
        }

        /// The V-trace loss total with the targets frozen at `frozen` (vs, pg advantages).
        fn vtrace_total(
            &self,
            heads: &[f32],
            log_std: &[f32],
            config: &VTraceLossConfig,
            frozen: &(Vec<f32>, Vec<f32>),
        ) -> f64 {
            let n = self.t_len * self.b_len;
            let w_sum: f64 = self.weights.iter().map(|&w| f64::from(w)).sum();
            let mut total = 0.0;
            for i in 0..n {
                let w = f64::from(self.weights[i]);
                let row = &heads[i * (self.a + 1)..(i + 1) * (self.a + 1)];
                let lp = gaussian_log_prob_f64(
                    &row[..self.a],
                    log_std,
                    &self.actions[i * self.a..(i + 1) * self.a],
                    self.squash,
                );
                let entropy: f64 =
                    log_std.iter().map(|&s| f64::from(s) + 0.5 + 0.5 * (std::f64::consts::TAU).ln()).sum();
                let value = f64::from(row[self.a]);
                total += w
                    * (-f64::from(frozen.1[i]) * lp
                        + f64::from(config.value_coef) * 0.5 * (f64::from(frozen.0[i]) - value).powi(2)
                        - f64::from(config.ent_coef) * entropy);
            }
            total / w_sum
        }
    }

    fn gaussian_log_prob_f64(mean: &[f32], log_std: &[f32], action: &[f32], squash: bool) -> f64 {
        let mut total = 0.0;
        for ((&mu, &s), &a) in mean.iter().zip(log_std).zip(action) {
            let (mu, s, a) = (f64::from(mu), f64::from(s), f64::from(a));
            let u = if squash { a.atanh() } else { a };
            total += -0.5 * ((u - mu) / s.exp()).powi(2) - s - 0.5 * (std::f64::consts::TAU).ln();
            if squash {
                total -= (1.0 - u.tanh().powi(2)).ln();
            }
        }
        total
    }

    /// Finite differences of the V-trace loss (targets frozen, as the gradient defines them)
    /// against the analytic gradient, for every mean, value and log-std parameter.
    #[test]
    fn vtrace_gradients_match_finite_differences() {
        for squash in [false, true] {
            let fixture = Fixture::new(squash, 5);
            let n = fixture.t_len * fixture.b_len;
            let stride = fixture.a + 1;
            let config = VTraceLossConfig {
                vtrace: VTraceConfig {
                    clip_rho_threshold: 1.0,
                    clip_pg_rho_threshold: 1.0,
                    clip_c_threshold: 1.0,
                    lambda_: 0.95,
                },
                value_coef: 0.5,
                ent_coef: 0.01,
            };
            let values = fixture.values(&fixture.heads);
            let (mut log_rhos, mut vs, mut pg) = (vec![0.0; n], vec![0.0; n], vec![0.0; n]);
            let mut d_heads = vec![0.0; fixture.heads.len()];
            let mut d_log_std_rows = vec![0.0; n * fixture.a];
            gaussian_vtrace_loss_heads(
                &fixture.batch(),
                &fixture.heads,
                &values,
                &config,
                None,
                &mut log_rhos,
                &mut vs,
                &mut pg,
                &mut d_heads,
                &mut d_log_std_rows,
            );
            let frozen = (vs.clone(), pg.clone());
            let eps = 1e-3f32;
            for k in 0..n * stride {
                let (mut plus, mut minus) = (fixture.heads.clone(), fixture.heads.clone());
                plus[k] += eps;
                minus[k] -= eps;
                let fd = (fixture.vtrace_total(&plus, &fixture.log_std, &config, &frozen)
                    - fixture.vtrace_total(&minus, &fixture.log_std, &config, &frozen))
                    / (2.0 * f64::from(eps));
                assert!(
                    (f64::from(d_heads[k]) - fd).abs() < 2e-3,
                    "squash {squash}, heads[{k}]: {} vs {fd}",
                    d_heads[k]
                );
            }
            assert!(d_heads[n * stride..].iter().all(|&g| g == 0.0), "the bootstrap row gets no gradient");
            for j in 0..fixture.a {
                let analytic: f32 = d_log_std_rows.chunks_exact(fixture.a).map(|row| row[j]).sum();
                let (mut plus, mut minus) = (fixture.log_std.clone(), fixture.log_std.clone());
                plus[j] += eps;
                minus[j] -= eps;
                let fd = (fixture.vtrace_total(&fixture.heads, &plus, &config, &frozen)
                    - fixture.vtrace_total(&fixture.heads, &minus, &config, &frozen))
                    / (2.0 * f64::from(eps));
                assert!((f64::from(analytic) - fd).abs() < 2e-3, "squash {squash}, log_std[{j}]: {analytic} vs {fd}");
            }
        }
    }

    /// Finite differences of the PPO loss against the analytic gradient, for means, values and
    /// log-stds, with clipping active on some samples.
    #[test]
    fn ppo_gradients_match_finite_differences() {
        for squash in [false, true] {
            let fixture = Fixture::new(squash, 9);
            let n = fixture.t_len * fixture.b_len;
            let stride = fixture.a + 1;
            let heads = &fixture.heads[..n * stride];
            let values = fixture.values(heads);
            let mut rng = SmallRng::seed_from_u64(1);
            let advantages: Vec<f32> = (0..n).map(|_| rng.random_range(-1.0..1.0)).collect();
            let returns: Vec<f32> = (0..n).map(|_| rng.random_range(-1.0..1.0)).collect();
            // The proximal policy is the behaviour one, so ratios differ from 1 and some clip.
            let prox = fixture.behaviour.clone();
            let is_weights: Vec<f32> = (0..n).map(|i| 0.5 + 0.05 * i as f32).collect();
            let targets = GaussianPpoTargets {
                advantages: &advantages,
                returns: &returns,
                prox_log_probs: &prox,
                is_weights: &is_weights,
            };
            let config = PpoLossConfig { clip_coef: 0.2, value_coef: 0.5, ent_coef: 0.01, normalize_advantages: true };
            let batch = GaussianBatch {
                t_len: 1,
                b_len: n,
                behaviour_log_probs: &[],
                rewards: &[],
                discounts: &[],
                ..fixture.batch()
            };
            let loss = |heads: &[f32], log_std: &[f32]| {
                let batch = GaussianBatch { log_std, ..batch };
                let mut d = vec![0.0; heads.len()];
                let mut ds = vec![0.0; n * fixture.a];
                let (sums, w) =
                    gaussian_ppo_loss_heads(&batch, &targets, heads, &fixture.values(heads), &config, &mut d, &mut ds);
                sums.stats(w, config.value_coef, config.ent_coef).total as f64
            };
            let mut d_heads = vec![0.0; heads.len()];
            let mut d_log_std_rows = vec![0.0; n * fixture.a];
            let (sums, w) =
                gaussian_ppo_loss_heads(&batch, &targets, heads, &values, &config, &mut d_heads, &mut d_log_std_rows);
            let stats = sums.stats(w, config.value_coef, config.ent_coef);
            assert!(stats.clip_fraction > 0.0 && stats.clip_fraction < 1.0, "{stats:?}");
            let eps = 1e-3f32;
            let mut checked = 0;
            for k in 0..n * stride {
                let (mut plus, mut minus) = (heads.to_vec(), heads.to_vec());
                plus[k] += eps;
                minus[k] -= eps;
                let (lp, lm) = (loss(&plus, &fixture.log_std), loss(&minus, &fixture.log_std));
                let fd = (lp - lm) / (2.0 * f64::from(eps));
                // The clipped surrogate has kinks; skip coordinates where the two sides straddle one.
                let centre = loss(heads, &fixture.log_std);
                if ((lp - centre) - (centre - lm)).abs() > 1e-4 {
                    continue;
                }
                checked += 1;
                assert!(
                    (f64::from(d_heads[k]) - fd).abs() < 3e-3,
                    "squash {squash}, heads[{k}]: {} vs {fd}",
                    d_heads[k]
                );
            }
            assert!(checked > n * stride / 2, "only {checked} coordinates were smooth");
            for j in 0..fixture.a {
                let analytic: f32 = d_log_std_rows.chunks_exact(fixture.a).map(|row| row[j]).sum();
                let (mut plus, mut minus) = (fixture.log_std.clone(), fixture.log_std.clone());
                plus[j] += eps;
                minus[j] -= eps;
                let fd = (loss(heads, &plus) - loss(heads, &minus)) / (2.0 * f64::from(eps));
                assert!((f64::from(analytic) - fd).abs() < 3e-3, "squash {squash}, log_std[{j}]: {analytic} vs {fd}");
            }
        }
    }

    #[test]
    fn log_probs_of_the_behaviour_policy_reproduce_what_the_actor_recorded() {
        let fixture = Fixture::new(true, 3);
        let n = fixture.t_len * fixture.b_len;
        let a = fixture.a;
        // The behaviour means were heads + 0.1; rebuild those heads and re-evaluate.
        let heads: Vec<f32> = fixture.heads[..n * (a + 1)]
            .chunks_exact(a + 1)
            .flat_map(|row| row[..a].iter().map(|m| m + 0.1).chain([row[a]]).collect::<Vec<_>>())
            .collect();
        let mut out = vec![0.0; n];
        gaussian_log_probs(&heads, &fixture.log_std, &fixture.actions, true, Some(&fixture.behaviour), &mut out);
        assert!(out.iter().all(|&d| d == 0.0), "{out:?}");
    }
}
