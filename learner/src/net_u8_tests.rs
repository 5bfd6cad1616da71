//! Image observations as bytes (issue 44 item 3): the first layer that reads them (a conv
//! unfolding, or a dense layer over widened bytes) has the gradients central differences give,
//! and a whole update on a batch of bytes equals the update on the same frames as `f32`.

use rand::{Rng, SeedableRng};
use rand_pcg::{Pcg64, Pcg64Mcg};
use volley_core::ids::PolicyVersion;
use volley_core::spec::{LossKind, RunSpec};
use volley_core::wire::Observations;
use volley_env::{EnvConfig, EnvServiceName, RemoteEnvConfig};
use volley_policy::{Activation, ConvInput, ConvLayerSpec, ConvSpec, ParamLayout, PolicySpec};
use volley_testkit::fixtures::SpecBuilder;

use super::test_data::random_params;
use super::*;
use crate::backend::{pack_byte_rows, packed_words, CpuBackend};
use crate::batch::SegmentBatch;
use crate::Learner;

/// A conv torso reading pixels (scale 1/255) whose images are not a whole number of words
/// (3·5·5 = 75 bytes, so the packed rows carry padding), with padding and stride; and a dense
/// first layer over 7 bytes per row.
fn byte_specs() -> Vec<PolicySpec> {
    let layer = |out_channels, kernel, stride, padding| ConvLayerSpec { out_channels, kernel, stride, padding };
    let pixels = ConvSpec {
        in_channels: 3,
        height: 5,
        width: 5,
        layers: vec![layer(4, 3, 2, 1), layer(3, 2, 1, 0)],
        input: ConvInput::Pixels,
    };
    vec![PolicySpec::mlp(0, 3, &[6], Activation::Tanh).with_conv(pixels), PolicySpec::mlp(7, 3, &[5], Activation::Tanh)]
}

/// `Σ c ⊙ heads` of a forward over `packed` bytes, and the network after it.
fn loss(
    net: &mut Network<CpuBackend>,
    cpu: &mut CpuBackend,
    params: &Vec<f32>,
    packed: &Vec<f32>,
    scale: f32,
    rows: usize,
    c: &[f32],
) -> f64 {
    let starts = vec![0.0; rows];
    let input = Input::U8 { packed: View::of(packed), scale };
    net.forward(cpu, params, input, View::of(&starts), View::of(&Vec::new()), None, rows, 1).expect("forward");
    let (heads, range) = net.heads().parts();
    heads[range].iter().zip(c).map(|(&h, &c)| f64::from(h) * f64::from(c)).sum()
}

/// The first layer over bytes (conv and dense): every weight's gradient matches central
/// differences (the input has none), equals the gradient of the `f32` path over the scaled
/// values bit for bit, and the check would catch a 3 % error in the first layer's largest one.
#[test]
fn first_layer_over_bytes_has_the_gradients_of_finite_differences() {
    for spec in byte_specs() {
        let layout = ParamLayout::new(&spec).expect("valid spec");
        let mut rng = Pcg64::seed_from_u64(21);
        let params = random_params(&layout, &mut rng);
        let (rows, obs_dim, scale) = (6, spec.obs_dim, layout.input_scale());
        let top = if spec.conv.is_some() { 256 } else { 4 };
        let bytes: Vec<u8> = (0..rows * obs_dim).map(|_| rng.random_range(0..top) as u8).collect();
        let mut packed = vec![0.0; rows * packed_words(obs_dim)];
        pack_byte_rows(&bytes, obs_dim, &mut packed);
        let c: Vec<f32> = (0..rows * (spec.n_actions + 1)).map(|_| rng.random_range(-4.0..4.0)).collect();
        let mut cpu = CpuBackend::new();
        let mut net = Network::new(&mut cpu, &layout).expect("network");
        loss(&mut net, &mut cpu, &params, &packed, scale, rows, &c);
        let starts = vec![0.0; rows];
        let mut analytic = vec![f32::NAN; params.len()];
        let input = Input::U8 { packed: View::of(&packed), scale };
        net.backward(&mut cpu, &params, View::of(&c), input, View::of(&starts), &mut analytic).expect("backward");

        // The f32 path over the values the first layer reads.
        let floats: Vec<f32> = bytes.iter().map(|&b| f32::from(b) * scale).collect();
        let mut reference = Network::new(&mut cpu, &layout).expect("network");
        let (obs, starts_view) = (View::of(&floats), View::of(&starts));
        reference.forward(&mut cpu, &params, obs, starts_view, View::of(&Vec::new()), None, rows, 1).expect("forward");
        let mut expected = vec![f32::NAN; params.len()];
        reference.backward(&mut cpu, &params, View::of(&c), obs, starts_view, &mut expected).expect("backward");
        let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
        assert_eq!(bits(&analytic), bits(&expected), "{spec:?}: the f32 path's gradient");

        let first = if spec.conv.is_some() { "conv.0.weight" } else { "torso.0.weight" };
        let entry = layout.entry(first).expect("a first layer");
        let mut perturbed = params.clone();
        let mut largest = (0, 0.0f64);
        for idx in entry.range() {
            let p = params[idx];
            let eps = 1e-3 * p.abs().max(1.0);
            perturbed[idx] = p + eps;
            let plus = loss(&mut net, &mut cpu, &perturbed, &packed, scale, rows, &c);
            perturbed[idx] = p - eps;
            let minus = loss(&mut net, &mut cpu, &perturbed, &packed, scale, rows, &c);
            perturbed[idx] = p;
            let numeric = (plus - minus) / (f64::from(p + eps) - f64::from(p - eps));
            let a = f64::from(analytic[idx]);
            assert!(
                (a - numeric).abs() <= 2e-3 + 1e-2 * a.abs().max(numeric.abs()),
                "{spec:?} {first}[{}]: analytic {a} numeric {numeric}",
                idx - entry.offset
            );
            if numeric.abs() > largest.1.abs() {
                largest = (idx, numeric);
            }
        }
        let (idx, g) = largest;
        assert!(g.abs() > 0.02, "{spec:?}: gradient {g} too small to check");
        let off = f64::from(analytic[idx]) + 0.03 * g.abs() + 6e-3;
        assert!((off - g).abs() > 2e-3 + 1e-2 * off.abs().max(g.abs()), "{spec:?}: the check is not sensitive");
    }
}

