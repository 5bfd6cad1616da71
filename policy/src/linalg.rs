//! Dense kernels shared by inference and training: a checked `sgemm` wrapper, a small-batch
//! layer kernel that agrees with it bit for bit, fused bias + activation loops, their backward
//! counterparts and column sums.
//!
//! Everything here works on contiguous row-major `f32` slices. The `unsafe` is: the call into
//! `matrixmultiply::sgemm`, behind bounds checks; the calls into functions compiled for AVX2
//! (and FMA), each after checking the CPU has them; and one unchecked read in the small-batch
//! kernel's inner loop, whose bound is asserted before the loop.

use std::cell::RefCell;

use super::Activation;

/// A read-only strided matrix view over a slice.
///
/// Element `(i, j)` lives at `data[i * row_stride + j * col_stride]`; [`Mat::t`] swaps the
/// strides, which is how transposed operands reach `sgemm` without a copy.
#[derive(Debug, Clone, Copy)]
pub struct Mat<'a> {
    data: &'a [f32],
    rows: usize,
    cols: usize,
    row_stride: usize,
    col_stride: usize,
}

impl<'a> Mat<'a> {
    /// A contiguous row-major `rows × cols` matrix at the start of `data`.
    ///
    /// # Panics
    /// If `data` is shorter than `rows * cols`.
    pub fn row_major(data: &'a [f32], rows: usize, cols: usize) -> Self {
        assert!(
            data.len() >= rows * cols,
            "matrix {rows}x{cols} needs {} floats, slice has {}",
            rows * cols,
            data.len()
        );
        Mat { data, rows, cols, row_stride: cols, col_stride: 1 }
    }

    /// The transposed view (no copy).
    pub fn t(self) -> Self {
        Mat {
            data: self.data,
            rows: self.cols,
            cols: self.rows,
            row_stride: self.col_stride,
            col_stride: self.row_stride,
        }
    }
}

/// `C = alpha · A B + beta · C` for row-major contiguous `C` (`a.rows × b.cols`).
///
/// With `beta == 0` the previous contents of `c` are ignored (not even read as NaN), as
/// `matrixmultiply` documents.
///
/// # Panics
/// If the inner dimensions disagree or `c` is too short.
pub fn gemm(alpha: f32, a: Mat<'_>, b: Mat<'_>, beta: f32, c: &mut [f32]) {
    let (m, k, n) = (a.rows, a.cols, b.cols);
    assert_eq!(b.rows, k, "gemm inner dimensions differ: {m}x{k} times {}x{n}", b.rows);
    assert!(c.len() >= m * n, "gemm output needs {} floats, has {}", m * n, c.len());
    if m == 0 || n == 0 {
        return;
    }
    // Views are only built by `Mat::row_major` (length checked there) and `Mat::t`, so the
    // furthest element each operand touches is in bounds; re-check cheaply for safety.
    for mat in [a, b] {
        if mat.rows > 0 && mat.cols > 0 {
            let last = (mat.rows - 1) * mat.row_stride + (mat.cols - 1) * mat.col_stride;
            assert!(last < mat.data.len(), "matrix view out of bounds");
        }
    }
    // SAFETY: `a` spans `m × k` elements with the given strides and its furthest element is in
    // bounds (checked above); likewise `b` (`k × n`). `c` is an exclusive borrow of at least
    // `m × n` floats laid out row-major (row stride `n`, column stride 1), so no two output
    // elements alias and `c` cannot overlap `a` or `b`, which are shared borrows. All strides
    // are slice lengths or smaller, which fit in `isize` because Rust allocations do.
    unsafe {
        matrixmultiply::sgemm(
            m,
            k,
            n,
            alpha,
            a.data.as_ptr(),
            a.row_stride as isize,
            a.col_stride as isize,
            b.data.as_ptr(),
            b.row_stride as isize,
            b.col_stride as isize,
            beta,
            c.as_mut_ptr(),
            n as isize,
            1,
        );
    }
}

/// One linear layer over a batch: `y = act(x Wᵀ + b)` (or `x Wᵀ + b` when `act` is `None`).
///
/// `x: [n_rows][n_in]`, `weight: [n_out][n_in]` (row-major), `bias: [n_out]`, `y: [n_rows][n_out]`
/// (only the first `n_rows * n_out` elements are written).
///
/// Batches of at most [`SMALL_BATCH_ROWS`] rows and at most [`SMALL_BATCH_MAX_IN`] inputs (an
/// actor's step over its environments) take a kernel without packing ([`small_dense_chain_forward`]),
/// whose results are bit-identical to the GEMM path's; larger ones take one GEMM for the whole
/// batch, then one fused pass for bias and activation.
pub fn dense_forward(x: &[f32], n_rows: usize, weight: &[f32], bias: &[f32], act: Option<Activation>, y: &mut [f32]) {
    let n_out = bias.len();
    let n_in = weight.len() / n_out;
    let y = &mut y[..n_rows * n_out];
    if n_rows <= SMALL_BATCH_ROWS && n_in <= SMALL_BATCH_MAX_IN {
        small_dense_chain_forward(x, n_rows, &[SmallLayer { weight, bias, act }], y);
    } else {
        gemm_dense_forward(x, n_rows, weight, bias, act, y);
    }
}

