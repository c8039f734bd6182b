"""The control-session protocol core (sans-IO): messages and time in, effects out.

Rules:
- Nothing here reads a clock, a socket or the journal: ``now`` (monotonic seconds) and
  ``wall_ms`` are passed in, journal facts are arguments, and every decision comes back as a list
  of effects that the daemon executes in order (journal first, then network, then processes).
- Hello first (with the outputs listener's address, certificate digest and grant key when it
  is on); nothing but Welcome is accepted before it. After Welcome every unacknowledged
  report is replayed in sequence order and every prepared member without a decision is asked
  about with DecisionQuery.
- Welcome's control address and list of coordinators come back as effects for the shell to
  store (agent/control_address.py), as does a later Coordinators message; reconnect timing is
  agent/reconnect.py's.
- Hello says this agent's control protocol and capabilities; Welcome's (the coordinator's
  release, protocol and capabilities) come back in :class:`Connected`, with a warning when the
  coordinator is older than the version-skew policy allows
  (proto/contract/control_protocol.py).
- Heartbeat every ``heartbeat_interval``; a peer silent for ``heartbeat_timeout`` closes the
  session. :meth:`ControlSession.next_deadline` says when :meth:`ControlSession.tick` is due.
  A Connect the coordinator put in line (:class:`~.messages.Queued`) awaits its Welcome longer.
- A report goes out once, again only after a heartbeat timeout without its ack; one a tick's
  journal read shows unpublished waits a grace for its publish (agent/session_reports.py).
- Credential rotation: Welcome says when the stream's credential expires; at the jittered point
  :func:`~tuneplane.agent.credential_renewal.renewal_at_ms` picks (checked on every tick, so at
  heartbeat granularity) the session asks with CredentialRenewal, resent after a heartbeat
  timeout. A matching CredentialIssued becomes :class:`StoreCredential`; only after the shell
  stored it durably does :meth:`ControlSession.credential_stored` say CredentialStored.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence

import attrs

from tuneplane.proto.contract import control_protocol as protocol

from . import messages as m
from .credential_renewal import renewal_at_ms
from .inventory import Inventory
from .journal_records import MemberKey, PendingReport
from .member_state import MemberState
from .reconnect import welcome_timeout_in_line
from .session_reports import ReportBook

#: How long to wait for Welcome after Hello, before the coordinator has told us its timeouts.
WELCOME_TIMEOUT_S = 10.0


class Phase(enum.Enum):
    IDLE = "idle"
    HELLO_SENT = "hello-sent"
    OPEN = "open"
    CLOSED = "closed"


# --- effects -----------------------------------------------------------------------------------


@attrs.frozen
class Send:
    """Send this message on the stream."""

    message: m.Outgoing


@attrs.frozen
class DropReport:
    """The coordinator acknowledged this report: delete it from ``pending_reports``.

    ``refused`` carries the coordinator's sentence when it refused the report: resending would
    get the same answer, so it is dropped too, and the refusal is journaled.
    """

    report_seq: int
    refused: str = ""


@attrs.frozen
class HandleCommand:
    """A member command for the member manager (prepare, commit, abort, cancel)."""

    command: m.MemberCommand


@attrs.frozen
class Connected:
    """The session is open (Welcome received): worth recording in the status file."""

    heartbeat_interval_s: float
    heartbeat_timeout_s: float
    credential_issued_at_ms: int = 0
    credential_expires_at_ms: int = 0
    # The coordinator's clock when it sent the Welcome (epoch ms; 0: not stated).
    server_time_ms: int = 0
    # What the coordinator said of itself in Welcome (an unversioned one: protocol 1).
    coordinator: protocol.Peer = protocol.UNKNOWN_PEER
    # A sentence when that coordinator is outside the version-skew policy for this agent.
    skew_warning: str = ""


@attrs.frozen
class HeartbeatAcked:
    seq: int
    # Seconds from sending the heartbeat to this acknowledgement; None for an older one's.
    rtt_s: float | None = None


@attrs.frozen
class LogAcked:
    """The coordinator acknowledged shipped log bytes: tell the log shipper."""

    ack: m.LogAck


@attrs.frozen
class StoreCredential:
    """Store this successor durably (next file, fsync, rename), then call
    :meth:`ControlSession.credential_stored`; until then the old credential stays in use."""

    issued: m.CredentialIssued


@attrs.frozen
class AdoptControlAddress:
    """The coordinator named the control address to dial from now on: store it (node.json,
    journal) for the next connect (agent/control_address.py)."""

    address: str


@attrs.frozen
class AdoptCoordinators:
    """Welcome (or a Coordinators message) named every coordinator sharing the store, the
    leader first (empty: one): store a new list (node.json, journal) for the next round of
    dials (agent/control_address.py)."""

    addresses: tuple[str, ...]


@attrs.frozen
class WaitingInLine:
    """The coordinator put this Connect in line (a storm): the Welcome is awaited ``deadline_s``."""

    wait_s: float
    deadline_s: float
    sentence: str


@attrs.frozen
class Close:
    """End the session; the daemon reconnects with backoff. ``reason`` is a sentence."""

    reason: str


Effect = (
    Send
    | DropReport
    | HandleCommand
    | Connected
    | HeartbeatAcked
    | LogAcked
    | StoreCredential
    | AdoptControlAddress
    | AdoptCoordinators
    | WaitingInLine
    | Close
)


class SessionError(Exception):
    """The session core was driven out of order (a bug in the shell, not the peer)."""


@attrs.define
class ControlSession:
    """One Connect stream's protocol state. A new stream gets a new session."""

    node_id: str
    agent_version: str
    # The control address this session's stream was dialed at (said in Hello).
    dialed_address: str = ""
    # Where this Node serves its ended members' outputs (said in Hello); None when it does not.
    outputs: m.OutputsService | None = None
    phase: Phase = Phase.IDLE
    heartbeat_interval_s: float = 0.0
    heartbeat_timeout_s: float = WELCOME_TIMEOUT_S
    last_heard: float = 0.0
    next_beat_at: float = float("inf")
    beat_seq: int = 0
    # When heartbeat ``beat_seq`` was sent (monotonic): its acknowledgement gives the RTT.
    beat_sent_at: float = 0.0
    inventory_sent: Inventory | None = None
    # Which reports this stream carried and when; which wait for their publish.
    reports: ReportBook = attrs.field(factory=ReportBook)
    # Where in the renewal window (uniform in [0, 1)) this Node asks; chosen by the shell.
    renewal_jitter: float = 0.5
    credential_issued_at_ms: int = 0
    credential_expires_at_ms: int = 0
    # The outstanding CredentialRenewal: its request id and when it was sent (monotonic).
    renewal_request: int = 0
    renewal_sent_at: float = 0.0
    renewal_seq: int = 0
    # What the coordinator's Welcome announced: what this session may send it.
    coordinator_capabilities: frozenset[str] = frozenset()

    def start(
        self,
        now: float,
        inventory: Inventory,
        held: Sequence[tuple[MemberKey, MemberState]],
    ) -> list[Effect]:
        """Open the session: say Hello with the inventory and the members this Node holds."""
        if self.phase is not Phase.IDLE:
            raise SessionError(f"start() called in phase {self.phase.value}")
        self.phase = Phase.HELLO_SENT
        self.last_heard = now
        self.inventory_sent = inventory
        hello = m.Hello(
            self.node_id,
            self.agent_version,
            inventory,
            tuple(held),
            self.dialed_address,
            self.outputs,
            protocol.PROTOCOL,
            protocol.AGENT_CAPABILITIES,
        )
        return [Send(hello)]

    def receive(
        self,
        now: float,
        message: m.Incoming,
        pending: Sequence[PendingReport] = (),
        undecided: Sequence[MemberKey] = (),
    ) -> list[Effect]:
        """React to one coordinator message.

        ``pending`` (unacknowledged reports, oldest first) and ``undecided`` (prepared members
        with no decision) are read from the journal by the shell; they matter only for Welcome.
        """
        if self.phase is Phase.CLOSED:
            return []
        self.last_heard = now
        if isinstance(message, m.Queued):
            return self._queued(message) if self.phase is Phase.HELLO_SENT else []
        if self.phase is Phase.HELLO_SENT:
            if not isinstance(message, m.Welcome):
                return self._close(
                    f"the coordinator sent {type(message).__name__} before Welcome; "
                    "reconnecting to start the session again"
                )
            return self._welcome(now, message, pending, undecided)
        if isinstance(message, m.Welcome):
            # A repeated Welcome only updates the timing and addresses; nothing is replayed twice.
            self._timing(message)
            return [*_announced(message.control_address), AdoptCoordinators(message.coordinators)]
        if isinstance(message, m.ControlAddress):
            return _announced(message.address)
        if isinstance(message, m.Coordinators):
            return [AdoptCoordinators(message.addresses)]
        if isinstance(message, m.HeartbeatAck):
            latest = message.seq == self.beat_seq and self.beat_seq > 0
            return [HeartbeatAcked(message.seq, now - self.beat_sent_at if latest else None)]
        if isinstance(message, m.ReportAck):
            self.reports.acked(message.report_seq, now)
            return [DropReport(message.report_seq, message.refused)]
        if isinstance(message, m.LogAck):
            return [LogAcked(message)]
        if isinstance(message, m.CredentialIssued):
            if not self.renewal_request or message.request_id != self.renewal_request:
                return []  # an answer to a request this session did not make, or a repeat
            return [StoreCredential(message)]
        return [HandleCommand(message)]

    def credential_stored(self, issued: m.CredentialIssued) -> list[Effect]:
        """The shell stored ``issued`` durably and uses it: tell the coordinator."""
        if issued.request_id != self.renewal_request:
            return []
        self.renewal_request = 0
        self.credential_issued_at_ms = issued.issued_at_ms
        self.credential_expires_at_ms = issued.expires_at_ms
        if self.phase is not Phase.OPEN:
            return []  # the next Connect, made with the new credential, confirms it instead
        return [Send(m.CredentialStored(issued.request_id))]

    def renewal_due_ms(self) -> int | None:
        """When this session asks for a successor (epoch ms); None: never (no lifetime stated)."""
        return renewal_at_ms(
            self.credential_issued_at_ms, self.credential_expires_at_ms, self.renewal_jitter
        )

    def _queued(self, queued: m.Queued) -> list[Effect]:
        deadline = welcome_timeout_in_line(queued.wait_s, WELCOME_TIMEOUT_S)
        self.heartbeat_timeout_s = deadline
        return [WaitingInLine(queued.wait_s, deadline, queued.sentence)]

    def _timing(self, welcome: m.Welcome) -> None:
        # A coordinator that sends zeros gets sane floors rather than a busy loop.
        self.heartbeat_interval_s = max(welcome.heartbeat_interval_ms, 50) / 1000
        self.heartbeat_timeout_s = max(
            welcome.heartbeat_timeout_ms / 1000, 2 * self.heartbeat_interval_s
        )

    def _welcome(
        self,
        now: float,
        welcome: m.Welcome,
        pending: Sequence[PendingReport],
        undecided: Sequence[MemberKey],
    ) -> list[Effect]:
        self._timing(welcome)
        self.phase = Phase.OPEN
        self.next_beat_at = now + self.heartbeat_interval_s
        self.credential_issued_at_ms = welcome.credential_issued_at_ms
        self.credential_expires_at_ms = welcome.credential_expires_at_ms
        coordinator = protocol.Peer.said(
            welcome.coordinator_version, welcome.protocol, list(welcome.capabilities)
        )
        self.coordinator_capabilities = frozenset(welcome.capabilities)
        effects: list[Effect] = [
            Connected(
                self.heartbeat_interval_s,
                self.heartbeat_timeout_s,
                welcome.credential_issued_at_ms,
                welcome.credential_expires_at_ms,
                welcome.server_time_ms,
                coordinator,
                protocol.coordinator_warning(coordinator, self.agent_version) or "",
            )
        ]
        effects.extend(_announced(welcome.control_address))
        effects.append(AdoptCoordinators(welcome.coordinators))
        effects.extend(Send(m.Report(report)) for report in self.reports.replay(now, pending))
        effects.extend(Send(m.DecisionQuery(key)) for key in undecided)
        return effects

    def outgoing(self, message: m.Outgoing, now: float = 0.0) -> list[Effect]:
        """A report or reply produced by the member manager: sent now if the session is open.

        When it is not, nothing is lost: reports stay in the journal and are replayed after the
        next Welcome (or a tick sends them), and the coordinator repeats an unanswered Prepare. A
        report this stream carried within the timeout (at Welcome) is not sent again.
        """
        if self.phase is not Phase.OPEN:
            return []
        if (
            isinstance(message, m.PrepareProgress)
            and protocol.Capability.PREPARE_PROGRESS not in self.coordinator_capabilities
        ):
            return []  # an older coordinator has no use for it (Prepared still comes)
        if isinstance(message, m.Report) and not self.reports.publish(
            message.report.report_seq, now, self.heartbeat_timeout_s
        ):
            return []
        return [Send(message)]

    def tick(
        self,
        now: float,
        wall_ms: int,
        inventory: Inventory,
        pending: Sequence[PendingReport] = (),
    ) -> list[Effect]:
        """Time passed: close a silent session, send the heartbeat that is due, and send the
        unacknowledged reports (``pending``, from the journal) that are due (session_reports)."""
        if self.phase in (Phase.IDLE, Phase.CLOSED):
            return []
        silent = now - self.last_heard
        if silent >= self.heartbeat_timeout_s:
            what = "no Welcome" if self.phase is Phase.HELLO_SENT else "nothing"
            return self._close(
                f"heard {what} from the coordinator for {silent:.1f} s "
                f"(timeout {self.heartbeat_timeout_s:.1f} s); reconnecting"
            )
        effects: list[Effect] = []
        if self.phase is Phase.OPEN and now >= self.next_beat_at:
            self.beat_seq += 1
            changed = inventory if inventory != self.inventory_sent else None
            self.inventory_sent = inventory
            # Schedule from now, not from the missed slot: a stalled loop sends one beat, not many.
            self.next_beat_at = now + self.heartbeat_interval_s
            self.beat_sent_at = now
            effects.append(Send(m.Heartbeat(self.beat_seq, wall_ms, changed)))
        if self.phase is Phase.OPEN:
            due = self.reports.due(now, pending, self.heartbeat_timeout_s)
            effects.extend(Send(m.Report(report)) for report in due)
            effects.extend(self._renewal(now, wall_ms))
        return effects

    def _renewal(self, now: float, wall_ms: int) -> list[Effect]:
        """Ask for a successor once due; ask again if no answer came within the timeout."""
        due = self.renewal_due_ms()
        if due is None or wall_ms < due:
            return []
        if self.renewal_request and now - self.renewal_sent_at < self.heartbeat_timeout_s:
            return []
        self.renewal_seq += 1
        self.renewal_request = self.renewal_seq
        self.renewal_sent_at = now
        return [Send(m.CredentialRenewal(self.renewal_request))]

    def stream_ended(self) -> list[Effect]:
        """The coordinator ended the stream (or it broke)."""
        if self.phase is Phase.CLOSED:
            return []
        return self._close("the coordinator ended the control stream")

    def next_deadline(self) -> float:
        """The monotonic time at which :meth:`tick` must next be called."""
        if self.phase in (Phase.IDLE, Phase.CLOSED):
            return float("inf")
        silent_at = self.last_heard + self.heartbeat_timeout_s
        if self.phase is not Phase.OPEN:
            return silent_at
        return min(silent_at, self.next_beat_at, self.reports.next_deadline())

    def _close(self, reason: str) -> list[Effect]:
        self.phase = Phase.CLOSED
        return [Close(reason)]


def _announced(address: str) -> list[Effect]:
    """A control address the coordinator named, for the shell to store; none when empty."""
    return [AdoptControlAddress(address)] if address else []
