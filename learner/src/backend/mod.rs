//! Where the learner's math runs: one [`Backend`] trait at the level of the math, two
//! implementations, and one generic update path above them.
//!
//! - [`cpu::CpuBackend`]: host `Vec<f32>` buffers and the CPU kernels of `volley_policy::ops`,
//!   `crate::losses` and `crate::optim` (the default everywhere, and what CI tests).
//! - [`cuda::CudaBackend`]: device buffers, cuBLAS products and the NVRTC-compiled kernels of
//!   `learner/kernels/`, with parameters, optimiser state and activations resident on the GPU.
//!
//! The network ([`crate::net::Network`]) and the update ([`crate::train::Trainer`]: V-trace and
//! PPO, minibatching and shuffling included) are written once, generically over `B: Backend`;
//! [`crate::learner::Learner`] matches on its [`crate::train::AnyTrainer`] once per update,
//! never once per operation.
//!
//! # Buffers and views
//!
//! A backend owns its storage type ([`Backend::Floats`], [`Backend::Indices`]); generic code
//! addresses parts of a buffer through typed views, [`View`] and [`ViewMut`], which carry the
//! buffer, an offset and a length (never a raw device address).
//!
//! # Shapes, checked once
//!
//! Each operation's shape contract is stated in one place: the `check` of its operands' struct
//! in [`ops`] (or of [`VTraceLossInputs`] and [`PpoLossInputs`]), or the one-line check beside
//! a small operation in the trait's operation list. The trait's entry point (`dense_forward`)
//! runs it and then calls the backend's `*_unchecked` implementation, so a wrong view is an
//! error naming the operation and the operand, raised before any backend code runs (not a wild
//! read on the device, nor a panic deep in a CPU loop), and backends state no shapes of their
//! own.
//!
//! # Adding a layer
//!
//! A new layer (a convolutional torso for pixels, a diagonal Gaussian action head) is written
//! once per backend and composed once:
//!
//! 1. Add its operations to [`Backend`] at the level of its math (for a convolution: the forward
//!    `conv2d` and its two backward products, or an `im2col` that reuses [`Backend::dense_forward`];
//!    for a Gaussian head: the log-density, entropy and their gradient rows). Each takes views,
//!    writes into caller-owned outputs and allocates nothing. An operation is one entry of the
//!    list in `backend_operations!` (which generates the trait's methods and the stand-in
//!    backend of builds without CUDA); one with more than a few operands takes a struct in
//!    [`ops`] whose `check` states its shapes.
//! 2. Implement its `*_unchecked` half in `cpu.rs` (plain loops over slices, or calls into
//!    `volley_policy::ops`) and in `cuda/mod.rs` (cuBLAS or a kernel in a `.cu` file under
//!    `learner/kernels/`, declared in `cuda/kernels.rs` with one safe launcher carrying its own
//!    `SAFETY` line); both trust the shapes the entry point checked.
//! 3. Compose it in [`crate::net::Network`] (forward records what backward needs; backward runs
//!    the same steps in reverse) and, for a head, in [`crate::train`]'s loss step.
//! 4. Add a parity test (`cuda/tests.rs`: CUDA against CPU) and a finite-difference test of the
//!    composed network on the CPU backend (`net.rs`).
//!
//! `cudarc` is built with dynamic loading, so nothing here links against CUDA: the workspace
//! builds and tests on machines without it. Without the `cuda` feature (on by default),
//! `cuda/unavailable.rs` stands in under the same names and [`cuda::open_cuda`] returns
//! [`BackendError::CudaNotCompiled`], so call sites need no `#[cfg]`. [`cuda::open_cuda`] first asks, without panicking,
//! whether the driver, NVRTC and cuBLAS libraries can be loaded, then whether a device works;
//! [`BackendKind::Auto`] falls back to the CPU when any of that fails: with one info line when
//! the machine has no GPU ([`BackendError::means_no_gpu`]), with one warning when a GPU is there
//! but failed; [`BackendKind::Cuda`] turns either into an error.

mod byte_rows;
pub mod cpu;
#[cfg(feature = "cuda")]
pub mod cuda;
#[cfg(not(feature = "cuda"))]
#[path = "cuda/unavailable.rs"]
pub mod cuda;
pub mod ops;

use std::fmt;
use std::ops::Range;
use std::str::FromStr;

use volley_policy::{ActionHead, Activation};

use crate::losses::{PpoLossConfig, VTraceLossConfig, WeightedSums};
use crate::telemetry::OffPolicySums;

pub use byte_rows::{pack_byte_rows, packed_words};
pub use cpu::CpuBackend;
pub use cuda::{open_cuda, CudaBackend, CudaDevice};
pub use ops::{
    BehaviourWeights, ClipAdamStep, Col2im, CopyColumns, DenseForward, GaeScan, GatherColumns, GruCarryGrad,
    GruCellBackward, GruCellForward, GruResetCopy, Im2col, Im2colU8, LogProbs, MatmulDw, MatmulDx, TakeColumn, WidenU8,
};

/// Which backend the user asked for (`--backend`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum BackendKind {
    /// CUDA when a device works, else the CPU (a warning only when a GPU is there but failed).
    #[default]
    Auto,
    /// The CPU backend.
    Cpu,
    /// CUDA, or an error when no device works.
    Cuda,
}

impl FromStr for BackendKind {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "auto" => Ok(Self::Auto),
            "cpu" => Ok(Self::Cpu),
            "cuda" => Ok(Self::Cuda),
            other => Err(format!("unknown backend `{other}`: expected auto, cpu or cuda")),
        }
    }
}

impl fmt::Display for BackendKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Self::Auto => "auto",
            Self::Cpu => "cpu",
            Self::Cuda => "cuda",
        })
    }
}

