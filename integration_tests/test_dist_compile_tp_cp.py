"""Compiled tensor- and context-parallel steps on 4 MPI ranks (a 2 × 2 mesh), each run eagerly and through
``blutrain.compiler.compile`` in one launch (``dist_workers/compiled_tp_cp.py``): tp = 2 (synchronous and
async in 3 row blocks), dp = 2 × tp = 2, cp = 2 with ring, all-gather and Ulysses attention, and dp = 2 ×
cp = 2 with ring attention, and cp = 2 × tp = 2 (context parallelism over the tensor-parallel model) with
ring and Ulysses attention; tp and dp × cp (ring) again with the rematerialize pass. The compiled step holds
the mode's collectives as ops of its one program (ring attention's transfers as one ``sendrecv`` each) and
must train exactly as the eager one. (The trainer's ``--compile --parallel tp=2`` and ``cp=2`` cells are in
test_plugin_matrix.py; ddp and zero in test_dist_compile.py.)"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from ranks import assert_trains_as_eager, run_worker

WORKER = Path(__file__).parent / "dist_workers" / "compiled_tp_cp.py"
RUNS = ["tp", "tp-async", "dp-tp", "cp-ring", "cp-allgather", "cp-ulysses", "dp-cp-ring", "tpcp-ring", "tpcp-ulysses",
        "tp+remat", "dp-cp-ring+remat"]


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    out = tmp_path_factory.mktemp("compiled_tp_cp") / "results.json"
    return run_worker(4, WORKER, out, *RUNS, rank_timeout=120, timeout=300)


@pytest.mark.parametrize("run", RUNS)
def test_compiled_step_trains_as_the_eager_step(results: dict[str, Any], run: str) -> None:
    # steps 3-5 replay; a collective left out of the replay, or a buffer read before its collective joined,
    # moves the losses of steps 3-5 by ~1e-3 and the weights by ~1e-2
    assert_trains_as_eager(results[run])


# the fewest collectives a 2-layer step makes: tp: 2 per layer forward and backward, the embedding's, the
# loss's 3 and the norm's; async tp: 3 blocks per fused all-reduce; cp: one transfer or gather per layer each
# way, the loss's and the gradient average's; Ulysses: two all-to-alls per layer each way; cp × tp: both
FEWEST = {"tp": 13, "tp-async": 30, "dp-tp": 14, "cp-ring": 6, "cp-allgather": 6, "cp-ulysses": 10, "dp-cp-ring": 6,
          "tpcp-ring": 19, "tpcp-ulysses": 23, "tp+remat": 13, "dp-cp-ring+remat": 6}


@pytest.mark.parametrize("run", RUNS)
def test_compiled_step_holds_every_collective_in_one_trace(results: dict[str, Any], run: str) -> None:
    compiled = results[run]["compiled"]
    assert compiled["collectives"] >= FEWEST[run]
    assert compiled["traces"] == 1


@pytest.mark.parametrize("run", [r for r in RUNS if r.endswith("+remat")])
def test_the_rematerialize_pass_made_copies_among_the_collectives(results: dict[str, Any], run: str) -> None:
    """Each block's LayerNorm outputs at least are made again before their backward readers (2 blocks), and the
    run trains as eager (the test above): copies read nothing a collective writes in between."""
    assert results[run]["compiled"]["recomputed"] >= 4
    assert results[run.removesuffix("+remat")]["compiled"]["recomputed"] == 0
