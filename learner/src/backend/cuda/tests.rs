//! Parity of the CUDA backend with the CPU backend: every operation of [`Backend`], the
//! generic network's forward and backward, the fused losses, the optimiser and whole updates,
//! on fresh random inputs, with relative-error bounds suited to f32 (different summation
//! orders, fused multiply-adds).
//!
//! Each check is generic over the backend under test and compares it with [`CpuBackend`]; the
//! `*_harness_*` tests run every check with the CPU backend in that role, so CI exercises the
//! harness itself. The CUDA runs need a device: without one each test prints
//! `SKIPPED: <reason>` and passes, unless `VOLLEY_REQUIRE_CUDA=1` (set by
//! `scripts/gpu-check.sh`), which turns a missing device into a failure.

use rand::{Rng, SeedableRng};
use rand_pcg::Pcg64Mcg;
use volley_core::ids::PolicyVersion;
use volley_core::spec::{LossKind, RunSpec};
use volley_core::wire::Observations;
use volley_env::EnvConfig;
use volley_policy::returns::{vtrace, VTraceConfig};
use volley_policy::{ActionHead, Activation, ParamLayout, PolicySpec};
use volley_testkit::fixtures::SpecBuilder;

use super::*;
use crate::backend::{
    Backend, BehaviourWeights, ClipAdamStep, CpuBackend, Evaluation, GaeScan, GatherColumns, Head, LogProbs,
    OffPolicyViews, PpoLoss, PpoLossInputs, PpoLossOutputs, VTraceLoss, VTraceLossInputs, VTraceLossOutputs, View,
    ViewMut,
};
use crate::batch::{SegmentBatch, StateRestore};
use crate::learner::{Learner, UpdateStats};
use crate::losses::{LossStats, PpoLossConfig, VTraceLossConfig};
use crate::net::Network;
use crate::optim::AdamConfig;
use crate::telemetry::{OffPolicyStats, OffPolicySums, NO_RATIO};
use crate::train::ValueEstimates;

fn device_or_skip(test: &str) -> Option<CudaDevice> {
    match open_cuda(0) {
        Ok(device) => Some(device),
        Err(err) => {
            assert!(
                std::env::var("VOLLEY_REQUIRE_CUDA").map_or(true, |v| v != "1"),
                "{test}: VOLLEY_REQUIRE_CUDA=1 but the CUDA backend cannot start: {err}"
            );
            eprintln!("SKIPPED {test}: no usable CUDA device ({err})");
            None
        }
    }
}

/// The CUDA backend on the device, or `None` (skipped).
pub(super) fn cuda_or_skip(test: &str) -> Option<CudaBackend> {
    device_or_skip(test).map(|device| CudaBackend::new(&device).expect("backend on an opened device"))
}

fn rng(seed: u64) -> Pcg64Mcg {
    Pcg64Mcg::seed_from_u64(seed)
}

fn uniform(rng: &mut Pcg64Mcg, n: usize, lo: f32, hi: f32) -> Vec<f32> {
    (0..n).map(|_| rng.random_range(lo..hi)).collect()
}

/// `|a − b| ≤ atol + rtol · max(|a|, |b|)` element-wise, reporting the worst element.
#[track_caller]
fn assert_close(name: &str, other: &[f32], cpu: &[f32], rtol: f32, atol: f32) {
    assert_eq!(other.len(), cpu.len(), "{name}: lengths differ");
    let mut worst = (0usize, 0.0f32);
    for (i, (&g, &c)) in other.iter().zip(cpu).enumerate() {
        assert!(g.is_finite() == c.is_finite(), "{name}[{i}]: backend {g}, cpu {c}");
        if !c.is_finite() {
            continue;
        }
        let excess = (g - c).abs() - (atol + rtol * g.abs().max(c.abs()));
        if excess > worst.1 {
            worst = (i, excess);
        }
    }
    let i = worst.0;
    assert!(worst.1 <= 0.0, "{name}[{i}]: backend {} vs cpu {} (rtol {rtol}, atol {atol})", other[i], cpu[i]);
}

/// A buffer on `backend` holding `host`.
fn put<B: Backend>(backend: &mut B, host: &[f32]) -> B::Floats {
    let mut buffer = backend.alloc(host.len()).expect("alloc");
    backend.upload(host, ViewMut::range(&mut buffer, 0..host.len())).expect("upload");
    buffer
}

/// The first `n` floats of `buffer`.
fn get<B: Backend>(backend: &mut B, buffer: &B::Floats, n: usize) -> Vec<f32> {
    let mut host = vec![0.0; n];
    backend.download(View::range(buffer, 0..n), &mut host).expect("download");
    host
}

fn actions_as_words(actions: &[u32]) -> Vec<f32> {
    actions.iter().map(|&a| f32::from_bits(a)).collect()
}

/// Parameters large enough that every path carries signal (the default init's 0.01 policy
/// head would hide torso errors).
fn random_params(layout: &ParamLayout, rng: &mut Pcg64Mcg) -> Vec<f32> {
    let mut params = vec![0.0; layout.n_params()];
    for entry in layout.entries() {
        let scale = if entry.rows == 1 { 0.5 } else { 1.5 / (entry.cols as f32).sqrt() };
        for p in &mut params[entry.range()] {
            *p = rng.random_range(-scale..scale);
        }
    }
    params
}

