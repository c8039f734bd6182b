"""An idle agent's loops never walk its history: the collector supervisor and the log shipper
read every member once, then only the live ones and those the journal says changed (issue 13,
idle agent). Real SQLite journals with 100 ended members; collectors are real processes (a
stand-in program in the collector's place, which drains once its member ended)."""

from __future__ import annotations

import json
import stat
from collections.abc import Awaitable, Callable
from pathlib import Path

import pytest
import trio
import trio.testing

from tuneplane.agent import collectors
from tuneplane.agent import messages as m
from tuneplane.agent.adapter import open_aio_host
from tuneplane.agent.collectors import (
    DRAINED_MARKER,
    EXITED_MARKER,
    CollectorSupervisor,
)
from tuneplane.agent.journal import Journal
from tuneplane.agent.journal_records import Exit, MemberKey, NewMember
from tuneplane.agent.logship import INTERVAL_S as LOG_INTERVAL_S
from tuneplane.agent.logship import STREAMS, LogShipper, meta_key
from tuneplane.agent.member_state import MemberEvent, MemberState

ENDED = 100
E = MemberEvent
LIFE = (E.PREPARE_SUCCEEDED, E.COMMIT_RECEIVED, E.SPAWN_REQUESTED, E.RUNNER_STARTED)
LIVE = (MemberState.STARTING, MemberState.RUNNING, MemberState.CANCELLING)
# In the collector's place: notes each start in its directory, and once its member ended (the
# supervisor's member-exited marker) writes the drained marker and exits, as a collector does.
STAND_IN = """#!/bin/sh
while [ $# -gt 0 ]; do [ "$1" = --state-dir ] && dir=$2; shift; done
echo started >> "$dir/starts"
while [ ! -e "$dir/member-exited" ]; do sleep 0.02; done
: > "$dir/drained"
"""


def _key(i: int) -> MemberKey:
    return MemberKey(f"run-{i:012d}", 1, 0)


async def _member(
    journal: Journal, root: Path, key: MemberKey, events: tuple[MemberEvent, ...]
) -> None:
    member_dir = root / "members" / str(key)
    member_dir.mkdir(parents=True)
    new = NewMember(key, 1, (0,), str(member_dir), str(root / "out" / str(key)), 5)
    await journal.create_member(new, 1)
    for event in events:
        done = Exit(0, None) if event is E.EXIT_OBSERVED else None
        await journal.transition(key, event, 2, exit=done)


async def _history(journal: Journal, root: Path) -> list[MemberKey]:
    """``ENDED`` members that ran and exited, one after the other."""
    keys = [_key(i) for i in range(ENDED)]
    for key in keys:
        await _member(journal, root, key, (*LIFE, E.EXIT_OBSERVED))
    return keys


def _supervisor(root: Path, journal: Journal) -> CollectorSupervisor:
    supervisor = CollectorSupervisor.under(
        root / "state", journal, root / "ca.pem", system_interval_s=0
    )
    program = root / "collector-stand-in"
    program.write_text(STAND_IN)
    program.chmod(program.stat().st_mode | stat.S_IXUSR)
    supervisor.python = str(program)
    # The stand-in is a program of its own, started as one: no template forks it.
    supervisor.template = None
    return supervisor


def _drained_collectors(supervisor: CollectorSupervisor, keys: list[MemberKey]) -> None:
    """What an earlier run's collectors left: a credential and, once delivered, drained."""
    for key in keys:
        supervisor._write_credential(key, "tpc_test", "127.0.0.1:9")
        (supervisor.directory(key) / DRAINED_MARKER).write_text("drained\n")


async def _until(ready: Callable[[], bool]) -> None:
    """Until ``ready()``; the test's own guard fails it if that never comes."""
    while not ready():
        await trio.sleep(0.01)


async def test_the_journal_reads_only_the_members_asked_for(tmp_path: Path) -> None:
    async with open_aio_host():
        journal = await Journal.open(tmp_path / "journal.db")
        keys = await _history(journal, tmp_path)
        running = MemberKey("run-live", 1, 0)
        await _member(journal, tmp_path, running, LIFE)
        assert len(await journal.members()) == ENDED + 1
        live = await journal.members_of(LIVE)
        assert [(r.key, r.state) for r in live] == [(running, MemberState.RUNNING)]
        named = await journal.members_of(LIVE, {keys[7], keys[3]})
        assert [r.key for r in named] == [keys[3], keys[7], running]
        assert await journal.members_of((), ()) == []
        await journal.close()


