"""Errors are part of the API: builtin-compatible classes, messages naming argument, expected, received."""

from __future__ import annotations

import re
from collections.abc import Callable

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import blutrain.tensor as bt
from blutrain.tensor import (
    AutogradError,
    BluTrainError,
    DeviceMismatchError,
    KernelNotFoundError,
    NotRegisteredError,
    SerializationError,
    ShapeError,
    TensorIndexError,
    TensorTypeError,
    TensorValueError,
)


@pytest.mark.parametrize(("cls", "builtin"), [
    (TensorTypeError, TypeError), (ShapeError, ValueError), (TensorValueError, ValueError),
    (DeviceMismatchError, RuntimeError), (AutogradError, RuntimeError), (KernelNotFoundError, LookupError),
    (NotRegisteredError, LookupError), (TensorIndexError, IndexError), (SerializationError, ValueError)])
def test_every_error_is_a_blutrain_error_and_the_builtin_users_catch(cls: type, builtin: type) -> None:
    assert issubclass(cls, BluTrainError) and issubclass(cls, builtin)


def test_broadcast_mismatch_shows_both_shapes() -> None:
    with pytest.raises(ShapeError, match=r"add: shapes \[2, 3\] and \[4\] cannot be broadcast together"):
        bt.ones(2, 3) + bt.ones(4)


def test_matmul_mismatch_shows_both_shapes_and_the_inner_sizes() -> None:
    with pytest.raises(ShapeError, match=r"matmul: shapes \[2, 3\] and \[4, 5\] cannot be multiplied \(3 != 4\)"):
        bt.ones(2, 3) @ bt.ones(4, 5)


def test_linear_mismatch_names_input_and_weight_shapes() -> None:
    with pytest.raises(ShapeError, match=r"linear: input of shape \[2, 3\] does not fit weight of shape \[4, 5\]"):
        bt.linear(bt.ones(2, 3), bt.ones(4, 5))


def test_reshape_to_a_wrong_size_shows_shape_and_element_count() -> None:
    with pytest.raises(ShapeError, match=r"reshape: shape \[4, 2\] is invalid for a tensor of 6 elements"):
        bt.ones(2, 3).reshape(4, 2)


def test_cat_mismatch_names_the_tensor_and_both_shapes() -> None:
    with pytest.raises(ShapeError, match=r"cat: tensor 1 has shape \[2, 4\], which does not match \[2, 3\] "
                                         r"outside dim 0"):
        bt.cat([bt.ones(2, 3), bt.ones(2, 4)])


def test_device_mismatch_shows_both_devices(second_device: bt.Device) -> None:
    with pytest.raises(DeviceMismatchError, match="add: tensors are on different devices: cpu and host2:0"):
        bt.ones(2) + bt.ones(2, device=second_device)
    with pytest.raises(DeviceMismatchError, match="matmul: other is on cpu, input on host2:0; expected both on one "
                                                  "device"):
        bt.ones(2, 2, device=second_device) @ bt.ones(2, 2)


def test_an_unknown_device_lists_the_installed_backends() -> None:
    with pytest.raises(TensorValueError, match=r"device: unknown device type 'tpu'; installed: cpu \(blutrain-tensor"):
        bt.device("tpu")


def test_a_device_index_that_does_not_exist_is_an_error() -> None:
    with pytest.raises(TensorValueError, match="device: 'cpu:1' does not exist; cpu has 1 device"):
        bt.device("cpu:1")


def test_a_missing_kernel_names_op_device_dtype_and_providers() -> None:
    with pytest.raises(KernelNotFoundError, match=r"no kernel for op 'abs' on device 'cpu' with dtype bool; 'abs' "
                                                  r"exists for: cpu/bfloat16.*kernel providers installed: .*"
                                                  r"blutrain-tensor"):
        bt.abs(bt.tensor([True]))


def test_wrong_argument_types_name_the_argument_and_what_was_received() -> None:
    with pytest.raises(TensorTypeError, match="add: expected a Tensor or a Python bool/int/float, got str"):
        bt.ones(2) + "one"
    with pytest.raises(TensorTypeError, match="where: condition must be a bool Tensor, got float32"):
        bt.where(bt.ones(2), 1.0, 0.0)
    with pytest.raises(TensorTypeError, match="gather: index must be an integer Tensor, got float32"):
        bt.gather(bt.ones(2), 0, bt.ones(2))
    with pytest.raises(TensorTypeError, match="layer_norm: input must be floating, got dtype int64"):
        bt.layer_norm(bt.ones(2, dtype="int64"), 2)
    with pytest.raises(TensorTypeError, match="mean: expected a floating tensor, got dtype int64"):
        bt.ones(2, dtype="int64").mean()


