"""Shared by the compiler's tests: the bit-for-bit comparison of fused results with eager ones."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

_UINT = {2: np.uint16, 4: np.uint32, 8: np.uint64}


def bits(a: Any) -> np.ndarray[Any, Any]:
    """``a``'s elements as unsigned integers of their width (signed zeros and NaN payloads told apart)."""
    a = np.asarray(a)
    return a.view(_UINT[a.dtype.itemsize])


def assert_same_bits(got: Any, expected: Any) -> None:
    got, expected = np.asarray(got), np.asarray(expected)
    assert got.dtype == expected.dtype and got.shape == expected.shape
    # float64 first: a readable report of the values where they differ
    np.testing.assert_array_equal(got.astype(np.float64), expected.astype(np.float64))
    np.testing.assert_array_equal(bits(got), bits(expected))  # and bit for bit


@pytest.fixture(scope="session")
def same_bits() -> Callable[[Any, Any], None]:
    """``same_bits(got, expected)``: equal dtypes, shapes and bits."""
    return assert_same_bits


@pytest.fixture(scope="session")
def as_bits() -> Callable[[Any], np.ndarray[Any, Any]]:
    return bits
