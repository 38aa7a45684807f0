"""Activation checkpointing: keep a segment's inputs, not its activations, and recompute in backward.

``checkpoint(fn, *args)`` runs ``fn`` without recording, so none of its intermediates stay alive.
Its outputs are linked to its inputs by one node whose backward re-runs ``fn`` with recording on
(restoring the random state, so dropout draws the same mask) and back-propagates through that
recomputation. Memory for the segment drops to its inputs and outputs; compute grows by one forward.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from blutrain.autograd import engine
from blutrain.autograd.grad_mode import enable_grad, is_grad_enabled, no_grad
from blutrain.autograd.rules import RULES, Rule
from blutrain.tensor.errors import AutogradError
from blutrain.tensor.tensor import Tensor


def _rng_states(args: tuple[Any, ...]) -> list[tuple[Any, dict[str, Any]]]:
    devices = {a.device for a in args if isinstance(a, Tensor)}
    return [(d, d.backend.generator(d.index).get_state()) for d in devices]


def checkpoint(fn: Callable[..., Any], *args: Any) -> Any:
    """``fn(*args)`` with its activations recomputed during backward instead of stored."""
    states = _rng_states(args)
    with no_grad():
        out = fn(*args)
    outs = out if isinstance(out, tuple) else (out,)
    if not all(isinstance(o, Tensor) for o in outs):
        raise AutogradError("checkpoint: fn must return a Tensor or a tuple of Tensors")
    inputs = tuple(args)
    if not is_grad_enabled():
        return out
    if not any(isinstance(a, Tensor) and a.requires_grad for a in inputs):
        raise AutogradError("checkpoint: no input requires grad, so the parameters used inside fn would get no "
                            "gradient; pass at least one input that requires grad")
    engine.record("checkpoint", inputs, tuple(outs), {"fn": fn, "rng": states})
    return out


def _save(inputs: tuple[Any, ...], outputs: tuple[Tensor, ...], attrs: dict[str, Any]) -> tuple[Any, ...]:
    return tuple(a.detach() if isinstance(a, Tensor) else a for a in inputs)


def _backward(node: Any, grads: list[Any], create_graph: bool) -> tuple[Any, ...]:
    if engine.partial_pass():
        # the recomputed segment back-propagates into every parameter it uses, which a pass asked
        # for some inputs' gradients only must not do (PyTorch's reentrant checkpoint refuses too)
        raise AutogradError("checkpoint: a checkpointed segment cannot be differentiated by grad() or by "
                            "backward(inputs=...); call backward() without inputs")
    fn = node.attrs["fn"]
    saved_rng = [(d, d.backend.generator(d.index).get_state()) for d, _ in node.attrs["rng"]]
    for d, state in node.attrs["rng"]:
        d.backend.generator(d.index).set_state(state)
    replay = tuple(a.detach().requires_grad_(needed) if isinstance(a, Tensor) and a.dtype.is_floating else a
                   for a, needed in zip(node.saved, node.needs, strict=True))
    try:
        with enable_grad():
            out = fn(*replay)
    finally:
        for d, state in saved_rng:
            d.backend.generator(d.index).set_state(state)
    outs = out if isinstance(out, tuple) else (out,)
    roots, seeds = [], []
    for o, g in zip(outs, grads, strict=True):
        if g is not None and o.requires_grad:
            roots.append(o)
            seeds.append(g)
    # parameters used inside fn are leaves of the recomputed graph: their .grad accumulates there
    if roots:
        engine.run_backward(roots, seeds, retain_graph=False, create_graph=create_graph)
    return tuple(a.grad if need else None for a, need in zip(replay, node.needs, strict=True))


RULES["checkpoint"] = Rule(_save, _backward)
