//! The CUDA backend: [`Backend`] on one GPU.
//!
//! - `device`: the context, streams, cuBLAS handle and the matrix products.
//! - [`kernels`]: the `.cu` sources in `learner/kernels/`, their NVRTC compilation and one safe
//!   launcher per kernel.
//! - [`profile`]: event timings for the benchmarks.
//!
//! Parameters, gradients, Adam's moments and step count, activations and loss intermediates
//! live in device memory for the learner's lifetime (the generic [`crate::train::Trainer`] owns
//! them as [`CudaSlice`]s). An update uploads one packed batch (page-locked host memory, one
//! asynchronous copy on the copy stream that the compute stream waits for through an event) and
//! reads back only the statistics; the clipping decision, Adam's step count and its bias
//! corrections stay on the device, so a gradient step needs no host round trip. Weights come
//! back to the host only when the learner publishes or checkpoints them.

#[cfg(test)]
mod conv_tests;
pub(crate) mod device;
pub mod kernels;
pub mod profile;
#[cfg(test)]
mod tests;
pub mod timing;

use std::sync::Arc;

use cudarc::driver::{CudaEvent, CudaSlice, CudaView, CudaViewMut, PinnedHostSlice};
use volley_policy::Activation;

use self::device::{Gpu, Product};
use self::kernels::{
    HeadArgs, LossGradOutputs, LossRows, PpoLossGradArgs, VTraceLossGradArgs, VTraceScanArgs, ACT_IDENTITY, ACT_RELU,
    ACT_TANH, SLOT, SLOT_STATS, SLOT_SUMSQ,
};
use self::profile::{Mark, Profile};
pub use self::timing::{DeviceTiming, KernelTiming};
use super::ops::{
    BehaviourWeights, ClipAdamStep, Col2im, ConvMap, CopyColumns, DenseForward, GaeScan, GatherColumns, GruCarryGrad,
    GruCellBackward, GruCellForward, GruResetCopy, Im2col, Im2colU8, LogProbs, MatmulDw, MatmulDx, TakeColumn, WidenU8,
};
use super::{Backend, BackendError, Evaluation, Head, OffPolicyViews, PpoLoss, VTraceLoss, View, ViewMut};
use crate::losses::WeightedSums;
use crate::telemetry::{OffPolicySums, OFF_POLICY_SUMS};

/// A CUDA device with the learner's kernels compiled and loaded, and a cuBLAS handle.
#[derive(Clone)]
pub struct CudaDevice {
    gpu: Arc<Gpu>,
}

impl std::fmt::Debug for CudaDevice {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CudaDevice").field("description", &self.description()).finish()
    }
}

impl CudaDevice {
    /// The device's name, architecture and ordinal.
    pub fn description(&self) -> &str {
        &self.gpu.description
    }
}

/// Open CUDA device `ordinal` and compile the kernels for it, or say why not. Never panics on a
/// machine without CUDA.
pub fn open_cuda(ordinal: usize) -> Result<CudaDevice, BackendError> {
    // SAFETY: each probe only tries to dlopen the library's candidate names.
    let present = unsafe {
        [
            (cudarc::driver::sys::is_culib_present(), "driver", "libcuda.so", ": is the NVIDIA driver installed?"),
            (
                cudarc::nvrtc::sys::is_culib_present(),
                "NVRTC",
                "libnvrtc.so",
                ": install the CUDA runtime libraries (the learner image has them)",
            ),
            (
                cudarc::cublas::sys::is_culib_present(),
                "cuBLAS",
                "libcublas.so",
                ": install the CUDA runtime libraries (the learner image has them)",
            ),
        ]
    };
    for (ok, what, file, hint) in present {
        if !ok {
            return Err(BackendError::LibraryMissing { what, file, hint });
        }
    }
    // The libraries loaded, so cudarc will not panic for want of them; catch anything else
    // rather than take the process down.
    match std::panic::catch_unwind(|| Gpu::open(ordinal)) {
        Ok(result) => result.map(|gpu| CudaDevice { gpu: Arc::new(gpu) }),
        Err(panic) => {
            let message = panic
                .downcast_ref::<String>()
                .cloned()
                .or_else(|| panic.downcast_ref::<&str>().map(|s| s.to_string()))
                .unwrap_or_else(|| "unknown panic".into());
            Err(BackendError::Panicked(message))
        }
    }
}

