"""The debug mode: a checking dispatch table, swapped in when the mode is switched.

With the mode off, :data:`blutrain.tensor.dispatch.TABLE` holds the registered kernels themselves,
so the per-op path stays a dict lookup and a call with no flag to read. Switching the mode empties
the table (as a plugin change does) and installs :func:`checking_kernel` as dispatch's interceptor
(:func:`blutrain.tensor.dispatch.set_interceptor`): each key refills on its next lookup, wrapped in the
checks of its op while the mode is on, bare again once it is off. ``debug_mode(True)`` switches for the
rest of the process, ``with debug_mode():`` for a block; ``BLUTRAIN_DEBUG=1`` in the environment switches it
on at import.

The checks run on backend arrays with the array module of their inputs, so they are the same on
every device; on an accelerator each reads a value back to the host and so synchronizes — the price
of the mode, paid only while it is on. They are:

- **Index ranges**, on every device (the ops check these on the CPU even with the mode off; on
  CUDA an index out of range would read or write memory outside the tensor): :data:`INDEX_CHECKS`.
- **NaN in inputs**, in the ops where one NaN spreads beyond its own element, so that once it has
  passed the op its origin is lost: matrix products and the row-wise ops (normalizations, softmax,
  log-sum-exp, cross-entropy, attention) and their backward kernels, where the upstream gradient
  is checked too (:data:`NAN_CHECKS`). Elementwise ops are not checked: a NaN stays in its element
  there, and ``log``/``sqrt`` of a negative number make one legitimately (the next mixing op names
  it). Reductions (``sum``, ``mean``, ``norm``, ``amax``, ...) are not checked either: they are how a
  program looks for NaN (the trainer's non-finite check is a norm). Nor are data movement (copies,
  ``cat``, indexing, views) and the optimizers' kernels. Infinities pass everywhere: ``-inf`` is how
  attention masks are written.

Compiled functions (``blutrain.compiler``) are not checked: their kernels are captured once, and a
check that reads values back to the host cannot be part of a graph; debug an eager step instead.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from types import TracebackType
from typing import Any

from blutrain.tensor import dispatch
from blutrain.tensor.checks import check_class_targets, check_index_range, check_key, check_no_nan
from blutrain.tensor.kernel import Kernel

Check = Callable[[tuple[Any, ...]], None]


def _index_in_dim(op: str, dim_pos: int, index_pos: int) -> Check:
    """Index argument ``args[index_pos]`` into dim ``args[dim_pos]`` of ``args[0]``."""

    def check(args: tuple[Any, ...]) -> None:
        a, dim = args[0], args[dim_pos]
        check_index_range(op, "index", args[index_pos], a.shape[dim] if a.ndim else 1, dim, "input")

    return check


def _embedding(args: tuple[Any, ...]) -> None:
    weight, index = args[0], args[1]
    check_index_range("embedding", "input", index, weight.shape[0], 0, "weight")


def _embedding_backward(args: tuple[Any, ...]) -> None:
    check_no_nan("embedding_backward", "grad_output", args[0])
    check_index_range("embedding_backward", "input", args[1], args[2], None, "num_embeddings")


def _cross_entropy(args: tuple[Any, ...]) -> None:
    logits, target, ignore_index = args[0], args[1], args[2]
    check_class_targets("cross_entropy", target, logits.shape[1], ignore_index)


def _cross_entropy_backward(args: tuple[Any, ...]) -> None:
    logits, target, ignore_index = args[1], args[2], args[4]
    check_class_targets("cross_entropy_backward", target, logits.shape[1], ignore_index)


def _key(op: str) -> Check:
    def check(args: tuple[Any, ...]) -> None:
        check_key(op, args[0].shape, args[1], arrays=True)

    return check


# op → the check of its index arguments (kernel signatures as in blutrain.tensor.cpu).
INDEX_CHECKS: dict[str, Check] = {
    "embedding": _embedding,
    "embedding_backward": _embedding_backward,
    "cross_entropy": _cross_entropy,
    "cross_entropy_backward": _cross_entropy_backward,
    "index_select": _index_in_dim("index_select", 1, 2),
    "gather": _index_in_dim("gather", 1, 2),
    "scatter_add": _index_in_dim("scatter_add", 1, 2),
    "index_add": _index_in_dim("index_add", 1, 2),
    "index": _key("index"),
    "index_put": _key("index_put"),
}

# op → (position, name) of the kernel arguments that must hold no NaN.
NAN_CHECKS: dict[str, tuple[tuple[int, str], ...]] = {
    "matmul": ((0, "input"), (1, "other")),
    "linear": ((0, "input"), (1, "weight"), (2, "bias")),
    "linear_gelu": ((0, "input"), (1, "weight"), (2, "bias")),
    "linear_add": ((0, "residual"), (1, "input"), (2, "weight"), (3, "bias")),
    "linear_backward": ((0, "grad_output"), (1, "input"), (2, "weight")),
    "layer_norm": ((0, "input"), (1, "weight"), (2, "bias")),
    "layer_norm_backward": ((0, "grad_output"), (1, "input"), (2, "weight")),
    "rms_norm": ((0, "input"), (1, "weight")),
    "rms_norm_backward": ((0, "grad_output"), (1, "input"), (2, "weight")),
    "rope": ((0, "q"), (1, "k"), (2, "cos"), (3, "sin")),
    "rope_backward": ((0, "grad_q"), (1, "grad_k")),
    "swiglu": ((0, "gate"), (1, "up")),
    "swiglu_backward": ((0, "grad_output"), (1, "gate"), (2, "up")),
    "softmax": ((0, "input"),),
    "log_softmax": ((0, "input"),),
    "logsumexp": ((0, "input"),),
    "softmax_backward": ((0, "grad_output"), (1, "output")),
    "log_softmax_backward": ((0, "grad_output"), (1, "output")),
    "cross_entropy": ((0, "input"),),
    "cross_entropy_backward": ((0, "grad_output"), (1, "input")),
    "sdpa": ((0, "query"), (1, "key"), (2, "value"), (3, "attn_mask")),
    "sdpa_backward": ((0, "grad_output"), (1, "query"), (2, "key"), (3, "value")),
}

_OP_NAMES = {"sdpa": "scaled_dot_product_attention", "sdpa_backward": "scaled_dot_product_attention_backward"}


def _nan_check(op: str, arguments: tuple[tuple[int, str], ...]) -> Check:
    name = _OP_NAMES.get(op, op)

    def check(args: tuple[Any, ...]) -> None:
        for pos, argument in arguments:
            if pos < len(args):
                check_no_nan(name, argument, args[pos])

    return check


def checking_kernel(op: str, fn: Kernel) -> Kernel:
    """``fn`` behind the checks of ``op``; ``fn`` itself when the op has none."""
    checks = [c for c in (INDEX_CHECKS.get(op),) if c is not None]
    if op in NAN_CHECKS:
        checks.append(_nan_check(op, NAN_CHECKS[op]))
    if not checks:
        return fn

    def checked(*args: Any) -> Any:
        for check in checks:
            check(args)
        return fn(*args)

    checked.__name__ = f"checked_{op}"
    checked.__wrapped__ = fn  # type: ignore[attr-defined]
    return checked


def _intercept(key: dispatch.KernelKey, fn: Kernel) -> Kernel:
    """The debug mode's dispatch interceptor: each kernel behind the checks of its op."""
    return checking_kernel(key[0], fn)


