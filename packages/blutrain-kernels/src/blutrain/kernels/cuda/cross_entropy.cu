// Softmax cross-entropy over [N, C] logits with int64 class targets, ignore_index and label
// smoothing, float32 and bf16 logits. No softmax tensor is ever stored: the forward keeps the
// per-row log-sum-exp, the backward recomputes softmax - onehot on the fly.
//
// ce_fwd_*:    grid N blocks (one per row), block 128..1024 threads. One pass over the row keeps an
//              online (max, sum exp) per thread, merged across the block; then
//              loss = (1-eps)(lse - x[t]) + eps (lse - mean(x)), 0 for ignored rows.
//              With dlogits != nullptr a second pass reads the row again and writes the gradient of
//              the reduced loss for an upstream gradient of 1, fusing forward and backward (the
//              fallback of ce_fused_* for the scalar variants, _v1).
//              The log-sum-exp is stored in float32 whatever the logits' dtype.
//              Bytes: read N*C (+ N*C read again and N*C written with the fused gradient).
//              FLOPs ~ 3 N*C plus N*C expf (2 N*C with the gradient).
// ce_fused_*:  the forward fused with the gradient (16-byte variants), the row read from memory once:
//              grid N blocks, block 32..512 threads, launched with `staged` 16-byte vectors of dynamic
//              shared memory (the launcher fits two blocks per multiprocessor, so one block's reads
//              overlap the other's arithmetic and writes: the whole row for bf16 up to C = 57344 on
//              Hopper, its first part for wider float32 rows). Each thread copies its vectors i = tid,
//              tid + blockDim, ... < staged into shared memory with cp.async, reads the rest of the row
//              from global memory meanwhile (online max and sum exp), then the staged part from shared
//              memory; after the block's merge it writes the gradient from shared memory, re-reading
//              only the unstaged rest. A thread reads back only the vectors it copied, so no barrier
//              guards the staging. Bytes: read N*C + N*(C - 8*staged) elements (N*C when staged
//              covers the row), write N*C. bf16 rows use exp(x) = 2^(x log2 e) on the hardware's
//              ex2.approx (relative error ~2^-22, plus ~1 ulp of lse*log2(e) in the argument: below
//              1e-6 relative in the sums and the gradient, against bf16's 2^-9 rounding of the
//              gradient) and pack the gradient with cvt.rn.bf16x2 (round to nearest even, the same bits
//              as the software rounding for every finite value; a row whose lse or scale is not finite
//              takes the software rounding, which keeps NaN payloads). float32 rows keep expf.
// ce_reduce_*: one block; sums the per-row losses in a fixed order (deterministic) and divides by
//              the number of non-ignored targets for reduction 'mean'.
// ce_bwd_*:    grid N blocks; dlogits = (softmax - (1-eps) onehot - eps/C) * scale_row, where
//              scale_row is grad[row] ('none'), grad[0] ('sum') or grad[0]/count ('mean'), 0 on
//              ignored rows. Bytes: read N*C, write N*C.
#include "common.cuh"

