"""Devices: a backend's device type plus an index ("cpu", "cuda:0").

Device objects are interned, so a tensor's device compares by identity in the per-op path.
"""

from __future__ import annotations

from blutrain.tensor import plugins
from blutrain.tensor.backend import Backend, get_backend
from blutrain.tensor.errors import TensorTypeError, TensorValueError
from blutrain.tensor.registry import NotRegisteredError


class Device:
    """A device: ``type`` names its backend, ``index`` the unit (always 0 on the CPU)."""

    __slots__ = ("backend", "index", "type")

    def __init__(self, type: str, index: int, backend: Backend) -> None:
        self.type = type
        self.index = index
        self.backend = backend

    def __repr__(self) -> str:
        return f"device('{self}')"

    def __str__(self) -> str:
        return self.type if self.type == "cpu" else f"{self.type}:{self.index}"

    def __reduce__(self) -> tuple[object, tuple[str]]:
        return (device, (str(self),))


_interned: dict[tuple[str, int], Device] = {}


def device(spec: str | Device | None = None, index: int | None = None) -> Device:
    """Resolve ``"cpu"``, ``"cuda"``, ``"cuda:1"`` or a Device; an unknown type lists the backends."""
    if isinstance(spec, Device):
        return spec
    if spec is None:
        spec = "cpu"
    if not isinstance(spec, str):
        raise TensorTypeError(f"device: expected a str such as 'cpu' or 'cuda:0', or a Device; got {spec!r}")
    name, _, idx = spec.partition(":")
    if idx:
        if not idx.isdigit():
            raise TensorValueError(f"device: index in {spec!r} must be a non-negative integer")
        index = int(idx)
    index = 0 if index is None else index
    key = (name, index)
    found = _interned.get(key)
    if found is not None:
        return found
    try:
        backend = get_backend(name)
    except NotRegisteredError as exc:
        raise TensorValueError(f"device: unknown device type {name!r}; {str(exc).split('; ', 1)[1]}") from None
    if name != "cpu" and index >= max(backend.device_count(), 1):
        raise TensorValueError(f"device: {spec!r} does not exist; {name} has {backend.device_count()} device(s)")
    dev = Device(name, index, backend)
    _interned[key] = dev
    return dev


def _forget_devices() -> None:
    _interned.clear()


plugins.on_change(_forget_devices)
