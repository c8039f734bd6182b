"""The detached runner's supervisor: start the member's local processes, stop them, record the end.

Rules: the runner stays root (it writes the member's records); each workload process switches to
the member's account (supplementary groups, gid, uid, then no new privileges) between fork and
exec. The lifecycle (:mod:`.lifecycle`) decides; this class only carries out its effects, and
``exit.json`` is written atomically before the runner exits. Stdlib + psutil only: this ships
inside ``runner.pyz``.
"""

from __future__ import annotations

import logging
import os
import select
import signal
import socket
import subprocess
import time
from pathlib import Path
from types import FrameType

import psutil

from . import lifecycle as lc
from .durable import write_json_atomic
from .member_file import Account, MemberFile
from .prctl import no_new_privileges
from .records import EXIT_FILE, RUNNER_FILE, ExitRecord, ProcessIdentity, RunnerRecord
from .sdk_path import sdk_root, with_sdk_on_path

log = logging.getLogger(__name__)

# A process that could not be exec'd gets the shell's "command not found" code.
EXIT_NOT_STARTED = 127
# How long the runner waits for a pool account's killed processes to be gone before it records
# the exit anyway (a process stuck in the kernel cannot be waited for forever).
RELEASE_TIMEOUT_S = 10.0


def _sandbox_preexec() -> None:
    """Runs in the forked child of a sandboxed process, after subprocess switched groups, gid
    and uid, before exec.

    Bubblewrap itself ignores SIGTERM so that a stop reaches the workload (``env
    --default-signal=TERM`` restores it there) and bubblewrap exits only with the workload,
    keeping the grace period; SIGKILL still ends bubblewrap and its whole sandbox.
    """
    signal.signal(signal.SIGTERM, signal.SIG_IGN)


def has_children() -> bool:
    """True while this process has a child, running or exited but not yet reaped.

    ``waitid`` with ``WNOWAIT`` looks without reaping; ECHILD means there is none. For a child
    subreaper that also means no descendant at all: an orphan is re-parented to it.
    """
    try:
        os.waitid(os.P_ALL, 0, os.WEXITED | os.WNOHANG | os.WNOWAIT)
    except ChildProcessError:
        return False
    return True


def _chown_tree(root: Path, uid: int, gid: int) -> None:
    if not root.exists():
        return
    os.lchown(root, uid, gid)
    for folder, dirs, files in os.walk(root, followlinks=False):
        for name in dirs + files:
            try:
                os.lchown(os.path.join(folder, name), uid, gid)
            except FileNotFoundError:
                continue