template <typename T, int VEC>
__device__ __forceinline__ void ce_fwd(const T* __restrict__ logits, const long long* __restrict__ target, int C,
                                       long long ignore_index, float smoothing, float* __restrict__ loss_rows,
                                       float* __restrict__ lse_out, T* __restrict__ dlogits,
                                       const long long* __restrict__ valid_count) {
    __shared__ float red[66];
    const long long row = blockIdx.x;
    const T* xr = logits + row * (long long)C;
    const int nv = C / VEC;

    LseState st{-BT_INF, 0.f};
    float sum = 0.f;
    for (int i = threadIdx.x; i < nv; i += blockDim.x) {
        float v[VEC];
        load_vec<VEC>(xr + (long long)i * VEC, v);
        float vmax = v[0];
#pragma unroll
        for (int k = 1; k < VEC; ++k) vmax = fmaxf(vmax, v[k]);
        const float m = fmaxf(st.m, vmax);
        if (m != -BT_INF) {
            float s = st.s * expf(st.m - m);
#pragma unroll
            for (int k = 0; k < VEC; ++k) s += expf(v[k] - m);
            st = LseState{m, s};
        }
#pragma unroll
        for (int k = 0; k < VEC; ++k) sum += v[k];
    }
    st = block_lse(st, red);
    sum = block_sum(sum, red);
    const float lse = st.m + logf(st.s);  // all -inf row: -inf + log(0) = -inf

    const long long t = target[row];
    const bool valid = t != ignore_index;
    if (threadIdx.x == 0) {
        float loss = 0.f;
        if (valid) {
            const float picked = (t >= 0 && t < C) ? to_float(xr[t]) : __int_as_float(0x7fc00000);
            loss = (1.f - smoothing) * (lse - picked);
            if (smoothing != 0.f) loss += smoothing * (lse - sum / (float)C);
        }
        loss_rows[row] = loss;
        lse_out[row] = lse;
    }
    if (dlogits != nullptr) {
        float scale = valid ? 1.f : 0.f;
        // 'mean': 1/count on valid rows; with no valid row at all 0/0 = NaN everywhere, as the loss.
        if (valid_count != nullptr) scale /= (float)(*valid_count);
        const float uniform = smoothing / (float)C;
        T* gr = dlogits + row * (long long)C;
        for (int i = threadIdx.x; i < nv; i += blockDim.x) {
            float v[VEC], o[VEC];
            load_vec<VEC>(xr + (long long)i * VEC, v);
#pragma unroll
            for (int k = 0; k < VEC; ++k) {
                const long long col = (long long)i * VEC + k;
                float p = expf(v[k] - lse) - uniform;
                if (col == t) p -= 1.f - smoothing;
                o[k] = p * scale;
            }
            store_vec<VEC>(gr + (long long)i * VEC, o);
        }
    }
}

// 2^x on the special-function unit (ftz: a result below 2^-126 is 0).
__device__ __forceinline__ float ex2_approx(float x) {
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
    return y;
}

constexpr float CE_LOG2E = 1.4426950408889634f;
constexpr int CE_BATCH = 4;  // vectors of the unstaged rest loaded before any is used

// Column vectors i0, i0 + blockDim.x, ... (CE_BATCH of them, those below nv) of the row xr into v: every load
// issued before any of them is used.
template <typename T, int VEC>
__device__ __forceinline__ void load_batch(const T* __restrict__ xr, int i0, int nv, float (&v)[CE_BATCH][VEC]) {
#pragma unroll
    for (int u = 0; u < CE_BATCH; ++u) {
        const int i = i0 + u * blockDim.x;
        if (i < nv) load_vec<VEC>(xr + (long long)i * VEC, v[u]);
    }
}

// Round-to-nearest-even bf16 pair (lo in the low half) in one instruction where the hardware has it: the
// same bits as pack_bf16x2 for every non-NaN input.
__device__ __forceinline__ unsigned int pack_bf16x2_rn(float lo, float hi) {
#if __CUDA_ARCH__ >= 800
    unsigned int r;
    asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
    return r;
#else
    return pack_bf16x2(lo, hi);
#endif
}

__device__ __forceinline__ unsigned int shared_addr(const void* p) {
    return (unsigned int)__cvta_generic_to_shared(p);
}

// 16 bytes global -> shared without passing through registers (cp.async where the hardware has it).
__device__ __forceinline__ void copy16_async(uint4* dst, const void* src) {
#if __CUDA_ARCH__ >= 800
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(shared_addr(dst)), "l"(src));
#else
    *dst = *reinterpret_cast<const uint4*>(src);
#endif
}

__device__ __forceinline__ void copy16_wait_all() {
#if __CUDA_ARCH__ >= 800
    asm volatile("cp.async.wait_all;\n" ::: "memory");
#endif
}

