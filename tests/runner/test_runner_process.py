"""``python -m tuneplane.runner`` run directly: refusals, its own session, its records, SIGTERM."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import psutil
import pytest
import trio

from tests.runner.members import (
    member_launch,
    prepared,
    python,
    wait_observation,
    wait_until,
    workload,
)
from tuneplane.agent.supervision import (
    START_TIME_TOLERANCE_S,
    Exited,
    Running,
    Vanished,
    observe,
)
from tuneplane.runner.exit_codes import (
    EXIT_BAD_MEMBER_FILE,
    EXIT_REFUSED,
    EXIT_STARTED,
    EXIT_USAGE,
)
from tuneplane.runner.records import read_exit_record, read_runner_record


def runner(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "tuneplane.runner", *args],
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
        stdin=subprocess.DEVNULL,
    )


def test_usage_and_a_missing_member_file_are_refused(tmp_path: Path) -> None:
    assert runner().returncode == EXIT_USAGE
    done = runner(str(tmp_path))
    assert done.returncode == EXIT_BAD_MEMBER_FILE
    assert f"{tmp_path / 'member.json'} does not exist" in done.stderr
    assert list(tmp_path.iterdir()) == []


def test_an_existing_claim_is_refused_and_nothing_is_touched(tmp_path: Path) -> None:
    member_dir = prepared(member_launch(tmp_path, [["/bin/true"]]))
    (member_dir / "launch.claim").write_text('{"pid": 1, "start_time": 0}')
    before = {
        p.name: (p.read_bytes(), p.stat().st_mtime_ns) for p in member_dir.iterdir() if p.is_file()
    }
    done = runner(str(member_dir))
    assert done.returncode == EXIT_REFUSED
    assert "is already claimed by runner pid 1" in done.stderr
    assert "start a new attempt instead" in done.stderr
    after = {
        p.name: (p.read_bytes(), p.stat().st_mtime_ns) for p in member_dir.iterdir() if p.is_file()
    }
    assert after == before


def test_the_runner_records_itself_and_its_groups_in_its_own_session(tmp_path: Path) -> None:
    script = workload(tmp_path, "w.py", "import time; time.sleep(60)")
    member_dir = prepared(member_launch(tmp_path, [python(script), python(script)]))
    try:
        assert runner(str(member_dir)).returncode == EXIT_STARTED
        record = read_runner_record(member_dir)
        assert record is not None
        me = psutil.Process(record.pid)
        assert me.create_time() == pytest.approx(record.start_time, abs=START_TIME_TOLERANCE_S)
        assert os.getsid(record.pid) == record.pid != os.getsid(0)
        assert [p.local_rank for p in record.processes] == [0, 1]
        for proc in record.processes:
            assert proc.pgid == proc.pid == os.getpgid(proc.pid)
            started = psutil.Process(proc.pid).create_time()
            assert started == pytest.approx(proc.start_time, abs=START_TIME_TOLERANCE_S)
            assert psutil.Process(proc.pid).ppid() == record.pid
        assert observe(member_dir) == Running(record.pid, record.start_time)
    finally:
        record = read_runner_record(member_dir)
        if record is not None:
            os.kill(record.pid, signal.SIGKILL)
            for proc in record.processes:
                os.killpg(proc.pgid, signal.SIGKILL)


async def test_sigterm_to_the_runner_reaches_the_workload(tmp_path: Path) -> None:
    source = """
    import os, signal, sys, time, pathlib
    def stop(signum, frame):
        pathlib.Path(os.environ["TUNEPLANE_OUT_DIR"], "got-sigterm").touch()
        sys.exit(0)
    signal.signal(signal.SIGTERM, stop)
    pathlib.Path(os.environ["TUNEPLANE_OUT_DIR"], "ready").touch()
    time.sleep(60)
    """
    script = workload(tmp_path, "polite.py", source)
    launch = member_launch(tmp_path, [python(script)])
    member_dir = prepared(launch)
    argv = [sys.executable, "-m", "tuneplane.runner", str(member_dir)]
    started = await trio.run_process(argv, stdin=subprocess.DEVNULL, check=False)
    assert started.returncode == EXIT_STARTED
    running = observe(member_dir)
    assert isinstance(running, Running)
    ready = launch.out_dir / "ready"
    await wait_until(ready.exists)
    os.kill(running.pid, signal.SIGTERM)
    result = await wait_observation(member_dir, Exited)
    assert (result.exit_code, result.signal) == (0, None)  # type: ignore[union-attr]
    assert (launch.out_dir / "got-sigterm").exists()
    record = read_exit_record(member_dir)
    assert record is not None
    assert record.stop_reason == "runner received SIGTERM"


def test_an_unreadable_claim_reads_as_vanished(tmp_path: Path) -> None:
    (tmp_path / "launch.claim").write_text("")
    result = observe(tmp_path)
    assert isinstance(result, Vanished)
    assert "launch.claim cannot be read as JSON" in result.reason
