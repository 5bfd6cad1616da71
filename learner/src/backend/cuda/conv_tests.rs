//! Parity of the CUDA `im2col`, `col2im`, `im2col_u8` and `widen_u8` kernels with the CPU backend, for both input
//! layouts, strides and padding (the network-level parity of conv torsos is in `tests.rs`).
//! Without a device each CUDA test prints `SKIPPED` and passes, unless `VOLLEY_REQUIRE_CUDA=1`.

use volley_policy::{ConvGeometry, ConvLayerSpec, ConvSpec};

use super::tests::cuda_or_skip;
use crate::backend::{Backend, Col2im, CpuBackend, Im2col, Im2colU8, View, ViewMut, WidenU8};

/// Two conv layers over a 2×9×8 image: 3×3 with padding 1, then 4×4 with stride 2 over the
/// channel-last output of the first.
pub(super) fn two_layer_conv() -> ConvSpec {
    let layer = |out_channels, kernel, stride, padding| ConvLayerSpec { out_channels, kernel, stride, padding };
    ConvSpec {
        in_channels: 2,
        height: 9,
        width: 8,
        layers: vec![layer(5, 3, 1, 1), layer(4, 4, 2, 0)],
        input: Default::default(),
    }
}

fn geometries() -> Vec<ConvGeometry> {
    let mut geometries = two_layer_conv().geometries().expect("valid");
    geometries.extend(ConvSpec::nature(4, 84, 84).geometries().expect("valid"));
    geometries.push(ConvGeometry {
        in_channels: 3,
        in_height: 7,
        in_width: 6,
        out_channels: 2,
        kernel: 5,
        stride: 3,
        padding: 2,
        channels_last: true,
    });
    geometries
}

fn values(len: usize, seed: f32) -> Vec<f32> {
    (0..len).map(|i| ((i as f32 + seed) * 0.377).sin()).collect()
}

/// `im2col` then `col2im` on `backend`, as host vectors.
fn run<B: Backend>(
    backend: &mut B,
    geometry: &ConvGeometry,
    n: usize,
    x: &[f32],
    d_cols: &[f32],
) -> (Vec<f32>, Vec<f32>) {
    let upload = |backend: &mut B, host: &[f32]| {
        let mut buffer = backend.alloc(host.len()).expect("alloc");
        backend.upload(host, ViewMut::of(&mut buffer)).expect("upload");
        buffer
    };
    let (x_buf, d_buf) = (upload(backend, x), upload(backend, d_cols));
    let mut cols = backend.alloc(d_cols.len()).expect("alloc");
    let mut dx = upload(backend, &vec![f32::NAN; x.len()]);
    backend.im2col(Im2col { x: View::of(&x_buf), n, geometry, cols: ViewMut::of(&mut cols) }).expect("im2col");
    backend.col2im(Col2im { d_cols: View::of(&d_buf), n, geometry, dx: ViewMut::of(&mut dx) }).expect("col2im");
    let (mut cols_host, mut dx_host) = (vec![0.0; d_cols.len()], vec![0.0; x.len()]);
    backend.download(View::of(&cols), &mut cols_host).expect("download");
    backend.download(View::of(&dx), &mut dx_host).expect("download");
    (cols_host, dx_host)
}

fn check_conv_ops<B: Backend>(backend: &mut B) {
    let mut cpu = CpuBackend::new();
    for geometry in geometries() {
        let n = 3;
        let x = values(n * geometry.input_len(), 0.25);
        let d_cols = values(n * geometry.cols_len(), 4.0);
        let (cols, dx) = run(backend, &geometry, n, &x, &d_cols);
        let (cpu_cols, cpu_dx) = run(&mut cpu, &geometry, n, &x, &d_cols);
        // The unfolding copies values, so it must agree exactly; the fold sums in another order.
        assert_eq!(cols, cpu_cols, "{geometry:?}: im2col");
        for (i, (&a, &b)) in dx.iter().zip(&cpu_dx).enumerate() {
            assert!((a - b).abs() <= 1e-5 * (1.0 + b.abs()), "{geometry:?}: col2im[{i}] {a} vs {b}");
        }
        let mut short = cpu.alloc(1).expect("alloc");
        let err = cpu
            .im2col(Im2col { x: View::of(&x), n, geometry: &geometry, cols: ViewMut::of(&mut short) })
            .expect_err("wrong cols length");
        assert!(err.to_string().contains("cols"), "{err}");
    }
}

