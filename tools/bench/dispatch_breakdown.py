"""Where one op's host time goes, by category, for tools/bench_dispatch.py.

Many calls of a case run under cProfile (off while the timings are taken, so it costs them nothing); each
profiled function's own time (``tottime``) goes to the category of the module it lives in, decided by
:data:`MODULE_CATEGORIES` (first matching prefix wins). C functions that belong to no package of interest
(``isinstance``, ``dict.get``, ``type.__new__``, ...) count for the category of whoever called them, in
proportion to each caller's share of their time. The shares are then scaled to the unprofiled host µs of the
case, since cProfile's own cost per call inflates the profiled total.

The categories are decided by module name alone, so the same table works on any backend: on cuda the
plugin's Python (``blutrain_backend_cupy.*``, ``blutrain.kernels.*``) is "backend", CuPy's and its CUDA
libraries' compiled calls (``cupy.*``, ``cupy_backends.*``) are "launch", and ``blutrain.alloc*`` and CuPy's
memory pool are "allocation".
"""

from __future__ import annotations

import cProfile
import os
import re
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

# category: what it holds
CATEGORIES: dict[str, str] = {
    "dispatch": "the (op, device, dtype) kernel lookup (blutrain.tensor.dispatch, .kernel)",
    "checks": "the op's front end: argument checks, dtype promotion, autocast (the rest of blutrain.tensor)",
    "wrap": "Tensor objects made around results and views (blutrain.tensor.tensor, .base, .views)",
    "autograd": "recording the node (forward with requires_grad), the engine and derivative rules (backward)",
    "optimizer": "the optimizer's Python (blutrain.optim, the blutrain_optim_* plugins)",
    "backend": "the backend's Python per kernel: argument preparation on cuda (blutrain_backend_cupy, "
               "blutrain.kernels); on the CPU the kernel itself, NumPy's arithmetic included (blutrain.tensor.cpu)",
    "allocation": "device memory (blutrain.alloc, CuPy's memory pool and array creation) and NumPy's empty/zeros",
    "launch": "CuPy's compiled kernel calls and CUDA library calls: argument packing and the launch (cupy.*, "
              "cupy_backends.*)",
    "compute": "NumPy / ml_dtypes functions called from elsewhere",
    "harness": "the benchmark's own loop and lambdas",
    "other": "anything else",
}

# (module prefix, category): the first prefix that equals the module or is a dotted parent of it wins.
MODULE_CATEGORIES: tuple[tuple[str, str], ...] = (
    ("blutrain.tensor.dispatch", "dispatch"),
    ("blutrain.tensor.kernel", "dispatch"),
    ("blutrain.tensor.cpu", "backend"),
    ("blutrain.tensor.tensor", "wrap"),
    ("blutrain.tensor.base", "wrap"),
    ("blutrain.tensor.views", "wrap"),
    ("blutrain.tensor", "checks"),
    ("blutrain.autograd", "autograd"),
    ("blutrain.alloc", "allocation"),
    ("blutrain.optim", "optimizer"),
    ("blutrain.kernels", "backend"),
    ("cupy.cuda.memory", "allocation"),
    ("cupy.cuda.memory_hook", "allocation"),
    ("cupy._creation", "allocation"),
    ("cupy", "launch"),
    ("cupyx", "launch"),
    ("cupy_backends", "launch"),
    ("numpy.empty", "allocation"),
    ("numpy.empty_like", "allocation"),
    ("numpy.zeros", "allocation"),
    ("numpy.zeros_like", "allocation"),
    ("numpy", "compute"),
    ("ml_dtypes", "compute"),
    ("bench", "harness"),
    ("bench_dispatch", "harness"),
    ("__main__", "harness"),
    ("_lsprof", "harness"),
)
# Plugin families by the prefix of their top-level package (one rule per family, not per plugin), then, within
# any plugin, modules by their last name: ``kernel(s)`` hold kernels, ``memory`` the allocator hook-up.
PLUGIN_PREFIXES: tuple[tuple[str, str], ...] = (("blutrain_kernels_", "backend"), ("blutrain_backend_", "backend"),
                                                ("blutrain_optim_", "optimizer"))
PLUGIN_MODULES: dict[str, str] = {"kernel": "backend", "kernels": "backend", "memory": "allocation"}

_CALLER = "caller"  # C functions of no package of interest: counted for their callers
_BUILTIN = re.compile(r"<built-in method ([\w.]+)>")
_METHOD = re.compile(r"<method '\w+' of '([\w.]+)' objects>")


