"""Start, observe and stop one member's runner: the agent's side of the runner's files.

Rules: the runner, not the agent, owns the member's processes; the agent starts it detached (its
own session, never reaped by the agent) and afterwards only reads its durable files and checks
pid *and* start time. Every function is safe to repeat: a second start is refused by the launch
claim, a second cancel finds the member stopping or gone.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import attrs
import psutil
import trio

from tuneplane.runner.exit_codes import EXIT_REFUSED, EXIT_STARTED
from tuneplane.runner.member_file import MEMBER_FILE, MemberFile, ProcessEntry, Sandbox
from tuneplane.runner.member_file import Account as RunAs
from tuneplane.runner.records import (
    CLAIM_FILE,
    ProcessIdentity,
    RecordError,
    read_claim,
    read_exit_record,
    read_runner_record,
)

from . import runner_pyz
from .atomic_file import write_json_atomic
from .launch_plan import ProcessSpec
from .runner_template import RunnerTemplate, StartOutcome

log = logging.getLogger(__name__)

# psutil derives start times from boot time + clock ticks; boot time as the kernel reports it can
# move by a fraction of a second when the clock is adjusted, so equal means "within this".
START_TIME_TOLERANCE_S = 1.0
# How much longer than the runner's own grace period cancel waits before killing directly.
CANCEL_MARGIN_S = 5.0
POLL_INTERVAL_S = 0.05
START_TIMEOUT_S = 30.0


class SupervisionError(Exception):
    """Base of the supervision errors; ``str()`` is a sentence naming the member directory."""


class LaunchAlreadyClaimed(SupervisionError):
    """The member was already started (or is starting) in this attempt; it starts at most once."""


class LaunchSpecError(SupervisionError, ValueError):
    """A :class:`MemberLaunch` field is unusable (for example a relative path)."""


class RunnerStartFailed(SupervisionError):
    """The runner did not start the member; the runner's own sentence is included."""


class RunnerNotVerified(RunnerStartFailed):
    """The capsule's ``runner.pyz`` is missing or no longer matches the digest Prepare recorded."""


class RunnerStartTimeout(SupervisionError):
    """The runner neither started the member nor refused within the timeout."""


@attrs.frozen
class MemberLaunch:
    """Everything the runner needs to start one member; written as ``<member_dir>/member.json``."""

    member_dir: Path
    run_id: str
    attempt: int
    member_index: int
    processes: tuple[ProcessSpec, ...]
    out_dir: Path
    grace_period_s: int
    stdout_path: Path
    stderr_path: Path
    # The account the workload runs as (None: the runner's own user, only for a non-root agent).
    run_as: RunAs | None = None
    # The sandbox command put before every process's argv (empty: no sandbox).
    sandbox_argv: tuple[str, ...] = ()
    # The workload-readable runner.pyz its tuneplane.report comes from (None: the runner's own).
    sdk_path: Path | None = None


@attrs.frozen
class NotStarted:
    """No runner has claimed this member's launch."""


@attrs.frozen
class Running:
    """The runner ``pid`` that started at ``start_time`` is alive and owns the member."""

    pid: int
    start_time: float


@attrs.frozen
class Exited:
    """The member ended; its runner recorded the first failure's exit code or signal (or 0)."""

    exit_code: int | None
    signal: int | None
    finished_at: float
    # The runner that recorded it (runner.json), when that record is readable. Not part of
    # equality: an exit is the same exit whoever is known to have recorded it.
    runner_pid: int | None = attrs.field(default=None, eq=False)


@attrs.frozen
class Vanished:
    """The launch was claimed but the runner is gone without recording an exit."""

    reason: str


Observation = NotStarted | Running | Exited | Vanished


def _member_file(launch: MemberLaunch) -> MemberFile:
    for name in ("member_dir", "out_dir", "stdout_path", "stderr_path", "sdk_path"):
        value = getattr(launch, name)
        if value is not None and not value.is_absolute():
            raise LaunchSpecError(
                f"MemberLaunch.{name} = {str(value)!r} is not an absolute path; the runner runs "
                f"from '/', so give an absolute path."
            )
    if not launch.processes:
        raise LaunchSpecError(
            f"MemberLaunch for {launch.member_dir} has no processes; plan at least one with "
            f"plan_processes()."
        )
    return MemberFile(
        run_id=launch.run_id,
        attempt=launch.attempt,
        member_index=launch.member_index,
        out_dir=str(launch.out_dir),
        grace_period_s=launch.grace_period_s,
        stdout_path=str(launch.stdout_path),
        stderr_path=str(launch.stderr_path),
        processes=tuple(
            ProcessEntry(argv=p.argv, env=dict(p.env), cwd=p.cwd, local_rank=p.local_rank)
            for p in launch.processes
        ),
        account=launch.run_as,
        sandbox=Sandbox(launch.sandbox_argv) if launch.sandbox_argv else None,
        sdk_path=str(launch.sdk_path) if launch.sdk_path else None,
    )


