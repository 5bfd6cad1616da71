//! Tests of the two loss bodies on the categorical head: gradients against finite differences,
//! masking and zero weight, the on-policy and unit-ratio reductions, ratio statistics, and
//! group advantages (the Gaussian head's are in `losses_gaussian_tests.rs`).

use super::*;
use rand::{rngs::SmallRng, Rng, SeedableRng};
use volley_policy::distributions::log_softmax;

/// `log softmax` of one row in f64, written independently of the crate's f32 version.
fn log_softmax_f64(row: &[f64]) -> Vec<f64> {
    let max = row.iter().copied().fold(f64::NEG_INFINITY, f64::max);
    let log_sum = row.iter().map(|z| (z - max).exp()).sum::<f64>().ln();
    row.iter().map(|z| z - max - log_sum).collect()
}

fn entropy_f64(log_probs: &[f64]) -> f64 {
    -log_probs.iter().map(|lp| lp.exp() * lp).sum::<f64>()
}

fn to_f64(xs: &[f32]) -> Vec<f64> {
    xs.iter().map(|&x| f64::from(x)).collect()
}

fn uniform_vec(rng: &mut SmallRng, n: usize, lo: f32, hi: f32) -> Vec<f32> {
    (0..n).map(|_| rng.random_range(lo..hi)).collect()
}

/// Central differences of `loss` at `x` in f64, step `h`.
fn finite_differences(x: &[f64], h: f64, loss: impl Fn(&[f64]) -> f64) -> Vec<f64> {
    let mut probe = x.to_vec();
    (0..x.len())
        .map(|i| {
            probe[i] = x[i] + h;
            let plus = loss(&probe);
            probe[i] = x[i] - h;
            let minus = loss(&probe);
            probe[i] = x[i];
            (plus - minus) / (2.0 * h)
        })
        .collect()
}

fn assert_gradients_close(name: &str, analytic: &[f32], numeric: &[f64]) {
    assert_eq!(analytic.len(), numeric.len());
    for (i, (&a, &n)) in analytic.iter().zip(numeric).enumerate() {
        let err = (f64::from(a) - n).abs();
        assert!(err <= 1e-5 + 1e-3 * n.abs(), "{name}[{i}]: analytic {a}, finite difference {n} (err {err})");
    }
}

/// Owned inputs of a random V-trace batch.
struct VTraceFixture {
    t_len: usize,
    b_len: usize,
    n_actions: usize,
    actions: Vec<u32>,
    behaviour_log_probs: Vec<f32>,
    rewards: Vec<f32>,
    discounts: Vec<f32>,
    sample_weights: Vec<f32>,
    logits: Vec<f32>,
    values: Vec<f32>,
}

impl VTraceFixture {
    fn random(seed: u64, t_len: usize, b_len: usize, n_actions: usize) -> Self {
        let mut rng = SmallRng::seed_from_u64(seed);
        let n = t_len * b_len;
        let n_rows = n + b_len;
        Self {
            t_len,
            b_len,
            n_actions,
            actions: (0..n).map(|_| rng.random_range(0..n_actions as u32)).collect(),
            behaviour_log_probs: uniform_vec(&mut rng, n, -2.5, -0.2),
            rewards: uniform_vec(&mut rng, n, -1.0, 1.0),
            discounts: (0..n).map(|_| if rng.random_bool(0.2) { 0.0 } else { 0.95 }).collect(),
            sample_weights: (0..n)
                .map(|_| if rng.random_bool(0.2) { 0.0 } else { rng.random_range(0.2..1.0) })
                .collect(),
            logits: uniform_vec(&mut rng, n_rows * n_actions, -2.0, 2.0),
            values: uniform_vec(&mut rng, n_rows, -1.0, 1.0),
        }
    }