fn specs() -> Vec<PolicySpec> {
    vec![
        PolicySpec::mlp(5, 3, &[32, 16], Activation::Tanh),
        PolicySpec::mlp(4, 2, &[24], Activation::Relu),
        PolicySpec::gru(6, 4, &[16], Activation::Tanh, 12),
        PolicySpec::gru(3, 2, &[], Activation::Tanh, 8),
        // A separate value network: `copy_columns` joins and splits the two heads.
        PolicySpec::mlp(5, 3, &[32, 16], Activation::Tanh).with_critic(&[24, 8]),
        // Conv torsos (issue 15): im2col and col2im with stride, padding and both layouts.
        PolicySpec::mlp(0, 3, &[16], Activation::Relu).with_conv(crate::backend::cuda::conv_tests::two_layer_conv()),
        PolicySpec::gru(0, 4, &[], Activation::Tanh, 6).with_conv(volley_policy::ConvSpec::minatar(3, 10, 10)),
    ]
}

/// The network's heads, values and parameter gradients on `backend` and on the CPU.
fn check_network<B: Backend>(backend: &mut B) {
    let mut cpu = CpuBackend::new();
    for (case, spec) in specs().into_iter().enumerate() {
        let layout = ParamLayout::new(&spec).expect("valid spec");
        let mut r = rng(case as u64);
        let params = random_params(&layout, &mut r);
        let (t_len, b_len) = (7, 5);
        let rows = t_len * b_len;
        let hidden = layout.recurrent_size();
        let stride = spec.n_actions + 1;
        let obs = uniform(&mut r, rows * spec.obs_dim, -1.0, 1.0);
        let starts: Vec<f32> = (0..rows).map(|i| f32::from(i % 11 == 6)).collect();
        let h0 = uniform(&mut r, b_len * hidden, -0.5, 0.5);
        let d_heads = uniform(&mut r, rows * stride, -1.0, 1.0);
        let name = format!("case {case} ({spec:?})");
        // Episodes resumed mid-sequence from saved states: every start gets a restored state.
        let restores: Vec<StateRestore> = (0..rows)
            .filter(|&i| starts[i] != 0.0)
            .enumerate()
            .map(|(state, i)| StateRestore { t: i / b_len, b: i % b_len, state })
            .collect();
        let restore_states = uniform(&mut r, restores.len() * hidden, -0.8, 0.8);

        let on = |backend: &mut B| {
            let (p, o, s, h, d, rs) = (
                put(backend, &params),
                put(backend, &obs),
                put(backend, &starts),
                put(backend, &h0),
                put(backend, &d_heads),
                put(backend, &restore_states),
            );
            let mut net = Network::new(backend, &layout).unwrap();
            let (h, rs) = (View::range(&h, 0..h0.len()), View::range(&rs, 0..restore_states.len()));
            net.forward_restoring(backend, &p, View::of(&o), View::of(&s), h, &restores, rs, t_len, b_len).unwrap();
            let heads = net.heads().parts();
            let values = net.values().parts();
            let (heads_buf, heads_range) = heads;
            let heads = get(backend, heads_buf, heads_range.end);
            let values = get(backend, values.0, values.1.end);
            let mut grads = backend.alloc(params.len()).unwrap();
            net.backward(backend, &p, View::of(&d), View::of(&o), View::of(&s), &mut grads).unwrap();
            (heads, values, get(backend, &grads, params.len()))
        };
        let (heads, values, grads) = on(backend);
        let on_cpu = |cpu: &mut CpuBackend| {
            let mut net = Network::new(cpu, &layout).unwrap();
            let (o, s, h, states) = (View::of(&obs), View::of(&starts), View::of(&h0), View::of(&restore_states));
            net.forward_restoring(cpu, &params, o, s, h, &restores, states, t_len, b_len).unwrap();
            let heads = net.heads().parts();
            let values = net.values().parts();
            let (heads, values) = (heads.0[heads.1].to_vec(), values.0[values.1].to_vec());
            let mut grads = vec![0.0; params.len()];
            net.backward(cpu, &params, View::of(&d_heads), View::of(&obs), View::of(&starts), &mut grads).unwrap();
            (heads, values, grads)
        };
        let (cpu_heads, cpu_values, cpu_grads) = on_cpu(&mut cpu);
        assert_close(&format!("{name} heads"), &heads, &cpu_heads, 1e-4, 1e-5);
        assert_close(&format!("{name} values"), &values, &cpu_values, 1e-4, 1e-5);
        assert_close(&format!("{name} grads"), &grads, &cpu_grads, 2e-3, 1e-4);
    }
}

/// A random `[T+1][B]` batch for the loss checks: heads rows, actions, behaviour log-probs,
/// rewards, discounts (some zero) and weights (some zero).
struct LossCase {
    t_len: usize,
    b_len: usize,
    n_actions: usize,
    heads: Vec<f32>,
    values: Vec<f32>,
    actions: Vec<f32>,
    behaviour: Vec<f32>,
    rewards: Vec<f32>,
    discounts: Vec<f32>,
    weights: Vec<f32>,
    advantages: Vec<f32>,
    returns: Vec<f32>,
    prox: Vec<f32>,
    is_weights: Vec<f32>,
    /// Group baselines: every third step a group advantage, NaN (the critic's) elsewhere.
    advantage_override: Vec<f32>,
}

