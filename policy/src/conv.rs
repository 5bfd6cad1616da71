//! The convolutional torso: its spec, its geometry and the two CPU kernels it needs, `im2col`
//! and its adjoint `col2im`. The products themselves are the ordinary dense GEMM.
//!
//! A convolution with `OC` filters of `C × K × K` over an image batch becomes one matrix
//! product by unfolding every receptive field into a row ("im2col", Chellapilla et al. 2006):
//!
//! ```text
//! cols[(n, oy, ox)][(c, ky, kx)] = x[n][c][oy·s − p + ky][ox·s − p + kx]   (0 outside the image)
//! y = relu(cols Wᵀ + b)                 W: [OC][C·K·K] (PyTorch's [OC][C][K][K], flattened)
//! ```
//!
//! so `y` is `[N][OH][OW][OC]`: channel-last. Each conv layer after the first therefore reads a
//! channel-last input, while the first reads the observation in its `[C][H][W]` layout;
//! [`ConvGeometry::channels_last`] says which. The last conv output is flattened in that
//! `(oy, ox, oc)` order for the dense torso (a different column order from PyTorch's
//! `nn.Flatten` over NCHW, which only matters when importing foreign weights).
//!
//! Backward reuses the GEMMs (`dW = dYᵀ cols`, `d cols = dY W`) and folds `d cols` back into the
//! input's shape with [`col2im`], which sums every input pixel's contributions (a gather, so the
//! CUDA kernel needs no atomics and the sum order is fixed).

use serde::{Deserialize, Serialize};

use super::PolicyError;

/// Largest accepted number of conv layers.
pub const MAX_CONV_LAYERS: usize = 16;

/// Largest accepted image side, kernel side, stride and padding (a guard against unit mistakes,
/// not a limit of the math).
pub const MAX_IMAGE_SIDE: usize = 1024;

/// One convolution layer: `out_channels` filters of `kernel × kernel`, then ReLU.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct ConvLayerSpec {
    /// Number of filters (output channels).
    pub out_channels: usize,
    /// Side of the square kernel.
    pub kernel: usize,
    /// Step between receptive fields, in pixels.
    pub stride: usize,
    /// Zeros added on every side of the input.
    pub padding: usize,
}

/// A convolutional torso in front of the dense torso: the observation is an image
/// `[in_channels][height][width]` (so `obs_dim = C·H·W`) and runs through `layers`, each a
/// convolution followed by ReLU; the dense torso then reads the flattened last feature map.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct ConvSpec {
    /// Channels of the observation image.
    pub in_channels: usize,
    /// Height of the observation image.
    pub height: usize,
    /// Width of the observation image.
    pub width: usize,
    /// The conv layers, input side first (at least one).
    pub layers: Vec<ConvLayerSpec>,
    /// What the observation values are, and so how the network scales them before the first
    /// layer; absent in specs written before it existed (raw).
    #[serde(default, skip_serializing_if = "ConvInput::is_raw")]
    pub input: ConvInput,
}

/// How a conv torso reads its observation values.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ConvInput {
    /// As they are (MinAtar's 0/1 planes).
    #[default]
    Raw,
    /// 8-bit pixel values `0..=255`, divided by 255 inside the network (the observations stay
    /// whole numbers in memory and one byte each on the wire), as the Nature-DQN network reads
    /// Atari frames.
    Pixels,
}

impl ConvInput {
    /// The factor applied to every observation value.
    pub fn scale(self) -> f32 {
        match self {
            ConvInput::Raw => 1.0,
            ConvInput::Pixels => 1.0 / 255.0,
        }
    }

    fn is_raw(&self) -> bool {
        *self == ConvInput::Raw
    }
}

impl ConvSpec {
    /// The MinAtar network (Young & Tian 2019): one 3×3 convolution with 16 filters, stride 1,
    /// no padding. Use it with a dense torso of 128 units.
    pub fn minatar(in_channels: usize, height: usize, width: usize) -> Self {
        ConvSpec {
            in_channels,
            height,
            width,
            layers: vec![ConvLayerSpec { out_channels: 16, kernel: 3, stride: 1, padding: 0 }],
            input: ConvInput::Raw,
        }
    }

