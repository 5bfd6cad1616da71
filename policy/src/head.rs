//! One interface to a policy head's action distribution, [`PolicyHead`], in the manner of
//! distrax's `Distribution` and rlax's `categorical`/`gaussian_diagonal` helpers: every loss
//! and every sampler is written once against it, and a head is one implementation.
//!
//! A head reads one row of the network's policy outputs (`n_outputs` floats: logits, or means)
//! plus its own state-independent parameters (none, or a log-std vector), and one recorded
//! action of `action_width` floats. Actions travel as floats everywhere (segments, the
//! learner's buffers): a categorical action is the bit pattern of its `u32` index
//! (`f32::from_bits`), so one buffer carries either kind.
//!
//! Implementations: [`Categorical`] (softmax over logits) and [`DiagGaussian`] (diagonal
//! Gaussian with a log-std vector, `tanh`-squashed or not); [`AnyHead`] picks one from the
//! spec's [`ActionHead`]. The learner's CUDA kernels mirror each implementation as a device
//! struct with the same three functions (`learner/kernels/loss.cu`).
//!
//! # Adding a head
//!
//! Implement [`PolicyHead`] (log-probability, entropy, row gradient, sample), add a variant to
//! [`ActionHead`] and [`AnyHead`], and write the device struct beside the others in `loss.cu`;
//! the V-trace and PPO losses, the actor's sampler and the importance statistics then serve it
//! unchanged.

use rand::Rng;

use crate::distributions::{entropy_from_log_probs, log_softmax, sample_categorical};
use crate::gaussian;
use crate::ActionHead;

/// What [`PolicyHead::row_gradient`] also returns: the row's `log π(a)` and entropy `H(π)`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct RowTerms {
    /// `log π(a|x)` of the given action.
    pub log_prob: f32,
    /// `H(π(·|x))` in nats.
    pub entropy: f32,
}

/// What [`PolicyHead::row_gradient`] differentiates, `−pg_scale · log π(action) − ent_scale ·
/// H(π)`, and where it writes the gradient.
#[derive(Debug)]
pub struct RowGradient<'a> {
    /// The weight of `−log π(action)`.
    pub pg_scale: f32,
    /// The weight of `−H(π)`.
    pub ent_scale: f32,
    /// With respect to the row's outputs, `n_outputs` long; on entry what
    /// [`prepare_row`](PolicyHead::prepare_row) left for the same outputs and action.
    pub d_outputs: &'a mut [f32],
    /// With respect to the head's parameters, `n_param_grads` long.
    pub d_params: &'a mut [f32],
}

/// One drawn action's log-probability, and whether the row had no distribution so the head's
/// fallback (uniform, or the standard normal) drew it instead.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Sampled {
    /// `log` of the density the action was drawn from (what the actor records as the
    /// behaviour log-probability).
    pub log_prob: f32,
    /// The row's outputs were not a distribution (issue 46); the fallback drew the action.
    pub fell_back: bool,
}

/// A policy head's action distribution over one row of network outputs (see the module docs).
pub trait PolicyHead {
    /// Floats of network output per row the head reads (logits, or means).
    fn n_outputs(&self) -> usize;

    /// Floats per recorded action: 1 (an index's bit pattern) or the action's dimension.
    fn action_width(&self) -> usize;

    /// Floats of gradient per row for the head's own parameters (0, or one per log-std).
    fn n_param_grads(&self) -> usize;

    /// Whether `action` is one this head can take (an index below the action count); the
    /// learner refuses a batch with any other rather than index past a row.
    fn valid_action(&self, _action: &[f32]) -> bool {
        true
    }

    /// `log π(action | outputs)`.
    fn log_prob(&self, outputs: &[f32], action: &[f32]) -> f32;

    /// `H(π(· | outputs))` in nats.
    fn entropy(&self, outputs: &[f32]) -> f32;

