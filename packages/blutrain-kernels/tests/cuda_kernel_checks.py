"""What the kernel-by-kernel GPU tests (``test_cuda_<family>.py``) share: moving arrays to and from the device
and the comparison with the float64 CPU references.

Every output is written into poisoned memory (all bytes 0xFF: NaN for floats; see conftest.py) so that an
element the kernel forgets to write fails the finiteness check. float32 results must be within 1e-5 relative
error (||out - ref|| / ||ref||) of the float64 reference, bfloat16 results within 1e-2. Per-row statistics
(mean, rstd, log-sum-exp) are float32 for both input dtypes and held to 1e-5.
"""

from __future__ import annotations

from typing import Any

import ml_dtypes
import numpy as np

BF16 = np.dtype(ml_dtypes.bfloat16)
DTYPES = [np.dtype(np.float32), BF16]
TOL = {"float32": 1e-5, "bfloat16": 1e-2}


def dev(a: np.ndarray[Any, Any], dtype: Any = None) -> Any:
    import cupy as cp

    return cp.asarray(a if dtype is None else a.astype(dtype))


def host(a: Any) -> np.ndarray[Any, Any]:
    import cupy as cp

    return np.asarray(cp.asnumpy(a)).astype(np.float64)


def f64(a: np.ndarray[Any, Any], dtype: Any) -> np.ndarray[Any, Any]:
    """The values a device array of ``dtype`` holds, in float64 (bf16 rounding included)."""
    return a.astype(dtype).astype(np.float64)


def check(out: Any, ref: np.ndarray[Any, Any], dtype: Any, tol: float | None = None, floor: float = 1e-30) -> None:
    """||out - ref|| / max(||ref||, floor) within the dtype's tolerance; ``floor`` keeps a reference
    that is zero up to rounding (a gradient that cancels exactly) from dividing by nothing."""
    got = host(out)
    assert got.shape == ref.shape, (got.shape, ref.shape)
    assert np.isfinite(got).all() or not np.isfinite(ref).all(), "unwritten (poisoned) or non-finite output"
    assert np.array_equal(np.isfinite(got), np.isfinite(ref))
    fin = np.isfinite(ref)
    err = np.linalg.norm(got[fin] - ref[fin]) / max(np.linalg.norm(ref[fin]), floor)
    assert err <= (tol if tol is not None else TOL[np.dtype(dtype).name]), f"relative error {err:.3g}"


def rng(seed: int) -> np.random.Generator:
    return np.random.default_rng(seed)


def assert_attention_backward_deterministic(q: Any, k: Any, v: Any, g: Any, scale: float = 0.125) -> None:
    """Causal flash attention's backward twice on the same inputs: the same bits (no atomics in dq or dk/dv)."""
    from blutrain.kernels import cuda

    res = cuda.sdpa(q, k, v, None, True, scale)
    assert res is not None
    first = cuda.sdpa_backward(g, q, k, v, res[0], res[1], None, True, scale)
    second = cuda.sdpa_backward(g, q, k, v, res[0], res[1], None, True, scale)
    assert first is not None and second is not None
    for a, b in zip(first, second, strict=True):
        assert np.array_equal(host(a), host(b))
