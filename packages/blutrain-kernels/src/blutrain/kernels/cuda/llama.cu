// The kernels of Llama-style blocks, float32 and bf16 (bf16 storage, float math): RMSNorm forward (with the
// residual add folded in) and backward, rotary embeddings of q and k in one launch, SwiGLU forward and backward.
//
// rmsnorm_fwd_*:     grid N blocks (one per row of [N, C]), block 32..1024 threads (a multiple of 32).
//                    y = x * rstd * w, rstd = 1 / sqrt(mean(x^2) + eps), written float32 [N] (the statistic
//                    stays float32 for bf16 input). w nullable. Bytes: read N*C (+C), write N*C (+N). FLOPs ~4 N*C.
// rmsnorm_fwd_f32_to_bf16: float32 x and w, a bf16 y rounded once (the compiler's layernorm-cast pass).
// rmsnorm_fwd_res_{x}_{y}: the row normalized is s = r + x (float32 r and w; x float32 or bf16; y float32 or
//                    bf16): a pre-norm block's residual add folded into the next norm (layernorm-residual). Each s is __fadd_rn(r, x) (one rounding, as
//                    the separate float32 add) and is written float32 (the stream goes on from it).
//                    Bytes: read N*C*(4 or 2) + N*C*4 (+C*4), write N*C*4 + N*C*(4 or 2) (+N*4).
// rmsnorm_bwd_*:     grid G blocks striding over rows (row b, b + G, ...), block 32..1024 threads.
//                    dx = rstd * (g*w - xhat * mean(g*w*xhat)), xhat = x * rstd; one block sum per row. Each
//                    thread keeps the sums of g*xhat of its columns over the block's rows and writes them to
//                    partial[G, C] (float32), which the host sums over G in a fixed order (dw; deterministic).
//                    Bytes: read 2*N*C (+C), write N*C + G*C*4. The row's second read hits L1/L2.
// rope_*:            q [B, T, H, D] and k [B, T, Hk, D] contiguous, cos/sin float32 [T, D/2]: each thread rotates
//                    one pair (i, i + D/2) of one head, q's heads then k's in one 1-D grid-stride launch:
//                    (x1 cos - x2 sin, x2 cos + x1 sin), or with inverse = 1 the opposite angle (the backward:
//                    the gradients rotated back). Outputs are new buffers. Bytes: read/write (H + Hk)*B*T*D
//                    elements each (+ 2*T*D/2*4 per head, from L2). FLOPs 6 per pair.
// swiglu_fwd_*:      y = silu(gate) * up, n contiguous elements, 1-D grid-stride. Bytes: read 2n, write n.
// swiglu_bwd_*:      d gate = g * up * s * (1 + gate * (1 - s)), d up = g * gate * s, s = sigmoid(gate) recomputed;
//                    either output nullable. Bytes: read 3n, write 2n. FLOPs ~10 per element (one expf).
#include "common.cuh"

// TX: x's storage, TW: w's, TY: y's (float32 x and w with a bf16 y: the compiler's layernorm-cast pass; the
// residual kernels: float32 or bf16 x, float32 r and w, float32 or bf16 y).
template <typename TX, typename TW, typename TY>
__device__ __forceinline__ void rmsnorm_fwd(const TX* __restrict__ x, const float* __restrict__ r,
                                            const TW* __restrict__ w, TY* __restrict__ y, float* __restrict__ s,
                                            float* __restrict__ rstd, int C, float eps) {
    __shared__ float shm[33];
    const long long row = blockIdx.x;
    const TX* xr = x + row * C;
    float ss = 0.f;
    for (int c = threadIdx.x; c < C; c += blockDim.x) {
        float v = to_float(xr[c]);
        if (r != nullptr) {
            v = __fadd_rn(r[row * C + c], v);
            s[row * C + c] = v;
        }
        ss += v * v;
    }
    const float inv = rsqrtf(block_sum(ss, shm) / (float)C + eps);
    if (threadIdx.x == 0) rstd[row] = inv;
    for (int c = threadIdx.x; c < C; c += blockDim.x) {
        const float v = r != nullptr ? s[row * C + c] : to_float(xr[c]);  // the thread's own s: no barrier
        const float o = v * inv * (w != nullptr ? to_float(w[c]) : 1.f);
        y[row * C + c] = from_float<TY>(o);
    }
}

template <typename T>
__device__ __forceinline__ void rmsnorm_bwd(const T* __restrict__ g, const T* __restrict__ x,
                                            const T* __restrict__ w, const float* __restrict__ rstd,
                                            T* __restrict__ dx, float* __restrict__ partial, long long N, int C,
                                            int need_w) {
    __shared__ float shm[33];
    for (int c = threadIdx.x; c < C; c += blockDim.x) partial[(long long)blockIdx.x * C + c] = 0.f;
    for (long long row = blockIdx.x; row < N; row += gridDim.x) {
        const float inv = rstd[row];
        float dot = 0.f;  // sum of g*w*xhat over the row
        for (int c = threadIdx.x; c < C; c += blockDim.x) {
            const float gw = to_float(g[row * C + c]) * (w != nullptr ? to_float(w[c]) : 1.f);
            dot += gw * to_float(x[row * C + c]) * inv;
        }
        const float mean_dot = block_sum(dot, shm) / (float)C;
        for (int c = threadIdx.x; c < C; c += blockDim.x) {
            const float gv = to_float(g[row * C + c]);
            const float xhat = to_float(x[row * C + c]) * inv;
            const float gw = gv * (w != nullptr ? to_float(w[c]) : 1.f);
            dx[row * C + c] = from_float<T>(inv * (gw - xhat * mean_dot));
            if (need_w) partial[(long long)blockIdx.x * C + c] += gv * xhat;  // only this thread touches column c
        }
    }
}

