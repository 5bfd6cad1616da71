//! A vectorised stepper: N environments of one type stepped together, with auto-reset.
//!
//! [`VecEnv::step`] writes into a caller-owned [`VecStep`] and allocates nothing once the
//! buffers have warmed up. A faulty environment never takes the batch down: an error or a
//! non-finite observation or reward is recorded in [`VecStep::env_errors`], that environment is
//! reset and its step reported as a truncation with reward 0, and the others carry on.

use super::{Action, ActionRepair, ActionSpace, Actions, Env, EnvError};

/// Seed for environment `env_idx` of a [`VecEnv`] created with `seed`: SplitMix64
/// (Steele, Lea and Flood 2014) of `seed` offset by the index times the golden-ratio increment,
/// so neighbouring indices and neighbouring seeds give unrelated streams.
pub fn derive_env_seed(seed: u64, env_idx: usize) -> u64 {
    let mut z = seed.wrapping_add((env_idx as u64).wrapping_add(1).wrapping_mul(0x9E37_79B9_7F4A_7C15));
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// A finished episode's statistics.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct FinishedEpisode {
    /// Which environment finished it.
    pub env_idx: usize,
    /// Undiscounted sum of its rewards (since the last reset or restore).
    pub episode_return: f32,
    /// Number of steps it lasted (since the last reset or restore).
    pub episode_len: u32,
}

/// What one [`VecEnv::step`] produced, for all environments. Reuse one across steps.
#[derive(Debug, Clone, PartialEq)]
pub struct VecStep {
    /// Reward per environment, `[n_envs]`.
    pub rewards: Vec<f32>,
    /// Whether each environment's episode terminated this step, `[n_envs]`.
    pub terminated: Vec<bool>,
    /// Whether each environment's episode was truncated this step, `[n_envs]` (also set when the
    /// environment failed this step).
    pub truncated: Vec<bool>,
    /// `[n_envs][obs_dim]`: for environments whose episode ended this step, the last
    /// observation before the auto-reset (to bootstrap truncated episodes); for a failed
    /// environment, the last valid observation. Unspecified for the others.
    pub final_obs: Vec<f32>,
    /// Episodes that ended this step (cleared each step). Episodes cut by an error are not
    /// listed.
    pub finished_episodes: Vec<FinishedEpisode>,
    /// Errors raised this step, by environment index (cleared each step).
    pub env_errors: Vec<(usize, EnvError)>,
    /// Continuous action values that were non-finite or out of range and were repaired before
    /// the step ([`ActionSpace::repair`]), summed over the environments (cleared each step).
    pub action_repairs: ActionRepair,
}

impl VecStep {
    /// Buffers for `n_envs` environments with `obs_dim` observations.
    pub fn new(n_envs: usize, obs_dim: usize) -> Self {
        Self {
            rewards: vec![0.0; n_envs],
            terminated: vec![false; n_envs],
            truncated: vec![false; n_envs],
            final_obs: vec![0.0; n_envs * obs_dim],
            finished_episodes: Vec::with_capacity(n_envs),
            env_errors: Vec::with_capacity(n_envs),
            action_repairs: ActionRepair::default(),
        }
    }

    /// Size the buffers for `n_envs` × `obs_dim` (no allocation when they already fit) and
    /// clear the per-step lists. Public for other [`VectorEnv`] implementations (the remote one).
    pub fn prepare(&mut self, n_envs: usize, obs_dim: usize) {
        self.rewards.resize(n_envs, 0.0);
        self.terminated.resize(n_envs, false);
        self.truncated.resize(n_envs, false);
        self.final_obs.resize(n_envs * obs_dim, 0.0);
        self.finished_episodes.clear();
        self.env_errors.clear();
        self.action_repairs = ActionRepair::default();
    }
}

