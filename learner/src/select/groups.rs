//! Group rollouts on the learner's side: the returns of each group of continuations, and the
//! group-relative advantage of its members.
//!
//! The scheduler issues a group as `K` work items that share a start and differ only in their
//! sampling streams ([`volley_core::work::GroupMember`]); each member's episode reports its
//! return in an [`EpisodeSummary`] tagged with the group. [`GroupTable`] collects those
//! returns per group; once all `K` are in, the group is complete and member `k`'s advantage is
//! `c · (G_k − mean_j G_j)` (GRPO, Shao et al. 2024, without the division by the standard
//! deviation as in Liu et al. 2025, "Dr. GRPO"; with it under `Baseline::GroupStd`), `c` the
//! reward scale, so it is on the critic's scale.
//!
//! Group ids come from peers (inside segments), so the table is bounded (docs/SECURITY.md): at
//! most `capacity` groups of at most [`volley_core::work::MAX_GROUP_SIZE`] returns each, the
//! oldest forgotten first. A flood of forged ids can only push honest groups out early (their
//! held segments then fall back to the critic, counted); it cannot grow the table, and the
//! selector's hold (`selection.rs`) is bounded separately in segments, bytes and lag.

use std::collections::{HashMap, VecDeque};

use volley_core::wire::EpisodeSummary;
use volley_core::work::GroupMember;

/// Groups the learner remembers by default (about 1.3 MB with 64 members each).
pub const MAX_TRACKED_GROUPS: usize = 4096;

/// What the table knows about a group.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum GroupState {
    /// Not in the table (never seen, or forgotten).
    Unknown,
    /// Some members' returns are still missing.
    Incomplete,
    /// Every member's return is in.
    Complete,
    /// Members reported different starts (a saved state that expired for some of them): not a
    /// group whose returns can be compared.
    Broken,
}

/// Counters of the group table (exported as `volley_learner_groups_total{outcome}` and
/// `volley_learner_group_members_duplicate_total`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct GroupCounters {
    /// Groups whose every member's return arrived.
    pub completed: u64,
    /// Groups forgotten before they completed (the table was full).
    pub evicted_incomplete: u64,
    /// Groups whose members reported different starts.
    pub broken: u64,
    /// Member returns reported again (a redelivered item replaying its tail); the first one
    /// counts.
    pub duplicate_members: u64,
}

#[derive(Debug, Clone)]
struct GroupEntry {
    /// `G_k` per member; NaN until reported.
    returns: Vec<f32>,
    reported: u32,
    /// Hash of the first reported (task, start): every member must match it.
    start: Option<u64>,
    broken: bool,
}

/// The returns of recent groups of continuations; see the module docs.
#[derive(Debug, Clone)]
pub struct GroupTable {
    group_size: u32,
    capacity: usize,
    groups: HashMap<u64, GroupEntry>,
    order: VecDeque<u64>,
    counters: GroupCounters,
}

impl GroupTable {
    /// A table for groups of `group_size` members, remembering at most `capacity` groups.
    pub fn new(group_size: u32, capacity: usize) -> Self {
        GroupTable {
            group_size,
            capacity: capacity.max(1),
            groups: HashMap::new(),
            order: VecDeque::new(),
            counters: GroupCounters::default(),
        }
    }

    /// The counters so far.
    pub fn counters(&self) -> GroupCounters {
        self.counters
    }

    /// Groups remembered.
    pub fn len(&self) -> usize {
        self.groups.len()
    }

    /// Whether no group is remembered.
    pub fn is_empty(&self) -> bool {
        self.groups.is_empty()
    }

    fn accepts(&self, tag: &GroupMember) -> bool {
        tag.is_valid() && tag.size == self.group_size
    }

