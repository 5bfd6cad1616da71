//! The in-process transport: bounded channels with the semantics that matter for one process
//! (backpressure, versioned weights, close on shutdown). Not a re-implementation of NATS.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use crossbeam_channel::{Receiver, RecvTimeoutError, SendTimeoutError, Sender, TrySendError};

use super::{
    Delivery, DeliveryToken, TrajectorySink, TrajectorySource, TransportError, WeightsFollower, WeightsPublisher,
};
use volley_core::ids::PolicyVersion;
use volley_core::wire::{TrajectorySegment, Weights};

/// How often a blocked publisher re-checks whether the run closed.
const CLOSE_POLL: Duration = Duration::from_millis(50);

/// Shared open/closed state of an in-process bus.
#[derive(Debug, Default)]
struct BusState {
    closed: AtomicBool,
}

/// Build a trajectory channel holding at most `capacity_segments` undelivered segments.
pub fn trajectory_channel(capacity_segments: usize) -> (LocalTrajectorySink, LocalTrajectorySource) {
    let (tx, rx) = crossbeam_channel::bounded(capacity_segments.max(1));
    let state = Arc::new(BusState::default());
    (
        LocalTrajectorySink { tx, state: state.clone(), throttled: Duration::ZERO },
        LocalTrajectorySource { rx, state, next_token: 0 },
    )
}

/// Actor side of [`trajectory_channel`]; clone one per actor.
#[derive(Debug, Clone)]
pub struct LocalTrajectorySink {
    tx: Sender<TrajectorySegment>,
    state: Arc<BusState>,
    throttled: Duration,
}

impl TrajectorySink for LocalTrajectorySink {
    fn publish(&mut self, segments: Vec<TrajectorySegment>) -> Result<(), TransportError> {
        for segment in segments {
            if self.state.closed.load(Ordering::Acquire) {
                return Err(TransportError::Closed);
            }
            let mut pending = match self.tx.try_send(segment) {
                Ok(()) => continue,
                Err(TrySendError::Disconnected(_)) => return Err(TransportError::Closed),
                Err(TrySendError::Full(back)) => back,
            };
            // The learner is behind: wait (this is the pacing), re-checking for shutdown.
            let blocked_since = Instant::now();
            loop {
                match self.tx.send_timeout(pending, CLOSE_POLL) {
                    Ok(()) => break,
                    Err(SendTimeoutError::Timeout(back)) => pending = back,
                    Err(SendTimeoutError::Disconnected(_)) => return Err(TransportError::Closed),
                }
                if self.state.closed.load(Ordering::Acquire) {
                    return Err(TransportError::Closed);
                }
            }
            self.throttled += blocked_since.elapsed();
        }
        Ok(())
    }

    fn throttled(&self) -> Duration {
        self.throttled
    }
}

/// Learner side of [`trajectory_channel`]. Dropping it (or calling [`LocalTrajectorySource::close`])
/// ends the run for every sink.
#[derive(Debug)]
pub struct LocalTrajectorySource {
    rx: Receiver<TrajectorySegment>,
    state: Arc<BusState>,
    next_token: u64,
}

impl LocalTrajectorySource {
    /// Close the bus: blocked and future publishes return [`TransportError::Closed`].
    pub fn close(&self) {
        self.state.closed.store(true, Ordering::Release);
    }

    fn wrap(&mut self, segment: TrajectorySegment) -> Delivery {
        self.next_token += 1;
        Delivery { segment: Ok(segment), token: DeliveryToken(self.next_token), delivery_count: 1, subject_actor: None }
    }
}

impl Drop for LocalTrajectorySource {
    fn drop(&mut self) {
        self.close();
    }
}

impl TrajectorySource for LocalTrajectorySource {
    fn recv(&mut self, max: usize, timeout: Duration, out: &mut Vec<Delivery>) -> Result<usize, TransportError> {
        if max == 0 {
            return Ok(0);
        }
        let first = match self.rx.recv_timeout(timeout) {
            Ok(segment) => segment,
            Err(RecvTimeoutError::Timeout) => return Ok(0),
            Err(RecvTimeoutError::Disconnected) => return Err(TransportError::Closed),
        };
        let delivery = self.wrap(first);
        out.push(delivery);
        let mut n = 1;
        while n < max {
            match self.rx.try_recv() {
                Ok(segment) => {
                    let delivery = self.wrap(segment);
                    out.push(delivery);
                    n += 1;
                }
                Err(_) => break,
            }
        }
        Ok(n)
    }

    fn ack(&mut self, _tokens: &[DeliveryToken]) -> Result<(), TransportError> {
        // In one process a delivered segment cannot be lost to a crash that spares the learner.
        Ok(())
    }

    fn reject(&mut self, _token: DeliveryToken) -> Result<(), TransportError> {
        Ok(())
    }

    fn backlog(&self) -> Option<u64> {
        Some(self.rx.len() as u64)
    }
}

#[derive(Debug, Default)]
struct WeightsSlot {
    latest: Mutex<Option<Arc<Weights>>>,
    version: AtomicU64,
    published: Condvar,
}

/// Build a weights broadcast: one publisher, any number of followers (clone them).
pub fn weights_channel() -> (LocalWeightsPublisher, LocalWeightsFollower) {
    let slot = Arc::new(WeightsSlot::default());
    (LocalWeightsPublisher { slot: slot.clone() }, LocalWeightsFollower { slot })
}

