//! The CPU backend: buffers are `Vec<f32>`, small products go through `matrixmultiply` with
//! strides (`volley_policy::ops`, the same kernels the actors' inference runs), the losses are
//! [`crate::losses`] on the fused heads block and the optimiser is [`crate::optim`].
//!
//! Threads (issue 44): a backend built [`with_threads`](CpuBackend::with_threads) runs the work
//! of conv-sized layers on its own pool of that many threads, and nothing else.
//! - Large forward and input-gradient products (at least [`LARGE_GEMM_MACS`] multiply-adds) go
//!   to the `gemm` crate, whose AVX-512/AVX2 kernels split the output rows over the pool.
//! - Large weight-gradient products (`dW = dYᵀ X`, whose inner dimension is every output
//!   position of the batch) also go to the `gemm` crate, one product per thread: with threads,
//!   they split that inner dimension, each thread summing its share of the rows into its own
//!   partial `dW`, and the partials are added in thread order, so the result is
//!   deterministic for a given thread count.
//! - `im2col` and `col2im` split the batch's images.
//!
//! Products below the threshold (an MLP's layers) stay on `matrixmultiply` on the calling
//! thread, exactly as with one thread. Every operation works on contiguous slices and, after
//! the first update, allocates nothing.

use rayon::prelude::*;
use volley_policy::head::{AnyHead, PolicyHead};
use volley_policy::ops::{
    act_backward_in_place, bias_act_rows, bias_rows, col2im, column_sums, dense_forward, gemm, gru_cell_backward,
    gru_cell_forward, im2col, Mat,
};
use volley_policy::returns::gae;
use volley_policy::{Activation, ConvGeometry};

use super::{
    check_len, Backend, BackendError, Evaluation, Head, OffPolicyViews, PpoLossInputs, PpoLossOutputs,
    VTraceLossInputs, VTraceLossOutputs, View, ViewMut,
};
use crate::losses::{self, PpoLossConfig, PpoTargets, RowBatch, VTraceLossConfig, VTraceRows};
use crate::optim::{adam_step, clip_grad_global_norm, AdamConfig};
use crate::telemetry::{self, OffPolicyInputs, OffPolicySums};

/// Products of at least this many multiply-adds (`m·k·n`) take the threaded path (see the
/// module documentation); below it the pool's hand-off costs more than it saves. A
/// Nature-DQN conv layer over one batch is 10⁸–10⁹, a 64×64 MLP layer over 256 rows 10⁶.
pub const LARGE_GEMM_MACS: usize = 1 << 22;

/// Weight gradients `dW = dYᵀ X` of layers with fewer outputs than this are computed as
/// `dWᵀ = Xᵀ dY` and transposed (issue 44): the `gemm` crate's kernels are 16 rows by 6
/// columns, and with a 32-row output (the first Nature-DQN conv layer) over an inner dimension
/// of 10⁵ positions the direct product ran at 29 % of the f32 peak, the transposed one at
/// about twice that; with 64 outputs or more the two were level or the direct one faster.
pub const THIN_WEIGHT_GRADIENT_OUT: usize = 64;

/// `dst[j][i] = src[i][j]` for `src: [rows][cols]`, `dst: [cols][rows]`.
fn transpose_into(src: &[f32], rows: usize, cols: usize, dst: &mut [f32]) {
    for (i, row) in src.chunks_exact(cols).take(rows).enumerate() {
        for (j, &value) in row.iter().enumerate() {
            dst[j * rows + i] = value;
        }
    }
}

/// Largest thread count a CPU backend accepts (a guard against a unit mistake in a flag).
pub const MAX_THREADS: usize = 1024;

/// The CPU backend (see the module documentation).
#[derive(Debug)]
pub struct CpuBackend {
    evaluations: Vec<Evaluation>,
    off_policy: OffPolicySums,
    /// The pool large products and per-image loops run on; `None` with one thread.
    pool: Option<rayon::ThreadPool>,
    threads: usize,
    /// The other threads' partial weight gradients, `[threads − 1][n_out·n_in]` (for a thin
    /// layer every thread's, transposed; with one thread, a thin layer's transposed gradient).
    partial_grads: Vec<f32>,
    /// Products of at least this many multiply-adds take the large path ([`LARGE_GEMM_MACS`];
    /// tests lower it so that small networks exercise that path).
    large_macs: usize,
}

impl Default for CpuBackend {
    fn default() -> Self {
        Self::new()
    }
}

impl CpuBackend {
    /// A single-threaded CPU backend.
    pub fn new() -> Self {
        CpuBackend {
            evaluations: Vec::new(),
            off_policy: OffPolicySums::default(),
            pool: None,
            threads: 1,
            partial_grads: Vec::new(),
            large_macs: LARGE_GEMM_MACS,
        }
    }

