//! Learner throughput per backend: samples per second of one whole V-trace update (forward over
//! T+1 steps, loss, backward, clipping, Adam) for MLPs of 64×64, 256×256 and 1024×1024 at
//! T ∈ {20, 80} and B ∈ {32, 256, 2048}, plus a PPO row; on CUDA also the split between the
//! host-to-device copy, the kernels and the read-back (CUDA events), the FLOP rate of the
//! network's matrix products against the GPU's f32 peak, and the V-trace scan's bandwidth
//! against a device-to-device copy.
//!
//! `cargo bench -p volley-learner --bench backend` (add `-- --quick` for fewer sizes,
//! `-- --peak-tflops X` for another GPU's f32 peak; the default 67 is the H100/H200 SXM
//! datasheet figure). Prints a Markdown table and writes the rows as JSON lines to
//! `$VOLLEY_BENCH_OUT` when set. Without a usable CUDA device the CUDA rows say why.
//!
//! The network takes CartPole-shaped inputs (4 observations, 2 actions; the run spec checks them
//! against the env), so the two hidden layers carry nearly all the work.
//!
//! The CPU backend is single-threaded; its rows are limited to updates of at most ~2·10¹⁰
//! FLOP so the run stays short.

mod common;
use common::median;

use std::io::Write;
use std::time::Instant;

use rand::{Rng, SeedableRng};
use rand_pcg::Pcg64Mcg;
use volley_core::spec::{LossKind, RunSpec};
use volley_core::wire::Observations;
use volley_env::EnvConfig;
use volley_learner::backend::{open_cuda, CudaDevice};
use volley_learner::batch::SegmentBatch;
use volley_learner::Learner;
use volley_policy::{Activation, PolicySpec};

const OBS_DIM: usize = 4;
const N_ACTIONS: usize = 2;

fn spec(width: usize, loss: LossKind, t_len: usize, b_len: usize) -> RunSpec {
    let policy = PolicySpec::mlp(OBS_DIM, N_ACTIONS, &[width, width], Activation::Tanh);
    common::spec(EnvConfig::Cartpole, policy, loss, t_len, b_len)
}

/// A batch of random observations in `[−1, 1)`.
fn batch(rng: &mut Pcg64Mcg, spec: &RunSpec) -> SegmentBatch {
    let n_obs = (spec.segment_len + 1) * spec.hyper.batch_segments * OBS_DIM;
    let observations = Observations::F32((0..n_obs).map(|_| rng.random_range(-1.0..1.0)).collect());
    common::batch(rng, spec, observations)
}

/// Multiply-adds of one forward row of the bench network.
fn macs_per_row(width: usize) -> f64 {
    (OBS_DIM * width + width * width + width * (N_ACTIONS + 1)) as f64
}

/// FLOP of one update: forward over (T+1)·B rows, backward (≈ 2× forward) over the same rows
/// (V-trace), or per PPO epoch over T·B rows.
fn update_flops(width: usize, loss: LossKind, t_len: usize, b_len: usize, epochs: usize) -> f64 {
    let rows = ((t_len + 1) * b_len) as f64;
    let per_row = 2.0 * macs_per_row(width);
    match loss {
        LossKind::Vtrace => 3.0 * rows * per_row,
        LossKind::Ppo => rows * per_row + 3.0 * (t_len * b_len * epochs) as f64 * per_row,
    }
}

struct Row {
    backend: String,
    width: usize,
    loss: LossKind,
    t_len: usize,
    b_len: usize,
    samples_per_s: f64,
    update_ms: f64,
    h2d_ms: Option<f64>,
    compute_ms: Option<f64>,
    d2h_ms: Option<f64>,
    tflops: f64,
}

