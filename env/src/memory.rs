//! Memory: recall a cue after a delay. A partially observable task that a memoryless (MLP)
//! policy cannot solve but a recurrent one can, in the spirit of the T-maze of Bakker (2001),
//! "Reinforcement learning with long short-term memory".
//!
//! An episode lasts `delay + 2` steps. With `t` the number of steps taken so far:
//!
//! - **Observation** (`n_cues + 1` × `f32`): `[cue one-hot (n_cues), query flag]`.
//!   - `t = 0` (after reset): the cue's one-hot, query flag 0.
//!   - `1 ≤ t ≤ delay`: all zeros.
//!   - `t = delay + 1` (the query step): cue part zero, query flag 1.
//!   - After the final step: all zeros.
//!
//!   There is deliberately no time or step feature: every observation after the first is
//!   identical for every cue, so a memoryless policy picks its query action without knowing the
//!   cue and is at chance (expected return `1 / n_cues`).
//! - **Actions** (`n_cues`): at the query step, the cue the agent recalls; ignored before it.
//! - **Reward**: at the query step 1.0 if the action equals the cue, else 0.0; 0.0 at every
//!   other step whatever the action.
//! - **Termination**: after the query step (step `delay + 2`). There is no truncation.
//! - **Reset**: the cue is uniform over `0..n_cues`, drawn from the environment's own
//!   [`Pcg64Mcg`].

use rand::{Rng, SeedableRng};
use rand_pcg::Pcg64Mcg;
use serde::{Deserialize, Serialize};

use super::{
    decode_snapshot, encode_snapshot, obs_shape_error, Action, ActionSpace, Env, EnvError, ObservationSpace,
    StepOutcome,
};

/// Largest `n_cues` a [`MemoryConfig`] accepts.
pub const MAX_N_CUES: usize = 1024;
/// Largest `delay` a [`MemoryConfig`] accepts.
pub const MAX_DELAY: usize = 100_000;

/// Configuration of the [`Memory`] task.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default)]
pub struct MemoryConfig {
    /// Number of distinct cues, which is also the number of actions (2..=1024).
    pub n_cues: usize,
    /// Number of blank steps between the cue and the query (1..=100000).
    pub delay: usize,
}

impl Default for MemoryConfig {
    fn default() -> Self {
        Self { n_cues: 2, delay: 6 }
    }
}

impl MemoryConfig {
    /// Check the bounds documented on each field.
    pub fn validate(&self) -> Result<(), EnvError> {
        if !(2..=MAX_N_CUES).contains(&self.n_cues) {
            return Err(EnvError::Config(format!("memory n_cues {} outside 2..={MAX_N_CUES}", self.n_cues)));
        }
        if !(1..=MAX_DELAY).contains(&self.delay) {
            return Err(EnvError::Config(format!("memory delay {} outside 1..={MAX_DELAY}", self.delay)));
        }
        Ok(())
    }

    /// Observation length: `n_cues + 1`.
    pub fn obs_dim(&self) -> usize {
        self.n_cues + 1
    }

    /// Steps in every episode: the cue step, `delay` blank steps and the query step.
    pub fn episode_len(&self) -> usize {
        self.delay + 2
    }
}

/// The cue-recall task (see the [module documentation](self)).
///
/// A new environment has no episode: call [`Env::reset`] first, otherwise [`Env::step`]
/// returns [`EnvError::EpisodeOver`].
#[derive(Debug, Clone)]
pub struct Memory {
    config: MemoryConfig,
    cue: usize,
    elapsed_steps: usize,
    episode_over: bool,
    rng: Pcg64Mcg,
}

/// Everything a [`Memory`] snapshot holds.
#[derive(Serialize, Deserialize)]
struct MemorySnapshot {
    config: MemoryConfig,
    cue: usize,
    elapsed_steps: usize,
    episode_over: bool,
    rng: Pcg64Mcg,
}

impl Memory {
    /// A Memory task with `config`, awaiting its first reset.
    pub fn new(config: MemoryConfig) -> Result<Self, EnvError> {
        config.validate()?;
        Ok(Self { config, cue: 0, elapsed_steps: 0, episode_over: true, rng: Pcg64Mcg::seed_from_u64(0) })
    }

    /// The configuration.
    pub fn config(&self) -> &MemoryConfig {
        &self.config
    }

    /// The cue of the current episode (the correct answer at the query step).
    pub fn cue(&self) -> usize {
        self.cue
    }

