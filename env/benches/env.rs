//! Raw environment throughput: CartPole-v1 steps per second on one core, through
//! [`VecEnv`] (with auto-reset, finiteness checks and episode statistics) and as a bare scalar
//! loop. Actions are precomputed pseudo-random bits so the policy costs nothing.
//!
//! Run with `cargo bench -p volley-env --bench env`.

use std::hint::black_box;
use std::time::Duration;

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use volley_env::minatar::{Asterix, Breakout, Freeway, Game, MinAtar, Seaquest, SpaceInvaders, CELLS};
use volley_env::{Action, Actions, CartPole, Env, VecEnv, VecStep};

/// Vec steps of precomputed actions to cycle through.
const N_ACTION_STEPS: usize = 256;

/// Pseudo-random 0/1 actions (SplitMix64 bits), `[N_ACTION_STEPS][n_envs]`.
fn precomputed_actions(n_envs: usize) -> Vec<usize> {
    precomputed_actions_below(n_envs, 2)
}

/// Pseudo-random actions in `0..n_actions` (SplitMix64), `[N_ACTION_STEPS][n_envs]`.
fn precomputed_actions_below(n_envs: usize, n_actions: usize) -> Vec<usize> {
    let mut z: u64 = 0x5EED;
    (0..N_ACTION_STEPS * n_envs)
        .map(|_| {
            z = z.wrapping_add(0x9E37_79B9_7F4A_7C15);
            let mut x = z;
            x = (x ^ (x >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
            x = (x ^ (x >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
            ((x ^ (x >> 31)) % n_actions as u64) as usize
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
                envs.step(Actions::Discrete(black_box(row)), &mut out).expect("actions match n_envs");
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
                    let outcome = env.step(Action::Discrete(black_box(action)), obs_row).expect("live episode");
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

/// One MinAtar game: `n_envs` environments stepped with uniformly random actions, resetting at
/// episode ends.
fn bench_minatar_game<G: Game>(c: &mut Criterion) {
    const N_ENVS: usize = 64;
    let mut group = c.benchmark_group(format!("minatar/{}", G::GAME.game_name()));
    group.measurement_time(Duration::from_secs(3));
    group.warm_up_time(Duration::from_secs(1));
    group.sample_size(20);
    group.throughput(Throughput::Elements(N_ENVS as u64));
    let template = MinAtar::<G>::with_defaults();
    let actions = precomputed_actions_below(N_ENVS, template.action_space().n_actions());

    let mut envs = VecEnv::new(vec![template.clone(); N_ENVS], 0).expect("minatar resets");
    let mut out = VecStep::new(N_ENVS, envs.obs_dim());
    let mut step_idx = 0;
    group.bench_function(BenchmarkId::new("vec_env_step_f32", N_ENVS), |b| {
        b.iter(|| {
            let row = &actions[step_idx * N_ENVS..(step_idx + 1) * N_ENVS];
            step_idx = (step_idx + 1) % N_ACTION_STEPS;
            envs.step(Actions::Discrete(black_box(row)), &mut out).expect("actions in range");
            black_box(&out.rewards);
        })
    });

    // The bare loop, as the Python reference is timed: step (which writes the observation) and
    // reset at episode ends.
    let dim = G::N_CHANNELS * CELLS;
    let mut scalar_envs = vec![template; N_ENVS];
    let mut obs = vec![0.0f32; N_ENVS * dim];
    for (env_idx, (env, obs_row)) in scalar_envs.iter_mut().zip(obs.chunks_exact_mut(dim)).enumerate() {
        env.reset(env_idx as u64, obs_row).expect("minatar resets");
    }
    let mut step_idx = 0;
    group.bench_function(BenchmarkId::new("scalar_step", N_ENVS), |b| {
        b.iter(|| {
            let row = &actions[step_idx * N_ENVS..(step_idx + 1) * N_ENVS];
            step_idx = (step_idx + 1) % N_ACTION_STEPS;
            for ((env, obs_row), &action) in scalar_envs.iter_mut().zip(obs.chunks_exact_mut(dim)).zip(row) {
                let outcome = env.step(Action::Discrete(black_box(action)), obs_row).expect("live episode");
                if outcome.done() {
                    env.reset_next(obs_row).expect("minatar resets");
                }
            }
            black_box(&obs);
        })
    });
    group.finish();
}

fn bench_minatar(c: &mut Criterion) {
    bench_minatar_game::<Asterix>(c);
    bench_minatar_game::<Breakout>(c);
    bench_minatar_game::<Freeway>(c);
    bench_minatar_game::<Seaquest>(c);
    bench_minatar_game::<SpaceInvaders>(c);
}

criterion_group!(benches, bench_cartpole, bench_minatar);
criterion_main!(benches);
