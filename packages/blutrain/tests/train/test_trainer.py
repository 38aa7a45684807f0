"""The trainer: resumable bit for bit, optimizers by name, checkpoints that detect damage."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, ClassVar

import numpy as np
import pytest

import blutrain.tensor as bt
from blutrain.data import write_shard
from blutrain.tensor.plugins import hookimpl
from blutrain.tensor.testing import plugin_registered
from blutrain.train import CheckpointError, ConfigError, TrainConfig, Trainer, load_checkpoint

from .conftest import MakeConfig


def _losses(out: Path) -> list[float]:
    return [json.loads(line)["loss"] for line in (out / "metrics.jsonl").read_text().splitlines()]


def test_resumed_run_reproduces_the_uninterrupted_losses_bit_for_bit(make_config: MakeConfig,
                                                                      tmp_path: Path) -> None:
    Trainer(make_config(out=str(tmp_path / "full"))).run()
    Trainer(make_config(out=str(tmp_path / "part"), max_steps=3)).run()
    resumed = make_config(out=str(tmp_path / "part"), resume=str(tmp_path / "part" / "final.safetensors"))
    Trainer(resumed).run()
    full, part = _losses(tmp_path / "full"), _losses(tmp_path / "part")
    assert len(full) == len(part) == 6
    assert full == part  # exact float equality: same data, same RNG draws, same optimizer state


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_a_step_checkpoint_saves_the_batches_consumed_not_the_batches_drawn_early(make_config: MakeConfig,
                                                                                    tmp_path: Path,
                                                                                    compiled: bool) -> None:
    """Each step draws the next step's batches while its own work runs; a checkpoint written between two
    steps must hold the loader's position before those, so a run resumed from it reads them again."""
    cfg = make_config(out=str(tmp_path / "full"), checkpoint_every=2, keep=0, compile=compiled)
    if compiled:
        cfg.model_overrides["dropout"] = 0.0
    early = Trainer(make_config(out=str(tmp_path / "early")))
    early.train_step()
    assert early.loader_state() != early.loader.state_dict()  # step 2's batches are drawn already
    Trainer(cfg).run()
    resumed = make_config(out=str(tmp_path / "full"), resume=str(tmp_path / "full" / "step_000002.safetensors"),
                          compile=compiled)
    resumed.model_overrides = dict(cfg.model_overrides)
    full = _losses(tmp_path / "full")
    Trainer(resumed).run()
    again = _losses(tmp_path / "full")
    assert len(full) == len(again) == 6
    assert again == full  # steps 3-6 read the same batches as the uninterrupted run


@pytest.mark.parametrize("optimizer", ["adamw", "sgd"])
def test_each_builtin_optimizer_lowers_the_loss(make_config: MakeConfig, tmp_path: Path, optimizer: str) -> None:
    lr = 3e-3 if optimizer == "adamw" else 0.3
    cfg = make_config(out=str(tmp_path), optimizer=optimizer, max_steps=25, lr=lr, warmup_steps=0)
    cfg.model_overrides["dropout"] = 0.0
    Trainer(cfg).run()
    losses = _losses(tmp_path)
    assert np.mean(losses[-5:]) < np.mean(losses[:5]) - 0.3


class _SignSGD:
    """A third-party optimizer: steps by the sign of the gradient."""

    trainer_defaults: ClassVar[dict[str, Any]] = {}  # what `blutrain train` passes beyond lr: nothing

    def __init__(self, params: Any, lr: float = 1e-3, **_: Any) -> None:
        self.param_groups = [dict(g, lr=lr) for g in params] if isinstance(params, list) and params and \
            isinstance(params[0], dict) else [{"params": list(params), "lr": lr}]
        self.steps = 0

    def zero_grad(self, set_to_none: bool = True) -> None:
        for g in self.param_groups:
            for p in g["params"]:
                p.grad = None

    def step(self) -> None:
        from blutrain.autograd import no_grad

        self.steps += 1
        with no_grad():
            for g in self.param_groups:
                for p in g["params"]:
                    if p.grad is not None:
                        p.sub_(bt.sign(p.grad) * g["lr"])

    def state_dict(self) -> dict[str, Any]:
        return {"steps": self.steps}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.steps = state["steps"]


