"""Shared by the compiler's tests: the bit-for-bit comparison of fused results with eager ones."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

_UINT = {2: np.uint16, 4: np.uint32, 8: np.uint64}


def bits(a: Any) -> np.ndarray[Any, Any]:
    """``a``'s elements as unsigned integers of their width (signed zeros and NaN payloads told apart)."""
    a = np.asarray(a)
    return a.view(_UINT[a.dtype.itemsize])


def assert_same_bits(got: Any, expected: Any) -> None:
    """Equal dtypes, shapes and bits, signed zeros included; a NaN matches a NaN of any sign and payload. Which NaN
    an operation on NaN operands returns is the CPU's choice (x86 keeps the first operand's, Arm makes its default
    NaN), and NumPy's loops and the fused code may take their operands in either order: no CPU computation here
    promises a NaN's sign (hypothesis found -0 * -inf, then a sum of two NaNs, giving +NaN eagerly and -NaN fused)."""
    got, expected = np.asarray(got), np.asarray(expected)
    assert got.dtype == expected.dtype and got.shape == expected.shape
    # float64 first: a readable report of the values where they differ (NaN matches NaN there)
    np.testing.assert_array_equal(got.astype(np.float64), expected.astype(np.float64))
    numbers = ~np.isnan(expected.astype(np.float64))
    np.testing.assert_array_equal(bits(got)[numbers], bits(expected)[numbers])  # and bit for bit


@pytest.fixture(scope="session")
def same_bits() -> Callable[[Any, Any], None]:
    """``same_bits(got, expected)``: equal dtypes, shapes and bits."""
    return assert_same_bits


@pytest.fixture(scope="session")
def as_bits() -> Callable[[Any], np.ndarray[Any, Any]]:
    return bits


def sgd_runs(loss: Callable[..., Any], params: list[np.ndarray[Any, Any] | None], x: np.ndarray[Any, Any],
             steps: int = 4) -> tuple[list[np.ndarray[Any, Any]], list[np.ndarray[Any, Any]], str]:
    """``loss(x, *params)`` trained by SGD for ``steps`` steps, eagerly and compiled from the same starting
    values (a None parameter stays None): (eager's losses and final parameters, the compiled ones, the
    compiled IR). The passes' tests compare the two bit for bit and look for their op in the IR."""
    import blutrain.compiler as bc
    import blutrain.tensor as bt
    from blutrain.optim import create

    runs: list[list[np.ndarray[Any, Any]]] = []
    ir = ""
    for compiled in (False, True):
        ps = [None if p is None else bt.from_numpy(p.copy()).requires_grad_() for p in params]
        opt = create("sgd", [p for p in ps if p is not None], lr=0.01)

        def step(xt: Any, ps: list[Any] = ps, opt: Any = opt) -> Any:
            value = loss(xt, *ps)
            value.backward()
            opt.step()
            opt.zero_grad()
            return value

        fn: Any = bc.compile(step) if compiled else step
        losses = [fn(bt.from_numpy(x)).detach().numpy().copy() for _ in range(steps)]
        if compiled:
            ir = fn.ir()
        runs.append([*losses, *(p.detach().numpy().copy() for p in ps if p is not None)])
    return runs[0], runs[1], ir


@pytest.fixture(scope="session")
def sgd_eager_and_compiled() -> Callable[..., tuple[list[Any], list[Any], str]]:
    """``sgd_eager_and_compiled(loss, params, x, steps=4)``: see :func:`sgd_runs`."""
    return sgd_runs


def run_gpt_steps(model: Any, opt: Any, passes: list[str] | tuple[str, ...] | None, *, steps: int = 4,
                  shape: tuple[int, int] = (4, 16), ids: int = 64, device: str = "cpu", autocast: bool = True,
                  clip: float | None = None, return_logits: bool = True) -> tuple[list[np.ndarray[Any, Any]], Any]:
    """``steps`` training steps of a GPT on seeded random tokens in [0, ids) of ``shape`` (under bf16 autocast,
    optionally clipping the gradients' norm to ``clip``), eagerly (``passes`` None) or compiled with
    ``passes``: each step's loss and the final parameters as host arrays, and the compiled function (None when
    eager). The one training loop of the passes' compiled-against-eager tests on GPT-2."""
    import blutrain.compiler as bc
    import blutrain.tensor as bt
    from blutrain.amp import autocast as region
    from blutrain.optim import clip_grad_norm_

    params = list(model.parameters())

    def step(x: Any, y: Any) -> Any:
        with region(dtype="bfloat16", enabled=autocast):
            _, loss = model(x, y) if return_logits else model(x, y, return_logits=False)
        loss.backward()
        if clip is not None:
            clip_grad_norm_(params, clip)
        opt.step()
        opt.zero_grad()
        return loss

    fn: Any = step if passes is None else bc.compile(step, passes=list(passes))
    rng = np.random.default_rng(0)
    out = []
    for _ in range(steps):
        x, y = (bt.tensor(rng.integers(0, ids, shape), device=device) for _ in range(2))
        out.append(fn(x, y).detach().cpu().numpy().copy().reshape(-1))
    return out + [p.detach().cpu().numpy().copy() for p in params], None if passes is None else fn


@pytest.fixture(scope="session")
def gpt_steps() -> Callable[..., tuple[list[np.ndarray[Any, Any]], Any]]:
    """:func:`run_gpt_steps`."""
    return run_gpt_steps