    fn batch(&self) -> SequenceBatch<'_> {
        SequenceBatch {
            t_len: self.t_len,
            b_len: self.b_len,
            n_actions: self.n_actions,
            actions: &self.actions,
            behaviour_log_probs: &self.behaviour_log_probs,
            rewards: &self.rewards,
            discounts: &self.discounts,
            sample_weights: &self.sample_weights,
        }
    }

    /// Runs the loss; returns `(stats, dlogits, dvalues, workspace)`.
    fn run(&self, config: &VTraceLossConfig) -> (LossStats, Vec<f32>, Vec<f32>, VTraceWorkspace) {
        let mut workspace = VTraceWorkspace::new();
        let mut dlogits = vec![f32::NAN; self.logits.len()];
        let mut dvalues = vec![f32::NAN; self.values.len()];
        let stats = vtrace_loss_with_workspace(
            &self.batch(),
            &self.logits,
            &self.values,
            config,
            &mut workspace,
            &mut dlogits,
            &mut dvalues,
        );
        (stats, dlogits, dvalues, workspace)
    }

    /// The V-trace loss in f64 as a function of the first `T` rows of logits and values,
    /// with `vs` and the advantages frozen (they carry no gradient).
    fn loss_f64(
        &self,
        config: &VTraceLossConfig,
        logits: &[f64],
        values: &[f64],
        vs: &[f32],
        pg_advantages: &[f32],
    ) -> f64 {
        let a = self.n_actions;
        let weight_sum: f64 = self.sample_weights.iter().map(|&w| f64::from(w)).sum();
        let mut total = 0.0;
        for i in 0..self.t_len * self.b_len {
            let w = f64::from(self.sample_weights[i]);
            let lp = log_softmax_f64(&logits[i * a..(i + 1) * a]);
            let policy = -f64::from(pg_advantages[i]) * lp[self.actions[i] as usize];
            let value = 0.5 * (f64::from(vs[i]) - values[i]).powi(2);
            total +=
                w * (policy + f64::from(config.value_coef) * value - f64::from(config.ent_coef) * entropy_f64(&lp));
        }
        total / weight_sum
    }
}

fn vtrace_loss_config(lambda_: f32) -> VTraceLossConfig {
    VTraceLossConfig {
        vtrace: VTraceConfig { clip_rho_threshold: 1.0, clip_pg_rho_threshold: 1.5, clip_c_threshold: 1.0, lambda_ },
        value_coef: 0.5,
        ent_coef: 0.1,
    }
}

#[test]
fn vtrace_loss_gradients_match_finite_differences() {
    for seed in 0..6 {
        let fixture = VTraceFixture::random(seed, 4, 3, 5);
        let config = vtrace_loss_config(0.9);
        let (stats, dlogits, dvalues, workspace) = fixture.run(&config);
        let n = fixture.t_len * fixture.b_len;
        let logits = to_f64(&fixture.logits[..n * fixture.n_actions]);
        let values = to_f64(&fixture.values[..n]);
        let (vs, adv) = (workspace.vs(), workspace.pg_advantages());

        let loss = fixture.loss_f64(&config, &logits, &values, vs, adv);
        assert!((f64::from(stats.total) - loss).abs() < 1e-5, "{} vs {loss}", stats.total);

        let numeric_logits = finite_differences(&logits, 1e-6, |x| fixture.loss_f64(&config, x, &values, vs, adv));
        let numeric_values = finite_differences(&values, 1e-6, |x| fixture.loss_f64(&config, &logits, x, vs, adv));
        assert_gradients_close("dlogits", &dlogits[..logits.len()], &numeric_logits);
        assert_gradients_close("dvalues", &dvalues[..n], &numeric_values);
        // The bootstrap row is a constant.
        assert!(dlogits[logits.len()..].iter().all(|&g| g == 0.0));
        assert!(dvalues[n..].iter().all(|&g| g == 0.0));
    }
}