template <typename T, int VEC> __device__ __forceinline__ void widen16(const uint4& u, float (&o)[VEC]);
template <> __device__ __forceinline__ void widen16<float, 4>(const uint4& u, float (&o)[4]) {
    o[0] = __uint_as_float(u.x); o[1] = __uint_as_float(u.y); o[2] = __uint_as_float(u.z); o[3] = __uint_as_float(u.w);
}
template <> __device__ __forceinline__ void widen16<bf16, 8>(const uint4& u, float (&o)[8]) {
    unpack_bf16x2(u.x, o[0], o[1]);
    unpack_bf16x2(u.y, o[2], o[3]);
    unpack_bf16x2(u.z, o[4], o[5]);
    unpack_bf16x2(u.w, o[6], o[7]);
}

// One vector of the row into the thread's running (max, sum exp) and plain sum (with smoothing only).
template <typename T, int VEC>
__device__ __forceinline__ void ce_accumulate(const float (&v)[VEC], LseState& st, float& sum, bool smooth) {
    constexpr bool FAST = sizeof(T) == 2;
    float vmax = v[0];
#pragma unroll
    for (int k = 1; k < VEC; ++k) vmax = fmaxf(vmax, v[k]);
    const float m = fmaxf(st.m, vmax);
    if (m != -BT_INF) {
        float s;
        if constexpr (FAST) {
            // s is kept relative to ml, the rounded m * log2(e): the rescale is 2^(ml_old - ml), exactly 1 while
            // the maximum stands (an FMA of st.m would add the product's rounding error at every vector)
            const float ml = __fmul_rn(m, CE_LOG2E);
            s = st.s * ex2_approx(__fmul_rn(st.m, CE_LOG2E) - ml);
#pragma unroll
            for (int k = 0; k < VEC; ++k) s += ex2_approx(fmaf(v[k], CE_LOG2E, -ml));
        } else {
            s = st.s * expf(st.m - m);
#pragma unroll
            for (int k = 0; k < VEC; ++k) s += expf(v[k] - m);
        }
        st = LseState{m, s};
    }
    if (smooth) {
#pragma unroll
        for (int k = 0; k < VEC; ++k) sum += v[k];
    }
}

// The gradient of one vector (columns base .. base + VEC) stored to dst.
template <typename T, int VEC>
__device__ __forceinline__ void ce_grad_store(const float (&v)[VEC], long long base, long long t, float lse,
                                              float uniform, float onehot, float scale, bool exact_pack,
                                              T* __restrict__ dst) {
    float o[VEC];
    if constexpr (sizeof(T) == 2) {
        const float nl = -lse * CE_LOG2E;
#pragma unroll
        for (int k = 0; k < VEC; ++k) o[k] = ex2_approx(fmaf(v[k], CE_LOG2E, nl)) - uniform;
    } else {
#pragma unroll
        for (int k = 0; k < VEC; ++k) o[k] = expf(v[k] - lse) - uniform;
    }
    if ((unsigned long long)(t - base) < (unsigned long long)VEC) {  // the target's column is in this vector
#pragma unroll
        for (int k = 0; k < VEC; ++k) {
            if (base + k == t) o[k] -= onehot;
        }
    }
#pragma unroll
    for (int k = 0; k < VEC; ++k) o[k] *= scale;
    if constexpr (sizeof(T) == 2) {
        if (!exact_pack) {
            uint4 u;
            u.x = pack_bf16x2_rn(o[0], o[1]);
            u.y = pack_bf16x2_rn(o[2], o[3]);
            u.z = pack_bf16x2_rn(o[4], o[5]);
            u.w = pack_bf16x2_rn(o[6], o[7]);
            *reinterpret_cast<uint4*>(dst) = u;
            return;
        }
    }
    store_vec<VEC>(dst, o);
}

