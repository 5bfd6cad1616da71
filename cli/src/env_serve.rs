//! `volley env-serve`: a built-in environment as an environment service over NATS, and the
//! learner's lookup of a remote environment's spaces.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use tracing::{info, warn};
use volley_env::{ActionSpace, EnvConfig, FrameStack, RemoteActionBox, RemoteEnvConfig, VectorEnv};
use volley_transport::envsvc::{
    connect_env_server, EnvFactory, EnvServer, EnvServiceClient, EnvServiceName, RemoteVecEnv,
};

use crate::args::{EnvServeArgs, NatsArgs};
use crate::Interrupted;

/// How long connecting to NATS may take.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(10);

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

/// Ask the servers of `service` for its spaces, waiting up to `wait` for one to appear.
pub fn remote_env_config(nats: &NatsArgs, service: &EnvServiceName, wait: Duration) -> anyhow::Result<RemoteEnvConfig> {
    let client = EnvServiceClient::connect(
        &nats.nats_url,
        nats.auth()?.as_ref(),
        &nats.tls.tls(),
        CONNECT_TIMEOUT,
        nats.timeout()?,
    )
    .with_context(|| format!("connecting to NATS at {}", nats.nats_url))?;
    let started = Instant::now();
    let mut last_log: Option<Instant> = None;
    loop {
        if crate::interrupted() {
            return Err(Interrupted(format!("waiting for a server of environment service {service}")).into());
        }
        let instances = client.block_on(client.discover(service))?;
        for instance in &instances {
            match client.block_on(client.spaces(instance)) {
                Ok(spaces) => {
                    // Checked by the client's `spaces`.
                    let action_space = spaces.action_space().map_err(|message| anyhow::anyhow!(message))?;
                    info!(service = %service, instance = %instance.id, env = %spaces.env, obs_dim = spaces.obs_dim,
                          n_actions = action_space.n_actions(), continuous = action_space.is_continuous(),
                          reward_threshold = ?spaces.reward_threshold, servers = instances.len(),
                          "remote environment found");
                    return Ok(RemoteEnvConfig {
                        service: service.clone(),
                        obs_dim: spaces.obs_dim as usize,
                        n_actions: action_space.n_actions(),
                        action_box: match action_space {
                            ActionSpace::Box { low, high, .. } => Some(RemoteActionBox { low, high }),
                            ActionSpace::Discrete { .. } => None,
                        },
                        reward_threshold: spaces.reward_threshold.filter(|t| t.is_finite()),
                        max_abs_reward: spaces.max_abs_reward.filter(|b| b.is_finite() && *b > 0.0),
                        max_episode_steps: spaces.max_episode_steps.map(u64::from),
                        // Checked by the client's `spaces`.
                        image: spaces.image_shape().ok().flatten(),
                        frame_stack: 1,
                        snapshot: spaces.snapshot,
                    });
                }
                Err(err) => warn!(service = %service, instance = %instance.id, %err, "spaces request failed"),
            }
        }
        if started.elapsed() >= wait {
            bail!("no server of environment service {service} answered within {wait:?}");
        }
        if last_log.is_none_or(|t| t.elapsed() >= Duration::from_secs(5)) {
            info!(service = %service, "waiting for a server of environment service {service} (start `volley env-serve` or `volley-envs serve`)");
            last_log = Some(Instant::now());
        }
        std::thread::sleep(Duration::from_millis(200));
    }
}

/// What an actor steps for `remote`: the servers' environments, checked to send the image
/// shape the run spec declares, with the spec's frame stacking on top.
pub fn actor_envs(envs: RemoteVecEnv, remote: &RemoteEnvConfig) -> anyhow::Result<Box<dyn VectorEnv>> {
    if envs.image_shape() != remote.image {
        bail!(
            "the servers of {} send {} but the run spec expects {}",
            remote.service,
            describe_image(envs.image_shape()),
            describe_image(remote.image)
        );
    }
    Ok(match remote.frame_stack {
        0 | 1 => Box::new(envs),
        k => Box::new(FrameStack::new(Box::new(envs), k)?),
    })
}

fn describe_image(image: Option<[usize; 3]>) -> String {
    match image {
        Some([c, h, w]) => format!("{c}x{h}x{w} u8 images"),
        None => "flat f32 vectors".to_string(),
    }
}
