//! The learner's two objectives, written once for every [`PolicyHead`], each returning its
//! weighted sums and writing its gradients with respect to the network's fused heads block (the
//! head's outputs, then the value) and the head's own parameters into caller buffers:
//!
//! - [`vtrace_loss_heads`]: the IMPALA actor-critic loss with V-trace targets (Espeholt et al.
//!   2018, sec. 4.2), on `[T+1][B]` rows (the last row only supplies the bootstrap value).
//! - [`ppo_loss_heads`]: PPO-clip (Schulman et al. 2017, eq. (7)) in the decoupled form of
//!   Hilton et al. 2021 ("Batch size-invariance for policy optimization", eq. (2)), on `[T][B]`
//!   rows (no bootstrap row), with advantages and targets ([`PpoTargets`]) computed beforehand
//!   (for example by [`volley_policy::returns::gae()`]).
//!
//! Both losses are weighted sums normalised by the weight sum `W = Σ_i w_i`:
//!
//! ```text
//! loss = (1/W) Σ_i w_i [ policy_i + value_coef · ½ (target_i − V_i)² − ent_coef · H(π_i) ].
//! ```
//!
//! A weight of `0` drops a sample (padding, a rejected or too-stale sample) and a weight in
//! `(0, 1)` down-weights it; weights must be non-negative. Normalising by `W` rather than by the
//! sample count keeps the loss scale, and hence the learning rate's meaning, independent of how
//! many samples were dropped. When `W = 0` the gradients are all zero and the statistics zero.
//!
//! Gradients are overwritten, not accumulated, and are those of the loss above with the targets
//! (`vs`, `pg_advantages`, `advantages`, `returns`) held constant, as in IMPALA and PPO. The
//! per-row gradient is computed in place: each row's gradient first receives what the head's
//! [`PolicyHead::prepare_row`] leaves there (the categorical log-probabilities) and then the
//! gradient, so the losses allocate nothing per sample.

use volley_policy::head::{PolicyHead, RowGradient};
use volley_policy::returns::{vtrace, VTraceConfig};

/// Coefficients of [`vtrace_loss_heads`].
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct VTraceLossConfig {
    /// The V-trace clipping thresholds and `λ`.
    pub vtrace: VTraceConfig,
    /// Weight of the value loss ("baseline cost" in IMPALA; 0.5 is usual).
    pub value_coef: f32,
    /// Weight of the entropy bonus (0.01 is usual).
    pub ent_coef: f32,
}

impl Default for VTraceLossConfig {
    /// IMPALA's clipping thresholds (`ρ̄ = ρ̄_pg = c̄ = λ = 1`), `value_coef = 0.5` and
    /// `ent_coef = 0.01`.
    fn default() -> Self {
        Self { vtrace: VTraceConfig::default(), value_coef: 0.5, ent_coef: 0.01 }
    }
}

/// Coefficients of [`ppo_loss_heads`].
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct PpoLossConfig {
    /// `ε`: the ratio `π_θ/π_prox` is clipped to `[1 − ε, 1 + ε]` (0.2 is usual).
    pub clip_coef: f32,
    /// Weight of the value loss (0.5 is usual).
    pub value_coef: f32,
    /// Weight of the entropy bonus (0.01 is usual).
    pub ent_coef: f32,
    /// Normalise advantages to zero mean and unit standard deviation over the minibatch's
    /// weighted samples before use, as cleanrl does.
    pub normalize_advantages: bool,
}

impl Default for PpoLossConfig {
    /// cleanrl's defaults: `clip_coef = 0.2`, `value_coef = 0.5`, `ent_coef = 0.01`, normalised
    /// advantages.
    fn default() -> Self {
        Self { clip_coef: 0.2, value_coef: 0.5, ent_coef: 0.01, normalize_advantages: true }
    }
}