    /// `log π(action | outputs)`, leaving in `d_outputs` (`n_outputs` long: the row's gradient
    /// to come) what [`row_gradient`](Self::row_gradient) reads back, so a head whose
    /// log-probability and gradient share work (the categorical log-softmax) does it once per
    /// sample even when the loss needs the log-probability long before the gradient (V-trace's
    /// scan sits between the two).
    fn prepare_row(&self, outputs: &[f32], action: &[f32], d_outputs: &mut [f32]) -> f32 {
        let _ = d_outputs;
        self.log_prob(outputs, action)
    }

    /// The gradient of `−pg_scale · log π(action) − ent_scale · H(π)` with respect to the row's
    /// outputs and the head's parameters (see [`RowGradient`]): the one piece of calculus every
    /// policy loss needs.
    fn row_gradient(&self, outputs: &[f32], action: &[f32], grad: RowGradient<'_>) -> RowTerms;

    /// Draw an action into `action` (`action_width` long) and return its log-probability,
    /// which is [`log_prob`](Self::log_prob) of the written action. A row that is not a
    /// distribution draws from the head's fallback and says so.
    fn sample<R: Rng + ?Sized>(&self, outputs: &[f32], rng: &mut R, action: &mut [f32]) -> Sampled;
}

/// The importance statistics of one sample, from `log ρ = log π(a) − log μ(a)`: the ratio and
/// the `k3` estimate `(ρ − 1) − log ρ` of `KL(μ ‖ π)` (Schulman's low-variance, non-negative
/// estimator), computed with `exp_m1` so the two terms cancel exactly near `ρ = 1`.
#[inline]
pub fn importance(log_rho: f64) -> (f64, f64) {
    (log_rho.exp(), log_rho.exp_m1() - log_rho)
}

/// A softmax over `n_actions` logits; actions are index bit patterns.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Categorical {
    /// The number of actions (logits per row).
    pub n_actions: usize,
}

impl Categorical {
    /// The index a recorded action word holds.
    #[inline]
    #[track_caller]
    fn index(&self, action: &[f32]) -> usize {
        let index = action[0].to_bits() as usize;
        assert!(index < self.n_actions, "action {index} out of range for {} actions", self.n_actions);
        index
    }
}

impl PolicyHead for Categorical {
    fn n_outputs(&self) -> usize {
        self.n_actions
    }

    fn action_width(&self) -> usize {
        1
    }

    fn n_param_grads(&self) -> usize {
        0
    }

    fn valid_action(&self, action: &[f32]) -> bool {
        (action[0].to_bits() as usize) < self.n_actions
    }

    fn log_prob(&self, outputs: &[f32], action: &[f32]) -> f32 {
        let index = self.index(action);
        let max = outputs.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        let sum: f32 = outputs.iter().map(|&z| (z - max).exp()).sum();
        (outputs[index] - max) - sum.ln()
    }

    fn entropy(&self, outputs: &[f32]) -> f32 {
        let mut log_probs = vec![0.0; outputs.len()];
        log_softmax(outputs, &mut log_probs);
        entropy_from_log_probs(&log_probs)
    }

    /// The row's log-softmax, into `d_outputs`.
    fn prepare_row(&self, outputs: &[f32], action: &[f32], d_outputs: &mut [f32]) -> f32 {
        let index = self.index(action);
        log_softmax(outputs, d_outputs);
        d_outputs[index]
    }

