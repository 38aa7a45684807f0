"""A package's README.md as its documentation tests read it: every example runs as printed, and the "Public API"
section names everything the package exports."""

from __future__ import annotations

import re
from pathlib import Path
from types import ModuleType

_EXAMPLE = re.compile(r"```python\n(.*?)```", flags=re.S)
# a name as the README writes it: the start of a back-quoted span (`Tensor`, `zeros(shape)`, `Tensor.view`)
_LISTED_NAME = re.compile(r"`([A-Za-z_][A-Za-z0-9_]*)")


class PackageReadme:
    """The README at ``path``: its ```python examples, in order, and the names its "## Public API" section lists."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.text = path.read_text(encoding="utf-8")
        self.examples: list[str] = _EXAMPLE.findall(self.text)

    @classmethod
    def of_tests(cls, test_file: str) -> PackageReadme:
        """The README of the package whose ``tests/`` folder holds ``test_file`` (pass ``__file__``)."""
        return cls(Path(test_file).resolve().parent.parent / "README.md")

    def run(self, code: str) -> dict[str, object]:
        """Runs one example in a fresh namespace, as a reader pasting it would, and returns that namespace."""
        namespace: dict[str, object] = {}
        exec(compile(code, str(self.path), "exec"), namespace)
        return namespace

    def run_the_example(self) -> dict[str, object]:
        """Runs the README's one example (a README with none or several is an error: parametrize over ``examples``)."""
        if len(self.examples) != 1:
            raise AssertionError(f"{self.path} has {len(self.examples)} ```python examples, expected exactly one")
        return self.run(self.examples[0])

    def public_api_section(self) -> str:
        """The text under the "## Public API" heading, up to the next "## " heading."""
        if "## Public API" not in self.text:
            raise AssertionError(f"{self.path} has no '## Public API' section")
        return self.text.split("## Public API", 1)[1].split("\n## ", 1)[0]

    def unlisted_exports(self, *modules: ModuleType) -> list[str]:
        """The names in the modules' ``__all__`` that the Public API section does not name, sorted (none: ``[]``)."""
        listed = set(_LISTED_NAME.findall(self.public_api_section()))
        exported = {name for module in modules for name in module.__all__}
        return sorted(exported - listed)
