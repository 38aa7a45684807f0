"""The backward engine: accumulation, grad(), hooks, retain_grad, saved tensors and their lifetime."""

from __future__ import annotations

import gc
import weakref

import numpy as np
import pytest

import blutrain.tensor as bt
from blutrain.autograd import grad, no_grad
from blutrain.tensor import AutogradError, ShapeError, Tensor, TensorTypeError


def leaf(values: object, dtype: str = "float64") -> Tensor:
    return bt.tensor(values, dtype=dtype, requires_grad=True)


def test_backward_of_a_scalar_fills_the_grad_of_every_leaf() -> None:
    x, w = leaf([1.0, 2.0, 3.0]), leaf([0.5, -1.0, 2.0])
    (x * w).sum().backward()
    assert x.grad is not None and w.grad is not None
    np.testing.assert_array_equal(x.grad.numpy(), [0.5, -1.0, 2.0])
    np.testing.assert_array_equal(w.grad.numpy(), [1.0, 2.0, 3.0])


def test_gradients_accumulate_into_grad_across_backward_calls() -> None:
    x = leaf([1.0, 2.0])
    (x * 3).sum().backward()
    (x * 4).sum().backward()
    assert x.grad is not None
    np.testing.assert_array_equal(x.grad.numpy(), [7.0, 7.0])


def test_accumulation_keeps_the_grad_tensor_and_bumps_its_version() -> None:
    x = leaf([1.0, 2.0])
    (x * 3).sum().backward()
    first = x.grad
    assert first is not None
    version = first.version
    (x * 4).sum().backward()
    assert x.grad is first
    assert first.version > version


def test_backward_of_a_non_scalar_needs_a_gradient() -> None:
    y = leaf([1.0, 2.0]) * 2
    with pytest.raises(AutogradError, match="only for scalar outputs"):
        y.backward()


def test_backward_gradient_of_wrong_shape_names_both_shapes() -> None:
    y = leaf([[1.0, 2.0]]) * 2
    with pytest.raises(ShapeError, match=r"gradient has shape \[2\], but the output has shape \[1, 2\]"):
        y.backward(bt.ones(2, dtype="float64"))


def test_backward_with_an_explicit_gradient_is_a_vector_jacobian_product() -> None:
    x = leaf([1.0, 2.0, 3.0])
    (x * x).backward(bt.tensor([1.0, 0.0, 2.0], dtype="float64"))
    assert x.grad is not None
    np.testing.assert_array_equal(x.grad.numpy(), [2.0, 0.0, 12.0])


def test_backward_on_a_tensor_without_grad_fails() -> None:
    with pytest.raises(AutogradError, match="does not require grad"):
        bt.ones(2).sum().backward()


def test_leaves_reached_through_a_shared_gradient_get_their_own_memory() -> None:
    a, b = leaf([1.0, 2.0]), leaf([3.0, 4.0])
    (a + b).sum().backward()
    assert a.grad is not None and b.grad is not None
    assert a.grad.data_ptr() != b.grad.data_ptr()
    a.grad.zero_()
    np.testing.assert_array_equal(b.grad.numpy(), [1.0, 1.0])


def test_grad_of_a_broadcast_is_contiguous_and_writable() -> None:
    x = leaf([[1.0, 2.0, 3.0]])
    x.expand(4, 3).sum().backward()
    assert x.grad is not None and x.grad.is_contiguous()
    x.grad.mul_(2)
    np.testing.assert_array_equal(x.grad.numpy(), [[8.0, 8.0, 8.0]])


def test_grad_reaching_a_leaf_has_the_leaf_dtype() -> None:
    x = leaf([1.0, 2.0], dtype="float32")
    (x.to(dtype="float64") * 2).sum().backward()
    assert x.grad is not None and x.grad.dtype is bt.float32


def test_grad_returns_gradients_without_touching_dot_grad() -> None:
    x, w = leaf([1.0, 2.0]), leaf([3.0, 5.0])
    gx, gw = grad((x * w).sum(), [x, w])
    assert gx is not None and gw is not None
    np.testing.assert_array_equal(gx.numpy(), [3.0, 5.0])
    np.testing.assert_array_equal(gw.numpy(), [1.0, 2.0])
    assert x.grad is None and w.grad is None


def test_grad_takes_grad_outputs_for_non_scalar_outputs() -> None:
    x = leaf([1.0, 2.0])
    (g,) = grad(x * x, x, bt.tensor([1.0, 10.0], dtype="float64"))
    assert g is not None
    np.testing.assert_array_equal(g.numpy(), [2.0, 40.0])


