"""The rematerialize pass: a cheap forward value that a backward op reads much later is made again right before that
reader from operands alive there anyway; where it must not fire; compiled GPT-2 steps with it are eager's bit for
bit, with a smaller planned arena; and ``compile(remat=...)`` places or leaves out the pass."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import blutrain.compiler as bc
import blutrain.tensor as bt
from blutrain.compiler.graph import body
from blutrain.compiler.passes.remat import MIN_GAP
from blutrain.compiler.registry import with_remat

PASS = "rematerialize"


def _ops(fn: Any, *arrays: np.ndarray[Any, Any], passes: tuple[str, ...] = (PASS,)) -> tuple[list[Any], Any]:
    module = bc.trace_module(fn, *arrays)
    bc.run_pipeline(module, list(passes))
    return list(body(module).ops), module


def _named(ops: list[Any], name: str) -> list[Any]:
    return [o for o in ops if o.name == f"blutrain.{name}"]


def _arrays(seed: int, rows: int = 6, cols: int = 8) -> list[np.ndarray[Any, Any]]:
    """x, W1, W2 (float32)."""
    rng = np.random.default_rng(seed)
    return [rng.standard_normal((rows, cols)).astype(np.float32),
            rng.standard_normal((cols, cols)).astype(np.float32),
            rng.standard_normal((cols, cols)).astype(np.float32)]


def _head(y: bt.Tensor) -> bt.Tensor:
    """Enough ops after the projection that its weight gradient comes more than MIN_GAP ops after the forward (each
    softmax and its backward one kernel: no op here fuses or is recomputed)."""
    for _ in range(MIN_GAP):
        y = bt.softmax(y, -1)
    return y.sum()


def _mlp_loss(activation: Any) -> Any:
    """``loss(x, W1, W2) = head(linear(activation(linear(x, W1)), W2))``, its backward run: W2's gradient reads
    the activation's output."""

    def loss(x: bt.Tensor, w1: bt.Tensor, w2: bt.Tensor) -> bt.Tensor:
        w1.requires_grad_()
        w2.requires_grad_()
        h = activation(bt.linear(x, w1))
        total = _head(bt.linear(h, w2))
        total.backward()
        return total

    return loss


def _reads(op: Any, value: Any) -> bool:
    return any(v is value for v in op.operands)


def test_a_gelu_output_is_made_again_before_the_weight_gradient_that_reads_it() -> None:
    ops, module = _ops(_mlp_loss(bt.gelu), *_arrays(0))
    original, copy = _named(ops, "gelu")
    forward_gemm, _ = _named(ops, "linear")  # the two forward projections, in order
    grads = _named(ops, "linear_backward")
    second = _named(ops, "linear")[1]
    assert _reads(second, original.results[0])  # the forward reads the original
    # W2's gradient (the first linear_backward) reads the copy, made right before it from the same pre-activation
    assert _reads(grads[0], copy.results[0]) and not _reads(grads[0], original.results[0])
    assert ops.index(copy) == ops.index(grads[0]) - 1
    assert list(copy.operands) == list(original.operands) == [forward_gemm.results[0]]
    assert int(module.attributes["blutrain.recomputed"].data) == 1


def test_a_swiglu_output_is_made_again_from_the_gate_and_up_its_backward_keeps() -> None:
    def loss(x: bt.Tensor, w1: bt.Tensor, w2: bt.Tensor) -> bt.Tensor:
        for t in (w1, w2):
            t.requires_grad_()
        h = bt.swiglu(bt.linear(x, w1), bt.linear(x, w1 * 2))
        total = _head(bt.linear(h, w2))
        total.backward()
        return total

    ops, _ = _ops(loss, *_arrays(1))
    original, copy = _named(ops, "swiglu")
    (back,) = _named(ops, "swiglu_backward")
    assert list(copy.operands) == list(original.operands)
    assert ops.index(copy) < ops.index(back)
    assert not any(_reads(o, original.results[0]) for o in ops[ops.index(copy):])


def test_a_norm_output_is_made_again_and_its_statistics_stay_the_originals() -> None:
    def loss(x: bt.Tensor, w1: bt.Tensor, w2: bt.Tensor) -> bt.Tensor:
        w2.requires_grad_()
        g = bt.ones(8).requires_grad_()
        y = bt.rms_norm(x, 8, g)
        total = _head(bt.linear(y, w2))
        total.backward()
        return total

    ops, _ = _ops(loss, *_arrays(2))
    original, copy = _named(ops, "rms_norm")
    (back,) = _named(ops, "rms_norm_backward")
    assert _reads(back, original.results[1]) and not _reads(back, copy.results[1])  # rstd: the original's
    assert not list(copy.results[1].uses)


