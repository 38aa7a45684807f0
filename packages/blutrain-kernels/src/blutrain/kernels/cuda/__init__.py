"""BluTrain's hand-written CUDA kernels, compiled at first use by NVRTC through CuPy.

One ``.cu`` file per kernel family sits beside this module; each starts with what it computes, its
launch shape and its bytes/FLOPs. The headers they include from this folder (``common.cuh``; the attention
families' ``attention.cuh``, and ``wgmma.cuh`` for sm_90a) are pasted into each source before compilation
(rather than found through ``-I``) so that CuPy's on-disk cache, keyed on the source text, sees a
change to a shared header too.

Each public function takes and returns CuPy arrays with the argument order of the op kernel it
implements (see ``blutrain.tensor.ops``), so a device plugin can register it directly. Per-row
statistics that only backward reads (LayerNorm's mean and rstd, the log-sum-exp of cross-entropy
and attention) are float32 whatever the input dtype, as PyTorch keeps them. A function
returns ``None`` when a call is outside what its kernel covers (a dtype other than float32 and
bfloat16, a mask given to attention, an unsupported head dim, an empty tensor, a strided view or a
dtype pair other than float32/bfloat16/float16 given to a cast): the caller then runs the generic
kernel. :data:`KERNELS` lists them by op name.

Importing this module does not import CuPy; nothing here runs without a GPU.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import re
import weakref
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from blutrain.tensor.dtype import bfloat16, float16, float32
from blutrain.tensor.errors import PluginError, ShapeError, TensorTypeError

Array = Any
_DIR = Path(__file__).parent
FAMILIES = ("adamw", "attention", "attention_bf16", "attention_wgmma", "attention_wgmma_bwd", "casts", "cross_entropy",
            "embedding", "gelu", "gemm_3xtf32", "layernorm", "llama", "philox", "reduce", "scale", "softmax")
_OPTIONS = ("-std=c++17",)
# Families of Hopper-only instructions (wgmma): built for sm_90a by NVRTC directly, see hopper_module
HOPPER_FAMILIES = frozenset({"attention_wgmma", "attention_wgmma_bwd"})
_DEFAULT_SMEM = 48 * 1024

_modules: dict[tuple[int, str], Any] = {}
_functions: dict[tuple[int, str, str], Any] = {}
_smem_set: dict[tuple[int, str, str], int] = {}
_sm_count: dict[int, int] = {}
_resident: dict[tuple[int, str, str, int, int], int] = {}
_deterministic = True


def _cp() -> Any:
    import cupy

    return cupy


_INCLUDE = re.compile(r'^#include "(\w+\.cuh)"$', re.MULTILINE)


def source(family: str) -> str:
    """The CUDA source of one kernel family, with each ``#include "<name>.cuh"`` of this folder pasted in,
    recursively: a header's text at its first include, nothing at a later one (as ``#pragma once`` would)."""
    if family not in FAMILIES:
        raise KeyError(f"no CUDA kernel family {family!r}; families: {', '.join(FAMILIES)}")
    pasted: set[str] = set()

    def paste(include: re.Match[str]) -> str:
        name = include.group(1)
        if not (_DIR / name).is_file():
            return include.group(0)
        if name in pasted:
            return ""
        pasted.add(name)
        return _INCLUDE.sub(paste, (_DIR / name).read_text())

    return _INCLUDE.sub(paste, (_DIR / f"{family}.cu").read_text())


def module(family: str) -> Any:
    """The compiled ``cupy.RawModule`` of ``family`` for the current device (compiled once); a Hopper family's
    ``cupy.cuda.function.Module`` (:func:`hopper_module`), which must exist."""
    cp = _cp()
    key = (cp.cuda.Device().id, family)
    mod = _modules.get(key)
    if mod is None:
        if family in HOPPER_FAMILIES:
            mod = hopper_module(family)
            if mod is None:
                raise PluginError(f"the {family} kernels need a compute capability 9.0 GPU and NVRTC >= 12.0 "
                                  "(sm_90a)")
        else:
            mod = cp.RawModule(code=source(family), options=_OPTIONS)
        _modules[key] = mod
    return mod


_hopper: dict[tuple[int, str], Any] = {}  # (device, family) -> module, or None where sm_90a cannot run
_NVRTC_SM90A = (12, 0)  # the first NVRTC that targets sm_90a


def hopper_module(family: str) -> Any | None:
    """``family`` built for sm_90a (wgmma and the other instructions plain sm_90 lacks), or None where the
    current device is not compute capability 9.0 or NVRTC predates sm_90a (the callers then keep their
    sm_80-level kernels). Decided once per device: later calls are one dictionary lookup. CuPy's RawModule
    always appends its own ``-arch=sm_90``, so NVRTC is called here and the cubin loaded as a module; it is
    kept on disk in CuPy's kernel cache directory, keyed by the source, the options and NVRTC's version, as
    RawModule keeps its own. A source that does not compile raises :class:`PluginError` with NVRTC's log:
    falling back silently would hide a broken kernel behind slower ones."""
    cp = _cp()
    key = (cp.cuda.runtime.getDevice(), family)
    if key in _hopper:
        return _hopper[key]
    mod = None
    if cp.cuda.Device(key[0]).compute_capability == "90":
        from cupy_backends.cuda.libs import nvrtc

        if tuple(nvrtc.getVersion()) >= _NVRTC_SM90A:
            mod = cp.cuda.function.Module()
            mod.load(_hopper_cubin(family, nvrtc))
    _hopper[key] = mod
    return mod


def _hopper_cubin(family: str, nvrtc: Any) -> bytes:
    """The sm_90a cubin of ``family``: from CuPy's cache directory, else compiled by NVRTC and stored there."""
    cp = _cp()
    code = source(family)
    options = [*_OPTIONS, "-arch=sm_90a", f"-I{Path(cp.__file__).parent / '_core' / 'include'}"]  # as CuPy's
    version = ".".join(map(str, nvrtc.getVersion()))
    digest = hashlib.sha256("\0".join([code, *options, version]).encode()).hexdigest()[:32]
    # CuPy's kernel cache directory, as its compiler names it (CUPY_CACHE_DIR, else ~/.cupy/kernel_cache)
    cache_dir = os.environ.get("CUPY_CACHE_DIR") or os.path.expanduser("~/.cupy/kernel_cache")
    cache = Path(cache_dir) / f"blutrain_{family}_{digest}.cubin"
    if cache.is_file():
        return cache.read_bytes()
    prog = nvrtc.createProgram(code, f"{family}.cu", [], [])
    try:
        try:
            nvrtc.compileProgram(prog, options)
        except Exception as e:
            raise PluginError(f"{family}.cu does not compile for sm_90a with NVRTC {version} ({e}):\n"
                              f"{nvrtc.getProgramLog(prog)}") from e
        image: bytes = nvrtc.getCUBIN(prog)
    finally:
        nvrtc.destroyProgram(prog)
    with contextlib.suppress(OSError):  # a read-only home: compiled again by the next process
        cache.parent.mkdir(parents=True, exist_ok=True)
        tmp = cache.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_bytes(image)
        tmp.replace(cache)  # whole or absent for another process reading it
    return image


def function(family: str, name: str) -> Any:
    """One kernel (``cupy.RawKernel``) of a family, for the current device."""
    dev = _cp().cuda.Device().id
    key = (dev, family, name)
    fn = _functions.get(key)
    if fn is None:
        fn = module(family).get_function(name)
        _functions[key] = fn
    return fn


def _launch(family: str, name: str, grid: tuple[int, ...], block: tuple[int, ...], args: tuple[Any, ...],
            smem: int = 0) -> None:
    fn = function(family, name)
    if smem > _DEFAULT_SMEM:
        key = (_cp().cuda.Device().id, family, name)
        if _smem_set.get(key, 0) < smem:  # opt in beyond 48 KB (cudaFuncSetAttribute)
            if family in HOPPER_FAMILIES:  # a Module's Function has no setter: the driver call
                from cupy_backends.cuda.api import driver

                driver.funcSetAttribute(fn.ptr, 8, smem)  # CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES
            else:
                fn.max_dynamic_shared_size_bytes = smem
            _smem_set[key] = smem
    fn(grid, block, args, shared_mem=smem)


def sm_count() -> int:
    """Multiprocessors of the current device."""
    cp = _cp()
    dev = cp.cuda.Device()
    n = _sm_count.get(dev.id)
    if n is None:
        n = int(dev.attributes["MultiProcessorCount"])
        _sm_count[dev.id] = n
    return n


