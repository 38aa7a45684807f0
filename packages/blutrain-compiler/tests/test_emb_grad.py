"""The embedding-grad-add pass: a tied weight's gradient sum ``dw · s + embedding_backward(...)`` (or ``g +
embedding_backward(...)``) becomes one ``embedding_backward`` with an addend (and its 0-d scale); where it must
not fire; and compiled steps of a tied GPT (float32 and bf16 autocast, clip_grad_norm_ and AdamW) that stay
eager's bit for bit."""

from __future__ import annotations

import re
from typing import Any

import numpy as np
import pytest

import blutrain.compiler as bc
import blutrain.tensor as bt
from blutrain.compiler.graph import body

# an embedding backward with four operands: grad, ids, the addend and the 0-d scale
SCALED = re.compile(r'"blutrain\.embedding_backward"\(%\w+, %\w+, %\w+, %\w+\)')


def _grad_of_embedding(w: bt.Tensor, idx: bt.Tensor, h: bt.Tensor) -> bt.Tensor:
    from blutrain.autograd import grad

    w = w.detach().requires_grad_(True)
    (ge,) = grad((bt.embedding(idx, w) * h).sum(), [w])
    return ge


def _scaled_sum(w: bt.Tensor, idx: bt.Tensor, h: bt.Tensor, other: bt.Tensor, s: bt.Tensor) -> bt.Tensor:
    return other * s + _grad_of_embedding(w, idx, h)


def _plain_sum(w: bt.Tensor, idx: bt.Tensor, h: bt.Tensor, other: bt.Tensor, s: bt.Tensor) -> bt.Tensor:
    return other + _grad_of_embedding(w, idx, h)


