"""What the tailer hands out: a :class:`Batch` of points with the :class:`Position` after it.

Rules: frozen values; a batch carries the decoded position of every stream *after* it, so the
consumer makes the points durable, then commits the batch (see :mod:`.tailer`).
:class:`TailerStatistics` is what :meth:`.tailer.Tailer.statistics` reports.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import attrs

from .points import Mark, ReadWarning, ScalarPoint


@attrs.frozen
class Position:
    """Where a stream's decoding stands: byte offset and the decoder state there."""

    offset: int
    state: Mapping[str, Any]


@attrs.frozen
class Batch:
    """Points and warnings to make durable, then :meth:`.tailer.Tailer.commit`.

    ``seq`` grows by one.
    """

    seq: int
    points: list[ScalarPoint]
    warnings: list[ReadWarning]
    positions: Mapping[str, Position]
    marks: list[Mark] = attrs.field(factory=list)


@attrs.frozen
class TailerStatistics:
    polls: int
    streams: int
    live_streams: int
    points: int
    warnings: int
    data_loss_warnings: int
    truncations: int
    replacements: int
    adoptions: int
    skipped_copies: int
    batches_sent: int
    batches_committed: int
    # Files the last scan found that are not followed (the file cap), and whether it stopped
    # at the depth or entries bound.
    files_not_followed: int = 0
    walk_limited: bool = False
