"""Every package and plugin README says what a user needs: how to install it, an example, its public API,
and the hook specifications it defines or implements.

The examples themselves run in each package's own ``tests/test_readme.py``; this test checks that every
member has one, and reads the hooks from the member's ``pyproject.toml`` (its ``blutrain.hookspecs`` and
``blutrain`` entry points), so a README cannot miss a hook that its package gains.
"""

from __future__ import annotations

import importlib
import tomllib
from pathlib import Path

import pytest

from blutrain.tensor import plugins

ROOT = Path(__file__).resolve().parents[1]
MEMBERS = sorted(p for d in ("packages", "plugins") for p in (ROOT / d).iterdir() if (p / "pyproject.toml").exists())


def _hooks_of(module_name: str) -> set[str]:
    module = importlib.import_module(module_name)
    return {name for name in dir(module) if name.startswith("blutrain_") and callable(getattr(module, name))}


def hooks(member: Path) -> tuple[set[str], set[str]]:
    """(hooks the member defines, hooks its plugins implement)."""
    project = tomllib.loads((member / "pyproject.toml").read_text())["project"]
    groups = project.get("entry-points", {})
    defined = set().union(*(_hooks_of(m) for m in groups.get("blutrain.hookspecs", {}).values()))
    implemented = set().union(*(_hooks_of(m) for m in groups.get("blutrain", {}).values()))
    if project["name"] == "blutrain-tensor":  # its built-in plugins are registered without entry points
        implemented |= set().union(*(_hooks_of(m) for _, m in plugins.BUILTIN_PLUGINS))
    return defined, implemented


@pytest.mark.parametrize("member", MEMBERS, ids=[m.name for m in MEMBERS])
def test_readme_has_install_example_api_and_hooks(member: Path) -> None:
    readme = (member / "README.md").read_text()
    assert f"pip install {member.name}" in readme or f'pip install "{member.name}[' in readme \
        or f"pip install '{member.name}[" in readme, f"{member.name}: no `pip install {member.name}` line"
    assert "```python\n" in readme, f"{member.name}: no Python example"
    assert "## Public API" in readme, f"{member.name}: no '## Public API' section"
    assert (member / "tests" / "test_readme.py").exists(), f"{member.name}: its README example is not tested"
    defined, implemented = hooks(member)
    missing = sorted(h for h in defined | implemented if h not in readme)
    assert missing == [], f"{member.name}'s README does not name the hooks it defines or implements: {missing}"
    if not defined and not implemented:
        assert "no hook" in readme.lower(), f"{member.name}: say that it defines and implements no hook"


def test_every_hook_specification_is_defined_by_one_member() -> None:
    defined = [h for m in MEMBERS for h in hooks(m)[0]]
    assert sorted(defined) == sorted(set(defined)) == plugins.hook_names()
