//! The actor's Prometheus metrics: the only place they are declared. They read the
//! [`ActorCounters`] the rollout loop already keeps, at scrape time, so the hot loop pays
//! nothing extra.

use std::sync::atomic::Ordering;
use std::sync::Arc;

use prometheus::core::{Collector, Desc};
use prometheus::proto::MetricFamily;
use prometheus::{Counter, Gauge, IntCounter, Opts, Registry};

use crate::rollout::ActorCounters;

/// Exports an actor's counters.
pub struct ActorMetrics {
    counters: Arc<ActorCounters>,
    env_steps: IntCounter,
    episodes: IntCounter,
    segments_published: IntCounter,
    env_errors: IntCounter,
    weight_updates: IntCounter,
    policy_version: Gauge,
    throttled_seconds: Counter,
    env_seconds: Counter,
    inference_seconds: Counter,
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

    fn parts(&self) -> [&dyn Collector; 10] {
        [
            &self.env_steps,
            &self.episodes,
            &self.segments_published,
            &self.env_errors,
            &self.weight_updates,
            &self.policy_version,
            &self.throttled_seconds,
            &self.env_seconds,
            &self.inference_seconds,
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
        catch_up_int(&self.weight_updates, c.weight_updates.load(Ordering::Relaxed));
        self.policy_version.set(c.policy_version.load(Ordering::Relaxed) as f64);
        catch_up_secs(&self.throttled_seconds, c.throttled_nanos.load(Ordering::Relaxed));
        catch_up_secs(&self.env_seconds, c.env_nanos.load(Ordering::Relaxed));
        catch_up_secs(&self.inference_seconds, c.inference_nanos.load(Ordering::Relaxed));
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
        counters.episode_return_mean_bits.store(21.5f64.to_bits(), Ordering::Relaxed);
        let mut text = Vec::new();
        TextEncoder::new().encode(&registry.gather(), &mut text).expect("encode");
        let text = String::from_utf8(text).expect("utf-8");
        assert!(text.contains("volley_actor_env_steps_total 1234"), "{text}");
        assert!(text.contains("volley_actor_throttled_seconds_total 1.5"), "{text}");
        assert!(text.contains("volley_actor_policy_version 7"), "{text}");
        assert!(text.contains("volley_actor_episode_return_mean 21.5"), "{text}");
        assert!(text.contains("# HELP volley_actor_env_steps_total Environment steps taken."));
    }
}
