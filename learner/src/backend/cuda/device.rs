//! One CUDA device: its context, a compute stream and a copy stream, a cuBLAS handle bound to
//! the compute stream, and the loaded kernels; plus the matrix products through cuBLAS.
//!
//! Row-major products through column-major cuBLAS: a row-major `M[r×c]` is the column-major
//! `Mᵀ[c×r]` with leading dimension `c`, so `Y = X Wᵀ` is computed as `Yᵀ = W Xᵀ`, and so on
//! (see [`Product`]). Products run in plain f32 (no TF32), so results stay within f32 rounding
//! of the CPU backend.

use std::sync::Arc;

use cudarc::cublas::sys::cublasOperation_t;
use cudarc::cublas::CudaBlas;
use cudarc::driver::{CudaContext, CudaStream, CudaView, CudaViewMut, DevicePtr, DevicePtrMut};

use super::kernels::{self, Kernels};
use crate::backend::BackendError;

/// An open device with the learner's kernels compiled for its architecture.
pub(crate) struct Gpu {
    pub(crate) description: String,
    pub(crate) ctx: Arc<CudaContext>,
    /// Every kernel and product runs here, in order.
    pub(crate) stream: Arc<CudaStream>,
    /// Batch uploads run here, ordered before the compute stream's use by an event.
    pub(crate) copy_stream: Arc<CudaStream>,
    blas: CudaBlas,
    pub(crate) kernels: Kernels,
}

/// A row-major product `C[rows×cols] = op(A)[rows×inner] · op(B)[inner×cols]` of contiguous
/// operands, where `op(M)` is `M`, or `Mᵀ` for an operand stored transposed
/// (`A: [inner×rows]`, `B: [cols×inner]`).
#[derive(Debug, Clone, Copy)]
pub(crate) struct Product {
    rows: usize,
    cols: usize,
    inner: usize,
    a_transposed: bool,
    b_transposed: bool,
}

impl Product {
    /// `C[rows×cols] = A[rows×inner] · B[inner×cols]`.
    pub(crate) fn new(rows: usize, cols: usize, inner: usize) -> Self {
        Product { rows, cols, inner, a_transposed: false, b_transposed: false }
    }

    /// With `A` stored transposed, `[inner×rows]`.
    pub(crate) fn a_transposed(self) -> Self {
        Product { a_transposed: true, ..self }
    }

    /// With `B` stored transposed, `[cols×inner]`.
    pub(crate) fn b_transposed(self) -> Self {
        Product { b_transposed: true, ..self }
    }
}

impl Gpu {
    /// Open device `ordinal`, compile the kernels for its architecture and load them.
    pub(crate) fn open(ordinal: usize) -> Result<Self, BackendError> {
        let count = CudaContext::device_count()?;
        if count <= 0 || ordinal >= count as usize {
            return Err(BackendError::NoDevice { visible: std::env::var("CUDA_VISIBLE_DEVICES").ok() });
        }
        let ctx = CudaContext::new(ordinal)?;
        // One compute stream and one copy stream, ordered by explicit events: cudarc's
        // per-buffer event tracking would add two event records per kernel argument.
        // SAFETY: the only cross-stream dependency is the batch upload, which the compute stream
        // waits for through an explicit event (`CudaBackend::upload_packed`).
        unsafe { ctx.disable_event_tracking() };
        let (major, minor) = ctx.compute_capability()?;
        let name = ctx.name()?;
        let arch: &'static str = Box::leak(format!("sm_{major}{minor}").into_boxed_str());
        let ptx = kernels::compile_module(Some(arch))?;
        let module = ctx.load_module(ptx)?;
        let stream = ctx.new_stream()?;
        let copy_stream = ctx.new_stream()?;
        let blas = CudaBlas::new(stream.clone())?;
        let kernels = Kernels::load(module, stream.clone())?;
        Ok(Gpu {
            description: format!("{name} (sm_{major}{minor}, device {ordinal})"),
            ctx,
            stream,
            copy_stream,
            blas,
            kernels,
        })
    }

    /// `C = op(A)·op(B) + beta·C` (see [`Product`]), after checking that every operand holds
    /// the elements the product addresses.
    pub(crate) fn product(
        &self,
        product: Product,
        a: &CudaView<'_, f32>,
        b: &CudaView<'_, f32>,
        beta: f32,
        c: &mut CudaViewMut<'_, f32>,
    ) -> Result<(), BackendError> {
        let Product { rows, cols, inner, a_transposed, b_transposed } = product;
        if rows == 0 || cols == 0 {
            return Ok(());
        }
        for (operand, need, len) in
            [("a", rows * inner, a.len()), ("b", inner * cols, b.len()), ("c", rows * cols, c.len())]
        {
            if len < need {
                return Err(BackendError::Shape { op: "sgemm", operand, expected: need, got: len });
            }
        }
        // Column-major cuBLAS sees each row-major operand transposed, with its stored row
        // width as leading dimension, so it computes `Cᵀ = op(B)ᵀ·op(A)ᵀ`: `B` is its first
        // operand.
        let dim = |what, x| kernels::int(what, x);
        let (m, n, k) = (dim("cols", cols)?, dim("rows", rows)?, dim("inner", inner)?);
        let ld_b = dim("b row width", if b_transposed { inner } else { cols })?;
        let ld_a = dim("a row width", if a_transposed { rows } else { inner })?;
        let op = |transposed| if transposed { cublasOperation_t::CUBLAS_OP_T } else { cublasOperation_t::CUBLAS_OP_N };
        let alpha = 1.0f32;
        let (a_ptr, _a_sync) = a.device_ptr(&self.stream);
        let (b_ptr, _b_sync) = b.device_ptr(&self.stream);
        let (c_ptr, _c_sync) = c.device_ptr_mut(&self.stream);
        // SAFETY: the handle is bound to the compute stream that orders every use of these
        // buffers; each operand is contiguous and holds at least the elements of its shape
        // (checked above), which is all the call addresses at these leading dimensions; `c` is
        // an exclusive borrow, so it aliases neither input.
        unsafe {
            cudarc::cublas::result::sgemm(
                *self.blas.handle(),
                op(b_transposed),
                op(a_transposed),
                m,
                n,
                k,
                &alpha,
                b_ptr as *const f32,
                ld_b,
                a_ptr as *const f32,
                ld_a,
                &beta,
                c_ptr as *mut f32,
                m,
            )
        }?;
        Ok(())
    }

    /// `out[width] = Σ_r dY[r][·]` through a product with `ones` (at least `rows` ones).
    pub(crate) fn column_sums(
        &self,
        dy: &CudaView<'_, f32>,
        rows: usize,
        ones: &CudaView<'_, f32>,
        out: &mut CudaViewMut<'_, f32>,
    ) -> Result<(), BackendError> {
        if rows == 0 {
            return self.kernels.fill(out, 0.0);
        }
        // `out[1×width] = ones[1×rows] · dY[rows×width]`.
        self.product(Product::new(1, out.len(), rows), ones, dy, 0.0, out)
    }
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
