//! `volley env-serve`: a built-in environment as an environment service over NATS.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::Context;
use tracing::info;
use volley_env::EnvConfig;
use volley_transport::envsvc::{connect_env_server, EnvFactory, EnvServer};

use crate::args::EnvServeArgs;
use crate::remote_env::CONNECT_TIMEOUT;

/// Serve until interrupted (SIGINT or SIGTERM): the service is deregistered on the way out, so
/// actors stop sending here at once.
pub fn env_serve(args: EnvServeArgs, interrupted: Arc<AtomicBool>) -> anyhow::Result<()> {
    let config = args.server_config()?;
    // Image environments (MinAtar) are served as u8 images (protocol version 3): the server
    // reads that from the environment's observation space.
    let builtin = EnvConfig::from_name(&config.env_label).context("--env")?;
    let factory: EnvFactory = Arc::new(move || builtin.build());
    let timeout = args.nats.timeout()?;
    let auth = args.nats.auth()?;
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .thread_name("volley-env-serve")
        .enable_all()
        .build()
        .context("starting the runtime")?;
    let url = args.nats.nats_url.clone();
    let client = runtime
        .block_on(connect_env_server(&url, auth.as_ref(), &args.nats.tls.tls(), CONNECT_TIMEOUT, timeout))
        .with_context(|| format!("connecting to NATS at {url}"))?;
    info!(url = %url, name = %config.name, env = %config.env_label, max_sessions = config.max_sessions,
          max_envs_per_session = config.max_envs_per_session, idle_timeout_secs = config.idle_timeout.as_secs_f64(),
          "env-serve starting");
    let server =
        runtime.block_on(EnvServer::start(client, factory, config)).context("starting the environment server")?;
    let mut last_log = Instant::now();
    while !interrupted.load(Ordering::Acquire) {
        std::thread::sleep(Duration::from_millis(100));
        if last_log.elapsed() >= Duration::from_secs(30) {
            let counters = server.counters();
            info!(
                instance = server.id(),
                sessions = server.n_sessions(),
                requests = counters.requests.load(Ordering::Relaxed),
                rejected = counters.rejected.load(Ordering::Relaxed),
                expired = counters.expired.load(Ordering::Relaxed),
                "env-serve progress"
            );
            last_log = Instant::now();
        }
    }
    let id = server.id().to_string();
    runtime.block_on(server.stop());
    info!(instance = %id, "env-serve stopped");
    Ok(())
}
