//! The CUDA backend: the whole V-trace or PPO update on one GPU.
//!
//! Parameters, gradients, Adam's moments and step count, activations and loss intermediates
//! live in device memory for the learner's lifetime. An update uploads one packed batch
//! (a page-locked host buffer, one asynchronous copy on a copy stream that the compute stream
//! waits on through an event) and reads back only a few dozen numbers of statistics; weights
//! come back to the host only when the learner publishes or checkpoints them.
//!
//! Matrix products are cuBLAS `sgemm` calls in plain f32 (no TF32, so results stay within
//! f32 rounding of the CPU backend); everything element-wise is one of our kernels in
//! `learner/kernels/` (see [`super::kernels`]). The network and loss follow the CPU backend
//! step for step (`core/src/policy/tape.rs`, `learner/src/losses.rs`, `learner/src/optim.rs`),
//! so the two are interchangeable and tested against each other (`cuda_tests.rs`).
//!
//! Row-major products through column-major cuBLAS: a row-major `M[r×c]` is the column-major
//! `Mᵀ[c×r]` with leading dimension `c`, so `Y = X Wᵀ` is computed as `Yᵀ = W Xᵀ`, and so on
//! (see `Gpu::gemm_xwt`, `Gpu::gemm_dw` and `Gpu::gemm_dx`).

use std::sync::Arc;

use cudarc::cublas::sys::cublasOperation_t;
use cudarc::cublas::CudaBlas;
use cudarc::driver::{
    CudaContext, CudaEvent, CudaFunction, CudaModule, CudaSlice, CudaStream, DevicePtr, LaunchConfig, PinnedHostSlice,
    PushKernelArg,
};
use rand::seq::SliceRandom;
use rand_pcg::Pcg64Mcg;
use volley_core::spec::{HyperParams, LossKind};
use volley_policy::{Activation, CoreKind, ParamLayout};

use super::kernels::{self, KernelError};
use super::BackendError;
use crate::batch::SegmentBatch;
use crate::losses::{LossStats, WeightedSums};

const BLOCK: u32 = 256;
/// Doubles per loss evaluation in the accumulator array: `[W, Σ w·x, Σ w·(x − mean)²,
/// policy, value, entropy, ratio, clipped, approx_kl, Σ g²]` plus padding.
const SLOT: usize = 12;
const SLOT_SUMSQ: usize = 9;
const SLOT_STATS: usize = 3;

/// A CUDA device with the learner's kernels compiled and loaded, and a cuBLAS handle.
pub struct CudaDevice {
    gpu: Arc<Gpu>,
}

impl std::fmt::Debug for CudaDevice {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CudaDevice").field("description", &self.description()).finish()
    }
}

impl CudaDevice {
    /// Open device `ordinal`, compile the kernels for its architecture and load them.
    /// Callers go through [`super::open_cuda`], which checks the libraries first.
    pub(crate) fn open(ordinal: usize) -> Result<Self> {
        let count = CudaContext::device_count()?;
        if count <= 0 || ordinal >= count as usize {
            return Err(BackendError::NoDevice { visible: std::env::var("CUDA_VISIBLE_DEVICES").ok() });
        }
        let ctx = CudaContext::new(ordinal)?;
        // One compute stream and one copy stream, ordered by explicit events: cudarc's
        // per-buffer event tracking would add two event records per kernel argument.
        // SAFETY: every cross-stream dependency below is an explicit event wait.
        unsafe { ctx.disable_event_tracking() };
        let (major, minor) = ctx.compute_capability()?;
        let name = ctx.name()?;
        let arch: &'static str = Box::leak(format!("sm_{major}{minor}").into_boxed_str());
        let ptx = kernels::compile_module(Some(arch))?;
        let module = ctx.load_module(ptx)?;
        let stream = ctx.new_stream()?;
        let copy_stream = ctx.new_stream()?;
        let blas = CudaBlas::new(stream.clone())?;
        let k = Kernels::load(&module)?;
        Ok(CudaDevice {
            gpu: Arc::new(Gpu {
                description: format!("{name} (sm_{major}{minor}, device {ordinal})"),
                ctx,
                stream,
                copy_stream,
                blas,
                k,
                _module: module,
            }),
        })
    }

    /// The device's name, architecture and ordinal.
    pub fn description(&self) -> &str {
        &self.gpu.description
    }
}

/// Loaded kernel handles, one field per kernel in `learner/kernels/`.
struct Kernels {
    bias_act_fwd: CudaFunction,
    act_bwd: CudaFunction,
    take_column: CudaFunction,
    gather_columns: CudaFunction,
    fill: CudaFunction,
    gru_reset_copy: CudaFunction,
    gru_cell_fwd: CudaFunction,
    gru_cell_bwd: CudaFunction,
    gru_carry_grad: CudaFunction,
    action_log_probs: CudaFunction,
    behaviour_weights: CudaFunction,
    vtrace_scan: CudaFunction,
    gae_scan: CudaFunction,
    weighted_sum: CudaFunction,
    weighted_var: CudaFunction,
    vtrace_loss_grad: CudaFunction,
    ppo_loss_grad: CudaFunction,
    sum_squares: CudaFunction,
    adam_prepare: CudaFunction,
    adam_step: CudaFunction,
}

impl Kernels {
    fn load(module: &Arc<CudaModule>) -> Result<Self> {
        let f = |name: &str| {
            module.load_function(name).map_err(|err| {
                BackendError::Kernels(KernelError::MissingKernel {
                    file: format!("module ({err})"),
                    kernel: name.into(),
                })
            })
        };
        Ok(Kernels {
            bias_act_fwd: f("bias_act_fwd")?,
            act_bwd: f("act_bwd")?,
            take_column: f("take_column")?,
            gather_columns: f("gather_columns")?,
            fill: f("fill")?,
            gru_reset_copy: f("gru_reset_copy")?,
            gru_cell_fwd: f("gru_cell_fwd")?,
            gru_cell_bwd: f("gru_cell_bwd")?,
            gru_carry_grad: f("gru_carry_grad")?,
            action_log_probs: f("action_log_probs")?,
            behaviour_weights: f("behaviour_weights")?,
            vtrace_scan: f("vtrace_scan")?,
            gae_scan: f("gae_scan")?,
            weighted_sum: f("weighted_sum")?,
            weighted_var: f("weighted_var")?,
            vtrace_loss_grad: f("vtrace_loss_grad")?,
            ppo_loss_grad: f("ppo_loss_grad")?,
            sum_squares: f("sum_squares")?,
            adam_prepare: f("adam_prepare")?,
            adam_step: f("adam_step")?,
        })
    }
}

/// A kernel argument: device pointers travel as `u64` (`CUdeviceptr`), the rest by value.
#[derive(Clone, Copy)]
pub(crate) enum Arg {
    Ptr(u64),
    I32(i32),
    I64(i64),
    F32(f32),
}

/// A device pointer `offset` `f32`/`u32` words past `base` (0 stays the null pointer).
fn at(base: u64, offset: usize) -> u64 {
    base + 4 * offset as u64
}

fn int(n: usize) -> Arg {
    Arg::I32(i32::try_from(n).expect("sizes handed to kernels fit in i32 (checked when the batch is staged)"))
}

