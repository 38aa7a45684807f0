"""Exposed communication of a training step, from a kernel timeline: the milliseconds during which an NCCL
kernel ran and no other kernel did.

Two sources of that timeline. ``--profiler torch`` (the default where PyTorch is installed): rank 0 runs its
profiled steps under ``torch.profiler`` (CUPTI through Kineto sees every kernel of the process, CuPy's, NCCL's
and those inside CUDA graphs) and writes one Chrome trace per configuration, ``<name>.trace.json``.
``--profiler nsys``: tools/bench/dist.py runs rank 0 of a launch under Nsight Systems (``nsys profile
--trace=cuda,nvtx`` with the CUDA profiler API as capture range, kernels inside CUDA graphs traced one by one,
exported to SQLite) and brackets each configuration's profiled steps with an NVTX range named
``PROFILE_RANGE_PREFIX + name``. Here: reading the Chrome traces, the ``nsys`` command line, reading kernels
and ranges back from the SQLite export, and the interval
arithmetic, which is plain Python so that it is tested without a GPU.

Per profiled range: ``comm`` = the measure of the union of NCCL kernels' intervals (a kernel is NCCL's when its
name contains "nccl", any case); ``exposed`` = ``comm`` minus its intersection with the union of every other
kernel's intervals. Both are divided by the number of profiled steps. Communication hidden under compute
costs nothing; exposed communication is what the step waits for (NCCL kernels also spin while they wait for
a peer: that waiting is counted as communication, which is what it costs the step).
"""

from __future__ import annotations

import contextlib
import json
import shutil
import sqlite3
import subprocess
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

PROFILE_RANGE_PREFIX = "bench-dist:"
UNDER_NSYS_ENV = "BLUTRAIN_BENCH_DIST_UNDER_NSYS"  # set in the profiled rank's environment: do not re-exec
NSYS_OPTIONS = ("--trace=cuda,nvtx", "--sample=none", "--cpuctxsw=none", "--capture-range=cudaProfilerApi",
                "--capture-range-end=repeat", "--export=sqlite", "--force-overwrite=true")
GRAPH_NODES_OPTION = "--cuda-graph-trace=node"  # each kernel of a CUDA graph, not the graph as one span

Interval = tuple[float, float]


@dataclass(frozen=True)
class Kernel:
    """One kernel on the device timeline: [start, end) in nanoseconds."""

    name: str
    start: float
    end: float
    device: int = 0

    @property
    def is_nccl(self) -> bool:
        return "nccl" in self.name.lower()


@dataclass(frozen=True)
class CommCost:
    """Per step, in milliseconds: NCCL kernels' busy time, the part of it no compute kernel overlapped, and
    compute kernels' busy time."""

    comm_ms: float
    exposed_ms: float
    compute_ms: float
    steps: int
    kernels: int


def union(intervals: Iterable[Interval]) -> list[Interval]:
    """Disjoint, sorted intervals covering exactly what ``intervals`` cover (empty ones dropped)."""
    merged: list[Interval] = []
    for start, end in sorted(iv for iv in intervals if iv[1] > iv[0]):
        if merged and start <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], end))
        else:
            merged.append((start, end))
    return merged


def measure(intervals: Sequence[Interval]) -> float:
    """Total length of disjoint intervals."""
    return sum(end - start for start, end in intervals)


def intersect(a: Sequence[Interval], b: Sequence[Interval]) -> list[Interval]:
    """The intersection of two sorted lists of disjoint intervals (a merge walk)."""
    out: list[Interval] = []
    i = j = 0
    while i < len(a) and j < len(b):
        start, end = max(a[i][0], b[j][0]), min(a[i][1], b[j][1])
        if end > start:
            out.append((start, end))
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return out


def comm_cost(kernels: Sequence[Kernel], steps: int) -> CommCost:
    """Communication and its exposed part per step over ``kernels`` (one device's, one profiled range)."""
    if steps < 1:
        raise ValueError(f"steps must be >= 1, got {steps}")
    comm = union((k.start, k.end) for k in kernels if k.is_nccl)
    compute = union((k.start, k.end) for k in kernels if not k.is_nccl)
    comm_ns, compute_ns = measure(comm), measure(compute)
    exposed_ns = comm_ns - measure(intersect(comm, compute))
    return CommCost(comm_ns / steps / 1e6, exposed_ns / steps / 1e6, compute_ns / steps / 1e6, steps, len(kernels))


def main_device(kernels: Sequence[Kernel]) -> list[Kernel]:
    """The kernels of the device that ran most of them (a rank's own GPU; a stray context elsewhere aside)."""
    if not kernels:
        return []
    device = Counter(k.device for k in kernels).most_common(1)[0][0]
    return [k for k in kernels if k.device == device]


