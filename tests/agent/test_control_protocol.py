"""The version-skew policy (proto/contract/control_protocol.py), exhaustively over protocols."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from tuneplane.proto.contract import control_protocol as protocol


def test_an_unversioned_hello_or_welcome_speaks_protocol_1() -> None:
    assert protocol.spoken(0) == 1 == protocol.UNVERSIONED
    assert protocol.Peer.said("", 0, []) == protocol.UNKNOWN_PEER


@given(st.integers(min_value=0, max_value=protocol.PROTOCOL + 5), st.text(max_size=12))
def test_an_agent_is_accepted_exactly_within_the_skew(wire: int, version: str) -> None:
    agent = protocol.Peer.said(version, wire, [])
    refusal = protocol.judge_agent(agent, "7.0.0")
    within = protocol.PROTOCOL - protocol.AGENT_SKEW <= agent.protocol <= protocol.PROTOCOL
    assert (refusal is None) == within
    if refusal is not None:
        # Both releases and both protocols, and what to upgrade.
        assert agent.text in refusal and "coordinator 7.0.0" in refusal
        assert f"control protocol {protocol.PROTOCOL}" in refusal
        assert "Upgrade" in refusal and refusal.endswith(".")


def test_the_previous_release_is_within_the_policy_and_a_newer_agent_is_not() -> None:
    previous = protocol.Peer.said("0.1.0", 0, [])
    assert protocol.judge_agent(previous, "0.2.0") is None
    newer = protocol.Peer.said("9.0.0", protocol.PROTOCOL + 1, [])
    refusal = protocol.judge_agent(newer, "0.2.0")
    assert refusal is not None and "Upgrade the coordinators first" in refusal


def test_only_a_coordinator_older_than_this_agent_is_warned_of() -> None:
    current = protocol.Peer.said("0.2.0", protocol.PROTOCOL, [])
    assert protocol.coordinator_warning(current, "0.2.0") is None
    old = protocol.Peer.said("0.1.0", 0, [])
    warning = protocol.coordinator_warning(old, "0.2.0")
    assert warning is not None and "0.1.0 (control protocol 1)" in warning


def test_each_side_announces_only_capabilities_the_protocol_names() -> None:
    names = {c.value for c in protocol.Capability}
    assert set(protocol.AGENT_CAPABILITIES) <= names
    assert set(protocol.COORDINATOR_CAPABILITIES) <= names
    assert protocol.Peer.said("x", 2, ["coordinators-update"]).can(
        protocol.Capability.COORDINATORS_UPDATE
    )


def test_the_status_command_says_both_versions_and_warns_of_an_older_coordinator() -> None:
    from tuneplane.agent.status_cli import _versions

    assert _versions({})["summary"] == (
        "versions: agent unknown (control protocol ?), coordinator not yet heard"
    )
    current = {"agent_version": "0.2.0", "protocol": 2, "coordinator_version": "0.2.0",
               "coordinator_protocol": 2, "coordinator_capabilities": ["b", "a"]}  # fmt: skip
    said = _versions(current)
    assert said["summary"] == (
        "versions: agent 0.2.0 (control protocol 2), coordinator 0.2.0 (control protocol 2)"
    )
    assert said["coordinator_capabilities"] == ["a", "b"] and not said["skew_warning"]
    older = _versions({**current, "coordinator_version": "unknown", "coordinator_protocol": 1})
    assert "unknown (control protocol 1) is older" in older["skew_warning"]


def test_a_busy_refusals_turn_reads_as_seconds_and_anything_else_as_none() -> None:
    header = protocol.COME_BACK_HEADER
    assert protocol.come_back_in({header: "2500"}) == 2.5
    assert protocol.come_back_in({header: "-3"}) == 0.0
    assert protocol.come_back_in({header: "999999999"}) == protocol.COME_BACK_CAP_S
    assert protocol.come_back_in({header: "soon"}) is None
    assert protocol.come_back_in({}) is None
    assert protocol.come_back_in(None) is None


def test_a_place_in_lines_wait_reads_as_seconds_and_no_place_as_none() -> None:
    queued, wait = protocol.QUEUED_HEADER, protocol.WAIT_HEADER
    assert protocol.queued_for({queued: "in line", wait: "2500"}) == 2.5
    assert protocol.queued_for({queued: "in line", wait: "-3"}) == 0.0
    assert protocol.queued_for({queued: "in line", wait: "999999999"}) == protocol.QUEUED_CAP_S
    # In line with no wait that reads as milliseconds: the longest a Node waits.
    assert protocol.queued_for({queued: "in line", wait: "soon"}) == protocol.QUEUED_CAP_S
    assert protocol.queued_for({queued: "in line"}) == protocol.QUEUED_CAP_S
    assert protocol.queued_for({wait: "2500"}) is None
    assert protocol.queued_for(None) is None


def test_connects_request_metadata_says_the_agents_capabilities() -> None:
    from tuneplane.agent.wire_control import connect_metadata

    said = protocol.from_metadata(connect_metadata("secret"))
    assert said is not None and said.can(protocol.Capability.QUEUED_CONNECT)
    assert said.capabilities == frozenset(protocol.AGENT_CAPABILITIES)
    # The probe for why a Connect was refused says none: it is never put in line.
    probe = protocol.from_metadata(connect_metadata("secret", ()))
    assert probe is not None and probe.capabilities == frozenset()
    assert protocol.from_metadata(
        {protocol.PROTOCOL_HEADER: "2", "tuneplane-capabilities": " a, ,b"}
    ) == (protocol.Peer("unknown", 2, frozenset({"a", "b"})))