pub(crate) struct Gpu {
    description: String,
    ctx: Arc<CudaContext>,
    stream: Arc<CudaStream>,
    copy_stream: Arc<CudaStream>,
    blas: CudaBlas,
    k: Kernels,
    _module: Arc<CudaModule>,
}

type Result<T> = std::result::Result<T, BackendError>;

/// Grid for a grid-stride loop over `n` elements.
fn grid(n: usize) -> LaunchConfig {
    let blocks = n.div_ceil(BLOCK as usize).clamp(1, 65_535 * 8) as u32;
    LaunchConfig { grid_dim: (blocks, 1, 1), block_dim: (BLOCK, 1, 1), shared_mem_bytes: 0 }
}

impl Gpu {
    fn launch(&self, f: &CudaFunction, cfg: LaunchConfig, args: &[Arg]) -> Result<()> {
        let mut builder = self.stream.launch_builder(f);
        for arg in args {
            match arg {
                Arg::Ptr(p) => builder.arg(p),
                Arg::I32(v) => builder.arg(v),
                Arg::I64(v) => builder.arg(v),
                Arg::F32(v) => builder.arg(v),
            };
        }
        // SAFETY: every kernel's parameter list matches the argument list its caller builds
        // (checked by the parity tests), and every pointer addresses a live allocation of this
        // context large enough for the sizes passed alongside it.
        unsafe { builder.launch(cfg) }?;
        Ok(())
    }

    fn alloc(&self, n: usize) -> Result<CudaSlice<f32>> {
        Ok(self.stream.alloc_zeros::<f32>(n.max(1))?)
    }

    fn ptr<T>(&self, slice: &CudaSlice<T>) -> u64 {
        let (ptr, _guard) = slice.device_ptr(&self.stream);
        ptr
    }

    #[allow(clippy::too_many_arguments)]
    fn sgemm(
        &self,
        transa: cublasOperation_t,
        transb: cublasOperation_t,
        m: usize,
        n: usize,
        k: usize,
        a: u64,
        lda: usize,
        b: u64,
        ldb: usize,
        beta: f32,
        c: u64,
        ldc: usize,
    ) -> Result<()> {
        if m == 0 || n == 0 {
            return Ok(());
        }
        let dim = |x: usize| i32::try_from(x).expect("matrix dimensions fit in i32");
        let alpha = 1.0f32;
        // SAFETY: the handle is bound to our compute stream; the pointers address device
        // buffers holding at least the `m×k`, `k×n` and `m×n` operands at the given leading
        // dimensions (the callers size every buffer from the layout and batch shape).
        unsafe {
            cudarc::cublas::result::sgemm(
                *self.blas.handle(),
                transa,
                transb,
                dim(m),
                dim(n),
                dim(k),
                &alpha,
                a as *const f32,
                dim(lda),
                b as *const f32,
                dim(ldb),
                &beta,
                c as *mut f32,
                dim(ldc),
            )
        }?;
        Ok(())
    }

    #[allow(clippy::too_many_arguments)]
    /// `Y[rows×n_out] = X[rows×n_in] · Wᵀ` (+ `beta · Y`), `W: [n_out×n_in]` row-major.
    fn gemm_xwt(&self, x: u64, rows: usize, n_in: usize, w: u64, n_out: usize, y: u64, beta: f32) -> Result<()> {
        use cublasOperation_t::{CUBLAS_OP_N, CUBLAS_OP_T};
        self.sgemm(CUBLAS_OP_T, CUBLAS_OP_N, n_out, rows, n_in, w, n_in, x, n_in, beta, y, n_out)
    }

    /// `dW[n_out×n_in] = dYᵀ · X` over `rows` rows (overwrites).
    fn gemm_dw(&self, dy: u64, rows: usize, n_out: usize, x: u64, n_in: usize, dw: u64) -> Result<()> {
        use cublasOperation_t::{CUBLAS_OP_N, CUBLAS_OP_T};
        self.sgemm(CUBLAS_OP_N, CUBLAS_OP_T, n_in, n_out, rows, x, n_in, dy, n_out, 0.0, dw, n_in)
    }

    #[allow(clippy::too_many_arguments)]
    /// `dX[rows×n_in] = dY[rows×n_out] · W` (+ `beta · dX`).
    fn gemm_dx(&self, dy: u64, rows: usize, n_out: usize, w: u64, n_in: usize, dx: u64, beta: f32) -> Result<()> {
        use cublasOperation_t::CUBLAS_OP_N;
        self.sgemm(CUBLAS_OP_N, CUBLAS_OP_N, n_in, rows, n_out, w, n_in, dy, n_out, beta, dx, n_in)
    }

    /// `out[width] = Σ_r dY[r][·]` through a product with a ones vector of at least `rows`.
    fn column_sums(&self, dy: u64, rows: usize, width: usize, ones: u64, out: u64) -> Result<()> {
        use cublasOperation_t::CUBLAS_OP_N;
        self.sgemm(CUBLAS_OP_N, CUBLAS_OP_N, width, 1, rows, dy, width, ones, rows, 0.0, out, width)
    }

    fn bias_act(&self, y: u64, bias: u64, rows: usize, width: usize, act: i32) -> Result<()> {
        let n = rows * width;
        self.launch(&self.k.bias_act_fwd, grid(n), &[Arg::Ptr(y), Arg::Ptr(bias), int(rows), int(width), Arg::I32(act)])
    }
}

/// Offsets of one dense layer in the flat parameter buffer.
#[derive(Debug, Clone, Copy)]
struct Dense {
    weight: usize,
    bias: usize,
    n_in: usize,
    n_out: usize,
}

#[derive(Debug, Clone, Copy)]
struct GruParams {
    weight_ih: usize,
    weight_hh: usize,
    bias_ih: usize,
    bias_hh: usize,
    n_in: usize,
    hidden: usize,
}

/// The network's shape, read from the public layout entries.
#[derive(Debug, Clone)]
struct Net {
    obs_dim: usize,
    n_actions: usize,
    torso: Vec<Dense>,
    gru: Option<GruParams>,
    /// Policy and value heads fused: `[A + 1][F']`, bias `[A + 1]`.
    heads: Dense,
    act: i32,
}

impl Net {
    fn new(layout: &ParamLayout) -> Self {
        let spec = layout.spec();
        let entry = |name: &str| layout.entry(name).unwrap_or_else(|| panic!("layout has no `{name}` entry"));
        let mut n_in = spec.obs_dim;
        let torso = (0..spec.torso.len())
            .map(|i| {
                let weight = entry(&format!("torso.{i}.weight"));
                let dense = Dense {
                    weight: weight.offset,
                    bias: entry(&format!("torso.{i}.bias")).offset,
                    n_in,
                    n_out: weight.rows,
                };
                n_in = weight.rows;
                dense
            })
            .collect();
        let gru = match spec.core {
            CoreKind::Mlp => None,
            CoreKind::Gru { hidden } => Some(GruParams {
                weight_ih: entry("gru.weight_ih").offset,
                weight_hh: entry("gru.weight_hh").offset,
                bias_ih: entry("gru.bias_ih").offset,
                bias_hh: entry("gru.bias_hh").offset,
                n_in,
                hidden,
            }),
        };
        let features = gru.map_or(n_in, |g| g.hidden);
        let heads = Dense {
            weight: entry("policy.weight").offset,
            bias: entry("policy.bias").offset,
            n_in: features,
            n_out: spec.n_actions + 1,
        };
        Net {
            obs_dim: spec.obs_dim,
            n_actions: spec.n_actions,
            torso,
            gru,
            heads,
            act: match spec.activation {
                Activation::Tanh => 1,
                Activation::Relu => 2,
            },
        }
    }

