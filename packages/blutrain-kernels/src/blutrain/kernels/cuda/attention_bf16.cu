// Flash attention for bfloat16 storage on the tensor cores (mma.sync m16n8k16, bf16 inputs, float32
// accumulators), forward and backward; causal (top-left aligned: query i sees keys 0..i) or not; head
// dim D = 64 or 128; any L and S (tails are zero-filled on load and masked). Same contract as
// attention.cu: q, out, dq, dout hold L rows of D per (batch, head), k, v, dk, dv S rows, each tensor
// addressed through its own (batch, head, row) strides in elements (a row's D elements contiguous,
// every row 16-byte aligned), so that q, k, v may be the parts of one packed [B, T, 3, H, D]
// projection and dq, dk, dv the parts of its gradient; blockIdx.y = b * H + h. lse [B*H, L] float32
// natural-log log-sum-exp of the scaled scores, contiguous. No L x S matrix in memory. Grouped-query
// attention: k, v, dk, dv have H / group heads, query head h reads key/value head h / group (group 1: one
// each); the dk/dv kernel's blocks are per key/value head (blockIdx.y = b * H / group + h_kv) and step through
// the query tiles of the group's query heads one head after another, summing in registers (no atomics).
//
// Work split. Every warp owns 16 rows of the "M" side of each product (queries in the forward and dq
// kernels, keys in the dk/dv kernel), so the softmax statistics of a row live in the four lanes of
// one quad and the score tile never leaves registers:
//   attn_bf16_fwd_*:     grid (ceil(L/BM), BH), WARPS warps, BM = 16 * WARPS * M_TILES queries (a
//                        warp takes M_TILES 16-row tiles so that each K/V fragment read from shared
//                        memory feeds M_TILES products). Loops over 64-key tiles: S = q k^T, online
//                        softmax in base 2 (running max m and per-lane partial sums l), O = O * alpha
//                        + P v; out = O / l, lse = scale * m + ln l. FLOPs 4 BH L S D (about half
//                        when causal).
//   attn_bf16_bwd_dq_*:  grid (ceil(L/BM), BH), BM = 16 * WARPS queries; launched first. Computes
//                        Delta = rowsum(dO * out) and lse2 = lse * log2(e) for its rows (written out,
//                        float32, for the dk/dv kernel), then per 64-key tile recomputes S = q k^T,
//                        dP = dO v^T, P = exp2(S scale log2e - lse2), dS = P (dP - Delta), and
//                        accumulates dq += scale dS k.
//   attn_bf16_bwd_dkv_*: grid (ceil(S/BN), BH / group), BN = 16 * WARPS keys; loops over BM-query tiles:
//                        S^T = k q^T and dP^T = v dO^T (warp = 16 keys), P^T, dS^T as above,
//                        dv += P^T dO, dk += scale dS^T q.
//   Two kernels rather than float32 atomics for dq: the result is deterministic, at 7 instead of 5
//   L x S x D products (backward FLOPs 14 BH L S D, about half when causal).
// In causal mode a block skips the tiles that lie wholly above the diagonal, and a warp skips the
// products of a tile that no row of it sees (a warp-uniform branch). Tiles needing a mask (the
// diagonal, the S tail) are masked element by element; the others are not.
//
// Fragments (PTX ISA, mma.m16n8k16 .bf16; lane = 4 * g + t, g = lane / 4, t = lane % 4):
//   A 16x16 (row-major), 4 registers of 2 bf16: a0 (row g, k 2t..2t+1), a1 (row g+8, same k),
//     a2 (row g, k 2t+8..2t+9), a3 (row g+8, k 2t+8..2t+9).
//   B 16x8 ("col"), 2 registers: b0 (k 2t..2t+1, column g), b1 (k 2t+8..2t+9, column g).
//   C/D 16x8 float: c0, c1 (row g, columns 2t, 2t+1), c2, c3 (row g+8, same columns).
// Two C tiles that are neighbours along n are exactly the A fragment of the next product along k
// (a0 = c0c1 of the first, a1 = c2c3, a2 = c0c1 of the second, a3 = c2c3), so P and dS go from
// accumulators to operands by packing pairs into bf16x2 registers, with no shuffle and no shared
// memory. Operands that come from shared memory are read with ldmatrix.x4 (four 8x8 matrices, one
// 16-byte row address per lane): non-transposed for A tiles and for B tiles stored n-major (k rows
// when the product is q k^T), transposed (.trans) for B tiles stored k-major (v rows in P v).
//
// Shared memory. Tiles are [rows][D] bf16, loaded with cp.async (16 bytes per thread and request,
// zero-filled past the last valid row) two stages deep: the next K/V (or q/dO) tile streams in while
// the current one is multiplied. A row is D * 2 = 128 or 256 bytes, so the eight row addresses of one
// ldmatrix matrix would all fall in the same four banks; each 16-byte chunk c of row r is stored at
// chunk c ^ (r % 8) instead (an XOR swizzle), which spreads them over all 32 banks for both the
// cp.async writes and the ldmatrix reads.
#include "common.cuh"
#include "attention.cuh"

#define ATTN_KEYS_PER_TILE 64  // keys per step of the forward and dq kernels

// ---- PTX wrappers (each one instruction; the cp.async ones, cvt_bf16x2 and fast_exp2 in attention.cuh) ----

