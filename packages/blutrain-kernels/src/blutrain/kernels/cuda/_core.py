"""The launch core of the CUDA kernel library: each family's source with the folder's headers pasted in, its
module compiled once per device (NVRTC through CuPy; sm_90a for the Hopper families), its kernels looked up
and launched (dynamic shared memory beyond 48 KB opted into once per kernel), the device queries the launch
shapes need, the deterministic-kernel switch, and the array helpers every family's launcher shares.

Importing this module does not import CuPy; nothing here runs without a GPU.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import re
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from blutrain.tensor.errors import PluginError

Array = Any
_DIR = Path(__file__).parent
FAMILIES = ("adamw", "attention", "attention_bf16", "attention_wgmma", "attention_wgmma_bwd", "casts", "cross_entropy",
            "embedding", "gelu", "gemm_3xtf32", "half_elementwise", "layernorm", "llama", "philox", "reduce", "scale",
            "softmax")
_OPTIONS = ("-std=c++17",)
# Families of Hopper-only instructions (wgmma): built for sm_90a by NVRTC directly, see hopper_module
HOPPER_FAMILIES = frozenset({"attention_wgmma", "attention_wgmma_bwd"})
_DEFAULT_SMEM = 48 * 1024

_modules: dict[tuple[int, str], Any] = {}
# (family, name) -> cupy.RawKernel, which compiles and loads itself for whichever device is current when it runs
_functions: dict[tuple[str, str], Any] = {}
# (device, family, name) -> a Hopper family's function, which belongs to the device it was loaded on
_hopper_functions: dict[tuple[int, str, str], Any] = {}
_smem_set: dict[tuple[int, str, str], int] = {}
_sm_count: dict[int, int] = {}
_smem_per_sm: dict[int, int] = {}
_resident: dict[tuple[int, str, str, int, int], int] = {}
_deterministic = True
# op name -> (launcher, dtype names it handles): the shape of a family's KERNELS and STANDALONE tables
Registry = dict[str, tuple[Callable[..., Any], tuple[str, ...]]]


_cupy: Any = None


def _cp() -> Any:
    """CuPy, imported at the first use; later uses read one global (the launchers call this per launch)."""
    global _cupy
    if _cupy is None:
        import cupy

        _cupy = cupy
    return _cupy


def _device() -> int:
    """The current device's index (one runtime call; no ``cupy.cuda.Device`` object)."""
    return int(_cp().cuda.runtime.getDevice())


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
    key = (_device(), family)
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
    """One kernel (``cupy.RawKernel``) of a family, for the current device. A RawKernel serves every device (it
    compiles and loads itself for the device current when it runs), so it is cached by name alone and a call
    is one dictionary lookup; a Hopper family's function belongs to one device and is cached per device."""
    fn = _functions.get((family, name))
    if fn is not None:
        return fn
    if family in HOPPER_FAMILIES:
        key = (_device(), family, name)
        fn = _hopper_functions.get(key)
        if fn is None:
            fn = module(family).get_function(name)
            _hopper_functions[key] = fn
        return fn
    fn = module(family).get_function(name)
    _functions[(family, name)] = fn
    return fn


def _launch(family: str, name: str, grid: tuple[int, ...], block: tuple[int, ...], args: tuple[Any, ...],
            smem: int = 0) -> None:
    fn = function(family, name)
    if smem > _DEFAULT_SMEM:
        key = (_device(), family, name)
        if _smem_set.get(key, 0) < smem:  # opt in beyond 48 KB (cudaFuncSetAttribute)
            if family in HOPPER_FAMILIES:  # a Module's Function has no setter: the driver call
                from cupy_backends.cuda.api import driver

                driver.funcSetAttribute(fn.ptr, 8, smem)  # CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES
            else:
                fn.max_dynamic_shared_size_bytes = smem
            _smem_set[key] = smem
    fn(grid, block, args, shared_mem=smem)


def sm_count() -> int:
    """Multiprocessors of the current device (queried once per device)."""
    dev = _device()
    n = _sm_count.get(dev)
    if n is None:
        n = int(_cp().cuda.Device(dev).attributes["MultiProcessorCount"])
        _sm_count[dev] = n
    return n


def shared_memory_per_sm() -> int:
    """Bytes of shared memory one multiprocessor of the current device holds (blocks' reservations included)."""
    cp = _cp()
    dev = cp.cuda.Device()
    n = _smem_per_sm.get(dev.id)
    if n is None:
        n = int(dev.attributes.get("MaxSharedMemoryPerMultiprocessor", _DEFAULT_SMEM))
        _smem_per_sm[dev.id] = n
    return n


def _resident_blocks(family: str, name: str, threads: int, smem: int = 0) -> int:
    """Blocks of ``threads`` threads of one kernel that the whole device holds at once (registers, threads
    and shared memory per multiprocessor; Hopper's limits: 64 K registers, 2048 threads, 228 KB)."""
    key = (_device(), family, name, threads, smem)
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
    """``a`` C-contiguous: itself where it is (no CuPy call), else ``cupy.ascontiguousarray`` (which also makes
    a 0-d array 1-d, as every caller has always received)."""
    if a is None or (a.ndim and a.flags.c_contiguous):
        return a
    return _cp().ascontiguousarray(a)


def _numel(shape: Sequence[int]) -> int:
    n = 1
    for s in shape:
        n *= int(s)
    return n


_grids: dict[int, tuple[int]] = {}


def _elementwise_grid(nv: int) -> tuple[int]:
    """Blocks of 256 threads for a grid-stride kernel over ``nv`` work items: one item per thread, at most 16
    blocks per multiprocessor, at least one. Cached by ``nv`` (a bounded table), with no device query per
    launch: a grid-stride kernel computes the same result with any grid, so one sized for the device current
    at the first call serves every device."""
    g = _grids.get(nv)
    if g is None:
        g = (max(1, min((nv + 255) // 256, 16 * sm_count())),)
        if len(_grids) < 4096:
            _grids[nv] = g
    return g
