"""A control stream's outbox and its silence watch, on their own (pure, with Trio's mock clock).

The real stream over TLS is tested in test_server.py (a silent stream closed after the heartbeat
timeout) and test_heartbeats.py (heartbeats acked); these pin the rules underneath.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import anyio
import pytest
import trio
import trio.testing

from tuneplane.coordinator.gateways.sessions import NodeSession, Outbox, SessionRegistry
from tuneplane.coordinator.gateways.silence import SilenceWatch
from tuneplane.proto import v1

# ----- the outbox -------------------------------------------------------------------------------


async def test_the_outbox_hands_out_in_order_and_wakes_a_waiting_pump() -> None:
    outbox = Outbox(limit=4)
    got: list[object] = []
    async with trio.open_nursery() as nursery:

        async def pump() -> None:
            for _ in range(3):
                got.append(await outbox.get())

        nursery.start_soon(pump)
        await trio.testing.wait_all_tasks_blocked()
        assert got == []  # nothing queued: the pump waits
        ack = v1.CoordinatorMessage(heartbeat_ack=v1.HeartbeatAck(seq=1))
        assert outbox.put(b"first")
        assert outbox.put(ack)
        await trio.testing.wait_all_tasks_blocked()
        assert outbox.put(b"third")
    assert got == [b"first", ack, b"third"]
    assert len(outbox) == 0


def test_a_full_outbox_takes_nothing_more() -> None:
    outbox = Outbox(limit=2)
    assert outbox.put(b"a") and outbox.put(b"b")
    assert not outbox.put(b"c")
    assert len(outbox) == 2


async def test_a_full_outbox_closes_its_session_and_the_registry_sends_no_more() -> None:
    registry = SessionRegistry()
    session = NodeSession.create("node-a")
    session.outbox = Outbox(limit=1)
    registry.attach(session)
    ack = v1.CoordinatorMessage(heartbeat_ack=v1.HeartbeatAck(seq=1))
    assert registry.send("node-a", ack)
    assert not registry.send("node-a", ack)  # full: the Node stopped reading
    assert session.close_reason == "the Node stopped reading its control stream"
    assert session.scope.cancel_called
    assert not session.send(b"late")  # a closing session queues nothing
    assert len(session.outbox) == 1
    assert not registry.send("node-b", ack)  # no session at all


# ----- the silence watch ------------------------------------------------------------------------


@asynccontextmanager
async def _watching(watch: SilenceWatch) -> AsyncIterator[trio.Event]:
    """Run ``watch.until_silent()`` in a task; the event is set when it returns."""
    silent = trio.Event()

    async def watching() -> None:
        await watch.until_silent()
        silent.set()

    async with trio.open_nursery() as nursery:
        nursery.start_soon(watching)
        await trio.testing.wait_all_tasks_blocked()
        yield silent


async def _after(clock: trio.testing.MockClock, seconds: float) -> None:
    clock.jump(seconds)
    await trio.testing.wait_all_tasks_blocked()


async def test_a_reader_waiting_the_whole_timeout_is_silent(
    mock_clock: trio.testing.MockClock,
) -> None:
    mock_clock.autojump_threshold = 0
    watch = SilenceWatch(15.0)
    watch.waiting()
    started = trio.current_time()
    await watch.until_silent()
    assert trio.current_time() - started == pytest.approx(15.0)


async def test_each_message_heard_starts_the_wait_again(mock_clock: trio.testing.MockClock) -> None:
    watch = SilenceWatch(15.0)
    watch.waiting()
    async with _watching(watch) as silent:
        for _ in range(5):  # a heartbeat every 10 s, for 50 s
            await _after(mock_clock, 10)
            watch.heard()
            watch.waiting()
        await _after(mock_clock, 14.9)
        assert not silent.is_set()
        await _after(mock_clock, 0.2)
        assert silent.is_set()


async def test_time_spent_handling_a_message_is_not_the_nodes_silence(
    mock_clock: trio.testing.MockClock,
) -> None:
    """The reader heard a message and the store took 40 s to take it (longer than the timeout):
    the Node is silent only once its next wait has lasted the timeout."""
    watch = SilenceWatch(15.0)
    watch.waiting()
    async with _watching(watch) as silent:
        await _after(mock_clock, 5)
        watch.heard()  # then handling it takes 40 s
        for _ in range(4):
            await _after(mock_clock, 10)
        assert not silent.is_set()
        watch.waiting()
        await _after(mock_clock, 14)
        assert not silent.is_set()
        await _after(mock_clock, 1)
        assert silent.is_set()


async def test_the_watch_runs_on_anyio(mock_clock: trio.testing.MockClock) -> None:
    """The gateway runs on asyncio through anyio; the watch uses anyio's clock, here Trio's."""
    mock_clock.autojump_threshold = 0
    watch = SilenceWatch(1.0)
    watch.waiting()
    with anyio.fail_after(2):
        await watch.until_silent()
