//! Where the learner's update runs: the CPU backend (the default everywhere, and what CI tests)
//! or the CUDA backend (cuBLAS products plus our own NVRTC-compiled kernels, with parameters,
//! optimiser state and activations resident on the GPU).
//!
//! `cudarc` is built with dynamic loading, so nothing here links against CUDA: the workspace
//! builds and tests on machines without it. [`open_cuda`] first asks, without panicking,
//! whether the driver, NVRTC and cuBLAS libraries can be loaded, then whether a device works;
//! [`BackendKind::Auto`] falls back to the CPU with one warning when any of that fails, and
//! [`BackendKind::Cuda`] turns it into an error.

pub mod cuda;
pub mod kernels;

use std::fmt;
use std::str::FromStr;

pub use cuda::{CudaDevice, DeviceTiming, KernelTiming};

/// Which backend the user asked for (`--backend`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum BackendKind {
    /// CUDA when a device works, else the CPU with a warning.
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

/// Why the CUDA backend cannot be used.
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
    #[error("kernels: {0}")]
    Kernels(#[from] kernels::KernelError),
    /// A CUDA library panicked while starting (caught).
    #[error("CUDA start-up panicked: {0}")]
    Panicked(String),
}

impl From<cudarc::driver::DriverError> for BackendError {
    fn from(err: cudarc::driver::DriverError) -> Self {
        BackendError::Driver(err.to_string())
    }
}

impl From<cudarc::cublas::result::CublasError> for BackendError {
    fn from(err: cudarc::cublas::result::CublasError) -> Self {
        BackendError::Cublas(err.to_string())
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
    match std::panic::catch_unwind(|| CudaDevice::open(ordinal)) {
        Ok(result) => result,
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn backend_kinds_parse_and_print() {
        for kind in [BackendKind::Auto, BackendKind::Cpu, BackendKind::Cuda] {
            assert_eq!(kind.to_string().parse::<BackendKind>(), Ok(kind));
        }
        assert!("gpu".parse::<BackendKind>().unwrap_err().contains("auto, cpu or cuda"));
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
