"""Op dispatch: (op, device type, dtype) → kernel, through one flat dict.

This is the per-op hot path, so it is deliberately plain: a dict lookup, with the registry (and
therefore pluggy) consulted only on the first miss of a key. Autograd plugs in through one function
slot, :data:`recorder`, set by ``blutrain.autograd`` when it is imported; op functions call it only
when an input requires grad.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from blutrain.tensor import plugins
from blutrain.tensor.dtype import DType
from blutrain.tensor.kernel import Kernel, kernels

if TYPE_CHECKING:
    from blutrain.tensor.tensor import Tensor

# (op, device type, dtype) → kernel: the one dict the per-op path reads. Filled lazily from the
# kernel registry, emptied (never replaced, so modules may hold a reference) when plugins change.
TABLE: dict[tuple[str, str, DType], Kernel] = {}

# recorder(op, inputs, outputs, attrs) -> None; installed by blutrain.autograd. ``inputs`` may hold
# Python scalars and None beside tensors; the recorder only links the tensors that require grad.
Recorder = Callable[[str, "tuple[Any, ...]", "Tensor | tuple[Tensor, ...]", "dict[str, Any]"], None]
recorder: Recorder | None = None


class GradMode(threading.local):
    """Whether ops record for autograd, per thread (toggled by ``blutrain.autograd.no_grad``)."""

    enabled = True


grad_mode = GradMode()


# checker(op, kernel) -> kernel: wraps a kernel in its op's argument checks. Installed by the debug
# mode (blutrain.tensor.debug) and read only when a key is first filled in, never per op: with the
# mode off the table holds the registered kernels themselves.
Checker = Callable[[str, Kernel], Kernel]
checker: Checker | None = None


def kernel(op: str, device_type: str, dtype: DType) -> Kernel:
    """The winning kernel for one key; the registry is read only the first time a key is seen."""
    fn = TABLE.get((op, device_type, dtype))
    if fn is None:
        fn = kernels().lookup(op, device_type, dtype).fn
        if checker is not None:
            fn = checker(op, fn)
        TABLE[(op, device_type, dtype)] = fn
    return fn


def has_kernel(op: str, device_type: str, dtype: DType) -> bool:
    """Whether ``kernel(op, device_type, dtype)`` would find one (for callers with a fallback of their own)."""
    return (op, device_type, dtype) in TABLE or kernels().has(op, device_type, dtype)


def set_checker(fn: Checker | None) -> None:
    """Install (or with None remove) the kernel checker; the table empties and refills through it."""
    global checker
    checker = fn
    TABLE.clear()


def set_recorder(fn: Recorder | None) -> None:
    global recorder
    recorder = fn


def _clear() -> None:
    TABLE.clear()


plugins.on_change(_clear)
