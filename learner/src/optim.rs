//! The optimiser over the flat parameter buffer: Adam with bias correction, global-norm gradient
//! clipping, and learning-rate schedules.
//!
//! Parameters and gradients are one contiguous `f32` buffer each (see `volley_policy`'s flat
//! layout), so the optimiser never needs to know the network's shape.

/// Errors restoring the optimiser from saved state.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum OptimError {
    /// A state buffer's length disagrees with the number of parameters.
    #[error("adam state {field}: expected {expected} elements, got {got}")]
    StateShape {
        /// Which buffer (`"m"` or `"v"`).
        field: &'static str,
        /// The number of parameters.
        expected: usize,
        /// The buffer's length.
        got: usize,
    },
}

/// Adam's hyper-parameters other than the learning rate (Kingma & Ba 2015, Algorithm 1).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct AdamConfig {
    /// `β₁`, the decay of the first-moment (mean) estimate.
    pub beta1: f32,
    /// `β₂`, the decay of the second-moment (uncentred variance) estimate.
    pub beta2: f32,
    /// `ε`, added to `√v̂` in the denominator.
    pub eps: f32,
}

impl Default for AdamConfig {
    /// The paper's and PyTorch's defaults: `β₁ = 0.9`, `β₂ = 0.999`, `ε = 1e-8`.
    fn default() -> Self {
        Self { beta1: 0.9, beta2: 0.999, eps: 1e-8 }
    }
}

/// Adam's per-parameter moments and step count, everything a checkpoint must keep to resume.
#[derive(Debug, Clone, PartialEq)]
pub struct AdamState {
    /// The first-moment estimates `m`, one per parameter.
    pub m: Vec<f32>,
    /// The second-moment estimates `v`, one per parameter.
    pub v: Vec<f32>,
    /// The number of steps taken so far (`t` in the paper).
    pub t: u64,
}

/// Adam (Kingma & Ba 2015, "Adam: A Method for Stochastic Optimization", Algorithm 1) over one
/// flat parameter buffer.
///
/// Each step computes, per parameter,
///
/// ```text
/// m ← β₁ m + (1 − β₁) g,        v ← β₂ v + (1 − β₂) g²,
/// θ ← θ − lr · (m / (1 − β₁ᵗ)) / (√(v / (1 − β₂ᵗ)) + ε),
/// ```
///
/// the same update as `torch.optim.Adam` with its defaults (`ε` is added outside the square
/// root, as in the paper's Algorithm 1).
///
/// # Example
///
/// ```
/// use volley_learner::optim::{Adam, AdamConfig};
///
/// let mut params = [1.0f32, -1.0];
/// let mut adam = Adam::new(params.len(), AdamConfig::default());
/// // The first step moves each parameter by lr against the gradient's sign.
/// adam.step(&mut params, &[0.5, -3.0], 0.1);
/// assert!((params[0] - 0.9).abs() < 1e-6 && (params[1] + 0.9).abs() < 1e-6);
/// ```
#[derive(Debug, Clone)]
pub struct Adam {
    config: AdamConfig,
    state: AdamState,
}

impl Adam {
    /// A fresh optimiser for `n_params` parameters, with zero moments and `t = 0`.
    pub fn new(n_params: usize, config: AdamConfig) -> Self {
        Self { config, state: AdamState { m: vec![0.0; n_params], v: vec![0.0; n_params], t: 0 } }
    }

    /// Resumes from saved state (for example a checkpoint).
    ///
    /// # Errors
    ///
    /// [`OptimError::StateShape`] if `m` and `v` differ in length.
    pub fn from_state(config: AdamConfig, state: AdamState) -> Result<Self, OptimError> {
        if state.v.len() != state.m.len() {
            return Err(OptimError::StateShape { field: "v", expected: state.m.len(), got: state.v.len() });
        }
        Ok(Self { config, state })
    }

    /// The moments and step count, for checkpointing.
    pub fn state(&self) -> &AdamState {
        &self.state
    }

    /// Consumes the optimiser and returns its state.
    pub fn into_state(self) -> AdamState {
        self.state
    }

    /// The hyper-parameters.
    pub fn config(&self) -> &AdamConfig {
        &self.config
    }

    /// The number of parameters this optimiser updates.
    pub fn n_params(&self) -> usize {
        self.state.m.len()
    }

