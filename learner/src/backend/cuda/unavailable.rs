//! The stand-in for the CUDA backend in builds without the `cuda` feature (CUDA is a feature
//! that builds anywhere and falls back loudly): the same names, so call sites need no `#[cfg]`,
//! and [`open_cuda`] reports [`BackendError::CudaNotCompiled`]. The types are uninhabited: no
//! value of them can exist, so every method is unreachable by construction.

use std::convert::Infallible;

use super::{
    Backend, BackendError, Evaluation, Head, OffPolicyViews, PpoLossInputs, PpoLossOutputs, VTraceLossInputs,
    VTraceLossOutputs, View, ViewMut,
};
use crate::losses::{PpoLossConfig, VTraceLossConfig};
use crate::optim::AdamConfig;
use crate::telemetry::OffPolicySums;
use volley_policy::{Activation, ConvGeometry};

/// A CUDA device (none can exist in this build).
#[derive(Debug, Clone)]
pub enum CudaDevice {}

impl CudaDevice {
    /// The device's name, architecture and ordinal.
    pub fn description(&self) -> &str {
        match *self {}
    }

    /// Time the V-trace reverse scan alone (see the CUDA build).
    pub fn time_vtrace_scan(&self, _t_len: usize, _b_len: usize, _reps: usize) -> Result<KernelTiming, BackendError> {
        match *self {}
    }

    /// Time a device-to-device copy (see the CUDA build).
    pub fn time_copy(&self, _bytes: usize, _reps: usize) -> Result<KernelTiming, BackendError> {
        match *self {}
    }
}

/// Always [`BackendError::CudaNotCompiled`] in this build.
pub fn open_cuda(_ordinal: usize) -> Result<CudaDevice, BackendError> {
    Err(BackendError::CudaNotCompiled)
}

/// Device time of the last update (see the CUDA build).
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct DeviceTiming {
    /// Host-to-device copy of the packed batch, milliseconds.
    pub h2d_ms: f32,
    /// Kernels and products of the update, milliseconds.
    pub compute_ms: f32,
    /// Device-to-host copy of the statistics, milliseconds.
    pub d2h_ms: f32,
}

/// One timed kernel measurement (see the CUDA build).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct KernelTiming {
    /// Median milliseconds per launch.
    pub ms: f32,
    /// Bytes read plus written per launch.
    pub bytes: u64,
}

impl KernelTiming {
    /// Achieved bandwidth in GB/s.
    pub fn gbps(&self) -> f64 {
        self.bytes as f64 / (f64::from(self.ms) * 1e-3) / 1e9
    }
}

/// The CUDA backend (none can exist in this build).
#[derive(Debug)]
pub enum CudaBackend {}

impl CudaBackend {
    /// A backend on an opened device.
    pub fn new(device: &CudaDevice) -> Result<Self, BackendError> {
        match *device {}
    }

    /// Time every update with CUDA events.
    pub fn set_profiling(&mut self, _on: bool) -> Result<(), BackendError> {
        match *self {}
    }

    /// Device timings of the last update.
    pub fn last_timing(&self) -> Option<DeviceTiming> {
        match *self {}
    }
}

impl Backend for CudaBackend {
    type Floats = Infallible;
    type Indices = Infallible;
    type StepCount = Infallible;

    fn description(&self) -> String {
        match *self {}
    }

    fn len(_buffer: &Self::Floats) -> usize {
        match *_buffer {}
    }

    fn alloc(&mut self, _len: usize) -> Result<Self::Floats, BackendError> {
        match *self {}
    }

    fn upload_indices(&mut self, _indices: &[u32], _dst: &mut Option<Self::Indices>) -> Result<(), BackendError> {
        match *self {}
    }

    fn upload(&mut self, _host: &[f32], _dst: ViewMut<'_, Self>) -> Result<(), BackendError> {
        match *self {}
    }

