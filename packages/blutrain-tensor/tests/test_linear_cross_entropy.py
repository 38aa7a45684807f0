"""linear_cross_entropy is cross_entropy(linear(x, w), target) without the logits: same loss, same
gradients, whatever the chunking; under autocast the bf16 GEMMs of the separate ops, without their
rounded gradients."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import blutrain.autograd  # installs the recorder; its no_grad is used below
import blutrain.tensor as bt
from blutrain.tensor.errors import ShapeError, TensorIndexError, TensorTypeError, TensorValueError


def _case(seed: int, lead: tuple[int, ...], c: int, v: int, ignored: float = 0.2) -> tuple[np.ndarray, ...]:
    rng = np.random.default_rng(seed)
    target = rng.integers(0, v, size=lead)
    target[rng.random(lead) < ignored] = -1
    return rng.standard_normal((*lead, c)), rng.standard_normal((v, c)), target


def _loss_and_grads(fused: bool, x: np.ndarray, w: np.ndarray, target: np.ndarray, dtype: str = "float64",
                    upstream: float = 1.75, **kw: object) -> tuple[np.ndarray, ...]:
    """Loss and input/weight gradients for an upstream gradient ``upstream`` (not 1 by default, so
    that its scaling of both gradients is tested)."""
    xt = bt.tensor(x, dtype=dtype, requires_grad=True)
    wt = bt.tensor(w, dtype=dtype, requires_grad=True)
    t = bt.tensor(target)
    if fused:
        loss = bt.linear_cross_entropy(xt, wt, t, ignore_index=-1, **kw)  # type: ignore[arg-type]
    else:
        kw.pop("chunk_size", None)
        logits = bt.linear(xt, wt)
        loss = bt.cross_entropy(logits.reshape(-1, w.shape[0]), t.reshape(-1), ignore_index=-1,
                                **kw)  # type: ignore[arg-type]
    (loss * upstream).backward()
    assert xt.grad is not None and wt.grad is not None
    return loss.detach().numpy(), xt.grad.numpy(), wt.grad.numpy()


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 2**16), lead=st.lists(st.integers(1, 6), min_size=1, max_size=2).map(tuple),
       c=st.integers(1, 6), v=st.integers(1, 9), chunk=st.sampled_from((None, 1, 2, 3, 64)),
       reduction=st.sampled_from(("mean", "sum")), smoothing=st.sampled_from((0.0, 0.1)))
def test_equals_linear_then_cross_entropy_in_float64(seed: int, lead: tuple[int, ...], c: int, v: int,
                                                     chunk: int | None, reduction: str, smoothing: float) -> None:
    x, w, target = _case(seed, lead, c, v)
    target.reshape(-1)[0] = 0  # 'mean' needs one target that is not ignored
    kw = {"reduction": reduction, "label_smoothing": smoothing, "chunk_size": chunk}
    got = _loss_and_grads(True, x, w, target, **kw)
    want = _loss_and_grads(False, x, w, target, **kw)
    for g, r in zip(got, want, strict=True):
        np.testing.assert_allclose(g, r, rtol=1e-12, atol=1e-13)


def test_the_chunk_size_changes_nothing_but_memory_in_float32() -> None:
    x, w, target = _case(1, (37,), 16, 50)
    whole = _loss_and_grads(True, x, w, target, "float32", chunk_size=37)
    for chunk in (1, 5, 36):
        part = _loss_and_grads(True, x, w, target, "float32", chunk_size=chunk)
        for g, r in zip(part, whole, strict=True):
            np.testing.assert_allclose(g, r, rtol=2e-6, atol=1e-7)


def test_the_default_chunks_of_a_gpt2_batch_are_six_equal_ones() -> None:
    """16384 rows of 50304 bf16 logits: 256 MiB holds 2668 rows, which left a seventh chunk of 376 rows
    (paying a whole pass over the float32 weight gradient); equal chunks of 2731 rows leave none."""
    from blutrain.tensor.ops.nn import default_chunk_rows

    assert default_chunk_rows(16384, 50304, 2) == 2731
    assert default_chunk_rows(16384, 50304, 4) == 1366  # float32 logits: 12 chunks of 1365-1366 rows
    assert default_chunk_rows(1, 50304, 4) == 1


@settings(max_examples=200, deadline=None)
@given(n=st.integers(1, 10**6), vocab=st.integers(1, 2**17), itemsize=st.sampled_from((2, 4, 8)))
def test_default_chunks_are_balanced_and_near_the_budget(n: int, vocab: int, itemsize: int) -> None:
    from blutrain.tensor.ops.nn import LOGITS_CHUNK_BYTES, default_chunk_rows

    rows = default_chunk_rows(n, vocab, itemsize)
    budget = max(1, LOGITS_CHUNK_BYTES // (vocab * itemsize))
    chunks = -(-n // rows)
    assert 1 <= rows <= n
    assert n - (chunks - 1) * rows > rows - chunks  # the last chunk is short by less than one row per chunk
    assert rows <= budget * (1 + 1 / (2 * chunks)) + 1 and rows <= 1.5 * budget + 1
    if n >= 2 * budget:
        assert rows > budget * 2 / 3  # no needless extra chunk either


def test_the_default_chunking_is_the_explicit_one_of_default_chunk_rows(monkeypatch: pytest.MonkeyPatch) -> None:
    """An explicit chunk_size is exact; the default one is default_chunk_rows: with a budget of 12 rows, 37 rows
    run as 13 + 13 + 11 (not 12 + 12 + 12 + 1), so float32's chunk-order rounding of dw is that of chunk_size=13."""
    from blutrain.tensor.ops import nn

    x, w, target = _case(1, (37,), 16, 50)
    monkeypatch.setattr(nn, "LOGITS_CHUNK_BYTES", 12 * 50 * 4)
    assert nn.default_chunk_rows(37, 50, 4) == 13
    default = _loss_and_grads(True, x, w, target, "float32")
    explicit = _loss_and_grads(True, x, w, target, "float32", chunk_size=13)
    for g, r in zip(default, explicit, strict=True):
        np.testing.assert_array_equal(g.view(np.uint32), r.view(np.uint32))


