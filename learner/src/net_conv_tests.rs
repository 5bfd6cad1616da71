//! The conv torso in the generic network: finite-difference gradient checks of every conv
//! parameter (with strides, padding, both input layouts, with and without a dense torso and a
//! GRU), and agreement of the learner's forward with the actors' `PolicyInference`.

use rand::SeedableRng;
use rand_pcg::Pcg64;
use volley_policy::{Activation, ConvLayerSpec, ConvSpec, ParamLayout, PolicyInference, PolicySpec};

use super::test_data::{random, random_params};
use super::*;
use crate::backend::CpuBackend;

fn layer(out_channels: usize, kernel: usize, stride: usize, padding: usize) -> ConvLayerSpec {
    ConvLayerSpec { out_channels, kernel, stride, padding }
}

/// Small conv specs that between them exercise stride > 1, padding, a channel-last second
/// layer, an empty dense torso, and a GRU reading the conv features directly.
fn conv_specs() -> Vec<PolicySpec> {
    let two_layers = ConvSpec {
        in_channels: 2,
        height: 6,
        width: 5,
        layers: vec![layer(3, 3, 1, 1), layer(4, 3, 2, 0)],
        input: Default::default(),
    };
    let strided =
        ConvSpec { in_channels: 3, height: 5, width: 5, layers: vec![layer(4, 3, 2, 1)], input: Default::default() };
    vec![
        PolicySpec::mlp(0, 3, &[6], Activation::Tanh).with_conv(two_layers.clone()),
        PolicySpec::mlp(0, 3, &[], Activation::Relu).with_conv(strided.clone()),
        PolicySpec::gru(0, 2, &[], Activation::Tanh, 4).with_conv(strided),
        PolicySpec::gru(0, 2, &[5], Activation::Relu, 3).with_conv(two_layers),
    ]
}

struct Case {
    layout: ParamLayout,
    t_len: usize,
    b_len: usize,
    obs: Vec<f32>,
    starts: Vec<f32>,
    h0: Vec<f32>,
    /// The loss is `Σ c ⊙ heads`, so `∂L/∂heads = c`.
    c: Vec<f32>,
}

impl Case {
    fn new(spec: &PolicySpec, rng: &mut Pcg64) -> Self {
        let layout = ParamLayout::new(spec).expect("valid spec");
        let (t_len, b_len) = (3, 2);
        let rows = t_len * b_len;
        let mut starts = vec![0.0; rows];
        starts[b_len + 1] = 1.0;
        Case {
            t_len,
            b_len,
            obs: random(rng, rows * spec.obs_dim, 1.0),
            starts,
            h0: random(rng, b_len * layout.recurrent_size(), 0.8),
            c: random(rng, rows * (spec.n_actions + 1), 4.0),
            layout,
        }
    }

    fn forward(&self, net: &mut Network<CpuBackend>, cpu: &mut CpuBackend, params: &Vec<f32>) {
        let (obs, starts, h0) = (View::of(&self.obs), View::of(&self.starts), View::of(&self.h0));
        net.forward(cpu, params, obs, starts, h0, None, self.t_len, self.b_len).expect("forward");
    }

    fn loss(&self, net: &mut Network<CpuBackend>, cpu: &mut CpuBackend, params: &Vec<f32>) -> f64 {
        self.forward(net, cpu, params);
        let (heads, range) = net.heads().parts();
        heads[range].iter().zip(&self.c).map(|(&h, &c)| f64::from(h) * f64::from(c)).sum()
    }
}

/// Which ReLU units (conv layers, and a ReLU dense torso) are active: a central difference that
/// flips one is not a derivative.
fn relu_pattern(net: &Network<CpuBackend>) -> Vec<bool> {
    let torso = if net.shape.activation == Activation::Relu { &net.torso_out[..] } else { &[] };
    net.conv_out.iter().chain(torso).flat_map(|out| out.iter().map(|&y| y > 0.0)).collect()
}

const GRAD_ATOL: f64 = 2e-3;
const GRAD_RTOL: f64 = 1e-2;

fn mismatch(analytic: f32, numeric: f64) -> bool {
    let a = f64::from(analytic);
    (a - numeric).abs() > GRAD_ATOL + GRAD_RTOL * a.abs().max(numeric.abs())
}

/// Every parameter of every conv spec (conv weights and biases included) has the gradient
/// that central differences give, and the check catches a 3 % error in each entry's largest
/// gradient (so it cannot pass vacuously).
#[test]
fn conv_network_gradients_match_finite_differences() {
    check_gradients(CpuBackend::new);
}

/// The same check with every product on the `gemm` crate's kernels on one thread (issue 44:
/// the path a one-thread learner takes for conv-sized layers, weight gradients included).
#[test]
fn large_path_conv_network_gradients_match_finite_differences() {
    check_gradients(|| CpuBackend::new().with_large_threshold(0));
}