/// Statistics of one loss evaluation, each a weighted mean over samples (weights `w_i`,
/// normalised by [`weight_sum`](Self::weight_sum)) unless noted.
///
/// The sums behind them are accumulated in `f64` and rounded to `f32` at the end. To average
/// several evaluations (the gradient steps of one PPO update), start from
/// [`LossStats::default`], [`accumulate`](Self::accumulate) each, then take the
/// [`mean`](Self::mean).
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct LossStats {
    /// The minimised objective: `policy + value_coef · value − ent_coef · entropy`.
    pub total: f32,
    /// The policy term: `−pg_advantage · log π(a)` for V-trace, the negated (importance-weighted)
    /// clipped surrogate for PPO.
    pub policy: f32,
    /// The value term before `value_coef`: `½ (target − V)²`.
    pub value: f32,
    /// The mean policy entropy in nats (the bonus, before `ent_coef`).
    pub entropy: f32,
    /// The mean unclipped ratio: `ρ = π/μ` (learner over behaviour) for V-trace, `r = π_θ/π_prox`
    /// for PPO. Far from 1 means the data is far off-policy.
    pub mean_ratio: f32,
    /// The fraction of weight whose ratio was clipped: `ρ > clip_rho_threshold` for V-trace,
    /// `|r − 1| > clip_coef` for PPO (cleanrl's `clipfrac`).
    pub clip_fraction: f32,
    /// The `k3` estimator `(ratio − 1) − log ratio` of the KL divergence between the two
    /// policies of `mean_ratio`, averaged over the samples (cleanrl's `approx_kl`). For V-trace
    /// it estimates `KL(μ ‖ π)`; for PPO it approximates `KL(π_prox ‖ π_θ)` using the behaviour
    /// samples.
    pub approx_kl: f32,
    /// `W = Σ_i w_i`, the normaliser of every other field (not itself normalised).
    pub weight_sum: f32,
    /// How many loss evaluations these statistics cover: 1 for the result of one loss call,
    /// the count so far for a running sum built with [`accumulate`](Self::accumulate).
    pub evaluations: u32,
}

impl LossStats {
    /// Adds `other`'s fields to `self`'s, turning `self` into a running sum over evaluations.
    pub fn accumulate(&mut self, other: &LossStats) {
        self.total += other.total;
        self.policy += other.policy;
        self.value += other.value;
        self.entropy += other.entropy;
        self.mean_ratio += other.mean_ratio;
        self.clip_fraction += other.clip_fraction;
        self.approx_kl += other.approx_kl;
        self.weight_sum += other.weight_sum;
        self.evaluations += other.evaluations;
    }

    /// The per-evaluation mean of a running sum built with [`accumulate`](Self::accumulate):
    /// every field divided by [`evaluations`](Self::evaluations), which is kept. Each
    /// evaluation counts once, whatever its weight sum. A sum of zero evaluations gives the
    /// default (all zero).
    pub fn mean(&self) -> LossStats {
        if self.evaluations == 0 {
            return LossStats::default();
        }
        let n = self.evaluations as f32;
        LossStats {
            total: self.total / n,
            policy: self.policy / n,
            value: self.value / n,
            entropy: self.entropy / n,
            mean_ratio: self.mean_ratio / n,
            clip_fraction: self.clip_fraction / n,
            approx_kl: self.approx_kl / n,
            weight_sum: self.weight_sum / n,
            evaluations: self.evaluations,
        }
    }
}

#[track_caller]
fn assert_len(name: &str, slice_len: usize, expected: usize) {
    assert!(slice_len == expected, "{name}: expected {expected} elements, got {slice_len}");
}

/// The recorded side of a time-major batch as the head-generic loss bodies read it: `[T][B]`
/// per-sample slices and the actions as `[T][B][action_width]` words (an index's bit pattern,
/// or the values of a continuous action; see [`volley_policy::head`]). PPO reads only
/// `actions` and `sample_weights` and passes its minibatch as `T = 1`, `B = n`.
#[derive(Debug, Clone, Copy)]
pub struct RowBatch<'a> {
    /// `T`, the number of steps per segment.
    pub t_len: usize,
    /// `B`, the number of segments.
    pub b_len: usize,
    /// The recorded actions, `[T][B][action_width]` (each valid for the head: the segment
    /// decoder and the backends' entry check this).
    pub actions: &'a [f32],
    /// `log μ(a_t|x_t)`, the behaviour policy's log-probability of each action, recorded by the
    /// actor (V-trace only).
    pub behaviour_log_probs: &'a [f32],
    /// `r_t` (V-trace only).
    pub rewards: &'a [f32],
    /// `γ · (1 − terminated_t)`: zero where the episode terminated at step `t` (V-trace only).
    pub discounts: &'a [f32],
    /// Per-sample weight `w ≥ 0`: `0` drops the sample's own loss terms, `< 1` down-weights a
    /// stale one. A dropped sample's reward and value still feed the V-trace recursion of the
    /// steps before it unless the discount before it is `0`, so padding must follow a
    /// termination (or carry harmless rewards and values).
    pub sample_weights: &'a [f32],
}