/// Why a backend cannot be used or an operation failed.
#[derive(Debug, thiserror::Error)]
pub enum BackendError {
    /// A CUDA library could not be loaded.
    #[error("the CUDA {what} library ({file}) could not be loaded{hint}")]
    LibraryMissing {
        /// Which library.
        what: &'static str,
        /// Its file name.
        file: &'static str,
        /// What to do about it.
        hint: &'static str,
    },
    /// The driver loaded but reports no device.
    #[error("no CUDA device is visible (CUDA_VISIBLE_DEVICES={visible:?})")]
    NoDevice {
        /// The environment variable's value, if set.
        visible: Option<String>,
    },
    /// A driver call failed.
    #[error("CUDA driver: {0}")]
    Driver(String),
    /// A cuBLAS call failed.
    #[error("cuBLAS: {0}")]
    Cublas(String),
    /// The kernels did not compile or load.
    #[cfg(feature = "cuda")]
    #[error("kernels: {0}")]
    Kernels(#[from] cuda::kernels::KernelError),
    /// This build has no CUDA backend (the `cuda` feature of `volley-learner` is off).
    #[error("CUDA support was not compiled into this build (volley-learner feature `cuda`)")]
    CudaNotCompiled,
    /// A CUDA library panicked while starting (caught).
    #[error("CUDA start-up panicked: {0}")]
    Panicked(String),
    /// The CPU backend's thread pool could not be built (or the thread count is out of range).
    #[error("CPU backend threads: {0}")]
    Threads(String),
    /// An operation was handed a view of the wrong length (a bug in the generic code).
    #[error("{op}: {operand} expected {expected} elements, got {got}")]
    Shape {
        /// The operation.
        op: &'static str,
        /// Which operand.
        operand: &'static str,
        /// The length its shape implies.
        expected: usize,
        /// The view's length.
        got: usize,
    },
    /// An index an operation was given is out of its range (a column of a block).
    #[error("{op}: {operand} {index} is not below {bound}")]
    IndexOutOfRange {
        /// The operation.
        op: &'static str,
        /// Which index.
        operand: &'static str,
        /// Its value.
        index: usize,
        /// The length it indexes.
        bound: usize,
    },
    /// A size does not fit the 32-bit integers the kernels take.
    #[error("{what} = {value} does not fit a 32-bit kernel argument")]
    TooLarge {
        /// Which size.
        what: &'static str,
        /// Its value.
        value: usize,
    },
}

impl BackendError {
    /// Whether the error says this machine has no GPU to use (no NVIDIA driver, no visible
    /// device, or a build without CUDA), rather than that a GPU is there and failed.
    /// [`BackendKind::Auto`] tells the first with one info line and warns only of the second
    /// (issue 48: every CPU-only run printed a CUDA warning).
    pub fn means_no_gpu(&self) -> bool {
        match self {
            BackendError::LibraryMissing { what, .. } => *what == "driver",
            BackendError::NoDevice { .. } | BackendError::CudaNotCompiled => true,
            // The driver is installed but finds no device (a container without one passed in).
            BackendError::Driver(message) => message.contains("CUDA_ERROR_NO_DEVICE"),
            _ => false,
        }
    }
}

/// Check that `operand` of `op` has `expected` elements.
#[inline]
pub(crate) fn check_len(
    op: &'static str,
    operand: &'static str,
    expected: usize,
    got: usize,
) -> Result<(), BackendError> {
    if expected == got {
        Ok(())
    } else {
        Err(shape_error(op, operand, expected, got))
    }
}

#[cold]
fn shape_error(op: &'static str, operand: &'static str, expected: usize, got: usize) -> BackendError {
    BackendError::Shape { op, operand, expected, got }
}

/// A read-only view of `len` floats at `offset` in one backend buffer.
pub struct View<'a, B: Backend + ?Sized> {
    buffer: &'a B::Floats,
    offset: usize,
    len: usize,
}

impl<B: Backend + ?Sized> Clone for View<'_, B> {
    fn clone(&self) -> Self {
        *self
    }
}

impl<B: Backend + ?Sized> Copy for View<'_, B> {}

impl<'a, B: Backend + ?Sized> View<'a, B> {
    /// The whole buffer.
    pub fn of(buffer: &'a B::Floats) -> Self {
        View { buffer, offset: 0, len: B::len(buffer) }
    }

    /// Elements `range` of the buffer.
    ///
    /// # Panics
    /// If `range` runs past the buffer: views are cut by generic code from sizes it allocated.
    #[track_caller]
    pub fn range(buffer: &'a B::Floats, range: Range<usize>) -> Self {
        assert!(
            range.start <= range.end && range.end <= B::len(buffer),
            "view {range:?} of a buffer of {}",
            B::len(buffer)
        );
        View { buffer, offset: range.start, len: range.end - range.start }
    }

    /// Elements `range` of this view.
    #[track_caller]
    pub fn slice(self, range: Range<usize>) -> Self {
        assert!(range.start <= range.end && range.end <= self.len, "view {range:?} of a view of {}", self.len);
        View { buffer: self.buffer, offset: self.offset + range.start, len: range.end - range.start }
    }

    /// The number of floats in view.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether the view is empty.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The buffer and the element range this view covers (for backend implementations).
    pub fn parts(self) -> (&'a B::Floats, Range<usize>) {
        (self.buffer, self.offset..self.offset + self.len)
    }
}

/// A writable view of `len` floats at `offset` in one backend buffer.
pub struct ViewMut<'a, B: Backend + ?Sized> {
    buffer: &'a mut B::Floats,
    offset: usize,
    len: usize,
}

impl<'a, B: Backend + ?Sized> ViewMut<'a, B> {
    /// The whole buffer.
    pub fn of(buffer: &'a mut B::Floats) -> Self {
        let len = B::len(buffer);
        ViewMut { buffer, offset: 0, len }
    }

    /// Elements `range` of the buffer.
    #[track_caller]
    pub fn range(buffer: &'a mut B::Floats, range: Range<usize>) -> Self {
        assert!(
            range.start <= range.end && range.end <= B::len(buffer),
            "view {range:?} of a buffer of {}",
            B::len(buffer)
        );
        ViewMut { buffer, offset: range.start, len: range.end - range.start }
    }

