"""The GEMM-epilogue pass: ``r + linear(x, W, b)`` becomes one ``linear_add`` where nothing else reads the
product, directly or through autocast's cast; the compiled results against eager."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import blutrain.compiler as bc
import blutrain.tensor as bt
from blutrain.compiler.graph import body


def _names(fn: Any, *arrays: np.ndarray) -> list[str]:
    module = bc.trace_module(fn, *arrays)
    bc.run_pipeline(module, ["gemm-epilogue"])
    return [o.name for o in body(module).ops]


def _arrays(seed: int, rows: int = 6, c_in: int = 5, c_out: int = 4) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.standard_normal((rows, c_out)).astype(np.float32), rng.standard_normal((rows, c_in)).astype(np.float32),
            rng.standard_normal((c_out, c_in)).astype(np.float32), rng.standard_normal(c_out).astype(np.float32)]


@pytest.mark.parametrize("order", ["residual first", "product first"])
def test_a_residual_add_of_a_projection_becomes_one_linear_add(order: str) -> None:
    def f(r: bt.Tensor, x: bt.Tensor, w: bt.Tensor, b: bt.Tensor) -> bt.Tensor:
        return r + bt.linear(x, w, b) if order == "residual first" else bt.linear(x, w, b) + r

    names = _names(f, *_arrays(0))
    assert "blutrain.linear_add" in names
    assert "blutrain.linear" not in names and "blutrain.add" not in names


def test_the_product_through_autocasts_cast_is_fused_too() -> None:
    def f(r: bt.Tensor, x: bt.Tensor, w: bt.Tensor, b: bt.Tensor) -> bt.Tensor:
        with bt.autocast(enabled=True):
            y = bt.linear(x, w, b)
        return r + y

    names = _names(f, *_arrays(1))
    assert "blutrain.linear_add" in names and "blutrain.add" not in names


def test_no_fusion_where_the_product_is_read_elsewhere_broadcast_or_its_weight_written_between() -> None:
    def twice(r: bt.Tensor, x: bt.Tensor, w: bt.Tensor, b: bt.Tensor) -> tuple[bt.Tensor, bt.Tensor]:
        y = bt.linear(x, w, b)
        return r + y, y

    def broadcast(r: bt.Tensor, x: bt.Tensor, w: bt.Tensor, b: bt.Tensor) -> bt.Tensor:
        return bt.linear(x, w, b) + b  # the bias again: a broadcast add, not a residual

    def written(r: bt.Tensor, x: bt.Tensor, w: bt.Tensor, b: bt.Tensor) -> bt.Tensor:
        y = bt.linear(x, w, b)
        w.mul_(2.0)
        return r + y

    for fn in (twice, broadcast, written):
        names = _names(fn, *_arrays(2))
        assert "blutrain.linear_add" not in names, fn.__name__
        assert "blutrain.linear" in names and "blutrain.add" in names, fn.__name__


@settings(max_examples=15, deadline=None)
@given(st.integers(1, 9), st.integers(1, 7), st.integers(1, 6), st.booleans(), st.integers(0, 2**16))
def test_compiled_residual_projection_trains_as_eager_bit_for_bit(rows: int, c_in: int, c_out: int, bias: bool,
                                                                   seed: int) -> None:
    """float32 on the CPU: the fused kernel adds in eager order, so the losses and the parameters after four
    SGD steps (gradients through the fused op's backward) are eager's bit for bit."""
    from blutrain.optim import create

    r, x, w0, b0 = _arrays(seed, rows, c_in, c_out)
    results = []
    for compiled in (False, True):
        w = bt.from_numpy(w0.copy()).requires_grad_()
        b = bt.from_numpy(b0.copy()).requires_grad_() if bias else None
        opt = create("sgd", [w] + ([b] if b is not None else []), lr=0.01)

        def step(rt: bt.Tensor, xt: bt.Tensor, w: bt.Tensor = w, b: bt.Tensor | None = b,
                 opt: Any = opt) -> bt.Tensor:
            out = rt + bt.linear(xt, w, b)
            loss = (out * out).sum()
            loss.backward()
            opt.step()
            opt.zero_grad()
            return loss

        fn = bc.compile(step) if compiled else step
        losses = [fn(bt.from_numpy(r), bt.from_numpy(x)).detach().numpy().copy() for _ in range(4)]
        if compiled:
            assert "blutrain.linear_add" in fn.ir()  # type: ignore[attr-defined]
        results.append([*losses, w.detach().numpy().copy(), *([] if b is None else [b.detach().numpy().copy()])])
    for a, c in zip(*results, strict=True):
        np.testing.assert_array_equal(a, c)


def test_the_ir_of_a_compiled_block_shows_the_fused_op() -> None:
    """A GPT-2 block written the plain way (hooks on its branches send it down ``x + branch(x)``) compiles
    to ``linear_add`` for its two projections."""
    from blutrain.models import GPT2, GPT2Config

    cfg = GPT2Config.preset("tiny", n_layer=1)
    model = GPT2(cfg)
    block = model.transformer.h[0]
    block.attn.register_forward_hook(lambda module, args, out: None)
    block.mlp.register_forward_hook(lambda module, args, out: None)
    idx = bt.from_numpy(np.random.default_rng(3).integers(0, cfg.vocab_size, (2, 8)))

    def loss_fn() -> bt.Tensor:
        _, loss = model(idx, idx)
        assert loss is not None
        loss.backward()
        return loss

    compiled = bc.compile(loss_fn)
    compiled()
    compiled()
    assert compiled.ir().count("blutrain.linear_add") >= 2


@pytest.mark.cuda
@pytest.mark.parametrize("autocast", [False, True])
def test_on_cuda_the_fused_projection_matches_eager(autocast: bool) -> None:
    """On cuda the fused op is one cuBLASLt GEMM with the bias and residual epilogue; under autocast the
    bf16 product reaches the float32 residual unrounded (eager rounds it once more: within bf16's 2⁻⁸)."""
    registry = bt.backends()
    if "cuda" not in registry.names() or not registry.get("cuda").is_available():
        pytest.skip("no CUDA device")
    r, x, w, b = (bt.from_numpy(a).to("cuda") for a in _arrays(4, 64, 96, 128))

    def f(r: bt.Tensor, x: bt.Tensor) -> bt.Tensor:
        with bt.autocast(enabled=autocast):
            y = bt.linear(x, w, b)
        return r + y

    fn = bc.compile(f)
    got = [fn(r, x).cpu().numpy() for _ in range(3)]
    want = f(r, x).cpu().numpy()
    assert "blutrain.linear_add" in fn.ir()
    for g in got:
        assert np.linalg.norm(g - want) <= (4e-3 if autocast else 1e-6) * np.linalg.norm(want)
