//! Learner ingest capacity (issue 16, item 5): samples per second one learner process takes
//! from JetStream, against the raw consumer rate of the same stream, on a real `nats-server`
//! (`volley_testkit::TestNats`: loopback, file store, the default 1 MiB `max_payload`).
//!
//! For each segment shape the bench fills the run's trajectory stream once (untimed) through
//! `NatsTrajectorySink`, as one actor with 8 environments publishes: 8 segments per `publish`
//! call, so with batch frames 8 segments per message when they fit. Then it reads the whole
//! stream again for each variant, through a freshly created learner consumer (deleted and
//! re-created between variants, so each starts at the first message):
//! - `raw`: async-nats pulls the consumer's messages (one `fetch` request of up to 64
//!   messages at a time) and acks each one (plain ack); nothing is decoded.
//! - `source_noop`: the learner's path without the update: `NatsTrajectorySource::recv`
//!   (pull, batch frame split, checksum, bincode decode), `TrajectorySegment::validate`,
//!   `Admission::check`, the duplicate filter, `SegmentBatch::fill` for every batch of
//!   `batch_segments` segments (B = 2048 samples), then `ack_later` of the batch's deliveries
//!   (double acks confirmed in the background) in place of an update.
//! - `source_cpu`: the same with `Learner::update` (V-trace, MLP 64×64, the CPU backend) on
//!   every batch.
//!
//! - `source_noop_prefetch4`: `source_noop` with `NatsConfig::prefetch_calls = 4` (the
//!   learner's pull asks for four calls' worth at a time instead of one), the setting for a
//!   learner whose update is faster than a round trip to the broker;
//! - `decode_only`: the learner's per-segment CPU work of `source_noop` without NATS (frame
//!   split, checksum, decode, validation, admission, batch layout) on the same bytes in memory,
//!   one thread: the ceiling of `source_noop` on this machine.
//!
//! Each variant stops when it has read every segment or after [`VARIANT_BUDGET`], and reports
//! samples (segment steps) per second over the segments it handed to batches. Every variant
//! runs [`repeats`] times (`VOLLEY_INGEST_REPEATS`, default 3), interleaved; the table gives
//! the median and the range. Timing starts with the first request, so a variant's rate
//! includes its start-up (consumer creation is untimed).
//!
//! Run with `cargo bench -p volley-learner --bench ingest` (a name as the only argument runs
//! the shapes whose label contains it; `VOLLEY_INGEST_VARIANTS=source_noop,raw` runs only the
//! variants named, for a profile of one; `VOLLEY_INGEST_RUNTIME_WORKERS=2` gives the NATS
//! client two worker threads instead of none); numbers go in docs/BENCHMARKS.md.

use std::time::{Duration, Instant};

use futures::StreamExt;
use volley_core::ids::{ActorId, RunId};
use volley_core::spec::{HyperParams, RunSpec, StoreLimits};
use volley_core::subjects;
use volley_core::wire::{self, TrajectorySegment};
use volley_env::{EnvConfig, EnvServiceName, RemoteEnvConfig};
use volley_learner::batch::SegmentBatch;
use volley_learner::ingest::admission::Admission;
use volley_learner::ingest::seen::{SeenSegments, SEEN_STREAMS};
use volley_learner::Learner;
use volley_policy::{Activation, PolicySpec};
use volley_testkit::fixtures::SegmentBuilder;
use volley_testkit::TestNats;
use volley_transport::nats::{NatsBus, NatsConfig, NatsTls};
use volley_transport::{Delivery, TrajectorySink, TrajectorySource};

/// Segments per learner batch: 64 × T=32 = 2048 samples.
const BATCH_SEGMENTS: usize = 64;
/// Steps per segment.
const SEGMENT_LEN: usize = 32;
/// Environments of the actor that fills the stream: segments per `publish` call.
const ENVS: usize = 8;
/// Longest a variant reads before it reports what it got.
const VARIANT_BUDGET: Duration = Duration::from_secs(12);

