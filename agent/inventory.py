"""What this Node has to offer: host CPU and memory, and GPUs from exactly one named source.

Rules:
- GPUs come from NVML (``gpu_source="nvml"``), from the scripted NVML test double
  (``"scripted-nvml"``, only with ``--scripted-nvml FILE``), from an explicit ``--simulate-gpus
  SERIES:N`` (``"simulated"``), or there are none (``"none"``: the NVML library is not on this
  machine). A missing NVML never turns into a fake GPU, and a broken driver is not "none": it is
  reported in ``Inventory.problem``.
- Only ``NVML_ERROR_NOT_SUPPORTED`` means "no data". Any other error on a per-GPU call marks that
  GPU unhealthy with the error named; one bad card never stops the read or hides the others. A
  read that fails as a whole (init, count) marks every GPU known from the last read unhealthy;
  nothing reuses a stale healthy verdict.
- ``health_reason`` is what the probe found (errors, ECC, remapped rows, retired pages, lost, MIG,
  unresponsive, released). XIDs are not judged here: :meth:`NvmlSource.take_xid_events` hands the
  drained events to the daemon (agent/xid_book.py judges them), each matched to its card by
  comparing the event's handle with the handles of this read, uuid "" when it matches none.
- A MIG-enabled GPU is refused (unhealthy, with how to disable MIG): a Resource Pool is whole,
  identical GPUs. Its MIG devices are still inventoried (``MIG-`` UUID, memory, profile).
- NVML is initialised again (and the XID event set re-created) after UNINITIALIZED,
  DRIVER_NOT_LOADED or LIB_RM_VERSION_MISMATCH, and let go of while an operator's release
  request (``tuneplane-node gpu release``) is in force, so ``nvidia-smi -r`` can reset a GPU.
- :func:`probe` reads in a thread with a time limit; a hung NVML call is abandoned (never blocks
  shutdown) and every known GPU reads "NVML unresponsive" until a read completes again.
"""

from __future__ import annotations

import json
import logging
import re
import socket
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import attrs
import psutil
import pynvml
import trio

log = logging.getLogger(__name__)

# Per-card memory of a simulated GPU, by Series; anything else gets 80 GiB.
_SIMULATED_MEMORY = {"h200": 141 * 2**30, "h100": 80 * 2**30, "a100": 80 * 2**30}
_SERIES = re.compile(r"^[a-z][a-z0-9-]{0,31}$")
#: How long one probe may take before its GPUs read "NVML unresponsive".
PROBE_LIMIT_S = 20.0
#: Errors after which NVML is shut down and initialised again (a driver reload or upgrade).
_REINIT_ERRORS = frozenset(
    {
        pynvml.NVML_ERROR_UNINITIALIZED,
        pynvml.NVML_ERROR_DRIVER_NOT_LOADED,
        pynvml.NVML_ERROR_LIB_RM_VERSION_MISMATCH,
    }
)
_ERROR_NAMES = {
    getattr(pynvml, n): n
    for n in dir(pynvml)
    if n.startswith("NVML_ERROR_") and n != "NVML_ERROR_STRING"
}
# NVML_FI_DEV_GET_GPU_RECOVERY_ACTION (230) is missing from older nvidia-ml-py releases.
_FI_RECOVERY_ACTION = int(getattr(pynvml, "NVML_FI_DEV_GET_GPU_RECOVERY_ACTION", 230))
_RECOVERY_NAMES = {
    0: "none",
    1: "gpu_reset",
    2: "node_reboot",
    3: "drain_p2p",
    4: "drain_and_reset",
    5: "recover_imex_domain",
    6: "bus_reset",
    7: "system_reboot",
}
#: NVIDIA's replacement threshold for retired pages on pre-Ampere cards.
_RETIRED_PAGES_LIMIT = 64
_MIG_PROFILE = re.compile(r"\bMIG\s+(\S+)\s*$")


class InventoryError(ValueError):
    """The inventory cannot be read as configured. ``str()`` says what and how to fix it."""


@attrs.frozen
class MigDevice:
    """One MIG device of a MIG-enabled GPU, as NVML names it (inventoried, never assigned)."""

    uuid: str
    memory_bytes: int
    profile: str


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
    # NVML's recovery action ("none", "gpu_reset", "drain_and_reset", ...); "" when unknown.
    recovery_action: str = ""
    mig_devices: tuple[MigDevice, ...] = ()
    # The N of the card's device node /dev/nvidia<N> (NVML's minor number; the driver numbers
    # them in its own order, not always NVML's index order); None when unknown.
    minor_number: int | None = None


