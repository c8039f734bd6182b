"""Member logs of Slurm attempts into the log store, so ``tp logs`` reads them as on Nodes.

Rules: each member's ``stdout.log`` and ``stderr.log`` lie in its folder on the Fleet's shared
folder (tuneplane.proto.contract.slurm_attempt); each pass appends what grew since the last one
(at most the log store's bound: older bytes count as dropped). The log store is idempotent by
offset, so a coordinator that restarts (and starts again at byte 0) stores nothing twice. A
stream is marked complete only once its Slurm job ended: the executor ships before it records
the end, so the last bytes are in before the Job is ``ended`` and no longer driven.
"""

from __future__ import annotations

import os
from pathlib import Path

import anyio

from tuneplane.proto.contract.slurm_attempt import attempt_dir, member_dir

from ..clock import now_ms
from ..store.logs import KEEP_BYTES, STREAMS, LogStore
from ..store.slurm_attempts import SlurmAttemptRow
from ..values.fleet import SlurmSettings
from ..values.jobs import MemberKey


def _read_from(path: Path, offset: int) -> tuple[int, bytes]:
    """(start, bytes) of ``path`` from ``offset`` on, at most KEEP_BYTES (the newest)."""
    try:
        with path.open("rb") as f:
            size = os.fstat(f.fileno()).st_size
            start = max(offset, size - KEEP_BYTES)
            f.seek(start)
            return start, f.read(size - start)
    except FileNotFoundError:
        return offset, b""


class SlurmLogs:
    """What each member stream has stored, and the reads that add to it."""

    def __init__(self, logs: LogStore) -> None:
        self._logs = logs
        self._offsets: dict[tuple[MemberKey, str], int] = {}

    async def ship(self, settings: SlurmSettings, row: SlurmAttemptRow, ended: bool) -> None:
        folder = attempt_dir(settings.shared_dir, row.run_id, row.attempt)
        for index in range(row.members):
            key = MemberKey(row.run_id, row.attempt, index)
            for stream in STREAMS:
                offset = self._offsets.get((key, stream), 0)
                path = member_dir(folder, index) / f"{stream}.log"
                start, data = await anyio.to_thread.run_sync(_read_from, path, offset)
                if not data and not ended:
                    continue
                done = await self._logs.append(key, stream, start, data, ended, now_ms())
                self._offsets[(key, stream)] = done.offset
                if done.complete:
                    self._offsets.pop((key, stream), None)