__device__ __forceinline__ void ldmatrix_x4(unsigned (&r)[4], unsigned addr) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(addr));
}

__device__ __forceinline__ void ldmatrix_x4_trans(unsigned (&r)[4], unsigned addr) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(addr));
}

// acc (16x8 float) += a (16x16 bf16) * b (16x8 bf16)
__device__ __forceinline__ void mma_bf16_16816(float (&acc)[4], const unsigned (&a)[4], unsigned b0, unsigned b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%0, %1, %2, %3};\n"
        : "+f"(acc[0]), "+f"(acc[1]), "+f"(acc[2]), "+f"(acc[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// ---- end of PTX wrappers --------------------------------------------------------------------------

// Byte offset of 16-byte chunk `chunk` (columns 8 chunk .. 8 chunk + 7) of row `row` in a swizzled
// [rows][D] bf16 tile.
template <int D> __device__ __forceinline__ unsigned tile_offset(int row, int chunk) {
    return static_cast<unsigned>(row * (D * 2) + ((chunk ^ (row & 7)) << 4));
}

// Rows row0 .. row0 + ROWS - 1 (rs elements apart) of a matrix of rows_valid rows into a swizzled tile;
// rows at or past rows_valid read as zero. Every thread of the block takes part; the caller commits.
template <int D, int ROWS, int THREADS>
__device__ __forceinline__ void load_tile_async(unsigned tile, const bf16* __restrict__ src, long long rs, int row0,
                                                int rows_valid) {
    constexpr int CHUNKS = D / 8;
    static_assert((ROWS * CHUNKS) % THREADS == 0, "tile chunks must divide evenly among the threads");
#pragma unroll
    for (int i = 0; i < ROWS * CHUNKS / THREADS; ++i) {
        const int e = i * THREADS + threadIdx.x;
        const int r = e / CHUNKS, c = e % CHUNKS;
        const int row = row0 + r;
        const bool valid = row < rows_valid;
        cp_async_16(tile + tile_offset<D>(r, c), src + (valid ? row : 0) * rs + c * 8, valid);
    }
}

// A fragment: rows row0 .. row0 + 15, k columns 16 kstep .. 16 kstep + 15 of a row-major tile.
// ldmatrix matrices: (rows 0-7, k 0-7), (rows 8-15, k 0-7), (rows 0-7, k 8-15), (rows 8-15, k 8-15).
template <int D> __device__ __forceinline__ void load_a(unsigned (&a)[4], unsigned tile, int row0, int kstep) {
    const int lane = threadIdx.x & 31;
    ldmatrix_x4(a, tile + tile_offset<D>(row0 + (lane & 15), 2 * kstep + (lane >> 4)));
}

// B fragments of two neighbouring n-blocks (n0 .. n0 + 15) at k-step kstep from a tile stored n-major
// ([n][k], e.g. k when the product is q k^T): b[0], b[1] for n-block n0 / 8, b[2], b[3] for the next.
template <int D> __device__ __forceinline__ void load_b_nmajor(unsigned (&b)[4], unsigned tile, int n0, int kstep) {
    const int lane = threadIdx.x & 31;
    ldmatrix_x4(b, tile + tile_offset<D>(n0 + (lane & 7) + ((lane >> 4) << 3), 2 * kstep + ((lane >> 3) & 1)));
}

// B fragments of two neighbouring n-blocks (columns 16 npair .. 16 npair + 15) at k rows k0 .. k0 + 15
// of a tile stored k-major ([k][n], e.g. v when the product is P v): transposed ldmatrix.
template <int D> __device__ __forceinline__ void load_b_kmajor(unsigned (&b)[4], unsigned tile, int k0, int npair) {
    const int lane = threadIdx.x & 31;
    ldmatrix_x4_trans(b, tile + tile_offset<D>(k0 + (lane & 15), 2 * npair + (lane >> 4)));
}

// A fragment of k-step kk from accumulator tiles acc[2 kk], acc[2 kk + 1] (16 x 16 of bf16).
template <int NB> __device__ __forceinline__ void accumulators_to_a(unsigned (&a)[4], const float (&acc)[NB][4],
                                                                    int kk) {
    a[0] = cvt_bf16x2(acc[2 * kk][0], acc[2 * kk][1]);
    a[1] = cvt_bf16x2(acc[2 * kk][2], acc[2 * kk][3]);
    a[2] = cvt_bf16x2(acc[2 * kk + 1][0], acc[2 * kk + 1][1]);
    a[3] = cvt_bf16x2(acc[2 * kk + 1][2], acc[2 * kk + 1][3]);
}

// One 16-row accumulator tile [DB][4] to rows row0 + g and row0 + g + 8 (rs elements apart) of a matrix of
// rows_valid rows, times `mul`, as bf16 pairs.
template <int D> __device__ __forceinline__ void store_rows(bf16* __restrict__ dst, long long rs,
                                                           const float (&acc)[D / 8][4], int row0, int rows_valid,
                                                           float mul0, float mul1) {
    const int lane = threadIdx.x & 31;
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        const int row = row0 + (lane >> 2) + 8 * h;
        if (row < rows_valid) {
            const float mul = h ? mul1 : mul0;
            unsigned* out = reinterpret_cast<unsigned*>(dst + row * rs + 2 * (lane & 3));
#pragma unroll
            for (int db = 0; db < D / 8; ++db) out[4 * db] = cvt_bf16x2(acc[db][2 * h] * mul, acc[db][2 * h + 1] * mul);
        }
    }
}

// ---------------------------------------------------------------------------------------------- forward

template <int D, int WARPS, int M_TILES, bool Q_IN_REGISTERS>
__device__ __forceinline__ void attn_bf16_fwd(const bf16* __restrict__ q, const bf16* __restrict__ k,
                                              const bf16* __restrict__ v, bf16* __restrict__ out,
                                              float* __restrict__ lse, int L, int S, float scale, int causal,
                                              int H, int group, RowLayout lq, RowLayout lk, RowLayout lv,
                                              RowLayout lo) {
    constexpr int THREADS = 32 * WARPS;
    constexpr int BM = 16 * WARPS * M_TILES;
    constexpr int BN = ATTN_KEYS_PER_TILE;
    constexpr int KSTEPS = D / 16;  // k-steps of q k^T
    constexpr int NB = BN / 8;      // n-blocks of a score tile
    constexpr int DB = D / 8;       // n-blocks of the output
    constexpr unsigned KV_TILE_BYTES = BN * D * 2;
    extern __shared__ __align__(128) unsigned char smem[];
    const unsigned sQ = shared_address(smem);
    const unsigned sK = sQ + BM * D * 2;  // two stages each
    const unsigned sV = sK + 2 * KV_TILE_BYTES;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int bh = blockIdx.y, batch = bh / H, head = bh - batch * H;
    // Causal query tiles differ in length: launch the longest first so that short ones fill the tail.
    const int q0 = (causal ? gridDim.x - 1 - blockIdx.x : blockIdx.x) * BM;
    const int warp_row0 = q0 + warp * 16 * M_TILES;  // this warp's first query
    const int warp_row_last = warp_row0 + 16 * M_TILES - 1;
    const bf16* qb = head_rows(q, lq, batch, head);
    const bf16* kb = head_rows(k, lk, batch, head / group);
    const bf16* vb = head_rows(v, lv, batch, head / group);
    const float scale_log2 = scale * ATTN_LOG2E;
    const int key_end = causal ? min(S, q0 + BM) : S;
    const int n_tiles = (key_end + BN - 1) / BN;

    load_tile_async<D, BM, THREADS>(sQ, qb, lq.row, q0, L);
    load_tile_async<D, BN, THREADS>(sK, kb, lk.row, 0, S);
    load_tile_async<D, BN, THREADS>(sV, vb, lv.row, 0, S);
    cp_async_commit();

    constexpr int QREG = Q_IN_REGISTERS ? KSTEPS : 1;
    unsigned q_frag[M_TILES][QREG][4];
    float o_acc[M_TILES][DB][4];
    float row_max[M_TILES][2], row_sum[M_TILES][2];  // raw-score max; this lane's partial sum
#pragma unroll
    for (int mt = 0; mt < M_TILES; ++mt) {
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            row_max[mt][h] = -BT_INF;
            row_sum[mt][h] = 0.f;
        }
#pragma unroll
        for (int db = 0; db < DB; ++db) {
#pragma unroll
            for (int c = 0; c < 4; ++c) o_acc[mt][db][c] = 0.f;
        }
    }

    for (int j = 0; j < n_tiles; ++j) {
        const int k0 = j * BN;
        const int stage = j & 1;
        if (j + 1 < n_tiles) {  // the other stage was released by the barrier that ended step j - 1
            load_tile_async<D, BN, THREADS>(sK + (stage ^ 1) * KV_TILE_BYTES, kb, lk.row, k0 + BN, S);
            load_tile_async<D, BN, THREADS>(sV + (stage ^ 1) * KV_TILE_BYTES, vb, lv.row, k0 + BN, S);
            cp_async_commit();
            cp_async_wait<1>();
        } else {
            cp_async_wait<0>();
        }
        __syncthreads();
        if (Q_IN_REGISTERS && j == 0) {
#pragma unroll
            for (int mt = 0; mt < M_TILES; ++mt) {
#pragma unroll
                for (int ks = 0; ks < QREG; ++ks) load_a<D>(q_frag[mt][ks], sQ, (warp * M_TILES + mt) * 16, ks);
            }
        }
        if (!(causal && k0 > warp_row_last)) {
            const unsigned tK = sK + stage * KV_TILE_BYTES, tV = sV + stage * KV_TILE_BYTES;
            float s[M_TILES][NB][4];
#pragma unroll
            for (int mt = 0; mt < M_TILES; ++mt) {
#pragma unroll
                for (int nb = 0; nb < NB; ++nb) {
#pragma unroll
                    for (int c = 0; c < 4; ++c) s[mt][nb][c] = 0.f;
                }
            }
#pragma unroll
            for (int ks = 0; ks < KSTEPS; ++ks) {
                const int qr = Q_IN_REGISTERS ? ks : 0;
                if (!Q_IN_REGISTERS) {
#pragma unroll
                    for (int mt = 0; mt < M_TILES; ++mt) load_a<D>(q_frag[mt][0], sQ, (warp * M_TILES + mt) * 16, ks);
                }
#pragma unroll
                for (int np = 0; np < NB / 2; ++np) {
                    unsigned b[4];
                    load_b_nmajor<D>(b, tK, 16 * np, ks);
#pragma unroll
                    for (int mt = 0; mt < M_TILES; ++mt) {
                        mma_bf16_16816(s[mt][2 * np], q_frag[mt][qr], b[0], b[1]);
                        mma_bf16_16816(s[mt][2 * np + 1], q_frag[mt][qr], b[2], b[3]);
                    }
                }
            }
            if (k0 + BN > S || (causal && k0 + BN - 1 > warp_row0)) {
#pragma unroll
                for (int mt = 0; mt < M_TILES; ++mt) {
#pragma unroll
                    for (int nb = 0; nb < NB; ++nb) {
#pragma unroll
                        for (int c = 0; c < 4; ++c) {
                            const int col = k0 + nb * 8 + 2 * (lane & 3) + (c & 1);
                            const int row = warp_row0 + mt * 16 + (lane >> 2) + 8 * (c >> 1);
                            if (col >= S || (causal && col > row)) s[mt][nb][c] = -BT_INF;
                        }
                    }
                }
            }
#pragma unroll
            for (int mt = 0; mt < M_TILES; ++mt) {
#pragma unroll
                for (int h = 0; h < 2; ++h) {
                    // Max and sum as trees, not chains: with two warps per scheduler there is little else to
                    // issue while a chain of dependent adds waits out its latency.
                    float tree[NB];
#pragma unroll
                    for (int nb = 0; nb < NB; ++nb) tree[nb] = fmaxf(s[mt][nb][2 * h], s[mt][nb][2 * h + 1]);
#pragma unroll
                    for (int w = NB / 2; w > 0; w >>= 1) {
#pragma unroll
                        for (int i = 0; i < w; ++i) tree[i] = fmaxf(tree[i], tree[i + w]);
                    }
                    float mx = fmaxf(row_max[mt][h], tree[0]);
                    mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
                    mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
                    // A row with nothing visible yet keeps max -inf: subtract 0 instead, so that every
                    // exponent is -inf and every p is 0 (never inf - inf).
                    const float base = mx == -BT_INF ? 0.f : mx * scale_log2;
                    const float alpha = fast_exp2(fmaf(row_max[mt][h], scale_log2, -base));
                    row_max[mt][h] = mx;
#pragma unroll
                    for (int nb = 0; nb < NB; ++nb) {
                        s[mt][nb][2 * h] = fast_exp2(fmaf(s[mt][nb][2 * h], scale_log2, -base));
                        s[mt][nb][2 * h + 1] = fast_exp2(fmaf(s[mt][nb][2 * h + 1], scale_log2, -base));
                        tree[nb] = s[mt][nb][2 * h] + s[mt][nb][2 * h + 1];
                    }
#pragma unroll
                    for (int w = NB / 2; w > 0; w >>= 1) {
#pragma unroll
                        for (int i = 0; i < w; ++i) tree[i] += tree[i + w];
                    }
                    row_sum[mt][h] = row_sum[mt][h] * alpha + tree[0];
#pragma unroll
                    for (int db = 0; db < DB; ++db) {
                        o_acc[mt][db][2 * h] *= alpha;
                        o_acc[mt][db][2 * h + 1] *= alpha;
                    }
                }
            }
#pragma unroll
            for (int kk = 0; kk < BN / 16; ++kk) {
                unsigned p_frag[M_TILES][4];
#pragma unroll
                for (int mt = 0; mt < M_TILES; ++mt) accumulators_to_a<NB>(p_frag[mt], s[mt], kk);
#pragma unroll
                for (int dp = 0; dp < DB / 2; ++dp) {
                    unsigned b[4];
                    load_b_kmajor<D>(b, tV, 16 * kk, dp);
#pragma unroll
                    for (int mt = 0; mt < M_TILES; ++mt) {
                        mma_bf16_16816(o_acc[mt][2 * dp], p_frag[mt], b[0], b[1]);
                        mma_bf16_16816(o_acc[mt][2 * dp + 1], p_frag[mt], b[2], b[3]);
                    }
                }
            }
        }
        __syncthreads();  // every warp is done with this stage before the next step refills it
    }

    bf16* ob = head_rows(out, lo, batch, head);
    float* lb = lse + (long long)bh * L;
#pragma unroll
    for (int mt = 0; mt < M_TILES; ++mt) {
        float inv[2];
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            float total = row_sum[mt][h];
            total += __shfl_xor_sync(0xffffffffu, total, 1);
            total += __shfl_xor_sync(0xffffffffu, total, 2);
            inv[h] = total > 0.f ? 1.f / total : 0.f;
            const int row = warp_row0 + mt * 16 + (lane >> 2) + 8 * h;
            if (row < L && (lane & 3) == 0) {
                lb[row] = total > 0.f ? row_max[mt][h] * scale + logf(total) : -BT_INF;
            }
        }
        store_rows<D>(ob, lo.row, o_acc[mt], warp_row0 + mt * 16, L, inv[0], inv[1]);
    }
}

