//! The CUDA sources of the learner's kernels and their NVRTC compilation.
//!
//! The `.cu` files live in `learner/kernels/` and are embedded in the binary; [`module_source`]
//! prepends the shared header (`common.cuh`) to them, and the CUDA backend compiles the result
//! with NVRTC when it starts, for the device's own architecture. [`compile_check`] compiles each
//! file on its own so that CI, which has NVRTC (a PyPI wheel) but no GPU, fails on any kernel that
//! does not compile.

use cudarc::nvrtc::{CompileOptions, Ptx};

/// One kernel source file and the `extern "C"` kernels it defines.
#[derive(Debug, Clone, Copy)]
pub struct KernelFile {
    /// File name under `learner/kernels/`.
    pub name: &'static str,
    /// Its text.
    pub source: &'static str,
    /// The kernels it defines (each must appear as a PTX entry).
    pub kernels: &'static [&'static str],
}

/// The header prepended to every file: fast tanh/sigmoid, block reductions, log-softmax rows.
pub const COMMON: &str = include_str!("../../kernels/common.cuh");

/// Every kernel file of the learner.
pub const FILES: &[KernelFile] = &[
    KernelFile {
        name: "dense.cu",
        source: include_str!("../../kernels/dense.cu"),
        kernels: &["bias_act_fwd", "act_bwd", "take_column", "gather_columns", "fill"],
    },
    KernelFile {
        name: "gru.cu",
        source: include_str!("../../kernels/gru.cu"),
        kernels: &["gru_reset_copy", "gru_cell_fwd", "gru_cell_bwd", "gru_carry_grad"],
    },
    KernelFile {
        name: "loss.cu",
        source: include_str!("../../kernels/loss.cu"),
        kernels: &[
            "action_log_probs",
            "behaviour_weights",
            "vtrace_scan",
            "gae_scan",
            "weighted_sum",
            "weighted_var",
            "vtrace_loss_grad",
            "ppo_loss_grad",
        ],
    },
    KernelFile {
        name: "optim.cu",
        source: include_str!("../../kernels/optim.cu"),
        kernels: &["sum_squares", "adam_prepare", "adam_step"],
    },
];

/// The whole module: the header followed by every file.
pub fn module_source() -> String {
    let mut source = String::from(COMMON);
    for file in FILES {
        source.push_str("\n// ---- ");
        source.push_str(file.name);
        source.push_str(" ----\n");
        source.push_str(file.source);
    }
    source
}

/// NVRTC options: `arch` is a virtual or real architecture such as `sm_90` (`None` leaves NVRTC's
/// default). Exact IEEE division and square root, and no flush-to-zero, keep the kernels close
/// to the CPU backend; fused multiply-adds stay on (they only make results more accurate).
pub fn options(arch: Option<&'static str>, name: &str) -> CompileOptions {
    CompileOptions {
        ftz: Some(false),
        prec_div: Some(true),
        prec_sqrt: Some(true),
        fmad: Some(true),
        arch,
        name: Some(name.to_string()),
        ..CompileOptions::default()
    }
}

/// Why a kernel did not compile.
#[derive(Debug, thiserror::Error)]
pub enum KernelError {
    /// The NVRTC library could not be loaded.
    #[error(
        "NVRTC (libnvrtc.so) was not found; install the CUDA runtime libraries or `pip install nvidia-cuda-nvrtc-cu12` and put its lib directory on LD_LIBRARY_PATH"
    )]
    NvrtcMissing,
    /// NVRTC rejected a source; `log` is its compiler output.
    #[error("{file}: NVRTC compilation failed: {log}")]
    Compile {
        /// The file (or `module` for the whole module).
        file: String,
        /// NVRTC's log or error.
        log: String,
    },
    /// A kernel the backend launches is missing from the compiled PTX.
    #[error("{file}: kernel `{kernel}` is not in the compiled PTX")]
    MissingKernel {
        /// The file.
        file: String,
        /// The kernel name.
        kernel: String,
    },
}

/// Whether the NVRTC library can be loaded (without panicking when it cannot).
pub fn nvrtc_available() -> bool {
    // SAFETY: only tries to dlopen the library's candidate names; no symbol is called.
    unsafe { cudarc::nvrtc::sys::is_culib_present() }
}

fn compile(source: &str, arch: Option<&'static str>, name: &str) -> Result<Ptx, KernelError> {
    if !nvrtc_available() {
        return Err(KernelError::NvrtcMissing);
    }
    cudarc::nvrtc::compile_ptx_with_opts(source, options(arch, name))
        .map_err(|err| KernelError::Compile { file: name.to_string(), log: err.to_string() })
}

/// Compile the whole module for `arch`.
pub fn compile_module(arch: Option<&'static str>) -> Result<Ptx, KernelError> {
    compile(&module_source(), arch, "volley_learner.cu")
}

/// Compile every file on its own for `arch` and check that each declared kernel is in the PTX.
/// Returns the PTX size per file.
pub fn compile_check(arch: Option<&'static str>) -> Result<Vec<(&'static str, usize)>, KernelError> {
    let mut sizes = Vec::new();
    for file in FILES {
        let ptx = compile(&format!("{COMMON}\n{}", file.source), arch, file.name)?.to_src();
        for kernel in file.kernels {
            if !ptx.contains(&format!(".entry {kernel}(")) {
                return Err(KernelError::MissingKernel { file: file.name.to_string(), kernel: kernel.to_string() });
            }
        }
        sizes.push((file.name, ptx.len()));
    }
    Ok(sizes)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// CI sets `VOLLEY_REQUIRE_NVRTC=1` (with the NVRTC wheel on `LD_LIBRARY_PATH`), so there a
    /// missing NVRTC fails the test instead of skipping it.
    fn nvrtc_or_skip() -> bool {
        if nvrtc_available() {
            return true;
        }
        assert!(
            std::env::var("VOLLEY_REQUIRE_NVRTC").map_or(true, |v| v != "1"),
            "VOLLEY_REQUIRE_NVRTC=1 but NVRTC could not be loaded (LD_LIBRARY_PATH={:?})",
            std::env::var("LD_LIBRARY_PATH").ok()
        );
        eprintln!("SKIPPED: NVRTC (libnvrtc.so) not found; kernels not compiled");
        false
    }

    #[test]
    fn every_kernel_compiles_with_nvrtc_for_the_gpu_architectures_we_target() {
        if !nvrtc_or_skip() {
            return;
        }
        for arch in ["sm_80", "sm_90"] {
            let sizes = compile_check(Some(arch)).unwrap_or_else(|err| panic!("{arch}: {err}"));
            assert_eq!(sizes.len(), FILES.len());
        }
        let module = compile_module(Some("sm_90")).expect("the whole module compiles").to_src();
        for kernel in FILES.iter().flat_map(|f| f.kernels) {
            assert!(module.contains(&format!(".entry {kernel}(")), "{kernel} missing from the module");
        }
    }

    #[test]
    fn a_broken_kernel_is_reported_with_the_compiler_log() {
        if !nvrtc_or_skip() {
            return;
        }
        let err = compile("extern \"C\" __global__ void k(float* x) { x[0] = undefined_name; }", None, "broken.cu")
            .expect_err("must not compile");
        let message = err.to_string();
        assert!(message.contains("broken.cu") && message.contains("undefined_name"), "{message}");
    }

    #[test]
    fn every_declared_kernel_is_defined_in_its_source() {
        for file in FILES {
            for kernel in file.kernels {
                assert!(
                    file.source.contains(&format!("__global__ void {kernel}(")),
                    "{} does not define {kernel}",
                    file.name
                );
            }
        }
    }
}
