// Flash attention (online softmax; no L x S matrix in memory), forward and backward, causal
// (top-left aligned: query i sees keys 0..i) or not, head dim D = 64 or 128. Layout: q, out (and dq,
// dout) hold L rows of D per (batch, head), k and v (dk, dv) S rows; each tensor is addressed through
// its own (batch, head, row) strides in elements, with the D elements of a row contiguous, so that
// views need no copy: q, k and v may be the three parts of one packed [B, T, 3, H, D] projection (row
// stride 3HD) and out a [B, T, H, D] buffer (row stride HD). blockIdx.y = b * H + h. Base pointers and
// strides must keep every row 16-byte aligned (cp.async; the host checks). lse (and Delta) are
// [B*H, L] float32, contiguous (natural log of the row's sum of exp(scale * q.k)). bfloat16 lives in
// attention_bf16.cu. Grouped-query attention: k, v, dk, dv have H / group heads, query head h reads key/value
// head h / group (group 1: one each); the dk/dv kernel's blocks are per key/value head (blockIdx.y = b * H /
// group + h_kv) and step through the query tiles of the group's query heads one head after another.
//
// float32 (attn_*_f32_d*): tensor cores with 3xTF32 (mma.sync m16n8k8), the scheme PyTorch's fp32
// memory-efficient attention (xFormers' CUTLASS kernel, OpMultiplyAddFastF32) uses. TF32 mma.sync
// runs at several times the fp32 FFMA rate, so three TF32 products per product still win. Each operand x is split as hi = tf32(x) (round to nearest), lo = x - hi,
// and a.b ~ hi_a hi_b + hi_a lo_b + lo_a hi_b with float32 accumulation: the dropped lo_a lo_b and the
// roundings are ~2^-21 relative per product, float32-level (one-pass TF32, ~2^-11, is not). The split
// is three ALU ops per fragment element, in registers, so shared memory holds plain float32.
//   The tensor core's own float32 adds truncate, so an accumulator that sums over every tile (out, dq,
//   dk, dv) would drift with the sequence length (~1e-5 at 2048): each tile's product is staged in a
//   zeroed accumulator and added to the running one with an ordinary rounded add.
//   Tiles: 4 warps (128 threads); each warp owns 16 rows of the block's 64-row tile (queries in the
//   forward and dq, keys in dk/dv) and the whole other side of the step (BN keys or BQ queries), so a
//   row's softmax statistics combine over the 4 lanes of a quad with two shuffles. Shared rows are
//   padded to D + 4 floats: the fragment reads (row g, column t) and (row 2t, column g) of m16n8k8 then
//   hit 32 distinct banks. Operand tiles arrive with cp.async (16 B, zero-fill past the end), K and V
//   (or Q and dO) in separate groups so that the next tile of one loads while the other is in use.
//   The accumulator of S = Q K^T (rows g, g+8; columns 2t, 2t+1) is reused as the A operand of P V
//   (which wants columns t and t+4) by renaming the reduction index: logical key t is physical key 2t,
//   t+4 is 2t+1, and V's fragment reads the same physical rows, so no shuffle is needed.
//   Under causal masking, a warp skips the 8-key (8-query) column blocks its rows cannot see.
//   Occupancy (warps per SM, bounded by registers and shared memory) is what the speed follows, hence
//   the narrow other side (small tiles, 4 warps per block: docs/kernels.md has the timings).
// attn_fwd_f32:     grid (ceil(L/64), BH); BN = 64 keys per step (D = 64, 4 blocks/SM) or 32 (D = 128,
//                   3 blocks/SM); smem (64 + 2*BN)*(D+4) floats. Heaviest causal tiles first.
//                   FLOPs 4*BH*L*S*D (half when causal), x3 on the tensor cores; bytes: q once, k and v
//                   once per query tile, out and lse once.
// attn_bwd_dq_f32:  grid (ceil(L/64), BH), BN = 32 keys per step; first Delta = rowsum(dO * out)
//                   (written for the next kernel), then per key tile dP = dO V^T,
//                   P = exp(scale S - lse), dS = P (dP - Delta), dq += scale dS K.
//                   smem (2*64 + 2*BN)*(D+4) floats.
// attn_bwd_dkv_f32: grid (ceil(S/64), BH / group), BQ = 32 queries per step: dP^T = V dO^T, P^T, dS^T,
//                   dv += P^T dO, dk += scale dS^T Q. Separate from dq (which recomputes P and dP)
//                   instead of atomics on dq: deterministic. smem (2*64 + 2*BQ)*(D+4) + 2*BQ floats.
//
#include "common.cuh"
#include "attention.cuh"