/// The same check on the threaded path (issue 44): three threads, and every product, `im2col`
/// and `col2im` sent to the large path (the `gemm` crate over the pool, weight gradients split
/// over the rows, images split over the threads), which the small specs here would otherwise
/// never reach.
#[test]
fn threaded_conv_network_gradients_match_finite_differences() {
    check_gradients(|| CpuBackend::with_threads(3).expect("a pool").with_large_threshold(0));
}

/// The learner's forward and backward on the threaded large path equal the single-threaded
/// ones to rounding, on a batch wide enough that every thread gets rows and images.
#[test]
fn threaded_backend_matches_one_thread() {
    let spec = PolicySpec::mlp(0, 4, &[32], Activation::Relu).with_conv(ConvSpec::nature(2, 36, 36));
    let layout = ParamLayout::new(&spec).expect("valid spec");
    let mut rng = Pcg64::seed_from_u64(44);
    let params = random_params(&layout, &mut rng);
    let (t_len, b_len) = (5, 3);
    let rows = t_len * b_len;
    let obs = random(&mut rng, rows * spec.obs_dim, 1.0);
    let starts = vec![0.0; rows];
    let d_heads = random(&mut rng, rows * (spec.n_actions + 1), 1.0);
    let run = |mut cpu: CpuBackend| {
        let mut net = Network::new(&mut cpu, &layout).expect("network");
        let (obs, starts) = (View::of(&obs), View::of(&starts));
        net.forward(&mut cpu, &params, obs, starts, View::of(&Vec::new()), None, t_len, b_len).expect("forward");
        let (heads, range) = net.heads().parts();
        let heads = heads[range].to_vec();
        let mut grads = vec![f32::NAN; params.len()];
        net.backward(&mut cpu, &params, View::of(&d_heads), obs, starts, &mut grads).expect("backward");
        (heads, grads)
    };
    let (heads_1, grads_1) = run(CpuBackend::new());
    for threads in [2, 3] {
        let (heads_n, grads_n) = run(CpuBackend::with_threads(threads).expect("a pool").with_large_threshold(0));
        for (i, (a, b)) in heads_1.iter().zip(&heads_n).enumerate() {
            assert!((a - b).abs() <= 1e-4 * (1.0 + a.abs()), "{threads} threads, head {i}: {a} vs {b}");
        }
        for (i, (a, b)) in grads_1.iter().zip(&grads_n).enumerate() {
            assert!((a - b).abs() <= 1e-3 * (1.0 + a.abs()), "{threads} threads, gradient {i}: {a} vs {b}");
        }
    }
}

/// Issue 44: the forward's unfoldings kept for the backward give the gradients of unfolding
/// again, bit for bit, whether none, the last layer's or every layer's is kept, and a second
/// backward after the same forward gives them again (the backward leaves what it keeps intact).
#[test]
fn kept_and_recomputed_unfoldings_give_the_same_gradients() {
    let nature = PolicySpec::mlp(0, 4, &[32], Activation::Relu).with_conv(ConvSpec::nature(2, 36, 36));
    for spec in conv_specs().into_iter().chain([nature]) {
        let mut rng = Pcg64::seed_from_u64(12);
        let case = Case::new(&spec, &mut rng);
        let params = random_params(&case.layout, &mut rng);
        let rows = case.t_len * case.b_len;
        let last_layer_bytes = rows * case.layout.conv_geometries().last().expect("a conv torso").cols_len() * 4;
        let gradients = |budget: usize| {
            let mut cpu = CpuBackend::new();
            let mut net = Network::new(&mut cpu, &case.layout).expect("network").with_kept_unfoldings_bytes(budget);
            assert_eq!(
                net.shape.first_kept_unfolding(rows, budget),
                match budget {
                    0 => net.shape.conv.len(),
                    usize::MAX => 0,
                    _ => net.shape.conv.len() - 1,
                }
            );
            case.forward(&mut net, &mut cpu, &params);
            let (obs, starts) = (View::of(&case.obs), View::of(&case.starts));
            let mut runs = [vec![f32::NAN; params.len()], vec![f32::NAN; params.len()]];
            for grads in &mut runs {
                net.backward(&mut cpu, &params, View::of(&case.c), obs, starts, grads).expect("backward");
            }
            runs.map(|grads| grads.iter().map(|g| g.to_bits()).collect::<Vec<_>>())
        };
        let [recomputed, again] = gradients(0);
        assert_eq!(recomputed, again, "{spec:?}: a second backward without keeping");
        for budget in [last_layer_bytes, usize::MAX] {
            let [kept, again] = gradients(budget);
            assert_eq!(kept, recomputed, "{spec:?}: keeping {budget} bytes");
            assert_eq!(again, recomputed, "{spec:?}: a second backward keeping {budget} bytes");
        }
    }
}