def test_grad_of_an_intermediate_tensor() -> None:
    x = leaf([1.0, 2.0])
    h = x * 3
    (gh,) = grad((h * h).sum(), h)
    assert gh is not None
    np.testing.assert_array_equal(gh.numpy(), [6.0, 12.0])


def test_grad_refuses_an_unused_input_unless_allowed() -> None:
    x, unused = leaf([1.0]), leaf([2.0])
    with pytest.raises(AutogradError, match="allow_unused=True"):
        grad((x * 2).sum(), [x, unused], retain_graph=True)
    gx, gu = grad((x * 2).sum(), [x, unused], allow_unused=True)
    assert gx is not None and gu is None


def test_grad_with_create_graph_gives_second_derivatives() -> None:
    x = leaf([1.0, 2.0])
    (g,) = grad((x * x * x).sum(), x, create_graph=True)
    assert g is not None and g.requires_grad
    (h,) = grad(g.sum(), x)
    assert h is not None
    np.testing.assert_allclose(h.numpy(), [6.0, 12.0])


def test_backward_with_inputs_accumulates_only_into_those() -> None:
    a, b = leaf([1.0]), leaf([2.0])
    (a * b).sum().backward(inputs=[a])
    assert a.grad is not None and b.grad is None
    (a * b).sum().backward(inputs=b)
    assert b.grad is not None and b.grad.tolist() == [1.0]


def test_second_backward_through_freed_saved_tensors_fails_naming_the_node() -> None:
    x = leaf([1.0, 2.0])
    y = (x.exp() * 2).sum()
    y.backward()
    with pytest.raises(AutogradError, match=r"ExpBackward a second time.*retain_graph=True"):
        y.backward()


def test_retain_graph_allows_a_second_backward() -> None:
    x = leaf([1.0, 2.0])
    y = (x * x).sum()
    y.backward(retain_graph=True)
    y.backward()
    assert x.grad is not None
    np.testing.assert_array_equal(x.grad.numpy(), [4.0, 8.0])


def test_a_graph_that_saved_no_tensor_can_run_backward_twice() -> None:
    x = leaf([1.0, 2.0])
    y = (x * 2 + 1).sum()  # scalar mul, add and sum keep no tensor
    y.backward()
    y.backward()
    assert x.grad is not None
    np.testing.assert_array_equal(x.grad.numpy(), [4.0, 4.0])


def test_a_node_frees_what_it_saved_after_its_backward() -> None:
    x = leaf(np.ones(1000))
    h = x * 2
    y = h.sin().sum()  # sin saves its input h
    node = y.grad_fn.edges[0][0]
    saved = weakref.ref(node.saved[0])
    del h
    gc.collect()
    assert saved() is not None
    y.backward()
    gc.collect()
    assert saved() is None
    assert node.saved == ()


def test_a_node_keeps_what_it_saved_with_retain_graph() -> None:
    x = leaf([1.0, 2.0])
    y = x.sin().sum()
    node = y.grad_fn.edges[0][0]
    y.backward(retain_graph=True)
    assert len(node.saved) == 1


def test_saved_outputs_form_no_reference_cycle() -> None:
    x = leaf(np.ones(8))
    out = x.exp()  # exp saves its output
    ref = weakref.ref(out)
    gc.disable()
    try:
        del out
        assert ref() is None  # freed by reference counting alone
    finally:
        gc.enable()


def test_modifying_a_saved_tensor_in_place_fails_naming_the_op_and_versions() -> None:
    w = leaf([1.0, 2.0])
    a = bt.tensor([3.0, 4.0], dtype="float64")
    y = (w * a).sum()  # mul saves a for w's gradient
    a.add_(1)
    with pytest.raises(AutogradError, match=r"modified by an in-place operation.*MulBackward.*version 1; "
                                            r"expected version 0"):
        y.backward()


def test_modifying_a_view_of_a_saved_tensor_is_detected_too() -> None:
    w = leaf([1.0, 2.0])
    a = bt.tensor([3.0, 4.0], dtype="float64")
    y = (w * a).sum()
    a[0:1].fill_(9.0)
    with pytest.raises(AutogradError, match="MulBackward"):
        y.backward()


def test_modifying_a_leaf_under_no_grad_after_it_was_saved_is_detected() -> None:
    x = leaf([1.0, 2.0])
    y = x.exp().sum() + (x * x).sum()
    with no_grad():
        x.mul_(2)
    with pytest.raises(AutogradError, match="MulBackward"):
        y.backward()


