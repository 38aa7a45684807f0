// Flash attention backward for bfloat16 storage on Hopper's warpgroup tensor cores (wgmma.mma_async, sm_90a:
// bf16 operands, float32 accumulators); head dim D = 64; causal (top-left aligned: query i sees keys 0..i) or
// not; any L and S (tails zero-filled on load and masked). The counterpart of attention_wgmma.cu's forward and
// a drop-in for attention_bf16.cu's attn_bf16_bwd_dq_d64_* / attn_bf16_bwd_dkv_d64_*: same kernel arguments,
// same outputs, same layouts (each tensor addressed through its own (batch, head, row) strides in elements, a
// row's D elements contiguous, every row 16-byte aligned; blockIdx.y = b * H + h), same launch order (dq first:
// it writes Delta = rowsum(dO * out) and lse2 = lse * log2(e), float32 [B*H, L], that dk/dv reads).
// Grouped-query attention: k, v, dk and dv have H / group heads, query head h reads key/value head h / group
// (group 1: one each); the dk/dv kernel's blocks are per key/value head (blockIdx.y = b * H / group + h_kv)
// and step through the query tiles of the group's query heads one head after another, summing in registers.
// blutrain.kernels.cuda runs the wg1 kernels on compute capability 9.0: dq, dk, dv agree with attention_bf16.cu's
// to 2e-5, and wg1 is the fastest variant at GPT-2's shapes (tools/attention_wgmma_bwd_check.py checks and times
// them; the numbers are in docs/kernels.md).
// Needs -arch=sm_90a. The PTX wrappers and descriptor helpers are the forward's (attention.cuh, wgmma.cuh).
//
//   attn_wgmma_bwd_dq_d64_wg<WG>: grid (ceil(L / BM), B*H), WG warpgroups (128 WG threads), BM = 64 WG
//     queries, warpgroup w owns queries 64w .. 64w + 63 of the tile. Delta and lse2 of the block's rows first
//     (two threads per row, straight from global memory). q and dO tiles are loaded once; 64-key K/V tiles
//     stream through two cp.async stages, one tile ahead. Per key tile and warpgroup: S = q k^T and
//     dP = dO v^T (4 + 4 wgmma.m64n64k16, all operands K-major in shared memory), P = 2^(S scale log2e -
//     lse2), dS = P (dP - Delta) on the accumulators, dq += dS k (4 wgmma.m64n64k16, dS from registers, k as
//     an MN-major B). dq is stored scaled by `scale`. Dynamic shared memory 2 BM 128 + 4 * 64 * 128 + 8 BM +
//     1024 bytes (wg2: 67584, wg1: 50688).
//   attn_wgmma_bwd_dkv_d64_wg<WG>: grid (ceil(S / BN), B*H / group), BN = 64 WG keys, warpgroup w owns keys 64w ..
//     64w + 63. k and v tiles loaded once; 64-query q/dO tiles (with their lse2 and Delta) stream through two
//     cp.async stages. Per query tile and warpgroup: S^T = k q^T (A = k, B = q) and dP^T = v dO^T (A = v,
//     B = dO), all K-major; P^T, dS^T as above; dv += P^T dO and dk += dS^T q (A from registers, B = dO and q
//     MN-major). dk stored scaled by `scale`. Dynamic shared memory 2 BN 128 + 4 * 64 * 128 + 1024 + 1024 bytes
//     (wg2: 67584, wg1: 51200).
//   wg1 issues each tile's products in order, with no software pipelining: two blocks per SM already hide the
//     softmax, so overlapping tile j - 1's product with tile j's softmax, deeper prefetch, heavy-first causal
//     tiles across heads or 3 blocks per SM do not pay at GPT-2's shapes (docs/kernels.md).
// In causal mode the dq kernel stops at its last query and a warpgroup skips the key tiles wholly above its
// rows; the dk/dv kernel starts at the query tile of its first key and a warpgroup skips query tiles wholly
// before its keys (warpgroup-uniform branches: wgmma is collective); only tiles that cross the diagonal or a
// tail are masked. Causal dq tiles are launched longest first (dk/dv's already are). FLOPs 14 BH L S D (7
// products of L x S x D; about half when causal). Fewest bytes: q, k, v, out, dO read and dq, dk, dv written
// once (bf16, 16 BH D (L + S) in all, roughly) plus lse, lse2, Delta; each kernel re-reads the streamed side
// once per tile of the other side, mostly from L2.
//
// Fragments (PTX ISA "Register Fragments", .m64nNk16; warp w of the warpgroup, lane = 4 g + t): accumulator
// d[4i + 0..1] = (row 16w + g, columns 8i + 2t, +1), d[4i + 2..3] = (row 16w + g + 8, same columns). A 64 x 16
// bf16 from registers: a0 = (row g, k 2t..2t+1), a1 = (row g + 8, same), a2 = (row g, k 2t+8..2t+9), a3 =
// (row g + 8, same): accumulators 8kk .. 8kk + 7 packed in pairs are the A fragment of k-step kk. So P^T and
// dS^T (keys x queries) are the A operands of P^T dO and dS^T q, and dS (queries x keys) that of dS k, with
// no data movement.
//
// Shared memory and descriptors (wgmma.cuh). Every tile is [rows][64] bf16 (128-byte rows), chunk c
// of row r at chunk c ^ (r % 8), tile bases 1024-byte aligned: the 128-byte swizzle mode. A tile whose rows are
// the M or N side of a product and whose d is the reduction (q, k in S = q k^T; dO, v in dP = dO v^T; k, q in
// S^T; v, dO in dP^T) is K-major: SBO 1024, LBO 16 (unused), k-step ks (16 of d) = +32 bytes of start address.
// A tile whose rows are the reduction and d the N side (k in dS k; dO in P^T dO; q in dS^T q) is MN-major with
// the transpose-B immediate: SBO = LBO = 1024, k-step kk (16 rows) = +2048 bytes.
// Ordering: cp.async -> wait_group 0 -> fence.proxy.async (each writing thread) -> block barrier before any
// wgmma reads a tile; a stage is refilled only after the barrier that follows every warpgroup's wait for the
// products that read it. wgmma.fence before each batch, commit/wait before accumulators are read, empty asm
// statements pin the registers to those points.
#include "common.cuh"
#include "attention.cuh"
#include "wgmma.cuh"