    /// The Nature-DQN network (Mnih et al. 2015), also IMPALA's shallow network (Espeholt et al.
    /// 2018): 32 8×8 filters with stride 4, 64 4×4 with stride 2, 64 3×3 with stride 1. For
    /// 84×84 frames that leaves a 7×7×64 map. Use it with a dense torso of 512 units.
    pub fn nature(in_channels: usize, height: usize, width: usize) -> Self {
        let layer = |out_channels, kernel, stride| ConvLayerSpec { out_channels, kernel, stride, padding: 0 };
        ConvSpec {
            in_channels,
            height,
            width,
            layers: vec![layer(32, 8, 4), layer(64, 4, 2), layer(64, 3, 1)],
            input: ConvInput::Raw,
        }
    }

    /// The observation length this torso reads, `C·H·W`.
    pub fn input_dim(&self) -> usize {
        self.in_channels * self.height * self.width
    }

    /// The geometry of every layer, input side first, or why the spec is invalid (a size out of
    /// range, or a kernel larger than its padded input).
    pub fn geometries(&self) -> Result<Vec<ConvGeometry>, PolicyError> {
        let invalid = |field: String, value: usize, rule: &'static str| PolicyError::InvalidSpec { field, value, rule };
        if self.layers.is_empty() || self.layers.len() > MAX_CONV_LAYERS {
            return Err(invalid("conv.layers.len()".into(), self.layers.len(), "between 1 and 16"));
        }
        for (field, value) in
            [("conv.in_channels", self.in_channels), ("conv.height", self.height), ("conv.width", self.width)]
        {
            if !(1..=MAX_IMAGE_SIDE).contains(&value) {
                return Err(invalid(field.into(), value, "between 1 and 1024"));
            }
        }
        let (mut channels, mut height, mut width) = (self.in_channels, self.height, self.width);
        let mut geometries = Vec::with_capacity(self.layers.len());
        for (layer_idx, layer) in self.layers.iter().enumerate() {
            let field = |name: &str| format!("conv.layers[{layer_idx}].{name}");
            if !(1..=MAX_IMAGE_SIDE).contains(&layer.out_channels) {
                return Err(invalid(field("out_channels"), layer.out_channels, "between 1 and 1024"));
            }
            if !(1..=MAX_IMAGE_SIDE).contains(&layer.kernel) {
                return Err(invalid(field("kernel"), layer.kernel, "between 1 and 1024"));
            }
            if !(1..=MAX_IMAGE_SIDE).contains(&layer.stride) {
                return Err(invalid(field("stride"), layer.stride, "between 1 and 1024"));
            }
            if layer.padding >= layer.kernel {
                return Err(invalid(field("padding"), layer.padding, "smaller than the kernel"));
            }
            if layer.kernel > height.min(width) + 2 * layer.padding {
                return Err(invalid(field("kernel"), layer.kernel, "at most the padded input side"));
            }
            let geometry = ConvGeometry {
                in_channels: channels,
                in_height: height,
                in_width: width,
                out_channels: layer.out_channels,
                kernel: layer.kernel,
                stride: layer.stride,
                padding: layer.padding,
                channels_last: layer_idx > 0,
            };
            (channels, height, width) = (layer.out_channels, geometry.out_height(), geometry.out_width());
            geometries.push(geometry);
        }
        Ok(geometries)
    }
}

/// Everything the conv kernels need about one layer: input shape and layout, filter shape,
/// stride and padding. All sizes are validated by [`ConvSpec::geometries`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ConvGeometry {
    /// Input channels `C`.
    pub in_channels: usize,
    /// Input height `H`.
    pub in_height: usize,
    /// Input width `W`.
    pub in_width: usize,
    /// Output channels `OC`.
    pub out_channels: usize,
    /// Kernel side `K`.
    pub kernel: usize,
    /// Stride `s`.
    pub stride: usize,
    /// Padding `p`.
    pub padding: usize,
    /// The input is `[H][W][C]` (an earlier conv layer's output) rather than `[C][H][W]` (the
    /// observation).
    pub channels_last: bool,
}

impl ConvGeometry {
    /// `OH = (H + 2p − K) / s + 1`.
    pub fn out_height(&self) -> usize {
        (self.in_height + 2 * self.padding - self.kernel) / self.stride + 1
    }

    /// `OW = (W + 2p − K) / s + 1`.
    pub fn out_width(&self) -> usize {
        (self.in_width + 2 * self.padding - self.kernel) / self.stride + 1
    }

    /// Output positions per image, `OH·OW` (the rows of one image's `cols`).
    pub fn out_positions(&self) -> usize {
        self.out_height() * self.out_width()
    }

