"""Launcher of ``philox.cu``: Philox4x32-10 draws (uniform, normal, integers, raw words) for the cuda
device's generator; ``philox_reference.py`` is its NumPy reference."""

from __future__ import annotations

import numpy as np

from blutrain.kernels.cuda._core import (
    Array,
    _cp,
    _launch,
    sm_count,
)

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