#[test]
fn vtrace_loss_masked_samples_have_zero_gradient() {
    let fixture = VTraceFixture::random(11, 5, 2, 3);
    let (stats, dlogits, dvalues, _) = fixture.run(&vtrace_loss_config(1.0));
    let a = fixture.n_actions;
    let mut n_masked = 0;
    for (i, &w) in fixture.sample_weights.iter().enumerate() {
        if w == 0.0 {
            n_masked += 1;
            assert!(dlogits[i * a..(i + 1) * a].iter().all(|&g| g == 0.0));
            assert_eq!(dvalues[i], 0.0);
        }
    }
    assert!(n_masked > 0, "the fixture should mask some samples");
    let weight_sum: f64 = fixture.sample_weights.iter().map(|&w| f64::from(w)).sum();
    assert!((f64::from(stats.weight_sum) - weight_sum).abs() < 1e-6);
}

#[test]
fn vtrace_loss_with_zero_total_weight_has_zero_gradient_and_stats() {
    let mut fixture = VTraceFixture::random(3, 3, 2, 3);
    fixture.sample_weights.fill(0.0);
    let (stats, dlogits, dvalues, _) = fixture.run(&vtrace_loss_config(1.0));
    assert_eq!(stats, LossStats { evaluations: 1, ..LossStats::default() });
    assert!(dlogits.iter().chain(&dvalues).all(|&g| g == 0.0));
}

#[test]
fn vtrace_loss_on_policy_reduces_to_actor_critic_with_lambda_returns() {
    let lambda_ = 0.8f32;
    let mut fixture = VTraceFixture::random(5, 6, 2, 4);
    let (t_len, b_len, a) = (fixture.t_len, fixture.b_len, fixture.n_actions);
    let n = t_len * b_len;
    // Behaviour = current policy, so every ρ is exactly 1.
    let mut log_probs = vec![0.0; n * a];
    for i in 0..n {
        log_softmax(&fixture.logits[i * a..(i + 1) * a], &mut log_probs[i * a..(i + 1) * a]);
        fixture.behaviour_log_probs[i] = log_probs[i * a + fixture.actions[i] as usize];
    }
    let config = VTraceLossConfig { ent_coef: 0.0, ..vtrace_loss_config(lambda_) };
    let (stats, dlogits, dvalues, _) = fixture.run(&config);
    assert!((stats.mean_ratio - 1.0).abs() < 1e-6);
    assert_eq!(stats.clip_fraction, 0.0);

    // λ-returns per column, G_t = r_t + γ_t ((1 − λ) V_{t+1} + λ G_{t+1}), G_T = V(x_T).
    let weight_sum: f64 = fixture.sample_weights.iter().map(|&w| f64::from(w)).sum();
    let (values, bootstrap) = fixture.values.split_at(n);
    for (b, &bootstrap_b) in bootstrap.iter().enumerate() {
        let mut g_next = f64::from(bootstrap_b);
        let mut v_next = f64::from(bootstrap_b);
        for t in (0..t_len).rev() {
            let i = t * b_len + b;
            let (r, gamma, v) = (f64::from(fixture.rewards[i]), f64::from(fixture.discounts[i]), f64::from(values[i]));
            let lambda = f64::from(lambda_);
            let g = r + gamma * ((1.0 - lambda) * v_next + lambda * g_next);
            let scale = f64::from(fixture.sample_weights[i]) / weight_sum;
            // Actor-critic: ∇ = −(w/W) (r + γ G_{t+1} − V) ∇log π(a) and −c (w/W)(G − V).
            let advantage = r + gamma * g_next - v;
            for j in 0..a {
                let p = f64::from(log_probs[i * a + j]).exp();
                let indicator = if j == fixture.actions[i] as usize { 1.0 } else { 0.0 };
                let want = -scale * advantage * (indicator - p);
                let got = f64::from(dlogits[i * a + j]);
                assert!((got - want).abs() < 1e-5, "t {t} b {b} j {j}: {got} vs {want}");
            }
            let want_dvalue = -f64::from(config.value_coef) * scale * (g - v);
            assert!((f64::from(dvalues[i]) - want_dvalue).abs() < 1e-5);
            g_next = g;
            v_next = v;
        }
    }
}

