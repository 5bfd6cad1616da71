//! The HTTP endpoint every long-running process serves: `/metrics` (Prometheus text),
//! `/healthz` (the main loop has made progress recently: a Kubernetes liveness probe) and
//! `/readyz` (connected, and the role's first weights published or received: a readiness
//! probe). Both answer 503 with the reason when they fail.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::thread;
use std::time::{Duration, Instant};

use anyhow::Context;
use prometheus::{Encoder, IntGaugeVec, Opts, Registry, TextEncoder};
use tracing::{info, warn};

/// A health check: `Ok` or the reason it fails (the 503 body).
pub type Probe = Arc<dyn Fn() -> Result<(), String> + Send + Sync>;

/// A readiness probe: connected to NATS through `client`, and `holds` (else `not_yet` is the
/// reason).
pub fn connected_and(
    client: async_nats::Client,
    holds: impl Fn() -> bool + Send + Sync + 'static,
    not_yet: &'static str,
) -> Probe {
    Arc::new(move || {
        let state = client.connection_state();
        if state != async_nats::connection::State::Connected {
            Err(format!("not connected to NATS ({state})"))
        } else if !holds() {
            Err(not_yet.into())
        } else {
            Ok(())
        }
    })
}

/// When the main loop last made progress; `/healthz` fails once that is longer ago than the
/// timeout. Shared between the loop (which beats) and the HTTP thread (which reads).
#[derive(Debug)]
pub struct Heartbeat {
    started: Instant,
    /// Milliseconds after `started` of the last beat.
    last_ms: AtomicU64,
}

impl Heartbeat {
    /// A heartbeat that has just beaten.
    pub fn new() -> Arc<Self> {
        Arc::new(Heartbeat { started: Instant::now(), last_ms: AtomicU64::new(0) })
    }

    /// The loop made progress.
    pub fn beat(&self) {
        self.last_ms.fetch_max(self.started.elapsed().as_millis() as u64, Ordering::AcqRel);
    }

    /// Time since the last beat.
    pub fn since(&self) -> Duration {
        self.started.elapsed().saturating_sub(Duration::from_millis(self.last_ms.load(Ordering::Acquire)))
    }

    /// A liveness probe: fails once no beat came for `timeout`, saying what `what` is.
    pub fn probe(self: &Arc<Self>, timeout: Duration, what: &'static str) -> Probe {
        let heartbeat = self.clone();
        Arc::new(move || {
            let since = heartbeat.since();
            if since > timeout {
                Err(format!("{what}: no progress for {:.0} s (limit {} s)\n", since.as_secs_f64(), timeout.as_secs()))
            } else {
                Ok(())
            }
        })
    }
}

/// A registry with `volley_build_info{version, role} 1` already in it.
pub fn registry_for(role: &str) -> anyhow::Result<Registry> {
    let registry = Registry::new();
    let build_info = IntGaugeVec::new(
        Opts::new("volley_build_info", "Build of this process: version and role labels, value 1."),
        &["version", "role"],
    )?;
    build_info.with_label_values(&[env!("CARGO_PKG_VERSION"), role]).set(1);
    registry.register(Box::new(build_info))?;
    Ok(registry)
}

