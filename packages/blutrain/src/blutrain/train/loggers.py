"""Loggers of the training events: plugins that implement ``blutrain_on_train_event``, chosen by name.

``--log csv,tensorboard`` names plugins as they are registered (their entry-point name in the ``blutrain``
group, as ``blutrain plugins`` lists them). The trainer checks that each named plugin is installed and
handles training events; a logger reads the names from ``state["config"]["log"]`` of the ``train_start``
event and writes only when its own name is there. ``csv`` comes with blutrain; others are packages of
their own.
"""

from __future__ import annotations

from typing import Any

import pluggy

from blutrain.tensor import plugins
from blutrain.train import hookspecs
from blutrain.train.config import ConfigError

# name → the distribution that provides it, for the hint when one is missing
KNOWN_LOGGERS: dict[str, str] = {"csv": "blutrain", "tensorboard": "blutrain-logger-tensorboard"}


def train_event_hook() -> pluggy.HookCaller:
    """The ``blutrain_on_train_event`` hook (its specification made known first)."""
    plugins.add_hookspecs(hookspecs)
    hook: pluggy.HookCaller = plugins.get_plugin_manager().hook.blutrain_on_train_event
    return hook


def installed_loggers() -> list[str]:
    """The names of the installed plugins that handle training events."""
    pm = plugins.get_plugin_manager()
    return sorted({name for impl in train_event_hook().get_hookimpls() if (name := pm.get_name(impl.plugin))})


def check_loggers(names: list[str]) -> None:
    """Raise :class:`ConfigError` for a name in ``names`` that no installed logger has, saying which
    package provides it where it is one of the project's."""
    installed = installed_loggers()
    for name in names:
        if name not in installed:
            dist = KNOWN_LOGGERS.get(name)
            hint = f"; install {dist}" if dist else "; give installed logger names, e.g. --log csv"
            if dist and name in plugins.disabled_plugins():
                hint = f"; it is blocked by {plugins.DISABLE_ENV}"
            raise ConfigError(f"log: no logger {name!r}; installed: {', '.join(installed) or 'none'}{hint}")


def logger_selected(name: str, state: dict[str, Any]) -> bool:
    """For a logger's ``train_start`` handler: whether ``--log`` named ``name``."""
    config = state.get("config", {})
    return name in (config.get("log") or [])


__all__ = ["KNOWN_LOGGERS", "check_loggers", "installed_loggers", "logger_selected", "train_event_hook"]
