"""Plugins blocked for a ``with`` block, as ``BLUTRAIN_DISABLE_PLUGINS`` blocks them for a process: for the tests of
what a user sees where a plugin is not installed."""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager

from blutrain.tensor import plugins


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