    fn hidden(&self) -> usize {
        self.gru.map_or(0, |g| g.hidden)
    }

    /// Widest `∂L/∂(layer output)` the backward pass carries.
    fn widest(&self) -> usize {
        self.torso.iter().map(|d| d.n_out).max().unwrap_or(0).max(self.heads.n_in).max(self.obs_dim)
    }

    /// Multiply-adds of one forward over `rows` rows (the backward does about twice as many).
    fn forward_macs(&self, rows: usize) -> u64 {
        let dense: usize =
            self.torso.iter().map(|d| d.n_in * d.n_out).sum::<usize>() + self.heads.n_in * self.heads.n_out;
        let gru = self.gru.map_or(0, |g| 3 * g.hidden * (g.n_in + g.hidden));
        (rows * (dense + gru)) as u64
    }
}

/// A device buffer that grows to the largest size asked for and is reused.
struct Grow {
    buf: Option<CudaSlice<f32>>,
    len: usize,
}

impl Grow {
    fn new() -> Self {
        Grow { buf: None, len: 0 }
    }

    /// A pointer to at least `n` words.
    fn ensure(&mut self, gpu: &Gpu, n: usize) -> Result<u64> {
        if self.buf.is_none() || self.len < n {
            self.buf = Some(gpu.alloc(n)?);
            self.len = n;
        }
        Ok(gpu.ptr(self.buf.as_ref().expect("allocated above")))
    }
}

/// Where the packed batch's fields start, in 32-bit words.
#[derive(Debug, Clone, Copy, Default)]
struct Staged {
    obs: usize,
    starts: usize,
    h0: usize,
    actions: usize,
    behaviour: usize,
    rewards: usize,
    discounts: usize,
    weights: usize,
    len: usize,
}

impl Staged {
    fn layout(t_len: usize, b_len: usize, obs_dim: usize, hidden: usize) -> Self {
        let steps = t_len * b_len;
        let mut at = 0;
        let mut take = |n: usize| {
            let start = at;
            at += n;
            start
        };
        let obs = take((t_len + 1) * b_len * obs_dim);
        let starts = take((t_len + 1) * b_len);
        let h0 = take(b_len * hidden);
        let actions = take(steps);
        let behaviour = take(steps);
        let rewards = take(steps);
        let discounts = take(steps);
        let weights = take(steps);
        Staged { obs, starts, h0, actions, behaviour, rewards, discounts, weights, len: at }
    }
}

/// Device time of the last update, from CUDA events (only when profiling is on).
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct DeviceTiming {
    /// Host-to-device copy of the packed batch, milliseconds.
    pub h2d_ms: f32,
    /// Kernels and products of the update, milliseconds.
    pub compute_ms: f32,
    /// Device-to-host copy of the statistics, milliseconds.
    pub d2h_ms: f32,
    /// Floating-point operations of the network's matrix products in this update (a lower
    /// bound on the work: element-wise kernels are not counted).
    pub gemm_flops: u64,
}

struct Profile {
    events: [CudaEvent; 5],
    last: Option<DeviceTiming>,
}

/// The learner's state on the GPU and the update that runs there.
pub(crate) struct CudaEngine {
    gpu: Arc<Gpu>,
    net: Net,
    n_params: usize,
    params: CudaSlice<f32>,
    grads: CudaSlice<f32>,
    adam_m: CudaSlice<f32>,
    adam_v: CudaSlice<f32>,
    /// Adam's step count `t` (a double on the device, advanced by `adam_prepare`).
    adam_t: CudaSlice<f64>,
    coeffs: CudaSlice<f32>,
    ones: Grow,
    /// Words of `ones` known to hold 1.0 (a reallocation starts from zeros).
    ones_filled_len: usize,
    // Activations of the last forward.
    torso_out: Vec<Grow>,
    gi: Grow,
    gh: Grow,
    gates: Grow,
    h_prev: Grow,
    h_out: Grow,
    heads_out: Grow,
    values: Grow,
    /// Inputs of the last forward (pointers into a staging buffer).
    fwd: Option<ForwardInputs>,
    // Backward scratch.
    d_heads: Grow,
    d_a: Grow,
    d_b: Grow,
    d_gi: Grow,
    d_gh: Grow,
    d_h: Grow,
    // Loss scratch, [T][B] each.
    log_rhos: Grow,
    vs: Grow,
    pg_adv: Grow,
    prox: Grow,
    is_w: Grow,
    adv: Grow,
    ret: Grow,
    // PPO minibatch staging and column permutations.
    mb: Grow,
    cols: Option<CudaSlice<i32>>,
    cols_len: usize,
    // Statistics: SLOT doubles per loss evaluation, and the pre-clip norm of each gradient step.
    acc: Option<CudaSlice<f64>>,
    acc_len: usize,
    norms: Grow,
    // Batch upload: page-locked host buffer → device staging, on the copy stream.
    host_stage: Option<PinnedHostSlice<f32>>,
    stage: Option<CudaSlice<f32>>,
    uploaded: CudaEvent,
    profile: Option<Profile>,
}

#[derive(Debug, Clone, Copy)]
struct ForwardInputs {
    obs: u64,
    starts: u64,
    t_len: usize,
    b_len: usize,
}

/// What an update measured, before it is turned into [`crate::UpdateStats`].
pub(crate) struct DeviceUpdate {
    pub(crate) loss: LossStats,
    pub(crate) grad_norm: f32,
    pub(crate) skipped_steps: u32,
}

/// Host copies of everything a checkpoint needs.
pub(crate) struct DeviceState {
    pub(crate) params: Vec<f32>,
    pub(crate) adam_m: Vec<f32>,
    pub(crate) adam_v: Vec<f32>,
    pub(crate) adam_t: u64,
}

