"""How a Node follows the coordinator to a new control address (agent/control_address.py):
the announced address is dialed first, the replaced ones are kept as fallbacks, and a bad one
changes nothing."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from tuneplane.agent import control_address as ca
from tuneplane.agent.state_dir import NodeConfig

NODE = NodeConfig("node-1", "default", "10.0.0.1:7444", "gpu-a", "/ca.pem", 1)


def test_a_new_address_is_dialed_first_and_the_old_one_kept() -> None:
    moved = ca.adopt(NODE, "coord-b.example:7444")
    assert moved is not None
    assert moved.coordinator == "coord-b.example:7444"
    assert moved.previous_coordinators == ("10.0.0.1:7444",)
    assert ca.dial_order(moved) == ("coord-b.example:7444", "10.0.0.1:7444")


def test_the_same_or_no_address_changes_nothing() -> None:
    assert ca.adopt(NODE, "10.0.0.1:7444") is None
    assert ca.adopt(NODE, "") is None


@pytest.mark.parametrize("bad", ["coord-b", "coord-b:", ":7444", "coord-b:70000", "coord-b:x"])
def test_an_address_that_is_not_host_port_is_refused(bad: str) -> None:
    with pytest.raises(ca.BadControlAddress, match="not HOST:PORT; the Node keeps dialing"):
        ca.adopt(NODE, bad)


def test_moving_back_does_not_list_an_address_twice() -> None:
    there = ca.adopt(NODE, "b:1")
    assert there is not None
    back = ca.adopt(there, "10.0.0.1:7444")
    assert back is not None
    assert ca.dial_order(back) == ("10.0.0.1:7444", "b:1")


ADDRESSES = st.sampled_from(["a:1", "b:2", "c:3", "d:4", "e:5", "10.0.0.1:7444", "[::1]:9"])


@given(st.lists(ADDRESSES, max_size=12))
def test_any_sequence_keeps_the_newest_first_unique_and_bounded(announced: list[str]) -> None:
    node = NODE
    for address in announced:
        node = ca.adopt(node, address) or node
    order = ca.dial_order(node)
    if announced:
        assert order[0] == announced[-1]
    assert len(order) == len(set(order)) <= 1 + ca.MAX_PREVIOUS
    # Every fallback is an address the Node once dialed first.
    assert set(order) <= {*announced, NODE.coordinator}
