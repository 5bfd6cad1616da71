//! MinAtar Asterix, as `minatar/environments/asterix.py` (1.0.15).
//!
//! The player moves in four directions (rows 1–8). Enemies and gold spawn at the left or right
//! edge of rows 1–8 (one slot per row) and move across; touching gold gives +1 and removes it,
//! touching an enemy ends the episode. With difficulty ramping, every 100 steps (after an
//! initial 101) the spawn interval shrinks by one, and every second time the move interval too.
//!
//! Channels: 0 player, 1 enemy, 2 trail (the cell an entity came from), 3 gold.
//! Draws per spawn: `rand()` for the side, `rand()` for gold, then, if a slot is free,
//! `randint(n_free)` for the slot (no draw when one slot is free, as numpy's legacy `randint`).
//! The player is checked against the entities before and after they move; each check can find
//! at most one entity (one per row), so the step reward is at most 2.

use serde::{Deserialize, Serialize};

use super::rng::RandomState;
use super::{set_cell, Action, Game, MinatarGame};

const RAMP_INTERVAL: i32 = 100;
const INIT_SPAWN_SPEED: i32 = 10;
const INIT_MOVE_INTERVAL: i32 = 5;
const N_SLOTS: usize = 8;

const CHANNEL_PLAYER: usize = 0;
const CHANNEL_ENEMY: usize = 1;
const CHANNEL_TRAIL: usize = 2;
const CHANNEL_GOLD: usize = 3;

/// An enemy or a piece of gold.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
struct Entity {
    x: i32,
    y: i32,
    /// Moving right (spawned at the left edge).
    lr: bool,
    gold: bool,
}

/// Asterix's state (see the [module documentation](self)).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Asterix {
    ramping: bool,
    player_x: i32,
    player_y: i32,
    entities: [Option<Entity>; N_SLOTS],
    spawn_speed: i32,
    spawn_timer: i32,
    move_speed: i32,
    move_timer: i32,
    ramp_timer: i32,
    ramp_index: u32,
    terminal: bool,
}

impl Asterix {
    fn spawn_entity(&mut self, rng: &mut RandomState) {
        let lr = rng.rand() < 1.0 / 2.0;
        let gold = rng.rand() < 1.0 / 3.0;
        let x = if lr { 0 } else { 9 };
        let mut free = [0usize; N_SLOTS];
        let mut n_free = 0;
        for (slot, entity) in self.entities.iter().enumerate() {
            if entity.is_none() {
                free[n_free] = slot;
                n_free += 1;
            }
        }
        if n_free == 0 {
            return;
        }
        let slot = free[rng.randint(0, n_free as i64) as usize];
        self.entities[slot] = Some(Entity { x, y: slot as i32 + 1, lr, gold });
    }
}

impl Game for Asterix {
    const GAME: MinatarGame = MinatarGame::Asterix;
    const N_CHANNELS: usize = 4;
    const MINIMAL_ACTIONS: &'static [Action] = &[Action::Noop, Action::Left, Action::Up, Action::Right, Action::Down];
    const MAX_STEP_REWARD: f32 = 2.0;

    fn new(ramping: bool) -> Self {
        Self {
            ramping,
            player_x: 5,
            player_y: 5,
            entities: [None; N_SLOTS],
            spawn_speed: INIT_SPAWN_SPEED,
            spawn_timer: INIT_SPAWN_SPEED,
            move_speed: INIT_MOVE_INTERVAL,
            move_timer: INIT_MOVE_INTERVAL,
            ramp_timer: RAMP_INTERVAL,
            ramp_index: 0,
            terminal: true,
        }
    }

    fn reset(&mut self, _rng: &mut RandomState) {
        *self = Self { terminal: false, ..Self::new(self.ramping) };
    }

    fn act(&mut self, action: Action, rng: &mut RandomState) -> (u32, bool) {
        let mut reward = 0;
        if self.terminal {
            return (reward, true);
        }
        if self.spawn_timer == 0 {
            self.spawn_entity(rng);
            self.spawn_timer = self.spawn_speed;
        }
        match action {
            Action::Left => self.player_x = (self.player_x - 1).max(0),
            Action::Right => self.player_x = (self.player_x + 1).min(9),
            Action::Up => self.player_y = (self.player_y - 1).max(1),
            Action::Down => self.player_y = (self.player_y + 1).min(8),
            _ => {}
        }

        let player = (self.player_x, self.player_y);
        for slot in &mut self.entities {
            if let Some(entity) = slot {
                if (entity.x, entity.y) == player {
                    if entity.gold {
                        *slot = None;
                        reward += 1;
                    } else {
                        self.terminal = true;
                    }
                }
            }
        }
        if self.move_timer == 0 {
            self.move_timer = self.move_speed;
            for slot in &mut self.entities {
                if let Some(entity) = slot {
                    entity.x += if entity.lr { 1 } else { -1 };
                    if entity.x < 0 || entity.x > 9 {
                        *slot = None;
                    } else if (entity.x, entity.y) == player {
                        if entity.gold {
                            *slot = None;
                            reward += 1;
                        } else {
                            self.terminal = true;
                        }
                    }
                }
            }
        }

        self.spawn_timer -= 1;
        self.move_timer -= 1;

        if self.ramping && (self.spawn_speed > 1 || self.move_speed > 1) {
            if self.ramp_timer >= 0 {
                self.ramp_timer -= 1;
            } else {
                if self.move_speed > 1 && self.ramp_index % 2 == 1 {
                    self.move_speed -= 1;
                }
                if self.spawn_speed > 1 {
                    self.spawn_speed -= 1;
                }
                self.ramp_index += 1;
                self.ramp_timer = RAMP_INTERVAL;
            }
        }
        (reward, self.terminal)
    }

