// Loss kernels: the policy heads' device functions, the V-trace and GAE reverse scans over time,
// weighted moments, and the fused V-trace / PPO losses that write the heads' gradient rows, each
// written once as a template over the head and instantiated per head at the end of this file.
// Mirrors learner/src/losses.rs, policy/src/head.rs and policy/src/returns (same formulas, f32
// per sample, double sums).

// out[i] = min(exp(prox[i] - behaviour[i]), clip): decoupled PPO's behaviour weights (Hilton et al. 2021).
extern "C" __global__ void behaviour_weights(const float* prox, const float* behaviour, float clip, float* out, int n) {
    for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x) {
        out[i] = fminf(expf(prox[i] - behaviour[i]), clip);
    }
}

// V-trace targets and policy-gradient advantages (Espeholt et al. 2018, eq. (1), sec. 4.2):
// one thread per batch column walks time backwards; every load is coalesced across columns.
// `vs` doubles as the carry, as in policy/src/returns/vtrace.rs. With `has_override`, a finite
// `adv_override[i]` (group baselines) replaces `reward + discount * vs_next - v` in the
// policy-gradient advantage, as learner/src/losses.rs `override_pg_advantages` does.
extern "C" __global__ void vtrace_scan(int t_len, int b_len, const float* log_rhos, const float* discounts, const float* rewards,
                                       const float* values, const float* bootstrap, float rho_bar, float pg_rho_bar, float c_bar,
                                       float lambda_, int has_override, const float* adv_override, float* vs, float* pg_adv) {
    const int b = blockIdx.x * blockDim.x + threadIdx.x;
    if (b >= b_len) return;
    float v_next = bootstrap[b];
    float vs_next = v_next;
    for (int t = t_len - 1; t >= 0; --t) {
        const long long i = (long long)t * b_len + b;
        const float rho = expf(log_rhos[i]);
        const float discount = discounts[i];
        const float reward = rewards[i];
        const float v = values[i];
        const float clipped_rho = fminf(rho, rho_bar);
        const float c = lambda_ * fminf(rho, c_bar);
        const float delta = clipped_rho * (reward + discount * v_next - v);
        const float vs_t = v + delta + discount * c * (vs_next - v_next);
        vs[i] = vs_t;
        const float own = reward + discount * vs_next - v;
        const float a = (has_override && isfinite(adv_override[i])) ? adv_override[i] : own;
        pg_adv[i] = fminf(rho, pg_rho_bar) * a;
        vs_next = vs_t;
        v_next = v;
    }
}

// GAE(gamma, lambda) advantages and lambda-returns (Schulman et al. 2016, eq. (16)). With
// `has_override`, a finite `adv_override[i]` (group baselines) is written as the advantage; the
// recursion and the returns stay GAE's.
extern "C" __global__ void gae_scan(int t_len, int b_len, const float* discounts, const float* rewards, const float* values,
                                    const float* bootstrap, float lambda_, int has_override, const float* adv_override,
                                    float* adv, float* ret) {
    const int b = blockIdx.x * blockDim.x + threadIdx.x;
    if (b >= b_len) return;
    float v_next = bootstrap[b];
    float adv_next = 0.0f;
    for (int t = t_len - 1; t >= 0; --t) {
        const long long i = (long long)t * b_len + b;
        const float discount = discounts[i];
        const float v = values[i];
        const float delta = rewards[i] + discount * v_next - v;
        const float a = delta + discount * lambda_ * adv_next;
        adv[i] = (has_override && isfinite(adv_override[i])) ? adv_override[i] : a;
        ret[i] = a + v;
        adv_next = a;
        v_next = v;
    }
}

// acc[0] += sum_i w_i; acc[1] += sum_i w_i x_i (x may be NULL).
extern "C" __global__ void weighted_sum(const float* w, const float* x, int n, double* acc) {
    double sw = 0.0, swx = 0.0;
    for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x) {
        const double wi = w[i];
        sw += wi;
        if (x && wi != 0.0) swx += wi * (double)x[i];
    }
    sw = volley_block_sum(sw);
    swx = volley_block_sum(swx);
    if (threadIdx.x == 0) {
        atomicAdd(acc, sw);
        atomicAdd(acc + 1, swx);
    }
}

