"""Which stored points a restarted TensorBoard writer orphaned: the coordinator's half of the rule.

Theory of operation:
- The collector replays TensorBoard's reader over each run directory and ships a restart mark
  wherever that reader would purge (:class:`tuneplane.collector.tb_runs.RunState`). Points and
  marks reach the store in any order (files are read side by side, batches are retried), so a
  point's fate is decided from its place, never from when it arrived.
- A point's place is its run directory and its position in TensorBoard's reading order: the
  file name (a file read again after truncation, ``path#N``, comes after ``path``), then the
  byte offset. A mark orphans a point of the same member and run directory that lies strictly
  before it, whose step is at least the mark's step and whose tag the mark names (or any tag).
  Only TensorBoard event files (``tfevents`` in the name, TensorBoard's own test) belong to a
  run: a JSONL file or the system samples beside them are never orphaned.
- Pure: the store feeds sources, marks and points; nothing here reads a database or a clock.
"""

from __future__ import annotations

import bisect
import posixpath
from collections.abc import Iterable

import attrs

#: A source's place in TensorBoard's reading order within its run directory.
FileKey = tuple[str, int]


def place(source_id: str) -> tuple[str, FileKey]:
    """(run directory, file key) of a source: its directory, then (base name, generation)."""
    path, sep, generation = source_id.rpartition("#")
    if not sep or not generation.isdigit() or not path:
        path, generation = source_id, "0"
    return posixpath.dirname(path), (posixpath.basename(path), int(generation))


def is_event_file(source_id: str) -> bool:
    """Whether a source is a TensorBoard event file, as TensorBoard tells them apart."""
    return "tfevents" in posixpath.basename(source_id)


@attrs.frozen
class Restart:
    """A stored restart mark: where it lies, from which step, for which tags (None: all)."""

    source_id: str
    offset: int
    step: int
    tags: frozenset[str] | None

    @property
    def scope(self) -> str:
        return place(self.source_id)[0]

    @property
    def file_key(self) -> FileKey:
        return place(self.source_id)[1]


@attrs.define
class SeriesRule:
    """The marks that can orphan points of one series (one source, one tag), ready to ask.

    A point at ``offset`` with ``step`` is orphaned when some applicable mark lies after it
    and has a step at most ``step``: marks in later files lie after every point, marks in the
    same file after the points before their offset. Sorted by offset with suffix minima of
    their steps, each question is one binary search.
    """

    later_min_step: int | None
    offsets: list[int]
    suffix_min_steps: list[int]

    @classmethod
    def build(cls, source_id: str, tag: str, restarts: Iterable[Restart]) -> SeriesRule:
        scope, key = place(source_id)
        later: int | None = None
        same: list[tuple[int, int]] = []
        if not is_event_file(source_id):
            restarts = ()
        for r in restarts:
            if r.tags is not None and tag not in r.tags:
                continue
            r_scope, r_key = place(r.source_id)
            if r_scope != scope:
                continue
            if r_key > key:
                later = r.step if later is None else min(later, r.step)
            elif r_key == key:
                same.append((r.offset, r.step))
        same.sort()
        suffix: list[int] = [0] * len(same)
        low: int | None = None
        for i in range(len(same) - 1, -1, -1):
            low = same[i][1] if low is None else min(low, same[i][1])
            suffix[i] = low
        return cls(later, [o for o, _ in same], suffix)

    @property
    def empty(self) -> bool:
        return self.later_min_step is None and not self.offsets

    def orphaned(self, offset: int, step: int) -> bool:
        if self.later_min_step is not None and step >= self.later_min_step:
            return True
        i = bisect.bisect_right(self.offsets, offset)
        return i < len(self.offsets) and step >= self.suffix_min_steps[i]


def orphaned(restarts: Iterable[Restart], source_id: str, tag: str, offset: int, step: int) -> bool:
    """Whether the point (``source_id``, ``offset``) of ``tag`` at ``step`` is orphaned."""
    return SeriesRule.build(source_id, tag, restarts).orphaned(offset, step)
