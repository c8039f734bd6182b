"""The daemon's control session: connect, carry out the session core's effects, reconnect with
backoff; credential rotation and a new control address as the coordinator asks.

Rules:
- Effects from the session core (agent/session.py) run in order: journal, then network, then
  processes. Member commands go to the daemon's command worker, one at a time, in order.
- The control credential is read from the state directory before every Connect (so a
  re-enrolment takes effect without a restart, within a backoff poll). A rotation stores the
  successor durably (``control.token.next``, then a rename) before saying CredentialStored;
  crash points ``after-credential-issued``, ``after-next-credential-stored``,
  ``after-credential-swapped`` and ``after-credential-confirmed`` sit between the steps.
- A message with no session open is dropped: reports stay journaled until acknowledged and the
  coordinator repeats an unanswered Prepare.
"""

from __future__ import annotations

import logging
import random

import trio

from . import control_address
from . import messages as m
from .crashpoint import crashpoint
from .daemon_base import AGENT_VERSION, CREDENTIAL_POLL_S, DaemonBase
from .journal_records import CONTROL_ADDRESS_CHANGED, MemberKey, PendingReport
from .member_state import MemberState
from .members_base import now_ms
from .metrics import HEARTBEAT_RTT, RECONNECTS
from .rendezvous import advertised_address
from .session import (
    AdoptControlAddress,
    Close,
    Connected,
    ControlSession,
    DropReport,
    Effect,
    HandleCommand,
    HeartbeatAcked,
    LogAcked,
    Phase,
    Send,
    StoreCredential,
    backoff_delay,
)
from .state_dir import CredentialLife, StateDirError
from .wire import CoordinatorUnreachable, Endpoint, UnknownMessage, WireError
from .wire_control import ControlStream, control_refusal, open_control_stream

log = logging.getLogger(__name__)


class SessionClosed(Exception):
    """The control session ended; the connect loop reconnects with backoff."""


