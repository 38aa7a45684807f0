"""Compiled data-parallel steps on 2 MPI ranks: ddp (several buckets, and gradient accumulation under
``no_sync``) and ZeRO stages 1-3, each run eagerly and through ``blutrain.compiler.compile`` in one launch
(``dist_workers/compiled_dp.py``). The compiled step holds the mode's collectives as ops of its one program
and must train exactly as the eager one, with the rematerialize pass too; a collective of an undeclared group
inside a compiled function must be refused with its line. (The trainer's ``--compile --parallel`` cells are in
test_plugin_matrix.py.)"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from ranks import assert_trains_as_eager, run_worker

WORKER = Path(__file__).parent / "dist_workers" / "compiled_dp.py"
RUNS = ["ddp", "ddp-accum2", "ddp-bf16-grads", "zero1", "zero1-accum2", "zero2", "zero3", "ddp-accum2+remat",
        "zero3+remat"]


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    out = tmp_path_factory.mktemp("compiled_dp") / "results.json"
    return run_worker(2, WORKER, out, *RUNS, rank_timeout=60, timeout=180)


@pytest.mark.parametrize("run", RUNS)
def test_compiled_step_trains_as_the_eager_step(results: dict[str, Any], run: str) -> None:
    # steps 3-5 replay; the losses of steps 4 and 5 and the final weights follow replayed updates, which a
    # collective left out of the replay moves by ~1e-3 (each rank would step on its own gradients)
    assert_trains_as_eager(results[run])


@pytest.mark.parametrize("run", RUNS)
def test_compiled_step_holds_its_collectives_in_one_trace(results: dict[str, Any], run: str) -> None:
    compiled = results[run]["compiled"]
    assert compiled["collectives"] >= 2  # the gradients' reduction and the clip's norm at least (ddp: 4 buckets)
    assert compiled["traces"] == 1


@pytest.mark.parametrize("run", ["ddp", "ddp-accum2", "zero1", "zero1-accum2", "zero2"])
def test_the_gradient_reductions_are_issued_while_backward_still_runs(results: dict[str, Any], run: str) -> None:
    """Every bucket but the last (the embeddings', final only at the end of backward) is reduced beside the rest
    of backward: its collective is issued before the step's last backward kernel. ZeRO stage 1 too, which
    reduced all of its buckets after backward, at the optimizer's step, before its reductions moved to the
    post-accumulate-grad hooks."""
    assert results[run]["compiled"]["collectives_in_backward"] >= 2


@pytest.mark.parametrize("where", ["traced", "state"])
def test_a_collective_of_an_undeclared_group_is_refused_with_its_line(results: dict[str, Any], where: str) -> None:
    guard = results["guard"]
    message = guard[where]
    assert message is not None, f"compiling a raw all_reduce on a {where} tensor did not raise"
    assert f"compiled_dp.py:{guard['lines'][where]}:" in message
    assert "the collective all_reduce was called while blutrain.compiler traces" in message
    assert "blutrain.dist.traceable" in message


def test_the_rematerialize_pass_makes_each_micro_batch_its_own_copies(results: dict[str, Any]) -> None:
    """ddp with two micro-batches: each block's two LayerNorm outputs are made again before each micro-batch's
    backward (2 blocks × 2 norms × 2 micro-batches), among the buckets' all-reduces, and the step trains as eager
    (above). zero=3 gathers each weight into a buffer that its collectives write again before the backward, so a
    norm there is not made again (the copy would read other memory); it trains as eager all the same."""
    assert results["ddp-accum2+remat"]["compiled"]["recomputed"] == 8
    assert results["ddp-accum2"]["compiled"]["recomputed"] == 0
