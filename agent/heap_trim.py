"""Hand the C heap's free pages back to the kernel while the agent idles.

Rules:
- Python hands what it frees of its larger objects (over 512 bytes: dicts, code, long strings)
  back to glibc's heap, which returns to the kernel only what lies at the heap's top. After a
  burst of work (the start, a member's launch and end) the free pages in its middle stay
  resident: about 2.4 MiB of an idle agent's RSS after 100 members (issue 13, goal 4).
  ``malloc_trim(0)`` returns them.
- Once every :data:`TRIM_INTERVAL_S`, not every second: one call walks the heap's free chunks
  (about a millisecond when there is much to return, 10 us when there is not) and does not
  grow with the journal.
- Where the C library has no ``malloc_trim`` (musl), nothing is done.
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable

import trio

#: Seconds between two trims.
TRIM_INTERVAL_S = 60.0


def malloc_trim() -> Callable[[int], int] | None:
    """The C library's ``malloc_trim``, or None where it has none."""
    trim: Callable[[int], int] | None = getattr(ctypes.CDLL(None), "malloc_trim", None)
    return trim


async def trim_heap_loop(interval_s: float = TRIM_INTERVAL_S) -> None:
    """Trim the heap every ``interval_s`` for as long as it runs (returns at once without
    ``malloc_trim``)."""
    await trim_every(interval_s, malloc_trim())


async def trim_every(interval_s: float, trim: Callable[[int], int] | None) -> None:
    """Call ``trim(0)`` every ``interval_s``, the first time one interval after the start;
    return at once when there is no ``trim``."""
    if trim is None:
        return
    while True:
        await trio.sleep(interval_s)
        trim(0)