def _resident_blocks(family: str, name: str, threads: int, smem: int = 0) -> int:
    """Blocks of ``threads`` threads of one kernel that the whole device holds at once (registers, threads
    and shared memory per multiprocessor; Hopper's limits: 64 K registers, 2048 threads, 228 KB)."""
    key = (_cp().cuda.Device().id, family, name, threads, smem)
    n = _resident.get(key)
    if n is None:
        regs = int(getattr(function(family, name), "num_regs", 0)) or 64
        warps = (threads + 31) // 32
        per_sm = min(2048 // (32 * warps), 32, 65536 // (((regs * 32 + 255) // 256) * 256 * warps))
        if smem:
            per_sm = min(per_sm, (228 * 1024) // (smem + 1024))
        n = max(1, per_sm) * sm_count()
        _resident[key] = n
    return n


def set_deterministic(enabled: bool) -> None:
    """Choose the embedding backward: deterministic (sorted segments, the default) or atomics (faster)."""
    global _deterministic
    _deterministic = bool(enabled)


def is_deterministic() -> bool:
    return _deterministic


# ---------------------------------------------------------------------------------------------- helpers

_NULL = np.uint64(0)


def _suffix(dtype: Any) -> str | None:
    dt = np.dtype(dtype)
    if dt == np.float32:
        return "f32"
    if dt.name == "bfloat16":
        return "bf16"
    return None


def _vec(suffix: str) -> int:
    return 4 if suffix == "f32" else 8


def _aligned(*arrays: Array | None) -> bool:
    return all(a is None or a.data.ptr % 16 == 0 for a in arrays)


def _variant(suffix: str, inner: int, *arrays: Array | None) -> tuple[str, int]:
    """The kernel name suffix and vector width: 16-byte accesses when every row starts aligned."""
    vec = _vec(suffix)
    if inner % vec == 0 and _aligned(*arrays):
        return f"{suffix}_v{vec}", vec
    return f"{suffix}_v1", 1


def _row_threads(nvec: int, hi: int = 512) -> int:
    """Threads for one block per row: about four vectors per thread, a power of two in [32, hi]."""
    t = 32
    while t < hi and t * 4 < nvec:
        t *= 2
    return t


def _ptr(a: Array | None) -> Any:
    return _NULL if a is None else a


def _contig(a: Array | None) -> Array | None:
    return None if a is None else _cp().ascontiguousarray(a)


def _numel(shape: Sequence[int]) -> int:
    n = 1
    for s in shape:
        n *= int(s)
    return n


# ---------------------------------------------------------------------------------------------- LayerNorm


def layer_norm(x: Array, w: Array | None, b: Array | None, eps: float, k: int, out_dtype: Any = None,
               residual: Array | None = None) -> tuple[Array, ...] | None:
    """(y, mean, rstd) of LayerNorm over the trailing ``k`` dims; mean and rstd in float32. ``out_dtype``: y in
    that dtype (float32 x to bfloat16 y here: the compiler's ``layernorm-cast`` pass), rounded once.
    ``residual``: see :func:`layer_norm_residual`."""
    if residual is not None:
        return layer_norm_residual(x, residual, w, b, eps, k, out_dtype)
    suffix = _suffix(x.dtype)
    C = _numel(x.shape[x.ndim - k:])
    N = x.size // C if C else 0
    if suffix is None or N == 0 or C == 0 or C >= 2**31:
        return None
    to = x.dtype if out_dtype is None else np.dtype(out_dtype)
    if to != x.dtype and (suffix != "f32" or _suffix(to) != "bf16"):
        return None
    cp = _cp()
    xc = _contig(x)
    wc, bc = _contig(w), _contig(b)
    y = cp.empty(x.shape, to)
    lead = x.shape[: x.ndim - k]
    mean = cp.empty(lead, np.float32)
    rstd = cp.empty(lead, np.float32)
    name, vec = _variant(suffix, C, xc, wc, bc, y)
    if to != x.dtype:
        name = name.replace("f32", "f32_to_bf16", 1)
    _launch("layernorm", f"layernorm_fwd_{name}", (N,), (_row_threads(C // vec),),
            (xc, _ptr(wc), _ptr(bc), y, mean, rstd, np.int32(C), np.float32(eps)))
    return y, mean, rstd


def layer_norm_residual(x: Array, r: Array, w: Array | None, b: Array | None, eps: float, k: int,
                        out_dtype: Any = None) -> tuple[Array, Array, Array, Array] | None:
    """(y, mean, rstd, s) of LayerNorm of s = r + x (the compiler's ``layernorm-residual`` pass): x bfloat16 or
    float32 (a projection), r float32 of x's shape (the residual stream), float32 w, b; s float32, y float32 or
    bfloat16. Each s is one float32 add, and the launch (VEC 4, the float32 kernel's threads) makes mean, rstd
    and y the bits of a float32 add of the two followed by :func:`layer_norm` of the sum."""
    sx = _suffix(x.dtype)
    C = _numel(x.shape[x.ndim - k:])
    N = x.size // C if C else 0
    to = np.dtype(np.float32) if out_dtype is None else np.dtype(out_dtype)
    if (sx is None or r.dtype != np.float32 or tuple(r.shape) != tuple(x.shape) or _suffix(to) is None
            or any(p is not None and p.dtype != np.float32 for p in (w, b)) or N == 0 or C == 0 or C >= 2**31):
        return None
    cp = _cp()
    # fresh copies where a view starts unaligned: the unfused LayerNorm reads a fresh sum, and the vector width
    # (so the order of each row's sums) must be the one it takes
    xc, rc = (a if a.flags.c_contiguous and a.data.ptr % 16 == 0 else a.copy() for a in (x, r))
    wc, bc = _contig(w), _contig(b)
    s = cp.empty(x.shape, np.float32)
    y = cp.empty(x.shape, to)
    lead = x.shape[: x.ndim - k]
    mean = cp.empty(lead, np.float32)
    rstd = cp.empty(lead, np.float32)
    _, vec = _variant("f32", C, wc, bc)
    _launch("layernorm", f"layernorm_fwd_res_{sx}_{_suffix(to)}_v{vec}", (N,), (_row_threads(C // vec),),
            (xc, rc, _ptr(wc), _ptr(bc), s, y, mean, rstd, np.int32(C), np.float32(eps)))
    return y, mean, rstd, s


_LN_BWD_THREADS = 256  # the kernels' __launch_bounds__: a row group (TG threads) is at most one block
_LN_BWD_NPER = {1: (1, 2, 4, 8, 16), 4: (1, 2, 3, 4), 8: (1, 2)}  # compiled vectors-per-thread variants


def _ln_bwd_shape(nv: int, vec: int) -> tuple[int, int] | None:
    """(row-group threads TG, vectors per thread NPER) of layernorm_bwd_*_n*, or None if the row is too
    wide to sit in one block's registers (C > 4096): TG the smallest power of two >= 32 with
    TG * max NPER >= nv."""
    allowed = _LN_BWD_NPER[vec]
    tg = 32
    while tg * allowed[-1] < nv:
        tg *= 2
        if tg > _LN_BWD_THREADS:
            return None
    need = (nv + tg - 1) // tg
    return tg, next(k for k in allowed if k >= need)


def layer_norm_backward(grad: Array, x: Array, w: Array | None, mean: Array, rstd: Array, k: int, need_w: bool,
                        need_b: bool, addend: Array | None = None, dx_copy_dtype: Any = None,
                        need_dx_sum: bool = False) -> tuple[Array | None, ...] | None:
    """(dx, dweight, dbias); dweight/dbias are None unless asked for. ``addend`` (x's dtype, broadcastable to
    x): dx + addend, added to each float32 dx before it is stored (one rounding, as a separate float32 add).

    With ``dx_copy_dtype`` or ``need_dx_sum`` (float32 x; the copy bfloat16): (dx, dweight, dbias, dx in
    bfloat16, dx's column sums over its leading dims), the readers of dx that the compiler's
    ``layernorm-grad-outputs`` pass folds in. The copy is the cast kernel's bits of the stored dx; the sums
    are float32 accumulations of the stored dx in this kernel's fixed order, not ``sum_cols``'s. These come from
    kernels of their own (``*_out``), which may hold fewer blocks per SM than the plain ones (not at GPT-2's
    widths): dweight/dbias then add their blocks' partials in another grouping than the plain call's."""
    suffix = _suffix(x.dtype)
    C = _numel(x.shape[x.ndim - k:])
    N = x.size // C if C else 0
    if suffix is None or N == 0 or C == 0 or C >= 2**31:
        return None
    if addend is not None and addend.dtype != x.dtype:
        return None
    extra = dx_copy_dtype is not None or need_dx_sum
    if extra and (suffix != "f32" or (dx_copy_dtype is not None and _suffix(dx_copy_dtype) != "bf16")):
        return None
    accumulate = need_w or need_b or need_dx_sum
    tables = 3 if need_dx_sum else 2
    cp = _cp()
    gc, xc, wc = _contig(grad), _contig(x), _contig(w)
    ac = None if addend is None else cp.ascontiguousarray(cp.broadcast_to(addend, x.shape))
    mc, rc = (cp.ascontiguousarray(s, dtype=np.float32) for s in (mean, rstd))
    dx = cp.empty(x.shape, x.dtype)
    dxc = None if dx_copy_dtype is None else cp.empty(x.shape, bfloat16.np)
    name, vec = _variant(suffix, C, gc, xc, wc, dx, ac, dxc)
    out = "_out" if extra else ""
    shape = _ln_bwd_shape(C // vec, vec)
    if shape is not None:
        tg, nper = shape
        rg = max(1, _LN_BWD_THREADS // tg)
        kname = f"layernorm_bwd_{name}_n{nper}{out}"
        smem = (128 * rg + ((3 if extra else 2) * C if accumulate else 0)) * 4
        if smem > 227 * 1024:
            return None
        G = min((N + rg - 1) // rg, _resident_blocks("layernorm", kname, tg * rg, smem))
        block: tuple[int, ...] = (tg, rg)
    else:
        smem = (72 + (3 if extra else 2) * C) * 4 if accumulate else 72 * 4
        if smem > 227 * 1024:
            return None
        kname = f"layernorm_bwd_{name}{out}"
        G = min(N, 4 * sm_count())
        block = (_row_threads(C // vec, hi=1024),)
    partial = cp.empty((tables, G, C), np.float32) if accumulate else None
    flags = (1 if need_w or need_b else 0) | (2 if need_dx_sum else 0)
    _launch("layernorm", kname, (G,), block,
            (gc, xc, _ptr(wc), mc, rc, _ptr(ac), dx, _ptr(dxc), _ptr(partial), np.int32(N), np.int32(C),
             np.int32(flags)), smem)
    ns = x.shape[x.ndim - k:]
    dw = cp.empty(ns, x.dtype) if need_w else None
    db = cp.empty(ns, x.dtype) if need_b else None
    ds = cp.empty(ns, x.dtype) if need_dx_sum else None
    if accumulate:
        _launch("layernorm", f"layernorm_bwd_reduce_{suffix}", ((tables * C + 31) // 32,), (32, 16),
                (partial, _ptr(dw), _ptr(db), _ptr(ds), np.int32(G), np.int32(C), np.int32(tables)))
    return (dx, dw, db, dxc, ds) if extra else (dx, dw, db)


# ---------------------------------------------------------------------------------------------- GELU


def _elementwise_grid(nv: int) -> tuple[int]:
    return (max(1, min((nv + 255) // 256, 16 * sm_count())),)


def gelu(a: Array, approximate: str = "none") -> Array | None:
    suffix = _suffix(a.dtype)
    if suffix is None or a.size == 0 or approximate not in ("none", "tanh"):
        return None
    cp = _cp()
    ac = _contig(a)
    y = cp.empty(a.shape, a.dtype)
    name, vec = _variant(suffix, _vec(suffix), ac, y)
    _launch("gelu", f"gelu_fwd_{name}", _elementwise_grid((a.size // vec + 1) // 2), (256,),
            (ac, y, np.int64(a.size), np.int32(approximate == "tanh")))
    return y


def gelu_backward(grad: Array, a: Array, approximate: str = "none") -> Array | None:
    suffix = _suffix(a.dtype)
    if suffix is None or a.size == 0 or approximate not in ("none", "tanh") or grad.shape != a.shape:
        return None
    cp = _cp()
    gc, ac = _contig(grad), _contig(a)
    dx = cp.empty(a.shape, a.dtype)
    name, vec = _variant(suffix, _vec(suffix), gc, ac, dx)
    _launch("gelu", f"gelu_bwd_{name}", _elementwise_grid((a.size // vec + 1) // 2), (256,),
            (gc, ac, dx, np.int64(a.size), np.int32(approximate == "tanh")))
    return dx


def _bias_gelu_shape(x: Array, bias: Array, approximate: str) -> tuple[str, int, int] | None:
    suffix = _suffix(x.dtype)
    if suffix is None or x.size == 0 or x.ndim == 0 or approximate not in ("none", "tanh"):
        return None
    D = int(x.shape[-1])
    if bias.dtype != x.dtype or bias.shape != (D,) or D >= 2**31:
        return None
    return suffix, x.size // D, D


def bias_gelu(x: Array, bias: Array, approximate: str = "tanh") -> Array | None:
    """GELU(x + bias) with ``bias`` (D,) over the last dim of ``x``, one pass."""
    found = _bias_gelu_shape(x, bias, approximate)
    if found is None:
        return None
    suffix, N, D = found
    cp = _cp()
    xc, bc = _contig(x), _contig(bias)
    y = cp.empty(x.shape, x.dtype)
    name, vec = _variant(suffix, D, xc, bc, y)
    tiles, chunks, rows_per = _column_plan(cp.cuda.runtime.getDevice(), N, D // vec, vec, 4 * _COL_LANES)
    _launch("gelu", f"bias_gelu_fwd_{name}", (tiles, chunks), _COL_BLOCK,
            (xc, bc, y, np.int64(N), np.int32(D), np.int64(rows_per), np.int32(approximate == "tanh")))
    return y


def bias_gelu_backward(grad: Array, x: Array, bias: Array, approximate: str = "tanh",
                       need_bias: bool = True) -> tuple[Array, Array | None] | None:
    """(dx, dbias): dx = grad * GELU'(x + bias), dbias its column sums (None unless asked for), one launch."""
    found = _bias_gelu_shape(x, bias, approximate)
    if found is None or grad.shape != x.shape or grad.dtype != x.dtype:
        return None
    suffix, N, D = found
    cp = _cp()
    gc, xc, bc = _contig(grad), _contig(x), _contig(bias)
    dx = cp.empty(x.shape, x.dtype)
    db = cp.empty((D,), x.dtype) if need_bias else None
    name, vec = _variant(suffix, D, gc, xc, bc, dx)
    dev = cp.cuda.runtime.getDevice()
    tiles, chunks, rows_per = _column_plan(dev, N, D // vec, vec, 2 * _COL_LANES)
    partial, counters = _column_scratch(dev) if need_bias and chunks > 1 else (_NULL, _NULL)
    _launch("gelu", f"bias_gelu_bwd_{name}", (tiles, chunks), _COL_BLOCK,
            (gc, xc, bc, dx, _ptr(db), partial, counters, np.int64(N), np.int32(D), np.int64(rows_per),
             np.int32(approximate == "tanh"), np.int32(bool(need_bias))))
    return dx, db


# ---------------------------------------------------------------------------------------------- casts

# (source, target) dtype -> casts.cu's (16-byte vector kernel, one-element kernel)
_CAST_SHORT = {float32: "f32", bfloat16: "bf16", float16: "f16"}
_CASTS: dict[tuple[np.dtype[Any], np.dtype[Any]], tuple[str, str]] = {
    (src.np, dst.np): (f"cast_{a}_{b}_v8", f"cast_{a}_{b}_v1")
    for src, a in _CAST_SHORT.items() for dst, b in _CAST_SHORT.items() if src is not dst}
_CAST_THREADS = (256,)


def cast(a: Array, dtype: Any) -> Array | None:
    """``a.astype(dtype)`` between float32, bfloat16 and float16, bit for bit as NumPy and ml_dtypes convert
    (round to nearest even; NaN rules in casts.cu), for an array contiguous in C or Fortran order (the result
    has the same order). None for other dtype pairs and for strided views, which CuPy's astype converts."""
    names = _CASTS.get((a.dtype, np.dtype(dtype)))
    if names is None:
        return None
    flags = a.flags
    if flags.c_contiguous:
        order = "C"
    elif flags.f_contiguous:
        order = "F"
    else:
        return None
    out = _cp().empty(a.shape, dtype, order=order)
    n = a.size
    if n == 0:
        return out
    if a.data.ptr % 16 == 0 and out.data.ptr % 16 == 0:
        _launch("casts", names[0], _elementwise_grid(n >> 3), _CAST_THREADS, (a, out, np.int64(n)))
    else:  # a view at an offset that is not a multiple of 16 bytes
        _launch("casts", names[1], _elementwise_grid((n + 3) >> 2), _CAST_THREADS, (a, out, np.int64(n)))
    return out


CAST_TILE = 4096  # elements per block of the multi-tensor casts (casts.cu's CAST_TILE)
_MULTI_CASTS = {pair: v8.replace("_v8", "_multi_tensor") for pair, (v8, _) in _CASTS.items()}
# Launch plans of cast_multi_tensor (device table, tensors, blocks), keyed by device, dtypes and the buffers'
# pointers and sizes; those a captured graph reads are kept for good (see _cached_plan).
_cast_plans: dict[tuple[Any, ...], tuple[Any, int, int]] = {}
_cast_graph_plans: dict[tuple[Any, ...], tuple[Any, int, int]] = {}


def _cast_plan(pairs: Sequence[tuple[Array, Array]]) -> tuple[Any, int, int]:
    """(device table, tensors, blocks) of casts.cu's multi-tensor kernels over non-empty contiguous (source,
    result) pairs: one row per tensor (source pointer, result pointer, numel, first block), CAST_TILE elements
    per block; cached by buffers."""
    cp = _cp()
    key = (cp.cuda.Device().id, tuple([s.data.ptr for s, _ in pairs]), tuple([d.data.ptr for _, d in pairs]),
           tuple([s.size for s, _ in pairs]), pairs[0][0].dtype, pairs[0][1].dtype)

    def build(capturing: bool) -> tuple[Any, int, int]:
        table = np.zeros((len(pairs), 4), np.int64)
        blocks = [(s.size + CAST_TILE - 1) // CAST_TILE for s, _ in pairs]
        table[:, 0] = [s.data.ptr for s, _ in pairs]
        table[:, 1] = [d.data.ptr for _, d in pairs]
        table[:, 2] = [s.size for s, _ in pairs]
        table[:, 3] = np.cumsum(blocks) - blocks
        return _upload(table, capturing), len(pairs), int(table[-1, 3]) + blocks[-1]

    plan: tuple[Any, int, int] = _cached_plan(key, True, build, _cast_plans, _cast_graph_plans)
    return plan


def cast_multi_tensor(arrays: Sequence[Array], dtype: Any) -> list[Array]:
    """``[a.astype(dtype) for a in arrays]`` (one source dtype for all), bit for bit as :func:`cast` converts
    each array: the C-contiguous arrays of a float32/bfloat16/float16 pair in one launch, whatever their
    number and sizes (under autocast a step's weights become bf16 together instead of one small launch
    each); another array (an F-ordered or strided view) or another pair goes through :func:`cast` or CuPy's
    astype, as the single cast would, so each result has the single cast's memory order too."""
    cp = _cp()
    if not arrays:
        return []
    src = arrays[0].dtype
    for i, a in enumerate(arrays):
        if type(a) is not cp.ndarray or a.dtype != src:
            raise TensorTypeError(f"cast_multi_tensor: array {i} must be a CuPy array of dtype {src} like array 0, "
                                  f"got {type(a).__name__} {getattr(a, 'dtype', '')}")
    dt = np.dtype(dtype)
    kernel = _MULTI_CASTS.get((src, dt))
    outs: list[Array] = []
    pairs: list[tuple[Array, Array]] = []
    for a in arrays:
        if kernel is not None and a.flags.c_contiguous and a.size:
            out = cp.empty(a.shape, dt)
            pairs.append((a, out))
        else:
            single = cast(a, dt)
            out = a.astype(dt) if single is None else single
        outs.append(out)
    if kernel is not None and pairs:
        table, n, K = _cast_plan(pairs)
        _launch("casts", kernel, (K,), _CAST_THREADS, (table, np.int32(n)))
    return outs


# ---------------------------------------------------------------------------------------------- cross-entropy

_REDUCTIONS = {"none": 0, "sum": 1, "mean": 2}


def _ce_checks(logits: Array, target: Array, reduction: str) -> tuple[str, int, int] | None:
    suffix = _suffix(logits.dtype)
    if suffix is None or logits.ndim != 2 or reduction not in _REDUCTIONS:
        return None
    N, C = int(logits.shape[0]), int(logits.shape[1])
    if N == 0 or C == 0 or C >= 2**31 or target.shape != (N,):
        return None
    return suffix, N, C


def _ce_rows(logits: Array, target: Array, ignore_index: int, label_smoothing: float, with_grad: bool,
             count: Array | None) -> tuple[str, Array, Array, Array, Array | None] | None:
    """(suffix, contiguous target, float32 loss per row, lse, dlogits) in one kernel; dlogits is scaled by
    1/count when ``count`` (a device int64) is given, else by 1 on every row that is not ignored."""
    checked = _ce_checks(logits, target, "none")
    if checked is None:
        return None
    suffix, N, C = checked
    cp = _cp()
    lc = _contig(logits)
    tc = cp.ascontiguousarray(target, dtype=np.int64)
    loss_rows = cp.empty((N,), np.float32)
    lse = cp.empty((N,), np.float32)
    dlogits = cp.empty((N, C), logits.dtype) if with_grad else None
    name, vec = _variant(suffix, C, lc, dlogits)
    _launch("cross_entropy", f"ce_fwd_{name}", (N,), (_row_threads(C // vec),),
            (lc, tc, np.int32(C), np.int64(ignore_index), np.float32(label_smoothing), loss_rows, lse,
             _ptr(dlogits), _ptr(count)))
    return suffix, tc, loss_rows, lse, dlogits


def _ce_forward(logits: Array, target: Array, ignore_index: int, label_smoothing: float, reduction: str,
                with_grad: bool) -> tuple[Array, Array, Array | None] | None:
    if _ce_checks(logits, target, reduction) is None:
        return None
    cp = _cp()
    count = None
    if with_grad and reduction == "mean":
        count = cp.count_nonzero(cp.asarray(target) != ignore_index).astype(np.int64)
    rows = _ce_rows(logits, target, ignore_index, label_smoothing, with_grad, count)
    assert rows is not None
    suffix, tc, loss_rows, lse, dlogits = rows
    if reduction == "none":
        loss = loss_rows if suffix == "f32" else loss_rows.astype(logits.dtype)
    else:
        loss = cp.empty((), logits.dtype)
        _launch("cross_entropy", f"ce_reduce_{suffix}", (1,), (1024,),
                (loss_rows, tc, np.int64(tc.shape[0]), np.int64(ignore_index), np.int32(reduction == "mean"),
                 loss))
    return loss, lse, dlogits


def cross_entropy_rows(logits: Array, target: Array, ignore_index: int, label_smoothing: float,
                       with_grad: bool) -> tuple[Array, Array | None] | None:
    """(float32 loss per row, dlogits for an upstream gradient of 1 per row) over [N, C] logits, one
    kernel; ignored rows have loss 0 and a zero gradient. Not an op of its own: the building block of
    fused losses that process the rows in chunks (``linear_cross_entropy``)."""
    rows = _ce_rows(logits, target, ignore_index, label_smoothing, with_grad, None)
    return None if rows is None else (rows[2], rows[4])


def cross_entropy(logits: Array, target: Array, ignore_index: int, label_smoothing: float,
                  reduction: str) -> tuple[Array, Array] | None:
    """(loss, lse) of softmax cross-entropy over [N, C] logits; one pass per row."""
    res = _ce_forward(logits, target, ignore_index, label_smoothing, reduction, with_grad=False)
    return None if res is None else (res[0], res[1])


def cross_entropy_with_grad(logits: Array, target: Array, ignore_index: int, label_smoothing: float,
                            reduction: str) -> tuple[Array, Array, Array] | None:
    """(loss, lse, dlogits) in one kernel: the gradient of the reduced loss for an upstream gradient of
    1 ('none' takes 1 per row), written while the row is still in L2. Not an op of its own: for fused
    training steps (the compiler) that know the loss is the last op."""
    res = _ce_forward(logits, target, ignore_index, label_smoothing, reduction, with_grad=True)
    if res is None:
        return None
    loss, lse, dlogits = res
    assert dlogits is not None
    return loss, lse, dlogits


def cross_entropy_backward(grad: Array, logits: Array, target: Array, lse: Array, ignore_index: int,
                           label_smoothing: float, reduction: str) -> Array | None:
    checked = _ce_checks(logits, target, reduction)
    if checked is None:
        return None
    suffix, N, C = checked
    cp = _cp()
    lc = _contig(logits)
    tc = cp.ascontiguousarray(target, dtype=np.int64)
    gc = cp.ascontiguousarray(grad, dtype=logits.dtype).reshape(-1)
    lsec = cp.ascontiguousarray(lse, dtype=np.float32)
    count = cp.count_nonzero(tc != ignore_index).astype(np.int64) if reduction == "mean" else None
    dlogits = cp.empty((N, C), logits.dtype)
    name, vec = _variant(suffix, C, lc, dlogits)
    _launch("cross_entropy", f"ce_bwd_{name}", (N,), (_row_threads(C // vec),),
            (gc, lc, tc, lsec, dlogits, np.int32(C), np.int64(ignore_index), np.float32(label_smoothing),
             np.int32(_REDUCTIONS[reduction]), _ptr(count)))
    return dlogits


# ---------------------------------------------------------------------------------------------- softmax


def _last_axis(a: Array, axis: int) -> bool:
    return bool(a.ndim >= 1 and axis % a.ndim == a.ndim - 1)


def _softmax(a: Array, axis: int, log_flag: int) -> Array | None:
    suffix = _suffix(a.dtype)
    if suffix is None or a.size == 0 or not _last_axis(a, axis) or a.shape[-1] >= 2**31:
        return None
    cp = _cp()
    C = int(a.shape[-1])
    ac = _contig(a)
    y = cp.empty(a.shape, a.dtype)
    name, vec = _variant(suffix, C, ac, y)
    _launch("softmax", f"softmax_fwd_{name}", (a.size // C,), (_row_threads(C // vec),),
            (ac, y, np.int32(C), np.int32(log_flag)))
    return y


def _softmax_bwd(grad: Array, out: Array, axis: int, log_flag: int) -> Array | None:
    suffix = _suffix(out.dtype)
    if suffix is None or out.size == 0 or not _last_axis(out, axis) or grad.shape != out.shape:
        return None
    cp = _cp()
    C = int(out.shape[-1])
    gc, oc = _contig(grad), _contig(out)
    dx = cp.empty(out.shape, out.dtype)
    name, vec = _variant(suffix, C, gc, oc, dx)
    _launch("softmax", f"softmax_bwd_{name}", (out.size // C,), (_row_threads(C // vec),),
            (gc, oc, dx, np.int32(C), np.int32(log_flag)))
    return dx


def softmax(a: Array, axis: int) -> Array | None:
    return _softmax(a, axis, 0)


def log_softmax(a: Array, axis: int) -> Array | None:
    return _softmax(a, axis, 1)


def softmax_backward(grad: Array, out: Array, axis: int) -> Array | None:
    return _softmax_bwd(grad, out, axis, 0)


def log_softmax_backward(grad: Array, out: Array, axis: int) -> Array | None:
    return _softmax_bwd(grad, out, axis, 1)


# ---------------------------------------------------------------------------------------------- embedding


def embedding(weight: Array, idx: Array) -> Array | None:
    suffix = _suffix(weight.dtype)
    if suffix is None or weight.ndim != 2 or idx.size == 0 or weight.shape[1] == 0:
        return None
    cp = _cp()
    V, D = int(weight.shape[0]), int(weight.shape[1])
    wc = _contig(weight)
    flat = cp.ascontiguousarray(idx.reshape(-1), dtype=np.int64)
    out = cp.empty((flat.size, D), weight.dtype)
    name, vec = _variant(suffix, D, wc, out)
    threads = min(128, _row_threads(D // vec, hi=128))
    _launch("embedding", f"embedding_fwd_{name}", (flat.size, (D // vec + threads - 1) // threads), (threads,),
            (wc, flat, out, np.int32(D), np.int64(V)))
    return out.reshape((*idx.shape, D))


def embedding_backward(grad: Array, idx: Array, num_embeddings: int, addend: Array | None = None,
                       addend_scale: Array | None = None) -> Array | None:
    """Rows of ``grad`` summed per token id into [num_embeddings, D]: deterministic by default
    (see :func:`set_deterministic`). With ``addend`` (the weight's shape, grad's dtype) and an optional 0-d
    ``addend_scale`` (grad's dtype, read on the device): ``addend * addend_scale + sums``, rounded as the
    separate multiply and add round it (embedding.cu's header), in the same pass that stores the sums."""
    suffix = _suffix(grad.dtype)
    if suffix is None or idx.size == 0 or grad.ndim < 1 or grad.shape[-1] == 0:
        return None
    D = int(grad.shape[-1])
    V = int(num_embeddings)
    if addend is not None and (addend.dtype != grad.dtype or tuple(addend.shape) != (V, D)):
        return None  # the generic kernel names what is wrong
    if addend_scale is not None and (addend is None or addend_scale.dtype != grad.dtype or addend_scale.shape != ()):
        return None
    cp = _cp()
    ac, sc = _contig(addend), _contig(addend_scale)
    flat = cp.ascontiguousarray(idx.reshape(-1), dtype=np.int64)
    ntok = int(flat.size)
    rows = cp.ascontiguousarray(grad).reshape(ntok, D)
    if not _deterministic:
        acc = cp.zeros((V, D), np.float32)
        _launch("embedding", f"embedding_bwd_atomic_{suffix}", (ntok, max(1, min(8, (D + 255) // 256))), (256,),
                (rows, flat, acc, np.int32(D)))
        if ac is None:
            return acc if suffix == "f32" else cast(acc, grad.dtype)
        total = cp.empty((V, D), grad.dtype)
        blocks = max(1, min(-(-(V * D) // 256), 8 * sm_count()))
        _launch("embedding", f"embedding_bwd_addend_{suffix}", (blocks,), (256,),
                (acc, ac, _ptr(sc), total, np.int64(V * D)))
        return total
    # Unique keys id * ntok + position: any sort gives the same order, so the sum order is fixed.
    keys = cp.sort(flat * ntok + cp.arange(ntok, dtype=np.int64))
    ids = keys // ntok
    pos = cp.ascontiguousarray(keys - ids * ntok)
    seg = cp.searchsorted(ids, cp.arange(V + 1, dtype=np.int64), side="left").astype(np.int64)
    out = cp.empty((V, D), grad.dtype)
    name, vec = _variant(suffix, D, rows, out, ac)
    threads = min(128, _row_threads(D // vec, hi=128))
    _launch("embedding", f"embedding_bwd_sorted_{name}", (V, (D // vec + threads - 1) // threads), (threads,),
            (rows, pos, seg, _ptr(ac), _ptr(sc), out, np.int32(D)))
    return out


# ---------------------------------------------------------------------------------------------- reductions


# Block of the column-tile kernels (sum_cols_*, bias_gelu_*): 32 column vectors x 16 row lanes; about two
# blocks per SM, each keeping 8 x 16 bytes of loads in flight per thread, saturate HBM.
_COL_LANES = 16
_COL_BLOCK = (32, _COL_LANES)
# Scratch of the one-launch column sums, per (device, stream): float32 partials and per-tile ticket
# counters, which are zero between launches (the last block of a tile resets its own). Launches on one
# stream run in order, so they share it; it is allocated once and never freed, so a captured CUDA graph
# may keep its pointers. A plan needs at most about 4 * SMs * 256 floats of it.
_SCRATCH_FLOATS = 1 << 19
_SCRATCH_TILES = 1 << 12
_scratch: dict[tuple[int, int], tuple[Array, Array]] = {}
_col_plans: dict[tuple[int, int, int, int, int], tuple[int, int, int]] = {}


def _column_plan(dev: int, N: int, nv: int, vec: int, rows_min: int) -> tuple[int, int, int]:
    """(column tiles, row chunks, rows per chunk) of a column-tile launch over N rows of ``nv`` vectors:
    about two blocks per SM, chunks of whole multiples of ``rows_min`` rows (a block's unrolled loads), and
    no more partials than the scratch holds."""
    key = (dev, N, nv, vec, rows_min)
    plan = _col_plans.get(key)
    if plan is None:
        tiles = (nv + 31) // 32
        chunks = max(1, min((2 * sm_count() + tiles - 1) // tiles, (N + rows_min - 1) // rows_min))
        if tiles > _SCRATCH_TILES:
            chunks = 1
        chunks = min(chunks, max(1, _SCRATCH_FLOATS // (tiles * 32 * vec)))
        per_chunk = (N + chunks - 1) // chunks
        rows_per = (per_chunk + rows_min - 1) // rows_min * rows_min
        plan = (tiles, (N + rows_per - 1) // rows_per, rows_per)
        if len(_col_plans) >= 4096:
            _col_plans.clear()
        _col_plans[key] = plan
    return plan


def _column_scratch(dev: int) -> tuple[Array, Array]:
    """(float32 partials, uint32 tile counters) of the current stream of device ``dev``.

    The scratch is device memory of its own, outside every pool, and lives as long as its stream: a
    compiled step's executor runs on a stream of its own and first needs it while it records into its private
    pool, which must not keep a block for the rest of the process (nor hand one to a graph that outlives it)."""
    cp = _cp()
    stream = cp.cuda.get_current_stream()
    key = (dev, stream.ptr)
    found = _scratch.get(key)
    if found is None:
        # The counters start at zero, written from the host on a side stream: a fill on this stream would be
        # recorded, not run, while it captures a graph.
        found = _scratch[key] = (_unpooled((_SCRATCH_FLOATS,), np.float32),
                                 _upload(np.zeros(_SCRATCH_TILES, np.uint32), capturing=True))
        if stream.ptr != 0:  # the default stream is never destroyed
            with contextlib.suppress(TypeError):  # a stream type without weak references: kept for good
                weakref.finalize(stream, _scratch.pop, key, None)
    return found


def sum_cols(x: Array) -> Array | None:
    """Column sums of a 2-D [N, D] array (the bias gradient) in one launch, float accumulation, deterministic."""
    suffix = _suffix(x.dtype)
    if suffix is None or x.ndim != 2 or x.size == 0 or x.shape[1] >= 2**31:
        return None
    cp = _cp()
    N, D = x.shape
    xc = _contig(x)
    out = cp.empty((D,), x.dtype)
    name, vec = _variant(suffix, D, xc)
    dev = cp.cuda.runtime.getDevice()
    tiles, chunks, rows_per = _column_plan(dev, N, D // vec, vec, 8 * _COL_LANES)
    partial, counters = _column_scratch(dev) if chunks > 1 else (_NULL, _NULL)
    _launch("reduce", f"sum_cols_{name}", (tiles, chunks), _COL_BLOCK,
            (xc, out, partial, counters, np.int64(N), np.int32(D), np.int64(rows_per)))
    return out


def sum_rows(x: Array) -> Array | None:
    """Row sums of a 2-D [N, D] array, float accumulation, deterministic."""
    suffix = _suffix(x.dtype)
    if suffix is None or x.ndim != 2 or x.size == 0 or x.shape[1] >= 2**31:
        return None
    cp = _cp()
    N, D = int(x.shape[0]), int(x.shape[1])
    xc = _contig(x)
    out = cp.empty((N,), x.dtype)
    name, vec = _variant(suffix, D, xc)
    _launch("reduce", f"sum_rows_{name}", (N,), (_row_threads(D // vec),), (xc, out, np.int32(D)))
    return out


def sum(a: Array, axes: tuple[int, ...] | None, keepdim: bool) -> Array | None:
    """``a.sum(axes)`` when the axes are the leading or the trailing dims of ``a``."""
    if _suffix(a.dtype) is None or a.size == 0 or a.ndim == 0 or not axes:
        return None
    ax = tuple(sorted(x % a.ndim for x in axes))
    j = len(ax)
    if ax == tuple(range(j)):
        out = sum_cols(a.reshape(_numel(a.shape[:j]), _numel(a.shape[j:])))
        kept = tuple(1 if i < j else s for i, s in enumerate(a.shape))
        rest = a.shape[j:]
    elif ax == tuple(range(a.ndim - j, a.ndim)):
        out = sum_rows(a.reshape(_numel(a.shape[: a.ndim - j]), _numel(a.shape[a.ndim - j:])))
        kept = tuple(1 if i >= a.ndim - j else s for i, s in enumerate(a.shape))
        rest = a.shape[: a.ndim - j]
    else:
        return None
    if out is None:
        return None
    return out.reshape(kept if keepdim else rest)


# ---------------------------------------------------------------------------------------------- AdamW

ADAMW_TILE = 2048  # elements per tile of the tile table (adamw.cu's ADAMW_TILE)
_ADAMW_THREADS = 256
_ADAMW_GRAD_BF16 = 1
_ADAMW_ALIGNED = 2
# Launch plans (device tensor table, device tile table, tile count), keyed by device, weight decays and
# the buffers' pointers, sizes and grad dtypes: an optimizer passes the same buffers every step, so a
# step after the first builds and copies nothing. A hit requires every array contiguous; shapes are
# checked on the call that built the plan (an update is elementwise, so equal sizes suffice after).
_adamw_plans: dict[tuple[Any, ...], tuple[Any, Any, int]] = {}
# Plans that a captured CUDA graph reads at every replay: never evicted, and their tables are device
# memory of their own (not of the capturing graph's pool, which may go away before a later hit).
_adamw_graph_plans: dict[tuple[Any, ...], tuple[Any, Any, int]] = {}


def _cached_plan(key: tuple[Any, ...], cacheable: bool, build: Callable[[bool], Any], plans: dict[Any, Any],
                 graph_plans: dict[Any, Any]) -> Any:
    """The launch plan (device tables) of a multi-tensor kernel for ``key`` (its buffers' pointers, sizes,
    dtypes): cached, built by ``build(capturing)`` on a miss. A plan built or used while the current stream
    captures a CUDA graph is kept for good in ``graph_plans`` (the graph reads its tables at every replay);
    others are evicted past 16. ``cacheable`` False (a plan over temporary copies): built every call."""
    plan = (graph_plans.get(key) or plans.get(key)) if cacheable else None
    if plan is not None and key in graph_plans:
        return plan
    capturing = bool(_cp().cuda.get_current_stream().is_capturing())
    if plan is None:
        plan = build(capturing)
        if capturing:
            graph_plans[key] = plan
        elif cacheable:
            if len(plans) >= 16:
                plans.clear()
            plans[key] = plan
    elif capturing:  # an eager plan a graph now reads: out of reach of the eviction
        graph_plans[key] = plan
    return plan


def _unpooled(shape: tuple[int, ...], dtype: Any) -> Array:
    """An uninitialised array in device memory of its own (cudaMalloc), outside every pool: freed when the
    last reference goes, never handed to another request while a captured graph may still read it."""
    cp = _cp()
    nbytes = max(int(np.prod(shape)) * np.dtype(dtype).itemsize, 1)
    return cp.ndarray(shape, dtype, memptr=cp.cuda.MemoryPointer(cp.cuda.Memory(nbytes), 0))


def _upload(host: np.ndarray[Any, Any], capturing: bool) -> Array:
    """``host`` copied to the device. While the current stream captures a CUDA graph, the copy runs on a
    side stream and is waited for here, into memory allocated outside any pool: a captured copy would
    re-read CuPy's pinned staging buffer at every replay, long after it was recycled."""
    cp = _cp()
    if not capturing:
        return cp.asarray(host)
    out = _unpooled(host.shape, host.dtype)
    side = cp.cuda.Stream(non_blocking=True)
    out.set(np.ascontiguousarray(host), stream=side)
    side.synchronize()
    return out


def _adamw_plan(params: Sequence[Array], grads: Sequence[Array], exp_avgs: Sequence[Array],
                exp_avg_sqs: Sequence[Array], wds: list[float],
                capturing: bool) -> tuple[Any, Any, int, list[Array]]:
    """Validate the four lists and build the device tables; returns them and the grads actually used
    (contiguous copies of non-contiguous grads, which the caller must keep alive until the launch)."""
    cp = _cp()
    n = len(params)
    table = np.zeros((n, 8), np.int64)
    keep: list[Array] = []
    for i, (p, g, m, v) in enumerate(zip(params, grads, exp_avgs, exp_avg_sqs, strict=True)):
        for name, arr in (("param", p), ("exp_avg", m), ("exp_avg_sq", v)):
            if arr.dtype != np.float32 or not arr.flags.c_contiguous:
                raise TensorTypeError(f"adamw_multi_tensor: {name} {i} must be a contiguous float32 array, got "
                                      f"dtype {arr.dtype}, contiguous={arr.flags.c_contiguous}")
            if arr.shape != p.shape:
                raise ShapeError(f"adamw_multi_tensor: {name} {i} has shape {arr.shape}, param {p.shape}")
        if g.shape != p.shape:
            raise ShapeError(f"adamw_multi_tensor: grad {i} has shape {g.shape}, param {p.shape}")
        gsuf = _suffix(g.dtype)
        if gsuf is None:
            raise TensorTypeError(f"adamw_multi_tensor: grad {i} must be float32 or bfloat16, got {g.dtype}")
        if capturing and not g.flags.c_contiguous:
            # the table would point at a copy that the graph's pool hands to later nodes
            raise TensorTypeError(f"adamw_multi_tensor: grad {i} is not contiguous; while a CUDA graph is "
                                  "captured every grad must be contiguous")
        g = cp.ascontiguousarray(g)
        keep.append(g)
        flags = (_ADAMW_GRAD_BF16 if gsuf == "bf16" else 0) | (_ADAMW_ALIGNED if _aligned(p, g, m, v) else 0)
        table[i] = (p.data.ptr, g.data.ptr, m.data.ptr, v.data.ptr, p.size, flags, 0, 0)
    table[:, 6] = np.asarray(wds, np.float32).view(np.int32).astype(np.int64)
    counts = (table[:, 4] + ADAMW_TILE - 1) // ADAMW_TILE
    K = int(counts.sum())
    tiles = np.empty((K, 2), np.int32)
    tiles[:, 0] = np.repeat(np.arange(n, dtype=np.int32), counts)
    tiles[:, 1] = np.arange(K, dtype=np.int64) - np.repeat(np.cumsum(counts) - counts, counts)
    if K == 0:
        return None, None, 0, keep
    return _upload(table, capturing), _upload(tiles, capturing), K, keep


def _adamw_grad_scale(grad_scale: Array | None, grads: Sequence[Array], max_grad_norm: float | None) -> bool:
    """Check ``grad_scale`` (None, or a 0-d CuPy array of every gradient's dtype) before any launch; whether it
    is bfloat16 (the kernel reads it as such)."""
    if grad_scale is None:
        return False
    cp = _cp()
    if max_grad_norm is not None:
        raise TensorTypeError("adamw_multi_tensor: grad_scale and max_grad_norm both given; pass one (the clip's "
                              f"coefficient, or the norm to clip to), got max_grad_norm={max_grad_norm!r}")
    if type(grad_scale) is not cp.ndarray or grad_scale.shape != () or _suffix(grad_scale.dtype) is None:
        raise TensorTypeError(f"adamw_multi_tensor: grad_scale must be a 0-d float32 or bfloat16 CuPy array, got "
                              f"{type(grad_scale).__name__} {getattr(grad_scale, 'dtype', '')} "
                              f"{getattr(grad_scale, 'shape', '')}")
    for i, g in enumerate(grads):
        if g.dtype != grad_scale.dtype:
            # the in-place scale it stands for takes one dtype: grads and coefficient alike
            raise TensorTypeError(f"adamw_multi_tensor: grad {i} has dtype {g.dtype}, grad_scale {grad_scale.dtype}; "
                                  "grad_scale must have every gradient's dtype")
    return _suffix(grad_scale.dtype) == "bf16"


def adamw_multi_tensor(params: Sequence[Array], grads: Sequence[Array], exp_avgs: Sequence[Array],
                       exp_avg_sqs: Sequence[Array], step_scalars: Array, beta1: float, beta2: float, eps: float,
                       weight_decay: float | Sequence[float], grad_scale: Array | None = None,
                       max_grad_norm: float | None = None) -> Array | None:
    """One AdamW step over every tensor in one launch (two with clipping), updating params, exp_avgs
    and exp_avg_sqs in place.

    params, exp_avgs, exp_avg_sqs: contiguous float32 arrays; grads: float32 or bfloat16, same shapes
    (not modified). ``step_scalars``: float64 [3] on the device, (lr, 1 - beta1**t, sqrt(1 - beta2**t))
    for step t (from 1); the kernel reads it when it runs, so a captured CUDA graph replays with the
    values written into it since. ``weight_decay`` is one value or one per tensor.

    ``grad_scale``: a 0-d CuPy array of the gradients' dtype (every grad must have it), read when the kernel
    runs; each gradient element is multiplied by it as it is read and rounded to the gradient's dtype, so the
    step equals ``scale_multi_tensor(grads, grad_scale)`` followed by this kernel without it, bit for bit (the
    compiler's ``adamw-grad-scale`` pass hands it the global-norm clip's coefficient). The 10th positional
    argument, as on the CPU, where the compiled IR puts it.

    With ``max_grad_norm`` (not together with ``grad_scale``) the gradients are scaled by min(1, max_norm /
    (norm + 1e-6)), norm being the 2-norm over all gradients, and the norm (float32, 0-d, before clipping) is
    returned; else None.
    """
    n = len(params)
    if not (len(grads) == len(exp_avgs) == len(exp_avg_sqs) == n):
        raise ShapeError(f"adamw_multi_tensor: got {n} params, {len(grads)} grads, {len(exp_avgs)} exp_avgs and "
                         f"{len(exp_avg_sqs)} exp_avg_sqs; the four lists must have one entry per parameter")
    cp = _cp()
    if type(step_scalars) is not cp.ndarray or step_scalars.dtype != np.float64 or step_scalars.shape != (3,) \
            or not step_scalars.flags.c_contiguous:
        got = f"{step_scalars.dtype} {tuple(step_scalars.shape)}" if hasattr(step_scalars, "dtype") else \
            type(step_scalars).__name__
        raise TensorTypeError(f"adamw_multi_tensor: step_scalars must be a contiguous float64 CuPy array of shape (3,) "
                              f"(lr, 1 - beta1**t, sqrt(1 - beta2**t)), got {got}")
    gscale_bf16 = _adamw_grad_scale(grad_scale, grads, max_grad_norm)
    wds = [float(weight_decay)] * n if isinstance(weight_decay, (int, float)) else [float(w) for w in weight_decay]
    if len(wds) != n:
        raise ShapeError(f"adamw_multi_tensor: {len(wds)} weight decays for {n} params")
    arrays = (*params, *grads, *exp_avgs, *exp_avg_sqs)
    contiguous = all(a.flags.c_contiguous for a in arrays)
    key = (cp.cuda.Device().id, tuple(wds), tuple([a.data.ptr for a in arrays]), tuple([a.size for a in arrays]),
           tuple([a.dtype for a in arrays]))
    keep: list[Array] = []

    def build(capturing: bool) -> tuple[Any, Any, int]:
        dtable, dtiles, K, kept = _adamw_plan(params, grads, exp_avgs, exp_avg_sqs, wds, capturing)
        keep.extend(kept)
        return dtable, dtiles, K

    dtable, dtiles, K = _cached_plan(key, contiguous, build, _adamw_plans, _adamw_graph_plans)
    if K == 0:
        return cp.zeros((), np.float32) if max_grad_norm is not None else None
    norm = None
    partial = None
    npartial = 0
    if max_grad_norm is not None:
        npartial = min(K, _resident_blocks("adamw", "adamw_sqnorm", _ADAMW_THREADS))
        partial = cp.empty((npartial,), np.float32)
        norm = cp.empty((), np.float32)
        _launch("adamw", "adamw_sqnorm", (npartial,), (_ADAMW_THREADS,), (dtable, dtiles, np.int32(K), partial))
    grid = (min(K, _resident_blocks("adamw", "adamw_update", _ADAMW_THREADS)),)
    _launch("adamw", "adamw_update", grid, (_ADAMW_THREADS,),
            (dtable, dtiles, np.int32(K), _ptr(partial), np.int32(npartial), np.float32(max_grad_norm or 0.0),
             step_scalars, np.float32(beta1), np.float32(beta2), np.float32(eps), _ptr(norm), _ptr(grad_scale),
             np.int32(gscale_bf16)))
    keep.clear()  # the grad copies the tables point at, alive until the launch
    return norm


# ---------------------------------------------------------------------------------------------- multi-tensor scale

SCALE_TILE = 4096  # elements per block (scale.cu's SCALE_TILE)
_scale_plans: dict[tuple[Any, ...], tuple[Any, int, int]] = {}
_scale_graph_plans: dict[tuple[Any, ...], tuple[Any, int, int]] = {}


def _tile_plan(dense: Sequence[Array]) -> tuple[Any, int, int]:
    """(device table, tensors, blocks) of scale.cu's kernels over contiguous, non-empty ``dense``: one row per
    tensor (pointer, numel, first block), SCALE_TILE elements per block; cached by buffers."""
    cp = _cp()
    key = (cp.cuda.Device().id, tuple([a.data.ptr for a in dense]), tuple([a.size for a in dense]), dense[0].dtype)

    def build(capturing: bool) -> tuple[Any, int, int]:
        table = np.zeros((len(dense), 3), np.int64)
        blocks = [(a.size + SCALE_TILE - 1) // SCALE_TILE for a in dense]
        table[:, 0] = [a.data.ptr for a in dense]
        table[:, 1] = [a.size for a in dense]
        table[:, 2] = np.cumsum(blocks) - blocks
        return _upload(table, capturing), len(dense), int(table[-1, 2]) + blocks[-1]

    plan: tuple[Any, int, int] = _cached_plan(key, True, build, _scale_plans, _scale_graph_plans)
    return plan


def _same_dtype(name: str, arrays: Sequence[Array]) -> str:
    """The kernel suffix of ``arrays``' one dtype (float32 or bfloat16); a clear error otherwise."""
    cp = _cp()
    dt = arrays[0].dtype
    suffix = _suffix(dt)
    if suffix is None:
        raise TensorTypeError(f"{name}: arrays must be float32 or bfloat16, got {dt}")
    for i, a in enumerate(arrays):
        if type(a) is not cp.ndarray or a.dtype != dt:
            raise TensorTypeError(f"{name}: array {i} must be a CuPy array of dtype {dt} like array 0, "
                                  f"got {type(a).__name__} {getattr(a, 'dtype', '')}")
    return suffix


def norm_multi_tensor(arrays: Sequence[Array]) -> Array:
    """The 2-norm of all elements of ``arrays`` together (all float32 or all bfloat16), a float32 0-d array:
    the global-norm clip's norm in two launches (per-tile sums of squares, then one block adding them in a
    fixed order), reading each element once. Strided views are read from contiguous copies."""
    cp = _cp()
    if not arrays:
        return cp.zeros((), np.float32)
    suffix = _same_dtype("norm_multi_tensor", arrays)
    dense = [cp.ascontiguousarray(a) for a in arrays if a.size]
    if not dense:
        return cp.zeros((), np.float32)
    table, n, K = _tile_plan(dense)
    partial = cp.empty((K,), np.float32)
    out = cp.empty((), np.float32)
    _launch("scale", f"sqnorm_multi_tensor_{suffix}", (K,), (256,), (table, np.int32(n), partial))
    _launch("scale", "norm_finish", (1,), (1024,), (partial, np.int64(K), out))
    return out


def scale_multi_tensor(arrays: Sequence[Array], coef: Array) -> None:
    """Multiply every array of ``arrays`` in place by the 0-d ``coef`` (all float32, or all bfloat16, ``coef``
    included), contiguous ones in one launch: the global-norm clip's rescaling of every gradient. ``coef`` is
    read when the kernel runs, so a captured CUDA graph replays with the value computed before it."""
    cp = _cp()
    if not arrays:
        return
    suffix = _same_dtype("scale_multi_tensor", arrays)
    dt = arrays[0].dtype
    if type(coef) is not cp.ndarray or coef.dtype != dt or coef.shape != ():
        raise TensorTypeError(f"scale_multi_tensor: coef must be a 0-d CuPy array of dtype {dt}, got "
                              f"{type(coef).__name__} {getattr(coef, 'dtype', '')} {getattr(coef, 'shape', '')}")
    dense = [a for a in arrays if a.flags.c_contiguous and a.size]
    for a in arrays:
        if not a.flags.c_contiguous:
            a *= coef  # a strided view: scaled where it lies
    if not dense:
        return
    table, n, K = _tile_plan(dense)
    _launch("scale", f"scale_multi_tensor_{suffix}", (K,), (256,), (table, np.int32(n), cp.ascontiguousarray(coef)))


# ---------------------------------------------------------------------------------------------- attention
# The kernels address every tensor through (batch, head, row) strides in elements (attention.cu's RowLayout), so
# a (B..., H, L, D) view whose D elements are contiguous reaches them as it is: the transposed q, k, v of a
# [B, T, 3C] projection, or the output written straight into a [B, T, C] buffer. Rows move by cp.async in
# 16-byte chunks, so the base pointer and every stride must be multiples of 16 bytes; a view that is not gets a
# contiguous (aligned) copy. lse, Delta and lse * log2(e) are [B*H, L] float32, contiguous.

_ATT_TILE = 64


# float32 tiles as attention.cu instantiates them, per head dim: (forward keys, dq keys, dk/dv queries) per
# step; each kernel's own side is _ATT_TILE rows (4 warps x 16).
_ATT_F32_TILES = {64: (64, 32, 32), 128: (32, 32, 32)}


def _aligned16(a: Array) -> Array:
    """``a`` itself, or a copy when its data is not 16-byte aligned (cp.async moves 16-byte chunks)."""
    return a if a.data.ptr % 16 == 0 else a.copy()


def _row_layout(a: Array) -> tuple[int, int, int] | None:
    """(batch, head, row) strides in elements of a (B..., H, L, D) view for the attention kernels, or None
    when the kernels cannot read it in place: D not contiguous, leading dims that do not collapse into one
    batch stride, or a base pointer or stride that is not a multiple of 16 bytes. A dim of size 1 is never
    stepped over, so its stride counts as 0."""
    item = a.itemsize
    shape, strides = a.shape, a.strides
    if shape[-1] > 1 and strides[-1] != item:
        return None
    st = [0 if n == 1 else s for n, s in zip(shape, strides, strict=True)]
    row = st[-2]
    head = st[-3] if a.ndim >= 3 else 0
    batch: int | None = None
    for n, s in zip(shape[:-3], st[:-3], strict=True):  # B... flattened in C order: one dim steps n of the next
        if n == 1:
            continue
        if batch is not None and batch != s * n:
            return None
        batch = s
    batch = batch or 0
    if a.data.ptr % 16 or row % 16 or head % 16 or batch % 16:
        return None
    return batch // item, head // item, row // item


def _attn_operand(a: Array) -> tuple[Array, tuple[int, int, int]]:
    """``a`` and its row layout, or an aligned contiguous copy of ``a`` and that copy's layout."""
    lay = _row_layout(a)
    if lay is None:
        a = _aligned16(_cp().ascontiguousarray(a))
        lay = _row_layout(a)
        assert lay is not None, "a contiguous array with D % (16 / itemsize) == 0 has an aligned layout"
    return a, lay


def _layout_args(*layouts: tuple[int, int, int]) -> tuple[Any, ...]:
    return tuple(np.int64(s) for lay in layouts for s in lay)


def _attn_shapes(q: Array, k: Array, v: Array, mask: Array | None) -> tuple[str, int, int, int, int, int] | None:
    """(kernel suffix, B*H, H, L, S, D) of a call the kernels cover, else None."""
    suffix = _suffix(q.dtype)
    if suffix is None or mask is not None or q.ndim < 2 or k.dtype != q.dtype or v.dtype != q.dtype:
        return None
    D = int(q.shape[-1])
    if D not in (64, 128) or k.shape[-1] != D or v.shape[-1] != D or k.shape[-2] != v.shape[-2]:
        return None
    if k.shape[:-2] != q.shape[:-2] or v.shape[:-2] != q.shape[:-2]:
        return None
    L, S = int(q.shape[-2]), int(k.shape[-2])
    BH = _numel(q.shape[:-2])
    H = int(q.shape[-3]) if q.ndim >= 3 else 1
    if L == 0 or S == 0 or BH == 0 or BH > 65535:
        return None
    return suffix, BH, H, L, S, D


def _attn_forward(q: Array, k: Array, v: Array, out: Array, suffix: str, BH: int, H: int, L: int, S: int, D: int,
                  causal: bool, scale: float) -> Array:
    """Launch the forward kernel on (B..., H, L, D) views, writing ``out`` (a view of the same shape, allocated
    aligned by the caller); returns the float32 lse [B*H, L]."""
    cp = _cp()
    (q, lq), (k, lk), (v, lv) = (_attn_operand(t) for t in (q, k, v))
    lo = _row_layout(out)
    assert lo is not None, "attention outputs are allocated 16-byte aligned"
    lse = cp.empty((BH, L), np.float32)
    args = (np.int32(L), np.int32(S), np.float32(scale), np.int32(bool(causal)), np.int32(H),
            *_layout_args(lq, lk, lv, lo))
    if suffix == "bf16" and D == 64 and hopper_module("attention_wgmma") is not None:
        # Hopper's warpgroup MMA (attention_wgmma.cu): 2 warpgroups of 64 queries, 64-key tiles, S_j overlapping
        # P_{j-1} v_{j-1}; the same contract as the mma.sync kernel, and faster (docs/kernels.md)
        rows = 128
        smem = rows * 128 + 3 * 2 * 64 * 128 + 1024  # q, three stages of k and v, 1024-byte alignment slack
        _launch("attention_wgmma", "attn_wgmma_fwd_d64_wg2n64p", ((L + rows - 1) // rows, BH), (256,),
                (q, k, v, out, lse, *args), smem)
    elif suffix == "bf16":
        name, warps, rows = _ATT_BF16_FWD[D, bool(causal)]
        smem = (rows + 4 * _ATT_BF16_KEYS) * D * 2  # the query tile and two stages of key and value tiles
        _launch("attention_bf16", f"attn_bf16_fwd_d{D}_{name}", ((L + rows - 1) // rows, BH), (32 * warps,),
                (q, k, v, out, lse, *args), smem)
    else:  # 3xTF32 tensor cores; rows padded to D + 4 floats in shared memory
        smem = (_ATT_TILE + 2 * _ATT_F32_TILES[D][0]) * (D + 4) * 4
        _launch("attention", f"attn_fwd_f32_d{D}", ((L + _ATT_TILE - 1) // _ATT_TILE, BH), (128,),
                (q, k, v, out, lse, *args), smem)
    return lse


def _attn_backward(grad: Array, q: Array, k: Array, v: Array, out: Array, lse: Array, dq: Array, dk: Array,
                   dv: Array, suffix: str, BH: int, H: int, L: int, S: int, D: int, causal: bool,
                   scale: float) -> None:
    """Launch the two backward kernels (dq per query tile first: it also writes Delta = rowsum(dO * out), and
    for bf16 lse * log2(e), per row; then dk/dv per key tile; no atomics: deterministic), writing the views
    ``dq``, ``dk``, ``dv`` (allocated aligned by the caller)."""
    cp = _cp()
    (q, lq), (k, lk), (v, lv), (grad, ldo), (out, lo) = (_attn_operand(t) for t in (q, k, v, grad, out))
    lsec = _aligned16(cp.ascontiguousarray(lse, dtype=np.float32).reshape(BH, L))
    ldq, ldk, ldv = (_row_layout(t) for t in (dq, dk, dv))
    assert ldq is not None and ldk is not None and ldv is not None, "attention gradients are allocated aligned"
    delta = cp.empty((BH, L), np.float32)
    head = (np.int32(L), np.int32(S), np.float32(scale), np.int32(bool(causal)), np.int32(H))
    if suffix == "bf16" and D == 64 and hopper_module("attention_wgmma_bwd") is not None:
        # Hopper's warpgroup MMA (attention_wgmma_bwd.cu), one warpgroup of 64 rows per block in both kernels; dq, dk,
        # dv within 2e-5 of attention_bf16.cu's, and faster (docs/kernels.md)
        lse2 = cp.empty((BH, L), np.float32)
        _launch("attention_wgmma_bwd", "attn_wgmma_bwd_dq_d64_wg1", ((L + 63) // 64, BH), (128,),
                (q, k, v, out, grad, lsec, lse2, delta, dq, *head, *_layout_args(lq, lk, lv, lo, ldo, ldq)),
                2 * 64 * 128 + 4 * 64 * 128 + 8 * 64 + 1024)  # q and dO, two stages of k and v, row stats, slack
        _launch("attention_wgmma_bwd", "attn_wgmma_bwd_dkv_d64_wg1", ((S + 63) // 64, BH), (128,),
                (q, k, v, grad, lse2, delta, dk, dv, *head, *_layout_args(lq, lk, lv, ldo, ldk, ldv)),
                2 * 64 * 128 + 4 * 64 * 128 + 1024 + 1024)  # k and v, two stages of q and dO, their row stats
        return
    if suffix == "bf16":
        lse2 = cp.empty((BH, L), np.float32)
        name, warps, rows = _ATT_BF16_DQ[D]
        _launch("attention_bf16", f"attn_bf16_bwd_dq_d{D}_{name}", ((L + rows - 1) // rows, BH), (32 * warps,),
                (q, k, v, out, grad, lsec, lse2, delta, dq, *head, *_layout_args(lq, lk, lv, lo, ldo, ldq)),
                (3 * rows + 4 * _ATT_BF16_KEYS) * D * 2)
        name, warps, keys, queries = _ATT_BF16_DKV[D]
        _launch("attention_bf16", f"attn_bf16_bwd_dkv_d{D}_{name}", ((S + keys - 1) // keys, BH), (32 * warps,),
                (q, k, v, grad, lse2, delta, dk, dv, *head, *_layout_args(lq, lk, lv, ldo, ldk, ldv)),
                (2 * keys + 4 * queries) * D * 2 + 4 * queries * 4)
        return
    t = _ATT_TILE  # 3xTF32 tensor cores
    _, bn, bq = _ATT_F32_TILES[D]
    _launch("attention", f"attn_bwd_dq_f32_d{D}", ((L + t - 1) // t, BH), (128,),
            (q, k, v, grad, out, lsec, delta, dq, *head, *_layout_args(lq, lk, lv, ldo, lo, ldq)),
            (2 * t + 2 * bn) * (D + 4) * 4)
    _launch("attention", f"attn_bwd_dkv_f32_d{D}", ((S + t - 1) // t, BH), (128,),
            (q, k, v, grad, lsec, delta, dk, dv, *head, *_layout_args(lq, lk, lv, ldo, ldk, ldv)),
            ((2 * t + 2 * bq) * (D + 4) + 2 * bq) * 4)


def sdpa(q: Array, k: Array, v: Array, mask: Array | None, causal: bool, scale: float) -> tuple[Array, Array] | None:
    """Flash-attention forward: (out, float32 lse) without the L x S matrix; None when a mask is given. q, k, v
    are read in place when their D elements are contiguous (transposed views included)."""
    shapes = _attn_shapes(q, k, v, mask)
    if shapes is None:
        return None
    suffix, BH, H, L, S, D = shapes
    out = _cp().empty(q.shape, q.dtype)
    lse = _attn_forward(q, k, v, out, suffix, BH, H, L, S, D, causal, scale)
    return out, lse.reshape(q.shape[:-1])


def sdpa_backward(grad: Array, q: Array, k: Array, v: Array, out: Array, lse: Array, mask: Array | None,
                  causal: bool, scale: float) -> tuple[Array, Array, Array] | None:
    """Flash-attention backward (dq, dk, dv), recomputing P from the saved lse; deterministic."""
    shapes = _attn_shapes(q, k, v, mask)
    if shapes is None or grad.shape != q.shape or out.shape != q.shape:
        return None
    suffix, BH, H, L, S, D = shapes
    cp = _cp()
    dq, dk, dv = cp.empty(q.shape, q.dtype), cp.empty(k.shape, q.dtype), cp.empty(v.shape, q.dtype)
    _attn_backward(grad, q, k, v, out, lse, dq, dk, dv, suffix, BH, H, L, S, D, causal, scale)
    return dq, dk, dv


def _packed_heads(qkv: Array, n_head: int) -> tuple[Array, Array, Array]:
    """q, k, v of a [B, T, 3C] projection as (B, H, T, D) views. A contiguous array (the gradient buffer, whose
    views the kernels write) is always viewed; a strided one is sliced, a view too wherever its strides allow."""
    B, T, C3 = qkv.shape
    D = C3 // (3 * n_head)
    if qkv.flags.c_contiguous:
        parts = qkv.reshape(B, T, 3, n_head, D)
        return tuple(parts[:, :, i].transpose(0, 2, 1, 3) for i in range(3))
    C = C3 // 3
    return tuple(qkv[:, :, i * C:(i + 1) * C].reshape(B, T, n_head, D).transpose(0, 2, 1, 3)
                 for i in range(3))


def _merged_heads(y: Array, n_head: int) -> Array:
    """A [B, T, C] array as the (B, H, T, D) view the kernels write."""
    B, T, C = y.shape
    return y.reshape(B, T, n_head, C // n_head).transpose(0, 2, 1, 3)


def _packed_shapes(qkv: Array, n_head: int) -> tuple[str, int, int, int, int, int] | None:
    if qkv.ndim != 3 or n_head <= 0 or qkv.shape[-1] % (3 * n_head):
        return None
    q, k, v = _packed_heads(qkv, n_head)
    return _attn_shapes(q, k, v, None)


def sdpa_packed(qkv: Array, n_head: int, causal: bool, scale: float) -> tuple[Array, Array] | None:
    """Multi-head self-attention over a packed [B, T, 3C] projection (q | k | v, head h at columns h*D of
    each): y [B, T, C] written by the kernel in place of the (B, H, T, D) output, float32 lse [B, H, T]."""
    shapes = _packed_shapes(qkv, n_head)
    if shapes is None:
        return None
    suffix, BH, H, L, S, D = shapes
    B, T, C3 = qkv.shape
    y = _cp().empty((B, T, C3 // 3), qkv.dtype)
    q, k, v = _packed_heads(qkv, n_head)
    lse = _attn_forward(q, k, v, _merged_heads(y, n_head), suffix, BH, H, L, S, D, causal, scale)
    return y, lse.reshape(B, H, T)


def sdpa_packed_backward(grad: Array, qkv: Array, out: Array, lse: Array, n_head: int, causal: bool,
                         scale: float) -> Array | None:
    """dqkv [B, T, 3C] in qkv's dtype, its three parts written by the kernels directly (no zero fill, no
    concatenation): dq by the dq kernel, dk and dv by the dk/dv kernel."""
    shapes = _packed_shapes(qkv, n_head)
    if shapes is None or grad.shape != out.shape or out.shape != (*qkv.shape[:2], qkv.shape[2] // 3):
        return None
    suffix, BH, H, L, S, D = shapes
    dqkv = _cp().empty(qkv.shape, qkv.dtype)
    q, k, v = _packed_heads(qkv, n_head)
    dq, dk, dv = _packed_heads(dqkv, n_head)
    _attn_backward(_merged_heads(grad, n_head), q, k, v, _merged_heads(out, n_head), lse, dq, dk, dv, suffix, BH,
                   H, L, S, D, causal, scale)
    return dqkv


# bfloat16 attention on the tensor cores (attention_bf16.cu). Tile shape (kernel name suffix, warps, rows per
# block), rows being queries (forward, dq) or keys (dk/dv), plus queries per step for dk/dv; the forward's is
# chosen per (head dim, causal): the fastest of the tile shapes timed on an H100 (docs/kernels.md). Forward and dq
# step over 64 keys at a time.
_ATT_BF16_FWD = {(64, False): ("w4m2", 4, 128), (64, True): ("w4m2", 4, 128),
                 (128, False): ("w4m2s", 4, 128), (128, True): ("w4m1", 4, 64)}
_ATT_BF16_DKV = {64: ("w4q64", 4, 64, 64), 128: ("w4q32", 4, 64, 32)}
_ATT_BF16_DQ = {64: ("w4b3", 4, 64), 128: ("w4", 4, 64)}
_ATT_BF16_KEYS = 64


# ---------------------------------------------------------------------------------------------- Philox

# Values each 128-bit counter yields, per kernel: the generator advances its offset by
# ceil(n / per_counter) counters after a draw.
PHILOX_PER_COUNTER = {"uniform_f32": 4, "uniform_f64": 2, "normal_f32": 4, "normal_f64": 2, "integers": 2, "raw": 1}


def philox(kind: str, n: int, seed: int, offset: int, low: int = 0, high: int = 0) -> tuple[Array, int]:
    """Draw ``n`` values of ``kind`` (see :data:`PHILOX_PER_COUNTER`) from counter ``offset`` under key
    ``seed``; returns the 1-D array and the number of counters used. ``raw`` gives 4n uint32 words."""
    cp = _cp()
    dtypes = {"uniform_f32": np.float32, "uniform_f64": np.float64, "normal_f32": np.float32,
              "normal_f64": np.float64, "integers": np.int64, "raw": np.uint32}
    if kind not in dtypes:
        raise KeyError(f"philox: unknown kind {kind!r}; kinds: {', '.join(dtypes)}")
    per = PHILOX_PER_COUNTER[kind]
    counters = (n + per - 1) // per
    out = cp.empty((4 * n if kind == "raw" else n,), dtypes[kind])
    if n == 0:
        return out, 0
    grid = (max(1, min((counters + 255) // 256, 16 * sm_count())),)
    base = (np.uint64(seed % 2**64), np.uint64(offset % 2**64))
    if kind == "raw":
        _launch("philox", "philox_raw", grid, (256,), (out, np.int64(n), *base))
    elif kind == "integers":
        _launch("philox", "philox_integers", grid, (256,),
                (out, np.int64(n), *base, np.int64(low), np.uint64(high - low)))
    else:
        _launch("philox", f"philox_{kind}", grid, (256,), (out, np.int64(n), *base))
    return out, counters


# ---------------------------------------------------------------------------------------------- 3xTF32 GEMM

# gemm_3xtf32.cu's tiling: 128 x 128 output tiles, 32-deep k-tiles, 256 threads, a 4-stage ring of A and B
# k-tiles in dynamic shared memory.
_GEMM_TILE = 128
_GEMM_BK = 32
_GEMM_THREADS = 256
_GEMM_SMEM = 4 * 2 * _GEMM_TILE * _GEMM_BK * 4
_GEMM_MAX_SPLITS = 16
_GEMM_SPLIT_BYTES = 256 * 2**20  # at most this much float32 workspace for split-K partials
# Products below this many FLOPs are declined: a few microseconds of work, where launch and tile
# overheads set the pace and cuBLAS's strict SGEMM is as fast.
GEMM_3XTF32_MIN_FLOPS = 2 * 256**3


def _gemm_splits(tiles: int, kt: int, mn: int, sms: int) -> int:
    """K splits of gemm_3xtf32 for ``tiles`` output tiles, ``kt`` k-tiles and an M x N of ``mn`` on ``sms``
    multiprocessors: 1 when the tiles alone fill the GPU for several waves, else the count whose blocks fill
    the last wave best (1 block per SM), less 1 % per split for the partials' traffic; each split keeps at
    least 8 k-tiles, and the partials fit in 256 MiB."""
    if tiles >= 4 * sms or kt < 16:
        return 1
    most = min(_GEMM_MAX_SPLITS, kt // 8, max(1, _GEMM_SPLIT_BYTES // (4 * mn)))
    best, best_score = 1, -1.0
    for s in range(1, most + 1):
        blocks = tiles * s
        score = blocks / (-(-blocks // sms) * sms) - 0.01 * s
        if score > best_score + 1e-9:
            best, best_score = s, score
    return best


_gemm_devices: dict[int, bool] = {}


def _gemm_fits_device() -> bool:
    """Whether the current device runs gemm_3xtf32.cu: TF32 mma.sync and cp.async (compute capability 8.0 or
    later) and 128 KB of shared memory per block (A100, H100; not the 99 KB of sm_86/sm_89 parts)."""
    cp = _cp()
    dev = cp.cuda.Device()
    ok = _gemm_devices.get(dev.id)
    if ok is None:
        ok = (int(dev.compute_capability) >= 80
              and int(dev.attributes["MaxSharedMemoryPerBlockOptin"]) >= _GEMM_SMEM)
        _gemm_devices[dev.id] = ok
    return ok


def gemm_3xtf32(a: Array, b: Array, out: Array, trans_a: bool = False, trans_b: bool = False,
                accumulate: bool = False, *, min_flops: int = GEMM_3XTF32_MIN_FLOPS) -> bool:
    """``out = op(a) @ op(b)`` (``out +=`` with ``accumulate``) in float32 at float32 accuracy on the tensor
    cores (3xTF32, gemm_3xtf32.cu), the argument convention of the cuda backend's ``gemm_into``: ``a`` is
    [M, K], or [K, M] with ``trans_a``; ``b`` is [K, N], or [N, K] with ``trans_b``; ``out`` is [M, N]. A
    linear layer's forward x Wᵀ is ``trans_b``, its input gradient dy W plain, its weight gradient dyᵀ x
    ``trans_a``. Deterministic (split-K partials are added in a fixed order).

    Returns False, and leaves ``out`` alone, when it declines: an operand or ``out`` that is not a
    C-contiguous 2-D float32 array, a size of 2**31 or more, fewer than ``min_flops`` FLOPs (2 M N K) to
    do, or a device without TF32 tensor cores and 128 KB of shared memory per block. Operand shapes that
    do not fit ``out`` raise ShapeError.
    """
    if a.dtype != np.float32 or b.dtype != np.float32 or out.dtype != np.float32:
        return False
    if a.ndim != 2 or b.ndim != 2 or out.ndim != 2:
        return False
    if not (a.flags.c_contiguous and b.flags.c_contiguous and out.flags.c_contiguous):
        return False
    M, K = (int(a.shape[1]), int(a.shape[0])) if trans_a else (int(a.shape[0]), int(a.shape[1]))
    kb, N = (int(b.shape[1]), int(b.shape[0])) if trans_b else (int(b.shape[0]), int(b.shape[1]))
    if kb != K or tuple(out.shape) != (M, N):
        raise ShapeError(f"gemm_3xtf32: op(a) is {M}x{K} (a {tuple(a.shape)}, trans_a={trans_a}) and op(b) {kb}x{N} "
                         f"(b {tuple(b.shape)}, trans_b={trans_b}); out must be ({M}, {N}), got {tuple(out.shape)}")
    flops = 2 * M * N * K
    if max(M, N, K) >= 2**31 or flops < min_flops or not _gemm_fits_device():
        return False
    if M == 0 or N == 0:
        return True
    if K == 0:
        if not accumulate:
            out.fill(0)
        return True
    # 16-byte copies when every operand's contiguous extent is a multiple of 4 floats and its base aligned
    vec = ((K if not trans_a else M) % 4 == 0 and (K if trans_b else N) % 4 == 0 and _aligned(a, b))
    name = f"gemm3x_{'t' if trans_a else 'n'}{'t' if trans_b else 'n'}_v{4 if vec else 1}"
    tiles = -(-M // _GEMM_TILE) * -(-N // _GEMM_TILE)
    kt = -(-K // _GEMM_BK)
    splits = _gemm_splits(tiles, kt, M * N, sm_count())
    per_split = -(-kt // splits)
    splits = -(-kt // per_split)  # no empty split
    dims = (np.int32(M), np.int32(N), np.int32(K))
    if splits == 1:
        cvec = N % 4 == 0 and _aligned(out)
        _launch("gemm_3xtf32", name, (tiles, 1, 1), (_GEMM_THREADS,),
                (a, b, out, *dims, np.int32(bool(accumulate)), np.int32(cvec), np.int32(per_split)), _GEMM_SMEM)
        return True
    ws = _cp().empty((splits, M, N), np.float32)
    _launch("gemm_3xtf32", name, (tiles, 1, splits), (_GEMM_THREADS,),
            (a, b, ws, *dims, np.int32(0), np.int32(N % 4 == 0), np.int32(per_split)), _GEMM_SMEM)
    mn = M * N
    rvec = 4 if mn % 4 == 0 and _aligned(out) else 1
    blocks = max(1, min(-(-mn // (rvec * _GEMM_THREADS)), 8 * sm_count()))
    _launch("gemm_3xtf32", f"gemm3x_splitk_reduce_v{rvec}", (blocks,), (_GEMM_THREADS,),
            (ws, out, np.int64(mn), np.int32(splits), np.int32(bool(accumulate))))
    return True


# ---------------------------------------------------------------------------------------------- registry

from blutrain.kernels.cuda import llama  # noqa: E402  (its launchers use the helpers above)

# op name -> (fused function, dtype names it handles). The device plugin registers each with a
# priority above the generic kernels and falls back to the generic one when it returns None.
KERNELS: dict[str, tuple[Callable[..., Any], tuple[str, ...]]] = {
    "layer_norm": (layer_norm, ("float32", "bfloat16")),
    "layer_norm_backward": (layer_norm_backward, ("float32", "bfloat16")),
    "gelu": (gelu, ("float32", "bfloat16")),
    "gelu_backward": (gelu_backward, ("float32", "bfloat16")),
    "bias_gelu": (bias_gelu, ("float32", "bfloat16")),
    "bias_gelu_backward": (bias_gelu_backward, ("float32", "bfloat16")),
    "cross_entropy": (cross_entropy, ("float32", "bfloat16")),
    "cross_entropy_backward": (cross_entropy_backward, ("float32", "bfloat16")),
    "softmax": (softmax, ("float32", "bfloat16")),
    "log_softmax": (log_softmax, ("float32", "bfloat16")),
    "softmax_backward": (softmax_backward, ("float32", "bfloat16")),
    "log_softmax_backward": (log_softmax_backward, ("float32", "bfloat16")),
    "embedding": (embedding, ("float32", "bfloat16")),
    "embedding_backward": (embedding_backward, ("float32", "bfloat16")),
    "sum": (sum, ("float32", "bfloat16")),
    "sdpa": (sdpa, ("float32", "bfloat16")),
    "sdpa_backward": (sdpa_backward, ("float32", "bfloat16")),
    "sdpa_packed": (sdpa_packed, ("float32", "bfloat16")),
    "sdpa_packed_backward": (sdpa_packed_backward, ("float32", "bfloat16")),
    "cast": (cast, ("float32", "bfloat16", "float16")),
    "rms_norm": (llama.rms_norm, ("float32", "bfloat16")),
    "rms_norm_backward": (llama.rms_norm_backward, ("float32", "bfloat16")),
    "rope": (llama.rope, ("float32", "bfloat16")),
    "rope_backward": (llama.rope_backward, ("float32", "bfloat16")),
    "swiglu": (llama.swiglu, ("float32", "bfloat16")),
    "swiglu_backward": (llama.swiglu_backward, ("float32", "bfloat16")),
}

# Ops with no generic kernel: registered as they are (they never return None for valid input).
STANDALONE: dict[str, tuple[Callable[..., Any], tuple[str, ...]]] = {
    "adamw_multi_tensor": (adamw_multi_tensor, ("float32",)),
    "scale_multi_tensor": (scale_multi_tensor, ("float32", "bfloat16")),
    "norm_multi_tensor": (norm_multi_tensor, ("float32", "bfloat16")),
    "cast_multi_tensor": (cast_multi_tensor, ("float32", "bfloat16", "float16")),
}

__all__ = [
    "ADAMW_TILE",
    "CAST_TILE",
    "FAMILIES",
    "GEMM_3XTF32_MIN_FLOPS",
    "KERNELS",
    "PHILOX_PER_COUNTER",
    "SCALE_TILE",
    "STANDALONE",
    "adamw_multi_tensor",
    "bias_gelu",
    "bias_gelu_backward",
    "cast",
    "cast_multi_tensor",
    "cross_entropy",
    "cross_entropy_backward",
    "cross_entropy_rows",
    "cross_entropy_with_grad",
    "embedding",
    "embedding_backward",
    "function",
    "gelu",
    "gelu_backward",
    "gemm_3xtf32",
    "is_deterministic",
    "layer_norm",
    "layer_norm_backward",
    "layer_norm_residual",
    "log_softmax",
    "log_softmax_backward",
    "module",
    "norm_multi_tensor",
    "philox",
    "scale_multi_tensor",
    "sdpa",
    "sdpa_backward",
    "sdpa_packed",
    "sdpa_packed_backward",
    "set_deterministic",
    "sm_count",
    "softmax",
    "softmax_backward",
    "source",
    "sum",
    "sum_cols",
    "sum_rows",
]
