//! Fixtures shared by the NATS integration tests.

use volley_core::ids::{PolicyVersion, RunId};
use volley_core::spec::{HyperParams, RunSpec, StoreLimits};
use volley_core::wire::TrajectorySegment;
use volley_env::EnvConfig;
use volley_policy::{Activation, CoreKind, PolicySpec};

/// A small CartPole run spec for `run`, with small store bounds: JetStream reserves every
/// stream's `max_bytes` when it is created, and a test broker may use at most 75 % of the free
/// disk, which the defaults (about 7 GB in all with work items) can exceed on a full machine.
pub fn spec(run: &str) -> RunSpec {
    let stores = StoreLimits {
        trajectory_max_bytes: 64 << 20,
        weights_max_bytes: 128 << 20,
        kv_max_bytes: 16 << 20,
        work_max_bytes: 16 << 20,
        snapshot_max_bytes: 64 << 20,
        snapshot_index_max_bytes: 16 << 20,
        ..StoreLimits::default()
    };
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
        hyper: HyperParams { stores, ..HyperParams::default() },
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
