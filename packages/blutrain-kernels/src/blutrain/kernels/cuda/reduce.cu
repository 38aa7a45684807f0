// Sums of an [N, D] row-major tensor in float accumulators, float32 and bf16; the order of every
// addition is fixed by the launch shape, so results are bitwise reproducible on a given GPU.
//
// sum_cols_*:   out[d] = sum_n x[n, d] (bias gradients, sums over leading dims), in one launch.
//               Block (32, 16): x = 32 column vectors of VEC elements (16-byte loads, 512 contiguous
//               bytes of a row per warp), y = 16 row lanes; grid (ceil(D/VEC/32) column tiles, S row
//               chunks of rows_per rows), S chosen on the host so that about two blocks per SM run.
//               Each thread keeps 8 rows' loads in flight, the block adds its lanes in shared memory
//               and, when S > 1, writes a float32 partial; the last block of a tile to finish adds the
//               S partials in a fixed order (column_tile_sum in common.cuh; a per-tile ticket counter
//               is the only atomic). Bytes: read N*D (+ 2*S*D*4 of partials, S*D <= ~64K floats),
//               write D. FLOPs: N*D adds.
// sum_rows_*:   out[n] = sum_d x[n, d]. Grid N blocks (one per row). Bytes: read N*D, write N.
#include "common.cuh"

#define SUM_COLS_LANES 16
#define SUM_COLS_UNROLL 8

template <typename T, int VEC>
__device__ __forceinline__ void sum_cols(const T* __restrict__ x, T* __restrict__ out, float* __restrict__ partial,
                                         unsigned int* __restrict__ counters, long long N, int D,
                                         long long rows_per) {
    constexpr int RL = SUM_COLS_LANES, U = SUM_COLS_UNROLL;
    const int nv = D / VEC;
    const int i = blockIdx.x * 32 + threadIdx.x;
    const long long r0 = (long long)blockIdx.y * rows_per;
    const long long r1 = r0 + rows_per < N ? r0 + rows_per : N;
    float acc[VEC];
#pragma unroll
    for (int k = 0; k < VEC; ++k) acc[k] = 0.f;
    if (i < nv) {
        const T* xc = x + (long long)i * VEC;
        long long r = r0 + threadIdx.y;
        for (; r + (U - 1) * RL < r1; r += U * RL) {  // U rows' loads in flight, then the adds
            float v[U][VEC];
#pragma unroll
            for (int u = 0; u < U; ++u) load_vec<VEC>(xc + (r + u * RL) * D, v[u]);
#pragma unroll
            for (int u = 0; u < U; ++u)
#pragma unroll
                for (int k = 0; k < VEC; ++k) acc[k] += v[u][k];
        }
        if (r < r1) {  // fewer than U rows left: the same, predicated
            float v[U - 1][VEC];
#pragma unroll
            for (int u = 0; u < U - 1; ++u) {
                const bool in = r + u * RL < r1;
#pragma unroll
                for (int k = 0; k < VEC; ++k) v[u][k] = 0.f;
                if (in) load_vec<VEC>(xc + (r + u * RL) * D, v[u]);
            }
#pragma unroll
            for (int u = 0; u < U - 1; ++u)
#pragma unroll
                for (int k = 0; k < VEC; ++k) acc[k] += v[u][k];
        }
    }
    const int tile0 = blockIdx.x * 32;
    column_tile_sum<VEC, RL>(acc, partial, counters, [&](int v, int k, float s) {
        if (tile0 + v < nv) out[(long long)(tile0 + v) * VEC + k] = from_float<T>(s);
    });
}

template <typename T, int VEC>
__device__ __forceinline__ void sum_rows(const T* __restrict__ x, T* __restrict__ out, int D) {
    __shared__ float red[66];
    const long long row = blockIdx.x;
    const T* xr = x + row * (long long)D;
    const int nv = D / VEC;
    float s = 0.f;
    for (int i = threadIdx.x; i < nv; i += blockDim.x) {
        float v[VEC];
        load_vec<VEC>(xr + (long long)i * VEC, v);
#pragma unroll
        for (int k = 0; k < VEC; ++k) s += v[k];
    }
    s = block_sum(s, red);
    if (threadIdx.x == 0) out[row] = from_float<T>(s);
}

#define SUM_KERNELS(SUFFIX, T, VEC)                                                                         \
    extern "C" __global__ void __launch_bounds__(32 * SUM_COLS_LANES, 2)                                   \
        sum_cols_##SUFFIX(const T* x, T* out, float* partial, unsigned int* counters, long long N, int D,  \
                          long long rows_per) {                                                            \
        sum_cols<T, VEC>(x, out, partial, counters, N, D, rows_per);                                       \
    }                                                                                                      \
    extern "C" __global__ void sum_rows_##SUFFIX(const T* x, T* out, int D) { sum_rows<T, VEC>(x, out, D); }
SUM_KERNELS(f32_v4, float, 4)
SUM_KERNELS(f32_v1, float, 1)
SUM_KERNELS(bf16_v8, bf16, 8)
SUM_KERNELS(bf16_v1, bf16, 1)
