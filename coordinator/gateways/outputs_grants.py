"""Fetch grants: what lets a Node fetch a Derivation's source from the Node that holds it.

Rules:
- A Node's outputs listener (Hello.outputs) is stored only when every part of it is well formed
  (:func:`check_service`): HOST:PORT, a 64-hex certificate digest, a key of exactly
  :data:`~.derivation.GRANT_KEY_BYTES` bytes. A malformed one is logged and stored as none; it
  never costs the Node its control stream.
- Every Prepare whose JobSpec names a holder (``init_from_source.node_id``) gets, just before it
  is sent (:func:`attach`), the holder's current address and certificate digest and a grant
  signed with the holder's key for that source member, good for :data:`~.derivation.GRANT_TTL_MS`.
  A resent Prepare gets a fresh one. The grant is never stored.
- When the holder serves no outputs at that moment (listener off, never said, revoked), the
  Prepare goes without, and the Node refuses it with a sentence naming the holder.
- Cheap first: a JobSpec is parsed only when its text mentions ``init_from_source`` and
  ``node_id``; the store is read once per batch of orders.
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Sequence
from typing import Any

import attrs

from tuneplane.proto.contract.outputs_grant import GRANT_KEY_BYTES, make_grant

from ..control_address import BadAddress, split
from ..derivation import GRANT_TTL_MS
from ..offload import in_thread
from ..store.core import Store
from ..store.fleet_views import outputs_services
from ..values.jobs import MemberKey
from ..values.orders import InitFromFetch, Order, OutputsService, PrepareOrder
from .message_limits import INLINE_DECODE_BYTES

log = logging.getLogger(__name__)

_SHA256 = re.compile(r"^[0-9a-f]{64}$")
MAX_ADDRESS_CHARS = 300


def check_service(service: OutputsService) -> str | None:
    """Why a Node's reported outputs listener cannot be stored, or None when it is well formed."""
    address = service.address
    if len(address) > MAX_ADDRESS_CHARS or not address.isprintable() or not address.isascii():
        return (
            f"its address is not HOST:PORT in at most {MAX_ADDRESS_CHARS} printable ASCII "
            "characters"
        )
    try:
        split(address)
    except BadAddress:
        return f"its address {address!r} is not HOST:PORT (for IPv6, [ADDRESS]:PORT)"
    if not _SHA256.fullmatch(service.cert_sha256):
        return "its cert_sha256 is not 64 lowercase hex digits (the sha256 of the DER certificate)"
    if len(service.grant_key) != GRANT_KEY_BYTES:
        return f"its grant_key is {len(service.grant_key)} bytes, not {GRANT_KEY_BYTES}"
    return None


def accepted_service(node_id: str, service: OutputsService | None) -> OutputsService | None:
    """``service`` when it can be stored; None (logged) when it is malformed or absent."""
    if service is None:
        return None
    why = check_service(service)
    if why is None:
        return service
    log.warning(
        "outputs service refused node=%s why=%s; the Node serves no outputs until its next "
        "Hello reports a well-formed one",
        node_id,
        why,
    )
    return None


@attrs.frozen
class FetchSource:
    """The source member a Prepare's JobSpec fetches from another Node."""

    holder: str
    member: MemberKey


def fetch_source(jobspec_json: str) -> FetchSource | None:
    """The holder and source member of a resolved JobSpec whose Derivation is fetched from a
    Node; None when it has none (no Derivation, or one on a shared output root)."""
    if '"init_from_source"' not in jobspec_json or '"node_id"' not in jobspec_json:
        return None
    try:
        data: Any = json.loads(jobspec_json)
        src = data.get("init_from_source")
        if not isinstance(src, dict) or not src.get("node_id"):
            return None
        holder, run_id = src["node_id"], src["run_id"]
        attempt, index = src["attempt"], src["member_index"]
    except (ValueError, KeyError, TypeError, AttributeError):
        log.warning("prepare jobspec unreadable; no fetch grant attached")
        return None
    if not (isinstance(holder, str) and isinstance(run_id, str)):
        return None
    if not (isinstance(attempt, int) and isinstance(index, int)):
        return None
    return FetchSource(holder, MemberKey(run_id, attempt, index))


async def _fetch_source(order: PrepareOrder) -> FetchSource | None:
    text = order.jobspec_json
    if '"init_from_source"' not in text or '"node_id"' not in text:
        return None
    if len(text) <= INLINE_DECODE_BYTES:
        return fetch_source(text)
    return await in_thread(fetch_source, text)


def grant_for(service: OutputsService, source: MemberKey, now: int) -> InitFromFetch:
    """What a Prepare carries to fetch ``source`` from the Node serving at ``service``."""
    expires = now + GRANT_TTL_MS
    grant = make_grant(
        service.grant_key, source.run_id, source.attempt, source.member_index, expires
    )
    return InitFromFetch(service.address, service.cert_sha256, grant, expires)


async def attach(store: Store, orders: Sequence[Order], now: int) -> list[Order]:
    """``orders`` with an :class:`InitFromFetch` on every Prepare whose source is fetched from a
    Node that serves outputs now."""
    sources: dict[int, FetchSource] = {}
    for i, order in enumerate(orders):
        if isinstance(order, PrepareOrder):
            found = await _fetch_source(order)
            if found is not None:
                sources[i] = found
    if not sources:
        return list(orders)
    services = await outputs_services(store, {s.holder for s in sources.values()})
    out: list[Order] = []
    for i, order in enumerate(orders):
        source = sources.get(i)
        if source is None:
            out.append(order)
            continue
        assert isinstance(order, PrepareOrder)
        service = services.get(source.holder)
        if service is None:
            log.warning(
                "fetch grant not made node=%s run_id=%s attempt=%d member=%d holder=%s "
                "why=the holder serves no outputs now; the Node will refuse the Prepare",
                order.node_id, order.member.run_id, order.member.attempt,
                order.member.member_index, source.holder,
            )  # fmt: skip
            out.append(attrs.evolve(order, init_from_fetch=None))
            continue
        fetch = grant_for(service, source.member, now)
        log.info(
            "fetch grant made node=%s run_id=%s attempt=%d member=%d holder=%s address=%s "
            "source=%s/%d/%d expires_at_ms=%d",
            order.node_id, order.member.run_id, order.member.attempt, order.member.member_index,
            source.holder, service.address, source.member.run_id, source.member.attempt,
            source.member.member_index, fetch.grant_expires_at_ms,
        )  # fmt: skip
        out.append(attrs.evolve(order, init_from_fetch=fetch))
    return out
