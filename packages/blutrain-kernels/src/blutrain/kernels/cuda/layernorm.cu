// LayerNorm over the last dim of an [N, C] row-major tensor, forward and backward, float32 and bf16
// (bf16 storage, float math). Two-pass statistics (mean, then sum of squared deviations) so that
// large offsets do not cancel; the row's re-reads hit L1/L2.
//
// layernorm_fwd_*:   grid N blocks (one per row), block 32..1024 threads (multiple of 32).
//                    y = (x - mean) * rstd * w + b; writes y and float32 mean[N], rstd[N] (statistics stay
//                    float32 for bf16 input, as PyTorch keeps them).
//                    Bytes: read N*C (+2C for w, b), write N*C (+2N). FLOPs ~ 7 N*C.
//                    *_f32_to_bf16_*: float32 x, w, b and a bf16 y, each element rounded once from the
//                    float32 result (the compiler's layernorm-cast pass: autocast's cast of y for the next
//                    GEMM folded in; write N*C bf16 instead of N*C float32 plus a cast's 6 bytes/element).
// layernorm_fwd_res_{x}_{y}_*: the row normalized is s = r + x (float32 r, x bf16 or float32, float32 w, b;
//                    y float32 or bf16): the compiler's layernorm-residual pass, the residual stream's add
//                    after a projection folded into the next LayerNorm, so the GEMM writes its bf16 product
//                    alone. Each s is __fadd_rn(r, x) (one rounding, as the separate float32 add) and is
//                    written (float32, [N, C]: the stream goes on from it); the statistics and y passes
//                    re-read the thread's own s. VEC is 4 for every dtype (bf16 x in 8-byte loads) and the
//                    launch is the float32 kernel's, so each thread sums the same elements in the same order
//                    and mean, rstd and y are the unfused add + LayerNorm's bits.
//                    Bytes: read N*C*(2 or 4) + N*C*4 (+2C*4), write N*C*4 + N*C*(4 or 2) (+2N).
// layernorm_bwd_*_n{NPER}: the backward for C <= 16 * 1024 elements. A row group of TG = blockDim.x
//                    threads (a power of two >= 32) owns one row at a time; thread t holds vectors
//                    t, t + TG, ... (NPER of them, VEC elements each) of g, x and w in registers, so each
//                    row is read from memory exactly once. blockDim.y = RG row groups per block, grid G
//                    blocks (all resident), block b takes rows [b RG, b RG + RG), then + G RG, ...
//                    dx = rstd * (g*w - mean(g*w) - xhat*mean(g*w*xhat)); the two row sums go through
//                    warp shuffles and, for TG > 32, a double-buffered shared table (one barrier a row).
//                    Each thread sums g*xhat and g of its columns over all its rows in registers; the RG
//                    groups then add into shared memory in a fixed order and the block writes
//                    partial[2, G, C] (float32). Dynamic shared memory: (128 RG + 2C) floats.
//                    bf16 rows hold g, x and w as loaded (4 registers per 8 values) and the two column
//                    sums in shared memory instead of registers (a slot per row group, vector, element
//                    and thread: (128 RG + 2 RG NPER VEC TG) floats), the same adds in the same order;
//                    at C = 768 that takes the kernel from 120 to 63 registers, 4 resident blocks of 256
//                    threads per SM instead of 2, twice the rows in flight. dx keeps its bits; the
//                    dweight/dbias partials follow G (the resident blocks), as they follow the SM count.
//                    Bytes: read 2*N*C (+C), write N*C + 2*G*C.
//                    addend (nullable, x's dtype, [N, C]): dx + addend, added to the float32 dx before it
//                    is stored (+N*C read): the input's other gradient (a residual stream's), which the
//                    compiler's layernorm-grad-add pass folds in instead of a separate add. In float32 the
//                    same rounding as that add; in bf16 one rounding less.
//                    *_out (float32 only): dx's other forms that the compiler's layernorm-grad-outputs
//                    pass folds in, for its readers under autocast. dx_bf16 (nullable): dx also stored as
//                    bf16, each stored float32 dx rounded once as the cast kernel rounds it (+N*C*2 bytes
//                    written, 8-byte stores), for the next bf16 GEMM, instead of a cast kernel's read and
//                    write of dx. accumulate & 2: each thread also sums the stored dx of its columns and
//                    partial is [3, G, C] (+G*C floats written): the column sums of dx, a bias gradient,
//                    instead of a sum kernel's read of dx. Kernels of their own, so that the plain ones
//                    keep their registers (occupancy) without these accumulators.
// layernorm_bwd_*:   the fallback for wider rows: grid G blocks striding over rows, re-reading each row
//                    once from L1/L2, dweight/dbias (and *_out's dx) sums in shared memory (dynamic
//                    (72 + 2C) floats, (72 + 3C) for *_out).
// layernorm_bwd_reduce_*: block (32, 16), one column of the tables*C partial columns (tables: 2, or 3 with
//                    the dx sums) per x-thread, the 16 y-lanes split the G rows and add in a fixed order
//                    (deterministic). Bytes: read tables*G*C, write tables*C.
#include "common.cuh"
#include "bf16_cast.cuh"

