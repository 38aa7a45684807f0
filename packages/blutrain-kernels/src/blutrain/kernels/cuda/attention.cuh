// Device helpers that BluTrain's attention kernel families share (attention.cu, attention_bf16.cu,
// attention_wgmma.cu, attention_wgmma_bwd.cu): where a tensor's rows live, the cp.async wrappers that stream
// tiles into shared memory, bf16x2 packing, the hardware 2^x and log2(e). Plain sm_80 PTX: wgmma.cuh holds the
// Hopper-only part. Pasted into each source by blutrain.kernels.cuda.source(), as common.cuh is.
#pragma once

#define ATTN_LOG2E 1.4426950408889634f

// Where one tensor's rows live, in elements: the rows of (batch b, head h) start at b * batch + h * head,
// consecutive rows are `row` apart. 64-bit: a packed [B, T, 3, H, D] buffer passes 2^31 elements early.
struct RowLayout {
    long long batch, head, row;
};

template <typename T> __device__ __forceinline__ T* head_rows(T* base, const RowLayout& l, int b, int h) {
    return base + b * l.batch + h * l.head;
}

// Grouped-query attention's dk/dv blocks, one per (key tile, key/value head), step through the query tiles of
// the group's query heads one head after another: step i reads tile i % n_tiles (of `tile_rows` queries from
// q_begin) of query head kv_head * group + i / n_tiles. `rows`: where that head's per-row lse2 and Delta start in
// their [B*H, L] arrays.
struct GroupStep {
    int head, q0;
    long long rows;
};

__device__ __forceinline__ GroupStep group_step(int step, int n_tiles, int q_begin, int tile_rows, int batch,
                                                int kv_head, int group, int H, int L) {
    const int member = step / n_tiles;
    const int head = kv_head * group + member;
    return {head, q_begin + (step - member * n_tiles) * tile_rows, ((long long)batch * H + head) * L};
}

// Entry points take each RowLayout as three scalars (x_b, x_h, x_r): kernel arguments stay plain integers.
#define LAYOUT_PARAMS(x) long long x##_b, long long x##_h, long long x##_r
#define LAYOUT(x) RowLayout{x##_b, x##_h, x##_r}

// ---- PTX wrappers (each one instruction) ----------------------------------------------------------

__device__ __forceinline__ unsigned shared_address(const void* p) {
    return static_cast<unsigned>(__cvta_generic_to_shared(p));
}

// 16 bytes global -> shared, asynchronously; zero-fills the destination when !valid.
__device__ __forceinline__ void cp_async_16(unsigned dst, const void* src, bool valid) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(valid ? 16 : 0));
}

// 4 bytes global -> shared, asynchronously; zero-fills the destination when !valid.
__device__ __forceinline__ void cp_async_4(unsigned dst, const void* src, bool valid) {
    asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(dst), "l"(src), "r"(valid ? 4 : 0));
}

__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }

// Wait until at most `pending` of this thread's committed groups are still in flight.
template <int pending> __device__ __forceinline__ void cp_async_wait() {
    asm volatile("cp.async.wait_group %0;\n" ::"n"(pending) : "memory");
}

// Two floats -> one bf16x2 register, round to nearest even; lo takes the low half (the lower k index).
__device__ __forceinline__ unsigned cvt_bf16x2(float lo, float hi) {
    unsigned r;
    asm("cvt.rn.bf16x2.f32 %0, %1, %2;\n" : "=r"(r) : "f"(hi), "f"(lo));
    return r;
}

// 2^x on the special-function unit (2 ulp; 2^-inf = 0), without exp2f's range and denormal fix-ups: weights
// under 2^-126 become 0, which no float32 softmax sum can see.
__device__ __forceinline__ float fast_exp2(float x) {
    float r;
    asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(r) : "f"(x));
    return r;
}

// ---- end of PTX wrappers --------------------------------------------------------------------------
