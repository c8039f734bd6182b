"""A Node that never comes back: the pure decisions, exhaustively, and the store's declaration on a
real store (one transaction, idempotent, late reports refused, what a returning Node gets).
"""

from __future__ import annotations

import itertools
import json
import logging
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any, TypeVar

import anyio
import pytest

from tests.support.store_backend import current, read, write_lock
from tuneplane.agent import messages as agent_messages
from tuneplane.agent.wire_convert import from_wire
from tuneplane.coordinator import lifecycle as lc
from tuneplane.coordinator import node_loss
from tuneplane.coordinator.api.node_loss import MaxDisconnectWatch, NodeLossDesk
from tuneplane.coordinator.clock import now_ms
from tuneplane.coordinator.config import ConfigError, parse_config
from tuneplane.coordinator.gateways.sessions import NodeSession, SessionRegistry
from tuneplane.coordinator.placement import MemberPlacement, Placement
from tuneplane.coordinator.store import lifecycle as store_lifecycle
from tuneplane.coordinator.store.core import Conflict, NotFound, Store
from tuneplane.coordinator.store.fleet_views import node_view
from tuneplane.coordinator.store.lost_nodes import (
    NodeLoss,
    declare_node_lost,
    declared_lost_order,
    declared_lost_stops,
)
from tuneplane.coordinator.values.jobs import MemberKey, Preview, PreviewSummary
from tuneplane.coordinator.values.lifecycle import CANCELLING
from tuneplane.coordinator.values.orders import (
    AbortOrder,
    CancelOrder,
    CommitOrder,
    Gpu,
    HeldMember,
    Inventory,
    Report,
)
from tuneplane.coordinator.wire.control import order_to_wire
from tuneplane.proto import v1

T = TypeVar("T")
NODE_A, NODE_B = "node-a", "node-b"
RUN = "run-1"
DECLARATION = node_loss.declared("ada", "the machine was powered off at its PDU")

# ----- pure decisions ---------------------------------------------------------------------------


def test_a_connected_node_is_never_declared_lost() -> None:
    with pytest.raises(node_loss.NodeLossRefused, match=r"node-a is connected.*revoke it first"):
        node_loss.check_declarable(NODE_A, True)
    node_loss.check_declarable(NODE_A, False)


@pytest.mark.parametrize("reason", ["", "   ", "\n\t"])
def test_a_declaration_needs_a_reason(reason: str) -> None:
    with pytest.raises(node_loss.NodeLossRefused, match="--reason"):
        node_loss.check_reason(reason)
    assert node_loss.check_reason("  off at the PDU ") == "off at the PDU"


def test_what_each_member_becomes_depends_only_on_its_attempts_decision() -> None:
    assert node_loss.member_fate(None) == node_loss.ABORT_ATTEMPT
    assert node_loss.member_fate(lc.COMMIT) == node_loss.END_LOST
    assert node_loss.member_fate(lc.ABORT) == node_loss.END_LOST
    with pytest.raises(lc.IllegalTransition):
        node_loss.member_fate("maybe")


def test_the_declaration_and_abort_sentences_name_who_and_why() -> None:
    assert DECLARATION == "declared lost by ada: the machine was powered off at its PDU"
    assert node_loss.declared("x", "off.") == "declared lost by x: off"
    assert node_loss.abort_reason(2, NODE_B, DECLARATION) == (
        f"member 2 on Node node-b was {DECLARATION}"
    )
    assert "max_disconnect (30m)" in node_loss.max_disconnect_reason("30m", "default")


@pytest.mark.parametrize(
    ("since", "watching", "now", "limit", "expected"),
    [
        (None, 0, 10_000, 1000, False),  # connected: never overdue
        (0, 0, 999, 1000, False),
        (0, 0, 1000, 1000, True),  # exactly the limit
        (0, 0, 5000, 1000, True),
        (0, 4500, 5000, 1000, False),  # the coordinator only started watching at 4500
        (0, 4000, 5000, 1000, True),
        (4800, 0, 5000, 1000, False),
        (0, 0, 5000, 0, False),  # no limit
    ],
)
def test_a_node_is_overdue_only_after_the_whole_limit_this_process_could_watch(
    since: int | None, watching: int, now: int, limit: int, expected: bool
) -> None:
    assert node_loss.overdue(since, watching, now, limit) is expected


