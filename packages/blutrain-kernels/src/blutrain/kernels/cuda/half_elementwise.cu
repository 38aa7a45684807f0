// Elementwise ops on bfloat16 and float16 in one launch each, computed in float32 registers: every operand
// widened exactly, the op in float32, the result rounded once to the storage dtype. The bits are those of the
// cuda backend's generic path for half precision (widen each operand with the cast kernel, run CuPy's float32
// ufunc, narrow with the cast kernel), which costs four launches and three temporaries for a + b:
// - the same conversions (bf16_cast.cuh, f16_cast.cuh: the cast kernel's rounding and NaN rules);
// - the same float32 expression as CuPy's float32 loop of each ufunc (noted at each op below), one op per
//   element, so no multiply-add can be contracted into an FMA;
// - the same compiler flags: CuPy compiles its ufuncs and these RawModule kernels alike with -ftz=true, so
//   float32 subnormals flush to zero in both (bfloat16 subnormals are float32 subnormals; float16 values widen
//   to normal floats).
//
// half_binary_{dt}_ff_{v8|v1}(x, y, out, n, op): out[i] = op(x[i], y[i]) for i < n, x, y and out C-contiguous.
// half_binary_{dt}_fb_{v8|v1}(x, y, out, n, mode, m, ys, op, swap): out[i] = op(x[i], y_i), or op(y_i, x[i])
//     when swap is 1 (the broadcast operand came first), x and out C-contiguous with n elements; y_i by mode:
//     1 the float ys (a Python number, packed by the host as CuPy packs it for a float32 ufunc: rounded to
//     float32; y null), 2 *y (a 0-d or one-element array), 3 y[i % m] (y repeated along x's leading dims: a
//     row (C,) or (T, C) over (B, T, C)), 4 y[i / m] (each y element repeated m times along x's trailing
//     dims: a column (B, T, 1) over (B, T, C)).
//     op: 0 add, 1 sub, 2 mul, 3 div, 4 maximum, 5 minimum, 6 pow. dt: bf16 or f16.
// half_compare_{dt}_{ff|fb}_{v8|v1}(...): the same with a bool (one byte) out and no swap (the host mirrors
//     the operator instead, exact for a bool): op 0 eq, 1 ne, 2 lt, 3 le, 4 gt, 5 ge.
// half_unary_{dt}_{v8|v1}(x, out, n, op, p): out[i] = op(x[i]); op: 0 neg, 1 abs, 2 exp, 3 expm1, 4 log,
//     5 log1p, 6 sqrt, 7 rsqrt (1 / sqrt, two roundings, as the generic kernel), 8 tanh, 9 sin, 10 cos,
//     11 relu (maximum(x, 0)), 12 square (x ** 2), 13 reciprocal (x ** -1.0), 14 pow by the float p.
//
// The op, the mode and the operand order are kernel arguments, uniform over the grid and branched on once per
// launch (the op, the order) or once per vector (the mode), not template parameters: a module of 20 kernels.
//
// Launch: block 256 threads. _v8: grid-stride over the n / 8 vectors of 8 elements with 16-byte accesses
// (x, out and a full y 16-byte aligned; modes 3 and 4 need m % 8 == 0, and mode 3 an aligned y), the
// n % 8 tail one element each for the first threads; grid min(ceil(n / 8 / 256), 16 x SMs). _v1: one
// element per access, 4 in flight per thread; grid min(ceil(n / 4 / 256), 16 x SMs).
// Bytes: read 2n per full operand (a broadcast y: its m or n / m elements, from cache after the first
// read), write 2n (n for a bool out). FLOPs: one op per element (tens for the transcendental ones); bound
// by memory bandwidth.

#include "bf16_cast.cuh"
#include "f16_cast.cuh"
#include "u16_store.cuh"

typedef unsigned char u8;

struct BF16 {
    static __device__ __forceinline__ float widen(u16 h) { return bf16_to_f32(h); }
    static __device__ __forceinline__ u16 narrow(float x) { return f32_to_bf16(x); }
};

struct F16 {
    static __device__ __forceinline__ float widen(u16 h) { return f16_to_f32(h); }
    static __device__ __forceinline__ u16 narrow(float x) { return f32_to_f16(x); }
};

// CuPy's NaN of maximum/minimum (its float preamble's NAN)
#define HALF_OPS_NAN __int_as_float(0x7fffffff)

