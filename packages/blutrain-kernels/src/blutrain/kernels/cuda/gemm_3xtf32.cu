// float32 GEMM at float32 accuracy on tensor cores (3xTF32): C[M,N] = op(A) op(B), or C += op(A) op(B),
// every matrix row-major and contiguous. op(A) is A[M,K] ("n") or the transpose of A[K,M] ("t"); op(B) is
// B[K,N] ("n") or the transpose of B[N,K] ("t"). A linear layer y = x W^T is "nt", its input gradient
// dx = dy W is "nn", its weight gradient dW = dy^T x is "tn" (kernel gemm3x_<a><b>_v<VEC>).
//
// Numerics. Each operand x is split into hi = tf32(x) (round to nearest) and lo = x - hi (exact in
// float32; the tensor core reads its top 19 bits), and a.b ~ hi_a hi_b + hi_a lo_b + lo_a hi_b with
// mma.sync m16n8k8 .tf32 (the dropped lo_a lo_b and the truncation of lo are ~2^-21 relative per
// product). The tensor core's own float32 accumulation truncates (round toward zero), which summed over
// all of K = 3072 drifts to 3e-6..3e-5 relative in a NumPy model of it (attention.cu saw ~1e-5 at 2048,
// where it stages for the same reason): so each 32-deep k-tile is accumulated in a zeroed stage (12 mma per
// output fragment) and added to the running sum with an ordinary round-to-nearest FADD. A NumPy model of
// the truncating accumulator puts this at ~3e-7 relative (Frobenius) at K = 768 and 3072, below a
// sequential float32 FFMA chain (~5e-7 and ~1e-6, what a SIMT SGEMM does).
//
// Launch: 256 threads (8 warps as 2 x 4), block tile 128 x 128, k-tile 32, grid (tiles, 1, splits). Tiles
// go in groups of 8 row tiles (all column tiles of a group before the next), so that a wave of blocks
// shares operand tiles in L2 even when B is larger than L2 (the LM head). Split-K (grid.z > 1, chosen by
// the host when M x N has too few tiles to fill the GPU) writes split z's partial product into a float32
// workspace [splits, M, N] that gemm3x_splitk_reduce sums, in split order, into C: deterministic.
//   Pipeline: a 4-stage cp.async ring of (A, B) k-tiles; one barrier per k-tile; 16-byte copies when
//   every contiguous extent is a multiple of 4 floats and the bases are 16-byte aligned (_v4), else
//   4-byte copies (_v1, any size). Out-of-range rows and k are zero-filled, so edge tiles need no branch
//   in the math.
//   Warp tile 64 x 32 = 4 x 4 fragments of 16 x 8. Indices are renamed so that each thread's fragment
//   elements are contiguous in shared memory and come in 16-byte loads (LDS.128):
//     rows: fragment row r (0..15) of m-block i is warp row 4 (r % 8) + i + 32 (r / 8), so thread
//           (g, t) = (lane / 4, lane % 4) holds rows 4g..4g+3 and 32+4g..32+4g+3;
//     cols: fragment col c (0..7) of n-block j is warp col 4c + j, so B's column g of the four n-blocks
//           is 4g..4g+3 and the accumulator's columns 2t, 2t+1 are 8t..8t+7 (two float4 stores per row);
//     k:    reduction index l (0..7) of step s of k-half p is k = 16p + 4(l % 4) + 2s + l / 4, the same
//           for A and B (a renaming of the summation), so a K-major row gives k 4t..4t+3 of two steps in
//           one load.
//   Shared tiles are stored as they arrive: K-major [128 rows][32 k], MN-major [32 k][128]. An XOR
//   swizzle of the 16-byte chunks makes every LDS.128 and every cp.async store conflict-free: chunk c of
//   K-major row r is stored at c ^ (4 ((r / 4) % 2)); chunk c of MN-major row k at c ^ (2 ((k / 4) % 4)).
//
// Budget per thread: 64 running sums + 64 stage sums + 48 raw operand words of one k-half + 24 lo parts
// of one step. Registers (--resource-usage, no spills anywhere): nvcc 13.0 sm_90 216-254 (nn_v4 254,
// nt_v4 246), sm_80 214-252; NVRTC 12.9 + ptxas sm_90 214-248. So 1 block (8 warps) per SM
// (__launch_bounds__(256, 1)). Shared memory 4 stages x (128 + 128) x 32 x 4 B = 128 KB (dynamic, opted
// in past 48 KB by the launcher). Per k-tile a warp issues 192 HMMA.1688.F32.TF32 among ~725-790 SASS
// instructions (96 splits at 3 each, 64 stage adds, 24 LDS.128, 8 LDGSTS): tensor-bound unless mma.sync
// runs faster than one HMMA per ~3.8 issue cycles per warp.
// FLOPs: 2 M N K useful (x3 on the tensor cores). Bytes: each block reads a 128-row slab of A and of B, so
// 4 K (M ceil(N / 128) + N ceil(M / 128)) from L2 and, with the grouping, about 4 K (M + N) from DRAM; C
// 4 M N written (and read with accumulate); split-K adds 4 M N (2 splits + 1) for the partials.
#include "common.cuh"

