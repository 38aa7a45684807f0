"""A trace holds no more memory than an eager call (a computed value lives as long as the function holds it),
and after its trace a compiled graph holds no array of the traced call: the probe of later calls works from the
values' descriptions (views computed on shape and strides), host-side checks read each call's own inputs."""

from __future__ import annotations

import gc
import tracemalloc
import weakref
from typing import Any

import numpy as np
import pytest

import blutrain.compiler as bc
import blutrain.tensor as bt
from blutrain.compiler import trace
from blutrain.models.gpt2 import GPT2, GPT2Config
from blutrain.optim import clip_grad_norm_, create, weight_decay_groups
from blutrain.tensor.errors import TensorIndexError


def _tiny_gpt_step() -> Any:
    bt.manual_seed(0)
    cfg = GPT2Config.preset("tiny", vocab_size=64, block_size=16, n_layer=2, n_head=2, n_embd=32)
    model = GPT2(cfg)
    opt = create("adamw", weight_decay_groups(model.parameters(), 0.1), lr=1e-3, betas=(0.9, 0.95))

    def step(x: bt.Tensor, y: bt.Tensor) -> bt.Tensor:
        _, loss = model(x, y)
        loss.backward()
        clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad()
        return loss

    return step


def test_a_trace_frees_what_the_function_drops_as_an_eager_call_does() -> None:
    """Eight 4 MB temporaries made and dropped one after another: the trace's peak stays near the eager call's
    (two or three of them alive at once), not the sum of every value it recorded."""
    x = bt.randn(1 << 20)

    def chain(x: bt.Tensor) -> bt.Tensor:
        y = x
        for i in range(8):
            y = (y * 0.5 + float(i)).tanh()  # each step's temporaries are dropped by the next one
        return y.sum()

    def peak(fn: Any) -> int:
        gc.collect()
        tracemalloc.start()
        try:
            fn(x)
            return tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()

    eager = peak(chain)
    traced = peak(bc.compile(chain, warmup=0))  # its first call traces
    # beyond eager, while one kernel runs: a copy of its operand (to see what it wrote) and the comparison's
    # temporaries; every value it recorded held at once would be 24 buffers more
    assert traced < eager + 5 * x.nbytes, (traced, eager)


def test_the_traced_calls_intermediate_arrays_are_freed_once_the_graph_is_built(
        monkeypatch: pytest.MonkeyPatch) -> None:
    made: list[tuple[trace.Tracer, int, weakref.ref[Any]]] = []
    new_value = trace.Tracer._new_value

    def recording(self: trace.Tracer, concrete: Any, *args: Any, **kwargs: Any) -> int:
        vid = new_value(self, concrete, *args, **kwargs)
        if self.mode == "trace":
            made.append((self, vid, weakref.ref(concrete)))
        return vid

    monkeypatch.setattr(trace.Tracer, "_new_value", recording)
    fn = bc.compile(_tiny_gpt_step())
    rng = np.random.default_rng(0)
    losses = []
    for _ in range(3):  # eager, trace, replay
        x = bt.tensor(rng.integers(0, 64, (4, 16)))
        y = bt.tensor(rng.integers(0, 64, (4, 16)))
        losses.append(float(fn(x, y).item()))
    del x, y
    gc.collect()
    tracer = fn.last.tracer if fn.last is not None else None
    assert tracer is not None
    intermediates = [(vid, ref) for tr, vid, ref in made if vid not in tracer.state_vids]
    assert len(intermediates) > 100  # every kernel result and view of the step
    alive = [vid for vid, ref in intermediates if ref() is not None]
    assert alive == []
    # the state stays: parameters and optimizer state are the model's own arrays
    assert all(ref() is not None for tr, vid, ref in made if vid in tracer.state_vids)
    assert np.isfinite(losses).all()


def test_views_of_a_later_call_are_computed_without_the_traced_arrays() -> None:
    w = bt.randn(6, 4)

    def f(x: bt.Tensor) -> bt.Tensor:
        h = (x * 2.0).exp()  # a computed value: the probe has no data for it
        t = h.transpose(0, 1)  # a strided view
        flat = t.reshape(24)  # not contiguous: the traced call copied here
        first = h[1]  # an integer key: a view, not a scalar
        part = h[1:5:2, 2:]  # a step
        wide = first.reshape(1, 6) + h[:2, :].reshape(2, 6)  # broadcasting
        return flat.sum() + first.sum() * part.sum() + (wide @ w).sum()

    fn = bc.compile(f, warmup=0)
    rng = np.random.default_rng(0)
    for _ in range(4):
        x = bt.tensor(rng.standard_normal((4, 6)).astype(np.float32) * 0.1)
        np.testing.assert_allclose(np.asarray(fn(x)), np.asarray(f(x)), rtol=1e-6)
    assert fn.traces == 1


def test_a_different_view_on_a_later_call_is_a_graph_break() -> None:
    calls = [0]

    def f(x: bt.Tensor) -> bt.Tensor:
        calls[0] += 1
        h = x.exp()
        return (h[:, 1:] if calls[0] == 1 else h[:, :-1]).sum()

    fn = bc.compile(f, warmup=0, replay="probe")
    fn(bt.randn(3, 4))
    with pytest.raises(bc.GraphBreakError):
        fn(bt.randn(3, 4))


def test_host_checks_on_an_input_read_each_calls_own_values() -> None:
    bt.manual_seed(0)
    emb = bt.randn(8, 5)

    def f(ids: bt.Tensor) -> bt.Tensor:
        return bt.embedding(ids[:, 1:], emb).exp().sum()  # the check reads a view of the input

    fn = bc.compile(f, warmup=0, replay="probe")  # a graph replay runs no check that reads an input's values
    fn(bt.tensor(np.array([[0, 1, 2], [3, 4, 5]])))
    np.testing.assert_allclose(np.asarray(fn(bt.tensor(np.array([[7, 6, 5], [4, 3, 2]])))),
                               np.asarray(f(bt.tensor(np.array([[7, 6, 5], [4, 3, 2]])))), rtol=1e-6)
    with pytest.raises(TensorIndexError, match="out of range"):
        fn(bt.tensor(np.array([[0, 1, 2], [3, 4, 8]])))


def test_host_checks_on_a_computed_value_replay_the_traced_calls_result() -> None:
    bt.manual_seed(0)
    logits_w = bt.randn(4, 6)

    def f(x: bt.Tensor, y: bt.Tensor) -> bt.Tensor:
        target = y + 1  # computed by a kernel: no data on later calls
        return bt.cross_entropy(x @ logits_w, target)

    fn = bc.compile(f, warmup=0)
    rng = np.random.default_rng(0)
    for _ in range(3):
        x = bt.tensor(rng.standard_normal((5, 4)).astype(np.float32))
        y = bt.tensor(rng.integers(0, 5, (5,)))
        np.testing.assert_allclose(np.asarray(fn(x, y)), np.asarray(f(x, y)), rtol=1e-6)
    assert fn.traces == 1
