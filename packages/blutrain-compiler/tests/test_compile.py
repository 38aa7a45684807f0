"""compile(): a traced training step replays exactly, retraces on new shapes, refuses data-dependent
control flow with the line that caused it."""

from __future__ import annotations

import logging
from typing import Any

import numpy as np
import pytest

import blutrain.compiler as bc
import blutrain.tensor as bt
from blutrain.models.gpt2 import GPT2, GPT2Config
from blutrain.nn import Linear
from blutrain.optim import clip_grad_norm_, create, weight_decay_groups


def _gpt_losses(compiled: bool, steps: int) -> tuple[list[float], Any]:
    bt.manual_seed(0)
    cfg = GPT2Config.preset("tiny", vocab_size=64, block_size=16, n_layer=2, n_head=2, n_embd=32)
    model = GPT2(cfg)
    opt = create("adamw", weight_decay_groups(model.parameters(), 0.1), lr=1e-3, betas=(0.9, 0.95))

    def step(x: bt.Tensor, y: bt.Tensor, lr: float) -> tuple[bt.Tensor, bt.Tensor]:
        for g in opt.param_groups:
            g["lr"] = lr
        _, loss = model(x, y)
        loss.backward()
        norm = clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad()
        return loss, norm

    fn = bc.compile(step) if compiled else step
    rng = np.random.default_rng(0)
    losses = []
    for i in range(steps):
        x = bt.tensor(rng.integers(0, 64, (4, 16)))
        y = bt.tensor(rng.integers(0, 64, (4, 16)))
        loss, _ = fn(x, y, 3e-3 * min(1.0, (i + 1) / 10))  # a warm-up schedule: lr changes every step
        losses.append(float(loss.item()))
    return losses, fn


def test_compiled_tiny_gpt_training_matches_eager_for_50_steps() -> None:
    eager, _ = _gpt_losses(False, 50)
    compiled, fn = _gpt_losses(True, 50)
    rel = max(abs(a - b) / abs(a) for a, b in zip(eager, compiled, strict=True))
    assert rel < 1e-6
    assert eager[-1] < eager[0]  # it trains
    assert fn.traces == 1
    assert fn.stats.arena_bytes < fn.stats.buffer_bytes


def _linear_step() -> tuple[Any, Linear]:
    bt.manual_seed(0)
    model = Linear(4, 3)
    opt = create("sgd", model.parameters(), lr=0.1)

    def step(x: bt.Tensor) -> bt.Tensor:
        loss = (model(x).tanh() * 2.0 + 1.0).pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss

    return step, model


def test_first_calls_run_eagerly_then_trace_then_replay() -> None:
    step, _ = _linear_step()
    fn = bc.compile(step, warmup=1)
    x = bt.randn(5, 4)
    for _ in range(3):
        fn(x)
    assert fn.traces == 1
    assert "func.func @step" in fn.ir()


def test_new_shape_retraces_and_logs_it(caplog: pytest.LogCaptureFixture) -> None:
    step, _ = _linear_step()
    fn = bc.compile(step, warmup=0)
    with caplog.at_level(logging.DEBUG, logger="blutrain.compiler"):
        fn(bt.randn(5, 4))
        fn(bt.randn(5, 4))
        fn(bt.randn(7, 4))
    assert fn.traces == 2
    assert sum("tracing" in r.getMessage() for r in caplog.records) == 2


def test_data_dependent_control_flow_names_the_line() -> None:
    model = Linear(4, 3)

    def step(x: bt.Tensor) -> bt.Tensor:
        y = model(x).sum()
        if y > 0:  # data-dependent: the marker line
            return y * 2
        return y

    fn = bc.compile(step, warmup=0)
    with pytest.raises(bc.DataDependentError, match=r"test_compile\.py:\d+: +if y > 0"):
        fn(bt.randn(2, 4))


def test_item_inside_the_function_is_refused() -> None:
    model = Linear(4, 3)
    fn = bc.compile(lambda x: model(x).sum().item(), warmup=0)
    with pytest.raises(bc.DataDependentError, match=r"\.item\(\)"):
        fn(bt.randn(2, 4))


def test_a_different_op_sequence_on_a_later_call_is_a_graph_break() -> None:
    model = Linear(4, 3)
    calls = [0]

    def step(x: bt.Tensor) -> bt.Tensor:
        calls[0] += 1
        y = model(x)
        return y.exp().sum() if calls[0] > 1 else y.sum()

    fn = bc.compile(step, warmup=0)
    fn(bt.randn(2, 4))
    with pytest.raises(bc.GraphBreakError):
        fn(bt.randn(2, 4))


def test_dump_ir_writes_one_file_per_pass(tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("BLUTRAIN_DUMP_IR", str(tmp_path))
    step, _ = _linear_step()
    fn = bc.compile(step, warmup=0)
    fn(bt.randn(5, 4))
    names = sorted(p.name for p in tmp_path.iterdir())
    assert len(names) == 1 + len(bc.DEFAULT_PIPELINE)
    assert names[0].endswith("_traced.mlir") and names[-1].endswith("_memory-plan.mlir")
