//! MinAtar Freeway, as `minatar/environments/freeway.py` (1.0.15).
//!
//! The chicken walks up column 4 from the bottom row, at most one cell every 3 steps; reaching
//! the top gives +1, sends it back to the bottom and re-draws the car speeds. Eight cars, one
//! per row 1–8, wrap around horizontally, each moving one cell every 1–5 steps; a car hitting
//! the chicken sends it back to the bottom. The episode ends after 2,500 steps (on step 2,501).
//!
//! Channels: 0 chicken, 1 car, 2–6 trail by speed (`speed1`…`speed5`: the cell behind a car,
//! in the channel of how many steps it waits between moves).
//! Draws per car re-draw: `randint(1, 6, 8)` for the eight speeds, then `rand(8)` for the eight
//! directions (`sign(u - 0.5)`). At most one crossing per step: the step reward is at most 1.
//!
//! Quirk of the reference: a direction draw of exactly 0.5 (probability 2^-53) gives a car of
//! speed 0, for which the reference's `state()` reuses the previous car's trail channel or
//! raises; here such a car has no trail.

use serde::{Deserialize, Serialize};

use super::rng::RandomState;
use super::{set_cell, Action, Game, MinatarGame};

/// Steps between the chicken's moves.
const PLAYER_SPEED: i32 = 3;
/// The reference's `time_limit`: the episode ends when this many steps have passed, on the next.
pub const TIME_LIMIT: i32 = 2500;
const N_CARS: usize = 8;

const CHANNEL_CHICKEN: usize = 0;
const CHANNEL_CAR: usize = 1;
/// `speed1`; `speed<k>` is `CHANNEL_SPEED1 + k - 1`.
const CHANNEL_SPEED1: usize = 2;

/// One car: `[x, y, timer, speed]` in the reference (speed signed by direction).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
struct Car {
    x: i32,
    y: i32,
    timer: i32,
    speed: i32,
}

/// Freeway's state (see the [module documentation](self)).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Freeway {
    cars: [Car; N_CARS],
    /// The chicken's row.
    pos: i32,
    move_timer: i32,
    terminate_timer: i32,
    terminal: bool,
}

/// Eight signed speeds: `randint(1, 6, 8) * sign(rand(8) - 0.5)`, drawn in that order.
fn draw_speeds(rng: &mut RandomState) -> [i32; N_CARS] {
    let mut speeds = [0i32; N_CARS];
    for speed in &mut speeds {
        *speed = rng.randint(1, 6) as i32;
    }
    for speed in &mut speeds {
        let u = rng.rand() - 0.5;
        *speed *= if u > 0.0 {
            1
        } else if u < 0.0 {
            -1
        } else {
            0
        };
    }
    speeds
}

impl Freeway {
    fn randomize_cars(&mut self, rng: &mut RandomState, initialize: bool) {
        let speeds = draw_speeds(rng);
        for (idx, (car, &speed)) in self.cars.iter_mut().zip(&speeds).enumerate() {
            if initialize {
                *car = Car { x: 0, y: idx as i32 + 1, timer: speed.abs(), speed };
            } else {
                car.timer = speed.abs();
                car.speed = speed;
            }
        }
    }
}

impl Game for Freeway {
    const GAME: MinatarGame = MinatarGame::Freeway;
    const N_CHANNELS: usize = 7;
    const MINIMAL_ACTIONS: &'static [Action] = &[Action::Noop, Action::Up, Action::Down];
    const MAX_STEP_REWARD: f32 = 1.0;

    fn new(_ramping: bool) -> Self {
        let cars = std::array::from_fn(|idx| Car { x: 0, y: idx as i32 + 1, timer: 1, speed: 1 });
        Self { cars, pos: 9, move_timer: PLAYER_SPEED, terminate_timer: TIME_LIMIT, terminal: true }
    }

    fn reset(&mut self, rng: &mut RandomState) {
        self.randomize_cars(rng, true);
        self.pos = 9;
        self.move_timer = PLAYER_SPEED;
        self.terminate_timer = TIME_LIMIT;
        self.terminal = false;
    }

