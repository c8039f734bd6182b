"""Group commit for a SQLite store: write transactions that queue up behind one another in this
process share one ``COMMIT``, so one fsync, instead of each waiting for its own.

Rules:
- Writers take the lock one at a time, as before. The first opens the file's transaction
  (``BEGIN IMMEDIATE``); each runs its block inside ``SAVEPOINT member``, released when the block
  ends and rolled back to when it fails: a failed block leaves nothing, and the blocks before it
  keep what they wrote.
- The group commits when a block ends and no writer waits for the lock, or once it holds
  :data:`MAX_MEMBERS` blocks, so a steady stream of writers still commits. A writer hears that
  its block succeeded only once that ``COMMIT`` returned: an acknowledged write is on disk, as
  with a ``COMMIT`` of its own.
- A ``COMMIT`` that fails fails every block of its group (none of them was kept), and so does an
  error to which SQLite answered by rolling the whole transaction back.
- A writer cancelled while it waits for the lock, or for its group's ``COMMIT``, leaves the group
  to the others: a block that ran commits or fails with them. One cancelled inside its block is
  taken back as a failed one, by a task of its own that no cancel scope reaches, before the next
  writer comes in.
- This groups whole transactions of any kind at the SQLite file. Writes of one kind that arrive
  together (Hellos, disconnections) are also batched into one transaction, on either backend,
  by :mod:`.group_writes`; such a batch is one block here.
"""

from __future__ import annotations

import asyncio
import sqlite3
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager

import attrs

from .handle import StoreUnavailable
from .sqlite_link import SqliteLink, mapped_errors

#: The most blocks one COMMIT makes durable: a group holds the file's write lock (other
#: processes wait) and its first writer's answer until then.
MAX_MEMBERS = 16
SAVEPOINT = "member"


@attrs.define
class _Group:
    """One open SQLite transaction and the outcome of its COMMIT, awaited by its blocks."""

    done: asyncio.Future[None]
    members: int = 0


class CommitGroups:
    """The writers of one SQLite store (module rules). ``begin`` opens the file's transaction;
    ``statement`` runs a small statement in it (on the loop where the store's statements run
    there)."""

    def __init__(
        self,
        link: SqliteLink,
        what: str,
        begin: Callable[[], Awaitable[None]],
        statement: Callable[[str], Awaitable[object]],
    ) -> None:
        self._link = link
        self._what = what
        self._begin = begin
        self._statement = statement
        self._lock = asyncio.Lock()
        self._waiting = 0
        self._open: _Group | None = None
        self._undoing: set[asyncio.Task[None]] = set()
        #: Blocks that committed, and the COMMITs that made them durable.
        self.committed_blocks = 0
        self.commits = 0

    @asynccontextmanager
    async def member(self) -> AsyncIterator[None]:
        """One write block in the open group (or a new one), answered once it is on disk."""
        self._waiting += 1
        try:
            await self._lock.acquire()
        except BaseException:
            self._waiting -= 1
            self._settle()  # nobody else may be coming to commit what the group holds
            raise
        self._waiting -= 1
        releases = True
        try:
            group = await self._join()
            try:
                yield
                await self._statement(f"RELEASE {SAVEPOINT}")
            except BaseException as exc:
                # Taken back by a task of its own, which lets the next writer in only once it is
                # done: a writer cancelled here (again at each await, under a cancel scope) must
                # neither leave its block half taken back nor hand the lock to a writer that
                # would join a transaction SQLite has ended.
                releases = False
                undo = asyncio.ensure_future(self._undo(group, exc))
                self._undoing.add(undo)
                undo.add_done_callback(self._undoing.discard)
                await asyncio.shield(undo)
                raise
            group.members += 1
        finally:
            if releases:
                self._lock.release()
                self._settle()
        # Shielded: one writer's deadline must not cancel the outcome the others wait for.
        with mapped_errors(self._what):
            await asyncio.shield(group.done)

    async def _join(self) -> _Group:
        if self._open is None:
            await self._begin()
            done = asyncio.get_running_loop().create_future()
            done.add_done_callback(_retrieved)
            self._open = _Group(done)
        group = self._open
        await self._statement(f"SAVEPOINT {SAVEPOINT}")
        return group

    async def _undo(self, group: _Group, exc: BaseException) -> None:
        """Take back the failed block, then let the next writer in. Where SQLite ended the
        whole transaction, or taking the block back fails, the group is lost: its blocks hear
        so before anything else can happen to it."""
        try:
            try:
                kept = await self._link.threaded(lambda: _roll_back_member(self._link.conn))
            except Exception as undo_exc:
                kept, exc = False, undo_exc
            if not kept:
                self._lose(group, exc)
                await self._link.threaded(lambda: _abandon(self._link.conn))
        finally:
            self._lock.release()
            self._settle()

    def _lose(self, group: _Group, exc: BaseException) -> None:
        if self._open is group:
            self._open = None
        if not group.done.done():
            group.done.set_exception(
                StoreUnavailable(
                    f"the {self._what} lost a transaction holding other writes when one failed "
                    f"({exc}); none of them was kept. Check the disk under the store's file and "
                    "try again."
                )
            )

    def _settle(self) -> None:
        """Commit the open group unless a block runs now, or a writer waits for the lock and
        the group still has room for it."""
        group = self._open
        if group is None or self._lock.locked():
            return
        if self._waiting and group.members < MAX_MEMBERS:
            return
        self._open = None
        sql = "COMMIT" if group.members else "ROLLBACK"
        if group.members:
            self.commits += 1
            self.committed_blocks += group.members
        outcome = self._link.submit(lambda: _finish(self._link.conn, sql))
        outcome.add_done_callback(lambda f: _pass_on(f, group.done))


def _roll_back_member(conn: sqlite3.Connection) -> bool:
    """In the thread: undo the failed block's savepoint; False where SQLite already rolled the
    whole transaction back (a full disk, an I/O error)."""
    if not conn.in_transaction:
        return False
    conn.execute(f"ROLLBACK TO {SAVEPOINT}").close()
    conn.execute(f"RELEASE {SAVEPOINT}").close()
    return True


def _abandon(conn: sqlite3.Connection) -> None:
    """In the thread: roll back what is left of a lost group's transaction, if anything is."""
    if conn.in_transaction:
        conn.execute("ROLLBACK").close()


def _finish(conn: sqlite3.Connection, sql: str) -> None:
    """In the thread: COMMIT or ROLLBACK; a COMMIT that fails leaves no transaction open."""
    try:
        conn.execute(sql).close()
    except BaseException:
        _abandon(conn)
        raise


def _pass_on(outcome: asyncio.Future[None], done: asyncio.Future[None]) -> None:
    if done.done():
        return
    error = outcome.exception()
    if error is not None:
        done.set_exception(error)
    else:
        done.set_result(None)


def _retrieved(future: asyncio.Future[None]) -> None:
    """Mark the outcome read: when every writer of a failed group was cancelled, nobody does."""
    if not future.cancelled():
        future.exception()
