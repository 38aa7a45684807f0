"""``blutrain run``: start the local ranks of a job, watch them, and stop them all together.

Node 0's launcher hosts the job's key-value store (``BLUTRAIN_STORE``, at ``--master``) and a PMI-1
server (so MPI ranks form one world without mpiexec); every launcher starts its ``nproc`` ranks with
the torchrun-style variables set. Each rank runs in its own process group (session), so stopping a
rank stops whatever it started, and dies with the launcher (``PR_SET_PDEATHSIG``): no orphans.

If a rank exits non-zero or is killed, the launcher waits a moment for near-simultaneous failures
(a collective timing out on several ranks), then sends SIGTERM to the others, SIGKILL after a
grace period, and exits non-zero naming the first failed rank and its error. SIGINT/SIGTERM sent to
the launcher are forwarded to every rank.
"""

from __future__ import annotations

import collections
import contextlib
import ctypes
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType

from blutrain.dist.env import RUN_ID_ENV, STORE_ENV, TIMEOUT_ENV
from blutrain.dist.errors import LaunchError
from blutrain.dist.pmi import PMIServer
from blutrain.dist.store import StoreServer, TCPStore

_FAILED_KEY = "blutrain/run/failed"
_PMI_KEY = "blutrain/run/pmi"
_RUN_ID_KEY = "blutrain/run/id"
# The thread-count variables of OpenMP and the BLAS libraries NumPy may use. Each rank gets its share of
# the node's cores, as torchrun does; N ranks each starting one thread per core would oversubscribe them N×.
THREAD_ENVS = ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS", "BLIS_NUM_THREADS",
               "VECLIB_MAXIMUM_THREADS", "NUMEXPR_NUM_THREADS")
_SETTLE = 1.0  # seconds to collect near-simultaneous failures before stopping the rest
_ERROR_LINE = re.compile(r"^(?:[A-Za-z_][\w.]*(?:Error|Exception|Interrupt|Exit|Warning)\w*(?::.*)?"
                         r"|blutrain \w[\w-]*: error: .*)$")
# Variables of other launchers that would make a rank read the wrong rank or PMI connection.
_CLEARED = ("PMI_FD", "PMI_RANK", "PMI_SIZE", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "SLURM_PROCID")


@dataclass
class Rank:
    """One local rank as the launcher sees it."""

    rank: int
    process: subprocess.Popen[bytes]
    tail: collections.deque[str] = field(default_factory=lambda: collections.deque(maxlen=50))
    reader: threading.Thread | None = None
    stopped: bool = False  # stopped by the launcher, not of its own accord

    def error(self) -> str:
        """The rank's error as the last exception-looking line of its stderr, else its last line."""
        lines = [line.strip() for line in self.tail if line.strip()]
        for line in reversed(lines):
            if _ERROR_LINE.match(line):
                return line
        return lines[-1] if lines else ""

    def describe(self) -> str:
        rc = self.process.returncode
        if rc is None:
            how = "still running"
        elif rc < 0:
            try:
                how = f"killed by {signal.Signals(-rc).name}"
            except ValueError:
                how = f"killed by signal {-rc}"
        else:
            how = f"exited with code {rc}"
        error = self.error() if rc not in (None, 0) and not self.stopped else ""
        return f"rank {self.rank} (pid {self.process.pid}) {how}" + (f": {error}" if error else "")


def _libc_prctl() -> object:
    try:
        return ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):  # not Linux
        return None


# looked up once in the parent: the child between fork and exec only calls it (no imports, no locks)
_PRCTL = _libc_prctl()


def _die_with_parent() -> None:
    """In the child, before exec: get SIGKILL when the launcher dies (Linux), so no rank outlives it."""
    if callable(_PRCTL):
        _PRCTL(1, int(signal.SIGKILL))  # PR_SET_PDEATHSIG


def _signal_group(proc: subprocess.Popen[bytes], sig: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, sig)


def _group_alive(pgid: int) -> bool:
    """Whether a process of group ``pgid`` still runs (zombies do not count). SIGKILL is delivered
    asynchronously, so a killed rank's children may still be on their way out when the rank is reaped."""
    proc = Path("/proc")
    if not proc.is_dir():  # not Linux: a signal 0 to the group tells whether any member, zombie or not, is left
        try:
            os.killpg(pgid, 0)
        except (ProcessLookupError, PermissionError):
            return False
        return True
    for entry in proc.iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if fields[0] != "Z" and int(fields[2]) == pgid:
            return True
    return False


