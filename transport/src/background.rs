//! [`BackgroundPublisher`]: any [`WeightsPublisher`] on its own thread, so the learner hands a
//! version over and goes on with the next update while the version is stored and announced.

use std::sync::{Arc, Condvar, Mutex};
use std::thread;
use std::time::{Duration, Instant};

use tracing::{debug, warn};
use volley_core::ids::PolicyVersion;
use volley_core::wire::Weights;

use crate::{LiveWeightsSender, TransportError, WeightsPublisher};

/// What the learner and the publishing thread share: what the caller asked for, what the
/// thread is doing, and what came of it.
#[derive(Default)]
struct State {
    /// The newest version handed over and not yet taken by the thread, with whether the
    /// caller sent it live (`None`: the caller did not run the live path; the inner publisher
    /// runs all of it).
    pending: Option<(Arc<Weights>, Option<bool>)>,
    /// What the thread does once nothing is pending.
    asked: Asked,
    /// What the thread is doing right now.
    doing: Doing,
    /// The newest version the inner publisher has published.
    confirmed: Option<PolicyVersion>,
    /// The first failure of the inner publisher (reported by the next call, then cleared).
    failure: Option<TransportError>,
    /// Versions handed over but replaced by a newer one before the thread took them.
    skipped: u64,
}

/// What the caller asked the thread to do after the pending version. Ordered: a later request
/// absorbs an earlier, weaker one (ending flushes too).
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
enum Asked {
    /// Nothing beyond publishing; a deferred write is still made when it falls due.
    #[default]
    Nothing,
    /// Flush the inner publisher ([`BackgroundPublisher::flush`]).
    Flush,
    /// Flush, then end the thread (the handle was dropped).
    FlushAndEnd,
}

/// What the publishing thread is doing.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
enum Doing {
    /// Waiting for a version, a request or a deferred write falling due.
    #[default]
    Idle,
    /// Publishing this version through the inner publisher.
    Publishing(PolicyVersion),
    /// Flushing the inner publisher.
    Flushing,
}

impl State {
    /// Nothing handed over or asked for is left undone: every version handed over went to the
    /// inner publisher and every flush asked for was made.
    fn settled(&self) -> bool {
        self.pending.is_none() && self.asked == Asked::Nothing && self.doing == Doing::Idle
    }

    /// The thread's next piece of work, marked as started, or `None` to wait: the pending
    /// version first, then a flush that was asked for or whose deferred write is `due` by `now`.
    fn start_next(&mut self, due: Option<Instant>, now: Instant) -> Option<Work> {
        if let Some((weights, sent_live)) = self.pending.take() {
            self.doing = Doing::Publishing(weights.version);
            return Some(Work::Publish(weights, sent_live));
        }
        let work = match self.asked {
            Asked::FlushAndEnd => Work::Flush { then_end: true },
            Asked::Flush => Work::Flush { then_end: false },
            Asked::Nothing if due.is_some_and(|due| due <= now) => Work::Flush { then_end: false },
            Asked::Nothing => return None,
        };
        if self.asked == Asked::Flush {
            self.asked = Asked::Nothing;
        }
        self.doing = Doing::Flushing;
        Some(work)
    }

    /// Record the end of a piece of work: `published` (a version) or a flush, with its outcome.
    fn finish(&mut self, published: Option<PolicyVersion>, outcome: Result<(), TransportError>) {
        self.doing = Doing::Idle;
        match (outcome, published) {
            (Ok(()), Some(version)) => self.confirmed = Some(version),
            (Ok(()), None) => {}
            (Err(err), Some(version)) => {
                warn!(version = version.0, %err, "weights publish failed");
                self.failure.get_or_insert(err);
            }
            (Err(err), None) => {
                warn!(%err, "weights flush failed");
                self.failure.get_or_insert(err);
            }
        }
    }
}

/// What the publishing thread does next.
enum Work {
    Publish(Arc<Weights>, Option<bool>),
    /// Flush the inner publisher: asked for, or a deferred write is due.
    Flush {
        /// The handle was dropped: end the thread after the flush.
        then_end: bool,
    },
}