fn measure(
    device: Option<&CudaDevice>,
    width: usize,
    loss: LossKind,
    t_len: usize,
    b_len: usize,
    max_updates: usize,
) -> Row {
    let spec = spec(width, loss, t_len, b_len);
    let epochs = spec.hyper.ppo_epochs as usize;
    let mut rng = Pcg64Mcg::seed_from_u64(1);
    let batch = batch(&mut rng, &spec);
    let mut learner = Learner::new(spec).expect("valid spec");
    if let Some(device) = device {
        learner.use_cuda_device(device).expect("the device opened once already");
        learner.set_profiling(true).expect("events");
    }
    for _ in 0..2 {
        learner.update(&batch); // warm-up: allocation, cuBLAS heuristics
    }
    let (mut wall, mut h2d, mut compute, mut d2h) = (Vec::new(), Vec::new(), Vec::new(), Vec::new());
    let started = Instant::now();
    while wall.len() < max_updates && (wall.len() < 3 || started.elapsed().as_secs_f64() < 1.0) {
        let t0 = Instant::now();
        learner.update(&batch);
        wall.push(t0.elapsed().as_secs_f64());
        if let Some(timing) = learner.last_timing() {
            h2d.push(f64::from(timing.h2d_ms));
            compute.push(f64::from(timing.compute_ms));
            d2h.push(f64::from(timing.d2h_ms));
        }
    }
    let update_s = median(wall);
    let compute_ms = (!compute.is_empty()).then(|| median(compute.clone()));
    let flops = update_flops(width, loss, t_len, b_len, epochs);
    Row {
        backend: if device.is_some() { "cuda".into() } else { "cpu".into() },
        width,
        loss,
        t_len,
        b_len,
        samples_per_s: (t_len * b_len) as f64 / update_s,
        update_ms: update_s * 1e3,
        h2d_ms: (!h2d.is_empty()).then(|| median(h2d)),
        compute_ms,
        d2h_ms: (!d2h.is_empty()).then(|| median(d2h)),
        // FLOP rate over the kernels' time on the GPU, over the whole update on the CPU.
        tflops: flops / (compute_ms.map_or(update_s, |ms| ms * 1e-3)) / 1e12,
    }
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let quick = args.iter().any(|a| a == "--quick");
    let peak_tflops: f64 = args
        .iter()
        .position(|a| a == "--peak-tflops")
        .and_then(|i| args.get(i + 1))
        .and_then(|v| v.parse().ok())
        .unwrap_or(67.0);
    let device = match open_cuda(0) {
        Ok(device) => {
            println!("CUDA device: {}", device.description());
            Some(device)
        }
        Err(err) => {
            println!("CUDA: not measured ({err})");
            None
        }
    };
    let widths: &[usize] = if quick { &[64, 1024] } else { &[64, 256, 1024] };
    let t_lens: &[usize] = if quick { &[20] } else { &[20, 80] };
    let b_lens: &[usize] = if quick { &[32, 2048] } else { &[32, 256, 2048] };
    let mut rows = Vec::new();
    println!(
        "| backend | loss | MLP | T | B | samples/s | update ms | H2D ms | kernels ms | D2H ms | TFLOP/s | % of f32 peak |"
    );
    println!("|---|---|---|---|---|---|---|---|---|---|---|---|");
    let mut configs: Vec<(usize, LossKind, usize, usize)> = Vec::new();
    for &width in widths {
        for &t_len in t_lens {
            for &b_len in b_lens {
                configs.push((width, LossKind::Vtrace, t_len, b_len));
            }
        }
    }
    configs.push((256, LossKind::Ppo, 20, 256));
    configs.push((1024, LossKind::Ppo, 80, 2048));
    for (width, loss, t_len, b_len) in configs {
        let flops = update_flops(width, loss, t_len, b_len, 2);
        let mut backends: Vec<Option<&CudaDevice>> = Vec::new();
        if flops <= 2e10 {
            backends.push(None);
        }
        if let Some(device) = device.as_ref() {
            backends.push(Some(device));
        }
        for backend in backends {
            let row = measure(backend, width, loss, t_len, b_len, if backend.is_some() { 50 } else { 10 });
            let fmt = |x: Option<f64>| x.map_or("–".to_string(), |v| format!("{v:.3}"));
            println!(
                "| {} | {:?} | {w}×{w} | {} | {} | {:.0} | {:.3} | {} | {} | {} | {:.2} | {} |",
                row.backend,
                row.loss,
                row.t_len,
                row.b_len,
                row.samples_per_s,
                row.update_ms,
                fmt(row.h2d_ms),
                fmt(row.compute_ms),
                fmt(row.d2h_ms),
                row.tflops,
                if row.backend == "cuda" { format!("{:.1}", 100.0 * row.tflops / peak_tflops) } else { "–".into() },
                w = row.width,
            );
            rows.push(row);
        }
    }
    if let Some(device) = device.as_ref() {
        println!();
        println!("| V-trace scan | T | B | µs | GB/s | % of copy bandwidth |");
        println!("|---|---|---|---|---|---|");
        let copy = device.time_copy(2 << 30, 10).expect("copy timing");
        for &(t_len, b_len) in &[(80, 2048), (80, 65_536), (80, 1 << 20), (20, 1 << 22)] {
            let scan = device.time_vtrace_scan(t_len, b_len, 10).expect("scan timing");
            println!(
                "| scan | {t_len} | {b_len} | {:.1} | {:.0} | {:.0} |",
                scan.ms * 1e3,
                scan.gbps(),
                100.0 * scan.gbps() / copy.gbps()
            );
        }
        println!("device-to-device copy of 2 GiB: {:.0} GB/s (read + write)", copy.gbps());
    }
    if let Ok(path) = std::env::var("VOLLEY_BENCH_OUT") {
        let mut file = std::fs::File::create(&path).expect("bench output file");
        for row in &rows {
            writeln!(
                file,
                "{{\"backend\":\"{}\",\"loss\":\"{:?}\",\"width\":{},\"t\":{},\"b\":{},\"samples_per_s\":{:.1},\"update_ms\":{:.4},\"h2d_ms\":{},\"compute_ms\":{},\"d2h_ms\":{},\"tflops\":{:.4}}}",
                row.backend,
                row.loss,
                row.width,
                row.t_len,
                row.b_len,
                row.samples_per_s,
                row.update_ms,
                row.h2d_ms.map_or("null".into(), |v| format!("{v:.4}")),
                row.compute_ms.map_or("null".into(), |v| format!("{v:.4}")),
                row.d2h_ms.map_or("null".into(), |v| format!("{v:.4}")),
                row.tflops
            )
            .expect("write");
        }
    }
}
