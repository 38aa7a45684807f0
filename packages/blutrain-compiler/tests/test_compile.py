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
from blutrain.optim import clip_grad_norm_, create, warmup_cosine, weight_decay_groups


def _gpt_losses(compiled: bool, steps: int, lr_inside: bool = True) -> tuple[list[float], Any]:
    """Tiny GPT training under a warm-up schedule that changes the lr every step: set inside the step from
    its float argument (each compiled call then re-runs the step's Python in probe mode), or outside it, as
    a trainer does (each compiled call then replays with no Python of the step)."""
    bt.manual_seed(0)
    cfg = GPT2Config.preset("tiny", vocab_size=64, block_size=16, n_layer=2, n_head=2, n_embd=32)
    model = GPT2(cfg)
    opt = create("adamw", weight_decay_groups(model.parameters(), 0.1), lr=1e-3, betas=(0.9, 0.95))

    def set_lr(lr: float) -> None:
        for g in opt.param_groups:
            g["lr"] = lr

    def step(x: bt.Tensor, y: bt.Tensor, lr: float) -> tuple[bt.Tensor, bt.Tensor]:
        if lr_inside:
            set_lr(lr)
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
        lr = 3e-3 * min(1.0, (i + 1) / 10)  # a warm-up schedule: lr changes every step
        if not lr_inside:
            set_lr(lr)
        loss, _ = fn(x, y, lr if lr_inside else 0.0)
        losses.append(float(loss.item()))
    return losses, fn


@pytest.mark.parametrize("lr_inside", [False, True], ids=["graph-replays", "probed-calls"])
def test_compiled_tiny_gpt_training_matches_eager_for_50_steps(lr_inside: bool) -> None:
    eager, _ = _gpt_losses(False, 50, lr_inside)
    compiled, fn = _gpt_losses(True, 50, lr_inside)
    rel = max(abs(a - b) / abs(a) for a, b in zip(eager, compiled, strict=True))
    assert rel < 1e-6
    assert eager[-1] < eager[0]  # it trains
    assert fn.traces == 1
    assert fn.stats.arena_bytes < fn.stats.buffer_bytes
    # calls 1 and 2 run eagerly and trace; every later one replays, but for those with a float argument
    # other than the last call's (lr inside: the warm-up's calls 3-10), which are probed
    assert (fn.last.replays, fn.last.probes) == ((40, 8) if lr_inside else (48, 0))
    assert fn.last.executor.updates == 0  # lr and bias corrections live in device memory


def _eps_changed_at_call_6(compiled: bool) -> tuple[np.ndarray[Any, Any], Any, Any]:
    bt.manual_seed(0)
    model = Linear(4, 3)
    opt = create("adamw", model.parameters(), lr=1e-2)

    def step(x: bt.Tensor) -> bt.Tensor:
        loss = model(x).pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss

    fn = bc.compile(step) if compiled else step
    rng = np.random.default_rng(0)
    for i in range(8):
        if i == 5:
            opt.param_groups[0]["eps"] = 1e-2
        fn(bt.tensor(rng.standard_normal((5, 4)).astype(np.float32)))
    return np.asarray(model.weight.detach()).copy(), fn, opt


def test_a_changed_hyperparameter_is_not_replayed_stale() -> None:
    """eps is a plain kernel argument: the optimizer's guard sees it change, so that call re-runs the step's
    Python (picking the new eps up) instead of replaying the traced one."""
    eager, _, _ = _eps_changed_at_call_6(False)
    compiled, fn, opt = _eps_changed_at_call_6(True)
    np.testing.assert_array_equal(eager, compiled)
    assert (fn.last.replays, fn.last.probes) == (5, 1)  # calls 3-5 and 7-8 replay; call 6 is probed
    assert fn.last.executor.updates == 1
    assert opt.state_dict()["state"][0]["step"] == 8  # the replays advanced the step count


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


def test_reset_closes_the_executors_and_the_next_calls_trace_anew() -> None:
    step, _ = _linear_step()
    fn = bc.compile(step, warmup=1)
    x = bt.randn(5, 4)
    for _ in range(3):
        fn(x)
    graph = fn.last
    assert graph is not None
    fn.reset()
    assert graph.executor.closed
    assert all(s is None for s in graph.program.slots)
    for _ in range(3):
        fn(x)
    assert fn.traces == 2 and fn.last is not graph


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

    fn = bc.compile(step, warmup=0, replay="probe")
    fn(bt.randn(2, 4))
    with pytest.raises(bc.GraphBreakError):
        fn(bt.randn(2, 4))


def test_a_graph_replay_runs_no_python_of_the_function() -> None:
    """The default replay: the traced kernels on the new inputs, no Python of the function (its own side
    effects happen on the eager and traced calls only)."""
    model = Linear(4, 3)
    calls = [0]

    def step(x: bt.Tensor) -> bt.Tensor:
        calls[0] += 1
        return (model(x) * 2.0).sum()

    fn = bc.compile(step)
    xs = [bt.randn(2, 4) for _ in range(5)]
    got = [float(fn(x).item()) for x in xs]
    assert calls[0] == 2  # the eager call and the traced one
    assert fn.last.replays == 3 and fn.last.probes == 0
    for x, g in zip(xs, got, strict=True):
        np.testing.assert_allclose(g, float(step(x).item()), rtol=1e-6)


