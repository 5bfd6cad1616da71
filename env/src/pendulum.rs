//! Pendulum-v1 with the dynamics, reward and time limit of Gymnasium's `PendulumEnv`
//! (gymnasium 1.x, `classic_control/pendulum.py`, default `g = 10.0`).
//!
//! - **State** (`f64`, as Gymnasium keeps it): angle `theta` (radians, 0 is upright) and angular
//!   velocity `theta_dot`.
//! - **Observation** (3 × `f32`): `cos θ`, `sin θ`, `θ̇`, computed in `f64` and rounded to `f32`
//!   as Gymnasium's `_get_obs` does. Bounds `[-1, -1, -8]` to `[1, 1, 8]`.
//! - **Action** (continuous, 1 value): the torque, clipped to `[-2, 2]` (Gymnasium clips too).
//! - **Reward**: `-(normalize(θ)² + 0.1 θ̇² + 0.001 u²)` of the state *before* the step, where
//!   `normalize` wraps the angle into `[-π, π)`; between about −16.27 and 0.
//! - **Dynamics**: `θ̇' = clip(θ̇ + (3g/(2l) sin θ + 3/(m l²) u) dt, −8, 8)`, `θ' = θ + θ̇' dt`
//!   with `g = 10`, `m = l = 1`, `dt = 0.05`.
//! - **Termination**: never. **Truncation**: after 200 steps (`TimeLimit(max_episode_steps=200)`).
//! - **Reset**: `θ` uniform in `[-π, π)`, `θ̇` uniform in `[-1, 1)`, from the environment's own
//!   [`Pcg64Mcg`] (Gymnasium draws the same distribution from numpy's generator; the streams
//!   differ, so golden tests set the state exactly with [`Pendulum::set_state`]).
//!
//! Arithmetic follows numpy 2's promotion rules (NEP 50) for Gymnasium's expressions: the
//! torque is an `f32` scalar, so `0.001 * u**2` and `3.0 / (m * l**2) * u` are computed in
//! `f32` and then added to `f64` terms. The golden test (`env/tests/pendulum_golden.rs`)
//! compares with Gymnasium step by step.

use rand::{Rng, SeedableRng};
use rand_pcg::Pcg64Mcg;
use serde::{Deserialize, Serialize};

use super::{
    decode_snapshot, encode_snapshot, obs_shape_error, Action, ActionSpace, Env, EnvError, ObservationSpace,
    StepOutcome,
};

/// Maximum angular speed, rad/s.
pub const MAX_SPEED: f64 = 8.0;
/// Maximum torque, N·m (the action's bound).
pub const MAX_TORQUE: f32 = 2.0;
/// Seconds between state updates.
pub const DT: f64 = 0.05;
/// Gravitational acceleration (Gymnasium's default `g`).
pub const GRAVITY: f64 = 10.0;
/// Pendulum mass, kg.
pub const MASS: f64 = 1.0;
/// Pendulum length, m.
pub const LENGTH: f64 = 1.0;
/// Gymnasium's `max_episode_steps` for Pendulum-v1.
pub const MAX_EPISODE_STEPS: u32 = 200;
/// Observation length.
pub const OBS_DIM: usize = 3;
/// Values per action.
pub const ACTION_DIM: usize = 1;
/// Reset draws `θ` from `[-RESET_THETA, RESET_THETA)` (Gymnasium's `DEFAULT_X = π`).
pub const RESET_THETA: f64 = std::f64::consts::PI;
/// Reset draws `θ̇` from `[-RESET_THETA_DOT, RESET_THETA_DOT)` (Gymnasium's `DEFAULT_Y = 1`).
pub const RESET_THETA_DOT: f64 = 1.0;
/// The largest cost of one step: `π² + 0.1·8² + 0.001·2²`.
pub const MAX_COST: f64 = std::f64::consts::PI * std::f64::consts::PI + 0.1 * MAX_SPEED * MAX_SPEED + 0.004;

/// Wrap an angle into `[-π, π)`, as Gymnasium's `angle_normalize` (numpy's floored modulo).
#[inline]
pub fn angle_normalize(theta: f64) -> f64 {
    use std::f64::consts::PI;
    (theta + PI).rem_euclid(2.0 * PI) - PI
}

