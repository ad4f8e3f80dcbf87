"""Byte counts as people write them (``4GiB``, ``512MB``) and read them back."""

from __future__ import annotations

import re
from typing import Annotated

_UNITS = {"": 1, "b": 1, "k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12}
_UNITS |= {"kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12}
_UNITS |= {"kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "tib": 1 << 40}


# a byte count: an int, whose command-line flag (config_flags) also takes units such as 4GiB
ByteSize = Annotated[int, "bytes"]


def parse_bytes(text: str) -> int:
    """Bytes of ``4GiB``, ``512MB``, ``1.5G``, ``4096`` (binary and decimal units, any case);
    ValueError for anything else or a negative amount."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:e[0-9]+)?)\s*([a-zA-Z]*)\s*", text)
    if m is None or m.group(2).lower() not in _UNITS:
        raise ValueError(f"not a byte size: {text!r} (e.g. 4GiB, 512MB, 1073741824)")
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])


def format_bytes(n: float) -> str:
    """``n`` bytes for people: ``4.40 GiB``, ``512.0 MiB``, ``12 B``."""
    for unit, size in (("TiB", 1 << 40), ("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if abs(n) >= size:
            return f"{n / size:.2f} {unit}" if unit in ("TiB", "GiB") else f"{n / size:.1f} {unit}"
    return f"{int(n)} B"
