"""The launch protocol's pure table (coordinator/launch.py ``step``), row by row and exhaustively.

Every small attempt (1-3 members, every prepared/known combination, every decision, with and
without a rendezvous) meets every event, from the right Node and from the wrong one; the
protocol's invariants must hold after each step. The same table run beside the real store is in
test_launch_store_model.py.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from pathlib import Path

import attrs
import pytest

from tuneplane.coordinator import launch
from tuneplane.coordinator.launch import Attempt, Member, Send
from tuneplane.coordinator.lifecycle import (
    ABORT,
    COMMIT,
    M_ABORTED,
    M_COMMITTED,
    M_PREPARED,
    M_PREPARING,
    M_RESERVED,
    M_RUNNING,
    MEMBER_RANK,
)

NODES = ("node-a", "node-b", "node-c")


def _attempt(count: int, **kw: object) -> Attempt:
    members = tuple(Member(i, NODES[i]) for i in range(count))
    return attrs.evolve(Attempt(members), **kw)  # type: ignore[arg-type]


def test_reserved_prepares_member_0_alone() -> None:
    out = launch.step(_attempt(3), launch.Reserved())
    assert out.sends == (Send("prepare", "node-a", 0),)
    assert out.changes == (launch.MemberChange(0, M_PREPARING, "Prepare issued to its Node"),)
    assert out.attempt.member(0) == Member(0, "node-a", known=M_PREPARING)
    assert out.decided is None and out.releases == ()


def test_member_0_prepared_records_the_rendezvous_and_prepares_the_others() -> None:
    before = launch.step(_attempt(3, nonce="n" * 64), launch.Reserved()).attempt
    out = launch.step(before, launch.Prepared("node-a", 0, "10.0.0.1", 29500, rendezvous_held=True))
    assert (out.attempt.master_addr, out.attempt.master_port) == ("10.0.0.1", 29500)
    assert out.attempt.nonce == "n" * 64
    assert out.sends == (Send("prepare", "node-b", 1), Send("prepare", "node-c", 2))
    why = "Prepare issued to its Node, to reach the rendezvous 10.0.0.1:29500"
    assert out.changes == (
        launch.MemberChange(0, M_PREPARED, "prepared on its Node"),
        launch.MemberChange(1, M_PREPARING, why),
        launch.MemberChange(2, M_PREPARING, why),
    )
    assert out.decided is None


def test_member_0_without_an_address_gets_its_host_name_and_no_listener_drops_the_nonce() -> None:
    out = launch.step(
        _attempt(2, nonce="n" * 64), launch.Prepared("node-a", 0, "", 40000, hostname="gpu-7")
    )
    assert (out.attempt.master_addr, out.attempt.master_port, out.attempt.nonce) == (
        "gpu-7",
        40000,
        "",
    )


def test_the_last_prepared_member_decides_commit_for_everyone() -> None:
    attempt = _attempt(2, master_addr="h", master_port=1)
    attempt = attrs.evolve(
        attempt, members=(Member(0, "node-a", True, M_PREPARED), Member(1, "node-b"))
    )
    out = launch.step(attempt, launch.Prepared("node-b", 1))
    assert out.decided == COMMIT
    assert out.attempt.decision == COMMIT and out.attempt.reason == "every member is prepared"
    assert out.sends == (
        Send("commit", "node-a", 0, master_addr="h", master_port=1),
        Send("commit", "node-b", 1, master_addr="h", master_port=1),
    )


def test_a_refused_prepare_aborts_every_member_and_releases_their_gpus() -> None:
    out = launch.step(_attempt(2), launch.PrepareFailed("node-b", 1, "disk full"))
    why = "member 1 on Node node-b refused Prepare: disk full"
    assert out.decided == ABORT and out.attempt.reason == why
    assert out.sends == (Send("abort", "node-a", 0, why), Send("abort", "node-b", 1, why))
    assert out.releases == (0, 1)
    assert all(m.known == M_ABORTED for m in out.attempt.members)


def test_a_passed_deadline_names_the_members_not_prepared() -> None:
    attempt = attrs.evolve(
        _attempt(3), members=(Member(0, "node-a", True), Member(1, "node-b"), Member(2, "node-c"))
    )
    out = launch.step(attempt, launch.PrepareTimedOut())
    assert out.attempt.reason == "member(s) 1, 2 were not prepared before the prepare deadline"


def test_a_query_for_another_nodes_member_gets_abort_and_changes_nothing() -> None:
    attempt = _attempt(2)
    out = launch.step(attempt, launch.DecisionQueried("node-c", 1))
    assert out.attempt == attempt
    assert out.sends == (Send("abort", "node-c", 1, launch.NO_RECORD),)
    out = launch.step(attempt, launch.DecisionQueried("node-a", 7))
    assert out.sends == (Send("abort", "node-a", 7, launch.NO_RECORD),)


def test_a_reconnect_resends_what_its_node_is_owed_and_nothing_else() -> None:
    attempt = Attempt(
        (
            Member(0, "node-a", True, M_RUNNING),
            Member(1, "node-b", True, M_PREPARED),
            Member(2, "node-b", True, M_COMMITTED),
        ),
        decision=COMMIT,
        master_addr="h",
        master_port=2,
    )
    out = launch.step(attempt, launch.NodeReconnected("node-b"))
    assert out.sends == (Send("commit", "node-b", 1, master_addr="h", master_port=2),)
    assert launch.step(attempt, launch.NodeReconnected("node-a")).sends == ()


def test_cancel_and_node_loss_abort_only_an_undecided_attempt() -> None:
    for event in (launch.Cancelled("cancelled by ana"), launch.NodeLost("node-b was lost")):
        out = launch.step(_attempt(2), event)
        assert out.decided == ABORT and out.attempt.reason == event.reason
        for decision in (COMMIT, ABORT):
            decided = _attempt(2, decision=decision, reason="earlier")
            out = launch.step(decided, event)
            assert out.attempt == decided and out.sends == () and out.decided is None


def test_the_table_rows_name_every_event() -> None:
    named = {name for row in launch.TABLE for name in row[0].split(", ")}
    assert named == {cls.__name__ for cls in _EVENT_CLASSES}


_EVENT_CLASSES = (
    launch.Reserved,
    launch.Prepared,
    launch.PrepareFailed,
    launch.PrepareTimedOut,
    launch.DecisionQueried,
    launch.NodeReconnected,
    launch.Cancelled,
    launch.NodeLost,
)
KNOWN = (M_RESERVED, M_PREPARING, M_PREPARED, M_COMMITTED)


def _attempts() -> Iterator[Attempt]:
    for count in (1, 2, 3):
        for prepared in itertools.product((False, True), repeat=count):
            for known in itertools.product(KNOWN, repeat=count):
                members = tuple(
                    Member(i, NODES[i], p, k)
                    for i, (p, k) in enumerate(zip(prepared, known, strict=True))
                )
                for decision, port in itertools.product((None, COMMIT, ABORT), (0, 29500)):
                    yield Attempt(
                        members,
                        decision,
                        "" if decision is None else "why",
                        "h" if port else "",
                        port,
                        "nonce",
                    )


def _events(attempt: Attempt) -> Iterator[launch.Event]:
    yield launch.Reserved()
    yield launch.PrepareTimedOut()
    yield launch.Cancelled("cancelled")
    yield launch.NodeLost("lost")
    for index, node in itertools.product(range(len(attempt.members) + 1), (*NODES, "stranger")):
        yield launch.Prepared(node, index, "addr", 30000, rendezvous_held=index % 2 == 0)
        yield launch.PrepareFailed(node, index, "no")
        yield launch.DecisionQueried(node, index)
    for node in (*NODES, "stranger"):
        yield launch.NodeReconnected(node)


def _check(before: Attempt, event: launch.Event, out: launch.Step) -> None:
    after = out.attempt
    # Pure: the same input gives the same output.
    assert launch.step(before, event) == out
    # The membership of an attempt never changes.
    assert [(m.index, m.node_id) for m in after.members] == [
        (m.index, m.node_id) for m in before.members
    ]
    # A decision is final and is the only thing that sets `decided`.
    if before.decision is not None:
        assert after == before and out.decided is None and out.changes == ()
        assert all(s.kind == before.decision or s.reason == launch.NO_RECORD for s in out.sends)
    assert (out.decided is not None) == (before.decision is None and after.decision is not None)
    assert out.decided in (None, after.decision)
    if after.decision == COMMIT and before.decision is None:
        assert all(m.prepared for m in after.members)
        assert sorted(s.member_index for s in out.sends) == [m.index for m in after.members]
        assert all(s.master_port == after.master_port for s in out.sends)
    if out.decided == ABORT:
        assert out.releases == tuple(sorted(m.index for m in after.members))
        assert all(m.known == M_ABORTED for m in after.members)
        assert [s.kind for s in out.sends] == ["abort"] * len(after.members)
    else:
        assert out.releases == ()
    # Prepares: never to a prepared member, never after a decision, member 0's first.
    for s in out.sends:
        if s.kind != "prepare":
            continue
        member = after.member(s.member_index)
        assert member is not None and not member.prepared and after.decision is None
        assert s.member_index == 0 or after.master_port > 0
    # Only the member's own Node moves it.
    if isinstance(event, launch.Prepared | launch.PrepareFailed | launch.DecisionQueried):
        member = before.member(event.member_index)
        if member is None or member.node_id != event.node_id:
            assert after == before and out.changes == ()
    # A prepared flag is never taken back; known states only move forward.
    for b, a in zip(before.members, after.members, strict=True):
        assert a.prepared >= b.prepared
        assert MEMBER_RANK[a.known] >= MEMBER_RANK[b.known]
    for change in out.changes:
        assert after.member(change.member_index) is not None


def test_every_small_attempt_meets_every_event() -> None:
    checked = 0
    for attempt in _attempts():
        for event in _events(attempt):
            _check(attempt, event, launch.step(attempt, event))
            checked += 1
    assert checked > 50_000


@pytest.mark.parametrize("count", [1, 2, 3, 4])
def test_every_order_of_replies_commits_exactly_once(count: int) -> None:
    """However the members' replies interleave with repeats, Commit is decided once, after the
    last member, and every member is told."""
    for order in itertools.permutations(range(count)):
        attempt = (
            _attempt(count)
            if count <= 3
            else Attempt(tuple(Member(i, f"n{i}") for i in range(count)))
        )
        attempt = launch.step(attempt, launch.Reserved()).attempt
        commits = 0
        sent_prepare = {0}
        for index in (0, *(i for i in order if i != 0)):
            member = attempt.member(index)
            assert member is not None and index in sent_prepare
            for _ in range(2):  # every reply arrives twice
                out = launch.step(attempt, launch.Prepared(member.node_id, index, "h", 5))
                attempt = out.attempt
                commits += out.decided == COMMIT
                sent_prepare |= {s.member_index for s in out.sends if s.kind == "prepare"}
        assert commits == 1 and attempt.decision == COMMIT


def test_docs_protocol_shows_the_table_as_the_code_has_it() -> None:
    text = (Path(__file__).parents[2] / "docs" / "protocol.md").read_text(encoding="utf-8")
    for event, decision, result in launch.TABLE:
        assert f"| {event} | {decision} | {result} |" in text, event