/// One segment shape and how many segments of it fill the stream.
struct Shape {
    label: &'static str,
    obs_dim: usize,
    n_segments: usize,
    /// The sink's `max_segments_per_message` (1: one message per segment, as before frames).
    max_segments_per_message: usize,
    /// Observations are frames, held and sent as one byte each (`core::wire::observations`);
    /// otherwise they are arbitrary `f32`.
    pixels: bool,
}

const SHAPES: [Shape; 4] = [
    Shape {
        label: "cartpole_obs4_t32_framed",
        obs_dim: 4,
        n_segments: 64 * 1024,
        max_segments_per_message: 64,
        pixels: false,
    },
    Shape {
        label: "cartpole_obs4_t32_single",
        obs_dim: 4,
        n_segments: 16 * 1024,
        max_segments_per_message: 1,
        pixels: false,
    },
    Shape {
        label: "frame84x84_f32_t32",
        obs_dim: 84 * 84,
        n_segments: 640,
        max_segments_per_message: 64,
        pixels: false,
    },
    // What a pixel task sends: four stacked 84×84 8-bit frames per step (`--frame-stack 4`),
    // the same 0.93 MB per segment as one frame of `f32`.
    Shape {
        label: "frame84x84x4_u8_t32",
        obs_dim: 84 * 84 * 4,
        n_segments: 640,
        max_segments_per_message: 64,
        pixels: true,
    },
];

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Variant {
    Raw,
    SourceNoop,
    SourceCpu,
    DecodeOnly,
    SourceNoopPrefetch4,
}

impl Variant {
    const ALL: [Variant; 5] =
        [Variant::Raw, Variant::SourceNoop, Variant::SourceCpu, Variant::DecodeOnly, Variant::SourceNoopPrefetch4];

    fn name(self) -> &'static str {
        match self {
            Variant::Raw => "raw",
            Variant::SourceNoop => "source_noop",
            Variant::SourceCpu => "source_cpu",
            Variant::DecodeOnly => "decode_only",
            Variant::SourceNoopPrefetch4 => "source_noop_prefetch4",
        }
    }
}

/// What one variant read, and in how long.
#[derive(Debug, Clone, Copy)]
struct Reading {
    segments: usize,
    elapsed: Duration,
}

impl Reading {
    fn samples_per_sec(&self) -> f64 {
        (self.segments * SEGMENT_LEN) as f64 / self.elapsed.as_secs_f64()
    }
}

/// Worker threads of the bench buses' runtimes (`VOLLEY_INGEST_RUNTIME_WORKERS`, default 0 as
/// for a learner: the thread that reads runs the connection).
fn runtime_workers() -> usize {
    std::env::var("VOLLEY_INGEST_RUNTIME_WORKERS").ok().and_then(|v| v.parse().ok()).unwrap_or(0)
}

/// Whether `variant` runs: all of them unless `VOLLEY_INGEST_VARIANTS` names some.
fn selected(variant: Variant) -> bool {
    std::env::var("VOLLEY_INGEST_VARIANTS")
        .map_or(true, |names| names.split(',').any(|name| name.trim() == variant.name()))
}

fn repeats() -> usize {
    std::env::var("VOLLEY_INGEST_REPEATS").ok().and_then(|v| v.parse().ok()).unwrap_or(3).max(1)
}

fn spec(run: &str, obs_dim: usize) -> RunSpec {
    let stores = StoreLimits { trajectory_max_bytes: 2 << 30, ..StoreLimits::default() };
    // Frames need an environment with that many observations: a remote one, as a pixel
    // environment served over NATS would be, with CartPole's reward bound.
    let env = if obs_dim == 4 {
        EnvConfig::Cartpole
    } else {
        EnvConfig::Remote(RemoteEnvConfig {
            max_abs_reward: Some(1.0),
            ..RemoteEnvConfig::new(EnvServiceName::new("pixels").expect("valid service name"), obs_dim, 2)
        })
    };
    RunSpec {
        run: RunId::new(run).expect("valid run id"),
        env,
        policy: PolicySpec::mlp(obs_dim, 2, &[64, 64], Activation::Tanh),
        segment_len: SEGMENT_LEN,
        hyper: HyperParams { batch_segments: BATCH_SEGMENTS, stores, ..HyperParams::default() },
        seed: 0,
    }
}

