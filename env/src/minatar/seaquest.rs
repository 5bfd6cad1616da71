//! MinAtar Seaquest, as `minatar/environments/seaquest.py` (1.0.15).
//!
//! The player's submarine (a front and a back cell, showing its heading) moves in four
//! directions between the surface (row 0) and row 8 and fires torpedoes forward (one every 5
//! steps). Enemy fish and submarines (which shoot) and divers cross rows 1–8. +1 per enemy hit.
//! Divers are picked up by touching them (at most 6 on board). Oxygen (200) runs down below the
//! surface; surfacing with divers refills it and costs one diver, and with all 6 on board gives
//! `oxygen * 10 // 200` (at most 10) and empties the boat. Each surfacing with difficulty
//! ramping spawns enemies more often and, every second time, makes them faster. The episode
//! ends when an enemy or enemy bullet touches the submarine, oxygen runs out, or the submarine
//! surfaces with no divers.
//!
//! Channels: 0 sub front, 1 sub back, 2 friendly bullet, 3 trail, 4 enemy bullet, 5 enemy fish,
//! 6 enemy sub, 7 oxygen gauge, 8 diver gauge, 9 diver.
//! Draws: an enemy spawn draws `rand()` (side), `rand()` (sub or fish), `randint(1, 9)` (row);
//! a diver spawn `rand()` (side), `randint(1, 9)` (row); enemies first when both are due.
//! Each enemy hit removes a torpedo, of which at most 3 are in flight (each lives at most 10
//! steps), so with the surfacing bonus the step reward is at most 13.
//!
//! The reference keeps entities in Python lists, iterates them with `reversed()` while removing
//! from them, and removes with `list.remove(x)` (the first element *equal* to `x`, not `x`
//! itself). When two entities have equal values this removes a different one than intended and
//! the reverse iterator then visits an entity twice; the loops below reproduce that exactly by
//! iterating by index as CPython's reverse list iterator does and removing the first equal
//! element. Other quirks kept: surfacing with 6 divers leaves the count at -1 (and surfacing
//! with a negative count refills oxygen without ending the episode); a sub that leaves the
//! screen or is hit can still fire its shot on the same step; oxygen can reach -1.

use serde::{Deserialize, Serialize};

use super::rng::RandomState;
use super::{set_cell, Action, Game, MinatarGame};

const RAMP_MAX_OXYGEN: i32 = 200;
const INIT_SPAWN_SPEED: i32 = 20;
const DIVER_SPAWN_SPEED: i32 = 30;
const INIT_MOVE_INTERVAL: i32 = 5;
const SHOT_COOL_DOWN: i32 = 5;
const ENEMY_SHOT_INTERVAL: i32 = 10;
const DIVER_MOVE_INTERVAL: i32 = 5;
const MAX_DIVERS: i32 = 6;
/// More entities of one kind than the dynamics can produce; snapshots with more are refused.
const MAX_ENTITIES: usize = 64;

const CHANNEL_SUB_FRONT: usize = 0;
const CHANNEL_SUB_BACK: usize = 1;
const CHANNEL_FRIENDLY_BULLET: usize = 2;
const CHANNEL_TRAIL: usize = 3;
const CHANNEL_ENEMY_BULLET: usize = 4;
const CHANNEL_ENEMY_FISH: usize = 5;
const CHANNEL_ENEMY_SUB: usize = 6;
const CHANNEL_OXYGEN_GAUGE: usize = 7;
const CHANNEL_DIVER_GAUGE: usize = 8;
const CHANNEL_DIVER: usize = 9;

/// A torpedo or an enemy bullet: `[x, y, heading]` in the reference.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
struct Bullet {
    x: i32,
    y: i32,
    /// Moving right.
    right: bool,
}

/// A fish or a diver: `[x, y, lr, move_timer]` in the reference.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
struct Swimmer {
    x: i32,
    y: i32,
    /// Moving right (spawned at the left edge).
    lr: bool,
    move_timer: i32,
}

/// An enemy sub: `[x, y, lr, move_timer, shot_timer]` in the reference.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
struct EnemySub {
    x: i32,
    y: i32,
    lr: bool,
    move_timer: i32,
    shot_timer: i32,
}

