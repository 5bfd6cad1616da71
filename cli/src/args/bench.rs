//! `volley bench-weights`: its flags and their validated config.

use std::time::Duration;

use anyhow::{bail, Context};
use clap::{Args, ValueEnum};
use volley_core::ids::RunId;
use volley_transport::nats::NatsConfig;

use super::{check_secs, NatsArgs};

/// The part `volley bench-weights` plays.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum BenchRole {
    /// Start the followers, publish versions, report latencies.
    Driver,
    /// Follow the weights like an actor; print `version,unix_nanos` per new version.
    Follower,
}

/// How `volley bench-weights` moves the weights: Volley's path, or a raw NATS pattern that
/// moves the same bytes (the baselines of issue 16, item 2).
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum BenchPattern {
    /// Volley's weights publisher and followers (frames, pointer, deltas, verification).
    Volley,
    /// A plain JetStream object-store put per version, a core-NATS notice, and an object get in
    /// every follower (no decoding, no verification beyond the object store's own digest).
    RawObject,
    /// Core-NATS fan-out: the frame's bytes published in chunks on one subject that every
    /// follower subscribes to (no persistence, no acknowledgement).
    RawCore,
}

impl BenchPattern {
    /// The flag's value.
    pub fn name(self) -> &'static str {
        match self {
            BenchPattern::Volley => "volley",
            BenchPattern::RawObject => "raw-object",
            BenchPattern::RawCore => "raw-core",
        }
    }
}

/// `volley bench-weights`: weight-broadcast latency from the learner's publish to every actor
/// holding the version (see `cli/src/bench.rs`). Needs a running nats-server; starts none.
#[derive(Debug, Args)]
pub struct BenchWeightsArgs {
    /// NATS connection.
    #[command(flatten)]
    pub nats: NatsArgs,
    /// Run whose buckets the benchmark uses; the driver deletes and re-creates its KV bucket
    /// and weights store, so never point it at a real run (hence not `VOLLEY_RUN`: the
    /// benchmark's own flags read `VOLLEY_BENCH_*` variables).
    #[arg(long, default_value = "bench-weights", env = "VOLLEY_BENCH_RUN")]
    pub run: String,
    /// Driver (the default) or one follower (started by the driver).
    #[arg(long, value_enum, default_value = "driver", env = "VOLLEY_BENCH_ROLE")]
    pub role: BenchRole,
    /// Follower processes the driver starts.
    #[arg(long, default_value_t = 8, env = "VOLLEY_BENCH_FOLLOWERS")]
    pub followers: usize,
    /// Size of the weights buffer in MiB (f32 parameters).
    #[arg(long, default_value_t = 1.0, env = "VOLLEY_BENCH_SIZE_MIB")]
    pub size_mib: f64,
    /// Timed versions, after one warm-up version.
    #[arg(long, default_value_t = 30, env = "VOLLEY_BENCH_VERSIONS")]
    pub versions: u64,
    /// Pause after every follower holds a version, before the next publish.
    #[arg(long, default_value_t = 200, env = "VOLLEY_BENCH_PAUSE_MS")]
    pub pause_ms: u64,
    /// How often a follower asks for a newer version (an actor asks between segments); 0: it
    /// waits for each version (woken by the pointer watch or a completed live frame), as the
    /// raw patterns' followers wait on their subscription.
    #[arg(long, default_value_t = 1.0, env = "VOLLEY_BENCH_POLL_MS")]
    pub poll_ms: f64,
    /// Layout hash (hex) driver and followers agree on; the buffer is not a real policy.
    #[arg(long, default_value = "62656e6368776774", env = "VOLLEY_BENCH_LAYOUT_HASH")]
    pub layout_hash: String,
    /// Give up when a version has not reached every follower (driver), or no new version came
    /// (follower), within this many seconds.
    #[arg(long, default_value_t = 60.0, env = "VOLLEY_BENCH_TIMEOUT_SECS")]
    pub timeout_secs: f64,
    /// A full frame every this many versions, deltas in between (1: every version full).
    #[arg(long, default_value_t = 16, env = "VOLLEY_BENCH_ANCHOR_EVERY")]
    pub anchor_every: u64,
    /// Weights whose full frame is at most this many KiB go inline in the pointer (0: never).
    #[arg(long, default_value_t = 256, env = "VOLLEY_BENCH_INLINE_MAX_KIB")]
    pub inline_max_kib: usize,
    /// Volley's weights path, or a raw NATS pattern moving the same bytes.
    #[arg(long, value_enum, default_value = "volley", env = "VOLLEY_BENCH_PATTERN")]
    pub pattern: BenchPattern,
}

/// A validated `volley bench-weights` configuration.
#[derive(Debug, Clone)]
pub struct BenchWeightsConfig {
    /// Transport config (its run is the benchmark's).
    pub nats: NatsConfig,
    /// Driver or follower.
    pub role: BenchRole,
    /// Follower processes.
    pub followers: usize,
    /// Buffer size in MiB, as given (passed on to the followers).
    pub size_mib: f64,
    /// Parameters per version: `size_mib` MiB of f32.
    pub n_params: usize,
    /// The agreed layout hash.
    pub layout_hash: u64,
    /// Timed versions (the last version number).
    pub versions: u64,
    /// Pause between versions.
    pub pause: Duration,
    /// Follower poll interval.
    pub poll: Duration,
    /// Per-version (driver) or idle (follower) limit.
    pub timeout: Duration,
    /// Volley's path or a raw pattern.
    pub pattern: BenchPattern,
}

impl TryFrom<BenchWeightsArgs> for BenchWeightsConfig {
    type Error = anyhow::Error;

    fn try_from(args: BenchWeightsArgs) -> anyhow::Result<Self> {
        let run = RunId::new(args.run.clone()).context("--run")?;
        if args.followers == 0 || args.followers > 256 {
            bail!("--followers: {} out of range 1..=256", args.followers);
        }
        if !(args.size_mib.is_finite() && args.size_mib > 0.0 && args.size_mib <= 1024.0) {
            bail!("--size-mib: {} out of range (0, 1024]", args.size_mib);
        }
        let n_params = ((args.size_mib * 1024.0 * 1024.0 / 4.0).round() as usize).max(1);
        if args.versions == 0 {
            bail!("--versions must be at least 1");
        }
        let layout_hash = u64::from_str_radix(args.layout_hash.trim_start_matches("0x"), 16)
            .with_context(|| format!("--layout-hash: {:?} is not a 64-bit hex number", args.layout_hash))?;
        // 0: each follower waits for the next version instead of polling.
        let poll = if args.poll_ms == 0.0 { Duration::ZERO } else { check_secs("--poll-ms", args.poll_ms * 1e-3)? };
        let timeout = check_secs("--timeout-secs", args.timeout_secs)?;
        if args.anchor_every == 0 {
            bail!("--anchor-every must be at least 1");
        }
        let mut nats = args.nats.config(run)?;
        nats.weights_anchor_every = args.anchor_every;
        nats.weights_inline_max_bytes = args.inline_max_kib.saturating_mul(1024);
        Ok(BenchWeightsConfig {
            nats,
            role: args.role,
            followers: args.followers,
            size_mib: args.size_mib,
            n_params,
            layout_hash,
            versions: args.versions,
            pause: Duration::from_millis(args.pause_ms),
            poll,
            timeout,
            pattern: args.pattern,
        })
    }
}
