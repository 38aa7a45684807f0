"""embedding.cu's addend (``cuda.embedding_backward(grad, idx, V, addend, addend_scale)``, the compiler's
embedding-grad-add pass): ``addend * addend_scale + the rows summed per id`` against float64, and bit for bit
against what eager runs for it on the device: the plain embedding backward, the ``mul`` kernel by the 0-d scale
and the ``add`` kernel, product first (float32: CuPy's multiply and add; bfloat16: each in float32 and rounded by
the cast kernel). Both the deterministic sorted path and the atomic one, row widths of the 16-byte kernels and
of the scalar ones, an addend off 16-byte alignment, rows no id selects (a -0.0 product there becomes +0.0),
NaN, infinity and signed zeros in the addend. Every device allocation starts as 0xFF bytes, so an element the
kernel forgets to write is a NaN that the bit comparison catches. Skipped without an NVIDIA GPU and CuPy.
"""

from __future__ import annotations

from typing import Any

import ml_dtypes
import numpy as np
import pytest

pytestmark = pytest.mark.cuda  # conftest: skipped without a GPU, run with poisoned device memory

F32, BF16 = np.dtype(np.float32), np.dtype(ml_dtypes.bfloat16)
UINT = {2: np.dtype(np.uint16), 4: np.dtype(np.uint32)}
TOL = {"float32": 1e-5, "bfloat16": 1e-2}


def _bits(a: np.ndarray[Any, Any]) -> np.ndarray[Any, Any]:
    return a.view(UINT[a.dtype.itemsize])