def write_launch(launch: MemberLaunch) -> None:
    """Write ``<member_dir>/member.json`` atomically (tmp, fsync, rename, fsync dir).

    Rewriting is allowed until the launch is claimed; afterwards it raises
    :class:`LaunchAlreadyClaimed`, because the running member must not change under its runner.
    """
    member_file = _member_file(launch)
    launch.member_dir.mkdir(parents=True, exist_ok=True)
    if (launch.member_dir / CLAIM_FILE).exists():
        raise LaunchAlreadyClaimed(
            f"Member directory {launch.member_dir} already holds {CLAIM_FILE}: the member was "
            f"started in this attempt and its member.json can no longer change; start a new "
            f"attempt in a new member directory."
        )
    write_json_atomic(launch.member_dir / MEMBER_FILE, member_file.to_json())


async def start_runner(
    member_dir: Path, timeout_s: float = START_TIMEOUT_S, template: RunnerTemplate | None = None
) -> Observation:
    """Start ``python <capsule>/runner.pyz <member_dir>`` detached and return what it did.

    The runner is the one Prepare sealed into the member's Job Capsule; it is checked against
    its recorded ``runner.sha256`` first and never replaced by the agent's installed copy (raises
    :class:`RunnerNotVerified`). The runner forks itself into a new session and the process
    this starts exits as soon as the runner has started every local process (or refused), so
    nothing here waits on the workload and the agent never reaps the runner. Raises
    :class:`LaunchAlreadyClaimed` when the member was already started,
    :class:`RunnerStartFailed` when the runner could not start it and
    :class:`RunnerStartTimeout` after ``timeout_s``. With a ``template`` whose runner is the
    capsule's (same sha256), the start is a fork of it instead of a new interpreter
    (agent/runner_template.py); otherwise, or when the template fails, as before.
    """
    capsule = runner_pyz.capsule_dir(member_dir)
    try:
        runner, digest = await trio.to_thread.run_sync(runner_pyz.verified, capsule)
    except runner_pyz.RunnerPyzError as exc:
        raise RunnerNotVerified(str(exc)) from None
    try:
        with trio.fail_after(timeout_s):
            started = None
            if template is not None:
                # The same runner, byte for byte (its sha256 is the one just verified).
                started = await template.start(member_dir, digest)
            if started is None:
                started = await _run_runner(runner, member_dir)
    except trio.TooSlowError:
        raise RunnerStartTimeout(
            f"The runner for {member_dir} neither started the member nor refused within "
            f"{timeout_s:g} s; read {member_dir / 'runner.log'} and the agent's log."
        ) from None
    said = started.stderr.decode("utf-8", "replace").strip()
    if started.returncode == EXIT_REFUSED:
        raise LaunchAlreadyClaimed(said or f"The launch of {member_dir} is already claimed.")
    if started.returncode != EXIT_STARTED:
        raise RunnerStartFailed(
            f"The runner for {member_dir} exited with code {started.returncode} before starting "
            f"the member: {said or 'it said nothing on stderr'}"
        )
    observation = observe(member_dir)
    log.info("runner started member_dir=%s observation=%s", member_dir, observation)
    return observation


async def _run_runner(runner: Path, member_dir: Path) -> StartOutcome:
    # psutil and the rest of the stdlib come from this interpreter; tuneplane from the zip.
    result = await trio.run_process(
        [sys.executable, str(runner), str(member_dir)],
        stdin=subprocess.DEVNULL,
        capture_stdout=True,
        capture_stderr=True,
        check=False,
        start_new_session=True,
    )
    return StartOutcome(result.returncode, result.stderr)


def is_alive(pid: int, start_time: float) -> bool:
    """True when ``pid`` is a live (not zombie) process that started at ``start_time``."""
    try:
        proc = psutil.Process(pid)
        if proc.status() == psutil.STATUS_ZOMBIE:
            return False
        return abs(proc.create_time() - start_time) <= START_TIME_TOLERANCE_S
    except psutil.Error:
        return False


