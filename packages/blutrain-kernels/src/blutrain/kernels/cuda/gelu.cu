// GELU forward and backward, elementwise over n contiguous elements, float32 and bf16; the tanh
// approximation (GPT-2's) and the exact erf form, chosen by a flag.
//
// gelu_fwd_*: y = 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3)))   or   0.5 x (1 + erf(x / sqrt 2)).
// gelu_bwd_*: dx = g * dGELU/dx(x).
// Launch: 1-D grid-stride loop; each thread moves 16 bytes per access (float4 or 8 x bf16) when the
// pointers are 16-byte aligned (the *_v kernels) and loads two vectors (i, i + stride) before computing
// either, then a scalar loop finishes the n % VEC tail.
// Bytes: forward reads n and writes n elements; backward reads 2n and writes n. FLOPs ~ 20 per element
// (one tanhf/erff each way, plus expf in the erf backward).
#include "common.cuh"

#define GELU_K0 0.7978845608028654f  // sqrt(2/pi)
#define GELU_K1 0.044715f
#define INV_SQRT2 0.7071067811865476f
#define INV_SQRT_2PI 0.3989422804014327f

__device__ __forceinline__ float gelu_f(float x, int tanh_approx) {
    if (tanh_approx) return 0.5f * x * (1.f + tanhf(GELU_K0 * (x + GELU_K1 * x * x * x)));
    return 0.5f * x * (1.f + erff(x * INV_SQRT2));
}

__device__ __forceinline__ float gelu_grad_f(float g, float x, int tanh_approx) {
    if (tanh_approx) {
        const float t = tanhf(GELU_K0 * (x + GELU_K1 * x * x * x));
        const float d_inner = GELU_K0 * (1.f + 3.f * GELU_K1 * x * x);
        return g * (0.5f * (1.f + t) + 0.5f * x * (1.f - t * t) * d_inner);
    }
    const float cdf = 0.5f * (1.f + erff(x * INV_SQRT2));
    const float pdf = INV_SQRT_2PI * expf(-0.5f * x * x);
    return g * (cdf + x * pdf);
}

template <typename T, int VEC>
__device__ __forceinline__ void gelu_fwd(const T* __restrict__ x, T* __restrict__ y, long long n, int tanh_approx) {
    const long long stride = (long long)gridDim.x * blockDim.x;
    const long long first = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    const long long nv = n / VEC;
    for (long long i = first; i < nv; i += 2 * stride) {  // two vectors' loads in flight per thread
        const bool two = i + stride < nv;
        float v[2][VEC];
        load_vec<VEC>(x + i * VEC, v[0]);
        if (two) load_vec<VEC>(x + (i + stride) * VEC, v[1]);
#pragma unroll
        for (int u = 0; u < 2; ++u) {
            if (u == 1 && !two) break;
            float o[VEC];
#pragma unroll
            for (int k = 0; k < VEC; ++k) o[k] = gelu_f(v[u][k], tanh_approx);
            store_vec<VEC>(y + (i + u * stride) * VEC, o);
        }
    }
    for (long long j = nv * VEC + first; j < n; j += stride) y[j] = from_float<T>(gelu_f(to_float(x[j]), tanh_approx));
}

template <typename T, int VEC>
__device__ __forceinline__ void gelu_bwd(const T* __restrict__ g, const T* __restrict__ x, T* __restrict__ dx,
                                         long long n, int tanh_approx) {
    const long long stride = (long long)gridDim.x * blockDim.x;
    const long long first = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    const long long nv = n / VEC;
    for (long long i = first; i < nv; i += 2 * stride) {  // two vectors of g and x in flight per thread
        const bool two = i + stride < nv;
        float gv[2][VEC], v[2][VEC];
        load_vec<VEC>(g + i * VEC, gv[0]);
        load_vec<VEC>(x + i * VEC, v[0]);
        if (two) {
            load_vec<VEC>(g + (i + stride) * VEC, gv[1]);
            load_vec<VEC>(x + (i + stride) * VEC, v[1]);
        }
#pragma unroll
        for (int u = 0; u < 2; ++u) {
            if (u == 1 && !two) break;
            float o[VEC];
#pragma unroll
            for (int k = 0; k < VEC; ++k) o[k] = gelu_grad_f(gv[u][k], v[u][k], tanh_approx);
            store_vec<VEC>(dx + (i + u * stride) * VEC, o);
        }
    }
    for (long long j = nv * VEC + first; j < n; j += stride) {
        dx[j] = from_float<T>(gelu_grad_f(to_float(g[j]), to_float(x[j]), tanh_approx));
    }
}

#define GELU_KERNELS(SUFFIX, T, VEC)                                                                   \
    extern "C" __global__ void gelu_fwd_##SUFFIX(const T* x, T* y, long long n, int tanh_approx) {     \
        gelu_fwd<T, VEC>(x, y, n, tanh_approx);                                                        \
    }                                                                                                  \
    extern "C" __global__ void gelu_bwd_##SUFFIX(const T* g, const T* x, T* dx, long long n, int tanh_approx) { \
        gelu_bwd<T, VEC>(g, x, dx, n, tanh_approx);                                                    \
    }
GELU_KERNELS(f32_v4, float, 4)
GELU_KERNELS(f32_v1, float, 1)
GELU_KERNELS(bf16_v8, bf16, 8)
GELU_KERNELS(bf16_v1, bf16, 1)
