"""``blutrain plugins``: every plugin found, where it came from, and what it registered per hook."""

from __future__ import annotations

import argparse
import importlib
import json
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
)


def add_command(sub: Any) -> None:
    p = sub.add_parser("plugins", help="list installed plugins and what they registered")
    p.add_argument("--json", action="store_true", help="print machine-readable JSON")
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