/// The GEMM path of [`dense_forward`], whatever the batch size: one GEMM for the whole batch,
/// then one fused pass for bias and activation; `y` is exactly `n_rows × n_out` long.
fn gemm_dense_forward(x: &[f32], n_rows: usize, weight: &[f32], bias: &[f32], act: Option<Activation>, y: &mut [f32]) {
    let n_out = bias.len();
    let n_in = weight.len() / n_out;
    gemm(1.0, Mat::row_major(x, n_rows, n_in), Mat::row_major(weight, n_out, n_in).t(), 0.0, y);
    match act {
        Some(act) => bias_act_rows(y, bias, act),
        None => bias_rows(y, bias),
    }
}

/// One linear layer through the `gemm` crate on the calling thread, `y = act(x Wᵀ + b)`, with
/// the shapes of [`dense_forward`]; for the large products of inference (issue 44: a conv layer
/// over a batch of frames, a dense layer of more than [`LARGE_WEIGHTS`] weights).
///
/// `matrixmultiply` copies ("packs") both operands before every product, so a 3136→512 layer
/// over one row copies its 6.4 MB of weights to read them once; the `gemm` crate reads a thin
/// operand in place (for one row, a matrix-vector product) and picks its AVX2/AVX-512 kernels at
/// run time, as the learner's CPU backend does for its large products.
pub fn large_dense_forward(
    x: &[f32],
    n_rows: usize,
    weight: &[f32],
    bias: &[f32],
    act: Option<Activation>,
    y: &mut [f32],
) {
    let n_out = bias.len();
    let n_in = weight.len() / n_out.max(1);
    assert_eq!(weight.len(), n_out * n_in, "weight is not n_out × n_in");
    assert!(x.len() >= n_rows * n_in, "input needs {} floats, has {}", n_rows * n_in, x.len());
    let y = &mut y[..n_rows * n_out];
    if n_rows == 0 || n_out == 0 {
        return;
    }
    // SAFETY: `x` holds at least `n_rows × n_in` floats read row-major (row stride `n_in`,
    // column stride 1) and `weight` exactly `n_out × n_in`, read as `Wᵀ` (row stride 1, column
    // stride `n_in`), so the furthest elements the product reads are in bounds (asserted
    // above). `y` is an exclusive borrow of exactly `n_rows × n_out` floats written row-major
    // (row stride `n_out`), so no two outputs alias and it cannot overlap the shared borrows.
    // Strides are at most slice lengths, which fit in `isize`. With `read_dst` false the crate
    // computes `dst = lhs·rhs` without reading `dst`.
    unsafe {
        gemm::gemm(
            n_rows,
            n_out,
            n_in,
            y.as_mut_ptr(),
            1,
            n_out as isize,
            false,
            x.as_ptr(),
            1,
            n_in as isize,
            weight.as_ptr(),
            n_in as isize,
            1,
            0.0,
            1.0,
            false,
            false,
            false,
            gemm::Parallelism::None,
        );
    }
    match act {
        Some(act) => bias_act_rows(y, bias, act),
        None => bias_rows(y, bias),
    }
}

/// Conv layers of inference whose product has at least this many multiply-adds go through
/// [`large_dense_forward`] (every Nature-DQN layer, even over one frame: 1.8–3.3 M; MinAtar's
/// layer over 8 environments, 0.3 M, stays on `matrixmultiply`).
pub const LARGE_PRODUCT_MACS: usize = 1 << 20;

/// Dense layers of inference with at least this many weights (4 MiB, more than a core's L2
/// cache, which `matrixmultiply` would copy through memory on every call) go through
/// [`large_dense_forward`]: the Nature-DQN network's 3136→512 layer (1.6 M), not MinAtar's
/// 1024→128 (131 K), which measured slower there over 8 environments.
pub const LARGE_WEIGHTS: usize = 1 << 20;

/// Largest batch [`dense_forward`] computes with [`small_dense_chain_forward`].
pub const SMALL_BATCH_ROWS: usize = 16;

/// Largest input width [`dense_forward`] computes with [`small_dense_chain_forward`]:
/// `matrixmultiply` sums the inner dimension in blocks of 256 (its `KC`), each block its own
/// chain of multiply-adds added to the last, so only up to one block can the two agree exactly.
pub const SMALL_BATCH_MAX_IN: usize = 256;

/// Rows computed together by [`small_dense_chain_forward`]: one 8-lane vector per output.
const SMALL_LANES: usize = 8;

/// Outputs computed together by [`small_dense_chain_forward`]: one accumulator vector each.
const SMALL_OUTPUTS: usize = 8;

