//! [`RemoteVecEnv`]: N environments in sessions on remote instances, stepped as one vector.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use futures::StreamExt;
use tracing::{info, warn};

use super::client::{EnvServiceClient, Instance};
use super::protocol::{ObsEncoding, StepActions, StepReply};
use super::{EnvServiceError, EnvServiceName};
use volley_env::{derive_env_seed, ActionSpace, Actions, EnvError, FinishedEpisode, VecStep, VectorEnv};

/// First and longest pause between discovery attempts while no instance is usable.
const WAIT_FIRST: Duration = Duration::from_millis(100);
const WAIT_MAX: Duration = Duration::from_secs(1);
/// How often the wait for instances logs.
const WAIT_LOG_EVERY: Duration = Duration::from_secs(5);
/// Bytes of a step reply per environment beyond its two observation rows (reward, flags,
/// MessagePack framing), and the share of `max_payload` a session's messages may use.
const STEP_BYTES_PER_ENV: usize = 16;
const PAYLOAD_SHARE: usize = 2;

/// How a [`RemoteVecEnv`] splits and steps its environments.
#[derive(Debug, Clone)]
pub struct RemoteVecEnvConfig {
    /// The environment service.
    pub service: EnvServiceName,
    /// Number of environments.
    pub n_envs: usize,
    /// Environments per session, i.e. per step request (0: spread the environments over the
    /// instances found at start, one session each).
    pub envs_per_session: usize,
    /// Step requests in flight at once (at least 1).
    pub max_in_flight: usize,
    /// Base seed: environment `i` starts with [`derive_env_seed`]`(seed, i)`, as in a
    /// [`volley_env::VecEnv`]; re-opened sessions get fresh seeds.
    pub seed: u64,
    /// Observation length and number of actions the caller needs (e.g. from the run spec);
    /// instances serving other spaces are skipped. `None`: take the first instance's. For a
    /// box action space, `n_actions` is the number of values of one action.
    pub expected_spaces: Option<(usize, usize)>,
    /// Whether the caller needs continuous (box) actions, e.g. because its policy has a
    /// Gaussian head; instances serving the other kind are skipped. `None`: the first
    /// instance's kind.
    pub expected_continuous: Option<bool>,
    /// Set to stop waiting for instances (the actor is shutting down).
    pub stop: Arc<AtomicBool>,
}

impl RemoteVecEnvConfig {
    /// `n_envs` environments of `service`, auto batching, 8 requests in flight.
    pub fn new(service: EnvServiceName, n_envs: usize, seed: u64) -> Self {
        RemoteVecEnvConfig {
            service,
            n_envs,
            envs_per_session: 0,
            max_in_flight: 8,
            seed,
            expected_spaces: None,
            expected_continuous: None,
            stop: Arc::new(AtomicBool::new(false)),
        }
    }
}

/// An instance that answered `spaces` with the right spaces.
#[derive(Debug)]
struct Known {
    instance: Arc<Instance>,
    max_envs_per_session: usize,
    /// Sessions this client holds on it.
    sessions: usize,
}

/// A contiguous range of environments served by one session.
#[derive(Debug)]
struct Slot {
    start: usize,
    len: usize,
    session: Option<(Arc<Instance>, u64)>,
    /// How many sessions this slot has had; feeds the seeds of the next.
    generation: u64,
}

#[derive(Debug, Clone, Copy, Default)]
struct EpisodeStats {
    episode_return: f32,
    episode_len: u32,
}

