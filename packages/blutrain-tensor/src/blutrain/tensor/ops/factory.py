"""Tensor factories and random numbers.

Random tensors come from the device backend's seeded generator (Philox on the CPU), so
``manual_seed`` makes every factory below reproducible, and a generator's state can be saved in a
checkpoint and restored exactly.
"""

from __future__ import annotations

from typing import Any

from blutrain.tensor import dispatch
from blutrain.tensor.backend import Generator, backends
from blutrain.tensor.base import Scalar, _shape_arg
from blutrain.tensor.device import Device, device
from blutrain.tensor.dtype import DType, as_dtype, get_default_dtype, int64
from blutrain.tensor.errors import TensorTypeError, TensorValueError
from blutrain.tensor.tensor import Tensor, as_tensor_data

_kernel = dispatch.kernel


def _resolve(dtype: DType | str | None, dev: str | Device | None, default: DType | None = None) -> tuple[DType, Device]:
    dt = as_dtype(dtype) if dtype is not None else (default or get_default_dtype())
    return dt, device(dev)


def _finish(t: Tensor, requires_grad: bool) -> Tensor:
    return t.requires_grad_(True) if requires_grad else t


def tensor(data: Any, *, dtype: DType | str | None = None, device: str | Device | None = None,
           requires_grad: bool = False) -> Tensor:
    """A new tensor holding a copy of ``data`` (nested lists, scalars, arrays)."""
    return _finish(as_tensor_data(data, dtype=dtype, device=device), requires_grad)


def full(size: Any, fill_value: Scalar, *, dtype: DType | str | None = None, device: str | Device | None = None,
         requires_grad: bool = False) -> Tensor:
    shape = _shape_arg((size,) if isinstance(size, int) else tuple(size))
    if any(s < 0 for s in shape):
        raise TensorValueError(f"full: sizes must be non-negative, got {list(shape)}")
    if not isinstance(fill_value, (bool, int, float)):
        raise TensorTypeError(f"full: fill_value must be a Python bool, int or float, got "
                              f"{type(fill_value).__name__}")
    if dtype is None and isinstance(fill_value, bool):
        dtype = "bool"
    elif dtype is None and isinstance(fill_value, int):
        dtype = int64
    dt, dev = _resolve(dtype, device)
    return _finish(Tensor._make(_kernel("full", dev.type, dt)(shape, fill_value, dt.np), dt, dev), requires_grad)


def zeros(*size: Any, dtype: DType | str | None = None, device: str | Device | None = None,
          requires_grad: bool = False) -> Tensor:
    dt, _ = _resolve(dtype, device)
    return full(_shape_arg(size), 0, dtype=dt, device=device, requires_grad=requires_grad)


def ones(*size: Any, dtype: DType | str | None = None, device: str | Device | None = None,
         requires_grad: bool = False) -> Tensor:
    dt, _ = _resolve(dtype, device)
    return full(_shape_arg(size), 1, dtype=dt, device=device, requires_grad=requires_grad)


def empty(*size: Any, dtype: DType | str | None = None, device: str | Device | None = None,
          requires_grad: bool = False) -> Tensor:
    """Uninitialized memory of the given shape."""
    dt, dev = _resolve(dtype, device)
    shape = _shape_arg(size)
    return _finish(Tensor._make(dev.backend.empty(shape, dt, dev.index), dt, dev), requires_grad)


def arange(start: Scalar, end: Scalar | None = None, step: Scalar = 1, *, dtype: DType | str | None = None,
           device: str | Device | None = None, requires_grad: bool = False) -> Tensor:
    if end is None:
        start, end = 0, start
    if step == 0:
        raise TensorValueError("arange: step must be non-zero")
    if dtype is None:
        dtype = int64 if all(isinstance(v, int) for v in (start, end, step)) else get_default_dtype()
    dt, dev = _resolve(dtype, device)
    return _finish(Tensor._make(_kernel("arange", dev.type, dt)(start, end, step, dt.np), dt, dev), requires_grad)