    /// Length of one unfolded receptive field, `C·K·K` (the columns of `cols`, and of `W`).
    pub fn patch_len(&self) -> usize {
        self.in_channels * self.kernel * self.kernel
    }

    /// Floats per input image, `C·H·W`.
    pub fn input_len(&self) -> usize {
        self.in_channels * self.in_height * self.in_width
    }

    /// Floats per output image, `OH·OW·OC`.
    pub fn output_len(&self) -> usize {
        self.out_positions() * self.out_channels
    }

    /// Floats of one image's `cols`, `OH·OW·C·K·K`.
    pub fn cols_len(&self) -> usize {
        self.out_positions() * self.patch_len()
    }

    /// The input strides `(channel, row, column)` in floats within one image.
    pub fn input_strides(&self) -> (usize, usize, usize) {
        if self.channels_last {
            (1, self.in_width * self.in_channels, self.in_channels)
        } else {
            (self.in_height * self.in_width, self.in_width, 1)
        }
    }

    fn check(&self, op: &'static str, n: usize, x: usize, cols: usize) -> Result<(), PolicyError> {
        let (want_x, want_cols) = (n * self.input_len(), n * self.cols_len());
        if x != want_x {
            return Err(PolicyError::Shape {
                field: if op == "im2col" { "x" } else { "dx" },
                expected: want_x,
                got: x,
            });
        }
        if cols != want_cols {
            let field = if op == "im2col" { "cols" } else { "d_cols" };
            return Err(PolicyError::Shape { field, expected: want_cols, got: cols });
        }
        Ok(())
    }
}

/// Unfold the receptive fields of `n` images `x` into `cols: [n·OH·OW][C·K·K]` (see the
/// module docs of `conv.rs`); zero padding reads as 0.
pub fn im2col(geometry: &ConvGeometry, x: &[f32], n: usize, cols: &mut [f32]) -> Result<(), PolicyError> {
    geometry.check("im2col", n, x.len(), cols.len())?;
    im2col_generic(geometry, x, n, cols, |v: f32| v);
    Ok(())
}

/// [`im2col`] over `u8` pixels, converted to `f32` as they are read (image observations stay
/// `u8` until they enter the network).
pub fn im2col_u8(geometry: &ConvGeometry, x: &[u8], n: usize, cols: &mut [f32]) -> Result<(), PolicyError> {
    geometry.check("im2col", n, x.len(), cols.len())?;
    im2col_generic(geometry, x, n, cols, f32::from);
    Ok(())
}

/// [`im2col`] over `u8` values, each converted to `f32` and multiplied by `scale` as it is
/// read: the first conv layer over image observations (`scale` is the torso's
/// [`ConvInput::scale`]). A value becomes exactly the `f32` that scaling its widened value
/// gives, so this unfolds to the same bits as [`im2col`] over `f32::from(v) * scale`.
pub fn im2col_u8_scaled(
    geometry: &ConvGeometry,
    x: &[u8],
    n: usize,
    scale: f32,
    cols: &mut [f32],
) -> Result<(), PolicyError> {
    geometry.check("im2col", n, x.len(), cols.len())?;
    let table = byte_table(scale);
    im2col_generic(geometry, x, n, cols, |byte: u8| table[usize::from(byte)]);
    Ok(())
}

/// `table[v] = f32::from(v) * scale` for every byte `v`: one lookup per value instead of a
/// conversion and a product.
pub fn byte_table(scale: f32) -> [f32; 256] {
    std::array::from_fn(|v| f32::from(v as u8) * scale)
}

