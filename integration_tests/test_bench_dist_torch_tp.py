"""tools/bench/dist.py's ``--torch-modes tp``: PyTorch's own tensor parallelism (tools/bench/dist_torch_tp.py) on
2 gloo CPU ranks trains tools/bench/gpt2.py's GPT-2 on the one-rank run's rows and gives its losses. Needs PyTorch
(the benchmarks use an installed one, outside the workspace's lock: PYTHONPATH); skipped without it."""

from __future__ import annotations

import importlib
import importlib.util
import json
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest

bench = pytest.importorskip("bench.dist", reason="tools/ is not part of this checkout")
tp_plan = pytest.importorskip("bench.dist_torch_tp")
pytestmark = pytest.mark.skipif(importlib.util.find_spec("torch") is None,
                                reason="PyTorch is not installed (put one on PYTHONPATH to run these)")

# float32 on the CPU: the 2-rank step differs from the 1-rank one by the order of its sums (the row-parallel
# all-reduce, the sharded GEMMs), a few float32 ulps a step, far below a wrong layout's O(0.1)
LOSS_TOLERANCE = 1e-4


def pytorch() -> Any:
    return importlib.import_module("torch")


def run_bench(out: Path, *argv: str) -> tuple[subprocess.CompletedProcess[str], dict[str, Any]]:
    proc = subprocess.run([sys.executable, str(Path(bench.__file__)), "--device", "cpu", "--out", str(out), *argv],
                          capture_output=True, text=True, timeout=900)
    return proc, json.loads((out / "bench_dist.json").read_text())


def test_pytorch_tp_on_two_ranks_gives_the_one_rank_losses(tmp_path: Path) -> None:
    proc, result = run_bench(tmp_path, "--frameworks", "torch", "--torch-modes", "tp,tp-async", "--stages",
                             "scaling", "--steps", "2")
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    rows = {r["config"]["name"]: r for r in result["rows"]}
    assert list(rows) == ["torch-compiled-single-1gpu", "torch-eager-single-1gpu", "torch-compiled-tp-2gpu",
                          "torch-compiled-tp-async-2gpu", "torch-eager-tp-2gpu", "torch-eager-tp-async-2gpu"]
    for impl in ("compiled", "eager"):
        one, tp = rows[f"torch-{impl}-single-1gpu"], rows[f"torch-{impl}-tp-2gpu"]
        assert one["status"] == "ok" and tp["status"] == "ok", (one["error"], tp["error"])
        assert len(tp["losses"]) == len(one["losses"]) == 5  # 3 warm-up and 2 timed steps, the same rows
        assert tp["losses"] == pytest.approx(one["losses"], abs=LOSS_TOLERANCE)
        assert tp["reference"] == one["config"]["name"] and tp["max_dloss"] <= LOSS_TOLERANCE
        assert tp["efficiency"] == pytest.approx(tp["tokens_per_s"] / (2 * one["tokens_per_s"]))
    # async TP is inductor's pass over CUDA symmetric memory: on the CPU both rows say so and count as no failure
    assert rows["torch-compiled-tp-async-2gpu"]["status"] == "skipped"
    assert "cuda only" in rows["torch-compiled-tp-async-2gpu"]["error"]
    assert "compiled only" in rows["torch-eager-tp-async-2gpu"]["error"]
    text = (tmp_path / "bench_dist.txt").read_text()
    assert "   torch compiled tp on 2: speed-up " in text and "   torch eager tp on 2: speed-up " in text
    assert any(note.startswith("torch tp: parallelize_module over every rank") for note in result["notes"])


