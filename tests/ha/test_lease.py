"""The leader lease and fencing on a real PostgreSQL database.

Each desk is a real connection, as each coordinator's is; "the leader died" is its connection
closing (what the kernel does for a killed process), "the leader hung" is a desk that stops
renewing. Fencing is shown on a real store: a write under a term that was taken over is refused,
changes nothing, and tells its coordinator; a takeover waits for a write in flight.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import pytest

from tests.support.postgres import run_async
from tests.support.store_backend import StoreBackend
from tuneplane.coordinator.leadership import LeaseRow, Verdict, judge
from tuneplane.coordinator.store.core import Store
from tuneplane.coordinator.store.handle import Fenced, StoreError
from tuneplane.coordinator.store.lease import CoordinatorFacts, LeaseDesk
from tuneplane.coordinator.store_location import PostgresUrl, parse_store_url

TTL_MS = 5000

pytestmark = pytest.mark.timeout(120)


def _url(backend: StoreBackend) -> PostgresUrl:
    return parse_store_url(backend.url(), "the test database")


@asynccontextmanager
async def _desk(url: PostgresUrl) -> AsyncIterator[LeaseDesk]:
    desk = await LeaseDesk.open(url)
    try:
        yield desk
    finally:
        await desk.close()


async def _campaign_once(desk: LeaseDesk, me: str, ttl_ms: int = TTL_MS) -> int | None:
    lease = await desk.read()
    if judge(lease).verdict is Verdict.WAIT:
        return None
    return await desk.take(me, ttl_ms, lease)


async def _decisions(store: Store, kind: str) -> int:
    rows = await store.reader.execute_fetchall(
        "SELECT COUNT(*) FROM decisions WHERE kind = ?", (kind,)
    )
    return int(rows[0][0])


async def _write(store: Store, kind: str) -> None:
    async def work() -> None:
        async with store.transaction() as db:
            await store.log_decision(db, 1, kind, {})

    await store.shielded(work)


def test_the_first_coordinator_takes_the_lease_and_a_second_waits_while_it_lives(
    pg_backend: StoreBackend,
) -> None:
    async def go() -> None:
        url = _url(pg_backend)
        async with _desk(url) as a, _desk(url) as b:
            assert await a.read() is None
            assert await _campaign_once(a, "coord-a") == 1
            lease = await b.read()
            assert lease is not None and lease.holder == "coord-a" and lease.holder_alive
            assert judge(lease).verdict is Verdict.WAIT
            assert await _campaign_once(b, "coord-b") is None
            # Even told it is free, take() re-reads and refuses a lease that is alive.
            assert await b.take("coord-b", TTL_MS, lease) is None
            assert await a.renew("coord-a", 1, TTL_MS)
            after = await b.read()
            assert after is not None and (after.term, after.holder) == (1, "coord-a")

    run_async(go)


def test_a_dead_leaders_session_lets_a_standby_take_over_at_once_and_fences_it(
    pg_backend: StoreBackend,
) -> None:
    async def go() -> None:
        url = _url(pg_backend)
        async with _desk(url) as b:
            a = await LeaseDesk.open(url)
            assert await _campaign_once(a, "coord-a") == 1
            await a.close()  # the leader's process died: its connection closed
            lease = await b.read()
            assert lease is not None and not lease.holder_alive
            assert lease.expires_ms > lease.now_ms, "taken over before the lease expired"
            reading = judge(lease)
            assert reading.verdict is Verdict.TAKE_OVER and "session ended" in reading.why
            assert await b.take("coord-b", TTL_MS, lease) == 2
            async with _desk(url) as again:
                # The old leader back with the same name cannot renew the term it lost.
                assert not await again.renew("coord-a", 1, TTL_MS)
                assert not await again.resign("coord-a", 1)

    run_async(go)


def test_a_leader_that_stops_renewing_loses_the_lease_when_it_expires(
    pg_backend: StoreBackend,
) -> None:
    async def go() -> None:
        url = _url(pg_backend)
        async with _desk(url) as a, _desk(url) as b:
            assert await _campaign_once(a, "coord-a", ttl_ms=300) == 1
            # Hung: alive, connected, not renewing. The standby waits until the lease expires.
            while True:
                lease = await b.read()
                assert lease is not None and lease.holder_alive
                if judge(lease).verdict is Verdict.TAKE_OVER:
                    break
                assert lease.expires_ms > lease.now_ms
                await asyncio.sleep(0.05)
            assert "did not renew" in judge(lease).why
            assert await b.take("coord-b", TTL_MS, lease) == 2
            assert not await a.renew("coord-a", 1, TTL_MS), "the hung leader is fenced"

    run_async(go)


def test_two_standbys_racing_for_one_lease_give_exactly_one_leader(
    pg_backend: StoreBackend,
) -> None:
    async def go() -> None:
        url = _url(pg_backend)
        async with _desk(url) as a:
            assert await _campaign_once(a, "coord-a", ttl_ms=1) == 1
            await asyncio.sleep(0.01)
            async with _desk(url) as b, _desk(url) as c:
                seen = await b.read()
                assert seen is not None
                won = await asyncio.gather(
                    b.take("coord-b", TTL_MS, seen), c.take("coord-c", TTL_MS, seen)
                )
                assert sorted(won, key=lambda t: t or 0) == [None, 2]
                lease = await a.read()
                assert lease is not None and lease.term == 2
                assert lease.holder == ("coord-b" if won[0] else "coord-c")

    run_async(go)


def test_a_write_under_a_term_taken_over_is_refused_and_changes_nothing(
    pg_backend: StoreBackend, tmp_path: Path
) -> None:
    async def go() -> None:
        url = _url(pg_backend)
        told: list[str] = []
        async with _desk(url) as a, _desk(url) as b:
            old = await Store.open(url)
            try:
                assert await _campaign_once(a, "coord-a", ttl_ms=1) == 1
                old.fence(1, lambda: told.append("fenced"), TTL_MS / 1000)
                await _write(old, "before the takeover")
                await asyncio.sleep(0.01)
                assert await _campaign_once(b, "coord-b") == 2
                with pytest.raises(Fenced, match="term 1"):
                    await _write(old, "after the takeover")
                assert told == ["fenced"]
                assert await _decisions(old, "before the takeover") == 1
                assert await _decisions(old, "after the takeover") == 0
                new = await Store.open(url)
                try:
                    new.fence(2, lambda: told.append("wrongly fenced"), TTL_MS / 1000)
                    await _write(new, "by the new leader")
                    assert await _decisions(new, "by the new leader") == 1
                finally:
                    await new.close()
                assert told == ["fenced"]
            finally:
                await old.close()

    run_async(go)


def test_a_takeover_waits_for_the_old_leaders_write_in_flight(pg_backend: StoreBackend) -> None:
    async def go() -> None:
        url = _url(pg_backend)
        async with _desk(url) as a, _desk(url) as b:
            old = await Store.open(url)
            try:
                assert await _campaign_once(a, "coord-a", ttl_ms=1) == 1
                old.fence(1, lambda: None, TTL_MS / 1000)
                in_flight = asyncio.Event()
                finish = asyncio.Event()

                async def slow_write() -> None:
                    async with old.transaction() as db:
                        await old.log_decision(db, 1, "in flight", {})
                        in_flight.set()
                        await finish.wait()

                writer = asyncio.ensure_future(slow_write())
                await in_flight.wait()
                await asyncio.sleep(0.01)
                seen = await b.read()
                assert seen is not None and judge(seen).verdict is Verdict.TAKE_OVER
                taking = asyncio.ensure_future(b.take("coord-b", TTL_MS, seen))
                await asyncio.sleep(0.3)
                assert not taking.done(), "the takeover did not wait for the write in flight"
                finish.set()
                await writer
                assert await taking == 2
                # The write that held the old term committed whole, before the term moved.
                assert await _decisions(old, "in flight") == 1
            finally:
                await old.close()

    run_async(go)


def test_a_leader_stalled_mid_write_past_its_lease_does_not_hold_off_the_takeover(
    pg_backend: StoreBackend,
) -> None:
    """A leader paused inside a write transaction (SIGSTOP, a frozen VM) holds the lease row and
    the write lock; the database ends that transaction after the lease's time, so the standby
    takes over within its own lock timeout and the stalled write keeps nothing."""

    async def go() -> None:
        url = _url(pg_backend)
        async with _desk(url) as a, _desk(url) as b:
            old = await Store.open(url)
            try:
                assert await _campaign_once(a, "coord-a", ttl_ms=1) == 1
                old.fence(1, lambda: None, ttl_s=0.5)
                in_flight = asyncio.Event()
                wake = asyncio.Event()

                async def stalled_write() -> None:
                    async with old.transaction() as db:
                        await old.log_decision(db, 1, "stalled", {})
                        in_flight.set()
                        await wake.wait()

                writer = asyncio.ensure_future(stalled_write())
                await in_flight.wait()
                seen = await b.read()
                assert seen is not None and judge(seen).verdict is Verdict.TAKE_OVER
                # b's lock timeout is 2 s: without the stall limit the take fails here.
                assert await b.take("coord-b", TTL_MS, seen) == 2
                wake.set()
                with pytest.raises(StoreError):
                    await writer
                assert await _decisions(old, "stalled") == 0
            finally:
                await old.close()

    run_async(go)


def test_the_roll_call_lists_each_coordinator_once_with_what_it_advertises(
    pg_backend: StoreBackend,
) -> None:
    async def go() -> None:
        url = _url(pg_backend)
        async with _desk(url) as a:
            for pid in (10, 11):  # a restart keeps the name and replaces the row
                await a.register(
                    CoordinatorFacts("coord-a", "host-a", pid, "1.0", "a:1", "a:2", "a:3")
                )
            await a.register(CoordinatorFacts("coord-b", "host-b", 20, "1.0", "b:1", "b:2", "b:3"))
            rows = await a.roll_call()
            assert sorted((r.facts.id, r.facts.pid) for r in rows) == [
                ("coord-a", 11),
                ("coord-b", 20),
            ]
            assert {r.facts.control_address for r in rows} == {"a:2", "b:2"}

    run_async(go)


def test_a_lease_row_is_judged_by_its_session_then_its_expiry() -> None:
    alive = LeaseRow(3, "coord-a", 0, expires_ms=2000, now_ms=1000, holder_alive=True)
    assert judge(None).verdict is Verdict.TAKE_OVER
    assert judge(alive).verdict is Verdict.WAIT
    dead = LeaseRow(3, "coord-a", 0, expires_ms=2000, now_ms=1000, holder_alive=False)
    assert judge(dead).verdict is Verdict.TAKE_OVER
    expired = LeaseRow(3, "coord-a", 0, expires_ms=1000, now_ms=1000, holder_alive=True)
    assert judge(expired).verdict is Verdict.TAKE_OVER
