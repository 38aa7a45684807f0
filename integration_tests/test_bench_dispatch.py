"""tools/bench_dispatch.py, the per-op host-cost benchmark of issue 22: the tool end to end on the CPU with tiny
counts (every op of the set in the JSON, the breakdown, the chart), the categories of the breakdown by module
name (the same rules serve the cuda backend), and its argument errors. No test asserts a time."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

# tools/ is on sys.path through the workspace's pytest config, and not there when the package is installed alone
tool = pytest.importorskip("bench_dispatch", reason="tools/ is not part of this checkout")
cases_mod = pytest.importorskip("bench.dispatch_cases")
breakdown_mod = pytest.importorskip("bench.dispatch_breakdown")

TOOL = Path(tool.__file__)
TINY = ["--calls", "2", "--batches", "1", "--warmup", "1", "--profile-calls", "2"]


@pytest.fixture(scope="module")
def report(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    out = tmp_path_factory.mktemp("bench_dispatch") / "dispatch.json"
    done = subprocess.run([sys.executable, str(TOOL), *TINY, "--out", str(out)], capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stderr
    data: dict[str, Any] = json.loads(out.read_text())
    data["_stdout"] = done.stdout
    data["_png"] = out.with_suffix(".png")
    return data


def test_every_op_of_the_set_has_its_forward_with_and_without_grad_and_its_backward(report: dict[str, Any]) -> None:
    rows = [r for r in report["results"] if r["framework"] == "blutrain"]
    seen = {(r["op"], r["pass"], r["requires_grad"]) for r in rows}
    for op in cases_mod.FORWARD_OPS:
        assert {(op, "forward", False), (op, "forward", True), (op, "backward", True)} <= seen, op
    assert ("adamw", "step", True) in seen
    assert set(report["ops"]) == set(cases_mod.OPS) == {r["op"] for r in rows}


def test_each_row_is_timed_on_the_cpu_without_error(report: dict[str, Any]) -> None:
    for r in report["results"]:
        assert r["error"] is None, r
        assert r["size"] == "small" and r["shape"]
        assert r["host_min_us"] <= r["host_us"] <= r["host_max_us"]
        assert r["device_us"] is None  # CUDA events only on cuda


def test_pytorch_rows_are_there_exactly_when_pytorch_is_installed(report: dict[str, Any]) -> None:
    torch_rows = [r for r in report["results"] if r["framework"] == "torch"]
    if importlib.util.find_spec("torch") is None:
        assert not torch_rows
        assert any("PyTorch is not installed" in n for n in report["meta"]["notes"])
        assert "PyTorch is not installed" in report["_stdout"]
    else:
        assert len(torch_rows) == len(report["results"]) // 2


def test_the_breakdown_splits_each_blutrain_case_into_every_category(report: dict[str, Any]) -> None:
    blutrain_rows = [r for r in report["results"] if r["framework"] == "blutrain"]
    assert [(b["op"], b["pass"], b["requires_grad"]) for b in report["breakdown"]] == \
        [(r["op"], r["pass"], r["requires_grad"]) for r in blutrain_rows]
    for b in report["breakdown"]:
        assert set(b["us"]) == set(breakdown_mod.CATEGORIES)
        assert sum(b["us"].values()) == pytest.approx(b["host_us"], rel=1e-6)
        assert b["python_calls_per_op"] > 0 and b["top"]


def test_the_meta_names_the_commit_machine_and_method(report: dict[str, Any]) -> None:
    meta = report["meta"]
    assert meta["device"] == "cpu" and meta["dtype"] == "float32" and meta["sizes"] == ["small"]
    assert meta["cpu"] and meta["frameworks"]["blutrain"]
    assert set(meta["categories"]) == set(breakdown_mod.CATEGORIES)
    assert "blutrain µs" in report["_stdout"] and "by category" in report["_stdout"]


def test_the_chart_is_written_beside_the_json(report: dict[str, Any]) -> None:
    assert report["_png"].read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize(("module", "category"), [
    ("blutrain.tensor.dispatch", "dispatch"),
    ("blutrain.tensor.ops.elementwise", "checks"),
    ("blutrain.tensor.tensor", "wrap"),
    ("blutrain.tensor.cpu.elementwise", "backend"),
    ("blutrain.autograd.engine", "autograd"),
    ("blutrain.autograd.rules.nn", "autograd"),
    ("blutrain.alloc._core", "allocation"),
    ("blutrain.alloc.cupy", "allocation"),
    ("blutrain.kernels.cuda.layer_norm", "backend"),
    ("blutrain_backend_cupy.kernels", "backend"),
    ("blutrain_backend_cupy.backend", "backend"),
    ("blutrain_backend_cupy.memory", "allocation"),
    ("blutrain_optim_adamw.adamw", "optimizer"),
    ("blutrain_optim_adamw.kernel", "backend"),
    ("blutrain_kernels_example.gelu", "backend"),
    ("cupy.cuda.memory", "allocation"),
    ("cupy._creation.basic", "allocation"),
    ("cupy._core.core", "launch"),
    ("cupy._core.raw", "launch"),
    ("cupy_backends.cuda.libs.cublas", "launch"),
    ("numpy.empty", "allocation"),
    ("numpy._core.numeric", "compute"),
    ("blutrain.tensorboard", "other"),  # a prefix matches at a dot, not inside a name
    ("somewhere.else", "other"),
])
def test_a_function_s_category_is_decided_by_its_module(module: str, category: str) -> None:
    assert breakdown_mod.category_of_module(module) == category


@pytest.mark.parametrize(("label", "module"), [
    ("<built-in method numpy.empty>", "numpy.empty"),
    ("<method 'astype' of 'cupy._core.core._ndarray_base' objects>", "cupy._core.core"),
    ("<built-in method builtins.isinstance>", None),
    ("<method 'get' of 'dict' objects>", None),
    ("<built-in method __new__ of type object at 0x7f00>", None),
])
def test_a_c_function_s_module_is_read_from_its_profiler_label(label: str, module: str | None) -> None:
    assert breakdown_mod.module_of_builtin(label) == module


def test_recording_for_autograd_shows_only_when_an_input_requires_grad() -> None:
    import blutrain.autograd  # noqa: F401
    import blutrain.tensor as bt

    a, b = bt.randn(4, 4), bt.randn(4, 4)
    ga, gb = bt.randn(4, 4, requires_grad=True), bt.randn(4, 4, requires_grad=True)
    plain = breakdown_mod.profile(lambda: a + b, 50, lambda: None)
    recorded = breakdown_mod.profile(lambda: ga + gb, 50, lambda: None)
    assert plain.shares["autograd"] == 0.0 and recorded.shares["autograd"] > 0.0
    for b_ in (plain, recorded):
        assert sum(b_.shares.values()) == pytest.approx(1.0)
        assert b_.shares["checks"] > 0.0 and b_.shares["wrap"] > 0.0
    assert recorded.python_calls_per_op > plain.python_calls_per_op


@pytest.mark.parametrize(("argv", "named"), [
    (["--calls", "0"], "--calls"),
    (["--batches", "x"], "--batches"),
    (["--sizes", "small,huge"], "--sizes"),
    (["--ops", "add,conv"], "--ops"),
    (["--frameworks", "jax"], "--frameworks"),
])
def test_a_bad_argument_is_one_error_line_naming_it(argv: list[str], named: str,
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        tool.parse_args(argv)
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert named in err and "expected" in err and argv[1] in err


def test_out_naming_a_directory_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        tool.parse_args(["--out", str(tmp_path)])
    assert "--out must be a file path" in capsys.readouterr().err


def test_cuda_where_the_cuda_backend_cannot_run_is_one_error_line(tmp_path: Path,
                                                                   capsys: pytest.CaptureFixture[str]) -> None:
    import blutrain.tensor as bt

    try:
        usable = bt.device("cuda").backend.is_available()
    except bt.BluTrainError:  # no cuda backend installed at all: the same one-line path
        usable = False
    if usable:
        pytest.skip("a GPU is here: the cuda run is the GPU machine's to make")
    out = tmp_path / "dispatch.json"
    assert tool.main(["--device", "cuda", *TINY, "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("bench_dispatch: error:") and "cuda" in err[0]
    assert not out.exists()  # nothing written for a run that did not happen


@pytest.mark.skipif(importlib.util.find_spec("torch") is not None, reason="PyTorch is installed here")
def test_asking_only_for_pytorch_where_it_is_missing_is_one_error_line(tmp_path: Path,
                                                                       capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "dispatch.json"
    assert tool.main(["--frameworks", "torch", *TINY, "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--frameworks torch" in err[0] and "install PyTorch" in err[0]
    assert not out.exists()
