"""``reduce=ordered`` on 2 and 4 MPI ranks against one process accumulating the ranks' micro-batches
(``dist_workers/ordered_reduce.py``): each bucket summed over the ranks in rank order makes a float32 run — eager and
compiled, ddp with clipping and AdamW — bit-identical to the single process, whose gradient accumulation adds the
micro-batches' gradients in that order. Under bf16 autocast (float32 weights and gradients) the same holds: the
reduction sees float32 gradients either way. ZeRO stages 1-3 reduce-scatter in rank order and train bit-identically
too (without clipping: ZeRO sums the gradient norm over its shards). Buckets whose sizes are not multiples of the
group size are padded."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from ranks import run_worker

WORKER = Path(__file__).parent / "dist_workers" / "ordered_reduce.py"
RUNS = ["ddp-fp32-eager", "ddp-fp32-compiled", "ddp-bf16-eager", "ddp-bf16-compiled", "zero1-fp32-eager",
        "zero2-fp32-eager", "zero2-fp32-compiled", "zero3-fp32-eager"]


@pytest.fixture(scope="module", params=[2, 4], ids=["2ranks", "4ranks"])
def results(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    ranks = request.param
    out = tmp_path_factory.mktemp(f"ordered{ranks}") / "results.json"
    return run_worker(ranks, WORKER, out, *RUNS, rank_timeout=120, timeout=300)


@pytest.mark.parametrize("run", RUNS)
def test_ordered_reduction_trains_bit_identically_to_one_process_accumulating(results: dict[str, Any],
                                                                              run: str) -> None:
    got = results[run]
    parallel, alone = got["parallel"]["losses"], got["alone"]["losses"]
    assert len(parallel) == len(alone) > 1 and all(len(step) == results["world"] for step in parallel)
    assert parallel == alone  # every micro-batch's loss of every step, exactly
    assert got["params_differing"] == 0 and got["param_max_diff"] == 0.0, got


@pytest.mark.parametrize("run", [r for r in RUNS if r.endswith("compiled")])
def test_the_compiled_step_holds_two_collectives_a_bucket(results: dict[str, Any], run: str) -> None:
    """ddp: an all-to-all and an all-gather per bucket; ZeRO-2: an all-to-all, and the parameters' all-gather."""
    parallel = results[run]["parallel"]
    assert parallel["traces"] == 1
    assert parallel["collectives"] == 2 * len(parallel["buckets"])


@pytest.mark.parametrize("run", ["ddp-fp32-eager", "zero2-fp32-eager"])
def test_buckets_not_divisible_by_the_group_size_are_padded(results: dict[str, Any], run: str) -> None:
    buckets = results[run]["parallel"]["buckets"]
    assert any(n % results["world"] for n in buckets), buckets  # so the runs above went through padding
