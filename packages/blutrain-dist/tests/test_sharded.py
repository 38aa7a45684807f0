"""Sharded state: ranges of flattened tensors, contiguous (ZeRO's buckets) or repeated blocks (tensor
parallelism's column blocks), merged back into full model and optimizer state."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

import blutrain.tensor as bt
from blutrain.dist import DistArgumentError, StateShard, merge_shards
from blutrain.dist.sharded import range_blocks, range_length

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
