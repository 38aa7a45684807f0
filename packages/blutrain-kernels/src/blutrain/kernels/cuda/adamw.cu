// Multi-tensor AdamW (decoupled weight decay, PyTorch's formulation) over any number of float32
// parameters with float32 or bf16 gradients, with an optional global-norm gradient clip, in at most
// two launches for all tensors.
//
// The host builds a tensor table (int64 [T, 8]: param, grad, exp_avg, exp_avg_sq pointers, numel,
// flags, weight decay as float bits, unused) and a chunk table (int32 [K, 2]: tensor, chunk index);
// every chunk is CHUNK = 65536 elements, so one grid of K blocks covers every tensor.
//
// adamw_sqnorm:  grid K blocks x 512 threads; partial[k] = sum of g^2 over chunk k (float).
//                Bytes: read the gradients once.
// adamw_update:  grid K blocks x 512 threads. With partial != nullptr each block first sums the K
//                partials in one fixed order (every block gets the identical norm; block 0 stores it),
//                clip = min(1, max_norm / (norm + 1e-6)); then per element
//                  g = clip * grad;  p -= lr * wd * p;  m = b1 m + (1-b1) g;  v = b2 v + (1-b2) g^2;
//                  p -= (lr / bc1) * m / (sqrt(v) / sqrt(bc2) + eps).
//                Bytes: read p, g, m, v and write p, m, v: 28 bytes per float32 parameter (26 with bf16
//                gradients). FLOPs ~ 15 per element.
#include "common.cuh"

#define ADAMW_CHUNK 65536
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

__device__ __forceinline__ AdamwTensor adamw_tensor(const long long* table, int t) {
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

extern "C" __global__ void adamw_sqnorm(const long long* table, const int* chunks, float* partial) {
    __shared__ float red[66];
    const AdamwTensor t = adamw_tensor(table, chunks[2 * blockIdx.x]);
    const long long start = (long long)chunks[2 * blockIdx.x + 1] * ADAMW_CHUNK;
    long long n = t.numel - start;
    if (n > ADAMW_CHUNK) n = ADAMW_CHUNK;
    float s = 0.f;
    for (long long j = threadIdx.x; j < n; j += blockDim.x) {
        const float g = grad_at(t, start + j);
        s += g * g;
    }
    s = block_sum(s, red);
    if (threadIdx.x == 0) partial[blockIdx.x] = s;
}

__device__ __forceinline__ void adamw_step(float& p, float& m, float& v, float g, float wd, float lr, float beta1,
                                           float beta2, float eps, float step_size, float bc2_sqrt) {
    p -= lr * wd * p;
    m = beta1 * m + (1.f - beta1) * g;
    v = beta2 * v + (1.f - beta2) * g * g;
    p -= step_size * m / (sqrtf(v) / bc2_sqrt + eps);
}

extern "C" __global__ void adamw_update(const long long* table, const int* chunks, int nchunks,
                                        const float* partial, float max_norm, float lr, float beta1, float beta2,
                                        float eps, float bc1, float bc2_sqrt, float* norm_out) {
    __shared__ float red[66];
    float clip = 1.f;
    if (partial != nullptr) {
        float s = 0.f;
        for (int k = threadIdx.x; k < nchunks; k += blockDim.x) s += partial[k];
        const float norm = sqrtf(block_sum(s, red));
        const float c = max_norm / (norm + 1e-6f);
        clip = c < 1.f ? c : (c != c ? c : 1.f);  // a NaN norm poisons the step visibly, as PyTorch's clip
        if (blockIdx.x == 0 && threadIdx.x == 0) norm_out[0] = norm;
    }
    const AdamwTensor t = adamw_tensor(table, chunks[2 * blockIdx.x]);
    const long long start = (long long)chunks[2 * blockIdx.x + 1] * ADAMW_CHUNK;
    long long n = t.numel - start;
    if (n > ADAMW_CHUNK) n = ADAMW_CHUNK;
    const float step_size = lr / bc1;
    long long done = 0;
    if (t.flags & ADAMW_ALIGNED) {
        const long long nv = n / 4;
        for (long long i = threadIdx.x; i < nv; i += blockDim.x) {
            const long long j = start + 4 * i;
            float p[4], g[4], m[4], v[4];
            load_vec<4>(t.p + j, p);
            if (t.flags & ADAMW_GRAD_BF16) {
                load_vec<4>(reinterpret_cast<const bf16*>(t.g) + j, g);
            } else {
                load_vec<4>(reinterpret_cast<const float*>(t.g) + j, g);
            }
            load_vec<4>(t.m + j, m);
            load_vec<4>(t.v + j, v);
#pragma unroll
            for (int k = 0; k < 4; ++k) adamw_step(p[k], m[k], v[k], clip * g[k], t.wd, lr, beta1, beta2, eps, step_size, bc2_sqrt);
            store_vec<4>(t.p + j, p);
            store_vec<4>(t.m + j, m);
            store_vec<4>(t.v + j, v);
        }
        done = nv * 4;
    }
    for (long long i = done + threadIdx.x; i < n; i += blockDim.x) {
        const long long j = start + i;
        float p = t.p[j], m = t.m[j], v = t.v[j];
        adamw_step(p, m, v, clip * grad_at(t, j), t.wd, lr, beta1, beta2, eps, step_size, bc2_sqrt);
        t.p[j] = p;
        t.m[j] = m;
        t.v[j] = v;
    }
}
