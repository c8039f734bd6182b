"""A collector belongs to the agent that started it: one per member, and it dies with its parent.

Real processes: a real coordinator's telemetry gateway (refusing the test's credential, so the
collectors keep retrying), real `tuneplane-collector run` processes, real SIGKILL.
"""

from __future__ import annotations

import fcntl
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

from tests.support.coordinator import CoordinatorProcess, start_coordinator
from tests.support.processes import wait_until
from tuneplane.collector.service import EXIT_BUSY, LOCK_FILE


@pytest.fixture(scope="module")
def coord(tmp_path_factory: pytest.TempPathFactory) -> Iterator[CoordinatorProcess]:
    with start_coordinator(tmp_path_factory.mktemp("collector-process")) as c:
        yield c


def _argv(coord: CoordinatorProcess, root: Path) -> list[str]:
    (root / "telemetry").mkdir(parents=True, exist_ok=True)
    credential = root / "credential"
    credential.write_text("tpc_not-a-real-credential\n")
    return [
        sys.executable, "-m", "tuneplane.collector.cli", "run",
        "--telemetry-dir", str(root / "telemetry"), "--state-dir", str(root / "state"),
        "--gateway", coord.telemetry, "--ca", str(coord.ca_path),
        "--credential-file", str(credential),
        "--run-id", "run-000000000000", "--attempt", "1", "--member", "0",
    ]  # fmt: skip


def _gone(pid: int, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if psutil.Process(pid).status() == psutil.STATUS_ZOMBIE:
                return True
        except psutil.NoSuchProcess:
            return True
        time.sleep(0.05)
    return False


def _lock_held(lock: Path) -> bool:
    """True when another process holds the collector's lock (flock, as the collector takes it)."""
    try:
        fd = os.open(lock, os.O_RDWR)
    except FileNotFoundError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    finally:
        os.close(fd)  # closing releases a lock this test took itself
    return False


def test_a_second_collector_for_the_same_member_leaves_it_to_the_first(
    coord: CoordinatorProcess, tmp_path: Path
) -> None:
    argv = _argv(coord, tmp_path)
    lock = tmp_path / "state" / LOCK_FILE
    first = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_until("the first collector to hold its lock", lambda: _lock_held(lock), 20)
        second = subprocess.run(argv, capture_output=True, text=True, timeout=30, check=False)
        assert second.returncode == EXIT_BUSY, second.stderr
        assert "another collector serves this member" in second.stderr
        assert first.poll() is None, "the first collector must keep running"
    finally:
        first.kill()
        first.wait()
    # SIGKILL released the lock: a new collector may serve the member again.
    again = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        wait_until(
            "a collector after a crashed one to take the lock",
            lambda: again.poll() is not None or _lock_held(lock),
            20,
        )
        assert again.poll() is None, "a collector after a crashed one must be able to start"
    finally:
        again.kill()
        again.wait()


def test_a_collector_stops_when_the_agent_that_started_it_is_killed(
    coord: CoordinatorProcess, tmp_path: Path
) -> None:
    # The agent names itself (--agent-pid), as the real agent does, and is killed at once: a
    # collector still starting up when its agent dies must stop too (no wait hides that race).
    parent_code = (
        "import os, subprocess, sys, time\n"
        f"p = subprocess.Popen({_argv(coord, tmp_path)!r} + ['--agent-pid', str(os.getpid())])\n"
        "print(p.pid, flush=True)\n"
        "time.sleep(120)\n"
    )
    parent = subprocess.Popen(
        [sys.executable, "-c", parent_code], stdout=subprocess.PIPE, text=True
    )
    try:
        assert parent.stdout is not None
        child = int(parent.stdout.readline())
        assert psutil.pid_exists(child)
        parent.kill()
        parent.wait()
        assert _gone(child, 15), "an orphaned collector kept running after its agent died"
    finally:
        if parent.poll() is None:
            parent.kill()


def test_a_collector_outlives_the_thread_that_spawned_it(
    coord: CoordinatorProcess, tmp_path: Path
) -> None:
    # The agent spawns collectors from a worker thread that Trio later retires; only the death
    # of the agent process itself may stop them.
    argv = _argv(coord, tmp_path)
    parent_code = (
        "import subprocess, sys, threading, time\n"
        "box = []\n"
        f"t = threading.Thread(target=lambda: box.append(subprocess.Popen({argv!r})))\n"
        "t.start(); t.join()\n"
        "print(box[0].pid, flush=True)\n"
        "time.sleep(120)\n"
    )
    parent = subprocess.Popen(
        [sys.executable, "-c", parent_code], stdout=subprocess.PIPE, text=True
    )
    try:
        assert parent.stdout is not None
        child = int(parent.stdout.readline())
        assert not _gone(child, 3), "the collector stopped when its spawning thread ended"
        parent.kill()
        parent.wait()
        assert _gone(child, 15), "an orphaned collector kept running after its agent died"
    finally:
        if parent.poll() is None:
            parent.kill()


def test_a_collector_whose_agent_died_before_it_started_stops(
    coord: CoordinatorProcess, tmp_path: Path
) -> None:
    # The agent is SIGKILLed right after spawning the collector, before the collector has
    # imported enough to look at its parent: by then its parent is already init. It must still
    # see that the agent that named itself (--agent-pid) is not its parent, and stop, instead of
    # taking init for its agent and retrying forever.
    parent_code = (
        "import os, subprocess, sys\n"
        f"argv = {_argv(coord, tmp_path)!r} + ['--agent-pid', str(os.getpid())]\n"
        "p = subprocess.Popen(argv)\n"
        "print(p.pid, flush=True)\n"
        "os.kill(os.getpid(), 9)\n"
    )
    parent = subprocess.Popen(
        [sys.executable, "-c", parent_code], stdout=subprocess.PIPE, text=True
    )
    assert parent.stdout is not None
    child = int(parent.stdout.readline())
    parent.wait()
    assert _gone(child, 20), "a collector orphaned before it started kept running"