// x as floats: bf16 in fours is one 8-byte load (the residual kernels' VEC = 4 layout), otherwise load_vec.
template <int VEC> __device__ __forceinline__ void load_x(const float* p, float (&o)[VEC]) { load_vec<VEC>(p, o); }
template <int VEC> __device__ __forceinline__ void load_x(const bf16* p, float (&o)[VEC]) {
    if constexpr (VEC == 4) {
        const uint2 u = *reinterpret_cast<const uint2*>(p);
        unpack_bf16x2(u.x, o[0], o[1]);
        unpack_bf16x2(u.y, o[2], o[3]);
    } else {
        load_vec<VEC>(p, o);
    }
}

// dx's bf16 copy from the float32 values just stored: the cast kernel's rounding (bf16_cast.cuh: a NaN becomes
// the quiet NaN of its sign, where the shared bf16 store keeps a payload), so the copy is the cast kernel's bits
// of the stored dx. Four elements go as one 8-byte store.
template <int VEC>
__device__ __forceinline__ void store_bf16_copy(bf16* __restrict__ p, const float* o) {
    if constexpr (VEC == 4) {
        uint2 u;
        u.x = (unsigned int)f32_to_bf16(o[0]) | ((unsigned int)f32_to_bf16(o[1]) << 16);
        u.y = (unsigned int)f32_to_bf16(o[2]) | ((unsigned int)f32_to_bf16(o[3]) << 16);
        *reinterpret_cast<uint2*>(p) = u;
    } else {
#pragma unroll
        for (int k = 0; k < VEC; ++k) p[k].bits = f32_to_bf16(o[k]);
    }
}

