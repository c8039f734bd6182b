"""Scheduling passes coalesce: wakes that come while a pass runs cause one more pass, not one each.

A real store file; the pass is held up by a real write lock that another SQLite connection holds
on the same file, so the wakes provably arrive while it runs.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

import anyio

from tests.support.store_backend import current, write_lock
from tuneplane.coordinator.catalogue import Catalogue
from tuneplane.coordinator.gateways.sessions import SessionRegistry
from tuneplane.coordinator.lifecycle import ABORT
from tuneplane.coordinator.placement import MemberPlacement, Placement
from tuneplane.coordinator.server.scheduler import Scheduler
from tuneplane.coordinator.store.core import Store, db_path
from tuneplane.coordinator.values.jobs import Preview, PreviewSummary
from tuneplane.coordinator.values.orders import Gpu, Inventory

WAITING_SINCE_ADMISSION = "admitted; waiting for free GPUs"


async def _admit_one(store: Store) -> str:
    now = time.time_ns() // 1_000_000
    await store.bootstrap("admin-token-hash", now)
    spec = {
        "project": "demo",
        "experiment": "hello",
        "method_id": "custom/custom",
        "resources": {"profile": "h200", "series": "h200", "gpus": 1},
    }
    await store.save_preview(
        Preview(
            "pv-1",
            "d1",
            json.dumps(spec),
            PreviewSummary("default", "node", "h200", 0, 0, "h200"),
            now,
            "admin",
        )
    )
    receipt = await store.commit("pv-1", "d1", "rk-1", "admin", "run-1", now)
    return receipt.run_id


async def _wait_until(what: str, check: Callable[[], bool], timeout: float = 10.0) -> None:
    deadline = anyio.current_time() + timeout
    while not check():
        if anyio.current_time() > deadline:
            raise AssertionError(f"{what} did not happen within {timeout:g} s")
        await anyio.sleep(0.01)


def test_wakes_during_a_pass_make_one_more_pass(tmp_path: Path) -> None:
    async def go() -> tuple[int, int, str]:
        where = current().where(db_path(tmp_path))
        store = await Store.open(where)
        try:
            run_id = await _admit_one(store)
            scheduler = Scheduler(store, SessionRegistry(), Catalogue.bundled(), 60, tick_s=3600)
            async with anyio.create_task_group() as tg:
                tg.start_soon(scheduler.run)
                # The pass must write the Job's wait reason, and this lock holds that write.
                with write_lock(where):
                    scheduler.wake()
                    await _wait_until("the first pass", lambda: scheduler.passes == 1)
                    for _ in range(10):
                        scheduler.wake()
                        await anyio.sleep(0.01)
                    during = scheduler.passes
                await _wait_until("the pass after the wakes", lambda: scheduler.passes == 2)
                await anyio.sleep(0.5)  # room for any extra pass to show itself
                after = scheduler.passes
                tg.cancel_scope.cancel()
            reason = str((await store.get_job(run_id)).state_reason)
        finally:
            await store.close()
        return during, after, reason

    during, after, reason = asyncio.run(go())
    assert during == 1  # the first pass was still waiting for the lock when the wakes came
    assert after == 2
    assert reason.startswith("waiting: needs 1 h200 GPU(s)")


def test_a_pass_the_store_refuses_is_logged_and_the_next_pass_places(tmp_path: Path) -> None:
    """A write lock held past the store's lock timeout fails a pass with StoreUnavailable; the
    scheduler keeps running (its coordinator's round goes on) and the pass after the lock writes
    the Job's wait reason."""

    async def go() -> tuple[int, int, str]:
        where = current().where(db_path(tmp_path))
        store = await Store.open(where)
        try:
            run_id = await _admit_one(store)
            scheduler = Scheduler(store, SessionRegistry(), Catalogue.bundled(), 60, tick_s=3600)
            with anyio.fail_after(60):
                async with anyio.create_task_group() as tg:
                    tg.start_soon(scheduler.run)
                    with write_lock(where):
                        scheduler.wake()
                        await _wait_until(
                            "the pass to give up on the lock",
                            lambda: scheduler.failed_passes == 1,
                            timeout=30,
                        )
                    failed = scheduler.failed_passes
                    scheduler.wake()
                    reason = ""
                    deadline = anyio.current_time() + 30
                    while not reason.startswith("waiting"):
                        assert anyio.current_time() < deadline, "no pass after the lock"
                        await anyio.sleep(0.05)
                        reason = str((await store.get_job(run_id)).state_reason)
                    tg.cancel_scope.cancel()
        finally:
            await store.close()
        return failed, scheduler.failed_passes, reason

    failed, after, reason = asyncio.run(go())
    assert (failed, after) == (1, 1)
    assert reason.startswith("waiting: needs 1 h200 GPU(s)")


async def _admit(store: Store, n: int) -> str:
    """Admit one more Job (the store bootstrapped by :func:`_admit_one`)."""
    now = time.time_ns() // 1_000_000
    spec = {
        "project": "demo",
        "experiment": f"hello-{n}",
        "method_id": "custom/custom",
        "resources": {"profile": "h200", "series": "h200", "gpus": 1},
    }
    summary = PreviewSummary("default", "node", "h200", 0, 0, "h200")
    await store.save_preview(Preview(f"pv-{n}", f"d{n}", json.dumps(spec), summary, now, "admin"))
    receipt = await store.commit(f"pv-{n}", f"d{n}", f"rk-{n}", "admin", f"run-{n}", now)
    return receipt.run_id


async def _reason(store: Store, run_id: str) -> str:
    return str((await store.get_job(run_id)).state_reason)


async def _reason_other_than(store: Store, run_id: str, old: str, timeout: float = 10.0) -> str:
    """The Job's reason once a pass has written one other than ``old`` (a pass counts when it
    starts, so its writes land a little after the count moves)."""
    deadline = anyio.current_time() + timeout
    while (reason := await _reason(store, run_id)) == old:
        if anyio.current_time() > deadline:
            raise AssertionError(f"no pass rewrote {run_id}'s reason {old!r} within {timeout:g} s")
        await anyio.sleep(0.01)
    return reason


async def _node_a(store: Store, now: int) -> None:
    """Enroll and connect ``node-a`` with one h200 GPU."""
    inventory = Inventory("node-a", (Gpu(0, "h200", True, "GPU-a-0"),), "simulated")
    await store.create_join_token("join-a", "default", now, now + 60_000)
    await store.enroll("join-a", "node-a", inventory, "cred-a", now)
    await store.node_connected("node-a", inventory, [], now)


async def _expired_launch(store: Store, run_id: str, now: int) -> int:
    """Reserve ``run_id`` on ``node-a`` with its Prepare deadline already past; its attempt."""
    job = await store.queued_job(run_id)
    assert job is not None
    placement = Placement((MemberPlacement(0, "node-a", (0,)),))
    orders = await store.reserve_launch(job, placement, lambda _: {}, now - 1, now)
    assert orders is not None
    return orders[0].member.attempt


def test_an_admission_plans_the_new_job_without_walking_the_queue(tmp_path: Path) -> None:
    """After a pass over the whole queue, a pass woken by an admission reads only the new Job:
    an older Job's reason, changed behind the scheduler's back, is left as it is until a wake
    that asks for the whole queue (as a released GPU or a Node would)."""

    async def go() -> tuple[str, str, str, str, int, int]:
        where = current().where(db_path(tmp_path))
        store = await Store.open(where)
        try:
            first = await _admit_one(store)
            scheduler = Scheduler(store, SessionRegistry(), Catalogue.bundled(), 60, tick_s=3600)
            with anyio.fail_after(60):
                async with anyio.create_task_group() as tg:
                    tg.start_soon(scheduler.run)
                    scheduler.wake()
                    await _wait_until("the first pass", lambda: scheduler.passes == 1)
                    # Its end: the reason it writes (a pass counts when it starts).
                    while not (await _reason(store, first)).startswith("waiting"):
                        await anyio.sleep(0.01)
                    async with store.transaction() as db:
                        await db.execute(
                            "UPDATE jobs SET state_reason = 'marked' WHERE run_id = ?", (first,)
                        )
                    second = await _admit(store, 2)
                    scheduler.admitted(second)
                    await _wait_until("the admission's pass", lambda: scheduler.passes == 2)
                    # Its end, again: the new Job's reason (the admission wrote it as waiting
                    # since admission; the pass plans it).
                    planned = await _reason_other_than(store, second, WAITING_SINCE_ADMISSION)
                    untouched = await _reason(store, first)
                    scheduler.wake()
                    await _wait_until("the whole queue's pass", lambda: scheduler.passes == 3)
                    rewritten = await _reason_other_than(store, first, "marked")
                    tg.cancel_scope.cancel()
        finally:
            await store.close()
        return untouched, planned, rewritten, second, scheduler.partial_passes, scheduler.passes

    untouched, planned, rewritten, _, partial, passes = asyncio.run(go())
    assert untouched == "marked"
    assert planned.startswith("waiting: needs 1 h200 GPU(s)")
    assert rewritten.startswith("waiting: needs 1 h200 GPU(s)")
    assert (partial, passes) == (1, 3)


def test_admissions_that_never_stop_still_get_a_whole_pass_each_tick(tmp_path: Path) -> None:
    """A pass over the whole queue runs at least every tick, even when admissions keep the
    scheduler awake (each tick plans the new Jobs first, then makes the whole pass): a launch
    whose Prepare deadline passed is aborted, which only a whole pass does."""

    async def go() -> str | None:
        where = current().where(db_path(tmp_path))
        store = await Store.open(where)
        try:
            now = time.time_ns() // 1_000_000
            first = await _admit_one(store)
            await _node_a(store, now)
            scheduler = Scheduler(store, SessionRegistry(), Catalogue.bundled(), 60, tick_s=0.2)
            with anyio.fail_after(60):
                async with anyio.create_task_group() as tg:
                    tg.start_soon(scheduler.run)
                    # The first pass (asked for at the start) is over: from now on only ticks
                    # make whole passes, since admissions ask for none.
                    await _reason_other_than(store, first, WAITING_SINCE_ADMISSION)
                    # Reserved behind the scheduler's back.
                    attempt = await _expired_launch(store, first, now)
                    n = 2
                    while (facts := await store.attempt_facts(store.reader, first, attempt)) and (
                        facts.decision is None
                    ):
                        n += 1
                        scheduler.admitted(await _admit(store, n))
                        await anyio.sleep(0.01)
                    tg.cancel_scope.cancel()
            assert scheduler.partial_passes >= 1
            return facts.decision if facts is not None else None
        finally:
            await store.close()

    assert asyncio.run(go()) == ABORT


async def _mark(store: Store, run_id: str) -> None:
    async with store.transaction() as db:
        await db.execute("UPDATE jobs SET state_reason = 'marked' WHERE run_id = ?", (run_id,))


def _ticks(tmp_path: Path, change: Callable[[Store, str], Awaitable[None]] | None) -> str:
    """A whole pass, the first Job's reason marked behind the scheduler's back, two ticks that
    find nothing changed, then ``change`` (also behind its back, as a missed wake would leave
    it); the first Job's reason once two more ticks have passed."""

    async def go() -> str:
        where = current().where(db_path(tmp_path))
        store = await Store.open(where)
        try:
            first = await _admit_one(store)
            scheduler = Scheduler(store, SessionRegistry(), Catalogue.bundled(), 60, tick_s=0.05)
            with anyio.fail_after(60):
                async with anyio.create_task_group() as tg:
                    tg.start_soon(scheduler.run)
                    await _reason_other_than(store, first, WAITING_SINCE_ADMISSION)
                    await _mark(store, first)
                    skipped = scheduler.skipped_passes
                    await _wait_until(
                        "two quiet ticks", lambda: scheduler.skipped_passes >= skipped + 2
                    )
                    assert await _reason(store, first) == "marked"
                    if change is not None:
                        await change(store, first)
                    passes = scheduler.passes
                    await _wait_until("two more ticks", lambda: scheduler.passes >= passes + 2)
                    tg.cancel_scope.cancel()
            return await _reason(store, first)
        finally:
            await store.close()

    return asyncio.run(go())


def test_a_tick_with_nothing_changed_reads_no_queue(tmp_path: Path) -> None:
    """Ticks whose inputs (the Fleets' Nodes, the GPUs in use, the queue's length and newest
    admission) are as the last whole pass saw them leave its reasons standing: a reason changed
    behind the scheduler's back is not rewritten, because nothing was read."""
    assert _ticks(tmp_path, None) == "marked"


def test_a_job_queued_behind_the_schedulers_back_is_planned_at_the_next_tick(
    tmp_path: Path,
) -> None:
    """A Job that joins the queue with no one telling the scheduler moves the queue's mark: the
    next tick reads the whole queue again (the marked reason is rewritten)."""

    async def queue_another(store: Store, _first: str) -> None:
        await _admit(store, 2)

    assert _ticks(tmp_path, queue_another).startswith("waiting: needs 1 h200 GPU(s)")


def test_gpus_taken_behind_the_schedulers_back_make_the_next_tick_read_the_queue(
    tmp_path: Path,
) -> None:
    """GPUs in use that change with no wake (a reservation written by someone else) change the
    pass's inputs: the next tick reads the whole queue again."""

    async def reserve(store: Store, first: str) -> None:
        async with store.transaction() as db:
            await db.execute(
                "INSERT INTO nodes (id, fleet, hostname, inventory_json, credential_hash, "
                "enrolled_at_ms) VALUES ('n-x', 'default', 'x', '{}', 'h-x', 0)"
            )
            await db.execute(
                "INSERT INTO reservations (node_id, gpu_index, run_id, attempt, member_index, "
                "created_at_ms) VALUES ('n-x', 0, ?, 1, 0, 0)",
                (first,),
            )

    assert _ticks(tmp_path, reserve).startswith("waiting: needs 1 h200 GPU(s)")


def _after_an_admission(
    tmp_path: Path, behind_its_back: Callable[[Store, str, str], Awaitable[None]], ticks: int
) -> tuple[str, str, int]:
    """A whole pass, one more Job admitted and planned by a pass over it alone, then
    ``behind_its_back(store, first, second)`` and ``ticks`` ticks, each pass called as the
    scheduler's loop calls it (no clock): both Jobs' reasons and the ticks that read no queue."""

    async def go() -> tuple[str, str, int]:
        store = await Store.open(current().where(db_path(tmp_path)))
        try:
            first = await _admit_one(store)
            scheduler = Scheduler(store, SessionRegistry(), Catalogue.bundled(), 60, 3600)
            await scheduler.step()
            second = await _admit(store, 2)
            await scheduler.step({second})
            await behind_its_back(store, first, second)
            for _ in range(ticks):
                await scheduler.step(tick=True)
            reasons = await _reason(store, first), await _reason(store, second)
            return *reasons, scheduler.skipped_passes
        finally:
            await store.close()

    return asyncio.run(go())


def test_ticks_after_an_admissions_pass_still_read_no_queue(tmp_path: Path) -> None:
    """A pass over a new Job counts it into the whole pass's record instead of counting the
    queue: the ticks after it find the real queue as that record says, and read no queue (a
    reason changed behind the scheduler's back after the admission stays as it is)."""

    async def mark_first(store: Store, first: str, _second: str) -> None:
        await _mark(store, first)

    first, planned, skipped = _after_an_admission(tmp_path, mark_first, ticks=2)
    assert planned.startswith("waiting: needs 1 h200 GPU(s)")
    assert (first, skipped) == ("marked", 2)


def test_a_tick_that_finds_a_job_admitted_since_the_last_pass_plans_it_and_reads_no_queue(
    tmp_path: Path,
) -> None:
    """While admissions keep coming, a tick nearly always finds one admitted since the last pass
    and not planned yet. The tick plans it as a pass of its own first, and then finds the whole
    pass's record standing: the new Job gets its reason, and an older Job's reason changed
    behind the scheduler's back stays as it is (no queue was read). Planned inside the whole
    pass instead, the new Job would move the queue's mark and make every such tick read the
    whole queue."""

    async def go() -> tuple[str, str, int, int]:
        store = await Store.open(current().where(db_path(tmp_path)))
        try:
            first = await _admit_one(store)
            scheduler = Scheduler(store, SessionRegistry(), Catalogue.bundled(), 60, 3600)
            await scheduler.step()
            await _mark(store, first)
            second = await _admit(store, 2)
            await scheduler.tick({second})
            reasons = await _reason(store, first), await _reason(store, second)
            return *reasons, scheduler.partial_passes, scheduler.skipped_passes
        finally:
            await store.close()

    first, second, partial, skipped = asyncio.run(go())
    assert second.startswith("waiting: needs 1 h200 GPU(s)")
    assert (first, partial, skipped) == ("marked", 1, 1)


def test_a_job_gone_behind_the_schedulers_back_after_an_admission_makes_the_tick_read(
    tmp_path: Path,
) -> None:
    """The record's mark after an admission's pass is a sum, not a read: a Job that left the
    queue with no one telling the scheduler makes the real mark differ from it, and the next
    tick reads the whole queue (the other Job's marked reason is rewritten)."""

    async def cancel_first(store: Store, first: str, second: str) -> None:
        async with store.transaction() as db:
            await db.execute("UPDATE jobs SET state = 'cancelled' WHERE run_id = ?", (first,))
        await _mark(store, second)

    _, second, skipped = _after_an_admission(tmp_path, cancel_first, ticks=1)
    assert (second.startswith("waiting: needs 1 h200 GPU(s)"), skipped) == (True, 0)


def test_an_expired_launch_is_aborted_by_the_whole_pass_not_by_an_admissions_pass(
    tmp_path: Path,
) -> None:
    """A launch whose Prepare deadline passed is aborted by the next whole pass (one runs at
    least every tick); a pass over newly admitted Jobs leaves it to that pass, as it leaves the
    drained Nodes: an admission changes neither, and it does not pay their reads."""

    async def go() -> tuple[str | None, str | None]:
        store = await Store.open(current().where(db_path(tmp_path)))
        try:
            now = time.time_ns() // 1_000_000
            first = await _admit_one(store)
            await _node_a(store, now)
            attempt = await _expired_launch(store, first, now)
            scheduler = Scheduler(store, SessionRegistry(), Catalogue.bundled(), 60)
            await scheduler.step({await _admit(store, 2)})
            after_admission = await store.attempt_facts(store.reader, first, attempt)
            await scheduler.step()
            after_whole = await store.attempt_facts(store.reader, first, attempt)
            assert after_admission is not None and after_whole is not None
            return after_admission.decision, after_whole.decision
        finally:
            await store.close()

    assert asyncio.run(go()) == (None, ABORT)