async def test_creating_and_moving_a_member_tells_every_follower(
    tmp_path: Path, mock_clock: trio.testing.MockClock
) -> None:
    # The clock stands still: a wait can end only through a change, never its timeout.
    async with open_aio_host():
        journal = await Journal.open(tmp_path / "journal.db")
        first, second = journal.changes.follow(), journal.changes.follow()
        key = MemberKey("run-a", 1, 0)
        await _member(journal, tmp_path, key, ())
        assert first.take() == {key}
        assert first.take() == set()
        # A change not taken yet: waiting returns at once.
        await second.wait(3600)
        assert second.take() == {key} and trio.current_time() == 0
        woke_at: list[float] = []

        async def waiter() -> None:
            await first.wait(3600)
            woke_at.append(trio.current_time())

        async with trio.open_nursery() as nursery:
            nursery.start_soon(waiter)
            await trio.testing.wait_all_tasks_blocked()
            await journal.transition(key, E.PREPARE_SUCCEEDED, 2)
        # Woken by the transition, not by its 3600 s.
        assert woke_at == [0]
        assert first.take() == second.take() == {key}
        await journal.close()


async def test_a_pass_after_the_first_reads_no_ended_member(tmp_path: Path) -> None:
    async with open_aio_host():
        journal = await Journal.open(tmp_path / "journal.db")
        keys = await _history(journal, tmp_path)
        supervisor = _supervisor(tmp_path, journal)
        _drained_collectors(supervisor, keys)
        # Live, with no credential: the supervisor reads it but starts nothing for it.
        await _member(journal, tmp_path, MemberKey("run-live", 1, 0), LIFE)
        async with trio.open_nursery() as nursery:
            # The first pass reads everything (a restart), each later one the live member...
            assert await supervisor.reconcile_pass(nursery) == ENDED + 1
            assert await supervisor.reconcile_pass(nursery, set()) == 1
            assert await supervisor.reconcile_pass(nursery, set()) == 1
            # ...and a member the journal changed, ended or not.
            assert await supervisor.reconcile_pass(nursery, {keys[0]}) == 2
        assert not any((tmp_path / "state" / "collectors").glob("*/starts"))
        await journal.close()


