//! CartPole-v1 with exactly the dynamics of Gymnasium's `CartPoleEnv` (Barto, Sutton and
//! Anderson 1983; equations from Florian 2007, "Correct equations for the dynamics of the
//! cart-pole system"), including its `TimeLimit` of 500 steps.
//!
//! - **Observation** (4 × `f32`): cart position `x`, cart velocity `x_dot`, pole angle `theta`
//!   (radians, 0 is upright), pole angular velocity `theta_dot`. The state is kept in `f64` as
//!   Gymnasium does and rounded to `f32` only when written out. Bounds as Gymnasium's:
//!   `x` ±4.8, `theta` ±24° (in radians), velocities unbounded (`f32::INFINITY`, where
//!   Gymnasium writes `f32::MAX`).
//! - **Actions** (2): 0 pushes the cart left (force −10 N), 1 pushes it right (+10 N).
//! - **Reward**: 1.0 for every step, including the one that terminates the episode.
//! - **Termination**: `|x| > 2.4` or `|theta| > 12°` (`12 * 2 * π / 360` radians) after the step.
//! - **Truncation**: after 500 steps (`TimeLimit(max_episode_steps=500)`). Unlike Gymnasium's
//!   wrapper, which raises both flags when the pole falls on step 500, `truncated` is only set
//!   when the episode did not terminate, so `truncated` always means "bootstrap".
//! - **Reset**: every state variable uniform in `[-0.05, 0.05)`, drawn from the environment's
//!   own [`Pcg64Mcg`] (seeded by [`Env::reset`], advanced by [`Env::reset_next`]).
//!
//! Integration is explicit Euler (Gymnasium's default `kinematics_integrator = "euler"`): the
//! positions advance with the old velocities, the velocities with the new accelerations.

use rand::{Rng, SeedableRng};
use rand_pcg::Pcg64Mcg;
use serde::{Deserialize, Serialize};

use super::{
    decode_snapshot, encode_snapshot, obs_shape_error, Action, ActionSpace, Env, EnvError, ObservationSpace,
    StepOutcome,
};

/// Gravitational acceleration, m/s².
pub const GRAVITY: f64 = 9.8;
/// Mass of the cart, kg.
pub const MASSCART: f64 = 1.0;
/// Mass of the pole, kg.
pub const MASSPOLE: f64 = 0.1;
/// Cart plus pole mass, kg (computed as Gymnasium does: `masspole + masscart`).
pub const TOTAL_MASS: f64 = MASSPOLE + MASSCART;
/// Half the pole's length, m (Gymnasium's `length`).
pub const LENGTH: f64 = 0.5;
/// Pole mass times half length (`masspole * length`).
pub const POLEMASS_LENGTH: f64 = MASSPOLE * LENGTH;
/// Magnitude of the force an action applies, N.
pub const FORCE_MAG: f64 = 10.0;
/// Seconds between state updates.
pub const TAU: f64 = 0.02;
/// The pole angle beyond which the episode terminates: 12 degrees, computed as Gymnasium does.
pub const THETA_THRESHOLD_RADIANS: f64 = 12.0 * 2.0 * std::f64::consts::PI / 360.0;
/// The cart position beyond which the episode terminates, m.
pub const X_THRESHOLD: f64 = 2.4;
/// Gymnasium's `max_episode_steps` for CartPole-v1.
pub const MAX_EPISODE_STEPS: u32 = 500;
/// Reset draws every state variable uniformly from `[-RESET_BOUND, RESET_BOUND)`.
pub const RESET_BOUND: f64 = 0.05;
/// Observation length.
pub const OBS_DIM: usize = 4;
/// Number of discrete actions.
pub const N_ACTIONS: usize = 2;

