"""The ``tuneplane-node run`` daemon: journal, replay, then the connect/reconnect loop.

Rules:
- One nursery owns every task: the command worker, the inventory and status loops, member
  watchers and the control session. Cancelling it (SIGTERM/SIGINT) stops the agent and never
  touches a member: runners live in their own sessions and the journal remembers them.
- Effects from the session core run in order: journal, then network, then processes.
- A journal that fails its integrity check puts the agent in SAFE MODE: it connects, refuses every
  Prepare with the reason, touches no workload and says so in logs and the status file.
- GPU health is what the probe found plus the XID book (agent/xid_book.py): XIDs drained from
  NVML are journaled before the inventory that reflects them is made current (so before it is
  sent), and every refresh reads the book back, so an operator's ``gpu clear`` takes effect at
  the next refresh. Launch asks for a refresh of its own (MemberManager re-checks on it).
- The outputs listener (agent/outputs_server.py), bound before the run so a taken port stops
  the agent at start, is served in the same nursery; every Hello says where it is.
- The control credential is read from the state directory before every Connect (so a
  re-enrolment takes effect without a restart). A rotation stores the successor durably
  (``control.token.next``, then a rename) before saying CredentialStored; crash points
  ``after-credential-issued``, ``after-next-credential-stored``, ``after-credential-swapped`` and
  ``after-credential-confirmed`` sit between the steps.
"""

from __future__ import annotations

import logging
import os
import random
import signal
from pathlib import Path
from typing import Any

import attrs
import trio

from tuneplane.collector.files import DEFAULT_MAX_FILES
from tuneplane.collector.system_sampler import DEFAULT_INTERVAL_S as SYSTEM_INTERVAL_S

from . import control_address
from . import messages as m
from .adapter import open_aio_host
from .atomic_file import write_json_atomic
from .collectors import COLLECTORS_DIR, CollectorSupervisor
from .config import WorkloadPolicy
from .crashpoint import crashpoint
from .inventory import Inventory, InventoryError
from .inventory_source import InventorySource, probe
from .journal import Journal
from .journal_owner import open_node_journal
from .journal_records import (
    AGENT_FAILED,
    AGENT_STOPPED,
    CONTROL_ADDRESS_CHANGED,
    JournalCorrupt,
    MemberKey,
    PendingReport,
)
from .logship import LogShipper
from .member_state import MemberState
from .members import MemberManager
from .members_base import now_ms
from .metrics import CONNECTED as METRIC_CONNECTED
from .metrics import CREDENTIAL_EXPIRY as METRIC_CREDENTIAL_EXPIRY
from .metrics import (
    HEARTBEAT_RTT,
    JOURNAL_COMMIT,
    RECONNECTS,
    SNAPSHOT_INTERVAL_S,
    refresh_snapshot,
)
from .outputs_server import Bound as OutputsBound
from .outputs_server import OutputsServer
from .prepare import node_address
from .rendezvous import advertised_address
from .sd_notify import ServiceNotifier
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
from .state_dir import CredentialLife, NodeConfig, StateDir, StateDirError
from .wire import CoordinatorUnreachable, Endpoint, UnknownMessage, WireError
from .wire_control import ControlStream, control_refusal, open_control_stream
from .xid_book import judge

log = logging.getLogger(__name__)

AGENT_VERSION = "0.1.0"
INVENTORY_INTERVAL_S = 30.0
STATUS_INTERVAL_S = 1.0
#: How often a reconnect backoff looks for a credential replaced by a re-enrolment.
CREDENTIAL_POLL_S = 0.5
COMMAND_QUEUE = 256


class SessionClosed(Exception):
    """The control session ended; the connect loop reconnects with backoff."""


@attrs.define(eq=False)
class Status:
    """What ``tuneplane-node status`` shows; written atomically to status.json."""

    pid: int
    node_id: str
    coordinator: str
    started_at_ms: int
    connected: bool = False
    last_connected_ms: int | None = None
    last_heartbeat_ack_ms: int | None = None
    last_error: str = ""
    reconnects: int = 0
    safe_mode: bool = False
    safe_mode_reason: str = ""
    inventory: dict[str, Any] = attrs.field(factory=dict)
    # The control credential's lifetime as the coordinator last stated it (never its value).
    credential_issued_at_ms: int = 0
    credential_expires_at_ms: int = 0
    credential_renewal_at_ms: int = 0
    # The coordinator's clock minus this host's at the last Welcome (for doctor), and when.
    clock_skew_ms: int | None = None
    clock_skew_at_ms: int | None = None
    # Where members' work directories and outputs go (doctor measures free space there).
    work_root: str = ""
    out_root: str = ""
    # Where the Prometheus listener ([metrics] in node.toml) serves; "" when it is off.
    metrics_address: str = ""
    # Where the outputs listener ([outputs] in node.toml) is bound and what Hello advertises;
    # "" when it is off.
    outputs_listen: str = ""
    outputs_address: str = ""


