//! `volley bench-weights`: how long a new policy version takes to reach every actor over NATS.
//!
//! The driver (`--role driver`, the default) plays the learner: it re-creates the run's buckets,
//! starts `--followers` copies of this binary with `--role follower`, publishes one warm-up
//! version and waits until every follower holds it (so all are connected, watching and have
//! opened the object store), then publishes `--versions` timed versions of a `--size-mib`
//! buffer through [`NatsWeightsPublisher`](volley_transport::nats::NatsWeightsPublisher).
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
use volley_core::spec::{HyperParams, RunSpec};
use volley_core::subjects;
use volley_core::wire::{encode_weights, Weights};
use volley_env::EnvConfig;
use volley_policy::{Activation, PolicySpec};
use volley_transport::nats::{NatsAuth, NatsBus};
use volley_transport::{WeightsFollower, WeightsPublisher};

use crate::args::{BenchRole, BenchWeightsConfig};

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
    /// Encoded size of one weights version (the object uploaded and downloaded).
    pub size_bytes: usize,
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
    let bus = NatsBus::connect(config.nats.clone()).with_context(|| format!("connecting to {}", config.nats.url))?;
    let mut follower = bus.weights_follower(config.layout_hash, config.n_params).context("following weights")?;
    let mut out = std::io::stdout().lock();
    let mut have: Option<PolicyVersion> = None;
    let mut last_new = Instant::now();
    while !interrupted.load(Ordering::Acquire) {
        match follower.latest(have) {
            Ok(Some(weights)) => {
                let usable_at = unix_nanos();
                // A closed pipe means the driver is gone: stop.
                writeln!(out, "{},{usable_at}", weights.version.0).and_then(|()| out.flush()).context("stdout")?;
                have = Some(weights.version);
                last_new = Instant::now();
                if weights.version.0 >= config.versions {
                    return Ok(());
                }
            }
            Ok(None) => {}
            Err(err) => warn!(%err, "weights fetch failed; retrying"),
        }
        if last_new.elapsed() >= config.timeout {
            bail!("no new weights version for {:?} (have {have:?})", config.timeout);
        }
        thread::sleep(config.poll);
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
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit());
        // Followers connect as the driver does; a password travels in the environment, which
        // process listings do not show, rather than in a flag.
        if let Some(NatsAuth::UserPassword { user, password }) = &config.nats.auth {
            command.env("VOLLEY_NATS_USER", user).env("VOLLEY_NATS_PASSWORD", password);
        }
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

/// Delete the run's KV bucket and object store if they exist, so versions start from 0.
fn reset_run(bus: &NatsBus) -> anyhow::Result<()> {
    let run = &bus.config().run;
    for stream in [
        subjects::kv_backing_stream(&subjects::run_bucket(run)),
        subjects::object_backing_stream(&subjects::weights_bucket(run)),
    ] {
        let deleted = bus.handle().block_on(bus.jetstream().delete_stream(&stream));
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

/// A buffer that differs from version to version, so no layer could skip an unchanged one.
fn params_for(version: u64, n_params: usize) -> Vec<f32> {
    (0..n_params).map(|i| ((i as u64 ^ version) % 1024) as f32 * 1e-3).collect()
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
        hyper: HyperParams::default(),
        seed: 0,
    };
    bus.ensure_run(&spec).context("creating the benchmark run")?;
    let mut publisher = bus.weights_publisher().context("opening the weights store")?;

    let (reports_tx, reports) = mpsc::channel();
    let followers = spawn_followers(config, &reports_tx)?;
    drop(reports_tx);
    let warm_up = Arc::new(Weights::new(PolicyVersion(0), config.layout_hash, params_for(0, config.n_params)));
    let size_bytes = encode_weights(&warm_up).len();
    info!(followers = config.followers, size_bytes, "warm-up: waiting for every follower to hold version 0");
    publisher.publish(warm_up).context("publishing the warm-up version")?;
    if collect(config, &reports, 0, interrupted)?.is_none() {
        bail!("interrupted during warm-up");
    }

    let mut publish_ms = Vec::new();
    let mut first_ms = Vec::new();
    let mut last_ms = Vec::new();
    let mut per_follower_ms: Vec<Vec<f64>> = vec![Vec::new(); config.followers];
    for version in 1..=config.versions {
        let weights =
            Arc::new(Weights::new(PolicyVersion(version), config.layout_hash, params_for(version, config.n_params)));
        let started = unix_nanos();
        publisher.publish(weights).with_context(|| format!("publishing version {version}"))?;
        let published = unix_nanos();
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

    let summary = BenchWeightsSummary {
        size_bytes,
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

/// The human-readable report, on stderr (the JSON summary goes to stdout).
fn print_table(summary: &BenchWeightsSummary) {
    let row = |name: &str, p: &Option<Percentiles>| match p {
        Some(p) => eprintln!("{name:<22} {:>9.2} {:>9.2} {:>9.2}", p.p50, p.p99, p.max),
        None => eprintln!("{name:<22} {:>9} {:>9} {:>9}", "-", "-", "-"),
    };
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