// acc[2] += sum_{w_i != 0} w_i (x_i - mean)^2 with mean = acc[1] / acc[0].
extern "C" __global__ void weighted_var(const float* w, const float* x, int n, double* acc) {
    const double mean = acc[0] > 0.0 ? acc[1] / acc[0] : 0.0;
    double s = 0.0;
    for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x) {
        const double wi = w[i];
        if (wi != 0.0) {
            const double d = (double)x[i] - mean;
            s += wi * d * d;
        }
    }
    s = volley_block_sum(s);
    if (threadIdx.x == 0) atomicAdd(acc + 2, s);
}

// Block-reduce the six weighted loss sums and add them to stats[0..6]: policy, value, entropy,
// ratio, clipped weight, approx-KL (k3).
__device__ __forceinline__ void volley_add_stats(double* stats, double policy, double value, double entropy, double ratio, double clipped, double kl) {
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

// Off-policy health of one update (learner/src/telemetry.rs, `OffPolicySums::add`: the same terms),
// grid-stride over samples: over the samples with w > 0, sums[0..10] += [w, w [rho > rho_bar],
// w [rho > c_bar], w ((rho - 1) - log rho), w rho, w rho^2, w target, w target^2, w err, w err^2]
// with err = target - value; ratios[i] = rho, or -1 (telemetry::NO_RATIO) where w <= 0.
extern "C" __global__ void off_policy_sums(const float* log_rhos, const float* ref, const float* weights, const float* values,
                                           const float* targets, float rho_bar, float c_bar, int n, double* sums,
                                           float* ratios) {
    double acc[10] = {0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0};
    for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x) {
        const double w = weights[i];
        if (w <= 0.0) {
            ratios[i] = -1.0f;
            continue;
        }
        // The difference in float, as the CPU backend takes it (ref: PPO's behaviour log-probs).
        const double log_rho = ref == NULL ? log_rhos[i] : log_rhos[i] - ref[i];
        const double rho = exp(log_rho);
        ratios[i] = (float)rho;
        const double target = targets[i];
        const double err = target - (double)values[i];
        acc[0] += w;
        if (rho > (double)rho_bar) acc[1] += w;
        if (rho > (double)c_bar) acc[2] += w;
        // expm1 keeps (rho - 1) - log rho exact near rho = 1, where both terms cancel.
        acc[3] += w * (expm1(log_rho) - log_rho);
        acc[4] += w * rho;
        acc[5] += w * rho * rho;
        acc[6] += w * target;
        acc[7] += w * target * target;
        acc[8] += w * err;
        acc[9] += w * err * err;
    }
    for (int k = 0; k < 10; ++k) {
        const double total = volley_block_sum(acc[k]);
        if (threadIdx.x == 0) atomicAdd(sums + k, total);
    }
}

// ---- Policy heads: the device side of volley_policy::head::PolicyHead ----
// A head is built in each thread from the uniform head arguments every head kernel takes
// (n_outputs, the head's own parameters, flags) and offers what the loss bodies need:
// action_width() and n_param_grads(); log_prob(z, action) for one row of outputs z and one
// recorded action; row_grad(...), which writes the gradient of -pg_scale * log pi(a) -
// ent_scale * H(pi) w.r.t. the row's outputs (d) and the head's parameters (d_params), and
// returns log pi(a) and H. Actions are floats: a categorical action is its index's bit pattern.