#[test]
fn vtrace_loss_reports_ratio_statistics() {
    // One sample, two actions with logits [0, 0] (π(a) = 0.5) and μ(a) = 0.25: ρ = 2.
    let batch = SequenceBatch {
        t_len: 1,
        b_len: 1,
        n_actions: 2,
        actions: &[0],
        behaviour_log_probs: &[0.25f32.ln()],
        rewards: &[1.0],
        discounts: &[0.0],
        sample_weights: &[2.0],
    };
    let mut workspace = VTraceWorkspace::new();
    let (mut dlogits, mut dvalues) = ([0.0; 4], [0.0; 2]);
    let config = VTraceLossConfig { vtrace: VTraceConfig::default(), value_coef: 0.5, ent_coef: 0.01 };
    let stats =
        vtrace_loss_with_workspace(&batch, &[0.0; 4], &[0.0, 0.0], &config, &mut workspace, &mut dlogits, &mut dvalues);
    // vs = V + min(1, ρ)(r − V) = 1; A = min(1, ρ)(r − V) = 1.
    // policy = −A log 0.5 = ln 2; value = ½(1 − 0)² = 0.5; entropy = ln 2.
    let ln2 = std::f32::consts::LN_2;
    assert!((stats.mean_ratio - 2.0).abs() < 1e-6);
    assert_eq!(stats.clip_fraction, 1.0);
    assert!((stats.approx_kl - (1.0 - ln2)).abs() < 1e-6);
    assert!((stats.policy - ln2).abs() < 1e-6);
    assert!((stats.value - 0.5).abs() < 1e-6);
    assert!((stats.entropy - ln2).abs() < 1e-6);
    assert!((stats.total - (ln2 + 0.25 - 0.01 * ln2)).abs() < 1e-6);
    assert_eq!(stats.weight_sum, 2.0);
}

/// Owned inputs of a random PPO minibatch whose ratios stay clear of the clip boundaries, so
/// that finite differences never straddle a kink.
struct PpoFixture {
    t_len: usize,
    b_len: usize,
    n_samples: usize,
    n_actions: usize,
    /// Zeros standing in for the batch fields PPO does not read.
    unused: Vec<f32>,
    actions: Vec<u32>,
    advantages: Vec<f32>,
    returns: Vec<f32>,
    prox_log_probs: Vec<f32>,
    is_weights: Vec<f32>,
    sample_weights: Vec<f32>,
    logits: Vec<f32>,
    values: Vec<f32>,
}

impl PpoFixture {
    fn random(seed: u64, t_len: usize, b_len: usize, n_actions: usize, clip_coef: f32) -> Self {
        let n_samples = t_len * b_len;
        let mut rng = SmallRng::seed_from_u64(seed);
        let logits = uniform_vec(&mut rng, n_samples * n_actions, -2.0, 2.0);
        let actions: Vec<u32> = (0..n_samples).map(|_| rng.random_range(0..n_actions as u32)).collect();
        // Ratios on both sides of both clip boundaries, at least 0.05 away from them.
        let ratio_choices = [
            0.5,
            1.0 - clip_coef - 0.1,
            1.0 - clip_coef + 0.05,
            1.0,
            1.0 + clip_coef - 0.05,
            1.0 + clip_coef + 0.1,
            2.0,
        ];
        let prox_log_probs = (0..n_samples)
            .map(|i| {
                let lp = log_softmax_f64(&to_f64(&logits[i * n_actions..(i + 1) * n_actions]));
                let ratio: f32 = ratio_choices[rng.random_range(0..ratio_choices.len())];
                (lp[actions[i] as usize] - f64::from(ratio).ln()) as f32
            })
            .collect();
        Self {
            t_len,
            b_len,
            n_samples,
            n_actions,
            unused: vec![0.0; n_samples],
            actions,
            advantages: uniform_vec(&mut rng, n_samples, -2.0, 2.0),
            returns: uniform_vec(&mut rng, n_samples, -1.0, 1.0),
            prox_log_probs,
            is_weights: uniform_vec(&mut rng, n_samples, 0.3, 1.0),
            sample_weights: (0..n_samples)
                .map(|_| if rng.random_bool(0.2) { 0.0 } else { rng.random_range(0.2..1.0) })
                .collect(),
            logits,
            values: uniform_vec(&mut rng, n_samples, -1.0, 1.0),
        }
    }