// ---------------------------------------------------------------------------------------------- backward

// dk and dv of BN = 16 * WARPS keys, looping over BM-query tiles. K_IN_REGISTERS keeps the warp's k and
// v rows as A fragments for the whole loop (D = 64); at D = 128 they are re-read from shared memory
// per k-step, which keeps the kernel within 255 registers.
template <int D, int WARPS, int BM, bool K_IN_REGISTERS>
__device__ __forceinline__ void attn_bf16_bwd_dkv(const bf16* __restrict__ q, const bf16* __restrict__ k,
                                                  const bf16* __restrict__ v, const bf16* __restrict__ dout,
                                                  const float* __restrict__ lse2, const float* __restrict__ delta,
                                                  bf16* __restrict__ dk, bf16* __restrict__ dv, int L, int S,
                                                  float scale, int causal, int H, int group, RowLayout lq,
                                                  RowLayout lk, RowLayout lv, RowLayout ldo, RowLayout ldk,
                                                  RowLayout ldv) {
    constexpr int THREADS = 32 * WARPS;
    constexpr int BN = 16 * WARPS;
    constexpr int KSTEPS = D / 16;
    constexpr int NBQ = BM / 8;  // n-blocks (of 8 queries) of S^T
    constexpr int DB = D / 8;
    constexpr unsigned Q_TILE_BYTES = BM * D * 2;
    static_assert(BM <= THREADS, "one thread per query row loads the row statistics");
    extern __shared__ __align__(128) unsigned char smem[];
    const unsigned sK = shared_address(smem);
    const unsigned sV = sK + BN * D * 2;
    const unsigned sQ = sV + BN * D * 2;     // two stages each
    const unsigned sdO = sQ + 2 * Q_TILE_BYTES;
    float* sLse2 = reinterpret_cast<float*>(smem + 2 * BN * D * 2 + 4 * Q_TILE_BYTES);  // [2][BM]
    float* sDelta = sLse2 + 2 * BM;                                                     // [2][BM]
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int kv_heads = H / group;
    const int bkv = blockIdx.y, batch = bkv / kv_heads, kv_head = bkv - batch * kv_heads;
    const int k0 = blockIdx.x * BN;
    const int warp_key0 = k0 + warp * 16;
    const float scale_log2 = scale * ATTN_LOG2E;
    // Causal: queries before the tile containing k0 see none of these keys.
    const int q_begin = causal ? (k0 / BM) * BM : 0;
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
        load_tile_async<D, BM, THREADS>(sQ + stage * Q_TILE_BYTES, qb, lq.row, q0, L);
        load_tile_async<D, BM, THREADS>(sdO + stage * Q_TILE_BYTES, ob, ldo.row, q0, L);
        if (threadIdx.x < BM) {
            const int row = q0 + threadIdx.x;
            const bool valid = row < L;
            cp_async_4(shared_address(sLse2 + stage * BM + threadIdx.x), lb + (valid ? row : 0), valid);
            cp_async_4(shared_address(sDelta + stage * BM + threadIdx.x), db_ + (valid ? row : 0), valid);
        }
    };
    load_tile_async<D, BN, THREADS>(sK, head_rows(k, lk, batch, kv_head), lk.row, k0, S);
    load_tile_async<D, BN, THREADS>(sV, head_rows(v, lv, batch, kv_head), lv.row, k0, S);
    if (n_steps > 0) load_query_tile(0, 0);
    cp_async_commit();

    constexpr int KREG = K_IN_REGISTERS ? KSTEPS : 1;
    unsigned k_frag[KREG][4], v_frag[KREG][4];
    float dk_acc[DB][4], dv_acc[DB][4];