@attrs.frozen
class XidEvent:
    """An XID the driver reported; ``uuid`` "" when its card could not be identified."""

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
    # What is wrong with the GPU read as a whole ("" when it worked); doctor reports an error.
    problem: str = ""
    # Whether the XID events could be registered ("" for a source without events).
    xid_events: str = ""
    # While an operator's release is in force: when NVML is taken back (ms since the epoch).
    released_until_ms: int = 0

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


def load_nvml(scripted: Path | None) -> Any:
    """The real ``pynvml`` module, or the scripted test double when ``scripted`` names a file."""
    if scripted is None:
        return pynvml
    from .scripted_nvml import ScriptedNvml

    return ScriptedNvml(scripted)


def nvml_error_text(exc: pynvml.NVMLError) -> str:
    """``GPU is lost (NVML_ERROR_GPU_IS_LOST)``: NVML's words and the code's name."""
    try:
        words = str(exc)
    except Exception:  # pynvml asks the library for unknown codes; it may not be loaded
        words = "NVML error"
    name = _ERROR_NAMES.get(getattr(exc, "value", None), f"code {getattr(exc, 'value', '?')}")
    return f"{words} ({name})"


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def _handle_key(handle: Any) -> Any:
    """What identifies a device handle: the pointer's address (ctypes), the handle otherwise."""
    import ctypes

    if isinstance(handle, ctypes._Pointer):
        return ctypes.cast(handle, ctypes.c_void_p).value
    return handle


def _now_ms() -> int:
    return time.time_ns() // 1_000_000


class _Reinit(Exception):
    """A call failed in a way that needs NVML initialised again."""

    def __init__(self, error: pynvml.NVMLError) -> None:
        super().__init__(nvml_error_text(error))
        self.error = error


def nvml_advice(code: int) -> str:
    """What an operator does about NVML failing to start with ``code``."""
    if code == pynvml.NVML_ERROR_DRIVER_NOT_LOADED:
        return (
            "the NVIDIA kernel driver is not loaded: load it (`modprobe nvidia`) or reinstall "
            "the driver; the agent picks the GPUs up at its next probe"
        )
    if code == pynvml.NVML_ERROR_LIB_RM_VERSION_MISMATCH:
        return (
            "the NVML library and the loaded kernel driver are different versions (a driver "
            "upgrade without a module reload): reload the nvidia modules or reboot"
        )
    if code == pynvml.NVML_ERROR_NO_PERMISSION:
        return "the agent may not open /dev/nvidia*: run it as root or fix the device permissions"
    return "check `nvidia-smi` and the kernel log (`dmesg`)"


@attrs.frozen
class MemoryCounters:
    """What NVML said about a card's memory; None where it had no answer."""

    ecc_uncorrected: int | None = None
    # (corrected, uncorrected, pending, failure), Ampere and later.
    remapped_rows: tuple[int, ...] | None = None
    # Page retirement, before Ampere.
    pages_pending: bool | None = None
    pages_retired: int | None = None


def memory_reasons(found: MemoryCounters) -> list[str]:
    """Why the card's memory makes it unusable (pure: the counters in, sentences out)."""
    reasons = []
    if found.ecc_uncorrected:
        reasons.append(f"{found.ecc_uncorrected} uncorrected ECC errors since the driver loaded")
    if found.remapped_rows is not None:
        _corr, _unc, pending, failure = found.remapped_rows
        if failure:
            reasons.append("row remapping failed; the card needs service")
        elif pending:
            reasons.append("a row remapping is pending; reset the GPU to apply it")
    if found.pages_pending:
        reasons.append("a page retirement is pending; reset the GPU to apply it")
    if found.pages_retired is not None and found.pages_retired >= _RETIRED_PAGES_LIMIT:
        reasons.append(
            f"{found.pages_retired} memory pages are retired, NVIDIA's replacement threshold; "
            "the card needs service"
        )
    return reasons


class _Lost(Exception):
    """The card answered GPU_IS_LOST: nothing more is asked of it in this read."""