def _facts(known: str, reported: str, declared: str, placed_on: str = NODE_B) -> lc.ReportFacts:
    return lc.ReportFacts(
        node_id=NODE_B,
        member=f"{RUN} attempt 1 member 1",
        run_id=RUN,
        attempt=1,
        member_index=1,
        reported=reported,
        has_exit=reported == lc.M_EXITED,
        out_dir="",
        placed_on=placed_on,
        known=known,
        decision=lc.COMMIT,
        declared_lost=declared,
    )


@pytest.mark.parametrize(
    ("known", "reported"), list(itertools.product(sorted(lc.MEMBER_RANK), sorted(lc.REPORTABLE)))
)
def test_every_report_about_a_member_declared_lost_is_refused_with_the_declaration(
    known: str, reported: str
) -> None:
    verdict = lc.judge_report(_facts(known, reported, DECLARATION))
    assert isinstance(verdict, lc.RefuseReport)
    assert DECLARATION in verdict.reason and "changed nothing" in verdict.reason
    # Another Node still learns nothing about the member.
    other = lc.judge_report(_facts(known, reported, DECLARATION, placed_on=NODE_A))
    assert isinstance(other, lc.RefuseReport) and DECLARATION not in other.reason


def test_a_member_declared_lost_fails_its_job_with_the_declaration() -> None:
    lost = lc.MemberFacts(1, lc.M_LOST, declared_lost=DECLARATION)
    running = lc.MemberFacts(0, lc.M_RUNNING)
    assert lc.derive_job_state(lc.COMMIT, "", [running, lost]) == (
        lc.FAILED,
        f"member 1 was {DECLARATION}",
    )
    # A loss its own Node reported keeps its sentence; a pending cancel still wins.
    assert lc.derive_job_state(lc.COMMIT, "", [lc.MemberFacts(0, lc.M_LOST)])[1] == (
        "member 0 was lost by its Node"
    )
    assert lc.derive_job_state(lc.COMMIT, "", [lost], "cancelled by ada") == (
        lc.CANCELLED,
        "cancelled by ada",
    )


def test_max_disconnect_is_parsed_per_fleet_and_refused_when_it_is_not_a_duration() -> None:
    path = Path("coordinator.toml")
    config = parse_config('[fleet.default]\nmax_disconnect = "90s"\n[fleet.other]\n', path)
    assert config.fleets["default"].max_disconnect_s == 90
    assert config.fleets["default"].max_disconnect_text == "90s"
    assert config.fleets["other"].max_disconnect_s is None
    assert parse_config("", path).fleets == {}
    for bad, match in (
        ('[fleet.default]\nmax_disconnect = "soon"\n', "max_disconnect = 'soon' is not a dur"),
        ("[fleet.default]\nmax_disconnect = 30\n", "is not a duration"),
        ('[fleet.default]\nmax_disconect = "1h"\n', "unknown key"),
        ('fleet = "default"\n', "one per Fleet"),
    ):
        with pytest.raises(ConfigError, match=match):
            parse_config(bad, path)


# ----- the store, on a real SQLite file ---------------------------------------------------------


def _run(work: Callable[[Store], Awaitable[T]], path: Path) -> T:
    async def go() -> T:
        store = await Store.open(current().where(path))
        try:
            return await work(store)
        finally:
            await store.close()

    return anyio.run(go)


def _inventory(name: str) -> Inventory:
    gpus = tuple(Gpu(i, "h200", True, f"GPU-{name}-{i}") for i in range(2))
    return Inventory(hostname=name, gpus=gpus, gpu_source="simulated")


