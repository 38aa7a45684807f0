"""Grad modes: ``no_grad``, ``enable_grad``, ``set_grad_enabled`` (context managers and decorators).

The flag itself lives in ``blutrain.tensor.dispatch.grad_mode`` (thread-local), where op functions
read it without a call. As in PyTorch, ``set_grad_enabled(mode)`` takes effect when called, so it
also works as a plain function; ``no_grad`` and ``enable_grad`` take effect on entering a ``with``
block, and decorate a function with or without parentheses.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from types import TracebackType
from typing import Any, TypeVar

from blutrain.tensor.dispatch import grad_mode

F = TypeVar("F", bound=Callable[..., Any])


def is_grad_enabled() -> bool:
    return bool(grad_mode.enabled)


def _decorate(fn: F, mode: bool) -> F:
    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        prev = grad_mode.enabled
        grad_mode.enabled = mode
        try:
            return fn(*args, **kwargs)
        finally:
            grad_mode.enabled = prev

    return wrapper  # type: ignore[return-value]


class _GradModeContext:
    """Sets grad mode to ``mode`` inside a ``with`` block and restores the previous mode after."""

    mode: bool

    def __init__(self) -> None:
        self._prev: list[bool] = []

    def __enter__(self) -> None:
        self._prev.append(grad_mode.enabled)
        grad_mode.enabled = self.mode

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        grad_mode.enabled = self._prev.pop()

    def __call__(self, fn: F) -> F:
        return _decorate(fn, self.mode)


class _Switch(_GradModeContext):
    """A fixed mode that takes effect on entering a ``with`` block; also a decorator, with or
    without parentheses (``@no_grad()`` and ``@no_grad``)."""

    def __new__(cls, fn: Callable[..., Any] | None = None) -> Any:
        if fn is not None:  # used as a bare decorator
            return _decorate(fn, cls.mode)
        return super().__new__(cls)

    def __init__(self, fn: Callable[..., Any] | None = None) -> None:
        super().__init__()


class no_grad(_Switch):  # noqa: N801 (PyTorch's name)
    """Ops inside record nothing: for evaluation and for optimizer updates."""

    mode = False


class enable_grad(_Switch):  # noqa: N801
    """Record again inside a ``no_grad`` region."""

    mode = True


class set_grad_enabled(_GradModeContext):  # noqa: N801
    """Turn grad mode on or off now; as a ``with`` block or a decorator, only for its extent."""

    def __init__(self, mode: bool) -> None:
        super().__init__()
        self.mode = bool(mode)
        self._prev_at_call = grad_mode.enabled
        grad_mode.enabled = self.mode

    def __enter__(self) -> None:
        self._prev.append(self._prev_at_call)
        grad_mode.enabled = self.mode

    def __call__(self, fn: F) -> F:
        # as a decorator, the call that built this object must not change the mode for good
        grad_mode.enabled = self._prev_at_call
        return _decorate(fn, self.mode)
