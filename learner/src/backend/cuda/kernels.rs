//! The CUDA sources of the learner's kernels, their NVRTC compilation, and one safe launcher
//! per kernel (`Kernels`).
//!
//! One concept over 1,000 lines: the launchers are one list, each beside the length checks its
//! kernel's indexing relies on; splitting them would put a launcher's checks and its `SAFETY`
//! argument in different files from the kernels' shared compile and module code.
//!
//! Each launcher takes typed device views (`CudaView`/`CudaViewMut`, which carry their length),
//! checks every length against the sizes the kernel will index with, converts sizes to the
//! kernel's integer types (refusing what does not fit), and only then launches, under a `SAFETY`
//! comment that names the invariant that launch relies on.
//!
//! The `.cu` files live in `learner/kernels/` and are embedded in the binary; [`module_source`]
//! prepends the shared header (`common.cuh`) to them, and the CUDA backend compiles the result
//! with NVRTC when it starts, for the device's own architecture. [`compile_check`] compiles each
//! file on its own so that CI, which has NVRTC (a PyPI wheel) but no GPU, fails on any kernel that
//! does not compile.

use std::sync::Arc;

use cudarc::driver::{CudaFunction, CudaModule, CudaStream, CudaView, CudaViewMut, LaunchConfig, PushKernelArg};
use cudarc::nvrtc::{CompileOptions, Ptx};

use volley_policy::{ActionHead, ConvGeometry};

use crate::backend::{check_len, BackendError};

/// One kernel source file and the `extern "C"` kernels it defines.
#[derive(Debug, Clone, Copy)]
pub struct KernelFile {
    /// File name under `learner/kernels/`.
    pub name: &'static str,
    /// Its text.
    pub source: &'static str,
    /// The kernels it defines (each must appear as a PTX entry).
    pub kernels: &'static [&'static str],
}

/// The header prepended to every file: fast tanh/sigmoid, block reductions, log-softmax rows.
pub const COMMON: &str = include_str!("../../../kernels/common.cuh");

/// Every kernel file of the learner.
pub const FILES: &[KernelFile] = &[
    KernelFile {
        name: "dense.cu",
        source: include_str!("../../../kernels/dense.cu"),
        kernels: &["bias_act_fwd", "act_bwd", "take_column", "gather_columns", "fill"],
    },
    KernelFile {
        name: "gru.cu",
        source: include_str!("../../../kernels/gru.cu"),
        kernels: &["gru_reset_copy", "gru_cell_fwd", "gru_cell_bwd", "gru_carry_grad"],
    },
    KernelFile {
        name: "loss.cu",
        source: include_str!("../../../kernels/loss.cu"),
        kernels: &[
            "behaviour_weights",
            "vtrace_scan",
            "gae_scan",
            "weighted_sum",
            "weighted_var",
            "off_policy_sums",
            "log_probs_categorical",
            "vtrace_loss_grad_categorical",
            "ppo_loss_grad_categorical",
            "log_probs_gaussian",
            "vtrace_loss_grad_gaussian",
            "ppo_loss_grad_gaussian",
        ],
    },
    KernelFile {
        name: "optim.cu",
        source: include_str!("../../../kernels/optim.cu"),
        kernels: &["sum_squares", "adam_prepare", "adam_step"],
    },
    KernelFile {
        name: "conv.cu",
        source: include_str!("../../../kernels/conv.cu"),
        kernels: &["im2col", "col2im", "im2col_u8", "widen_u8"],
    },
];

/// The whole module: the header followed by every file.
pub fn module_source() -> String {
    let mut source = String::from(COMMON);
    for file in FILES {
        source.push_str("\n// ---- ");
        source.push_str(file.name);
        source.push_str(" ----\n");
        source.push_str(file.source);
    }
    source
}

/// NVRTC options: `arch` is a virtual or real architecture such as `sm_90` (`None` leaves NVRTC's
/// default). Exact IEEE division and square root, and no flush-to-zero, keep the kernels close
/// to the CPU backend; fused multiply-adds stay on (they only make results more accurate).
pub fn options(arch: Option<&'static str>, name: &str) -> CompileOptions {
    CompileOptions {
        ftz: Some(false),
        prec_div: Some(true),
        prec_sqrt: Some(true),
        fmad: Some(true),
        arch,
        name: Some(name.to_string()),
        ..CompileOptions::default()
    }
}

/// Why a kernel did not compile.
#[derive(Debug, thiserror::Error)]
pub enum KernelError {
    /// The NVRTC library could not be loaded.
    #[error(
        "NVRTC (libnvrtc.so) was not found; install the CUDA runtime libraries or `pip install nvidia-cuda-nvrtc-cu12` and put its lib directory on LD_LIBRARY_PATH"
    )]
    NvrtcMissing,
    /// NVRTC rejected a source; `log` is its compiler output.
    #[error("{file}: NVRTC compilation failed: {log}")]
    Compile {
        /// The file (or `module` for the whole module).
        file: String,
        /// NVRTC's log or error.
        log: String,
    },
    /// A kernel the backend launches is missing from the compiled PTX.
    #[error("{file}: kernel `{kernel}` is not in the compiled PTX")]
    MissingKernel {
        /// The file.
        file: String,
        /// The kernel name.
        kernel: String,
    },
}

/// Whether the NVRTC library can be loaded (without panicking when it cannot).
pub fn nvrtc_available() -> bool {
    // SAFETY: only tries to dlopen the library's candidate names; no symbol is called.
    unsafe { cudarc::nvrtc::sys::is_culib_present() }
}

fn compile(source: &str, arch: Option<&'static str>, name: &str) -> Result<Ptx, KernelError> {
    if !nvrtc_available() {
        return Err(KernelError::NvrtcMissing);
    }
    cudarc::nvrtc::compile_ptx_with_opts(source, options(arch, name))
        .map_err(|err| KernelError::Compile { file: name.to_string(), log: err.to_string() })
}

/// Compile the whole module for `arch`.
pub fn compile_module(arch: Option<&'static str>) -> Result<Ptx, KernelError> {
    compile(&module_source(), arch, "volley_learner.cu")
}

/// Compile every file on its own for `arch` and check that each declared kernel is in the PTX.
/// Returns the PTX size per file.
pub fn compile_check(arch: Option<&'static str>) -> Result<Vec<(&'static str, usize)>, KernelError> {
    let mut sizes = Vec::new();
    for file in FILES {
        let ptx = compile(&format!("{COMMON}\n{}", file.source), arch, file.name)?.to_src();
        for kernel in file.kernels {
            if !ptx.contains(&format!(".entry {kernel}(")) {
                return Err(KernelError::MissingKernel { file: file.name.to_string(), kernel: kernel.to_string() });
            }
        }
        sizes.push((file.name, ptx.len()));
    }
    Ok(sizes)
}

/// Threads per block of every grid-stride kernel (the block reductions assume a multiple of 32).
const BLOCK: u32 = 256;

