//! Tests of the two loss bodies on the categorical head: gradients against finite differences,
//! masking and zero weight, the on-policy and unit-ratio reductions, ratio statistics, and
//! group advantages (the Gaussian head's are in `losses_gaussian_tests.rs`).

use super::*;
use rand::{rngs::SmallRng, Rng, SeedableRng};
use volley_policy::distributions::log_softmax;
use volley_policy::head::Categorical;

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

/// Random categorical rows in the layout of the network's fused heads: `n_rows` rows of `A`
/// logits (in `[−2, 2]`) then a value (in `[−1, 1]`), and an action word and a sample weight (a
/// fifth of them 0) for each of the first `n` rows.
struct Rows {
    n_actions: usize,
    heads: Vec<f32>,
    actions: Vec<f32>,
    sample_weights: Vec<f32>,
}

impl Rows {
    /// The rows, and the generator seeded with `seed` that drew them, for the rest of a fixture.
    fn random(seed: u64, n: usize, n_rows: usize, n_actions: usize) -> (Self, SmallRng) {
        let mut rng = SmallRng::seed_from_u64(seed);
        let mut heads = Vec::with_capacity(n_rows * (n_actions + 1));
        for _ in 0..n_rows {
            heads.extend(uniform_vec(&mut rng, n_actions, -2.0, 2.0));
            heads.push(rng.random_range(-1.0..1.0));
        }
        let rows = Self {
            n_actions,
            heads,
            actions: (0..n).map(|_| f32::from_bits(rng.random_range(0..n_actions as u32))).collect(),
            sample_weights: (0..n)
                .map(|_| if rng.random_bool(0.2) { 0.0 } else { rng.random_range(0.2..1.0) })
                .collect(),
        };
        (rows, rng)
    }

    fn stride(&self) -> usize {
        self.n_actions + 1
    }

    fn action(&self, i: usize) -> usize {
        self.actions[i].to_bits() as usize
    }

    fn values(&self) -> Vec<f32> {
        self.heads.chunks_exact(self.stride()).map(|row| row[self.n_actions]).collect()
    }

    /// These rows' actions and weights as a `T × B` batch without the V-trace-only fields.
    fn batch(&self, t_len: usize, b_len: usize) -> RowBatch<'_> {
        let (actions, sample_weights) = (&self.actions, &self.sample_weights);
        RowBatch { t_len, b_len, actions, behaviour_log_probs: &[], rewards: &[], discounts: &[], sample_weights }
    }

    fn weight_sum(&self) -> f64 {
        self.sample_weights.iter().map(|&w| f64::from(w)).sum()
    }

    /// The log-softmax of the first `n` rows, `[n][A]`.
    fn log_probs(&self) -> Vec<f32> {
        let (a, n) = (self.n_actions, self.sample_weights.len());
        let mut log_probs = vec![0.0; n * a];
        for (row, out) in self.heads.chunks_exact(a + 1).zip(log_probs.chunks_exact_mut(a)) {
            log_softmax(&row[..a], out);
        }
        log_probs
    }

    /// `(1/W) Σ_i w_i term(i, log π(·|x_i), V_i)` over `heads` in f64: the frame of both losses,
    /// written out directly from the definition.
    fn weighted_mean_f64(&self, heads: &[f64], term: impl Fn(usize, &[f64], f64) -> f64) -> f64 {
        let a = self.n_actions;
        let total: f64 = self
            .sample_weights
            .iter()
            .zip(heads.chunks_exact(a + 1))
            .enumerate()
            .filter(|(_, (&w, _))| w != 0.0)
            .map(|(i, (&w, row))| f64::from(w) * term(i, &log_softmax_f64(&row[..a]), row[a]))
            .sum();
        total / self.weight_sum()
    }

    /// The gradient the row `i`'s logit `j` gets from `−scale · advantage · log π(a_i)`:
    /// `−scale · advantage · (1[j = a_i] − p_j)`.
    fn policy_gradient(&self, log_probs: &[f32], i: usize, j: usize, scale: f64, advantage: f64) -> f64 {
        let p = f64::from(log_probs[i * self.n_actions + j]).exp();
        let indicator = if j == self.action(i) { 1.0 } else { 0.0 };
        -scale * advantage * (indicator - p)
    }
}

/// What [`vtrace_loss_heads`] returned and wrote.
struct VTraceRun {
    stats: LossStats,
    log_rhos: Vec<f32>,
    vs: Vec<f32>,
    pg_advantages: Vec<f32>,
    d_heads: Vec<f32>,
}

