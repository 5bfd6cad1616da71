//! Work items, episode snapshots and the run-spec settings of save-load and budget assignment.
//!
//! The learner's scheduler decides where rollout compute goes by issuing [`WorkItem`]s: "run
//! task X from a fresh start" or "resume from saved state S", each with a step budget. Actors
//! take items from a work queue (acknowledged when done, redelivered when an actor dies), save
//! the whole episode state ([`EpisodeSnapshot`]) at milestones or every N steps, and resume an
//! interrupted item from its newest snapshot. Finished episodes report their item, task and
//! start back to the scheduler inside the trajectory segments
//! ([`crate::wire::EpisodeSummary`]), and every saved snapshot is announced the same way
//! ([`SnapshotInfo`]), so the scheduler needs no channel of its own.

use rand_pcg::Pcg64Mcg;
use serde::{Deserialize, Serialize};

use crate::wire::DecodeError;
use volley_env::EnvConfig;

/// How the scheduler splits the rollout budget between tasks.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum BudgetPolicy {
    /// Every task equally often.
    #[default]
    Uniform,
    /// In proportion to `p (1 − p)` of each task's recent success rate `p` (plus a floor), the
    /// variance of a Bernoulli outcome: most budget where the policy succeeds about half the
    /// time, little where it always or never succeeds (Tzannetos et al. 2023; "learnability" in
    /// Rutherford et al. 2024, "No Regrets").
    Learnability,
    /// UCB1 (Auer et al. 2002) on each task's learnability, so rarely tried tasks get tried.
    Ucb,
}

/// Save-load and budget-assignment settings of a run (`RunSpec::work`).
///
/// Off by default: actors then run fresh episodes of the run's environment back to back, as
/// before. With `enabled`, the learner schedules every episode.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct WorkConfig {
    /// Schedule episodes through work items (and save snapshots).
    pub enabled: bool,
    /// The tasks episodes are drawn from; empty means the run's `env` alone. Every task must
    /// have the same observation and action spaces as `env`.
    pub tasks: Vec<EnvConfig>,
    /// Budget policy between tasks.
    pub policy: BudgetPolicy,
    /// Fraction of work items that restart from a saved state instead of a fresh start
    /// (Go-Explore-style exploration, Ecoffet et al. 2021), when saved states exist.
    pub restart_share: f32,
    /// Episodes per work item (all from the item's start).
    pub episodes_per_item: u32,
    /// Save a snapshot every this many steps of an episode (0: only at env milestones).
    pub snapshot_every_steps: u32,
    /// Save at the environment's milestones ([`volley_env::Env::at_milestone`]).
    pub snapshot_at_milestones: bool,
    /// Work items kept queued per actor environment slot.
    pub queue_per_slot: u32,
    /// Seconds a taken item may go without progress before the learner's dispatcher takes
    /// it back and hands it to another actor (and the bound on the broker's redelivery when
    /// the learner itself is gone).
    pub ack_wait_secs: f64,
    /// Work items one actor identity may hold at once (issue 46): taken and not yet confirmed
    /// by the learner. An actor holds one item per environment slot while it runs, plus items
    /// it has finished whose episodes the learner has not yet seen; give it at least twice
    /// its environments. Takes beyond the bound are refused.
    pub max_items_per_actor: u32,
    /// Seconds the dispatcher waits, after an actor reports an item done, for the item's
    /// episode summaries to reach the learner before it hands the item out again: an item
    /// acknowledged but never run is not lost (issue 46).
    pub confirm_wait_secs: f64,
    /// Seconds a snapshot is kept (the snapshot store's retention bound).
    pub snapshot_ttl_secs: f64,
    /// Success-rate window (episodes) per task and per start in the scheduler.
    pub stats_window: u32,
    /// UCB exploration constant.
    pub ucb_c: f32,
    /// Group rollouts: continuations per group (`K`; 1 = no groups). A group is `K` work items
    /// of one episode each that share a start (one fresh reset seed, or one saved state) and
    /// differ only in their action-sampling streams ([`group_stream_seed`]).
    pub group_size: u32,
    /// Share of the scheduler's draws that become a group of `group_size` items instead of a
    /// single item (used only when `group_size > 1`).
    pub group_share: f32,
    /// The learner holds the segments of incomplete groups back (group baselines, or the
    /// zero-variance filter on groups) until their `group_size` episodes have ended: at most
    /// this many segments; beyond it the oldest go to the critic.
    pub group_hold_segments: u32,
    /// The same bound in bytes of held segments (observations, actions and per-step floats).
    pub group_hold_bytes: u64,
}