/// A grid for a grid-stride loop over `n` elements.
pub(crate) fn grid(n: usize) -> LaunchConfig {
    let blocks = n.div_ceil(BLOCK as usize).clamp(1, 65_535 * 8) as u32;
    LaunchConfig { grid_dim: (blocks, 1, 1), block_dim: (BLOCK, 1, 1), shared_mem_bytes: 0 }
}

/// `value` as the `int` a kernel takes, or an error naming it.
pub(crate) fn int(what: &'static str, value: usize) -> Result<i32, BackendError> {
    i32::try_from(value).map_err(|_| BackendError::TooLarge { what, value })
}

/// `value` as the `long long` a kernel takes.
fn long(what: &'static str, value: usize) -> Result<i64, BackendError> {
    i64::try_from(value).map_err(|_| BackendError::TooLarge { what, value })
}

/// The null pointer a kernel reads as "no such input" (`ref == NULL`, `x == NULL`).
pub(crate) const NULL: u64 = 0;

/// Activation codes of `bias_act_fwd` and `act_bwd`.
pub(crate) const ACT_IDENTITY: i32 = 0;
/// `tanh`.
pub(crate) const ACT_TANH: i32 = 1;
/// `relu`.
pub(crate) const ACT_RELU: i32 = 2;

/// The loaded kernels, one field per `extern "C"` kernel in `learner/kernels/`.
pub(crate) struct Kernels {
    bias_act_fwd: CudaFunction,
    act_bwd: CudaFunction,
    take_column: CudaFunction,
    gather_columns: CudaFunction,
    fill: CudaFunction,
    gru_reset_copy: CudaFunction,
    gru_cell_fwd: CudaFunction,
    gru_cell_bwd: CudaFunction,
    gru_carry_grad: CudaFunction,
    behaviour_weights: CudaFunction,
    vtrace_scan: CudaFunction,
    gae_scan: CudaFunction,
    weighted_sum: CudaFunction,
    weighted_var: CudaFunction,
    off_policy_sums: CudaFunction,
    /// Each head's instances of the head kernels, by [`HeadArgs::index`].
    heads: [HeadKernels; 2],
    sum_squares: CudaFunction,
    adam_prepare: CudaFunction,
    adam_step: CudaFunction,
    im2col: CudaFunction,
    col2im: CudaFunction,
    im2col_u8: CudaFunction,
    widen_u8: CudaFunction,
    /// Keeps the functions' module loaded.
    _module: Arc<CudaModule>,
}

/// Doubles per loss evaluation in the statistics array: the moments `[W, Σ w·x, Σ w·(x − mean)²]`,
/// the six loss sums `[policy, value, entropy, ratio, clipped, approx_kl]`, `Σ g²`, padding.
pub(crate) const SLOT: usize = 12;
/// Where the six loss sums start in a slot.
pub(crate) const SLOT_STATS: usize = 3;
/// Where `Σ g²` sits in a slot.
pub(crate) const SLOT_SUMSQ: usize = 9;

/// One head's instances of the kernels templated over the head (`loss.cu`,
/// `VOLLEY_HEAD_KERNELS`): every one takes the same leading head arguments, so one launcher per
/// kernel serves every head.
struct HeadKernels {
    log_probs: CudaFunction,
    vtrace_loss_grad: CudaFunction,
    ppo_loss_grad: CudaFunction,
}

/// The head arguments every head kernel starts with: `(int n_outputs, const float* head_params,
/// int head_flags)`, and which instance to launch.
pub(crate) struct HeadArgs<'a> {
    /// The head's kind.
    pub(crate) kind: ActionHead,
    /// Outputs per row (the heads block's stride is one more).
    pub(crate) n_outputs: usize,
    /// The head's own parameters ([`ActionHead::n_params`] floats).
    pub(crate) params: CudaView<'a, f32>,
}

impl HeadArgs<'_> {
    /// The index of the head's kernels in [`Kernels`] (the order of `VOLLEY_HEAD_KERNELS`).
    fn index(&self) -> usize {
        match self.kind {
            ActionHead::Categorical => 0,
            ActionHead::Gaussian { .. } => 1,
        }
    }

    /// The kernel's `head_flags`: squashing for a Gaussian head.
    fn flags(&self) -> i32 {
        i32::from(matches!(self.kind, ActionHead::Gaussian { squash: true }))
    }

    /// Floats per recorded action, and per row of parameter gradient.
    fn widths(&self) -> (usize, usize) {
        (self.kind.action_width(self.n_outputs), self.kind.n_params(self.n_outputs))
    }

    /// Check the parameters' length and push the three head arguments.
    fn push<'b>(
        &'b self,
        op: &'static str,
        launch: &mut cudarc::driver::LaunchArgs<'b>,
        n_outputs: &'b i32,
        flags: &'b i32,
    ) -> Result<(), BackendError> {
        check_len(op, "head params", self.kind.n_params(self.n_outputs), self.params.len())?;
        launch.arg(n_outputs).arg(&self.params).arg(flags);
        Ok(())
    }
}

/// The arguments of [`Kernels::vtrace_loss_grad`] besides the head and the slot: the heads block
/// of `n_rows` rows and the `[n]` per-sample inputs.
pub(crate) struct VTraceLossGradArgs<'a> {
    pub(crate) heads: CudaView<'a, f32>,
    pub(crate) actions: CudaView<'a, f32>,
    pub(crate) weights: CudaView<'a, f32>,
    pub(crate) values: CudaView<'a, f32>,
    pub(crate) vs: CudaView<'a, f32>,
    pub(crate) log_rhos: CudaView<'a, f32>,
    pub(crate) pg_advantages: CudaView<'a, f32>,
    pub(crate) rho_bar: f32,
    pub(crate) value_coef: f32,
    pub(crate) ent_coef: f32,
}

/// The arguments of [`Kernels::ppo_loss_grad`] besides the head and the slot, all `[n]` but the
/// heads block.
pub(crate) struct PpoLossGradArgs<'a> {
    pub(crate) heads: CudaView<'a, f32>,
    pub(crate) actions: CudaView<'a, f32>,
    pub(crate) weights: CudaView<'a, f32>,
    pub(crate) values: CudaView<'a, f32>,
    pub(crate) advantages: CudaView<'a, f32>,
    pub(crate) returns: CudaView<'a, f32>,
    pub(crate) prox_log_probs: CudaView<'a, f32>,
    pub(crate) is_weights: CudaView<'a, f32>,
    pub(crate) clip_coef: f32,
    pub(crate) value_coef: f32,
    pub(crate) ent_coef: f32,
    pub(crate) normalize: bool,
}

/// The arguments of [`Kernels::vtrace_scan`], all `[T][B]` but `bootstrap` (`[B]`).
pub(crate) struct VTraceScanArgs<'a> {
    pub(crate) t_len: usize,
    pub(crate) b_len: usize,
    pub(crate) log_rhos: CudaView<'a, f32>,
    pub(crate) discounts: CudaView<'a, f32>,
    pub(crate) rewards: CudaView<'a, f32>,
    pub(crate) values: CudaView<'a, f32>,
    pub(crate) bootstrap: CudaView<'a, f32>,
    pub(crate) rho_bar: f32,
    pub(crate) pg_rho_bar: f32,
    pub(crate) c_bar: f32,
    pub(crate) lambda_: f32,
    /// Group baselines: where finite, the policy-gradient advantage before the clipped
    /// importance weight (`[T][B]`).
    pub(crate) advantage_override: Option<CudaView<'a, f32>>,
}

