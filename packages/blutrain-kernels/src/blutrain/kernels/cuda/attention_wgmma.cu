// Flash attention forward for bfloat16 storage on Hopper's warpgroup tensor cores (wgmma.mma_async,
// sm_90a: bf16 operands, float32 accumulators); head dim D = 64; causal (top-left aligned: query i sees
// keys 0..i) or not; any L and S (tails zero-filled on load and masked). On a compute capability 9.0 GPU
// blutrain.kernels.cuda runs wg2n64p for the bf16 D = 64 forward in place of attn_bf16_fwd_* (attention_bf16.cu),
// with the same contract and the same kernel arguments (the fastest variant at GPT-2's shapes;
// tools/attention_wgmma_check.py checks and times them all, the numbers are in docs/kernels.md): q, out hold
// L rows of D per (batch, head), k, v S rows, each addressed through its own (batch, head, row) strides in
// elements (a row's D elements contiguous, every row 16-byte aligned), blockIdx.y = b * H + h; lse [B*H, L]
// float32, contiguous, the natural-log log-sum-exp of the scaled scores (scale * m + ln l). Grouped-query
// attention: k and v have H / group heads, query head h reads key/value head h / group (group 1: one each).
// Needs -arch=sm_90a (wgmma does not exist on plain sm_90). Dynamic shared memory: BM * 128 + STAGES *
// 2 * BN * 128 + 1024 bytes (the base is rounded up to 1024 inside the kernel), from 50176 (wg2n64) to
// 123904 (wg3n128p): more than 48 KB, so the host raises the function's dynamic limit first.
//
// Work split. grid (ceil(L / BM), B*H), WG warpgroups of 4 warps (128 threads), BM = 64 WG queries: each
// warpgroup owns 64 query rows (warp w of it rows 16w .. 16w + 15, so a row's softmax statistics live in
// the four lanes of one quad, as in attention_bf16.cu). The q tile is loaded once; BN-key K/V tiles stream
// through shared memory with cp.async (16 bytes per thread and request, zero-fill past S), one tile ahead.
// Per tile and warpgroup: S = q k^T as D/16 = 4 wgmma.m64n{BN}k16 (A = q, B = k, both from shared memory),
// online softmax in base 2 on the accumulators (running max m of the raw scores, per-lane partial sums l),
// O = O * alpha + P v as BN/16 wgmma.m64n64k16 with P in registers (A) and v from shared memory (B).
// out = O / l. In causal mode a block stops at its last query, a warpgroup skips the tiles wholly above
// its rows (warpgroup-uniform: wgmma is collective), and a warp masks only tiles that cross its rows or S.
// Causal query tiles are launched longest first. FLOPs 4 BH L S D (about half when causal). Fewest bytes
// 2 BH D (2 L + 2 S) (q, k, v read and out written once, bf16) + 4 BH L (lse); k and v are read by each of
// a head's ceil(L / BM) query tiles, mostly from L2.
//   Simple variants (attn_wgmma_fwd_d64_wg<WG>n<BN>): per tile, S; wait; softmax; P v; wait. Two K/V
//   stages. Other warpgroups and blocks fill the tensor cores while one does its softmax.
//   Pipelined variants (suffix p): per tile j, S_j = q k_j^T and O += P_{j-1} v_{j-1} are issued back to
//   back; the softmax of S_j runs while P_{j-1} v_{j-1} is still on the tensor cores (wait_group 1, then 0
//   before O is rescaled). v_{j-1} stays live one tile longer, so three K/V stages.
//   One tile ahead is enough: prefetching K/V two tiles ahead (four stages), or launching causal tiles
//   heavy-first across all heads, changes the time by a few per cent either way (docs/kernels.md).
//
// Fragments (PTX ISA, "Register Fragments", .m64nNk16; warp w of the warpgroup, lane = 4 g + t):
//   Accumulator D 64 x N float: warp w holds rows 16w .. 16w + 15; d[4i + 0], d[4i + 1] = (row g, columns
//     8i + 2t, 8i + 2t + 1), d[4i + 2], d[4i + 3] = (row g + 8, same columns), i = 0 .. N/8 - 1: the
//     mma.m16n8 C layout tiled along N.
//   A 64 x 16 bf16 in registers: four .b32 of bf16 pairs, warp w rows 16w .. 16w + 15: a0 = (row g, k 2t,
//     2t + 1), a1 = (row g + 8, same k), a2 = (row g, k 2t + 8, 2t + 9), a3 = (row g + 8, k 2t + 8, 2t + 9):
//     the mma.m16n8k16 A layout. So keys 16kk .. 16kk + 15 of S (accumulators 8kk .. 8kk + 7) are, packed
//     in pairs, the A fragment of k-step kk of P v: no shuffle, no shared memory.
//
// Shared memory, descriptors and ordering: wgmma.cuh (128-byte swizzled [rows][64] bf16 tiles, 1024-byte aligned;
// q and k K-major, v MN-major). A K/V stage is refilled only after the barrier that follows every warpgroup's
// wait for the products that read it.
#include "common.cuh"
#include "attention.cuh"
#include "wgmma.cuh"