    fn batch(&self) -> SequenceBatch<'_> {
        SequenceBatch {
            t_len: self.t_len,
            b_len: self.b_len,
            n_actions: self.n_actions,
            actions: &self.actions,
            behaviour_log_probs: &self.unused,
            rewards: &self.unused,
            discounts: &self.unused,
            sample_weights: &self.sample_weights,
        }
    }

    fn targets(&self) -> PpoTargets<'_> {
        PpoTargets {
            advantages: &self.advantages,
            returns: &self.returns,
            prox_log_probs: &self.prox_log_probs,
            is_weights: &self.is_weights,
        }
    }

    fn run(&self, config: &PpoLossConfig) -> (LossStats, Vec<f32>, Vec<f32>) {
        let mut dlogits = vec![f32::NAN; self.logits.len()];
        let mut dvalues = vec![f32::NAN; self.values.len()];
        let stats =
            ppo_loss(&self.batch(), &self.targets(), &self.logits, &self.values, config, &mut dlogits, &mut dvalues);
        (stats, dlogits, dvalues)
    }

    /// The PPO loss in f64, written out directly from its definition.
    fn loss_f64(&self, config: &PpoLossConfig, logits: &[f64], values: &[f64]) -> f64 {
        let a = self.n_actions;
        let weights = to_f64(&self.sample_weights);
        let weight_sum: f64 = weights.iter().sum();
        let mut advantages = to_f64(&self.advantages);
        if config.normalize_advantages {
            let mean = weights.iter().zip(&advantages).map(|(w, x)| w * x).sum::<f64>() / weight_sum;
            let var = weights.iter().zip(&advantages).map(|(w, x)| w * (x - mean).powi(2)).sum::<f64>() / weight_sum;
            for x in &mut advantages {
                *x = (*x - mean) / (var.sqrt() + 1e-8);
            }
        }
        let eps = f64::from(config.clip_coef);
        let mut total = 0.0;
        for i in 0..self.n_samples {
            let lp = log_softmax_f64(&logits[i * a..(i + 1) * a]);
            let ratio = (lp[self.actions[i] as usize] - f64::from(self.prox_log_probs[i])).exp();
            let adv = advantages[i];
            let surrogate = (ratio * adv).min(ratio.clamp(1.0 - eps, 1.0 + eps) * adv);
            let policy = -f64::from(self.is_weights[i]) * surrogate;
            let value = 0.5 * (f64::from(self.returns[i]) - values[i]).powi(2);
            total += weights[i]
                * (policy + f64::from(config.value_coef) * value - f64::from(config.ent_coef) * entropy_f64(&lp));
        }
        total / weight_sum
    }
}

#[test]
fn ppo_loss_gradients_match_finite_differences() {
    for (seed, normalize_advantages) in (0..6).zip([false, true].into_iter().cycle()) {
        let config = PpoLossConfig { clip_coef: 0.2, value_coef: 0.5, ent_coef: 0.1, normalize_advantages };
        let fixture = PpoFixture::random(seed, 6, 4, 4, config.clip_coef);
        let (stats, dlogits, dvalues) = fixture.run(&config);
        let logits = to_f64(&fixture.logits);
        let values = to_f64(&fixture.values);

        let loss = fixture.loss_f64(&config, &logits, &values);
        assert!((f64::from(stats.total) - loss).abs() < 1e-5, "{} vs {loss}", stats.total);
        assert!(stats.clip_fraction > 0.0 && stats.clip_fraction < 1.0);

        let numeric_logits = finite_differences(&logits, 1e-6, |x| fixture.loss_f64(&config, x, &values));
        let numeric_values = finite_differences(&values, 1e-6, |x| fixture.loss_f64(&config, &logits, x));
        assert_gradients_close("dlogits", &dlogits, &numeric_logits);
        assert_gradients_close("dvalues", &dvalues, &numeric_values);
    }
}