/// A vector of environments served by remote instances of one environment service.
///
/// The environments are split into sessions (one step request each), spread over the
/// instances; a step sends the sessions' requests concurrently (at most
/// [`RemoteVecEnvConfig::max_in_flight`] at once), each with the client's deadline.
/// When a session is lost (its server died, timed out, forgot it, or sent a reply that does
/// not fit), its environments' episodes are aborted: each is reported in
/// [`VecStep::env_errors`] as a truncation with reward 0, its final observation the last one
/// received, and not listed as a finished episode; the session is opened again on another
/// instance (waiting for one if none is left) and the run goes on.
#[derive(Debug)]
pub struct RemoteVecEnv {
    client: EnvServiceClient,
    config: RemoteVecEnvConfig,
    obs_dim: usize,
    n_actions: usize,
    /// The action space of the first usable instance; later ones must have the same kind and
    /// size (box bounds may differ: each server clips to its own).
    action_space: Option<ActionSpace>,
    /// How the first usable instance's observations travel (and so every later one's), with
    /// its image shape if they are images.
    obs_space: Option<(ObsEncoding, Option<[usize; 3]>)>,
    obs: Vec<f32>,
    stats: Vec<EpisodeStats>,
    slots: Vec<Slot>,
    known: HashMap<String, Known>,
    /// Rotates ties between equally loaded instances, so that actors spread out.
    pick_counter: u64,
    errored: Vec<bool>,
}

impl RemoteVecEnv {
    /// Discover the service's instances (waiting, with a log line every few seconds, until one
    /// serves the expected spaces or `config.stop` is set), open the sessions and reset every
    /// environment. Blocking: call from a plain thread.
    pub fn new(client: EnvServiceClient, config: RemoteVecEnvConfig) -> Result<Self, EnvServiceError> {
        if config.n_envs == 0 {
            return Err(EnvServiceError::Incompatible {
                instance: String::new(),
                message: "a remote vec env needs at least one environment".to_string(),
            });
        }
        let mut env = RemoteVecEnv {
            obs_dim: config.expected_spaces.map_or(0, |(d, _)| d),
            n_actions: config.expected_spaces.map_or(0, |(_, n)| n),
            action_space: None,
            obs_space: None,
            obs: Vec::new(),
            stats: vec![EpisodeStats::default(); config.n_envs],
            slots: Vec::new(),
            known: HashMap::new(),
            pick_counter: config.seed,
            errored: Vec::new(),
            client,
            config,
        };
        if !env.wait_for_instances() {
            return Err(EnvServiceError::NoInstances {
                service: env.config.service.to_string(),
                after: env.client.discovery_window(),
            });
        }
        env.obs = vec![0.0; env.config.n_envs * env.obs_dim];
        let per_session = env.envs_per_session();
        let mut start = 0;
        while start < env.config.n_envs {
            let len = per_session.min(env.config.n_envs - start);
            env.slots.push(Slot { start, len, session: None, generation: 0 });
            start += len;
        }
        for slot_idx in 0..env.slots.len() {
            if !env.open_slot(slot_idx) {
                return Err(EnvServiceError::NoInstances {
                    service: env.config.service.to_string(),
                    after: env.client.discovery_window(),
                });
            }
        }
        info!(service = %env.config.service, n_envs = env.config.n_envs, sessions = env.slots.len(),
              instances = env.known.len(), obs_dim = env.obs_dim, n_actions = env.n_actions, "remote environments ready");
        Ok(env)
    }

    /// Number of sessions (step requests per step).
    pub fn n_sessions(&self) -> usize {
        self.slots.len()
    }

    /// The ids of the instances currently hosting a session.
    pub fn instances_in_use(&self) -> Vec<String> {
        let mut ids: Vec<String> =
            self.slots.iter().filter_map(|s| s.session.as_ref().map(|(i, _)| i.id.clone())).collect();
        ids.sort();
        ids.dedup();
        ids
    }

    /// Environments per session: as configured, or spread over the known instances; never
    /// more than an instance accepts or than fits in a message.
    fn envs_per_session(&self) -> usize {
        let n_envs = self.config.n_envs;
        let wanted = if self.config.envs_per_session > 0 {
            self.config.envs_per_session
        } else {
            let n_sessions = self.known.len().clamp(1, n_envs);
            n_envs.div_ceil(n_sessions)
        };
        let instance_cap = self.known.values().map(|k| k.max_envs_per_session).max().unwrap_or(1);
        let value_bytes = match self.obs_encoding() {
            ObsEncoding::F32 => 4,
            ObsEncoding::U8 => 1,
        };
        let payload_cap =
            (self.client.max_payload() / PAYLOAD_SHARE) / (2 * value_bytes * self.obs_dim + STEP_BYTES_PER_ENV);
        wanted.min(instance_cap).min(payload_cap.max(1)).max(1)
    }

