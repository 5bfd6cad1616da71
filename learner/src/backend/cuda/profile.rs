//! Timing helpers for the benchmarks, kept out of the update: CUDA events around an update's
//! upload, compute and read-back (recorded only after [`super::CudaBackend::set_profiling`]),
//! and stand-alone timings of the V-trace scan and of a device-to-device copy (its bandwidth
//! ceiling).

use cudarc::driver::{CudaEvent, CudaSlice};
use volley_policy::returns::VTraceConfig;

use super::device::Gpu;
use super::kernels::VTraceScanArgs;
use super::timing::{DeviceTiming, KernelTiming};
use super::CudaDevice;
use crate::backend::BackendError;

/// Where in an update an event is recorded.
#[derive(Debug, Clone, Copy)]
pub(crate) enum Mark {
    /// Before the batch copy (copy stream).
    UploadStart = 0,
    /// After the batch copy (copy stream).
    UploadEnd = 1,
    /// When the compute stream starts on the batch.
    ComputeStart = 2,
    /// Before the statistics read-back.
    ReadbackStart = 3,
    /// After the statistics read-back.
    ReadbackEnd = 4,
}

/// The events of one update and the last timing they gave.
pub(crate) struct Profile {
    events: [CudaEvent; 5],
    last: Option<DeviceTiming>,
}

impl Profile {
    pub(crate) fn new(gpu: &Gpu) -> Result<Self, BackendError> {
        let timed = || gpu.ctx.new_event(Some(cudarc::driver::sys::CUevent_flags::CU_EVENT_DEFAULT));
        Ok(Profile { events: [timed()?, timed()?, timed()?, timed()?, timed()?], last: None })
    }

    pub(crate) fn event(&self, mark: Mark) -> &CudaEvent {
        &self.events[mark as usize]
    }

    /// Read the five events of an update that has been synchronised.
    pub(crate) fn finish(&mut self) -> Result<(), BackendError> {
        let e = &self.events;
        self.last = Some(DeviceTiming {
            h2d_ms: e[0].elapsed_ms(&e[1])?,
            compute_ms: e[2].elapsed_ms(&e[3])?,
            d2h_ms: e[3].elapsed_ms(&e[4])?,
        });
        Ok(())
    }

    pub(crate) fn last(&self) -> Option<DeviceTiming> {
        self.last
    }
}

fn median(mut xs: Vec<f32>) -> f32 {
    xs.sort_by(f32::total_cmp);
    xs[xs.len() / 2]
}

/// Median event time of `reps` runs of `work` on the compute stream (after one warm-up).
fn time(gpu: &Gpu, reps: usize, mut work: impl FnMut() -> Result<(), BackendError>) -> Result<f32, BackendError> {
    let timed = || gpu.ctx.new_event(Some(cudarc::driver::sys::CUevent_flags::CU_EVENT_DEFAULT));
    let (start, stop) = (timed()?, timed()?);
    work()?;
    let mut times = Vec::with_capacity(reps.max(1));
    for _ in 0..reps.max(1) {
        start.record(&gpu.stream)?;
        work()?;
        stop.record(&gpu.stream)?;
        stop.synchronize()?;
        times.push(start.elapsed_ms(&stop)?);
    }
    Ok(median(times))
}

impl CudaDevice {
    /// Time the V-trace reverse scan alone on a `[t_len][b_len]` batch (fixed pseudo-random
    /// inputs): each launch reads four `[T][B]` inputs and the bootstrap row and writes two
    /// `[T][B]` outputs.
    pub fn time_vtrace_scan(&self, t_len: usize, b_len: usize, reps: usize) -> Result<KernelTiming, BackendError> {
        let gpu = &self.gpu;
        let n = t_len * b_len;
        let inputs: Vec<f32> = (0..n).map(|i| ((i * 2_654_435_761usize) % 1000) as f32 * 1e-3 - 0.5).collect();
        let bufs: Vec<CudaSlice<f32>> = (0..4).map(|_| gpu.stream.clone_htod(&inputs)).collect::<Result<_, _>>()?;
        let bootstrap = gpu.stream.alloc_zeros::<f32>(b_len.max(1))?;
        let (mut vs, mut adv) = (gpu.stream.alloc_zeros::<f32>(n.max(1))?, gpu.stream.alloc_zeros::<f32>(n.max(1))?);
        let ms = time(gpu, reps, || {
            let args = VTraceScanArgs {
                t_len,
                b_len,
                log_rhos: bufs[0].slice(..n),
                discounts: bufs[1].slice(..n),
                rewards: bufs[2].slice(..n),
                values: bufs[3].slice(..n),
                bootstrap: bootstrap.slice(..b_len),
                config: &VTraceConfig { lambda_: 0.95, ..VTraceConfig::default() },
                advantage_override: None,
            };
            gpu.kernels.vtrace_scan(&args, &mut vs.slice_mut(..n), &mut adv.slice_mut(..n))
        })?;
        Ok(KernelTiming { ms, bytes: (4 * (6 * n + b_len)) as u64 })
    }

    /// Time a device-to-device copy of `bytes` (the memory-bandwidth ceiling the scan is
    /// compared with; a copy reads and writes every byte, so `bytes` counts both).
    pub fn time_copy(&self, bytes: usize, reps: usize) -> Result<KernelTiming, BackendError> {
        let gpu = &self.gpu;
        let n = (bytes / 8).max(1);
        let src = gpu.stream.alloc_zeros::<f32>(n)?;
        let mut dst = gpu.stream.alloc_zeros::<f32>(n)?;
        let ms = time(gpu, reps, || Ok(gpu.stream.memcpy_dtod(&src, &mut dst)?))?;
        Ok(KernelTiming { ms, bytes: (8 * n) as u64 })
    }
}
