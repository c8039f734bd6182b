"""``tuneplane-collector run``: tail one member's telemetry, spool it, ship it, drain, exit.

Rules:
- Order of durability: a batch goes into the spool (fsync) *before* the tailer's checkpoint moves
  past it, and leaves the spool only after the gateway acknowledged it. A crash anywhere re-reads
  or re-sends; dedup keys make both harmless.
- Backpressure, never loss: when the spool holds ``max_spool_points``, the consumer stops taking
  batches, so the tailer stops reading (the files stay on disk) until shipping makes room; the
  collector logs it and reports it with every call (``tp job show`` shows it).
- Every Ship has a deadline; failures are retried with jittered backoff (0.5 s doubling to 30 s),
  whatever the reason, and logged with the gateway's own sentence. Points the gateway refused one
  by one (the reply names them) are never sent again: they leave the spool with the batch and
  stay recorded as data-loss warnings with their file and offset.
- What is followed: with ``out_dir``, the member's whole ``$TUNEPLANE_OUT_DIR`` (its telemetry
  directory inside it), else the telemetry directory alone; a checkpoint written by a collector
  that followed the telemetry directory alone keeps it so (its stream names are relative to
  it). See :mod:`tuneplane.collector.files` for which files count and the bounds.
- The member's end is a file the Node writes (``member-exited`` in the state directory). Then
  the tailer drains every file, the spool is shipped to empty, a last call says ``drained``,
  ``drained`` is written beside it, and the process exits 0. SIGTERM/SIGINT stop it early
  without losing anything: it resumes from the spool and checkpoint when started again.
"""

from __future__ import annotations

import fcntl
import logging
import os
import random
import signal
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import attrs
import trio

from tuneplane.agent.atomic_file import write_atomic

from .batches import Batch
from .checkpoint import load_checkpoint
from .files import Layout, ScanLimits, TelemetryPathError
from .point_rules import REFUSED_KIND, PointScreen, storable
from .points import ReadWarning, ScalarPoint
from .ship_wire import (
    Gateway,
    Progress,
    ShipFailed,
    TelemetryClient,
    open_telemetry_client,
    refusals,
)
from .spool import DEFAULT_MAX_POINTS, SPOOL_FILE, Spool, SpooledPoint
from .system_sampler import SystemOptions, SystemSampling
from .tailer import Tailer

log = logging.getLogger(__name__)
T = TypeVar("T")

CHECKPOINT_FILE = "checkpoint.json"
EXITED_MARKER = "member-exited"
DRAINED_MARKER = "drained"
BATCH_POINTS = 2000
BATCH_MARKS = 100
PROGRESS_INTERVAL_S = 5.0
BACKOFF_FIRST_S = 0.5
BACKOFF_MAX_S = 30.0


@attrs.frozen
class CollectorOptions:
    """One member's collector. ``state_dir`` is private to the Node (spool, checkpoint, markers)."""

    telemetry_dir: Path
    state_dir: Path
    gateway: Gateway
    ca: Path
    credential_file: Path
    run_id: str
    attempt: int
    member_index: int
    max_spool_points: int = DEFAULT_MAX_POINTS
    poll_interval_s: float = 0.5
    progress_interval_s: float = PROGRESS_INTERVAL_S
    # The agent that started this collector; None: whatever process is the parent at start.
    agent_pid: int | None = None
    # The member's GPU and process samples (docs/telemetry.md, "System series").
    system: SystemOptions = attrs.field(factory=lambda: SystemOptions(interval_s=0))
    # The member's $TUNEPLANE_OUT_DIR, followed as a whole; None: the telemetry directory only.
    out_dir: Path | None = None
    limits: ScanLimits = attrs.field(factory=ScanLimits)

    @property
    def member(self) -> tuple[str, int, int]:
        return (self.run_id, self.attempt, self.member_index)


