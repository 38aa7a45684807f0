"""The TCP key-value store: set/get across clients, blocking get with a timeout, add, check, delete."""

from __future__ import annotations

import threading
import time

import pytest

from blutrain.dist import StoreError, StoreServer, StoreTimeoutError, TCPStore


@pytest.fixture()
def server() -> StoreServer:
    srv = StoreServer("127.0.0.1", 0).start()
    yield srv
    srv.close()


def test_a_value_set_by_one_client_is_read_by_another(server: StoreServer) -> None:
    a, b = TCPStore("127.0.0.1", server.port), TCPStore("127.0.0.1", server.port)
    a.set("id", b"\x00\x01binary")
    assert b.get("id") == b"\x00\x01binary"


def test_get_waits_for_a_key_set_later(server: StoreServer) -> None:
    a, b = TCPStore("127.0.0.1", server.port), TCPStore("127.0.0.1", server.port)
    threading.Timer(0.2, a.set, args=("late", b"v")).start()
    assert b.get("late", timeout=10) == b"v"


def test_get_of_a_missing_key_times_out_naming_the_key(server: StoreServer) -> None:
    store = TCPStore("127.0.0.1", server.port)
    start = time.monotonic()
    with pytest.raises(StoreTimeoutError, match="'never'"):
        store.get("never", timeout=0.3)
    assert time.monotonic() - start < 5


def test_add_counts_across_clients(server: StoreServer) -> None:
    clients = [TCPStore("127.0.0.1", server.port) for _ in range(4)]
    totals = sorted(c.add("n", 1) for c in clients)
    assert totals == [1, 2, 3, 4]


def test_check_and_delete(server: StoreServer) -> None:
    store = TCPStore("127.0.0.1", server.port)
    assert not store.check("k")
    store.set("k", b"")
    assert store.check("k") and store.delete("k") and not store.check("k")


def test_a_store_nobody_serves_is_an_error_naming_the_address() -> None:
    srv = StoreServer("127.0.0.1", 0)
    port = srv.port
    srv.close()
    with pytest.raises(StoreError, match=f"127.0.0.1:{port}"):
        TCPStore("127.0.0.1", port, timeout=0.3)