/// Where [`vtrace_loss_heads`] writes: the `[T][B]` intermediates, the heads' gradient
/// `[T+1][B][n_outputs + 1]` and the head parameters' per-sample gradient rows
/// `[T][B][n_param_grads]` (empty for a head without parameters), which the caller sums over
/// rows.
pub struct VTraceRows<'a> {
    /// `log π(a|x) − log μ(a|x)`.
    pub log_rhos: &'a mut [f32],
    /// The V-trace value targets.
    pub vs: &'a mut [f32],
    /// The policy-gradient advantages.
    pub pg_advantages: &'a mut [f32],
    /// `∂L/∂heads` (zero on the bootstrap row).
    pub d_heads: &'a mut [f32],
    /// `∂L/∂(head parameters)` per sample.
    pub d_head_params: &'a mut [f32],
}

/// The IMPALA loss with V-trace targets (Espeholt et al. 2018, sec. 4.2) on the network's fused
/// heads block, for any [`PolicyHead`]: the one body the CPU backend runs for every head.
///
/// Shapes (`T = batch.t_len`, `B = batch.b_len`): `heads` and `out.d_heads` are
/// `[T+1][B][n_outputs + 1]` (the head's outputs, then the value) and `values` is its value
/// column `[T+1][B]`. The learner runs the network over the `T` steps plus the state after the
/// last one; row `T` only supplies the bootstrap value `V(x_T)`, so its outputs are unused and it
/// receives zero gradient.
///
/// With `log ρ_t = log π(a_t|x_t) − log μ(a_t|x_t)` from the current outputs and the behaviour
/// log-probabilities, [`vtrace()`] gives targets `vs_t` and advantages `A_t` (or
/// `advantage_override`, see [`override_pg_advantages`]); then
///
/// ```text
/// loss = (1/W) Σ_t w_t [ −A_t log π(a_t|x_t) + value_coef · ½ (vs_t − V(x_t))² − ent_coef · H(π(·|x_t)) ]
/// ```
///
/// with `A_t`, `vs_t` and the bootstrap value held constant (no gradient), as in IMPALA.
/// Returns the weighted sums and the weight sum `W`; the gradients are zero where `W = 0`.
///
/// # Panics
///
/// If a slice length disagrees with the batch shape or an action is out of range.
pub fn vtrace_loss_heads<H: PolicyHead>(
    head: &H,
    batch: &RowBatch<'_>,
    heads: &[f32],
    values: &[f32],
    config: &VTraceLossConfig,
    advantage_override: Option<&[f32]>,
    out: VTraceRows<'_>,
) -> (WeightedSums, f64) {
    let VTraceRows { log_rhos, vs, pg_advantages, d_heads, d_head_params } = out;
    let n_samples = batch.t_len * batch.b_len;
    let (n_outputs, width) = check_rows(head, batch, n_samples + batch.b_len, heads, values, d_heads, d_head_params);
    let stride = n_outputs + 1;
    for (name, len) in [
        ("behaviour_log_probs", batch.behaviour_log_probs.len()),
        ("rewards", batch.rewards.len()),
        ("discounts", batch.discounts.len()),
        ("log_rhos", log_rhos.len()),
        ("vs", vs.len()),
        ("pg_advantages", pg_advantages.len()),
    ] {
        assert_len(name, len, n_samples);
    }

    // The bootstrap row is a constant: no gradient reaches its outputs or its value.
    let (d_heads, d_heads_bootstrap) = d_heads.split_at_mut(n_samples * stride);
    d_heads_bootstrap.fill(0.0);
    let (values, bootstrap_value) = values.split_at(n_samples);
    let action = |i: usize| &batch.actions[i * width..(i + 1) * width];

    // Pass 1: the log importance weights. What the head computes on the way (the categorical
    // log-softmax) waits in the row's gradient for pass 3, which overwrites every row.
    let rows = log_rhos.iter_mut().zip(batch.behaviour_log_probs).zip(d_heads.chunks_exact_mut(stride));
    for (i, ((log_rho, &behaviour_log_prob), grad_row)) in rows.enumerate() {
        let outputs = &heads[i * stride..i * stride + n_outputs];
        *log_rho = head.prepare_row(outputs, action(i), &mut grad_row[..n_outputs]) - behaviour_log_prob;
    }

    // Pass 2: V-trace targets and advantages (Espeholt et al. 2018, eq. (1) and sec. 4.2).
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
        override_pg_advantages(advantage_override, log_rhos, config.vtrace.clip_pg_rho_threshold, pg_advantages);
    }

    // Pass 3: per-sample loss terms and gradients.
    let mut sums = WeightedSums::default();
    let weight_sum =
        for_weighted_samples(batch.sample_weights, n_outputs, d_heads, d_head_params, |i, scale, mut grads| {
            let (value, target, pg_advantage, log_rho) = (values[i], vs[i], pg_advantages[i], log_rhos[i]);
            let outputs = &heads[i * stride..i * stride + n_outputs];
            let terms = head.row_gradient(outputs, action(i), grads.row(scale * pg_advantage, scale * config.ent_coef));
            *grads.value = -config.value_coef * scale * (target - value);
            let w = f64::from(batch.sample_weights[i]);
            let rho = log_rho.exp();
            sums.policy += w * f64::from(-pg_advantage * terms.log_prob);
            sums.value += w * 0.5 * f64::from(target - value).powi(2);
            sums.entropy += w * f64::from(terms.entropy);
            sums.add_ratio(w, f64::from(rho), f64::from(log_rho), rho > config.vtrace.clip_rho_threshold);
        });
    (sums, weight_sum)
}

