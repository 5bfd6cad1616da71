//! Milestones: a long-horizon, sparse-reward task with natural checkpoints, made to exercise
//! save-load of episodes (resume exploration from a late checkpoint, as in Go-Explore, Ecoffet
//! et al. 2021, "First return, then explore").
//!
//! The world is a chain of `n_rooms` rooms, each a one-dimensional corridor of `room_len` cells
//! `0..room_len`. The agent enters each room at cell 0. Each room holds a key at a random cell
//! in `1..room_len - 1` (drawn from the environment's generator when the room is entered), and
//! a locked door at the right end, cell `room_len - 1`.
//!
//! - **Actions** (3): 0 moves left, 1 moves right (walls at both ends: moving into one is a
//!   no-op), 2 interacts. Interacting on the key's cell without the key picks it up.
//!   Interacting on the door's cell with the key opens the door: the agent enters the next room
//!   at cell 0 without a key, or, at the last room's door, finishes the task. Any other
//!   interaction is a no-op.
//! - **Observation** (5 × `f32`, each in `[0, 1]`):
//!   `[position / (room_len - 1), key_position / (room_len - 1), has_key,
//!   room / (n_rooms - 1) (0 with one room), elapsed_steps / max_steps]`
//!   (with `room_steps`, the last one is `steps_in_room / room_steps` instead),
//!   and with `task_features` two more that say which member of a task family this is:
//!   `[min(n_rooms, 16) / 16, min(room_len, 64) / 64]` (7 in all).
//!   The last feature is the time left to the limit, which makes the value of a state
//!   well-defined under truncation (Pardo et al. 2018, "Time limits in reinforcement
//!   learning"). The key position is shown whether or not the key has been picked up.
//! - **Reward**: 1.0 on the step that opens the last room's door, 0.0 otherwise.
//! - **Termination**: when the last door opens; with `room_steps > 0`, also (reward 0) when
//!   the agent has spent `room_steps` steps in one room without opening its door. Such chains
//!   are the setting where restarting from saved states pays (Go-Explore; Salimans & Chen 2018):
//!   a random policy clears each room with some probability `q < 1` (about 0.19 for rooms of 6
//!   cells and 32 steps), so fresh episodes reach room `k` with probability about `q^k`, while
//!   an episode restarted on entering room `k` faces only the rooms left.
//! - **Truncation**: after `max_steps` steps of the episode, unless the same step terminated.
//! - **Milestones**: [`Env::at_milestone`] is true exactly between the step that opened a door
//!   into room 1, 2, … and the next step (or reset or restore of another state): the state right
//!   after entering a new room. It is never true at reset (room 0) or after the episode ended.
//!
//! With the default configuration (4 rooms of 8 cells, 128 steps) a uniformly random policy
//! finishes well under 1% of episodes, while from a snapshot taken on entering the last room
//! it finishes about half of them.

use rand::{Rng, SeedableRng};
use rand_pcg::Pcg64Mcg;
use serde::{Deserialize, Serialize};

use super::{
    decode_snapshot, encode_snapshot, obs_shape_error, Action, ActionSpace, Env, EnvError, ObservationSpace,
    StepOutcome,
};

/// Observation length without task features.
pub const OBS_DIM: usize = 5;
/// Observation length with [`MilestonesConfig::task_features`].
pub const OBS_DIM_WITH_TASK_FEATURES: usize = OBS_DIM + 2;
/// Number of discrete actions: left, right, interact.
pub const N_ACTIONS: usize = 3;
/// Action: move one cell left.
pub const ACTION_LEFT: usize = 0;
/// Action: move one cell right.
pub const ACTION_RIGHT: usize = 1;
/// Action: pick up the key or open the door.
pub const ACTION_INTERACT: usize = 2;
/// Largest `n_rooms` a [`MilestonesConfig`] accepts.
pub const MAX_N_ROOMS: usize = 1024;
/// Largest `room_len` a [`MilestonesConfig`] accepts.
pub const MAX_ROOM_LEN: usize = 1024;
/// Largest `max_steps` a [`MilestonesConfig`] accepts.
pub const MAX_MAX_STEPS: usize = 100_000_000;

