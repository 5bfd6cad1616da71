// Element-wise GRU cell kernels (PyTorch gate convention, gate blocks r, z, n side by side in
// [rows][3H] rows); the matrix products x W_i^T and h W_h^T are cuBLAS calls. Mirrors
// policy/src/gru.rs unit for unit.

// dst[b] = starts[b] != 0 ? 0 : src[b]: the state entering a step, zeroed where an episode starts.
extern "C" __global__ void gru_reset_copy(const float* src, const float* starts, float* dst, int b_len, int hidden) {
    const int n = b_len * hidden;
    for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x) {
        dst[i] = starts[i / hidden] != 0.0f ? 0.0f : src[i];
    }
}

// One step forward: gi, gh [B][3H] (biases included), h_prev [B][H] -> gates [B][3H] = r, z, n
// and h_out [B][H].
extern "C" __global__ void gru_cell_fwd(const float* gi, const float* gh, const float* h_prev, float* gates, float* h_out, int b_len, int hidden) {
    const int n = b_len * hidden;
    for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x) {
        const int b = i / hidden;
        const int j = i - b * hidden;
        const long long g = (long long)b * 3 * hidden + j;
        const float r = volley_sigmoid(gi[g] + gh[g]);
        const float z = volley_sigmoid(gi[g + hidden] + gh[g + hidden]);
        const float c = volley_tanh(gi[g + 2 * hidden] + r * gh[g + 2 * hidden]);
        gates[g] = r;
        gates[g + hidden] = z;
        gates[g + 2 * hidden] = c;
        h_out[i] = (1.0f - z) * c + z * h_prev[i];
    }
}

// One step backward. On entry dh holds dL/dh' ([B][H]); on exit its direct part dL/dh' * z (the
// caller adds dgh W_h). Writes dgi and dgh ([B][3H]), the gradients of the gate pre-sums.
extern "C" __global__ void gru_cell_bwd(float* dh, const float* gates, const float* gh, const float* h_prev, float* dgi, float* dgh, int b_len, int hidden) {
    const int n = b_len * hidden;
    for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x) {
        const int b = i / hidden;
        const int j = i - b * hidden;
        const long long g = (long long)b * 3 * hidden + j;
        const float r = gates[g], z = gates[g + hidden], c = gates[g + 2 * hidden];
        const float d = dh[i];
        const float da_n = d * (1.0f - z) * (1.0f - c * c);
        const float da_r = da_n * gh[g + 2 * hidden] * r * (1.0f - r);
        const float da_z = d * (h_prev[i] - c) * z * (1.0f - z);
        dgi[g] = da_r;
        dgi[g + hidden] = da_z;
        dgi[g + 2 * hidden] = da_n;
        dgh[g] = da_r;
        dgh[g + hidden] = da_z;
        dgh[g + 2 * hidden] = da_n * r;
        dh[i] = d * z;
    }
}

// dh[b] = 0 where an episode started at this step (the zeroed state gets no gradient), then
// dh += from_heads (the next step's gradient arriving from the heads).
extern "C" __global__ void gru_carry_grad(float* dh, const float* starts, const float* from_heads, int b_len, int hidden, int apply_reset) {
    const int n = b_len * hidden;
    for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x) {
        float d = dh[i];
        if (apply_reset && starts[i / hidden] != 0.0f) d = 0.0f;
        dh[i] = d + from_heads[i];
    }
}