    /// Elements `range` of this view, reborrowed.
    #[track_caller]
    pub fn slice(&mut self, range: Range<usize>) -> ViewMut<'_, B> {
        assert!(range.start <= range.end && range.end <= self.len, "view {range:?} of a view of {}", self.len);
        ViewMut { buffer: &mut *self.buffer, offset: self.offset + range.start, len: range.end - range.start }
    }

    /// The whole view, reborrowed (to pass it to an operation and keep using it afterwards).
    pub fn reborrow(&mut self) -> ViewMut<'_, B> {
        ViewMut { buffer: &mut *self.buffer, offset: self.offset, len: self.len }
    }

    /// A read-only view of the same elements.
    pub fn as_view(&self) -> View<'_, B> {
        View { buffer: &*self.buffer, offset: self.offset, len: self.len }
    }

    /// The number of floats in view.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether the view is empty.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The buffer and the element range this view covers (for backend implementations).
    pub fn parts(self) -> (&'a mut B::Floats, Range<usize>) {
        (self.buffer, self.offset..self.offset + self.len)
    }
}

/// What one loss evaluation (one gradient step) measured, read back after the update.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct Evaluation {
    /// `W`, the sum of the sample weights.
    pub weight_sum: f64,
    /// The weighted loss sums.
    pub sums: WeightedSums,
    /// The global gradient norm before clipping (not finite: the step was skipped).
    pub grad_norm: f32,
}

/// The inputs of the fused V-trace loss ([`Backend::vtrace_loss`]), `[T][B]` unless noted.
pub struct VTraceLossInputs<'a, B: Backend + ?Sized> {
    /// `T`.
    pub t_len: usize,
    /// `B`.
    pub b_len: usize,
    /// `A`, the policy head's outputs per row.
    pub n_actions: usize,
    /// The policy head the heads block feeds.
    pub head: Head<'a, B>,
    /// The heads block of the forward over `T + 1` rows, `[T+1][B][A + 1]`.
    pub heads: View<'a, B>,
    /// The value column of `heads`, `[T+1][B]` (row `T` is the bootstrap).
    pub values: View<'a, B>,
    /// Actions, `[T][B][action_width]` words (see [`Backend::Floats`]).
    pub actions: View<'a, B>,
    /// `log μ(a|x)`.
    pub behaviour_log_probs: View<'a, B>,
    /// Rewards.
    pub rewards: View<'a, B>,
    /// `γ (1 − terminated)`.
    pub discounts: View<'a, B>,
    /// Sample weights.
    pub sample_weights: View<'a, B>,
    /// Group baselines (`hyper.baseline`): where finite, the advantage `A_t` that replaces
    /// V-trace's `r_t + γ v_{t+1} − V(x_t)` in the policy gradient (the clipped importance
    /// weight `min(ρ_t, ρ̄_pg)` still multiplies it); NaN where V-trace's own applies. The value
    /// targets `v_t` are V-trace's either way. `None`: V-trace's everywhere.
    pub advantage_override: Option<View<'a, B>>,
}

/// Where the fused V-trace loss writes: its `[T][B]` intermediates and the heads' gradient.
pub struct VTraceLossOutputs<'a, B: Backend + ?Sized> {
    /// `log π(a|x) − log μ(a|x)`.
    pub log_rhos: ViewMut<'a, B>,
    /// The V-trace value targets.
    pub vs: ViewMut<'a, B>,
    /// The policy-gradient advantages.
    pub pg_advantages: ViewMut<'a, B>,
    /// `∂L/∂heads`, `[T+1][B][A + 1]` (the bootstrap row gets zero).
    pub d_heads: ViewMut<'a, B>,
    /// `∂L/∂(head parameters)` per sample, `[T][B][n_params]` (empty for a head without
    /// parameters); the caller sums the rows into the parameters' gradient.
    pub d_head_params: ViewMut<'a, B>,
}

/// The inputs of the fused PPO loss ([`Backend::ppo_loss`]), all `[n]` (one minibatch) unless
/// noted.
pub struct PpoLossInputs<'a, B: Backend + ?Sized> {
    /// `n`, the samples of the minibatch.
    pub n_samples: usize,
    /// `A`, the policy head's outputs per row.
    pub n_actions: usize,
    /// The policy head the heads block feeds.
    pub head: Head<'a, B>,
    /// The heads block, `[n][A + 1]`.
    pub heads: View<'a, B>,
    /// Its value column.
    pub values: View<'a, B>,
    /// Actions, `[n][action_width]` words.
    pub actions: View<'a, B>,
    /// Sample weights.
    pub sample_weights: View<'a, B>,
    /// Advantages (GAE under the proximal values).
    pub advantages: View<'a, B>,
    /// Value targets.
    pub returns: View<'a, B>,
    /// `log π_prox(a|x)`.
    pub prox_log_probs: View<'a, B>,
    /// `min(π_prox/μ, clip)`.
    pub is_weights: View<'a, B>,
}

/// The operands of [`Backend::vtrace_loss`]: inputs, hyper-parameters, outputs, and the
/// evaluation slot its sums go to.
pub struct VTraceLoss<'a, B: Backend + ?Sized> {
    /// What the loss reads.
    pub inputs: VTraceLossInputs<'a, B>,
    /// Its hyper-parameters.
    pub config: &'a VTraceLossConfig,
    /// Where it writes.
    pub outputs: VTraceLossOutputs<'a, B>,
    /// The evaluation (gradient step) its weighted sums go to.
    pub slot: usize,
}

/// The operands of [`Backend::ppo_loss`]: inputs, hyper-parameters, outputs, and the
/// evaluation slot its sums go to.
pub struct PpoLoss<'a, B: Backend + ?Sized> {
    /// What the loss reads.
    pub inputs: PpoLossInputs<'a, B>,
    /// Its hyper-parameters.
    pub config: &'a PpoLossConfig,
    /// Where it writes.
    pub outputs: PpoLossOutputs<'a, B>,
    /// The evaluation (gradient step) its weighted sums go to.
    pub slot: usize,
}

