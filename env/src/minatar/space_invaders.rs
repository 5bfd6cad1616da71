//! MinAtar Space Invaders, as `minatar/environments/space_invaders.py` (1.0.15).
//!
//! The cannon moves along the bottom row and fires upward (one shot every 5 steps). A 4×6 block
//! of aliens moves sideways, stepping down and turning at the walls, one move every
//! `min(aliens left, move interval)` steps, and every 10 steps the alien nearest the cannon
//! (by column distance, the left one on ties, the lowest in its column) drops a bullet. +1 per
//! alien shot; a cleared wave is replaced, and with difficulty ramping the next one moves one
//! step more often (down to every 6 steps). The episode ends when an alien or a bullet reaches
//! the cannon, or an alien in the bottom row has to step down.
//!
//! Channels: 0 cannon, 1 alien, 2 alien moving left, 3 alien moving right, 4 friendly bullet,
//! 5 enemy bullet. The game draws nothing at random (only the sticky actions do).
//! A shot lives 9 steps and a new one needs 5, so at most 2 are in flight and the step reward is
//! at most 2.
//!
//! The maps are `numpy.roll`ed as in the reference, so rows wrap around: an alien block that
//! steps down from the bottom row reappears at the top (the episode has ended by then).

use serde::{Deserialize, Serialize};

use super::rng::RandomState;
use super::{set_cell, Action, Game, MinatarGame, GRID};

const SHOT_COOL_DOWN: i32 = 5;
const ENEMY_MOVE_INTERVAL: i32 = 12;
const ENEMY_SHOT_INTERVAL: i32 = 10;
/// The fastest the ramp makes the aliens: one move every 6 steps.
const MIN_ENEMY_MOVE_INTERVAL: i32 = 6;

const CHANNEL_CANNON: usize = 0;
const CHANNEL_ALIEN: usize = 1;
const CHANNEL_ALIEN_LEFT: usize = 2;
const CHANNEL_ALIEN_RIGHT: usize = 3;
const CHANNEL_FRIENDLY_BULLET: usize = 4;
const CHANNEL_ENEMY_BULLET: usize = 5;

/// One 10×10 boolean map: bit `x` of row `y` is cell `(y, x)`.
type Map = [u16; GRID];
const ROW_MASK: u16 = 0x3ff;
/// Rows 0–3, columns 2–7: `alien_map[0:4, 2:8] = 1`.
const ALIEN_WAVE: Map = [0xfc, 0xfc, 0xfc, 0xfc, 0, 0, 0, 0, 0, 0];

fn cell(map: &Map, y: usize, x: i32) -> bool {
    map[y] >> x & 1 == 1
}

fn count(map: &Map) -> u32 {
    map.iter().map(|row| row.count_ones()).sum()
}

fn column_occupied(map: &Map, x: usize) -> bool {
    map.iter().any(|row| row >> x & 1 == 1)
}

/// `np.roll(map, 1, axis=0)`: every row moves down one, the bottom row to the top.
fn roll_rows_down(map: &mut Map) {
    map.rotate_right(1);
}

/// `np.roll(map, -1, axis=0)`: every row moves up one, the top row to the bottom.
fn roll_rows_up(map: &mut Map) {
    map.rotate_left(1);
}

/// `np.roll(map, shift, axis=1)` for `shift` ±1: columns move right (+1) or left (-1), wrapping.
fn roll_columns(map: &mut Map, shift: i32) {
    for row in map.iter_mut() {
        *row = if shift > 0 { (*row << 1 | *row >> 9) & ROW_MASK } else { (*row >> 1 | (*row & 1) << 9) & ROW_MASK };
    }
}

/// Space Invaders' state (see the [module documentation](self)).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SpaceInvaders {
    ramping: bool,
    /// The cannon's column.
    pos: i32,
    f_bullet_map: Map,
    e_bullet_map: Map,
    alien_map: Map,
    /// -1 left, +1 right.
    alien_dir: i32,
    enemy_move_interval: i32,
    alien_move_timer: i32,
    alien_shot_timer: i32,
    ramp_index: u32,
    shot_timer: i32,
    terminal: bool,
}

impl SpaceInvaders {
    /// The reference's `_nearest_alien(pos)`: `(row, column)` of the lowest alien in the
    /// occupied column nearest `pos`, the left column first on ties.
    fn nearest_alien(&self) -> Option<(usize, usize)> {
        let pos = self.pos as usize;
        let candidates = (0..GRID).flat_map(|distance| {
            let left = pos.checked_sub(distance);
            let right = if distance > 0 { Some(pos + distance).filter(|&x| x < GRID) } else { None };
            left.into_iter().chain(right)
        });
        for x in candidates {
            if let Some(y) = (0..GRID).rev().find(|&y| cell(&self.alien_map, y, x as i32)) {
                return Some((y, x));
            }
        }
        None
    }
}

