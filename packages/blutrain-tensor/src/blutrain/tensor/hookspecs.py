"""Hook specifications owned by blutrain-tensor: device backends and kernels.

Both hooks are called once, when the registry they fill is first needed, never per op. Every
implementation is called (no first-result-wins); each adds entries to the registry it is handed.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import pluggy

if TYPE_CHECKING:
    from blutrain.tensor.backend import BackendRegistry
    from blutrain.tensor.kernel import KernelRegistry

hookspec = pluggy.HookspecMarker("blutrain")


@hookspec
def blutrain_register_backends(registry: BackendRegistry) -> None:
    """Add device backends with ``registry.register(backend)``.

    A backend (see :class:`blutrain.tensor.backend.Backend`) owns a device type such as ``"cpu"`` or
    ``"cuda"``: its array module, allocation, host copies, synchronization, streams and events, and
    its random generators. Two plugins registering the same device type is an error naming both.
    """


@hookspec
def blutrain_register_kernels(registry: KernelRegistry) -> None:
    """Add op implementations with ``registry.register(op, device, dtypes, fn, priority=...)``.

    ``fn`` receives backend arrays and returns backend arrays. For one (op, device, dtype) the
    implementation with the highest priority wins, so a plugin can replace a single op on a single
    device without touching anything else; equal priorities from two plugins are an error.
    """