/// A V-trace batch of `T·B` samples over `(T+1)·B` rows.
struct VTraceFixture {
    t_len: usize,
    b_len: usize,
    rows: Rows,
    behaviour_log_probs: Vec<f32>,
    rewards: Vec<f32>,
    discounts: Vec<f32>,
}

impl VTraceFixture {
    /// `T·B` samples and the bootstrap row, a fifth of the discounts zero.
    fn random(seed: u64, t_len: usize, b_len: usize, n_actions: usize) -> Self {
        let n = t_len * b_len;
        let (rows, mut rng) = Rows::random(seed, n, n + b_len, n_actions);
        Self {
            t_len,
            b_len,
            rows,
            behaviour_log_probs: uniform_vec(&mut rng, n, -2.5, -0.2),
            rewards: uniform_vec(&mut rng, n, -1.0, 1.0),
            discounts: (0..n).map(|_| if rng.random_bool(0.2) { 0.0 } else { 0.95 }).collect(),
        }
    }

    fn run(&self, config: &VTraceLossConfig, advantage_override: Option<&[f32]>) -> VTraceRun {
        let n = self.t_len * self.b_len;
        let batch = RowBatch {
            behaviour_log_probs: &self.behaviour_log_probs,
            rewards: &self.rewards,
            discounts: &self.discounts,
            ..self.rows.batch(self.t_len, self.b_len)
        };
        let (mut log_rhos, mut vs, mut pg_advantages) = (vec![f32::NAN; n], vec![f32::NAN; n], vec![f32::NAN; n]);
        let mut d_heads = vec![f32::NAN; self.rows.heads.len()];
        let out = VTraceRows {
            log_rhos: &mut log_rhos,
            vs: &mut vs,
            pg_advantages: &mut pg_advantages,
            d_heads: &mut d_heads,
            d_head_params: &mut [],
        };
        let head = Categorical { n_actions: self.rows.n_actions };
        let values = self.rows.values();
        let (sums, weight_sum) =
            vtrace_loss_heads(&head, &batch, &self.rows.heads, &values, config, advantage_override, out);
        let stats = sums.stats(weight_sum, config.value_coef, config.ent_coef);
        VTraceRun { stats, log_rhos, vs, pg_advantages, d_heads }
    }

    /// The V-trace loss in f64 as a function of the first `T` rows of `heads`, with `vs` and the
    /// advantages frozen (they carry no gradient).
    fn loss_f64(&self, config: &VTraceLossConfig, heads: &[f64], vs: &[f32], pg_advantages: &[f32]) -> f64 {
        self.rows.weighted_mean_f64(heads, |i, lp, value| {
            let policy = -f64::from(pg_advantages[i]) * lp[self.rows.action(i)];
            let value = 0.5 * (f64::from(vs[i]) - value).powi(2);
            policy + f64::from(config.value_coef) * value - f64::from(config.ent_coef) * entropy_f64(lp)
        })
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
        let run = fixture.run(&config, None);
        let n_heads = fixture.t_len * fixture.b_len * fixture.rows.stride();
        let heads = to_f64(&fixture.rows.heads[..n_heads]);
        let (vs, adv) = (&run.vs, &run.pg_advantages);

        let loss = fixture.loss_f64(&config, &heads, vs, adv);
        assert!((f64::from(run.stats.total) - loss).abs() < 1e-5, "{} vs {loss}", run.stats.total);

        let numeric = finite_differences(&heads, 1e-6, |x| fixture.loss_f64(&config, x, vs, adv));
        assert_gradients_close("d_heads", &run.d_heads[..n_heads], &numeric);
        // The bootstrap row is a constant.
        assert!(run.d_heads[n_heads..].iter().all(|&g| g == 0.0));
    }
}

#[test]
fn vtrace_loss_masked_samples_have_zero_gradient() {
    let fixture = VTraceFixture::random(11, 5, 2, 3);
    let run = fixture.run(&vtrace_loss_config(1.0), None);
    let stride = fixture.rows.stride();
    let mut n_masked = 0;
    for (i, &w) in fixture.rows.sample_weights.iter().enumerate() {
        if w == 0.0 {
            n_masked += 1;
            assert!(run.d_heads[i * stride..(i + 1) * stride].iter().all(|&g| g == 0.0));
        }
    }
    assert!(n_masked > 0, "the fixture should mask some samples");
    assert!((f64::from(run.stats.weight_sum) - fixture.rows.weight_sum()).abs() < 1e-6);
}

