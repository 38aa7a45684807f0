// Sums of an [N, D] row-major tensor in float accumulators, float32 and bf16; the order of every
// addition is fixed by the launch shape, so results are bitwise reproducible.
//
// sum_cols_*:   out[d] = sum_n x[n, d] (bias gradients, sum over leading dims). Block (32, 8):
//               x = 32 column vectors of VEC elements, y = 8 row lanes; grid (ceil(D/VEC/32), S row
//               splits). Each block reduces its rows over the 8 lanes in shared memory and writes
//               out (S == 1) or a float32 partial[S, D]; each thread keeps four rows' loads in
//               flight. sum_cols_finish_* (block (32, 16): 32 columns, 16 lanes splitting the S rows,
//               partial_column_sum) then adds the S partials per column. Bytes: read N*D (+ 2*S*D),
//               write D.
// sum_rows_*:   out[n] = sum_d x[n, d]. Grid N blocks (one per row). Bytes: read N*D, write N.
#include "common.cuh"

template <typename T, int VEC>
__device__ __forceinline__ void sum_cols(const T* __restrict__ x, T* __restrict__ out, float* __restrict__ partial,
                                         long long N, int D, long long rows_per_split) {
    __shared__ float tile[8][32 * VEC + 1];
    const int tx = threadIdx.x, ty = threadIdx.y;
    const int nv = D / VEC;
    const int i = blockIdx.x * 32 + tx;
    const long long r0 = (long long)blockIdx.y * rows_per_split;
    long long r1 = r0 + rows_per_split;
    if (r1 > N) r1 = N;
    float acc[VEC];
#pragma unroll
    for (int k = 0; k < VEC; ++k) acc[k] = 0.f;
    if (i < nv) {
        const T* xc = x + (long long)i * VEC;
        long long r = r0 + ty;
        for (; r + 24 < r1; r += 32) {  // four rows' loads in flight before the first add
            float v[4][VEC];
#pragma unroll
            for (int u = 0; u < 4; ++u) load_vec<VEC>(xc + (r + 8 * u) * D, v[u]);
#pragma unroll
            for (int u = 0; u < 4; ++u)
#pragma unroll
                for (int k = 0; k < VEC; ++k) acc[k] += v[u][k];
        }
        for (; r < r1; r += 8) {
            float v[VEC];
            load_vec<VEC>(xc + r * D, v);
#pragma unroll
            for (int k = 0; k < VEC; ++k) acc[k] += v[k];
        }
    }
#pragma unroll
    for (int k = 0; k < VEC; ++k) tile[ty][tx * VEC + k] = acc[k];
    __syncthreads();
    if (ty == 0 && i < nv) {
        float s[VEC];
#pragma unroll
        for (int k = 0; k < VEC; ++k) {
            float t = 0.f;
#pragma unroll
            for (int y = 0; y < 8; ++y) t += tile[y][tx * VEC + k];
            s[k] = t;
        }
        if (gridDim.y == 1) {
            store_vec<VEC>(out + (long long)i * VEC, s);
        } else {
            float* p = partial + (long long)blockIdx.y * D + (long long)i * VEC;
#pragma unroll
            for (int k = 0; k < VEC; ++k) p[k] = s[k];
        }
    }
}

template <typename T>
__device__ __forceinline__ void sum_cols_finish(const float* __restrict__ partial, T* __restrict__ out, int S, int D) {
    const long long j = (long long)blockIdx.x * 32 + threadIdx.x;
    const float s = partial_column_sum(partial, S, D, j);
    if (threadIdx.y == 0 && j < D) out[j] = from_float<T>(s);
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
    extern "C" __global__ void sum_cols_##SUFFIX(const T* x, T* out, float* partial, long long N, int D,    \
                                                 long long rows_per_split) {                               \
        sum_cols<T, VEC>(x, out, partial, N, D, rows_per_split);                                           \
    }                                                                                                      \
    extern "C" __global__ void sum_rows_##SUFFIX(const T* x, T* out, int D) { sum_rows<T, VEC>(x, out, D); }
SUM_KERNELS(f32_v4, float, 4)
SUM_KERNELS(f32_v1, float, 1)
SUM_KERNELS(bf16_v8, bf16, 8)
SUM_KERNELS(bf16_v1, bf16, 1)

extern "C" __global__ void sum_cols_finish_f32(const float* partial, float* out, int S, int D) {
    sum_cols_finish<float>(partial, out, S, D);
}
extern "C" __global__ void sum_cols_finish_bf16(const float* partial, bf16* out, int S, int D) {
    sum_cols_finish<bf16>(partial, out, S, D);
}
