"""Which control address a Node dials, and how it follows the coordinator to a new one.

Rules (docs/operator.md, "Moving the coordinator"):
- node.json's ``coordinator`` is the address dialed first; ``previous_coordinators`` holds the
  ones it replaced, newest first (at most :data:`MAX_PREVIOUS`), tried in turn when the first is
  unreachable, so a wrong or not-yet-serving new address never strands a Node.
- Only the coordinator, over the Node's CA-verified TLS stream, names a new address (Welcome or
  ControlAddress). The Node stores it (node.json rewritten atomically, the change journaled)
  before using it, and dials it at its next connect; the stream it is on is not dropped.
- An address that is not ``HOST:PORT`` is refused with a sentence and changes nothing.
"""

from __future__ import annotations

import attrs

from .state_dir import NodeConfig
from .wire import Endpoint

#: How many replaced addresses a Node keeps as fallbacks.
MAX_PREVIOUS = 3


class BadControlAddress(ValueError):
    """The coordinator named an address that is not HOST:PORT; ``str()`` says so."""


def adopt(node: NodeConfig, announced: str) -> NodeConfig | None:
    """node.json after the coordinator announced ``announced``; None when nothing changes (it
    is empty, or already the address dialed first). Raises :class:`BadControlAddress`."""
    if not announced or announced == node.coordinator:
        return None
    try:
        Endpoint.parse(announced)
    except ValueError:
        raise BadControlAddress(
            f"the coordinator announced the control address {announced!r}, which is not "
            "HOST:PORT; the Node keeps dialing its current address. Correct it with "
            "`tuneplane-coordinator control-address HOST:PORT`."
        ) from None
    previous = [node.coordinator, *node.previous_coordinators]
    kept = tuple(dict.fromkeys(a for a in previous if a != announced))[:MAX_PREVIOUS]
    return attrs.evolve(node, coordinator=announced, previous_coordinators=kept)


def dial_order(node: NodeConfig) -> tuple[str, ...]:
    """The addresses to try, in order: the current one, then the ones it replaced."""
    return tuple(dict.fromkeys((node.coordinator, *node.previous_coordinators)))


def pick(node: NodeConfig, failures: int) -> str:
    """The address for a connect after ``failures`` consecutive failed ones (0: the first try):
    the current address first, then each fallback in turn, then the current again."""
    order = dial_order(node)
    return order[failures % len(order)]
