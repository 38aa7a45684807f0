"""The contract a device backend implements, and the registry of installed backends.

A backend owns one device type ("cpu", "cuda", ...). Everything device-specific that is not a
kernel lives here: the array module its kernels compute with, host copies, synchronization,
streams and events (no-ops on the CPU), and seeded random generators. Adding a device touches no
core file: a plugin registers a Backend through ``blutrain_register_backends``.
"""

from __future__ import annotations

from collections.abc import Sequence
from types import ModuleType
from typing import Any, Protocol, runtime_checkable

import numpy as np

from blutrain.tensor import plugins
from blutrain.tensor.dtype import DType
from blutrain.tensor.errors import PluginError, ShapeError, TensorTypeError, TensorValueError
from blutrain.tensor.registry import Registry

Array = Any  # a backend array: numpy.ndarray on the CPU, cupy.ndarray on CUDA


@runtime_checkable
class Generator(Protocol):
    """A seeded random stream on one device; its state can be saved and restored exactly."""

    def seed(self, seed: int) -> None: ...
    def uniform(self, shape: Sequence[int], dtype: DType) -> Array: ...
    def normal(self, shape: Sequence[int], dtype: DType) -> Array: ...
    def integers(self, low: int, high: int, shape: Sequence[int], dtype: DType) -> Array: ...
    def get_state(self) -> dict[str, Any]: ...
    def set_state(self, state: dict[str, Any]) -> None: ...


@runtime_checkable
class DeviceProperties(Protocol):
    """What a backend tells about its devices for the trainer's reports (MFU, peak memory): part of
    :class:`Backend`. A device whose name has no known peak, or whose memory is not tracked (the CPU), gets no
    MFU or no peak memory."""

    def device_name(self, index: int) -> str:
        """The device's product name, e.g. "NVIDIA H100 80GB HBM3" (the MFU peak is looked up by it)."""
        ...

    def max_memory_allocated(self, index: int) -> int | None:
        """The most bytes that were allocated at once on the device so far, or None where not tracked."""
        ...


@runtime_checkable
class Backend(DeviceProperties, Protocol):
    """A device type. ``xp`` is the array module (NumPy-compatible) its generic kernels call.

    Every member is required (the registry refuses a backend that lacks one): what the trainer, the generic
    kernels and the tensor core ask of a device is declared here, never probed for. A backend's own extras
    (the CUDA backend's ``empty_cache()``) are used by its own plugin only.
    """

    name: str
    xp: ModuleType
    array_type: type
    dlpack_device_type: int
    # an accelerator: ``default_device()`` (``--device auto``) takes the first available one, else "cpu"; each
    # rank of a launch on one takes its own device (its local rank)
    accelerator: bool
    # the comm backend (``blutrain_register_comm_backends``) that ranks on this device use unless told otherwise
    comm_backend: str

    def is_available(self) -> bool: ...
    def device_count(self) -> int: ...
    def empty(self, shape: Sequence[int], dtype: DType, index: int) -> Array: ...
    def from_host(self, array: np.ndarray[Any, Any], index: int) -> Array: ...
    def to_host(self, array: Array) -> np.ndarray[Any, Any]: ...

    def write_from_host(self, array: Array, host: np.ndarray[Any, Any]) -> None:
        """Copy ``host``'s values into ``array``, an existing C-contiguous array of this backend with the same shape
        and dtype, in place. The copy is ordered on ``array``'s device's current stream after the work already
        queued there (kernels queued before it read the old values, those queued after it the new ones), and the
        call returns without waiting for the device; ``host`` may be reused as soon as it returns. This is how
        per-step values reach device memory that a captured graph reads (``blutrain.optim.StepScalars``): no
        allocation, no host wait. A write while the current stream captures a graph is refused (a replay would
        copy from host memory reused since); a shape, dtype or layout mismatch raises, naming both."""
        ...
    def device_index(self, array: Array) -> int: ...
    def data_ptr(self, array: Array) -> int: ...
    def synchronize(self, index: int) -> None: ...
    def generator(self, index: int) -> Generator: ...
    def manual_seed(self, seed: int) -> None: ...

    def set_tf32(self, enabled: bool) -> bool:
        """Let float32 GEMMs use TF32 (``enabled``) or keep them strict float32; returns whether the device has a
        TF32 mode at all (False: float32 is computed either way, as on the CPU)."""
        ...

    def set_deterministic(self, enabled: bool) -> None:
        """Choose, process-wide, kernels whose results do not depend on thread scheduling (``enabled``) where
        the backend also has faster non-deterministic ones (atomics); a backend whose kernels are all
        deterministic does nothing."""
        ...

    def reserve_sms(self, index: int, sms: int, products: int) -> None:
        """Plan the next ``products`` matrix products launched on device ``index`` for its SM count less ``sms``:
        a collective kernel just launched beside them holds that many SMs while it runs, and a product planned
        for every SM would then leave part of its grid to a second wave (a communication backend calls this
        when it launches an overlapped collective). A backend that plans nothing by SM count ignores it."""
        ...

    def erf(self, array: Array) -> Array:
        """The error function, elementwise, on one of this backend's arrays, in its dtype: the generic kernels
        (erf, exact GELU) take it from here because NumPy and CuPy have none in their array modules."""
        ...


