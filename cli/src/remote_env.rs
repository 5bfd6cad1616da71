//! A remote environment seen from the learner and the actors: the lookup of its spaces from
//! its servers (the run spec is built from them), and the environments an actor steps.

use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use tracing::{info, warn};
use volley_env::{ActionSpace, FrameStack, RemoteActionBox, RemoteEnvConfig, VectorEnv};
use volley_transport::envsvc::{EnvServiceClient, EnvServiceName, RemoteVecEnv};
use volley_transport::nats::{NatsAuth, NatsTls};

use crate::Interrupted;

/// How long connecting to NATS may take.
pub const CONNECT_TIMEOUT: Duration = Duration::from_secs(10);

/// Ask the servers of `service` for its spaces (over NATS at `nats_url`, as `auth`, with the
/// client TLS settings `tls`, each request within `timeout`), waiting up to `wait` for one to
/// appear.
pub fn remote_env_config(
    nats_url: &str,
    auth: Option<&NatsAuth>,
    tls: &NatsTls,
    timeout: Duration,
    service: &EnvServiceName,
    wait: Duration,
) -> anyhow::Result<RemoteEnvConfig> {
    let client = EnvServiceClient::connect(nats_url, auth, tls, CONNECT_TIMEOUT, timeout)
        .with_context(|| format!("connecting to NATS at {nats_url}"))?;
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
                        env: Some(RemoteEnvConfig::env_label(&spaces.env)),
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