#define LN2 0.6931471805599453f

// ------------------------------------------------------------------ float32: 3xTF32 tensor cores

// hi = x rounded to TF32 (half a TF32 ulp added, low 13 bits cleared), lo = x - hi (exact). lo goes to
// the tensor core as it is: mma reads the top 19 bits of a .tf32 operand, so lo is truncated there
// (~2^-21 |x| at most, of either sign since hi was rounded to nearest).
__device__ __forceinline__ void tf32_split(float x, unsigned& hi, unsigned& lo) {
    hi = (__float_as_uint(x) + 0x1000u) & 0xffffe000u;
    lo = __float_as_uint(x - __uint_as_float(hi));
}

// A: 16 x 8 (rows g, g+8; columns t, t+4), B: 8 x 8 (rows t, t+4; column g), C: 16 x 8 (rows g, g+8;
// columns 2t, 2t+1), with g = lane / 4 and t = lane % 4.
struct FragA {
    unsigned hi[4], lo[4];
};
struct FragB {
    unsigned hi[2], lo[2];
};

__device__ __forceinline__ void mma_tf32(float (&c)[4], const unsigned (&a)[4], const unsigned (&b)[2]) {
    asm("mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%0, %1, %2, %3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}

// c += a b to float32 accuracy: the small cross terms first, the big product last.
__device__ __forceinline__ void mma_3xtf32(float (&c)[4], const FragA& a, const FragB& b) {
    mma_tf32(c, a.lo, b.hi);
    mma_tf32(c, a.hi, b.lo);
    mma_tf32(c, a.hi, b.hi);
}

// A from 16 shared rows of stride ST (m at row 0, column k0).
template <int ST>
__device__ __forceinline__ void frag_a_rows(FragA& f, const float* m, int g, int t) {
    tf32_split(m[g * ST + t], f.hi[0], f.lo[0]);
    tf32_split(m[(g + 8) * ST + t], f.hi[1], f.lo[1]);
    tf32_split(m[g * ST + t + 4], f.hi[2], f.lo[2]);
    tf32_split(m[(g + 8) * ST + t + 4], f.hi[3], f.lo[3]);
}

// B[k][n] = m[n][k]: 8 shared rows are B's columns (K in Q K^T; m at row n0, column k0).
template <int ST>
__device__ __forceinline__ void frag_b_cols(FragB& f, const float* m, int g, int t) {
    tf32_split(m[g * ST + t], f.hi[0], f.lo[0]);
    tf32_split(m[g * ST + t + 4], f.hi[1], f.lo[1]);
}

// B[k][n] = m[k][n] under the renamed reduction index (logical k = t, t+4 -> physical rows 2t, 2t+1):
// V in P V (m at row k0, column n0).
template <int ST>
__device__ __forceinline__ void frag_b_rows(FragB& f, const float* m, int g, int t) {
    tf32_split(m[2 * t * ST + g], f.hi[0], f.lo[0]);
    tf32_split(m[(2 * t + 1) * ST + g], f.hi[1], f.lo[1]);
}

// A from an accumulator block (columns 2t, 2t+1 are logical t, t+4: see frag_b_rows).
__device__ __forceinline__ void frag_a_acc(FragA& f, const float (&c)[4]) {
    tf32_split(c[0], f.hi[0], f.lo[0]);
    tf32_split(c[2], f.hi[1], f.lo[1]);
    tf32_split(c[1], f.hi[2], f.lo[2]);
    tf32_split(c[3], f.hi[3], f.lo[3]);
}

__device__ __forceinline__ void zero(float (&c)[4]) { c[0] = c[1] = c[2] = c[3] = 0.f; }

// acc[n] (16 x 8 each) += A (16 x 8*KS, shared rows) B^T, for column blocks lo <= n < hi of the NT that
// b's rows hold (8 rows each). acc starts at zero for each tile: at most 3*KS truncating adds.
template <int NT, int KS, int ST>
__device__ __forceinline__ void warp_mma_abt(float (&acc)[NT][4], const float* a, const float* b, int lo, int hi,
                                             int g, int t) {
#pragma unroll
    for (int ks = 0; ks < KS; ++ks) {
        FragA fa;
        frag_a_rows<ST>(fa, a + ks * 8, g, t);
#pragma unroll
        for (int n = 0; n < NT; ++n) {
            if (n >= lo && n < hi) {
                FragB fb;
                frag_b_cols<ST>(fb, b + n * 8 * ST + ks * 8, g, t);
                mma_3xtf32(acc[n], fa, fb);
            }
        }
    }
}

// acc[n] (16 x 8 each, n < NT) += P (16 x 8*KT, accumulator blocks p[kk]) B, B's rows in shared memory;
// reduction blocks lo <= kk < hi only (the others are zero in P). The tensor core's float32 adds
// truncate, so acc, which sums over every tile, is only added to with rounding: each CH-block chunk of
// the product goes to a zeroed stage first (P's split is redone per chunk: registers are scarcer).
template <int KT, int NT, int CH, int ST>
__device__ __forceinline__ void warp_mma_pb(float (&acc)[NT][4], const float (&p)[KT][4], const float* b, int lo,
                                            int hi, int g, int t) {
#pragma unroll
    for (int c0 = 0; c0 < NT; c0 += CH) {
        float st[CH][4];
#pragma unroll
        for (int n = 0; n < CH; ++n) zero(st[n]);
#pragma unroll
        for (int kk = 0; kk < KT; ++kk) {
            if (kk >= lo && kk < hi) {
                FragA fa;
                frag_a_acc(fa, p[kk]);
#pragma unroll
                for (int n = 0; n < CH; ++n) {
                    FragB fb;
                    frag_b_rows<ST>(fb, b + kk * 8 * ST + (c0 + n) * 8, g, t);
                    mma_3xtf32(st[n], fa, fb);
                }
            }
        }
#pragma unroll
        for (int n = 0; n < CH; ++n) {
#pragma unroll
            for (int i = 0; i < 4; ++i) acc[c0 + n][i] += st[n][i];
        }
    }
}

__device__ __forceinline__ unsigned smem_addr(const void* p) {
    unsigned a;
    asm("{ .reg .u64 t; cvta.to.shared.u64 t, %1; cvt.u32.u64 %0, t; }" : "=r"(a) : "l"(p));
    return a;
}

// attention.cuh's cp.async to a float* destination, its shared-window address taken last (through cvta in asm,
// not shared_address's intrinsic), which fixes the instruction order ptxas sees: the float32 kernels' tile shapes
// are tuned for that order.
__device__ __forceinline__ void cp_async_16(float* dst, const float* src, bool valid) {
    cp_async_16(smem_addr(dst), src, valid);
}

__device__ __forceinline__ void cp_async_4(float* dst, const float* src, bool valid) {
    cp_async_4(smem_addr(dst), src, valid);
}

// dst[r][0..D) (stride D+4) = src[(row0 + r) * rs + 0..D), zero for rows at or past rows_valid.
template <int D, int ROWS, int THREADS>
__device__ __forceinline__ void load_rows_async(float* dst, const float* src, long long rs, int row0,
                                                int rows_valid) {
    constexpr int C = D / 4;  // 16-byte chunks per row
#pragma unroll
    for (int e = threadIdx.x; e < ROWS * C; e += THREADS) {
        const int r = e / C, c = e % C;
        const int gr = row0 + r;
        const bool ok = gr < rows_valid;
        cp_async_16(dst + r * (D + 4) + c * 4, src + (ok ? gr : 0) * rs + c * 4, ok);
    }
}

// dst[i] = src[row0 + i] for i < N (zero at or past rows_valid): lse and Delta of a query tile.
template <int N>
__device__ __forceinline__ void load_vec_async(float* dst, const float* src, int row0, int rows_valid) {
    if (threadIdx.x < N) {
        const int row = row0 + threadIdx.x;
        const bool ok = row < rows_valid;
        cp_async_4(dst + threadIdx.x, src + (ok ? row : 0), ok);
    }
}

// Number of 8-wide column blocks (from 0) that rows up to last_row can see under causal masking when
// the tile's columns start at c0: all NT without causal, none when last_row < c0.
template <int NT> __device__ __forceinline__ int causal_blocks(int causal, int last_row, int c0) {
    if (!causal) return NT;
    if (last_row < c0) return 0;
    return min(NT, (last_row - c0) / 8 + 1);
}

// WARPS x 16 queries per block, BN keys per step; output blocks staged CH at a time.
template <int D, int WARPS, int BN, int CH>
__device__ __forceinline__ void attn_fwd_tc(const float* __restrict__ q, const float* __restrict__ k,
                                            const float* __restrict__ v, float* __restrict__ out,
                                            float* __restrict__ lse, int L, int S, float scale, int causal,
                                            int H, int group, RowLayout lq, RowLayout lk, RowLayout lv,
                                            RowLayout lo) {
    constexpr int BM = WARPS * 16, TH = WARPS * 32, ST = D + 4, NT = BN / 8, DT = D / 8;
    extern __shared__ __align__(16) float tc_smem[];
    float* sQ = tc_smem;
    float* sK = sQ + BM * ST;
    float* sV = sK + BN * ST;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    const int bh = blockIdx.y, batch = bh / H, head = bh - batch * H;
    const int q0 = (causal ? gridDim.x - 1 - blockIdx.x : blockIdx.x) * BM;  // heaviest causal tiles first
    const int qw = q0 + warp * 16;                                            // this warp's first row
    const float* qb = head_rows(q, lq, batch, head);
    const float* kb = head_rows(k, lk, batch, head / group);
    const float* vb = head_rows(v, lv, batch, head / group);
    const float sl2 = scale * ATTN_LOG2E;

    load_rows_async<D, BM, TH>(sQ, qb, lq.row, q0, L);
    load_rows_async<D, BN, TH>(sK, kb, lk.row, 0, S);
    cp_async_commit();
    load_rows_async<D, BN, TH>(sV, vb, lv.row, 0, S);
    cp_async_commit();

    float o[DT][4], m[2] = {-BT_INF, -BT_INF}, l[2] = {0.f, 0.f};  // l: this lane's part of the row sum
#pragma unroll
    for (int n = 0; n < DT; ++n) zero(o[n]);

    const int kend = causal ? min(S, q0 + BM) : S;
    for (int k0 = 0; k0 < kend; k0 += BN) {
        const bool more = k0 + BN < kend;
        const int nhi = causal_blocks<NT>(causal, qw + 15, k0);
        cp_async_wait<1>();  // Q and this K tile
        __syncthreads();
        float s[NT][4];
#pragma unroll
        for (int n = 0; n < NT; ++n) zero(s[n]);
        warp_mma_abt<NT, D / 8, ST>(s, sQ + warp * 16 * ST, sK, 0, nhi, g, t);
        __syncthreads();  // every warp is done with sK
        if (more) load_rows_async<D, BN, TH>(sK, kb, lk.row, k0 + BN, S);
        cp_async_commit();

        const bool edge = k0 + BN > S || (causal && k0 + BN - 1 > qw);
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            const int row = qw + g + 8 * h;
            float mx = -BT_INF;
#pragma unroll
            for (int n = 0; n < NT; ++n) {
#pragma unroll
                for (int e = 0; e < 2; ++e) {
                    float x = s[n][2 * h + e] * sl2;
                    if (edge) {
                        const int col = k0 + n * 8 + 2 * t + e;
                        if (col >= S || (causal && col > row)) x = -BT_INF;
                    }
                    s[n][2 * h + e] = x;
                    mx = fmaxf(mx, x);
                }
            }
            mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
            mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
            const float mn = fmaxf(m[h], mx);
            const float mref = mn == -BT_INF ? 0.f : mn;  // a row with nothing visible yet stays at zero
            const float alpha = fast_exp2(m[h] - mref);
            m[h] = mn;
            float rs = 0.f;
#pragma unroll
            for (int n = 0; n < NT; ++n) {
#pragma unroll
                for (int e = 0; e < 2; ++e) {
                    const float p = fast_exp2(s[n][2 * h + e] - mref);
                    s[n][2 * h + e] = p;
                    rs += p;
                }
            }
            l[h] = l[h] * alpha + rs;
#pragma unroll
            for (int n = 0; n < DT; ++n) {
                o[n][2 * h] *= alpha;
                o[n][2 * h + 1] *= alpha;
            }
        }

        cp_async_wait<1>();  // this V tile (the next K may still be in flight)
        __syncthreads();
        warp_mma_pb<NT, DT, CH, ST>(o, s, sV, 0, nhi, g, t);
        __syncthreads();  // every warp is done with sV
        if (more) load_rows_async<D, BN, TH>(sV, vb, lv.row, k0 + BN, S);
        cp_async_commit();
    }
    cp_async_wait<0>();

    float* ob = head_rows(out, lo, batch, head);
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        float lt = l[h];
        lt += __shfl_xor_sync(0xffffffffu, lt, 1);
        lt += __shfl_xor_sync(0xffffffffu, lt, 2);
        const int row = qw + g + 8 * h;
        if (row < L) {
            const float inv = 1.f / lt;
            float* orow = ob + row * lo.row + 2 * t;
#pragma unroll
            for (int n = 0; n < DT; ++n) {
                *reinterpret_cast<float2*>(orow + n * 8) = make_float2(o[n][2 * h] * inv, o[n][2 * h + 1] * inv);
            }
            if (t == 0) lse[(long long)bh * L + row] = (m[h] + log2f(lt)) * LN2;
        }
    }
}