template <typename T>
__device__ __forceinline__ void rope_pairs(const T* __restrict__ x, T* __restrict__ out, const float* __restrict__ cos,
                                           const float* __restrict__ sin, long long pairs, int T_, int H, int D,
                                           int inverse, long long i) {
    const int half = D / 2;
    const int f = (int)(i % half);           // frequency
    const long long head = i / half;         // (b, t, h) flattened
    const int t = (int)((head / H) % T_);
    const long long base = head * D + f;
    const float c = cos[(long long)t * half + f];
    const float s = inverse ? -sin[(long long)t * half + f] : sin[(long long)t * half + f];
    const float x1 = to_float(x[base]), x2 = to_float(x[base + half]);
    out[base] = from_float<T>(x1 * c - x2 * s);
    out[base + half] = from_float<T>(x2 * c + x1 * s);
}

template <typename T>
__device__ __forceinline__ void rope(const T* __restrict__ q, const T* __restrict__ k, T* __restrict__ qo,
                                     T* __restrict__ ko, const float* __restrict__ cos, const float* __restrict__ sin,
                                     long long q_pairs, long long k_pairs, int T_, int H, int Hk, int D, int inverse) {
    const long long stride = (long long)gridDim.x * blockDim.x;
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < q_pairs + k_pairs; i += stride) {
        if (i < q_pairs) rope_pairs<T>(q, qo, cos, sin, q_pairs, T_, H, D, inverse, i);
        else rope_pairs<T>(k, ko, cos, sin, k_pairs, T_, Hk, D, inverse, i - q_pairs);
    }
}

__device__ __forceinline__ float sigmoid_f(float v) { return 1.f / (1.f + expf(-v)); }

template <typename T>
__device__ __forceinline__ void swiglu_fwd(const T* __restrict__ gate, const T* __restrict__ up, T* __restrict__ y,
                                           long long n) {
    const long long stride = (long long)gridDim.x * blockDim.x;
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride) {
        const float g = to_float(gate[i]);
        y[i] = from_float<T>(g * sigmoid_f(g) * to_float(up[i]));
    }
}

template <typename T>
__device__ __forceinline__ void swiglu_bwd(const T* __restrict__ grad, const T* __restrict__ gate,
                                           const T* __restrict__ up, T* __restrict__ dgate, T* __restrict__ dup,
                                           long long n) {
    const long long stride = (long long)gridDim.x * blockDim.x;
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride) {
        const float dy = to_float(grad[i]), g = to_float(gate[i]), s = sigmoid_f(g);
        if (dgate != nullptr) dgate[i] = from_float<T>(dy * to_float(up[i]) * s * (1.f + g * (1.f - s)));
        if (dup != nullptr) dup[i] = from_float<T>(dy * g * s);
    }
}

#define LLAMA_KERNELS(SUFFIX, T)                                                                                    \
    extern "C" __global__ void rmsnorm_fwd_##SUFFIX(const T* x, const T* w, T* y, float* rstd, int C, float eps) {  \
        rmsnorm_fwd<T, T, T>(x, nullptr, w, y, nullptr, rstd, C, eps);                                              \
    }                                                                                                               \
    extern "C" __global__ void rmsnorm_bwd_##SUFFIX(const T* g, const T* x, const T* w, const float* rstd, T* dx,  \
                                                    float* partial, long long N, int C, int need_w) {               \
        rmsnorm_bwd<T>(g, x, w, rstd, dx, partial, N, C, need_w);                                                   \
    }                                                                                                               \
    extern "C" __global__ void rope_##SUFFIX(const T* q, const T* k, T* qo, T* ko, const float* cos,               \
                                             const float* sin, long long q_pairs, long long k_pairs, int T_, int H, \
                                             int Hk, int D, int inverse) {                                          \
        rope<T>(q, k, qo, ko, cos, sin, q_pairs, k_pairs, T_, H, Hk, D, inverse);                                   \
    }                                                                                                               \
    extern "C" __global__ void swiglu_fwd_##SUFFIX(const T* gate, const T* up, T* y, long long n) {                \
        swiglu_fwd<T>(gate, up, y, n);                                                                              \
    }                                                                                                               \
    extern "C" __global__ void swiglu_bwd_##SUFFIX(const T* grad, const T* gate, const T* up, T* dgate, T* dup,    \
                                                   long long n) {                                                   \
        swiglu_bwd<T>(grad, gate, up, dgate, dup, n);                                                               \
    }
LLAMA_KERNELS(f32, float)
LLAMA_KERNELS(bf16, bf16)

extern "C" __global__ void rmsnorm_fwd_f32_to_bf16(const float* x, const float* w, bf16* y, float* rstd, int C,
                                                   float eps) {
    rmsnorm_fwd<float, float, bf16>(x, nullptr, w, y, nullptr, rstd, C, eps);
}

#define RMSNORM_RES_KERNEL(XS, YS, TX, TY)                                                                         \
    extern "C" __global__ void rmsnorm_fwd_res_##XS##_##YS(const TX* x, const float* r, const float* w, TY* y,    \
                                                           float* s, float* rstd, int C, float eps) {              \
        rmsnorm_fwd<TX, float, TY>(x, r, w, y, s, rstd, C, eps);                                                   \
    }
RMSNORM_RES_KERNEL(f32, f32, float, float)
RMSNORM_RES_KERNEL(f32, bf16, float, bf16)
RMSNORM_RES_KERNEL(bf16, f32, bf16, float)
RMSNORM_RES_KERNEL(bf16, bf16, bf16, bf16)
