"""GPT-2 124M: the parameter count, and one float32 forward/backward against float64 on the CPU."""

from __future__ import annotations

import numpy as np
import pytest

from blutrain.models import GPT2, GPT2Config
from blutrain.tensor import float64, from_numpy, manual_seed

from .conftest import max_gradient_error


@pytest.fixture(scope="module")
def gpt2_124m() -> GPT2:
    manual_seed(1234)
    return GPT2(GPT2Config.preset("gpt2-124m"))


def test_gpt2_124m_has_124_475_904_parameters(gpt2_124m: GPT2) -> None:
    assert gpt2_124m.config.vocab_size == 50304
    assert gpt2_124m.num_parameters() == 124_475_904


def test_gpt2_124m_forward_backward_in_float32_matches_float64(gpt2_124m: GPT2) -> None:
    # Batch 1 × 64 tokens keeps this under half a minute on two cores; the float64 twin holds the
    # very same weights (cast), so every difference is float32 rounding in forward and backward.
    m32 = gpt2_124m
    m64 = GPT2(m32.config).to(float64)
    m64.load_state_dict(m32.state_dict())
    rng = np.random.default_rng(0)
    x = from_numpy(rng.integers(0, 50257, size=(1, 64), dtype=np.int64))
    y = from_numpy(rng.integers(0, 50257, size=(1, 64), dtype=np.int64))
    _, loss32 = m32(x, y)
    _, loss64 = m64(x, y)
    assert loss32 is not None and loss64 is not None
    loss32.backward()
    loss64.backward()
    l32, l64 = float(loss32.item()), float(loss64.item())
    assert abs(l32 - l64) / l64 < 1e-4, (l32, l64)
    worst, where = max_gradient_error(m32, m64)
    assert worst < 1e-4, f"gradient of {where}: relative error {worst:.2e}"
