"""A second device for the tests that move tensors between devices.

"host2" is the NumPy backend under another name, with the generic CPU kernels registered for it:
registered at run time through the same hooks as any plugin, and unregistered after the test.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

import blutrain.tensor as bt
from blutrain.tensor import plugins
from blutrain.tensor.cpu import TABLE, kernel_for
from blutrain.tensor.cpu.backend import NumpyBackend
from blutrain.tensor.device import Device


class _SecondHost(NumpyBackend):
    name = "host2"


class _SecondHostPlugin:
    def __init__(self) -> None:
        self.backend = _SecondHost()

    @bt.hookimpl
    def blutrain_register_backends(self, registry: Any) -> None:
        registry.register(self.backend)

    @bt.hookimpl
    def blutrain_register_kernels(self, registry: Any) -> None:
        for op, (_, dtypes, _) in TABLE.items():
            for dt in dtypes:
                registry.register(op, "host2", dt, kernel_for(op, dt))


@pytest.fixture
def second_device() -> Iterator[Device]:
    plugins.register(_SecondHostPlugin(), "test-host2")
    try:
        yield bt.device("host2")
    finally:
        plugins.unregister("test-host2")