template <typename T, int VEC>
__device__ __forceinline__ void ce_fused(const T* __restrict__ logits, const long long* __restrict__ target, int C,
                                         long long ignore_index, float smoothing, float* __restrict__ loss_rows,
                                         float* __restrict__ lse_out, T* __restrict__ dlogits,
                                         const long long* __restrict__ valid_count, int staged) {
    extern __shared__ uint4 stage[];
    __shared__ float red[66];
    const long long row = blockIdx.x;
    const T* xr = logits + row * (long long)C;
    const int nv = C / VEC;
    const bool smooth = smoothing != 0.f;

    for (int i = threadIdx.x; i < staged; i += blockDim.x) copy16_async(stage + i, xr + (long long)i * VEC);
    LseState st{-BT_INF, 0.f};
    float sum = 0.f;
    // the unstaged rest while the copies fly, CE_BATCH vectors' loads in flight per thread
    for (int i0 = staged + threadIdx.x; i0 < nv; i0 += CE_BATCH * blockDim.x) {
        float v[CE_BATCH][VEC];
        load_batch<T, VEC>(xr, i0, nv, v);
#pragma unroll
        for (int u = 0; u < CE_BATCH; ++u) {
            if (i0 + u * blockDim.x < nv) ce_accumulate<T, VEC>(v[u], st, sum, smooth);
        }
    }
    copy16_wait_all();  // this thread's own copies: the only staged vectors it reads
    for (int i = threadIdx.x; i < staged; i += blockDim.x) {
        float v[VEC];
        widen16<T, VEC>(stage[i], v);
        ce_accumulate<T, VEC>(v, st, sum, smooth);
    }
    st = block_lse(st, red);
    if (smooth) sum = block_sum(sum, red);
    const float lse = st.m + logf(st.s);  // all -inf row: -inf + log(0) = -inf

    const long long t = target[row];
    const bool valid = t != ignore_index;
    if (threadIdx.x == 0) {
        float loss = 0.f;
        if (valid) {
            const float picked = (t >= 0 && t < C) ? to_float(xr[t]) : __int_as_float(0x7fc00000);
            loss = (1.f - smoothing) * (lse - picked);
            if (smooth) loss += smoothing * (lse - sum / (float)C);
        }
        loss_rows[row] = loss;
        lse_out[row] = lse;
    }
    float scale = valid ? 1.f : 0.f;
    // 'mean': 1/count on valid rows; with no valid row at all 0/0 = NaN everywhere, as the loss.
    if (valid_count != nullptr) scale /= (float)(*valid_count);
    const float uniform = smoothing / (float)C, onehot = 1.f - smoothing;
    // A finite lse means finite logits (an inf or NaN logit makes it inf or NaN), so with a finite scale no
    // gradient element is NaN and the one-instruction rounding gives the cast's bits.
    const bool exact_pack = !(isfinite(lse) && isfinite(scale));
    T* gr = dlogits + row * (long long)C;
    for (int i = threadIdx.x; i < staged; i += blockDim.x) {
        float v[VEC];
        widen16<T, VEC>(stage[i], v);
        ce_grad_store<T, VEC>(v, (long long)i * VEC, t, lse, uniform, onehot, scale, exact_pack,
                              gr + (long long)i * VEC);
    }
    for (int i0 = staged + threadIdx.x; i0 < nv; i0 += CE_BATCH * blockDim.x) {
        float v[CE_BATCH][VEC];
        load_batch<T, VEC>(xr, i0, nv, v);
#pragma unroll
        for (int u = 0; u < CE_BATCH; ++u) {
            const int i = i0 + u * blockDim.x;
            if (i < nv) {
                ce_grad_store<T, VEC>(v[u], (long long)i * VEC, t, lse, uniform, onehot, scale, exact_pack,
                                      gr + (long long)i * VEC);
            }
        }
    }
}

template <typename T>
__device__ __forceinline__ void ce_reduce(const float* __restrict__ loss_rows, const long long* __restrict__ target,
                                          long long N, long long ignore_index, int mean, T* __restrict__ out) {
    __shared__ float red[66];
    float s = 0.f, cnt = 0.f;
    for (long long i = threadIdx.x; i < N; i += blockDim.x) {
        s += loss_rows[i];
        cnt += target[i] != ignore_index ? 1.f : 0.f;
    }
    s = block_sum(s, red);
    cnt = block_sum(cnt, red);
    if (threadIdx.x == 0) out[0] = from_float<T>(mean ? s / cnt : s);
}

