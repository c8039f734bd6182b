"""System series: what a member's GPUs and processes did, sampled by the member's collector.

Rules:
- Every ``interval_s`` the collector reads each of its member's GPUs by UUID through NVML
  (:func:`tuneplane.agent.nvml_source.load_nvml`: the real library, or the scripted test double
  when the agent runs with ``--scripted-nvml``) and the member's process tree (the runner named
  in ``runner.json`` and its descendants) through psutil. docs/telemetry.md lists the series.
- The values become points of the source ``system`` under tags ``system/...``; that namespace is
  the collector's own (``point_rules`` refuses a ``system/`` tag from any other source, and any
  other tag from the source ``system``), so a workload cannot write into it.
- Keys: a sample's number ``n`` is its points' step and byte offset, a tag's fixed slot their
  index: ``("system", n, slot)``. ``n`` is reserved durably (``system-samples.json``, fsync and
  rename) *before* the sample is spooled, so a restarted collector never reuses a number: a
  spooled sample is shipped once (the spool and the store dedup on the key), and a sample taken
  but never spooled was never a point.
- NVML: NOT_SUPPORTED means "no value". Any other error skips that value for that sample and is
  logged once per GPU, reading and error until it recovers; UNINITIALIZED, DRIVER_NOT_LOADED and
  a library/driver mismatch re-initialise NVML at the next sample. A hung call: the read runs in
  a worker thread with a time limit; past it the sample goes without GPU values and no other NVML
  read starts until the hung one returns. Shipping never waits for NVML.
- While the operator's GPU release (``gpu-release.json``) is in force the collector lets go of
  NVML too, so ``nvidia-smi -r`` can reset a GPU; GPU values pause until it ends.
"""

from __future__ import annotations

import json
import logging
import math
import threading
import time
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path
from typing import Any

import attrs
import psutil
import pynvml
import trio

from tuneplane.agent.atomic_file import write_atomic
from tuneplane.agent.inventory_source import read_release
from tuneplane.agent.nvml_card import nvml_error_text
from tuneplane.agent.nvml_source import load_nvml
from tuneplane.runner.records import RecordError, read_runner_record

from .point_rules import SYSTEM_PREFIX, SYSTEM_SOURCE
from .points import ScalarPoint

log = logging.getLogger(__name__)

SEQUENCE_FILE = "system-samples.json"
DEFAULT_INTERVAL_S = 5.0
#: The longest one NVML read of a member's GPUs may take before the sample goes without it.
NVML_LIMIT_S = 2.0
#: psutil's start times move by a fraction of a second with clock adjustments (as supervision).
START_TIME_TOLERANCE_S = 1.0

PROCESS_SERIES = ("cpu_percent", "rss_bytes", "processes")
GPU_SERIES = (
    "utilization",
    "memory_utilization",
    "memory_used_bytes",
    "power_w",
    "temperature_c",
    "sm_clock_mhz",
    "throttle_reasons",
    "ecc_uncorrected",
    "ecc_corrected",
)
#: Slots 0..15 are the process series; GPU rank r's series start at 16 + 16 * r.
_GPU_BASE = 16
_GPU_SLOTS = 16
# Errors after which NVML must be initialised again (a driver reload or upgrade).
_REINIT = frozenset(
    {
        pynvml.NVML_ERROR_UNINITIALIZED,
        pynvml.NVML_ERROR_DRIVER_NOT_LOADED,
        pynvml.NVML_ERROR_LIB_RM_VERSION_MISMATCH,
    }
)


@attrs.frozen(slots=True)
class Reading:
    """One value of one system series in one sample; ``slot`` is the tag's fixed key index."""

    tag: str
    slot: int
    value: float


def process_reading(name: str, value: float) -> Reading:
    return Reading(SYSTEM_PREFIX + name, PROCESS_SERIES.index(name), value)


def gpu_reading(rank: int, name: str, value: float) -> Reading:
    """``system/gpu<rank>/<name>``; ``rank`` is the GPU's position in the member's list."""
    slot = _GPU_BASE + rank * _GPU_SLOTS + GPU_SERIES.index(name)
    return Reading(f"{SYSTEM_PREFIX}gpu{rank}/{name}", slot, value)


