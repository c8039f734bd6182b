"""The coordinator's side of log shipping: a Node's LogChunk in, a LogAck out.

Rules: a chunk is stored (:class:`~tuneplane.coordinator.store.logs.LogStore`) before it is
acknowledged, and the acknowledgement names the offset the Node continues from, so a resent chunk
is never stored twice. A chunk for a member this Node does not hold, or for a stream that does not
exist, is acknowledged as ended so the Node stops sending it; it is never stored.
"""

from __future__ import annotations

import logging

from tuneplane.proto import v1

from ..store.core import Store
from ..store.logs import STREAMS, LogStore
from ..wire.members import member_key, member_ref

log = logging.getLogger(__name__)


async def receive_chunk(
    store: Store, logs: LogStore, node_id: str, chunk: v1.LogChunk, now: int
) -> v1.LogAck:
    """Store ``chunk`` from ``node_id`` and return the acknowledgement to send back."""
    member = member_key(chunk.member)
    ref = member_ref(member)
    held = await store.holds_member(node_id, member)
    if not held or chunk.stream not in STREAMS:
        log.warning(
            "log chunk refused node=%s run_id=%s attempt=%d member=%d stream=%s",
            node_id,
            member.run_id,
            member.attempt,
            member.member_index,
            chunk.stream,
        )
        return v1.LogAck(member=ref, stream=chunk.stream, offset=chunk.offset, eof=True)
    done = await logs.append(member, chunk.stream, chunk.offset, chunk.data, chunk.eof, now)
    return v1.LogAck(member=ref, stream=chunk.stream, offset=done.offset, eof=done.complete)