def _inventory_summary(inv: Inventory) -> dict[str, Any]:
    return {
        "hostname": inv.hostname,
        "gpu_source": inv.gpu_source,
        "note": inv.note,
        "problem": inv.problem,
        "xid_events": inv.xid_events,
        "released_until_ms": inv.released_until_ms,
        "driver_version": inv.driver_version,
        "cuda_version": inv.cuda_version,
        "cpu_count": inv.cpu_count,
        "memory_bytes": inv.memory_bytes,
        "gpus": [attrs.asdict(g) for g in inv.gpus],
    }


class Daemon:
    def __init__(
        self,
        state: StateDir,
        node: NodeConfig,
        credential: str,
        source: InventorySource,
        out_root: Path,
        *,
        work_root: Path,
        policy: WorkloadPolicy,
        inventory_interval_s: float = INVENTORY_INTERVAL_S,
        system_interval_s: float = SYSTEM_INTERVAL_S,
        telemetry_max_files: int = DEFAULT_MAX_FILES,
        outputs: OutputsBound | None = None,
    ) -> None:
        self.state = state
        self.node = node
        self.credential = credential
        self.source = source
        self.out_root = out_root
        self.work_root = work_root
        self.policy = policy
        self.inventory_interval_s = inventory_interval_s
        # Seconds between each member's GPU and process samples (node.toml [telemetry]).
        self.system_interval_s = system_interval_s
        # The most telemetry files one member's collector follows (node.toml [telemetry]).
        self.telemetry_max_files = telemetry_max_files
        # The outputs listener's bound socket (None: node.toml turns it off).
        self.outputs = outputs
        self._inventory_lock = trio.Lock()
        self.endpoint = Endpoint.parse(node.coordinator)
        self.ca_path = Path(node.ca)
        # A hung NVML at start-up reads "NVML unresponsive" instead of holding the agent.
        self.inventory = source.collect_within()
        self.status = Status(os.getpid(), node.node_id, node.coordinator, now_ms())
        self.status.inventory = _inventory_summary(self.inventory)
        self.status.work_root, self.status.out_root = str(work_root), str(out_root)
        if outputs is not None:
            self.status.outputs_listen = outputs.listen_address()
        # Read at scrape time, from the listener's thread: two plain attributes.
        METRIC_CONNECTED.set_function(lambda: float(self.status.connected))
        METRIC_CREDENTIAL_EXPIRY.set_function(lambda: self.status.credential_expires_at_ms / 1000)
        self.journal: Journal | None = None
        self.manager: MemberManager | None = None
        self.logship: LogShipper | None = None
        self.collectors: CollectorSupervisor | None = None
        self._session: ControlSession | None = None
        self._stream: ControlStream | None = None
        self._wake = trio.Event()
        self._welcomed = False
        # Where this Node renews in each credential's window: fixed per process, so a Fleet
        # spreads out and one Node does not wander.
        self._renewal_jitter = random.random()
        self._commands_send, self._commands_recv = trio.open_memory_channel[m.MemberCommand](
            COMMAND_QUEUE
        )
        # Set once the journal is replayed and live members re-attached (or safe mode entered),
        # right before the first connect: what READY=1 to systemd waits for (run_daemon).
        self.ready = trio.Event()

    # --- main --------------------------------------------------------------------------------

    async def run(self) -> None:
        """Run until cancelled. Members are left exactly as they are when it returns."""
        async with open_aio_host():
            try:
                self.journal = await open_node_journal(
                    self.state.journal_path, self.node.node_id, now_ms()
                )
            except JournalCorrupt as exc:
                self.status.safe_mode = True
                self.status.safe_mode_reason = (
                    f"{exc} The agent is in SAFE MODE: it refuses new members and touches no "
                    "running workload. Move the journal aside and run `tuneplane-node doctor`."
                )
                log.critical("safe mode reason=%s", self.status.safe_mode_reason)
            ended_by: BaseException | None = None
            try:
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(self._status_loop)
                    if self.outputs is not None:
                        server = OutputsServer(
                            self.outputs, self.journal.member if self.journal else None
                        )
                        await nursery.start(server.serve)
                    if self.journal is not None:
                        self.journal.on_commit = JOURNAL_COMMIT.observe
                    if self.status.metrics_address:
                        nursery.start_soon(self._metrics_loop)
                    if self.journal is not None:
                        self.manager = MemberManager(
                            self.journal, self.state.members_dir, self.out_root,
                            lambda: self.inventory, self._node_address, self.publish, nursery,
                            work_root=self.work_root, policy=self.policy,
                            refresh=self.refresh_inventory, node_id=self.node.node_id,
                        )  # fmt: skip
                        previous = await self.journal.record_start(
                            now_ms(), version=AGENT_VERSION, pid=os.getpid(),
                            state_dir=str(self.state.root),
                        )  # fmt: skip
                        log.log(
                            logging.WARNING if previous.how == "unclean" else logging.INFO,
                            "agent started pid=%d previous_stop=%s reason=%s", os.getpid(),
                            previous.how, previous.sentence(),
                        )  # fmt: skip
                        # XIDs and clears journaled before this start apply before anything is
                        # sent or launched; members an older agent prepared get their UUIDs.
                        await self.refresh_inventory()
                        await self.journal.fill_member_uuids(self.inventory, now_ms())
                        await self.manager.replay()
                        self.logship = LogShipper(self.journal, self.publish)
                        nursery.start_soon(self.logship.run)
                        self.collectors = CollectorSupervisor.under(
                            self.state.root, self.journal, self.ca_path,
                            system_interval_s=self.system_interval_s,
                            sample_gpus=self.source.gpu_source != "simulated",
                            scripted_nvml=self.source.scripted_nvml,
                            gpu_release_file=self.source.release_request,
                            max_files=self.telemetry_max_files,
                        )  # fmt: skip
                        nursery.start_soon(self.collectors.run)
                    nursery.start_soon(self._command_worker)
                    nursery.start_soon(self._inventory_loop)
                    self.ready.set()
                    await self._connect_loop()
            except BaseException as exc:
                ended_by = exc
                raise
            finally:
                if self.outputs is not None:
                    self.outputs.sock.close()
                with trio.CancelScope(shield=True):
                    self.status.connected = False
                    self._write_status()
                    if self.journal is not None:
                        # Only an orderly stop writes the marker the next start looks for; an
                        # error leaves its own event, so the next start reads the run as unclean.
                        if _orderly(ended_by):
                            await self.journal.node_event(
                                now_ms(), AGENT_STOPPED, "orderly stop", pid=os.getpid()
                            )
                        else:
                            await self.journal.node_event(
                                now_ms(), AGENT_FAILED, f"{type(ended_by).__name__}: {ended_by}",
                                pid=os.getpid(),
                            )  # fmt: skip
                        await self.journal.close()
                log.info("agent stopped node_id=%s", self.node.node_id)

    def _node_address(self) -> str:
        return node_address(self.endpoint.host, self.endpoint.port)

    def _outputs_service(self) -> m.OutputsService | None:
        """What this session's Hello says of the outputs listener (None when it is off): the
        advertised host, else this Node's own address as the rendezvous uses it."""
        if self.outputs is None:
            return None
        service = self.outputs.service(advertised_address(self._node_address()))
        self.status.outputs_address = service.address
        return service

    # --- background loops --------------------------------------------------------------------

    async def _command_worker(self) -> None:
        async for command in self._commands_recv:
            if self.manager is None:
                await self._refuse_in_safe_mode(command)
                continue
            if isinstance(command, m.Commit) and self.collectors is not None:
                # Before the Commit is journaled: a member that runs has its credential on disk.
                await self.collectors.accept_commit(command)
            await self.manager.handle(command)

    async def _refuse_in_safe_mode(self, command: m.MemberCommand) -> None:
        if isinstance(command, m.Prepare):
            reason = (
                "This Node's journal failed its integrity check (safe mode); it accepts no new "
                "members until an operator repairs it."
            )
            await self.publish(m.PrepareReply(command.key, False, reason, None))
        else:
            log.warning("safe mode ignores command=%s member=%s", type(command).__name__,
                        command.key)  # fmt: skip

    async def _inventory_loop(self) -> None:
        while True:
            await trio.sleep(self.inventory_interval_s)
            await self.refresh_inventory()

    async def _probe(self) -> Inventory:
        """What the GPUs say now. A read that fails marks every known GPU unhealthy with why."""
        try:
            return await probe(self.source)
        except InventoryError as exc:
            log.error("inventory refresh failed reason=%s", exc)
            reason = str(exc)
            return attrs.evolve(
                self.inventory,
                gpus=tuple(
                    attrs.evolve(g, healthy=False, health_reason=reason)
                    for g in self.inventory.gpus
                ),
            )

    async def refresh_inventory(self) -> Inventory:
        """Probe, journal the XIDs NVML reported, apply the XID book, and make that current.

        The XIDs (and any recovery-action change) are committed to the journal before the
        inventory that reflects them replaces the current one, so nothing the coordinator is
        told about a GPU is missing from the journal after a crash.
        """
        async with self._inventory_lock:
            probed = await self._probe()
            inventory = probed
            if self.journal is not None:
                drained = self.source.take_xid_events()
                written = await self.journal.record_xids(
                    [judge(e.uuid, e.xid, e.at_ms) for e in drained]
                )
                for x in written:
                    log.warning("gpu xid journaled gpu_uuid=%s xid=%d application=%s",
                                x.uuid or "unidentified", x.xid, x.application)  # fmt: skip
                if written:
                    crashpoint("after-xid-journaled")
                book = await self.journal.xid_book()
                changes = book.observe(probed, now_ms())
                if changes:
                    await self.journal.record_health_events(changes)
                    for c in changes:
                        log.warning("gpu health event gpu_uuid=%s kind=%s reason=%s", c.uuid,
                                    c.kind, c.reason)  # fmt: skip
                    book = await self.journal.xid_book()
                inventory = book.apply(probed)
            if inventory != self.inventory:
                log.info("inventory changed gpus=%d source=%s unhealthy=%d", len(inventory.gpus),
                         inventory.gpu_source,
                         sum(not g.healthy for g in inventory.gpus))  # fmt: skip
                self.inventory = inventory
                self.status.inventory = _inventory_summary(inventory)
            return inventory

    async def _status_loop(self) -> None:
        while True:
            self._write_status()
            await trio.sleep(STATUS_INTERVAL_S)

    def _write_status(self) -> None:
        data = attrs.asdict(self.status)
        data["updated_at_ms"] = now_ms()
        write_json_atomic(self.state.status_path, data)

    async def _metrics_loop(self) -> None:
        """Refresh what the metrics listener serves, while it is on (agent/metrics.py)."""
        while True:
            await refresh_snapshot(self.journal, self.inventory, self.state.root / COLLECTORS_DIR)
            await trio.sleep(SNAPSHOT_INTERVAL_S)

    # --- connection --------------------------------------------------------------------------

    async def _connect_loop(self) -> None:
        failures = 0
        while True:
            self._welcomed = False
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
                self._session = None
                self._stream = None
                if self.status.connected:
                    self.status.connected = False
                    self._write_status()
            if isinstance(ended, CoordinatorUnreachable) and not self._welcomed:
                # A refused Connect can reach us as a bare stream reset; ask once more in a way
                # that always returns the coordinator's sentence (revoked, expired, unknown).
                refusal = await control_refusal(self.endpoint, self.ca_path, self.credential)
                if refusal is not None:
                    self._session_ended(refusal)
            # A session that got as far as Welcome starts the backoff over.
            failures = 1 if self._welcomed else failures + 1
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
            renewal_jitter=self._renewal_jitter,
        )
        self._session, self._stream = session, stream
        await self._execute(session.start(trio.current_time(), self.inventory,
                                          await self._held()))  # fmt: skip
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self._receive_loop, session, stream)
            while True:
                with trio.move_on_at(session.next_deadline()):
                    await self._wake.wait()
                self._wake = trio.Event()
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
            self._wake.set()

    async def _execute(self, effects: list[Effect]) -> None:
        """Carry out session effects in order; Close raises :class:`SessionClosed`."""
        for effect in effects:
            if isinstance(effect, Send):
                assert self._stream is not None
                await self._stream.send(effect.message)
                if isinstance(effect.message, m.Report):
                    crashpoint("after-report-sent")
            elif isinstance(effect, DropReport):
                if effect.refused:
                    log.warning("report refused by the coordinator seq=%d reason=%s",
                                effect.report_seq, effect.refused)  # fmt: skip
                if self.journal is not None:
                    await self.journal.ack_report(effect.report_seq, effect.refused, now_ms())
            elif isinstance(effect, HandleCommand):
                await self._commands_send.send(effect.command)
            elif isinstance(effect, Connected):
                self._welcomed = True
                self.status.connected = True
                self.status.last_connected_ms = now_ms()
                self.status.last_error = ""
                if effect.server_time_ms:
                    self.status.clock_skew_ms = effect.server_time_ms - now_ms()
                    self.status.clock_skew_at_ms = now_ms()
                self._write_status()
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
        session = self._session
        if session is not None:
            await self._execute(session.credential_stored(issued))
        crashpoint("after-credential-confirmed")

    def _credential_life(self, issued_at_ms: int, expires_at_ms: int) -> None:
        """Remember what the coordinator said about the credential's lifetime (status, doctor)."""
        if expires_at_ms:
            self.state.save_credential_life(CredentialLife(issued_at_ms, expires_at_ms))
        self.status.credential_issued_at_ms = issued_at_ms
        self.status.credential_expires_at_ms = expires_at_ms
        due = self._session.renewal_due_ms() if self._session is not None else None
        self.status.credential_renewal_at_ms = due or 0

    async def publish(self, message: m.Outgoing) -> None:
        """Send a manager's reply or report now if a session is open, else drop it.

        Nothing is lost by dropping: reports stay in the journal until acknowledged and are
        replayed after the next Welcome; the coordinator repeats an unanswered Prepare.
        """
        session, stream = self._session, self._stream
        if session is None or stream is None:
            return
        try:
            for effect in session.outgoing(message, trio.current_time()):
                await self._execute([effect])
        except WireError as exc:
            # The receive loop sees the same broken stream and closes the session.
            log.warning("send failed message=%s reason=%s", type(message).__name__, exc)


