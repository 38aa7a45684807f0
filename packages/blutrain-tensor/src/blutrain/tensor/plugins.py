"""The one plugin manager of the process, and how registries are filled from it.

BluTrain is a set of pluggy plugins, as pytest is: the built-in NumPy backend and kernels register
through the same hooks as any third-party package found in the entry-point group ``blutrain``.
Hook specifications come from the entry-point group ``blutrain.hookspecs`` (each BluTrain package
declares its own ``hookspecs`` module there), so every hook any installed package defines is known
before the first plugin is checked: an implementation of a hook nobody defines, or with argument
names the spec does not have, fails at load with the plugin's name.

Hooks are called once per registry, when it is first needed (:func:`registry`); the result is kept
and the per-op path only ever reads plain dicts built from it.
"""

from __future__ import annotations

import importlib
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from importlib import metadata
from types import ModuleType
from typing import Any, TypeVar

import pluggy

from blutrain.tensor.errors import PluginError
from blutrain.tensor.registry import Provider, Registry

PROJECT = "blutrain"
ENTRY_POINT_GROUP = "blutrain"
HOOKSPEC_GROUP = "blutrain.hookspecs"
DISABLE_ENV = "BLUTRAIN_DISABLE_PLUGINS"

hookimpl = pluggy.HookimplMarker(PROJECT)
hookspec = pluggy.HookspecMarker(PROJECT)

# Built-in plugins of blutrain-tensor: registered exactly like entry-point plugins, and blockable.
BUILTIN_PLUGINS: tuple[tuple[str, str], ...] = (
    ("cpu", "blutrain.tensor.cpu.backend"),
    ("cpu-kernels", "blutrain.tensor.cpu.kernels"),
)

R = TypeVar("R", bound=Registry[Any])


@dataclass
class PluginInfo:
    """One plugin as ``blutrain plugins`` shows it."""

    name: str
    distribution: str
    version: str
    source: str  # "built-in" or "entry point"
    registered: dict[str, list[str]] = field(default_factory=dict)

    @property
    def provider(self) -> Provider:
        return Provider(self.name, self.distribution, self.version)


class _BluTrainPluginManager(pluggy.PluginManager):
    """Treats every ``blutrain_*`` function of a plugin as a hook implementation, marked or not,
    so a misspelt hook name cannot be silently ignored (pytest does the same for ``pytest_*``)."""

    def parse_hookimpl_opts(self, plugin: object, name: str) -> Any:
        opts = super().parse_hookimpl_opts(plugin, name)
        if opts is None and name.startswith(PROJECT + "_") and callable(getattr(plugin, name, None)):
            opts = {"wrapper": False, "hookwrapper": False, "optionalhook": False,
                    "tryfirst": False, "trylast": False, "specname": None}
        return opts


class _State:
    def __init__(self) -> None:
        self.pm: pluggy.PluginManager | None = None
        self.infos: dict[str, PluginInfo] = {}
        self.spec_modules: set[str] = set()
        self.registries: dict[str, Registry[Any]] = {}
        self.listeners: list[Callable[[], None]] = []


_state = _State()


def disabled_plugins() -> set[str]:
    """Plugin names listed in ``BLUTRAIN_DISABLE_PLUGINS`` (comma separated)."""
    raw = os.environ.get(DISABLE_ENV, "")
    return {part.strip() for part in raw.split(",") if part.strip()}


def get_plugin_manager() -> pluggy.PluginManager:
    """The process-wide plugin manager, created and loaded on first use."""
    if _state.pm is None:
        _load()
    assert _state.pm is not None
    return _state.pm


def _load() -> None:
    pm = _BluTrainPluginManager(PROJECT)
    _state.pm = pm
    _state.infos = {}
    _state.spec_modules = set()
    blocked = disabled_plugins()
    for name in blocked:
        pm.set_blocked(name)
    from blutrain.tensor import hookspecs as tensor_specs

    _add_specs(pm, tensor_specs)
    for ep in _entry_points(HOOKSPEC_GROUP):
        try:
            module = ep.load()
        except Exception as exc:
            raise PluginError(f"hook specifications {ep.value!r} ({_dist_of(ep)}) failed to import: {exc}") from exc
        _add_specs(pm, module)
    for name, module_name in BUILTIN_PLUGINS:
        if name in blocked:
            continue
        dist, version = "blutrain-tensor", _version("blutrain-tensor")
        _register(pm, importlib.import_module(module_name), PluginInfo(name, dist, version, "built-in"))
    for ep in _entry_points(ENTRY_POINT_GROUP):
        if ep.name in blocked:
            continue
        dist = ep.dist.name if ep.dist is not None else ""
        version = ep.dist.version if ep.dist is not None else ""
        info = PluginInfo(ep.name, dist, version, "entry point")
        try:
            plugin = ep.load()
        except Exception as exc:
            raise PluginError(f"plugin {ep.name!r} ({dist} {version}) failed to import {ep.value!r}: {exc}") from exc
        _register(pm, plugin, info)
    _check_pending(pm)


def _entry_points(group: str) -> list[metadata.EntryPoint]:
    seen: dict[str, metadata.EntryPoint] = {}
    for ep in metadata.entry_points(group=group):
        seen.setdefault(ep.name, ep)  # the first on sys.path wins, as for imports
    return list(seen.values())


def _dist_of(ep: metadata.EntryPoint) -> str:
    return f"{ep.dist.name} {ep.dist.version}" if ep.dist is not None else "unknown distribution"