/// Learner side of [`weights_channel`].
#[derive(Debug)]
pub struct LocalWeightsPublisher {
    slot: Arc<WeightsSlot>,
}

impl WeightsPublisher for LocalWeightsPublisher {
    fn publish(&mut self, weights: Arc<Weights>) -> Result<(), TransportError> {
        let mut latest = self.slot.latest.lock().expect("weights lock is never poisoned");
        if let Some(current) = latest.as_ref() {
            if weights.version <= current.version {
                return Err(TransportError::Failed {
                    operation: "weights publish",
                    message: format!("version {} is not newer than {}", weights.version, current.version),
                });
            }
        }
        self.slot.version.store(weights.version.0.saturating_add(1), Ordering::Release);
        *latest = Some(weights);
        self.slot.published.notify_all();
        Ok(())
    }
}

/// Actor side of [`weights_channel`].
#[derive(Debug, Clone)]
pub struct LocalWeightsFollower {
    slot: Arc<WeightsSlot>,
}

impl WeightsFollower for LocalWeightsFollower {
    fn latest(&mut self, have: Option<PolicyVersion>) -> Result<Option<Arc<Weights>>, TransportError> {
        // `version` holds latest + 1 (0 = nothing yet), so the common "nothing new" case is one
        // atomic load without taking the lock.
        let published = self.slot.version.load(Ordering::Acquire);
        let newer = match (published, have) {
            (0, _) => false,
            (_, None) => true,
            (v, Some(have)) => v - 1 > have.0,
        };
        if !newer {
            return Ok(None);
        }
        Ok(self.slot.latest.lock().expect("weights lock is never poisoned").clone())
    }

    fn wait_first(&mut self, timeout: Duration) -> Result<Arc<Weights>, TransportError> {
        let latest = self.slot.latest.lock().expect("weights lock is never poisoned");
        let (latest, _) = self
            .slot
            .published
            .wait_timeout_while(latest, timeout, |w| w.is_none())
            .expect("weights lock is never poisoned");
        latest.clone().ok_or(TransportError::Timeout { operation: "first weights", after: timeout })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::thread;
    use volley_testkit::fixtures::SegmentBuilder;

    fn segment(idx: u64) -> TrajectorySegment {
        SegmentBuilder::new(1, 1).run("r").segment_idx(idx).reward(0.0).log_prob(0.0).build()
    }

    #[test]
    fn segments_arrive_in_order_up_to_max() {
        let (mut sink, mut source) = trajectory_channel(8);
        sink.publish((0..5).map(segment).collect()).expect("room for five");
        let mut out = Vec::new();
        assert_eq!(source.recv(3, Duration::from_millis(10), &mut out).expect("open"), 3);
        assert_eq!(source.recv(10, Duration::from_millis(10), &mut out).expect("open"), 2);
        let idx: Vec<u64> =
            out.iter().map(|d| d.segment.as_ref().expect("in-process segments decode").segment_idx).collect();
        assert_eq!(idx, vec![0, 1, 2, 3, 4]);
        assert_eq!(source.recv(1, Duration::from_millis(1), &mut out).expect("open"), 0, "timeout yields nothing");
    }

    #[test]
    fn full_channel_blocks_publisher_until_learner_reads() {
        let (mut sink, mut source) = trajectory_channel(2);
        let publisher = thread::spawn(move || {
            sink.publish((0..4).map(segment).collect()).expect("eventually delivered");
            sink.throttled()
        });
        let mut out = Vec::new();
        while out.len() < 4 {
            source.recv(4, Duration::from_millis(200), &mut out).expect("open");
            thread::sleep(Duration::from_millis(20));
        }
        let throttled = publisher.join().expect("publisher thread");
        assert!(throttled > Duration::ZERO, "the publisher must have waited for room");
    }

    #[test]
    fn closing_the_source_releases_blocked_publishers() {
        let (mut sink, source) = trajectory_channel(1);
        let publisher = thread::spawn(move || sink.publish((0..3).map(segment).collect()));
        thread::sleep(Duration::from_millis(30));
        drop(source);
        assert_eq!(publisher.join().expect("publisher thread"), Err(TransportError::Closed));
    }

    #[test]
    fn followers_see_only_newer_versions() {
        let (mut publisher, mut follower) = weights_channel();
        assert!(follower.latest(None).expect("open").is_none());
        assert!(follower.wait_first(Duration::from_millis(5)).is_err());
        publisher.publish(Arc::new(Weights::new(PolicyVersion(0), 1, vec![1.0]))).expect("first");
        let first = follower.wait_first(Duration::from_millis(5)).expect("published");
        assert_eq!(first.version, PolicyVersion(0));
        assert!(follower.latest(Some(PolicyVersion(0))).expect("open").is_none());
        publisher.publish(Arc::new(Weights::new(PolicyVersion(1), 1, vec![2.0]))).expect("second");
        let second = follower.latest(Some(PolicyVersion(0))).expect("open").expect("newer");
        assert_eq!(second.params, vec![2.0]);
        assert!(publisher.publish(Arc::new(Weights::new(PolicyVersion(1), 1, vec![3.0]))).is_err());
    }
}
