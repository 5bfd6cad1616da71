//! The actor's Prometheus metrics: the only place they are declared. They read the
//! [`ActorCounters`] the rollout loop already keeps, at scrape time, so the hot loop pays
//! nothing extra.

use std::sync::atomic::Ordering;
use std::sync::Arc;

use prometheus::core::{Collector, Desc};
use prometheus::proto::MetricFamily;
use prometheus::{Counter, Gauge, IntCounter, IntCounterVec, Opts, Registry};

use crate::counters::ActorCounters;

/// Exports an actor's counters.
pub struct ActorMetrics {
    counters: Arc<ActorCounters>,
    env_steps: IntCounter,
    episodes: IntCounter,
    segments_published: IntCounter,
    env_errors: IntCounter,
    episodes_aborted: IntCounter,
    env_sessions_lost: IntCounter,
    weight_updates: IntCounter,
    policy_version: Gauge,
    throttled_seconds: Counter,
    env_seconds: Counter,
    inference_seconds: Counter,
    publish_errors: IntCounter,
    weight_fetch_seconds: Counter,
    weight_fetches: IntCounter,
    weights_refused: IntCounter,
    policy_fallbacks: IntCounter,
    weights_taken: IntCounterVec,
    weights_live_refused: IntCounterVec,
    weights_signature_refused: IntCounterVec,
    pace_notices: IntCounterVec,
    work_items_completed: IntCounter,
    snapshots_saved: IntCounter,
    episodes_resumed: IntCounter,
    resume_failures: IntCounter,
    unscheduled_episodes: IntCounter,
    spec_rejected: IntCounter,
    run_end_refused: IntCounterVec,
    episode_return_mean: Gauge,
    descs: Vec<Desc>,
}

