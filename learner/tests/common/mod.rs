//! Helpers the learner's integration tests share: a CartPole segment whose one episode ends at
//! its last step, and the learner loop run to its end with a stop flag nobody sets.

#![allow(dead_code)] // Each test file uses its own subset.

use std::sync::atomic::AtomicBool;

use volley_core::spec::RunSpec;
use volley_core::wire::TrajectorySegment;
use volley_learner::{run_learner, Learner, LearnerControl, LearnerReport, RunLimits};
use volley_testkit::fixtures::SegmentBuilder;
use volley_transport::{TrajectorySource, WeightsPublisher};

/// A CartPole segment of `actor` (index `idx`) under `spec`, with small varying observations,
/// alternating actions, and one episode that ends at the last step with `episode_return` over
/// `episode_len` steps (the steps before the segment are the actor's claim).
pub fn ended_episode_segment(
    spec: &RunSpec,
    actor: &str,
    idx: u64,
    episode_return: f32,
    episode_len: u32,
) -> TrajectorySegment {
    let t_len = spec.segment_len;
    SegmentBuilder::for_spec(spec)
        .actor(actor)
        .episode_id(idx)
        .segment_idx(idx)
        .observations_from(|i| (i as f32 * 0.37).sin() * 0.1)
        .actions((0..t_len).map(|t| (t % 2) as u32).collect())
        .terminal_at(t_len - 1)
        .episode(episode_return, episode_len)
        .build()
}

/// [`run_learner`] until `limits` or the source stop it.
///
/// # Panics
/// If the loop fails (a transport error: none of these tests expects one).
pub fn run_to_end(
    learner: &mut Learner,
    source: &mut dyn TrajectorySource,
    publisher: &mut dyn WeightsPublisher,
    limits: &RunLimits,
    control: &mut dyn LearnerControl,
) -> LearnerReport {
    run_learner(learner, source, publisher, limits, &AtomicBool::new(false), control).expect("learner loop")
}
