"""Each component installs on its own, and third-party plugins are found, listed and blockable.

These tests build real wheels (``uv build --all-packages``) and install them into fresh virtual
environments, so they prove what a user gets from ``pip install``, not what the workspace happens
to have on its path.
"""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest
from venvs import MEMBERS, UV, install, make_venv, run, uninstall, wheel_of

pytestmark = [pytest.mark.slow, pytest.mark.skipif(UV is None, reason="uv is not on PATH")]

# the wheels are conftest.py's session fixture `wheels`, built once for this file and test_new_user.py


def test_every_package_and_plugin_builds_one_wheel(wheels: Path) -> None:
    built = sorted(w.name.split("-")[0].replace("_", "-") for w in wheels.glob("*.whl"))
    assert built == MEMBERS


@pytest.mark.parametrize(("dist", "module"), [("blutrain-tensor", "blutrain.tensor"),
                                              ("blutrain-alloc", "blutrain.alloc")])
def test_component_installs_and_imports_alone(wheels: Path, tmp_path: Path, dist: str, module: str) -> None:
    python = make_venv(tmp_path / "venv")
    install(python, wheel_of(wheels, dist))
    listing = run(UV, "pip", "list", "--python", python).stdout  # type: ignore[arg-type]
    others = [m for m in MEMBERS if m != dist and f"\n{m} " in "\n" + listing]
    assert others == [], f"{dist} pulled in other BluTrain packages: {others}"
    probe = {
        "blutrain.tensor": "import blutrain.tensor as bt; print((bt.ones(2, 3) * 2).sum().item())",
        "blutrain.alloc": "import blutrain.alloc as ba; print(ba.__name__)",
    }[module]
    out = run(python, "-c", probe).stdout.strip()
    assert out == ("12.0" if module == "blutrain.tensor" else "blutrain.alloc")


def _write_plugin(root: Path, name: str, body: str) -> Path:
    pkg = root / name
    (pkg / "src" / name).mkdir(parents=True)
    (pkg / "pyproject.toml").write_text(textwrap.dedent(f"""
        [project]
        name = "{name.replace('_', '-')}"
        version = "3.1.4"
        dependencies = []
        [project.entry-points.blutrain]
        {name} = "{name}"
        [build-system]
        requires = ["hatchling"]
        build-backend = "hatchling.build"
        [tool.hatch.build.targets.wheel]
        packages = ["src/{name}"]
    """))
    (pkg / "src" / name / "__init__.py").write_text(textwrap.dedent(body))
    return pkg


LION = """
    from blutrain.optim import Optimizer
    from blutrain.tensor.plugins import hookimpl

    class Lion(Optimizer):  # the protocol's members (the registry refuses a class without them); no update here
        def __init__(self, params, lr=1e-4):
            super().__init__(params, {"lr": lr})

    @hookimpl
    def blutrain_register_optimizers(registry):
        registry.register("lion", Lion)
"""


@pytest.fixture(scope="module")
def framework_venv(wheels: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("framework")
    python = make_venv(root / "venv")
    install(python, *sorted(wheels.glob("*.whl")))
    return python


def test_third_party_optimizer_plugin_is_listed_registered_and_blockable(framework_venv: Path,
                                                                         tmp_path: Path) -> None:
    python = framework_venv
    install(python, _write_plugin(tmp_path, "lion_opt", LION))
    blutrain = python.parent / "blutrain"
    listing = run(blutrain, "plugins").stdout
    assert "lion_opt  [entry point]  lion-opt 3.1.4" in listing
    assert "blutrain_register_optimizers: lion" in listing
    probe = "from blutrain.optim import optimizers; print(optimizers().get('lion').__name__)"
    assert run(python, "-c", probe).stdout.strip() == "Lion"

    blocked = {"BLUTRAIN_DISABLE_PLUGINS": "lion_opt"}
    blocked_listing = run(blutrain, "plugins", env=blocked).stdout
    assert "lion_opt  [entry point]" not in blocked_listing
    assert "disabled: lion_opt" in blocked_listing
    gone = run(python, "-c", probe, env=blocked, check=False)
    assert gone.returncode != 0
    assert "no optimizer 'lion'; installed: adamw (blutrain-optim-adamw 0.1.0)" in gone.stderr
    uninstall(python, "lion-opt")


@pytest.mark.parametrize(("name", "body", "expected"), [
    ("typo_hook", """
        from blutrain.tensor.plugins import hookimpl

        @hookimpl
        def blutrain_register_optimisers(registry):
            pass
     """, "plugin 'typo_hook' (typo-hook 3.1.4) implements unknown hook 'blutrain_register_optimisers'"),
    ("typo_args", """
        from blutrain.tensor.plugins import hookimpl

        @hookimpl
        def blutrain_register_optimizers(reg):
            pass
     """, "plugin 'typo_args' (typo-args 3.1.4) is invalid"),
])
def test_plugin_with_hook_typo_fails_at_load_naming_the_plugin(framework_venv: Path, tmp_path: Path, name: str,
                                                               body: str, expected: str) -> None:
    python = framework_venv
    install(python, _write_plugin(tmp_path, name, body))
    try:
        proc = run(python.parent / "blutrain", "plugins", check=False)
        assert proc.returncode != 0
        assert expected in proc.stderr
    finally:
        uninstall(python, name.replace("_", "-"))