// Accumulator rows row_g, row_g + 8 (64 d columns) -> bf16 rows of dst, times `mul`; rows at or past n skipped.
__device__ __forceinline__ void store_acc_rows(bf16* dst, long long rs, const float (&acc)[32], int row_g, int n,
                                               float mul) {
    const int lane = threadIdx.x & 31;
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        const int row = row_g + 8 * h;
        if (row < n) {
            unsigned* p = reinterpret_cast<unsigned*>(dst + row * rs + 2 * (lane & 3));
#pragma unroll
            for (int db = 0; db < 8; ++db) p[4 * db] = cvt_bf16x2(acc[4 * db + 2 * h] * mul, acc[4 * db + 2 * h + 1] * mul);
        }
    }
}

__device__ __forceinline__ float dot_bf16x8(uint4 a, uint4 b) {
    const unsigned aw[4] = {a.x, a.y, a.z, a.w}, bw[4] = {b.x, b.y, b.z, b.w};
    float acc = 0.f;
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        acc = fmaf(__uint_as_float(aw[i] << 16), __uint_as_float(bw[i] << 16), acc);
        acc = fmaf(__uint_as_float(aw[i] & 0xFFFF0000u), __uint_as_float(bw[i] & 0xFFFF0000u), acc);
    }
    return acc;
}

// ---------------------------------------------------------------------------------------------- dq

