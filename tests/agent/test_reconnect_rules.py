"""How a Node follows the leader and when it dials again (agent/control_address.py,
agent/reconnect.py): the dial order over every known coordinator, the fully jittered backoff
capped from the heartbeat timeout, and the probe watch that ends a wait when a coordinator comes
back. Pure: plain values, no sockets, no clocks."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from tuneplane.agent import control_address as ca
from tuneplane.agent import reconnect as rc
from tuneplane.agent.state_dir import NodeConfig, StateDir

NODE = NodeConfig("node-1", "default", "10.0.0.1:7444", "gpu-a", "/ca.pem", 1)
ADDRESSES = st.sampled_from(["a:1", "b:2", "c:3", "d:4", "10.0.0.1:7444", "[::1]:9"])
JITTER = st.floats(min_value=0.0, max_value=1.0, exclude_max=True)

# --- which addresses, in which order ------------------------------------------------------------


def test_a_welcome_list_is_stored_leader_first_and_an_empty_one_keeps_it() -> None:
    listed = ca.adopt_coordinators(NODE, ["b:7444", "10.0.0.1:7444", "b:7444"])
    assert listed is not None
    assert listed.coordinators == ("b:7444", "10.0.0.1:7444")
    assert ca.adopt_coordinators(listed, ["b:7444", "10.0.0.1:7444"]) is None
    # One coordinator names none: the Node may know this one only through the list it keeps.
    assert ca.adopt_coordinators(listed, []) is None
    moved = ca.adopt_coordinators(listed, ["c:7444", "b:7444"])
    assert moved is not None and moved.coordinators == ("c:7444", "b:7444")


@pytest.mark.parametrize("bad", ["coord-b", "coord-b:", ":7444", "coord-b:70000", "a b:1"])
def test_a_list_with_an_address_that_is_not_host_port_changes_nothing(bad: str) -> None:
    with pytest.raises(ca.BadControlAddress, match="is not HOST:PORT; the Node keeps the list"):
        ca.adopt_coordinators(NODE, ["b:7444", bad])


def test_a_list_longer_than_a_node_keeps_is_refused() -> None:
    many = [f"c{i}:7444" for i in range(ca.MAX_COORDINATORS + 1)]
    with pytest.raises(ca.BadControlAddress, match="Run at most 9 coordinators on one store"):
        ca.adopt_coordinators(NODE, many)


def test_the_address_that_welcomed_leads_then_the_list_then_the_replaced_ones() -> None:
    node = ca.adopt(NODE, "new:7444")
    assert node is not None
    node = ca.adopt_coordinators(node, ["b:7444", "c:7444", "new:7444"])
    assert node is not None
    assert ca.dial_order(node) == ("new:7444", "b:7444", "c:7444", "10.0.0.1:7444")
    assert ca.dial_order(node, welcomed_by="c:7444") == (
        "c:7444", "new:7444", "b:7444", "10.0.0.1:7444",
    )  # fmt: skip
    # An address a probe saw come back goes first of all.
    assert ca.dial_order(node, "c:7444", came_back="b:7444")[:2] == ("b:7444", "c:7444")


@given(
    st.lists(ADDRESSES, max_size=6),
    st.lists(ADDRESSES, max_size=6),
    st.sampled_from(["", "a:1", "z:9"]),
    st.sampled_from(["", "b:2", "y:8"]),
)
def test_any_history_dials_each_known_address_once(
    announced: list[str], listed: list[str], welcomed_by: str, came_back: str
) -> None:
    node = NODE
    for address in announced:
        node = ca.adopt(node, address) or node
    before = node.coordinators
    node = ca.adopt_coordinators(node, listed) or node
    assert node.coordinators == (tuple(dict.fromkeys(listed)) or before)
    order = ca.dial_order(node, welcomed_by, came_back)
    assert len(order) == len(set(order)) and "" not in order
    known = {node.coordinator, *node.coordinators, *node.previous_coordinators}
    assert set(order) == known | ({welcomed_by, came_back} - {""})
    assert order[0] == (came_back or welcomed_by or node.coordinator)


def test_node_json_keeps_the_list_and_an_old_one_reads_without_it(tmp_path: Path) -> None:
    state = StateDir(tmp_path / "state")
    state.create()
    listed = ca.adopt_coordinators(NODE, ["b:7444", "c:7444"])
    assert listed is not None
    state.save_node(listed)
    assert state.load_node() == listed
    raw = json.loads(state.node_file.read_text())
    del raw["coordinators"]
    state.node_file.write_text(json.dumps(raw))
    assert state.load_node().coordinators == ()


# --- when to dial again --------------------------------------------------------------------------


def test_the_cap_is_a_third_of_the_heartbeat_timeout_within_bounds() -> None:
    assert rc.backoff_cap(None) == pytest.approx(5.0)
    assert rc.backoff_cap(15.0) == pytest.approx(5.0)
    assert rc.backoff_cap(3.0) == rc.CAP_FLOOR_S
    assert rc.backoff_cap(3600.0) == rc.CAP_CEILING_S


def test_no_wait_before_the_first_round_and_the_window_doubles_to_the_cap() -> None:
    assert rc.backoff_delay(0, 0.7, 5.0) == 0.0
    top = 0.999999
    windows = [rc.backoff_delay(n, top, 5.0) for n in (1, 2, 3, 4, 5, 50)]
    assert windows == pytest.approx([0.5, 1.0, 2.0, 4.0, 5.0, 5.0], rel=1e-5)
    assert rc.backoff_delay(7, 0.0, 5.0) == 0.0


@given(st.integers(min_value=1, max_value=10_000), JITTER, st.floats(0.5, 60.0))
def test_every_wait_lies_in_its_window(rounds: int, jitter: float, cap: float) -> None:
    delay = rc.backoff_delay(rounds, jitter, cap)
    ceiling = min(cap, rc.BACKOFF_FIRST_S * 2 ** min(rounds - 1, 16))
    assert 0.0 <= delay <= ceiling <= cap


@given(st.integers(min_value=1, max_value=40), JITTER, JITTER)
def test_a_larger_draw_never_waits_less(rounds: int, a: float, b: float) -> None:
    low, high = sorted((a, b))
    assert rc.backoff_delay(rounds, low, 5.0) <= rc.backoff_delay(rounds, high, 5.0)


@given(
    st.integers(min_value=1, max_value=40),
    JITTER,
    st.floats(0.5, 60.0),
    st.none() | st.floats(0.0, 120.0),
)
def test_a_named_turn_is_kept_within_a_tenth_and_otherwise_the_backoff_rules(
    rounds: int, jitter: float, cap: float, turn: float | None
) -> None:
    delay = rc.redial_delay(rounds, jitter, cap, turn)
    if turn is None:
        assert delay == rc.backoff_delay(rounds, jitter, cap)
    else:
        # Whatever the backoff: a coordinator that named a turn is dialed again then.
        assert turn * 0.9 - 1e-9 <= delay <= turn * 1.1 + 1e-9


@given(st.integers(min_value=0, max_value=2**32 - 1))
def test_five_thousand_nodes_spread_over_the_whole_window(seed: int) -> None:
    draw = random.Random(seed)
    cap = rc.backoff_cap(15.0)
    delays = [rc.backoff_delay(20, draw.random(), cap) for _ in range(5000)]
    # Full jitter: every tenth of the window gets its share (500), none twice it: no lockstep.
    buckets = [0] * 10
    for delay in delays:
        buckets[min(int(delay / cap * 10), 9)] += 1
    assert min(buckets) > 350 and max(buckets) < 650, buckets
    assert min(delays) < 0.05 * cap and max(delays) > 0.95 * cap


@given(JITTER)
def test_probes_come_about_every_half_second_jittered(jitter: float) -> None:
    assert 0.25 <= rc.probe_delay(jitter) <= 0.75


# --- the probe watch -----------------------------------------------------------------------------


def test_an_address_that_refused_and_then_accepts_ends_the_wait() -> None:
    watch = rc.ProbeWatch()
    assert watch.observe({"a:1": False, "b:2": False}) is None
    assert watch.observe({"a:1": False, "b:2": False}) is None
    assert watch.observe({"a:1": False, "b:2": True}) == "b:2"


def test_an_address_that_accepted_all_along_never_ends_the_wait() -> None:
    # It refused the session, not the connection: only the backoff paces it.
    watch = rc.ProbeWatch()
    assert watch.observe({"a:1": True, "b:2": False}) is None
    # Probing it again would only load a coordinator that is saying no.
    assert watch.to_probe(("a:1", "b:2")) == ("b:2",)
    assert watch.observe({"b:2": False}) is None


def test_the_first_to_come_back_in_dial_order_is_named() -> None:
    watch = rc.ProbeWatch()
    watch.observe({"a:1": False, "b:2": False})
    assert watch.observe({"a:1": True, "b:2": True}) == "a:1"


@given(st.lists(st.dictionaries(ADDRESSES, st.booleans(), max_size=4), max_size=8))
def test_only_a_refusal_followed_by_an_accept_is_a_return(sweeps: list[dict[str, bool]]) -> None:
    watch = rc.ProbeWatch()
    refused: set[str] = set()
    for sweep in sweeps:
        back = watch.observe(sweep)
        model = next((a for a, ok in sweep.items() if ok and a in refused), None)
        assert back == model
        refused |= {a for a, ok in sweep.items() if not ok}
