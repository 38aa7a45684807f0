"""HalfPrecision: a half-precision kernel runs in float32 and its outputs are rounded once to the storage dtype."""

from __future__ import annotations

from typing import Any

import ml_dtypes
import numpy as np
import pytest

import blutrain.tensor as bt
from blutrain.tensor.half import HalfPrecision

HOST = HalfPrecision(is_array=lambda v: type(v) is np.ndarray, cast=lambda v, dtype: v.astype(dtype))
HALVES = [np.dtype(np.float16), np.dtype(ml_dtypes.bfloat16)]


@pytest.mark.parametrize("half", HALVES, ids=str)
def test_the_kernel_sees_float32_and_the_result_is_rounded_once(half: np.dtype[Any]) -> None:
    seen: list[np.dtype[Any]] = []

    def add_third(a: Any, b: Any) -> Any:
        seen.extend([a.dtype, b.dtype])
        return a + b / 3

    a = np.array([1.0, 2.5, -7.0], dtype=np.float64).astype(half)
    b = np.array([0.1, 1e-3, 3.0], dtype=np.float64).astype(half)
    out = HOST.in_float32(add_third, bt.as_dtype(half))(a, b)
    assert seen == [np.dtype(np.float32)] * 2
    assert out.dtype == half
    expected = (a.astype(np.float32) + b.astype(np.float32) / 3).astype(half)
    np.testing.assert_array_equal(out.astype(np.float64), expected.astype(np.float64))


def test_kept_outputs_stay_float32_and_the_others_are_rounded() -> None:
    def with_statistic(a: Any) -> tuple[Any, Any]:
        return a * 2, a.mean(keepdims=True)

    a = np.array([1.0, 2.0, 4.0], dtype=np.float16)
    y, mean = HOST.in_float32(with_statistic, bt.float16, keep=(1,))(a)
    assert y.dtype == np.float16 and mean.dtype == np.float32


def test_lists_are_widened_element_by_element_and_other_arguments_pass_unchanged() -> None:
    a = np.ones(2, dtype=ml_dtypes.bfloat16)
    widened = HOST.widen([a, a])
    assert [w.dtype for w in widened] == [np.dtype(np.float32)] * 2
    ints = np.arange(3)
    assert HOST.widen(ints) is ints and HOST.widen(2.5) == 2.5


def test_only_the_backends_arrays_are_cast_and_finish_applies_to_the_rest() -> None:
    other = HalfPrecision(is_array=lambda v: False, cast=lambda v, dtype: v.astype(dtype), finish=np.asarray)
    a = np.ones(2, dtype=np.float16)
    assert other.widen(a) is a
    assert other.narrow(np.float32(1.5), np.dtype(np.float16)).shape == ()
    assert HOST.narrow(np.ones(2, np.float64), np.dtype(np.float16)).dtype == np.float64


def test_the_wrapper_keeps_the_kernels_name() -> None:
    def softmax(a: Any) -> Any:
        return a

    assert HOST.in_float32(softmax, bt.bfloat16).__name__ == "softmax"
