// Multi-tensor AdamW (decoupled weight decay, PyTorch's formulation) over any number of float32
// parameters with float32 or bf16 gradients, with an optional global-norm gradient clip, in at most
// two launches for all tensors.
//
// The host builds (once per set of buffers, then cached) a tensor table (int64 [T, 8]: param, grad,
// exp_avg, exp_avg_sq pointers, numel, flags, weight decay as float bits, unused) and a tile table
// (int32 [K, 2]: tensor, tile index); every tile is ADAMW_TILE = 2048 elements (the tensor's last one
// shorter). Both kernels run a persistent grid of G blocks x 256 threads (G = resident blocks of the
// whole chip) and block b takes tiles b, b + G, b + 2G, ...: small tiles keep the blocks' shares within
// one tile of each other, and the fixed assignment keeps sums reproducible.
//
// adamw_sqnorm:  partial[b] = sum of g^2 over block b's tiles (float). Bytes: read the gradients once.
// adamw_update:  with partial != nullptr each block first sums the G partials in one fixed order
//                (every block gets the identical norm; block 0 stores it),
//                clip = min(1, max_norm / (norm + 1e-6)); then per element
//                  g = clip * grad;  p -= lr * wd * p;  m = b1 m + (1-b1) g;  v = b2 v + (1-b2) g^2;
//                  p -= (lr / bc1) * m / (sqrt(v) / sqrt(bc2) + eps).
//                With gscale != nullptr (a 0-d device scalar of the gradients' dtype, float32 or bf16; the
//                compiler hands the global-norm clip's coefficient over instead of scaling every gradient in
//                place first) g = grad * c rounded to the gradient's dtype, exactly what scale_multi_tensor
//                stores (__fmul_rn: one rounding, never contracted into the update's FMAs), so the update sees
//                the bits it would read after the in-place scale, and that kernel's read and write of every
//                gradient (8 bytes per float32 element) are gone.
//                lr, bc1 = 1 - b1^t and sqrt(bc2) = sqrt(1 - b2^t) change every step, so they are read from
//                device memory (scalars: float64 [3], written by the host before the launch) when the kernel
//                runs, not passed as launch parameters: a CUDA graph captured once replays every step.
//                Each thread issues all its loads of a tile (2 float4 from each of p, g, m, v: 128 bytes)
//                before the first use. Tensors whose four pointers are 16-byte aligned (flag ALIGNED) use
//                16-byte accesses (8-byte for bf16 grads); others, and the n % 4 tail, go element-wise.
//                Bytes: read p, g, m, v and write p, m, v: 28 bytes per float32 parameter (26 with bf16
//                gradients). FLOPs ~ 15 per element.
#include "common.cuh"

#define ADAMW_TILE 2048
#define ADAMW_THREADS 256
#define ADAMW_VPT (ADAMW_TILE / (4 * ADAMW_THREADS))  // float4 vectors per thread per tile: 2
#define ADAMW_GRAD_BF16 1
#define ADAMW_ALIGNED 2

struct AdamwTensor {
    float* p;
    const void* g;
    float* m;
    float* v;
    long long numel;
    int flags;
    float wd;
};

__device__ __forceinline__ AdamwTensor adamw_tensor(const long long* __restrict__ table, int t) {
    const long long* e = table + 8LL * t;
    AdamwTensor r;
    r.p = reinterpret_cast<float*>(e[0]);
    r.g = reinterpret_cast<const void*>(e[1]);
    r.m = reinterpret_cast<float*>(e[2]);
    r.v = reinterpret_cast<float*>(e[3]);
    r.numel = e[4];
    r.flags = (int)e[5];
    r.wd = __int_as_float((int)e[6]);
    return r;
}

__device__ __forceinline__ float grad_at(const AdamwTensor& t, long long j) {
    if (t.flags & ADAMW_GRAD_BF16) return to_float(reinterpret_cast<const bf16*>(t.g)[j]);
    return reinterpret_cast<const float*>(t.g)[j];
}

// Four gradients at element j (j % 4 == 0, pointer aligned): one 16-byte load, or 8 bytes for bf16.
__device__ __forceinline__ void grad4_at(const AdamwTensor& t, long long j, float (&o)[4]) {
    if (t.flags & ADAMW_GRAD_BF16) {
        const uint2 u = *reinterpret_cast<const uint2*>(reinterpret_cast<const bf16*>(t.g) + j);
        unpack_bf16x2(u.x, o[0], o[1]);
        unpack_bf16x2(u.y, o[2], o[3]);
    } else {
        load_vec<4>(reinterpret_cast<const float*>(t.g) + j, o);
    }
}

// Elements of tile `tile` of t: [start, start + n).
__device__ __forceinline__ long long adamw_tile_len(const AdamwTensor& t, long long start) {
    const long long n = t.numel - start;
    return n < ADAMW_TILE ? n : ADAMW_TILE;
}

