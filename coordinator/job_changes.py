"""Which Jobs changed, told to the WatchJob streams that follow them, in this process.

Rules:
- Only the leading coordinator serves the API, and every write to a Job happens in that process
  (:mod:`.leadership`), so a book in memory hears of every change.
- It hears of one only after the store transaction that made it committed (the store's commit
  observers, :meth:`~.store.db.StoreDb.changed`): a watch woken by :meth:`JobChanges.changed`
  and reading the Job sees the change.
- A watch is armed *before* it reads the Job (:meth:`JobWatch.arm`), so a change that commits
  between its read and its wait still wakes it; a spurious wake costs one read, never a change.
- Bounded: at most ``max_watches`` at once; one more is :class:`TooManyWatches`. A watch leaves
  the book when its block ends, however it ends (the stream done, the client gone, a deadline).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Iterator
from contextlib import contextmanager

import anyio
import attrs

log = logging.getLogger(__name__)

#: How many WatchJob streams one coordinator serves at once, unless ``[limits] job_watches``
#: says otherwise.
DEFAULT_MAX_WATCHES = 1000
#: Seconds a watch waits for a change notice before it reads its Job anyway (what no
#: transaction tells of, image-pull progress in memory), unless ``[limits]
#: job_watch_fallback_s`` says otherwise.
DEFAULT_FALLBACK_S = 1.0


class TooManyWatches(Exception):
    """The coordinator already serves its most watches at once (gRPC RESOURCE_EXHAUSTED)."""


@attrs.frozen
class JobChangesStatistics:
    """How many watches are open, and of how many Jobs."""

    watches: int
    run_ids: int


@attrs.define(eq=False)
class JobWatch:
    """One watch of one Job: woken when that Job changed since it was last armed."""

    run_id: str
    _woken: anyio.Event = attrs.field(factory=anyio.Event, alias="woken")

    def arm(self) -> None:
        """Forget earlier changes: from now on only a new one wakes :meth:`wait`. Call it before
        reading the Job."""
        if self._woken.is_set():
            self._woken = anyio.Event()

    def wake(self) -> None:
        self._woken.set()

    async def wait(self, timeout_s: float) -> bool:
        """Wait until the Job changed since :meth:`arm` or ``timeout_s`` passed; whether it
        changed."""
        with anyio.move_on_after(timeout_s):
            await self._woken.wait()
        return self._woken.is_set()


class JobChanges:
    """The watches open in this coordinator, by run id."""

    def __init__(self, max_watches: int = DEFAULT_MAX_WATCHES) -> None:
        self.max_watches = max_watches
        self._watches: dict[str, set[JobWatch]] = {}
        self._count = 0

    def statistics(self) -> JobChangesStatistics:
        return JobChangesStatistics(self._count, len(self._watches))

    def changed(self, run_ids: Iterable[str]) -> None:
        """Wake every watch of each of ``run_ids`` (a committed transaction changed them)."""
        for run_id in run_ids:
            for watch in self._watches.get(run_id, ()):
                watch.wake()

    @contextmanager
    def watching(self, run_id: str) -> Iterator[JobWatch]:
        """A watch of ``run_id`` for the block, or :class:`TooManyWatches` when
        ``max_watches`` are open already."""
        if self._count >= self.max_watches:
            raise TooManyWatches(
                f"the coordinator already serves {self.max_watches} WatchJob streams, its most "
                "at once ([limits] job_watches). Try again later, or ask the coordinator's "
                "operator to raise job_watches."
            )
        watch = JobWatch(run_id)
        self._watches.setdefault(run_id, set()).add(watch)
        self._count += 1
        try:
            yield watch
        finally:
            self._count -= 1
            left = self._watches[run_id]
            left.discard(watch)
            if not left:
                del self._watches[run_id]
            log.info("job watch closed run_id=%s watches=%d", run_id, self._count)
