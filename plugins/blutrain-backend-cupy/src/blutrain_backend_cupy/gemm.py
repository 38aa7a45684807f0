"""GEMM on the "cuda" device through cuBLAS.

Matrix × matrix products (what linear layers and their gradients are) call cublasGemmEx through this
module's own binding of the libcublas CuPy loaded: CuPy refuses every cuBLAS call while a stream is
being captured into a CUDA graph (CuPy 14.2: "calling cuBLAS API during stream capture is currently
unsupported"), and the compiled training step is one captured graph. cuBLAS itself captures GEMMs
given a workspace of its own, set again after each stream binding (which resets it). Vector and batched products, and
float64, go through CuPy's matmul.

A GEMM with a bias or an addend (``linear``'s bias, ``linear_add``'s residual) runs through cuBLASLt
(same library, bound the same way): its epilogue adds both while the tile is in registers, so neither
is a pass over memory of its own. Plans (descriptors, layouts and the heuristic's algorithm) are made
once per shape and reused; a call sets the bias pointer and launches.

float32 is strict by default (CUBLAS_COMPUTE_32F): TF32 rounds operands to 10 mantissa bits and
is used only when asked, through :func:`set_tf32` or CuPy's own ``CUPY_TF32=1``. bfloat16 and
float16 operands accumulate in float32 (CUBLAS_COMPUTE_32F on tensor cores).
"""

from __future__ import annotations

import math
import os
from typing import Any

import numpy as np

from blutrain.kernels import cuda as fused
from blutrain.tensor.dtype import HALF_NAMES, as_dtype, bfloat16

Array = Any
_tf32 = False


def tf32_requested_by_env() -> bool | None:
    """CuPy's switch ``CUPY_TF32`` (1: on, 0: off), or None when unset: the setting then stays as it is (off
    unless :func:`set_tf32` turned it on, which the backend's registration must not undo)."""
    value = os.environ.get("CUPY_TF32", "")
    return int(value) > 0 if value else None


def set_tf32(enabled: bool) -> None:
    """Let float32 GEMMs round their operands to TF32 (about 3e-4 relative error, several times faster)."""
    global _tf32
    from cupy._core import _routines_linalg as linalg

    linalg.set_compute_type(np.float32, linalg.COMPUTE_TYPE_TF32 if enabled else linalg.COMPUTE_TYPE_DEFAULT)
    _tf32 = bool(enabled)


def tf32_enabled() -> bool:
    return _tf32


# float32 GEMMs as strict cuBLAS SGEMM ("cublas", the default) or as BluTrain's 3xTF32 tensor-core kernel
# ("3xtf32": float32 accuracy at up to ~3x SGEMM's rate; opt-in: by default float32 GEMMs are cuBLAS's own). TF32, when
# asked for, takes precedence: it is the less accurate, faster mode the user chose.
FP32_GEMMS = ("cublas", "3xtf32")
_fp32_gemm = "cublas"


def set_fp32_gemm(kind: str) -> None:
    """How float32 matrix products run: ``"cublas"`` (strict SGEMM) or ``"3xtf32"`` (BluTrain's kernel)."""
    global _fp32_gemm
    if kind not in FP32_GEMMS:
        raise ValueError(f"set_fp32_gemm: kind must be one of {FP32_GEMMS}, got {kind!r}")
    _fp32_gemm = kind


def fp32_gemm() -> str:
    return _fp32_gemm


# SMs that GEMMs leave to kernels running beside them (NCCL's collectives under backward take one SM per CTA,
# 24 on 4 H100s): cuBLAS and cuBLASLt then choose their algorithm for the SMs that are left (a persistent
# kernel sized for every SM would otherwise wait for a second wave); 0, the default, plans for all of them.
# Read when a plan is made: a compiled step keeps the algorithms of its capture.
_sm_carveout = 0


def set_gemm_sm_carveout(sms: int) -> None:
    """Plan GEMMs for the device's SM count less ``sms`` (0: every SM), as ``BLUTRAIN_GEMM_SM_CARVEOUT`` does."""
    global _sm_carveout
    if not isinstance(sms, int) or isinstance(sms, bool) or sms < 0:
        raise ValueError(f"set_gemm_sm_carveout: sms must be an int >= 0, got {sms!r}")
    _sm_carveout = sms


def gemm_sm_carveout() -> int:
    return _sm_carveout


def gemm_sm_carveout_requested_by_env() -> int | None:
    """``BLUTRAIN_GEMM_SM_CARVEOUT`` as an int, or None when unset; anything but an int >= 0 is refused."""
    raw = os.environ.get("BLUTRAIN_GEMM_SM_CARVEOUT", "")
    if not raw:
        return None
    if not raw.isdigit():
        raise ValueError(f"BLUTRAIN_GEMM_SM_CARVEOUT must be a number of SMs >= 0, got {raw!r}; unset it to "
                         "plan GEMMs for every SM")
    return int(raw)