/// The shape contract both loss bodies share, checked at their entry: `batch`'s `n` samples
/// (actions and weights), `n_rows ≥ n` rows of `heads`, of their value column `values` and of
/// their gradient `d_heads` (V-trace adds the bootstrap row), and `n` rows of head-parameter
/// gradients. Returns the head's `n_outputs` and `action_width`.
#[track_caller]
fn check_rows<H: PolicyHead>(
    head: &H,
    batch: &RowBatch<'_>,
    n_rows: usize,
    heads: &[f32],
    values: &[f32],
    d_heads: &[f32],
    d_head_params: &[f32],
) -> (usize, usize) {
    let n = batch.t_len * batch.b_len;
    let (n_outputs, width, n_params) = (head.n_outputs(), head.action_width(), head.n_param_grads());
    assert!(n_outputs > 0, "a head has outputs");
    for (name, len, expected) in [
        ("actions", batch.actions.len(), n * width),
        ("sample_weights", batch.sample_weights.len(), n),
        ("heads", heads.len(), n_rows * (n_outputs + 1)),
        ("values", values.len(), n_rows),
        ("d_heads", d_heads.len(), n_rows * (n_outputs + 1)),
        ("d_head_params", d_head_params.len(), n * n_params),
    ] {
        assert_len(name, len, expected);
    }
    (n_outputs, width)
}

/// One sample's rows of the loss bodies' outputs: the gradient of its head outputs, of its
/// value and of the head's parameters.
struct SampleGrads<'a> {
    outputs: &'a mut [f32],
    value: &'a mut f32,
    params: &'a mut [f32],
}

impl SampleGrads<'_> {
    /// The head's part of the sample's gradient, for [`PolicyHead::row_gradient`] with these
    /// scales.
    fn row(&mut self, pg_scale: f32, ent_scale: f32) -> RowGradient<'_> {
        RowGradient { pg_scale, ent_scale, d_outputs: &mut *self.outputs, d_params: &mut *self.params }
    }
}

