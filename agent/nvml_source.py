"""Reading GPUs from NVML (or its scripted double), read by read, with the XID events.

Rules:
- One bad card never stops the read or hides the others (each card's answers are judged by
  :mod:`.nvml_card`). A read that fails as a whole (init, count) marks every GPU known from the
  last read unhealthy; nothing reuses a stale healthy verdict.
- XIDs are not judged here: :meth:`NvmlSource.take_xid_events` hands the drained events to the
  daemon (agent/xid_book.py judges them), each matched to its card by comparing the event's
  handle with the handles of this read, uuid "" when it matches none.
- NVML is initialised again (and the XID event set re-created) after UNINITIALIZED,
  DRIVER_NOT_LOADED or LIB_RM_VERSION_MISMATCH, and let go of while an operator's release
  request (``tuneplane-node gpu release``) is in force, so ``nvidia-smi -r`` can reset a GPU.
"""

from __future__ import annotations

import logging
import threading
import time
from pathlib import Path
from typing import Any

import attrs
import pynvml

from .inventory import Gpu, Inventory, MigDevice, XidEvent, host_resources, series_of
from .nvml_card import (
    REINIT_ERRORS,
    CardLost,
    CardRead,
    NeedsReinit,
    check_memory,
    nvml_advice,
    nvml_error_text,
    nvml_text,
    read_mig,
    read_recovery,
)

log = logging.getLogger(__name__)


def load_nvml(scripted: Path | None) -> Any:
    """The real ``pynvml`` module, or the scripted test double when ``scripted`` names a file."""
    if scripted is None:
        return pynvml
    from .scripted_nvml import ScriptedNvml

    return ScriptedNvml(scripted)


def _handle_key(handle: Any) -> Any:
    """What identifies a device handle: the pointer's address (ctypes), the handle otherwise."""
    import ctypes

    if isinstance(handle, ctypes._Pointer):
        return ctypes.cast(handle, ctypes.c_void_p).value
    return handle


def _now_ms() -> int:
    return time.time_ns() // 1_000_000


class NvmlSource:
    """GPUs as NVML (or its scripted double) reports them, read by read, with the XID events.

    Not thread-safe on its own: :class:`.inventory_source.InventorySource` lets one read run at
    a time.
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
        host = host_resources(node_name)
        if released_until_ms > _now_ms():
            self.release()
            until = time.strftime("%H:%M:%S", time.gmtime(released_until_ms / 1000))
            reason = f"NVML released for a GPU reset by the operator until {until} UTC"
            inventory = self._all_unhealthy(host, reason, "", released_until_ms)
        else:
            try:
                inventory = self._read(host)
            except NeedsReinit as first:
                log.warning("nvml initialising again reason=%s", first)
                self.release()
                try:
                    inventory = self._read(host)
                except NeedsReinit as again:
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
            if exc.value in REINIT_ERRORS:
                raise NeedsReinit(exc) from exc
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
        versions = CardRead(of_card=False)
        driver = versions.ask("driver version", nvml.nvmlSystemGetDriverVersion)
        cuda = versions.ask("CUDA version", nvml.nvmlSystemGetCudaDriverVersion_v2)
        cuda_text = f"{cuda // 1000}.{cuda % 1000 // 10}" if isinstance(cuda, int) and cuda else ""
        return Inventory(
            *host,
            tuple(gpus),
            self.source_name,
            nvml_text(driver) if isinstance(driver, (str, bytes)) else "",
            cuda_text,
            xid_events=self._events_text(handles),
        )

    def _read_card(self, index: int, previous: dict[str, Gpu]) -> tuple[Gpu, Any]:
        nvml = self.nvml
        card = CardRead()
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
                    uuid = self._handle_uuid[key] = nvml_text(answer)
                name = card.ask("name", nvml.nvmlDeviceGetName, handle, need=True)
                memory = card.ask("memory size", nvml.nvmlDeviceGetMemoryInfo, handle, need=True)
                minor = card.ask("device minor number", nvml.nvmlDeviceGetMinorNumber, handle)
                arch = card.ask("architecture", nvml.nvmlDeviceGetArchitecture, handle)
                check_memory(nvml, card, handle, arch)
                mig_enabled, mig_devices = read_mig(nvml, card, handle, uuid or str(index))
                recovery = read_recovery(nvml, card, handle)
        except CardLost:
            pass
        if handle is None and self.last is not None and (at := self.last.gpu(index)):
            uuid = at.uuid  # no handle: the card the last read saw at this index
        old = previous.get(uuid)
        name_text = nvml_text(name) if isinstance(name, (str, bytes)) else (old.name if old else "")
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

    # --- XID events ---------------------------------------------------------------------------

    def _ensure_event_set(self) -> None:
        if self._event_set is not None:
            return
        try:
            self._event_set = self.nvml.nvmlEventSetCreate()
            self._events_problem = ""
        except pynvml.NVMLError as exc:
            if exc.value in REINIT_ERRORS:
                raise NeedsReinit(exc) from exc
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
            if exc.value in REINIT_ERRORS:
                raise NeedsReinit(exc) from exc
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
                if exc.value in REINIT_ERRORS:
                    raise NeedsReinit(exc) from exc
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