def _version(dist: str) -> str:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return "source"


def _add_specs(pm: pluggy.PluginManager, module: ModuleType) -> None:
    if module.__name__ in _state.spec_modules:
        return
    _state.spec_modules.add(module.__name__)
    pm.add_hookspecs(module)


def _register(pm: pluggy.PluginManager, plugin: object, info: PluginInfo) -> None:
    if info.name in _state.infos:
        other = _state.infos[info.name]
        raise PluginError(
            f"two plugins are named {info.name!r}: from {other.distribution} and from {info.distribution}"
        )
    try:
        pm.register(plugin, name=info.name)
    except pluggy.PluginValidationError as exc:
        raise PluginError(f"plugin {info.name!r} ({info.distribution} {info.version}) is invalid: {exc}") from exc
    _state.infos[info.name] = info


def _check_pending(pm: pluggy.PluginManager) -> None:
    known = sorted(n for n in dir(pm.hook) if n.startswith(PROJECT + "_"))
    for name in dir(pm.hook):
        if not name.startswith(PROJECT + "_"):
            continue
        caller = getattr(pm.hook, name)
        if caller.spec is not None:
            continue
        for impl in caller.get_hookimpls():
            if impl.optionalhook:  # marked as implementing a hook of a package that may not be installed
                continue
            plugin_name = pm.get_name(impl.plugin) or repr(impl.plugin)
            info = _state.infos.get(plugin_name)
            where = f" ({info.distribution} {info.version})" if info else ""
            specced = [k for k in known if getattr(pm.hook, k).spec is not None]
            raise PluginError(
                f"plugin {plugin_name!r}{where} implements unknown hook {name!r}; "
                f"hooks defined by the installed packages: {', '.join(specced)}"
            )


def add_hookspecs(module: ModuleType) -> None:
    """Make a package's hook specifications known (idempotent). Packages call it on import so that
    they work even where entry-point metadata is missing (a source tree on PYTHONPATH)."""
    if _state.pm is not None and module.__name__ not in _state.spec_modules:
        _add_specs(_state.pm, module)


def register(plugin: object, name: str) -> None:
    """Register a plugin object at run time (tests, notebooks). Registries are rebuilt on next use."""
    pm = get_plugin_manager()
    if name in disabled_plugins():
        return
    _register(pm, plugin, PluginInfo(name, "", "", "registered at run time"))
    _check_pending(pm)
    _invalidate()


def unregister(name: str) -> None:
    """Remove a plugin registered by name; registries are rebuilt on next use."""
    pm = get_plugin_manager()
    plugin = pm.get_plugin(name)
    if plugin is None:
        raise PluginError(f"no plugin named {name!r}; loaded: {', '.join(sorted(_state.infos))}")
    pm.unregister(plugin)
    _state.infos.pop(name, None)
    _invalidate()


def reload() -> None:
    """Forget the plugin manager and every registry; the next use loads everything again."""
    _state.pm = None
    _invalidate()


def _invalidate() -> None:
    _state.registries.clear()
    for listener in list(_state.listeners):
        listener()


def on_change(listener: Callable[[], None]) -> None:
    """Call ``listener`` whenever plugins change, so tables built from registries are dropped."""
    _state.listeners.append(listener)


def registry(hook_name: str, factory: Callable[[], R], specs: ModuleType | None = None) -> R:
    """The registry filled by ``hook_name``: built by ``factory`` and filled once, then cached. ``specs``, the
    hookspecs module that declares ``hook_name``, is made known first (:func:`add_hookspecs`), so that a package's
    registry works where its entry-point metadata is missing."""
    if specs is not None:
        add_hookspecs(specs)
    cached = _state.registries.get(hook_name)
    if cached is not None:
        return cached  # type: ignore[return-value]
    reg = factory()
    fill(hook_name, reg)
    _state.registries[hook_name] = reg
    return reg


def fill(hook_name: str, reg: Registry[Any]) -> None:
    """Call every implementation of ``hook_name`` with ``registry=reg``, one plugin at a time, so
    each entry records which plugin registered it."""
    pm = get_plugin_manager()
    caller = getattr(pm.hook, hook_name, None)
    if caller is None or caller.spec is None:
        raise PluginError(f"no hook specification {hook_name!r} is installed")
    # pluggy's own call order is last-registered-first; get_hookimpls() lists registration order,
    # so built-ins come first and error messages read naturally.
    for impl in caller.get_hookimpls():
        name = pm.get_name(impl.plugin) or repr(impl.plugin)
        info = _state.infos.get(name, PluginInfo(name, "", "", "unknown"))
        reg.current_provider = info.provider
        try:
            impl.function(registry=reg)
        except PluginError:
            raise
        except Exception as exc:
            where = f"plugin {name!r} ({info.distribution} {info.version})"
            raise PluginError(f"{where} failed in {hook_name}: {exc}") from exc
        finally:
            reg.current_provider = Provider("direct", "", "")
    for name, entries in reg.by_provider().items():
        if name in _state.infos:
            _state.infos[name].registered[hook_name] = entries


def plugin_infos() -> list[PluginInfo]:
    """Every loaded plugin, in load order."""
    get_plugin_manager()
    return list(_state.infos.values())


def hook_names() -> list[str]:
    """Every hook specification known to the plugin manager."""
    pm = get_plugin_manager()
    return sorted(n for n in dir(pm.hook) if n.startswith(PROJECT + "_") and getattr(pm.hook, n).spec is not None)
