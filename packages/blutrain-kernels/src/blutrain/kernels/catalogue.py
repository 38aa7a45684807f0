"""The op catalogue (filled in by the tensor/autograd issue)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class OpInfo:
    name: str
    signature: str
    meaning: str


CATALOGUE: dict[str, OpInfo] = {}


def get_op(name: str) -> OpInfo:
    return CATALOGUE[name]
