//! `volley bench-weights`: how long a new policy version takes to reach every actor over NATS.
//!
//! The driver (`--role driver`, the default) plays the learner: it re-creates the run's buckets,
//! starts `--followers` copies of this binary with `--role follower`, publishes one warm-up
//! version and waits until every follower holds it (so all are connected, watching and have
//! opened the object store), then publishes `--versions` timed versions of a `--size-mib`
//! buffer through [`NatsWeightsPublisher`].
//! For each it records the wall clock (`CLOCK_REALTIME`) when `publish` was called and waits
//! until every follower reported the version, then pauses `--pause-ms` before the next one, so
//! transfers of consecutive versions never overlap.
//!
//! A follower plays an actor: it polls [`WeightsFollower::latest`] every `--poll-ms` (an actor
//! asks between segments) and prints `version,unix_nanos` to stdout the moment a new version is
//! fetched, decoded and verified, i.e. usable. Driver and followers share the machine, so their
//! realtime clocks agree and `unix_nanos - publish_start` is the latency. It covers: encoding,
//! the chunked object-store upload, the KV pointer, the watch, the follower's poll interval,
//! the object download, decoding and checksum verification.
//!
//! The weights are not a policy: driver and followers agree on a made-up layout hash
//! (`--layout-hash`) and a parameter count derived from `--size-mib`.

use std::io::{BufRead, BufReader, Write};
use std::process::{Child, ChildStdout, Command, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{mpsc, Arc};
use std::thread;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use anyhow::{bail, Context};
use async_nats::jetstream::context::GetStreamErrorKind;
use async_nats::jetstream::ErrorCode;
use tracing::{info, warn};
use volley_core::ids::PolicyVersion;
use volley_core::spec::{HyperParams, RunSpec, StoreLimits};
use volley_core::subjects;
use volley_core::wire::{frame, Weights};
use volley_env::EnvConfig;
use volley_policy::{Activation, PolicySpec};
use volley_transport::nats::{NatsAuth, NatsBus, NatsWeightsPublisher};
use volley_transport::{WeightsFollower, WeightsPublisher};

use crate::args::{BenchPattern, BenchRole, BenchWeightsConfig};

/// Latency percentiles over versions, in milliseconds (nearest rank: with 30 versions p99 is
/// the slowest one).
#[derive(Debug, Clone, Copy, PartialEq, serde::Serialize)]
pub struct Percentiles {
    /// Median.
    pub p50: f64,
    /// 99th percentile.
    pub p99: f64,
    /// Slowest.
    pub max: f64,
}

impl Percentiles {
    /// Nearest-rank percentiles of `samples_ms`; `None` when empty.
    pub fn of(samples_ms: &[f64]) -> Option<Self> {
        if samples_ms.is_empty() {
            return None;
        }
        let mut sorted = samples_ms.to_vec();
        sorted.sort_by(f64::total_cmp);
        let rank = |p: f64| sorted[((p / 100.0 * sorted.len() as f64).ceil() as usize).clamp(1, sorted.len()) - 1];
        Some(Percentiles { p50: rank(50.0), p99: rank(99.0), max: sorted[sorted.len() - 1] })
    }
}

/// What `volley bench-weights` prints as one JSON line when the driver finishes.
#[derive(Debug, serde::Serialize)]
pub struct BenchWeightsSummary {
    /// Bytes of one version's full frame.
    pub size_bytes: usize,
    /// Bytes published per timed version (full frames and deltas), median and maximum.
    pub frame_bytes_median: usize,
    /// The largest frame of the timed versions.
    pub frame_bytes_max: usize,
    /// Whether the versions travelled inline in the pointer.
    pub inline: bool,
    /// Whether the versions were also fanned out by core NATS (the live path).
    pub live: bool,
    /// A full frame every this many versions.
    pub anchor_every: u64,
    /// Parameters per version.
    pub n_params: usize,
    /// Follower processes.
    pub followers: usize,
    /// Timed versions that reached every follower.
    pub versions: usize,
    /// How long the learner's `publish` call took (encode, upload, pointer, old-object delete).
    pub publish_ms: Option<Percentiles>,
    /// From `publish` to the first follower holding the version.
    pub first_follower_ms: Option<Percentiles>,
    /// From `publish` to the last of the followers holding the version: the broadcast latency.
    pub last_follower_ms: Option<Percentiles>,
    /// From `publish` to each follower holding the version, one entry per follower.
    pub per_follower_ms: Vec<Option<Percentiles>>,
}

/// Realtime clock in nanoseconds since the Unix epoch (comparable across processes).
fn unix_nanos() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map(|d| d.as_nanos() as u64).unwrap_or(0)
}