/// N environments stepped together with auto-reset: what an actor steps.
///
/// [`VecEnv`] implements it in-process; `volley_transport::envsvc::RemoteVecEnv` over NATS. The
/// semantics are [`VecEnv::step`]'s: environments whose episode ends are reset at once, the
/// observation before the reset is in [`VecStep::final_obs`], and a failed environment is
/// reported in [`VecStep::env_errors`] as a truncation with reward 0 and started again.
pub trait VectorEnv: Send {
    /// Number of environments.
    fn n_envs(&self) -> usize;
    /// Observation length of each environment.
    fn obs_dim(&self) -> usize;
    /// Width of the policy's action head ([`ActionSpace::n_actions`]).
    fn n_actions(&self) -> usize;
    /// The action space of every environment. Default: `n_actions` discrete actions.
    fn action_space(&self) -> ActionSpace {
        ActionSpace::Discrete { n: self.n_actions() }
    }
    /// Current observations, `[n_envs][obs_dim]` (after any auto-reset).
    fn obs(&self) -> &[f32];
    /// Step every environment with its action (see [`VecEnv::step`]). The only error is a
    /// batch for another number of environments.
    fn step(&mut self, actions: Actions<'_>, out: &mut VecStep) -> Result<(), EnvError>;
    /// The complete state of environment `env_idx` ([`Env::snapshot`]); remote environments
    /// may not support it.
    fn snapshot_env(&mut self, env_idx: usize) -> Result<Vec<u8>, EnvError>;
    /// Restore environment `env_idx` from a snapshot and update its row of [`VectorEnv::obs`].
    fn restore_env(&mut self, env_idx: usize, bytes: &[u8]) -> Result<(), EnvError>;
    /// Start a new episode of environment `env_idx` from `seed` and update its row of
    /// [`VectorEnv::obs`] (save-load: a scheduled fresh start). Default: unsupported.
    fn reset_env(&mut self, env_idx: usize, seed: u64) -> Result<(), EnvError> {
        let _ = seed;
        Err(EnvError::Config(format!("environment {env_idx} cannot be reset on demand")))
    }
    /// Replace environment `env_idx` with a freshly built `task` and reset it from `seed`
    /// (multi-task runs). Default: unsupported.
    fn switch_task(&mut self, env_idx: usize, task: &super::EnvConfig, seed: u64) -> Result<(), EnvError> {
        let _ = seed;
        Err(EnvError::Config(format!("environment {env_idx} cannot switch to task {}", task.name())))
    }
    /// Whether environment `env_idx` is at a milestone ([`Env::at_milestone`]). Default: never.
    fn env_at_milestone(&self, env_idx: usize) -> bool {
        let _ = env_idx;
        false
    }
    /// Progress of environment `env_idx`'s episode ([`Env::progress`]). Default: 0.
    fn env_progress(&self, env_idx: usize) -> f32 {
        let _ = env_idx;
        0.0
    }
}

impl<E: Env + 'static> VectorEnv for VecEnv<E> {
    fn n_envs(&self) -> usize {
        VecEnv::n_envs(self)
    }
    fn obs_dim(&self) -> usize {
        VecEnv::obs_dim(self)
    }
    fn n_actions(&self) -> usize {
        VecEnv::n_actions(self)
    }
    fn action_space(&self) -> ActionSpace {
        self.action_space.clone()
    }
    fn obs(&self) -> &[f32] {
        VecEnv::obs(self)
    }
    fn step(&mut self, actions: Actions<'_>, out: &mut VecStep) -> Result<(), EnvError> {
        VecEnv::step(self, actions, out)
    }
    fn snapshot_env(&mut self, env_idx: usize) -> Result<Vec<u8>, EnvError> {
        if env_idx >= self.envs.len() {
            return Err(EnvError::Shape { field: "env_idx", expected: self.envs.len(), got: env_idx });
        }
        Ok(VecEnv::snapshot_env(self, env_idx))
    }
    fn restore_env(&mut self, env_idx: usize, bytes: &[u8]) -> Result<(), EnvError> {
        if env_idx >= self.envs.len() {
            return Err(EnvError::Shape { field: "env_idx", expected: self.envs.len(), got: env_idx });
        }
        VecEnv::restore_env(self, env_idx, bytes)
    }
    fn reset_env(&mut self, env_idx: usize, seed: u64) -> Result<(), EnvError> {
        if env_idx >= self.envs.len() {
            return Err(EnvError::Shape { field: "env_idx", expected: self.envs.len(), got: env_idx });
        }
        VecEnv::reset_env(self, env_idx, Some(seed))
    }
    fn switch_task(&mut self, env_idx: usize, task: &super::EnvConfig, seed: u64) -> Result<(), EnvError> {
        if env_idx >= self.envs.len() {
            return Err(EnvError::Shape { field: "env_idx", expected: self.envs.len(), got: env_idx });
        }
        // Only a vec env of boxed environments can hold another environment type.
        let slot: &mut dyn std::any::Any = &mut self.envs[env_idx];
        let Some(boxed) = slot.downcast_mut::<Box<dyn Env>>() else {
            return Err(EnvError::Config("this vec env holds one environment type; tasks cannot switch".into()));
        };
        let env = task.build()?;
        if env.observation_space().dim() != self.obs_dim || env.action_space() != self.action_space {
            return Err(EnvError::Config(format!("task {} has other spaces than this vec env", task.name())));
        }
        *boxed = env;
        VecEnv::reset_env(self, env_idx, Some(seed))
    }
    fn env_at_milestone(&self, env_idx: usize) -> bool {
        self.envs.get(env_idx).is_some_and(|env| env.at_milestone())
    }
    fn env_progress(&self, env_idx: usize) -> f32 {
        self.envs.get(env_idx).map_or(0.0, |env| env.progress())
    }
}