    /// This backend with every product of at least `macs` multiply-adds on the large path
    /// (tests: 0 sends a small network's every product there).
    #[cfg(test)]
    pub(crate) fn with_large_threshold(mut self, macs: usize) -> Self {
        self.large_macs = macs;
        self
    }

    /// A CPU backend that runs large products and per-image loops on `threads` threads
    /// (`1..=`[`MAX_THREADS`]; one is [`new`](Self::new)).
    pub fn with_threads(threads: usize) -> Result<Self, BackendError> {
        if !(1..=MAX_THREADS).contains(&threads) {
            return Err(BackendError::Threads(format!("{threads} threads: expected 1..={MAX_THREADS}")));
        }
        if threads == 1 {
            return Ok(Self::new());
        }
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(threads)
            .thread_name(|i| format!("volley-learner-cpu-{i}"))
            .build()
            .map_err(|err| BackendError::Threads(err.to_string()))?;
        Ok(CpuBackend { pool: Some(pool), threads, ..Self::new() })
    }

    /// The threads this backend computes on.
    pub fn threads(&self) -> usize {
        self.threads
    }
}

/// One operand of [`large_gemm`]: element `(i, j)` at `data[i·row_stride + j·col_stride]`.
#[derive(Clone, Copy)]
struct Strided<'a> {
    data: &'a [f32],
    row_stride: usize,
    col_stride: usize,
}

impl Strided<'_> {
    /// Panics unless the `rows × cols` view lies inside `data` (the `unsafe` call relies on it).
    fn check(&self, rows: usize, cols: usize) {
        if rows > 0 && cols > 0 {
            let last = (rows - 1) * self.row_stride + (cols - 1) * self.col_stride;
            assert!(last < self.data.len(), "matrix view out of bounds");
        }
    }
}

/// The row-major contiguous matrix `data` with rows of `cols` elements.
fn rows_of(data: &[f32], cols: usize) -> Strided<'_> {
    Strided { data, row_stride: cols, col_stride: 1 }
}

/// The transpose of the row-major contiguous matrix `data` with rows of `cols` elements.
fn transposed_rows(data: &[f32], cols: usize) -> Strided<'_> {
    Strided { data, row_stride: 1, col_stride: cols }
}

/// `C = A B` (or `C += A B` with `accumulate`) for `A: m × k`, `B: k × n` and row-major
/// contiguous `C: m × n`, through the `gemm` crate's kernels, split over the current rayon
/// pool's threads when `threads > 1`.
#[allow(clippy::too_many_arguments)]
fn large_gemm(
    threads: usize,
    m: usize,
    k: usize,
    n: usize,
    a: Strided<'_>,
    b: Strided<'_>,
    accumulate: bool,
    c: &mut [f32],
) {
    a.check(m, k);
    b.check(k, n);
    assert!(c.len() >= m * n, "gemm output needs {} floats, has {}", m * n, c.len());
    if m == 0 || n == 0 {
        return;
    }
    let parallelism = if threads > 1 { gemm::Parallelism::Rayon(threads) } else { gemm::Parallelism::None };
    // SAFETY: `a` spans `m × k` elements and `b` `k × n` with the given strides, and their
    // furthest elements are in bounds (checked above). `c` is an exclusive borrow of at least
    // `m × n` floats written row-major (row stride `n`, column stride 1), so no two outputs
    // alias and `c` cannot overlap the shared borrows `a` and `b`. Strides are at most slice
    // lengths, which fit in `isize`. The crate computes `dst = alpha·dst + beta·lhs·rhs` and
    // reads `dst` only when `read_dst` is true.
    unsafe {
        gemm::gemm(
            m,
            n,
            k,
            c.as_mut_ptr(),
            1,
            n as isize,
            accumulate,
            a.data.as_ptr(),
            a.col_stride as isize,
            a.row_stride as isize,
            b.data.as_ptr(),
            b.col_stride as isize,
            b.row_stride as isize,
            1.0,
            1.0,
            false,
            false,
            false,
            parallelism,
        );
    }
}

fn slice<'a>(view: View<'a, CpuBackend>) -> &'a [f32] {
    let (buffer, range) = view.parts();
    &buffer[range]
}

fn slice_mut<'a>(view: ViewMut<'a, CpuBackend>) -> &'a mut [f32] {
    let (buffer, range) = view.parts();
    &mut buffer[range]
}

impl CpuBackend {
    /// [`large_gemm`] on this backend's threads.
    #[allow(clippy::too_many_arguments)]
    fn large_product(
        &self,
        m: usize,
        k: usize,
        n: usize,
        a: Strided<'_>,
        b: Strided<'_>,
        accumulate: bool,
        c: &mut [f32],
    ) {
        match &self.pool {
            Some(pool) => pool.install(|| large_gemm(self.threads, m, k, n, a, b, accumulate, c)),
            None => large_gemm(1, m, k, n, a, b, accumulate, c),
        }
    }

