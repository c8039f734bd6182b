"""What this Node has to offer: host CPU and memory, and GPUs from exactly one named source.

Rules: GPUs come from NVML (``gpu_source="nvml"``), or from an explicit ``--simulate-gpus
SERIES:N`` (``"simulated"``), or there are none (``"none"``); a missing NVML never turns into a
fake GPU. A GPU with an XID event, uncorrected ECC errors or a remapped-row failure is reported
``healthy=False`` with the reason, and the daemon never assigns it.
"""

from __future__ import annotations

import logging
import re
import socket
from collections.abc import Callable
from typing import Any

import attrs
import psutil

log = logging.getLogger(__name__)

# Per-card memory of a simulated GPU, by Series; anything else gets 80 GiB.
_SIMULATED_MEMORY = {"h200": 141 * 2**30, "h100": 80 * 2**30, "a100": 80 * 2**30}
_SERIES = re.compile(r"^[a-z][a-z0-9-]{0,31}$")
_XID_CRITICAL = (13, 31, 43, 45, 48, 61, 62, 63, 64, 68, 69, 74, 79, 92, 94, 95, 119, 120)


class InventoryError(ValueError):
    """The inventory cannot be read as configured. ``str()`` says what and how to fix it."""


@attrs.frozen
class Gpu:
    index: int
    uuid: str
    name: str
    series: str
    memory_bytes: int
    mig_enabled: bool
    healthy: bool
    health_reason: str = ""
    # NVML's recovery action for the card ("none", "gpu_reset", "drain_and_reset", ...; "" when
    # NVML cannot say). agent/xid_book.py clears XIDs when it goes back to "none" after a reset.
    recovery_action: str = ""


@attrs.frozen
class XidEvent:
    """An XID the driver reported; ``uuid`` is "" when the card could not be identified."""

    uuid: str
    xid: int
    at_ms: int


@attrs.frozen
class Inventory:
    hostname: str
    cpu_count: int
    memory_bytes: int
    gpus: tuple[Gpu, ...]
    gpu_source: str
    driver_version: str = ""
    cuda_version: str = ""
    # Why there are no GPUs when ``gpu_source == "none"`` (shown by status and doctor).
    note: str = ""

    def gpu(self, index: int) -> Gpu | None:
        return next((g for g in self.gpus if g.index == index), None)


@attrs.frozen
class SimulatedGpus:
    series: str
    count: int


def parse_simulate_gpus(text: str) -> SimulatedGpus:
    """Read ``SERIES:N`` (``h200:2``). Raises :class:`InventoryError` with the fix."""
    series, sep, count = text.partition(":")
    series = series.strip().lower()
    if not sep or not _SERIES.match(series) or not count.isdigit() or not 0 < int(count) <= 64:
        raise InventoryError(
            f"--simulate-gpus {text!r} is not SERIES:N; write the Series and a count from 1 to "
            "64, for example --simulate-gpus h200:2."
        )
    return SimulatedGpus(series, int(count))


def _host(hostname: str) -> tuple[str, int, int]:
    return hostname, psutil.cpu_count(logical=True) or 1, int(psutil.virtual_memory().total)


def simulated_inventory(node_name: str, sim: SimulatedGpus) -> Inventory:
    """The host as it is, plus ``sim.count`` GPUs named as simulated (never mistaken for real)."""
    hostname, cpus, memory = _host(node_name)
    gpus = tuple(
        Gpu(
            index=i,
            uuid=f"GPU-sim-{node_name}-{i}",
            name=f"Simulated {sim.series.upper()}",
            series=sim.series,
            memory_bytes=_SIMULATED_MEMORY.get(sim.series, 80 * 2**30),
            mig_enabled=False,
            healthy=True,
        )
        for i in range(sim.count)
    )
    return Inventory(hostname, cpus, memory, gpus, "simulated")


def series_of(name: str) -> str:
    """The Series of an NVML product name: "NVIDIA H200" -> "h200", "A100-SXM4-80GB" -> "a100"."""
    for word in re.split(r"[\s\-_]+", name.lower()):
        if re.fullmatch(r"[a-z]{1,3}\d{2,4}[a-z]?", word) and word != "nvidia":
            return word
    return re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-") or "unknown"


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def _probe(fn: Callable[..., Any], *args: Any) -> Any:
    """Call an NVML query that a card or driver may not support; ``None`` when it does not."""
    import pynvml

    try:
        return fn(*args)
    except pynvml.NVMLError:
        return None


