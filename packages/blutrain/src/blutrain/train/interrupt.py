"""SIGINT and SIGTERM during training: finish the step, checkpoint it, stop.

While a run trains, :class:`StopSignals` replaces the two handlers. The first SIGINT (Ctrl-C) or SIGTERM
(Slurm's preemption, ``kill``, ``blutrain run`` forwarding either) only records the signal: the trainer
stops at the next step boundary, where the state is whole, writes a checkpoint of that step and exits with
128 + the signal. A second SIGINT means "now": it raises KeyboardInterrupt at once, without a checkpoint.
Handlers can only be installed from the main thread; elsewhere (a Trainer run in a worker thread) the
process's handlers are left as they are.
"""

from __future__ import annotations

import signal
import threading
from types import FrameType, TracebackType
from typing import Any

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)


class StopSignals:
    """A context manager: inside it, ``received`` is the first stop signal seen (None until one arrives)."""

    def __init__(self, on_first: Any = None) -> None:
        self.received: int | None = None
        self._on_first = on_first  # called with the signal number on the first one (a message to the user)
        self._previous: dict[int, Any] = {}

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if self.received is None:
            self.received = signum
            if self._on_first is not None:
                self._on_first(signum)
        elif signum == signal.SIGINT:
            raise KeyboardInterrupt

    def __enter__(self) -> StopSignals:
        if threading.current_thread() is threading.main_thread():
            self._previous = {s: signal.signal(s, self._handle) for s in STOP_SIGNALS}
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        for s, handler in self._previous.items():
            signal.signal(s, handler)
        self._previous = {}


def signal_name(signum: int) -> str:
    return signal.Signals(signum).name


__all__ = ["STOP_SIGNALS", "StopSignals", "signal_name"]
