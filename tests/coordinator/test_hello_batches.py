"""Hellos that arrive together share one transaction (group commit) and leave exactly what the
same Hellos one at a time would: the same rows, the same decisions in the same order, the same
orders to resend. On SQLite and PostgreSQL (tests/coordinator/conftest.py)."""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import anyio
import pytest

from tests.support.store_backend import current, read, write, write_lock
from tuneplane.coordinator import lifecycle as lc
from tuneplane.coordinator.placement import MemberPlacement, Placement
from tuneplane.coordinator.store.core import Store
from tuneplane.coordinator.store.hellos import ReplacedStream
from tuneplane.coordinator.store.lifecycle import cancel_job
from tuneplane.coordinator.store_location import Where
from tuneplane.coordinator.values.jobs import MemberKey, Preview, PreviewSummary
from tuneplane.coordinator.values.orders import (
    Gpu,
    HeldMember,
    Inventory,
    Order,
    OutputsService,
    PrepareOrder,
    Report,
)

NOW = 1000
HOLDERS = ("node-a", "node-b", "node-c", "node-d")
IDLE = ("node-e", "node-f", "node-g")
#: Every table a Hello writes or reads, compared whole (ordered by every column).
TABLES = ("nodes", "members", "attempts", "jobs", "decisions", "member_states", "job_states")


def _inventory(name: str, gpus: int = 2) -> Inventory:
    return Inventory(
        hostname=name,
        gpus=tuple(Gpu(i, "h200", True, f"GPU-{name}-{i}") for i in range(gpus)),
        gpu_source="simulated",
    )


async def _job(store: Store, run_id: str, nodes: tuple[str, ...], gpu: int) -> list[MemberKey]:
    spec = {
        "project": "p",
        "experiment": "e",
        "method_id": "custom/custom",
        "grace_period_s": 7,
        "resources": {"profile": "h200", "series": "h200", "gpus": len(nodes)},
    }
    summary = PreviewSummary("default", "node", "h200", 0, 0, "h200")
    await store.save_preview(Preview(f"pv-{run_id}", "d", json.dumps(spec), summary, NOW, "ada"))
    await store.commit(f"pv-{run_id}", "d", f"rk-{run_id}", "ada", run_id, NOW)
    job = await store.queued_job(run_id)
    assert job is not None
    placement = Placement(tuple(MemberPlacement(i, n, (gpu,)) for i, n in enumerate(nodes)))
    orders = await store.reserve_launch(job, placement, lambda _: {}, NOW + 600_000, NOW)
    assert orders is not None
    return [MemberKey(run_id, orders[0].member.attempt, i) for i in range(len(nodes))]


async def _running(store: Store, keys: list[MemberKey], nodes: tuple[str, ...]) -> None:
    for key, node in zip(keys, nodes, strict=True):
        await store.record_prepare_reply(node, key, True, "", "10.0.0.1", 2900, NOW)
    for key, node in zip(keys, nodes, strict=True):
        for state in (lc.M_COMMITTED, lc.M_STARTING, lc.M_RUNNING):
            await store.apply_report(node, Report(lc.MEMBER_RANK[state], key, state, NOW), NOW)


async def _world(store: Store, disconnected: bool = True) -> dict[str, list[MemberKey]]:
    """Seven Nodes: four hold members of three Jobs (running, preparing, running and being
    cancelled), three hold none; then (``disconnected``) every Node's stream ends (members
    unknown)."""
    await store.bootstrap("admin-hash", NOW)
    for i, node in enumerate(HOLDERS + IDLE):
        await store.create_join_token(f"join-{i}", "default", NOW, NOW + 600_000)
        await store.enroll(f"join-{i}", node, _inventory(node), f"cred-{i}", NOW)
        await store.node_connected(node, _inventory(node), [], NOW)
    jobs = {
        "run-1": await _job(store, "run-1", ("node-a", "node-b"), 0),
        "run-2": await _job(store, "run-2", ("node-c", "node-d"), 0),
        "run-3": await _job(store, "run-3", ("node-a", "node-c"), 1),
    }
    await _running(store, jobs["run-1"], ("node-a", "node-b"))
    await store.record_prepare_reply("node-c", jobs["run-2"][0], True, "", "10.0.0.3", 2901, NOW)
    await _running(store, jobs["run-3"], ("node-a", "node-c"))
    await cancel_job(store, "run-3", "ada", False, "no longer needed", NOW + 1)
    if disconnected:
        for node in HOLDERS + IDLE:
            await store.node_disconnected(node, NOW + 2, "the coordinator restarted")
    return jobs


