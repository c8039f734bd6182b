"""Which members of an undecided attempt get their Prepare now: member 0 first, then the rest.

Theory of operation: member 0's Node picks the rendezvous (address and port) at Prepare and holds
a listener there. Every other member's Node must prove at its own Prepare that it reaches that
listener (agent/rendezvous.py), so its Prepare carries the rendezvous and can only be sent once
member 0 is prepared and the rendezvous is recorded. Nothing here remembers what was sent: the
rule reads only what the store records (the decision, who is prepared, the rendezvous), so after
a coordinator restart, a reconnect or a DecisionQuery it names the same Prepares again, and a
Prepare sent twice is harmless (the Node answers a repeat from its journal).

Rules:
- A decided attempt (Commit or Abort) gets no Prepare.
- A prepared member gets no Prepare.
- Member 0 gets its Prepare as soon as the attempt is reserved.
- Any other member gets its Prepare only once member 0 is prepared and the rendezvous port is
  recorded; its Prepare carries that rendezvous and the attempt's nonce.
"""

from __future__ import annotations

import secrets
from collections.abc import Iterable

import attrs

from .lifecycle import ABORT, COMMIT


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
