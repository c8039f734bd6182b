"""``python -m tuneplane.runner <member_dir>``: start one member; outlive the agent.

``python -m tuneplane.runner --template`` is the same runner imported once, forking a start per
request from the agent (:mod:`.template`).

Rules: the launch is claimed (``launch.claim``, exclusive create) before anything starts, so a
second runner for the same member refuses itself and touches nothing; the runner detaches into
its own session so the agent's death never reaches it, and :class:`.member_runner.MemberRunner`
supervises the member from there. Stdlib + psutil only: this ships inside ``runner.pyz``.
"""

from __future__ import annotations

import logging
import os
import sys
import time
import traceback
from pathlib import Path

import psutil

from .durable import create_exclusive
from .exit_codes import (
    EXIT_BAD_MEMBER_FILE,
    EXIT_FAILED,
    EXIT_REFUSED,
    EXIT_STARTED,
    EXIT_USAGE,
)
from .member_file import MemberFile, MemberFileError, read_member_file
from .member_runner import MemberRunner
from .prctl import become_child_subreaper
from .records import CLAIM_FILE, RUNNER_LOG, RecordError, read_claim, read_exit_record
from .sdk_path import SdkNotFound

log = logging.getLogger(__name__)


_STARTED = b"started\n"


def main(argv: list[str] | None = None) -> int:
    """Validate ``member.json``, then fork the detached runner and wait only until it started.

    Returns EXIT_STARTED once the runner has written ``runner.json`` and started every local
    process; EXIT_REFUSED when the launch was already claimed; otherwise a failure code, with a
    sentence on stderr.
    """
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        print("usage: python -m tuneplane.runner <member_dir> | --template", file=sys.stderr)
        return EXIT_USAGE
    if args[0] == "--template":
        from .template import run_template

        return run_template()
    member_dir = Path(args[0]).resolve()
    try:
        member = read_member_file(member_dir)
    except MemberFileError as exc:
        print(f"tuneplane runner: {exc}", file=sys.stderr)
        return EXIT_BAD_MEMBER_FILE
    return _fork_runner(member_dir, member)


def _fork_runner(member_dir: Path, member: MemberFile) -> int:
    read_fd, write_fd = os.pipe()
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid:
        os.close(write_fd)
        status = _read_all(read_fd)
        if status == _STARTED:
            # The runner goes on alone; init (or a subreaper) reaps it, never the agent.
            return EXIT_STARTED
        _, wait_status = os.waitpid(pid, 0)
        code = os.waitstatus_to_exitcode(wait_status)
        message = status.decode("utf-8", "replace").strip()
        print(
            f"tuneplane runner: {message or 'the runner died before starting the member'}",
            file=sys.stderr,
        )
        return code if code > 0 else EXIT_FAILED
    os.close(read_fd)
    code = EXIT_FAILED
    try:
        # A new session: no controlling terminal and no signals aimed at the agent's group.
        os.setsid()
        code = _run_detached(member_dir, member, write_fd)
    except BaseException:
        # Whatever happens the forked child must not return into the caller's stack.
        traceback.print_exc()
        _report(write_fd, "the runner failed unexpectedly; see runner.log in the member directory")
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def _read_all(fd: int) -> bytes:
    chunks = []
    while chunk := os.read(fd, 4096):
        chunks.append(chunk)
    os.close(fd)
    return b"".join(chunks)


def _report(fd: int, message: str | bytes) -> None:
    """Tell the foreground process how the start went, once; closing the pipe ends its wait."""
    try:
        os.write(fd, message if isinstance(message, bytes) else message.encode("utf-8"))
        os.close(fd)
    except OSError:
        # Already reported and closed, or the foreground process is gone: nobody to tell.
        return


def _claim(member_dir: Path, member: MemberFile) -> str | None:
    """Claim the member's launch; None when claimed here, else the sentence refusing it."""
    me = psutil.Process()
    try:
        create_exclusive(
            member_dir / CLAIM_FILE,
            {"pid": me.pid, "start_time": me.create_time(), "claimed_at": time.time()},
        )
    except FileExistsError:
        try:
            claimed = read_claim(member_dir)
            holder = f"runner pid {claimed[0]}" if claimed else "another runner"
        except RecordError:
            holder = "another runner"
        return (
            f"the launch of member {member.member_index} of run {member.run_id} attempt "
            f"{member.attempt} is already claimed by {holder} ({member_dir / CLAIM_FILE} "
            f"exists); a member starts at most once per attempt, so start a new attempt instead."
        )
    return None


def run_in_foreground(member_dir: Path) -> int:
    """Claim, start and supervise the member in this process (a Slurm task: Slurm, not an agent,
    owns this process), and return how the member ended as an exit status: the first failure's
    exit code, 128 + its signal, or 0. The exit record is written as on a Node."""
    member = read_member_file(member_dir)
    refused = _claim(member_dir, member)
    if refused is not None:
        print(f"tuneplane runner: {refused}", file=sys.stderr)
        return EXIT_REFUSED
    become_child_subreaper()
    runner = MemberRunner(member_dir, member)
    runner.start()
    runner.supervise()
    ended = read_exit_record(member_dir)
    if ended is None:
        return EXIT_FAILED
    if ended.signal:
        return 128 + ended.signal
    return ended.exit_code or 0


def _run_detached(member_dir: Path, member: MemberFile, ready_fd: int) -> int:
    refused = _claim(member_dir, member)
    if refused is not None:
        _report(ready_fd, refused)
        return EXIT_REFUSED
    _redirect_stdio(member_dir / RUNNER_LOG)
    logging.basicConfig(
        stream=sys.stderr, level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s"
    )
    os.chdir("/")
    # Orphans of the workload (a daemon it started, bubblewrap's helpers) become the runner's
    # children instead of init's, so the runner reaps them and knows when they are all gone.
    become_child_subreaper()
    runner = MemberRunner(member_dir, member)
    try:
        runner.start()
    except (OSError, SdkNotFound) as exc:
        log.exception("member start failed run_id=%s member=%d", member.run_id, member.member_index)
        _report(ready_fd, f"the runner could not start member {member.member_index}: {exc}")
        return EXIT_FAILED
    _report(ready_fd, _STARTED)
    runner.supervise()
    return 0


def _redirect_stdio(log_path: Path) -> None:
    # The foreground process's pipes belong to the agent; after the claim the runner only
    # writes to its own log, so the agent sees EOF as soon as the foreground process exits.
    null = os.open(os.devnull, os.O_RDONLY)
    out = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(null, 0)
    os.dup2(out, 1)
    os.dup2(out, 2)
    os.close(null)
    os.close(out)
