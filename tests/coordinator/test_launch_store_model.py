"""The real store beside the pure launch table: after every step they agree.

A Hypothesis ``RuleBasedStateMachine`` plays one attempt of 1-3 members through the real
``Store`` (a real database file) and, beside it, through :func:`launch.step` alone: replies from
the right and the wrong Node, repeats, refusals, a passed deadline, DecisionQuery, reconnects,
a cancel, a Node declared lost, and coordinator restarts (the store closed and opened again).
After every step the orders the store returned equal what the table sends, and the attempt the
store records (decision, reason, rendezvous, nonce, every member's prepared flag and state)
equals the table's.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Coroutine, Sequence
from pathlib import Path
from tempfile import TemporaryDirectory
from typing import Any, TypeVar

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

from tests.support.store_backend import current
from tuneplane.coordinator import launch
from tuneplane.coordinator.placement import MemberPlacement, Placement
from tuneplane.coordinator.store import lifecycle as store_lifecycle
from tuneplane.coordinator.store.core import Store
from tuneplane.coordinator.store.lost_nodes import declare_node_lost
from tuneplane.coordinator.values.jobs import MemberKey, Preview, PreviewSummary
from tuneplane.coordinator.values.orders import (
    AbortOrder,
    CommitOrder,
    Gpu,
    Inventory,
    Order,
    PrepareOrder,
)

T = TypeVar("T")
NODES = ("node-a", "node-b", "node-c")
RUN = "run-model"
DEADLINE = 60_000


def _inventory(name: str) -> Inventory:
    gpus = tuple(Gpu(i, "h200", True, f"GPU-{name}-{i}") for i in range(2))
    return Inventory(hostname=name, gpus=gpus, gpu_source="simulated")


def _sends(orders: Sequence[Order]) -> list[launch.Send]:
    """The store's orders in the table's words."""
    out = []
    for o in orders:
        index = o.member.member_index
        if isinstance(o, PrepareOrder):
            out.append(launch.Send("prepare", o.node_id, index))
        elif isinstance(o, CommitOrder):
            out.append(
                launch.Send(
                    "commit", o.node_id, index, master_addr=o.master_addr, master_port=o.master_port
                )
            )
        else:
            assert isinstance(o, AbortOrder), o
            out.append(launch.Send("abort", o.node_id, index, o.reason))
    return out


class StoreBesideTable(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.loop = asyncio.new_event_loop()
        self.folder = TemporaryDirectory()
        # The test's backend: on PostgreSQL its database, emptied for each run.
        self.path = current().where(Path(self.folder.name) / "coordinator.db", fresh=True)
        self.store: Store | None = None
        self.model: launch.Attempt | None = None
        self.attempt = 0
        self.now = 1_000

    def run(self, work: Coroutine[Any, Any, T]) -> T:
        return self.loop.run_until_complete(work)

    def teardown(self) -> None:
        if self.store is not None:
            self.run(self.store.close())
        self.loop.close()
        self.folder.cleanup()

    @property
    def db(self) -> Store:
        assert self.store is not None
        return self.store

    def tick(self) -> int:
        self.now += 1
        return self.now

    @initialize(count=st.integers(min_value=1, max_value=3))
    def reserve(self, count: int) -> None:
        self.store = self.run(Store.open(self.path))
        self.run(self._world(count))

    async def _world(self, count: int) -> None:
        store = self.db
        await store.bootstrap("admin-hash", self.now)
        for i, node in enumerate(NODES):
            await store.create_join_token(f"join-{i}", "default", self.now, self.now + 60_000)
            await store.enroll(f"join-{i}", node, _inventory(node), f"cred-{i}", self.now)
            await store.node_connected(node, _inventory(node), [], self.now)
        spec = {
            "project": "p",
            "experiment": "e",
            "method_id": "custom/custom",
            "resources": {"profile": "h200", "series": "h200", "gpus": count},
        }
        await store.save_preview(
            Preview(
                "pv",
                "d",
                json.dumps(spec),
                PreviewSummary("default", "node", "h200", 0, 0, "h200"),
                self.now,
                "ada",
            )
        )
        await store.commit("pv", "d", "rk", "ada", RUN, self.now)
        job = await store.queued_job(RUN)
        assert job is not None
        placement = Placement(tuple(MemberPlacement(i, NODES[i], (0,)) for i in range(count)))
        orders = await store.reserve_launch(
            job, placement, lambda _: {}, self.now + DEADLINE, self.tick()
        )
        assert orders is not None
        self.attempt = orders[0].member.attempt
        facts = await store.attempt_facts(store.reader, RUN, self.attempt)
        assert facts is not None
        # The table starts from what was reserved: every member reserved, nobody prepared.
        start = launch.Attempt(
            tuple(launch.Member(i, NODES[i]) for i in range(count)), nonce=facts.nonce
        )
        out = launch.step(start, launch.Reserved())
        assert _sends(orders) == list(out.sends)
        self.model = out.attempt

    def apply(self, event: launch.Event, orders: list[Order]) -> None:
        assert self.model is not None
        out = launch.step(self.model, event)
        assert _sends(orders) == list(out.sends), (event, orders, out.sends)
        self.model = out.attempt

    def key(self, index: int) -> MemberKey:
        return MemberKey(RUN, self.attempt, index)

    @rule(
        index=st.integers(0, 3),
        node=st.sampled_from(NODES),
        addr=st.sampled_from(["", "10.0.0.9"]),
        held=st.booleans(),
    )
    def prepared(self, index: int, node: str, addr: str, held: bool) -> None:
        orders = self.run(
            self.db.record_prepare_reply(
                node, self.key(index), True, "", addr, 29_500, self.tick(), rendezvous_held=held
            )
        )
        self.apply(launch.Prepared(node, index, addr, 29_500, held, hostname=node), orders)

    @rule(index=st.integers(0, 2), addr=st.sampled_from(["", "10.0.0.9"]))
    def prepared_by_its_node(self, index: int, addr: str) -> None:
        """The usual case, drawn often so that attempts reach Commit."""
        self.prepared(index, NODES[index], addr, True)

    @rule(index=st.integers(0, 3), node=st.sampled_from(NODES))
    def prepare_failed(self, index: int, node: str) -> None:
        orders = self.run(
            self.db.record_prepare_reply(
                node, self.key(index), False, "disk full", "", 0, self.tick()
            )
        )
        self.apply(launch.PrepareFailed(node, index, "disk full"), orders)

    @rule()
    def deadline_passes(self) -> None:
        self.now += DEADLINE
        orders = self.run(self.db.abort_expired_prepares(self.tick()))
        assert self.model is not None
        if self.model.decision is None:
            self.apply(launch.PrepareTimedOut(), orders)
        else:
            assert orders == []

    @rule(index=st.integers(0, 3), node=st.sampled_from(NODES))
    def decision_queried(self, index: int, node: str) -> None:
        order = self.run(self.db.decision_for(node, self.key(index)))
        self.apply(launch.DecisionQueried(node, index), [] if order is None else [order])

    @rule(node=st.sampled_from(NODES))
    def node_reconnects(self, node: str) -> None:
        orders = self.run(self.db.node_connected(node, _inventory(node), [], self.tick()))
        self.apply(launch.NodeReconnected(node), orders)

    @precondition(lambda self: self.model is not None and self.model.decision is None)
    @rule()
    def cancel(self) -> None:
        result = self.run(store_lifecycle.cancel_job(self.db, RUN, "ada", False, "", self.tick()))
        self.apply(launch.Cancelled("cancelled by ada"), list(result.orders))

    @precondition(lambda self: self.model is not None and self.model.decision is None)
    @rule(node=st.sampled_from(NODES))
    def node_declared_lost(self, node: str) -> None:
        assert self.model is not None
        held = any(m.node_id == node for m in self.model.members)
        # Only a Node whose stream is gone can be declared lost.
        self.run(self.db.node_disconnected(node, self.tick(), "unplugged"))
        loss = self.run(
            declare_node_lost(self.db, node, "ada", "unplugged", self.tick(), connected=False)
        )
        if not held:
            assert loss.orders == ()
            return
        # The store words the reason (which member, which Node, who declared it): the table
        # takes it as given. Orders go to the members on the other Nodes only.
        facts = self.run(self.db.attempt_facts(self.db.reader, RUN, self.attempt))
        assert facts is not None
        out = launch.step(self.model, launch.NodeLost(facts.reason))
        assert _sends(list(loss.orders)) == [s for s in out.sends if s.node_id != node]
        self.model = out.attempt

    @rule()
    def coordinator_restarts(self) -> None:
        self.run(self.db.close())
        self.store = self.run(Store.open(self.path))

    @invariant()
    def store_records_what_the_table_says(self) -> None:
        if self.store is None or self.model is None:
            return
        facts = self.run(self.db.attempt_facts(self.db.reader, RUN, self.attempt))
        assert facts == self.model


def test_store_beside_table() -> None:
    # A function, not StoreBesideTable.TestCase: a unittest case takes no fixtures, and every
    # test here runs once per store backend (tests/coordinator/conftest.py).
    run_state_machine_as_test(
        StoreBesideTable,
        settings=settings(
            max_examples=100,
            stateful_step_count=20,
            deadline=None,
            suppress_health_check=[HealthCheck.too_slow],
        ),
    )