// Online softmax step on one score tile (this thread's accumulators s[4 nb + c]: row row_g + 8 (c >> 1),
// key k0 + 8 nb + 2 t + (c & 1)): masks if asked, turns s into P = 2^(s scale_log2 - m scale_log2) with the
// updated running max m, adds P's row sums to l (this lane's part), and returns the factor alpha per row
// half by which the old O and l were to be scaled (l already is).
template <int BN>
__device__ __forceinline__ void softmax_step(float (&s)[BN / 2], float (&row_max)[2], float (&row_sum)[2],
                                             float (&alpha)[2], float scale_log2, bool needs_mask, int k0,
                                             int row_g, int S, int causal) {
    constexpr int NB = BN / 8;
    const int lane = threadIdx.x & 31;
    if (needs_mask) {
#pragma unroll
        for (int nb = 0; nb < NB; ++nb) {
#pragma unroll
            for (int c = 0; c < 4; ++c) {
                const int col = k0 + nb * 8 + 2 * (lane & 3) + (c & 1);
                const int row = row_g + 8 * (c >> 1);
                if (col >= S || (causal && col > row)) s[4 * nb + c] = -BT_INF;
            }
        }
    }
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        // Max and sum over four independent chains, not one (attention_bf16.cu: little else to issue
        // meanwhile). Four named partials rather than a tree array, which at NB = 16 went to local memory.
        float m0 = fmaxf(s[2 * h], s[2 * h + 1]), m1 = fmaxf(s[4 + 2 * h], s[5 + 2 * h]);
        float m2 = fmaxf(s[8 + 2 * h], s[9 + 2 * h]), m3 = fmaxf(s[12 + 2 * h], s[13 + 2 * h]);
#pragma unroll
        for (int nb = 4; nb < NB; nb += 4) {
            m0 = fmaxf(m0, fmaxf(s[4 * nb + 2 * h], s[4 * nb + 2 * h + 1]));
            m1 = fmaxf(m1, fmaxf(s[4 * nb + 4 + 2 * h], s[4 * nb + 5 + 2 * h]));
            m2 = fmaxf(m2, fmaxf(s[4 * nb + 8 + 2 * h], s[4 * nb + 9 + 2 * h]));
            m3 = fmaxf(m3, fmaxf(s[4 * nb + 12 + 2 * h], s[4 * nb + 13 + 2 * h]));
        }
        float mx = fmaxf(row_max[h], fmaxf(fmaxf(m0, m1), fmaxf(m2, m3)));
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
        // A row with nothing visible yet keeps max -inf: subtract 0 instead, so that every exponent is -inf
        // and every p is 0 (never inf - inf).
        const float base = mx == -BT_INF ? 0.f : mx * scale_log2;
        alpha[h] = fast_exp2(fmaf(row_max[h], scale_log2, -base));
        row_max[h] = mx;
#pragma unroll
        for (int nb = 0; nb < NB; ++nb) {
            s[4 * nb + 2 * h] = fast_exp2(fmaf(s[4 * nb + 2 * h], scale_log2, -base));
            s[4 * nb + 2 * h + 1] = fast_exp2(fmaf(s[4 * nb + 2 * h + 1], scale_log2, -base));
        }
        float a0 = s[2 * h] + s[2 * h + 1], a1 = s[4 + 2 * h] + s[5 + 2 * h];
        float a2 = s[8 + 2 * h] + s[9 + 2 * h], a3 = s[12 + 2 * h] + s[13 + 2 * h];
#pragma unroll
        for (int nb = 4; nb < NB; nb += 4) {
            a0 += s[4 * nb + 2 * h] + s[4 * nb + 2 * h + 1];
            a1 += s[4 * nb + 4 + 2 * h] + s[4 * nb + 5 + 2 * h];
            a2 += s[4 * nb + 8 + 2 * h] + s[4 * nb + 9 + 2 * h];
            a3 += s[4 * nb + 12 + 2 * h] + s[4 * nb + 13 + 2 * h];
        }
        row_sum[h] = row_sum[h] * alpha[h] + ((a0 + a1) + (a2 + a3));
    }
}

