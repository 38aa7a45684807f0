"""Plugins for the length of a ``with`` block: one registered at run time (a test's own hook implementations), or
some blocked as ``BLUTRAIN_DISABLE_PLUGINS`` blocks them for a process (what a user sees where they are not
installed). Either way the registries are rebuilt on entry and on exit, so none outlives the block."""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager

from blutrain.tensor import plugins


@contextmanager
def plugin_registered(plugin: object, name: str) -> Iterator[None]:
    """Registers ``plugin`` under ``name`` (:func:`blutrain.tensor.plugins.register`) for the block and unregisters
    it after, also when the block raises."""
    plugins.register(plugin, name)
    try:
        yield
    finally:
        plugins.unregister(name)


@contextmanager
def plugins_blocked(*names: str) -> Iterator[None]:
    """Reloads the plugins with ``names`` added to ``BLUTRAIN_DISABLE_PLUGINS``; on exit restores the variable as it
    was and reloads again, so no registry built while they were blocked outlives the block."""
    before = os.environ.get(plugins.DISABLE_ENV)
    os.environ[plugins.DISABLE_ENV] = ",".join([*sorted(plugins.disabled_plugins()), *names])
    plugins.reload()
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(plugins.DISABLE_ENV, None)
        else:
            os.environ[plugins.DISABLE_ENV] = before
        plugins.reload()
