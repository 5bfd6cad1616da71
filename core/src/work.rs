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

use crate::env::EnvConfig;

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
    /// Save at the environment's milestones ([`crate::env::Env::at_milestone`]).
    pub snapshot_at_milestones: bool,
    /// Work items kept queued per actor environment slot.
    pub queue_per_slot: u32,
    /// Seconds a taken item may go without progress before the broker redelivers it.
    pub ack_wait_secs: f64,
    /// Seconds a snapshot is kept (the snapshot store's retention bound).
    pub snapshot_ttl_secs: f64,
    /// Success-rate window (episodes) per task and per start in the scheduler.
    pub stats_window: u32,
    /// UCB exploration constant.
    pub ucb_c: f32,
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
            snapshot_ttl_secs: 3600.0,
            stats_window: 50,
            ucb_c: 0.5,
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
        for (name, secs) in [("ack_wait_secs", self.ack_wait_secs), ("snapshot_ttl_secs", self.snapshot_ttl_secs)] {
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
}

/// A work item as the work queue carries it: the item's fields plus `checksum`, the XXH3-64
/// (hex) of the item's own JSON encoding, so a corrupted item is refused (docs/SECURITY.md).
#[derive(Serialize, Deserialize)]
struct SealedWorkItem {
    #[serde(flatten)]
    item: WorkItem,
    checksum: String,
}

impl WorkItem {
    fn checksum(&self) -> String {
        let json = serde_json::to_vec(self).expect("a work item always serializes");
        format!("{:016x}", crate::wire::body_checksum(&json))
    }

    /// JSON, the work queue's message body (readable with `nats stream view`), with the
    /// item's checksum.
    pub fn to_json(&self) -> Vec<u8> {
        let sealed = SealedWorkItem { item: self.clone(), checksum: self.checksum() };
        serde_json::to_vec(&sealed).expect("a work item always serializes")
    }

    /// Parse a work-queue message body and verify its checksum.
    pub fn from_json(bytes: &[u8]) -> Result<Self, String> {
        let sealed: SealedWorkItem =
            serde_json::from_slice(bytes).map_err(|err| format!("undecodable work item: {err}"))?;
        let expected = sealed.item.checksum();
        if sealed.checksum != expected {
            return Err(format!("corrupt work item: checksum {} does not match {expected}", sealed.checksum));
        }
        Ok(sealed.item)
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
    /// [`crate::env::Env::snapshot`] bytes.
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
    /// Environment-defined progress ([`crate::env::Env::progress`]).
    pub progress: f32,
}

/// Leading bytes of an encoded [`EpisodeSnapshot`].
const EPISODE_SNAPSHOT_MAGIC: [u8; 4] = *b"VLYE";
/// Largest encoded episode snapshot accepted (16 MiB).
pub const MAX_EPISODE_SNAPSHOT_BYTES: usize = 16 << 20;

impl EpisodeSnapshot {
    /// `b"VLYE"`, the XXH3-64 of the body (8 bytes, little-endian), then the bincode body.
    pub fn encode(&self) -> Vec<u8> {
        let body = bincode::serde::encode_to_vec(self, bincode::config::standard()).expect("plain data always encodes");
        let mut bytes = EPISODE_SNAPSHOT_MAGIC.to_vec();
        bytes.extend_from_slice(&crate::wire::body_checksum(&body).to_le_bytes());
        bytes.extend(body);
        bytes
    }

    /// Decode untrusted bytes; every failure is an error, never a panic.
    pub fn decode(bytes: &[u8]) -> Result<Self, String> {
        if bytes.len() > MAX_EPISODE_SNAPSHOT_BYTES {
            return Err(format!("episode snapshot of {} bytes exceeds the limit", bytes.len()));
        }
        let sealed = bytes.strip_prefix(&EPISODE_SNAPSHOT_MAGIC).ok_or("not an episode snapshot (magic)")?;
        let (checksum, body) = sealed.split_first_chunk::<8>().ok_or("episode snapshot truncated")?;
        let (expected, got) = (u64::from_le_bytes(*checksum), crate::wire::body_checksum(body));
        if expected != got {
            return Err(format!("corrupt episode snapshot: checksum {expected:016x}, body hashes to {got:016x}"));
        }
        let config = bincode::config::standard().with_limit::<MAX_EPISODE_SNAPSHOT_BYTES>();
        let (snapshot, used): (Self, usize) =
            bincode::serde::decode_from_slice(body, config).map_err(|err| format!("episode snapshot: {err}"))?;
        if used != body.len() {
            return Err(format!("{} trailing bytes after an episode snapshot", body.len() - used));
        }
        if !snapshot.episode_return.is_finite() || snapshot.hidden.iter().any(|h| !h.is_finite()) {
            return Err("episode snapshot holds non-finite values".into());
        }
        Ok(snapshot)
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
/// last milestones door.
pub fn episode_success(env: &EnvConfig, episode_return: f32) -> bool {
    match env {
        EnvConfig::Cartpole => episode_return >= 500.0,
        EnvConfig::Memory(_) | EnvConfig::Milestones(_) => episode_return > 0.5,
        // Work items are for built-in environments (`RunSpec::validate` refuses remote ones).
        EnvConfig::Remote(_) => episode_return > 0.0,
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
        assert!(EpisodeSnapshot::decode(&bytes[..bytes.len() - 1]).is_err());
        assert!(EpisodeSnapshot::decode(b"VLYS....").unwrap_err().contains("magic"));
        let mut trailing = bytes.clone();
        trailing.push(0);
        assert!(EpisodeSnapshot::decode(&trailing).unwrap_err().contains("corrupt"));
        // Issue 12: every bit flip after the magic is caught by the checksum.
        for bit in 32..bytes.len() * 8 {
            let mut flipped = bytes.clone();
            flipped[bit / 8] ^= 1 << (bit % 8);
            assert!(EpisodeSnapshot::decode(&flipped).unwrap_err().contains("corrupt"), "bit {bit}");
        }
        // The restored generator continues the same sequence.
        let mut a = EpisodeSnapshot::decode(&bytes).unwrap().rng;
        let mut b = snapshot.rng.clone();
        assert_eq!(a.random::<u64>(), b.random::<u64>());
    }

    #[test]
    fn work_items_are_json_and_old_specs_parse_without_work_settings() {
        let item = WorkItem { id: 4, task_id: 1, start: Start::Resume { snapshot: "w1-e0-s8".into() }, episodes: 2 };
        let json = item.to_json();
        assert_eq!(WorkItem::from_json(&json).unwrap(), item);
        assert!(String::from_utf8(json).unwrap().contains("\"kind\":\"resume\""));
        assert!(WorkItem::from_json(b"{\"id\":1}").is_err());
        // Issue 12: a flipped field value that still parses is refused by the checksum.
        let json = String::from_utf8(item.to_json()).unwrap();
        let forged = json.replace("\"episodes\":2", "\"episodes\":3");
        assert_ne!(forged, json);
        assert!(WorkItem::from_json(forged.as_bytes()).unwrap_err().contains("corrupt"));
        let config: WorkConfig = serde_json::from_str("{}").unwrap();
        assert_eq!(config, WorkConfig::default());
        assert!(WorkConfig { restart_share: 1.5, ..WorkConfig::default() }.validate().is_err());
        assert!(WorkConfig { episodes_per_item: 0, ..WorkConfig::default() }.validate().is_err());
        assert!(WorkConfig::default().validate().is_ok());
    }
}