/// Running statistics of one environment's current episode.
#[derive(Debug, Clone, Copy, Default)]
struct EpisodeStats {
    episode_return: f32,
    episode_len: u32,
}

/// N environments of type `E` stepped in lockstep with auto-reset.
///
/// Observations live in one contiguous `[n_envs][obs_dim]` buffer ([`VecEnv::obs`]); after a
/// step it holds each environment's current observation, which for an environment whose
/// episode just ended is the first observation of its next episode.
#[derive(Debug)]
pub struct VecEnv<E: Env> {
    envs: Vec<E>,
    obs: Vec<f32>,
    stats: Vec<EpisodeStats>,
    scratch_obs: Vec<f32>,
    obs_dim: usize,
    action_space: ActionSpace,
    /// One environment's continuous action, repaired before the step.
    scratch_action: Vec<f32>,
}

impl<E: Env> VecEnv<E> {
    /// Take ownership of `envs` and reset environment `i` with [`derive_env_seed`]`(seed, i)`.
    ///
    /// Fails when `envs` is empty, when the environments disagree on their spaces, or when a
    /// reset fails or yields a non-finite observation.
    pub fn new(mut envs: Vec<E>, seed: u64) -> Result<Self, EnvError> {
        let first =
            envs.first().ok_or_else(|| EnvError::Config("a vec env needs at least one environment".to_string()))?;
        let obs_dim = first.observation_space().dim();
        let action_space = first.action_space();
        let mut obs = vec![0.0; envs.len() * obs_dim];
        for (env_idx, env) in envs.iter_mut().enumerate() {
            let env_obs_dim = env.observation_space().dim();
            if env_obs_dim != obs_dim {
                return Err(EnvError::Shape { field: "observation_space", expected: obs_dim, got: env_obs_dim });
            }
            if env.action_space() != action_space {
                return Err(EnvError::Config(format!(
                    "environment {env_idx} has action space {:?}, environment 0 {action_space:?}",
                    env.action_space()
                )));
            }
            let row = &mut obs[env_idx * obs_dim..(env_idx + 1) * obs_dim];
            env.reset(derive_env_seed(seed, env_idx), row)?;
            if !row.iter().all(|v| v.is_finite()) {
                return Err(EnvError::NonFinite { what: "observation", env: env.name() });
            }
        }
        let n_envs = envs.len();
        Ok(Self {
            envs,
            obs,
            stats: vec![EpisodeStats::default(); n_envs],
            scratch_obs: vec![0.0; obs_dim],
            obs_dim,
            scratch_action: vec![0.0; if action_space.is_continuous() { action_space.n_actions() } else { 0 }],
            action_space,
        })
    }

