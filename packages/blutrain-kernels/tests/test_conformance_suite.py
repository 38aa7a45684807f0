"""The conformance suite itself: it runs from ``--pyargs``, and it catches kernels that are wrong.

The regular ``uv run pytest`` already runs the suite for the CPU once: pytest collects
``blutrain/kernels/conformance/test_conformance.py`` from this package's source tree (testpaths
holds ``packages``). So these tests only collect it through ``--pyargs`` (without running it twice)
and check, on hand-made broken kernels, that a wrong device would fail it.
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import blutrain.tensor as bt
from blutrain.kernels import CATALOGUE
from blutrain.kernels.catalogue import Arg, Sample
from blutrain.kernels.conformance.check import MismatchError, assert_matches, run_sample
from blutrain.tensor import plugins

CPU = bt.device("cpu")


def pytest_run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", *args],
                          capture_output=True, text=True)


def test_pyargs_collects_one_test_per_op_and_dtype_for_the_named_device() -> None:
    proc = pytest_run("--pyargs", "blutrain.kernels.conformance", "--blutrain-device=cpu", "--collect-only", "-q")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    collected = [line for line in proc.stdout.splitlines() if "test_op_matches_float64_reference[" in line]
    expected = sum(len(op.dtypes) for op in CATALOGUE.values())
    assert len(collected) == expected
    assert any(line.endswith("[sdpa_backward-bfloat16]") for line in collected)


def test_an_unknown_device_option_fails_the_run_naming_the_installed_backends() -> None:
    proc = pytest_run("--pyargs", "blutrain.kernels.conformance", "--blutrain-device=tpu", "-q", "-x",
                      "-k", "add-float32")
    assert proc.returncode != 0
    assert "unknown device type 'tpu'; installed: cpu" in proc.stdout


def test_the_plugin_is_harmless_in_an_unrelated_run_and_defaults_the_device_to_cpu(tmp_path: Path) -> None:
    (tmp_path / "test_unrelated.py").write_text(
        "def test_plain():\n    assert True\n\n"
        "def test_device(blutrain_device):\n    assert str(blutrain_device) == 'cpu'\n")
    proc = pytest_run(str(tmp_path), "-q", "--rootdir", str(tmp_path))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "2 passed" in proc.stdout
    assert "--blutrain-device=DEVICE" in pytest_run("--help").stdout


class _Broken:
    """A plugin that overrides one CPU kernel with a wrong one, at a higher priority."""

    def __init__(self, op: str, dtype: str, fn: Callable[..., Any]) -> None:
        self.op, self.dtype, self.fn = op, dtype, fn

    @bt.hookimpl
    def blutrain_register_kernels(self, registry: Any) -> None:
        registry.register(self.op, "cpu", self.dtype, self.fn, priority=100)


@pytest.fixture
def broken() -> Iterator[Callable[[str, str, Callable[..., Any]], None]]:
    names: list[str] = []

    def install(op: str, dtype: str, fn: Callable[..., Any]) -> None:
        name = f"test-broken-{len(names)}"
        plugins.register(_Broken(op, dtype, fn), name)
        names.append(name)

    yield install
    for name in names:
        plugins.unregister(name)


def _sample(*values: np.ndarray, **kwargs: Any) -> Sample:
    return Sample(tuple(Arg(v) for v in values), kwargs)


X = np.random.default_rng(0).standard_normal((5, 7))
Y = np.random.default_rng(1).standard_normal((5, 7))


def test_a_correct_kernel_passes() -> None:
    run_sample(CATALOGUE["add"], bt.float32, CPU, _sample(X, Y))


def test_a_kernel_with_a_wrong_result_fails(broken: Callable[..., None]) -> None:
    broken("add", "float32", lambda a, b: a - b)
    with pytest.raises(MismatchError, match=r"error .* exceeds 1e-05 for float32"):
        run_sample(CATALOGUE["add"], bt.float32, CPU, _sample(X, Y))


def test_a_kernel_computing_in_a_lower_precision_fails(broken: Callable[..., None]) -> None:
    broken("exp", "float32", lambda a: np.exp(a.astype(np.float16)).astype(np.float32))
    with pytest.raises(MismatchError, match="exceeds 1e-05"):
        run_sample(CATALOGUE["exp"], bt.float32, CPU, _sample(X))


def test_a_kernel_producing_nan_fails(broken: Callable[..., None]) -> None:
    def nan_at_one(a: np.ndarray) -> np.ndarray:
        out = np.tanh(a)
        out.reshape(-1)[3] = np.nan
        return out

    broken("tanh", "float32", nan_at_one)
    with pytest.raises(MismatchError, match="NaN where the reference is not"):
        run_sample(CATALOGUE["tanh"], bt.float32, CPU, _sample(X))


def test_a_wrong_backward_kernel_fails(broken: Callable[..., None]) -> None:
    from blutrain.tensor.cpu import reduction

    broken("softmax_backward", "float32", lambda g, y, axis: reduction.softmax_backward(g, y, axis) * 1.01)
    x = Arg(X, grad=True)
    with pytest.raises(MismatchError, match="gradient"):
        run_sample(CATALOGUE["softmax_backward"], bt.float32, CPU, Sample((x,), {"dim": 1}, grad_seed=3))


def test_a_kernel_that_assumes_contiguous_inputs_fails_on_a_transposed_view(broken: Callable[..., None]) -> None:
    def reads_memory_in_order(a: np.ndarray) -> np.ndarray:
        dense_strides = np.empty(a.shape, a.dtype).strides
        return -np.lib.stride_tricks.as_strided(a, a.shape, dense_strides)

    broken("neg", "float32", reads_memory_in_order)
    run_sample(CATALOGUE["neg"], bt.float32, CPU, Sample((Arg(X),), {}))
    with pytest.raises(MismatchError):
        run_sample(CATALOGUE["neg"], bt.float32, CPU, Sample((Arg(X, layout="transposed"),), {}))


def test_integer_results_must_be_exact() -> None:
    with pytest.raises(MismatchError, match="1 of 3 elements differ"):
        assert_matches(bt.tensor([1, 2, 3]), bt.tensor([1, 2, 4]), bt.int64)


def test_nan_in_the_same_place_as_the_reference_passes_and_elsewhere_fails() -> None:
    ref = bt.tensor([1.0, float("nan")], dtype="float64")
    assert_matches(bt.tensor([1.0, float("nan")]), ref, bt.float32)
    with pytest.raises(MismatchError, match="NaN"):
        assert_matches(bt.tensor([float("nan"), 1.0]), ref, bt.float32)


def test_tolerances_are_per_dtype() -> None:
    ref = bt.tensor(np.full(100, 1.0), dtype="float64")
    assert_matches(bt.full((100,), 1.004, dtype="bfloat16"), ref, bt.bfloat16)
    with pytest.raises(MismatchError, match="for float16"):
        assert_matches(bt.full((100,), 1.004, dtype="float16"), ref, bt.float16)
    with pytest.raises(MismatchError, match="for float32"):
        assert_matches(bt.full((100,), 1.0001, dtype="float32"), ref, bt.float32)
