// Flash attention (online softmax; no L x S matrix in memory), forward and backward, causal
// (top-left aligned: query i sees keys 0..i) or not, head dim D = 64 or 128, float32 and bf16
// storage with float math. A first, correctness-first version: SIMT FFMA tiles, no tensor cores.
//
// Layout: q [BH, L, D], k and v [BH, S, D], out [BH, L, D], lse [BH, L] float32 (natural log of
// the row's sum of exp(scale * q.k)), all contiguous. Tiles: BM = 64 queries x BN = 64 keys per step,
// 128 threads as 16 x 8: thread (ty, tx) owns rows ty*4..ty*4+3 and columns tx + 8j, so a row's
// max and sum combine over 8 neighbouring lanes with shuffles. Shared rows are padded by one float
// so that column reads hit distinct banks. Dynamic shared memory (the host raises the limit):
//   forward: (3*64*(D+1) + 64*65) floats;  dq: (4*64*(D+1) + 64*65);  dk/dv: (4*64*(D+1) + 2*64*65 + 128).
//
// attn_fwd_*:    grid (ceil(L/64), BH). Per key tile: S = q k^T * scale (in log2 units), running
//                max m and sum l per row, O = O * 2^(m_old - m_new) + P V; finally out = O / l and
//                lse = ln2 * (m + log2 l). FLOPs 4*BH*L*S*D (half when causal); bytes: read q once,
//                k and v once per query tile, write out and lse.
// attn_bwd_dq_*: grid (ceil(L/64), BH). Recomputes P = exp(scale q.k - lse) per key tile,
//                dS = P * (dO.v - Delta) with Delta = rowsum(dO * out) (precomputed, float32),
//                dq = scale * dS k.
// attn_bwd_dkv_*: grid (ceil(S/64), BH), one key tile per block looping over query tiles:
//                dv = P^T dO, dk = scale * dS^T q. Two kernels instead of atomics: deterministic.
#include "common.cuh"

#define ATT_BM 64
#define ATT_BN 64
#define ATT_THREADS 128
#define LOG2E 1.4426950408889634f
#define LN2 0.6931471805599453f

template <typename T, int D>
__device__ __forceinline__ void load_tile(float* __restrict__ dst, const T* __restrict__ src, int row0, int nrows,
                                          int rows_valid) {
    // dst[r][d] (stride D+1) = src[row0 + r][d], zero for rows at or past rows_valid.
    for (int e = threadIdx.x; e < nrows * D; e += ATT_THREADS) {
        const int r = e / D, d = e - r * D;
        const int gr = row0 + r;
        dst[r * (D + 1) + d] = gr < rows_valid ? to_float(src[(long long)gr * D + d]) : 0.f;
    }
}