def followed_root(opts: CollectorOptions) -> tuple[Path, Layout]:
    """The directory the tailer follows and its layout (see the module notes)."""
    if opts.out_dir is None:
        return opts.telemetry_dir, Layout()
    try:
        inner = opts.telemetry_dir.relative_to(opts.out_dir).as_posix()
    except ValueError:
        raise TelemetryPathError(
            f"the telemetry directory {opts.telemetry_dir} is not inside the output directory "
            f"{opts.out_dir}; give --telemetry-dir under --out-dir, or leave --out-dir out"
        ) from None
    if inner == ".":
        raise TelemetryPathError(
            f"the telemetry directory {opts.telemetry_dir} is the output directory itself; "
            "give its telemetry sub-directory as --telemetry-dir"
        )
    body = load_checkpoint(opts.state_dir / CHECKPOINT_FILE)
    if body is not None and body.get("root") == str(opts.telemetry_dir):
        log.info("the checkpoint follows the telemetry directory only; kept so root=%s",
                 opts.telemetry_dir)  # fmt: skip
        return opts.telemetry_dir, Layout()
    return opts.out_dir, Layout.output_dir(inner)


def drained(state_dir: Path) -> bool:
    """True once a collector delivered everything its member wrote and exited."""
    return (state_dir / DRAINED_MARKER).exists()


def screen_spooled(
    screen: PointScreen, points: list[SpooledPoint], now: float
) -> tuple[list[SpooledPoint], list[ReadWarning]]:
    """The spooled points that may be sent, and a data-loss warning for each other one."""
    sendable, refused = screen.partition(points, now)
    return sendable, [
        ReadWarning(storable(p.source_id), p.offset, REFUSED_KIND, f"{why}; not shipped")
        for p, why in refused
    ]


def write_marker(path: Path) -> None:
    """Create ``path`` durably (:func:`~tuneplane.agent.atomic_file.write_atomic`): it exists
    whole or not at all."""
    write_atomic(path, f"{int(time.time() * 1000)}\n".encode(), 0o600)


def backoff_s(failures: int, jitter: float) -> float:
    """Seconds to wait after ``failures`` failed calls in a row; ``jitter`` in [0, 1)."""
    base = min(BACKOFF_MAX_S, BACKOFF_FIRST_S * 2.0 ** max(failures - 1, 0))
    return base * (0.5 + jitter / 2)


@attrs.define(eq=False)
class _Shared:
    backpressure: bool = False
    tail_done: trio.Event = attrs.field(factory=trio.Event)
    # Set once system sampling stopped (or never ran): the last sample is in the spool.
    sampling_done: trio.Event = attrs.field(factory=trio.Event)
    wrote: trio.Event = attrs.field(factory=trio.Event)
    room: trio.Event = attrs.field(factory=trio.Event)