/// One environment's segment: random observations (bytes for `pixels`),
/// alternating actions, reward 1, no episode end; valid for `spec` and admitted at policy
/// version 0.
fn template(spec: &RunSpec, env_idx: usize, pixels: bool) -> TrajectorySegment {
    let mut z = (env_idx as u32).wrapping_mul(0x9E37_79B9) | 1;
    let mut next = move || {
        z = z.wrapping_mul(1_664_525).wrapping_add(1_013_904_223);
        z
    };
    let builder = SegmentBuilder::for_spec(spec).actor("actor-0").env_idx(env_idx as u32);
    // Frames are bytes, as an actor of an image space holds them (issue 44 item 3).
    let builder = if pixels {
        builder.frames_from(|_| (next() >> 24) as u8)
    } else {
        builder.observations_from(|_| (next() >> 8) as f32 / (1u32 << 24) as f32 - 0.5)
    };
    builder.actions((0..SEGMENT_LEN).map(|t| (t % 2) as u32).collect()).log_prob(-0.69).build()
}

/// Publish `shape.n_segments` segments through the sink, 8 per call; returns the messages
/// the stream holds.
fn fill(bus: &NatsBus, spec: &RunSpec, shape: &Shape) -> u64 {
    let templates: Vec<TrajectorySegment> = (0..ENVS).map(|env| template(spec, env, shape.pixels)).collect();
    eprintln!("{}: {} bytes per encoded segment", shape.label, wire::encode_segment(&templates[0]).len());
    let mut sink = bus
        .trajectory_sink(&ActorId::new("actor-0").expect("valid actor id"), Default::default())
        .expect("open the sink");
    sink.set_max_backlog_segments(u64::MAX);
    let started = Instant::now();
    for call in 0..shape.n_segments / ENVS {
        let segments = templates.iter().map(|s| TrajectorySegment { segment_idx: call as u64, ..s.clone() }).collect();
        sink.publish(segments).expect("publish");
    }
    sink.flush().expect("flush");
    let messages = bus.block_on(async {
        let mut stream = bus
            .jetstream()
            .get_stream(subjects::trajectory_stream(&bus.config().run))
            .await
            .expect("the stream exists");
        stream.info().await.expect("stream info").state.messages
    });
    eprintln!(
        "{}: filled {} segments in {messages} messages in {:.1?}",
        shape.label,
        shape.n_segments,
        started.elapsed()
    );
    messages
}

/// The run's trajectory stream.
async fn trajectory_stream(bus: &NatsBus) -> async_nats::jetstream::stream::Stream<()> {
    let name = subjects::trajectory_stream(&bus.config().run);
    bus.jetstream().get_stream_no_info(name).await.expect("the stream exists")
}

/// Delete the learner consumer, so the next one starts at the stream's first message.
fn reset_consumer(bus: &NatsBus) {
    bus.block_on(async {
        let _ = trajectory_stream(bus).await.delete_consumer(subjects::LEARNER_CONSUMER).await;
    });
}

/// Pull and ack every message through the learner consumer's config, decoding nothing.
fn read_raw(bus: &NatsBus, n_messages: u64, n_segments: usize) -> Reading {
    reset_consumer(bus);
    drop(bus.trajectory_source().expect("create the learner consumer"));
    bus.block_on(async {
        let stream = trajectory_stream(bus).await;
        let consumer: async_nats::jetstream::consumer::PullConsumer =
            stream.get_consumer(subjects::LEARNER_CONSUMER).await.expect("the learner consumer");
        let started = Instant::now();
        let mut received = 0u64;
        while received < n_messages && started.elapsed() < VARIANT_BUDGET {
            // One pull request at a time for what is left (at most 64 messages), answered at
            // once with what the stream holds.
            let want = (n_messages - received).min(64) as usize;
            let mut batch = consumer.fetch().max_messages(want).messages().await.expect("pull");
            while let Some(message) = batch.next().await {
                message.expect("a message").ack().await.expect("ack sent");
                received += 1;
            }
        }
        let segments = (n_segments as u64 * received / n_messages) as usize;
        Reading { segments, elapsed: started.elapsed() }
    })
}

