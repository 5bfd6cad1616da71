//! Issue 14: observation normalisation. The learner moves the running statistics with every
//! batch it trains on and writes them into the parameters it publishes, so the actors' next
//! version normalises with exactly the statistics the learner used.

use rand::{Rng, SeedableRng};
use rand_pcg::Pcg64Mcg;
use volley_core::spec::{HyperParams, LossKind};
use volley_learner::batch::SegmentBatch;
use volley_learner::Learner;
use volley_policy::obs_norm;
use volley_testkit::fixtures::{SegmentBuilder, SpecBuilder};

#[test]
fn statistics_follow_the_batches_and_travel_in_the_parameters() {
    const T: usize = 16;
    const B: usize = 4;
    for loss in [LossKind::Ppo, LossKind::Vtrace] {
        let hyper = HyperParams { loss, batch_segments: B, ppo_minibatches: 2, ..HyperParams::default() };
        let spec = SpecBuilder::pendulum(T).run("obsnorm").normalize_obs(true).hyper(hyper).build();
        let mut learner = Learner::new(spec.clone()).expect("a valid spec");
        let range = learner.layout().obs_norm_range().expect("statistics in the layout");
        let mut expected = learner.params()[range.clone()].to_vec();
        assert_eq!(expected, [0.0, 0.0, 0.0, 1.0, 1.0, 1.0, 0.0], "fresh statistics: zero mean, unit variance");
        let mut rng = Pcg64Mcg::seed_from_u64(9);
        for update in 0..3 {
            // Observations far from zero mean and unit scale (pendulum's angular velocity is ±8).
            let segments: Vec<_> = (0..B)
                .map(|_| {
                    SegmentBuilder::for_spec(&spec)
                        .observations_from(|i| {
                            [0.5, -0.3, 4.0][i % 3] + rng.random_range(-1.0..1.0) * [0.2, 0.2, 4.0][i % 3]
                        })
                        .continuous_actions_from(|_| rng.random_range(-2.0..2.0))
                        .log_prob(-1.0)
                        .build()
                })
                .collect();
            let batch = SegmentBatch::from_segments(&segments, 0.9, 0.1, &[1.0; B]);
            let stats = learner.update(&batch);
            assert!(stats.loss.total.is_finite() && stats.grad_norm.is_finite(), "update {update}: {stats:?}");
            obs_norm::update(&mut expected, &batch.observations.to_f32_vec());
            let params = learner.params().to_vec();
            assert_eq!(params[range.clone()], expected[..], "update {update}: the published statistics");
        }
        assert!((expected[2] - 4.0).abs() < 0.5 && expected[5] > 2.0, "the statistics moved: {expected:?}");
        // A checkpoint carries them, and a learner restored from it continues from them.
        let checkpoint = learner.checkpoint(0);
        let restored = Learner::from_checkpoint(spec.clone(), checkpoint, std::path::Path::new("memory"));
        let mut restored = restored.expect("the checkpoint restores");
        assert_eq!(restored.params()[range.clone()], expected[..]);
    }
}