/// `--role follower`: print `version,unix_nanos` for every new version until `--versions`.
pub fn follow(config: &BenchWeightsConfig, interrupted: &AtomicBool) -> anyhow::Result<()> {
    if config.pattern != BenchPattern::Volley {
        return raw::follow(config, interrupted);
    }
    let bus = NatsBus::connect(config.nats.clone()).with_context(|| format!("connecting to {}", config.nats.url))?;
    let mut follower = bus.weights_follower(config.layout_hash, config.n_params).context("following weights")?;
    let mut out = std::io::stdout().lock();
    let mut have: Option<PolicyVersion> = None;
    let mut last_new = Instant::now();
    while !interrupted.load(Ordering::Acquire) {
        // `--poll-ms 0`: wait for each version as the raw patterns' followers do.
        let newer = if config.poll.is_zero() {
            follower.wait_newer(have, Duration::from_millis(200))
        } else {
            follower.latest(have)
        };
        match newer {
            Ok(Some(weights)) => {
                let usable_at = unix_nanos();
                // A closed pipe means the driver is gone: stop.
                writeln!(out, "{},{usable_at}", weights.version.0).and_then(|()| out.flush()).context("stdout")?;
                have = Some(weights.version);
                last_new = Instant::now();
                if weights.version.0 >= config.versions {
                    info!(
                        live = follower.live_applied(),
                        durable = follower.durable_fetches(),
                        live_refused = follower.live_refused(),
                        live_chunks_refused = follower.live_chunks_refused(),
                        "versions taken by path"
                    );
                    return Ok(());
                }
            }
            Ok(None) => {}
            Err(err) => warn!(%err, "weights fetch failed; retrying"),
        }
        if last_new.elapsed() >= config.timeout {
            bail!("no new weights version for {:?} (have {have:?})", config.timeout);
        }
        if !config.poll.is_zero() {
            thread::sleep(config.poll);
        }
    }
    Ok(())
}

/// One report from a follower process.
enum Report {
    /// Follower `follower` held `version` at `unix_nanos`.
    Usable { follower: usize, version: u64, unix_nanos: u64 },
    /// Follower `follower` closed its stdout (exited) or wrote something unreadable.
    Gone { follower: usize, problem: Option<String> },
}

fn read_reports(follower: usize, stdout: ChildStdout, reports: mpsc::Sender<Report>) {
    for line in BufReader::new(stdout).lines() {
        let parsed = line.map_err(|err| err.to_string()).and_then(|line| {
            let (version, nanos) = line.split_once(',').ok_or_else(|| format!("unexpected line {line:?}"))?;
            Ok((
                version.trim().parse().map_err(|_| format!("bad version in {line:?}"))?,
                nanos.trim().parse().map_err(|_| format!("bad time in {line:?}"))?,
            ))
        });
        let report = match parsed {
            Ok((version, unix_nanos)) => Report::Usable { follower, version, unix_nanos },
            Err(problem) => Report::Gone { follower, problem: Some(problem) },
        };
        let stop = matches!(report, Report::Gone { .. });
        if reports.send(report).is_err() || stop {
            return;
        }
    }
    let _ = reports.send(Report::Gone { follower, problem: None });
}

/// Follower processes, killed on drop if still running.
struct Followers(Vec<Child>);

