"""Supervision against real runners: real processes, real signals, real files."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import zipfile
from pathlib import Path

import attrs
import psutil
import pytest
import trio

import tuneplane.report
from tests.runner.members import (
    WAIT_FOR_RELEASE,
    member_launch,
    prepared,
    process_group_specs,
    python,
    wait_observation,
    wait_until,
    workload,
)
from tuneplane.agent.runner_pyz import RUNNER_PYZ, capsule_dir
from tuneplane.agent.supervision import (
    Exited,
    LaunchAlreadyClaimed,
    LaunchSpecError,
    NotStarted,
    RunnerStartFailed,
    Running,
    Vanished,
    cancel,
    observe,
    start_runner,
    write_launch,
)
from tuneplane.runner.member_file import read_member_file
from tuneplane.runner.records import read_exit_record, read_runner_record


async def run_to_exit(tmp_path: Path, source: str, grace_period_s: int = 5) -> Exited:
    script = workload(tmp_path, "w.py", source)
    member_dir = prepared(member_launch(tmp_path, [python(script)], grace_period_s=grace_period_s))
    await start_runner(member_dir)
    result = await wait_observation(member_dir, Exited)
    assert isinstance(result, Exited)
    return result


async def test_a_member_that_exits_0_is_recorded_as_0(tmp_path: Path) -> None:
    before = time.time()
    result = await run_to_exit(tmp_path, "print('hello from the workload')")
    assert (result.exit_code, result.signal) == (0, None)
    assert result.finished_at >= before
    stdout = (tmp_path / "members" / "r-1.1.0" / "stdout.log").read_text()
    assert "hello from the workload" in stdout


async def test_exit_code_3_is_recorded(tmp_path: Path) -> None:
    result = await run_to_exit(tmp_path, "import sys; sys.exit(3)")
    assert (result.exit_code, result.signal) == (3, None)


async def test_death_by_signal_is_recorded_as_the_signal(tmp_path: Path) -> None:
    result = await run_to_exit(tmp_path, "import os, signal; os.kill(os.getpid(), signal.SIGKILL)")
    assert (result.exit_code, result.signal) == (None, signal.SIGKILL)


async def test_a_second_start_refuses_itself_and_the_first_keeps_running(tmp_path: Path) -> None:
    script = workload(tmp_path, "w.py", WAIT_FOR_RELEASE)
    launch = member_launch(tmp_path, [python(script)])
    member_dir = prepared(launch)
    first = await start_runner(member_dir)
    assert isinstance(first, Running)
    files_before = {p.name: p.read_bytes() for p in member_dir.iterdir() if p.is_file()}

    with pytest.raises(LaunchAlreadyClaimed, match="already claimed by runner pid"):
        await start_runner(member_dir)
    with pytest.raises(LaunchAlreadyClaimed, match=r"member\.json can no longer change"):
        write_launch(launch)

    assert observe(member_dir) == first
    files_after = {p.name: p.read_bytes() for p in member_dir.iterdir() if p.is_file()}
    assert files_after == files_before
    (launch.out_dir / "release").touch()
    result = await wait_observation(member_dir, Exited)
    assert result == Exited(0, None, result.finished_at)  # type: ignore[union-attr]


async def test_one_failing_process_stops_its_sibling_and_sets_the_result(tmp_path: Path) -> None:
    fails = workload(tmp_path, "fails.py", "import time, sys; time.sleep(0.3); sys.exit(5)")
    sleeps = workload(tmp_path, "sleeps.py", "import time; time.sleep(60)")
    member_dir = prepared(member_launch(tmp_path, [python(sleeps), python(fails)]))
    await start_runner(member_dir)
    result = await wait_observation(member_dir, Exited)
    assert isinstance(result, Exited)
    assert (result.exit_code, result.signal) == (5, None)
    record = read_exit_record(member_dir)
    assert record is not None
    assert record.stop_reason == "local rank 1 failed"
    by_rank = {p.local_rank: (p.exit_code, p.signal) for p in record.processes}
    assert by_rank == {0: (None, signal.SIGTERM), 1: (5, None)}


async def test_cancel_kills_a_workload_that_ignores_sigterm_after_the_grace(
    tmp_path: Path,
) -> None:
    source = (
        "import signal, time, pathlib, os\n"
        "signal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
        "pathlib.Path(os.environ['TUNEPLANE_OUT_DIR'], 'ready').touch()\n"
        "time.sleep(60)\n"
    )
    script = workload(tmp_path, "stubborn.py", source)
    launch = member_launch(tmp_path, [python(script)], grace_period_s=1)
    member_dir = prepared(launch)
    await start_runner(member_dir)
    await wait_until(lambda: (launch.out_dir / "ready").exists())
    started = time.monotonic()
    await cancel(member_dir, grace_period_s=1)
    took = time.monotonic() - started
    result = observe(member_dir)
    assert isinstance(result, Exited)
    assert (result.exit_code, result.signal) == (None, signal.SIGKILL)
    assert took >= 1.0
    record = read_exit_record(member_dir)
    assert record is not None
    assert record.stop_reason == "runner received SIGTERM"
    # Cancelling again finds the member exited and changes nothing.
    await cancel(member_dir, grace_period_s=1)
    assert observe(member_dir) == result


async def test_cancel_stops_a_cooperative_workload_with_sigterm(tmp_path: Path) -> None:
    script = workload(tmp_path, "w.py", WAIT_FOR_RELEASE)
    member_dir = prepared(member_launch(tmp_path, [python(script)], grace_period_s=30))
    await start_runner(member_dir)
    started = time.monotonic()
    await cancel(member_dir, grace_period_s=30)
    assert time.monotonic() - started < 10
    result = observe(member_dir)
    assert isinstance(result, Exited)
    assert result.signal == signal.SIGTERM


async def test_cancel_signals_the_process_groups_when_the_runner_is_gone(tmp_path: Path) -> None:
    script = workload(tmp_path, "w.py", "import time; time.sleep(60)")
    member_dir = prepared(member_launch(tmp_path, [python(script)]))
    running = await start_runner(member_dir)
    assert isinstance(running, Running)
    os.kill(running.pid, signal.SIGKILL)
    vanished = await wait_observation(member_dir, Vanished)
    assert "left no exit.json" in vanished.reason  # type: ignore[union-attr]
    record = read_runner_record(member_dir)
    assert record is not None
    (proc,) = record.processes
    assert psutil.pid_exists(proc.pid)

    await cancel(member_dir, grace_period_s=2)

    def gone() -> bool:
        try:
            return psutil.Process(proc.pid).status() == psutil.STATUS_ZOMBIE
        except psutil.NoSuchProcess:
            return True

    await wait_until(gone, 5)


STARTER = """
import sys
from pathlib import Path

