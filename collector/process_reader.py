"""CPU and memory of a member's process tree (the runner in ``runner.json`` and its descendants).

Rules: blocking (the sampler calls it in a worker thread); the runner is known by pid *and*
start time, never pid alone, and a zombie runner has ended; no runner alive means no reading.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path

import psutil

from tuneplane.runner.records import RecordError, read_runner_record

from .system_samples import Reading, process_reading

log = logging.getLogger(__name__)

#: psutil's start times move by a fraction of a second with clock adjustments (as supervision).
START_TIME_TOLERANCE_S = 1.0


class ProcessReader:
    """CPU and memory of the member's process tree: the runner and all its descendants.

    ``cpu_percent`` is CPU time used since the previous sample over the wall time between them
    (100 = one core busy); ``rss_bytes`` sums the processes' resident memory (a page shared by
    two processes counts twice); ``processes`` counts them. :meth:`read` is None while no runner
    of the member is alive (not yet, or no more).
    """

    def __init__(self, member_dir: Path | None) -> None:
        self.member_dir = member_dir
        # (pid, create time) -> CPU seconds at the previous sample.
        self._cpu: dict[tuple[int, float], float] = {}
        self._at: float | None = None

    def _runner(self) -> psutil.Process | None:
        if self.member_dir is None:
            return None
        try:
            record = read_runner_record(self.member_dir)
        except RecordError as exc:
            log.warning("runner record unreadable member_dir=%s error=%s", self.member_dir, exc)
            return None
        if record is None:
            return None
        try:
            proc = psutil.Process(record.pid)
            if abs(proc.create_time() - record.start_time) > START_TIME_TOLERANCE_S:
                return None
            if proc.status() == psutil.STATUS_ZOMBIE:
                return None  # it ended; nobody reaped it yet
        except psutil.Error:
            return None
        return proc

    def read(self) -> list[Reading] | None:
        runner = self._runner()
        now = time.monotonic()
        if runner is None:
            self._cpu.clear()
            self._at = None
            return None
        try:
            tree = [runner, *runner.children(recursive=True)]
        except psutil.Error:
            return None
        cpu: dict[tuple[int, float], float] = {}
        used = 0.0
        rss = 0
        for proc in tree:
            try:
                with proc.oneshot():
                    times = proc.cpu_times()
                    key = (proc.pid, proc.create_time())
                    resident = proc.memory_info().rss
            except psutil.Error:
                continue  # it exited between the listing and the read
            spent = times.user + times.system
            cpu[key] = spent
            rss += resident
            # A process not seen before started after the previous sample (or this is the
            # first): all its CPU time belongs to this interval.
            used += spent - self._cpu.get(key, 0.0)
        if not cpu:
            return None  # every process ended between the listing and the read
        readings = [process_reading("rss_bytes", rss), process_reading("processes", len(cpu))]
        if self._at is not None and now > self._at:
            percent = max(used, 0.0) / (now - self._at) * 100.0
            readings.insert(0, process_reading("cpu_percent", percent))
        self._cpu = cpu
        self._at = now
        return readings
