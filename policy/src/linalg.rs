//! Dense kernels shared by inference and training: a checked `sgemm` wrapper, fused
//! bias + activation loops, their backward counterparts and column sums.
//!
//! Everything here works on contiguous row-major `f32` slices; the only `unsafe` is the call
//! into `matrixmultiply::sgemm`, behind bounds checks.

use super::Activation;

/// A read-only strided matrix view over a slice.
///
/// Element `(i, j)` lives at `data[i * row_stride + j * col_stride]`; [`Mat::t`] swaps the
/// strides, which is how transposed operands reach `sgemm` without a copy.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Mat<'a> {
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
    pub(crate) fn row_major(data: &'a [f32], rows: usize, cols: usize) -> Self {
        assert!(
            data.len() >= rows * cols,
            "matrix {rows}x{cols} needs {} floats, slice has {}",
            rows * cols,
            data.len()
        );
        Mat { data, rows, cols, row_stride: cols, col_stride: 1 }
    }

    /// The transposed view (no copy).
    pub(crate) fn t(self) -> Self {
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
pub(crate) fn gemm(alpha: f32, a: Mat<'_>, b: Mat<'_>, beta: f32, c: &mut [f32]) {
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
/// (only the first `n_rows * n_out` elements are written). One GEMM for the whole batch, then
/// one fused pass for bias and activation.
pub(crate) fn dense_forward(
    x: &[f32],
    n_rows: usize,
    weight: &[f32],
    bias: &[f32],
    act: Option<Activation>,
    y: &mut [f32],
) {
    let n_out = bias.len();
    let n_in = weight.len() / n_out;
    let y = &mut y[..n_rows * n_out];
    gemm(1.0, Mat::row_major(x, n_rows, n_in), Mat::row_major(weight, n_out, n_in).t(), 0.0, y);
    match act {
        Some(act) => bias_act_rows(y, bias, act),
        None => bias_rows(y, bias),
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
pub(crate) fn fast_tanh(x: f32) -> f32 {
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
pub(crate) fn fast_sigmoid(x: f32) -> f32 {
    0.5 + 0.5 * fast_tanh(0.5 * x)
}

/// `y[r] = act(y[r] + bias)` for every row `r` of the row-major `y` (row length `bias.len()`).
pub(crate) fn bias_act_rows(y: &mut [f32], bias: &[f32], act: Activation) {
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
pub(crate) fn bias_rows(y: &mut [f32], bias: &[f32]) {
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
pub(crate) fn act_backward_in_place(dy: &mut [f32], y: &[f32], act: Activation) {
    debug_assert_eq!(dy.len(), y.len());
    match act {
        Activation::Tanh => {
            for (d, &y) in dy.iter_mut().zip(y) {
                *d *= 1.0 - y * y;
            }
        }
        Activation::Relu => {
            for (d, &y) in dy.iter_mut().zip(y) {
                if y <= 0.0 {
                    *d = 0.0;
                }
            }
        }
    }
}

/// `out[j] = Σ_r x[r][j]` over the rows of the row-major `x` (row length `out.len()`); this is
/// the bias gradient of a layer whose output gradient is `x`.
pub(crate) fn column_sums(x: &[f32], out: &mut [f32]) {
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

    #[test]
    fn column_sums_sum_each_column() {
        let x = [1.0, 2.0, 3.0, 4.0, 5.0, 6.0];
        let mut out = [f32::NAN; 3];
        column_sums(&x, &mut out);
        assert_eq!(out, [5.0, 7.0, 9.0]);
    }
}