#define GM_BM 128
#define GM_BN 128
#define GM_BK 32
#define GM_STAGES 4
#define GM_THREADS 256
#define GM_GROUP 8
#define GM_TILE_FLOATS (GM_BM * GM_BK)  // one operand's k-tile; A and B tiles are the same size

__device__ __forceinline__ unsigned gm_smem_addr(const void* p) {
    unsigned a;
    asm("{ .reg .u64 t; cvta.to.shared.u64 t, %1; cvt.u32.u64 %0, t; }" : "=r"(a) : "l"(p));
    return a;
}

// 16 (or 4) bytes global -> shared without passing through registers; zero-filled when !valid (src unread).
__device__ __forceinline__ void gm_cp16(float* dst, const float* src, bool valid) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(gm_smem_addr(dst)), "l"(src),
                 "r"(valid ? 16 : 0));
}

__device__ __forceinline__ void gm_cp4(float* dst, const float* src, bool valid) {
    asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(gm_smem_addr(dst)), "l"(src),
                 "r"(valid ? 4 : 0));
}

__device__ __forceinline__ void gm_commit() { asm volatile("cp.async.commit_group;\n" ::); }

template <int N> __device__ __forceinline__ void gm_wait() { asm volatile("cp.async.wait_group %0;\n" ::"n"(N)); }

// Float offset of element (row r, k) of a K-major tile [128][32] and of (row k, col c) of an MN-major
// tile [32][128], with the chunk swizzles of the header.
__device__ __forceinline__ int kmajor_off(int r, int k) {
    return r * GM_BK + ((((k >> 2) ^ (((r >> 2) & 1) << 2))) << 2) + (k & 3);
}

__device__ __forceinline__ int mnmajor_off(int k, int c) {
    return k * GM_BM + ((((c >> 2) ^ (((k >> 2) & 3) << 1))) << 2) + (c & 3);
}

// One thread's share of the copies of one operand's k-tiles into shared memory, its addresses worked out
// once. KMAJOR: the operand is g[rows][K] (row stride ld = K) and tiles are 128 rows x 32 k; else it is
// g[K][rows] (row stride ld = rows) and tiles are 32 k x 128 columns. Rows are r0..r0+127. Out-of-range
// elements are zero-filled; interior tiles (the usual case) take a copy loop without range checks.
template <bool KMAJOR, int VEC>
struct TileCopier {
    const float* base;  // the operand (the source of a zero-filled copy, which reads nothing)
    const float* src;   // this thread's first element at k-tile 0 of the split
    long long ld;
    int rows, r0, K, kbeg;
    int tr, tk;         // this thread's first (row, k) within a tile (VEC = 4: a 4-float chunk)