impl LossCase {
    fn new(seed: u64, t_len: usize, b_len: usize, n_actions: usize) -> Self {
        let mut r = rng(seed);
        let (n, rows) = (t_len * b_len, (t_len + 1) * b_len);
        let heads = uniform(&mut r, rows * (n_actions + 1), -2.0, 2.0);
        let values = heads.chunks_exact(n_actions + 1).map(|row| row[n_actions]).collect();
        let actions: Vec<u32> = (0..n).map(|_| r.random_range(0..n_actions as u32)).collect();
        let prox = uniform(&mut r, n, -2.0, -0.1);
        LossCase {
            t_len,
            b_len,
            n_actions,
            heads,
            values,
            actions: actions_as_words(&actions),
            behaviour: uniform(&mut r, n, -2.0, -0.1),
            rewards: uniform(&mut r, n, -1.0, 1.0),
            discounts: (0..n).map(|i| if i % 13 == 5 { 0.0 } else { 0.97 }).collect(),
            weights: (0..n).map(|i| if i % 17 == 3 { 0.0 } else { 0.5 + (i % 3) as f32 * 0.25 }).collect(),
            advantages: uniform(&mut r, n, -1.0, 1.0),
            returns: uniform(&mut r, n, -1.0, 1.0),
            is_weights: prox.iter().map(|p| (p + 0.5).exp().min(1.0)).collect(),
            prox,
            advantage_override: (0..n)
                .map(|i| if i % 3 == 1 { (i % 7) as f32 * 0.25 - 0.75 } else { f32::NAN })
                .collect(),
        }
    }
}

/// A [`LossCase`] on a backend: one buffer per vector, and the categorical head's (empty)
/// parameters.
struct DeviceCase<B: Backend> {
    heads: B::Floats,
    values: B::Floats,
    actions: B::Floats,
    behaviour: B::Floats,
    rewards: B::Floats,
    discounts: B::Floats,
    weights: B::Floats,
    advantages: B::Floats,
    returns: B::Floats,
    prox: B::Floats,
    is_weights: B::Floats,
    advantage_override: B::Floats,
    no_params: B::Floats,
}

impl LossCase {
    fn upload<B: Backend>(&self, backend: &mut B) -> DeviceCase<B> {
        DeviceCase {
            heads: put(backend, &self.heads),
            values: put(backend, &self.values),
            actions: put(backend, &self.actions),
            behaviour: put(backend, &self.behaviour),
            rewards: put(backend, &self.rewards),
            discounts: put(backend, &self.discounts),
            weights: put(backend, &self.weights),
            advantages: put(backend, &self.advantages),
            returns: put(backend, &self.returns),
            prox: put(backend, &self.prox),
            is_weights: put(backend, &self.is_weights),
            advantage_override: put(backend, &self.advantage_override),
            no_params: backend.alloc(0).expect("alloc"),
        }
    }
}

impl<B: Backend> DeviceCase<B> {
    /// The categorical head the cases' heads rows feed.
    fn categorical(&self) -> Head<'_, B> {
        Head { kind: ActionHead::Categorical, params: View::of(&self.no_params) }
    }
}

/// Everything a loss check reads back: the gradient rows, the intermediates and the evaluation.
#[derive(Debug)]
struct LossResult {
    d_heads: Vec<f32>,
    intermediates: Vec<Vec<f32>>,
    evaluation: Evaluation,
}

fn run_vtrace_loss<B: Backend>(
    backend: &mut B,
    case: &LossCase,
    config: &VTraceLossConfig,
    with_override: bool,
) -> LossResult {
    let (n, rows) = (case.t_len * case.b_len, (case.t_len + 1) * case.b_len);
    let stride = case.n_actions + 1;
    let d = case.upload(backend);
    let (mut log_rhos, mut vs, mut pg) =
        (backend.alloc(n).unwrap(), backend.alloc(n).unwrap(), backend.alloc(n).unwrap());
    let mut d_heads = backend.alloc(rows * stride).unwrap();
    backend.begin_evaluations(1).unwrap();
    let mut no_param_grads = backend.alloc(0).unwrap();
    let inputs = VTraceLossInputs {
        t_len: case.t_len,
        b_len: case.b_len,
        n_actions: case.n_actions,
        head: d.categorical(),
        heads: View::of(&d.heads),
        values: View::of(&d.values),
        actions: View::of(&d.actions),
        behaviour_log_probs: View::of(&d.behaviour),
        rewards: View::of(&d.rewards),
        discounts: View::of(&d.discounts),
        sample_weights: View::of(&d.weights),
        advantage_override: with_override.then(|| View::of(&d.advantage_override)),
    };
    let outputs = VTraceLossOutputs {
        log_rhos: ViewMut::range(&mut log_rhos, 0..n),
        vs: ViewMut::range(&mut vs, 0..n),
        pg_advantages: ViewMut::range(&mut pg, 0..n),
        d_heads: ViewMut::range(&mut d_heads, 0..rows * stride),
        d_head_params: ViewMut::of(&mut no_param_grads),
    };
    backend.vtrace_loss(VTraceLoss { inputs, config, outputs, slot: 0 }).unwrap();
    let mut evaluations = Vec::new();
    backend.read_evaluations(&mut evaluations, &mut OffPolicySums::default()).unwrap();
    LossResult {
        d_heads: get(backend, &d_heads, rows * stride),
        intermediates: vec![get(backend, &log_rhos, n), get(backend, &vs, n), get(backend, &pg, n)],
        evaluation: evaluations[0],
    }
}