/// One layer of [`small_dense_chain_forward`]: `weight: [n_out][n_in]`, `bias: [n_out]`, and
/// the activation after the bias (`None`: none).
#[derive(Debug, Clone, Copy)]
pub struct SmallLayer<'a> {
    /// `[n_out][n_in]`, row-major.
    pub weight: &'a [f32],
    /// `[n_out]`.
    pub bias: &'a [f32],
    /// Applied after the bias; `None`: none.
    pub act: Option<Activation>,
}

impl SmallLayer<'_> {
    fn n_in(&self) -> usize {
        self.weight.len() / self.bias.len().max(1)
    }
}

/// Whether [`small_dense_chain_forward`] takes `layers` over `n_rows` rows: at most
/// [`SMALL_BATCH_ROWS`] rows, at least one layer, and every layer at most
/// [`SMALL_BATCH_MAX_IN`] inputs with at least one output.
pub fn small_chain_fits(n_rows: usize, layers: &[SmallLayer<'_>]) -> bool {
    n_rows <= SMALL_BATCH_ROWS
        && !layers.is_empty()
        && layers.iter().all(|layer| !layer.bias.is_empty() && layer.n_in() <= SMALL_BATCH_MAX_IN)
}

/// Linear layers over a small batch, `y = act(x Wᵀ + b)` one after another (each layer's output
/// the next one's input), without GEMM packing (issue 16).
///
/// `matrixmultiply` copies ("packs") both operands before every product; for an actor's batch
/// of 8 rows through a 64×64 layer that copy of the weights costs about as much as the product
/// (CartPole's forward pass for 8 environments: 4.0 µs with GEMM, 2.7 µs with this). Here the
/// inputs are transposed into 8-row lanes (the weights are read in place), and each output
/// element is one chain of multiply-adds over the inputs in order, starting from zero: exactly
/// what `matrixmultiply`'s kernels compute, fused where they fuse (FMA on x86-64 with AVX2 and
/// FMA, and on aarch64), separate where they do not, so the two paths agree bit for bit and an
/// actor's behaviour log-probabilities equal the learner's at the same weights (tested against
/// [`gemm()`]).
/// Between layers the activations stay in the kernel's 8-row lanes instead of being written out
/// row by row and transposed back in (issue 16: for CartPole's 4→64→64→3 network over 8
/// environments, chaining took 28 % off the forward pass); the results are bit-identical to the
/// GEMM path layer by layer.
///
/// `x: [n_rows][n_in of the first layer]` with `n_rows ≤` [`SMALL_BATCH_ROWS`],
/// `y: [n_rows][n_out of the last layer]`; each layer has at most [`SMALL_BATCH_MAX_IN`] inputs,
/// and its `n_in` equals the previous layer's `n_out`.
///
/// # Panics
/// If [`small_chain_fits`] does not hold, the layers do not chain, or a slice is too short.
pub fn small_dense_chain_forward(x: &[f32], n_rows: usize, layers: &[SmallLayer<'_>], y: &mut [f32]) {
    if n_rows == 0 || layers.is_empty() {
        return;
    }
    assert!(
        n_rows <= SMALL_BATCH_ROWS,
        "small_dense_chain_forward takes at most {SMALL_BATCH_ROWS} rows, got {n_rows}"
    );
    let mut widest = 0;
    for (i, layer) in layers.iter().enumerate() {
        let (n_in, n_out) = (layer.n_in(), layer.bias.len());
        assert!(n_out > 0, "layer {i} has no outputs");
        assert!(
            n_in <= SMALL_BATCH_MAX_IN,
            "small_dense_chain_forward takes at most {SMALL_BATCH_MAX_IN} inputs, got {n_in}"
        );
        assert_eq!(layer.weight.len(), n_in * n_out, "layer {i}: weight is not n_out × n_in");
        if i > 0 {
            assert_eq!(
                n_in,
                layers[i - 1].bias.len(),
                "layer {i} takes {n_in} inputs, the layer before gives {}",
                layers[i - 1].bias.len()
            );
        }
        widest = widest.max(n_in).max(n_out);
    }
    let (n_in, n_out) = (layers[0].n_in(), layers[layers.len() - 1].bias.len());
    assert!(x.len() >= n_rows * n_in, "input needs {} floats, has {}", n_rows * n_in, x.len());
    assert!(y.len() >= n_rows * n_out, "output needs {} floats, has {}", n_rows * n_out, y.len());
    SMALL_DENSE_SCRATCH.with_borrow_mut(|scratch| {
        // Two ping-pong lane buffers, then room for one padded block of weights.
        let lanes = 2 * widest + SMALL_OUTPUTS * SMALL_BATCH_MAX_IN.div_ceil(SMALL_LANES);
        if scratch.len() < lanes {
            scratch.resize(lanes, [0.0; SMALL_LANES]);
        }
        let (a, rest) = scratch.split_at_mut(widest);
        let (b, tail) = rest.split_at_mut(widest);
        let mut scratch = ChainScratch { a, b, tail: tail.as_flattened_mut() };
        #[cfg(target_arch = "x86_64")]
        {
            if std::arch::is_x86_feature_detected!("avx2") && std::arch::is_x86_feature_detected!("fma") {
                // SAFETY: the CPU has AVX2 and FMA (checked just above); the function is
                // otherwise safe Rust.
                unsafe { small_chain_avx2_fma(x, n_rows, layers, y, &mut scratch) };
            } else {
                small_chain::<false>(x, n_rows, layers, y, &mut scratch);
            }
        }
        // `matrixmultiply`'s NEON kernel fuses its multiply-adds.
        #[cfg(target_arch = "aarch64")]
        small_chain::<true>(x, n_rows, layers, y, &mut scratch);
        #[cfg(not(any(target_arch = "x86_64", target_arch = "aarch64")))]
        small_chain::<false>(x, n_rows, layers, y, &mut scratch);
    });
}

thread_local! {
    /// [`small_dense_chain_forward`]'s scratch (two buffers of lanes, a padded block of
    /// weights): on the heap once per thread, not zeroed per call.
    static SMALL_DENSE_SCRATCH: RefCell<Vec<[f32; SMALL_LANES]>> = const { RefCell::new(Vec::new()) };
}

/// The buffers of [`small_chain`]: activations in lanes (`a`, `b`: one `[f32; 8]` per
/// feature, lane `r` for the group's row `r`) and room for a padded block of weights.
struct ChainScratch<'a> {
    a: &'a mut [[f32; SMALL_LANES]],
    b: &'a mut [[f32; SMALL_LANES]],
    tail: &'a mut [f32],
}

/// [`small_chain`] compiled for AVX2 and FMA: 8-lane vectors and fused multiply-adds.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
fn small_chain_avx2_fma(
    x: &[f32],
    n_rows: usize,
    layers: &[SmallLayer<'_>],
    y: &mut [f32],
    scratch: &mut ChainScratch<'_>,
) {
    small_chain::<true>(x, n_rows, layers, y, scratch);
}

/// The body of [`small_dense_chain_forward`]; `FUSED` picks fused or separately rounded
/// multiply-adds (fused only where the target has them in hardware). Everything it calls is
/// inlined, so it runs with its caller's target features.
#[inline(always)]
fn small_chain<const FUSED: bool>(
    x: &[f32],
    n_rows: usize,
    layers: &[SmallLayer<'_>],
    y: &mut [f32],
    scratch: &mut ChainScratch<'_>,
) {
    let n_in = layers[0].n_in();
    let n_out = layers[layers.len() - 1].bias.len();
    for first_row in (0..n_rows).step_by(SMALL_LANES) {
        let rows = (n_rows - first_row).min(SMALL_LANES);
        // Transpose this group's rows into lanes; lanes past the last row are zero (their
        // results are never stored).
        let input = &mut scratch.a[..n_in];
        for r in 0..SMALL_LANES {
            if r < rows {
                let row = &x[(first_row + r) * n_in..][..n_in];
                for (lane, &value) in input.iter_mut().zip(row) {
                    lane[r] = value;
                }
            } else {
                input.iter_mut().for_each(|lane| lane[r] = 0.0);
            }
        }
        for (i, layer) in layers.iter().enumerate() {
            let (input, output) =
                if i % 2 == 0 { (&*scratch.a, &mut *scratch.b) } else { (&*scratch.b, &mut *scratch.a) };
            small_layer::<FUSED>(layer, &input[..layer.n_in()], &mut output[..layer.bias.len()], scratch.tail);
        }
        let last = if layers.len() % 2 == 1 { &scratch.b[..n_out] } else { &scratch.a[..n_out] };
        for r in 0..rows {
            let y = &mut y[(first_row + r) * n_out..][..n_out];
            for (y, lane) in y.iter_mut().zip(last) {
                *y = lane[r];
            }
        }
    }
}

/// One layer over one group of lanes: `output[j] = act(Σₖ input[k] · W[j][k] + b[j])`, each
/// sum one chain of multiply-adds over `k` in order, starting from zero. `tail` holds a padded
/// block of weights when the outputs are not a multiple of eight.
#[inline(always)]
fn small_layer<const FUSED: bool>(
    layer: &SmallLayer<'_>,
    input: &[[f32; SMALL_LANES]],
    output: &mut [[f32; SMALL_LANES]],
    tail: &mut [f32],
) {
    let &SmallLayer { weight, bias, act } = layer;
    let (n_in, n_out) = (input.len(), output.len());
    let mut first_out = 0;
    while first_out < n_out {
        let outputs = (n_out - first_out).min(SMALL_OUTPUTS);
        // Eight accumulator vectors stay in registers through the whole sum. A last block of
        // fewer outputs is copied out with zero rows after it (computed, not stored).
        let block = &weight[first_out * n_in..(first_out + outputs) * n_in];
        let block = if outputs == SMALL_OUTPUTS {
            block
        } else {
            let padded = &mut tail[..SMALL_OUTPUTS * n_in];
            padded[..block.len()].copy_from_slice(block);
            padded[block.len()..].fill(0.0);
            &padded[..]
        };
        let mut regs = block_sums::<FUSED>(input, block);
        for (j, (acc, out)) in regs.iter_mut().zip(&mut output[first_out..first_out + outputs]).enumerate() {
            let b = bias[first_out + j];
            match act {
                Some(Activation::Tanh) => acc.iter_mut().for_each(|v| *v = fast_tanh(*v + b)),
                Some(Activation::Relu) => acc.iter_mut().for_each(|v| *v = (*v + b).max(0.0)),
                None => acc.iter_mut().for_each(|v| *v += b),
            }
            *out = *acc;
        }
        first_out += outputs;
    }
}

/// The sums of one block: `regs[j][r] = Σₖ input[k][r] · block[j][k]`, one chain of
/// multiply-adds over `k` in order from zero; `block` is `SMALL_OUTPUTS × n_in`.
#[inline(always)]
fn block_sums<const FUSED: bool>(input: &[[f32; SMALL_LANES]], block: &[f32]) -> [[f32; SMALL_LANES]; SMALL_OUTPUTS] {
    let n_in = input.len();
    assert_eq!(block.len(), SMALL_OUTPUTS * n_in);
    let mut regs = [[0.0f32; SMALL_LANES]; SMALL_OUTPUTS];
    for (k, lane) in input.iter().enumerate() {
        let lane = *lane;
        for (j, acc) in regs.iter_mut().enumerate() {
            // SAFETY: `j < SMALL_OUTPUTS` and `k < n_in` (`input` is `n_in` long), so the
            // index is below `block.len()`, asserted above. Unchecked: the eight checks per
            // input spilled the kernel's registers (1.3× slower).
            let w = unsafe { *block.get_unchecked(j * n_in + k) };
            for (a, &v) in acc.iter_mut().zip(&lane) {
                *a = multiply_add::<FUSED>(v, w, *a);
            }
        }
    }
    regs
}

/// `a · b + c`, rounded once (`FUSED`) or twice.
#[inline(always)]
fn multiply_add<const FUSED: bool>(a: f32, b: f32, c: f32) -> f32 {
    if FUSED {
        a.mul_add(b, c)
    } else {
        a * b + c
    }
}

/// Branch-free rational approximation of `tanh` for `f32`.
///
/// The [13/6] rational minimax fit used by Eigen (`generic_fast_tanh_float`, also in ONNX
/// Runtime's MLAS), with the input clamped to ±7.905311 where the fit reaches ±1. The absolute
/// error is below 1e-6 over the whole line (tested). Unlike libm's `tanhf` it has no branches or
/// calls, so loops over it vectorise. Actors and the learner both use it, so they agree exactly.
#[inline(always)]
// The coefficients are Eigen's, verbatim, so they can be checked against the reference.
#[allow(clippy::excessive_precision)]
pub fn fast_tanh(x: f32) -> f32 {
    const CLAMP: f32 = 7.905_311_107_635_498_05;
    let x = x.clamp(-CLAMP, CLAMP);
    let x2 = x * x;
    let mut p = -2.760_768_477_423_55e-16_f32;
    p = p * x2 + 2.000_187_904_824_77e-13;
    p = p * x2 - 8.604_671_522_137_35e-11;
    p = p * x2 + 5.122_297_090_371_14e-8;
    p = p * x2 + 1.485_722_357_179_79e-5;
    p = p * x2 + 6.372_619_288_754_36e-4;
    p = p * x2 + 4.893_524_558_917_86e-3;
    p *= x;
    let mut q = 1.198_258_394_667_02e-6_f32;
    q = q * x2 + 1.185_347_056_866_54e-4;
    q = q * x2 + 2.268_434_632_439_00e-3;
    q = q * x2 + 4.893_525_185_543_85e-3;
    p / q
}

/// Logistic sigmoid through [`fast_tanh`]: `σ(x) = ½ + ½ tanh(x / 2)`.
#[inline(always)]
pub fn fast_sigmoid(x: f32) -> f32 {
    0.5 + 0.5 * fast_tanh(0.5 * x)
}

/// `y[r] = act(y[r] + bias)` for every row `r` of the row-major `y` (row length `bias.len()`).
///
/// On x86-64 with AVX2 the loops run 8 lanes wide instead of SSE2's 4 (the learner's forward
/// pass spent 11 % of its time here); each element's arithmetic is the same, so the results
/// are identical either way.
pub fn bias_act_rows(y: &mut [f32], bias: &[f32], act: Activation) {
    #[cfg(target_arch = "x86_64")]
    {
        if std::arch::is_x86_feature_detected!("avx2") {
            // SAFETY: the CPU has AVX2 (checked just above); the function is otherwise safe Rust.
            unsafe { bias_act_rows_avx2(y, bias, act) };
            return;
        }
    }
    bias_act_rows_body(y, bias, act);
}

/// [`bias_act_rows_body`] compiled for AVX2.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
fn bias_act_rows_avx2(y: &mut [f32], bias: &[f32], act: Activation) {
    bias_act_rows_body(y, bias, act);
}

#[inline(always)]
fn bias_act_rows_body(y: &mut [f32], bias: &[f32], act: Activation) {
    let width = bias.len();
    debug_assert_eq!(y.len() % width, 0);
    // One loop per activation keeps each body branch-free so it vectorises.
    match act {
        Activation::Tanh => {
            for row in y.chunks_exact_mut(width) {
                for (y, &b) in row.iter_mut().zip(bias) {
                    *y = fast_tanh(*y + b);
                }
            }
        }
        Activation::Relu => {
            for row in y.chunks_exact_mut(width) {
                for (y, &b) in row.iter_mut().zip(bias) {
                    *y = (*y + b).max(0.0);
                }
            }
        }
    }
}

/// `y[r] += bias` for every row `r` of the row-major `y` (row length `bias.len()`).
pub fn bias_rows(y: &mut [f32], bias: &[f32]) {
    let width = bias.len();
    debug_assert_eq!(y.len() % width, 0);
    for row in y.chunks_exact_mut(width) {
        for (y, &b) in row.iter_mut().zip(bias) {
            *y += b;
        }
    }
}

/// Chain rule through the activation, in place: `dy ← dy · act'(pre)`, where the derivative is
/// written in terms of the stored output `y = act(pre)`: `1 − y²` for tanh, `[y > 0]` for ReLU.
pub fn act_backward_in_place(dy: &mut [f32], y: &[f32], act: Activation) {
    debug_assert_eq!(dy.len(), y.len());
    match act {
        Activation::Tanh => {
            for (d, &y) in dy.iter_mut().zip(y) {
                *d *= 1.0 - y * y;
            }
        }
        Activation::Relu => {
            // A select rather than a conditional store: it vectorises and has no branch to
            // mispredict on the roughly random signs of a conv layer's outputs.
            for (d, &y) in dy.iter_mut().zip(y) {
                *d = if y <= 0.0 { 0.0 } else { *d };
            }
        }
    }
}

/// `out[j] = Σ_r x[r][j]` over the rows of the row-major `x` (row length `out.len()`); this is
/// the bias gradient of a layer whose output gradient is `x`.
pub fn column_sums(x: &[f32], out: &mut [f32]) {
    let width = out.len();
    debug_assert_eq!(x.len() % width, 0);
    out.fill(0.0);
    for row in x.chunks_exact(width) {
        for (o, &v) in out.iter_mut().zip(row) {
            *o += v;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fast_tanh_is_within_1e6_of_tanh_everywhere() {
        let mut max_err = 0.0f64;
        let mut x = -12.0f32;
        while x <= 12.0 {
            let err = (fast_tanh(x) as f64 - (x as f64).tanh()).abs();
            max_err = max_err.max(err);
            x += 1e-3;
        }
        assert!(max_err < 1e-6, "max abs error {max_err}");
        assert_eq!(fast_tanh(0.0), 0.0);
        assert!(fast_tanh(1e30) <= 1.0 && fast_tanh(-1e30) >= -1.0);
    }

    #[test]
    fn fast_sigmoid_matches_logistic() {
        for i in -200..=200 {
            let x = i as f32 * 0.1;
            let exact = 1.0 / (1.0 + (-(x as f64)).exp());
            assert!((fast_sigmoid(x) as f64 - exact).abs() < 1e-6, "x = {x}");
        }
    }

    #[test]
    fn gemm_with_transposes_matches_naive_product() {
        // A is 3x4, B is 4x2; use A from a stored 4x3 (transposed) and B from a stored 2x4.
        let a_t: Vec<f32> = (0..12).map(|i| i as f32 * 0.5 - 2.0).collect(); // 4x3
        let b_t: Vec<f32> = (0..8).map(|i| 1.0 - i as f32 * 0.25).collect(); // 2x4
        let mut c = vec![f32::NAN; 6];
        gemm(1.0, Mat::row_major(&a_t, 4, 3).t(), Mat::row_major(&b_t, 2, 4).t(), 0.0, &mut c);
        for i in 0..3 {
            for j in 0..2 {
                let expected: f32 = (0..4).map(|k| a_t[k * 3 + i] * b_t[j * 4 + k]).sum();
                assert!((c[i * 2 + j] - expected).abs() < 1e-5);
            }
        }
        // beta = 1 accumulates.
        let before = c.clone();
        gemm(1.0, Mat::row_major(&a_t, 4, 3).t(), Mat::row_major(&b_t, 2, 4).t(), 1.0, &mut c);
        for (after, before) in c.iter().zip(&before) {
            assert!((after - 2.0 * before).abs() < 1e-5);
        }
    }

    proptest::proptest! {
        #![proptest_config(proptest::test_runner::Config::with_cases(200))]

        /// The small-batch kernel computes each output as the GEMM kernel does: bit-identical
        /// results, so an actor's log-probabilities equal the learner's at the same weights.
        #[test]
        fn small_batch_kernel_is_bit_identical_to_gemm(
            n_rows in 1usize..=SMALL_BATCH_ROWS,
            n_in in 1usize..=SMALL_BATCH_MAX_IN,
            n_out in 1usize..=70,
            act in 0usize..3,
            seed in proptest::prelude::any::<u32>(),
        ) {
            let value = |i: usize, salt: u32| {
                let h = (i as u32 ^ salt).wrapping_mul(2_654_435_761).wrapping_add(seed).wrapping_mul(2_246_822_519);
                ((h >> 8) as f32 / (1u32 << 23) as f32 - 1.0) * 3.0
            };
            let x: Vec<f32> = (0..n_rows * n_in).map(|i| value(i, 1)).collect();
            let weight: Vec<f32> = (0..n_out * n_in).map(|i| value(i, 2) * 0.2).collect();
            let bias: Vec<f32> = (0..n_out).map(|i| value(i, 3)).collect();
            let act = [None, Some(Activation::Tanh), Some(Activation::Relu)][act];
            let mut expected = vec![f32::NAN; n_rows * n_out];
            gemm_dense_forward(&x, n_rows, &weight, &bias, act, &mut expected);
            let mut y = vec![f32::NAN; n_rows * n_out + 3];
            small_dense_chain_forward(&x, n_rows, &[SmallLayer { weight: &weight, bias: &bias, act }], &mut y);
            for (i, (got, want)) in y.iter().zip(&expected).enumerate() {
                proptest::prop_assert_eq!(got.to_bits(), want.to_bits(), "element {} ({} vs {})", i, got, want);
            }
            // Nothing past the output is written.
            proptest::prop_assert!(y[n_rows * n_out..].iter().all(|v| v.is_nan()));
        }
    }

    proptest::proptest! {
        #![proptest_config(proptest::test_runner::Config::with_cases(100))]

        /// Layers chained in lanes give, bit for bit, what the GEMM path gives layer by layer.
        #[test]
        fn small_chain_is_bit_identical_to_gemm_layer_by_layer(
            n_rows in 1usize..=SMALL_BATCH_ROWS,
            widths in proptest::collection::vec(1usize..=80, 2..=5),
            acts in proptest::collection::vec(0usize..3, 4),
            seed in proptest::prelude::any::<u32>(),
        ) {
            let value = |i: usize, salt: u32| {
                let h = (i as u32 ^ salt).wrapping_mul(2_654_435_761).wrapping_add(seed).wrapping_mul(2_246_822_519);
                ((h >> 8) as f32 / (1u32 << 23) as f32 - 1.0) * 3.0
            };
            let n_layers = widths.len() - 1;
            let params: Vec<(Vec<f32>, Vec<f32>, Option<Activation>)> = (0..n_layers)
                .map(|l| {
                    let (n_in, n_out) = (widths[l], widths[l + 1]);
                    let weight = (0..n_out * n_in).map(|i| value(i, 10 + l as u32) * 0.2).collect();
                    let bias = (0..n_out).map(|i| value(i, 20 + l as u32)).collect();
                    (weight, bias, [None, Some(Activation::Tanh), Some(Activation::Relu)][acts[l]])
                })
                .collect();
            let x: Vec<f32> = (0..n_rows * widths[0]).map(|i| value(i, 1)).collect();
            let mut expected = x.clone();
            for (weight, bias, act) in &params {
                let mut next = vec![f32::NAN; n_rows * bias.len()];
                gemm_dense_forward(&expected, n_rows, weight, bias, *act, &mut next);
                expected = next;
            }
            let chain: Vec<SmallLayer<'_>> =
                params.iter().map(|(weight, bias, act)| SmallLayer { weight, bias, act: *act }).collect();
            proptest::prop_assert!(small_chain_fits(n_rows, &chain));
            let mut y = vec![f32::NAN; expected.len() + 3];
            small_dense_chain_forward(&x, n_rows, &chain, &mut y);
            for (i, (got, want)) in y.iter().zip(&expected).enumerate() {
                proptest::prop_assert_eq!(got.to_bits(), want.to_bits(), "element {} ({} vs {})", i, got, want);
            }
            proptest::prop_assert!(y[expected.len()..].iter().all(|v| v.is_nan()));
        }
    }

    #[test]
    fn small_chain_refuses_what_it_cannot_take() {
        let (w, b) = ([0.0f32; 4 * 300], [0.0f32; 4]);
        assert!(!small_chain_fits(17, &[SmallLayer { weight: &w[..8], bias: &b[..2], act: None }]));
        assert!(!small_chain_fits(8, &[SmallLayer { weight: &w, bias: &b, act: None }]), "300 inputs");
        assert!(!small_chain_fits(8, &[]));
        assert!(small_chain_fits(16, &[SmallLayer { weight: &w[..8], bias: &b[..2], act: None }]));
        let layers = [
            SmallLayer { weight: &w[..8], bias: &b[..2], act: None },
            SmallLayer { weight: &w[..9], bias: &b[..3], act: None },
        ];
        let result = std::panic::catch_unwind(|| small_dense_chain_forward(&[0.0; 4], 1, &layers, &mut [0.0; 3]));
        assert!(result.is_err(), "3 inputs after a layer of 2 outputs");
    }

    #[test]
    fn dense_forward_takes_the_small_kernel_only_within_its_bounds() {
        // 17 rows and 257 inputs go through GEMM (blocked sums past 256 inputs); both paths
        // agree with a plain sum to float precision.
        for (n_rows, n_in) in [(8, 64), (17, 64), (8, 257), (16, 256)] {
            let x: Vec<f32> = (0..n_rows * n_in).map(|i| ((i * 7919) % 13) as f32 * 0.1 - 0.6).collect();
            let weight: Vec<f32> = (0..5 * n_in).map(|i| ((i * 104_729) % 11) as f32 * 0.05 - 0.25).collect();
            let bias = [0.1, -0.2, 0.3, 0.0, 0.5];
            let mut y = vec![0.0; n_rows * 5];
            dense_forward(&x, n_rows, &weight, &bias, None, &mut y);
            for r in 0..n_rows {
                for o in 0..5 {
                    let sum: f64 = (0..n_in).map(|k| x[r * n_in + k] as f64 * weight[o * n_in + k] as f64).sum();
                    let want = sum + bias[o] as f64;
                    assert!((y[r * 5 + o] as f64 - want).abs() < 1e-4, "{n_rows}x{n_in}: {} vs {want}", y[r * 5 + o]);
                }
            }
        }
    }

    /// The `gemm` crate's path of inference computes what the `matrixmultiply` path computes,
    /// to rounding, for one row (a matrix-vector product), a few rows and many, with and
    /// without an activation, and writes nothing past `n_rows × n_out`.
    #[test]
    fn large_dense_forward_matches_the_gemm_path() {
        for (n_rows, n_in, n_out, act) in [
            (1, 3136, 40, Some(Activation::Relu)),
            (8, 300, 33, None),
            (67, 256, 32, Some(Activation::Tanh)),
            (0, 5, 3, None),
        ] {
            let x: Vec<f32> = (0..n_rows * n_in).map(|i| ((i * 7919) % 255) as f32 / 255.0 - 0.5).collect();
            let weight: Vec<f32> = (0..n_out * n_in).map(|i| ((i * 104_729) % 97) as f32 * 0.002 - 0.09).collect();
            let bias: Vec<f32> = (0..n_out).map(|i| i as f32 * 0.01 - 0.1).collect();
            let mut want = vec![0.0; n_rows * n_out];
            gemm_dense_forward(&x, n_rows, &weight, &bias, act, &mut want);
            let mut got = vec![f32::NAN; n_rows * n_out + 2];
            large_dense_forward(&x, n_rows, &weight, &bias, act, &mut got);
            for (i, (a, b)) in got.iter().zip(&want).enumerate() {
                assert!((a - b).abs() <= 1e-5 * (1.0 + b.abs()), "{n_rows}x{n_in}x{n_out} output {i}: {a} vs {b}");
            }
            assert!(got[n_rows * n_out..].iter().all(|v| v.is_nan()), "wrote past the output");
        }
    }

    #[test]
    fn bias_act_rows_applies_the_activation_to_each_element_exactly() {
        let bias: Vec<f32> = (0..37).map(|i| i as f32 * 0.37 - 6.0).collect();
        let pre: Vec<f32> = (0..37 * 9).map(|i| ((i * 7919) % 201) as f32 * 0.09 - 9.0).collect();
        for act in [Activation::Tanh, Activation::Relu] {
            let mut y = pre.clone();
            bias_act_rows(&mut y, &bias, act);
            for (i, (&got, &x)) in y.iter().zip(&pre).enumerate() {
                let x = x + bias[i % 37];
                let want = match act {
                    Activation::Tanh => fast_tanh(x),
                    Activation::Relu => x.max(0.0),
                };
                assert_eq!(got.to_bits(), want.to_bits(), "{act:?} element {i}");
            }
        }
    }

    #[test]
    fn column_sums_sum_each_column() {
        let x = [1.0, 2.0, 3.0, 4.0, 5.0, 6.0];
        let mut out = [f32::NAN; 3];
        column_sums(&x, &mut out);
        assert_eq!(out, [5.0, 7.0, 9.0]);
    }
}
