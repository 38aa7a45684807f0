// Shared device helpers of BluTrain's CUDA kernels: the bfloat16 storage type, float conversion,
// 16-byte vector loads/stores that widen to float, warp/block reductions and the column sum of
// per-block partials.
//
// bfloat16 is a plain 16-bit storage type here, not cuda_bf16.h's __nv_bfloat16: NVRTC through CuPy
// finds cuda_fp16.h in CuPy's bundled headers but cuda_bf16.h only in a local toolkit, and a version
// mismatch between the two breaks compilation (cupy/cupy#8146). Every kernel computes in float and
// rounds once on store, with round-to-nearest-even and quiet NaNs, bit-identical to ml_dtypes.
#pragma once

// Infinity without <math.h> (NVRTC has no host headers).
#define BT_INF __int_as_float(0x7f800000)

struct __align__(2) bf16 {
    unsigned short bits;
};

__device__ __forceinline__ float to_float(float x) { return x; }
__device__ __forceinline__ float to_float(bf16 x) { return __uint_as_float(((unsigned int)x.bits) << 16); }

__device__ __forceinline__ unsigned short float_to_bf16_bits(float x) {
    unsigned int u = __float_as_uint(x);
    if ((u & 0x7fffffffu) > 0x7f800000u) {
        return (unsigned short)((u >> 16) | 0x40u);  // NaN stays NaN (quiet), keeping its sign
    }
    u += 0x7fffu + ((u >> 16) & 1u);  // round to nearest, ties to even
    return (unsigned short)(u >> 16);
}

template <typename T> __device__ __forceinline__ T from_float(float x);
template <> __device__ __forceinline__ float from_float<float>(float x) { return x; }
template <> __device__ __forceinline__ bf16 from_float<bf16>(float x) {
    bf16 r;
    r.bits = float_to_bf16_bits(x);
    return r;
}

// VEC consecutive elements as floats. VEC is the 16-byte width (4 floats or 8 bf16) or 1; callers
// guarantee 16-byte alignment of p when VEC > 1.
template <int VEC> __device__ __forceinline__ void load_vec(const float* p, float (&o)[VEC]) {
    if constexpr (VEC == 4) {
        float4 v = *reinterpret_cast<const float4*>(p);
        o[0] = v.x; o[1] = v.y; o[2] = v.z; o[3] = v.w;
    } else {
#pragma unroll
        for (int i = 0; i < VEC; ++i) o[i] = p[i];
    }
}

__device__ __forceinline__ void unpack_bf16x2(unsigned int u, float& lo, float& hi) {
    lo = __uint_as_float(u << 16);
    hi = __uint_as_float(u & 0xffff0000u);
}

__device__ __forceinline__ unsigned int pack_bf16x2(float lo, float hi) {
    return (unsigned int)float_to_bf16_bits(lo) | ((unsigned int)float_to_bf16_bits(hi) << 16);
}

template <int VEC> __device__ __forceinline__ void load_vec(const bf16* p, float (&o)[VEC]) {
    if constexpr (VEC == 8) {
        uint4 v = *reinterpret_cast<const uint4*>(p);
        unpack_bf16x2(v.x, o[0], o[1]);
        unpack_bf16x2(v.y, o[2], o[3]);
        unpack_bf16x2(v.z, o[4], o[5]);
        unpack_bf16x2(v.w, o[6], o[7]);
    } else {
#pragma unroll
        for (int i = 0; i < VEC; ++i) o[i] = to_float(p[i]);
    }
}

template <int VEC> __device__ __forceinline__ void store_vec(float* p, const float (&v)[VEC]) {
    if constexpr (VEC == 4) {
        *reinterpret_cast<float4*>(p) = make_float4(v[0], v[1], v[2], v[3]);
    } else {
#pragma unroll
        for (int i = 0; i < VEC; ++i) p[i] = v[i];
    }
}

