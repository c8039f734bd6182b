"""Member 0's rendezvous port, held from Prepare until just before launch, and the other
members' check at Prepare that they reach it.

Rules: member 0 keeps its attempt's nonce on disk (0600, in the root-only member directory)
before it holds the port, so a restarted agent can hold a prepared member 0's port again
(:meth:`RendezvousHolds.hold_again`); a port it cannot hold or reach refuses the Prepare with a
sentence naming the address. Releasing is idempotent.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path

import trio

from . import messages as m
from . import rendezvous as rdv
from .atomic_file import write_atomic
from .journal_records import MemberKey, MemberRecord
from .prepare import PrepareRefused

log = logging.getLogger(__name__)

#: Member 0's copy of its attempt's rendezvous nonce (0600, in the root-only member directory),
#: so a restarted agent can hold the rendezvous listener of a prepared member again.
NONCE_FILE = "rendezvous.nonce"


class RendezvousHolds:
    """Member 0's rendezvous listeners, held from Prepare until just before launch or the end,
    and every other member's check that it reaches member 0's."""

    def __init__(self, nursery: trio.Nursery, node_address: Callable[[], str]) -> None:
        self._nursery = nursery
        self._node_address = node_address
        # Member 0's rendezvous listeners, held from Prepare until just before launch or the end.
        self._listeners: dict[MemberKey, rdv.Listener] = {}

    async def check(self, cmd: m.Prepare) -> dict[str, str]:
        """Every member but 0: prove this Node reaches member 0's rendezvous listener, or refuse
        the Prepare naming the address, the port and the interface tried from. Returns what the
        journal records of the check ({} when there was nothing to check)."""
        target = cmd.rendezvous
        if cmd.pick_rendezvous or target is None or not cmd.rendezvous_nonce:
            return {}
        try:
            route = await rdv.probe(target.master_addr, target.master_port, cmd.rendezvous_nonce)
        except rdv.Unreachable as exc:
            raise PrepareRefused(str(exc)) from None
        where = f"{target.master_addr}:{target.master_port}"
        log.info("rendezvous reached member=%s rendezvous=%s interface=%s local_address=%s",
                 cmd.key, where, route.interface, route.local_address)  # fmt: skip
        return {"rendezvous_checked": where, "rendezvous_interface": route.interface}

    async def hold(self, cmd: m.Prepare, member_dir: Path) -> m.Rendezvous:
        """Member 0: hold a free port for the rendezvous (answering the other members' probes)
        and say where it is. The nonce is kept first, so a restarted agent can hold it again."""
        key = cmd.key
        await self.release(key)  # a Prepare cut short before its journal entry
        write_atomic(member_dir / NONCE_FILE, cmd.rendezvous_nonce.encode(), 0o600)
        address = rdv.advertised_address(self._node_address())
        try:
            listener = await rdv.open_listener(self._nursery, address, cmd.rendezvous_nonce)
        except rdv.ListenFailed as exc:
            raise PrepareRefused(str(exc)) from None
        self._listeners[key] = listener
        log.info("rendezvous held member=%s address=%s port=%d", key, address, listener.port)
        return m.Rendezvous(address, listener.port)

    async def release(self, key: MemberKey) -> None:
        """Close member 0's rendezvous listener, if it holds one (idempotent)."""
        listener = self._listeners.pop(key, None)
        if listener is not None:
            await listener.aclose()
            log.info("rendezvous released member=%s port=%d", key, listener.port)

    async def hold_again(self, record: MemberRecord) -> None:
        """After a restart: hold a prepared member 0's rendezvous port again, for the members
        whose Prepare still has to reach it. A port taken meanwhile is logged; their probes then
        fail and the attempt is aborted, never started to hang."""
        try:
            nonce = (Path(record.member_dir) / NONCE_FILE).read_text()
        except OSError as exc:
            log.warning("rendezvous nonce unreadable member=%s reason=%s", record.key, exc)
            return
        try:
            listener = await rdv.open_listener(
                self._nursery, record.master_addr, nonce, record.master_port
            )
        except rdv.ListenFailed as exc:
            log.warning("rendezvous not held again member=%s reason=%s", record.key, exc)
            return
        self._listeners[record.key] = listener
        log.info("rendezvous held again member=%s address=%s port=%d", record.key,
                 record.master_addr, record.master_port)  # fmt: skip
