//! Raw environment throughput: CartPole-v1 steps per second on one core, through
//! [`VecEnv`] (with auto-reset, finiteness checks and episode statistics) and as a bare scalar
//! loop. Actions are precomputed pseudo-random bits so the policy costs nothing.
//!
//! Run with `cargo bench -p volley-env --bench env`.

use std::hint::black_box;
use std::time::Duration;

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use volley_env::{CartPole, Env, VecEnv, VecStep};

/// Vec steps of precomputed actions to cycle through.
const N_ACTION_STEPS: usize = 256;

/// Pseudo-random 0/1 actions (SplitMix64 bits), `[N_ACTION_STEPS][n_envs]`.
fn precomputed_actions(n_envs: usize) -> Vec<usize> {
    let mut z: u64 = 0x5EED;
    (0..N_ACTION_STEPS * n_envs)
        .map(|_| {
            z = z.wrapping_add(0x9E37_79B9_7F4A_7C15);
            let mut x = z;
            x = (x ^ (x >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
            x = (x ^ (x >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
            ((x ^ (x >> 31)) & 1) as usize
        })
        .collect()
}

fn bench_cartpole(c: &mut Criterion) {
    let mut group = c.benchmark_group("cartpole");
    group.measurement_time(Duration::from_secs(3));
    group.warm_up_time(Duration::from_secs(1));
    group.sample_size(20);

    for n_envs in [64usize] {
        let actions = precomputed_actions(n_envs);
        group.throughput(Throughput::Elements(n_envs as u64));

        let mut envs = VecEnv::new(vec![CartPole::new(); n_envs], 0).expect("cartpole resets");
        let mut out = VecStep::new(n_envs, envs.obs_dim());
        let mut step_idx = 0;
        group.bench_function(BenchmarkId::new("vec_env_step", n_envs), |b| {
            b.iter(|| {
                let row = &actions[step_idx * n_envs..(step_idx + 1) * n_envs];
                step_idx = (step_idx + 1) % N_ACTION_STEPS;
                envs.step(black_box(row), &mut out).expect("actions match n_envs");
                black_box(&out.rewards);
            })
        });

        let mut scalar_envs = vec![CartPole::new(); n_envs];
        let mut obs = vec![0.0f32; n_envs * 4];
        for (env_idx, (env, row)) in scalar_envs.iter_mut().zip(obs.chunks_exact_mut(4)).enumerate() {
            env.reset(env_idx as u64, row).expect("cartpole resets");
        }
        let mut step_idx = 0;
        group.bench_function(BenchmarkId::new("scalar_step", n_envs), |b| {
            b.iter(|| {
                let row = &actions[step_idx * n_envs..(step_idx + 1) * n_envs];
                step_idx = (step_idx + 1) % N_ACTION_STEPS;
                for ((env, obs_row), &action) in scalar_envs.iter_mut().zip(obs.chunks_exact_mut(4)).zip(row) {
                    let outcome = env.step(black_box(action), obs_row).expect("live episode");
                    if outcome.done() {
                        env.reset_next(obs_row).expect("cartpole resets");
                    }
                }
                black_box(&obs);
            })
        });
    }
    group.finish();
}

criterion_group!(benches, bench_cartpole);
criterion_main!(benches);