/// The weighted-sample frame of both loss bodies: with `W = Σ_i w_i` over `weights`, runs
/// `sample(i, w_i / W, its gradient rows)` for every sample of nonzero weight in order and
/// zeroes the rows of the others, or zeroes every row where `W = 0`; returns `W`. `d_heads` holds
/// `[n][n_outputs + 1]` rows and `d_head_params` `n` equal rows (empty for a head without
/// parameters).
fn for_weighted_samples(
    weights: &[f32],
    n_outputs: usize,
    d_heads: &mut [f32],
    d_head_params: &mut [f32],
    mut sample: impl FnMut(usize, f32, SampleGrads<'_>),
) -> f64 {
    let weight_sum: f64 = weights.iter().map(|&w| f64::from(w)).sum();
    if weight_sum <= 0.0 {
        d_heads.fill(0.0);
        d_head_params.fill(0.0);
        return weight_sum;
    }
    let inv_weight_sum = (1.0 / weight_sum) as f32;
    let (stride, n_params) = (n_outputs + 1, d_head_params.len() / weights.len().max(1));
    for (i, &weight) in weights.iter().enumerate() {
        let grad_row = &mut d_heads[i * stride..(i + 1) * stride];
        let params = &mut d_head_params[i * n_params..(i + 1) * n_params];
        if weight == 0.0 {
            grad_row.fill(0.0);
            params.fill(0.0);
            continue;
        }
        let (outputs, value) = grad_row.split_at_mut(n_outputs);
        sample(i, weight * inv_weight_sum, SampleGrads { outputs, value: &mut value[0], params });
    }
    weight_sum
}

/// Group baselines in V-trace: where `advantage_override[i]` is finite, the policy-gradient
/// advantage becomes `min(ρ_i, ρ̄_pg) · advantage_override[i]` (the same clipped importance
/// weight V-trace puts on its own `r + γ v_{t+1} − V`); elsewhere V-trace's stays.
///
/// # Panics
/// If the lengths differ.
pub fn override_pg_advantages(
    advantage_override: &[f32],
    log_rhos: &[f32],
    pg_rho_bar: f32,
    pg_advantages: &mut [f32],
) {
    assert!(advantage_override.len() == log_rhos.len() && log_rhos.len() == pg_advantages.len());
    for ((pg, &a), &log_rho) in pg_advantages.iter_mut().zip(advantage_override).zip(log_rhos) {
        if a.is_finite() {
            *pg = log_rho.exp().min(pg_rho_bar) * a;
        }
    }
}

/// Group baselines in PPO: where `advantage_override[i]` is finite it replaces GAE's
/// advantage; elsewhere GAE's stays.
///
/// # Panics
/// If the lengths differ.
pub fn override_advantages(advantage_override: &[f32], advantages: &mut [f32]) {
    assert_eq!(advantage_override.len(), advantages.len());
    for (adv, &a) in advantages.iter_mut().zip(advantage_override) {
        if a.is_finite() {
            *adv = a;
        }
    }
}

/// What [`ppo_loss_heads`] needs beyond the [`RowBatch`], all computed before the update.
///
/// Every slice is `[T][B]`, laid out like the batch.
#[derive(Debug, Clone, Copy)]
pub struct PpoTargets<'a> {
    /// `Â`, the advantages (for example GAE under the proximal policy's values).
    pub advantages: &'a [f32],
    /// The value targets (for example `Â + V`).
    pub returns: &'a [f32],
    /// `log π_prox(a|x)`: the learner's policy at the start of this update.
    pub prox_log_probs: &'a [f32],
    /// `min(π_prox/μ, clip)`, the behaviour importance weights from [`behaviour_is_weights`].
    pub is_weights: &'a [f32],
}

impl PpoTargets<'_> {
    /// Every slice is `[n]`.
    #[track_caller]
    fn check(&self, n: usize) {
        assert_len("advantages", self.advantages.len(), n);
        assert_len("returns", self.returns.len(), n);
        assert_len("prox_log_probs", self.prox_log_probs.len(), n);
        assert_len("is_weights", self.is_weights.len(), n);
    }
}

