"""The README's example runs as printed, and its API section names everything ``__all__`` exports."""

from __future__ import annotations

import re
from pathlib import Path

import blutrain_logger_tensorboard as package

README = (Path(__file__).parent.parent / "README.md").read_text()


def test_readme_example_runs() -> None:
    (code,) = re.findall(r"```python\n(.*?)```", README, flags=re.S)
    exec(compile(code, "README.md", "exec"), {})


def test_readme_public_api_section_lists_every_exported_name() -> None:
    section = README.split("## Public API", 1)[1].split("\n## ", 1)[0]
    listed = set(re.findall(r"`([A-Za-z_][A-Za-z0-9_]*)", section))
    assert sorted(set(package.__all__) - listed) == []
