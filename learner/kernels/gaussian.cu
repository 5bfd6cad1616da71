// Diagonal Gaussian action head (issue 14): log-densities and the fused V-trace / PPO loss
// gradients for heads rows whose first A columns are means, with the state-independent log-std
// vector log_std[A]. Mirrors policy/src/gaussian.rs and learner/src/gaussian_losses.rs (same
// formulas, f32 per sample, double sums). Actions are [n][A] floats as the actor recorded them;
// with squash != 0 they are tanh(u), and u = atanh(a) is recovered here.

#define VOLLEY_LOG_STD_MIN (-20.0f)
#define VOLLEY_LOG_STD_MAX 2.0f
#define VOLLEY_SQUASH_LIMIT (1.0f - 1e-6f)
#define VOLLEY_HALF_LN_2PI 0.9189385332046727f
#define VOLLEY_LN_2 0.6931471805599453f

// Block-reduce the six weighted loss sums and add them to stats[0..6] (as loss.cu's
// volley_add_stats; each file compiles on its own in the NVRTC check).
__device__ __forceinline__ void volley_gaussian_add_stats(double* stats, double policy, double value, double entropy, double ratio,
                                                          double clipped, double kl) {
    policy = volley_block_sum(policy);
    value = volley_block_sum(value);
    entropy = volley_block_sum(entropy);
    ratio = volley_block_sum(ratio);
    clipped = volley_block_sum(clipped);
    kl = volley_block_sum(kl);
    if (threadIdx.x == 0) {
        atomicAdd(stats + 0, policy);
        atomicAdd(stats + 1, value);
        atomicAdd(stats + 2, entropy);
        atomicAdd(stats + 3, ratio);
        atomicAdd(stats + 4, clipped);
        atomicAdd(stats + 5, kl);
    }
}

__device__ __forceinline__ float volley_softplus(float x) { return fmaxf(x, 0.0f) + log1pf(expf(-fabsf(x))); }

// One row: returns log pi(a) and, when d_mean != NULL, writes the gradient of
// -pg_scale * log pi(a) - ent_scale * H w.r.t. the means (d_mean, stride 1) and the log-stds
// (d_log_std, stride 1; zero where the log-std is clamped).
__device__ __forceinline__ float volley_gaussian_row(const float* mean, const float* log_std, const float* action, int a_dim, int squash,
                                                     float pg_scale, float ent_scale, float* d_mean, float* d_log_std) {
    float total = 0.0f;
    for (int j = 0; j < a_dim; ++j) {
        const float s_raw = log_std[j];
        const float s = fminf(fmaxf(s_raw, VOLLEY_LOG_STD_MIN), VOLLEY_LOG_STD_MAX);
        const float inv_sigma = expf(-s);
        float u = action[j];
        if (squash) u = atanhf(fminf(fmaxf(u, -VOLLEY_SQUASH_LIMIT), VOLLEY_SQUASH_LIMIT));
        const float z = (u - mean[j]) * inv_sigma;
        total += -0.5f * z * z - s - VOLLEY_HALF_LN_2PI;
        if (squash) total -= 2.0f * (VOLLEY_LN_2 - u - volley_softplus(-2.0f * u));
        if (d_mean) {
            d_mean[j] = -pg_scale * z * inv_sigma;
            const bool inside = s_raw >= VOLLEY_LOG_STD_MIN && s_raw <= VOLLEY_LOG_STD_MAX;
            d_log_std[j] = inside ? -pg_scale * (z * z - 1.0f) - ent_scale : 0.0f;
        }
    }
    return total;
}

__device__ __forceinline__ float volley_gaussian_entropy(const float* log_std, int a_dim) {
    float h = 0.0f;
    for (int j = 0; j < a_dim; ++j) h += fminf(fmaxf(log_std[j], VOLLEY_LOG_STD_MIN), VOLLEY_LOG_STD_MAX) + 0.5f + VOLLEY_HALF_LN_2PI;
    return h;
}

// One thread per sample row i < n: out[i] = log pi(a_i | x_i) - ref[i] (ref == NULL: log pi itself).
extern "C" __global__ void gaussian_log_probs(const float* heads, int stride, int a_dim, const float* log_std, const float* actions,
                                              int squash, const float* ref, float* out, int n) {
    for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x) {
        const float lp = volley_gaussian_row(heads + (long long)i * stride, log_std, actions + (long long)i * a_dim, a_dim, squash, 0.0f,
                                             0.0f, 0, 0);
        out[i] = ref ? lp - ref[i] : lp;
    }
}

