"""Ship each member's stdout.log and stderr.log to the coordinator, in acknowledged chunks.

Rules:
- One chunk in flight per member and stream; the next goes only after the coordinator's LogAck,
  whose offset is written to the journal (``meta``: ``logship:<member>:<stream>``) before
  anything else happens. A restarted agent resumes from there, and the coordinator ignores the
  bytes it already holds, so nothing is shipped twice into the store.
- Bounded: a backlog over :data:`KEEP_BYTES` (what the coordinator keeps) is skipped to its last
  :data:`KEEP_BYTES`; the bytes skipped show up as dropped. Sending is limited to
  :data:`RATE_BYTES_PER_S` per Node in chunks of at most :data:`CHUNK_BYTES`, so heartbeats and
  reports on the same stream never wait behind a chatty workload.
- A stream ends (``eof``) once the member is terminal in the journal and everything up to the end
  of its file is acknowledged; a member that never ran ends with an empty stream.
- The first pass reads every member (an earlier run may have left streams unended); later passes
  re-read only the members the journal changed since (:mod:`~tuneplane.agent.journal_changes`)
  and keep the rest from before, and a member whose streams both ended is forgotten: a pass
  costs the members still shipping, never the journal's history.
- A pass runs every :data:`INTERVAL_S` while a member is followed (its files grow without
  telling anyone). With none followed, the shipper sleeps until the journal changes a member
  or a new control stream opens: an idle Node's shipper never wakes.
"""

from __future__ import annotations

import functools
import json
import logging
import math
import os
from collections.abc import Awaitable, Callable
from pathlib import Path

import attrs
import trio

from . import messages as m
from .journal import Journal
from .journal_changes import Follower
from .journal_records import MemberKey, MemberRecord
from .member_state import TERMINAL, MemberState

log = logging.getLogger(__name__)

STREAMS = ("stdout", "stderr")
CHUNK_BYTES = 64 * 1024
KEEP_BYTES = 1024 * 1024
RATE_BYTES_PER_S = 1024 * 1024
# A chunk not acknowledged within this is sent again (the coordinator drops nothing twice).
RESEND_AFTER_S = 5.0
INTERVAL_S = 0.25
# States in which a member may have written logs, or has ended and its streams must be closed.
SHIPPED = frozenset(
    {MemberState.STARTING, MemberState.RUNNING, MemberState.CANCELLING} | set(TERMINAL)
)

Send = Callable[[m.Outgoing], Awaitable[None]]


def meta_key(key: MemberKey, stream: str) -> str:
    """The journal ``meta`` key holding a stream's acknowledged offset."""
    return f"logship:{key}:{stream}"


@attrs.define
class StreamState:
    """How far one member's stream is acknowledged, and the chunk in flight if any."""

    offset: int = 0
    done: bool = False
    in_flight_end: int | None = None
    sent_at: float = 0.0


@attrs.frozen
class NextChunk:
    """What to send next for one stream (pure decision; see :func:`next_chunk`)."""

    offset: int
    length: int
    eof: bool


def next_chunk(
    acked: int, size: int, terminal: bool, budget: int, chunk: int = CHUNK_BYTES
) -> NextChunk | None:
    """The next chunk of a file of ``size`` bytes acknowledged up to ``acked``; None for none.

    A backlog over :data:`KEEP_BYTES` starts at the last :data:`KEEP_BYTES` (the rest is
    dropped); ``budget`` bytes may be sent now. A terminal member whose file is fully sent gets
    an empty ``eof`` chunk.
    """
    if size < acked:
        # The file shrank (truncated by the workload): nothing more can be read where we were.
        size = acked
    start = max(acked, size - KEEP_BYTES)
    length = min(chunk, size - start, budget)
    if size > start and length <= 0:
        return None
    if length <= 0 and not terminal:
        return None
    return NextChunk(start, max(length, 0), terminal and start + max(length, 0) >= size)


def _read(path: Path, offset: int, length: int) -> bytes:
    try:
        with open(path, "rb") as f:
            f.seek(offset)
            return f.read(length)
    except FileNotFoundError:
        return b""


def _size(path: Path) -> int:
    try:
        return os.stat(path).st_size
    except FileNotFoundError:
        return 0


