//! The stand-in for the CUDA backend in builds without the `cuda` feature (CUDA is a feature
//! that builds anywhere and falls back loudly): the same names, so call sites need no `#[cfg]`,
//! and [`open_cuda`] reports [`BackendError::CudaNotCompiled`]. The types are uninhabited: no
//! value of them can exist, so every method is unreachable by construction. The `Backend`
//! implementation is generated from the trait's own list of operations
//! (`backend::backend_operations`), so it never needs editing when an operation changes.

use std::convert::Infallible;

#[path = "timing.rs"]
mod timing;
pub use timing::{DeviceTiming, KernelTiming};

use super::ops::{
    BehaviourWeights, ClipAdamStep, Col2im, CopyColumns, DenseForward, GaeScan, GatherColumns, GruCarryGrad,
    GruCellBackward, GruCellForward, GruResetCopy, Im2col, Im2colU8, LogProbs, MatmulDw, MatmulDx, TakeColumn, WidenU8,
};
use super::{
    backend_operations, Backend, BackendError, Evaluation, OffPolicyViews, PpoLoss, VTraceLoss, View, ViewMut,
};
use crate::telemetry::OffPolicySums;
use volley_policy::Activation;

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

/// Implements each operation [`backend_operations`] lists as unreachable: `self` is uninhabited.
/// A checked operation's entry point is the trait's own; only its `_unchecked` half is here.
macro_rules! unreachable_operations {
    (
        plain { $($(#[$meta:meta])* fn $name:ident(&mut self $(, $param:ident: $ty:ty)* $(,)?) -> $ret:ty;)* }
        checked {
            $($(#[$checked_meta:meta])*
            fn $checked:ident(&mut self $(, $checked_param:ident: $checked_ty:ty)* $(,)?) -> $checked_ret:ty
                => $unchecked:ident after $check:expr;)*
        }
    ) => {
        $(fn $name(&mut self $(, _: $ty)*) -> $ret {
            match *self {}
        })*
        $(fn $unchecked(&mut self $(, _: $checked_ty)*) -> $checked_ret {
            match *self {}
        })*
    };
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

    fn indices_len(_buffer: &Self::Indices) -> usize {
        match *_buffer {}
    }

    backend_operations!(unreachable_operations);
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