/// The inputs of [`Backend::off_policy_sums`], all `[n]`.
pub struct OffPolicyViews<'a, B: Backend + ?Sized> {
    /// `log ρ = log π(a|x) − log μ(a|x)`: the learner's parameters before the update against the
    /// behaviour log-probabilities the actors recorded.
    pub log_rhos: View<'a, B>,
    /// Subtracted from `log_rhos` per sample when given: PPO passes its proximal
    /// log-probabilities as `log_rhos` and the behaviour's here, with no pass of its own.
    pub reference: Option<View<'a, B>>,
    /// Sample weights (0 drops a sample).
    pub weights: View<'a, B>,
    /// The value head's outputs.
    pub values: View<'a, B>,
    /// The value targets the update regresses on.
    pub value_targets: View<'a, B>,
    /// `ρ̄`.
    pub rho_bar: f32,
    /// `c̄`.
    pub c_bar: f32,
}

/// Where the fused PPO loss writes: the heads' gradient `[n][A + 1]` and the head parameters'
/// per-sample gradient rows `[n][n_params]` (empty for a head without parameters).
pub struct PpoLossOutputs<'a, B: Backend + ?Sized> {
    /// `∂L/∂heads`.
    pub d_heads: ViewMut<'a, B>,
    /// `∂L/∂(head parameters)` per sample.
    pub d_head_params: ViewMut<'a, B>,
}

/// The policy head a heads block feeds (`volley_policy::head`): its kind, and its own
/// parameters on the backend (empty for a categorical head, the `A` log-stds of a Gaussian
/// one). The heads block's first `A` columns are the head's outputs (logits, or means).
pub struct Head<'a, B: Backend + ?Sized> {
    /// Which distribution.
    pub kind: ActionHead,
    /// Its parameters, [`ActionHead::n_params`] floats.
    pub params: View<'a, B>,
}

impl<B: Backend + ?Sized> Clone for Head<'_, B> {
    fn clone(&self) -> Self {
        *self
    }
}

impl<B: Backend + ?Sized> Copy for Head<'_, B> {}