def sample_points(number: int, wall_time: float, readings: Sequence[Reading]) -> list[ScalarPoint]:
    """The points of sample ``number``: step and offset ``number``, index the tag's slot."""
    return [
        ScalarPoint(
            source=SYSTEM_SOURCE,
            tag=r.tag,
            step=number,
            wall_time=wall_time,
            value=r.value,
            offset=number,
            index=r.slot,
            source_id=SYSTEM_SOURCE,
        )
        for r in readings
    ]


class SampleNumbers:
    """The next sample number, reserved on disk before a sample is spooled (blocking)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.next = 0
        try:
            data = json.loads(path.read_bytes())
            self.next = int(data["next"])
            if self.next < 0:
                raise ValueError(f"next is {self.next}")
        except FileNotFoundError:
            pass
        except (OSError, ValueError, KeyError, TypeError) as exc:
            # Never reuse a number: the clock in milliseconds is past any count this file held.
            self.next = int(time.time() * 1000)
            log.error(
                "system sample numbers unreadable; continuing from the clock path=%s error=%s "
                "next=%d",
                path,
                exc,
                self.next,
            )

    def reserve(self) -> int:
        number = self.next
        write_atomic(self.path, json.dumps({"next": number + 1}).encode(), 0o600)
        self.next = number + 1
        return number


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


class GpuReader:
    """The member's GPUs through NVML, by UUID (blocking; one read at a time: :attr:`busy`).

    ``nvml`` makes the NVML module (the real ``pynvml`` or the scripted double); it is called
    on first use, so a broken script or library costs a warning, not the collector.
    """

    def __init__(
        self,
        nvml: Callable[[], Any],
        uuids: Sequence[str],
        release_file: Path | None = None,
        now_ms: Callable[[], int] = lambda: int(time.time() * 1000),
    ) -> None:
        self.uuids = tuple(uuids)
        self.release_file = release_file
        self.busy = threading.Lock()
        self._make = nvml
        self._now_ms = now_ms
        self._nvml: Any = None
        self._initialised = False
        self._handles: dict[int, Any] = {}
        self._failing: dict[tuple[str, ...], str] = {}
        self._release_logged = False

    # --- warnings: once per failing thing, and a note when it works again --------------------

    def _failed(self, what: tuple[str, ...], text: str) -> None:
        if self._failing.get(what) != text:
            self._failing[what] = text
            log.warning("gpu sample skipped %s error=%s", " ".join(what), text)

    def _worked(self, what: tuple[str, ...]) -> None:
        if self._failing.pop(what, None) is not None:
            log.info("gpu sample works again %s", " ".join(what))

    # --- NVML life-cycle ----------------------------------------------------------------------

    def _start(self) -> bool:
        if self._initialised:
            return True
        what = ("call=nvmlInit",)
        try:
            if self._nvml is None:
                self._nvml = self._make()
            self._nvml.nvmlInit()
        except pynvml.NVMLError as exc:
            self._failed(what, nvml_error_text(exc))
            return False
        except Exception as exc:  # the scripted double's own errors, a missing library
            self._failed(what, str(exc))
            return False
        self._worked(what)
        self._initialised = True
        return True

    def close(self) -> None:
        """Let go of NVML (and every handle)."""
        self._handles.clear()
        if not self._initialised:
            return
        self._initialised = False
        try:
            self._nvml.nvmlShutdown()
        except pynvml.NVMLError as exc:
            log.info("nvml shutdown failed error=%s", nvml_error_text(exc))

    def _released(self) -> bool:
        until = read_release(self.release_file)
        if until <= self._now_ms():
            if self._release_logged:
                log.info("gpu release over; gpu samples resume")
                self._release_logged = False
            return False
        if not self._release_logged:
            log.info("gpu release in force; NVML let go until_ms=%d", until)
            self._release_logged = True
        self.close()
        return True

    # --- reading ------------------------------------------------------------------------------

    def read(self) -> list[Reading]:
        """One sample of every GPU; values that NVML could not give are left out."""
        if not self.uuids or self._released() or not self._start():
            return []
        readings: list[Reading] = []
        for rank, uuid in enumerate(self.uuids):
            handle = self._handle(rank, uuid)
            if handle is None:
                continue
            for names, read in _READS:
                what = (f"gpu={uuid}", f"reading={names[0]}")
                try:
                    values = read(self._nvml, handle)
                except pynvml.NVMLError as exc:
                    if exc.value == pynvml.NVML_ERROR_NOT_SUPPORTED:
                        continue
                    if exc.value == pynvml.NVML_ERROR_GPU_IS_LOST:
                        # The whole card: one warning for it, and it is looked up again.
                        self._failed(_card_key(uuid), nvml_error_text(exc))
                        self._handles.pop(rank, None)
                        break
                    self._failed(what, nvml_error_text(exc))
                    if exc.value in _REINIT:
                        self.close()
                        return readings
                    continue
                self._worked(what)
                readings += [
                    gpu_reading(rank, name, value)
                    for name, value in zip(names, values, strict=True)
                    if math.isfinite(value)
                ]
        return readings

    def _handle(self, rank: int, uuid: str) -> Any:
        if rank in self._handles:
            return self._handles[rank]
        what = _card_key(uuid)
        try:
            handle = self._nvml.nvmlDeviceGetHandleByUUID(uuid)
        except pynvml.NVMLError as exc:
            self._failed(what, nvml_error_text(exc))
            if exc.value in _REINIT:
                self.close()
            return None
        self._worked(what)
        self._handles[rank] = handle
        return handle


def _card_key(uuid: str) -> tuple[str, ...]:
    return (f"gpu={uuid}", "call=nvmlDeviceGetHandleByUUID")


def _utilization(nvml: Any, handle: Any) -> tuple[float, ...]:
    rates = nvml.nvmlDeviceGetUtilizationRates(handle)
    return float(rates.gpu), float(rates.memory)


def _throttle(nvml: Any, handle: Any) -> tuple[float, ...]:
    try:
        return (float(nvml.nvmlDeviceGetCurrentClocksEventReasons(handle)),)
    except pynvml.NVMLError as exc:
        if exc.value != pynvml.NVML_ERROR_FUNCTION_NOT_FOUND:
            raise
    # Drivers before 535 know the same bit mask by its older name.
    return (float(nvml.nvmlDeviceGetCurrentClocksThrottleReasons(handle)),)


def _one(call: Callable[[Any, Any], float]) -> Callable[[Any, Any], tuple[float, ...]]:
    return lambda nvml, handle: (float(call(nvml, handle)),)


# Each NVML call once per GPU and sample, and the series its answer fills, in GPU_SERIES order.
_READS: tuple[tuple[tuple[str, ...], Callable[[Any, Any], tuple[float, ...]]], ...] = (
    (("utilization", "memory_utilization"), _utilization),
    (("memory_used_bytes",), _one(lambda n, h: n.nvmlDeviceGetMemoryInfo(h).used)),
    (("power_w",), _one(lambda n, h: n.nvmlDeviceGetPowerUsage(h) / 1000.0)),
    (
        ("temperature_c",),
        _one(lambda n, h: n.nvmlDeviceGetTemperature(h, pynvml.NVML_TEMPERATURE_GPU)),
    ),
    (("sm_clock_mhz",), _one(lambda n, h: n.nvmlDeviceGetClockInfo(h, pynvml.NVML_CLOCK_SM))),
    (("throttle_reasons",), _throttle),
    (
        ("ecc_uncorrected",),
        _one(
            lambda n, h: n.nvmlDeviceGetTotalEccErrors(
                h, pynvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED, pynvml.NVML_VOLATILE_ECC
            )
        ),
    ),
    (
        ("ecc_corrected",),
        _one(
            lambda n, h: n.nvmlDeviceGetTotalEccErrors(
                h, pynvml.NVML_MEMORY_ERROR_TYPE_CORRECTED, pynvml.NVML_VOLATILE_ECC
            )
        ),
    ),
)


@attrs.frozen
class SystemOptions:
    """What the agent tells a member's collector about the member's system series.

    ``gpu_uuids`` in the member's order (rank r is ``system/gpu<r>/...``); ``member_dir`` holds
    the runner's ``runner.json``; ``scripted_nvml`` picks the scripted NVML double; an
    ``interval_s`` of 0 turns system series off.
    """

    interval_s: float = DEFAULT_INTERVAL_S
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
