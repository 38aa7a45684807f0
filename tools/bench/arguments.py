"""Command-line argument types the benchmarks share."""

from __future__ import annotations

import argparse
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


__all__ = ["choice_list"]