/// The learner's ingest path, with or without the CPU update.
fn read_source(bus: &NatsBus, spec: &RunSpec, n_segments: usize, update: bool) -> Reading {
    reset_consumer(bus);
    let mut source = bus.trajectory_source().expect("create the learner consumer");
    let mut learner = Learner::new(spec.clone()).expect("valid spec");
    let layout_hash = learner.layout().hash();
    let hidden_size = learner.layout().recurrent_size();
    let admission = Admission::new(spec);
    let mut seen = SeenSegments::new(SEEN_STREAMS);
    let mut incoming: Vec<Delivery> = Vec::with_capacity(BATCH_SEGMENTS);
    let mut segments: Vec<TrajectorySegment> = Vec::with_capacity(BATCH_SEGMENTS);
    let mut tokens = Vec::with_capacity(BATCH_SEGMENTS);
    let mut batch = SegmentBatch::default();
    let column_weights = vec![1.0; BATCH_SEGMENTS];
    let mut used = 0;
    let started = Instant::now();
    while used < n_segments && started.elapsed() < VARIANT_BUDGET {
        let want = BATCH_SEGMENTS - segments.len();
        source.recv(want, Duration::from_millis(100), &mut incoming).expect("recv");
        for delivery in incoming.drain(..) {
            let segment = delivery.segment.expect("the bench's segments decode");
            segment.validate(spec, layout_hash, hidden_size).expect("the bench's segments are valid");
            admission.check(&segment, learner.version()).expect("the bench's segments are admitted");
            assert!(seen.insert(&segment), "no duplicates in the bench's stream");
            segments.push(segment);
            tokens.push(delivery.token);
        }
        if segments.len() == BATCH_SEGMENTS {
            let refs: Vec<&TrajectorySegment> = segments.iter().collect();
            batch.fill(&refs, spec.hyper.gamma, spec.hyper.reward_scale, &column_weights);
            if update {
                std::hint::black_box(learner.update(&batch));
            } else {
                std::hint::black_box(&batch);
            }
            source.ack_later(&tokens).expect("ack");
            used += segments.len();
            segments.clear();
            tokens.clear();
        }
    }
    let reading = Reading { segments: used, elapsed: started.elapsed() };
    source.ack(&[]).expect("settle the background acks");
    reading
}

/// The learner's per-segment CPU work alone, no NATS: the messages the sink would publish for
/// `shape` (frames of 8, or single segments) split, decoded, validated, admitted and laid out
/// in batches, on this thread. The duplicate filter is left out (the same bytes repeat).
fn decode_only(spec: &RunSpec, shape: &Shape) -> Reading {
    let templates: Vec<TrajectorySegment> = (0..ENVS).map(|env| template(spec, env, shape.pixels)).collect();
    let encoded: Vec<Vec<u8>> = templates.iter().map(wire::encode_segment).collect();
    let frame_fits = wire::batch::batch_header_bytes(ENVS) + encoded.iter().map(Vec::len).sum::<usize>() <= 64 << 10;
    let messages: Vec<Vec<u8>> = if shape.max_segments_per_message > 1 && frame_fits {
        vec![wire::batch::encode_segment_batch(&encoded)]
    } else {
        encoded
    };
    let learner = Learner::new(spec.clone()).expect("valid spec");
    let (layout_hash, hidden_size) = (learner.layout().hash(), learner.layout().recurrent_size());
    let admission = Admission::new(spec);
    let mut segments: Vec<TrajectorySegment> = Vec::with_capacity(BATCH_SEGMENTS);
    let mut batch = SegmentBatch::default();
    let column_weights = vec![1.0; BATCH_SEGMENTS];
    let mut used = 0;
    let started = Instant::now();
    'outer: while used < shape.n_segments && started.elapsed() < VARIANT_BUDGET {
        for message in &messages {
            let parts: Vec<&[u8]> = if wire::batch::is_segment_batch(message) {
                wire::batch::split_segment_batch(message).expect("a valid frame").collect()
            } else {
                vec![message.as_slice()]
            };
            for part in parts {
                let segment = wire::decode_segment_body(part).expect("decodes");
                segment.validate(spec, layout_hash, hidden_size).expect("valid");
                admission.check(&segment, learner.version()).expect("admitted");
                segments.push(segment);
                if segments.len() == BATCH_SEGMENTS {
                    let refs: Vec<&TrajectorySegment> = segments.iter().collect();
                    batch.fill(&refs, spec.hyper.gamma, spec.hyper.reward_scale, &column_weights);
                    std::hint::black_box(&batch);
                    used += segments.len();
                    segments.clear();
                    if used >= shape.n_segments {
                        break 'outer;
                    }
                }
            }
        }
    }
    Reading { segments: used, elapsed: started.elapsed() }
}

