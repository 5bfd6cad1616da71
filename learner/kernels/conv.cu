// The conv torso as im2col + the cuBLAS products of the dense layers (volley_policy's conv.rs
// has the layouts). An image's element (c, y, x) sits at c*H*W + y*W + x for the observation
// (channels_last = 0) and at (y*W + x)*C + c for an earlier conv layer's output (channels_last = 1).

__device__ __forceinline__ long long conv_input_index(int c, int y, int x, int c_in, int h, int w, int channels_last) {
    return channels_last ? ((long long)y * w + x) * c_in + c : ((long long)c * h + y) * w + x;
}

// cols[(img, oy, ox)][(c, ky, kx)] = x[img](c, oy*stride - pad + ky, ox*stride - pad + kx), or 0
// in the padding; `read(img, e)` gives element e of image img as a float. One thread per
// element of cols, so consecutive threads write consecutive addresses.
template <typename Read>
__device__ __forceinline__ void im2col_body(Read read, float* cols, int n, int c_in, int h, int w, int k, int stride,
                                            int pad, int out_h, int out_w, int channels_last) {
    const int patch = c_in * k * k;
    const long long total = (long long)n * out_h * out_w * patch;
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < total; i += (long long)gridDim.x * blockDim.x) {
        const int col = (int)(i % patch);
        const long long row = i / patch;
        const int ox = (int)(row % out_w);
        const long long rest = row / out_w;
        const int oy = (int)(rest % out_h);
        const long long img = rest / out_h;
        const int kx = col % k;
        const int ky = (col / k) % k;
        const int c = col / (k * k);
        const int iy = oy * stride - pad + ky;
        const int ix = ox * stride - pad + kx;
        float v = 0.0f;
        if (iy >= 0 && iy < h && ix >= 0 && ix < w) {
            v = read(img, conv_input_index(c, iy, ix, c_in, h, w, channels_last));
        }
        cols[i] = v;
    }
}

extern "C" __global__ void im2col(const float* x, float* cols, int n, int c_in, int h, int w, int k, int stride,
                                  int pad, int out_h, int out_w, int channels_last) {
    const long long image_len = (long long)c_in * h * w;
    auto read = [=](long long img, long long e) { return x[img * image_len + e]; };
    im2col_body(read, cols, n, c_in, h, w, k, stride, pad, out_h, out_w, channels_last);
}

// The adjoint of im2col: every input element gathers the d_cols entries that read it, over the
// kernel offsets (ky, kx) whose output position ((iy + pad - ky) / stride, (ix + pad - kx) / stride)
// is whole and inside the output. One thread per input element, so no atomics and a fixed
// summation order.
extern "C" __global__ void col2im(const float* d_cols, float* dx, int n, int c_in, int h, int w, int k, int stride,
                                  int pad, int out_h, int out_w, int channels_last) {
    const int patch = c_in * k * k;
    const long long image_len = (long long)c_in * h * w;
    const long long total = (long long)n * image_len;
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < total; i += (long long)gridDim.x * blockDim.x) {
        const long long img = i / image_len;
        const long long e = i % image_len;
        int c, iy, ix;
        if (channels_last) {
            c = (int)(e % c_in);
            ix = (int)((e / c_in) % w);
            iy = (int)(e / ((long long)c_in * w));
        } else {
            ix = (int)(e % w);
            iy = (int)((e / w) % h);
            c = (int)(e / ((long long)h * w));
        }
        float sum = 0.0f;
        for (int ky = 0; ky < k; ++ky) {
            const int ty = iy + pad - ky;
            if (ty < 0 || ty % stride != 0 || ty / stride >= out_h) continue;
            const int oy = ty / stride;
            for (int kx = 0; kx < k; ++kx) {
                const int tx = ix + pad - kx;
                if (tx < 0 || tx % stride != 0 || tx / stride >= out_w) continue;
                const int ox = tx / stride;
                sum += d_cols[((img * out_h + oy) * out_w + ox) * patch + (c * k + ky) * k + kx];
            }
        }
        dx[i] = sum;
    }
}

// im2col over image observations of one byte per value (issue 44 item 3): x is the staged
// float buffer read as bytes, image img's C*H*W bytes starting at byte img * image_stride (each
// image starts at a word: image_stride = 4 * ceil(C*H*W / 4)), and byte v enters cols as
// table[v] = (float)v * scale, which the host computes (so the values are those of the f32
// path bit for bit). Same thread mapping as im2col (im2col_body).
extern "C" __global__ void im2col_u8(const unsigned char* x, float* cols, const float* table, long long image_stride,
                                     int n, int c_in, int h, int w, int k, int stride, int pad, int out_h, int out_w,
                                     int channels_last) {
    auto read = [=](long long img, long long e) { return table[x[img * image_stride + e]]; };
    im2col_body(read, cols, n, c_in, h, w, k, stride, pad, out_h, out_w, channels_last);
}

// Widen rows of bytes into floats: out[r * width + j] = table[x[r * row_stride + j]], row r's
// bytes starting at byte r * row_stride (a word boundary). One thread per output element.
extern "C" __global__ void widen_u8(const unsigned char* x, float* out, const float* table, long long row_stride,
                                    int rows, int width) {
    const long long total = (long long)rows * width;
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < total; i += (long long)gridDim.x * blockDim.x) {
        const long long r = i / width;
        const int j = (int)(i % width);
        out[i] = table[x[r * row_stride + j]];
    }
}