    /// Discover until some instance serves the expected spaces; false once `stop` is set.
    fn wait_for_instances(&mut self) -> bool {
        let started = Instant::now();
        let mut last_log: Option<Instant> = None;
        let mut pause = WAIT_FIRST;
        loop {
            self.rediscover();
            if !self.known.is_empty() {
                return true;
            }
            if self.config.stop.load(Ordering::Acquire) {
                return false;
            }
            if last_log.is_none_or(|t| t.elapsed() >= WAIT_LOG_EVERY) {
                warn!(service = %self.config.service, waited_secs = started.elapsed().as_secs(),
                      "no usable environment server; waiting (start `volley env-serve` or `volley-envs serve`)");
                last_log = Some(Instant::now());
            }
            std::thread::sleep(pause);
            pause = (pause * 2).min(WAIT_MAX);
        }
    }

    /// Refresh the known instances: keep those still listed, ask new ones for their spaces.
    fn rediscover(&mut self) {
        let client = self.client.clone();
        let service = self.config.service.clone();
        let found = match client.block_on(client.discover(&service)) {
            Ok(found) => found,
            Err(err) => {
                warn!(service = %service, %err, "environment server discovery failed");
                return;
            }
        };
        self.known.retain(|id, _| found.iter().any(|i| &i.id == id));
        for instance in found {
            if self.known.contains_key(&instance.id) {
                continue;
            }
            let spaces = match client.block_on(client.spaces(&instance)) {
                Ok(spaces) => spaces,
                Err(err) => {
                    warn!(service = %service, instance = %instance.id, %err, "environment server did not answer spaces; skipped");
                    continue;
                }
            };
            // Checked by the client's `spaces`.
            let Ok(action_space) = spaces.action_space() else { continue };
            let (obs_dim, n_actions) = (spaces.obs_dim as usize, action_space.n_actions());
            let continuous = action_space.is_continuous();
            // Checked by the client's `spaces` too.
            let Ok(image) = spaces.image_shape() else { continue };
            let obs_space = (spaces.obs_encoding(), image);
            if self.obs_space.is_some_and(|known| known != obs_space) {
                warn!(service = %service, instance = %instance.id, ?image,
                      expected_image = ?self.obs_space.and_then(|(_, image)| image),
                      "environment server serves another observation space; skipped");
                continue;
            }
            if self.obs_dim == 0 {
                (self.obs_dim, self.n_actions) = (obs_dim, n_actions);
            }
            let expected_continuous = self
                .config
                .expected_continuous
                .or_else(|| self.action_space.as_ref().map(ActionSpace::is_continuous))
                .unwrap_or(continuous);
            if (obs_dim, n_actions, continuous) != (self.obs_dim, self.n_actions, expected_continuous) {
                warn!(service = %service, instance = %instance.id, obs_dim, n_actions, continuous,
                      expected_obs_dim = self.obs_dim, expected_n_actions = self.n_actions, expected_continuous,
                      "environment server serves other spaces; skipped");
                continue;
            }
            if self.action_space.is_none() {
                self.action_space = Some(action_space);
            }
            self.obs_space = Some(obs_space);
            let max_envs_per_session = (spaces.max_envs_per_session as usize).max(1);
            self.known
                .insert(instance.id.clone(), Known { instance: Arc::new(instance), max_envs_per_session, sessions: 0 });
        }
    }

    /// The least loaded known instance that takes `len` environments (ties rotate).
    fn choose(&mut self, len: usize) -> Option<Arc<Instance>> {
        let mut candidates: Vec<&Known> = self.known.values().filter(|k| k.max_envs_per_session >= len).collect();
        candidates.sort_by(|a, b| a.sessions.cmp(&b.sessions).then_with(|| a.instance.id.cmp(&b.instance.id)));
        let least = candidates.first()?.sessions;
        let ties = candidates.iter().take_while(|k| k.sessions == least).count();
        self.pick_counter = self.pick_counter.wrapping_add(1);
        Some(candidates[(self.pick_counter % ties as u64) as usize].instance.clone())
    }