impl Drop for Followers {
    fn drop(&mut self) {
        for child in &mut self.0 {
            if matches!(child.try_wait(), Ok(None)) {
                let _ = child.kill();
            }
            let _ = child.wait();
        }
    }
}

fn spawn_followers(config: &BenchWeightsConfig, reports: &mpsc::Sender<Report>) -> anyhow::Result<Followers> {
    let exe = std::env::current_exe().context("locating the volley binary")?;
    let mut children = Followers(Vec::with_capacity(config.followers));
    for follower in 0..config.followers {
        let mut command = Command::new(&exe);
        command
            .arg("bench-weights")
            .args(["--role", "follower"])
            .args(["--nats", &config.nats.url])
            .args(["--nats-timeout-secs", &config.nats.request_timeout.as_secs_f64().to_string()])
            .args(["--run", config.nats.run.as_str()])
            .args(["--size-mib", &config.size_mib.to_string()])
            .args(["--layout-hash", &format!("{:016x}", config.layout_hash)])
            .args(["--versions", &config.versions.to_string()])
            .args(["--poll-ms", &(config.poll.as_secs_f64() * 1e3).to_string()])
            .args(["--timeout-secs", &config.timeout.as_secs_f64().to_string()])
            .args(["--pattern", config.pattern.name()])
            .args(["--nats-weights-live", &config.nats.weights_live.to_string()])
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit());
        // Followers connect as the driver does; a password travels in the environment, which
        // process listings do not show, rather than in a flag.
        if let Some(NatsAuth::UserPassword { user, password }) = &config.nats.auth {
            command.env("VOLLEY_NATS_USER", user).env("VOLLEY_NATS_PASSWORD", password);
        }
        // And over TLS as the driver does.
        let tls = &config.nats.tls;
        for (flag, path) in
            [("--nats-tls-ca", &tls.ca_file), ("--nats-tls-cert", &tls.cert_file), ("--nats-tls-key", &tls.key_file)]
        {
            if let Some(path) = path {
                command.arg(flag).arg(path);
            }
        }
        command.args(["--nats-tls-required", &tls.required.to_string()]);
        if std::env::var_os("RUST_LOG").is_none() {
            command.env("RUST_LOG", "warn");
        }
        let mut child = command.spawn().with_context(|| format!("starting follower {follower}"))?;
        let stdout = child.stdout.take().expect("stdout is piped");
        children.0.push(child);
        let reports = reports.clone();
        thread::Builder::new()
            .name(format!("follower-{follower}"))
            .spawn(move || read_reports(follower, stdout, reports))
            .context("starting a reader thread")?;
    }
    Ok(children)
}

/// Delete the run's streams (KV bucket, weights object store, trajectory stream) if they exist,
/// so versions start from 0 and the broker's storage reservation for them is released.
fn reset_run(bus: &NatsBus) -> anyhow::Result<()> {
    let run = &bus.config().run;
    for stream in [
        subjects::trajectory_stream(run),
        subjects::kv_backing_stream(&subjects::run_bucket(run)),
        subjects::object_backing_stream(&subjects::weights_bucket(run)),
    ] {
        let deleted = bus.block_on(bus.jetstream().delete_stream(&stream));
        match deleted {
            Ok(_) => info!(%stream, "deleted the previous benchmark's stream"),
            Err(err) => match err.kind() {
                GetStreamErrorKind::JetStream(js_err) if js_err.error_code() == ErrorCode::STREAM_NOT_FOUND => {}
                _ => return Err(err).with_context(|| format!("deleting stream {stream}")),
            },
        }
    }
    Ok(())
}