// RES: x is the projection, r the residual stream and s = r + x the row (written to s_out); else r and s_out
// are unused and x is the row.
template <typename TX, typename T, typename TO, int VEC, bool RES>
__device__ __forceinline__ void layernorm_fwd(const TX* __restrict__ x, const float* __restrict__ r,
                                              float* __restrict__ s_out, const T* __restrict__ w,
                                              const T* __restrict__ b, TO* __restrict__ y,
                                              float* __restrict__ mean_out, float* __restrict__ rstd_out, int C,
                                              float eps) {
    __shared__ float red[66];
    const long long row = blockIdx.x;
    const TX* xr = x + row * C;
    TO* yr = y + row * C;
    const int nv = C / VEC;
    // the row's vector i as floats: after the first pass, a residual kernel reads back the s it stored (the
    // same thread wrote it: its own writes are visible to it)
    auto load_row = [&](int i, float (&v)[VEC]) {
        if constexpr (RES) {
            load_vec<VEC>(s_out + row * C + (long long)i * VEC, v);
        } else {
            load_vec<VEC>(xr + (long long)i * VEC, v);
        }
    };

    float s = 0.f;
    for (int i = threadIdx.x; i < nv; i += blockDim.x) {
        float v[VEC];
        if constexpr (RES) {
            float rv[VEC];
            load_x<VEC>(xr + (long long)i * VEC, v);
            load_vec<VEC>(r + row * C + (long long)i * VEC, rv);
#pragma unroll
            for (int k = 0; k < VEC; ++k) v[k] = __fadd_rn(rv[k], v[k]);
            store_vec<VEC>(s_out + row * C + (long long)i * VEC, v);
        } else {
            load_row(i, v);
        }
#pragma unroll
        for (int k = 0; k < VEC; ++k) s += v[k];
    }
    const float mean = block_sum(s, red) / (float)C;

    float q = 0.f;
    for (int i = threadIdx.x; i < nv; i += blockDim.x) {
        float v[VEC];
        load_row(i, v);
#pragma unroll
        for (int k = 0; k < VEC; ++k) {
            const float d = v[k] - mean;
            q += d * d;
        }
    }
    const float rstd = 1.f / sqrtf(block_sum(q, red) / (float)C + eps);

    for (int i = threadIdx.x; i < nv; i += blockDim.x) {
        float v[VEC], wv[VEC], bv[VEC], o[VEC];
        load_row(i, v);
        if (w != nullptr) {
            load_vec<VEC>(w + (long long)i * VEC, wv);
        } else {
#pragma unroll
            for (int k = 0; k < VEC; ++k) wv[k] = 1.f;
        }
        if (b != nullptr) {
            load_vec<VEC>(b + (long long)i * VEC, bv);
        } else {
#pragma unroll
            for (int k = 0; k < VEC; ++k) bv[k] = 0.f;
        }
#pragma unroll
        for (int k = 0; k < VEC; ++k) o[k] = (v[k] - mean) * rstd * wv[k] + bv[k];
        // narrowed on the way out: a NaN becomes the quiet NaN of its sign, as casts.cu's float32 -> bfloat16
        // makes it (the store keeps a payload), so the output is the cast kernel's bits
        if constexpr (sizeof(TO) < sizeof(T)) {  // T: the row's type (float with a residual)
            store_bf16_copy<VEC>(yr + (long long)i * VEC, o);
        } else {
            store_vec<VEC>(yr + (long long)i * VEC, o);
        }
    }
    if (threadIdx.x == 0) {
        mean_out[row] = mean;
        rstd_out[row] = rstd;
    }
}

// dx += addend as dx is stored: __fadd_rn, so that no multiply-add contraction gives the sum another rounding
// than a separate float32 add of the stored dx would
template <int VEC, typename T>
__device__ __forceinline__ void add_addend(const T* __restrict__ addend, float* o) {
    float av[VEC];
    load_vec<VEC>(addend, av);
#pragma unroll
    for (int k = 0; k < VEC; ++k) o[k] = __fadd_rn(o[k], av[k]);
}