class LogShipper:
    """Owned by the daemon's nursery (:meth:`run`); fed acks by the control session."""

    def __init__(self, journal: Journal, send: Send) -> None:
        self._journal = journal
        self._send = send
        self._streams: dict[tuple[MemberKey, str], StreamState] = {}
        self._wake = trio.Event()
        self._budget = float(RATE_BYTES_PER_S)
        self._refilled_at = 0.0
        # The members whose streams have not both ended, as last read; None before the first.
        self._follower: Follower | None = None
        self._members: dict[MemberKey, MemberRecord] = {}

    async def run(self) -> None:
        """Ship until cancelled."""
        self._refilled_at = trio.current_time()
        while True:
            await self.ship_once()
            if self._follower is not None and not self._members:
                await self._until_woken_or_changed(self._follower)
            else:
                with trio.move_on_after(INTERVAL_S):
                    await self._wake.wait()
            self._wake = trio.Event()

    async def _until_woken_or_changed(self, follower: Follower) -> None:
        """Until :meth:`session_opened` or :meth:`acked` wakes the shipper, or the journal
        changes a member (at once when a change is already waiting to be taken)."""
        async with trio.open_nursery() as nursery:

            async def then_stop(wait: Callable[[], Awaitable[None]]) -> None:
                await wait()
                nursery.cancel_scope.cancel()

            nursery.start_soon(then_stop, self._wake.wait)
            nursery.start_soon(then_stop, functools.partial(follower.wait, math.inf))

    def session_opened(self) -> None:
        """A new control stream: whatever was in flight on the old one is sent again."""
        for state in self._streams.values():
            state.in_flight_end = None
        self._wake.set()

    async def acked(self, ack: m.LogAck) -> None:
        """Record the coordinator's acknowledgement (journal first), then send the next chunk."""
        state = self._streams.get((ack.key, ack.stream))
        if state is None or state.done:
            return
        if ack.offset > state.offset or ack.eof:
            value = {"offset": max(ack.offset, state.offset), "done": ack.eof}
            await self._journal.set_meta(meta_key(ack.key, ack.stream), json.dumps(value))
            state.offset, state.done = int(value["offset"]), ack.eof
            if ack.eof:
                log.info("member logs shipped member=%s stream=%s bytes=%d", ack.key,
                         ack.stream, state.offset)  # fmt: skip
        if state.in_flight_end is not None and (ack.eof or ack.offset >= state.in_flight_end):
            state.in_flight_end = None
        self._wake.set()

    async def _state(self, key: MemberKey, stream: str) -> StreamState:
        state = self._streams.get((key, stream))
        if state is None:
            raw = await self._journal.get_meta(meta_key(key, stream))
            state = StreamState()
            if raw is not None:
                saved = json.loads(raw)
                state = StreamState(int(saved.get("offset", 0)), bool(saved.get("done", False)))
            self._streams[(key, stream)] = state
        return state

    def _refill(self, now: float) -> None:
        elapsed = max(0.0, now - self._refilled_at)
        self._refilled_at = now
        self._budget = min(float(RATE_BYTES_PER_S), self._budget + elapsed * RATE_BYTES_PER_S)

    async def _shipping(self) -> list[MemberRecord]:
        """The members with a stream to ship or end: every member on the first call, then the
        ones kept from before with those the journal changed since read again."""
        if self._follower is None:
            self._follower = self._journal.changes.follow()
            records = await self._journal.members()
        else:
            changed = self._follower.take()
            records = await self._journal.members_of((), changed) if changed else []
        for record in records:
            if record.state in SHIPPED:
                self._members[record.key] = record
        return list(self._members.values())

    def following(self) -> list[MemberKey]:
        """The members a pass looks at: those with a stream not yet ended, as last read."""
        return list(self._members)

    def _forget_if_ended(self, record: MemberRecord) -> None:
        states = [self._streams.get((record.key, stream)) for stream in STREAMS]
        if record.state in TERMINAL and all(state and state.done for state in states):
            del self._members[record.key]
            for stream in STREAMS:
                del self._streams[(record.key, stream)]

    async def ship_once(self) -> None:
        """Send the next chunk of every stream that has no chunk in flight, within the budget."""
        now = trio.current_time()
        self._refill(now)
        for record in await self._shipping():
            for stream in STREAMS:
                if self._budget < 1:
                    return
                await self._ship_stream(record, stream, now)
            self._forget_if_ended(record)

    async def _ship_stream(self, record: MemberRecord, stream: str, now: float) -> None:
        state = await self._state(record.key, stream)
        if state.done:
            return
        if state.in_flight_end is not None and now - state.sent_at < RESEND_AFTER_S:
            return
        path = Path(record.member_dir) / f"{stream}.log"
        terminal = record.state in TERMINAL
        size = await trio.to_thread.run_sync(_size, path)
        plan = next_chunk(state.offset, size, terminal, int(self._budget))
        if plan is None:
            return
        data = b""
        if plan.length:
            data = await trio.to_thread.run_sync(_read, path, plan.offset, plan.length)
        eof = plan.eof and len(data) == plan.length
        self._budget -= len(data)
        state.in_flight_end, state.sent_at = plan.offset + len(data), now
        await self._send(m.LogChunk(record.key, stream, plan.offset, data, eof))