def test_in_place_on_a_leaf_that_requires_grad_is_refused_in_grad_mode() -> None:
    x = leaf([1.0, 2.0])
    with pytest.raises(AutogradError, match=r"add_: in-place ops on a leaf tensor that requires grad"):
        x.add_(1)
    with no_grad():
        x.add_(1)
    np.testing.assert_array_equal(x.detach().numpy(), [2.0, 3.0])


def test_detach_shares_storage_and_leaves_the_graph() -> None:
    x = leaf([1.0, 2.0])
    y = x * 2
    d = y.detach()
    assert not d.requires_grad and d.grad_fn is None and d.is_leaf
    assert d.data_ptr() == y.data_ptr()
    assert d.version == y.version


def test_requires_grad_is_for_floating_tensors_only() -> None:
    with pytest.raises(TensorTypeError, match="only floating tensors can require gradients, got dtype int64"):
        bt.tensor([1, 2]).requires_grad_()


def test_requires_grad_false_on_a_non_leaf_points_to_detach() -> None:
    y = leaf([1.0]) * 2
    with pytest.raises(AutogradError, match="detach"):
        y.requires_grad_(False)


def test_ops_on_tensors_that_require_grad_record_a_node_named_after_the_op() -> None:
    x = leaf([1.0])
    y = bt.tanh(x)
    assert not y.is_leaf and y.requires_grad
    assert y.grad_fn.name() == "TanhBackward"
    assert "grad_fn=<TanhBackward>" in repr(y)


def test_a_hook_on_a_leaf_can_replace_its_gradient() -> None:
    x = leaf([1.0, 2.0])
    seen = []
    x.register_hook(lambda g: seen.append(g.numpy().copy()) or g * 10)
    (x * 2).sum().backward()
    np.testing.assert_array_equal(seen[0], [2.0, 2.0])
    assert x.grad is not None
    np.testing.assert_array_equal(x.grad.numpy(), [20.0, 20.0])


def test_a_hook_on_an_intermediate_tensor_changes_what_flows_upstream() -> None:
    x = leaf([1.0, 2.0])
    h = x * 3
    h.register_hook(lambda g: g * 0)
    (h * h).sum().backward()
    assert x.grad is not None
    np.testing.assert_array_equal(x.grad.numpy(), [0.0, 0.0])


def test_a_removed_hook_is_not_called() -> None:
    x = leaf([1.0])
    calls = []
    remove = x.register_hook(lambda g: calls.append(1))
    remove()
    (x * 2).sum().backward()
    assert calls == []


def test_post_accumulate_hook_runs_after_grad_is_set_once_per_backward() -> None:
    x = leaf([1.0, 2.0])
    seen: list[np.ndarray] = []
    x.register_post_accumulate_grad_hook(lambda t: seen.append(t.grad.numpy().copy()))  # type: ignore[union-attr]
    (x * 2).sum().backward()
    (x * 3).sum().backward()
    assert len(seen) == 2
    np.testing.assert_array_equal(seen[1], [5.0, 5.0])


def test_post_accumulate_hook_is_for_leaves_only() -> None:
    y = leaf([1.0]) * 2
    with pytest.raises(AutogradError, match="only leaf tensors"):
        y.register_post_accumulate_grad_hook(lambda t: None)


def test_post_accumulate_hook_does_not_run_for_grad() -> None:
    x = leaf([1.0])
    calls = []
    x.register_post_accumulate_grad_hook(lambda t: calls.append(t))
    grad((x * 2).sum(), x)
    assert calls == []


def test_retain_grad_keeps_the_gradient_of_an_intermediate_tensor() -> None:
    x = leaf([1.0, 2.0])
    h = x * 3
    h.retain_grad()
    (h * h).sum().backward()
    assert h.retains_grad and h.grad is not None
    np.testing.assert_array_equal(h.grad.numpy(), [6.0, 12.0])


def test_a_retained_gradient_accumulates_across_backward_calls() -> None:
    x = leaf([1.0])
    h = x * 3
    h.retain_grad()
    y = (h * 2).sum()
    y.backward(retain_graph=True)
    y.backward()
    assert h.grad is not None
    np.testing.assert_array_equal(h.grad.numpy(), [4.0])


def test_intermediate_tensors_get_no_grad_without_retain_grad() -> None:
    x = leaf([1.0])
    h = x * 3
    (h * 2).sum().backward()
    assert h.grad is None


def test_gradient_flows_through_a_second_device_and_back(second_device: bt.Device) -> None:
    x = leaf([1.0, 2.0])
    y = x.to(second_device)
    assert y.device is second_device
    (y.exp().to("cpu")).sum().backward()
    assert x.grad is not None and x.grad.device.type == "cpu"
    np.testing.assert_allclose(x.grad.numpy(), np.exp([1.0, 2.0]))