fn check_gradients(backend: impl Fn() -> CpuBackend) {
    for spec in conv_specs() {
        let mut rng = Pcg64::seed_from_u64(11);
        let case = Case::new(&spec, &mut rng);
        let layout = &case.layout;
        let params = random_params(layout, &mut rng);
        let mut cpu = backend();
        let mut net = Network::new(&mut cpu, layout).expect("network");
        case.forward(&mut net, &mut cpu, &params);
        let base_pattern = relu_pattern(&net);
        let mut analytic = vec![f32::NAN; params.len()];
        let (obs, starts) = (View::of(&case.obs), View::of(&case.starts));
        net.backward(&mut cpu, &params, View::of(&case.c), obs, starts, &mut analytic).expect("backward");

        let mut perturbed = params.clone();
        let mut numeric = vec![None; params.len()];
        for (idx, slot) in numeric.iter_mut().enumerate() {
            let p = params[idx];
            let eps = 1e-3 * p.abs().max(1.0);
            perturbed[idx] = p + eps;
            let plus = case.loss(&mut net, &mut cpu, &perturbed);
            let kink_plus = relu_pattern(&net) != base_pattern;
            perturbed[idx] = p - eps;
            let minus = case.loss(&mut net, &mut cpu, &perturbed);
            let kink_minus = relu_pattern(&net) != base_pattern;
            perturbed[idx] = p;
            let step = f64::from(p + eps) - f64::from(p - eps);
            *slot = (!(kink_plus || kink_minus)).then(|| (plus - minus) / step);
        }
        let skipped = numeric.iter().filter(|n| n.is_none()).count();
        assert!(skipped * 10 <= numeric.len(), "{spec:?}: {skipped} of {} straddle a kink", numeric.len());
        for entry in layout.entries() {
            for idx in entry.range() {
                if let Some(n) = numeric[idx] {
                    assert!(
                        !mismatch(analytic[idx], n),
                        "{spec:?} {}[{}]: analytic {} numeric {n}",
                        entry.name,
                        idx - entry.offset,
                        analytic[idx]
                    );
                }
            }
            let (idx, g) = entry
                .range()
                .filter_map(|idx| numeric[idx].map(|n| (idx, n)))
                .max_by(|a, b| a.1.abs().total_cmp(&b.1.abs()))
                .expect("the entry has a checkable parameter");
            assert!(g.abs() > 10.0 * GRAD_ATOL, "{}: gradient {g} too small to check", entry.name);
            assert!(
                mismatch(analytic[idx] + (0.03 * g.abs() + 3.0 * GRAD_ATOL) as f32, g),
                "{} not sensitive",
                entry.name
            );
        }
        assert!(layout.entries().iter().any(|e| e.name == "conv.0.weight"));
    }
}

/// The actors' one-step `PolicyInference` and the learner's network compute the same logits,
/// values and recurrent state for conv specs (the MinAtar preset included), to rounding.
#[test]
fn actor_inference_matches_the_learner_forward_for_conv_torsos() {
    let mut specs = conv_specs();
    specs.push(PolicySpec::mlp(0, 6, &[128], Activation::Relu).with_conv(ConvSpec::minatar(4, 10, 10)));
    specs.push(PolicySpec::mlp(0, 4, &[32], Activation::Relu).with_conv(ConvSpec::nature(2, 36, 36)));
    for spec in specs {
        let mut rng = Pcg64::seed_from_u64(5);
        let layout = ParamLayout::new(&spec).expect("valid spec");
        let params = random_params(&layout, &mut rng);
        let n = 5;
        let hidden = layout.recurrent_size();
        let obs = random(&mut rng, n * spec.obs_dim, 1.0);
        let h0 = random(&mut rng, n * hidden, 0.8);

        let mut inference = PolicyInference::new(&layout, n);
        let mut h = h0.clone();
        let (mut logits, mut values) = (vec![0.0; n * spec.n_actions], vec![0.0; n]);
        inference.forward(&params, &obs, n, &mut h, &mut logits, &mut values);

        let mut cpu = CpuBackend::new();
        let mut net = Network::new(&mut cpu, &layout).expect("network");
        let starts = vec![0.0; n];
        net.forward(&mut cpu, &params, View::of(&obs), View::of(&starts), View::of(&h0), None, 1, n).expect("forward");
        let (heads, range) = net.heads().parts();
        let stride = spec.n_actions + 1;
        for (i, row) in heads[range].chunks_exact(stride).enumerate() {
            for (a, (&learner, &actor)) in row[..spec.n_actions].iter().zip(&logits[i * spec.n_actions..]).enumerate() {
                assert!(
                    (learner - actor).abs() <= 1e-5 * (1.0 + actor.abs()),
                    "{spec:?} logit {i},{a}: {learner} vs {actor}"
                );
            }
            assert!((row[spec.n_actions] - values[i]).abs() <= 1e-5 * (1.0 + values[i].abs()), "{spec:?} value {i}");
        }
        if hidden > 0 {
            for (&learner, &actor) in net.gru_h_out[..n * hidden].iter().zip(&h) {
                assert!((learner - actor).abs() <= 1e-5, "{spec:?} hidden: {learner} vs {actor}");
            }
        }
    }
}