// Softmax over n logits (policy/src/head.rs `Categorical`).
struct VolleyCategorical {
    int n;
    __device__ VolleyCategorical(int n_outputs, const float*, int) : n(n_outputs) {}
    __device__ int action_width() const { return 1; }
    __device__ int n_param_grads() const { return 0; }
    __device__ float log_prob(const float* z, const float* action) const {
        float m, log_sum;
        volley_log_softmax_row(z, n, &m, &log_sum);
        return (z[__float_as_uint(action[0])] - m) - log_sum;
    }
    // d_j = pg_scale (p_j - [j = a]) + ent_scale p_j (log p_j + H).
    __device__ void row_grad(const float* z, const float* action, float pg_scale, float ent_scale, float* d, float*,
                             float* log_prob_out, float* entropy_out) const {
        const u32 a = __float_as_uint(action[0]);
        float m, log_sum;
        volley_log_softmax_row(z, n, &m, &log_sum);
        float entropy = 0.0f;
        for (int j = 0; j < n; ++j) {
            const float lp = (z[j] - m) - log_sum;
            const float p = expf(lp);
            if (p > 0.0f) entropy -= p * lp;
        }
        for (int j = 0; j < n; ++j) {
            const float lp = (z[j] - m) - log_sum;
            const float p = expf(lp);
            const float entropy_grad = p > 0.0f ? p * (lp + entropy) : 0.0f;
            d[j] = pg_scale * (p - (j == (int)a ? 1.0f : 0.0f)) + ent_scale * entropy_grad;
        }
        *entropy_out = entropy;
        *log_prob_out = (z[a] - m) - log_sum;
    }
};

#define VOLLEY_LOG_STD_MIN (-20.0f)
#define VOLLEY_LOG_STD_MAX 2.0f
#define VOLLEY_SQUASH_LIMIT (1.0f - 1e-6f)
#define VOLLEY_HALF_LN_2PI 0.9189385332046727f
#define VOLLEY_LN_2 0.6931471805599453f

__device__ __forceinline__ float volley_softplus(float x) { return fmaxf(x, 0.0f) + log1pf(expf(-fabsf(x))); }

// Diagonal Gaussian with the state-independent log-std vector params[A], tanh-squashed when
// flags != 0 (policy/src/gaussian.rs, policy/src/head.rs `DiagGaussian`).
struct VolleyGaussian {
    int a_dim;
    const float* log_std;
    int squash;
    __device__ VolleyGaussian(int n_outputs, const float* params, int flags) : a_dim(n_outputs), log_std(params), squash(flags) {}
    __device__ int action_width() const { return a_dim; }
    __device__ int n_param_grads() const { return a_dim; }
    // log pi(a), and with d != NULL the gradient rows (zero log-std gradient where it is clamped).
    __device__ float row(const float* mean, const float* action, float pg_scale, float ent_scale, float* d, float* d_log_std) const {
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
            if (d) {
                d[j] = -pg_scale * z * inv_sigma;
                const bool inside = s_raw >= VOLLEY_LOG_STD_MIN && s_raw <= VOLLEY_LOG_STD_MAX;
                d_log_std[j] = inside ? -pg_scale * (z * z - 1.0f) - ent_scale : 0.0f;
            }
        }
        return total;
    }
    __device__ float log_prob(const float* mean, const float* action) const { return row(mean, action, 0.0f, 0.0f, 0, 0); }
    __device__ void row_grad(const float* mean, const float* action, float pg_scale, float ent_scale, float* d, float* d_log_std,
                             float* log_prob_out, float* entropy_out) const {
        *log_prob_out = row(mean, action, pg_scale, ent_scale, d, d_log_std);
        float h = 0.0f;
        for (int j = 0; j < a_dim; ++j) h += fminf(fmaxf(log_std[j], VOLLEY_LOG_STD_MIN), VOLLEY_LOG_STD_MAX) + 0.5f + VOLLEY_HALF_LN_2PI;
        *entropy_out = h;
    }
};

// ---- The loss bodies, once per loss, templated over the head ----

