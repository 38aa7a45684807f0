"""The README's example runs as printed, and its API section names everything ``__all__`` exports."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

import blutrain.alloc as alloc
import blutrain.alloc.cupy as alloc_cupy
from blutrain.alloc import HostProvider


def test_readme_example_runs_and_returns_every_segment(capsys: pytest.CaptureFixture[str]) -> None:
    readme = (Path(__file__).parent.parent / "README.md").read_text()
    (code,) = re.findall(r"```python\n(.*?)```", readme, flags=re.S)
    namespace: dict[str, object] = {}
    exec(compile(code, "README.md", "exec"), namespace)
    assert "allocated_bytes" in capsys.readouterr().out
    provider = namespace["provider"]
    assert isinstance(provider, HostProvider)
    assert provider.used_bytes == 0


def test_readme_public_api_section_lists_every_exported_name() -> None:
    readme = (Path(__file__).parent.parent / "README.md").read_text()
    section = readme.split("## Public API", 1)[1].split("\n## ", 1)[0]
    listed = set(re.findall(r"`([A-Za-z_][A-Za-z0-9_]*)", section))
    assert sorted(set(alloc.__all__) - listed) == []
    assert sorted(set(alloc_cupy.__all__) - listed) == []
