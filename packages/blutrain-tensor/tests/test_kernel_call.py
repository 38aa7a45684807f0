"""The public way to run a kernel on tensors (dispatch.call / call_multi), the dispatch interceptor, and the
raw access a tensor offers beside its ops (array, from_array, storage, base, bump_version, copy=False)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import hypothesis.strategies as st
import numpy as np
import pytest
from hypothesis import given, settings

import blutrain.tensor as bt
from blutrain.tensor import capture, dispatch
from blutrain.tensor.kernel import Kernel


@settings(max_examples=20, deadline=None)
@given(st.lists(st.integers(1, 5), min_size=1, max_size=3))
def test_call_gives_the_kernel_output_as_a_tensor_of_the_kernel_dtype(shape: list[int]) -> None:
    rng = np.random.default_rng(0)
    a, b = rng.standard_normal(shape), rng.standard_normal(shape)
    out = dispatch.call("mul", bt.from_numpy(a), bt.from_numpy(b))
    assert isinstance(out, bt.Tensor) and out.dtype is bt.float64 and out.device == bt.device("cpu")
    np.testing.assert_allclose(out.numpy(), a * b, rtol=1e-12)


def test_call_passes_non_tensor_arguments_as_they_are() -> None:
    x = bt.tensor([-1.0, 0.0, 2.0], dtype="float64")
    dx = dispatch.call("gelu_backward", bt.ones_like(x), x, "none")
    want = dispatch.kernel("gelu_backward", "cpu", bt.float64)(np.ones(3), x.numpy(), "none")
    np.testing.assert_allclose(dx.numpy(), want, rtol=1e-12)


def test_call_looks_up_the_given_dtype_and_wraps_in_the_given_out_dtype() -> None:
    x = bt.tensor([1.5, 2.5], dtype="float32")
    out = dispatch.call("cast", x, np.dtype(np.float64), out_dtype=bt.float64)
    assert out.dtype is bt.float64 and out.array.dtype == np.float64
    summed = dispatch.call("sum", bt.tensor([1, 2, 3]), None, False, dtype=bt.int64)
    assert summed.item() == 6 and summed.dtype is bt.int64


def test_call_records_nothing_for_autograd() -> None:
    x = bt.randn(3, requires_grad=True)
    out = dispatch.call("exp", x)
    assert not out.requires_grad and out.grad_fn is None


def test_call_multi_keeps_none_outputs_and_takes_each_output_dtype() -> None:
    rng = np.random.default_rng(1)
    g, x, w = (bt.from_numpy(rng.standard_normal(s)) for s in ((4, 3), (4, 5), (3, 5)))
    gx, gw, gb = dispatch.call_multi("linear_backward", g, x, w, True, False, True)
    assert gw is None and gx is not None and gb is not None
    np.testing.assert_allclose(gx.numpy(), g.numpy() @ w.numpy(), rtol=1e-12)
    np.testing.assert_allclose(gb.numpy(), g.numpy().sum(0), rtol=1e-12)
    q = bt.randn(1, 2, 4, 8, dtype="bfloat16")
    out, lse = dispatch.call_multi("sdpa", q, q, q, None, True, 0.5, out_dtypes=(q.dtype, None))
    assert out is not None and lse is not None
    assert out.dtype is bt.bfloat16 and lse.dtype is bt.float32  # None: the dtype the kernel's array holds


def test_call_multi_refuses_a_wrong_number_of_out_dtypes() -> None:
    q = bt.randn(1, 2, 4, 8)
    with pytest.raises(bt.TensorTypeError, match="out_dtypes gives 1 dtypes, the kernel returned 2"):
        dispatch.call_multi("sdpa", q, q, q, None, True, 0.5, out_dtypes=(q.dtype,))


class _ScaleFirst:
    """A plugin kernel whose first argument is a Python number, not an array."""

    @bt.hookimpl
    def blutrain_register_kernels(self, registry: Any) -> None:
        registry.register("test_scale_first", "cpu", "float64", lambda scale, x: x * scale)


def test_call_runs_on_the_first_tensor_argument_wherever_it_is() -> None:
    bt.plugins.register(_ScaleFirst(), "test-scale-first")
    try:
        out = dispatch.call("test_scale_first", 3.0, bt.tensor([1.0, 2.0], dtype="float64"))
    finally:
        bt.plugins.unregister("test-scale-first")
    assert out.dtype is bt.float64 and out.tolist() == [3.0, 6.0]


def test_call_without_a_tensor_argument_names_the_op() -> None:
    with pytest.raises(bt.TensorTypeError, match=r"exp: dispatch\.call needs at least one Tensor argument"):
        dispatch.call("exp", np.ones(2))


def test_call_of_an_unknown_op_raises_kernel_not_found() -> None:
    with pytest.raises(bt.KernelNotFoundError):
        dispatch.call("no_such_op", bt.ones(2))


def test_an_interceptor_wraps_each_kernel_looked_up_and_goes_with_its_block() -> None:
    seen: list[tuple[str, str, bt.DType]] = []

    def intercept(key: dispatch.KernelKey, fn: Kernel) -> Kernel:
        def wrapped(*args: Any) -> Any:
            seen.append(key)
            return fn(*args)
        return wrapped

    a, b = bt.ones(2), bt.ones(2, dtype="float64")
    with dispatch.intercepting(intercept):
        assert dispatch.interceptor is intercept
        (a + a).exp()
        dispatch.call("neg", b)
    assert seen == [("add", "cpu", bt.float32), ("exp", "cpu", bt.float32), ("neg", "cpu", bt.float64)]
    assert dispatch.interceptor is None
    (a + a).exp()
    assert len(seen) == 3  # the table holds the bare kernels again


def test_the_debug_mode_is_an_interceptor_that_another_stands_in_for_and_gives_back() -> None:
    passthrough: Callable[[dispatch.KernelKey, Kernel], Kernel] = lambda key, fn: fn  # noqa: E731
    with bt.debug_mode():
        checking = dispatch.interceptor
        assert checking is not None
        with dispatch.intercepting(passthrough):
            assert dispatch.interceptor is passthrough and bt.is_debug_mode()
        assert dispatch.interceptor is checking
    assert dispatch.interceptor is None and not bt.is_debug_mode()


def test_array_is_the_viewed_backend_array() -> None:
    x = bt.arange(6).reshape(2, 3)
    col = x[:, 1]
    assert isinstance(col.array, np.ndarray) and np.shares_memory(col.array, x.array)
    assert col.array.tolist() == [1, 4] and col.array.shape == col.shape


def test_from_array_wraps_without_copy_in_a_storage_of_its_own() -> None:
    a = np.arange(4.0)
    t = bt.Tensor.from_array(a, bt.float64, bt.device("cpu"))
    assert t.array is a and t.storage.array is a and t.base is None and t.version == 0
    assert not t.requires_grad and t.grad_fn is None


def test_views_share_storage_and_name_their_base() -> None:
    x = bt.zeros(4)
    v = x[1:3]
    assert v.storage is x.storage and v.base is x and x.base is None
    assert v[0:1].base is x  # a view of a view names the tensor that owns the storage


def test_bump_version_is_seen_by_every_view() -> None:
    x = bt.zeros(4)
    v = x[1:]
    x.array[0] = 1.0  # a write around the ops ...
    v.bump_version()  # ... reported by its writer
    assert x.version == v.version == 1


def test_tensor_with_copy_false_shares_a_tensor_of_the_same_dtype_and_device() -> None:
    x = bt.arange(3.0)
    shared = bt.Tensor(x, copy=False)
    assert shared.storage is x.storage and shared.array is x.array
    assert bt.Tensor(x).storage is not x.storage  # the default copies
    converted = bt.Tensor(x, dtype="float64", copy=False)
    assert converted.storage is not x.storage and converted.dtype is bt.float64


def test_set_grad_fn_links_an_output_and_makes_it_require_grad() -> None:
    t = bt.zeros(2)
    node = object()
    t.set_grad_fn(node, 1)
    assert t.requires_grad and t.grad_fn is node and t.output_nr == 1 and not t.is_leaf


def test_grad_hooks_list_the_registered_hooks_in_order() -> None:
    w = bt.zeros(2, requires_grad=True)
    assert tuple(w.grad_hooks) == () and tuple(w.post_accumulate_grad_hooks) == ()
    first, second = (lambda g: g), (lambda g: None)
    w.register_hook(first)
    remove = w.register_hook(second)
    post = w.register_post_accumulate_grad_hook(lambda t: None)
    assert list(w.grad_hooks) == [first, second]
    remove()
    post()
    assert list(w.grad_hooks) == [first] and list(w.post_accumulate_grad_hooks) == []


def test_substitute_arrays_swaps_for_the_block_and_restores_on_error() -> None:
    x = bt.arange(3.0)
    own, other = x.array, np.full(3, 7.0)
    with pytest.raises(RuntimeError, match="inside"), capture.substitute_arrays([x], [other]):
        assert x.array is other and x.tolist() == [7.0, 7.0, 7.0]
        raise RuntimeError("inside")
    assert x.array is own and x.tolist() == [0.0, 1.0, 2.0]


def test_substitute_arrays_wants_one_array_per_tensor() -> None:
    entered = False
    with pytest.raises(bt.TensorValueError, match="2 tensors and 1 arrays"), capture.substitute_arrays(
            [bt.zeros(1), bt.zeros(1)], [np.zeros(1)]):
        entered = True
    assert not entered