    /// Number of environments.
    pub fn n_envs(&self) -> usize {
        self.envs.len()
    }

    /// Observation length of each environment.
    pub fn obs_dim(&self) -> usize {
        self.obs_dim
    }

    /// Number of discrete actions of each environment.
    pub fn n_actions(&self) -> usize {
        self.action_space.n_actions()
    }

    /// The environments' action space.
    pub fn action_space(&self) -> &ActionSpace {
        &self.action_space
    }

    /// Current observations, `[n_envs][obs_dim]` (after any auto-reset).
    pub fn obs(&self) -> &[f32] {
        &self.obs
    }

    /// Environment `env_idx`.
    ///
    /// # Panics
    /// If `env_idx >= n_envs`.
    pub fn env(&self, env_idx: usize) -> &E {
        &self.envs[env_idx]
    }

    /// Environment `env_idx`, mutably. Changing its state behind the vec env's back leaves
    /// [`VecEnv::obs`] stale until the next step; prefer [`VecEnv::restore_env`].
    ///
    /// # Panics
    /// If `env_idx >= n_envs`.
    pub fn env_mut(&mut self, env_idx: usize) -> &mut E {
        &mut self.envs[env_idx]
    }

    /// Snapshot of environment `env_idx` ([`Env::snapshot`]).
    ///
    /// # Panics
    /// If `env_idx >= n_envs`.
    pub fn snapshot_env(&self, env_idx: usize) -> Vec<u8> {
        self.envs[env_idx].snapshot()
    }

    /// Restore environment `env_idx` from `bytes` and update its row of [`VecEnv::obs`]. Its
    /// episode statistics restart from zero. On error the environment and its observation are
    /// unchanged, except when the restored observation is non-finite: then the environment is
    /// reset and [`EnvError::NonFinite`] returned.
    ///
    /// # Panics
    /// If `env_idx >= n_envs`.
    pub fn restore_env(&mut self, env_idx: usize, bytes: &[u8]) -> Result<(), EnvError> {
        let env = &mut self.envs[env_idx];
        env.restore(bytes, &mut self.scratch_obs)?;
        let row = &mut self.obs[env_idx * self.obs_dim..(env_idx + 1) * self.obs_dim];
        self.stats[env_idx] = EpisodeStats::default();
        if !self.scratch_obs.iter().all(|v| v.is_finite()) {
            let error = EnvError::NonFinite { what: "observation", env: env.name() };
            let mut reset_errors = Vec::new();
            reset_env(env, env_idx, row, &mut reset_errors);
            return Err(error);
        }
        row.copy_from_slice(&self.scratch_obs);
        Ok(())
    }

    /// Start a new episode in environment `env_idx`, seeded with `seed` ([`Env::reset`]) or
    /// drawing on its own generator (`None`, [`Env::reset_next`]), and update its row of
    /// [`VecEnv::obs`]. Its episode statistics restart from zero. On error (or a non-finite
    /// first observation) the row is zeroed and the error returned.
    ///
    /// # Panics
    /// If `env_idx >= n_envs`.
    pub fn reset_env(&mut self, env_idx: usize, seed: Option<u64>) -> Result<(), EnvError> {
        let env = &mut self.envs[env_idx];
        let row = &mut self.obs[env_idx * self.obs_dim..(env_idx + 1) * self.obs_dim];
        self.stats[env_idx] = EpisodeStats::default();
        let result = match seed {
            Some(seed) => env.reset(seed, row),
            None => env.reset_next(row),
        };
        let result = result.and_then(|()| {
            if row.iter().all(|v| v.is_finite()) {
                Ok(())
            } else {
                Err(EnvError::NonFinite { what: "observation", env: env.name() })
            }
        });
        if result.is_err() {
            row.fill(0.0);
        }
        result
    }