fn step_x(lr: bool) -> i32 {
    if lr {
        1
    } else {
        -1
    }
}

/// `list.remove(value)`: remove the first element equal to `value`, returning its index.
fn remove_first_equal<T: PartialEq>(list: &mut Vec<T>, value: &T) -> Option<usize> {
    let idx = list.iter().position(|item| item == value)?;
    list.remove(idx);
    Some(idx)
}

/// Where the element a loop is working on sits after `list.remove` took index `removed`: gone
/// if it was the one, one lower if an earlier equal one went instead.
fn after_removal(current: Option<usize>, removed: Option<usize>) -> Option<usize> {
    match (current, removed) {
        (Some(current), Some(removed)) if removed == current => None,
        (Some(current), Some(removed)) if removed < current => Some(current - 1),
        (current, _) => current,
    }
}

/// CPython's reverse list iterator: the next index, or `None` once it falls off either end
/// (it checks against the list's length at every step, so removals shorten the walk).
fn next_reverse(index: &mut isize, len: usize) -> Option<usize> {
    if *index >= 0 && (*index as usize) < len {
        let current = *index as usize;
        *index -= 1;
        Some(current)
    } else {
        *index = -1;
        None
    }
}

/// Seaquest's state (see the [module documentation](self)).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Seaquest {
    ramping: bool,
    oxygen: i32,
    diver_count: i32,
    sub_x: i32,
    sub_y: i32,
    /// Heading right.
    sub_or: bool,
    f_bullets: Vec<Bullet>,
    e_bullets: Vec<Bullet>,
    e_fish: Vec<Swimmer>,
    e_subs: Vec<EnemySub>,
    divers: Vec<Swimmer>,
    e_spawn_speed: i32,
    e_spawn_timer: i32,
    d_spawn_timer: i32,
    move_speed: i32,
    ramp_index: u32,
    shot_timer: i32,
    surface: bool,
    terminal: bool,
}

impl Seaquest {
    fn spawn_enemy(&mut self, rng: &mut RandomState) {
        let lr = rng.rand() < 1.0 / 2.0;
        let is_sub = rng.rand() < 1.0 / 3.0;
        let x = if lr { 0 } else { 9 };
        let y = rng.randint(1, 9) as i32;
        // No spawn into a row where an enemy heads the other way.
        let blocked = self.e_subs.iter().any(|sub| sub.y == y && sub.lr != lr)
            || self.e_fish.iter().any(|fish| fish.y == y && fish.lr != lr);
        if blocked {
            return;
        }
        if is_sub {
            self.e_subs.push(EnemySub { x, y, lr, move_timer: self.move_speed, shot_timer: ENEMY_SHOT_INTERVAL });
        } else {
            self.e_fish.push(Swimmer { x, y, lr, move_timer: self.move_speed });
        }
    }

    fn spawn_diver(&mut self, rng: &mut RandomState) {
        let lr = rng.rand() < 1.0 / 2.0;
        let x = if lr { 0 } else { 9 };
        let y = rng.randint(1, 9) as i32;
        self.divers.push(Swimmer { x, y, lr, move_timer: DIVER_MOVE_INTERVAL });
    }

    /// The reference's `_surface()`.
    fn surface(&mut self) -> u32 {
        self.surface = true;
        let reward = if self.diver_count == MAX_DIVERS {
            self.diver_count = 0;
            // Python's floor division; the oxygen is never negative when surfacing.
            (self.oxygen * 10).div_euclid(RAMP_MAX_OXYGEN).max(0) as u32
        } else {
            0
        };
        self.oxygen = RAMP_MAX_OXYGEN;
        self.diver_count -= 1;
        if self.ramping && (self.e_spawn_speed > 1 || self.move_speed > 2) {
            if self.move_speed > 2 && self.ramp_index % 2 == 1 {
                self.move_speed -= 1;
            }
            if self.e_spawn_speed > 1 {
                self.e_spawn_speed -= 1;
            }
            self.ramp_index += 1;
        }
        reward
    }

