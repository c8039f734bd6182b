"""Named crash points for fault tests: ``TUNEPLANE_CRASHPOINT=<name>`` makes the agent die there.

A test facility, off unless the environment names a point.

Rules: the agent calls :func:`crashpoint` at each point where a crash must be survivable; the
process exits at once with status 137 (as if SIGKILLed), running no cleanup, so a test sees
exactly what a power cut at that point would leave behind.

The same points can hang instead: ``TUNEPLANE_HANGPOINT=<name>:<seconds>`` makes the thread that
reaches the point block (``time.sleep``, not an await) for that long, the first time it is
reached in the process, then go on as if nothing happened. At a point on the event loop (for
example ``after-prepare-journaled``) that is a hung loop: the test of the systemd watchdog uses
it to show that the pings stop while the loop is blocked and come back after, which a thread
that pinged on its own would hide. A value that is not ``<point>:<seconds>``, with a point of
:data:`POINTS` and at most :data:`MAX_HANG_S` seconds, arms nothing and says so once in the log.
"""

from __future__ import annotations

import logging
import os
import time

import attrs

log = logging.getLogger(__name__)

CRASH_ENV = "TUNEPLANE_CRASHPOINT"
HANG_ENV = "TUNEPLANE_HANGPOINT"
#: The longest a hang point blocks: a mistyped value must not wedge a test run for good.
MAX_HANG_S = 600.0

POINTS = frozenset(
    {
        "after-prepare-journaled",
        "after-commit-journaled",
        "after-spawn",
        "after-exit-observed",
        "after-report-sent",
        # Control credential rotation (agent/daemon.py: Daemon._rotate).
        "after-credential-issued",
        "after-next-credential-stored",
        "after-credential-swapped",
        "after-credential-confirmed",
        # XIDs committed to the journal, the inventory that shows them not yet current or sent.
        "after-xid-journaled",
        # Output manifests (agent/outputs_manifest.py) and a Derivation's copy (agent/init_from.py).
        "after-manifest-written",
        "during-init-from-copy",
    }
)


@attrs.frozen
class HangPoint:
    point: str
    seconds: float


def parse_hang(value: str) -> HangPoint | None:
    """``<point>:<seconds>`` as a :class:`HangPoint`; ``None`` when it is not one (pure)."""
    point, sep, seconds = value.rpartition(":")
    if not sep or point not in POINTS:
        return None
    try:
        length = float(seconds)
    except ValueError:
        return None
    if not 0 < length <= MAX_HANG_S:
        return None
    return HangPoint(point, length)


@attrs.define
class _HangState:
    """What ``TUNEPLANE_HANGPOINT`` armed, read the first time any point is reached."""

    read: bool = False
    armed: HangPoint | None = None

    def take(self, name: str) -> HangPoint | None:
        """The hang to do at point ``name``, once per process."""
        if not self.read:
            self.read = True
            value = os.environ.get(HANG_ENV, "")
            self.armed = parse_hang(value) if value else None
            if value and self.armed is None:
                log.warning(
                    "hang point not armed variable=%s value=%s reason=%s", HANG_ENV, value,
                    f"it is not <point>:<seconds> with a known point and 0 < seconds <= "
                    f"{MAX_HANG_S:g}",
                )  # fmt: skip
        if self.armed is None or self.armed.point != name:
            return None
        armed, self.armed = self.armed, None
        return armed


_hang = _HangState()


def _flush_logs() -> None:
    for handler in logging.getLogger().handlers:
        handler.flush()


def crashpoint(name: str) -> None:
    """Exit with status 137 right here if ``TUNEPLANE_CRASHPOINT`` names this point; block
    this thread first if ``TUNEPLANE_HANGPOINT`` names it (once)."""
    hang = _hang.take(name)
    if hang is not None:
        log.warning("hang point reached, blocking point=%s seconds=%g", name, hang.seconds)
        _flush_logs()
        time.sleep(hang.seconds)
        log.warning("hang point over, going on point=%s seconds=%g", name, hang.seconds)
    if os.environ.get(CRASH_ENV) == name:
        log.critical("crash point reached, exiting point=%s", name)
        _flush_logs()
        os._exit(137)
