//! Segment throughput through the NATS transport against raw JetStream publishing of the same
//! bytes, on a real `nats-server` (started by `volley_testkit::TestNats`, loopback, file store).
//!
//! Every iteration moves one actor's batch of [`BATCH`] segments (one per environment, as
//! `RolloutWorker` publishes them); a sample ends with a flush, so every segment counted was
//! acknowledged by the stream. Only the publishing is timed: each batch is built (cloned from a
//! template with fresh segment indices) just before, untimed, in every variant. Variants, all on
//! the same connection, runtime, subject and stream:
//! - `volley_sink`: `NatsTrajectorySink::publish` of owned segments (encoding, packing the
//!   call's 8 segments into one batch frame, message id, size check, pacing check, 32 acks in
//!   flight) and `flush()` at the end of the sample;
//! - `volley_sink_single`: the same with `max_segments_per_message = 1`: one message (and one
//!   ack and message id) per segment, as before batch frames (issue 16);
//! - `raw`: `jetstream::Context::publish` of the same bytes pre-encoded, 32 acks in flight;
//! - `raw_msg_id`: the same with a unique `Nats-Msg-Id` header per message, shaped like the
//!   sink's (which it adds for server-side deduplication of retried publishes);
//! - `raw_frame`: raw publishing of the batch's pre-encoded frame, one message per batch with
//!   no header: the sink's message shape without the sink;
//! - `raw_encode`: `raw_msg_id` with the encoding of each segment (and its message id) inside
//!   the timed region, one message per segment: the encoding no sink can skip, without the
//!   sink's own machinery or its frames (the sink frames both sizes: 8 segments of 64 KB fit
//!   its 1 MiB frame bound); the batch is freed after the timed region, as in the other `raw`
//!   variants;
//! - `encode`: `wire::encode_segment` alone, for the share of the sink's time spent encoding.
//!
//! The run is created with `ensure_run`, so the learner's durable consumer exists (nobody
//! consumes from it) and the sink does its real pacing reads (consumer info every 250 ms);
//! its bound is raised to `u64::MAX` so it never waits. The stream is purged before every
//! sample, outside the timed region.
//!
//! The server requires TLS, as deployments run it (issue 46); `VOLLEY_BENCH_NATS_TLS=0` runs it
//! in plain text, to measure what TLS costs.
//!
//! Run with `cargo bench -p volley-transport --bench nats`; numbers go in docs/BENCHMARKS.md.

use std::collections::VecDeque;
use std::hint::black_box;
use std::sync::atomic::AtomicBool;
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use volley_core::ids::{ActorId, RunId};
use volley_core::spec::{HyperParams, RunSpec};
use volley_core::subjects;
use volley_core::wire::{self, TrajectorySegment};
use volley_env::EnvConfig;
use volley_policy::{Activation, PolicySpec};
use volley_testkit::fixtures::SegmentBuilder;
use volley_testkit::{TestNats, TestNatsOptions, TestTls};
use volley_transport::nats::{NatsBus, NatsConfig, NatsTls};
use volley_transport::TrajectorySink;

/// Segments per `publish` call: one actor with 8 environments.
const BATCH: usize = 8;
/// Steps per segment (the CartPole default).
const SEGMENT_LEN: usize = 32;
/// Publish acks in flight, as `NatsConfig::publish_window` by default.
const WINDOW: usize = 32;
const RUN: &str = "bench";
const ACTOR: &str = "actor-0";
/// Stands in for the sink's incarnation (16 hex digits) in `raw_msg_id`, so its ids have the
/// sink's length but never collide with the sink's.
const RAW_INCARNATION: &str = "raw0000000000000";