def test_dims_out_of_range_name_the_valid_range() -> None:
    with pytest.raises(TensorValueError, match=r"sum: dim must be in \[-2, 1\], got 2"):
        bt.ones(2, 3).sum(2)
    with pytest.raises(TensorValueError, match=r"dim0: expected a dimension in \[-2, 1\], got 5"):
        bt.ones(2, 3).transpose(5, 0)


def test_index_out_of_range_names_op_argument_expected_range_and_received_value() -> None:
    with pytest.raises(TensorIndexError, match=r"index: index 3 is out of range for dim 0 of size 3: expected an "
                                               r"index in \[-3, 3\)"):
        bt.ones(3)[3]
    with pytest.raises(TensorIndexError, match=r"index: index -4 is out of range for dim 0 of size 3: expected "
                                               r"indices in \[-3, 3\)"):
        bt.ones(3)[bt.tensor([0, -4])]
    with pytest.raises(TensorIndexError, match=r"index_select: index out of range: expected indices in \[0, 2\) for "
                                               r"dim 1 of input \(size 2\), received 7"):
        bt.index_select(bt.ones(3, 2), 1, bt.tensor([0, 7]))
    with pytest.raises(TensorIndexError, match=r"embedding: input out of range: expected indices in \[0, 10\) for "
                                               r"dim 0 of weight \(size 10\), received 10"):
        bt.embedding(bt.tensor([10]), bt.ones(10, 4))
    with pytest.raises(TensorIndexError, match=r"cross_entropy: target out of range: expected class indices in "
                                               r"\[0, 5\) or ignore_index=-100, received 5"):
        bt.cross_entropy(bt.ones(2, 5), bt.tensor([0, 5]))
    with pytest.raises(TensorIndexError, match=r"one_hot: input out of range: expected indices in \[0, 3\) for "
                                               r"num_classes=3, received -1"):
        bt.one_hot(bt.tensor([-1, 2]), 3)


def test_value_errors_name_the_argument_and_the_allowed_values() -> None:
    with pytest.raises(TensorValueError, match=r"dropout: p must be in \[0, 1\], got 1\.5"):
        bt.dropout(bt.ones(2), 1.5)
    with pytest.raises(TensorValueError, match="cross_entropy: reduction must be 'mean', 'sum' or 'none', got 'avg'"):
        bt.cross_entropy(bt.ones(2, 3), bt.tensor([0, 1]), reduction="avg")
    with pytest.raises(TensorValueError, match="arange: step must be non-zero"):
        bt.arange(0, 3, 0)


def test_a_bool_mask_of_the_wrong_shape_shows_both_shapes() -> None:
    with pytest.raises(ShapeError, match=r"a bool mask of shape \[3\] must match the dims it indexes, \[2\]"):
        bt.ones(2, 3)[bt.tensor([True, False, True])]


def test_ragged_nested_lists_are_a_value_error() -> None:
    with pytest.raises(TensorValueError, match="tensor: list data must be rectangular"):
        bt.tensor([[1, 2], [3]])


def test_a_fill_value_that_is_not_a_number_is_a_type_error() -> None:
    with pytest.raises(TensorTypeError, match="full: fill_value must be a Python bool, int or float, got str"):
        bt.full((2,), "x")  # type: ignore[arg-type]


def test_integers_to_negative_integer_powers_are_refused() -> None:
    with pytest.raises(TensorValueError, match="pow: integers to negative integer powers are not allowed"):
        bt.tensor([2]) ** -1
    with pytest.raises(TensorValueError, match="pow: integers to negative integer powers are not allowed"):
        bt.tensor([2]) ** bt.tensor([-1])
    assert (bt.tensor([2.0]) ** -1).tolist() == [0.5]


def test_item_of_a_tensor_with_several_elements_says_so() -> None:
    with pytest.raises(TensorValueError, match=r"item: only a one-element tensor converts to a scalar, got "
                                               r"shape \[2\]"):
        bt.ones(2).item()


