"""Sharded state: ranges of flattened tensors, contiguous (ZeRO's buckets) or repeated blocks (tensor
parallelism's column blocks), merged back into full model and optimizer state."""

from __future__ import annotations

import itertools
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import blutrain.tensor as bt
from blutrain.dist import DistArgumentError, StateShard, merge_shards
from blutrain.dist.sharded import piece_blocks, piece_length, range_blocks, range_length

FULL = np.arange(12, dtype=np.float32).reshape(3, 4)


def column_shard(rank: int) -> StateShard:
    """Columns 2r, 2r + 1 of FULL: a block of 2 elements repeated for each of the 3 rows, 4 apart."""
    piece = FULL[:, 2 * rank:2 * rank + 2].reshape(-1)
    groups: list[dict[str, Any]] = [{"lr": 0.1, "params": ["w"]}]
    return StateShard.from_layout(
        {"format": "blutrain-sharded-1", "shapes": {"w": [3, 4]}, "ranges": {"w": [2 * rank, 2 * rank + 2, 4, 3]},
         "param_groups": groups},
        {"w": bt.tensor(piece)}, {"w": {"step": 7, "exp_avg": bt.tensor(-piece)}})


def test_a_repeated_block_lists_its_blocks_outermost_repeat_slowest() -> None:
    assert range_blocks((1, 3, 10, 2, 4, 2)) == [(1, 3), (5, 7), (11, 13), (15, 17)]
    assert range_length((1, 3, 10, 2, 4, 2)) == 8
    assert range_blocks((5, 9)) == [(5, 9)] and range_length((5, 9)) == 4


def test_column_blocks_of_two_ranks_merge_into_the_full_tensor_and_its_optimizer_state() -> None:
    model, optimizer = merge_shards([column_shard(1), column_shard(0)])
    np.testing.assert_array_equal(model["w"].numpy(), FULL)
    assert optimizer["param_groups"] == [{"lr": 0.1, "params": [0]}]
    assert optimizer["state"][0]["step"] == 7
    np.testing.assert_array_equal(optimizer["state"][0]["exp_avg"].numpy(), -FULL)


def test_contiguous_and_repeated_ranges_of_one_tensor_merge_together() -> None:
    top = StateShard({"w": (3, 4)}, {"w": (0, 4)}, {"w": bt.tensor(FULL[0])})
    rest = StateShard({"w": (3, 4)}, {"w": (4, 6, 4, 2)}, {"w": bt.tensor(FULL[1:, :2].reshape(-1))})
    right = StateShard({"w": (3, 4)}, {"w": (6, 8, 4, 2)}, {"w": bt.tensor(FULL[1:, 2:].reshape(-1))})
    model, _ = merge_shards([rest, right, top])
    np.testing.assert_array_equal(model["w"].numpy(), FULL)


def test_a_missing_rank_is_a_gap_named_by_its_first_element() -> None:
    with pytest.raises(DistArgumentError, match=r"the shards of 'w' have a gap at element 2"):
        merge_shards([column_shard(0)])


def test_blocks_held_twice_are_an_overlap() -> None:
    with pytest.raises(DistArgumentError, match=r"the shards of 'w' have overlap"):
        merge_shards([column_shard(0), column_shard(0), column_shard(1)])


@pytest.mark.parametrize(("r", "message"), [
    ((2, 4, 4, 4), r"range \[2, 4, 4, 4\] of 'w' is not inside its 12 elements"),
    ((2, 4, 4), r"must be \[start, stop\] followed by \[step, count\] pairs"),
    ((2, 4, 4, 0), r"must be \[start, stop\] followed by \[step, count\] pairs"),
])
def test_a_range_outside_the_tensor_or_malformed_is_refused(r: tuple[int, ...], message: str) -> None:
    shard = StateShard({"w": (3, 4)}, {"w": r}, {"w": bt.zeros(6)})
    with pytest.raises(DistArgumentError, match=message):
        shard.check()


