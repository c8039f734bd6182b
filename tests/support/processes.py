"""What every process-starting test helper shares: a last-resort reaper and a polling wait.

Rules: a helper adds each child it starts with :func:`track` and drops it with :func:`untrack`
once it has stopped it; anything still tracked when the interpreter exits is killed, so a test
that forgot to stop a process never leaves it running.
"""

from __future__ import annotations

import atexit
import os
import signal
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

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


def kill_now(proc: subprocess.Popen[bytes]) -> None:
    """SIGKILL ``proc`` (unless it has exited) and reap it: the crash a daemon must survive."""
    untrack(proc)
    if proc.poll() is None:
        proc.kill()
    proc.wait()


FAKETIME_LIB = Path("/usr/lib/x86_64-linux-gnu/faketime/libfaketimeMT.so.1")


def faketime_env(offset: str, why: str) -> dict[str, str]:
    """The environment that runs a real process with its wall clock moved by ``offset``
    (libfaketime's syntax: ``+1d``, ``-1h``); monotonic time is left alone. Skips the test with
    a sentence naming ``why`` it needs libfaketime (fails under ``CI=true``) when it is missing."""
    if not FAKETIME_LIB.exists():
        message = (
            f"this test needs libfaketime ({FAKETIME_LIB}) {why}; install the distribution's "
            "faketime package"
        )
        if os.environ.get("CI") == "true":
            pytest.fail(message)
        pytest.skip(message)
    return dict(
        os.environ,
        LD_PRELOAD=str(FAKETIME_LIB),
        FAKETIME=offset,
        FAKETIME_DONT_FAKE_MONOTONIC="1",
    )


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
