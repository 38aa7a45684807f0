"""The layernorm-grad-outputs pass: the bf16 cast and the column sum of a LayerNorm's input gradient written by
``layer_norm_backward`` itself instead of by a cast and a sum that read dx again; the compiled results against
eager."""

from __future__ import annotations

import re
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import blutrain.compiler as bc
import blutrain.tensor as bt
from blutrain.compiler.graph import body

# a layer_norm_backward call that writes dx's bf16 copy and its column sums
FUSED = re.compile(r'"blutrain\.layer_norm_backward".*args = \[[^]]*\{np_dtype = "bfloat16"\}, true\]')
PIPELINE = ["inplace-aliasing", "dce", "cse", "dce", "gemm-epilogue", "layernorm-grad-add", "layernorm-cast",
            "layernorm-grad-outputs"]


def _grad_readers(x: bt.Tensor, w: bt.Tensor, b: bt.Tensor) -> tuple[bt.Tensor, bt.Tensor]:
    """A LayerNorm input gradient as autocast's projections read it: cast to bf16, and summed over its rows
    (a float32 bias's gradient)."""
    from blutrain.autograd import grad

    x = x.detach().requires_grad_(True)
    (dx,) = grad(bt.layer_norm(x, x.shape[-1], w, b).tanh().sum(), [x])
    return dx.to(dtype="bfloat16"), dx.reshape(-1, dx.shape[-1]).sum(dim=0)


def _ops(fn: Any, *arrays: np.ndarray) -> list[Any]:
    module = bc.trace_module(fn, *arrays)
    bc.run_pipeline(module, PIPELINE)
    return list(body(module).ops)


def _norms(ops: list[Any]) -> list[Any]:
    return [o for o in ops if o.name == "blutrain.layer_norm_backward"]


def _arrays(seed: int, shape: tuple[int, ...] = (2, 3, 8), dtype: Any = np.float32) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    c = shape[-1]
    return [rng.standard_normal(shape).astype(dtype), rng.standard_normal(c).astype(dtype),
            rng.standard_normal(c).astype(dtype)]


def test_the_cast_and_the_column_sum_are_written_by_the_backward() -> None:
    ops = _ops(_grad_readers, *_arrays(0))
    (norm,) = _norms(ops)
    types = [str(r.type) for r in norm.results]
    assert types[-2:] == ["tensor<2x3x8xbf16>", "tensor<8xf32>"]  # dx's copy and column sums
    assert not any(o.name in ("blutrain.cast", "blutrain.sum") for o in ops)
    assert not any(o.name == "blutrain.view" and o.operands[0] is norm.results[0] for o in ops)  # the sum's view
    returned = list(ops[-1].operands)
    assert returned == list(norm.results[-2:])


def test_a_sum_of_dx_over_its_leading_dims_is_folded_too() -> None:
    def direct(x: bt.Tensor, w: bt.Tensor, b: bt.Tensor) -> bt.Tensor:
        from blutrain.autograd import grad

        x = x.detach().requires_grad_(True)
        (dx,) = grad(bt.layer_norm(x, x.shape[-1], w, b).tanh().sum(), [x])
        return dx.sum(dim=(0, 1))

    ops = _ops(direct, *_arrays(1))
    (norm,) = _norms(ops)
    assert str(norm.results[-1].type) == "tensor<8xf32>" and not any(o.name == "blutrain.sum" for o in ops)


def test_a_reader_after_a_write_into_dx_reads_it_where_it_was() -> None:
    """dx changed in place between the backward and the cast: the cast stays, the sum before it is folded."""
    def written(x: bt.Tensor, w: bt.Tensor, b: bt.Tensor) -> tuple[bt.Tensor, bt.Tensor]:
        from blutrain.autograd import grad

        x = x.detach().requires_grad_(True)
        (dx,) = grad(bt.layer_norm(x, x.shape[-1], w, b).tanh().sum(), [x])
        total = dx.reshape(-1, dx.shape[-1]).sum(dim=0)
        dx.mul_(2.0)
        return dx.to(dtype="bfloat16"), total

    ops = _ops(written, *_arrays(2))
    (norm,) = _norms(ops)
    casts = [o for o in ops if o.name == "blutrain.cast"]
    assert len(casts) == 1 and all("bf16" not in str(r.type) for r in norm.results)
    assert not any(o.name == "blutrain.sum" for o in ops)


def test_no_fold_for_other_readers_dtypes_or_reductions() -> None:
    def others(x: bt.Tensor, w: bt.Tensor, b: bt.Tensor) -> tuple[bt.Tensor, ...]:
        from blutrain.autograd import grad

        x = x.detach().requires_grad_(True)
        (dx,) = grad(bt.layer_norm(x, x.shape[-1], w, b).tanh().sum(), [x])
        return (dx.to(dtype="float16"),  # not autocast's bf16
                dx.sum(dim=-1),  # row sums
                dx.sum(dim=0, keepdim=True),  # keeps a dim: not the normalized shape
                dx[:, :2].reshape(-1, dx.shape[-1]).sum(dim=0))  # a part of dx

    def float64(x: bt.Tensor, w: bt.Tensor, b: bt.Tensor) -> tuple[bt.Tensor, bt.Tensor]:
        return _grad_readers(x, w, b)

    for fn, arrays in ((others, _arrays(3, (4, 3, 8))), (float64, _arrays(4, dtype=np.float64))):
        (norm,) = _norms(_ops(fn, *arrays))
        assert len(norm.properties["args"].data) == 8, fn.__name__  # no addend, no copy dtype, no sums


