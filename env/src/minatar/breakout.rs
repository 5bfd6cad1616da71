//! MinAtar Breakout, as `minatar/environments/breakout.py` (1.0.15).
//!
//! The paddle moves along the bottom row; the ball travels diagonally, reflecting off the walls,
//! the ceiling, the bricks (three rows, rows 1–3, refilled when all are gone and the ball next
//! reaches the bottom) and the paddle, which sends it back the way it came when the ball was
//! above the paddle and sideways when it lands on it. +1 per brick; the episode ends when the
//! ball reaches the bottom row past the paddle.
//!
//! Channels: 0 paddle, 1 ball, 2 trail (the ball's previous cell), 3 brick.
//! The reset draws `randint(2)` for the ball's starting side. One step breaks at most one
//! brick, so the step reward is at most 1.
//!
//! Quirk kept from the reference: after breaking a brick the ball does not break another on
//! the next step (`strike`); it passes into the brick's cell instead.

use serde::{Deserialize, Serialize};

use super::rng::RandomState;
use super::{set_cell, Action, Game, MinatarGame, GRID};

const CHANNEL_PADDLE: usize = 0;
const CHANNEL_BALL: usize = 1;
const CHANNEL_TRAIL: usize = 2;
const CHANNEL_BRICK: usize = 3;

/// Breakout's state (see the [module documentation](self)).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Breakout {
    ball_x: i32,
    ball_y: i32,
    /// 0 up-left, 1 up-right, 2 down-right, 3 down-left.
    ball_dir: u8,
    /// The paddle's column.
    pos: i32,
    /// Bit `x` of row `y` is the brick at `(y, x)`.
    brick_rows: [u16; GRID],
    strike: bool,
    last_x: i32,
    last_y: i32,
    terminal: bool,
}

/// Rows 1–3 full of bricks.
const FULL_BRICKS: [u16; GRID] = [0, 0x3ff, 0x3ff, 0x3ff, 0, 0, 0, 0, 0, 0];

impl Breakout {
    fn brick(&self, y: i32, x: i32) -> bool {
        self.brick_rows[y as usize] >> x & 1 == 1
    }
}

impl Game for Breakout {
    const GAME: MinatarGame = MinatarGame::Breakout;
    const N_CHANNELS: usize = 4;
    const MINIMAL_ACTIONS: &'static [Action] = &[Action::Noop, Action::Left, Action::Right];
    const MAX_STEP_REWARD: f32 = 1.0;

    fn new(_ramping: bool) -> Self {
        Self {
            ball_x: 0,
            ball_y: 3,
            ball_dir: 2,
            pos: 4,
            brick_rows: FULL_BRICKS,
            strike: false,
            last_x: 0,
            last_y: 3,
            terminal: true,
        }
    }

    fn reset(&mut self, rng: &mut RandomState) {
        self.ball_y = 3;
        let ball_start = rng.randint(0, 2);
        (self.ball_x, self.ball_dir) = if ball_start == 0 { (0, 2) } else { (9, 3) };
        self.pos = 4;
        self.brick_rows = FULL_BRICKS;
        self.strike = false;
        self.last_x = self.ball_x;
        self.last_y = self.ball_y;
        self.terminal = false;
    }

    fn act(&mut self, action: Action, _rng: &mut RandomState) -> (u32, bool) {
        let mut reward = 0;
        if self.terminal {
            return (reward, true);
        }
        match action {
            Action::Left => self.pos = (self.pos - 1).max(0),
            Action::Right => self.pos = (self.pos + 1).min(9),
            _ => {}
        }

        self.last_x = self.ball_x;
        self.last_y = self.ball_y;
        let (mut new_x, mut new_y) = match self.ball_dir {
            0 => (self.ball_x - 1, self.ball_y - 1),
            1 => (self.ball_x + 1, self.ball_y - 1),
            2 => (self.ball_x + 1, self.ball_y + 1),
            _ => (self.ball_x - 1, self.ball_y + 1),
        };

        let mut strike_toggle = false;
        if !(0..=9).contains(&new_x) {
            new_x = new_x.clamp(0, 9);
            self.ball_dir = [1, 0, 3, 2][usize::from(self.ball_dir)];
        }
        if new_y < 0 {
            new_y = 0;
            self.ball_dir = [3, 2, 1, 0][usize::from(self.ball_dir)];
        } else if self.brick(new_y, new_x) {
            strike_toggle = true;
            if !self.strike {
                reward += 1;
                self.strike = true;
                self.brick_rows[new_y as usize] &= !(1 << new_x);
                new_y = self.last_y;
                self.ball_dir = [3, 2, 1, 0][usize::from(self.ball_dir)];
            }
        } else if new_y == 9 {
            if self.brick_rows.iter().all(|&row| row == 0) {
                self.brick_rows = FULL_BRICKS;
            }
            if self.ball_x == self.pos {
                self.ball_dir = [3, 2, 1, 0][usize::from(self.ball_dir)];
                new_y = self.last_y;
            } else if new_x == self.pos {
                self.ball_dir = [2, 3, 0, 1][usize::from(self.ball_dir)];
                new_y = self.last_y;
            } else {
                self.terminal = true;
            }
        }
        if !strike_toggle {
            self.strike = false;
        }
        self.ball_x = new_x;
        self.ball_y = new_y;
        (reward, self.terminal)
    }