/// Wait until every follower reported `version`; returns each one's `unix_nanos`.
fn collect(
    config: &BenchWeightsConfig,
    reports: &mpsc::Receiver<Report>,
    version: u64,
    interrupted: &AtomicBool,
) -> anyhow::Result<Option<Vec<u64>>> {
    let deadline = Instant::now() + config.timeout;
    let mut usable_at: Vec<Option<u64>> = vec![None; config.followers];
    while usable_at.iter().any(Option::is_none) {
        if interrupted.load(Ordering::Acquire) {
            return Ok(None);
        }
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            let missing: Vec<usize> = (0..config.followers).filter(|&f| usable_at[f].is_none()).collect();
            bail!("followers {missing:?} did not get version {version} within {:?}", config.timeout);
        }
        match reports.recv_timeout(left.min(Duration::from_millis(100))) {
            Ok(Report::Usable { follower, version: got, unix_nanos }) if got == version => {
                usable_at[follower] = Some(unix_nanos);
            }
            Ok(Report::Usable { follower, version: got, .. }) => {
                warn!(follower, got, expected = version, "follower reported an unexpected version");
            }
            // A follower exits after the last version: only a missing report is a failure.
            Ok(Report::Gone { follower, .. }) if usable_at[follower].is_some() => {}
            Ok(Report::Gone { follower, problem }) => {
                bail!(
                    "follower {follower} stopped before version {version}: {}",
                    problem.as_deref().unwrap_or("exited")
                );
            }
            Err(mpsc::RecvTimeoutError::Timeout) => {}
            Err(mpsc::RecvTimeoutError::Disconnected) => bail!("every follower is gone"),
        }
    }
    Ok(Some(usable_at.into_iter().map(|t| t.expect("all reported")).collect()))
}

/// A buffer in which every parameter moves a little from version to version, as under an
/// optimiser step (about 1e-4 per version on values of order 0.1–1), so no layer could skip an
/// unchanged one and deltas are as big as a real learner's.
fn params_for(version: u64, n_params: usize) -> Vec<f32> {
    (0..n_params)
        .map(|i| {
            let base = ((i as u64).wrapping_mul(2_654_435_761) % 2048) as f32 * 1e-3 - 1.0;
            let direction = ((i % 7) as f32 - 3.0) * 3e-5;
            base + direction * version as f32
        })
        .collect()
}

/// `--role driver`: publish, time, summarise.
pub fn drive(config: &BenchWeightsConfig, interrupted: &AtomicBool) -> anyhow::Result<BenchWeightsSummary> {
    let bus = NatsBus::connect(config.nats.clone()).with_context(|| format!("connecting to {}", config.nats.url))?;
    reset_run(&bus)?;
    // The spec is a placeholder the followers never read: ensure_run needs one to create the run.
    let spec = RunSpec {
        run: config.nats.run.clone(),
        env: EnvConfig::Cartpole,
        policy: PolicySpec::mlp(4, 2, &[64, 64], Activation::Tanh),
        segment_len: 32,
        hyper: HyperParams { stores: bench_stores(config), ..HyperParams::default() },
        seed: 0,
    };
    bus.ensure_run(&spec).context("creating the benchmark run")?;
    let summary = measure(config, &bus, interrupted);
    // Release the run's storage reservation whether or not the measurement succeeded.
    if let Err(err) = reset_run(&bus) {
        warn!(error = %format!("{err:#}"), "could not delete the benchmark run's streams");
    }
    summary
}

/// Store limits sized to the benchmark: JetStream reserves a stream's `max_bytes` against the
/// server's storage limit when the stream is created, so the default run limits (1 GiB of
/// trajectories, 1 GiB of weights) made a benchmark fail on a broker with a few GiB of disk
/// free, or after another run took its share. The benchmark sends no trajectories. Its weights
/// store holds the kept chains plus the one being written, each an anchor and at most
/// `anchor_every - 1` deltas, every frame at most a full frame, plus metadata.
fn bench_stores(config: &BenchWeightsConfig) -> StoreLimits {
    let full_frame = (config.n_params as u64).saturating_mul(4).saturating_add(64 << 10);
    let chains = config.nats.keep_weight_versions as u64 + 1;
    let frames = chains.saturating_mul(config.nats.weights_anchor_every.max(1));
    StoreLimits {
        trajectory_max_bytes: 1 << 20,
        weights_keep_versions: config.nats.keep_weight_versions,
        weights_max_bytes: frames.saturating_mul(full_frame).saturating_add(16 << 20),
        kv_max_bytes: 16 << 20,
        ..StoreLimits::default()
    }
}

