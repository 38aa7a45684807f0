// Softmax cross-entropy over [N, C] logits with int64 class targets, ignore_index and label
// smoothing, float32 and bf16 logits. No softmax tensor is ever stored: the forward keeps the
// per-row log-sum-exp, the backward recomputes softmax - onehot on the fly.
//
// ce_fwd_*:    grid N blocks (one per row), block 128..1024 threads. One pass over the row keeps an
//              online (max, sum exp) per thread, merged across the block; then
//              loss = (1-eps)(lse - x[t]) + eps (lse - mean(x)), 0 for ignored rows.
//              With dlogits != nullptr a second pass (the row is still in L2) writes the gradient of
//              the reduced loss for an upstream gradient of 1, fusing forward and backward.
//              The log-sum-exp is stored in float32 whatever the logits' dtype.
//              Bytes: read N*C (+ N*C write with the fused gradient). FLOPs ~ 3 N*C plus N*C expf.
// ce_reduce_*: one block; sums the per-row losses in a fixed order (deterministic) and divides by
//              the number of non-ignored targets for reduction 'mean'.
// ce_bwd_*:    grid N blocks; dlogits = (softmax - (1-eps) onehot - eps/C) * scale_row, where
//              scale_row is grad[row] ('none'), grad[0] ('sum') or grad[0]/count ('mean'), 0 on
//              ignored rows. Bytes: read N*C, write N*C.
#include "common.cuh"

template <typename T, int VEC>
__device__ __forceinline__ void ce_fwd(const T* __restrict__ logits, const long long* __restrict__ target, int C,
                                       long long ignore_index, float smoothing, float* __restrict__ loss_rows,
                                       float* __restrict__ lse_out, T* __restrict__ dlogits,
                                       const long long* __restrict__ valid_count) {
    __shared__ float red[66];
    const long long row = blockIdx.x;
    const T* xr = logits + row * (long long)C;
    const int nv = C / VEC;

    LseState st{-BT_INF, 0.f};
    float sum = 0.f;
    for (int i = threadIdx.x; i < nv; i += blockDim.x) {
        float v[VEC];
        load_vec<VEC>(xr + (long long)i * VEC, v);
        float vmax = v[0];
#pragma unroll
        for (int k = 1; k < VEC; ++k) vmax = fmaxf(vmax, v[k]);
        const float m = fmaxf(st.m, vmax);
        if (m != -BT_INF) {
            float s = st.s * expf(st.m - m);
#pragma unroll
            for (int k = 0; k < VEC; ++k) s += expf(v[k] - m);
            st = LseState{m, s};
        }
#pragma unroll
        for (int k = 0; k < VEC; ++k) sum += v[k];
    }
    st = block_lse(st, red);
    sum = block_sum(sum, red);
    const float lse = st.m + logf(st.s);  // all -inf row: -inf + log(0) = -inf

    const long long t = target[row];
    const bool valid = t != ignore_index;
    if (threadIdx.x == 0) {
        float loss = 0.f;
        if (valid) {
            const float picked = (t >= 0 && t < C) ? to_float(xr[t]) : __int_as_float(0x7fc00000);
            loss = (1.f - smoothing) * (lse - picked);
            if (smoothing != 0.f) loss += smoothing * (lse - sum / (float)C);
        }
        loss_rows[row] = loss;
        lse_out[row] = lse;
    }
    if (dlogits != nullptr) {
        float scale = valid ? 1.f : 0.f;
        // 'mean': 1/count on valid rows; with no valid row at all 0/0 = NaN everywhere, as the loss.
        if (valid_count != nullptr) scale /= (float)(*valid_count);
        const float uniform = smoothing / (float)C;
        T* gr = dlogits + row * (long long)C;
        for (int i = threadIdx.x; i < nv; i += blockDim.x) {
            float v[VEC], o[VEC];
            load_vec<VEC>(xr + (long long)i * VEC, v);
#pragma unroll
            for (int k = 0; k < VEC; ++k) {
                const long long col = (long long)i * VEC + k;
                float p = expf(v[k] - lse) - uniform;
                if (col == t) p -= 1.f - smoothing;
                o[k] = p * scale;
            }
            store_vec<VEC>(gr + (long long)i * VEC, o);
        }
    }
}

