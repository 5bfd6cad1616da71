//! Fixtures shared by the NATS integration tests.

use volley_core::ids::{PolicyVersion, RunId};
use volley_core::spec::{HyperParams, RunSpec};
use volley_core::wire::TrajectorySegment;
use volley_env::EnvConfig;
use volley_policy::{Activation, CoreKind, PolicySpec};

/// A small CartPole run spec for `run`.
pub fn spec(run: &str) -> RunSpec {
    RunSpec {
        run: RunId::new(run).expect("a valid run id"),
        env: EnvConfig::Cartpole,
        policy: PolicySpec {
            obs_dim: 4,
            n_actions: 2,
            torso: vec![8],
            activation: Activation::Tanh,
            core: CoreKind::Mlp,
        },
        segment_len: 4,
        hyper: HyperParams::default(),
        seed: 7,
    }
}

/// A one-step segment whose observations carry its index (not valid against a spec: the
/// transport does not validate, the learner does).
pub fn segment(run: &str, actor: &str, env_idx: u32, segment_idx: u64) -> TrajectorySegment {
    TrajectorySegment {
        run: run.into(),
        actor: actor.into(),
        incarnation: 0,
        env_idx,
        episode_id: 0,
        segment_idx,
        task_id: 0,
        start_snapshot: None,
        policy_version: PolicyVersion(0),
        layout_hash: 0,
        obs_dim: 1,
        observations: vec![segment_idx as f32; 2],
        actions: vec![0],
        rewards: vec![1.0],
        terminated: vec![0],
        truncated: vec![0],
        behaviour_log_probs: vec![-0.5],
        truncation_values: vec![0.0],
        initial_hidden: vec![],
        finished_episodes: vec![],
        saved_snapshots: Vec::new(),
    }
}