fn run_ppo_loss<B: Backend>(backend: &mut B, case: &LossCase, config: &PpoLossConfig) -> LossResult {
    let n = case.t_len * case.b_len;
    let stride = case.n_actions + 1;
    let d = case.upload(backend);
    let mut d_heads = backend.alloc(n * stride).unwrap();
    backend.begin_evaluations(2).unwrap();
    let mut no_param_grads = backend.alloc(0).unwrap();
    // The first `n` of the `[T+1][B]` rows: the samples, without the bootstrap row.
    let inputs = PpoLossInputs {
        n_samples: n,
        n_actions: case.n_actions,
        head: d.categorical(),
        heads: View::range(&d.heads, 0..n * stride),
        values: View::range(&d.values, 0..n),
        actions: View::of(&d.actions),
        sample_weights: View::of(&d.weights),
        advantages: View::of(&d.advantages),
        returns: View::of(&d.returns),
        prox_log_probs: View::of(&d.prox),
        is_weights: View::of(&d.is_weights),
    };
    // Slot 1: the statistics land in the slot asked for, not slot 0.
    let outputs = PpoLossOutputs {
        d_heads: ViewMut::range(&mut d_heads, 0..n * stride),
        d_head_params: ViewMut::of(&mut no_param_grads),
    };
    backend.ppo_loss(PpoLoss { inputs, config, outputs, slot: 1 }).unwrap();
    let mut evaluations = Vec::new();
    backend.read_evaluations(&mut evaluations, &mut OffPolicySums::default()).unwrap();
    assert_eq!(evaluations[0].weight_sum, 0.0, "slot 0 untouched");
    LossResult { d_heads: get(backend, &d_heads, n * stride), intermediates: Vec::new(), evaluation: evaluations[1] }
}

#[track_caller]
fn assert_stats_close(name: &str, other: &LossStats, cpu: &LossStats) {
    let fields = |s: &LossStats| {
        [s.total, s.policy, s.value, s.entropy, s.mean_ratio, s.clip_fraction, s.approx_kl, s.weight_sum]
    };
    assert_close(name, &fields(other), &fields(cpu), 1e-3, 1e-5);
    assert_eq!(other.evaluations, cpu.evaluations, "{name}: evaluations");
}

fn check_losses<B: Backend>(backend: &mut B) {
    let mut cpu = CpuBackend::new();
    for (seed, (t_len, b_len, n_actions)) in [(7, 5, 3), (1, 9, 2), (20, 33, 6)].into_iter().enumerate() {
        let case = LossCase::new(seed as u64, t_len, b_len, n_actions);
        for lambda_ in [1.0, 0.9] {
            let config = VTraceLossConfig {
                vtrace: VTraceConfig {
                    clip_rho_threshold: 1.0,
                    clip_pg_rho_threshold: 0.9,
                    clip_c_threshold: 1.0,
                    lambda_,
                },
                value_coef: 0.5,
                ent_coef: 0.01,
            };
            for with_override in [false, true] {
                let name = format!("vtrace T{t_len} B{b_len} A{n_actions} λ{lambda_} override {with_override}");
                let (other, reference) = (
                    run_vtrace_loss(backend, &case, &config, with_override),
                    run_vtrace_loss(&mut cpu, &case, &config, with_override),
                );
                assert_close(&format!("{name} d_heads"), &other.d_heads, &reference.d_heads, 1e-3, 1e-6);
                for (k, (o, c)) in other.intermediates.iter().zip(&reference.intermediates).enumerate() {
                    assert_close(&format!("{name} intermediate {k}"), o, c, 1e-4, 1e-5);
                }
                let stats = |e: &Evaluation| e.sums.stats(e.weight_sum, config.value_coef, config.ent_coef);
                assert_stats_close(&name, &stats(&other.evaluation), &stats(&reference.evaluation));
            }
        }
        for normalize_advantages in [true, false] {
            let config = PpoLossConfig { clip_coef: 0.2, value_coef: 0.5, ent_coef: 0.01, normalize_advantages };
            let name = format!("ppo T{t_len} B{b_len} A{n_actions} normalize {normalize_advantages}");
            let (other, reference) = (run_ppo_loss(backend, &case, &config), run_ppo_loss(&mut cpu, &case, &config));
            assert_close(&format!("{name} d_heads"), &other.d_heads, &reference.d_heads, 1e-3, 1e-6);
            let stats = |e: &Evaluation| e.sums.stats(e.weight_sum, config.value_coef, config.ent_coef);
            assert_stats_close(&name, &stats(&other.evaluation), &stats(&reference.evaluation));
        }
    }
}

