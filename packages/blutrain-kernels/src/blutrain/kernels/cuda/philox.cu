// Counter-based random numbers: Philox4x32-10 (Salmon et al., SC'11), the generator behind
// BluTrain's seeded CUDA streams. Element e of a draw uses counter (offset + e / per) under key
// seed, so a stream is a pure function of (seed, offset): reproducible for any launch shape, and
// its whole state is two integers.
//
// Launch: 1-D grid-stride loop, one thread per 128-bit counter (4 words).
//   philox_raw:         out[4i + k] = word k of counter offset + i (for known-answer tests).
//   philox_uniform_f32: 4 floats per counter, (w >> 8) * 2^-24 in [0, 1).
//   philox_uniform_f64: 2 doubles per counter, 53 random bits * 2^-53 in [0, 1).
//   philox_normal_f32:  4 floats per counter, Box-Muller on word pairs (u1 in (0, 1]).
//   philox_normal_f64:  2 doubles per counter, Box-Muller on two 53-bit uniforms.
//   philox_integers:    2 int64 per counter, low + floor(r64 * range / 2^64) (bias < range / 2^64).
// Bytes: write n elements. FLOPs: 10 rounds of 2 32-bit multiplies per counter.
#define PHILOX_M0 0xD2511F53u
#define PHILOX_M1 0xCD9E8D57u
#define PHILOX_W0 0x9E3779B9u
#define PHILOX_W1 0xBB67AE85u

__device__ __forceinline__ uint4 philox_round(uint4 c, uint2 k) {
    const unsigned int hi0 = __umulhi(PHILOX_M0, c.x), lo0 = PHILOX_M0 * c.x;
    const unsigned int hi1 = __umulhi(PHILOX_M1, c.z), lo1 = PHILOX_M1 * c.z;
    return make_uint4(hi1 ^ c.y ^ k.x, lo1, hi0 ^ c.w ^ k.y, lo0);
}

__device__ __forceinline__ uint4 philox4x32_10(unsigned long long counter, unsigned long long seed) {
    uint4 c = make_uint4((unsigned int)counter, (unsigned int)(counter >> 32), 0u, 0u);
    uint2 k = make_uint2((unsigned int)seed, (unsigned int)(seed >> 32));
    c = philox_round(c, k);
#pragma unroll
    for (int r = 1; r < 10; ++r) {
        k.x += PHILOX_W0;
        k.y += PHILOX_W1;
        c = philox_round(c, k);
    }
    return c;
}

__device__ __forceinline__ float u01_f32(unsigned int w) { return (float)(w >> 8) * 5.9604644775390625e-08f; }
__device__ __forceinline__ double u01_f64(unsigned int a, unsigned int b) {
    return (double)(((unsigned long long)(a >> 5) << 26) | (unsigned long long)(b >> 6)) * 1.1102230246251565e-16;
}

#define GRID_STRIDE(i, count)                                                                  \
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < (count);         \
         i += (long long)gridDim.x * blockDim.x)

extern "C" __global__ void philox_raw(unsigned int* out, long long ncounters, unsigned long long seed,
                                      unsigned long long offset) {
    GRID_STRIDE(i, ncounters) {
        const uint4 w = philox4x32_10(offset + (unsigned long long)i, seed);
        out[4 * i] = w.x;
        out[4 * i + 1] = w.y;
        out[4 * i + 2] = w.z;
        out[4 * i + 3] = w.w;
    }
}

extern "C" __global__ void philox_uniform_f32(float* out, long long n, unsigned long long seed,
                                              unsigned long long offset) {
    GRID_STRIDE(i, (n + 3) / 4) {
        const uint4 w = philox4x32_10(offset + (unsigned long long)i, seed);
        const unsigned int words[4] = {w.x, w.y, w.z, w.w};
#pragma unroll
        for (int k = 0; k < 4; ++k) {
            if (4 * i + k < n) out[4 * i + k] = u01_f32(words[k]);
        }
    }
}

extern "C" __global__ void philox_uniform_f64(double* out, long long n, unsigned long long seed,
                                              unsigned long long offset) {
    GRID_STRIDE(i, (n + 1) / 2) {
        const uint4 w = philox4x32_10(offset + (unsigned long long)i, seed);
        out[2 * i] = u01_f64(w.x, w.y);
        if (2 * i + 1 < n) out[2 * i + 1] = u01_f64(w.z, w.w);
    }
}

extern "C" __global__ void philox_normal_f32(float* out, long long n, unsigned long long seed,
                                             unsigned long long offset) {
    GRID_STRIDE(i, (n + 3) / 4) {
        const uint4 w = philox4x32_10(offset + (unsigned long long)i, seed);
        float z[4];
        const unsigned int a[2] = {w.x, w.z}, b[2] = {w.y, w.w};
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            const float u1 = (float)((a[h] >> 8) + 1u) * 5.9604644775390625e-08f;  // (0, 1]: log is finite
            const float u2 = u01_f32(b[h]);
            const float r = sqrtf(-2.f * logf(u1));
            float s, c;
            sincospif(2.f * u2, &s, &c);
            z[2 * h] = r * c;
            z[2 * h + 1] = r * s;
        }
#pragma unroll
        for (int k = 0; k < 4; ++k) {
            if (4 * i + k < n) out[4 * i + k] = z[k];
        }
    }
}

extern "C" __global__ void philox_normal_f64(double* out, long long n, unsigned long long seed,
                                             unsigned long long offset) {
    GRID_STRIDE(i, (n + 1) / 2) {
        const uint4 w = philox4x32_10(offset + (unsigned long long)i, seed);
        const double u1 = u01_f64(w.x, w.y) + 1.1102230246251565e-16;  // (0, 1]
        const double u2 = u01_f64(w.z, w.w);
        const double r = sqrt(-2.0 * log(u1));
        double s, c;
        sincospi(2.0 * u2, &s, &c);
        out[2 * i] = r * c;
        if (2 * i + 1 < n) out[2 * i + 1] = r * s;
    }
}

extern "C" __global__ void philox_integers(long long* out, long long n, unsigned long long seed,
                                           unsigned long long offset, long long low, unsigned long long range) {
    GRID_STRIDE(i, (n + 1) / 2) {
        const uint4 w = philox4x32_10(offset + (unsigned long long)i, seed);
        const unsigned long long r0 = ((unsigned long long)w.x << 32) | w.y;
        const unsigned long long r1 = ((unsigned long long)w.z << 32) | w.w;
        out[2 * i] = low + (long long)__umul64hi(r0, range);
        if (2 * i + 1 < n) out[2 * i + 1] = low + (long long)__umul64hi(r1, range);
    }
}
