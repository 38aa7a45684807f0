"""The README's example runs as printed, and its API section names everything ``__all__`` exports."""

from __future__ import annotations

import blutrain_optim_sgd as package
from blutrain.tensor.testing import PackageReadme

README = PackageReadme.of_tests(__file__)


def test_readme_example_runs() -> None:
    README.run_the_example()


def test_readme_public_api_section_lists_every_exported_name() -> None:
    assert README.unlisted_exports(package) == []