_UNSUPPORTED = object()


class _Card:
    """One card's answers, and every reason it cannot be trusted."""

    def __init__(self, of_card: bool = True) -> None:
        # False for system-wide calls (driver version): GPU_IS_LOST there is one more failure,
        # not a card to stop asking.
        self.of_card = of_card
        self.reasons: list[str] = []

    def failed(self, what: str, exc: pynvml.NVMLError) -> None:
        self.reasons.append(f"NVML could not read its {what}: {nvml_error_text(exc)}")

    def ask(self, what: str, fn: Callable[..., Any], *args: Any, need: bool = False) -> Any:
        """NVML's answer; ``_UNSUPPORTED`` for NOT_SUPPORTED; None when it failed (a reason).

        ``need``: the card cannot be used without the answer (handle, UUID, name, memory), so
        NOT_SUPPORTED is a failure too.
        """
        try:
            return fn(*args)
        except pynvml.NVMLError as exc:
            if exc.value == pynvml.NVML_ERROR_NOT_SUPPORTED and not need:
                return _UNSUPPORTED
            if exc.value in _REINIT_ERRORS:
                raise _Reinit(exc) from exc
            self.failed(what, exc)
            if exc.value == pynvml.NVML_ERROR_GPU_IS_LOST and self.of_card:
                raise _Lost from exc
            return None
        except InventoryError:
            raise
        except Exception as exc:  # a binding that does not know the call, a ctypes fault
            self.reasons.append(f"NVML could not read its {what}: {type(exc).__name__}: {exc}")
            return None


def _mig_refusal(gpu: str) -> str:
    return (
        "MIG is enabled; TunePlane assigns whole GPUs only: disable it with "
        f"`nvidia-smi -i {gpu} -mig 0` and reset the GPU"
    )