#[test]
fn ppo_loss_masked_samples_have_zero_gradient_and_are_not_read() {
    let config = PpoLossConfig::default();
    let mut fixture = PpoFixture::random(9, 4, 4, 3, config.clip_coef);
    let (stats, dlogits, dvalues) = fixture.run(&config);
    let a = fixture.n_actions;
    let masked: Vec<usize> = (0..fixture.n_samples).filter(|&i| fixture.sample_weights[i] == 0.0).collect();
    assert!(!masked.is_empty(), "the fixture should mask some samples");
    for &i in &masked {
        assert!(dlogits[i * a..(i + 1) * a].iter().all(|&g| g == 0.0));
        assert_eq!(dvalues[i], 0.0);
        // Garbage in a dropped sample changes nothing, even with advantage normalisation.
        fixture.logits[i * a..(i + 1) * a].fill(f32::NAN);
        fixture.advantages[i] = 1e9;
        fixture.values[i] = f32::NAN;
    }
    let (stats_garbage, dlogits_garbage, dvalues_garbage) = fixture.run(&config);
    assert_eq!(stats, stats_garbage);
    assert_eq!(dlogits, dlogits_garbage);
    assert_eq!(dvalues, dvalues_garbage);
}

#[test]
fn ppo_loss_at_unit_ratio_and_weight_is_the_policy_gradient() {
    let mut fixture = PpoFixture::random(4, 5, 2, 3, 0.2);
    let a = fixture.n_actions;
    let mut log_probs = vec![0.0; fixture.logits.len()];
    for i in 0..fixture.n_samples {
        log_softmax(&fixture.logits[i * a..(i + 1) * a], &mut log_probs[i * a..(i + 1) * a]);
        fixture.prox_log_probs[i] = log_probs[i * a + fixture.actions[i] as usize];
    }
    fixture.is_weights.fill(1.0);
    let config = PpoLossConfig { clip_coef: 0.2, value_coef: 0.0, ent_coef: 0.0, normalize_advantages: false };
    let (stats, dlogits, dvalues) = fixture.run(&config);
    assert!((stats.mean_ratio - 1.0).abs() < 1e-6);
    assert_eq!(stats.clip_fraction, 0.0);
    assert!(stats.approx_kl.abs() < 1e-6);
    assert!(dvalues.iter().all(|&g| g == 0.0));
    let weight_sum: f64 = fixture.sample_weights.iter().map(|&w| f64::from(w)).sum();
    for i in 0..fixture.n_samples {
        let scale = f64::from(fixture.sample_weights[i]) / weight_sum;
        for j in 0..a {
            // −w A ∇log π(a) / W with ∇_j log π(a) = 1[j = a] − p_j.
            let p = f64::from(log_probs[i * a + j]).exp();
            let indicator = if j == fixture.actions[i] as usize { 1.0 } else { 0.0 };
            let want = -scale * f64::from(fixture.advantages[i]) * (indicator - p);
            let got = f64::from(dlogits[i * a + j]);
            assert!((got - want).abs() < 1e-6, "sample {i} action {j}: {got} vs {want}");
        }
    }
}