def _hellos(jobs: dict[str, list[MemberKey]]) -> list[dict[str, Any]]:
    """A storm's Hellos in arrival order: Nodes with and without members, held states that
    move a member on and that do not, a replaced stream, one Node twice, outputs and none."""
    r1, r2, r3 = jobs["run-1"], jobs["run-2"], jobs["run-3"]
    outputs = OutputsService("10.0.0.5:7000", "ab" * 32, b"k" * 32)
    at = NOW + 10
    return [
        {"node_id": "node-e", "inventory": _inventory("node-e"), "held": [], "now": at},
        {
            "node_id": "node-a",
            "inventory": _inventory("node-a", 4),
            "held": [HeldMember(r1[0], lc.M_RUNNING), HeldMember(r3[0], lc.M_EXITED)],
            "now": at + 1,
            "dialed_address": "coord-1:7001",
        },
        {
            "node_id": "node-f",
            "inventory": _inventory("node-f"),
            "held": [],
            "now": at + 2,
            "outputs": outputs,
            "replaced": ReplacedStream("10.0.0.9:1", "10.0.0.9:2", NOW, at + 2),
        },
        {"node_id": "node-b", "inventory": _inventory("node-b"), "held": [], "now": at + 3},
        {
            "node_id": "node-c",
            "inventory": _inventory("node-c"),
            "held": [HeldMember(r2[0], lc.M_PREPARED), HeldMember(r3[1], lc.M_RUNNING)],
            "now": at + 4,
        },
        {"node_id": "node-g", "inventory": _inventory("node-g"), "held": [], "now": at + 5},
        {
            "node_id": "node-d",
            "inventory": _inventory("node-d"),
            "held": [HeldMember(r2[1], lc.M_PREPARING)],
            "now": at + 6,
        },
        {
            "node_id": "node-e",
            "inventory": _inventory("node-e", 8),
            "held": [],
            "now": at + 7,
            "replaced": ReplacedStream("10.0.0.8:1", "10.0.0.8:2", at, at + 7),
        },
    ]


def _tables(where: Where) -> dict[str, list[tuple[Any, ...]]]:
    return {t: sorted(read(where, Store, f"SELECT * FROM {t}"), key=repr) for t in TABLES}


def _play(
    where: Where,
    storm: Callable[[Store, list[dict[str, Any]]], Awaitable[list[list[Order]]]],
    disconnected: bool = True,
) -> tuple[list[list[Order]], int]:
    async def go() -> tuple[list[list[Order]], int]:
        store = await Store.open(where)
        try:
            jobs = await _world(store, disconnected)
            # reserve_launch draws each attempt's rendezvous nonce at random: both worlds get
            # the same ones, so only what the Hellos did can differ.
            write(where, Store, "UPDATE attempts SET rendezvous_nonce = 'nonce'")
            orders = await storm(store, _hellos(jobs))
            grouped = store.hello_statistics() if disconnected else store.goodbye_statistics()
            return orders, grouped.largest
        finally:
            await store.close()

    return anyio.run(go)


async def _one_at_a_time(store: Store, hellos: list[dict[str, Any]]) -> list[list[Order]]:
    return [await store.node_connected(**h) for h in hellos]


async def _all_at_once(store: Store, hellos: list[dict[str, Any]]) -> list[list[Order]]:
    results: list[list[Order]] = [[] for _ in hellos]

    async def one(i: int) -> None:
        results[i] = await store.node_connected(**hellos[i])

    async with anyio.create_task_group() as tg:
        for i in range(len(hellos)):
            tg.start_soon(one, i)
    return results


def _where(tmp_path: Path, name: str) -> Where:
    return current().where(tmp_path / name, fresh=True)


def test_hellos_together_leave_what_hellos_one_at_a_time_leave(tmp_path: Path) -> None:
    alone_at = _where(tmp_path, "alone.db")
    alone, largest_alone = _play(alone_at, _one_at_a_time)
    alone_rows = _tables(alone_at)

    together_at = _where(tmp_path, "together.db")
    together, largest = _play(together_at, _all_at_once)

    assert largest_alone == 1
    assert largest > 1, "the Hellos were not grouped; the test proves nothing"
    assert together == alone
    assert _tables(together_at) == alone_rows
    # What the storm did, so an equal nothing cannot pass: members back from unknown,
    # a Prepare owed to node-d, the replaced streams audited.
    kinds = [r[0] for r in read(together_at, Store, "SELECT kind FROM decisions ORDER BY id")]
    assert kinds.count("control stream replaced") == 2
    states = read(together_at, Store, "SELECT state FROM members WHERE state = 'unknown'")
    assert states == []
    assert any(isinstance(o, PrepareOrder) for o in together[6])


async def _gone_one_at_a_time(store: Store, hellos: list[dict[str, Any]]) -> list[list[Order]]:
    for h in hellos:
        await store.node_disconnected(h["node_id"], h["now"], f"stream {h['now']} ended")
    return []