// WARPS x 16 queries per block, BN keys per step.
template <int D, int WARPS, int BN, int CH>
__device__ __forceinline__ void attn_bwd_dq_tc(const float* __restrict__ q, const float* __restrict__ k,
                                               const float* __restrict__ v, const float* __restrict__ dout,
                                               const float* __restrict__ out, const float* __restrict__ lse,
                                               float* __restrict__ delta, float* __restrict__ dq, int L, int S,
                                               float scale, int causal, int H, int group, RowLayout lq,
                                               RowLayout lk, RowLayout lv, RowLayout ldo, RowLayout lo,
                                               RowLayout ldq) {
    constexpr int BM = WARPS * 16, TH = WARPS * 32, ST = D + 4, NT = BN / 8, DT = D / 8;
    extern __shared__ __align__(16) float tc_smem[];
    float* sQ = tc_smem;
    float* sdO = sQ + BM * ST;
    float* sK = sdO + BM * ST;
    float* sV = sK + BN * ST;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    const int bh = blockIdx.y, batch = bh / H, head = bh - batch * H;
    const int q0 = (causal ? gridDim.x - 1 - blockIdx.x : blockIdx.x) * BM;
    const int qw = q0 + warp * 16;
    const long long rowbase = (long long)bh * L;  // lse and Delta
    const float* kb = head_rows(k, lk, batch, head / group);
    const float* vb = head_rows(v, lv, batch, head / group);
    const float* ob = head_rows(out, lo, batch, head);
    const float sl2 = scale * ATTN_LOG2E;

    load_rows_async<D, BM, TH>(sQ, head_rows(q, lq, batch, head), lq.row, q0, L);
    load_rows_async<D, BM, TH>(sdO, head_rows(dout, ldo, batch, head), ldo.row, q0, L);
    load_rows_async<D, BN, TH>(sV, vb, lv.row, 0, S);
    cp_async_commit();
    load_rows_async<D, BN, TH>(sK, kb, lk.row, 0, S);
    cp_async_commit();
    float lse2[2];
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        const int row = qw + g + 8 * h;
        lse2[h] = row < L ? lse[rowbase + row] * ATTN_LOG2E : 0.f;
    }
    cp_async_wait<1>();
    __syncthreads();

    // Delta = rowsum(dO * out) for this warp's 16 rows, one row per pass of the warp; saved for dk/dv.
    float dl[2] = {0.f, 0.f};
    for (int r = 0; r < 16; ++r) {
        const int row = qw + r;
        float acc = 0.f;
        if (row < L) {
            const float* orow = ob + row * lo.row;
#pragma unroll
            for (int c = lane * 2; c < D; c += 64) {
                const float2 ov = *reinterpret_cast<const float2*>(orow + c);
                acc += ov.x * sdO[(warp * 16 + r) * ST + c] + ov.y * sdO[(warp * 16 + r) * ST + c + 1];
            }
        }
#pragma unroll
        for (int w = 16; w > 0; w >>= 1) acc += __shfl_xor_sync(0xffffffffu, acc, w);
        if (r == g) dl[0] = acc;
        if (r == g + 8) dl[1] = acc;
        if (lane == 0 && row < L) delta[rowbase + row] = acc;
    }

    float a[DT][4];