# trains tools/bench/gpt2.py's tiny GPT-2 four steps on fixed random rows, parallelized by the tool's plan over the
# ranks torchrun starts (none on one process), and prints its losses as JSON
SEQUENCE_PARALLEL_RUN = textwrap.dedent("""
    import contextlib, json, os, sys
    import torch
    sys.path[:0] = [sys.argv[1], sys.argv[1] + "/bench"]
    from bench import dist_torch_tp
    from bench.gpt2_models import TORCH_MODELS
    from blutrain.models import model_spec

    world = int(os.environ.get("WORLD_SIZE", "1"))
    cfg = model_spec("gpt2").config("tiny", vocab_size=256)
    torch.manual_seed(0)
    model = TORCH_MODELS["gpt2"](cfg)
    if world > 1:
        torch.distributed.init_process_group("gloo")
        tp = dist_torch_tp.tensor_parallel(torch, model, cfg, "gpt2", world, "cpu", 64, sequence_parallel=True)
        context, clip, local = tp.loss_context, tp.clip, tp.local_loss
    else:
        context, local = contextlib.nullcontext, lambda loss: loss
        clip = lambda v: torch.nn.utils.clip_grad_norm_(list(model.parameters()), v)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=True)
    rows = torch.randint(0, 256, (4, 4, 65), generator=torch.Generator().manual_seed(1))
    losses = []
    for batch in rows:
        opt.zero_grad(set_to_none=True)
        with context():
            loss = model(batch[:, :-1].contiguous(), batch[:, 1:].contiguous())
            loss.backward()
        clip(1.0)
        opt.step()
        losses.append(float(local(loss).detach()))
    if int(os.environ.get("RANK", "0")) == 0:
        print(json.dumps(losses))
""")


def test_tp_async_s_sequence_parallel_layout_gives_the_one_rank_losses(tmp_path: Path) -> None:
    """tp-async runs on CUDA only, so its layout (LayerNorms sequence-parallel, the sequence gathered into each
    attention and MLP and reduce-scattered out of it) is checked here eagerly on 2 gloo ranks."""
    script = tmp_path / "train.py"
    script.write_text(SEQUENCE_PARALLEL_RUN)
    tools = str(Path(bench.__file__).resolve().parents[1])

    def losses(*launcher: str) -> list[float]:
        proc = subprocess.run([sys.executable, *launcher, str(script), tools], capture_output=True, text=True,
                              timeout=600)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
        return [float(x) for x in json.loads(proc.stdout.strip().splitlines()[-1])]

    one = losses()
    two = losses("-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2")
    assert len(one) == 4 and two == pytest.approx(one, abs=LOSS_TOLERANCE)


def test_the_fused_qkv_rows_are_ordered_so_each_rank_s_shard_holds_its_heads_q_k_and_v() -> None:
    torch = pytorch()
    c, parts = 8, 2
    linear = torch.nn.Linear(c, 3 * c, dtype=torch.float64)
    x = torch.randn(5, c, dtype=torch.float64)
    q, k, v = linear(x).split(c, dim=1)
    tp_plan.interleave_qkv(torch, linear, parts)
    for rank, shard in enumerate(linear(x).chunk(parts, dim=1)):  # ColwiseParallel's cut of the output rows
        heads = slice(rank * c // parts, (rank + 1) * c // parts)
        for mine, whole in zip(shard.chunk(3, dim=1), (q, k, v), strict=True):
            torch.testing.assert_close(mine, whole[:, heads], rtol=0, atol=0)


def test_one_part_leaves_the_fused_qkv_rows_as_they_are() -> None:
    torch = pytorch()
    linear = torch.nn.Linear(4, 12, dtype=torch.float64)
    before = linear.weight.detach().clone(), linear.bias.detach().clone()
    tp_plan.interleave_qkv(torch, linear, 1)
    assert torch.equal(linear.weight, before[0]) and torch.equal(linear.bias, before[1])


def test_a_family_without_a_plan_is_unavailable_not_a_crash() -> None:
    torch = pytorch()

    class Config:
        n_head, vocab_size = 4, 256

    with pytest.raises(tp_plan.TensorParallelUnavailableError, match="has a plan for gpt2, not for 'llama'"):
        tp_plan.tensor_parallel(torch, torch.nn.Linear(2, 2), Config(), "llama", 2, "cpu", 64, False)