fn im2col_generic<T: Copy>(geometry: &ConvGeometry, x: &[T], n: usize, cols: &mut [f32], to_f32: impl Fn(T) -> f32) {
    let g = geometry;
    let (k, s, p) = (g.kernel, g.stride, g.padding);
    let (out_h, out_w) = (g.out_height(), g.out_width());
    let (c_stride, y_stride, x_stride) = g.input_strides();
    let (h, w) = (g.in_height as isize, g.in_width as isize);
    let mut rows = cols.chunks_exact_mut(g.patch_len());
    if p == 0 {
        // No padding (every preset): every read is inside the image, so the loops need no
        // bounds tests, and a channel-first kernel row is one contiguous run of the input.
        for image in x.chunks_exact(g.input_len()).take(n) {
            for oy in 0..out_h {
                for ox in 0..out_w {
                    let row = rows.next().expect("cols holds n·OH·OW rows (checked)");
                    let origin = oy * s * y_stride + ox * s * x_stride;
                    if x_stride == 1 {
                        for (c, row_c) in row.chunks_exact_mut(k * k).enumerate() {
                            for (ky, row_ky) in row_c.chunks_exact_mut(k).enumerate() {
                                let start = origin + c * c_stride + ky * y_stride;
                                for (out, &value) in row_ky.iter_mut().zip(&image[start..start + k]) {
                                    *out = to_f32(value);
                                }
                            }
                        }
                    } else {
                        // Channel-last input: the channels of one pixel are contiguous, and
                        // land `K·K` apart in the row.
                        let pixel = |kk: usize| origin + kk / k * y_stride + kk % k * x_stride;
                        unfold_channels_last(image, pixel, g.in_channels, row, &to_f32);
                    }
                }
            }
        }
        return;
    }
    for image in x.chunks_exact(g.input_len()).take(n) {
        for oy in 0..out_h {
            for ox in 0..out_w {
                let row = rows.next().expect("cols holds n·OH·OW rows (checked)");
                let (y0, x0) = ((oy * s) as isize - p as isize, (ox * s) as isize - p as isize);
                for (c, row_c) in row.chunks_exact_mut(k * k).enumerate() {
                    for (ky, row_ky) in row_c.chunks_exact_mut(k).enumerate() {
                        let iy = y0 + ky as isize;
                        if iy < 0 || iy >= h {
                            row_ky.fill(0.0);
                            continue;
                        }
                        let base = c * c_stride + iy as usize * y_stride;
                        for (kx, out) in row_ky.iter_mut().enumerate() {
                            let ix = x0 + kx as isize;
                            *out = if ix < 0 || ix >= w { 0.0 } else { to_f32(image[base + ix as usize * x_stride]) };
                        }
                    }
                }
            }
        }
    }
}

/// One unfolded row of a channel-last input: `row[c·K² + kk] = image[pixel(kk) + c]` for the
/// `K²` kernel positions `kk` (`row.len() = channels·K²`). The pixels' channels are contiguous
/// but land `K²` apart in the row, so the copy goes through 4 × 4 blocks (four pixels' four
/// channels, transposed in registers) instead of one scalar store per value (issue 44: conv 2
/// of the Nature network, the slowest unfolding per byte).
#[inline]
fn unfold_channels_last<T: Copy>(
    image: &[T],
    pixel: impl Fn(usize) -> usize,
    channels: usize,
    row: &mut [f32],
    to_f32: &impl Fn(T) -> f32,
) {
    let kk_len = row.len() / channels;
    let (kk_blocks, c_blocks) = (kk_len / 4 * 4, channels / 4 * 4);
    for kk0 in (0..kk_blocks).step_by(4) {
        let starts = [pixel(kk0), pixel(kk0 + 1), pixel(kk0 + 2), pixel(kk0 + 3)];
        let pixels = starts.map(|start| &image[start..start + channels]);
        for c0 in (0..c_blocks).step_by(4) {
            let block: [[f32; 4]; 4] = pixels.map(|p| std::array::from_fn(|i| to_f32(p[c0 + i])));
            for i in 0..4 {
                let out = &mut row[(c0 + i) * kk_len + kk0..][..4];
                out.copy_from_slice(&[block[0][i], block[1][i], block[2][i], block[3][i]]);
            }
        }
        for c in c_blocks..channels {
            for (j, p) in pixels.iter().enumerate() {
                row[c * kk_len + kk0 + j] = to_f32(p[c]);
            }
        }
    }
    for kk in kk_blocks..kk_len {
        let start = pixel(kk);
        for (out, &value) in row[kk..].iter_mut().step_by(kk_len).zip(&image[start..start + channels]) {
            *out = to_f32(value);
        }
    }
}