    __device__ __forceinline__ void init(const float* g, long long ld_, int rows_, int r0_, int K_, int kbeg_) {
        base = g; ld = ld_; rows = rows_; r0 = r0_; K = K_; kbeg = kbeg_;
        const int tid = threadIdx.x;
        if constexpr (KMAJOR) {
            tr = VEC == 4 ? tid >> 3 : tid >> 5;
            tk = VEC == 4 ? (tid & 7) << 2 : tid & 31;
            src = g + (long long)(r0 + tr) * ld + kbeg + tk;
        } else {
            tk = VEC == 4 ? tid >> 5 : tid >> 7;
            tr = VEC == 4 ? (tid & 31) << 2 : tid & 127;
            src = g + (long long)(kbeg + tk) * ld + r0 + tr;
        }
    }

    // Copy i (0 <= i < COPIES) of this thread: (row, k) within the tile.
    static constexpr int COPIES = GM_TILE_FLOATS / VEC / GM_THREADS;
    static constexpr int ROW_STEP = KMAJOR ? GM_THREADS * VEC / GM_BK : 0;  // K-major: rows between copies
    static constexpr int K_STEP = KMAJOR ? 0 : GM_THREADS * VEC / GM_BM;    // MN-major: k between copies

    __device__ __forceinline__ void copy(float* s, int kt) const {
        const int k0 = kbeg + kt * GM_BK;
        const float* p = src + (KMAJOR ? (long long)kt * GM_BK : (long long)kt * GM_BK * ld);
        const bool interior = r0 + GM_BM <= rows && k0 + GM_BK <= K;
#pragma unroll(VEC == 4 ? COPIES : 4)
        for (int i = 0; i < COPIES; ++i) {
            const int r = tr + i * ROW_STEP, k = tk + i * K_STEP;
            const float* q = p + (KMAJOR ? (long long)i * ROW_STEP * ld : (long long)i * K_STEP * ld);
            float* d = s + (KMAJOR ? kmajor_off(r, k) : mnmajor_off(k, r));
            // VEC = 4: the contiguous extent is a multiple of 4, so a chunk is in range or out as a whole
            const bool ok = interior || (r0 + r < rows && k0 + k < K);
            if constexpr (VEC == 4) gm_cp16(d, ok ? q : base, ok);
            else gm_cp4(d, ok ? q : base, ok);
        }
    }
};

// hi = x rounded to TF32 (half a TF32 ulp added, low 13 bits cleared), lo = x - hi (exact). lo goes to
// the tensor core as it is: mma reads the top 19 bits of a .tf32 operand (as in attention.cu).
__device__ __forceinline__ void gm_split(float x, unsigned& hi, unsigned& lo) {
    hi = (__float_as_uint(x) + 0x1000u) & 0xffffe000u;
    lo = __float_as_uint(x - __uint_as_float(hi));
}