def test_a_value_read_by_two_micro_batches_is_made_again_before_each_backward() -> None:
    """Gradient accumulation: one weight copy (CSE merges the micro-batches' casts) read by two forwards and two
    backwards is split at each long gap: each backward GEMM reads its own copy, made right before it."""

    def loss(x: bt.Tensor, w1: bt.Tensor, w2: bt.Tensor) -> bt.Tensor:
        w1.requires_grad_()
        totals = []
        for batch in (x, w2):  # two micro-batches
            with bt.autocast(dtype="bfloat16"):
                total = _head(bt.linear(batch, w1).float())
            total.backward()
            totals.append(total)
        return totals[0] + totals[1]

    ops, _ = _ops(loss, *_arrays(11), passes=("cse", PASS))
    w1 = ops[0].parent.args[1]
    weight_copies = [c for c in _named(ops, "cast") if c.operands[0] is w1]
    grads = _named(ops, "linear_backward")
    assert len(weight_copies) == 3 and len(grads) == 2  # the original and one copy before each backward GEMM
    read = []
    for grad in grads:
        (cast,) = [c for c in weight_copies if any(v is c.results[0] for v in grad.operands)]
        # right before it: only copies (the micro-batch's own input copy) between
        assert all(o.name == "blutrain.cast" for o in ops[ops.index(cast):ops.index(grad)])
        read.append(cast)
    assert read[0] is not read[1]


def test_no_copy_where_an_operand_is_not_alive_at_the_reader() -> None:
    """``p · 2``'s backward keeps nothing of p: making the product again would hold p through the backward."""
    ops, _ = _ops(_mlp_loss(lambda p: p * 2.0), *_arrays(3))
    p = _named(ops, "linear")[0].results[0]
    assert [o.name for o in ops if _reads(o, p)] == ["blutrain.mul"]  # the product only, made once


def test_no_copy_of_an_op_that_is_not_recomputable() -> None:
    """A matmul's operands are kept for its backward, but a GEMM is not a cheap op to make again."""

    def loss(x: bt.Tensor, w1: bt.Tensor, w2: bt.Tensor) -> bt.Tensor:
        for t in (x, w1, w2):
            t.requires_grad_()
        total = _head(bt.linear(bt.matmul(x, w1), w2))
        total.backward()
        return total

    ops, _ = _ops(loss, *_arrays(4))
    assert len(_named(ops, "matmul")) == 3  # the product and its two gradients


def test_no_copy_where_an_operand_is_written_before_the_reader() -> None:
    def loss(x: bt.Tensor, w1: bt.Tensor, w2: bt.Tensor) -> bt.Tensor:
        w2.requires_grad_()
        h = bt.gelu(x)
        y = bt.linear(h, w2)
        x.mul_(3.0)  # a copy made later would read the new x
        total = _head(y)
        total.backward()
        return total

    ops, _ = _ops(loss, *_arrays(5))
    assert len(_named(ops, "gelu")) == 1


def test_no_copy_where_the_readers_are_close_together() -> None:
    def loss(x: bt.Tensor, w1: bt.Tensor, w2: bt.Tensor) -> bt.Tensor:
        w2.requires_grad_()
        total = bt.linear(bt.gelu(x), w2).sum()  # W2's gradient comes a few ops after the forward
        total.backward()
        return total

    ops, module = _ops(loss, *_arrays(6))
    assert len(_named(ops, "gelu")) == 1
    assert int(module.attributes["blutrain.recomputed"].data) == 0


def test_a_value_read_through_a_view_is_made_again_with_the_view() -> None:
    def loss(x: bt.Tensor, w1: bt.Tensor, w2: bt.Tensor) -> bt.Tensor:
        w2.requires_grad_()
        h = bt.gelu(x).reshape(2, 3, 8)
        total = _head(bt.linear(h, w2))
        total.backward()
        return total

    ops, _ = _ops(loss, *_arrays(7))
    original, copy = _named(ops, "gelu")
    (grad,) = _named(ops, "linear_backward")
    view = grad.operands[1].owner
    assert view.name == "blutrain.view" and view.operands[0] is copy.results[0]
    assert ops.index(copy) < ops.index(view) < ops.index(grad)
    assert all(not _reads(o, original.results[0]) for o in ops[ops.index(copy):])


