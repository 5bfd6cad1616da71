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
    act_backward_in_place, bias_act_rows, bias_rows, byte_table, col2im, column_sums, dense_forward, gemm,
    gru_cell_backward, gru_cell_forward, im2col, im2col_u8_scaled, Mat,
};
use volley_policy::returns::gae;
use volley_policy::{Activation, ConvGeometry};

use super::ops::{
    BehaviourWeights, ClipAdamStep, Col2im, ConvMap, CopyColumns, DenseForward, GaeScan, GatherColumns, GruCarryGrad,
    GruCellBackward, GruCellForward, GruResetCopy, Im2col, Im2colU8, LogProbs, MatmulDw, MatmulDx, TakeColumn, WidenU8,
};
use super::{
    packed_words, Backend, BackendError, Evaluation, Head, OffPolicyViews, PpoLoss, VTraceLoss, View, ViewMut,
};
use crate::losses::{self, PpoTargets, RowBatch, VTraceRows};
use crate::optim::{adam_step, clip_grad_global_norm};
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
    /// `f(threads)` on this backend's pool, or on the calling thread with one thread: for
    /// [`large_gemm`], which splits a product over the current rayon pool.
    fn on_pool<R: Send>(&self, f: impl FnOnce(usize) -> R + Send) -> R {
        match &self.pool {
            Some(pool) => pool.install(|| f(self.threads)),
            None => f(1),
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

    /// `f(images, input, output)` over a conv layer's `n` images, where `input` holds
    /// `per_image.0` elements an image and `output` `per_image.1`: split into whole images over
    /// the pool when [`Self::image_split`] finds the work (the unfolded matrix's size) worth it,
    /// else one call over all `n`.
    fn over_images<I: Sync, O: Send>(
        &self,
        geometry: &ConvGeometry,
        n: usize,
        (input, output): (&[I], &mut [O]),
        per_image: (usize, usize),
        f: impl Fn(usize, &[I], &mut [O]) + Sync + Send,
    ) {
        match self.image_split(n, geometry.cols_len()) {
            Some((pool, per_thread)) => pool.install(|| {
                let inputs = input.par_chunks(per_thread * per_image.0);
                inputs
                    .zip(output.par_chunks_mut(per_thread * per_image.1))
                    .enumerate()
                    .for_each(|(chunk, (input, output))| f(per_thread.min(n - chunk * per_thread), input, output));
            }),
            None => f(n, input, output),
        }
    }

    /// `im2col` ([`ConvMap::Unfold`]: `src` the images, `dst` the unfolded matrix) or `col2im`
    /// ([`ConvMap::Fold`]: `src` the matrix's gradient, `dst` the images', overwritten) over
    /// `n` images.
    fn conv_map(&self, map: ConvMap, geometry: &ConvGeometry, n: usize, src: &[f32], dst: &mut [f32]) {
        let (image, cols) = (geometry.input_len(), geometry.cols_len());
        let per_image = match map {
            ConvMap::Unfold => (image, cols),
            ConvMap::Fold => (cols, image),
        };
        self.over_images(geometry, n, (src, dst), per_image, |images, src, dst| {
            match map {
                ConvMap::Unfold => im2col(geometry, src, images, dst),
                ConvMap::Fold => col2im(geometry, src, images, dst),
            }
            .expect("whole images on both sides")
        });
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

    fn indices_len(buffer: &Vec<u32>) -> usize {
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

    fn upload_unchecked(&mut self, host: &[f32], dst: ViewMut<'_, Self>) -> Result<(), BackendError> {
        slice_mut(dst).copy_from_slice(host);
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

    fn download_unchecked(&mut self, src: View<'_, Self>, host: &mut [f32]) -> Result<(), BackendError> {
        host.copy_from_slice(slice(src));
        Ok(())
    }

    fn fill(&mut self, x: ViewMut<'_, Self>, value: f32) -> Result<(), BackendError> {
        slice_mut(x).fill(value);
        Ok(())
    }

    fn copy_unchecked(&mut self, src: View<'_, Self>, dst: ViewMut<'_, Self>) -> Result<(), BackendError> {
        slice_mut(dst).copy_from_slice(slice(src));
        Ok(())
    }

    fn dense_forward_unchecked(&mut self, op: DenseForward<'_, Self>) -> Result<(), BackendError> {
        let DenseForward { rows, n_in, n_out, act, .. } = op;
        if rows == 0 {
            return Ok(());
        }
        let (x, weight, bias, y) = (slice(op.x), slice(op.weight), slice(op.bias), slice_mut(op.y));
        if rows * n_in * n_out < self.large_macs {
            dense_forward(x, rows, weight, bias, act, y);
            return Ok(());
        }
        // y = x Wᵀ: W is [n_out][n_in], so Wᵀ has row stride 1 and column stride n_in.
        let a = Strided { data: x, row_stride: n_in, col_stride: 1 };
        let b = Strided { data: weight, row_stride: 1, col_stride: n_in };
        self.on_pool(|threads| large_gemm(threads, rows, n_in, n_out, a, b, false, y));
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

    fn act_backward_unchecked(
        &mut self,
        dy: ViewMut<'_, Self>,
        y: View<'_, Self>,
        act: Activation,
    ) -> Result<(), BackendError> {
        act_backward_in_place(slice_mut(dy), slice(y), act);
        Ok(())
    }

    fn matmul_dw_unchecked(&mut self, op: MatmulDw<'_, Self>) -> Result<(), BackendError> {
        let MatmulDw { rows, n_out, n_in, .. } = op;
        let (dy, x, dw) = (slice(op.dy), slice(op.x), slice_mut(op.dw));
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

    fn matmul_dx_unchecked(&mut self, op: MatmulDx<'_, Self>) -> Result<(), BackendError> {
        let MatmulDx { rows, n_out, n_in, accumulate, .. } = op;
        let (dy, weight, dx) = (slice(op.dy), slice(op.weight), slice_mut(op.dx));
        if rows * n_out * n_in >= self.large_macs {
            let a = Strided { data: dy, row_stride: n_out, col_stride: 1 };
            let b = Strided { data: weight, row_stride: n_in, col_stride: 1 };
            self.on_pool(|threads| large_gemm(threads, rows, n_out, n_in, a, b, accumulate, dx));
            return Ok(());
        }
        let beta = if accumulate { 1.0 } else { 0.0 };
        gemm(1.0, Mat::row_major(dy, rows, n_out), Mat::row_major(weight, n_out, n_in), beta, dx);
        Ok(())
    }

    fn column_sums_unchecked(
        &mut self,
        dy: View<'_, Self>,
        _rows: usize,
        out: ViewMut<'_, Self>,
    ) -> Result<(), BackendError> {
        column_sums(slice(dy), slice_mut(out));
        Ok(())
    }

    fn im2col_unchecked(&mut self, op: Im2col<'_, Self>) -> Result<(), BackendError> {
        self.conv_map(ConvMap::Unfold, op.geometry, op.n, slice(op.x), slice_mut(op.cols));
        Ok(())
    }

    fn im2col_u8_unchecked(&mut self, op: Im2colU8<'_, Self>) -> Result<(), BackendError> {
        let (x, n, geometry, scale, cols) = (op.x, op.n, op.geometry, op.scale, op.cols);
        let image_words = packed_words(geometry.input_len());
        let (bytes, cols): (&[u8], _) = (bytemuck::cast_slice(slice(x)), slice_mut(cols));
        // Each image starts at a word. When `C·H·W` is a whole number of words (every preset)
        // the images are contiguous and unfold in one call; otherwise one at a time, skipping
        // the padding between them.
        let contiguous = 4 * image_words == geometry.input_len();
        let per_image = (4 * image_words, geometry.cols_len());
        self.over_images(geometry, n, (bytes, cols), per_image, |images, bytes, cols| {
            if contiguous {
                im2col_u8_scaled(geometry, bytes, images, scale, cols).expect("whole images on both sides");
                return;
            }
            for (image, cols) in bytes.chunks_exact(4 * image_words).zip(cols.chunks_exact_mut(geometry.cols_len())) {
                im2col_u8_scaled(geometry, &image[..geometry.input_len()], 1, scale, cols)
                    .expect("one whole image on both sides");
            }
        });
        Ok(())
    }

    fn widen_u8_unchecked(&mut self, op: WidenU8<'_, Self>) -> Result<(), BackendError> {
        let (x, width, scale, out) = (op.x, op.width, op.scale, op.out);
        let row_words = packed_words(width);
        if width == 0 {
            return Ok(());
        }
        let (bytes, out): (&[u8], _) = (bytemuck::cast_slice(slice(x)), slice_mut(out));
        let table = byte_table(scale);
        for (row, out) in bytes.chunks_exact(4 * row_words).zip(out.chunks_exact_mut(width)) {
            for (value, &byte) in out.iter_mut().zip(row) {
                *value = table[usize::from(byte)];
            }
        }
        Ok(())
    }

    fn col2im_unchecked(&mut self, op: Col2im<'_, Self>) -> Result<(), BackendError> {
        self.conv_map(ConvMap::Fold, op.geometry, op.n, slice(op.d_cols), slice_mut(op.dx));
        Ok(())
    }

    fn take_column_unchecked(&mut self, op: TakeColumn<'_, Self>) -> Result<(), BackendError> {
        for (out, row) in slice_mut(op.dst).iter_mut().zip(slice(op.src).chunks_exact(op.width)) {
            *out = row[op.column];
        }
        Ok(())
    }

    fn copy_columns_unchecked(&mut self, op: CopyColumns<'_, Self>) -> Result<(), BackendError> {
        let (from, to, n) = (op.src_column, op.dst_column, op.columns);
        let rows = slice_mut(op.dst).chunks_exact_mut(op.dst_width).zip(slice(op.src).chunks_exact(op.src_width));
        for (dst, src) in rows.take(op.rows) {
            dst[to..to + n].copy_from_slice(&src[from..from + n]);
        }
        Ok(())
    }

    fn gru_reset_copy_unchecked(&mut self, op: GruResetCopy<'_, Self>) -> Result<(), BackendError> {
        let hidden = op.hidden;
        let rows = slice_mut(op.dst).chunks_exact_mut(hidden).zip(slice(op.src).chunks_exact(hidden));
        for ((dst, src), &start) in rows.zip(slice(op.starts)) {
            if start != 0.0 {
                dst.fill(0.0);
            } else {
                dst.copy_from_slice(src);
            }
        }
        Ok(())
    }

    fn gru_cell_forward_unchecked(&mut self, op: GruCellForward<'_, Self>) -> Result<(), BackendError> {
        let (gi, gh, h_prev) = (slice(op.gi), slice(op.gh), slice(op.h_prev));
        gru_cell_forward(gi, gh, h_prev, op.hidden, slice_mut(op.gates), slice_mut(op.h_out));
        Ok(())
    }

    fn gru_cell_backward_unchecked(&mut self, op: GruCellBackward<'_, Self>) -> Result<(), BackendError> {
        let (gates, gh, h_prev) = (slice(op.gates), slice(op.gh), slice(op.h_prev));
        let (d_gi, d_gh) = (slice_mut(op.d_gi), slice_mut(op.d_gh));
        gru_cell_backward(slice_mut(op.d_h), gates, gh, h_prev, op.hidden, d_gi, d_gh);
        Ok(())
    }

    fn gru_carry_grad_unchecked(&mut self, op: GruCarryGrad<'_, Self>) -> Result<(), BackendError> {
        let d_h = slice_mut(op.d_h);
        if let Some(starts) = op.starts_next {
            for (d_row, &start) in d_h.chunks_exact_mut(op.hidden).zip(slice(starts)) {
                if start != 0.0 {
                    d_row.fill(0.0);
                }
            }
        }
        for (d, &from_heads) in d_h.iter_mut().zip(slice(op.from_heads)) {
            *d += from_heads;
        }
        Ok(())
    }

    fn log_probs_unchecked(&mut self, op: LogProbs<'_, Self>) -> Result<(), BackendError> {
        let n_actions = op.n_actions;
        let head = cpu_head(&op.head, n_actions);
        let width = head.action_width();
        let actions = slice(op.actions);
        check_actions(&head, actions, "log_probs")?;
        let out = slice_mut(op.out);
        let reference = op.reference.map(slice);
        let rows = slice(op.heads).chunks_exact(n_actions + 1).zip(actions.chunks_exact(width));
        for (i, (row, action)) in rows.enumerate() {
            out[i] = head.log_prob(&row[..n_actions], action) - reference.map_or(0.0, |r| r[i]);
        }
        Ok(())
    }

    fn behaviour_weights_unchecked(&mut self, op: BehaviourWeights<'_, Self>) -> Result<(), BackendError> {
        let (prox, behaviour) = (slice(op.prox_log_probs), slice(op.behaviour_log_probs));
        losses::behaviour_is_weights(prox, behaviour, op.clip, slice_mut(op.out));
        Ok(())
    }

    fn gae_scan_unchecked(&mut self, op: GaeScan<'_, Self>) -> Result<(), BackendError> {
        let advantages = slice_mut(op.advantages);
        let (discounts, rewards, values) = (slice(op.discounts), slice(op.rewards), slice(op.values));
        let (bootstrap_value, returns) = (slice(op.bootstrap_value), slice_mut(op.returns));
        gae(op.t_len, op.b_len, discounts, rewards, values, bootstrap_value, op.lambda_, advantages, returns);
        if let Some(advantage_override) = op.advantage_override {
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

    fn vtrace_loss_unchecked(&mut self, op: VTraceLoss<'_, Self>) -> Result<(), BackendError> {
        let VTraceLoss { inputs, config, outputs, slot } = op;
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

    fn ppo_loss_unchecked(&mut self, op: PpoLoss<'_, Self>) -> Result<(), BackendError> {
        let PpoLoss { inputs, config, outputs, slot } = op;
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
            reference: inputs.reference.map(slice),
            weights: slice(inputs.weights),
            values: slice(inputs.values),
            value_targets: slice(inputs.value_targets),
            rho_bar: inputs.rho_bar,
            c_bar: inputs.c_bar,
        };
        telemetry::off_policy_sums(&host, &mut self.off_policy, slice_mut(ratios));
        Ok(())
    }

    fn gather_columns_unchecked(&mut self, op: GatherColumns<'_, Self>) -> Result<(), BackendError> {
        let GatherColumns { b_len, width, columns_offset, n_columns, .. } = op;
        let columns = &op.columns[columns_offset..columns_offset + n_columns];
        // A column index is data, not a shape: refused here rather than indexed out of bounds.
        if let Some(&column) = columns.iter().find(|&&c| c as usize >= b_len) {
            return Err(BackendError::IndexOutOfRange {
                op: "gather_columns",
                operand: "column",
                index: column as usize,
                bound: b_len,
            });
        }
        let (src, dst) = (slice(op.src), slice_mut(op.dst));
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

    fn clip_adam_step_unchecked(&mut self, op: ClipAdamStep<'_, Self>) -> Result<(), BackendError> {
        let grads = slice_mut(op.grads);
        let norm = clip_grad_global_norm(grads, op.max_grad_norm);
        self.slot(op.slot)?.grad_norm = norm;
        if norm.is_finite() {
            let (params, adam_m, adam_v) = (slice_mut(op.params), slice_mut(op.adam_m), slice_mut(op.adam_v));
            adam_step(op.config, params, grads, adam_m, adam_v, op.step, op.learning_rate);
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
        let mut gather = |columns_offset, dst: &mut Vec<f32>| {
            let (src, dst) = (View::of(&src), ViewMut::of(dst));
            let (rows, b_len, width, n_columns, columns) = (2, 3, 2, 2, &columns);
            cpu.gather_columns(GatherColumns { src, rows, b_len, width, columns, columns_offset, n_columns, dst })
        };
        gather(1, &mut dst).unwrap();
        assert_eq!(dst, [4.0, 5.0, 0.0, 1.0, 10.0, 11.0, 6.0, 7.0]);
        let err = gather(0, &mut dst).unwrap_err();
        assert!(err.to_string().contains("column"), "{err}");
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
        let mut log_probs = |actions: &Vec<f32>, out: &mut Vec<f32>| {
            let (heads, actions, out) = (View::of(&heads), View::of(actions), ViewMut::of(out));
            cpu.log_probs(LogProbs { heads, n_actions: 2, head, actions, reference: None, out })
        };
        log_probs(&actions, &mut out).unwrap();
        assert!((out[0] - 0.5f32.ln()).abs() < 1e-6);
        let expected = 1.0 - (1.0f32.exp() + 1.0).ln();
        assert!((out[1] - expected).abs() < 1e-6, "{out:?}");
        let bad = vec![f32::from_bits(2), f32::from_bits(0)];
        assert!(log_probs(&bad, &mut out).is_err());
    }
}