    /// Steps taken in the current episode.
    pub fn elapsed_steps(&self) -> usize {
        self.elapsed_steps
    }

    /// The step index at which the query is shown and answered.
    fn query_step(&self) -> usize {
        self.config.delay + 1
    }

    /// Write the observation for the current step counter; `obs` has the right length.
    fn write_obs(&self, obs: &mut [f32]) {
        obs.fill(0.0);
        if self.episode_over {
            return;
        }
        if self.elapsed_steps == 0 {
            obs[self.cue] = 1.0;
        } else if self.elapsed_steps == self.query_step() {
            obs[self.config.n_cues] = 1.0;
        }
    }

    fn check_obs_len(&self, obs: &[f32]) -> Result<(), EnvError> {
        if obs.len() == self.config.obs_dim() {
            Ok(())
        } else {
            Err(obs_shape_error(self.config.obs_dim(), obs.len()))
        }
    }
}

impl Env for Memory {
    fn name(&self) -> &'static str {
        "memory"
    }

    fn observation_space(&self) -> ObservationSpace {
        ObservationSpace::vector(vec![0.0; self.config.obs_dim()], vec![1.0; self.config.obs_dim()])
    }

    fn action_space(&self) -> ActionSpace {
        ActionSpace::Discrete { n: self.config.n_cues }
    }

    fn reset(&mut self, seed: u64, obs: &mut [f32]) -> Result<(), EnvError> {
        self.check_obs_len(obs)?;
        self.rng = Pcg64Mcg::seed_from_u64(seed);
        self.reset_next(obs)
    }

    fn reset_next(&mut self, obs: &mut [f32]) -> Result<(), EnvError> {
        self.check_obs_len(obs)?;
        self.cue = self.rng.random_range(0..self.config.n_cues);
        self.elapsed_steps = 0;
        self.episode_over = false;
        self.write_obs(obs);
        Ok(())
    }

    fn step(&mut self, action: Action<'_>, obs: &mut [f32]) -> Result<StepOutcome, EnvError> {
        self.check_obs_len(obs)?;
        let action = action.discrete(self.config.n_cues)?;
        if self.episode_over {
            return Err(EnvError::EpisodeOver);
        }
        let answered = self.elapsed_steps == self.query_step();
        self.elapsed_steps += 1;
        self.episode_over = answered;
        self.write_obs(obs);
        let reward = if answered && action == self.cue { 1.0 } else { 0.0 };
        Ok(StepOutcome { reward, terminated: answered, truncated: false })
    }

    fn snapshot(&self) -> Vec<u8> {
        encode_snapshot(
            self.name(),
            &MemorySnapshot {
                config: self.config.clone(),
                cue: self.cue,
                elapsed_steps: self.elapsed_steps,
                episode_over: self.episode_over,
                rng: self.rng.clone(),
            },
        )
    }

    fn restore(&mut self, bytes: &[u8], obs: &mut [f32]) -> Result<(), EnvError> {
        self.check_obs_len(obs)?;
        let snapshot: MemorySnapshot = decode_snapshot(self.name(), bytes)?;
        if snapshot.config != self.config {
            return Err(EnvError::BadSnapshot(format!(
                "memory snapshot config {:?} differs from this environment's {:?}",
                snapshot.config, self.config
            )));
        }
        if snapshot.cue >= self.config.n_cues {
            return Err(EnvError::BadSnapshot(format!(
                "memory cue {} out of range for {} cues",
                snapshot.cue, self.config.n_cues
            )));
        }
        let live_limit = self.query_step();
        if snapshot.elapsed_steps > live_limit + 1 || (snapshot.elapsed_steps > live_limit && !snapshot.episode_over) {
            return Err(EnvError::BadSnapshot(format!(
                "memory step counter {} impossible for delay {}",
                snapshot.elapsed_steps, self.config.delay
            )));
        }
        self.cue = snapshot.cue;
        self.elapsed_steps = snapshot.elapsed_steps;
        self.episode_over = snapshot.episode_over;
        self.rng = snapshot.rng;
        self.write_obs(obs);
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::*;
    use crate::testing::{replay_after_restore, restore_corrupted_snapshot};

    fn memory(n_cues: usize, delay: usize) -> Memory {
        Memory::new(MemoryConfig { n_cues, delay }).unwrap()
    }

    /// Run one episode answering `query_action` (and `0` before the query); return the
    /// observations seen before each action and the episode return.
    fn run_episode(env: &mut Memory, seed: u64, query_action: impl Fn(&[f32]) -> usize) -> (Vec<Vec<f32>>, f32) {
        let mut obs = vec![0.0; env.config().obs_dim()];
        env.reset(seed, &mut obs).unwrap();
        let mut seen = Vec::new();
        let mut episode_return = 0.0;
        loop {
            seen.push(obs.clone());
            let outcome = env.step(Action::Discrete(query_action(&obs)), &mut obs).unwrap();
            episode_return += outcome.reward;
            if outcome.done() {
                assert!(outcome.terminated && !outcome.truncated);
                return (seen, episode_return);
            }
        }
    }

    #[test]
    fn episode_shows_cue_then_blanks_then_query() {
        let mut env = memory(3, 4);
        let (seen, _) = run_episode(&mut env, 11, |_| 0);
        assert_eq!(seen.len(), 6);
        let mut cue_obs = vec![0.0; 4];
        cue_obs[env.cue()] = 1.0;
        assert_eq!(seen[0], cue_obs);
        for blank in &seen[1..5] {
            assert_eq!(blank, &vec![0.0; 4]);
        }
        assert_eq!(seen[5], vec![0.0, 0.0, 0.0, 1.0]);
    }

    #[test]
    fn correct_answer_at_query_earns_one_and_terminates() {
        let mut env = memory(4, 2);
        let mut obs = vec![0.0; 5];
        env.reset(5, &mut obs).unwrap();
        let cue = obs.iter().position(|&v| v == 1.0).unwrap();
        assert_eq!(cue, env.cue());
        let wrong = (cue + 1) % 4;
        // Rewards during the delay are 0 whatever the action, including the cue itself.
        for action in [cue, wrong, cue] {
            let outcome = env.step(Action::Discrete(action), &mut obs).unwrap();
            assert_eq!(outcome, StepOutcome::default());
        }
        assert_eq!(obs[4], 1.0);
        let outcome = env.step(Action::Discrete(cue), &mut obs).unwrap();
        assert_eq!(outcome.reward, 1.0);
        assert!(outcome.terminated);
        assert_eq!(env.step(Action::Discrete(cue), &mut obs), Err(EnvError::EpisodeOver));
    }

    #[test]
    fn wrong_answer_at_query_earns_zero() {
        let mut env = memory(2, 1);
        let mut obs = vec![0.0; 3];
        env.reset(9, &mut obs).unwrap();
        let wrong = 1 - env.cue();
        env.step(Action::Discrete(0), &mut obs).unwrap();
        env.step(Action::Discrete(0), &mut obs).unwrap();
        let outcome = env.step(Action::Discrete(wrong), &mut obs).unwrap();
        assert_eq!(outcome.reward, 0.0);
        assert!(outcome.terminated);
    }

    #[test]
    fn recurrent_oracle_always_succeeds() {
        let mut env = memory(5, 6);
        for seed in 0..50 {
            let remembered = std::cell::Cell::new(None);
            let (_, episode_return) = run_episode(&mut env, seed, |obs| {
                if let Some(cue) = obs[..5].iter().position(|&v| v == 1.0) {
                    remembered.set(Some(cue));
                }
                remembered.get().unwrap_or(0)
            });
            assert_eq!(episode_return, 1.0);
        }
    }

    /// A memoryless policy's query action depends only on the query observation. That
    /// observation (and every other observation but the first) is the same for every cue, so
    /// for any memoryless policy `π`, `E[return] = Σ_c P(c) π(c | query) = 1 / n_cues` when
    /// cues are uniform. The test checks both premises and the resulting chance-level return
    /// of every deterministic memoryless policy.
    #[test]
    fn best_memoryless_policy_is_at_chance() {
        let n_cues = 3;
        let mut env = memory(n_cues, 6);
        let mut later_obs_by_cue: Vec<Option<Vec<Vec<f32>>>> = vec![None; n_cues];
        let mut cue_counts = vec![0usize; n_cues];
        let n_episodes = 3000;
        for seed in 0..n_episodes {
            let (seen, _) = run_episode(&mut env, seed, |_| 0);
            cue_counts[env.cue()] += 1;
            later_obs_by_cue[env.cue()].get_or_insert_with(|| seen[1..].to_vec());
        }
        // Premise 1: after the first step the observation sequence does not depend on the cue.
        let sequences: Vec<_> = later_obs_by_cue.into_iter().map(Option::unwrap).collect();
        assert!(sequences.windows(2).all(|pair| pair[0] == pair[1]));
        // Premise 2: cues are uniform (each within 10% of its expected count of 1000).
        for &count in &cue_counts {
            assert!((900..=1100).contains(&count), "cue counts {cue_counts:?}");
        }
        // Consequence: each fixed query answer wins with frequency about 1 / n_cues.
        for answer in 0..n_cues {
            let mut total = 0.0;
            for seed in 0..n_episodes {
                total += run_episode(&mut env, seed, |_| answer).1;
            }
            let success_rate = total / n_episodes as f32;
            assert!((success_rate - 1.0 / 3.0).abs() < 0.04, "answer {answer}: {success_rate}");
        }
    }

    #[test]
    fn config_is_validated() {
        for (n_cues, delay) in [(1, 6), (0, 6), (2, 0), (MAX_N_CUES + 1, 1), (2, MAX_DELAY + 1)] {
            assert!(matches!(Memory::new(MemoryConfig { n_cues, delay }), Err(EnvError::Config(_))));
        }
        assert!(Memory::new(MemoryConfig::default()).is_ok());
        assert_eq!(MemoryConfig::default(), MemoryConfig { n_cues: 2, delay: 6 });
    }

    #[test]
    fn out_of_range_action_is_rejected() {
        let mut env = memory(2, 3);
        let mut obs = vec![0.0; 3];
        env.reset(0, &mut obs).unwrap();
        assert_eq!(
            env.step(Action::Discrete(2), &mut obs),
            Err(EnvError::ActionOutOfRange { action: 2, n_actions: 2 })
        );
        assert_eq!(env.elapsed_steps(), 0);
    }

    #[test]
    fn restore_rejects_other_config_and_other_env() {
        let mut source = memory(2, 6);
        let mut obs = vec![0.0; 3];
        source.reset(1, &mut obs).unwrap();
        let bytes = source.snapshot();
        let mut other_delay = memory(2, 7);
        assert!(matches!(other_delay.restore(&bytes, &mut obs), Err(EnvError::BadSnapshot(_))));
        let mut cartpole = crate::CartPole::new();
        let mut cartpole_obs = [0.0f32; 4];
        assert!(matches!(cartpole.restore(&bytes, &mut cartpole_obs), Err(EnvError::BadSnapshot(_))));
        let mut obs4 = vec![0.0; 3];
        assert!(matches!(source.restore(&cartpole.snapshot(), &mut obs4), Err(EnvError::BadSnapshot(_))));
    }

    fn config_strategy() -> impl Strategy<Value = MemoryConfig> {
        (2usize..6, 1usize..10).prop_map(|(n_cues, delay)| MemoryConfig { n_cues, delay })
    }

    proptest! {
        #[test]
        fn restored_snapshot_replays_bit_identically(
            config in config_strategy(),
            seed in any::<u64>(),
            prefix in proptest::collection::vec(0usize..64, 0..100),
            suffix in proptest::collection::vec(0usize..64, 1..100),
        ) {
            let n = config.n_cues;
            let prefix: Vec<usize> = prefix.into_iter().map(|a| a % n).collect();
            let suffix: Vec<usize> = suffix.into_iter().map(|a| a % n).collect();
            let (original, replayed, obs_at_snapshot, restored_obs) = replay_after_restore(
                &mut Memory::new(config.clone()).unwrap(),
                &mut Memory::new(config).unwrap(),
                seed, &prefix, &suffix);
            prop_assert_eq!(obs_at_snapshot, restored_obs);
            prop_assert_eq!(original, replayed);
        }

        #[test]
        fn restore_of_arbitrary_bytes_never_panics(bytes in proptest::collection::vec(any::<u8>(), 0..128)) {
            let mut env = Memory::new(MemoryConfig::default()).unwrap();
            let mut obs = vec![0.0; 3];
            let _ = env.restore(&bytes, &mut obs);
        }

        #[test]
        fn restore_of_corrupted_snapshot_never_panics(
            seed in any::<u64>(),
            flip_idx in any::<prop::sample::Index>(),
            flip_value in any::<u8>(),
            actions in proptest::collection::vec(0usize..2, 0..30),
        ) {
            restore_corrupted_snapshot(&mut Memory::new(MemoryConfig::default()).unwrap(), &mut Memory::new(MemoryConfig::default()).unwrap(), seed, flip_idx, flip_value, &actions);
        }
    }
}
