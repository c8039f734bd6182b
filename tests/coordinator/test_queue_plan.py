"""A scheduling pass is pure: cordons, drains and quotas, by example and by Hypothesis."""

from __future__ import annotations

from collections.abc import Mapping

from hypothesis import given, settings
from hypothesis import strategies as st

from tuneplane.coordinator.capacity import never_fits
from tuneplane.coordinator.placement import (
    CORDONED,
    DRAINED,
    DRAINING,
    SCHEDULABLE,
    SCHEDULING_STATES,
    NodeOffer,
    Request,
    place,
)
from tuneplane.coordinator.queue_plan import NodeState, QueuedRequest, plan_pass


def node(name: str, gpus: int, scheduling: str = SCHEDULABLE, connected: bool = True) -> NodeState:
    return NodeState(name, "default", connected, scheduling, {"h200": tuple(range(gpus))})


def job(run_id: str, gpus: int, **shape: int) -> QueuedRequest:
    return QueuedRequest(run_id, "default", "h200", Request(gpus, **shape))


def test_cordoned_draining_and_drained_nodes_take_no_new_members() -> None:
    for state in (CORDONED, DRAINING, DRAINED):
        plan = plan_pass([job("r1", 2)], [node("a", 8, state), node("b", 2)], {}, {})
        assert [
            (launch.run_id, m.node_id) for launch in plan.launches for m in launch.placement.members
        ] == [("r1", "b")]
        plan = plan_pass([job("r1", 2)], [node("a", 8, state)], {}, {})
        assert plan.launches == ()
        assert plan.waiting["r1"].startswith("waiting: needs 2 h200 GPU(s)")
        assert "0 free on 0 schedulable Node(s) of Fleet default" in plan.waiting["r1"]


def test_a_disconnected_node_takes_no_new_members() -> None:
    plan = plan_pass([job("r1", 1)], [node("a", 8, connected=False)], {}, {})
    assert plan.launches == ()


def test_quota_keeps_a_job_waiting_with_the_figures_in_its_reason() -> None:
    quotas = {("default", "h200"): 4}
    plan = plan_pass(
        [job("r1", 2), job("r2", 2), job("r3", 1), job("r4", 0)],
        [node("a", 8)],
        {("default", "h200"): 2},
        quotas,
    )
    assert [launch.run_id for launch in plan.launches] == ["r1", "r4"]
    assert plan.waiting == {
        "r2": "waiting: quota h200 4/4 in use",
        "r3": "waiting: quota h200 4/4 in use",
    }


def test_gpus_placed_in_a_pass_are_not_offered_again_and_later_jobs_backfill() -> None:
    plan = plan_pass(
        [job("big", 4), job("r1", 2), job("r2", 2), job("r3", 1)], [node("a", 3)], {}, {}
    )
    assert [launch.run_id for launch in plan.launches] == ["r1", "r3"]
    assert set(plan.waiting) == {"big", "r2"}


def test_never_fits_refuses_only_what_can_never_run() -> None:
    assert never_fits(Request(2), "default", "h200", [], None) is None
    over_quota = never_fits(Request(5), "default", "h200", [8], 4)
    assert over_quota is not None and "quota of Fleet default" in str(over_quota)
    too_many = never_fits(Request(33, gpus_per_member=1), "default", "h200", [], None)
    assert too_many is not None and "at most 32 equal members" in str(too_many)
    too_big = never_fits(Request(4, members=2), "default", "h200", [8], None)
    assert too_big is not None and "can never fit Fleet default" in str(too_big)
    assert never_fits(Request(8), "default", "h200", [4, 4], None) is None


pools = st.dictionaries(
    st.text("abcdef", min_size=1, max_size=2),
    st.tuples(st.integers(0, 8), st.sampled_from(SCHEDULING_STATES), st.booleans()),
    max_size=6,
)
queues = st.lists(
    st.tuples(
        st.integers(0, 12),
        st.none() | st.integers(1, 4),
    ),
    max_size=12,
)


