"""linear_add and linear_gelu on the CPU: values against float64 formulas, eager order in float32, autocast's
dtypes, and clear errors for bad arguments."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import blutrain.tensor as bt
from blutrain.tensor.errors import ShapeError, TensorTypeError, TensorValueError


def _gelu64(a: np.ndarray, approximate: str) -> np.ndarray:
    if approximate == "tanh":
        return 0.5 * a * (1 + np.tanh(math.sqrt(2 / math.pi) * (a + 0.044715 * a**3)))
    from math import erf

    return 0.5 * a * (1 + np.vectorize(erf)(a / math.sqrt(2)))


@settings(max_examples=30, deadline=None)
@given(st.lists(st.integers(1, 4), min_size=0, max_size=2), st.integers(1, 6), st.integers(1, 6), st.booleans(),
       st.sampled_from(["float32", "float64"]), st.integers(0, 2**16))
def test_linear_add_is_the_residual_plus_the_product_and_bias(lead: list[int], c_in: int, c_out: int, bias: bool,
                                                               dtype: str, seed: int) -> None:
    rng = np.random.default_rng(seed)
    r, x = rng.standard_normal((*lead, c_out)), rng.standard_normal((*lead, c_in))
    w, b = rng.standard_normal((c_out, c_in)), rng.standard_normal(c_out)
    ts = [bt.tensor(a, dtype=dtype) for a in (r, x, w, b)]
    got = bt.linear_add(*ts[:3], ts[3] if bias else None)
    want = r + x @ w.T + (b if bias else 0)
    assert got.dtype is bt.as_dtype(dtype) and got.shape == r.shape
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5 if dtype == "float32" else 1e-12, atol=1e-5)
    plain = ts[0] + bt.linear(*ts[1:3], ts[3] if bias else None)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(plain))  # eager order, bit for bit


@settings(max_examples=30, deadline=None)
@given(st.lists(st.integers(1, 4), min_size=0, max_size=2), st.integers(1, 6), st.integers(1, 6), st.booleans(),
       st.sampled_from(["tanh", "none"]), st.integers(0, 2**16))
def test_linear_gelu_is_gelu_of_the_projection(lead: list[int], c_in: int, c_out: int, bias: bool, approximate: str,
                                               seed: int) -> None:
    rng = np.random.default_rng(seed)
    x, w, b = rng.standard_normal((*lead, c_in)), rng.standard_normal((c_out, c_in)), rng.standard_normal(c_out)
    got = bt.linear_gelu(bt.tensor(x), bt.tensor(w), bt.tensor(b) if bias else None, approximate)
    want = _gelu64(x @ w.T + (b if bias else 0), approximate)
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-12, atol=1e-12)


def test_under_autocast_the_residual_stream_stays_float32_and_the_activation_is_bf16() -> None:
    rng = np.random.default_rng(0)
    r, x = bt.tensor(rng.standard_normal((3, 8)), dtype="float32"), bt.tensor(rng.standard_normal((3, 5)),
                                                                              dtype="float32")
    w, b = bt.tensor(rng.standard_normal((8, 5)), dtype="float32"), bt.tensor(rng.standard_normal(8), dtype="float32")
    with bt.autocast(enabled=True):
        out = bt.linear_add(r, x, w, b)
        act = bt.linear_gelu(x, w, b)
    assert out.dtype is bt.float32 and act.dtype is bt.bfloat16
    want = np.asarray(r) + np.asarray(x).astype(bt.bfloat16.np).astype(np.float64) @ np.asarray(w).astype(
        bt.bfloat16.np).astype(np.float64).T + np.asarray(b)
    np.testing.assert_allclose(np.asarray(out), want, rtol=1e-5, atol=1e-5)


def test_bad_arguments_are_refused_naming_them() -> None:
    r, x, w, b = bt.ones(3, 4), bt.ones(3, 5), bt.ones(4, 5), bt.ones(4)
    with pytest.raises(ShapeError, match=r"linear_add: residual must have the product's shape \[3, 4\], got \[3, 5\]"):
        bt.linear_add(bt.ones(3, 5), x, w, b)
    with pytest.raises(TensorTypeError, match="linear_add: residual must have dtype float32, got float64"):
        bt.linear_add(r.to(dtype="float64"), x, w, b)
    with pytest.raises(TensorTypeError, match="linear_add: bias must have the residual's dtype float32, got float64"):
        bt.linear_add(r, x, w, b.to(dtype="float64"))
    with pytest.raises(TensorTypeError, match="linear_add: residual must be a Tensor, got list"):
        bt.linear_add([1.0], x, w, b)  # type: ignore[arg-type]
    with pytest.raises(ShapeError, match=r"linear_gelu: input of shape \[3, 4\] does not fit weight of shape"):
        bt.linear_gelu(r, w, b)
    with pytest.raises(ShapeError, match=r"linear_gelu: bias must have shape \[4\]"):
        bt.linear_gelu(x, w, bt.ones(5))
    with pytest.raises(TensorValueError, match="linear_gelu: approximate must be 'none' or 'tanh', got 'erf'"):
        bt.linear_gelu(x, w, b, "erf")
    with pytest.raises(TensorTypeError, match="linear_add: input must be floating, got int64"):
        bt.linear_add(r, x.to(dtype="int64"), w.to(dtype="int64"), b)


@pytest.mark.parametrize("op", ["linear_add", "linear_gelu"])
def test_under_autocast_float32_operands_get_float32_gradients_close_to_float64(op: str) -> None:
    """The backward GEMMs read the bf16 operands and write the float32 operands' gradients in float32."""
    pytest.importorskip("blutrain.autograd")
    rng = np.random.default_rng(1)
    arrays = [rng.standard_normal((4, 8)), rng.standard_normal((4, 6)), rng.standard_normal((8, 6)) * 0.3,
              rng.standard_normal(8)]
    results = []
    for dtype, amp in (("float32", True), ("float64", False)):
        ts = [bt.tensor(a, dtype=dtype, requires_grad=True) for a in arrays]
        with bt.autocast(enabled=amp):
            out = bt.linear_add(*ts) if op == "linear_add" else bt.linear_gelu(*ts[1:])
        (out.to(dtype=dtype) * out.to(dtype=dtype)).sum().backward()
        used = ts if op == "linear_add" else ts[1:]
        assert all(t.grad is not None and t.grad.dtype is bt.as_dtype(dtype) for t in used)
        results.append([np.asarray(t.grad, np.float64) for t in used])  # type: ignore[arg-type]
    for got, want in zip(*results, strict=True):
        assert np.linalg.norm(got - want) <= 3e-2 * np.linalg.norm(want)