/// One step from `state = [θ, θ̇]` under torque `u` (already clipped): the new state and the
/// cost of the old one, with Gymnasium's operation order and numpy 2's precision per term.
#[inline]
pub fn pendulum_step(state: [f64; 2], u: f32) -> ([f64; 2], f64) {
    let [theta, theta_dot] = state;
    let cost = angle_normalize(theta).powi(2) + 0.1 * theta_dot.powi(2) + f64::from(0.001f32 * (u * u));
    let torque_term = f64::from((3.0 / (MASS * LENGTH * LENGTH)) as f32 * u);
    let new_theta_dot = theta_dot + (3.0 * GRAVITY / (2.0 * LENGTH) * theta.sin() + torque_term) * DT;
    let new_theta_dot = new_theta_dot.clamp(-MAX_SPEED, MAX_SPEED);
    let new_theta = theta + new_theta_dot * DT;
    ([new_theta, new_theta_dot], cost)
}

#[inline]
fn write_obs(state: &[f64; 2], obs: &mut [f32; OBS_DIM]) {
    let [theta, theta_dot] = *state;
    *obs = [theta.cos() as f32, theta.sin() as f32, theta_dot as f32];
}

/// Gymnasium Pendulum-v1 (see the [module documentation](self)).
///
/// A new environment has no episode: call [`Env::reset`] (or [`Pendulum::set_state`]) first,
/// otherwise [`Env::step`] returns [`EnvError::EpisodeOver`].
#[derive(Debug, Clone)]
pub struct Pendulum {
    state: [f64; 2],
    elapsed_steps: u32,
    episode_over: bool,
    rng: Pcg64Mcg,
}

/// Everything a [`Pendulum`] snapshot holds. Pendulum has no configuration.
#[derive(Serialize, Deserialize)]
struct PendulumSnapshot {
    state: [f64; 2],
    elapsed_steps: u32,
    episode_over: bool,
    rng: Pcg64Mcg,
}

impl Default for Pendulum {
    fn default() -> Self {
        Self::new()
    }
}

impl Pendulum {
    /// A pendulum awaiting its first reset (its generator is seeded with 0 until then).
    pub fn new() -> Self {
        Self { state: [0.0; 2], elapsed_steps: 0, episode_over: true, rng: Pcg64Mcg::seed_from_u64(0) }
    }

    /// Set the exact state `[θ, θ̇]` and start a fresh episode from it (step counter 0,
    /// episode live). The random generator is untouched.
    pub fn set_state(&mut self, state: [f64; 2]) {
        self.state = state;
        self.elapsed_steps = 0;
        self.episode_over = false;
    }

    /// The current state `[θ, θ̇]` in `f64`.
    pub fn state(&self) -> [f64; 2] {
        self.state
    }

    /// Steps taken in the current episode.
    pub fn elapsed_steps(&self) -> u32 {
        self.elapsed_steps
    }

    fn start_episode(&mut self, obs: &mut [f32]) -> Result<(), EnvError> {
        let obs_len = obs.len();
        let obs: &mut [f32; OBS_DIM] = obs.try_into().map_err(|_| obs_shape_error(OBS_DIM, obs_len))?;
        let theta = self.rng.random_range(-RESET_THETA..RESET_THETA);
        let theta_dot = self.rng.random_range(-RESET_THETA_DOT..RESET_THETA_DOT);
        self.set_state([theta, theta_dot]);
        write_obs(&self.state, obs);
        Ok(())
    }
}

