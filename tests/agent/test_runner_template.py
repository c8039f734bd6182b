"""The runner template against real runners: real forks, real members, real kills."""

from __future__ import annotations

import hashlib
import json
import os
import signal
import socket
import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import psutil
import pytest
import trio

from tests.runner.members import (
    WAIT_FOR_RELEASE,
    member_launch,
    prepared,
    python,
    wait_observation,
    wait_until,
    workload,
)
from tuneplane.agent.runner_pyz import RUNNER_DIGEST, RUNNER_PYZ, build, capsule_dir
from tuneplane.agent.runner_template import RunnerTemplate
from tuneplane.agent.supervision import (
    Exited,
    LaunchAlreadyClaimed,
    MemberLaunch,
    NotStarted,
    RunnerNotVerified,
    RunnerStartFailed,
    RunnerStartTimeout,
    Running,
    observe,
    start_runner,
)
from tuneplane.runner.template import RUNNER_NAME

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
async def template(tmp_path: Path) -> AsyncIterator[RunnerTemplate]:
    template = RunnerTemplate(tmp_path / "state" / "runner")
    async with trio.open_nursery() as nursery:
        nursery.start_soon(template.run)
        yield template
        nursery.cancel_scope.cancel()


def _template_pid(template: RunnerTemplate) -> int:
    assert template.process is not None
    return template.process.pid


def _forked_from_template(pid: int, template: RunnerTemplate) -> bool:
    """A runner the template forked has its command line and the runner's process name."""
    proc = psutil.Process(pid)
    written = str(template.folder / RUNNER_PYZ)
    return proc.name() == RUNNER_NAME and proc.cmdline()[-2:] == [written, "--template"]


async def _start_waiting(
    tmp_path: Path, template: RunnerTemplate
) -> tuple[MemberLaunch, Path, Running]:
    """A member whose workload waits for its release file, started through ``template``."""
    launch = member_launch(tmp_path, [python(workload(tmp_path, "w.py", WAIT_FOR_RELEASE))])
    member_dir = prepared(launch)
    running = await start_runner(member_dir, template=template)
    assert isinstance(running, Running)
    return launch, member_dir, running


async def test_a_start_forked_from_the_template_runs_the_member_to_its_exit(
    tmp_path: Path, template: RunnerTemplate
) -> None:
    launch, member_dir, running = await _start_waiting(tmp_path, template)
    assert _forked_from_template(running.pid, template)
    # The runner is in its own session, not the template's child: it outlives the template.
    runner = psutil.Process(running.pid)
    assert runner.ppid() != _template_pid(template)
    assert os.getsid(running.pid) == running.pid
    (launch.out_dir / "release").touch()
    result = await wait_observation(member_dir, Exited)
    assert (result.exit_code, result.signal) == (0, None)  # type: ignore[union-attr]
    # The template's runner is the Node's own, written 0600 in a 0700 folder.
    assert (template.folder.stat().st_mode & 0o777, template.folder.joinpath(RUNNER_PYZ).stat()
            .st_mode & 0o777) == (0o700, 0o600)  # fmt: skip


async def test_the_runner_outlives_a_template_killed_while_the_member_runs(
    tmp_path: Path, template: RunnerTemplate
) -> None:
    launch, member_dir, running = await _start_waiting(tmp_path, template)
    assert template.process is not None
    template.process.kill()
    await template.process.wait()

    assert observe(member_dir) == running
    (launch.out_dir / "release").touch()
    result = await wait_observation(member_dir, Exited)
    assert (result.exit_code, result.signal) == (0, None)  # type: ignore[union-attr]


async def test_a_second_start_through_the_template_is_refused_and_changes_nothing(
    tmp_path: Path, template: RunnerTemplate
) -> None:
    launch, member_dir, first = await _start_waiting(tmp_path, template)
    files_before = {p.name: p.read_bytes() for p in member_dir.iterdir() if p.is_file()}

    with pytest.raises(LaunchAlreadyClaimed, match="already claimed by runner pid"):
        await start_runner(member_dir, template=template)

    assert observe(member_dir) == first
    assert {p.name: p.read_bytes() for p in member_dir.iterdir() if p.is_file()} == files_before
    (launch.out_dir / "release").touch()
    await wait_observation(member_dir, Exited)


async def test_a_broken_member_file_is_refused_with_the_runners_own_sentence(
    tmp_path: Path, template: RunnerTemplate
) -> None:
    member_dir = prepared(member_launch(tmp_path, [python(workload(tmp_path, "w.py", "pass"))]))
    raw = json.loads((member_dir / "member.json").read_text())
    raw["grace_period_s"] = "soon"
    (member_dir / "member.json").write_text(json.dumps(raw))
    with pytest.raises(RunnerStartFailed, match="field 'grace_period_s' = 'soon' is not an int"):
        await start_runner(member_dir, template=template)
    assert observe(member_dir) == NotStarted()
    # The template answered and is still there for the next start.
    assert template.process is not None and template.process.returncode is None


async def test_another_runner_is_never_forked_from_the_template(
    tmp_path: Path, template: RunnerTemplate
) -> None:
    """A capsule whose runner is not the Node's own (another agent version sealed it) starts
    in a fresh interpreter from the capsule's own file; the template is not even started."""
    script = workload(tmp_path, "w.py", WAIT_FOR_RELEASE)
    launch = member_launch(tmp_path, [python(script)])
    member_dir = prepared(launch)
    capsule = capsule_dir(member_dir)
    other = capsule / RUNNER_PYZ
    # A zip with a comment is another file that still runs the same code.
    data = other.read_bytes()
    other.write_bytes(data[:-2] + b"\x04\x00" + b"TP!!")
    (capsule / RUNNER_DIGEST).write_text(hashlib.sha256(other.read_bytes()).hexdigest() + "\n")
    running = await start_runner(member_dir, template=template)
    assert isinstance(running, Running)
    assert template.process is None
    assert str(other.absolute()) in psutil.Process(running.pid).cmdline()
    (launch.out_dir / "release").touch()
    await wait_observation(member_dir, Exited)


