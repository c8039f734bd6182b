"""A plain Heartbeat read by its layout, and a HeartbeatAck written by it, against betterproto.

The fast reading must never take what the general decoder would read differently: whatever
:func:`plain_heartbeat` accepts, the bounded decoder reads as the same Heartbeat with nothing
else in it; what it declines goes to that decoder with every check.
"""

from __future__ import annotations

import betterproto
import pytest
from grpclib import GRPCError
from hypothesis import example, given
from hypothesis import strategies as st

from tuneplane.coordinator.gateways.bounded_decode import decode
from tuneplane.coordinator.gateways.heartbeat_layout import heartbeat_ack, plain_heartbeat
from tuneplane.proto import v1

UINT64 = st.integers(0, 2**64 - 1)
INT64 = st.integers(-(2**63), 2**63 - 1)


def _general(data: bytes) -> v1.NodeMessage | None:
    """What the gateway's full decoder makes of ``data``; None when it refuses it."""
    try:
        return decode(data, v1.NodeMessage)
    except GRPCError:
        return None


@given(seq=UINT64)
@example(seq=0)
@example(seq=2**63)
def test_the_ack_is_betterprotos_encoding_byte_for_byte(seq: int) -> None:
    expected = bytes(v1.CoordinatorMessage(heartbeat_ack=v1.HeartbeatAck(seq=seq)))
    assert heartbeat_ack(seq) == expected
    assert v1.CoordinatorMessage().parse(heartbeat_ack(seq)).heartbeat_ack.seq == seq


@given(seq=st.integers(0, 2**63 - 1), sent_at=st.integers(0, 2**63 - 1))
@example(seq=0, sent_at=0)
def test_an_agents_heartbeat_is_read_by_its_layout(seq: int, sent_at: int) -> None:
    data = bytes(v1.NodeMessage(heartbeat=v1.Heartbeat(seq=seq, sent_at_ms=sent_at)))
    assert plain_heartbeat(data) == seq


@given(seq=UINT64, sent_at=INT64)
@example(seq=2**63, sent_at=0)  # a 10-byte varint: left to betterproto
@example(seq=1, sent_at=-1)
def test_what_the_layout_declines_the_general_decoder_still_reads(seq: int, sent_at: int) -> None:
    data = bytes(v1.NodeMessage(heartbeat=v1.Heartbeat(seq=seq, sent_at_ms=sent_at)))
    fast = plain_heartbeat(data)
    general = _general(data)
    assert general is not None
    assert fast in (None, general.heartbeat.seq)
    if seq >= 2**63 or sent_at < 0:
        assert fast is None


def test_a_heartbeat_with_an_inventory_or_another_body_is_left_to_the_general_decoder() -> None:
    with_inventory = v1.Heartbeat(seq=3, inventory=v1.Inventory(hostname="a", cpu_count=4))
    for message in (
        v1.NodeMessage(heartbeat=with_inventory),
        v1.NodeMessage(hello=v1.Hello(node_id="node-a")),
        v1.NodeMessage(report=v1.MemberReport()),
        v1.NodeMessage(),
    ):
        assert plain_heartbeat(bytes(message)) is None, message


def _key(number: int, wire_type: int) -> bytes:
    return betterproto.encode_varint(number << 3 | wire_type)


@pytest.mark.parametrize(
    "data",
    [
        # an unknown field inside the Heartbeat
        _key(2, 2) + bytes([4]) + _key(1, 0) + b"\x05" + _key(9, 0) + b"\x01",
        # a second Heartbeat (protobuf merges them)
        _key(2, 2) + b"\x02\x08\x05" + _key(2, 2) + b"\x02\x08\x06",
        # seq sent with the wrong wire type
        _key(2, 2) + b"\x05" + _key(1, 2) + b"\x03abc",
        # a length past the end, and one short of it
        _key(2, 2) + b"\x05\x08\x05",
        _key(2, 2) + b"\x01\x08\x05",
        # a varint that never ends
        _key(2, 2) + b"\x03\x08\xff\xff",
        # a non-minimal key (two bytes for key 8)
        _key(2, 2) + b"\x03\x88\x00\x05",
    ],
)
def test_odd_bytes_are_declined(data: bytes) -> None:
    assert plain_heartbeat(data) is None


@given(st.binary(max_size=40))
def test_anything_the_layout_takes_decodes_to_the_same_plain_heartbeat(data: bytes) -> None:
    seq = plain_heartbeat(data)
    if seq is None:
        return
    general = _general(data)
    assert general is not None, data.hex()
    kind, body = betterproto.which_one_of(general, "body")
    assert kind == "heartbeat" and isinstance(body, v1.Heartbeat)
    assert body.seq == seq
    assert not betterproto.serialized_on_wire(body.inventory)


@given(
    st.lists(st.tuples(st.sampled_from([1, 2]), st.integers(0, 2**63 - 1)), min_size=1, max_size=6)
)
def test_fields_in_any_order_and_repeated_read_as_protobuf_reads_them(
    fields: list[tuple[int, int]],
) -> None:
    body = b"".join(_key(n, 0) + betterproto.encode_varint(v) for n, v in fields)
    data = _key(2, 2) + betterproto.encode_varint(len(body)) + body
    general = _general(data)
    assert general is not None
    assert plain_heartbeat(data) == general.heartbeat.seq
