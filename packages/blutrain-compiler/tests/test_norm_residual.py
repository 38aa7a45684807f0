"""The layernorm-residual pass: the residual add before a LayerNorm made by the LayerNorm, the projection a
plain bf16 GEMM; where it fires and where it must not, and the compiled results against eager."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import blutrain.compiler as bc
import blutrain.tensor as bt
from blutrain.autograd import no_grad
from blutrain.compiler.dialect import decode
from blutrain.compiler.graph import body

PASS = "layernorm-residual"
PASS_LA = "layernorm-residual-linear-add"
# the default pipeline with the pass that also takes linear_add apart in place of the default one
WITH_LINEAR_ADD = [PASS_LA if p == PASS else p for p in bc.default_pipeline()]


def _ops(fn: Any, *arrays: np.ndarray[Any, Any], passes: tuple[str, ...] = (PASS,)) -> list[Any]:
    module = bc.trace_module(fn, *arrays)
    bc.run_pipeline(module, list(passes))
    return list(body(module).ops)


def _named(ops: list[Any], name: str) -> list[Any]:
    return [o for o in ops if o.name == f"blutrain.{name}"]


def _residual_norms(ops: list[Any]) -> list[Any]:
    """The layer_norm ops that take a residual (7 arguments, the last an operand)."""
    return [o for o in _named(ops, "layer_norm") if len(decode(o.properties["args"])) == 7]


def _arrays(seed: int, rows: int = 6, cols: int = 8) -> list[np.ndarray[Any, Any]]:
    """x, r (the stream), W, b, LayerNorm weight and bias, float32."""
    rng = np.random.default_rng(seed)
    return [rng.standard_normal((rows, cols)).astype(np.float32), rng.standard_normal((rows, cols)).astype(np.float32),
            rng.standard_normal((cols, cols)).astype(np.float32), rng.standard_normal(cols).astype(np.float32),
            rng.standard_normal(cols).astype(np.float32), rng.standard_normal(cols).astype(np.float32)]


def _add_then_norm(x: bt.Tensor, r: bt.Tensor, m: bt.Tensor, c: bt.Tensor, w: bt.Tensor,
                   b: bt.Tensor) -> tuple[bt.Tensor, bt.Tensor]:
    """``r + proj(x)`` under autocast (linear, cast to float32, add) into a LayerNorm; the sum goes on."""
    with bt.autocast(dtype="bfloat16"):
        s = r + bt.linear(x, m, c)
        return bt.layer_norm(s, s.shape[-1], w, b), s * 2


def _linear_add_then_norm(x: bt.Tensor, r: bt.Tensor, m: bt.Tensor, c: bt.Tensor, w: bt.Tensor,
                          b: bt.Tensor) -> tuple[bt.Tensor, bt.Tensor]:
    with bt.autocast(dtype="bfloat16"):
        s = bt.linear_add(r, x, m, c)
        return bt.layer_norm(s, s.shape[-1], w, b), s * 2


def test_the_add_of_a_bf16_projection_goes_into_the_layernorm() -> None:
    ops = _ops(_add_then_norm, *_arrays(0))
    (norm,) = _residual_norms(ops)
    (linear,) = _named(ops, "linear")
    assert norm.operands[0] is linear.results[0] and "bf16" in str(linear.results[0].type)
    assert not _named(ops, "add") and not _named(ops, "linear_add")
    assert [c.results[0] for c in _named(ops, "cast")] == list(linear.operands)  # only x, W and b are cast
    (double,) = _named(ops, "mul")
    assert double.operands[0] is norm.results[3]  # the stream goes on from s
    assert "f32" in str(norm.results[3].type)


def test_the_default_pass_leaves_a_linear_add_alone() -> None:
    """A linear_add's product is not rounded to bf16 before the residual: taking it apart changes eager's bits,
    which only the opt-in pass does."""
    ops = _ops(_linear_add_then_norm, *_arrays(1))
    assert not _residual_norms(ops) and len(_named(ops, "linear_add")) == 1


def test_a_linear_add_becomes_a_bf16_linear_with_a_bf16_bias_and_the_layernorm_adds_the_residual() -> None:
    ops = _ops(_linear_add_then_norm, *_arrays(1), passes=(PASS_LA,))
    (norm,) = _residual_norms(ops)
    (linear,) = _named(ops, "linear")
    assert not _named(ops, "linear_add")
    assert norm.operands[0] is linear.results[0] and "bf16" in str(linear.results[0].type)
    bias_cast = linear.operands[2].owner
    assert bias_cast.name == "blutrain.cast" and "bf16" in str(bias_cast.results[0].type)
    assert _named(ops, "mul")[0].operands[0] is norm.results[3]


def test_the_layernorm_backward_reads_s_as_its_saved_input() -> None:
    def loss(x: bt.Tensor, r: bt.Tensor, m: bt.Tensor, c: bt.Tensor, w: bt.Tensor, b: bt.Tensor) -> bt.Tensor:
        for t in (r, m, w):
            t.requires_grad_()
        y, s = _add_then_norm(x, r, m, c, w, b)
        total = (y * y).sum() + s.sum()
        total.backward()
        return total

    ops = _ops(loss, *_arrays(2))
    (norm,) = _residual_norms(ops)
    (back,) = _named(ops, "layer_norm_backward")
    assert back.operands[decode(back.properties["args"])[1].index] is norm.results[3]


def test_gemm_epilogue_after_it_finds_no_add_to_take() -> None:
    ops = _ops(_add_then_norm, *_arrays(3), passes=(PASS, "gemm-epilogue"))
    assert len(_residual_norms(ops)) == 1 and not _named(ops, "linear_add")


def test_no_fusion_where_the_sum_is_read_before_the_layernorm() -> None:
    def early(x: bt.Tensor, r: bt.Tensor, m: bt.Tensor, c: bt.Tensor, w: bt.Tensor,
              b: bt.Tensor) -> tuple[bt.Tensor, bt.Tensor]:
        with bt.autocast(dtype="bfloat16"):
            s = r + bt.linear(x, m, c)
            t = s * 2  # read before the LayerNorm makes s
            return bt.layer_norm(s, s.shape[-1], w, b), t

    ops = _ops(early, *_arrays(4))
    assert not _residual_norms(ops) and len(_named(ops, "add")) == 1


def test_no_fusion_where_the_residual_is_written_between_the_add_and_the_layernorm() -> None:
    def overwrite(x: bt.Tensor, r: bt.Tensor, m: bt.Tensor, c: bt.Tensor, w: bt.Tensor, b: bt.Tensor) -> bt.Tensor:
        with bt.autocast(dtype="bfloat16"):
            s = r + bt.linear(x, m, c)
        r.mul_(3.0)  # the moved add would read the new r
        return bt.layer_norm(s, s.shape[-1], w, b)

    ops = _ops(overwrite, *_arrays(5))
    assert not _residual_norms(ops) and len(_named(ops, "add")) == 1


def test_no_fusion_where_the_product_has_another_reader() -> None:
    def twice(x: bt.Tensor, r: bt.Tensor, m: bt.Tensor, c: bt.Tensor, w: bt.Tensor,
              b: bt.Tensor) -> tuple[bt.Tensor, bt.Tensor]:
        with bt.autocast(dtype="bfloat16"):
            p = bt.linear(x, m, c)
            s = r + p
            return bt.layer_norm(s, s.shape[-1], w, b), p.float()

    assert not _residual_norms(_ops(twice, *_arrays(6)))


def test_no_fusion_of_a_float32_projection() -> None:
    def plain(x: bt.Tensor, r: bt.Tensor, m: bt.Tensor, c: bt.Tensor, w: bt.Tensor, b: bt.Tensor) -> bt.Tensor:
        s = r + bt.linear(x, m, c)  # no autocast: gemm-epilogue's case, not this pass's
        return bt.layer_norm(s, s.shape[-1], w, b)

    assert not _residual_norms(_ops(plain, *_arrays(7)))


def test_no_fusion_where_no_layernorm_reads_the_sum() -> None:
    def last(x: bt.Tensor, r: bt.Tensor, m: bt.Tensor, c: bt.Tensor, w: bt.Tensor, b: bt.Tensor) -> bt.Tensor:
        with bt.autocast(dtype="bfloat16"):
            return r + bt.linear(x, m, c)

    ops = _ops(last, *_arrays(8), passes=(PASS, "gemm-epilogue"))
    assert not _named(ops, "layer_norm") and len(_named(ops, "linear_add")) == 1  # gemm-epilogue's, as before


def test_the_layernorm_cast_pass_then_gives_the_fused_layernorm_a_bf16_output() -> None:
    def norm_gemm(x: bt.Tensor, r: bt.Tensor, m: bt.Tensor, c: bt.Tensor, w: bt.Tensor, b: bt.Tensor) -> bt.Tensor:
        with bt.autocast(dtype="bfloat16"):
            s = r + bt.linear(x, m, c)
            return bt.linear(bt.layer_norm(s, s.shape[-1], w, b), m)

    ops = _ops(norm_gemm, *_arrays(9), passes=(PASS, "layernorm-cast"))
    (norm,) = _residual_norms(ops)
    assert "bf16" in str(norm.results[0].type) and "f32" in str(norm.results[3].type)
    assert decode(norm.properties["args"])[5] is not None


@settings(max_examples=15, deadline=None)
@given(st.integers(1, 9), st.integers(1, 12), st.booleans(), st.integers(0, 2**16))
def test_compiled_autocast_residual_blocks_train_as_eager_bit_for_bit(sgd_eager_and_compiled: Any, same_bits: Any,
                                                                     rows: int, cols: int, affine: bool,
                                                                     seed: int) -> None:
    """Two pre-LN residual blocks written as ``r + proj(h)`` under autocast: the LayerNorm adds the bf16
    product with the add's one rounding, so four SGD steps are eager's bits at any shape."""
    rng = np.random.default_rng(seed)
    shapes = ((rows, cols), (cols, cols), cols, (cols, cols), cols, cols, cols)
    x, m1, c1, m2, c2, w, b = (rng.standard_normal(s).astype(np.float32) for s in shapes)

    def loss(xt: bt.Tensor, m1: bt.Tensor, c1: bt.Tensor, m2: bt.Tensor, c2: bt.Tensor, w: Any,
             b: Any) -> bt.Tensor:
        with bt.autocast(dtype="bfloat16"):
            s = xt + bt.linear(bt.layer_norm(xt, cols, w, b), m1, c1)
            s = s + bt.linear(bt.layer_norm(s, cols, w, b).tanh(), m2, c2)
            y = bt.layer_norm(s, cols, w, b)
        return (y * y).sum() + s.sum()

    params = [m1, c1, m2, c2, w if affine else None, b if affine else None]
    eager, compiled, ir = sgd_eager_and_compiled(loss, params, x)
    assert ir.count("blutrain.layer_norm\"") == 3 and ir.count("blutrain.linear_add") == 0
    for a, c in zip(eager, compiled, strict=True):
        same_bits(c, a)


def _gpt(hooked: bool, device: str = "cpu", n_embd: int = 32, vocab: int = 64, block: int = 16) -> Any:
    """A tiny GPT; ``hooked``: forward hooks on the output projections, so that the blocks add the residual
    as ``r + proj(h)`` (the hook sees the projection) instead of calling ``linear_add``."""
    from blutrain.models.gpt2 import GPT2, GPT2Config

    bt.manual_seed(0)
    cfg = GPT2Config.preset("tiny", vocab_size=vocab, block_size=block, n_layer=2, n_head=2, n_embd=n_embd)
    model = GPT2(cfg).to(device)
    if hooked:
        for blk in model.transformer.h:
            for proj in (blk.attn.c_proj, blk.mlp.c_proj):
                proj.register_forward_hook(lambda m, i, o: None)
    return model


_LAST: dict[str, str] = {}  # the executor the last compiled run replayed with, and why it fell back if it did


def _gpt_runs(gpt_steps: Any, optimizer: str, passes: list[str] | None, hooked: bool, device: str = "cpu",
              steps: int = 4, big: bool = False) -> tuple[list[Any], str]:
    """Losses and final parameters of a tiny GPT trained under bf16 autocast (``big``: C = 128, vocab 256,
    T = 64, batch 8), compiled with ``passes`` or eagerly (None), and the compiled IR."""
    from blutrain.optim import create

    vocab, T, B = (256, 64, 8) if big else (64, 16, 4)
    model = _gpt(hooked, device, n_embd=128 if big else 32, vocab=vocab, block=T)
    extra: dict[str, Any] = {"betas": (0.9, 0.95)} if optimizer == "adamw" else {}
    opt = create(optimizer, model.parameters(), lr=1e-2, **extra)
    out, fn = gpt_steps(model, opt, passes, steps=steps, shape=(B, T), ids=vocab, device=device)
    if fn is None:
        return out, ""
    executor = fn.last.executor
    _LAST["executor"] = f"{type(executor).__name__} eager={getattr(executor, 'eager', None)} " \
                        f"{getattr(executor, 'capture_error', '')}"
    return out, str(fn.ir())


@pytest.mark.parametrize("optimizer", ["sgd", "adamw"])
def test_compiled_autocast_gpt_with_unfused_projections_trains_as_eager_bit_for_bit(optimizer: str, same_bits: Any,
                                                                                     gpt_steps: Any) -> None:
    """The default pipeline on a GPT whose blocks trace ``r + proj(h)``: all four sums (two blocks, each read by
    ln_2 and the next ln_1 or ln_f) go into their LayerNorms, none into a GEMM epilogue, and four steps are
    eager's bits."""
    eager, _ = _gpt_runs(gpt_steps, optimizer, None, hooked=True)
    compiled, ir = _gpt_runs(gpt_steps, optimizer, list(bc.default_pipeline()), hooked=True)
    assert ir.count(", 3 : index], ret = [0 : index, 1 : index, 2 : index, 3 : index]") == 4
    assert "linear_add" not in ir
    for a, c in zip(eager, compiled, strict=True):
        same_bits(c, a)