template <typename T, int VEC>
__device__ __forceinline__ void ce_bwd(const T* __restrict__ grad, const T* __restrict__ logits,
                                       const long long* __restrict__ target, const float* __restrict__ lse,
                                       T* __restrict__ dlogits, int C, long long ignore_index, float smoothing,
                                       int mode, const long long* __restrict__ valid_count) {
    const long long row = blockIdx.x;
    const long long t = target[row];
    float scale = 0.f;
    if (t != ignore_index) scale = to_float(grad[mode == 0 ? row : 0]);
    // 'mean': divided by the number of valid rows; with none at all 0/0 = NaN, as the loss.
    if (mode == 2) scale /= (float)(*valid_count);
    const float l = lse[row];
    const float uniform = smoothing / (float)C;
    const T* xr = logits + row * (long long)C;
    T* gr = dlogits + row * (long long)C;
    const int nv = C / VEC;
    for (int i = threadIdx.x; i < nv; i += blockDim.x) {
        float v[VEC], o[VEC];
        load_vec<VEC>(xr + (long long)i * VEC, v);
#pragma unroll
        for (int k = 0; k < VEC; ++k) {
            const long long col = (long long)i * VEC + k;
            float p = expf(v[k] - l) - uniform;
            if (col == t) p -= 1.f - smoothing;
            o[k] = p * scale;
        }
        store_vec<VEC>(gr + (long long)i * VEC, o);
    }
}

#define CE_KERNELS(SUFFIX, T, VEC)                                                                      \
    extern "C" __global__ void ce_fwd_##SUFFIX(const T* logits, const long long* target, int C,          \
                                               long long ignore_index, float smoothing, float* loss_rows, \
                                               float* lse, T* dlogits, const long long* valid_count) {    \
        ce_fwd<T, VEC>(logits, target, C, ignore_index, smoothing, loss_rows, lse, dlogits, valid_count); \
    }                                                                                                   \
    extern "C" __global__ void ce_bwd_##SUFFIX(const T* grad, const T* logits, const long long* target,  \
                                               const float* lse, T* dlogits, int C, long long ignore_index, \
                                               float smoothing, int mode, const long long* valid_count) { \
        ce_bwd<T, VEC>(grad, logits, target, lse, dlogits, C, ignore_index, smoothing, mode, valid_count); \
    }
#define CE_FUSED_KERNEL(SUFFIX, T, VEC)                                                                 \
    extern "C" __global__ void __launch_bounds__(512, 2)                                                \
    ce_fused_##SUFFIX(const T* logits, const long long* target, int C, long long ignore_index,          \
                      float smoothing, float* loss_rows, float* lse, T* dlogits,                         \
                      const long long* valid_count, int staged) {                                        \
        ce_fused<T, VEC>(logits, target, C, ignore_index, smoothing, loss_rows, lse, dlogits, valid_count, \
                         staged);                                                                        \
    }
CE_FUSED_KERNEL(f32_v4, float, 4)
CE_FUSED_KERNEL(bf16_v8, bf16, 8)
CE_KERNELS(f32_v4, float, 4)
CE_KERNELS(f32_v1, float, 1)
CE_KERNELS(bf16_v8, bf16, 8)
CE_KERNELS(bf16_v1, bf16, 1)

extern "C" __global__ void ce_reduce_f32(const float* loss_rows, const long long* target, long long N,
                                         long long ignore_index, int mean, float* out) {
    ce_reduce<float>(loss_rows, target, N, ignore_index, mean, out);
}
extern "C" __global__ void ce_reduce_bf16(const float* loss_rows, const long long* target, long long N,
                                          long long ignore_index, int mean, bf16* out) {
    ce_reduce<bf16>(loss_rows, target, N, ignore_index, mean, out);
}
