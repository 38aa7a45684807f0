"""The rank-ordered reduction's local parts: the sum in rank order (as one process accumulates, add by add), the
padding to whole chunks, the refusal of unknown reductions, and the three steps through a group of one.
Multi-rank runs against one process: integration_tests/test_dist_ordered.py."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import blutrain.tensor as bt
from blutrain.dist import (
    GRAD_REDUCTIONS,
    DistArgumentError,
    OrderedReduction,
    ProcessGroup,
    check_reduction,
    ordered_reduce_scatter,
    padded_numel,
    rank_ordered_sum,
)


def _accumulated(blocks: np.ndarray, size: int) -> np.ndarray:
    """What one process's gradient accumulation computes: ``acc = b0; acc = acc + b1; ...`` in float32."""
    parts = blocks.reshape(size, -1)
    acc = parts[0].copy()
    for part in parts[1:]:
        acc = acc + part  # float32 + float32: one rounding per add, on any CPU
    return acc


@settings(max_examples=40, deadline=None)
@given(size=st.integers(1, 6), chunk=st.integers(1, 40), seed=st.integers(0, 2**31 - 1))
def test_the_sum_adds_the_ranks_blocks_in_rank_order_as_accumulation_does(size: int, chunk: int, seed: int) -> None:
    rng = np.random.default_rng(seed)
    # magnitudes over many octaves: a different order of additions rounds differently
    blocks = (rng.standard_normal(size * chunk) * 10.0 ** rng.integers(-4, 4, size * chunk)).astype(np.float32)
    got = rank_ordered_sum(bt.tensor(blocks), size).numpy()
    np.testing.assert_array_equal(got, _accumulated(blocks, size))
    want = blocks.astype(np.float64).reshape(size, -1).sum(axis=0)  # and it is a sum
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * np.abs(blocks).max())


@pytest.mark.parametrize("size", [1, 2, 4, 8])
def test_the_average_over_a_power_of_two_equals_accumulating_each_block_scaled(size: int) -> None:
    """Dividing the ordered sum by N = 2^k is exact, and equals adding the blocks each scaled by 1/N first: the
    bits of one process that scales each micro-batch's loss by 1/N."""
    rng = np.random.default_rng(size)
    blocks = (rng.standard_normal(size * 50) * 10.0 ** rng.integers(-3, 3, size * 50)).astype(np.float32)
    got = rank_ordered_sum(bt.tensor(blocks), size, op="avg").numpy()
    np.testing.assert_array_equal(got, _accumulated(blocks * np.float32(1 / size), size))


def test_only_sum_and_avg_are_ordered_reductions() -> None:
    with pytest.raises(DistArgumentError, match="rank_ordered_sum: op must be 'sum' or 'avg', got 'max'"):
        rank_ordered_sum(bt.ones(4), 2, op="max")


@pytest.mark.parametrize(("numel", "size", "padded"), [(10, 4, 12), (12, 4, 12), (1, 3, 3), (0, 2, 2), (7, 1, 7)])
def test_a_flat_buffer_is_padded_to_whole_chunks(numel: int, size: int, padded: int) -> None:
    assert padded_numel(numel, size) == padded


def test_an_unknown_reduction_is_refused_naming_the_choices() -> None:
    assert GRAD_REDUCTIONS == ("backend", "ordered")
    assert check_reduction("x", "ordered") == "ordered"
    with pytest.raises(DistArgumentError, match=r"owner: reduce must be one of backend, ordered \(.*\), got 'ring'"):
        check_reduction("owner", "ring")


def test_the_three_steps_in_a_group_of_one_give_the_buffer_back(group_of_one: ProcessGroup) -> None:
    flat = bt.tensor(np.arange(6, dtype=np.float32))
    reduction = OrderedReduction(group_of_one, flat, op="sum")
    assert reduction.reduce().tolist() == list(range(6))
    assert reduction.wait() is flat and flat.tolist() == list(range(6))
    out = bt.zeros(6)
    ordered_reduce_scatter(group_of_one, out, bt.full((6,), 3.0), op="avg")
    assert out.tolist() == [3.0] * 6


def test_a_buffer_that_does_not_split_into_chunks_is_refused(group_of_one: ProcessGroup) -> None:
    with pytest.raises(DistArgumentError, match="flat must be 1-d"):
        OrderedReduction(group_of_one, bt.zeros(2, 3))
    with pytest.raises(DistArgumentError, match="input must be 1-d with 1 × output's elements"):
        ordered_reduce_scatter(group_of_one, bt.zeros(2), bt.zeros(3))
