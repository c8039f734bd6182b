"""Named crash points for fault tests: ``TUNEPLANE_CRASHPOINT=<name>`` makes the process die there.

A test facility, off unless the environment names a point. The agent and the coordinator share
it (one variable, one list of names, :data:`POINTS`): each calls :func:`crashpoint` at each point
where a crash must be survivable, and names no point the other reaches.

Rules: the process exits at once with status 137 (as if SIGKILLed), running no cleanup, so a test
sees exactly what a power cut at that point would leave behind. ``<name>@<n>`` waits for the
``n``-th time the point is reached (``mid-heartbeat-batch@3``: the third batch), for a point
reached too often for its first time to be the interesting one. A call may name details
(``crashpoint("mid-heartbeat-batch", beats=beats)``): they are formatted only on the way out, as
``key=value`` on the crash line, so a test knows what the process was holding when it died. A
value that is not ``<point>`` or ``<point>@<n>`` with a point of :data:`POINTS` and
``1 <= n <= MAX_NTH`` arms nothing and says so once in the log (the first time any point is
reached).

The same points can hang instead: ``TUNEPLANE_HANGPOINT=<name>:<seconds>`` makes the thread that
reaches the point block (``time.sleep``, not an await) for that long, the first time it is
reached in the process, then go on as if nothing happened. At a point on the event loop (for
example ``after-prepare-journaled``) that is a hung loop: the test of the systemd watchdog uses
it to show that the pings stop while the loop is blocked and come back after, which a thread
that pinged on its own would hide. A value that is not ``<point>:<seconds>``, with a point of
:data:`POINTS` and at most :data:`MAX_HANG_S` seconds, arms nothing and says so once in the log.

Both variables are read once per process, the first time any point is reached.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Mapping

import attrs

log = logging.getLogger(__name__)

CRASH_ENV = "TUNEPLANE_CRASHPOINT"
HANG_ENV = "TUNEPLANE_HANGPOINT"
#: The longest a hang point blocks: a mistyped value must not wedge a test run for good.
MAX_HANG_S = 600.0
#: The latest reach ``<point>@<n>`` may wait for.
MAX_NTH = 10_000

AGENT_POINTS = frozenset(
    {
        "after-prepare-journaled",
        "after-commit-journaled",
        "after-spawn",
        "after-exit-observed",
        "after-report-sent",
        # Control credential rotation (agent/daemon_session.py: DaemonSession._rotate).
        "after-credential-issued",
        "after-next-credential-stored",
        "after-credential-swapped",
        "after-credential-confirmed",
        # XIDs committed to the journal, the inventory that shows them not yet current or sent.
        "after-xid-journaled",
        # Output manifests (agent/outputs_manifest.py) and a Derivation's copy (agent/init_from.py).
        "after-manifest-written",
        "during-init-from-copy",
        # Runtime images (agent/image_pull.py, agent/image_cache.py): a blob's partial file
        # written up to some byte; an image's root unpacked in full, not yet renamed into place.
        "mid-image-blob",
        "before-image-root-renamed",
    }
)
COORDINATOR_POINTS = frozenset(
    {
        # coordinator/server/scheduler.py, Scheduler._launch: the reservation is committed, its
        # Prepare not yet sent.
        "after-reservation-written",
        # coordinator/gateways/node_messages.py, a PrepareReply: the Commit decision is committed,
        # not yet sent.
        "after-commit-decided",
        # An Abort is committed, not yet sent: a refused Prepare (node_messages.py) or a passed
        # prepare deadline (scheduler.py, Scheduler.step).
        "after-abort-decided",
        # coordinator/gateways/node_messages.py, a MemberReport: applied and committed, not yet
        # acknowledged.
        "after-report-applied",
        # coordinator/store/nodes.py, Store.node_heartbeats: inside the batch's transaction, its
        # rows written, not committed.
        "mid-heartbeat-batch",
        # coordinator/store/metric_ingest.py, MetricIngest.ship: inside the transaction, a series'
        # points written, not committed.
        "mid-telemetry-ingest",
        # coordinator/server/slurm_executor.py: slurmrestd accepted an attempt's Slurm job, its
        # job id not yet recorded.
        "after-slurm-submit",
    }
)
POINTS = AGENT_POINTS | COORDINATOR_POINTS


@attrs.frozen
class CrashPoint:
    point: str
    nth: int = 1


def parse_crash(value: str) -> CrashPoint | None:
    """``<point>`` or ``<point>@<n>`` as a :class:`CrashPoint`; ``None`` when it is not one."""
    point, sep, nth = value.partition("@")
    if point not in POINTS:
        return None
    if not sep:
        return CrashPoint(point)
    if not (nth.isascii() and nth.isdigit()) or not 1 <= int(nth) <= MAX_NTH:
        return None
    return CrashPoint(point, int(nth))


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


CRASH_FORM = f"<point> or <point>@<n> with a known point and 1 <= n <= {MAX_NTH}"
HANG_FORM = f"<point>:<seconds> with a known point and 0 < seconds <= {MAX_HANG_S:g}"


def _refuse(what: str, variable: str, value: str, form: str) -> None:
    """Say (once: the caller reads ``variable`` once) that its ``value`` arms nothing."""
    log.warning(
        "%s not armed variable=%s value=%s reason=it is not %s", what, variable, value, form
    )


@attrs.define
class _CrashState:
    """What ``TUNEPLANE_CRASHPOINT`` armed (read the first time any point is reached), and how
    often its point has been reached since."""

    read: bool = False
    armed: CrashPoint | None = None
    reached: int = 0

    def take(self, name: str) -> int:
        """How many times point ``name`` has now been reached, when that is the reach to die
        at; 0 otherwise."""
        if not self.read:
            self.read = True
            value = os.environ.get(CRASH_ENV, "")
            self.armed = parse_crash(value) if value else None
            if value and self.armed is None:
                _refuse("crash point", CRASH_ENV, value, CRASH_FORM)
        if self.armed is None or self.armed.point != name:
            return 0
        self.reached += 1
        return self.reached if self.reached == self.armed.nth else 0


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
                _refuse("hang point", HANG_ENV, value, HANG_FORM)
        if self.armed is None or self.armed.point != name:
            return None
        armed, self.armed = self.armed, None
        return armed


_crash = _CrashState()
_hang = _HangState()


def _flush_logs() -> None:
    for handler in logging.getLogger().handlers:
        handler.flush()


def _field(value: object) -> str:
    """One detail as it appears after ``key=``: a mapping as ``k:v,k:v`` (sorted by key)."""
    if isinstance(value, Mapping):
        return ",".join(f"{k}:{v}" for k, v in sorted(value.items()))
    return str(value)


def crashpoint(name: str, **detail: object) -> None:
    """Exit with status 137 right here if ``TUNEPLANE_CRASHPOINT`` names this point (and this is
    the reach it waits for); block this thread first if ``TUNEPLANE_HANGPOINT`` names it (once).
    ``detail`` goes on the crash line as ``key=value``, formatted only then."""
    assert name in POINTS, f"crash point {name!r} is not listed in POINTS"
    hang = _hang.take(name)
    if hang is not None:
        log.warning("hang point reached, blocking point=%s seconds=%g", name, hang.seconds)
        _flush_logs()
        time.sleep(hang.seconds)
        log.warning("hang point over, going on point=%s seconds=%g", name, hang.seconds)
    reached = _crash.take(name)
    if reached:
        fields = "".join(f" {key}={_field(value)}" for key, value in detail.items())
        log.critical("crash point reached, exiting point=%s reached=%d%s", name, reached, fields)
        _flush_logs()
        os._exit(137)