def test_without_grad_only_the_loss_is_computed() -> None:
    x, w, target = _case(2, (4, 3), 5, 7)
    with blutrain.autograd.no_grad():
        loss = bt.linear_cross_entropy(bt.tensor(x, requires_grad=True), bt.tensor(w), bt.tensor(target),
                                       ignore_index=-1)
    assert loss.grad_fn is None
    want = _loss_and_grads(False, x, w, target)[0]
    np.testing.assert_allclose(loss.numpy(), want, rtol=1e-12)


def test_only_the_inputs_that_require_grad_get_one() -> None:
    x, w, target = _case(3, (6,), 4, 5)
    xt, wt = bt.tensor(x), bt.tensor(w, requires_grad=True)
    bt.linear_cross_entropy(xt, wt, bt.tensor(target), ignore_index=-1).backward()
    assert xt.grad is None and wt.grad is not None
    np.testing.assert_allclose(wt.grad.numpy(), _loss_and_grads(False, x, w, target, upstream=1.0)[2], rtol=1e-12)


def test_mean_over_no_target_is_nan_as_cross_entropy() -> None:
    x, w, _ = _case(4, (3,), 2, 4)
    with np.errstate(invalid="ignore"):
        loss = bt.linear_cross_entropy(bt.tensor(x), bt.tensor(w), bt.tensor(np.full(3, -1)), ignore_index=-1)
    assert np.isnan(loss.item())


