"""Compiled data-parallel steps on 2 (and, where the machine has them, 4) GPUs with the nccl group: the same
ddp and ZeRO runs as test_dist_compile.py (``dist_workers/compiled_dp.py --device cuda``), each eagerly and
through ``blutrain.compiler.compile``. The compiled step must run as one captured CUDA graph holding its
collectives (a DDP bucket's all-reduce on a communication stream under the rest of backward) and train as
the eager step does."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
from ranks import run_worker

WORKER = Path(__file__).parent / "dist_workers" / "compiled_dp.py"
RUNS = ["ddp", "ddp-accum2", "zero1", "zero2", "zero3"]


def _gpus() -> int:
    try:
        from blutrain_backend_cupy import cuda
    except ImportError:
        return 0
    return int(cuda.device_count()) if cuda.is_available() else 0


@pytest.fixture(scope="module", params=[2, 4], ids=["2gpus", "4gpus"])
def results(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    ranks = int(request.param)
    if _gpus() < ranks:
        pytest.skip(f"needs {ranks} NVIDIA GPUs and CuPy")
    out = tmp_path_factory.mktemp(f"compiled_dp_cuda{ranks}") / "results.json"
    return run_worker(ranks, WORKER, out, "--device", "cuda", *RUNS, rank_timeout=120, timeout=400)


@pytest.mark.cuda
@pytest.mark.parametrize("run", RUNS)
def test_compiled_step_is_one_graph_with_its_collectives_and_trains_as_eager(results: dict[str, Any],
                                                                            run: str) -> None:
    got = results[run]
    compiled, eager = got["compiled"], got["eager"]
    assert compiled["captured"], compiled["capture_error"]
    assert compiled["traces"] == 1 and compiled["collectives"] >= 2
    # the same kernels in the same order on the same stream, now inside one graph with the reductions on a
    # communication stream: float32 rounding of the reduction order at most
    np.testing.assert_allclose(compiled["losses"], eager["losses"], rtol=1e-5, atol=0)
    np.testing.assert_allclose(compiled["norms"], eager["norms"], rtol=1e-4, atol=0)
    assert got["param_diff"] < 1e-5