    fn upload_packed(
        &mut self,
        _len: usize,
        _pack: &mut dyn FnMut(&mut [f32]),
        _dst: &mut Self::Floats,
    ) -> Result<(), BackendError> {
        match *self {}
    }

    fn download(&mut self, _src: View<'_, Self>, _host: &mut [f32]) -> Result<(), BackendError> {
        match *self {}
    }

    fn fill(&mut self, _x: ViewMut<'_, Self>, _value: f32) -> Result<(), BackendError> {
        match *self {}
    }

    fn copy(&mut self, _src: View<'_, Self>, _dst: ViewMut<'_, Self>) -> Result<(), BackendError> {
        match *self {}
    }

    fn dense_forward(
        &mut self,
        _x: View<'_, Self>,
        _rows: usize,
        _n_in: usize,
        _weight: View<'_, Self>,
        _bias: View<'_, Self>,
        _n_out: usize,
        _act: Option<Activation>,
        _y: ViewMut<'_, Self>,
    ) -> Result<(), BackendError> {
        match *self {}
    }

    fn act_backward(
        &mut self,
        _dy: ViewMut<'_, Self>,
        _y: View<'_, Self>,
        _act: Activation,
    ) -> Result<(), BackendError> {
        match *self {}
    }

    fn matmul_dw(
        &mut self,
        _dy: View<'_, Self>,
        _x: View<'_, Self>,
        _rows: usize,
        _n_out: usize,
        _n_in: usize,
        _dw: ViewMut<'_, Self>,
    ) -> Result<(), BackendError> {
        match *self {}
    }

    fn matmul_dx(
        &mut self,
        _dy: View<'_, Self>,
        _rows: usize,
        _n_out: usize,
        _weight: View<'_, Self>,
        _n_in: usize,
        _dx: ViewMut<'_, Self>,
        _accumulate: bool,
    ) -> Result<(), BackendError> {
        match *self {}
    }

    fn column_sums(&mut self, _dy: View<'_, Self>, _rows: usize, _out: ViewMut<'_, Self>) -> Result<(), BackendError> {
        match *self {}
    }

    fn im2col(
        &mut self,
        _x: View<'_, Self>,
        _n: usize,
        _geometry: &ConvGeometry,
        _cols: ViewMut<'_, Self>,
    ) -> Result<(), BackendError> {
        match *self {}
    }

    fn col2im(
        &mut self,
        _d_cols: View<'_, Self>,
        _n: usize,
        _geometry: &ConvGeometry,
        _dx: ViewMut<'_, Self>,
    ) -> Result<(), BackendError> {
        match *self {}
    }

    fn take_column(
        &mut self,
        _src: View<'_, Self>,
        _rows: usize,
        _width: usize,
        _column: usize,
        _dst: ViewMut<'_, Self>,
    ) -> Result<(), BackendError> {
        match *self {}
    }

    fn gru_reset_copy(
        &mut self,
        _src: View<'_, Self>,
        _starts: View<'_, Self>,
        _hidden: usize,
        _dst: ViewMut<'_, Self>,
    ) -> Result<(), BackendError> {
        match *self {}
    }

    fn gru_cell_forward(
        &mut self,
        _gi: View<'_, Self>,
        _gh: View<'_, Self>,
        _h_prev: View<'_, Self>,
        _hidden: usize,
        _gates: ViewMut<'_, Self>,
        _h_out: ViewMut<'_, Self>,
    ) -> Result<(), BackendError> {
        match *self {}
    }

    fn gru_cell_backward(
        &mut self,
        _d_h: ViewMut<'_, Self>,
        _gates: View<'_, Self>,
        _gh: View<'_, Self>,
        _h_prev: View<'_, Self>,
        _hidden: usize,
        _d_gi: ViewMut<'_, Self>,
        _d_gh: ViewMut<'_, Self>,
    ) -> Result<(), BackendError> {
        match *self {}
    }