__device__ __forceinline__ void rescale_o(float (&o)[32], const float (&alpha)[2]) {
#pragma unroll
    for (int i = 0; i < 32; ++i) o[i] *= alpha[(i >> 1) & 1];
}

template <int WG, int BN, bool PIPELINED>
__device__ __forceinline__ void attn_wgmma_fwd(const bf16* __restrict__ q, const bf16* __restrict__ k,
                                               const bf16* __restrict__ v, bf16* __restrict__ out,
                                               float* __restrict__ lse, int L, int S, float scale, int causal,
                                               int H, int group, RowLayout lq, RowLayout lk, RowLayout lv,
                                               RowLayout lo) {
    static_assert(BN == 64 || BN == 128, "BN: 64 or 128 keys per tile");
    constexpr int THREADS = 128 * WG;
    constexpr int BM = 64 * WG;
    constexpr int STAGES = PIPELINED ? 3 : 2;
    constexpr unsigned Q_TILE_BYTES = BM * 128, KV_TILE_BYTES = BN * 128;  // multiples of 1024
    extern __shared__ unsigned char smem_raw[];
    const unsigned sQ = (shared_address(smem_raw) + 1023u) & ~1023u;
    const unsigned sK = sQ + Q_TILE_BYTES;  // STAGES tiles each
    const unsigned sV = sK + STAGES * KV_TILE_BYTES;
    const int wg = threadIdx.x >> 7, warp = (threadIdx.x >> 5) & 3, lane = threadIdx.x & 31;
    // Causal query tiles differ in length: launch the longest first so that short ones fill the tail.
    const int bh = blockIdx.y, batch = bh / H, head = bh - batch * H;
    const int q0 = (causal ? gridDim.x - 1 - blockIdx.x : blockIdx.x) * BM;
    const int wg_row0 = q0 + 64 * wg;            // this warpgroup's first query
    const int warp_row0 = wg_row0 + 16 * warp;   // this warp's
    const int row_g = warp_row0 + (lane >> 2);   // this thread's rows: row_g, row_g + 8
    const bf16* kb = head_rows(k, lk, batch, head / group);
    const bf16* vb = head_rows(v, lv, batch, head / group);
    const float scale_log2 = scale * ATTN_LOG2E;
    const int key_end = causal ? min(S, q0 + BM) : S;
    const int n_tiles = (key_end + BN - 1) / BN;  // >= 1: L, S >= 1
    // Tiles this warpgroup multiplies: under causal masking the ones that start at or before its last row.
    const int n_wg = causal ? min(n_tiles, (min(S, wg_row0 + 64) + BN - 1) / BN) : n_tiles;
    const unsigned long long dq = desc_kmajor(sQ + wg * (64 * 128));

    load_tile_async<BM, THREADS>(sQ, head_rows(q, lq, batch, head), lq.row, q0, L);
    load_tile_async<BN, THREADS>(sK, kb, lk.row, 0, S);
    load_tile_async<BN, THREADS>(sV, vb, lv.row, 0, S);
    cp_async_commit();

    float o[32], s[BN / 2];
    unsigned p[BN / 16][4];
    float row_max[2] = {-BT_INF, -BT_INF}, row_sum[2] = {0.f, 0.f};
#pragma unroll
    for (int i = 0; i < 32; ++i) o[i] = 0.f;
#pragma unroll
    for (int i = 0; i < BN / 2; ++i) s[i] = 0.f;
#pragma unroll
    for (int i = 0; i < BN / 16; ++i) {
#pragma unroll
        for (int c = 0; c < 4; ++c) p[i][c] = 0u;
    }

    // Tile j (the only cp.async group in flight) has landed: publish it to the async proxy, then to the block
    // (the barrier also means every warpgroup has finished the products of step j - 1); then start loading
    // tile j + 1 into the stage of tile j + 1 - STAGES, which that barrier released.
    auto sync_and_prefetch = [&](int j) {
        cp_async_wait<0>();
        fence_proxy_async_shared();
        __syncthreads();
        if (j + 1 < n_tiles) {
            const unsigned st = ((j + 1) % STAGES) * KV_TILE_BYTES;
            load_tile_async<BN, THREADS>(sK + st, kb, lk.row, (j + 1) * BN, S);
            load_tile_async<BN, THREADS>(sV + st, vb, lv.row, (j + 1) * BN, S);
            cp_async_commit();
        }
    };
    float alpha[2];
    if constexpr (!PIPELINED) {
        for (int j = 0; j < n_tiles; ++j) {
            sync_and_prefetch(j);
            if (j < n_wg) {
                const int k0 = j * BN;
                const unsigned cur = (j % STAGES) * KV_TILE_BYTES;
                const bool needs_mask = k0 + BN > S || (causal && k0 + BN - 1 > warp_row0);
                fence_registers(s);
                wgmma_fence();
                issue_abt(s, dq, desc_kmajor(sK + cur));
                wgmma_commit();
                wgmma_wait<0>();
                fence_registers(s);
                softmax_step<BN>(s, row_max, row_sum, alpha, scale_log2, needs_mask, k0, row_g, S, causal);
                rescale_o(o, alpha);
                pack_a(p, s);
                fence_registers(o);
                fence_registers(p);
                wgmma_fence();
                issue_rb(o, p, desc_mnmajor(sV + cur));
                wgmma_commit();
                wgmma_wait<0>();
                fence_registers(o);
                fence_registers(p);
            }
        }
    } else {
        // Step 0 (every warpgroup has tile 0): S_0 and its softmax; O is still 0.
        sync_and_prefetch(0);
        fence_registers(s);
        wgmma_fence();
        issue_abt(s, dq, desc_kmajor(sK));
        wgmma_commit();
        wgmma_wait<0>();
        fence_registers(s);
        softmax_step<BN>(s, row_max, row_sum, alpha, scale_log2, BN > S || (causal && BN - 1 > warp_row0), 0, row_g,
                         S, causal);
        pack_a(p, s);
        // Step j: S_j and O += P_{j-1} v_{j-1} (the stage of tile j - 1) back to back, unconditionally (a
        // product under a branch made ptxas serialize every wgmma); the softmax of S_j runs while the second
        // product is still on the tensor cores.
        for (int j = 1; j < n_tiles; ++j) {
            sync_and_prefetch(j);
            if (j < n_wg) {
                const int k0 = j * BN;
                const unsigned cur = (j % STAGES) * KV_TILE_BYTES;
                const unsigned prev = ((j - 1) % STAGES) * KV_TILE_BYTES;
                const bool needs_mask = k0 + BN > S || (causal && k0 + BN - 1 > warp_row0);
                fence_registers(s);
                fence_registers(o);
                fence_registers(p);
                wgmma_fence();
                issue_abt(s, dq, desc_kmajor(sK + cur));
                wgmma_commit();
                issue_rb(o, p, desc_mnmajor(sV + prev));
                wgmma_commit();
                wgmma_wait<1>();  // S_j done; P_{j-1} v_{j-1} may still run
                fence_registers(s);
                softmax_step<BN>(s, row_max, row_sum, alpha, scale_log2, needs_mask, k0, row_g, S, causal);
                wgmma_wait<0>();  // O and P_{j-1} are free again
                fence_registers(o);
                fence_registers(p);
                rescale_o(o, alpha);
                pack_a(p, s);
            }
        }
    }
    if constexpr (PIPELINED) {
        // This warpgroup's last P v (tile n_wg - 1). Its stage is intact: at most STAGES - 1 tiles were loaded
        // after it (the tiles a causal warpgroup skips, at most ceil((BM - 64) / BN)).
        // (A load overwrites the stage of the tile STAGES before it.)
        static_assert((BM - 64 + BN - 1) / BN < STAGES, "a skipped tile would overwrite the last one used");
        fence_registers(o);
        fence_registers(p);
        wgmma_fence();
        issue_rb(o, p, desc_mnmajor(sV + ((n_wg - 1) % STAGES) * KV_TILE_BYTES));
        wgmma_commit();
        wgmma_wait<0>();
        fence_registers(o);
    }

    bf16* ob = head_rows(out, lo, batch, head);
    float* lb = lse + (long long)bh * L;
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        float total = row_sum[h];
        total += __shfl_xor_sync(0xffffffffu, total, 1);
        total += __shfl_xor_sync(0xffffffffu, total, 2);
        const float inv = total > 0.f ? 1.f / total : 0.f;
        const int row = row_g + 8 * h;
        if (row < L) {
            if ((lane & 3) == 0) lb[row] = total > 0.f ? row_max[h] * scale + logf(total) : -BT_INF;
            unsigned* dst = reinterpret_cast<unsigned*>(ob + row * lo.row + 2 * (lane & 3));
#pragma unroll
            for (int db = 0; db < 8; ++db) dst[4 * db] = cvt_bf16x2(o[4 * db + 2 * h] * inv, o[4 * db + 2 * h + 1] * inv);
        }
    }
}