// One thread per sample row i < n of the heads block (stride = n_outputs + 1):
// out[i] = log pi(a_i | x_i) - ref[i] (ref == NULL: log pi itself).
template <class Head>
__device__ void volley_log_probs(const Head& head, const float* heads, int stride, const float* actions, const float* ref,
                                 float* out, int n) {
    for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x) {
        const float lp = head.log_prob(heads + (long long)i * stride, actions + (long long)i * head.action_width());
        out[i] = ref ? lp - ref[i] : lp;
    }
}

// Zero one row's gradients (a dropped sample, or the bootstrap row, which has no parameter row).
template <class Head>
__device__ void volley_zero_row(const Head& head, float* d, int stride, float* d_params) {
    for (int j = 0; j < stride; ++j) d[j] = 0.0f;
    if (d_params) {
        for (int j = 0; j < head.n_param_grads(); ++j) d_params[j] = 0.0f;
    }
}

// The IMPALA loss with V-trace targets, one thread per row: gradient rows of the heads block for
// the n sample rows (rows n..n_rows, the bootstrap row, get zero), the head parameters' gradient
// rows d_head_params[n][n_param_grads], and the weighted sums into stats. moments[0] holds W.
template <class Head>
__device__ void volley_vtrace_loss_grad(const Head& head, const float* heads, int stride, const float* actions, const float* weights,
                                        const float* values, const float* vs, const float* log_rhos, const float* pg_adv, float rho_bar,
                                        float value_coef, float ent_coef, int n, int n_rows, const double* moments, float* d_heads,
                                        float* d_head_params, double* stats) {
    const double weight_sum = moments[0];
    const float inv_weight_sum = weight_sum > 0.0 ? (float)(1.0 / weight_sum) : 0.0f;
    const int n_params = head.n_param_grads();
    double s_policy = 0.0, s_value = 0.0, s_entropy = 0.0, s_ratio = 0.0, s_clipped = 0.0, s_kl = 0.0;
    for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < n_rows; i += gridDim.x * blockDim.x) {
        float* d = d_heads + (long long)i * stride;
        float* d_params = i < n ? d_head_params + (long long)i * n_params : 0;
        const float w = i < n ? weights[i] : 0.0f;
        if (w == 0.0f || weight_sum <= 0.0) {
            volley_zero_row(head, d, stride, d_params);
            continue;
        }
        const float scale = w * inv_weight_sum;
        const float pg = pg_adv[i];
        float entropy, log_prob;
        head.row_grad(heads + (long long)i * stride, actions + (long long)i * head.action_width(), scale * pg, scale * ent_coef, d,
                      d_params, &log_prob, &entropy);
        const float value_error = vs[i] - values[i];
        d[stride - 1] = -value_coef * scale * value_error;
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
    volley_add_stats(stats, s_policy, s_value, s_entropy, s_ratio, s_clipped, s_kl);
}

