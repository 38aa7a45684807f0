// Casts between float32, bfloat16 and float16 over a contiguous buffer of n elements, bit-identical to
// NumPy / ml_dtypes (the CPU backend's astype): round to nearest even, subnormals kept, overflow to inf.
// NaNs keep their sign; their payload follows the CPU's rules, which differ per pair: to bfloat16 (from
// float32 or float16) and bfloat16 -> float16 give the quiet NaN (0x7fc0 / 0x7e00); float32 -> float16
// keeps the top 10 payload bits (NumPy; 0x7c01 if they are all zero); widening copies the payload.
// bfloat16 and float16 are unsigned 16-bit storage here (no cuda_fp16.h / cuda_bf16.h: NVRTC through
// CuPy lacks one of them, see common.cuh); the float16 rounding is the PTX cvt.rn instruction.
//
// cast_{src}_{dst}_v8: grid-stride over the n / 8 vectors of 8 elements; each step reads 8 source
//                      elements and writes 8 with 16-byte accesses (two float4 for float32, one uint4
//                      for 16-bit types), so both pointers must be 16-byte aligned. The n % 8 tail
//                      elements go one each to the first threads of the grid. Block 256 threads, grid
//                      min(ceil(n / 8 / 256), 16 x SMs).
// cast_{src}_{dst}_v1: the same conversion one element per access, for a source that is not 16-byte
//                      aligned (a view at an odd offset): each thread has 4 loads in flight, a block's
//                      accesses are contiguous. Block 256, grid min(ceil(n / 4 / 256), 16 x SMs).
// cast_{src}_{dst}_multi_tensor: the same conversion of every tensor of a list in one launch (under autocast
//                      the float32 weights of a step become bf16 together, one launch instead of one small,
//                      launch-bound cast per weight). The host's table, int64 [T, 4]: source pointer, destination pointer, numel,
//                      first block; tensor t owns ceil(numel_t / CAST_TILE) blocks from its first, and a block
//                      finds its tensor by binary search over the first blocks (as scale.cu's tiles). A block of
//                      256 threads converts one tile of 4096 elements: two 8-element vectors per thread with
//                      16-byte accesses where both of the tensor's pointers are 16-byte aligned (the numel % 8
//                      tail one element per thread), else one element per access. Grid: the tiles.
// Bytes: read n * sizeof(src), write n * sizeof(dst) (6n for float32 <-> 16-bit, 4n for bf16 <-> f16); the
// multi-tensor kernels read 32 bytes of table per block besides (n the elements of all tensors).
// FLOPs: none (a few integer operations per element; the kernels are bound by memory bandwidth).

#include "bf16_cast.cuh"
#include "f16_cast.cuh"
#include "multi_tensor.cuh"
#include "u16_store.cuh"


struct F32 { typedef float T; };
struct BF16 { typedef u16 T; };
struct F16 { typedef u16 T; };

// float32 -> bfloat16: f32_to_bf16 (bf16_cast.cuh), round to nearest even, a NaN the quiet NaN of its sign;
// float32 <-> float16 and bfloat16 -> float32: f16_cast.cuh and bf16_cast.cuh.

// ml_dtypes' bfloat16 -> float16 goes through float32 (exact) and Eigen's float -> half, whose NaN is the
// quiet NaN of its sign.
__device__ __forceinline__ u16 bf16_to_f16(u16 b) {
    if ((b & 0x7fffu) > 0x7f80u) return (u16)((b & 0x8000u) | 0x7e00u);
    return f32_to_f16_rn(bf16_to_f32(b));
}

// ml_dtypes' float16 -> bfloat16: through float32 (exact), then float32 -> bfloat16.
__device__ __forceinline__ u16 f16_to_bf16(u16 h) { return f32_to_bf16(f16_to_f32(h)); }

template <typename From, typename To> struct Cast;
template <> struct Cast<F32, BF16> { static __device__ __forceinline__ u16 apply(float x) { return f32_to_bf16(x); } };
template <> struct Cast<BF16, F32> { static __device__ __forceinline__ float apply(u16 x) { return bf16_to_f32(x); } };
template <> struct Cast<F32, F16> { static __device__ __forceinline__ u16 apply(float x) { return f32_to_f16(x); } };
template <> struct Cast<F16, F32> { static __device__ __forceinline__ float apply(u16 x) { return f16_to_f32(x); } };
template <> struct Cast<BF16, F16> { static __device__ __forceinline__ u16 apply(u16 x) { return bf16_to_f16(x); } };
template <> struct Cast<F16, BF16> { static __device__ __forceinline__ u16 apply(u16 x) { return f16_to_bf16(x); } };

// 8 consecutive elements through 16-byte accesses; p is 16-byte aligned.
__device__ __forceinline__ void load8(const float* __restrict__ p, float (&v)[8]) {
    const float4 a = reinterpret_cast<const float4*>(p)[0];
    const float4 b = reinterpret_cast<const float4*>(p)[1];
    v[0] = a.x; v[1] = a.y; v[2] = a.z; v[3] = a.w;
    v[4] = b.x; v[5] = b.y; v[6] = b.z; v[7] = b.w;
}

__device__ __forceinline__ void load8(const u16* __restrict__ p, u16 (&v)[8]) {
    const uint4 a = *reinterpret_cast<const uint4*>(p);
    const unsigned int w[4] = {a.x, a.y, a.z, a.w};
#pragma unroll
    for (int k = 0; k < 4; ++k) {
        v[2 * k] = (u16)(w[k] & 0xffffu);  // little-endian: the lower half is the earlier element
        v[2 * k + 1] = (u16)(w[k] >> 16);
    }
}

