//! The follower's live path: the subscription to `volley.<run>.weights.live` and the
//! background reassembly of its chunks into frames.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use futures::StreamExt;
use tracing::{debug, warn};
use volley_core::subjects;
use volley_core::wire;

use super::pointer::full_frame_bytes;
use crate::nats::run::open_kv;
use crate::nats::{call, Shared};

/// Subscribe to the run's live weights subject and start reassembling its chunks in the
/// background; `None` (logged) when the subscription fails, e.g. a broker whose permissions
/// predate the live path: the follower then uses the pointer alone.
pub(super) fn open_live(shared: &Arc<Shared>, layout_hash: u64, n_params: usize) -> Option<LiveFeed> {
    let subject = subjects::weights_live(&shared.config.run);
    let client = shared.client.clone();
    let timeout = shared.config.request_timeout;
    let bucket = subjects::run_bucket(&shared.config.run);
    let subscribed = shared.block_on(call("subscribe to live weights", timeout, async {
        let subscriber = client.subscribe(subject).await.map_err(|err| err.to_string())?;
        // `flush` only writes the subscription out; an answered request (any answer, the
        // bucket need not exist yet) shows the server has processed it, so no version
        // published after `weights_follower` returns is missed for want of it.
        client.flush().await.map_err(|err| err.to_string())?;
        let _ = open_kv(&shared.js, &bucket, timeout).await;
        Ok::<_, String>(subscriber)
    }));
    let subscriber = match subscribed {
        Ok(subscriber) => subscriber,
        Err(err) => {
            warn!(%err, "live weights unavailable; following the pointer only, which may trail small weights by up to the learner's pointer interval");
            return None;
        }
    };
    let slot = Arc::new(LiveSlot::default());
    let max_frame = full_frame_bytes(n_params);
    let assembler = wire::live::LiveAssembler::new(layout_hash, max_frame);
    let task = shared.handle.spawn(follow_live(subscriber, assembler, slot.clone()));
    Some(LiveFeed { slot, task })
}

/// Completed live frames waiting for the follower, and what the reassembly refused.
#[derive(Debug, Default)]
pub(super) struct LiveSlot {
    /// Completed frames, oldest first, at most [`LIVE_FRAMES_KEPT`].
    pub(super) frames: Mutex<VecDeque<wire::live::LiveFrame>>,
    /// Frames completed so far: lets `latest` answer "nothing new" with one load.
    pub(super) completed: AtomicU64,
    /// Chunks refused (unreadable, corrupt, another layout, too large, inconsistent).
    pub(super) refused_chunks: AtomicU64,
    pub(super) changed: tokio::sync::Notify,
    /// A decoded frame's bytes, handed back to the reassembly task for the next version.
    pub(super) spare: Mutex<Option<Vec<u8>>>,
}

/// Completed live frames kept for the follower: the newest two, so a follower that polls
/// less often than versions arrive can still apply a version and then its child delta.
pub(super) const LIVE_FRAMES_KEPT: usize = 2;

/// The background half of the live path: its slot and reassembly task.
#[derive(Debug)]
pub(super) struct LiveFeed {
    pub(super) slot: Arc<LiveSlot>,
    pub(super) task: tokio::task::JoinHandle<()>,
}

/// Reassemble live chunks into frames until the subscription ends (async-nats re-subscribes
/// by itself after a reconnect).
async fn follow_live(
    mut subscriber: async_nats::Subscriber,
    mut assembler: wire::live::LiveAssembler,
    slot: Arc<LiveSlot>,
) {
    use wire::live::Offered;
    while let Some(message) = subscriber.next().await {
        if let Some(bytes) = slot.spare.lock().expect("live lock is never poisoned").take() {
            assembler.recycle(bytes);
        }
        if relayed(&message) {
            slot.refused_chunks.fetch_add(1, Ordering::Relaxed);
            debug!(reply = ?message.reply, "live weights message relayed by a consumer refused");
            continue;
        }
        match assembler.offer(&message.payload) {
            Offered::Complete(frame) => {
                let mut frames = slot.frames.lock().expect("live lock is never poisoned");
                if frames.len() >= LIVE_FRAMES_KEPT {
                    frames.pop_front();
                }
                frames.push_back(frame);
                drop(frames);
                slot.completed.fetch_add(1, Ordering::AcqRel);
                slot.changed.notify_waiters();
            }
            Offered::Refused(err) => {
                slot.refused_chunks.fetch_add(1, Ordering::Relaxed);
                debug!(reason = err.reason(), %err, "live weights chunk refused");
            }
            Offered::Pending | Offered::Stale => {}
        }
    }
}

/// Whether `message`, received on a subject only the learner may publish to (live weights,
/// pace notices), was not published there by a client but delivered by a JetStream consumer.
///
/// NATS checks no permission on a push consumer's deliver subject, so a user who may create
/// consumers on a stream it can write (an actor on the snapshot store) can make the server
/// deliver its own bytes on the learner's subjects (issue 46: 4 of 4 such relays reached every
/// actor). Every such delivery carries the consumer's `$JS.ACK…` reply subject, and heartbeats
/// and flow control carry a status; the learner publishes these subjects with neither, and with
/// no headers, so a message with any of them is refused.
pub(crate) fn relayed(message: &async_nats::Message) -> bool {
    message.reply.is_some() || message.headers.is_some() || message.status.is_some()
}