async def _job(store: Store, run_id: str, members: int, gpu: int, now: int) -> list[MemberKey]:
    """Admit and place a Job of ``members`` members, one per Node (node-a, node-b), on ``gpu``."""
    spec = {
        "project": "p",
        "experiment": "e",
        "method_id": "custom/custom",
        "grace_period_s": 7,
        "resources": {"profile": "h200", "series": "h200", "gpus": members},
    }
    preview = f"pv-{run_id}"
    await store.save_preview(
        Preview(
            preview,
            "d",
            json.dumps(spec),
            PreviewSummary("default", "node", "h200", 0, 0, "h200"),
            now,
            "ada",
        )
    )
    await store.commit(preview, "d", f"rk-{run_id}", "ada", run_id, now)
    job = await store.queued_job(run_id)
    assert job is not None
    nodes = [NODE_A, NODE_B][:members]
    placement = Placement(tuple(MemberPlacement(i, n, (gpu,)) for i, n in enumerate(nodes)))
    orders = await store.reserve_launch(job, placement, lambda _: {}, now + 60_000, now)
    assert orders is not None
    # Only member 0's Prepare goes out at placement (the rendezvous is checked first); every
    # member is reserved all the same.
    first = orders[0].member
    return [MemberKey(run_id, first.attempt, i) for i in range(members)]


async def _world(store: Store, *, runs: int = 1, committed: bool = True) -> list[MemberKey]:
    """Two connected Nodes and ``runs`` two-member Jobs on them, running (or only preparing)."""
    now = 1000
    await store.bootstrap("admin-hash", now)
    for i, node in enumerate((NODE_A, NODE_B)):
        await store.create_join_token(f"join-{i}", "default", now, now + 60_000)
        await store.enroll(f"join-{i}", node, _inventory(node), f"cred-{i}", now)
        await store.node_connected(node, _inventory(node), [], now)
    keys: list[MemberKey] = []
    for r in range(runs):
        run_id = f"run-{r + 1}"
        members = await _job(store, run_id, 2, r, now)
        keys += members
        if committed:
            for key in members:
                node = NODE_A if key.member_index == 0 else NODE_B
                await store.record_prepare_reply(node, key, True, "", "10.0.0.1", 2900, now)
            for key in members:
                node = NODE_A if key.member_index == 0 else NODE_B
                for state in (lc.M_COMMITTED, lc.M_STARTING, lc.M_RUNNING):
                    seq = lc.MEMBER_RANK[state]
                    await store.apply_report(node, Report(seq, key, state, now), now)
    await store.node_disconnected(NODE_B, 2000, "the heartbeat timeout passed")
    return keys


def _rows(path: Path, sql: str, args: tuple[Any, ...] = ()) -> list[Any]:
    return read(current().where(path), Store, sql, args)


def test_declaring_a_node_lost_ends_its_members_fails_the_job_and_stops_the_siblings(
    tmp_path: Path,
) -> None:
    path = tmp_path / "coordinator.db"

    async def go(store: Store) -> tuple[NodeLoss, str, str]:
        keys = await _world(store)
        assert (await store.get_job(RUN)).state == lc.UNKNOWN
        loss = await declare_node_lost(
            store, NODE_B, "ada", "the machine was powered off at its PDU", 3000, connected=False
        )
        assert loss.lost == (keys[1],)
        job = await store.get_job(RUN)
        node = await node_view(store, NODE_B)
        return loss, f"{job.state}|{job.state_reason}", node.scheduling

    loss, job, scheduling = _run(go, path)
    assert job == f"failed|member 1 was {DECLARATION}"
    assert scheduling == "cordoned"
    assert loss.cordoned and loss.runs == (RUN,)
    # Member 0 on node-a worked with it: it is stopped, with the JobSpec's grace period.
    (order,) = loss.orders
    assert isinstance(order, CancelOrder) and order.node_id == NODE_A
    assert order.member.member_index == 0 and order.grace_period_s == 7
    assert DECLARATION in order.reason and not order.declared_lost
    # node-b's GPU went back; node-a's is held until its member ends.
    assert _rows(path, "SELECT node_id FROM reservations") == [(NODE_A,)]
    assert _rows(
        path, "SELECT state, known_state, declared_lost FROM members WHERE member_index = 1"
    ) == [(lc.M_LOST, lc.M_LOST, DECLARATION)]
    kinds = [r[0] for r in _rows(path, "SELECT kind FROM decisions WHERE at_ms = 3000")]
    assert kinds == [
        "member declared lost",
        "release",
        "stop-siblings",
        "state change",
        "node cordoned",
        "node declared lost",
    ]
    (detail,) = _rows(path, "SELECT detail_json FROM decisions WHERE kind = 'node declared lost'")
    assert json.loads(detail[0]) == {
        "by": "ada",
        "cordoned": True,
        "members": [f"{RUN}/1/1"],
        "reason": "the machine was powered off at its PDU",
    }


