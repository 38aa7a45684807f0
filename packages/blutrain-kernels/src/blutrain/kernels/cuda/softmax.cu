// Softmax and log-softmax over the last dim of an [N, C] row-major tensor, forward and backward,
// float32 and bf16.
//
// softmax_fwd_*:  grid N blocks (one per row), block 32..1024 threads. Pass 1: online log-sum-exp
//                 (running max and rescaled sum, merged across the block); pass 2 (re-read from
//                 L1/L2): y = exp(x - lse), or x - lse for log-softmax (log_flag = 1).
//                 Bytes: read N*C, write N*C. FLOPs ~ 2 expf per element.
// softmax_bwd_*:  grid N blocks. softmax:     dx = y * (g - sum(g * y))
//                                log-softmax: dx = g - exp(y) * sum(g)
//                 Bytes: read 2*N*C, write N*C.
#include "common.cuh"

template <typename T, int VEC>
__device__ __forceinline__ void softmax_fwd(const T* __restrict__ x, T* __restrict__ y, int C, int log_flag) {
    __shared__ float red[66];
    const long long row = blockIdx.x;
    const T* xr = x + row * (long long)C;
    T* yr = y + row * (long long)C;
    const int nv = C / VEC;
    LseState st{-BT_INF, 0.f};
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
    }
    st = block_lse(st, red);
    const float lse = st.m + logf(st.s);
    for (int i = threadIdx.x; i < nv; i += blockDim.x) {
        float v[VEC], o[VEC];
        load_vec<VEC>(xr + (long long)i * VEC, v);
#pragma unroll
        for (int k = 0; k < VEC; ++k) o[k] = log_flag ? v[k] - lse : expf(v[k] - lse);
        store_vec<VEC>(yr + (long long)i * VEC, o);
    }
}

template <typename T, int VEC>
__device__ __forceinline__ void softmax_bwd(const T* __restrict__ g, const T* __restrict__ y, T* __restrict__ dx,
                                            int C, int log_flag) {
    __shared__ float red[66];
    const long long row = blockIdx.x;
    const T* gr = g + row * (long long)C;
    const T* yr = y + row * (long long)C;
    T* dr = dx + row * (long long)C;
    const int nv = C / VEC;
    float s = 0.f;
    for (int i = threadIdx.x; i < nv; i += blockDim.x) {
        float gv[VEC], yv[VEC];
        load_vec<VEC>(gr + (long long)i * VEC, gv);
        if (log_flag) {
#pragma unroll
            for (int k = 0; k < VEC; ++k) s += gv[k];
        } else {
            load_vec<VEC>(yr + (long long)i * VEC, yv);
#pragma unroll
            for (int k = 0; k < VEC; ++k) s += gv[k] * yv[k];
        }
    }
    s = block_sum(s, red);
    for (int i = threadIdx.x; i < nv; i += blockDim.x) {
        float gv[VEC], yv[VEC], o[VEC];
        load_vec<VEC>(gr + (long long)i * VEC, gv);
        load_vec<VEC>(yr + (long long)i * VEC, yv);
#pragma unroll
        for (int k = 0; k < VEC; ++k) o[k] = log_flag ? gv[k] - expf(yv[k]) * s : yv[k] * (gv[k] - s);
        store_vec<VEC>(dr + (long long)i * VEC, o);
    }
}

#define SOFTMAX_KERNELS(SUFFIX, T, VEC)                                                                  \
    extern "C" __global__ void softmax_fwd_##SUFFIX(const T* x, T* y, int C, int log_flag) {             \
        softmax_fwd<T, VEC>(x, y, C, log_flag);                                                          \
    }                                                                                                    \
    extern "C" __global__ void softmax_bwd_##SUFFIX(const T* g, const T* y, T* dx, int C, int log_flag) { \
        softmax_bwd<T, VEC>(g, y, dx, C, log_flag);                                                      \
    }
SOFTMAX_KERNELS(f32_v4, float, 4)
SOFTMAX_KERNELS(f32_v1, float, 1)
SOFTMAX_KERNELS(bf16_v8, bf16, 8)
SOFTMAX_KERNELS(bf16_v1, bf16, 1)