class NvmlSource:
    """GPUs as NVML (or its scripted double) reports them, read by read, with the XID events.

    Not thread-safe on its own: :class:`InventorySource` lets one read run at a time.
    """

    def __init__(self, nvml: Any, source_name: str) -> None:
        self.nvml = nvml
        self.source_name = source_name
        self.last: Inventory | None = None
        self._initialised = False
        self._event_set: Any = None
        self._events_problem = ""
        self._registered: dict[Any, str] = {}  # handle key -> "" or why registration failed
        self._handle_uuid: dict[Any, str] = {}
        self._pending: list[XidEvent] = []
        self._pending_lock = threading.Lock()

    def take_xid_events(self) -> list[XidEvent]:
        """The XID events drained since the last call (each handed out once)."""
        with self._pending_lock:
            taken, self._pending = self._pending, []
        return taken

    # --- the read -----------------------------------------------------------------------------

    def collect(self, node_name: str, released_until_ms: int = 0) -> Inventory:
        """Read every GPU. Never raises for an NVML error: it is in the GPUs or ``problem``."""
        host = _host(node_name)
        if released_until_ms > _now_ms():
            self.release()
            until = time.strftime("%H:%M:%S", time.gmtime(released_until_ms / 1000))
            reason = f"NVML released for a GPU reset by the operator until {until} UTC"
            inventory = self._all_unhealthy(host, reason, "", released_until_ms)
        else:
            try:
                inventory = self._read(host)
            except _Reinit as first:
                log.warning("nvml initialising again reason=%s", first)
                self.release()
                try:
                    inventory = self._read(host)
                except _Reinit as again:
                    self.release()
                    problem = (
                        f"NVML failed with {again} and initialising it again did not help; "
                        f"{nvml_advice(again.error.value)}"
                    )
                    inventory = self._all_unhealthy(host, problem, problem)
        self.last = inventory
        return inventory

    def release(self) -> None:
        """Let go of NVML and the event set (so ``nvidia-smi -r`` can reset a GPU)."""
        self._drop_event_set()
        # Handles are only good for one initialisation: a new one may give the same address to
        # another card.
        self._handle_uuid = {}
        if self._initialised:
            self._initialised = False
            try:
                self.nvml.nvmlShutdown()
            except pynvml.NVMLError as exc:
                log.info("nvml shutdown failed error=%s", nvml_error_text(exc))
            log.info("nvml released")

    def _all_unhealthy(
        self, host: tuple[str, int, int], reason: str, problem: str, released_until_ms: int = 0
    ) -> Inventory:
        """Every GPU known from the last read, unhealthy with ``reason``."""
        last = self.last
        gpus = tuple(
            attrs.evolve(g, healthy=False, health_reason=reason)
            for g in (last.gpus if last else ())
        )
        return Inventory(
            *host,
            gpus,
            self.source_name,
            last.driver_version if last else "",
            last.cuda_version if last else "",
            problem=problem,
            xid_events="",
            released_until_ms=released_until_ms,
        )

    def _read(self, host: tuple[str, int, int]) -> Inventory:
        nvml = self.nvml
        if not self._initialised:
            try:
                nvml.nvmlInit()
            except pynvml.NVMLError as exc:
                known = self.last is not None and bool(self.last.gpus)
                if exc.value == pynvml.NVML_ERROR_LIBRARY_NOT_FOUND and not known:
                    note = (
                        "NVML library not found: this Node reports 0 GPUs (right for a machine "
                        "without NVIDIA GPUs)"
                    )
                    source = "none" if self.source_name == "nvml" else self.source_name
                    return Inventory(*host, (), source, note=note)
                problem = f"NVML could not start: {nvml_error_text(exc)}; {nvml_advice(exc.value)}"
                log.error("nvml init failed error=%s", nvml_error_text(exc))
                return self._all_unhealthy(host, problem, problem)
            self._initialised = True
        try:
            count = int(nvml.nvmlDeviceGetCount())
        except pynvml.NVMLError as exc:
            if exc.value in _REINIT_ERRORS:
                raise _Reinit(exc) from exc
            problem = f"NVML could not count the GPUs: {nvml_error_text(exc)}"
            log.error("nvml read failed error=%s", nvml_error_text(exc))
            return self._all_unhealthy(host, problem, problem)
        self._ensure_event_set()
        previous = {g.uuid: g for g in (self.last.gpus if self.last else ()) if g.uuid}
        gpus: list[Gpu] = []
        handles: dict[Any, str] = {}
        for index in range(count):
            gpu, handle = self._read_card(index, previous)
            gpus.append(gpu)
            if handle is not None:
                handles[_handle_key(handle)] = gpu.uuid
                self._register(handle, gpu)
        self._drain(handles)
        versions = _Card(of_card=False)
        driver = versions.ask("driver version", nvml.nvmlSystemGetDriverVersion)
        cuda = versions.ask("CUDA version", nvml.nvmlSystemGetCudaDriverVersion_v2)
        cuda_text = f"{cuda // 1000}.{cuda % 1000 // 10}" if isinstance(cuda, int) and cuda else ""
        return Inventory(
            *host,
            tuple(gpus),
            self.source_name,
            _text(driver) if isinstance(driver, (str, bytes)) else "",
            cuda_text,
            xid_events=self._events_text(handles),
        )

    def _read_card(self, index: int, previous: dict[str, Gpu]) -> tuple[Gpu, Any]:
        nvml = self.nvml
        card = _Card()
        handle: Any = None
        uuid = ""
        name: Any = None
        memory: Any = None
        recovery = ""
        minor: Any = None
        mig_enabled = False
        mig_devices: tuple[MigDevice, ...] = ()
        try:
            handle = card.ask("handle", nvml.nvmlDeviceGetHandleByIndex, index, need=True)
            if handle is not None:
                key = _handle_key(handle)
                uuid = self._handle_uuid.get(key, "")  # known from an earlier read, if any
                answer = card.ask("UUID", nvml.nvmlDeviceGetUUID, handle, need=True)
                if isinstance(answer, (str, bytes)):
                    uuid = self._handle_uuid[key] = _text(answer)
                name = card.ask("name", nvml.nvmlDeviceGetName, handle, need=True)
                memory = card.ask("memory size", nvml.nvmlDeviceGetMemoryInfo, handle, need=True)
                minor = card.ask("device minor number", nvml.nvmlDeviceGetMinorNumber, handle)
                arch = card.ask("architecture", nvml.nvmlDeviceGetArchitecture, handle)
                self._check_memory(card, handle, arch)
                mig_enabled, mig_devices = self._mig(card, handle, uuid or str(index))
                recovery = self._recovery(card, handle)
        except _Lost:
            pass
        if handle is None and self.last is not None and (at := self.last.gpu(index)):
            uuid = at.uuid  # no handle: the card the last read saw at this index
        old = previous.get(uuid)
        name_text = _text(name) if isinstance(name, (str, bytes)) else (old.name if old else "")
        total = int(memory.total) if memory is not None else 0
        reason = "; ".join(dict.fromkeys(card.reasons))
        gpu = Gpu(
            index=index,
            uuid=uuid,
            name=name_text or "unknown",
            series=series_of(name_text) if name_text else "unknown",
            memory_bytes=total or (old.memory_bytes if old else 0),
            mig_enabled=mig_enabled,
            healthy=not reason,
            health_reason=reason,
            recovery_action=recovery,
            mig_devices=mig_devices,
            minor_number=minor if isinstance(minor, int) else None,
        )
        if reason:
            log.debug("gpu unhealthy gpu=%d gpu_uuid=%s reason=%s", index, uuid, reason)
        return gpu, handle

    def _check_memory(self, card: _Card, handle: Any, arch: Any) -> None:
        """ECC counters, remapped rows (Ampere on) or retired pages (before Ampere)."""
        nvml = self.nvml
        ecc = card.ask(
            "ECC counters",
            nvml.nvmlDeviceGetTotalEccErrors,
            handle,
            pynvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED,
            pynvml.NVML_VOLATILE_ECC,
        )
        rows = card.ask("remapped rows", nvml.nvmlDeviceGetRemappedRows, handle)
        found = MemoryCounters(
            ecc_uncorrected=ecc if isinstance(ecc, int) else None,
            remapped_rows=tuple(rows) if isinstance(rows, (tuple, list)) else None,
        )
        pre_ampere = isinstance(arch, int) and arch < pynvml.NVML_DEVICE_ARCH_AMPERE
        if pre_ampere or rows is _UNSUPPORTED:
            pending = card.ask("retired pages", nvml.nvmlDeviceGetRetiredPagesPendingStatus, handle)
            retired: int | None = 0
            for cause in (
                pynvml.NVML_PAGE_RETIREMENT_CAUSE_DOUBLE_BIT_ECC_ERROR,
                pynvml.NVML_PAGE_RETIREMENT_CAUSE_MULTIPLE_SINGLE_BIT_ECC_ERRORS,
            ):
                pages = card.ask("retired pages", nvml.nvmlDeviceGetRetiredPages, handle, cause)
                if isinstance(pages, list) and retired is not None:
                    retired += len(pages)
                else:
                    retired = None
            found = attrs.evolve(
                found,
                pages_pending=bool(pending) if isinstance(pending, int) else None,
                pages_retired=retired,
            )
        card.reasons.extend(memory_reasons(found))

    def _mig(self, card: _Card, handle: Any, gpu: str) -> tuple[bool, tuple[MigDevice, ...]]:
        nvml = self.nvml
        mode = card.ask("MIG mode", nvml.nvmlDeviceGetMigMode, handle)
        if not isinstance(mode, (list, tuple)) or mode[0] != pynvml.NVML_DEVICE_MIG_ENABLE:
            return False, ()
        card.reasons.append(_mig_refusal(gpu))
        slots = card.ask("MIG device count", nvml.nvmlDeviceGetMaxMigDeviceCount, handle)
        devices = []
        for slot in range(slots if isinstance(slots, int) else 0):
            try:
                mig = nvml.nvmlDeviceGetMigDeviceHandleByIndex(handle, slot)
            except pynvml.NVMLError as exc:
                if exc.value in (pynvml.NVML_ERROR_NOT_FOUND, pynvml.NVML_ERROR_INVALID_ARGUMENT):
                    continue  # an empty slot
                if exc.value in _REINIT_ERRORS:
                    raise _Reinit(exc) from exc
                card.failed("MIG devices", exc)
                break
            mig_uuid = card.ask("MIG device UUID", nvml.nvmlDeviceGetUUID, mig)
            mig_memory = card.ask("MIG device memory", nvml.nvmlDeviceGetMemoryInfo, mig)
            mig_name = card.ask("MIG device name", nvml.nvmlDeviceGetName, mig)
            if not isinstance(mig_uuid, (str, bytes)):
                continue
            profile = ""
            if isinstance(mig_name, (str, bytes)) and (m := _MIG_PROFILE.search(_text(mig_name))):
                profile = m.group(1)
            size = getattr(mig_memory, "total", 0)
            devices.append(MigDevice(_text(mig_uuid), int(size), profile))
        return True, tuple(devices)

    def _recovery(self, card: _Card, handle: Any) -> str:
        values = card.ask(
            "recovery action", self.nvml.nvmlDeviceGetFieldValues, handle, [_FI_RECOVERY_ACTION]
        )
        if values is None or values is _UNSUPPORTED:
            return ""
        field = values[0]
        ret = int(field.nvmlReturn)
        if ret == pynvml.NVML_SUCCESS:
            code = int(field.value.uiVal)
            return _RECOVERY_NAMES.get(code, f"action-{code}")
        if ret != pynvml.NVML_ERROR_NOT_SUPPORTED:
            card.failed("recovery action", pynvml.NVMLError(ret))
        return ""

    # --- XID events ---------------------------------------------------------------------------

    def _ensure_event_set(self) -> None:
        if self._event_set is not None:
            return
        try:
            self._event_set = self.nvml.nvmlEventSetCreate()
            self._events_problem = ""
        except pynvml.NVMLError as exc:
            if exc.value in _REINIT_ERRORS:
                raise _Reinit(exc) from exc
            self._events_problem = f"NVML could not create an event set: {nvml_error_text(exc)}"
            log.warning("gpu xid events unavailable error=%s", nvml_error_text(exc))
        self._registered = {}

    def _drop_event_set(self) -> None:
        if self._event_set is not None:
            try:
                self.nvml.nvmlEventSetFree(self._event_set)
            except pynvml.NVMLError as exc:
                log.info("nvml event set free failed error=%s", nvml_error_text(exc))
        self._event_set = None
        self._registered = {}

    def _register(self, handle: Any, gpu: Gpu) -> None:
        key = _handle_key(handle)
        if self._event_set is None or self._registered.get(key) == "":
            return
        try:
            self.nvml.nvmlDeviceRegisterEvents(
                handle, pynvml.nvmlEventTypeXidCriticalError, self._event_set
            )
            self._registered[key] = ""
        except pynvml.NVMLError as exc:
            if exc.value in _REINIT_ERRORS:
                raise _Reinit(exc) from exc
            self._registered[key] = nvml_error_text(exc)
            log.warning("gpu xid registration failed gpu=%d gpu_uuid=%s error=%s", gpu.index,
                        gpu.uuid, nvml_error_text(exc))  # fmt: skip

    def _events_text(self, handles: dict[Any, str]) -> str:
        if self._event_set is None:
            return f"unavailable: {self._events_problem or 'no event set'}"
        failed = {k: why for k, why in self._registered.items() if why and k in handles}
        if not failed:
            return f"registered on all {len(handles)} GPUs"
        first = next(iter(failed.values()))
        return f"registered on {len(handles) - len(failed)} of {len(handles)} GPUs ({first})"

    def _drain(self, handles: dict[Any, str]) -> None:
        """Take the waiting XID events; each card found by its handle among ``handles``."""
        if self._event_set is None:
            return
        for _ in range(1000):
            try:
                data = self.nvml.nvmlEventSetWait_v2(self._event_set, 0)
            except pynvml.NVMLError as exc:
                if exc.value == pynvml.NVML_ERROR_TIMEOUT:
                    return
                if exc.value in _REINIT_ERRORS:
                    raise _Reinit(exc) from exc
                log.error("gpu xid wait failed error=%s action=the event set is created again",
                          nvml_error_text(exc))  # fmt: skip
                self._drop_event_set()
                return
            if not int(data.eventType) & pynvml.nvmlEventTypeXidCriticalError:
                continue
            uuid = handles.get(_handle_key(data.device), "")
            event = XidEvent(uuid, int(data.eventData), _now_ms())
            log.warning("gpu xid event gpu_uuid=%s xid=%d", uuid or "unidentified", event.xid)
            with self._pending_lock:
                self._pending.append(event)