    /// `∂/∂z_j = pg_scale · (p_j − 1[j = a]) + ent_scale · p_j · (log p_j + H)`, using
    /// `∂ log p_a / ∂z_j = 1[j = a] − p_j` and `∂H/∂z_j = −p_j (log p_j + H)`, from the
    /// log-probabilities [`prepare_row`](PolicyHead::prepare_row) left in `d_outputs`, turned
    /// into the gradient in place, so nothing is allocated.
    fn row_gradient(&self, _outputs: &[f32], action: &[f32], grad: RowGradient<'_>) -> RowTerms {
        let RowGradient { pg_scale, ent_scale, d_outputs, .. } = grad;
        let index = self.index(action);
        let entropy = entropy_from_log_probs(d_outputs);
        let log_prob = d_outputs[index];
        for (j, slot) in d_outputs.iter_mut().enumerate() {
            let log_p = *slot;
            let p = log_p.exp();
            // A masked action (p = 0, log p = −∞) has no entropy gradient; 0·(−∞) would be NaN.
            let entropy_grad = if p > 0.0 { p * (log_p + entropy) } else { 0.0 };
            let indicator = if j == index { 1.0 } else { 0.0 };
            *slot = pg_scale * (p - indicator) + ent_scale * entropy_grad;
        }
        RowTerms { log_prob, entropy }
    }

    /// Inverts the CDF at one uniform draw; a row with no distribution acts uniformly from the
    /// same draw and records `−ln A`, the uniform policy's log-probability.
    fn sample<R: Rng + ?Sized>(&self, outputs: &[f32], rng: &mut R, action: &mut [f32]) -> Sampled {
        let u: f32 = rng.random();
        let (index, log_prob, fell_back) = match sample_categorical(outputs, u) {
            Some(index) => {
                let word = [f32::from_bits(index as u32)];
                (index, self.log_prob(outputs, &word), false)
            }
            None => {
                let index = ((u * self.n_actions as f32) as usize).min(self.n_actions - 1);
                (index, -(self.n_actions as f32).ln(), true)
            }
        };
        action[0] = f32::from_bits(index as u32);
        Sampled { log_prob, fell_back }
    }
}

/// A diagonal Gaussian over `log_std.len()` values with means from the network and a
/// state-independent log-std vector, `tanh`-squashed or not (see [`crate::gaussian`]).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct DiagGaussian<'a> {
    /// The `policy.log_std` parameters, one per action value.
    pub log_std: &'a [f32],
    /// Whether actions are `tanh(u)` (Haarnoja et al. 2018, appendix C).
    pub squash: bool,
}

impl PolicyHead for DiagGaussian<'_> {
    fn n_outputs(&self) -> usize {
        self.log_std.len()
    }

    fn action_width(&self) -> usize {
        self.log_std.len()
    }

    fn n_param_grads(&self) -> usize {
        self.log_std.len()
    }

    fn log_prob(&self, outputs: &[f32], action: &[f32]) -> f32 {
        gaussian::log_prob(outputs, self.log_std, action, self.squash)
    }

    fn entropy(&self, _outputs: &[f32]) -> f32 {
        gaussian::entropy(self.log_std)
    }

    fn row_gradient(&self, outputs: &[f32], action: &[f32], grad: RowGradient<'_>) -> RowTerms {
        let RowGradient { pg_scale, ent_scale, d_outputs, d_params } = grad;
        let (log_std, squash) = (self.log_std, self.squash);
        let log_prob =
            gaussian::row_gradient(outputs, log_std, action, squash, pg_scale, ent_scale, d_outputs, d_params);
        RowTerms { log_prob, entropy: gaussian::entropy(self.log_std) }
    }

    /// A head whose means or log-stds are not finite (finite weights can still overflow a
    /// forward) draws from the standard normal instead and records that density.
    fn sample<R: Rng + ?Sized>(&self, outputs: &[f32], rng: &mut R, action: &mut [f32]) -> Sampled {
        if outputs.iter().chain(self.log_std).all(|x| x.is_finite()) {
            let log_prob = gaussian::sample(outputs, self.log_std, self.squash, rng, action);
            return Sampled { log_prob, fell_back: false };
        }
        let log_prob = gaussian::sample_standard(self.squash, rng, action);
        Sampled { log_prob, fell_back: true }
    }
}