    /// Applies one Adam update with learning rate `lr` to `params` given `grads`.
    ///
    /// # Panics
    ///
    /// If `params` or `grads` does not have [`n_params`](Self::n_params) elements.
    pub fn step(&mut self, params: &mut [f32], grads: &[f32], lr: f32) {
        let n_params = self.n_params();
        assert!(params.len() == n_params, "params: expected {n_params} elements, got {}", params.len());
        assert!(grads.len() == n_params, "grads: expected {n_params} elements, got {}", grads.len());
        self.state.t += 1;
        let AdamConfig { beta1, beta2, eps } = self.config;
        // β^t in f64 via powf: t can exceed i32::MAX in principle, and 1 − β₂ᵗ is tiny early on.
        let t = self.state.t as f64;
        let bias_correction1 = 1.0 - f64::from(beta1).powf(t);
        let bias_correction2 = 1.0 - f64::from(beta2).powf(t);
        // As in PyTorch: θ −= (lr / bc1) · m / (√v / √bc2 + ε).
        let step_size = (f64::from(lr) / bias_correction1) as f32;
        let inv_sqrt_bias_correction2 = (1.0 / bias_correction2.sqrt()) as f32;

        let moments = self.state.m.iter_mut().zip(self.state.v.iter_mut());
        for ((param, &grad), (m, v)) in params.iter_mut().zip(grads).zip(moments) {
            *m = beta1 * *m + (1.0 - beta1) * grad;
            *v = beta2 * *v + (1.0 - beta2) * grad * grad;
            let denom = v.sqrt() * inv_sqrt_bias_correction2 + eps;
            *param -= step_size * *m / denom;
        }
    }
}

/// Scales `grads` in place so that their global L2 norm is at most `max_norm`, and returns the
/// norm before clipping (Pascanu et al. 2013, "On the difficulty of training recurrent neural
/// networks", Algorithm 1).
///
/// The norm is accumulated in `f64`. If it is not finite (a NaN or infinite gradient), `grads`
/// is left untouched and the non-finite norm returned, so the caller can skip the step and count
/// it. Unlike PyTorch's `clip_grad_norm_`, no `1e-6` is added to the denominator, so a clipped
/// gradient has norm `max_norm` up to rounding.
pub fn clip_grad_global_norm(grads: &mut [f32], max_norm: f32) -> f32 {
    let norm = grads.iter().map(|&g| f64::from(g) * f64::from(g)).sum::<f64>().sqrt();
    if norm.is_finite() && norm > f64::from(max_norm) {
        let scale = (f64::from(max_norm) / norm) as f32;
        for g in grads.iter_mut() {
            *g *= scale;
        }
    }
    norm as f32
}

/// A learning rate as a function of the update index.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum LrSchedule {
    /// The same rate for every update.
    Constant(f32),
    /// Linear interpolation from `start` at update 0 to `end` at `total_updates`, then `end`
    /// (cleanrl's `anneal_lr` is `end = 0`).
    Linear {
        /// The rate at update 0.
        start: f32,
        /// The rate from `total_updates` on.
        end: f32,
        /// The length of the ramp, in updates.
        total_updates: u64,
    },
    /// Cosine decay from `start` at update 0 to `end` at `total_updates`, then `end`
    /// (Loshchilov & Hutter 2017, "SGDR", eq. (5) without restarts).
    Cosine {
        /// The rate at update 0.
        start: f32,
        /// The rate from `total_updates` on.
        end: f32,
        /// The length of the decay, in updates.
        total_updates: u64,
    },
}

impl LrSchedule {
    /// The learning rate for update `update` (counting from 0).
    ///
    /// # Example
    ///
    /// ```
    /// use volley_learner::optim::LrSchedule;
    ///
    /// let schedule = LrSchedule::Linear { start: 1e-3, end: 0.0, total_updates: 100 };
    /// assert_eq!(schedule.lr_at(0), 1e-3);
    /// assert_eq!(schedule.lr_at(100), 0.0);
    /// ```
    pub fn lr_at(&self, update: u64) -> f32 {
        match *self {
            Self::Constant(lr) => lr,
            Self::Linear { start, end, total_updates } => {
                let progress = progress(update, total_updates);
                (f64::from(start) + (f64::from(end) - f64::from(start)) * progress) as f32
            }
            Self::Cosine { start, end, total_updates } => {
                let progress = progress(update, total_updates);
                let cosine = 0.5 * (1.0 + (std::f64::consts::PI * progress).cos());
                (f64::from(end) + (f64::from(start) - f64::from(end)) * cosine) as f32
            }
        }
    }
}