def _arrays(seed: int, vocab: int = 11, dim: int = 6, ntok: int = 9) -> list[np.ndarray[Any, Any]]:
    rng = np.random.default_rng(seed)
    return [rng.standard_normal((vocab, dim)).astype(np.float32), rng.integers(0, vocab // 2, ntok),
            rng.standard_normal((ntok, dim)).astype(np.float32), rng.standard_normal((vocab, dim)).astype(np.float32),
            np.asarray(rng.uniform(0.1, 2.0), np.float32)]


def _embedding_backwards(fn: Any, arrays: list[np.ndarray[Any, Any]]) -> tuple[list[Any], list[str]]:
    """The embedding_backward ops after the pass, and the names of the other ops that make or read a tensor of
    the weight's type (the product and the sum, where they stay)."""
    module = bc.trace_module(fn, *arrays)
    bc.run_pipeline(module, ["inplace-aliasing", "dce", "embedding-grad-add"])
    ops = list(body(module).ops)
    weight = body(module).args[0].type
    weighty = [o.name for o in ops if o.name != "blutrain.embedding_backward"
               and any(v.type == weight for v in (*o.operands, *o.results))]
    return [o for o in ops if o.name == "blutrain.embedding_backward"], weighty


def _compiled_matches_eager(fn: Any, arrays: list[np.ndarray[Any, Any]], same_bits: Any) -> str:
    compiled = bc.compile(fn)
    args = [bt.from_numpy(a) for a in arrays]
    want = fn(*args)
    wants = want if isinstance(want, tuple) else (want,)
    for _ in range(3):
        got = compiled(*args)
        for g, w in zip(got if isinstance(got, tuple) else (got,), wants, strict=True):
            same_bits(g.numpy(), w.numpy())
    return compiled.ir()


def test_the_scaled_head_gradient_goes_into_the_embedding_backward(same_bits: Any) -> None:
    embs, names = _embedding_backwards(_scaled_sum, _arrays(0))
    assert len(embs) == 1 and len(embs[0].operands) == 4  # grad, ids, addend, scale
    assert "blutrain.add" not in names and "blutrain.mul" not in names
    assert SCALED.search(_compiled_matches_eager(_scaled_sum, _arrays(1), same_bits))


def test_an_unscaled_gradient_goes_in_as_the_addend_alone(same_bits: Any) -> None:
    embs, names = _embedding_backwards(_plain_sum, _arrays(2))
    assert len(embs) == 1 and len(embs[0].operands) == 3 and "blutrain.add" not in names
    _compiled_matches_eager(_plain_sum, _arrays(3), same_bits)


def _scale_first(w: bt.Tensor, idx: bt.Tensor, h: bt.Tensor, other: bt.Tensor, s: bt.Tensor) -> bt.Tensor:
    return s * other + _grad_of_embedding(w, idx, h)  # mul(s, g): not the rule's operand order


def _product_read_twice(w: bt.Tensor, idx: bt.Tensor, h: bt.Tensor, other: bt.Tensor,
                        s: bt.Tensor) -> tuple[bt.Tensor, bt.Tensor]:
    p = other * s
    return p + _grad_of_embedding(w, idx, h), p


def _operand_written_before_the_add(w: bt.Tensor, idx: bt.Tensor, h: bt.Tensor, other: bt.Tensor,
                                    s: bt.Tensor) -> bt.Tensor:
    g = other * 1.0
    p = g * s
    g.mul_(0.5)  # the product's operand changes before the add: the fused op would read the halved values
    return p + _grad_of_embedding(w, idx, h)


@pytest.mark.parametrize("fn", [_scale_first, _product_read_twice, _operand_written_before_the_add])
def test_the_product_stays_and_is_the_addend_where_it_cannot_move(fn: Any, same_bits: Any) -> None:
    embs, names = _embedding_backwards(fn, _arrays(4))
    assert len(embs) == 1 and len(embs[0].operands) == 3 and "blutrain.mul" in names
    _compiled_matches_eager(fn, _arrays(5), same_bits)


def _embedding_gradient_first(w: bt.Tensor, idx: bt.Tensor, h: bt.Tensor, other: bt.Tensor,
                              s: bt.Tensor) -> bt.Tensor:
    return _grad_of_embedding(w, idx, h) + other * s  # the CPU's NaN payload is the first operand's


def _embedding_gradient_read_twice(w: bt.Tensor, idx: bt.Tensor, h: bt.Tensor, other: bt.Tensor,
                                   s: bt.Tensor) -> tuple[bt.Tensor, bt.Tensor]:
    ge = _grad_of_embedding(w, idx, h)
    return other * s + ge, ge


def _broadcast_addend(w: bt.Tensor, idx: bt.Tensor, h: bt.Tensor, other: bt.Tensor, s: bt.Tensor) -> bt.Tensor:
    return other[0] * s + _grad_of_embedding(w, idx, h)  # a row broadcast over the weight: not its gradient


def _half_embedding_gradient_cast_up(w: bt.Tensor, idx: bt.Tensor, h: bt.Tensor, other: bt.Tensor,
                                     s: bt.Tensor) -> bt.Tensor:
    ge = _grad_of_embedding(w.to(dtype=bt.bfloat16), idx, h.to(dtype=bt.bfloat16))
    return other * s + ge.to(dtype=bt.float32)  # a cast between: the sum is not of the kernel's dtype


@pytest.mark.parametrize("fn", [_embedding_gradient_first, _embedding_gradient_read_twice, _broadcast_addend,
                                _half_embedding_gradient_cast_up])
def test_no_fusion(fn: Any, same_bits: Any) -> None:
    embs, _ = _embedding_backwards(fn, _arrays(6))
    assert len(embs) == 1 and len(embs[0].operands) == 2
    _compiled_matches_eager(fn, _arrays(7), same_bits)


def test_the_sum_is_eager_bit_for_bit_with_nan_infinity_and_signed_zeros(same_bits: Any) -> None:
    arrays = _arrays(8)
    other = arrays[3]
    other[:, 0] = -0.0  # rows no id selects (ids < vocab // 2): -0.0 · s + 0 is +0.0
    other[0, 1], other[-1, 1], other[1, 2], other[-2, 2] = np.nan, np.nan, np.inf, -np.inf
    _compiled_matches_eager(_scaled_sum, arrays, same_bits)


def _tiny_gpt_steps(gpt_steps: Any, device: str, compiled: bool, autocast: bool,
                    passes: tuple[str, ...] | None = None) -> tuple[list[np.ndarray[Any, Any]], str]:
    """Four AdamW steps of a tiny tied GPT-2 (linear_cross_entropy head) with clip_grad_norm_: the losses and
    the final parameters, and the compiled IR (``passes``: the default pipeline when None)."""
    from blutrain.models.gpt2 import GPT2, GPT2Config
    from blutrain.optim import create

    bt.manual_seed(0)
    model = GPT2(GPT2Config.preset("tiny", vocab_size=64, block_size=16, n_layer=2, n_head=2, n_embd=32))
    model.to(device)
    opt = create("adamw", list(model.parameters()), lr=1e-2, weight_decay=0.1)
    pipeline = (passes or bc.default_pipeline()) if compiled else None
    out, fn = gpt_steps(model, opt, pipeline, ids=48, device=device, autocast=autocast, clip=0.5,
                        return_logits=False)  # ids >= 48 unused
    return out, "" if fn is None else str(fn.ir())


@pytest.mark.parametrize("autocast", [False, True], ids=["float32", "autocast-bf16"])
def test_compiled_tied_gpt_with_clip_and_adamw_is_eager_bit_for_bit(same_bits: Any, autocast: bool,
                                                                     gpt_steps: Any) -> None:
    eager, _ = _tiny_gpt_steps(gpt_steps, "cpu", False, autocast)
    compiled, ir = _tiny_gpt_steps(gpt_steps, "cpu", True, autocast)
    assert len(SCALED.findall(ir)) == 1, ir
    for c, e in zip(compiled, eager, strict=True):
        same_bits(np.atleast_1d(c), np.atleast_1d(e))


@pytest.mark.cuda
@pytest.mark.parametrize("autocast", [False, True], ids=["float32", "autocast-bf16"])
def test_on_cuda_the_compiled_tied_gpt_with_the_pass_is_bit_for_bit_without_it(same_bits: Any, autocast: bool,
                                                                              gpt_steps: Any) -> None:
    """On cuda the embedding backward's addend rounds as the elementwise-fusion kernel it replaces
    (__fmul_rn, then __fadd_rn with the product first): the compiled steps with the pass are the compiled steps
    without it, bit for bit (both graphs run the same GEMMs and reductions, so eager's cuBLAS choices play no
    part), and the pass fired once."""
    registry = bt.backends()
    if "cuda" not in registry.names() or not registry.get("cuda").is_available():
        pytest.skip("no CUDA device")
    without = tuple(p for p in bc.default_pipeline() if p != "embedding-grad-add")
    base, base_ir = _tiny_gpt_steps(gpt_steps, "cuda", True, autocast, without)
    fused, ir = _tiny_gpt_steps(gpt_steps, "cuda", True, autocast)
    assert len(SCALED.findall(ir)) == 1 and not SCALED.search(base_ir), ir
    for c, e in zip(fused, base, strict=True):
        same_bits(np.atleast_1d(c), np.atleast_1d(e))