/// The CUDA backend on one device (see the module documentation).
pub struct CudaBackend {
    gpu: Arc<Gpu>,
    /// Ones for column sums through a product; `ones_filled` of them hold 1.0.
    ones: CudaSlice<f32>,
    ones_filled: usize,
    /// `SLOT` doubles per loss evaluation of the current update (see [`kernels::SLOT`]).
    evaluation_sums: CudaSlice<f64>,
    /// The pre-clip gradient norm of each evaluation of the current update.
    grad_norms: CudaSlice<f32>,
    n_evaluations: usize,
    /// The update's off-policy sums (`OffPolicySums` in field order).
    off_policy_sums: CudaSlice<f64>,
    /// Adam's per-step coefficients `[clip scale, step size, 1/√(1 − β₂ᵗ), apply]`.
    adam_coeffs: CudaSlice<f32>,
    /// The batch upload: page-locked host buffer, and the event the compute stream waits on.
    host_stage: Option<PinnedHostSlice<f32>>,
    uploaded: CudaEvent,
    // Host scratch for the read-back.
    host_sums: Vec<f64>,
    host_norms: Vec<f32>,
    profile: Option<Profile>,
    /// `f32::from(v) · scale` for every byte `v`, on the device, and the bits of its `scale`:
    /// what the byte-reading first layers look values up in (`im2col_u8`, `widen_u8`).
    byte_table: Option<(u32, CudaSlice<f32>)>,
}

impl std::fmt::Debug for CudaBackend {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CudaBackend").field("device", &self.gpu.description).finish()
    }
}

fn view<'a>(view: View<'a, CudaBackend>) -> CudaView<'a, f32> {
    let (buffer, range) = view.parts();
    buffer.slice(range)
}

/// The head arguments of the head kernels for `head` over `n_outputs` outputs per row.
fn head_args<'a>(head: &Head<'a, CudaBackend>, n_outputs: usize) -> HeadArgs<'a> {
    HeadArgs { kind: head.kind, n_outputs, params: view(head.params) }
}

fn view_mut<'a>(view: ViewMut<'a, CudaBackend>) -> CudaViewMut<'a, f32> {
    let (buffer, range) = view.parts();
    buffer.slice_mut(range)
}

/// Record `mark`'s event when profiling.
fn record(profile: &Option<Profile>, gpu: &Gpu, mark: Mark, on_copy_stream: bool) -> Result<(), BackendError> {
    if let Some(profile) = profile {
        let stream = if on_copy_stream { &gpu.copy_stream } else { &gpu.stream };
        profile.event(mark).record(stream)?;
    }
    Ok(())
}

fn activation_code(act: Option<Activation>) -> i32 {
    match act {
        None => ACT_IDENTITY,
        Some(Activation::Tanh) => ACT_TANH,
        Some(Activation::Relu) => ACT_RELU,
    }
}

impl CudaBackend {
    /// A backend on an opened device.
    pub fn new(device: &CudaDevice) -> Result<Self, BackendError> {
        let gpu = device.gpu.clone();
        let stream = &gpu.stream;
        let backend = CudaBackend {
            ones: stream.alloc_zeros(1)?,
            ones_filled: 0,
            evaluation_sums: stream.alloc_zeros(SLOT)?,
            grad_norms: stream.alloc_zeros(1)?,
            n_evaluations: 0,
            off_policy_sums: stream.alloc_zeros(OFF_POLICY_SUMS)?,
            adam_coeffs: stream.alloc_zeros(4)?,
            host_stage: None,
            uploaded: gpu.ctx.new_event(None)?,
            host_sums: Vec::new(),
            host_norms: Vec::new(),
            profile: None,
            byte_table: None,
            gpu,
        };
        backend.gpu.stream.synchronize()?;
        Ok(backend)
    }