def _orderly(ended_by: BaseException | None) -> bool:
    """Whether the daemon stopped because it was told to (cancelled by SIGTERM/SIGINT)."""
    if ended_by is None:
        return True
    if isinstance(ended_by, BaseExceptionGroup):
        return all(_orderly(e) for e in ended_by.exceptions)
    return isinstance(ended_by, trio.Cancelled | KeyboardInterrupt)


def service_status(status: Status) -> str:
    """The one-line status ``systemctl status tuneplane-node`` shows (pure)."""
    if status.safe_mode:
        return "SAFE MODE: refusing new members, touching no workload (tuneplane-node status)"
    if status.connected:
        return f"connected to {status.coordinator}"
    return f"not connected to {status.coordinator}, retrying ({status.reconnects} reconnects)"


async def _tell_service_manager(daemon: Daemon, notifier: ServiceNotifier) -> None:
    """READY=1 once the journal is replayed, then the status line whenever it changes."""
    await daemon.ready.wait()
    line = service_status(daemon.status)
    notifier.ready(f"journal replayed; {line}")
    while True:
        await trio.sleep(STATUS_INTERVAL_S)
        now = service_status(daemon.status)
        if now != line:
            line = now
            notifier.status(line)


async def run_daemon(daemon: Daemon, notifier: ServiceNotifier | None = None) -> None:
    """Run ``daemon`` until SIGTERM or SIGINT, then stop cleanly without touching members.
    ``notifier`` tells systemd (Type=notify) when it is ready, that it lives and that it stops."""
    notifier = notifier or ServiceNotifier()
    async with trio.open_nursery() as nursery:

        async def on_signal() -> None:
            with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
                async for signum in signals:
                    log.info("stopping on signal signal=%s; members keep running",
                             signal.Signals(signum).name)  # fmt: skip
                    notifier.stopping("stopping; members keep running")
                    nursery.cancel_scope.cancel()
                    return

        nursery.start_soon(on_signal)
        # From the start, not from READY: systemd arms the watchdog when it starts the process.
        nursery.start_soon(notifier.keep_watchdog)
        nursery.start_soon(_tell_service_manager, daemon, notifier)
        await daemon.run()
        nursery.cancel_scope.cancel()
