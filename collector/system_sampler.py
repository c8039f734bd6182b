"""System series: what a member's GPUs and processes did, sampled by the member's collector.

Rules:
- Every ``interval_s`` the collector reads each of its member's GPUs by UUID through NVML
  (:func:`tuneplane.agent.nvml_source.load_nvml`: the real library, or the scripted test double
  when the agent runs with ``--scripted-nvml``) and the member's process tree (the runner named
  in ``runner.json`` and its descendants) through psutil. docs/telemetry.md lists the series.
- The readers are :mod:`.process_reader` and :mod:`.gpu_reader`; a sample's points, keys and
  durably reserved numbers are :mod:`.system_samples`.
- A hung NVML call: the read runs in a worker thread with a time limit; past it the sample goes
  without GPU values and no other NVML read starts until the hung one returns. Shipping never
  waits for NVML.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

import attrs
import trio

from tuneplane.agent.nvml_source import load_nvml

from .defaults import SYSTEM_INTERVAL_S
from .gpu_reader import GpuReader
from .points import ScalarPoint
from .process_reader import ProcessReader
from .system_samples import SEQUENCE_FILE, Reading, SampleNumbers, sample_points

log = logging.getLogger(__name__)

#: The longest one NVML read of a member's GPUs may take before the sample goes without it.
NVML_LIMIT_S = 2.0


@attrs.frozen
class SystemOptions:
    """What the agent tells a member's collector about the member's system series.

    ``gpu_uuids`` in the member's order (rank r is ``system/gpu<r>/...``); ``member_dir`` holds
    the runner's ``runner.json``; ``scripted_nvml`` picks the scripted NVML double; an
    ``interval_s`` of 0 turns system series off.
    """

    interval_s: float = SYSTEM_INTERVAL_S
    gpu_uuids: tuple[str, ...] = ()
    member_dir: Path | None = None
    scripted_nvml: Path | None = None
    gpu_release_file: Path | None = None
    nvml_limit_s: float = NVML_LIMIT_S


SpoolPoints = Callable[[list[ScalarPoint]], Awaitable[None]]


class SystemSampling:
    """The Trio shell: sample every ``interval_s`` until ``stop`` is set, spool each sample.

    ``spool`` makes points durable (the collector's spool); ``spool_full`` says when to skip a
    sample rather than grow the spool past its limit.
    """

    def __init__(
        self,
        opts: SystemOptions,
        state_dir: Path,
        spool: SpoolPoints,
        spool_full: Callable[[], bool],
    ) -> None:
        self.opts = opts
        self.state_dir = state_dir
        self._spool = spool
        self._spool_full = spool_full
        self.processes = ProcessReader(opts.member_dir)
        scripted = opts.scripted_nvml
        self.gpus = GpuReader(lambda: load_nvml(scripted), opts.gpu_uuids, opts.gpu_release_file)
        self.samples = 0
        self._hung_logged = False
        self._full_logged = False

    async def run(self, stop: trio.Event) -> None:
        numbers = await trio.to_thread.run_sync(SampleNumbers, self.state_dir / SEQUENCE_FILE)
        log.info("system sampling interval_s=%g gpus=%s member_dir=%s", self.opts.interval_s,
                 ",".join(self.opts.gpu_uuids) or "-", self.opts.member_dir)  # fmt: skip
        try:
            while not stop.is_set():
                started = trio.current_time()
                await self.sample(numbers)
                with trio.move_on_at(started + self.opts.interval_s):
                    await stop.wait()
        finally:
            with trio.CancelScope(shield=True):
                await self._close()

    async def sample(self, numbers: SampleNumbers) -> None:
        """Take one sample and spool it (nothing when there is nothing to record)."""
        if self._spool_full():
            if not self._full_logged:
                log.warning("spool full; system samples paused until points are delivered")
                self._full_logged = True
            return
        self._full_logged = False
        wall_time = time.time()
        try:
            found = await trio.to_thread.run_sync(self.processes.read)
        except Exception as exc:  # a sample is worth less than the collector
            log.warning("process sample failed error=%r", exc)
            return
        if found is None:
            # The GPUs are the member's only while its runner is alive: before it started or
            # after it ended they may already serve another member.
            return
        readings = found + await self._gpu_readings()
        if not readings:
            return
        number = await trio.to_thread.run_sync(numbers.reserve)
        await self._spool(sample_points(number, wall_time, readings))
        self.samples += 1

    async def _gpu_readings(self) -> list[Reading]:
        reader = self.gpus
        if not reader.uuids:
            return []
        if not reader.busy.acquire(blocking=False):
            if not self._hung_logged:
                log.warning("gpu sample skipped: an earlier NVML call has not returned")
                self._hung_logged = True
            return []

        def work() -> list[Reading]:
            try:
                return reader.read()
            finally:
                reader.busy.release()

        readings: list[Reading] = []
        with trio.move_on_after(self.opts.nvml_limit_s) as scope:
            try:
                readings = await trio.to_thread.run_sync(work, abandon_on_cancel=True)
            except Exception as exc:
                log.warning("gpu sample failed error=%r", exc)
        if scope.cancelled_caught:
            log.warning("gpu sample skipped: NVML did not answer within limit_s=%g; later "
                        "samples skip the GPUs until it does", self.opts.nvml_limit_s)  # fmt: skip
            self._hung_logged = True
            return []
        if self._hung_logged:
            log.info("gpu sample: NVML answers again")
            self._hung_logged = False
        return readings

    async def _close(self) -> None:
        reader = self.gpus
        if not reader.busy.acquire(blocking=False):
            return  # a hung call holds NVML; the process exit lets go of it

        def work() -> None:
            try:
                reader.close()
            finally:
                reader.busy.release()

        with trio.move_on_after(self.opts.nvml_limit_s):
            await trio.to_thread.run_sync(work, abandon_on_cancel=True)