    fn render(&self, planes: &mut [u8]) {
        set_cell(planes, CHANNEL_PLAYER, self.player_y, self.player_x);
        for entity in self.entities.iter().flatten() {
            let channel = if entity.gold { CHANNEL_GOLD } else { CHANNEL_ENEMY };
            set_cell(planes, channel, entity.y, entity.x);
            let back_x = if entity.lr { entity.x - 1 } else { entity.x + 1 };
            if (0..=9).contains(&back_x) {
                set_cell(planes, CHANNEL_TRAIL, entity.y, back_x);
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
        if !(0..=9).contains(&self.player_x) || !(1..=8).contains(&self.player_y) {
            return Err(format!("asterix player ({}, {}) off the field", self.player_x, self.player_y));
        }
        for (slot, entity) in self.entities.iter().enumerate() {
            if let Some(entity) = entity {
                if !(0..=9).contains(&entity.x) || entity.y != slot as i32 + 1 {
                    return Err(format!("asterix entity {entity:?} does not fit slot {slot}"));
                }
            }
        }
        let timers = [self.spawn_speed, self.spawn_timer, self.move_speed, self.move_timer];
        if !(1..=INIT_SPAWN_SPEED).contains(&self.spawn_speed)
            || !(1..=INIT_MOVE_INTERVAL).contains(&self.move_speed)
            || !(-1..=INIT_SPAWN_SPEED).contains(&self.spawn_timer)
            || !(-1..=INIT_MOVE_INTERVAL).contains(&self.move_timer)
            || !(-1..=RAMP_INTERVAL).contains(&self.ramp_timer)
        {
            return Err(format!("asterix timers {timers:?} (ramp {}) out of range", self.ramp_timer));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::super::testing::{random_play, snapshot_property_test};
    use super::*;

    #[test]
    fn spawn_uses_the_only_free_slot_without_a_draw() {
        let mut game = Asterix::new(true);
        game.reset(&mut RandomState::from_seed(0));
        for slot in 0..N_SLOTS - 1 {
            game.entities[slot] = Some(Entity { x: 4, y: slot as i32 + 1, lr: true, gold: false });
        }
        let mut rng = RandomState::from_seed(7);
        let mut reference = rng.clone();
        game.spawn_entity(&mut rng);
        assert_eq!(game.entities[7].map(|e| e.y), Some(8));
        reference.rand();
        reference.rand();
        assert_eq!(rng, reference, "two rand() draws and no randint draw");
        // With every slot taken the side and gold draws still happen.
        let mut full = rng.clone();
        game.spawn_entity(&mut full);
        rng.rand();
        rng.rand();
        assert_eq!(full, rng);
    }

    #[test]
    fn ramping_speeds_up_spawns_after_the_first_interval() {
        let mut game = Asterix::new(true);
        let mut rng = RandomState::from_seed(1);
        game.reset(&mut rng);
        // Keep the player out of harm's way is not needed for the timers: clear entities each step.
        for _ in 0..=RAMP_INTERVAL + 1 {
            game.act(Action::Noop, &mut rng);
            game.entities = [None; N_SLOTS];
            game.terminal = false;
        }
        assert_eq!(game.ramp_index, 1);
        assert_eq!(game.spawn_speed, INIT_SPAWN_SPEED - 1);
        assert_eq!(game.move_speed, INIT_MOVE_INTERVAL);
        let mut flat = Asterix::new(false);
        flat.reset(&mut rng);
        for _ in 0..300 {
            flat.act(Action::Noop, &mut rng);
            flat.entities = [None; N_SLOTS];
            flat.terminal = false;
        }
        assert_eq!((flat.ramp_index, flat.spawn_speed), (0, INIT_SPAWN_SPEED));
    }

    #[test]
    fn random_play_collects_gold_and_dies() {
        let (episodes, total, _) = random_play::<Asterix>(5, 5000);
        assert!(episodes > 10, "{episodes} episodes");
        assert!(total > 0.0);
    }

    snapshot_property_test!(Asterix);
}