impl Kernels {
    /// Look every kernel up in `module`.
    pub(crate) fn load(module: Arc<CudaModule>) -> Result<Self, BackendError> {
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
            behaviour_weights: f("behaviour_weights")?,
            vtrace_scan: f("vtrace_scan")?,
            gae_scan: f("gae_scan")?,
            weighted_sum: f("weighted_sum")?,
            weighted_var: f("weighted_var")?,
            off_policy_sums: f("off_policy_sums")?,
            heads: [
                HeadKernels {
                    log_probs: f("log_probs_categorical")?,
                    vtrace_loss_grad: f("vtrace_loss_grad_categorical")?,
                    ppo_loss_grad: f("ppo_loss_grad_categorical")?,
                },
                HeadKernels {
                    log_probs: f("log_probs_gaussian")?,
                    vtrace_loss_grad: f("vtrace_loss_grad_gaussian")?,
                    ppo_loss_grad: f("ppo_loss_grad_gaussian")?,
                },
            ],
            sum_squares: f("sum_squares")?,
            adam_prepare: f("adam_prepare")?,
            adam_step: f("adam_step")?,
            im2col: f("im2col")?,
            col2im: f("col2im")?,
            im2col_u8: f("im2col_u8")?,
            widen_u8: f("widen_u8")?,
            _module: module,
        })
    }

    /// `y[r][j] = act(y[r][j] + bias[j])` over `[rows][width]`.
    pub(crate) fn bias_act_fwd(
        &self,
        stream: &Arc<CudaStream>,
        y: &mut CudaViewMut<'_, f32>,
        bias: &CudaView<'_, f32>,
        rows: usize,
        act: i32,
    ) -> Result<(), BackendError> {
        let width = bias.len();
        check_len("bias_act_fwd", "y", rows * width, y.len())?;
        let (rows_i, width_i) = (int("rows", rows)?, int("width", width)?);
        let mut launch = stream.launch_builder(&self.bias_act_fwd);
        launch.arg(y).arg(bias).arg(&rows_i).arg(&width_i).arg(&act);
        // SAFETY: (y, bias, rows, width, act) is the kernel's parameter list; it reads
        // bias[0..width) and reads and writes y[0..rows·width), both checked above.
        unsafe { launch.launch(grid(rows * width)) }?;
        Ok(())
    }

    /// `dy ← dy · act'(pre)` through the stored output `y`.
    pub(crate) fn act_bwd(
        &self,
        stream: &Arc<CudaStream>,
        dy: &mut CudaViewMut<'_, f32>,
        y: &CudaView<'_, f32>,
        act: i32,
    ) -> Result<(), BackendError> {
        check_len("act_bwd", "y", dy.len(), y.len())?;
        let len = dy.len();
        let n = long("n", len)?;
        let mut launch = stream.launch_builder(&self.act_bwd);
        launch.arg(dy).arg(y).arg(&n).arg(&act);
        // SAFETY: (dy, y, n, act) is the parameter list; both views hold n elements (checked).
        unsafe { launch.launch(grid(len)) }?;
        Ok(())
    }

    /// `dst[i] = src[i · stride + column]` for `i < dst.len()`.
    pub(crate) fn take_column(
        &self,
        stream: &Arc<CudaStream>,
        src: &CudaView<'_, f32>,
        stride: usize,
        column: usize,
        dst: &mut CudaViewMut<'_, f32>,
    ) -> Result<(), BackendError> {
        let rows = dst.len();
        check_len("take_column", "src", rows * stride, src.len())?;
        if column >= stride {
            return Err(BackendError::Shape { op: "take_column", operand: "column", expected: stride, got: column });
        }
        let (rows_i, stride_i, column_i) = (int("rows", rows)?, int("stride", stride)?, int("column", column)?);
        let mut launch = stream.launch_builder(&self.take_column);
        launch.arg(src).arg(dst).arg(&rows_i).arg(&stride_i).arg(&column_i);
        // SAFETY: (src, dst, rows, stride, col) is the parameter list; the largest index read is
        // (rows − 1)·stride + column < rows·stride = src.len(), and dst holds rows (checked).
        unsafe { launch.launch(grid(rows)) }?;
        Ok(())
    }

    /// `dst[t][j][k] = src[t][columns[j]][k]` for `j < n_columns` over `[rows][b_len][width]`
    /// words; `columns` holds the `n_columns` column indices, each `< b_len`.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn gather_columns(
        &self,
        stream: &Arc<CudaStream>,
        src: &CudaView<'_, f32>,
        rows: usize,
        b_len: usize,
        width: usize,
        columns: &CudaView<'_, u32>,
        dst: &mut CudaViewMut<'_, f32>,
    ) -> Result<(), BackendError> {
        let n_columns = columns.len();
        check_len("gather_columns", "src", rows * b_len * width, src.len())?;
        check_len("gather_columns", "dst", rows * n_columns * width, dst.len())?;
        let (rows_i, b_i, width_i, n_i) =
            (int("rows", rows)?, int("b_len", b_len)?, int("width", width)?, int("n_columns", n_columns)?);
        let mut launch = stream.launch_builder(&self.gather_columns);
        launch.arg(src).arg(dst).arg(&rows_i).arg(&b_i).arg(&width_i).arg(columns).arg(&n_i);
        // SAFETY: (src, dst, rows, b_len, width, cols, mb_len) is the parameter list; dst holds
        // rows·n_columns·width words and src rows·b_len·width (checked); every column index is
        // below b_len because the trainer uploads permutations of 0..b_len only.
        unsafe { launch.launch(grid(rows * n_columns * width)) }?;
        Ok(())
    }

    /// `x[i] = value`.
    pub(crate) fn fill(
        &self,
        stream: &Arc<CudaStream>,
        x: &mut CudaViewMut<'_, f32>,
        value: f32,
    ) -> Result<(), BackendError> {
        let n = long("n", x.len())?;
        let len = x.len();
        let mut launch = stream.launch_builder(&self.fill);
        launch.arg(x).arg(&value).arg(&n);
        // SAFETY: (x, value, n) is the parameter list and x holds n floats.
        unsafe { launch.launch(grid(len)) }?;
        Ok(())
    }

    /// `dst[b] = starts[b] ≠ 0 ? 0 : src[b]` over `[B][hidden]`.
    pub(crate) fn gru_reset_copy(
        &self,
        stream: &Arc<CudaStream>,
        src: &CudaView<'_, f32>,
        starts: &CudaView<'_, f32>,
        hidden: usize,
        dst: &mut CudaViewMut<'_, f32>,
    ) -> Result<(), BackendError> {
        let b_len = starts.len();
        check_len("gru_reset_copy", "src", b_len * hidden, src.len())?;
        check_len("gru_reset_copy", "dst", b_len * hidden, dst.len())?;
        let (b_i, h_i) = (int("b_len", b_len)?, int("hidden", hidden)?);
        let mut launch = stream.launch_builder(&self.gru_reset_copy);
        launch.arg(src).arg(starts).arg(dst).arg(&b_i).arg(&h_i);
        // SAFETY: (src, starts, dst, b_len, hidden) is the parameter list; src and dst hold
        // b_len·hidden floats and starts b_len (checked); src and dst are distinct buffers.
        unsafe { launch.launch(grid(b_len * hidden)) }?;
        Ok(())
    }

    /// One GRU step forward (see `gru.cu`).
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn gru_cell_fwd(
        &self,
        stream: &Arc<CudaStream>,
        gi: &CudaView<'_, f32>,
        gh: &CudaView<'_, f32>,
        h_prev: &CudaView<'_, f32>,
        hidden: usize,
        gates: &mut CudaViewMut<'_, f32>,
        h_out: &mut CudaViewMut<'_, f32>,
    ) -> Result<(), BackendError> {
        let state = h_prev.len();
        check_len("gru_cell_fwd", "gi", 3 * state, gi.len())?;
        check_len("gru_cell_fwd", "gh", 3 * state, gh.len())?;
        check_len("gru_cell_fwd", "gates", 3 * state, gates.len())?;
        check_len("gru_cell_fwd", "h_out", state, h_out.len())?;
        let b_len = state.checked_div(hidden).unwrap_or(0);
        let (b_i, h_i) = (int("b_len", b_len)?, int("hidden", hidden)?);
        let mut launch = stream.launch_builder(&self.gru_cell_fwd);
        launch.arg(gi).arg(gh).arg(h_prev).arg(gates).arg(h_out).arg(&b_i).arg(&h_i);
        // SAFETY: (gi, gh, h_prev, gates, h_out, b_len, hidden) is the parameter list; the gate
        // views hold 3·b_len·hidden floats and the state views b_len·hidden (checked); the two
        // outputs are distinct buffers from the inputs.
        unsafe { launch.launch(grid(state)) }?;
        Ok(())
    }

    /// One GRU step backward (see `gru.cu`).
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn gru_cell_bwd(
        &self,
        stream: &Arc<CudaStream>,
        d_h: &mut CudaViewMut<'_, f32>,
        gates: &CudaView<'_, f32>,
        gh: &CudaView<'_, f32>,
        h_prev: &CudaView<'_, f32>,
        hidden: usize,
        d_gi: &mut CudaViewMut<'_, f32>,
        d_gh: &mut CudaViewMut<'_, f32>,
    ) -> Result<(), BackendError> {
        let state = d_h.len();
        check_len("gru_cell_bwd", "gates", 3 * state, gates.len())?;
        check_len("gru_cell_bwd", "gh", 3 * state, gh.len())?;
        check_len("gru_cell_bwd", "h_prev", state, h_prev.len())?;
        check_len("gru_cell_bwd", "d_gi", 3 * state, d_gi.len())?;
        check_len("gru_cell_bwd", "d_gh", 3 * state, d_gh.len())?;
        let b_len = state.checked_div(hidden).unwrap_or(0);
        let (b_i, h_i) = (int("b_len", b_len)?, int("hidden", hidden)?);
        let mut launch = stream.launch_builder(&self.gru_cell_bwd);
        launch.arg(d_h).arg(gates).arg(gh).arg(h_prev).arg(d_gi).arg(d_gh).arg(&b_i).arg(&h_i);
        // SAFETY: (dh, gates, gh, h_prev, dgi, dgh, b_len, hidden) is the parameter list; every
        // view has the length its shape implies (checked); dh is read and written only at the
        // thread's own index.
        unsafe { launch.launch(grid(state)) }?;
        Ok(())
    }

    /// `d_h[b] = 0` where `starts_next[b] ≠ 0` (when given), then `d_h += from_heads`.
    pub(crate) fn gru_carry_grad(
        &self,
        stream: &Arc<CudaStream>,
        d_h: &mut CudaViewMut<'_, f32>,
        starts_next: Option<&CudaView<'_, f32>>,
        from_heads: &CudaView<'_, f32>,
        hidden: usize,
    ) -> Result<(), BackendError> {
        let state = d_h.len();
        check_len("gru_carry_grad", "from_heads", state, from_heads.len())?;
        let b_len = state.checked_div(hidden).unwrap_or(0);
        if let Some(starts) = starts_next {
            check_len("gru_carry_grad", "starts_next", b_len, starts.len())?;
        }
        let (b_i, h_i) = (int("b_len", b_len)?, int("hidden", hidden)?);
        let apply_reset = i32::from(starts_next.is_some());
        let mut launch = stream.launch_builder(&self.gru_carry_grad);
        launch.arg(d_h);
        match starts_next {
            Some(starts) => launch.arg(starts),
            None => launch.arg(&NULL),
        };
        launch.arg(from_heads).arg(&b_i).arg(&h_i).arg(&apply_reset);
        // SAFETY: (dh, starts, from_heads, b_len, hidden, apply_reset) is the parameter list;
        // dh and from_heads hold b_len·hidden floats and starts b_len (checked); the kernel reads
        // starts only when apply_reset is 1, which is exactly when a real view was passed.
        unsafe { launch.launch(grid(state)) }?;
        Ok(())
    }

    /// `out[i] = log π(a_i|x_i) − reference[i]` (or without a reference) for `i < out.len()`
    /// under `head`, from rows of stride `n_outputs + 1`.
    pub(crate) fn log_probs(
        &self,
        stream: &Arc<CudaStream>,
        head: &HeadArgs<'_>,
        heads: &CudaView<'_, f32>,
        actions: &CudaView<'_, f32>,
        reference: Option<&CudaView<'_, f32>>,
        out: &mut CudaViewMut<'_, f32>,
    ) -> Result<(), BackendError> {
        let n = out.len();
        let (width, _) = head.widths();
        check_len("log_probs", "heads", n * (head.n_outputs + 1), heads.len())?;
        check_len("log_probs", "actions", n * width, actions.len())?;
        if let Some(reference) = reference {
            check_len("log_probs", "reference", n, reference.len())?;
        }
        let (outputs_i, flags, n_i) = (int("n_outputs", head.n_outputs)?, head.flags(), int("n", n)?);
        let mut launch = stream.launch_builder(&self.heads[head.index()].log_probs);
        head.push("log_probs", &mut launch, &outputs_i, &flags)?;
        launch.arg(heads).arg(actions);
        match reference {
            Some(reference) => launch.arg(reference),
            None => launch.arg(&NULL),
        };
        launch.arg(out).arg(&n_i);
        // SAFETY: (n_outputs, head_params, head_flags, heads, actions, ref, out, n) is the
        // parameter list; head_params holds the head's parameters, heads n rows of
        // n_outputs + 1 floats, actions n rows of the head's action width, ref and out n floats
        // (checked); ref may be NULL (the kernel tests it); every categorical action is below
        // n_outputs because the trainer validates actions before staging them.
        unsafe { launch.launch(grid(n)) }?;
        Ok(())
    }

    /// `out[i] = min(exp(prox[i] − behaviour[i]), clip)`.
    pub(crate) fn behaviour_weights(
        &self,
        stream: &Arc<CudaStream>,
        prox: &CudaView<'_, f32>,
        behaviour: &CudaView<'_, f32>,
        clip: f32,
        out: &mut CudaViewMut<'_, f32>,
    ) -> Result<(), BackendError> {
        let n = out.len();
        check_len("behaviour_weights", "prox", n, prox.len())?;
        check_len("behaviour_weights", "behaviour", n, behaviour.len())?;
        let n_i = int("n", n)?;
        let mut launch = stream.launch_builder(&self.behaviour_weights);
        launch.arg(prox).arg(behaviour).arg(&clip).arg(out).arg(&n_i);
        // SAFETY: (prox, behaviour, clip, out, n) is the parameter list; all three views hold n
        // floats (checked).
        unsafe { launch.launch(grid(n)) }?;
        Ok(())
    }

    /// The V-trace reverse scan (one thread per column).
    pub(crate) fn vtrace_scan(
        &self,
        stream: &Arc<CudaStream>,
        args: &VTraceScanArgs<'_>,
        vs: &mut CudaViewMut<'_, f32>,
        pg_advantages: &mut CudaViewMut<'_, f32>,
    ) -> Result<(), BackendError> {
        let n = args.t_len * args.b_len;
        for (operand, len) in [
            ("log_rhos", args.log_rhos.len()),
            ("discounts", args.discounts.len()),
            ("rewards", args.rewards.len()),
            ("values", args.values.len()),
            ("vs", vs.len()),
            ("pg_advantages", pg_advantages.len()),
            ("advantage_override", args.advantage_override.as_ref().map_or(n, |v| v.len())),
        ] {
            check_len("vtrace_scan", operand, n, len)?;
        }
        check_len("vtrace_scan", "bootstrap", args.b_len, args.bootstrap.len())?;
        let (t_i, b_i) = (int("t_len", args.t_len)?, int("b_len", args.b_len)?);
        // Without an override the kernel never reads the pointer; `rewards` stands in for it.
        let has_override = i32::from(args.advantage_override.is_some());
        let advantage_override = args.advantage_override.as_ref().unwrap_or(&args.rewards);
        let mut launch = stream.launch_builder(&self.vtrace_scan);
        launch
            .arg(&t_i)
            .arg(&b_i)
            .arg(&args.log_rhos)
            .arg(&args.discounts)
            .arg(&args.rewards)
            .arg(&args.values)
            .arg(&args.bootstrap)
            .arg(&args.rho_bar)
            .arg(&args.pg_rho_bar)
            .arg(&args.c_bar)
            .arg(&args.lambda_)
            .arg(&has_override)
            .arg(advantage_override)
            .arg(vs)
            .arg(pg_advantages);
        // SAFETY: the argument list matches vtrace_scan's parameters; every [T][B] view holds
        // t_len·b_len floats (the override too, or it is not read) and bootstrap b_len
        // (checked); each thread touches only its column.
        unsafe { launch.launch(grid(args.b_len)) }?;
        Ok(())
    }

    /// GAE advantages and returns (one thread per column).
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn gae_scan(
        &self,
        stream: &Arc<CudaStream>,
        t_len: usize,
        b_len: usize,
        discounts: &CudaView<'_, f32>,
        rewards: &CudaView<'_, f32>,
        values: &CudaView<'_, f32>,
        bootstrap: &CudaView<'_, f32>,
        lambda_: f32,
        advantage_override: Option<&CudaView<'_, f32>>,
        advantages: &mut CudaViewMut<'_, f32>,
        returns: &mut CudaViewMut<'_, f32>,
    ) -> Result<(), BackendError> {
        let n = t_len * b_len;
        for (operand, len) in [
            ("discounts", discounts.len()),
            ("rewards", rewards.len()),
            ("values", values.len()),
            ("advantages", advantages.len()),
            ("returns", returns.len()),
            ("advantage_override", advantage_override.map_or(n, |v| v.len())),
        ] {
            check_len("gae_scan", operand, n, len)?;
        }
        // Without an override the kernel never reads the pointer; `rewards` stands in for it.
        let has_override = i32::from(advantage_override.is_some());
        let advantage_override = advantage_override.unwrap_or(rewards);
        check_len("gae_scan", "bootstrap", b_len, bootstrap.len())?;
        let (t_i, b_i) = (int("t_len", t_len)?, int("b_len", b_len)?);
        let mut launch = stream.launch_builder(&self.gae_scan);
        launch
            .arg(&t_i)
            .arg(&b_i)
            .arg(discounts)
            .arg(rewards)
            .arg(values)
            .arg(bootstrap)
            .arg(&lambda_)
            .arg(&has_override)
            .arg(advantage_override)
            .arg(advantages)
            .arg(returns);
        // SAFETY: the argument list matches gae_scan's parameters; every [T][B] view holds
        // t_len·b_len floats (the override too, or it is not read) and bootstrap b_len
        // (checked); each thread touches only its column.
        unsafe { launch.launch(grid(b_len)) }?;
        Ok(())
    }

    /// `moments[0] += Σ w`, `moments[1] += Σ w·x` (without `x`: only the first).
    pub(crate) fn weighted_sum(
        &self,
        stream: &Arc<CudaStream>,
        weights: &CudaView<'_, f32>,
        x: Option<&CudaView<'_, f32>>,
        moments: &mut CudaViewMut<'_, f64>,
    ) -> Result<(), BackendError> {
        let n = weights.len();
        if let Some(x) = x {
            check_len("weighted_sum", "x", n, x.len())?;
        }
        check_len("weighted_sum", "moments", SLOT_STATS, moments.len())?;
        let n_i = int("n", n)?;
        let mut launch = stream.launch_builder(&self.weighted_sum);
        launch.arg(weights);
        match x {
            Some(x) => launch.arg(x),
            None => launch.arg(&NULL),
        };
        launch.arg(&n_i).arg(moments);
        // SAFETY: (w, x, n, acc) is the parameter list; w and x hold n floats (checked), x may
        // be NULL (the kernel tests it), and acc has the two doubles the kernel adds to.
        unsafe { launch.launch(grid(n)) }?;
        Ok(())
    }

    /// `moments[2] += Σ w·(x − mean)²` with the mean from `moments[0..2]`.
    pub(crate) fn weighted_var(
        &self,
        stream: &Arc<CudaStream>,
        weights: &CudaView<'_, f32>,
        x: &CudaView<'_, f32>,
        moments: &mut CudaViewMut<'_, f64>,
    ) -> Result<(), BackendError> {
        let n = weights.len();
        check_len("weighted_var", "x", n, x.len())?;
        check_len("weighted_var", "moments", SLOT_STATS, moments.len())?;
        let n_i = int("n", n)?;
        let mut launch = stream.launch_builder(&self.weighted_var);
        launch.arg(weights).arg(x).arg(&n_i).arg(moments);
        // SAFETY: (w, x, n, acc) is the parameter list; w and x hold n floats and acc the three
        // moments the kernel reads and adds to (checked).
        unsafe { launch.launch(grid(n)) }?;
        Ok(())
    }

    /// The update's off-policy sums (`crate::telemetry::OffPolicySums`, added to `sums`) over
    /// `[log_rhos, weights, values, value_targets]`, each `[n]`, and every sample's ratio into
    /// `ratios` (`[n]`).
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn off_policy_sums(
        &self,
        stream: &Arc<CudaStream>,
        inputs: &[CudaView<'_, f32>; 4],
        reference: Option<&CudaView<'_, f32>>,
        rho_bar: f32,
        c_bar: f32,
        sums: &mut CudaViewMut<'_, f64>,
        ratios: &mut CudaViewMut<'_, f32>,
    ) -> Result<(), BackendError> {
        let n = ratios.len();
        for (operand, input) in ["log_rhos", "weights", "values", "value_targets"].into_iter().zip(inputs) {
            check_len("off_policy_sums", operand, n, input.len())?;
        }
        if let Some(reference) = reference {
            check_len("off_policy_sums", "reference", n, reference.len())?;
        }
        check_len("off_policy_sums", "sums", crate::telemetry::OFF_POLICY_SUMS, sums.len())?;
        let n_i = int("n", n)?;
        let [log_rhos, weights, values, targets] = inputs;
        let mut launch = stream.launch_builder(&self.off_policy_sums);
        launch.arg(log_rhos);
        match reference {
            Some(reference) => launch.arg(reference),
            None => launch.arg(&NULL),
        };
        launch.arg(weights).arg(values).arg(targets).arg(&rho_bar).arg(&c_bar).arg(&n_i).arg(sums).arg(ratios);
        // SAFETY: (log_rhos, ref, weights, values, targets, rho_bar, c_bar, n, sums, ratios) is
        // the parameter list; the four inputs, ref and ratios hold n floats and sums the ten
        // doubles the kernel adds to (checked); ref may be NULL (the kernel tests it).
        unsafe { launch.launch(grid(n)) }?;
        Ok(())
    }

    /// The fused V-trace loss rows over `n_rows` heads rows (`n` samples plus the bootstrap),
    /// with the head parameters' gradient rows `[n][n_params]`.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn vtrace_loss_grad(
        &self,
        stream: &Arc<CudaStream>,
        head: &HeadArgs<'_>,
        args: &VTraceLossGradArgs<'_>,
        moments: &mut CudaViewMut<'_, f64>,
        d_heads: &mut CudaViewMut<'_, f32>,
        d_head_params: &mut CudaViewMut<'_, f32>,
        stats: &mut CudaViewMut<'_, f64>,
    ) -> Result<(), BackendError> {
        let op = "vtrace_loss_grad";
        let n = args.weights.len();
        let stride = head.n_outputs + 1;
        let (width, n_params) = head.widths();
        let n_rows = d_heads.len() / stride;
        check_len(op, "d_heads", n_rows * stride, d_heads.len())?;
        check_len(op, "heads", n_rows * stride, args.heads.len())?;
        check_len(op, "actions", n * width, args.actions.len())?;
        check_len(op, "d_head_params", n * n_params, d_head_params.len())?;
        for (operand, len) in
            [("vs", args.vs.len()), ("log_rhos", args.log_rhos.len()), ("pg_advantages", args.pg_advantages.len())]
        {
            check_len(op, operand, n, len)?;
        }
        if args.values.len() < n || n > n_rows {
            return Err(BackendError::Shape { op, operand: "values", expected: n, got: args.values.len() });
        }
        check_len(op, "moments", SLOT_STATS, moments.len())?;
        check_len(op, "stats", 6, stats.len())?;
        let (outputs_i, flags, n_i, rows_i) =
            (int("n_outputs", head.n_outputs)?, head.flags(), int("n", n)?, int("n_rows", n_rows)?);
        let mut launch = stream.launch_builder(&self.heads[head.index()].vtrace_loss_grad);
        head.push(op, &mut launch, &outputs_i, &flags)?;
        launch
            .arg(&args.heads)
            .arg(&args.actions)
            .arg(&args.weights)
            .arg(&args.values)
            .arg(&args.vs)
            .arg(&args.log_rhos)
            .arg(&args.pg_advantages)
            .arg(&args.rho_bar)
            .arg(&args.value_coef)
            .arg(&args.ent_coef)
            .arg(&n_i)
            .arg(&rows_i)
            .arg(moments)
            .arg(d_heads)
            .arg(d_head_params)
            .arg(stats);
        // SAFETY: the argument list matches vtrace_loss_grad_<head>'s parameters; heads and
        // d_heads hold n_rows rows of n_outputs + 1 floats, actions n rows of the action width,
        // d_head_params n rows of the head's parameter count, the per-sample inputs n floats
        // (read only for rows < n); moments and stats are disjoint parts of one slot
        // (split_at_mut) of 3 and 6 doubles; every categorical action is below n_outputs
        // (validated before staging).
        unsafe { launch.launch(grid(n_rows)) }?;
        Ok(())
    }

    /// The fused PPO loss rows over `n` samples, with the head parameters' gradient rows.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn ppo_loss_grad(
        &self,
        stream: &Arc<CudaStream>,
        head: &HeadArgs<'_>,
        args: &PpoLossGradArgs<'_>,
        moments: &mut CudaViewMut<'_, f64>,
        d_heads: &mut CudaViewMut<'_, f32>,
        d_head_params: &mut CudaViewMut<'_, f32>,
        stats: &mut CudaViewMut<'_, f64>,
    ) -> Result<(), BackendError> {
        let op = "ppo_loss_grad";
        let n = args.weights.len();
        let stride = head.n_outputs + 1;
        let (width, n_params) = head.widths();
        check_len(op, "heads", n * stride, args.heads.len())?;
        check_len(op, "d_heads", n * stride, d_heads.len())?;
        check_len(op, "actions", n * width, args.actions.len())?;
        check_len(op, "d_head_params", n * n_params, d_head_params.len())?;
        for (operand, len) in [
            ("values", args.values.len()),
            ("advantages", args.advantages.len()),
            ("returns", args.returns.len()),
            ("prox_log_probs", args.prox_log_probs.len()),
            ("is_weights", args.is_weights.len()),
        ] {
            check_len(op, operand, n, len)?;
        }
        check_len(op, "moments", SLOT_STATS, moments.len())?;
        check_len(op, "stats", 6, stats.len())?;
        let (outputs_i, flags, n_i) = (int("n_outputs", head.n_outputs)?, head.flags(), int("n", n)?);
        let normalize = i32::from(args.normalize);
        let mut launch = stream.launch_builder(&self.heads[head.index()].ppo_loss_grad);
        head.push(op, &mut launch, &outputs_i, &flags)?;
        launch
            .arg(&args.heads)
            .arg(&args.actions)
            .arg(&args.weights)
            .arg(&args.values)
            .arg(&args.advantages)
            .arg(&args.returns)
            .arg(&args.prox_log_probs)
            .arg(&args.is_weights)
            .arg(&args.clip_coef)
            .arg(&args.value_coef)
            .arg(&args.ent_coef)
            .arg(&normalize)
            .arg(&n_i)
            .arg(moments)
            .arg(d_heads)
            .arg(d_head_params)
            .arg(stats);
        // SAFETY: the argument list matches ppo_loss_grad_<head>'s parameters; heads and d_heads
        // hold n rows of n_outputs + 1 floats, actions n rows of the action width,
        // d_head_params n rows of the head's parameter count and every per-sample input n
        // floats (checked); moments and stats are disjoint parts of one slot; every categorical
        // action is below n_outputs (validated).
        unsafe { launch.launch(grid(n)) }?;
        Ok(())
    }

    /// `sumsq[0] += Σ g²`.
    pub(crate) fn sum_squares(
        &self,
        stream: &Arc<CudaStream>,
        grads: &CudaView<'_, f32>,
        sumsq: &mut CudaViewMut<'_, f64>,
    ) -> Result<(), BackendError> {
        check_len("sum_squares", "sumsq", 1, sumsq.len())?;
        let n = long("n", grads.len())?;
        let mut launch = stream.launch_builder(&self.sum_squares);
        launch.arg(grads).arg(&n).arg(sumsq);
        // SAFETY: (g, n, acc) is the parameter list; g holds n floats and acc one double.
        unsafe { launch.launch(grid(grads.len())) }?;
        Ok(())
    }

    /// From `Σ g²`: the norm, the skip decision, the step count and the bias corrections.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn adam_prepare(
        &self,
        stream: &Arc<CudaStream>,
        sumsq: &CudaView<'_, f64>,
        step: &mut CudaViewMut<'_, f64>,
        coeffs: &mut CudaViewMut<'_, f32>,
        norm_out: &mut CudaViewMut<'_, f32>,
        learning_rate: f32,
        max_norm: f32,
        beta1: f32,
        beta2: f32,
    ) -> Result<(), BackendError> {
        check_len("adam_prepare", "sumsq", 1, sumsq.len())?;
        check_len("adam_prepare", "step", 1, step.len())?;
        check_len("adam_prepare", "coeffs", 4, coeffs.len())?;
        check_len("adam_prepare", "norm_out", 1, norm_out.len())?;
        let mut launch = stream.launch_builder(&self.adam_prepare);
        launch
            .arg(sumsq)
            .arg(step)
            .arg(coeffs)
            .arg(norm_out)
            .arg(&learning_rate)
            .arg(&max_norm)
            .arg(&beta1)
            .arg(&beta2);
        // SAFETY: the argument list matches adam_prepare's parameters; one thread touches
        // sumsq[0], step[0], coeffs[0..4] and norm_out[0], all present (checked).
        unsafe { launch.launch(LaunchConfig { grid_dim: (1, 1, 1), block_dim: (32, 1, 1), shared_mem_bytes: 0 }) }?;
        Ok(())
    }

    /// The clipped Adam step over the flat parameters (skipped when `coeffs[3] = 0`).
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn adam_step(
        &self,
        stream: &Arc<CudaStream>,
        params: &mut CudaViewMut<'_, f32>,
        grads: &CudaView<'_, f32>,
        m: &mut CudaViewMut<'_, f32>,
        v: &mut CudaViewMut<'_, f32>,
        coeffs: &CudaView<'_, f32>,
        beta1: f32,
        beta2: f32,
        eps: f32,
    ) -> Result<(), BackendError> {
        let len = params.len();
        check_len("adam_step", "grads", len, grads.len())?;
        check_len("adam_step", "m", len, m.len())?;
        check_len("adam_step", "v", len, v.len())?;
        check_len("adam_step", "coeffs", 4, coeffs.len())?;
        let n = long("n", len)?;
        let mut launch = stream.launch_builder(&self.adam_step);
        launch.arg(params).arg(grads).arg(m).arg(v).arg(coeffs).arg(&beta1).arg(&beta2).arg(&eps).arg(&n);
        // SAFETY: the argument list matches adam_step's parameters; params, grads, m and v hold
        // n floats and coeffs four (checked); the four buffers are distinct allocations.
        unsafe { launch.launch(grid(len)) }?;
        Ok(())
    }

    /// Unfold `n` images `x` into `cols: [n·OH·OW][C·K·K]` (see `conv.cu`).
    pub(crate) fn im2col(
        &self,
        stream: &Arc<CudaStream>,
        x: &CudaView<'_, f32>,
        n: usize,
        geometry: &ConvGeometry,
        cols: &mut CudaViewMut<'_, f32>,
    ) -> Result<(), BackendError> {
        check_len("im2col", "x", n * geometry.input_len(), x.len())?;
        check_len("im2col", "cols", n * geometry.cols_len(), cols.len())?;
        let args = ConvInts::new(n, geometry)?;
        let len = cols.len();
        let mut launch = stream.launch_builder(&self.im2col);
        launch.arg(x).arg(cols);
        args.push(&mut launch);
        // SAFETY: the argument list matches im2col's (x, cols, then the ten ints of
        // ConvInts::push); the kernel writes cols[0..n·OH·OW·C·K·K) and reads x only at in-image
        // positions of images 0..n, below n·C·H·W; both lengths are checked above, and cols (a
        // mutable borrow) cannot alias x.
        unsafe { launch.launch(grid(len)) }?;
        Ok(())
    }

    /// Fold `d_cols: [n·OH·OW][C·K·K]` back into `dx: [n][C·H·W]`, overwriting it (see `conv.cu`).
    pub(crate) fn col2im(
        &self,
        stream: &Arc<CudaStream>,
        d_cols: &CudaView<'_, f32>,
        n: usize,
        geometry: &ConvGeometry,
        dx: &mut CudaViewMut<'_, f32>,
    ) -> Result<(), BackendError> {
        check_len("col2im", "d_cols", n * geometry.cols_len(), d_cols.len())?;
        check_len("col2im", "dx", n * geometry.input_len(), dx.len())?;
        let args = ConvInts::new(n, geometry)?;
        let len = dx.len();
        let mut launch = stream.launch_builder(&self.col2im);
        launch.arg(d_cols).arg(dx);
        args.push(&mut launch);
        // SAFETY: the argument list matches col2im's (d_cols, dx, then the ten ints of
        // ConvInts::push); the kernel writes dx[0..n·C·H·W) and reads d_cols only at rows of
        // in-range output positions of images 0..n, below n·OH·OW·C·K·K; both lengths are
        // checked above, and dx (a mutable borrow) cannot alias d_cols.
        unsafe { launch.launch(grid(len)) }?;
        Ok(())
    }
}

