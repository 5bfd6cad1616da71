//! Actor path throughput: environment stepping + batched policy inference + sampling +
//! segment building + wire encoding, on one thread (agent steps per second per core).

use std::sync::Arc;

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use volley_actor::{ActorCounters, RolloutWorker};
use volley_core::ids::{ActorId, PolicyVersion, RunId};
use volley_core::spec::{HyperParams, RunSpec};
use volley_core::wire::{encode_segment, Weights};
use volley_env::{EnvConfig, MinatarConfig, MinatarGame};
use volley_policy::{Activation, ConvSpec, CoreKind, ParamLayout, PolicySpec};

fn cartpole_spec(segment_len: usize) -> RunSpec {
    RunSpec {
        run: RunId::new("bench").expect("valid run id"),
        env: EnvConfig::Cartpole,
        policy: PolicySpec {
            obs_dim: 4,
            n_actions: 2,
            torso: vec![64, 64],
            activation: Activation::Tanh,
            core: CoreKind::Mlp,
            head: volley_policy::ActionHead::Categorical,
            conv: None,
            normalize_obs: false,
            critic: Vec::new(),
        },
        segment_len,
        hyper: HyperParams::default(),
        seed: 7,
    }
}

fn actor_path(c: &mut Criterion) {
    let mut group = c.benchmark_group("actor_agent_steps");
    group.sample_size(10).measurement_time(std::time::Duration::from_secs(3));
    let segment_len = 32;
    for n_envs in [8usize, 64] {
        let spec = cartpole_spec(segment_len);
        let layout = ParamLayout::new(&spec.policy).expect("valid policy");
        let weights = Arc::new(Weights::new(PolicyVersion(1), layout.hash(), layout.init_params(3)));
        let mut worker = RolloutWorker::new(
            spec,
            ActorId::new("bench").expect("valid actor id"),
            n_envs,
            11,
            Arc::new(ActorCounters::default()),
        )
        .expect("cartpole actor");
        worker.set_weights(weights).expect("matching weights");
        group.throughput(Throughput::Elements((segment_len * n_envs) as u64));
        group.bench_with_input(BenchmarkId::new("cartpole_mlp64x64_encode", n_envs), &n_envs, |b, _| {
            b.iter(|| {
                let segments = worker.collect_segments();
                let bytes: usize = segments.iter().map(|s| encode_segment(s).len()).sum();
                std::hint::black_box(bytes)
            })
        });
    }
    // Issue 14: the Gaussian head on pendulum (3 observations, one continuous action).
    for n_envs in [8usize, 64] {
        let spec = RunSpec {
            env: EnvConfig::Pendulum,
            policy: PolicySpec::mlp(3, 1, &[64, 64], Activation::Tanh)
                .with_head(volley_policy::ActionHead::Gaussian { squash: false }),
            ..cartpole_spec(segment_len)
        };
        let layout = ParamLayout::new(&spec.policy).expect("valid policy");
        let weights = Arc::new(Weights::new(PolicyVersion(1), layout.hash(), layout.init_params(3)));
        let mut worker = RolloutWorker::new(
            spec,
            ActorId::new("bench").expect("valid actor id"),
            n_envs,
            11,
            Arc::new(ActorCounters::default()),
        )
        .expect("pendulum actor");
        worker.set_weights(weights).expect("matching weights");
        group.throughput(Throughput::Elements((segment_len * n_envs) as u64));
        group.bench_with_input(BenchmarkId::new("pendulum_gaussian_mlp64x64_encode", n_envs), &n_envs, |b, _| {
            b.iter(|| {
                let segments = worker.collect_segments();
                let bytes: usize = segments.iter().map(|s| encode_segment(s).len()).sum();
                std::hint::black_box(bytes)
            })
        });
    }
    group.finish();
}

/// The policy side of an actor step with the Gaussian head, without an environment: batched
/// MLP 64×64 inference and one Gaussian draw with its log-probability per agent, for the
/// observation and action widths of pendulum (3, 1) and MuJoCo HalfCheetah (17, 6).
fn gaussian_policy_step(c: &mut Criterion) {
    use rand::SeedableRng;
    let mut group = c.benchmark_group("actor_gaussian_policy_steps");
    group.sample_size(10).measurement_time(std::time::Duration::from_secs(3));
    let n = 64;
    for (obs_dim, action_dim) in [(3usize, 1usize), (17, 6)] {
        let policy = PolicySpec::mlp(obs_dim, action_dim, &[64, 64], Activation::Tanh)
            .with_head(volley_policy::ActionHead::Gaussian { squash: false });
        let layout = ParamLayout::new(&policy).expect("valid policy");
        let params = layout.init_params(3);
        let log_std = &params[layout.log_std_range().expect("a Gaussian layout")];
        let mut inference = volley_policy::PolicyInference::new(&layout, n);
        let obs: Vec<f32> = (0..n * obs_dim).map(|i| (i as f32 * 0.37).sin()).collect();
        let (mut means, mut values, mut actions) = (vec![0.0; n * action_dim], vec![0.0; n], vec![0.0; n * action_dim]);
        let mut rng = rand::rngs::SmallRng::seed_from_u64(1);
        group.throughput(Throughput::Elements(n as u64));
        group.bench_function(BenchmarkId::new(format!("obs{obs_dim}_act{action_dim}_mlp64x64"), n), |b| {
            b.iter(|| {
                inference.forward(&params, &obs, n, &mut [], &mut means, &mut values);
                let mut total = 0.0f32;
                for (mean, action) in means.chunks_exact(action_dim).zip(actions.chunks_exact_mut(action_dim)) {
                    total += volley_policy::gaussian::sample(mean, log_std, false, &mut rng, action);
                }
                std::hint::black_box(total)
            })
        });
    }
    group.finish();
}