#pragma unroll
    for (int db = 0; db < DB; ++db) {
#pragma unroll
        for (int c = 0; c < 4; ++c) {
            dk_acc[db][c] = 0.f;
            dv_acc[db][c] = 0.f;
        }
    }

    for (int i = 0; i < n_steps; ++i) {
        const int q0 = q_begin + (i % n_tiles) * BM;
        const int stage = i & 1;
        if (i + 1 < n_steps) {
            load_query_tile(stage ^ 1, i + 1);
            cp_async_commit();
            cp_async_wait<1>();
        } else {
            cp_async_wait<0>();
        }
        __syncthreads();
        if (K_IN_REGISTERS && i == 0) {
#pragma unroll
            for (int ks = 0; ks < KREG; ++ks) {
                load_a<D>(k_frag[ks], sK, warp * 16, ks);
                load_a<D>(v_frag[ks], sV, warp * 16, ks);
            }
        }
        if (!(causal && q0 + BM - 1 < warp_key0)) {
            const unsigned tQ = sQ + stage * Q_TILE_BYTES, tdO = sdO + stage * Q_TILE_BYTES;
            float st[NBQ][4], dpt[NBQ][4];  // S^T and dP^T: rows = this warp's keys, columns = queries
#pragma unroll
            for (int nb = 0; nb < NBQ; ++nb) {
#pragma unroll
                for (int c = 0; c < 4; ++c) {
                    st[nb][c] = 0.f;
                    dpt[nb][c] = 0.f;
                }
            }
#pragma unroll
            for (int ks = 0; ks < KSTEPS; ++ks) {
                const int kr = K_IN_REGISTERS ? ks : 0;
                if (!K_IN_REGISTERS) {
                    load_a<D>(k_frag[kr], sK, warp * 16, ks);
                    load_a<D>(v_frag[kr], sV, warp * 16, ks);
                }
#pragma unroll
                for (int np = 0; np < NBQ / 2; ++np) {
                    unsigned b[4];
                    load_b_nmajor<D>(b, tQ, 16 * np, ks);
                    mma_bf16_16816(st[2 * np], k_frag[kr], b[0], b[1]);
                    mma_bf16_16816(st[2 * np + 1], k_frag[kr], b[2], b[3]);
                    load_b_nmajor<D>(b, tdO, 16 * np, ks);
                    mma_bf16_16816(dpt[2 * np], v_frag[kr], b[0], b[1]);
                    mma_bf16_16816(dpt[2 * np + 1], v_frag[kr], b[2], b[3]);
                }
            }
            const bool needs_mask = q0 + BM > L || (causal && q0 < warp_key0 + 15);
            const float* tLse2 = sLse2 + stage * BM;
            const float* tDelta = sDelta + stage * BM;
#pragma unroll
            for (int nb = 0; nb < NBQ; ++nb) {
                const int col = nb * 8 + 2 * (lane & 3);  // query within the tile (and col + 1)
                const float2 l2 = *reinterpret_cast<const float2*>(tLse2 + col);
                const float2 dl = *reinterpret_cast<const float2*>(tDelta + col);
#pragma unroll
                for (int c = 0; c < 4; ++c) {
                    float p = fast_exp2(fmaf(st[nb][c], scale_log2, -((c & 1) ? l2.y : l2.x)));
                    if (needs_mask) {
                        const int query = q0 + col + (c & 1);
                        const int key = warp_key0 + (lane >> 2) + 8 * (c >> 1);
                        if (query >= L || (causal && key > query)) p = 0.f;
                    }
                    st[nb][c] = p;
                    dpt[nb][c] = p * (dpt[nb][c] - ((c & 1) ? dl.y : dl.x));
                }
            }
#pragma unroll
            for (int kk = 0; kk < BM / 16; ++kk) {
                unsigned p_frag[4], ds_frag[4];
                accumulators_to_a<NBQ>(p_frag, st, kk);
                accumulators_to_a<NBQ>(ds_frag, dpt, kk);
#pragma unroll
                for (int dp = 0; dp < DB / 2; ++dp) {
                    unsigned b[4];
                    load_b_kmajor<D>(b, tdO, 16 * kk, dp);
                    mma_bf16_16816(dv_acc[2 * dp], p_frag, b[0], b[1]);
                    mma_bf16_16816(dv_acc[2 * dp + 1], p_frag, b[2], b[3]);
                    load_b_kmajor<D>(b, tQ, 16 * kk, dp);
                    mma_bf16_16816(dk_acc[2 * dp], ds_frag, b[0], b[1]);
                    mma_bf16_16816(dk_acc[2 * dp + 1], ds_frag, b[2], b[3]);
                }
            }
        }
        __syncthreads();
    }
    if (n_steps == 0) cp_async_wait<0>();  // causal keys past the last query: zero gradients

    store_rows<D>(head_rows(dk, ldk, batch, kv_head), ldk.row, dk_acc, warp_key0, S, scale, scale);
    store_rows<D>(head_rows(dv, ldv, batch, kv_head), ldv.row, dv_acc, warp_key0, S, 1.f, 1.f);
}

