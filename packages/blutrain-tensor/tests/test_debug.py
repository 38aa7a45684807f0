"""The debug mode: a checking dispatch table swapped in at switch time, index and NaN checks on any device.

"host2" (conftest) stands in for an accelerator: a device that is not "cpu", so the ops read no
index values there themselves, as on CUDA; only the debug mode checks them.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import blutrain.tensor as bt
from blutrain.tensor import TensorIndexError, TensorValueError, dispatch, kernels
from blutrain.tensor.debug import INDEX_CHECKS, NAN_CHECKS, enabled_by_environment
from blutrain.tensor.device import Device


@pytest.fixture(autouse=True)
def _debug_mode_off_around_each_test() -> Iterator[None]:
    """Each test starts with the mode off (whatever BLUTRAIN_DEBUG says) and leaves it as it was."""
    with bt.debug_mode(False):
        yield


def _filled(op: str, device: str = "cpu", dtype: bt.DType = bt.float32) -> Any:
    dispatch.kernel(op, device, dtype)
    return dispatch.TABLE[(op, device, dtype)]


# --- the switch -----------------------------------------------------------------------------------------------


def test_with_the_mode_off_the_table_holds_the_registered_kernels_themselves() -> None:
    for op in ("embedding", "cross_entropy", "matmul", "add"):
        assert _filled(op) is kernels().lookup(op, "cpu", bt.float32).fn


def test_with_the_mode_on_checked_ops_dispatch_to_a_wrapper_around_the_registered_kernel() -> None:
    bt.debug_mode(True)
    for op in ("embedding", "cross_entropy", "matmul", "layer_norm_backward"):
        fn = _filled(op)
        assert fn is not kernels().lookup(op, "cpu", bt.float32).fn
        assert fn.__wrapped__ is kernels().lookup(op, "cpu", bt.float32).fn


def test_ops_without_checks_keep_their_bare_kernel_in_the_mode() -> None:
    bt.debug_mode(True)
    for op in ("add", "exp", "log", "sum", "copy"):
        assert _filled(op) is kernels().lookup(op, "cpu", bt.float32).fn


def test_switching_off_puts_the_bare_kernels_back() -> None:
    bt.debug_mode(True)
    _filled("embedding")
    bt.debug_mode(False)
    assert _filled("embedding") is kernels().lookup("embedding", "cpu", bt.float32).fn


def test_the_context_manager_restores_the_state_before_it_even_on_error() -> None:
    assert not bt.is_debug_mode()
    with pytest.raises(RuntimeError), bt.debug_mode():
        assert bt.is_debug_mode()
        with bt.debug_mode(False):
            assert not bt.is_debug_mode()
        assert bt.is_debug_mode()
        raise RuntimeError("leave the block")
    assert not bt.is_debug_mode()


@pytest.mark.parametrize(("value", "on"), [("1", True), ("true", True), ("ON", True), ("0", False), ("", False),
                                           ("no", False)])
def test_blutrain_debug_in_the_environment_selects_the_mode(value: str, on: bool) -> None:
    assert enabled_by_environment({"BLUTRAIN_DEBUG": value}) is on
    assert enabled_by_environment({}) is False


def test_blutrain_debug_1_turns_the_mode_on_at_import() -> None:
    code = ("import blutrain.tensor as bt\n"
            "print(bt.is_debug_mode())\n"
            "try:\n"
            "    bt.softmax(bt.tensor([float('nan'), 1.0]), 0)\n"
            "except bt.TensorValueError as e:\n"
            "    print(e)\n")
    env = {**os.environ, "BLUTRAIN_DEBUG": "1"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.splitlines()[0] == "True"
    assert out.stdout.splitlines()[1].startswith("softmax: input holds NaN")


def test_every_checked_op_is_a_registered_kernel() -> None:
    registered = {op for op, _, _ in kernels().entries()}
    assert set(INDEX_CHECKS) | set(NAN_CHECKS) <= registered


# --- index ranges, on a device where the ops themselves do not read indices ------------------------------------


def _bad_indices(size: int) -> st.SearchStrategy[tuple[list[int], int]]:
    """Index lists holding at least one value outside [0, size), and the value the check reports
    (the largest if any is >= size, else the smallest)."""
    good = st.integers(0, size - 1)
    bad = st.one_of(st.integers(-3 * size, -1), st.integers(size, 3 * size))

    @st.composite
    def draw(d: st.DrawFn) -> tuple[list[int], int]:
        values = d(st.lists(good, max_size=6)) + d(st.lists(bad, min_size=1, max_size=3))
        values = d(st.permutations(values))
        hi = max(values)
        return values, hi if hi >= size else min(values)

    return draw()


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data(), size=st.integers(1, 9))
def test_embedding_index_out_of_range_on_another_device_is_caught_in_the_mode(
        second_device: Device, data: st.DataObject, size: int) -> None:
    values, reported = data.draw(_bad_indices(size))
    weight = bt.randn(size, 3, device=second_device)
    index = bt.tensor(values, device=second_device)
    with bt.debug_mode(), pytest.raises(TensorIndexError) as caught:
        bt.embedding(index, weight)
    assert str(caught.value) == (f"embedding: input out of range: expected indices in [0, {size}) for dim 0 of "
                                 f"weight (size {size}), received {reported}")


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data(), classes=st.integers(1, 9))
def test_cross_entropy_target_out_of_range_on_another_device_is_caught_in_the_mode(
        second_device: Device, data: st.DataObject, classes: int) -> None:
    values, _ = data.draw(_bad_indices(classes))
    logits = bt.randn(len(values), classes, device=second_device)
    with bt.debug_mode(), pytest.raises(TensorIndexError, match=rf"cross_entropy: target out of range: expected "
                                                                rf"class indices in \[0, {classes}\) or "
                                                                r"ignore_index=-100, received -?\d+"):
        bt.cross_entropy(logits, bt.tensor(values, device=second_device))


def test_ignored_targets_pass_the_check_wherever_they_lie(second_device: Device) -> None:
    logits = bt.randn(3, 4, device=second_device)
    target = bt.tensor([1, 99, 3], device=second_device)
    with bt.debug_mode():
        loss = bt.cross_entropy(logits, target, ignore_index=99)
    assert loss.item() == bt.cross_entropy(logits, target, ignore_index=99).item()


IndexOp = Callable[[bt.Tensor, bt.Tensor], Any]
INDEX_OPS: dict[str, tuple[IndexOp, str]] = {
    "index_select": (lambda x, i: bt.index_select(x, 1, i), "dim 1 of input"),
    "gather": (lambda x, i: bt.gather(x, 1, i.reshape(1, -1).expand(2, i.shape[0])), "dim 1 of input"),
    "scatter_add": (lambda x, i: bt.scatter_add(x, 1, i.reshape(1, -1), bt.ones(1, i.shape[0], device=x.device)),
                    "dim 1 of input"),
    "index_add": (lambda x, i: bt.index_add(x, 1, i, bt.ones(2, i.shape[0], device=x.device)), "dim 1 of input"),
}


@pytest.mark.parametrize("op", sorted(INDEX_OPS))
@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data(), size=st.integers(1, 7))
def test_index_ops_out_of_range_on_another_device_are_caught_in_the_mode(
        second_device: Device, op: str, data: st.DataObject, size: int) -> None:
    fn, where = INDEX_OPS[op]
    values, reported = data.draw(_bad_indices(size))
    x = bt.zeros(2, size, device=second_device)
    with bt.debug_mode(), pytest.raises(TensorIndexError) as caught:
        fn(x, bt.tensor(values, device=second_device))
    assert str(caught.value) == (f"{op}: index out of range: expected indices in [0, {size}) for {where} "
                                 f"(size {size}), received {reported}")


def test_an_index_tensor_key_out_of_range_is_caught_in_the_mode(second_device: Device) -> None:
    x = bt.zeros(4, 2, device=second_device)
    with bt.debug_mode():
        with pytest.raises(TensorIndexError, match=r"index: index 4 is out of range for dim 0 of size 4: expected "
                                                   r"indices in \[-4, 4\)"):
            x[bt.tensor([0, 4], device=second_device)]
        with pytest.raises(TensorIndexError, match=r"index_put: index -5 is out of range for dim 0 of size 4"):
            x[bt.tensor([-5], device=second_device)] = 1.0
        assert x[bt.tensor([-4, 3], device=second_device)].shape == (2, 2)


@settings(max_examples=25, deadline=None)
@given(data=st.data(), size=st.integers(1, 9))
def test_the_checking_kernels_catch_bad_indices_on_the_cpu_too(data: st.DataObject, size: int) -> None:
    """The same checks, called through the CPU table (the ops check first on the CPU, so the kernels
    are called directly here, as a backward rule does)."""
    values, reported = data.draw(_bad_indices(size))
    idx = np.array(values, dtype=np.int64)
    with bt.debug_mode():
        with pytest.raises(TensorIndexError, match=rf"embedding: input out of range: .* received {reported}$"):
            dispatch.kernel("embedding", "cpu", bt.float32)(np.zeros((size, 2), np.float32), idx)
        with pytest.raises(TensorIndexError, match=rf"embedding_backward: input out of range: expected indices in "
                                                   rf"\[0, {size}\) for num_embeddings={size}, received {reported}$"):
            dispatch.kernel("embedding_backward", "cpu", bt.float32)(np.zeros((idx.size, 2), np.float32), idx, size)
        with pytest.raises(TensorIndexError, match=r"cross_entropy_backward: target out of range"):
            dispatch.kernel("cross_entropy_backward", "cpu", bt.float32)(
                np.ones(idx.size, np.float32), np.zeros((idx.size, size), np.float32), idx,
                np.zeros(idx.size, np.float32), -100, 0.0, "none")


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(values=st.lists(st.integers(0, 7), min_size=1, max_size=12))
def test_in_range_indices_give_the_same_results_with_the_mode_on(second_device: Device, values: list[int]) -> None:
    weight = bt.randn(8, 3, device=second_device)
    index = bt.tensor(values, device=second_device)
    plain = bt.embedding(index, weight).cpu().numpy()
    with bt.debug_mode():
        np.testing.assert_array_equal(bt.embedding(index, weight).cpu().numpy(), plain)


# --- NaN in inputs of the ops that mix elements ------------------------------------------------------------------

NanOp = Callable[[bt.Tensor], Any]
NAN_OPS: dict[str, tuple[NanOp, str, str]] = {
    # public op name → (call with the poisoned tensor, op in the message, argument in the message)
    "matmul": (lambda x: x @ bt.ones(x.shape[-1], 2, dtype=x.dtype), "matmul", "input"),
    "linear/weight": (lambda w: bt.linear(bt.ones(3, w.shape[1], dtype=w.dtype), w), "linear", "weight"),
    "layer_norm": (lambda x: bt.layer_norm(x, x.shape[-1]), "layer_norm", "input"),
    "rms_norm": (lambda x: bt.rms_norm(x, x.shape[-1]), "rms_norm", "input"),
    "softmax": (lambda x: bt.softmax(x, -1), "softmax", "input"),
    "log_softmax": (lambda x: bt.log_softmax(x, -1), "log_softmax", "input"),
    "logsumexp": (lambda x: bt.logsumexp(x, -1), "logsumexp", "input"),
    "cross_entropy": (lambda x: bt.cross_entropy(x, bt.zeros(x.shape[0], dtype="int64")), "cross_entropy",
                      "input"),
    "sdpa/key": (lambda k: bt.scaled_dot_product_attention(bt.ones(2, k.shape[1], dtype=k.dtype), k,
                                                           bt.ones(*k.shape, dtype=k.dtype)),
                 "scaled_dot_product_attention", "key"),
}


@pytest.mark.parametrize("case", sorted(NAN_OPS))
@settings(max_examples=10, deadline=None)
@given(rows=st.integers(1, 4), cols=st.integers(1, 5), data=st.data(),
       dtype=st.sampled_from([bt.float32, bt.float64, bt.bfloat16]))
def test_nan_in_an_input_of_a_mixing_op_is_refused_in_the_mode_naming_op_argument_and_position(
        case: str, rows: int, cols: int, data: st.DataObject, dtype: bt.DType) -> None:
    fn, op, argument = NAN_OPS[case]
    r, c = data.draw(st.integers(0, rows - 1)), data.draw(st.integers(0, cols - 1))
    values = np.ones((rows, cols))
    values[r, c] = np.nan
    x = bt.tensor(values, dtype=dtype)
    fn(x)  # the mode off: the NaN passes
    with bt.debug_mode(), pytest.raises(TensorValueError) as caught:
        fn(x)
    assert str(caught.value) == (f"{op}: {argument} holds NaN: expected no NaN, received 1 of {rows * cols} "
                                 f"elements NaN (the first at [{r}, {c}]) in a tensor of shape [{rows}, {cols}]")


def test_a_nan_gradient_arriving_at_a_backward_kernel_is_refused_in_the_mode() -> None:
    x = bt.randn(3, 4, requires_grad=True)
    w = bt.randn(2, 4, requires_grad=True)
    grad = bt.tensor([[1.0, float("nan")], [0.0, 0.0], [0.0, 0.0]])
    with bt.debug_mode():
        y = bt.linear(x, w)
        with pytest.raises(TensorValueError, match=r"linear_backward: grad_output holds NaN: expected no NaN, "
                                                   r"received 1 of 6 elements NaN \(the first at \[0, 1\]\)"):
            y.backward(grad)


def test_elementwise_ops_and_reductions_let_nan_through_in_the_mode() -> None:
    with bt.debug_mode():
        made = bt.log(bt.tensor([-1.0, 1.0]))  # log of a negative number makes a NaN legitimately
        assert np.isnan(made.numpy()[0])
        assert np.isnan((made * 2).sum().item())
        assert np.isnan(made.norm().item())


def test_infinities_pass_the_checks_since_masks_are_written_with_minus_inf() -> None:
    scores = bt.tensor([[0.0, float("-inf")], [1.0, 2.0]])
    with bt.debug_mode():
        probs = bt.softmax(scores, -1).numpy()
    np.testing.assert_allclose(probs[0], [1.0, 0.0])


def test_a_training_step_gives_identical_results_with_the_mode_on() -> None:
    def step() -> tuple[float, np.ndarray, np.ndarray]:
        bt.manual_seed(3)
        emb = bt.randn(11, 8, requires_grad=True)
        w = bt.randn(11, 8, requires_grad=True)
        ids = bt.randint(0, 11, (2, 5))
        h = bt.layer_norm(bt.embedding(ids, emb), 8)
        att = bt.scaled_dot_product_attention(h, h, h, is_causal=True)
        loss = bt.cross_entropy(bt.linear(att, w).reshape(10, 11), ids.reshape(10))
        loss.backward()
        assert emb.grad is not None and w.grad is not None
        return loss.item(), emb.grad.numpy(), w.grad.numpy()

    plain = step()
    with bt.debug_mode():
        checked = step()
    assert checked[0] == plain[0]
    np.testing.assert_array_equal(checked[1], plain[1])
    np.testing.assert_array_equal(checked[2], plain[2])