/// Serve the endpoints on `addr` from a background thread; returns the bound address (useful
/// with port 0).
pub fn serve(addr: &str, registry: Registry, ready: Probe, live: Probe) -> anyhow::Result<SocketAddr> {
    let server = tiny_http::Server::http(addr)
        .map_err(|err| anyhow::anyhow!("{err}"))
        .with_context(|| format!("serving metrics on {addr}"))?;
    let bound = server.server_addr().to_ip().context("metrics server address")?;
    info!(address = %bound, "serving /metrics, /healthz and /readyz");
    thread::Builder::new()
        .name("volley-metrics".into())
        .spawn(move || {
            for request in server.incoming_requests() {
                let (status, content_type, body) = match request.url() {
                    "/metrics" => {
                        let mut body = Vec::new();
                        let encoder = TextEncoder::new();
                        match encoder.encode(&registry.gather(), &mut body) {
                            Ok(()) => (200, encoder.format_type().to_string(), body),
                            Err(err) => (500, "text/plain".into(), err.to_string().into_bytes()),
                        }
                    }
                    "/healthz" => match live() {
                        Ok(()) => (200, "text/plain".into(), b"ok\n".to_vec()),
                        Err(reason) => (503, "text/plain".into(), reason.into_bytes()),
                    },
                    "/readyz" => match ready() {
                        Ok(()) => (200, "text/plain".into(), b"ready\n".to_vec()),
                        Err(reason) => (503, "text/plain".into(), format!("not ready: {reason}\n").into_bytes()),
                    },
                    _ => (404, "text/plain".into(), b"not found\n".to_vec()),
                };
                let header = tiny_http::Header::from_bytes("Content-Type", content_type.as_bytes())
                    .expect("content types are valid header values");
                let response = tiny_http::Response::from_data(body).with_status_code(status).with_header(header);
                if let Err(err) = request.respond(response) {
                    warn!(%err, "metrics response failed");
                }
            }
        })
        .context("spawning the metrics thread")?;
    Ok(bound)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::BTreeSet;
    use volley_actor::ActorMetrics;
    use volley_core::ids::RunId;
    use volley_core::spec::{HyperParams, RunSpec};
    use volley_env::EnvConfig;
    use volley_learner::{Learner, LearnerMetrics, LearnerReport, UpdateStats};
    use volley_policy::{Activation, CoreKind, PolicySpec};

    fn exported_names() -> BTreeSet<String> {
        let learner_registry = registry_for("learner").expect("registry");
        let mut metrics = LearnerMetrics::register(&learner_registry).expect("learner metrics");
        let spec = RunSpec {
            run: RunId::new("docs").expect("valid"),
            env: EnvConfig::Cartpole,
            policy: PolicySpec {
                obs_dim: 4,
                n_actions: 2,
                torso: vec![4],
                activation: Activation::Tanh,
                core: CoreKind::Mlp,
                head: volley_policy::ActionHead::Categorical,
                conv: None,
                normalize_obs: false,
                critic: Vec::new(),
            },
            segment_len: 4,
            hyper: HyperParams::default(),
            seed: 0,
        };
        let learner = Learner::new(spec).expect("valid spec");
        let mut report = LearnerReport { lag_histogram: vec![1; 16], ..LearnerReport::default() };
        report.segments_rejected.insert("shape", 1);
        metrics.observe(&learner, &report, &UpdateStats::default(), true);
        let mut actor_lag = volley_learner::metrics::ActorLag::register(&learner_registry).expect("actor lag");
        actor_lag.observe("actor-0", 1);
        let work = volley_learner::metrics::WorkMetrics::register(&learner_registry).expect("work metrics");
        let scheduler = volley_learner::scheduler::Scheduler::new(
            &volley_core::work::WorkConfig::default(),
            &EnvConfig::Cartpole,
            0,
            0,
        );
        work.observe(&scheduler);
        let actor_registry = registry_for("actor").expect("registry");
        ActorMetrics::register(&actor_registry, Default::default()).expect("actor metrics");
        learner_registry.gather().iter().chain(actor_registry.gather().iter()).map(|f| f.name().to_string()).collect()
    }

    fn documented_names() -> BTreeSet<String> {
        let doc = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/../docs/OPERATIONS.md"))
            .expect("docs/OPERATIONS.md");
        doc.lines()
            .filter_map(|line| line.strip_prefix("| `volley_"))
            .map(|rest| format!("volley_{}", rest.split(['`', '{']).next().expect("a name")))
            .collect()
    }

    #[test]
    fn operations_doc_lists_exactly_the_exported_metrics() {
        assert_eq!(exported_names(), documented_names());
    }

    /// Every `volley_*` metric name in a PromQL expression, histogram suffixes removed.
    fn metric_names(expr: &str) -> Vec<String> {
        let mut names = Vec::new();
        let mut rest = expr;
        while let Some(start) = rest.find("volley_") {
            let tail = &rest[start..];
            let end = tail.find(|c: char| !(c.is_ascii_alphanumeric() || c == '_')).unwrap_or(tail.len());
            let name = &tail[..end];
            let base = ["_bucket", "_sum", "_count"].iter().find_map(|s| name.strip_suffix(s)).unwrap_or(name);
            names.push(base.to_string());
            rest = &tail[end..];
        }
        names
    }

    #[test]
    fn dashboards_reference_only_exported_metrics() {
        let exported = exported_names();
        let dir = concat!(env!("CARGO_MANIFEST_DIR"), "/../dashboards");
        let mut checked = 0;
        let mut uids = BTreeSet::new();
        for entry in std::fs::read_dir(dir).expect("dashboards/") {
            let path = entry.expect("entry").path();
            if path.extension().is_none_or(|e| e != "json") {
                continue;
            }
            let text = std::fs::read_to_string(&path).expect("readable");
            let dashboard: serde_json::Value = serde_json::from_str(&text).expect("dashboard JSON parses");
            let file = path.display();
            assert!(dashboard["id"].is_null(), "{file}: provisioned dashboards have id null");
            let uid = dashboard["uid"].as_str().expect("uid");
            assert!((8..=40).contains(&uid.len()), "{file}: uid {uid:?} must be 8-40 characters");
            assert!(uids.insert(uid.to_string()), "{file}: uid {uid} is used by another dashboard");
            let mut ids = BTreeSet::new();
            // Panels of a collapsed row live inside the row.
            let top = dashboard["panels"].as_array().expect("panels");
            let nested = top.iter().filter_map(|p| p["panels"].as_array()).flatten();
            for panel in top.iter().chain(nested) {
                assert!(ids.insert(panel["id"].as_u64().expect("panel id")), "{file}: duplicate panel id");
                if panel["type"] == "row" {
                    continue;
                }
                assert_eq!(
                    panel["datasource"]["uid"], "${datasource}",
                    "{file}: {} uses a fixed datasource",
                    panel["title"]
                );
                assert!(panel["fieldConfig"]["defaults"]["unit"].is_string(), "{file}: {} has no unit", panel["title"]);
                for target in panel["targets"].as_array().expect("targets") {
                    let expr = target["expr"].as_str().expect("expr");
                    if expr.contains("rate(") {
                        assert!(expr.contains("$__rate_interval"), "{file}: {expr} should use $__rate_interval");
                    }
                    for name in metric_names(expr) {
                        assert!(exported.contains(&name), "{file}: {name} is not exported by any volley process");
                        checked += 1;
                    }
                }
            }
        }
        assert!(checked > 20, "the dashboards reference volley metrics ({checked} checked)");
        for uid in ["volley-overview", "volley-actors", "volley-nats-jetstream"] {
            assert!(uids.contains(uid), "dashboard {uid} is missing: {uids:?}");
        }
    }

    fn get(addr: SocketAddr, path: &str) -> (u16, String) {
        use std::io::{Read, Write};
        let mut stream = std::net::TcpStream::connect(addr).expect("connect");
        write!(stream, "GET {path} HTTP/1.0\r\nHost: x\r\n\r\n").expect("request");
        let mut text = String::new();
        stream.read_to_string(&mut text).expect("response");
        let status = text.split_whitespace().nth(1).and_then(|s| s.parse().ok()).expect("status");
        (status, text.split("\r\n\r\n").nth(1).unwrap_or_default().to_string())
    }

    #[test]
    fn probes_answer_503_with_their_reason() {
        // Long enough that a request sent right after a beat is answered within it on a loaded
        // machine (200 ms may not be); the failure without beats is waited for, not slept for.
        let timeout = Duration::from_secs(2);
        let heartbeat = Heartbeat::new();
        let ready_flag = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let flag = ready_flag.clone();
        let ready: Probe =
            Arc::new(move || if flag.load(Ordering::Acquire) { Ok(()) } else { Err("no weights yet".into()) });
        let addr =
            serve("127.0.0.1:0", registry_for("test").expect("registry"), ready, heartbeat.probe(timeout, "test loop"))
                .expect("serve");
        heartbeat.beat();
        assert_eq!(get(addr, "/healthz").0, 200);
        let (status, body) = get(addr, "/readyz");
        assert_eq!((status, body.as_str()), (503, "not ready: no weights yet\n"));
        ready_flag.store(true, Ordering::Release);
        assert_eq!(get(addr, "/readyz").0, 200);
        let started = Instant::now();
        let body = loop {
            let (status, body) = get(addr, "/healthz");
            if status == 503 {
                break body;
            }
            assert_eq!(status, 200, "{body}");
            assert!(started.elapsed() < Duration::from_secs(60), "/healthz never failed without beats");
            std::thread::sleep(Duration::from_millis(50));
        };
        assert!(heartbeat.since() > timeout, "failed {:?} after the last beat", heartbeat.since());
        assert!(body.starts_with("test loop: no progress for"), "{body}");
        heartbeat.beat();
        assert_eq!(get(addr, "/healthz").0, 200);
        assert_eq!(get(addr, "/nope").0, 404);
    }

    #[test]
    fn metric_names_are_found_in_expressions() {
        let names =
            metric_names("histogram_quantile(0.5, sum by (le) (rate(volley_learner_policy_lag_bucket{a=\"b\"}[5m])))");
        assert_eq!(names, vec!["volley_learner_policy_lag".to_string()]);
        assert_eq!(metric_names("max(volley_a) - min(volley_b_total)"), vec!["volley_a", "volley_b_total"]);
    }
}
