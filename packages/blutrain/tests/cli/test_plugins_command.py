"""``blutrain plugins``: the listing, and ``--check``, the conformance suite of every installed device backend."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

import blutrain.tensor as bt
from blutrain.cli import main
from blutrain.kernels import CATALOGUE
from blutrain.tensor import plugins
from blutrain.tensor.testing import plugin_registered


def _cuda_available() -> bool:
    return "cuda" in bt.backends() and bt.backends().get("cuda").is_available()


class _WrongMul:
    """Overrides float32 ``mul`` on the CPU with a kernel that is off by one."""

    @bt.hookimpl
    def blutrain_register_kernels(self, registry: Any) -> None:
        registry.register("mul", "cpu", "float32", lambda a, b: np.asarray(a * b + 1, dtype=np.float32),
                          priority=1000)


@pytest.fixture
def wrong_mul() -> Iterator[None]:
    with plugin_registered(_WrongMul(), "test-wrong-mul"):
        yield


def test_listing_names_every_plugin_with_what_it_registered(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plugins"]) == 0
    out = capsys.readouterr().out
    for info in plugins.plugin_infos():
        assert f"\n{info.name}  [{info.source}]" in out
    assert "blutrain_register_optimizers: adamw" in out


def test_check_runs_every_catalogue_op_and_dtype_on_the_cpu_and_passes(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plugins", "--check", "--device", "cpu", "--examples", "2"]) == 0
    out = capsys.readouterr().out
    cases = sum(len(op.dtypes) for op in CATALOGUE.values())
    assert f"device cpu: {cases} passed, 0 failed, 0 skipped" in out
    lines = out.splitlines()
    for name, op in CATALOGUE.items():
        (line,) = [ln for ln in lines if ln.split()[:1] == [name]]
        assert all(f"{dt.name} ok" in line for dt in op.dtypes), line


def test_check_prints_the_plugin_whose_kernel_ran(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plugins", "--check", "--device", "cpu", "--op", "add", "--examples", "1"]) == 0
    (line,) = [ln for ln in capsys.readouterr().out.splitlines() if ln.strip().startswith("add ")]
    assert line.endswith("[cpu-kernels]")


def test_check_fails_a_wrong_kernel_naming_op_dtype_and_plugin(wrong_mul: None,
                                                               capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plugins", "--check", "--device", "cpu", "--op", "mul", "--examples", "3"]) == 1
    out = capsys.readouterr().out
    (line,) = [ln for ln in out.splitlines() if ln.strip().startswith("mul ")]
    assert "float32 FAILED" in line and "float64 ok" in line and "test-wrong-mul" in line
    assert "float32: MismatchError: output: error" in out and "sample: Sample(" in out
    assert "device cpu: " in out and " 1 failed" in out


def test_check_of_an_unknown_op_is_refused_listing_the_catalogue(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plugins", "--check", "--op", "gleu"]) == 2
    assert "no op 'gleu' in the catalogue; known: " in capsys.readouterr().err


def test_check_options_without_check_are_refused(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plugins", "--device", "cpu"]) == 2
    assert "go with --check" in capsys.readouterr().err


def test_check_of_every_device_skips_an_unavailable_one_but_naming_it_fails(capsys: pytest.CaptureFixture[str]) -> None:
    # decided here, not in a skipif: loading the plugins while tests are collected would import every plugin
    # before the other test modules are collected
    if "cuda" not in bt.backends() or _cuda_available():
        pytest.skip("needs cuda installed without a GPU")
    assert main(["plugins", "--check", "--op", "add", "--examples", "1"]) == 0
    assert "device cuda:0: skipped (installed, not available on this machine)" in capsys.readouterr().out
    assert main(["plugins", "--check", "--device", "cuda", "--op", "add", "--examples", "1"]) == 1
    assert "device 'cuda' is installed but not available" in capsys.readouterr().err


def test_the_command_exits_zero_from_a_shell() -> None:
    proc = subprocess.run([sys.executable, "-m", "blutrain.cli", "plugins", "--check", "--device", "cpu", "--op",
                           "gelu", "--examples", "2"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "device cpu: 4 passed, 0 failed, 0 skipped" in proc.stdout


def test_a_reader_that_goes_away_ends_the_command_quietly(monkeypatch: pytest.MonkeyPatch) -> None:
    """`blutrain plugins | head -n 1`: the pipe closes before the output is written; no traceback, the exit
    status of a writer killed by SIGPIPE."""
    read_end, write_end = os.pipe()
    os.close(read_end)
    with os.fdopen(write_end, "w") as closed_pipe:
        monkeypatch.setattr(sys, "stdout", closed_pipe)
        assert main(["plugins"]) == 128 + signal.SIGPIPE