/// The head a spec names, over borrowed parameters: one type for code that serves every head
/// (the actor's sampler, the learner's CPU backend). Each call dispatches on the variant.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum AnyHead<'a> {
    /// [`ActionHead::Categorical`].
    Categorical(Categorical),
    /// [`ActionHead::Gaussian`].
    Gaussian(DiagGaussian<'a>),
}

impl<'a> AnyHead<'a> {
    /// The head `kind` over `n_actions` outputs, with its parameters `params` (empty for a
    /// categorical head, the `n_actions` log-stds for a Gaussian one).
    ///
    /// # Panics
    /// If `params` does not have [`ActionHead::n_params`] elements.
    #[track_caller]
    pub fn new(kind: ActionHead, n_actions: usize, params: &'a [f32]) -> Self {
        assert_eq!(params.len(), kind.n_params(n_actions), "head parameters of a {kind:?} head");
        match kind {
            ActionHead::Categorical => AnyHead::Categorical(Categorical { n_actions }),
            ActionHead::Gaussian { squash } => AnyHead::Gaussian(DiagGaussian { log_std: params, squash }),
        }
    }
}

macro_rules! dispatch {
    ($self:ident, $head:ident => $call:expr) => {
        match $self {
            AnyHead::Categorical($head) => $call,
            AnyHead::Gaussian($head) => $call,
        }
    };
}

