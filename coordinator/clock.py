"""Wall-clock time as the store records it: Unix epoch milliseconds (UTC)."""

from __future__ import annotations

import time


def now_ms() -> int:
    """The current wall-clock time in epoch milliseconds."""
    return time.time_ns() // 1_000_000