    /// `dw = dyᵀ x` with the rows split over the pool (see the module documentation).
    fn split_weight_gradient(&mut self, dy: &[f32], x: &[f32], rows: usize, n_out: usize, n_in: usize, dw: &mut [f32]) {
        let pool = self.pool.as_ref().expect("only called with a pool");
        let share = rows.div_ceil(self.threads);
        let len = n_out * n_in;
        let shares = rows.div_ceil(share);
        let thin = n_out < THIN_WEIGHT_GRADIENT_OUT;
        // A thin layer's shares are all computed transposed (`dwᵀ = xᵀ dy`) into the partials,
        // summed there and transposed into `dw` once; otherwise share 0 writes `dw` itself.
        let n_partials = if thin { shares } else { shares - 1 };
        if self.partial_grads.len() < n_partials * len {
            self.partial_grads.resize(n_partials * len, 0.0);
        }
        let product = |first_row: usize, out: &mut [f32]| {
            let n_rows = share.min(rows - first_row);
            let dy = &dy[first_row * n_out..(first_row + n_rows) * n_out];
            let x = &x[first_row * n_in..(first_row + n_rows) * n_in];
            if thin {
                large_gemm(1, n_in, n_rows, n_out, transposed_rows(x, n_in), rows_of(dy, n_out), false, out);
            } else {
                large_gemm(1, n_out, n_rows, n_in, transposed_rows(dy, n_out), rows_of(x, n_in), false, out);
            }
        };
        let partials = &mut self.partial_grads[..n_partials * len];
        let threads = self.threads;
        pool.install(|| {
            if thin {
                partials.par_chunks_exact_mut(len).enumerate().for_each(|(i, out)| product(i * share, out));
            } else {
                rayon::join(
                    || product(0, dw),
                    || {
                        partials
                            .par_chunks_exact_mut(len)
                            .enumerate()
                            .for_each(|(i, out)| product((i + 1) * share, out))
                    },
                );
            }
            let (sum, rest) = if thin { partials.split_at_mut(len) } else { (&mut *dw, &mut *partials) };
            // Sums in share order, split over the weight elements.
            let chunk = len.div_ceil(threads).max(1);
            sum.par_chunks_mut(chunk).enumerate().for_each(|(c, sum)| {
                for partial in rest.chunks_exact(len) {
                    for (d, &p) in sum.iter_mut().zip(&partial[c * chunk..]) {
                        *d += p;
                    }
                }
            });
            if thin {
                transpose_into(&partials[..len], n_in, n_out, dw);
            }
        });
    }

    /// The pool and the images per thread, when this backend has threads and the `n` images
    /// of `elements_per_image` each are worth splitting.
    fn image_split(&self, n: usize, elements_per_image: usize) -> Option<(&rayon::ThreadPool, usize)> {
        let pool = self.pool.as_ref()?;
        (n > 1 && n * elements_per_image >= self.large_macs / 16).then(|| (pool, n.div_ceil(self.threads)))
    }

    fn slot(&mut self, slot: usize) -> Result<&mut Evaluation, BackendError> {
        let n = self.evaluations.len();
        self.evaluations.get_mut(slot).ok_or(BackendError::Shape {
            op: "evaluation",
            operand: "slot",
            expected: n,
            got: slot,
        })
    }
}

impl Backend for CpuBackend {
    type Floats = Vec<f32>;
    type Indices = Vec<u32>;
    type StepCount = u64;

    fn description(&self) -> String {
        "cpu".into()
    }

    fn len(buffer: &Vec<f32>) -> usize {
        buffer.len()
    }

    fn alloc(&mut self, len: usize) -> Result<Vec<f32>, BackendError> {
        Ok(vec![0.0; len])
    }

    fn upload_indices(&mut self, indices: &[u32], dst: &mut Option<Vec<u32>>) -> Result<(), BackendError> {
        let dst = dst.get_or_insert_with(Vec::new);
        dst.clear();
        dst.extend_from_slice(indices);
        Ok(())
    }

    fn upload(&mut self, host: &[f32], dst: ViewMut<'_, Self>) -> Result<(), BackendError> {
        let dst = slice_mut(dst);
        check_len("upload", "dst", host.len(), dst.len())?;
        dst.copy_from_slice(host);
        Ok(())
    }

    fn upload_packed(
        &mut self,
        len: usize,
        pack: &mut dyn FnMut(&mut [f32]),
        dst: &mut Vec<f32>,
    ) -> Result<(), BackendError> {
        if dst.len() != len {
            dst.resize(len, 0.0);
        }
        pack(dst);
        Ok(())
    }

