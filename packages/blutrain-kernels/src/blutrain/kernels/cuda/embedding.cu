// Embedding lookup and its gradient, float32 and bf16 rows of width D, int64 token ids.
//
// embedding_fwd_*:        grid (ntok, ceil(D/VEC / block)), out[t] = weight[idx[t]]; an id outside
//                         [0, V) yields a NaN row instead of reading out of bounds.
//                         Bytes: read ntok*D (+ids), write ntok*D.
// embedding_bwd_sorted_*: deterministic. The host sorts the keys id*ntok + position once (unique keys,
//                         so any sort gives one order) and finds each id's segment; grid (ceil(V/2),
//                         column chunks), block = one chunk of column vectors (a multiple of 32 threads, so
//                         a warp never spans two vocabulary rows); each thread owns VEC columns of
//                         EMB_BWD_ROWS = 2 consecutive vocabulary rows and sums each row's gradient rows
//                         in position order, in float (the order, hence the bits, of a plain loop over the
//                         segment), then writes the row once (zero rows included: no memset).
//                         Latency, not bandwidth, bounds a long segment (a frequent token: hundreds to
//                         thousands of positions): a warp loads 32 positions with one coalesced load (the
//                         next 32 in flight meanwhile) and hands them out by shuffle, and each thread
//                         issues the loads of EMB_BWD_UNROLL = 8 gradient rows before adding them in order,
//                         so 8 rows of the segment are in flight instead of one, while the next 8 rows are
//                         prefetched into L2. Both rows' addend vectors and segment bounds are loaded
//                         before any segment, so an empty row costs one memory latency, not two.
//                         A segment longer than `chunk` positions (a frequent token: byte-level text gives
//                         the space thousands of the 16384 positions of a GPT-2 batch, and one block would
//                         sum them all, one latency per 8 rows, while the others idle) is summed in two
//                         passes instead: embedding_bwd_chunks_* sums each `chunk` positions of it into a
//                         float32 partial row (one block per chunk, position order within it), and this
//                         kernel adds the row's partials in chunk order, from +0. A row of at most `chunk`
//                         positions keeps the plain loop's order and bits; a longer one is deterministic
//                         too (the chunks are fixed by the positions), in the chunked order.
//                         cstart[v] .. cstart[v+1] are row v's chunks (none for a short row; host-made).
//                         Bytes: read ntok*D (+ntok*8 positions, (V+1)*16 bounds), write V*D; the long
//                         rows' partials once more (write, read): at most 2*ntok/chunk rows of D floats.
// embedding_bwd_chunks_*: grid (the bound on chunks, column chunks): block b sums chunk b (its vocabulary row
//                         found by binary search in cstart; a block past cstart[V] returns) into partial[b].
//                         Bytes: read the long segments' rows, write their partials.
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

// One 16-byte vector (or one element, VEC == 1) of T as loaded, widened to floats only when added: the
// registers of UNROLL rows in flight stay 4 per row for bf16 too.
template <typename T, int VEC> struct RawVec {
    T v[VEC];
    __device__ __forceinline__ void load(const T* p) {
#pragma unroll
        for (int k = 0; k < VEC; ++k) v[k] = p[k];
    }
    __device__ __forceinline__ void widen(float (&o)[VEC]) const {
#pragma unroll
        for (int k = 0; k < VEC; ++k) o[k] = to_float(v[k]);
    }
};
template <> struct RawVec<float, 4> {
    float4 v;
    __device__ __forceinline__ void load(const float* p) { v = *reinterpret_cast<const float4*>(p); }
    __device__ __forceinline__ void widen(float (&o)[4]) const { o[0] = v.x; o[1] = v.y; o[2] = v.z; o[3] = v.w; }
};
template <> struct RawVec<bf16, 8> {
    uint4 v;
    __device__ __forceinline__ void load(const bf16* p) { v = *reinterpret_cast<const uint4*>(p); }
    __device__ __forceinline__ void widen(float (&o)[8]) const {
        unpack_bf16x2(v.x, o[0], o[1]);
        unpack_bf16x2(v.y, o[2], o[3]);
        unpack_bf16x2(v.z, o[4], o[5]);
        unpack_bf16x2(v.w, o[6], o[7]);
    }
};

