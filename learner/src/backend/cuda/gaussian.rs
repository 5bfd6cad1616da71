//! Launchers of the diagonal Gaussian head's kernels (`learner/kernels/gaussian.cu`, issue 14),
//! beside the other launchers of [`super::kernels::Kernels`]: each checks the lengths its
//! kernel indexes with, converts sizes to `int`, and launches under a `SAFETY` line.

use std::sync::Arc;

use cudarc::driver::{CudaStream, CudaView, CudaViewMut, PushKernelArg};

use super::kernels::{grid, int, Kernels, NULL, SLOT_STATS};
use crate::backend::{check_len, BackendError};

/// The per-sample inputs of a Gaussian loss besides the heads block: actions `[n][A]` and the
/// log-std `[A]`.
pub(crate) struct GaussianRows<'a> {
    pub(crate) heads: CudaView<'a, f32>,
    pub(crate) action_dim: usize,
    pub(crate) log_std: CudaView<'a, f32>,
    pub(crate) actions: CudaView<'a, f32>,
    pub(crate) squash: bool,
}

impl GaussianRows<'_> {
    /// Check the shared shapes for `n` samples and `n_rows` heads rows.
    fn check(&self, op: &'static str, n: usize, n_rows: usize) -> Result<(), BackendError> {
        check_len(op, "log_std", self.action_dim, self.log_std.len())?;
        check_len(op, "actions", n * self.action_dim, self.actions.len())?;
        if self.heads.len() < n_rows * (self.action_dim + 1) {
            return Err(BackendError::Shape {
                op,
                operand: "heads",
                expected: n_rows * (self.action_dim + 1),
                got: self.heads.len(),
            });
        }
        Ok(())
    }
}

/// The V-trace inputs of [`Kernels::gaussian_vtrace_loss_grad`], all `[n]` but `values`
/// (`[n_rows]`).
pub(crate) struct GaussianVTraceArgs<'a> {
    pub(crate) weights: CudaView<'a, f32>,
    pub(crate) values: CudaView<'a, f32>,
    pub(crate) vs: CudaView<'a, f32>,
    pub(crate) log_rhos: CudaView<'a, f32>,
    pub(crate) pg_advantages: CudaView<'a, f32>,
    pub(crate) rho_bar: f32,
    pub(crate) value_coef: f32,
    pub(crate) ent_coef: f32,
}

/// The PPO inputs of [`Kernels::gaussian_ppo_loss_grad`], all `[n]`.
pub(crate) struct GaussianPpoArgs<'a> {
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

impl Kernels {
    /// `out[i] = log π(a_i|x_i) − reference[i]` (or without a reference) for `i < out.len()`.
    pub(crate) fn gaussian_log_probs(
        &self,
        stream: &Arc<CudaStream>,
        rows: &GaussianRows<'_>,
        reference: Option<&CudaView<'_, f32>>,
        out: &mut CudaViewMut<'_, f32>,
    ) -> Result<(), BackendError> {
        let n = out.len();
        rows.check("gaussian_log_probs", n, n)?;
        if let Some(reference) = reference {
            check_len("gaussian_log_probs", "reference", n, reference.len())?;
        }
        let a = rows.action_dim;
        let (stride_i, a_i, n_i) = (int("stride", a + 1)?, int("action_dim", a)?, int("n", n)?);
        let squash = i32::from(rows.squash);
        let mut launch = stream.launch_builder(&self.gaussian_log_probs);
        launch.arg(&rows.heads).arg(&stride_i).arg(&a_i).arg(&rows.log_std).arg(&rows.actions).arg(&squash);
        match reference {
            Some(reference) => launch.arg(reference),
            None => launch.arg(&NULL),
        };
        launch.arg(out).arg(&n_i);
        // SAFETY: (heads, stride, a_dim, log_std, actions, squash, ref, out, n) is the parameter
        // list; heads holds at least n rows of stride = a_dim + 1 floats, actions n·a_dim,
        // log_std a_dim, ref and out n floats (checked); ref may be NULL (the kernel tests it).
        unsafe { launch.launch(grid(n)) }?;
        Ok(())
    }

