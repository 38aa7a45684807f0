"""Devices: a backend's device type plus an index ("cpu", "cuda:0").

Device objects are interned for the life of the process, so a tensor's device compares by identity
in the per-op path. When plugins change, a device keeps its identity (tensors made before and after
still meet in one op) and only looks its backend up again on next use.
"""

from __future__ import annotations

from blutrain.tensor import plugins
from blutrain.tensor.backend import Backend, get_backend
from blutrain.tensor.errors import NotRegisteredError, TensorTypeError, TensorValueError


class Device:
    """A device: ``type`` names its backend, ``index`` the unit (always 0 on the CPU)."""

    __slots__ = ("_backend", "index", "type")

    def __init__(self, type: str, index: int, backend: Backend) -> None:
        self.type = type
        self.index = index
        self._backend: Backend | None = backend

    @property
    def backend(self) -> Backend:
        """The backend registered for ``type`` (looked up again after plugins changed)."""
        found = self._backend
        if found is None:
            found = self._backend = get_backend(self.type)
        return found

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
    if found is not None and found._backend is not None:
        return found
    try:
        backend = get_backend(name)
    except NotRegisteredError as exc:
        raise TensorValueError(f"device: unknown device type {name!r}; {str(exc).split('; ', 1)[1]}") from None
    if found is not None:
        found._backend = backend
        return found
    if index >= max(backend.device_count(), 1):
        raise TensorValueError(f"device: {spec!r} does not exist; {name} has {backend.device_count()} device(s)")
    dev = Device(name, index, backend)
    _interned[key] = dev
    return dev


def _forget_backends() -> None:
    for dev in _interned.values():
        dev._backend = None


plugins.on_change(_forget_backends)
