// float32 -> bfloat16 as casts.cu's cast kernel and NumPy/ml_dtypes round it: to nearest even (the carry of
// 0x7fff + lsb rounds a tie to the even neighbour and lets the largest finite floats overflow to inf), and a
// NaN becomes the quiet NaN of its sign. Shared by the kernels whose bf16 outputs stand for that cast
// (casts.cu itself, LayerNorm's bf16 outputs, the embedding backward's rounding of a bf16 product), so that
// a fused kernel writes the cast's bits. common.cuh's float_to_bf16_bits differs on purpose: it keeps a NaN's
// payload, as the elementwise kernels it serves do. bfloat16 -> float32 is exact (the top half of the float),
// a NaN's sign and payload included, as the cast kernel and ml_dtypes widen it.
#pragma once

__device__ __forceinline__ bool f32_isnan(unsigned int u) { return (u & 0x7fffffffu) > 0x7f800000u; }

__device__ __forceinline__ unsigned short f32_to_bf16(float x) {
    const unsigned int u = __float_as_uint(x);
    if (f32_isnan(u)) return (unsigned short)(((u >> 16) & 0x8000u) | 0x7fc0u);
    return (unsigned short)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

__device__ __forceinline__ float bf16_to_f32(unsigned short h) { return __uint_as_float((unsigned int)h << 16); }