template <typename T, int VEC, bool OUT>
__device__ __forceinline__ void layernorm_bwd(const T* __restrict__ g, const T* __restrict__ x,
                                              const T* __restrict__ w, const float* __restrict__ mean,
                                              const float* __restrict__ rstd, const T* __restrict__ addend,
                                              T* __restrict__ dx, bf16* __restrict__ dx_bf16,
                                              float* __restrict__ partial, int N, int C, int accumulate) {
    extern __shared__ float smem[];
    float* red = smem;             // 66 floats of reduction scratch (64 reserved + pad)
    float* acc_w = smem + 72;      // [VEC][nv]: vector-major so that a warp's adds hit distinct banks
    float* acc_b = acc_w + C;
    float* acc_d = acc_b + C;      // OUT only
    const int nv = C / VEC;
    if (accumulate) {
        for (int j = threadIdx.x; j < C; j += blockDim.x) {
            acc_w[j] = 0.f;
            acc_b[j] = 0.f;
            if constexpr (OUT) acc_d[j] = 0.f;
        }
    }
    __syncthreads();

    for (long long row = blockIdx.x; row < N; row += gridDim.x) {
        const T* gr = g + row * C;
        const T* xr = x + row * C;
        const float mu = mean[row];
        const float rs = rstd[row];
        float a = 0.f, c = 0.f;
        for (int i = threadIdx.x; i < nv; i += blockDim.x) {
            float gv[VEC], xv[VEC], wv[VEC];
            load_vec<VEC>(gr + (long long)i * VEC, gv);
            load_vec<VEC>(xr + (long long)i * VEC, xv);
            if (w != nullptr) {
                load_vec<VEC>(w + (long long)i * VEC, wv);
            } else {
#pragma unroll
                for (int k = 0; k < VEC; ++k) wv[k] = 1.f;
            }
#pragma unroll
            for (int k = 0; k < VEC; ++k) {
                const float gp = gv[k] * wv[k];
                a += gp;
                c += gp * (xv[k] - mu) * rs;
            }
        }
        a = block_sum(a, red) / (float)C;
        c = block_sum(c, red) / (float)C;
        T* dxr = dx + row * C;
        for (int i = threadIdx.x; i < nv; i += blockDim.x) {
            float gv[VEC], xv[VEC], wv[VEC], o[VEC];
            load_vec<VEC>(gr + (long long)i * VEC, gv);
            load_vec<VEC>(xr + (long long)i * VEC, xv);
            if (w != nullptr) {
                load_vec<VEC>(w + (long long)i * VEC, wv);
            } else {
#pragma unroll
                for (int k = 0; k < VEC; ++k) wv[k] = 1.f;
            }
#pragma unroll
            for (int k = 0; k < VEC; ++k) {
                const float xh = (xv[k] - mu) * rs;
                // __fmul_rn: the product as rounded in the row sum a, not fused into the subtraction (an
                // FMA would leave g*w's rounding error, times rstd, where the exact result is 0)
                o[k] = rs * (__fmul_rn(gv[k], wv[k]) - a - xh * c);
                if (accumulate) {
                    acc_w[k * nv + i] += gv[k] * xh;
                    acc_b[k * nv + i] += gv[k];
                }
            }
            if (addend != nullptr) add_addend<VEC>(addend + row * C + (long long)i * VEC, o);
            store_vec<VEC>(dxr + (long long)i * VEC, o);
            if constexpr (OUT) {
                if (dx_bf16 != nullptr) store_bf16_copy<VEC>(dx_bf16 + row * C + (long long)i * VEC, o);
                if (accumulate & 2) {
#pragma unroll
                    for (int k = 0; k < VEC; ++k) acc_d[k * nv + i] += o[k];
                }
            }
        }
    }
    if (accumulate) {
        __syncthreads();
        float* pw = partial + (long long)blockIdx.x * C;
        float* pb = partial + (long long)gridDim.x * C + (long long)blockIdx.x * C;
        float* pd = partial + 2LL * gridDim.x * C + (long long)blockIdx.x * C;
        for (int j = threadIdx.x; j < C; j += blockDim.x) {
            const int i = j / VEC, k = j - i * VEC;
            pw[j] = acc_w[k * nv + i];
            pb[j] = acc_b[k * nv + i];
            if constexpr (OUT) {
                if (accumulate & 2) pd[j] = acc_d[k * nv + i];
            }
        }
    }
}

// VEC elements of a row held in registers through the row's two passes: float32 as floats; bf16 as loaded (four
// registers for eight values, widened exactly at each use), which leaves the registers for more resident rows.
template <typename T, int VEC> struct Held {
    float v[VEC];
    __device__ __forceinline__ void load(const T* p) { load_vec<VEC>(p, v); }
    __device__ __forceinline__ void fill(float f) {
#pragma unroll
        for (int e = 0; e < VEC; ++e) v[e] = f;
    }
    __device__ __forceinline__ float operator[](int e) const { return v[e]; }
};
template <> struct Held<bf16, 8> {
    uint4 u;
    __device__ __forceinline__ void load(const bf16* p) { u = *reinterpret_cast<const uint4*>(p); }
    __device__ __forceinline__ void fill(float f) {  // f exact in bf16 (0 or 1)
        const unsigned int h = __float_as_uint(f) >> 16, w2 = h | (h << 16);
        u = make_uint4(w2, w2, w2, w2);
    }
    __device__ __forceinline__ float operator[](int e) const {  // e a constant once unrolled
        const unsigned int w2 = e < 2 ? u.x : e < 4 ? u.y : e < 6 ? u.z : u.w;
        return __uint_as_float((e & 1) ? (w2 & 0xffff0000u) : (w2 << 16));
    }
};