/// Truncated importance weights of the proximal policy over the behaviour policy,
/// `out_i = min(exp(prox_log_probs_i − behaviour_log_probs_i), clip)`, for the decoupled PPO
/// objective (Hilton et al. 2021, eq. (2)).
///
/// Truncating at `clip` (V-trace's `ρ̄`, e.g. 1) bounds the variance that stale samples add.
///
/// # Panics
///
/// If the slice lengths differ.
pub fn behaviour_is_weights(prox_log_probs: &[f32], behaviour_log_probs: &[f32], clip: f32, out: &mut [f32]) {
    assert_len("behaviour_log_probs", behaviour_log_probs.len(), prox_log_probs.len());
    assert_len("out", out.len(), prox_log_probs.len());
    for ((o, &prox), &behaviour) in out.iter_mut().zip(prox_log_probs).zip(behaviour_log_probs) {
        *o = (prox - behaviour).exp().min(clip);
    }
}

/// The decoupled PPO-clip loss (Schulman et al. 2017, eq. (7); Hilton et al. 2021, eq. (2)) on
/// the network's fused heads block, for any [`PolicyHead`]: the one body the CPU backend runs for
/// every head.
///
/// Shapes: `heads` and `d_heads` are `[n][n_outputs + 1]`, `values` the value column `[n]`,
/// `d_head_params` the head parameters' per-sample gradient rows `[n][n_param_grads]`; `batch`
/// is the minibatch as `T = 1`, `B = n`. Unlike [`vtrace_loss_heads`] there is no bootstrap row:
/// the advantages and returns were computed before the update. The loss treats the `n` samples
/// independently, so their order does not matter as long as every slice follows the same one.
///
/// With `r = π_θ(a|x) / π_prox(a|x)` and the behaviour weight `is_w = min(π_prox/μ, clip)`,
///
/// ```text
/// loss = (1/W) Σ_i w_i [ −is_w_i · min(r_i Â_i, clip(r_i, 1 − ε, 1 + ε) Â_i)
///                       + value_coef · ½ (ret_i − V_i)² − ent_coef · H(π_θ(·|x_i)) ].
/// ```
///
/// With `normalize_advantages`, `Â` is first replaced by `(Â − m) / (s + 1e-8)`, where `m` and
/// `s` are the weighted mean and (population) standard deviation over the minibatch.
/// The surrogate's gradient flows through the unclipped term whenever that term is the minimum
/// (ties included); the clipped term is constant in `θ` outside `[1 − ε, 1 + ε]`.
/// Samples of weight `0` are skipped entirely: their outputs are not read.
/// Returns the weighted sums and `W`; the gradients are zero where `W = 0`.
///
/// # Panics
///
/// If a slice length disagrees with the batch shape or an action is out of range.
#[allow(clippy::too_many_arguments)]
pub fn ppo_loss_heads<H: PolicyHead>(
    head: &H,
    batch: &RowBatch<'_>,
    targets: &PpoTargets<'_>,
    heads: &[f32],
    values: &[f32],
    config: &PpoLossConfig,
    d_heads: &mut [f32],
    d_head_params: &mut [f32],
) -> (WeightedSums, f64) {
    let n_samples = batch.t_len * batch.b_len;
    let (n_outputs, width) = check_rows(head, batch, n_samples, heads, values, d_heads, d_head_params);
    let stride = n_outputs + 1;
    targets.check(n_samples);

    // Weighted advantage moments over the kept samples, in f64 so large minibatches stay exact
    // (unused where no sample carries weight).
    let weight_sum: f64 = batch.sample_weights.iter().map(|&w| f64::from(w)).sum();
    let (adv_shift, adv_scale) = if config.normalize_advantages && weight_sum > 0.0 {
        let weighted = || {
            batch
                .sample_weights
                .iter()
                .zip(targets.advantages)
                .filter(|(&w, _)| w != 0.0)
                .map(|(&w, &a)| (f64::from(w), f64::from(a)))
        };
        let mean = weighted().map(|(w, a)| w * a).sum::<f64>() / weight_sum;
        let variance = weighted().map(|(w, a)| w * (a - mean).powi(2)).sum::<f64>() / weight_sum;
        (mean as f32, (1.0 / (variance.sqrt() + 1e-8)) as f32)
    } else {
        (0.0, 1.0)
    };

    let (clip_low, clip_high) = (1.0 - config.clip_coef, 1.0 + config.clip_coef);
    let mut sums = WeightedSums::default();
    let weight_sum =
        for_weighted_samples(batch.sample_weights, n_outputs, d_heads, d_head_params, |i, scale, mut grads| {
            let outputs = &heads[i * stride..i * stride + n_outputs];
            let action = &batch.actions[i * width..(i + 1) * width];
            let log_ratio = head.prepare_row(outputs, action, grads.outputs) - targets.prox_log_probs[i];
            let ratio = log_ratio.exp();
            let advantage = (targets.advantages[i] - adv_shift) * adv_scale;

            // PPO-clip surrogate (Schulman et al. 2017, eq. (7)); d(r Â)/d log π = r Â.
            let unclipped = ratio * advantage;
            let clipped = ratio.clamp(clip_low, clip_high) * advantage;
            let (surrogate, surrogate_grad) =
                if unclipped <= clipped { (unclipped, unclipped) } else { (clipped, 0.0) };
            let is_weight = targets.is_weights[i];
            let pg_scale = scale * is_weight * surrogate_grad;
            let terms = head.row_gradient(outputs, action, grads.row(pg_scale, scale * config.ent_coef));
            let (value, ret) = (values[i], targets.returns[i]);
            *grads.value = -config.value_coef * scale * (ret - value);
            let w = f64::from(batch.sample_weights[i]);
            sums.policy -= w * f64::from(is_weight * surrogate);
            sums.value += w * 0.5 * f64::from(ret - value).powi(2);
            sums.entropy += w * f64::from(terms.entropy);
            sums.add_ratio(w, f64::from(ratio), f64::from(log_ratio), (ratio - 1.0).abs() > config.clip_coef);
        });
    (sums, weight_sum)
}