def observe(member_dir: Path) -> Observation:
    """What the member's runner files and the process table say now (cheap, never blocks).

    ``exit.json`` wins; otherwise the runner recorded in ``runner.json`` (or, before that, in
    ``launch.claim``) is Running only if its pid is alive with the recorded start time, so a
    reused pid or a zombie reads as Vanished.
    """
    try:
        exited = read_exit_record(member_dir)
        if exited is not None:
            return Exited(exited.exit_code, exited.signal, exited.finished_at,
                          _runner_pid(member_dir))  # fmt: skip
        record = read_runner_record(member_dir)
        if record is not None:
            identity = (record.pid, record.start_time)
        else:
            claim = read_claim(member_dir)
            if claim is None:
                return NotStarted()
            identity = claim
        if is_alive(*identity):
            return Running(*identity)
        # The runner writes exit.json before it exits: check again now that it is known dead.
        exited = read_exit_record(member_dir)
    except RecordError as exc:
        return Vanished(f"a runner record is unreadable: {exc}")
    if exited is not None:
        return Exited(exited.exit_code, exited.signal, exited.finished_at, identity[0])
    where = "runner.json" if record is not None else CLAIM_FILE
    return Vanished(
        f"runner pid {identity[0]} recorded in {member_dir / where} is gone and left no exit.json"
    )


def _runner_pid(member_dir: Path) -> int | None:
    try:
        record = read_runner_record(member_dir)
    except RecordError:
        return None
    return record.pid if record is not None else None


def _group_is_ours(proc: ProcessIdentity) -> bool:
    """Whether signalling process group ``proc.pgid`` can only reach the member's processes.

    A pgid number cannot be handed out again while any process is in that group; it can only
    be reused once the group emptied, by a new process whose pid equals it. So a live leader
    pid with another start time means "not ours"; otherwise any survivors are the member's.
    """
    try:
        leader = psutil.Process(proc.pgid)
        return abs(leader.create_time() - proc.start_time) <= START_TIME_TOLERANCE_S
    except psutil.NoSuchProcess:
        return True
    except psutil.Error:
        return False


def _signal_groups(processes: tuple[ProcessIdentity, ...], signum: int) -> int:
    """Send ``signum`` to each of the member's process groups; the number still populated."""
    populated = 0
    for proc in processes:
        if not _group_is_ours(proc):
            continue
        try:
            os.killpg(proc.pgid, signum)
            populated += 1
        except (ProcessLookupError, PermissionError):
            # Empty group: that local process and everything it started are gone.
            continue
    return populated


async def _wait_until(done: Callable[[], bool], deadline_s: float) -> bool:
    """Poll ``done`` until it is true (True) or ``deadline_s`` passes (its last answer)."""
    with trio.move_on_after(deadline_s):
        while not done():
            await trio.sleep(POLL_INTERVAL_S)
        return True
    return done()


def _recorded_processes(member_dir: Path) -> tuple[ProcessIdentity, ...]:
    try:
        record = read_runner_record(member_dir)
    except RecordError:
        return ()
    return record.processes if record is not None else ()


async def cancel(member_dir: Path, grace_period_s: int) -> None:
    """Stop the member: SIGTERM, then SIGKILL after ``grace_period_s``; safe to repeat.

    With a live runner the runner does the work (it forwards SIGTERM to every local process
    group, kills after its grace period and records exit.json). If it has not finished after
    ``grace_period_s`` plus a margin, the runner and the recorded process groups are killed
    directly; if the runner is already gone, the groups get SIGTERM, the grace period, SIGKILL.
    Returns when the member has exited or nothing of it is left to signal.
    """
    observation = observe(member_dir)
    if isinstance(observation, NotStarted | Exited):
        return
    if isinstance(observation, Running):
        log.info("member cancel member_dir=%s runner_pid=%d", member_dir, observation.pid)
        if await _stop_runner(member_dir, observation, grace_period_s):
            return
        # The runner had its grace period and did not finish: nothing gentle is left to try.
        _signal_groups(_recorded_processes(member_dir), signal.SIGKILL)
        return
    processes = _recorded_processes(member_dir)
    if _signal_groups(processes, signal.SIGTERM) == 0:
        return
    log.info("member cancel without runner member_dir=%s groups=%d", member_dir, len(processes))

    def groups_empty() -> bool:
        return _signal_groups(processes, 0) == 0

    if not await _wait_until(groups_empty, grace_period_s):
        log.info("member grace expired member_dir=%s; killing its process groups", member_dir)
        _signal_groups(processes, signal.SIGKILL)


async def _stop_runner(member_dir: Path, runner: Running, grace_period_s: int) -> bool:
    """SIGTERM the runner and wait for exit.json; False (runner killed) when it never came."""
    try:
        os.kill(runner.pid, signal.SIGTERM)
    except ProcessLookupError:
        return isinstance(observe(member_dir), Exited)

    def runner_done() -> bool:
        return not isinstance(observe(member_dir), Running)

    await _wait_until(runner_done, grace_period_s + CANCEL_MARGIN_S)
    if isinstance(observe(member_dir), Exited):
        return True
    if is_alive(runner.pid, runner.start_time):
        log.warning("runner ignored stop runner_pid=%d; killing it", runner.pid)
        os.kill(runner.pid, signal.SIGKILL)
    return False