impl CudaEngine {
    /// Upload parameters and Adam state.
    pub(crate) fn new(device: &CudaDevice, layout: &ParamLayout, state: &DeviceState) -> Result<Self> {
        let gpu = device.gpu.clone();
        let n = layout.n_params();
        assert!(state.params.len() == n && state.adam_m.len() == n && state.adam_v.len() == n, "state matches layout");
        let upload = |host: &[f32]| -> Result<CudaSlice<f32>> { Ok(gpu.stream.clone_htod(host)?) };
        let net = Net::new(layout);
        let torso_out = net.torso.iter().map(|_| Grow::new()).collect();
        let engine = CudaEngine {
            params: upload(&state.params)?,
            grads: gpu.alloc(n)?,
            adam_m: upload(&state.adam_m)?,
            adam_v: upload(&state.adam_v)?,
            adam_t: gpu.stream.clone_htod(&[state.adam_t as f64])?,
            coeffs: gpu.alloc(4)?,
            ones: Grow::new(),
            ones_filled_len: 0,
            torso_out,
            gi: Grow::new(),
            gh: Grow::new(),
            gates: Grow::new(),
            h_prev: Grow::new(),
            h_out: Grow::new(),
            heads_out: Grow::new(),
            values: Grow::new(),
            fwd: None,
            d_heads: Grow::new(),
            d_a: Grow::new(),
            d_b: Grow::new(),
            d_gi: Grow::new(),
            d_gh: Grow::new(),
            d_h: Grow::new(),
            log_rhos: Grow::new(),
            vs: Grow::new(),
            pg_adv: Grow::new(),
            prox: Grow::new(),
            is_w: Grow::new(),
            adv: Grow::new(),
            ret: Grow::new(),
            mb: Grow::new(),
            cols: None,
            cols_len: 0,
            acc: None,
            acc_len: 0,
            norms: Grow::new(),
            host_stage: None,
            stage: None,
            uploaded: gpu.ctx.new_event(None)?,
            profile: None,
            net,
            n_params: n,
            gpu,
        };
        engine.gpu.stream.synchronize()?;
        Ok(engine)
    }

    /// Time every update with CUDA events from now on (or stop).
    pub(crate) fn set_profiling(&mut self, on: bool) -> Result<()> {
        self.profile = if on {
            let timed = || self.gpu.ctx.new_event(Some(cudarc::driver::sys::CUevent_flags::CU_EVENT_DEFAULT));
            Some(Profile { events: [timed()?, timed()?, timed()?, timed()?, timed()?], last: None })
        } else {
            None
        };
        Ok(())
    }

    pub(crate) fn last_timing(&self) -> Option<DeviceTiming> {
        self.profile.as_ref().and_then(|p| p.last)
    }

    fn mark(&self, index: usize, stream: &CudaStream) -> Result<()> {
        if let Some(profile) = &self.profile {
            profile.events[index].record(stream)?;
        }
        Ok(())
    }

    /// Download parameters and optimiser state.
    pub(crate) fn download(&self) -> Result<DeviceState> {
        let stream = &self.gpu.stream;
        let mut t = [0.0f64];
        stream.memcpy_dtoh(&self.adam_t, &mut t)?;
        Ok(DeviceState {
            params: stream.clone_dtoh(&self.params)?,
            adam_m: stream.clone_dtoh(&self.adam_m)?,
            adam_v: stream.clone_dtoh(&self.adam_v)?,
            adam_t: t[0] as u64,
        })
    }

    /// Download the parameters only.
    pub(crate) fn download_params(&self, out: &mut [f32]) -> Result<()> {
        self.gpu.stream.memcpy_dtoh(&self.params, out)?;
        Ok(())
    }

    /// Pack the batch into the page-locked buffer and copy it to the device on the copy stream;
    /// the compute stream waits for the copy through an event.
    fn upload(&mut self, batch: &SegmentBatch) -> Result<(Staged, u64)> {
        let (t_len, b_len) = (batch.t_len, batch.b_len);
        let staged = Staged::layout(t_len, b_len, self.net.obs_dim, self.net.hidden());
        assert!(staged.len < i32::MAX as usize, "batch of {} words is too large for one upload", staged.len);
        if self.host_stage.as_ref().is_none_or(|h| h.len() != staged.len) {
            // SAFETY: page-locked memory of plain f32s; every word is written below before use.
            self.host_stage = Some(unsafe { self.gpu.ctx.alloc_pinned::<f32>(staged.len) }?);
            self.stage = Some(self.gpu.alloc(staged.len)?);
            // The copy stream must not touch the buffer before its stream-ordered allocation.
            self.gpu.stream.synchronize()?;
        }
        let host = self.host_stage.as_mut().expect("allocated above");
        // Waits for the previous copy out of this buffer to finish before handing it out.
        let words = host.as_mut_slice()?;
        let put = |words: &mut [f32], at: usize, src: &[f32]| words[at..at + src.len()].copy_from_slice(src);
        put(words, staged.obs, &batch.observations[..(t_len + 1) * b_len * self.net.obs_dim]);
        put(words, staged.starts, &batch.episode_start[..(t_len + 1) * b_len]);
        put(words, staged.h0, &batch.initial_hidden[..b_len * self.net.hidden()]);
        for (word, &action) in words[staged.actions..staged.actions + t_len * b_len].iter_mut().zip(&batch.actions) {
            assert!((action as usize) < self.net.n_actions, "action {action} out of range (segments are validated)");
            *word = f32::from_bits(action);
        }
        put(words, staged.behaviour, &batch.behaviour_log_probs[..t_len * b_len]);
        put(words, staged.rewards, &batch.rewards[..t_len * b_len]);
        put(words, staged.discounts, &batch.discounts[..t_len * b_len]);
        put(words, staged.weights, &batch.sample_weights[..t_len * b_len]);
        let stage = self.stage.as_mut().expect("allocated above");
        // No update reads the staging buffer any more: each one ends with a blocking read-back.
        if let Some(profile) = &self.profile {
            profile.events[0].record(&self.gpu.copy_stream)?;
        }
        self.gpu.copy_stream.memcpy_htod(&*host, stage)?;
        if let Some(profile) = &self.profile {
            profile.events[1].record(&self.gpu.copy_stream)?;
        }
        self.uploaded.record(&self.gpu.copy_stream)?;
        self.gpu.stream.wait(&self.uploaded)?;
        let base = self.gpu.ptr(self.stage.as_ref().expect("allocated above"));
        Ok((staged, base))
    }

    fn ensure_acc(&mut self, evaluations: usize) -> Result<u64> {
        let n = evaluations * SLOT;
        if self.acc.is_none() || self.acc_len < n {
            self.acc = Some(self.gpu.stream.alloc_zeros::<f64>(n)?);
            self.acc_len = n;
        }
        let acc = self.acc.as_mut().expect("allocated above");
        self.gpu.stream.memset_zeros(acc)?;
        Ok(self.gpu.ptr(acc))
    }

