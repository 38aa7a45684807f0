"""Fenced code blocks of the guides in docs/, with the marker comment before each (see test_docs.py)."""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
MARKER = re.compile(r"<!--\s*(not run|source|file):\s*(.*?)\s*-->")


@dataclass(frozen=True)
class Block:
    doc: str
    line: int  # of the opening fence, 1-based
    lang: str
    code: str
    marker: str  # "", "not run", "source" or "file"
    arg: str

    @property
    def id(self) -> str:
        return f"{self.doc}:{self.line}-{self.lang or 'plain'}" + (f"-{self.marker.replace(' ', '')}"
                                                                  if self.marker else "")


def read_blocks(doc: str) -> list[Block]:
    lines = (DOCS / doc).read_text().splitlines()
    out: list[Block] = []
    i = 0
    while i < len(lines):
        if not lines[i].startswith("```"):
            i += 1
            continue
        lang = lines[i][3:].strip()
        end = next(j for j in range(i + 1, len(lines)) if lines[j].startswith("```"))
        found = MARKER.fullmatch(lines[i - 1].strip()) if i > 0 else None
        marker, arg = (found.group(1), found.group(2)) if found else ("", "")
        out.append(Block(doc, i + 1, lang, "\n".join(lines[i + 1:end]) + "\n", marker, arg))
        i = end + 1
    return out