impl ActorMetrics {
    /// Register the actor's metrics, backed by `counters`.
    pub fn register(registry: &Registry, counters: Arc<ActorCounters>) -> prometheus::Result<()> {
        let int = |name: &str, help: &str| IntCounter::with_opts(Opts::new(name, help));
        let float = |name: &str, help: &str| Counter::with_opts(Opts::new(name, help));
        let metrics = ActorMetrics {
            counters,
            env_steps: int("volley_actor_env_steps_total", "Environment steps taken.")?,
            episodes: int("volley_actor_episodes_total", "Episodes finished.")?,
            segments_published: int("volley_actor_segments_published_total", "Segments published to the learner.")?,
            env_errors: int(
                "volley_actor_env_errors_total",
                "Environment failures (error or non-finite output), each followed by a reset.",
            )?,
            episodes_aborted: int(
                "volley_actor_episodes_aborted_total",
                "Episodes cut short by an environment failure or a lost remote environment server (not reported as finished).",
            )?,
            env_sessions_lost: int(
                "volley_actor_env_sessions_lost_total",
                "Remote environment sessions lost (server died, timed out or forgot the session); each aborts its episodes.",
            )?,
            weight_updates: int("volley_actor_weight_updates_total", "Policy versions switched to.")?,
            policy_version: Gauge::with_opts(Opts::new(
                "volley_actor_policy_version",
                "Policy version the actor is acting with.",
            ))?,
            throttled_seconds: float(
                "volley_actor_throttled_seconds_total",
                "Time spent waiting because the learner's backlog was full (pacing).",
            )?,
            env_seconds: float("volley_actor_env_seconds_total", "Time spent stepping environments.")?,
            inference_seconds: float(
                "volley_actor_inference_seconds_total",
                "Time spent in policy inference and action sampling.",
            )?,
            publish_errors: int(
                "volley_actor_publish_errors_total",
                "Segment publishes that failed: retried by the transport (lost ack, broker error) or fatal.",
            )?,
            weight_fetch_seconds: float(
                "volley_actor_weight_fetch_seconds_total",
                "Time spent fetching new policy versions (download and checksum); divide by fetches for the mean latency.",
            )?,
            weight_fetches: int("volley_actor_weight_fetches_total", "New policy versions fetched and timed.")?,
            weights_refused: int(
                "volley_actor_weights_refused_total",
                "Weights pointers refused (layout, size, checksum, version) or not fetchable; the actor kept its verified version.",
            )?,
            policy_fallbacks: int(
                "volley_actor_policy_fallback_actions_total",
                "Actions drawn from a fallback policy (uniform, or the standard normal) because the policy's output for that step was not finite; each records the fallback's log-probability.",
            )?,
            weights_taken: IntCounterVec::new(
                Opts::new(
                    "volley_actor_weights_taken_total",
                    "Policy versions taken, by path: live (core-NATS fan-out to connected actors) or durable (object store, or inline in the pointer).",
                ),
                &["path"],
            )?,
            weights_live_refused: IntCounterVec::new(
                Opts::new(
                    "volley_actor_weights_live_refused_total",
                    "Live weights refused: reassembled versions (frame, digest or pointer mismatch; each fell back to the durable path) and chunks on arrival (corrupt, another layout, too large, inconsistent).",
                ),
                &["what"],
            )?,
            weights_signature_refused: IntCounterVec::new(
                Opts::new(
                    "volley_actor_weights_signature_refused_total",
                    "Weights versions refused by an actor that requires signed weights (--weights-public-key), live or durable, by reason: unsigned (no signature), bad_signature (no trusted key signed this run, version and parameters).",
                ),
                &["reason"],
            )?,
            pace_notices: IntCounterVec::new(
                Opts::new(
                    "volley_actor_pace_notices_total",
                    "The learner's pace notices (pushed pacing), by outcome: used as the learner's position, refused on arrival (corrupt, malformed), distrusted (a consumer reading contradicted them; they were ignored for a second).",
                ),
                &["outcome"],
            )?,
            work_items_completed: int(
                "volley_actor_work_items_completed_total",
                "Work items finished (scheduled episodes, save-load).",
            )?,
            snapshots_saved: int("volley_actor_snapshots_saved_total", "Episode snapshots saved to the snapshot store.")?,
            episodes_resumed: int(
                "volley_actor_episodes_resumed_total",
                "Episodes continued from a saved state (scheduled restarts and interrupted work items).",
            )?,
            resume_failures: int(
                "volley_actor_resume_failures_total",
                "Saved states that could not be loaded (expired or undecodable); a fresh start ran instead.",
            )?,
            unscheduled_episodes: int(
                "volley_actor_unscheduled_episodes_total",
                "Episodes run without a work item because the work queue was empty.",
            )?,
            spec_rejected: int(
                "volley_actor_spec_rejected_total",
                "Run specs read from NATS that failed their checksum (corrupt) or did not decode; never used, read again.",
            )?,
            run_end_refused: IntCounterVec::new(
                Opts::new(
                    "volley_actor_run_end_refused_total",
                    "Values of the run's `ended` key not taken as the end of the run (the actor goes on), by reason: malformed (not a run-end marker for this run, e.g. an answer a client had stored there), unsigned (an actor with --weights-public-key reads only signed markers), bad_signature (no trusted key signed this run and reason).",
                ),
                &["reason"],
            )?,
            episode_return_mean: Gauge::with_opts(Opts::new(
                "volley_actor_episode_return_mean",
                "Mean return of this actor's last 100 finished episodes (0 until one ends).",
            ))?,
            descs: Vec::new(),
        };
        let mut metrics = metrics;
        metrics.descs = metrics.parts().iter().flat_map(|c| c.desc().into_iter().cloned()).collect();
        registry.register(Box::new(metrics))
    }

    fn parts(&self) -> [&dyn Collector; 28] {
        [
            &self.env_steps,
            &self.episodes,
            &self.segments_published,
            &self.env_errors,
            &self.episodes_aborted,
            &self.env_sessions_lost,
            &self.weight_updates,
            &self.policy_version,
            &self.throttled_seconds,
            &self.env_seconds,
            &self.inference_seconds,
            &self.publish_errors,
            &self.weight_fetch_seconds,
            &self.weight_fetches,
            &self.weights_refused,
            &self.policy_fallbacks,
            &self.weights_taken,
            &self.weights_live_refused,
            &self.weights_signature_refused,
            &self.pace_notices,
            &self.work_items_completed,
            &self.snapshots_saved,
            &self.episodes_resumed,
            &self.resume_failures,
            &self.unscheduled_episodes,
            &self.spec_rejected,
            &self.run_end_refused,
            &self.episode_return_mean,
        ]
    }
}