def linspace(start: float, end: float, steps: int, *, dtype: DType | str | None = None,
             device: str | Device | None = None, requires_grad: bool = False) -> Tensor:
    if not isinstance(steps, int) or steps < 0:
        raise TensorValueError(f"linspace: steps must be a non-negative int, got {steps!r}")
    dt, dev = _resolve(dtype, device)
    return _finish(Tensor._make(_kernel("linspace", dev.type, dt)(start, end, steps, dt.np), dt, dev), requires_grad)


def eye(n: int, m: int | None = None, *, dtype: DType | str | None = None,
        device: str | Device | None = None) -> Tensor:
    dt, dev = _resolve(dtype, device)
    return Tensor._make(_kernel("eye", dev.type, dt)(n, n if m is None else m, dt.np), dt, dev)


def _gen(dev: Device, generator: Generator | None) -> Generator:
    return generator if generator is not None else dev.backend.generator(dev.index)


def rand(*size: Any, dtype: DType | str | None = None, device: str | Device | None = None,
         generator: Generator | None = None, requires_grad: bool = False) -> Tensor:
    """Uniform on [0, 1)."""
    dt, dev = _resolve(dtype, device)
    if not dt.is_floating:
        raise TensorTypeError(f"rand: dtype must be floating, got {dt.name}")
    return _finish(Tensor._make(_gen(dev, generator).uniform(_shape_arg(size), dt), dt, dev), requires_grad)


def randn(*size: Any, dtype: DType | str | None = None, device: str | Device | None = None,
          generator: Generator | None = None, requires_grad: bool = False) -> Tensor:
    """Standard normal."""
    dt, dev = _resolve(dtype, device)
    if not dt.is_floating:
        raise TensorTypeError(f"randn: dtype must be floating, got {dt.name}")
    return _finish(Tensor._make(_gen(dev, generator).normal(_shape_arg(size), dt), dt, dev), requires_grad)


def randint(low: int, high: int | None = None, size: Any = (), *, dtype: DType | str | None = None,
            device: str | Device | None = None, generator: Generator | None = None) -> Tensor:
    """Integers uniform in [low, high)."""
    if high is None:
        low, high = 0, low
    if high <= low:
        raise TensorValueError(f"randint: high ({high}) must be greater than low ({low})")
    dt, dev = _resolve(dtype, device, int64)
    shape = _shape_arg((size,) if isinstance(size, int) else tuple(size))
    return Tensor._make(_gen(dev, generator).integers(low, high, shape, dt), dt, dev)


def _like(x: Tensor, dtype: DType | str | None, device: str | Device | None) -> dict[str, Any]:
    return {"dtype": dtype if dtype is not None else x.dtype, "device": device if device is not None else x.device}


def zeros_like(x: Tensor, *, dtype: DType | str | None = None, device: str | Device | None = None,
               requires_grad: bool = False) -> Tensor:
    return zeros(x.shape, **_like(x, dtype, device), requires_grad=requires_grad)


def ones_like(x: Tensor, *, dtype: DType | str | None = None, device: str | Device | None = None,
              requires_grad: bool = False) -> Tensor:
    return ones(x.shape, **_like(x, dtype, device), requires_grad=requires_grad)


def full_like(x: Tensor, fill_value: Scalar, *, dtype: DType | str | None = None,
              device: str | Device | None = None) -> Tensor:
    return full(x.shape, fill_value, **_like(x, dtype, device))


def empty_like(x: Tensor, *, dtype: DType | str | None = None, device: str | Device | None = None) -> Tensor:
    return empty(x.shape, **_like(x, dtype, device))


def rand_like(x: Tensor, *, dtype: DType | str | None = None, device: str | Device | None = None) -> Tensor:
    return rand(x.shape, **_like(x, dtype, device))


def randn_like(x: Tensor, *, dtype: DType | str | None = None, device: str | Device | None = None) -> Tensor:
    return randn(x.shape, **_like(x, dtype, device))


def randint_like(x: Tensor, low: int, high: int | None = None, *, dtype: DType | str | None = None) -> Tensor:
    return randint(low, high, x.shape, dtype=dtype if dtype is not None else x.dtype, device=x.device)


def manual_seed(seed: int) -> None:
    """Seed the default generator of every installed backend (every device)."""
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise TensorTypeError(f"manual_seed: seed must be an int, got {seed!r}")
    for _, backend in backends().items():
        if backend.is_available():
            backend.manual_seed(seed)
