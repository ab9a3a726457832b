"""Byte sizes as people write them: `parse_size("40GiB")`, `format_bytes(3.2e9)`."""

from __future__ import annotations

import math
import re

_UNITS = {"": 1, "b": 1, "k": 2**10, "kb": 10**3, "kib": 2**10, "m": 2**20, "mb": 10**6,
          "mib": 2**20, "g": 2**30, "gb": 10**9, "gib": 2**30, "t": 2**40, "tb": 10**12,
          "tib": 2**40}


def parse_size(text: str) -> float:
    """Bytes from "40GiB", "512MiB", "16GB", "1e9", "2G" (K/M/G/T alone are binary).

    Raises ValueError naming the text and the accepted units."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([A-Za-z]*)\s*", str(text))
    unit = m.group(2).lower() if m else None
    if not m or unit not in _UNITS:
        raise ValueError(f"invalid size {text!r}: expected a number of bytes with an optional "
                         f"unit, e.g. 40GiB, 512MiB, 16GB or 1e9 (units: B, KiB, MiB, GiB, TiB, "
                         f"KB, MB, GB, TB)")
    value = float(m.group(1)) * _UNITS[unit]
    if not value > 0 or not math.isfinite(value):
        raise ValueError(f"invalid size {text!r}: must be positive")
    return value


def format_bytes(n: float) -> str:
    """`n` bytes in binary units with two decimals: "1.50 GiB", "512.00 KiB", "12 B"."""
    for unit, size in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= size:
            return f"{n / size:.2f} {unit}"
    return f"{n:.0f} B"