    /// One whole update from `batch`; `rng` shuffles PPO's minibatch columns exactly as the CPU
    /// backend does, so both backends see the same minibatches.
    pub(crate) fn update(
        &mut self,
        batch: &SegmentBatch,
        hyper: &HyperParams,
        learning_rate: f32,
        rng: &mut Pcg64Mcg,
    ) -> Result<DeviceUpdate> {
        let (staged, base) = self.upload(batch)?;
        self.mark(2, &self.gpu.stream.clone())?;
        let evaluations = match hyper.loss {
            LossKind::Vtrace => {
                let acc = self.ensure_acc(1)?;
                self.norms.ensure(&self.gpu, 1)?;
                self.vtrace_step(batch.t_len, batch.b_len, &staged, base, hyper, learning_rate, acc)?;
                1
            }
            LossKind::Ppo => self.ppo_update(batch.t_len, batch.b_len, &staged, base, hyper, learning_rate, rng)?,
        };
        self.mark(3, &self.gpu.stream.clone())?;
        let mut sums = vec![0.0f64; evaluations * SLOT];
        let mut norms = vec![0.0f32; evaluations];
        {
            let acc = self.acc.as_ref().expect("allocated by the step");
            self.gpu.stream.memcpy_dtoh(&acc.slice(..evaluations * SLOT), &mut sums[..])?;
            let norms_dev = self.norms.buf.as_ref().expect("allocated by the step");
            self.gpu.stream.memcpy_dtoh(&norms_dev.slice(..evaluations), &mut norms[..])?;
        }
        self.mark(4, &self.gpu.stream.clone())?;
        if let Some(profile) = &mut self.profile {
            self.gpu.stream.synchronize()?;
            let e = &profile.events;
            // Both losses run one forward over T+1 rows; PPO (the proximal pass) then runs
            // forward and backward per epoch over T rows.
            let rows = (batch.t_len + 1) * batch.b_len;
            let backward_rows = match hyper.loss {
                LossKind::Vtrace => rows,
                LossKind::Ppo => batch.t_len * batch.b_len * hyper.ppo_epochs as usize,
            };
            let macs = self.net.forward_macs(rows) + 3 * self.net.forward_macs(backward_rows);
            profile.last = Some(DeviceTiming {
                h2d_ms: e[0].elapsed_ms(&e[1])?,
                compute_ms: e[2].elapsed_ms(&e[3])?,
                d2h_ms: e[3].elapsed_ms(&e[4])?,
                gemm_flops: 2 * macs,
            });
        }
        // The same bookkeeping as the CPU backend: statistics of applied steps only.
        let (value_coef, ent_coef) = (hyper.value_coef, hyper.ent_coef);
        let mut total = LossStats::default();
        let (mut norm_sum, mut applied, mut skipped) = (0.0f32, 0u32, 0u32);
        for (slot, &norm) in sums.chunks_exact(SLOT).zip(&norms) {
            if !norm.is_finite() {
                skipped += 1;
                continue;
            }
            applied += 1;
            norm_sum += norm;
            let weight_sum = slot[0];
            let loss = if weight_sum <= 0.0 {
                LossStats { weight_sum: weight_sum as f32, evaluations: 1, ..LossStats::default() }
            } else {
                let s = &slot[SLOT_STATS..];
                WeightedSums { policy: s[0], value: s[1], entropy: s[2], ratio: s[3], clipped: s[4], approx_kl: s[5] }
                    .finish(weight_sum, value_coef, ent_coef)
            };
            total.accumulate(&loss);
        }
        Ok(DeviceUpdate {
            loss: total.mean(),
            grad_norm: if applied > 0 { norm_sum / applied as f32 } else { f32::NAN },
            skipped_steps: skipped,
        })
    }

    #[allow(clippy::too_many_arguments)]
    fn vtrace_step(
        &mut self,
        t_len: usize,
        b_len: usize,
        s: &Staged,
        base: u64,
        h: &HyperParams,
        learning_rate: f32,
        acc: u64,
    ) -> Result<()> {
        let n = t_len * b_len;
        let n_rows = n + b_len;
        let a = self.net.n_actions;
        self.forward(at(base, s.obs), at(base, s.starts), at(base, s.h0), t_len + 1, b_len)?;
        let gpu = self.gpu.clone();
        let heads = self.heads_out.ensure(&gpu, 0)?;
        let values = self.values.ensure(&gpu, 0)?;
        let log_rhos = self.log_rhos.ensure(&gpu, n)?;
        let vs = self.vs.ensure(&gpu, n)?;
        let pg_adv = self.pg_adv.ensure(&gpu, n)?;
        let d_heads = self.d_heads.ensure(&gpu, n_rows * (a + 1))?;
        let actions = at(base, s.actions);
        gpu.launch(
            &gpu.k.action_log_probs,
            grid(n),
            &[
                Arg::Ptr(heads),
                int(a + 1),
                int(a),
                Arg::Ptr(actions),
                Arg::Ptr(at(base, s.behaviour)),
                Arg::Ptr(log_rhos),
                int(n),
            ],
        )?;
        gpu.launch(
            &gpu.k.vtrace_scan,
            grid(b_len),
            &[
                int(t_len),
                int(b_len),
                Arg::Ptr(log_rhos),
                Arg::Ptr(at(base, s.discounts)),
                Arg::Ptr(at(base, s.rewards)),
                Arg::Ptr(values),
                Arg::Ptr(at(values, n)),
                Arg::F32(h.clip_rho_threshold),
                Arg::F32(h.clip_pg_rho_threshold),
                Arg::F32(h.clip_c_threshold),
                Arg::F32(h.vtrace_lambda),
                Arg::Ptr(vs),
                Arg::Ptr(pg_adv),
            ],
        )?;
        let weights = at(base, s.weights);
        gpu.launch(&gpu.k.weighted_sum, grid(n), &[Arg::Ptr(weights), Arg::Ptr(0), int(n), Arg::Ptr(acc)])?;
        gpu.launch(
            &gpu.k.vtrace_loss_grad,
            grid(n_rows),
            &[
                Arg::Ptr(heads),
                int(a + 1),
                int(a),
                Arg::Ptr(actions),
                Arg::Ptr(weights),
                Arg::Ptr(values),
                Arg::Ptr(vs),
                Arg::Ptr(log_rhos),
                Arg::Ptr(pg_adv),
                Arg::F32(h.clip_rho_threshold),
                Arg::F32(h.value_coef),
                Arg::F32(h.ent_coef),
                int(n),
                int(n_rows),
                Arg::Ptr(acc),
                Arg::Ptr(d_heads),
                Arg::Ptr(acc + 8 * SLOT_STATS as u64),
            ],
        )?;
        self.backward()?;
        self.apply_gradients(h, learning_rate, acc, 0)
    }

