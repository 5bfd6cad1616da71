//! What the learner's throughput benches (`backend`, `conv`) share: the run of a bench network,
//! a random batch for it, and the median of a sample.

use rand::Rng;
use rand_pcg::Pcg64Mcg;
use volley_core::ids::PolicyVersion;
use volley_core::spec::{LossKind, RunSpec};
use volley_core::wire::Observations;
use volley_env::EnvConfig;
use volley_learner::batch::SegmentBatch;
use volley_policy::PolicySpec;
use volley_testkit::fixtures::SpecBuilder;

/// A run of `policy` on `env` training with `loss` on batches of `b_len` segments of `t_len`
/// steps: a constant learning rate of 1e-4, PPO's two epochs of four minibatches, seed 5.
pub fn spec(env: EnvConfig, policy: PolicySpec, loss: LossKind, t_len: usize, b_len: usize) -> RunSpec {
    SpecBuilder::new(env, policy, t_len).run("bench").training(loss, b_len, 1e-4).ppo(2, 4).seed(5).build()
}

/// A batch for `spec` with `observations` (`[T + 1][B][obs_dim]`, drawn by the caller before
/// the rest): random discrete actions and rewards in `[−1, 1)`, the uniform policy's
/// log-probabilities, discount 0.99, weight 1, no episode start.
pub fn batch(rng: &mut Pcg64Mcg, spec: &RunSpec, observations: Observations) -> SegmentBatch {
    let (t_len, b_len, n_actions) = (spec.segment_len, spec.hyper.batch_segments, spec.policy.n_actions);
    let steps = t_len * b_len;
    SegmentBatch {
        t_len,
        b_len,
        obs_dim: spec.policy.obs_dim,
        hidden_size: 0,
        observations,
        episode_start: vec![0.0; (t_len + 1) * b_len],
        initial_hidden: Vec::new(),
        actions: (0..steps).map(|_| rng.random_range(0..n_actions as u32)).collect(),
        action_dim: 0,
        continuous_actions: Vec::new(),
        behaviour_log_probs: vec![-(n_actions as f32).ln(); steps],
        rewards: (0..steps).map(|_| rng.random_range(-1.0..1.0)).collect(),
        discounts: vec![0.99; steps],
        sample_weights: vec![1.0; steps],
        policy_versions: vec![PolicyVersion(0); b_len],
        ..SegmentBatch::default()
    }
}

/// The median of `xs` (the upper one of an even count).
pub fn median(mut xs: Vec<f64>) -> f64 {
    xs.sort_by(f64::total_cmp);
    xs[xs.len() / 2]
}
