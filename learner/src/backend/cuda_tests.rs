//! Parity of the CUDA backend with the CPU backend: every kernel, the network's forward and
//! backward, the losses, the optimiser and whole updates, on fresh random inputs, with
//! relative-error bounds suited to f32 (different summation orders, fused multiply-adds).
//!
//! They need a CUDA device: without one each test prints `SKIPPED: <reason>` and passes, unless
//! `VOLLEY_REQUIRE_CUDA=1` (set by `scripts/gpu-check.sh`), which turns a missing device into a
//! failure.

use super::*;
use crate::backend::open_cuda;
use crate::learner::Learner;
use crate::losses::{self, PpoLossConfig, PpoTargets, SequenceBatch, VTraceLossConfig};
use crate::optim::{clip_grad_global_norm, Adam, AdamConfig};
use rand::{Rng, SeedableRng};
use volley_core::ids::{PolicyVersion, RunId};
use volley_core::spec::RunSpec;
use volley_env::EnvConfig;
use volley_policy::returns::{gae, vtrace, VTraceConfig};
use volley_policy::{PolicySpec, PolicyTape};

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

fn rng(seed: u64) -> Pcg64Mcg {
    Pcg64Mcg::seed_from_u64(seed)
}

fn uniform(rng: &mut Pcg64Mcg, n: usize, lo: f32, hi: f32) -> Vec<f32> {
    (0..n).map(|_| rng.random_range(lo..hi)).collect()
}

/// `|a − b| ≤ atol + rtol · max(|a|, |b|)` element-wise, reporting the worst element.
#[track_caller]
fn assert_close(name: &str, gpu: &[f32], cpu: &[f32], rtol: f32, atol: f32) {
    assert_eq!(gpu.len(), cpu.len(), "{name}: lengths differ");
    let mut worst = (0usize, 0.0f32);
    for (i, (&g, &c)) in gpu.iter().zip(cpu).enumerate() {
        assert!(g.is_finite() == c.is_finite(), "{name}[{i}]: gpu {g}, cpu {c}");
        if !c.is_finite() {
            continue;
        }
        let excess = (g - c).abs() - (atol + rtol * g.abs().max(c.abs()));
        if excess > worst.1 {
            worst = (i, excess);
        }
    }
    let i = worst.0;
    assert!(worst.1 <= 0.0, "{name}[{i}]: gpu {} vs cpu {} (rtol {rtol}, atol {atol})", gpu[i], cpu[i]);
}

fn download(gpu: &Gpu, ptr_slice: &CudaSlice<f32>, n: usize) -> Vec<f32> {
    let mut out = vec![0.0f32; n];
    gpu.stream.memcpy_dtoh(&ptr_slice.slice(..n), &mut out[..]).expect("download");
    out
}

fn grow_download(gpu: &Gpu, grow: &Grow, n: usize) -> Vec<f32> {
    download(gpu, grow.buf.as_ref().expect("allocated"), n)
}

fn upload(gpu: &Gpu, host: &[f32]) -> CudaSlice<f32> {
    gpu.stream.clone_htod(host).expect("upload")
}