def test_declaring_it_again_changes_nothing(tmp_path: Path) -> None:
    path = tmp_path / "coordinator.db"

    async def go(store: Store) -> NodeLoss:
        await _world(store)
        await declare_node_lost(store, NODE_B, "ada", "off", 3000, connected=False)
        return await declare_node_lost(store, NODE_B, "ada", "off", 4000, connected=False)

    again = _run(go, path)
    assert again == NodeLoss() and not again.changed
    assert _rows(path, "SELECT COUNT(*) FROM decisions WHERE at_ms = 4000") == [(0,)]
    assert _rows(path, "SELECT COUNT(*) FROM job_states WHERE state = 'failed'") == [(1,)]


def test_a_connected_node_is_refused_and_nothing_changes(tmp_path: Path) -> None:
    path = tmp_path / "coordinator.db"

    async def before(store: Store) -> None:
        await _world(store)

    _run(before, path)
    snapshot = _rows(path, "SELECT * FROM decisions"), _rows(path, "SELECT * FROM members")

    async def go(store: Store) -> None:
        # The serving coordinator holds its stream...
        with pytest.raises(Conflict, match="node-b is connected"):
            await declare_node_lost(store, NODE_B, "ada", "x", 3000, connected=True)
        # ...or the store recorded its Hello since the caller looked.
        with pytest.raises(Conflict, match="node-a is connected"):
            await declare_node_lost(store, NODE_A, "ada", "x", 3000, connected=False)
        with pytest.raises(Conflict, match="--reason"):
            await declare_node_lost(store, NODE_B, "ada", " ", 3000)
        with pytest.raises(NotFound, match="no Node 'node-z'"):
            await declare_node_lost(store, "node-z", "ada", "x", 3000)

    _run(go, path)
    assert (_rows(path, "SELECT * FROM decisions"), _rows(path, "SELECT * FROM members")) == (
        snapshot
    )


def test_with_no_coordinator_serving_a_stale_connected_flag_does_not_block_it(
    tmp_path: Path,
) -> None:
    path = tmp_path / "coordinator.db"

    async def go(store: Store) -> NodeLoss:
        await _world(store)
        # node-a's flag says connected (left from a crash); the admin CLI passes connected=None.
        await store.node_disconnected(NODE_A, 2500, "test")
        await declare_node_lost(store, NODE_B, "ada", "off", 3000)
        return await declare_node_lost(store, NODE_A, "ada", "off", 3000)

    loss = _run(go, path)
    assert [k.member_index for k in loss.lost] == [0]


def test_an_undecided_launch_is_aborted_and_the_other_node_told(tmp_path: Path) -> None:
    path = tmp_path / "coordinator.db"

    async def go(store: Store) -> tuple[NodeLoss, str, str]:
        await _world(store, committed=False)
        loss = await declare_node_lost(
            store, NODE_B, "ada", "the machine was powered off at its PDU", 3000, connected=False
        )
        job = await store.get_job(RUN)
        return loss, job.state, job.state_reason

    loss, state, reason = _run(go, path)
    assert state == lc.ABORTED
    assert reason == f"member 1 on Node node-b was {DECLARATION}"
    assert [(type(o), o.node_id) for o in loss.orders] == [(AbortOrder, NODE_A)]
    assert _rows(path, "SELECT COUNT(*) FROM reservations") == [(0,)]
    assert _rows(path, "SELECT state FROM members ORDER BY member_index") == [
        (lc.M_ABORTED,),
        (lc.M_ABORTED,),
    ]


