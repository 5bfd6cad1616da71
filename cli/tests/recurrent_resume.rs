//! Issue 18, item 3: a recurrent policy's recorded behaviour log-probabilities are the ones the
//! learner re-evaluates under the same weights, also where an episode resumed from a saved
//! recurrent state in the middle of a segment (no wait for the next segment boundary), and
//! across the segment boundaries of a stitched BPTT window. The actor's rollout and the
//! learner's batch and network on the CPU backend meet only here, in the binary crate that
//! depends on both.

use std::sync::Arc;

use volley_actor::{ActorCounters, RolloutWorker};
use volley_core::ids::{ActorId, PolicyVersion};
use volley_core::spec::RunSpec;
use volley_core::wire::{TrajectorySegment, Weights};
use volley_core::work::{Start, WorkConfig, WorkItem};
use volley_env::{EnvConfig, MemoryConfig};
use volley_learner::backend::{Backend, CpuBackend, Head, LogProbs, View, ViewMut};
use volley_learner::batch::SegmentBatch;
use volley_learner::net::Network;
use volley_policy::{CoreKind, ParamLayout};
use volley_testkit::fixtures::SpecBuilder;
use volley_transport::work::{local_work_queue, LocalSnapshotStore, WorkQueue};

const T: usize = 16;

/// Memory with 2 cues and delay 6 (episodes of 8 steps), a GRU, scheduled episodes that save a
/// snapshot every 3 steps.
fn spec() -> RunSpec {
    let memory = MemoryConfig { n_cues: 2, delay: 6 };
    let mut spec = SpecBuilder::cartpole(T)
        .env(EnvConfig::Memory(memory), 3, 2)
        .torso(vec![16])
        .core(CoreKind::Gru { hidden: 8 })
        .seed(3)
        .build();
    spec.hyper.work =
        WorkConfig { enabled: true, snapshot_every_steps: 3, snapshot_at_milestones: false, ..WorkConfig::default() };
    spec
}

fn worker(
    spec: &RunSpec,
    layout: &ParamLayout,
    params: &[f32],
    items: &[WorkItem],
    store: &LocalSnapshotStore,
) -> RolloutWorker {
    let (mut queue, source) = local_work_queue();
    queue.submit(items).expect("in-process queue");
    let actor = ActorId::new("resume-0").expect("valid");
    let mut worker = RolloutWorker::new(spec.clone(), actor, 1, 5, Arc::new(ActorCounters::default()))
        .expect("a memory worker")
        .with_work(Box::new(source), Box::new(store.clone()))
        .expect("work enabled");
    worker.set_weights(Arc::new(Weights::new(PolicyVersion(1), layout.hash(), params.to_vec()))).expect("weights");
    worker
}

/// The learner's log π(a_t | x_t) of every step of `batch` (the batch's own restores applied
/// unless `ignore_restores`).
fn learner_log_probs(layout: &ParamLayout, params: &[f32], batch: &SegmentBatch, ignore_restores: bool) -> Vec<f32> {
    let (t_len, b_len) = (batch.t_len, batch.b_len);
    let n = t_len * b_len;
    let mut cpu = CpuBackend::new();
    let mut net = Network::new(&mut cpu, layout).expect("a network");
    let obs = &batch.observations.to_f32_vec()[..n * batch.obs_dim];
    let starts = &batch.episode_start[..n];
    let restores = if ignore_restores { &[][..] } else { &batch.restores[..] };
    net.forward_restoring(
        &mut cpu,
        &params.to_vec(),
        View::of(&obs.to_vec()),
        View::of(&starts.to_vec()),
        View::of(&batch.initial_hidden),
        restores,
        View::of(&batch.restore_states),
        t_len,
        b_len,
    )
    .expect("forward");
    let actions: Vec<f32> = batch.actions.iter().map(|&a| f32::from_bits(a)).collect();
    let mut log_probs = vec![0.0f32; n];
    let no_params = Vec::new();
    let head = Head { kind: layout.head(), params: View::of(&no_params) };
    let (n_actions, actions, out) = (layout.spec().n_actions, View::of(&actions), ViewMut::of(&mut log_probs));
    cpu.log_probs(LogProbs { heads: net.heads(), n_actions, head, actions, reference: None, out }).expect("log-probs");
    log_probs
}

fn max_error(learner: &[f32], actor: &[f32]) -> f32 {
    learner.iter().zip(actor).map(|(l, a)| (l - a).abs() / (1.0 + a.abs())).fold(0.0, f32::max)
}

#[test]
fn an_episode_resumed_mid_segment_is_re_evaluated_from_its_restored_state() {
    let spec = spec();
    let layout = spec.validate().expect("a valid memory spec");
    let mut params = layout.init_params(3);
    for (i, p) in params.iter_mut().enumerate() {
        *p += 0.1 * ((i as f32 * 0.37).sin());
    }
    // Actor A runs one fresh episode and saves its state every 3 steps.
    let store = LocalSnapshotStore::new(100);
    let fresh = WorkItem { id: 1, task_id: 0, start: Start::Fresh { seed: 11 }, episodes: 1, group: None };
    let saved = worker(&spec, &layout, &params, &[fresh], &store).collect_segments().remove(0).saved_snapshots;
    let key = saved.first().expect("a snapshot after 3 steps").key.clone();

    // Actor B runs a fresh 8-step episode, then resumes A's saved state at once, at step 8.
    let items = [
        WorkItem { id: 2, task_id: 0, start: Start::Fresh { seed: 12 }, episodes: 1, group: None },
        WorkItem { id: 3, task_id: 0, start: Start::Resume { snapshot: key }, episodes: 1, group: None },
    ];
    let mut b = worker(&spec, &layout, &params, &items, &store);
    let segments: Vec<TrajectorySegment> = (0..2).map(|_| b.collect_segments().remove(0)).collect();
    let first = &segments[0];
    first.validate(&spec, layout.hash(), 8).expect("the actor's segment validates");
    assert_eq!(first.restored_states.len(), 1, "one resumed episode: {:?}", first.restored_states);
    let restored = &first.restored_states[0];
    assert_eq!(restored.step, 8, "resumed right after the fresh episode ended, mid-segment");
    assert!(restored.hidden.iter().any(|&h| h != 0.0), "a non-zero saved state");

    // One segment per column: the learner starts step 8 from the restored state.
    let mut batch = SegmentBatch::default();
    batch.fill(&[first], 0.99, 1.0, &[1.0]);
    let learner = learner_log_probs(&layout, &params, &batch, false);
    let error = max_error(&learner, &first.behaviour_log_probs);
    assert!(error <= 1e-5, "learner and actor log-probs differ by {error}");
    // The test can fail: from zero state, as the learner did before, step 8 on differs.
    let zeroed = learner_log_probs(&layout, &params, &batch, true);
    assert!(max_error(&zeroed[8..], &first.behaviour_log_probs[8..]) > 1e-4, "the restored state matters");

    // Both segments stitched into one window of 2·T steps: the state carried across the
    // boundary by the learner is the actor's.
    let mut window = SegmentBatch::default();
    window.fill_windows(&[segments.as_slice()], 2, 0.99, 1.0, &[1.0]);
    assert_eq!((window.t_len, window.b_len), (2 * T, 1));
    let learner = learner_log_probs(&layout, &params, &window, false);
    let actor: Vec<f32> = segments.iter().flat_map(|s| s.behaviour_log_probs.iter().copied()).collect();
    let error = max_error(&learner, &actor);
    assert!(error <= 1e-5, "stitched window: learner and actor log-probs differ by {error}");
}
