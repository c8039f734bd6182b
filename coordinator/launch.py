"""The launch protocol as one pure table: an attempt's facts and an event in, the decision out.

Theory of operation: a launch is two-phase. The coordinator reserves GPUs and records an
*attempt* whose members are each placed on a Node; it sends Prepare to the Nodes; each Node
answers with a PrepareReply; when every member is prepared the coordinator decides Commit, and
any refusal, a passed prepare deadline, a cancel or a Node declared lost decides Abort. A
decision is final and is sent again whenever a Node asks (DecisionQuery) or reconnects.

Member 0 first: member 0's Node picks the rendezvous (address and port) at Prepare and holds a
listener there; every other member's Node proves at its own Prepare that it reaches that listener
(agent/rendezvous.py), so their Prepares carry the rendezvous and go out only once member 0 is
prepared and the rendezvous is recorded.

:func:`step` is the whole protocol. It reads only :class:`Attempt` (what the store records) and
the event, and returns a :class:`Step`: the attempt afterwards, the member state changes with
their reasons, the GPUs to release, the decision to log and the messages to send. It remembers
nothing and does no IO: the store persists what it returns in the same transaction, so after a
coordinator restart, a reconnect or a DecisionQuery it names the same messages again, and a
message sent twice is harmless (the Node answers a repeat from its journal).

The table is :data:`TABLE` (shown in docs/protocol.md, which a test keeps equal to it).

A reply or query naming a member another Node holds (or no member at all) changes nothing;
a query for it gets Abort, so the asking Node releases what it reserved.
"""

from __future__ import annotations

import secrets
from collections.abc import Iterable

import attrs

from .lifecycle import (
    ABORT,
    COMMIT,
    M_ABORTED,
    M_PREPARED,
    M_PREPARING,
    M_RESERVED,
    member_after_report,
)

#: Member states a Commit still has to reach on a reconnect (later states have seen it).
BEFORE_COMMIT = frozenset({M_RESERVED, M_PREPARING, M_PREPARED})
NO_RECORD = "the coordinator holds no record of this member on this Node"


# ----- facts -----------------------------------------------------------------------------------


@attrs.frozen
class Member:
    """One member of an attempt, as the store records it."""

    index: int
    node_id: str
    prepared: bool = False
    known: str = M_RESERVED  # the member's last real state (lifecycle.M_*)


@attrs.frozen
class Attempt:
    """What the store records about one attempt: the whole input of :func:`step`."""

    members: tuple[Member, ...]
    decision: str | None = None  # None, COMMIT or ABORT
    reason: str = ""
    master_addr: str = ""
    master_port: int = 0  # 0 until member 0 is prepared
    nonce: str = ""  # the rendezvous nonce; "" when member 0's Node holds no listener

    def member(self, index: int) -> Member | None:
        for m in self.members:
            if m.index == index:
                return m
        return None


# ----- events ----------------------------------------------------------------------------------


@attrs.frozen
class Reserved:
    """The attempt and its reservations were just written."""


@attrs.frozen
class Prepared:
    """A Node's PrepareReply saying ok. ``master_addr`` "" leaves the address to the coordinator:
    ``hostname`` (the Node's reported host name) is used."""

    node_id: str
    member_index: int
    master_addr: str = ""
    master_port: int = 0
    rendezvous_held: bool = False
    hostname: str = ""


@attrs.frozen
class PrepareFailed:
    """A Node's PrepareReply refusing, with its reason."""

    node_id: str
    member_index: int
    reason: str = ""


@attrs.frozen
class PrepareTimedOut:
    """The attempt's prepare deadline passed."""


@attrs.frozen
class DecisionQueried:
    """A Node asks for the decision on a member it holds."""

    node_id: str
    member_index: int


@attrs.frozen
class NodeReconnected:
    """A Node said Hello again: what it is still owed is sent again."""

    node_id: str


@attrs.frozen
class Cancelled:
    """The Job was cancelled (``reason`` says by whom)."""

    reason: str


@attrs.frozen
class NodeLost:
    """A Node holding a member was declared lost (``reason`` says which and by whom)."""

    reason: str


Event = (
    Reserved
    | Prepared
    | PrepareFailed
    | PrepareTimedOut
    | DecisionQueried
    | NodeReconnected
    | Cancelled
    | NodeLost
)


# ----- results ---------------------------------------------------------------------------------


@attrs.frozen
class Send:
    """One message to one Node about one member: ``kind`` is "prepare", "commit" or "abort";
    a Commit carries the rendezvous, an Abort its reason."""

    kind: str
    node_id: str
    member_index: int
    reason: str = ""
    master_addr: str = ""
    master_port: int = 0