@pytest.mark.timeout(120)
async def test_collectors_start_and_drain_as_members_change(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Only a change can wake a pass: were it missed, the test would hang until its guard.
    monkeypatch.setattr(collectors, "RECONCILE_INTERVAL_S", 3600.0)
    async with open_aio_host():
        journal = await Journal.open(tmp_path / "journal.db")
        keys = await _history(journal, tmp_path)
        supervisor = _supervisor(tmp_path, journal)
        _drained_collectors(supervisor, keys[1:])
        # An earlier run stopped before keys[0]'s collector drained: this one finishes it.
        supervisor._write_credential(keys[0], "tpc_test", "127.0.0.1:9")
        left = supervisor.directory(keys[0])
        member = MemberKey("run-new", 1, 0)
        folder = supervisor.directory(member)
        with trio.fail_after(100):
            async with trio.open_nursery() as nursery:
                nursery.start_soon(supervisor.run)
                await _until((left / DRAINED_MARKER).exists)
                await _member(journal, tmp_path, member, LIFE[:2])
                await supervisor.accept_commit(m.Commit(member, None, "tpc_x", "127.0.0.1:9"))
                for event in LIFE[2:]:
                    await journal.transition(member, event, 3)
                await _until((folder / "starts").exists)
                assert not (folder / EXITED_MARKER).exists()
                await journal.transition(member, E.EXIT_OBSERVED, 4, exit=Exit(0, None))
                await _until((folder / DRAINED_MARKER).exists)
                nursery.cancel_scope.cancel()
        assert (folder / "starts").read_text() == "started\n"
        assert (left / "starts").read_text() == "started\n"
        for key in keys[1:]:
            assert not (supervisor.directory(key) / "starts").exists()
        await journal.close()


def _chunk_inbox() -> tuple[list[m.LogChunk], Callable[[m.Outgoing], Awaitable[None]]]:
    """The chunks a shipper sends, and the send it sends them with."""
    sent: list[m.LogChunk] = []

    async def send(message: m.Outgoing) -> None:
        assert isinstance(message, m.LogChunk)
        sent.append(message)

    return sent, send


async def _shipped_history(journal: Journal, root: Path) -> None:
    """``ENDED`` members whose streams an earlier run shipped to their end."""
    ended = json.dumps({"offset": 0, "done": True})
    for key in await _history(journal, root):
        for stream in STREAMS:
            await journal.set_meta(meta_key(key, stream), ended)


async def test_the_log_shipper_forgets_ended_streams_and_follows_new_members(
    tmp_path: Path,
) -> None:
    sent, send = _chunk_inbox()
    async with open_aio_host():
        journal = await Journal.open(tmp_path / "journal.db")
        await _shipped_history(journal, tmp_path)
        shipper = LogShipper(journal, send)
        await shipper.ship_once()
        assert sent == [] and shipper.following() == []
        # Refused before it ever ran: its streams still end (empty), found through the journal.
        refused = MemberKey("run-refused", 1, 0)
        await _member(journal, tmp_path, refused, (E.PREPARE_FAILED,))
        await shipper.ship_once()
        assert [(c.key, c.stream, c.data, c.eof) for c in sent] == [
            (refused, "stdout", b"", True),
            (refused, "stderr", b"", True),
        ]
        assert shipper.following() == [refused]
        for stream in STREAMS:
            await shipper.acked(m.LogAck(refused, stream, 0, True))
        await shipper.ship_once()
        assert shipper.following() == []
        assert len(sent) == 2
        await journal.close()


class _CountingShipper(LogShipper):
    """A real shipper that tells each pass it ends, so a test can wait for one."""

    def __init__(self, journal: Journal, send: Callable[[m.Outgoing], Awaitable[None]]) -> None:
        super().__init__(journal, send)
        self.passes = 0
        self.passed = trio.Event()

    async def ship_once(self) -> None:
        await super().ship_once()
        self.passes += 1
        self.passed.set()
        self.passed = trio.Event()

    async def until(self, ready: Callable[[], bool]) -> None:
        """Until ``ready()`` holds after a pass; the clock never has to move for it."""
        while not ready():
            await self.passed.wait()


async def test_an_idle_log_shipper_sleeps_until_the_journal_changes_a_member(
    tmp_path: Path, mock_clock: trio.testing.MockClock
) -> None:
    # The clock stands still unless the test moves it: with nothing followed, only a change
    # can wake a pass. The shipper used to poll every INTERVAL_S however idle the Node was
    # (issue 13, idle agent); then this test would hang here until its guard.
    sent, send = _chunk_inbox()
    async with open_aio_host():
        journal = await Journal.open(tmp_path / "journal.db")
        await _shipped_history(journal, tmp_path)
        shipper = _CountingShipper(journal, send)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(shipper.run)
            await shipper.until(lambda: shipper.passes == 1)
            # Idle: an hour goes by without a pass.
            await trio.testing.wait_all_tasks_blocked()
            mock_clock.jump(3600)
            await trio.testing.wait_all_tasks_blocked()
            assert shipper.passes == 1 and sent == []
            # A member starts running: the journal's change wakes the shipper, which follows it.
            member = MemberKey("run-new", 1, 0)
            await _member(journal, tmp_path, member, LIFE)
            await shipper.until(lambda: shipper.following() == [member])
            # Followed: its log grows without telling anyone, so a pass comes each interval.
            (tmp_path / "members" / str(member) / "stdout.log").write_bytes(b"hello\n")
            while not sent:
                await trio.testing.wait_all_tasks_blocked()
                mock_clock.jump(LOG_INTERVAL_S)
            assert [(c.key, c.stream, c.data, c.eof) for c in sent] == [
                (member, "stdout", b"hello\n", False)
            ]
            nursery.cancel_scope.cancel()
        await journal.close()
