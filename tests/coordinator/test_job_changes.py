"""Change notices for WatchJob: the store tells its commit observers only after a commit, and
the book of watches forgets a watch however it ends."""

from __future__ import annotations

import asyncio
from pathlib import Path

import anyio
import pytest

from tests.support.store_backend import current
from tuneplane.coordinator.job_changes import JobChanges, TooManyWatches
from tuneplane.coordinator.store.core import Store

WAIT_S = 30.0


class Boom(Exception):
    """What the rolled-back transaction raises."""


def test_the_store_names_changed_jobs_only_after_the_commit(tmp_path: Path) -> None:
    told: list[frozenset[str]] = []

    async def go() -> list[frozenset[str]]:
        store = await Store.open(current().where(tmp_path / "c.db"))
        try:
            store.commit_observers.append(told.append)
            # Outside a transaction nothing changes: nobody is told.
            store.changed("run-outside")
            async with store.transaction() as db:
                store.changed("run-a")
                store.changed("run-b")
                store.changed("run-a")
                await db.execute("UPDATE schema_version SET version = version")
                during = list(told)
            with pytest.raises(Boom):
                async with store.transaction() as db:
                    store.changed("run-rolled-back")
                    raise Boom()
            return during
        finally:
            await store.close()

    during = asyncio.run(asyncio.wait_for(go(), WAIT_S))
    assert during == []
    assert told == [frozenset({"run-a", "run-b"})]


@pytest.mark.sqlite_only("pure: no store")
def test_a_watch_wakes_on_a_change_after_it_was_armed() -> None:
    async def go() -> tuple[bool, bool, int]:
        changes = JobChanges()
        with changes.watching("run-a") as watch:
            changes.changed(["run-a"])
            # A notice before arming is forgotten by arm(); the read that follows sees it.
            watch.arm()
            async with anyio.create_task_group() as tg:
                woke: list[bool] = []

                async def wait() -> None:
                    woke.append(await watch.wait(WAIT_S))

                tg.start_soon(wait)
                await anyio.wait_all_tasks_blocked()
                changes.changed(["run-b", "run-a"])
            watch.arm()
            # No change since it was armed again: the wait ends on its timeout and says so.
            timed_out = await watch.wait(0)
            return woke[0], timed_out, changes.statistics().watches

    woke, timed_out, watches = asyncio.run(asyncio.wait_for(go(), WAIT_S))
    assert woke is True and timed_out is False and watches == 1


@pytest.mark.sqlite_only("pure: no store")
def test_a_cancelled_watch_leaves_no_waiter_and_the_limit_counts_open_ones() -> None:
    async def go() -> tuple[int, int, str]:
        changes = JobChanges(max_watches=2)
        with anyio.CancelScope() as scope:
            async with anyio.create_task_group() as tg:

                async def watch_forever(run_id: str) -> None:
                    with changes.watching(run_id) as watch:
                        watch.arm()
                        await watch.wait(3600)

                tg.start_soon(watch_forever, "run-a")
                tg.start_soon(watch_forever, "run-a")
                await anyio.wait_all_tasks_blocked()
                during = changes.statistics().watches
                with pytest.raises(TooManyWatches) as refused, changes.watching("run-b"):
                    raise AssertionError("a third watch was opened over the limit of 2")
                scope.cancel()
        after = changes.statistics()
        with changes.watching("run-b"):
            reopened = changes.statistics().run_ids
        return during, after.watches + after.run_ids + reopened - 1, str(refused.value)

    during, left, sentence = asyncio.run(asyncio.wait_for(go(), WAIT_S))
    assert during == 2
    assert left == 0
    assert "already serves 2 WatchJob streams" in sentence and "job_watches" in sentence