    fn download(&mut self, src: View<'_, Self>, host: &mut [f32]) -> Result<(), BackendError> {
        let src = slice(src);
        check_len("download", "host", src.len(), host.len())?;
        host.copy_from_slice(src);
        Ok(())
    }

    fn fill(&mut self, x: ViewMut<'_, Self>, value: f32) -> Result<(), BackendError> {
        slice_mut(x).fill(value);
        Ok(())
    }

    fn copy(&mut self, src: View<'_, Self>, dst: ViewMut<'_, Self>) -> Result<(), BackendError> {
        check_len("copy", "dst", src.len(), dst.len())?;
        slice_mut(dst).copy_from_slice(slice(src));
        Ok(())
    }

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
    ) -> Result<(), BackendError> {
        let op = "dense_forward";
        check_len(op, "x", rows * n_in, x.len())?;
        check_len(op, "weight", n_out * n_in, weight.len())?;
        check_len(op, "bias", n_out, bias.len())?;
        check_len(op, "y", rows * n_out, y.len())?;
        if rows == 0 {
            return Ok(());
        }
        if rows * n_in * n_out < self.large_macs {
            dense_forward(slice(x), rows, slice(weight), slice(bias), act, slice_mut(y));
            return Ok(());
        }
        // y = x Wᵀ: W is [n_out][n_in], so Wᵀ has row stride 1 and column stride n_in.
        let (x, weight) = (slice(x), slice(weight));
        let y = slice_mut(y);
        let a = Strided { data: x, row_stride: n_in, col_stride: 1 };
        let b = Strided { data: weight, row_stride: 1, col_stride: n_in };
        self.large_product(rows, n_in, n_out, a, b, false, y);
        let bias = slice(bias);
        let finish = |y: &mut [f32]| match act {
            Some(act) => bias_act_rows(y, bias, act),
            None => bias_rows(y, bias),
        };
        match &self.pool {
            Some(pool) => {
                let share = rows.div_ceil(self.threads) * n_out;
                pool.install(|| y.par_chunks_mut(share).for_each(finish));
            }
            None => finish(y),
        }
        Ok(())
    }

    fn act_backward(&mut self, dy: ViewMut<'_, Self>, y: View<'_, Self>, act: Activation) -> Result<(), BackendError> {
        check_len("act_backward", "y", dy.len(), y.len())?;
        act_backward_in_place(slice_mut(dy), slice(y), act);
        Ok(())
    }

    fn matmul_dw(
        &mut self,
        dy: View<'_, Self>,
        x: View<'_, Self>,
        rows: usize,
        n_out: usize,
        n_in: usize,
        dw: ViewMut<'_, Self>,
    ) -> Result<(), BackendError> {
        let op = "matmul_dw";
        check_len(op, "dy", rows * n_out, dy.len())?;
        check_len(op, "x", rows * n_in, x.len())?;
        check_len(op, "dw", n_out * n_in, dw.len())?;
        let (dy, x, dw) = (slice(dy), slice(x), slice_mut(dw));
        let large = rows * n_out * n_in >= self.large_macs;
        if large && self.pool.is_some() && rows >= 2 * self.threads {
            self.split_weight_gradient(dy, x, rows, n_out, n_in, dw);
        } else if large && n_out < THIN_WEIGHT_GRADIENT_OUT {
            let mut transposed = std::mem::take(&mut self.partial_grads);
            transposed.resize(n_out * n_in, 0.0);
            large_gemm(1, n_in, rows, n_out, transposed_rows(x, n_in), rows_of(dy, n_out), false, &mut transposed);
            transpose_into(&transposed, n_in, n_out, dw);
            self.partial_grads = transposed;
        } else if large {
            large_gemm(1, n_out, rows, n_in, transposed_rows(dy, n_out), rows_of(x, n_in), false, dw);
        } else {
            gemm(1.0, Mat::row_major(dy, rows, n_out).t(), Mat::row_major(x, rows, n_in), 0.0, dw);
        }
        Ok(())
    }

    fn matmul_dx(
        &mut self,
        dy: View<'_, Self>,
        rows: usize,
        n_out: usize,
        weight: View<'_, Self>,
        n_in: usize,
        dx: ViewMut<'_, Self>,
        accumulate: bool,
    ) -> Result<(), BackendError> {
        let op = "matmul_dx";
        check_len(op, "dy", rows * n_out, dy.len())?;
        check_len(op, "weight", n_out * n_in, weight.len())?;
        check_len(op, "dx", rows * n_in, dx.len())?;
        if rows * n_out * n_in >= self.large_macs {
            let a = Strided { data: slice(dy), row_stride: n_out, col_stride: 1 };
            let b = Strided { data: slice(weight), row_stride: n_in, col_stride: 1 };
            self.large_product(rows, n_out, n_in, a, b, accumulate, slice_mut(dx));
            return Ok(());
        }
        let beta = if accumulate { 1.0 } else { 0.0 };
        gemm(
            1.0,
            Mat::row_major(slice(dy), rows, n_out),
            Mat::row_major(slice(weight), n_out, n_in),
            beta,
            slice_mut(dx),
        );
        Ok(())
    }

    fn column_sums(&mut self, dy: View<'_, Self>, rows: usize, out: ViewMut<'_, Self>) -> Result<(), BackendError> {
        check_len("column_sums", "dy", rows * out.len(), dy.len())?;
        column_sums(slice(dy), slice_mut(out));
        Ok(())
    }

    fn im2col(
        &mut self,
        x: View<'_, Self>,
        n: usize,
        geometry: &ConvGeometry,
        cols: ViewMut<'_, Self>,
    ) -> Result<(), BackendError> {
        check_len("im2col", "x", n * geometry.input_len(), x.len())?;
        check_len("im2col", "cols", n * geometry.cols_len(), cols.len())?;
        let (x, cols) = (slice(x), slice_mut(cols));
        match self.image_split(n, geometry.cols_len()) {
            Some((pool, per_thread)) => pool.install(|| {
                let inputs = x.par_chunks(per_thread * geometry.input_len());
                inputs.zip(cols.par_chunks_mut(per_thread * geometry.cols_len())).for_each(|(x, cols)| {
                    let images = x.len() / geometry.input_len();
                    im2col(geometry, x, images, cols).expect("whole images on both sides");
                });
            }),
            None => im2col(geometry, x, n, cols).expect("lengths checked above"),
        }
        Ok(())
    }

    fn col2im(
        &mut self,
        d_cols: View<'_, Self>,
        n: usize,
        geometry: &ConvGeometry,
        dx: ViewMut<'_, Self>,
    ) -> Result<(), BackendError> {
        check_len("col2im", "d_cols", n * geometry.cols_len(), d_cols.len())?;
        check_len("col2im", "dx", n * geometry.input_len(), dx.len())?;
        let (d_cols, dx) = (slice(d_cols), slice_mut(dx));
        match self.image_split(n, geometry.cols_len()) {
            Some((pool, per_thread)) => pool.install(|| {
                let grads = d_cols.par_chunks(per_thread * geometry.cols_len());
                grads.zip(dx.par_chunks_mut(per_thread * geometry.input_len())).for_each(|(d_cols, dx)| {
                    let images = dx.len() / geometry.input_len();
                    col2im(geometry, d_cols, images, dx).expect("whole images on both sides");
                });
            }),
            None => col2im(geometry, d_cols, n, dx).expect("lengths checked above"),
        }
        Ok(())
    }

    fn take_column(
        &mut self,
        src: View<'_, Self>,
        rows: usize,
        width: usize,
        column: usize,
        dst: ViewMut<'_, Self>,
    ) -> Result<(), BackendError> {
        check_len("take_column", "src", rows * width, src.len())?;
        check_len("take_column", "dst", rows, dst.len())?;
        for (out, row) in slice_mut(dst).iter_mut().zip(slice(src).chunks_exact(width)) {
            *out = row[column];
        }
        Ok(())
    }

    fn gru_reset_copy(
        &mut self,
        src: View<'_, Self>,
        starts: View<'_, Self>,
        hidden: usize,
        dst: ViewMut<'_, Self>,
    ) -> Result<(), BackendError> {
        check_len("gru_reset_copy", "src", starts.len() * hidden, src.len())?;
        check_len("gru_reset_copy", "dst", starts.len() * hidden, dst.len())?;
        let rows = slice_mut(dst).chunks_exact_mut(hidden).zip(slice(src).chunks_exact(hidden)).zip(slice(starts));
        for ((dst, src), &start) in rows {
            if start != 0.0 {
                dst.fill(0.0);
            } else {
                dst.copy_from_slice(src);
            }
        }
        Ok(())
    }

    fn gru_cell_forward(
        &mut self,
        gi: View<'_, Self>,
        gh: View<'_, Self>,
        h_prev: View<'_, Self>,
        hidden: usize,
        gates: ViewMut<'_, Self>,
        h_out: ViewMut<'_, Self>,
    ) -> Result<(), BackendError> {
        let op = "gru_cell_forward";
        let state = h_prev.len();
        check_len(op, "gi", 3 * state, gi.len())?;
        check_len(op, "gh", 3 * state, gh.len())?;
        check_len(op, "gates", 3 * state, gates.len())?;
        check_len(op, "h_out", state, h_out.len())?;
        gru_cell_forward(slice(gi), slice(gh), slice(h_prev), hidden, slice_mut(gates), slice_mut(h_out));
        Ok(())
    }

    fn gru_cell_backward(
        &mut self,
        d_h: ViewMut<'_, Self>,
        gates: View<'_, Self>,
        gh: View<'_, Self>,
        h_prev: View<'_, Self>,
        hidden: usize,
        d_gi: ViewMut<'_, Self>,
        d_gh: ViewMut<'_, Self>,
    ) -> Result<(), BackendError> {
        let op = "gru_cell_backward";
        let state = d_h.len();
        check_len(op, "gates", 3 * state, gates.len())?;
        check_len(op, "gh", 3 * state, gh.len())?;
        check_len(op, "h_prev", state, h_prev.len())?;
        check_len(op, "d_gi", 3 * state, d_gi.len())?;
        check_len(op, "d_gh", 3 * state, d_gh.len())?;
        gru_cell_backward(
            slice_mut(d_h),
            slice(gates),
            slice(gh),
            slice(h_prev),
            hidden,
            slice_mut(d_gi),
            slice_mut(d_gh),
        );
        Ok(())
    }

    fn gru_carry_grad(
        &mut self,
        d_h: ViewMut<'_, Self>,
        starts_next: Option<View<'_, Self>>,
        from_heads: View<'_, Self>,
        hidden: usize,
    ) -> Result<(), BackendError> {
        check_len("gru_carry_grad", "from_heads", d_h.len(), from_heads.len())?;
        let d_h = slice_mut(d_h);
        if let Some(starts) = starts_next {
            check_len("gru_carry_grad", "starts_next", d_h.len(), starts.len() * hidden)?;
            for (d_row, &start) in d_h.chunks_exact_mut(hidden).zip(slice(starts)) {
                if start != 0.0 {
                    d_row.fill(0.0);
                }
            }
        }
        for (d, &from_heads) in d_h.iter_mut().zip(slice(from_heads)) {
            *d += from_heads;
        }
        Ok(())
    }

    fn log_probs_unchecked(
        &mut self,
        heads: View<'_, Self>,
        n_actions: usize,
        head: &Head<'_, Self>,
        actions: View<'_, Self>,
        reference: Option<View<'_, Self>>,
        out: ViewMut<'_, Self>,
    ) -> Result<(), BackendError> {
        let stride = n_actions + 1;
        let head = cpu_head(head, n_actions);
        let width = head.action_width();
        check_actions(&head, slice(actions), "log_probs")?;
        let out = slice_mut(out);
        let reference = reference.map(slice);
        for (i, (row, action)) in slice(heads).chunks_exact(stride).zip(slice(actions).chunks_exact(width)).enumerate()
        {
            out[i] = head.log_prob(&row[..n_actions], action) - reference.map_or(0.0, |r| r[i]);
        }
        Ok(())
    }

    fn behaviour_weights(
        &mut self,
        prox_log_probs: View<'_, Self>,
        behaviour_log_probs: View<'_, Self>,
        clip: f32,
        out: ViewMut<'_, Self>,
    ) -> Result<(), BackendError> {
        check_len("behaviour_weights", "behaviour_log_probs", prox_log_probs.len(), behaviour_log_probs.len())?;
        check_len("behaviour_weights", "out", prox_log_probs.len(), out.len())?;
        losses::behaviour_is_weights(slice(prox_log_probs), slice(behaviour_log_probs), clip, slice_mut(out));
        Ok(())
    }

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
    ) -> Result<(), BackendError> {
        let n = t_len * b_len;
        if let Some(advantage_override) = advantage_override {
            check_len("gae_scan", "advantage_override", n, advantage_override.len())?;
        }
        for (operand, len) in [
            ("discounts", discounts.len()),
            ("rewards", rewards.len()),
            ("values", values.len()),
            ("advantages", advantages.len()),
            ("returns", returns.len()),
        ] {
            check_len("gae_scan", operand, n, len)?;
        }
        check_len("gae_scan", "bootstrap_value", b_len, bootstrap_value.len())?;
        let advantages = slice_mut(advantages);
        gae(
            t_len,
            b_len,
            slice(discounts),
            slice(rewards),
            slice(values),
            slice(bootstrap_value),
            lambda_,
            advantages,
            slice_mut(returns),
        );
        if let Some(advantage_override) = advantage_override {
            losses::override_advantages(slice(advantage_override), advantages);
        }
        Ok(())
    }

    fn begin_evaluations(&mut self, n_evaluations: usize) -> Result<(), BackendError> {
        self.evaluations.clear();
        self.evaluations.resize(n_evaluations, Evaluation::default());
        self.off_policy = OffPolicySums::default();
        Ok(())
    }

    fn vtrace_loss_unchecked(
        &mut self,
        inputs: &VTraceLossInputs<'_, Self>,
        config: &VTraceLossConfig,
        outputs: VTraceLossOutputs<'_, Self>,
        slot: usize,
    ) -> Result<(), BackendError> {
        let head = cpu_head(&inputs.head, inputs.n_actions);
        check_actions(&head, slice(inputs.actions), "vtrace_loss")?;
        let batch = RowBatch {
            t_len: inputs.t_len,
            b_len: inputs.b_len,
            actions: slice(inputs.actions),
            behaviour_log_probs: slice(inputs.behaviour_log_probs),
            rewards: slice(inputs.rewards),
            discounts: slice(inputs.discounts),
            sample_weights: slice(inputs.sample_weights),
        };
        let out = VTraceRows {
            log_rhos: slice_mut(outputs.log_rhos),
            vs: slice_mut(outputs.vs),
            pg_advantages: slice_mut(outputs.pg_advantages),
            d_heads: slice_mut(outputs.d_heads),
            d_head_params: slice_mut(outputs.d_head_params),
        };
        let (sums, weight_sum) = losses::vtrace_loss_heads(
            &head,
            &batch,
            slice(inputs.heads),
            slice(inputs.values),
            config,
            inputs.advantage_override.map(slice),
            out,
        );
        let evaluation = self.slot(slot)?;
        evaluation.sums = sums;
        evaluation.weight_sum = weight_sum;
        Ok(())
    }

    fn ppo_loss_unchecked(
        &mut self,
        inputs: &PpoLossInputs<'_, Self>,
        config: &PpoLossConfig,
        outputs: PpoLossOutputs<'_, Self>,
        slot: usize,
    ) -> Result<(), BackendError> {
        let n = inputs.n_samples;
        let head = cpu_head(&inputs.head, inputs.n_actions);
        check_actions(&head, slice(inputs.actions), "ppo_loss")?;
        // The PPO loss treats samples independently, so one row of n samples is its batch.
        let batch = RowBatch {
            t_len: 1,
            b_len: n,
            actions: slice(inputs.actions),
            behaviour_log_probs: &[],
            rewards: &[],
            discounts: &[],
            sample_weights: slice(inputs.sample_weights),
        };
        let targets = PpoTargets {
            advantages: slice(inputs.advantages),
            returns: slice(inputs.returns),
            prox_log_probs: slice(inputs.prox_log_probs),
            is_weights: slice(inputs.is_weights),
        };
        let (sums, weight_sum) = losses::ppo_loss_heads(
            &head,
            &batch,
            &targets,
            slice(inputs.heads),
            slice(inputs.values),
            config,
            slice_mut(outputs.d_heads),
            slice_mut(outputs.d_head_params),
        );
        let evaluation = self.slot(slot)?;
        evaluation.sums = sums;
        evaluation.weight_sum = weight_sum;
        Ok(())
    }

    fn off_policy_sums_unchecked(
        &mut self,
        inputs: &OffPolicyViews<'_, Self>,
        ratios: ViewMut<'_, Self>,
    ) -> Result<(), BackendError> {
        let host = OffPolicyInputs {
            log_rhos: slice(inputs.log_rhos),
            weights: slice(inputs.weights),
            values: slice(inputs.values),
            value_targets: slice(inputs.value_targets),
            rho_bar: inputs.rho_bar,
            c_bar: inputs.c_bar,
        };
        telemetry::off_policy_sums(&host, &mut self.off_policy, slice_mut(ratios));
        Ok(())
    }

    fn gather_columns(
        &mut self,
        src: View<'_, Self>,
        rows: usize,
        b_len: usize,
        width: usize,
        columns: &Vec<u32>,
        columns_offset: usize,
        n_columns: usize,
        dst: ViewMut<'_, Self>,
    ) -> Result<(), BackendError> {
        check_len("gather_columns", "src", rows * b_len * width, src.len())?;
        check_len("gather_columns", "dst", rows * n_columns * width, dst.len())?;
        let Some(columns) = columns.get(columns_offset..columns_offset + n_columns) else {
            return Err(BackendError::Shape {
                op: "gather_columns",
                operand: "columns",
                expected: columns_offset + n_columns,
                got: columns.len(),
            });
        };
        if let Some(&column) = columns.iter().find(|&&c| c as usize >= b_len) {
            return Err(BackendError::Shape {
                op: "gather_columns",
                operand: "column",
                expected: b_len,
                got: column as usize,
            });
        }
        let (src, dst) = (slice(src), slice_mut(dst));
        for (src_row, dst_row) in src.chunks_exact(b_len * width).zip(dst.chunks_exact_mut(n_columns * width)) {
            for (&column, dst) in columns.iter().zip(dst_row.chunks_exact_mut(width)) {
                let column = column as usize;
                dst.copy_from_slice(&src_row[column * width..(column + 1) * width]);
            }
        }
        Ok(())
    }

    fn step_count(&mut self, t: u64) -> Result<u64, BackendError> {
        Ok(t)
    }

    fn read_step_count(&mut self, step: &u64) -> Result<u64, BackendError> {
        Ok(*step)
    }

    fn clip_adam_step(
        &mut self,
        params: ViewMut<'_, Self>,
        grads: ViewMut<'_, Self>,
        adam_m: ViewMut<'_, Self>,
        adam_v: ViewMut<'_, Self>,
        step: &mut u64,
        config: &AdamConfig,
        learning_rate: f32,
        max_grad_norm: f32,
        slot: usize,
    ) -> Result<(), BackendError> {
        let n = params.len();
        for (operand, len) in [("grads", grads.len()), ("adam_m", adam_m.len()), ("adam_v", adam_v.len())] {
            check_len("clip_adam_step", operand, n, len)?;
        }
        let grads = slice_mut(grads);
        let norm = clip_grad_global_norm(grads, max_grad_norm);
        self.slot(slot)?.grad_norm = norm;
        if norm.is_finite() {
            adam_step(config, slice_mut(params), grads, slice_mut(adam_m), slice_mut(adam_v), step, learning_rate);
        }
        Ok(())
    }

    fn read_evaluations(
        &mut self,
        out: &mut Vec<Evaluation>,
        off_policy: &mut OffPolicySums,
    ) -> Result<(), BackendError> {
        *off_policy = self.off_policy;
        out.clear();
        out.extend_from_slice(&self.evaluations);
        Ok(())
    }
}