    fn at_sub(&self, x: i32, y: i32) -> bool {
        (x, y) == (self.sub_x, self.sub_y)
    }

    fn update_friendly_bullets(&mut self) -> u32 {
        let mut reward = 0;
        let mut index = self.f_bullets.len() as isize - 1;
        while let Some(idx) = next_reverse(&mut index, self.f_bullets.len()) {
            self.f_bullets[idx].x += step_x(self.f_bullets[idx].right);
            let bullet = self.f_bullets[idx];
            if bullet.x < 0 || bullet.x > 9 {
                remove_first_equal(&mut self.f_bullets, &bullet);
                continue;
            }
            if let Some(hit) = self.e_fish.iter().position(|fish| (fish.x, fish.y) == (bullet.x, bullet.y)) {
                self.e_fish.remove(hit);
                remove_first_equal(&mut self.f_bullets, &bullet);
                reward += 1;
            } else if let Some(hit) = self.e_subs.iter().position(|sub| (sub.x, sub.y) == (bullet.x, bullet.y)) {
                self.e_subs.remove(hit);
                remove_first_equal(&mut self.f_bullets, &bullet);
                reward += 1;
            }
        }
        reward
    }

    fn update_divers(&mut self) {
        let mut index = self.divers.len() as isize - 1;
        while let Some(idx) = next_reverse(&mut index, self.divers.len()) {
            let diver = self.divers[idx];
            if self.at_sub(diver.x, diver.y) && self.diver_count < MAX_DIVERS {
                remove_first_equal(&mut self.divers, &diver);
                self.diver_count += 1;
            } else if diver.move_timer == 0 {
                let moved = Swimmer { move_timer: DIVER_MOVE_INTERVAL, x: diver.x + step_x(diver.lr), ..diver };
                self.divers[idx] = moved;
                if moved.x < 0 || moved.x > 9 {
                    remove_first_equal(&mut self.divers, &moved);
                } else if self.at_sub(moved.x, moved.y) && self.diver_count < MAX_DIVERS {
                    remove_first_equal(&mut self.divers, &moved);
                    self.diver_count += 1;
                }
            } else {
                self.divers[idx].move_timer -= 1;
            }
        }
    }

    fn update_enemy_subs(&mut self) -> u32 {
        let mut reward = 0;
        let mut index = self.e_subs.len() as isize - 1;
        while let Some(idx) = next_reverse(&mut index, self.e_subs.len()) {
            // The reference mutates `sub` after it may have left the list: `sub` is the loop's
            // copy and `current` where the list still holds it.
            let mut current = Some(idx);
            let mut sub = self.e_subs[idx];
            if self.at_sub(sub.x, sub.y) {
                self.terminal = true;
            }
            if sub.move_timer == 0 {
                sub.move_timer = self.move_speed;
                sub.x += step_x(sub.lr);
                self.e_subs[idx] = sub;
                if sub.x < 0 || sub.x > 9 {
                    let removed = remove_first_equal(&mut self.e_subs, &sub);
                    current = after_removal(current, removed);
                } else if self.at_sub(sub.x, sub.y) {
                    self.terminal = true;
                } else if let Some(hit) =
                    self.f_bullets.iter().position(|bullet| (bullet.x, bullet.y) == (sub.x, sub.y))
                {
                    let removed = remove_first_equal(&mut self.e_subs, &sub);
                    current = after_removal(current, removed);
                    self.f_bullets.remove(hit);
                    reward += 1;
                }
            } else {
                sub.move_timer -= 1;
                self.e_subs[idx].move_timer = sub.move_timer;
            }
            if sub.shot_timer == 0 {
                sub.shot_timer = ENEMY_SHOT_INTERVAL;
                self.e_bullets.push(Bullet { x: sub.x, y: sub.y, right: sub.lr });
            } else {
                sub.shot_timer -= 1;
            }
            if let Some(current) = current {
                self.e_subs[current].shot_timer = sub.shot_timer;
            }
        }
        reward
    }