/// One explicit-Euler step of the cart-pole dynamics from `state = [x, x_dot, theta, theta_dot]`
/// under `force` (N), with Gymnasium's operation order so results match it bit for bit.
///
/// With `m = TOTAL_MASS`, `ml = POLEMASS_LENGTH` and `l = LENGTH` (Florian 2007, eqs. 23–24
/// with friction removed):
/// `temp = (F + ml θ̇² sin θ) / m`,
/// `θ̈ = (g sin θ − cos θ · temp) / (l (4/3 − m_p cos² θ / m))`,
/// `ẍ = temp − ml θ̈ cos θ / m`.
#[inline]
pub fn cartpole_euler_step(state: [f64; 4], force: f64) -> [f64; 4] {
    let [x, x_dot, theta, theta_dot] = state;
    let (sintheta, costheta) = theta.sin_cos();
    let temp = (force + POLEMASS_LENGTH * (theta_dot * theta_dot) * sintheta) / TOTAL_MASS;
    let thetaacc =
        (GRAVITY * sintheta - costheta * temp) / (LENGTH * (4.0 / 3.0 - MASSPOLE * (costheta * costheta) / TOTAL_MASS));
    let xacc = temp - POLEMASS_LENGTH * thetaacc * costheta / TOTAL_MASS;
    [x + TAU * x_dot, x_dot + TAU * xacc, theta + TAU * theta_dot, theta_dot + TAU * thetaacc]
}

/// Whether `state` is past Gymnasium's termination thresholds (NaN compares as not terminal,
/// as in Gymnasium).
#[inline]
// Written as Gymnasium writes it rather than `!range.contains(..)`, which would call NaN terminal.
#[allow(clippy::manual_range_contains)]
pub fn cartpole_is_terminal(state: &[f64; 4]) -> bool {
    let [x, _, theta, _] = *state;
    x < -X_THRESHOLD || x > X_THRESHOLD || theta < -THETA_THRESHOLD_RADIANS || theta > THETA_THRESHOLD_RADIANS
}

/// The error for an action other than 0 or 1.
#[cold]
fn bad_action(action: Action<'_>) -> EnvError {
    action.discrete(N_ACTIONS).err().unwrap_or(EnvError::ActionOutOfRange { action: N_ACTIONS, n_actions: N_ACTIONS })
}

#[inline]
fn write_obs(state: &[f64; 4], obs: &mut [f32; OBS_DIM]) {
    for (out, &value) in obs.iter_mut().zip(state) {
        *out = value as f32;
    }
}

/// Gymnasium CartPole-v1 (see the [module documentation](self)).
///
/// A new environment has no episode: call [`Env::reset`] (or [`CartPole::set_state`]) first,
/// otherwise [`Env::step`] returns [`EnvError::EpisodeOver`].
#[derive(Debug, Clone)]
pub struct CartPole {
    state: [f64; 4],
    elapsed_steps: u32,
    episode_over: bool,
    rng: Pcg64Mcg,
}

/// Everything a [`CartPole`] snapshot holds. CartPole has no configuration.
#[derive(Serialize, Deserialize)]
struct CartPoleSnapshot {
    state: [f64; 4],
    elapsed_steps: u32,
    episode_over: bool,
    rng: Pcg64Mcg,
}

impl Default for CartPole {
    fn default() -> Self {
        Self::new()
    }
}

impl CartPole {
    /// A CartPole awaiting its first reset (its generator is seeded with 0 until then).
    pub fn new() -> Self {
        Self { state: [0.0; 4], elapsed_steps: 0, episode_over: true, rng: Pcg64Mcg::seed_from_u64(0) }
    }

    /// Set the exact state `[x, x_dot, theta, theta_dot]` and start a fresh episode from it
    /// (step counter 0, episode live). The random generator is untouched.
    pub fn set_state(&mut self, state: [f64; 4]) {
        self.state = state;
        self.elapsed_steps = 0;
        self.episode_over = false;
    }

    /// The current state `[x, x_dot, theta, theta_dot]` in `f64`.
    pub fn state(&self) -> [f64; 4] {
        self.state
    }

    /// Steps taken in the current episode.
    pub fn elapsed_steps(&self) -> u32 {
        self.elapsed_steps
    }

    /// Write the current observation (the state rounded to `f32`).
    ///
    /// # Panics
    /// If `obs.len() != 4`.
    pub fn write_observation(&self, obs: &mut [f32]) {
        let obs: &mut [f32; OBS_DIM] = obs.try_into().expect("cartpole observations have 4 values");
        write_obs(&self.state, obs);
    }
}