/// A segment shaped like an actor's: `T + 1` observations of `obs_dim`, binary actions,
/// unit rewards, log-probabilities near ln ½, one finished episode.
fn segment(obs_dim: usize, env_idx: u32, segment_idx: u64) -> TrajectorySegment {
    let t = SEGMENT_LEN;
    let mut z = (segment_idx as u32) ^ env_idx.wrapping_mul(0x9E37_79B9);
    let mut next = move || {
        z = z.wrapping_mul(1_664_525).wrapping_add(1_013_904_223);
        (z >> 8) as f32 / (1u32 << 24) as f32 - 0.5
    };
    SegmentBuilder::new(t, obs_dim)
        .run(RUN)
        .actor(ACTOR)
        .incarnation(1)
        .env_idx(env_idx)
        .episode_id(segment_idx / 4)
        .segment_idx(segment_idx)
        .version(segment_idx / 8)
        .layout_hash(0x0123_4567_89ab_cdef)
        .observations_from(|_| next())
        .actions((0..t).map(|i| (i % 2) as u32).collect())
        .terminal_at(t / 2)
        .log_probs((0..t).map(|_| -0.69 + 0.1 * next()).collect())
        .episode(57.0, 57)
        .build()
}

/// A fresh batch like `template` with new segment indices, hence new message ids: the server
/// must store every segment rather than drop it as a duplicate.
fn next_batch(template: &[TrajectorySegment], next_idx: &mut u64) -> Vec<TrajectorySegment> {
    template
        .iter()
        .map(|s| {
            *next_idx += 1;
            TrajectorySegment { segment_idx: *next_idx, ..s.clone() }
        })
        .collect()
}

fn spec() -> RunSpec {
    RunSpec {
        run: RunId::new(RUN).expect("valid run id"),
        env: EnvConfig::Cartpole,
        policy: PolicySpec::mlp(4, 2, &[64, 64], Activation::Tanh),
        segment_len: SEGMENT_LEN,
        hyper: HyperParams::default(),
        seed: 0,
    }
}

/// Drop every message of the run's trajectory stream (untimed, between samples).
fn purge(bus: &NatsBus) {
    let name = subjects::trajectory_stream(&bus.config().run);
    bus.block_on(async {
        let stream = bus.jetstream().get_stream_no_info(name).await.expect("the stream exists");
        stream.purge().await.expect("purge the trajectory stream");
    });
}

/// The bench server (TLS unless `VOLLEY_BENCH_NATS_TLS=0`) and the TLS settings of its clients.
fn server() -> (TestNats, NatsTls) {
    if std::env::var("VOLLEY_BENCH_NATS_TLS").is_ok_and(|value| value == "0") {
        eprintln!("nats-server in plain text (VOLLEY_BENCH_NATS_TLS=0)");
        (TestNats::start_with(TestNatsOptions { tls: TestTls::Off, ..Default::default() }), NatsTls::default())
    } else {
        let server = TestNats::start();
        let tls = NatsTls::with_ca(server.ca_file());
        (server, tls)
    }
}

