// Embedding lookup and its gradient, float32 and bf16 rows of width D, int64 token ids.
//
// embedding_fwd_*:        grid (ntok, ceil(D/VEC / block)), out[t] = weight[idx[t]]; an id outside
//                         [0, V) yields a NaN row instead of reading out of bounds.
//                         Bytes: read ntok*D (+ids), write ntok*D.
// embedding_bwd_sorted_*: deterministic. The host sorts the keys id*ntok + position once (unique keys,
//                         so any sort gives one order) and finds each id's segment; grid (V, column
//                         chunks), each thread owns VEC columns of one vocabulary row and sums that row's
//                         gradient rows in position order, in float, then writes the row once (zero rows
//                         included: no memset). Bytes: read ntok*D, write V*D.
//                         addend, scale (nullable; the weight's [V, D] and a 0-d, T): writes
//                         addend * scale + sum instead (+V*D read): a tied weight's other gradient (the
//                         LM head's times the loss scale), which the compiler's embedding-grad-add pass
//                         folds in instead of a separate multiply and add over the whole weight.
// embedding_bwd_atomic:   the fast non-deterministic path: one float atomicAdd per gradient element into a
//                         zeroed float32 [V, D] buffer. Bytes: read ntok*D, atomics ntok*D.
// embedding_bwd_addend_*: that path's addend: grid-stride over V*D, out = addend * scale + acc (acc rounded
//                         to T as the plain path's cast rounds it).
//                         Bytes: read 2*V*D (float32 acc + addend), write V*D.
//
// The addend's roundings are the separate ops': the product rounded to T (__fmul_rn, then T's rounding),
// the sum rounded to T as the plain kernel stores it, their sum (__fadd_rn, the product as its first
// operand, as autograd adds the head's gradient first) rounded to T. bf16 products and sums round as the
// cast kernel does (NaN -> the quiet NaN of its sign), the cast that ends the generic half multiply and add.
// A row no id selects is product + 0.f (a -0 product gives +0, as the add of the zero row does).
#include "common.cuh"
#include "bf16_cast.cuh"

template <typename T, int VEC>
__device__ __forceinline__ void embedding_fwd(const T* __restrict__ weight, const long long* __restrict__ idx,
                                              T* __restrict__ out, int D, long long V) {
    const long long tok = blockIdx.x;
    const int i = blockIdx.y * blockDim.x + threadIdx.x;
    if (i * VEC >= D) return;
    const long long id = idx[tok];
    float v[VEC];
    if (id >= 0 && id < V) {
        load_vec<VEC>(weight + id * D + (long long)i * VEC, v);
    } else {
#pragma unroll
        for (int k = 0; k < VEC; ++k) v[k] = __int_as_float(0x7fc00000);
    }
    store_vec<VEC>(out + tok * D + (long long)i * VEC, v);
}

// x rounded to T as casts.cu rounds it, back in float: float is exact already; bf16 is round to nearest
// even, a NaN the quiet NaN of its sign (a value store_vec then stores with these bits)
template <typename T> __device__ __forceinline__ float cast_round(float x);
template <> __device__ __forceinline__ float cast_round<float>(float x) { return x; }
template <> __device__ __forceinline__ float cast_round<bf16>(float x) {
    return __uint_as_float((unsigned int)f32_to_bf16(x) << 16);
}

// addend * scale + sum with the separate ops' roundings (see the header); scale may be null (addend + sum).
// sum comes rounded to T as the plain path would have stored it.
template <typename T>
__device__ __forceinline__ float addend_sum(float a, const T* __restrict__ scale, float sum) {
    const float term = scale != nullptr ? cast_round<T>(__fmul_rn(a, to_float(*scale))) : a;
    return cast_round<T>(__fadd_rn(term, sum));
}