def _forward(model: Any) -> Any:
    def fwd(x: bt.Tensor) -> bt.Tensor:
        with no_grad(), bt.autocast(dtype="bfloat16"):
            out: bt.Tensor = model.transformer(x)
            return out

    return fwd


def test_a_compiled_linear_add_gpt_computes_the_forward_of_the_unfused_eager_model_bit_for_bit(
        same_bits: Any) -> None:
    """The model's own ``linear_add`` projections, rewritten by the opt-in pass: the compiled hidden states are
    the bits of the eager model that adds ``r + proj(h)`` (the product rounded to bf16 first), not of eager
    ``linear_add``."""
    fused_model, unfused_model = _gpt(False), _gpt(True)
    fn = bc.compile(_forward(fused_model), passes=WITH_LINEAR_ADD)
    x = bt.tensor(np.random.default_rng(1).integers(0, 64, (4, 16)))
    got = [fn(x).numpy().copy() for _ in range(3)][-1]  # call 3 replays the compiled graph
    assert fn.ir().count("blutrain.linear_add") == 0
    same_bits(got, _forward(unfused_model)(x).numpy())
    assert not np.array_equal(got, _forward(fused_model)(x).numpy())  # eager linear_add rounds once fewer


def _cuda() -> None:
    registry = bt.backends()
    if "cuda" not in registry.names() or not registry.get("cuda").is_available():
        pytest.skip("no CUDA device")