/// Configuration of the [`Milestones`] task.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default)]
pub struct MilestonesConfig {
    /// Rooms in the chain (1..=1024).
    pub n_rooms: usize,
    /// Cells per room (3..=1024): the entry cell, at least one key cell, the door cell.
    pub room_len: usize,
    /// Steps before the episode is truncated; at least [`MilestonesConfig::min_solution_steps`]
    /// so the task stays solvable, at most 100000000.
    pub max_steps: usize,
    /// Steps allowed in each room (0: no per-room limit, 1..=100000000): the episode ends with
    /// reward 0 when one room takes this long (see the module documentation).
    pub room_steps: usize,
    /// Append `n_rooms` and `room_len` (scaled) to the observation, so a policy shared by a
    /// family of chains can tell them apart.
    pub task_features: bool,
}

impl Default for MilestonesConfig {
    fn default() -> Self {
        let (n_rooms, room_len) = (4, 8);
        Self {
            n_rooms,
            room_len,
            max_steps: Self::default_max_steps(n_rooms, room_len),
            room_steps: 0,
            task_features: false,
        }
    }
}

impl MilestonesConfig {
    /// The default step limit for a chain: `4 * n_rooms * room_len` (128 for the defaults),
    /// about 3.5 times what an optimal policy needs.
    pub fn default_max_steps(n_rooms: usize, room_len: usize) -> usize {
        4 * n_rooms * room_len
    }

    /// Steps an optimal policy needs in the worst case: per room, `room_len - 1` moves and two
    /// interactions.
    pub fn min_solution_steps(&self) -> usize {
        self.n_rooms * (self.room_len + 1)
    }

    /// Observation length: [`OBS_DIM`], or [`OBS_DIM_WITH_TASK_FEATURES`].
    pub fn obs_dim(&self) -> usize {
        if self.task_features {
            OBS_DIM_WITH_TASK_FEATURES
        } else {
            OBS_DIM
        }
    }

    /// Check the bounds documented on each field.
    pub fn validate(&self) -> Result<(), EnvError> {
        if !(1..=MAX_N_ROOMS).contains(&self.n_rooms) {
            return Err(EnvError::Config(format!("milestones n_rooms {} outside 1..={MAX_N_ROOMS}", self.n_rooms)));
        }
        if !(3..=MAX_ROOM_LEN).contains(&self.room_len) {
            return Err(EnvError::Config(format!("milestones room_len {} outside 3..={MAX_ROOM_LEN}", self.room_len)));
        }
        if self.room_steps != 0 && !(self.room_len + 1..=MAX_MAX_STEPS).contains(&self.room_steps) {
            return Err(EnvError::Config(format!(
                "milestones room_steps {} outside {}..={MAX_MAX_STEPS} (or 0 for no per-room limit)",
                self.room_steps,
                self.room_len + 1
            )));
        }
        let min_steps = self.min_solution_steps();
        if !(min_steps..=MAX_MAX_STEPS).contains(&self.max_steps) {
            return Err(EnvError::Config(format!(
                "milestones max_steps {} outside {min_steps}..={MAX_MAX_STEPS} \
                 (an optimal policy may need {min_steps})",
                self.max_steps
            )));
        }
        Ok(())
    }
}

/// The room-chain task (see the [module documentation](self)).
///
/// A new environment has no episode: call [`Env::reset`] first, otherwise [`Env::step`]
/// returns [`EnvError::EpisodeOver`].
#[derive(Debug, Clone)]
pub struct Milestones {
    config: MilestonesConfig,
    state: RoomState,
    rng: Pcg64Mcg,
}

/// The dynamic part of a [`Milestones`] environment.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
struct RoomState {
    room: usize,
    position: usize,
    key_position: usize,
    has_key: bool,
    just_entered_room: bool,
    elapsed_steps: usize,
    /// Steps since entering the current room.
    room_elapsed: usize,
    episode_over: bool,
}

/// Everything a [`Milestones`] snapshot holds.
#[derive(Serialize, Deserialize)]
struct MilestonesSnapshot {
    config: MilestonesConfig,
    state: RoomState,
    rng: Pcg64Mcg,
}