impl PolicyHead for AnyHead<'_> {
    #[inline]
    fn n_outputs(&self) -> usize {
        dispatch!(self, head => head.n_outputs())
    }

    #[inline]
    fn action_width(&self) -> usize {
        dispatch!(self, head => head.action_width())
    }

    #[inline]
    fn n_param_grads(&self) -> usize {
        dispatch!(self, head => head.n_param_grads())
    }

    #[inline]
    fn valid_action(&self, action: &[f32]) -> bool {
        dispatch!(self, head => head.valid_action(action))
    }

    #[inline]
    fn log_prob(&self, outputs: &[f32], action: &[f32]) -> f32 {
        dispatch!(self, head => head.log_prob(outputs, action))
    }

    #[inline]
    fn entropy(&self, outputs: &[f32]) -> f32 {
        dispatch!(self, head => head.entropy(outputs))
    }

    #[inline]
    fn row_gradient(&self, outputs: &[f32], action: &[f32], grad: RowGradient<'_>) -> RowTerms {
        dispatch!(self, head => head.row_gradient(outputs, action, grad))
    }

    #[inline]
    fn prepare_row(&self, outputs: &[f32], action: &[f32], d_outputs: &mut [f32]) -> f32 {
        dispatch!(self, head => head.prepare_row(outputs, action, d_outputs))
    }

    #[inline]
    fn sample<R: Rng + ?Sized>(&self, outputs: &[f32], rng: &mut R, action: &mut [f32]) -> Sampled {
        dispatch!(self, head => head.sample(outputs, rng, action))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::{rngs::SmallRng, SeedableRng};

    fn heads(log_std: &[f32]) -> [AnyHead<'_>; 3] {
        [
            AnyHead::new(ActionHead::Categorical, 3, &[]),
            AnyHead::new(ActionHead::Gaussian { squash: false }, 3, log_std),
            AnyHead::new(ActionHead::Gaussian { squash: true }, 3, log_std),
        ]
    }

    /// Every head: a sample records its own log-probability, and the row gradient returns
    /// the same log-probability and entropy as the two direct functions.
    #[test]
    fn samples_and_row_gradients_agree_with_log_prob_and_entropy() {
        let log_std = [-0.5, 0.1, -1.0];
        let outputs = [0.3, -0.8, 1.2];
        let mut rng = SmallRng::seed_from_u64(4);
        for head in heads(&log_std) {
            for _ in 0..20 {
                let mut action = vec![0.0; head.action_width()];
                let sampled = head.sample(&outputs, &mut rng, &mut action);
                assert!(!sampled.fell_back);
                assert_eq!(sampled.log_prob, head.log_prob(&outputs, &action), "{head:?}");
                let (mut d_outputs, mut d_params) = (vec![0.0; head.n_outputs()], vec![0.0; head.n_param_grads()]);
                let log_prob = head.prepare_row(&outputs, &action, &mut d_outputs);
                assert_eq!(log_prob, head.log_prob(&outputs, &action), "{head:?}");
                let grad =
                    RowGradient { pg_scale: 0.7, ent_scale: 0.1, d_outputs: &mut d_outputs, d_params: &mut d_params };
                let terms = head.row_gradient(&outputs, &action, grad);
                assert!((terms.log_prob - sampled.log_prob).abs() < 1e-5, "{head:?}");
                assert!((terms.entropy - head.entropy(&outputs)).abs() < 1e-6, "{head:?}");
            }
        }
    }

    /// The row gradient against central differences of `−pg · log π − ent · H`, outputs and
    /// parameters, for every head.
    #[test]
    fn row_gradients_match_finite_differences() {
        let log_std = [-0.5f32, 0.1, -1.0];
        let outputs = [0.3f32, -0.8, 1.2];
        let (pg, ent) = (0.7f32, 0.3f32);
        let mut rng = SmallRng::seed_from_u64(5);
        for head in heads(&log_std) {
            let mut action = vec![0.0; head.action_width()];
            head.sample(&outputs, &mut rng, &mut action);
            let objective = |head: &AnyHead<'_>, outputs: &[f32]| {
                f64::from(-pg * head.log_prob(outputs, &action) - ent * head.entropy(outputs))
            };
            let (mut d_outputs, mut d_params) = (vec![0.0; head.n_outputs()], vec![0.0; head.n_param_grads()]);
            head.prepare_row(&outputs, &action, &mut d_outputs);
            let grad = RowGradient { pg_scale: pg, ent_scale: ent, d_outputs: &mut d_outputs, d_params: &mut d_params };
            head.row_gradient(&outputs, &action, grad);
            let eps = 1e-2f32;
            for j in 0..outputs.len() {
                let (mut plus, mut minus) = (outputs, outputs);
                plus[j] += eps;
                minus[j] -= eps;
                let fd = (objective(&head, &plus) - objective(&head, &minus)) / f64::from(2.0 * eps);
                assert!((f64::from(d_outputs[j]) - fd).abs() < 2e-3, "{head:?} output {j}: {} vs {fd}", d_outputs[j]);
            }
            for j in 0..head.n_param_grads() {
                let (mut plus, mut minus) = (log_std, log_std);
                plus[j] += eps;
                minus[j] -= eps;
                let squash = matches!(head, AnyHead::Gaussian(DiagGaussian { squash: true, .. }));
                let at = |log_std: &[f32]| objective(&AnyHead::Gaussian(DiagGaussian { log_std, squash }), &outputs);
                let fd = (at(&plus) - at(&minus)) / f64::from(2.0 * eps);
                assert!((f64::from(d_params[j]) - fd).abs() < 2e-3, "{head:?} log_std {j}: {} vs {fd}", d_params[j]);
            }
        }
    }

    /// Issue 46: a row that is not a distribution samples from the fallback and says so.
    #[test]
    fn rows_without_a_distribution_fall_back() {
        let log_std = [0.0f32; 3];
        let mut rng = SmallRng::seed_from_u64(6);
        for head in heads(&log_std) {
            let mut action = vec![0.0; head.action_width()];
            let sampled = head.sample(&[f32::NAN, 0.0, 1.0], &mut rng, &mut action);
            assert!(sampled.fell_back && sampled.log_prob.is_finite(), "{head:?}: {sampled:?}");
        }
    }

    #[test]
    fn importance_of_an_on_policy_sample_is_one_with_no_kl() {
        assert_eq!(importance(0.0), (1.0, 0.0));
        let (ratio, kl) = importance(1.0);
        assert!((ratio - std::f64::consts::E).abs() < 1e-12 && kl > 0.0);
    }
}
