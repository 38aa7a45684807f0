"""The README's example runs as printed, and its API section names everything the public modules export."""

from __future__ import annotations

import re
from pathlib import Path
from types import ModuleType

import pytest

import blutrain.models.gpt2
import blutrain.optim
import blutrain.train

README = (Path(__file__).parent.parent / "README.md").read_text()
EXAMPLES = re.findall(r"```python\n(.*?)```", README, flags=re.S)


@pytest.mark.parametrize("code", EXAMPLES, ids=[f"example{i}" for i in range(len(EXAMPLES))])
def test_readme_example_runs(code: str) -> None:
    exec(compile(code, "README.md", "exec"), {})


@pytest.mark.parametrize("module", [blutrain.optim, blutrain.train], ids=lambda m: m.__name__)
def test_readme_public_api_section_lists_every_exported_name(module: ModuleType) -> None:
    section = README.split("## Public API", 1)[1].split("\n## ", 1)[0]
    listed = set(re.findall(r"`([A-Za-z_][A-Za-z0-9_]*)", section))
    assert sorted(set(module.__all__) - listed) == []


def test_readme_names_the_hook_specifications_it_defines() -> None:
    assert "`blutrain_register_optimizers(registry)`" in README
    assert "`blutrain_on_train_event(event, state)`" in README