    fn update_enemy_bullets(&mut self) {
        let mut index = self.e_bullets.len() as isize - 1;
        while let Some(idx) = next_reverse(&mut index, self.e_bullets.len()) {
            if self.at_sub(self.e_bullets[idx].x, self.e_bullets[idx].y) {
                self.terminal = true;
            }
            self.e_bullets[idx].x += step_x(self.e_bullets[idx].right);
            let bullet = self.e_bullets[idx];
            if bullet.x < 0 || bullet.x > 9 {
                remove_first_equal(&mut self.e_bullets, &bullet);
            } else if self.at_sub(bullet.x, bullet.y) {
                self.terminal = true;
            }
        }
    }

    fn update_enemy_fish(&mut self) -> u32 {
        let mut reward = 0;
        let mut index = self.e_fish.len() as isize - 1;
        while let Some(idx) = next_reverse(&mut index, self.e_fish.len()) {
            let fish = self.e_fish[idx];
            if self.at_sub(fish.x, fish.y) {
                self.terminal = true;
            }
            if fish.move_timer == 0 {
                let moved = Swimmer { move_timer: self.move_speed, x: fish.x + step_x(fish.lr), ..fish };
                self.e_fish[idx] = moved;
                if moved.x < 0 || moved.x > 9 {
                    remove_first_equal(&mut self.e_fish, &moved);
                } else if self.at_sub(moved.x, moved.y) {
                    self.terminal = true;
                } else if let Some(hit) =
                    self.f_bullets.iter().position(|bullet| (bullet.x, bullet.y) == (moved.x, moved.y))
                {
                    remove_first_equal(&mut self.e_fish, &moved);
                    self.f_bullets.remove(hit);
                    reward += 1;
                }
            } else {
                self.e_fish[idx].move_timer -= 1;
            }
        }
        reward
    }
}

impl Game for Seaquest {
    const GAME: MinatarGame = MinatarGame::Seaquest;
    const N_CHANNELS: usize = 10;
    const MINIMAL_ACTIONS: &'static [Action] = &Action::ALL;
    const MAX_STEP_REWARD: f32 = 13.0;

    fn new(ramping: bool) -> Self {
        Self {
            ramping,
            oxygen: RAMP_MAX_OXYGEN,
            diver_count: 0,
            sub_x: 5,
            sub_y: 0,
            sub_or: false,
            f_bullets: Vec::new(),
            e_bullets: Vec::new(),
            e_fish: Vec::new(),
            e_subs: Vec::new(),
            divers: Vec::new(),
            e_spawn_speed: INIT_SPAWN_SPEED,
            e_spawn_timer: INIT_SPAWN_SPEED,
            d_spawn_timer: DIVER_SPAWN_SPEED,
            move_speed: INIT_MOVE_INTERVAL,
            ramp_index: 0,
            shot_timer: 0,
            surface: true,
            terminal: true,
        }
    }

    fn reset(&mut self, _rng: &mut RandomState) {
        // Reuse the lists' allocations across episodes.
        let mut lists = (
            std::mem::take(&mut self.f_bullets),
            std::mem::take(&mut self.e_bullets),
            std::mem::take(&mut self.e_fish),
            std::mem::take(&mut self.e_subs),
            std::mem::take(&mut self.divers),
        );
        lists.0.clear();
        lists.1.clear();
        lists.2.clear();
        lists.3.clear();
        lists.4.clear();
        *self = Self {
            f_bullets: lists.0,
            e_bullets: lists.1,
            e_fish: lists.2,
            e_subs: lists.3,
            divers: lists.4,
            terminal: false,
            ..Self::new(self.ramping)
        };
    }