template <typename T, int D>
__device__ __forceinline__ void attn_fwd(const T* __restrict__ q, const T* __restrict__ k, const T* __restrict__ v,
                                         T* __restrict__ out, float* __restrict__ lse, int L, int S, float scale,
                                         int causal) {
    extern __shared__ float smem[];
    float* sQ = smem;
    float* sK = sQ + ATT_BM * (D + 1);
    float* sV = sK + ATT_BN * (D + 1);
    float* sP = sV + ATT_BN * (D + 1);
    constexpr int DJ = D / 8;
    const int bh = blockIdx.y, q0 = blockIdx.x * ATT_BM;
    const int ty = threadIdx.x >> 3, tx = threadIdx.x & 7;
    const T* qb = q + (long long)bh * L * D;
    const T* kb = k + (long long)bh * S * D;
    const T* vb = v + (long long)bh * S * D;
    const float sl2 = scale * LOG2E;

    load_tile<T, D>(sQ, qb, q0, ATT_BM, L);
    float m[4], l[4], o[4][DJ];
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        m[i] = -BT_INF;
        l[i] = 0.f;
#pragma unroll
        for (int jj = 0; jj < DJ; ++jj) o[i][jj] = 0.f;
    }
    const int kend = causal ? min(S, q0 + ATT_BM) : S;
    for (int k0 = 0; k0 < kend; k0 += ATT_BN) {
        __syncthreads();  // the previous step is done with sK, sV, sP (and sQ is loaded)
        load_tile<T, D>(sK, kb, k0, ATT_BN, S);
        load_tile<T, D>(sV, vb, k0, ATT_BN, S);
        __syncthreads();
        float s[4][8];
#pragma unroll
        for (int i = 0; i < 4; ++i) {
#pragma unroll
            for (int j = 0; j < 8; ++j) s[i][j] = 0.f;
        }
        for (int d = 0; d < D; ++d) {
            float qv[4], kv[8];
#pragma unroll
            for (int i = 0; i < 4; ++i) qv[i] = sQ[(ty * 4 + i) * (D + 1) + d];
#pragma unroll
            for (int j = 0; j < 8; ++j) kv[j] = sK[(tx + 8 * j) * (D + 1) + d];
#pragma unroll
            for (int i = 0; i < 4; ++i) {
#pragma unroll
                for (int j = 0; j < 8; ++j) s[i][j] += qv[i] * kv[j];
            }
        }
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            const int row = q0 + ty * 4 + i;
            float mx = -BT_INF;
#pragma unroll
            for (int j = 0; j < 8; ++j) {
                const int col = k0 + tx + 8 * j;
                const bool masked = col >= S || (causal && col > row);
                s[i][j] = masked ? -BT_INF : s[i][j] * sl2;
                mx = fmaxf(mx, s[i][j]);
            }
            mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
            mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
            mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 4));
            const float m_new = fmaxf(m[i], mx);
            const bool none = m_new == -BT_INF;  // nothing visible yet in this row
            const float alpha = none ? 1.f : exp2f(m[i] - m_new);
            float rs = 0.f;
#pragma unroll
            for (int j = 0; j < 8; ++j) {
                const float p = none ? 0.f : exp2f(s[i][j] - m_new);
                sP[(ty * 4 + i) * (ATT_BN + 1) + tx + 8 * j] = p;
                rs += p;
            }
            rs += __shfl_xor_sync(0xffffffffu, rs, 1);
            rs += __shfl_xor_sync(0xffffffffu, rs, 2);
            rs += __shfl_xor_sync(0xffffffffu, rs, 4);
            l[i] = l[i] * alpha + rs;
            m[i] = m_new;
#pragma unroll
            for (int jj = 0; jj < DJ; ++jj) o[i][jj] *= alpha;
        }
        __syncthreads();
        for (int j = 0; j < ATT_BN; ++j) {
            float pv[4];
#pragma unroll
            for (int i = 0; i < 4; ++i) pv[i] = sP[(ty * 4 + i) * (ATT_BN + 1) + j];
#pragma unroll
            for (int jj = 0; jj < DJ; ++jj) {
                const float vv = sV[j * (D + 1) + tx + 8 * jj];
#pragma unroll
                for (int i = 0; i < 4; ++i) o[i][jj] += pv[i] * vv;
            }
        }
    }
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        const int row = q0 + ty * 4 + i;
        if (row < L) {
            const float inv = 1.f / l[i];
            T* orow = out + ((long long)bh * L + row) * D;
#pragma unroll
            for (int jj = 0; jj < DJ; ++jj) orow[tx + 8 * jj] = from_float<T>(o[i][jj] * inv);
            if (tx == 0) lse[(long long)bh * L + row] = (m[i] + log2f(l[i])) * LN2;
        }
    }
}