// dq of BM = 16 * WARPS queries, looping over 64-key tiles. Runs before the dk/dv kernel: it also computes
// the per-row inputs of both, Delta = rowsum(dO * out) and lse2 = lse * log2(e), from its own tiles and
// writes them out (float32 [BH, L]) for dk/dv, which would otherwise need a pass of its own over out and dO.
template <int D, int WARPS>
__device__ __forceinline__ void attn_bf16_bwd_dq(const bf16* __restrict__ q, const bf16* __restrict__ k,
                                                 const bf16* __restrict__ v, const bf16* __restrict__ out,
                                                 const bf16* __restrict__ dout, const float* __restrict__ lse,
                                                 float* __restrict__ lse2, float* __restrict__ delta,
                                                 bf16* __restrict__ dq, int L, int S, float scale, int causal,
                                                 int H, int group, RowLayout lq, RowLayout lk, RowLayout lv,
                                                 RowLayout lo, RowLayout ldo, RowLayout ldq) {
    constexpr int THREADS = 32 * WARPS;
    constexpr int BM = 16 * WARPS;
    constexpr int BN = ATTN_KEYS_PER_TILE;
    constexpr int KSTEPS = D / 16;
    constexpr int NB = BN / 8;
    constexpr int DB = D / 8;
    constexpr unsigned KV_TILE_BYTES = BN * D * 2;
    extern __shared__ __align__(128) unsigned char smem[];
    constexpr unsigned Q_TILE_BYTES = BM * D * 2;
    const unsigned sQ = shared_address(smem);
    const unsigned sdO = sQ + Q_TILE_BYTES;
    const unsigned sO = sdO + Q_TILE_BYTES;
    const unsigned sK = sO + Q_TILE_BYTES;  // two stages each
    const unsigned sV = sK + 2 * KV_TILE_BYTES;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int bh = blockIdx.y, batch = bh / H, head = bh - batch * H;
    const int q0 = (causal ? gridDim.x - 1 - blockIdx.x : blockIdx.x) * BM;
    const int warp_row0 = q0 + warp * 16;
    const bf16* kb = head_rows(k, lk, batch, head / group);
    const bf16* vb = head_rows(v, lv, batch, head / group);
    const float scale_log2 = scale * ATTN_LOG2E;
    const int key_end = causal ? min(S, q0 + BM) : S;
    const int n_tiles = (key_end + BN - 1) / BN;

    load_tile_async<D, BM, THREADS>(sQ, head_rows(q, lq, batch, head), lq.row, q0, L);
    load_tile_async<D, BM, THREADS>(sdO, head_rows(dout, ldo, batch, head), ldo.row, q0, L);
    load_tile_async<D, BM, THREADS>(sO, head_rows(out, lo, batch, head), lo.row, q0, L);
    load_tile_async<D, BN, THREADS>(sK, kb, lk.row, 0, S);
    load_tile_async<D, BN, THREADS>(sV, vb, lv.row, 0, S);
    cp_async_commit();

    float row_lse2[2], row_delta[2];
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        const int row = warp_row0 + (lane >> 2) + 8 * h;
        row_lse2[h] = row < L ? lse[(long long)bh * L + row] * ATTN_LOG2E : 0.f;
    }
    unsigned q_frag[KSTEPS][4], do_frag[KSTEPS][4];
    float dq_acc[DB][4];