/// The driver's measurement on a created run: followers, warm-up, the timed versions.
fn measure(
    config: &BenchWeightsConfig,
    bus: &NatsBus,
    interrupted: &AtomicBool,
) -> anyhow::Result<BenchWeightsSummary> {
    let mut publisher = match config.pattern {
        BenchPattern::Volley => {
            Publisher::Volley(Box::new(bus.weights_publisher().context("opening the weights store")?))
        }
        pattern => Publisher::Raw(Box::new(raw::RawPublisher::open(bus, pattern)?)),
    };

    let (reports_tx, reports) = mpsc::channel();
    let ready = match &publisher {
        Publisher::Raw(raw) => Some(raw.ready_subscription(bus)?),
        Publisher::Volley(_) => None,
    };
    let followers = spawn_followers(config, &reports_tx)?;
    drop(reports_tx);
    if let Some(ready) = ready {
        raw::wait_ready(bus, ready, config.followers, config.timeout)?;
    }
    let warm_up = Arc::new(Weights::new(PolicyVersion(0), config.layout_hash, params_for(0, config.n_params)));
    let size_bytes = frame::encode_full_frame(&warm_up).len();
    let inline = config.pattern == BenchPattern::Volley && size_bytes <= config.nats.weights_inline_max_bytes;
    info!(
        followers = config.followers,
        size_bytes,
        pattern = config.pattern.name(),
        "warm-up: waiting for every follower to hold version 0"
    );
    publisher.publish(bus, publisher.prepare(warm_up)).context("publishing the warm-up version")?;
    if collect(config, &reports, 0, interrupted)?.is_none() {
        bail!("interrupted during warm-up");
    }

    let mut frame_bytes = Vec::new();
    let mut publish_ms = Vec::new();
    let mut first_ms = Vec::new();
    let mut last_ms = Vec::new();
    let mut per_follower_ms: Vec<Vec<f64>> = vec![Vec::new(); config.followers];
    for version in 1..=config.versions {
        let weights =
            Arc::new(Weights::new(PolicyVersion(version), config.layout_hash, params_for(version, config.n_params)));
        // The raw patterns move the bytes of Volley's full frame, encoded before the clock starts.
        let weights = publisher.prepare(weights);
        let started = unix_nanos();
        publisher.publish(bus, weights).with_context(|| format!("publishing version {version}"))?;
        let published = unix_nanos();
        frame_bytes.push(publisher.last_frame_bytes());
        let Some(usable_at) = collect(config, &reports, version, interrupted)? else {
            warn!(version, "interrupted; summarising the versions so far");
            break;
        };
        let ms = |t: u64| t.saturating_sub(started) as f64 * 1e-6;
        publish_ms.push(ms(published));
        for (follower, &t) in usable_at.iter().enumerate() {
            per_follower_ms[follower].push(ms(t));
        }
        first_ms.push(ms(*usable_at.iter().min().expect("at least one follower")));
        last_ms.push(ms(*usable_at.iter().max().expect("at least one follower")));
        info!(version, publish_ms = ms(published), last_follower_ms = last_ms[last_ms.len() - 1], "version delivered");
        thread::sleep(config.pause);
    }
    drop(followers);

    frame_bytes.sort_unstable();
    let summary = BenchWeightsSummary {
        size_bytes,
        frame_bytes_median: frame_bytes.get(frame_bytes.len() / 2).copied().unwrap_or(0),
        frame_bytes_max: frame_bytes.last().copied().unwrap_or(0),
        inline,
        live: config.pattern == BenchPattern::Volley && config.nats.weights_live,
        anchor_every: config.nats.weights_anchor_every,
        n_params: config.n_params,
        followers: config.followers,
        versions: last_ms.len(),
        publish_ms: Percentiles::of(&publish_ms),
        first_follower_ms: Percentiles::of(&first_ms),
        last_follower_ms: Percentiles::of(&last_ms),
        per_follower_ms: per_follower_ms.iter().map(|samples| Percentiles::of(samples)).collect(),
    };
    print_table(&summary);
    Ok(summary)
}