@attrs.frozen
class MemberChange:
    """A member state to record, with the reason shown in its history."""

    member_index: int
    state: str
    reason: str


@attrs.frozen
class Step:
    """What one event does: the store writes ``attempt`` (decision, rendezvous, nonce, prepared
    flags), ``changes`` and ``releases``, logs ``decided`` ("commit"/"abort") and sends ``sends``,
    all in one transaction. ``ignored`` says why an event changed nothing, for the log."""

    attempt: Attempt
    sends: tuple[Send, ...] = ()
    changes: tuple[MemberChange, ...] = ()
    releases: tuple[int, ...] = ()
    decided: str | None = None
    ignored: str = ""


# ----- the rule for Prepares -------------------------------------------------------------------


@attrs.frozen
class PrepareFacts:
    """What the store records about one member of an attempt, for :func:`prepare_due`."""

    member_index: int
    prepared: bool
    decision: str | None  # the attempt's decision: None, "commit" or "abort"
    rendezvous_port: int  # the attempt's rendezvous port; 0 until member 0 is prepared


def prepare_due(facts: PrepareFacts) -> bool:
    """Whether this member's Node is to be sent (or sent again) its Prepare now."""
    if facts.decision in (COMMIT, ABORT) or facts.prepared:
        return False
    return facts.member_index == 0 or facts.rendezvous_port > 0


def prepares_due(
    decision: str | None, prepared: Iterable[tuple[int, bool]], rendezvous_port: int
) -> tuple[int, ...]:
    """The member indexes of one attempt whose Prepare is due, in order; ``prepared`` holds
    ``(member index, prepared)`` for every member."""
    return tuple(
        sorted(
            index
            for index, is_prepared in prepared
            if prepare_due(PrepareFacts(index, is_prepared, decision, rendezvous_port))
        )
    )


def new_nonce() -> str:
    """A fresh per-attempt rendezvous nonce: 256 random bits, hex."""
    return secrets.token_hex(32)


# ----- the table -------------------------------------------------------------------------------


def step(attempt: Attempt, event: Event) -> Step:
    """Apply one event to one attempt; see the module docstring for the table."""
    match event:
        case Reserved():
            return _issue_prepares(attempt, "Prepare issued to its Node")
        case Prepared():
            return _prepared(attempt, event)
        case PrepareFailed():
            member = _held(attempt, event.node_id, event.member_index)
            if member is None:
                return Step(attempt, ignored=NO_RECORD)
            if attempt.decision is not None:
                return Step(attempt, sends=(_decision_for(attempt, member),))
            why = (
                f"member {member.index} on Node {member.node_id} refused Prepare: "
                f"{event.reason or 'no reason given'}"
            )
            return _abort(attempt, why)
        case PrepareTimedOut():
            if attempt.decision is not None:
                return Step(attempt, ignored="already decided")
            missing = ", ".join(str(m.index) for m in _by_index(attempt) if not m.prepared)
            return _abort(
                attempt, f"member(s) {missing} were not prepared before the prepare deadline"
            )
        case DecisionQueried():
            member = _held(attempt, event.node_id, event.member_index)
            if member is None:
                return Step(
                    attempt,
                    sends=(Send("abort", event.node_id, event.member_index, NO_RECORD),),
                    ignored=NO_RECORD,
                )
            if attempt.decision is None:
                return Step(attempt, ignored="undecided")
            return Step(attempt, sends=(_decision_for(attempt, member),))
        case NodeReconnected():
            return _reconnected(attempt, event.node_id)
        case Cancelled() | NodeLost():
            if attempt.decision is not None:
                return Step(attempt, ignored="already decided")
            return _abort(attempt, event.reason)
    raise AssertionError(f"unknown launch event {event!r}")


def _by_index(attempt: Attempt) -> list[Member]:
    return sorted(attempt.members, key=lambda m: m.index)


def _held(attempt: Attempt, node_id: str, index: int) -> Member | None:
    member = attempt.member(index)
    return member if member is not None and member.node_id == node_id else None


def _decision_for(attempt: Attempt, member: Member) -> Send:
    if attempt.decision == COMMIT:
        return Send(
            "commit",
            member.node_id,
            member.index,
            master_addr=attempt.master_addr,
            master_port=attempt.master_port,
        )
    return Send("abort", member.node_id, member.index, attempt.reason)


def _put(attempt: Attempt, member: Member) -> Attempt:
    """The attempt with ``member`` in place of the one of the same index."""
    members = tuple(member if m.index == member.index else m for m in attempt.members)
    return attrs.evolve(attempt, members=members)


