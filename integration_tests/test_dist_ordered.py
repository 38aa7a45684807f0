"""``ddp,reduce=ordered`` on 2 and 4 MPI ranks against one process accumulating the ranks' micro-batches
(``dist_workers/ordered_ddp.py``): each bucket summed over the ranks in rank order makes a float32 run — eager and
compiled, with clipping and AdamW — bit-identical to the single process, whose gradient accumulation adds the
micro-batches' gradients in that order. Buckets whose sizes are not multiples of the group size are padded.
Under bf16 autocast (float32 weights and gradients) the same holds exactly too: the reduction sees float32
gradients either way."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from ranks import run_worker

WORKER = Path(__file__).parent / "dist_workers" / "ordered_ddp.py"
RUNS = ["fp32-eager", "fp32-compiled", "bf16-eager", "bf16-compiled"]


@pytest.fixture(scope="module", params=[2, 4], ids=["2ranks", "4ranks"])
def results(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    ranks = request.param
    out = tmp_path_factory.mktemp(f"ordered{ranks}") / "results.json"
    return run_worker(ranks, WORKER, out, *RUNS, rank_timeout=120, timeout=300)


@pytest.mark.parametrize("run", RUNS)
def test_ordered_ddp_trains_bit_identically_to_one_process_accumulating(results: dict[str, Any], run: str) -> None:
    got = results[run]
    ddp, alone = got["ddp"]["losses"], got["alone"]["losses"]
    assert len(ddp) == len(alone) > 1 and all(len(step) == results["world"] for step in ddp)
    assert ddp == alone  # every micro-batch's loss of every step, exactly
    assert got["params_differing"] == 0 and got["param_max_diff"] == 0.0, got


@pytest.mark.parametrize("run", ["fp32-compiled", "bf16-compiled"])
def test_the_compiled_step_holds_both_collectives_of_every_bucket(results: dict[str, Any], run: str) -> None:
    ddp = results[run]["ddp"]
    assert ddp["traces"] == 1
    assert ddp["collectives"] == 2 * len(ddp["buckets"])  # an all-to-all and an all-gather per bucket


def test_buckets_not_divisible_by_the_group_size_are_padded(results: dict[str, Any]) -> None:
    buckets = results["fp32-eager"]["ddp"]["buckets"]
    assert any(n % results["world"] for n in buckets), buckets  # so the runs above went through padding
