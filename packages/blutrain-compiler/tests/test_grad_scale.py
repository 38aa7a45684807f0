"""The adamw-grad-scale pass: the global-norm clip's in-place ``scale_multi_tensor`` handed to the AdamW calls
that alone read the scaled gradients after it (their ``grad_scale`` operand); where it must not fire; and the
compiled training against eager, bit for bit."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from xdsl.ir import Operation

import blutrain.compiler as bc
import blutrain.tensor as bt
from blutrain.compiler.dialect import Operand, decode, is_kernel, kernel_name
from blutrain.compiler.graph import body
from blutrain.optim import clip_grad_norm_, create, weight_decay_groups


def _kernels(fn: Any, name: str) -> list[Operation]:
    """The calls of kernel ``name`` in the compiled module of ``fn`` (its last signature)."""
    return [o for o in body(fn.last.module).ops if is_kernel(o) and kernel_name(o) == name]


def _fired(fn: Any) -> bool:
    """No scale_multi_tensor left, every AdamW call given grad_scale: a 10th argument, its last operand."""
    adamws = _kernels(fn, "adamw_multi_tensor")
    assert adamws
    return not _kernels(fn, "scale_multi_tensor") and all(
        decode(o.properties["args"])[9:] == (Operand(len(o.operands) - 1),) for o in adamws)


def _not_fired(fn: Any) -> bool:
    adamws = _kernels(fn, "adamw_multi_tensor")
    assert adamws
    return len(_kernels(fn, "scale_multi_tensor")) == 1 and all(len(decode(o.properties["args"])) == 9 for o in adamws)


Params = list[bt.Tensor]
Step = Callable[[Params, Any, bt.Tensor, bt.Tensor], Any]


def _mlp(ps: Params, x: bt.Tensor) -> bt.Tensor:
    w1, b1, w2, b2 = ps
    return bt.linear(bt.linear(x, w1, b1).tanh(), w2, b2)


def _clipped_step(ps: Params, opt: Any, x: bt.Tensor, y: bt.Tensor, max_norm: float = 0.05) -> Any:
    """forward, backward, clip_grad_norm_, AdamW (two parameter groups: two calls), zero_grad: the trainer's step."""
    loss = ((_mlp(ps, x) - y) ** 2).mean()
    loss.backward()
    norm = clip_grad_norm_(ps, max_norm)
    opt.step()
    opt.zero_grad()
    return loss, norm


def _train(step: Step, compiled: bool, steps: int = 4, dtype: Any = np.float32, dims: tuple[int, int, int] = (5, 7, 3),
           rows: int = 6, seed: int = 0, passes: list[str] | None = None,
           between: Callable[[int, Any], None] | None = None) -> tuple[list[np.ndarray], Any]:
    """``step`` run ``steps`` times eagerly or compiled from the same start (``between(i, opt)`` before call i):
    (every output of every call, every final parameter and every ``.grad`` left, as NumPy arrays; the compiled
    function or None)."""
    rng = np.random.default_rng(seed)
    d_in, hidden, d_out = dims
    ps = [bt.from_numpy(rng.standard_normal(s).astype(dtype)).requires_grad_()
          for s in ((hidden, d_in), (hidden,), (d_out, hidden), (d_out,))]
    opt = create("adamw", weight_decay_groups(ps, 0.1), lr=1e-2, betas=(0.9, 0.95))

    def call(x: bt.Tensor, y: bt.Tensor) -> Any:
        return step(ps, opt, x, y)

    fn: Any = bc.compile(call, passes=passes) if compiled else call
    out: list[np.ndarray] = []
    for i in range(steps):
        if between is not None:
            between(i, opt)
        x = bt.from_numpy(rng.standard_normal((rows, d_in)).astype(dtype))
        y = bt.from_numpy(rng.standard_normal((rows, d_out)).astype(dtype))
        out.extend(np.asarray(r.detach().numpy()).copy() for r in fn(x, y))
    out.extend(p.detach().numpy().copy() for p in ps)
    out.extend(p.grad.detach().numpy().copy() for p in ps if p.grad is not None)
    return out, fn if compiled else None