# Per device: [SMs, products] of the last reserve_sms call: the next ``products`` GEMMs on the device are planned
# for ``SMs`` fewer SMs (a collective launched beside them holds them while it runs). Each plan made counts one.
_RESERVED: dict[int, list[int]] = {}


def reserve_sms(dev: int, sms: int, products: int) -> None:
    """Plan the next ``products`` GEMMs on device ``dev`` for its SM count less ``sms`` (the backend's
    ``reserve_sms``); a later call replaces an earlier one's remainder. ``products`` 0 cancels."""
    for name, value in (("sms", sms), ("products", products)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            raise ValueError(f"reserve_sms: {name} must be an int >= 0, got {value!r}")
    if sms and products:
        _RESERVED[dev] = [sms, products]
    else:
        _RESERVED.pop(dev, None)


def _sm_target(dev: int | None = None) -> int:
    """The SM count the next GEMM on ``dev`` (None: the current device) is planned for: 0 (the device's own)
    without a carve-out or a reservation, asking nothing of the runtime then (every GEMM asks). A GEMM
    planned under a reservation counts against it."""
    if not _sm_carveout and not _RESERVED:
        return 0
    if dev is None:
        import cupy as cp

        dev = int(cp.cuda.runtime.getDevice())
    leave = _sm_carveout
    reserved = _RESERVED.get(dev)
    if reserved is not None:
        leave = max(leave, reserved[0])
        reserved[1] -= 1
        if reserved[1] <= 0:
            del _RESERVED[dev]
    if not leave:
        return 0
    count = _SM_COUNTS.get(dev)
    if count is None:
        import cupy as cp

        count = _SM_COUNTS[dev] = int(cp.cuda.runtime.getDeviceProperties(dev)["multiProcessorCount"])
    return max(1, count - leave)


def fp32_gemm_requested_by_env() -> str | None:
    """``BLUTRAIN_FP32_GEMM``, or None when unset (the setting then stays as :func:`set_fp32_gemm` left it,
    "cublas" by default); an unknown value is refused when the backend registers."""
    return os.environ.get("BLUTRAIN_FP32_GEMM", "") or None


# ---------------------------------------------------------------------------------------------- cublasGemmEx

_CUDA_DTYPE = {"float32": 0, "float16": 2, "bfloat16": 14}  # cudaDataType: CUDA_R_32F, _16F, _16BF
_TYPE_CODES = {np.dtype(np.float32): 0, np.dtype(np.float16): 2, np.dtype(bfloat16.np): 14}  # by dtype
_COMPUTE_32F, _COMPUTE_32F_FAST_TF32 = 68, 77  # cublasComputeType_t
_OP_N, _OP_T = 0, 1
_ALGO_DEFAULT = -1
# alpha and beta: cuBLAS reads them on the host during the call (the handle's default pointer mode); the
# arrays live as long as the module, so their addresses are taken once
_ONE = np.ones((), np.float32)
_ZERO = np.zeros((), np.float32)
_ONE_PTR, _ZERO_PTR = _ONE.ctypes.data, _ZERO.ctypes.data


class CublasError(RuntimeError):
    """A cuBLAS call returned an error status."""


_LIB: dict[str, Any] = {}
_SM_COUNTS: dict[int, int] = {}  # per device: its SM count (for a carve-out)
_HANDLE_SM_TARGETS: dict[int, int] = {}  # per cuBLAS handle: the SM count target last set on it
_WORKSPACES: dict[int, Any] = {}  # per device: the workspace cuBLAS and cuBLASLt are given (kept alive here)
WORKSPACE_BYTES = 32 * 2**20  # what PyTorch gives cuBLAS on Hopper


def _cublas() -> Any:
    """The libcublas CuPy loaded, bound with ctypes (found among this process's mapped libraries)."""
    lib = _LIB.get("cublas")
    if lib is None:
        import ctypes

        import cupy as cp

        cp.cuda.device.get_cublas_handle()  # CuPy loads and initialises cuBLAS
        with open("/proc/self/maps") as maps:
            paths = {line.split()[-1] for line in maps if "/libcublas.so" in line}
        if not paths:
            raise CublasError("libcublas is not among this process's libraries (CuPy loaded no cuBLAS)")
        lib = ctypes.CDLL(sorted(paths)[0])
        ptr, i32 = ctypes.c_void_p, ctypes.c_int
        lib.cublasSetStream_v2.argtypes = [ptr, ptr]
        lib.cublasSetWorkspace_v2.argtypes = [ptr, ptr, ctypes.c_size_t]
        lib.cublasGemmEx.argtypes = [ptr, i32, i32, i32, i32, i32, ptr, ptr, i32, i32, ptr, i32, i32, ptr, ptr, i32,
                                     i32, i32, i32]
        lib.cublasSetSmCountTarget.argtypes = [ptr, i32]
        for fn in (lib.cublasSetStream_v2, lib.cublasSetWorkspace_v2, lib.cublasGemmEx, lib.cublasSetSmCountTarget):
            fn.restype = i32
        _LIB["cublas"] = lib
    return lib


def _check(status: int, call: str) -> None:
    if status:
        raise CublasError(f"{call} returned cuBLAS status {status}")


def _handle(lib: Any) -> int:
    """CuPy's cuBLAS handle of the current device, bound to the current stream, with a workspace."""
    import cupy as cp

    handle = int(cp.cuda.device.get_cublas_handle())
    space = _workspace()
    _check(lib.cublasSetStream_v2(handle, cp.cuda.get_current_stream().ptr), "cublasSetStream")
    # after the stream: cublasSetStream puts the handle back on cuBLAS's own workspace pool
    _check(lib.cublasSetWorkspace_v2(handle, space.data.ptr, WORKSPACE_BYTES), "cublasSetWorkspace")
    target = _sm_target()
    if _HANDLE_SM_TARGETS.get(handle, 0) != target:
        _check(lib.cublasSetSmCountTarget(handle, target), "cublasSetSmCountTarget")
        _HANDLE_SM_TARGETS[handle] = target
    return handle


def _workspace() -> Any:
    """The current device's GEMM workspace, shared by cuBLAS and cuBLASLt (their calls on a stream run
    in order, so one buffer serves both)."""
    import cupy as cp

    dev = cp.cuda.runtime.getDevice()
    space = _WORKSPACES.get(dev)
    if space is None:
        space = _WORKSPACES[dev] = cp.empty((WORKSPACE_BYTES,), np.uint8)
    return space


def _row_major(a: Array, trans: bool) -> tuple[Array, bool]:
    """``a`` as a C-contiguous matrix and whether to transpose it: a transposed view (F-contiguous) is
    its C-contiguous base, transposed; anything else strided is copied."""
    if a.flags.c_contiguous:
        return a, trans
    if a.flags.f_contiguous:
        return a.T, not trans
    import cupy as cp

    return cp.ascontiguousarray(a), trans


def gemm_into(a: Array, b: Array, out: Array, *, trans_a: bool = False, trans_b: bool = False,
              accumulate: bool = False, bias: Array | None = None, addend: Array | None = None) -> None:
    """``out = op(a) @ op(b)`` (``+=`` with ``accumulate``) in one cublasGemmEx that accumulates in float32
    whatever the dtypes: bfloat16 operands can write a float32 result, and a sum of products over chunks
    stays in float32 without a temporary. ``a`` and ``b`` may be transposed views; ``out`` is C-contiguous.

    ``bias`` (a vector over out's columns, out's dtype) and ``addend`` (a matrix like out, read in place
    of out's old values: ``out = addend + op(a) @ op(b) + bias``) are added by cuBLASLt's epilogue to
    the float32 accumulators; where cuBLASLt has no algorithm for the case (or float32 runs as 3xTF32)
    they are added by a copy before and an add after the GEMM, with the same values to rounding.

    cuBLAS is column-major: a row-major (r, c) matrix is its (c, r) transpose there, so the row-major
    ``out`` (m, n) is computed as the column-major ``outᵀ = op(b)ᵀ op(a)ᵀ``.
    """
    a, trans_a = _row_major(a, trans_a)
    b, trans_b = _row_major(b, trans_b)
    m, k = (a.shape[1], a.shape[0]) if trans_a else (a.shape[0], a.shape[1])
    kb, n = (b.shape[1], b.shape[0]) if trans_b else (b.shape[0], b.shape[1])
    if kb != k or out.shape != (m, n):
        raise ValueError(f"gemm_into: op(a) {m}x{k} times op(b) {kb}x{n} does not fit out {tuple(out.shape)}")
    codes = []
    for name, arr in (("a", a), ("b", b), ("out", out)):
        code = _TYPE_CODES.get(arr.dtype)
        if code is None or arr.ndim != 2 or not arr.flags.c_contiguous:
            raise ValueError(f"gemm_into: {name} must be a contiguous float32/float16/bfloat16 matrix, got "
                             f"{arr.dtype.name} {tuple(arr.shape)} with strides {arr.strides}")
        codes.append(code)
    if a.dtype != b.dtype:
        raise ValueError(f"gemm_into: a and b must have one dtype, got {a.dtype.name} and {b.dtype.name}")
    if bias is not None and (bias.shape != (n,) or bias.dtype != out.dtype or not bias.flags.c_contiguous):
        raise ValueError(f"gemm_into: bias must be a contiguous vector of {n} {out.dtype.name}, got "
                         f"{bias.dtype.name} {tuple(bias.shape)}")
    if addend is not None:
        if accumulate:
            raise ValueError("gemm_into: addend replaces out's old values; it cannot go with accumulate=True")
        if addend.shape != out.shape or addend.dtype != out.dtype or not addend.flags.c_contiguous:
            raise ValueError(f"gemm_into: addend must be a contiguous {out.dtype.name} matrix of out's shape "
                             f"{tuple(out.shape)}, got {addend.dtype.name} {tuple(addend.shape)}")
        if addend.data.ptr == out.data.ptr:
            addend, accumulate = None, True
    if m == 0 or n == 0:
        return
    strict = not (_tf32 and codes[0] == 0)
    three_tf32 = _fp32_gemm == "3xtf32" and not _tf32 and codes == [0, 0, 0]
    if (k > 0 and (bias is not None or addend is not None) and not three_tf32
            and _lt_matmul(a, b, out, trans_a, trans_b, codes, strict, bias, addend, accumulate)):
        return
    if addend is not None:
        out[...] = addend
        accumulate = True
    _gemm(a, b, out, trans_a, trans_b, codes, strict, accumulate, three_tf32, k)
    if bias is not None:
        out += bias


def _gemm(a: Array, b: Array, out: Array, trans_a: bool, trans_b: bool, codes: list[int], strict: bool,
          accumulate: bool, three_tf32: bool, k: int) -> None:
    """``out (+)= op(a) @ op(b)`` by BluTrain's 3xTF32 kernel where asked for float32, else cublasGemmEx."""
    if k == 0:
        if not accumulate:
            out.fill(0)
        return
    if three_tf32 and fused.gemm_3xtf32(a, b, out, trans_a, trans_b, accumulate):
        return
    lib = _cublas()
    _check(lib.cublasGemmEx(
        _handle(lib), _OP_T if trans_b else _OP_N, _OP_T if trans_a else _OP_N, out.shape[1], out.shape[0], k,
        _ONE_PTR, b.data.ptr, codes[1], b.shape[1], a.data.ptr, codes[0], a.shape[1],
        _ONE_PTR if accumulate else _ZERO_PTR, out.data.ptr, codes[2], out.shape[1],
        _COMPUTE_32F if strict else _COMPUTE_32F_FAST_TF32, _ALGO_DEFAULT), "cublasGemmEx")


# ---------------------------------------------------------------------------------------------- cuBLASLt

# cublasLt.h: matmul descriptor and preference attributes, epilogues
_DESC_TRANSA, _DESC_TRANSB, _DESC_EPILOGUE, _DESC_BIAS_POINTER = 3, 4, 7, 8
_DESC_EPILOGUE_AUX_POINTER, _DESC_EPILOGUE_AUX_LD = 11, 12
_DESC_SM_COUNT_TARGET = 15  # int32; 0: the device's SM count
_EPILOGUE_DEFAULT, _EPILOGUE_BIAS, _EPILOGUE_GELU_AUX, _EPILOGUE_GELU_AUX_BIAS = 1, 4, 160, 164
_PREF_MAX_WORKSPACE_BYTES = 1
_PREF_MIN_ALIGNMENT = (5, 6, 7, 8)  # of A, B, C, D in bytes
# cublasLtMatmulHeuristicResult_t: the algorithm (64 bytes), workspaceSize, state, wavesCount, reserved[4]
_HEURISTIC_BYTES, _HEURISTIC_STATE = 96, 72
_LT_PLANS: dict[tuple[Any, ...], Any] = {}
_LT_HANDLES: dict[int, int] = {}


def _cublaslt() -> Any:
    """The libcublasLt that CuPy's libcublas loaded with it, bound with ctypes."""
    lib = _LIB.get("cublasLt")
    if lib is None:
        import ctypes

        _cublas()
        with open("/proc/self/maps") as maps:
            paths = {line.split()[-1] for line in maps if "/libcublasLt.so" in line}
        if not paths:
            raise CublasError("libcublasLt is not among this process's libraries (CuPy's libcublas loaded none)")
        lib = ctypes.CDLL(sorted(paths)[0])
        ptr, i32, out_ptr = ctypes.c_void_p, ctypes.c_int, ctypes.POINTER(ctypes.c_void_p)
        size, u64, i64 = ctypes.c_size_t, ctypes.c_uint64, ctypes.c_int64
        lib.cublasLtCreate.argtypes = [out_ptr]
        lib.cublasLtMatmulDescCreate.argtypes = [out_ptr, i32, i32]
        lib.cublasLtMatmulDescSetAttribute.argtypes = [ptr, i32, ptr, size]
        lib.cublasLtMatrixLayoutCreate.argtypes = [out_ptr, i32, u64, u64, i64]
        lib.cublasLtMatmulPreferenceCreate.argtypes = [out_ptr]
        lib.cublasLtMatmulPreferenceSetAttribute.argtypes = [ptr, i32, ptr, size]
        lib.cublasLtMatmulAlgoGetHeuristic.argtypes = [ptr, ptr, ptr, ptr, ptr, ptr, ptr, i32, ptr,
                                                       ctypes.POINTER(i32)]
        lib.cublasLtMatmul.argtypes = [ptr, ptr, ptr, ptr, ptr, ptr, ptr, ptr, ptr, ptr, ptr, ptr, ptr, ptr, size, ptr]
        for fn in (lib.cublasLtCreate, lib.cublasLtMatmulDescCreate, lib.cublasLtMatmulDescSetAttribute,
                   lib.cublasLtMatrixLayoutCreate, lib.cublasLtMatmulPreferenceCreate,
                   lib.cublasLtMatmulPreferenceSetAttribute, lib.cublasLtMatmulAlgoGetHeuristic, lib.cublasLtMatmul):
            fn.restype = i32
        _LIB["cublasLt"] = lib
    return lib


def _alignment(ptr: int) -> int:
    """The largest power of two (at most 256, cuBLASLt's default) that ``ptr`` is a multiple of."""
    return min(256, ptr & -ptr) if ptr else 256


class _LtPlan:
    """One cuBLASLt problem (shapes, dtypes, transposes, epilogue, alignments): its descriptors and the
    algorithm the heuristic chose, kept for every later call of the same problem."""

    __slots__ = ("algo", "aux_ptr", "bias_ptr", "desc", "layouts")

    def __init__(self, lib: Any, handle: int, problem: tuple[Any, ...]) -> None:
        import ctypes

        (trans_a, trans_b, a_shape, b_shape, out_shape, codes, strict, epilogue, _beta, aligns, sm_target) = problem
        void = ctypes.c_void_p

        def attr(setter: Any, obj: Any, name: int, value: Any, call: str) -> None:
            _check(setter(obj, name, ctypes.byref(value), ctypes.sizeof(value)), call)

        desc = void()
        _check(lib.cublasLtMatmulDescCreate(ctypes.byref(desc), _COMPUTE_32F if strict else _COMPUTE_32F_FAST_TF32,
                                            _CUDA_DTYPE["float32"]), "cublasLtMatmulDescCreate")
        # cuBLAS's A is the row-major b, its B the row-major a (see gemm_into)
        set_desc, set_pref = lib.cublasLtMatmulDescSetAttribute, lib.cublasLtMatmulPreferenceSetAttribute
        for name, value in ((_DESC_TRANSA, _OP_T if trans_b else _OP_N),
                            (_DESC_TRANSB, _OP_T if trans_a else _OP_N), (_DESC_EPILOGUE, epilogue)):
            attr(set_desc, desc, name, ctypes.c_int32(value), "cublasLtMatmulDescSetAttribute")
        if sm_target:
            attr(set_desc, desc, _DESC_SM_COUNT_TARGET, ctypes.c_int32(sm_target), "cublasLtMatmulDescSetAttribute")
        if epilogue in (_EPILOGUE_GELU_AUX, _EPILOGUE_GELU_AUX_BIAS):  # the pre-activation, laid out like D
            attr(set_desc, desc, _DESC_EPILOGUE_AUX_LD, ctypes.c_int64(out_shape[1]), "cublasLtMatmulDescSetAttribute")
        layouts = []
        for code, (rows, cols) in ((codes[1], b_shape), (codes[0], a_shape), (codes[2], out_shape),
                                   (codes[2], out_shape)):
            layout = void()
            _check(lib.cublasLtMatrixLayoutCreate(ctypes.byref(layout), code, cols, rows, cols),
                   "cublasLtMatrixLayoutCreate")
            layouts.append(layout)
        pref = void()
        _check(lib.cublasLtMatmulPreferenceCreate(ctypes.byref(pref)), "cublasLtMatmulPreferenceCreate")
        attr(set_pref, pref, _PREF_MAX_WORKSPACE_BYTES, ctypes.c_uint64(WORKSPACE_BYTES),
             "cublasLtMatmulPreferenceSetAttribute")
        for name, align in zip(_PREF_MIN_ALIGNMENT, aligns, strict=True):
            attr(set_pref, pref, name, ctypes.c_uint32(align), "cublasLtMatmulPreferenceSetAttribute")
        result = (ctypes.c_char * _HEURISTIC_BYTES)()
        found = ctypes.c_int(0)
        status = lib.cublasLtMatmulAlgoGetHeuristic(handle, desc, *layouts, pref, 1, result, ctypes.byref(found))
        state = int.from_bytes(bytes(result)[_HEURISTIC_STATE:_HEURISTIC_STATE + 4], "little")
        self.desc, self.layouts = desc, layouts
        self.algo = result if status == 0 and found.value > 0 and state == 0 else None
        self.bias_ptr = void(0)
        self.aux_ptr = void(0)


def _lt_matmul(a: Array, b: Array, out: Array, trans_a: bool, trans_b: bool, codes: list[int], strict: bool,
               bias: Array | None, addend: Array | None, accumulate: bool, aux: Array | None = None) -> bool:
    """``out = [addend or out if accumulate +] op(a) @ op(b) [+ bias]`` by cublasLtMatmul, or with ``aux``
    ``aux = op(a) @ op(b) [+ bias]; out = gelu_tanh(aux)``; False where cuBLASLt has no algorithm for the
    problem (the caller then runs cuBLAS and the elementwise kernels)."""
    import ctypes

    import cupy as cp

    lib = _cublaslt()
    dev = cp.cuda.runtime.getDevice()
    handle = _LT_HANDLES.get(dev)
    if handle is None:
        h = ctypes.c_void_p()
        _check(lib.cublasLtCreate(ctypes.byref(h)), "cublasLtCreate")
        handle = _LT_HANDLES[dev] = int(h.value or 0)
    c = addend if addend is not None else out
    has_c = addend is not None or accumulate
    aligns = (_alignment(b.data.ptr), _alignment(a.data.ptr), _alignment(c.data.ptr), _alignment(out.data.ptr))
    if aux is not None:
        epilogue = _EPILOGUE_GELU_AUX if bias is None else _EPILOGUE_GELU_AUX_BIAS
        aligns = (*aligns[:3], min(aligns[3], _alignment(aux.data.ptr)))
    else:
        epilogue = _EPILOGUE_DEFAULT if bias is None else _EPILOGUE_BIAS
    problem = (trans_a, trans_b, a.shape, b.shape, out.shape, tuple(codes), strict, epilogue, has_c, aligns,
               _sm_target(dev))
    key = (dev, problem)
    plan = _LT_PLANS.get(key)
    if plan is None:
        plan = _LT_PLANS[key] = _LtPlan(lib, handle, problem)
    if plan.algo is None:
        return False
    if bias is not None:
        if bias.data.ptr % 16:  # a vector inside a flat buffer: given to the epilogue from an aligned copy
            bias = bias.copy()
        plan.bias_ptr.value = bias.data.ptr
        _check(lib.cublasLtMatmulDescSetAttribute(plan.desc, _DESC_BIAS_POINTER, ctypes.byref(plan.bias_ptr),
                                                  ctypes.sizeof(plan.bias_ptr)), "cublasLtMatmulDescSetAttribute")
    if aux is not None:
        plan.aux_ptr.value = aux.data.ptr
        _check(lib.cublasLtMatmulDescSetAttribute(plan.desc, _DESC_EPILOGUE_AUX_POINTER, ctypes.byref(plan.aux_ptr),
                                                  ctypes.sizeof(plan.aux_ptr)), "cublasLtMatmulDescSetAttribute")
    la, lb, lc, ld = plan.layouts
    space = _workspace()
    _check(lib.cublasLtMatmul(handle, plan.desc, _ONE_PTR, b.data.ptr, la, a.data.ptr, lb,
                              _ONE_PTR if has_c else _ZERO_PTR, c.data.ptr, lc, out.data.ptr, ld, plan.algo,
                              space.data.ptr, WORKSPACE_BYTES, cp.cuda.get_current_stream().ptr), "cublasLtMatmul")
    return True


# ---------------------------------------------------------------------------------------------- ops


def _half_in_float32(a: Array, b: Array) -> Array:
    """CuPy sends bfloat16 vector and batched products down an integer tensordot path that does not know
    the dtype, and float16 vector products (dot) accumulate in float16 (~7 ulps off over 13 terms; both
    with CuPy 14.2): those are computed in float32 and rounded once."""
    import cupy as cp

    return cp.matmul(a.astype(np.float32), b.astype(np.float32)).astype(a.dtype)


def matmul(a: Array, b: Array) -> Array:
    import cupy as cp

    if a.ndim > 2 and b.ndim == 2 and a.dtype.name in _CUDA_DTYPE:
        # a weight applied to batched rows: one matrix product over the folded rows
        return matmul(_rows(a), b).reshape((*a.shape[:-1], b.shape[1]))
    if a.ndim == 2 and b.ndim == 2 and _gemm_fits(a, b):
        out = cp.empty((a.shape[0], b.shape[1]), a.dtype)
        gemm_into(a, b, out)
        return out
    if a.dtype.name in HALF_NAMES:
        return _half_in_float32(a, b)
    return cp.matmul(a, b)


def _gemm_fits(a: Array, b: Array) -> bool:
    """A product :func:`gemm_into` takes: same float32/bfloat16/float16 dtype, int32 sizes."""
    return (a.dtype == b.dtype and a.dtype.name in _CUDA_DTYPE
            and max(*a.shape, *b.shape) < 2**31 and a.size < 2**62)


def _rows(a: Array) -> Array:
    """``a`` as a matrix, leading dims folded into rows (explicit sizes: 0-size dims work)."""
    return a.reshape(math.prod(a.shape[:-1]), a.shape[-1])


def linear(x: Array, w: Array, b: Array | None) -> Array:
    """``x Wᵀ + b`` with batch dims folded into rows: one GEMM (Wᵀ is a transposed view, no copy) whose
    epilogue adds the bias."""
    import cupy as cp

    xr = _rows(x)
    if b is not None and _gemm_fits(xr, w) and b.dtype == x.dtype:
        out = cp.empty((xr.shape[0], w.shape[0]), x.dtype)
        gemm_into(xr, w, out, trans_b=True, bias=cp.ascontiguousarray(b))
    else:
        out = matmul(xr, w.T)
        if b is not None:
            out += b
    return out.reshape((*x.shape[:-1], w.shape[0]))


def linear_gelu(x: Array, w: Array, b: Array | None, approximate: str) -> tuple[Array, Array]:
    """(gelu(pre), pre), pre = x Wᵀ + b. bfloat16/float16 with the tanh form: one cuBLASLt GEMM whose
    epilogue adds the bias, writes pre and applies GELU from the float32 accumulators. float32 stays on
    linear and BluTrain's GELU kernel (the epilogue's GELU is checked at half precision only)."""
    import cupy as cp

    from blutrain.tensor.cpu import elementwise as generic

    xr = _rows(x)
    shape = (*x.shape[:-1], w.shape[0])
    if (approximate == "tanh" and x.dtype.name in HALF_NAMES and _gemm_fits(xr, w) and xr.shape[0]
            and xr.shape[1] and w.shape[0] % 8 == 0 and (b is None or b.dtype == x.dtype)):
        out = cp.empty((xr.shape[0], w.shape[0]), x.dtype)
        pre = cp.empty_like(out)
        a, trans_a = _row_major(xr, False)
        bt, trans_b = _row_major(w, True)
        codes = [_TYPE_CODES[a.dtype], _TYPE_CODES[bt.dtype], _TYPE_CODES[out.dtype]]
        bias = None if b is None else cp.ascontiguousarray(b)
        if _lt_matmul(a, bt, out, trans_a, trans_b, codes, True, bias, None, False, aux=pre):
            return out.reshape(shape), pre.reshape(shape)
    pre = linear(x, w, b)
    out = fused.gelu(pre, approximate)
    return (generic.gelu(pre, approximate) if out is None else out), pre


def linear_add(residual: Array, x: Array, w: Array, b: Array | None) -> Array:
    """``residual + x Wᵀ + b`` in residual's dtype: one GEMM, whose epilogue reads the residual and adds
    the bias (see ``blutrain.tensor.linear_add``); half operands with a float32 residual write float32."""
    import cupy as cp

    xr = _rows(x)
    rows = _rows(residual)
    out = cp.empty(residual.shape, residual.dtype)
    if _gemm_fits(xr, w) and residual.dtype.name in _CUDA_DTYPE:
        # the bias in the residual's dtype (the compiler's gemm-epilogue pass may hand autocast's bf16 copy)
        bias = None if b is None else cp.ascontiguousarray(b.astype(residual.dtype, copy=False))
        gemm_into(xr, w, _rows(out), trans_b=True, addend=cp.ascontiguousarray(rows), bias=bias)
        return out
    # float64: CuPy's matmul, adds in eager order (product, bias, residual)
    prod = matmul(xr, w.T).astype(residual.dtype, copy=False)
    if b is not None:
        prod += b
    prod += rows
    return prod.reshape(residual.shape)


def linear_backward(grad: Array, x: Array, w: Array, need_x: bool, need_w: bool, need_b: bool,
                    wide_x: bool = False, wide_w: bool = False) -> tuple[Array | None, Array | None, Array | None]:
    """(dx, dW, db) of ``y = x Wᵀ + b``: dx = dy W, dW = dyᵀ x (two GEMMs), db = Σ dy (fused column sum).

    ``wide_x`` / ``wide_w``: dx / dW and db in float32 for half operands (autocast's float32 inputs),
    written by the GEMMs from their float32 accumulators.
    """
    import cupy as cp

    g = _rows(grad)
    xr = _rows(x)
    gx = gw = gb = None
    if need_x:
        if wide_x and _gemm_fits(g, w):
            gx = cp.empty((g.shape[0], w.shape[1]), np.float32)
            gemm_into(g, w, gx)
        else:
            gx = matmul(g, w)
        gx = gx.reshape(x.shape)
    if need_w:
        if wide_w and _gemm_fits(g, xr):
            gw = cp.empty(w.shape, np.float32)
            gemm_into(g, xr, gw, trans_a=True)
        else:
            gw = matmul(g.T, xr)
    if need_b:
        gb = fused.sum_cols(g)
        if gb is None and g.dtype.name == "float16":
            gb = g.sum(axis=0, dtype=np.float32).astype(g.dtype)  # accumulate in float32, round once
        elif gb is None:
            gb = g.sum(axis=0, dtype=g.dtype)
    half = x.dtype.name in HALF_NAMES
    if half and wide_x and gx is not None and gx.dtype != np.float32:
        gx = gx.astype(np.float32)
    if half and wide_w:
        gw = gw if gw is None or gw.dtype == np.float32 else gw.astype(np.float32)
        gb = gb if gb is None or gb.dtype == np.float32 else gb.astype(np.float32)
    return gx, gw, gb


def astype_by_kernel(v: Any, dtype: np.dtype[Any]) -> Any:
    """``v.astype(dtype)``, by the cast kernels where they cover it (a contiguous CuPy array of float32,
    bfloat16 or float16; bit-identical to the CPU backend's astype), else by CuPy."""
    import cupy as cp

    out = fused.cast(v, dtype) if type(v) is cp.ndarray else None
    return v.astype(dtype) if out is None else out


def _compute_operand(a: Array, dtype: np.dtype[Any]) -> Array:
    """``a`` in the GEMMs' compute dtype, C-contiguous. Under autocast that is a cast of float32 x and of the
    whole (tied) weight to bfloat16 every step: BluTrain's cast kernel (16-byte accesses, near copy speed)
    rather than CuPy's astype, which is well below copy speed (docs/kernels.md). Both round to nearest even,
    so the bits are the same but for a NaN: the cast kernel writes the quiet NaN of its sign (0x7fc0, as the
    CPU backend's astype), CuPy the canonical 0x7fff; either way a NaN operand makes NaN logits and loss."""
    import cupy as cp

    return cp.ascontiguousarray(a if a.dtype == dtype else astype_by_kernel(a, dtype))


def linear_cross_entropy(x: Array, w: Array, target: Array, ignore_index: int, label_smoothing: float, mean: bool,
                         compute: str, loss_dtype: str, need_x: bool, need_w: bool,
                         chunk_rows: int) -> tuple[Array, Array, Array | None, Array | None]:
    """The LM head and its loss chunk by chunk (see ``blutrain.tensor.linear_cross_entropy``): per chunk one
    GEMM writes the logits in the compute dtype, one kernel their loss rows and gradient, then two
    GEMMs the input gradient (written in x's dtype) and the weight gradient (accumulated in float32
    across chunks by cuBLAS's beta = 1). float32 or bfloat16 compute; anything else runs the generic
    kernel on CuPy."""
    import cupy as cp

    from blutrain.tensor.cpu import nn as generic

    if (compute not in ("float32", "bfloat16") or x.dtype.name not in ("float32", "bfloat16")
            or w.dtype != x.dtype or x.ndim != 2 or w.shape[0] >= 2**31):
        return generic.linear_cross_entropy(x, w, target, ignore_index, label_smoothing, mean, compute, loss_dtype,
                                            need_x, need_w, chunk_rows)
    cd = np.dtype(as_dtype(compute).np)
    xs = _compute_operand(x, cd)
    ws = _compute_operand(w, cd)
    tc = cp.ascontiguousarray(target, dtype=np.int64)
    n, c = xs.shape
    v = ws.shape[0]
    need = need_x or need_w
    loss_rows = cp.empty((n,), np.float32)
    dx = cp.empty((n, c), x.dtype) if need_x else None
    dw32 = (cp.empty if n else cp.zeros)((v, c), np.float32) if need_w else None
    for i, start in enumerate(range(0, n, chunk_rows)):
        stop = min(n, start + chunk_rows)
        logits = cp.empty((stop - start, v), cd)
        gemm_into(xs[start:stop], ws, logits, trans_b=True)
        rows = fused.cross_entropy_rows(logits, tc[start:stop], ignore_index, label_smoothing, need)
        if rows is None:
            raise AssertionError(f"cross_entropy_rows refused [{stop - start}, {v}] {cd} logits")
        loss_rows[start:stop] = rows[0]
        del logits  # the chunk's logits go back to the pool before its gradient GEMMs
        dl = rows[1]
        if dl is not None:
            if dx is not None:
                gemm_into(dl, ws, dx[start:stop])
            if dw32 is not None:
                gemm_into(dl, xs[start:stop], dw32, trans_a=True, accumulate=i > 0)
    count = cp.count_nonzero(tc != ignore_index)
    total = loss_rows.sum()
    loss = (total / count if mean else total).astype(as_dtype(loss_dtype).np)
    scale = (1.0 / count if mean else cp.ones((), np.float64)).astype(np.float32)
    dw = None if dw32 is None else dw32 if w.dtype.name == "float32" else dw32.astype(w.dtype)
    return loss, scale, dx, dw
