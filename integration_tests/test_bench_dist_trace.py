"""tools/bench/dist_profile.py's torch.profiler side: kernels read back from a Chrome trace, the communication
cost of each profiled configuration, and the per-kernel table (what a profile's top costs are)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

profile = pytest.importorskip("bench.dist_profile", reason="tools/ is not part of this checkout")


def event(name: str, ts_us: float, dur_us: float, device: int = 0, cat: str = "kernel") -> dict[str, Any]:
    return {"ph": "X", "cat": cat, "name": name, "ts": ts_us, "dur": dur_us, "pid": device, "tid": 7,
            "args": {"device": device, "stream": 7}}


def write_trace(path: Path, events: list[dict[str, Any]]) -> Path:
    path.write_text(json.dumps({"schemaVersion": 1, "traceEvents": events}))
    return path


def test_a_trace_gives_its_kernels_in_nanoseconds_and_skips_other_events(tmp_path: Path) -> None:
    trace = write_trace(tmp_path / "x.trace.json", [
        event("sm90_xmma_gemm_bf16(int)", 10.0, 5.0),
        event("cudaLaunchKernel", 9.0, 1.0, cat="cuda_runtime"),
        {"ph": "i", "cat": "kernel", "name": "marker", "ts": 3.0},
        event("ncclDevKernel_AllReduce_Sum_f32_RING_LL(ncclDevKernelArgsStorage<4096ul>)", 12.0, 6.0, device=1),
    ])
    kernels = profile.read_chrome_trace(trace)
    assert [(k.name.split("(")[0], k.start, k.end, k.device) for k in kernels] == [
        ("sm90_xmma_gemm_bf16", 10_000.0, 15_000.0, 0), ("ncclDevKernel_AllReduce_Sum_f32_RING_LL", 12_000.0,
                                                          18_000.0, 1)]
    assert kernels[1].is_nccl and not kernels[0].is_nccl


def test_each_configurations_trace_gives_its_exposed_communication_and_kernel_table(tmp_path: Path) -> None:
    # two steps: per step a 4 µs GEMM, then an all-reduce of 3 µs of which 1 µs runs beside the next GEMM
    events = []
    for step in range(2):
        t = step * 10.0
        events += [event("gemm(a)", t, 4.0), event("ncclDevKernel_AllReduce(x)", t + 4.0, 3.0),
                   event("gemm(a)", t + 6.0, 2.0)]
    write_trace(tmp_path / "blutrain-compiled-ddp-4gpu.trace.json", events)
    write_trace(tmp_path / "not-asked.trace.json", events)
    write_trace(tmp_path / "empty-one.trace.json", [])
    costs, tables, problems = profile.costs_from_chrome_traces(
        sorted(tmp_path.glob("*.trace.json")), {"blutrain-compiled-ddp-4gpu": 2, "empty-one": 1})
    assert set(costs) == {"blutrain-compiled-ddp-4gpu"}
    cost = costs["blutrain-compiled-ddp-4gpu"]
    assert cost.comm_ms == pytest.approx(3e-3) and cost.exposed_ms == pytest.approx(2e-3)
    assert cost.compute_ms == pytest.approx(6e-3)
    rows = tables["blutrain-compiled-ddp-4gpu"]
    assert [(r.name, r.calls, r.nccl) for r in rows] == [("gemm", 2.0, False), ("ncclDevKernel_AllReduce", 1.0, True),
                                                       ("(idle)", 0.0, False)]
    assert rows[0].ms == pytest.approx(6e-3) and rows[1].ms == pytest.approx(3e-3)
    assert rows[2].ms == pytest.approx(1e-3)  # the span 0..18 µs less 16 µs busy (0-8, 10-18), over 2 steps
    assert problems == ["empty-one.trace.json: no kernel in the trace"]


def test_the_kernel_table_keeps_the_name_without_arguments_or_templates() -> None:
    assert profile.short_name("void cutlass::Kernel<Sm90>(Params)") == "void cutlass::Kernel"
    assert profile.short_name("x" * 100, width=10) == "x" * 9 + "…"
    with pytest.raises(ValueError, match="steps"):
        profile.kernel_table([], 0)
