"""Random programs against the journal on a real SQLite file, checked against a plain model.

Invariants after every step, and after closing and reopening the file: states match the model,
a GPU (by UUID, whatever index it was listed at: each create draws a shift that models the
cards reordered since the last Prepare) is owned by at most one member and only while its state
owns GPUs, report sequence numbers only grow, and an illegal move leaves the journal untouched.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tuneplane.agent.adapter import open_aio_host
from tuneplane.agent.journal import Journal
from tuneplane.agent.journal_records import GpuAlreadyOwned, MemberExists, MemberKey, NewMember
from tuneplane.agent.member_state import (
    OWNS_GPUS,
    TRANSITIONS,
    IllegalTransition,
    MemberEvent,
    MemberState,
)

MEMBERS = 4
GPUS = 3

create = st.tuples(
    st.just("create"),
    st.integers(0, MEMBERS - 1),
    st.tuples(
        st.lists(st.integers(0, GPUS - 1), max_size=2, unique=True), st.integers(0, GPUS - 1)
    ),
)
move = st.tuples(st.just("move"), st.integers(0, MEMBERS - 1), st.sampled_from(list(MemberEvent)))
ack = st.tuples(st.just("ack"), st.integers(0, 30), st.just(None))
reopen = st.tuples(st.just("reopen"), st.just(0), st.just(None))
programs = st.lists(st.one_of(create, create, move, move, move, ack, reopen), max_size=30)


def key(i: int) -> MemberKey:
    return MemberKey(f"run-{i}", 1, 0)


def uuid(card: int) -> str:
    return f"GPU-card-{card}"


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(program=programs)
async def test_journal_matches_the_model(program: list[tuple[str, int, object]]) -> None:
    states: dict[int, MemberState] = {}
    gpus: dict[int, tuple[str, ...]] = {}
    pending: set[int] = set()
    last_seq = 0
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "journal.db"
        async with open_aio_host():
            journal = await Journal.open(path)
            try:
                for op, i, arg in program:
                    if op == "create":
                        assert isinstance(arg, tuple)
                        cards, shift = arg
                        indexes = tuple((c + shift) % GPUS for c in cards)
                        uuids = tuple(uuid(c) for c in cards)
                        new = NewMember(key(i), 1, indexes, "/m", "/o", 1, gpu_uuids=uuids)
                        if i in states:
                            try:
                                await journal.create_member(new, 1)
                            except MemberExists:
                                continue
                            raise AssertionError("a member was created twice")
                        created = await journal.create_member(new, 1)
                        assert created == await journal.member(key(i))
                        states[i], gpus[i] = MemberState.PREPARING, uuids
                    elif op == "move" and i in states:
                        assert isinstance(arg, MemberEvent)
                        before_events = await journal.events()
                        want = TRANSITIONS[states[i]].get(arg)
                        owned_by_others = {
                            g for j, s in states.items() if j != i and s in OWNS_GPUS
                            for g in gpus[j]
                        }  # fmt: skip
                        try:
                            moved, report = await journal.transition(
                                key(i), arg, 2, reason=f"move {len(before_events)}"
                            )
                        except IllegalTransition:
                            assert want is None
                            assert await journal.events() == before_events
                            continue
                        except GpuAlreadyOwned:
                            assert want in OWNS_GPUS and set(gpus[i]) & owned_by_others
                            assert await journal.events() == before_events
                            continue
                        assert want is not None
                        states[i] = want
                        # The record returned is the one the journal now holds.
                        assert moved == await journal.member(key(i))
                        assert moved.reason == f"move {len(before_events)}"
                        if report is not None:
                            # Reports are numbered one after another, across reopens too.
                            assert report.report_seq == last_seq + 1
                            last_seq = report.report_seq
                            pending.add(report.report_seq)
                    elif op == "ack":
                        assert isinstance(i, int)
                        assert await journal.ack_report(i) == (i in pending)
                        pending.discard(i)
                    elif op == "reopen":
                        await journal.close()
                        journal = await Journal.open(path)
                    # Invariants after every step.
                    for j, state in states.items():
                        record = await journal.member(key(j))
                        assert record is not None and record.state is state
                    expected_owners = {
                        g: key(j) for j, s in states.items() if s in OWNS_GPUS for g in gpus[j]
                    }
                    assert await journal.gpu_owners_by_uuid() == (expected_owners, {})
                    assert {r.report_seq for r in await journal.pending_reports()} == pending
            finally:
                await journal.close()