    #[allow(clippy::too_many_arguments)]
    fn ppo_update(
        &mut self,
        t_len: usize,
        b_len: usize,
        s: &Staged,
        base: u64,
        h: &HyperParams,
        learning_rate: f32,
        rng: &mut Pcg64Mcg,
    ) -> Result<usize> {
        let gpu = self.gpu.clone();
        let n = t_len * b_len;
        let a = self.net.n_actions;
        let obs_dim = self.net.obs_dim;
        let hidden = self.net.hidden();
        // 1. Proximal policy and values: the parameters before this update.
        self.forward(at(base, s.obs), at(base, s.starts), at(base, s.h0), t_len + 1, b_len)?;
        let heads = self.heads_out.ensure(&gpu, 0)?;
        let values = self.values.ensure(&gpu, 0)?;
        let prox = self.prox.ensure(&gpu, n)?;
        let is_w = self.is_w.ensure(&gpu, n)?;
        let adv = self.adv.ensure(&gpu, n)?;
        let ret = self.ret.ensure(&gpu, n)?;
        gpu.launch(
            &gpu.k.action_log_probs,
            grid(n),
            &[Arg::Ptr(heads), int(a + 1), int(a), Arg::Ptr(at(base, s.actions)), Arg::Ptr(0), Arg::Ptr(prox), int(n)],
        )?;
        // 2. GAE against the proximal values (Schulman et al. 2016).
        gpu.launch(
            &gpu.k.gae_scan,
            grid(b_len),
            &[
                int(t_len),
                int(b_len),
                Arg::Ptr(at(base, s.discounts)),
                Arg::Ptr(at(base, s.rewards)),
                Arg::Ptr(values),
                Arg::Ptr(at(values, n)),
                Arg::F32(h.gae_lambda),
                Arg::Ptr(adv),
                Arg::Ptr(ret),
            ],
        )?;
        // 3. Behaviour weights min(π_prox/μ, clip) (Hilton et al. 2021).
        gpu.launch(
            &gpu.k.behaviour_weights,
            grid(n),
            &[Arg::Ptr(prox), Arg::Ptr(at(base, s.behaviour)), Arg::F32(h.behaviour_is_clip), Arg::Ptr(is_w), int(n)],
        )?;
        // 4. Epochs of minibatch steps over whole columns, shuffled as the CPU backend does.
        let n_minibatches = (h.ppo_minibatches as usize).clamp(1, b_len.max(1));
        let epochs = h.ppo_epochs as usize;
        let evaluations = epochs * n_minibatches;
        let mut columns: Vec<usize> = (0..b_len).collect();
        let mut permutations: Vec<i32> = Vec::with_capacity(epochs * b_len);
        for _ in 0..epochs {
            columns.shuffle(rng);
            permutations.extend(columns.iter().map(|&c| c as i32));
        }
        if permutations.is_empty() {
            return Ok(0);
        }
        if self.cols.is_none() || self.cols_len < permutations.len() {
            self.cols = Some(gpu.stream.alloc_zeros::<i32>(permutations.len())?);
            self.cols_len = permutations.len();
        }
        gpu.stream.memcpy_htod(&permutations, self.cols.as_mut().expect("allocated above"))?;
        let cols_base = gpu.ptr(self.cols.as_ref().expect("allocated above"));
        let acc = self.ensure_acc(evaluations)?;
        self.norms.ensure(&gpu, evaluations)?;
        // Minibatch staging: [obs T·mb·D | starts T·mb | h0 mb·H | actions | weights | adv | ret | prox | is_w].
        let max_mb = (0..n_minibatches).map(|mb| (mb + 1) * b_len / n_minibatches - mb * b_len / n_minibatches).max();
        let max_mb = max_mb.unwrap_or(0);
        let mb_words = t_len * max_mb * (obs_dim + 7) + max_mb * hidden;
        let mb_base = self.mb.ensure(&gpu, mb_words)?;
        let mut slot = 0;
        for epoch in 0..epochs {
            for mb in 0..n_minibatches {
                let lo = mb * b_len / n_minibatches;
                let hi = (mb + 1) * b_len / n_minibatches;
                let mb_len = hi - lo;
                let cols = at(cols_base, epoch * b_len + lo);
                let m = t_len * mb_len;
                let f_obs = mb_base;
                let f_starts = at(f_obs, m * obs_dim);
                let f_h0 = at(f_starts, m);
                let f_actions = at(f_h0, mb_len * hidden);
                let f_weights = at(f_actions, m);
                let f_adv = at(f_weights, m);
                let f_ret = at(f_adv, m);
                let f_prox = at(f_ret, m);
                let f_is_w = at(f_prox, m);
                let gather = |src: u64, dst: u64, rows: usize, width: usize| -> Result<()> {
                    gpu.launch(
                        &gpu.k.gather_columns,
                        grid(rows * mb_len * width),
                        &[Arg::Ptr(src), Arg::Ptr(dst), int(rows), int(b_len), int(width), Arg::Ptr(cols), int(mb_len)],
                    )
                };
                gather(at(base, s.obs), f_obs, t_len, obs_dim)?;
                gather(at(base, s.starts), f_starts, t_len, 1)?;
                if hidden > 0 {
                    gather(at(base, s.h0), f_h0, 1, hidden)?;
                }
                gather(at(base, s.actions), f_actions, t_len, 1)?;
                gather(at(base, s.weights), f_weights, t_len, 1)?;
                gather(adv, f_adv, t_len, 1)?;
                gather(ret, f_ret, t_len, 1)?;
                gather(prox, f_prox, t_len, 1)?;
                gather(is_w, f_is_w, t_len, 1)?;
                self.forward(f_obs, f_starts, f_h0, t_len, mb_len)?;
                let heads = self.heads_out.ensure(&gpu, 0)?;
                let values = self.values.ensure(&gpu, 0)?;
                let d_heads = self.d_heads.ensure(&gpu, m * (a + 1))?;
                let slot_acc = acc + (8 * SLOT * slot) as u64;
                gpu.launch(
                    &gpu.k.weighted_sum,
                    grid(m),
                    &[Arg::Ptr(f_weights), Arg::Ptr(f_adv), int(m), Arg::Ptr(slot_acc)],
                )?;
                if h.normalize_advantages {
                    gpu.launch(
                        &gpu.k.weighted_var,
                        grid(m),
                        &[Arg::Ptr(f_weights), Arg::Ptr(f_adv), int(m), Arg::Ptr(slot_acc)],
                    )?;
                }
                gpu.launch(
                    &gpu.k.ppo_loss_grad,
                    grid(m),
                    &[
                        Arg::Ptr(heads),
                        int(a + 1),
                        int(a),
                        Arg::Ptr(f_actions),
                        Arg::Ptr(f_weights),
                        Arg::Ptr(values),
                        Arg::Ptr(f_adv),
                        Arg::Ptr(f_ret),
                        Arg::Ptr(f_prox),
                        Arg::Ptr(f_is_w),
                        Arg::F32(h.clip_coef),
                        Arg::F32(h.value_coef),
                        Arg::F32(h.ent_coef),
                        Arg::I32(i32::from(h.normalize_advantages)),
                        int(m),
                        Arg::Ptr(slot_acc),
                        Arg::Ptr(d_heads),
                        Arg::Ptr(slot_acc + 8 * SLOT_STATS as u64),
                    ],
                )?;
                self.backward()?;
                self.apply_gradients(h, learning_rate, slot_acc, slot)?;
                slot += 1;
            }
        }
        Ok(evaluations)
    }

    /// Clip to the global norm and take an Adam step, all on the device; `slot_acc` is this
    /// evaluation's accumulator slot and `slot` its index in the norms.
    fn apply_gradients(&mut self, h: &HyperParams, learning_rate: f32, slot_acc: u64, slot: usize) -> Result<()> {
        let gpu = self.gpu.clone();
        let n = self.n_params;
        let grads = gpu.ptr(&self.grads);
        let sumsq = slot_acc + 8 * SLOT_SUMSQ as u64;
        let norms = self.norms.ensure(&gpu, slot + 1)?;
        let coeffs = gpu.ptr(&self.coeffs);
        let n64 = Arg::I64(n as i64);
        gpu.launch(&gpu.k.sum_squares, grid(n), &[Arg::Ptr(grads), n64, Arg::Ptr(sumsq)])?;
        gpu.launch(
            &gpu.k.adam_prepare,
            LaunchConfig { grid_dim: (1, 1, 1), block_dim: (32, 1, 1), shared_mem_bytes: 0 },
            &[
                Arg::Ptr(sumsq),
                Arg::Ptr(gpu.ptr(&self.adam_t)),
                Arg::Ptr(coeffs),
                Arg::Ptr(at(norms, slot)),
                Arg::F32(learning_rate),
                Arg::F32(h.max_grad_norm),
                Arg::F32(h.adam_beta1),
                Arg::F32(h.adam_beta2),
            ],
        )?;
        gpu.launch(
            &gpu.k.adam_step,
            grid(n),
            &[
                Arg::Ptr(gpu.ptr(&self.params)),
                Arg::Ptr(grads),
                Arg::Ptr(gpu.ptr(&self.adam_m)),
                Arg::Ptr(gpu.ptr(&self.adam_v)),
                Arg::Ptr(coeffs),
                Arg::F32(h.adam_beta1),
                Arg::F32(h.adam_beta2),
                Arg::F32(h.adam_eps),
                n64,
            ],
        )
    }

