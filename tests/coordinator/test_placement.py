"""Placement is a pure function: examples for the rules, Hypothesis for the invariants."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from tuneplane.coordinator.placement import (
    MAX_MEMBERS,
    NodeOffer,
    Placement,
    Request,
    candidate_shapes,
    place,
)


def offers(**free: int) -> list[NodeOffer]:
    return [NodeOffer(name, tuple(range(n))) for name, n in free.items()]


def test_one_member_when_one_node_has_enough() -> None:
    p = place(Request(gpus=4), offers(a=8, b=4))
    assert p is not None
    # Best fit: the Node with exactly 4 free keeps the 8-GPU hole for a bigger Job.
    assert [(m.node_id, m.gpu_indexes) for m in p.members] == [("b", (0, 1, 2, 3))]


def test_as_few_members_as_the_free_gpus_allow() -> None:
    p = place(Request(gpus=8), offers(a=4, b=4, c=2, d=2))
    assert p is not None
    assert sorted(m.node_id for m in p.members) == ["a", "b"]
    assert p.gpus_per_member == 4


def test_a_fixed_member_count_is_honoured() -> None:
    p = place(Request(gpus=4, members=4), offers(a=8, b=8, c=8, d=8))
    assert p is not None
    assert len(p.members) == 4 and p.gpus_per_member == 1


def test_zero_gpus_get_one_member_on_any_node() -> None:
    p = place(Request(gpus=0), [NodeOffer("a", ())])
    assert p is not None
    assert [(m.node_id, m.gpu_indexes) for m in p.members] == [("a", ())]


def test_nothing_fits_means_none() -> None:
    assert place(Request(gpus=3), offers(a=2, b=2)) is None  # 3 = 3 x 1 needs 3 Nodes
    assert place(Request(gpus=1), []) is None


def test_a_duplicate_offer_never_yields_two_members_on_one_node() -> None:
    p = place(Request(gpus=2, members=2), [NodeOffer("a", (0,)), NodeOffer("a", (1,))])
    assert p is None


nodes = st.dictionaries(
    st.text("abcdefgh", min_size=1, max_size=3),
    st.lists(st.integers(0, 15), unique=True, max_size=9).map(tuple),
    max_size=8,
)
requests = st.builds(
    Request,
    gpus=st.integers(0, 40),
    members=st.none() | st.integers(1, MAX_MEMBERS),
    gpus_per_member=st.none() | st.integers(0, 8),
)


def _feasible(request: Request, free: dict[str, tuple[int, ...]]) -> list[int]:
    """Member counts that would fit, by brute force over the shapes."""
    return [
        m
        for m, g in candidate_shapes(request, len(free))
        if sum(1 for f in free.values() if len(f) >= g) >= m
    ]


@settings(max_examples=300, deadline=None)
@given(free=nodes, request=requests)
def test_placement_invariants(free: dict[str, tuple[int, ...]], request: Request) -> None:
    p = place(request, [NodeOffer(n, f) for n, f in free.items()])
    feasible = _feasible(request, free)
    if p is None:
        assert feasible == []
        return
    assert isinstance(p, Placement)
    members = p.members
    assert 1 <= len(members) <= MAX_MEMBERS
    # Never two members of a Job on one Node.
    assert len({m.node_id for m in members}) == len(members)
    # Members are always equal, and together they hold exactly what was asked.
    assert len({len(m.gpu_indexes) for m in members}) == 1
    assert sum(len(m.gpu_indexes) for m in members) == request.gpus
    # Never over-commit: each GPU is free on its Node and given once.
    for m in members:
        assert set(m.gpu_indexes) <= set(free[m.node_id])
        assert len(set(m.gpu_indexes)) == len(m.gpu_indexes)
    # As few members as possible.
    assert len(members) == min(feasible)
    assert [m.index for m in members] == list(range(len(members)))
    if request.members is not None:
        assert len(members) == request.members