def _same_runs(same_bits: Any, step: Step, **kw: Any) -> Any:
    """Train eagerly and compiled, assert every output, parameter and gradient the same bits; the compiled
    function."""
    eager, _ = _train(step, False, **kw)
    compiled, fn = _train(step, True, **kw)
    assert len(eager) == len(compiled)
    for c, e in zip(compiled, eager, strict=True):
        same_bits(c, e)
    return fn


def test_the_clip_scale_goes_into_every_adamw_call(same_bits: Any) -> None:
    """Two parameter groups (decayed weights, undecayed biases): two AdamW calls, each reading a subset of the
    scaled gradients, each given the clip coefficient; no scale_multi_tensor left."""
    fn = _same_runs(same_bits, _clipped_step)
    assert len(_kernels(fn, "adamw_multi_tensor")) == 2
    assert _fired(fn), fn.ir()


def test_the_coefficient_operand_is_the_clamped_clip_factor() -> None:
    """The grad_scale operand is the clamp the scale read: min(1, max_norm / (norm + eps))."""
    _, fn = _train(_clipped_step, True, steps=2)
    (clamp,) = [o for o in body(fn.last.module).ops if o.name == "blutrain.clamp"]
    for adamw in _kernels(fn, "adamw_multi_tensor"):
        assert adamw.operands[-1] is clamp.results[0]


@settings(max_examples=12, deadline=None)
@given(st.sampled_from(["float32", "float64"]), st.integers(1, 8), st.integers(1, 9), st.integers(1, 6),
       st.integers(1, 7), st.sampled_from([1e-3, 0.05, 1e3]), st.integers(0, 2**16))
def test_compiled_clip_and_adamw_train_as_eager_bit_for_bit(same_bits: Any, dtype: str, d_in: int, hidden: int,
                                                            d_out: int, rows: int, max_norm: float,
                                                            seed: int) -> None:
    """Clipping hard, a little or not at all (coefficient 1), float32 or float64: five steps of a small MLP
    compiled with the pass are eager's bits (losses, norms, parameters), and the pass fired."""

    def step(ps: Params, opt: Any, x: bt.Tensor, y: bt.Tensor) -> Any:
        return _clipped_step(ps, opt, x, y, max_norm)

    fn = _same_runs(same_bits, step, steps=5, dtype=np.dtype(dtype), dims=(d_in, hidden, d_out), rows=rows,
                    seed=seed)
    assert _fired(fn), fn.ir()


def test_compiled_tiny_gpt_with_clip_and_adamw_trains_as_eager_bit_for_bit(same_bits: Any) -> None:
    from blutrain.models.gpt2 import GPT2, GPT2Config

    def run(compiled: bool) -> tuple[list[np.ndarray], Any]:
        bt.manual_seed(0)
        cfg = GPT2Config.preset("tiny", vocab_size=64, block_size=16, n_layer=2, n_head=2, n_embd=32)
        model = GPT2(cfg)
        opt = create("adamw", weight_decay_groups(model.parameters(), 0.1), lr=1e-3, betas=(0.9, 0.95))

        def step(x: bt.Tensor, y: bt.Tensor) -> tuple[bt.Tensor, bt.Tensor]:
            _, loss = model(x, y)
            loss.backward()
            norm = clip_grad_norm_(model.parameters(), 0.5)
            opt.step()
            opt.zero_grad()
            return loss, norm

        fn: Any = bc.compile(step) if compiled else step
        rng = np.random.default_rng(0)
        out = []
        for _ in range(5):
            loss, norm = fn(bt.tensor(rng.integers(0, 64, (4, 16))), bt.tensor(rng.integers(0, 64, (4, 16))))
            out += [loss.detach().numpy().copy(), norm.numpy().copy()]
        return out + [p.detach().numpy().copy() for p in model.parameters()], fn

    eager, _ = run(False)
    compiled, fn = run(True)
    for c, e in zip(compiled, eager, strict=True):
        same_bits(c, e)
    assert _fired(fn)
    assert min(float(n) for n in eager[1:10:2]) > 0.5  # the norms: the clip scaled every step