// ---------------------------------------------------------------------------------------------- entry points
// attn_wgmma_fwd_d64_wg<WG>n<BN>[p]: WG warpgroups (BM = 64 WG queries), BN keys per tile, p = pipelined.
// MIN_BLOCKS is the blocks per multiprocessor that __launch_bounds__ asks the register allocator for.
#define ATTN_WGMMA_FWD(NAME, WG, BN, PIPELINED, MIN_BLOCKS)                                                \
    extern "C" __global__ void __launch_bounds__(128 * WG, MIN_BLOCKS) attn_wgmma_fwd_d64_##NAME(          \
        const bf16* q, const bf16* k, const bf16* v, bf16* out, float* lse, int L, int S, float scale,      \
        int causal, int H, int group, LAYOUT_PARAMS(q), LAYOUT_PARAMS(k), LAYOUT_PARAMS(v),                 \
        LAYOUT_PARAMS(o)) {                                                                                \
        attn_wgmma_fwd<WG, BN, PIPELINED>(q, k, v, out, lse, L, S, scale, causal, H, group, LAYOUT(q),      \
                                          LAYOUT(k), LAYOUT(v), LAYOUT(o));                                \
    }

ATTN_WGMMA_FWD(wg2n64, 2, 64, false, 2)
ATTN_WGMMA_FWD(wg2n128, 2, 128, false, 1)
ATTN_WGMMA_FWD(wg3n64, 3, 64, false, 1)
ATTN_WGMMA_FWD(wg3n128, 3, 128, false, 1)
ATTN_WGMMA_FWD(wg2n64p, 2, 64, true, 2)
ATTN_WGMMA_FWD(wg2n128p, 2, 128, true, 1)
ATTN_WGMMA_FWD(wg3n64p, 3, 64, true, 1)
ATTN_WGMMA_FWD(wg3n128p, 3, 128, true, 1)