// The transcendental functions are called, not inlined: each is hundreds of instructions, which unrolled
// eight times in every loop would make NVRTC's first compilation of this module slow. A call computes the
// same bits (the instructions of libdevice's function, under the same -ftz).
__device__ __noinline__ float call_powf(float a, float b) { return powf(a, b); }
__device__ __noinline__ float call_expf(float x) { return expf(x); }
__device__ __noinline__ float call_expm1f(float x) { return expm1f(x); }
__device__ __noinline__ float call_logf(float x) { return logf(x); }
__device__ __noinline__ float call_log1pf(float x) { return log1pf(x); }
__device__ __noinline__ float call_tanhf(float x) { return tanhf(x); }
__device__ __noinline__ float call_sinf(float x) { return sinf(x); }
__device__ __noinline__ float call_cosf(float x) { return cosf(x); }

// Binary ops as CuPy's float32 loops compute them: add/subtract/multiply 'out0 = in0 op in1'; true_divide
// the same after static_cast to float; maximum/minimum '(isnan(in0) | isnan(in1)) ? NAN : max/min(in0,
// in1)' (CUDA's max/min of floats are fmaxf/fminf); power 'powf(in0, in1)'.
#define HALF_BINARY_OP(NAME, EXPR) \
    struct NAME { static __device__ __forceinline__ float f(float a, float b) { return EXPR; } };
HALF_BINARY_OP(OpAdd, a + b)
HALF_BINARY_OP(OpSub, a - b)
HALF_BINARY_OP(OpMul, a * b)
HALF_BINARY_OP(OpDiv, a / b)
HALF_BINARY_OP(OpMaximum, (isnan(a) | isnan(b)) ? HALF_OPS_NAN : fmaxf(a, b))
HALF_BINARY_OP(OpMinimum, (isnan(a) | isnan(b)) ? HALF_OPS_NAN : fminf(a, b))
HALF_BINARY_OP(OpPow, call_powf(a, b))

// Comparisons to bool (CuPy: 'out0 = in0 op in1' on floats).
#define HALF_COMPARE_OP(NAME, OPERATOR) \
    struct NAME { typedef u8 T; static __device__ __forceinline__ u8 apply(float a, float b) { return a OPERATOR b; } };
HALF_COMPARE_OP(OpEq, ==)
HALF_COMPARE_OP(OpNe, !=)
HALF_COMPARE_OP(OpLt, <)
HALF_COMPARE_OP(OpLe, <=)
HALF_COMPARE_OP(OpGt, >)
HALF_COMPARE_OP(OpGe, >=)

// A binary op's float32 result rounded to the storage dtype.
template <typename H, typename Op> struct Rounded {
    typedef u16 T;
    static __device__ __forceinline__ u16 apply(float a, float b) { return H::narrow(Op::f(a, b)); }
};

// Unary ops as CuPy's float32 loops compute them: negative '-in0', absolute 'fabsf(in0)', exp, expm1, log,
// log1p, sqrt, tanh, sin, cos their float overloads (expf, ...); the generic rsqrt is sqrt, then 1 / that
// (true_divide by a weak int: float); relu is maximum(x, 0); CuPy's x ** 2 is square 'in0 * in0',
// x ** -1.0 reciprocal '1 / in0', x ** 0.5 sqrt, other exponents powf (p the exponent).
#define HALF_UNARY_OP(NAME, EXPR) \
    struct NAME { static __device__ __forceinline__ float f(float x, float p) { return EXPR; } };
HALF_UNARY_OP(OpNeg, -x)
HALF_UNARY_OP(OpAbs, fabsf(x))
HALF_UNARY_OP(OpExp, call_expf(x))
HALF_UNARY_OP(OpExpm1, call_expm1f(x))
HALF_UNARY_OP(OpLog, call_logf(x))
HALF_UNARY_OP(OpLog1p, call_log1pf(x))
HALF_UNARY_OP(OpSqrt, sqrtf(x))
HALF_UNARY_OP(OpRsqrt, 1.0f / sqrtf(x))
HALF_UNARY_OP(OpTanh, call_tanhf(x))
HALF_UNARY_OP(OpSin, call_sinf(x))
HALF_UNARY_OP(OpCos, call_cosf(x))
HALF_UNARY_OP(OpRelu, isnan(x) ? HALF_OPS_NAN : fmaxf(x, 0.0f))
HALF_UNARY_OP(OpSquare, x * x)
HALF_UNARY_OP(OpReciprocal, 1.0f / x)
HALF_UNARY_OP(OpPowScalar, call_powf(x, p))

