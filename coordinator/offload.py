"""Heavy work off the event loop: a bounded pool of worker threads and one of worker processes.

Rules:
- At most :data:`DECODE_THREADS` threads work at once, whatever the number of callers
  (:func:`in_thread`): decoding a large body, grouping a Ship's points. 50 hostile callers wait
  their turn instead of making 50 threads.
- Work that would hold the interpreter for long single calls (reading a JobSpec of megabytes:
  JSON, base64, canonical JSON; text over :data:`PROCESS_TEXT_CHARS`) runs in at most
  :data:`HEAVY_PROCESSES` worker processes (:func:`in_process`); a worker thread would still
  stall the loop, as a C call keeps the interpreter lock for its whole length.
- Each limiter belongs to the event loop that first waits on it.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Callable, Iterator
from typing import TypeVar, TypeVarTuple

import anyio
import anyio.to_process
from anyio.lowlevel import RunVar

T = TypeVar("T")
Args = TypeVarTuple("Args")

# Worker threads decoding or checking bodies at once, and worker processes for the heaviest
# bodies: 50 hostile callers wait their turn instead of making 50 threads or processes.
DECODE_THREADS = 4
HEAVY_PROCESSES = 2
# Text (a JobSpec's JSON) longer than this is read in a worker process: a thread would hold the
# interpreter lock through each long C call (json, base64) of reading it.
PROCESS_TEXT_CHARS = 256 * 1024

# While a worker thread works on a large body, the interpreter hands its lock between threads
# every 0.5 ms instead of Python's 5 ms: a thread running Python code (betterproto decoding,
# grouping points) otherwise keeps the event loop waiting up to 5 ms each time the loop wants the
# lock back. Measured with the loop-lag bench: Ship of 5,000 points 10.5-12.6 ms median at 5 ms,
# 2.5-7.6 at 0.5 ms; Enroll 5.7-8.2 against 2.1-4.3. Only while such work is in flight: set for
# good, it cost 15-20% of admissions per second (157-170/s against 204-214/s, one in flight).
HEAVY_SWITCH_INTERVAL_S = 0.0005
_switching = {"heavy": 0, "saved": 0.0}

_THREADS: RunVar[anyio.CapacityLimiter] = RunVar("tuneplane_decode_threads")
_PROCESSES: RunVar[anyio.CapacityLimiter] = RunVar("tuneplane_heavy_processes")


def _limiter(var: RunVar[anyio.CapacityLimiter], tokens: int) -> anyio.CapacityLimiter:
    """The event loop's own limiter (a limiter belongs to the loop that first waits on it)."""
    try:
        return var.get()
    except LookupError:
        limiter = anyio.CapacityLimiter(tokens)
        var.set(limiter)
        return limiter


@contextlib.contextmanager
def _fast_switching() -> Iterator[None]:
    """:data:`HEAVY_SWITCH_INTERVAL_S` while at least one such block runs (event loop only)."""
    if _switching["heavy"] == 0:
        _switching["saved"] = sys.getswitchinterval()
        sys.setswitchinterval(HEAVY_SWITCH_INTERVAL_S)
    _switching["heavy"] += 1
    try:
        yield
    finally:
        _switching["heavy"] -= 1
        if _switching["heavy"] == 0:
            sys.setswitchinterval(_switching["saved"])


async def in_thread(func: Callable[[*Args], T], *args: *Args) -> T:
    """``func(*args)`` in one of at most :data:`DECODE_THREADS` worker threads, with the
    interpreter switching threads every :data:`HEAVY_SWITCH_INTERVAL_S` meanwhile."""
    with _fast_switching():
        return await anyio.to_thread.run_sync(
            func, *args, limiter=_limiter(_THREADS, DECODE_THREADS)
        )


async def in_process(func: Callable[[*Args], T], *args: *Args) -> T:
    """``func(*args)`` in one of at most :data:`HEAVY_PROCESSES` worker processes.

    ``func`` must be a module-level function; arguments and result are pickled, so pass bytes
    rather than big strings (a str is UTF-8 encoded on the event loop as it is pickled).
    """
    return await anyio.to_process.run_sync(
        func, *args, limiter=_limiter(_PROCESSES, HEAVY_PROCESSES)
    )