    /// Time every update with CUDA events from now on (or stop); see [`Self::last_timing`].
    pub fn set_profiling(&mut self, on: bool) -> Result<(), BackendError> {
        self.profile = if on { Some(Profile::new(&self.gpu)?) } else { None };
        Ok(())
    }

    /// Device timings of the last update, when profiling.
    pub fn last_timing(&self) -> Option<DeviceTiming> {
        self.profile.as_ref().and_then(Profile::last)
    }

    fn mark(&self, mark: Mark, on_copy_stream: bool) -> Result<(), BackendError> {
        record(&self.profile, &self.gpu, mark, on_copy_stream)
    }

    /// The device table of `f32::from(v) · scale` for every byte `v`, uploaded when `scale`
    /// changes (once per run: a network has one input scale).
    fn byte_table(&mut self, scale: f32) -> Result<CudaView<'_, f32>, BackendError> {
        if self.byte_table.as_ref().is_none_or(|(bits, _)| *bits != scale.to_bits()) {
            let table = volley_policy::ops::byte_table(scale);
            self.byte_table = Some((scale.to_bits(), self.gpu.stream.clone_htod(&table)?));
        }
        let (_, table) = self.byte_table.as_ref().expect("set above");
        Ok(table.slice(..))
    }

    /// At least `rows` ones, for column sums.
    fn ones(&mut self, rows: usize) -> Result<CudaView<'_, f32>, BackendError> {
        if self.ones.len() < rows {
            self.ones = self.gpu.stream.alloc_zeros(rows)?;
            self.ones_filled = 0;
        }
        if self.ones_filled < rows {
            let len = self.ones.len();
            self.gpu.kernels.fill(&mut self.ones.slice_mut(..len), 1.0)?;
            self.ones_filled = len;
        }
        Ok(self.ones.slice(..rows))
    }

    /// The moments (`[0..3]`), loss sums (`[3..9]`) and `Σ g²` (`[9]`) of evaluation `slot`.
    fn slot(&mut self, slot: usize) -> Result<CudaViewMut<'_, f64>, BackendError> {
        if slot >= self.n_evaluations {
            return Err(BackendError::Shape {
                op: "evaluation",
                operand: "slot",
                expected: self.n_evaluations,
                got: slot,
            });
        }
        Ok(self.evaluation_sums.slice_mut(slot * SLOT..(slot + 1) * SLOT))
    }
}

impl Backend for CudaBackend {
    type Floats = CudaSlice<f32>;
    type Indices = CudaSlice<u32>;
    type StepCount = CudaSlice<f64>;

    fn description(&self) -> String {
        format!("cuda: {}", self.gpu.description)
    }

    fn len(buffer: &CudaSlice<f32>) -> usize {
        buffer.len()
    }

    fn indices_len(buffer: &CudaSlice<u32>) -> usize {
        buffer.len()
    }

    fn alloc(&mut self, len: usize) -> Result<CudaSlice<f32>, BackendError> {
        Ok(self.gpu.stream.alloc_zeros::<f32>(len.max(1))?)
    }

    fn upload_indices(&mut self, indices: &[u32], dst: &mut Option<CudaSlice<u32>>) -> Result<(), BackendError> {
        let n = indices.len();
        if dst.as_ref().is_none_or(|d| d.len() < n.max(1)) {
            *dst = Some(self.gpu.stream.alloc_zeros::<u32>(n.max(1))?);
        }
        let dst = dst.as_mut().expect("allocated above");
        self.gpu.stream.memcpy_htod(indices, &mut dst.slice_mut(..n))?;
        Ok(())
    }