fn upload_u32(gpu: &Gpu, host: &[u32]) -> CudaSlice<u32> {
    gpu.stream.clone_htod(host).expect("upload")
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

fn state_for(params: &[f32]) -> DeviceState {
    DeviceState { params: params.to_vec(), adam_m: vec![0.0; params.len()], adam_v: vec![0.0; params.len()], adam_t: 0 }
}

fn specs() -> Vec<PolicySpec> {
    vec![
        PolicySpec { obs_dim: 5, n_actions: 3, torso: vec![32, 16], activation: Activation::Tanh, core: CoreKind::Mlp },
        PolicySpec { obs_dim: 4, n_actions: 2, torso: vec![24], activation: Activation::Relu, core: CoreKind::Mlp },
        PolicySpec::gru(6, 4, &[16], Activation::Tanh, 12),
        PolicySpec {
            obs_dim: 3,
            n_actions: 2,
            torso: vec![],
            activation: Activation::Tanh,
            core: CoreKind::Gru { hidden: 8 },
        },
    ]
}

#[test]
fn network_forward_and_backward_match_the_cpu_tape() {
    let Some(device) = device_or_skip("network_forward_and_backward_match_the_cpu_tape") else { return };
    for (case, spec) in specs().into_iter().enumerate() {
        let layout = ParamLayout::new(&spec).expect("valid spec");
        let mut r = rng(case as u64);
        let params = random_params(&layout, &mut r);
        let (t_len, b_len) = (7, 5);
        let rows = t_len * b_len;
        let obs = uniform(&mut r, rows * spec.obs_dim, -1.0, 1.0);
        let starts: Vec<f32> = (0..rows).map(|i| f32::from(i % 11 == 3)).collect();
        let h0 = uniform(&mut r, b_len * layout.recurrent_size(), -0.8, 0.8);
        let dlogits = uniform(&mut r, rows * spec.n_actions, -1.0, 1.0);
        let dvalues = uniform(&mut r, rows, -1.0, 1.0);

        let mut tape = PolicyTape::new(&layout);
        tape.forward(&params, &obs, &starts, &h0, t_len, b_len);
        let mut cpu_grads = vec![0.0; layout.n_params()];
        tape.backward(&params, &dlogits, &dvalues, &mut cpu_grads);

        let mut engine = CudaEngine::new(&device, &layout, &state_for(&params)).expect("engine");
        let gpu = engine.gpu.clone();
        let (obs_d, starts_d) = (upload(&gpu, &obs), upload(&gpu, &starts));
        let h0_d = upload(&gpu, if h0.is_empty() { &[0.0] } else { &h0 });
        engine.forward(gpu.ptr(&obs_d), gpu.ptr(&starts_d), gpu.ptr(&h0_d), t_len, b_len).expect("forward");
        let a = spec.n_actions;
        let heads = grow_download(&gpu, &engine.heads_out, rows * (a + 1));
        let logits: Vec<f32> = heads.chunks_exact(a + 1).flat_map(|row| row[..a].to_vec()).collect();
        let values = grow_download(&gpu, &engine.values, rows);
        assert_close(&format!("case {case} logits"), &logits, tape.logits(), 1e-4, 1e-5);
        assert_close(&format!("case {case} values"), &values, tape.values(), 1e-4, 1e-5);

        let d_heads: Vec<f32> =
            dlogits.chunks_exact(a).zip(&dvalues).flat_map(|(row, &dv)| row.iter().copied().chain([dv])).collect();
        let d_ptr = engine.d_heads.ensure(&gpu, rows * (a + 1)).expect("d_heads");
        gpu.stream
            .memcpy_htod(&d_heads, &mut engine.d_heads.buf.as_mut().expect("allocated").slice_mut(..d_heads.len()))
            .expect("copy");
        assert_ne!(d_ptr, 0);
        engine.backward().expect("backward");
        let gpu_grads = download(&gpu, &engine.grads, layout.n_params());
        assert_close(&format!("case {case} grads"), &gpu_grads, &cpu_grads, 2e-3, 2e-5);
    }
}

#[test]
fn vtrace_and_gae_scans_match_the_cpu_recursions() {
    let Some(device) = device_or_skip("vtrace_and_gae_scans_match_the_cpu_recursions") else { return };
    let gpu = device.gpu.clone();
    let mut r = rng(7);
    let (t_len, b_len) = (23, 300);
    let n = t_len * b_len;
    let log_rhos = uniform(&mut r, n, -1.5, 1.0);
    let discounts: Vec<f32> = (0..n).map(|_| if r.random_bool(0.1) { 0.0 } else { 0.97 }).collect();
    let rewards = uniform(&mut r, n, -1.0, 1.0);
    let values = uniform(&mut r, n, -2.0, 2.0);
    let bootstrap = uniform(&mut r, b_len, -2.0, 2.0);
    let config =
        VTraceConfig { clip_rho_threshold: 1.0, clip_pg_rho_threshold: 0.9, clip_c_threshold: 0.95, lambda_: 0.9 };
    let (mut vs, mut adv) = (vec![0.0; n], vec![0.0; n]);
    vtrace(t_len, b_len, &log_rhos, &discounts, &rewards, &values, &bootstrap, &config, &mut vs, &mut adv);
    let d = |x: &[f32]| upload(&gpu, x);
    let (lr_d, disc_d, rew_d, val_d, boot_d) = (d(&log_rhos), d(&discounts), d(&rewards), d(&values), d(&bootstrap));
    let (vs_d, adv_d) = (gpu.alloc(n).expect("alloc"), gpu.alloc(n).expect("alloc"));
    gpu.launch(
        &gpu.k.vtrace_scan,
        grid(b_len),
        &[
            int(t_len),
            int(b_len),
            Arg::Ptr(gpu.ptr(&lr_d)),
            Arg::Ptr(gpu.ptr(&disc_d)),
            Arg::Ptr(gpu.ptr(&rew_d)),
            Arg::Ptr(gpu.ptr(&val_d)),
            Arg::Ptr(gpu.ptr(&boot_d)),
            Arg::F32(config.clip_rho_threshold),
            Arg::F32(config.clip_pg_rho_threshold),
            Arg::F32(config.clip_c_threshold),
            Arg::F32(config.lambda_),
            Arg::Ptr(gpu.ptr(&vs_d)),
            Arg::Ptr(gpu.ptr(&adv_d)),
        ],
    )
    .expect("launch");
    assert_close("vs", &download(&gpu, &vs_d, n), &vs, 1e-5, 1e-5);
    assert_close("pg advantages", &download(&gpu, &adv_d, n), &adv, 1e-5, 1e-5);

    let (mut gae_adv, mut gae_ret) = (vec![0.0; n], vec![0.0; n]);
    gae(t_len, b_len, &discounts, &rewards, &values, &bootstrap, 0.95, &mut gae_adv, &mut gae_ret);
    gpu.launch(
        &gpu.k.gae_scan,
        grid(b_len),
        &[
            int(t_len),
            int(b_len),
            Arg::Ptr(gpu.ptr(&disc_d)),
            Arg::Ptr(gpu.ptr(&rew_d)),
            Arg::Ptr(gpu.ptr(&val_d)),
            Arg::Ptr(gpu.ptr(&boot_d)),
            Arg::F32(0.95),
            Arg::Ptr(gpu.ptr(&vs_d)),
            Arg::Ptr(gpu.ptr(&adv_d)),
        ],
    )
    .expect("launch");
    assert_close("gae advantages", &download(&gpu, &vs_d, n), &gae_adv, 1e-5, 1e-5);
    assert_close("gae returns", &download(&gpu, &adv_d, n), &gae_ret, 1e-5, 1e-5);
}

/// A random heads block `[rows][A + 1]` and its split into logits and values.
fn heads_block(r: &mut Pcg64Mcg, rows: usize, a: usize) -> (Vec<f32>, Vec<f32>, Vec<f32>) {
    let heads = uniform(r, rows * (a + 1), -3.0, 3.0);
    let logits = heads.chunks_exact(a + 1).flat_map(|row| row[..a].to_vec()).collect();
    let values = heads.chunks_exact(a + 1).map(|row| row[a]).collect();
    (heads, logits, values)
}

fn split_grads(d_heads: &[f32], a: usize) -> (Vec<f32>, Vec<f32>) {
    (
        d_heads.chunks_exact(a + 1).flat_map(|row| row[..a].to_vec()).collect(),
        d_heads.chunks_exact(a + 1).map(|row| row[a]).collect(),
    )
}

fn assert_stats_close(name: &str, gpu: &LossStats, cpu: &LossStats) {
    let pairs = [
        ("total", gpu.total, cpu.total),
        ("policy", gpu.policy, cpu.policy),
        ("value", gpu.value, cpu.value),
        ("entropy", gpu.entropy, cpu.entropy),
        ("mean_ratio", gpu.mean_ratio, cpu.mean_ratio),
        ("clip_fraction", gpu.clip_fraction, cpu.clip_fraction),
        ("approx_kl", gpu.approx_kl, cpu.approx_kl),
        ("weight_sum", gpu.weight_sum, cpu.weight_sum),
    ];
    for (field, g, c) in pairs {
        assert_close(&format!("{name}.{field}"), &[g], &[c], 1e-4, 1e-5);
    }
}

fn stats_from_slot(slot: &[f64], value_coef: f32, ent_coef: f32) -> LossStats {
    let s = &slot[SLOT_STATS..];
    WeightedSums { policy: s[0], value: s[1], entropy: s[2], ratio: s[3], clipped: s[4], approx_kl: s[5] }
        .finish(slot[0], value_coef, ent_coef)
}

#[test]
fn log_probs_and_loss_kernels_match_the_cpu_losses() {
    let Some(device) = device_or_skip("log_probs_and_loss_kernels_match_the_cpu_losses") else { return };
    let gpu = device.gpu.clone();
    let mut r = rng(11);
    let (t_len, b_len, a) = (9, 40, 5);
    let n = t_len * b_len;
    let n_rows = n + b_len;
    let (heads, logits, values) = heads_block(&mut r, n_rows, a);
    let actions: Vec<u32> = (0..n).map(|_| r.random_range(0..a as u32)).collect();
    let behaviour = uniform(&mut r, n, -2.5, -0.2);
    let rewards = uniform(&mut r, n, -1.0, 1.0);
    let discounts: Vec<f32> = (0..n).map(|i| if i % 17 == 5 { 0.0 } else { 0.99 }).collect();
    let weights: Vec<f32> = (0..n).map(|i| if i % 13 == 0 { 0.0 } else { r.random_range(0.3..1.0) }).collect();
    let batch = SequenceBatch {
        t_len,
        b_len,
        n_actions: a,
        actions: &actions,
        behaviour_log_probs: &behaviour,
        rewards: &rewards,
        discounts: &discounts,
        sample_weights: &weights,
    };

    // V-trace: log-rhos, scan, weight sum, fused loss and gradient.
    let config = VTraceLossConfig::default();
    let (mut dlogits, mut dvalues) = (vec![0.0; n_rows * a], vec![0.0; n_rows]);
    let mut workspace = losses::VTraceWorkspace::new();
    let cpu = losses::vtrace_loss_with_workspace(
        &batch,
        &logits,
        &values,
        &config,
        &mut workspace,
        &mut dlogits,
        &mut dvalues,
    );
    let heads_d = upload(&gpu, &heads);
    let values_d = upload(&gpu, &values);
    let actions_d = upload_u32(&gpu, &actions);
    let (behaviour_d, rewards_d, discounts_d, weights_d) =
        (upload(&gpu, &behaviour), upload(&gpu, &rewards), upload(&gpu, &discounts), upload(&gpu, &weights));
    let (log_rhos_d, vs_d, adv_d) = (gpu.alloc(n).unwrap(), gpu.alloc(n).unwrap(), gpu.alloc(n).unwrap());
    let d_heads_d = gpu.alloc(n_rows * (a + 1)).unwrap();
    let acc_d = gpu.stream.alloc_zeros::<f64>(SLOT).unwrap();
    let p = |s: &CudaSlice<f32>| Arg::Ptr(gpu.ptr(s));
    gpu.launch(
        &gpu.k.action_log_probs,
        grid(n),
        &[p(&heads_d), int(a + 1), int(a), Arg::Ptr(gpu.ptr(&actions_d)), p(&behaviour_d), p(&log_rhos_d), int(n)],
    )
    .unwrap();
    assert_close("log rhos", &download(&gpu, &log_rhos_d, n), workspace.log_rhos(), 1e-5, 1e-5);
    let v = config.vtrace;
    gpu.launch(
        &gpu.k.vtrace_scan,
        grid(b_len),
        &[
            int(t_len),
            int(b_len),
            p(&log_rhos_d),
            p(&discounts_d),
            p(&rewards_d),
            p(&values_d),
            Arg::Ptr(at(gpu.ptr(&values_d), n)),
            Arg::F32(v.clip_rho_threshold),
            Arg::F32(v.clip_pg_rho_threshold),
            Arg::F32(v.clip_c_threshold),
            Arg::F32(v.lambda_),
            p(&vs_d),
            p(&adv_d),
        ],
    )
    .unwrap();
    let acc = gpu.ptr(&acc_d);
    gpu.launch(&gpu.k.weighted_sum, grid(n), &[p(&weights_d), Arg::Ptr(0), int(n), Arg::Ptr(acc)]).unwrap();
    gpu.launch(
        &gpu.k.vtrace_loss_grad,
        grid(n_rows),
        &[
            p(&heads_d),
            int(a + 1),
            int(a),
            Arg::Ptr(gpu.ptr(&actions_d)),
            p(&weights_d),
            p(&values_d),
            p(&vs_d),
            p(&log_rhos_d),
            p(&adv_d),
            Arg::F32(v.clip_rho_threshold),
            Arg::F32(config.value_coef),
            Arg::F32(config.ent_coef),
            int(n),
            int(n_rows),
            Arg::Ptr(acc),
            p(&d_heads_d),
            Arg::Ptr(acc + 8 * SLOT_STATS as u64),
        ],
    )
    .unwrap();
    let (g_dlogits, g_dvalues) = split_grads(&download(&gpu, &d_heads_d, n_rows * (a + 1)), a);
    assert_close("vtrace dlogits", &g_dlogits, &dlogits, 1e-4, 1e-7);
    assert_close("vtrace dvalues", &g_dvalues, &dvalues, 1e-4, 1e-7);
    let sums = gpu.stream.clone_dtoh(&acc_d).unwrap();
    assert_stats_close("vtrace", &stats_from_slot(&sums, config.value_coef, config.ent_coef), &cpu);

    // PPO: proximal log-probs, behaviour weights, moments and the fused clipped loss.
    let (ppo_heads, ppo_logits, ppo_values) = heads_block(&mut r, n, a);
    let prox: Vec<f32> = ppo_logits
        .chunks_exact(a)
        .zip(&actions)
        .map(|(row, &act)| {
            let mut lp = vec![0.0; a];
            volley_policy::distributions::log_softmax(row, &mut lp);
            lp[act as usize] + r.random_range(-0.3..0.3)
        })
        .collect();
    let mut is_weights = vec![0.0; n];
    losses::behaviour_is_weights(&prox, &behaviour, 1.0, &mut is_weights);
    let advantages = uniform(&mut r, n, -2.0, 3.0);
    let returns = uniform(&mut r, n, -2.0, 2.0);
    let ppo_config = PpoLossConfig::default();
    let targets =
        PpoTargets { advantages: &advantages, returns: &returns, prox_log_probs: &prox, is_weights: &is_weights };
    let (mut dlogits, mut dvalues) = (vec![0.0; n * a], vec![0.0; n]);
    let cpu = losses::ppo_loss(&batch, &targets, &ppo_logits, &ppo_values, &ppo_config, &mut dlogits, &mut dvalues);
    let (ppo_heads_d, ppo_values_d, prox_d, adv_in_d, ret_d) = (
        upload(&gpu, &ppo_heads),
        upload(&gpu, &ppo_values),
        upload(&gpu, &prox),
        upload(&gpu, &advantages),
        upload(&gpu, &returns),
    );
    let is_w_d = gpu.alloc(n).unwrap();
    gpu.launch(&gpu.k.behaviour_weights, grid(n), &[p(&prox_d), p(&behaviour_d), Arg::F32(1.0), p(&is_w_d), int(n)])
        .unwrap();
    assert_close("behaviour weights", &download(&gpu, &is_w_d, n), &is_weights, 1e-5, 1e-6);
    let lp_d = gpu.alloc(n).unwrap();
    gpu.launch(
        &gpu.k.action_log_probs,
        grid(n),
        &[p(&ppo_heads_d), int(a + 1), int(a), Arg::Ptr(gpu.ptr(&actions_d)), Arg::Ptr(0), p(&lp_d), int(n)],
    )
    .unwrap();
    let cpu_lp: Vec<f32> = ppo_logits
        .chunks_exact(a)
        .zip(&actions)
        .map(|(row, &act)| {
            let mut lp = vec![0.0; a];
            volley_policy::distributions::log_softmax(row, &mut lp);
            lp[act as usize]
        })
        .collect();
    assert_close("action log-probs", &download(&gpu, &lp_d, n), &cpu_lp, 1e-5, 1e-5);
    let acc_d = gpu.stream.alloc_zeros::<f64>(SLOT).unwrap();
    let acc = gpu.ptr(&acc_d);
    gpu.launch(&gpu.k.weighted_sum, grid(n), &[p(&weights_d), p(&adv_in_d), int(n), Arg::Ptr(acc)]).unwrap();
    gpu.launch(&gpu.k.weighted_var, grid(n), &[p(&weights_d), p(&adv_in_d), int(n), Arg::Ptr(acc)]).unwrap();
    let d_heads_d = gpu.alloc(n * (a + 1)).unwrap();
    gpu.launch(
        &gpu.k.ppo_loss_grad,
        grid(n),
        &[
            p(&ppo_heads_d),
            int(a + 1),
            int(a),
            Arg::Ptr(gpu.ptr(&actions_d)),
            p(&weights_d),
            p(&ppo_values_d),
            p(&adv_in_d),
            p(&ret_d),
            p(&prox_d),
            p(&is_w_d),
            Arg::F32(ppo_config.clip_coef),
            Arg::F32(ppo_config.value_coef),
            Arg::F32(ppo_config.ent_coef),
            Arg::I32(1),
            int(n),
            Arg::Ptr(acc),
            p(&d_heads_d),
            Arg::Ptr(acc + 8 * SLOT_STATS as u64),
        ],
    )
    .unwrap();
    let (g_dlogits, g_dvalues) = split_grads(&download(&gpu, &d_heads_d, n * (a + 1)), a);
    assert_close("ppo dlogits", &g_dlogits, &dlogits, 1e-4, 1e-7);
    assert_close("ppo dvalues", &g_dvalues, &dvalues, 1e-4, 1e-7);
    let sums = gpu.stream.clone_dtoh(&acc_d).unwrap();
    assert_stats_close("ppo", &stats_from_slot(&sums, ppo_config.value_coef, ppo_config.ent_coef), &cpu);
}

#[test]
fn clipped_adam_matches_the_cpu_optimiser_and_skips_non_finite_gradients() {
    let Some(device) = device_or_skip("clipped_adam_matches_the_cpu_optimiser_and_skips_non_finite_gradients") else {
        return;
    };
    let spec =
        PolicySpec { obs_dim: 4, n_actions: 2, torso: vec![64, 64], activation: Activation::Tanh, core: CoreKind::Mlp };
    let layout = ParamLayout::new(&spec).unwrap();
    let mut r = rng(5);
    let params = random_params(&layout, &mut r);
    let n = params.len();
    let h = HyperParams { max_grad_norm: 0.5, ..HyperParams::default() };
    let config = AdamConfig { beta1: h.adam_beta1, beta2: h.adam_beta2, eps: h.adam_eps };
    let mut cpu_params = params.clone();
    let mut cpu_adam = Adam::new(n, config);
    let mut engine = CudaEngine::new(&device, &layout, &state_for(&params)).unwrap();
    let gpu = engine.gpu.clone();
    let acc_d = gpu.stream.alloc_zeros::<f64>(4 * SLOT).unwrap();
    for step in 0..4 {
        // Step 0 is clipped (norm ≫ 0.5), step 1 is not, step 2 is non-finite and skipped.
        let scale = [3.0, 0.001, 1.0, 0.5][step];
        let mut grads = uniform(&mut r, n, -scale, scale);
        if step == 2 {
            grads[n / 2] = f32::NAN;
        }
        gpu.stream.memcpy_htod(&grads, &mut engine.grads).unwrap();
        let lr = 1e-3 * (step + 1) as f32;
        let cpu_norm = clip_grad_global_norm(&mut grads, h.max_grad_norm);
        if cpu_norm.is_finite() {
            cpu_adam.step(&mut cpu_params, &grads, lr);
        }
        engine.apply_gradients(&h, lr, gpu.ptr(&acc_d) + (8 * SLOT * step) as u64, step).unwrap();
        let norms = grow_download(&gpu, &engine.norms, step + 1);
        assert_eq!(norms[step].is_finite(), cpu_norm.is_finite(), "step {step}");
        if cpu_norm.is_finite() {
            assert_close(&format!("norm {step}"), &norms[step..=step], &[cpu_norm], 1e-5, 0.0);
        }
        let state = engine.download().unwrap();
        assert_close(&format!("params after step {step}"), &state.params, &cpu_params, 1e-5, 1e-7);
        assert_close(&format!("adam m after step {step}"), &state.adam_m, &cpu_adam.state().m, 1e-4, 1e-9);
        assert_close(&format!("adam v after step {step}"), &state.adam_v, &cpu_adam.state().v, 1e-4, 1e-12);
        assert_eq!(state.adam_t, cpu_adam.state().t, "step count after step {step}");
    }
}

fn run_spec(policy: PolicySpec, loss: LossKind, t_len: usize, b_len: usize) -> RunSpec {
    RunSpec {
        run: RunId::new("parity").expect("valid run id"),
        env: EnvConfig::Cartpole,
        policy,
        segment_len: t_len,
        hyper: HyperParams {
            loss,
            batch_segments: b_len,
            ppo_epochs: 2,
            ppo_minibatches: 3,
            learning_rate: 3e-4,
            final_learning_rate: 3e-4,
            ..HyperParams::default()
        },
        seed: 9,
    }
}

fn random_batch(r: &mut Pcg64Mcg, spec: &RunSpec, hidden: usize) -> SegmentBatch {
    let (t_len, b_len) = (spec.segment_len, spec.hyper.batch_segments);
    let (d, a) = (spec.policy.obs_dim, spec.policy.n_actions);
    let steps = t_len * b_len;
    SegmentBatch {
        t_len,
        b_len,
        obs_dim: d,
        hidden_size: hidden,
        observations: uniform(r, (t_len + 1) * b_len * d, -1.0, 1.0),
        episode_start: (0..(t_len + 1) * b_len).map(|i| f32::from(i % 9 == 4)).collect(),
        initial_hidden: uniform(r, b_len * hidden, -0.5, 0.5),
        actions: (0..steps).map(|_| r.random_range(0..a as u32)).collect(),
        behaviour_log_probs: uniform(r, steps, -(a as f32).ln() - 0.3, -(a as f32).ln() + 0.3),
        rewards: uniform(r, steps, -1.0, 1.0),
        discounts: (0..steps).map(|i| if i % 23 == 7 { 0.0 } else { 0.99 }).collect(),
        sample_weights: (0..steps).map(|i| if i % 31 == 0 { 0.0 } else { 1.0 }).collect(),
        policy_versions: vec![PolicyVersion(0); b_len],
    }
}

/// CartPole-shaped policies (the run spec checks them against the env): an MLP and a GRU.
fn cartpole_policies() -> [PolicySpec; 2] {
    [
        PolicySpec { obs_dim: 4, n_actions: 2, torso: vec![32, 16], activation: Activation::Tanh, core: CoreKind::Mlp },
        PolicySpec::gru(4, 2, &[16], Activation::Tanh, 12),
    ]
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
                let c = cpu.update(&batch);
                let g = gpu.update(&batch);
                let name = format!("{loss:?} {:?} update {update}", spec.policy.core);
                assert_stats_close(&name, &g.loss, &c.loss);
                assert_close(&format!("{name} grad norm"), &[g.grad_norm], &[c.grad_norm], 1e-3, 1e-6);
                assert_eq!(g.skipped_steps, c.skipped_steps, "{name}");
                // Adam's first steps are ±lr per parameter whatever the gradient's size, so a
                // parameter whose gradient is rounding noise may step either way on the two
                // backends: require all but a few parameters to agree closely.
                let (gp, cp) = (gpu.params().to_vec(), cpu.params().to_vec());
                let off = gp.iter().zip(&cp).filter(|(a, b)| (*a - *b).abs() > 1e-5 + 1e-3 * b.abs()).count();
                let mean_diff = gp.iter().zip(&cp).map(|(a, b)| (a - b).abs()).sum::<f32>() / gp.len() as f32;
                assert!(
                    (off as f32) < 0.02 * gp.len() as f32,
                    "{name}: {off} of {} parameters differ (mean |Δ| {mean_diff})",
                    gp.len()
                );
            }
            // A checkpoint from the device has the device's optimiser state.
            let checkpoint = gpu.checkpoint(0);
            assert_eq!(checkpoint.adam_t, cpu.checkpoint(0).adam_t);
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
    assert!(timing.gemm_flops > 0);
}