def test_no_fusion_where_a_gradient_is_read_after_the_scale_by_another_op(same_bits: Any) -> None:
    """A gradient's sum after the clip (a logged statistic) must see the scaled gradient: the scale stays."""

    def step(ps: Params, opt: Any, x: bt.Tensor, y: bt.Tensor) -> Any:
        loss = ((_mlp(ps, x) - y) ** 2).mean()
        loss.backward()
        clip_grad_norm_(ps, 0.05)
        seen = ps[0].grad.detach().sum()  # type: ignore[union-attr]
        opt.step()
        opt.zero_grad()
        return loss, seen

    assert _not_fired(_same_runs(same_bits, step))


def test_no_fusion_where_a_gradient_is_returned(same_bits: Any) -> None:
    """A gradient the step returns is live out: the caller must get it scaled."""

    def step(ps: Params, opt: Any, x: bt.Tensor, y: bt.Tensor) -> Any:
        loss = ((_mlp(ps, x) - y) ** 2).mean()
        loss.backward()
        clip_grad_norm_(ps, 0.05)
        opt.step()
        grad = ps[3].grad
        opt.zero_grad()
        return loss, grad

    assert _not_fired(_same_runs(same_bits, step))


def test_no_fusion_where_the_gradients_are_kept_across_calls(same_bits: Any) -> None:
    """zero_grad(set_to_none=False) keeps each ``.grad`` buffer: state of the compiled step (an argument of its
    function), which the caller reads after each call and must find scaled. Zeroed at the start of the step
    here, so the scaled values are what is left; _train compares the ``.grad`` of both runs too."""

    def step(ps: Params, opt: Any, x: bt.Tensor, y: bt.Tensor) -> Any:
        opt.zero_grad(set_to_none=False)
        loss = ((_mlp(ps, x) - y) ** 2).mean()
        loss.backward()
        clip_grad_norm_(ps, 0.05)
        opt.step()
        return (loss,)

    assert _not_fired(_same_runs(same_bits, step))


def test_no_fusion_where_an_adamw_call_also_reads_an_unscaled_gradient(same_bits: Any) -> None:
    """The clip covers the first layer only; the decayed group's AdamW call reads both weights' gradients and
    has one coefficient for none or all of them, so the scale stays."""

    def step(ps: Params, opt: Any, x: bt.Tensor, y: bt.Tensor) -> Any:
        loss = ((_mlp(ps, x) - y) ** 2).mean()
        loss.backward()
        clip_grad_norm_(ps[:2], 0.05)
        opt.step()
        opt.zero_grad()
        return (loss,)

    assert _not_fired(_same_runs(same_bits, step))


def test_a_changed_adamw_eps_keeps_the_grad_scale_operand(same_bits: Any) -> None:
    """eps changes before call 4: that call is probed and hands the AdamW launches the traced call's arguments
    with the new eps; the executor keeps the grad_scale operand the pass appended (without it the gradients
    would go unscaled from there on)."""

    def between(i: int, opt: Any) -> None:
        if i == 3:
            for g in opt.param_groups:
                g["eps"] = 1e-3

    fn = _same_runs(same_bits, _clipped_step, steps=6, between=between)
    assert _fired(fn)
    assert (fn.last.replays, fn.last.probes, fn.last.executor.updates) == (3, 1, 1)


def test_the_pass_alone_fires_on_a_trace_and_leaves_the_rest(same_bits: Any) -> None:
    """Run as the only pass (no DCE, fusion or selection after it): still eager's bits."""
    fn = _same_runs(same_bits, _clipped_step, passes=["adamw-grad-scale"])
    assert _fired(fn)
    assert "adamw-grad-scale" in bc.default_pipeline()  # placed there by the adamw plugin