__device__ __forceinline__ void store8(float* __restrict__ p, const float (&v)[8]) {
    reinterpret_cast<float4*>(p)[0] = make_float4(v[0], v[1], v[2], v[3]);
    reinterpret_cast<float4*>(p)[1] = make_float4(v[4], v[5], v[6], v[7]);
}

template <typename From, typename To>
__device__ __forceinline__ void cast_v8(const typename From::T* __restrict__ src, typename To::T* __restrict__ dst,
                                        long long n) {
    const long long nv = n >> 3;
    const long long tid = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    const long long stride = (long long)gridDim.x * blockDim.x;
    for (long long i = tid; i < nv; i += stride) {
        typename From::T s[8];
        typename To::T d[8];
        load8(src + (i << 3), s);
#pragma unroll
        for (int k = 0; k < 8; ++k) d[k] = Cast<From, To>::apply(s[k]);
        store8(dst + (i << 3), d);
    }
    const long long t = (nv << 3) + tid;  // at most 7 tail elements; the grid has >= 256 threads
    if (t < n) dst[t] = Cast<From, To>::apply(src[t]);
}

#define CAST_V1_UNROLL 4

template <typename From, typename To>
__device__ __forceinline__ void cast_v1(const typename From::T* __restrict__ src, typename To::T* __restrict__ dst,
                                        long long n) {
    const long long step = (long long)gridDim.x * blockDim.x * CAST_V1_UNROLL;
    for (long long base = (long long)blockIdx.x * blockDim.x * CAST_V1_UNROLL + threadIdx.x; base < n;
         base += step) {
        typename From::T s[CAST_V1_UNROLL];
#pragma unroll
        for (int u = 0; u < CAST_V1_UNROLL; ++u) {
            const long long j = base + (long long)u * blockDim.x;
            if (j < n) s[u] = src[j];
        }
#pragma unroll
        for (int u = 0; u < CAST_V1_UNROLL; ++u) {
            const long long j = base + (long long)u * blockDim.x;
            if (j < n) dst[j] = Cast<From, To>::apply(s[u]);
        }
    }
}

#define CAST_TILE 4096  // elements per block of the multi-tensor kernels: 256 threads x 2 vectors of 8
#define CAST_TILE_VECTORS (CAST_TILE / (8 * 256))


// One tile of one tensor of the table; blockDim.x must be 256 (CAST_TILE_VECTORS vectors per thread).
template <typename From, typename To>
__device__ __forceinline__ void cast_tile(const long long* __restrict__ table, int n) {
    const long long b = blockIdx.x;
    const int t = tile_owner<4, 3>(table, n, b);  // rows: source, result, numel, first block
    const long long sp = table[4 * t], dp = table[4 * t + 1], numel = table[4 * t + 2];
    const typename From::T* __restrict__ src = reinterpret_cast<const typename From::T*>(sp);
    typename To::T* __restrict__ dst = reinterpret_cast<typename To::T*>(dp);
    const long long start = (b - table[4 * t + 3]) * CAST_TILE;
    const long long end = start + CAST_TILE < numel ? start + CAST_TILE : numel;
    if (((sp | dp) & 15) == 0) {
        // start is a multiple of CAST_TILE elements, so every vector of the tile is 16-byte aligned too
        const long long vend = start + ((end - start) & ~7LL);
        typename From::T s[CAST_TILE_VECTORS][8];
#pragma unroll
        for (int k = 0; k < CAST_TILE_VECTORS; ++k) {  // both loads in flight before the first store
            const long long i = start + ((long long)(k * 256 + threadIdx.x) << 3);
            if (i < vend) load8(src + i, s[k]);
        }
#pragma unroll
        for (int k = 0; k < CAST_TILE_VECTORS; ++k) {
            const long long i = start + ((long long)(k * 256 + threadIdx.x) << 3);
            if (i < vend) {
                typename To::T d[8];
#pragma unroll
                for (int e = 0; e < 8; ++e) d[e] = Cast<From, To>::apply(s[k][e]);
                store8(dst + i, d);
            }
        }
        const long long j = vend + threadIdx.x;  // at most 7 tail elements, in the tensor's last tile
        if (j < end) dst[j] = Cast<From, To>::apply(src[j]);
    } else {  // a source view at an offset that is not a multiple of 16 bytes
        for (long long i = start + threadIdx.x; i < end; i += 256) dst[i] = Cast<From, To>::apply(src[i]);
    }
}

#define CAST_KERNELS(NAME, FROM, TO)                                                                          \
    extern "C" __global__ void __launch_bounds__(256)                                                         \
        cast_##NAME##_v8(const FROM::T* __restrict__ src, TO::T* __restrict__ dst, long long n) {           \
        cast_v8<FROM, TO>(src, dst, n);                                                                       \
    }                                                                                                         \
    extern "C" __global__ void __launch_bounds__(256)                                                         \
        cast_##NAME##_v1(const FROM::T* __restrict__ src, TO::T* __restrict__ dst, long long n) {           \
        cast_v1<FROM, TO>(src, dst, n);                                                                       \
    }                                                                                                         \
    extern "C" __global__ void __launch_bounds__(256)                                                         \
        cast_##NAME##_multi_tensor(const long long* __restrict__ table, int n) {                              \
        cast_tile<FROM, TO>(table, n);                                                                        \
    }
CAST_KERNELS(f32_bf16, F32, BF16)
CAST_KERNELS(bf16_f32, BF16, F32)
CAST_KERNELS(f32_f16, F32, F16)
CAST_KERNELS(f16_f32, F16, F32)
CAST_KERNELS(bf16_f16, BF16, F16)
CAST_KERNELS(f16_bf16, F16, BF16)
