"""What every process-starting test helper shares: a last-resort reaper and a polling wait.

Rules: a helper adds each child it starts with :func:`track` and drops it with :func:`untrack`
once it has stopped it; anything still tracked when the interpreter exits is killed, so a test
that forgot to stop a process never leaves it running.
"""

from __future__ import annotations

import atexit
import signal
import subprocess
import time
from collections.abc import Callable
from typing import Any

_LIVE: set[subprocess.Popen[bytes]] = set()


@atexit.register
def _reap_all() -> None:
    for proc in list(_LIVE):
        if proc.poll() is None:
            proc.kill()
        proc.wait()
    _LIVE.clear()


def track(proc: subprocess.Popen[bytes]) -> None:
    _LIVE.add(proc)


def untrack(proc: subprocess.Popen[bytes]) -> None:
    _LIVE.discard(proc)


def wait_until(what: str, check: Callable[[], Any], timeout: float = 30.0) -> Any:
    """Poll ``check()`` until it returns something truthy; fail naming ``what`` on timeout."""
    deadline = time.monotonic() + timeout
    while True:
        value = check()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:g} s waiting for {what}")
        time.sleep(0.05)


def stop_cleanly(
    proc: subprocess.Popen[bytes], what: str, read_log: Callable[[], str], timeout: float
) -> None:
    """SIGTERM ``proc``, wait, and assert it stopped cleanly (exit status 0) within ``timeout``."""
    untrack(proc)
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
            raise AssertionError(
                f"the {what} ignored SIGTERM for {timeout:g} s:\n{read_log()}"
            ) from None
    assert proc.returncode == 0, f"the {what} exited with {proc.returncode}:\n{read_log()}"