impl Env for Pendulum {
    fn name(&self) -> &'static str {
        "pendulum"
    }

    fn observation_space(&self) -> ObservationSpace {
        let max_speed = MAX_SPEED as f32;
        ObservationSpace::vector(vec![-1.0, -1.0, -max_speed], vec![1.0, 1.0, max_speed])
    }

    fn action_space(&self) -> ActionSpace {
        ActionSpace::Box { low: vec![-MAX_TORQUE], high: vec![MAX_TORQUE], shape: vec![ACTION_DIM] }
    }

    fn reset(&mut self, seed: u64, obs: &mut [f32]) -> Result<(), EnvError> {
        self.rng = Pcg64Mcg::seed_from_u64(seed);
        self.start_episode(obs)
    }

    fn reset_next(&mut self, obs: &mut [f32]) -> Result<(), EnvError> {
        self.start_episode(obs)
    }

    #[inline]
    fn step(&mut self, action: Action<'_>, obs: &mut [f32]) -> Result<StepOutcome, EnvError> {
        let obs_len = obs.len();
        let obs: &mut [f32; OBS_DIM] = obs.try_into().map_err(|_| obs_shape_error(OBS_DIM, obs_len))?;
        let torque = action.continuous(ACTION_DIM)?[0];
        if !torque.is_finite() {
            return Err(EnvError::NonFinite { what: "action", env: "pendulum" });
        }
        if self.episode_over {
            return Err(EnvError::EpisodeOver);
        }
        let (state, cost) = pendulum_step(self.state, torque.clamp(-MAX_TORQUE, MAX_TORQUE));
        self.state = state;
        self.elapsed_steps += 1;
        let truncated = self.elapsed_steps >= MAX_EPISODE_STEPS;
        self.episode_over = truncated;
        write_obs(&self.state, obs);
        Ok(StepOutcome { reward: (-cost) as f32, terminated: false, truncated })
    }

    fn snapshot(&self) -> Vec<u8> {
        encode_snapshot(
            self.name(),
            &PendulumSnapshot {
                state: self.state,
                elapsed_steps: self.elapsed_steps,
                episode_over: self.episode_over,
                rng: self.rng.clone(),
            },
        )
    }

    fn restore(&mut self, bytes: &[u8], obs: &mut [f32]) -> Result<(), EnvError> {
        let obs_len = obs.len();
        let obs: &mut [f32; OBS_DIM] = obs.try_into().map_err(|_| obs_shape_error(OBS_DIM, obs_len))?;
        let snapshot: PendulumSnapshot = decode_snapshot(self.name(), bytes)?;
        if !snapshot.state.iter().all(|v| v.is_finite()) || snapshot.elapsed_steps > MAX_EPISODE_STEPS {
            return Err(EnvError::BadSnapshot("pendulum state out of range".to_string()));
        }
        self.state = snapshot.state;
        self.elapsed_steps = snapshot.elapsed_steps;
        self.episode_over = snapshot.episode_over;
        self.rng = snapshot.rng;
        write_obs(&self.state, obs);
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::*;
    use crate::{Actions, VecEnv, VecStep};

    fn step(env: &mut Pendulum, torque: f32) -> ([f32; OBS_DIM], StepOutcome) {
        let mut obs = [0.0f32; OBS_DIM];
        let outcome = env.step(Action::Continuous(&[torque]), &mut obs).expect("live episode");
        (obs, outcome)
    }

    #[test]
    fn upright_and_still_costs_nothing_and_stays() {
        let mut env = Pendulum::new();
        env.set_state([0.0, 0.0]);
        let (obs, outcome) = step(&mut env, 0.0);
        assert_eq!(obs, [1.0, 0.0, 0.0]);
        assert_eq!(outcome, StepOutcome { reward: -0.0, terminated: false, truncated: false });
    }

    #[test]
    fn hand_computed_step() {
        // θ = 1, θ̇ = 0.5, u = 1.5: cost = 1 + 0.1·0.25 + 0.001·2.25;
        // θ̇' = 0.5 + (15 sin 1 + 4.5)·0.05, θ' = 1 + 0.05 θ̇'.
        let mut env = Pendulum::new();
        env.set_state([1.0, 0.5]);
        let (_, outcome) = step(&mut env, 1.5);
        let theta_dot = 0.5 + (15.0 * 1.0f64.sin() + 4.5) * 0.05;
        assert_eq!(env.state(), [1.0 + theta_dot * 0.05, theta_dot]);
        assert_eq!(outcome.reward, (-(1.0 + 0.025 + f64::from(0.001f32 * 2.25))) as f32);
    }

    #[test]
    fn torque_is_clipped_and_speed_is_capped() {
        let mut clipped = Pendulum::new();
        clipped.set_state([0.3, 0.0]);
        let mut at_bound = clipped.clone();
        assert_eq!(step(&mut clipped, 50.0), step(&mut at_bound, 2.0));
        let mut fast = Pendulum::new();
        fast.set_state([0.0, 7.99]);
        step(&mut fast, 2.0);
        assert_eq!(fast.state()[1], MAX_SPEED);
    }

    #[test]
    fn angles_wrap_like_numpy_floored_modulo() {
        use std::f64::consts::PI;
        assert_eq!(angle_normalize(0.0), 0.0);
        assert_eq!(angle_normalize(PI), -PI);
        assert!((angle_normalize(3.0 * PI / 2.0) + PI / 2.0).abs() < 1e-12);
        assert!((angle_normalize(-3.0 * PI / 2.0) - PI / 2.0).abs() < 1e-12);
        assert!((angle_normalize(-7.0) - (-7.0 + 2.0 * PI)).abs() < 1e-12);
    }

    #[test]
    fn truncates_after_200_steps_and_never_terminates() {
        let mut env = Pendulum::new();
        let mut obs = [0.0f32; OBS_DIM];
        env.reset(3, &mut obs).unwrap();
        for t in 1..=MAX_EPISODE_STEPS {
            let (_, outcome) = step(&mut env, 1.0);
            assert!(!outcome.terminated);
            assert_eq!(outcome.truncated, t == MAX_EPISODE_STEPS, "step {t}");
        }
        assert_eq!(env.step(Action::Continuous(&[0.0]), &mut obs), Err(EnvError::EpisodeOver));
    }

    #[test]
    fn wrong_actions_are_errors_not_panics() {
        let mut env = Pendulum::new();
        env.set_state([0.0, 0.0]);
        let mut obs = [0.0f32; OBS_DIM];
        assert_eq!(env.step(Action::Discrete(1), &mut obs), Err(EnvError::WrongActionKind { expected: "continuous" }));
        assert!(matches!(env.step(Action::Continuous(&[0.0, 1.0]), &mut obs), Err(EnvError::Shape { .. })));
        assert!(matches!(env.step(Action::Continuous(&[f32::NAN]), &mut obs), Err(EnvError::NonFinite { .. })));
        assert_eq!(env.elapsed_steps(), 0, "a refused action does not step");
    }

    #[test]
    fn vec_env_repairs_and_counts_bad_actions() {
        let mut envs = VecEnv::new(vec![Pendulum::new(); 4], 9).unwrap();
        let mut reference = VecEnv::new(vec![Pendulum::new(); 4], 9).unwrap();
        let mut out = VecStep::new(4, OBS_DIM);
        let mut reference_out = VecStep::new(4, OBS_DIM);
        envs.step(Actions::Continuous { values: &[f32::NAN, 9.0, f32::NEG_INFINITY, 0.5], dim: 1 }, &mut out).unwrap();
        reference.step(Actions::Continuous { values: &[0.0, 2.0, -2.0, 0.5], dim: 1 }, &mut reference_out).unwrap();
        assert!(out.env_errors.is_empty(), "{:?}", out.env_errors);
        assert_eq!(out.action_repairs, crate::ActionRepair { non_finite: 2, out_of_range: 1 });
        assert_eq!(envs.obs(), reference.obs(), "repaired actions act as their repaired values");
        assert_eq!(out.rewards, reference_out.rewards);
    }

    #[test]
    fn reset_draws_the_documented_ranges() {
        let mut env = Pendulum::new();
        let mut obs = [0.0f32; OBS_DIM];
        env.reset(11, &mut obs).unwrap();
        for _ in 0..1000 {
            env.reset_next(&mut obs).unwrap();
            let [theta, theta_dot] = env.state();
            assert!((-RESET_THETA..RESET_THETA).contains(&theta));
            assert!((-RESET_THETA_DOT..RESET_THETA_DOT).contains(&theta_dot));
        }
    }

    proptest! {
        #[test]
        fn restore_replays_the_same_future(seed in any::<u64>(), prefix in prop::collection::vec(-3.0f32..3.0, 0..250),
                                           suffix in prop::collection::vec(-3.0f32..3.0, 1..250)) {
            let mut env = Pendulum::new();
            let mut obs = [0.0f32; OBS_DIM];
            env.reset(seed, &mut obs).unwrap();
            let run = |env: &mut Pendulum, torques: &[f32]| -> Vec<(u32, u32, bool)> {
                let mut obs = [0.0f32; OBS_DIM];
                torques.iter().map(|&torque| {
                    let outcome = env.step(Action::Continuous(&[torque]), &mut obs).unwrap();
                    if outcome.done() {
                        env.reset_next(&mut obs).unwrap();
                    }
                    (obs[0].to_bits() ^ obs[2].to_bits(), outcome.reward.to_bits(), outcome.truncated)
                }).collect()
            };
            run(&mut env, &prefix);
            let bytes = env.snapshot();
            let original = run(&mut env, &suffix);
            let mut fresh = Pendulum::new();
            let mut restored_obs = [0.0f32; OBS_DIM];
            fresh.restore(&bytes, &mut restored_obs).unwrap();
            prop_assert_eq!(run(&mut fresh, &suffix), original);
        }

        #[test]
        fn rewards_stay_within_the_declared_bound(theta in -50.0f64..50.0, theta_dot in -8.0f64..8.0, u in -2.0f32..2.0) {
            let (state, cost) = pendulum_step([theta, theta_dot], u);
            prop_assert!((0.0..=MAX_COST).contains(&cost));
            prop_assert!(state[1].abs() <= MAX_SPEED);
        }
    }
}