def _health(handle: Any, xid_seen: dict[int, int], index: int) -> str:
    """Why the card must not be assigned, or "" when it may."""
    import pynvml

    if index in xid_seen:
        return f"XID {xid_seen[index]} event reported by the driver"
    ecc = _probe(
        pynvml.nvmlDeviceGetTotalEccErrors,
        handle,
        pynvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED,
        pynvml.NVML_VOLATILE_ECC,
    )
    if ecc:
        return f"{ecc} uncorrected ECC errors since the driver loaded"
    remapped = _probe(pynvml.nvmlDeviceGetRemappedRows, handle)
    if remapped is not None:
        _corr, _unc, pending, failure = remapped
        if failure:
            return "row remapping failed; the card needs service"
        if pending:
            return "a row remapping is pending; reset the GPU to apply it"
    return ""


class NvmlSource:
    """GPUs as NVML reports them. Holds an XID event set so health survives between probes."""

    def __init__(self) -> None:
        self._initialised = False
        self._event_set: Any = None
        self._xid_seen: dict[int, int] = {}
        self._uuid_index: dict[str, int] = {}

    def take_xid_events(self) -> list[XidEvent]:
        """The XIDs drained since the last call (none are handed over yet: see _drain_xid)."""
        return []

    def _drain_xid(self) -> None:
        import pynvml

        if self._event_set is None:
            return
        while True:
            try:
                data = pynvml.nvmlEventSetWait_v2(self._event_set, 0)
            except pynvml.NVMLError:
                return
            xid = int(data.eventData)
            uuid = _text(_probe(pynvml.nvmlDeviceGetUUID, data.device) or "")
            if xid in _XID_CRITICAL and uuid in self._uuid_index:
                self._xid_seen[self._uuid_index[uuid]] = xid
                log.warning("gpu xid event gpu=%d xid=%d", self._uuid_index[uuid], xid)

    def collect(self, node_name: str) -> Inventory:
        """Read every GPU; an NVML that cannot load gives zero GPUs with ``gpu_source="none"``."""
        import pynvml

        hostname, cpus, memory = _host(node_name)
        if not self._initialised:
            try:
                pynvml.nvmlInit()
            except pynvml.NVMLError as exc:
                note = f"NVML not found: this Node reports 0 GPUs ({exc})"
                return Inventory(hostname, cpus, memory, (), "none", note=note)
            # Stay initialised for the source's lifetime: the XID event set lives in NVML.
            self._initialised = True
        try:
            return self._read(pynvml, hostname, cpus, memory)
        except pynvml.NVMLError as exc:
            raise InventoryError(f"NVML failed while reading the GPUs: {exc}.") from exc

    def _read(self, pynvml: Any, hostname: str, cpus: int, memory: int) -> Inventory:
        if self._event_set is None:
            self._event_set = _probe(pynvml.nvmlEventSetCreate)
        self._drain_xid()
        gpus = []
        for index in range(pynvml.nvmlDeviceGetCount()):
            handle = pynvml.nvmlDeviceGetHandleByIndex(index)
            uuid = _text(pynvml.nvmlDeviceGetUUID(handle))
            if uuid not in self._uuid_index and self._event_set is not None:
                _probe(
                    pynvml.nvmlDeviceRegisterEvents,
                    handle,
                    pynvml.nvmlEventTypeXidCriticalError,
                    self._event_set,
                )
            self._uuid_index[uuid] = index
            name = _text(pynvml.nvmlDeviceGetName(handle))
            mig = _probe(pynvml.nvmlDeviceGetMigMode, handle)
            reason = _health(handle, self._xid_seen, index)
            gpus.append(
                Gpu(
                    index=index,
                    uuid=uuid,
                    name=name,
                    series=series_of(name),
                    memory_bytes=int(pynvml.nvmlDeviceGetMemoryInfo(handle).total),
                    mig_enabled=bool(mig and mig[0] == pynvml.NVML_DEVICE_MIG_ENABLE),
                    healthy=not reason,
                    health_reason=reason,
                )
            )
        driver = _text(_probe(pynvml.nvmlSystemGetDriverVersion) or "")
        cuda = _probe(pynvml.nvmlSystemGetCudaDriverVersion_v2)
        cuda_text = f"{cuda // 1000}.{cuda % 1000 // 10}" if cuda else ""
        return Inventory(hostname, cpus, memory, tuple(gpus), "nvml", driver, cuda_text)


def default_node_name() -> str:
    return socket.gethostname()


class InventorySource:
    """One configured source: simulated when ``simulate`` is given, NVML otherwise."""

    def __init__(self, node_name: str, simulate: SimulatedGpus | None) -> None:
        self.node_name = node_name
        self.simulate = simulate
        self._nvml = NvmlSource() if simulate is None else None

    def take_xid_events(self) -> list[XidEvent]:
        """The XIDs drained since the last call, for the daemon to journal and judge."""
        return self._nvml.take_xid_events() if self._nvml is not None else []

    def collect(self) -> Inventory:
        if self._nvml is None:
            assert self.simulate is not None
            return simulated_inventory(self.node_name, self.simulate)
        return self._nvml.collect(self.node_name)
