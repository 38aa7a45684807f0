"""The kernel registry: (op, device type, dtype) → the implementation with the highest priority.

Plugins fill it through ``blutrain_register_kernels``; dispatch then reads one flat dict built
from it (see :mod:`blutrain.tensor.dispatch`). Each entry remembers its provider, so a missing
kernel or a priority clash names the plugins involved.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

from blutrain.tensor import plugins
from blutrain.tensor.dtype import ALL_DTYPES, DType, as_dtype
from blutrain.tensor.errors import KernelNotFoundError, PluginError
from blutrain.tensor.registry import Provider, Registry

Kernel = Callable[..., Any]


@dataclass(frozen=True)
class KernelEntry:
    fn: Kernel
    priority: int
    provider: Provider


class KernelRegistry(Registry[KernelEntry]):
    """Holds every registered kernel; ``lookup`` returns the winner for one key."""

    def __init__(self) -> None:
        super().__init__("kernel")
        self._table: dict[tuple[str, str, DType], KernelEntry] = {}

    def register(  # type: ignore[override]
        self,
        op: str,
        device: str,
        dtypes: Iterable[DType | str] | DType | str,
        fn: Kernel,
        priority: int = 0,
    ) -> None:
        """Register ``fn`` for ``op`` on device type ``device`` for each of ``dtypes``.

        The dtype is the op's *compute* dtype (the promoted dtype of its inputs). The highest
        priority wins; a tie between two plugins is an error, so overriding is always explicit.
        """
        if not callable(fn):
            raise PluginError(f"{self.current_provider.plugin}: kernel for {op!r} must be callable, got {fn!r}")
        if isinstance(dtypes, (DType, str)):
            dtypes = (dtypes,)
        entry = KernelEntry(fn, priority, self.current_provider)
        for dt in dtypes:
            key = (op, device, as_dtype(dt))
            old = self._table.get(key)
            if old is not None:
                if old.priority == priority and old.provider != entry.provider:
                    raise PluginError(
                        f"kernel {op!r} for {device}/{key[2].name} registered by {old.provider} and by "
                        f"{entry.provider} with the same priority {priority}; give one a higher priority"
                    )
                if old.priority > priority:
                    continue
            self._table[key] = entry

    def lookup(self, op: str, device: str, dtype: DType) -> KernelEntry:
        entry = self._table.get((op, device, dtype))
        if entry is None:
            raise KernelNotFoundError(self.missing_message(op, device, dtype))
        return entry

    def has(self, op: str, device: str, dtype: DType) -> bool:
        """Whether a kernel is registered for the key (a caller with a fallback of its own asks first)."""
        return (op, device, dtype) in self._table

    def missing_message(self, op: str, device: str, dtype: DType) -> str:
        same_op = sorted({(d, t.name) for (o, d, t) in self._table if o == op})
        providers = sorted({str(e.provider) for e in self._table.values()})
        have = ", ".join(f"{d}/{t}" for d, t in same_op) or "no device"
        return (f"no kernel for op {op!r} on device {device!r} with dtype {dtype.name}; {op!r} exists for: "
                f"{have}; kernel providers installed: {', '.join(providers) or 'none'}")

    def keys(self) -> Iterator[tuple[str, str, DType]]:
        return iter(self._table)

    def entries(self) -> dict[tuple[str, str, DType], KernelEntry]:
        return dict(self._table)

    def by_provider(self) -> dict[str, list[str]]:
        out: dict[str, set[str]] = {}
        for (op, dev, _), entry in self._table.items():
            out.setdefault(entry.provider.plugin, set()).add(f"{op}@{dev}")
        return {k: sorted(v) for k, v in out.items()}

    def describe(self) -> str:
        return f"{len(self._table)} kernels"

    def __len__(self) -> int:
        return len(self._table)


def kernels() -> KernelRegistry:
    """The filled kernel registry (loads plugins on first use)."""
    return plugins.registry("blutrain_register_kernels", KernelRegistry)


__all__ = ["ALL_DTYPES", "Kernel", "KernelEntry", "KernelRegistry", "kernels"]
