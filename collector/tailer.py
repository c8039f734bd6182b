"""The tailer: follows one member's telemetry files and hands out batches of points.

Rules:
- Hand-off: every :class:`Batch` carries the decoded position of every stream *after* it. The
  consumer makes the batch's points durable first (the spool), then calls :meth:`Tailer.commit`;
  only then does the checkpoint advance. A crash in between re-reads those bytes, and the points
  come back with the same dedup keys. Committing batch N declares every batch up to N durable;
  committing it again, or an older one, changes nothing.
- The stream table (which inode is which source identity) is checkpointed before any point of
  a new stream is handed out, so identities are stable across restarts.
- While the writers run, each poll decodes a bounded amount per stream; once ``writers_done``
  is set, the tailer drains every stream to its end, reports incomplete tails, and finishes.
- What is followed: the files :func:`~tuneplane.collector.files.discover` finds under the root
  with its :class:`Layout`, new files and directories included, within :class:`ScanLimits`.
  A file's tags (and the tags its marks name) get its run in front (``tb/run1`` + ``loss`` is
  ``tb/run1/loss``), so two writers' ``loss`` never merge into one Series name.
- The files are walked, stat'ed and read in worker threads (:mod:`.poll_io`, which says how
  often the directory walk is repeated); the files already found are looked at every poll.
- A bound that leaves telemetry unread is said once per member (:mod:`.bound_notices`).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import attrs
import trio

from .batches import Batch, Position, TailerStatistics
from .bound_notices import BoundNotices
from .checkpoint import CheckpointError, load_checkpoint, save_checkpoint
from .files import Layout, ScanLimits, make_decoder, mark_in_run, points_in_run
from .point_rules import PointScreen, storable
from .points import Decoder, Mark, ReadWarning, ScalarPoint
from .poll_io import Walker, read_new
from .tb_runs import opening_state
from .tracking import (
    HEAD_BYTES,
    Adopted,
    Change,
    Moved,
    NotFollowed,
    Opened,
    Restarted,
    SkippedCopy,
    Stream,
    Tracker,
    Vanished,
)

log = logging.getLogger(__name__)

POLL_BYTES = 8 * 1024 * 1024


@attrs.define
class _Counters:
    polls: int = 0
    points: int = 0
    warnings: int = 0
    data_loss: int = 0
    truncations: int = 0
    replacements: int = 0
    adoptions: int = 0
    skipped_copies: int = 0
    not_followed: int = 0
    walk_limited: bool = False


class Tailer:
    """Follows ``root`` (a member's output or telemetry directory, as ``layout`` says),
    checkpointing into ``checkpoint``; ``source_prefix`` goes in front of every new stream's
    source id (:class:`~tuneplane.collector.tracking.Tracker`).

    Use::

        send, receive = trio.open_memory_channel[Batch](0)
        nursery.start_soon(tailer.run, send, writers_done)
        async for batch in receive:
            await spool.append(batch.points)   # durable first
            await tailer.commit(batch)         # then the read position advances
    """

    def __init__(
        self,
        root: Path,
        checkpoint: Path,
        *,
        poll_interval: float = 0.5,
        poll_bytes: int = POLL_BYTES,
        layout: Layout | None = None,
        limits: ScanLimits | None = None,
        source_prefix: str = "",
    ) -> None:
        self._root = root
        self._layout = layout or Layout()
        self._limits = limits or ScanLimits()
        self._checkpoint = checkpoint
        self._poll_interval = poll_interval
        self._poll_bytes = poll_bytes
        body = load_checkpoint(checkpoint)
        if body is not None and body.get("root") != str(root):
            raise CheckpointError(
                f"checkpoint {checkpoint} belongs to telemetry directory {body.get('root')!r}, "
                f"not {str(root)!r}; give each member its own checkpoint file"
            )
        self._tracker = (
            Tracker.from_json(body["tracker"], source_prefix)
            if body
            else Tracker(source_prefix=source_prefix)
        )
        noted = body.get("noted", ()) if body else ()
        self._bound_notices = BoundNotices(root, self._limits, noted)
        self._walker = Walker(root, self._layout, self._limits)
        self._decoders: dict[str, Decoder] = {}
        self._positions: dict[str, Position] = {
            s.source_id: Position(s.committed, s.committed_state)
            for s in self._tracker.streams.values()
        }
        self._sent_positions: dict[str, Position] = {}
        self._seq = 0
        self._committed_seq = 0
        self._skipped_copies: set[str] = set()
        self._counters = _Counters()
        self._persist_lock = trio.Lock()
        self._screen = PointScreen()

    def statistics(self) -> TailerStatistics:
        c = self._counters
        return TailerStatistics(
            polls=c.polls,
            streams=len(self._tracker.streams),
            live_streams=len(self._tracker.live()),
            points=c.points,
            warnings=c.warnings,
            data_loss_warnings=c.data_loss,
            files_not_followed=c.not_followed,
            walk_limited=c.walk_limited,
            truncations=c.truncations,
            replacements=c.replacements,
            adoptions=c.adoptions,
            skipped_copies=c.skipped_copies,
            batches_sent=self._seq,
            batches_committed=self._committed_seq,
        )

    async def run(self, send: trio.MemorySendChannel[Batch], writers_done: trio.Event) -> None:
        """Poll until ``writers_done`` is set, then drain every stream and close ``send``."""
        async with send:
            while not writers_done.is_set():
                await self._poll(send, final=False)
                with trio.move_on_after(self._poll_interval):
                    await writers_done.wait()
            # Drain: repeat until a whole pass decodes nothing more.
            draining = True
            while draining:
                draining = await self._poll(send, final=True)
            # Bytes that held no points (graphs, hparams lines) still move positions: one last
            # batch lets the consumer commit the checkpoint to the very end.
            if self._positions != self._sent_positions:
                await self._send(send, [], [])
        log.info(
            "telemetry drained root=%s points=%d warnings=%d",
            self._root,
            self._counters.points,
            self._counters.warnings,
        )

    async def commit(self, batch: Batch) -> None:
        """Record that ``batch`` (and every earlier one) is durable; persists the checkpoint."""
        if batch.seq <= self._committed_seq:
            return
        for source_id, position in batch.positions.items():
            stream = self._tracker.streams.get(source_id)
            if stream is not None:
                stream.committed = position.offset
                stream.committed_state = dict(position.state)
        self._bound_notices.committed(batch.warnings)
        self._committed_seq = batch.seq
        await self._persist()

    async def _persist(self) -> None:
        body = {
            "root": str(self._root),
            "tracker": self._tracker.to_json(),
            "noted": sorted(self._bound_notices.noted),
        }
        async with self._persist_lock:
            await trio.to_thread.run_sync(save_checkpoint, self._checkpoint, body)

    async def _send(
        self,
        send: trio.MemorySendChannel[Batch],
        points: list[ScalarPoint],
        warnings: list[ReadWarning],
        marks: list[Mark] | None = None,
    ) -> None:
        # A point the gateway would refuse (a step beyond int64, an absurd wall time, a name
        # that cannot travel) becomes a data-loss warning here, before it can reach the spool.
        points, refused = self._screen.screen(points, time.time())
        warnings = [*warnings, *refused]
        self._seq += 1
        self._counters.points += len(points)
        self._counters.warnings += len(warnings)
        for warning in warnings:
            if warning.data_loss:
                self._counters.data_loss += 1
                log.warning(
                    "telemetry data loss source=%s offset=%d kind=%s line=%s",
                    storable(warning.source),
                    warning.offset,
                    warning.kind,
                    warning.line,
                )
        self._sent_positions = dict(self._positions)
        await send.send(Batch(self._seq, points, warnings, self._sent_positions, list(marks or ())))

    async def _poll(self, send: trio.MemorySendChannel[Batch], *, final: bool) -> bool:
        """One pass: scan, update identities, decode new bytes. True when anything advanced."""
        stats, walk_limited = await trio.to_thread.run_sync(self._walker.scan, final)
        changes = self._tracker.observe(stats, final=final, max_live=self._limits.max_files)
        notices = self._apply(changes)
        notices += self._bounds(changes, walk_limited)
        if any(not isinstance(c, Vanished | SkippedCopy | NotFollowed) for c in changes):
            await self._persist()
        if notices:
            await self._send(send, [], notices)
        advanced = False
        for stream in self._tracker.live():
            decoder = self._decoder(stream)
            chunks = await trio.to_thread.run_sync(
                read_new, self._root, stream, decoder, final, self._poll_bytes
            )
            # The run (its tags' prefix) is the opened path's, whatever the source id's prefix.
            run = self._layout.run(self._tracker.unprefixed(stream.source_id))
            for points, warnings, position, state, seen, marks in chunks:
                if run:
                    points = points_in_run(run, points)
                    marks = [mark_in_run(run, mark) for mark in marks]
                advanced = advanced or position != stream.position
                self._tracker.advance(stream.source_id, position, seen)
                self._positions[stream.source_id] = Position(position, state)
                if points or warnings or marks:
                    await self._send(send, points, warnings, marks)
        self._counters.polls += 1
        return advanced

    def _decoder(self, stream: Stream) -> Decoder:
        decoder = self._decoders.get(stream.source_id)
        if decoder is None:
            position = self._positions.get(stream.source_id)
            state = dict(position.state) if position else None
            if not state and stream.kind == "tfevents":
                # TensorBoard reads a run directory's event files one after the other: a new
                # file starts from the restart rule's state where the file before it stands.
                state = opening_state(stream.path, self._decoder_states())
            decoder = make_decoder(stream.kind, stream.path, stream.source_id, state)
            self._decoders[stream.source_id] = decoder
        decoder.source = stream.path
        return decoder

    def _decoder_states(self) -> list[tuple[str, Mapping[str, Any]]]:
        return [
            (self._tracker.streams[source_id].path, decoder.snapshot())
            for source_id, decoder in self._decoders.items()
            if source_id in self._tracker.streams
        ]

    def _apply(self, changes: list[Change]) -> list[ReadWarning]:
        notices: list[ReadWarning] = []
        for change in changes:
            if isinstance(change, Opened):
                self._positions[change.source_id] = Position(0, {})
                log.info("telemetry stream opened source_id=%s", change.source_id)
            elif isinstance(change, Moved):
                log.info(
                    "telemetry file renamed source_id=%s from=%s to=%s",
                    change.source_id,
                    change.old_path,
                    change.path,
                )
            elif isinstance(change, Restarted):
                self._positions[change.new_id] = Position(0, {})
                if change.reason == "truncated":
                    self._counters.truncations += 1
                else:
                    self._counters.replacements += 1
                notices.append(
                    ReadWarning(
                        change.path,
                        0,
                        change.reason,
                        f"the file was {change.reason} ({change.size} bytes now, {change.seen} "
                        f"read before); it is read again from byte 0 as {change.new_id!r}. Bytes "
                        "written after the last read are lost unless a rotated copy turns up",
                        data_loss=False,
                    )
                )
                log.info(
                    "telemetry stream restarted old=%s new=%s reason=%s",
                    change.old_id,
                    change.new_id,
                    change.reason,
                )
            elif isinstance(change, Adopted):
                self._counters.adoptions += 1
                log.info(
                    "telemetry copy continues stream source_id=%s path=%s",
                    change.source_id,
                    change.path,
                )
            elif isinstance(change, Vanished):
                log.info(
                    "telemetry file vanished source_id=%s path=%s", change.source_id, change.path
                )
            elif isinstance(change, NotFollowed):
                continue  # see _bounds
            elif change.path not in self._skipped_copies:
                self._skipped_copies.add(change.path)
                self._counters.skipped_copies += 1
                notices.append(
                    ReadWarning(
                        change.path,
                        0,
                        "copy-skipped",
                        f"the file starts with the same {HEAD_BYTES} bytes as "
                        f"{change.source_id!r}, which is still read; it is taken for a copy and "
                        "not read, so its points are not counted twice",
                        data_loss=False,
                    )
                )
        return notices

    def _bounds(self, changes: list[Change], walk_limited: bool) -> list[ReadWarning]:
        """The once-per-member warnings of a bound that leaves telemetry unread."""
        skipped = [c for c in changes if isinstance(c, NotFollowed)]
        self._counters.not_followed = len(skipped)
        self._counters.walk_limited = walk_limited
        return self._bound_notices.notices(skipped, walk_limited)
