"""The outputs fetch on the wire: Hello.outputs read into the store's value, and a Prepare's
InitFromFetch put on the wire and read back byte for byte by what a Node decodes."""

from __future__ import annotations

import attrs
import betterproto
import pytest

from tuneplane.coordinator.values.jobs import MemberKey
from tuneplane.coordinator.values.orders import InitFromFetch, OutputsService, PrepareOrder
from tuneplane.coordinator.wire.control import order_to_wire, outputs_from_wire
from tuneplane.proto import v1

pytestmark = pytest.mark.timeout(30)

FETCH = InitFromFetch("10.0.0.7:7463", "cd" * 32, "ef" * 32, 1_700_001_800_000)
ORDER = PrepareOrder(
    node_id="node-t",
    member=MemberKey("run-new", 1, 0),
    jobspec_json="{}",
    member_count=1,
    gpu_indexes=(0,),
    pick_rendezvous=True,
    capsule_files={},
    init_from_fetch=FETCH,
)


def _through_bytes(order: PrepareOrder) -> v1.Prepare:
    data = bytes(order_to_wire(order))
    return v1.CoordinatorMessage().parse(data).prepare


def test_a_prepare_carries_init_from_fetch_whole() -> None:
    prepare = _through_bytes(ORDER)
    assert betterproto.serialized_on_wire(prepare.init_from_fetch)
    got = prepare.init_from_fetch
    assert (got.address, got.cert_sha256, got.grant, got.grant_expires_at_ms) == (
        FETCH.address,
        FETCH.cert_sha256,
        FETCH.grant,
        FETCH.grant_expires_at_ms,
    )
    # Logged orders never show the grant.
    assert FETCH.grant not in repr(ORDER)


def test_a_prepare_without_a_fetch_leaves_it_unset() -> None:
    prepare = _through_bytes(attrs.evolve(ORDER, init_from_fetch=None))
    assert not betterproto.serialized_on_wire(prepare.init_from_fetch)


def test_hello_outputs_are_read_as_sent() -> None:
    key = bytes(range(32))
    sent = v1.Hello(
        node_id="node-h",
        outputs=v1.OutputsService(address="10.0.0.7:7463", cert_sha256="cd" * 32, grant_key=key),
    )
    hello = v1.Hello().parse(bytes(sent))
    assert outputs_from_wire(hello) == OutputsService("10.0.0.7:7463", "cd" * 32, key)
    assert outputs_from_wire(v1.Hello().parse(bytes(v1.Hello(node_id="node-h")))) is None
    empty = v1.Hello(node_id="node-h", outputs=v1.OutputsService(grant_key=key))
    assert outputs_from_wire(v1.Hello().parse(bytes(empty))) is None
