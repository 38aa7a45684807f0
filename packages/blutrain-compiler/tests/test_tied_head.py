"""GPT-2's tied LM head in a compiled step: the tied weight's two gradients (the fused head-and-loss op's
``dw · scale`` and the embedding's) are summed in one pass even though ``clip_grad_norm_`` then scales the
sum in place (elementwise fusion fuses an op written in place later; the embedding-grad-add pass, which runs
first, now puts the whole sum into the embedding backward); the compiled step stays eager's bit for bit."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

import blutrain.compiler as bc
import blutrain.tensor as bt
from blutrain.compiler.dialect import FusedOp
from blutrain.compiler.graph import body


def _members(module: Any) -> list[list[str]]:
    return [[m.name for m in o.regions[0].block.ops] for o in body(module).ops if isinstance(o, FusedOp)]


def _summed_in_the_embedding_backward(ir: str, weight: str) -> bool:
    """Whether the embedding backward of the [``weight``] float32 gradient takes the head's gradient and the 0-d
    scale as its addend (the embedding-grad-add pass, which runs before elementwise fusion) and the IR
    multiplies the weight's gradient by a 0-d scale nowhere else: no pass over the weight for the product or
    the sum alone."""
    fused = [line for line in ir.splitlines() if '"blutrain.embedding_backward"' in line
             and f"tensor<{weight}xf32>, tensor<f32>) -> tensor<{weight}xf32>" in line]
    scaled = [line for line in ir.splitlines()
              if '"blutrain.mul"' in line and f"(tensor<{weight}xf32>, tensor<f32>)" in line]
    return len(fused) == 1 and not scaled


def _arrays(seed: int) -> list[np.ndarray[Any, Any]]:
    rng = np.random.default_rng(seed)
    return [rng.standard_normal((5, 7)).astype(np.float32), rng.standard_normal((5, 7)).astype(np.float32),
            np.asarray(rng.standard_normal(), np.float32)]


def _scaled_sum_then_halved(x: bt.Tensor, y: bt.Tensor, s: bt.Tensor) -> bt.Tensor:
    out = x * s + y
    out.mul_(0.5)  # written in place after the sum, as clip_grad_norm_ writes a gradient
    return out


def test_an_elementwise_chain_written_in_place_after_it_is_still_fused(same_bits: Any) -> None:
    module = bc.trace_module(_scaled_sum_then_halved, *_arrays(0))
    bc.run_pipeline(module, ["inplace-aliasing", "elementwise-fusion"])
    # the sum and the halving it is written with (an assign after the region) in one kernel
    assert _members(module) == [["blutrain.mul", "blutrain.add", "blutrain.mul", "blutrain.yield"]]
    fn = bc.compile(_scaled_sum_then_halved)
    args = [bt.from_numpy(a) for a in _arrays(1)]
    want = _scaled_sum_then_halved(*args).numpy()
    for _ in range(3):
        same_bits(fn(*args).numpy(), want)


def _written_between(x: bt.Tensor, y: bt.Tensor, s: bt.Tensor) -> bt.Tensor:
    prod = x * s
    prod.mul_(0.5)  # the product is written before the add reads it: the add may not pull it after the write
    return prod + y


def test_no_fusion_across_an_in_place_write_of_a_member(same_bits: Any) -> None:
    module = bc.trace_module(_written_between, *_arrays(2))
    bc.run_pipeline(module, ["inplace-aliasing", "elementwise-fusion"])
    assert not any("blutrain.add" in m for m in _members(module))
    fn = bc.compile(_written_between)
    args = [bt.from_numpy(a) for a in _arrays(3)]
    want = _written_between(*args).numpy()
    for _ in range(3):
        same_bits(fn(*args).numpy(), want)


def _tiny_gpt_steps(gpt_steps: Any, compiled: bool, autocast: bool) -> tuple[list[np.ndarray[Any, Any]], str]:
    """Four SGD steps of a tied-head GPT through linear_cross_entropy under clip_grad_norm_ (0.5: small enough
    to scale every step's gradients in place): the losses and the final parameters, and the compiled IR."""
    from blutrain.models.gpt2 import GPT2, GPT2Config
    from blutrain.optim import create

    bt.manual_seed(0)
    model = GPT2(GPT2Config.preset("tiny", vocab_size=64, block_size=16, n_layer=2, n_head=2, n_embd=32))
    opt = create("sgd", list(model.parameters()), lr=1e-2)
    out, fn = gpt_steps(model, opt, bc.default_pipeline() if compiled else None, autocast=autocast, clip=0.5,
                        return_logits=False)
    return out, "" if fn is None else str(fn.ir())


@pytest.mark.parametrize("autocast", [False, True], ids=["float32", "autocast-bf16"])
def test_compiled_tied_gpt_sums_the_weight_gradients_in_one_kernel_bit_for_bit(same_bits: Any, autocast: bool,
                                                                              gpt_steps: Any) -> None:
    eager, _ = _tiny_gpt_steps(gpt_steps, False, autocast)
    compiled, ir = _tiny_gpt_steps(gpt_steps, True, autocast)
    for c, e in zip(compiled, eager, strict=True):
        same_bits(np.atleast_1d(c), np.atleast_1d(e))
    assert _summed_in_the_embedding_backward(ir, "64x32"), ir


def _tied_head_steps(device: str, compiled: bool, autocast: bool) -> tuple[list[np.ndarray[Any, Any]], str]:
    """Three SGD steps of a tied embedding and LM head (embedding → tanh → linear_cross_entropy on the same
    [256, 64] weight) with clip_grad_norm_: the weight's gradient is dw · scale + the embedding's gradient,
    clipped in place. The losses and the final weight, and the compiled IR."""
    from blutrain.amp import autocast as region
    from blutrain.optim import clip_grad_norm_, create

    rng = np.random.default_rng(9)
    wte = bt.tensor((rng.standard_normal((256, 64)) * 0.5).astype(np.float32), device=device, requires_grad=True)
    opt = create("sgd", [wte], lr=0.5)

    def step(idx: bt.Tensor, tgt: bt.Tensor) -> bt.Tensor:
        with region(dtype="bfloat16", enabled=autocast):
            loss = bt.linear_cross_entropy(bt.embedding(idx, wte).tanh(), wte, tgt, ignore_index=-1)
        loss.backward()
        clip_grad_norm_([wte], 0.1)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss

    fn: Any = bc.compile(step) if compiled else step
    out = []
    for _ in range(3):
        idx, tgt = (bt.tensor(rng.integers(0, 256, (4, 32)), device=device) for _ in range(2))
        out.append(fn(idx, tgt).detach().cpu().numpy().copy())
    return [*out, wte.detach().cpu().numpy().copy()], fn.ir() if compiled else ""


@pytest.mark.cuda
@pytest.mark.parametrize("autocast", [False, True], ids=["float32", "autocast-bf16"])
def test_on_cuda_the_tied_weight_gradient_sum_is_one_kernel_and_eager_bit_for_bit(same_bits: Any,
                                                                                 autocast: bool) -> None:
    """On cuda the embedding backward kernel multiplies and adds with __fmul_rn / __fadd_rn, the roundings of
    CuPy's separate multiply and add: the compiled steps (dw · scale + the embedding's gradient written by the
    embedding backward, then the clip writing it in place) give eager's losses and weight bit for bit."""
    registry = bt.backends()
    if "cuda" not in registry.names() or not registry.get("cuda").is_available():
        pytest.skip("no CUDA device")
    eager, _ = _tied_head_steps("cuda", False, autocast)
    compiled, ir = _tied_head_steps("cuda", True, autocast)
    assert _summed_in_the_embedding_backward(ir, "256x64"), ir
    for c, e in zip(compiled, eager, strict=True):
        same_bits(np.atleast_1d(c), np.atleast_1d(e))


@pytest.mark.parametrize("autocast", [False, True], ids=["float32", "autocast-bf16"])
def test_the_tied_head_steps_compile_to_eager_bits_on_the_cpu(same_bits: Any, autocast: bool) -> None:
    """The cuda test's model on the CPU: the same fused embedding backward, eager's bits."""
    eager, _ = _tied_head_steps("cpu", False, autocast)
    compiled, ir = _tied_head_steps("cpu", True, autocast)
    assert _summed_in_the_embedding_backward(ir, "256x64"), ir
    for c, e in zip(compiled, eager, strict=True):
        same_bits(np.atleast_1d(c), np.atleast_1d(e))
