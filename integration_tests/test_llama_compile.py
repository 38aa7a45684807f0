"""The compiler on the Llama family (blutrain-model-llama): a compiled training step of the tiny preset (rope,
swiglu, rms_norm, grouped-query attention, the untied head) gives eager's losses and weights on the CPU through
the default pass pipeline, in float32 and under bf16 autocast, with and without activation checkpointing; the
norm passes apply to its RMSNorms (layernorm-cast writes their bf16 output, layernorm-residual-linear-add
folds the residual add into the next norm); the rematerialize pass makes the SwiGLU and RMSNorm outputs again
before the backward GEMMs that read them, with eager's bits, in a smaller planned arena."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

import blutrain.compiler as bc
import blutrain.tensor as bt
from blutrain.amp import autocast
from blutrain.models import model_spec
from blutrain.optim import clip_grad_norm_, create


def run(compiled: bool, bf16: bool, recompute: bool, steps: int = 4,
        passes: tuple[str, ...] | None = None, remat: bool | None = None) -> tuple[list[np.ndarray], Any]:
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

    fn: Any = bc.compile(step, passes=None if passes is None else list(passes), remat=remat) if compiled else step
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
    norms = [line for line in ir.splitlines() if '"blutrain.rms_norm"' in line]
    # layernorm-cast: under autocast each block's norm writes the bf16 input of the GEMMs after it
    assert sum('np_dtype = "bfloat16"' in line for line in norms) == (4 if bf16 else 0)


def test_the_residual_norm_pass_folds_llamas_residual_adds_into_its_rms_norms() -> None:
    pipeline = list(bc.default_pipeline())
    pipeline.insert(pipeline.index("gemm-epilogue"), "layernorm-residual-linear-add")
    eager, _ = run(False, True, False)
    compiled, fn = run(True, True, False, passes=tuple(pipeline))
    # the projections' products are rounded to bf16 before the add (the pass's documented numerics)
    for i, (got, want) in enumerate(zip(compiled[:4], eager[:4], strict=True)):
        np.testing.assert_allclose(got, want, rtol=2e-2, err_msg=f"loss {i}")
    norms = [line for line in fn.ir().splitlines() if '"blutrain.rms_norm"' in line]
    # every norm but the first reads a residual sum (2 blocks: 4 of 5 norms), and now returns it as a third result
    assert sum(line.split("=")[0].count("%") == 3 for line in norms) == 4


def test_the_compiled_llama_attention_reads_the_shared_key_value_heads() -> None:
    """Grouped-query attention traces as one sdpa op (and one sdpa_backward) per layer whose k and v keep
    their 2 heads against q's 4: no expanded or repeated K/V reaches the kernel."""
    _, fn = run(True, False, False, steps=3)
    ops = [line for line in fn.ir().splitlines() if '"blutrain.sdpa' in line]
    assert len(ops) == 4  # 2 layers, forward and backward
    for line in ops:
        assert "tensor<4x2x16x16xf32>, tensor<4x2x16x16xf32>" in line, line


@pytest.mark.parametrize("bf16", [False, True], ids=["float32", "autocast-bf16"])
def test_the_compiled_llama_step_with_rematerialization_is_eager_bit_for_bit_in_a_smaller_arena(bf16: bool) -> None:
    eager, _ = run(False, bf16, False)
    _, plain = run(True, bf16, False, remat=False)
    compiled, fn = run(True, bf16, False, remat=True)
    for i, (got, want) in enumerate(zip(compiled, eager, strict=True)):
        np.testing.assert_array_equal(got.view(np.uint32), want.view(np.uint32), err_msg=f"output {i}")
    ir = fn.ir()
    # per block: the SwiGLU output, both RMSNorm outputs and the attention output's contiguous copy, made again
    # before the backward GEMMs that read them, and under autocast the bf16 copies of the seven weights (2 blocks)
    assert fn.stats.recomputed == 8 + 14 * bf16 and plain.stats.recomputed == 0
    assert ir.count('"blutrain.swiglu"') == 4 and ir.count('"blutrain.rms_norm"') == 5 + 4
    assert fn.stats.arena_bytes < plain.stats.arena_bytes