template <int VEC> __device__ __forceinline__ void store_vec(bf16* p, const float (&v)[VEC]) {
    if constexpr (VEC == 8) {
        uint4 u;
        u.x = pack_bf16x2(v[0], v[1]);
        u.y = pack_bf16x2(v[2], v[3]);
        u.z = pack_bf16x2(v[4], v[5]);
        u.w = pack_bf16x2(v[6], v[7]);
        *reinterpret_cast<uint4*>(p) = u;
    } else {
#pragma unroll
        for (int i = 0; i < VEC; ++i) p[i] = from_float<bf16>(v[i]);
    }
}

// The 16-byte vector width of T: 4 floats or 8 bf16.
template <typename T> struct VecWidth;
template <> struct VecWidth<float> { static constexpr int value = 4; };
template <> struct VecWidth<bf16> { static constexpr int value = 8; };

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}

// Sum over the block, returned to every thread. shm holds at least 32 floats. blockDim.x is a
// multiple of 32. The leading barrier lets callers reuse shm for consecutive reductions.
__device__ __forceinline__ float block_sum(float v, float* shm) {
    const int lane = threadIdx.x & 31, wid = threadIdx.x >> 5, nw = blockDim.x >> 5;
    v = warp_sum(v);
    __syncthreads();
    if (lane == 0) shm[wid] = v;
    __syncthreads();
    if (wid == 0) {
        float s = lane < nw ? shm[lane] : 0.f;
        s = warp_sum(s);
        if (lane == 0) shm[32] = s;
    }
    __syncthreads();
    return shm[32];
}

// Column sums of a float32 [S, D] table of per-block partials, for the finishing kernels of two-pass
// reductions: block (32, 16), column col = blockIdx.x * 32 + threadIdx.x; the 16 row lanes stride over
// S and are added in a fixed order, so the result is reproducible. Returns the sum to threadIdx.y == 0
// (other lanes get 0). Every thread of the block must call it (it holds a barrier).
__device__ __forceinline__ float partial_column_sum(const float* __restrict__ partial, int S, long long D,
                                                    long long col) {
    __shared__ float tile[16][33];
    float s = 0.f;
    if (col < D) {
        int r = threadIdx.y;
        for (; r + 48 < S; r += 64) {  // four independent loads in flight per thread
            const float a = partial[(long long)r * D + col], b = partial[(long long)(r + 16) * D + col];
            const float c = partial[(long long)(r + 32) * D + col], d = partial[(long long)(r + 48) * D + col];
            s += (a + b) + (c + d);
        }
        for (; r < S; r += 16) s += partial[(long long)r * D + col];
    }
    tile[threadIdx.y][threadIdx.x] = s;
    __syncthreads();
    if (threadIdx.y != 0) return 0.f;
    float t = 0.f;
#pragma unroll
    for (int y = 0; y < 16; ++y) t += tile[y][threadIdx.x];
    return t;
}