/// The adjoint of [`unfold_channels_last`]: `image[pixel(kk) + c] += row[c·K² + kk]`, through
/// the same 4 × 4 blocks.
#[inline]
fn fold_channels_last(row: &[f32], pixel: impl Fn(usize) -> usize, channels: usize, image: &mut [f32]) {
    let kk_len = row.len() / channels;
    let (kk_blocks, c_blocks) = (kk_len / 4 * 4, channels / 4 * 4);
    for kk0 in (0..kk_blocks).step_by(4) {
        for c0 in (0..c_blocks).step_by(4) {
            let block: [[f32; 4]; 4] = std::array::from_fn(|i| {
                let d = &row[(c0 + i) * kk_len + kk0..][..4];
                [d[0], d[1], d[2], d[3]]
            });
            for j in 0..4 {
                let start = pixel(kk0 + j) + c0;
                let out = &mut image[start..start + 4];
                for (out, channel) in out.iter_mut().zip(&block) {
                    *out += channel[j];
                }
            }
        }
        for j in 0..4 {
            let start = pixel(kk0 + j);
            for c in c_blocks..channels {
                image[start + c] += row[c * kk_len + kk0 + j];
            }
        }
    }
    for kk in kk_blocks..kk_len {
        let start = pixel(kk);
        for (out, &d) in image[start..start + channels].iter_mut().zip(row[kk..].iter().step_by(kk_len)) {
            *out += d;
        }
    }
}

