"""Which control addresses a Node dials, in which order, and how it follows the coordinator to
new ones.

Rules (docs/operator.md, "Moving the coordinator" and "How a Node reconnects"):
- node.json's ``coordinator`` is the address a fresh daemon dials first; ``coordinators`` lists
  every coordinator sharing the store (high availability), the leader first as the last
  Welcome named them; ``previous_coordinators`` holds the addresses ``coordinator`` replaced,
  newest first (at most :data:`MAX_PREVIOUS`). :func:`dial_order` puts them in one
  de-duplicated order, led by the address that last welcomed this Node, so a dead or
  not-yet-leading coordinator, or a wrong new address, never strands a Node.
- Only the coordinator, over the Node's CA-verified TLS stream, names new addresses (Welcome
  or ControlAddress). The Node stores them (node.json rewritten atomically, the change
  journaled) before using them, at its next connect; the stream it is on is not dropped.
- An address that is not ``HOST:PORT`` is refused with a sentence and changes nothing.
"""

from __future__ import annotations

from collections.abc import Sequence

import attrs

from .host_port import split_host_port
from .state_dir import NodeConfig

#: How many replaced addresses a Node keeps as fallbacks.
MAX_PREVIOUS = 3
#: The most coordinators a Welcome may name (two or three share a store in practice).
MAX_COORDINATORS = 9


class BadControlAddress(ValueError):
    """The coordinator named an address that is not HOST:PORT; ``str()`` says so."""


def adopt(node: NodeConfig, announced: str) -> NodeConfig | None:
    """node.json after the coordinator announced ``announced``; None when nothing changes (it
    is empty, or already the address dialed first). Raises :class:`BadControlAddress`."""
    if not announced or announced == node.coordinator:
        return None
    if split_host_port(announced) is None:
        raise BadControlAddress(
            f"the coordinator announced the control address {announced!r}, which is not "
            "HOST:PORT; the Node keeps dialing its current address. Correct it with "
            "`tuneplane-coordinator control-address HOST:PORT`."
        )
    previous = [node.coordinator, *node.previous_coordinators]
    kept = tuple(dict.fromkeys(a for a in previous if a != announced))[:MAX_PREVIOUS]
    return attrs.evolve(node, coordinator=announced, previous_coordinators=kept)


def adopt_coordinators(node: NodeConfig, named: Sequence[str]) -> NodeConfig | None:
    """node.json after a Welcome named every coordinator sharing the store, the leader first;
    None when that is the list stored, or when it is empty. Raises :class:`BadControlAddress`
    when one is not HOST:PORT or there are too many.

    An empty list (one coordinator, or one too old to say) keeps the stored one: the Node may
    have reached this coordinator only through that list, and a Node that forgot the way back
    would be stranded at its next start; a stale entry costs one refused connect per round.
    """
    listed = tuple(dict.fromkeys(named))
    if not listed:
        return None
    bad = [a for a in listed if split_host_port(a) is None]
    if bad:
        raise BadControlAddress(
            f"the coordinator named {bad[0]!r} among the coordinators sharing its store, which "
            "is not HOST:PORT; the Node keeps the list it had. Correct that coordinator's "
            "control address (its `serve --advertise` or [addresses] host)."
        )
    if len(listed) > MAX_COORDINATORS:
        raise BadControlAddress(
            f"the coordinator named {len(listed)} coordinators sharing its store, more than the "
            f"{MAX_COORDINATORS} a Node keeps; the Node keeps the list it had. Run at most "
            f"{MAX_COORDINATORS} coordinators on one store."
        )
    if listed == node.coordinators:
        return None
    return attrs.evolve(node, coordinators=listed)


def dial_order(node: NodeConfig, welcomed_by: str = "", came_back: str = "") -> tuple[str, ...]:
    """The addresses one round dials, in order, each once: ``came_back`` (a probe just saw it
    start accepting), the address that last welcomed this Node, node.json's ``coordinator``,
    the other coordinators sharing the store (leader first), then the replaced addresses."""
    candidates = (came_back, welcomed_by, node.coordinator, *node.coordinators,
                  *node.previous_coordinators)  # fmt: skip
    return tuple(a for a in dict.fromkeys(candidates) if a)