class MemberRunner:
    """Starts the member's local processes, forwards stops and records how the member ended."""

    def __init__(self, member_dir: Path, member: MemberFile) -> None:
        self.member_dir = member_dir
        self.member = member
        self.lifecycle = lc.MemberLifecycle(p.local_rank for p in member.processes)
        self.live: dict[int, subprocess.Popen[bytes]] = {}
        self.pgids: dict[int, int] = {}
        self.pending: list[lc.Event] = []
        self.grace_deadline: float | None = None
        self._wake_r, self._wake_w = socket.socketpair()

    def _on_stop_signal(self, signum: int, frame: FrameType | None) -> None:
        self.pending.append(lc.StopRequested(f"runner received {signal.Signals(signum).name}"))

    def _on_wake_signal(self, signum: int, frame: FrameType | None) -> None:
        # SIGCHLD only needs to wake the loop (the wakeup fd does that); SIGHUP must not kill us.
        return

    def _install_signals(self) -> None:
        for sock in (self._wake_r, self._wake_w):
            sock.setblocking(False)
        signal.set_wakeup_fd(self._wake_w.fileno(), warn_on_full_buffer=False)
        signal.signal(signal.SIGTERM, self._on_stop_signal)
        signal.signal(signal.SIGINT, self._on_stop_signal)
        signal.signal(signal.SIGCHLD, self._on_wake_signal)
        signal.signal(signal.SIGHUP, self._on_wake_signal)

    def _record(self) -> None:
        me = psutil.Process()
        identities = []
        for rank, popen in self.live.items():
            try:
                started = psutil.Process(popen.pid).create_time()
            except psutil.Error:
                # Not reaped yet, so /proc still has it; this is only a guard against races.
                started = time.time()
            identities.append(ProcessIdentity(rank, popen.pid, self.pgids[rank], started))
        record = RunnerRecord(me.pid, me.create_time(), tuple(identities))
        write_json_atomic(self.member_dir / RUNNER_FILE, record.to_json())

    def start(self) -> None:
        """Install signal handling, start every local process, then record the runner and them.

        Until ``runner.json`` exists the launch claim names the runner (pid and start time, the
        same identity), so nothing is written twice before the processes start. Signals arrive
        from here on (a stop that comes before the processes exist is queued). A process that
        cannot be exec'd is a member failure (exit code 127), not a start failure.
        """
        member = self.member
        self._install_signals()
        # No exec from here on gains privileges (setuid bits, file capabilities). Set on the
        # runner, it is inherited by every local process and kept across their exec, so an
        # unsandboxed child runs no Python between its fork and its exec (about 0.8 ms each).
        no_new_privileges()
        Path(member.out_dir).mkdir(parents=True, exist_ok=True)
        root = Path(member.sdk_path) if member.sdk_path else sdk_root(self.member_dir / "sdk")
        account = member.account
        sandbox = tuple(member.sandbox.argv) if member.sandbox else ()
        flags = os.O_WRONLY | os.O_CREAT | os.O_APPEND
        out = os.open(member.stdout_path, flags, 0o644)
        err = os.open(member.stderr_path, flags, 0o644)
        try:
            for index, proc in enumerate(member.processes):
                try:
                    popen = subprocess.Popen(
                        (*sandbox, *proc.argv),
                        env=with_sdk_on_path(dict(proc.env), root),
                        cwd=proc.cwd,
                        stdin=subprocess.DEVNULL,
                        stdout=out,
                        stderr=err,
                        process_group=0,
                        close_fds=True,
                        preexec_fn=_sandbox_preexec if sandbox else None,
                        user=account.uid if account else None,
                        group=account.gid if account else None,
                        extra_groups=list(account.groups) if account else None,
                    )
                except OSError as exc:
                    self._not_started(index, exc)
                    break
                self.live[proc.local_rank] = popen
                self.pgids[proc.local_rank] = popen.pid
                log.info(
                    "local process started run_id=%s member=%d local_rank=%d pid=%d",
                    member.run_id,
                    member.member_index,
                    proc.local_rank,
                    popen.pid,
                )
        finally:
            os.close(out)
            os.close(err)
        self._record()

    def _not_started(self, index: int, exc: OSError) -> None:
        procs = self.member.processes
        log.error("local process not started local_rank=%d error=%s", index, exc)
        self.pending.append(
            lc.ProcessExited(procs[index].local_rank, EXIT_NOT_STARTED, None, f"{exc}")
        )
        for later in procs[index + 1 :]:
            self.pending.append(
                lc.ProcessExited(
                    later.local_rank,
                    None,
                    None,
                    f"not started because local rank {procs[index].local_rank} failed to start",
                )
            )

    def supervise(self) -> None:
        """Wait for every local process, carrying out the lifecycle's effects; write exit.json."""
        while True:
            events, self.pending = self.pending, []
            for rank, popen in list(self.live.items()):
                code = popen.poll()
                if code is None:
                    continue
                del self.live[rank]
                # Stragglers the process left in its group would hold the member's GPUs.
                self._signal_groups((rank,), signal.SIGKILL)
                exit_code, signum = (code, None) if code >= 0 else (None, -code)
                log.info(
                    "local process exited local_rank=%d exit_code=%s signal=%s",
                    rank,
                    exit_code,
                    signum,
                )
                events.append(lc.ProcessExited(rank, exit_code, signum))
            if self.grace_deadline is not None and time.monotonic() >= self.grace_deadline:
                self.grace_deadline = None
                events.append(lc.GraceExpired())
            for event in events:
                for effect in self.lifecycle.handle(event):
                    if isinstance(effect, lc.Finish):
                        self._finish(effect)
                        return
                    self._carry_out(effect)
            self._wait()

    def _carry_out(self, effect: lc.Terminate | lc.Kill) -> None:
        if isinstance(effect, lc.Terminate):
            log.info(
                "member stopping local_ranks=%s reason=%s",
                effect.local_ranks,
                self.lifecycle.stop_reason,
            )
            self._signal_groups(effect.local_ranks, signal.SIGTERM)
            self.grace_deadline = time.monotonic() + self.member.grace_period_s
        else:
            log.info("member grace expired local_ranks=%s", effect.local_ranks)
            self._signal_groups(effect.local_ranks, signal.SIGKILL)

    def _signal_groups(self, ranks: tuple[int, ...], signum: int) -> None:
        for rank in ranks:
            pgid = self.pgids.get(rank)
            if pgid is None:
                continue
            try:
                os.killpg(pgid, signum)
            except (ProcessLookupError, PermissionError):
                # The group is empty already: nothing left to stop.
                continue

    def _reap_orphans(self) -> int:
        """Reap exited children that are not local processes; the number still running."""
        ours = {popen.pid for popen in self.live.values()}
        running = 0
        for child in psutil.Process().children():
            if child.pid in ours:
                continue
            try:
                pid, _ = os.waitpid(child.pid, os.WNOHANG)
            except ChildProcessError:
                continue
            running += pid == 0
        return running

    def _release(self, account: Account) -> None:
        """End everything the member left behind, then give its folders back to root.

        The runner is a child subreaper, so whatever the workload started, even a daemon that
        left its process group and session, is still a descendant of the runner: it is killed
        and reaped here (bounded by RELEASE_TIMEOUT_S), before exit.json, so the account is
        only leased again once nothing of this member runs or owns a file.
        """
        deadline = time.monotonic() + RELEASE_TIMEOUT_S
        # Most members leave nothing: with no child at all (alive or a zombie) the runner, a
        # subreaper, has no descendant either, so the process-table scans below are skipped.
        while has_children():
            self._reap_orphans()
            left = psutil.Process().children(recursive=True)
            if not left:
                break
            for proc in left:
                try:
                    proc.send_signal(signal.SIGKILL)
                except psutil.Error:
                    continue
            if time.monotonic() >= deadline:
                log.error("member processes left running account=%s count=%d", account.name,
                          len(left))  # fmt: skip
                break
            # SIGCHLD (through the wakeup fd) ends the wait as soon as one of them exits.
            select.select([self._wake_r], [], [], 0.05)
            self._drain_wakeups()
        for root in account.release_paths:
            _chown_tree(Path(root), 0, 0)

    def _wait(self) -> None:
        self._reap_orphans()
        timeout = 1.0
        if self.grace_deadline is not None:
            timeout = min(timeout, max(self.grace_deadline - time.monotonic(), 0.0))
        select.select([self._wake_r], [], [], timeout)
        self._drain_wakeups()

    def _drain_wakeups(self) -> None:
        try:
            while self._wake_r.recv(4096):
                continue
        except BlockingIOError:
            return

    def _finish(self, finish: lc.Finish) -> None:
        account = self.member.account
        if account is not None and account.reap:
            self._release(account)
        record = ExitRecord(
            exit_code=finish.exit_code,
            signal=finish.signal,
            finished_at=time.time(),
            stop_reason=finish.stop_reason,
            processes=finish.processes,
        )
        write_json_atomic(self.member_dir / EXIT_FILE, record.to_json())
        log.info(
            "member exited run_id=%s attempt=%d member=%d exit_code=%s signal=%s",
            self.member.run_id,
            self.member.attempt,
            self.member.member_index,
            finish.exit_code,
            finish.signal,
        )
