//! The timings the CUDA backend reports to the benchmarks, as plain values: defined without
//! `cudarc`, so the stand-in backend of builds without the `cuda` feature shares them.

/// Device time of the last update, from CUDA events (only when profiling is on).
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct DeviceTiming {
    /// Host-to-device copy of the packed batch, milliseconds.
    pub h2d_ms: f32,
    /// Kernels and products of the update, milliseconds.
    pub compute_ms: f32,
    /// Device-to-host copy of the statistics, milliseconds.
    pub d2h_ms: f32,
}

/// One timed kernel measurement for the benchmarks: median milliseconds per launch and the
/// bytes each launch must move at least.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct KernelTiming {
    /// Median milliseconds per launch.
    pub ms: f32,
    /// Bytes read plus written per launch.
    pub bytes: u64,
}

impl KernelTiming {
    /// Achieved bandwidth in GB/s (10⁹ bytes per second).
    pub fn gbps(&self) -> f64 {
        self.bytes as f64 / (f64::from(self.ms) * 1e-3) / 1e9
    }
}