#pragma unroll
    for (int db = 0; db < DB; ++db) {
#pragma unroll
        for (int c = 0; c < 4; ++c) dq_acc[db][c] = 0.f;
    }

    for (int j = 0; j < n_tiles; ++j) {
        const int k0 = j * BN;
        const int stage = j & 1;
        if (j + 1 < n_tiles) {
            load_tile_async<D, BN, THREADS>(sK + (stage ^ 1) * KV_TILE_BYTES, kb, lk.row, k0 + BN, S);
            load_tile_async<D, BN, THREADS>(sV + (stage ^ 1) * KV_TILE_BYTES, vb, lv.row, k0 + BN, S);
            cp_async_commit();
            cp_async_wait<1>();
        } else {
            cp_async_wait<0>();
        }
        __syncthreads();
        if (j == 0) {
#pragma unroll
            for (int ks = 0; ks < KSTEPS; ++ks) {
                load_a<D>(q_frag[ks], sQ, warp * 16, ks);
                load_a<D>(do_frag[ks], sdO, warp * 16, ks);
            }
            // Delta of rows g and g + 8: the four lanes of a quad split the row's 16-byte chunks.
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                const int r = warp * 16 + (lane >> 2) + 8 * h;
                float acc = 0.f;
#pragma unroll
                for (int c = lane & 3; c < D / 8; c += 4) {
                    const uint4 o = *reinterpret_cast<const uint4*>(smem + (sO - sQ) + tile_offset<D>(r, c));
                    const uint4 g = *reinterpret_cast<const uint4*>(smem + (sdO - sQ) + tile_offset<D>(r, c));
                    const unsigned ow[4] = {o.x, o.y, o.z, o.w}, gw[4] = {g.x, g.y, g.z, g.w};
#pragma unroll
                    for (int i = 0; i < 4; ++i) {
                        float o0, o1, g0, g1;
                        unpack_bf16x2(ow[i], o0, o1);
                        unpack_bf16x2(gw[i], g0, g1);
                        acc = fmaf(o0, g0, fmaf(o1, g1, acc));
                    }
                }
                acc += __shfl_xor_sync(0xffffffffu, acc, 1);
                acc += __shfl_xor_sync(0xffffffffu, acc, 2);
                row_delta[h] = acc;
                const int row = warp_row0 + (lane >> 2) + 8 * h;
                if ((lane & 3) == 0 && row < L) {
                    delta[(long long)bh * L + row] = acc;
                    lse2[(long long)bh * L + row] = row_lse2[h];
                }
            }
        }
        if (!(causal && k0 > warp_row0 + 15)) {
            const unsigned tK = sK + stage * KV_TILE_BYTES, tV = sV + stage * KV_TILE_BYTES;
            float s[NB][4], dp[NB][4];
#pragma unroll
            for (int nb = 0; nb < NB; ++nb) {
#pragma unroll
                for (int c = 0; c < 4; ++c) {
                    s[nb][c] = 0.f;
                    dp[nb][c] = 0.f;
                }
            }
#pragma unroll
            for (int ks = 0; ks < KSTEPS; ++ks) {
#pragma unroll
                for (int np = 0; np < NB / 2; ++np) {
                    unsigned b[4];
                    load_b_nmajor<D>(b, tK, 16 * np, ks);
                    mma_bf16_16816(s[2 * np], q_frag[ks], b[0], b[1]);
                    mma_bf16_16816(s[2 * np + 1], q_frag[ks], b[2], b[3]);
                    load_b_nmajor<D>(b, tV, 16 * np, ks);
                    mma_bf16_16816(dp[2 * np], do_frag[ks], b[0], b[1]);
                    mma_bf16_16816(dp[2 * np + 1], do_frag[ks], b[2], b[3]);
                }
            }
            const bool needs_mask = k0 + BN > S || (causal && k0 + BN - 1 > warp_row0);
#pragma unroll
            for (int nb = 0; nb < NB; ++nb) {
#pragma unroll
                for (int c = 0; c < 4; ++c) {
                    const int h = c >> 1;
                    float p = fast_exp2(fmaf(s[nb][c], scale_log2, -row_lse2[h]));
                    if (needs_mask) {
                        const int col = k0 + nb * 8 + 2 * (lane & 3) + (c & 1);
                        const int row = warp_row0 + (lane >> 2) + 8 * h;
                        if (col >= S || (causal && col > row)) p = 0.f;
                    }
                    dp[nb][c] = p * (dp[nb][c] - row_delta[h]);
                }
            }
#pragma unroll
            for (int kk = 0; kk < BN / 16; ++kk) {
                unsigned ds_frag[4];
                accumulators_to_a<NB>(ds_frag, dp, kk);
#pragma unroll
                for (int dpair = 0; dpair < DB / 2; ++dpair) {
                    unsigned b[4];
                    load_b_kmajor<D>(b, tK, 16 * kk, dpair);
                    mma_bf16_16816(dq_acc[2 * dpair], ds_frag, b[0], b[1]);
                    mma_bf16_16816(dq_acc[2 * dpair + 1], ds_frag, b[2], b[3]);
                }
            }
        }
        __syncthreads();
    }
    store_rows<D>(head_rows(dq, ldq, batch, head), ldq.row, dq_acc, warp_row0, L, scale, scale);
}