// 8 consecutive 16-bit elements widened, through one 16-byte load; p is 16-byte aligned.
template <typename H> __device__ __forceinline__ void load8(const u16* __restrict__ p, float (&v)[8]) {
    const uint4 a = *reinterpret_cast<const uint4*>(p);
    const unsigned int w[4] = {a.x, a.y, a.z, a.w};
#pragma unroll
    for (int k = 0; k < 4; ++k) {
        v[2 * k] = H::widen((u16)(w[k] & 0xffffu));  // little-endian: the lower half is the earlier element
        v[2 * k + 1] = H::widen((u16)(w[k] >> 16));
    }
}

// 8 bools in one 8-byte store; p is 8-byte aligned (16-byte aligned, as the launcher requires).
__device__ __forceinline__ void store8(u8* __restrict__ p, const u8 (&v)[8]) {
    uint2 a;
    a.x = (unsigned int)v[0] | ((unsigned int)v[1] << 8) | ((unsigned int)v[2] << 16) | ((unsigned int)v[3] << 24);
    a.y = (unsigned int)v[4] | ((unsigned int)v[5] << 8) | ((unsigned int)v[6] << 16) | ((unsigned int)v[7] << 24);
    *reinterpret_cast<uint2*>(p) = a;
}

// How y reaches the ops (a value uniform over the grid, tested once per vector of 8): the same n elements as x
// (the _ff kernels), or, in the _fb kernels, one value (the host's float ys, or *y), m elements repeated along
// x (j = i % m) or each of y's elements repeated m times (j = i / m).
#define Y_FULL 0
#define Y_HOST_SCALAR 1
#define Y_DEVICE_SCALAR 2
#define Y_ROWS 3
#define Y_COLUMNS 4

// y's element for output element i, widened (s: a scalar's value).
template <typename H>
__device__ __forceinline__ float y_at(const u16* __restrict__ y, int mode, float s, long long i, long long m) {
    if (mode == Y_FULL) return H::widen(y[i]);
    if (mode == Y_ROWS) return H::widen(y[i % m]);
    if (mode == Y_COLUMNS) return H::widen(y[i / m]);
    return s;
}

template <typename F, bool SWAP> __device__ __forceinline__ typename F::T apply(float a, float b) {
    if constexpr (SWAP) return F::apply(b, a);
    else return F::apply(a, b);
}

// F: Rounded<H, Op> or a comparison; SWAP: op(y, x) instead of op(x, y). For a mode other than Y_FULL and
// Y_*_SCALAR, m % 8 == 0 (and y is 16-byte aligned for Y_ROWS).
template <typename H, typename F, bool SWAP>
__device__ __forceinline__ void binary_v8(const u16* __restrict__ x, const u16* __restrict__ y,
                                          typename F::T* __restrict__ out, long long n, int mode, long long m,
                                          float s) {
    const long long nv = n >> 3;
    const long long tid = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    const long long stride = (long long)gridDim.x * blockDim.x;
    for (long long v = tid; v < nv; v += stride) {
        const long long i = v << 3;
        float a[8], b[8];
        load8<H>(x + i, a);
        if (mode == Y_FULL) {
            load8<H>(y + i, b);
        } else if (mode == Y_ROWS) {
            load8<H>(y + i % m, b);  // the 8 elements lie in one repetition of y
        } else {
            const float c = mode == Y_COLUMNS ? H::widen(y[i / m]) : s;  // one y element for all 8
#pragma unroll
            for (int k = 0; k < 8; ++k) b[k] = c;
        }
        typename F::T r[8];
#pragma unroll
        for (int k = 0; k < 8; ++k) r[k] = apply<F, SWAP>(a[k], b[k]);
        store8(out + i, r);
    }
    const long long t = (nv << 3) + tid;  // at most 7 tail elements; the grid has >= 256 threads
    if (t < n) out[t] = apply<F, SWAP>(H::widen(x[t]), y_at<H>(y, mode, s, t, m));
}

#define HALF_V1_UNROLL 4

template <typename H, typename F, bool SWAP>
__device__ __forceinline__ void binary_v1(const u16* __restrict__ x, const u16* __restrict__ y,
                                          typename F::T* __restrict__ out, long long n, int mode, long long m,
                                          float s) {
    const long long step = (long long)gridDim.x * blockDim.x * HALF_V1_UNROLL;
    for (long long base = (long long)blockIdx.x * blockDim.x * HALF_V1_UNROLL + threadIdx.x; base < n;
         base += step) {
        float a[HALF_V1_UNROLL], b[HALF_V1_UNROLL];
#pragma unroll
        for (int u = 0; u < HALF_V1_UNROLL; ++u) {  // every load in flight before the first store
            const long long j = base + (long long)u * blockDim.x;
            if (j < n) {
                a[u] = H::widen(x[j]);
                b[u] = y_at<H>(y, mode, s, j, m);
            }
        }
#pragma unroll
        for (int u = 0; u < HALF_V1_UNROLL; ++u) {
            const long long j = base + (long long)u * blockDim.x;
            if (j < n) out[j] = apply<F, SWAP>(a[u], b[u]);
        }
    }
}