/// What the driver publishes through: Volley's publisher or a raw pattern.
enum Publisher {
    Volley(Box<NatsWeightsPublisher>),
    Raw(Box<raw::RawPublisher>),
}

/// A version ready to publish: Volley's weights, or the raw bytes of their full frame.
enum Prepared {
    Weights(Arc<Weights>),
    Bytes(u64, Vec<u8>),
}

impl Publisher {
    fn prepare(&self, weights: Arc<Weights>) -> Prepared {
        match self {
            Publisher::Volley(_) => Prepared::Weights(weights),
            Publisher::Raw(_) => Prepared::Bytes(weights.version.0, frame::encode_full_frame(&weights)),
        }
    }

    fn publish(&mut self, bus: &NatsBus, version: Prepared) -> anyhow::Result<()> {
        match (self, version) {
            (Publisher::Volley(publisher), Prepared::Weights(weights)) => Ok(publisher.publish(weights)?),
            (Publisher::Raw(raw), Prepared::Bytes(version, bytes)) => raw.publish(bus, version, &bytes),
            _ => unreachable!("a version is published by the publisher that prepared it"),
        }
    }

    fn last_frame_bytes(&self) -> usize {
        match self {
            Publisher::Volley(publisher) => publisher.last_frame_bytes(),
            Publisher::Raw(raw) => raw.last_bytes,
        }
    }
}

/// The raw NATS patterns `--pattern raw-object` and `raw-core`: the same bytes as Volley's full
/// frame, moved with nothing of Volley's around them (the baselines of issue 16, item 2).
mod raw {
    use std::sync::atomic::{AtomicBool, Ordering};
    use std::time::{Duration, Instant};

    use anyhow::{bail, Context};
    use async_nats::jetstream::object_store;
    use futures::StreamExt;
    use std::io::Write;
    use tokio::io::AsyncReadExt;

    use super::unix_nanos;
    use crate::args::{BenchPattern, BenchWeightsConfig};
    use volley_transport::nats::NatsBus;

    /// The object-store bucket of `raw-object`.
    fn bucket(bus: &NatsBus) -> String {
        format!("volley-bench-raw-{}", bus.config().run)
    }

    fn subject(bus: &NatsBus, what: &str) -> String {
        format!("volley-bench.{}.{what}", bus.config().run)
    }

    /// The driver's side of a raw pattern.
    pub(super) struct RawPublisher {
        pattern: BenchPattern,
        store: Option<object_store::ObjectStore>,
        /// Bytes of the last version published.
        pub(super) last_bytes: usize,
        chunk: usize,
    }

    impl RawPublisher {
        /// Re-create the raw bucket (`raw-object`).
        pub(super) fn open(bus: &NatsBus, pattern: BenchPattern) -> anyhow::Result<Self> {
            let store = match pattern {
                BenchPattern::RawObject => {
                    let js = bus.jetstream();
                    let name = bucket(bus);
                    let _ = bus.block_on(js.delete_object_store(&name));
                    let config = object_store::Config { bucket: name.clone(), ..Default::default() };
                    Some(bus.block_on(js.create_object_store(config)).context("creating the raw bucket")?)
                }
                _ => None,
            };
            // Chunks of half the largest message, at most 1 MiB.
            let chunk = (bus.max_payload() / 2).clamp(1024, 1 << 20);
            Ok(RawPublisher { pattern, store, last_bytes: 0, chunk })
        }