    /// The network over a time-major `[t_len][b_len]` sequence, recording what backward needs;
    /// fills `heads_out` (`[rows][A + 1]`) and `values` (`[rows]`).
    fn forward(&mut self, obs: u64, starts: u64, h0: u64, t_len: usize, b_len: usize) -> Result<()> {
        let gpu = self.gpu.clone();
        let rows = t_len * b_len;
        let p = gpu.ptr(&self.params);
        let mut x = obs;
        let mut width = self.net.obs_dim;
        for (layer, out) in self.net.torso.iter().zip(&mut self.torso_out) {
            let y = out.ensure(&gpu, rows * layer.n_out)?;
            gpu.gemm_xwt(x, rows, width, at(p, layer.weight), layer.n_out, y, 0.0)?;
            gpu.bias_act(y, at(p, layer.bias), rows, layer.n_out, self.net.act)?;
            x = y;
            width = layer.n_out;
        }
        if let Some(g) = self.net.gru {
            let hidden = g.hidden;
            let (state, gates) = (b_len * hidden, 3 * b_len * hidden);
            let gi = self.gi.ensure(&gpu, rows * 3 * hidden)?;
            let gh = self.gh.ensure(&gpu, rows * 3 * hidden)?;
            let gate_buf = self.gates.ensure(&gpu, rows * 3 * hidden)?;
            let h_prev = self.h_prev.ensure(&gpu, rows * hidden)?;
            let h_out = self.h_out.ensure(&gpu, rows * hidden)?;
            gpu.gemm_xwt(x, rows, width, at(p, g.weight_ih), 3 * hidden, gi, 0.0)?;
            gpu.bias_act(gi, at(p, g.bias_ih), rows, 3 * hidden, 0)?;
            for t in 0..t_len {
                let source = if t == 0 { h0 } else { at(h_out, (t - 1) * state) };
                let h_prev_t = at(h_prev, t * state);
                gpu.launch(
                    &gpu.k.gru_reset_copy,
                    grid(state),
                    &[Arg::Ptr(source), Arg::Ptr(at(starts, t * b_len)), Arg::Ptr(h_prev_t), int(b_len), int(hidden)],
                )?;
                let gh_t = at(gh, t * gates);
                gpu.gemm_xwt(h_prev_t, b_len, hidden, at(p, g.weight_hh), 3 * hidden, gh_t, 0.0)?;
                gpu.bias_act(gh_t, at(p, g.bias_hh), b_len, 3 * hidden, 0)?;
                gpu.launch(
                    &gpu.k.gru_cell_fwd,
                    grid(state),
                    &[
                        Arg::Ptr(at(gi, t * gates)),
                        Arg::Ptr(gh_t),
                        Arg::Ptr(h_prev_t),
                        Arg::Ptr(at(gate_buf, t * gates)),
                        Arg::Ptr(at(h_out, t * state)),
                        int(b_len),
                        int(hidden),
                    ],
                )?;
            }
            x = h_out;
            width = hidden;
        }
        let heads = self.net.heads;
        let heads_out = self.heads_out.ensure(&gpu, rows * heads.n_out)?;
        let values = self.values.ensure(&gpu, rows)?;
        gpu.gemm_xwt(x, rows, width, at(p, heads.weight), heads.n_out, heads_out, 0.0)?;
        gpu.bias_act(heads_out, at(p, heads.bias), rows, heads.n_out, 0)?;
        gpu.launch(
            &gpu.k.take_column,
            grid(rows),
            &[Arg::Ptr(heads_out), Arg::Ptr(values), int(rows), int(heads.n_out), int(self.net.n_actions)],
        )?;
        self.fwd = Some(ForwardInputs { obs, starts, t_len, b_len });
        Ok(())
    }

