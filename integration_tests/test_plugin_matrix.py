"""The plugin-combination matrix: model family × device backend × optimizer × parallel mode × compile.

Every axis is read from the registries at collection time, so an installed plugin joins the matrix by
being installed: model families from ``blutrain_register_models``, devices from
``blutrain_register_backends``, optimizers from
``blutrain_register_optimizers``, parallel modes from ``blutrain_register_parallel_modes`` (each on 2
ranks), plus the single process; compile is ``eager`` or ``compiled`` (``--compile``). One test per
combination, with an id such as ``llama-cpu-adamw-ddp2-eager``, so ``-k`` picks any slice::

    uv run pytest integration_tests/test_plugin_matrix.py -k "cpu and sgd"
    uv run pytest integration_tests/test_plugin_matrix.py -k "llama and zero2"
    uv run pytest integration_tests/test_plugin_matrix.py -k "llama and stage3"

Each combination trains a tiny model of its family (``dist_workers/matrix_train.py``: the family's
``tiny`` preset made smaller) for 4 steps through ``blutrain.train.Trainer`` (what ``blutrain train``
runs) and must give the losses of ``MODEL-DEVICE-OPTIMIZER-single-eager``, the reference, on the same
tokens: a data-parallel mode (``dim`` "dp", ``--parallel ddp``) gets half of the reference batch on each of
2 ranks; a mode that splits the model or the sequence instead ("tp", "cp") runs as a mesh dimension of 2
(``--parallel tp=2``) and every rank reads the whole batch; compiled gets the reference batch. The
reference itself must change the parameters with the optimizer named. (4 steps: with ``--compile`` step 1
runs eagerly, step 2 is traced and steps 3 and 4 replay the compiled graph; step 4's loss is the first that
depends on an update the replay made, so a replay that left out a collective or an update shows there.)
A parallel mode composes with compile when it declares so (``compiles = True``: ddp, zero, tp and cp,
whose collectives become ops of the compiled step, see ``blutrain.dist.traceable``).
A combination the trainer's configuration refuses (``TrainConfig.validate``: compile with a mode that has
not declared it) is skipped with its message; a device that is installed but not available here (cuda without a GPU) is
skipped, as is a parallel combination on a device with fewer than 2 units.

The selected combinations run in two process launches in all (one single-process, one ``blutrain run -n
2``), each running its combinations one after the other: see ``dist_workers/matrix_train.py``.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import blutrain.tensor as bt
from blutrain.dist import parallel_modes
from blutrain.models import models
from blutrain.optim import optimizers
from blutrain.train import TrainConfig

WORKER = Path(__file__).parent / "dist_workers" / "matrix_train.py"
RANKS = 2
BATCH = 4  # the reference's batch: a "dp" mode gets BATCH // RANKS per rank, other modes BATCH
COMPILE = {"eager": False, "compiled": True}
# ZeRO's stages beyond its default (2), each a cell of its own with AdamW (the stage decides what is sharded:
# optimizer state, gradients, parameters; the optimizer plugin does not change that): ids such as
# ``llama-cuda-adamw-zero2-stage3-compiled``
ZERO_STAGES = ("1", "3")


@dataclass(frozen=True)
class Combo:
    model: str
    device: str
    optimizer: str
    mode: str  # "" for a single process
    compiled: bool
    batch_size: int
    flag: str = ""  # the trainer's --parallel for this mode on RANKS ranks
    skip: str = ""  # why the combination does not run here
    stage: str = ""  # a ZeRO stage other than the default, from ZERO_STAGES

    @property
    def parallel(self) -> str:
        if not self.mode:
            return "single"
        return f"{self.mode}{RANKS}" + (f"-stage{self.stage}" if self.stage else "")

    @property
    def id(self) -> str:
        return (f"{self.model}-{self.device}-{self.optimizer}-{self.parallel}-"
                f"{'compiled' if self.compiled else 'eager'}")

    @property
    def reference(self) -> str:
        return f"{self.model}-{self.device}-{self.optimizer}-single-eager"

    def spec(self) -> dict[str, Any]:
        return {"id": self.id, "model": self.model, "device": self.device, "optimizer": self.optimizer,
                "parallel": self.flag, "compile": self.compiled, "batch_size": self.batch_size}


def _device_skip(device: str, ranks: int) -> str:
    backend = bt.backends().get(device)
    if not backend.is_available():
        return f"device {device!r} is installed but not available on this machine"
    if ranks > 1 and device != "cpu" and backend.device_count() < ranks:
        return f"{ranks} ranks on {device!r} need {ranks} devices, this machine has {backend.device_count()}"
    return ""


def _refusal(flag: str, compiled: bool) -> str:
    """The trainer configuration's own refusal of this combination, if any."""
    try:
        TrainConfig(parallel=flag, compile=compiled).validate()
    except ValueError as exc:
        return f"refused by the trainer: {exc}"
    return ""


