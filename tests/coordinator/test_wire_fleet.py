"""The Api's Fleet and Node calls (coordinator/wire/fleet.py): a Fleet and a Node (its inventory,
who holds each GPU, its members) come back equal from the wire, and what a Node reported cannot
reach ``tp``'s terminal as an escape sequence."""

from __future__ import annotations

from typing import TypeVar

import betterproto
import pytest
from hypothesis import given
from hypothesis import strategies as st

from tests.support import value_strategies as vs
from tuneplane.coordinator.values.fleet import Fleet, Node
from tuneplane.coordinator.values.jobs import MemberKey
from tuneplane.coordinator.values.orders import Gpu, Inventory
from tuneplane.coordinator.wire.fleet import (
    fleet_from_wire,
    fleet_to_wire,
    fleets_from_wire,
    fleets_to_wire,
    node_from_wire,
    node_to_wire,
    nodes_from_wire,
    nodes_to_wire,
)
from tuneplane.proto import v1

pytestmark = pytest.mark.timeout(120)

M = TypeVar("M", bound=betterproto.Message)


def through_bytes(msg: M) -> M:
    return type(msg)().parse(bytes(msg))


@given(vs.fleets)
def test_a_fleet_comes_back_equal(fleet: Fleet) -> None:
    assert fleet_from_wire(through_bytes(fleet_to_wire(fleet))) == fleet


@given(st.lists(vs.fleets, max_size=3))
def test_a_fleet_list_comes_back_equal(fleets: list[Fleet]) -> None:
    assert fleets_from_wire(through_bytes(fleets_to_wire(fleets))) == fleets


@given(vs.nodes())
def test_a_node_comes_back_equal(node: Node) -> None:
    assert node_from_wire(through_bytes(node_to_wire(node))) == node


@given(st.lists(vs.nodes(), max_size=3))
def test_a_node_list_comes_back_equal(nodes: list[Node]) -> None:
    assert nodes_from_wire(through_bytes(nodes_to_wire(nodes))) == nodes


def _node(**changes: object) -> Node:
    fields: dict[str, object] = {
        "id": "node-1",
        "fleet": "default",
        "hostname": "gpu-07",
        "scheduling": "schedulable",
        "scheduling_reason": "",
        "scheduling_changed_at_ms": 0,
        "scheduling_changed_by": "",
        "connected": True,
        "disconnected_since_ms": 0,
        "last_heartbeat_ms": 0,
        "enrolled_at_ms": 1,
        "inventory": Inventory("gpu-07", (Gpu(0, "h200", True), Gpu(1, "h200", True))),
        "held_by": {1: MemberKey("run-1", 1, 0)},
        "members": (),
        "name": "gpu-07",
    }
    fields.update(changes)
    return Node(**fields)  # type: ignore[arg-type]


def test_each_gpu_travels_with_who_holds_it() -> None:
    msg = through_bytes(node_to_wire(_node()))
    holders = [(g.gpu.index, g.held_by.run_id) for g in msg.gpus]
    assert holders == [(0, ""), (1, "run-1")]


def test_a_node_from_a_coordinator_older_than_names_is_named_by_its_id() -> None:
    msg = through_bytes(node_to_wire(_node(name="")))
    assert node_from_wire(msg).name == "node-1"


def test_escape_sequences_a_node_reported_are_made_printable_before_tp_sees_them() -> None:
    bad = "\x1b[2J\x1b]0;owned\x07"
    inventory = Inventory(bad, (Gpu(0, "h200", False, health_reason=bad),), gpu_source="nvml")
    msg = through_bytes(node_to_wire(_node(hostname=bad, inventory=inventory, held_by={})))
    read = node_from_wire(msg)
    shown = [read.hostname, read.inventory.hostname, read.inventory.gpus[0].health_reason]
    assert all("\x1b" not in s and "\x07" not in s for s in shown)
    assert read.hostname == "\\x1b[2J\\x1b]0;owned\\x07"


def test_tp_reads_a_reply_whose_member_names_no_run_without_failing() -> None:
    msg = v1.Node(id="node-1", name="n", members=[v1.NodeMember(state="running")])
    (member,) = node_from_wire(through_bytes(msg)).members
    assert member.member == MemberKey("", 0, 0)
