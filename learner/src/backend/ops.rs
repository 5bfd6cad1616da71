//! The operands of the [`Backend`] operations that take more than a few, one struct per
//! operation, each with its shape contract stated once (`check`).
//!
//! The trait's entry point of an operation ([`Backend::dense_forward`], ...) runs `check` and
//! only then hands the operands to the backend's `*_unchecked` implementation, so backends
//! trust the lengths they are given and state no shapes of their own. A wrong view is an error
//! naming the operation, the operand and both lengths ([`BackendError::Shape`]), raised before
//! any backend code runs.

use volley_policy::{Activation, ConvGeometry};

use super::{check_len, Backend, BackendError, Head, View, ViewMut};
use crate::optim::AdamConfig;

/// Check every `(operand, expected, got)` length of operation `op`, in order.
#[inline]
pub(crate) fn check_all(op: &'static str, operands: &[(&'static str, usize, usize)]) -> Result<(), BackendError> {
    operands.iter().try_for_each(|&(operand, expected, got)| check_len(op, operand, expected, got))
}

/// Which way a conv layer's `im2col` and `col2im` map between its images `[n][C·H·W]` and the
/// unfolded matrix `[n·OH·OW][C·K·K]`; the two are adjoint and take the same operands, so each
/// backend implements them once.
#[derive(Debug, Clone, Copy)]
pub(crate) enum ConvMap {
    /// Images to the matrix ([`Backend::im2col`]).
    Unfold,
    /// The matrix's gradient back to the images', summing overlaps ([`Backend::col2im`]).
    Fold,
}

/// The operands of [`Backend::dense_forward`]: `y = act(x Wᵀ + b)` over `rows` rows.
pub struct DenseForward<'a, B: Backend + ?Sized> {
    /// The input, `[rows][n_in]`.
    pub x: View<'a, B>,
    /// The rows of the batch.
    pub rows: usize,
    /// Input features per row.
    pub n_in: usize,
    /// The weight, `[n_out][n_in]`.
    pub weight: View<'a, B>,
    /// The bias, `[n_out]`.
    pub bias: View<'a, B>,
    /// Output features per row.
    pub n_out: usize,
    /// The activation (`None`: the identity).
    pub act: Option<Activation>,
    /// The output, `[rows][n_out]`.
    pub y: ViewMut<'a, B>,
}

impl<B: Backend + ?Sized> DenseForward<'_, B> {
    pub(super) fn check(&self) -> Result<(), BackendError> {
        check_all(
            "dense_forward",
            &[
                ("x", self.rows * self.n_in, self.x.len()),
                ("weight", self.n_out * self.n_in, self.weight.len()),
                ("bias", self.n_out, self.bias.len()),
                ("y", self.rows * self.n_out, self.y.len()),
            ],
        )
    }
}

/// The operands of [`Backend::matmul_dw`]: `dW = dYᵀ X` over `rows` rows.
pub struct MatmulDw<'a, B: Backend + ?Sized> {
    /// The output gradient, `[rows][n_out]`.
    pub dy: View<'a, B>,
    /// The layer's input, `[rows][n_in]`.
    pub x: View<'a, B>,
    /// The rows of the batch.
    pub rows: usize,
    /// Output features per row.
    pub n_out: usize,
    /// Input features per row.
    pub n_in: usize,
    /// The weight gradient, `[n_out][n_in]`, overwritten.
    pub dw: ViewMut<'a, B>,
}

impl<B: Backend + ?Sized> MatmulDw<'_, B> {
    pub(super) fn check(&self) -> Result<(), BackendError> {
        check_all(
            "matmul_dw",
            &[
                ("dy", self.rows * self.n_out, self.dy.len()),
                ("x", self.rows * self.n_in, self.x.len()),
                ("dw", self.n_out * self.n_in, self.dw.len()),
            ],
        )
    }
}

/// The operands of [`Backend::matmul_dx`]: `dX = dY W` (`+ dX` when `accumulate`).
pub struct MatmulDx<'a, B: Backend + ?Sized> {
    /// The output gradient, `[rows][n_out]`.
    pub dy: View<'a, B>,
    /// The rows of the batch.
    pub rows: usize,
    /// Output features per row.
    pub n_out: usize,
    /// The weight, `[n_out][n_in]`.
    pub weight: View<'a, B>,
    /// Input features per row.
    pub n_in: usize,
    /// The input gradient, `[rows][n_in]`.
    pub dx: ViewMut<'a, B>,
    /// Add to `dx` instead of overwriting it.
    pub accumulate: bool,
}

