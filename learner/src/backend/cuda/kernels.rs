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

use cudarc::driver::{
    CudaFunction, CudaModule, CudaStream, CudaView, CudaViewMut, LaunchArgs, LaunchConfig, PushKernelArg,
};
use cudarc::nvrtc::{CompileOptions, Ptx};

use volley_policy::returns::VTraceConfig;
use volley_policy::{ActionHead, ConvGeometry};

use crate::losses::{PpoLossConfig, VTraceLossConfig};

use crate::backend::ops::{check_all, ConvMap};
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
        kernels: &["bias_act_fwd", "act_bwd", "take_column", "copy_columns", "gather_columns", "fill"],
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

/// Push `view`, or [`NULL`] for an input the kernel may go without.
fn optional<'a, 'l>(launch: &'l mut LaunchArgs<'a>, view: Option<&'a CudaView<'_, f32>>) -> &'l mut LaunchArgs<'a> {
    match view {
        Some(view) => launch.arg(view),
        None => launch.arg(&NULL),
    }
}

/// Activation codes of `bias_act_fwd` and `act_bwd`.
pub(crate) const ACT_IDENTITY: i32 = 0;
/// `tanh`.
pub(crate) const ACT_TANH: i32 = 1;
/// `relu`.
pub(crate) const ACT_RELU: i32 = 2;

/// The loaded kernels, one field per `extern "C"` kernel in `learner/kernels/`, and the stream
/// they run on.
pub(crate) struct Kernels {
    /// The compute stream: every launch runs here, in order.
    stream: Arc<CudaStream>,
    bias_act_fwd: CudaFunction,
    act_bwd: CudaFunction,
    take_column: CudaFunction,
    copy_columns: CudaFunction,
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

    /// Check the parameters' length (every head kernel indexes them) and convert the two
    /// integers of the head arguments.
    fn check(&self, op: &'static str) -> Result<[i32; 2], BackendError> {
        check_len(op, "head params", self.kind.n_params(self.n_outputs), self.params.len())?;
        Ok([int("n_outputs", self.n_outputs)?, self.flags()])
    }

    /// Push the three head arguments every head kernel starts with (`ints` from
    /// [`Self::check`]).
    fn push<'a, 'l>(&'a self, launch: &'l mut LaunchArgs<'a>, ints: &'a [i32; 2]) -> &'l mut LaunchArgs<'a> {
        let [n_outputs, flags] = ints;
        launch.arg(n_outputs).arg(&self.params).arg(flags)
    }
}

/// Where [`Kernels::vtrace_loss_grad`] and [`Kernels::ppo_loss_grad`] write: the slot's moments
/// and loss sums (disjoint parts of one slot), the heads block's gradient and the head
/// parameters' gradient rows.
pub(crate) struct LossGradOutputs<'a> {
    /// `[W, Σ w·x, Σ w·(x − mean)²]` ([`SLOT_STATS`] doubles).
    pub(crate) moments: CudaViewMut<'a, f64>,
    /// `∂L/∂heads`, rows of `n_outputs + 1`.
    pub(crate) d_heads: CudaViewMut<'a, f32>,
    /// `[n][n_params]`.
    pub(crate) d_head_params: CudaViewMut<'a, f32>,
    /// The six loss sums.
    pub(crate) stats: CudaViewMut<'a, f64>,
}

impl LossGradOutputs<'_> {
    /// Push the four outputs, the last parameters of both loss kernels.
    fn push<'b, 'l>(&'b mut self, launch: &'l mut LaunchArgs<'b>) -> &'l mut LaunchArgs<'b> {
        launch.arg(&mut self.moments).arg(&mut self.d_heads).arg(&mut self.d_head_params).arg(&mut self.stats)
    }
}

/// What both fused loss kernels read first, in their parameter order: the head's arguments,
/// the heads block, and per sample the action, the weight and the value.
pub(crate) struct LossRows<'a> {
    pub(crate) head: HeadArgs<'a>,
    /// Rows of `n_outputs + 1`.
    pub(crate) heads: CudaView<'a, f32>,
    /// `[n][action width]` words.
    pub(crate) actions: CudaView<'a, f32>,
    /// `[n]`.
    pub(crate) weights: CudaView<'a, f32>,
    /// At least `[n]`.
    pub(crate) values: CudaView<'a, f32>,
}

impl LossRows<'_> {
    /// Check what every loss kernel indexes besides its own inputs: the head's parameters,
    /// `n_rows` heads rows in and out, and the actions and parameter-gradient rows of the
    /// `n = weights.len()` samples; and convert the head's two integers.
    fn check(&self, op: &'static str, out: &LossGradOutputs<'_>, n_rows: usize) -> Result<[i32; 2], BackendError> {
        let (n, stride) = (self.weights.len(), self.head.n_outputs + 1);
        let (width, n_params) = self.head.widths();
        let head_ints = self.head.check(op)?;
        check_all(
            op,
            &[
                ("heads", n_rows * stride, self.heads.len()),
                ("d_heads", n_rows * stride, out.d_heads.len()),
                ("actions", n * width, self.actions.len()),
                ("d_head_params", n * n_params, out.d_head_params.len()),
                ("moments", SLOT_STATS, out.moments.len()),
                ("stats", 6, out.stats.len()),
            ],
        )?;
        Ok(head_ints)
    }

    /// Push the head's arguments (`head_ints` from [`Self::check`]) and the four views.
    fn push<'a, 'l>(&'a self, launch: &'l mut LaunchArgs<'a>, head_ints: &'a [i32; 2]) -> &'l mut LaunchArgs<'a> {
        self.head.push(launch, head_ints).arg(&self.heads).arg(&self.actions).arg(&self.weights).arg(&self.values)
    }
}

