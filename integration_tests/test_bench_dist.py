"""tools/bench/dist.py, the multi-GPU benchmark: its arithmetic (efficiency against the same framework and
implementation, loss differences, exposed communication from a kernel timeline and from an nsys SQLite
export), its plan and commands, how a launch's rank reports become rows, the table; and its CPU mode end to
end (MPI ranks through `blutrain run`, eager and compiled, the same-loss stage, a failing configuration).
No test here needs a GPU or PyTorch, and none asserts a time."""

from __future__ import annotations

import json
import sqlite3
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

# tools/ is on sys.path through the workspace's pytest config, and not there when the package is installed alone
bench = pytest.importorskip("bench.dist", reason="tools/ is not part of this checkout")
report = pytest.importorskip("bench.dist_report")
profile = pytest.importorskip("bench.dist_profile")
options = pytest.importorskip("bench.dist_options")


def config(framework: str = "blutrain", impl: str = "compiled", mode: str = "ddp", gpus: int = 2, **kw: Any) -> Any:
    fields: dict[str, Any] = {"stage": "scaling", "precision": "bf16", "batch_size": 16, "seq_len": 1024, "steps": 3,
                              "warmup": 1}
    fields.update(kw)
    return report.Config(name=f"{fields['stage']}-{framework}-{impl}-{mode}-{gpus}", framework=framework, impl=impl,
                         mode=mode, gpus=gpus, **fields)


def row(tokens_per_s: float | None = None, status: str = "ok", **kw: Any) -> Any:
    return report.Row(config(**kw), status=status, tokens_per_s=tokens_per_s)


def entry(rank: int, **kw: Any) -> dict[str, Any]:
    return {"rank": rank, "status": "ok", "phase": "timed", "losses": [], "step_ms": [], **kw}


def args(*argv: str, found: int = 4) -> Any:
    return bench.parse_args([*argv, "--out", "/nonexistent/unused"], gpus_found=lambda: found)


# -- efficiency and losses ---------------------------------------------------------------------------------
def test_scaling_efficiency_is_tokens_per_second_on_n_over_n_times_one() -> None:
    assert report.scaling_efficiency(196_000.0, 100_000.0, 2) == pytest.approx(0.98)
    assert report.scaling_efficiency(None, 100_000.0, 2) is None
    assert report.scaling_efficiency(196_000.0, None, 2) is None


def test_efficiency_compares_compiled_with_compiled_and_eager_with_eager() -> None:
    rows = [row(400_000.0, impl="compiled", mode="single", gpus=1), row(200_000.0, impl="eager", mode="single", gpus=1),
            row(784_000.0, impl="compiled", mode="ddp", gpus=2), row(400_000.0, impl="eager", mode="ddp", gpus=2),
            row(1_568_000.0, impl="compiled", mode="zero2", gpus=4)]
    report.fill_efficiencies(rows)
    assert [r.efficiency for r in rows[2:]] == [pytest.approx(0.98), pytest.approx(1.0), pytest.approx(0.98)]
    assert rows[0].efficiency is None and rows[1].efficiency is None  # the baselines themselves


def test_a_row_without_its_own_one_gpu_baseline_has_no_efficiency() -> None:
    rows = [row(400_000.0, framework="blutrain", impl="compiled", mode="single", gpus=1),
            row(700_000.0, framework="torch", impl="compiled", mode="ddp", gpus=2),
            row(700_000.0, impl="eager", mode="ddp", gpus=2),
            row(None, status="error", impl="eager", mode="single", gpus=1)]
    report.fill_efficiencies(rows)
    assert rows[1].efficiency is None  # torch's one-GPU row is missing
    assert rows[2].efficiency is None  # eager's one-GPU row failed


def test_loss_differences_are_the_largest_absolute_and_relative_gaps_over_common_steps() -> None:
    dmax, rel = report.loss_differences([10.0, 9.0, 8.5, 7.0], [10.0, 9.5, 8.0])
    assert dmax == pytest.approx(0.5)
    assert rel == pytest.approx(0.5 / 8.0)
    assert report.loss_differences([], [1.0]) == (None, None)


