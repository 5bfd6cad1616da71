//! The V-trace and PPO loss bodies of [`super`] on a diagonal Gaussian head (issue 14), squashed
//! and not: analytic gradients against finite differences for every mean, value and log-std,
//! and the behaviour log-probabilities the actor records reproduced by the learner.

use rand::{rngs::SmallRng, Rng, SeedableRng};
use volley_policy::gaussian;
use volley_policy::head::{DiagGaussian, PolicyHead};
use volley_policy::returns::VTraceConfig;

use super::{ppo_loss_heads, vtrace_loss_heads, PpoLossConfig, PpoTargets, RowBatch, VTraceLossConfig, VTraceRows};

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

    fn head<'a>(&self, log_std: &'a [f32]) -> DiagGaussian<'a> {
        DiagGaussian { log_std, squash: self.squash }
    }

    fn batch(&self) -> RowBatch<'_> {
        RowBatch {
            t_len: self.t_len,
            b_len: self.b_len,
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
            let entropy: f64 = log_std.iter().map(|&s| f64::from(s) + 0.5 + 0.5 * (std::f64::consts::TAU).ln()).sum();
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

/// Central differences of `loss(heads, log_std)` against the analytic gradient of the first
/// `d_heads.len()` entries of `heads` and of every log-std (the rows of `d_log_std_rows` summed).
/// With `kinks`, a coordinate whose two sides straddle a kink of the clipped surrogate is
/// skipped, and more than half must be smooth.
fn assert_gradients_match(
    fixture: &Fixture,
    heads: &[f32],
    (d_heads, d_log_std_rows): (&[f32], &[f32]),
    tolerance: f64,
    kinks: bool,
    loss: impl Fn(&[f32], &[f32]) -> f64,
) {
    let eps = 1e-3f32;
    let log_std = &fixture.log_std;
    let centre = loss(heads, log_std);
    let perturbed = |x: &[f32], k: usize| {
        let (mut plus, mut minus) = (x.to_vec(), x.to_vec());
        plus[k] += eps;
        minus[k] -= eps;
        (plus, minus)
    };
    let mut checked = 0;
    for (k, &analytic) in d_heads.iter().enumerate() {
        let (plus, minus) = perturbed(heads, k);
        let (at_plus, at_minus) = (loss(&plus, log_std), loss(&minus, log_std));
        if kinks && ((at_plus - centre) - (centre - at_minus)).abs() > 1e-4 {
            continue;
        }
        checked += 1;
        let fd = (at_plus - at_minus) / (2.0 * f64::from(eps));
        assert!(
            (f64::from(analytic) - fd).abs() < tolerance,
            "squash {}, heads[{k}]: {analytic} vs {fd}",
            fixture.squash
        );
    }
    assert!(checked > d_heads.len() / 2, "only {checked} coordinates were smooth");
    for j in 0..fixture.a {
        let analytic: f32 = d_log_std_rows.chunks_exact(fixture.a).map(|row| row[j]).sum();
        let (plus, minus) = perturbed(log_std, j);
        let fd = (loss(heads, &plus) - loss(heads, &minus)) / (2.0 * f64::from(eps));
        assert!(
            (f64::from(analytic) - fd).abs() < tolerance,
            "squash {}, log_std[{j}]: {analytic} vs {fd}",
            fixture.squash
        );
    }
}

/// Finite differences of the V-trace loss (targets frozen, as the gradient defines them)
/// against the analytic gradient, for every mean, value and log-std parameter.
#[test]
fn vtrace_gradients_match_finite_differences() {
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
    for fixture in [false, true].map(|squash| Fixture::new(squash, 5)) {
        let n = fixture.t_len * fixture.b_len;
        let values = fixture.values(&fixture.heads);
        let (mut log_rhos, mut vs, mut pg) = (vec![0.0; n], vec![0.0; n], vec![0.0; n]);
        let mut d_heads = vec![0.0; fixture.heads.len()];
        let mut d_log_std_rows = vec![0.0; n * fixture.a];
        let rows = VTraceRows {
            log_rhos: &mut log_rhos,
            vs: &mut vs,
            pg_advantages: &mut pg,
            d_heads: &mut d_heads,
            d_head_params: &mut d_log_std_rows,
        };
        let head = fixture.head(&fixture.log_std);
        vtrace_loss_heads(&head, &fixture.batch(), &fixture.heads, &values, &config, None, rows);
        let frozen = (vs, pg);
        let (d_samples, d_bootstrap) = d_heads.split_at(n * (fixture.a + 1));
        assert!(d_bootstrap.iter().all(|&g| g == 0.0), "the bootstrap row gets no gradient");
        assert_gradients_match(
            &fixture,
            &fixture.heads,
            (d_samples, &d_log_std_rows),
            2e-3,
            false,
            |heads, log_std| fixture.vtrace_total(heads, log_std, &config, &frozen),
        );
    }
}

/// Finite differences of the PPO loss against the analytic gradient, for means, values and
/// log-stds, with clipping active on some samples.
#[test]
fn ppo_gradients_match_finite_differences() {
    let config = PpoLossConfig { clip_coef: 0.2, value_coef: 0.5, ent_coef: 0.01, normalize_advantages: true };
    for fixture in [false, true].map(|squash| Fixture::new(squash, 9)) {
        let n = fixture.t_len * fixture.b_len;
        let heads = &fixture.heads[..n * (fixture.a + 1)];
        let mut rng = SmallRng::seed_from_u64(1);
        let advantages: Vec<f32> = (0..n).map(|_| rng.random_range(-1.0..1.0)).collect();
        let returns: Vec<f32> = (0..n).map(|_| rng.random_range(-1.0..1.0)).collect();
        // The proximal policy is the behaviour one, so ratios differ from 1 and some clip.
        let is_weights: Vec<f32> = (0..n).map(|i| 0.5 + 0.05 * i as f32).collect();
        let targets = PpoTargets {
            advantages: &advantages,
            returns: &returns,
            prox_log_probs: &fixture.behaviour,
            is_weights: &is_weights,
        };
        let batch =
            RowBatch { t_len: 1, b_len: n, behaviour_log_probs: &[], rewards: &[], discounts: &[], ..fixture.batch() };
        let run = |heads: &[f32], log_std: &[f32], d_heads: &mut [f32], d_log_std_rows: &mut [f32]| {
            let head = fixture.head(log_std);
            let values = fixture.values(heads);
            let (sums, w) = ppo_loss_heads(&head, &batch, &targets, heads, &values, &config, d_heads, d_log_std_rows);
            sums.stats(w, config.value_coef, config.ent_coef)
        };
        let mut d_heads = vec![0.0; heads.len()];
        let mut d_log_std_rows = vec![0.0; n * fixture.a];
        let stats = run(heads, &fixture.log_std, &mut d_heads, &mut d_log_std_rows);
        assert!(stats.clip_fraction > 0.0 && stats.clip_fraction < 1.0, "{stats:?}");
        assert_gradients_match(&fixture, heads, (&d_heads, &d_log_std_rows), 3e-3, true, |heads, log_std| {
            let (mut d, mut ds) = (vec![0.0; heads.len()], vec![0.0; n * fixture.a]);
            f64::from(run(heads, log_std, &mut d, &mut ds).total)
        });
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
    let head = fixture.head(&fixture.log_std);
    for (i, row) in heads.chunks_exact(a + 1).enumerate() {
        let log_prob = head.log_prob(&row[..a], &fixture.actions[i * a..(i + 1) * a]);
        assert_eq!(log_prob, fixture.behaviour[i], "sample {i}");
    }
}