@settings(max_examples=12, deadline=None)
@given(st.integers(1, 9), st.integers(1, 12), st.integers(1, 16), st.booleans(), st.integers(0, 2**16))
def test_a_compiled_swiglu_mlp_with_the_pass_trains_as_eager_bit_for_bit(same_bits: Any, rows: int, cols: int,
                                                                         hidden: int, autocast: bool,
                                                                         seed: int) -> None:
    """Four SGD steps of an RMSNorm → SwiGLU MLP of any shape, under bf16 autocast or not: the SwiGLU and norm
    outputs are made again, and every loss and weight is eager's bit for bit."""
    from blutrain.amp import autocast as region
    from blutrain.optim import create

    rng = np.random.default_rng(seed)
    x = rng.standard_normal((rows, cols)).astype(np.float32)
    weights = [rng.standard_normal(shape).astype(np.float32) for shape in ((hidden, cols), (hidden, cols),
                                                                           (cols, hidden), (cols,))]
    runs = []
    for remat in (None, True):
        ps = [bt.from_numpy(w.copy()).requires_grad_() for w in weights]
        opt = create("sgd", ps, lr=0.01)

        def step(xt: bt.Tensor, ps: list[bt.Tensor] = ps, opt: Any = opt) -> bt.Tensor:
            with region(dtype="bfloat16", enabled=autocast):
                y = bt.rms_norm(xt, cols, ps[3])
                h = bt.swiglu(bt.linear(y, ps[0]), bt.linear(y, ps[1]))
                total = _head(bt.linear(h, ps[2]).float())
            total.backward()
            opt.step()
            opt.zero_grad()
            return total

        fn: Any = step if remat is None else bc.compile(step, remat=remat)
        losses = [fn(bt.from_numpy(x)).detach().numpy().copy() for _ in range(4)]
        runs.append([*losses, *(p.detach().numpy().copy() for p in ps)])
        if remat:
            ir = fn.ir()
            assert ir.count('"blutrain.swiglu"') == 2 and ir.count('"blutrain.rms_norm"') == 2
    for got, want in zip(runs[1], runs[0], strict=True):
        same_bits(got, want)


def test_a_probe_hands_new_scalars_to_the_copy_too(same_bits: Any) -> None:
    """A float argument that reaches a recomputed op: each launch of the traced call gets the new value."""
    rng = np.random.default_rng(9)
    xs = rng.standard_normal((6, 8)).astype(np.float32)
    ws = rng.standard_normal((8, 8)).astype(np.float32)

    def step(x: bt.Tensor, w: bt.Tensor, s: float) -> tuple[bt.Tensor, bt.Tensor]:
        w = w.detach().requires_grad_()
        total = _head(bt.linear(x * s, w))
        total.backward()
        assert w.grad is not None
        return total * 1.0, w.grad * 1.0

    fn = bc.compile(step, remat=True)
    for s in (0.5, 0.5, 0.5, -1.25, 2.0):
        got = fn(bt.from_numpy(xs), bt.from_numpy(ws), s)
        want = step(bt.from_numpy(xs), bt.from_numpy(ws), s)
        for g, e in zip(got, want, strict=True):
            same_bits(g.detach().numpy(), e.detach().numpy())
    assert fn.stats.recomputed == 1 and fn.last is not None and fn.last.probes == 2


def _tiny_gpt2(remat: bool | None, autocast: bool, gpt_steps: Any,
               device: str = "cpu") -> tuple[list[np.ndarray[Any, Any]], Any]:
    """Four AdamW steps of a tiny GPT-2 with clip_grad_norm_, eagerly (``remat`` None) or compiled with the
    default pipeline with or without the pass: the losses and final parameters, and the compiled function."""
    from blutrain.models.gpt2 import GPT2, GPT2Config
    from blutrain.optim import create

    bt.manual_seed(0)
    model = GPT2(GPT2Config.preset("tiny", vocab_size=64, block_size=16, n_layer=2, n_head=2, n_embd=32))
    model.to(device)
    opt = create("adamw", list(model.parameters()), lr=1e-2, weight_decay=0.1)
    pipeline = None if remat is None else with_remat(bc.default_pipeline(), remat)
    out: tuple[list[np.ndarray[Any, Any]], Any] = gpt_steps(model, opt, pipeline, ids=48, device=device,
                                                           autocast=autocast, clip=0.5, return_logits=False)
    return out