class Collector:
    def __init__(self, opts: CollectorOptions, spool: Spool) -> None:
        self.opts = opts
        self.spool = spool
        self.writers_done = trio.Event()
        self._shared = _Shared()
        self._spool_lock = trio.Lock()
        self._screen = PointScreen()
        self.sampling = SystemSampling(
            opts.system, opts.state_dir, self._spool_samples, self.spool.full
        )

    async def _spool_call(self, fn: Callable[..., T], *args: Any) -> T:
        """Run a blocking spool method in a worker thread, one at a time."""
        async with self._spool_lock:
            return await trio.to_thread.run_sync(fn, *args)

    async def run(self) -> None:
        """Collect until the member's telemetry is delivered (or until cancelled)."""
        root, layout = followed_root(self.opts)
        tailer = Tailer(
            root,
            self.opts.state_dir / CHECKPOINT_FILE,
            poll_interval=self.opts.poll_interval_s,
            layout=layout,
            limits=self.opts.limits,
        )
        async with (
            open_telemetry_client(
                self.opts.gateway, self.opts.ca, self.opts.credential_file
            ) as client,
            trio.open_nursery() as nursery,
        ):
            send, receive = trio.open_memory_channel[Batch](0)
            nursery.start_soon(self._watch_exit)
            nursery.start_soon(tailer.run, send, self.writers_done)
            nursery.start_soon(self._consume, tailer, receive)
            nursery.start_soon(self._sample)
            await self._ship(client)
            nursery.cancel_scope.cancel()

    async def _watch_exit(self) -> None:
        marker = self.opts.state_dir / EXITED_MARKER
        while not marker.exists():
            await trio.sleep(self.opts.poll_interval_s)
        log.info("member exited; draining run_id=%s member=%d", self.opts.run_id,
                 self.opts.member_index)  # fmt: skip
        self.writers_done.set()

    async def _sample(self) -> None:
        """System samples until the member exited; each is spooled like a batch of points."""
        try:
            if self.opts.system.interval_s > 0:
                await self.sampling.run(self.writers_done)
        finally:
            self._shared.sampling_done.set()
            self._shared.wrote.set()

    async def _spool_samples(self, points: list[ScalarPoint]) -> None:
        await self._spool_call(self.spool.append, points, [])
        self._shared.wrote.set()

    async def _consume(self, tailer: Tailer, receive: trio.MemoryReceiveChannel[Batch]) -> None:
        """Spool each batch, then commit it to the tailer: durable first, then the position."""
        shared = self._shared
        async with receive:
            async for batch in receive:
                while self.spool.full():
                    if not shared.backpressure:
                        shared.backpressure = True
                        log.warning(
                            "spool full; reading paused until points are delivered "
                            "spool=%s points=%d limit=%d",
                            self.spool.path,
                            self.spool.depth,
                            self.spool.max_points,
                        )
                    shared.room = trio.Event()
                    await shared.room.wait()
                if shared.backpressure:
                    shared.backpressure = False
                    log.info("spool has room again; reading resumed points=%d", self.spool.depth)
                if batch.points or batch.warnings or batch.marks:
                    await self._spool_call(
                        self.spool.append, batch.points, batch.warnings, batch.marks
                    )
                    shared.wrote.set()
                await tailer.commit(batch)
        shared.tail_done.set()
        shared.wrote.set()

    async def _progress(self, finished: bool) -> Progress:
        warnings, lost = await self._spool_call(self.spool.warning_counts)
        return Progress(
            spool_points=self.spool.depth,
            backpressure=self._shared.backpressure,
            member_exited=self.writers_done.is_set(),
            drained=finished,
            warnings=warnings,
            data_loss_warnings=lost,
        )

    async def _ship(self, client: TelemetryClient) -> None:
        """Ship until the tailer is done and the spool is empty; the last call says drained."""
        shared = self._shared
        failures = 0
        last_call = -float("inf")
        while True:
            shared.wrote = trio.Event()
            batch = await self._spool_call(self.spool.peek, BATCH_POINTS)
            marks = await self._spool_call(self.spool.peek_marks, BATCH_MARKS)
            finished = (
                shared.tail_done.is_set()
                and shared.sampling_done.is_set()
                and not batch
                and not marks
            )
            quiet = trio.current_time() - last_call < self.opts.progress_interval_s
            if not batch and not marks and not finished and quiet:
                # Nothing to send: wait for new points, or send progress when it is due.
                with trio.move_on_at(last_call + self.opts.progress_interval_s):
                    await shared.wrote.wait()
                continue
            progress = await self._progress(finished)
            # A spool written before the point rule existed (or under another clock) may hold
            # points the gateway would refuse: they go as data loss, never on the wire.
            sendable, unsendable = screen_spooled(self._screen, batch, time.time())
            try:
                reply = await client.ship(
                    self.opts.member, sendable, progress, [m.mark for m in marks]
                )
            except ShipFailed as exc:
                failures += 1
                delay = backoff_s(failures, random.random())
                log.warning(
                    "ship failed; retrying run_id=%s member=%d points=%d in_s=%.1f reason=%s",
                    self.opts.run_id,
                    self.opts.member_index,
                    len(batch),
                    delay,
                    exc,
                )
                await trio.sleep(delay)
                continue
            failures = 0
            last_call = trio.current_time()
            if batch or marks:
                refused = unsendable + refusals(reply)
                for warning in refused:
                    log.warning(
                        "telemetry data loss source=%s offset=%d kind=%s reason=%s",
                        warning.source,
                        warning.offset,
                        warning.kind,
                        warning.message,
                    )
                await self._spool_call(
                    self.spool.acknowledge,
                    batch[-1].id if batch else 0,
                    refused,
                    marks[-1].id if marks else 0,
                )
                shared.room.set()
                log.debug("points delivered count=%d stored=%d duplicates=%d spool=%d",
                          len(batch), reply.stored, reply.duplicates,
                          self.spool.depth)  # fmt: skip
            if finished:
                return


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