template <typename T>
__device__ __forceinline__ void ce_reduce(const float* __restrict__ loss_rows, const long long* __restrict__ target,
                                          long long N, long long ignore_index, int mean, T* __restrict__ out) {
    __shared__ float red[66];
    float s = 0.f, cnt = 0.f;
    for (long long i = threadIdx.x; i < N; i += blockDim.x) {
        s += loss_rows[i];
        cnt += target[i] != ignore_index ? 1.f : 0.f;
    }
    s = block_sum(s, red);
    cnt = block_sum(cnt, red);
    if (threadIdx.x == 0) out[0] = from_float<T>(mean ? s / cnt : s);
}

template <typename T, int VEC>
__device__ __forceinline__ void ce_bwd(const T* __restrict__ grad, const T* __restrict__ logits,
                                       const long long* __restrict__ target, const float* __restrict__ lse,
                                       T* __restrict__ dlogits, int C, long long ignore_index, float smoothing,
                                       int mode, const long long* __restrict__ valid_count) {
    const long long row = blockIdx.x;
    const long long t = target[row];
    float scale = 0.f;
    if (t != ignore_index) scale = to_float(grad[mode == 0 ? row : 0]);
    // 'mean': divided by the number of valid rows; with none at all 0/0 = NaN, as the loss.
    if (mode == 2) scale /= (float)(*valid_count);
    const float l = lse[row];
    const float uniform = smoothing / (float)C;
    const T* xr = logits + row * (long long)C;
    T* gr = dlogits + row * (long long)C;
    const int nv = C / VEC;
    for (int i = threadIdx.x; i < nv; i += blockDim.x) {
        float v[VEC], o[VEC];
        load_vec<VEC>(xr + (long long)i * VEC, v);
#pragma unroll
        for (int k = 0; k < VEC; ++k) {
            const long long col = (long long)i * VEC + k;
            float p = expf(v[k] - l) - uniform;
            if (col == t) p -= 1.f - smoothing;
            o[k] = p * scale;
        }
        store_vec<VEC>(gr + (long long)i * VEC, o);
    }
}

#define CE_KERNELS(SUFFIX, T, VEC)                                                                      \
    extern "C" __global__ void ce_fwd_##SUFFIX(const T* logits, const long long* target, int C,          \
                                               long long ignore_index, float smoothing, float* loss_rows, \
                                               float* lse, T* dlogits, const long long* valid_count) {    \
        ce_fwd<T, VEC>(logits, target, C, ignore_index, smoothing, loss_rows, lse, dlogits, valid_count); \
    }                                                                                                   \
    extern "C" __global__ void ce_bwd_##SUFFIX(const T* grad, const T* logits, const long long* target,  \
                                               const float* lse, T* dlogits, int C, long long ignore_index, \
                                               float smoothing, int mode, const long long* valid_count) { \
        ce_bwd<T, VEC>(grad, logits, target, lse, dlogits, C, ignore_index, smoothing, mode, valid_count); \
    }
CE_KERNELS(f32_v4, float, 4)
CE_KERNELS(f32_v1, float, 1)
CE_KERNELS(bf16_v8, bf16, 8)
CE_KERNELS(bf16_v1, bf16, 1)

extern "C" __global__ void ce_reduce_f32(const float* loss_rows, const long long* target, long long N,
                                         long long ignore_index, int mean, float* out) {
    ce_reduce<float>(loss_rows, target, N, ignore_index, mean, out);
}
extern "C" __global__ void ce_reduce_bf16(const float* loss_rows, const long long* target, long long N,
                                          long long ignore_index, int mean, bf16* out) {
    ce_reduce<bf16>(loss_rows, target, N, ignore_index, mean, out);
}