    fn act(&mut self, action: Action, rng: &mut RandomState) -> (u32, bool) {
        let mut reward = 0;
        if self.terminal {
            return (reward, true);
        }
        if action == Action::Up && self.move_timer == 0 {
            self.move_timer = PLAYER_SPEED;
            self.pos = (self.pos - 1).max(0);
        } else if action == Action::Down && self.move_timer == 0 {
            self.move_timer = PLAYER_SPEED;
            self.pos = (self.pos + 1).min(9);
        }

        if self.pos == 0 {
            reward += 1;
            self.randomize_cars(rng, false);
            self.pos = 9;
        }

        for car in &mut self.cars {
            if (car.x, car.y) == (4, self.pos) {
                self.pos = 9;
            }
            if car.timer == 0 {
                car.timer = car.speed.abs();
                car.x += if car.speed > 0 { 1 } else { -1 };
                if car.x < 0 {
                    car.x = 9;
                } else if car.x > 9 {
                    car.x = 0;
                }
                if (car.x, car.y) == (4, self.pos) {
                    self.pos = 9;
                }
            } else {
                car.timer -= 1;
            }
        }

        if self.move_timer > 0 {
            self.move_timer -= 1;
        }
        self.terminate_timer -= 1;
        if self.terminate_timer < 0 {
            self.terminal = true;
        }
        (reward, self.terminal)
    }

    fn render(&self, planes: &mut [u8]) {
        set_cell(planes, CHANNEL_CHICKEN, self.pos, 4);
        for car in &self.cars {
            set_cell(planes, CHANNEL_CAR, car.y, car.x);
            let mut back_x = if car.speed > 0 { car.x - 1 } else { car.x + 1 };
            if back_x < 0 {
                back_x = 9;
            } else if back_x > 9 {
                back_x = 0;
            }
            let speed = car.speed.unsigned_abs() as usize;
            if (1..=5).contains(&speed) {
                set_cell(planes, CHANNEL_SPEED1 + speed - 1, car.y, back_x);
            }
        }
    }

    fn difficulty_ramp(&self) -> Option<u32> {
        None
    }

    fn is_terminal(&self) -> bool {
        self.terminal
    }

    fn check(&self) -> Result<(), String> {
        for (idx, car) in self.cars.iter().enumerate() {
            if !(0..=9).contains(&car.x)
                || car.y != idx as i32 + 1
                || car.speed.abs() > 5
                || !(0..=car.speed.abs()).contains(&car.timer)
            {
                return Err(format!("freeway car {idx} {car:?} out of range"));
            }
        }
        if !(0..=9).contains(&self.pos) || !(0..=PLAYER_SPEED).contains(&self.move_timer) {
            return Err(format!("freeway chicken row {} or move timer {} out of range", self.pos, self.move_timer));
        }
        if !(-1..=TIME_LIMIT).contains(&self.terminate_timer) {
            return Err(format!("freeway clock {} outside -1..={TIME_LIMIT}", self.terminate_timer));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::super::testing::{random_play, snapshot_property_test};
    use super::super::{Env, MinAtar};
    use super::*;

    #[test]
    fn episode_ends_on_step_2501() {
        let mut env = MinAtar::<Freeway>::with_defaults();
        let mut obs = vec![0.0f32; 700];
        env.reset(4, &mut obs).unwrap();
        for step_idx in 1..=2501 {
            let outcome = env.step(crate::Action::Discrete(0), &mut obs).unwrap();
            assert_eq!(outcome.terminated, step_idx == 2501, "step {step_idx}");
        }
    }

    #[test]
    fn always_up_crosses_the_road_sometimes() {
        let mut env = MinAtar::<Freeway>::with_defaults();
        let mut obs = vec![0.0f32; 700];
        env.reset(4, &mut obs).unwrap();
        let mut total = 0.0;
        loop {
            let outcome = env.step(crate::Action::Discrete(1), &mut obs).unwrap();
            total += outcome.reward;
            if outcome.terminated {
                break;
            }
        }
        assert!(total >= 5.0, "crossed {total} times");
        // Every car has exactly one trail cell, in the channel of its speed.
        let trails: f32 = obs[CHANNEL_SPEED1 * 100..].iter().sum();
        assert_eq!(trails, 8.0);
    }

    #[test]
    fn random_play_scores() {
        let (episodes, _, largest) = random_play::<Freeway>(2, 6000);
        assert_eq!(episodes, 2);
        assert!(largest <= 1.0);
    }

    snapshot_property_test!(Freeway, ProptestConfig::with_cases(64));
}