async def _gone_all_at_once(store: Store, hellos: list[dict[str, Any]]) -> list[list[Order]]:
    async with anyio.create_task_group() as tg:
        for h in hellos:
            tg.start_soon(
                store.node_disconnected, h["node_id"], h["now"], f"stream {h['now']} ended"
            )
    return []


def test_streams_ending_together_leave_what_streams_ending_one_at_a_time_leave(
    tmp_path: Path,
) -> None:
    alone_at = _where(tmp_path, "alone.db")
    _, largest_alone = _play(alone_at, _gone_one_at_a_time, disconnected=False)
    alone_rows = _tables(alone_at)
    together_at = _where(tmp_path, "together.db")
    _, largest = _play(together_at, _gone_all_at_once, disconnected=False)
    assert largest_alone == 1
    assert largest > 1, "the disconnections were not grouped; the test proves nothing"
    assert _tables(together_at) == alone_rows
    unknown = read(together_at, Store, "SELECT COUNT(*) FROM members WHERE state = 'unknown'")
    assert unknown == [(6,)]  # every member of the three Jobs: none had ended


@pytest.mark.parametrize("size", [1, 40])
def test_a_failing_hello_fails_alone(tmp_path: Path, size: int) -> None:
    """A Hello whose write breaks a rule of the schema gets the error; the others in its batch
    are written all the same."""

    async def go() -> tuple[list[str], list[tuple[Any, ...]]]:
        store = await Store.open(current().where(tmp_path / "c.db"))
        try:
            await store.bootstrap("admin-hash", NOW)
            nodes = [f"node-{i:02d}" for i in range(size)]
            for i, node in enumerate(nodes):
                await store.create_join_token(f"join-{i}", "default", NOW, NOW + 600_000)
                await store.enroll(f"join-{i}", node, _inventory(node), f"cred-{i}", NOW)
            outcome: dict[str, str] = {}

            async def one(node: str, now: int) -> None:
                try:
                    await store.node_connected(node, _inventory(node), [], now)
                    outcome[node] = "ok"
                except Exception as exc:
                    outcome[node] = type(exc).__name__

            async with anyio.create_task_group() as tg:
                for i, node in enumerate(nodes):
                    # at_ms is NOT NULL in decisions: this one Hello cannot be written.
                    tg.start_soon(one, node, None if i == size // 2 else NOW + i)  # type: ignore[arg-type]
            connected = read(
                current().where(tmp_path / "c.db"),
                Store,
                "SELECT id FROM nodes WHERE connected = 1 ORDER BY id",
            )
            return [outcome[n] for n in nodes], connected
        finally:
            await store.close()

    outcomes, connected = anyio.run(go)
    bad = size // 2
    assert outcomes[bad] == "IntegrityViolation"
    assert outcomes[:bad] + outcomes[bad + 1 :] == ["ok"] * (size - 1)
    assert [r[0] for r in connected] == [f"node-{i:02d}" for i in range(size) if i != bad]


def test_a_hello_whose_caller_gave_up_is_written_all_the_same(tmp_path: Path) -> None:
    """A caller's cancellation stops its waiting, never its write: a Hello whose batch had
    begun and one still queued behind it are both written (as a disconnection must be when
    grpclib cancels the handler of a dropped connection)."""
    where = current().where(tmp_path / "c.db")

    async def go() -> None:
        store = await Store.open(where)
        try:
            await store.bootstrap("admin-hash", NOW)
            for i, node in enumerate(("node-x", "node-y", "node-z")):
                await store.create_join_token(f"join-{i}", "default", NOW, NOW + 600_000)
                await store.enroll(f"join-{i}", node, _inventory(node), f"cred-{i}", NOW)
            scopes = {"node-x": anyio.CancelScope(), "node-y": anyio.CancelScope()}

            async def hello(node: str) -> None:
                with scopes[node]:
                    await store.node_connected(node, _inventory(node), [], NOW + 1)

            with ExitStack() as lock:
                lock.enter_context(write_lock(where))  # every batch waits for the store
                async with anyio.create_task_group() as tg:
                    tg.start_soon(hello, "node-x")  # its batch begins, and waits
                    await anyio.wait_all_tasks_blocked()
                    tg.start_soon(hello, "node-y")  # queued behind node-x's batch
                    await anyio.wait_all_tasks_blocked()
                    for scope in scopes.values():
                        scope.cancel()
                lock.close()
            await store.node_connected("node-z", _inventory("node-z"), [], NOW + 2)
        finally:
            await store.close()

    anyio.run(go)
    rows = read(where, Store, "SELECT id FROM nodes WHERE connected = 1 ORDER BY id")
    assert rows == [("node-x",), ("node-y",), ("node-z",)]
    kinds = read(
        where, Store, "SELECT node_id FROM decisions WHERE kind = 'node connected' ORDER BY id"
    )
    assert kinds == [("node-x",), ("node-y",), ("node-z",)]
