// Hopper's warpgroup tensor-core instructions (wgmma.mma_async, bf16 operands, float32 accumulators) and what
// they need around them, shared by attention_wgmma.cu and attention_wgmma_bwd.cu: the async-proxy fence, the
// wgmma fence / commit / wait, register pins, the m64n64k16 and m64n128k16 products, the shared-memory matrix
// descriptors and the swizzled [rows][64] bf16 tiles they describe. Only for sources built with -arch=sm_90a
// (wgmma does not exist on plain sm_90). Needs common.cuh (bf16) and attention.cuh (cp.async, cvt_bf16x2).
//
// Shared memory. Tiles are [rows][64] bf16, 128-byte rows, 16-byte chunk c of row r stored at chunk
// c ^ (r % 8) (attention_bf16.cu's swizzle), every tile base 1024-byte aligned: that is exactly the 128-byte
// swizzle mode of the wgmma descriptors (Swizzle<3,4,3> on the byte address: bits 4-6 ^= bits 7-9), whose
// repeating pattern must start on a 1024-byte boundary for the base-offset field to be 0.
// Descriptors (PTX ISA "Matrix Descriptor Format"; 64 bits): bits 0-13 start address >> 4, 16-29 leading
// dimension byte offset (LBO) >> 4, 32-45 stride dimension byte offset (SBO) >> 4, 49-51 base offset (0),
// 62-63 swizzle mode (1 = 128 bytes).
//   A tile whose rows are the M or N side of a product and whose d is the reduction (q and k in S = q k^T) is
//   K-major (imm-trans 0): canonical layout ((8,m),(8,2)):((64,SBO),(1,8)) in elements (8 rows 128 bytes
//   apart, then the next 8 rows SBO = 1024 bytes on; K = 16 is two 16-byte chunks of a row), LBO unused for
//   swizzled K-major ("assumed 1", encoded 1). The k-step ks (16 of d = 32 bytes) moves the start address by
//   32 ks bytes inside the swizzle atom: the hardware swizzles the computed address, so the 1024-aligned
//   pattern still lines up (base offset stays 0).
//   A tile whose rows are the reduction and d the N side (v in P v) is MN-major (imm-trans-b 1): canonical
//   layout ((8,8,m),(8,k)):((1,8,LBO),(64,SBO)) in elements, SBO = 1024 between groups of 8 rows, LBO the step
//   between 64-element column blocks, of which D = 64 has one (unused; set to 1024 as well). The k-step kk
//   (16 rows) moves the start address by 2048 bytes.
// Ordering: cp.async writes are made visible to the tensor cores' async proxy by fence.proxy.async in each
// writing thread after cp.async.wait_group, then a block barrier. wgmma.fence precedes each batch (registers
// written by ordinary code); wgmma.commit_group / wait_group complete it before the accumulators are read;
// fence_registers ties the accumulator registers to those points so the compiler moves no access across them.
#pragma once

#include "common.cuh"
#include "attention.cuh"

// ---- PTX wrappers (each one instruction) ----------------------------------------------------------

// This thread's completed shared-memory writes become visible to the async proxy (wgmma operand reads).
__device__ __forceinline__ void fence_proxy_async_shared() {
    asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
}

__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }

__device__ __forceinline__ void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }

// Wait until at most `pending` of this warpgroup's committed wgmma groups are still in flight.
template <int pending> __device__ __forceinline__ void wgmma_wait() {
    asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(pending) : "memory");
}

// Pin registers at this point of the instruction stream (no code moves across an ordered volatile asm).
template <int N> __device__ __forceinline__ void fence_registers(float (&r)[N]) {
#pragma unroll
    for (int i = 0; i < N; ++i) asm volatile("" : "+f"(r[i])::"memory");
}

template <int N> __device__ __forceinline__ void fence_registers(unsigned (&r)[N][4]) {
#pragma unroll
    for (int i = 0; i < N; ++i) {
#pragma unroll
        for (int c = 0; c < 4; ++c) asm volatile("" : "+r"(r[i][c])::"memory");
    }
}

// wgmma.mma_async, bf16 inputs, float32 accumulators (operand lists written out: asm takes no arrays).
// d (64 x 64, float) = A (64 x 16, K-major, shared memory) * B (16 x 64, K-major, shared memory), plus d when
// accumulate != 0.
__device__ __forceinline__ void wgmma_m64n64k16_ss(float (&d)[32], unsigned long long desc_a, unsigned long long desc_b,
                                                   int accumulate) {
    asm volatile(
        "{\n"
        ".reg .pred p;\n"
        "setp.ne.b32 p, %34, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16\n"
        "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15,\n"
        " %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31},\n"
        " %32, %33, p, 1, 1, 0, 0;\n"
        "}\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
          "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]),
          "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),
          "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])
        : "l"(desc_a), "l"(desc_b), "r"(accumulate));
}

// d (64 x 128, float) = A (64 x 16, K-major, shared memory) * B (16 x 128, K-major, shared memory), plus d when
// accumulate != 0.
__device__ __forceinline__ void wgmma_m64n128k16_ss(float (&d)[64], unsigned long long desc_a, unsigned long long desc_b,
                                                   int accumulate) {
    asm volatile(
        "{\n"
        ".reg .pred p;\n"
        "setp.ne.b32 p, %66, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16\n"
        "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15,\n"
        " %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31,\n"
        " %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47,\n"
        " %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63},\n"
        " %64, %65, p, 1, 1, 0, 0;\n"
        "}\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
          "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]),
          "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),
          "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]),
          "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]),
          "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]),
          "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]),
          "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])
        : "l"(desc_a), "l"(desc_b), "r"(accumulate));
}

