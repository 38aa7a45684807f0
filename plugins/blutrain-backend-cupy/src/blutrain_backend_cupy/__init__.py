"""blutrain-backend-cupy: the "cuda" device for BluTrain, as a plugin.

It registers the "cuda" backend (CuPy arrays, host copies through pinned memory, streams and events,
a Philox4x32-10 generator per GPU) and a kernel for every op on "cuda": the generic kernels on CuPy,
cuBLAS GEMM, and the fused kernels of :mod:`blutrain.kernels.cuda` over them; and, where blutrain-compiler is
installed, the "cuda" compile target (fused regions and the CUDA-graph executor of compiled steps). It
imports and registers without CuPy or a GPU; the device then reports itself unavailable and using it raises
:class:`CudaUnavailableError` with the reason.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from blutrain.tensor.backend import BackendRegistry
from blutrain.tensor.kernel import KernelRegistry
from blutrain.tensor.plugins import hookimpl
from blutrain_backend_cupy import cuda
from blutrain_backend_cupy import kernels as _kernels
from blutrain_backend_cupy.backend import CudaUnavailableError, CupyBackend, PhiloxGenerator, backend
from blutrain_backend_cupy.gemm import fp32_gemm, set_fp32_gemm, set_tf32, tf32_enabled
from blutrain_backend_cupy.host_writes import CaptureWriteError
from blutrain_backend_cupy.streams import Event, Stream, current_stream, device, stream

if TYPE_CHECKING:
    from blutrain.compiler.target import CompileTargetRegistry


def is_available() -> bool:
    """True when CuPy is installed and at least one NVIDIA GPU is visible."""
    return backend().is_available()


@hookimpl
def blutrain_register_backends(registry: BackendRegistry) -> None:
    registry.register(backend())


@hookimpl
def blutrain_register_kernels(registry: KernelRegistry) -> None:
    _kernels.register(registry, backend().is_available())


@hookimpl(optionalhook=True)  # blutrain-compiler's hook: no error where the compiler is not installed
def blutrain_register_compile_targets(registry: CompileTargetRegistry) -> None:
    """The "cuda" compile target (:mod:`blutrain_backend_cupy.compile_target`): how a compiled step runs here."""
    from blutrain_backend_cupy.compile_target import TARGET

    registry.register(TARGET.device, TARGET)


__all__ = [
    "CaptureWriteError",
    "CudaUnavailableError",
    "CupyBackend",
    "Event",
    "PhiloxGenerator",
    "Stream",
    "backend",
    "cuda",
    "current_stream",
    "device",
    "fp32_gemm",
    "is_available",
    "set_fp32_gemm",
    "set_tf32",
    "stream",
    "tf32_enabled",
]