impl Milestones {
    /// A Milestones task with `config`, awaiting its first reset.
    pub fn new(config: MilestonesConfig) -> Result<Self, EnvError> {
        config.validate()?;
        Ok(Self {
            state: RoomState {
                room: 0,
                position: 0,
                key_position: 1,
                has_key: false,
                just_entered_room: false,
                elapsed_steps: 0,
                room_elapsed: 0,
                episode_over: true,
            },
            config,
            rng: Pcg64Mcg::seed_from_u64(0),
        })
    }

    /// The configuration.
    pub fn config(&self) -> &MilestonesConfig {
        &self.config
    }

    /// The room the agent is in (`0..n_rooms`).
    pub fn room(&self) -> usize {
        self.state.room
    }

    /// The agent's cell in its room (`0..room_len`).
    pub fn position(&self) -> usize {
        self.state.position
    }

    /// The key's cell in the current room (`1..room_len - 1`).
    pub fn key_position(&self) -> usize {
        self.state.key_position
    }

    /// Whether the agent holds the current room's key.
    pub fn has_key(&self) -> bool {
        self.state.has_key
    }

    /// Steps taken in the current episode.
    pub fn elapsed_steps(&self) -> usize {
        self.state.elapsed_steps
    }

    fn draw_key_position(&mut self) -> usize {
        self.rng.random_range(1..self.config.room_len - 1)
    }

    fn write_obs(&self, obs: &mut [f32]) {
        let last_cell = (self.config.room_len - 1) as f32;
        let last_room = self.config.n_rooms.saturating_sub(1).max(1) as f32;
        obs[0] = self.state.position as f32 / last_cell;
        obs[1] = self.state.key_position as f32 / last_cell;
        obs[2] = f32::from(u8::from(self.state.has_key));
        obs[3] = self.state.room as f32 / last_room;
        obs[4] = if self.config.room_steps > 0 {
            self.state.room_elapsed as f32 / self.config.room_steps as f32
        } else {
            self.state.elapsed_steps as f32 / self.config.max_steps as f32
        };
        if self.config.task_features {
            obs[5] = self.config.n_rooms.min(16) as f32 / 16.0;
            obs[6] = self.config.room_len.min(64) as f32 / 64.0;
        }
    }

    fn check_obs_len(&self, obs: &[f32]) -> Result<(), EnvError> {
        let want = self.config.obs_dim();
        if obs.len() == want {
            Ok(())
        } else {
            Err(obs_shape_error(want, obs.len()))
        }
    }

    /// Validate a decoded state against this environment's configuration.
    fn check_state(&self, state: &RoomState) -> Result<(), String> {
        let config = &self.config;
        if state.room >= config.n_rooms {
            return Err(format!("room {} of {}", state.room, config.n_rooms));
        }
        if state.position >= config.room_len {
            return Err(format!("position {} in a room of {}", state.position, config.room_len));
        }
        if !(1..config.room_len - 1).contains(&state.key_position) {
            return Err(format!("key position {} in a room of {}", state.key_position, config.room_len));
        }
        if state.elapsed_steps > config.max_steps || (state.elapsed_steps == config.max_steps && !state.episode_over) {
            return Err(format!("step counter {} with max_steps {}", state.elapsed_steps, config.max_steps));
        }
        if config.room_steps > 0 && (state.room_elapsed >= config.room_steps && !state.episode_over) {
            return Err(format!("{} steps in a room with room_steps {}", state.room_elapsed, config.room_steps));
        }
        Ok(())
    }
}

