"""SGD against a float64 NumPy reference of PyTorch's update rule, over several steps."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from blutrain import nn
from blutrain.optim import OptimizerError, create, optimizers
from blutrain.tensor import DType, float32, float64, from_numpy, kernels
from blutrain_optim_sgd import SGD


def reference_sgd(p: np.ndarray, grads: list[np.ndarray], lr: float, momentum: float, dampening: float,
                  weight_decay: float, nesterov: bool) -> np.ndarray:
    """PyTorch's SGD, written out in float64."""
    p = p.astype(np.float64).copy()
    buf = None
    for g in grads:
        d = g + weight_decay * p
        if momentum:
            buf = d.copy() if buf is None else momentum * buf + (1 - dampening) * d
            d = d + momentum * buf if nesterov else buf
        p -= lr * d
    return p


CASES = [
    {"momentum": 0.0, "dampening": 0.0, "weight_decay": 0.0, "nesterov": False},
    {"momentum": 0.0, "dampening": 0.0, "weight_decay": 0.05, "nesterov": False},
    {"momentum": 0.9, "dampening": 0.0, "weight_decay": 0.0, "nesterov": False},
    {"momentum": 0.9, "dampening": 0.3, "weight_decay": 0.01, "nesterov": False},
    {"momentum": 0.8, "dampening": 0.0, "weight_decay": 0.01, "nesterov": True},
]


Run = tuple[list[np.ndarray], list[np.ndarray], list[list[np.ndarray]]]


def _run(dtype: DType, steps: int, **kw: Any) -> Run:
    rng = np.random.default_rng(0)
    shapes = [(3, 4), (6,)]
    init = [rng.normal(size=s) for s in shapes]
    params = [nn.Parameter(from_numpy(a.astype(dtype.np))) for a in init]
    opt = SGD(params, lr=0.05, **kw)
    grads: list[list[np.ndarray]] = [[] for _ in shapes]
    for _ in range(steps):
        for i, p in enumerate(params):
            g = rng.normal(size=shapes[i]).astype(dtype.np)
            grads[i].append(g.astype(np.float64))
            p.grad = from_numpy(g)
        opt.step()
    return init, [np.asarray(p.detach()) for p in params], grads


@pytest.mark.parametrize("kw", CASES, ids=lambda c: "-".join(f"{k}={v}" for k, v in c.items()))
def test_float64_updates_match_the_reference(kw: dict[str, Any]) -> None:
    init, got, grads = _run(float64, 5, **kw)
    for p0, p, gs in zip(init, got, grads, strict=True):
        np.testing.assert_allclose(p, reference_sgd(p0, gs, 0.05, **kw), rtol=1e-12, atol=1e-14)


def test_float32_updates_match_the_reference_to_float32_rounding() -> None:
    kw = CASES[-1]
    init, got, grads = _run(float32, 5, **kw)
    ref = reference_sgd(init[0].astype(np.float32), grads[0], 0.05, **kw)
    np.testing.assert_allclose(got[0], ref, rtol=1e-5, atol=1e-6)


def test_momentum_buffers_live_in_the_state_dict() -> None:
    p = nn.Parameter(from_numpy(np.ones(3)))
    opt = SGD([p], lr=0.1, momentum=0.9)
    p.grad = from_numpy(np.full(3, 2.0))
    opt.step()
    sd = opt.state_dict()
    np.testing.assert_array_equal(np.asarray(sd["state"][0]["momentum_buffer"]), 2.0)


def test_without_momentum_there_is_no_state() -> None:
    p = nn.Parameter(from_numpy(np.ones(3)))
    opt = SGD([p], lr=0.1)
    p.grad = from_numpy(np.ones(3))
    opt.step()
    assert opt.state == {}
    np.testing.assert_allclose(np.asarray(p.detach()), 0.9)


def test_the_update_is_one_registered_multi_tensor_kernel() -> None:
    for dt in (float32, float64):
        assert kernels().lookup("sgd_multi_tensor", "cpu", dt).provider.distribution == "blutrain-optim-sgd"


def test_registered_by_name() -> None:
    assert optimizers().get("sgd") is SGD
    assert isinstance(create("sgd", [nn.Parameter(from_numpy(np.ones(2)))], lr=0.5, momentum=0.9), SGD)


@pytest.mark.parametrize(("kw", "message"), [
    ({"nesterov": True}, "nesterov needs momentum > 0 and dampening 0, got momentum 0.0 and dampening 0.0"),
    ({"nesterov": True, "momentum": 0.9, "dampening": 0.1}, "nesterov needs momentum > 0 and dampening 0"),
    ({"momentum": -0.5}, "momentum must be a number >= 0, got -0.5"),
    ({"weight_decay": -1}, "weight_decay must be a number >= 0, got -1"),
])
def test_invalid_hyperparameters_are_named(kw: dict[str, Any], message: str) -> None:
    with pytest.raises(OptimizerError, match=message):
        SGD([nn.Parameter(from_numpy(np.ones(2)))], **kw)