def _relay(rank: Rank) -> None:
    """Copy the rank's stderr to ours, prefixed with its rank, keeping the last lines for the report."""
    stream = rank.process.stderr
    assert stream is not None
    prefix = f"[rank{rank.rank}]: ".encode()
    out = sys.stderr.buffer if hasattr(sys.stderr, "buffer") else None
    for raw in iter(stream.readline, b""):
        rank.tail.append(raw.decode(errors="replace"))
        if out is not None:
            with contextlib.suppress(OSError, ValueError):
                out.write(prefix + raw)
                out.flush()
        else:
            print(f"[rank{rank.rank}]: {raw.decode(errors='replace')}", end="", file=sys.stderr)
    stream.close()


def _shared_segments(pid: int) -> set[str]:
    """The MPICH shared-memory segments a rank has mapped (Linux; empty elsewhere)."""
    try:
        with open(f"/proc/{pid}/maps") as maps:
            return {line.split()[-1] for line in maps if "/dev/shm/mpich_shm_" in line}
    except OSError:
        return set()


def parse_master(master: str) -> tuple[str, int]:
    host, sep, port = master.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 <= int(port) < 65536:
        raise LaunchError(f"--master must be ADDR:PORT (e.g. 10.0.0.1:29500), got {master!r}")
    return host, int(port)