impl<B: Backend + ?Sized> MatmulDx<'_, B> {
    pub(super) fn check(&self) -> Result<(), BackendError> {
        check_all(
            "matmul_dx",
            &[
                ("dy", self.rows * self.n_out, self.dy.len()),
                ("weight", self.n_out * self.n_in, self.weight.len()),
                ("dx", self.rows * self.n_in, self.dx.len()),
            ],
        )
    }
}

/// The operands of [`Backend::im2col`]: `n` images unfolded for one conv layer.
pub struct Im2col<'a, B: Backend + ?Sized> {
    /// The images, `[n][C·H·W]` in the geometry's layout.
    pub x: View<'a, B>,
    /// The images.
    pub n: usize,
    /// The conv layer's geometry.
    pub geometry: &'a ConvGeometry,
    /// The unfolded matrix, `[n·OH·OW][C·K·K]`.
    pub cols: ViewMut<'a, B>,
}

impl<B: Backend + ?Sized> Im2col<'_, B> {
    pub(super) fn check(&self) -> Result<(), BackendError> {
        let (g, n) = (self.geometry, self.n);
        check_all("im2col", &[("x", n * g.input_len(), self.x.len()), ("cols", n * g.cols_len(), self.cols.len())])
    }
}

/// The operands of [`Backend::im2col_u8`]: [`Im2col`] over images of bytes packed four to a
/// word ([`super::pack_byte_rows`]), each byte `v` unfolded as `f32::from(v) · scale`.
pub struct Im2colU8<'a, B: Backend + ?Sized> {
    /// The images, `[n][packed_words(C·H·W)]`, each image starting at a word.
    pub x: View<'a, B>,
    /// The images.
    pub n: usize,
    /// The conv layer's geometry.
    pub geometry: &'a ConvGeometry,
    /// What one byte step is worth in the layer's input (`1/255` for pixels).
    pub scale: f32,
    /// The unfolded matrix, `[n·OH·OW][C·K·K]`.
    pub cols: ViewMut<'a, B>,
}

impl<B: Backend + ?Sized> Im2colU8<'_, B> {
    pub(super) fn check(&self) -> Result<(), BackendError> {
        let (g, n) = (self.geometry, self.n);
        let x_len = n * super::packed_words(g.input_len());
        check_all("im2col_u8", &[("x", x_len, self.x.len()), ("cols", n * g.cols_len(), self.cols.len())])
    }
}

/// The operands of [`Backend::widen_u8`]: `rows` rows of `width` bytes packed four to a word
/// ([`super::pack_byte_rows`]) widened to floats, byte `v` as `f32::from(v) · scale`.
pub struct WidenU8<'a, B: Backend + ?Sized> {
    /// `[rows][packed_words(width)]`.
    pub x: View<'a, B>,
    /// Rows of `x` and `out`.
    pub rows: usize,
    /// Bytes (and floats) per row.
    pub width: usize,
    /// What one byte step is worth.
    pub scale: f32,
    /// `[rows][width]`.
    pub out: ViewMut<'a, B>,
}

impl<B: Backend + ?Sized> WidenU8<'_, B> {
    pub(super) fn check(&self) -> Result<(), BackendError> {
        let x_len = self.rows * super::packed_words(self.width);
        check_all("widen_u8", &[("x", x_len, self.x.len()), ("out", self.rows * self.width, self.out.len())])
    }
}

/// The operands of [`Backend::col2im`], the adjoint of [`Backend::im2col`].
pub struct Col2im<'a, B: Backend + ?Sized> {
    /// The unfolded matrix's gradient, `[n·OH·OW][C·K·K]`.
    pub d_cols: View<'a, B>,
    /// The images.
    pub n: usize,
    /// The conv layer's geometry.
    pub geometry: &'a ConvGeometry,
    /// The images' gradient, `[n][C·H·W]`, overwritten.
    pub dx: ViewMut<'a, B>,
}

impl<B: Backend + ?Sized> Col2im<'_, B> {
    pub(super) fn check(&self) -> Result<(), BackendError> {
        let (g, n) = (self.geometry, self.n);
        check_all(
            "col2im",
            &[("d_cols", n * g.cols_len(), self.d_cols.len()), ("dx", n * g.input_len(), self.dx.len())],
        )
    }
}