/// The head `head` describes, over its host parameters (their length is checked at the
/// trait's entry).
fn cpu_head<'a>(head: &Head<'a, CpuBackend>, n_actions: usize) -> AnyHead<'a> {
    AnyHead::new(head.kind, n_actions, slice(head.params))
}

/// Segments are validated on arrival; an out-of-range action here is refused, not indexed.
fn check_actions(head: &AnyHead<'_>, actions: &[f32], op: &'static str) -> Result<(), BackendError> {
    let width = head.action_width();
    match actions.chunks_exact(width).position(|action| !head.valid_action(action)) {
        Some(i) => Err(BackendError::Shape {
            op,
            operand: "action",
            expected: head.n_outputs(),
            got: actions[i * width].to_bits() as usize,
        }),
        None => Ok(()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn gather_columns_takes_whole_columns_in_the_given_order() {
        let mut cpu = CpuBackend::new();
        // [rows 2][b_len 3][width 2]
        let src: Vec<f32> = (0..12).map(|i| i as f32).collect();
        let mut columns = None;
        cpu.upload_indices(&[9, 2, 0], &mut columns).unwrap();
        let columns = columns.unwrap();
        let mut dst = vec![0.0; 2 * 2 * 2];
        cpu.gather_columns(View::of(&src), 2, 3, 2, &columns, 1, 2, ViewMut::of(&mut dst)).unwrap();
        assert_eq!(dst, [4.0, 5.0, 0.0, 1.0, 10.0, 11.0, 6.0, 7.0]);
        let err = cpu.gather_columns(View::of(&src), 2, 3, 2, &columns, 0, 2, ViewMut::of(&mut dst)).unwrap_err();
        assert!(err.to_string().contains("column"), "{err}");
    }

    #[test]
    fn a_wrong_length_is_an_error_naming_the_operand() {
        let mut cpu = CpuBackend::new();
        let (x, w, b) = (vec![0.0; 6], vec![0.0; 6], vec![0.0; 3]);
        let mut y = vec![0.0; 5];
        let err = cpu
            .dense_forward(View::of(&x), 3, 2, View::of(&w), View::of(&b), 3, None, ViewMut::of(&mut y))
            .unwrap_err();
        assert_eq!(err.to_string(), "dense_forward: y expected 9 elements, got 5");
    }

    #[test]
    fn log_probs_read_the_logits_of_each_heads_row() {
        use volley_policy::ActionHead;
        let mut cpu = CpuBackend::new();
        // Two rows of [logit 0, logit 1, value].
        let heads = vec![0.0, 0.0, 5.0, 1.0, 0.0, -5.0];
        let actions = vec![f32::from_bits(1), f32::from_bits(0)];
        let mut out = vec![0.0; 2];
        let no_params = Vec::new();
        let head = Head { kind: ActionHead::Categorical, params: View::of(&no_params) };
        cpu.log_probs(View::of(&heads), 2, &head, View::of(&actions), None, ViewMut::of(&mut out)).unwrap();
        assert!((out[0] - 0.5f32.ln()).abs() < 1e-6);
        let expected = 1.0 - (1.0f32.exp() + 1.0).ln();
        assert!((out[1] - expected).abs() < 1e-6, "{out:?}");
        let bad = vec![f32::from_bits(2), f32::from_bits(0)];
        assert!(cpu.log_probs(View::of(&heads), 2, &head, View::of(&bad), None, ViewMut::of(&mut out)).is_err());
    }
}