impl Game for SpaceInvaders {
    const GAME: MinatarGame = MinatarGame::SpaceInvaders;
    const N_CHANNELS: usize = 6;
    const MINIMAL_ACTIONS: &'static [Action] = &[Action::Noop, Action::Left, Action::Right, Action::Fire];
    const MAX_STEP_REWARD: f32 = 2.0;

    fn new(ramping: bool) -> Self {
        Self {
            ramping,
            pos: 5,
            f_bullet_map: [0; GRID],
            e_bullet_map: [0; GRID],
            alien_map: ALIEN_WAVE,
            alien_dir: -1,
            enemy_move_interval: ENEMY_MOVE_INTERVAL,
            alien_move_timer: ENEMY_MOVE_INTERVAL,
            alien_shot_timer: ENEMY_SHOT_INTERVAL,
            ramp_index: 0,
            shot_timer: 0,
            terminal: true,
        }
    }

    fn reset(&mut self, _rng: &mut RandomState) {
        *self = Self { terminal: false, ..Self::new(self.ramping) };
    }

    fn act(&mut self, action: Action, _rng: &mut RandomState) -> (u32, bool) {
        if self.terminal {
            return (0, true);
        }
        if action == Action::Fire && self.shot_timer == 0 {
            self.f_bullet_map[9] |= 1 << self.pos;
            self.shot_timer = SHOT_COOL_DOWN;
        } else if action == Action::Left {
            self.pos = (self.pos - 1).max(0);
        } else if action == Action::Right {
            self.pos = (self.pos + 1).min(9);
        }

        roll_rows_up(&mut self.f_bullet_map);
        self.f_bullet_map[9] = 0;

        roll_rows_down(&mut self.e_bullet_map);
        self.e_bullet_map[0] = 0;
        if cell(&self.e_bullet_map, 9, self.pos) {
            self.terminal = true;
        }

        if cell(&self.alien_map, 9, self.pos) {
            self.terminal = true;
        }
        if self.alien_move_timer == 0 {
            self.alien_move_timer = (count(&self.alien_map) as i32).min(self.enemy_move_interval);
            if (column_occupied(&self.alien_map, 0) && self.alien_dir < 0)
                || (column_occupied(&self.alien_map, 9) && self.alien_dir > 0)
            {
                self.alien_dir = -self.alien_dir;
                if self.alien_map[9] != 0 {
                    self.terminal = true;
                }
                roll_rows_down(&mut self.alien_map);
            } else {
                roll_columns(&mut self.alien_map, self.alien_dir);
            }
            if cell(&self.alien_map, 9, self.pos) {
                self.terminal = true;
            }
        }
        if self.alien_shot_timer == 0 {
            self.alien_shot_timer = ENEMY_SHOT_INTERVAL;
            // The map is never empty here (a cleared wave is replaced at the end of a step); the
            // reference would raise if it were.
            if let Some((y, x)) = self.nearest_alien() {
                self.e_bullet_map[y] |= 1 << x;
            }
        }

        let mut reward = 0;
        for (aliens, bullets) in self.alien_map.iter_mut().zip(self.f_bullet_map.iter_mut()) {
            let kills = *aliens & *bullets;
            reward += kills.count_ones();
            *aliens &= !kills;
            *bullets &= !kills;
        }

        if self.shot_timer > 0 {
            self.shot_timer -= 1;
        }
        self.alien_move_timer -= 1;
        self.alien_shot_timer -= 1;
        if count(&self.alien_map) == 0 {
            if self.enemy_move_interval > MIN_ENEMY_MOVE_INTERVAL && self.ramping {
                self.enemy_move_interval -= 1;
                self.ramp_index += 1;
            }
            self.alien_map = ALIEN_WAVE;
        }
        (reward, self.terminal)
    }

    fn render(&self, planes: &mut [u8]) {
        set_cell(planes, CHANNEL_CANNON, 9, self.pos);
        let direction_channel = if self.alien_dir < 0 { CHANNEL_ALIEN_LEFT } else { CHANNEL_ALIEN_RIGHT };
        let layers = [
            (CHANNEL_ALIEN, &self.alien_map),
            (direction_channel, &self.alien_map),
            (CHANNEL_FRIENDLY_BULLET, &self.f_bullet_map),
            (CHANNEL_ENEMY_BULLET, &self.e_bullet_map),
        ];
        for (channel, map) in layers {
            for (y, &row) in map.iter().enumerate() {
                for x in 0..GRID {
                    if row >> x & 1 == 1 {
                        set_cell(planes, channel, y as i32, x as i32);
                    }
                }
            }
        }
    }

    fn difficulty_ramp(&self) -> Option<u32> {
        Some(self.ramp_index)
    }

