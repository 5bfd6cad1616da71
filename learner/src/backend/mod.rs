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
//! buffer, an offset and a length (never a raw device address). Every operation checks the
//! lengths it is given against the shapes it is told, so a wrong view is an error message, not
//! a wild read on the device.
//!
//! # Adding a layer
//!
//! A new layer (a convolutional torso for pixels, a diagonal Gaussian action head) is written
//! once per backend and composed once:
//!
//! 1. Add its operations to [`Backend`] at the level of its math (for a convolution: the forward
//!    `conv2d` and its two backward products, or an `im2col` that reuses [`Backend::dense_forward`];
//!    for a Gaussian head: the log-density, entropy and their gradient rows). Each takes views,
//!    writes into caller-owned outputs and allocates nothing.
//! 2. Implement them in `cpu.rs` (plain loops over slices, or calls into
//!    `volley_policy::ops`) and in `cuda/mod.rs` (cuBLAS or a kernel in a `.cu` file under
//!    `learner/kernels/`, declared in `cuda/kernels.rs` with one safe launcher carrying its own
//!    `SAFETY` line).
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

pub mod cpu;
#[cfg(feature = "cuda")]
pub mod cuda;
#[cfg(not(feature = "cuda"))]
#[path = "cuda/unavailable.rs"]
pub mod cuda;

use std::fmt;
use std::ops::Range;
use std::str::FromStr;

use volley_policy::{ActionHead, Activation, ConvGeometry};

use crate::losses::{PpoLossConfig, VTraceLossConfig, WeightedSums};
use crate::optim::AdamConfig;
use crate::telemetry::OffPolicySums;

pub use cpu::CpuBackend;
pub use cuda::{open_cuda, CudaBackend, CudaDevice};

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

/// Words one row of `width` bytes takes in a float buffer: rows of bytes travel packed four
/// to a word, each row starting at a word ([`pack_byte_rows`]).
pub fn packed_words(width: usize) -> usize {
    width.div_ceil(4)
}

