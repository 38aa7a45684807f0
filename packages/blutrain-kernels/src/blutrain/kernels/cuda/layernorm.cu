// LayerNorm over the last dim of an [N, C] row-major tensor, forward and backward, float32 and bf16
// (bf16 storage, float math). Two-pass statistics (mean, then sum of squared deviations) so that
// large offsets do not cancel; the row's re-reads hit L1/L2.
//
// layernorm_fwd_*:   grid N blocks (one per row), block 32..1024 threads (multiple of 32).
//                    y = (x - mean) * rstd * w + b; writes y and float32 mean[N], rstd[N] (statistics stay
//                    float32 for bf16 input, as PyTorch keeps them).
//                    Bytes: read N*C (+2C for w, b), write N*C (+2N). FLOPs ~ 7 N*C.
// layernorm_bwd_*:   grid G blocks striding over rows, dynamic shared memory (64 + 2C) floats when
//                    accumulating dweight/dbias. dx = rstd * (g*w - mean(g*w) - xhat*mean(g*w*xhat));
//                    per-block partial sums of g*xhat and g go to partial[2, G, C] (float32).
//                    Bytes: read 2*N*C, write N*C + 2*G*C.
// layernorm_bwd_reduce_*: one thread per column of the 2*C partial columns, sums G rows in a fixed
//                    order (deterministic). Bytes: read 2*G*C, write 2*C.
#include "common.cuh"

template <typename T, int VEC>
__device__ __forceinline__ void layernorm_fwd(const T* __restrict__ x, const T* __restrict__ w,
                                              const T* __restrict__ b, T* __restrict__ y,
                                              float* __restrict__ mean_out, float* __restrict__ rstd_out, int C,
                                              float eps) {
    __shared__ float red[66];
    const long long row = blockIdx.x;
    const T* xr = x + row * C;
    T* yr = y + row * C;
    const int nv = C / VEC;

    float s = 0.f;
    for (int i = threadIdx.x; i < nv; i += blockDim.x) {
        float v[VEC];
        load_vec<VEC>(xr + (long long)i * VEC, v);
#pragma unroll
        for (int k = 0; k < VEC; ++k) s += v[k];
    }
    const float mean = block_sum(s, red) / (float)C;

    float q = 0.f;
    for (int i = threadIdx.x; i < nv; i += blockDim.x) {
        float v[VEC];
        load_vec<VEC>(xr + (long long)i * VEC, v);
#pragma unroll
        for (int k = 0; k < VEC; ++k) {
            const float d = v[k] - mean;
            q += d * d;
        }
    }
    const float rstd = 1.f / sqrtf(block_sum(q, red) / (float)C + eps);

    for (int i = threadIdx.x; i < nv; i += blockDim.x) {
        float v[VEC], wv[VEC], bv[VEC], o[VEC];
        load_vec<VEC>(xr + (long long)i * VEC, v);
        if (w != nullptr) {
            load_vec<VEC>(w + (long long)i * VEC, wv);
        } else {
#pragma unroll
            for (int k = 0; k < VEC; ++k) wv[k] = 1.f;
        }
        if (b != nullptr) {
            load_vec<VEC>(b + (long long)i * VEC, bv);
        } else {
#pragma unroll
            for (int k = 0; k < VEC; ++k) bv[k] = 0.f;
        }
#pragma unroll
        for (int k = 0; k < VEC; ++k) o[k] = (v[k] - mean) * rstd * wv[k] + bv[k];
        store_vec<VEC>(yr + (long long)i * VEC, o);
    }
    if (threadIdx.x == 0) {
        mean_out[row] = mean;
        rstd_out[row] = rstd;
    }
}