#[test]
fn vtrace_loss_with_zero_total_weight_has_zero_gradient_and_stats() {
    let mut fixture = VTraceFixture::random(3, 3, 2, 3);
    fixture.rows.sample_weights.fill(0.0);
    let run = fixture.run(&vtrace_loss_config(1.0), None);
    assert_eq!(run.stats, LossStats { evaluations: 1, ..LossStats::default() });
    assert!(run.d_heads.iter().all(|&g| g == 0.0));
}

#[test]
fn vtrace_loss_on_policy_reduces_to_actor_critic_with_lambda_returns() {
    let lambda_ = 0.8f32;
    let mut fixture = VTraceFixture::random(5, 6, 2, 4);
    let (t_len, b_len, a) = (fixture.t_len, fixture.b_len, fixture.rows.n_actions);
    let n = t_len * b_len;
    // Behaviour = current policy, so every ρ is exactly 1.
    let log_probs = fixture.rows.log_probs();
    for i in 0..n {
        fixture.behaviour_log_probs[i] = log_probs[i * a + fixture.rows.action(i)];
    }
    let config = VTraceLossConfig { ent_coef: 0.0, ..vtrace_loss_config(lambda_) };
    let run = fixture.run(&config, None);
    assert!((run.stats.mean_ratio - 1.0).abs() < 1e-6);
    assert_eq!(run.stats.clip_fraction, 0.0);

    // λ-returns per column, G_t = r_t + γ_t ((1 − λ) V_{t+1} + λ G_{t+1}), G_T = V(x_T).
    let weight_sum = fixture.rows.weight_sum();
    let all_values = fixture.rows.values();
    let (values, bootstrap) = all_values.split_at(n);
    let d_heads = |i: usize, j: usize| f64::from(run.d_heads[i * (a + 1) + j]);
    for (b, &bootstrap_b) in bootstrap.iter().enumerate() {
        let mut g_next = f64::from(bootstrap_b);
        let mut v_next = f64::from(bootstrap_b);
        for t in (0..t_len).rev() {
            let i = t * b_len + b;
            let (r, gamma, v) = (f64::from(fixture.rewards[i]), f64::from(fixture.discounts[i]), f64::from(values[i]));
            let lambda = f64::from(lambda_);
            let g = r + gamma * ((1.0 - lambda) * v_next + lambda * g_next);
            let scale = f64::from(fixture.rows.sample_weights[i]) / weight_sum;
            // Actor-critic: ∇ = −(w/W) (r + γ G_{t+1} − V) ∇log π(a) and −c (w/W)(G − V).
            let advantage = r + gamma * g_next - v;
            for j in 0..a {
                let want = fixture.rows.policy_gradient(&log_probs, i, j, scale, advantage);
                assert!((d_heads(i, j) - want).abs() < 1e-5, "t {t} b {b} j {j}: {} vs {want}", d_heads(i, j));
            }
            let want_dvalue = -f64::from(config.value_coef) * scale * (g - v);
            assert!((d_heads(i, a) - want_dvalue).abs() < 1e-5);
            g_next = g;
            v_next = v;
        }
    }
}

