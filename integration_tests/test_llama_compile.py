"""The compiler on the Llama family (blutrain-model-llama): a compiled training step of the tiny preset (rope,
swiglu, rms_norm, grouped-query attention, the untied head) gives eager's losses and weights on the CPU through
the default pass pipeline, in float32 and under bf16 autocast, with and without activation checkpointing."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

import blutrain.compiler as bc
import blutrain.tensor as bt
from blutrain.amp import autocast
from blutrain.models import model_spec
from blutrain.optim import clip_grad_norm_, create


def run(compiled: bool, bf16: bool, recompute: bool, steps: int = 4) -> tuple[list[np.ndarray], Any]:
    spec = model_spec("llama")
    bt.manual_seed(0)
    model: Any = spec.build(spec.config("tiny", n_layer=2, n_embd=64, n_head=4, n_kv_head=2, ffn_hidden=96,
                                        block_size=16, vocab_size=64, checkpoint_activations=recompute))
    params = list(model.parameters())
    opt = create("adamw", params, lr=1e-2)

    def step(x: Any, y: Any) -> Any:
        with autocast(dtype="bfloat16", enabled=bf16):
            _, loss = model(x, y, return_logits=False)
        loss.backward()
        clip_grad_norm_(params, 1.0)
        opt.step()
        opt.zero_grad()
        return loss

    fn: Any = bc.compile(step) if compiled else step
    rng = np.random.default_rng(0)
    out = []
    for _ in range(steps):
        x, y = (bt.tensor(rng.integers(0, 64, (4, 16))) for _ in range(2))
        out.append(fn(x, y).detach().numpy().copy().reshape(-1))
    return out + [p.detach().numpy().copy() for p in params], fn if compiled else None


@pytest.mark.parametrize(("bf16", "recompute"), [(False, False), (True, False), (False, True)])
def test_the_compiled_llama_step_equals_eager(bf16: bool, recompute: bool) -> None:
    eager, _ = run(False, bf16, recompute)
    compiled, fn = run(True, bf16, recompute)
    for i, (got, want) in enumerate(zip(compiled, eager, strict=True)):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-7, err_msg=f"output {i}")
    ir = fn.ir()
    for op in ("blutrain.rope", "blutrain.swiglu", "blutrain.rms_norm", "blutrain.sdpa"):
        assert op in ir, op