impl Kernels {
    /// Unfold `n` images of bytes packed four to a word in `x` into `cols`, byte `v` as
    /// `table[v]` (`table`: 256 floats on the device; see `conv.cu`).
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn im2col_u8(
        &self,
        stream: &Arc<CudaStream>,
        x: &CudaView<'_, f32>,
        n: usize,
        geometry: &ConvGeometry,
        table: &CudaView<'_, f32>,
        cols: &mut CudaViewMut<'_, f32>,
    ) -> Result<(), BackendError> {
        let image_words = crate::backend::packed_words(geometry.input_len());
        check_len("im2col_u8", "x", n * image_words, x.len())?;
        check_len("im2col_u8", "table", 256, table.len())?;
        check_len("im2col_u8", "cols", n * geometry.cols_len(), cols.len())?;
        let args = ConvInts::new(n, geometry)?;
        let image_stride = long("image_stride", 4 * image_words)?;
        long("x bytes", n.saturating_mul(4 * image_words))?;
        let len = cols.len();
        let mut launch = stream.launch_builder(&self.im2col_u8);
        launch.arg(x).arg(cols).arg(table).arg(&image_stride);
        args.push(&mut launch);
        // SAFETY: the argument list matches im2col_u8's (x read as bytes, cols, table,
        // image_stride, then the ten ints of ConvInts::push); the kernel writes
        // cols[0..n·OH·OW·C·K·K) and reads bytes of images 0..n below n·image_stride = 4·x.len()
        // and table[0..256); the lengths are checked above, and cols (a mutable borrow) cannot
        // alias x or table.
        unsafe { launch.launch(grid(len)) }?;
        Ok(())
    }