def category_of_module(module: str) -> str:
    """The category of code living in ``module`` (a dotted module name)."""
    for prefix, category in MODULE_CATEGORIES:
        if module == prefix or module.startswith(prefix + "."):
            return category
    top, _, rest = module.partition(".")
    for prefix, category in PLUGIN_PREFIXES:
        if top.startswith(prefix):
            return PLUGIN_MODULES.get(rest.rsplit(".", 1)[-1], category)
    return "other"


def module_of_builtin(label: str) -> str | None:
    """The module a C function's cProfile label names (``<built-in method numpy.empty>`` → ``numpy.empty``,
    ``<method 'get' of 'cupy._core.core._ndarray_base' objects>`` → ``cupy._core.core``), or None for the
    interpreter's own (builtins, ``dict``, ``type``)."""
    m = _BUILTIN.fullmatch(label)
    if m:
        name = m.group(1)
        return None if name.startswith("builtins.") or "." not in name else name
    m = _METHOD.fullmatch(label)
    if m and "." in m.group(1):
        return m.group(1).rsplit(".", 1)[0]
    return None


def _module_files() -> dict[str, str]:
    files = {}
    for name, module in list(sys.modules.items()):
        path = getattr(module, "__file__", None)
        if path:
            files[os.path.realpath(path)] = name
    return files


Key = tuple[str, int, str]


@dataclass
class Breakdown:
    """One case's host time split by category (µs per call), and the functions that took the most."""

    shares: dict[str, float]
    python_calls_per_op: float
    top: list[tuple[str, str, float]] = field(default_factory=list)  # (function, category, share)

    def us(self, host_us: float) -> dict[str, float]:
        return {c: share * host_us for c, share in self.shares.items()}


class _Categorizer:
    def __init__(self, stats: dict[Key, Any]) -> None:
        self.stats = stats
        self.files = _module_files()
        self.memo: dict[Key, str] = {}

    def own(self, key: Key) -> str:
        """A function's category by its module, or ``caller`` for an interpreter built-in or the standard library."""
        path, _, name = key
        if path == "~":
            module = module_of_builtin(name)
            return _CALLER if module is None else category_of_module(module)
        module = self.files.get(os.path.realpath(path))
        if module is None:
            return _CALLER if path.startswith("<") else "other"
        if module.partition(".")[0] in sys.stdlib_module_names:  # weakref, contextlib, ...: the caller's work
            return _CALLER
        return category_of_module(module)

    def callers_split(self, key: Key, depth: int = 0) -> dict[str, float]:
        """Weights (summing to 1) of the categories a ``caller``-category function's time goes to."""
        callers = self.stats[key][4]
        total = sum(v[2] for v in callers.values())
        if not callers or total <= 0 or depth > 8:
            return {"other": 1.0}
        split: dict[str, float] = {}
        for caller, v in callers.items():
            cat = self.own(caller) if caller in self.stats else "other"
            parts = self.callers_split(caller, depth + 1) if cat == _CALLER else {cat: 1.0}
            for c, w in parts.items():
                split[c] = split.get(c, 0.0) + w * v[2] / total
        return split


def label(key: Key) -> str:
    path, line, name = key
    if path == "~":
        return name
    return f"{os.path.basename(path)}:{line}({name})"


def profile(call: Callable[[], Any], calls: int, synchronize: Callable[[], None]) -> Breakdown:
    """Run ``call`` ``calls`` times under cProfile and split the profiled own time by category (after one
    unprofiled call, so a first call's one-time work, such as filling the kernel table, is not counted)."""
    call()
    synchronize()
    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(calls):
        call()
    synchronize()
    profiler.disable()
    profiler.create_stats()
    stats: dict[Key, Any] = profiler.stats
    cat = _Categorizer(stats)
    per_category = dict.fromkeys(CATEGORIES, 0.0)
    per_function: dict[Key, tuple[str, float]] = {}
    for key, (_, _, tottime, _, _) in stats.items():
        own = cat.own(key)
        parts = cat.callers_split(key) if own == _CALLER else {own: 1.0}
        for c, w in parts.items():
            per_category[c] += tottime * w
        per_function[key] = (max(parts, key=lambda c: parts[c]), tottime)
    total = sum(per_category.values()) or 1.0
    python_calls = sum(v[1] for k, v in stats.items() if k[0] != "~")
    top = sorted(per_function.items(), key=lambda kv: -kv[1][1])[:8]
    return Breakdown(shares={c: t / total for c, t in per_category.items()},
                     python_calls_per_op=python_calls / calls,
                     top=[(label(k), c, t / total) for k, (c, t) in top])