import trio

from tuneplane.agent.supervision import start_runner

observation = trio.run(start_runner, Path(sys.argv[1]))
Path(sys.argv[2]).write_text(type(observation).__name__)
trio.run(trio.sleep_forever)
"""


async def test_the_runner_survives_the_death_of_the_process_that_started_it(
    tmp_path: Path,
) -> None:
    script = workload(tmp_path, "w.py", WAIT_FOR_RELEASE)
    launch = member_launch(tmp_path, [python(script)])
    member_dir = prepared(launch)
    starter = workload(tmp_path, "starter.py", STARTER)
    said = tmp_path / "starter-saw"
    agent = await trio.lowlevel.open_process(
        [sys.executable, str(starter), str(member_dir), str(said)]
    )
    try:
        await wait_until(said.exists)
        assert said.read_text() == "Running"
    finally:
        agent.kill()
        await agent.wait()
    assert agent.returncode == -signal.SIGKILL

    running = observe(member_dir)
    assert isinstance(running, Running)
    assert psutil.Process(running.pid).ppid() != agent.pid
    (launch.out_dir / "release").touch()
    result = await wait_observation(member_dir, Exited)
    assert (result.exit_code, result.signal) == (0, None)  # type: ignore[union-attr]


def test_a_reused_pid_or_a_zombie_is_not_running(tmp_path: Path) -> None:
    member_dir = tmp_path / "m"
    member_dir.mkdir()
    me = psutil.Process()

    def fake_runner(pid: int, start_time: float) -> None:
        record = {"pid": pid, "start_time": start_time, "processes": []}
        (member_dir / "runner.json").write_text(json.dumps(record))

    assert observe(member_dir) == NotStarted()
    fake_runner(me.pid, me.create_time())
    assert observe(member_dir) == Running(me.pid, me.create_time())
    fake_runner(me.pid, me.create_time() - 3600)
    result = observe(member_dir)
    assert isinstance(result, Vanished)
    assert f"runner pid {me.pid}" in result.reason

    zombie = subprocess.Popen([sys.executable, "-c", "pass"])
    try:
        started = psutil.Process(zombie.pid).create_time()
        deadline = time.monotonic() + 10
        while psutil.Process(zombie.pid).status() != psutil.STATUS_ZOMBIE:
            assert time.monotonic() < deadline
            time.sleep(0.02)
        fake_runner(zombie.pid, started)
        assert isinstance(observe(member_dir), Vanished)
    finally:
        zombie.wait()


ENV_DUMP = """
import json, os
keys = ["RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "NODE_RANK", "NNODES",
        "MASTER_ADDR", "MASTER_PORT", "CUDA_VISIBLE_DEVICES", "TUNEPLANE_RUN_ID"]
out = os.environ["TUNEPLANE_OUT_DIR"]
with open(os.path.join(out, "env-%s.json" % os.environ["LOCAL_RANK"]), "w") as f:
    json.dump({k: os.environ.get(k) for k in keys}, f)
