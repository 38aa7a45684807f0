"""The README's examples run as printed, and its API section names everything ``__all__`` exports."""

from __future__ import annotations

import pytest

import blutrain.tensor as package
import blutrain.tensor.testing
from blutrain.tensor.testing import PackageReadme

README = PackageReadme.of_tests(__file__)


def test_readme_has_examples() -> None:
    assert len(README.examples) >= 2


@pytest.mark.parametrize("code", README.examples, ids=[f"example{i}" for i in range(len(README.examples))])
def test_readme_example_runs(code: str) -> None:
    README.run(code)


def test_readme_public_api_section_lists_every_exported_name() -> None:
    assert README.unlisted_exports(package, blutrain.tensor.testing) == []
