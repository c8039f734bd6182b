"""Waiting for a runner's exit on a pidfd, with real processes and real signals."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import psutil
import pytest
import trio
import trio.testing

from tuneplane.agent.exit_wait import Waited, wait_exit

pytestmark = pytest.mark.skipif(
    not hasattr(os, "pidfd_open"), reason="needs os.pidfd_open (Linux 5.3 and Python 3.9 or later)"
)


def sleeper() -> subprocess.Popen[bytes]:
    return subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])


async def test_the_wait_ends_when_the_process_is_killed() -> None:
    proc = sleeper()
    try:
        start = psutil.Process(proc.pid).create_time()
        result: list[Waited] = []
        with trio.fail_after(30):
            async with trio.open_nursery() as nursery:

                async def wait() -> None:
                    result.append(await wait_exit(proc.pid, start, 3600))

                nursery.start_soon(wait)
                await trio.testing.wait_all_tasks_blocked()
                assert result == []
                os.kill(proc.pid, signal.SIGKILL)
        assert result == [Waited.EXITED]
    finally:
        proc.kill()
        proc.wait()


async def test_a_live_process_is_waited_on_until_the_limit() -> None:
    proc = sleeper()
    try:
        start = psutil.Process(proc.pid).create_time()
        with trio.fail_after(30):
            assert await wait_exit(proc.pid, start, 0.05) is Waited.TIMED_OUT
        assert proc.poll() is None
    finally:
        proc.kill()
        proc.wait()


async def test_a_pid_taken_by_another_process_is_not_waited_on() -> None:
    """The recorded start time is not this process's: the runner is gone and the pid reused."""
    proc = sleeper()
    try:
        start = psutil.Process(proc.pid).create_time()
        with trio.fail_after(30):
            assert await wait_exit(proc.pid, start - 3600, 3600) is Waited.EXITED
        assert proc.poll() is None  # nothing was done to the other process
    finally:
        proc.kill()
        proc.wait()


def finished_process() -> tuple[int, float]:
    """The pid and start time of a process that ran, exited and was reaped."""
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    start = psutil.Process(proc.pid).create_time()  # a zombie until reaped: still readable
    proc.wait()
    return proc.pid, start


async def test_a_process_already_gone_has_exited() -> None:
    pid, start = finished_process()
    with trio.fail_after(30):
        assert await wait_exit(pid, start, 3600) is Waited.EXITED
