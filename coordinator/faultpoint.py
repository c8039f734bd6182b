"""Named fault points, a test facility: ``TUNEPLANE_FAULTPOINT=<name>`` makes one call fail there.

Rules:
- Off unless the environment names a point; the variable is read once, when this module loads,
  so the coordinator's process decides at start and a later change of its environment does
  nothing. A name that is no point in :data:`POINTS` arms nothing.
- An armed point raises :class:`FaultPointReached` the first time the code reaches it, and never
  again in that process: a test sees an unexpected error inside a real call (the agent's
  counterpart, ``agent/crashpoint.py``, kills the process instead) and then that the coordinator
  keeps serving the same call.
- Points sit only in handlers that change nothing before them.
"""

from __future__ import annotations

import logging
import os

log = logging.getLogger(__name__)

ENV = "TUNEPLANE_FAULTPOINT"
POINTS = frozenset(
    {
        # fleet_service.FleetService._list_fleets, after the caller is authenticated and the
        # request read, before the store is read.
        "list-fleets",
    }
)


class FaultPointReached(RuntimeError):
    """The error an armed fault point raises: one nobody in the coordinator expects."""


_armed: str | None = os.environ.get(ENV) or None


def faultpoint(name: str) -> None:
    """Raise :class:`FaultPointReached` here, once, if ``TUNEPLANE_FAULTPOINT`` names this point."""
    global _armed
    assert name in POINTS, f"fault point {name!r} is not listed in POINTS"
    if _armed == name:
        _armed = None
        log.warning("fault point reached, raising point=%s", name)
        raise FaultPointReached(f"fault point {name} was armed by {ENV} and was reached.")