#[test]
fn ppo_loss_clipped_samples_carry_no_policy_gradient() {
    // One sample, A = 2, logits [0, 0]: π(a) = 0.5. π_prox(a) = 0.25 → r = 2 > 1 + ε.
    // With Â > 0 the clipped term (1.2 Â) is the minimum and is constant in θ.
    let batch = SequenceBatch {
        t_len: 1,
        b_len: 1,
        n_actions: 2,
        actions: &[1],
        behaviour_log_probs: &[0.0],
        rewards: &[0.0],
        discounts: &[0.0],
        sample_weights: &[1.0],
    };
    let targets =
        PpoTargets { advantages: &[1.0], returns: &[0.0], prox_log_probs: &[0.25f32.ln()], is_weights: &[1.0] };
    let config = PpoLossConfig { clip_coef: 0.2, value_coef: 0.0, ent_coef: 0.0, normalize_advantages: false };
    let (mut dlogits, mut dvalues) = ([f32::NAN; 2], [f32::NAN; 1]);
    let stats = ppo_loss(&batch, &targets, &[0.0, 0.0], &[0.0], &config, &mut dlogits, &mut dvalues);
    assert_eq!(dlogits, [0.0, 0.0]);
    assert!((stats.policy + 1.2).abs() < 1e-6);
    assert_eq!(stats.clip_fraction, 1.0);
    assert!((stats.mean_ratio - 2.0).abs() < 1e-6);
}

#[test]
fn vtrace_loss_without_workspace_matches_the_workspace_version() {
    let fixture = VTraceFixture::random(21, 4, 3, 3);
    let config = vtrace_loss_config(0.95);
    let (stats, dlogits, dvalues, _) = fixture.run(&config);
    let mut dlogits_plain = vec![f32::NAN; dlogits.len()];
    let mut dvalues_plain = vec![f32::NAN; dvalues.len()];
    let stats_plain = vtrace_loss(
        &fixture.batch(),
        &fixture.logits,
        &fixture.values,
        &config,
        &mut dlogits_plain,
        &mut dvalues_plain,
    );
    assert_eq!(stats, stats_plain);
    assert_eq!(dlogits, dlogits_plain);
    assert_eq!(dvalues, dvalues_plain);
}

#[test]
fn loss_stats_mean_averages_accumulated_evaluations() {
    let one = LossStats {
        total: 1.0,
        policy: 2.0,
        value: 3.0,
        entropy: 4.0,
        mean_ratio: 1.0,
        clip_fraction: 0.5,
        approx_kl: 0.25,
        weight_sum: 8.0,
        evaluations: 1,
    };
    let two = LossStats {
        total: 3.0,
        policy: 0.0,
        value: 1.0,
        entropy: 2.0,
        mean_ratio: 3.0,
        clip_fraction: 0.0,
        approx_kl: 0.75,
        weight_sum: 4.0,
        evaluations: 1,
    };
    let mut sum = LossStats::default();
    assert_eq!(sum.mean(), LossStats::default());
    sum.accumulate(&one);
    sum.accumulate(&two);
    let mean = sum.mean();
    let want = LossStats {
        total: 2.0,
        policy: 1.0,
        value: 2.0,
        entropy: 3.0,
        mean_ratio: 2.0,
        clip_fraction: 0.25,
        approx_kl: 0.5,
        weight_sum: 6.0,
        evaluations: 2,
    };
    assert_eq!(mean, want);
}

#[test]
fn behaviour_is_weights_are_truncated_ratios() {
    let mut out = [0.0; 3];
    behaviour_is_weights(
        &[0.5f32.ln(), 0.5f32.ln(), 0.1f32.ln()],
        &[0.25f32.ln(), 0.5f32.ln(), 0.2f32.ln()],
        1.5,
        &mut out,
    );
    // Ratios 2, 1, 0.5 truncated at 1.5.
    for (got, want) in out.iter().zip([1.5, 1.0, 0.5]) {
        assert!((got - want).abs() < 1e-6, "{out:?}");
    }
}

#[test]
#[should_panic(expected = "action 3 out of range for 3 actions")]
fn out_of_range_action_panics_naming_it() {
    let mut fixture = PpoFixture::random(1, 2, 1, 3, 0.2);
    fixture.sample_weights.fill(1.0);
    fixture.actions[1] = 3;
    fixture.run(&PpoLossConfig::default());
}