template <int WG>
__device__ __forceinline__ void attn_wgmma_bwd_dq(const bf16* __restrict__ q, const bf16* __restrict__ k,
                                                  const bf16* __restrict__ v, const bf16* __restrict__ out,
                                                  const bf16* __restrict__ dout, const float* __restrict__ lse,
                                                  float* __restrict__ lse2, float* __restrict__ delta,
                                                  bf16* __restrict__ dq, int L, int S, float scale, int causal, int H,
                                                  int group, RowLayout lq, RowLayout lk, RowLayout lv, RowLayout lo,
                                                  RowLayout ldo, RowLayout ldq) {
    constexpr int THREADS = 128 * WG;
    constexpr int BM = 64 * WG;
    constexpr int BN = 64;
    constexpr int STAGES = 2;
    constexpr unsigned Q_TILE_BYTES = BM * 128, KV_TILE_BYTES = BN * 128;
    extern __shared__ unsigned char smem_raw[];
    const unsigned sQ = (shared_address(smem_raw) + 1023u) & ~1023u;
    const unsigned sdO = sQ + Q_TILE_BYTES;
    const unsigned sK = sdO + Q_TILE_BYTES;  // STAGES tiles each
    const unsigned sV = sK + STAGES * KV_TILE_BYTES;
    float* sLse2 = reinterpret_cast<float*>(smem_raw + (sV + STAGES * KV_TILE_BYTES - shared_address(smem_raw)));
    float* sDelta = sLse2 + BM;
    const int wg = threadIdx.x >> 7, warp = (threadIdx.x >> 5) & 3, lane = threadIdx.x & 31;
    const int bh = blockIdx.y, batch = bh / H, head = bh - batch * H;
    const int q0 = (causal ? gridDim.x - 1 - blockIdx.x : blockIdx.x) * BM;
    const int wg_row0 = q0 + 64 * wg;
    const int warp_row0 = wg_row0 + 16 * warp;
    const int row_g = warp_row0 + (lane >> 2);
    const bf16* kb = head_rows(k, lk, batch, head / group);
    const bf16* vb = head_rows(v, lv, batch, head / group);
    const float scale_log2 = scale * ATTN_LOG2E;
    const int key_end = causal ? min(S, q0 + BM) : S;
    const int n_tiles = (key_end + BN - 1) / BN;
    const int n_wg = causal ? min(n_tiles, (min(S, wg_row0 + 64) + BN - 1) / BN) : n_tiles;

    load_tile_async<BM, THREADS>(sQ, head_rows(q, lq, batch, head), lq.row, q0, L);
    load_tile_async<BM, THREADS>(sdO, head_rows(dout, ldo, batch, head), ldo.row, q0, L);
    load_tile_async<BN, THREADS>(sK, kb, lk.row, 0, S);
    load_tile_async<BN, THREADS>(sV, vb, lv.row, 0, S);
    cp_async_commit();

    // Delta and lse2 of the block's rows while the tiles load: two threads per row, 32 d each, from global
    // memory (out is needed for nothing else). Rows past L get 0 (their q and dO are zero: dS = 0).
    {
        const int r = threadIdx.x >> 1, half = threadIdx.x & 1;
        const int row = q0 + r;
        float acc = 0.f, l2 = 0.f;
        if (row < L) {
            const uint4* po = reinterpret_cast<const uint4*>(head_rows(out, lo, batch, head) + row * lo.row + 32 * half);
            const uint4* pd = reinterpret_cast<const uint4*>(head_rows(dout, ldo, batch, head) + row * ldo.row + 32 * half);
            uint4 ov[4], dv[4];
#pragma unroll
            for (int i = 0; i < 4; ++i) {
                ov[i] = po[i];
                dv[i] = pd[i];
            }
#pragma unroll
            for (int i = 0; i < 4; ++i) acc += dot_bf16x8(ov[i], dv[i]);
            l2 = lse[(long long)bh * L + row] * ATTN_LOG2E;
        }
        acc += __shfl_xor_sync(0xffffffffu, acc, 1);
        if (half == 0) {
            sDelta[r] = acc;
            sLse2[r] = l2;
            if (row < L) {
                delta[(long long)bh * L + row] = acc;
                lse2[(long long)bh * L + row] = l2;
            }
        }
    }

    const unsigned long long dq_desc = desc_kmajor(sQ + wg * (64 * 128));
    const unsigned long long ddo_desc = desc_kmajor(sdO + wg * (64 * 128));
    float s[32], dp[32], acc[32];
    unsigned ds[4][4];
#pragma unroll
    for (int i = 0; i < 32; ++i) {
        s[i] = 0.f;
        dp[i] = 0.f;
        acc[i] = 0.f;
    }
#pragma unroll
    for (int i = 0; i < 4; ++i) {
#pragma unroll
        for (int c = 0; c < 4; ++c) ds[i][c] = 0u;
    }
    float row_lse2[2] = {0.f, 0.f}, row_delta[2] = {0.f, 0.f};

    for (int j = 0; j < n_tiles; ++j) {
        // Tile j (the only cp.async group in flight) has landed: publish it to the async proxy and the block;
        // the barrier also ends every warpgroup's products of tile j - 1, releasing stage (j + 1) % 2.
        cp_async_wait<0>();
        fence_proxy_async_shared();
        __syncthreads();
        if (j == 0) {
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                row_lse2[h] = sLse2[row_g + 8 * h - q0];
                row_delta[h] = sDelta[row_g + 8 * h - q0];
            }
        }
        if (j + 1 < n_tiles) {
            const unsigned st = ((j + 1) % STAGES) * KV_TILE_BYTES;
            load_tile_async<BN, THREADS>(sK + st, kb, lk.row, (j + 1) * BN, S);
            load_tile_async<BN, THREADS>(sV + st, vb, lv.row, (j + 1) * BN, S);
            cp_async_commit();
        }
        if (j < n_wg) {
            const int k0 = j * BN;
            const unsigned cur = (j % STAGES) * KV_TILE_BYTES;
            const bool needs_mask = k0 + BN > S || (causal && k0 + BN - 1 > warp_row0);
            fence_registers(s);
            fence_registers(dp);
            wgmma_fence();
            issue_abt(s, dq_desc, desc_kmajor(sK + cur));
            issue_abt(dp, ddo_desc, desc_kmajor(sV + cur));
            wgmma_commit();
            wgmma_wait<0>();
            fence_registers(s);
            fence_registers(dp);
#pragma unroll
            for (int nb = 0; nb < 8; ++nb) {
#pragma unroll
                for (int c = 0; c < 4; ++c) {
                    const int h = c >> 1;
                    float p = fast_exp2(fmaf(s[4 * nb + c], scale_log2, -row_lse2[h]));
                    if (needs_mask) {
                        const int col = k0 + nb * 8 + 2 * (lane & 3) + (c & 1);
                        if (col >= S || (causal && col > row_g + 8 * h)) p = 0.f;
                    }
                    dp[4 * nb + c] = p * (dp[4 * nb + c] - row_delta[h]);
                }
            }
            pack_a(ds, dp);
            fence_registers(acc);
            fence_registers(ds);
            wgmma_fence();
            issue_rb(acc, ds, desc_mnmajor(sK + cur));
            wgmma_commit();
            wgmma_wait<0>();
            fence_registers(acc);
            fence_registers(ds);
        }
    }
    store_acc_rows(head_rows(dq, ldq, batch, head), ldq.row, acc, row_g, L, scale);
}

