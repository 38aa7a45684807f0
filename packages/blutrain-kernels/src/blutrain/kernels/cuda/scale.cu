// Multi-tensor in-place scale, x *= c for every tensor of a list in one launch: the global-norm clip's
// rescaling of every gradient (GPT-2 124M: 148 tensors, 148 launches as one multiply each).
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

#define SCALE_TILE 4096

template <typename T>
__device__ __forceinline__ void scale_tile(const long long* __restrict__ table, int n, float c) {
    const long long b = blockIdx.x;
    int lo = 0, hi = n - 1;  // the last tensor whose first block is <= b (empty tensors own no block)
    while (lo < hi) {
        const int mid = (lo + hi + 1) >> 1;
        if (table[3 * mid + 2] <= b) {
            lo = mid;
        } else {
            hi = mid - 1;
        }
    }
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
