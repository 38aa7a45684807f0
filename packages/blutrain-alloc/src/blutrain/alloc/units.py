"""Byte counts as people read them."""

from __future__ import annotations

__all__ = ["format_bytes"]

_UNITS = ("KiB", "MiB", "GiB", "TiB", "PiB")


def format_bytes(size: int) -> str:
    """``512`` -> ``"512 B"``, ``3 << 20`` -> ``"3.00 MiB"``: binary units, two decimals past bytes."""
    if size < 0:
        return "-" + format_bytes(-size)
    if size < 1024:
        return f"{size} B"
    value = size / 1024.0
    unit = 0
    while value >= 1024.0 and unit < len(_UNITS) - 1:
        value /= 1024.0
        unit += 1
    return f"{value:.2f} {_UNITS[unit]}"