// A hint with no register to wait on: the line holding p is fetched into L2.
__device__ __forceinline__ void prefetch_l2(const void* p) { asm volatile("prefetch.global.L2 [%0];" ::"l"(p)); }

constexpr int EMB_BWD_ROWS = 2;     // vocabulary rows per thread
constexpr int EMB_BWD_UNROLL = 8;   // gradient rows of a segment in flight per thread (divides 32)

// acc += the gradient rows pos[begin], ..., pos[end - 1] (columns col .. col + VEC), added in that order.
// Every lane of the warp calls it with the same begin and end (one vocabulary row per warp); lanes whose
// columns lie past the row (active false) take part in the shuffles and load nothing.
template <typename T, int VEC>
__device__ __forceinline__ void sum_segment(const T* __restrict__ grad, const long long* __restrict__ pos,
                                            long long begin, long long end, long long col, int D, bool active,
                                            float (&acc)[VEC]) {
    constexpr int U = EMB_BWD_UNROLL;
    const int lane = threadIdx.x & 31;
    long long mine = begin + lane < end ? pos[begin + lane] : 0;  // lane u holds the position of row base + u
    for (long long base = begin; base < end; base += 32) {
        const int n = end - base < 32 ? (int)(end - base) : 32;
        const long long ahead = base + 32 + lane;
        const long long next = ahead < end ? pos[ahead] : 0;  // the next 32 positions, in flight meanwhile
        for (int u0 = 0; u0 < n; u0 += U) {
#pragma unroll
            for (int u = 0; u < U; ++u) {  // the next group's rows into L2: its loads then wait on L2, not DRAM
                const int q = u0 + U + u;
                const long long p = __shfl_sync(0xffffffffu, mine, q & 31);
                if (active && q < n) prefetch_l2(grad + p * D + col);
            }
            RawVec<T, VEC> r[U];
#pragma unroll
            for (int u = 0; u < U; ++u) {
                const long long p = __shfl_sync(0xffffffffu, mine, u0 + u);
                if (active && u0 + u < n) r[u].load(grad + p * D + col);
            }
#pragma unroll
            for (int u = 0; u < U; ++u) {
                if (active && u0 + u < n) {
                    float v[VEC];
                    r[u].widen(v);
#pragma unroll
                    for (int k = 0; k < VEC; ++k) acc[k] += v[k];
                }
            }
        }
        mine = next;
    }
}

// The chunk b of a long segment: its vocabulary row (the r with cstart[r] <= b < cstart[r + 1]: cstart is
// non-decreasing with cstart[0] = 0) and its positions seg[r] + k*chunk .. at most chunk further, k = b -
// cstart[r]. Every thread of the block computes the same; b < cstart[V].
__device__ __forceinline__ void chunk_bounds(const long long* __restrict__ seg, const long long* __restrict__ cstart,
                                             long long V, long long b, int chunk, long long& begin, long long& end) {
    long long lo = 0, hi = V;  // invariant: cstart[lo] <= b < cstart[hi]
    while (hi - lo > 1) {
        const long long mid = (lo + hi) / 2;
        if (cstart[mid] <= b) lo = mid; else hi = mid;
    }
    begin = seg[lo] + (b - cstart[lo]) * chunk;
    const long long stop = seg[lo + 1];
    end = begin + chunk < stop ? begin + chunk : stop;
}