template <typename T, int VEC, int NPER, bool OUT>
__device__ __forceinline__ void layernorm_bwd_rows(const T* __restrict__ g, const T* __restrict__ x,
                                                   const T* __restrict__ w, const float* __restrict__ mean,
                                                   const float* __restrict__ rstd, const T* __restrict__ addend,
                                                   T* __restrict__ dx, bf16* __restrict__ dx_bf16,
                                                   float* __restrict__ partial, int N, int C, int accumulate) {
    extern __shared__ float smem[];
    const int TG = blockDim.x, RG = blockDim.y, tx = threadIdx.x, ty = threadIdx.y;
    const int lane = tx & 31, wig = tx >> 5, nwg = TG >> 5;
    const int nv = C / VEC;
    // bf16 keeps the dweight/dbias sums in shared memory, a slot per (row group, vector, element, thread)
    // that only its thread touches until the end: registers for more resident rows; the same adds in the
    // same order as in registers, so the same bits.
    constexpr bool SACC = sizeof(T) == 2 && !OUT;
    float* red = smem;               // [2 buffers][RG][32 warps][2 sums]
    float* acc = smem + 128 * RG;    // [2][C]: dweight, dbias sums of the block ([3][C] for OUT: dx's too);
                                     // SACC: [RG][NPER][2][VEC][TG] slots instead
    const float inv_c = 1.f / (float)C;
    auto slot = [&](int r, int k, int which, int e, int t) -> float& {
        return acc[(((r * NPER + k) * 2 + which) * VEC + e) * TG + t];
    };

    Held<T, VEC> wv[NPER];
    float aw[SACC ? 1 : NPER][VEC], ab[SACC ? 1 : NPER][VEC];
    float ad[OUT ? NPER : 1][VEC];   // dx's column sums (OUT only)
#pragma unroll
    for (int k = 0; k < NPER; ++k) {
        const int i = tx + k * TG;
        if (w != nullptr && i < nv) {
            wv[k].load(w + (long long)i * VEC);
        } else {
            wv[k].fill(1.f);
        }
#pragma unroll
        for (int e = 0; e < VEC; ++e) {
            if constexpr (SACC) {
                if (accumulate && i < nv) {
                    slot(ty, k, 0, e, tx) = 0.f;
                    slot(ty, k, 1, e, tx) = 0.f;
                }
            } else {
                aw[k][e] = 0.f;
                ab[k][e] = 0.f;
            }
            if constexpr (OUT) ad[k][e] = 0.f;
        }
    }

    int it = 0;
    // The trip count depends only on blockIdx, so every thread reaches every barrier.
    for (long long base = (long long)blockIdx.x * RG; base < N; base += (long long)gridDim.x * RG, ++it) {
        const long long row = base + ty;
        const bool valid = row < N;
        Held<T, VEC> gv[NPER], xv[NPER];
        float mu = 0.f, rs = 0.f;
        if (valid) {
            mu = mean[row];
            rs = rstd[row];
        }
#pragma unroll
        for (int k = 0; k < NPER; ++k) {
            const int i = tx + k * TG;
            if (valid && i < nv) {
                gv[k].load(g + row * C + (long long)i * VEC);
                xv[k].load(x + row * C + (long long)i * VEC);
            } else {
                gv[k].fill(0.f);
                xv[k].fill(0.f);
            }
        }
        float a = 0.f, c = 0.f;
#pragma unroll
        for (int k = 0; k < NPER; ++k) {
#pragma unroll
            for (int e = 0; e < VEC; ++e) {
                const float xh = (xv[k][e] - mu) * rs;  // xhat, computed again (the same bits) below
                const float gp = gv[k][e] * wv[k][e];
                a += gp;
                c += gp * xh;
            }
        }
        a = warp_sum(a);
        c = warp_sum(c);
        if (nwg > 1) {
            float* rb = red + (it & 1) * 64 * RG + 64 * ty;  // the other buffer may still be read
            if (lane == 0) {
                rb[2 * wig] = a;
                rb[2 * wig + 1] = c;
            }
            __syncthreads();
            a = 0.f;
            c = 0.f;
            for (int q = 0; q < nwg; ++q) {
                a += rb[2 * q];
                c += rb[2 * q + 1];
            }
        }
        a *= inv_c;
        c *= inv_c;
        if (valid) {
#pragma unroll
            for (int k = 0; k < NPER; ++k) {
                const int i = tx + k * TG;
                float o[VEC];
#pragma unroll
                for (int e = 0; e < VEC; ++e) {
                    const float xh = (xv[k][e] - mu) * rs;
                    o[e] = rs * (__fmul_rn(gv[k][e], wv[k][e]) - a - xh * c);  // as above
                    if constexpr (SACC) {
                        if (accumulate && i < nv) {
                            slot(ty, k, 0, e, tx) += gv[k][e] * xh;
                            slot(ty, k, 1, e, tx) += gv[k][e];
                        }
                    } else {
                        aw[k][e] += gv[k][e] * xh;
                        ab[k][e] += gv[k][e];
                    }
                }
                if (i < nv) {
                    if (addend != nullptr) add_addend<VEC>(addend + row * C + (long long)i * VEC, o);
                    store_vec<VEC>(dx + row * C + (long long)i * VEC, o);
                    if constexpr (OUT) {
                        if (dx_bf16 != nullptr) store_bf16_copy<VEC>(dx_bf16 + row * C + (long long)i * VEC, o);
#pragma unroll
                        for (int e = 0; e < VEC; ++e) ad[k][e] += o[e];  // the stored value
                    }
                }
            }
        }
    }
    if (!accumulate) return;
    float* pw = partial + (long long)blockIdx.x * C;
    float* pb = partial + (long long)gridDim.x * C + (long long)blockIdx.x * C;
    if constexpr (SACC) {
        __syncthreads();
        for (int j = ty * TG + tx; j < C; j += TG * RG) {  // the row groups' slots added in order, as below
            const int i = j / VEC, e = j - i * VEC, k = i / TG, t = i - k * TG;
            float sw = slot(0, k, 0, e, t), sb = slot(0, k, 1, e, t);
            for (int r = 1; r < RG; ++r) {
                sw = sw + slot(r, k, 0, e, t);
                sb = sb + slot(r, k, 1, e, t);
            }
            pw[j] = sw;
            pb[j] = sb;
        }
    } else {
        for (int r = 0; r < RG; ++r) {  // fixed order over the row groups: reproducible sums
            if (ty == r) {
#pragma unroll
                for (int k = 0; k < NPER; ++k) {
                    const int i = tx + k * TG;
                    if (i < nv) {
#pragma unroll
                        for (int e = 0; e < VEC; ++e) {
                            const int col = i * VEC + e;
                            acc[col] = r == 0 ? aw[k][e] : acc[col] + aw[k][e];
                            acc[C + col] = r == 0 ? ab[k][e] : acc[C + col] + ab[k][e];
                            if constexpr (OUT) {
                                acc[2 * C + col] = r == 0 ? ad[k][e] : acc[2 * C + col] + ad[k][e];
                            }
                        }
                    }
                }
            }
            __syncthreads();
        }
        float* pd = partial + 2LL * gridDim.x * C + (long long)blockIdx.x * C;
        for (int j = ty * TG + tx; j < C; j += TG * RG) {
            pw[j] = acc[j];
            pb[j] = acc[C + j];
            if constexpr (OUT) {
                if (accumulate & 2) pd[j] = acc[2 * C + j];
            }
        }
    }
}

