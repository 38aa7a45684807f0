"""A listening TCP socket that serves each connection on a daemon thread: the shape both of
``blutrain run``'s servers have (the key-value store and the PMI-1 process manager)."""

from __future__ import annotations

import contextlib
import socket
import threading
from typing import Self


class ThreadedServer:
    """Listens on ``host:port`` (port 0 picks a free one; see :attr:`port`); :meth:`start` accepts
    connections on a daemon thread and hands each to :meth:`_serve` on a thread of its own, until
    :meth:`close`. Subclasses implement ``_serve``."""

    def __init__(self, host: str, port: int, name: str) -> None:
        self._sock = socket.create_server((host, port), backlog=1024)
        self.port: int = self._sock.getsockname()[1]
        self._name = name
        self._closed = False

    def start(self) -> Self:
        """Serve in a daemon thread (started separately so a launcher can fork its ranks first)."""
        threading.Thread(target=self._accept, name=self._name, daemon=True).start()
        return self

    def close(self) -> None:
        self._closed = True
        with contextlib.suppress(OSError):
            self._sock.close()

    def _accept(self) -> None:
        while not self._closed:
            try:
                conn, _ = self._sock.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        raise NotImplementedError(f"{type(self).__name__} must implement _serve(conn)")