    fn upload_unchecked(&mut self, host: &[f32], dst: ViewMut<'_, Self>) -> Result<(), BackendError> {
        self.gpu.stream.memcpy_htod(host, &mut view_mut(dst))?;
        Ok(())
    }

    fn upload_packed(
        &mut self,
        len: usize,
        pack: &mut dyn FnMut(&mut [f32]),
        dst: &mut CudaSlice<f32>,
    ) -> Result<(), BackendError> {
        // Both buffers only grow: the learner alternates between batch sizes (an update's batch,
        // selection's batch of new segments), and page-locked allocations are slow.
        if self.host_stage.as_ref().is_none_or(|h| h.len() < len) {
            // SAFETY: page-locked memory of plain f32s, zeroed below before any word is read.
            let mut host = unsafe { self.gpu.ctx.alloc_pinned::<f32>(len.max(1)) }?;
            let (words, ptr) = (host.len(), host.as_mut_ptr()?);
            // SAFETY: `ptr` addresses the `words` f32s just allocated, which nothing else uses yet;
            // all-zero bytes are a valid f32 (0.0).
            unsafe { std::ptr::write_bytes(ptr, 0, words) };
            self.host_stage = Some(host);
        }
        let host_len = self.host_stage.as_ref().map_or(0, PinnedHostSlice::len);
        if dst.len() < host_len {
            *dst = self.gpu.stream.alloc_zeros::<f32>(host_len)?;
            // The copy stream must not touch the buffer before its stream-ordered allocation.
            self.gpu.stream.synchronize()?;
        }
        let host = self.host_stage.as_mut().expect("allocated above");
        // Waits for the previous copy out of this buffer to finish before handing it out.
        let words = host.as_mut_slice()?;
        pack(&mut words[..len]);
        // The device buffer is free: every update ends with a blocking read-back, so no kernel
        // still reads the previous batch.
        record(&self.profile, &self.gpu, Mark::UploadStart, true)?;
        self.gpu.copy_stream.memcpy_htod(&*host, &mut dst.slice_mut(..host_len))?;
        record(&self.profile, &self.gpu, Mark::UploadEnd, true)?;
        self.uploaded.record(&self.gpu.copy_stream)?;
        self.gpu.stream.wait(&self.uploaded)?;
        self.mark(Mark::ComputeStart, false)
    }

    fn download_unchecked(&mut self, src: View<'_, Self>, host: &mut [f32]) -> Result<(), BackendError> {
        self.gpu.stream.memcpy_dtoh(&view(src), host)?;
        self.gpu.stream.synchronize()?;
        Ok(())
    }

    fn fill(&mut self, x: ViewMut<'_, Self>, value: f32) -> Result<(), BackendError> {
        self.gpu.kernels.fill(&mut view_mut(x), value)
    }

    fn copy_unchecked(&mut self, src: View<'_, Self>, dst: ViewMut<'_, Self>) -> Result<(), BackendError> {
        self.gpu.stream.memcpy_dtod(&view(src), &mut view_mut(dst))?;
        Ok(())
    }

    fn dense_forward_unchecked(&mut self, op: DenseForward<'_, Self>) -> Result<(), BackendError> {
        let gpu = &self.gpu;
        let mut y = view_mut(op.y);
        // `y[rows×n_out] = x[rows×n_in] · Wᵀ`, `W: [n_out×n_in]`.
        gpu.product(
            Product::new(op.rows, op.n_out, op.n_in).b_transposed(),
            &view(op.x),
            &view(op.weight),
            0.0,
            &mut y,
        )?;
        gpu.kernels.bias_act_fwd(&mut y, &view(op.bias), op.rows, activation_code(op.act))
    }