// ---------------------------------------------------------------------------------------------- dk, dv

template <int WG>
__device__ __forceinline__ void attn_wgmma_bwd_dkv(const bf16* __restrict__ q, const bf16* __restrict__ k,
                                                   const bf16* __restrict__ v, const bf16* __restrict__ dout,
                                                   const float* __restrict__ lse2, const float* __restrict__ delta,
                                                   bf16* __restrict__ dk, bf16* __restrict__ dv, int L, int S,
                                                   float scale, int causal, int H, int group, RowLayout lq,
                                                   RowLayout lk, RowLayout lv, RowLayout ldo, RowLayout ldk,
                                                   RowLayout ldv) {
    constexpr int THREADS = 128 * WG;
    constexpr int BN = 64 * WG;  // keys per block
    constexpr int BM = 64;       // queries per step
    constexpr int STAGES = 2;
    constexpr unsigned K_TILE_BYTES = BN * 128, Q_TILE_BYTES = BM * 128;
    extern __shared__ unsigned char smem_raw[];
    const unsigned sK = (shared_address(smem_raw) + 1023u) & ~1023u;
    const unsigned sV = sK + K_TILE_BYTES;
    const unsigned sQ = sV + K_TILE_BYTES;  // STAGES tiles each
    const unsigned sdO = sQ + STAGES * Q_TILE_BYTES;
    const unsigned sRows = sdO + STAGES * Q_TILE_BYTES;  // lse2 [STAGES][BM], then Delta [STAGES][BM]
    const float* sLse2 = reinterpret_cast<const float*>(smem_raw + (sRows - shared_address(smem_raw)));
    const float* sDelta = sLse2 + STAGES * BM;
    const int wg = threadIdx.x >> 7, warp = (threadIdx.x >> 5) & 3, lane = threadIdx.x & 31;
    const int kv_heads = H / group;
    const int bkv = blockIdx.y, batch = bkv / kv_heads, kv_head = bkv - batch * kv_heads;
    const int k0 = blockIdx.x * BN;
    const int wg_key0 = k0 + 64 * wg;
    const int warp_key0 = wg_key0 + 16 * warp;
    const int key_g = warp_key0 + (lane >> 2);  // this thread's keys: key_g, key_g + 8
    const float scale_log2 = scale * ATTN_LOG2E;
    // Causal: queries before k0 see none of these keys (k0 is a multiple of BM).
    const int q_begin = causal ? k0 : 0;
    const int n_tiles = q_begin < L ? (L - q_begin + BM - 1) / BM : 0;  // per query head
    // Step i: query tile i % n_tiles of query head kv_head * group + i / n_tiles (the group's heads in turn).
    const int n_steps = n_tiles * group;

    auto load_query_tile = [&](int stage, int step) {
        const GroupStep at = group_step(step, n_tiles, q_begin, BM, batch, kv_head, group, H, L);
        const int q0 = at.q0;
        const bf16* qb = head_rows(q, lq, batch, at.head);
        const bf16* ob = head_rows(dout, ldo, batch, at.head);
        const float* lb = lse2 + at.rows;
        const float* db_ = delta + at.rows;
        load_tile_async<BM, THREADS>(sQ + stage * Q_TILE_BYTES, qb, lq.row, q0, L);
        load_tile_async<BM, THREADS>(sdO + stage * Q_TILE_BYTES, ob, ldo.row, q0, L);
        if (threadIdx.x < BM) {
            const int row = q0 + threadIdx.x;
            const bool valid = row < L;
            cp_async_4(sRows + 4 * (stage * BM + threadIdx.x), lb + (valid ? row : 0), valid);
            cp_async_4(sRows + 4 * ((STAGES + stage) * BM + threadIdx.x), db_ + (valid ? row : 0), valid);
        }
    };
    load_tile_async<BN, THREADS>(sK, head_rows(k, lk, batch, kv_head), lk.row, k0, S);
    load_tile_async<BN, THREADS>(sV, head_rows(v, lv, batch, kv_head), lv.row, k0, S);
    if (n_steps > 0) load_query_tile(0, 0);
    cp_async_commit();

    const unsigned long long dk_desc = desc_kmajor(sK + wg * (64 * 128));
    const unsigned long long dv_desc = desc_kmajor(sV + wg * (64 * 128));
    float st[32], dpt[32], dk_acc[32], dv_acc[32];
    unsigned pf[4][4], dsf[4][4];
#pragma unroll
    for (int i = 0; i < 32; ++i) {
        st[i] = 0.f;
        dpt[i] = 0.f;
        dk_acc[i] = 0.f;
        dv_acc[i] = 0.f;
    }
#pragma unroll
    for (int i = 0; i < 4; ++i) {
#pragma unroll
        for (int c = 0; c < 4; ++c) {
            pf[i][c] = 0u;
            dsf[i][c] = 0u;
        }
    }

    for (int i = 0; i < n_steps; ++i) {
        const int q0 = q_begin + (i % n_tiles) * BM;
        const int stage = i % STAGES;
        cp_async_wait<0>();
        fence_proxy_async_shared();
        __syncthreads();
        if (i + 1 < n_steps) {
            load_query_tile((i + 1) % STAGES, i + 1);
            cp_async_commit();
        }
        // Causal: a query tile wholly before this warpgroup's first key contributes nothing.
        if (!(causal && q0 + BM - 1 < wg_key0)) {
            const unsigned tQ = sQ + stage * Q_TILE_BYTES, tdO = sdO + stage * Q_TILE_BYTES;
            fence_registers(st);
            fence_registers(dpt);
            wgmma_fence();
            issue_abt(st, dk_desc, desc_kmajor(tQ));
            issue_abt(dpt, dv_desc, desc_kmajor(tdO));
            wgmma_commit();
            wgmma_wait<0>();
            fence_registers(st);
            fence_registers(dpt);
            const bool needs_mask = q0 + BM > L || (causal && q0 < warp_key0 + 15);
            const float* tLse2 = sLse2 + stage * BM;
            const float* tDelta = sDelta + stage * BM;
#pragma unroll
            for (int nb = 0; nb < 8; ++nb) {
                const int col = nb * 8 + 2 * (lane & 3);  // query within the tile (and col + 1)
                const float2 l2 = *reinterpret_cast<const float2*>(tLse2 + col);
                const float2 dl = *reinterpret_cast<const float2*>(tDelta + col);
#pragma unroll
                for (int c = 0; c < 4; ++c) {
                    float p = fast_exp2(fmaf(st[4 * nb + c], scale_log2, -((c & 1) ? l2.y : l2.x)));
                    if (needs_mask) {
                        const int query = q0 + col + (c & 1);
                        const int key = key_g + 8 * (c >> 1);
                        if (query >= L || (causal && key > query)) p = 0.f;
                    }
                    st[4 * nb + c] = p;
                    dpt[4 * nb + c] = p * (dpt[4 * nb + c] - ((c & 1) ? dl.y : dl.x));
                }
            }
            pack_a(pf, st);
            pack_a(dsf, dpt);
            fence_registers(dv_acc);
            fence_registers(dk_acc);
            fence_registers(pf);
            fence_registers(dsf);
            wgmma_fence();
            issue_rb(dv_acc, pf, desc_mnmajor(tdO));
            issue_rb(dk_acc, dsf, desc_mnmajor(tQ));
            wgmma_commit();
            wgmma_wait<0>();
            fence_registers(dv_acc);
            fence_registers(dk_acc);
            fence_registers(pf);
            fence_registers(dsf);
        }
    }
    if (n_steps == 0) cp_async_wait<0>();  // causal keys past the last query: zero gradients

    const int key_row = wg_key0 + 16 * warp + (lane >> 2);
    store_acc_rows(head_rows(dk, ldk, batch, kv_head), ldk.row, dk_acc, key_row, S, scale);
    store_acc_rows(head_rows(dv, ldv, batch, kv_head), ldv.row, dv_acc, key_row, S, 1.f);
}