template <typename T, int VEC>
__device__ __forceinline__ void embedding_bwd_chunks(const T* __restrict__ grad, const long long* __restrict__ pos,
                                                     const long long* __restrict__ seg,
                                                     const long long* __restrict__ cstart, float* __restrict__ partial,
                                                     int D, long long V, int chunk) {
    const long long b = blockIdx.x;
    if (b >= cstart[V]) return;  // uniform over the block: the grid is a bound on the chunks
    const int i = blockIdx.y * blockDim.x + threadIdx.x;
    const bool active = i * VEC < D;  // no early return: the whole warp shuffles positions
    const long long col = (long long)i * VEC;
    long long begin, end;
    chunk_bounds(seg, cstart, V, b, chunk, begin, end);
    float acc[VEC];
#pragma unroll
    for (int k = 0; k < VEC; ++k) acc[k] = 0.f;
    sum_segment<T, VEC>(grad, pos, begin, end, col, D, active, acc);
    if (active) store_vec<VEC>(partial + b * D + col, acc);
}

template <typename T, int VEC>
__device__ __forceinline__ void embedding_bwd_sorted(const T* __restrict__ grad, const long long* __restrict__ pos,
                                                     const long long* __restrict__ seg,
                                                     const long long* __restrict__ cstart,
                                                     const float* __restrict__ partial, const T* __restrict__ addend,
                                                     const T* __restrict__ scale, T* __restrict__ out, int D,
                                                     long long V) {
    constexpr int R = EMB_BWD_ROWS;
    const long long row0 = (long long)blockIdx.x * R;
    const int i = blockIdx.y * blockDim.x + threadIdx.x;
    const bool active = i * VEC < D;  // no early return: the whole warp shuffles positions
    const long long col = (long long)i * VEC;
    RawVec<T, VEC> add[R];
    long long bound[R + 1], chunks[R + 1];
#pragma unroll
    for (int r = 0; r < R; ++r) {
        if (addend != nullptr && active && row0 + r < V) add[r].load(addend + (row0 + r) * D + col);
    }
#pragma unroll
    for (int r = 0; r <= R; ++r) {
        bound[r] = row0 + r <= V ? seg[row0 + r] : 0;
        chunks[r] = row0 + r <= V ? cstart[row0 + r] : 0;
    }
#pragma unroll
    for (int r = 0; r < R; ++r) {
        const long long row = row0 + r;
        if (row >= V) break;  // uniform over the block
        float acc[VEC];
#pragma unroll
        for (int k = 0; k < VEC; ++k) acc[k] = 0.f;
        if (chunks[r + 1] > chunks[r]) {  // a long segment: its chunks' partial sums, in chunk order
            if (active) {
                for (long long c = chunks[r]; c < chunks[r + 1]; ++c) {
                    float v[VEC];
                    load_vec<VEC>(partial + c * D + col, v);
#pragma unroll
                    for (int k = 0; k < VEC; ++k) acc[k] += v[k];
                }
            }
        } else {
            sum_segment<T, VEC>(grad, pos, bound[r], bound[r + 1], col, D, active, acc);
        }
        if (!active) continue;
        if (addend != nullptr) {
            float av[VEC];
            add[r].widen(av);
#pragma unroll
            for (int k = 0; k < VEC; ++k) acc[k] = addend_sum<T>(av[k], scale, to_float(from_float<T>(acc[k])));
        }
        store_vec<VEC>(out + row * D + col, acc);
    }
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
                                                             const long long* seg, const long long* cstart, \
                                                             const float* partial, const T* addend,         \
                                                             const T* scale, T* out, int D, long long V) {  \
        embedding_bwd_sorted<T, VEC>(grad, pos, seg, cstart, partial, addend, scale, out, D, V);            \
    }                                                                                                       \
    extern "C" __global__ void embedding_bwd_chunks_##SUFFIX(const T* grad, const long long* pos,           \
                                                             const long long* seg, const long long* cstart, \
                                                             float* partial, int D, long long V,            \
                                                             int chunk) {                                   \
        embedding_bwd_chunks<T, VEC>(grad, pos, seg, cstart, partial, D, V, chunk);                         \
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