    fn act(&mut self, action: Action, rng: &mut RandomState) -> (u32, bool) {
        if self.terminal {
            return (0, true);
        }
        if self.e_spawn_timer == 0 {
            self.spawn_enemy(rng);
            self.e_spawn_timer = self.e_spawn_speed;
        }
        if self.d_spawn_timer == 0 {
            self.spawn_diver(rng);
            self.d_spawn_timer = DIVER_SPAWN_SPEED;
        }

        match action {
            Action::Fire if self.shot_timer == 0 => {
                self.f_bullets.push(Bullet { x: self.sub_x, y: self.sub_y, right: self.sub_or });
                self.shot_timer = SHOT_COOL_DOWN;
            }
            Action::Left => {
                self.sub_x = (self.sub_x - 1).max(0);
                self.sub_or = false;
            }
            Action::Right => {
                self.sub_x = (self.sub_x + 1).min(9);
                self.sub_or = true;
            }
            Action::Up => self.sub_y = (self.sub_y - 1).max(0),
            Action::Down => self.sub_y = (self.sub_y + 1).min(8),
            _ => {}
        }

        let mut reward = self.update_friendly_bullets();
        self.update_divers();
        reward += self.update_enemy_subs();
        self.update_enemy_bullets();
        reward += self.update_enemy_fish();

        if self.e_spawn_timer > 0 {
            self.e_spawn_timer -= 1;
        }
        if self.d_spawn_timer > 0 {
            self.d_spawn_timer -= 1;
        }
        if self.shot_timer > 0 {
            self.shot_timer -= 1;
        }
        if self.oxygen <= 0 {
            self.terminal = true;
        }
        if self.sub_y > 0 {
            self.oxygen -= 1;
            self.surface = false;
        } else if !self.surface {
            if self.diver_count == 0 {
                self.terminal = true;
            } else {
                reward += self.surface();
            }
        }
        (reward, self.terminal)
    }

    fn render(&self, planes: &mut [u8]) {
        set_cell(planes, CHANNEL_SUB_FRONT, self.sub_y, self.sub_x);
        let back_x = if self.sub_or { self.sub_x - 1 } else { self.sub_x + 1 };
        set_cell(planes, CHANNEL_SUB_BACK, self.sub_y, back_x);
        // `state[9, 0:max(0, oxygen) * 10 // 200]` and `state[9, 9 - diver_count:9]`.
        for x in 0..(self.oxygen.max(0) * 10 / RAMP_MAX_OXYGEN).min(10) {
            set_cell(planes, CHANNEL_OXYGEN_GAUGE, 9, x);
        }
        for x in (9 - self.diver_count).max(0)..9 {
            set_cell(planes, CHANNEL_DIVER_GAUGE, 9, x);
        }
        for bullet in &self.f_bullets {
            set_cell(planes, CHANNEL_FRIENDLY_BULLET, bullet.y, bullet.x);
        }
        for bullet in &self.e_bullets {
            set_cell(planes, CHANNEL_ENEMY_BULLET, bullet.y, bullet.x);
        }
        let trail = |planes: &mut [u8], x: i32, y: i32, lr: bool| {
            let back_x = if lr { x - 1 } else { x + 1 };
            if (0..=9).contains(&back_x) {
                set_cell(planes, CHANNEL_TRAIL, y, back_x);
            }
        };
        for fish in &self.e_fish {
            set_cell(planes, CHANNEL_ENEMY_FISH, fish.y, fish.x);
            trail(planes, fish.x, fish.y, fish.lr);
        }
        for sub in &self.e_subs {
            set_cell(planes, CHANNEL_ENEMY_SUB, sub.y, sub.x);
            trail(planes, sub.x, sub.y, sub.lr);
        }
        for diver in &self.divers {
            set_cell(planes, CHANNEL_DIVER, diver.y, diver.x);
            trail(planes, diver.x, diver.y, diver.lr);
        }
    }

    fn difficulty_ramp(&self) -> Option<u32> {
        Some(self.ramp_index)
    }

    fn is_terminal(&self) -> bool {
        self.terminal
    }

