"""Activation checkpointing: the same gradients as without, by recomputing the segment in backward."""

from __future__ import annotations

import numpy as np
import pytest

import blutrain.tensor as bt
from blutrain.autograd import checkpoint, grad, in_backward
from blutrain.tensor import AutogradError, Tensor


def make_params(seed: int) -> tuple[Tensor, Tensor, Tensor]:
    rng = np.random.default_rng(seed)
    x = bt.tensor(rng.standard_normal((4, 6)), dtype="float64", requires_grad=True)
    w1 = bt.tensor(rng.standard_normal((8, 6)), dtype="float64", requires_grad=True)
    w2 = bt.tensor(rng.standard_normal((3, 8)), dtype="float64", requires_grad=True)
    return x, w1, w2


def block(x: Tensor, w1: Tensor, w2: Tensor) -> Tensor:
    return bt.linear(bt.gelu(bt.linear(x, w1)), w2).tanh()


def test_checkpoint_gives_the_same_gradients_as_running_the_segment_directly() -> None:
    x, w1, w2 = make_params(0)
    (block(x, w1, w2) ** 2).sum().backward()
    expected = [t.grad.numpy().copy() for t in (x, w1, w2)]  # type: ignore[union-attr]

    x, w1, w2 = make_params(0)
    (checkpoint(block, x, w1, w2) ** 2).sum().backward()
    for t, want in zip((x, w1, w2), expected, strict=True):
        assert t.grad is not None
        np.testing.assert_allclose(t.grad.numpy(), want, rtol=1e-12)


def test_parameters_captured_by_the_segment_get_gradients() -> None:
    x, w1, w2 = make_params(1)
    (block(x, w1, w2)).sum().backward()
    expected = w1.grad.numpy().copy()  # type: ignore[union-attr]
    w1.grad = None
    checkpoint(lambda inp: block(inp, w1, w2), x).sum().backward()
    assert w1.grad is not None
    np.testing.assert_allclose(w1.grad.numpy(), expected, rtol=1e-12)


def test_checkpoint_keeps_no_intermediate_and_recomputes_in_backward() -> None:
    calls = []

    def segment(t: Tensor) -> Tensor:
        calls.append(1)
        return (t * 2).exp()

    x = bt.tensor([1.0, 2.0], dtype="float64", requires_grad=True)
    y = checkpoint(segment, x)
    assert len(calls) == 1
    assert y.grad_fn.name() == "CheckpointBackward"
    assert y.grad_fn.edges == [(x, 0)]  # linked to the input only: nothing inside was recorded
    y.sum().backward()
    assert len(calls) == 2


def test_random_ops_draw_the_same_numbers_when_recomputed() -> None:
    def noisy(t: Tensor) -> Tensor:
        return bt.dropout(t, 0.5) * 3

    x = bt.tensor(np.ones(64), dtype="float64", requires_grad=True)
    bt.manual_seed(3)
    y = checkpoint(noisy, x)
    y.sum().backward()
    assert x.grad is not None
    kept = y.detach().numpy() != 0
    np.testing.assert_array_equal(x.grad.numpy(), np.where(kept, 6.0, 0.0))


def test_checkpoint_refuses_grad_which_would_accumulate_into_parameters() -> None:
    x = bt.tensor([1.0], dtype="float64", requires_grad=True)
    with pytest.raises(AutogradError, match="cannot be differentiated by grad"):
        grad(checkpoint(lambda t: t * 2, x).sum(), x)


def test_checkpoint_without_an_input_that_requires_grad_is_an_error() -> None:
    with pytest.raises(AutogradError, match="no input requires grad"):
        checkpoint(lambda t: t * 2, bt.ones(2))


def test_in_backward_tells_a_recomputation_from_the_forward() -> None:
    seen: list[bool] = []

    def segment(t: Tensor) -> Tensor:
        seen.append(in_backward())
        return t * 2

    x = bt.tensor([1.0, 2.0], dtype="float64", requires_grad=True)
    y = checkpoint(segment, x)
    assert not in_backward()
    y.sum().backward()
    assert seen == [False, True]
    assert not in_backward()  # the pass's entry is gone once backward returns