    /// Widen `rows` rows of `width` bytes packed four to a word in `x` into `out`, byte `v` as
    /// `table[v]` (see `conv.cu`).
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn widen_u8(
        &self,
        stream: &Arc<CudaStream>,
        x: &CudaView<'_, f32>,
        rows: usize,
        width: usize,
        table: &CudaView<'_, f32>,
        out: &mut CudaViewMut<'_, f32>,
    ) -> Result<(), BackendError> {
        let row_words = crate::backend::packed_words(width);
        check_len("widen_u8", "x", rows * row_words, x.len())?;
        check_len("widen_u8", "table", 256, table.len())?;
        check_len("widen_u8", "out", rows * width, out.len())?;
        let len = out.len();
        if len == 0 {
            return Ok(());
        }
        let row_stride = long("row_stride", 4 * row_words)?;
        long("x bytes", rows.saturating_mul(4 * row_words))?;
        let (rows_arg, width_arg) = (int("rows", rows)?, int("width", width)?);
        let mut launch = stream.launch_builder(&self.widen_u8);
        launch.arg(x).arg(out).arg(table).arg(&row_stride).arg(&rows_arg).arg(&width_arg);
        // SAFETY: the argument list matches widen_u8's (x read as bytes, out, table,
        // row_stride, rows, width); the kernel writes out[0..rows·width) and reads bytes below
        // rows·row_stride = 4·x.len() and table[0..256); the lengths are checked above, and out
        // (a mutable borrow) cannot alias x or table.
        unsafe { launch.launch(grid(len)) }?;
        Ok(())
    }
}

