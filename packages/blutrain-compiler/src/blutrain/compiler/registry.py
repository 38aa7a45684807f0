"""The registry of compiler passes, filled by ``blutrain_register_passes``."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from blutrain.compiler import hookspecs
from blutrain.compiler.passes import CORE_PIPELINE, REMAT_BEFORE, REMAT_PASS
from blutrain.tensor import plugins
from blutrain.tensor.errors import PluginError
from blutrain.tensor.registry import Registry


class PassRegistry(Registry[Any]):
    """Pass name → the pass (an xDSL ``ModulePass`` class or instance).

    ``register(name, pass_, runs_before=CORE_PASS)`` also places the pass in the default pipeline, just before the
    first run of that core pass: how a plugin's pass (an optimizer's, beside its kernel) runs by default without the
    core pipeline naming it. Without ``runs_before`` the pass runs only where a pipeline names it."""

    def __init__(self) -> None:
        super().__init__("compiler pass")
        self.places: dict[str, list[str]] = {}  # core pass → the passes placed before it, in registration order

    def register(self, name: str, obj: Any, runs_before: str | None = None) -> None:
        if runs_before is not None and runs_before not in CORE_PIPELINE:
            raise PluginError(f"{self.current_provider.plugin}: compiler pass {name!r}: runs_before must name a pass "
                              f"of blutrain.compiler.CORE_PIPELINE ({', '.join(dict.fromkeys(CORE_PIPELINE))}), got "
                              f"{runs_before!r}")
        super().register(name, obj)
        if runs_before is not None:
            self.places.setdefault(runs_before, []).append(name)

    def pipeline(self, core: Sequence[str] = CORE_PIPELINE) -> tuple[str, ...]:
        """``core`` with every placed pass inserted before the first run of the pass it named."""
        out: list[str] = []
        for name in core:
            if name not in out:
                out.extend(self.places.get(name, ()))
            out.append(name)
        return tuple(out)


def passes() -> PassRegistry:
    plugins.add_hookspecs(hookspecs)
    return plugins.registry("blutrain_register_passes", PassRegistry)


def default_pipeline() -> tuple[str, ...]:
    """What :func:`blutrain.compiler.compile` runs when given no ``passes``: the core passes
    (:data:`blutrain.compiler.CORE_PIPELINE`) with the passes plugins placed among them."""
    return passes().pipeline()


def with_remat(pipeline: Sequence[str], remat: bool) -> tuple[str, ...]:
    """``pipeline`` with the ``rematerialize`` pass (``remat`` True: placed before kernel selection, or at the end of
    a pipeline without it, where it is not there yet) or without it (False)."""
    out = [name for name in pipeline if name != REMAT_PASS]
    if remat:
        at = out.index(REMAT_BEFORE) if REMAT_BEFORE in out else len(out)
        out.insert(at, REMAT_PASS)
    return tuple(out)
