"""``blutrain.optim.StepScalars`` on the "cuda" device (blutrain's optimizers over the CuPy backend plugin): a
site's array is allocated once and refilled in place through ``write_from_host`` on the current stream, where a
kernel queued after the refill reads the new values. Skipped without a GPU."""

from __future__ import annotations

import numpy as np
import pytest

import blutrain.tensor as bt
from blutrain import nn
from blutrain.optim import StepScalars, multi_tensor_apply


def _gpu() -> bool:
    try:
        from blutrain_backend_cupy import cuda
    except ImportError:
        return False
    return bool(cuda.is_available())


pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not _gpu(), reason="needs an NVIDIA GPU and CuPy")]


def test_step_scalars_refill_one_device_array_that_the_next_kernel_reads() -> None:
    from blutrain_backend_cupy import stream

    scalars, cuda = StepScalars(), bt.device("cuda")
    backend = cuda.backend
    arrays, expected = [], 1.0
    with stream() as s:  # a non-default stream: the refills and the kernels are ordered on it
        p, g = nn.Parameter(bt.ones(3, dtype=bt.float64, device="cuda")), bt.ones(3, dtype=bt.float64, device="cuda")
        for lr in (0.5, 0.25, 0.125):  # p ← p − lr·g, each step with its own lr
            arrays.append(scalars((0, 0), cuda, (lr,)))
            multi_tensor_apply("sgd_multi_tensor", [[p], [g], []], arrays[-1], 0.0, 0.0, 0.0, False, False,
                               written=(0,))
            expected -= lr
        s.synchronize()
    assert all(a is arrays[0] for a in arrays)
    np.testing.assert_array_equal(backend.to_host(arrays[0]), [0.125])
    np.testing.assert_array_equal(p.detach().cpu().numpy(), np.full(3, expected))
