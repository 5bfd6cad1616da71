//! Learner throughput with conv torsos (issue 15): samples per second of one whole V-trace
//! update (forward over T+1 steps, loss, backward, clipping, Adam) for the MinAtar network
//! (Breakout's 4×10×10 planes, one 3×3 conv with 16 filters, 128 ReLU units) and the
//! Nature-DQN network (4×84×84 frames, three convs, 512 units), on the CPU backend and, where a
//! device works, on CUDA.
//!
//! `cargo bench -p volley-learner --bench conv` (add `-- --quick` for the MinAtar rows only,
//! `-- --threads 1,2` for the CPU backend's thread counts, default 1 and every core the process
//! may use; `-- --obs u8,f32` for how the batch holds its observations, default both: `u8`
//! frames converted in the first layer, issue 44 item 3, or `f32` as before it; `--presets
//! nature` (or `--networks nature`) and `--batches 32` to run only those rows, `--no-peak` to skip
//! the peak measurement, `--phases` for the Nature-DQN update's time per phase instead). Each row
//! gives the bytes of the batch's observations, and the last line the process's peak resident
//! memory (`VmHWM`). Prints a Markdown table with the arithmetic rate of each update (2 FLOP per
//! multiply-add of the forward and the backward products) beside the f32 peak of the threads it
//! ran on, measured first by an FMA loop (see [`fma_peak_gflops`]).

mod common;
use common::median;

use std::time::Instant;

use rand::{Rng, SeedableRng};
use rand_pcg::Pcg64Mcg;
use volley_core::spec::{LossKind, RunSpec};
use volley_core::wire::{ObsElement, Observations};
use volley_env::{EnvConfig, EnvServiceName, MinatarConfig, MinatarGame, RemoteEnvConfig};
use volley_learner::backend::{
    open_cuda, Backend, Col2im, CpuBackend, CudaDevice, DenseForward, Im2col, MatmulDw, MatmulDx, View, ViewMut,
};
use volley_learner::batch::SegmentBatch;
use volley_learner::net::KEPT_UNFOLDINGS_BYTES;
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
    common::spec(env, policy, LossKind::Vtrace, t_len, b_len)
}

/// A batch of byte-valued observations (MinAtar's planes; frames for the Nature network) held
/// as `element`.
fn batch(rng: &mut Pcg64Mcg, spec: &RunSpec, element: ObsElement) -> SegmentBatch {
    let n_obs = (spec.segment_len + 1) * spec.hyper.batch_segments * spec.policy.obs_dim;
    let bytes: Vec<u8> = (0..n_obs).map(|_| u8::from(rng.random_bool(0.1))).collect();
    let observations = match element {
        ObsElement::U8 => Observations::U8(bytes),
        ObsElement::F32 => Observations::F32(bytes.iter().map(|&b| f32::from(b)).collect()),
    };
    common::batch(rng, spec, observations)
}

/// Multiply-adds of one update per row of the batch (`(T + 1)·B` rows): the forward products,
/// the weight-gradient products (as many) and the input-gradient products of every layer but
/// the first conv layer, whose input gradient is never formed.
fn macs_per_row(spec: &RunSpec) -> f64 {
    let layout = spec.validate().expect("valid spec");
    let conv = layout.conv_geometries();
    let conv_macs: Vec<f64> =
        conv.iter().map(|g| (g.out_positions() * g.patch_len() * g.out_channels) as f64).collect();
    let mut n_in = conv.last().map_or(spec.policy.obs_dim, |g| g.output_len());
    let mut dense = 0.0;
    for &n_out in spec.policy.torso.iter().chain([spec.policy.n_actions + 1].iter()) {
        dense += (n_in * n_out) as f64;
        n_in = n_out;
    }
    let forward = conv_macs.iter().sum::<f64>() + dense;
    3.0 * forward - conv_macs.first().copied().unwrap_or(0.0)
}