# Array type → array module, so generic kernels find NumPy or CuPy from their inputs with one dict
# lookup (Chainer's get_array_module, without importing CuPy).
ARRAY_MODULES: dict[type, ModuleType] = {np.ndarray: np}
# Array type → the device type of the backend that registered it ("cpu" for NumPy's)
ARRAY_DEVICES: dict[type, str] = {np.ndarray: "cpu"}
# Array type → the backend that registered it (for what its array module lacks, such as erf)
ARRAY_BACKENDS: dict[type, Backend] = {}


def array_module(array: Any) -> ModuleType:
    """The array module (NumPy, CuPy, ...) that owns ``array``."""
    return ARRAY_MODULES.get(type(array), np)


def array_backend(array: Any) -> Backend:
    """The registered backend whose arrays are of ``array``'s type (a NumPy scalar, which NumPy makes of a 0-d
    array's arithmetic, is NumPy's array)."""
    backend = ARRAY_BACKENDS.get(type(array))
    if backend is None:
        if not ARRAY_BACKENDS:
            backends()  # registration fills ARRAY_BACKENDS: the first lookup may precede it
        kind = np.ndarray if isinstance(array, np.generic) else type(array)
        backend = ARRAY_BACKENDS.get(kind)
    if backend is None:
        raise PluginError(f"no registered backend computes on arrays of type {type(array).__name__}")
    return backend


def check_host_write(array: Array, host: np.ndarray[Any, Any]) -> None:
    """Raise unless ``host`` may be written into ``array`` by :meth:`Backend.write_from_host`: the same shape and
    dtype, and ``array`` C-contiguous (a backend copies its bytes in one piece)."""
    if not isinstance(host, np.ndarray):
        raise TensorTypeError(f"write_from_host: host must be a numpy.ndarray, got {type(host).__name__}; pass "
                              "np.asarray(values, dtype=array.dtype)")
    if tuple(host.shape) != tuple(array.shape):
        raise ShapeError(f"write_from_host: host has shape {tuple(host.shape)}, array {tuple(array.shape)}; give "
                         "host values of the array's shape")
    if host.dtype != array.dtype:
        raise TensorTypeError(f"write_from_host: host has dtype {host.dtype}, array {array.dtype}; convert the host "
                              "values to the array's dtype first")
    if not array.flags.c_contiguous:
        raise TensorValueError(f"write_from_host: array (shape {tuple(array.shape)}, strides {array.strides}) is not "
                               "C-contiguous; write into a contiguous array (from_host or empty make one)")


def is_writeable(array: Any) -> bool:
    """Whether writing into ``array`` in place is safe. NumPy says so in its flags; CuPy has no
    read-only arrays, so there an expanded (broadcast) view shows itself by a zero stride."""
    writeable = getattr(array.flags, "writeable", None)
    if writeable is not None:
        return bool(writeable)
    return all(stride != 0 for stride, n in zip(array.strides, array.shape, strict=True) if n > 1)


class BackendRegistry(Registry[Backend]):
    """Device type → Backend, filled by ``blutrain_register_backends``."""

    def __init__(self) -> None:
        super().__init__("device backend", {"cuda": "'blutrain-backend-cupy[cuda12]' (or [cuda13])"})

    def register(self, name: str | Backend, obj: Backend | None = None) -> None:
        """``register(backend)`` (its ``name`` is the device type) or ``register(name, backend)``."""
        if obj is None:
            if isinstance(name, str):
                raise PluginError(f"{self.current_provider.plugin}: register(backend) got only a name {name!r}")
            obj, name = name, name.name
        assert isinstance(name, str)
        missing = [a for a in ("xp", "array_type", "accelerator", "comm_backend",
                               "empty", "from_host", "to_host", "write_from_host", "data_ptr", "synchronize",
                               "generator", "manual_seed", "is_available", "device_count", "set_tf32",
                               "set_deterministic", "reserve_sms", "erf", "device_name", "max_memory_allocated")
                   if not hasattr(obj, a)]
        if missing:
            raise PluginError(f"{self.current_provider.plugin}: backend {name!r} lacks {', '.join(missing)} of the "
                              "blutrain.tensor.Backend protocol")
        super().register(name, obj)
        ARRAY_MODULES[obj.array_type] = obj.xp
        ARRAY_DEVICES[obj.array_type] = name
        ARRAY_BACKENDS[obj.array_type] = obj


def backends() -> BackendRegistry:
    """Every installed backend (loads plugins on first use)."""
    return plugins.registry("blutrain_register_backends", BackendRegistry)


def default_device() -> str:
    """The device type ``--device auto`` means: the first available accelerator among the registered backends
    (by name), else "cpu"."""
    registry = backends()
    for name in registry.names():
        backend = registry.get(name)
        if backend.accelerator and backend.is_available():
            return name
    return "cpu"


def get_backend(name: str) -> Backend:
    return backends().get(name)
