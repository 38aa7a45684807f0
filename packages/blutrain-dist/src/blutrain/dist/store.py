"""A TCP key-value store for bootstrap: NCCL unique ids, sub-group ids, launcher coordination.

One process hosts a :class:`StoreServer` (``blutrain run`` on node 0, else rank 0); every rank talks
to it through a :class:`TCPStore`. Values are bytes. ``get`` blocks until the key exists or the
timeout passes, which is how ranks wait for each other. It is used at start-up and on errors only,
never per op, so it is written for clarity: one thread per connection, one lock, length-prefixed frames.

Frame (client → server): command byte, key length (u32), key, value length (u32), value, timeout ms (u32).
Reply: status byte (0 ok, 1 missing/timed out), value length (u32), value.
"""

from __future__ import annotations

import socket
import struct
import threading
import time
from typing import Protocol, runtime_checkable

from blutrain.dist.errors import StoreError, StoreTimeoutError
from blutrain.dist.server import ThreadedServer

_SET, _GET, _ADD, _CHECK, _DELETE = b"S", b"G", b"A", b"C", b"D"
_HEAD = struct.Struct("!I")
_OK, _MISSING = 0, 1


@runtime_checkable
class Store(Protocol):
    """What process groups need from a store."""

    def set(self, key: str, value: bytes) -> None: ...
    def get(self, key: str, timeout: float | None = None) -> bytes: ...
    def add(self, key: str, amount: int) -> int: ...
    def check(self, key: str) -> bool: ...


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    chunks = []
    while n:
        chunk = sock.recv(n)
        if not chunk:
            raise ConnectionError("connection closed")
        chunks.append(chunk)
        n -= len(chunk)
    return b"".join(chunks)


def _recv_blob(sock: socket.socket) -> bytes:
    (n,) = _HEAD.unpack(_recv_exact(sock, 4))
    return _recv_exact(sock, n)


class StoreServer(ThreadedServer):
    """Hosts the key-value table on ``host:port`` (port 0 picks a free one; see :attr:`port`)."""

    def __init__(self, host: str = "0.0.0.0", port: int = 0) -> None:
        try:
            super().__init__(host, port, "blutrain-store")
        except OSError as exc:
            raise StoreError(f"store server: cannot listen on {host}:{port}: {exc}") from exc
        self._data: dict[str, bytes] = {}
        self._cond = threading.Condition()

    def _serve(self, conn: socket.socket) -> None:
        with conn:
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            while True:
                try:
                    cmd = _recv_exact(conn, 1)
                    key = _recv_blob(conn).decode()
                    value = _recv_blob(conn)
                    (timeout_ms,) = _HEAD.unpack(_recv_exact(conn, 4))
                except (ConnectionError, OSError):
                    return
                status, out = self._handle(cmd, key, value, timeout_ms / 1000.0)
                try:
                    conn.sendall(bytes([status]) + _HEAD.pack(len(out)) + out)
                except OSError:
                    return

    def _handle(self, cmd: bytes, key: str, value: bytes, timeout: float) -> tuple[int, bytes]:
        with self._cond:
            if cmd == _SET:
                self._data[key] = value
                self._cond.notify_all()
                return _OK, b""
            if cmd == _GET:
                deadline = time.monotonic() + timeout
                while key not in self._data:
                    left = deadline - time.monotonic()
                    if left <= 0:
                        return _MISSING, b""
                    self._cond.wait(left)
                return _OK, self._data[key]
            if cmd == _ADD:
                total = int(self._data.get(key, b"0")) + int(value)
                self._data[key] = str(total).encode()
                self._cond.notify_all()
                return _OK, self._data[key]
            if cmd == _CHECK:
                return (_OK if key in self._data else _MISSING), b""
            if cmd == _DELETE:
                return (_OK if self._data.pop(key, None) is not None else _MISSING), b""
        return _MISSING, b"unknown command"


class TCPStore:
    """A client of a :class:`StoreServer`; connects with retries until ``timeout`` (the server may
    not be up yet). Thread-safe: one request at a time on one connection."""

    def __init__(self, host: str, port: int, timeout: float = 300.0) -> None:
        if not isinstance(port, int) or not 0 < port < 65536:
            raise StoreError(f"TCPStore: port must be an int in 1..65535, got {port!r}")
        self.host, self.port, self.timeout = host, port, float(timeout)
        self._lock = threading.Lock()
        deadline = time.monotonic() + self.timeout
        delay = 0.01
        while True:
            try:
                self._sock = socket.create_connection((host, port), timeout=max(0.1, deadline - time.monotonic()))
                break
            except OSError as exc:
                if time.monotonic() + delay > deadline:
                    raise StoreError(f"TCPStore: cannot reach the store at {host}:{port} within {self.timeout:g} s: "
                                     f"{exc}; is the rank-0 process or `blutrain run` running there?") from exc
                time.sleep(delay)
                delay = min(delay * 2, 0.5)
        self._sock.settimeout(None)
        self._sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def _request(self, cmd: bytes, key: str, value: bytes = b"", timeout: float = 0.0) -> tuple[int, bytes]:
        k = key.encode()
        frame = cmd + _HEAD.pack(len(k)) + k + _HEAD.pack(len(value)) + value + _HEAD.pack(int(timeout * 1000))
        with self._lock:
            try:
                self._sock.sendall(frame)
                status = _recv_exact(self._sock, 1)[0]
                return status, _recv_blob(self._sock)
            except (ConnectionError, OSError) as exc:
                raise StoreError(f"TCPStore: lost the connection to {self.host}:{self.port} "
                                 f"during {cmd.decode()} {key!r}: {exc}") from exc

    def set(self, key: str, value: bytes) -> None:
        self._request(_SET, key, bytes(value))

    def get(self, key: str, timeout: float | None = None) -> bytes:
        """The value of ``key``, waiting for it up to ``timeout`` seconds (default: the store's)."""
        wait = self.timeout if timeout is None else float(timeout)
        status, value = self._request(_GET, key, timeout=wait)
        if status != _OK:
            raise StoreTimeoutError(f"TCPStore: key {key!r} did not appear at {self.host}:{self.port} within "
                                    f"{wait:g} s; a rank that should have set it may have died or hung")
        return value

    def add(self, key: str, amount: int) -> int:
        """Add ``amount`` to the integer stored at ``key`` (0 if absent) and return the new value."""
        return int(self._request(_ADD, key, str(int(amount)).encode())[1])

    def check(self, key: str) -> bool:
        return self._request(_CHECK, key)[0] == _OK

    def delete(self, key: str) -> bool:
        return self._request(_DELETE, key)[0] == _OK

    def close(self) -> None:
        try:
            self._sock.close()
        except OSError:
            pass


__all__ = ["Store", "StoreServer", "TCPStore"]