/// The operands of [`Backend::take_column`]: `dst[i] = src[i · width + column]`.
pub struct TakeColumn<'a, B: Backend + ?Sized> {
    /// `[rows][width]`.
    pub src: View<'a, B>,
    /// Rows of `src`.
    pub rows: usize,
    /// Its row width.
    pub width: usize,
    /// The column to take (`< width`).
    pub column: usize,
    /// `[rows]`.
    pub dst: ViewMut<'a, B>,
}

impl<B: Backend + ?Sized> TakeColumn<'_, B> {
    pub(super) fn check(&self) -> Result<(), BackendError> {
        check_all(
            "take_column",
            &[("src", self.rows * self.width, self.src.len()), ("dst", self.rows, self.dst.len())],
        )?;
        if self.column >= self.width {
            return Err(BackendError::IndexOutOfRange {
                op: "take_column",
                operand: "column",
                index: self.column,
                bound: self.width,
            });
        }
        Ok(())
    }
}

/// The operands of [`Backend::copy_columns`]: `dst[r][dst_column + k] = src[r][src_column + k]`
/// for `r < rows`, `k < columns`, between two row-major blocks.
pub struct CopyColumns<'a, B: Backend + ?Sized> {
    /// `[rows][src_width]`.
    pub src: View<'a, B>,
    /// Its row width.
    pub src_width: usize,
    /// The first column copied from.
    pub src_column: usize,
    /// `[rows][dst_width]`; columns outside the copied ones are left as they are.
    pub dst: ViewMut<'a, B>,
    /// Its row width.
    pub dst_width: usize,
    /// The first column copied to.
    pub dst_column: usize,
    /// How many columns.
    pub columns: usize,
    /// Rows of both.
    pub rows: usize,
}

impl<B: Backend + ?Sized> CopyColumns<'_, B> {
    pub(super) fn check(&self) -> Result<(), BackendError> {
        check_all(
            "copy_columns",
            &[("src", self.rows * self.src_width, self.src.len()), ("dst", self.rows * self.dst_width, self.dst.len())],
        )?;
        let ends = [
            ("last src column", self.src_column + self.columns, self.src_width),
            ("last dst column", self.dst_column + self.columns, self.dst_width),
        ];
        for (operand, end, width) in ends {
            if end > width {
                return Err(BackendError::IndexOutOfRange {
                    op: "copy_columns",
                    operand,
                    index: end - 1,
                    bound: width,
                });
            }
        }
        Ok(())
    }
}

/// The operands of [`Backend::gru_reset_copy`]: `dst[b] = 0` where `starts[b] ≠ 0`, else `src[b]`.
pub struct GruResetCopy<'a, B: Backend + ?Sized> {
    /// The state leaving the previous step, `[B][hidden]`.
    pub src: View<'a, B>,
    /// The episode starts of this step, `[B]`.
    pub starts: View<'a, B>,
    /// `H`.
    pub hidden: usize,
    /// The state entering this step, `[B][hidden]`.
    pub dst: ViewMut<'a, B>,
}

impl<B: Backend + ?Sized> GruResetCopy<'_, B> {
    pub(super) fn check(&self) -> Result<(), BackendError> {
        let state = self.starts.len() * self.hidden;
        check_all("gru_reset_copy", &[("src", state, self.src.len()), ("dst", state, self.dst.len())])
    }
}

/// The operands of [`Backend::gru_cell_forward`]; `B = h_prev.len() / hidden` rows.
pub struct GruCellForward<'a, B: Backend + ?Sized> {
    /// The input projection, `[B][3H]`.
    pub gi: View<'a, B>,
    /// The hidden projection, `[B][3H]`.
    pub gh: View<'a, B>,
    /// The state entering the step, `[B][H]`.
    pub h_prev: View<'a, B>,
    /// `H`.
    pub hidden: usize,
    /// The gates `[r, z, n]`, `[B][3H]`.
    pub gates: ViewMut<'a, B>,
    /// The state leaving the step, `[B][H]`.
    pub h_out: ViewMut<'a, B>,
}

impl<B: Backend + ?Sized> GruCellForward<'_, B> {
    pub(super) fn check(&self) -> Result<(), BackendError> {
        let state = self.h_prev.len();
        check_all(
            "gru_cell_forward",
            &[
                ("gi", 3 * state, self.gi.len()),
                ("gh", 3 * state, self.gh.len()),
                ("gates", 3 * state, self.gates.len()),
                ("h_out", state, self.h_out.len()),
            ],
        )
    }
}