    fn act_backward_unchecked(
        &mut self,
        dy: ViewMut<'_, Self>,
        y: View<'_, Self>,
        act: Activation,
    ) -> Result<(), BackendError> {
        self.gpu.kernels.act_bwd(&mut view_mut(dy), &view(y), activation_code(Some(act)))
    }

    fn matmul_dw_unchecked(&mut self, op: MatmulDw<'_, Self>) -> Result<(), BackendError> {
        // `dW[n_out×n_in] = dYᵀ · X` over `rows` rows (overwrites).
        let product = Product::new(op.n_out, op.n_in, op.rows).a_transposed();
        self.gpu.product(product, &view(op.dy), &view(op.x), 0.0, &mut view_mut(op.dw))
    }

    fn matmul_dx_unchecked(&mut self, op: MatmulDx<'_, Self>) -> Result<(), BackendError> {
        let beta = if op.accumulate { 1.0 } else { 0.0 };
        let (dy, weight) = (view(op.dy), view(op.weight));
        // `dX[rows×n_in] = dY[rows×n_out] · W` (`+ dX`).
        self.gpu.product(Product::new(op.rows, op.n_in, op.n_out), &dy, &weight, beta, &mut view_mut(op.dx))
    }

    fn column_sums_unchecked(
        &mut self,
        dy: View<'_, Self>,
        rows: usize,
        out: ViewMut<'_, Self>,
    ) -> Result<(), BackendError> {
        let gpu = self.gpu.clone();
        let ones = self.ones(rows)?;
        gpu.column_sums(&view(dy), rows, &ones, &mut view_mut(out))
    }

    fn im2col_unchecked(&mut self, op: Im2col<'_, Self>) -> Result<(), BackendError> {
        self.gpu.kernels.conv_map(ConvMap::Unfold, &view(op.x), op.n, op.geometry, &mut view_mut(op.cols))
    }

    fn im2col_u8_unchecked(&mut self, op: Im2colU8<'_, Self>) -> Result<(), BackendError> {
        let gpu = self.gpu.clone();
        let table = self.byte_table(op.scale)?;
        gpu.kernels.im2col_u8(&view(op.x), op.n, op.geometry, &table, &mut view_mut(op.cols))
    }

    fn widen_u8_unchecked(&mut self, op: WidenU8<'_, Self>) -> Result<(), BackendError> {
        let gpu = self.gpu.clone();
        let table = self.byte_table(op.scale)?;
        gpu.kernels.widen_u8(&view(op.x), op.rows, op.width, &table, &mut view_mut(op.out))
    }

    fn col2im_unchecked(&mut self, op: Col2im<'_, Self>) -> Result<(), BackendError> {
        self.gpu.kernels.conv_map(ConvMap::Fold, &view(op.d_cols), op.n, op.geometry, &mut view_mut(op.dx))
    }

    fn take_column_unchecked(&mut self, op: TakeColumn<'_, Self>) -> Result<(), BackendError> {
        self.gpu.kernels.take_column(&view(op.src), op.width, op.column, &mut view_mut(op.dst))
    }

    fn copy_columns_unchecked(&mut self, op: CopyColumns<'_, Self>) -> Result<(), BackendError> {
        let (src, widths) = (view(op.src), (op.src_width, op.dst_width));
        let (columns, at) = ((op.src_column, op.dst_column), op.columns);
        self.gpu.kernels.copy_columns(&src, widths, columns, at, op.rows, &mut view_mut(op.dst))
    }

    fn gru_reset_copy_unchecked(&mut self, op: GruResetCopy<'_, Self>) -> Result<(), BackendError> {
        let (src, starts) = (view(op.src), view(op.starts));
        self.gpu.kernels.gru_reset_copy(&src, &starts, op.hidden, &mut view_mut(op.dst))
    }