/// Move a monotonic counter up to `target` (counters only go up; the sources are monotonic).
fn catch_up_int(counter: &IntCounter, target: u64) {
    let now = counter.get();
    if target > now {
        counter.inc_by(target - now);
    }
}

fn catch_up_secs(counter: &Counter, nanos: u64) {
    let target = nanos as f64 * 1e-9;
    let now = counter.get();
    if target > now {
        counter.inc_by(target - now);
    }
}

impl Collector for ActorMetrics {
    fn desc(&self) -> Vec<&Desc> {
        self.descs.iter().collect()
    }

    fn collect(&self) -> Vec<MetricFamily> {
        let c = &self.counters;
        catch_up_int(&self.env_steps, c.env_steps.load(Ordering::Relaxed));
        catch_up_int(&self.episodes, c.episodes.load(Ordering::Relaxed));
        catch_up_int(&self.segments_published, c.segments_published.load(Ordering::Relaxed));
        catch_up_int(&self.env_errors, c.env_errors.load(Ordering::Relaxed));
        catch_up_int(&self.episodes_aborted, c.episodes_aborted.load(Ordering::Relaxed));
        catch_up_int(&self.env_sessions_lost, c.remote_env.sessions_lost.load(Ordering::Relaxed));
        catch_up_int(&self.weight_updates, c.weight_updates.load(Ordering::Relaxed));
        self.policy_version.set(c.policy_version.load(Ordering::Relaxed) as f64);
        catch_up_secs(&self.throttled_seconds, c.throttled().as_nanos() as u64);
        catch_up_secs(&self.env_seconds, c.env_nanos.load(Ordering::Relaxed));
        catch_up_secs(&self.inference_seconds, c.inference_nanos.load(Ordering::Relaxed));
        catch_up_int(&self.publish_errors, c.publish_errors.load(Ordering::Relaxed));
        catch_up_secs(&self.weight_fetch_seconds, c.weight_fetch_nanos.load(Ordering::Relaxed));
        catch_up_int(&self.weight_fetches, c.weight_fetches.load(Ordering::Relaxed));
        catch_up_int(&self.weights_refused, c.weights_refused.load(Ordering::Relaxed));
        catch_up_int(&self.policy_fallbacks, c.policy_fallbacks.load(Ordering::Relaxed));
        catch_up_int(&self.weights_taken.with_label_values(&["live"]), c.weights_live.load(Ordering::Relaxed));
        catch_up_int(&self.weights_taken.with_label_values(&["durable"]), c.weights_durable.load(Ordering::Relaxed));
        catch_up_int(
            &self.weights_live_refused.with_label_values(&["version"]),
            c.weights_live_refused.load(Ordering::Relaxed),
        );
        catch_up_int(
            &self.weights_live_refused.with_label_values(&["chunk"]),
            c.weights_live_chunks_refused.load(Ordering::Relaxed),
        );
        for (reason, counter) in [("unsigned", &c.weights_unsigned), ("bad_signature", &c.weights_bad_signature)] {
            catch_up_int(&self.weights_signature_refused.with_label_values(&[reason]), counter.load(Ordering::Relaxed));
        }
        for (outcome, counter) in [
            ("used", &c.pace_notices_used),
            ("refused", &c.pace_notices_refused),
            ("distrusted", &c.pace_notices_distrusted),
        ] {
            catch_up_int(&self.pace_notices.with_label_values(&[outcome]), counter.load(Ordering::Relaxed));
        }
        catch_up_int(&self.work_items_completed, c.work_items_completed.load(Ordering::Relaxed));
        catch_up_int(&self.snapshots_saved, c.snapshots_saved.load(Ordering::Relaxed));
        catch_up_int(&self.episodes_resumed, c.episodes_resumed.load(Ordering::Relaxed));
        catch_up_int(&self.resume_failures, c.resume_failures.load(Ordering::Relaxed));
        catch_up_int(&self.unscheduled_episodes, c.unscheduled_episodes.load(Ordering::Relaxed));
        catch_up_int(&self.spec_rejected, c.spec_rejected.load(Ordering::Relaxed));
        for refusal in volley_transport::run_end::RunEndRefusal::ALL {
            catch_up_int(
                &self.run_end_refused.with_label_values(&[refusal.reason()]),
                c.run_end_refused(refusal).load(Ordering::Relaxed),
            );
        }
        self.episode_return_mean.set(f64::from_bits(c.episode_return_mean_bits.load(Ordering::Relaxed)));
        self.parts().iter().flat_map(|c| c.collect()).collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use prometheus::{Encoder, TextEncoder};

    #[test]
    fn scrape_reflects_the_counters() {
        let registry = Registry::new();
        let counters = Arc::new(ActorCounters::default());
        ActorMetrics::register(&registry, counters.clone()).expect("register");
        counters.env_steps.store(1234, Ordering::Relaxed);
        counters.throttled_nanos.store(1_500_000_000, Ordering::Relaxed);
        counters.policy_version.store(7, Ordering::Relaxed);
        counters.publish_errors.store(2, Ordering::Relaxed);
        counters.weight_fetch_nanos.store(250_000_000, Ordering::Relaxed);
        counters.weight_fetches.store(5, Ordering::Relaxed);
        counters.episodes_aborted.store(3, Ordering::Relaxed);
        counters.remote_env.sessions_lost.store(2, Ordering::Relaxed);
        counters.episode_return_mean_bits.store(21.5f64.to_bits(), Ordering::Relaxed);
        counters.weights_live.store(9, Ordering::Relaxed);
        counters.weights_durable.store(1, Ordering::Relaxed);
        counters.weights_live_chunks_refused.store(4, Ordering::Relaxed);
        counters.weights_bad_signature.store(2, Ordering::Relaxed);
        counters.pace_notices_distrusted.store(1, Ordering::Relaxed);
        counters.run_end_malformed.store(3, Ordering::Relaxed);
        let mut text = Vec::new();
        TextEncoder::new().encode(&registry.gather(), &mut text).expect("encode");
        let text = String::from_utf8(text).expect("utf-8");
        assert!(text.contains("volley_actor_env_steps_total 1234"), "{text}");
        assert!(text.contains("volley_actor_throttled_seconds_total 1.5"), "{text}");
        assert!(text.contains("volley_actor_policy_version 7"), "{text}");
        assert!(text.contains("volley_actor_publish_errors_total 2"), "{text}");
        assert!(text.contains("volley_actor_weight_fetch_seconds_total 0.25"), "{text}");
        assert!(text.contains("volley_actor_weight_fetches_total 5"), "{text}");
        assert!(text.contains("volley_actor_episodes_aborted_total 3"), "{text}");
        assert!(text.contains("volley_actor_env_sessions_lost_total 2"), "{text}");
        assert!(text.contains("volley_actor_episode_return_mean 21.5"), "{text}");
        assert!(text.contains("volley_actor_weights_taken_total{path=\"live\"} 9"), "{text}");
        assert!(text.contains("volley_actor_run_end_refused_total{reason=\"malformed\"} 3"), "{text}");
        assert!(text.contains("volley_actor_run_end_refused_total{reason=\"unsigned\"} 0"), "{text}");
        assert!(text.contains("volley_actor_weights_taken_total{path=\"durable\"} 1"), "{text}");
        assert!(text.contains("volley_actor_weights_live_refused_total{what=\"chunk\"} 4"), "{text}");
        assert!(text.contains("volley_actor_weights_live_refused_total{what=\"version\"} 0"), "{text}");
        assert!(text.contains("volley_actor_weights_signature_refused_total{reason=\"bad_signature\"} 2"), "{text}");
        assert!(text.contains("volley_actor_weights_signature_refused_total{reason=\"unsigned\"} 0"), "{text}");
        assert!(text.contains("volley_actor_pace_notices_total{outcome=\"distrusted\"} 1"), "{text}");
        assert!(text.contains("# HELP volley_actor_env_steps_total Environment steps taken."));
    }
}
