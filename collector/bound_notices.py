"""The once-per-member warnings of a bound that leaves telemetry unread (file cap, walk bounds).

Rules: a bound that leaves telemetry unread (the file cap, the walk's depth or entries) is said
once per member: a log line, and a data-loss warning in the spool, which ``tp job show``
counts. The checkpoint remembers it was said (:attr:`BoundNotices.noted`) once that warning is
durable (:meth:`BoundNotices.committed`).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from pathlib import Path

from .files import ScanLimits
from .point_rules import storable
from .points import ReadWarning
from .tracking import NotFollowed

log = logging.getLogger(__name__)

#: Warning kinds of the bounds (see the module notes), each said once per member.
NOT_FOLLOWED = "not-followed"
WALK_LIMITED = "walk-limited"


class BoundNotices:
    """Says each bound once: logs it once per process, warns once per member."""

    def __init__(self, root: Path, limits: ScanLimits, noted: Iterable[str]) -> None:
        self._root = root
        self._limits = limits
        # Bound warnings that are durable (said for good), and those said by this process.
        self.noted: set[str] = set(noted)
        self._logged: set[str] = set(self.noted)

    def committed(self, warnings: Iterable[ReadWarning]) -> None:
        """``warnings`` are durable now: a bound's warning among them is said for good."""
        self.noted.update(w.kind for w in warnings if w.kind in (NOT_FOLLOWED, WALK_LIMITED))

    def notices(self, skipped: list[NotFollowed], walk_limited: bool) -> list[ReadWarning]:
        """The warnings to hand out for this poll's files not followed and walk bound."""
        notices: list[ReadWarning] = []
        if skipped and NOT_FOLLOWED not in self._logged:
            self._logged.add(NOT_FOLLOWED)
            first = skipped[0]
            log.warning(
                "telemetry files not followed: the limit of files per member is reached "
                "limit=%d not_followed=%d first=%s",
                first.limit,
                len(skipped),
                storable(first.path),
            )
            if NOT_FOLLOWED not in self.noted:
                notices.append(
                    ReadWarning(
                        first.path,
                        0,
                        NOT_FOLLOWED,
                        f"{len(skipped)} telemetry file(s) are not followed, this one first: "
                        f"this member already has {first.limit} files followed, the most a "
                        "collector follows (tuneplane-collector run --max-files). Write fewer "
                        "event or report files (one SummaryWriter per run, not per step)",
                    )
                )
        if walk_limited and WALK_LIMITED not in self._logged:
            self._logged.add(WALK_LIMITED)
            limits = self._limits
            log.warning(
                "telemetry search stopped at a bound; files beyond it are not seen "
                "root=%s max_depth=%d max_entries=%d",
                self._root,
                limits.max_depth,
                limits.max_entries,
            )
            if WALK_LIMITED not in self.noted:
                notices.append(
                    ReadWarning(
                        ".",
                        0,
                        WALK_LIMITED,
                        f"the search for telemetry files stopped at a bound (directories at "
                        f"most {limits.max_depth} deep, {limits.max_entries} entries per look); "
                        "files beyond it are not read. Write event and report files near the "
                        "top of $TUNEPLANE_OUT_DIR, e.g. under $TENSORBOARD_LOGDIR",
                    )
                )
        return notices
