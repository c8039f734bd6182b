"""When a preparing member's image pull is told: journaled (``image-pull-progress``) and sent to
the coordinator (PrepareProgress), at a bounded rate (pure: the caller passes the time in).

Rules: a pull is told when it starts, at each new tenth of its bytes, when its phase changes
(``pulling`` -> ``unpacking``), and otherwise at most every :data:`EVERY_S` seconds while it
moves, so a slow 1 GiB pull writes about ten progress events and never one per chunk.
"""

from __future__ import annotations

import attrs

from .image_cache import PullProgress

#: The most seconds between two reports of a pull that is moving.
EVERY_S = 5.0
#: Reports per pull by bytes: one at each tenth.
STEPS = 10


def _tenth(progress: PullProgress) -> int:
    if progress.bytes_total <= 0:
        return 0
    return min(progress.bytes_done * STEPS // progress.bytes_total, STEPS)


@attrs.define
class ProgressPace:
    """The last progress told, and when (the caller's clock, in seconds)."""

    told: PullProgress | None = None
    told_at: float = 0.0

    def due(self, progress: PullProgress, now: float) -> bool:
        """Whether ``progress`` is to be told now; if so, it counts as told at ``now``."""
        last = self.told
        if last == progress:
            return False
        moved_on = (
            last is None
            or progress.phase != last.phase
            or _tenth(progress) != _tenth(last)
            or progress.layers_total != last.layers_total
            or now - self.told_at >= EVERY_S
        )
        if moved_on:
            self.told, self.told_at = progress, now
        return moved_on