/// This machine's f32 peak on one core, in GFLOP/s: the best of five short runs of twelve
/// independent chains of 16-lane (AVX-512F) or 8-lane (AVX2) fused multiply-adds, enough to
/// cover the FMA latency on both FMA ports. The best run is the one the scheduler left alone.
fn fma_peak_gflops() -> Option<f64> {
    #[cfg(target_arch = "x86_64")]
    {
        use std::arch::x86_64::*;
        const CHAINS: usize = 12;
        const ITERS: usize = 20_000_000;
        // `CHAINS` independent chains of `ITERS` steps `chain = chain · a + b` on the vectors
        // `$set1` makes, each step one `$fmadd`.
        macro_rules! fma_chains {
            ($set1:ident, $fmadd:ident) => {{
                let (a, b) = ($set1(0.999_999), $set1(1e-7));
                let mut acc = [$set1(1.0); CHAINS];
                for _ in 0..ITERS {
                    for chain in acc.iter_mut() {
                        *chain = $fmadd(*chain, a, b);
                    }
                }
                acc
            }};
        }
        #[target_feature(enable = "avx512f")]
        fn avx512() -> f32 {
            fma_chains!(_mm512_set1_ps, _mm512_fmadd_ps).iter().map(|&v| _mm512_reduce_add_ps(v)).sum()
        }
        #[target_feature(enable = "avx2,fma")]
        fn avx2() -> f32 {
            let mut lanes = [0.0f32; 8];
            fma_chains!(_mm256_set1_ps, _mm256_fmadd_ps)
                .iter()
                .map(|&v| {
                    // SAFETY: `lanes` holds 8 floats, what one unaligned 256-bit store writes.
                    unsafe { _mm256_storeu_ps(lanes.as_mut_ptr(), v) };
                    lanes.iter().sum::<f32>()
                })
                .sum()
        }
        let (lanes, run): (usize, fn() -> f32) = if is_x86_feature_detected!("avx512f") {
            // SAFETY: the CPU has AVX-512F (checked just above).
            (16, || unsafe { avx512() })
        } else if is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma") {
            // SAFETY: the CPU has AVX2 and FMA (checked just above).
            (8, || unsafe { avx2() })
        } else {
            return None;
        };
        let best = (0..5)
            .map(|_| {
                let t0 = Instant::now();
                std::hint::black_box(run());
                t0.elapsed().as_secs_f64()
            })
            .fold(f64::INFINITY, f64::min);
        Some((ITERS * CHAINS * lanes * 2) as f64 / best / 1e9)
    }
    #[cfg(not(target_arch = "x86_64"))]
    None
}

/// Median seconds per update over at least 3 updates and about a second, and the bytes of the
/// batch's observations.
fn seconds_per_update(device: Option<&CudaDevice>, threads: usize, spec: RunSpec, element: ObsElement) -> (f64, usize) {
    let batch = batch(&mut Pcg64Mcg::seed_from_u64(1), &spec, element);
    let mut learner = Learner::new(spec).expect("valid spec");
    match device {
        Some(device) => learner.use_cuda_device(device).expect("the device opened once already"),
        None => learner.set_cpu_threads(threads).expect("a thread pool"),
    }
    learner.update(&batch); // warm-up: allocation, cuBLAS heuristics
    let mut wall = Vec::new();
    let started = Instant::now();
    while wall.len() < 3 || (wall.len() < 50 && started.elapsed().as_secs_f64() < 1.0) {
        let t0 = Instant::now();
        learner.update(&batch);
        wall.push(t0.elapsed().as_secs_f64());
    }
    (median(wall), batch.observations.size_bytes())
}

/// The values of a comma-separated list flag, or `default`.
fn list_flag<T>(args: &[String], flag: &str, default: Vec<T>, parse: impl Fn(&str) -> T) -> Vec<T> {
    match args.iter().position(|a| a == flag) {
        Some(i) => args.get(i + 1).unwrap_or_else(|| panic!("{flag} takes a list")).split(',').map(parse).collect(),
        None => default,
    }
}