    /// The group's entry, made (forgetting the oldest group when full) if new.
    fn entry(&mut self, group: u64) -> &mut GroupEntry {
        if !self.groups.contains_key(&group) {
            if self.groups.len() >= self.capacity {
                if let Some(oldest) = self.order.pop_front() {
                    if let Some(entry) = self.groups.remove(&oldest) {
                        if entry.reported < self.group_size && !entry.broken {
                            self.counters.evicted_incomplete += 1;
                        }
                    }
                }
            }
            self.order.push_back(group);
            self.groups.insert(
                group,
                GroupEntry {
                    returns: vec![f32::NAN; self.group_size as usize],
                    reported: 0,
                    start: None,
                    broken: false,
                },
            );
        }
        self.groups.get_mut(&group).expect("inserted above")
    }

    /// Remember that a segment of `tag`'s group is waiting (so the group is known, and a
    /// later eviction shows as [`GroupState::Unknown`]). Tags of another size are ignored.
    pub fn touch(&mut self, tag: &GroupMember) {
        if self.accepts(tag) {
            self.entry(tag.group);
        }
    }

    /// Record a finished episode; episodes without a valid group tag are ignored.
    pub fn record(&mut self, episode: &EpisodeSummary) {
        let Some(tag) = episode.group.filter(|tag| self.accepts(tag)) else {
            return;
        };
        if !episode.episode_return.is_finite() {
            return;
        }
        let start = volley_core::wire::id_hash(
            format!("{}:{}", episode.task_id, episode.start.as_deref().unwrap_or("")).as_bytes(),
        );
        let group_size = self.group_size;
        let entry = self.entry(tag.group);
        if entry.broken {
            return;
        }
        if entry.start.is_some_and(|first| first != start) {
            entry.broken = true;
            self.counters.broken += 1;
            return;
        }
        entry.start = Some(start);
        let slot = &mut entry.returns[tag.member as usize];
        if !slot.is_nan() {
            self.counters.duplicate_members += 1;
            return;
        }
        *slot = episode.episode_return;
        entry.reported += 1;
        if entry.reported == group_size {
            self.counters.completed += 1;
        }
    }

    /// What the table knows about `group`.
    pub fn state(&self, group: u64) -> GroupState {
        match self.groups.get(&group) {
            None => GroupState::Unknown,
            Some(entry) if entry.broken => GroupState::Broken,
            Some(entry) if entry.reported == self.group_size => GroupState::Complete,
            Some(_) => GroupState::Incomplete,
        }
    }

    /// The group's returns, when it is complete.
    pub fn returns(&self, group: u64) -> Option<&[f32]> {
        (self.state(group) == GroupState::Complete).then(|| self.groups[&group].returns.as_slice())
    }

    /// Member `tag.member`'s group-relative advantage `scale · (G_k − mean G)`, divided by
    /// `std G + 1e-6` with `divide_by_std`; `None` unless the group is complete.
    pub fn advantage(&self, tag: &GroupMember, scale: f32, divide_by_std: bool) -> Option<f32> {
        let returns = self.returns(tag.group)?;
        let own = *returns.get(tag.member as usize)?;
        Some(group_relative_advantage(own, returns, divide_by_std) * scale)
    }

    /// Whether the group is complete and its returns spread by at most `tolerance` (every
    /// member's group-relative advantage is then zero: the zero-variance filter's case).
    pub fn is_zero_variance(&self, group: u64, tolerance: f32) -> bool {
        self.returns(group).is_some_and(|returns| {
            let (lo, hi) =
                returns.iter().fold((f32::INFINITY, f32::NEG_INFINITY), |(lo, hi), &r| (lo.min(r), hi.max(r)));
            hi - lo <= tolerance
        })
    }
}

/// `G_k − mean(G)` over a group's returns `G` (Shao et al. 2024, eq. for outcome supervision),
/// divided by the population standard deviation plus 1e-6 with `divide_by_std`. Computed in
/// `f64`.
///
/// ```
/// # use volley_learner::select::groups::group_relative_advantage;
/// assert_eq!(group_relative_advantage(1.0, &[1.0, 0.0, 0.0, 0.0], false), 0.75);
/// ```
pub fn group_relative_advantage(own: f32, returns: &[f32], divide_by_std: bool) -> f32 {
    let n = returns.len().max(1) as f64;
    let mean = returns.iter().map(|&r| f64::from(r)).sum::<f64>() / n;
    let centred = f64::from(own) - mean;
    if !divide_by_std {
        return centred as f32;
    }
    let var = returns.iter().map(|&r| (f64::from(r) - mean).powi(2)).sum::<f64>() / n;
    (centred / (var.sqrt() + 1e-6)) as f32
}

