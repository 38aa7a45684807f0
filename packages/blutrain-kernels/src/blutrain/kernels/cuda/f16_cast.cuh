// float32 <-> float16 as casts.cu's cast kernel and NumPy convert them: float32 -> float16 rounds to nearest
// even by the hardware (subnormal results kept) and keeps a NaN's sign and the top 10 bits of its payload
// (NumPy's rule; the hardware would give one canonical NaN); float16 -> float32 is exact, a NaN widened bit
// for bit. Shared by the kernels whose float16 values stand for that cast (casts.cu itself, the
// half-precision elementwise ops of half_elementwise.cu), so that a fused kernel reads and writes the cast's
// bits. float16 is unsigned 16-bit storage (no cuda_fp16.h: see common.cuh). The explicit cvt instructions
// carry no .ftz, so CuPy's -ftz=true leaves these conversions exact.
#pragma once

#include "bf16_cast.cuh"

// float32 -> float16 by the hardware's IEEE round to nearest even (no .ftz: subnormal results kept).
__device__ __forceinline__ unsigned short f32_to_f16_rn(float x) {
    unsigned short h;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(x));
    return h;
}

// NumPy's float32 -> float16: the NaN keeps its sign and the top 10 bits of its payload (made nonzero so
// that it stays a NaN); the hardware would give one canonical NaN.
__device__ __forceinline__ unsigned short f32_to_f16(float x) {
    const unsigned int u = __float_as_uint(x);
    if (f32_isnan(u)) {
        const unsigned int m = (u & 0x7fffffu) >> 13;
        return (unsigned short)(((u >> 16) & 0x8000u) | 0x7c00u | (m ? m : 1u));
    }
    return f32_to_f16_rn(x);
}

// float16 -> float32 is exact; the NaN is widened bit for bit (sign and payload), as NumPy does.
__device__ __forceinline__ float f16_to_f32(unsigned short h) {
    if ((h & 0x7fffu) > 0x7c00u) {
        return __uint_as_float(((unsigned int)(h & 0x8000u) << 16) | 0x7f800000u | ((unsigned int)(h & 0x3ffu) << 13));
    }
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
    return f;
}