def _case(seed: int, vocab: int, dim: int, ntok: int, dtype: Any) -> tuple[Any, ...]:
    """Host grad rows, ids (repeats; ids >= vocab // 2 never used, so half the rows are the product alone), an
    addend with signed zeros, NaN and infinities in used and unused rows, and a 0-d scale."""
    rng = np.random.default_rng(seed)
    g = rng.standard_normal((ntok, dim)).astype(dtype)
    idx = rng.integers(0, max(1, vocab // 2), ntok).astype(np.int64)
    idx[: min(ntok, 9)] = 0  # a long segment
    a = (rng.standard_normal((vocab, dim)) * 3).astype(np.float64)
    a[:, 0] = -0.0
    a[-1, :] = -0.0  # an unused row of -0.0: the product + 0 is +0.0
    a[0, 1 % dim] = np.nan
    a[vocab - 1, 1 % dim] = np.nan
    a[1 % vocab, 2 % dim] = np.inf
    s = np.asarray(rng.uniform(0.01, 2.0), dtype)
    return g, idx, a.astype(dtype), s


def _eager(g: Any, idx: Any, a: Any, s: Any | None, vocab: int, dtype: Any) -> Any:
    """The separate kernels eager dispatches on cuda for ``a * s + embedding_backward(g)``."""
    import blutrain.tensor as bt
    from blutrain.kernels import cuda
    from blutrain.tensor import dispatch

    dt = bt.as_dtype(np.dtype(dtype).name)
    sums = cuda.embedding_backward(g, idx, vocab)
    term = a if s is None else dispatch.kernel("mul", "cuda", dt)(a, s)
    return dispatch.kernel("add", "cuda", dt)(term, sums)


def _reference(g: Any, idx: Any, a: Any, s: Any | None, vocab: int) -> np.ndarray[Any, Any]:
    want = a.astype(np.float64) * (1.0 if s is None else float(s.astype(np.float64)))
    np.add.at(want, idx, g.astype(np.float64))
    return want


@pytest.mark.parametrize("dtype", [F32, BF16], ids=lambda d: d.name)
@pytest.mark.parametrize(("vocab", "dim"), [(1000, 768), (301, 1032), (64, 10), (50, 8)])
@pytest.mark.parametrize("deterministic", [True, False], ids=["sorted", "atomic"])
@pytest.mark.parametrize("scaled", [True, False], ids=["scaled", "unscaled"])
def test_embedding_backward_adds_the_scaled_addend_as_the_separate_kernels(dtype: Any, vocab: int, dim: int,
                                                                          deterministic: bool,
                                                                          scaled: bool) -> None:
    """Bit for bit the separate multiply and add (the sorted path sums in position order, so eager's sums
    are its own; the atomic path's sums depend on the atomics' order, so there the comparison is against
    float64 only, and the bits of the rows no id selects)."""
    import cupy as cp

    from blutrain.kernels import cuda

    g, idx, a, s = _case(7 + dim, vocab, dim, 4 * 37, dtype)
    scale = cp.asarray(s) if scaled else None
    cuda.set_deterministic(deterministic)
    try:
        got = cuda.embedding_backward(cp.asarray(g), cp.asarray(idx), vocab, cp.asarray(a), scale)
        want = _eager(cp.asarray(g), cp.asarray(idx), cp.asarray(a), scale, vocab, dtype)
    finally:
        cuda.set_deterministic(True)
    assert got is not None and got.dtype == dtype and got.shape == (vocab, dim)
    got_h, want_h = cp.asnumpy(got), cp.asnumpy(want)
    unused = np.setdiff1d(np.arange(vocab), idx)
    np.testing.assert_array_equal(_bits(got_h[unused]), _bits(want_h[unused]))
    if deterministic:
        np.testing.assert_array_equal(_bits(got_h), _bits(want_h))
    ref = _reference(g, idx, a, s if scaled else None, vocab)
    fin = np.isfinite(ref)
    assert np.array_equal(np.isfinite(got_h.astype(np.float64)), fin)
    err = np.linalg.norm(got_h.astype(np.float64)[fin] - ref[fin]) / np.linalg.norm(ref[fin])
    assert err <= TOL[dtype.name], f"relative error {err:.3g}"
    assert not np.signbit(got_h[vocab - 1, 0].astype(np.float32))  # -0.0 * s + 0 in an unused row


@pytest.mark.parametrize("dtype", [F32, BF16], ids=lambda d: d.name)
def test_an_addend_off_16_byte_alignment_takes_the_scalar_kernel_with_the_same_bits(dtype: Any) -> None:
    import cupy as cp

    from blutrain.kernels import cuda

    vocab, dim = 300, 768
    g, idx, a, s = _case(3, vocab, dim, 200, dtype)
    flat = cp.empty(vocab * dim + 1, dtype)
    addend = flat[1:].reshape(vocab, dim)  # contiguous, one element past an aligned base
    addend[...] = cp.asarray(a)
    got = cuda.embedding_backward(cp.asarray(g), cp.asarray(idx), vocab, addend, cp.asarray(s))
    want = _eager(cp.asarray(g), cp.asarray(idx), cp.asarray(a), cp.asarray(s), vocab, dtype)
    np.testing.assert_array_equal(_bits(cp.asnumpy(got)), _bits(cp.asnumpy(want)))


def test_an_addend_of_another_dtype_or_shape_falls_back_to_the_generic_kernel() -> None:
    """The fused kernel declines (None) and the registered cuda kernel's generic fallback names the argument."""
    import cupy as cp

    import blutrain.tensor as bt
    from blutrain.kernels import cuda
    from blutrain.tensor import dispatch
    from blutrain.tensor.errors import ShapeError

    g, idx = cp.ones((3, 8), np.float32), cp.asarray(np.array([0, 1, 1]))
    assert cuda.embedding_backward(g, idx, 4, cp.zeros((4, 8), np.float64)) is None
    assert cuda.embedding_backward(g, idx, 4, cp.zeros((5, 8), np.float32)) is None
    with pytest.raises(ShapeError, match="addend must have the weight's shape"):
        dispatch.kernel("embedding_backward", "cuda", bt.float32)(g, idx, 4, cp.zeros((5, 8), np.float32), None)