template <typename T, int D>
__device__ __forceinline__ void attn_bwd_dq(const T* __restrict__ q, const T* __restrict__ k,
                                            const T* __restrict__ v, const T* __restrict__ dout,
                                            const float* __restrict__ lse, const float* __restrict__ delta,
                                            T* __restrict__ dq, int L, int S, float scale, int causal) {
    extern __shared__ float smem[];
    float* sQ = smem;
    float* sdO = sQ + ATT_BM * (D + 1);
    float* sK = sdO + ATT_BM * (D + 1);
    float* sV = sK + ATT_BN * (D + 1);
    float* sS = sV + ATT_BN * (D + 1);
    constexpr int DJ = D / 8;
    const int bh = blockIdx.y, q0 = blockIdx.x * ATT_BM;
    const int ty = threadIdx.x >> 3, tx = threadIdx.x & 7;
    const float sl2 = scale * LOG2E;
    load_tile<T, D>(sQ, q + (long long)bh * L * D, q0, ATT_BM, L);
    load_tile<T, D>(sdO, dout + (long long)bh * L * D, q0, ATT_BM, L);
    float lse2[4], dlt[4], acc[4][DJ];
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        const int row = q0 + ty * 4 + i;
        lse2[i] = row < L ? lse[(long long)bh * L + row] * LOG2E : 0.f;
        dlt[i] = row < L ? delta[(long long)bh * L + row] : 0.f;
#pragma unroll
        for (int jj = 0; jj < DJ; ++jj) acc[i][jj] = 0.f;
    }
    const T* kb = k + (long long)bh * S * D;
    const T* vb = v + (long long)bh * S * D;
    const int kend = causal ? min(S, q0 + ATT_BM) : S;
    for (int k0 = 0; k0 < kend; k0 += ATT_BN) {
        __syncthreads();
        load_tile<T, D>(sK, kb, k0, ATT_BN, S);
        load_tile<T, D>(sV, vb, k0, ATT_BN, S);
        __syncthreads();
        float s[4][8], dp[4][8];
#pragma unroll
        for (int i = 0; i < 4; ++i) {
#pragma unroll
            for (int j = 0; j < 8; ++j) {
                s[i][j] = 0.f;
                dp[i][j] = 0.f;
            }
        }
        for (int d = 0; d < D; ++d) {
            float qv[4], ov[4], kv[8], vv[8];
#pragma unroll
            for (int i = 0; i < 4; ++i) {
                qv[i] = sQ[(ty * 4 + i) * (D + 1) + d];
                ov[i] = sdO[(ty * 4 + i) * (D + 1) + d];
            }
#pragma unroll
            for (int j = 0; j < 8; ++j) {
                kv[j] = sK[(tx + 8 * j) * (D + 1) + d];
                vv[j] = sV[(tx + 8 * j) * (D + 1) + d];
            }
#pragma unroll
            for (int i = 0; i < 4; ++i) {
#pragma unroll
                for (int j = 0; j < 8; ++j) {
                    s[i][j] += qv[i] * kv[j];
                    dp[i][j] += ov[i] * vv[j];
                }
            }
        }
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            const int row = q0 + ty * 4 + i;
#pragma unroll
            for (int j = 0; j < 8; ++j) {
                const int col = k0 + tx + 8 * j;
                const bool masked = col >= S || (causal && col > row);
                const float p = masked ? 0.f : exp2f(s[i][j] * sl2 - lse2[i]);
                sS[(ty * 4 + i) * (ATT_BN + 1) + tx + 8 * j] = p * (dp[i][j] - dlt[i]);
            }
        }
        __syncthreads();
        for (int j = 0; j < ATT_BN; ++j) {
            float dsv[4];
#pragma unroll
            for (int i = 0; i < 4; ++i) dsv[i] = sS[(ty * 4 + i) * (ATT_BN + 1) + j];
#pragma unroll
            for (int jj = 0; jj < DJ; ++jj) {
                const float kv = sK[j * (D + 1) + tx + 8 * jj];
#pragma unroll
                for (int i = 0; i < 4; ++i) acc[i][jj] += dsv[i] * kv;
            }
        }
    }
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        const int row = q0 + ty * 4 + i;
        if (row < L) {
            T* r = dq + ((long long)bh * L + row) * D;
#pragma unroll
            for (int jj = 0; jj < DJ; ++jj) r[tx + 8 * jj] = from_float<T>(acc[i][jj] * scale);
        }
    }
}