def test_dx_keeps_its_other_readers() -> None:
    def also_returned(x: bt.Tensor, w: bt.Tensor, b: bt.Tensor) -> tuple[bt.Tensor, ...]:
        from blutrain.autograd import grad

        x = x.detach().requires_grad_(True)
        (dx,) = grad(bt.layer_norm(x, x.shape[-1], w, b).tanh().sum(), [x])
        return dx, dx.to(dtype="bfloat16"), dx.reshape(-1, dx.shape[-1]).sum(dim=0)

    ops = _ops(also_returned, *_arrays(5))
    (norm,) = _norms(ops)
    assert list(ops[-1].operands) == [norm.results[0], *norm.results[-2:]]


@settings(max_examples=15, deadline=None)
@given(st.integers(1, 4), st.integers(1, 6), st.integers(1, 12), st.booleans(), st.integers(0, 2**16))
def test_compiled_autocast_residual_block_trains_as_eager_bit_for_bit(sgd_eager_and_compiled: Any, same_bits: Any,
                                                                      batch: int, rows: int, cols: int, affine: bool,
                                                                      seed: int) -> None:
    """A float32 residual stream through two pre-LN projections under autocast (GPT-2's shape): each
    LayerNorm's dx (plus the stream's gradient) is cast to bf16 for the projection's GEMMs and summed for its
    float32 bias. The fused backward's copy is the cast's bits and its sums NumPy's own: four SGD steps are
    eager's bit for bit on the CPU."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((batch, rows, cols)).astype(np.float32)
    params = [rng.standard_normal(s).astype(np.float32) * 0.5 for s in
              ((cols, cols), cols, cols, cols, (cols, cols), cols, cols, cols)]
    if not affine:
        params[1] = params[2] = params[5] = params[6] = None

    def loss(xt: bt.Tensor, m1: bt.Tensor, w1: Any, b1: Any, c1: bt.Tensor, m2: bt.Tensor, w2: Any, b2: Any,
             c2: bt.Tensor) -> bt.Tensor:
        with bt.autocast(dtype="bfloat16"):
            h = bt.linear_add(xt, bt.layer_norm(xt, cols, w1, b1), m1, c1)
            h = bt.linear_add(h, bt.layer_norm(h, cols, w2, b2), m2, c2)
            y = bt.layer_norm(h, cols)
        return (y * y).sum()

    eager, compiled, ir = sgd_eager_and_compiled(loss, params, x)
    assert len(FUSED.findall(ir)) == 2, ir  # the two projections' gradients: the last LayerNorm's and the middle's
    for a, c in zip(eager, compiled, strict=True):
        same_bits(c, a)


def test_compiled_tiny_gpt_under_autocast_trains_as_eager_bit_for_bit(same_bits: Any) -> None:
    """GPT-2's blocks: every LayerNorm backward whose dx reaches a projection (ln_f's and each block's ln_2's,
    and ln_1's of all blocks but the first, whose dx goes to the embeddings) writes the copy and the sums; four
    SGD steps are eager's bits on the CPU."""
    from blutrain.models.gpt2 import GPT2, GPT2Config
    from blutrain.optim import create

    def run(compiled: bool) -> tuple[list[np.ndarray], str]:
        bt.manual_seed(0)
        model = GPT2(GPT2Config(block_size=8, vocab_size=32, n_layer=2, n_head=2, n_embd=16))
        opt = create("sgd", list(model.parameters()), lr=0.01)

        def step(idx: bt.Tensor, tgt: bt.Tensor) -> bt.Tensor:
            with bt.autocast(dtype="bfloat16"):
                _, loss = model(idx, tgt)
            loss.backward()
            opt.step()
            opt.zero_grad()
            return loss

        rng = np.random.default_rng(0)
        idx, tgt = (bt.from_numpy(rng.integers(0, 32, (2, 8))) for _ in range(2))
        fn: Any = bc.compile(step) if compiled else step
        losses = [fn(idx, tgt).detach().numpy().copy() for _ in range(4)]
        return [*losses, *(p.detach().numpy().copy() for p in model.parameters())], fn.ir() if compiled else ""

    eager, _ = run(False)
    compiled, ir = run(True)
    assert len(FUSED.findall(ir)) == 4, ir  # ln_f, ln_2 twice, the second block's ln_1
    for a, c in zip(eager, compiled, strict=True):
        same_bits(c, a)


@pytest.mark.cuda
def test_on_cuda_the_folded_cast_and_column_sum_match_eager() -> None:
    """float32 on cuda: the bf16 copy is the cast kernel's bits; the column sums add in the LayerNorm
    backward's order, not sum_cols', so they are held to float32 rounding of the float64 sums of eager's dx
    (rows * 2^-24 of the summed magnitudes)."""
    registry = bt.backends()
    if "cuda" not in registry.names() or not registry.get("cuda").is_available():
        pytest.skip("no CUDA device")
    host = _arrays(6, (8, 512, 768))
    x, w, b = (bt.from_numpy(a).to("cuda") for a in host)

    fn = bc.compile(_grad_readers)
    got = [tuple(t.float().cpu().numpy() for t in fn(x, w, b)) for _ in range(3)]
    assert FUSED.search(fn.ir())
    from blutrain.autograd import grad

    xe = x.detach().requires_grad_(True)
    (dx,) = grad(bt.layer_norm(xe, 768, w, b).tanh().sum(), [xe])
    dx64 = dx.cpu().numpy().astype(np.float64).reshape(-1, 768)
    want_copy = dx.to(dtype="bfloat16").float().cpu().numpy()
    bound = dx64.shape[0] * 2.0**-24 * np.abs(dx64).sum(axis=0)
    for copy, total in got:
        np.testing.assert_array_equal(copy, want_copy)
        assert np.all(np.abs(total.astype(np.float64) - dx64.sum(axis=0)) <= bound)