// One-launch column sums over a (column tile x row chunk) grid, block (32, RL): thread (tx, ty) of
// block (tile, chunk) holds acc[VEC], its rows' sums of the VEC columns of column vector tile*32 + tx.
// The block adds its RL row lanes in shared memory (fixed order). With one chunk (gridDim.y == 1) it
// stores the tile's sums; else it writes a float32 partial[chunk][tile][32*VEC] and takes a ticket
// from counters[tile]; the last block of the tile to arrive (threadfence-reduction pattern: only the
// ticket is atomic) adds the gridDim.y partials, as float4s in a fixed order, stores the sums and
// resets counters[tile] to 0 for the next launch on the stream. The result does not depend on which
// block came last, so it is bitwise reproducible. store(v, k, s): column vector tile*32 + v, element
// k, sum s. Every thread of the block must call it (it holds barriers).
template <int VEC, int RL, typename Store>
__device__ __forceinline__ void column_tile_sum(const float (&acc)[VEC], float* __restrict__ partial,
                                                unsigned int* __restrict__ counters, Store store) {
    constexpr int TW = 32 * VEC;           // floats of one tile row; column c = k * 32 + v
    constexpr int LANES = 32 * RL * 4 / TW;  // row lanes of the last block's float4 sum
    constexpr int RED = (LANES > RL ? LANES : RL) * TW;
    __shared__ float red[RED];
    __shared__ int last;
    const int tx = threadIdx.x, ty = threadIdx.y, tid = ty * 32 + tx;
#pragma unroll
    for (int k = 0; k < VEC; ++k) red[ty * TW + k * 32 + tx] = acc[k];
    __syncthreads();
    float s = 0.f;
    if (tid < TW) {
#pragma unroll
        for (int y = 0; y < RL; ++y) s += red[y * TW + tid];
    }
    if (gridDim.y == 1) {
        if (tid < TW) store(tid & 31, tid >> 5, s);
        return;
    }
    if (tid < TW) partial[((long long)blockIdx.y * gridDim.x + blockIdx.x) * TW + tid] = s;
    __threadfence();
    __syncthreads();
    if (tid == 0) last = atomicAdd(counters + blockIdx.x, 1u) == gridDim.y - 1;
    __syncthreads();
    if (!last) return;
    __threadfence();
    const int q = tid % (TW / 4), lane = tid / (TW / 4);
    const float* p = partial + (long long)blockIdx.x * TW + 4 * q;
    const long long step = (long long)gridDim.x * TW;
    // __ldcg: from L2, where the other blocks' partials are; four loads in flight per thread, since this
    // block's sum is the launch's tail
    const int S = (int)gridDim.y;
    float4 t = make_float4(0.f, 0.f, 0.f, 0.f);
    int y = lane;
    for (; y + 3 * LANES < S; y += 4 * LANES) {
        const float4 a = __ldcg(reinterpret_cast<const float4*>(p + y * step));
        const float4 b = __ldcg(reinterpret_cast<const float4*>(p + (y + LANES) * step));
        const float4 c = __ldcg(reinterpret_cast<const float4*>(p + (y + 2 * LANES) * step));
        const float4 d = __ldcg(reinterpret_cast<const float4*>(p + (y + 3 * LANES) * step));
        t.x += (a.x + b.x) + (c.x + d.x);
        t.y += (a.y + b.y) + (c.y + d.y);
        t.z += (a.z + b.z) + (c.z + d.z);
        t.w += (a.w + b.w) + (c.w + d.w);
    }
    for (; y < S; y += LANES) {
        const float4 u = __ldcg(reinterpret_cast<const float4*>(p + y * step));
        t.x += u.x; t.y += u.y; t.z += u.z; t.w += u.w;
    }
    float* r = red + lane * TW + 4 * q;
    r[0] = t.x; r[1] = t.y; r[2] = t.z; r[3] = t.w;
    __syncthreads();
    if (tid < TW) {
        float v = 0.f;
#pragma unroll
        for (int l = 0; l < LANES; ++l) v += red[l * TW + tid];
        store(tid & 31, tid >> 5, v);
    }
    if (tid == 0) counters[blockIdx.x] = 0u;
}

// log-sum-exp state (running max m, sum of exp(x - m)); combining handles all -inf inputs.
struct LseState {
    float m;
    float s;
};

__device__ __forceinline__ LseState lse_combine(LseState a, LseState b) {
    const float m = fmaxf(a.m, b.m);
    if (m == -BT_INF) return LseState{-BT_INF, 0.f};
    return LseState{m, a.s * expf(a.m - m) + b.s * expf(b.m - m)};
}

__device__ __forceinline__ LseState warp_lse(LseState v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
        LseState other{__shfl_xor_sync(0xffffffffu, v.m, o), __shfl_xor_sync(0xffffffffu, v.s, o)};
        v = lse_combine(v, other);
    }
    return v;
}

// shm holds at least 66 floats.
__device__ __forceinline__ LseState block_lse(LseState v, float* shm) {
    const int lane = threadIdx.x & 31, wid = threadIdx.x >> 5, nw = blockDim.x >> 5;
    v = warp_lse(v);
    __syncthreads();
    if (lane == 0) {
        shm[wid] = v.m;
        shm[32 + wid] = v.s;
    }
    __syncthreads();
    if (wid == 0) {
        LseState w = lane < nw ? LseState{shm[lane], shm[32 + lane]} : LseState{-BT_INF, 0.f};
        w = warp_lse(w);
        if (lane == 0) {
            shm[64] = w.m;
            shm[65] = w.s;
        }
    }
    __syncthreads();
    return LseState{shm[64], shm[65]};
}