class _SignSGDPlugin:
    @hookimpl
    def blutrain_register_optimizers(self, registry: Any) -> None:
        registry.register("signsgd", _SignSGD)


def test_third_party_optimizer_is_selectable_by_name(make_config: MakeConfig, tmp_path: Path) -> None:
    with plugin_registered(_SignSGDPlugin(), "signsgd-test"):
        trainer = Trainer(make_config(out=str(tmp_path), optimizer="signsgd", max_steps=2, lr=1e-3))
        assert isinstance(trainer.optimizer, _SignSGD)
        trainer.run()
        assert trainer.optimizer.steps == 2


def test_unknown_optimizer_lists_the_installed_ones(make_config: MakeConfig, tmp_path: Path) -> None:
    with pytest.raises(LookupError, match=r"no optimizer 'lion'; installed: adamw \(blutrain-optim-adamw"):
        Trainer(make_config(out=str(tmp_path), optimizer="lion"))


def test_checkpoint_with_one_flipped_byte_fails_naming_the_damage(make_config: MakeConfig, tmp_path: Path) -> None:
    result = Trainer(make_config(out=str(tmp_path), max_steps=1)).run()
    path = Path(result["checkpoint"])
    raw = bytearray(path.read_bytes())
    raw[-100] ^= 0x01  # a byte inside the last tensor's data
    path.write_bytes(bytes(raw))
    with pytest.raises(CheckpointError, match=r"tensor '.*' fails its SHA-256 check"):
        load_checkpoint(path)


def test_truncated_checkpoint_fails_clearly(make_config: MakeConfig, tmp_path: Path) -> None:
    result = Trainer(make_config(out=str(tmp_path), max_steps=1)).run()
    path = Path(result["checkpoint"])
    path.write_bytes(path.read_bytes()[:-1000])
    with pytest.raises(CheckpointError, match=r"final\.safetensors: .*truncated"):
        load_checkpoint(path)


def test_truncated_shard_fails_before_training_naming_the_file(make_config: MakeConfig, tmp_path: Path) -> None:
    shard = tmp_path / "train_000000.bin"
    write_shard(shard, np.arange(5000, dtype=np.uint16) % 256)
    shard.write_bytes(shard.read_bytes()[:-10])
    cfg = make_config(data=str(shard))
    with pytest.raises(ValueError, match=r"train_000000\.bin"):
        Trainer(cfg)