/// `min(update / total_updates, 1)`, with an empty ramp counting as finished.
fn progress(update: u64, total_updates: u64) -> f64 {
    if total_updates == 0 {
        1.0
    } else {
        (update.min(total_updates) as f64) / (total_updates as f64)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Regression for issue 11 (docs/STABILITY.md): after CartPole was solved, gradients fell
    /// ~100x (per-parameter RMS ~4e-5) while Adam with ε = 1e-8 kept taking learning-rate-sized
    /// steps on that noise; the policy drifted to near-determinism, and the first large value
    /// gradient after thousands of tiny ones was amplified ~3x (m̂/√v̂ up to
    /// (1 − β₁)/√(1 − β₂) ≈ 3.16) into a step that saturated the logits for good. With the run
    /// default ε for CartPole both effects vanish: steps shrink with the gradient, and a spike moves the
    /// parameters by at most about the learning rate.
    #[test]
    fn run_default_eps_keeps_plateau_noise_and_gradient_spikes_from_taking_large_steps() {
        let lr = 2e-3;
        let n_params = 256;
        // A plateau: 5000 updates of random-sign gradients with per-parameter size 4e-5, then
        // one update whose gradient is 200x larger, all in one direction.
        let run = |eps: f32| {
            let mut adam = Adam::new(n_params, AdamConfig { eps, ..AdamConfig::default() });
            let mut params = vec![0.0f32; n_params];
            let mut state = 0x9e37_79b9_u32;
            let mut walk = 0.0f64;
            for _ in 0..5000 {
                let grads: Vec<f32> = (0..n_params)
                    .map(|_| {
                        state ^= state << 13;
                        state ^= state >> 17;
                        state ^= state << 5;
                        if state & 1 == 0 {
                            4e-5
                        } else {
                            -4e-5
                        }
                    })
                    .collect();
                let before = params.clone();
                adam.step(&mut params, &grads, lr);
                walk += before.iter().zip(&params).map(|(a, b)| f64::from(a - b).abs()).sum::<f64>();
            }
            let before = params.clone();
            adam.step(&mut params, &vec![8e-3; n_params], lr);
            let spike = before.iter().zip(&params).map(|(a, b)| (a - b).abs()).fold(0.0f32, f32::max);
            (walk / (5000.0 * n_params as f64), spike)
        };
        let (paper_walk, paper_spike) = run(1e-8);
        let (run_walk, run_spike) = run(volley_core::spec::default_adam_eps(&volley_env::EnvConfig::Cartpole));
        // The mechanism with ε = 1e-8: noise moves each parameter by a sizeable fraction of lr
        // per update, and the spike by well over lr.
        assert!(paper_walk > 0.1 * f64::from(lr), "paper ε: mean step {paper_walk}");
        assert!(paper_spike > 2.5 * lr, "paper ε: spike step {paper_spike}");
        // The run default: noise steps are ~25x smaller, and the spike stays below lr.
        assert!(run_walk < 0.05 * paper_walk, "default ε: mean step {run_walk} vs {paper_walk}");
        assert!(run_spike < lr, "default ε: spike step {run_spike}");
    }

    #[test]
    fn adam_matches_hand_computed_first_two_steps() {
        // One parameter θ₀ = 1, β₁ = 0.9, β₂ = 0.999, ε = 1e-8, lr = 0.1, g₁ = 2, g₂ = −1.
        // Step 1: m = 0.2, v = 0.004, m̂ = 0.2/0.1 = 2, v̂ = 0.004/0.001 = 4,
        //         θ₁ = 1 − 0.1·2/(2 + 1e-8) = 0.9 (to 1e-9).
        // Step 2: m = 0.9·0.2 + 0.1·(−1) = 0.08, v = 0.999·0.004 + 0.001·1 = 0.004996,
        //         m̂ = 0.08/0.19 = 0.42105263, v̂ = 0.004996/0.001999 = 2.49924962,
        //         θ₂ = 0.9 − 0.1·0.42105263/1.58090152 = 0.87336583.
        let mut adam = Adam::new(1, AdamConfig::default());
        let mut theta = [1.0f32];
        adam.step(&mut theta, &[2.0], 0.1);
        assert!((theta[0] - 0.9).abs() < 1e-6, "{theta:?}");
        adam.step(&mut theta, &[-1.0], 0.1);
        assert!((theta[0] - 0.873_365_8).abs() < 1e-6, "{theta:?}");
        let state = adam.state();
        assert_eq!(state.t, 2);
        assert!((state.m[0] - 0.08).abs() < 1e-7);
        // 0.999 is not exact in f32, so 1 − β₂ evaluates to 9.99987e-4 (relative error 1.3e-5).
        assert!((state.v[0] - 0.004_996).abs() < 1e-7, "{state:?}");
    }

    #[test]
    fn adam_minimises_a_quadratic() {
        // f(θ) = Σ_i c_i (θ_i − target_i)², gradient 2 c_i (θ_i − target_i).
        let target = [3.0f32, -2.0, 0.5, 10.0];
        let curvature = [1.0f32, 10.0, 0.1, 2.0];
        let mut theta = [0.0f32; 4];
        let mut grads = [0.0f32; 4];
        let mut adam = Adam::new(4, AdamConfig::default());
        let schedule = LrSchedule::Cosine { start: 0.1, end: 1e-4, total_updates: 3000 };
        for update in 0..3000 {
            for i in 0..4 {
                grads[i] = 2.0 * curvature[i] * (theta[i] - target[i]);
            }
            adam.step(&mut theta, &grads, schedule.lr_at(update));
        }
        for i in 0..4 {
            assert!((theta[i] - target[i]).abs() < 1e-2, "{theta:?}");
        }
    }

    #[test]
    fn adam_resumes_identically_from_saved_state() {
        let grads = [[0.3f32, -1.0], [0.1, 2.0], [-0.5, 0.5]];
        let mut straight = Adam::new(2, AdamConfig::default());
        let mut theta_straight = [1.0f32, 2.0];
        for g in &grads {
            straight.step(&mut theta_straight, g, 0.01);
        }

        let mut first = Adam::new(2, AdamConfig::default());
        let mut theta_resumed = [1.0f32, 2.0];
        first.step(&mut theta_resumed, &grads[0], 0.01);
        let mut resumed = Adam::from_state(*first.config(), first.into_state()).unwrap();
        for g in &grads[1..] {
            resumed.step(&mut theta_resumed, g, 0.01);
        }
        assert_eq!(theta_straight, theta_resumed);
        assert_eq!(straight.state(), resumed.state());
    }

    #[test]
    fn adam_rejects_mismatched_state() {
        let state = AdamState { m: vec![0.0; 3], v: vec![0.0; 2], t: 5 };
        let err = Adam::from_state(AdamConfig::default(), state).unwrap_err();
        assert_eq!(err.to_string(), "adam state v: expected 3 elements, got 2");
    }

    #[test]
    fn clipping_scales_to_exactly_the_max_norm() {
        let mut grads = [3.0f32, 4.0, 0.0, -12.0];
        let norm = clip_grad_global_norm(&mut grads, 6.5);
        assert_eq!(norm, 13.0);
        let clipped_norm = grads.iter().map(|g| g * g).sum::<f32>().sqrt();
        assert!((clipped_norm - 6.5).abs() < 1e-6, "{grads:?}");
        assert_eq!(grads, [1.5, 2.0, 0.0, -6.0]);
    }

    #[test]
    fn clipping_leaves_small_gradients_alone() {
        let mut grads = [0.3f32, -0.4];
        let norm = clip_grad_global_norm(&mut grads, 1.0);
        assert!((norm - 0.5).abs() < 1e-7);
        assert_eq!(grads, [0.3, -0.4]);
    }

    #[test]
    fn clipping_reports_a_non_finite_norm_without_touching_gradients() {
        let mut grads = [1.0f32, f32::NAN, 2.0];
        assert!(clip_grad_global_norm(&mut grads, 1.0).is_nan());
        assert_eq!(grads[0], 1.0);
        assert_eq!(grads[2], 2.0);
        let mut grads = [1.0f32, f32::INFINITY];
        assert_eq!(clip_grad_global_norm(&mut grads, 1.0), f32::INFINITY);
        assert_eq!(grads, [1.0, f32::INFINITY]);
    }

    #[test]
    fn schedules_hit_their_endpoints() {
        let constant = LrSchedule::Constant(3e-4);
        assert_eq!(constant.lr_at(0), 3e-4);
        assert_eq!(constant.lr_at(u64::MAX), 3e-4);

        let linear = LrSchedule::Linear { start: 1e-3, end: 1e-4, total_updates: 10 };
        assert_eq!(linear.lr_at(0), 1e-3);
        assert!((linear.lr_at(5) - 5.5e-4).abs() < 1e-10);
        assert_eq!(linear.lr_at(10), 1e-4);
        assert_eq!(linear.lr_at(1_000), 1e-4);

        let cosine = LrSchedule::Cosine { start: 1e-3, end: 0.0, total_updates: 10 };
        assert_eq!(cosine.lr_at(0), 1e-3);
        assert!((cosine.lr_at(5) - 5e-4).abs() < 1e-10);
        assert_eq!(cosine.lr_at(10), 0.0);
        assert_eq!(cosine.lr_at(11), 0.0);

        let empty = LrSchedule::Linear { start: 1.0, end: 0.5, total_updates: 0 };
        assert_eq!(empty.lr_at(0), 0.5);
    }
}