struct Shared {
    state: Mutex<State>,
    changed: Condvar,
}

impl Shared {
    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().expect("publisher lock is never poisoned")
    }
}

/// The publishing thread: takes work from `shared` until the handle is dropped, running it
/// through `inner`.
fn run_publisher(shared: &Shared, inner: &Mutex<Box<dyn WeightsPublisher>>) {
    let lock_inner = || inner.lock().expect("publisher lock is never poisoned");
    loop {
        let work = {
            let mut state = shared.lock();
            loop {
                // A write the inner publisher deferred is made when it falls due, unless a
                // newer version comes first. Read under the state lock: a version the caller
                // took without writing changes it, and notifies.
                let due = lock_inner().deferred_until();
                let now = Instant::now();
                if let Some(work) = state.start_next(due, now) {
                    break work;
                }
                state = match due {
                    Some(due) => {
                        shared.changed.wait_timeout(state, due - now).expect("publisher lock is never poisoned").0
                    }
                    None => shared.changed.wait(state).expect("publisher lock is never poisoned"),
                };
            }
        };
        let (published, outcome, then_end) = match work {
            Work::Publish(weights, sent_live) => {
                let version = weights.version;
                let outcome = match sent_live {
                    Some(sent_live) => lock_inner().publish_after_live(weights, sent_live),
                    None => lock_inner().publish(weights),
                };
                (Some(version), outcome, false)
            }
            Work::Flush { then_end } => (None, lock_inner().flush(), then_end),
        };
        shared.lock().finish(published, outcome);
        shared.changed.notify_all();
        if then_end {
            return;
        }
    }
}

/// Publishes weights from a dedicated thread, newest first.
///
/// [`publish`](WeightsPublisher::publish) sends the version on the inner publisher's live
/// path from the caller's thread, when it has one ([`WeightsPublisher::live_sender`]): that
/// only queues it on the connection, so it leaves with the caller's next call on the bus (the
/// learner's next `recv`), with no hand-off to this thread in between. Then it returns: the
/// version replaces any version still waiting (the thread publishes only the newest, so a slow
/// store costs versions, never learner time), and the thread hands it to the inner publisher
/// ([`WeightsPublisher::publish_after_live`] when the caller sent it live). When the thread is
/// idle and the inner publisher can take the version without writing anything
/// ([`WeightsPublisher::take_without_writing`]: inline weights whose pointer may wait), the
/// caller's thread does that itself and the version is published at once: no hand-off, and the
/// thread is woken only when the deferred write's deadline changes. A failure of the inner
/// publisher (after its own retries) is returned by the next `publish` or
/// [`flush`](WeightsPublisher::flush). [`is_published`](WeightsPublisher::is_published) tells
/// the learner which versions are out, so it acknowledges the segments behind an update only
/// after the update's version was published (learner/src/consume.rs).
pub struct BackgroundPublisher {
    shared: Arc<Shared>,
    /// The inner publisher: run by the thread, and asked on the caller's thread to take a
    /// version without writing ([`WeightsPublisher::take_without_writing`]) when the thread is
    /// idle. Lock order: `shared.state`, then this (the caller only tries it).
    inner: Arc<Mutex<Box<dyn WeightsPublisher>>>,
    /// The inner publisher's live path, run on the caller's thread.
    live: Option<Box<dyn LiveWeightsSender>>,
    last_handed: Option<PolicyVersion>,
    thread: Option<thread::JoinHandle<()>>,
}

impl std::fmt::Debug for BackgroundPublisher {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let state = self.shared.lock();
        f.debug_struct("BackgroundPublisher")
            .field("last_handed", &self.last_handed)
            .field("confirmed", &state.confirmed)
            .field("skipped", &state.skipped)
            .finish()
    }
}