template <typename T>
__device__ __forceinline__ void layernorm_bwd_reduce(const float* __restrict__ partial, T* __restrict__ dw,
                                                     T* __restrict__ db, T* __restrict__ ds, int G, int C,
                                                     int tables) {
    // Columns [0, C) are dweight's, [C, 2C) dbias's, [2C, 3C) dx's (tables == 3): partial[tables, G, C].
    const long long j = (long long)blockIdx.x * 32 + threadIdx.x;
    const int t = j < C ? 0 : j < 2LL * C ? 1 : 2;
    const long long col = j - (long long)t * C;
    T* out = t == 0 ? dw : t == 1 ? db : ds;
    const float* src = partial + (long long)t * G * C;
    const bool in = j < (long long)tables * C;
    // Each table is [G, C]; a warp straddling a boundary reads two tables, which is fine.
    const float s = partial_column_sum(src, G, C, in ? col : (long long)C);
    if (threadIdx.y == 0 && in && out != nullptr) out[col] = from_float<T>(s);
}

#define LN_FWD(NAME, T, TO, VEC)                                                                    \
    extern "C" __global__ void NAME(const T* x, const T* w, const T* b, TO* y, float* mean, float* rstd, int C, \
                                    float eps) {                                                    \
        layernorm_fwd<T, T, TO, VEC, false>(x, nullptr, nullptr, w, b, y, mean, rstd, C, eps);     \
    }