impl Default for WorkConfig {
    fn default() -> Self {
        WorkConfig {
            enabled: false,
            tasks: Vec::new(),
            policy: BudgetPolicy::Uniform,
            restart_share: 0.0,
            episodes_per_item: 1,
            snapshot_every_steps: 0,
            snapshot_at_milestones: true,
            queue_per_slot: 2,
            ack_wait_secs: 30.0,
            max_items_per_actor: 64,
            confirm_wait_secs: 120.0,
            snapshot_ttl_secs: 3600.0,
            stats_window: 50,
            ucb_c: 0.5,
            group_size: 1,
            group_share: 1.0,
            group_hold_segments: 256,
            group_hold_bytes: 64 << 20,
        }
    }
}

impl WorkConfig {
    /// The tasks, with `env` standing in for an empty list.
    pub fn task_list(&self, env: &EnvConfig) -> Vec<EnvConfig> {
        if self.tasks.is_empty() {
            vec![env.clone()]
        } else {
            self.tasks.clone()
        }
    }

    /// Check ranges; spaces are checked by `RunSpec::validate`.
    pub fn validate(&self) -> Result<(), String> {
        if !(0.0..=1.0).contains(&self.restart_share) {
            return Err(format!("work.restart_share {} outside [0, 1]", self.restart_share));
        }
        if self.episodes_per_item == 0 || self.queue_per_slot == 0 || self.stats_window == 0 {
            return Err("work.episodes_per_item, work.queue_per_slot and work.stats_window must be at least 1".into());
        }
        if !(1..=65_536).contains(&self.max_items_per_actor) {
            return Err(format!("work.max_items_per_actor {} outside 1..=65536", self.max_items_per_actor));
        }
        for (name, secs) in [
            ("ack_wait_secs", self.ack_wait_secs),
            ("confirm_wait_secs", self.confirm_wait_secs),
            ("snapshot_ttl_secs", self.snapshot_ttl_secs),
        ] {
            if !(secs.is_finite() && secs > 0.0 && secs <= 7.0 * 24.0 * 3600.0) {
                return Err(format!("work.{name} {secs} outside (0, 604800]"));
            }
        }
        if self.tasks.len() > 256 {
            return Err(format!("work.tasks: {} tasks, at most 256", self.tasks.len()));
        }
        if !(self.ucb_c.is_finite() && self.ucb_c >= 0.0) {
            return Err(format!("work.ucb_c {} must be finite and non-negative", self.ucb_c));
        }
        if !(1..=MAX_GROUP_SIZE).contains(&self.group_size) {
            return Err(format!("work.group_size {} outside 1..={MAX_GROUP_SIZE}", self.group_size));
        }
        if !(0.0..=1.0).contains(&self.group_share) {
            return Err(format!("work.group_share {} outside [0, 1]", self.group_share));
        }
        if !(1..=4096).contains(&self.group_hold_segments) || self.group_hold_bytes == 0 {
            return Err(format!(
                "work.group_hold_segments {} outside 1..=4096 or work.group_hold_bytes {} is 0",
                self.group_hold_segments, self.group_hold_bytes
            ));
        }
        Ok(())
    }
}

/// Where a work item's episodes start.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase", tag = "kind")]
pub enum Start {
    /// A fresh episode; its randomness derives from `seed`.
    Fresh {
        /// Reset seed of the first episode (later episodes of the item add their index).
        seed: u64,
    },
    /// The saved state with this key.
    Resume {
        /// Snapshot key in the run's snapshot store.
        snapshot: String,
    },
}

/// The most continuations one group may have ([`WorkConfig::group_size`]).
pub const MAX_GROUP_SIZE: u32 = 64;

/// Membership of one work item (and of its episode) in a group of continuations forked from
/// one start (GRPO-style groups, Shao et al. 2024): `size` items share the group id (the id of
/// the group's first item) and the start, and member `member` samples its actions from its
/// own stream, [`group_stream_seed`]`(group, member)`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct GroupMember {
    /// The group's id: the id of its first work item.
    pub group: u64,
    /// This continuation's index, `0..size`.
    pub member: u32,
    /// Continuations in the group (`work.group_size` when issued).
    pub size: u32,
}

impl GroupMember {
    /// Whether the tag is well-formed: `member < size ≤ MAX_GROUP_SIZE`.
    pub fn is_valid(&self) -> bool {
        self.size >= 2 && self.size <= MAX_GROUP_SIZE && self.member < self.size
    }
}

/// The seed of member `member`'s action-sampling generator in group `group`: a fixed
/// function of the two (SplitMix64's finaliser over both), so a redelivered member samples
/// exactly as it would have on the first actor, and every member samples differently.
pub fn group_stream_seed(group: u64, member: u32) -> u64 {
    let mut z = group ^ (u64::from(member) + 1).wrapping_mul(0x9e37_79b9_7f4a_7c15) ^ 0x6a09_e667_f3bc_c909;
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// One unit of rollout work, as the scheduler issues it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct WorkItem {
    /// Unique within the run (the scheduler counts up, also across learner restarts).
    pub id: u64,
    /// Index into the run's task list.
    pub task_id: u32,
    /// Where its episodes start.
    pub start: Start,
    /// Episodes to run from the start.
    pub episodes: u32,
    /// The group this item is a continuation of (group rollouts); absent from the JSON of a
    /// single item, so such items are byte-for-byte what they were before groups existed.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub group: Option<GroupMember>,
}