    /// Open a session for `slot_idx` on some instance, waiting for one if needed. False when
    /// `stop` was set before a session opened (the slot stays detached).
    fn open_slot(&mut self, slot_idx: usize) -> bool {
        let (start, len) = (self.slots[slot_idx].start, self.slots[slot_idx].len);
        loop {
            let Some(instance) = self.choose(len) else {
                if !self.wait_for_instances() {
                    return false;
                }
                continue;
            };
            let generation = self.slots[slot_idx].generation;
            self.slots[slot_idx].generation += 1;
            let seed = self.config.seed ^ generation.wrapping_mul(0x9E37_79B9_7F4A_7C15);
            let seeds: Vec<u64> = (start..start + len).map(|env_idx| derive_env_seed(seed, env_idx)).collect();
            let client = self.client.clone();
            let encoding = self.obs_encoding();
            let result = client.block_on(client.open(&instance, &seeds)).and_then(|reply| {
                let bad =
                    |message: String| EnvServiceError::BadReply { instance: instance.id.clone(), op: "open", message };
                let obs = reply.obs.decode(encoding).map_err(bad)?;
                if obs.len() != len * self.obs_dim || !obs.iter().all(|v| v.is_finite()) {
                    return Err(bad(format!("{} finite observations expected, got {}", len * self.obs_dim, obs.len())));
                }
                Ok((reply, obs))
            });
            match result {
                Ok((reply, obs)) => {
                    self.obs[start * self.obs_dim..(start + len) * self.obs_dim].copy_from_slice(&obs);
                    self.stats[start..start + len].fill(EpisodeStats::default());
                    if let Some(known) = self.known.get_mut(&instance.id) {
                        known.sessions += 1;
                    }
                    self.client.counters().sessions_opened.fetch_add(1, Ordering::Relaxed);
                    info!(service = %self.config.service, instance = %instance.id, session = reply.session,
                          first_env = start, n_envs = len, "environment session opened");
                    self.slots[slot_idx].session = Some((instance, reply.session));
                    return true;
                }
                Err(err) => {
                    warn!(service = %self.config.service, instance = %instance.id, %err, reason = err.reason(),
                          "opening an environment session failed; trying another server");
                    // Forget the instance for now; a later discovery brings it back if it lives.
                    self.known.remove(&instance.id);
                }
            }
        }
    }

    /// How observations travel (`F32` until an instance is known).
    fn obs_encoding(&self) -> ObsEncoding {
        self.obs_space.map_or(ObsEncoding::F32, |(encoding, _)| encoding)
    }

    /// The image shape `[C, H, W]` of the servers' observations, if they are images.
    pub fn image_shape(&self) -> Option<[usize; 3]> {
        self.obs_space.and_then(|(_, image)| image)
    }

    /// Check a step reply against the session's shape; its observations and final
    /// observations, decoded.
    fn check_reply(&self, len: usize, reply: &StepReply) -> Result<(Vec<f32>, Vec<f32>), String> {
        let dim = self.obs_dim;
        let obs = reply.obs.decode(self.obs_encoding())?;
        let final_obs = reply.final_obs.decode(self.obs_encoding())?;
        if obs.len() != len * dim
            || reply.rewards.len() != len
            || reply.terminated.len() != len
            || reply.truncated.len() != len
        {
            return Err(format!(
                "{len} environments of {dim} observations expected, got {} observations, {} rewards, {} and {} flags",
                obs.len(),
                reply.rewards.len(),
                reply.terminated.len(),
                reply.truncated.len()
            ));
        }
        let n_done = reply.terminated.iter().zip(&reply.truncated).filter(|(&te, &tr)| te || tr).count();
        if final_obs.len() != n_done * dim {
            return Err(format!("{n_done} final observations expected, got {} values", final_obs.len()));
        }
        if let Some(failure) = reply.errors.iter().find(|f| f.env as usize >= len) {
            return Err(format!("error for environment {} of {len}", failure.env));
        }
        let finite = |values: &[f32]| values.iter().all(|v| v.is_finite());
        if !(finite(&obs) && finite(&reply.rewards) && finite(&final_obs)) {
            return Err("non-finite observation or reward".to_string());
        }
        Ok((obs, final_obs))
    }