    /// The fused Gaussian V-trace loss rows over `n_rows = d_heads.len() / (A + 1)` heads rows
    /// (`n` samples plus the bootstrap row), with per-row log-std gradients `[n][A]`.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn gaussian_vtrace_loss_grad(
        &self,
        stream: &Arc<CudaStream>,
        rows: &GaussianRows<'_>,
        args: &GaussianVTraceArgs<'_>,
        moments: &mut CudaViewMut<'_, f64>,
        d_heads: &mut CudaViewMut<'_, f32>,
        d_log_std_rows: &mut CudaViewMut<'_, f32>,
        stats: &mut CudaViewMut<'_, f64>,
    ) -> Result<(), BackendError> {
        let n = args.weights.len();
        let a = rows.action_dim;
        let stride = a + 1;
        let n_rows = d_heads.len() / stride;
        check_len("gaussian_vtrace_loss_grad", "d_heads", n_rows * stride, d_heads.len())?;
        rows.check("gaussian_vtrace_loss_grad", n, n_rows)?;
        for (operand, len) in
            [("vs", args.vs.len()), ("log_rhos", args.log_rhos.len()), ("pg_advantages", args.pg_advantages.len())]
        {
            check_len("gaussian_vtrace_loss_grad", operand, n, len)?;
        }
        check_len("gaussian_vtrace_loss_grad", "d_log_std_rows", n * a, d_log_std_rows.len())?;
        if args.values.len() < n || n > n_rows {
            return Err(BackendError::Shape {
                op: "gaussian_vtrace_loss_grad",
                operand: "values",
                expected: n,
                got: args.values.len(),
            });
        }
        check_len("gaussian_vtrace_loss_grad", "moments", SLOT_STATS, moments.len())?;
        check_len("gaussian_vtrace_loss_grad", "stats", 6, stats.len())?;
        let (stride_i, a_i, n_i, rows_i) =
            (int("stride", stride)?, int("action_dim", a)?, int("n", n)?, int("n_rows", n_rows)?);
        let squash = i32::from(rows.squash);
        let mut launch = stream.launch_builder(&self.gaussian_vtrace_loss_grad);
        launch
            .arg(&rows.heads)
            .arg(&stride_i)
            .arg(&a_i)
            .arg(&rows.log_std)
            .arg(&rows.actions)
            .arg(&squash)
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
            .arg(d_log_std_rows)
            .arg(stats);
        // SAFETY: the argument list matches gaussian_vtrace_loss_grad's parameters; heads and
        // d_heads hold n_rows rows of stride floats, actions and d_log_std n·a_dim floats, the
        // per-sample inputs n floats (read only for rows < n), log_std a_dim floats (checked);
        // moments and stats are disjoint parts of one slot (split_at_mut) of 3 and 6 doubles.
        unsafe { launch.launch(grid(n_rows)) }?;
        Ok(())
    }

    /// The fused Gaussian PPO loss rows over `n` samples, with per-row log-std gradients.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn gaussian_ppo_loss_grad(
        &self,
        stream: &Arc<CudaStream>,
        rows: &GaussianRows<'_>,
        args: &GaussianPpoArgs<'_>,
        moments: &mut CudaViewMut<'_, f64>,
        d_heads: &mut CudaViewMut<'_, f32>,
        d_log_std_rows: &mut CudaViewMut<'_, f32>,
        stats: &mut CudaViewMut<'_, f64>,
    ) -> Result<(), BackendError> {
        let n = args.weights.len();
        let a = rows.action_dim;
        let stride = a + 1;
        rows.check("gaussian_ppo_loss_grad", n, n)?;
        check_len("gaussian_ppo_loss_grad", "d_heads", n * stride, d_heads.len())?;
        check_len("gaussian_ppo_loss_grad", "d_log_std_rows", n * a, d_log_std_rows.len())?;
        for (operand, len) in [
            ("values", args.values.len()),
            ("advantages", args.advantages.len()),
            ("returns", args.returns.len()),
            ("prox_log_probs", args.prox_log_probs.len()),
            ("is_weights", args.is_weights.len()),
        ] {
            check_len("gaussian_ppo_loss_grad", operand, n, len)?;
        }
        check_len("gaussian_ppo_loss_grad", "moments", SLOT_STATS, moments.len())?;
        check_len("gaussian_ppo_loss_grad", "stats", 6, stats.len())?;
        let (stride_i, a_i, n_i) = (int("stride", stride)?, int("action_dim", a)?, int("n", n)?);
        let (squash, normalize) = (i32::from(rows.squash), i32::from(args.normalize));
        let mut launch = stream.launch_builder(&self.gaussian_ppo_loss_grad);
        launch
            .arg(&rows.heads)
            .arg(&stride_i)
            .arg(&a_i)
            .arg(&rows.log_std)
            .arg(&rows.actions)
            .arg(&squash)
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
            .arg(d_log_std_rows)
            .arg(stats);
        // SAFETY: the argument list matches gaussian_ppo_loss_grad's parameters; heads and
        // d_heads hold n rows of stride floats, actions and d_log_std n·a_dim floats, log_std
        // a_dim floats and every per-sample input n floats (checked); moments and stats are
        // disjoint parts of one slot.
        unsafe { launch.launch(grid(n)) }?;
        Ok(())
    }
}