template <typename T, int D>
__device__ __forceinline__ void attn_bwd_dkv(const T* __restrict__ q, const T* __restrict__ k,
                                             const T* __restrict__ v, const T* __restrict__ dout,
                                             const float* __restrict__ lse, const float* __restrict__ delta,
                                             T* __restrict__ dk, T* __restrict__ dv, int L, int S, float scale,
                                             int causal) {
    extern __shared__ float smem[];
    float* sK = smem;
    float* sV = sK + ATT_BN * (D + 1);
    float* sQ = sV + ATT_BN * (D + 1);
    float* sdO = sQ + ATT_BM * (D + 1);
    float* sP = sdO + ATT_BM * (D + 1);   // [key][query], stride BM+1
    float* sdS = sP + ATT_BN * (ATT_BM + 1);
    float* sL = sdS + ATT_BN * (ATT_BM + 1);  // per query row of the tile: lse in log2 units
    float* sD = sL + ATT_BM;                   // per query row: Delta
    constexpr int DJ = D / 8;
    const int bh = blockIdx.y, k0 = blockIdx.x * ATT_BN;
    const int ty = threadIdx.x >> 3, tx = threadIdx.x & 7;
    const float sl2 = scale * LOG2E;
    load_tile<T, D>(sK, k + (long long)bh * S * D, k0, ATT_BN, S);
    load_tile<T, D>(sV, v + (long long)bh * S * D, k0, ATT_BN, S);
    float ak[4][DJ], av[4][DJ];
#pragma unroll
    for (int i = 0; i < 4; ++i) {
#pragma unroll
        for (int jj = 0; jj < DJ; ++jj) {
            ak[i][jj] = 0.f;
            av[i][jj] = 0.f;
        }
    }
    const T* qb = q + (long long)bh * L * D;
    const T* ob = dout + (long long)bh * L * D;
    const int qstart = causal ? (k0 / ATT_BM) * ATT_BM : 0;  // earlier queries see none of these keys
    for (int q0 = qstart; q0 < L; q0 += ATT_BM) {
        __syncthreads();
        load_tile<T, D>(sQ, qb, q0, ATT_BM, L);
        load_tile<T, D>(sdO, ob, q0, ATT_BM, L);
        for (int r = threadIdx.x; r < ATT_BM; r += ATT_THREADS) {
            const int row = q0 + r;
            sL[r] = row < L ? lse[(long long)bh * L + row] * LOG2E : BT_INF;  // +inf: p = 0
            sD[r] = row < L ? delta[(long long)bh * L + row] : 0.f;
        }
        __syncthreads();
        float st[4][8];
#pragma unroll
        for (int i = 0; i < 4; ++i) {
#pragma unroll
            for (int j = 0; j < 8; ++j) st[i][j] = 0.f;
        }
        for (int d = 0; d < D; ++d) {
            float kv[4], qv[8];
#pragma unroll
            for (int i = 0; i < 4; ++i) kv[i] = sK[(ty * 4 + i) * (D + 1) + d];
#pragma unroll
            for (int j = 0; j < 8; ++j) qv[j] = sQ[(tx + 8 * j) * (D + 1) + d];
#pragma unroll
            for (int i = 0; i < 4; ++i) {
#pragma unroll
                for (int j = 0; j < 8; ++j) st[i][j] += kv[i] * qv[j];
            }
        }
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            const int key = k0 + ty * 4 + i;
#pragma unroll
            for (int j = 0; j < 8; ++j) {
                const int qr = q0 + tx + 8 * j;
                const bool masked = key >= S || qr >= L || (causal && key > qr);
                st[i][j] = masked ? 0.f : exp2f(st[i][j] * sl2 - sL[tx + 8 * j]);
                sP[(ty * 4 + i) * (ATT_BM + 1) + tx + 8 * j] = st[i][j];
            }
        }
        // dP^T = v dO^T, reusing st's registers for P and a fresh accumulator for dP^T.
        float dpt[4][8];
#pragma unroll
        for (int i = 0; i < 4; ++i) {
#pragma unroll
            for (int j = 0; j < 8; ++j) dpt[i][j] = 0.f;
        }
        for (int d = 0; d < D; ++d) {
            float vv[4], ov[8];
#pragma unroll
            for (int i = 0; i < 4; ++i) vv[i] = sV[(ty * 4 + i) * (D + 1) + d];
#pragma unroll
            for (int j = 0; j < 8; ++j) ov[j] = sdO[(tx + 8 * j) * (D + 1) + d];
#pragma unroll
            for (int i = 0; i < 4; ++i) {
#pragma unroll
                for (int j = 0; j < 8; ++j) dpt[i][j] += vv[i] * ov[j];
            }
        }
#pragma unroll
        for (int i = 0; i < 4; ++i) {
#pragma unroll
            for (int j = 0; j < 8; ++j) {
                sdS[(ty * 4 + i) * (ATT_BM + 1) + tx + 8 * j] = st[i][j] * (dpt[i][j] - sD[tx + 8 * j]);
            }
        }
        __syncthreads();
        for (int c = 0; c < ATT_BM; ++c) {
            float pv[4], dsv[4];
#pragma unroll
            for (int i = 0; i < 4; ++i) {
                pv[i] = sP[(ty * 4 + i) * (ATT_BM + 1) + c];
                dsv[i] = sdS[(ty * 4 + i) * (ATT_BM + 1) + c];
            }
#pragma unroll
            for (int jj = 0; jj < DJ; ++jj) {
                const float ov = sdO[c * (D + 1) + tx + 8 * jj];
                const float qv = sQ[c * (D + 1) + tx + 8 * jj];
#pragma unroll
                for (int i = 0; i < 4; ++i) {
                    av[i][jj] += pv[i] * ov;
                    ak[i][jj] += dsv[i] * qv;
                }
            }
        }
    }
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        const int key = k0 + ty * 4 + i;
        if (key < S) {
            T* rk = dk + ((long long)bh * S + key) * D;
            T* rv = dv + ((long long)bh * S + key) * D;
#pragma unroll
            for (int jj = 0; jj < DJ; ++jj) {
                rk[tx + 8 * jj] = from_float<T>(ak[i][jj] * scale);
                rv[tx + 8 * jj] = from_float<T>(av[i][jj]);
            }
        }
    }
}