# -- Nsight Systems -------------------------------------------------------------------------------------
def nsys_path() -> str | None:
    """nsys on PATH, else where CUDA toolkits and Nsight Systems installers put it (the newest), else the copy
    that Nsight Compute carries in its host folder (the lent machines have only that one)."""
    found = shutil.which("nsys")
    if found:
        return found
    for pattern in ("/usr/local/cuda/bin/nsys", "/opt/nvidia/nsight-systems/*/bin/nsys", "/usr/local/cuda-*/bin/nsys",
                    "/opt/nvidia/nsight-compute/*/host/target-linux-x64/nsys"):
        candidates = sorted(Path("/").glob(pattern.lstrip("/")))
        if candidates:
            return str(candidates[-1])
    return None


def nsys_graph_node_tracing(nsys: str) -> bool:
    """Whether this nsys traces the kernels inside CUDA graphs one by one (needed for compiled steps)."""
    with contextlib.suppress(OSError, subprocess.SubprocessError):
        out = subprocess.run([nsys, "profile", "--help"], capture_output=True, text=True, timeout=60)
        return "cuda-graph-trace" in out.stdout + out.stderr
    return False


def nsys_command(nsys: str, report: Path, graph_nodes: bool) -> list[str]:
    """The prefix that runs a rank's command under nsys: one report per capture range (``report`` plus a
    counter), each exported to SQLite."""
    return [nsys, "profile", *NSYS_OPTIONS, *([GRAPH_NODES_OPTION] if graph_nodes else []), "-o", str(report)]


def export_missing(nsys: str, folder: Path, timeout: float = 120.0) -> list[str]:
    """``nsys export`` every report in ``folder`` that has no SQLite file yet; the problems, one line each."""
    problems = []
    for rep in sorted(folder.glob("*.nsys-rep")):
        sqlite = rep.with_suffix(".sqlite")
        if sqlite.exists():
            continue
        try:
            done = subprocess.run([nsys, "export", "--type=sqlite", "--force-overwrite=true", "-o", str(sqlite),
                                   str(rep)], capture_output=True, text=True, timeout=timeout)
            if done.returncode != 0:
                problems.append(f"nsys export {rep.name}: exit code {done.returncode}: "
                                f"{(done.stderr or done.stdout).strip()[-200:]}")
        except (OSError, subprocess.SubprocessError) as exc:
            problems.append(f"nsys export {rep.name}: {exc}")
    return problems


def _tables(db: sqlite3.Connection) -> set[str]:
    return {row[0] for row in db.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}


def _columns(db: sqlite3.Connection, table: str) -> set[str]:
    return {row[1] for row in db.execute(f"PRAGMA table_info({table})")}


def read_kernels(db: sqlite3.Connection) -> list[Kernel]:
    """Every kernel of an nsys SQLite export (``CUPTI_ACTIVITY_KIND_KERNEL``; names through ``StringIds``)."""
    if "CUPTI_ACTIVITY_KIND_KERNEL" not in _tables(db):
        return []
    cols = _columns(db, "CUPTI_ACTIVITY_KIND_KERNEL")
    name_col = next((c for c in ("demangledName", "shortName", "mangledName") if c in cols), None)
    if name_col is None:
        raise ValueError("CUPTI_ACTIVITY_KIND_KERNEL has no name column")
    device = "k.deviceId" if "deviceId" in cols else "0"
    rows = db.execute(f"SELECT s.value, k.start, k.end, {device} FROM CUPTI_ACTIVITY_KIND_KERNEL AS k "
                      f"JOIN StringIds AS s ON s.id = k.{name_col}")
    return [Kernel(str(name), float(start), float(end), int(dev)) for name, start, end, dev in rows]


def read_ranges(db: sqlite3.Connection, prefix: str = PROFILE_RANGE_PREFIX) -> dict[str, Interval]:
    """NVTX ranges whose text starts with ``prefix``: name (the prefix removed) → (start, end) in ns. The
    text is in ``text``, or in ``StringIds`` through ``textId`` (newer exports)."""
    if "NVTX_EVENTS" not in _tables(db):
        return {}
    cols = _columns(db, "NVTX_EVENTS")
    text = ("COALESCE(e.text, (SELECT value FROM StringIds WHERE id = e.textId))" if "textId" in cols
            else "e.text")
    out: dict[str, Interval] = {}
    for label, start, end in db.execute(f"SELECT {text}, e.start, e.end FROM NVTX_EVENTS AS e "
                                        "WHERE e.end IS NOT NULL"):
        if isinstance(label, str) and label.startswith(prefix):
            out[label[len(prefix):]] = (float(start), float(end))
    return out