// d = a b + d; A 16 x 8 (a0: row g col t, a1: g+8 t, a2: g t+4, a3: g+8 t+4), B 8 x 8 (b0: row t col g,
// b1: t+4 g), C 16 x 8 (c0: g 2t, c1: g 2t+1, c2: g+8 2t, c3: g+8 2t+1); g = lane / 4, t = lane % 4.
__device__ __forceinline__ void gm_mma(float (&d)[4], const unsigned (&a)[4], const unsigned (&b)[2]) {
    asm("mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%0, %1, %2, %3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}

// stg[i][j] += (the warp's 64 rows of sA) (32 k) (sB's 32 columns of the warp), 3xTF32, i < 4 m-blocks,
// j < 4 n-blocks. ra[i][h][q]: A at warp row 4g + i + 32h, k = 16p + 4t + q; rb[j][q]: B at k = 16p + 4t + q,
// warp col 4g + j. Step s of half p uses q = 2s (logical k t) and q = 2s + 1 (logical k t + 4).
template <bool A_KMAJOR, bool B_KMAJOR>
__device__ __forceinline__ void warp_tile_mma(float (&stg)[4][4][4], const float* sA, const float* sB, int wm, int wn,
                                              int g, int t) {
#pragma unroll
    for (int p = 0; p < 2; ++p) {
        float ra[4][2][4], rb[4][4];
        if constexpr (A_KMAJOR) {  // one load: k 4t..4t+3 of one row
#pragma unroll
            for (int i = 0; i < 4; ++i) {
#pragma unroll
                for (int h = 0; h < 2; ++h) {
                    const float4 v = *reinterpret_cast<const float4*>(
                        sA + kmajor_off(64 * wm + 4 * g + i + 32 * h, 16 * p + 4 * t));
                    ra[i][h][0] = v.x; ra[i][h][1] = v.y; ra[i][h][2] = v.z; ra[i][h][3] = v.w;
                }
            }
        } else {  // one load: rows 4g..4g+3 (i = 0..3) of one k
#pragma unroll
            for (int q = 0; q < 4; ++q) {
#pragma unroll
                for (int h = 0; h < 2; ++h) {
                    const float4 v = *reinterpret_cast<const float4*>(
                        sA + mnmajor_off(16 * p + 4 * t + q, 64 * wm + 32 * h + 4 * g));
                    ra[0][h][q] = v.x; ra[1][h][q] = v.y; ra[2][h][q] = v.z; ra[3][h][q] = v.w;
                }
            }
        }
        if constexpr (B_KMAJOR) {
#pragma unroll
            for (int j = 0; j < 4; ++j) {
                const float4 v =
                    *reinterpret_cast<const float4*>(sB + kmajor_off(32 * wn + 4 * g + j, 16 * p + 4 * t));
                rb[j][0] = v.x; rb[j][1] = v.y; rb[j][2] = v.z; rb[j][3] = v.w;
            }
        } else {  // one load: columns 4g..4g+3 (j = 0..3) of one k
#pragma unroll
            for (int q = 0; q < 4; ++q) {
                const float4 v =
                    *reinterpret_cast<const float4*>(sB + mnmajor_off(16 * p + 4 * t + q, 32 * wn + 4 * g));
                rb[0][q] = v.x; rb[1][q] = v.y; rb[2][q] = v.z; rb[3][q] = v.w;
            }
        }
#pragma unroll
        for (int s = 0; s < 2; ++s) {
            unsigned ahi[4][4], alo[4][4], bhi[4][2], blo[4][2];
#pragma unroll
            for (int i = 0; i < 4; ++i) {
                gm_split(ra[i][0][2 * s], ahi[i][0], alo[i][0]);
                gm_split(ra[i][1][2 * s], ahi[i][1], alo[i][1]);
                gm_split(ra[i][0][2 * s + 1], ahi[i][2], alo[i][2]);
                gm_split(ra[i][1][2 * s + 1], ahi[i][3], alo[i][3]);
            }
#pragma unroll
            for (int j = 0; j < 4; ++j) {
                gm_split(rb[j][2 * s], bhi[j][0], blo[j][0]);
                gm_split(rb[j][2 * s + 1], bhi[j][1], blo[j][1]);
            }
            // the small cross terms first, the big product last; 16 independent sums between two mma
            // into the same one
#pragma unroll
            for (int i = 0; i < 4; ++i) {
#pragma unroll
                for (int j = 0; j < 4; ++j) gm_mma(stg[i][j], alo[i], bhi[j]);
            }
#pragma unroll
            for (int i = 0; i < 4; ++i) {
#pragma unroll
                for (int j = 0; j < 4; ++j) gm_mma(stg[i][j], ahi[i], blo[j]);
            }
#pragma unroll
            for (int i = 0; i < 4; ++i) {
#pragma unroll
                for (int j = 0; j < 4; ++j) gm_mma(stg[i][j], ahi[i], bhi[j]);
            }
        }
    }
}

// Store (or add to) 4 consecutive columns col..col+3 of row `row` of C[M, N]: one float4 when they are all
// in range and C's rows are 16-byte aligned (cvec), else element by element.
__device__ __forceinline__ void store4(float* __restrict__ C, int N, int row, int col, float4 v, int accumulate,
                                       bool cvec) {
    float* p = C + (long long)row * N + col;
    if (cvec && col + 3 < N) {
        if (accumulate) {
            const float4 o = *reinterpret_cast<const float4*>(p);
            v.x += o.x; v.y += o.y; v.z += o.z; v.w += o.w;
        }
        *reinterpret_cast<float4*>(p) = v;
        return;
    }
    const float e[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
    for (int q = 0; q < 4; ++q) {
        if (col + q < N) p[q] = accumulate ? p[q] + e[q] : e[q];
    }
}

template <bool A_KMAJOR, bool B_KMAJOR, int VEC>
__device__ __forceinline__ void gemm3x(const float* __restrict__ A, const float* __restrict__ B, float* __restrict__ C,
                                       int M, int N, int K, int accumulate, int cvec, int kt_per_split) {
    extern __shared__ __align__(16) float gm_smem[];
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    const int wm = warp >> 2, wn = warp & 3;

    // grouped tile order: GM_GROUP row tiles at a time, every column tile of the group before the next
    const int tiles_m = (M + GM_BM - 1) / GM_BM, tiles_n = (N + GM_BN - 1) / GM_BN;
    const int pid = blockIdx.x, per_group = GM_GROUP * tiles_n;
    const int first_m = (pid / per_group) * GM_GROUP;
    const int gsize = min(tiles_m - first_m, GM_GROUP);
    const int m0 = (first_m + (pid % per_group) % gsize) * GM_BM;
    const int n0 = ((pid % per_group) / gsize) * GM_BN;

    const int kt_total = (K + GM_BK - 1) / GM_BK;
    const int kt0 = blockIdx.z * kt_per_split;
    const int KT = min(kt_total - kt0, kt_per_split);
    C += (long long)blockIdx.z * M * N;  // split z's partial (the host passes the workspace when splits > 1)

    TileCopier<A_KMAJOR, VEC> copy_a;
    TileCopier<B_KMAJOR, VEC> copy_b;
    copy_a.init(A, A_KMAJOR ? K : M, M, m0, K, kt0 * GM_BK);
    copy_b.init(B, B_KMAJOR ? K : N, N, n0, K, kt0 * GM_BK);
    auto load = [&](int stage, int kt) {
        float* sA = gm_smem + stage * 2 * GM_TILE_FLOATS;
        copy_a.copy(sA, kt);
        copy_b.copy(sA + GM_TILE_FLOATS, kt);
    };

#pragma unroll
    for (int s = 0; s < GM_STAGES - 1; ++s) {
        if (s < KT) load(s, s);
        gm_commit();
    }

    float acc[4][4][4], stg[4][4][4];
#pragma unroll
    for (int i = 0; i < 4; ++i) {
#pragma unroll
        for (int j = 0; j < 4; ++j) {
#pragma unroll
            for (int e = 0; e < 4; ++e) acc[i][j][e] = 0.f;
        }
    }

    for (int kt = 0; kt < KT; ++kt) {
        gm_wait<GM_STAGES - 2>();  // this thread's copies of k-tile kt have landed
        __syncthreads();           // everyone's have, and everyone is done with the stage refilled next
        const int nk = kt + GM_STAGES - 1;
        if (nk < KT) load(nk % GM_STAGES, nk);
        gm_commit();  // an empty group past the end keeps the count of groups in flight uniform

        const float* sA = gm_smem + (kt % GM_STAGES) * 2 * GM_TILE_FLOATS;
#pragma unroll
        for (int i = 0; i < 4; ++i) {
#pragma unroll
            for (int j = 0; j < 4; ++j) {
#pragma unroll
                for (int e = 0; e < 4; ++e) stg[i][j][e] = 0.f;
            }
        }
        warp_tile_mma<A_KMAJOR, B_KMAJOR>(stg, sA, sA + GM_TILE_FLOATS, wm, wn, g, t);
        // the truncating tensor-core sums of this k-tile join the running sums with rounded adds
#pragma unroll
        for (int i = 0; i < 4; ++i) {
#pragma unroll
            for (int j = 0; j < 4; ++j) {
#pragma unroll
                for (int e = 0; e < 4; ++e) acc[i][j][e] += stg[i][j][e];
            }
        }
    }
    gm_wait<0>();

    // acc[i][j][2h + u]: row 4g + i + 32h, column 8t + 4u + j of the warp's 64 x 32 tile
    const int rbase = m0 + 64 * wm + 4 * g, cbase = n0 + 32 * wn + 8 * t;
#pragma unroll
    for (int h = 0; h < 2; ++h) {
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            const int row = rbase + i + 32 * h;
            if (row < M) {
#pragma unroll
                for (int u = 0; u < 2; ++u) {
                    const int col = cbase + 4 * u;
                    if (col < N) {
                        store4(C, N, row, col,
                               make_float4(acc[i][0][2 * h + u], acc[i][1][2 * h + u], acc[i][2][2 * h + u],
                                           acc[i][3][2 * h + u]),
                               accumulate, cvec != 0);
                    }
                }
            }
        }
    }
}

#define GEMM3X_KERNEL(name, AK, BK_, VEC)                                                                        \
    extern "C" __global__ void __launch_bounds__(GM_THREADS, 1)                                                  \
        name(const float* __restrict__ A, const float* __restrict__ B, float* __restrict__ C, int M, int N, int K, \
             int accumulate, int cvec, int kt_per_split) {                                                       \
        gemm3x<AK, BK_, VEC>(A, B, C, M, N, K, accumulate, cvec, kt_per_split);                                  \
    }

GEMM3X_KERNEL(gemm3x_nt_v4, true, true, 4)
GEMM3X_KERNEL(gemm3x_nn_v4, true, false, 4)
GEMM3X_KERNEL(gemm3x_tn_v4, false, false, 4)
GEMM3X_KERNEL(gemm3x_tt_v4, false, true, 4)
GEMM3X_KERNEL(gemm3x_nt_v1, true, true, 1)
GEMM3X_KERNEL(gemm3x_nn_v1, true, false, 1)
GEMM3X_KERNEL(gemm3x_tn_v1, false, false, 1)
GEMM3X_KERNEL(gemm3x_tt_v1, false, true, 1)

// C[i] = the sum over splits z (in order) of ws[z][i], then + C[i] when accumulating; i < mn. VEC = 4: mn %
// 4 == 0 and both 16-byte aligned. Grid-stride; bytes 4 mn (splits + 1 + accumulate).
template <int VEC>
__device__ __forceinline__ void splitk_reduce(const float* __restrict__ ws, float* __restrict__ C, long long mn,
                                              int splits, int accumulate) {
    const long long nv = mn / VEC;
    const long long stride = (long long)gridDim.x * blockDim.x;
    for (long long v = blockIdx.x * (long long)blockDim.x + threadIdx.x; v < nv; v += stride) {
        float s[VEC];
        load_vec<VEC>(ws + v * VEC, s);
        for (int z = 1; z < splits; ++z) {
            float u[VEC];
            load_vec<VEC>(ws + z * mn + v * VEC, u);
#pragma unroll
            for (int q = 0; q < VEC; ++q) s[q] += u[q];
        }
        if (accumulate) {
            float o[VEC];
            load_vec<VEC>(C + v * VEC, o);
#pragma unroll
            for (int q = 0; q < VEC; ++q) s[q] += o[q];
        }
        store_vec<VEC>(C + v * VEC, s);
    }
}

extern "C" __global__ void gemm3x_splitk_reduce_v4(const float* __restrict__ ws, float* __restrict__ C, long long mn,
                                                   int splits, int accumulate) {
    splitk_reduce<4>(ws, C, mn, splits, accumulate);
}

extern "C" __global__ void gemm3x_splitk_reduce_v1(const float* __restrict__ ws, float* __restrict__ C, long long mn,
                                                   int splits, int accumulate) {
    splitk_reduce<1>(ws, C, mn, splits, accumulate);
}