template <typename H, typename F, bool SWAP, int VEC>
__device__ __forceinline__ void binary(const u16* __restrict__ x, const u16* __restrict__ y,
                                       typename F::T* __restrict__ out, long long n, int mode, long long m,
                                       float s) {
    if constexpr (VEC == 8) binary_v8<H, F, SWAP>(x, y, out, n, mode, m, s);
    else binary_v1<H, F, SWAP>(x, y, out, n, mode, m, s);
}

// The op and the operand order chosen once per launch (uniform over the grid), outside the loops.
template <typename H, bool SWAP, int VEC>
__device__ __forceinline__ void arith_ordered(const u16* x, const u16* y, u16* out, long long n, int mode,
                                              long long m, float s, int op) {
    switch (op) {
        case 0: binary<H, Rounded<H, OpAdd>, SWAP, VEC>(x, y, out, n, mode, m, s); break;
        case 1: binary<H, Rounded<H, OpSub>, SWAP, VEC>(x, y, out, n, mode, m, s); break;
        case 2: binary<H, Rounded<H, OpMul>, SWAP, VEC>(x, y, out, n, mode, m, s); break;
        case 3: binary<H, Rounded<H, OpDiv>, SWAP, VEC>(x, y, out, n, mode, m, s); break;
        case 4: binary<H, Rounded<H, OpMaximum>, SWAP, VEC>(x, y, out, n, mode, m, s); break;
        case 5: binary<H, Rounded<H, OpMinimum>, SWAP, VEC>(x, y, out, n, mode, m, s); break;
        default: binary<H, Rounded<H, OpPow>, SWAP, VEC>(x, y, out, n, mode, m, s); break;
    }
}

// Comparisons never swap: the host mirrors the operator (y < x is x > y), exact for a bool result.
template <typename H, int VEC>
__device__ __forceinline__ void compare(const u16* x, const u16* y, u8* out, long long n, int mode, long long m,
                                        float s, int op) {
    switch (op) {
        case 0: binary<H, OpEq, false, VEC>(x, y, out, n, mode, m, s); break;
        case 1: binary<H, OpNe, false, VEC>(x, y, out, n, mode, m, s); break;
        case 2: binary<H, OpLt, false, VEC>(x, y, out, n, mode, m, s); break;
        case 3: binary<H, OpLe, false, VEC>(x, y, out, n, mode, m, s); break;
        case 4: binary<H, OpGt, false, VEC>(x, y, out, n, mode, m, s); break;
        default: binary<H, OpGe, false, VEC>(x, y, out, n, mode, m, s); break;
    }
}

// A scalar's value: *y for a device scalar, else the host's float.
template <typename H> __device__ __forceinline__ float scalar_of(const u16* y, int mode, float ys) {
    return mode == Y_DEVICE_SCALAR ? H::widen(*y) : ys;
}

template <typename H, typename Op>
__device__ __forceinline__ void unary_v8(const u16* __restrict__ x, u16* __restrict__ out, long long n, float p) {
    const long long nv = n >> 3;
    const long long tid = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    const long long stride = (long long)gridDim.x * blockDim.x;
    for (long long v = tid; v < nv; v += stride) {
        const long long i = v << 3;
        float a[8];
        load8<H>(x + i, a);
        u16 r[8];
#pragma unroll
        for (int k = 0; k < 8; ++k) r[k] = H::narrow(Op::f(a[k], p));
        store8(out + i, r);
    }
    const long long t = (nv << 3) + tid;
    if (t < n) out[t] = H::narrow(Op::f(H::widen(x[t]), p));
}

template <typename H, typename Op>
__device__ __forceinline__ void unary_v1(const u16* __restrict__ x, u16* __restrict__ out, long long n, float p) {
    const long long step = (long long)gridDim.x * blockDim.x * HALF_V1_UNROLL;
    for (long long base = (long long)blockIdx.x * blockDim.x * HALF_V1_UNROLL + threadIdx.x; base < n;
         base += step) {
        float a[HALF_V1_UNROLL];
#pragma unroll
        for (int u = 0; u < HALF_V1_UNROLL; ++u) {
            const long long j = base + (long long)u * blockDim.x;
            if (j < n) a[u] = H::widen(x[j]);
        }
#pragma unroll
        for (int u = 0; u < HALF_V1_UNROLL; ++u) {
            const long long j = base + (long long)u * blockDim.x;
            if (j < n) out[j] = H::narrow(Op::f(a[u], p));
        }
    }
}

