// Shared device helpers for Volley's learner kernels. Prepended to every .cu file before NVRTC
// compiles it (NVRTC has no include path here), so each kernel file stays self-contained.
//
// Layout conventions (the same as the CPU backend, learner/src and policy/src):
// - every matrix is row-major; a batch is time-major `[T][B]` flattened as `t * B + b`;
// - the two heads form one `[rows][A + 1]` block: columns 0..A are logits, column A the value;
// - reductions accumulate in double, as the CPU backend does, with one atomicAdd per block.

#define VOLLEY_BLOCK 256

typedef unsigned int u32;

// Eigen's [13/6] rational fit of tanh with the input clamped to +-7.905311 (the CPU backend's
// fast_tanh, policy/src/linalg.rs): the same coefficients, so both backends agree to ~1e-6.
__device__ __forceinline__ float volley_tanh(float x) {
    const float clamp = 7.90531110763549805f;
    x = fminf(fmaxf(x, -clamp), clamp);
    float x2 = x * x;
    float p = -2.76076847742355e-16f;
    p = p * x2 + 2.00018790482477e-13f;
    p = p * x2 - 8.60467152213735e-11f;
    p = p * x2 + 5.12229709037114e-08f;
    p = p * x2 + 1.48572235717979e-05f;
    p = p * x2 + 6.37261928875436e-04f;
    p = p * x2 + 4.89352455891786e-03f;
    p = p * x;
    float q = 1.19825839466702e-06f;
    q = q * x2 + 1.18534705686654e-04f;
    q = q * x2 + 2.26843463243900e-03f;
    q = q * x2 + 4.89352518554385e-03f;
    return p / q;
}

__device__ __forceinline__ float volley_sigmoid(float x) { return 0.5f + 0.5f * volley_tanh(0.5f * x); }

// Sum of `v` over the block; the result is valid in thread 0. Needs blockDim.x a multiple of 32
// and at most 1024.
__device__ __forceinline__ double volley_block_sum(double v) {
    __shared__ double warp_sums[32];
    for (int offset = 16; offset > 0; offset >>= 1) v += __shfl_down_sync(0xffffffffu, v, offset);
    const int lane = threadIdx.x & 31;
    const int warp = threadIdx.x >> 5;
    __syncthreads();  // warp_sums may still be read by a previous call
    if (lane == 0) warp_sums[warp] = v;
    __syncthreads();
    const int n_warps = (blockDim.x + 31) >> 5;
    v = (threadIdx.x < n_warps) ? warp_sums[threadIdx.x] : 0.0;
    if (warp == 0) {
        for (int offset = 16; offset > 0; offset >>= 1) v += __shfl_down_sync(0xffffffffu, v, offset);
    }
    return v;
}

// Log-softmax statistics of one logits row (stride 1): the max and log-sum-exp shift, so that
// log p_j = (z_j - max) - log_sum.
__device__ __forceinline__ void volley_log_softmax_row(const float* z, int n, float* max_out, float* log_sum_out) {
    float m = __int_as_float(0xff800000);  // -inf
    for (int j = 0; j < n; ++j) m = fmaxf(m, z[j]);
    float s = 0.0f;
    for (int j = 0; j < n; ++j) s += expf(z[j] - m);
    *max_out = m;
    *log_sum_out = logf(s);
}
