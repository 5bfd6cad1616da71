// Element-wise kernels around the cuBLAS products of the torso and heads.

// y[r][j] = act(y[r][j] + bias[j]); act: 0 = identity, 1 = tanh, 2 = relu.
extern "C" __global__ void bias_act_fwd(float* y, const float* bias, int rows, int width, int act) {
    const long long n = (long long)rows * width;
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n; i += (long long)gridDim.x * blockDim.x) {
        float v = y[i] + bias[i % width];
        if (act == 1) v = volley_tanh(v);
        else if (act == 2) v = fmaxf(v, 0.0f);
        y[i] = v;
    }
}

// dy <- dy * act'(pre), written through the stored output y: 1 - y^2 (tanh), [y > 0] (relu).
extern "C" __global__ void act_bwd(float* dy, const float* y, long long n, int act) {
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n; i += (long long)gridDim.x * blockDim.x) {
        const float out = y[i];
        if (act == 1) dy[i] *= 1.0f - out * out;
        else if (act == 2 && out <= 0.0f) dy[i] = 0.0f;
    }
}

// dst[i] = src[i * stride + col]: one column of a row-major block (the value head's outputs).
extern "C" __global__ void take_column(const float* src, float* dst, int rows, int stride, int col) {
    for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < rows; i += gridDim.x * blockDim.x) {
        dst[i] = src[(long long)i * stride + col];
    }
}

// dst[r][dst_col + k] = src[r][src_col + k] for k < cols, over n = rows * cols elements: a block
// of columns between two row-major blocks (a separate value network's heads into one block).
extern "C" __global__ void copy_columns(const float* src, float* dst, long long n, int src_width, int src_col, int dst_width, int dst_col, int cols) {
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n; i += (long long)gridDim.x * blockDim.x) {
        const long long r = i / cols;
        const int k = (int)(i % cols);
        dst[r * dst_width + dst_col + k] = src[r * src_width + src_col + k];
    }
}

// Whole columns (sequences) of a time-major [rows][b_len][width] block, as 32-bit words (floats
// and action indices alike): dst[t][j][k] = src[t][cols[j]][k] for j < mb_len.
extern "C" __global__ void gather_columns(const u32* src, u32* dst, int rows, int b_len, int width, const int* cols, int mb_len) {
    const long long n = (long long)rows * mb_len * width;
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n; i += (long long)gridDim.x * blockDim.x) {
        const int k = (int)(i % width);
        const long long tj = i / width;
        const int j = (int)(tj % mb_len);
        const long long t = tj / mb_len;
        dst[i] = src[(t * b_len + cols[j]) * width + k];
    }
}

extern "C" __global__ void fill(float* x, float value, long long n) {
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n; i += (long long)gridDim.x * blockDim.x) {
        x[i] = value;
    }
}
