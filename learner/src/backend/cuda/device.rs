//! One CUDA device: its context, a compute stream and a copy stream, a cuBLAS handle bound to
//! the compute stream, and the loaded kernels; plus the matrix products through cuBLAS.
//!
//! Row-major products through column-major cuBLAS: a row-major `M[r×c]` is the column-major
//! `Mᵀ[c×r]` with leading dimension `c`, so `Y = X Wᵀ` is computed as `Yᵀ = W Xᵀ`, and so on
//! (see `Gpu::gemm_xwt`, `Gpu::gemm_dw` and `Gpu::gemm_dx`). Products run in plain f32
//! (no TF32), so results stay within f32 rounding of the CPU backend.

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

/// The dimensions of one `sgemm` call (column-major, cuBLAS's convention).
#[derive(Debug, Clone, Copy)]
struct Gemm {
    transa: cublasOperation_t,
    transb: cublasOperation_t,
    m: usize,
    n: usize,
    k: usize,
    lda: usize,
    ldb: usize,
    ldc: usize,
}

impl Gemm {
    /// Elements of `A`, `B` and `C` that the call reads or writes (the last one addressed + 1).
    fn extents(&self) -> (usize, usize, usize) {
        let cols_a = if self.transa == cublasOperation_t::CUBLAS_OP_N { self.k } else { self.m };
        let cols_b = if self.transb == cublasOperation_t::CUBLAS_OP_N { self.n } else { self.k };
        let rows_a = if self.transa == cublasOperation_t::CUBLAS_OP_N { self.m } else { self.k };
        let rows_b = if self.transb == cublasOperation_t::CUBLAS_OP_N { self.k } else { self.n };
        let extent = |rows: usize, cols: usize, ld: usize| if cols == 0 { 0 } else { (cols - 1) * ld + rows };
        (extent(rows_a, cols_a, self.lda), extent(rows_b, cols_b, self.ldb), extent(self.m, self.n, self.ldc))
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
        let kernels = Kernels::load(module)?;
        Ok(Gpu {
            description: format!("{name} (sm_{major}{minor}, device {ordinal})"),
            ctx,
            stream,
            copy_stream,
            blas,
            kernels,
        })
    }

    /// `C = A·B + beta·C` in cuBLAS's column-major terms, after checking that every operand
    /// holds the elements the call addresses.
    fn sgemm(
        &self,
        dims: Gemm,
        a: &CudaView<'_, f32>,
        b: &CudaView<'_, f32>,
        beta: f32,
        c: &mut CudaViewMut<'_, f32>,
    ) -> Result<(), BackendError> {
        if dims.m == 0 || dims.n == 0 {
            return Ok(());
        }
        let (need_a, need_b, need_c) = dims.extents();
        for (operand, need, len) in [("a", need_a, a.len()), ("b", need_b, b.len()), ("c", need_c, c.len())] {
            if len < need {
                return Err(BackendError::Shape { op: "sgemm", operand, expected: need, got: len });
            }
        }
        let dim = |what, x| kernels::int(what, x);
        let (m, n, k) = (dim("m", dims.m)?, dim("n", dims.n)?, dim("k", dims.k)?);
        let (lda, ldb, ldc) = (dim("lda", dims.lda)?, dim("ldb", dims.ldb)?, dim("ldc", dims.ldc)?);
        let alpha = 1.0f32;
        let (a_ptr, _a_sync) = a.device_ptr(&self.stream);
        let (b_ptr, _b_sync) = b.device_ptr(&self.stream);
        let (c_ptr, _c_sync) = c.device_ptr_mut(&self.stream);
        // SAFETY: the handle is bound to the compute stream that orders every use of these
        // buffers; each operand holds at least the elements the call addresses at its leading
        // dimension (checked above); `c` is an exclusive borrow, so it aliases neither input.
        unsafe {
            cudarc::cublas::result::sgemm(
                *self.blas.handle(),
                dims.transa,
                dims.transb,
                m,
                n,
                k,
                &alpha,
                a_ptr as *const f32,
                lda,
                b_ptr as *const f32,
                ldb,
                &beta,
                c_ptr as *mut f32,
                ldc,
            )
        }?;
        Ok(())
    }

    /// `Y[rows×n_out] = X[rows×n_in] · Wᵀ`, `W: [n_out×n_in]` row-major.
    pub(crate) fn gemm_xwt(
        &self,
        x: &CudaView<'_, f32>,
        rows: usize,
        n_in: usize,
        w: &CudaView<'_, f32>,
        n_out: usize,
        y: &mut CudaViewMut<'_, f32>,
    ) -> Result<(), BackendError> {
        use cublasOperation_t::{CUBLAS_OP_N, CUBLAS_OP_T};
        let dims = Gemm {
            transa: CUBLAS_OP_T,
            transb: CUBLAS_OP_N,
            m: n_out,
            n: rows,
            k: n_in,
            lda: n_in,
            ldb: n_in,
            ldc: n_out,
        };
        self.sgemm(dims, w, x, 0.0, y)
    }

    /// `dW[n_out×n_in] = dYᵀ · X` over `rows` rows (overwrites).
    pub(crate) fn gemm_dw(
        &self,
        dy: &CudaView<'_, f32>,
        rows: usize,
        n_out: usize,
        x: &CudaView<'_, f32>,
        n_in: usize,
        dw: &mut CudaViewMut<'_, f32>,
    ) -> Result<(), BackendError> {
        use cublasOperation_t::{CUBLAS_OP_N, CUBLAS_OP_T};
        let dims = Gemm {
            transa: CUBLAS_OP_N,
            transb: CUBLAS_OP_T,
            m: n_in,
            n: n_out,
            k: rows,
            lda: n_in,
            ldb: n_out,
            ldc: n_in,
        };
        self.sgemm(dims, x, dy, 0.0, dw)
    }

    /// `dX[rows×n_in] = dY[rows×n_out] · W` (`+ beta · dX`).
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn gemm_dx(
        &self,
        dy: &CudaView<'_, f32>,
        rows: usize,
        n_out: usize,
        w: &CudaView<'_, f32>,
        n_in: usize,
        dx: &mut CudaViewMut<'_, f32>,
        beta: f32,
    ) -> Result<(), BackendError> {
        use cublasOperation_t::CUBLAS_OP_N;
        let dims = Gemm {
            transa: CUBLAS_OP_N,
            transb: CUBLAS_OP_N,
            m: n_in,
            n: rows,
            k: n_out,
            lda: n_in,
            ldb: n_out,
            ldc: n_in,
        };
        self.sgemm(dims, w, dy, beta, dx)
    }

    /// `out[width] = Σ_r dY[r][·]` through a product with `ones` (at least `rows` ones).
    pub(crate) fn column_sums(
        &self,
        dy: &CudaView<'_, f32>,
        rows: usize,
        ones: &CudaView<'_, f32>,
        out: &mut CudaViewMut<'_, f32>,
    ) -> Result<(), BackendError> {
        use cublasOperation_t::CUBLAS_OP_N;
        let width = out.len();
        let dims = Gemm {
            transa: CUBLAS_OP_N,
            transb: CUBLAS_OP_N,
            m: width,
            n: 1,
            k: rows,
            lda: width,
            ldb: rows,
            ldc: width,
        };
        if rows == 0 {
            return self.kernels.fill(&self.stream, out, 0.0);
        }
        self.sgemm(dims, dy, ones, 0.0, out)
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