def test_each_equivalence_row_is_compared_with_the_one_gpu_run_of_its_framework_and_precision() -> None:
    def equiv(fw: str, prec: str, gpus: int, losses: list[float]) -> Any:
        r = report.Row(config(fw, mode="ddp" if gpus > 1 else "single", gpus=gpus, stage="equivalence",
                              precision=prec, accum=4 // gpus))
        r.status, r.losses = "ok", losses
        return r

    rows = [equiv("blutrain", "bf16", 1, [11.0, 10.0]), equiv("blutrain", "fp32", 1, [11.0, 10.0]),
            equiv("torch", "bf16", 1, [11.0, 10.5]), equiv("blutrain", "bf16", 4, [11.0, 10.25]),
            equiv("blutrain", "fp32", 4, [11.0, 10.00001]), equiv("torch", "bf16", 4, [11.0, 10.0])]
    report.fill_loss_differences(rows)
    assert rows[3].reference == rows[0].config.name and rows[3].max_dloss == pytest.approx(0.25)
    assert rows[4].max_rel_dloss == pytest.approx(1e-6, rel=1e-3)
    assert rows[5].reference == rows[2].config.name and rows[5].max_dloss == pytest.approx(0.5)
    text = "\n".join(report.goals(rows))
    assert "bf16 blutrain compiled ddp on 4 GPUs against 1 GPU × 4 micro-batches: max |Δloss| 0.2500 over 2 steps, " \
           "PyTorch DDP's own 1-vs-4: 0.5000" in text
    assert "goal fp32 blutrain compiled ddp on 4 GPUs" in text and "— met" in text


def test_a_tensor_parallel_row_is_compared_with_the_one_gpu_run_of_its_framework_and_implementation() -> None:
    """tp trains every rank on the one-GPU run's rows: its losses are that run's, whichever framework."""
    rows = [row(400_000.0, framework="torch", impl="eager", mode="single", gpus=1),
            row(300_000.0, framework="torch", impl="compiled", mode="single", gpus=1),
            row(500_000.0, framework="torch", impl="eager", mode="tp", gpus=2),
            row(350_000.0, impl="compiled", mode="single", gpus=1), row(420_000.0, impl="compiled", mode="tp", gpus=2)]
    for r, losses in zip(rows, ([5.5, 5.25, 5.0], [5.5, 5.0, 4.0], [5.5, 5.2, 5.0], [5.5, 5.3], [5.5, 5.25, 5.0]),
                         strict=True):
        r.losses = losses
    rows[2].peak_allocated = 3 * report.GIB // 2
    report.fill_efficiencies(rows)
    report.fill_loss_differences(rows)
    assert rows[2].reference == rows[0].config.name and rows[2].max_dloss == pytest.approx(0.05)  # eager vs eager
    assert rows[4].reference == rows[3].config.name and rows[4].max_dloss == pytest.approx(0.05)  # 2 common steps
    assert rows[2].efficiency == pytest.approx(500_000.0 / (2 * 400_000.0))  # one rank's tokens: speed-up / N
    lines = report.same_batch_lines(rows)
    assert lines[0] == ("   torch eager tp on 2: speed-up 1.25× over eager 1 GPU, max |Δloss| 0.0500 over 3 steps "
                        "against it, peak allocated 1.50 GiB per GPU")
    assert "speed-up 1.20× over compiled 1 GPU, max |Δloss| 0.0500 over 2 steps" in lines[1]


def test_blutrain_tensor_parallelism_is_set_beside_pytorch_s_own_of_the_same_implementation_and_size() -> None:
    rows = [row(50_000.0, framework="torch", mode="tp", gpus=2), row(60_000.0, mode="tp", gpus=2),
            row(40_000.0, framework="torch", mode="tp-async", gpus=2), row(20_000.0, mode="tp-async", gpus=2),
            row(None, status="skipped", framework="torch", impl="eager", mode="tp-async", gpus=2),
            row(10_000.0, impl="eager", mode="tp-async", gpus=2)]
    rows[0].peak_allocated, rows[1].peak_allocated = 8 * report.GIB, 6 * report.GIB
    assert report.against_torch(rows) == [
        "blutrain compiled tp on 2 GPUs against PyTorch TP torch.compile: tokens/s 1.20×, peak allocated 0.75×",
        "blutrain compiled tp-async on 2 GPUs against PyTorch async TP torch.compile: tokens/s 0.50×, peak "
        "allocated -"]  # PyTorch's eager tp-async was skipped: no pair for BluTrain's


def test_pytorch_s_tensor_parallel_modes_run_on_every_size_above_one() -> None:
    a = args("--gpus", "4", "--frameworks", "torch", "--torch-modes", "tp,tp-async", "--stages", "scaling",
             "--impls", "compiled")
    by = {lc.name: [c.name for c in lc.configs] for lc in bench.plan(a)}
    assert by == {"torch-1gpu": ["torch-compiled-single-1gpu"],
                  "torch-4gpu": ["torch-compiled-tp-4gpu", "torch-compiled-tp-async-4gpu"],
                  "torch-2gpu": ["torch-compiled-tp-2gpu", "torch-compiled-tp-async-2gpu"]}


# -- exposed communication ---------------------------------------------------------------------------------
def k(name: str, start: float, end: float, device: int = 0) -> Any:
    return profile.Kernel(name, start, end, device)


def test_exposed_communication_is_nccl_time_with_no_other_kernel_running() -> None:
    ms = 1e6  # ns
    kernels = [k("ampere_bf16_gemm", 0, 10 * ms), k("ncclDevKernel_AllReduce_Sum_f32_RING_LL", 8 * ms, 14 * ms),
               k("layernorm_bwd", 12 * ms, 13 * ms), k("ncclKernel_ReduceScatter", 13.5 * ms, 15 * ms),
               k("adamw_multi_tensor", 16 * ms, 17 * ms)]
    cost = profile.comm_cost(kernels, steps=2)
    # NCCL busy 8-15 (7 ms); covered by compute 8-10 and 12-13 (3 ms); exposed 4 ms; per step: half
    assert cost.comm_ms == pytest.approx(3.5)
    assert cost.exposed_ms == pytest.approx(2.0)
    assert cost.compute_ms == pytest.approx((10 + 1 + 1) / 2)


def test_union_merges_touching_and_nested_intervals() -> None:
    assert profile.union([(5, 7), (0, 2), (1, 3), (3, 4), (6, 6.5), (9, 9)]) == [(0, 4), (5, 7)]
    assert profile.intersect([(0, 4), (5, 7)], [(3, 6)]) == [(3, 4), (5, 6)]


intervals = st.lists(st.tuples(st.integers(0, 60), st.integers(0, 12)).map(lambda t: (t[0], t[0] + t[1])),
                     max_size=12)


@settings(max_examples=150, deadline=None)
@given(comm=intervals, compute=intervals, steps=st.integers(1, 4))
def test_exposed_communication_matches_a_unit_grid_count(comm: list[tuple[int, int]],
                                                         compute: list[tuple[int, int]], steps: int) -> None:
    kernels = [k("nccl", a * 1e6, b * 1e6) for a, b in comm] + [k("gemm", a * 1e6, b * 1e6) for a, b in compute]
    cost = profile.comm_cost(kernels, steps)
    busy = np.zeros((2, 80), dtype=bool)  # integer endpoints: a unit cell is wholly inside or outside
    for row_index, ivs in enumerate((comm, compute)):
        for a, b in ivs:
            busy[row_index, a:b] = True
    assert cost.comm_ms * steps == pytest.approx(float(busy[0].sum()), abs=1e-9)
    assert cost.exposed_ms * steps == pytest.approx(float((busy[0] & ~busy[1]).sum()), abs=1e-9)


def test_the_kernels_of_the_busiest_device_are_kept() -> None:
    kernels = [k("a", 0, 1, 0), k("b", 1, 2, 1), k("c", 2, 3, 1)]
    assert [x.name for x in profile.main_device(kernels)] == ["b", "c"]


def nsys_export(path: Path, text_in_string_ids: bool) -> None:
    """A SQLite file laid out as nsys exports one (the tables and columns read here)."""
    db = sqlite3.connect(path)
    db.executescript("""
        CREATE TABLE StringIds (id INTEGER PRIMARY KEY, value TEXT);
        CREATE TABLE CUPTI_ACTIVITY_KIND_KERNEL (start INTEGER, end INTEGER, deviceId INTEGER, streamId INTEGER,
                                                 shortName INTEGER, demangledName INTEGER);
    """)
    db.executemany("INSERT INTO StringIds VALUES (?, ?)", [(1, "gemm_kernel"), (2, "ncclDevKernel_AllReduce"),
                                                           (3, "bench-dist:blutrain-compiled-ddp-2gpu"),
                                                           (4, "some other range")])
    ms = 1_000_000
    db.executemany("INSERT INTO CUPTI_ACTIVITY_KIND_KERNEL VALUES (?, ?, ?, ?, ?, ?)", [
        (0, 5 * ms, 0, 7, 1, 1),  # before the range: left out
        (10 * ms, 20 * ms, 0, 7, 1, 1), (18 * ms, 24 * ms, 0, 9, 2, 2), (30 * ms, 31 * ms, 0, 9, 2, 2),
        (40 * ms, 41 * ms, 0, 9, 2, 2)])  # after the range: left out
    if text_in_string_ids:
        db.execute("CREATE TABLE NVTX_EVENTS (start INTEGER, end INTEGER, eventType INTEGER, text TEXT, "
                   "textId INTEGER)")
        db.executemany("INSERT INTO NVTX_EVENTS VALUES (?, ?, ?, ?, ?)",
                       [(9 * ms, 35 * ms, 59, None, 3), (0, 50 * ms, 59, None, 4)])
    else:
        db.execute("CREATE TABLE NVTX_EVENTS (start INTEGER, end INTEGER, eventType INTEGER, text TEXT)")
        db.executemany("INSERT INTO NVTX_EVENTS VALUES (?, ?, ?, ?)",
                       [(9 * ms, 35 * ms, 59, "bench-dist:blutrain-compiled-ddp-2gpu"), (0, 50 * ms, 59, "other")])
    db.commit()
    db.close()


@pytest.mark.parametrize("text_in_string_ids", [False, True])
def test_an_nsys_export_gives_each_profiled_range_its_cost(tmp_path: Path, text_in_string_ids: bool) -> None:
    path = tmp_path / "report.sqlite"
    nsys_export(path, text_in_string_ids)
    costs, problems = profile.costs_from_exports([path], {"blutrain-compiled-ddp-2gpu": 2, "never-profiled": 3})
    assert problems == []
    cost = costs["blutrain-compiled-ddp-2gpu"]
    # NCCL 18-24 and 30-31 (7 ms), compute 10-20 covers 18-20: exposed 5 ms; two steps
    assert (cost.comm_ms, cost.exposed_ms, cost.kernels) == (pytest.approx(3.5), pytest.approx(2.5), 3)
    assert "never-profiled" not in costs


def test_a_file_that_is_not_an_export_is_a_problem_not_a_crash(tmp_path: Path) -> None:
    bad = tmp_path / "bad.sqlite"
    bad.write_bytes(b"not a database at all" * 10)
    costs, problems = profile.costs_from_exports([bad], {"x": 1})
    assert costs == {} and len(problems) == 1 and problems[0].startswith("bad.sqlite: ")


def test_the_nsys_command_captures_cuda_profiler_ranges_into_sqlite() -> None:
    cmd = profile.nsys_command("/usr/bin/nsys", Path("/out/r"), graph_nodes=True)
    assert cmd[:2] == ["/usr/bin/nsys", "profile"] and cmd[-2:] == ["-o", "/out/r"]
    for option in ("--trace=cuda,nvtx", "--capture-range=cudaProfilerApi", "--capture-range-end=repeat",
                   "--export=sqlite", "--cuda-graph-trace=node"):
        assert option in cmd
    assert "--cuda-graph-trace=node" not in profile.nsys_command("nsys", Path("r"), graph_nodes=False)


# -- plan, commands, options -------------------------------------------------------------------------------
def test_sizes_are_the_powers_of_two_up_to_the_gpus_and_the_gpus() -> None:
    assert options.gpu_sizes(1) == [1]
    assert options.gpu_sizes(4) == [1, 2, 4]
    assert options.gpu_sizes(6) == [1, 2, 4, 6]


def test_one_gpu_runs_first_then_the_largest_size() -> None:
    assert bench.run_order([1, 2, 4, 8]) == [1, 8, 4, 2]
    assert bench.run_order([2, 4]) == [4, 2]


def test_the_plan_runs_every_mode_on_each_size_and_the_same_global_batch_for_the_losses() -> None:
    launches = bench.plan(args("--gpus", "4"))
    assert [lc.name for lc in launches] == [
        "torch-1gpu", "blutrain-1gpu", "torch-4gpu", "blutrain-4gpu", "torch-2gpu", "blutrain-2gpu",
        "equiv-torch-1gpu", "equiv-blutrain-1gpu", "equiv-torch-4gpu", "equiv-blutrain-4gpu", "equiv-torch-2gpu",
        "equiv-blutrain-2gpu"]
    by = {lc.name: lc.configs for lc in launches}
    assert [c.name for c in by["blutrain-2gpu"]] == [
        f"blutrain-{impl}-{mode}-2gpu" for impl in ("compiled", "eager") for mode in ("ddp", "zero1", "zero2", "zero3")]
    assert [c.name for c in by["torch-4gpu"]] == ["torch-compiled-ddp-4gpu", "torch-eager-ddp-4gpu"]
    equiv = [c for lc in launches for c in lc.configs if c.stage == "equivalence"]
    assert {(c.framework, c.mode, c.precision, c.gpus, c.accum) for c in equiv} == {
        ("blutrain", "single", "bf16", 1, 4), ("blutrain", "single", "fp32", 1, 4), ("blutrain", "ddp", "bf16", 2, 2),
        ("blutrain", "ddp", "bf16", 4, 1), ("blutrain", "ddp", "fp32", 4, 1), ("blutrain", "ddp-ordered", "fp32", 4, 1),
        ("torch", "single", "bf16", 1, 4), ("torch", "ddp", "bf16", 2, 2), ("torch", "ddp", "bf16", 4, 1)}
    assert [c.name for c in by["equiv-blutrain-4gpu"]] == [  # fp32: the default all-reduce, then the ordered sum
        "equiv-blutrain-bf16-4gpu", "equiv-blutrain-fp32-4gpu", "equiv-blutrain-fp32-ordered-4gpu"]
    assert all(c.tokens_per_step == 4 * 16 * 1024 and c.steps == 50 for c in equiv)
    assert all(c.impl == ("compiled" if c.framework == "blutrain" else "eager") for c in equiv)


def test_the_same_losses_are_checked_on_2_and_g_gpus_whichever_sizes_scale() -> None:
    equiv = [lc for lc in bench.plan(args("--gpus", "4", "--sizes", "1,4")) if lc.stage == "equivalence"]
    assert [lc.name for lc in equiv] == ["equiv-torch-1gpu", "equiv-blutrain-1gpu", "equiv-torch-4gpu",
                                         "equiv-blutrain-4gpu", "equiv-torch-2gpu", "equiv-blutrain-2gpu"]
    assert bench.plan(args("--gpus", "1", "--stages", "equivalence")) == []  # nothing to compare on one GPU


def test_the_profile_covers_the_scaling_rows_only() -> None:
    """The 1-GPU rows too: their kernel table is what the N-GPU rows' kernels are compared with."""
    launches = bench.plan(args("--gpus", "2", "--profile", "--profile-steps", "4"))
    steps = {c.name: c.profile_steps for lc in launches for c in lc.configs}
    assert steps["blutrain-compiled-zero3-2gpu"] == 4 and steps["blutrain-compiled-single-1gpu"] == 4
    assert steps["equiv-blutrain-bf16-2gpu"] == 0


def test_blutrain_launches_through_blutrain_run_and_pytorch_through_torchrun() -> None:
    ours = bench.launch_command(bench.Launch("scaling", "blutrain", 4), Path("/j/job.json"), 60.0)
    assert ours[1:6] == ["-m", "blutrain.cli", "run", "-n", "4"]
    assert ours[ours.index("--timeout") + 1] == "60" and ours[-3:] == [str(bench.SCRIPT), "--worker", "/j/job.json"]
    theirs = bench.launch_command(bench.Launch("scaling", "torch", 2), Path("/j/job.json"), 60.0)
    assert theirs[1:3] == ["-m", "torch.distributed.run"] and theirs[theirs.index("--nproc-per-node") + 1] == "2"


def test_more_gpus_than_visible_is_refused_with_what_to_give(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        args("--gpus", "4", found=2)
    assert "--gpus/--sizes ask for 4 GPUs but 2 are visible; give --gpus 2 or less" in capsys.readouterr().err
    assert args(found=2).sizes == [1, 2]  # default: every visible GPU


def test_a_misspelt_mode_is_refused_naming_the_choices(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        args("--modes", "ddp,zero4")
    err = capsys.readouterr().err
    assert ("expected a comma-separated list of ddp, zero1, zero2, zero3, ddp-bf16, tp, tp-async, ddp-ordered, got "
            "'ddp,zero4'") in err


def test_a_model_family_runs_its_preset_and_pytorch_shards_it_with_fsdp2() -> None:
    a = args("--gpus", "4", "--sizes", "1,4", "--model", "llama", "--preset", "llama-1b", "--seq-len", "2048",
             "--modes", "zero3", "--torch-modes", "fsdp2", "--impls", "compiled", "--stages", "scaling")
    assert (a.model, a.preset, a.batch_size, a.seq_len, a.frameworks) == ("llama", "llama-1b", 4, 2048,
                                                                          ["blutrain", "torch"])
    by = {lc.name: [c.name for c in lc.configs] for lc in bench.plan(a)}
    assert by == {"torch-1gpu": ["torch-compiled-single-1gpu"], "blutrain-1gpu": ["blutrain-compiled-single-1gpu"],
                  "torch-4gpu": ["torch-compiled-fsdp2-4gpu"], "blutrain-4gpu": ["blutrain-compiled-zero3-4gpu"]}
    gpt2 = args("--gpus", "2")
    assert (gpt2.model, gpt2.preset, gpt2.batch_size, gpt2.seq_len) == ("gpt2", "gpt2-124m", 16, 1024)
    assert args("--device", "cpu", "--model", "llama").preset == "tiny"


@pytest.mark.parametrize(("argv", "message"), [
    (("--model", "llama"), "--preset: give the preset of llama to run on the GPUs, one of tiny, llama-1b"),
    (("--model", "llama", "--preset", "gpt2-124m"), "--preset: unknown preset 'gpt2-124m' of llama; expected one of"),
    (("--model", "llama", "--preset", "llama-1b", "--seq-len", "4096"),
     "--seq-len 4096 exceeds preset llama-1b's block_size 2048; give --seq-len 2048 or less"),
    (("--model", "no-such-family"), "--model: no model 'no-such-family'; installed: "),
    (("--modes", "fsdp2"), "expected a comma-separated list of ddp, zero1, zero2, zero3, ddp-bf16, tp, tp-async, "
                           "ddp-ordered, got 'fsdp2'"),
])
def test_a_model_or_preset_that_does_not_fit_is_refused_in_one_line(capsys: pytest.CaptureFixture[str],
                                                                    argv: tuple[str, ...], message: str) -> None:
    with pytest.raises(SystemExit):
        args(*argv)
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


def test_blutrain_zero3_is_set_beside_pytorch_fsdp2_of_the_same_implementation_and_size() -> None:
    rows = [row(50_000.0, framework="torch", mode="fsdp2", gpus=4), row(60_000.0, mode="zero3", gpus=4),
            row(30_000.0, framework="torch", impl="eager", mode="fsdp2", gpus=4),
            row(20_000.0, impl="eager", mode="zero3", gpus=2)]
    rows[0].peak_allocated, rows[1].peak_allocated = 40 * report.GIB, 30 * report.GIB
    lines = report.against_torch(rows)
    assert lines == ["blutrain compiled zero3 on 4 GPUs against PyTorch FSDP2 torch.compile: tokens/s 1.20×, "
                     "peak allocated 0.75×"]  # the eager zero3 row ran on 2 GPUs, PyTorch's on 4: no pair


def test_the_nccl_summary_names_the_version_and_counts_each_transport() -> None:
    log = "\n".join([
        "[rank0]: host:1:1 [0] NCCL INFO NCCL version 2.27.3+cuda12.9",
        "[rank0]: host:1:1 [0] NCCL INFO Channel 00/0 : 0[0] -> 1[1] via P2P/CUMEM/read",
        "[rank0]: host:1:1 [0] NCCL INFO Channel 01/0 : 0[0] -> 1[1] via P2P/CUMEM/read",
        "[rank1]: host:2:2 [1] NCCL INFO Channel 00/0 : 1[1] -> 0[0] via SHM/direct/direct",
        "step 3: loss 9.1",
    ])
    assert bench.nccl_summary(log) == "NCCL 2.27.3+cuda12.9: 2 × P2P/CUMEM/read, 1 × SHM/direct/direct"
    assert bench.nccl_summary("no nccl here\n") is None


# -- rank reports to rows ----------------------------------------------------------------------------------
def test_a_step_takes_as_long_as_its_slowest_rank() -> None:
    assert report.slowest_rank_steps([[1.0, 5.0, 3.0], [2.0, 4.0, 3.0, 9.0]]) == [2.0, 5.0, 3.0]
    assert report.slowest_rank_steps([]) == []


def test_a_row_is_timed_from_every_ranks_steps() -> None:
    r = report.Row(config())
    report.collect(r, [entry(0, step_ms=[100.0, 110.0, 90.0], losses=[5.0, 4.0], peak_allocated=7),
                       entry(1, step_ms=[105.0, 100.0, 95.0], losses=[5.0, 4.0], peak_allocated=9)])
    assert r.status == "ok"
    assert r.step_ms == 105.0  # the median of 105, 110, 95
    assert r.tokens_per_s == pytest.approx(2 * 16 * 1024 / 0.105)
    assert (r.losses, r.peak_allocated) == ([5.0, 4.0], 9)


def launch_rows(*names: str) -> list[Any]:
    return [report.Row(config(mode=n)) for n in names]


def test_a_failed_configuration_is_its_row_and_the_ones_after_it_are_launched_again(tmp_path: Path) -> None:
    rows = launch_rows("ddp", "zero1", "zero2")
    ranks = [{"rank": 0, "configs": {rows[0].config.name: entry(0, step_ms=[10.0]),
                                     rows[1].config.name: entry(0, status="running", phase="warm-up")}},
             {"rank": 1, "configs": {rows[0].config.name: entry(1, step_ms=[11.0]),
                                     rows[1].config.name: entry(1, status="error", phase="warm-up", oom=True,
                                                                error="OutOfMemoryError: out of memory")}}]
    left = bench.settle(rows, ranks, None, tmp_path / "log")
    assert rows[0].status == "ok" and rows[0].step_ms == 11.0
    assert rows[1].status == "oom" and rows[1].error == "rank 1 in warm-up: OutOfMemoryError: out of memory"
    assert left == [rows[2]] and rows[2].status == "not run"


def test_a_configuration_stopped_at_its_limit_says_where_each_rank_was(tmp_path: Path) -> None:
    rows = launch_rows("ddp", "zero1")
    ranks = [{"rank": r, "configs": {rows[0].config.name: entry(r, status="running", phase="timed")}} for r in (0, 1)]
    left = bench.settle(rows, ranks, f"killed after 180 s in {rows[0].config.name}", tmp_path / "log")
    assert rows[0].status == "timeout"
    assert rows[0].error == f"killed after 180 s in {rows[0].config.name}; rank 0 in timed; rank 1 in timed"
    assert left == [rows[1]]


def test_a_launch_that_died_before_a_configuration_gives_the_logs_error(tmp_path: Path) -> None:
    log = tmp_path / "launch.log"
    log.write_text("starting\nblutrain run: rank 1 exited with code 1: ImportError: no module named cupy\n")
    rows = launch_rows("ddp")
    assert bench.settle(rows, [], None, log) == []
    assert rows[0].status == "error" and "ImportError: no module named cupy" in (rows[0].error or "")


def test_a_set_up_that_failed_before_any_configuration_is_every_rows_error(tmp_path: Path) -> None:
    rows = launch_rows("ddp", "zero1")
    ranks = [{"rank": 0, "configs": {}, "error": "NcclError: unhandled system error"}, {"rank": 1, "configs": {}}]
    assert bench.settle(rows, ranks, None, tmp_path / "log") == []
    assert [(r.status, r.error) for r in rows] == [("error", "set-up: NcclError: unhandled system error")] * 2


def test_the_table_says_what_efficiency_compares_and_names_each_failure() -> None:
    rows = [row(400_000.0, mode="single", gpus=1), row(784_000.0), row(None, status="skipped", framework="torch")]
    rows[2].error = "PyTorch is not installed"
    rows[1].comm_ms, rows[1].exposed_ms, rows[1].step_ms = 2.0, 0.5, 41.8
    report.fill_efficiencies(rows)
    text = report.format_table(rows, {"device": "cuda", "gpu": "H100", "gpus_found": 2, "preset": "gpt2-124m"})
    assert "compiled against compiled 1 GPU, eager against eager 1 GPU" in text
    assert "skipped: PyTorch is not installed" in text
    assert "goal blutrain compiled ddp on 2 GPUs scales ≥ 97% of compiled 1 GPU: 98.0% — met" in text
    assert "exposed communication ≤ 3% of the step: 1.2% (0.50 of 41.80 ms) — met" in text


def test_a_long_error_is_cut_in_its_row_and_printed_whole_below_the_table() -> None:
    failed = row(None, status="error", mode="zero3")
    failed.error = "rank 0 in build: ConfigError: " + "the mode has not declared how it composes with compile " * 3
    text = report.format_table([failed], {"device": "cuda", "gpu": "H100", "gpus_found": 2})
    assert f"   {failed.config.name}: error: {failed.error}" in text.splitlines()
    assert any(line.endswith("…") and "error: rank 0 in build" in line for line in text.splitlines())


# -- the CPU mode end to end -------------------------------------------------------------------------------
def run_bench(out: Path, *argv: str) -> tuple[subprocess.CompletedProcess[str], dict[str, Any]]:
    proc = subprocess.run([sys.executable, str(Path(bench.__file__)), "--device", "cpu", "--out", str(out), *argv],
                          capture_output=True, text=True, timeout=600)
    return proc, json.loads((out / "bench_dist.json").read_text())


def test_the_cpu_mode_runs_both_stages_through_blutrain_run(tmp_path: Path) -> None:
    proc, result = run_bench(tmp_path, "--frameworks", "blutrain", "--modes", "ddp", "--steps", "2",
                             "--equiv-steps", "3")
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    rows = {r["config"]["name"]: r for r in result["rows"]}
    assert list(rows) == ["blutrain-compiled-single-1gpu", "blutrain-eager-single-1gpu", "blutrain-compiled-ddp-2gpu",
                          "blutrain-eager-ddp-2gpu", "equiv-blutrain-fp32-1gpu", "equiv-blutrain-fp32-2gpu",
                          "equiv-blutrain-fp32-ordered-2gpu"]
    assert all(r["status"] == "ok" for r in rows.values())
    assert all(r["steps"] == 2 and r["efficiency"] is not None for n, r in rows.items() if n.endswith("ddp-2gpu"))
    equiv = rows["equiv-blutrain-fp32-2gpu"]
    assert len(equiv["losses"]) == 3 and equiv["max_rel_dloss"] < 1e-4  # 2 ranks = 1 rank accumulating 2
    # summed in rank order, one micro-batch per rank: one rank's losses exactly (the trainer averages the ranks'
    # losses in float64, where their sum is exact)
    ordered = rows["equiv-blutrain-fp32-ordered-2gpu"]
    assert ordered["config"]["mode"] == "ddp-ordered"
    assert ordered["losses"] == rows["equiv-blutrain-fp32-1gpu"]["losses"]
    text = (tmp_path / "bench_dist.txt").read_text()
    assert text.startswith("BluTrain distributed benchmark") and "2. Same losses" in text
    assert (tmp_path / "bench_dist.png").stat().st_size > 0


def test_eight_ranks_run_compiled_ddp_and_zero_and_give_the_one_rank_losses(tmp_path: Path) -> None:
    """--gpus 8 on 8 MPI ranks (the 8-GPU machine's layout, exercised on the CPU): compiled DDP and ZeRO-1 on 1 and
    8, and the same global batch on 1 rank (accumulating 8 micro-batches), 2 and 8 ranks."""
    proc, result = run_bench(tmp_path, "--gpus", "8", "--sizes", "1,8", "--frameworks", "blutrain", "--modes",
                             "ddp,zero1", "--impls", "compiled", "--steps", "2", "--equiv-steps", "2")
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    rows = {r["config"]["name"]: r for r in result["rows"]}
    assert list(rows) == ["blutrain-compiled-single-1gpu", "blutrain-compiled-ddp-8gpu", "blutrain-compiled-zero1-8gpu",
                          "equiv-blutrain-fp32-1gpu", "equiv-blutrain-fp32-8gpu", "equiv-blutrain-fp32-ordered-8gpu",
                          "equiv-blutrain-fp32-2gpu", "equiv-blutrain-fp32-ordered-2gpu"]
    assert all(r["status"] == "ok" for r in rows.values())
    for name in ("equiv-blutrain-fp32-2gpu", "equiv-blutrain-fp32-8gpu"):  # N ranks = 1 rank accumulating N
        assert len(rows[name]["losses"]) == 2 and rows[name]["max_rel_dloss"] < 1e-4, name
    assert rows["equiv-blutrain-fp32-ordered-8gpu"]["max_rel_dloss"] == 0.0  # in rank order: the same bits
    assert all(json.loads((tmp_path / "runs" / "blutrain-8gpu-1" / f"rank{r}.json").read_text())["rank"] == r
               for r in range(8))


def test_tensor_parallel_rows_count_one_rank_s_tokens_and_are_scored_against_one_gpu(tmp_path: Path) -> None:
    """tp and tp-async over every rank: each rank trains on the same rows, so a step's tokens are one rank's,
    and the goal line says whether it beat one GPU (its efficiency times N)."""
    assert config(mode="tp", gpus=4).tokens_per_step == config(mode="single", gpus=1).tokens_per_step
    assert config(mode="ddp", gpus=4).tokens_per_step == 4 * config(mode="single", gpus=1).tokens_per_step
    proc, result = run_bench(tmp_path, "--frameworks", "blutrain", "--modes", "tp,tp-async", "--impls", "compiled",
                             "--stages", "scaling", "--steps", "2")
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    rows = {r["config"]["name"]: r for r in result["rows"]}
    assert list(rows) == ["blutrain-compiled-single-1gpu", "blutrain-compiled-tp-2gpu",
                          "blutrain-compiled-tp-async-2gpu"]
    assert all(r["status"] == "ok" and r["steps"] == 2 and r["tokens_per_s"] for r in rows.values())
    one = rows["blutrain-compiled-single-1gpu"]["tokens_per_s"]
    for name in ("blutrain-compiled-tp-2gpu", "blutrain-compiled-tp-async-2gpu"):
        assert rows[name]["efficiency"] == pytest.approx(rows[name]["tokens_per_s"] / (2 * one))
    text = (tmp_path / "bench_dist.txt").read_text()
    assert "goal blutrain compiled tp on 2 GPUs faster than compiled 1 GPU: " in text


def test_the_cpu_mode_trains_the_family_it_is_given_with_zero3(tmp_path: Path) -> None:
    from blutrain.models import model_spec

    proc, result = run_bench(tmp_path, "--model", "llama", "--frameworks", "blutrain", "--modes", "zero3", "--impls",
                             "compiled", "--stages", "scaling", "--steps", "2")
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    rows = {r["config"]["name"]: r for r in result["rows"]}
    assert list(rows) == ["blutrain-compiled-single-1gpu", "blutrain-compiled-zero3-2gpu"]
    assert all(r["status"] == "ok" and r["steps"] == 2 for r in rows.values())
    assert result["meta"]["model"] == "llama" and result["meta"]["preset"] == "tiny"
    job = json.loads((tmp_path / "runs" / "blutrain-2gpu-1" / "job.json").read_text())
    llama = model_spec("llama")
    expected = llama.build(llama.config("tiny", vocab_size=job["vocab_size"])).num_parameters()
    for r in (0, 1):  # each rank trained the Llama of the tiny preset, not the default family
        entry = json.loads((tmp_path / "runs" / "blutrain-2gpu-1" / f"rank{r}.json").read_text())
        assert entry["configs"]["blutrain-compiled-zero3-2gpu"]["params"] == expected
    assert "1. Scaling: llama tiny" in (tmp_path / "bench_dist.txt").read_text()


def test_a_configuration_that_fails_is_a_row_and_the_bench_goes_on(tmp_path: Path) -> None:
    from blutrain.data.shard import write_shard

    write_shard(tmp_path / "small_000000.bin", np.arange(200, dtype=np.uint16) % 256)  # too few tokens for a step
    proc, result = run_bench(tmp_path / "out", "--frameworks", "blutrain", "--stages", "scaling", "--impls", "eager",
                             "--sizes", "2", "--modes", "ddp,zero1", "--data", str(tmp_path / "small_*.bin"))
    assert proc.returncode == 1  # a row failed
    rows = result["rows"]
    assert [r["config"]["name"] for r in rows] == ["blutrain-eager-ddp-2gpu", "blutrain-eager-zero1-2gpu"]
    for r in rows:  # each failed on its own, in its own launch
        assert r["status"] == "error" and "in build" in r["error"] and "small_000000.bin" in r["error"], r["error"]
    assert sorted(p.name for p in (tmp_path / "out" / "runs").iterdir()) == ["blutrain-2gpu-1", "blutrain-2gpu-2"]


def test_a_spent_budget_skips_every_configuration_without_launching(tmp_path: Path) -> None:
    proc, result = run_bench(tmp_path, "--frameworks", "blutrain", "--budget", "0.001")
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    assert result["rows"] and all(r["status"] == "skipped" and "--budget" in r["error"] for r in result["rows"])
    assert not (tmp_path / "runs").exists()


def test_ranks_skip_together_the_configurations_that_would_start_past_the_deadline(tmp_path: Path) -> None:
    configs = [config(impl="eager", mode=m, gpus=2, precision="fp32", batch_size=2, seq_len=32)
               for m in ("ddp", "zero1")]
    job = {"framework": "blutrain", "gpus": 2, "device": "cpu", "model": "gpt2", "preset": "tiny", "data": None,
           "train_pattern": "unused", "vocab_size": 256, "seed": 0, "configs": [vars(c) for c in configs],
           "overrides": {}, "deadline": 1.0, "nsys_prefix": None}  # 1970: long past
    (tmp_path / "job.json").write_text(json.dumps(job))
    proc = subprocess.run([sys.executable, "-m", "blutrain.cli", "run", "-n", "2", "--timeout", "60", "--",
                           str(Path(bench.__file__)), "--worker", str(tmp_path / "job.json")],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    for r in (0, 1):
        entries = json.loads((tmp_path / f"rank{r}.json").read_text())["configs"]
        assert [(e["status"], e["why"]) for e in entries.values()] == [
            ("skipped", "the --budget was spent before it started")] * 2

