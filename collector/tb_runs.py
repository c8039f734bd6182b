"""TensorBoard's rule for restarted writers, per run directory: :class:`RunState` and its helpers.

Rules: pure (no files, no clock); the state is JSON-able so it rides in the checkpointed decoder
state and passes from one event file of a run directory to the next (:func:`opening_state`).
The decoder emits a ``RestartMark`` wherever this says TensorBoard would purge orphaned points.
"""

from __future__ import annotations

import posixpath
from collections.abc import Iterable, Mapping
from typing import Any, Literal

import attrs


@attrs.define
class RunState:
    """What TensorBoard's reader (``plugin_event_accumulator.EventAccumulator``, the one its
    server reads runs with) remembers across the events of one run directory, and its rule for
    orphaned points, as a pure state machine.

    Theory of operation, per event in reading order (files sorted by name, then byte offset):

    - an event carrying ``file_version`` sets the version (``brain.Event:2`` -> 2.0);
    - with a version of at least 2, a ``SessionLog.START`` event *after the first one in the
      run* orphans every earlier point whose step is at least the event's step, whatever its
      tag; the first START is a start, not a restart;
    - without such a version (old writers), a summary event whose step is smaller than the
      previous summary event's orphans the earlier points of *its own tags* with a step at
      least its own;
    - every summary event then becomes "the previous summary event".

    Purges apply to points read before the event; the event's own values are kept.
    """

    file_version: float | None = None
    seen_start: bool = False
    most_recent_step: int = -1

    def to_json(self) -> dict[str, Any]:
        return {
            "file_version": self.file_version,
            "seen_start": self.seen_start,
            "most_recent_step": self.most_recent_step,
        }

    @classmethod
    def from_json(cls, raw: Mapping[str, Any] | None) -> RunState:
        raw = raw or {}
        version = raw.get("file_version")
        return cls(
            None if version is None else float(version),
            bool(raw.get("seen_start", False)),
            int(raw.get("most_recent_step", -1)),
        )

    def event(
        self,
        step: int,
        *,
        file_version: str | None = None,
        session_start: bool = False,
        summary_tags: tuple[str, ...] | None = None,
    ) -> tuple[str, ...] | Literal[False] | None:
        """Feed one event; returns False when it orphans nothing, None when it orphans every
        tag (from ``step`` on), or the tags it orphans. ``summary_tags`` is None for an event
        without a summary, else the tags of its values."""
        if file_version is not None:
            self.file_version = parse_file_version(file_version)
        orphans: tuple[str, ...] | Literal[False] | None = False
        if self.file_version and self.file_version >= 2:
            if session_start:
                if self.seen_start:
                    orphans = None
                self.seen_start = True
        elif summary_tags is not None and step < self.most_recent_step:
            orphans = summary_tags
        if summary_tags is not None:
            self.most_recent_step = step
        return orphans


def parse_file_version(text: str) -> float:
    """TensorBoard's reading of ``Event.file_version`` (``brain.Event:2``); -1 when unreadable."""
    try:
        return float(text.split("brain.Event:")[-1])
    except ValueError:
        return -1.0


def run_directory(path: str) -> str:
    """The TensorBoard run a file belongs to: its directory ('' for the root)."""
    return posixpath.dirname(path)


def opening_state(path: str, others: Iterable[tuple[str, Mapping[str, Any]]]) -> dict[str, Any]:
    """The decoder state a newly found event file ``path`` starts from: the run state where the
    last file before it (by name, in the same directory) stands, as TensorBoard reads a run's
    files one after the other. ``others`` are (path, decoder snapshot) of the other files."""
    directory, name = run_directory(path), posixpath.basename(path)
    before = [
        (posixpath.basename(p), snap)
        for p, snap in others
        if run_directory(p) == directory and posixpath.basename(p) < name
    ]
    if not before:
        return {}
    _, snap = max(before, key=lambda item: item[0])
    return {"run": dict(snap.get("run", {}))}
