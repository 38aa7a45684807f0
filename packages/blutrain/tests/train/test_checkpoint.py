"""Checkpoints: atomic and durable under ``kill -9``, verified on load, never executing code, rotated by
``--keep``, and written asynchronously with the same guarantees."""

from __future__ import annotations

import io
import os
import pickle
import random
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import blutrain.tensor as bt
from blutrain.tensor.plugins import hookimpl
from blutrain.tensor.testing import plugin_registered
from blutrain.train import CheckpointError, CheckpointWriter, TrainConfig, Trainer, load_checkpoint, save_checkpoint
from blutrain.train.checkpoint import STALL_VARIABLE, remove_stale_temporaries, stage_checkpoint

MakeConfig = Callable[..., TrainConfig]


def _state(step: int, n: int = 4) -> dict[str, Any]:
    """Checkpoint arguments whose every tensor holds ``step``: which save a file came from is visible."""
    model = {f"layer{i}.weight": bt.full((n, n), float(step)) for i in range(3)}
    model["ids"] = bt.full((n,), step, dtype="int64")
    optim = {"state": {0: {"step": step, "exp_avg": bt.full((n, n), step / 2)}}, "param_groups": [{"lr": 0.1}]}
    return {"model_state": model, "optimizer_state": optim, "trainer_state": {"step": step},
            "loader_state": {"position": step}, "rng_state": {"cpu": {"seed": 1}}, "config": {"train": {}}}


def _step_of(path: Path) -> int:
    state = load_checkpoint(path)
    step = int(state["trainer"]["step"])
    for t in [*state["model"].values(), state["optimizer"]["state"]["0"]["exp_avg"]]:
        assert np.all(t.numpy() == t.numpy().flat[0]), "a tensor mixes two saves"
    assert float(state["model"]["layer0.weight"].numpy()[0, 0]) == step
    return step


# A child process that saves checkpoints of tensors of ``n`` × ``n`` values (step = its argument, then +1 ...).
_CHILD = textwrap.dedent("""
    import sys
    import blutrain.tensor as bt
    from blutrain.train.checkpoint import CheckpointWriter, save_checkpoint, stage_checkpoint
    path, first, count, n, mode = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), sys.argv[5]
    writer = CheckpointWriter()
    for step in range(first, first + count):
        model = {f"layer{i}.weight": bt.full((n, n), float(step)) for i in range(3)}
        model["ids"] = bt.full((n,), step, dtype="int64")
        optim = {"state": {0: {"step": step, "exp_avg": bt.full((n, n), step / 2)}}, "param_groups": [{"lr": 0.1}]}
        kwargs = dict(model_state=model, optimizer_state=optim, trainer_state={"step": step},
                      loader_state={"position": step}, rng_state={"cpu": {"seed": 1}}, config={"train": {}})
        if mode == "async":
            writer.submit(stage_checkpoint(**kwargs), path)
            writer.wait()
        else:
            save_checkpoint(path, **kwargs)
        print("saved", step, flush=True)
""")


def _child(path: Path, first: int, count: int, n: int, mode: str, env: dict[str, str] | None = None) -> Any:
    return subprocess.Popen([sys.executable, "-c", _CHILD, str(path), str(first), str(count), str(n), mode],
                            stdout=subprocess.PIPE, text=True, env={**os.environ, **(env or {})})


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_kill_9_in_the_middle_of_a_save_leaves_the_previous_checkpoint_loadable(tmp_path: Path, mode: str) -> None:
    path = tmp_path / "ckpt.safetensors"
    save_checkpoint(path, **_state(1))
    marker = tmp_path / "stalled"
    child = _child(path, 2, 1, 512, mode, {STALL_VARIABLE: str(marker)})
    try:
        deadline = time.monotonic() + 60
        while not marker.exists():  # the child writes it with half of the new tensors on disk, then sleeps
            assert child.poll() is None, f"the child exited with {child.returncode} before stalling"
            assert time.monotonic() < deadline, "the child never reached the middle of its save"
            time.sleep(0.01)
        os.kill(child.pid, signal.SIGKILL)
    finally:
        child.kill()
        child.wait()
    assert child.returncode == -signal.SIGKILL
    partial = [p for p in tmp_path.iterdir() if p.name.endswith(".tmp")]
    assert len(partial) == 1 and partial[0].stat().st_size > 0  # the killed save got half way
    assert _step_of(path) == 1
    assert remove_stale_temporaries(tmp_path) == partial and not partial[0].exists()


def test_kill_9_at_random_points_of_repeated_saves_never_breaks_the_checkpoint(tmp_path: Path) -> None:
    path = tmp_path / "ckpt.safetensors"
    rng = random.Random(0)
    for attempt in range(3):
        child = _child(path, 10 * attempt + 1, 10**6, 384, "sync")
        try:
            assert child.stdout is not None
            assert child.stdout.readline().startswith("saved")
            time.sleep(rng.uniform(0.0, 0.15))
            os.kill(child.pid, signal.SIGKILL)
        finally:
            child.kill()
            child.wait()
        assert _step_of(path) >= 10 * attempt + 1


def test_load_names_the_tensor_whose_bytes_fail_their_sha256(tmp_path: Path) -> None:
    path = save_checkpoint(tmp_path / "c.safetensors", **_state(3))
    raw = bytearray(path.read_bytes())
    header_end = 8 + int.from_bytes(raw[:8], "little")
    raw[header_end + 4 * 16 + 2] ^= 0x10  # a byte of the second tensor: layer1.weight (4×4 float32 each)
    path.write_bytes(bytes(raw))
    with pytest.raises(CheckpointError, match=r"c\.safetensors: tensor 'model\.layer1\.weight' fails its SHA-256"):
        load_checkpoint(path)