    fn gru_cell_forward_unchecked(&mut self, op: GruCellForward<'_, Self>) -> Result<(), BackendError> {
        let (gi, gh, h_prev) = (view(op.gi), view(op.gh), view(op.h_prev));
        let (mut gates, mut h_out) = (view_mut(op.gates), view_mut(op.h_out));
        self.gpu.kernels.gru_cell_fwd(&gi, &gh, &h_prev, op.hidden, &mut gates, &mut h_out)
    }

    fn gru_cell_backward_unchecked(&mut self, op: GruCellBackward<'_, Self>) -> Result<(), BackendError> {
        let (gates, gh, h_prev) = (view(op.gates), view(op.gh), view(op.h_prev));
        let (mut d_h, mut d_gi, mut d_gh) = (view_mut(op.d_h), view_mut(op.d_gi), view_mut(op.d_gh));
        self.gpu.kernels.gru_cell_bwd(&mut d_h, &gates, &gh, &h_prev, op.hidden, &mut d_gi, &mut d_gh)
    }

    fn gru_carry_grad_unchecked(&mut self, op: GruCarryGrad<'_, Self>) -> Result<(), BackendError> {
        let (starts, from_heads) = (op.starts_next.map(view), view(op.from_heads));
        self.gpu.kernels.gru_carry_grad(&mut view_mut(op.d_h), starts.as_ref(), &from_heads, op.hidden)
    }

    fn log_probs_unchecked(&mut self, op: LogProbs<'_, Self>) -> Result<(), BackendError> {
        let (heads, actions, reference) = (view(op.heads), view(op.actions), op.reference.map(view));
        let head = head_args(&op.head, op.n_actions);
        self.gpu.kernels.log_probs(&head, &heads, &actions, reference.as_ref(), &mut view_mut(op.out))
    }

    fn behaviour_weights_unchecked(&mut self, op: BehaviourWeights<'_, Self>) -> Result<(), BackendError> {
        let (prox, behaviour) = (view(op.prox_log_probs), view(op.behaviour_log_probs));
        self.gpu.kernels.behaviour_weights(&prox, &behaviour, op.clip, &mut view_mut(op.out))
    }

    fn gae_scan_unchecked(&mut self, op: GaeScan<'_, Self>) -> Result<(), BackendError> {
        let advantage_override = op.advantage_override.map(view);
        self.gpu.kernels.gae_scan(
            op.t_len,
            op.b_len,
            &view(op.discounts),
            &view(op.rewards),
            &view(op.values),
            &view(op.bootstrap_value),
            op.lambda_,
            advantage_override.as_ref(),
            &mut view_mut(op.advantages),
            &mut view_mut(op.returns),
        )
    }

    fn begin_evaluations(&mut self, n_evaluations: usize) -> Result<(), BackendError> {
        let stream = &self.gpu.stream;
        if self.evaluation_sums.len() < n_evaluations * SLOT {
            self.evaluation_sums = stream.alloc_zeros(n_evaluations * SLOT)?;
            self.grad_norms = stream.alloc_zeros(n_evaluations.max(1))?;
        }
        stream.memset_zeros(&mut self.evaluation_sums)?;
        stream.memset_zeros(&mut self.off_policy_sums)?;
        self.n_evaluations = n_evaluations;
        Ok(())
    }

