"""Named registries that hooks fill once, at load time.

A registry is a plain dict behind a small typed class. Hook implementations are called one plugin at
a time (see :func:`blutrain.tensor.plugins.fill`), so every entry knows which plugin and distribution
provided it; a failed lookup can then say exactly what is installed.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Generic, TypeVar

from blutrain.tensor.errors import NotRegisteredError, PluginError

T = TypeVar("T")


@dataclass(frozen=True)
class Provider:
    """The plugin that registered an entry: its plugin name and the distribution it came from."""

    plugin: str
    distribution: str
    version: str

    def __str__(self) -> str:
        if not self.distribution:
            return self.plugin
        return f"{self.distribution} {self.version}"


UNKNOWN_PROVIDER = Provider("direct", "", "")


class Registry(Generic[T]):
    """Name → object, filled by one hook; ``kind`` names the thing in messages ("optimizer").

    ``providers`` maps names that the project's own plugins register to the distribution that provides each
    ("adamw" → "blutrain-optim-adamw"), so that looking up one that is not installed says what to install."""

    def __init__(self, kind: str, providers: Mapping[str, str] | None = None) -> None:
        self.kind = kind
        self.known_providers: dict[str, str] = dict(providers or {})
        self._entries: dict[str, T] = {}
        self._providers: dict[str, Provider] = {}
        self.current_provider: Provider = UNKNOWN_PROVIDER

    def register(self, name: str, obj: T) -> None:
        """Add ``obj`` under ``name``; a name registered twice is an error naming both plugins."""
        if not isinstance(name, str) or not name:
            raise PluginError(
                f"{self.current_provider.plugin}: a {self.kind} name must be a non-empty str, got {name!r}"
            )
        if name in self._entries:
            raise PluginError(
                f"{self.kind} {name!r} is registered twice: by {self._providers[name]} and by "
                f"{self.current_provider}; block one with BLUTRAIN_DISABLE_PLUGINS="
                f"{self.current_provider.plugin}"
            )
        self._entries[name] = obj
        self._providers[name] = self.current_provider

    def get(self, name: str) -> T:
        """The object registered as ``name``, or an error listing every installed name."""
        try:
            return self._entries[name]
        except KeyError:
            dist = self.known_providers.get(name)
            hint = f"; install {dist}" if dist else ""
            raise NotRegisteredError(f"no {self.kind} {name!r}; installed: {self.describe()}{hint}") from None

    def provider(self, name: str) -> Provider:
        self.get(name)
        return self._providers[name]

    def describe(self) -> str:
        if not self._entries:
            return "none"
        return ", ".join(f"{n} ({self._providers[n]})" for n in sorted(self._entries))

    def names(self) -> list[str]:
        return sorted(self._entries)

    def items(self) -> Iterator[tuple[str, T]]:
        return iter(sorted(self._entries.items()))

    def by_provider(self) -> dict[str, list[str]]:
        """Plugin name → the names it registered, for ``blutrain plugins``."""
        out: dict[str, list[str]] = {}
        for name, prov in self._providers.items():
            out.setdefault(prov.plugin, []).append(name)
        return out

    def __contains__(self, name: object) -> bool:
        return name in self._entries

    def __len__(self) -> int:
        return len(self._entries)
