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
// embedding_bwd_atomic:   the fast non-deterministic path: one float atomicAdd per gradient element into a
//                         zeroed float32 [V, D] buffer. Bytes: read ntok*D, atomics ntok*D.
#include "common.cuh"

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

template <typename T, int VEC>
__device__ __forceinline__ void embedding_bwd_sorted(const T* __restrict__ grad, const long long* __restrict__ pos,
                                                     const long long* __restrict__ seg, T* __restrict__ out, int D) {
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
    store_vec<VEC>(out + row * D + (long long)i * VEC, acc);
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
                                                             const long long* seg, T* out, int D) {         \
        embedding_bwd_sorted<T, VEC>(grad, pos, seg, out, D);                                               \
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
