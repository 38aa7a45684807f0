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
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any, NoReturn, Protocol


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


__all__ = ["Capture", "active", "set_active"]