def test_a_pending_cancel_completes_once_the_node_is_declared_lost(tmp_path: Path) -> None:
    path = tmp_path / "coordinator.db"

    async def go(store: Store) -> tuple[str, str, list[str], NodeLoss]:
        keys = await _world(store)
        await store.node_disconnected(NODE_A, 2000, "test")
        cancel = await store_lifecycle.cancel_job(store, RUN, "ada", False, "", 2500)
        assert cancel.outcome == CANCELLING
        assert (await store.get_job(RUN)).state == lc.CANCELLING
        loss_b = await declare_node_lost(store, NODE_B, "ada", "off", 3000)
        waiting = (await store.get_job(RUN)).state
        loss_a = await declare_node_lost(store, NODE_A, "ada", "off", 3000)
        assert set(loss_a.lost + loss_b.lost) == set(keys)
        job = await store.get_job(RUN)
        return waiting, job.state, [h.state for h in job.history], loss_b

    waiting, state, history, loss_b = _run(go, path)
    assert waiting == lc.CANCELLING  # member 0 on node-a has not ended yet
    assert state == lc.CANCELLED and history[-1] == lc.CANCELLED
    # The person's cancel already stops the siblings: no second stop is recorded.
    assert loss_b.orders == ()
    assert _rows(path, "SELECT kind FROM attempt_stops") == [("cancel",)]


def test_a_returning_node_is_told_to_stop_and_its_reports_are_refused(tmp_path: Path) -> None:
    path = tmp_path / "coordinator.db"

    async def go(store: Store) -> dict[str, Any]:
        keys = await _world(store, runs=2)
        mine = [k for k in keys if k.member_index == 1]
        await declare_node_lost(store, NODE_B, "ada", "off", 3000, connected=False)
        held = [HeldMember(mine[0], lc.M_RUNNING), HeldMember(mine[1], lc.M_CANCELLING)]
        orders = await store.node_connected(NODE_B, _inventory(NODE_B), held, 4000)
        stops = await declared_lost_stops(store, NODE_B, held)
        # Another Node asking about them learns nothing; node-b asking gets the stop.
        foreign = await declared_lost_order(store, NODE_A, mine[0])
        asked = await declared_lost_order(store, NODE_B, mine[0])
        sibling = await declared_lost_order(store, NODE_A, keys[0])
        jobs_before = [(await store.get_job(k.run_id)).state for k in mine]
        exited = Report(9, mine[0], lc.M_EXITED, 4000, has_exit=True, signal=15)
        outcome = await store.apply_report(NODE_B, exited, 4000)
        jobs_after = [(await store.get_job(k.run_id)).state for k in mine]
        return {
            "resent": orders, "stops": stops, "foreign": foreign, "asked": asked,
            "sibling": sibling, "outcome": outcome, "before": jobs_before, "after": jobs_after,
            "mine": mine,
        }  # fmt: skip

    seen = _run(go, path)
    assert not [o for o in seen["resent"] if isinstance(o, CommitOrder)]
    stops = seen["stops"]
    assert [s.member for s in stops] == seen["mine"]
    assert all(s.declared_lost and s.reason == node_loss.declared("ada", "off") for s in stops)
    assert all(s.grace_period_s == 7 and s.node_id == NODE_B for s in stops)
    assert seen["foreign"] is None and seen["sibling"] is None
    assert seen["asked"] == stops[0]
    assert "declared lost by ada: off" in seen["outcome"].refused
    assert not seen["outcome"].applied and not seen["outcome"].ended
    assert seen["before"] == seen["after"] == [lc.FAILED, lc.FAILED]
    (refused,) = _rows(path, "SELECT node_id, detail_json FROM decisions WHERE kind = ?", (
        "report refused",
    ))  # fmt: skip
    assert refused[0] == NODE_B and "declared lost" in refused[1]
    assert _rows(path, "SELECT has_exit FROM members WHERE member_index = 1") == [(0,), (0,)]


