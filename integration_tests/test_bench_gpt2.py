"""tools/bench/gpt2.py on the CPU, BluTrain's side only (no PyTorch in the lock): a model family other than
GPT-2 counts its FLOPs through the model's own declaration, sequential turns build, time and free each
implementation alone, compiled ones first, and --stage-timeout stops an implementation that runs too long. No
test here asserts a time."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

# tools/ is on sys.path through the workspace's pytest config, and not there when the package is installed alone
bench = pytest.importorskip("bench.gpt2", reason="tools/ is not part of this checkout")


def run_bench(out: Path, *argv: str) -> tuple[subprocess.CompletedProcess[str], dict[str, Any]]:
    proc = subprocess.run([sys.executable, str(Path(bench.__file__)), "--device", "cpu", "--model", "llama",
                           "--steps", "2", "--warmup", "1", "--seq-len", "32", "--batch-size", "2", "--out", str(out),
                           *argv], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    return proc, json.loads((out / "bench_gpt2.json").read_text())


def test_another_family_counts_the_flops_its_model_declares(tmp_path: Path) -> None:
    from blutrain.models import model_spec

    _, result = run_bench(tmp_path, "--impl", "blutrain")
    llama = model_spec("llama")
    declared = llama.build(llama.config("tiny")).flops_per_token(32)
    assert result["meta"]["flops_per_token"] == declared
    assert result["meta"]["flops_formula"] == "the model's declared flops_per_token (Model.flops_per_token)"
    assert [(r["impl"], r["steps"]) for r in result["rows"]] == [("blutrain", 2)]


def test_sequential_turns_time_each_implementation_alone_compiled_first(tmp_path: Path) -> None:
    proc, result = run_bench(tmp_path, "--impl", "blutrain,blutrain-compile", "--turns", "sequential")
    assert [(r["impl"], r["steps"], r["error"]) for r in result["rows"]] == [("blutrain-compile", 2, None),
                                                                            ("blutrain", 2, None)]
    assert "2 timed steps of blutrain-compile alone" in proc.stdout and "alternating" not in proc.stdout
    assert result["meta"]["turns"] == "sequential"


def test_remat_compiles_the_step_with_the_rematerialize_pass(tmp_path: Path) -> None:
    _, result = run_bench(tmp_path, "--impl", "blutrain-compile", "--remat")
    assert result["meta"]["hyper"]["remat"] is True
    assert [(r["impl"], r["steps"], r["error"]) for r in result["rows"]] == [("blutrain-compile", 2, None)]
    from blutrain.models import model_spec

    # per block of the tiny Llama: the SwiGLU output, both RMSNorm outputs and the attention output's copy
    assert result["rows"][0]["compile_stats"]["recomputed"] == 4 * model_spec("llama").config("tiny").n_layer



def test_compile_replace_can_swap_the_rematerialize_pass_for_its_activations_only_variant() -> None:
    from bench.gpt2_models import compile_pipeline

    from blutrain.compiler import default_pipeline, passes

    assert compile_pipeline([], True) is None  # no replacement: compile's own remat places the pass
    swapped = compile_pipeline(["rematerialize=rematerialize-activations"], True)
    assert swapped is not None and "rematerialize" not in swapped
    assert swapped.index("rematerialize-activations") == swapped.index("kernel-selection") - 1
    assert set(swapped) <= set(passes().names())  # every name a registered pass
    with pytest.raises(SystemExit, match="--compile-replace: expected OLD=NEW with OLD one of"):
        compile_pipeline(["rematerialize=rematerialize-activations"], None)  # without --remat it is not there
    assert "rematerialize" not in default_pipeline()


def test_an_implementation_past_its_stage_timeout_is_stopped_with_an_error_naming_it() -> None:
    expected = "blutrain-compile's build and warm-up ran past --stage-timeout 0.05 s"
    with pytest.raises(bench.StageTimeoutError, match=expected), \
            bench.stage_deadline(0.05, "blutrain-compile's build and warm-up"):
        while True:  # a compile that never ends
            time.sleep(0.01)


def test_a_stage_within_its_timeout_leaves_no_alarm_behind() -> None:
    before = signal.getsignal(signal.SIGALRM)
    with bench.stage_deadline(30.0, "torch's timed steps"):
        pass
    assert signal.getitimer(signal.ITIMER_REAL) == (0.0, 0.0)
    assert signal.getsignal(signal.SIGALRM) is before