def test_a_piece_must_have_the_length_of_its_range() -> None:
    shard = StateShard({"w": (3, 4)}, {"w": (0, 2, 4, 3)}, {"w": bt.zeros(2)})
    with pytest.raises(DistArgumentError, match=r"'w' must hold a 1-D piece of 6 elements .* got \[2\]"):
        shard.check()


# ------------------------------------------------------------------------- windows: nested shards


def column_windows(rank: int, cuts: list[int]) -> list[StateShard]:
    """Rank ``rank``'s column block of FULL (its piece: 6 elements) cut at ``cuts`` into windows, one shard each
    (as ZeRO's ranks cut a tensor-parallel block)."""
    piece = FULL[:, 2 * rank:2 * rank + 2].reshape(-1)
    bounds = [0, *cuts, piece.size]
    r = (2 * rank, 2 * rank + 2, 4, 3)
    groups: list[dict[str, Any]] = [{"lr": 0.1, "params": ["w"]}]
    return [StateShard({"w": (3, 4)}, {"w": r}, {"w": bt.tensor(piece[lo:hi])},
                       {"w": {"step": 7, "exp_avg": bt.tensor(-piece[lo:hi])}}, groups, {"w": (lo, hi)})
            for lo, hi in itertools.pairwise(bounds) if lo < hi]


def test_a_window_holds_the_blocks_of_its_part_of_the_piece() -> None:
    r = (1, 3, 10, 2, 4, 2)  # blocks (1, 3), (5, 7), (11, 13), (15, 17): a piece of 8
    assert piece_blocks(r, (1, 6)) == [(2, 3), (5, 7), (11, 13)]
    assert piece_blocks(r, (2, 4)) == [(5, 7)] and piece_length(r, (2, 4)) == 2
    assert piece_blocks(r) == range_blocks(r) and piece_length(r) == 8


@settings(max_examples=40, deadline=None)
@given(st.lists(st.integers(1, 5), max_size=4, unique=True), st.lists(st.integers(1, 5), max_size=4, unique=True))
def test_windows_of_every_rank_s_block_merge_into_the_full_state(cuts0: list[int], cuts1: list[int]) -> None:
    shards = [*column_windows(0, sorted(cuts0)), *column_windows(1, sorted(cuts1))]
    model, optimizer = merge_shards(shards[::-1])
    np.testing.assert_array_equal(model["w"].numpy(), FULL)
    np.testing.assert_array_equal(optimizer["state"][0]["exp_avg"].numpy(), -FULL)


def test_a_layout_with_windows_is_format_2_and_reads_back() -> None:
    shard = column_windows(1, [4])[0]
    layout = shard.layout()
    assert layout["format"] == "blutrain-sharded-2" and layout["windows"] == {"w": [0, 4]}
    again = StateShard.from_layout(layout, shard.params, shard.optimizer)
    assert again.windows == {"w": (0, 4)} and again.length("w") == 4
    assert column_shard(0).layout()["format"] == "blutrain-sharded-1"  # no windows: readable by older readers


def test_a_missing_window_is_a_gap() -> None:
    # rank 1's first window (its elements 2, 3 and 6 of FULL) is missing
    with pytest.raises(DistArgumentError, match=r"the shards of 'w' have a gap at element 2"):
        merge_shards([*column_windows(0, [3]), column_windows(1, [3])[1]])


@pytest.mark.parametrize(("window", "message"), [((4, 9), r"window \[4, 9\] of 'w' is not inside the 6 elements"),
                                                 ((3, 3), r"window \[3, 3\] of 'w' is not inside")])
def test_a_window_outside_its_range_is_refused(window: tuple[int, int], message: str) -> None:
    layout = {"format": "blutrain-sharded-2", "shapes": {"w": [3, 4]}, "ranges": {"w": [0, 2, 4, 3]},
              "windows": {"w": list(window)}, "param_groups": []}
    with pytest.raises(DistArgumentError, match=message):
        StateShard.from_layout(layout, {"w": bt.zeros(max(window[1] - window[0], 1))}, {})
