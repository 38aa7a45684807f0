"""The "cpu" device backend: NumPy arrays, synchronous, seeded by Philox generators."""

from __future__ import annotations

import math
from collections.abc import Sequence
from types import ModuleType
from typing import Any

import numpy as np

from blutrain.tensor.backend import BackendRegistry, check_host_write
from blutrain.tensor.cpu.host_memory import keep_freed_memory
from blutrain.tensor.dtype import DType
from blutrain.tensor.plugins import hookimpl

_DLPACK_CPU = 1


def _to_jsonable(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _to_jsonable(v) for k, v in value.items()}
    if isinstance(value, np.ndarray):
        return {"__ndarray__": value.tolist(), "dtype": str(value.dtype)}
    if isinstance(value, np.integer):
        return int(value)
    return value


def _from_jsonable(value: Any) -> Any:
    if isinstance(value, dict):
        if "__ndarray__" in value:
            return np.asarray(value["__ndarray__"], dtype=value["dtype"])
        return {k: _from_jsonable(v) for k, v in value.items()}
    return value


class PhiloxGenerator:
    """NumPy's Philox counter-based generator; its state is JSON-able for checkpoints."""

    def __init__(self, seed: int = 0) -> None:
        self._gen = np.random.Generator(np.random.Philox(seed))

    def seed(self, seed: int) -> None:
        self._gen = np.random.Generator(np.random.Philox(seed))

    def uniform(self, shape: Sequence[int], dtype: DType) -> np.ndarray[Any, Any]:
        native = dtype.np if dtype.name in ("float32", "float64") else np.dtype(np.float32)
        return self._gen.random(tuple(shape), dtype=native).astype(dtype.np, copy=False)

    def normal(self, shape: Sequence[int], dtype: DType) -> np.ndarray[Any, Any]:
        native = dtype.np if dtype.name in ("float32", "float64") else np.dtype(np.float32)
        return self._gen.standard_normal(tuple(shape), dtype=native).astype(dtype.np, copy=False)

    def integers(self, low: int, high: int, shape: Sequence[int], dtype: DType) -> np.ndarray[Any, Any]:
        return np.asarray(self._gen.integers(low, high, size=tuple(shape), dtype=np.int64)).astype(dtype.np)

    def get_state(self) -> dict[str, Any]:
        return _to_jsonable(self._gen.bit_generator.state)  # type: ignore[no-any-return]

    def set_state(self, state: dict[str, Any]) -> None:
        self._gen.bit_generator.state = _from_jsonable(state)


class NumpyBackend:
    """Device type "cpu"."""

    name: str = "cpu"
    xp: ModuleType = np
    array_type: type = np.ndarray
    dlpack_device_type: int = _DLPACK_CPU
    accelerator: bool = False
    comm_backend: str = "mpi"  # blutrain-comm-mpi: host memory between processes

    def __init__(self) -> None:
        self._generator = PhiloxGenerator(0)
        # the host's large temporaries reused instead of faulted in at every op (host_memory.py)
        self.host_malloc = keep_freed_memory()

    def is_available(self) -> bool:
        return True

    def device_count(self) -> int:
        return 1

    def empty(self, shape: Sequence[int], dtype: DType, index: int) -> np.ndarray[Any, Any]:
        return np.empty(tuple(shape), dtype=dtype.np)

    def from_host(self, array: np.ndarray[Any, Any], index: int) -> np.ndarray[Any, Any]:
        return np.array(array, copy=True)

    def to_host(self, array: np.ndarray[Any, Any]) -> np.ndarray[Any, Any]:
        return array

    def write_from_host(self, array: np.ndarray[Any, Any], host: np.ndarray[Any, Any]) -> None:
        """NumPy runs synchronously: the values are in ``array`` when this returns."""
        check_host_write(array, host)
        np.copyto(array, host)

    def device_index(self, array: np.ndarray[Any, Any]) -> int:
        return 0

    def reserve_sms(self, index: int, sms: int, products: int) -> None:
        """Nothing to plan: BLAS on the host does not size its work by SM count."""

    def data_ptr(self, array: np.ndarray[Any, Any]) -> int:
        return int(array.__array_interface__["data"][0])

    def synchronize(self, index: int = 0) -> None:
        """Nothing to wait for: NumPy runs synchronously."""

    def generator(self, index: int = 0) -> PhiloxGenerator:
        return self._generator

    def manual_seed(self, seed: int) -> None:
        self._generator.seed(seed)

    def set_tf32(self, enabled: bool) -> bool:
        """The CPU has no TF32 mode: float32 GEMMs stay float32."""
        return False

    def set_deterministic(self, enabled: bool) -> None:
        """Nothing to choose: the CPU kernels reduce in a fixed order and the embedding backward sorts its ids."""

    def device_name(self, index: int) -> str:
        return "cpu"  # no peak FLOP/s is listed for it: no MFU

    def max_memory_allocated(self, index: int) -> int | None:
        return None  # NumPy allocates through malloc, which keeps no peak

    def erf(self, array: np.ndarray[Any, Any]) -> np.ndarray[Any, Any]:
        # NumPy has no erf; math.erf is exact to double precision, which the float64 reference needs.
        return np.vectorize(math.erf, otypes=[np.float64])(array).astype(array.dtype, copy=False)  # type: ignore[no-any-return]


# One instance for the process: registries are rebuilt when plugins change, and the generator's
# state (what manual_seed set) must survive that.
BACKEND = NumpyBackend()


@hookimpl
def blutrain_register_backends(registry: BackendRegistry) -> None:
    registry.register(BACKEND)
