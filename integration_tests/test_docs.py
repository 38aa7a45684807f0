"""The guides in docs/ run as printed.

Every fenced code block of docs/user-guide.md, docs/plugin-guide.md and docs/architecture.md is one test:

- ```python blocks are executed, each in a fresh namespace, in a temporary working directory;
- ```bash blocks are run by bash (``-e -o pipefail``) with this environment's ``bin`` first on PATH, so
  ``blutrain`` and ``python`` are the ones under test; the blocks of one guide run in order in one temporary
  directory, as a reader would type them;
- ```toml blocks must parse.

An HTML comment on the line before a fence changes that: ``<!-- not run: REASON -->`` (a GPU, a cluster, a
download; the reason is required), ``<!-- source: PATH -->`` (the block must equal the repository file at
PATH, so a walkthrough cannot drift from the code it explains), ``<!-- file: PATH -->`` (a file of a worked
example: TOML must parse; Python is imported as a module and, when it defines hook functions, registered as a
plugin and loaded; integration_tests/test_new_user.py installs these files for real).
"""

from __future__ import annotations

import os
import subprocess
import sys
import tomllib
from pathlib import Path
from types import SimpleNamespace

import pytest
from doc_blocks import DOCS, ROOT, Block, read_blocks

from blutrain.tensor import plugins
from blutrain.tensor.testing import plugin_registered

GUIDES = ("user-guide.md", "plugin-guide.md", "architecture.md")
RUNNABLE = ("python", "bash", "toml")


BLOCKS = [b for doc in GUIDES for b in read_blocks(doc)]


def _params(select: str) -> list[object]:
    return [pytest.param(b, id=b.id) for b in BLOCKS if (b.marker, b.lang) == ("", select)]


def test_every_guide_has_blocks_and_every_block_is_run_or_says_why_not() -> None:
    for doc in ("user-guide.md", "plugin-guide.md"):
        assert any(b.doc == doc and not b.marker and b.lang == "python" for b in BLOCKS), doc
    for b in BLOCKS:
        assert b.lang, f"{b.id}: give the block a language"
        if b.marker == "not run":
            assert len(b.arg) > 8, f"{b.id}: say why the block is not run"
        elif not b.marker:
            assert b.lang in RUNNABLE, f"{b.id}: a {b.lang} block is not run; mark it <!-- not run: why -->"


@pytest.mark.parametrize("block", _params("python"))
def test_python_block_runs(block: Block, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    exec(compile(block.code, f"{block.doc}:{block.line}", "exec"), {"__name__": "docs_example"})


def _shell(block: Block, cwd: Path) -> None:
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"}
    env.pop("BLUTRAIN_DISABLE_PLUGINS", None)
    proc = subprocess.run(["bash", "-e", "-o", "pipefail", "-c", block.code], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, f"{block.id} failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}"


@pytest.fixture(scope="module")
def shells(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, set[int]]]:
    """Per guide: the one directory its shell blocks run in, and the lines of the blocks that ran there."""
    return {doc: (tmp_path_factory.mktemp(doc.replace(".md", "")), set()) for doc in GUIDES}


@pytest.mark.parametrize("block", _params("bash"))
def test_bash_block_runs(block: Block, shells: dict[str, tuple[Path, set[int]]]) -> None:
    # A guide's shell blocks run in order in one directory, as a reader types them (a later block may use
    # a file an earlier one wrote); a block selected alone first runs the blocks before it.
    cwd, done = shells[block.doc]
    for earlier in (b for b in BLOCKS if b.doc == block.doc and (b.marker, b.lang) == ("", "bash")
                    and b.line < block.line and b.line not in done):
        _shell(earlier, cwd)
        done.add(earlier.line)
    _shell(block, cwd)
    done.add(block.line)


@pytest.mark.parametrize("block", _params("toml") + [pytest.param(b, id=b.id) for b in BLOCKS
                                                      if b.marker == "file" and b.lang == "toml"])
def test_toml_block_parses(block: Block) -> None:
    tomllib.loads(block.code)


@pytest.mark.parametrize("block", [pytest.param(b, id=b.id) for b in BLOCKS if b.marker == "source"])
def test_source_block_is_the_repository_file(block: Block) -> None:
    assert block.code == (ROOT / block.arg).read_text(), f"{block.id} differs from {block.arg}"


@pytest.mark.parametrize("block", [pytest.param(b, id=b.id) for b in BLOCKS
                                   if b.marker == "file" and b.lang == "python"])
def test_plugin_module_block_imports_and_registers(block: Block) -> None:
    namespace: dict[str, object] = {"__name__": Path(block.arg).parent.name}
    exec(compile(block.code, f"{block.doc}:{block.line}", "exec"), namespace)
    hooks = {k: v for k, v in namespace.items() if k.startswith("blutrain_") and callable(v)}
    assert hooks, f"{block.id} defines no hook function"
    name = f"docs-{Path(block.arg).parent.name}"
    with plugin_registered(SimpleNamespace(**hooks), name):
        from blutrain.cli.plugins_command import collect

        (found,) = [p for p in collect() if p["name"] == name]
        assert found["hooks"] == sorted(hooks) and all(found["registered"].get(h) for h in hooks), found


def test_the_plugin_guide_gives_the_contract_of_every_hook_specification() -> None:
    guide = (DOCS / "plugin-guide.md").read_text()
    for hook in plugins.hook_names():
        assert f"**`{hook}(" in guide, f"docs/plugin-guide.md has no contract paragraph for {hook}"
        assert f"| `{hook}(" in guide, f"docs/plugin-guide.md's hook table lacks {hook}"


def test_the_architecture_page_lists_every_hook_and_every_distribution() -> None:
    page = (DOCS / "architecture.md").read_text()
    for hook in plugins.hook_names():
        assert f"`{hook}(" in page, hook
    members = sorted(p.name for d in ("packages", "plugins") for p in (ROOT / d).iterdir()
                     if (p / "pyproject.toml").exists())
    missing = [m for m in members if m not in page]
    assert missing == [], f"docs/architecture.md does not mention {missing}"