#: The file in the state directory through which ``tuneplane-node gpu release`` asks the agent
#: to let go of NVML: ``{"until_ms": ...}``.
RELEASE_REQUEST = "gpu-release.json"


def read_release(path: Path | None) -> int:
    """Until when the operator's release is in force (ms); 0 when there is none or it is bad."""
    if path is None:
        return 0
    try:
        data = json.loads(path.read_bytes())
        return int(data["until_ms"])
    except FileNotFoundError:
        return 0
    except (OSError, ValueError, KeyError, TypeError) as exc:
        log.error("gpu release request unreadable path=%s error=%s", path, exc)
        return 0


def default_node_name() -> str:
    return socket.gethostname()


class InventorySource:
    """One configured source: simulated, scripted NVML, or NVML. One read at a time."""

    def __init__(
        self,
        node_name: str,
        simulate: SimulatedGpus | None,
        scripted_nvml: Path | None = None,
        release_request: Path | None = None,
        limit_s: float = PROBE_LIMIT_S,
    ) -> None:
        if simulate is not None and scripted_nvml is not None:
            raise InventoryError(
                "--simulate-gpus and --scripted-nvml cannot be used together; pass one of them."
            )
        self.node_name = node_name
        self.simulate = simulate
        self.release_request = release_request
        # How long one read may take before the GPUs read "NVML unresponsive".
        self.limit_s = limit_s
        # Passed on to every collector the agent starts, so metrics read the same NVML.
        self.scripted_nvml = scripted_nvml
        self.reading = threading.Lock()
        self._nvml: NvmlSource | None = None
        if simulate is None:
            source = "nvml" if scripted_nvml is None else "scripted-nvml"
            self._nvml = NvmlSource(load_nvml(scripted_nvml), source)

    @property
    def gpu_source(self) -> str:
        return "simulated" if self._nvml is None else self._nvml.source_name

    def collect(self) -> Inventory:
        """Read now, in this thread (waits for a read in progress)."""
        with self.reading:
            return self.read_locked()

    def read_locked(self) -> Inventory:
        """Read; the caller holds :attr:`reading`."""
        if self._nvml is None:
            assert self.simulate is not None
            return simulated_inventory(self.node_name, self.simulate)
        return self._nvml.collect(self.node_name, read_release(self.release_request))

    def collect_within(self, limit_s: float | None = None) -> Inventory:
        """:meth:`collect` in a daemon thread; :meth:`unresponsive` when it takes too long."""
        limit_s = self.limit_s if limit_s is None else limit_s
        result: list[Inventory] = []
        failure: list[BaseException] = []
        if not self.reading.acquire(blocking=False):
            return self.unresponsive(limit_s)

        def work() -> None:
            try:
                result.append(self.read_locked())
            except BaseException as exc:
                failure.append(exc)
            finally:
                self.reading.release()

        thread = threading.Thread(target=work, name="nvml-read", daemon=True)
        thread.start()
        thread.join(limit_s)
        if failure:
            raise failure[0]
        return result[0] if result else self.unresponsive(limit_s)

    def unresponsive(self, limit_s: float) -> Inventory:
        """The last read with every GPU unhealthy: "NVML unresponsive"."""
        reason = (
            f"NVML unresponsive: a read did not finish within {limit_s:g} s (a wedged GPU or "
            "driver); the agent keeps probing"
        )
        log.error("gpu probe timed out limit_s=%g", limit_s)
        last = self._nvml.last if self._nvml is not None else None
        if last is None:
            hostname, cpus, memory = _host(self.node_name)
            return Inventory(hostname, cpus, memory, (), self.gpu_source, problem=reason)
        gpus = tuple(attrs.evolve(g, healthy=False, health_reason=reason) for g in last.gpus)
        return attrs.evolve(last, gpus=gpus, problem=reason)

    def take_xid_events(self) -> list[XidEvent]:
        return [] if self._nvml is None else self._nvml.take_xid_events()


async def probe(source: InventorySource, limit_s: float | None = None) -> Inventory:
    """Read in a worker thread with a time limit (``source.limit_s`` unless given); a hung read
    is abandoned, never awaited.

    While an abandoned read is still stuck, no new thread is started: every known GPU reads
    "NVML unresponsive" until it returns.
    """
    limit_s = source.limit_s if limit_s is None else limit_s
    if not source.reading.acquire(blocking=False):
        return source.unresponsive(limit_s)

    def work() -> Inventory:
        try:
            return source.read_locked()
        finally:
            source.reading.release()

    with trio.move_on_after(limit_s):
        return await trio.to_thread.run_sync(work, abandon_on_cancel=True)
    return source.unresponsive(limit_s)