#[cfg(test)]
mod tests {
    use super::*;

    fn episode(group: u64, member: u32, size: u32, episode_return: f32) -> EpisodeSummary {
        EpisodeSummary {
            episode_return,
            episode_len: 5,
            group: Some(GroupMember { group, member, size }),
            ..EpisodeSummary::default()
        }
    }

    #[test]
    fn a_group_completes_when_every_member_reported_and_gives_centred_advantages() {
        let mut table = GroupTable::new(4, 16);
        let returns = [1.0, 0.0, 0.0, 3.0];
        for (k, &r) in returns.iter().enumerate().take(3) {
            table.record(&episode(7, k as u32, 4, r));
            assert_eq!(table.state(7), GroupState::Incomplete);
        }
        let tag = |member| GroupMember { group: 7, member, size: 4 };
        assert_eq!(table.advantage(&tag(0), 1.0, false), None, "no advantage before the group is complete");
        table.record(&episode(7, 3, 4, 3.0));
        assert_eq!(table.state(7), GroupState::Complete);
        // Hand-computed: mean 1, so G_k − mean = 0, −1, −1, 2; scaled by 0.5.
        let advantages: Vec<f32> = (0..4).map(|k| table.advantage(&tag(k), 0.5, false).unwrap()).collect();
        assert_eq!(advantages, vec![0.0, -0.5, -0.5, 1.0]);
        // Divided by the standard deviation √1.5.
        let std = 1.5f64.sqrt();
        assert!((f64::from(table.advantage(&tag(3), 1.0, true).unwrap()) - 2.0 / (std + 1e-6)).abs() < 1e-6);
        assert_eq!(table.counters().completed, 1);
        assert!(!table.is_zero_variance(7, 0.0));
    }

    #[test]
    fn duplicates_other_sizes_and_mixed_starts_do_not_count() {
        let mut table = GroupTable::new(2, 16);
        table.record(&episode(1, 0, 2, 1.0));
        table.record(&episode(1, 0, 2, 5.0));
        assert_eq!(table.counters().duplicate_members, 1);
        table.record(&episode(1, 1, 3, 1.0));
        table.record(&episode(1, 2, 2, 1.0));
        assert_eq!(table.state(1), GroupState::Incomplete, "a tag of another size or member is ignored");
        table.record(&episode(1, 1, 2, 1.0));
        assert!(table.is_zero_variance(1, 0.0), "the first report of member 0 counts");
        table.record(&episode(2, 0, 2, 1.0));
        let mut other_start = episode(2, 1, 2, 1.0);
        other_start.start = Some("w1-e0-s4".into());
        table.record(&other_start);
        assert_eq!(table.state(2), GroupState::Broken);
        assert_eq!(table.counters().broken, 1);
    }

    /// docs/SECURITY.md: forged group ids cannot grow the table; they push the oldest groups
    /// out, which is counted.
    #[test]
    fn a_flood_of_forged_group_ids_stays_bounded() {
        let mut table = GroupTable::new(8, 64);
        table.record(&episode(u64::MAX, 0, 8, 1.0));
        for forged in 0..100_000u64 {
            table.record(&episode(forged, (forged % 8) as u32, 8, 1.0));
            assert!(table.len() <= 64);
        }
        assert_eq!(table.len(), 64);
        assert_eq!(table.state(u64::MAX), GroupState::Unknown, "the oldest group was forgotten");
        assert_eq!(table.counters().evicted_incomplete, 100_000 + 1 - 64);
    }
}