impl Env for Milestones {
    fn name(&self) -> &'static str {
        "milestones"
    }

    fn observation_space(&self) -> ObservationSpace {
        let dim = self.config.obs_dim();
        ObservationSpace::vector(vec![0.0; dim], vec![1.0; dim])
    }

    fn action_space(&self) -> ActionSpace {
        ActionSpace::Discrete { n: N_ACTIONS }
    }

    fn reset(&mut self, seed: u64, obs: &mut [f32]) -> Result<(), EnvError> {
        self.check_obs_len(obs)?;
        self.rng = Pcg64Mcg::seed_from_u64(seed);
        self.reset_next(obs)
    }

    fn reset_next(&mut self, obs: &mut [f32]) -> Result<(), EnvError> {
        self.check_obs_len(obs)?;
        self.state = RoomState {
            room: 0,
            position: 0,
            key_position: self.draw_key_position(),
            has_key: false,
            just_entered_room: false,
            elapsed_steps: 0,
            room_elapsed: 0,
            episode_over: false,
        };
        self.write_obs(obs);
        Ok(())
    }

    fn step(&mut self, action: Action<'_>, obs: &mut [f32]) -> Result<StepOutcome, EnvError> {
        self.check_obs_len(obs)?;
        let action = action.discrete(N_ACTIONS)?;
        if self.state.episode_over {
            return Err(EnvError::EpisodeOver);
        }
        let door_cell = self.config.room_len - 1;
        self.state.elapsed_steps += 1;
        self.state.room_elapsed += 1;
        self.state.just_entered_room = false;
        let mut terminated = false;
        let mut reward = 0.0;
        match action {
            ACTION_LEFT => self.state.position = self.state.position.saturating_sub(1),
            ACTION_RIGHT => self.state.position = (self.state.position + 1).min(door_cell),
            _ => {
                if !self.state.has_key && self.state.position == self.state.key_position {
                    self.state.has_key = true;
                } else if self.state.has_key && self.state.position == door_cell {
                    if self.state.room + 1 == self.config.n_rooms {
                        terminated = true;
                        reward = 1.0;
                    } else {
                        self.state.room += 1;
                        self.state.position = 0;
                        self.state.has_key = false;
                        self.state.key_position = self.draw_key_position();
                        self.state.just_entered_room = true;
                        self.state.room_elapsed = 0;
                    }
                }
            }
        }
        if self.config.room_steps > 0 && self.state.room_elapsed >= self.config.room_steps {
            // Only reached when this step did not open the room's door (that resets the count).
            terminated = true;
        }
        let truncated = !terminated && self.state.elapsed_steps >= self.config.max_steps;
        self.state.episode_over = terminated || truncated;
        if self.state.episode_over {
            self.state.just_entered_room = false;
        }
        self.write_obs(obs);
        Ok(StepOutcome { reward, terminated, truncated })
    }

    fn snapshot(&self) -> Vec<u8> {
        encode_snapshot(
            self.name(),
            &MilestonesSnapshot { config: self.config.clone(), state: self.state, rng: self.rng.clone() },
        )
    }

    fn restore(&mut self, bytes: &[u8], obs: &mut [f32]) -> Result<(), EnvError> {
        self.check_obs_len(obs)?;
        let snapshot: MilestonesSnapshot = decode_snapshot(self.name(), bytes)?;
        if snapshot.config != self.config {
            return Err(EnvError::BadSnapshot(format!(
                "milestones snapshot config {:?} differs from this environment's {:?}",
                snapshot.config, self.config
            )));
        }
        self.check_state(&snapshot.state)
            .map_err(|reason| EnvError::BadSnapshot(format!("milestones state: {reason}")))?;
        self.state = snapshot.state;
        self.rng = snapshot.rng;
        self.write_obs(obs);
        Ok(())
    }

    fn at_milestone(&self) -> bool {
        self.state.just_entered_room && !self.state.episode_over
    }

    /// Rooms opened, plus half a room once the key is held: the stage of the chain reached.
    fn progress(&self) -> f32 {
        self.state.room as f32 + if self.state.has_key { 0.5 } else { 0.0 }
    }
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;
    use rand::Rng;

    use super::*;
    use crate::testing::{replay_after_restore, restore_corrupted_snapshot};

    fn reset_default(seed: u64) -> (Milestones, Vec<f32>) {
        let mut env = Milestones::new(MilestonesConfig::default()).unwrap();
        let mut obs = vec![0.0; OBS_DIM];
        env.reset(seed, &mut obs).unwrap();
        (env, obs)
    }

    /// The optimal action: walk to the key, pick it up, walk to the door, open it.
    fn scripted_action(env: &Milestones) -> usize {
        let target = if env.has_key() { env.config().room_len - 1 } else { env.key_position() };
        match env.position().cmp(&target) {
            std::cmp::Ordering::Less => ACTION_RIGHT,
            std::cmp::Ordering::Greater => ACTION_LEFT,
            std::cmp::Ordering::Equal => ACTION_INTERACT,
        }
    }

    /// Run a uniformly random policy until the episode ends; return whether it succeeded.
    fn random_rollout(env: &mut Milestones, obs: &mut [f32], policy_rng: &mut Pcg64Mcg) -> bool {
        loop {
            let outcome = env.step(Action::Discrete(policy_rng.random_range(0..N_ACTIONS)), obs).unwrap();
            if outcome.done() {
                return outcome.terminated;
            }
        }
    }

    #[test]
    fn a_room_that_takes_room_steps_ends_the_episode_and_opening_a_door_resets_the_count() {
        let config = MilestonesConfig { n_rooms: 2, room_len: 6, room_steps: 10, max_steps: 40, ..Default::default() };
        let mut env = Milestones::new(config.clone()).unwrap();
        let mut obs = vec![0.0; OBS_DIM];
        env.reset(3, &mut obs).unwrap();
        // Pacing left at the wall: the tenth step in the room ends the episode, no reward.
        for step in 1..=10 {
            let outcome = env.step(Action::Discrete(ACTION_LEFT), &mut obs).unwrap();
            assert_eq!(obs[4], step as f32 / 10.0);
            assert_eq!(outcome.terminated, step == 10, "step {step}");
            assert!(!outcome.truncated && outcome.reward == 0.0);
        }
        // The scripted policy clears each room in at most 7 steps, so a room limit of 10 never
        // ends its episode, and entering the second room resets the count.
        env.reset(3, &mut obs).unwrap();
        let mut steps = 0;
        loop {
            let outcome = env.step(Action::Discrete(scripted_action(&env)), &mut obs).unwrap();
            steps += 1;
            if env.at_milestone() {
                assert_eq!(obs[4], 0.0);
            }
            if outcome.done() {
                assert!(outcome.terminated && outcome.reward == 1.0, "{outcome:?} after {steps}");
                break;
            }
        }
        // Snapshots carry the count (and `restored_snapshot_replays_bit_identically` covers
        // per-room limits too).
        assert!(MilestonesConfig { room_steps: 6, ..config.clone() }.validate().is_err(), "room_steps <= room_len");
    }

    #[test]
    fn task_features_say_which_chain_this_is() {
        let config = MilestonesConfig { n_rooms: 3, room_len: 6, task_features: true, ..Default::default() };
        let mut env = Milestones::new(config.clone()).unwrap();
        assert_eq!(env.observation_space().dim(), OBS_DIM_WITH_TASK_FEATURES);
        let mut short = vec![0.0; OBS_DIM];
        assert!(env.reset(1, &mut short).is_err());
        let mut obs = vec![0.0; OBS_DIM_WITH_TASK_FEATURES];
        env.reset(1, &mut obs).unwrap();
        assert_eq!(&obs[5..], &[3.0 / 16.0, 6.0 / 64.0]);
        let big = MilestonesConfig { n_rooms: 40, room_len: 100, max_steps: 16_000, ..config };
        let mut env = Milestones::new(big).unwrap();
        env.reset(1, &mut obs).unwrap();
        assert_eq!(&obs[5..], &[1.0, 1.0]);
    }

    #[test]
    fn scripted_policy_solves_in_minimum_steps_with_milestones_at_each_room() {
        let (mut env, mut obs) = reset_default(4);
        assert!(!env.at_milestone());
        let mut rooms_entered = Vec::new();
        let mut steps = 0;
        let mut rewards = Vec::new();
        loop {
            let outcome = env.step(Action::Discrete(scripted_action(&env)), &mut obs).unwrap();
            steps += 1;
            rewards.push(outcome.reward);
            if env.at_milestone() {
                rooms_entered.push(env.room());
                assert_eq!(env.position(), 0);
                assert!(!env.has_key());
                assert_eq!(obs[3], env.room() as f32 / 3.0);
            }
            if outcome.done() {
                assert!(outcome.terminated && !outcome.truncated);
                assert_eq!(outcome.reward, 1.0);
                break;
            }
        }
        assert_eq!(rooms_entered, vec![1, 2, 3]);
        assert!(steps <= MilestonesConfig::default().min_solution_steps());
        assert_eq!(rewards.iter().sum::<f32>(), 1.0);
        assert!(!env.at_milestone());
    }

    #[test]
    fn milestone_flag_clears_on_the_next_step() {
        let (mut env, mut obs) = reset_default(8);
        while !env.at_milestone() {
            env.step(Action::Discrete(scripted_action(&env)), &mut obs).unwrap();
        }
        env.step(Action::Discrete(ACTION_LEFT), &mut obs).unwrap();
        assert!(!env.at_milestone());
        assert_eq!(env.room(), 1);
    }

    #[test]
    fn observation_encodes_position_key_and_time() {
        let (mut env, mut obs) = reset_default(2);
        let key = env.key_position();
        assert_eq!(obs, vec![0.0, key as f32 / 7.0, 0.0, 0.0, 0.0]);
        env.step(Action::Discrete(ACTION_LEFT), &mut obs).unwrap(); // Wall: stays at 0.
        assert_eq!(env.position(), 0);
        for _ in 0..key {
            env.step(Action::Discrete(ACTION_RIGHT), &mut obs).unwrap();
        }
        env.step(Action::Discrete(ACTION_INTERACT), &mut obs).unwrap();
        assert!(env.has_key());
        let elapsed = (key + 2) as f32;
        assert_eq!(obs, vec![key as f32 / 7.0, key as f32 / 7.0, 1.0, 0.0, elapsed / 128.0]);
    }

    #[test]
    fn door_stays_shut_without_key() {
        let (mut env, mut obs) = reset_default(5);
        for _ in 0..7 {
            env.step(Action::Discrete(ACTION_RIGHT), &mut obs).unwrap();
        }
        env.step(Action::Discrete(ACTION_RIGHT), &mut obs).unwrap(); // Wall at the door.
        assert_eq!(env.position(), 7);
        let outcome = env.step(Action::Discrete(ACTION_INTERACT), &mut obs).unwrap();
        assert_eq!(outcome, StepOutcome::default());
        assert_eq!(env.room(), 0);
    }

    #[test]
    fn truncates_at_max_steps() {
        let config = MilestonesConfig { n_rooms: 1, room_len: 3, max_steps: 4, ..Default::default() };
        let mut env = Milestones::new(config).unwrap();
        let mut obs = vec![0.0; OBS_DIM];
        env.reset(0, &mut obs).unwrap();
        for step_idx in 1..=4 {
            let outcome = env.step(Action::Discrete(ACTION_LEFT), &mut obs).unwrap();
            assert!(!outcome.terminated);
            assert_eq!(outcome.truncated, step_idx == 4);
        }
        assert_eq!(obs[4], 1.0);
        assert_eq!(env.step(Action::Discrete(ACTION_LEFT), &mut obs), Err(EnvError::EpisodeOver));
        assert_eq!(
            env.step(Action::Discrete(3), &mut obs),
            Err(EnvError::ActionOutOfRange { action: 3, n_actions: 3 })
        );
    }

    #[test]
    fn config_is_validated() {
        let bad = [
            (0, 8, 128),
            (4, 2, 128),
            (4, 8, 35),
            (MAX_N_ROOMS + 1, 8, 1_000_000),
            (1, MAX_ROOM_LEN + 1, 1_000_000),
            (1, 8, MAX_MAX_STEPS + 1),
        ];
        for (n_rooms, room_len, max_steps) in bad {
            let config = MilestonesConfig { n_rooms, room_len, max_steps, ..Default::default() };
            assert!(matches!(Milestones::new(config), Err(EnvError::Config(_))));
        }
        let default = MilestonesConfig::default();
        assert_eq!((default.n_rooms, default.room_len, default.max_steps), (4, 8, 128));
        assert!(Milestones::new(MilestonesConfig { max_steps: 36, ..default }).is_ok());
    }

    #[test]
    fn keys_are_drawn_inside_the_room_on_entry() {
        let (mut env, mut obs) = reset_default(0);
        let mut seen = std::collections::BTreeSet::new();
        for _ in 0..300 {
            env.reset_next(&mut obs).unwrap();
            seen.insert(env.key_position());
        }
        assert_eq!(seen.into_iter().collect::<Vec<_>>(), vec![1, 2, 3, 4, 5, 6]);
    }

    /// The point of the task: a random policy almost never finishes from the start, but
    /// resuming from the snapshot taken on entering the last room makes success likely.
    #[test]
    fn resuming_from_last_room_snapshot_makes_random_policy_succeed_far_more_often() {
        let n_episodes = 400;
        let mut policy_rng = Pcg64Mcg::seed_from_u64(2024);

        let (mut env, mut obs) = reset_default(1);
        let mut successes_from_start = 0;
        for _ in 0..n_episodes {
            env.reset_next(&mut obs).unwrap();
            successes_from_start += usize::from(random_rollout(&mut env, &mut obs, &mut policy_rng));
        }

        // Reach the last room with the scripted policy and snapshot at the milestone.
        let (mut env, mut obs) = reset_default(1);
        while !(env.at_milestone() && env.room() == 3) {
            env.step(Action::Discrete(scripted_action(&env)), &mut obs).unwrap();
        }
        let checkpoint = env.snapshot();
        let mut successes_from_checkpoint = 0;
        for _ in 0..n_episodes {
            env.restore(&checkpoint, &mut obs).unwrap();
            successes_from_checkpoint += usize::from(random_rollout(&mut env, &mut obs, &mut policy_rng));
        }

        assert!(successes_from_start <= 4, "from start: {successes_from_start}/{n_episodes}");
        assert!(successes_from_checkpoint >= 120, "from checkpoint: {successes_from_checkpoint}/{n_episodes}");
    }

    #[test]
    fn restore_rejects_other_config() {
        let (env, mut obs) = reset_default(3);
        let bytes = env.snapshot();
        let mut other =
            Milestones::new(MilestonesConfig { n_rooms: 5, room_len: 8, max_steps: 160, ..Default::default() })
                .unwrap();
        assert!(matches!(other.restore(&bytes, &mut obs), Err(EnvError::BadSnapshot(_))));
    }

    fn config_strategy() -> impl Strategy<Value = MilestonesConfig> {
        (1usize..4, 3usize..7, 0usize..20, proptest::option::of(0usize..8), any::<bool>()).prop_map(
            |(n_rooms, room_len, extra, room_extra, task_features)| {
                let min_steps = n_rooms * (room_len + 1);
                MilestonesConfig {
                    n_rooms,
                    room_len,
                    max_steps: min_steps + extra,
                    room_steps: room_extra.map_or(0, |extra| room_len + 1 + extra),
                    task_features,
                }
            },
        )
    }

    proptest! {
        #[test]
        fn restored_snapshot_replays_bit_identically(
            config in config_strategy(),
            seed in any::<u64>(),
            prefix in proptest::collection::vec(0usize..3, 0..200),
            suffix in proptest::collection::vec(0usize..3, 1..200),
        ) {
            let (original, replayed, obs_at_snapshot, restored_obs) = replay_after_restore(
                &mut Milestones::new(config.clone()).unwrap(),
                &mut Milestones::new(config).unwrap(),
                seed, &prefix, &suffix);
            prop_assert_eq!(obs_at_snapshot, restored_obs);
            prop_assert_eq!(original, replayed);
        }

        #[test]
        fn restore_of_arbitrary_bytes_never_panics(bytes in proptest::collection::vec(any::<u8>(), 0..128)) {
            let mut env = Milestones::new(MilestonesConfig::default()).unwrap();
            let mut obs = vec![0.0; OBS_DIM];
            let _ = env.restore(&bytes, &mut obs);
        }

        #[test]
        fn restore_of_corrupted_snapshot_never_panics(
            seed in any::<u64>(),
            flip_idx in any::<prop::sample::Index>(),
            flip_value in any::<u8>(),
            actions in proptest::collection::vec(0usize..3, 0..200),
        ) {
            restore_corrupted_snapshot(&mut Milestones::new(MilestonesConfig::default()).unwrap(), &mut Milestones::new(MilestonesConfig::default()).unwrap(), seed, flip_idx, flip_value, &actions);
        }
    }
}
