//! Learner throughput on the CPU: one full update (forward over T+1 steps, loss, backward,
//! clipping, Adam) on a batch of T=20, B=32, MLP 64×64 (learner samples per second).

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use rand::{Rng, SeedableRng};
use rand_pcg::Pcg64Mcg;
use volley_core::spec::{HyperParams, LossKind, RunSpec};
use volley_core::wire::TrajectorySegment;
use volley_learner::batch::SegmentBatch;
use volley_learner::Learner;
use volley_policy::CoreKind;
use volley_testkit::fixtures::{SegmentBuilder, SpecBuilder};

/// `loss` over batches of `b_len` segments, one epoch of one minibatch per update.
fn hyper(loss: LossKind, b_len: usize) -> HyperParams {
    HyperParams { loss, batch_segments: b_len, ppo_epochs: 1, ppo_minibatches: 1, ..HyperParams::default() }
}

/// CartPole with a 64×64 tanh MLP (and `core`).
fn spec(loss: LossKind, core: CoreKind, t_len: usize, b_len: usize) -> RunSpec {
    SpecBuilder::cartpole(t_len).run("bench").torso(vec![64, 64]).core(core).hyper(hyper(loss, b_len)).seed(5).build()
}

fn random_segment(rng: &mut Pcg64Mcg, t_len: usize, hidden: usize) -> TrajectorySegment {
    SegmentBuilder::cartpole(t_len)
        .run("bench")
        .observations_from(|_| rng.random_range(-1.0..1.0))
        .actions((0..t_len).map(|_| rng.random_range(0..2)).collect())
        .terminated((0..t_len).map(|_| (rng.random::<f32>() < 0.05) as u8).collect())
        .initial_hidden(vec![0.0; hidden])
        .build()
}

fn learner_update(c: &mut Criterion) {
    let (t_len, b_len) = (20, 32);
    let mut group = c.benchmark_group("learner_samples");
    group.sample_size(10).measurement_time(std::time::Duration::from_secs(3));
    group.throughput(Throughput::Elements((t_len * b_len) as u64));
    let cases = [
        ("vtrace_mlp64x64", LossKind::Vtrace, CoreKind::Mlp),
        ("ppo_mlp64x64", LossKind::Ppo, CoreKind::Mlp),
        ("vtrace_mlp64x64_gru64", LossKind::Vtrace, CoreKind::Gru { hidden: 64 }),
    ];
    for (name, loss, core) in cases {
        let mut learner = Learner::new(spec(loss, core, t_len, b_len)).expect("valid spec");
        let hidden = learner.layout().recurrent_size();
        let mut rng = Pcg64Mcg::seed_from_u64(1);
        let segments: Vec<_> = (0..b_len).map(|_| random_segment(&mut rng, t_len, hidden)).collect();
        let batch = SegmentBatch::from_segments(&segments, 0.99, 1.0, &vec![1.0; b_len]);
        group.bench_with_input(BenchmarkId::new(name, format!("T{t_len}xB{b_len}")), &batch, |b, batch| {
            b.iter(|| std::hint::black_box(learner.update(batch)))
        });
    }
    // Issue 14: the Gaussian head (pendulum: 3 observations, one continuous action).
    for (name, loss) in [("vtrace_mlp64x64_gaussian", LossKind::Vtrace), ("ppo_mlp64x64_gaussian", LossKind::Ppo)] {
        let spec = SpecBuilder::pendulum(t_len).run("bench").torso(vec![64, 64]).hyper(hyper(loss, b_len)).build();
        let mut learner = Learner::new(spec.clone()).expect("valid spec");
        let mut rng = Pcg64Mcg::seed_from_u64(1);
        let segments: Vec<_> = (0..b_len)
            .map(|_| {
                SegmentBuilder::for_spec(&spec)
                    .observations_from(|_| rng.random_range(-1.0..1.0))
                    .continuous_actions_from(|_| rng.random_range(-2.0..2.0))
                    .log_prob(-1.0)
                    .build()
            })
            .collect();
        let batch = SegmentBatch::from_segments(&segments, 0.99, 1.0, &vec![1.0; b_len]);
        group.bench_with_input(BenchmarkId::new(name, format!("T{t_len}xB{b_len}")), &batch, |b, batch| {
            b.iter(|| std::hint::black_box(learner.update(batch)))
        });
    }
    group.finish();
}

/// What the learner's metrics cost per update (issue 16: the distributed learner's non-update
/// work per update): one `LearnerMetrics::observe` with a batch of 8 × 32 samples' importance
/// ratios and 8 new segments' lags, the counters of the report advancing as in a run.
fn metrics_observe(c: &mut Criterion) {
    use volley_learner::telemetry::OffPolicyStats;
    use volley_learner::{LearnerMetrics, LearnerReport, UpdateStats};
    let learner = Learner::new(spec(LossKind::Vtrace, CoreKind::Mlp, 32, 8)).expect("valid spec");
    let registry = prometheus::Registry::new();
    let mut metrics = LearnerMetrics::register(&registry).expect("metrics register");
    let mut rng = Pcg64Mcg::seed_from_u64(3);
    let ratios: Vec<f32> = (0..256).map(|_| rng.random_range(0.5..1.5)).collect();
    let stats = UpdateStats {
        samples: 256,
        off_policy: Some(OffPolicyStats { ratios, ..OffPolicyStats::default() }),
        ..UpdateStats::default()
    };
    let mut report = LearnerReport { lag_histogram: vec![0; 65], ..LearnerReport::default() };
    c.bench_function("metrics_observe/ratios256_lags8", |b| {
        b.iter(|| {
            report.updates += 1;
            report.env_steps += 256;
            for lag in 0..8 {
                report.lag_histogram[lag] += 1;
            }
            metrics.observe(&learner, &report, &stats, true);
        })
    });
}

criterion_group!(benches, learner_update, metrics_observe);
criterion_main!(benches);