def test_replay_must_be_graph_or_probe() -> None:
    with pytest.raises(bc.CompilerError, match=r"replay must be one of 'graph', 'probe', got 'fast'"):
        bc.compile(lambda x: x, replay="fast")


def test_dump_ir_writes_one_file_per_pass(tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("BLUTRAIN_DUMP_IR", str(tmp_path))
    step, _ = _linear_step()
    fn = bc.compile(step, warmup=0)
    fn(bt.randn(5, 4))
    names = sorted(p.name for p in tmp_path.iterdir())
    assert len(names) == 1 + len(bc.default_pipeline())
    assert names[0].endswith("_traced.mlir") and names[-1].endswith("_memory-plan.mlir")


def _scheduled_steps(optimizer: str, compiled: bool, steps: int) -> tuple[list[np.ndarray[Any, Any]], Any]:
    """A small model trained with a learning rate that changes every step (warm-up, then cosine)."""
    bt.manual_seed(0)
    model = Linear(6, 4)
    extra: dict[str, Any] = {"betas": (0.9, 0.95), "weight_decay": 0.1} if optimizer == "adamw" else {"momentum": 0.9}
    opt = create(optimizer, model.parameters(), lr=1e-2, **extra)

    def step(x: bt.Tensor, y: bt.Tensor, lr: float) -> bt.Tensor:
        for g in opt.param_groups:
            g["lr"] = lr
        loss = (model(x).tanh() - y).pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss

    fn = bc.compile(step) if compiled else step
    rng = np.random.default_rng(1)
    for i in range(steps):
        x = bt.tensor(rng.standard_normal((8, 6)).astype(np.float32))
        y = bt.tensor(rng.standard_normal((8, 4)).astype(np.float32))
        fn(x, y, warmup_cosine(i, 5e-2, 3, steps, 1e-3))
    return [np.asarray(p.detach()).copy() for p in model.parameters()], fn


@pytest.mark.parametrize("optimizer", ["adamw", "sgd"])
def test_a_scheduled_lr_and_the_step_count_change_no_kernel_argument(optimizer: str) -> None:
    eager, _ = _scheduled_steps(optimizer, False, 12)
    compiled, fn = _scheduled_steps(optimizer, True, 12)
    for a, b in zip(eager, compiled, strict=True):
        np.testing.assert_array_equal(a, b)
    assert fn.traces == 1
    # lr and the bias corrections are read from a device array (graph state), so no call handed the
    # executor new scalars: on CUDA the graph captured at the trace serves every step
    assert fn.last.executor.updates == 0
    n_scalars = 3 if optimizer == "adamw" else 1  # (lr, bias corrections) or (lr,): a float64 graph argument
    assert f"tensor<{n_scalars}xf64>" in fn.ir()


def test_a_changed_python_scalar_argument_is_handed_to_the_executor() -> None:
    w = Linear(3, 3).weight

    def f(x: bt.Tensor, scale: float) -> bt.Tensor:
        return (x * scale + w.sum()).exp()

    fn = bc.compile(f, warmup=0)
    x = bt.randn(2, 3)
    fn(x, 0.5)
    fn(x, 0.5)
    assert fn.last.executor.updates == 0
    got = fn(x, 0.25)
    assert fn.last.executor.updates == 1
    np.testing.assert_allclose(np.asarray(got), np.asarray(f(x, 0.25)), rtol=1e-6)


def test_two_optimizer_steps_in_one_compiled_call_are_refused() -> None:
    bt.manual_seed(0)
    model = Linear(4, 3)
    opt = create("adamw", model.parameters(), lr=1e-2)

    def two_steps(x: bt.Tensor) -> bt.Tensor:
        for _ in range(2):
            loss = model(x).pow(2).mean()
            loss.backward()
            opt.step()  # the second step refills the bias corrections the first step's kernel read
            opt.zero_grad()
        return loss

    fn = bc.compile(two_steps)
    fn(bt.randn(5, 4))
    with pytest.raises(bc.TracingError, match=r"(?s)test_compile\.py:\d+: +opt\.step\(\).*one optimizer step "
                                              r"per compiled call"):
        fn(bt.randn(5, 4))


def test_an_in_place_kernel_that_left_its_operands_unchanged_when_traced_still_writes_them_on_replay() -> None:
    """The clip's one-kernel rescale, traced while the gradients were under the clip norm (coefficient 1:
    nothing changes), must stay in the graph: a later call with a coefficient below 1 scales. The caller says
    what the kernel writes (multi_tensor_apply's ``written``); the values alone would not show it."""
    from blutrain.optim.multi_tensor import multi_tensor_apply

    a, b = bt.ones(3), bt.ones(5)  # state, as gradients are

    def rescale(coef: bt.Tensor) -> bt.Tensor:
        multi_tensor_apply("scale_multi_tensor", [[a, b]], coef.array, written=(0,))
        return coef * 2.0

    fn = bc.compile(rescale, warmup=0)
    fn(bt.tensor(np.float32(1.0)))  # traced: a scale by 1
    fn(bt.tensor(np.float32(0.5)))  # replayed
    assert fn.last.replays == 1
    np.testing.assert_array_equal(np.asarray(a), np.full(3, 0.5, np.float32))
    np.testing.assert_array_equal(np.asarray(b), np.full(5, 0.5, np.float32))
