// Global-norm gradient clipping (Pascanu et al. 2013) fused into Adam (Kingma & Ba 2015, PyTorch's
// bias-correction form) over the flat parameter buffer. The step decision (skip a non-finite
// gradient), the step count and the bias corrections live on the device, so a gradient step needs
// no host round trip. Mirrors learner/src/optim.rs.

// acc[0] += sum_i g_i^2.
extern "C" __global__ void sum_squares(const float* g, long long n, double* acc) {
    double s = 0.0;
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n; i += (long long)gridDim.x * blockDim.x) {
        const double v = g[i];
        s += v * v;
    }
    s = volley_block_sum(s);
    if (threadIdx.x == 0) atomicAdd(acc, s);
}

// One thread. From the squared norm in sumsq[0]: norm_out[0] = ||g||; if it is finite, step[0]
// (Adam's t, a double) += 1 and coeffs = [clip scale, lr / (1 - beta1^t), 1 / sqrt(1 - beta2^t), 1];
// otherwise coeffs[3] = 0 and the step is skipped.
extern "C" __global__ void adam_prepare(const double* sumsq, double* step, float* coeffs, float* norm_out, float lr, float max_norm,
                                        float beta1, float beta2) {
    if (blockIdx.x != 0 || threadIdx.x != 0) return;
    const double norm = sqrt(sumsq[0]);
    norm_out[0] = (float)norm;
    if (!isfinite(norm)) {
        coeffs[3] = 0.0f;
        return;
    }
    coeffs[0] = norm > (double)max_norm ? (float)((double)max_norm / norm) : 1.0f;
    const double t = step[0] + 1.0;
    step[0] = t;
    coeffs[1] = (float)((double)lr / (1.0 - pow((double)beta1, t)));
    coeffs[2] = (float)(1.0 / sqrt(1.0 - pow((double)beta2, t)));
    coeffs[3] = 1.0f;
}

extern "C" __global__ void adam_step(float* params, const float* grads, float* m, float* v, const float* coeffs, float beta1,
                                     float beta2, float eps, long long n) {
    if (coeffs[3] == 0.0f) return;
    const float clip = coeffs[0], step_size = coeffs[1], inv_sqrt_bc2 = coeffs[2];
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n; i += (long long)gridDim.x * blockDim.x) {
        const float g = clip == 1.0f ? grads[i] : grads[i] * clip;
        const float m_i = beta1 * m[i] + (1.0f - beta1) * g;
        const float v_i = beta2 * v[i] + (1.0f - beta2) * g * g;
        m[i] = m_i;
        v[i] = v_i;
        params[i] -= step_size * m_i / (sqrtf(v_i) * inv_sqrt_bc2 + eps);
    }
}
