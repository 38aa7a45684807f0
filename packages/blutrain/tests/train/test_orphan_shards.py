"""Rotation deletes the rank files of rotated sharded checkpoints, never another rank's file of a newer one."""

from __future__ import annotations

from pathlib import Path

from blutrain.train.sharded import remove_orphan_shards


def _touch(directory: Path, *names: str) -> None:
    for name in names:
        (directory / name).write_bytes(b"")


def test_only_rank_files_of_older_steps_without_their_rank0_file_go(tmp_path: Path) -> None:
    _touch(tmp_path, "step_000001.rank1-of-2.safetensors",                      # rotated away: an orphan
           "step_000002.safetensors", "step_000002.rank1-of-2.safetensors",   # kept
           "step_000003.rank1-of-2.safetensors",                              # rank 0 still writing step 3
           "final.rank1-of-2.safetensors")                                    # and the final one
    gone = remove_orphan_shards(tmp_path, below_step=2)
    assert [p.name for p in gone] == ["step_000001.rank1-of-2.safetensors"]
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "final.rank1-of-2.safetensors", "step_000002.rank1-of-2.safetensors", "step_000002.safetensors",
        "step_000003.rank1-of-2.safetensors"]


def test_without_a_bound_every_orphan_goes(tmp_path: Path) -> None:
    _touch(tmp_path, "step_000003.rank1-of-2.safetensors", "final.rank1-of-2.safetensors", "final.safetensors")
    assert [p.name for p in remove_orphan_shards(tmp_path)] == ["step_000003.rank1-of-2.safetensors"]