    /// Abort the episodes of `slot_idx` after `error`, and open the slot again elsewhere.
    fn lose_slot(&mut self, slot_idx: usize, error: &EnvServiceError, out: &mut VecStep) {
        let dim = self.obs_dim;
        let slot = &mut self.slots[slot_idx];
        let (start, len) = (slot.start, slot.len);
        if let Some((instance, session)) = slot.session.take() {
            self.client.counters().sessions_lost.fetch_add(1, Ordering::Relaxed);
            warn!(service = %self.config.service, instance = %instance.id, session, %error, reason = error.reason(),
                  aborted_episodes = len, "environment session lost; its episodes are aborted");
            let keep_instance =
                matches!(error.reason(), "remote_unknown_session" | "remote_capacity" | "remote_server_error");
            if keep_instance {
                if let Some(known) = self.known.get_mut(&instance.id) {
                    known.sessions = known.sessions.saturating_sub(1);
                }
            } else {
                self.known.remove(&instance.id);
            }
        }
        for env_idx in start..start + len {
            out.rewards[env_idx] = 0.0;
            out.terminated[env_idx] = false;
            out.truncated[env_idx] = true;
            out.final_obs[env_idx * dim..(env_idx + 1) * dim]
                .copy_from_slice(&self.obs[env_idx * dim..(env_idx + 1) * dim]);
            self.stats[env_idx] = EpisodeStats::default();
            out.env_errors.push((
                env_idx,
                EnvError::Remote {
                    service: self.config.service.to_string(),
                    reason: error.reason(),
                    message: error.to_string(),
                },
            ));
        }
        self.open_slot(slot_idx);
    }

    /// Apply a checked step reply of `slot_idx`.
    fn apply_reply(
        &mut self,
        slot_idx: usize,
        reply: StepReply,
        (obs, final_obs): (Vec<f32>, Vec<f32>),
        out: &mut VecStep,
    ) {
        let dim = self.obs_dim;
        let (start, len) = (self.slots[slot_idx].start, self.slots[slot_idx].len);
        self.errored.clear();
        self.errored.resize(len, false);
        for failure in reply.errors {
            self.errored[failure.env as usize] = true;
            out.env_errors.push((
                start + failure.env as usize,
                EnvError::Remote {
                    service: self.config.service.to_string(),
                    reason: "remote_env_failed",
                    message: failure.message,
                },
            ));
        }
        let mut final_rows = final_obs.chunks_exact(dim.max(1));
        for k in 0..len {
            let env_idx = start + k;
            let errored = self.errored[k];
            let (reward, terminated, truncated) =
                if errored { (0.0, false, true) } else { (reply.rewards[k], reply.terminated[k], reply.truncated[k]) };
            out.rewards[env_idx] = reward;
            out.terminated[env_idx] = terminated;
            out.truncated[env_idx] = truncated;
            let stats = &mut self.stats[env_idx];
            if reply.terminated[k] || reply.truncated[k] || errored {
                if reply.terminated[k] || reply.truncated[k] {
                    let row = final_rows.next().expect("checked: one final row per ended episode");
                    out.final_obs[env_idx * dim..(env_idx + 1) * dim].copy_from_slice(row);
                } else {
                    out.final_obs[env_idx * dim..(env_idx + 1) * dim]
                        .copy_from_slice(&self.obs[env_idx * dim..(env_idx + 1) * dim]);
                }
                if !errored {
                    out.finished_episodes.push(FinishedEpisode {
                        env_idx,
                        episode_return: stats.episode_return + reward,
                        episode_len: stats.episode_len + 1,
                    });
                }
                *stats = EpisodeStats::default();
            } else {
                stats.episode_return += reward;
                stats.episode_len += 1;
            }
        }
        self.obs[start * dim..(start + len) * dim].copy_from_slice(&obs);
    }

