//! Fixtures shared by the NATS integration tests, built with `volley_testkit::fixtures`.

use volley_core::spec::RunSpec;
use volley_core::wire::TrajectorySegment;
use volley_testkit::fixtures::{SegmentBuilder, SpecBuilder};

/// A small CartPole run spec for `run`.
pub fn spec(run: &str) -> RunSpec {
    SpecBuilder::cartpole(4).run(run).seed(7).build()
}

/// A one-step segment whose observations carry its index (not valid against a spec: the
/// transport does not validate, the learner does).
pub fn segment(run: &str, actor: &str, env_idx: u32, segment_idx: u64) -> TrajectorySegment {
    SegmentBuilder::new(1, 1)
        .run(run)
        .actor(actor)
        .env_idx(env_idx)
        .segment_idx(segment_idx)
        .observations_from(|_| segment_idx as f32)
        .log_prob(-0.5)
        .build()
}