/// A run spec for `policy` over a declared remote environment of its width (never contacted).
fn run_spec(policy: PolicySpec, loss: LossKind, t_len: usize, b_len: usize) -> RunSpec {
    let service = EnvServiceName::new("frames").expect("valid service name");
    let env = EnvConfig::Remote(RemoteEnvConfig::new(service, policy.obs_dim, policy.n_actions));
    SpecBuilder::new(env, policy, t_len).run("bytes").training(loss, b_len, 1e-3).ppo(2, 2).seed(3).build()
}

/// A batch of `bytes` observations (`[T + 1][B][obs_dim]`) held as `observations`.
fn batch(rng: &mut Pcg64Mcg, spec: &RunSpec, observations: Observations) -> SegmentBatch {
    let (t_len, b_len, n_actions) = (spec.segment_len, spec.hyper.batch_segments, spec.policy.n_actions);
    let steps = t_len * b_len;
    SegmentBatch {
        t_len,
        b_len,
        obs_dim: spec.policy.obs_dim,
        observations,
        episode_start: (0..(t_len + 1) * b_len).map(|i| if i % 7 == 5 { 1.0 } else { 0.0 }).collect(),
        actions: (0..steps).map(|_| rng.random_range(0..n_actions as u32)).collect(),
        behaviour_log_probs: (0..steps).map(|_| -(n_actions as f32).ln() + rng.random_range(-0.3..0.3)).collect(),
        rewards: (0..steps).map(|_| rng.random_range(-1.0..1.0)).collect(),
        discounts: (0..steps).map(|i| if i % 7 == 4 { 0.0 } else { 0.99 }).collect(),
        sample_weights: vec![1.0; steps],
        policy_versions: vec![PolicyVersion(0); b_len],
        ..SegmentBatch::default()
    }
}

/// Issue 44 item 3: two whole updates (V-trace, and PPO with shuffled minibatches gathered from
/// the packed bytes) on a batch of byte frames leave the parameters bit for bit where the same
/// updates on the frames as `f32` leave them: for the Nature network on pixels, MinAtar's
/// network on planes, and a dense first layer with and without observation normalisation
/// (which widens bytes before it normalises).
#[test]
fn an_update_on_byte_frames_equals_the_update_on_their_float_values() {
    let policies = [
        PolicySpec::mlp(0, 4, &[32], Activation::Relu)
            .with_conv(ConvSpec { input: ConvInput::Pixels, ..ConvSpec::nature(2, 36, 36) }),
        PolicySpec::mlp(0, 6, &[128], Activation::Relu).with_conv(ConvSpec::minatar(4, 10, 10)),
        PolicySpec::mlp(75, 3, &[16], Activation::Tanh),
        PolicySpec::mlp(75, 3, &[16], Activation::Tanh).with_obs_normalization(true),
    ];
    for policy in policies {
        for loss in [LossKind::Vtrace, LossKind::Ppo] {
            let spec = run_spec(policy.clone(), loss, 5, 4);
            let top = if policy.conv.as_ref().is_some_and(|c| c.input == ConvInput::Pixels) { 256 } else { 2 };
            let mut rng = Pcg64Mcg::seed_from_u64(8);
            let len = (spec.segment_len + 1) * spec.hyper.batch_segments * policy.obs_dim;
            let bytes: Vec<u8> = (0..len).map(|_| rng.random_range(0..top) as u8).collect();
            let floats = Observations::F32(bytes.iter().map(|&b| f32::from(b)).collect());
            let run = |observations: Observations| {
                let mut learner = Learner::new(spec.clone()).expect("valid spec");
                let batch = batch(&mut Pcg64Mcg::seed_from_u64(9), &spec, observations);
                for _ in 0..2 {
                    let stats = learner.update(&batch);
                    assert!(stats.loss.total.is_finite(), "{policy:?} {loss:?}: {stats:?}");
                }
                learner.params().to_vec()
            };
            let (from_bytes, from_floats) = (run(Observations::U8(bytes.clone())), run(floats));
            let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
            assert_eq!(bits(&from_bytes), bits(&from_floats), "{policy:?} {loss:?}");
            let initial = Learner::new(spec.clone()).expect("valid spec").params().to_vec();
            assert_ne!(from_bytes, initial, "the updates moved the parameters");
        }
    }
}