// ---------------------------------------------------------------------------------------------- entry points
// attn_wgmma_bwd_{dq,dkv}_d64_wg<WG>: WG warpgroups; arguments exactly those of attention_bf16.cu's
// attn_bf16_bwd_dq_d64_* and attn_bf16_bwd_dkv_d64_*.
#define ATTN_WGMMA_DQ(NAME, WG, MIN_BLOCKS)                                                                 \
    extern "C" __global__ void __launch_bounds__(128 * WG, MIN_BLOCKS) attn_wgmma_bwd_dq_d64_##NAME(        \
        const bf16* q, const bf16* k, const bf16* v, const bf16* out, const bf16* dout, const float* lse,   \
        float* lse2, float* delta, bf16* dq, int L, int S, float scale, int causal, int H, int group,       \
        LAYOUT_PARAMS(q), LAYOUT_PARAMS(k), LAYOUT_PARAMS(v), LAYOUT_PARAMS(o), LAYOUT_PARAMS(dO),          \
        LAYOUT_PARAMS(dq)) {                                                                               \
        attn_wgmma_bwd_dq<WG>(q, k, v, out, dout, lse, lse2, delta, dq, L, S, scale, causal, H, group,      \
                              LAYOUT(q), LAYOUT(k), LAYOUT(v), LAYOUT(o), LAYOUT(dO), LAYOUT(dq));         \
    }