def costs_from_exports(paths: Iterable[Path], steps: dict[str, int]) -> tuple[dict[str, CommCost], list[str]]:
    """For every profiled range found in the SQLite exports ``paths`` whose name is a key of ``steps`` (its
    number of profiled steps): its communication cost, from the kernels that started and ended inside it.
    Returns the costs and the problems met (one line each)."""
    costs: dict[str, CommCost] = {}
    problems: list[str] = []
    for path in paths:
        try:
            with contextlib.closing(sqlite3.connect(f"file:{path}?mode=ro", uri=True)) as db:
                ranges = read_ranges(db)
                kernels = main_device(read_kernels(db)) if ranges else []
        except (sqlite3.Error, ValueError) as exc:
            problems.append(f"{path.name}: {exc}")
            continue
        for name, (start, end) in ranges.items():
            if name not in steps:
                continue
            inside = [k for k in kernels if k.start >= start and k.end <= end]
            if not inside:
                problems.append(f"{path.name}: no kernel inside the range of {name}")
                continue
            costs[name] = comm_cost(inside, steps[name])
    return costs, problems


# -- torch.profiler ------------------------------------------------------------------------------------------
TORCH_TRACE_SUFFIX = ".trace.json"  # one Chrome trace per profiled configuration: <config name>.trace.json


def read_chrome_trace(path: Path, categories: Sequence[str] = ("kernel",)) -> list[Kernel]:
    """Device activity of a ``torch.profiler`` Chrome trace: complete events (``"ph": "X"``) of ``categories``
    (default the kernels; also e.g. "gpu_memcpy", "gpu_memset", named ``[category] name``), their
    ``ts``/``dur`` (µs) as nanoseconds, on the device its ``args.device`` names."""
    data = json.loads(path.read_text())
    events = data.get("traceEvents", []) if isinstance(data, dict) else data
    out = []
    for e in events:
        if isinstance(e, dict) and e.get("cat") in categories and e.get("ph") == "X":
            start = float(e["ts"]) * 1e3
            args = e.get("args") or {}
            name = str(e.get("name", ""))
            out.append(Kernel(name if e["cat"] == "kernel" else f"[{e['cat']}] {name}", start,
                              start + float(e.get("dur", 0.0)) * 1e3, int(args.get("device", 0))))
    return out


def costs_from_chrome_traces(paths: Iterable[Path], steps: dict[str, int]
                             ) -> tuple[dict[str, CommCost], dict[str, list[KernelRow]], list[str]]:
    """For every trace ``<name>.trace.json`` whose name is a key of ``steps`` (its number of profiled steps): its
    communication cost and its kernel table (every kernel in the trace ran in the profiled steps). Returns the
    costs, the tables and the problems met (one line each)."""
    costs: dict[str, CommCost] = {}
    tables: dict[str, list[KernelRow]] = {}
    problems: list[str] = []
    for path in paths:
        name = path.name.removesuffix(TORCH_TRACE_SUFFIX)
        if name not in steps:
            continue
        try:
            kernels = main_device(read_chrome_trace(path))
        except (OSError, ValueError, KeyError, TypeError) as exc:
            problems.append(f"{path.name}: {exc}")
            continue
        if not kernels:
            problems.append(f"{path.name}: no kernel in the trace")
            continue
        costs[name] = comm_cost(kernels, steps[name])
        tables[name] = kernel_table(kernels, steps[name])
    return costs, tables, problems


@dataclass(frozen=True)
class KernelRow:
    """One kernel name's share of a profiled step: calls and busy milliseconds per step."""

    name: str
    calls: float
    ms: float
    nccl: bool


def short_name(name: str, width: int = 70) -> str:
    """A kernel's name without its argument list and template arguments, cut to ``width``."""
    base = name.split("(", 1)[0]
    if "<" in base:
        base = base.split("<", 1)[0]
    return base if len(base) <= width else base[: width - 1] + "…"


def kernel_table(kernels: Sequence[Kernel], steps: int, idle: bool = True) -> list[KernelRow]:
    """Kernels grouped by :func:`short_name`, most time first, per step; with ``idle`` a last row ``(idle)``: the
    time within the profiled span when no kernel ran (the device waiting on the host or on a peer)."""
    if steps < 1:
        raise ValueError(f"steps must be >= 1, got {steps}")
    calls: Counter[str] = Counter()
    busy: dict[str, float] = {}
    for k in kernels:
        key = short_name(k.name)
        calls[key] += 1
        busy[key] = busy.get(key, 0.0) + k.end - k.start
    rows = [KernelRow(n, calls[n] / steps, busy[n] / steps / 1e6, "nccl" in n.lower())
            for n in sorted(busy, key=lambda n: -busy[n])]
    if idle and kernels:
        span = max(k.end for k in kernels) - min(k.start for k in kernels)
        gap = span - measure(union((k.start, k.end) for k in kernels))
        rows.append(KernelRow("(idle)", 0.0, gap / steps / 1e6, False))
    return rows