impl BackgroundPublisher {
    /// Start the publishing thread around `inner`.
    pub fn new(inner: impl WeightsPublisher + 'static) -> Result<Self, TransportError> {
        let live = inner.live_sender();
        let inner: Arc<Mutex<Box<dyn WeightsPublisher>>> = Arc::new(Mutex::new(Box::new(inner)));
        let shared = Arc::new(Shared { state: Mutex::new(State::default()), changed: Condvar::new() });
        let (thread_shared, thread_inner) = (shared.clone(), inner.clone());
        let thread = thread::Builder::new()
            .name("weights-publisher".into())
            .spawn(move || run_publisher(&thread_shared, &thread_inner))
            .map_err(|err| TransportError::Failed { operation: "start weights publisher", message: err.to_string() })?;
        Ok(BackgroundPublisher { shared, inner, live, last_handed: None, thread: Some(thread) })
    }

    /// Versions replaced by a newer one before they were published.
    pub fn skipped(&self) -> u64 {
        self.shared.lock().skipped
    }

    /// Wait until every version handed over is published and the inner publisher is flushed
    /// (its deferred writes made), or something failed, at most `timeout`.
    fn wait_flushed(&mut self, timeout: Duration) -> Result<(), TransportError> {
        let started = Instant::now();
        let mut state = self.shared.lock();
        state.asked = state.asked.max(Asked::Flush);
        self.shared.changed.notify_all();
        loop {
            if let Some(err) = state.failure.take() {
                return Err(err);
            }
            if state.settled() {
                return Ok(());
            }
            let left = timeout.saturating_sub(started.elapsed());
            if left.is_zero() {
                return Err(TransportError::Timeout { operation: "weights publish", after: timeout });
            }
            state = self.shared.changed.wait_timeout(state, left).expect("publisher lock is never poisoned").0;
        }
    }
}

impl WeightsPublisher for BackgroundPublisher {
    fn publish(&mut self, weights: Arc<Weights>) -> Result<(), TransportError> {
        if let Some(last) = self.last_handed.filter(|&last| weights.version <= last) {
            return Err(TransportError::Failed {
                operation: "weights publish",
                message: format!("version {} is not newer than {last}", weights.version),
            });
        }
        let sent_live = self.live.as_mut().and_then(|live| live.send_live(&weights));
        let mut state = self.shared.lock();
        if let Some(err) = state.failure.take() {
            return Err(err);
        }
        // With the thread idle, a version whose durable write may wait is taken here: no
        // hand-off, and no wake-up of the thread, unless the deferred write's deadline changed
        // (issue 16: a futex wake-up and a context switch per version on two busy cores).
        if let (true, Some(sent_live)) = (state.settled(), sent_live) {
            if let Ok(mut inner) = self.inner.try_lock() {
                let due = inner.deferred_until();
                if inner.take_without_writing(&weights, sent_live) {
                    state.confirmed = Some(weights.version);
                    self.last_handed = Some(weights.version);
                    if inner.deferred_until() != due {
                        self.shared.changed.notify_all();
                    }
                    return Ok(());
                }
            }
        }
        if let Some((replaced, _)) = state.pending.replace((weights.clone(), sent_live)) {
            debug!(version = replaced.version.0, "weights version replaced before it was published");
            state.skipped += 1;
        }
        self.last_handed = Some(weights.version);
        self.shared.changed.notify_all();
        Ok(())
    }

    fn is_published(&self, version: PolicyVersion) -> bool {
        let state = self.shared.lock();
        state.confirmed.is_some_and(|confirmed| confirmed >= version)
    }

    fn flush(&mut self) -> Result<(), TransportError> {
        // Far above any healthy publish; the inner publisher has its own deadlines.
        self.wait_flushed(Duration::from_secs(600))
    }

    fn flush_within(&mut self, timeout: Duration) -> Result<(), TransportError> {
        self.wait_flushed(timeout)
    }
}

/// How long dropping a [`BackgroundPublisher`] waits for its thread to publish what is pending
/// and end. A thread still retrying then (a broker that is gone: the inner publisher retries
/// for its own deadline, 30 s over NATS) is left behind, so a stopping learner exits in seconds
/// (issue 48); a caller that must know what got out calls
/// [`flush_within`](WeightsPublisher::flush_within) first.
const DROP_WAIT: Duration = Duration::from_secs(1);