class Launcher:
    """Start ``command`` as ranks ``node_rank * nproc .. + nproc - 1`` of ``nnodes * nproc``."""

    def __init__(self, command: Sequence[str], nproc: int, nnodes: int = 1, node_rank: int = 0,
                 master: str | None = None, timeout: float | None = None, grace: float = 5.0) -> None:
        if not command:
            raise LaunchError("blutrain run: no command given; usage: blutrain run -n N -- SCRIPT [ARGS...]")
        for name, value, low in (("-n/--nproc", nproc, 1), ("--nnodes", nnodes, 1), ("--node-rank", node_rank, 0)):
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise LaunchError(f"blutrain run: {name} must be an int >= {low}, got {value!r}")
        if node_rank >= nnodes:
            raise LaunchError(f"blutrain run: --node-rank must be < --nnodes ({nnodes}), got {node_rank}")
        if nnodes > 1 and master is None:
            raise LaunchError("blutrain run: --master ADDR:PORT is required with --nnodes > 1 (node 0's address)")
        if timeout is not None and not timeout > 0:
            raise LaunchError(f"blutrain run: --timeout must be > 0 seconds, got {timeout!r}")
        self.command = list(command)
        self.nproc, self.nnodes, self.node_rank = nproc, nnodes, node_rank
        self.world = nproc * nnodes
        self.host, self.port = parse_master(master) if master is not None else ("127.0.0.1", 0)
        self.timeout, self.grace = timeout, grace
        self.ranks: list[Rank] = []
        self._signal: int | None = None
        self._aborted: list[str] = []
        # MPICH unlinks its node-local segment at MPI_Finalize; a rank that is killed or leaves after
        # a timeout never gets there, so the launcher removes what its ranks had mapped
        self._segments: set[str] = set()
        self.run_id = ""

    # ---------------------------------------------------------------------------------- set-up
    def _rendezvous(self) -> tuple[StoreServer | None, PMIServer | None, TCPStore, str]:
        server = pmi = None
        if self.node_rank == 0:
            server = StoreServer("0.0.0.0" if self.nnodes > 1 else "127.0.0.1", self.port)
            self.port = server.port
            pmi = PMIServer(self.world, self.nproc, "0.0.0.0" if self.nnodes > 1 else "127.0.0.1",
                            on_abort=self._on_abort)
        # node 0 serves in threads started after the ranks are forked; its own client connects now
        # (the listening socket queues the connection), the other nodes' wait for node 0
        if server is not None:
            server.start()
        client = TCPStore(self.host, self.port, timeout=self.timeout or 300.0)
        if pmi is not None:
            client.set(_PMI_KEY, f"{self.host}:{pmi.port}".encode())
            client.set(_RUN_ID_KEY, os.environ.get(RUN_ID_ENV, time.strftime("%Y%m%d-%H%M%S")).encode())
        pmi_addr = client.get(_PMI_KEY).decode()
        self.run_id = client.get(_RUN_ID_KEY).decode()
        return server, pmi, client, pmi_addr

    def _env(self, local_rank: int, pmi_addr: str) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if k not in _CLEARED}
        rank = self.node_rank * self.nproc + local_rank
        env.update(RANK=str(rank), WORLD_SIZE=str(self.world), LOCAL_RANK=str(local_rank),
                   LOCAL_WORLD_SIZE=str(self.nproc), GROUP_RANK=str(self.node_rank), NODE_RANK=str(self.node_rank),
                   MASTER_ADDR=self.host, MASTER_PORT=str(self.port), PMI_PORT=pmi_addr, PMI_ID=str(rank))
        env[STORE_ENV] = f"{self.host}:{self.port}"
        env[RUN_ID_ENV] = self.run_id
        env.setdefault("PYTHONUNBUFFERED", "1")
        env.update(rank_threads(os.environ, self.nproc))
        if self.timeout is not None:
            env[TIMEOUT_ENV] = str(self.timeout)
        return env

    def _on_abort(self, rank: int, code: int, message: str) -> None:
        self._aborted.append(f"rank {rank} called MPI_Abort (exit code {code})" + (f": {message}" if message else ""))

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        self._signal = signum
        for r in self.ranks:
            _signal_group(r.process, signum)

    # ---------------------------------------------------------------------------------- run
    def run(self) -> int:
        """Start the ranks, wait for them, and return the launcher's exit code (0: all ranks succeeded)."""
        server, pmi, client, pmi_addr = self._rendezvous()
        previous = {s: signal.signal(s, self._on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
        try:
            for local in range(self.nproc):
                try:
                    proc = subprocess.Popen(self.command, env=self._env(local, pmi_addr), stderr=subprocess.PIPE,
                                            start_new_session=True, preexec_fn=_die_with_parent)
                except OSError as exc:
                    self._stop_all()
                    raise LaunchError(f"blutrain run: cannot start {self.command[0]!r}: {exc}") from exc
                self.ranks.append(Rank(self.node_rank * self.nproc + local, proc))
            if pmi is not None:
                pmi.start()
            for r in self.ranks:
                r.reader = threading.Thread(target=_relay, args=(r,), daemon=True)
                r.reader.start()
            return self._watch(client)
        finally:
            self._stop_all()
            for s, handler in previous.items():
                signal.signal(s, handler)
            client.close()
            for srv in (server, pmi):
                if srv is not None:
                    srv.close()

    def _watch(self, client: TCPStore) -> int:
        failed: list[Rank] = []
        remote = ""
        next_check = 0.0
        next_scan = time.monotonic() + 1.0
        while True:
            if time.monotonic() >= next_scan:
                next_scan = time.monotonic() + 1.0
                self._scan_segments()
            running = [r for r in self.ranks if r.process.poll() is None]
            failed = [r for r in self.ranks if r.process.returncode not in (None, 0)]
            if not running or failed or self._signal is not None or self._aborted:
                break
            if self.nnodes > 1 and time.monotonic() >= next_check:
                next_check = time.monotonic() + 0.5
                with contextlib.suppress(Exception):
                    if client.check(_FAILED_KEY):
                        remote = client.get(_FAILED_KEY, timeout=1.0).decode()
                        break
            time.sleep(0.02)
        if not failed and not remote and self._signal is None and not self._aborted:
            self._join_readers()
            return 0
        # let ranks that fail at nearly the same moment (a collective timing out everywhere) say so; after a
        # forwarded SIGINT/SIGTERM, give them the grace period to checkpoint and exit on their own
        settle = time.monotonic() + (self.grace if self._signal is not None else _SETTLE)
        while time.monotonic() < settle and any(r.process.poll() is None for r in self.ranks):
            time.sleep(0.02)
        still = [r for r in self.ranks if r.process.poll() is None]
        for r in still:
            r.stopped = True
        if self._signal is not None:
            for r in self.ranks:
                if r.process.returncode == -self._signal:
                    r.stopped = True
        self._stop_all()
        self._join_readers()
        failed = sorted((r for r in self.ranks if r.process.returncode not in (None, 0) and not r.stopped),
                        key=lambda r: r.rank)
        return self._report(failed, still, remote, client)

    def _report(self, failed: list[Rank], still: list[Rank], remote: str, client: TCPStore) -> int:
        lines = []
        if self._signal is not None:
            lines.append(f"blutrain run: received {signal.Signals(self._signal).name}; stopped all ranks")
        lines.extend(f"blutrain run: {a}" for a in self._aborted)
        if failed:
            first = failed[0]
            lines.append(f"blutrain run: {first.describe()}")
            lines.extend(f"blutrain run: also {r.describe()}" for r in failed[1:])
            with contextlib.suppress(Exception):
                client.set(_FAILED_KEY, f"node {self.node_rank}: {first.describe()}".encode())
        elif remote:
            lines.append(f"blutrain run: another node failed: {remote}")
        if still:
            who = ", ".join(str(r.rank) for r in still)
            lines.append(f"blutrain run: rank(s) {who} had not failed and were stopped"
                         + ("; a rank that never reached the collective the others timed out in is the one that "
                            "hung" if failed and "Timeout" in failed[0].error() else ""))
        print("\n".join(lines), file=sys.stderr, flush=True)
        if self._signal is not None:
            return 128 + self._signal
        if failed:
            rc = failed[0].process.returncode
            return rc if rc is not None and rc > 0 else 128 + (-(rc or 0) or 1)
        return 1

    def _scan_segments(self) -> None:
        for r in self.ranks:
            if r.process.poll() is None:
                self._segments |= _shared_segments(r.process.pid)

    def _stop_all(self) -> None:
        """SIGTERM every rank's process group, SIGKILL after the grace period, and reap them all."""
        self._scan_segments()
        live = [r for r in self.ranks if r.process.poll() is None]
        for r in live:
            _signal_group(r.process, signal.SIGTERM)
        deadline = time.monotonic() + self.grace
        while time.monotonic() < deadline and any(r.process.poll() is None for r in live):
            time.sleep(0.02)
        for r in self.ranks:
            # the whole group, also where the leader has exited: a rank's children go with it
            _signal_group(r.process, signal.SIGKILL)
        for r in self.ranks:
            with contextlib.suppress(subprocess.TimeoutExpired):
                r.process.wait(timeout=5.0)
        deadline = time.monotonic() + 5.0  # until the killed groups are gone: nothing outlives the launcher
        while time.monotonic() < deadline and any(_group_alive(r.process.pid) for r in self.ranks):
            time.sleep(0.01)
        for path in self._segments:
            with contextlib.suppress(OSError):
                os.unlink(path)
        self._segments.clear()

    def _join_readers(self) -> None:
        for r in self.ranks:
            if r.reader is not None:
                r.reader.join(timeout=2.0)


def rank_threads(environ: Mapping[str, str], nproc: int, cores: int | None = None) -> dict[str, str]:
    """The thread-count variables (``THREAD_ENVS``) for each of ``nproc`` ranks on this node: the user's
    ``OMP_NUM_THREADS`` where set, else max(1, cores // nproc); a variable the user set is left alone."""
    if cores is None:
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    share = environ.get("OMP_NUM_THREADS") or str(max(1, cores // nproc))
    return {name: share for name in THREAD_ENVS if name not in environ}


def resolve_command(argv: Sequence[str]) -> list[str]:
    """``script.py args`` runs under this Python, ``blutrain ...`` as ``python -m blutrain.cli``,
    ``-m module`` as ``python -m module``; anything else as given."""
    args = list(argv)
    if args and args[0] == "--":
        args = args[1:]
    if not args:
        return args
    if args[0].endswith(".py") or args[0] == "-m" or args[0] == "-c":
        return [sys.executable, *args]
    if args[0] == "blutrain":
        return [sys.executable, "-m", "blutrain.cli", *args[1:]]
    return args


def run(command: Sequence[str], nproc: int, nnodes: int = 1, node_rank: int = 0, master: str | None = None,
        timeout: float | None = None, grace: float = 5.0) -> int:
    """Launch ``command`` (see :func:`resolve_command`) on ``nproc`` local ranks; the exit code."""
    return Launcher(resolve_command(command), nproc, nnodes, node_rank, master, timeout, grace).run()


__all__ = ["THREAD_ENVS", "Launcher", "Rank", "parse_master", "rank_threads", "resolve_command",
           "run"]
