"""Containers: ModuleList (indexable, registered children) and Sequential (chained forward)."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any, Generic, TypeVar, overload

from blutrain.nn.errors import ModuleError
from blutrain.nn.module import Module

M = TypeVar("M", bound=Module)


def _index(i: int, n: int, container: str) -> int:
    if not -n <= i < n:
        raise IndexError(f"{container}: index {i} is out of range for {n} modules")
    return i % n


class ModuleList(Module, Generic[M]):
    """A list of submodules registered under the names "0", "1", ...; ``for m in list: m(x)``."""

    def __init__(self, modules: Iterable[M] | None = None) -> None:
        super().__init__()
        if modules is not None:
            self.extend(modules)

    def append(self, module: M) -> ModuleList[M]:
        if not isinstance(module, Module):
            raise ModuleError(f"ModuleList.append: expected a Module, got {type(module).__name__}")
        self.add_module(str(len(self._modules)), module)
        return self

    def extend(self, modules: Iterable[M]) -> ModuleList[M]:
        for m in modules:
            self.append(m)
        return self

    @overload
    def __getitem__(self, index: int) -> M: ...
    @overload
    def __getitem__(self, index: slice) -> ModuleList[M]: ...

    def __getitem__(self, index: int | slice) -> M | ModuleList[M]:
        items: list[M] = list(self._modules.values())  # type: ignore[arg-type]
        if isinstance(index, slice):
            return ModuleList(items[index])
        return items[_index(index, len(items), "ModuleList")]

    def __len__(self) -> int:
        return len(self._modules)

    def __iter__(self) -> Iterator[M]:
        return iter(self._modules.values())  # type: ignore[arg-type]


class Sequential(Module):
    """Modules applied one after the other: ``Sequential(a, b)(x) == b(a(x))``."""

    def __init__(self, *modules: Module) -> None:
        super().__init__()
        for i, m in enumerate(modules):
            if not isinstance(m, Module):
                raise ModuleError(f"Sequential: argument {i} must be a Module, got {type(m).__name__}")
            self.add_module(str(i), m)

    def forward(self, x: Any) -> Any:
        for m in self._modules.values():
            x = m(x)  # type: ignore[misc]
        return x

    def __getitem__(self, index: int) -> Module:
        items: list[Module] = list(self._modules.values())  # type: ignore[arg-type]
        return items[_index(index, len(items), "Sequential")]

    def __len__(self) -> int:
        return len(self._modules)

    def __iter__(self) -> Iterator[Module]:
        return iter(self._modules.values())  # type: ignore[arg-type]


__all__ = ["ModuleList", "Sequential"]
