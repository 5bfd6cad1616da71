//! Fixtures shared by the NATS integration tests, built with `volley_testkit::fixtures`.

use volley_core::spec::{HyperParams, RunSpec, StoreLimits};
use volley_core::wire::TrajectorySegment;
use volley_testkit::fixtures::{SegmentBuilder, SpecBuilder};

/// A small CartPole run spec for `run`, with small store bounds: JetStream reserves every
/// stream's `max_bytes` when it is created, and a test broker may use at most 75 % of the free
/// disk, which the defaults (about 7 GB in all with work items) can exceed on a full machine.
pub fn spec(run: &str) -> RunSpec {
    let stores = StoreLimits {
        trajectory_max_bytes: 64 << 20,
        weights_max_bytes: 128 << 20,
        kv_max_bytes: 16 << 20,
        work_max_bytes: 16 << 20,
        snapshot_max_bytes: 64 << 20,
        snapshot_index_max_bytes: 16 << 20,
        ..StoreLimits::default()
    };
    SpecBuilder::cartpole(4).run(run).hyper(HyperParams { stores, ..HyperParams::default() }).seed(7).build()
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
