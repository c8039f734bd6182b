"""Heartbeats are acked from memory and stored in batches: the book, a real coordinator, a lock.

The store is read from the test on a connection of its own, as an operator would; the lock that
stalls the coordinator's writes is a real one held by another connection (SQLite's ``BEGIN
IMMEDIATE`` on the same file, or the store's advisory lock on PostgreSQL).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from contextlib import AsyncExitStack
from pathlib import Path

import pytest

from tests.coordinator.grpc_client import api_client, enroll, node_stream
from tests.support.coordinator import CoordinatorProcess, start_coordinator
from tests.support.processes import wait_until
from tests.support.store_backend import read, where_in, write_lock
from tuneplane.coordinator.auth import JOIN_PREFIX, hash_credential, new_credential
from tuneplane.coordinator.gateways.heartbeats import HeartbeatBook
from tuneplane.coordinator.store.core import Store
from tuneplane.proto import v1

# ----- the book (pure) --------------------------------------------------------------------------


def test_the_book_keeps_the_latest_time_and_hands_out_each_once() -> None:
    book = HeartbeatBook()
    book.record("node-a", 100)
    book.record("node-a", 90)  # out of order: the newer time stays
    book.record("node-b", 50)
    assert book.last("node-a") == 100
    assert book.last("node-c") == 0
    assert book.take() == {"node-a": 100, "node-b": 50}
    assert book.take() == {}
    assert book.last("node-a") == 100  # the live value outlives the flush


def test_a_batch_put_back_does_not_hide_a_newer_time() -> None:
    book = HeartbeatBook()
    book.record("node-a", 100)
    book.record("node-b", 50)
    batch = book.take()
    book.record("node-a", 200)  # heard while the failed flush was in flight
    book.put_back(batch)
    assert book.pending() == 2
    assert book.take() == {"node-a": 200, "node-b": 50}


# ----- a real coordinator -----------------------------------------------------------------------


def _now_ms() -> int:
    return time.time_ns() // 1_000_000


def _stored(state_dir: Path) -> dict[str, int]:
    """node id -> last_heartbeat_ms, as the store file holds it now."""
    return {
        str(node_id): int(at or 0)
        for node_id, at in read(
            where_in(state_dir), Store, "SELECT id, last_heartbeat_ms FROM nodes"
        )
    }


async def _enroll_many(coord: CoordinatorProcess, count: int) -> list[v1.EnrollReply]:
    # Join tokens written straight into the store (the admin CLI would cost a process each).
    tokens = [new_credential(JOIN_PREFIX) for _ in range(count)]
    store = await Store.open(where_in(coord.state_dir))
    try:
        for token in tokens:
            await store.create_join_token(
                hash_credential(token), "default", _now_ms(), _now_ms() + 600_000
            )
    finally:
        await store.close()
    return [
        await enroll(coord.control, coord.ca_path, token, f"hb-{i}", 1)
        for i, token in enumerate(tokens)
    ]


@pytest.fixture
def slow_flush(tmp_path: Path) -> Iterator[CoordinatorProcess]:
    # A flush interval far longer than the test: only the shutdown flush can store the times.
    with start_coordinator(tmp_path, heartbeat_interval=60, heartbeat_timeout=120) as c:
        yield c


def test_the_last_heartbeat_is_live_before_a_flush_and_stored_on_sigterm(
    slow_flush: CoordinatorProcess,
) -> None:
    coord = slow_flush
    (reply,) = asyncio.run(_enroll_many(coord, 1))

    async def beat() -> tuple[int, int]:
        async with node_stream(
            coord.control, coord.ca_path, reply.node_credential, reply.node_id
        ) as node:
            await asyncio.sleep(0.2)  # so the heartbeat's time is clearly after the Hello's
            sent = _now_ms()
            await node.send(heartbeat=v1.Heartbeat(seq=1))
            ack = await node.stream.recv_message()
            assert ack is not None and ack.heartbeat_ack.seq == 1
        async with api_client(coord.api, coord.ca_path, coord.admin_token) as api:
            shown = await api.stub.get_node(v1.GetNodeRequest(node_id=reply.node_id))
        return sent, shown.last_heartbeat_ms

    sent, shown = asyncio.run(beat())
    # The API answers with the live time this process heard...
    assert shown >= sent
    # ...while the store still holds the Hello's: the heartbeat waits for its batch.
    hello_time = _stored(coord.state_dir)[reply.node_id]
    assert 0 < hello_time < sent
    coord.stop()  # SIGTERM; asserts a clean exit
    assert _stored(coord.state_dir)[reply.node_id] == shown


def test_heartbeats_are_acked_while_another_connection_holds_the_store_lock(
    tmp_path: Path,
) -> None:
    nodes = 20
    with start_coordinator(tmp_path, heartbeat_interval=0.5, heartbeat_timeout=30) as coord:
        replies = asyncio.run(_enroll_many(coord, nodes))

        async def beat_under_lock() -> tuple[list[float], int]:
            async with AsyncExitStack() as stack:
                streams = [
                    await stack.enter_async_context(
                        node_stream(coord.control, coord.ca_path, r.node_credential, r.node_id)
                    )
                    for r in replies
                ]
                # A real write lock on the store: every store write now waits for it.
                with write_lock(where_in(coord.state_dir)):
                    latencies: list[float] = []
                    last_sent = 0
                    for seq in (1, 2, 3):
                        last_sent = _now_ms()
                        started = time.monotonic()
                        for node in streams:
                            await node.send(heartbeat=v1.Heartbeat(seq=seq))
                        for node in streams:
                            ack = await asyncio.wait_for(node.stream.recv_message(), 10)
                            assert ack is not None and ack.heartbeat_ack.seq == seq
                            latencies.append(time.monotonic() - started)
                        await asyncio.sleep(0.5)  # a flush is due: it now waits for the lock
                return latencies, last_sent

        latencies, last_sent = asyncio.run(beat_under_lock())
        assert len(latencies) == 3 * nodes
        # Every ack came while the lock was held; a store write would have waited for it.
        assert max(latencies) < 2.5, f"slowest ack {max(latencies):.2f} s"
        # Once the lock is gone the waiting batch lands: each Node's last time is stored.
        ids = {r.node_id for r in replies}
        wait_until(
            "the batched heartbeat times reaching the store",
            lambda: all(at >= last_sent for n, at in _stored(coord.state_dir).items() if n in ids),
        )