impl WorkItem {
    /// The work queue's message body: [`crate::wire::encode_work_item`].
    pub fn to_json(&self) -> Vec<u8> {
        crate::wire::encode_work_item(self)
    }

    /// Parse a work-queue message body: [`crate::wire::decode_work_item`].
    pub fn from_json(bytes: &[u8]) -> Result<Self, DecodeError> {
        crate::wire::decode_work_item(bytes)
    }
}

/// Everything needed to continue an episode on any actor: the environment's own snapshot, the
/// policy's recurrent state, the episode's running statistics and the action-sampling
/// generator, so a resumed episode with the same weights takes exactly the same actions.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct EpisodeSnapshot {
    /// The work item being run.
    pub work_item: u64,
    /// Which of the item's episodes (0-based).
    pub episode_index: u32,
    /// Task index.
    pub task_id: u32,
    /// The start the episode came from (`None`: fresh).
    pub origin: Option<String>,
    /// [`volley_env::Env::snapshot`] bytes.
    pub env: Vec<u8>,
    /// Recurrent state `[H]` before the next step.
    pub hidden: Vec<f32>,
    /// Return so far.
    pub episode_return: f32,
    /// Steps so far.
    pub episode_len: u32,
    /// Behaviour policy version when saved.
    pub policy_version: crate::ids::PolicyVersion,
    /// The episode's action-sampling generator.
    pub rng: Pcg64Mcg,
    /// Environment-defined progress ([`volley_env::Env::progress`]).
    pub progress: f32,
}

pub use crate::wire::MAX_EPISODE_SNAPSHOT_BYTES;

impl EpisodeSnapshot {
    /// Encode for a snapshot store: [`crate::wire::encode_episode_snapshot`].
    pub fn encode(&self) -> Vec<u8> {
        crate::wire::encode_episode_snapshot(self)
    }

    /// Decode untrusted bytes: [`crate::wire::decode_episode_snapshot`].
    pub fn decode(bytes: &[u8]) -> Result<Self, DecodeError> {
        crate::wire::decode_episode_snapshot(bytes)
    }

    /// The store key: `w<item>-e<episode>-s<steps>`, unique per item and position.
    pub fn key(&self) -> String {
        format!("w{}-e{}-s{}", self.work_item, self.episode_index, self.episode_len)
    }
}

/// A saved snapshot, announced to the scheduler inside a segment.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SnapshotInfo {
    /// Store key.
    pub key: String,
    /// Task index.
    pub task_id: u32,
    /// Environment-defined progress at the save.
    pub progress: f32,
    /// Return so far.
    pub episode_return: f32,
    /// Steps so far.
    pub episode_len: u32,
}

