//! Transport traits of save-load and budget assignment, and their in-process implementations.
//!
//! - [`WorkQueue`] (learner side): the scheduler submits [`WorkItem`]s.
//! - [`WorkSource`] (actor side): take an item, report progress while running it, complete it.
//!   A taken item that is neither completed nor kept alive is delivered again (networked
//!   implementations; an in-process actor cannot die without its learner).
//! - [`SnapshotStore`] (actor side): save an [`EpisodeSnapshot`] (also recorded as the newest
//!   one of its work item) and load one by key, with a retention bound.

use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use super::TransportError;
use volley_core::ids::ActorId;
use volley_core::work::{EpisodeSnapshot, WorkItem};

/// Opaque handle of a taken work item.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct WorkToken(pub u64);

/// Where the learner's scheduler sends work.
pub trait WorkQueue: Send {
    /// Queue items for actors.
    fn submit(&mut self, items: &[WorkItem]) -> Result<(), TransportError>;
    /// Items queued and not yet taken, when known.
    fn queued(&mut self) -> Result<u64, TransportError>;
    /// The item's episode summaries reached the learner from `actor`: the item is done. A
    /// networked queue hands an item an actor reported done but never confirmed to another
    /// actor after `work.confirm_wait_secs`; in process there is nothing to confirm.
    fn confirm(&mut self, _item: u64, _actor: &ActorId) {}
    /// What the queue's lease dispatcher has done so far, for a networked queue that leases
    /// items to actors (`None` in process, where nothing is leased).
    fn leases(&self) -> Option<LeaseCounts> {
        None
    }
}

/// What a work dispatcher did with actors' takes and leases since it started (issue 46): the
/// counters only grow; `in_flight` and `most_held` are the state now.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct LeaseCounts {
    /// Takes answered with an item.
    pub leased: u64,
    /// Takes refused because the actor held its limit of items (`work.max_items_per_actor`).
    pub refused_limit: u64,
    /// Takes refused because one of the actor's leases was taken back within `work.ack_wait_secs`.
    pub refused_cooling: u64,
    /// Leases ended by their item's episodes arriving from the actor that reported it done
    /// (the item is acknowledged to the stream).
    pub confirmed: u64,
    /// Leases taken back without a progress signal for `work.ack_wait_secs`; the item goes to
    /// the next actor that asks.
    pub reclaimed: u64,
    /// Leases reported done whose episodes did not arrive within `work.confirm_wait_secs`;
    /// the item goes to the next actor that asks.
    pub unconfirmed: u64,
    /// Leases held now, over all actors.
    pub in_flight: u64,
    /// The most leases one actor identity holds now.
    pub most_held: u64,
}

impl LeaseCounts {
    /// The counters' labels, as the metric exports them, with their values.
    pub fn outcomes(&self) -> [(&'static str, u64); 6] {
        [
            ("leased", self.leased),
            ("refused_limit", self.refused_limit),
            ("refused_cooling", self.refused_cooling),
            ("confirmed", self.confirmed),
            ("reclaimed", self.reclaimed),
            ("unconfirmed", self.unconfirmed),
        ]
    }
}

/// Where actors take work.
pub trait WorkSource: Send {
    /// The next item, waiting at most `timeout`; `Ok(None)` when none is queued.
    fn take(&mut self, timeout: Duration) -> Result<Option<(WorkItem, WorkToken)>, TransportError>;
    /// The item is still being worked on: push its redelivery deadline back.
    fn progress(&mut self, token: WorkToken) -> Result<(), TransportError>;
    /// The item is done and must not be delivered again.
    fn complete(&mut self, token: WorkToken) -> Result<(), TransportError>;
}

/// Where actors keep episode snapshots.
pub trait SnapshotStore: Send {
    /// Save `snapshot` under [`EpisodeSnapshot::key`] and record it as the newest of its work
    /// item; returns the key.
    fn save(&mut self, snapshot: &EpisodeSnapshot) -> Result<String, TransportError>;
    /// The key of the newest snapshot of `work_item`, if any is kept.
    fn latest_for_item(&mut self, work_item: u64) -> Result<Option<String>, TransportError>;
    /// The snapshot with `key`; `Ok(None)` when it expired or never existed.
    fn load(&mut self, key: &str) -> Result<Option<EpisodeSnapshot>, TransportError>;
}

/// An in-process work queue: the learner's end.
#[derive(Debug, Clone, Default)]
pub struct LocalWorkQueue {
    items: Arc<Mutex<VecDeque<WorkItem>>>,
}

/// An in-process work queue: an actor's end (clone one per actor).
#[derive(Debug, Clone, Default)]
pub struct LocalWorkSource {
    items: Arc<Mutex<VecDeque<WorkItem>>>,
}

/// A connected in-process work queue and source.
pub fn local_work_queue() -> (LocalWorkQueue, LocalWorkSource) {
    let items = Arc::new(Mutex::new(VecDeque::new()));
    (LocalWorkQueue { items: items.clone() }, LocalWorkSource { items })
}

impl WorkQueue for LocalWorkQueue {
    fn submit(&mut self, items: &[WorkItem]) -> Result<(), TransportError> {
        self.items.lock().expect("work queue lock").extend(items.iter().cloned());
        Ok(())
    }