#[test]
fn vtrace_loss_reports_ratio_statistics() {
    // One sample, two actions with logits [0, 0] (π(a) = 0.5) and μ(a) = 0.25: ρ = 2.
    let fixture = VTraceFixture {
        t_len: 1,
        b_len: 1,
        rows: Rows { n_actions: 2, heads: vec![0.0; 6], actions: vec![f32::from_bits(0)], sample_weights: vec![2.0] },
        behaviour_log_probs: vec![0.25f32.ln()],
        rewards: vec![1.0],
        discounts: vec![0.0],
    };
    let config = VTraceLossConfig { vtrace: VTraceConfig::default(), value_coef: 0.5, ent_coef: 0.01 };
    let stats = fixture.run(&config, None).stats;
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

/// A random PPO minibatch of `n` samples whose ratios stay clear of the clip boundaries, so
/// that finite differences never straddle a kink.
struct PpoFixture {
    rows: Rows,
    advantages: Vec<f32>,
    returns: Vec<f32>,
    prox_log_probs: Vec<f32>,
    is_weights: Vec<f32>,
}

impl PpoFixture {
    /// `n` samples whose ratios to the proximal policy stay at least 0.05 from `1 ± clip_coef`.
    fn random(seed: u64, n: usize, n_actions: usize, clip_coef: f32) -> Self {
        let (rows, mut rng) = Rows::random(seed, n, n, n_actions);
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
        let log_probs = rows.log_probs();
        let prox_log_probs = (0..n)
            .map(|i| {
                let ratio: f32 = ratio_choices[rng.random_range(0..ratio_choices.len())];
                log_probs[i * n_actions + rows.action(i)] - ratio.ln()
            })
            .collect();
        Self {
            advantages: uniform_vec(&mut rng, n, -2.0, 2.0),
            returns: uniform_vec(&mut rng, n, -1.0, 1.0),
            prox_log_probs,
            is_weights: uniform_vec(&mut rng, n, 0.3, 1.0),
            rows,
        }
    }

    /// Runs the loss; returns its statistics and `∂L/∂heads`.
    fn run(&self, config: &PpoLossConfig) -> (LossStats, Vec<f32>) {
        let batch = self.rows.batch(1, self.rows.sample_weights.len());
        let targets = PpoTargets {
            advantages: &self.advantages,
            returns: &self.returns,
            prox_log_probs: &self.prox_log_probs,
            is_weights: &self.is_weights,
        };
        let head = Categorical { n_actions: self.rows.n_actions };
        let mut d_heads = vec![f32::NAN; self.rows.heads.len()];
        let (sums, weight_sum) = ppo_loss_heads(
            &head,
            &batch,
            &targets,
            &self.rows.heads,
            &self.rows.values(),
            config,
            &mut d_heads,
            &mut [],
        );
        (sums.stats(weight_sum, config.value_coef, config.ent_coef), d_heads)
    }

    /// The PPO loss in f64, written out directly from its definition.
    fn loss_f64(&self, config: &PpoLossConfig, heads: &[f64]) -> f64 {
        let weights = to_f64(&self.rows.sample_weights);
        let weight_sum = self.rows.weight_sum();
        let mut advantages = to_f64(&self.advantages);
        if config.normalize_advantages {
            let mean = weights.iter().zip(&advantages).map(|(w, x)| w * x).sum::<f64>() / weight_sum;
            let var = weights.iter().zip(&advantages).map(|(w, x)| w * (x - mean).powi(2)).sum::<f64>() / weight_sum;
            for x in &mut advantages {
                *x = (*x - mean) / (var.sqrt() + 1e-8);
            }
        }
        let eps = f64::from(config.clip_coef);
        self.rows.weighted_mean_f64(heads, |i, lp, value| {
            let ratio = (lp[self.rows.action(i)] - f64::from(self.prox_log_probs[i])).exp();
            let adv = advantages[i];
            let surrogate = (ratio * adv).min(ratio.clamp(1.0 - eps, 1.0 + eps) * adv);
            let policy = -f64::from(self.is_weights[i]) * surrogate;
            let value = 0.5 * (f64::from(self.returns[i]) - value).powi(2);
            policy + f64::from(config.value_coef) * value - f64::from(config.ent_coef) * entropy_f64(lp)
        })
    }
}

#[test]
fn ppo_loss_gradients_match_finite_differences() {
    for (seed, normalize_advantages) in (0..6).zip([false, true].into_iter().cycle()) {
        let config = PpoLossConfig { clip_coef: 0.2, value_coef: 0.5, ent_coef: 0.1, normalize_advantages };
        let fixture = PpoFixture::random(seed, 24, 4, config.clip_coef);
        let (stats, d_heads) = fixture.run(&config);
        let heads = to_f64(&fixture.rows.heads);

        let loss = fixture.loss_f64(&config, &heads);
        assert!((f64::from(stats.total) - loss).abs() < 1e-5, "{} vs {loss}", stats.total);
        assert!(stats.clip_fraction > 0.0 && stats.clip_fraction < 1.0);

        let numeric = finite_differences(&heads, 1e-6, |x| fixture.loss_f64(&config, x));
        assert_gradients_close("d_heads", &d_heads, &numeric);
    }
}

#[test]
fn ppo_loss_masked_samples_have_zero_gradient_and_are_not_read() {
    let config = PpoLossConfig::default();
    let mut fixture = PpoFixture::random(9, 16, 3, config.clip_coef);
    let (stats, d_heads) = fixture.run(&config);
    let stride = fixture.rows.stride();
    let masked: Vec<usize> = (0..16).filter(|&i| fixture.rows.sample_weights[i] == 0.0).collect();
    assert!(!masked.is_empty(), "the fixture should mask some samples");
    for &i in &masked {
        assert!(d_heads[i * stride..(i + 1) * stride].iter().all(|&g| g == 0.0));
        // Garbage in a dropped sample changes nothing, even with advantage normalisation.
        fixture.rows.heads[i * stride..(i + 1) * stride].fill(f32::NAN);
        fixture.advantages[i] = 1e9;
    }
    assert_eq!((stats, d_heads), fixture.run(&config));
}

#[test]
fn ppo_loss_at_unit_ratio_and_weight_is_the_policy_gradient() {
    let mut fixture = PpoFixture::random(4, 10, 3, 0.2);
    let a = fixture.rows.n_actions;
    let log_probs = fixture.rows.log_probs();
    for i in 0..10 {
        fixture.prox_log_probs[i] = log_probs[i * a + fixture.rows.action(i)];
    }
    fixture.is_weights.fill(1.0);
    let config = PpoLossConfig { clip_coef: 0.2, value_coef: 0.0, ent_coef: 0.0, normalize_advantages: false };
    let (stats, d_heads) = fixture.run(&config);
    assert!((stats.mean_ratio - 1.0).abs() < 1e-6);
    assert_eq!(stats.clip_fraction, 0.0);
    assert!(stats.approx_kl.abs() < 1e-6);
    let weight_sum = fixture.rows.weight_sum();
    for (i, row) in d_heads.chunks_exact(a + 1).enumerate() {
        assert_eq!(row[a], 0.0, "no value gradient");
        let scale = f64::from(fixture.rows.sample_weights[i]) / weight_sum;
        for (j, &got) in row[..a].iter().enumerate() {
            // −w A ∇log π(a) / W with ∇_j log π(a) = 1[j = a] − p_j.
            let want = fixture.rows.policy_gradient(&log_probs, i, j, scale, f64::from(fixture.advantages[i]));
            assert!((f64::from(got) - want).abs() < 1e-6, "sample {i} action {j}: {got} vs {want}");
        }
    }
}

#[test]
fn ppo_loss_clipped_samples_carry_no_policy_gradient() {
    // One sample, A = 2, logits [0, 0]: π(a) = 0.5. π_prox(a) = 0.25 → r = 2 > 1 + ε.
    // With Â > 0 the clipped term (1.2 Â) is the minimum and is constant in θ.
    let fixture = PpoFixture {
        rows: Rows { n_actions: 2, heads: vec![0.0; 3], actions: vec![f32::from_bits(1)], sample_weights: vec![1.0] },
        advantages: vec![1.0],
        returns: vec![0.0],
        prox_log_probs: vec![0.25f32.ln()],
        is_weights: vec![1.0],
    };
    let config = PpoLossConfig { clip_coef: 0.2, value_coef: 0.0, ent_coef: 0.0, normalize_advantages: false };
    let (stats, d_heads) = fixture.run(&config);
    assert_eq!(d_heads[..2], [0.0, 0.0]);
    assert!((stats.policy + 1.2).abs() < 1e-6);
    assert_eq!(stats.clip_fraction, 1.0);
    assert!((stats.mean_ratio - 2.0).abs() < 1e-6);
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
    let mut fixture = PpoFixture::random(1, 2, 3, 0.2);
    fixture.rows.sample_weights.fill(1.0);
    fixture.rows.actions[1] = f32::from_bits(3);
    fixture.run(&PpoLossConfig::default());
}

/// Group baselines (issue 18): a finite override replaces V-trace's policy-gradient
/// advantage, still times the clipped importance weight; NaN steps, the value targets and
/// the value gradient stay V-trace's.
#[test]
fn group_advantages_replace_vtrace_pg_advantages_only_where_given() {
    let f = VTraceFixture::random(11, 6, 3, 4);
    let (n, a) = (f.t_len * f.b_len, f.rows.n_actions);
    let stride = a + 1;
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
    let base = f.run(&config, None);
    let given: Vec<f32> = (0..n).map(|i| if i % 2 == 0 { i as f32 * 0.1 - 0.5 } else { f32::NAN }).collect();
    let with = f.run(&config, Some(&given));
    assert_eq!(with.vs, base.vs, "value targets are V-trace's");
    for (i, &a_i) in given.iter().enumerate() {
        let expected = if a_i.is_finite() { base.log_rhos[i].exp().min(0.8) * a_i } else { base.pg_advantages[i] };
        assert_eq!(with.pg_advantages[i], expected, "step {i}");
        assert_eq!(with.d_heads[i * stride + a], base.d_heads[i * stride + a], "value gradient of step {i}");
    }
    assert_ne!(with.d_heads, base.d_heads, "the policy gradient moved");
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