    /// Step every environment with its action, auto-resetting those whose episode ends.
    ///
    /// `out` is resized to `n_envs` × `obs_dim` if needed (allocation-free when reused). The
    /// only error is a batch for another number of environments; environment failures
    /// (including an action of the wrong kind or out of range) are reported in
    /// `out.env_errors`: the failed environment is reset, its step reported as a truncation
    /// with reward 0 and its last valid observation as the final observation. Continuous
    /// actions are repaired first ([`ActionSpace::repair`], counted in `out.action_repairs`).
    pub fn step(&mut self, actions: Actions<'_>, out: &mut VecStep) -> Result<(), EnvError> {
        let n_envs = self.envs.len();
        actions.check(n_envs)?;
        let obs_dim = self.obs_dim;
        out.prepare(n_envs, obs_dim);
        let rows = self
            .envs
            .iter_mut()
            .zip(self.stats.iter_mut())
            .zip(self.obs.chunks_exact_mut(obs_dim))
            .zip(out.final_obs.chunks_exact_mut(obs_dim))
            .zip(0..n_envs)
            .zip(out.rewards.iter_mut())
            .zip(out.terminated.iter_mut().zip(out.truncated.iter_mut()));
        for ((((((env, stats), obs_row), final_row), env_idx), reward), (terminated, truncated)) in rows {
            let action = match actions.get(env_idx) {
                Action::Continuous(values) if values.len() == self.scratch_action.len() => {
                    self.scratch_action.copy_from_slice(values);
                    let repair = self.action_space.repair(&mut self.scratch_action);
                    out.action_repairs.non_finite += repair.non_finite;
                    out.action_repairs.out_of_range += repair.out_of_range;
                    Action::Continuous(&self.scratch_action)
                }
                other => other,
            };
            // The step writes into the final-observation row so that the current row still
            // holds the last valid observation if the environment fails.
            let result = env.step(action, final_row);
            let outcome = match result {
                Ok(outcome) if outcome.reward.is_finite() && final_row.iter().all(|v| v.is_finite()) => outcome,
                failed => {
                    let error = match failed {
                        Err(error) => error,
                        Ok(outcome) => EnvError::NonFinite {
                            what: if outcome.reward.is_finite() { "observation" } else { "reward" },
                            env: env.name(),
                        },
                    };
                    *reward = 0.0;
                    *terminated = false;
                    *truncated = true;
                    *stats = EpisodeStats::default();
                    final_row.copy_from_slice(obs_row);
                    out.env_errors.push((env_idx, error));
                    reset_env(env, env_idx, obs_row, &mut out.env_errors);
                    continue;
                }
            };
            *reward = outcome.reward;
            *terminated = outcome.terminated;
            *truncated = outcome.truncated;
            stats.episode_return += outcome.reward;
            stats.episode_len += 1;
            if outcome.done() {
                out.finished_episodes.push(FinishedEpisode {
                    env_idx,
                    episode_return: stats.episode_return,
                    episode_len: stats.episode_len,
                });
                *stats = EpisodeStats::default();
                reset_env(env, env_idx, obs_row, &mut out.env_errors);
            } else {
                obs_row.copy_from_slice(final_row);
            }
        }
        Ok(())
    }
}