def _issue_prepares(attempt: Attempt, why: str) -> Step:
    """Prepare every member :func:`prepare_due` names; a reserved one becomes ``preparing``."""
    sends: list[Send] = []
    changes: list[MemberChange] = []
    after = attempt
    for m in _by_index(attempt):
        if not prepare_due(
            PrepareFacts(m.index, m.prepared, attempt.decision, attempt.master_port)
        ):
            continue
        sends.append(Send("prepare", m.node_id, m.index))
        if m.known == M_RESERVED:
            changes.append(MemberChange(m.index, M_PREPARING, why))
            after = _put(after, attrs.evolve(m, known=M_PREPARING))
    return Step(after, sends=tuple(sends), changes=tuple(changes))


def _prepared(attempt: Attempt, event: Prepared) -> Step:
    member = _held(attempt, event.node_id, event.member_index)
    if member is None:
        return Step(attempt, ignored=NO_RECORD)
    if attempt.decision is not None:
        return Step(attempt, sends=(_decision_for(attempt, member),))
    changes: list[MemberChange] = []
    member = attrs.evolve(member, prepared=True)
    after = _put(attempt, member)
    moved = member_after_report(member.known, M_PREPARED)
    if moved is not None:
        changes.append(MemberChange(member.index, moved, "prepared on its Node"))
        member = attrs.evolve(member, known=moved)
        after = _put(after, member)
    if member.index == 0:
        after = attrs.evolve(
            after,
            master_addr=event.master_addr or event.hostname,
            master_port=event.master_port,
            nonce=after.nonce if event.rendezvous_held else "",
        )
    if any(not m.prepared for m in after.members):
        if member.index != 0:
            return Step(after, changes=tuple(changes))
        rendezvous = f"{after.master_addr}:{after.master_port}"
        issued = _issue_prepares(
            after, f"Prepare issued to its Node, to reach the rendezvous {rendezvous}"
        )
        return attrs.evolve(issued, changes=(*changes, *issued.changes))
    decided = attrs.evolve(after, decision=COMMIT, reason="every member is prepared")
    sends = tuple(_decision_for(decided, m) for m in _by_index(decided))
    return Step(decided, sends=sends, changes=tuple(changes), decided=COMMIT)


def _abort(attempt: Attempt, reason: str) -> Step:
    """Decide Abort: every member ``aborted``, its GPUs released, an Abort to each Node."""
    members = _by_index(attempt)
    after = attrs.evolve(
        attempt,
        decision=ABORT,
        reason=reason,
        members=tuple(attrs.evolve(m, known=M_ABORTED) for m in attempt.members),
    )
    return Step(
        after,
        sends=tuple(Send("abort", m.node_id, m.index, reason) for m in members),
        changes=tuple(MemberChange(m.index, M_ABORTED, reason) for m in members),
        releases=tuple(m.index for m in members),
        decided=ABORT,
    )


def _reconnected(attempt: Attempt, node_id: str) -> Step:
    sends: list[Send] = []
    for m in _by_index(attempt):
        if m.node_id != node_id:
            continue
        if prepare_due(PrepareFacts(m.index, m.prepared, attempt.decision, attempt.master_port)):
            sends.append(Send("prepare", m.node_id, m.index))
        elif attempt.decision == COMMIT and m.known in BEFORE_COMMIT:
            sends.append(_decision_for(attempt, m))
    return Step(attempt, sends=tuple(sends))


#: The table as rows (event, decision before, what happens), for docs/protocol.md and its test.
TABLE: tuple[tuple[str, str, str], ...] = (
    ("Reserved", "-", "Prepare to member 0 (it becomes preparing)"),
    ("Prepared", "-", "member prepared; member 0 records the rendezvous and Prepares the others; "
     "the last one decides Commit: Commit to every member"),
    ("Prepared", "decided", "the decision again, to that member only"),
    ("PrepareFailed", "-", "Abort: Abort to every member, GPUs released"),
    ("PrepareFailed", "decided", "the decision again, to that member only"),
    ("PrepareTimedOut", "-", "Abort naming the members not prepared"),
    ("DecisionQueried", "-", "nothing (still undecided)"),
    ("DecisionQueried", "decided", "the decision, to that member only"),
    ("NodeReconnected", "-", "Prepares still due for its members"),
    ("NodeReconnected", "commit", "Commit to its members not yet past prepared"),
    ("Cancelled, NodeLost", "-", "Abort with the reason"),
)  # fmt: skip