"""


async def test_rendezvous_variables_reach_every_local_process(tmp_path: Path) -> None:
    script = workload(tmp_path, "env.py", ENV_DUMP)
    specs = process_group_specs(tmp_path, script, ("GPU-aaa", "GPU-bbb"), 1, 2)
    launch = member_launch(tmp_path, specs=specs)
    member_dir = prepared(launch)
    await start_runner(member_dir)
    result = await wait_observation(member_dir, Exited)
    assert (result.exit_code, result.signal) == (0, None)  # type: ignore[union-attr]
    seen = [json.loads((launch.out_dir / f"env-{r}.json").read_text()) for r in (0, 1)]
    common = {
        "WORLD_SIZE": "4",
        "LOCAL_WORLD_SIZE": "2",
        "NODE_RANK": "1",
        "NNODES": "2",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": "29511",
        "TUNEPLANE_RUN_ID": "r-1",
    }
    assert seen[0] == {**common, "RANK": "2", "LOCAL_RANK": "0", "CUDA_VISIBLE_DEVICES": "GPU-aaa"}
    assert seen[1] == {**common, "RANK": "3", "LOCAL_RANK": "1", "CUDA_VISIBLE_DEVICES": "GPU-bbb"}


REPORT_FILE = os.path.realpath(tuneplane.report.__file__)
IMPORTS_REPORT = """
import os, sys
import tuneplane.report
with open(os.path.join(os.environ["TUNEPLANE_OUT_DIR"], "report-path"), "w") as f:
    f.write(os.path.realpath(tuneplane.report.__file__))
"""


async def test_the_workload_imports_tuneplane_report_from_the_runner(tmp_path: Path) -> None:
    script = workload(tmp_path, "imports.py", IMPORTS_REPORT)
    # -S: no site-packages, so only the runner's PYTHONPATH can make tuneplane.report importable.
    launch = member_launch(tmp_path, [[sys.executable, "-S", str(script)]])
    member_dir = prepared(launch)
    await start_runner(member_dir)
    result = await wait_observation(member_dir, Exited)
    stderr = launch.stderr_path.read_text()
    assert (result.exit_code, result.signal) == (0, None), stderr  # type: ignore[union-attr]
    assert_sdk_from_capsule(member_dir, (launch.out_dir / "report-path").read_text())


def assert_sdk_from_capsule(member_dir: Path, reported: str) -> None:
    """The SDK is the capsule's copy inside runner.pyz, the same source as the installed one."""
    runner = os.path.realpath(capsule_dir(member_dir) / RUNNER_PYZ)
    assert reported == os.path.join(runner, "tuneplane", "report", "__init__.py")
    with zipfile.ZipFile(runner) as archive:
        sealed = archive.read("tuneplane/report/__init__.py")
    assert sealed == Path(REPORT_FILE).read_bytes()


async def test_a_process_that_cannot_be_executed_fails_the_member_with_127(
    tmp_path: Path,
) -> None:
    sleeps = workload(tmp_path, "sleeps.py", "import time; time.sleep(60)")
    missing = str(tmp_path / "no-such-program")
    member_dir = prepared(member_launch(tmp_path, [python(sleeps), [missing], python(sleeps)]))
    await start_runner(member_dir)
    result = await wait_observation(member_dir, Exited)
    assert (result.exit_code, result.signal) == (127, None)  # type: ignore[union-attr]
    record = read_exit_record(member_dir)
    assert record is not None
    first, broken, never = record.processes
    assert first.signal == signal.SIGTERM
    assert broken.error is not None
    assert "no-such-program" in broken.error
    assert never.error == "not started because local rank 1 failed to start"


async def test_a_broken_member_file_is_refused_with_a_sentence(tmp_path: Path) -> None:
    script = workload(tmp_path, "w.py", "pass")
    member_dir = prepared(member_launch(tmp_path, [python(script)]))
    raw = json.loads((member_dir / "member.json").read_text())
    raw["grace_period_s"] = "soon"
    (member_dir / "member.json").write_text(json.dumps(raw))
    with pytest.raises(
        RunnerStartFailed, match="field 'grace_period_s' = 'soon' is not an integer"
    ):
        await start_runner(member_dir)
    assert observe(member_dir) == NotStarted()


def test_write_launch_round_trips_and_refuses_relative_paths(tmp_path: Path) -> None:
    launch = member_launch(tmp_path, [["/bin/true"]])
    write_launch(launch)
    member = read_member_file(launch.member_dir)
    assert member.run_id == "r-1"
    assert member.processes[0].argv == ("/bin/true",)
    assert member.stdout_path == str(launch.stdout_path)
    assert not list(launch.member_dir.glob(".*.tmp"))
    with pytest.raises(LaunchSpecError, match=r"MemberLaunch.out_dir = 'out' is not an absolute"):
        write_launch(attrs.evolve(launch, out_dir=Path("out")))