    fn render(&self, planes: &mut [u8]) {
        set_cell(planes, CHANNEL_BALL, self.ball_y, self.ball_x);
        set_cell(planes, CHANNEL_PADDLE, 9, self.pos);
        set_cell(planes, CHANNEL_TRAIL, self.last_y, self.last_x);
        for (y, &row) in self.brick_rows.iter().enumerate() {
            for x in 0..GRID {
                if row >> x & 1 == 1 {
                    set_cell(planes, CHANNEL_BRICK, y as i32, x as i32);
                }
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
        let in_grid = |v: i32| (0..=9).contains(&v);
        if ![self.ball_x, self.ball_y, self.pos, self.last_x, self.last_y].into_iter().all(in_grid) {
            return Err(format!(
                "breakout position out of the grid: ball ({}, {}), last ({}, {}), paddle {}",
                self.ball_x, self.ball_y, self.last_x, self.last_y, self.pos
            ));
        }
        if self.ball_dir > 3 {
            return Err(format!("breakout ball direction {} outside 0..=3", self.ball_dir));
        }
        if self.brick_rows.iter().any(|&row| row > 0x3ff) {
            return Err("breakout brick row wider than the grid".to_string());
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::super::testing::{random_play, snapshot_property_test};
    use super::super::{Env, MinAtar, MinatarConfig};
    use super::*;

    fn no_sticky() -> MinAtar<Breakout> {
        MinAtar::new(MinatarConfig { sticky_action_prob: 0.0, ..MinatarConfig::new(MinatarGame::Breakout) }).unwrap()
    }

    #[test]
    fn reset_places_ball_on_a_side_with_full_bricks() {
        let mut env = no_sticky();
        let mut obs = vec![0.0f32; 400];
        env.reset(0, &mut obs).unwrap();
        let game = env.game();
        assert_eq!(game.ball_y, 3);
        assert!(matches!((game.ball_x, game.ball_dir), (0, 2) | (9, 3)));
        assert_eq!(obs[CHANNEL_BRICK * 100..].iter().sum::<f32>(), 30.0);
        assert_eq!(obs[CHANNEL_PADDLE * 100 + 94], 1.0);
    }

    #[test]
    fn ball_reaching_the_floor_past_the_paddle_ends_the_episode() {
        let mut env = no_sticky();
        let mut obs = vec![0.0f32; 400];
        env.reset(0, &mut obs).unwrap();
        // Park the paddle at the far left; the ball comes down somewhere else.
        let mut steps = 0;
        loop {
            let outcome = env.step(crate::Action::Discrete(1), &mut obs).unwrap();
            steps += 1;
            if outcome.terminated {
                break;
            }
            assert!(steps < 100, "the ball never fell");
        }
        assert_eq!(env.game().ball_y, 9);
        assert_eq!(env.step(crate::Action::Discrete(0), &mut obs), Err(super::super::EnvError::EpisodeOver));
    }

    #[test]
    fn random_play_breaks_bricks_and_ends_episodes() {
        let (episodes, total, largest) = random_play::<Breakout>(11, 5000);
        assert!(episodes > 20, "{episodes} episodes");
        assert!(total > 0.0 && largest == 1.0);
    }

    snapshot_property_test!(Breakout);
}
