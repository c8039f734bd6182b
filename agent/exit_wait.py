"""Waiting for a runner to exit without polling: a pidfd turns readable when its process exits.

Rules: the pidfd is opened by pid and the process's identity (pid and start time) is checked
again after the open, so a pid reused between the observation and the open is never waited on.
Where no pidfd can be had (a kernel before Linux 5.3, or a Python without ``os.pidfd_open``),
:func:`wait_exit` says so and the caller polls as before. The pidfd is closed before returning.
"""

from __future__ import annotations

import os
from enum import Enum

import trio

from .supervision import is_alive


class Waited(Enum):
    EXITED = "exited"  # the process exited (or was already gone)
    TIMED_OUT = "timed-out"  # still running after the limit
    UNSUPPORTED = "unsupported"  # no pidfd here: poll instead


def _open_pidfd(pid: int) -> int | None:
    opener = getattr(os, "pidfd_open", None)
    if opener is None:
        return None
    try:
        return int(opener(pid))
    except ProcessLookupError:
        return -1
    except OSError:  # ENOSYS on an old kernel, EINVAL, EMFILE: poll instead
        return None


async def wait_exit(pid: int, start_time: float, limit_s: float) -> Waited:
    """Wait until process ``pid``, which started at ``start_time``, exits, at most ``limit_s``."""
    fd = _open_pidfd(pid)
    if fd is None:
        return Waited.UNSUPPORTED
    if fd < 0:
        return Waited.EXITED
    try:
        if not is_alive(pid, start_time):
            # Gone, a zombie, or another process that took the pid since it was observed.
            return Waited.EXITED
        with trio.move_on_after(limit_s):
            await trio.lowlevel.wait_readable(fd)
            return Waited.EXITED
        return Waited.TIMED_OUT
    finally:
        os.close(fd)