/// Weighted running sums behind [`LossStats`], accumulated in `f64`: each is `Σ_i w_i x_i`
/// over the samples of one loss evaluation (what a backend reads back per gradient step).
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct WeightedSums {
    /// The policy term.
    pub policy: f64,
    /// The value term before `value_coef`.
    pub value: f64,
    /// The entropy.
    pub entropy: f64,
    /// The unclipped ratio.
    pub ratio: f64,
    /// The weight of clipped samples.
    pub clipped: f64,
    /// The `k3` KL estimate.
    pub approx_kl: f64,
}

impl WeightedSums {
    pub(crate) fn add_ratio(&mut self, weight: f64, ratio: f64, log_ratio: f64, clipped: bool) {
        self.ratio += weight * ratio;
        if clipped {
            self.clipped += weight;
        }
        self.approx_kl += weight * ((ratio - 1.0) - log_ratio);
    }

    /// The statistics of one evaluation with weight sum `weight_sum`: all zero (but the weight
    /// sum and the count) when nothing carried weight.
    pub fn stats(self, weight_sum: f64, value_coef: f32, ent_coef: f32) -> LossStats {
        if weight_sum <= 0.0 {
            return LossStats { weight_sum: weight_sum as f32, evaluations: 1, ..LossStats::default() };
        }
        self.finish(weight_sum, value_coef, ent_coef)
    }

    pub(crate) fn finish(self, weight_sum: f64, value_coef: f32, ent_coef: f32) -> LossStats {
        let policy = self.policy / weight_sum;
        let value = self.value / weight_sum;
        let entropy = self.entropy / weight_sum;
        let total = policy + f64::from(value_coef) * value - f64::from(ent_coef) * entropy;
        LossStats {
            total: total as f32,
            policy: policy as f32,
            value: value as f32,
            entropy: entropy as f32,
            mean_ratio: (self.ratio / weight_sum) as f32,
            clip_fraction: (self.clipped / weight_sum) as f32,
            approx_kl: (self.approx_kl / weight_sum) as f32,
            weight_sum: weight_sum as f32,
            evaluations: 1,
        }
    }
}

#[cfg(test)]
#[path = "losses_tests.rs"]
mod tests;

#[cfg(test)]
#[path = "losses_gaussian_tests.rs"]
mod gaussian_tests;
