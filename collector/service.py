"""``tuneplane-collector run``: one collector per member's state directory, drain, exit.

Rules:
- One collector per state directory: an exclusive lock the kernel drops when its holder dies;
  a second one exits with :data:`EXIT_BUSY`. A collector belongs to the agent that started it
  and stops when that agent is gone.
- The work itself is :class:`.pipeline.Collector` (tail, spool, ship). Once it has delivered
  everything, ``drained`` is written beside ``member-exited`` and the process exits 0.
  SIGTERM/SIGINT stop it early without losing anything: it resumes from the spool and
  checkpoint when started again.
"""

from __future__ import annotations

import fcntl
import logging
import os
import signal
import time
from pathlib import Path

import trio

from tuneplane.agent.atomic_file import write_atomic

from .options import CollectorOptions
from .pipeline import Collector
from .spool import SPOOL_FILE, Spool

log = logging.getLogger(__name__)

DRAINED_MARKER = "drained"


def drained(state_dir: Path) -> bool:
    """True once a collector delivered everything its member wrote and exited."""
    return (state_dir / DRAINED_MARKER).exists()


def write_marker(path: Path) -> None:
    """Create ``path`` durably (:func:`~tuneplane.agent.atomic_file.write_atomic`): it exists
    whole or not at all."""
    write_atomic(path, f"{int(time.time() * 1000)}\n".encode(), 0o600)


LOCK_FILE = "collector.lock"
#: How often a collector checks that the agent that started it is still there.
PARENT_POLL_S = 1.0
#: Exit status when another collector already serves this state directory (EX_TEMPFAIL).
EXIT_BUSY = 75


def _hold_single_instance(state_dir: Path) -> int | None:
    """An exclusive lock on the state directory, or None when another collector holds it.

    The kernel drops the lock when its holder dies, however it dies.
    """
    fd = os.open(state_dir / LOCK_FILE, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        return None
    return fd


async def run_collector(opts: CollectorOptions) -> int:
    """Run one member's collector until drained (exit status 0) or stopped by a signal (0).

    Exits with :data:`EXIT_BUSY` when another collector already serves ``opts.state_dir``.
    """
    opts.state_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
    lock_fd = _hold_single_instance(opts.state_dir)
    if lock_fd is None:
        log.warning("another collector serves this member; leaving it to finish state_dir=%s",
                    opts.state_dir)  # fmt: skip
        return EXIT_BUSY
    try:
        return await _run_locked(opts)
    finally:
        os.close(lock_fd)


async def _run_locked(opts: CollectorOptions) -> int:
    if drained(opts.state_dir):
        log.info("already drained; nothing to do state_dir=%s", opts.state_dir)
        return 0
    spool = await trio.to_thread.run_sync(
        Spool.open, opts.state_dir / SPOOL_FILE, opts.max_spool_points
    )
    collector = Collector(opts, spool)
    stopped = False
    try:
        async with trio.open_nursery() as nursery:

            async def on_signal() -> None:
                nonlocal stopped
                with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
                    async for signum in signals:
                        log.info("collector stopping signal=%s spool=%d",
                                 signal.Signals(signum).name, spool.depth)  # fmt: skip
                        stopped = True
                        nursery.cancel_scope.cancel()
                        return

            async def watch_parent(parent: int) -> None:
                # A collector belongs to the agent that started it. If the agent is SIGKILLed,
                # this orphan would otherwise retry forever beside the one the restarted agent
                # starts; stopping loses nothing (the spool and checkpoint resume it). Polling
                # getppid is used rather than PR_SET_PDEATHSIG, which fires when the *thread*
                # that spawned us exits (Trio spawns from a worker thread it later retires).
                # The agent names itself (--agent-pid): an agent killed while this process was
                # still starting has already left it to init, and "the parent at start" would
                # then be init, never gone.
                nonlocal stopped
                while os.getppid() == parent:
                    await trio.sleep(PARENT_POLL_S)
                log.info("the agent that started this collector is gone; stopping spool=%d",
                         spool.depth)  # fmt: skip
                stopped = True
                nursery.cancel_scope.cancel()

            nursery.start_soon(on_signal)
            nursery.start_soon(watch_parent, opts.agent_pid or os.getppid())
            await collector.run()
            nursery.cancel_scope.cancel()
    finally:
        spool.close()
    if stopped:
        return 0
    await trio.to_thread.run_sync(write_marker, opts.state_dir / DRAINED_MARKER)
    log.info(
        "telemetry delivered; collector done run_id=%s attempt=%d member=%d",
        opts.run_id,
        opts.attempt,
        opts.member_index,
    )
    return 0
