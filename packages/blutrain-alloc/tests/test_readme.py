"""The README's example runs as printed."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

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
