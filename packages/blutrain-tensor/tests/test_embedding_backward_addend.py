"""The CPU embedding_backward's optional addend (the compiler's embedding-grad-add pass): ``addend * addend_scale
+ the rows summed per id``, the tied weight's two gradients in one kernel, against a float64 reference and bit
for bit against the separate multiply, embedding backward and add that it stands for (each dispatched as
eager dispatches it, half dtypes included)."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import blutrain.tensor as bt
from blutrain.tensor import dispatch
from blutrain.tensor.errors import ShapeError, TensorTypeError, TensorValueError

_UINT = {2: np.uint16, 4: np.uint32, 8: np.uint64}
DTYPES = ["float32", "float64", "bfloat16", "float16"]


def _bits(a: Any) -> Any:
    a = np.asarray(a)
    return a.view(_UINT[a.dtype.itemsize])


def _kernel(op: str, dtype: str) -> Any:
    return dispatch.kernel(op, "cpu", bt.as_dtype(dtype))


def _case(seed: int, vocab: int, dim: int, ntok: int, dtype: str) -> tuple[Any, Any, Any, Any]:
    """grad rows, ids (repeats, and ids no token uses), the addend and a 0-d scale, in ``dtype``."""
    rng = np.random.default_rng(seed)
    np_dtype = bt.as_dtype(dtype).np
    g = rng.standard_normal((ntok, dim)).astype(np_dtype)
    idx = rng.integers(0, vocab, ntok)
    a = (rng.standard_normal((vocab, dim)) * 3).astype(np_dtype)
    s = np.asarray(rng.uniform(0.01, 2.0), np_dtype)
    return g, idx, a, s


def _separate(g: Any, idx: Any, a: Any, s: Any | None, vocab: int, dtype: str) -> Any:
    """What eager computes: the plain embedding backward, the product by the scale, then product + sums."""
    sums = _kernel("embedding_backward", dtype)(g, idx, vocab)
    term = a if s is None else _kernel("mul", dtype)(a, s)
    return _kernel("add", dtype)(term, sums)


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 12), st.integers(0, 9), st.integers(0, 30), st.booleans(), st.sampled_from(DTYPES),
       st.integers(0, 2**16))
def test_the_addend_is_the_separate_multiply_and_add_bit_for_bit(vocab: int, dim: int, ntok: int, scaled: bool,
                                                                 dtype: str, seed: int) -> None:
    g, idx, a, s = _case(seed, vocab, dim, ntok, dtype)
    scale = s if scaled else None
    got = _kernel("embedding_backward", dtype)(g, idx, vocab, a, scale)
    want = _separate(g, idx, a, scale, vocab, dtype)
    assert got.dtype == want.dtype and got.shape == (vocab, dim)
    np.testing.assert_array_equal(_bits(got), _bits(want))


@settings(max_examples=40, deadline=None)
@given(st.integers(1, 12), st.integers(1, 9), st.integers(0, 30), st.booleans(), st.sampled_from(DTYPES),
       st.integers(0, 2**16))
def test_the_addend_matches_a_float64_reference(vocab: int, dim: int, ntok: int, scaled: bool, dtype: str,
                                                seed: int) -> None:
    """Within the dtype's rounding of the three steps of the exact addend * scale + Σ rows."""
    g, idx, a, s = _case(seed, vocab, dim, ntok, dtype)
    got = _kernel("embedding_backward", dtype)(g, idx, vocab, a, s if scaled else None).astype(np.float64)
    want = a.astype(np.float64) * (float(s) if scaled else 1.0)
    np.add.at(want, idx, g.astype(np.float64))
    eps = float(np.finfo(bt.as_dtype(dtype).np).eps) if dtype != "bfloat16" else 2.0**-7
    bound = 4 * eps * (np.abs(a.astype(np.float64)) * (float(s) if scaled else 1.0)
                       + np.abs(want) + np.bincount(idx, minlength=vocab)[:, None] * np.abs(g).max(initial=0))
    assert np.all(np.abs(got - want) <= bound + 1e-300)


def test_rows_no_id_selects_are_the_product_plus_zero() -> None:
    """A -0.0 product in a row no token touches becomes +0.0, as the separate add of the zero row makes it;
    a NaN in the addend stays NaN where its row is touched and where it is not."""
    g = np.ones((2, 3), np.float32)
    idx = np.array([1, 1])
    a = np.array([[-0.0, 2.0, np.nan], [-0.0, np.nan, 1.0], [-0.0, -0.0, 0.0]], np.float32)
    s = np.asarray(0.5, np.float32)
    got = _kernel("embedding_backward", "float32")(g, idx, 3, a, s)
    np.testing.assert_array_equal(_bits(got), _bits(_separate(g, idx, a, s, 3, "float32")))
    assert not np.signbit(got[0, 0]) and not np.signbit(got[2, 0]) and not np.signbit(got[2, 1])
    assert np.isnan(got[0, 2]) and np.isnan(got[1, 1]) and got[1, 0] == 2.0


def test_no_ids_gives_the_product_plus_zero() -> None:
    a = np.array([[1.5, -0.0]], np.float32)
    got = _kernel("embedding_backward", "float32")(np.zeros((0, 2), np.float32), np.zeros(0, np.int64), 1, a,
                                                   np.asarray(2.0, np.float32))
    np.testing.assert_array_equal(_bits(got), _bits(np.array([[3.0, 0.0]], np.float32)))


@pytest.mark.parametrize(("addend", "scale", "error", "message"), [
    (np.zeros((4, 3), np.float32), None, ShapeError, r"addend must have the weight's shape \(5, 3\), got \(4, 3\)"),
    (np.zeros((5, 3), np.float64), None, TensorTypeError, "addend must have grad's dtype float32, got float64"),
    (np.zeros((5, 3), np.float32), np.ones(1, np.float32), TensorTypeError,
     r"addend_scale must be a 0-d float32 array, got float32 of shape \(1,\)"),
    (None, np.asarray(1.0, np.float32), TensorValueError, "addend_scale needs an addend"),
])
def test_a_wrong_addend_is_named(addend: Any, scale: Any, error: type[Exception], message: str) -> None:
    with pytest.raises(error, match=message):
        _kernel("embedding_backward", "float32")(np.zeros((2, 3), np.float32), np.array([0, 4]), 5, addend, scale)