impl Env for CartPole {
    fn name(&self) -> &'static str {
        "cartpole"
    }

    fn observation_space(&self) -> ObservationSpace {
        let high = [(X_THRESHOLD * 2.0) as f32, f32::INFINITY, (THETA_THRESHOLD_RADIANS * 2.0) as f32, f32::INFINITY];
        ObservationSpace::vector(high.iter().map(|v| -v).collect(), high.to_vec())
    }

    fn action_space(&self) -> ActionSpace {
        ActionSpace::Discrete { n: N_ACTIONS }
    }

    fn reset(&mut self, seed: u64, obs: &mut [f32]) -> Result<(), EnvError> {
        if obs.len() != OBS_DIM {
            return Err(obs_shape_error(OBS_DIM, obs.len()));
        }
        self.rng = Pcg64Mcg::seed_from_u64(seed);
        self.reset_next(obs)
    }

    #[inline]
    fn reset_next(&mut self, obs: &mut [f32]) -> Result<(), EnvError> {
        let obs_len = obs.len();
        let obs: &mut [f32; OBS_DIM] = obs.try_into().map_err(|_| obs_shape_error(OBS_DIM, obs_len))?;
        // numpy's `uniform(low, high)` is `low + (high - low) * random()`.
        for value in &mut self.state {
            *value = -RESET_BOUND + (2.0 * RESET_BOUND) * self.rng.random::<f64>();
        }
        self.elapsed_steps = 0;
        self.episode_over = false;
        write_obs(&self.state, obs);
        Ok(())
    }

    // `#[inline]` here and on `reset_next` lets `VecEnv<CartPole>` in other crates inline the
    // step: about 45 vs 27 million steps/s in `benches/env.rs`.
    #[inline]
    fn step(&mut self, action: Action<'_>, obs: &mut [f32]) -> Result<StepOutcome, EnvError> {
        let obs_len = obs.len();
        let obs: &mut [f32; OBS_DIM] = obs.try_into().map_err(|_| obs_shape_error(OBS_DIM, obs_len))?;
        let force = match action {
            Action::Discrete(0) => -FORCE_MAG,
            Action::Discrete(1) => FORCE_MAG,
            other => return Err(bad_action(other)),
        };
        if self.episode_over {
            return Err(EnvError::EpisodeOver);
        }
        self.state = cartpole_euler_step(self.state, force);
        self.elapsed_steps += 1;
        let terminated = cartpole_is_terminal(&self.state);
        let truncated = !terminated && self.elapsed_steps >= MAX_EPISODE_STEPS;
        self.episode_over = terminated || truncated;
        write_obs(&self.state, obs);
        Ok(StepOutcome { reward: 1.0, terminated, truncated })
    }

    fn snapshot(&self) -> Vec<u8> {
        encode_snapshot(
            self.name(),
            &CartPoleSnapshot {
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
        let snapshot: CartPoleSnapshot = decode_snapshot(self.name(), bytes)?;
        if !snapshot.state.iter().all(|v| v.is_finite()) {
            return Err(EnvError::BadSnapshot(format!("cartpole state {:?} is not finite", snapshot.state)));
        }
        if snapshot.elapsed_steps > MAX_EPISODE_STEPS {
            return Err(EnvError::BadSnapshot(format!(
                "cartpole step counter {} exceeds {MAX_EPISODE_STEPS}",
                snapshot.elapsed_steps
            )));
        }
        if snapshot.elapsed_steps == MAX_EPISODE_STEPS && !snapshot.episode_over {
            return Err(EnvError::BadSnapshot("cartpole episode at the step limit is not marked over".to_string()));
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
    use crate::testing::{replay_after_restore, restore_corrupted_snapshot};

    const START: [f64; 4] = [0.01, -0.02, 0.03, 0.04];

    fn live_cartpole(state: [f64; 4]) -> CartPole {
        let mut env = CartPole::new();
        env.set_state(state);
        env
    }

    #[test]
    fn one_step_matches_hand_computed_euler_update() {
        let mut env = live_cartpole(START);
        let mut obs = [0.0f32; 4];
        let outcome = env.step(Action::Discrete(1), &mut obs).unwrap();

        // The formulas written out by hand, in Gymnasium's order of operations.
        let [x, x_dot, theta, theta_dot] = START;
        let force = 10.0;
        let total_mass = 0.1 + 1.0;
        let polemass_length = 0.1 * 0.5;
        let temp = (force + polemass_length * theta_dot.powi(2) * theta.sin()) / total_mass;
        let thetaacc =
            (9.8 * theta.sin() - theta.cos() * temp) / (0.5 * (4.0 / 3.0 - 0.1 * theta.cos().powi(2) / total_mass));
        let xacc = temp - polemass_length * thetaacc * theta.cos() / total_mass;
        let expected = [x + 0.02 * x_dot, x_dot + 0.02 * xacc, theta + 0.02 * theta_dot, theta_dot + 0.02 * thetaacc];
        assert_eq!(env.state(), expected);
        assert_eq!(obs, expected.map(|v| v as f32));
        assert_eq!(outcome, StepOutcome { reward: 1.0, terminated: false, truncated: false });
        assert_eq!(env.elapsed_steps(), 1);
    }

    /// Golden values from an independent Python computation with plain floats (`math.sin`,
    /// `math.cos`, Gymnasium's expression order), printed as IEEE-754 bit patterns.
    #[test]
    fn steps_match_python_golden_bits() {
        let mut env = live_cartpole(START);
        let mut obs = [0.0f32; 4];
        env.step(Action::Discrete(1), &mut obs).unwrap();
        assert_eq!(
            env.state().map(f64::to_bits),
            [4576687645003166306, 4595461501577559966, 4584534716993896657, 13821297530646352165]
        );
        assert_eq!(obs.map(f32::to_bits), [0x3c1d4952, 0x3e32df1a, 0x3cfc5048, 0xbe78e702]);

        let mut env = live_cartpole(START);
        env.step(Action::Discrete(0), &mut obs).unwrap();
        assert_eq!(
            env.state().map(f64::to_bits),
            [4576687645003166306, 13820305668642174633, 4584534716993896657, 4599832458167346957]
        );
        assert_eq!(obs.map(f32::to_bits), [0x3c1d4952, 0xbe5cb643, 0x3cfc5048, 0x3eaf19ff]);

        // Ten steps with actions 0, 1, 0, 1, ...
        let mut env = live_cartpole(START);
        for step_idx in 0..10 {
            env.step(Action::Discrete(step_idx % 2), &mut obs).unwrap();
        }
        assert_eq!(
            env.state().map(f64::to_bits),
            [13802606380901663422, 13806765563781585136, 4590319326590741594, 4596065574498215474]
        );
    }

    #[test]
    fn threshold_constant_matches_gymnasium() {
        // Python: (12 * 2 * math.pi / 360).hex() == '0x1.acee9f37bebd5p-3'.
        assert_eq!(THETA_THRESHOLD_RADIANS.to_bits(), 0x3FCA_CEE9_F37B_EBD5);
        assert_eq!(TOTAL_MASS, 1.1);
    }

    #[test]
    fn terminates_when_cart_leaves_the_track() {
        let mut obs = [0.0f32; 4];
        // x = 2.4 exactly is still inside; moving right at 1 m/s takes it past.
        let mut env = live_cartpole([X_THRESHOLD - 0.01, 1.0, 0.0, 0.0]);
        let outcome = env.step(Action::Discrete(1), &mut obs).unwrap();
        assert!(env.state()[0] > X_THRESHOLD);
        assert!(outcome.terminated && !outcome.truncated);
        assert_eq!(outcome.reward, 1.0);

        let mut env = live_cartpole([-X_THRESHOLD + 0.01, -1.0, 0.0, 0.0]);
        assert!(env.step(Action::Discrete(0), &mut obs).unwrap().terminated);

        // Landing exactly on the threshold does not terminate (strict inequality).
        let mut env = live_cartpole([X_THRESHOLD, 0.0, 0.0, 0.0]);
        assert!(!env.step(Action::Discrete(1), &mut obs).unwrap().terminated);
    }

    #[test]
    fn terminates_when_pole_passes_twelve_degrees() {
        let mut obs = [0.0f32; 4];
        let mut env = live_cartpole([0.0, 0.0, THETA_THRESHOLD_RADIANS - 0.001, 1.0]);
        let outcome = env.step(Action::Discrete(0), &mut obs).unwrap();
        assert!(env.state()[2] > THETA_THRESHOLD_RADIANS);
        assert!(outcome.terminated);
        assert_eq!(outcome.reward, 1.0);

        let mut env = live_cartpole([0.0, 0.0, -THETA_THRESHOLD_RADIANS + 0.001, -1.0]);
        assert!(env.step(Action::Discrete(1), &mut obs).unwrap().terminated);

        let mut env = live_cartpole([0.0, 0.0, THETA_THRESHOLD_RADIANS - 0.001, 0.0]);
        assert!(!env.step(Action::Discrete(1), &mut obs).unwrap().terminated);
    }

    #[test]
    fn truncates_exactly_at_step_500() {
        let mut env = CartPole::new();
        let mut obs = [0.0f32; 4];
        env.reset(7, &mut obs).unwrap();
        for step_idx in 1..=MAX_EPISODE_STEPS {
            // Keep the pole up and the cart near the centre by resetting the state each step;
            // the step counter is what is under test here.
            let state = env.state();
            env.state = [0.0, 0.0, state[2].clamp(-0.01, 0.01), 0.0];
            let outcome = env.step(Action::Discrete((step_idx % 2) as usize), &mut obs).unwrap();
            assert!(!outcome.terminated, "step {step_idx}");
            assert_eq!(outcome.truncated, step_idx == MAX_EPISODE_STEPS, "step {step_idx}");
            assert_eq!(outcome.reward, 1.0);
        }
        assert_eq!(env.elapsed_steps(), 500);
        assert_eq!(env.step(Action::Discrete(0), &mut obs), Err(EnvError::EpisodeOver));
    }

    #[test]
    fn balanced_pole_survives_to_truncation_with_a_simple_controller() {
        let mut env = CartPole::new();
        let mut obs = [0.0f32; 4];
        env.reset(3, &mut obs).unwrap();
        let mut episode_len = 0;
        loop {
            // Push toward the side the pole leans to, damped by the angular velocity.
            let action = usize::from(obs[2] + 0.5 * obs[3] + 0.01 * obs[0] + 0.1 * obs[1] > 0.0);
            let outcome = env.step(Action::Discrete(action), &mut obs).unwrap();
            episode_len += 1;
            if outcome.done() {
                assert!(outcome.truncated && !outcome.terminated);
                break;
            }
        }
        assert_eq!(episode_len, 500);
    }

    #[test]
    fn step_after_termination_is_episode_over() {
        let mut env = live_cartpole([X_THRESHOLD, 1.0, 0.0, 0.0]);
        let mut obs = [0.0f32; 4];
        assert!(env.step(Action::Discrete(1), &mut obs).unwrap().terminated);
        assert_eq!(env.step(Action::Discrete(1), &mut obs), Err(EnvError::EpisodeOver));
        env.reset_next(&mut obs).unwrap();
        assert!(env.step(Action::Discrete(1), &mut obs).is_ok());
    }

    #[test]
    fn new_env_must_be_reset_before_stepping() {
        let mut obs = [0.0f32; 4];
        assert_eq!(CartPole::new().step(Action::Discrete(0), &mut obs), Err(EnvError::EpisodeOver));
    }

    #[test]
    fn out_of_range_action_is_rejected_without_changing_state() {
        let mut env = live_cartpole(START);
        let mut obs = [0.0f32; 4];
        assert_eq!(
            env.step(Action::Discrete(2), &mut obs),
            Err(EnvError::ActionOutOfRange { action: 2, n_actions: 2 })
        );
        assert_eq!(env.state(), START);
        assert_eq!(env.elapsed_steps(), 0);
    }

    #[test]
    fn wrong_obs_length_is_a_shape_error() {
        let mut env = live_cartpole(START);
        let mut obs = [0.0f32; 3];
        assert!(matches!(env.step(Action::Discrete(0), &mut obs), Err(EnvError::Shape { expected: 4, got: 3, .. })));
        assert!(env.reset(0, &mut obs).is_err());
    }

    #[test]
    fn reset_is_seeded_and_within_bounds() {
        let mut first = CartPole::new();
        let mut second = CartPole::new();
        let (mut obs_a, mut obs_b) = ([0.0f32; 4], [0.0f32; 4]);
        first.reset(42, &mut obs_a).unwrap();
        second.reset(42, &mut obs_b).unwrap();
        assert_eq!(first.state(), second.state());
        assert_eq!(obs_a, first.state().map(|v| v as f32));
        for _ in 0..1000 {
            first.reset_next(&mut obs_a).unwrap();
            assert!(first.state().iter().all(|v| (-0.05..0.05).contains(v)));
        }
        second.reset(43, &mut obs_b).unwrap();
        first.reset(42, &mut obs_a).unwrap();
        assert_ne!(first.state(), second.state());
    }

    #[test]
    fn observation_space_matches_gymnasium_bounds() {
        let space = CartPole::new().observation_space();
        assert_eq!(space.dim(), 4);
        assert_eq!(space.high[0], 4.8);
        assert_eq!(space.high[2], (24.0f64.to_radians()) as f32);
        assert_eq!(space.high[1], f32::INFINITY);
        assert_eq!(space.low[3], f32::NEG_INFINITY);
        assert_eq!(space.low[0], -4.8);
    }

    #[test]
    fn snapshot_of_another_env_or_garbage_is_bad_snapshot() {
        let mut env = CartPole::new();
        let mut obs = [0.0f32; 4];
        for bytes in [&b""[..], b"VLYS", b"garbage bytes here", &[0xff; 64]] {
            assert!(matches!(env.restore(bytes, &mut obs), Err(EnvError::BadSnapshot(_))));
        }
        let mut snapshot = live_cartpole(START).snapshot();
        snapshot[7] = b'x'; // The name "cartpole" becomes "cxrtpole".
        assert!(matches!(env.restore(&snapshot, &mut obs), Err(EnvError::BadSnapshot(_))));
        let mut snapshot = live_cartpole(START).snapshot();
        snapshot.push(0);
        assert!(matches!(env.restore(&snapshot, &mut obs), Err(EnvError::BadSnapshot(_))));
        snapshot.truncate(snapshot.len() - 2);
        assert!(matches!(env.restore(&snapshot, &mut obs), Err(EnvError::BadSnapshot(_))));
    }

    #[test]
    fn restore_writes_observation_and_resumes_step_counter() {
        let mut env = live_cartpole(START);
        let mut obs = [0.0f32; 4];
        env.step(Action::Discrete(1), &mut obs).unwrap();
        let bytes = env.snapshot();
        let mut restored = CartPole::new();
        let mut restored_obs = [0.0f32; 4];
        restored.restore(&bytes, &mut restored_obs).unwrap();
        assert_eq!(restored_obs, obs);
        assert_eq!(restored.state(), env.state());
        assert_eq!(restored.elapsed_steps(), 1);
    }

    proptest! {
        #[test]
        fn restored_snapshot_replays_bit_identically(
            seed in any::<u64>(),
            prefix in proptest::collection::vec(0usize..2, 0..300),
            suffix in proptest::collection::vec(0usize..2, 1..300),
        ) {
            let (original, replayed, obs_at_snapshot, restored_obs) = replay_after_restore(
                &mut CartPole::new(), &mut CartPole::new(), seed, &prefix, &suffix);
            prop_assert_eq!(obs_at_snapshot, restored_obs);
            prop_assert_eq!(original, replayed);
        }

        #[test]
        fn restore_of_arbitrary_bytes_never_panics(bytes in proptest::collection::vec(any::<u8>(), 0..128)) {
            let mut env = CartPole::new();
            let mut obs = [0.0f32; 4];
            let _ = env.restore(&bytes, &mut obs);
        }

        #[test]
        fn restore_of_corrupted_snapshot_never_panics(
            seed in any::<u64>(),
            flip_idx in any::<prop::sample::Index>(),
            flip_value in any::<u8>(),
            actions in proptest::collection::vec(0usize..2, 0..50),
        ) {
            restore_corrupted_snapshot(&mut CartPole::new(), &mut CartPole::new(), seed, flip_idx, flip_value, &actions);
        }
    }
}