_enabled = False  # the mode as switched (while the compiler traces, its tracer holds the interceptor slot)


def is_debug_mode() -> bool:
    """Whether the debug mode is on."""
    return _enabled


def _switch(enabled: bool) -> None:
    global _enabled
    if enabled != _enabled:
        _enabled = enabled
        dispatch.set_interceptor(_intercept if enabled else None)


class DebugMode:
    """What :func:`debug_mode` returns: the switch is already made; as a context manager it restores
    the state before it on exit."""

    def __init__(self, enabled: bool) -> None:
        self.previous = is_debug_mode()
        self.enabled = enabled
        _switch(enabled)

    def __enter__(self) -> DebugMode:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        _switch(self.previous)


def debug_mode(enabled: bool = True) -> DebugMode:
    """Switch the debug mode on (or off): ``debug_mode(True)`` for good, ``with debug_mode():`` for a
    block. The dispatch table is rebuilt lazily, so the switch itself costs nothing per op."""
    return DebugMode(bool(enabled))


def enabled_by_environment(environ: dict[str, str] | os._Environ[str] = os.environ) -> bool:
    """Whether ``BLUTRAIN_DEBUG`` asks for the debug mode ("1", "true", "yes", "on"; any case)."""
    return environ.get("BLUTRAIN_DEBUG", "").strip().lower() in ("1", "true", "yes", "on")


if enabled_by_environment():
    _switch(True)


__all__ = ["INDEX_CHECKS", "NAN_CHECKS", "DebugMode", "checking_kernel", "debug_mode", "enabled_by_environment",
           "is_debug_mode"]
