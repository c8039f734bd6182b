"""The tailer's file I/O for one poll, run in worker threads: the walk, the stat, the reads.

Rules:
- The directory walk costs CPU in proportion to the tree (a checkpoint directory of 10 000
  files takes tens of milliseconds): while the writers run it is repeated only once
  :data:`WALK_COST_FACTOR` times its last cost has passed (at most every poll), so it never
  takes more than about 2 % of a core; the files already found are looked at every poll, and
  draining always walks again.
- A file is opened only under the root (:func:`.files.open_under`), and a stream is read only
  while its inode is the one the scan saw; anything renamed or replaced meanwhile waits for the
  next scan.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

from .files import Discovery, Layout, ScanLimits, discover, open_under, read_chunks
from .points import Decoder, Mark, ReadWarning, ScalarPoint
from .tracking import HEAD_BYTES, FileStat, Stream

#: A walk that took ``t`` seconds is repeated after ``WALK_COST_FACTOR * t`` at the soonest.
WALK_COST_FACTOR = 50.0
# One decoded chunk: points, warnings, position, decoder state there, bytes read, marks.
Chunk = tuple[list[ScalarPoint], list[ReadWarning], int, dict[str, Any], int, list[Mark]]


class Walker:
    """Finds the telemetry files under ``root`` (as ``layout`` says, within ``limits``) and
    stats them, walking the directories only as often as the module notes say."""

    def __init__(self, root: Path, layout: Layout, limits: ScanLimits) -> None:
        self._root = root
        self._layout = layout
        self._limits = limits
        # The last directory walk, and when the next one is due (time.monotonic()).
        self._found: Discovery | None = None
        self._next_walk = 0.0

    def scan(self, final: bool) -> tuple[list[FileStat], bool]:
        """The telemetry files as they are now, and whether the walk stopped at a bound (see
        the module notes for how often the directories are walked)."""
        started = time.monotonic()
        found = self._found
        if final or found is None or started >= self._next_walk:
            found = discover(self._root, self._layout, self._limits)
            self._found = found
            self._next_walk = started + WALK_COST_FACTOR * (time.monotonic() - started)
        stats: list[FileStat] = []
        for rel, _ in found.files:
            handle = open_under(self._root, rel)
            if handle is None:
                continue
            with handle:
                try:
                    info = os.fstat(handle.fileno())
                    head = handle.read(HEAD_BYTES)
                except OSError:
                    continue
            stats.append(FileStat(rel, info.st_dev, info.st_ino, info.st_size, head))
        return stats, found.depth_limited or found.entries_limited


def read_new(root: Path, stream: Stream, decoder: Decoder, final: bool, limit: int) -> list[Chunk]:
    """Decode new bytes of ``stream`` (in a worker thread): per chunk, its points,
    warnings, position, decoder state there, how far the file was read, and its marks."""
    out: list[Chunk] = []
    handle = open_under(root, stream.path)
    if handle is None:
        return out
    with handle:
        info = os.fstat(handle.fileno())
        if (info.st_dev, info.st_ino) != stream.inode:
            # Renamed or replaced since the scan: the next scan sorts it out.
            return out
        for decoded in read_chunks(handle, decoder, stream.position, final=final, limit=limit):
            out.append(
                (
                    list(decoded.points),
                    decoded.warnings,
                    decoded.consumed,
                    decoder.snapshot(),
                    handle.tell(),
                    decoded.marks,
                )
            )
    return out
