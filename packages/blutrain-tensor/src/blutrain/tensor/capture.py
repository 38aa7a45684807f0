"""The slot through which a capture of this thread's ops sees work that is not a kernel.

``blutrain.compiler`` traces a function by recording every kernel it dispatches, and a compiled call
replays those kernels and nothing else. Work that changes tensors outside kernels — a process
group's collective — would run while the function is traced and then be missing from every replay.
So such work asks :func:`active` first: while a capture is active on this thread it either hands
itself over (:meth:`Capture.host_call`, which records it so that the replay runs it at the same
point) or, where its caller never declared that it may be recorded, is refused
(:meth:`Capture.refuse`). The write-back of an in-place tensor op (``copy_``, ``add_``, ``zero_``) is
no kernel either and goes through :meth:`Capture.write`, so that a write into memory that outlives the
trace (a gradient bucket, a shard) is recorded like one. The compiler sets the slot while it traces or
checks a function; packages that do such work (``blutrain.dist``) read it without importing the compiler.

A compiled call replays kernels without running the function's Python, so host work that a step's
kernels depend on and that must happen on every step — an optimizer's step counts and the per-step
scalars it writes into device memory (learning rate, bias corrections) — goes through
:func:`per_call`: it runs at once, and a capture records it so that every replay runs it again.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Hashable, Iterator, Sequence
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any, NoReturn, Protocol, TypeVar

from blutrain.tensor.errors import TensorValueError

if TYPE_CHECKING:
    from blutrain.tensor.tensor import Tensor

T = TypeVar("T")


class Capture(Protocol):
    """What a capture (the compiler's tracer) does with work outside kernels."""

    def host_call(self, what: str, fn: Callable[..., Any], args: tuple[Any, ...]) -> None:
        """``fn(*args)`` reads and writes the tensors in ``args`` (tensors, lists of tensors and plain
        scalars) outside kernels and returns nothing the caller needs: run it now and record it (a
        trace), or check it against the record without running it (a later call, which replays it)."""

    def write(self, target: Any, value: Any) -> None:
        """``target[...] = value`` on a backend array (``value`` an array or a scalar): the write-back of
        an in-place tensor op, which is no kernel (trace: do it and record it; later call: check it)."""

    def refuse(self, what: str) -> NoReturn:
        """Raise the capture's error for ``what``, naming the line of the captured function."""

    def declare_writes(self, operands: tuple[int, ...]) -> None:
        """The next kernel writes these of its array operands in place, and no other (positions in argument
        order, lists flattened): an in-place kernel whose write leaves the values as they were at trace time
        (a scale by 1, a step with lr 0) is still recorded as writing them, and the capture need not compare
        copies of every operand to find out."""

    def per_call(self, fn: Callable[[], Any], guard: Callable[[], Hashable], value: Hashable) -> None:
        """Record host work ``fn`` (just run) for every replay, with its ``guard`` and the guard's ``value``
        at the start of this step (see :func:`per_call`)."""


class _Local(threading.local):
    capture: Capture | None = None


_local = _Local()


def active() -> Capture | None:
    """The capture of this thread, or None (the case outside compilation)."""
    return _local.capture


def set_active(capture: Capture | None) -> Capture | None:
    """Make ``capture`` this thread's capture (None: no capture); returns the previous one."""
    previous, _local.capture = _local.capture, capture
    return previous


def _unguarded() -> None:
    """The guard of host work that passes no plain argument to a kernel: never changes."""


def per_call(fn: Callable[[], T], guard: Callable[[], Hashable] = _unguarded, value: Hashable = None) -> T:
    """Run ``fn()``, host work of one step that the step's kernels then read, and return its result; while a
    capture is active, hand ``fn`` over so that every replay of the compiled step runs it again first.

    ``guard()`` returns the Python values that the step passes to its kernels as plain arguments beside what
    ``fn`` refreshes (an optimizer's betas, eps, weight decay; whether every parameter already had its state),
    and ``value`` is what it returned at the start of this step. A replay compares ``guard()`` with the traced
    ``value`` first: where they differ the compiled function runs this call's Python again instead (which picks
    new arguments up, or reports a different path), so a changed hyper-parameter is never replayed stale.
    Without a guard (host work that passes no plain argument to a kernel) nothing is compared. ``fn`` must
    do the same thing on every call but for the values it reads (no new state, no other kernels).
    """
    result = fn()
    capture = _local.capture
    if capture is not None:
        capture.per_call(fn, guard, value)
    return result


@contextmanager
def substitute_arrays(tensors: Sequence[Tensor], arrays: Sequence[Any]) -> Iterator[None]:
    """Inside the block each of ``tensors`` views the matching one of ``arrays`` in place of its own array;
    after it (even on error) each views its own again. Dtype, device, storage, version counter and autograd
    state stay as they are, so the substitute must have the tensor's shape and dtype.

    This is how a capture runs a function on its own arrays: the compiler's tracer hands the function's
    input tensors proxies that record what is done with them (and the real arrays back to a collective it
    runs for real), without new tensors that the function's callers would not see.
    """
    if len(tensors) != len(arrays):
        raise TensorValueError(f"substitute_arrays: {len(tensors)} tensors and {len(arrays)} arrays; give one array "
                         "per tensor")
    own = [t.array for t in tensors]
    try:
        for t, a in zip(tensors, arrays, strict=True):
            t.array = a
        yield
    finally:
        for t, a in zip(tensors, own, strict=True):
            t.array = a


__all__ = ["Capture", "active", "per_call", "set_active", "substitute_arrays"]