template <typename H, typename Op, int VEC>
__device__ __forceinline__ void unary_loop(const u16* x, u16* out, long long n, float p) {
    if constexpr (VEC == 8) unary_v8<H, Op>(x, out, n, p);
    else unary_v1<H, Op>(x, out, n, p);
}

template <typename H, int VEC>
__device__ __forceinline__ void unary(const u16* x, u16* out, long long n, int op, float p) {
    switch (op) {
        case 0: unary_loop<H, OpNeg, VEC>(x, out, n, p); break;
        case 1: unary_loop<H, OpAbs, VEC>(x, out, n, p); break;
        case 2: unary_loop<H, OpExp, VEC>(x, out, n, p); break;
        case 3: unary_loop<H, OpExpm1, VEC>(x, out, n, p); break;
        case 4: unary_loop<H, OpLog, VEC>(x, out, n, p); break;
        case 5: unary_loop<H, OpLog1p, VEC>(x, out, n, p); break;
        case 6: unary_loop<H, OpSqrt, VEC>(x, out, n, p); break;
        case 7: unary_loop<H, OpRsqrt, VEC>(x, out, n, p); break;
        case 8: unary_loop<H, OpTanh, VEC>(x, out, n, p); break;
        case 9: unary_loop<H, OpSin, VEC>(x, out, n, p); break;
        case 10: unary_loop<H, OpCos, VEC>(x, out, n, p); break;
        case 11: unary_loop<H, OpRelu, VEC>(x, out, n, p); break;
        case 12: unary_loop<H, OpSquare, VEC>(x, out, n, p); break;
        case 13: unary_loop<H, OpReciprocal, VEC>(x, out, n, p); break;
        default: unary_loop<H, OpPowScalar, VEC>(x, out, n, p); break;
    }
}

#define HALF_VEC_KERNELS(DT, H, VNAME, VEC)                                                                   \
    extern "C" __global__ void __launch_bounds__(256) half_binary_##DT##_ff_##VNAME(                          \
        const u16* __restrict__ x, const u16* __restrict__ y, u16* __restrict__ out, long long n, int op) {      \
        arith_ordered<H, false, VEC>(x, y, out, n, Y_FULL, 0, 0.0f, op);                                      \
    }                                                                                                         \
    extern "C" __global__ void __launch_bounds__(256) half_binary_##DT##_fb_##VNAME(                          \
        const u16* __restrict__ x, const u16* __restrict__ y, u16* __restrict__ out, long long n, int mode,      \
        long long m, float ys, int op, int swap) {                                                            \
        const float s = scalar_of<H>(y, mode, ys);                                                            \
        if (swap) arith_ordered<H, true, VEC>(x, y, out, n, mode, m, s, op);                                  \
        else arith_ordered<H, false, VEC>(x, y, out, n, mode, m, s, op);                                      \
    }                                                                                                         \
    extern "C" __global__ void __launch_bounds__(256) half_compare_##DT##_ff_##VNAME(                         \
        const u16* __restrict__ x, const u16* __restrict__ y, u8* __restrict__ out, long long n, int op) {       \
        compare<H, VEC>(x, y, out, n, Y_FULL, 0, 0.0f, op);                                                   \
    }                                                                                                         \
    extern "C" __global__ void __launch_bounds__(256) half_compare_##DT##_fb_##VNAME(                         \
        const u16* __restrict__ x, const u16* __restrict__ y, u8* __restrict__ out, long long n, int mode,       \
        long long m, float ys, int op) {                                                                      \
        compare<H, VEC>(x, y, out, n, mode, m, scalar_of<H>(y, mode, ys), op);                                \
    }                                                                                                         \
    extern "C" __global__ void __launch_bounds__(256)                                                         \
        half_unary_##DT##_##VNAME(const u16* __restrict__ x, u16* __restrict__ out, long long n, int op,       \
                                  float p) {                                                                  \
        unary<H, VEC>(x, out, n, op, p);                                                                      \
    }

HALF_VEC_KERNELS(bf16, BF16, v8, 8)
HALF_VEC_KERNELS(bf16, BF16, v1, 1)
HALF_VEC_KERNELS(f16, F16, v8, 8)
HALF_VEC_KERNELS(f16, F16, v1, 1)
