"""A second device for the tests that move tensors between devices.

"host2" is the NumPy backend under another name, with the generic CPU kernels registered for it: registered at run
time through the same hooks as any plugin, and unregistered when the ``with`` block ends.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from blutrain.tensor.backend import BackendRegistry
from blutrain.tensor.cpu.backend import NumpyBackend
from blutrain.tensor.cpu.kernels import TABLE, kernel_for
from blutrain.tensor.device import Device, device
from blutrain.tensor.kernel import KernelRegistry
from blutrain.tensor.plugins import hookimpl
from blutrain.tensor.testing.plugins import plugin_registered

SECOND_HOST = "host2"


class _SecondHost(NumpyBackend):
    name = SECOND_HOST


class _SecondHostPlugin:
    def __init__(self) -> None:
        self.backend = _SecondHost()

    @hookimpl
    def blutrain_register_backends(self, registry: BackendRegistry) -> None:
        registry.register(self.backend)

    @hookimpl
    def blutrain_register_kernels(self, registry: KernelRegistry) -> None:
        for op, (_, dtypes, _) in TABLE.items():
            for dtype in dtypes:
                registry.register(op, SECOND_HOST, dtype, kernel_for(op, dtype))


@contextmanager
def second_host_device() -> Iterator[Device]:
    """Registers the "host2" device (NumPy under another name) for the ``with`` block and yields it."""
    with plugin_registered(_SecondHostPlugin(), f"test-{SECOND_HOST}"):
        yield device(SECOND_HOST)
