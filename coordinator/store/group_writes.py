"""Group commit, the store's shell: writes of one kind that arrive together share one
transaction (:mod:`~tuneplane.coordinator.group_commit` decides which).

Rules:
- A write is submitted and awaited like any store method; it returns (or raises) only after the
  transaction that holds it committed, so nothing is acknowledged before it is durable.
- One batch at a time. A waiter whose ticket is still queued when no batch runs cuts the next
  one (everything queued) and runs it; the others wait for that batch to end, all woken at once.
  Each write, with its waiting and any batch it runs, is *shielded* (:meth:`StoreDb.shielded`):
  once called it is written, whatever happens to the caller (a deadline, or grpclib cancelling
  the handler of a dropped connection, which a disconnection must survive), and
  :meth:`StoreDb.close` waits for it. A conflict the database aborted re-runs the whole batch.
- One bad write never sinks the others: when a batch fails for something one write did (it
  broke a rule of the schema, the store refused it, a bug), each of its writes runs again alone,
  in its own transaction, and only the ones that fail alone get their error. An error of the
  whole store (unreachable, fenced by a newer leader) is every write's answer at once.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Awaitable, Callable, Sequence
from typing import Generic, TypeVar

import anyio

from ..group_commit import MAX_ITEMS, MAX_WEIGHT, GroupCommit, GroupCommitStatistics, Ticket
from ..group_commit import TicketState as TicketState
from .base import Conflict, NotFound
from .db import StoreDb
from .handle import Handle, IntegrityViolation, StoreError

log = logging.getLogger(__name__)

T = TypeVar("T")
R = TypeVar("R")

#: Writes the items of one batch in the transaction it is given; one result per item, in order.
BatchWrite = Callable[[Handle, Sequence[T]], Awaitable[list[R]]]


class GroupWriter(Generic[T, R]):
    """One kind of write to ``store``, grouped: :meth:`submit` an item, get its result."""

    def __init__(
        self,
        store: StoreDb,
        write: BatchWrite[T, R],
        kind: str,
        weigh: Callable[[T], int] = lambda _item: 1,
        max_items: int = MAX_ITEMS,
        max_weight: int = MAX_WEIGHT,
        *,
        reads_only: bool = False,
    ) -> None:
        # reads_only: the batch reads on the store's reader, outside any write transaction.
        self._reads_only = reads_only
        self._store = store
        self._write = write
        self._kind = kind
        self._core: GroupCommit[T, R] = GroupCommit(weigh, max_items, max_weight)
        # Set when the batch now running is written; None while none runs.
        self._running: anyio.Event | None = None

    def statistics(self) -> GroupCommitStatistics:
        return self._core.statistics()

    async def submit(self, item: T) -> R:
        """Write ``item`` in the next batch's transaction; its result once that committed.

        Shielded as a whole, like any store write: once called, the write happens, even when the
        caller is cancelled meanwhile (grpclib cancels a handler whose connection dropped, and a
        disconnection must still be recorded)."""
        return await self._store.shielded(functools.partial(self._submitted, item))

    async def _submitted(self, item: T) -> R:
        ticket = self._core.submit(item)
        while ticket.state is not TicketState.ANSWERED:
            running = self._running
            if running is not None:
                # One wake per batch for every waiter, not one lock handoff each: with thousands
                # of streams on the loop, a handoff per waiter cost seconds.
                await running.wait()
                continue
            batch = self._core.cut()
            self._running = done = anyio.Event()
            await self._run(batch, done)
        return ticket.outcome()

    async def _run(self, batch: list[Ticket[T, R]], done: anyio.Event) -> None:
        """Write ``batch`` (shielded: it runs to the end), answer every ticket in it, and wake
        every waiter for the next turn."""
        try:
            await self._write_batch(batch)
        finally:
            self._running = None
            done.set()

    async def _write_batch(self, batch: list[Ticket[T, R]]) -> None:
        try:
            try:
                results = await self._store.shielded(functools.partial(self._transaction, batch))
            except Exception as exc:
                if len(batch) == 1 or not _one_writes(exc):
                    for ticket in batch:
                        self._core.fail(ticket, exc)
                    return
                log.warning(
                    "group commit split kind=%s items=%d error=%s", self._kind, len(batch), exc
                )
                await self._one_by_one(batch)
                return
            for ticket, result in zip(batch, results, strict=True):
                self._core.answer(ticket, result)
        except BaseException as exc:
            for ticket in batch:
                if ticket.state is TicketState.RUNNING:
                    self._core.fail(ticket, exc)
            raise

    async def _one_by_one(self, batch: list[Ticket[T, R]]) -> None:
        for ticket in batch:
            try:
                (result,) = await self._store.shielded(
                    functools.partial(self._transaction, [ticket])
                )
            except Exception as exc:
                self._core.fail(ticket, exc)
            else:
                self._core.answer(ticket, result)

    async def _transaction(self, batch: Sequence[Ticket[T, R]]) -> list[R]:
        if self._reads_only:
            return self._checked(
                batch, await self._write(self._store.reader, [t.item for t in batch])
            )
        async with self._store.transaction() as db:
            # A wrong count raises here, so the transaction keeps nothing.
            return self._checked(batch, await self._write(db, [t.item for t in batch]))

    def _checked(self, batch: Sequence[Ticket[T, R]], results: list[R]) -> list[R]:
        if len(results) != len(batch):
            raise RuntimeError(
                f"a {self._kind} batch of {len(batch)} items returned {len(results)} results."
            )
        return results


def _one_writes(exc: Exception) -> bool:
    """Whether ``exc`` may be one write's own fault (then the others are tried without it)."""
    return not isinstance(exc, StoreError) or isinstance(
        exc, IntegrityViolation | Conflict | NotFound
    )
