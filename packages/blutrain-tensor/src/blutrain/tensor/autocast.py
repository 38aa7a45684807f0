"""Mixed precision: an autocast region runs GEMMs and attention in a low-precision dtype and the
numerically sensitive ops (LayerNorm, RMSNorm, softmax, log-softmax, cross-entropy) in float32.

Parameters stay in float32 (the master weights): inside the region the GEMM ops cast their floating
inputs to the region's dtype, and because that cast is itself a recorded op, gradients flow back
and accumulate in float32. Everything else runs in the dtype of its inputs, so a residual stream
that starts in float32 stays in float32 (bf16 + fp32 promotes to fp32), as under PyTorch's autocast.
The state is one thread-local attribute, read by the op functions without a call when it is off.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable
from types import TracebackType
from typing import Any, TypeVar

from blutrain.tensor.dtype import DType, as_dtype, bfloat16, float16, float32
from blutrain.tensor.errors import TensorTypeError

F = TypeVar("F", bound=Callable[..., Any])


class AutocastState(threading.local):
    dtype: DType | None = None


state = AutocastState()


def lower(t: Any) -> Any:
    """``t`` in the region's dtype when it is a floating tensor of another dtype (GEMM inputs)."""
    dt = state.dtype
    if dt is None or t is None or not t.dtype.is_floating or t.dtype is dt:
        return t
    return t.to(dtype=dt)


def widen(t: Any) -> Any:
    """``t`` in float32 when it is a half-precision tensor (norms, softmax, losses)."""
    if t is None or t.dtype not in (bfloat16, float16):
        return t
    return t.to(dtype=float32)


def get_autocast_dtype() -> DType | None:
    """The dtype of the innermost active autocast region, or None outside any."""
    return state.dtype


class autocast:  # noqa: N801  (named as PyTorch users know it)
    """``with autocast(dtype=bfloat16):`` (or as a decorator) — see the module docstring."""

    def __init__(self, dtype: DType | str = bfloat16, enabled: bool = True) -> None:
        dt = as_dtype(dtype, "autocast dtype")
        if dt not in (bfloat16, float16):
            raise TensorTypeError(f"autocast: dtype must be bfloat16 or float16, got {dt.name}")
        self.dtype: DType | None = dt if enabled else None
        self._prev: list[DType | None] = []

    def __enter__(self) -> None:
        self._prev.append(state.dtype)
        state.dtype = self.dtype

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        state.dtype = self._prev.pop()

    def __call__(self, fn: F) -> F:
        region = self

        @functools.wraps(fn)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            with autocast(region.dtype or bfloat16, enabled=region.dtype is not None):
                return fn(*args, **kwargs)

        return wrapper  # type: ignore[return-value]