// Decoupled PPO-clip (Schulman et al. 2017, eq. (7); Hilton et al. 2021, eq. (2)) over n rows, one
// thread per row; moments = [W, sum w A, sum w (A - mean)^2] from weighted_sum / weighted_var.
template <class Head>
__device__ void volley_ppo_loss_grad(const Head& head, const float* heads, int stride, const float* actions, const float* weights,
                                     const float* values, const float* advantages, const float* returns, const float* prox_log_probs,
                                     const float* is_weights, float clip_coef, float value_coef, float ent_coef, int normalize, int n,
                                     const double* moments, float* d_heads, float* d_head_params, double* stats) {
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
    const int n_params = head.n_param_grads();
    double s_policy = 0.0, s_value = 0.0, s_entropy = 0.0, s_ratio = 0.0, s_clipped = 0.0, s_kl = 0.0;
    for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x) {
        float* d = d_heads + (long long)i * stride;
        float* d_params = d_head_params + (long long)i * n_params;
        const float w = weights[i];
        if (w == 0.0f || weight_sum <= 0.0) {
            volley_zero_row(head, d, stride, d_params);
            continue;
        }
        const float* z = heads + (long long)i * stride;
        const float* action = actions + (long long)i * head.action_width();
        const float scale = w * inv_weight_sum;
        const float log_ratio = head.log_prob(z, action) - prox_log_probs[i];
        const float ratio = expf(log_ratio);
        const float advantage = (advantages[i] - adv_shift) * adv_scale;
        const float unclipped = ratio * advantage;
        const float clipped = fminf(fmaxf(ratio, clip_low), clip_high) * advantage;
        const bool take_unclipped = unclipped <= clipped;
        const float surrogate = take_unclipped ? unclipped : clipped;
        const float surrogate_grad = take_unclipped ? unclipped : 0.0f;
        const float is_w = is_weights[i];
        float entropy, log_prob;
        head.row_grad(z, action, scale * is_w * surrogate_grad, scale * ent_coef, d, d_params, &log_prob, &entropy);
        const float value_error = returns[i] - values[i];
        d[stride - 1] = -value_coef * scale * value_error;
        const double wd = w;
        s_policy -= wd * (double)(is_w * surrogate);
        s_value += wd * 0.5 * (double)value_error * (double)value_error;
        s_entropy += wd * (double)entropy;
        s_ratio += wd * (double)ratio;
        if (fabsf(ratio - 1.0f) > clip_coef) s_clipped += wd;
        s_kl += wd * (((double)ratio - 1.0) - (double)log_ratio);
    }
    volley_add_stats(stats, s_policy, s_value, s_entropy, s_ratio, s_clipped, s_kl);
}

// ---- Entry points: each head's instance of every head kernel ----
// Every head kernel takes the same leading head arguments (n_outputs, head_params, head_flags),
// so one launcher per kernel serves every head (learner/src/backend/cuda/kernels.rs); the rows
// of the heads block have stride n_outputs + 1 (the head's outputs, then the value).
#define VOLLEY_HEAD_KERNELS(HEAD, NAME)                                                                                               \
    extern "C" __global__ void log_probs_##NAME(int n_outputs, const float* head_params, int head_flags, const float* heads,           \
                                                const float* actions, const float* ref, float* out, int n) {                          \
        volley_log_probs(HEAD(n_outputs, head_params, head_flags), heads, n_outputs + 1, actions, ref, out, n);                       \
    }                                                                                                                                 \
    extern "C" __global__ void vtrace_loss_grad_##NAME(                                                                               \
        int n_outputs, const float* head_params, int head_flags, const float* heads, const float* actions, const float* weights,     \
        const float* values, const float* vs, const float* log_rhos, const float* pg_adv, float rho_bar, float value_coef,           \
        float ent_coef, int n, int n_rows, const double* moments, float* d_heads, float* d_head_params, double* stats) {             \
        volley_vtrace_loss_grad(HEAD(n_outputs, head_params, head_flags), heads, n_outputs + 1, actions, weights, values, vs,         \
                                log_rhos, pg_adv, rho_bar, value_coef, ent_coef, n, n_rows, moments, d_heads, d_head_params, stats);  \
    }                                                                                                                                 \
    extern "C" __global__ void ppo_loss_grad_##NAME(                                                                                  \
        int n_outputs, const float* head_params, int head_flags, const float* heads, const float* actions, const float* weights,     \
        const float* values, const float* advantages, const float* returns, const float* prox_log_probs, const float* is_weights,    \
        float clip_coef, float value_coef, float ent_coef, int normalize, int n, const double* moments, float* d_heads,              \
        float* d_head_params, double* stats) {                                                                                       \
        volley_ppo_loss_grad(HEAD(n_outputs, head_params, head_flags), heads, n_outputs + 1, actions, weights, values, advantages,    \
                             returns, prox_log_probs, is_weights, clip_coef, value_coef, ent_coef, normalize, n, moments, d_heads,   \
                             d_head_params, stats);                                                                                   \
    }

VOLLEY_HEAD_KERNELS(VolleyCategorical, categorical)
VOLLEY_HEAD_KERNELS(VolleyGaussian, gaussian)