    fn vtrace_loss_unchecked(&mut self, op: VTraceLoss<'_, Self>) -> Result<(), BackendError> {
        let VTraceLoss { inputs, config, outputs, slot } = op;
        let (t_len, b_len) = (inputs.t_len, inputs.b_len);
        let n = t_len * b_len;
        let gpu = self.gpu.clone();
        let head = head_args(&inputs.head, inputs.n_actions);
        let mut log_rhos = view_mut(outputs.log_rhos);
        let mut vs = view_mut(outputs.vs);
        let mut pg_advantages = view_mut(outputs.pg_advantages);
        let values = inputs.values;
        // log ρ over the n sample rows (the bootstrap row has no action).
        let sample_rows = view(inputs.heads.slice(0..n * (inputs.n_actions + 1)));
        let behaviour = view(inputs.behaviour_log_probs);
        gpu.kernels.log_probs(&head, &sample_rows, &view(inputs.actions), Some(&behaviour), &mut log_rhos)?;
        let scan = VTraceScanArgs {
            t_len,
            b_len,
            log_rhos: log_rhos.as_view(),
            discounts: view(inputs.discounts),
            rewards: view(inputs.rewards),
            values: view(values.slice(0..n)),
            bootstrap: view(values.slice(n..n + b_len)),
            config: &config.vtrace,
            advantage_override: inputs.advantage_override.map(view),
        };
        gpu.kernels.vtrace_scan(&scan, &mut vs, &mut pg_advantages)?;
        let mut slot_sums = self.slot(slot)?;
        let (mut moments, mut rest) = slot_sums.split_at_mut(SLOT_STATS);
        let stats = rest.slice_mut(..6);
        let weights = view(inputs.sample_weights);
        gpu.kernels.weighted_sum(&weights, None, &mut moments)?;
        let rows =
            LossRows { head, heads: view(inputs.heads), actions: view(inputs.actions), weights, values: view(values) };
        let (vs, log_rhos, pg_advantages) = (vs.as_view(), log_rhos.as_view(), pg_advantages.as_view());
        let args = VTraceLossGradArgs { rows, vs, log_rhos, pg_advantages, config };
        let (d_heads, d_head_params) = (view_mut(outputs.d_heads), view_mut(outputs.d_head_params));
        gpu.kernels.vtrace_loss_grad(&args, LossGradOutputs { moments, d_heads, d_head_params, stats })
    }

    fn ppo_loss_unchecked(&mut self, op: PpoLoss<'_, Self>) -> Result<(), BackendError> {
        let PpoLoss { inputs, config, outputs, slot } = op;
        let gpu = self.gpu.clone();
        let mut slot_sums = self.slot(slot)?;
        let (mut moments, mut rest) = slot_sums.split_at_mut(SLOT_STATS);
        let stats = rest.slice_mut(..6);
        let weights = view(inputs.sample_weights);
        let advantages = view(inputs.advantages);
        gpu.kernels.weighted_sum(&weights, Some(&advantages), &mut moments)?;
        if config.normalize_advantages {
            gpu.kernels.weighted_var(&weights, &advantages, &mut moments)?;
        }
        let head = head_args(&inputs.head, inputs.n_actions);
        let rows = LossRows {
            head,
            heads: view(inputs.heads),
            actions: view(inputs.actions),
            weights,
            values: view(inputs.values),
        };
        let (returns, prox_log_probs, is_weights) =
            (view(inputs.returns), view(inputs.prox_log_probs), view(inputs.is_weights));
        let args = PpoLossGradArgs { rows, advantages, returns, prox_log_probs, is_weights, config };
        let (d_heads, d_head_params) = (view_mut(outputs.d_heads), view_mut(outputs.d_head_params));
        gpu.kernels.ppo_loss_grad(&args, LossGradOutputs { moments, d_heads, d_head_params, stats })
    }

    fn off_policy_sums_unchecked(
        &mut self,
        inputs: &OffPolicyViews<'_, Self>,
        ratios: ViewMut<'_, Self>,
    ) -> Result<(), BackendError> {
        let gpu = self.gpu.clone();
        let views = [view(inputs.log_rhos), view(inputs.weights), view(inputs.values), view(inputs.value_targets)];
        let reference = inputs.reference.map(view);
        gpu.kernels.off_policy_sums(
            &views,
            reference.as_ref(),
            inputs.rho_bar,
            inputs.c_bar,
            &mut self.off_policy_sums.slice_mut(..),
            &mut view_mut(ratios),
        )
    }