#[test]
fn im2col_and_col2im_kernels_match_the_cpu_backend() {
    let Some(mut cuda) = cuda_or_skip("im2col_and_col2im_kernels_match_the_cpu_backend") else { return };
    check_conv_ops(&mut cuda);
}

/// `im2col_u8` and `widen_u8` over `n` rows of bytes packed four to a word, as host vectors.
fn run_bytes<B: Backend>(
    backend: &mut B,
    geometry: &ConvGeometry,
    n: usize,
    bytes: &[u8],
    scale: f32,
) -> (Vec<f32>, Vec<f32>) {
    let width = geometry.input_len();
    let mut packed = vec![0.0; n * crate::backend::packed_words(width)];
    crate::backend::pack_byte_rows(bytes, width, &mut packed);
    let mut x = backend.alloc(packed.len()).expect("alloc");
    backend.upload(&packed, ViewMut::of(&mut x)).expect("upload");
    let mut cols = backend.alloc(n * geometry.cols_len()).expect("alloc");
    let mut widened = backend.alloc(n * width).expect("alloc");
    backend
        .im2col_u8(Im2colU8 { x: View::of(&x), n, geometry, scale, cols: ViewMut::of(&mut cols) })
        .expect("im2col_u8");
    let out = ViewMut::of(&mut widened);
    backend.widen_u8(WidenU8 { x: View::of(&x), rows: n, width, scale, out }).expect("widen_u8");
    let (mut cols_host, mut widened_host) = (vec![0.0; n * geometry.cols_len()], vec![0.0; n * width]);
    backend.download(View::of(&cols), &mut cols_host).expect("download");
    backend.download(View::of(&widened), &mut widened_host).expect("download");
    (cols_host, widened_host)
}

/// Issue 44 item 3: the byte-reading first-layer operations equal `im2col` over the scaled
/// values (on the CPU) and agree exactly between backends, for images that are and are not a
/// whole number of words (the Nature preset's 28 224 bytes, the 7×6×3 image's 126).
fn check_byte_ops<B: Backend>(backend: &mut B) {
    let mut cpu = CpuBackend::new();
    for geometry in geometries().into_iter().filter(|g| !g.channels_last || g.in_channels == 3) {
        let n = 3;
        let bytes: Vec<u8> = (0..n * geometry.input_len()).map(|i| (i * 97 % 256) as u8).collect();
        for scale in [1.0, 1.0 / 255.0] {
            let (cols, widened) = run_bytes(backend, &geometry, n, &bytes, scale);
            let (cpu_cols, cpu_widened) = run_bytes(&mut cpu, &geometry, n, &bytes, scale);
            assert_eq!(cols, cpu_cols, "{geometry:?}: im2col_u8");
            assert_eq!(widened, cpu_widened, "{geometry:?}: widen_u8");
            let floats: Vec<f32> = bytes.iter().map(|&b| f32::from(b) * scale).collect();
            let (float_cols, _) = run(&mut cpu, &geometry, n, &floats, &vec![0.0; n * geometry.cols_len()]);
            assert_eq!(cpu_cols, float_cols, "{geometry:?}: im2col over the scaled values");
            assert_eq!(cpu_widened, floats, "{geometry:?}: the scaled values");
        }
    }
}

/// The checks run with the CPU backend in the tested role: the harness works without a GPU.
#[test]
fn conv_and_byte_ops_harnesses_run_on_the_cpu() {
    check_conv_ops(&mut CpuBackend::new());
    check_byte_ops(&mut CpuBackend::new());
}

#[test]
fn im2col_u8_and_widen_u8_kernels_match_the_cpu_backend() {
    let Some(mut cuda) = cuda_or_skip("im2col_u8_and_widen_u8_kernels_match_the_cpu_backend") else { return };
    check_byte_ops(&mut cuda);
}