/// The integer arguments shared by `im2col` and `col2im`, converted once.
struct ConvInts([i32; 10]);

impl ConvInts {
    fn new(n: usize, g: &ConvGeometry) -> Result<Self, BackendError> {
        // Every product the kernels form in 64 bits must fit as well.
        long("cols", n.saturating_mul(g.cols_len()))?;
        long("input", n.saturating_mul(g.input_len()))?;
        Ok(ConvInts([
            int("n", n)?,
            int("in_channels", g.in_channels)?,
            int("in_height", g.in_height)?,
            int("in_width", g.in_width)?,
            int("kernel", g.kernel)?,
            int("stride", g.stride)?,
            int("padding", g.padding)?,
            int("out_height", g.out_height())?,
            int("out_width", g.out_width())?,
            i32::from(g.channels_last),
        ]))
    }

    /// Push `n, c_in, h, w, k, stride, pad, out_h, out_w, channels_last`, in the kernels' order.
    fn push<'a>(&'a self, launch: &mut cudarc::driver::LaunchArgs<'a>) {
        for value in &self.0 {
            launch.arg(value);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// CI sets `VOLLEY_REQUIRE_NVRTC=1` (with the NVRTC wheel on `LD_LIBRARY_PATH`), so there a
    /// missing NVRTC fails the test instead of skipping it.
    fn nvrtc_or_skip() -> bool {
        if nvrtc_available() {
            return true;
        }
        assert!(
            std::env::var("VOLLEY_REQUIRE_NVRTC").map_or(true, |v| v != "1"),
            "VOLLEY_REQUIRE_NVRTC=1 but NVRTC could not be loaded (LD_LIBRARY_PATH={:?})",
            std::env::var("LD_LIBRARY_PATH").ok()
        );
        eprintln!("SKIPPED: NVRTC (libnvrtc.so) not found; kernels not compiled");
        false
    }

    #[test]
    fn every_kernel_compiles_with_nvrtc_for_the_gpu_architectures_we_target() {
        if !nvrtc_or_skip() {
            return;
        }
        for arch in ["sm_80", "sm_90"] {
            let sizes = compile_check(Some(arch)).unwrap_or_else(|err| panic!("{arch}: {err}"));
            assert_eq!(sizes.len(), FILES.len());
        }
        let module = compile_module(Some("sm_90")).expect("the whole module compiles").to_src();
        for kernel in FILES.iter().flat_map(|f| f.kernels) {
            assert!(module.contains(&format!(".entry {kernel}(")), "{kernel} missing from the module");
        }
    }

    #[test]
    fn a_broken_kernel_is_reported_with_the_compiler_log() {
        if !nvrtc_or_skip() {
            return;
        }
        let err = compile("extern \"C\" __global__ void k(float* x) { x[0] = undefined_name; }", None, "broken.cu")
            .expect_err("must not compile");
        let message = err.to_string();
        assert!(message.contains("broken.cu") && message.contains("undefined_name"), "{message}");
    }

    #[test]
    fn every_declared_kernel_is_defined_in_its_source() {
        for file in FILES {
            for kernel in file.kernels {
                // A head kernel is defined by one `VOLLEY_HEAD_KERNELS(<head>, <name>)` line.
                let by_head = ["log_probs_", "vtrace_loss_grad_", "ppo_loss_grad_"].iter().any(|prefix| {
                    kernel.strip_prefix(prefix).is_some_and(|name| {
                        file.source.contains(&format!("__global__ void {prefix}##NAME("))
                            && file
                                .source
                                .lines()
                                .any(|l| l.starts_with("VOLLEY_HEAD_KERNELS(") && l.ends_with(&format!(", {name})")))
                    })
                });
                assert!(
                    by_head || file.source.contains(&format!("__global__ void {kernel}(")),
                    "{} does not define {kernel}",
                    file.name
                );
            }
        }
    }
}