def combinations() -> list[Combo]:
    modes = parallel_modes()
    out = []
    for model in models().names():
        for device in bt.backends().names():
            for optimizer in optimizers().names():
                for mode in ["", *modes.names()]:
                    data_parallel = mode == "" or getattr(modes.get(mode), "dim", "") == "dp"
                    batch = BATCH // RANKS if mode and data_parallel else BATCH
                    # a data-parallel mode over every rank ("ddp", "zero": the mode's defaults); a mode that splits
                    # the model or the sequence as a mesh dimension of RANKS ("tp=2"), so every rank reads the batch
                    flag = mode if data_parallel else f"{mode}={RANKS}"
                    stages = ZERO_STAGES if mode == "zero" and optimizer == "adamw" else ()
                    for compiled in COMPILE.values():
                        skip = _device_skip(device, RANKS if mode else 1) or _refusal(flag, compiled)
                        out.append(Combo(model, device, optimizer, mode, compiled, batch, flag, skip))
                        for stage in stages:
                            out.append(Combo(model, device, optimizer, mode, compiled, batch, f"{mode}={stage}",
                                             skip, stage))
    return out


COMBOS = combinations()
BY_ID = {c.id: c for c in COMBOS}


def _launch(specs: list[dict[str, Any]], ranks: int, workdir: Path) -> dict[str, Any]:
    spec_file, out = workdir / f"spec{ranks}.json", workdir / f"results{ranks}.json"
    spec_file.write_text(json.dumps(specs))
    args = [str(WORKER), str(out), str(spec_file)]
    cmd = ([sys.executable, "-m", "blutrain.cli", "run", "-n", str(ranks), "--timeout", "60", "--", *args]
           if ranks > 1 else [sys.executable, *args])
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0 and out.exists(), f"{' '.join(cmd)} failed:\n{proc.stdout}\n{proc.stderr}"
    results: dict[str, Any] = json.loads(out.read_text())
    return results


@pytest.fixture(scope="module")
def results(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Train every selected combination that runs here, and the references they are compared with."""
    selected = [BY_ID[item.callspec.id] for item in request.session.items
                if item.path == Path(__file__) and hasattr(item, "callspec") and item.callspec.id in BY_ID]
    wanted = {c.id: c for c in selected if not c.skip}
    for c in list(wanted.values()):
        wanted.setdefault(c.reference, BY_ID[c.reference])
    workdir = tmp_path_factory.mktemp("matrix")
    single = [c.spec() for c in wanted.values() if not c.mode]
    parallel = [c.spec() for c in wanted.values() if c.mode]
    found: dict[str, Any] = {}
    if single:
        found |= _launch(single, 1, workdir)
    if parallel:
        found |= _launch(parallel, RANKS, workdir)
    return found


def _losses(results: dict[str, Any], combo_id: str) -> list[float]:
    got = results[combo_id]
    assert "error" not in got, f"{combo_id} raised:\n{got['error']}"
    losses: list[float] = got["losses"]
    assert len(losses) == 4 and all(math.isfinite(v) for v in losses), losses
    return losses


@pytest.mark.parametrize("combo", [pytest.param(c, id=c.id, marks=[pytest.mark.skip(reason=c.skip)] if c.skip else [])
                                   for c in COMBOS])
def test_combination_trains_like_the_single_process_eager_run(combo: Combo, results: dict[str, Any]) -> None:
    losses = _losses(results, combo.id)
    got = results[combo.id]
    if combo.id == combo.reference:
        # the reference: the named optimizer plugin's class ran and moved the parameters
        assert got["world"] == 1
        assert got["optimizer_class"] == optimizers().get(combo.optimizer).__name__
        assert got["params_after"] != got["params_before"]
        return
    assert got["world"] == (RANKS if combo.mode else 1)
    # float32 sums in another order (over ranks, or in the compiled graph) move the losses by ~1e-6;
    # a missing gradient average, a wrong shard or a step that did not run moves them by ~1e-2
    np.testing.assert_allclose(losses, _losses(results, combo.reference), rtol=1e-4, atol=0,
                               err_msg=f"{combo.id} against {combo.reference}")


def test_the_matrix_holds_every_registered_plugin_of_each_axis() -> None:
    ids = set(BY_ID)
    for model in models().names():
        for device in bt.backends().names():
            for name in optimizers().names():
                assert f"{model}-{device}-{name}-single-eager" in ids
                assert f"{model}-{device}-{name}-single-compiled" in ids
                for mode in parallel_modes().names():
                    assert f"{model}-{device}-{name}-{mode}{RANKS}-eager" in ids
                    assert f"{model}-{device}-{name}-{mode}{RANKS}-compiled" in ids
    assert "gpt2-cpu-adamw-ddp2-eager" in ids and "llama-cpu-sgd-single-compiled" in ids
    for model in models().names():
        for stage in ZERO_STAGES:
            assert BY_ID[f"{model}-cpu-adamw-zero{RANKS}-stage{stage}-compiled"].flag == f"zero={stage}"


def test_every_built_in_parallel_mode_runs_compiled() -> None:
    """ddp, zero, tp and cp declare how they compose with compile (their collectives are recorded into the
    compiled step), so none of their compiled cells is refused by the trainer."""
    for mode in ("ddp", "zero", "tp", "cp"):
        for model in ("gpt2", "llama"):
            assert BY_ID[f"{model}-cpu-adamw-{mode}{RANKS}-compiled"].skip == ""