/// The operands of [`Backend::gru_cell_backward`]; `B = d_h.len() / hidden` rows.
pub struct GruCellBackward<'a, B: Backend + ?Sized> {
    /// On entry `∂L/∂h'`, on exit its direct part `∂L/∂h' ⊙ z`, `[B][H]`.
    pub d_h: ViewMut<'a, B>,
    /// The step's gates, `[B][3H]`.
    pub gates: View<'a, B>,
    /// The step's hidden projection, `[B][3H]`.
    pub gh: View<'a, B>,
    /// The state entering the step, `[B][H]`.
    pub h_prev: View<'a, B>,
    /// `H`.
    pub hidden: usize,
    /// `∂L/∂gi`, `[B][3H]`.
    pub d_gi: ViewMut<'a, B>,
    /// `∂L/∂gh`, `[B][3H]`.
    pub d_gh: ViewMut<'a, B>,
}

impl<B: Backend + ?Sized> GruCellBackward<'_, B> {
    pub(super) fn check(&self) -> Result<(), BackendError> {
        let state = self.d_h.len();
        check_all(
            "gru_cell_backward",
            &[
                ("gates", 3 * state, self.gates.len()),
                ("gh", 3 * state, self.gh.len()),
                ("h_prev", state, self.h_prev.len()),
                ("d_gi", 3 * state, self.d_gi.len()),
                ("d_gh", 3 * state, self.d_gh.len()),
            ],
        )
    }
}

/// The operands of [`Backend::gru_carry_grad`]; `B = d_h.len() / hidden` rows.
pub struct GruCarryGrad<'a, B: Backend + ?Sized> {
    /// The gradient carried into the step, `[B][H]`.
    pub d_h: ViewMut<'a, B>,
    /// The next step's episode starts, `[B]` (none after the last step).
    pub starts_next: Option<View<'a, B>>,
    /// The gradient arriving at this step's output from above, `[B][H]`.
    pub from_heads: View<'a, B>,
    /// `H`.
    pub hidden: usize,
}

impl<B: Backend + ?Sized> GruCarryGrad<'_, B> {
    pub(super) fn check(&self) -> Result<(), BackendError> {
        let state = self.d_h.len();
        let starts = self.starts_next.map_or(state, |s| s.len() * self.hidden);
        check_all("gru_carry_grad", &[("from_heads", state, self.from_heads.len()), ("starts_next", state, starts)])
    }
}

/// The operands of [`Backend::log_probs`]: `n = out.len()` samples.
pub struct LogProbs<'a, B: Backend + ?Sized> {
    /// The heads block, `[n][A + 1]`.
    pub heads: View<'a, B>,
    /// `A`, the policy head's outputs per row.
    pub n_actions: usize,
    /// The policy head the heads block feeds.
    pub head: Head<'a, B>,
    /// Actions, `[n][action_width]` words.
    pub actions: View<'a, B>,
    /// Subtracted from each log-probability when given, `[n]`.
    pub reference: Option<View<'a, B>>,
    /// `[n]`.
    pub out: ViewMut<'a, B>,
}

impl<B: Backend + ?Sized> LogProbs<'_, B> {
    pub(super) fn check(&self) -> Result<(), BackendError> {
        let op = "log_probs";
        let n = self.out.len();
        let (width, _) = self.head.check(op, self.n_actions)?;
        check_all(
            op,
            &[
                ("heads", n * (self.n_actions + 1), self.heads.len()),
                ("actions", n * width, self.actions.len()),
                ("reference", n, self.reference.map_or(n, |r| r.len())),
            ],
        )
    }
}

/// The operands of [`Backend::behaviour_weights`], all `[n]`.
pub struct BehaviourWeights<'a, B: Backend + ?Sized> {
    /// `log π_prox(a|x)`.
    pub prox_log_probs: View<'a, B>,
    /// `log μ(a|x)`.
    pub behaviour_log_probs: View<'a, B>,
    /// The clip of the weight.
    pub clip: f32,
    /// `min(π_prox/μ, clip)`.
    pub out: ViewMut<'a, B>,
}

impl<B: Backend + ?Sized> BehaviourWeights<'_, B> {
    pub(super) fn check(&self) -> Result<(), BackendError> {
        let n = self.prox_log_probs.len();
        check_all(
            "behaviour_weights",
            &[("behaviour_log_probs", n, self.behaviour_log_probs.len()), ("out", n, self.out.len())],
        )
    }
}

