"""Autocast: GEMMs in the region's dtype, sensitive ops in float32, master weights in float32."""

from __future__ import annotations

import numpy as np
import pytest

import blutrain.tensor as bt


def test_linear_runs_in_bf16_inside_the_region_and_in_float32_outside() -> None:
    x, w = bt.randn(4, 8), bt.randn(3, 8)
    with bt.autocast(dtype="bfloat16"):
        assert bt.linear(x, w).dtype is bt.bfloat16
        assert (x @ w.T).dtype is bt.bfloat16
    assert bt.linear(x, w).dtype is bt.float32
    assert bt.get_autocast_dtype() is None


def test_norms_softmax_and_loss_run_in_float32_inside_the_region() -> None:
    h = bt.randn(4, 8).to(dtype="bfloat16")
    with bt.autocast():
        assert bt.layer_norm(h, 8).dtype is bt.float32
        assert bt.softmax(h, -1).dtype is bt.float32
        assert bt.cross_entropy(h, bt.tensor([0, 1, 2, 3])).dtype is bt.float32


def test_gradients_reach_float32_master_weights_in_float32() -> None:
    import blutrain.autograd  # noqa: F401  (installs the recorder)

    bt.manual_seed(0)
    x = bt.randn(16, 32)
    w = bt.randn(8, 32, requires_grad=True)
    target = bt.randint(0, 8, (16,))
    with bt.autocast():
        loss = bt.cross_entropy(bt.linear(x, w), target)
    loss.backward()
    assert w.grad is not None and w.grad.dtype is bt.float32
    w32 = w.detach().clone().requires_grad_()
    bt.cross_entropy(bt.linear(x, w32), target).backward()
    ref = w32.grad.numpy()
    err = np.linalg.norm(w.grad.numpy() - ref) / np.linalg.norm(ref)
    assert err < 2e-2  # bf16 operands, float32 accumulation


def test_packed_self_attention_runs_in_bf16_and_its_gradient_reaches_float32_in_float32() -> None:
    import blutrain.autograd  # noqa: F401  (installs the recorder)

    bt.manual_seed(0)
    qkv = bt.randn(2, 8, 3 * 2 * 4, requires_grad=True)
    with bt.autocast():
        y = bt.self_attention(qkv, 2, is_causal=True)
    assert y.dtype is bt.bfloat16
    y.float().sum().backward()
    assert qkv.grad is not None and qkv.grad.dtype is bt.float32


def test_autocast_refuses_a_full_precision_dtype() -> None:
    with pytest.raises(TypeError, match="bfloat16 or float16"):
        bt.autocast(dtype="float32")


def test_linear_under_autocast_names_a_bad_input() -> None:
    with bt.autocast(), pytest.raises(TypeError, match="linear: expected input and weight to be Tensors, got int"):
        bt.linear(5, bt.zeros(3, 4))  # type: ignore[arg-type]
