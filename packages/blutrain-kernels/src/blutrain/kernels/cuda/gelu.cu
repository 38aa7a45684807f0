// GELU forward and backward, elementwise over n contiguous elements, float32 and bf16; the tanh
// approximation (GPT-2's) and the exact erf form, chosen by a flag. Fused bias + GELU over [N, D] rows.
//
// gelu_fwd_*: y = 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3)))   or   0.5 x (1 + erf(x / sqrt 2)).
// gelu_bwd_*: dx = g * dGELU/dx(x).
// Launch: 1-D grid-stride loop; each thread moves 16 bytes per access (float4 or 8 x bf16) when the
// pointers are 16-byte aligned (the *_v kernels) and loads two vectors (i, i + stride) before computing
// either, then a scalar loop finishes the n % VEC tail.
// Bytes: forward reads n and writes n elements; backward reads 2n and writes n. FLOPs ~ 20 per element
// (one tanhf/erff each way, plus expf in the erf backward).
//
// bias_gelu_fwd_*: y[n, d] = GELU(x[n, d] + b[d]) (GPT-2's c_fc: the GEMM runs without its bias).
// bias_gelu_bwd_*: dx[n, d] = g[n, d] * GELU'(x[n, d] + b[d]); db[d] = sum_n dx[n, d], summed from the
//                  float32 dx before rounding, in the same launch (column_tile_sum of common.cuh).
// Launch: block (32, 16): x = 32 column vectors of VEC elements (16-byte accesses when D % VEC == 0
// and the rows are aligned, else VEC = 1), y = 16 row lanes; grid (ceil(D/VEC/32) column tiles, S
// row chunks), S from the host (about two blocks per SM). A thread loads its bias vector once and
// keeps 4 (forward) or 2 (backward: g and x) rows of loads in flight. Bytes: forward reads N*D + D
// and writes N*D elements; backward reads 2*N*D + D and writes N*D + D (+ 2*S*D*4 bytes of float32
// partials when S > 1) -- one pass less than dx followed by a column sum of dx (4*N*D).
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

#define BIAS_GELU_LANES 16

template <typename T, int VEC>
__device__ __forceinline__ void bias_gelu_fwd(const T* __restrict__ x, const T* __restrict__ b, T* __restrict__ y,
                                              long long N, int D, long long rows_per, int tanh_approx) {
    constexpr int RL = BIAS_GELU_LANES, U = 4;
    const int i = blockIdx.x * 32 + threadIdx.x;
    if (i >= D / VEC) return;
    const long long r0 = (long long)blockIdx.y * rows_per;
    const long long r1 = r0 + rows_per < N ? r0 + rows_per : N;
    const long long col = (long long)i * VEC;
    float bv[VEC];
    load_vec<VEC>(b + col, bv);
    long long r = r0 + threadIdx.y;
    for (; r + (U - 1) * RL < r1; r += U * RL) {
        float v[U][VEC];
#pragma unroll
        for (int u = 0; u < U; ++u) load_vec<VEC>(x + (r + u * RL) * D + col, v[u]);
#pragma unroll
        for (int u = 0; u < U; ++u) {
            float o[VEC];
#pragma unroll
            for (int k = 0; k < VEC; ++k) o[k] = gelu_f(v[u][k] + bv[k], tanh_approx);
            store_vec<VEC>(y + (r + u * RL) * D + col, o);
        }
    }
    for (; r < r1; r += RL) {
        float v[VEC], o[VEC];
        load_vec<VEC>(x + r * D + col, v);
#pragma unroll
        for (int k = 0; k < VEC; ++k) o[k] = gelu_f(v[k] + bv[k], tanh_approx);
        store_vec<VEC>(y + r * D + col, o);
    }
}

template <typename T, int VEC>
__device__ __forceinline__ void bias_gelu_bwd(const T* __restrict__ g, const T* __restrict__ x,
                                              const T* __restrict__ b, T* __restrict__ dx, T* __restrict__ db,
                                              float* __restrict__ partial, unsigned int* __restrict__ counters,
                                              long long N, int D, long long rows_per, int tanh_approx,
                                              int need_bias) {
    constexpr int RL = BIAS_GELU_LANES, U = 2;
    const int nv = D / VEC;
    const int i = blockIdx.x * 32 + threadIdx.x;
    const long long r0 = (long long)blockIdx.y * rows_per;
    const long long r1 = r0 + rows_per < N ? r0 + rows_per : N;
    const long long col = (long long)i * VEC;
    float acc[VEC];
#pragma unroll
    for (int k = 0; k < VEC; ++k) acc[k] = 0.f;
    if (i < nv) {
        float bv[VEC];
        load_vec<VEC>(b + col, bv);
        long long r = r0 + threadIdx.y;
        for (; r + (U - 1) * RL < r1; r += U * RL) {
            float gv[U][VEC], v[U][VEC];
#pragma unroll
            for (int u = 0; u < U; ++u) {
                load_vec<VEC>(g + (r + u * RL) * D + col, gv[u]);
                load_vec<VEC>(x + (r + u * RL) * D + col, v[u]);
            }
#pragma unroll
            for (int u = 0; u < U; ++u) {
                float o[VEC];
#pragma unroll
                for (int k = 0; k < VEC; ++k) {
                    o[k] = gelu_grad_f(gv[u][k], v[u][k] + bv[k], tanh_approx);
                    acc[k] += o[k];
                }
                store_vec<VEC>(dx + (r + u * RL) * D + col, o);
            }
        }
        for (; r < r1; r += RL) {
            float gv[VEC], v[VEC], o[VEC];
            load_vec<VEC>(g + r * D + col, gv);
            load_vec<VEC>(x + r * D + col, v);
#pragma unroll
            for (int k = 0; k < VEC; ++k) {
                o[k] = gelu_grad_f(gv[k], v[k] + bv[k], tanh_approx);
                acc[k] += o[k];
            }
            store_vec<VEC>(dx + r * D + col, o);
        }
    }
    if (!need_bias) return;
    const int tile0 = blockIdx.x * 32;
    column_tile_sum<VEC, RL>(acc, partial, counters, [&](int v, int k, float s) {
        if (tile0 + v < nv) db[(long long)(tile0 + v) * VEC + k] = from_float<T>(s);
    });
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

#define BIAS_GELU_KERNELS(SUFFIX, T, VEC)                                                                  \
    extern "C" __global__ void __launch_bounds__(32 * BIAS_GELU_LANES)                                     \
        bias_gelu_fwd_##SUFFIX(const T* x, const T* b, T* y, long long N, int D, long long rows_per,      \
                               int tanh_approx) {                                                          \
        bias_gelu_fwd<T, VEC>(x, b, y, N, D, rows_per, tanh_approx);                                       \
    }                                                                                                      \
    extern "C" __global__ void __launch_bounds__(32 * BIAS_GELU_LANES)                                     \
        bias_gelu_bwd_##SUFFIX(const T* g, const T* x, const T* b, T* dx, T* db, float* partial,          \
                               unsigned int* counters, long long N, int D, long long rows_per,             \
                               int tanh_approx, int need_bias) {                                           \
        bias_gelu_bwd<T, VEC>(g, x, b, dx, db, partial, counters, N, D, rows_per, tanh_approx, need_bias); \
    }
BIAS_GELU_KERNELS(f32_v4, float, 4)
BIAS_GELU_KERNELS(f32_v1, float, 1)
BIAS_GELU_KERNELS(bf16_v8, bf16, 8)
BIAS_GELU_KERNELS(bf16_v1, bf16, 1)