/// MinAtar Breakout with the MinAtar network (3×3 conv, 16 filters, then 128 ReLU units): the
/// actor path for image observations (issue 15).
fn minatar_conv_spec(segment_len: usize) -> RunSpec {
    let env = EnvConfig::Minatar(MinatarConfig::new(MinatarGame::Breakout));
    let (_, n_actions) = env.spaces().expect("minatar spaces");
    let [channels, height, width] = env.image_shape().expect("minatar observations are images");
    RunSpec {
        run: RunId::new("bench").expect("valid run id"),
        env,
        policy: PolicySpec::mlp(0, n_actions, &[128], Activation::Relu)
            .with_conv(ConvSpec::minatar(channels, height, width)),
        segment_len,
        hyper: HyperParams::default(),
        seed: 7,
    }
}

fn actor_path_minatar_conv(c: &mut Criterion) {
    let mut group = c.benchmark_group("actor_agent_steps");
    group.sample_size(10).measurement_time(std::time::Duration::from_secs(3));
    let segment_len = 32;
    for n_envs in [8usize, 64] {
        let spec = minatar_conv_spec(segment_len);
        let layout = ParamLayout::new(&spec.policy).expect("valid policy");
        let weights = Arc::new(Weights::new(PolicyVersion(1), layout.hash(), layout.init_params(3)));
        let mut worker = RolloutWorker::new(
            spec,
            ActorId::new("bench").expect("valid actor id"),
            n_envs,
            11,
            Arc::new(ActorCounters::default()),
        )
        .expect("minatar actor");
        worker.set_weights(weights).expect("matching weights");
        group.throughput(Throughput::Elements((segment_len * n_envs) as u64));
        group.bench_with_input(BenchmarkId::new("minatar_breakout_conv_encode", n_envs), &n_envs, |b, _| {
            b.iter(|| {
                let segments = worker.collect_segments();
                let bytes: usize = segments.iter().map(|s| encode_segment(s).len()).sum();
                std::hint::black_box(bytes)
            })
        });
    }
    group.finish();
}

/// The policy side of an actor step with the Nature-DQN network (issue 44 item 4): a batch of
/// 84×84×4 frames of 8-bit pixels (as `f32`, scaled by 1/255 inside the network) through the
/// three convs, 512 ReLU units and the heads, then one categorical draw per agent; one thread,
/// batches of 1 and 8 environments. The peer is `bench/peers/torch_actor_nature.py`.
fn nature_policy_step(c: &mut Criterion) {
    use rand::SeedableRng;
    let mut group = c.benchmark_group("actor_nature_policy_steps");
    group.sample_size(10).measurement_time(std::time::Duration::from_secs(3));
    let n_actions = 6;
    let conv = ConvSpec { input: volley_policy::ConvInput::Pixels, ..ConvSpec::nature(4, 84, 84) };
    let policy = PolicySpec::mlp(0, n_actions, &[512], Activation::Relu).with_conv(conv);
    let layout = ParamLayout::new(&policy).expect("valid policy");
    let params = layout.init_params(3);
    for n in [1usize, 8] {
        let mut inference = volley_policy::PolicyInference::new(&layout, n);
        let obs: Vec<f32> = (0..n * policy.obs_dim).map(|i| ((i * 7919) % 256) as f32).collect();
        let (mut logits, mut values, mut actions) = (vec![0.0; n * n_actions], vec![0.0; n], vec![0u32; n]);
        let mut rng = rand::rngs::SmallRng::seed_from_u64(1);
        group.throughput(Throughput::Elements(n as u64));
        group.bench_function(BenchmarkId::new("frames84x84x4_nature", n), |b| {
            b.iter(|| {
                inference.forward(&params, &obs, n, &mut [], &mut logits, &mut values);
                for (row, action) in logits.chunks_exact(n_actions).zip(actions.iter_mut()) {
                    let (a, _) = volley_policy::distributions::sample_categorical_with_rng(row, &mut rng)
                        .expect("finite logits");
                    *action = a as u32;
                }
                std::hint::black_box(&actions);
            })
        });
    }
    group.finish();
}

criterion_group!(benches, actor_path, gaussian_policy_step, actor_path_minatar_conv, nature_policy_step);
criterion_main!(benches);
