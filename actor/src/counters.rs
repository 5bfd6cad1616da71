//! [`ActorCounters`]: what an actor counts as it runs, shared between the rollout loop, the
//! episode starts and whoever reports progress (metrics, liveness).

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use volley_transport::envsvc::RemoteEnvCounters;

/// Counters an actor updates as it runs; shared with whoever reports progress.
#[derive(Debug, Default)]
pub struct ActorCounters {
    /// Segment publishes that failed (retried by the transport, or fatal).
    pub publish_errors: AtomicU64,
    /// Nanoseconds spent fetching new weight versions (download and verification).
    pub weight_fetch_nanos: AtomicU64,
    /// Weight fetches timed in `weight_fetch_nanos`.
    pub weight_fetches: AtomicU64,
    /// Weights pointers refused (wrong layout, size, checksum or version) or not fetchable
    /// (missing object, timeout); the actor keeps its verified version (docs/SECURITY.md).
    pub weights_refused: AtomicU64,
    /// Actions drawn from a fallback policy because the policy's output for that step had no
    /// distribution (non-finite logits or means); the step records the fallback's log-probability.
    pub policy_fallbacks: AtomicU64,
    /// Versions taken from the weights live path, and through the durable path (object store
    /// or inline pointer); live versions and live chunks refused. Copied from the follower's
    /// [`volley_transport::WeightsFollower::paths`] after each weights check.
    pub weights_live: AtomicU64,
    /// See `weights_live`.
    pub weights_durable: AtomicU64,
    /// See `weights_live`.
    pub weights_live_refused: AtomicU64,
    /// See `weights_live`.
    pub weights_live_chunks_refused: AtomicU64,
    /// Weights versions refused for carrying no signature (a follower that requires them).
    pub weights_unsigned: AtomicU64,
    /// Weights versions refused for a signature no trusted key made.
    pub weights_bad_signature: AtomicU64,
    /// The learner's pace notices: taken, refused on arrival, and times a consumer reading
    /// contradicted them. Copied from the sink's
    /// [`volley_transport::TrajectorySink::pace_notices`] after each round.
    pub pace_notices_used: AtomicU64,
    /// See `pace_notices_used`.
    pub pace_notices_refused: AtomicU64,
    /// See `pace_notices_used`.
    pub pace_notices_distrusted: AtomicU64,
    /// Work items finished (save-load / budget assignment).
    pub work_items_completed: AtomicU64,
    /// Episode snapshots saved.
    pub snapshots_saved: AtomicU64,
    /// Episodes continued from a saved state (scheduled restarts and interrupted items).
    pub episodes_resumed: AtomicU64,
    /// Saved states that could not be loaded (expired or undecodable); a fresh start was
    /// run instead.
    pub resume_failures: AtomicU64,
    /// Episodes run without a work item because the queue was empty.
    pub unscheduled_episodes: AtomicU64,
    /// Run specs read from the broker that failed their checksum or did not decode (never
    /// used; the actor reads the spec again).
    pub spec_rejected: AtomicU64,
    /// Values of the run bucket's `ended` key that were not taken as the end of the run, by
    /// reason: not a marker for this run, unsigned, or a signature no trusted key made
    /// (`volley_transport::run_end`; the run goes on).
    pub run_end_malformed: AtomicU64,
    /// See `run_end_malformed`.
    pub run_end_unsigned: AtomicU64,
    /// See `run_end_malformed`.
    pub run_end_bad_signature: AtomicU64,
    /// Environment steps taken.
    pub env_steps: AtomicU64,
    /// Segments published.
    pub segments_published: AtomicU64,
    /// Episodes finished.
    pub episodes: AtomicU64,
    /// Environment failures (error or non-finite output), each followed by a reset.
    pub env_errors: AtomicU64,
    /// Episodes cut short by an environment failure (an error, or a lost remote environment
    /// server); they are not reported as finished episodes.
    pub episodes_aborted: AtomicU64,
    /// Counters of the remote environment client, when the environments are remote.
    pub remote_env: Arc<RemoteEnvCounters>,
    /// Weight versions switched to.
    pub weight_updates: AtomicU64,
    /// Policy version in use.
    pub policy_version: AtomicU64,
    /// Nanoseconds spent blocked by transport backpressure.
    pub throttled_nanos: AtomicU64,
    /// Nanoseconds spent stepping environments.
    pub env_nanos: AtomicU64,
    /// Nanoseconds spent in policy inference.
    pub inference_nanos: AtomicU64,
    /// Mean return of this actor's last [`RETURN_WINDOW`] finished episodes, as `f64` bits
    /// (0.0 until the first episode ends).
    pub episode_return_mean_bits: AtomicU64,
    /// The sink's live pacing clock, when its transport has one: the throttled time then
    /// includes a wait still in progress (set once, by whoever opened the sink).
    pub pacing: std::sync::OnceLock<Arc<volley_transport::PacingClock>>,
    /// Whether the loop is inside [`volley_transport::TrajectorySink::publish`] now (waiting
    /// on pacing or on the broker's acknowledgements: the actor is waiting on others, not
    /// stuck).
    pub publishing: std::sync::atomic::AtomicBool,
}

impl ActorCounters {
    /// The counter of run-end values refused for `refusal`.
    pub fn run_end_refused(&self, refusal: volley_transport::run_end::RunEndRefusal) -> &AtomicU64 {
        use volley_transport::run_end::RunEndRefusal;
        match refusal {
            RunEndRefusal::Malformed => &self.run_end_malformed,
            RunEndRefusal::Unsigned => &self.run_end_unsigned,
            RunEndRefusal::BadSignature => &self.run_end_bad_signature,
        }
    }

    /// Time blocked by backpressure so far, a wait in progress included when the sink's
    /// transport reports it live.
    pub fn throttled(&self) -> Duration {
        let counted = Duration::from_nanos(self.throttled_nanos.load(Ordering::Relaxed));
        self.pacing.get().map_or(counted, |clock| clock.total().max(counted))
    }
}

/// How many of an actor's most recent episodes its mean return covers (the learner's window).
pub const RETURN_WINDOW: usize = 100;