fn bench_segments(c: &mut Criterion) {
    let (server, tls) = server();
    let bus =
        NatsBus::connect(NatsConfig::new(server.url(), RunId::new(RUN).expect("valid run id")).with_tls(tls.clone()))
            .expect("connect to the bench server");
    bus.ensure_run(&spec()).expect("create the run");
    let actor = ActorId::new(ACTOR).expect("valid actor id");
    let mut sink = bus.trajectory_sink(&actor, Arc::new(AtomicBool::new(false))).expect("open the sink");
    sink.set_max_backlog_segments(u64::MAX);
    let subject = sink.subject().to_string();
    let mut single_config = NatsConfig::new(server.url(), RunId::new(RUN).expect("valid run id")).with_tls(tls);
    single_config.max_segments_per_message = 1;
    let single_bus = NatsBus::connect(single_config).expect("connect to the bench server");
    let mut single_sink =
        single_bus.trajectory_sink(&actor, Arc::new(AtomicBool::new(false))).expect("open the unbatched sink");
    single_sink.set_max_backlog_segments(u64::MAX);
    let js = bus.jetstream().clone();
    let mut next_idx = 0u64;

    let mut group = c.benchmark_group("nats_segments");
    // (label, observation width): CartPole, and a wide observation for ≈ 64 KB segments.
    for (label, obs_dim) in [("cartpole_obs4_t32", 4usize), ("obs480_t32", 480)] {
        let template: Vec<TrajectorySegment> = (0..BATCH).map(|e| segment(obs_dim, e as u32, e as u64)).collect();
        let encoded: Vec<Bytes> = template.iter().map(|s| Bytes::from(wire::encode_segment(s))).collect();
        let batch_bytes: usize = encoded.iter().map(Bytes::len).sum();
        eprintln!("{label}: {} bytes per encoded segment", batch_bytes / BATCH);
        group.throughput(Throughput::ElementsAndBytes { elements: BATCH as u64, bytes: batch_bytes as u64 });

        for (name, sink) in [("volley_sink", &mut sink), ("volley_sink_single", &mut single_sink)] {
            group.bench_function(BenchmarkId::new(name, label), |b| {
                b.iter_custom(|iters| {
                    purge(&bus);
                    let mut timed = Duration::ZERO;
                    for _ in 0..iters {
                        let batch = next_batch(&template, &mut next_idx);
                        let started = Instant::now();
                        sink.publish(batch).expect("publish");
                        timed += started.elapsed();
                    }
                    let started = Instant::now();
                    sink.flush().expect("flush");
                    timed + started.elapsed()
                })
            });
        }

        let frame = [Bytes::from(wire::batch::encode_segment_batch(&encoded))];
        for (name, with_msg_id, pre_encoded) in [
            ("raw", false, Some(&encoded[..])),
            ("raw_msg_id", true, Some(&encoded[..])),
            ("raw_frame", false, Some(&frame[..])),
            ("raw_encode", true, None),
        ] {
            group.bench_function(BenchmarkId::new(name, label), |b| {
                b.iter_custom(|iters| {
                    purge(&bus);
                    let mut in_flight = VecDeque::with_capacity(WINDOW);
                    let mut timed = Duration::ZERO;
                    for _ in 0..iters {
                        // The same untimed work between publishes as the sink's variant: build
                        // the batch (here only for its message ids), so both pipelines get the
                        // same time to make progress between calls.
                        let batch = next_batch(&template, &mut next_idx);
                        let message_ids = |batch: &[TrajectorySegment]| -> Vec<String> {
                            batch
                                .iter()
                                .map(|s| {
                                    subjects::trajectory_msg_id(&s.actor, RAW_INCARNATION, s.env_idx, s.segment_idx)
                                })
                                .collect()
                        };
                        let mut ids: Vec<String> =
                            if with_msg_id && pre_encoded.is_some() { message_ids(&batch) } else { Vec::new() };
                        let started = Instant::now();
                        let fresh: Vec<Bytes>;
                        let payloads = match pre_encoded {
                            Some(payloads) => payloads,
                            None => {
                                fresh = batch.iter().map(|s| Bytes::from(wire::encode_segment(s))).collect();
                                ids = message_ids(&batch);
                                &fresh[..]
                            }
                        };
                        bus.block_on(async {
                            for (i, payload) in payloads.iter().enumerate() {
                                let mut message =
                                    async_nats::jetstream::message::PublishMessage::build().payload(payload.clone());
                                if let Some(id) = ids.get(i) {
                                    message = message.message_id(id);
                                }
                                let ack = js.send_publish(subject.clone(), message).await.expect("publish");
                                in_flight.push_back(ack);
                                while in_flight.len() >= WINDOW {
                                    in_flight.pop_front().expect("non-empty").await.expect("stored");
                                }
                            }
                        });
                        timed += started.elapsed();
                        drop((batch, ids));
                    }
                    let started = Instant::now();
                    bus.block_on(async {
                        for ack in in_flight.drain(..) {
                            ack.await.expect("stored");
                        }
                    });
                    timed + started.elapsed()
                })
            });
        }

        group.bench_function(BenchmarkId::new("encode", label), |b| {
            b.iter(|| {
                for s in &template {
                    black_box(wire::encode_segment(black_box(s)));
                }
            })
        });
    }
    group.finish();
    drop(sink);
    drop(single_sink);
    drop(single_bus);
    drop(bus);
    drop(server);
}

fn config() -> Criterion {
    Criterion::default().sample_size(10).warm_up_time(Duration::from_secs(1)).measurement_time(Duration::from_secs(3))
}

criterion_group! {
    name = benches;
    config = config();
    targets = bench_segments
}
criterion_main!(benches);