// d (64 x 64, float) += A (64 x 16 bf16, registers) * B (16 x 64, MN-major in shared memory: imm-trans-b = 1).
__device__ __forceinline__ void wgmma_m64n64k16_rs_tb(float (&d)[32], const unsigned (&a)[4],
                                                     unsigned long long desc_b) {
    asm volatile(
        "{\n"
        ".reg .pred p;\n"
        "setp.ne.b32 p, %37, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16\n"
        "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15,\n"
        " %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31},\n"
        " {%32, %33, %34, %35}, %36, p, 1, 1, 1;\n"
        "}\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
          "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]),
          "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),
          "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b), "r"(1));
}

// ---- end of PTX wrappers --------------------------------------------------------------------------

// 128-byte swizzle, 1024-byte aligned start: bits 62-63 = 1; addresses and offsets in 16-byte units.
__device__ __forceinline__ unsigned long long wgmma_desc(unsigned smem_addr, unsigned lbo_bytes, unsigned sbo_bytes) {
    return static_cast<unsigned long long>((smem_addr & 0x3FFFFu) >> 4) |
           (static_cast<unsigned long long>(lbo_bytes >> 4) << 16) |
           (static_cast<unsigned long long>(sbo_bytes >> 4) << 32) | (1ull << 62);
}

// K-major tile ([rows][64] bf16, rows the M or N side, d the reduction): SBO 1024, LBO unused (1).
__device__ __forceinline__ unsigned long long desc_kmajor(unsigned tile) { return wgmma_desc(tile, 16, 1024); }

// MN-major tile ([keys][64] bf16, keys the reduction, d the N side): SBO 1024 between 8-key groups; LBO
// (between 64-wide column blocks; D = 64 has one) set to the same value.
__device__ __forceinline__ unsigned long long desc_mnmajor(unsigned tile) { return wgmma_desc(tile, 1024, 1024); }

// A descriptor moved by `bytes` (a multiple of 16): the start-address field, which cannot carry out for
// shared-memory addresses below 256 KB.
__device__ __forceinline__ unsigned long long desc_advance(unsigned long long desc, unsigned bytes) {
    return desc + (bytes >> 4);
}

// d (64 x 2N) = a (64 rows, K-major) b^T (2N rows, K-major) over the four k-steps of D = 64 (N = 32: 64 x 64,
// N = 64: 64 x 128); the first step overwrites d.
template <int N>
__device__ __forceinline__ void issue_abt(float (&d)[N], unsigned long long da, unsigned long long db) {
    static_assert(N == 32 || N == 64, "issue_abt: 64 or 128 columns");
#pragma unroll
    for (int ks = 0; ks < 4; ++ks) {
        if constexpr (N == 32) {
            wgmma_m64n64k16_ss(d, desc_advance(da, 32 * ks), desc_advance(db, 32 * ks), ks);
        } else {
            wgmma_m64n128k16_ss(d, desc_advance(da, 32 * ks), desc_advance(db, 32 * ks), ks);
        }
    }
}

// d (64 x 64) += a (64 x 16 KS, registers: KS k-steps) b (16 KS rows = the reduction, MN-major in shared memory).
template <int KS>
__device__ __forceinline__ void issue_rb(float (&d)[32], const unsigned (&a)[KS][4], unsigned long long db) {
#pragma unroll
    for (int kk = 0; kk < KS; ++kk) wgmma_m64n64k16_rs_tb(d, a[kk], desc_advance(db, 2048 * kk));
}

// Accumulators (64 x 16 KS float) -> A fragments (bf16) of the KS k-steps of the next product: keys 16 kk ..
// 16 kk + 15 (accumulators 8 kk .. 8 kk + 7), packed in pairs, are the A fragment of k-step kk.
template <int KS> __device__ __forceinline__ void pack_a(unsigned (&a)[KS][4], const float (&s)[8 * KS]) {
#pragma unroll
    for (int kk = 0; kk < KS; ++kk) {
#pragma unroll
        for (int r = 0; r < 4; ++r) a[kk][r] = cvt_bf16x2(s[8 * kk + 2 * r], s[8 * kk + 2 * r + 1]);
    }
}

// Byte offset of 16-byte chunk `chunk` of row `row` in a swizzled [rows][64] bf16 tile.
__device__ __forceinline__ unsigned tile_offset(int row, int chunk) {
    return static_cast<unsigned>(row * 128 + ((chunk ^ (row & 7)) << 4));
}

// Rows row0 .. row0 + ROWS - 1 (rs elements apart) of a matrix of rows_valid rows into a swizzled tile; rows
// at or past rows_valid read as zero. Every thread of the block takes part; the caller commits.
template <int ROWS, int THREADS>
__device__ __forceinline__ void load_tile_async(unsigned tile, const bf16* __restrict__ src, long long rs, int row0,
                                                int rows_valid) {
    constexpr int CHUNKS = ROWS * 8;
#pragma unroll
    for (int i = 0; i < (CHUNKS + THREADS - 1) / THREADS; ++i) {
        const int e = i * THREADS + threadIdx.x;
        if (CHUNKS % THREADS == 0 || e < CHUNKS) {
            const int r = e >> 3, c = e & 7;
            const int row = row0 + r;
            const bool valid = row < rows_valid;
            cp_async_16(tile + tile_offset(r, c), src + (valid ? row : 0) * rs + c * 8, valid);
        }
    }
}