/// The operands of [`Backend::gae_scan`], `[T][B]` unless noted.
pub struct GaeScan<'a, B: Backend + ?Sized> {
    /// `T`.
    pub t_len: usize,
    /// `B`.
    pub b_len: usize,
    /// `γ (1 − terminated)`.
    pub discounts: View<'a, B>,
    /// Rewards.
    pub rewards: View<'a, B>,
    /// Values.
    pub values: View<'a, B>,
    /// The values after the last step, `[B]`.
    pub bootstrap_value: View<'a, B>,
    /// GAE's `λ`.
    pub lambda_: f32,
    /// Group baselines: where finite, the advantage written in place of GAE's.
    pub advantage_override: Option<View<'a, B>>,
    /// The advantages.
    pub advantages: ViewMut<'a, B>,
    /// The λ-returns (value targets).
    pub returns: ViewMut<'a, B>,
}

impl<B: Backend + ?Sized> GaeScan<'_, B> {
    pub(super) fn check(&self) -> Result<(), BackendError> {
        let n = self.t_len * self.b_len;
        check_all(
            "gae_scan",
            &[
                ("discounts", n, self.discounts.len()),
                ("rewards", n, self.rewards.len()),
                ("values", n, self.values.len()),
                ("bootstrap_value", self.b_len, self.bootstrap_value.len()),
                ("advantage_override", n, self.advantage_override.map_or(n, |v| v.len())),
                ("advantages", n, self.advantages.len()),
                ("returns", n, self.returns.len()),
            ],
        )
    }
}

/// The operands of [`Backend::gather_columns`]:
/// `dst[t][j] = src[t][columns[columns_offset + j]]` for `j < n_columns`.
pub struct GatherColumns<'a, B: Backend + ?Sized> {
    /// `[rows][b_len][width]`.
    pub src: View<'a, B>,
    /// Rows (time steps) of `src`.
    pub rows: usize,
    /// Columns per row of `src`.
    pub b_len: usize,
    /// Floats per column entry.
    pub width: usize,
    /// The column indices (each below `b_len`).
    pub columns: &'a B::Indices,
    /// Where in `columns` this gather's indices start.
    pub columns_offset: usize,
    /// How many columns to gather.
    pub n_columns: usize,
    /// `[rows][n_columns][width]`.
    pub dst: ViewMut<'a, B>,
}

impl<B: Backend + ?Sized> GatherColumns<'_, B> {
    pub(super) fn check(&self) -> Result<(), BackendError> {
        // The index buffer may hold more than this gather reads (PPO's minibatches share one).
        let needed = self.columns_offset + self.n_columns;
        check_all(
            "gather_columns",
            &[
                ("src", self.rows * self.b_len * self.width, self.src.len()),
                ("dst", self.rows * self.n_columns * self.width, self.dst.len()),
                ("columns", needed, B::indices_len(self.columns).min(needed)),
            ],
        )
    }
}

/// The operands of [`Backend::clip_adam_step`]: the flat parameter buffer and its gradient and
/// moments (all the same length), Adam's step count and hyper-parameters.
pub struct ClipAdamStep<'a, B: Backend + ?Sized> {
    /// The parameters, updated in place.
    pub params: ViewMut<'a, B>,
    /// Their gradient (may be scaled in place by the clipping).
    pub grads: ViewMut<'a, B>,
    /// Adam's first moment.
    pub adam_m: ViewMut<'a, B>,
    /// Adam's second moment.
    pub adam_v: ViewMut<'a, B>,
    /// Adam's step count `t`.
    pub step: &'a mut B::StepCount,
    /// Adam's `β₁`, `β₂`, `ε`.
    pub config: &'a AdamConfig,
    /// The step size.
    pub learning_rate: f32,
    /// The global-norm clip.
    pub max_grad_norm: f32,
    /// The evaluation the pre-clip norm goes to.
    pub slot: usize,
}

impl<B: Backend + ?Sized> ClipAdamStep<'_, B> {
    pub(super) fn check(&self) -> Result<(), BackendError> {
        let n = self.params.len();
        check_all(
            "clip_adam_step",
            &[("grads", n, self.grads.len()), ("adam_m", n, self.adam_m.len()), ("adam_v", n, self.adam_v.len())],
        )
    }
}