    fn is_terminal(&self) -> bool {
        self.terminal
    }

    fn check(&self) -> Result<(), String> {
        if !(0..=9).contains(&self.pos) || self.alien_dir.abs() != 1 {
            return Err(format!("space_invaders cannon {} or alien direction {} invalid", self.pos, self.alien_dir));
        }
        let maps = [&self.f_bullet_map, &self.e_bullet_map, &self.alien_map];
        if maps.iter().any(|map| map.iter().any(|&row| row > ROW_MASK)) || count(&self.alien_map) == 0 {
            return Err("space_invaders map wider than the grid, or no aliens".to_string());
        }
        if !(MIN_ENEMY_MOVE_INTERVAL..=ENEMY_MOVE_INTERVAL).contains(&self.enemy_move_interval)
            || !(-1..=ENEMY_MOVE_INTERVAL).contains(&self.alien_move_timer)
            || !(-1..=ENEMY_SHOT_INTERVAL).contains(&self.alien_shot_timer)
            || !(0..=SHOT_COOL_DOWN).contains(&self.shot_timer)
        {
            return Err(format!(
                "space_invaders timers out of range: interval {}, move {}, alien shot {}, shot {}",
                self.enemy_move_interval, self.alien_move_timer, self.alien_shot_timer, self.shot_timer
            ));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::super::testing::{random_play, snapshot_property_test};
    use super::*;

    #[test]
    fn rolls_match_numpy_roll() {
        let mut map: Map = [0; GRID];
        map[9] = 0b10_0000_0001;
        roll_rows_down(&mut map);
        assert_eq!((map[0], map[9]), (0b10_0000_0001, 0));
        roll_rows_up(&mut map);
        assert_eq!((map[0], map[9]), (0, 0b10_0000_0001));
        roll_columns(&mut map, 1);
        assert_eq!(map[9], 0b00_0000_0011);
        roll_columns(&mut map, -1);
        roll_columns(&mut map, -1);
        assert_eq!(map[9], 0b11_0000_0000);
    }

    #[test]
    fn nearest_alien_prefers_the_left_column_on_ties_and_the_lowest_row() {
        let mut game = SpaceInvaders::new(true);
        game.pos = 5;
        game.alien_map = [0; GRID];
        game.alien_map[1] = 1 << 3 | 1 << 7;
        game.alien_map[2] = 1 << 7;
        assert_eq!(game.nearest_alien(), Some((1, 3)));
        game.alien_map[0] |= 1 << 6;
        assert_eq!(game.nearest_alien(), Some((0, 6)));
        game.pos = 0;
        assert_eq!(game.nearest_alien(), Some((1, 3)));
        game.alien_map = [0; GRID];
        assert_eq!(game.nearest_alien(), None);
    }

    #[test]
    fn a_shot_under_an_alien_scores() {
        let mut game = SpaceInvaders::new(true);
        let mut rng = RandomState::from_seed(0);
        game.reset(&mut rng);
        game.pos = 3;
        // The wave spans columns 2–7 in rows 0–3; a bullet fired at column 3 rises one row per
        // step and meets the lowest alien (row 3) after 6 steps, unless the block moved.
        game.alien_move_timer = 100;
        let (mut reward, _) = game.act(Action::Fire, &mut rng);
        for _ in 0..6 {
            reward += game.act(Action::Noop, &mut rng).0;
        }
        assert_eq!(reward, 1);
        assert!(!cell(&game.alien_map, 3, 3));
    }

    #[test]
    fn clearing_a_wave_brings_a_faster_one_only_with_ramping() {
        for (ramping, interval, ramp_index) in [(true, ENEMY_MOVE_INTERVAL - 1, 1), (false, ENEMY_MOVE_INTERVAL, 0)] {
            let mut game = SpaceInvaders::new(ramping);
            let mut rng = RandomState::from_seed(0);
            game.reset(&mut rng);
            // One alien left, right above a torpedo that reaches it this step.
            game.alien_map = [0; GRID];
            game.alien_map[4] = 1 << 5;
            game.f_bullet_map[5] = 1 << 5;
            game.alien_move_timer = 3;
            let (reward, terminal) = game.act(Action::Noop, &mut rng);
            assert_eq!((reward, terminal), (1, false));
            assert_eq!(game.alien_map, ALIEN_WAVE, "a new wave");
            assert_eq!((game.enemy_move_interval, game.ramp_index), (interval, ramp_index), "ramping {ramping}");
        }
    }

    #[test]
    fn random_play_shoots_aliens() {
        let (episodes, total, _) = random_play::<SpaceInvaders>(3, 5000);
        assert!(episodes > 5, "{episodes} episodes");
        assert!(total > 0.0);
    }

    snapshot_property_test!(SpaceInvaders);
}