    /// Find the slot and the index within it of environment `env_idx`.
    fn locate(&self, env_idx: usize) -> Result<(usize, u32), EnvError> {
        if env_idx >= self.config.n_envs {
            return Err(EnvError::Shape { field: "env_idx", expected: self.config.n_envs, got: env_idx });
        }
        let slot_idx = self.slots.iter().position(|s| env_idx < s.start + s.len).expect("slots cover every env");
        Ok((slot_idx, (env_idx - self.slots[slot_idx].start) as u32))
    }

    fn remote_error(&self, error: &EnvServiceError) -> EnvError {
        EnvError::Remote {
            service: self.config.service.to_string(),
            reason: error.reason(),
            message: error.to_string(),
        }
    }
}

impl VectorEnv for RemoteVecEnv {
    fn n_envs(&self) -> usize {
        self.config.n_envs
    }

    fn obs_dim(&self) -> usize {
        self.obs_dim
    }

    fn n_actions(&self) -> usize {
        self.n_actions
    }

    fn action_space(&self) -> ActionSpace {
        self.action_space.clone().unwrap_or(ActionSpace::Discrete { n: self.n_actions })
    }

    fn obs(&self) -> &[f32] {
        &self.obs
    }

    fn step(&mut self, actions: Actions<'_>, out: &mut VecStep) -> Result<(), EnvError> {
        let n_envs = self.config.n_envs;
        actions.check(n_envs)?;
        // Actions of the kind the servers serve; box values go as they are (the caller repairs
        // them, and the server clips again: docs/ENV_PROTOCOL.md, "Continuous actions").
        let continuous = self.action_space.as_ref().is_some_and(ActionSpace::is_continuous);
        match actions {
            Actions::Discrete(_) if continuous => return Err(EnvError::WrongActionKind { expected: "continuous" }),
            Actions::Continuous { .. } if !continuous => {
                return Err(EnvError::WrongActionKind { expected: "discrete" })
            }
            Actions::Continuous { dim, .. } if dim != self.n_actions => {
                return Err(EnvError::Shape { field: "action", expected: self.n_actions, got: dim })
            }
            _ => {}
        }
        out.prepare(n_envs, self.obs_dim);
        let requests: Vec<(usize, Arc<Instance>, u64, StepActions)> = self
            .slots
            .iter()
            .enumerate()
            .filter_map(|(slot_idx, slot)| {
                let (instance, session) = slot.session.as_ref()?;
                let range = slot.start..slot.start + slot.len;
                let slot_actions = match actions {
                    Actions::Discrete(actions) => {
                        StepActions::Discrete(actions[range].iter().map(|&a| a as u32).collect())
                    }
                    Actions::Continuous { values, dim } => {
                        StepActions::Box(values[range.start * dim..range.end * dim].to_vec())
                    }
                };
                Some((slot_idx, instance.clone(), *session, slot_actions))
            })
            .collect();
        let client = self.client.clone();
        let max_in_flight = self.config.max_in_flight.max(1);
        let mut results = client.block_on(
            futures::stream::iter(requests)
                .map(|(slot_idx, instance, session, slot_actions)| {
                    let client = &client;
                    async move { (slot_idx, instance.id.clone(), client.step(&instance, session, slot_actions).await) }
                })
                .buffer_unordered(max_in_flight)
                .collect::<Vec<_>>(),
        );
        // Apply in slot order, so that the lists in `out` are in environment order.
        results.sort_by_key(|(slot_idx, _, _)| *slot_idx);
        let mut answered = vec![false; self.slots.len()];
        for (slot_idx, instance, result) in results {
            answered[slot_idx] = true;
            let len = self.slots[slot_idx].len;
            let checked = result.and_then(|reply| match self.check_reply(len, &reply) {
                Ok(decoded) => Ok((reply, decoded)),
                Err(message) => Err(EnvServiceError::BadReply { instance: instance.clone(), op: "step", message }),
            });
            match checked {
                Ok((reply, decoded)) => self.apply_reply(slot_idx, reply, decoded, out),
                Err(error) => self.lose_slot(slot_idx, &error, out),
            }
        }
        // Detached slots (no session: the actor is stopping and no server was left) abort again.
        for slot_idx in (0..self.slots.len()).filter(|&i| !answered[i]) {
            let error = EnvServiceError::NoInstances {
                service: self.config.service.to_string(),
                after: self.client.discovery_window(),
            };
            self.lose_slot(slot_idx, &error, out);
        }
        Ok(())
    }

