"""The member's GPUs through NVML, by UUID: :class:`GpuReader` and the NVML calls it makes.

Rules:
- NVML: NOT_SUPPORTED means "no value". Any other error skips that value for that sample and is
  logged once per GPU, reading and error until it recovers; UNINITIALIZED, DRIVER_NOT_LOADED and
  a library/driver mismatch re-initialise NVML at the next sample. Blocking: the sampler runs a
  read in a worker thread with a time limit, one read at a time (:attr:`GpuReader.busy`).
- While the operator's GPU release (``gpu-release.json``) is in force the collector lets go of
  NVML too, so ``nvidia-smi -r`` can reset a GPU; GPU values pause until it ends.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import pynvml

from tuneplane.agent.inventory_source import read_release
from tuneplane.agent.nvml_card import nvml_error_text

from .system_samples import Reading, gpu_reading

log = logging.getLogger(__name__)

# Errors after which NVML must be initialised again (a driver reload or upgrade).
_REINIT = frozenset(
    {
        pynvml.NVML_ERROR_UNINITIALIZED,
        pynvml.NVML_ERROR_DRIVER_NOT_LOADED,
        pynvml.NVML_ERROR_LIB_RM_VERSION_MISMATCH,
    }
)


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
