// The global-norm clip over a list of tensors: its norm in two launches and its in-place rescale in one,
// reading each gradient where it lies (a norm of their copy laid end to end costs a copy, an abs, a multiply
// and a reduction over all of them).
//
// scale_multi_tensor_*: x *= c for every tensor.
// sqnorm_multi_tensor_*: partial[b] = sum of x^2 over block b's tile (float); norm_finish: one block sums
// the partials in a fixed order (in double) and writes sqrt. Bytes: read each element once.
//
// The host builds (once per set of buffers, then cached) a tensor table, int64 [T, 3]: pointer, numel,
// first block. Tensor t owns blocks [first_t, first_t+1) * ceil(numel_t / SCALE_TILE); a block finds its
// tensor by binary search over the first blocks (a few steps over an L1-resident table) and scales one
// tile of SCALE_TILE elements, coalesced. c is read from device memory when the kernel runs (a 0-d array
// of the tensors' dtype, computed on the device by the clip), so a captured CUDA graph replays with each
// step's value. Float math, one rounding on store: bit-identical to a float32 multiply, and for bfloat16
// to rounding the float product of the widened operands (what NumPy/ml_dtypes and CuPy do).
// Bytes: read and write each element once.
#include "common.cuh"
#include "multi_tensor.cuh"

#define SCALE_TILE 4096

template <typename T>
__device__ __forceinline__ void scale_tile(const long long* __restrict__ table, int n, float c) {
    const long long b = blockIdx.x;
    const int lo = tile_owner<3, 2>(table, n, b);
    T* x = reinterpret_cast<T*>(table[3 * lo]);
    const long long numel = table[3 * lo + 1];
    const long long start = (b - table[3 * lo + 2]) * SCALE_TILE;
    const long long end = start + SCALE_TILE < numel ? start + SCALE_TILE : numel;
    for (long long i = start + threadIdx.x; i < end; i += blockDim.x) {
        x[i] = from_float<T>(to_float(x[i]) * c);
    }
}

extern "C" __global__ void scale_multi_tensor_f32(const long long* __restrict__ table, int n,
                                                  const float* __restrict__ c) {
    scale_tile<float>(table, n, *c);
}

extern "C" __global__ void scale_multi_tensor_bf16(const long long* __restrict__ table, int n,
                                                   const bf16* __restrict__ c) {
    scale_tile<bf16>(table, n, to_float(*c));
}

template <typename T>
__device__ __forceinline__ void sqnorm_tile(const long long* __restrict__ table, int n, float* __restrict__ partial) {
    __shared__ float red[33];
    const long long b = blockIdx.x;
    const int t = tile_owner<3, 2>(table, n, b);
    const T* x = reinterpret_cast<const T*>(table[3 * t]);
    const long long numel = table[3 * t + 1];
    const long long start = (b - table[3 * t + 2]) * SCALE_TILE;
    const long long end = start + SCALE_TILE < numel ? start + SCALE_TILE : numel;
    float s = 0.f;
    for (long long i = start + threadIdx.x; i < end; i += blockDim.x) {
        const float v = to_float(x[i]);
        s += v * v;
    }
    s = block_sum(s, red);
    if (threadIdx.x == 0) partial[b] = s;
}

extern "C" __global__ void sqnorm_multi_tensor_f32(const long long* __restrict__ table, int n,
                                                   float* __restrict__ partial) {
    sqnorm_tile<float>(table, n, partial);
}

extern "C" __global__ void sqnorm_multi_tensor_bf16(const long long* __restrict__ table, int n,
                                                    float* __restrict__ partial) {
    sqnorm_tile<bf16>(table, n, partial);
}

// One block: out = sqrt(sum of partial[0, count)), each thread a strided share in double, then a fixed tree.
extern "C" __global__ void norm_finish(const float* __restrict__ partial, long long count, float* __restrict__ out) {
    __shared__ double red[1024];
    double s = 0.0;
    for (long long i = threadIdx.x; i < count; i += blockDim.x) s += (double)partial[i];
    red[threadIdx.x] = s;
    __syncthreads();
    for (int half = blockDim.x >> 1; half > 0; half >>= 1) {
        if (threadIdx.x < half) red[threadIdx.x] += red[threadIdx.x + half];
        __syncthreads();
    }
    if (threadIdx.x == 0) *out = (float)sqrt(red[0]);
}