#pragma unroll
    for (int n = 0; n < DT; ++n) zero(a[n]);
    const int kend = causal ? min(S, q0 + BM) : S;
    for (int k0 = 0; k0 < kend; k0 += BN) {
        const bool more = k0 + BN < kend;
        const int nhi = causal_blocks<NT>(causal, qw + 15, k0);
        cp_async_wait<1>();  // this V tile
        __syncthreads();
        float dp[NT][4], s[NT][4];
#pragma unroll
        for (int n = 0; n < NT; ++n) {
            zero(dp[n]);
            zero(s[n]);
        }
        warp_mma_abt<NT, DT, ST>(dp, sdO + warp * 16 * ST, sV, 0, nhi, g, t);
        __syncthreads();
        if (more) load_rows_async<D, BN, TH>(sV, vb, lv.row, k0 + BN, S);
        cp_async_commit();

        cp_async_wait<1>();  // this K tile
        __syncthreads();
        warp_mma_abt<NT, DT, ST>(s, sQ + warp * 16 * ST, sK, 0, nhi, g, t);
        const bool edge = k0 + BN > S || (causal && k0 + BN - 1 > qw);
#pragma unroll
        for (int n = 0; n < NT; ++n) {
#pragma unroll
            for (int i = 0; i < 4; ++i) {
                const int h = i >> 1;
                float p = fast_exp2(s[n][i] * sl2 - lse2[h]);
                if (edge) {
                    const int col = k0 + n * 8 + 2 * t + (i & 1);
                    if (col >= S || (causal && col > qw + g + 8 * h)) p = 0.f;
                }
                s[n][i] = p * (dp[n][i] - dl[h]);  // dS
            }
        }
        warp_mma_pb<NT, DT, CH, ST>(a, s, sK, 0, nhi, g, t);
        __syncthreads();
        if (more) load_rows_async<D, BN, TH>(sK, kb, lk.row, k0 + BN, S);
        cp_async_commit();
    }
    cp_async_wait<0>();

    float* dqb = head_rows(dq, ldq, batch, head);
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        const int row = qw + g + 8 * h;
        if (row < L) {
            float* r = dqb + row * ldq.row + 2 * t;
#pragma unroll
            for (int n = 0; n < DT; ++n) {
                *reinterpret_cast<float2*>(r + n * 8) = make_float2(a[n][2 * h] * scale, a[n][2 * h + 1] * scale);
            }
        }
    }
}