template <typename T, int VEC>
__device__ __forceinline__ void layernorm_bwd(const T* __restrict__ g, const T* __restrict__ x,
                                              const T* __restrict__ w, const float* __restrict__ mean,
                                              const float* __restrict__ rstd, T* __restrict__ dx,
                                              float* __restrict__ partial, int N, int C, int accumulate) {
    extern __shared__ float smem[];
    float* red = smem;             // 66 floats of reduction scratch (64 reserved + pad)
    float* acc_w = smem + 72;      // [VEC][nv]: vector-major so that a warp's adds hit distinct banks
    float* acc_b = acc_w + C;
    const int nv = C / VEC;
    if (accumulate) {
        for (int j = threadIdx.x; j < C; j += blockDim.x) {
            acc_w[j] = 0.f;
            acc_b[j] = 0.f;
        }
    }
    __syncthreads();

    for (long long row = blockIdx.x; row < N; row += gridDim.x) {
        const T* gr = g + row * C;
        const T* xr = x + row * C;
        const float mu = mean[row];
        const float rs = rstd[row];
        float a = 0.f, c = 0.f;
        for (int i = threadIdx.x; i < nv; i += blockDim.x) {
            float gv[VEC], xv[VEC], wv[VEC];
            load_vec<VEC>(gr + (long long)i * VEC, gv);
            load_vec<VEC>(xr + (long long)i * VEC, xv);
            if (w != nullptr) {
                load_vec<VEC>(w + (long long)i * VEC, wv);
            } else {
#pragma unroll
                for (int k = 0; k < VEC; ++k) wv[k] = 1.f;
            }
#pragma unroll
            for (int k = 0; k < VEC; ++k) {
                const float gp = gv[k] * wv[k];
                a += gp;
                c += gp * (xv[k] - mu) * rs;
            }
        }
        a = block_sum(a, red) / (float)C;
        c = block_sum(c, red) / (float)C;
        T* dxr = dx + row * C;
        for (int i = threadIdx.x; i < nv; i += blockDim.x) {
            float gv[VEC], xv[VEC], wv[VEC], o[VEC];
            load_vec<VEC>(gr + (long long)i * VEC, gv);
            load_vec<VEC>(xr + (long long)i * VEC, xv);
            if (w != nullptr) {
                load_vec<VEC>(w + (long long)i * VEC, wv);
            } else {
#pragma unroll
                for (int k = 0; k < VEC; ++k) wv[k] = 1.f;
            }
#pragma unroll
            for (int k = 0; k < VEC; ++k) {
                const float xh = (xv[k] - mu) * rs;
                o[k] = rs * (gv[k] * wv[k] - a - xh * c);
                if (accumulate) {
                    acc_w[k * nv + i] += gv[k] * xh;
                    acc_b[k * nv + i] += gv[k];
                }
            }
            store_vec<VEC>(dxr + (long long)i * VEC, o);
        }
    }
    if (accumulate) {
        __syncthreads();
        float* pw = partial + (long long)blockIdx.x * C;
        float* pb = partial + (long long)gridDim.x * C + (long long)blockIdx.x * C;
        for (int j = threadIdx.x; j < C; j += blockDim.x) {
            const int i = j / VEC, k = j - i * VEC;
            pw[j] = acc_w[k * nv + i];
            pb[j] = acc_b[k * nv + i];
        }
    }
}

template <typename T>
__device__ __forceinline__ void layernorm_bwd_reduce(const float* __restrict__ partial, T* __restrict__ dw,
                                                     T* __restrict__ db, int G, int C) {
    const int j = blockIdx.x * blockDim.x + threadIdx.x;
    if (j >= 2 * C) return;
    const bool is_b = j >= C;
    const int col = is_b ? j - C : j;
    T* out = is_b ? db : dw;
    if (out == nullptr) return;
    const float* src = partial + (is_b ? (long long)G * C : 0LL) + col;
    float s = 0.f;
    for (int r = 0; r < G; ++r) s += src[(long long)r * C];
    out[col] = from_float<T>(s);
}

#define LN_FWD(NAME, T, VEC)                                                                        \
    extern "C" __global__ void NAME(const T* x, const T* w, const T* b, T* y, float* mean, float* rstd, int C, \
                                    float eps) {                                                    \
        layernorm_fwd<T, VEC>(x, w, b, y, mean, rstd, C, eps);                                      \
    }
LN_FWD(layernorm_fwd_f32_v4, float, 4)
LN_FWD(layernorm_fwd_f32_v1, float, 1)
LN_FWD(layernorm_fwd_bf16_v8, bf16, 8)
LN_FWD(layernorm_fwd_bf16_v1, bf16, 1)

#define LN_BWD(NAME, T, VEC)                                                                          \
    extern "C" __global__ void NAME(const T* g, const T* x, const T* w, const float* mean, const float* rstd, \
                                    T* dx, float* partial, int N, int C, int accumulate) {            \
        layernorm_bwd<T, VEC>(g, x, w, mean, rstd, dx, partial, N, C, accumulate);                    \
    }
LN_BWD(layernorm_bwd_f32_v4, float, 4)
LN_BWD(layernorm_bwd_f32_v1, float, 1)
LN_BWD(layernorm_bwd_bf16_v8, bf16, 8)
LN_BWD(layernorm_bwd_bf16_v1, bf16, 1)

extern "C" __global__ void layernorm_bwd_reduce_f32(const float* partial, float* dw, float* db, int G, int C) {
    layernorm_bwd_reduce<float>(partial, dw, db, G, C);
}
extern "C" __global__ void layernorm_bwd_reduce_bf16(const float* partial, bf16* dw, bf16* db, int G, int C) {
    layernorm_bwd_reduce<bf16>(partial, dw, db, G, C);
}
