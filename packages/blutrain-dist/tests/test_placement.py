"""Placement: where a rank's tensor sits in the single-process state; ``take_range`` cuts it out of the whole
tensor in the range's order, which is the rank's tensor flattened."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import blutrain.tensor as bt
from blutrain.dist import DistArgumentError, Placement, take_range, whole_placements


@settings(max_examples=40, deadline=None)
@given(st.integers(1, 4), st.integers(1, 3), st.integers(1, 3), st.integers(0, 3))
def test_take_range_of_a_column_block_is_the_block_flattened(rows: int, width: int, size: int, seed: int) -> None:
    rank = seed % size
    full = np.random.default_rng(seed).standard_normal((rows, width * size)).astype(np.float32)
    r = (rank * width, (rank + 1) * width, width * size, rows)  # `width` columns, one row apart
    got = take_range(bt.tensor(full), r).numpy()
    np.testing.assert_array_equal(got, full[:, rank * width:(rank + 1) * width].reshape(-1))


def test_a_range_outside_the_tensor_is_refused_naming_it() -> None:
    with pytest.raises(DistArgumentError, match=r"range \[4, 8, 8, 2\] is not inside the 12 elements"):
        take_range(bt.zeros(3, 4), (4, 8, 8, 2))


def test_whole_placements_name_every_tensor_whole_and_saved() -> None:
    w, b = bt.zeros(2, 3), bt.zeros(3)
    got = whole_placements({"w": w, "b": b})
    assert [(p.name, p.shape, p.range, p.saved, p.whole) for p in got] == [
        ("w", (2, 3), (0, 6), True, True), ("b", (3,), (0, 3), True, True)]
    assert got[0].tensor is w
    assert not Placement(w, "w", (2, 6), (0, 3, 6, 2)).whole