    /// Backprop `d_heads` (`[rows][A + 1]`) through the last forward into `grads`.
    fn backward(&mut self) -> Result<()> {
        let gpu = self.gpu.clone();
        let fwd = self.fwd.expect("backward runs after a forward");
        let (t_len, b_len) = (fwd.t_len, fwd.b_len);
        let rows = t_len * b_len;
        let p = gpu.ptr(&self.params);
        let grads = gpu.ptr(&self.grads);
        let ones = self.ones.ensure(&gpu, rows)?;
        if self.ones_filled_len != self.ones.len {
            gpu.launch(
                &gpu.k.fill,
                grid(self.ones.len),
                &[Arg::Ptr(ones), Arg::F32(1.0), Arg::I64(self.ones.len as i64)],
            )?;
            self.ones_filled_len = self.ones.len;
        }
        let net = self.net.clone();
        let heads = net.heads;
        let d_heads = self.d_heads.ensure(&gpu, 0)?;
        let torso_ptrs: Vec<u64> =
            self.torso_out.iter().map(|g| gpu.ptr(g.buf.as_ref().expect("forward ran"))).collect();
        let torso_features = torso_ptrs.last().copied().unwrap_or(fwd.obs);
        let features = if net.gru.is_some() { self.h_out.ensure(&gpu, 0)? } else { torso_features };
        gpu.gemm_dw(d_heads, rows, heads.n_out, features, heads.n_in, at(grads, heads.weight))?;
        gpu.column_sums(d_heads, rows, heads.n_out, ones, at(grads, heads.bias))?;
        if net.torso.is_empty() && net.gru.is_none() {
            return Ok(());
        }
        let widest = net.widest();
        let mut d_cur = self.d_a.ensure(&gpu, rows * widest)?;
        let mut d_next = self.d_b.ensure(&gpu, rows * widest)?;
        gpu.gemm_dx(d_heads, rows, heads.n_out, at(p, heads.weight), heads.n_in, d_cur, 0.0)?;
        if let Some(g) = net.gru {
            let hidden = g.hidden;
            let (state, gates) = (b_len * hidden, 3 * b_len * hidden);
            let d_gi = self.d_gi.ensure(&gpu, rows * 3 * hidden)?;
            let d_gh = self.d_gh.ensure(&gpu, rows * 3 * hidden)?;
            let d_h = self.d_h.ensure(&gpu, state)?;
            let gate_buf = self.gates.ensure(&gpu, 0)?;
            let gh = self.gh.ensure(&gpu, 0)?;
            let h_prev = self.h_prev.ensure(&gpu, 0)?;
            for t in (0..t_len).rev() {
                // d_h = (reset rows of step t+1 zeroed) d_h + ∂L/∂h_t from the heads.
                let last = t + 1 == t_len;
                let starts_next = if last { fwd.starts } else { at(fwd.starts, (t + 1) * b_len) };
                if last {
                    gpu.launch(&gpu.k.fill, grid(state), &[Arg::Ptr(d_h), Arg::F32(0.0), Arg::I64(state as i64)])?;
                }
                gpu.launch(
                    &gpu.k.gru_carry_grad,
                    grid(state),
                    &[
                        Arg::Ptr(d_h),
                        Arg::Ptr(starts_next),
                        Arg::Ptr(at(d_cur, t * state)),
                        int(b_len),
                        int(hidden),
                        Arg::I32(i32::from(!last)),
                    ],
                )?;
                gpu.launch(
                    &gpu.k.gru_cell_bwd,
                    grid(state),
                    &[
                        Arg::Ptr(d_h),
                        Arg::Ptr(at(gate_buf, t * gates)),
                        Arg::Ptr(at(gh, t * gates)),
                        Arg::Ptr(at(h_prev, t * state)),
                        Arg::Ptr(at(d_gi, t * gates)),
                        Arg::Ptr(at(d_gh, t * gates)),
                        int(b_len),
                        int(hidden),
                    ],
                )?;
                if t == 0 {
                    break; // no gradient into h0
                }
                gpu.gemm_dx(at(d_gh, t * gates), b_len, 3 * hidden, at(p, g.weight_hh), hidden, d_h, 1.0)?;
            }
            gpu.gemm_dw(d_gi, rows, 3 * hidden, torso_features, g.n_in, at(grads, g.weight_ih))?;
            gpu.column_sums(d_gi, rows, 3 * hidden, ones, at(grads, g.bias_ih))?;
            gpu.gemm_dw(d_gh, rows, 3 * hidden, h_prev, hidden, at(grads, g.weight_hh))?;
            gpu.column_sums(d_gh, rows, 3 * hidden, ones, at(grads, g.bias_hh))?;
            if !net.torso.is_empty() {
                gpu.gemm_dx(d_gi, rows, 3 * hidden, at(p, g.weight_ih), g.n_in, d_cur, 0.0)?;
            }
        }
        for (i, layer) in net.torso.iter().enumerate().rev() {
            let n = rows * layer.n_out;
            gpu.launch(
                &gpu.k.act_bwd,
                grid(n),
                &[Arg::Ptr(d_cur), Arg::Ptr(torso_ptrs[i]), Arg::I64(n as i64), Arg::I32(net.act)],
            )?;
            let x = if i == 0 { fwd.obs } else { torso_ptrs[i - 1] };
            gpu.gemm_dw(d_cur, rows, layer.n_out, x, layer.n_in, at(grads, layer.weight))?;
            gpu.column_sums(d_cur, rows, layer.n_out, ones, at(grads, layer.bias))?;
            if i > 0 {
                gpu.gemm_dx(d_cur, rows, layer.n_out, at(p, layer.weight), layer.n_in, d_next, 0.0)?;
                std::mem::swap(&mut d_cur, &mut d_next);
            }
        }
        Ok(())
    }
}

/// One timed kernel measurement for the benchmarks: median milliseconds per launch and the
/// bytes each launch must move at least.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct KernelTiming {
    /// Median milliseconds per launch.
    pub ms: f32,
    /// Bytes read plus written per launch.
    pub bytes: u64,
}

impl KernelTiming {
    /// Achieved bandwidth in GB/s (10⁹ bytes per second).
    pub fn gbps(&self) -> f64 {
        self.bytes as f64 / (f64::from(self.ms) * 1e-3) / 1e9
    }
}

fn median(mut xs: Vec<f32>) -> f32 {
    xs.sort_by(f32::total_cmp);
    xs[xs.len() / 2]
}

impl CudaDevice {
    /// Time the V-trace reverse scan alone on a `[t_len][b_len]` batch (random inputs): each
    /// launch reads four `[T][B]` inputs and the bootstrap row and writes two `[T][B]` outputs.
    pub fn time_vtrace_scan(&self, t_len: usize, b_len: usize, reps: usize) -> Result<KernelTiming> {
        let gpu = &self.gpu;
        let n = t_len * b_len;
        let inputs: Vec<f32> = (0..n).map(|i| ((i * 2_654_435_761usize) % 1000) as f32 * 1e-3 - 0.5).collect();
        let bufs: Vec<CudaSlice<f32>> =
            (0..4).map(|_| gpu.stream.clone_htod(&inputs)).collect::<std::result::Result<_, _>>()?;
        let bootstrap = gpu.alloc(b_len)?;
        let (vs, adv) = (gpu.alloc(n)?, gpu.alloc(n)?);
        let args = [
            int(t_len),
            int(b_len),
            Arg::Ptr(gpu.ptr(&bufs[0])),
            Arg::Ptr(gpu.ptr(&bufs[1])),
            Arg::Ptr(gpu.ptr(&bufs[2])),
            Arg::Ptr(gpu.ptr(&bufs[3])),
            Arg::Ptr(gpu.ptr(&bootstrap)),
            Arg::F32(1.0),
            Arg::F32(1.0),
            Arg::F32(1.0),
            Arg::F32(0.95),
            Arg::Ptr(gpu.ptr(&vs)),
            Arg::Ptr(gpu.ptr(&adv)),
        ];
        let timed = || gpu.ctx.new_event(Some(cudarc::driver::sys::CUevent_flags::CU_EVENT_DEFAULT));
        let (start, stop) = (timed()?, timed()?);
        gpu.launch(&gpu.k.vtrace_scan, grid(b_len), &args)?; // warm-up
        let mut times = Vec::with_capacity(reps);
        for _ in 0..reps.max(1) {
            start.record(&gpu.stream)?;
            gpu.launch(&gpu.k.vtrace_scan, grid(b_len), &args)?;
            stop.record(&gpu.stream)?;
            stop.synchronize()?;
            times.push(start.elapsed_ms(&stop)?);
        }
        Ok(KernelTiming { ms: median(times), bytes: (4 * (6 * n + b_len)) as u64 })
    }

    /// Time a device-to-device copy of `bytes` (the memory-bandwidth ceiling the scan is
    /// compared with; a copy reads and writes every byte, so `bytes` counts both).
    pub fn time_copy(&self, bytes: usize, reps: usize) -> Result<KernelTiming> {
        let gpu = &self.gpu;
        let n = bytes / 8;
        let src = gpu.alloc(n)?;
        let mut dst = gpu.alloc(n)?;
        let timed = || gpu.ctx.new_event(Some(cudarc::driver::sys::CUevent_flags::CU_EVENT_DEFAULT));
        let (start, stop) = (timed()?, timed()?);
        gpu.stream.memcpy_dtod(&src, &mut dst)?;
        let mut times = Vec::with_capacity(reps);
        for _ in 0..reps.max(1) {
            start.record(&gpu.stream)?;
            gpu.stream.memcpy_dtod(&src, &mut dst)?;
            stop.record(&gpu.stream)?;
            stop.synchronize()?;
            times.push(start.elapsed_ms(&stop)?);
        }
        Ok(KernelTiming { ms: median(times), bytes: (8 * n) as u64 })
    }
}

#[cfg(test)]
#[path = "cuda_tests.rs"]
mod cuda_tests;