/// The inputs of [`Kernels::vtrace_loss_grad`]: its [`LossRows`], then `[n]` per-sample inputs.
pub(crate) struct VTraceLossGradArgs<'a> {
    pub(crate) rows: LossRows<'a>,
    pub(crate) vs: CudaView<'a, f32>,
    pub(crate) log_rhos: CudaView<'a, f32>,
    pub(crate) pg_advantages: CudaView<'a, f32>,
    pub(crate) config: &'a VTraceLossConfig,
}

/// The inputs of [`Kernels::ppo_loss_grad`]: its [`LossRows`], then `[n]` per-sample inputs.
pub(crate) struct PpoLossGradArgs<'a> {
    pub(crate) rows: LossRows<'a>,
    pub(crate) advantages: CudaView<'a, f32>,
    pub(crate) returns: CudaView<'a, f32>,
    pub(crate) prox_log_probs: CudaView<'a, f32>,
    pub(crate) is_weights: CudaView<'a, f32>,
    pub(crate) config: &'a PpoLossConfig,
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
    /// The clipping thresholds and `λ`.
    pub(crate) config: &'a VTraceConfig,
    /// Group baselines: where finite, the policy-gradient advantage before the clipped
    /// importance weight (`[T][B]`).
    pub(crate) advantage_override: Option<CudaView<'a, f32>>,
}

