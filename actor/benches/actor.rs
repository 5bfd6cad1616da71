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
            conv: None,
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

criterion_group!(benches, actor_path, actor_path_minatar_conv);
criterion_main!(benches);