        /// Subscribe to the followers' ready notices, before they start.
        pub(super) fn ready_subscription(&self, bus: &NatsBus) -> anyhow::Result<async_nats::Subscriber> {
            let client = bus.client().clone();
            let subject = subject(bus, "ready");
            bus.block_on(async move {
                let subscriber = client.subscribe(subject).await?;
                client.flush().await?;
                Ok::<_, anyhow::Error>(subscriber)
            })
        }

        /// Put version `version`'s bytes and tell the followers (`raw-object`), or fan them out in
        /// chunks (`raw-core`); returns once the server has them.
        pub(super) fn publish(&mut self, bus: &NatsBus, version: u64, bytes: &[u8]) -> anyhow::Result<()> {
            let client = bus.client().clone();
            let notice = subject(bus, "notice");
            let chunks = subject(bus, "chunks");
            let chunk = self.chunk;
            self.last_bytes = bytes.len();
            match (self.pattern, &self.store) {
                (BenchPattern::RawObject, Some(store)) => bus.block_on(async {
                    store.put(format!("v{version}").as_str(), &mut &bytes[..]).await.context("object put")?;
                    if version >= 2 {
                        let _ = store.delete(format!("v{}", version - 2).as_str()).await;
                    }
                    client.publish(notice, version.to_string().into()).await?;
                    client.flush().await?;
                    Ok(())
                }),
                (BenchPattern::RawCore, _) => bus.block_on(async {
                    let n = bytes.len().div_ceil(chunk).max(1);
                    for (i, part) in bytes.chunks(chunk).enumerate() {
                        let mut headers = async_nats::HeaderMap::new();
                        headers.insert("v", version.to_string().as_str());
                        headers.insert("i", i.to_string().as_str());
                        headers.insert("n", n.to_string().as_str());
                        client.publish_with_headers(chunks.clone(), headers, part.to_vec().into()).await?;
                    }
                    client.flush().await?;
                    Ok(())
                }),
                _ => bail!("no raw pattern to publish with"),
            }
        }
    }

    /// Wait until `n` followers said they are subscribed.
    pub(super) fn wait_ready(
        bus: &NatsBus,
        mut ready: async_nats::Subscriber,
        n: usize,
        timeout: Duration,
    ) -> anyhow::Result<()> {
        bus.block_on(async {
            for seen in 0..n {
                match tokio::time::timeout(timeout, ready.next()).await {
                    Ok(Some(_)) => {}
                    _ => bail!("only {seen} of {n} followers subscribed within {timeout:?}"),
                }
            }
            Ok(())
        })
    }

    /// A follower of a raw pattern: print `version,unix_nanos` when a version's bytes are all here.
    pub(super) fn follow(config: &BenchWeightsConfig, interrupted: &AtomicBool) -> anyhow::Result<()> {
        let bus =
            NatsBus::connect(config.nats.clone()).with_context(|| format!("connecting to {}", config.nats.url))?;
        let client = bus.client().clone();
        let mut out = std::io::stdout().lock();
        let mut report = |version: u64| -> anyhow::Result<bool> {
            writeln!(out, "{version},{}", unix_nanos()).and_then(|()| out.flush()).context("stdout")?;
            Ok(version >= config.versions)
        };
        bus.block_on(async {
            let (mut messages, store) = match config.pattern {
                BenchPattern::RawObject => {
                    let store =
                        bus.jetstream().get_object_store(bucket(&bus)).await.context("opening the raw bucket")?;
                    (client.subscribe(subject(&bus, "notice")).await?, Some(store))
                }
                _ => (client.subscribe(subject(&bus, "chunks")).await?, None),
            };
            client.flush().await?;
            client.publish(subject(&bus, "ready"), "".into()).await?;
            client.flush().await?;
            // raw-core reassembly: the version being received, its chunks seen and its bytes.
            let (mut current, mut seen, mut buffer) = (None::<u64>, 0usize, Vec::<u8>::new());
            let mut last_new = Instant::now();
            while !interrupted.load(Ordering::Acquire) {
                let message = match tokio::time::timeout(Duration::from_millis(200), messages.next()).await {
                    Ok(Some(message)) => message,
                    Ok(None) => bail!("subscription closed"),
                    Err(_) if last_new.elapsed() >= config.timeout => bail!("no new version for {:?}", config.timeout),
                    Err(_) => continue,
                };
                let done = match &store {
                    Some(store) => {
                        let version: u64 = std::str::from_utf8(&message.payload)?.parse()?;
                        let mut object = store.get(format!("v{version}").as_str()).await.context("object get")?;
                        let mut bytes = Vec::new();
                        object.read_to_end(&mut bytes).await.context("object read")?;
                        last_new = Instant::now();
                        report(version)?
                    }
                    None => {
                        let header = |name: &str| -> anyhow::Result<u64> {
                            let value = message.headers.as_ref().and_then(|h| h.get(name)).context("chunk header")?;
                            Ok(value.as_str().parse()?)
                        };
                        let (version, n) = (header("v")?, header("n")? as usize);
                        if current != Some(version) {
                            (current, seen) = (Some(version), 0);
                            buffer.clear();
                        }
                        buffer.extend_from_slice(&message.payload);
                        seen += 1;
                        if seen < n {
                            continue;
                        }
                        last_new = Instant::now();
                        report(version)?
                    }
                };
                if done {
                    return Ok(());
                }
            }
            Ok(())
        })
    }
}