#define ATTN_KERNELS(SUFFIX, T, D)                                                                          \
    extern "C" __global__ void __launch_bounds__(ATT_THREADS) attn_fwd_##SUFFIX(                           \
        const T* q, const T* k, const T* v, T* out, float* lse, int L, int S, float scale, int causal) {    \
        attn_fwd<T, D>(q, k, v, out, lse, L, S, scale, causal);                                             \
    }                                                                                                       \
    extern "C" __global__ void __launch_bounds__(ATT_THREADS) attn_bwd_dq_##SUFFIX(                        \
        const T* q, const T* k, const T* v, const T* dout, const float* lse, const float* delta, T* dq, int L, \
        int S, float scale, int causal) {                                                                   \
        attn_bwd_dq<T, D>(q, k, v, dout, lse, delta, dq, L, S, scale, causal);                              \
    }                                                                                                       \
    extern "C" __global__ void __launch_bounds__(ATT_THREADS) attn_bwd_dkv_##SUFFIX(                       \
        const T* q, const T* k, const T* v, const T* dout, const float* lse, const float* delta, T* dk, T* dv, \
        int L, int S, float scale, int causal) {                                                            \
        attn_bwd_dkv<T, D>(q, k, v, dout, lse, delta, dk, dv, L, S, scale, causal);                         \
    }
ATTN_KERNELS(f32_d64, float, 64)
ATTN_KERNELS(f32_d128, float, 128)
ATTN_KERNELS(bf16_d64, bf16, 64)
ATTN_KERNELS(bf16_d128, bf16, 128)