/// Pack `rows` rows of `width` bytes into `words` (`rows · packed_words(width)` floats), each
/// row's bytes in memory order from the start of its first word, so that a buffer of floats
/// carries image observations at a byte per value (the staged batch is one float buffer, as
/// actions travel in it as the bit patterns of their indices). A backend reads the words back
/// as bytes in the same memory order (`bytemuck`'s casts on the CPU, a byte pointer on CUDA).
///
/// # Panics
/// If the lengths disagree: callers size both sides.
pub fn pack_byte_rows(bytes: &[u8], width: usize, words: &mut [f32]) {
    let stride = packed_words(width);
    assert!(width > 0 || bytes.is_empty(), "rows of no bytes");
    let rows = bytes.len().checked_div(width).unwrap_or(0);
    assert_eq!((rows * width, rows * stride), (bytes.len(), words.len()), "pack_byte_rows: shapes");
    let out: &mut [u8] = bytemuck::cast_slice_mut(words);
    if stride * 4 == width {
        out.copy_from_slice(bytes);
        return;
    }
    for (row, out) in bytes.chunks_exact(width).zip(out.chunks_exact_mut(4 * stride)) {
        out[..width].copy_from_slice(row);
        out[width..].fill(0);
    }
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

/// The inputs of [`Backend::off_policy_sums`], all `[n]`.
pub struct OffPolicyViews<'a, B: Backend + ?Sized> {
    /// `log ρ = log π(a|x) − log μ(a|x)`: the learner's parameters before the update against the
    /// behaviour log-probabilities the actors recorded.
    pub log_rhos: View<'a, B>,
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

/// Hands the declarations of [`Backend`]'s operations (every method after `len`, each taking
/// `&mut self`) to the macro `$then`: the one list both the trait (`declare_operations`) and
/// the stand-in CUDA backend of builds without CUDA (`cuda/unavailable.rs`, where every
/// operation is unreachable) are generated from.
macro_rules! backend_operations {
    ($then:ident) => {
        $then! {
            /// A zeroed buffer of `len` floats.
            fn alloc(&mut self, len: usize) -> Result<Self::Floats, BackendError>;

            /// Make `dst` hold `indices` (at its start), allocating it or growing it when needed.
            fn upload_indices(&mut self, indices: &[u32], dst: &mut Option<Self::Indices>) -> Result<(), BackendError>;

            /// Copy `host` into `dst` (equal lengths).
            fn upload(&mut self, host: &[f32], dst: ViewMut<'_, Self>) -> Result<(), BackendError>;

            /// Make `dst` hold `len` floats written by `pack` into host memory, in one transfer (the
            /// batch upload: CUDA packs into page-locked memory and copies asynchronously).
            fn upload_packed(
                &mut self,
                len: usize,
                pack: &mut dyn FnMut(&mut [f32]),
                dst: &mut Self::Floats,
            ) -> Result<(), BackendError>;

            /// Copy `src` to `host` (equal lengths), waiting for the work that writes it.
            fn download(&mut self, src: View<'_, Self>, host: &mut [f32]) -> Result<(), BackendError>;

            /// `x[i] = value`.
            fn fill(&mut self, x: ViewMut<'_, Self>, value: f32) -> Result<(), BackendError>;

            /// `dst[i] = src[i]` (equal lengths, on the device): a restored recurrent state copied
            /// into the row of the step it enters ([`crate::net::Network::forward`]).
            fn copy(&mut self, src: View<'_, Self>, dst: ViewMut<'_, Self>) -> Result<(), BackendError>;

            /// One dense layer over `rows` rows: `y = act(x Wᵀ + b)` (no activation when `act` is
            /// `None`); `x: [rows][n_in]`, `weight: [n_out][n_in]`, `bias: [n_out]`, `y: [rows][n_out]`.
            #[allow(clippy::too_many_arguments)]
            fn dense_forward(
                &mut self,
                x: View<'_, Self>,
                rows: usize,
                n_in: usize,
                weight: View<'_, Self>,
                bias: View<'_, Self>,
                n_out: usize,
                act: Option<Activation>,
                y: ViewMut<'_, Self>,
            ) -> Result<(), BackendError>;

            /// `dy ← dy · act'(pre)`, written through the stored output `y = act(pre)`.
            fn act_backward(&mut self, dy: ViewMut<'_, Self>, y: View<'_, Self>, act: Activation) -> Result<(), BackendError>;

            /// The weight gradient of a dense layer, overwritten: `dW = dYᵀ X` over `rows` rows;
            /// `dy: [rows][n_out]`, `x: [rows][n_in]`, `dw: [n_out][n_in]`.
            #[allow(clippy::too_many_arguments)]
            fn matmul_dw(
                &mut self,
                dy: View<'_, Self>,
                x: View<'_, Self>,
                rows: usize,
                n_out: usize,
                n_in: usize,
                dw: ViewMut<'_, Self>,
            ) -> Result<(), BackendError>;

            /// The input gradient of a dense layer: `dX = dY W` (`+ dX` when `accumulate`);
            /// `dy: [rows][n_out]`, `weight: [n_out][n_in]`, `dx: [rows][n_in]`.
            #[allow(clippy::too_many_arguments)]
            fn matmul_dx(
                &mut self,
                dy: View<'_, Self>,
                rows: usize,
                n_out: usize,
                weight: View<'_, Self>,
                n_in: usize,
                dx: ViewMut<'_, Self>,
                accumulate: bool,
            ) -> Result<(), BackendError>;

            /// The bias gradient, overwritten: `out[j] = Σ_r dy[r][j]`, `dy: [rows][out.len()]`.
            fn column_sums(&mut self, dy: View<'_, Self>, rows: usize, out: ViewMut<'_, Self>) -> Result<(), BackendError>;

            /// Unfold the receptive fields of `n` images for one conv layer (`volley_policy::ops::im2col`):
            /// `x: [n][C·H·W]` in the geometry's layout, `cols: [n·OH·OW][C·K·K]` (zeros where the
            /// kernel covers padding). The layer itself is then [`Backend::dense_forward`] over `cols`.
            fn im2col(
                &mut self,
                x: View<'_, Self>,
                n: usize,
                geometry: &ConvGeometry,
                cols: ViewMut<'_, Self>,
            ) -> Result<(), BackendError>;

            /// The adjoint of [`Backend::im2col`], overwriting `dx: [n][C·H·W]` with, for every input
            /// element, the sum of the entries of `d_cols: [n·OH·OW][C·K·K]` that read it.
            fn col2im(
                &mut self,
                d_cols: View<'_, Self>,
                n: usize,
                geometry: &ConvGeometry,
                dx: ViewMut<'_, Self>,
            ) -> Result<(), BackendError>;

            /// [`Backend::im2col`] over `n` images of bytes (image observations, issue 44 item 3):
            /// `x` holds them packed four bytes to a word ([`pack_byte_rows`]), each image's
            /// `C·H·W` bytes starting at a word, and each byte `v` enters `cols` as
            /// `f32::from(v) · scale`, the value the `f32` path would unfold.
            fn im2col_u8(
                &mut self,
                x: View<'_, Self>,
                n: usize,
                geometry: &ConvGeometry,
                scale: f32,
                cols: ViewMut<'_, Self>,
            ) -> Result<(), BackendError>;

            /// Widen `rows` rows of `width` bytes, packed four to a word ([`pack_byte_rows`]),
            /// into `out: [rows][width]` floats, byte `v` as `f32::from(v) · scale` (a dense first
            /// layer over image observations reads these).
            fn widen_u8(
                &mut self,
                x: View<'_, Self>,
                rows: usize,
                width: usize,
                scale: f32,
                out: ViewMut<'_, Self>,
            ) -> Result<(), BackendError>;

            /// `dst[i] = src[i · width + column]` for `i < rows` (the value column of the heads).
            fn take_column(
                &mut self,
                src: View<'_, Self>,
                rows: usize,
                width: usize,
                column: usize,
                dst: ViewMut<'_, Self>,
            ) -> Result<(), BackendError>;

            /// The GRU state entering a step: `dst[b] = 0` where `starts[b] ≠ 0`, else `src[b]`;
            /// `src`, `dst: [B][hidden]`, `starts: [B]`.
            fn gru_reset_copy(
                &mut self,
                src: View<'_, Self>,
                starts: View<'_, Self>,
                hidden: usize,
                dst: ViewMut<'_, Self>,
            ) -> Result<(), BackendError>;

            /// One GRU step's element-wise part (PyTorch gate convention): from the gate pre-sums
            /// `gi`, `gh` (`[B][3H]`, biases included) and `h_prev` (`[B][H]`) write the gates
            /// `[r, z, n]` (`[B][3H]`) and `h_out` (`[B][H]`).
            #[allow(clippy::too_many_arguments)]
            fn gru_cell_forward(
                &mut self,
                gi: View<'_, Self>,
                gh: View<'_, Self>,
                h_prev: View<'_, Self>,
                hidden: usize,
                gates: ViewMut<'_, Self>,
                h_out: ViewMut<'_, Self>,
            ) -> Result<(), BackendError>;

            /// Backward through one GRU step's element-wise part: on entry `d_h` holds `∂L/∂h'`, on
            /// exit its direct part `∂L/∂h' ⊙ z` (the caller adds `d_gh W_h`); writes `d_gi`, `d_gh`.
            #[allow(clippy::too_many_arguments)]
            fn gru_cell_backward(
                &mut self,
                d_h: ViewMut<'_, Self>,
                gates: View<'_, Self>,
                gh: View<'_, Self>,
                h_prev: View<'_, Self>,
                hidden: usize,
                d_gi: ViewMut<'_, Self>,
                d_gh: ViewMut<'_, Self>,
            ) -> Result<(), BackendError>;

            /// The gradient carried into a GRU step from the step after it: zero the rows of `d_h`
            /// where `starts_next` (the next step's episode starts, if any) is non-zero, then add
            /// `from_heads`, the gradient arriving at this step's output from above.
            fn gru_carry_grad(
                &mut self,
                d_h: ViewMut<'_, Self>,
                starts_next: Option<View<'_, Self>>,
                from_heads: View<'_, Self>,
                hidden: usize,
            ) -> Result<(), BackendError>;

            /// [`Backend::log_probs`] on shapes it has checked (what a backend implements).
            #[allow(clippy::too_many_arguments)]
            fn log_probs_unchecked(
                &mut self,
                heads: View<'_, Self>,
                n_actions: usize,
                head: &Head<'_, Self>,
                actions: View<'_, Self>,
                reference: Option<View<'_, Self>>,
                out: ViewMut<'_, Self>,
            ) -> Result<(), BackendError>;

            /// `out[i] = min(exp(prox[i] − behaviour[i]), clip)` (Hilton et al. 2021).
            fn behaviour_weights(
                &mut self,
                prox_log_probs: View<'_, Self>,
                behaviour_log_probs: View<'_, Self>,
                clip: f32,
                out: ViewMut<'_, Self>,
            ) -> Result<(), BackendError>;

            /// GAE(γ, λ) advantages and λ-returns over `[T][B]` (Schulman et al. 2016, eq. (16));
            /// `values: [T][B]`, `bootstrap_value: [B]`.
            #[allow(clippy::too_many_arguments)]
            ///
            /// Where `advantage_override` (`[T][B]`, group baselines) is finite, it is written to
            /// `advantages` in place of GAE's; `returns` (the value targets) are GAE's either way.
            fn gae_scan(
                &mut self,
                t_len: usize,
                b_len: usize,
                discounts: View<'_, Self>,
                rewards: View<'_, Self>,
                values: View<'_, Self>,
                bootstrap_value: View<'_, Self>,
                lambda_: f32,
                advantage_override: Option<View<'_, Self>>,
                advantages: ViewMut<'_, Self>,
                returns: ViewMut<'_, Self>,
            ) -> Result<(), BackendError>;

            /// Start the statistics of an update of `n_evaluations` loss evaluations (gradient steps):
            /// every slot, and the update's off-policy sums, is zeroed.
            fn begin_evaluations(&mut self, n_evaluations: usize) -> Result<(), BackendError>;

            /// [`Backend::vtrace_loss`] on shapes it has checked (what a backend implements): log-ρ,
            /// the V-trace scan, the weighted loss sums into evaluation `slot`,
            /// `∂L/∂heads` and the head parameters' gradient rows. Same result as
            /// [`crate::losses::vtrace_loss_heads`].
            fn vtrace_loss_unchecked(
                &mut self,
                inputs: &VTraceLossInputs<'_, Self>,
                config: &VTraceLossConfig,
                outputs: VTraceLossOutputs<'_, Self>,
                slot: usize,
            ) -> Result<(), BackendError>;

            /// [`Backend::ppo_loss`] on shapes it has checked (what a backend implements;
            /// Schulman et al. 2017, Hilton et al. 2021): the weighted loss sums into evaluation `slot`, `∂L/∂heads` and
            /// the head parameters' gradient rows. Same result as [`crate::losses::ppo_loss_heads`].
            fn ppo_loss_unchecked(
                &mut self,
                inputs: &PpoLossInputs<'_, Self>,
                config: &PpoLossConfig,
                outputs: PpoLossOutputs<'_, Self>,
                slot: usize,
            ) -> Result<(), BackendError>;

            /// [`Backend::off_policy_sums`] on shapes it has checked (what a backend implements).
            /// The off-policy health of this update ([`crate::telemetry`]), from the same per-sample
            /// terms on every device ([`OffPolicySums::add`]): adds the weighted sums of `inputs` to the
            /// update's [`OffPolicySums`] (read back by [`Backend::read_evaluations`]) and writes each
            /// sample's `ρ` into `ratios` (`[n]`; [`crate::telemetry::NO_RATIO`] where its weight is 0).
            fn off_policy_sums_unchecked(
                &mut self,
                inputs: &OffPolicyViews<'_, Self>,
                ratios: ViewMut<'_, Self>,
            ) -> Result<(), BackendError>;

            /// Whole columns of a time-major `[rows][b_len][width]` block:
            /// `dst[t][j] = src[t][columns[columns_offset + j]]` for `j < n_columns`.
            #[allow(clippy::too_many_arguments)]
            fn gather_columns(
                &mut self,
                src: View<'_, Self>,
                rows: usize,
                b_len: usize,
                width: usize,
                columns: &Self::Indices,
                columns_offset: usize,
                n_columns: usize,
                dst: ViewMut<'_, Self>,
            ) -> Result<(), BackendError>;

            /// Adam's step count `t`, on the device.
            fn step_count(&mut self, t: u64) -> Result<Self::StepCount, BackendError>;

            /// Read Adam's step count back.
            fn read_step_count(&mut self, step: &Self::StepCount) -> Result<u64, BackendError>;

            /// Global-norm clipping (Pascanu et al. 2013) then Adam (Kingma & Ba 2015) over the flat
            /// parameter buffer; the pre-clip norm goes to evaluation `slot`. A non-finite norm skips
            /// the step (parameters, moments and `t` unchanged). `grads` may be scaled in place.
            #[allow(clippy::too_many_arguments)]
            fn clip_adam_step(
                &mut self,
                params: ViewMut<'_, Self>,
                grads: ViewMut<'_, Self>,
                adam_m: ViewMut<'_, Self>,
                adam_v: ViewMut<'_, Self>,
                step: &mut Self::StepCount,
                config: &AdamConfig,
                learning_rate: f32,
                max_grad_norm: f32,
                slot: usize,
            ) -> Result<(), BackendError>;

            /// The statistics of this update's evaluations and its off-policy sums (one wait for the
            /// device on CUDA).
            fn read_evaluations(
                &mut self,
                out: &mut Vec<Evaluation>,
                off_policy: &mut OffPolicySums,
            ) -> Result<(), BackendError>;
        }
    };
}
// Used by the stand-in, which builds without the `cuda` feature.
#[cfg_attr(feature = "cuda", allow(unused_imports))]
pub(crate) use backend_operations;

/// Declares the operations [`backend_operations`] lists, as they are, in the trait.
macro_rules! declare_operations {
    ($($(#[$meta:meta])* fn $name:ident($($params:tt)*) -> $ret:ty;)*) => {
        $($(#[$meta])* fn $name($($params)*) -> $ret;)*
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

    backend_operations!(declare_operations);

    /// `out[i] = log π(a_i | x_i) − reference[i]` (or `log π(a_i | x_i)` without a reference)
    /// under `head`, from the outputs in row `i` of the heads block (`stride = A + 1`);
    /// `actions: [n][action_width]`, `n = out.len()`. Checks the shapes, then runs
    /// [`Backend::log_probs_unchecked`].
    #[allow(clippy::too_many_arguments)]
    fn log_probs(
        &mut self,
        heads: View<'_, Self>,
        n_actions: usize,
        head: &Head<'_, Self>,
        actions: View<'_, Self>,
        reference: Option<View<'_, Self>>,
        out: ViewMut<'_, Self>,
    ) -> Result<(), BackendError> {
        let n = out.len();
        let (width, _) = head.check("log_probs", n_actions)?;
        check_len("log_probs", "heads", n * (n_actions + 1), heads.len())?;
        check_len("log_probs", "actions", n * width, actions.len())?;
        check_len("log_probs", "reference", n, reference.map_or(n, |r| r.len()))?;
        self.log_probs_unchecked(heads, n_actions, head, actions, reference, out)
    }

    /// The fused IMPALA loss with V-trace targets (Espeholt et al. 2018, sec. 4.2) for any
    /// head: checks the shapes ([`VTraceLossInputs`]' contract), then runs
    /// [`Backend::vtrace_loss_unchecked`].
    fn vtrace_loss(
        &mut self,
        inputs: &VTraceLossInputs<'_, Self>,
        config: &VTraceLossConfig,
        outputs: VTraceLossOutputs<'_, Self>,
        slot: usize,
    ) -> Result<(), BackendError> {
        inputs.check(&outputs)?;
        self.vtrace_loss_unchecked(inputs, config, outputs, slot)
    }

    /// The fused decoupled PPO-clip loss over one minibatch for any head: checks the shapes
    /// ([`PpoLossInputs`]' contract), then runs [`Backend::ppo_loss_unchecked`].
    fn ppo_loss(
        &mut self,
        inputs: &PpoLossInputs<'_, Self>,
        config: &PpoLossConfig,
        outputs: PpoLossOutputs<'_, Self>,
        slot: usize,
    ) -> Result<(), BackendError> {
        inputs.check(&outputs)?;
        self.ppo_loss_unchecked(inputs, config, outputs, slot)
    }

    /// The update's off-policy sums over `n = ratios.len()` samples: checks that every input
    /// has `n` elements, then runs [`Backend::off_policy_sums_unchecked`].
    fn off_policy_sums(
        &mut self,
        inputs: &OffPolicyViews<'_, Self>,
        ratios: ViewMut<'_, Self>,
    ) -> Result<(), BackendError> {
        let n = ratios.len();
        for (operand, view) in [
            ("log_rhos", inputs.log_rhos),
            ("weights", inputs.weights),
            ("values", inputs.values),
            ("value_targets", inputs.value_targets),
        ] {
            check_len("off_policy_sums", operand, n, view.len())?;
        }
        self.off_policy_sums_unchecked(inputs, ratios)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

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