class DaemonSession(DaemonBase):
    """Connect, run one control session at a time, and reconnect with backoff."""

    def _outputs_service(self) -> m.OutputsService | None:
        """What this session's Hello says of the outputs listener (None when it is off): the
        advertised host, else this Node's own address as the rendezvous uses it."""
        if self.outputs is None:
            return None
        service = self.outputs.service(advertised_address(self.node_address()))
        self.status.outputs_address = service.address
        return service

    # --- connection --------------------------------------------------------------------------

    async def connect_loop(self) -> None:
        """Connect, run the session, and reconnect with backoff when it ends; never returns."""
        failures = 0
        while True:
            self.welcomed = False
            ended: BaseException | None = None
            # The current address first; after failures, the ones it replaced in turn.
            self.endpoint = Endpoint.parse(control_address.pick(self.node, max(failures - 1, 0)))
            self.status.coordinator = str(self.endpoint)
            try:
                # Read each time: a re-enrolment or a rotation a crash cut short changed it.
                self.credential = self.state.read_credential()
                async with open_control_stream(
                    self.endpoint, self.ca_path, self.credential
                ) as stream:
                    await self._run_session(stream)
            except (WireError, SessionClosed, StateDirError) as exc:
                ended = exc
                self._session_ended(exc)
            except BaseExceptionGroup as group:
                # The session's nursery groups what its tasks raised; anything other than a
                # broken stream or a closed session (Cancelled, a bug) propagates.
                matched, rest = group.split((WireError, SessionClosed))
                if rest is not None or matched is None:
                    raise
                first: BaseException = matched
                while isinstance(first, BaseExceptionGroup):
                    first = first.exceptions[0]
                ended = first
                self._session_ended(first)
            finally:
                self.session = None
                self.stream = None
                if self.status.connected:
                    self.status.connected = False
                    self.write_status()
            if isinstance(ended, CoordinatorUnreachable) and not self.welcomed:
                # A refused Connect can reach us as a bare stream reset; ask once more in a way
                # that always returns the coordinator's sentence (revoked, expired, unknown).
                refusal = await control_refusal(self.endpoint, self.ca_path, self.credential)
                if refusal is not None:
                    self._session_ended(refusal)
            # A session that got as far as Welcome starts the backoff over.
            failures = 1 if self.welcomed else failures + 1
            self.status.reconnects += 1
            RECONNECTS.inc()
            delay = backoff_delay(failures, random.random())
            log.info("reconnecting coordinator=%s in_s=%.2f attempt=%d", self.endpoint, delay,
                     failures)  # fmt: skip
            await self._backoff(delay)

    async def _backoff(self, delay: float) -> None:
        """Wait ``delay`` before reconnecting, or less once the credential file changes: a
        re-enrolment (``enroll --re-enroll``) takes effect within a poll, not a backoff."""
        before = self._credential_stamp()
        with trio.move_on_after(delay):
            while self._credential_stamp() == before:
                await trio.sleep(CREDENTIAL_POLL_S)
            log.info("control credential replaced on disk; reconnecting now")

    def _credential_stamp(self) -> tuple[int, int] | None:
        try:
            found = self.state.control_token.stat()
        except OSError:
            return None
        return found.st_ino, found.st_mtime_ns

    def _session_ended(self, exc: BaseException) -> None:
        self.status.last_error = str(exc)
        log.warning("control session ended coordinator=%s reason=%s", self.endpoint, exc)

    async def _held(self) -> list[tuple[MemberKey, MemberState]]:
        return await self.manager.held() if self.manager else []

    async def _run_session(self, stream: ControlStream) -> None:
        """Drive one session until it closes: raises SessionClosed or WireError, never returns."""
        session = ControlSession(
            self.node.node_id,
            AGENT_VERSION,
            dialed_address=str(self.endpoint),
            outputs=self._outputs_service(),
            renewal_jitter=self.renewal_jitter,
        )
        self.session, self.stream = session, stream
        await self._execute(session.start(trio.current_time(), self.inventory,
                                          await self._held()))  # fmt: skip
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self._receive_loop, session, stream)
            while True:
                with trio.move_on_at(session.next_deadline()):
                    await self.wake.wait()
                self.wake = trio.Event()
                pending: list[PendingReport] = []
                if session.phase is Phase.OPEN and self.journal is not None:
                    pending = await self.journal.pending_reports()
                await self._execute(
                    session.tick(trio.current_time(), now_ms(), self.inventory, pending)
                )

    async def _receive_loop(self, session: ControlSession, stream: ControlStream) -> None:
        while True:
            try:
                message = await stream.receive()
            except UnknownMessage as exc:
                log.warning("coordinator message skipped reason=%s", exc)
                continue
            if message is None:
                await self._execute(session.stream_ended())
                return
            pending: list[PendingReport] = []
            undecided: list[MemberKey] = []
            welcome = isinstance(message, m.Welcome) and session.phase is Phase.HELLO_SENT
            if welcome and self.journal is not None and self.manager is not None:
                pending = await self.journal.pending_reports()
                undecided = await self.manager.undecided()
            await self._execute(session.receive(trio.current_time(), message, pending, undecided))
            # The deadline may have moved (Welcome sets the heartbeat timing).
            self.wake.set()

    async def _execute(self, effects: list[Effect]) -> None:
        """Carry out session effects in order; Close raises :class:`SessionClosed`."""
        for effect in effects:
            if isinstance(effect, Send):
                assert self.stream is not None
                await self.stream.send(effect.message)
                if isinstance(effect.message, m.Report):
                    crashpoint("after-report-sent")
            elif isinstance(effect, DropReport):
                if effect.refused:
                    log.warning("report refused by the coordinator seq=%d reason=%s",
                                effect.report_seq, effect.refused)  # fmt: skip
                if self.journal is not None:
                    await self.journal.ack_report(effect.report_seq, effect.refused, now_ms())
            elif isinstance(effect, HandleCommand):
                await self.commands_send.send(effect.command)
            elif isinstance(effect, Connected):
                self.welcomed = True
                self.status.connected = True
                self.status.last_connected_ms = now_ms()
                self.status.last_error = ""
                if effect.server_time_ms:
                    self.status.clock_skew_ms = effect.server_time_ms - now_ms()
                    self.status.clock_skew_at_ms = now_ms()
                self.write_status()
                if self.logship is not None:
                    self.logship.session_opened()
                self._credential_life(
                    effect.credential_issued_at_ms, effect.credential_expires_at_ms
                )
                log.info("connected coordinator=%s heartbeat_interval_s=%.2f timeout_s=%.2f",
                         self.endpoint, effect.heartbeat_interval_s,
                         effect.heartbeat_timeout_s)  # fmt: skip
            elif isinstance(effect, HeartbeatAcked):
                self.status.last_heartbeat_ack_ms = now_ms()
                if effect.rtt_s is not None:
                    HEARTBEAT_RTT.observe(effect.rtt_s)
            elif isinstance(effect, LogAcked):
                if self.logship is not None:
                    await self.logship.acked(effect.ack)
            elif isinstance(effect, StoreCredential):
                await self._rotate(effect.issued)
            elif isinstance(effect, AdoptControlAddress):
                await self._adopt_control_address(effect.address)
            elif isinstance(effect, Close):
                raise SessionClosed(effect.reason)

    async def _adopt_control_address(self, address: str) -> None:
        """Store the control address the coordinator named (node.json, atomically) and journal
        it, so the next connect dials it; the stream now open is kept."""
        try:
            changed = control_address.adopt(self.node, address)
        except control_address.BadControlAddress as exc:
            log.warning("control address refused reason=%s", exc)
            return
        if changed is None:
            return
        old = self.node.coordinator
        if self.journal is not None:
            await self.journal.node_event(
                now_ms(),
                CONTROL_ADDRESS_CHANGED,
                f"the coordinator named {address} as the control address; {old} is kept as "
                "a fallback",
                old=old,
                new=address,
            )
        await trio.to_thread.run_sync(self.state.save_node, changed)
        self.node = changed
        log.info("control address changed old=%s new=%s fallbacks=%s", old, address,
                 ",".join(changed.previous_coordinators))  # fmt: skip

    async def _rotate(self, issued: m.CredentialIssued) -> None:
        """Store a successor credential durably, switch to it, then confirm it.

        Each step leaves a working credential behind: until the rename the old one is in
        ``control.token`` (and still accepted); after it, the new one is (and is accepted, and
        the next Connect with it confirms it if CredentialStored never got out).
        """
        crashpoint("after-credential-issued")
        await trio.to_thread.run_sync(self.state.save_next_credential, issued.credential)
        crashpoint("after-next-credential-stored")
        await trio.to_thread.run_sync(self.state.promote_next_credential)
        self.credential = issued.credential
        crashpoint("after-credential-swapped")
        self._credential_life(issued.issued_at_ms, issued.expires_at_ms)
        if self.journal is not None:
            await self.journal.record_credential("control", now_ms())
        log.info("control credential rotated expires_at_ms=%d request_id=%d",
                 issued.expires_at_ms, issued.request_id)  # fmt: skip
        session = self.session
        if session is not None:
            await self._execute(session.credential_stored(issued))
        crashpoint("after-credential-confirmed")

    def _credential_life(self, issued_at_ms: int, expires_at_ms: int) -> None:
        """Remember what the coordinator said about the credential's lifetime (status, doctor)."""
        if expires_at_ms:
            self.state.save_credential_life(CredentialLife(issued_at_ms, expires_at_ms))
        self.status.credential_issued_at_ms = issued_at_ms
        self.status.credential_expires_at_ms = expires_at_ms
        due = self.session.renewal_due_ms() if self.session is not None else None
        self.status.credential_renewal_at_ms = due or 0

    async def publish(self, message: m.Outgoing) -> None:
        """Send a manager's reply or report now if a session is open, else drop it.

        Nothing is lost by dropping: reports stay in the journal until acknowledged and are
        replayed after the next Welcome; the coordinator repeats an unanswered Prepare.
        """
        session, stream = self.session, self.stream
        if session is None or stream is None:
            return
        try:
            for effect in session.outgoing(message, trio.current_time()):
                await self._execute([effect])
        except WireError as exc:
            # The receive loop sees the same broken stream and closes the session.
            log.warning("send failed message=%s reason=%s", type(message).__name__, exc)
