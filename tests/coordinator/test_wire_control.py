"""The Node boundary (coordinator/wire/control.py): every value the control stream carries comes
back equal through value -> message -> bytes -> message -> value, what a Node sends comes back
equal through message -> value -> message, and what the protocol does not allow is refused
with a sentence."""

from __future__ import annotations

from typing import TypeVar

import betterproto
import pytest
from hypothesis import given
from hypothesis import strategies as st

from tests.support import value_strategies as vs
from tuneplane.coordinator.values.jobs import MemberKey
from tuneplane.coordinator.values.orders import (
    HeldMember,
    Inventory,
    Order,
    OutputsService,
    Report,
)
from tuneplane.coordinator.wire.control import (
    REPORTED_STATES,
    held_from_wire,
    held_to_wire,
    inventory_from_wire,
    inventory_to_wire,
    member_state_value,
    order_from_wire,
    order_to_wire,
    outputs_from_wire,
    outputs_to_wire,
    report_from_wire,
    report_to_wire,
)
from tuneplane.coordinator.wire.errors import BadMessage
from tuneplane.proto import v1

pytestmark = pytest.mark.timeout(120)

M = TypeVar("M", bound=betterproto.Message)


def through_bytes(msg: M) -> M:
    """``msg`` as the peer decodes it."""
    return type(msg)().parse(bytes(msg))


# -- value -> wire -> value -----------------------------------------------------------------------


@given(vs.inventories)
def test_an_inventory_comes_back_equal(inventory: Inventory) -> None:
    assert inventory_from_wire(through_bytes(inventory_to_wire(inventory))) == inventory


@given(vs.reports)
def test_a_member_report_comes_back_equal(report: Report) -> None:
    assert report_from_wire(through_bytes(report_to_wire(report))) == report


@given(st.lists(vs.held_members, max_size=4))
def test_held_members_come_back_equal(held: list[HeldMember]) -> None:
    hello = v1.Hello(node_id="node-a", held=[held_to_wire(h) for h in held])
    assert held_from_wire(through_bytes(hello)) == held


@given(vs.outputs_services)
def test_an_outputs_service_comes_back_equal(service: OutputsService) -> None:
    hello = v1.Hello(node_id="node-a", outputs=outputs_to_wire(service))
    assert outputs_from_wire(through_bytes(hello)) == service


@given(vs.orders)
def test_every_order_comes_back_equal(order: Order) -> None:
    assert order_from_wire(order.node_id, through_bytes(order_to_wire(order))) == order


# -- what a Node sends: message -> value -> message -----------------------------------------------

refs = st.builds(v1.MemberRef, run_id=vs.name, attempt=vs.u32, member_index=vs.u32)
node_manifests = st.one_of(
    st.just(v1.OutputManifest()),
    st.builds(v1.OutputManifest, files=vs.u32, bytes=vs.u64, sha256=vs.name, problem=vs.text),
)
report_messages = st.builds(
    v1.MemberReport,
    report_seq=vs.u64,
    member=refs,
    state=st.sampled_from(REPORTED_STATES).map(member_state_value),
    at_ms=vs.i64,
    reason=vs.text,
    has_exit=st.booleans(),
    exit_code=vs.i32,
    signal=vs.i32,
    out_dir=vs.text,
    journal_id=vs.text,
    output_manifest=node_manifests,
)
inventory_messages = st.builds(
    v1.Inventory,
    hostname=vs.name,
    cpu_count=vs.u32,
    memory_bytes=vs.u64,
    gpus=st.lists(
        st.builds(
            v1.Gpu,
            index=vs.u32,
            uuid=vs.text,
            name=vs.text,
            series=vs.text,
            memory_bytes=vs.u64,
            mig_enabled=st.booleans(),
            healthy=st.booleans(),
            health_reason=vs.text,
        ),
        max_size=3,
    ),
    gpu_source=vs.name,
    driver_version=vs.text,
    cuda_version=vs.text,
)


@given(report_messages)
def test_a_node_s_report_is_read_whole(msg: v1.MemberReport) -> None:
    assert report_to_wire(report_from_wire(through_bytes(msg))) == msg


@given(inventory_messages)
def test_a_node_s_inventory_is_read_whole(msg: v1.Inventory) -> None:
    assert inventory_to_wire(inventory_from_wire(through_bytes(msg))) == msg


# -- what the protocol does not allow -------------------------------------------------------------


def test_a_report_of_a_state_no_node_may_report_is_refused() -> None:
    msg = v1.MemberReport(member=v1.MemberRef("run-1", 1, 0), state=v1.MemberState(0))
    with pytest.raises(BadMessage, match=r"member state 0 is not one a Node may report\."):
        report_from_wire(through_bytes(msg))


def test_a_report_that_names_no_member_is_refused() -> None:
    msg = v1.MemberReport(state=member_state_value("running"))
    with pytest.raises(BadMessage, match=r"member\.run_id is empty"):
        report_from_wire(through_bytes(msg))


def test_hello_skips_a_held_member_it_cannot_read_and_keeps_the_rest() -> None:
    good = HeldMember(MemberKey("run-1", 1, 0), "running")
    hello = v1.Hello(
        held=[
            v1.HeldMember(member=v1.MemberRef(), state=member_state_value("running")),
            held_to_wire(good),
            v1.HeldMember(member=v1.MemberRef("run-2", 1, 0), state=v1.MemberState(0)),
        ]
    )
    assert held_from_wire(through_bytes(hello)) == [good]


def test_hello_without_outputs_or_with_an_empty_address_serves_none() -> None:
    assert outputs_from_wire(v1.Hello(node_id="node-a")) is None
    empty = v1.Hello(outputs=v1.OutputsService(grant_key=b"k" * 32))
    assert outputs_from_wire(through_bytes(empty)) is None


def test_an_inventory_names_the_host_and_a_gpu_source_even_when_the_node_did_not() -> None:
    assert inventory_from_wire(None, "gpu-07") == Inventory(hostname="gpu-07")
    read = inventory_from_wire(through_bytes(v1.Inventory(cpu_count=8)), "gpu-07")
    assert (read.hostname, read.gpu_source, read.cpu_count) == ("gpu-07", "none", 8)


def test_a_message_that_carries_no_order_is_not_read_as_one() -> None:
    msg = v1.CoordinatorMessage(heartbeat_ack=v1.HeartbeatAck())
    with pytest.raises(BadMessage, match=r"carries heartbeat_ack, not an order\."):
        order_from_wire("node-a", msg)
