"""Half-precision math in float32: how a backend runs a float16/bfloat16 kernel that computes in float32.

Like PyTorch's CPU kernels, BluTrain's generic kernels do float16/bfloat16 arithmetic in float32 and
round once at the end, on every backend that registers them. The wrapping is the same everywhere: widen
the half-precision array arguments to float32, run the kernel, round its float32 outputs back to the
storage dtype, except statistics that only backward reads (kept float32, as PyTorch keeps them, so that
backward does not start from rounded values). What differs between backends is given to
:class:`HalfPrecision`: which arguments are the backend's arrays, and how it casts one (``.astype``, or a
faster kernel with the same bits).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from blutrain.tensor.dtype import HALF_NAMES, DType

Kernel = Callable[..., Any]
_F32 = np.dtype(np.float32)


def _same(value: Any) -> Any:
    return value


class HalfPrecision:
    """One backend's rule for computing half-precision kernels in float32.

    ``is_array(v)`` says whether ``v`` is one of the backend's arrays (only those are cast);
    ``cast(v, dtype)`` returns ``v`` converted to ``dtype`` (``v.astype(dtype)`` or the same bits);
    ``finish(v)`` is applied to every output that is not rounded (by default it returns ``v`` as is).
    """

    __slots__ = ("_cast", "_finish", "_is_array")

    def __init__(self, is_array: Callable[[Any], bool], cast: Callable[[Any, np.dtype[Any]], Any],
                 finish: Callable[[Any], Any] = _same) -> None:
        self._is_array = is_array
        self._cast = cast
        self._finish = finish

    def widen(self, value: Any) -> Any:
        """``value`` in float32 if it is a float16/bfloat16 array (each element of a list likewise), else as is."""
        if isinstance(value, list):
            return [self.widen(v) for v in value]
        if self._is_array(value) and value.dtype.name in HALF_NAMES:
            return self._cast(value, _F32)
        return value

    def narrow(self, value: Any, dtype: np.dtype[Any]) -> Any:
        """``value`` rounded to ``dtype`` if it is a float32 array (each element of a tuple likewise), else
        ``finish(value)``."""
        if isinstance(value, tuple):
            return tuple(self.narrow(v, dtype) for v in value)
        if self._is_array(value) and value.dtype == _F32:
            return self._cast(value, dtype)
        return self._finish(value)

    def in_float32(self, fn: Kernel, dtype: DType, keep: tuple[int, ...] = ()) -> Kernel:
        """``fn`` run in float32 on half-precision arguments, its float32 outputs rounded back to ``dtype``.

        Outputs listed in ``keep`` (per-row statistics that only backward reads: mean, rstd, log-sum-exp)
        stay float32.
        """
        target = dtype.np
        widen, narrow, finish = self.widen, self.narrow, self._finish

        def kernel(*args: Any) -> Any:
            out = fn(*[widen(a) for a in args])
            if not keep:
                return narrow(out, target)
            return tuple(finish(o) if i in keep else narrow(o, target) for i, o in enumerate(out))

        kernel.__name__ = getattr(fn, "__name__", "kernel")
        return kernel


__all__ = ["HalfPrecision"]