// The IMPALA loss with V-trace targets for a Gaussian head, one thread per row: gradient rows of
// the heads block for the n sample rows (rows n..n_rows, the bootstrap row, get zero), per-row
// log-std gradients d_log_std[n][A], and the weighted sums into stats. moments[0] holds W.
extern "C" __global__ void gaussian_vtrace_loss_grad(const float* heads, int stride, int a_dim, const float* log_std, const float* actions,
                                                     int squash, const float* weights, const float* values, const float* vs,
                                                     const float* log_rhos, const float* pg_adv, float rho_bar, float value_coef,
                                                     float ent_coef, int n, int n_rows, const double* moments, float* d_heads,
                                                     float* d_log_std, double* stats) {
    const double weight_sum = moments[0];
    const float inv_weight_sum = weight_sum > 0.0 ? (float)(1.0 / weight_sum) : 0.0f;
    const float entropy = volley_gaussian_entropy(log_std, a_dim);
    double s_policy = 0.0, s_value = 0.0, s_entropy = 0.0, s_ratio = 0.0, s_clipped = 0.0, s_kl = 0.0;
    for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < n_rows; i += gridDim.x * blockDim.x) {
        float* d = d_heads + (long long)i * stride;
        const float w = i < n ? weights[i] : 0.0f;
        if (w == 0.0f || weight_sum <= 0.0) {
            for (int j = 0; j < stride; ++j) d[j] = 0.0f;
            if (i < n) {
                for (int j = 0; j < a_dim; ++j) d_log_std[(long long)i * a_dim + j] = 0.0f;
            }
            continue;
        }
        const float scale = w * inv_weight_sum;
        const float pg = pg_adv[i];
        const float log_prob = volley_gaussian_row(heads + (long long)i * stride, log_std, actions + (long long)i * a_dim, a_dim, squash,
                                                   scale * pg, scale * ent_coef, d, d_log_std + (long long)i * a_dim);
        const float value_error = vs[i] - values[i];
        d[a_dim] = -value_coef * scale * value_error;
        const float log_rho = log_rhos[i];
        const float rho = expf(log_rho);
        const double wd = w;
        s_policy += wd * (double)(-pg * log_prob);
        s_value += wd * 0.5 * (double)value_error * (double)value_error;
        s_entropy += wd * (double)entropy;
        s_ratio += wd * (double)rho;
        if (rho > rho_bar) s_clipped += wd;
        s_kl += wd * (((double)rho - 1.0) - (double)log_rho);
    }
    volley_gaussian_add_stats(stats, s_policy, s_value, s_entropy, s_ratio, s_clipped, s_kl);
}

// Decoupled PPO-clip for a Gaussian head over n rows, one thread per row; moments = [W, sum w A,
// sum w (A - mean)^2] from weighted_sum / weighted_var.
extern "C" __global__ void gaussian_ppo_loss_grad(const float* heads, int stride, int a_dim, const float* log_std, const float* actions,
                                                  int squash, const float* weights, const float* values, const float* advantages,
                                                  const float* returns, const float* prox_log_probs, const float* is_weights, float clip_coef,
                                                  float value_coef, float ent_coef, int normalize, int n, const double* moments,
                                                  float* d_heads, float* d_log_std, double* stats) {
    const double weight_sum = moments[0];
    const float inv_weight_sum = weight_sum > 0.0 ? (float)(1.0 / weight_sum) : 0.0f;
    float adv_shift = 0.0f, adv_scale = 1.0f;
    if (normalize && weight_sum > 0.0) {
        const double mean = moments[1] / weight_sum;
        const double variance = moments[2] / weight_sum;
        adv_shift = (float)mean;
        adv_scale = (float)(1.0 / (sqrt(variance) + 1e-8));
    }
    const float clip_low = 1.0f - clip_coef, clip_high = 1.0f + clip_coef;
    const float entropy = volley_gaussian_entropy(log_std, a_dim);
    double s_policy = 0.0, s_value = 0.0, s_entropy = 0.0, s_ratio = 0.0, s_clipped = 0.0, s_kl = 0.0;
    for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x) {
        float* d = d_heads + (long long)i * stride;
        float* ds = d_log_std + (long long)i * a_dim;
        const float w = weights[i];
        if (w == 0.0f || weight_sum <= 0.0) {
            for (int j = 0; j < stride; ++j) d[j] = 0.0f;
            for (int j = 0; j < a_dim; ++j) ds[j] = 0.0f;
            continue;
        }
        const float* mean = heads + (long long)i * stride;
        const float* action = actions + (long long)i * a_dim;
        const float scale = w * inv_weight_sum;
        const float log_prob = volley_gaussian_row(mean, log_std, action, a_dim, squash, 0.0f, 0.0f, 0, 0);
        const float log_ratio = log_prob - prox_log_probs[i];
        const float ratio = expf(log_ratio);
        const float advantage = (advantages[i] - adv_shift) * adv_scale;
        const float unclipped = ratio * advantage;
        const float clipped = fminf(fmaxf(ratio, clip_low), clip_high) * advantage;
        const bool take_unclipped = unclipped <= clipped;
        const float surrogate = take_unclipped ? unclipped : clipped;
        const float surrogate_grad = take_unclipped ? unclipped : 0.0f;
        const float is_w = is_weights[i];
        volley_gaussian_row(mean, log_std, action, a_dim, squash, scale * is_w * surrogate_grad, scale * ent_coef, d, ds);
        const float value_error = returns[i] - values[i];
        d[a_dim] = -value_coef * scale * value_error;
        const double wd = w;
        s_policy -= wd * (double)(is_w * surrogate);
        s_value += wd * 0.5 * (double)value_error * (double)value_error;
        s_entropy += wd * (double)entropy;
        s_ratio += wd * (double)ratio;
        if (fabsf(ratio - 1.0f) > clip_coef) s_clipped += wd;
        s_kl += wd * (((double)ratio - 1.0) - (double)log_ratio);
    }
    volley_gaussian_add_stats(stats, s_policy, s_value, s_entropy, s_ratio, s_clipped, s_kl);
}
