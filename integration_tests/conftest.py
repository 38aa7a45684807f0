"""Fixtures shared by the integration tests."""

from __future__ import annotations

from pathlib import Path

import pytest
from venvs import UV, build_wheels


@pytest.fixture(scope="session")
def wheels(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Every package and plugin of the workspace built as a wheel, once per test session."""
    if UV is None:
        pytest.skip("uv is not on PATH")
    return build_wheels(tmp_path_factory.mktemp("wheels"))
