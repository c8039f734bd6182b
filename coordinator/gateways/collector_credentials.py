"""Collector credentials: minted with each Commit, scoped to one member, kept alive by heartbeats.

Rules:
- A credential (``tpc_`` + 32 random bytes) is minted for every Commit order just before it is
  sent, and its sha256 is stored (with the member, the Node and an expiry) before it leaves.
  A repeated Commit carries a fresh one; earlier ones stay valid, each for the same member.
- While the member has not ended, its Node's heartbeats keep extending the expiry
  (:data:`TTL_MS`). When the member reaches a terminal state, its credentials last
  :data:`DRAIN_MS` more, for the collector to deliver what is spooled, then expire for good.
- It opens the telemetry gateway only: the control gateway and the Api refuse it.
- A member of a Slurm attempt gets one when the attempt is submitted; its Fleet's live attempts
  extend it as a Node's heartbeats do, and the end of the Slurm job starts the drain window.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping, Sequence

import attrs

from ..auth import (
    AuthError,
    Principal,
    bearer_token,
    hash_credential,
    new_credential,
)
from ..store.telemetry import TelemetryStore
from ..values.jobs import MemberKey
from ..values.orders import CommitOrder, Order
from ..values.telemetry import CollectorGrant

log = logging.getLogger(__name__)

COLLECTOR_PREFIX = "tpc_"
TTL_MS = 15 * 60 * 1000
# A heartbeat rewrites an expiry only when less than TTL - REFRESH_SLACK is left: one write a
# minute per member instead of one per heartbeat. Heartbeats reach here in batches, one per
# flush interval (heartbeats.py), which must stay well under the slack.
REFRESH_SLACK_MS = 60 * 1000
DRAIN_MS = 60 * 60 * 1000


def is_collector_credential(token: str) -> bool:
    return token.startswith(COLLECTOR_PREFIX)


@attrs.define(eq=False)
class CollectorCredentials:
    """Mints, refreshes and checks collector credentials against the telemetry store.

    ``telemetry_address`` is the gateway's advertised HOST:PORT, set once its listener accepts;
    every Commit carries it so the Node knows where its collector ships.
    ``telemetry_fallbacks`` are the other coordinators' gateways sharing the store (HA): the
    collector tries them in order when ``telemetry_address`` refuses.
    """

    store: TelemetryStore
    telemetry_address: str = ""
    telemetry_fallbacks: tuple[str, ...] = ()

    async def attach(self, orders: list[Order], now: int) -> list[Order]:
        """``orders`` with a fresh, durably recorded credential on every Commit order."""
        minted: list[tuple[str, MemberKey, str]] = []
        out: list[Order] = []
        for order in orders:
            if isinstance(order, CommitOrder):
                token = new_credential(COLLECTOR_PREFIX)
                minted.append((hash_credential(token), order.member, order.node_id))
                order = attrs.evolve(
                    order,
                    collector_credential=token,
                    telemetry_address=self.telemetry_address,
                    telemetry_fallbacks=self.telemetry_fallbacks,
                )
            out.append(order)
        if minted:
            await self.store.issue_credentials(minted, now, TTL_MS)
            for _, member, node_id in minted:
                log.info(
                    "collector credential issued node=%s run_id=%s attempt=%d member=%d",
                    node_id,
                    member.run_id,
                    member.attempt,
                    member.member_index,
                )
        return out

    async def issue_for_slurm(
        self, members: Sequence[MemberKey], fleet: str, now: int
    ) -> list[str]:
        """A fresh, durably recorded credential for each member of a Slurm attempt (before it
        is written where the member's node reads it). Their "Node" is the Fleet
        (:func:`slurm_holder`): :meth:`keep_slurm_alive` extends them while the job lives."""
        tokens = [new_credential(COLLECTOR_PREFIX) for _ in members]
        holder = slurm_holder(fleet)
        grants = [(hash_credential(t), m, holder) for t, m in zip(tokens, members, strict=True)]
        await self.store.issue_credentials(grants, now, TTL_MS)
        log.info("collector credentials issued fleet=%s members=%d", fleet, len(members))
        return tokens

    async def keep_slurm_alive(self, fleets: Iterable[str], now: int) -> None:
        """A Slurm Fleet's live attempts stand in for a Node's heartbeat."""
        await self.heartbeats({slurm_holder(f): now for f in fleets})

    async def heartbeats(self, beats: Mapping[str, int]) -> None:
        """Extend the credentials of members that have not ended, for each Node's latest
        heartbeat time in ``beats`` (node id -> ms); one transaction for the whole batch."""
        extended = await self.store.refresh_credentials(beats, TTL_MS, REFRESH_SLACK_MS)
        if extended:
            log.debug("collector credentials extended nodes=%d count=%d", len(beats), extended)

    async def member_ended(self, member: MemberKey, now: int) -> None:
        await self.store.member_ended(member, now, DRAIN_MS)

    async def principal(
        self, metadata: Iterable[tuple[str, str | bytes]] | None, now: int
    ) -> tuple[Principal, CollectorGrant]:
        """The collector a call's bearer token belongs to, or :class:`AuthError`."""
        token = bearer_token(metadata)
        if not is_collector_credential(token):
            raise AuthError(
                "this call needs a collector credential (tpc_...), which the Node receives with "
                "each Commit and keeps in its state directory; Node control credentials and user "
                "tokens cannot ship points."
            )
        grant = await self.store.grant_for(hash_credential(token))
        if grant is None:
            raise AuthError(
                "this collector credential is not known to this coordinator. The Node receives a "
                "new one with the member's Commit; check the collector's --credential-file."
            )
        if grant.expires_at_ms <= now:
            why = (
                "its member ended and the drain window passed"
                if grant.ended_at_ms is not None
                else "its Node has not sent a heartbeat since"
            )
            raise AuthError(
                f"this collector credential for {_member_text(grant.member)} expired ({why}). "
                "Reconnect the Node; heartbeats renew the credential of a member that has not "
                "ended."
            )
        name = _member_text(grant.member)
        return Principal("collector", name), grant


def slurm_holder(fleet: str) -> str:
    """What a Slurm member's credential names in place of a Node id."""
    return f"slurm:{fleet}"


def _member_text(member: MemberKey) -> str:
    return f"{member.run_id}/attempt-{member.attempt}/member-{member.member_index}"