/// Group baselines (issue 18): a finite override replaces V-trace's policy-gradient
/// advantage, still times the clipped importance weight; NaN steps, the value targets and
/// the value gradient stay V-trace's.
#[test]
fn group_advantages_replace_vtrace_pg_advantages_only_where_given() {
    let f = VTraceFixture::random(11, 6, 3, 4);
    let (n, a) = (f.t_len * f.b_len, f.n_actions);
    let (rows, stride) = (n + f.b_len, a + 1);
    let mut heads = vec![0.0; rows * stride];
    for r in 0..rows {
        heads[r * stride..r * stride + a].copy_from_slice(&f.logits[r * a..(r + 1) * a]);
        heads[r * stride + a] = f.values[r];
    }
    let config = VTraceLossConfig {
        vtrace: VTraceConfig {
            clip_rho_threshold: 1.0,
            clip_pg_rho_threshold: 0.8,
            clip_c_threshold: 1.0,
            lambda_: 0.9,
        },
        value_coef: 0.5,
        ent_coef: 0.01,
    };
    let run = |advantage_override: Option<&[f32]>| {
        let (mut log_rhos, mut vs, mut pg, mut d_heads) =
            (vec![0.0; n], vec![0.0; n], vec![0.0; n], vec![0.0; rows * stride]);
        let actions = action_words(&f.actions);
        let rows = VTraceRows {
            log_rhos: &mut log_rhos,
            vs: &mut vs,
            pg_advantages: &mut pg,
            d_heads: &mut d_heads,
            d_head_params: &mut [],
        };
        let head = Categorical { n_actions: f.n_actions };
        vtrace_loss_heads(&head, &f.batch().rows(&actions), &heads, &f.values, &config, advantage_override, rows);
        (log_rhos, vs, pg, d_heads)
    };
    let base = run(None);
    let given: Vec<f32> = (0..n).map(|i| if i % 2 == 0 { i as f32 * 0.1 - 0.5 } else { f32::NAN }).collect();
    let with = run(Some(&given));
    assert_eq!(with.1, base.1, "value targets are V-trace's");
    for (i, &a_i) in given.iter().enumerate() {
        let expected = if a_i.is_finite() { base.0[i].exp().min(0.8) * a_i } else { base.2[i] };
        assert_eq!(with.2[i], expected, "step {i}");
        assert_eq!(with.3[i * stride + a], base.3[i * stride + a], "value gradient of step {i}");
    }
    assert_ne!(with.3, base.3, "the policy gradient moved");
}

#[test]
fn group_advantages_replace_gae_advantages_but_not_returns() {
    use crate::backend::{Backend, CpuBackend, GaeScan, View, ViewMut};
    let (t_len, b_len) = (5, 2);
    let n = t_len * b_len;
    let discounts = vec![0.9; n];
    let rewards: Vec<f32> = (0..n).map(|i| i as f32 * 0.1).collect();
    let values: Vec<f32> = (0..n + b_len).map(|i| 0.5 - i as f32 * 0.05).collect();
    let given: Vec<f32> = (0..n).map(|i| if i < b_len { 2.0 } else { f32::NAN }).collect();
    let mut backend = CpuBackend::new();
    let run = |backend: &mut CpuBackend, advantage_override: Option<&Vec<f32>>| {
        let (mut adv, mut ret) = (vec![0.0; n], vec![0.0; n]);
        backend
            .gae_scan(GaeScan {
                t_len,
                b_len,
                discounts: View::of(&discounts),
                rewards: View::of(&rewards),
                values: View::range(&values, 0..n),
                bootstrap_value: View::range(&values, n..n + b_len),
                lambda_: 0.95,
                advantage_override: advantage_override.map(View::of),
                advantages: ViewMut::of(&mut adv),
                returns: ViewMut::of(&mut ret),
            })
            .unwrap();
        (adv, ret)
    };
    let base = run(&mut backend, None);
    let with = run(&mut backend, Some(&given));
    assert_eq!(with.1, base.1, "returns are GAE's");
    assert_eq!(&with.0[..b_len], &[2.0, 2.0]);
    assert_eq!(&with.0[b_len..], &base.0[b_len..]);
}
