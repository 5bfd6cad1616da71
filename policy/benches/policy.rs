//! Policy network throughput: actor inference (agent-steps/s) and learner forward + backward
//! (samples/s) for the CartPole-sized 64×64 tanh MLP, with and without a GRU(64) core; and
//! actor inference with the MinAtar and Nature conv presets over `f32` observations and over
//! the same frames as bytes (`forward_u8`, issue 44 item 3).
//!
//! Run with `cargo bench -p volley-policy --bench policy`; numbers go in docs/BENCHMARKS.md.
//! The project's targets are ≥ 1M agent-steps/s per core for inference and ≥ 1M samples/s on
//! two cores for the learner at T = 20, B = 32 (this bench is single-threaded).

use std::hint::black_box;
use std::time::Duration;

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use volley_policy::{Activation, ConvInput, ConvSpec, ParamLayout, PolicyInference, PolicySpec, PolicyTape};

const OBS_DIM: usize = 4;
const N_ACTIONS: usize = 2;
const TORSO: [usize; 2] = [64, 64];

/// Deterministic pseudo-random inputs in [-1, 1) without pulling an RNG into the bench.
fn inputs(n: usize, salt: u32) -> Vec<f32> {
    (0..n as u32)
        .map(|i| {
            let x = (i.wrapping_mul(2_654_435_761) ^ salt).wrapping_mul(2_246_822_519);
            (x >> 8) as f32 / (1u32 << 23) as f32 - 1.0
        })
        .collect()
}

fn bench_inference(c: &mut Criterion) {
    let spec = PolicySpec::mlp(OBS_DIM, N_ACTIONS, &TORSO, Activation::Tanh);
    let layout = ParamLayout::new(&spec).expect("valid spec");
    let params = layout.init_params(0);
    let mut group = c.benchmark_group("policy_inference_mlp64x64_tanh");
    for n in [1usize, 8, 16, 64, 256] {
        let mut inference = PolicyInference::new(&layout, n);
        let obs = inputs(n * OBS_DIM, 1);
        let mut logits = vec![0.0; n * N_ACTIONS];
        let mut values = vec![0.0; n];
        group.throughput(Throughput::Elements(n as u64));
        group.bench_with_input(BenchmarkId::new("forward", n), &n, |b, &n| {
            b.iter(|| {
                inference.forward(black_box(&params), black_box(&obs), n, &mut [], &mut logits, &mut values);
                black_box(&values);
            })
        });
    }
    group.finish();
}

/// One actor step over 8 environments with a conv torso: frames as `f32` rows (`forward`) and
/// the same frames as bytes (`forward_u8`).
fn bench_conv_inference(c: &mut Criterion) {
    let presets = [
        ("minatar", PolicySpec::mlp(0, 6, &[128], Activation::Relu).with_conv(ConvSpec::minatar(4, 10, 10))),
        (
            "nature",
            PolicySpec::mlp(0, 6, &[512], Activation::Relu)
                .with_conv(ConvSpec { input: ConvInput::Pixels, ..ConvSpec::nature(4, 84, 84) }),
        ),
    ];
    let n = 8;
    for (name, spec) in presets {
        let layout = ParamLayout::new(&spec).expect("valid spec");
        let params = layout.init_params(0);
        let mut group = c.benchmark_group(format!("policy_inference_conv_{name}"));
        group.throughput(Throughput::Elements(n as u64));
        let bytes: Vec<u8> = (0..n * spec.obs_dim).map(|i| (i.wrapping_mul(2_654_435_761) >> 11) as u8).collect();
        let floats: Vec<f32> = bytes.iter().map(|&b| f32::from(b)).collect();
        let mut inference = PolicyInference::new(&layout, n);
        let (mut logits, mut values) = (vec![0.0; n * 6], vec![0.0; n]);
        group.bench_function(BenchmarkId::new("f32", n), |b| {
            b.iter(|| {
                inference.forward(black_box(&params), black_box(&floats), n, &mut [], &mut logits, &mut values);
                black_box(&values);
            })
        });
        group.bench_function(BenchmarkId::new("u8", n), |b| {
            b.iter(|| {
                inference.forward_u8(black_box(&params), black_box(&bytes), n, &mut [], &mut logits, &mut values);
                black_box(&values);
            })
        });
        group.finish();
    }
}

fn bench_tape(c: &mut Criterion) {
    // T + 1 steps, as the learner runs one extra step for the bootstrap value.
    let (t_len, b_len) = (21usize, 32usize);
    let rows = t_len * b_len;
    let mut group = c.benchmark_group("policy_tape_forward_backward_t21_b32");
    group.throughput(Throughput::Elements(rows as u64));
    let specs = [
        ("mlp64x64_tanh", PolicySpec::mlp(OBS_DIM, N_ACTIONS, &TORSO, Activation::Tanh)),
        ("mlp64x64_tanh_gru64", PolicySpec::gru(OBS_DIM, N_ACTIONS, &TORSO, Activation::Tanh, 64)),
    ];
    for (name, spec) in specs {
        let layout = ParamLayout::new(&spec).expect("valid spec");
        let params = layout.init_params(0);
        let obs = inputs(rows * OBS_DIM, 2);
        let episode_start: Vec<f32> = (0..rows).map(|i| f32::from(i % 97 == 5)).collect();
        let h0 = inputs(b_len * layout.recurrent_size(), 3);
        let dlogits = inputs(rows * N_ACTIONS, 4);
        let dvalues = inputs(rows, 5);
        let mut grads = vec![0.0; layout.n_params()];
        let mut tape = PolicyTape::new(&layout);
        group.bench_function(name, |b| {
            b.iter(|| {
                tape.forward(black_box(&params), black_box(&obs), &episode_start, &h0, t_len, b_len);
                tape.backward(&params, black_box(&dlogits), &dvalues, &mut grads);
                black_box(&grads);
            })
        });
    }
    group.finish();
}

fn config() -> Criterion {
    Criterion::default().sample_size(20).warm_up_time(Duration::from_secs(1)).measurement_time(Duration::from_secs(3))
}

criterion_group! {
    name = benches;
    config = config();
    targets = bench_inference, bench_tape, bench_conv_inference
}
criterion_main!(benches);