template <typename T, int VEC>
__device__ __forceinline__ void embedding_bwd_sorted(const T* __restrict__ grad, const long long* __restrict__ pos,
                                                     const long long* __restrict__ seg, const T* __restrict__ addend,
                                                     const T* __restrict__ scale, T* __restrict__ out, int D) {
    const long long row = blockIdx.x;
    const int i = blockIdx.y * blockDim.x + threadIdx.x;
    if (i * VEC >= D) return;
    float acc[VEC];
#pragma unroll
    for (int k = 0; k < VEC; ++k) acc[k] = 0.f;
    const long long begin = seg[row], end = seg[row + 1];
    for (long long j = begin; j < end; ++j) {
        float v[VEC];
        load_vec<VEC>(grad + pos[j] * D + (long long)i * VEC, v);
#pragma unroll
        for (int k = 0; k < VEC; ++k) acc[k] += v[k];
    }
    if (addend != nullptr) {
        float av[VEC];
        load_vec<VEC>(addend + row * D + (long long)i * VEC, av);
#pragma unroll
        for (int k = 0; k < VEC; ++k) acc[k] = addend_sum<T>(av[k], scale, to_float(from_float<T>(acc[k])));
    }
    store_vec<VEC>(out + row * D + (long long)i * VEC, acc);
}

template <typename T>
__device__ __forceinline__ void embedding_bwd_addend(const float* __restrict__ acc, const T* __restrict__ addend,
                                                     const T* __restrict__ scale, T* __restrict__ out,
                                                     long long n) {
    const long long stride = (long long)gridDim.x * blockDim.x;
    for (long long e = blockIdx.x * (long long)blockDim.x + threadIdx.x; e < n; e += stride) {
        // the plain path casts acc to T with the cast kernel
        out[e] = from_float<T>(addend_sum<T>(to_float(addend[e]), scale, cast_round<T>(acc[e])));
    }
}

template <typename T>
__device__ __forceinline__ void embedding_bwd_atomic(const T* __restrict__ grad, const long long* __restrict__ idx,
                                                     float* __restrict__ acc, int D) {
    const long long tok = blockIdx.x;
    const long long id = idx[tok];
    for (int c = blockIdx.y * blockDim.x + threadIdx.x; c < D; c += gridDim.y * blockDim.x) {
        atomicAdd(acc + id * D + c, to_float(grad[tok * D + c]));
    }
}

#define EMB_KERNELS(SUFFIX, T, VEC)                                                                          \
    extern "C" __global__ void embedding_fwd_##SUFFIX(const T* weight, const long long* idx, T* out, int D,  \
                                                      long long V) {                                        \
        embedding_fwd<T, VEC>(weight, idx, out, D, V);                                                      \
    }                                                                                                       \
    extern "C" __global__ void embedding_bwd_sorted_##SUFFIX(const T* grad, const long long* pos,           \
                                                             const long long* seg, const T* addend,         \
                                                             const T* scale, T* out, int D) {               \
        embedding_bwd_sorted<T, VEC>(grad, pos, seg, addend, scale, out, D);                                \
    }
EMB_KERNELS(f32_v4, float, 4)
EMB_KERNELS(f32_v1, float, 1)
EMB_KERNELS(bf16_v8, bf16, 8)
EMB_KERNELS(bf16_v1, bf16, 1)

extern "C" __global__ void embedding_bwd_atomic_f32(const float* grad, const long long* idx, float* acc, int D) {
    embedding_bwd_atomic<float>(grad, idx, acc, D);
}
extern "C" __global__ void embedding_bwd_atomic_bf16(const bf16* grad, const long long* idx, float* acc, int D) {
    embedding_bwd_atomic<bf16>(grad, idx, acc, D);
}
extern "C" __global__ void embedding_bwd_addend_f32(const float* acc, const float* addend, const float* scale,
                                                    float* out, long long n) {
    embedding_bwd_addend<float>(acc, addend, scale, out, n);
}
extern "C" __global__ void embedding_bwd_addend_bf16(const float* acc, const bf16* addend, const bf16* scale,
                                                     bf16* out, long long n) {
    embedding_bwd_addend<bf16>(acc, addend, scale, out, n);
}
