"""Declaring a Node lost: what happens to its members, and when ``max_disconnect`` does it.

Theory of operation: a disconnected Node's members are ``unknown`` and their Jobs wait, because a
lost connection is not proof that a workload stopped. Only a person who made sure the machine is
off (``tuneplane-coordinator node lost``), or a Fleet's ``max_disconnect`` after a long silence,
may end that wait. The declaration is one decision: every live member of the Node ends, its GPUs
go back, its Job ends (or its pending cancel completes), the members on other Nodes that worked
with it are stopped, and the Node is cordoned so nothing new lands on it before a person looks.

Rules:
- A connected Node is never declared lost (:func:`check_declarable`): it can say what its members
  are doing. An operator who distrusts its stream revokes it first.
- What each live member becomes depends only on its attempt's decision (:func:`member_fate`):
  before Commit nothing of the attempt started anywhere, so the attempt is aborted; after Commit
  the member ends ``lost``, which fails its Job like any lost member (there is no automatic
  retry: a person retries with ``tp job retry``).
- A member declared lost stays so: its Node's later reports are refused
  (:func:`~tuneplane.coordinator.lifecycle.judge_report`), and when its Node comes back it is told
  to stop the member (a Cancel that says ``declared_lost``).
- Nothing here reads a clock or the store; the store applies these decisions in one transaction.
"""

from __future__ import annotations

from . import lifecycle as lc

#: Who declares a Node lost when its Fleet's ``max_disconnect`` passes.
MAX_DISCONNECT_ACTOR = "coordinator (max_disconnect)"

# What a live member of a lost Node becomes.
ABORT_ATTEMPT = "abort-attempt"
END_LOST = "lost"


class NodeLossRefused(ValueError):
    """The Node cannot be declared lost now; ``str()`` says why and what to do instead."""


def check_declarable(node_id: str, connected: bool) -> None:
    """Raise :class:`NodeLossRefused` for a Node that is connected right now."""
    if connected:
        raise NodeLossRefused(
            f"Node {node_id} is connected, so its members are not lost: it reports what they do. "
            f"Cancel their Jobs with `tp job cancel`, or drain it with `tp node drain {node_id}`. "
            "If its stream is not the real machine, revoke it first (`tuneplane-coordinator node "
            "revoke`), make sure the machine is off, then declare it lost."
        )


def check_reason(reason: str) -> str:
    """The reason, stripped; :class:`NodeLossRefused` when there is none."""
    text = reason.strip()
    if not text:
        raise NodeLossRefused(
            "a Node is declared lost only with a reason (--reason): say how you know the machine "
            "is off, for the decision log."
        )
    return text


def member_fate(decision: str | None) -> str:
    """What a live member of a lost Node becomes, from its attempt's decision.

    Undecided: :data:`ABORT_ATTEMPT` (nothing of the attempt started anywhere). Committed, or an
    aborted attempt that still shows a live member (which the store never leaves behind):
    :data:`END_LOST`.
    """
    if decision is None:
        return ABORT_ATTEMPT
    if decision in (lc.COMMIT, lc.ABORT):
        return END_LOST
    raise lc.IllegalTransition(f"an attempt cannot have the decision {decision!r}")


def declared(by: str, reason: str) -> str:
    """The sentence recorded on each member declared lost (and shown in the Job's reason)."""
    return f"declared lost by {by}: {reason.strip().rstrip('.')}"


def abort_reason(member_index: int, node_id: str, declaration: str) -> str:
    """Why an undecided attempt is aborted when one of its Nodes is declared lost."""
    return f"member {member_index} on Node {node_id} was {declaration}"


def max_disconnect_reason(max_disconnect: str, fleet: str) -> str:
    """The reason recorded when ``max_disconnect`` declares a Node of ``fleet`` lost."""
    return (
        f"it was disconnected for longer than the Fleet {fleet}'s max_disconnect ({max_disconnect})"
    )


def overdue(
    disconnected_since_ms: int | None,
    watching_since_ms: int,
    now_ms: int,
    max_disconnect_ms: int,
) -> bool:
    """Whether a Node disconnected since ``disconnected_since_ms`` has passed ``max_disconnect``.

    The silence counts only from when this coordinator could have heard the Node
    (``watching_since_ms``, its start): a coordinator that was itself down must give every Node
    the whole ``max_disconnect`` to come back before it declares it lost.
    """
    if disconnected_since_ms is None or max_disconnect_ms <= 0:
        return False
    since = max(disconnected_since_ms, watching_since_ms)
    return now_ms - since >= max_disconnect_ms
