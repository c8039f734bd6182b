"""The daemon's control session: connect, carry out the session core's effects, reconnect
(rounds over every known coordinator, then a jittered wait a probe cuts short:
agent/reconnect.py); credential rotation and new control addresses as the coordinator asks.

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
from typing import Any

import trio

from . import control_address, reconnect
from . import messages as m
from .crashpoint import crashpoint
from .daemon_base import AGENT_VERSION, DaemonBase
from .journal_records import CONTROL_ADDRESS_CHANGED, MemberKey, PendingReport
from .member_state import MemberState
from .members_base import now_ms
from .metric_hooks import HOOKS as METRIC_HOOKS
from .reconnect_wait import accepts, wait_to_redial
from .rendezvous import advertised_address
from .session import (
    AdoptControlAddress,
    AdoptCoordinators,
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
    WaitingInLine,
)
from .state_dir import CredentialLife, NodeConfig, StateDirError
from .wire import CoordinatorBusy, CoordinatorUnreachable, Endpoint, UnknownMessage, WireError
from .wire_control import ControlStream, control_refusal, open_control_stream

log = logging.getLogger(__name__)


class SessionClosed(Exception):
    """The control session ended; the connect loop reconnects with backoff."""


class DaemonSession(DaemonBase):
    """Connect, run one control session at a time, and reconnect with backoff."""

    # The control address that last welcomed this Node ("" before any): dialed first.
    welcomed_by: str = ""
    # The longest wait between rounds, from the heartbeat timeout the last Welcome gave.
    backoff_cap_s: float = reconnect.backoff_cap(None)
    # The turn the last busy refusal of this round named (seconds), if one did.
    come_back_s: float | None = None

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
        """Dial round after round and run each session; never returns.

        A round dials every address of :func:`.control_address.dial_order` in turn, the next at
        once after a failed one, and ends at the first session that got as far as Welcome (once
        that session is over). Only then does the Node wait (agent/reconnect.py): a short wait
        after a welcomed session, a growing one after rounds that all failed, cut short when a
        probe sees a coordinator come back or the credential file changes.
        """
        failed_rounds = 0
        came_back = ""
        while True:
            welcomed = False
            self.come_back_s = None
            for address in control_address.dial_order(self.node, self.welcomed_by, came_back):
                welcomed = await self._session_at(address)
                if welcomed:
                    break
            # A round that got as far as Welcome starts the backoff over; a busy coordinator
            # that named this Node's turn is dialed again then instead.
            failed_rounds = 1 if welcomed else failed_rounds + 1
            delay = reconnect.redial_delay(
                failed_rounds, random.random(), self.backoff_cap_s, self.come_back_s
            )
            order = control_address.dial_order(self.node, self.welcomed_by)
            log.info("reconnecting coordinator=%s coordinators=%s in_s=%.2f failed_rounds=%d",
                     order[0], ",".join(order), delay, failed_rounds)  # fmt: skip
            came_back = await wait_to_redial(delay, order, self.state.control_token)

    async def _session_at(self, address: str) -> bool:
        """Dial ``address`` and run a session there until it ends; whether it got Welcome."""
        self.welcomed = False
        ended: BaseException | None = None
        try:
            self.endpoint = Endpoint.parse(address)
        except ValueError as exc:
            # node.json edited by hand: say so and go on to the next address.
            self._session_ended(exc)
            return False
        self.status.coordinator = str(self.endpoint)
        try:
            # Read each time: a re-enrolment or a rotation a crash cut short changed it.
            self.credential = self.state.read_credential()
            async with open_control_stream(self.endpoint, self.ca_path, self.credential) as stream:
                await self._run_session(stream)
        except (WireError, SessionClosed, StateDirError) as exc:
            ended = exc
            self._session_ended(exc)
        except BaseExceptionGroup as group:
            # The session's nursery groups what its tasks raised; anything other than a broken
            # stream or a closed session (Cancelled, a bug) propagates.
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
        if isinstance(ended, CoordinatorBusy):
            # It said no for now and when to come back: nothing to ask it.
            self.come_back_s = ended.come_back_s
        elif (
            isinstance(ended, CoordinatorUnreachable)
            and not self.welcomed
            and await accepts(address)
        ):
            # A refused Connect can reach us as a bare stream reset; ask once more in a way that
            # always returns the coordinator's sentence (revoked, expired, unknown). Not of an
            # address that takes no connection: the round goes on to the next at once.
            refusal = await control_refusal(self.endpoint, self.ca_path, self.credential)
            if refusal is not None:
                self._session_ended(refusal)
        self.status.reconnects += 1
        METRIC_HOOKS.reconnect()
        return self.welcomed

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
                self.welcomed_by = str(self.endpoint)
                self.backoff_cap_s = reconnect.backoff_cap(effect.heartbeat_timeout_s)
                self.status.connected = True
                self.status.last_connected_ms = now_ms()
                self.status.last_error = ""
                if effect.server_time_ms:
                    self.status.clock_skew_ms = effect.server_time_ms - now_ms()
                    self.status.clock_skew_at_ms = now_ms()
                self.status.coordinator_version = effect.coordinator.version
                self.status.coordinator_protocol = effect.coordinator.protocol
                self.status.coordinator_capabilities = sorted(effect.coordinator.capabilities)
                if effect.skew_warning:
                    log.warning("coordinator outside the version-skew policy coordinator=%s "
                                "reason=%s", self.endpoint, effect.skew_warning)  # fmt: skip
                self.write_status()
                if self.logship is not None:
                    self.logship.session_opened()
                self._credential_life(
                    effect.credential_issued_at_ms, effect.credential_expires_at_ms
                )
                log.info("connected coordinator=%s coordinator_version=%s protocol=%d "
                         "heartbeat_interval_s=%.2f timeout_s=%.2f", self.endpoint,
                         effect.coordinator.version, effect.coordinator.protocol,
                         effect.heartbeat_interval_s, effect.heartbeat_timeout_s)  # fmt: skip
            elif isinstance(effect, HeartbeatAcked):
                self.status.last_heartbeat_ack_ms = now_ms()
                if effect.rtt_s is not None:
                    METRIC_HOOKS.heartbeat_rtt(effect.rtt_s)
            elif isinstance(effect, LogAcked):
                if self.logship is not None:
                    await self.logship.acked(effect.ack)
            elif isinstance(effect, StoreCredential):
                await self._rotate(effect.issued)
            elif isinstance(effect, AdoptControlAddress):
                await self._adopt_control_address(effect.address)
            elif isinstance(effect, AdoptCoordinators):
                await self._adopt_coordinators(effect.addresses)
            elif isinstance(effect, WaitingInLine):
                log.info("waiting in line for a Welcome coordinator=%s expected_s=%.1f "
                         "deadline_s=%.1f reason=%s", self.endpoint, effect.wait_s,
                         effect.deadline_s, effect.sentence)  # fmt: skip
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
        await self._store_node(
            changed,
            f"the coordinator named {address} as the control address; {old} is kept as a fallback",
            old=old,
            new=address,
        )
        log.info("control address changed old=%s new=%s fallbacks=%s", old, address,
                 ",".join(changed.previous_coordinators))  # fmt: skip

    async def _adopt_coordinators(self, addresses: tuple[str, ...]) -> None:
        """Store the coordinators Welcome named (node.json, atomically) and journal the change,
        so the next round dials them after the leader; the stream now open is kept."""
        try:
            changed = control_address.adopt_coordinators(self.node, addresses)
        except control_address.BadControlAddress as exc:
            log.warning("coordinators refused reason=%s", exc)
            return
        if changed is None:
            return
        old = self.node.coordinators
        named = ", ".join(addresses) or "none (one coordinator)"
        await self._store_node(
            changed,
            f"the coordinator named the coordinators sharing its store: {named}",
            old_coordinators=list(old),
            coordinators=list(addresses),
        )
        log.info("coordinators changed old=%s new=%s", ",".join(old),
                 ",".join(changed.coordinators))  # fmt: skip

    async def _store_node(self, changed: NodeConfig, reason: str, **detail: Any) -> None:
        """Journal a change the coordinator named (``control-address-changed``), then write
        node.json atomically and use it: journal before acting."""
        if self.journal is not None:
            await self.journal.node_event(now_ms(), CONTROL_ADDRESS_CHANGED, reason, **detail)
        await trio.to_thread.run_sync(self.state.save_node, changed)
        self.node = changed

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
