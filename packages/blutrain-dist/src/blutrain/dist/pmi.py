"""A PMI-1 server, so that ranks started by ``blutrain run`` form one MPI world.

MPICH (the ``mpich`` wheel) and other PMI-1 clients bootstrap through a process manager: each rank
connects to ``PMI_PORT`` (host:port) and says who it is (``PMI_ID``); the process manager answers
the job's size and its rank, keeps the key-value space ranks publish their addresses in, and runs
the fences (``barrier_in``). This is that process manager's side of the simple PMI-1 wire protocol:
newline-terminated ``cmd=... key=value`` lines. Used at MPI init and finalize only.

``abort`` from a rank (MPI_Abort) is reported to the launcher through ``on_abort``.
"""

from __future__ import annotations

import os
import secrets
import socket
import threading
from collections.abc import Callable

from blutrain.dist.server import ThreadedServer


class PMIServer(ThreadedServer):
    """Serve PMI-1 for ``size`` ranks, ``per_node`` of them on each of the job's nodes."""

    def __init__(self, size: int, per_node: int, host: str = "0.0.0.0",
                 on_abort: Callable[[int, int, str], None] | None = None) -> None:
        super().__init__(host, 0, "blutrain-pmi")
        self.size = size
        self.per_node = per_node
        self.on_abort = on_abort
        # unique per job: MPICH names its node-local shared-memory segment after the kvs name, and a
        # segment left behind by a killed job must not be mistaken for this job's
        self.kvsname = f"blutrain_{os.getpid()}_{secrets.token_hex(6)}"
        self._kvs: dict[str, str] = {}
        self._cond = threading.Condition()
        self._arrived = 0
        self._generation = 0

    def _serve(self, conn: socket.socket) -> None:
        rank = -1
        with conn, conn.makefile("rb") as lines:
            for raw in lines:
                msg = dict(part.split("=", 1) for part in raw.decode().split() if "=" in part)
                cmd = msg.get("cmd", "")
                if cmd == "initack":
                    rank = int(msg.get("pmiid", "-1"))
                    replies = ["cmd=initack rc=0", f"cmd=set size={self.size}", f"cmd=set rank={rank}",
                               "cmd=set debug=0"]
                elif cmd == "abort":
                    if self.on_abort is not None:
                        self.on_abort(rank, int(msg.get("exitcode", "1")), msg.get("error_msg", ""))
                    return
                else:
                    replies = [self._answer(cmd, msg)]
                try:
                    conn.sendall("".join(r + "\n" for r in replies).encode())
                except OSError:
                    return
                if cmd == "finalize":
                    return

    def _answer(self, cmd: str, msg: dict[str, str]) -> str:
        if cmd == "init":
            return "cmd=response_to_init pmi_version=1 pmi_subversion=1 rc=0"
        if cmd == "get_maxes":
            return "cmd=maxes rc=0 kvsname_max=256 keylen_max=256 vallen_max=1024"
        if cmd == "get_appnum":
            return "cmd=appnum rc=0 appnum=0"
        if cmd == "get_my_kvsname":
            return f"cmd=my_kvsname rc=0 kvsname={self.kvsname}"
        if cmd == "get_universe_size":
            return f"cmd=universe_size rc=0 size={self.size}"
        if cmd == "put":
            with self._cond:
                self._kvs[msg.get("key", "")] = msg.get("value", "")
            return "cmd=put_result rc=0"
        if cmd == "get":
            key = msg.get("key", "")
            with self._cond:
                value = self._kvs.get(key)
            if value is None and key == "PMI_process_mapping":
                # ranks are placed in blocks of per_node, node after node
                value = f"(vector,(0,{self.size // self.per_node},{self.per_node}))"
            if value is None:
                return f"cmd=get_result rc=-1 msg=key_{key}_not_found"
            return f"cmd=get_result rc=0 value={value}"
        if cmd == "barrier_in":
            with self._cond:
                generation = self._generation
                self._arrived += 1
                if self._arrived == self.size:
                    self._arrived = 0
                    self._generation += 1
                    self._cond.notify_all()
                while self._generation == generation and not self._closed:
                    self._cond.wait(1.0)
            return "cmd=barrier_out rc=0"
        if cmd == "finalize":
            return "cmd=finalize_ack rc=0"
        return f"cmd={cmd or 'unknown'} rc=-1 msg=unsupported"


__all__ = ["PMIServer"]