async def test_a_dead_template_is_replaced_at_the_next_start(
    tmp_path: Path, template: RunnerTemplate
) -> None:
    await template.warm()
    dead = _template_pid(template)
    assert template.process is not None
    template.process.kill()
    await template.process.wait()

    member_dir = prepared(member_launch(tmp_path, [python(workload(tmp_path, "w.py", "pass"))]))
    result = await start_runner(member_dir, template=template)
    assert isinstance(result, Running | Exited)
    assert _template_pid(template) != dead
    assert await wait_observation(member_dir, Exited) == Exited(
        0,
        None,
        observe(member_dir).finished_at,  # type: ignore[union-attr]
    )


async def test_a_start_that_hangs_times_out_and_takes_the_template_and_its_fork_with_it(
    tmp_path: Path, template: RunnerTemplate
) -> None:
    member_dir = prepared(member_launch(tmp_path, [python(workload(tmp_path, "w.py", "pass"))]))
    # member.json as a FIFO nobody writes: the forked start blocks reading it.
    (member_dir / "member.json").unlink()
    os.mkfifo(member_dir / "member.json")
    await template.warm()
    pid = _template_pid(template)
    forks_before = {c.pid for c in psutil.Process(pid).children()}
    assert forks_before == set()

    async def forked() -> int:
        while not (children := psutil.Process(pid).children()):
            await trio.sleep(0.01)
        return children[0].pid

    async with trio.open_nursery() as nursery:
        seen: list[int] = []

        async def watch() -> None:
            seen.append(await forked())

        nursery.start_soon(watch)
        with pytest.raises(RunnerStartTimeout, match="neither started the member nor refused"):
            await start_runner(member_dir, timeout_s=2.0, template=template)
    assert template.process is None
    assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    await wait_until(lambda: not psutil.pid_exists(seen[0]))
    assert observe(member_dir) == NotStarted()


async def test_an_idle_template_ends_and_the_next_prepare_starts_another(
    tmp_path: Path, template: RunnerTemplate
) -> None:
    template.idle_s = 0.2
    await template.warm()
    process = template.process
    assert process is not None
    with trio.fail_after(20):
        await process.wait()
    # Ended by closing its socket (EOF), not killed.
    assert process.returncode == 0
    await wait_until(lambda: template.process is None)
    await template.warm()
    assert _template_pid(template) != process.pid
    os.kill(_template_pid(template), signal.SIGKILL)


async def test_a_capsule_runner_changed_after_prepare_is_not_started_by_the_template_either(
    tmp_path: Path, template: RunnerTemplate
) -> None:
    """The template's copy is intact, but the launch verifies the capsule's file first: a
    changed capsule runner stops the launch before the template is asked (or even started)."""
    member_dir = prepared(member_launch(tmp_path, [python(workload(tmp_path, "w.py", "pass"))]))
    runner = capsule_dir(member_dir) / RUNNER_PYZ
    tampered = bytearray(runner.read_bytes())
    tampered[len(tampered) // 2] ^= 0xFF
    runner.write_bytes(bytes(tampered))
    files_before = {p.name: p.read_bytes() for p in member_dir.iterdir() if p.is_file()}
    with pytest.raises(RunnerNotVerified, match="it changed after Prepare"):
        await start_runner(member_dir, template=template)
    assert template.process is None
    assert observe(member_dir) == NotStarted()
    assert {p.name: p.read_bytes() for p in member_dir.iterdir() if p.is_file()} == files_before


async def test_a_template_whose_agent_died_mid_start_finishes_the_start_and_ends_quietly(
    tmp_path: Path,
) -> None:
    """The agent is killed while a start runs: the member still starts (its runner stands on
    its own records) and the template, finding nobody to answer, ends with code 0 and no
    traceback."""
    launch = member_launch(tmp_path, [python(workload(tmp_path, "w.py", "pass"))])
    member_dir = prepared(launch)
    member_json = (member_dir / "member.json").read_bytes()
    (member_dir / "member.json").unlink()
    os.mkfifo(member_dir / "member.json")
    folder = tmp_path / "state" / "runner"
    folder.mkdir(parents=True)
    (folder / RUNNER_PYZ).write_bytes(build())
    ours, theirs = socket.socketpair()
    with theirs:
        process = await trio.lowlevel.open_process(
            [sys.executable, str(folder / RUNNER_PYZ), "--template"],
            stdin=theirs.fileno(),
            stderr=subprocess.PIPE,
            start_new_session=True,
        )
    read_fd, write_fd = os.pipe()
    socket.send_fds(ours, [f"{member_dir}\n".encode()], [write_fd])
    os.close(write_fd)
    ours.close()  # the agent is gone
    # The forked start was blocked reading member.json; now it gets it.
    await trio.to_thread.run_sync((member_dir / "member.json").write_bytes, member_json)
    with trio.fail_after(20):
        await process.wait()
    assert process.stderr is not None
    assert process.returncode == 0
    assert await process.stderr.receive_some() == b""
    result = await wait_observation(member_dir, Exited)
    assert (result.exit_code, result.signal) == (0, None)  # type: ignore[union-attr]
    os.close(read_fd)
