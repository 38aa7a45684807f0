"""``blutrain plugins``: every plugin found, where it came from, and what it registered per hook.

``blutrain plugins --check`` runs the kernel conformance suite (:mod:`blutrain.kernels.conformance`) on
every installed device backend, or on the one ``--device`` names, and prints pass or fail per op and
dtype with the plugin whose kernel ran; the exit status is 1 when any case fails.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import itertools
import json
import sys
from typing import Any

from blutrain.tensor import plugins

# Registry getters of the packages that define registry hooks; calling them fills the registries
# so that the listing shows what each plugin registered. Packages that are not installed are skipped.
_REGISTRIES = (
    ("blutrain.tensor.backend", "backends"),
    ("blutrain.tensor.kernel", "kernels"),
    ("blutrain.optim.registry", "optimizers"),
    ("blutrain.dist.registry", "comm_backends"),
    ("blutrain.dist.registry", "parallel_modes"),
    ("blutrain.compiler.registry", "passes"),
    ("blutrain.models.registry", "models"),
)


def add_command(sub: Any) -> None:
    p = sub.add_parser("plugins", help="list installed plugins and what they registered")
    p.add_argument("--json", action="store_true", help="print machine-readable JSON")
    p.add_argument("--check", action="store_true",
                   help="run the kernel conformance suite on every installed device backend: pass/fail per op "
                        "and dtype against the float64 references; exit status 1 on any failure")
    p.add_argument("--device", metavar="NAME", help="with --check: only this device (cpu, cuda, ...)")
    p.add_argument("--op", action="append", metavar="OP",
                   help="with --check: only this catalogue op (repeatable; default: every op)")
    p.add_argument("--examples", type=int, default=None, metavar="N",
                   help="with --check: hypothesis samples per op and dtype (default 8)")
    p.set_defaults(func=run)


def collect() -> list[dict[str, Any]]:
    for module, getter in _REGISTRIES:
        try:
            mod = importlib.import_module(module)
        except ImportError:
            continue
        getattr(mod, getter)()
    pm = plugins.get_plugin_manager()
    out = []
    for info in plugins.plugin_infos():
        plugin = pm.get_plugin(info.name)
        hooks = sorted(impl.name for impl in pm.get_hookcallers(plugin) or ()) if plugin is not None else []
        out.append({"name": info.name, "distribution": info.distribution, "version": info.version,
                    "source": info.source, "hooks": hooks, "registered": info.registered})
    return out


def run(args: argparse.Namespace) -> int:
    if args.check:
        return check(args)
    if args.device or args.op or args.examples is not None:
        print("blutrain plugins: --device, --op and --examples go with --check", file=sys.stderr)
        return 2
    found = collect()
    if args.json:
        print(json.dumps(found, indent=2))
        return 0
    blocked = sorted(plugins.disabled_plugins())
    print(f"{len(found)} plugins (entry-point group {plugins.ENTRY_POINT_GROUP!r})"
          + (f"; disabled: {', '.join(blocked)}" if blocked else ""))
    for p in found:
        dist = f"{p['distribution']} {p['version']}".strip() or "-"
        print(f"\n{p['name']}  [{p['source']}]  {dist}")
        for hook in p["hooks"]:
            names = p["registered"].get(hook)
            if names is None:
                print(f"  {hook}")
                continue
            shown = ", ".join(names[:12]) + (f", ... ({len(names)} in all)" if len(names) > 12 else "")
            print(f"  {hook}: {shown or 'nothing'}")
    return 0


def check(args: argparse.Namespace) -> int:
    """``--check``: the conformance suite per device; 0 when every case passed, 1 otherwise."""
    import blutrain.tensor as bt

    # the suite draws its inputs with hypothesis, an extra of blutrain-kernels
    if importlib.util.find_spec("blutrain.kernels") is None or importlib.util.find_spec("hypothesis") is None:
        print("blutrain plugins --check needs the conformance suite: pip install 'blutrain-kernels[conformance]'",
              file=sys.stderr)
        return 2
    from blutrain.kernels.catalogue import get_op
    from blutrain.kernels.conformance.suite import DEFAULT_EXAMPLES

    examples = DEFAULT_EXAMPLES if args.examples is None else args.examples
    if examples < 1:
        print(f"blutrain plugins: --examples must be at least 1, got {examples}", file=sys.stderr)
        return 2
    try:
        ops = [get_op(name).name for name in args.op] if args.op else None
    except KeyError as exc:
        print(f"blutrain plugins: {exc.args[0]}", file=sys.stderr)
        return 2
    names = [args.device] if args.device else bt.backends().names()
    failed = 0
    for name in names:
        dev = bt.device(name)  # an unknown name raises, listing the installed backends
        if not dev.backend.is_available():
            if args.device:
                print(f"blutrain plugins: device {name!r} is installed but not available on this machine",
                      file=sys.stderr)
                return 1
            print(f"device {dev}: skipped (installed, not available on this machine)")
            continue
        failed += _check_one(dev, ops, examples)
    return 1 if failed else 0


def _check_one(dev: Any, ops: list[str] | None, examples: int) -> int:
    """Print the verdicts of one device, one line per op as it completes; returns the number of failed cases."""
    from blutrain.kernels.catalogue import CATALOGUE
    from blutrain.kernels.conformance.suite import check_device

    print(f"device {dev}: conformance against the float64 references, {examples} samples per op and dtype",
          flush=True)
    counts = {"passed": 0, "failed": 0, "skipped": 0}
    width = max(len(op) for op in (ops or CATALOGUE))
    for op, group in itertools.groupby(check_device(dev, ops, examples), key=lambda r: r.op):
        results = list(group)
        for r in results:
            counts[r.status] += 1
        verdicts = "  ".join(f"{r.dtype} {'ok' if r.status == 'passed' else r.status.upper()}" for r in results)
        providers = ", ".join(sorted({r.provider for r in results}))
        print(f"  {op:<{width}}  {verdicts}  [{providers}]", flush=True)
        for r in results:
            if r.status != "passed":
                print(f"      {r.dtype}: {r.message}" + (f"\n      sample: {r.sample}" if r.sample else ""))
    print(f"device {dev}: {counts['passed']} passed, {counts['failed']} failed, {counts['skipped']} skipped")
    return counts["failed"]