// ---------------------------------------------------------------------------------------------- entry points
// One instance per tile shape, named attn_bf16_<kernel>_d<D>_<shape>; the host picks one per head dim.
// MIN_BLOCKS is the blocks per multiprocessor that __launch_bounds__ asks the register allocator for.

// Each tensor's layout arrives as three 64-bit scalars (batch, head, row strides), after the scalars.
#define ATTN_BF16_FWD(D, NAME, WARPS, M_TILES, Q_IN_REGISTERS, MIN_BLOCKS)                                 \
    extern "C" __global__ void __launch_bounds__(32 * WARPS, MIN_BLOCKS) attn_bf16_fwd_d##D##_##NAME(       \
        const bf16* q, const bf16* k, const bf16* v, bf16* out, float* lse, int L, int S, float scale,      \
        int causal, int H, int group, LAYOUT_PARAMS(q), LAYOUT_PARAMS(k), LAYOUT_PARAMS(v),                 \
        LAYOUT_PARAMS(o)) {                                                                                \
        attn_bf16_fwd<D, WARPS, M_TILES, Q_IN_REGISTERS>(q, k, v, out, lse, L, S, scale, causal, H, group,  \
                                                         LAYOUT(q), LAYOUT(k), LAYOUT(v), LAYOUT(o));      \
    }