@settings(max_examples=200, deadline=None)
@given(nodes=pools, queue=queues, quota=st.none() | st.integers(1, 16), used=st.integers(0, 8))
def test_a_pass_never_overcommits_never_uses_closed_nodes_and_keeps_quota(
    nodes: dict[str, tuple[int, str, bool]],
    queue: list[tuple[int, int | None]],
    quota: int | None,
    used: int,
) -> None:
    states = [node(n, g, s, c) for n, (g, s, c) in nodes.items()]
    jobs = [job(f"r{i}", g, **({"members": m} if m else {})) for i, (g, m) in enumerate(queue)]
    quotas = {} if quota is None else {("default", "h200"): quota}
    plan = plan_pass(jobs, states, {("default", "h200"): used}, quotas)
    open_nodes = {n for n, (_, s, c) in nodes.items() if s == SCHEDULABLE and c}
    taken: set[tuple[str, int]] = set()
    placed_gpus = 0
    for launch in plan.launches:
        for m in launch.placement.members:
            assert m.node_id in open_nodes
            for g in m.gpu_indexes:
                assert g < nodes[m.node_id][0]
                assert (m.node_id, g) not in taken
                taken.add((m.node_id, g))
        placed_gpus += sum(len(m.gpu_indexes) for m in launch.placement.members)
    if quota is not None:
        assert placed_gpus == 0 or used + placed_gpus <= quota
    # Every queued Job either launches or has a reason.
    launched = {launch.run_id for launch in plan.launches}
    assert launched.isdisjoint(plan.waiting)
    assert launched | set(plan.waiting) == {j.run_id for j in jobs}


@settings(max_examples=200, deadline=None)
@given(
    offers=st.lists(
        st.tuples(
            st.text("abcd", min_size=1, max_size=2),
            st.integers(0, 8),
            st.sampled_from(SCHEDULING_STATES),
        ),
        max_size=6,
    ),
    gpus=st.integers(0, 16),
)
def test_place_never_puts_a_member_on_a_node_that_is_not_schedulable(
    offers: list[tuple[str, int, str]], gpus: int
) -> None:
    p = place(Request(gpus), [NodeOffer(n, tuple(range(g)), s) for n, g, s in offers])
    if p is None:
        return
    for m in p.members:
        assert any(n == m.node_id and s == SCHEDULABLE for n, _, s in offers)


@settings(max_examples=300, deadline=None)
@given(
    nodes=pools,
    queue=queues,
    new=queues,
    quota=st.none() | st.integers(1, 16),
    used=st.integers(0, 8),
    closed=st.sets(st.text("abcdef", min_size=1, max_size=2)),
)
def test_after_a_pass_planning_only_new_jobs_is_planning_the_whole_queue(
    nodes: dict[str, tuple[int, str, bool]],
    queue: list[tuple[int, int | None]],
    new: list[tuple[int, int | None]],
    quota: int | None,
    used: int,
    closed: set[str],
) -> None:
    """What the scheduler's pass for admissions relies on: once a pass has run and GPUs have
    only been taken since (its launches; Nodes gone or cordoned), every Job that waited still
    waits, so planning the new Jobs alone launches exactly what the whole queue's pass would."""
    states = [node(n, g, s, c) for n, (g, s, c) in nodes.items()]
    jobs = [job(f"r{i}", g, **({"members": m} if m else {})) for i, (g, m) in enumerate(queue)]
    quotas = {} if quota is None else {("default", "h200"): quota}
    first = plan_pass(jobs, states, {("default", "h200"): used}, quotas)
    taken = {(m.node_id, g) for launch in first.launches for m in launch.placement.members
             for g in m.gpu_indexes}  # fmt: skip
    placed = sum(len(m.gpu_indexes) for launch in first.launches for m in launch.placement.members)
    after = [
        NodeState(
            s.node_id,
            s.fleet,
            s.connected and s.node_id not in closed,
            s.scheduling,
            {"h200": tuple(g for g in s.free["h200"] if (s.node_id, g) not in taken)},
        )
        for s in states
    ]
    in_use = {("default", "h200"): used + placed}
    admitted = [job(f"n{i}", g, **({"members": m} if m else {})) for i, (g, m) in enumerate(new)]
    still = [j for j in jobs if j.run_id in first.waiting]
    whole = plan_pass([*still, *admitted], after, in_use, quotas)
    alone = plan_pass(admitted, after, in_use, quotas)
    assert whole.launches == alone.launches
    assert set(first.waiting) <= set(whole.waiting)

    # Why each new Job waits is the same; the free-GPU figures in the sentence may differ (a
    # pass reuses a reason it computed for an equal request earlier in the pass), and the
    # scheduler's periodic pass over the whole queue writes them afresh.
    def kinds(waiting: Mapping[str, str]) -> dict[str, str]:
        return {r: why.split(";")[0] for r, why in waiting.items() if r.startswith("n")}

    assert kinds(whole.waiting) == kinds(alone.waiting)