// WARPS x 16 keys per block, BQ queries per step.
template <int D, int WARPS, int BQ, int CH>
__device__ __forceinline__ void attn_bwd_dkv_tc(const float* __restrict__ q, const float* __restrict__ k,
                                                const float* __restrict__ v, const float* __restrict__ dout,
                                                const float* __restrict__ lse, const float* __restrict__ delta,
                                                float* __restrict__ dk, float* __restrict__ dv, int L, int S,
                                                float scale, int causal, int H, int group, RowLayout lq,
                                                RowLayout lk, RowLayout lv, RowLayout ldo, RowLayout ldk,
                                                RowLayout ldv) {
    constexpr int BN = WARPS * 16, TH = WARPS * 32, ST = D + 4, NQ = BQ / 8, DT = D / 8;
    extern __shared__ __align__(16) float tc_smem[];
    float* sK = tc_smem;
    float* sV = sK + BN * ST;
    float* sQ = sV + BN * ST;
    float* sdO = sQ + BQ * ST;
    float* sL = sdO + BQ * ST;  // lse of the tile's queries
    float* sD = sL + BQ;        // Delta of the tile's queries
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    const int kv_heads = H / group;
    const int bkv = blockIdx.y, k0 = blockIdx.x * BN, batch = bkv / kv_heads, kv_head = bkv - batch * kv_heads;
    const int kw = k0 + warp * 16;  // this warp's first key
    const float sl2 = scale * ATTN_LOG2E;
    const int qstart = causal ? (k0 / BQ) * BQ : 0;  // earlier queries see none of these keys
    const int n_tiles = qstart < L ? (L - qstart + BQ - 1) / BQ : 0;  // per query head
    // Step i: query tile i % n_tiles of query head kv_head * group + i / n_tiles (the group's heads in turn).
    const int n_steps = n_tiles * group;
    const int head0 = kv_head * group;
    const long long rowbase0 = ((long long)batch * H + head0) * L;  // lse and Delta of step 0's head

    load_rows_async<D, BN, TH>(sK, head_rows(k, lk, batch, kv_head), lk.row, k0, S);
    load_rows_async<D, BN, TH>(sV, head_rows(v, lv, batch, kv_head), lv.row, k0, S);
    load_rows_async<D, BQ, TH>(sdO, head_rows(dout, ldo, batch, head0), ldo.row, qstart, L);
    load_vec_async<BQ>(sL, lse + rowbase0, qstart, L);
    load_vec_async<BQ>(sD, delta + rowbase0, qstart, L);
    cp_async_commit();
    load_rows_async<D, BQ, TH>(sQ, head_rows(q, lq, batch, head0), lq.row, qstart, L);
    cp_async_commit();

    float ak[DT][4], av[DT][4];
#pragma unroll
    for (int n = 0; n < DT; ++n) {
        zero(ak[n]);
        zero(av[n]);
    }
    for (int i = 0; i < n_steps; ++i) {
        const int q0 = qstart + (i % n_tiles) * BQ;
        const bool more = i + 1 < n_steps;
        // the next step's query head and tile, loaded into the stages this step releases
        const int next_head = head0 + (i + 1) / n_tiles, next_q0 = qstart + ((i + 1) % n_tiles) * BQ;
        const long long next_rows = ((long long)batch * H + next_head) * L;
        // Query blocks entirely before this warp's first key see none of its keys (kw - q0 is a
        // multiple of 8).
        const int nlo = causal ? min(NQ, max(0, (kw - q0) / 8)) : 0;
        cp_async_wait<1>();  // dO, lse and Delta of this tile (and K, V)
        __syncthreads();
        float dpt[NQ][4], st[NQ][4];
#pragma unroll
        for (int n = 0; n < NQ; ++n) {
            zero(dpt[n]);
            zero(st[n]);
        }
        warp_mma_abt<NQ, DT, ST>(dpt, sV + warp * 16 * ST, sdO, nlo, NQ, g, t);
        cp_async_wait<0>();  // Q of this tile
        __syncthreads();
        warp_mma_abt<NQ, DT, ST>(st, sK + warp * 16 * ST, sQ, nlo, NQ, g, t);
        const bool edge = k0 + BN > S || q0 + BQ > L || (causal && kw + 15 > q0);
#pragma unroll
        for (int n = 0; n < NQ; ++n) {
#pragma unroll
            for (int i = 0; i < 4; ++i) {
                const int c = n * 8 + 2 * t + (i & 1);
                float p = fast_exp2(st[n][i] * sl2 - sL[c] * ATTN_LOG2E);
                if (edge) {
                    const int key = kw + g + 8 * (i >> 1), qr = q0 + c;
                    if (key >= S || qr >= L || (causal && key > qr)) p = 0.f;
                }
                st[n][i] = p;                         // P^T
                dpt[n][i] = p * (dpt[n][i] - sD[c]);  // dS^T
            }
        }
        warp_mma_pb<NQ, DT, CH, ST>(av, st, sdO, nlo, NQ, g, t);
        __syncthreads();  // every warp is done with sdO, sL, sD
        if (more) {
            load_rows_async<D, BQ, TH>(sdO, head_rows(dout, ldo, batch, next_head), ldo.row, next_q0, L);
            load_vec_async<BQ>(sL, lse + next_rows, next_q0, L);
            load_vec_async<BQ>(sD, delta + next_rows, next_q0, L);
        }
        cp_async_commit();
        warp_mma_pb<NQ, DT, CH, ST>(ak, dpt, sQ, nlo, NQ, g, t);
        __syncthreads();  // every warp is done with sQ
        if (more) load_rows_async<D, BQ, TH>(sQ, head_rows(q, lq, batch, next_head), lq.row, next_q0, L);
        cp_async_commit();
    }
    cp_async_wait<0>();

    float* dkb = head_rows(dk, ldk, batch, kv_head);
    float* dvb = head_rows(dv, ldv, batch, kv_head);
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        const int key = kw + g + 8 * h;
        if (key < S) {
            float* rk = dkb + key * ldk.row + 2 * t;
            float* rv = dvb + key * ldv.row + 2 * t;
#pragma unroll
            for (int n = 0; n < DT; ++n) {
                *reinterpret_cast<float2*>(rk + n * 8) = make_float2(ak[n][2 * h] * scale, ak[n][2 * h + 1] * scale);
                *reinterpret_cast<float2*>(rv + n * 8) = make_float2(av[n][2 * h], av[n][2 * h + 1]);
            }
        }
    }
}