    fn gru_carry_grad(
        &mut self,
        _d_h: ViewMut<'_, Self>,
        _starts_next: Option<View<'_, Self>>,
        _from_heads: View<'_, Self>,
        _hidden: usize,
    ) -> Result<(), BackendError> {
        match *self {}
    }

    fn log_probs(
        &mut self,
        _heads: View<'_, Self>,
        _n_actions: usize,
        _head: &Head<'_, Self>,
        _actions: View<'_, Self>,
        _reference: Option<View<'_, Self>>,
        _out: ViewMut<'_, Self>,
    ) -> Result<(), BackendError> {
        match *self {}
    }

    fn behaviour_weights(
        &mut self,
        _prox_log_probs: View<'_, Self>,
        _behaviour_log_probs: View<'_, Self>,
        _clip: f32,
        _out: ViewMut<'_, Self>,
    ) -> Result<(), BackendError> {
        match *self {}
    }

    fn gae_scan(
        &mut self,
        _t_len: usize,
        _b_len: usize,
        _discounts: View<'_, Self>,
        _rewards: View<'_, Self>,
        _values: View<'_, Self>,
        _bootstrap_value: View<'_, Self>,
        _lambda_: f32,
        _advantage_override: Option<View<'_, Self>>,
        _advantages: ViewMut<'_, Self>,
        _returns: ViewMut<'_, Self>,
    ) -> Result<(), BackendError> {
        match *self {}
    }

    fn begin_evaluations(&mut self, _n_evaluations: usize) -> Result<(), BackendError> {
        match *self {}
    }

    fn vtrace_loss(
        &mut self,
        _inputs: &VTraceLossInputs<'_, Self>,
        _config: &VTraceLossConfig,
        _outputs: VTraceLossOutputs<'_, Self>,
        _slot: usize,
    ) -> Result<(), BackendError> {
        match *self {}
    }

    fn ppo_loss(
        &mut self,
        _inputs: &PpoLossInputs<'_, Self>,
        _config: &PpoLossConfig,
        _outputs: PpoLossOutputs<'_, Self>,
        _slot: usize,
    ) -> Result<(), BackendError> {
        match *self {}
    }

    fn gather_columns(
        &mut self,
        _src: View<'_, Self>,
        _rows: usize,
        _b_len: usize,
        _width: usize,
        _columns: &Self::Indices,
        _columns_offset: usize,
        _n_columns: usize,
        _dst: ViewMut<'_, Self>,
    ) -> Result<(), BackendError> {
        match *self {}
    }

    fn step_count(&mut self, _t: u64) -> Result<Self::StepCount, BackendError> {
        match *self {}
    }

    fn read_step_count(&mut self, _step: &Self::StepCount) -> Result<u64, BackendError> {
        match *self {}
    }

    fn clip_adam_step(
        &mut self,
        _params: ViewMut<'_, Self>,
        _grads: ViewMut<'_, Self>,
        _adam_m: ViewMut<'_, Self>,
        _adam_v: ViewMut<'_, Self>,
        _step: &mut Self::StepCount,
        _config: &AdamConfig,
        _learning_rate: f32,
        _max_grad_norm: f32,
        _slot: usize,
    ) -> Result<(), BackendError> {
        match *self {}
    }

    fn off_policy_sums(
        &mut self,
        _inputs: &OffPolicyViews<'_, Self>,
        _ratios: ViewMut<'_, Self>,
    ) -> Result<(), BackendError> {
        match *self {}
    }

    fn read_evaluations(
        &mut self,
        _out: &mut Vec<Evaluation>,
        _off_policy: &mut OffPolicySums,
    ) -> Result<(), BackendError> {
        match *self {}
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn without_the_cuda_feature_opening_cuda_says_it_was_not_compiled_in() {
        let err = open_cuda(0).expect_err("no CUDA in this build");
        assert!(matches!(err, BackendError::CudaNotCompiled), "{err}");
        assert!(err.to_string().contains("feature `cuda`"), "{err}");
    }
}
