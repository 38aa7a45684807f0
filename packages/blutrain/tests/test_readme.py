"""The README's example runs as printed, and its API section names everything the public modules export."""

from __future__ import annotations

from types import ModuleType

import pytest

import blutrain.models.gpt2
import blutrain.optim
import blutrain.train
from blutrain.tensor.testing import PackageReadme

README = PackageReadme.of_tests(__file__)


@pytest.mark.parametrize("code", README.examples, ids=[f"example{i}" for i in range(len(README.examples))])
def test_readme_example_runs(code: str) -> None:
    README.run(code)


@pytest.mark.parametrize("module", [blutrain.optim, blutrain.train], ids=lambda m: m.__name__)
def test_readme_public_api_section_lists_every_exported_name(module: ModuleType) -> None:
    assert README.unlisted_exports(module) == []


def test_readme_names_the_hook_specifications_it_defines() -> None:
    assert "`blutrain_register_optimizers(registry)`" in README.text
    assert "`blutrain_on_train_event(event, state)`" in README.text
