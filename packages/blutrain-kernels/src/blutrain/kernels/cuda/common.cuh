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