    fn check(&self) -> Result<(), String> {
        if !(0..=9).contains(&self.sub_x) || !(0..=8).contains(&self.sub_y) {
            return Err(format!("seaquest submarine ({}, {}) off the field", self.sub_x, self.sub_y));
        }
        if (self.sub_or && self.sub_x == 0) || (!self.sub_or && self.sub_x == 9) {
            return Err(format!("seaquest submarine at column {} faces the wall", self.sub_x));
        }
        let lens =
            [self.f_bullets.len(), self.e_bullets.len(), self.e_fish.len(), self.e_subs.len(), self.divers.len()];
        if lens.iter().any(|&len| len > MAX_ENTITIES) {
            return Err(format!("seaquest entity lists {lens:?} longer than {MAX_ENTITIES}"));
        }
        if !(-1..=RAMP_MAX_OXYGEN).contains(&self.oxygen) || self.diver_count > MAX_DIVERS {
            return Err(format!("seaquest oxygen {} or divers {} out of range", self.oxygen, self.diver_count));
        }
        if !(1..=INIT_SPAWN_SPEED).contains(&self.e_spawn_speed) || !(1..=INIT_MOVE_INTERVAL).contains(&self.move_speed)
        {
            return Err(format!(
                "seaquest spawn speed {} or move speed {} out of range",
                self.e_spawn_speed, self.move_speed
            ));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::super::testing::{random_play, snapshot_property_test};
    use super::*;

    fn live_game() -> Seaquest {
        let mut game = Seaquest::new(true);
        game.reset(&mut RandomState::from_seed(0));
        game
    }

    #[test]
    fn reverse_iteration_follows_cpython_when_an_equal_earlier_element_is_removed() {
        // Two torpedoes heading right in row 3, at columns 4 and 3, and a fish at column 5: the
        // later torpedo (index 1) moves to 4, then the earlier one (index 0) moves to 5 and hits
        // the fish. Then `f_bullets.remove([5, 3, True])` takes index 0 itself. No duplicate.
        let mut game = live_game();
        game.f_bullets = vec![Bullet { x: 4, y: 3, right: true }, Bullet { x: 3, y: 3, right: true }];
        game.e_fish = vec![Swimmer { x: 5, y: 3, lr: false, move_timer: 3 }];
        assert_eq!(game.update_friendly_bullets(), 1);
        assert_eq!(game.f_bullets, [Bullet { x: 4, y: 3, right: true }]);

        // Now torpedoes at columns 5 and 4 (index 0 and 1), fish at 5: index 1 moves to 5 and
        // hits, and `remove([5, 3, True])` takes index 0 (the *other*, equal torpedo) — so the
        // iterator's next index (0) is the same torpedo again, which moves to 6.
        let mut game = live_game();
        game.f_bullets = vec![Bullet { x: 5, y: 3, right: true }, Bullet { x: 4, y: 3, right: true }];
        game.e_fish = vec![Swimmer { x: 5, y: 3, lr: false, move_timer: 3 }];
        assert_eq!(game.update_friendly_bullets(), 1);
        assert_eq!(game.f_bullets, [Bullet { x: 6, y: 3, right: true }]);
    }

    #[test]
    fn surfacing_with_six_divers_pays_oxygen_and_leaves_minus_one() {
        let mut game = live_game();
        let mut rng = RandomState::from_seed(0);
        game.sub_y = 1;
        game.surface = false;
        game.diver_count = MAX_DIVERS;
        game.oxygen = 150;
        let (reward, terminal) = game.act(Action::Up, &mut rng);
        assert_eq!((reward, terminal), (7, false));
        assert_eq!(game.diver_count, -1);
        assert_eq!(game.oxygen, RAMP_MAX_OXYGEN);
        assert_eq!(game.ramp_index, 1);
        // A later surfacing with the negative count refills without ending the episode.
        game.act(Action::Down, &mut rng);
        let (_, terminal) = game.act(Action::Up, &mut rng);
        assert!(!terminal);
        assert_eq!(game.diver_count, -2);
    }

    #[test]
    fn surfacing_without_divers_ends_the_episode() {
        let mut game = live_game();
        let mut rng = RandomState::from_seed(0);
        game.act(Action::Down, &mut rng);
        let (_, terminal) = game.act(Action::Up, &mut rng);
        assert!(terminal);
    }

    #[test]
    fn random_play_scores_and_ends_episodes() {
        let (episodes, total, _) = random_play::<Seaquest>(8, 5000);
        assert!(episodes > 20, "{episodes} episodes");
        assert!(total > 0.0);
    }

    snapshot_property_test!(Seaquest);
}