impl Kernels {
    /// Look every kernel up in `module`; every launcher launches on `stream`.
    pub(crate) fn load(module: Arc<CudaModule>, stream: Arc<CudaStream>) -> Result<Self, BackendError> {
        let f = |name: &str| {
            module.load_function(name).map_err(|err| {
                BackendError::Kernels(KernelError::MissingKernel {
                    file: format!("module ({err})"),
                    kernel: name.into(),
                })
            })
        };
        Ok(Kernels {
            stream,
            bias_act_fwd: f("bias_act_fwd")?,
            act_bwd: f("act_bwd")?,
            take_column: f("take_column")?,
            copy_columns: f("copy_columns")?,
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

    /// Launch `function` on the stream over `config`, with the arguments `push` adds in the
    /// kernel's parameter order: the one launch every launcher below ends with.
    ///
    /// # Safety
    ///
    /// The arguments must match the kernel's parameter list, and every element the kernel
    /// indexes through them must lie inside the views passed: each launcher checks the lengths
    /// its kernel relies on first, and states them in its `SAFETY` comment.
    unsafe fn launch<'a>(
        &'a self,
        function: &'a CudaFunction,
        config: LaunchConfig,
        push: impl for<'l> FnOnce(&'l mut LaunchArgs<'a>) -> &'l mut LaunchArgs<'a>,
    ) -> Result<(), BackendError> {
        let mut launch = self.stream.launch_builder(function);
        push(&mut launch);
        // SAFETY: the caller's contract above.
        unsafe { launch.launch(config) }?;
        Ok(())
    }

    /// `y[r][j] = act(y[r][j] + bias[j])` over `[rows][width]`.
    pub(crate) fn bias_act_fwd(
        &self,
        y: &mut CudaViewMut<'_, f32>,
        bias: &CudaView<'_, f32>,
        rows: usize,
        act: i32,
    ) -> Result<(), BackendError> {
        let width = bias.len();
        check_len("bias_act_fwd", "y", rows * width, y.len())?;
        let (rows_i, width_i) = (int("rows", rows)?, int("width", width)?);
        // SAFETY: (y, bias, rows, width, act) is the kernel's parameter list; it reads
        // bias[0..width) and reads and writes y[0..rows·width), both checked above.
        unsafe {
            self.launch(&self.bias_act_fwd, grid(rows * width), |l| {
                l.arg(y).arg(bias).arg(&rows_i).arg(&width_i).arg(&act)
            })
        }
    }

    /// `dy ← dy · act'(pre)` through the stored output `y`.
    pub(crate) fn act_bwd(
        &self,
        dy: &mut CudaViewMut<'_, f32>,
        y: &CudaView<'_, f32>,
        act: i32,
    ) -> Result<(), BackendError> {
        let len = dy.len();
        check_len("act_bwd", "y", len, y.len())?;
        let n = long("n", len)?;
        // SAFETY: (dy, y, n, act) is the parameter list; both views hold n elements (checked).
        unsafe { self.launch(&self.act_bwd, grid(len), |l| l.arg(dy).arg(y).arg(&n).arg(&act)) }
    }

    /// `dst[i] = src[i · stride + column]` for `i < dst.len()`.
    pub(crate) fn take_column(
        &self,
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
        // SAFETY: (src, dst, rows, stride, col) is the parameter list; the largest index read is
        // (rows − 1)·stride + column < rows·stride = src.len(), and dst holds rows (checked).
        unsafe {
            self.launch(&self.take_column, grid(rows), |l| {
                l.arg(src).arg(dst).arg(&rows_i).arg(&stride_i).arg(&column_i)
            })
        }
    }

    /// `dst[r][dst_column + k] = src[r][src_column + k]` for `r < rows`, `k < columns`, with
    /// `widths = (src_width, dst_width)` and `(src_column, dst_column)` = `from_to`.
    pub(crate) fn copy_columns(
        &self,
        src: &CudaView<'_, f32>,
        (src_width, dst_width): (usize, usize),
        (src_column, dst_column): (usize, usize),
        columns: usize,
        rows: usize,
        dst: &mut CudaViewMut<'_, f32>,
    ) -> Result<(), BackendError> {
        check_len("copy_columns", "src", rows * src_width, src.len())?;
        check_len("copy_columns", "dst", rows * dst_width, dst.len())?;
        for (operand, end, width) in
            [("src columns", src_column + columns, src_width), ("dst columns", dst_column + columns, dst_width)]
        {
            if end > width {
                return Err(BackendError::Shape { op: "copy_columns", operand, expected: width, got: end });
            }
        }
        let n = long("n", rows * columns)?;
        let ints = [int("src_width", src_width)?, int("src_column", src_column)?, int("dst_width", dst_width)?];
        let (dst_column_i, columns_i) = (int("dst_column", dst_column)?, int("columns", columns)?);
        // SAFETY: (src, dst, n, src_width, src_column, dst_width, dst_column, columns) is the
        // parameter list; element i = r·columns + k reads src[r·src_width + src_column + k] and
        // writes dst[r·dst_width + dst_column + k], inside both views for r < rows and
        // src_column + k < src_width, dst_column + k < dst_width (checked).
        unsafe {
            self.launch(&self.copy_columns, grid(rows * columns), |l| {
                l.arg(src).arg(dst).arg(&n).arg(&ints[0]).arg(&ints[1]).arg(&ints[2]).arg(&dst_column_i).arg(&columns_i)
            })
        }
    }

    /// `dst[t][j][k] = src[t][columns[j]][k]` for `j < n_columns` over `[rows][b_len][width]`
    /// words; `columns` holds the `n_columns` column indices, each `< b_len`.
    pub(crate) fn gather_columns(
        &self,
        src: &CudaView<'_, f32>,
        rows: usize,
        b_len: usize,
        width: usize,
        columns: &CudaView<'_, u32>,
        dst: &mut CudaViewMut<'_, f32>,
    ) -> Result<(), BackendError> {
        let n_columns = columns.len();
        let op = "gather_columns";
        check_all(op, &[("src", rows * b_len * width, src.len()), ("dst", rows * n_columns * width, dst.len())])?;
        let (rows_i, b_i, width_i, n_i) =
            (int("rows", rows)?, int("b_len", b_len)?, int("width", width)?, int("n_columns", n_columns)?);
        // SAFETY: (src, dst, rows, b_len, width, cols, mb_len) is the parameter list; dst holds
        // rows·n_columns·width words and src rows·b_len·width (checked); every column index is
        // below b_len because the trainer uploads permutations of 0..b_len only.
        unsafe {
            self.launch(&self.gather_columns, grid(rows * n_columns * width), |l| {
                l.arg(src).arg(dst).arg(&rows_i).arg(&b_i).arg(&width_i).arg(columns).arg(&n_i)
            })
        }
    }

    /// `x[i] = value`.
    pub(crate) fn fill(&self, x: &mut CudaViewMut<'_, f32>, value: f32) -> Result<(), BackendError> {
        let len = x.len();
        let n = long("n", len)?;
        // SAFETY: (x, value, n) is the parameter list and x holds n floats.
        unsafe { self.launch(&self.fill, grid(len), |l| l.arg(x).arg(&value).arg(&n)) }
    }

    /// `dst[b] = starts[b] ≠ 0 ? 0 : src[b]` over `[B][hidden]`.
    pub(crate) fn gru_reset_copy(
        &self,
        src: &CudaView<'_, f32>,
        starts: &CudaView<'_, f32>,
        hidden: usize,
        dst: &mut CudaViewMut<'_, f32>,
    ) -> Result<(), BackendError> {
        let b_len = starts.len();
        check_all("gru_reset_copy", &[("src", b_len * hidden, src.len()), ("dst", b_len * hidden, dst.len())])?;
        let (b_i, h_i) = (int("b_len", b_len)?, int("hidden", hidden)?);
        // SAFETY: (src, starts, dst, b_len, hidden) is the parameter list; src and dst hold
        // b_len·hidden floats and starts b_len (checked); src and dst are distinct buffers.
        unsafe {
            self.launch(&self.gru_reset_copy, grid(b_len * hidden), |l| {
                l.arg(src).arg(starts).arg(dst).arg(&b_i).arg(&h_i)
            })
        }
    }

    /// One GRU step forward (see `gru.cu`).
    pub(crate) fn gru_cell_fwd(
        &self,
        gi: &CudaView<'_, f32>,
        gh: &CudaView<'_, f32>,
        h_prev: &CudaView<'_, f32>,
        hidden: usize,
        gates: &mut CudaViewMut<'_, f32>,
        h_out: &mut CudaViewMut<'_, f32>,
    ) -> Result<(), BackendError> {
        let state = h_prev.len();
        let gate_lens =
            [("gi", gi.len()), ("gh", gh.len()), ("gates", gates.len())].map(|(op, len)| (op, 3 * state, len));
        check_all("gru_cell_fwd", &gate_lens)?;
        check_len("gru_cell_fwd", "h_out", state, h_out.len())?;
        let (b_i, h_i) = (int("b_len", state.checked_div(hidden).unwrap_or(0))?, int("hidden", hidden)?);
        // SAFETY: (gi, gh, h_prev, gates, h_out, b_len, hidden) is the parameter list; the gate
        // views hold 3·b_len·hidden floats and the state views b_len·hidden (checked); the two
        // outputs are distinct buffers from the inputs.
        unsafe {
            self.launch(&self.gru_cell_fwd, grid(state), |l| {
                l.arg(gi).arg(gh).arg(h_prev).arg(gates).arg(h_out).arg(&b_i).arg(&h_i)
            })
        }
    }

    /// One GRU step backward (see `gru.cu`).
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn gru_cell_bwd(
        &self,
        d_h: &mut CudaViewMut<'_, f32>,
        gates: &CudaView<'_, f32>,
        gh: &CudaView<'_, f32>,
        h_prev: &CudaView<'_, f32>,
        hidden: usize,
        d_gi: &mut CudaViewMut<'_, f32>,
        d_gh: &mut CudaViewMut<'_, f32>,
    ) -> Result<(), BackendError> {
        let state = d_h.len();
        let gate_lens = [("gates", gates.len()), ("gh", gh.len()), ("d_gi", d_gi.len()), ("d_gh", d_gh.len())]
            .map(|(op, len)| (op, 3 * state, len));
        check_all("gru_cell_bwd", &gate_lens)?;
        check_len("gru_cell_bwd", "h_prev", state, h_prev.len())?;
        let (b_i, h_i) = (int("b_len", state.checked_div(hidden).unwrap_or(0))?, int("hidden", hidden)?);
        // SAFETY: (dh, gates, gh, h_prev, dgi, dgh, b_len, hidden) is the parameter list; every
        // view has the length its shape implies (checked); dh is read and written only at the
        // thread's own index.
        unsafe {
            self.launch(&self.gru_cell_bwd, grid(state), |l| {
                l.arg(d_h).arg(gates).arg(gh).arg(h_prev).arg(d_gi).arg(d_gh).arg(&b_i).arg(&h_i)
            })
        }
    }

    /// `d_h[b] = 0` where `starts_next[b] ≠ 0` (when given), then `d_h += from_heads`.
    pub(crate) fn gru_carry_grad(
        &self,
        d_h: &mut CudaViewMut<'_, f32>,
        starts_next: Option<&CudaView<'_, f32>>,
        from_heads: &CudaView<'_, f32>,
        hidden: usize,
    ) -> Result<(), BackendError> {
        let state = d_h.len();
        let b_len = state.checked_div(hidden).unwrap_or(0);
        let starts_len = starts_next.map_or(b_len, |starts| starts.len());
        check_all("gru_carry_grad", &[("from_heads", state, from_heads.len()), ("starts_next", b_len, starts_len)])?;
        let (b_i, h_i) = (int("b_len", b_len)?, int("hidden", hidden)?);
        let apply_reset = i32::from(starts_next.is_some());
        // SAFETY: (dh, starts, from_heads, b_len, hidden, apply_reset) is the parameter list;
        // dh and from_heads hold b_len·hidden floats and starts b_len (checked); the kernel reads
        // starts only when apply_reset is 1, which is exactly when a real view was passed.
        unsafe {
            self.launch(&self.gru_carry_grad, grid(state), |l| {
                optional(l.arg(d_h), starts_next).arg(from_heads).arg(&b_i).arg(&h_i).arg(&apply_reset)
            })
        }
    }

    /// `out[i] = log π(a_i|x_i) − reference[i]` (or without a reference) for `i < out.len()`
    /// under `head`, from rows of stride `n_outputs + 1`.
    pub(crate) fn log_probs(
        &self,
        head: &HeadArgs<'_>,
        heads: &CudaView<'_, f32>,
        actions: &CudaView<'_, f32>,
        reference: Option<&CudaView<'_, f32>>,
        out: &mut CudaViewMut<'_, f32>,
    ) -> Result<(), BackendError> {
        let n = out.len();
        let (width, _) = head.widths();
        let reference_len = reference.map_or(n, |reference| reference.len());
        check_all(
            "log_probs",
            &[
                ("heads", n * (head.n_outputs + 1), heads.len()),
                ("actions", n * width, actions.len()),
                ("reference", n, reference_len),
            ],
        )?;
        let (head_ints, n_i) = (head.check("log_probs")?, int("n", n)?);
        // SAFETY: (n_outputs, head_params, head_flags, heads, actions, ref, out, n) is the
        // parameter list; head_params holds the head's parameters, heads n rows of
        // n_outputs + 1 floats, actions n rows of the head's action width, ref and out n floats
        // (checked); ref may be NULL (the kernel tests it); every categorical action is below
        // n_outputs because the trainer validates actions before staging them.
        unsafe {
            self.launch(&self.heads[head.index()].log_probs, grid(n), |l| {
                optional(head.push(l, &head_ints).arg(heads).arg(actions), reference).arg(out).arg(&n_i)
            })
        }
    }

    /// `out[i] = min(exp(prox[i] − behaviour[i]), clip)`.
    pub(crate) fn behaviour_weights(
        &self,
        prox: &CudaView<'_, f32>,
        behaviour: &CudaView<'_, f32>,
        clip: f32,
        out: &mut CudaViewMut<'_, f32>,
    ) -> Result<(), BackendError> {
        let n = out.len();
        check_all("behaviour_weights", &[("prox", n, prox.len()), ("behaviour", n, behaviour.len())])?;
        let n_i = int("n", n)?;
        // SAFETY: (prox, behaviour, clip, out, n) is the parameter list; all three views hold n
        // floats (checked).
        unsafe {
            self.launch(&self.behaviour_weights, grid(n), |l| l.arg(prox).arg(behaviour).arg(&clip).arg(out).arg(&n_i))
        }
    }

    /// The V-trace reverse scan (one thread per column).
    pub(crate) fn vtrace_scan(
        &self,
        args: &VTraceScanArgs<'_>,
        vs: &mut CudaViewMut<'_, f32>,
        pg_advantages: &mut CudaViewMut<'_, f32>,
    ) -> Result<(), BackendError> {
        let (t_len, b_len) = (args.t_len, args.b_len);
        let n = t_len * b_len;
        check_all(
            "vtrace_scan",
            &[
                ("log_rhos", n, args.log_rhos.len()),
                ("discounts", n, args.discounts.len()),
                ("rewards", n, args.rewards.len()),
                ("values", n, args.values.len()),
                ("vs", n, vs.len()),
                ("pg_advantages", n, pg_advantages.len()),
                ("advantage_override", n, args.advantage_override.as_ref().map_or(n, |v| v.len())),
                ("bootstrap", b_len, args.bootstrap.len()),
            ],
        )?;
        let (t_i, b_i) = (int("t_len", t_len)?, int("b_len", b_len)?);
        // Without an override the kernel never reads the pointer; `rewards` stands in for it.
        let has_override = i32::from(args.advantage_override.is_some());
        let advantage_override = args.advantage_override.as_ref().unwrap_or(&args.rewards);
        let VTraceScanArgs { log_rhos, discounts, rewards, values, bootstrap, config, .. } = args;
        let VTraceConfig { clip_rho_threshold, clip_pg_rho_threshold, clip_c_threshold, lambda_ } = config;
        // SAFETY: the argument list matches vtrace_scan's parameters; every [T][B] view holds
        // t_len·b_len floats (the override too, or it is not read) and bootstrap b_len
        // (checked); each thread touches only its column.
        unsafe {
            self.launch(&self.vtrace_scan, grid(b_len), |l| {
                l.arg(&t_i).arg(&b_i).arg(log_rhos).arg(discounts).arg(rewards).arg(values).arg(bootstrap);
                l.arg(clip_rho_threshold).arg(clip_pg_rho_threshold).arg(clip_c_threshold).arg(lambda_);
                l.arg(&has_override).arg(advantage_override).arg(vs).arg(pg_advantages)
            })
        }
    }

    /// GAE advantages and returns (one thread per column).
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn gae_scan(
        &self,
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
        check_all(
            "gae_scan",
            &[
                ("discounts", n, discounts.len()),
                ("rewards", n, rewards.len()),
                ("values", n, values.len()),
                ("advantages", n, advantages.len()),
                ("returns", n, returns.len()),
                ("advantage_override", n, advantage_override.map_or(n, |v| v.len())),
                ("bootstrap", b_len, bootstrap.len()),
            ],
        )?;
        // Without an override the kernel never reads the pointer; `rewards` stands in for it.
        let has_override = i32::from(advantage_override.is_some());
        let advantage_override = advantage_override.unwrap_or(rewards);
        let (t_i, b_i) = (int("t_len", t_len)?, int("b_len", b_len)?);
        // SAFETY: the argument list matches gae_scan's parameters; every [T][B] view holds
        // t_len·b_len floats (the override too, or it is not read) and bootstrap b_len
        // (checked); each thread touches only its column.
        unsafe {
            self.launch(&self.gae_scan, grid(b_len), |l| {
                l.arg(&t_i).arg(&b_i).arg(discounts).arg(rewards).arg(values).arg(bootstrap).arg(&lambda_);
                l.arg(&has_override).arg(advantage_override).arg(advantages).arg(returns)
            })
        }
    }

    /// `moments[0] += Σ w`, `moments[1] += Σ w·x` (without `x`: only the first).
    pub(crate) fn weighted_sum(
        &self,
        weights: &CudaView<'_, f32>,
        x: Option<&CudaView<'_, f32>>,
        moments: &mut CudaViewMut<'_, f64>,
    ) -> Result<(), BackendError> {
        let n = weights.len();
        check_all("weighted_sum", &[("x", n, x.map_or(n, |x| x.len())), ("moments", SLOT_STATS, moments.len())])?;
        let n_i = int("n", n)?;
        // SAFETY: (w, x, n, acc) is the parameter list; w and x hold n floats (checked), x may
        // be NULL (the kernel tests it), and acc has the two doubles the kernel adds to.
        unsafe { self.launch(&self.weighted_sum, grid(n), |l| optional(l.arg(weights), x).arg(&n_i).arg(moments)) }
    }

    /// `moments[2] += Σ w·(x − mean)²` with the mean from `moments[0..2]`.
    pub(crate) fn weighted_var(
        &self,
        weights: &CudaView<'_, f32>,
        x: &CudaView<'_, f32>,
        moments: &mut CudaViewMut<'_, f64>,
    ) -> Result<(), BackendError> {
        let n = weights.len();
        check_all("weighted_var", &[("x", n, x.len()), ("moments", SLOT_STATS, moments.len())])?;
        let n_i = int("n", n)?;
        // SAFETY: (w, x, n, acc) is the parameter list; w and x hold n floats and acc the three
        // moments the kernel reads and adds to (checked).
        unsafe { self.launch(&self.weighted_var, grid(n), |l| l.arg(weights).arg(x).arg(&n_i).arg(moments)) }
    }

    /// The update's off-policy sums (`crate::telemetry::OffPolicySums`, added to `sums`) over
    /// `[log_rhos, weights, values, value_targets]`, each `[n]`, and every sample's ratio into
    /// `ratios` (`[n]`).
    pub(crate) fn off_policy_sums(
        &self,
        inputs: &[CudaView<'_, f32>; 4],
        reference: Option<&CudaView<'_, f32>>,
        rho_bar: f32,
        c_bar: f32,
        sums: &mut CudaViewMut<'_, f64>,
        ratios: &mut CudaViewMut<'_, f32>,
    ) -> Result<(), BackendError> {
        let op = "off_policy_sums";
        let n = ratios.len();
        for (operand, input) in ["log_rhos", "weights", "values", "value_targets"].into_iter().zip(inputs) {
            check_len(op, operand, n, input.len())?;
        }
        let reference_len = reference.map_or(n, |reference| reference.len());
        check_all(op, &[("reference", n, reference_len), ("sums", crate::telemetry::OFF_POLICY_SUMS, sums.len())])?;
        let n_i = int("n", n)?;
        let [log_rhos, weights, values, targets] = inputs;
        // SAFETY: (log_rhos, ref, weights, values, targets, rho_bar, c_bar, n, sums, ratios) is
        // the parameter list; the four inputs, ref and ratios hold n floats and sums the ten
        // doubles the kernel adds to (checked); ref may be NULL (the kernel tests it).
        unsafe {
            self.launch(&self.off_policy_sums, grid(n), |l| {
                optional(l.arg(log_rhos), reference).arg(weights).arg(values).arg(targets);
                l.arg(&rho_bar).arg(&c_bar).arg(&n_i).arg(sums).arg(ratios)
            })
        }
    }

    /// The fused V-trace loss rows over `n_rows` heads rows (`n` samples plus the bootstrap),
    /// with the head parameters' gradient rows `[n][n_params]`.
    pub(crate) fn vtrace_loss_grad(
        &self,
        args: &VTraceLossGradArgs<'_>,
        mut out: LossGradOutputs<'_>,
    ) -> Result<(), BackendError> {
        let op = "vtrace_loss_grad";
        let VTraceLossGradArgs { rows, vs, log_rhos, pg_advantages, config } = args;
        let n = rows.weights.len();
        let n_rows = out.d_heads.len() / (rows.head.n_outputs + 1);
        let head_ints = rows.check(op, &out, n_rows)?;
        let per_sample = [("vs", vs.len()), ("log_rhos", log_rhos.len()), ("pg_advantages", pg_advantages.len())];
        check_all(op, &per_sample.map(|(operand, len)| (operand, n, len)))?;
        if rows.values.len() < n || n > n_rows {
            return Err(BackendError::Shape { op, operand: "values", expected: n, got: rows.values.len() });
        }
        let (n_i, rows_i) = (int("n", n)?, int("n_rows", n_rows)?);
        let [rho_bar, value_coef, ent_coef] = [config.vtrace.clip_rho_threshold, config.value_coef, config.ent_coef];
        // SAFETY: the argument list matches vtrace_loss_grad_<head>'s parameters; heads and
        // d_heads hold n_rows rows of n_outputs + 1 floats, actions n rows of the action width,
        // d_head_params n rows of the head's parameter count, the per-sample inputs n floats
        // (read only for rows < n); moments and stats are disjoint parts of one slot
        // (split_at_mut) of 3 and 6 doubles; every categorical action is below n_outputs
        // (validated before staging).
        unsafe {
            self.launch(&self.heads[rows.head.index()].vtrace_loss_grad, grid(n_rows), |l| {
                rows.push(l, &head_ints).arg(vs).arg(log_rhos).arg(pg_advantages);
                out.push(l.arg(&rho_bar).arg(&value_coef).arg(&ent_coef).arg(&n_i).arg(&rows_i))
            })
        }
    }

    /// The fused PPO loss rows over `n` samples, with the head parameters' gradient rows.
    pub(crate) fn ppo_loss_grad(
        &self,
        args: &PpoLossGradArgs<'_>,
        mut out: LossGradOutputs<'_>,
    ) -> Result<(), BackendError> {
        let op = "ppo_loss_grad";
        let PpoLossGradArgs { rows, advantages, returns, prox_log_probs, is_weights, config } = args;
        let n = rows.weights.len();
        let head_ints = rows.check(op, &out, n)?;
        let per_sample = [rows.values.len(), advantages.len(), returns.len(), prox_log_probs.len(), is_weights.len()];
        let operands = ["values", "advantages", "returns", "prox_log_probs", "is_weights"];
        for (operand, len) in operands.into_iter().zip(per_sample) {
            check_len(op, operand, n, len)?;
        }
        let (n_i, normalize) = (int("n", n)?, i32::from(config.normalize_advantages));
        let [clip_coef, value_coef, ent_coef] = [config.clip_coef, config.value_coef, config.ent_coef];
        // SAFETY: the argument list matches ppo_loss_grad_<head>'s parameters; heads and d_heads
        // hold n rows of n_outputs + 1 floats, actions n rows of the action width,
        // d_head_params n rows of the head's parameter count and every per-sample input n
        // floats (checked); moments and stats are disjoint parts of one slot; every categorical
        // action is below n_outputs (validated).
        unsafe {
            self.launch(&self.heads[rows.head.index()].ppo_loss_grad, grid(n), |l| {
                rows.push(l, &head_ints).arg(advantages).arg(returns).arg(prox_log_probs).arg(is_weights);
                l.arg(&clip_coef).arg(&value_coef).arg(&ent_coef).arg(&normalize).arg(&n_i);
                out.push(l)
            })
        }
    }

    /// `sumsq[0] += Σ g²`.
    pub(crate) fn sum_squares(
        &self,
        grads: &CudaView<'_, f32>,
        sumsq: &mut CudaViewMut<'_, f64>,
    ) -> Result<(), BackendError> {
        check_len("sum_squares", "sumsq", 1, sumsq.len())?;
        let n = long("n", grads.len())?;
        // SAFETY: (g, n, acc) is the parameter list; g holds n floats and acc one double.
        unsafe { self.launch(&self.sum_squares, grid(grads.len()), |l| l.arg(grads).arg(&n).arg(sumsq)) }
    }

    /// From `Σ g²`: the norm, the skip decision, the step count and the bias corrections.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn adam_prepare(
        &self,
        sumsq: &CudaView<'_, f64>,
        step: &mut CudaViewMut<'_, f64>,
        coeffs: &mut CudaViewMut<'_, f32>,
        norm_out: &mut CudaViewMut<'_, f32>,
        learning_rate: f32,
        max_norm: f32,
        beta1: f32,
        beta2: f32,
    ) -> Result<(), BackendError> {
        let lens = [("sumsq", 1, sumsq.len()), ("step", 1, step.len()), ("coeffs", 4, coeffs.len())];
        check_all("adam_prepare", &lens)?;
        check_len("adam_prepare", "norm_out", 1, norm_out.len())?;
        let one_thread = LaunchConfig { grid_dim: (1, 1, 1), block_dim: (32, 1, 1), shared_mem_bytes: 0 };
        // SAFETY: the argument list matches adam_prepare's parameters; one thread touches
        // sumsq[0], step[0], coeffs[0..4] and norm_out[0], all present (checked).
        unsafe {
            self.launch(&self.adam_prepare, one_thread, |l| {
                l.arg(sumsq).arg(step).arg(coeffs).arg(norm_out);
                l.arg(&learning_rate).arg(&max_norm).arg(&beta1).arg(&beta2)
            })
        }
    }

    /// The clipped Adam step over the flat parameters (skipped when `coeffs[3] = 0`).
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn adam_step(
        &self,
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
        let lens = [("grads", len, grads.len()), ("m", len, m.len()), ("v", len, v.len()), ("coeffs", 4, coeffs.len())];
        check_all("adam_step", &lens)?;
        let n = long("n", len)?;
        // SAFETY: the argument list matches adam_step's parameters; params, grads, m and v hold
        // n floats and coeffs four (checked); the four buffers are distinct allocations.
        unsafe {
            self.launch(&self.adam_step, grid(len), |l| {
                l.arg(params).arg(grads).arg(m).arg(v).arg(coeffs).arg(&beta1).arg(&beta2).arg(&eps).arg(&n)
            })
        }
    }

    /// `im2col` ([`ConvMap::Unfold`]: `src` the images, `dst` the unfolded matrix) or
    /// `col2im` ([`ConvMap::Fold`]: `src` the matrix's gradient, `dst` the images' gradient,
    /// overwritten) over `n` images (see `conv.cu`).
    pub(crate) fn conv_map(
        &self,
        map: ConvMap,
        src: &CudaView<'_, f32>,
        n: usize,
        geometry: &ConvGeometry,
        dst: &mut CudaViewMut<'_, f32>,
    ) -> Result<(), BackendError> {
        let (images, cols) = (n * geometry.input_len(), n * geometry.cols_len());
        let (op, function, [(src_name, src_len), (dst_name, dst_len)]) = match map {
            ConvMap::Unfold => ("im2col", &self.im2col, [("x", images), ("cols", cols)]),
            ConvMap::Fold => ("col2im", &self.col2im, [("d_cols", cols), ("dx", images)]),
        };
        check_all(op, &[(src_name, src_len, src.len()), (dst_name, dst_len, dst.len())])?;
        let ints = ConvInts::new(n, geometry)?;
        // SAFETY: the argument list matches im2col's and col2im's (src, dst, then the ten ints
        // of ConvInts::push); the kernel writes dst[0..dst_len) and reads src only below
        // src_len (im2col: in-image positions of images 0..n; col2im: rows of in-range output
        // positions of images 0..n); both lengths are checked above, and dst (a mutable
        // borrow) cannot alias src.
        unsafe { self.launch(function, grid(dst_len), |l| ints.push(l.arg(src).arg(dst))) }
    }

    /// Unfold `n` images of bytes packed four to a word in `x` into `cols`, byte `v` as
    /// `table[v]` (`table`: 256 floats on the device; see `conv.cu`).
    pub(crate) fn im2col_u8(
        &self,
        x: &CudaView<'_, f32>,
        n: usize,
        geometry: &ConvGeometry,
        table: &CudaView<'_, f32>,
        cols: &mut CudaViewMut<'_, f32>,
    ) -> Result<(), BackendError> {
        let image_words = crate::backend::packed_words(geometry.input_len());
        let lens = [("x", n * image_words, x.len()), ("table", 256, table.len())];
        check_all("im2col_u8", &lens)?;
        check_len("im2col_u8", "cols", n * geometry.cols_len(), cols.len())?;
        let ints = ConvInts::new(n, geometry)?;
        let image_stride = long("image_stride", 4 * image_words)?;
        long("x bytes", n.saturating_mul(4 * image_words))?;
        // SAFETY: the argument list matches im2col_u8's (x read as bytes, cols, table,
        // image_stride, then the ten ints of ConvInts::push); the kernel writes
        // cols[0..n·OH·OW·C·K·K) and reads bytes of images 0..n below n·image_stride = 4·x.len()
        // and table[0..256); the lengths are checked above, and cols (a mutable borrow) cannot
        // alias x or table.
        unsafe {
            self.launch(&self.im2col_u8, grid(cols.len()), |l| {
                ints.push(l.arg(x).arg(cols).arg(table).arg(&image_stride))
            })
        }
    }

    /// Widen `rows` rows of `width` bytes packed four to a word in `x` into `out`, byte `v` as
    /// `table[v]` (see `conv.cu`).
    pub(crate) fn widen_u8(
        &self,
        x: &CudaView<'_, f32>,
        rows: usize,
        width: usize,
        table: &CudaView<'_, f32>,
        out: &mut CudaViewMut<'_, f32>,
    ) -> Result<(), BackendError> {
        let row_words = crate::backend::packed_words(width);
        let lens = [("x", rows * row_words, x.len()), ("table", 256, table.len()), ("out", rows * width, out.len())];
        check_all("widen_u8", &lens)?;
        let len = out.len();
        if len == 0 {
            return Ok(());
        }
        let row_stride = long("row_stride", 4 * row_words)?;
        long("x bytes", rows.saturating_mul(4 * row_words))?;
        let (rows_i, width_i) = (int("rows", rows)?, int("width", width)?);
        // SAFETY: the argument list matches widen_u8's (x read as bytes, out, table,
        // row_stride, rows, width); the kernel writes out[0..rows·width) and reads bytes below
        // rows·row_stride = 4·x.len() and table[0..256); the lengths are checked above, and out
        // (a mutable borrow) cannot alias x or table.
        unsafe {
            self.launch(&self.widen_u8, grid(len), |l| {
                l.arg(x).arg(out).arg(table).arg(&row_stride).arg(&rows_i).arg(&width_i)
            })
        }
    }
}

/// The integer arguments shared by the conv kernels, converted once.
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
    fn push<'a, 'l>(&'a self, launch: &'l mut LaunchArgs<'a>) -> &'l mut LaunchArgs<'a> {
        for value in &self.0 {
            launch.arg(value);
        }
        launch
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