// Tile shapes (the host's _ATT_F32_TILES must agree): warps per block, the other side of the tile,
// output blocks per stage, and the blocks per SM that registers are budgeted for. Each tensor's layout
// arrives as three 64-bit scalars (batch, head, row strides), after the scalar arguments.
#define ATTN_TC_FWD(NAME, D, WARPS, BN, CH, MINB)                                                          \
    extern "C" __global__ void __launch_bounds__(WARPS * 32, MINB)                                         \
        NAME(const float* q, const float* k, const float* v, float* out, float* lse, int L, int S, float scale, \
             int causal, int H, int group, LAYOUT_PARAMS(q), LAYOUT_PARAMS(k), LAYOUT_PARAMS(v),             \
             LAYOUT_PARAMS(o)) {                                                                           \
        attn_fwd_tc<D, WARPS, BN, CH>(q, k, v, out, lse, L, S, scale, causal, H, group, LAYOUT(q),          \
                                      LAYOUT(k), LAYOUT(v), LAYOUT(o));                                    \
    }
#define ATTN_TC_DQ(NAME, D, WARPS, BN, CH, MINB)                                                           \
    extern "C" __global__ void __launch_bounds__(WARPS * 32, MINB)                                         \
        NAME(const float* q, const float* k, const float* v, const float* dout, const float* out,          \
             const float* lse, float* delta, float* dq, int L, int S, float scale, int causal, int H,        \
             int group, LAYOUT_PARAMS(q), LAYOUT_PARAMS(k), LAYOUT_PARAMS(v), LAYOUT_PARAMS(dO),            \
             LAYOUT_PARAMS(o), LAYOUT_PARAMS(dq)) {                                                        \
        attn_bwd_dq_tc<D, WARPS, BN, CH>(q, k, v, dout, out, lse, delta, dq, L, S, scale, causal, H, group,  \
                                         LAYOUT(q), LAYOUT(k), LAYOUT(v), LAYOUT(dO), LAYOUT(o), LAYOUT(dq)); \
    }