/// The human-readable report, on stderr (the JSON summary goes to stdout).
fn print_table(summary: &BenchWeightsSummary) {
    let row = |name: &str, p: &Option<Percentiles>| match p {
        Some(p) => eprintln!("{name:<22} {:>9.2} {:>9.2} {:>9.2}", p.p50, p.p99, p.max),
        None => eprintln!("{name:<22} {:>9} {:>9} {:>9}", "-", "-", "-"),
    };
    eprintln!(
        "frames: full {} B, published median {} B, max {} B ({}{}, anchor every {})",
        summary.size_bytes,
        summary.frame_bytes_median,
        summary.frame_bytes_max,
        if summary.inline { "inline" } else { "object store" },
        if summary.live { " + live fan-out" } else { "" },
        summary.anchor_every
    );
    eprintln!(
        "weights {:.2} MiB, {} followers, {} versions (ms from publish call)",
        summary.size_bytes as f64 / (1024.0 * 1024.0),
        summary.followers,
        summary.versions
    );
    eprintln!("{:<22} {:>9} {:>9} {:>9}", "", "p50", "p99", "max");
    row("publish call", &summary.publish_ms);
    row("first follower", &summary.first_follower_ms);
    row("last follower", &summary.last_follower_ms);
    for (follower, p) in summary.per_follower_ms.iter().enumerate() {
        row(&format!("follower {follower}"), p);
    }
}

/// Run `volley bench-weights` in its role; the driver returns its summary.
pub fn bench_weights(
    config: &BenchWeightsConfig,
    interrupted: &AtomicBool,
) -> anyhow::Result<Option<BenchWeightsSummary>> {
    match config.role {
        BenchRole::Driver => drive(config, interrupted).map(Some),
        BenchRole::Follower => follow(config, interrupted).map(|()| None),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn percentiles_use_the_nearest_rank() {
        let samples: Vec<f64> = (1..=30).map(f64::from).collect();
        let p = Percentiles::of(&samples).expect("samples");
        assert_eq!(p.p50, 15.0);
        assert_eq!(p.p99, 30.0);
        assert_eq!(p.max, 30.0);
        let p = Percentiles::of(&(1..=200).map(f64::from).collect::<Vec<_>>()).expect("samples");
        assert_eq!((p.p50, p.p99), (100.0, 198.0));
        assert_eq!(Percentiles::of(&[]), None);
    }

    #[test]
    fn params_change_with_the_version() {
        assert_ne!(params_for(1, 64), params_for(2, 64));
        assert_eq!(params_for(3, 10).len(), 10);
    }
}