def test_run_writes_metrics_config_checkpoint_and_plot(make_config: MakeConfig, tmp_path: Path) -> None:
    result = Trainer(make_config(out=str(tmp_path), max_steps=2, eval_every=1)).run()
    lines = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in lines] == [1, 2]
    assert {"step", "loss", "lr", "grad_norm", "tok_per_s"} <= set(lines[0])
    assert "val_loss" in lines[0]
    assert (tmp_path / "config.toml").read_text().startswith('model = "gpt2"\npreset = "tiny"')
    assert Path(result["checkpoint"]).exists()
    assert (tmp_path / "loss.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_toml_config_is_overridden_by_flags(tmp_path: Path) -> None:
    from blutrain.cli import build_parser
    from blutrain.cli.train_command import build_config

    toml = tmp_path / "run.toml"
    toml.write_text('preset = "tiny"\nlr = 0.01\nmax_steps = 50\n')
    args = build_parser().parse_args(["train", "--config", str(toml), "--lr", "0.002"])
    cfg = build_config(args)
    assert (cfg.lr, cfg.max_steps) == (0.002, 50)


def test_unknown_config_key_is_named(tmp_path: Path) -> None:
    toml = tmp_path / "bad.toml"
    toml.write_text("learning_rate = 0.1\n")
    with pytest.raises(ConfigError, match="unknown key 'learning_rate'"):
        TrainConfig.from_toml(toml)


def test_generate_command_continues_a_prompt_from_a_checkpoint(make_config: MakeConfig, tmp_path: Path,
                                                                capsys: pytest.CaptureFixture[str]) -> None:
    from blutrain.cli import main

    result = Trainer(make_config(out=str(tmp_path), max_steps=1)).run()
    capsys.readouterr()
    code = main(["generate", "--checkpoint", result["checkpoint"], "--prompt", "def ", "--max-new-tokens", "12",
                 "--device", "cpu"])
    out = capsys.readouterr().out
    assert code == 0
    assert out.startswith("def ")
    assert len(out.rstrip("\n").encode("utf-8", "replace")) >= len("def ")


def test_bf16_autocast_training_keeps_float32_master_weights_and_learns(make_config: MakeConfig,
                                                                         tmp_path: Path) -> None:
    cfg = make_config(out=str(tmp_path), dtype="bf16", max_steps=20, warmup_steps=0)
    cfg.model_overrides["dropout"] = 0.0
    trainer = Trainer(cfg)
    trainer.run()
    assert all(p.dtype is bt.float32 for p in trainer.model.parameters())
    losses = _losses(tmp_path)
    assert np.mean(losses[-5:]) < np.mean(losses[:5]) - 0.2


def test_the_trainer_builds_the_optimizer_with_its_declared_trainer_defaults(make_config: MakeConfig,
                                                                              tmp_path: Path) -> None:
    adamw = Trainer(make_config(out=str(tmp_path), max_steps=1))
    assert [g["betas"] for g in adamw.optimizer.param_groups] == [(0.9, 0.95)] * len(adamw.optimizer.param_groups)
    sgd = Trainer(make_config(out=str(tmp_path / "sgd"), optimizer="sgd", max_steps=1))
    assert all(g["momentum"] == 0.0 and g["lr"] == sgd.cfg.lr for g in sgd.optimizer.param_groups)


def test_each_rank_of_a_launch_gets_its_own_accelerator(monkeypatch: pytest.MonkeyPatch) -> None:
    """A bare accelerator name gets the rank's local index (also when the process group was made before the
    trainer: Trainer._init_distributed asks before it returns the existing group); the CPU, an indexed name and a
    single process are left as given."""
    from types import SimpleNamespace

    from blutrain.dist import detect
    from blutrain.train.trainer import rank_device

    real = bt.backends()
    fake = SimpleNamespace(get=lambda name: SimpleNamespace(accelerator=True) if name == "gpu" else real.get(name))
    monkeypatch.setattr(bt, "backends", lambda: fake)
    second_of_four = detect({"RANK": "5", "WORLD_SIZE": "8", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "4"})
    assert rank_device("gpu", second_of_four) == "gpu:1"
    assert rank_device("gpu:3", second_of_four) == "gpu:3"
    assert rank_device("cpu", second_of_four) == "cpu"
    assert rank_device("gpu", detect({})) == "gpu"


def test_evaluate_is_the_mean_of_the_validation_batches_losses_each_read_alone(make_config: MakeConfig) -> None:
    """evaluate() reads every batch's loss back at once: the same numbers as reading each after its batch."""
    from blutrain.autograd import no_grad
    from blutrain.data import TokenLoader

    trainer = Trainer(make_config(eval_batches=3))
    trainer.train_step()
    assert trainer.data.val_pattern is not None
    val = TokenLoader(trainer.data.val_pattern, trainer.cfg.batch_size, trainer.cfg.seq_len, seed=trainer.cfg.seed)
    trainer.model.eval()
    each = []
    with no_grad():
        for _ in range(3):
            x, y = val.next_batch()
            each.append(float(trainer.model(bt.from_numpy(x), bt.from_numpy(y), return_logits=False)[1].item()))
    trainer.model.train()
    assert len(set(each)) > 1  # three different batches
    assert trainer.evaluate() == sum(each) / 3