@pytest.mark.cuda
def test_on_cuda_the_compiled_gpt_with_unfused_projections_matches_eager_bit_for_bit(gpt_steps: Any) -> None:
    """The residual LayerNorm kernel on cuda gives the bits of the add followed by the float32 (or
    float32-to-bf16) LayerNorm kernel: six AdamW steps of the hooked tiny GPT (C = 128: the VEC 4 kernels),
    replayed as a CUDA graph, are eager's bits."""
    _cuda()
    from blutrain_backend_cupy.compile_target import CUDAGraphExecutor

    eager, _ = _gpt_runs(gpt_steps, "adamw", None, hooked=True, device="cuda", steps=6, big=True)
    compiled, ir = _gpt_runs(gpt_steps, "adamw", list(bc.default_pipeline()), hooked=True, device="cuda", steps=6,
                             big=True)
    assert ir.count(", 3 : index], ret = [0 : index, 1 : index, 2 : index, 3 : index]") == 4
    assert "linear_add" not in ir
    for a, c in zip(eager, compiled, strict=True):
        np.testing.assert_array_equal(np.asarray(c).reshape(-1).view(np.uint8),
                                      np.asarray(a).reshape(-1).view(np.uint8))
    assert _LAST["executor"].startswith(f"{CUDAGraphExecutor.__name__} eager=False"), _LAST["executor"]


@pytest.mark.cuda
def test_on_cuda_a_compiled_linear_add_gpt_computes_the_unfused_eager_forward_bit_for_bit(same_bits: Any) -> None:
    """On cuda the rewritten ``linear_add`` is a bf16 cuBLAS GEMM and the residual LayerNorm: the eager
    forward of ``r + proj(h)`` bit for bit (the same GEMM, the add's and the LayerNorm's bits)."""
    _cuda()
    fused_model, unfused_model = _gpt(False, "cuda", 128, 256, 64), _gpt(True, "cuda", 128, 256, 64)
    fn = bc.compile(_forward(fused_model), passes=WITH_LINEAR_ADD)
    x = bt.tensor(np.random.default_rng(1).integers(0, 256, (8, 64)), device="cuda")
    got = [fn(x).cpu().numpy().copy() for _ in range(3)][-1]
    assert fn.ir().count("blutrain.linear_add") == 0
    same_bits(got, _forward(unfused_model)(x).cpu().numpy())
