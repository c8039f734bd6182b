"""The lease's shell in ``serve``: campaign as a standby, renew as the leader, step down.

Rules (the lease's rules are :mod:`tuneplane.coordinator.leadership`'s; its SQL is
:mod:`tuneplane.coordinator.store.lease`'s):
- A standby reads the lease every ``poll_s`` and takes it when :func:`judge` says so; it logs
  the leader once per change, not once per poll, and marks itself seen in the roll call.
- The leader renews every ``renew_s``. A renewal that finds another term, or that has not
  succeeded by :func:`must_step_down_at`, ends its leadership: :meth:`Leadership.keep` calls
  ``lost`` with a sentence and returns, and ``serve`` stops every listener and session before it
  campaigns again. A renewal is never retried past that point, however the store answers.
- :class:`LeaderView` is what status and the metrics read: memory only, never the store.
- :class:`Peers` is the roll call as Nodes, collectors and ``tp`` get it (each coordinator's
  advertised addresses, the leader's first), re-read every :data:`ROLL_CALL_S` while leading.
  Coordinators not seen for :data:`FORGET_AFTER_MS` are left out.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import anyio
import attrs

from ..clock import now_ms
from ..leadership import LeaseRow, LeaseSettings, Verdict, judge, must_step_down_at
from ..store.handle import StoreUnavailable
from ..store.lease import CoordinatorFacts, CoordinatorRow, LeaseDesk

log = logging.getLogger(__name__)

ROLL_CALL_S = 5.0
#: A coordinator not seen for a day is left out of the lists handed to Nodes and ``tp``.
FORGET_AFTER_MS = 24 * 3600 * 1000


@attrs.define
class LeaderView:
    """This coordinator's part, as status and metrics show it (memory only).

    ``role``: ``leader``, ``standby`` or ``single`` (a SQLite store: no lease, it always leads).
    """

    me: str
    role: str = "standby"
    term: int = 0
    leader: str = ""
    leader_since_ms: int = 0
    lease_expires_ms: int = 0
    takeovers: int = 0
    standbys: tuple[str, ...] = ()


@attrs.define
class Peers:
    """Every coordinator's advertised addresses, this one's first."""

    api: tuple[str, ...] = ()
    control: tuple[str, ...] = ()
    telemetry: tuple[str, ...] = ()

    def update(self, me: CoordinatorFacts, rows: list[CoordinatorRow], db_now_ms: int) -> None:
        others = [
            r.facts for r in rows if r.facts.id != me.id and db_now_ms - r.seen_ms < FORGET_AFTER_MS
        ]
        ordered = [me, *others]
        self.api = tuple(dict.fromkeys(f.api_address for f in ordered if f.api_address))
        self.control = tuple(dict.fromkeys(f.control_address for f in ordered if f.control_address))
        self.telemetry = tuple(
            dict.fromkeys(f.telemetry_address for f in ordered if f.telemetry_address)
        )


@attrs.frozen
class Won:
    """A lease this coordinator just took: its term, why it could, whom it took it from, and
    the monotonic time the taking started (the lease's time runs from no earlier)."""

    term: int
    why: str
    previous: str
    started: float


class Leadership:
    """Campaign and renewal for coordinator ``facts.id`` on ``desk``."""

    def __init__(
        self,
        desk: LeaseDesk,
        facts: CoordinatorFacts,
        settings: LeaseSettings,
        view: LeaderView,
        peers: Peers,
    ) -> None:
        self.desk = desk
        self.facts = facts
        self.settings = settings
        self.view = view
        self.peers = peers
        #: Called after a roll call that changed :attr:`peers` (the leader republishes them).
        self.on_peers: Callable[[], None] | None = None
        self._said = ""

    def _say(self, text: str, level: int = logging.INFO) -> None:
        """Log ``text`` once, until something else is said."""
        if text != self._said:
            log.log(level, text)
            self._said = text

    def _saw(self, lease: LeaseRow | None) -> None:
        if lease is not None:
            self.view.leader = lease.holder
            self.view.term = lease.term
            self.view.leader_since_ms = lease.acquired_ms
            self.view.lease_expires_ms = lease.expires_ms

    async def campaign(self) -> Won:
        """Wait as a standby until this coordinator takes the lease."""
        self.view.role = "standby"
        while True:
            started = anyio.current_time()
            try:
                await self.desk.seen(self.facts.id)
                lease = await self.desk.read()
                reading = judge(lease)
                if reading.verdict is Verdict.TAKE_OVER:
                    term = await self.desk.take(self.facts.id, self.settings.ttl_ms, lease)
                    if term is not None:
                        self._said = ""
                        return Won(term, reading.why, lease.holder if lease else "", started)
                else:
                    self._saw(lease)
                    self._say(
                        f"standing by leader={lease.holder if lease else '-'} "
                        f"term={lease.term if lease else 0} me={self.facts.id}"
                    )
            except StoreUnavailable as exc:
                self._say(f"lease not readable; retrying reason={exc}", logging.WARNING)
            await anyio.sleep(self.settings.poll_s)

    def took(self, won: Won) -> None:
        """Record in the view that this coordinator leads with ``won``."""
        self.view.role = "leader"
        self.view.leader = self.facts.id
        self.view.term = won.term
        self.view.leader_since_ms = now_ms()
        self.view.lease_expires_ms = now_ms() + self.settings.ttl_ms
        self.view.takeovers += 1

    async def keep(self, won: Won, lost: Callable[[str, bool], None]) -> None:
        """Renew the lease of ``won`` until cancelled; when it is lost, call ``lost`` with why
        and whether the store is still reachable, and return."""
        settings = self.settings
        renewed = won.started
        next_roll_call = 0.0
        while True:
            await anyio.sleep(settings.renew_s)
            deadline = must_step_down_at(renewed, settings)
            started = anyio.current_time()
            if started >= deadline:
                lost(_late(settings), False)
                return
            try:
                with anyio.fail_after(deadline - started):
                    ours = await self.desk.renew(self.facts.id, won.term, settings.ttl_ms)
                    if ours and started >= next_roll_call:
                        await self.roll_call()
                        next_roll_call = started + ROLL_CALL_S
            except TimeoutError:
                lost(_late(settings), False)
                return
            except StoreUnavailable as exc:
                log.warning("lease renewal failed; retrying reason=%s", exc)
                continue
            if not ours:
                lost(f"another coordinator took the lease over (term {won.term} ended)", True)
                return
            renewed = started
            self.view.lease_expires_ms = now_ms() + settings.ttl_ms

    async def roll_call(self) -> None:
        """Read the roll call into :attr:`peers` (and the view's standbys)."""
        await self.desk.seen(self.facts.id)
        rows = await self.desk.roll_call()
        before = attrs.astuple(self.peers)
        self.peers.update(self.facts, rows, await self.desk.now_ms())
        self.view.standbys = tuple(r.facts.id for r in rows if r.facts.id != self.facts.id)
        if attrs.astuple(self.peers) != before and self.on_peers is not None:
            self.on_peers()


def _late(settings: LeaseSettings) -> str:
    return (
        f"its lease could not be renewed in time (the store did not answer within "
        f"{settings.ttl_s - settings.margin_s:g} s of the last renewal), so it may already "
        "have expired"
    )
