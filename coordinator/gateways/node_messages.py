"""What the coordinator does with each message a Node sends on its Connect stream after Hello.

Rules:
- Every Heartbeat and every MemberReport is acked. A Heartbeat is acked from memory, on the
  stream it came on (:mod:`~tuneplane.coordinator.gateways.heartbeats` stores the times in
  batches); only an inventory change it carries is written before the ack. A plain one (no
  inventory) reaches :meth:`NodeMessages.heartbeat` read by its layout, never decoded
  (:mod:`~tuneplane.coordinator.gateways.heartbeat_layout`).
- A report is applied only as a move its member's lifecycle allows on this Node
  (:func:`~tuneplane.coordinator.lifecycle.judge_report`); a refused one is acked with the
  sentence in ``ReportAck.refused`` and changes nothing; an early one (it overtook a report before
  it) is not acked, so the Node sends it again.
- A member declared lost (:mod:`~tuneplane.coordinator.node_loss`) gets its stop, never the Commit
  its attempt recorded, when its Node asks about it with DecisionQuery.
- Commit orders carry a fresh collector credential, recorded before they are sent; Prepare orders
  whose source is on another Node carry a fresh fetch grant.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import betterproto

from tuneplane.agent.crashpoint import crashpoint
from tuneplane.proto import v1

from ..clock import now_ms
from ..preparations import PreparationBook
from ..store.core import Store
from ..store.lifecycle import stop_siblings
from ..store.logs import LogStore
from ..store.lost_nodes import declared_lost_order
from ..values.jobs import ImagePreparation
from ..values.orders import AbortOrder, CommitOrder, Order
from ..wire.control import inventory_from_wire, report_from_wire
from ..wire.members import member_key
from . import outputs_grants
from .collector_credentials import CollectorCredentials
from .heartbeat_layout import heartbeat_ack
from .heartbeats import HeartbeatBook
from .logship import receive_chunk
from .node_credentials import NodeCredentials
from .sessions import NodeSession, SessionRegistry

log = logging.getLogger(__name__)


class NodeMessages:
    """Handles the messages of every Node's control stream, one at a time per stream."""

    def __init__(
        self,
        store: Store,
        registry: SessionRegistry,
        wake_scheduler: Callable[[], None],
        heartbeats: HeartbeatBook,
        credentials: NodeCredentials,
        collectors: CollectorCredentials | None,
        logs: LogStore | None,
        preparations: PreparationBook | None = None,
    ) -> None:
        self._store = store
        # Where a preparing member's image progress waits for GetJob (in memory only).
        self._preparations = preparations
        self._registry = registry
        self._wake = wake_scheduler
        self._heartbeats = heartbeats
        self._credentials = credentials
        self._collectors = collectors
        self._logs = logs

    async def with_credentials(self, orders: list[Order]) -> list[Order]:
        """Commit orders carry a fresh collector credential, recorded before they are sent;
        Prepare orders whose source is on another Node carry a fresh fetch grant."""
        orders = await outputs_grants.attach(self._store, orders, now_ms())
        if self._collectors is None:
            return orders
        return await self._collectors.attach(orders, now_ms())

    def heartbeat(self, session: NodeSession, seq: int, now: int) -> None:
        """Heartbeat ``seq`` heard on ``session`` at ``now``: acked at once on that stream. The
        time waits in memory for the next batch (which renews collector credentials too): no
        store round trip delays the ack. An expired credential closes the stream instead."""
        if self._credentials.expired(session.node_id, now):
            session.close(
                "this stream's control credential expired; the Node must renew before "
                "expiry or be re-enrolled with a new join token"
            )
            return
        self._heartbeats.record(session.node_id, now)
        session.send(heartbeat_ack(seq))

    async def handle(self, session: NodeSession, message: v1.NodeMessage) -> None:
        """Carry out one message of ``session``'s stream: store first, then ack or orders."""
        node_id = session.node_id
        kind, body = betterproto.which_one_of(message, "body")
        now = now_ms()
        if isinstance(body, v1.Heartbeat):
            inventory = betterproto.serialized_on_wire(body.inventory)
            if inventory and not self._credentials.expired(node_id, now):
                # An inventory change is what placement reads: stored before the ack.
                await self._store.node_inventory(node_id, inventory_from_wire(body.inventory), now)
                self._wake()
            self.heartbeat(session, body.seq, now)
        elif isinstance(body, v1.MemberReport):
            await self._report(node_id, body, now)
        elif isinstance(body, v1.LogChunk):
            if self._logs is not None:
                ack = await receive_chunk(self._store, self._logs, node_id, body, now)
                self._registry.send(node_id, v1.CoordinatorMessage(log_ack=ack))
        elif isinstance(body, v1.PrepareReply):
            rendezvous = body.rendezvous or v1.Rendezvous()
            orders = await self._store.record_prepare_reply(
                node_id,
                member_key(body.member),
                body.ok,
                body.reason,
                rendezvous.master_addr,
                rendezvous.master_port,
                now,
                rendezvous_held=body.rendezvous_held,
            )
            if any(isinstance(o, CommitOrder) for o in orders):
                crashpoint("after-commit-decided")
            if any(isinstance(o, AbortOrder) for o in orders):
                crashpoint("after-abort-decided")
            self._registry.dispatch(await self.with_credentials(orders))
            if any(isinstance(o, AbortOrder) for o in orders):
                self._wake()
        elif isinstance(body, v1.PrepareProgress):
            # Shown by GetJob only for a member its Job places on this very Node.
            if self._preparations is not None:
                self._preparations.record(
                    node_id,
                    member_key(body.member),
                    ImagePreparation(
                        body.image[:512], body.bytes_done, body.bytes_total, body.layers_done,
                        body.layers_total, body.phase[:32], now,
                    ),
                )  # fmt: skip
        elif isinstance(body, v1.DecisionQuery):
            # A member declared lost gets its stop, never the Commit its attempt recorded.
            key = member_key(body.member)
            order: Order | None = await declared_lost_order(self._store, node_id, key)
            if order is None:
                order = await self._store.decision_for(node_id, key)
            if order is not None:
                self._registry.dispatch(await self.with_credentials([order]))
        elif isinstance(body, v1.CredentialRenewal):
            await self._credentials.renew(node_id, body.request_id, now)
        elif isinstance(body, v1.CredentialStored):
            await self._credentials.stored(node_id, body.request_id, now)
        else:
            log.warning("unexpected message on control stream node=%s kind=%s", node_id, kind)

    async def _report(self, node_id: str, body: v1.MemberReport, now: int) -> None:
        """Apply a MemberReport as its member's lifecycle allows, then ack it (unless early)."""
        report = report_from_wire(body)
        outcome = await self._store.apply_report(node_id, report, now)
        if outcome.early:
            # It overtook a report before it: unacknowledged, the Node sends it again.
            log.info(
                "member report early node=%s journal=%s seq=%d run_id=%s member=%d state=%s",
                node_id, report.journal_id or "-", report.report_seq, report.member.run_id,
                report.member.member_index, report.state,
            )  # fmt: skip
            return
        if outcome.refused:
            log.warning(
                "member report refused node=%s journal=%s seq=%d run_id=%s attempt=%d "
                "member=%d state=%s reason=%s",
                node_id, report.journal_id or "-", report.report_seq, report.member.run_id,
                report.member.attempt, report.member.member_index, report.state,
                outcome.refused,
            )  # fmt: skip
        else:
            log.info(
                "member report node=%s journal=%s seq=%d run_id=%s member=%d state=%s "
                "applied=%s",
                node_id, report.journal_id or "-", report.report_seq, report.member.run_id,
                report.member.member_index, report.state, outcome.applied,
            )  # fmt: skip
        if outcome.applied:
            crashpoint("after-report-applied")
        if self._collectors is not None and outcome.ended:
            # Also for a repeated report: the store may have applied it before a crash.
            await self._collectors.member_ended(report.member, now)
        self._registry.send(
            node_id,
            v1.CoordinatorMessage(
                report_ack=v1.ReportAck(report_seq=body.report_seq, refused=outcome.refused)
            ),
        )
        if outcome.applied:
            self._wake()
        if outcome.ended:
            # Also for a repeat: the first copy may have been applied just before a crash.
            self._registry.dispatch(await stop_siblings(self._store, report.member, now))
