"""Dispatch: (op, device, dtype) → kernel from the registry the hooks filled, plain dicts per op."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

import blutrain.tensor as bt
from blutrain.tensor import PluginError, dispatch, plugins
from blutrain.tensor.testing import plugin_registered


class _Override:
    """A plugin replacing float32 ``mul`` on the CPU with a kernel that marks its results."""

    def __init__(self, priority: int) -> None:
        self.priority = priority

    @bt.hookimpl
    def blutrain_register_kernels(self, registry: Any) -> None:
        registry.register("mul", "cpu", "float32", lambda a, b: np.asarray(a * b + 1000, dtype=np.float32),
                          priority=self.priority)


@pytest.fixture
def override() -> Iterator[None]:
    with plugin_registered(_Override(priority=10), "test-override"):
        yield


def test_a_higher_priority_kernel_replaces_one_op_on_one_device_and_dtype(override: None) -> None:
    assert (bt.ones(2) * 2).tolist() == [1002.0, 1002.0]
    assert (bt.ones(2, dtype="float64") * 2).tolist() == [2.0, 2.0]
    assert (bt.ones(2) + 2).tolist() == [3.0, 3.0]


def test_unregistering_the_plugin_restores_the_built_in_kernel(override: None) -> None:
    assert (bt.ones(1) * 2).item() == 1002.0
    plugins.unregister("test-override")
    try:
        assert (bt.ones(1) * 2).item() == 2.0
    finally:
        plugins.register(_Override(priority=10), "test-override")


def test_two_plugins_with_the_same_priority_for_one_kernel_is_an_error_naming_both() -> None:
    tie = r"kernel 'mul' for cpu/float32 registered by blutrain-tensor .* and by test-tie with the same priority 0"
    with plugin_registered(_Override(priority=0), "test-tie"), pytest.raises(PluginError, match=tie):
        bt.ones(1) * 2


def test_ops_call_no_plugin_hook_once_the_registries_are_filled(monkeypatch: pytest.MonkeyPatch) -> None:
    x = bt.ones(2, 3, requires_grad=True)
    (bt.softmax(x @ bt.ones(3, 2), 1).sum()).backward()  # warm: registries filled

    def forbidden(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("a plugin hook was called in the per-op path")

    monkeypatch.setattr(plugins, "get_plugin_manager", forbidden)
    monkeypatch.setattr(plugins, "fill", forbidden)
    y = bt.softmax(x @ bt.ones(3, 2), 1)
    y.sum().backward()
    assert (bt.ones(2, dtype="int8") + 1).tolist() == [2, 2]  # a key not seen before: a dict, not a hook


def test_autograd_records_through_the_single_dispatch_slot() -> None:
    bt.ones(1, requires_grad=True)  # imports blutrain.autograd on demand
    from blutrain.autograd import record

    assert dispatch.recorder is record


def test_blocking_the_built_in_kernels_leaves_ops_without_a_kernel() -> None:
    env = {**os.environ, "BLUTRAIN_DISABLE_PLUGINS": "cpu-kernels"}
    code = "import blutrain.tensor as bt; bt.zeros(2)"
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert proc.returncode != 0
    assert "KernelNotFoundError: no kernel for op 'full' on device 'cpu' with dtype float32" in proc.stderr


def test_every_cpu_kernel_returns_arrays_never_numpy_scalars() -> None:
    assert type((bt.ones(()) + 1).array) is np.ndarray
    assert type(bt.ones(3).sum().array) is np.ndarray
    assert type(bt.ones(3)[0].array) is np.ndarray
