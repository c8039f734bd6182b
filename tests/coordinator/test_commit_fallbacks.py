"""A Commit names the other coordinators' telemetry gateways (``telemetry_fallbacks``): the
credential minter puts them on every Commit order with a credential recorded in a real
telemetry store, and they cross the wire unchanged, in order."""

from __future__ import annotations

import asyncio
from pathlib import Path

from tests.support.store_backend import current
from tuneplane.coordinator.auth import hash_credential
from tuneplane.coordinator.gateways.collector_credentials import CollectorCredentials
from tuneplane.coordinator.store.telemetry import TelemetryStore
from tuneplane.coordinator.values.jobs import MemberKey
from tuneplane.coordinator.values.orders import AbortOrder, CommitOrder, Order
from tuneplane.coordinator.wire.control import order_from_wire, order_to_wire
from tuneplane.proto import v1

MEMBER = MemberKey("run-000000000001", 1, 0)
FALLBACKS = ("10.0.0.2:7445", "[fd00::3]:7445")


def test_fallbacks_come_back_from_the_wire_in_order() -> None:
    order = CommitOrder("node-a", MEMBER, "10.0.0.9", 29500, "tpc_x", "10.0.0.1:7445", FALLBACKS)
    data = bytes(order_to_wire(order))
    message = v1.CoordinatorMessage().parse(data)
    assert list(message.commit.telemetry_fallbacks) == list(FALLBACKS)
    assert order_from_wire("node-a", message) == order


def test_a_commit_without_fallbacks_reads_as_none() -> None:
    message = v1.CoordinatorMessage(commit=v1.Commit(member=v1.MemberRef(run_id="r", attempt=1)))
    read = order_from_wire("node-a", v1.CoordinatorMessage().parse(bytes(message)))
    assert isinstance(read, CommitOrder)
    assert read.telemetry_fallbacks == ()


async def _attached(path: Path, fallbacks: tuple[str, ...]) -> tuple[list[Order], bool]:
    store = await TelemetryStore.open(current().where(path))
    try:
        minter = CollectorCredentials(store, "10.0.0.1:7445", fallbacks)
        orders: list[Order] = [
            CommitOrder("node-a", MEMBER, "10.0.0.9", 29500),
            AbortOrder("node-b", MemberKey("run-000000000002", 1, 0), "refused"),
        ]
        out = await minter.attach(orders, 1_000)
        commit = out[0]
        assert isinstance(commit, CommitOrder)
        grant = await store.grant_for(hash_credential(commit.collector_credential))
        return out, grant is not None and grant.member == MEMBER
    finally:
        await store.close()


def test_every_commit_order_gets_the_gateway_and_its_fallbacks(tmp_path: Path) -> None:
    out, recorded = asyncio.run(_attached(tmp_path / "telemetry.db", FALLBACKS))
    commit, abort = out
    assert isinstance(commit, CommitOrder)
    assert commit.collector_credential.startswith("tpc_")
    assert (commit.telemetry_address, commit.telemetry_fallbacks) == ("10.0.0.1:7445", FALLBACKS)
    assert recorded, "the credential the Commit carries is recorded in the telemetry store"
    assert isinstance(abort, AbortOrder)


def test_one_coordinator_hands_out_no_fallbacks(tmp_path: Path) -> None:
    out, _ = asyncio.run(_attached(tmp_path / "telemetry.db", ()))
    commit = out[0]
    assert isinstance(commit, CommitOrder)
    assert commit.telemetry_fallbacks == ()
