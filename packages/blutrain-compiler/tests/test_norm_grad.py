"""The layernorm-grad-add pass: a LayerNorm input's two gradients (the residual stream's and the LayerNorm's dx)
summed inside ``layer_norm_backward`` instead of by a separate add; the compiled results against eager."""

from __future__ import annotations

import re
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import blutrain.compiler as bc
import blutrain.tensor as bt
from blutrain.compiler.graph import body

FUSED = re.compile(r'"blutrain\.layer_norm_backward".*args = \[.*(true|false), (true|false), \d+ : index\]')


def _residual_norm(x: bt.Tensor, w: bt.Tensor, b: bt.Tensor) -> bt.Tensor:
    """x + f(layer_norm(x)): x's gradient is the residual path's plus the LayerNorm's."""
    x = x.detach().requires_grad_(True)
    y = x + bt.layer_norm(x, x.shape[-1], w, b).tanh()
    (y * y).sum().backward()
    assert x.grad is not None
    return x.grad


def _ops(fn: Any, *arrays: np.ndarray) -> list[Any]:
    module = bc.trace_module(fn, *arrays)
    bc.run_pipeline(module, ["layernorm-grad-add"])
    return list(body(module).ops)


def _arrays(seed: int, rows: int = 6, cols: int = 8, dtype: Any = np.float32) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.standard_normal((rows, cols)).astype(dtype), rng.standard_normal(cols).astype(dtype),
            rng.standard_normal(cols).astype(dtype)]


def test_the_residual_gradient_is_added_inside_the_layernorm_backward() -> None:
    ops = _ops(_residual_norm, *_arrays(0))
    norm = [o for o in ops if o.name == "blutrain.layer_norm_backward"]
    assert len(norm) == 1 and len(norm[0].operands) == 6  # grad, x, weight, mean, rstd and the addend
    assert not any(o.name == "blutrain.add" and norm[0].results[0] in o.operands for o in ops)


def test_no_fusion_where_dx_is_read_twice_broadcast_or_in_a_half_dtype() -> None:
    def twice(x: bt.Tensor, w: bt.Tensor, b: bt.Tensor) -> tuple[bt.Tensor, bt.Tensor]:
        from blutrain.autograd import grad

        x = x.detach().requires_grad_(True)
        (dx,) = grad(bt.layer_norm(x, x.shape[-1], w, b).tanh().sum(), [x])
        return dx + x.detach(), dx  # dx is read twice

    def broadcast(x: bt.Tensor, w: bt.Tensor, b: bt.Tensor) -> bt.Tensor:
        x = x.detach().requires_grad_(True)
        bt.layer_norm(x, x.shape[-1], w, b).sum().backward()
        assert x.grad is not None
        return x.grad + b  # the other operand broadcasts: not a gradient of x

    for fn, arrays in ((twice, _arrays(1)), (broadcast, _arrays(2)),
                       (_residual_norm, _arrays(3, dtype=bt.bfloat16.np))):
        norm = [o for o in _ops(fn, *arrays) if o.name == "blutrain.layer_norm_backward"]
        assert norm and all(len(o.operands) == 5 for o in norm), fn.__name__


@settings(max_examples=15, deadline=None)
@given(st.integers(1, 9), st.integers(1, 12), st.booleans(), st.sampled_from(["float32", "float64"]),
       st.integers(0, 2**16))
def test_compiled_residual_layernorm_trains_as_eager_bit_for_bit(sgd_eager_and_compiled: Any, same_bits: Any,
                                                                 rows: int, cols: int, affine: bool, dtype: str,
                                                                 seed: int) -> None:
    """The fused kernel rounds dx + addend once, as the add did: four SGD steps through it (the input's
    gradient reaches the parameters of a linear before the LayerNorm) are eager's bit for bit."""
    rng = np.random.default_rng(seed)
    x, m, w, b = (rng.standard_normal(s).astype(dtype) for s in ((rows, cols), (cols, cols), cols, cols))

    def loss(xt: bt.Tensor, m: bt.Tensor, w: Any, b: Any) -> bt.Tensor:
        h = bt.linear(xt, m)
        y = h + bt.layer_norm(h, cols, w, b).tanh()
        return (y * y).sum()

    eager, compiled, ir = sgd_eager_and_compiled(loss, [m, w if affine else None, b if affine else None], x)
    assert FUSED.search(ir), ir  # the layer_norm_backward call ends with an operand after need_w and need_b
    for a, c in zip(eager, compiled, strict=True):
        same_bits(c, a)


@pytest.mark.cuda
def test_on_cuda_the_fused_layernorm_backward_matches_eager_bit_for_bit() -> None:
    """float32 on cuda: the kernel adds each dx to the addend with __fadd_rn before the store, the rounding of
    eager's separate add."""
    registry = bt.backends()
    if "cuda" not in registry.names() or not registry.get("cuda").is_available():
        pytest.skip("no CUDA device")
    x, w, b = (bt.from_numpy(a).to("cuda") for a in _arrays(4, 512, 768))

    fn = bc.compile(_residual_norm)
    got = [fn(x, w, b).cpu().numpy() for _ in range(3)]
    want = _residual_norm(x, w, b).cpu().numpy()
    assert FUSED.search(fn.ir())
    for g in got:
        np.testing.assert_array_equal(g, want)
