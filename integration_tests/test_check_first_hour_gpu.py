"""tools/check_first_hour_gpu.py: the parts that need no GPU.

The dead-rank check runs for real on the CPU (two MPI ranks training a tiny GPT with ddp, one killed with
SIGKILL); the out-of-memory check's reading of the command's error line is checked against the message a real
allocator (blutrain.alloc on host memory with a limit) and the trainer's wrapper produce.
"""

from __future__ import annotations

from pathlib import Path

import check_first_hour_gpu as check
import pytest

import blutrain.alloc as ba
from blutrain.cli.user_errors import user_error_message
from blutrain.train.errors import step_out_of_memory


def _allocator_out_of_memory() -> MemoryError:
    allocator = ba.CachingAllocator(ba.HostProvider(limit=1 << 20))
    with pytest.raises(MemoryError) as caught:
        allocator.malloc(4 << 20)
    return caught.value


def test_the_out_of_memory_line_of_blutrain_train_says_what_was_asked_held_and_to_try() -> None:
    error = step_out_of_memory(_allocator_out_of_memory(), step=3, batch_size=64, seq_len=1024, device="cuda:0")
    line = f"blutrain train: error: {user_error_message(error)}"
    assert check.error_line(line + "\n") == (line, "")
    assert check.out_of_memory_problems(line) == []
    assert check.out_of_memory_problems("blutrain train: error: CUDA error") == [
        "what was asked", "what is held", "what to try", "that it is out of memory"]


def test_a_traceback_or_several_lines_are_not_an_error_line() -> None:
    assert check.error_line("Traceback (most recent call last):\n  x\nMemoryError\n")[0] is None
    assert check.error_line("one\ntwo\n") == (None, "2 lines on stderr, expected one")


def test_the_dead_rank_check_passes_on_the_cpu(tmp_path: Path) -> None:
    (tmp_path / "quick.toml").write_text(check.QUICK)
    result = check.check_dead_rank(tmp_path, "cpu", "mpi", timeout=30, grace=2,
                                   model=("--preset", "tiny", "--batch-size", "2", "--seq-len", "32"))
    assert result.status == "PASS", result.detail
    assert "rank 1" in result.check


def test_metrics_need_an_mfu_and_a_peak_on_every_step() -> None:
    good = [{"step": 1, "mfu": 0.31, "mem_peak_bytes": 7 << 30}, {"step": 2, "mfu": 0.42, "mem_peak_bytes": 7 << 30}]
    assert check.metrics_problems(good) == []
    assert len(check.metrics_problems([{"step": 1, "loss": 5.0}])) == 2  # a CPU row has neither
    assert len(check.metrics_problems([{"step": 1, "mfu": 1.7, "mem_peak_bytes": 1}])) == 1
    assert len(check.metrics_problems([])) == 2


def test_the_table_has_one_row_per_check() -> None:
    text = check.table([check.Result("a", "PASS", "fine"), check.Result("b check", "SKIP", "no GPU")])
    assert text.splitlines()[2:] == ["a        PASS    fine", "b check  SKIP    no GPU"]
