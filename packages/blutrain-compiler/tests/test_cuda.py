"""The CUDA executor: a compiled step replays as one CUDA graph and matches eager mode."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import blutrain.compiler as bc
import blutrain.tensor as bt
from blutrain_backend_cupy.compile_target import CUDAGraphExecutor

pytestmark = pytest.mark.cuda


def _cuda() -> None:
    registry = bt.backends()
    if "cuda" not in registry.names() or not registry.get("cuda").is_available():
        pytest.skip("no CUDA device")


def _gpt(compiled: bool, steps: int, optimizer: str) -> tuple[list[float], list[float], Any]:
    from blutrain.models.gpt2 import GPT2, GPT2Config
    from blutrain.optim import clip_grad_norm_, create, warmup_cosine, weight_decay_groups

    bt.manual_seed(0)
    # head size 64: the fused attention kernels (GEMMs through BluTrain's cuBLAS binding only; CuPy's own
    # batched matmul, which a generic attention would use, refuses stream capture)
    cfg = GPT2Config.preset("tiny", vocab_size=256, block_size=64, n_layer=2, n_head=2, n_embd=128)
    model = GPT2(cfg).to("cuda")
    extra: dict[str, Any] = {"betas": (0.9, 0.95)} if optimizer == "adamw" else {}
    opt = create(optimizer, weight_decay_groups(model.parameters(), 0.1), lr=1e-3, **extra)

    def step(x: bt.Tensor, y: bt.Tensor, lr: float) -> bt.Tensor:
        for g in opt.param_groups:
            g["lr"] = lr
        _, loss = model(x, y, return_logits=False)
        loss.backward()
        clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad()
        return loss

    fn = bc.compile(step) if compiled else step
    rng = np.random.default_rng(0)
    losses, times = [], []
    for i in range(steps):
        x = bt.tensor(rng.integers(0, 256, (8, 64)), device="cuda")
        y = bt.tensor(rng.integers(0, 256, (8, 64)), device="cuda")
        bt.device("cuda").backend.synchronize(0)
        t0 = time.perf_counter()
        loss = fn(x, y, warmup_cosine(i, 1e-3, 5, steps, 1e-4))  # lr changes every step
        value = float(loss.item())
        times.append(time.perf_counter() - t0)
        losses.append(value)
    return losses, times, fn


@pytest.mark.parametrize("optimizer", ["sgd", "adamw"])
def test_compiled_gpt_on_cuda_matches_eager_and_runs_as_one_graph(optimizer: str) -> None:
    _cuda()
    eager, t_eager, _ = _gpt(False, 20, optimizer)
    compiled, t_comp, fn = _gpt(True, 20, optimizer)
    rel = max(abs(a - b) / abs(a) for a, b in zip(eager, compiled, strict=True))
    graph = fn.last
    assert isinstance(graph.executor, CUDAGraphExecutor)
    report = {"optimizer": optimizer, "max_rel": rel, "eager_losses": eager, "compiled_losses": compiled,
              "eager_ms": 1e3 * float(np.median(t_eager[3:])), "compiled_ms": 1e3 * float(np.median(t_comp[3:])),
              "captures": graph.executor.captures, "updates": graph.executor.updates,
              "graph": not graph.executor.eager,
              "capture_error": graph.executor.capture_error,
              "graph_pool_bytes": graph.executor.pool_bytes,
              "stats": vars(fn.stats)}
    print(json.dumps(report))
    out = os.environ.get("OUT")
    if out:
        Path(out, f"compiler_cuda_{optimizer}.json").write_text(json.dumps(report, indent=1))
    assert rel < 1e-4
    # lr, the step count and the bias corrections reach the kernels in device memory: no kernel argument
    # changed, so the graph captured at the trace replays every later step
    assert graph.executor.updates == 0
    if not graph.executor.eager:
        assert graph.executor.captures == 1


def test_compiled_gpt_replays_in_a_planned_arena_smaller_than_the_recording_pool() -> None:
    """The captured step's allocation requests are recorded once and served from one arena placed by
    liveness: the graph replays eager mode's losses, every request came from the arena, and the arena is
    smaller than what CuPy's caching pool held for the same run (and no smaller than the most bytes live at
    once). reset() gives it all back."""
    _cuda()
    eager, _, _ = _gpt(False, 12, "adamw")
    compiled, _, fn = _gpt(True, 12, "adamw")
    executor = fn.last.executor
    assert isinstance(executor, CUDAGraphExecutor)
    assert not executor.eager, executor.capture_error
    stats = fn.stats
    rel = max(abs(a - b) / abs(a) for a, b in zip(eager, compiled, strict=True))
    report = {"max_rel": rel, "eager_losses": eager, "compiled_losses": compiled, "captures": executor.captures,
              "first_fallback": executor.first_fallback, "stats": vars(stats)}
    print(json.dumps(report))
    out = os.environ.get("OUT")
    if out:
        Path(out, "compiler_cuda_arena.json").write_text(json.dumps(report, indent=1))
    assert rel < 1e-4
    assert executor.captures == 1 and executor.updates == 0
    assert stats.alloc_requests > 0
    assert stats.alloc_fallbacks == 0, executor.first_fallback
    assert stats.alloc_live_peak_bytes <= stats.alloc_arena_bytes < stats.alloc_pool_bytes
    assert stats.alloc_arena_bytes <= stats.alloc_request_bytes
    fn.reset()
    assert executor.closed and executor.arena is None and executor.graph is None
    assert executor.pool_bytes == 0  # the recording run's blocks were all freed back


def test_an_adamw_step_without_gemms_captures_once_and_replays_under_a_schedule() -> None:
    """Elementwise ops, reductions and the fused AdamW kernel only (no GEMM), so the step must capture;
    the lr and step change every call and the parameters follow eager mode's."""
    _cuda()
    from blutrain.nn import Parameter
    from blutrain.optim import create, warmup_cosine

    def run(compiled: bool) -> tuple[list[np.ndarray[Any, Any]], Any]:
        bt.manual_seed(0)
        w = Parameter(bt.randn(4096, device="cuda"))
        b = Parameter(bt.randn(7, device="cuda"))
        opt = create("adamw", [{"params": [w], "weight_decay": 0.1}, {"params": [b], "weight_decay": 0.0}],
                     lr=1e-2, betas=(0.9, 0.95))

        def step(x: bt.Tensor, lr: float) -> bt.Tensor:
            for g in opt.param_groups:
                g["lr"] = lr
            loss = (x * w).tanh().pow(2).mean() + (b * b).sum()
            loss.backward()
            opt.step()
            opt.zero_grad()
            return loss

        fn = bc.compile(step) if compiled else step
        rng = np.random.default_rng(0)
        for i in range(12):
            x = bt.tensor(rng.standard_normal(4096).astype(np.float32), device="cuda")
            fn(x, warmup_cosine(i, 5e-2, 3, 12, 1e-3))
        return [w.detach().cpu().numpy(), b.detach().cpu().numpy()], fn

    eager, _ = run(False)
    compiled, fn = run(True)
    executor = fn.last.executor
    assert isinstance(executor, CUDAGraphExecutor)
    assert not executor.eager, executor.capture_error
    assert executor.captures == 1 and executor.updates == 0
    for a, c in zip(eager, compiled, strict=True):
        np.testing.assert_allclose(c, a, rtol=1e-5, atol=1e-6)  # fused kernels may contract a*b+c into FMAs


