"""The "cuda" device backend: CuPy arrays on NVIDIA GPUs, one seeded Philox stream per GPU.

The backend registers whether or not a GPU is there: without CuPy, or without a visible GPU, it
reports ``is_available() == False`` and ``device_count() == 0``, and anything that would put data on
the device raises :class:`CudaUnavailableError` saying why.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from types import ModuleType
from typing import Any

import numpy as np

from blutrain.kernels import cuda as kernels_cuda
from blutrain.tensor.backend import check_host_write
from blutrain.tensor.dtype import DType
from blutrain.tensor.errors import BluTrainError, TensorTypeError, TensorValueError
from blutrain_backend_cupy import gemm
from blutrain_backend_cupy.host_writes import PinnedStaging

DLPACK_CUDA = 2
# Copies to host at least this large go through page-locked memory (about twice the bandwidth of a
# pageable copy); smaller ones are dominated by latency and use a plain copy.
PINNED_MIN_BYTES = 1 << 20
ALGORITHM = "philox4x32-10"


class CudaUnavailableError(BluTrainError, RuntimeError):
    """The "cuda" device was used where CuPy or a GPU is missing."""


_probe_cache: tuple[Any, int, str] | None = None


def probe() -> tuple[Any, int, str]:
    """(the cupy module or None, visible GPUs, why none are usable); looked up once per process."""
    global _probe_cache
    if _probe_cache is None:
        try:
            import cupy
        except Exception as exc:  # ImportError, or a CuPy built for another CUDA failing to load
            _probe_cache = (None, 0, f"CuPy is not installed ({exc}); install blutrain-backend-cupy[cuda12] "
                                     "or blutrain-backend-cupy[cuda13]")
        else:
            try:
                count = int(cupy.cuda.runtime.getDeviceCount())
            except Exception as exc:
                _probe_cache = (cupy, 0, f"no CUDA GPU is visible (CuPy: {exc})")
            else:
                reason = "" if count else "no CUDA GPU is visible (CuPy: 0 devices)"
                _probe_cache = (cupy, count, reason)
    return _probe_cache


def unavailable_error() -> CudaUnavailableError:
    return CudaUnavailableError(f"device 'cuda': {probe()[2]}")


def require_cupy() -> Any:
    """The cupy module, or CudaUnavailableError when no GPU can be used."""
    cp, count, _ = probe()
    if not count:
        raise unavailable_error()
    return cp


class _NoCupyArray:
    """Stands for cupy.ndarray in the array-module table when CuPy is missing; never instantiated."""


def _missing_module(reason: str) -> ModuleType:
    mod = ModuleType("blutrain_backend_cupy.missing_cupy", f"CuPy is unavailable: {reason}")

    def missing(name: str) -> Any:
        raise CudaUnavailableError(f"device 'cuda': {reason} (needed for cupy.{name})")

    mod.__getattr__ = missing  # type: ignore[method-assign]
    return mod


def _numel(shape: Sequence[int]) -> int:
    return math.prod(int(s) for s in shape)


class PhiloxGenerator:
    """A seeded Philox4x32-10 stream on one GPU. Its state is the key (seed) and the next counter
    (offset): draws are a pure function of both, whatever the launch shape, and the state is two
    integers, JSON-able for checkpoints."""

    def __init__(self, index: int, seed: int = 0) -> None:
        self.index = index
        self._seed = seed % 2**64
        self._offset = 0

    def seed(self, seed: int) -> None:
        self._seed = int(seed) % 2**64
        self._offset = 0

    def _draw(self, kind: str, n: int, low: int = 0, high: int = 0) -> Any:
        cp = require_cupy()
        with cp.cuda.Device(self.index):
            out, used = kernels_cuda.philox(kind, n, self._seed, self._offset, low, high)
        self._offset += used
        return out

    def uniform(self, shape: Sequence[int], dtype: DType) -> Any:
        """Uniform on [0, 1); float64 draws 53 random bits, the others float32 (24) rounded to dtype."""
        wide = dtype.name == "float64"
        out = self._draw("uniform_f64" if wide else "uniform_f32", _numel(shape)).reshape(tuple(shape))
        return out if dtype.name in ("float32", "float64") else out.astype(dtype.np)

    def normal(self, shape: Sequence[int], dtype: DType) -> Any:
        wide = dtype.name == "float64"
        out = self._draw("normal_f64" if wide else "normal_f32", _numel(shape)).reshape(tuple(shape))
        return out if dtype.name in ("float32", "float64") else out.astype(dtype.np)

    def integers(self, low: int, high: int, shape: Sequence[int], dtype: DType) -> Any:
        if high <= low:
            raise TensorValueError(f"integers: high ({high}) must be greater than low ({low})")
        out = self._draw("integers", _numel(shape), int(low), int(high)).reshape(tuple(shape))
        return out if dtype.name == "int64" else out.astype(dtype.np)

    def get_state(self) -> dict[str, Any]:
        return {"algorithm": ALGORITHM, "seed": self._seed, "offset": self._offset}

    def set_state(self, state: dict[str, Any]) -> None:
        if state.get("algorithm") != ALGORITHM:
            raise TensorValueError(f"set_state: expected a {ALGORITHM} state from a cuda generator, got "
                                   f"algorithm {state.get('algorithm')!r}")
        self._seed = int(state["seed"]) % 2**64
        self._offset = int(state["offset"])


class CupyBackend:
    """Device type "cuda"."""

    name = "cuda"
    dlpack_device_type = DLPACK_CUDA
    accelerator = True
    comm_backend = "nccl"  # blutrain-comm-nccl: collectives between GPUs, inside CUDA graphs too
    xp: ModuleType
    array_type: type

    def __init__(self) -> None:
        cp, count, reason = probe()
        self._cp = cp
        self._count = count
        self.xp = cp if cp is not None else _missing_module(reason)
        self.array_type = cp.ndarray if cp is not None else _NoCupyArray
        self._seed = 0
        self._generators: dict[int, PhiloxGenerator] = {}
        self._staging: dict[int, PinnedStaging] = {}  # per GPU: the page-locked slots of write_from_host
        if count:
            from blutrain_backend_cupy.memory import install_default

            install_default()

    def empty_cache(self) -> None:
        """Give every wholly free cached segment back to CUDA (``blutrain.cuda.empty_cache``)."""
        from blutrain_backend_cupy.memory import empty_cache

        empty_cache()

    def set_tf32(self, enabled: bool) -> bool:
        """Let float32 GEMMs use TF32 tensor cores (the trainer's ``--dtype tf32``); the GPU has the mode."""
        from blutrain_backend_cupy.gemm import set_tf32

        set_tf32(enabled)
        return True

    def set_deterministic(self, enabled: bool) -> None:
        """The one cuda kernel with a faster non-deterministic variant is the embedding backward (atomics);
        ``enabled`` pins the sorted-segment one (importing the kernel library does not import CuPy)."""
        kernels_cuda.set_deterministic(enabled)

    def reserve_sms(self, index: int, sms: int, products: int) -> None:
        """cuBLAS and cuBLASLt plan the next ``products`` GEMMs on GPU ``index`` for ``sms`` fewer SMs
        (their SM count target; a compiled step keeps the plans of its capture)."""
        gemm.reserve_sms(index, sms, products)

    def erf(self, array: Any) -> Any:
        from cupyx.scipy.special import erf as cupy_erf

        return cupy_erf(array)

    def is_available(self) -> bool:
        return self._count > 0

    # the trainer's MFU and peak-memory reports (blutrain.tensor.DeviceProperties, part of Backend)
    def device_name(self, index: int) -> str:
        cp = self._check(index)
        name = cp.cuda.runtime.getDeviceProperties(index)["name"]
        return name.decode() if isinstance(name, bytes) else str(name)

    def max_memory_allocated(self, index: int) -> int | None:
        """The caching allocator's peak of live bytes; None under CuPy's own pool, which keeps no peak."""
        from blutrain_backend_cupy.memory import install_default, max_memory_allocated

        if install_default() != "blutrain":  # the allocator in use (installed once, when a GPU was found)
            return None
        return max_memory_allocated(index)

    def device_count(self) -> int:
        return self._count

    def _check(self, index: int) -> Any:
        cp = require_cupy()
        if not 0 <= index < self._count:
            raise TensorValueError(f"device 'cuda:{index}' does not exist; {self._count} GPU(s) are visible")
        return cp

    def empty(self, shape: Sequence[int], dtype: DType, index: int) -> Any:
        cp = self._check(index)
        with cp.cuda.Device(index):
            return cp.empty(tuple(shape), dtype=dtype.np)

    def from_host(self, array: np.ndarray[Any, Any], index: int) -> Any:
        cp = self._check(index)
        with cp.cuda.Device(index):
            return cp.asarray(array)

    def write_from_host(self, array: Any, host: np.ndarray[Any, Any]) -> None:
        """A ``cudaMemcpyAsync`` on the current stream of ``array``'s GPU from a page-locked staging slot
        (:class:`~blutrain_backend_cupy.host_writes.PinnedStaging`): a copy from pageable memory may make the
        host wait for the stream. Refused while that stream captures a graph (:class:`CaptureWriteError`)."""
        cp = require_cupy()
        if type(array) is not cp.ndarray:
            raise TensorTypeError(f"write_from_host: array must be a cupy.ndarray, got {type(array).__name__}")
        check_host_write(array, host)
        index = int(array.device.id)
        staging = self._staging.get(index)
        if staging is None:  # setdefault: two threads' first writes share one staging (slots in flight stay held)
            staging = self._staging.setdefault(index, PinnedStaging(cp, index))
        staging.write(array, host)

    def to_host(self, array: Any) -> np.ndarray[Any, Any]:
        cp = require_cupy()
        if array.nbytes < PINNED_MIN_BYTES:
            return array.get()  # type: ignore[no-any-return]
        import cupyx

        with cp.cuda.Device(array.device.id):
            src = cp.ascontiguousarray(array)
            host = cupyx.empty_pinned(src.shape, dtype=src.dtype)
            src.get(out=host)  # waits for the copy: the result is ready when this returns
        return host  # type: ignore[no-any-return]

    def device_index(self, array: Any) -> int:
        return int(array.device.id)

    def data_ptr(self, array: Any) -> int:
        return int(array.data.ptr)

    def synchronize(self, index: int = 0) -> None:
        cp = self._check(index)
        cp.cuda.Device(index).synchronize()

    def generator(self, index: int = 0) -> PhiloxGenerator:
        self._check(index)
        gen = self._generators.get(index)
        if gen is None:
            gen = PhiloxGenerator(index, self._seed)
            self._generators[index] = gen
        return gen

    def manual_seed(self, seed: int) -> None:
        """Seed every GPU's generator with ``seed`` (each restarts at counter 0)."""
        self._seed = int(seed) % 2**64
        for gen in self._generators.values():
            gen.seed(self._seed)


_instance: CupyBackend | None = None


def backend() -> CupyBackend:
    """The process's one CupyBackend (the one the plugin registers)."""
    global _instance
    if _instance is None:
        _instance = CupyBackend()
    return _instance
