"""GPUs in Slurm's GRES text, as slurmrestd reports a node's ``gres`` and ``gres_used``.

Rules: pure. An entry is ``name[:type][:count][(detail)]`` (no count: one), entries are
separated by commas (``gpu:h100:8(S:0-1),nic:1``); only ``gpu`` entries count. Slurm writes
``(null)`` or an empty string for none. Text this cannot read is a ``ValueError`` naming it,
not a silent zero.
"""

from __future__ import annotations

import re

_NAME = re.compile(r"^[A-Za-z0-9_]+$")


def _entries(text: str) -> list[str]:
    # Commas also appear inside a detail such as "(IDX:0,2)": split only outside parentheses.
    entries, depth, current = [], 0, ""
    for char in text:
        if char == "," and depth == 0:
            entries.append(current)
            current = ""
            continue
        depth += {"(": 1, ")": -1}.get(char, 0)
        current += char
    entries.append(current)
    return [entry.strip() for entry in entries if entry.strip()]


def gpu_count(gres: str | None) -> int:
    """How many GPUs a GRES text names (every ``gpu`` entry, any type)."""
    if gres is None or gres.strip() in ("", "(null)", "N/A"):
        return 0
    total = 0
    for entry in _entries(gres):
        parts = entry.split("(", 1)[0].split(":")
        if not _NAME.match(parts[0]) or not all(parts[1:]):
            raise ValueError(f"cannot read the GRES entry {entry!r} in {gres!r}")
        if parts[0] != "gpu":
            continue
        # name, name:count, name:type or name:type:count; no count means one.
        total += int(parts[-1]) if len(parts) > 1 and parts[-1].isdigit() else 1
    return total
