"""Shared helpers for the GPT-2 tests."""

from __future__ import annotations

import numpy as np

from blutrain.models import GPT2
from blutrain.tensor import Tensor


def relative_error(got: Tensor, want: Tensor) -> float:
    """‖got − want‖ / ‖want‖ in float64 (the whole tensor, so tiny entries do not dominate)."""
    g = np.asarray(got.detach(), dtype=np.float64)
    w = np.asarray(want.detach(), dtype=np.float64)
    return float(np.linalg.norm(g - w) / max(np.linalg.norm(w), 1e-300))


def max_gradient_error(model32: GPT2, model64: GPT2) -> tuple[float, str]:
    """The worst relative error over every parameter's gradient, and its name."""
    grads64 = dict(model64.named_parameters())
    worst, where = 0.0, ""
    for name, p in model32.named_parameters():
        assert p.grad is not None and grads64[name].grad is not None, name
        err = relative_error(p.grad, grads64[name].grad)  # type: ignore[arg-type]
        if err > worst or not np.isfinite(err):
            worst, where = err, name
    return worst, where