def test_under_autocast_loss_is_float32_and_gradients_skip_the_bf16_rounding() -> None:
    """The logits are bf16 GEMM results as with linear + cross_entropy under autocast, so the losses
    agree to float32; the gradients accumulate in float32 where the separate ops may round them to bf16,
    so they are no further from the float64 gradients of the same bf16-rounded operands. (Whether the
    separate ops' rounding shows depends on the CPU's bf16 GEMM: on some hosts both errors are the same
    float, so the guarantee is "not worse", with a float32-sized slack, not "strictly better".)"""
    x, w, target = _case(5, (64,), 32, 300, ignored=0.0)
    xt, wt = bt.tensor(x, dtype="float32", requires_grad=True), bt.tensor(w, dtype="float32", requires_grad=True)
    with bt.autocast():
        fused = bt.linear_cross_entropy(xt, wt, bt.tensor(target), ignore_index=-1, chunk_size=10)
    assert fused.dtype is bt.float32
    fused.backward()
    assert xt.grad is not None and wt.grad is not None
    assert xt.grad.dtype is bt.float32 and wt.grad.dtype is bt.float32
    fused_grads = xt.grad.numpy(), wt.grad.numpy()
    xt.grad = wt.grad = None
    with bt.autocast():
        separate = bt.cross_entropy(bt.linear(xt, wt), bt.tensor(target), ignore_index=-1)
    separate.backward()
    assert separate.dtype is bt.float32
    np.testing.assert_allclose(fused.item(), separate.item(), rtol=1e-6)
    # the float64 reference of the same bf16-rounded operands
    xb = x.astype(bt.bfloat16.np).astype(np.float64)
    wb = w.astype(bt.bfloat16.np).astype(np.float64)
    _, gx, gw = _loss_and_grads(False, xb, wb, target, upstream=1.0)
    for got, eager, ref in zip(fused_grads, (xt.grad.numpy(), wt.grad.numpy()), (gx, gw), strict=True):
        err_fused = np.linalg.norm(got - ref) / np.linalg.norm(ref)
        err_eager = np.linalg.norm(eager - ref) / np.linalg.norm(ref)
        assert err_fused < 1e-2
        assert err_fused <= err_eager * (1 + 2.0**-20), (err_fused, err_eager)


@pytest.mark.parametrize(("kwargs", "error", "match"), [
    ({"reduction": "none"}, TensorValueError, "reduction must be 'mean' or 'sum'"),
    ({"label_smoothing": 1.5}, TensorValueError, "label_smoothing must be in"),
    ({"chunk_size": 0}, TensorValueError, "chunk_size must be a positive int, got 0"),
    ({"chunk_size": 2.0}, TensorValueError, "chunk_size must be a positive int"),
])
def test_bad_options_are_named(kwargs: dict[str, object], error: type[Exception], match: str) -> None:
    x, w, target = bt.zeros(3, 4), bt.zeros(5, 4), bt.tensor([0, 1, 2])
    with pytest.raises(error, match=match):
        bt.linear_cross_entropy(x, w, target, **kwargs)  # type: ignore[arg-type]


def test_bad_inputs_are_named() -> None:
    x, w, target = bt.zeros(3, 4), bt.zeros(5, 4), bt.tensor([0, 1, 2])
    with pytest.raises(ShapeError, match=r"input of shape \[3, 4\] does not fit weight of shape \[5, 3\]"):
        bt.linear_cross_entropy(x, bt.zeros(5, 3), target)
    with pytest.raises(ShapeError, match=r"target shape \[2\] does not match input \[3, 4\] \(expected \[3\]\)"):
        bt.linear_cross_entropy(x, w, bt.tensor([0, 1]))
    with pytest.raises(TensorTypeError, match="target must be an integer Tensor"):
        bt.linear_cross_entropy(x, w, bt.zeros(3))
    with pytest.raises(TensorTypeError, match="weight has dtype float64, input has float32"):
        bt.linear_cross_entropy(x, bt.zeros(5, 4, dtype="float64"), target)
    with pytest.raises(TensorIndexError, match=r"out of range: expected class indices in \[0, 5\) .* received 5"):
        bt.linear_cross_entropy(x, w, bt.tensor([0, 1, 5]))