fn median_and_range(values: &mut [f64]) -> (f64, f64, f64) {
    values.sort_by(f64::total_cmp);
    (values[values.len() / 2], values[0], values[values.len() - 1])
}

fn main() {
    let filter = std::env::args().skip(1).find(|arg| !arg.starts_with('-'));
    let repeats = repeats();
    let server = TestNats::start();
    println!("| segments | variant | samples/s (median) | range | segments/s | share of raw |");
    println!("| --- | --- | --- | --- | --- | --- |");
    for (shape_idx, shape) in SHAPES.iter().enumerate() {
        if filter.as_deref().is_some_and(|filter| !shape.label.contains(filter)) {
            continue;
        }
        let run = format!("ingest-{shape_idx}");
        let spec = spec(&run, shape.obs_dim);
        let mut config = NatsConfig::new(server.url(), spec.run.clone()).with_tls(NatsTls::with_ca(server.ca_file()));
        config.max_segments_per_message = shape.max_segments_per_message;
        config.runtime_workers = runtime_workers();
        let mut deep_config = config.clone();
        deep_config.prefetch_calls = 4;
        let bus = NatsBus::connect(config).expect("connect to the bench server");
        bus.ensure_run(&spec).expect("create the run");
        let deep_bus = NatsBus::connect(deep_config).expect("connect to the bench server");
        let n_messages = fill(&bus, &spec, shape);
        let mut rates: Vec<Vec<f64>> = vec![Vec::new(); Variant::ALL.len()];
        for repeat in 0..repeats {
            for (variant_idx, variant) in Variant::ALL.into_iter().enumerate().filter(|(_, v)| selected(*v)) {
                let reading = match variant {
                    Variant::Raw => read_raw(&bus, n_messages, shape.n_segments),
                    Variant::SourceNoop => read_source(&bus, &spec, shape.n_segments, false),
                    Variant::SourceCpu => read_source(&bus, &spec, shape.n_segments, true),
                    Variant::DecodeOnly => decode_only(&spec, shape),
                    Variant::SourceNoopPrefetch4 => read_source(&deep_bus, &spec, shape.n_segments, false),
                };
                eprintln!(
                    "{} {} #{repeat}: {} segments in {:.2?}, {:.0} samples/s",
                    shape.label,
                    variant.name(),
                    reading.segments,
                    reading.elapsed,
                    reading.samples_per_sec()
                );
                rates[variant_idx].push(reading.samples_per_sec());
            }
        }
        let raw = (!rates[0].is_empty()).then(|| median_and_range(&mut rates[0].clone()).0);
        for (variant, values) in Variant::ALL.into_iter().zip(&mut rates).filter(|(_, values)| !values.is_empty()) {
            let (median, low, high) = median_and_range(values);
            println!(
                "| {} | {} | {:.3} M | {:.3}–{:.3} M | {:.0} | {} |",
                shape.label,
                variant.name(),
                median / 1e6,
                low / 1e6,
                high / 1e6,
                median / SEGMENT_LEN as f64,
                raw.map_or_else(|| "–".to_string(), |raw| format!("{:.2}", median / raw))
            );
        }
        bus.block_on(async {
            let _ = bus.jetstream().delete_stream(subjects::trajectory_stream(&spec.run)).await;
        });
    }
    drop(server);
}