#define ATTN_BF16_DKV(D, NAME, WARPS, BM, K_IN_REGISTERS, MIN_BLOCKS)                                      \
    extern "C" __global__ void __launch_bounds__(32 * WARPS, MIN_BLOCKS) attn_bf16_bwd_dkv_d##D##_##NAME(   \
        const bf16* q, const bf16* k, const bf16* v, const bf16* dout, const float* lse2,                   \
        const float* delta, bf16* dk, bf16* dv, int L, int S, float scale, int causal, int H, int group,    \
        LAYOUT_PARAMS(q), LAYOUT_PARAMS(k), LAYOUT_PARAMS(v), LAYOUT_PARAMS(dO), LAYOUT_PARAMS(dk),         \
        LAYOUT_PARAMS(dv)) {                                                                               \
        attn_bf16_bwd_dkv<D, WARPS, BM, K_IN_REGISTERS>(q, k, v, dout, lse2, delta, dk, dv, L, S, scale,    \
                                                        causal, H, group, LAYOUT(q), LAYOUT(k), LAYOUT(v),        \
                                                        LAYOUT(dO), LAYOUT(dk), LAYOUT(dv));               \
    }
#define ATTN_BF16_DQ(D, NAME, WARPS, MIN_BLOCKS)                                                            \
    extern "C" __global__ void __launch_bounds__(32 * WARPS, MIN_BLOCKS) attn_bf16_bwd_dq_d##D##_##NAME(    \
        const bf16* q, const bf16* k, const bf16* v, const bf16* out, const bf16* dout, const float* lse,   \
        float* lse2, float* delta, bf16* dq, int L, int S, float scale, int causal, int H, int group,       \
        LAYOUT_PARAMS(q), LAYOUT_PARAMS(k), LAYOUT_PARAMS(v), LAYOUT_PARAMS(o), LAYOUT_PARAMS(dO),          \
        LAYOUT_PARAMS(dq)) {                                                                               \
        attn_bf16_bwd_dq<D, WARPS>(q, k, v, out, dout, lse, lse2, delta, dq, L, S, scale, causal, H, group, \
                                   LAYOUT(q), LAYOUT(k), LAYOUT(v), LAYOUT(o), LAYOUT(dO), LAYOUT(dq));    \
    }

ATTN_BF16_FWD(64, w4m2, 4, 2, true, 1)
ATTN_BF16_FWD(128, w4m1, 4, 1, true, 1)
ATTN_BF16_FWD(128, w4m2s, 4, 2, false, 1)
ATTN_BF16_DKV(64, w4q64, 4, 64, true, 1)
ATTN_BF16_DKV(128, w4q32, 4, 32, false, 1)
ATTN_BF16_DQ(64, w4b3, 4, 3)
ATTN_BF16_DQ(64, w4, 4, 1)
ATTN_BF16_DQ(128, w4, 4, 1)