LN_FWD(layernorm_fwd_f32_v4, float, float, 4)
LN_FWD(layernorm_fwd_f32_v1, float, float, 1)
LN_FWD(layernorm_fwd_bf16_v8, bf16, bf16, 8)
LN_FWD(layernorm_fwd_bf16_v1, bf16, bf16, 1)
LN_FWD(layernorm_fwd_f32_to_bf16_v4, float, bf16, 4)
LN_FWD(layernorm_fwd_f32_to_bf16_v1, float, bf16, 1)

#define LN_FWD_RES(NAME, TX, TO, VEC)                                                               \
    extern "C" __global__ void NAME(const TX* x, const float* r, const float* w, const float* b, float* s, \
                                    TO* y, float* mean, float* rstd, int C, float eps) {            \
        layernorm_fwd<TX, float, TO, VEC, true>(x, r, s, w, b, y, mean, rstd, C, eps);            \
    }
LN_FWD_RES(layernorm_fwd_res_bf16_f32_v4, bf16, float, 4)
LN_FWD_RES(layernorm_fwd_res_bf16_f32_v1, bf16, float, 1)
LN_FWD_RES(layernorm_fwd_res_bf16_bf16_v4, bf16, bf16, 4)
LN_FWD_RES(layernorm_fwd_res_bf16_bf16_v1, bf16, bf16, 1)
LN_FWD_RES(layernorm_fwd_res_f32_f32_v4, float, float, 4)
LN_FWD_RES(layernorm_fwd_res_f32_f32_v1, float, float, 1)
LN_FWD_RES(layernorm_fwd_res_f32_bf16_v4, float, bf16, 4)
LN_FWD_RES(layernorm_fwd_res_f32_bf16_v1, float, bf16, 1)

#define LN_BWD(NAME, T, VEC, OUT)                                                                     \
    extern "C" __global__ void NAME(const T* g, const T* x, const T* w, const float* mean, const float* rstd, \
                                    const T* addend, T* dx, bf16* dx_bf16, float* partial, int N, int C, \
                                    int accumulate) {                                                   \
        layernorm_bwd<T, VEC, OUT>(g, x, w, mean, rstd, addend, dx, dx_bf16, partial, N, C, accumulate); \
    }
LN_BWD(layernorm_bwd_f32_v4, float, 4, false)
LN_BWD(layernorm_bwd_f32_v1, float, 1, false)
LN_BWD(layernorm_bwd_bf16_v8, bf16, 8, false)
LN_BWD(layernorm_bwd_bf16_v1, bf16, 1, false)
LN_BWD(layernorm_bwd_f32_v4_out, float, 4, true)
LN_BWD(layernorm_bwd_f32_v1_out, float, 1, true)

#define LN_BWD_ROWS(NAME, T, VEC, NPER, OUT)                                                          \
    extern "C" __global__ void __launch_bounds__(256) NAME(const T* g, const T* x, const T* w, const float* mean, \
                                    const float* rstd, const T* addend, T* dx, bf16* dx_bf16, float* partial, \
                                    int N, int C, int accumulate) {                                     \
        layernorm_bwd_rows<T, VEC, NPER, OUT>(g, x, w, mean, rstd, addend, dx, dx_bf16, partial, N, C,    \
                                              accumulate);                                              \
    }
