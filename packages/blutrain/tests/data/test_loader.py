"""TokenLoader: validation up front, llm.c batches, seeded shard order, rank slices, resume."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from blutrain.data import LoaderError, ShardError, TokenLoader, write_shard

B, T = 2, 4
STEP = B * T  # tokens one rank reads per step (plus one for the shifted targets)
SPAN = 4_000  # token ids of shard i start at i*SPAN (shards here are shorter than that)


def _shards(directory: Path, lengths: list[int], prefix: str = "train") -> list[np.ndarray]:
    """Shards whose tokens are all distinct (shard i holds i*10000 + arange), so any token tells
    exactly where it was read from."""
    directory.mkdir(parents=True, exist_ok=True)
    contents = []
    for i, n in enumerate(lengths):
        tokens = (i * SPAN + np.arange(n)).astype(np.int64)
        write_shard(directory / f"{prefix}_{i:06d}.bin", tokens)
        contents.append(tokens)
    return contents


def _take(loader: TokenLoader, n: int) -> list[tuple[np.ndarray, np.ndarray]]:
    return [loader.next_batch() for _ in range(n)]


def test_batches_are_int64_of_shape_batch_by_seq(tmp_path: Path) -> None:
    _shards(tmp_path, [100])
    x, y = TokenLoader(tmp_path, B, T).next_batch()
    assert x.shape == y.shape == (B, T)
    assert x.dtype == y.dtype == np.int64


def test_y_is_x_shifted_by_one_from_contiguous_tokens(tmp_path: Path) -> None:
    (tokens,) = _shards(tmp_path, [100])
    x, y = TokenLoader(tmp_path, B, T).next_batch()
    np.testing.assert_array_equal(x.ravel(), tokens[:STEP])
    np.testing.assert_array_equal(y.ravel(), tokens[1 : STEP + 1])


def test_position_advances_by_batch_tokens_times_world_size(tmp_path: Path) -> None:
    (tokens,) = _shards(tmp_path, [100])
    loader = TokenLoader(tmp_path, B, T, rank=1, world_size=3)
    first, second = _take(loader, 2)
    np.testing.assert_array_equal(first[0].ravel(), tokens[STEP : 2 * STEP])
    np.testing.assert_array_equal(second[0].ravel(), tokens[4 * STEP : 5 * STEP])
    assert loader.position == 2 * 3 * STEP


def test_shard_is_left_when_the_next_step_does_not_fit(tmp_path: Path) -> None:
    _shards(tmp_path, [2 * STEP + 1, 2 * STEP + 1])
    loader = TokenLoader(tmp_path, B, T)
    first_shard = loader.current_shard
    _take(loader, 2)
    assert loader.current_shard != first_shard
    assert loader.position == 0


def test_shard_order_is_the_philox_permutation_of_the_seed(tmp_path: Path) -> None:
    _shards(tmp_path, [STEP + 1] * 6)
    loader = TokenLoader(tmp_path, B, T, seed=42)
    visited = [int(loader.next_batch()[0][0, 0]) // SPAN for _ in range(6)]
    expected = np.random.Generator(np.random.Philox(42)).permutation(6)
    assert visited == expected.tolist()


def test_each_epoch_visits_every_shard_once(tmp_path: Path) -> None:
    _shards(tmp_path, [STEP + 1] * 5)
    loader = TokenLoader(tmp_path, B, T, seed=3)
    for epoch in range(3):
        assert loader.epoch == epoch
        visited = [int(loader.next_batch()[0][0, 0]) // SPAN for _ in range(5)]
        assert sorted(visited) == list(range(5))


def test_each_epoch_shuffles_the_shards_anew(tmp_path: Path) -> None:
    _shards(tmp_path, [STEP + 1] * 8)
    loader = TokenLoader(tmp_path, B, T, seed=0)
    orders = [tuple(int(loader.next_batch()[0][0, 0]) // SPAN for _ in range(8)) for _ in range(3)]
    assert len(set(orders)) == 3


def test_same_seed_gives_the_same_batches(tmp_path: Path) -> None:
    _shards(tmp_path, [3 * STEP + 1, 2 * STEP + 5, 4 * STEP + 1])
    a, b = TokenLoader(tmp_path, B, T, seed=7), TokenLoader(tmp_path, B, T, seed=7)
    for (xa, ya), (xb, yb) in zip(_take(a, 25), _take(b, 25), strict=True):
        np.testing.assert_array_equal(xa, xb)
        np.testing.assert_array_equal(ya, yb)


def test_different_seeds_give_different_shard_orders(tmp_path: Path) -> None:
    _shards(tmp_path, [STEP + 1] * 8)
    orders = [
        [int(loader.next_batch()[0][0, 0]) // SPAN for _ in range(8)]
        for loader in (TokenLoader(tmp_path, B, T, seed=0), TokenLoader(tmp_path, B, T, seed=1))
    ]
    assert orders[0] != orders[1]


def test_ranks_read_disjoint_slices_that_together_are_what_one_process_reads(tmp_path: Path) -> None:
    world = 3
    # Lengths that hold whole multi-rank steps, so both loaders leave each shard at the same token.
    _shards(tmp_path, [2 * world * STEP + 1, 3 * world * STEP + 1, world * STEP + 1])
    steps = 2 * (2 + 3 + 1)  # two epochs
    single = _take(TokenLoader(tmp_path, B, T, seed=5), world * steps)
    ranks = [
        _take(TokenLoader(tmp_path, B, T, seed=5, rank=r, world_size=world), steps) for r in range(world)
    ]
    for step in range(steps):
        xs = [ranks[r][step][0] for r in range(world)]
        assert len(np.unique(np.concatenate([x.ravel() for x in xs]))) == world * STEP
        for r in range(world):
            np.testing.assert_array_equal(xs[r], single[world * step + r][0])
            np.testing.assert_array_equal(ranks[r][step][1], single[world * step + r][1])


@pytest.mark.parametrize("stop_after", [0, 1, 3, 4, 9, 17])
def test_resumed_loader_continues_with_the_batch_an_uninterrupted_one_produces(
    tmp_path: Path, stop_after: int
) -> None:
    # 3 + 2 + 4 = 9 steps an epoch, so the stops fall inside a shard, on shard and on epoch borders.
    _shards(tmp_path, [3 * 2 * STEP + 1, 2 * 2 * STEP + 7, 4 * 2 * STEP + 1])
    uninterrupted = _take(TokenLoader(tmp_path, B, T, seed=11, rank=1, world_size=2), stop_after + 6)
    first = TokenLoader(tmp_path, B, T, seed=11, rank=1, world_size=2)
    _take(first, stop_after)
    saved = json.loads(json.dumps(first.state_dict()))
    resumed = TokenLoader(tmp_path, B, T, seed=11, rank=1, world_size=2)
    resumed.load_state_dict(saved)
    for (x, y), (ex, ey) in zip(_take(resumed, 6), uninterrupted[stop_after:], strict=True):
        np.testing.assert_array_equal(x, ex)
        np.testing.assert_array_equal(y, ey)


def test_state_dict_is_small_json(tmp_path: Path) -> None:
    _shards(tmp_path, [100] * 3)
    state = TokenLoader(tmp_path, B, T).state_dict()
    assert json.loads(json.dumps(state)) == state
    assert {"epoch", "shard_index", "position", "seed"} <= state.keys()
    assert len(json.dumps(state)) < 500


def test_load_state_dict_rejects_a_state_of_other_settings(tmp_path: Path) -> None:
    _shards(tmp_path, [100])
    state = TokenLoader(tmp_path, B, T).state_dict()
    with pytest.raises(LoaderError, match=r"saved batch_size is 2 but this loader's is 3"):
        TokenLoader(tmp_path, 3, T).load_state_dict(state)


def test_load_state_dict_rejects_a_state_of_other_shards(tmp_path: Path) -> None:
    _shards(tmp_path / "a", [100])
    _shards(tmp_path / "b", [101])
    state = TokenLoader(tmp_path / "a", B, T).state_dict()
    with pytest.raises(LoaderError, match=r"saved shards_digest"):
        TokenLoader(tmp_path / "b", B, T).load_state_dict(state)


def test_load_state_dict_rejects_a_position_past_the_shard(tmp_path: Path) -> None:
    _shards(tmp_path, [3 * STEP + 1])
    loader = TokenLoader(tmp_path, B, T)
    state = loader.state_dict() | {"position": 3 * STEP}
    with pytest.raises(LoaderError, match=r"position must be a multiple of 8 .* 25 tokens, received 24"):
        loader.load_state_dict(state)


def test_iteration_yields_the_same_batches_as_next_batch(tmp_path: Path) -> None:
    _shards(tmp_path, [3 * STEP + 1, 2 * STEP + 1])
    expected = _take(TokenLoader(tmp_path, B, T), 7)
    for (x, y), (ex, ey) in zip(TokenLoader(tmp_path, B, T), expected, strict=False):
        np.testing.assert_array_equal(x, ex)
        np.testing.assert_array_equal(y, ey)


def test_directory_gives_all_bin_files_sorted(tmp_path: Path) -> None:
    _shards(tmp_path, [100, 100, 100])
    (tmp_path / "notes.txt").write_text("not a shard")
    assert [p.name for p in TokenLoader(tmp_path, B, T).shards] == [f"train_{i:06d}.bin" for i in range(3)]


def test_glob_pattern_selects_matching_shards(tmp_path: Path) -> None:
    _shards(tmp_path, [100, 100])
    _shards(tmp_path, [100], prefix="val")
    loader = TokenLoader(tmp_path / "val_*.bin", B, T)
    assert [p.name for p in loader.shards] == ["val_000000.bin"]


def test_directory_holding_train_and_val_shards_is_refused(tmp_path: Path) -> None:
    _shards(tmp_path, [100])
    _shards(tmp_path, [100], prefix="val")
    with pytest.raises(LoaderError, match=r"both train_\*\.bin and val_\*\.bin.*train_\*\.bin"):
        TokenLoader(tmp_path, B, T)


def test_empty_directory_is_an_error_naming_it(tmp_path: Path) -> None:
    with pytest.raises(LoaderError, match=rf"{tmp_path} holds no \*\.bin files"):
        TokenLoader(tmp_path, B, T)


def test_pattern_matching_nothing_is_an_error_naming_it(tmp_path: Path) -> None:
    with pytest.raises(LoaderError, match=r"no shard files match .*nothing_\*\.bin"):
        TokenLoader(tmp_path / "nothing_*.bin", B, T)


def test_shard_shorter_than_one_step_is_an_error_naming_it(tmp_path: Path) -> None:
    _shards(tmp_path, [100, 2 * STEP])
    with pytest.raises(LoaderError, match=r"train_000001\.bin: holds 16 tokens, .* = 2\*4\*2\+1 = 17"):
        TokenLoader(tmp_path, B, T, world_size=2)


def test_token_at_or_above_vocab_size_is_an_error_naming_file_id_and_position(tmp_path: Path) -> None:
    tokens = np.zeros(100, dtype=np.int64)
    tokens[37] = 300
    tokens[60] = 256
    write_shard(tmp_path / "a.bin", tokens)
    with pytest.raises(LoaderError, match=r"a\.bin: token id 300 at position 37 .* vocab_size=256"):
        TokenLoader(tmp_path, B, T, vocab_size=256)


def test_tokens_below_vocab_size_pass_the_check(tmp_path: Path) -> None:
    write_shard(tmp_path / "a.bin", np.arange(100) % 256)
    assert TokenLoader(tmp_path, B, T, vocab_size=256).next_batch()[0].max() < 256


def test_malformed_shard_fails_construction_before_any_batch(tmp_path: Path) -> None:
    _shards(tmp_path, [100])
    (tmp_path / "train_000001.bin").write_bytes(b"\x00" * 2000)
    with pytest.raises(ShardError, match=r"train_000001\.bin: wrong magic"):
        TokenLoader(tmp_path, B, T)


def test_rank_outside_the_world_is_rejected(tmp_path: Path) -> None:
    _shards(tmp_path, [100])
    with pytest.raises(LoaderError, match=r"rank must be in \[0, 1\], received 2"):
        TokenLoader(tmp_path, B, T, rank=2, world_size=2)


def test_non_positive_batch_size_is_rejected(tmp_path: Path) -> None:
    _shards(tmp_path, [100])
    with pytest.raises(LoaderError, match=r"batch_size must be a positive integer, received 0"):
        TokenLoader(tmp_path, 0, T)


def _seed_visiting_first(directory: Path, name: str) -> int:
    """A seed whose epoch 0 starts with the shard called ``name``."""
    return next(s for s in range(100) if TokenLoader(directory, B, T, seed=s).current_shard.name == name)


def test_token_range_of_a_later_shard_is_checked_when_the_loader_enters_it(tmp_path: Path) -> None:
    write_shard(tmp_path / "a.bin", np.zeros(2 * STEP + 1, dtype=np.int64))
    bad = np.zeros(2 * STEP + 1, dtype=np.int64)
    bad[5] = 999
    write_shard(tmp_path / "b.bin", bad)
    loader = TokenLoader(tmp_path, B, T, seed=_seed_visiting_first(tmp_path, "a.bin"), vocab_size=256)
    loader.next_batch()
    with pytest.raises(LoaderError, match=r"b\.bin: token id 999 at position 5 .* vocab_size=256"):
        loader.next_batch()


def test_a_failed_shard_check_leaves_the_loader_where_it_was(tmp_path: Path) -> None:
    write_shard(tmp_path / "a.bin", np.zeros(2 * STEP + 1, dtype=np.int64))
    bad = np.zeros(2 * STEP + 1, dtype=np.int64)
    bad[-1] = 256
    write_shard(tmp_path / "b.bin", bad)
    loader = TokenLoader(tmp_path, B, T, seed=_seed_visiting_first(tmp_path, "a.bin"), vocab_size=256)
    loader.next_batch()
    before = loader.state_dict()
    with pytest.raises(LoaderError):
        loader.next_batch()
    assert loader.state_dict() == before


def test_every_shard_header_and_size_is_checked_when_the_loader_is_built(tmp_path: Path) -> None:
    _shards(tmp_path, [100, 100, 100])
    data = (tmp_path / "train_000002.bin").read_bytes()
    (tmp_path / "train_000002.bin").write_bytes(data[:-3])
    with pytest.raises(ShardError, match=r"train_000002\.bin: truncated: header declares 100 tokens"):
        TokenLoader(tmp_path, B, T)


def test_a_shard_that_changes_length_during_training_is_an_error_naming_it(tmp_path: Path) -> None:
    _shards(tmp_path, [2 * STEP + 1, 2 * STEP + 1])
    loader = TokenLoader(tmp_path, B, T)
    other = next(p for p in loader.shards if p != loader.current_shard)
    write_shard(other, np.zeros(5 * STEP, dtype=np.int64))
    with pytest.raises(LoaderError, match=rf"{other.name}: holds 40 tokens now, 17 when the loader was built"):
        _take(loader, 2)


def test_a_directory_named_like_a_shard_is_not_taken_for_one(tmp_path: Path) -> None:
    (tmp_path / "sub.bin").mkdir()
    with pytest.raises(LoaderError, match=rf"{tmp_path} holds no \*\.bin files"):
        TokenLoader(tmp_path, B, T)
    _shards(tmp_path, [100])
    assert [p.name for p in TokenLoader(tmp_path, B, T).shards] == ["train_000000.bin"]


def test_a_glob_matching_only_directories_is_an_error_naming_it(tmp_path: Path) -> None:
    (tmp_path / "d_1.bin").mkdir()
    with pytest.raises(LoaderError, match=r"no shard files match .*d_\*\.bin"):
        TokenLoader(tmp_path / "d_*.bin", B, T)


@pytest.mark.parametrize("vocab_size", [0, 65537, True, 2.5, "256"])
def test_vocab_size_must_be_an_integer_that_uint16_can_hold(tmp_path: Path, vocab_size: object) -> None:
    _shards(tmp_path, [100])
    with pytest.raises(LoaderError, match=rf"vocab_size must be .*received {vocab_size!r}"):
        TokenLoader(tmp_path, B, T, vocab_size=vocab_size)  # type: ignore[arg-type]