@pytest.mark.cuda
def test_on_cuda_the_compiled_step_with_the_pass_is_the_one_without_it_bit_for_bit() -> None:
    """cuda, tiny GPT (head size 64: graph-capturable attention), clip + AdamW, 6 compiled steps with the
    default pipeline against the same pipeline without adamw-grad-scale: the same losses, norms and parameters
    bit for bit (the kernel's __fmul_rn product is what the in-place scale stored), and the pass fired."""
    registry = bt.backends()
    if "cuda" not in registry.names() or not registry.get("cuda").is_available():
        pytest.skip("no CUDA device")
    from blutrain.models.gpt2 import GPT2, GPT2Config

    def run(passes: list[str]) -> tuple[list[np.ndarray], Any]:
        bt.manual_seed(0)
        cfg = GPT2Config.preset("tiny", vocab_size=256, block_size=64, n_layer=2, n_head=2, n_embd=128)
        model = GPT2(cfg).to("cuda")
        opt = create("adamw", weight_decay_groups(model.parameters(), 0.1), lr=1e-3, betas=(0.9, 0.95))

        def step(x: bt.Tensor, y: bt.Tensor) -> tuple[bt.Tensor, bt.Tensor]:
            _, loss = model(x, y, return_logits=False)
            loss.backward()
            norm = clip_grad_norm_(model.parameters(), 0.5)
            opt.step()
            opt.zero_grad()
            return loss, norm

        fn = bc.compile(step, passes=passes)
        rng = np.random.default_rng(0)
        out = []
        for _ in range(6):
            x = bt.tensor(rng.integers(0, 256, (8, 64)), device="cuda")
            y = bt.tensor(rng.integers(0, 256, (8, 64)), device="cuda")
            loss, norm = fn(x, y)
            out += [loss.detach().cpu().numpy().copy(), norm.cpu().numpy().copy()]
        return out + [p.detach().cpu().numpy().copy() for p in model.parameters()], fn

    with_pass, fn = run(list(bc.default_pipeline()))
    without, fn0 = run([p for p in bc.default_pipeline() if p != "adamw-grad-scale"])
    assert _fired(fn) and _not_fired(fn0)
    assert fn.last.executor.captures == 1 and fn.last.replays == 4
    assert max(float(n) for n in with_pass[1:12:2]) > 0.5  # the clip scaled
    for a, b in zip(with_pass, without, strict=True):
        np.testing.assert_array_equal(a.view(f"u{a.dtype.itemsize}"), b.view(f"u{b.dtype.itemsize}"))


@pytest.mark.cuda
def test_on_cuda_the_fused_clip_matches_eager_bit_for_bit_without_gemms() -> None:
    """A step of elementwise ops only (no cuBLAS, whose compiled and eager workspaces may differ): compiled with
    the pass, every parameter is eager's bits after 5 steps, under a coefficient well below 1."""
    registry = bt.backends()
    if "cuda" not in registry.names() or not registry.get("cuda").is_available():
        pytest.skip("no CUDA device")
    rng = np.random.default_rng(3)
    start = [rng.standard_normal(s).astype(np.float32) for s in ((3000,), (2049,), (7,))]

    def run(compiled: bool) -> tuple[list[np.ndarray], Any]:
        ps = [bt.from_numpy(a.copy()).to("cuda").requires_grad_() for a in start]
        opt = create("adamw", [{"params": ps[:2], "weight_decay": 0.1}, {"params": ps[2:], "weight_decay": 0.0}],
                     lr=1e-2, betas=(0.9, 0.95))

        def step(x: bt.Tensor) -> tuple[bt.Tensor, bt.Tensor]:
            loss = sum(((p * x[: p.shape[0]]).tanh() ** 2).sum() for p in ps)
            assert isinstance(loss, bt.Tensor)
            loss.backward()
            norm = clip_grad_norm_(ps, 0.1)
            opt.step()
            opt.zero_grad()
            return loss, norm

        fn: Any = bc.compile(step) if compiled else step
        out = []
        for i in range(5):
            x = bt.from_numpy(np.random.default_rng(i).standard_normal(3000).astype(np.float32)).to("cuda")
            loss, norm = fn(x)
            out += [loss.detach().cpu().numpy().copy(), norm.cpu().numpy().copy()]
        return out + [p.detach().cpu().numpy().copy() for p in ps], fn

    eager, _ = run(False)
    compiled, fn = run(True)
    assert _fired(fn)
    assert min(float(n) for n in eager[1:10:2]) > 0.1  # the clip scaled every step
    for c, e in zip(compiled, eager, strict=True):
        np.testing.assert_array_equal(c.view(np.uint32), e.view(np.uint32))