/// Log-probabilities, behaviour weights, GAE and column gathering.
fn check_elementwise<B: Backend>(backend: &mut B) {
    let mut cpu = CpuBackend::new();
    let case = LossCase::new(5, 9, 7, 4);
    let stride = case.n_actions + 1;
    fn run<B: Backend>(backend: &mut B, case: &LossCase) -> Vec<Vec<f32>> {
        let (t_len, b_len) = (case.t_len, case.b_len);
        let n = t_len * b_len;
        let stride = case.n_actions + 1;
        let d = case.upload(backend);
        let mut out: Vec<B::Floats> = (0..5).map(|_| backend.alloc(n).unwrap()).collect();
        let [log_probs, log_rhos, weights, adv, ret] = &mut out[..] else { unreachable!() };
        let heads_view = View::range(&d.heads, 0..n * stride);
        // Without a reference (log π), and less the behaviour's (log ρ).
        for (reference, out) in [(None, &mut *log_probs), (Some(View::of(&d.behaviour)), &mut *log_rhos)] {
            let (n_actions, head, actions) = (case.n_actions, d.categorical(), View::of(&d.actions));
            let out = ViewMut::of(out);
            backend.log_probs(LogProbs { heads: heads_view, n_actions, head, actions, reference, out }).unwrap();
        }
        backend
            .behaviour_weights(BehaviourWeights {
                prox_log_probs: View::of(log_probs),
                behaviour_log_probs: View::of(&d.behaviour),
                clip: 1.0,
                out: ViewMut::of(weights),
            })
            .unwrap();
        backend
            .gae_scan(GaeScan {
                t_len,
                b_len,
                discounts: View::of(&d.discounts),
                rewards: View::of(&d.rewards),
                values: View::range(&d.values, 0..n),
                bootstrap_value: View::range(&d.values, n..n + b_len),
                lambda_: 0.95,
                advantage_override: Some(View::of(&d.advantage_override)),
                advantages: ViewMut::of(adv),
                returns: ViewMut::of(ret),
            })
            .unwrap();
        let mut columns = None;
        backend.upload_indices(&[3, 0, 6, 6, 1], &mut columns).unwrap();
        let mut gathered = backend.alloc(t_len * 3 * stride).unwrap();
        backend
            .gather_columns(GatherColumns {
                src: heads_view,
                rows: t_len,
                b_len,
                width: stride,
                columns: columns.as_ref().unwrap(),
                columns_offset: 1,
                n_columns: 3,
                dst: ViewMut::of(&mut gathered),
            })
            .unwrap();
        let mut results: Vec<Vec<f32>> = out.iter().map(|b| get(backend, b, n)).collect();
        results.push(get(backend, &gathered, t_len * 3 * stride));
        results
    }
    let (other, reference) = (run(backend, &case), run(&mut cpu, &case));
    for (k, (o, c)) in other.iter().zip(&reference).enumerate() {
        assert_close(&format!("element-wise output {k}"), o, c, 1e-4, 1e-5);
    }
    // The CPU side against the reference recursions themselves.
    assert_eq!(reference[5][..stride], case.heads[0..stride]);
}

/// Clipping and Adam over several steps, one of them with a non-finite gradient (skipped).
fn check_optimiser<B: Backend>(backend: &mut B) {
    let mut cpu = CpuBackend::new();
    let config = AdamConfig { beta1: 0.9, beta2: 0.999, eps: 1e-8 };
    fn run<B: Backend>(backend: &mut B, config: &AdamConfig) -> (Vec<Vec<f32>>, u64, Vec<f32>) {
        let mut r = rng(8);
        let n = 1000;
        let mut params = put(backend, &uniform(&mut r, n, -1.0, 1.0));
        let (mut m, mut v) = (backend.alloc(n).unwrap(), backend.alloc(n).unwrap());
        let mut step = backend.step_count(3).unwrap();
        backend.begin_evaluations(4).unwrap();
        for slot in 0..4 {
            let mut host = uniform(&mut r, n, -0.3, 0.3);
            if slot == 2 {
                host[17] = f32::NAN;
            }
            let mut grads = put(backend, &host);
            backend
                .clip_adam_step(ClipAdamStep {
                    params: ViewMut::of(&mut params),
                    grads: ViewMut::of(&mut grads),
                    adam_m: ViewMut::of(&mut m),
                    adam_v: ViewMut::of(&mut v),
                    step: &mut step,
                    config,
                    learning_rate: 1e-2,
                    max_grad_norm: if slot == 1 { 0.5 } else { 100.0 },
                    slot,
                })
                .unwrap();
        }
        let mut evaluations = Vec::new();
        backend.read_evaluations(&mut evaluations, &mut OffPolicySums::default()).unwrap();
        let t = backend.read_step_count(&step).unwrap();
        let state = vec![get(backend, &params, n), get(backend, &m, n), get(backend, &v, n)];
        (state, t, evaluations.iter().map(|e| e.grad_norm).collect())
    }
    let (other, other_t, other_norms) = run(backend, &config);
    let (reference, cpu_t, cpu_norms) = run(&mut cpu, &config);
    assert_eq!(other_t, 6, "three applied steps after t = 3, one skipped");
    assert_eq!(other_t, cpu_t);
    assert!(!other_norms[2].is_finite() && !cpu_norms[2].is_finite());
    for slot in [0, 1, 3] {
        assert_close(&format!("norm {slot}"), &other_norms[slot..=slot], &cpu_norms[slot..=slot], 1e-5, 0.0);
    }
    for (name, (o, c)) in ["params", "adam m", "adam v"].iter().zip(other.iter().zip(&reference)) {
        assert_close(name, o, c, 1e-4, 1e-9);
    }
}

/// Issue 47: the off-policy sums and ratios (`telemetry::OffPolicySums`) of a batch with
/// dropped samples and ratios on both sides of the clips, accumulated over two calls.
fn check_off_policy<B: Backend>(backend: &mut B) {
    let case = LossCase::new(8, 11, 6, 3);
    let n = case.t_len * case.b_len;
    let log_rhos: Vec<f32> = case.prox.iter().zip(&case.behaviour).map(|(p, b)| p - b).collect();
    fn run<B: Backend>(backend: &mut B, case: &LossCase, log_rhos: &[f32]) -> (OffPolicySums, Vec<f32>) {
        let n = log_rhos.len();
        let inputs = [log_rhos, &case.weights[..], &case.values[..n], &case.returns[..]].map(|host| put(backend, host));
        let mut ratios = backend.alloc(n).unwrap();
        backend.begin_evaluations(1).unwrap();
        let half = n / 2;
        for range in [0..half, half..n] {
            let views = OffPolicyViews {
                log_rhos: View::range(&inputs[0], range.clone()),
                reference: None,
                weights: View::range(&inputs[1], range.clone()),
                values: View::range(&inputs[2], range.clone()),
                value_targets: View::range(&inputs[3], range.clone()),
                rho_bar: 1.0,
                c_bar: 0.9,
            };
            backend.off_policy_sums(&views, ViewMut::range(&mut ratios, range)).unwrap();
        }
        let mut sums = OffPolicySums::default();
        backend.read_evaluations(&mut Vec::new(), &mut sums).unwrap();
        (sums, get(backend, &ratios, n))
    }
    let mut cpu = CpuBackend::new();
    let (other, other_ratios) = run(backend, &case, &log_rhos);
    let (reference, cpu_ratios) = run(&mut cpu, &case, &log_rhos);
    for (k, (o, c)) in other.to_array().iter().zip(reference.to_array()).enumerate() {
        assert!((o - c).abs() <= 1e-9 * (1.0 + c.abs()), "off-policy sum {k}: {o} vs {c}");
    }
    assert_close("ratios", &other_ratios, &cpu_ratios, 1e-6, 0.0);
    let stats = reference.finish(Vec::new());
    assert!(stats.rho_clipped_fraction > 0.0 && stats.rho_clipped_fraction < 1.0, "{stats:?}");
    assert!(cpu_ratios.iter().filter(|&&r| r == NO_RATIO).count() < n, "some samples carry weight");
}