impl Drop for BackgroundPublisher {
    fn drop(&mut self) {
        self.shared.lock().asked = Asked::FlushAndEnd;
        self.shared.changed.notify_all();
        if let Some(thread) = self.thread.take() {
            let started = Instant::now();
            while !thread.is_finished() && started.elapsed() < DROP_WAIT {
                thread::sleep(Duration::from_millis(10));
            }
            if thread.is_finished() {
                let _ = thread.join();
            } else {
                warn!(waited_secs = DROP_WAIT.as_secs(), "the weights publisher is still retrying; leaving it behind");
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::mpsc;

    /// Publishes into a channel, each publish waiting for a go-ahead.
    struct Gated {
        published: mpsc::Sender<u64>,
        go: Arc<(Mutex<u64>, Condvar)>,
        fail_at: Option<u64>,
    }

    impl WeightsPublisher for Gated {
        fn publish(&mut self, weights: Arc<Weights>) -> Result<(), TransportError> {
            let (lock, cvar) = &*self.go;
            let mut allowed = lock.lock().unwrap();
            while *allowed == 0 {
                allowed = cvar.wait(allowed).unwrap();
            }
            *allowed -= 1;
            if self.fail_at == Some(weights.version.0) {
                return Err(TransportError::Failed { operation: "test", message: "refused".into() });
            }
            self.published.send(weights.version.0).unwrap();
            Ok(())
        }
    }

    fn weights(version: u64) -> Arc<Weights> {
        Arc::new(Weights::new(PolicyVersion(version), 1, vec![version as f32]))
    }

    fn allow(go: &Arc<(Mutex<u64>, Condvar)>, n: u64) {
        *go.0.lock().unwrap() += n;
        go.1.notify_all();
    }

    #[test]
    fn publish_does_not_wait_and_only_the_newest_pending_version_is_published() {
        let (tx, rx) = mpsc::channel();
        let go = Arc::new((Mutex::new(0), Condvar::new()));
        let mut publisher =
            BackgroundPublisher::new(Gated { published: tx, go: go.clone(), fail_at: None }).expect("thread");
        publisher.publish(weights(0)).expect("handed over");
        // The thread holds v0 (blocked); v1 and v2 queue up, v2 replaces v1.
        while !matches!(publisher.shared.lock().doing, Doing::Publishing(_)) {
            thread::yield_now();
        }
        publisher.publish(weights(1)).expect("handed over");
        publisher.publish(weights(2)).expect("handed over");
        assert!(!publisher.is_published(PolicyVersion(0)));
        assert!(publisher.publish(weights(2)).is_err(), "versions must increase");
        allow(&go, 2);
        publisher.flush_within(Duration::from_secs(30)).expect("flushed");
        assert_eq!(rx.try_iter().collect::<Vec<_>>(), vec![0, 2]);
        assert_eq!(publisher.skipped(), 1);
        assert!(publisher.is_published(PolicyVersion(1)), "v2 covers v1");
        assert!(!publisher.is_published(PolicyVersion(3)));
    }

    #[test]
    fn a_failure_is_reported_by_the_next_call() {
        let (tx, rx) = mpsc::channel();
        let go = Arc::new((Mutex::new(10), Condvar::new()));
        let mut publisher = BackgroundPublisher::new(Gated { published: tx, go, fail_at: Some(1) }).expect("thread");
        publisher.publish(weights(0)).expect("handed over");
        publisher.flush_within(Duration::from_secs(30)).expect("v0 out");
        publisher.publish(weights(1)).expect("handed over");
        assert!(publisher.flush_within(Duration::from_secs(30)).is_err(), "v1 failed");
        publisher.publish(weights(2)).expect("the failure was reported once");
        publisher.flush().expect("v2 out");
        assert_eq!(rx.try_iter().collect::<Vec<_>>(), vec![0, 2]);
        assert!(!publisher.is_published(PolicyVersion(3)));
    }

    /// Has a live path that takes even versions only, and reports on which thread each part
    /// of a publish ran.
    struct WithLive {
        events: mpsc::Sender<(String, thread::ThreadId)>,
    }

    struct EvenLive {
        events: mpsc::Sender<(String, thread::ThreadId)>,
    }

    impl LiveWeightsSender for EvenLive {
        fn send_live(&mut self, weights: &Weights) -> Option<bool> {
            let version = weights.version.0;
            self.events.send((format!("live {version}"), thread::current().id())).unwrap();
            version.is_multiple_of(2).then_some(version != 4)
        }
    }

    impl WeightsPublisher for WithLive {
        fn publish(&mut self, weights: Arc<Weights>) -> Result<(), TransportError> {
            self.events.send((format!("publish {}", weights.version.0), thread::current().id())).unwrap();
            Ok(())
        }

        fn live_sender(&self) -> Option<Box<dyn LiveWeightsSender>> {
            Some(Box::new(EvenLive { events: self.events.clone() }))
        }

        fn publish_after_live(&mut self, weights: Arc<Weights>, sent_live: bool) -> Result<(), TransportError> {
            let event = format!("after live {} {sent_live}", weights.version.0);
            self.events.send((event, thread::current().id())).unwrap();
            Ok(())
        }
    }

    #[test]
    fn the_live_path_runs_on_the_callers_thread_and_the_rest_on_the_publishers() {
        let (tx, rx) = mpsc::channel();
        let mut publisher = BackgroundPublisher::new(WithLive { events: tx }).expect("thread");
        let caller = thread::current().id();
        for version in [2, 3, 4] {
            publisher.publish(weights(version)).expect("handed over");
            publisher.flush_within(Duration::from_secs(30)).expect("flushed");
        }
        let events: Vec<_> = rx.try_iter().collect();
        let names: Vec<_> = events.iter().map(|(name, _)| name.as_str()).collect();
        // v3: the sender leaves it to the inner publisher, which runs all of it; v4: the
        // sender failed to queue it, and the inner publisher hears so.
        assert_eq!(names, ["live 2", "after live 2 true", "live 3", "publish 3", "live 4", "after live 4 false"]);
        for (name, on) in &events {
            assert_eq!(*on == caller, name.starts_with("live"), "{name} ran on the wrong thread");
        }
        assert!(publisher.is_published(PolicyVersion(4)));
    }

    /// Defers a write of each version (as the NATS publisher defers a pointer), due `after`
    /// the publish; `flush` makes it. Reports both.
    struct Deferring {
        events: mpsc::Sender<String>,
        after: Duration,
        due: Option<(u64, Instant)>,
    }

    impl WeightsPublisher for Deferring {
        fn publish(&mut self, weights: Arc<Weights>) -> Result<(), TransportError> {
            self.due = Some((weights.version.0, Instant::now() + self.after));
            self.events.send(format!("publish {}", weights.version.0)).unwrap();
            Ok(())
        }

        fn flush(&mut self) -> Result<(), TransportError> {
            if let Some((version, _)) = self.due.take() {
                self.events.send(format!("write {version}")).unwrap();
            }
            Ok(())
        }

        fn deferred_until(&self) -> Option<Instant> {
            self.due.map(|(_, at)| at)
        }
    }

    #[test]
    fn a_deferred_write_is_made_when_due_on_flush_and_on_drop() {
        const GUARD: Duration = Duration::from_secs(30);
        let (tx, rx) = mpsc::channel();
        let after = Duration::from_millis(50);
        let mut publisher =
            BackgroundPublisher::new(Deferring { events: tx.clone(), after, due: None }).expect("thread");
        // Due: written by the thread with nothing else happening, not before its time.
        let handed = Instant::now();
        publisher.publish(weights(0)).expect("handed over");
        assert_eq!(rx.recv_timeout(GUARD).unwrap(), "publish 0");
        assert_eq!(rx.recv_timeout(GUARD).unwrap(), "write 0");
        assert!(handed.elapsed() >= after, "written {:?} after the publish", handed.elapsed());
        // A flush makes it at once; a flush with nothing deferred writes nothing.
        let mut publisher_slow =
            BackgroundPublisher::new(Deferring { events: tx.clone(), after: GUARD, due: None }).expect("thread");
        publisher_slow.publish(weights(1)).expect("handed over");
        publisher_slow.flush_within(GUARD).expect("flushed");
        assert_eq!(rx.try_iter().collect::<Vec<_>>(), vec!["publish 1", "write 1"]);
        publisher_slow.flush_within(GUARD).expect("flushed");
        assert_eq!(rx.try_iter().count(), 0);
        // Dropping the publisher makes what is deferred.
        publisher_slow.publish(weights(2)).expect("handed over");
        drop(publisher_slow);
        assert_eq!(rx.try_iter().collect::<Vec<_>>(), vec!["publish 2", "write 2"]);
        drop(publisher);
    }

    /// Sends every version live; takes odd versions without writing (as the NATS publisher
    /// takes a version whose pointer may wait), with a write due `after` the first one taken.
    /// Reports on which thread each part ran.
    struct TakesOdd {
        events: mpsc::Sender<(String, thread::ThreadId)>,
        after: Duration,
        due: Option<Instant>,
    }

    struct AllLive;

    impl LiveWeightsSender for AllLive {
        fn send_live(&mut self, _: &Weights) -> Option<bool> {
            Some(true)
        }
    }

    impl WeightsPublisher for TakesOdd {
        fn publish(&mut self, _: Arc<Weights>) -> Result<(), TransportError> {
            unreachable!("every version went out live")
        }

        fn live_sender(&self) -> Option<Box<dyn LiveWeightsSender>> {
            Some(Box::new(AllLive))
        }

        fn publish_after_live(&mut self, weights: Arc<Weights>, _: bool) -> Result<(), TransportError> {
            self.due = None;
            self.events.send((format!("after live {}", weights.version.0), thread::current().id())).unwrap();
            Ok(())
        }

        fn take_without_writing(&mut self, weights: &Arc<Weights>, _: bool) -> bool {
            let version = weights.version.0;
            if version.is_multiple_of(2) {
                return false;
            }
            self.due.get_or_insert(Instant::now() + self.after);
            self.events.send((format!("taken {version}"), thread::current().id())).unwrap();
            true
        }

        fn flush(&mut self) -> Result<(), TransportError> {
            if self.due.take().is_some() {
                self.events.send(("write".into(), thread::current().id())).unwrap();
            }
            Ok(())
        }

        fn deferred_until(&self) -> Option<Instant> {
            self.due
        }
    }

    #[test]
    fn a_version_that_needs_no_write_is_taken_on_the_callers_thread_and_its_write_made_when_due() {
        const GUARD: Duration = Duration::from_secs(30);
        let (tx, rx) = mpsc::channel();
        let after = Duration::from_millis(50);
        let mut publisher = BackgroundPublisher::new(TakesOdd { events: tx, after, due: None }).expect("thread");
        let caller = thread::current().id();
        publisher.publish(weights(0)).expect("handed over");
        publisher.flush_within(GUARD).expect("v0 out");
        // v1 and v3: taken by the caller and published at once; the thread, idle until then,
        // wakes for the write they made due and makes it in its time.
        let handed = Instant::now();
        publisher.publish(weights(1)).expect("taken");
        assert!(publisher.is_published(PolicyVersion(1)), "a version taken is published");
        publisher.publish(weights(3)).expect("taken");
        assert!(publisher.is_published(PolicyVersion(3)));
        let (name, on) = rx.recv_timeout(GUARD).unwrap();
        assert_eq!((name.as_str(), on), ("after live 0", on));
        assert_ne!(on, caller, "v0 went to the publisher's thread");
        for want in ["taken 1", "taken 3"] {
            assert_eq!(rx.recv_timeout(GUARD).unwrap(), (want.to_string(), caller));
        }
        let (name, on) = rx.recv_timeout(GUARD).unwrap();
        assert_eq!(name, "write");
        assert_ne!(on, caller, "the due write is the thread's");
        assert!(handed.elapsed() >= after, "written {:?} after v1", handed.elapsed());
        // An even version goes to the thread as before; versions must still increase.
        publisher.publish(weights(4)).expect("handed over");
        assert!(publisher.publish(weights(3)).is_err(), "versions must increase");
        publisher.flush_within(GUARD).expect("flushed");
        assert_eq!(rx.try_iter().map(|(name, _)| name).collect::<Vec<_>>(), vec!["after live 4"]);
        assert!(publisher.is_published(PolicyVersion(4)));
    }
}
