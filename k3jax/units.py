"""Byte sizes as people write them: "141GB", "95 GiB" in, "5.3 MiB" or "141.00 GB" out.

GB is decimal (10^9), as HBM sizes are quoted; GiB is binary (2^30). One table serves both
directions.
"""

from __future__ import annotations

import math
import re

_UNITS = {"B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
          "KiB": 2**10, "MiB": 2**20, "GiB": 2**30, "TiB": 2**40}
_BY_LOWER = {name.lower(): size for name, size in _UNITS.items()} | {"": 1}
_BINARY = ("B", "KiB", "MiB", "GiB", "TiB")


def parse_bytes(text: str) -> int:
    """'141GB' -> 141e9, '95 GiB' -> 95 * 2**30, '512' -> 512 (units case-insensitive)."""
    m = re.fullmatch(r"\s*([0-9.]+)\s*([a-zA-Z]*)\s*", text)
    if not m or m.group(2).lower() not in _BY_LOWER:
        raise ValueError(f"cannot read a byte size from {text!r}; write e.g. 141GB or 95GiB")
    return int(float(m.group(1)) * _BY_LOWER[m.group(2).lower()])


def format_bytes(n: float, unit: str | None = None) -> str:
    """`n` bytes in `unit` with two decimals ("141.00 GB": columns comparable at a glance), or by
    default in the largest binary unit that keeps the number >= 1, with one decimal ("5.3 MiB")."""
    if unit is not None:
        if unit not in _UNITS:
            raise ValueError(f"unit={unit!r}: expected one of {list(_UNITS)}")
        return f"{n / _UNITS[unit]:.2f} {unit}"
    if n < 1024:
        return f"{int(n)} B"
    exp = min(int(math.log(n, 1024)), len(_BINARY) - 1)
    return f"{n / 1024**exp:.1f} {_BINARY[exp]}"
