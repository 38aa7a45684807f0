"""Command-line argument types, and the set-up of a run, that the benchmarks share."""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable, Sequence


def choice_list(allowed: Sequence[str] | None) -> Callable[[str], list[str]]:
    """An argparse type: a comma-separated list of names from ``allowed`` (any names where None), in the order
    given, each once; an empty list or a name not allowed is argparse's one-line usage error."""

    def parse(text: str) -> list[str]:
        items = [s.strip() for s in text.split(",") if s.strip()]
        bad = [s for s in items if allowed is not None and s not in allowed]
        if bad or not items:
            raise argparse.ArgumentTypeError(f"expected a comma-separated list of {', '.join(allowed or ())}, "
                                             f"got {text!r}")
        return list(dict.fromkeys(items))

    return parse


def measure_installed_plugins() -> None:
    """Measure what ``pip install blutrain`` runs: not the workspace's teaching plugin blutrain-kernels-example,
    whose gelu outranks the built-in kernel wherever it is installed (``BLUTRAIN_DISABLE_PLUGINS``, unless set
    already; the ranks a tool launches inherit it). A tool calls this in its main, not at import, so that
    importing it (its tests) leaves the process's plugins alone."""
    os.environ.setdefault("BLUTRAIN_DISABLE_PLUGINS", "kernels-example")


__all__ = ["choice_list", "measure_installed_plugins"]
