"""Grad modes: ``no_grad``, ``enable_grad``, ``set_grad_enabled`` (context managers and decorators).

The flag itself lives in ``blutrain.tensor.dispatch.grad_mode`` (thread-local), where op functions
read it without a call.
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


class set_grad_enabled:
    """Set grad mode for a ``with`` block or a decorated function, restoring it afterwards."""

    def __init__(self, mode: bool) -> None:
        self.mode = bool(mode)
        self._prev: list[bool] = []

    def __enter__(self) -> None:
        self._prev.append(grad_mode.enabled)
        grad_mode.enabled = self.mode

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        grad_mode.enabled = self._prev.pop()

    def __call__(self, fn: F) -> F:
        mode = self.mode

        @functools.wraps(fn)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            with set_grad_enabled(mode):
                return fn(*args, **kwargs)

        return wrapper  # type: ignore[return-value]


class no_grad(set_grad_enabled):
    """Ops inside record nothing: for evaluation and for optimizer updates."""

    def __init__(self) -> None:
        super().__init__(False)


class enable_grad(set_grad_enabled):
    """Record again inside a ``no_grad`` region."""

    def __init__(self) -> None:
        super().__init__(True)