#define ATTN_TC_DKV(NAME, D, WARPS, BQ, CH, MINB)                                                          \
    extern "C" __global__ void __launch_bounds__(WARPS * 32, MINB)                                         \
        NAME(const float* q, const float* k, const float* v, const float* dout, const float* lse,          \
             const float* delta, float* dk, float* dv, int L, int S, float scale, int causal, int H,         \
             int group, LAYOUT_PARAMS(q), LAYOUT_PARAMS(k), LAYOUT_PARAMS(v), LAYOUT_PARAMS(dO),            \
             LAYOUT_PARAMS(dk), LAYOUT_PARAMS(dv)) {                                                       \
        attn_bwd_dkv_tc<D, WARPS, BQ, CH>(q, k, v, dout, lse, delta, dk, dv, L, S, scale, causal, H, group,  \
                                          LAYOUT(q), LAYOUT(k), LAYOUT(v), LAYOUT(dO), LAYOUT(dk),         \
                                          LAYOUT(dv));                                                     \
    }
ATTN_TC_FWD(attn_fwd_f32_d64, 64, 4, 64, 4, 4)
ATTN_TC_FWD(attn_fwd_f32_d128, 128, 4, 32, 4, 3)
ATTN_TC_DQ(attn_bwd_dq_f32_d64, 64, 4, 32, 4, 4)
ATTN_TC_DQ(attn_bwd_dq_f32_d128, 128, 4, 32, 4, 2)
ATTN_TC_DKV(attn_bwd_dkv_f32_d64, 64, 4, 32, 4, 3)
ATTN_TC_DKV(attn_bwd_dkv_f32_d128, 128, 4, 32, 4, 2)
