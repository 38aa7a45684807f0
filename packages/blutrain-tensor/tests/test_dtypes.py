"""Dtypes and PyTorch's type promotion (torch.promote_types and the documented result_type rules)."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

import blutrain.tensor as bt
from blutrain.tensor import DType, TensorTypeError, TensorValueError
from blutrain.tensor import dtype as dtypes

b1, u1, i1, i2, i4, i8 = bt.bool_, bt.uint8, bt.int8, bt.int16, bt.int32, bt.int64
f2, bf, f4, f8 = bt.float16, bt.bfloat16, bt.float32, bt.float64
ORDER = (b1, u1, i1, i2, i4, i8, f2, bf, f4, f8)

# PyTorch's promotion lookup table (c10/core/ScalarType.cpp, _promoteTypesLookup), restricted to the
# dtypes BluTrain has: row dtype × column dtype → torch.promote_types(row, column).
TORCH_PROMOTE = (
    #        b1  u1  i1  i2  i4  i8  f2  bf  f4  f8
    (b1, (b1, u1, i1, i2, i4, i8, f2, bf, f4, f8)),
    (u1, (u1, u1, i2, i2, i4, i8, f2, bf, f4, f8)),
    (i1, (i1, i2, i1, i2, i4, i8, f2, bf, f4, f8)),
    (i2, (i2, i2, i2, i2, i4, i8, f2, bf, f4, f8)),
    (i4, (i4, i4, i4, i4, i4, i8, f2, bf, f4, f8)),
    (i8, (i8, i8, i8, i8, i8, i8, f2, bf, f4, f8)),
    (f2, (f2, f2, f2, f2, f2, f2, f2, f4, f4, f8)),
    (bf, (bf, bf, bf, bf, bf, bf, f4, bf, f4, f8)),
    (f4, (f4, f4, f4, f4, f4, f4, f4, f4, f4, f8)),
    (f8, (f8, f8, f8, f8, f8, f8, f8, f8, f8, f8)),
)


@pytest.mark.parametrize(("row", "expected"), TORCH_PROMOTE, ids=[r.name for r, _ in TORCH_PROMOTE])
def test_promote_types_matches_pytorch(row: DType, expected: tuple[DType, ...]) -> None:
    assert tuple(bt.promote_types(row, col) for col in ORDER) == expected


def test_binary_ops_on_dimensioned_tensors_follow_the_table() -> None:
    for a, row in TORCH_PROMOTE:
        for b, want in zip(ORDER, row, strict=True):
            x, y = bt.ones(2, dtype=a), bt.ones(2, dtype=b)
            assert bt.mul(x, y).dtype is want, (a, b)


# Examples of the PyTorch documentation (torch.result_type / "Type promotion" notes).
def test_python_scalars_change_the_dtype_only_when_of_a_higher_category() -> None:
    int_tensor, long_tensor = bt.ones(1, dtype="int32"), bt.ones(1, dtype="int64")
    float_tensor, uint_tensor = bt.ones(1, dtype="float32"), bt.ones(1, dtype="uint8")
    assert bt.result_type(5, 5) is i8
    assert (int_tensor + 5).dtype is i4
    assert (int_tensor + 5.5).dtype is f4  # the default float dtype
    assert (long_tensor * 2.5).dtype is f4
    assert (float_tensor * 2.5).dtype is f4
    assert (bt.ones(1, dtype="float16") * 2.5).dtype is f2
    assert (uint_tensor + 1).dtype is u1
    assert (bt.ones(1, dtype="bool") + 1).dtype is i8
    assert (bt.ones(1, dtype="bool") + True).dtype is b1


def test_zero_dim_tensors_change_the_dtype_only_when_of_a_higher_category() -> None:
    int_tensor, long_zerodim = bt.ones(1, dtype="int32"), bt.tensor(1, dtype="int64")
    assert (int_tensor + long_zerodim).dtype is i4
    assert (bt.ones(1, dtype="float32") + bt.tensor(1.0, dtype="float64")).dtype is f4
    assert (int_tensor + bt.tensor(1.5, dtype="float64")).dtype is f8
    assert (bt.tensor(1, dtype="int32") + bt.tensor(1.0, dtype="float16")).dtype is f2


def test_dimensioned_tensors_of_different_categories_promote_to_the_higher() -> None:
    assert (bt.ones(1, dtype="int64") + bt.ones(1, dtype="int32")).dtype is i8
    assert (bt.ones(1, dtype="bool") + bt.ones(1, dtype="int64")).dtype is i8
    assert (bt.ones(1, dtype="bool") + bt.ones(1, dtype="uint8")).dtype is u1
    assert (bt.ones(1, dtype="float32") + bt.ones(1, dtype="float64")).dtype is f8
    assert bt.add(bt.ones(1, dtype="int64"), bt.ones(1, dtype="float32")).dtype is f4


def test_true_division_of_integers_gives_the_default_float() -> None:
    assert (bt.tensor([3, 4]) / 2).dtype is f4
    np.testing.assert_array_equal((bt.tensor([3, 4]) / 2).numpy(), [1.5, 2.0])


def test_comparisons_give_bool() -> None:
    assert (bt.ones(2, dtype="float16") < 2).dtype is b1


def test_set_default_dtype_changes_factories_and_float_scalars() -> None:
    bt.set_default_dtype(f8)
    try:
        assert bt.zeros(2).dtype is f8
        assert (bt.tensor([1, 2]) * 0.5).dtype is f8
        assert bt.tensor([1.5]).dtype is f8
    finally:
        bt.set_default_dtype(f4)
    assert bt.zeros(2).dtype is f4


def test_set_default_dtype_accepts_only_floating_dtypes() -> None:
    with pytest.raises(TensorTypeError, match=r"must be floating, got blutrain\.int32"):
        bt.set_default_dtype(i4)


def test_dtype_properties() -> None:
    assert [d.itemsize for d in ORDER] == [1, 1, 1, 2, 4, 8, 2, 2, 4, 8]
    assert [d.is_floating for d in ORDER] == [False] * 6 + [True] * 4
    assert (f2, bf, f4, f8) == bt.FLOATING_DTYPES
    assert repr(bt.bfloat16) == "blutrain.bfloat16"


def test_bfloat16_is_stored_through_ml_dtypes() -> None:
    x = bt.tensor([1.0, 2.5], dtype="bfloat16")
    assert x.numpy().dtype == np.dtype(ml_dtypes.bfloat16)
    assert x.tolist() == [1.0, 2.5]


def test_dtypes_are_found_by_name_alias_and_numpy_dtype() -> None:
    assert bt.as_dtype("float") is f4 and bt.as_dtype("half") is f2 and bt.as_dtype("long") is i8
    assert bt.as_dtype(np.dtype(np.int16)) is i2 and bt.as_dtype(np.float64) is f8
    assert bt.float is f4 and bt.double is f8 and bt.long is i8 and bt.bool is b1


def test_an_unknown_dtype_name_lists_the_known_ones() -> None:
    with pytest.raises(TensorTypeError, match="dtype: unknown dtype 'float8'; expected one of bool, uint8"):
        bt.as_dtype("float8")


def test_a_python_int_outside_the_tensors_integer_range_is_an_error_not_a_wrap() -> None:
    with pytest.raises(TensorValueError, match=r"add: the scalar 300 is out of range for a tensor of dtype uint8 "
                                               r"\(\[0, 255\]\)"):
        bt.ones(2, dtype="uint8") + 300


def test_no_silent_coercion_in_ops_that_take_one_dtype() -> None:
    with pytest.raises(TensorTypeError, match="matmul: other has dtype float64, input has float32; expected the "
                                              "same dtype"):
        bt.ones(2, 2) @ bt.ones(2, 2, dtype="float64")
    with pytest.raises(TensorTypeError, match="result type float32 cannot be written into a tensor of dtype "
                                              "int64"):
        bt.ones(2, dtype="int64").add_(bt.ones(2))
    with pytest.raises(TensorTypeError, match=r"fill_: cannot write the float 0\.5 into a tensor of dtype int64"):
        bt.ones(2, dtype="int64").fill_(0.5)


def test_the_dtype_groups_partition_the_dtypes_as_their_names_say() -> None:
    assert tuple(d for d in ORDER if d is not b1) == dtypes.NUMERIC_DTYPES
    assert set(dtypes.FLOATING_DTYPES) | set(dtypes.INTEGER_DTYPES) | {b1} == set(dtypes.ALL_DTYPES)
    assert set(dtypes.HALF_DTYPES) == {f2, bf} <= set(dtypes.FLOATING_DTYPES)
    assert {"float16", "bfloat16", "float32", "float64"} == dtypes.FLOATING_NAMES
    assert {np.dtype(np.float16).name, np.dtype(ml_dtypes.bfloat16).name} == dtypes.HALF_NAMES


@pytest.mark.parametrize("name", sorted(dtypes.DTYPE_NAMES))
def test_every_dtype_name_is_accepted_by_as_dtype_and_by_tensor_to(name: str) -> None:
    x = bt.tensor([1.0, 2.0])
    assert x.to(name).dtype is bt.as_dtype(name)


def test_float_unary_ops_promote_integer_inputs_to_the_default_float() -> None:
    x = bt.tensor([1, 2, 3])
    for op in dtypes.FLOAT_UNARY_OPS:
        assert getattr(bt, op)(x).dtype is bt.get_default_dtype(), op