/// Whether an episode of `env` with this return counts as a success for the scheduler's
/// success rates: CartPole lasting to its 500-step limit, a correct memory recall, reaching the
/// last milestones door, Pendulum held upright for most of its episode, scoring in a MinAtar game.
pub fn episode_success(env: &EnvConfig, episode_return: f32) -> bool {
    match env {
        EnvConfig::Cartpole => episode_return >= 500.0,
        EnvConfig::Memory(_) | EnvConfig::Milestones(_) => episode_return > 0.5,
        // Swung up and held for most of the 200 steps (random torques score about -1200).
        EnvConfig::Pendulum => episode_return >= -200.0,
        // MinAtar games have no goal; an episode that scores at all counts.
        EnvConfig::Minatar(_) => episode_return > 0.0,
        // Remote environments that snapshot: the servers' solved threshold if they declared
        // one, else any positive return.
        EnvConfig::Remote(remote) => match remote.reward_threshold {
            Some(threshold) => episode_return >= threshold,
            None => episode_return > 0.0,
        },
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::{Rng, SeedableRng};

    #[test]
    fn episode_snapshots_round_trip_and_reject_garbage() {
        let mut rng = Pcg64Mcg::seed_from_u64(3);
        let _: u32 = rng.random();
        let snapshot = EpisodeSnapshot {
            work_item: 12,
            episode_index: 1,
            task_id: 2,
            origin: Some("w3-e0-s40".into()),
            env: vec![1, 2, 3, 4],
            hidden: vec![0.5, -0.25],
            episode_return: 3.5,
            episode_len: 17,
            policy_version: crate::ids::PolicyVersion(9),
            rng,
            progress: 1.5,
        };
        let bytes = snapshot.encode();
        assert_eq!(EpisodeSnapshot::decode(&bytes).unwrap(), snapshot);
        assert_eq!(snapshot.key(), "w12-e1-s17");
        let nan = EpisodeSnapshot { hidden: vec![0.0, f32::NAN], ..snapshot.clone() };
        assert_eq!(EpisodeSnapshot::decode(&nan.encode()).unwrap_err().reason(), "non_finite");
        assert!(EpisodeSnapshot::decode(&bytes[..bytes.len() - 1]).is_err());
        assert_eq!(EpisodeSnapshot::decode(b"VLYS....").unwrap_err().reason(), "bad_magic");
        assert_eq!(EpisodeSnapshot::decode(b"VLY").unwrap_err().reason(), "truncated");
        assert_eq!(EpisodeSnapshot::decode(&[0; (16 << 20) + 1]).unwrap_err().reason(), "too_large");
        let mut trailing = bytes.clone();
        trailing.push(0);
        assert_eq!(EpisodeSnapshot::decode(&trailing).unwrap_err().reason(), "corrupt");
        // Issue 12: every bit flip after the magic is caught by the checksum.
        for bit in 32..bytes.len() * 8 {
            let mut flipped = bytes.clone();
            flipped[bit / 8] ^= 1 << (bit % 8);
            assert_eq!(EpisodeSnapshot::decode(&flipped).unwrap_err().reason(), "corrupt", "bit {bit}");
        }
        // The restored generator continues the same sequence.
        let mut a = EpisodeSnapshot::decode(&bytes).unwrap().rng;
        let mut b = snapshot.rng.clone();
        assert_eq!(a.random::<u64>(), b.random::<u64>());
    }

    #[test]
    fn work_items_are_json_and_old_specs_parse_without_work_settings() {
        let item = WorkItem {
            id: 4,
            task_id: 1,
            start: Start::Resume { snapshot: "w1-e0-s8".into() },
            episodes: 2,
            group: None,
        };
        let json = item.to_json();
        assert_eq!(WorkItem::from_json(&json).unwrap(), item);
        assert!(String::from_utf8(json.clone()).unwrap().contains("\"kind\":\"resume\""));
        assert_eq!(WorkItem::from_json(b"{\"id\":1}").unwrap_err().reason(), "malformed");
        assert_eq!(WorkItem::from_json(&json[..json.len() / 2]).unwrap_err().reason(), "truncated");
        // Issue 12: a flipped field value that still parses is refused by the checksum.
        let json = String::from_utf8(item.to_json()).unwrap();
        let forged = json.replace("\"episodes\":2", "\"episodes\":3");
        assert_ne!(forged, json);
        assert_eq!(WorkItem::from_json(forged.as_bytes()).unwrap_err().reason(), "corrupt");
        let config: WorkConfig = serde_json::from_str("{}").unwrap();
        assert_eq!(config, WorkConfig::default());
        assert!(WorkConfig { restart_share: 1.5, ..WorkConfig::default() }.validate().is_err());
        assert!(WorkConfig { episodes_per_item: 0, ..WorkConfig::default() }.validate().is_err());
        assert!(WorkConfig::default().validate().is_ok());
        assert!(WorkConfig { group_size: 0, ..WorkConfig::default() }.validate().is_err());
        assert!(WorkConfig { group_size: MAX_GROUP_SIZE + 1, ..WorkConfig::default() }.validate().is_err());
        assert!(WorkConfig { group_share: -0.1, ..WorkConfig::default() }.validate().is_err());
    }

    #[test]
    fn group_items_round_trip_and_single_items_keep_their_json() {
        let single = WorkItem { id: 9, task_id: 0, start: Start::Fresh { seed: 3 }, episodes: 1, group: None };
        let json = String::from_utf8(single.to_json()).unwrap();
        assert!(!json.contains("group"), "{json}");
        let member = WorkItem { group: Some(GroupMember { group: 9, member: 2, size: 4 }), ..single };
        assert_eq!(WorkItem::from_json(&member.to_json()).unwrap(), member);
        assert!(GroupMember { group: 9, member: 2, size: 4 }.is_valid());
        assert!(!GroupMember { group: 9, member: 4, size: 4 }.is_valid());
        assert!(!GroupMember { group: 9, member: 0, size: MAX_GROUP_SIZE + 1 }.is_valid());
    }

    #[test]
    fn group_streams_differ_by_member_and_group_and_are_fixed() {
        let seeds: std::collections::HashSet<u64> =
            (0..4u64).flat_map(|g| (0..8).map(move |m| group_stream_seed(100 + g, m))).collect();
        assert_eq!(seeds.len(), 32);
        assert_eq!(group_stream_seed(5, 1), group_stream_seed(5, 1));
    }
}