/// The process's peak resident memory in MiB (`VmHWM` of `/proc/self/status`).
fn peak_rss_mib() -> Option<f64> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let line = status.lines().find(|line| line.starts_with("VmHWM:"))?;
    let kib: f64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kib / 1024.0)
}

/// Median milliseconds of `op` over `reps` calls after one warm-up call.
fn median_ms(reps: usize, mut op: impl FnMut()) -> f64 {
    op();
    median(
        (0..reps)
            .map(|_| {
                let t0 = Instant::now();
                op();
                t0.elapsed().as_secs_f64() * 1e3
            })
            .collect(),
    )
}

/// One row of the phase table: its name, milliseconds and multiply-adds.
struct Phase {
    name: String,
    ms: f64,
    macs: f64,
}

/// One layer's product as the network runs it: `rows` rows of `n_in` inputs to `n_out` outputs
/// (a conv layer's output positions over its unfolded patches, or a dense layer's images).
#[derive(Clone, Copy)]
struct Product {
    rows: usize,
    n_in: usize,
    n_out: usize,
}

type Cpu = CpuBackend;

impl Product {
    /// Multiply-adds of one product.
    fn macs(self) -> f64 {
        (self.rows * self.n_in * self.n_out) as f64
    }

    /// `y = ReLU(x Wᵀ + b)`.
    fn forward(self, backend: &mut Cpu, x: View<'_, Cpu>, (weight, bias): &(Vec<f32>, Vec<f32>), y: &mut Vec<f32>) {
        let (weight, bias, y) = (View::of(weight), View::of(bias), ViewMut::of(y));
        let Product { rows, n_in, n_out } = self;
        let op = DenseForward { x, rows, n_in, weight, bias, n_out, act: Some(Activation::Relu), y };
        backend.dense_forward(op).expect("shapes")
    }

    /// The weight gradient `dYᵀ X` and the bias sums of `dY`.
    fn weight_gradient(
        self,
        backend: &mut Cpu,
        dy: &Vec<f32>,
        x: View<'_, Cpu>,
        dw: &mut Vec<f32>,
        d_bias: &mut Vec<f32>,
    ) {
        let Product { rows, n_in, n_out } = self;
        backend.matmul_dw(MatmulDw { dy: View::of(dy), x, rows, n_out, n_in, dw: ViewMut::of(dw) }).expect("shapes");
        backend.column_sums(View::of(dy), rows, ViewMut::range(d_bias, 0..n_out)).expect("shapes");
    }

    /// The input gradient `dY W`, overwriting `dx`.
    fn input_gradient(self, backend: &mut Cpu, dy: &Vec<f32>, weight: &Vec<f32>, dx: ViewMut<'_, Cpu>) {
        let Product { rows, n_in, n_out } = self;
        let op = MatmulDx { dy: View::of(dy), rows, n_out, weight: View::of(weight), n_in, dx, accumulate: false };
        backend.matmul_dx(op).expect("shapes")
    }
}