/// Start a new episode in `env` with [`Env::reset_next`], writing its first observation into
/// `obs_row`. A failed reset or a non-finite first observation is recorded in `env_errors` and
/// the row zeroed, so a policy never reads a non-finite value.
#[inline]
fn reset_env<E: Env>(env: &mut E, env_idx: usize, obs_row: &mut [f32], env_errors: &mut Vec<(usize, EnvError)>) {
    match env.reset_next(obs_row) {
        Ok(()) if obs_row.iter().all(|v| v.is_finite()) => {}
        Ok(()) => {
            env_errors.push((env_idx, EnvError::NonFinite { what: "observation", env: env.name() }));
            obs_row.fill(0.0);
        }
        Err(error) => {
            env_errors.push((env_idx, error));
            obs_row.fill(0.0);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{CartPole, Memory, MemoryConfig, ObservationSpace, StepOutcome};

    /// A test environment that counts up and misbehaves on cue: its observation is
    /// `[episode_step, 1.0]`, its episodes last `episode_len` steps (truncated), action 1 makes
    /// `step` fail, action 2 yields a NaN observation and action 3 an infinite reward.
    #[derive(Debug, Clone)]
    struct FaultyEnv {
        episode_step: u32,
        episode_len: u32,
        resets: u32,
    }

    impl FaultyEnv {
        fn new(episode_len: u32) -> Self {
            Self { episode_step: 0, episode_len, resets: 0 }
        }
    }

    impl Env for FaultyEnv {
        fn name(&self) -> &'static str {
            "faulty"
        }
        fn observation_space(&self) -> ObservationSpace {
            ObservationSpace::vector(vec![0.0; 2], vec![f32::INFINITY; 2])
        }
        fn action_space(&self) -> ActionSpace {
            ActionSpace::Discrete { n: 4 }
        }
        fn reset(&mut self, _seed: u64, obs: &mut [f32]) -> Result<(), EnvError> {
            self.reset_next(obs)
        }
        fn reset_next(&mut self, obs: &mut [f32]) -> Result<(), EnvError> {
            self.episode_step = 0;
            self.resets += 1;
            obs.copy_from_slice(&[0.0, 1.0]);
            Ok(())
        }
        fn step(&mut self, action: Action<'_>, obs: &mut [f32]) -> Result<StepOutcome, EnvError> {
            let action = action.discrete(4)?;
            // Scribble over the buffer first, as a careless environment might.
            obs.fill(-7.0);
            if action == 1 {
                return Err(EnvError::BadSnapshot("deliberate failure".to_string()));
            }
            self.episode_step += 1;
            obs.copy_from_slice(&[self.episode_step as f32, 1.0]);
            if action == 2 {
                obs[1] = f32::NAN;
            }
            Ok(StepOutcome {
                reward: if action == 3 { f32::INFINITY } else { 0.5 },
                terminated: false,
                truncated: self.episode_step >= self.episode_len,
            })
        }
        fn snapshot(&self) -> Vec<u8> {
            self.episode_step.to_le_bytes().to_vec()
        }
        fn restore(&mut self, bytes: &[u8], obs: &mut [f32]) -> Result<(), EnvError> {
            let bytes: [u8; 4] = bytes.try_into().map_err(|_| EnvError::BadSnapshot("want 4 bytes".to_string()))?;
            self.episode_step = u32::from_le_bytes(bytes);
            obs.copy_from_slice(&[self.episode_step as f32, 1.0]);
            Ok(())
        }
    }

    fn faulty_vec(n_envs: usize, episode_len: u32) -> VecEnv<FaultyEnv> {
        VecEnv::new(vec![FaultyEnv::new(episode_len); n_envs], 0).unwrap()
    }

    #[test]
    fn truncated_episode_reports_final_obs_and_auto_resets() {
        let mut envs = faulty_vec(2, 3);
        let mut out = VecStep::new(2, 2);
        for step_idx in 1..=3u32 {
            envs.step(Actions::Discrete(&[0, 0]), &mut out).unwrap();
            let done = step_idx == 3;
            assert_eq!(out.truncated, vec![done, done]);
            assert_eq!(out.terminated, vec![false, false]);
            assert_eq!(out.rewards, vec![0.5, 0.5]);
            if !done {
                assert_eq!(envs.obs(), &[step_idx as f32, 1.0, step_idx as f32, 1.0]);
                assert!(out.finished_episodes.is_empty());
            }
        }
        // The final observation is the one before the reset; obs is the reset observation.
        assert_eq!(out.final_obs, vec![3.0, 1.0, 3.0, 1.0]);
        assert_eq!(envs.obs(), &[0.0, 1.0, 0.0, 1.0]);
        assert_eq!(
            out.finished_episodes,
            vec![
                FinishedEpisode { env_idx: 0, episode_return: 1.5, episode_len: 3 },
                FinishedEpisode { env_idx: 1, episode_return: 1.5, episode_len: 3 },
            ]
        );
        assert_eq!(envs.env(0).resets, 2);
        // Lists are cleared on the next step.
        envs.step(Actions::Discrete(&[0, 0]), &mut out).unwrap();
        assert!(out.finished_episodes.is_empty());
    }

    #[test]
    fn failing_env_is_reset_and_counted_while_others_continue() {
        let mut envs = faulty_vec(3, 100);
        let mut out = VecStep::new(3, 2);
        envs.step(Actions::Discrete(&[0, 0, 0]), &mut out).unwrap();
        envs.step(Actions::Discrete(&[0, 1, 0]), &mut out).unwrap();
        assert_eq!(out.env_errors.len(), 1);
        assert_eq!(out.env_errors[0].0, 1);
        assert_eq!(out.env_errors[0].1.reason(), "bad_snapshot");
        assert_eq!(out.rewards, vec![0.5, 0.0, 0.5]);
        assert_eq!(out.truncated, vec![false, true, false]);
        assert_eq!(out.terminated, vec![false, false, false]);
        // The failed env's final observation is its last valid one, not the scribbled buffer.
        assert_eq!(&out.final_obs[2..4], &[1.0, 1.0]);
        assert_eq!(envs.obs(), &[2.0, 1.0, 0.0, 1.0, 2.0, 1.0]);
        assert!(out.finished_episodes.is_empty());
        assert_eq!(envs.env(1).resets, 2);

        // Non-finite observation and reward are caught the same way.
        envs.step(Actions::Discrete(&[2, 0, 3]), &mut out).unwrap();
        let reasons: Vec<_> = out.env_errors.iter().map(|(idx, err)| (*idx, err.clone())).collect();
        assert_eq!(
            reasons,
            vec![
                (0, EnvError::NonFinite { what: "observation", env: "faulty" }),
                (2, EnvError::NonFinite { what: "reward", env: "faulty" }),
            ]
        );
        assert_eq!(out.rewards, vec![0.0, 0.5, 0.0]);
        assert_eq!(&out.final_obs[0..2], &[2.0, 1.0]);
        assert_eq!(&out.final_obs[4..6], &[2.0, 1.0]);
        assert!(envs.obs().iter().all(|v| v.is_finite()));
        assert_eq!(envs.obs(), &[0.0, 1.0, 1.0, 1.0, 0.0, 1.0]);

        // The episode statistics of a failed env restart from zero.
        for _ in 0..99 {
            envs.step(Actions::Discrete(&[0, 0, 0]), &mut out).unwrap();
        }
        assert_eq!(out.finished_episodes, vec![FinishedEpisode { env_idx: 1, episode_return: 50.0, episode_len: 100 }]);
    }

    #[test]
    fn wrong_action_count_is_the_only_step_error() {
        let mut envs = faulty_vec(2, 5);
        let mut out = VecStep::new(2, 2);
        assert_eq!(
            envs.step(Actions::Discrete(&[0]), &mut out),
            Err(EnvError::Shape { field: "actions", expected: 2, got: 1 })
        );
        // An out-of-range action is an env error, not a step error.
        let mut cartpoles = VecEnv::new(vec![CartPole::new(), CartPole::new()], 1).unwrap();
        let mut out = VecStep::new(0, 0); // Wrong shape: step resizes it.
        cartpoles.step(Actions::Discrete(&[0, 9]), &mut out).unwrap();
        assert_eq!(out.rewards.len(), 2);
        assert_eq!(out.final_obs.len(), 8);
        assert_eq!(out.env_errors, vec![(1, EnvError::ActionOutOfRange { action: 9, n_actions: 2 })]);
    }

    #[test]
    fn new_resets_each_env_with_a_distinct_derived_seed() {
        let envs = VecEnv::new(vec![CartPole::new(); 4], 99).unwrap();
        assert_eq!((envs.n_envs(), envs.obs_dim(), envs.n_actions()), (4, 4, 2));
        let mut expected = CartPole::new();
        let mut obs = [0.0f32; 4];
        expected.reset(derive_env_seed(99, 2), &mut obs).unwrap();
        assert_eq!(&envs.obs()[8..12], &obs);
        assert_ne!(&envs.obs()[0..4], &envs.obs()[4..8]);
        assert!(VecEnv::<CartPole>::new(Vec::new(), 0).is_err());
    }

    #[test]
    fn mismatched_spaces_are_rejected() {
        let envs = vec![
            Memory::new(MemoryConfig { n_cues: 2, delay: 3 }).unwrap(),
            Memory::new(MemoryConfig { n_cues: 3, delay: 3 }).unwrap(),
        ];
        assert!(matches!(VecEnv::new(envs, 0), Err(EnvError::Shape { .. })));
    }

    #[test]
    fn cartpole_episodes_auto_reset_and_match_a_scalar_env() {
        let seed = 5;
        let mut envs = VecEnv::new(vec![CartPole::new(); 3], seed).unwrap();
        let mut scalar = CartPole::new();
        let mut scalar_obs = [0.0f32; 4];
        scalar.reset(derive_env_seed(seed, 1), &mut scalar_obs).unwrap();
        let mut out = VecStep::new(3, 4);
        let mut n_finished = 0;
        for step_idx in 0..2000usize {
            let actions = [step_idx % 2, (step_idx / 3) % 2, 1];
            envs.step(Actions::Discrete(&actions), &mut out).unwrap();
            assert!(out.env_errors.is_empty());
            let outcome = scalar.step(Action::Discrete(actions[1]), &mut scalar_obs).unwrap();
            assert_eq!(out.rewards[1], outcome.reward);
            assert_eq!((out.terminated[1], out.truncated[1]), (outcome.terminated, outcome.truncated));
            if outcome.done() {
                assert_eq!(&out.final_obs[4..8], &scalar_obs);
                scalar.reset_next(&mut scalar_obs).unwrap();
            }
            assert_eq!(&envs.obs()[4..8], &scalar_obs);
            for episode in &out.finished_episodes {
                assert_eq!(episode.episode_return, episode.episode_len as f32);
                n_finished += 1;
            }
        }
        assert!(n_finished > 3 * 2000 / 500);
    }

    #[test]
    fn restore_env_updates_obs_and_rejects_garbage() {
        let mut envs = VecEnv::new(vec![CartPole::new(); 2], 3).unwrap();
        let mut out = VecStep::new(2, 4);
        envs.step(Actions::Discrete(&[1, 1]), &mut out).unwrap();
        let bytes = envs.snapshot_env(0);
        let obs_then = envs.obs()[0..4].to_vec();
        let state_then = envs.env(0).state();
        envs.step(Actions::Discrete(&[0, 0]), &mut out).unwrap();
        envs.restore_env(1, &bytes).unwrap();
        assert_eq!(&envs.obs()[4..8], &obs_then[..]);
        assert_eq!(envs.env(1).state(), state_then);
        assert_eq!(envs.env(1).elapsed_steps(), 1);
        let before = envs.obs().to_vec();
        assert!(matches!(envs.restore_env(0, b"junk"), Err(EnvError::BadSnapshot(_))));
        assert_eq!(envs.obs(), &before[..]);
    }

    #[test]
    fn step_does_not_reallocate_output_buffers() {
        let mut envs = VecEnv::new(vec![CartPole::new(); 8], 0).unwrap();
        let mut out = VecStep::new(8, 4);
        let pointers = (out.rewards.as_ptr(), out.final_obs.as_ptr(), out.finished_episodes.as_ptr());
        for step_idx in 0..1000 {
            envs.step(Actions::Discrete(&[step_idx % 2; 8]), &mut out).unwrap();
        }
        assert_eq!(pointers, (out.rewards.as_ptr(), out.final_obs.as_ptr(), out.finished_episodes.as_ptr()));
    }
}
