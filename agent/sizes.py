"""Sizes in bytes as people write them (node.toml's ``max_size = "50GiB"``) and read them.

Rules (pure): units of 1000 (KB, MB, GB, TB) and of 1024 (KiB, MiB, GiB, TiB) are both accepted
and mean what they say; a size is a whole number of bytes, never negative.
"""

from __future__ import annotations

import re


def human_bytes(n: int) -> str:
    """``n`` bytes for people: 0 B, 512 B, 1.5 KiB, 1.0 GiB."""
    size = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(size) < 1024 or unit == "TiB":
            return f"{int(size)} B" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    raise AssertionError("unreachable")


_UNITS = {"": 1, "b": 1, "k": 10**3, "kb": 10**3, "m": 10**6, "mb": 10**6, "g": 10**9,
          "gb": 10**9, "t": 10**12, "tb": 10**12, "kib": 2**10, "mib": 2**20, "gib": 2**30,
          "tib": 2**40}  # fmt: skip


def parse_size(value: int | str) -> int:
    """A size in bytes: an integer, or a string like ``"50GiB"``, ``"500 MB"``, ``"1048576"``.
    Raises ValueError with a sentence naming the accepted forms."""
    if isinstance(value, int) and not isinstance(value, bool):
        if value < 0:
            raise ValueError(f"{value} is negative; give a size of 0 bytes or more.")
        return value
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([A-Za-z]*)\s*", str(value))
    unit = match[2].lower() if match else ""
    if match is None or unit not in _UNITS:
        raise ValueError(
            f"{value!r} is not a size; give bytes (an integer) or a number with a unit: B, KB, "
            'MB, GB, TB (powers of 1000) or KiB, MiB, GiB, TiB (powers of 1024), e.g. "50GiB".'
        )
    return int(float(match[1]) * _UNITS[unit])