/// The Nature-DQN update's conv and dense phases, each timed alone on the CPU backend with the
/// shapes and calls of the learner's network (`net.rs`) over `(T + 1)·B` images: per layer the
/// forward `im2col` and product (with bias and ReLU), and backward the ReLU mask, the unfolding
/// again (only for the layers whose forward unfolding the network does not keep,
/// [`KEPT_UNFOLDINGS_BYTES`]), the weight-gradient product, the bias sums, the input-gradient
/// product and `col2im`.
/// The rest of a whole update (the heads, loss, clipping, Adam, batch packing) is the whole
/// update's time less these.
fn phases(threads: usize, t_len: usize, b_len: usize, peak: Option<f64>) {
    let spec = spec("nature", t_len, b_len);
    let whole_ms = seconds_per_update(None, threads, spec.clone(), ObsElement::F32).0 * 1e3;
    let geometries = spec.validate().expect("valid spec").conv_geometries().to_vec();
    let mut backend = CpuBackend::with_threads(threads).expect("a thread pool");
    let images = (t_len + 1) * b_len;
    let mut rng = Pcg64Mcg::seed_from_u64(3);
    let mut random =
        |len: usize, scale: f32| -> Vec<f32> { (0..len).map(|_| rng.random_range(-scale..scale)).collect() };
    let reps = 5;
    let mut rows: Vec<Phase> = Vec::new();
    let obs: Vec<f32> = (0..images * geometries[0].input_len()).map(|i| ((i * 7919) % 256) as f32 / 255.0).collect();
    let widest = geometries.iter().map(|g| g.cols_len()).max().expect("three layers") * images;
    let mut cols = vec![0.0f32; widest];
    let mut d_cols = vec![0.0f32; widest];
    let mut outputs: Vec<Vec<f32>> = Vec::new();
    let mut weights: Vec<(Vec<f32>, Vec<f32>)> = Vec::new();
    for (i, g) in geometries.iter().enumerate() {
        let product = Product { rows: images * g.out_positions(), n_in: g.patch_len(), n_out: g.out_channels };
        let layer = (random(product.n_out * product.n_in, 0.05), random(product.n_out, 0.05));
        let cols_len = images * g.cols_len();
        let input = if i == 0 { &obs } else { &outputs[i - 1] };
        rows.push(Phase {
            name: format!("conv {} forward: im2col", i + 1),
            ms: median_ms(reps, || {
                let cols = ViewMut::range(&mut cols, 0..cols_len);
                backend.im2col(Im2col { x: View::of(input), n: images, geometry: g, cols }).expect("shapes")
            }),
            macs: 0.0,
        });
        let mut y = vec![0.0f32; product.rows * product.n_out];
        rows.push(Phase {
            name: format!("conv {} forward: product, bias, ReLU", i + 1),
            ms: median_ms(reps, || product.forward(&mut backend, View::range(&cols, 0..cols_len), &layer, &mut y)),
            macs: product.macs(),
        });
        outputs.push(y);
        weights.push(layer);
    }
    let (n_in, n_hidden) = (geometries[2].output_len(), spec.policy.torso[0]);
    let dense = Product { rows: images, n_in, n_out: n_hidden };
    let dense_layer = (random(n_hidden * n_in, 0.02), random(n_hidden, 0.02));
    let mut hidden = vec![0.0f32; images * n_hidden];
    rows.push(Phase {
        name: format!("dense {n_in}→{n_hidden} forward"),
        ms: median_ms(reps, || dense.forward(&mut backend, View::of(&outputs[2]), &dense_layer, &mut hidden)),
        macs: dense.macs(),
    });
    let d_hidden = random(images * n_hidden, 0.01);
    let mut d_dense_w = vec![0.0f32; n_hidden * n_in];
    let mut d_bias = vec![0.0f32; 64.max(n_hidden)];
    rows.push(Phase {
        name: format!("dense {n_in}→{n_hidden} backward: weight gradient, bias sums"),
        ms: median_ms(reps, || {
            dense.weight_gradient(&mut backend, &d_hidden, View::of(&outputs[2]), &mut d_dense_w, &mut d_bias)
        }),
        macs: dense.macs(),
    });
    let mut d_y = vec![0.0f32; images * n_in];
    rows.push(Phase {
        name: format!("dense {n_in}→{n_hidden} backward: input gradient"),
        ms: median_ms(reps, || dense.input_gradient(&mut backend, &d_hidden, &dense_layer.0, ViewMut::of(&mut d_y))),
        macs: dense.macs(),
    });
    // The network keeps the forward's unfoldings from the last layer towards the first while
    // they fit in `KEPT_UNFOLDINGS_BYTES`.
    let mut kept_bytes = 0;
    for (i, g) in geometries.iter().enumerate().rev() {
        let product = Product { rows: images * g.out_positions(), n_in: g.patch_len(), n_out: g.out_channels };
        let cols_len = images * g.cols_len();
        kept_bytes += cols_len * std::mem::size_of::<f32>();
        let kept = kept_bytes <= KEPT_UNFOLDINGS_BYTES;
        let input = if i == 0 { &obs } else { &outputs[i - 1] };
        let mut d_pre = random(product.rows * product.n_out, 0.01);
        rows.push(Phase {
            name: format!("conv {} backward: ReLU mask", i + 1),
            ms: median_ms(reps, || {
                backend.act_backward(ViewMut::of(&mut d_pre), View::of(&outputs[i]), Activation::Relu).expect("shapes")
            }),
            macs: 0.0,
        });
        let mut unfold = || {
            let cols = ViewMut::range(&mut cols, 0..cols_len);
            backend.im2col(Im2col { x: View::of(input), n: images, geometry: g, cols }).expect("shapes")
        };
        if kept {
            // The network reads the forward's unfolding; the bench only refills its one buffer.
            unfold();
        } else {
            let ms = median_ms(reps, unfold);
            rows.push(Phase { name: format!("conv {} backward: im2col again", i + 1), ms, macs: 0.0 });
        }
        let mut d_w = vec![0.0f32; product.n_out * product.n_in];
        rows.push(Phase {
            name: format!("conv {} backward: weight gradient, bias sums", i + 1),
            ms: median_ms(reps, || {
                let x = View::range(&cols, 0..cols_len);
                product.weight_gradient(&mut backend, &d_pre, x, &mut d_w, &mut d_bias)
            }),
            macs: product.macs(),
        });
        if i > 0 {
            rows.push(Phase {
                name: format!("conv {} backward: input gradient", i + 1),
                ms: median_ms(reps, || {
                    let dx = ViewMut::range(&mut d_cols, 0..cols_len);
                    product.input_gradient(&mut backend, &d_pre, &weights[i].0, dx)
                }),
                macs: product.macs(),
            });
            let mut dx = vec![0.0f32; images * g.input_len()];
            rows.push(Phase {
                name: format!("conv {} backward: col2im", i + 1),
                ms: median_ms(reps, || {
                    let d_cols = View::range(&d_cols, 0..cols_len);
                    backend.col2im(Col2im { d_cols, n: images, geometry: g, dx: ViewMut::of(&mut dx) }).expect("shapes")
                }),
                macs: 0.0,
            });
        }
    }
    let timed: f64 = rows.iter().map(|r| r.ms).sum();
    println!(
        "Nature-DQN phases, T={t_len} B={b_len}, {threads} thread(s), {images} images; median of {reps} calls each"
    );
    println!("| phase | ms | % of update | GFLOP/s | % of f32 peak |");
    println!("|---|---|---|---|---|");
    let peak_of = |gflops: f64| peak.map_or("-".into(), |p| format!("{:.0} %", 100.0 * gflops / (p * threads as f64)));
    for row in &rows {
        let gflops = 2.0 * row.macs / row.ms / 1e6;
        let (gflops, of_peak) =
            if row.macs > 0.0 { (format!("{gflops:.1}"), peak_of(gflops)) } else { ("-".into(), "-".into()) };
        println!("| {} | {:.2} | {:.1} % | {gflops} | {of_peak} |", row.name, row.ms, 100.0 * row.ms / whole_ms);
    }
    println!(
        "| rest: heads, loss, clipping, Adam, packing | {:.2} | {:.1} % | - | - |",
        whole_ms - timed,
        100.0 * (whole_ms - timed) / whole_ms
    );
    println!("| whole update | {whole_ms:.2} | 100 % | - | - |");
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let quick = args.iter().any(|a| a == "--quick");
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    let thread_counts: Vec<usize> = match args.iter().position(|a| a == "--threads") {
        Some(i) => args
            .get(i + 1)
            .expect("--threads takes a list such as 1,2")
            .split(',')
            .map(|n| n.parse().expect("--threads: whole numbers"))
            .collect(),
        None if cores > 1 => vec![1, cores],
        None => vec![1],
    };
    let device = match open_cuda(0) {
        Ok(device) => Some(device),
        Err(err) => {
            println!("CUDA: not measured ({err})");
            None
        }
    };
    let peak = if args.iter().any(|a| a == "--no-peak") { None } else { fma_peak_gflops() };
    match peak {
        Some(peak) => println!("f32 peak of one core (FMA loop): {peak:.1} GFLOP/s"),
        None => println!("f32 peak: not measured (no AVX2/AVX-512 FMA)"),
    }
    if args.iter().any(|a| a == "--phases") {
        let batches = list_flag(&args, "--batches", vec![8], |b| b.parse::<usize>().expect("--batches: whole numbers"));
        for &threads in &thread_counts {
            for &b_len in &batches {
                phases(threads, 20, b_len, peak);
            }
        }
        return;
    }
    let elements = list_flag(&args, "--obs", vec![ObsElement::U8, ObsElement::F32], |name| match name {
        "u8" => ObsElement::U8,
        "f32" => ObsElement::F32,
        other => panic!("--obs: u8 or f32, not {other}"),
    });
    println!(
        "| backend | threads | network | obs | T | B | batch obs MB | samples/s | update ms | GFLOP/s | % of f32 peak |"
    );
    println!("|---|---|---|---|---|---|---|---|---|---|---|");
    let mut configs = vec![("minatar", 32, 8), ("minatar", 32, 32)];
    if !quick {
        configs.extend([("nature", 20, 8), ("nature", 20, 32)]);
    }
    let mut presets = list_flag(&args, "--presets", vec![], str::to_string);
    presets.extend(list_flag(&args, "--networks", vec![], str::to_string));
    let batches = list_flag(&args, "--batches", vec![], |n| n.parse::<usize>().expect("--batches: whole numbers"));
    if !presets.is_empty() {
        configs = vec![("minatar", 32, 8), ("minatar", 32, 32), ("nature", 20, 8), ("nature", 20, 32)];
        configs.retain(|(preset, _, _)| presets.iter().any(|p| p == preset));
    }
    configs.retain(|(_, _, b_len)| batches.is_empty() || batches.contains(b_len));
    let mut backends: Vec<(Option<&CudaDevice>, usize)> = thread_counts.iter().map(|&n| (None, n)).collect();
    backends.extend(device.as_ref().map(|d| (Some(d), 1)));
    for &(preset, t_len, b_len) in &configs {
        for (&(backend, threads), &element) in backends.iter().flat_map(|b| elements.iter().map(move |e| (b, e))) {
            let spec = spec(preset, t_len, b_len);
            let flop = 2.0 * macs_per_row(&spec) * ((t_len + 1) * b_len) as f64;
            let (secs, obs_bytes) = seconds_per_update(backend, threads, spec, element);
            let obs = match element {
                ObsElement::U8 => "u8",
                ObsElement::F32 => "f32",
            };
            let gflops = flop / secs / 1e9;
            let (name, of_peak) = match (backend, peak) {
                (None, Some(peak)) => ("cpu", format!("{:.0} %", 100.0 * gflops / (peak * threads as f64))),
                (None, None) => ("cpu", "-".into()),
                (Some(_), _) => ("cuda", "-".into()),
            };
            println!(
                "| {name} | {threads} | {preset} | {obs} | {t_len} | {b_len} | {:.2} | {:.0} | {:.1} | {gflops:.1} | {of_peak} |",
                obs_bytes as f64 / 1e6,
                (t_len * b_len) as f64 / secs,
                secs * 1e3
            );
        }
    }
    if let Some(mib) = peak_rss_mib() {
        println!("peak resident memory (VmHWM): {mib:.0} MiB");
    }
}