def test_fused_region_runs_as_a_generated_cuda_kernel() -> None:
    _cuda()
    x = bt.randn(64, 33, device="cuda")
    b = bt.randn(33, device="cuda")

    def f(x: bt.Tensor, b: bt.Tensor) -> bt.Tensor:
        return ((x + b).tanh() * 0.5 - 1.0).exp()

    fn = bc.compile(f, warmup=0)
    fn(x, b)
    got = fn(x, b)
    assert "blutrain.fused" in fn.ir()
    np.testing.assert_allclose(got.cpu().numpy(), f(x, b).cpu().numpy(), rtol=1e-5, atol=1e-6)


def _allocated_bytes() -> int:
    """Bytes of device memory in live allocations of the process's allocator (blutrain-alloc, or CuPy's pool
    with BLUTRAIN_CUDA_ALLOCATOR=cupy), after a collection and a synchronization."""
    import gc

    import cupy

    from blutrain.alloc.cupy import CupyAllocator

    gc.collect()
    cupy.cuda.Device().synchronize()
    hook = cupy.cuda.get_allocator()
    if isinstance(hook, CupyAllocator):
        return int(hook.allocator().stats().allocated_bytes)
    return int(cupy.get_default_memory_pool().used_bytes())


def test_a_compiled_gpt_holds_its_state_and_arena_but_not_the_traced_calls_arrays() -> None:
    """After the trace, device memory held is the state (parameters, optimizer state), the executor's arena and
    static inputs, and the returned loss: the traced call's intermediates (``buffer_bytes`` of them, tens of MB
    here) are freed, and later calls hold no more."""
    _cuda()
    from blutrain.models.gpt2 import GPT2, GPT2Config
    from blutrain.optim import clip_grad_norm_, create, weight_decay_groups

    bt.zeros(1, device="cuda")  # the backend installs its allocator when it first makes an array
    start = _allocated_bytes()
    bt.manual_seed(0)
    cfg = GPT2Config.preset("tiny", vocab_size=256, block_size=64, n_layer=2, n_head=2, n_embd=128)
    model = GPT2(cfg).to("cuda")
    opt = create("adamw", weight_decay_groups(model.parameters(), 0.1), lr=1e-3, betas=(0.9, 0.95))

    def step(x: bt.Tensor, y: bt.Tensor) -> bt.Tensor:
        _, loss = model(x, y, return_logits=False)
        loss.backward()
        clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad()
        return loss

    fn = bc.compile(step)
    rng = np.random.default_rng(0)
    batch = (32, 64)
    held, losses = [], []
    for _ in range(4):  # eager (makes the optimizer's state), trace, two replays
        x = bt.tensor(rng.integers(0, 256, batch), device="cuda")
        y = bt.tensor(rng.integers(0, 256, batch), device="cuda")
        losses.append(fn(x, y))
        del x, y
        held.append(_allocated_bytes() - start)
    graph = fn.last
    assert graph is not None
    executor = graph.executor
    assert isinstance(executor, CUDAGraphExecutor)
    assert not executor.eager, executor.capture_error
    tracer = graph.tracer
    state_bytes = sum(int(tracer.concrete[v].nbytes) for v in tracer.state_order)
    input_bytes = sum(int(a.nbytes) for a in executor.inputs)
    stats = fn.stats
    slack = 2 << 20  # allocator rounding (512 bytes a block), library handles' small buffers
    # what the eager call leaves (the state, the model's own buffers, its loss) and the static inputs; from the
    # first replay on (which captures the graph) the executor's arena too (aligned by up to 256 bytes)
    after_trace = max(held[0], state_bytes) + input_bytes + slack
    bound = after_trace + stats.alloc_arena_bytes + 256
    report = {"held_after_each_call": held, "state_bytes": state_bytes, "arena_bytes": stats.alloc_arena_bytes,
              "input_bytes": input_bytes, "traced_buffer_bytes": stats.buffer_bytes, "after_trace": after_trace,
              "bound": bound}
    print(json.dumps(report))
    out = os.environ.get("OUT")
    if out:
        Path(out, "compiler_cuda_held_memory.json").write_text(json.dumps(report, indent=1))
    assert stats.buffer_bytes > 4 * slack  # the traced intermediates would not fit under the bound
    assert state_bytes <= held[0] + slack
    assert held[1] <= after_trace  # right after the trace: its arrays are gone, the graph is not captured yet
    assert held[2] <= bound  # the first replay captured the graph in its arena
    assert held[3] <= held[2] + slack  # later replays add nothing that stays
    assert all(np.isfinite(float(v.item())) for v in losses)
