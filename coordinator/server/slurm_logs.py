"""Member logs of Slurm attempts into the log store, so ``tp logs`` reads them as on Nodes.

Rules: each member's ``stdout.log`` and ``stderr.log`` lie in its folder on the Fleet's shared
folder, one folder per run of the Slurm job (tuneplane.proto.contract.slurm_attempt); a member's
stream is its runs' files one after the other, in restart order (the first run's, then each
requeued run's, up to the job's restart count), so ``tp logs`` shows every run's output in
order. Each pass appends what grew since the last one (at most the log store's bound: older
bytes count as dropped). A run's file no longer grows once the run after it started (Slurm
starts a requeued job again only once the run before it has ended), so the offsets of a later
run's bytes never move. The log store is idempotent by offset, so a coordinator that restarts
(and starts again at byte 0 of the first run's file) stores nothing twice. A stream is marked
complete only once its Slurm job ended: the executor ships before it records the end, so the
last bytes are in before the Job is ``ended`` and no longer driven.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path

import anyio

from tuneplane.proto.contract.slurm_attempt import attempt_dir, member_dir

from ..clock import now_ms
from ..store.logs import KEEP_BYTES, STREAMS, LogStore
from ..store.slurm_attempts import SlurmAttemptRow
from ..values.fleet import SlurmSettings
from ..values.jobs import MemberKey


def _size(path: Path) -> int:
    try:
        return os.stat(path).st_size
    except FileNotFoundError:
        return 0


def read_runs_from(paths: Sequence[Path], offset: int) -> tuple[int, bytes]:
    """(start, bytes) of the files ``paths`` read as one stream, one after the other, from
    ``offset`` on: at most KEEP_BYTES (the newest). A missing file is empty; a file that grows
    while it is read gives the bytes up to its size when it was looked at, and one that gives
    fewer ends what is read there (the rest is read at the next pass)."""
    sizes = [_size(path) for path in paths]
    total = sum(sizes)
    start = max(offset, total - KEEP_BYTES)
    chunks: list[bytes] = []
    base = 0  # where the file starts in the stream
    for path, size in zip(paths, sizes, strict=True):
        begin, end = max(start, base), base + size
        here, base = base, end
        if begin >= end:
            continue
        try:
            with path.open("rb") as f:
                f.seek(begin - here)
                chunk = f.read(end - begin)
        except FileNotFoundError:
            chunk = b""
        chunks.append(chunk)
        if len(chunk) < end - begin:
            break
    if not chunks:
        return offset, b""
    return start, b"".join(chunks)


def run_files(folder: Path, index: int, restarts: int, stream: str) -> list[Path]:
    """Member ``index``'s ``<stream>.log`` of each run of the Slurm job, in restart order."""
    return [member_dir(folder, index, r) / f"{stream}.log" for r in range(restarts + 1)]


class SlurmLogs:
    """What each member stream has stored, and the reads that add to it."""

    def __init__(self, logs: LogStore) -> None:
        self._logs = logs
        self._offsets: dict[tuple[MemberKey, str], int] = {}

    async def ship(
        self, settings: SlurmSettings, row: SlurmAttemptRow, ended: bool, restarts: int
    ) -> None:
        """Append what each member stream grew by, through the run after ``restarts`` requeues
        (the Slurm job's restart count as this pass read it)."""
        folder = attempt_dir(settings.shared_dir, row.run_id, row.attempt)
        for index in range(row.members):
            key = MemberKey(row.run_id, row.attempt, index)
            for stream in STREAMS:
                offset = self._offsets.get((key, stream), 0)
                paths = run_files(folder, index, restarts, stream)
                start, data = await anyio.to_thread.run_sync(read_runs_from, paths, offset)
                if not data and not ended:
                    continue
                done = await self._logs.append(key, stream, start, data, ended, now_ms())
                self._offsets[(key, stream)] = done.offset
                if done.complete:
                    self._offsets.pop((key, stream), None)