def test_load_detects_a_changed_metadata_value(tmp_path: Path) -> None:
    path = save_checkpoint(tmp_path / "c.safetensors", **_state(5))
    raw = path.read_bytes()
    assert raw.count(b'{\\"step\\": 5}') == 1  # the trainer state, as escaped JSON inside the header
    path.write_bytes(raw.replace(b'{\\"step\\": 5}', b'{\\"step\\": 6}'))
    with pytest.raises(CheckpointError, match=r"c\.safetensors: the metadata .* fails its SHA-256 check"):
        load_checkpoint(path)


def test_a_checkpoint_without_a_metadata_checksum_still_loads(tmp_path: Path) -> None:
    """Checkpoints written before the metadata had its own checksum."""
    import json

    path = save_checkpoint(tmp_path / "c.safetensors", **_state(2))
    raw = path.read_bytes()
    n = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8:8 + n])
    del header["__metadata__"]["metadata_sha256"]
    head = json.dumps(header).encode()
    head += b" " * (-len(head) % 8)
    path.write_bytes(len(head).to_bytes(8, "little") + head + raw[8 + n:])
    assert _step_of(path) == 2


class _Payload:
    def __reduce__(self) -> tuple[Any, ...]:
        return (Path.touch, (Path(os.environ["BLUTRAIN_TEST_PWNED"]),))


def test_loading_a_pickle_executes_nothing_and_fails_clearly(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    pwned = tmp_path / "pwned"
    monkeypatch.setenv("BLUTRAIN_TEST_PWNED", str(pwned))
    path = tmp_path / "evil.safetensors"
    path.write_bytes(pickle.dumps({"model": _Payload()}) + b"\0" * 64)
    with pytest.raises(CheckpointError, match=r"evil\.safetensors: not a BluTrain checkpoint"):
        load_checkpoint(path)
    assert not pwned.exists()


def test_a_checkpoint_round_trips_every_state(tmp_path: Path) -> None:
    path = save_checkpoint(tmp_path / "c.safetensors", **_state(5))
    state = load_checkpoint(path)
    assert state["trainer"] == {"step": 5} and state["loader"] == {"position": 5}
    assert state["optimizer"]["state"]["0"]["step"] == 5
    assert state["model"]["ids"].dtype is bt.int64 and state["model"]["ids"].tolist() == [5] * 4


def _run(make_config: MakeConfig, **changes: Any) -> Trainer:
    trainer = Trainer(make_config(**changes), stream=io.StringIO())
    trainer.run()
    return trainer


@pytest.mark.parametrize("async_checkpoint", [False, True])
def test_keep_rotates_step_checkpoints(make_config: MakeConfig, tmp_path: Path, async_checkpoint: bool) -> None:
    _run(make_config, max_steps=5, checkpoint_every=1, keep=2, async_checkpoint=async_checkpoint)
    names = sorted(p.name for p in (tmp_path / "out").glob("*.safetensors"))
    assert names == ["final.safetensors", "step_000003.safetensors", "step_000004.safetensors"]


def test_async_checkpoint_holds_the_state_of_its_step_although_training_went_on(make_config: MakeConfig,
                                                                               tmp_path: Path) -> None:
    _run(make_config, max_steps=4, checkpoint_every=2, out=str(tmp_path / "sync"))
    _run(make_config, max_steps=4, checkpoint_every=2, out=str(tmp_path / "async"), async_checkpoint=True)
    sync = load_checkpoint(tmp_path / "sync" / "step_000002.safetensors")
    asynchronous = load_checkpoint(tmp_path / "async" / "step_000002.safetensors")
    for name, t in sync["model"].items():
        np.testing.assert_array_equal(asynchronous["model"][name].numpy(), t.numpy(), err_msg=name)
    assert asynchronous["loader"] == sync["loader"] and asynchronous["trainer"] == sync["trainer"]
    final = load_checkpoint(tmp_path / "async" / "final.safetensors")
    assert not np.array_equal(final["model"]["transformer.wte.weight"].numpy(),
                              asynchronous["model"]["transformer.wte.weight"].numpy())


def test_staging_copies_so_later_updates_do_not_leak_into_the_checkpoint(tmp_path: Path) -> None:
    state = _state(7)
    staged = stage_checkpoint(**state)
    state["model_state"]["layer0.weight"].numpy()[:] = -1.0  # training goes on while the writer writes
    writer = CheckpointWriter()
    writer.submit(staged, tmp_path / "c.safetensors")
    writer.wait()
    assert _step_of(tmp_path / "c.safetensors") == 7


class _WaitForWriter:
    """Lets the asynchronous write finish before the next step starts, so the test knows which step sees it."""

    def __init__(self, trainer: Trainer) -> None:
        self.trainer = trainer

    @hookimpl
    def blutrain_on_train_event(self, event: str, state: dict[str, Any]) -> None:
        writer = self.trainer.writer
        while event == "checkpoint_saved" and writer is not None and writer.busy:
            time.sleep(0.001)


def test_a_failed_async_write_surfaces_at_the_next_step(make_config: MakeConfig, tmp_path: Path) -> None:
    trainer = Trainer(make_config(max_steps=5, checkpoint_every=2, async_checkpoint=True), stream=io.StringIO())
    blocker = tmp_path / "out" / "step_000002.safetensors" / "occupied"
    blocker.mkdir(parents=True)  # the rename onto a non-empty directory fails
    with (plugin_registered(_WaitForWriter(trainer), "wait-for-writer"),
          pytest.raises(CheckpointError, match=r"asynchronous checkpoint write failed: .*step_000002\.safetensors")):
        trainer.run()
    assert trainer.step == 2  # step 3 never ran
    assert not list((tmp_path / "out").glob(".*.tmp"))
