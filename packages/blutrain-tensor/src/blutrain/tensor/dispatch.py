"""Op dispatch: (op, device type, dtype) → kernel, through one flat dict.

This is the per-op hot path, so it is deliberately plain: a dict lookup, with the registry (and
therefore pluggy) consulted only on the first miss of a key. Autograd plugs in through one function
slot, :data:`recorder`, set by ``blutrain.autograd`` when it is imported; op functions call it only
when an input requires grad.

How to call a kernel on tensors (autograd's derivative rules, optimizers, plugins): :func:`call` for a
kernel with one output, :func:`call_multi` for one that returns several. They look the kernel up as the
op functions do (:func:`kernel`), pass each Tensor argument as its backend array (``Tensor.array``)
and every other argument as it is, and wrap the outputs with ``Tensor.from_array``. They record
nothing for autograd. :func:`kernel` itself is for code that works on backend arrays.

How to see every kernel call (a tracer, the debug mode's checks): :func:`set_interceptor` or
``with intercepting(fn):``. The interceptor wraps each kernel when its key is first filled into
:data:`TABLE`, so with none installed the table holds the registered kernels themselves and the
per-op path reads no flag. :data:`TABLE` is written by this module only.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

from blutrain.tensor import plugins
from blutrain.tensor.base import TensorBase
from blutrain.tensor.dtype import DType, from_numpy_dtype
from blutrain.tensor.errors import TensorTypeError
from blutrain.tensor.kernel import Kernel, kernels

if TYPE_CHECKING:
    from blutrain.tensor.tensor import Tensor

KernelKey = tuple[str, str, DType]  # (op, device type, compute dtype)

# (op, device type, dtype) → kernel: the one dict the per-op path reads. Filled lazily from the
# kernel registry, emptied (never replaced, so modules may hold a reference) when plugins change or
# the interceptor changes.
TABLE: dict[KernelKey, Kernel] = {}

# recorder(op, inputs, outputs, attrs) -> None; installed by blutrain.autograd. ``inputs`` may hold
# Python scalars and None beside tensors; the recorder only links the tensors that require grad.
Recorder = Callable[[str, "tuple[Any, ...]", "Tensor | tuple[Tensor, ...]", "dict[str, Any]"], None]
recorder: Recorder | None = None


class GradMode(threading.local):
    """Whether ops record for autograd, per thread (toggled by ``blutrain.autograd.no_grad``)."""

    enabled = True


grad_mode = GradMode()


# interceptor(key, kernel) -> kernel: what the table holds for ``key`` instead of the registered kernel
# (usually a wrapper that calls it). Read only when a key is first filled in, never per op.
Interceptor = Callable[[KernelKey, Kernel], Kernel]
interceptor: Interceptor | None = None


def kernel(op: str, device_type: str, dtype: DType) -> Kernel:
    """The winning kernel for one key; the registry is read only the first time a key is seen."""
    fn = TABLE.get((op, device_type, dtype))
    if fn is None:
        fn = kernels().lookup(op, device_type, dtype).fn
        if interceptor is not None:
            fn = interceptor((op, device_type, dtype), fn)
        TABLE[(op, device_type, dtype)] = fn
    return fn


def _first_tensor(op: str, args: tuple[Any, ...]) -> TensorBase:
    """The first Tensor of ``args`` (the one whose device runs the kernel), when it is not ``args[0]``."""
    for a in args:
        if isinstance(a, TensorBase):
            return a
    raise TensorTypeError(f"{op}: dispatch.call needs at least one Tensor argument (it picks the device), got "
                          f"{', '.join(type(a).__name__ for a in args) or 'none'}")


def call(op: str, *args: Any, dtype: DType | None = None, out_dtype: DType | None = None) -> Tensor:
    """Run the kernel of ``op`` on ``args`` and return its output as a Tensor.

    The kernel is the one for the device of the first Tensor argument and ``dtype`` (default: that
    tensor's dtype), found as the op functions find theirs. Tensors reach it as their backend arrays,
    every other argument (Python scalars, None, keys) as it is, in order: the kernel's own signature (see
    ``blutrain.tensor.cpu`` for the catalogue's). The output, a backend array, becomes a new Tensor of
    ``out_dtype`` (default: the kernel's dtype) on that device. Nothing is recorded for autograd::

        dx = dispatch.call("gelu_backward", grad, x, "tanh")

    Every Tensor argument must be on the first one's device (as the op functions have checked for their
    inputs; the kernel's array module refuses another device's arrays). Raises ``KernelNotFoundError`` when no
    plugin registered the key, ``TensorTypeError`` when no argument is a Tensor.
    """
    # one comprehension, inline: derivative rules call this per backward op with ~8 arguments
    arrays = [a.array if isinstance(a, TensorBase) else a for a in args]
    host = args[0] if args and isinstance(args[0], TensorBase) else _first_tensor(op, args)
    dt = host.dtype if dtype is None else dtype
    fn = TABLE.get((op, host.device.type, dt))
    if fn is None:
        fn = kernel(op, host.device.type, dt)
    return host._make(fn(*arrays), dt if out_dtype is None else out_dtype, host.device)


def call_multi(op: str, *args: Any, dtype: DType | None = None,
               out_dtypes: Sequence[DType | None] | None = None) -> tuple[Tensor | None, ...]:
    """:func:`call` for a kernel that returns a tuple: one Tensor per output, None where the kernel returned
    None (an input gradient it was told is not needed).

    ``out_dtypes`` gives each output's dtype: a DType, or None for the dtype its array holds (a per-row
    statistic that a kernel keeps in float32 for half inputs); left out, every output has the kernel's dtype::

        out, lse = dispatch.call_multi("sdpa", q, k, v, None, True, scale, out_dtypes=(q.dtype, None))
    """
    arrays = [a.array if isinstance(a, TensorBase) else a for a in args]  # as in call
    host = args[0] if args and isinstance(args[0], TensorBase) else _first_tensor(op, args)
    dt = host.dtype if dtype is None else dtype
    dev = host.device
    fn = TABLE.get((op, dev.type, dt))
    if fn is None:
        fn = kernel(op, dev.type, dt)
    outs = fn(*arrays)
    make = host._make
    # list comprehensions, not generators: one frame for all outputs
    if out_dtypes is None:
        return tuple([None if o is None else make(o, dt, dev) for o in outs])
    if len(out_dtypes) != len(outs):
        raise TensorTypeError(f"{op}: out_dtypes gives {len(out_dtypes)} dtypes, the kernel returned {len(outs)} "
                              "outputs; give one per output")
    return tuple([None if o is None else make(o, from_numpy_dtype(o.dtype) if d is None else d, dev)
                  for o, d in zip(outs, out_dtypes, strict=True)])


def has_kernel(op: str, device_type: str, dtype: DType) -> bool:
    """Whether ``kernel(op, device_type, dtype)`` would find one (for callers with a fallback of their own)."""
    return (op, device_type, dtype) in TABLE or kernels().has(op, device_type, dtype)


def set_interceptor(fn: Interceptor | None) -> Interceptor | None:
    """Install ``fn`` as the interceptor (None removes it) and return the one it replaces.

    One interceptor at a time: whoever installs one restores the previous when done (:func:`intercepting`
    does), so the compiler's tracer, while it traces, stands in for the debug mode's checks (a compiled
    function runs unchecked kernels). The table empties and refills through ``fn`` on each key's next lookup.
    """
    global interceptor
    previous = interceptor
    interceptor = fn
    TABLE.clear()
    return previous


@contextmanager
def intercepting(fn: Interceptor | None) -> Iterator[None]:
    """``fn`` as the interceptor inside the block, the previous one again after it (even on error)."""
    previous = set_interceptor(fn)
    try:
        yield
    finally:
        set_interceptor(previous)


def set_recorder(fn: Recorder | None) -> None:
    global recorder
    recorder = fn


def _clear() -> None:
    TABLE.clear()


plugins.on_change(_clear)
