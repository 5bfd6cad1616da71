//! Issue 14: the behaviour log-probability an actor records for a continuous action is the one
//! the learner re-evaluates under the same weights, squashed or not. The actor's rollout
//! (`volley_actor::RolloutWorker` on the native pendulum) and the learner's network and
//! Gaussian head on the CPU backend meet only here, in the binary crate that depends on both.

use std::sync::Arc;

use volley_actor::{ActorCounters, RolloutWorker};
use volley_core::ids::{ActorId, PolicyVersion};
use volley_core::wire::Weights;
use volley_learner::backend::{Backend, CpuBackend, Head, LogProbs, View, ViewMut};
use volley_learner::net::Network;
use volley_policy::ActionHead;
use volley_testkit::fixtures::SpecBuilder;

#[test]
fn recorded_behaviour_log_probs_equal_the_learners_for_the_same_weights() {
    const T: usize = 32;
    for (squash, normalize_obs) in [(false, false), (true, false), (false, true)] {
        let spec = SpecBuilder::pendulum(T)
            .torso(vec![16, 16])
            .head(ActionHead::Gaussian { squash })
            .normalize_obs(normalize_obs)
            .seed(5)
            .build();
        let layout = spec.validate().expect("a valid pendulum spec");
        // Non-trivial weights: a random perturbation of the initialisation, and a log-std
        // away from zero.
        let mut params = layout.init_params(3);
        for (i, p) in params.iter_mut().enumerate() {
            *p += 0.05 * ((i as f32 * 0.37).sin());
        }
        let log_std = layout.log_std_range().expect("a Gaussian layout");
        params[log_std.clone()].fill(-0.4);
        // Observation statistics far from the identity, as the learner would have published.
        if let Some(stats) = layout.obs_norm_range() {
            params[stats].copy_from_slice(&[0.1, -0.2, 1.0, 0.5, 0.5, 9.0, 100.0]);
        }
        let weights = Arc::new(Weights::new(PolicyVersion(1), layout.hash(), params.clone()));
        let counters = Arc::new(ActorCounters::default());
        let actor = ActorId::new("actor-0").expect("valid");
        let mut worker = RolloutWorker::new(spec.clone(), actor, 3, 7, counters).expect("a pendulum worker");
        worker.set_weights(weights).expect("matching weights");
        let segments = worker.collect_segments();
        assert_eq!(segments.len(), 3);

        let mut cpu = CpuBackend::new();
        let mut net = Network::new(&mut cpu, &layout).expect("a network");
        let starts = vec![0.0f32; T];
        let mut checked = 0;
        for segment in &segments {
            segment.validate(&spec, layout.hash(), 0).expect("the actor's segment validates");
            assert!(segment.actions.is_empty());
            if squash {
                assert!(segment.continuous_actions.iter().all(|a| a.abs() < 1.0));
            }
            let mut observations = segment.observations.to_f32_vec()[..T * spec.policy.obs_dim].to_vec();
            // What the trainer's staging does with the statistics in the weights.
            if let Some(stats) = layout.obs_norm_range() {
                let raw = observations.clone();
                volley_policy::obs_norm::normalize(&params[stats], &raw, &mut observations);
            }
            net.forward(
                &mut cpu,
                &params,
                View::of(&observations),
                View::of(&starts),
                View::of(&Vec::new()),
                None,
                T,
                1,
            )
            .expect("forward");
            let mut log_probs = vec![0.0f32; T];
            let head = Head { kind: spec.policy.head, params: View::range(&params, log_std.clone()) };
            cpu.log_probs(LogProbs {
                heads: net.heads(),
                n_actions: spec.policy.n_actions,
                head,
                actions: View::of(&segment.continuous_actions),
                reference: None,
                out: ViewMut::of(&mut log_probs),
            })
            .expect("log-probs");
            for (t, (&learner, &actor)) in log_probs.iter().zip(&segment.behaviour_log_probs).enumerate() {
                assert!(
                    (learner - actor).abs() <= 1e-5 * (1.0 + actor.abs()),
                    "squash {squash}, step {t}: learner {learner}, actor {actor}"
                );
                checked += 1;
            }
        }
        assert_eq!(checked, 3 * T, "squash {squash}, normalize_obs {normalize_obs}");
    }
}
