"""One member's pipeline: tail its files, spool the points, ship them, until drained.

Rules:
- Order of durability: a batch goes into the spool (fsync) *before* the tailer's checkpoint moves
  past it, and leaves the spool only after the gateway acknowledged it. A crash anywhere re-reads
  or re-sends; dedup keys make both harmless.
- Backpressure, never loss: when the spool holds ``max_spool_points``, the consumer stops taking
  batches, so the tailer stops reading (the files stay on disk) until shipping makes room; the
  collector logs it and reports it with every call (``tp job show`` shows it).
- Every Ship has a deadline; failures are retried with jittered backoff (0.5 s doubling to 30 s),
  whatever the reason, and logged with the gateway's own sentence. Given more than one gateway
  (coordinators sharing one store), a failed call moves to the next gateway at once and only a
  whole round of failures backs off (:mod:`.gateway_ring`); it stays on whichever accepted.
- Points the gateway refused one by one (the reply names them) are never sent again: they leave
  the spool with the batch and stay recorded as data-loss warnings with their file and offset.
- The member's end is a file the Node writes (``member-exited`` in the state directory); then
  the tailer drains every file and the spool is shipped to empty, and a last call says
  ``drained``.
"""

from __future__ import annotations

import logging
import random
import time
from collections.abc import Callable
from typing import Any, TypeVar

import attrs
import trio

from .batches import Batch
from .gateway_ring import GatewayRing
from .options import CHECKPOINT_FILE, CollectorOptions, followed_root
from .point_rules import REFUSED_KIND, PointScreen, storable
from .points import ReadWarning, ScalarPoint
from .ship_wire import Progress, ShipFailed, TelemetryClient, open_telemetry_client, refusals
from .spool import Spool, SpooledPoint
from .system_sampler import SystemSampling
from .tailer import Tailer

log = logging.getLogger(__name__)
T = TypeVar("T")

EXITED_MARKER = "member-exited"
BATCH_POINTS = 2000
BATCH_MARKS = 100
BACKOFF_FIRST_S = 0.5
BACKOFF_MAX_S = 30.0


def screen_spooled(
    screen: PointScreen, points: list[SpooledPoint], now: float
) -> tuple[list[SpooledPoint], list[ReadWarning]]:
    """The spooled points that may be sent, and a data-loss warning for each other one."""
    sendable, refused = screen.partition(points, now)
    return sendable, [
        ReadWarning(storable(p.source_id), p.offset, REFUSED_KIND, f"{why}; not shipped")
        for p, why in refused
    ]


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
            source_prefix=self.opts.source_prefix,
        )
        async with (
            open_telemetry_client(
                self.opts.gateway, self.opts.ca, self.opts.credential_file, self.opts.fallbacks
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
        ring = GatewayRing(len(client.gateways))
        shipped_to = 0
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
            at = ring.current
            try:
                reply = await client.ship(
                    self.opts.member, sendable, progress, [m.mark for m in marks], at
                )
            except ShipFailed as exc:
                if not ring.failed():
                    log.warning(
                        "telemetry gateway failed; trying the next one now gateway=%s next=%s "
                        "reason=%s",
                        client.gateways[at],
                        client.gateways[ring.current],
                        exc,
                    )
                    continue
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
            ring.succeeded()
            if failures or at != shipped_to:
                log.info("shipping to telemetry gateway=%s", client.gateways[at])
            shipped_to = at
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