/// Hands the declarations of [`Backend`]'s operations (every method after `indices_len`, each
/// taking `&mut self`) to the macro `$then`: the one list the trait (`declare_operations`) and
/// the stand-in CUDA backend of builds without CUDA (`cuda/unavailable.rs`, where every
/// operation is unreachable) are generated from.
///
/// `plain` operations have no shape contract and are implemented as declared. Each `checked`
/// operation `fn name(...) => name_unchecked after check;` becomes two methods: the provided
/// entry point `name`, which runs `check` (its shape contract, stated once: in
/// [`ops`] or beside its inputs' type) and then calls `name_unchecked`, the method a backend
/// implements and that trusts the shapes it is given.
macro_rules! backend_operations {
    ($then:ident) => {
        $then! {
            plain {
                /// A zeroed buffer of `len` floats.
                fn alloc(&mut self, len: usize) -> Result<Self::Floats, BackendError>;

                /// Make `dst` hold `indices` (at its start), allocating it or growing it when needed.
                fn upload_indices(&mut self, indices: &[u32], dst: &mut Option<Self::Indices>) -> Result<(), BackendError>;

                /// Make `dst` hold `len` floats written by `pack` into host memory, in one transfer (the
                /// batch upload: CUDA packs into page-locked memory and copies asynchronously).
                fn upload_packed(
                    &mut self,
                    len: usize,
                    pack: &mut dyn FnMut(&mut [f32]),
                    dst: &mut Self::Floats,
                ) -> Result<(), BackendError>;

                /// `x[i] = value`.
                fn fill(&mut self, x: ViewMut<'_, Self>, value: f32) -> Result<(), BackendError>;

                /// Start the statistics of an update of `n_evaluations` loss evaluations (gradient steps):
                /// every slot, and the update's off-policy sums, is zeroed.
                fn begin_evaluations(&mut self, n_evaluations: usize) -> Result<(), BackendError>;

                /// Adam's step count `t`, on the device.
                fn step_count(&mut self, t: u64) -> Result<Self::StepCount, BackendError>;

                /// Read Adam's step count back.
                fn read_step_count(&mut self, step: &Self::StepCount) -> Result<u64, BackendError>;

                /// The statistics of this update's evaluations and its off-policy sums (one wait for the
                /// device on CUDA).
                fn read_evaluations(
                    &mut self,
                    out: &mut Vec<Evaluation>,
                    off_policy: &mut OffPolicySums,
                ) -> Result<(), BackendError>;
            }
            checked {
                /// Copy `host` into `dst` (equal lengths).
                fn upload(&mut self, host: &[f32], dst: ViewMut<'_, Self>) -> Result<(), BackendError>
                    => upload_unchecked after check_len("upload", "dst", host.len(), dst.len());

                /// Copy `src` to `host` (equal lengths), waiting for the work that writes it.
                fn download(&mut self, src: View<'_, Self>, host: &mut [f32]) -> Result<(), BackendError>
                    => download_unchecked after check_len("download", "host", src.len(), host.len());

                /// `dst[i] = src[i]` (equal lengths, on the device): a restored recurrent state copied
                /// into the row of the step it enters ([`crate::net::Network::forward`]).
                fn copy(&mut self, src: View<'_, Self>, dst: ViewMut<'_, Self>) -> Result<(), BackendError>
                    => copy_unchecked after check_len("copy", "dst", src.len(), dst.len());

                /// One dense layer over `rows` rows: `y = act(x Wᵀ + b)` (no activation when `act` is
                /// `None`); `x: [rows][n_in]`, `weight: [n_out][n_in]`, `bias: [n_out]`, `y: [rows][n_out]`.
                fn dense_forward(&mut self, op: DenseForward<'_, Self>) -> Result<(), BackendError>
                    => dense_forward_unchecked after op.check();

                /// `dy ← dy · act'(pre)`, written through the stored output `y = act(pre)` (equal lengths).
                fn act_backward(&mut self, dy: ViewMut<'_, Self>, y: View<'_, Self>, act: Activation) -> Result<(), BackendError>
                    => act_backward_unchecked after check_len("act_backward", "y", dy.len(), y.len());

                /// The weight gradient of a dense layer, overwritten: `dW = dYᵀ X` over `rows` rows;
                /// `dy: [rows][n_out]`, `x: [rows][n_in]`, `dw: [n_out][n_in]`.
                fn matmul_dw(&mut self, op: MatmulDw<'_, Self>) -> Result<(), BackendError>
                    => matmul_dw_unchecked after op.check();

                /// The input gradient of a dense layer: `dX = dY W` (`+ dX` when `accumulate`);
                /// `dy: [rows][n_out]`, `weight: [n_out][n_in]`, `dx: [rows][n_in]`.
                fn matmul_dx(&mut self, op: MatmulDx<'_, Self>) -> Result<(), BackendError>
                    => matmul_dx_unchecked after op.check();

                /// The bias gradient, overwritten: `out[j] = Σ_r dy[r][j]`, `dy: [rows][out.len()]`.
                fn column_sums(&mut self, dy: View<'_, Self>, rows: usize, out: ViewMut<'_, Self>) -> Result<(), BackendError>
                    => column_sums_unchecked after check_len("column_sums", "dy", rows * out.len(), dy.len());

                /// [`Backend::im2col`] over `n` images of bytes (image observations, issue 44 item 3):
                /// `x` holds them packed four bytes to a word ([`pack_byte_rows`]), each image's
                /// `C·H·W` bytes starting at a word, and each byte `v` enters `cols` as
                /// `f32::from(v) · scale`, the value the `f32` path would unfold.
                fn im2col_u8(&mut self, op: Im2colU8<'_, Self>) -> Result<(), BackendError>
                    => im2col_u8_unchecked after op.check();

                /// Widen `rows` rows of `width` bytes, packed four to a word ([`pack_byte_rows`]),
                /// into `out: [rows][width]` floats, byte `v` as `f32::from(v) · scale` (a dense first
                /// layer over image observations reads these).
                fn widen_u8(&mut self, op: WidenU8<'_, Self>) -> Result<(), BackendError>
                    => widen_u8_unchecked after op.check();

                /// Unfold the receptive fields of `n` images for one conv layer (`volley_policy::ops::im2col`):
                /// `x: [n][C·H·W]` in the geometry's layout, `cols: [n·OH·OW][C·K·K]` (zeros where the
                /// kernel covers padding). The layer itself is then [`Backend::dense_forward`] over `cols`.
                fn im2col(&mut self, op: Im2col<'_, Self>) -> Result<(), BackendError>
                    => im2col_unchecked after op.check();

                /// The adjoint of [`Backend::im2col`], overwriting `dx: [n][C·H·W]` with, for every input
                /// element, the sum of the entries of `d_cols: [n·OH·OW][C·K·K]` that read it.
                fn col2im(&mut self, op: Col2im<'_, Self>) -> Result<(), BackendError>
                    => col2im_unchecked after op.check();

                /// `dst[i] = src[i · width + column]` for `i < rows` (the value column of the heads).
                fn take_column(&mut self, op: TakeColumn<'_, Self>) -> Result<(), BackendError>
                    => take_column_unchecked after op.check();

                /// `dst[r][dst_column + k] = src[r][src_column + k]` for `r < rows`, `k < columns`
                /// (the two heads of a separate value network into one heads block, and back).
                fn copy_columns(&mut self, op: CopyColumns<'_, Self>) -> Result<(), BackendError>
                    => copy_columns_unchecked after op.check();

                /// The GRU state entering a step: `dst[b] = 0` where `starts[b] ≠ 0`, else `src[b]`;
                /// `src`, `dst: [B][hidden]`, `starts: [B]`.
                fn gru_reset_copy(&mut self, op: GruResetCopy<'_, Self>) -> Result<(), BackendError>
                    => gru_reset_copy_unchecked after op.check();

                /// One GRU step's element-wise part (PyTorch gate convention): from the gate pre-sums
                /// `gi`, `gh` (`[B][3H]`, biases included) and `h_prev` (`[B][H]`) write the gates
                /// `[r, z, n]` (`[B][3H]`) and `h_out` (`[B][H]`).
                fn gru_cell_forward(&mut self, op: GruCellForward<'_, Self>) -> Result<(), BackendError>
                    => gru_cell_forward_unchecked after op.check();

                /// Backward through one GRU step's element-wise part: on entry `d_h` holds `∂L/∂h'`, on
                /// exit its direct part `∂L/∂h' ⊙ z` (the caller adds `d_gh W_h`); writes `d_gi`, `d_gh`.
                fn gru_cell_backward(&mut self, op: GruCellBackward<'_, Self>) -> Result<(), BackendError>
                    => gru_cell_backward_unchecked after op.check();

                /// The gradient carried into a GRU step from the step after it: zero the rows of `d_h`
                /// where `starts_next` (the next step's episode starts, if any) is non-zero, then add
                /// `from_heads`, the gradient arriving at this step's output from above.
                fn gru_carry_grad(&mut self, op: GruCarryGrad<'_, Self>) -> Result<(), BackendError>
                    => gru_carry_grad_unchecked after op.check();

                /// `out[i] = log π(a_i | x_i) − reference[i]` (or `log π(a_i | x_i)` without a reference)
                /// under `head`, from the outputs in row `i` of the heads block (`stride = A + 1`);
                /// `actions: [n][action_width]`, `n = out.len()`.
                fn log_probs(&mut self, op: LogProbs<'_, Self>) -> Result<(), BackendError>
                    => log_probs_unchecked after op.check();

                /// `out[i] = min(exp(prox[i] − behaviour[i]), clip)` (Hilton et al. 2021).
                fn behaviour_weights(&mut self, op: BehaviourWeights<'_, Self>) -> Result<(), BackendError>
                    => behaviour_weights_unchecked after op.check();

                /// GAE(γ, λ) advantages and λ-returns over `[T][B]` (Schulman et al. 2016, eq. (16));
                /// `values: [T][B]`, `bootstrap_value: [B]`.
                ///
                /// Where `advantage_override` (`[T][B]`, group baselines) is finite, it is written to
                /// `advantages` in place of GAE's; `returns` (the value targets) are GAE's either way.
                fn gae_scan(&mut self, op: GaeScan<'_, Self>) -> Result<(), BackendError>
                    => gae_scan_unchecked after op.check();

                /// The fused IMPALA loss with V-trace targets (Espeholt et al. 2018, sec. 4.2) for any
                /// head ([`VTraceLossInputs`]' contract): log-ρ, the V-trace scan, the weighted loss
                /// sums into evaluation `slot`, `∂L/∂heads` and the head parameters' gradient rows.
                /// Same result as [`crate::losses::vtrace_loss_heads`].
                fn vtrace_loss(&mut self, op: VTraceLoss<'_, Self>) -> Result<(), BackendError>
                    => vtrace_loss_unchecked after op.inputs.check(&op.outputs);

                /// The fused decoupled PPO-clip loss over one minibatch for any head (Schulman et al.
                /// 2017, Hilton et al. 2021; [`PpoLossInputs`]' contract): the weighted loss sums into
                /// evaluation `slot`, `∂L/∂heads` and the head parameters' gradient rows. Same result
                /// as [`crate::losses::ppo_loss_heads`].
                fn ppo_loss(&mut self, op: PpoLoss<'_, Self>) -> Result<(), BackendError>
                    => ppo_loss_unchecked after op.inputs.check(&op.outputs);

                /// The off-policy health of this update ([`crate::telemetry`]) over `n = ratios.len()`
                /// samples, from the same per-sample terms on every device ([`OffPolicySums::add`]):
                /// adds the weighted sums of `inputs` to the update's [`OffPolicySums`] (read back by
                /// [`Backend::read_evaluations`]) and writes each sample's `ρ` into `ratios` (`[n]`;
                /// [`crate::telemetry::NO_RATIO`] where its weight is 0).
                fn off_policy_sums(&mut self, inputs: &OffPolicyViews<'_, Self>, ratios: ViewMut<'_, Self>) -> Result<(), BackendError>
                    => off_policy_sums_unchecked after inputs.check(ratios.len());

                /// Whole columns of a time-major `[rows][b_len][width]` block:
                /// `dst[t][j] = src[t][columns[columns_offset + j]]` for `j < n_columns`.
                fn gather_columns(&mut self, op: GatherColumns<'_, Self>) -> Result<(), BackendError>
                    => gather_columns_unchecked after op.check();

                /// Global-norm clipping (Pascanu et al. 2013) then Adam (Kingma & Ba 2015) over the flat
                /// parameter buffer; the pre-clip norm goes to evaluation `slot`. A non-finite norm skips
                /// the step (parameters, moments and `t` unchanged). `grads` may be scaled in place.
                fn clip_adam_step(&mut self, op: ClipAdamStep<'_, Self>) -> Result<(), BackendError>
                    => clip_adam_step_unchecked after op.check();
            }
        }
    };
}
// Used by the stand-in, which builds without the `cuda` feature.
#[cfg_attr(feature = "cuda", allow(unused_imports))]
pub(crate) use backend_operations;

/// Declares the operations [`backend_operations`] lists in the trait: each plain one as it is,
/// each checked one as its entry point (check, then run) and its `_unchecked` implementation.
macro_rules! declare_operations {
    (
        plain { $($(#[$meta:meta])* fn $name:ident($($params:tt)*) -> $ret:ty;)* }
        checked {
            $($(#[$checked_meta:meta])*
            fn $checked:ident(&mut self $(, $param:ident: $ty:ty)* $(,)?) -> $checked_ret:ty
                => $unchecked:ident after $check:expr;)*
        }
    ) => {
        $($(#[$meta])* fn $name($($params)*) -> $ret;)*
        $(
            $(#[$checked_meta])*
            ///
            #[doc = concat!("Checks the shapes, then runs [`Backend::", stringify!($unchecked), "`].")]
            fn $checked(&mut self $(, $param: $ty)*) -> $checked_ret {
                $check?;
                self.$unchecked($($param),*)
            }

            #[doc = concat!("[`Backend::", stringify!($checked), "`] on shapes it has checked (what a backend implements).")]
            fn $unchecked(&mut self $(, $param: $ty)*) -> $checked_ret;
        )*
    };
}

impl<B: Backend + ?Sized> Head<'_, B> {
    /// The head's part of every head operation's shape contract: its parameters'
    /// length; returns the widths an action and a parameter-gradient row take.
    fn check(&self, op: &'static str, n_outputs: usize) -> Result<(usize, usize), BackendError> {
        check_len(op, "head params", self.kind.n_params(n_outputs), self.params.len())?;
        Ok((self.kind.action_width(n_outputs), self.kind.n_params(n_outputs)))
    }
}

impl<B: Backend + ?Sized> VTraceLossInputs<'_, B> {
    /// The shape contract of [`Backend::vtrace_loss`], stated once: `n = T·B` samples, `T + 1`
    /// rows of heads and values, `[n]` per-sample inputs and intermediates, `[n][action_width]`
    /// actions, `[n][n_params]` head-parameter gradient rows.
    fn check(&self, outputs: &VTraceLossOutputs<'_, B>) -> Result<(), BackendError> {
        let op = "vtrace_loss";
        let n = self.t_len * self.b_len;
        let (rows, stride) = (n + self.b_len, self.n_actions + 1);
        let (width, n_params) = self.head.check(op, self.n_actions)?;
        let per_sample = [
            ("behaviour_log_probs", self.behaviour_log_probs.len()),
            ("rewards", self.rewards.len()),
            ("discounts", self.discounts.len()),
            ("sample_weights", self.sample_weights.len()),
            ("advantage_override", self.advantage_override.map_or(n, |v| v.len())),
            ("log_rhos", outputs.log_rhos.len()),
            ("vs", outputs.vs.len()),
            ("pg_advantages", outputs.pg_advantages.len()),
        ];
        let blocks = [
            ("actions", n * width, self.actions.len()),
            ("heads", rows * stride, self.heads.len()),
            ("values", rows, self.values.len()),
            ("d_heads", rows * stride, outputs.d_heads.len()),
            ("d_head_params", n * n_params, outputs.d_head_params.len()),
        ];
        per_sample
            .into_iter()
            .map(|(operand, len)| (operand, n, len))
            .chain(blocks)
            .try_for_each(|(operand, expected, len)| check_len(op, operand, expected, len))
    }
}

impl<B: Backend + ?Sized> OffPolicyViews<'_, B> {
    /// The shape contract of [`Backend::off_policy_sums`]: every input has the `n` elements of
    /// the ratios it writes.
    fn check(&self, n: usize) -> Result<(), BackendError> {
        [
            ("log_rhos", self.log_rhos),
            ("reference", self.reference.unwrap_or(self.log_rhos)),
            ("weights", self.weights),
            ("values", self.values),
            ("value_targets", self.value_targets),
        ]
        .into_iter()
        .try_for_each(|(operand, view)| check_len("off_policy_sums", operand, n, view.len()))
    }
}

impl<B: Backend + ?Sized> PpoLossInputs<'_, B> {
    /// The shape contract of [`Backend::ppo_loss`], stated once: `n` samples, `[n]` per-sample
    /// inputs, `[n][A + 1]` heads and their gradient, `[n][action_width]` actions and
    /// `[n][n_params]` head-parameter gradient rows.
    fn check(&self, outputs: &PpoLossOutputs<'_, B>) -> Result<(), BackendError> {
        let op = "ppo_loss";
        let n = self.n_samples;
        let stride = self.n_actions + 1;
        let (width, n_params) = self.head.check(op, self.n_actions)?;
        let per_sample = [
            ("values", self.values.len()),
            ("sample_weights", self.sample_weights.len()),
            ("advantages", self.advantages.len()),
            ("returns", self.returns.len()),
            ("prox_log_probs", self.prox_log_probs.len()),
            ("is_weights", self.is_weights.len()),
        ];
        let blocks = [
            ("actions", n * width, self.actions.len()),
            ("heads", n * stride, self.heads.len()),
            ("d_heads", n * stride, outputs.d_heads.len()),
            ("d_head_params", n * n_params, outputs.d_head_params.len()),
        ];
        per_sample
            .into_iter()
            .map(|(operand, len)| (operand, n, len))
            .chain(blocks)
            .try_for_each(|(operand, expected, len)| check_len(op, operand, expected, len))
    }
}

/// The learner's device operations, at the level of the math (one trait for every device, one
/// enum at the edge, generic code in between): matrix products, bias + activation, the GRU
/// cell, log-probabilities, the return scans, the fused losses, clipping + Adam, and buffers.
/// Generic code ([`crate::net`], [`crate::train`]) composes them; an implementation runs each
/// one on its device and allocates nothing per call.
///
/// Conventions: matrices are row-major, batches time-major (`t * B + b`), a weight is
/// `[n_out][n_in]` (so a layer computes `Y = X Wᵀ + b`), and the two heads form one
/// `[rows][A + 1]` block (logits, then the value). Operations are asynchronous on a device:
/// their results are only guaranteed visible to the host after [`Backend::download`] or
/// [`Backend::read_evaluations`].
pub trait Backend {
    /// A buffer of `f32` (host memory on the CPU, device memory on CUDA). Actions travel in
    /// these buffers too, as the bit patterns of their `u32` indices (`f32::from_bits`), so
    /// one upload carries a whole batch; the kernels read those words as `u32`.
    type Floats;
    /// A buffer of `u32` indices (the columns of PPO's shuffled minibatches).
    type Indices;
    /// Adam's step count, where the device keeps it.
    type StepCount;

    /// `cpu` or `cuda: <device>`.
    fn description(&self) -> String;

    /// The number of floats in `buffer`.
    fn len(buffer: &Self::Floats) -> usize;

    /// The number of indices in `buffer`.
    fn indices_len(buffer: &Self::Indices) -> usize;

    backend_operations!(declare_operations);
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::optim::AdamConfig;

    /// Issue 48: a machine without a GPU is told once at info level, not warned on every run;
    /// a GPU that is there but fails is still a warning.
    #[test]
    fn only_a_missing_gpu_counts_as_no_gpu() {
        let no_gpu = [
            BackendError::LibraryMissing { what: "driver", file: "libcuda.so", hint: "" },
            BackendError::NoDevice { visible: None },
            BackendError::CudaNotCompiled,
            BackendError::Driver("DriverError(CUDA_ERROR_NO_DEVICE, \"no CUDA-capable device is detected\")".into()),
        ];
        for err in &no_gpu {
            assert!(err.means_no_gpu(), "{err}");
        }
        let gpu_failed = [
            BackendError::LibraryMissing { what: "NVRTC", file: "libnvrtc.so", hint: "" },
            BackendError::LibraryMissing { what: "cuBLAS", file: "libcublas.so", hint: "" },
            BackendError::Driver("DriverError(CUDA_ERROR_OUT_OF_MEMORY, \"out of memory\")".into()),
            BackendError::Cublas("CUBLAS_STATUS_NOT_INITIALIZED".into()),
            BackendError::Panicked("boom".into()),
        ];
        for err in &gpu_failed {
            assert!(!err.means_no_gpu(), "{err}");
        }
    }

    #[test]
    fn backend_kinds_parse_and_print() {
        for kind in [BackendKind::Auto, BackendKind::Cpu, BackendKind::Cuda] {
            assert_eq!(kind.to_string().parse::<BackendKind>(), Ok(kind));
        }
        assert!("gpu".parse::<BackendKind>().unwrap_err().contains("auto, cpu or cuda"));
    }

    /// Issue 47: every operation's shapes are checked once, at the trait's entry, so a wrong
    /// view is an error naming the operation and the operand before any backend code runs (the
    /// CPU backend itself would panic on a short slice, or read past a row).
    #[test]
    fn a_wrong_shape_is_an_error_naming_the_operation_and_operand() {
        let mut cpu = CpuBackend::new();
        let (x, w, b, short) = (vec![0.0; 6], vec![0.0; 6], vec![0.0; 3], vec![0.0; 5]);
        let (mut out, mut out2, mut out3) = (vec![0.0; 5], vec![0.0; 6], vec![0.0; 9]);
        let mut step = cpu.step_count(0).unwrap();
        cpu.begin_evaluations(1).unwrap();
        let config = AdamConfig { beta1: 0.9, beta2: 0.999, eps: 1e-8 };
        let results = [
            cpu.dense_forward(DenseForward {
                x: View::of(&x),
                rows: 3,
                n_in: 2,
                weight: View::of(&w),
                bias: View::of(&b),
                n_out: 3,
                act: None,
                y: ViewMut::of(&mut out),
            }),
            cpu.matmul_dx(MatmulDx {
                dy: View::of(&x),
                rows: 2,
                n_out: 3,
                weight: View::of(&short),
                n_in: 2,
                dx: ViewMut::of(&mut out[..4].to_vec()),
                accumulate: false,
            }),
            cpu.gru_cell_forward(GruCellForward {
                gi: View::of(&x),
                gh: View::of(&x),
                h_prev: View::of(&[0.0, 0.0].to_vec()),
                hidden: 2,
                gates: ViewMut::of(&mut out),
                h_out: ViewMut::range(&mut out2, 0..2),
            }),
            cpu.gae_scan(GaeScan {
                t_len: 2,
                b_len: 3,
                discounts: View::of(&x),
                rewards: View::of(&x),
                values: View::of(&x),
                bootstrap_value: View::of(&short),
                lambda_: 0.95,
                advantage_override: None,
                advantages: ViewMut::of(&mut out2),
                returns: ViewMut::of(&mut out3[..6].to_vec()),
            }),
            cpu.take_column(TakeColumn {
                src: View::of(&x),
                rows: 2,
                width: 3,
                column: 3,
                dst: ViewMut::range(&mut out3, 0..2),
            }),
            cpu.clip_adam_step(ClipAdamStep {
                params: ViewMut::of(&mut out2),
                grads: ViewMut::of(&mut out3[..6].to_vec()),
                adam_m: ViewMut::of(&mut x.clone()),
                adam_v: ViewMut::of(&mut short.clone()),
                step: &mut step,
                config: &config,
                learning_rate: 1e-3,
                max_grad_norm: 1.0,
                slot: 0,
            }),
            cpu.upload(&x, ViewMut::of(&mut out)),
        ];
        let expected = [
            "dense_forward: y expected 9 elements, got 5",
            "matmul_dx: weight expected 6 elements, got 5",
            "gru_cell_forward: gates expected 6 elements, got 5",
            "gae_scan: bootstrap_value expected 3 elements, got 5",
            "take_column: column 3 is not below 3",
            "clip_adam_step: adam_v expected 6 elements, got 5",
            "upload: dst expected 6 elements, got 5",
        ];
        for (result, expected) in results.into_iter().zip(expected) {
            assert_eq!(result.expect_err(expected).to_string(), expected);
        }
    }

    #[test]
    fn copy_columns_moves_a_block_of_columns_between_row_widths() {
        let mut cpu = CpuBackend::new();
        // Two rows: `columns` columns from `src_column` of `src` (rows of `src_width`) to
        // `dst_column` of `dst` (rows of `dst_width`).
        let mut copy =
            |src: &Vec<f32>, (src_width, src_column), dst: &mut Vec<f32>, (dst_width, dst_column), columns| {
                let (src, dst) = (View::of(src), ViewMut::of(dst));
                let op = CopyColumns { src, src_width, src_column, dst, dst_width, dst_column, columns, rows: 2 };
                cpu.copy_columns(op)
            };
        // Rows of [a, b] into columns 1..3 of rows of width 4, and column 2 of those back.
        let src = vec![1.0f32, 2.0, 3.0, 4.0];
        let mut wide = vec![0.0f32; 8];
        copy(&src, (2, 0), &mut wide, (4, 1), 2).unwrap();
        assert_eq!(wide, [0.0, 1.0, 2.0, 0.0, 0.0, 3.0, 4.0, 0.0]);
        let mut narrow = vec![0.0f32; 2];
        copy(&wide, (4, 2), &mut narrow, (1, 0), 1).unwrap();
        assert_eq!(narrow, [2.0, 4.0]);
        // A block that runs past a row is refused, and nothing is written.
        let err = copy(&src, (2, 1), &mut wide, (4, 0), 2).unwrap_err().to_string();
        assert_eq!(err, "copy_columns: last src column 2 is not below 2");
        assert_eq!(wide, [0.0, 1.0, 2.0, 0.0, 0.0, 3.0, 4.0, 0.0]);
    }

    #[test]
    fn views_cut_ranges_of_their_buffer() {
        let buffer = vec![0.0f32, 1.0, 2.0, 3.0, 4.0];
        let view = View::<CpuBackend>::range(&buffer, 1..4).slice(1..3);
        assert_eq!(view.parts().1, 2..4);
        assert_eq!(view.len(), 2);
        let mut buffer = buffer;
        let mut view = ViewMut::<CpuBackend>::of(&mut buffer);
        assert_eq!(view.slice(3..5).parts().1, 3..5);
    }

    #[test]
    #[should_panic(expected = "view 2..6 of a buffer of 5")]
    fn a_view_past_the_buffer_is_refused() {
        let buffer = vec![0.0f32; 5];
        let _ = View::<CpuBackend>::range(&buffer, 2..6);
    }

    #[test]
    fn opening_cuda_without_a_device_is_an_error_not_a_panic() {
        match open_cuda(0) {
            Ok(device) => eprintln!("a CUDA device is present here: {}", device.description()),
            Err(err) => {
                let message = err.to_string();
                assert!(!message.is_empty());
                eprintln!("no CUDA here, as expected on CI: {message}");
            }
        }
    }
}