@pytest.mark.parametrize("autocast", [False, True], ids=["float32", "autocast-bf16"])
def test_a_compiled_tiny_gpt2_with_the_pass_is_eager_bit_for_bit_in_a_smaller_arena(same_bits: Any, autocast: bool,
                                                                                   gpt_steps: Any) -> None:
    eager, _ = _tiny_gpt2(None, autocast, gpt_steps)
    _, plain = _tiny_gpt2(False, autocast, gpt_steps)
    compiled, fn = _tiny_gpt2(True, autocast, gpt_steps)
    for c, e in zip(compiled, eager, strict=True):
        same_bits(np.atleast_1d(c), np.atleast_1d(e))
    # each block's two LayerNorm outputs, read by the next GEMM and its weight gradient, are made again, and under
    # autocast each block's four bf16 weight copies (c_attn, attention c_proj, c_fc, MLP c_proj)
    assert fn.stats.recomputed == 4 + 8 * autocast and plain.stats.recomputed == 0
    assert fn.stats.arena_bytes < plain.stats.arena_bytes


def test_compile_remat_places_the_pass_before_kernel_selection_or_leaves_it_out() -> None:
    def f() -> None:
        return None

    on = bc.compile(f, remat=True).pipeline
    assert on.index(PASS) == on.index("kernel-selection") - 1 and on.count(PASS) == 1
    assert PASS not in bc.compile(f, remat=False, passes=list(on)).pipeline
    assert bc.compile(f).pipeline == bc.default_pipeline()
    assert bc.compile(f, passes=["dce"], remat=True).pipeline == ("dce", PASS)


def test_compile_refuses_a_remat_that_is_not_a_bool() -> None:
    with pytest.raises(bc.CompilerError, match="remat must be True, False or None"):
        bc.compile(lambda: None, remat="yes")  # type: ignore[arg-type]


def test_the_activations_only_variant_keeps_the_weights_copies_and_still_trains_as_eager(same_bits: Any,
                                                                                         gpt_steps: Any) -> None:
    """``rematerialize-activations`` in place of ``rematerialize``: under autocast the two LayerNorm outputs of each
    block are made again (4), the 8 weights' bf16 copies are not, and the steps are eager's bits; its planned arena
    lies between the pipeline without the pass and the one with the whole pass."""
    from blutrain.models.gpt2 import GPT2, GPT2Config
    from blutrain.optim import create

    eager, _ = _tiny_gpt2(None, True, gpt_steps)
    _, plain = _tiny_gpt2(False, True, gpt_steps)
    _, whole = _tiny_gpt2(True, True, gpt_steps)
    bt.manual_seed(0)
    model = GPT2(GPT2Config.preset("tiny", vocab_size=64, block_size=16, n_layer=2, n_head=2, n_embd=32))
    opt = create("adamw", list(model.parameters()), lr=1e-2, weight_decay=0.1)
    pipeline = tuple("rematerialize-activations" if name == PASS else name
                     for name in with_remat(bc.default_pipeline(), True))
    got, fn = gpt_steps(model, opt, pipeline, ids=48, device="cpu", autocast=True, clip=0.5, return_logits=False)
    for c, e in zip(got, eager, strict=True):
        same_bits(np.atleast_1d(c), np.atleast_1d(e))
    assert fn.stats.recomputed == 4 and whole.stats.recomputed == 12
    assert whole.stats.arena_bytes < fn.stats.arena_bytes < plain.stats.arena_bytes


@pytest.mark.cuda
@pytest.mark.parametrize("autocast", [False, True], ids=["float32", "autocast-bf16"])
def test_on_cuda_the_pass_gives_the_same_bits_in_a_smaller_planned_arena(same_bits: Any, autocast: bool,
                                                                        gpt_steps: Any) -> None:
    """On cuda a copy is the same kernel on the same operands: the compiled steps with the pass are the compiled
    steps without it bit for bit, and the memory plan's arena is smaller (the executor's own report exists only
    once a replay has captured the graph, which these few steps need not reach)."""
    registry = bt.backends()
    if "cuda" not in registry.names() or not registry.get("cuda").is_available():
        pytest.skip("no CUDA device")
    base, plain = _tiny_gpt2(False, autocast, gpt_steps, "cuda")
    got, fn = _tiny_gpt2(True, autocast, gpt_steps, "cuda")
    for c, e in zip(got, base, strict=True):
        same_bits(np.atleast_1d(c), np.atleast_1d(e))
    assert fn.stats.recomputed == 4 + 8 * autocast
    assert 0 < fn.stats.arena_bytes < plain.stats.arena_bytes
