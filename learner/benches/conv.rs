//! Learner throughput with conv torsos (issue 15): samples per second of one whole V-trace
//! update (forward over T+1 steps, loss, backward, clipping, Adam) for the MinAtar network
//! (Breakout's 4×10×10 planes, one 3×3 conv with 16 filters, 128 ReLU units) and the
//! Nature-DQN network (4×84×84 frames, three convs, 512 units), on the CPU backend and, where a
//! device works, on CUDA.
//!
//! `cargo bench -p volley-learner --bench conv` (add `-- --quick` for the MinAtar rows only).
//! Prints a Markdown table. The CPU backend is single-threaded.

use std::time::Instant;

use rand::{Rng, SeedableRng};
use rand_pcg::Pcg64Mcg;
use volley_core::ids::{PolicyVersion, RunId};
use volley_core::spec::{HyperParams, LossKind, RunSpec};
use volley_env::{EnvConfig, EnvServiceName, MinatarConfig, MinatarGame, RemoteEnvConfig};
use volley_learner::backend::{open_cuda, CudaDevice};
use volley_learner::batch::SegmentBatch;
use volley_learner::Learner;
use volley_policy::{Activation, ConvSpec, PolicySpec};

/// The two presets with an environment of matching shape (a declared remote environment for
/// 84×84 frames, which is never contacted: the learner only checks the declared spaces).
fn spec(preset: &str, t_len: usize, b_len: usize) -> RunSpec {
    let (env, policy) = match preset {
        "minatar" => {
            let env = EnvConfig::Minatar(MinatarConfig::new(MinatarGame::Breakout));
            let n_actions = env.spaces().expect("minatar spaces").1;
            let policy =
                PolicySpec::mlp(0, n_actions, &[128], Activation::Relu).with_conv(ConvSpec::minatar(4, 10, 10));
            (env, policy)
        }
        _ => {
            let service = EnvServiceName::new("frames").expect("valid service name");
            let env = EnvConfig::Remote(RemoteEnvConfig::new(service, 4 * 84 * 84, 6));
            let policy = PolicySpec::mlp(0, 6, &[512], Activation::Relu).with_conv(ConvSpec::nature(4, 84, 84));
            (env, policy)
        }
    };
    RunSpec {
        run: RunId::new("bench").expect("valid run id"),
        env,
        policy,
        segment_len: t_len,
        hyper: HyperParams {
            loss: LossKind::Vtrace,
            batch_segments: b_len,
            learning_rate: 1e-4,
            final_learning_rate: 1e-4,
            ..HyperParams::default()
        },
        seed: 5,
    }
}

fn batch(rng: &mut Pcg64Mcg, obs_dim: usize, n_actions: usize, t_len: usize, b_len: usize) -> SegmentBatch {
    let steps = t_len * b_len;
    SegmentBatch {
        t_len,
        b_len,
        obs_dim,
        hidden_size: 0,
        observations: (0..(t_len + 1) * b_len * obs_dim).map(|_| f32::from(u8::from(rng.random_bool(0.1)))).collect(),
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

fn median(mut xs: Vec<f64>) -> f64 {
    xs.sort_by(f64::total_cmp);
    xs[xs.len() / 2]
}

/// Median seconds per update over at least 3 updates and about a second.
fn seconds_per_update(device: Option<&CudaDevice>, preset: &str, t_len: usize, b_len: usize) -> f64 {
    let spec = spec(preset, t_len, b_len);
    let (obs_dim, n_actions) = (spec.policy.obs_dim, spec.policy.n_actions);
    let mut learner = Learner::new(spec).expect("valid spec");
    if let Some(device) = device {
        learner.use_cuda_device(device).expect("the device opened once already");
    }
    let batch = batch(&mut Pcg64Mcg::seed_from_u64(1), obs_dim, n_actions, t_len, b_len);
    learner.update(&batch); // warm-up: allocation, cuBLAS heuristics
    let mut wall = Vec::new();
    let started = Instant::now();
    while wall.len() < 3 || (wall.len() < 50 && started.elapsed().as_secs_f64() < 1.0) {
        let t0 = Instant::now();
        learner.update(&batch);
        wall.push(t0.elapsed().as_secs_f64());
    }
    median(wall)
}

fn main() {
    let quick = std::env::args().any(|a| a == "--quick");
    let device = match open_cuda(0) {
        Ok(device) => Some(device),
        Err(err) => {
            println!("CUDA: not measured ({err})");
            None
        }
    };
    println!("| backend | network | T | B | samples/s | update ms |");
    println!("|---|---|---|---|---|---|");
    let mut configs = vec![("minatar", 32, 8), ("minatar", 32, 32)];
    if !quick {
        configs.push(("nature", 20, 8));
    }
    let mut backends: Vec<Option<&CudaDevice>> = vec![None];
    backends.extend(device.as_ref().map(Some));
    for backend in backends {
        for &(preset, t_len, b_len) in &configs {
            let secs = seconds_per_update(backend, preset, t_len, b_len);
            let name = if backend.is_some() { "cuda" } else { "cpu" };
            println!(
                "| {name} | {preset} | {t_len} | {b_len} | {:.0} | {:.1} |",
                (t_len * b_len) as f64 / secs,
                secs * 1e3
            );
        }
    }
}