    fn queued(&mut self) -> Result<u64, TransportError> {
        Ok(self.items.lock().expect("work queue lock").len() as u64)
    }
}

impl WorkSource for LocalWorkSource {
    fn take(&mut self, _timeout: Duration) -> Result<Option<(WorkItem, WorkToken)>, TransportError> {
        // In process the queue is filled between updates; never block the actor's lockstep.
        Ok(self.items.lock().expect("work queue lock").pop_front().map(|item| {
            let token = WorkToken(item.id);
            (item, token)
        }))
    }

    fn progress(&mut self, _token: WorkToken) -> Result<(), TransportError> {
        Ok(())
    }

    fn complete(&mut self, _token: WorkToken) -> Result<(), TransportError> {
        Ok(())
    }
}

#[derive(Debug, Default)]
struct StoreState {
    /// Encoded snapshot and its work item, by key.
    snapshots: HashMap<String, (Vec<u8>, u64)>,
    order: VecDeque<String>,
    latest: HashMap<u64, String>,
}

/// An in-process snapshot store keeping the newest `capacity` snapshots (its retention bound).
#[derive(Debug, Clone)]
pub struct LocalSnapshotStore {
    state: Arc<Mutex<StoreState>>,
    capacity: usize,
}

impl LocalSnapshotStore {
    /// A store that keeps at most `capacity` snapshots, dropping the oldest first.
    pub fn new(capacity: usize) -> Self {
        LocalSnapshotStore { state: Arc::default(), capacity: capacity.max(1) }
    }

    /// Snapshots kept now.
    pub fn len(&self) -> usize {
        self.state.lock().expect("store lock").snapshots.len()
    }

    /// Whether the store is empty.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

impl SnapshotStore for LocalSnapshotStore {
    fn save(&mut self, snapshot: &EpisodeSnapshot) -> Result<String, TransportError> {
        let key = snapshot.key();
        let mut state = self.state.lock().expect("store lock");
        if state.snapshots.insert(key.clone(), (snapshot.encode(), snapshot.work_item)).is_none() {
            state.order.push_back(key.clone());
        }
        state.latest.insert(snapshot.work_item, key.clone());
        while state.order.len() > self.capacity {
            let Some(old) = state.order.pop_front() else { break };
            if let Some((_, item)) = state.snapshots.remove(&old) {
                if state.latest.get(&item) == Some(&old) {
                    state.latest.remove(&item);
                }
            }
        }
        Ok(key)
    }

    fn latest_for_item(&mut self, work_item: u64) -> Result<Option<String>, TransportError> {
        Ok(self.state.lock().expect("store lock").latest.get(&work_item).cloned())
    }

    fn load(&mut self, key: &str) -> Result<Option<EpisodeSnapshot>, TransportError> {
        let state = self.state.lock().expect("store lock");
        state
            .snapshots
            .get(key)
            .map(|(bytes, _)| {
                EpisodeSnapshot::decode(bytes)
                    .map_err(|err| TransportError::Failed { operation: "load snapshot", message: err.to_string() })
            })
            .transpose()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::SeedableRng;
    use volley_core::work::Start;

    fn snapshot(item: u64, len: u32) -> EpisodeSnapshot {
        EpisodeSnapshot {
            work_item: item,
            episode_index: 0,
            task_id: 0,
            origin: None,
            env: vec![7; 3],
            hidden: vec![],
            episode_return: 0.0,
            episode_len: len,
            policy_version: volley_core::ids::PolicyVersion(0),
            rng: rand_pcg::Pcg64Mcg::seed_from_u64(1),
            progress: 0.0,
        }
    }

    #[test]
    fn local_queue_hands_out_items_in_order() {
        let (mut queue, mut source) = local_work_queue();
        let items: Vec<WorkItem> = (0..3)
            .map(|id| WorkItem { id, task_id: 0, start: Start::Fresh { seed: id }, episodes: 1, group: None })
            .collect();
        queue.submit(&items).unwrap();
        assert_eq!(queue.queued().unwrap(), 3);
        let (first, token) = source.take(Duration::ZERO).unwrap().unwrap();
        assert_eq!((first.id, token), (0, WorkToken(0)));
        source.complete(token).unwrap();
        assert_eq!(queue.queued().unwrap(), 2);
    }

    #[test]
    fn local_store_keeps_the_newest_per_item_within_its_capacity() {
        let mut store = LocalSnapshotStore::new(2);
        store.save(&snapshot(1, 8)).unwrap();
        store.save(&snapshot(1, 16)).unwrap();
        assert_eq!(store.latest_for_item(1).unwrap().as_deref(), Some("w1-e0-s16"));
        store.save(&snapshot(2, 8)).unwrap();
        assert_eq!(store.len(), 2, "the oldest snapshot was dropped");
        assert!(store.load("w1-e0-s8").unwrap().is_none());
        assert_eq!(store.load("w1-e0-s16").unwrap().unwrap().episode_len, 16);
        store.save(&snapshot(3, 8)).unwrap();
        assert_eq!(store.latest_for_item(1).unwrap(), None, "an evicted newest snapshot is forgotten");
    }
}