    fn snapshot_env(&mut self, env_idx: usize) -> Result<Vec<u8>, EnvError> {
        let (slot_idx, within) = self.locate(env_idx)?;
        let Some((instance, session)) = self.slots[slot_idx].session.clone() else {
            return Err(EnvError::Config(format!("environment {env_idx} has no session")));
        };
        let client = self.client.clone();
        client.block_on(client.snapshot(&instance, session, within)).map_err(|err| self.remote_error(&err))
    }

    fn restore_env(&mut self, env_idx: usize, bytes: &[u8]) -> Result<(), EnvError> {
        let (slot_idx, within) = self.locate(env_idx)?;
        let Some((instance, session)) = self.slots[slot_idx].session.clone() else {
            return Err(EnvError::Config(format!("environment {env_idx} has no session")));
        };
        let client = self.client.clone();
        let obs = client
            .block_on(client.restore(&instance, session, within, bytes.to_vec(), self.obs_encoding()))
            .map_err(|err| self.remote_error(&err))?;
        let dim = self.obs_dim;
        if obs.len() != dim || !obs.iter().all(|v| v.is_finite()) {
            return Err(EnvError::Remote {
                service: self.config.service.to_string(),
                reason: "remote_bad_reply",
                message: format!("restore returned {} values, expected {dim} finite ones", obs.len()),
            });
        }
        self.obs[env_idx * dim..(env_idx + 1) * dim].copy_from_slice(&obs);
        self.stats[env_idx] = EpisodeStats::default();
        Ok(())
    }

    /// A scheduled fresh start of one environment (save-load's work items): a version-3
    /// `reset` of that environment alone.
    fn reset_env(&mut self, env_idx: usize, seed: u64) -> Result<(), EnvError> {
        let (slot_idx, within) = self.locate(env_idx)?;
        let Some((instance, session)) = self.slots[slot_idx].session.clone() else {
            return Err(EnvError::Config(format!("environment {env_idx} has no session")));
        };
        let (start, len) = (self.slots[slot_idx].start, self.slots[slot_idx].len);
        let client = self.client.clone();
        let obs = client
            .block_on(client.reset(&instance, session, vec![Some(seed)], Some(vec![within]), self.obs_encoding()))
            .map_err(|err| self.remote_error(&err))?;
        let dim = self.obs_dim;
        if obs.len() != len * dim || !obs.iter().all(|v| v.is_finite()) {
            return Err(EnvError::Remote {
                service: self.config.service.to_string(),
                reason: "remote_bad_reply",
                message: format!("reset returned {} values, expected {} finite ones", obs.len(), len * dim),
            });
        }
        // Only the reset environment's row: the others did not change.
        let row = (env_idx - start) * dim..(env_idx - start + 1) * dim;
        self.obs[env_idx * dim..(env_idx + 1) * dim].copy_from_slice(&obs[row]);
        self.stats[env_idx] = EpisodeStats::default();
        Ok(())
    }
}

impl Drop for RemoteVecEnv {
    /// Close the sessions (best effort, one deadline for all), so servers free them before
    /// their idle timeout. Skipped inside a tokio runtime, where blocking is not allowed.
    fn drop(&mut self) {
        if tokio::runtime::Handle::try_current().is_ok() {
            return;
        }
        let sessions: Vec<(Arc<Instance>, u64)> = self.slots.iter_mut().filter_map(|s| s.session.take()).collect();
        let client = self.client.clone();
        client.block_on(async {
            futures::future::join_all(sessions.iter().map(|(instance, session)| client.close(instance, *session))).await
        });
    }
}