def test_max_disconnect_declares_only_overdue_nodes_that_hold_members(tmp_path: Path) -> None:
    path = tmp_path / "coordinator.db"
    config = parse_config('[fleet.default]\nmax_disconnect = "1s"\n', Path("coordinator.toml"))

    async def go(store: Store) -> tuple[list[str], list[str], list[str], str]:
        await _world(store)
        registry = SessionRegistry()
        registry.attach(NodeSession.create(NODE_A))
        woken: list[int] = []
        desk = NodeLossDesk(store, registry, lambda: woken.append(1))
        # node-b went away at 2000 (epoch ms: long ago), but a watch that began now waits.
        first = await MaxDisconnectWatch(store, registry, desk, config.fleets).step()
        began = now_ms() - 1000
        watch = MaxDisconnectWatch(store, registry, desk, config.fleets, started_ms=began)
        second = await watch.step()
        third = await watch.step()
        job = await store.get_job(RUN)
        assert woken
        return first, second, third, job.state_reason

    first, second, third, reason = _run(go, path)
    assert (first, second, third) == ([], [NODE_B], [])
    assert reason.startswith("member 1 was declared lost by coordinator (max_disconnect)")
    (by,) = _rows(path, "SELECT detail_json FROM decisions WHERE kind = 'node declared lost'")
    assert json.loads(by[0])["by"] == node_loss.MAX_DISCONNECT_ACTOR


def test_a_look_the_store_refuses_is_logged_and_the_next_tick_declares(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The declaration's write waits on a lock held past the store's lock timeout and fails with
    StoreUnavailable: the watch logs it and keeps watching, and once the lock is gone the next
    tick declares the Node lost."""
    path = tmp_path / "coordinator.db"
    config = parse_config('[fleet.default]\nmax_disconnect = "1s"\n', Path("coordinator.toml"))
    caplog.set_level(logging.WARNING, logger="tuneplane.coordinator.api.node_loss")

    def failed() -> bool:
        return any("max_disconnect look failed" in r.getMessage() for r in caplog.records)

    async def go(store: Store) -> str:
        await _world(store)
        registry = SessionRegistry()
        registry.attach(NodeSession.create(NODE_A))
        desk = NodeLossDesk(store, registry, lambda: None)
        watch = MaxDisconnectWatch(store, registry, desk, config.fleets, tick_s=0.05, started_ms=0)
        with anyio.fail_after(60):
            async with anyio.create_task_group() as tg:
                with write_lock(current().where(path)):
                    tg.start_soon(watch.run)
                    while not failed():
                        await anyio.sleep(0.05)
                while not (await store.get_job(RUN)).state_reason.startswith("member 1 was"):
                    await anyio.sleep(0.05)
                tg.cancel_scope.cancel()
        return (await store.get_job(RUN)).state_reason

    reason = _run(go, path)
    assert reason.startswith("member 1 was declared lost by coordinator (max_disconnect)")
    (message,) = [r.getMessage() for r in caplog.records if "look failed" in r.getMessage()]
    assert "stayed locked" in message


def test_max_disconnect_is_off_unless_a_fleet_sets_it(tmp_path: Path) -> None:
    path = tmp_path / "coordinator.db"

    async def go(store: Store) -> tuple[bool, list[str]]:
        await _world(store)
        registry = SessionRegistry()
        desk = NodeLossDesk(store, registry, lambda: None)
        watch = MaxDisconnectWatch(store, registry, desk, {}, started_ms=0)
        await watch.run()  # returns at once: nothing to watch
        return watch.enabled, await watch.step()

    assert _run(go, path) == (False, [])


def test_the_node_reads_declared_lost_from_the_cancel_on_the_wire() -> None:
    key = MemberKey(RUN, 1, 1)
    for lost in (True, False):
        order = CancelOrder(NODE_B, key, DECLARATION, 7, declared_lost=lost)
        sent = bytes(order_to_wire(order))
        cancel = from_wire(v1.CoordinatorMessage().parse(sent))
        assert isinstance(cancel, agent_messages.Cancel)
        assert (cancel.declared_lost, cancel.reason, cancel.grace_period_s) == (
            lost,
            DECLARATION,
            7,
        )
        assert str(cancel.key) == f"{RUN}.1.1"