@st.composite
def _unbroadcastable(draw: st.DrawFn) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Two shapes that do not broadcast: some aligned dim differs with neither size 1."""
    a = draw(st.lists(st.integers(1, 4), min_size=1, max_size=4))
    b = [draw(st.sampled_from([1, s])) for s in a[len(a) - draw(st.integers(1, len(a))):]]
    i = draw(st.integers(0, len(b) - 1))
    ai = len(a) - len(b) + i
    a[ai] = draw(st.integers(2, 5))
    b[i] = draw(st.integers(2, 5).filter(lambda v: v != a[ai]))
    return tuple(a), tuple(b)


@settings(max_examples=40, deadline=None)
@given(shapes=_unbroadcastable(), op=st.sampled_from(["add", "sub", "mul", "maximum", "lt"]))
def test_elementwise_shapes_that_do_not_broadcast_name_op_and_both_shapes(
        shapes: tuple[tuple[int, ...], tuple[int, ...]], op: str) -> None:
    a, b = shapes
    with pytest.raises(ShapeError, match=re.escape(f"{op}: shapes {list(a)} and {list(b)} cannot be broadcast")):
        getattr(bt, op)(bt.ones(*a), bt.ones(*b))


@settings(max_examples=30, deadline=None)
@given(m=st.integers(1, 4), k=st.integers(1, 6), k2=st.integers(1, 6), n=st.integers(1, 4))
def test_matmul_inner_sizes_that_differ_name_both_shapes_and_sizes(m: int, k: int, k2: int, n: int) -> None:
    if k == k2:
        bt.ones(m, k) @ bt.ones(k2, n)
        return
    with pytest.raises(ShapeError, match=re.escape(f"matmul: shapes {[m, k]} and {[k2, n]} cannot be multiplied "
                                                   f"({k} != {k2})")):
        bt.ones(m, k) @ bt.ones(k2, n)


DeviceCase = Callable[[bt.Device], object]
DEVICE_CASES: dict[str, tuple[DeviceCase, str]] = {
    "linear": (lambda d: bt.linear(bt.ones(2, 3), bt.ones(4, 3, device=d)),
               "linear: weight is on host2:0, input on cpu"),
    "linear/bias": (lambda d: bt.linear(bt.ones(2, 3), bt.ones(4, 3), bt.ones(4, device=d)),
                    "linear: bias is on host2:0, input on cpu"),
    "embedding": (lambda d: bt.embedding(bt.tensor([1]), bt.ones(3, 2, device=d)),
                  "embedding: input is on cpu, weight on host2:0"),
    "cross_entropy": (lambda d: bt.cross_entropy(bt.ones(2, 3), bt.tensor([1, 0], device=d)),
                      "cross_entropy: target is on host2:0, input on cpu"),
    "layer_norm": (lambda d: bt.layer_norm(bt.ones(2, 3), 3, bt.ones(3, device=d)),
                   "layer_norm: weight is on host2:0, input on cpu"),
    "sdpa": (lambda d: bt.scaled_dot_product_attention(bt.ones(2, 3), bt.ones(2, 3, device=d), bt.ones(2, 3)),
             "scaled_dot_product_attention: key is on host2:0, query on cpu"),
    "gather": (lambda d: bt.gather(bt.ones(2), 0, bt.tensor([0], device=d)),
               "gather: index is on host2:0, input on cpu"),
}


@pytest.mark.parametrize("case", sorted(DEVICE_CASES))
def test_arguments_on_different_devices_name_both_arguments_and_devices(second_device: bt.Device, case: str) -> None:
    fn, message = DEVICE_CASES[case]
    with pytest.raises(DeviceMismatchError, match=re.escape(message)):
        fn(second_device)


DTYPE_CASES: dict[str, tuple[Callable[[], object], str]] = {
    "linear": (lambda: bt.linear(bt.ones(2, 3, dtype="int64"), bt.ones(4, 3)),
               "linear: weight has dtype float32, input has int64; expected the same dtype"),
    "linear/bias": (lambda: bt.linear(bt.ones(2, 3), bt.ones(4, 3), bt.ones(4, dtype="float64")),
                    "linear: bias has dtype float64, input has float32; expected the same dtype"),
    "layer_norm": (lambda: bt.layer_norm(bt.ones(2, 3), 3, bt.ones(3, dtype="float64")),
                   "layer_norm: weight has dtype float64, input has float32"),
    "softmax": (lambda: bt.softmax(bt.ones(2, dtype="int64"), 0),
                "softmax: expected a floating tensor, got dtype int64"),
    "embedding": (lambda: bt.embedding(bt.ones(2), bt.ones(3, 2)),
                  "embedding: input must be an integer Tensor, got float32"),
    "cross_entropy/input": (lambda: bt.cross_entropy(bt.ones(2, 3, dtype="int64"), bt.tensor([0, 1])),
                            "cross_entropy: input must be floating, got dtype int64"),
    "cross_entropy/target": (lambda: bt.cross_entropy(bt.ones(2, 3), bt.ones(2)),
                             "cross_entropy: target must be an integer Tensor of class indices, got float32"),
}


@pytest.mark.parametrize("case", sorted(DTYPE_CASES))
def test_arguments_of_the_wrong_dtype_name_op_argument_expected_and_received(case: str) -> None:
    fn, message = DTYPE_CASES[case]
    with pytest.raises(TensorTypeError, match=re.escape(message)):
        fn()