    fn gather_columns_unchecked(&mut self, op: GatherColumns<'_, Self>) -> Result<(), BackendError> {
        let columns = op.columns.slice(op.columns_offset..op.columns_offset + op.n_columns);
        let (src, mut dst) = (view(op.src), view_mut(op.dst));
        let (rows, b_len, width) = (op.rows, op.b_len, op.width);
        self.gpu.kernels.gather_columns(&src, rows, b_len, width, &columns, &mut dst)
    }

    fn step_count(&mut self, t: u64) -> Result<CudaSlice<f64>, BackendError> {
        // Adam's t is a double on the device; exact up to 2^53 steps.
        Ok(self.gpu.stream.clone_htod(&[t as f64])?)
    }

    fn read_step_count(&mut self, step: &CudaSlice<f64>) -> Result<u64, BackendError> {
        let mut t = [0.0f64];
        self.gpu.stream.memcpy_dtoh(step, &mut t)?;
        self.gpu.stream.synchronize()?;
        Ok(t[0] as u64)
    }

    fn clip_adam_step_unchecked(&mut self, op: ClipAdamStep<'_, Self>) -> Result<(), BackendError> {
        let ClipAdamStep { step, config, learning_rate, max_grad_norm, slot, .. } = op;
        let gpu = self.gpu.clone();
        let grads = view_mut(op.grads);
        {
            let mut slot_sums = self.slot(slot)?;
            let mut sumsq = slot_sums.slice_mut(SLOT_SUMSQ..SLOT_SUMSQ + 1);
            gpu.kernels.sum_squares(&grads.as_view(), &mut sumsq)?;
        }
        let sumsq = self.evaluation_sums.slice(slot * SLOT + SLOT_SUMSQ..slot * SLOT + SLOT_SUMSQ + 1);
        gpu.kernels.adam_prepare(
            &sumsq,
            &mut step.slice_mut(..1),
            &mut self.adam_coeffs.slice_mut(..4),
            &mut self.grad_norms.slice_mut(slot..slot + 1),
            learning_rate,
            max_grad_norm,
            config.beta1,
            config.beta2,
        )?;
        gpu.kernels.adam_step(
            &mut view_mut(op.params),
            &grads.as_view(),
            &mut view_mut(op.adam_m),
            &mut view_mut(op.adam_v),
            &self.adam_coeffs.slice(..4),
            config.beta1,
            config.beta2,
            config.eps,
        )
    }

    fn read_evaluations(
        &mut self,
        out: &mut Vec<Evaluation>,
        off_policy: &mut OffPolicySums,
    ) -> Result<(), BackendError> {
        let n = self.n_evaluations;
        self.mark(Mark::ReadbackStart, false)?;
        let mut host_off_policy = [0.0f64; OFF_POLICY_SUMS];
        self.gpu.stream.memcpy_dtoh(&self.off_policy_sums, &mut host_off_policy[..])?;
        self.host_sums.resize(n * SLOT, 0.0);
        self.host_norms.resize(n, 0.0);
        if n > 0 {
            let stream = &self.gpu.stream;
            stream.memcpy_dtoh(&self.evaluation_sums.slice(..n * SLOT), &mut self.host_sums[..])?;
            stream.memcpy_dtoh(&self.grad_norms.slice(..n), &mut self.host_norms[..])?;
        }
        self.mark(Mark::ReadbackEnd, false)?;
        self.gpu.stream.synchronize()?;
        *off_policy = OffPolicySums::from_array(&host_off_policy);
        if let Some(profile) = &mut self.profile {
            profile.finish()?;
        }
        out.clear();
        out.extend(self.host_sums.chunks_exact(SLOT).zip(&self.host_norms).map(|(slot, &grad_norm)| {
            let s = &slot[SLOT_STATS..];
            Evaluation {
                weight_sum: slot[0],
                sums: WeightedSums {
                    policy: s[0],
                    value: s[1],
                    entropy: s[2],
                    ratio: s[3],
                    clipped: s[4],
                    approx_kl: s[5],
                },
                grad_norm,
            }
        }));
        Ok(())
    }
}