// MINB resident blocks of 256 threads per SM asked of the register allocator
#define LN_BWD_ROWS_MIN(NAME, T, VEC, NPER, OUT, MINB)                                                \
    extern "C" __global__ void __launch_bounds__(256, MINB) NAME(const T* g, const T* x, const T* w,     \
                                    const float* mean, const float* rstd, const T* addend, T* dx,        \
                                    bf16* dx_bf16, float* partial, int N, int C, int accumulate) {       \
        layernorm_bwd_rows<T, VEC, NPER, OUT>(g, x, w, mean, rstd, addend, dx, dx_bf16, partial, N, C,    \
                                              accumulate);                                              \
    }
LN_BWD_ROWS(layernorm_bwd_f32_v4_n1, float, 4, 1, false)
LN_BWD_ROWS(layernorm_bwd_f32_v4_n2, float, 4, 2, false)
LN_BWD_ROWS(layernorm_bwd_f32_v4_n3, float, 4, 3, false)
LN_BWD_ROWS(layernorm_bwd_f32_v4_n4, float, 4, 4, false)
LN_BWD_ROWS(layernorm_bwd_bf16_v8_n1, bf16, 8, 1, false)
LN_BWD_ROWS_MIN(layernorm_bwd_bf16_v8_n2, bf16, 8, 2, false, 4)
LN_BWD_ROWS(layernorm_bwd_f32_v1_n1, float, 1, 1, false)
LN_BWD_ROWS(layernorm_bwd_f32_v1_n2, float, 1, 2, false)
LN_BWD_ROWS(layernorm_bwd_f32_v1_n4, float, 1, 4, false)
LN_BWD_ROWS(layernorm_bwd_f32_v1_n8, float, 1, 8, false)
LN_BWD_ROWS(layernorm_bwd_f32_v1_n16, float, 1, 16, false)
LN_BWD_ROWS(layernorm_bwd_bf16_v1_n1, bf16, 1, 1, false)
LN_BWD_ROWS(layernorm_bwd_bf16_v1_n2, bf16, 1, 2, false)
LN_BWD_ROWS(layernorm_bwd_bf16_v1_n4, bf16, 1, 4, false)
LN_BWD_ROWS(layernorm_bwd_bf16_v1_n8, bf16, 1, 8, false)
LN_BWD_ROWS(layernorm_bwd_bf16_v1_n16, bf16, 1, 16, false)
// float32 with dx's bf16 copy and column sums: the backward of autocast's float32 LayerNorm
LN_BWD_ROWS(layernorm_bwd_f32_v4_n1_out, float, 4, 1, true)
LN_BWD_ROWS(layernorm_bwd_f32_v4_n2_out, float, 4, 2, true)
LN_BWD_ROWS(layernorm_bwd_f32_v4_n3_out, float, 4, 3, true)
LN_BWD_ROWS(layernorm_bwd_f32_v4_n4_out, float, 4, 4, true)
LN_BWD_ROWS(layernorm_bwd_f32_v1_n1_out, float, 1, 1, true)
LN_BWD_ROWS(layernorm_bwd_f32_v1_n2_out, float, 1, 2, true)
LN_BWD_ROWS(layernorm_bwd_f32_v1_n4_out, float, 1, 4, true)
LN_BWD_ROWS(layernorm_bwd_f32_v1_n8_out, float, 1, 8, true)
LN_BWD_ROWS(layernorm_bwd_f32_v1_n16_out, float, 1, 16, true)

extern "C" __global__ void layernorm_bwd_reduce_f32(const float* partial, float* dw, float* db, float* ds, int G,
                                                    int C, int tables) {
    layernorm_bwd_reduce<float>(partial, dw, db, ds, G, C, tables);
}
extern "C" __global__ void layernorm_bwd_reduce_bf16(const float* partial, bf16* dw, bf16* db, bf16* ds, int G,
                                                     int C, int tables) {
    layernorm_bwd_reduce<bf16>(partial, dw, db, ds, G, C, tables);
}