fn assert_off_policy_close(name: &str, other: &Option<OffPolicyStats>, cpu: &Option<OffPolicyStats>) {
    let (Some(o), Some(c)) = (other, cpu) else { panic!("{name}: off-policy statistics missing: {other:?} {cpu:?}") };
    let fields = |s: &OffPolicyStats| {
        [
            s.rho_clipped_fraction,
            s.c_clipped_fraction,
            s.behaviour_kl,
            s.effective_sample_fraction,
            s.explained_variance,
        ]
    };
    assert_close(&format!("{name} off-policy"), &fields(o), &fields(c), 1e-4, 1e-6);
    assert_close(&format!("{name} ratios"), &o.ratios, &c.ratios, 1e-4, 1e-6);
}

/// The checks run with the CPU backend in the tested role: the harness works without a GPU.
#[test]
fn parity_checks_harness_runs_on_the_cpu() {
    let mut cpu = CpuBackend::new();
    check_network(&mut cpu);
    check_losses(&mut cpu);
    check_elementwise(&mut cpu);
    check_optimiser(&mut cpu);
    check_off_policy(&mut cpu);
}

/// One CUDA test per `name => check`: the check with the CUDA backend in the tested role,
/// skipped without a device (see [`cuda_or_skip`]).
macro_rules! cuda_parity_tests {
    ($($(#[$doc:meta])* $name:ident => $check:ident;)*) => {$(
        $(#[$doc])*
        #[test]
        fn $name() {
            let Some(mut cuda) = cuda_or_skip(stringify!($name)) else { return };
            $check(&mut cuda);
        }
    )*};
}

cuda_parity_tests! {
    /// Issue 47: the CUDA backend reports the off-policy statistics, with the CPU's values.
    off_policy_sums_match_the_cpu => check_off_policy;
    network_forward_and_backward_match_the_cpu_backend => check_network;
    fused_losses_match_the_cpu_losses => check_losses;
    log_probs_scans_and_gathers_match_the_cpu => check_elementwise;
    clipped_adam_matches_the_cpu_optimiser_and_skips_non_finite_gradients => check_optimiser;
}

#[test]
fn the_vtrace_scan_kernel_matches_the_cpu_recursion() {
    let Some(device) = device_or_skip("the_vtrace_scan_kernel_matches_the_cpu_recursion") else { return };
    let gpu = &device.gpu;
    let case = LossCase::new(4, 30, 70, 2);
    let (t_len, b_len) = (case.t_len, case.b_len);
    let n = t_len * b_len;
    let log_rhos: Vec<f32> = case.behaviour.iter().map(|b| b + 1.0).collect();
    let config =
        VTraceConfig { clip_rho_threshold: 1.0, clip_pg_rho_threshold: 0.8, clip_c_threshold: 0.9, lambda_: 0.95 };
    let (mut vs, mut pg) = (vec![0.0; n], vec![0.0; n]);
    vtrace(
        t_len,
        b_len,
        &log_rhos,
        &case.discounts,
        &case.rewards,
        &case.values[..n],
        &case.values[n..],
        &config,
        &mut vs,
        &mut pg,
    );
    let upload = |host: &[f32]| gpu.stream.clone_htod(host).expect("upload");
    let (l, d, r, v) = (upload(&log_rhos), upload(&case.discounts), upload(&case.rewards), upload(&case.values));
    let (mut vs_d, mut pg_d) = (gpu.stream.alloc_zeros::<f32>(n).unwrap(), gpu.stream.alloc_zeros::<f32>(n).unwrap());
    let args = kernels::VTraceScanArgs {
        t_len,
        b_len,
        log_rhos: l.slice(..),
        discounts: d.slice(..),
        rewards: r.slice(..),
        values: v.slice(..n),
        bootstrap: v.slice(n..),
        config: &config,
        advantage_override: None,
    };
    gpu.kernels.vtrace_scan(&args, &mut vs_d.slice_mut(..), &mut pg_d.slice_mut(..)).unwrap();
    let (vs_g, pg_g) = (gpu.stream.clone_dtoh(&vs_d).unwrap(), gpu.stream.clone_dtoh(&pg_d).unwrap());
    assert_close("vs", &vs_g, &vs, 1e-4, 1e-5);
    assert_close("pg advantages", &pg_g, &pg, 1e-4, 1e-5);
}

#[test]
fn values_for_selection_match_the_cpu_learner() {
    let Some(device) = device_or_skip("values_for_selection_match_the_cpu_learner") else { return };
    for policy in cartpole_policies() {
        let spec = run_spec(policy, LossKind::Vtrace, 10, 6);
        let mut cpu = Learner::new(spec.clone()).unwrap();
        let mut gpu = Learner::new(spec.clone()).unwrap();
        gpu.use_cuda_device(&device).unwrap();
        let batch = random_batch(&mut rng(5), &spec, cpu.layout().recurrent_size());
        let (mut c, mut g) = (ValueEstimates::default(), ValueEstimates::default());
        cpu.values_and_advantages(&batch, 0.95, &mut c);
        gpu.values_and_advantages(&batch, 0.95, &mut g);
        assert_close("selection values", &g.values, &c.values, 1e-4, 1e-5);
        assert_close("selection advantages", &g.advantages, &c.advantages, 1e-3, 1e-5);
    }
}

fn run_spec(policy: PolicySpec, loss: LossKind, t_len: usize, b_len: usize) -> RunSpec {
    SpecBuilder::new(EnvConfig::Cartpole, policy, t_len)
        .run("parity")
        .training(loss, b_len, 3e-4)
        .ppo(2, 3)
        .seed(9)
        .build()
}

fn random_batch(r: &mut Pcg64Mcg, spec: &RunSpec, hidden: usize) -> SegmentBatch {
    let (t_len, b_len) = (spec.segment_len, spec.hyper.batch_segments);
    let (d, a) = (spec.policy.obs_dim, spec.policy.n_actions);
    let steps = t_len * b_len;
    let continuous = spec.policy.head.is_continuous();
    let episode_start: Vec<f32> = (0..(t_len + 1) * b_len).map(|i| f32::from(i % 9 == 4)).collect();
    // Every other episode start inside the sequence resumes a saved, non-zero state.
    let restores: Vec<StateRestore> = if hidden == 0 {
        Vec::new()
    } else {
        (b_len..t_len * b_len)
            .filter(|&i| episode_start[i] != 0.0 && i % 2 == 0)
            .enumerate()
            .map(|(state, i)| StateRestore { t: i / b_len, b: i % b_len, state })
            .collect()
    };
    SegmentBatch {
        restore_states: uniform(r, restores.len() * hidden, -0.8, 0.8),
        restores,
        padded_steps: 0,
        t_len,
        b_len,
        obs_dim: d,
        hidden_size: hidden,
        observations: Observations::F32(uniform(r, (t_len + 1) * b_len * d, -1.0, 1.0)),
        episode_start,
        initial_hidden: uniform(r, b_len * hidden, -0.5, 0.5),
        actions: if continuous { Vec::new() } else { (0..steps).map(|_| r.random_range(0..a as u32)).collect() },
        action_dim: if continuous { a } else { 0 },
        // Within (−1, 1), so the same batch serves squashed heads.
        continuous_actions: if continuous { uniform(r, steps * a, -0.9, 0.9) } else { Vec::new() },
        behaviour_log_probs: uniform(r, steps, -(a as f32).ln() - 0.3, -(a as f32).ln() + 0.3),
        rewards: uniform(r, steps, -1.0, 1.0),
        discounts: (0..steps).map(|i| if i % 23 == 7 { 0.0 } else { 0.99 }).collect(),
        sample_weights: (0..steps).map(|i| if i % 31 == 0 { 0.0 } else { 1.0 }).collect(),
        policy_versions: vec![PolicyVersion(0); b_len],
        // Group advantages on some steps, so whole updates check that path on both losses.
        advantage_override: (0..steps)
            .map(|i| if i % 5 == 2 { (i % 4) as f32 * 0.5 - 0.75 } else { f32::NAN })
            .collect(),
    }
}

/// CartPole-shaped policies (the run spec checks them against the env): an MLP and a GRU.
fn cartpole_policies() -> [PolicySpec; 2] {
    [PolicySpec::mlp(4, 2, &[32, 16], Activation::Tanh), PolicySpec::gru(4, 2, &[16], Activation::Tanh, 12)]
}

/// The harness of the whole-update tests works (specs valid, batches well formed) without a
/// GPU too, so a skipped CUDA run cannot hide a broken test.
#[test]
fn parity_harness_runs_on_the_cpu() {
    for loss in [LossKind::Vtrace, LossKind::Ppo] {
        for policy in cartpole_policies() {
            let spec = run_spec(policy, loss, 12, 9);
            let mut cpu = Learner::new(spec.clone()).unwrap();
            let hidden = cpu.layout().recurrent_size();
            let stats = cpu.update(&random_batch(&mut rng(21), &spec, hidden));
            assert!(stats.grad_norm.is_finite() && stats.loss.total.is_finite(), "{stats:?}");
        }
    }
}

#[test]
fn whole_updates_match_the_cpu_learner() {
    let Some(device) = device_or_skip("whole_updates_match_the_cpu_learner") else { return };
    for loss in [LossKind::Vtrace, LossKind::Ppo] {
        for policy in cartpole_policies() {
            let spec = run_spec(policy, loss, 12, 9);
            let mut cpu = Learner::new(spec.clone()).unwrap();
            let mut gpu = Learner::new(spec.clone()).unwrap();
            gpu.use_cuda_device(&device).unwrap();
            assert!(gpu.backend().starts_with("cuda"), "{}", gpu.backend());
            let hidden = cpu.layout().recurrent_size();
            let mut r = rng(21);
            for update in 0..3 {
                let batch = random_batch(&mut r, &spec, hidden);
                let name = format!("{loss:?} {:?} update {update}", spec.policy.core);
                let [g, c] = assert_update_matches(&name, &mut gpu, &mut cpu, &batch);
                assert_eq!(g.skipped_steps, c.skipped_steps, "{name}");
            }
            // A checkpoint from the device has the device's optimiser state.
            let checkpoint = gpu.checkpoint(0);
            assert_eq!(checkpoint.adam_t, cpu.checkpoint(0).adam_t);
        }
    }
}

/// One update of `batch` on both learners: the statistics, the gradient norm and the
/// off-policy statistics agree, and so do all but a few parameters. Returns both updates'
/// statistics (the GPU's first).
#[track_caller]
fn assert_update_matches(name: &str, gpu: &mut Learner, cpu: &mut Learner, batch: &SegmentBatch) -> [UpdateStats; 2] {
    let (c, g) = (cpu.update(batch), gpu.update(batch));
    assert_stats_close(name, &g.loss, &c.loss);
    assert_close(&format!("{name} grad norm"), &[g.grad_norm], &[c.grad_norm], 1e-3, 1e-6);
    assert_off_policy_close(name, &g.off_policy, &c.off_policy);
    // Adam's first steps are ±lr per parameter whatever the gradient's size, so a parameter
    // whose gradient is rounding noise may step either way on the two backends: require all
    // but a few parameters to agree closely.
    let (gp, cp) = (gpu.params(), cpu.params());
    let off = gp.iter().zip(cp).filter(|(a, b)| (*a - *b).abs() > 1e-5 + 1e-3 * b.abs()).count();
    let mean_diff = gp.iter().zip(cp).map(|(a, b)| (a - b).abs()).sum::<f32>() / gp.len() as f32;
    assert!(
        (off as f32) < 0.02 * gp.len() as f32,
        "{name}: {off} of {} parameters differ (mean |Δ| {mean_diff})",
        gp.len()
    );
    [g, c]
}

/// Pendulum-shaped policies with the Gaussian head (issue 14): unsquashed and squashed, and
/// the MuJoCo family's shape: a separate value network over normalised observations.
fn pendulum_specs(loss: LossKind) -> Vec<RunSpec> {
    [(false, &[][..]), (true, &[]), (false, &[16, 16])]
        .into_iter()
        .map(|(squash, critic)| {
            let policy = PolicySpec::mlp(3, 1, &[32, 16], Activation::Tanh)
                .with_head(volley_policy::ActionHead::Gaussian { squash })
                .with_critic(critic)
                .with_obs_normalization(!critic.is_empty());
            RunSpec { env: EnvConfig::Pendulum, ..run_spec(policy, loss, 12, 9) }
        })
        .collect()
}

/// The Gaussian whole-update harness runs without a GPU too.
#[test]
fn gaussian_parity_harness_runs_on_the_cpu() {
    for loss in [LossKind::Vtrace, LossKind::Ppo] {
        for spec in pendulum_specs(loss) {
            let mut cpu = Learner::new(spec.clone()).unwrap();
            let before = cpu.params().to_vec();
            let stats = cpu.update(&random_batch(&mut rng(21), &spec, 0));
            assert!(stats.grad_norm.is_finite() && stats.loss.total.is_finite(), "{stats:?}");
            let log_std = cpu.layout().log_std_range().expect("a Gaussian layout");
            assert_ne!(cpu.params()[log_std.clone()], before[log_std], "the log-std parameters learn");
        }
    }
}

/// Issue 14: whole V-trace and PPO updates with the Gaussian head (log-probabilities, the
/// fused losses and the log-std gradient rows of the `VolleyGaussian` kernels) and their
/// off-policy statistics match the CPU learner.
#[test]
fn gaussian_whole_updates_match_the_cpu_learner() {
    let Some(device) = device_or_skip("gaussian_whole_updates_match_the_cpu_learner") else { return };
    for loss in [LossKind::Vtrace, LossKind::Ppo] {
        for spec in pendulum_specs(loss) {
            let mut cpu = Learner::new(spec.clone()).unwrap();
            let mut gpu = Learner::new(spec.clone()).unwrap();
            gpu.use_cuda_device(&device).unwrap();
            let mut r = rng(23);
            for update in 0..3 {
                let batch = random_batch(&mut r, &spec, 0);
                let name = format!("{loss:?} {:?} update {update}", spec.policy.head);
                assert_update_matches(&name, &mut gpu, &mut cpu, &batch);
                let log_std = cpu.layout().log_std_range().expect("a Gaussian layout");
                let (gp, cp) = (gpu.params(), cpu.params());
                assert_close(&format!("{name} log_std"), &gp[log_std.clone()], &cp[log_std], 1e-3, 1e-5);
            }
        }
    }
}

#[test]
fn profiling_reports_copy_compute_and_readback_times() {
    let Some(device) = device_or_skip("profiling_reports_copy_compute_and_readback_times") else { return };
    let spec = run_spec(cartpole_policies()[0].clone(), LossKind::Vtrace, 16, 32);
    let mut learner = Learner::new(spec.clone()).unwrap();
    learner.use_cuda_device(&device).unwrap();
    learner.set_profiling(true).unwrap();
    let batch = random_batch(&mut rng(3), &spec, 0);
    learner.update(&batch);
    let timing = learner.last_timing().expect("profiling is on");
    assert!(timing.h2d_ms >= 0.0 && timing.compute_ms > 0.0 && timing.d2h_ms >= 0.0, "{timing:?}");
}