/// The adjoint of [`im2col`]: `dx` (overwritten, `[n]` images in the geometry's input layout)
/// gets, for every pixel, the sum of the `d_cols` entries that read it.
pub fn col2im(geometry: &ConvGeometry, d_cols: &[f32], n: usize, dx: &mut [f32]) -> Result<(), PolicyError> {
    geometry.check("col2im", n, dx.len(), d_cols.len())?;
    let g = geometry;
    let (k, s, p) = (g.kernel, g.stride, g.padding);
    let (out_h, out_w) = (g.out_height(), g.out_width());
    let (c_stride, y_stride, x_stride) = g.input_strides();
    let (h, w) = (g.in_height as isize, g.in_width as isize);
    dx.fill(0.0);
    // A scatter-add over the rows of d_cols; on the CPU this visits each entry once, in a fixed
    // order, so the sums are deterministic.
    let mut rows = d_cols.chunks_exact(g.patch_len());
    if p == 0 {
        // No padding (every preset): the mirror of `im2col`'s fast path, every write inside the
        // image, so no bounds tests per element (issue 44: 1.5–1.9× faster on the Nature layers).
        for image in dx.chunks_exact_mut(g.input_len()).take(n) {
            for oy in 0..out_h {
                for ox in 0..out_w {
                    let row = rows.next().expect("d_cols holds n·OH·OW rows (checked)");
                    let origin = oy * s * y_stride + ox * s * x_stride;
                    if x_stride == 1 {
                        for (c, row_c) in row.chunks_exact(k * k).enumerate() {
                            for (ky, row_ky) in row_c.chunks_exact(k).enumerate() {
                                let start = origin + c * c_stride + ky * y_stride;
                                for (out, &d) in image[start..start + k].iter_mut().zip(row_ky) {
                                    *out += d;
                                }
                            }
                        }
                    } else {
                        let pixel = |kk: usize| origin + kk / k * y_stride + kk % k * x_stride;
                        fold_channels_last(row, pixel, g.in_channels, image);
                    }
                }
            }
        }
        return Ok(());
    }
    for image in dx.chunks_exact_mut(g.input_len()).take(n) {
        for oy in 0..out_h {
            for ox in 0..out_w {
                let row = rows.next().expect("d_cols holds n·OH·OW rows (checked)");
                let (y0, x0) = ((oy * s) as isize - p as isize, (ox * s) as isize - p as isize);
                for (c, row_c) in row.chunks_exact(k * k).enumerate() {
                    for (ky, row_ky) in row_c.chunks_exact(k).enumerate() {
                        let iy = y0 + ky as isize;
                        if iy < 0 || iy >= h {
                            continue;
                        }
                        let base = c * c_stride + iy as usize * y_stride;
                        for (kx, &d) in row_ky.iter().enumerate() {
                            let ix = x0 + kx as isize;
                            if ix >= 0 && ix < w {
                                image[base + ix as usize * x_stride] += d;
                            }
                        }
                    }
                }
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::linalg::{bias_act_rows, gemm, Mat};
    use crate::Activation;
    use proptest::prelude::*;

    fn geometry(c: usize, h: usize, w: usize, k: usize, s: usize, p: usize, last: bool) -> ConvGeometry {
        ConvGeometry {
            in_channels: c,
            in_height: h,
            in_width: w,
            out_channels: 3,
            kernel: k,
            stride: s,
            padding: p,
            channels_last: last,
        }
    }

    /// The textbook direct convolution, `y[n][oy][ox][oc]` (channel-last output).
    fn direct_conv(g: &ConvGeometry, x: &[f32], n: usize, weight: &[f32], bias: &[f32]) -> Vec<f32> {
        let (cs, ys, xs) = g.input_strides();
        let mut y = Vec::new();
        for image in x.chunks_exact(g.input_len()).take(n) {
            for oy in 0..g.out_height() {
                for ox in 0..g.out_width() {
                    for oc in 0..g.out_channels {
                        let mut acc = bias[oc] as f64;
                        for c in 0..g.in_channels {
                            for ky in 0..g.kernel {
                                for kx in 0..g.kernel {
                                    let iy = (oy * g.stride + ky) as isize - g.padding as isize;
                                    let ix = (ox * g.stride + kx) as isize - g.padding as isize;
                                    if iy < 0 || ix < 0 || iy >= g.in_height as isize || ix >= g.in_width as isize {
                                        continue;
                                    }
                                    let w = weight[oc * g.patch_len() + (c * g.kernel + ky) * g.kernel + kx];
                                    acc += w as f64 * image[c * cs + iy as usize * ys + ix as usize * xs] as f64;
                                }
                            }
                        }
                        y.push(acc.max(0.0) as f32);
                    }
                }
            }
        }
        y
    }

    fn values(len: usize, seed: f32) -> Vec<f32> {
        (0..len).map(|i| ((i as f32 + seed) * 0.731).sin()).collect()
    }

    #[test]
    fn presets_have_the_published_shapes() {
        let minatar = ConvSpec::minatar(4, 10, 10).geometries().unwrap();
        assert_eq!((minatar[0].out_height(), minatar[0].out_width(), minatar[0].output_len()), (8, 8, 1024));
        let nature = ConvSpec::nature(4, 84, 84).geometries().unwrap();
        let sides: Vec<_> = nature.iter().map(|g| (g.out_height(), g.out_channels, g.channels_last)).collect();
        assert_eq!(sides, [(20, 32, false), (9, 64, true), (7, 64, true)]);
        assert_eq!(nature[2].output_len(), 3136);
    }

    #[test]
    fn invalid_conv_specs_are_errors_naming_the_field() {
        let mut spec = ConvSpec::minatar(4, 10, 10);
        spec.layers[0].kernel = 11;
        let err = spec.geometries().unwrap_err().to_string();
        assert!(err.contains("conv.layers[0].kernel"), "{err}");
        let mut spec = ConvSpec::minatar(4, 10, 10);
        spec.layers[0].padding = 3;
        assert!(spec.geometries().unwrap_err().to_string().contains("padding"));
        let mut spec = ConvSpec::minatar(4, 10, 10);
        spec.layers[0].stride = 0;
        assert!(spec.geometries().is_err());
        let mut spec = ConvSpec::minatar(0, 10, 10);
        assert!(spec.geometries().unwrap_err().to_string().contains("conv.in_channels"));
        spec.in_channels = 1;
        spec.layers.clear();
        assert!(spec.geometries().is_err());
    }

    #[test]
    fn wrong_lengths_are_shape_errors() {
        let g = geometry(2, 5, 5, 3, 1, 1, false);
        let mut cols = vec![0.0; 2 * g.cols_len()];
        assert!(matches!(
            im2col(&g, &[0.0; 99], 2, &mut cols),
            Err(PolicyError::Shape { field: "x", expected: 100, got: 99 })
        ));
        assert!(matches!(col2im(&g, &cols[1..], 2, &mut [0.0; 100]), Err(PolicyError::Shape { field: "d_cols", .. })));
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(48))]

        /// im2col followed by the dense GEMM, bias and ReLU equals the direct convolution, for
        /// both input layouts, with strides and padding.
        #[test]
        fn im2col_gemm_equals_the_direct_convolution(
            c in 1usize..4, h in 3usize..9, w in 3usize..9, k in 1usize..4, s in 1usize..4,
            p in 0usize..3, last: bool, n in 1usize..3,
        ) {
            prop_assume!(p < k && k <= h.min(w) + 2 * p);
            let g = geometry(c, h, w, k, s, p, last);
            let x = values(n * g.input_len(), 0.5);
            let weight = values(g.out_channels * g.patch_len(), 3.0);
            let bias = values(g.out_channels, 7.0);
            let mut cols = vec![f32::NAN; n * g.cols_len()];
            im2col(&g, &x, n, &mut cols).unwrap();
            let rows = n * g.out_positions();
            let mut y = vec![0.0; rows * g.out_channels];
            gemm(1.0, Mat::row_major(&cols, rows, g.patch_len()), Mat::row_major(&weight, g.out_channels, g.patch_len()).t(), 0.0, &mut y);
            bias_act_rows(&mut y, &bias, Activation::Relu);
            let expected = direct_conv(&g, &x, n, &weight, &bias);
            for (i, (a, b)) in y.iter().zip(&expected).enumerate() {
                prop_assert!((a - b).abs() < 1e-5, "output {}: {} vs {}", i, a, b);
            }
        }

        /// col2im is the adjoint of im2col: ⟨im2col(x), d⟩ = ⟨x, col2im(d)⟩ for all x, d, which is
        /// exactly what makes it the input gradient of the unfolding.
        #[test]
        fn col2im_is_the_adjoint_of_im2col(
            c in 1usize..4, h in 3usize..9, w in 3usize..9, k in 1usize..4, s in 1usize..4,
            p in 0usize..3, last: bool, n in 1usize..3,
        ) {
            prop_assume!(p < k && k <= h.min(w) + 2 * p);
            let g = geometry(c, h, w, k, s, p, last);
            let x = values(n * g.input_len(), 1.5);
            let d = values(n * g.cols_len(), 9.0);
            let mut cols = vec![0.0; d.len()];
            im2col(&g, &x, n, &mut cols).unwrap();
            let mut dx = vec![f32::NAN; x.len()];
            col2im(&g, &d, n, &mut dx).unwrap();
            let lhs: f64 = cols.iter().zip(&d).map(|(a, b)| *a as f64 * *b as f64).sum();
            let rhs: f64 = x.iter().zip(&dx).map(|(a, b)| *a as f64 * *b as f64).sum();
            prop_assert!((lhs - rhs).abs() < 1e-4 * (1.0 + lhs.abs()), "{} vs {}", lhs, rhs);
        }
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(32))]

        /// Issue 44: channel-last unfolding and folding through 4 × 4 blocks give the bits of
        /// the definition (`cols[(n, oy, ox)][(c, ky, kx)] = x[n][iy][ix][c]`, and its adjoint
        /// summed in row order), for channel counts and kernel sizes around the block size.
        #[test]
        fn channel_last_blocks_give_the_bits_of_the_definition(
            c in 1usize..11, h in 3usize..9, w in 3usize..9, k in 1usize..5, s in 1usize..3, n in 1usize..3,
        ) {
            prop_assume!(k <= h.min(w));
            let g = geometry(c, h, w, k, s, 0, true);
            let x = values(n * g.input_len(), 2.5);
            let mut cols = vec![f32::NAN; n * g.cols_len()];
            im2col(&g, &x, n, &mut cols).unwrap();
            let d_cols = values(n * g.cols_len(), 4.5);
            let mut dx = vec![f32::NAN; x.len()];
            col2im(&g, &d_cols, n, &mut dx).unwrap();
            let mut want_dx = vec![0.0f32; x.len()];
            let (ow, oh) = (g.out_width(), g.out_height());
            for image in 0..n {
                for (oy, ox) in (0..oh).flat_map(|oy| (0..ow).map(move |ox| (oy, ox))) {
                    let row = ((image * oh + oy) * ow + ox) * g.patch_len();
                    for (ci, ky, kx) in (0..c).flat_map(|ci| (0..k).flat_map(move |ky| (0..k).map(move |kx| (ci, ky, kx)))) {
                        let at = image * g.input_len() + ((oy * s + ky) * w + ox * s + kx) * c + ci;
                        let col = row + (ci * k + ky) * k + kx;
                        prop_assert_eq!(cols[col].to_bits(), x[at].to_bits(), "cols[{}]", col);
                        want_dx[at] += d_cols[col];
                    }
                }
            }
            let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
            prop_assert_eq!(bits(&dx), bits(&want_dx));
        }
    }

    /// `L = Σ c ⊙ relu(conv(x))`: the input gradient through the GEMM and [`col2im`] matches
    /// central differences on every input element, for both layouts, with stride and padding.
    #[test]
    fn input_gradient_through_col2im_matches_finite_differences() {
        for g in
            [geometry(2, 7, 6, 3, 2, 1, false), geometry(3, 5, 5, 2, 1, 1, true), geometry(1, 6, 6, 4, 2, 0, false)]
        {
            let n = 2;
            let (rows, patch, oc) = (n * g.out_positions(), g.patch_len(), g.out_channels);
            let x = values(n * g.input_len(), 0.3);
            let weight = values(oc * patch, 2.0);
            let bias = values(oc, 5.0);
            let c = values(rows * oc, 8.0);
            let forward = |x: &[f32]| -> (f64, Vec<f32>) {
                let mut cols = vec![0.0; n * g.cols_len()];
                im2col(&g, x, n, &mut cols).unwrap();
                let mut y = vec![0.0; rows * oc];
                gemm(1.0, Mat::row_major(&cols, rows, patch), Mat::row_major(&weight, oc, patch).t(), 0.0, &mut y);
                bias_act_rows(&mut y, &bias, Activation::Relu);
                (y.iter().zip(&c).map(|(&y, &c)| f64::from(y) * f64::from(c)).sum(), y)
            };
            let (_, y) = forward(&x);
            let d_y: Vec<f32> = y.iter().zip(&c).map(|(&y, &c)| if y > 0.0 { c } else { 0.0 }).collect();
            let mut d_cols = vec![0.0; n * g.cols_len()];
            gemm(1.0, Mat::row_major(&d_y, rows, oc), Mat::row_major(&weight, oc, patch), 0.0, &mut d_cols);
            let mut dx = vec![0.0; x.len()];
            col2im(&g, &d_cols, n, &mut dx).unwrap();
            let pattern = |y: &[f32]| y.iter().map(|&v| v > 0.0).collect::<Vec<_>>();
            let (mut checked, mut x_p) = (0, x.clone());
            for i in 0..x.len() {
                let eps = 1e-3f32;
                x_p[i] = x[i] + eps;
                let (plus, y_plus) = forward(&x_p);
                x_p[i] = x[i] - eps;
                let (minus, y_minus) = forward(&x_p);
                x_p[i] = x[i];
                if pattern(&y_plus) != pattern(&y) || pattern(&y_minus) != pattern(&y) {
                    continue;
                }
                let numeric = (plus - minus) / (f64::from(x[i] + eps) - f64::from(x[i] - eps));
                let analytic = f64::from(dx[i]);
                assert!(
                    (analytic - numeric).abs() <= 2e-3 + 1e-2 * numeric.abs(),
                    "{g:?} x[{i}]: {analytic} vs {numeric}"
                );
                checked += 1;
            }
            assert!(checked * 10 >= x.len() * 9, "{g:?}: only {checked} of {} inputs checkable", x.len());
            assert!(dx.iter().any(|&d| d.abs() > 0.1), "{g:?}: gradients too small to test anything");
        }
    }

    #[test]
    fn scaled_u8_pixels_unfold_to_the_bits_of_their_scaled_float_values() {
        let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
        for g in
            [geometry(4, 9, 9, 3, 2, 0, false), geometry(2, 6, 5, 3, 2, 1, false), geometry(3, 5, 5, 2, 1, 0, true)]
        {
            let pixels: Vec<u8> = (0..3 * g.input_len()).map(|i| (i * 101 % 256) as u8).collect();
            for scale in [1.0, 1.0 / 255.0] {
                let floats: Vec<f32> = pixels.iter().map(|&v| f32::from(v) * scale).collect();
                let (mut a, mut b) = (vec![0.0; 3 * g.cols_len()], vec![0.0; 3 * g.cols_len()]);
                im2col_u8_scaled(&g, &pixels, 3, scale, &mut a).unwrap();
                im2col(&g, &floats, 3, &mut b).unwrap();
                assert_eq!(bits(&a), bits(&b), "{g:?} scale {scale}");
            }
        }
    }

    #[test]
    fn u8_pixels_unfold_like_their_float_values() {
        let g = geometry(2, 6, 5, 3, 2, 1, false);
        let pixels: Vec<u8> = (0..2 * g.input_len()).map(|i| (i * 37 % 256) as u8).collect();
        let floats: Vec<f32> = pixels.iter().map(|&v| v as f32).collect();
        let (mut a, mut b) = (vec![0.0; 2 * g.cols_len()], vec![0.0; 2 * g.cols_len()]);
        im2col_u8(&g, &pixels, 2, &mut a).unwrap();
        im2col(&g, &floats, 2, &mut b).unwrap();
        assert_eq!(a, b);
    }
}