extern "C" __global__ void __launch_bounds__(ADAMW_THREADS)
adamw_sqnorm(const long long* __restrict__ table, const int* __restrict__ tiles, int ntiles,
             float* __restrict__ partial) {
    __shared__ float red[66];
    float s = 0.f;
    for (int k = blockIdx.x; k < ntiles; k += gridDim.x) {
        const AdamwTensor t = adamw_tensor(table, tiles[2 * k]);
        const long long start = (long long)tiles[2 * k + 1] * ADAMW_TILE;
        const long long n = adamw_tile_len(t, start);
        if ((t.flags & ADAMW_ALIGNED) && n == ADAMW_TILE) {
            float g[ADAMW_VPT][4];
#pragma unroll
            for (int u = 0; u < ADAMW_VPT; ++u) grad4_at(t, start + 4 * (threadIdx.x + u * ADAMW_THREADS), g[u]);
#pragma unroll
            for (int u = 0; u < ADAMW_VPT; ++u)
#pragma unroll
                for (int e = 0; e < 4; ++e) s += g[u][e] * g[u][e];
        } else {
            for (long long j = threadIdx.x; j < n; j += ADAMW_THREADS) {
                const float g = grad_at(t, start + j);
                s += g * g;
            }
        }
    }
    s = block_sum(s, red);
    if (threadIdx.x == 0) partial[blockIdx.x] = s;
}

// The gradient the update uses: grad * c as one rounded multiply (__fmul_rn, so no FMA takes the product in
// unrounded). round_to_grad (a gscale operand): rounded again to the gradient's own dtype, as the in-place
// scale stores it; c = 1 and a clip factor need no second rounding (the first is exact or the clip's own).
__device__ __forceinline__ float grad_in(float g, float c, bool round_to_grad, int flags) {
    const float s = __fmul_rn(g, c);
    return (round_to_grad && (flags & ADAMW_GRAD_BF16)) ? to_float(from_float<bf16>(s)) : s;
}

__device__ __forceinline__ void adamw_step(float& p, float& m, float& v, float g, float wd, float lr, float beta1,
                                           float beta2, float eps, float step_size, float bc2_sqrt) {
    p -= lr * wd * p;
    m = beta1 * m + (1.f - beta1) * g;
    v = beta2 * v + (1.f - beta2) * g * g;
    p -= step_size * m / (sqrtf(v) / bc2_sqrt + eps);
}

extern "C" __global__ void __launch_bounds__(ADAMW_THREADS)
adamw_update(const long long* __restrict__ table, const int* __restrict__ tiles, int ntiles,
             const float* __restrict__ partial, int npartial, float max_norm, const double* __restrict__ scalars,
             float beta1, float beta2, float eps, float* __restrict__ norm_out, const void* __restrict__ gscale,
             int gscale_bf16) {
    __shared__ float red[66];
    // Rounded to float as the host rounded them for launch parameters (round to nearest even): same bits.
    const float lr = (float)scalars[0];
    const float bc1 = (float)scalars[1];
    const float bc2_sqrt = (float)scalars[2];
    float clip = 1.f;
    if (partial != nullptr) {
        float s = 0.f;
        for (int k = threadIdx.x; k < npartial; k += ADAMW_THREADS) s += partial[k];
        const float norm = sqrtf(block_sum(s, red));
        const float c = max_norm / (norm + 1e-6f);
        clip = c < 1.f ? c : (c != c ? c : 1.f);  // a NaN norm poisons the step visibly, as PyTorch's clip
        if (blockIdx.x == 0 && threadIdx.x == 0) norm_out[0] = norm;
    }
    const bool scaled = gscale != nullptr;  // the host never passes both partial and gscale
    if (scaled) {
        clip = gscale_bf16 ? to_float(*reinterpret_cast<const bf16*>(gscale)) : *reinterpret_cast<const float*>(gscale);
    }
    const float step_size = lr / bc1;
    for (int k = blockIdx.x; k < ntiles; k += gridDim.x) {
        const AdamwTensor t = adamw_tensor(table, tiles[2 * k]);
        const long long start = (long long)tiles[2 * k + 1] * ADAMW_TILE;
        const long long n = adamw_tile_len(t, start);
        long long done = 0;
        if (t.flags & ADAMW_ALIGNED) {
            // Vector u of this thread covers elements [4 i, 4 i + 4) of the tile, i = tid + u * THREADS.
            float p[ADAMW_VPT][4], g[ADAMW_VPT][4], m[ADAMW_VPT][4], v[ADAMW_VPT][4];
            const long long nv = n >> 2;
#pragma unroll
            for (int u = 0; u < ADAMW_VPT; ++u) {
                const long long i = threadIdx.x + u * ADAMW_THREADS;
                if (i < nv) {
                    const long long j = start + 4 * i;
                    load_vec<4>(t.p + j, p[u]);
                    grad4_at(t, j, g[u]);
                    load_vec<4>(t.m + j, m[u]);
                    load_vec<4>(t.v + j, v[u]);
                }
            }
#pragma unroll
            for (int u = 0; u < ADAMW_VPT; ++u) {
                const long long i = threadIdx.x + u * ADAMW_THREADS;
                if (i < nv) {
                    const long long j = start + 4 * i;
#pragma unroll
                    for (int e = 0; e < 4; ++e)
                        adamw_step(p[u][e], m[u][e], v[u][e], grad_in(g[u][e], clip, scaled, t.flags), t.wd, lr, beta1,
                                   beta2, eps, step_size, bc2_sqrt);
                    store_vec<4>(t.p + j, p[u]);
                    store_vec<4>(t.m + j, m[u]);
                    store_vec<4>(t.v + j, v[u]);
                }
            }
            done = nv << 2;
        }
        for (long long i = done + threadIdx.x; i < n; i += ADAMW_THREADS) {
            const long long j = start + i;
            float p = t.p[j], m = t.m[j], v = t.v[j];
            adamw_step(p, m, v, grad_in(grad_at(t, j), clip, scaled, t.flags), t.wd, lr, beta1, beta2, eps, step_size,
                       bc2_sqrt);
            t.p[j] = p;
            t.m[j] = m;
            t.v[j] = v;
        }
    }
}
