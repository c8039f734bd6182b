"""Conversion between the agent's messages and the generated protobuf classes."""

from __future__ import annotations

import pytest

from tuneplane.agent import messages as m
from tuneplane.agent.inventory import SimulatedGpus, simulated_inventory
from tuneplane.agent.journal_records import Exit, MemberKey, PendingReport
from tuneplane.agent.member_state import MemberState
from tuneplane.agent.wire import Endpoint, UnknownMessage
from tuneplane.agent.wire_convert import from_wire, inventory_from_wire, inventory_to_wire, to_wire
from tuneplane.proto import v1

KEY = MemberKey("run-1", 2, 1)


@pytest.mark.parametrize("state", list(MemberState))
def test_every_member_state_has_a_wire_value(state: MemberState) -> None:
    report = PendingReport(5, KEY, state, 10, "why", Exit(None, 9), "/o")
    wire = to_wire(m.Report(report)).report
    assert wire.state.name == state.name
    assert (wire.report_seq, wire.member.run_id, wire.member.attempt) == (5, "run-1", 2)
    assert wire.has_exit and wire.signal == 9 and wire.exit_code == 0


def test_hello_and_heartbeat_carry_the_inventory() -> None:
    inv = simulated_inventory("node-a", SimulatedGpus("h200", 2))
    hello = to_wire(
        m.Hello("n1", "0.1.0", inv, ((KEY, MemberState.RUNNING),), "", None, 2, ("cap-a",))
    ).hello
    assert (hello.protocol, hello.capabilities) == (2, ["cap-a"])
    assert inventory_from_wire(hello.inventory) == inv
    assert hello.held[0].state == v1.MemberState.RUNNING
    beat = to_wire(m.Heartbeat(3, 7, None)).heartbeat
    assert beat.seq == 3 and not beat.inventory.gpus
    assert inventory_to_wire(inv).gpu_source == "simulated"


def test_coordinator_messages_become_domain_messages() -> None:
    ref = v1.MemberRef(run_id="run-1", attempt=2, member_index=1)
    prepare = v1.CoordinatorMessage(
        prepare=v1.Prepare(
            member=ref, jobspec_json="{}", member_count=2, gpu_indexes=[0, 1],
            pick_rendezvous=True, capsule_digests={"a": "sha256:00"}, capsule_files={"a": b"x"},
        )
    )  # fmt: skip
    assert from_wire(prepare) == m.Prepare(KEY, "{}", 2, (0, 1), True, {"a": "sha256:00"},
                                           {"a": b"x"})  # fmt: skip
    commit = v1.CoordinatorMessage(commit=v1.Commit(member=ref))
    assert from_wire(commit) == m.Commit(KEY, None)
    commit = v1.CoordinatorMessage(
        commit=v1.Commit(member=ref, rendezvous=v1.Rendezvous(master_addr="h", master_port=9))
    )
    assert from_wire(commit) == m.Commit(KEY, m.Rendezvous("h", 9))
    cancel = v1.CoordinatorMessage(cancel=v1.Cancel(member=ref, reason="r", grace_period_s=4))
    assert from_wire(cancel) == m.Cancel(KEY, "r", 4)
    welcome = v1.CoordinatorMessage(welcome=v1.Welcome(heartbeat_interval_ms=500))
    assert from_wire(welcome) == m.Welcome(500, 0, 0)
    welcome = v1.CoordinatorMessage(
        welcome=v1.Welcome(coordinator_version="0.2.0", protocol=2, capabilities=["x", "y"])
    )
    said = from_wire(welcome)
    assert isinstance(said, m.Welcome)
    assert (said.coordinator_version, said.protocol, said.capabilities) == ("0.2.0", 2, ("x", "y"))
    update = v1.CoordinatorMessage(coordinators=v1.Coordinators(addresses=["a:1", "b:2"]))
    assert from_wire(update) == m.Coordinators(("a:1", "b:2"))
    with pytest.raises(UnknownMessage, match="upgrade tuneplane-node"):
        from_wire(v1.CoordinatorMessage())


def test_endpoint_parsing() -> None:
    assert Endpoint.parse("127.0.0.1:7443") == Endpoint("127.0.0.1", 7443)
    assert Endpoint.parse("[::1]:80") == Endpoint("::1", 80)
    for bad in ("localhost", "h:0", ":80", "h:x"):
        with pytest.raises(ValueError, match="HOST:PORT"):
            Endpoint.parse(bad)
