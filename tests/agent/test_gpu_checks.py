"""Prepare's and launch's GPU checks (pure): health and the index -> UUID mapping, exhaustively."""

from __future__ import annotations

import attrs
import pytest
from hypothesis import given
from hypothesis import strategies as st

from tuneplane.agent.inventory import Gpu, Inventory
from tuneplane.agent.journal_records import MemberKey
from tuneplane.agent.prepare import PrepareRefused, check_gpus, check_launch

KEY = MemberKey("run-1", 1, 0)
OTHER = MemberKey("run-0", 1, 0)
CARDS = ("GPU-0aa", "GPU-1bb", "GPU-2cc", "GPU-3dd")
# A card NVML lists but cannot identify (its handle or UUID reads GPU_IS_LOST).
LOST = "lost"


def node(order: tuple[str, ...], sick: frozenset[str] = frozenset()) -> Inventory:
    """Cards in ``order``; a sick one is unhealthy, and a lost one (LOST) cannot be identified."""
    gpus = tuple(
        Gpu(i, "" if u == LOST else u, "NVIDIA H200", "h200", 2**30, False,
            u not in sick and u != LOST, "XID 79" * (u in sick) or "GPU is lost" * (u == LOST))
        for i, u in enumerate(order)
    )  # fmt: skip
    return Inventory("node", 4, 2**34, gpus, "scripted-nvml")


@st.composite
def situations(draw: st.DrawFn) -> tuple[Inventory, Inventory, tuple[int, ...], frozenset[str]]:
    """The inventory at placement, the Node's now (reordered, cards lost, some sick), a request."""
    placed = node(CARDS)
    kept = draw(st.lists(st.sampled_from((*CARDS, LOST)), unique=True, min_size=1))
    now_order = tuple(draw(st.permutations(kept)))
    sick = frozenset(draw(st.sets(st.sampled_from(CARDS))))
    requested = tuple(draw(st.lists(st.integers(0, 3), min_size=1, max_size=4, unique=True)))
    return placed, node(now_order, sick), requested, sick


def first_problem(now: Inventory, requested: tuple[int, ...], sent: bool) -> str | None:
    """The model: the first requested GPU that fails, and what a refusal must say about it."""
    for i in requested:
        g = now.gpu(i)
        if g is None:
            return f"GPU {i} "
        if sent and g.uuid and g.uuid != CARDS[i]:
            return f"GPU {i} was placed as {CARDS[i]} but this Node's GPU {i} is {g.uuid} now"
        if not g.healthy or not g.uuid:
            named = g.uuid or (CARDS[i] if sent else "UUID unreadable")
            return f"GPU {i} ({named}) "
    return None


@given(situations())
def test_prepare_and_launch_accept_exactly_the_same_healthy_cards(
    case: tuple[Inventory, Inventory, tuple[int, ...], frozenset[str]],
) -> None:
    _, now, requested, _ = case
    sent = tuple(CARDS[i] for i in requested)
    problem = first_problem(now, requested, sent=True)
    if problem is None:
        assert check_gpus(KEY, requested, sent, now, {}) == sent
        assert check_launch(requested, sent, now) is None
        return
    with pytest.raises(PrepareRefused) as refused:
        check_gpus(KEY, requested, sent, now, {})
    assert str(refused.value).startswith(problem)
    launch = check_launch(requested, sent, now)
    assert launch is not None and launch.startswith(problem)


@given(situations())
def test_an_old_coordinator_gets_the_health_check_only(
    case: tuple[Inventory, Inventory, tuple[int, ...], frozenset[str]],
) -> None:
    _, now, requested, _ = case
    problem = first_problem(now, requested, sent=False)
    if problem is None:
        uuids = check_gpus(KEY, requested, (), now, {})
        assert uuids == tuple(g.uuid for i in requested if (g := now.gpu(i)) is not None)
        assert check_launch(requested, (), now) is None
        return
    with pytest.raises(PrepareRefused) as refused:
        check_gpus(KEY, requested, (), now, {})
    assert str(refused.value).startswith(problem)
    launch = check_launch(requested, (), now)
    assert launch is not None and launch.startswith(problem)


def test_a_reordered_card_is_named_where_it_went() -> None:
    now = node(("GPU-1bb", "GPU-0aa"))
    with pytest.raises(PrepareRefused) as refused:
        check_gpus(KEY, (0,), ("GPU-0aa",), now, {})
    assert str(refused.value) == (
        "GPU 0 was placed as GPU-0aa but this Node's GPU 0 is GPU-1bb now (that card is GPU 1 "
        "now); the GPU order changed, so the Job must be placed again."
    )
    assert check_launch((0,), ("GPU-0aa",), now) == str(refused.value)


def test_ownership_is_by_uuid_and_by_index_for_unnamed_reservations() -> None:
    now = node(CARDS)
    with pytest.raises(PrepareRefused, match=r"GPU 1 is busy: member run-0\.1\.0 owns it"):
        check_gpus(KEY, (1,), (), now, {"GPU-1bb": OTHER})
    with pytest.raises(PrepareRefused, match=r"GPU 2 is busy: member run-0\.1\.0 owns it"):
        check_gpus(KEY, (2,), (), now, {}, {2: OTHER})
    # Its own reservation (a repeated Prepare) is no conflict; another card's owner neither.
    assert check_gpus(KEY, (1,), (), now, {"GPU-1bb": KEY, "GPU-0aa": OTHER}) == ("GPU-1bb",)


def test_malformed_requests_are_refused_with_sentences() -> None:
    now = node(CARDS)
    with pytest.raises(PrepareRefused, match="more than once"):
        check_gpus(KEY, (1, 1), (), now, {})
    with pytest.raises(PrepareRefused, match="names 2 GPU indexes but 1 GPU UUIDs"):
        check_gpus(KEY, (0, 1), ("GPU-0aa",), now, {})
    with pytest.raises(PrepareRefused, match="GPU 7 does not exist on this Node"):
        check_gpus(KEY, (7,), (), now, {})


def test_launch_refuses_a_card_that_became_unhealthy_or_went_away() -> None:
    sick = node(CARDS, frozenset({"GPU-0aa"}))
    assert check_launch((0,), ("GPU-0aa",), sick) == (
        "GPU 0 (GPU-0aa) became unhealthy after it was prepared: XID 79."
    )
    gone = attrs.evolve(sick, gpus=())
    why = check_launch((0,), ("GPU-0aa",), gone)
    assert why is not None and why.startswith("GPU 0 (GPU-0aa) is no longer present")