#define ATTN_WGMMA_DKV(NAME, WG, MIN_BLOCKS)                                                                \
    extern "C" __global__ void __launch_bounds__(128 * WG, MIN_BLOCKS) attn_wgmma_bwd_dkv_d64_##NAME(       \
        const bf16* q, const bf16* k, const bf16* v, const bf16* dout, const float* lse2,                   \
        const float* delta, bf16* dk, bf16* dv, int L, int S, float scale, int causal, int H, int group,    \
        LAYOUT_PARAMS(q), LAYOUT_PARAMS(k), LAYOUT_PARAMS(v), LAYOUT_PARAMS(dO), LAYOUT_PARAMS(dk),         \
        LAYOUT_PARAMS(dv)) {                                                                               \
        attn_wgmma_bwd_dkv<WG>(q, k, v, dout, lse2, delta, dk, dv, L, S, scale, causal, H, group,           \
                               LAYOUT(q), LAYOUT(k), LAYOUT(v), LAYOUT(dO), LAYOUT(dk), LAYOUT(dv));       \
    }

ATTN_WGMMA_DQ(wg2, 2, 1)
ATTN_WGMMA_DQ(wg1, 1, 2)
ATTN_WGMMA_DKV(wg2, 2, 1)
ATTN_WGMMA_DKV(wg1, 1, 2)
