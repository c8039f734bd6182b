"""ScriptedNvml: the explicitly named test double of NVML, driven by a JSON script file.

A ``ScriptedNvml`` instance behaves like the ``pynvml`` module for every function the agent and
the collectors call, and raises the real ``pynvml.NVMLError`` subclasses with the real NVML
error codes, so ``except pynvml.NVMLError`` and ``exc.value`` checks work unchanged. Constants
(``NVML_*``, ``nvmlEventType*``, ``nvmlClocks*``, ``NVMLError*``) are pynvml's own. A process
uses it only when told: ``tuneplane-node ... --scripted-nvml FILE``; its inventory then says
``gpu_source="scripted-nvml"``.

The script is re-read whenever the file changes (write it atomically: :func:`write_script`), so
a test can lose a card, inject an XID, reorder cards, make a call hang or fail, or change a
metric while a real agent or collector process runs. Format (every key optional unless noted)::

    {
      "init_error": "DRIVER_NOT_LOADED",   # nvmlInit raises NVML_ERROR_<name>
      "epoch": 0,              # change it to model a driver reload: calls made under an older
      "epoch_error": "UNINITIALIZED",      # nvmlInit raise this until nvmlInit runs again
      "driver_version": "550.54.15", "cuda_version": 12040,
      "errors": {"nvmlDeviceGetCount": "UNKNOWN"},     # global calls that fail
      "hang": ["nvmlDeviceGetCount"],     # calls that block until the script no longer says so
      "calls_log": "/path/file",  # nvmlInit/Shutdown/EventSet*/RegisterEvents appended, a line each
      "xids": [{"gpu": "GPU-...", "xid": 79, "id": "optional, defaults to the position"}],
      "gpus": [                            # in NVML index order; reorder the list to reorder
        {
          "uuid": "GPU-...",               # required; also the card's identity for its handle
          "name": "NVIDIA H200", "memory": 150754820096, "architecture": 9 or "hopper",
          "minor": 3,                      # N of /dev/nvidia<N>; absent: its place in this list
          "ecc_uncorrected": 0, "ecc_corrected": 0,     # null: NOT_SUPPORTED
          "remapped_rows": [corr, unc, pending, failure], # null: NOT_SUPPORTED (pre-Ampere default)
          "retired_pages": {"pending": false, "double_bit": [], "single_bit": []},
                                           # null: NOT_SUPPORTED (Ampere and later default)
          "mig": {"current": 1, "pending": 1, "devices": [
              {"uuid": "MIG-...", "memory": 10737418240, "profile": "1g.10gb"}]},
                                           # null/absent: NOT_SUPPORTED (not MIG-capable)
          "recovery_action": "none" | "gpu_reset" | "drain_and_reset" | ... or an int,
                                           # absent: the field reads NOT_SUPPORTED
          "metrics": {"utilization_gpu": 0, "utilization_memory": 0, "memory_used": 0,
                      "power_mw": 0, "temperature_c": 0, "sm_clock_mhz": 0,
                      "clocks_event_reasons": 0, "processes": [{"pid": 1, "used_memory": 0}]},
          "lost": false,                   # true: every call on the card raises GPU_IS_LOST
          "errors": {"nvmlDeviceGetTotalEccErrors": "GPU_IS_LOST"},
          "hang": ["nvmlDeviceGetRemappedRows"]
        }
      ]
    }

Error names are the ``NVML_ERROR_`` suffixes (``GPU_IS_LOST``, ``UNKNOWN``, ``NO_PERMISSION``,
``NOT_SUPPORTED``, ``LIB_RM_VERSION_MISMATCH``, ...). An XID is delivered once per event set, only
to an event set its card was registered with and that existed before the XID was added to the
script (append it while the process runs); an XID for a card that has since left the list still
arrives with the card's handle (as NVML does for a card that fell off the bus).
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import attrs
import pynvml

from .atomic_file import write_atomic
from .scripted_nvml_file import (
    ARCHITECTURES,
    POLL_S,
    ScriptedHandle,
    ScriptError,
    ScriptFile,
    nvml_error,
)

_RECOVERY_ACTIONS = {
    "none": pynvml.NVML_GPU_RECOVERY_ACTION_NONE,
    "gpu_reset": pynvml.NVML_GPU_RECOVERY_ACTION_GPU_RESET,
    "node_reboot": pynvml.NVML_GPU_RECOVERY_ACTION_NODE_REBOOT,
    "drain_p2p": pynvml.NVML_GPU_RECOVERY_ACTION_DRAIN_P2P,
    "drain_and_reset": pynvml.NVML_GPU_RECOVERY_ACTION_DRAIN_AND_RESET,
}


def write_script(path: Path, script: dict[str, Any]) -> None:
    """Replace the script atomically, so a running process never reads half of it."""
    write_atomic(path, json.dumps(script, indent=1).encode())


@attrs.define
class _EventSet:
    cards: set[str] = attrs.field(factory=set)
    delivered: set[str] = attrs.field(factory=set)
    freed: bool = False


class ScriptedNvml:
    """Behaves like the ``pynvml`` module, as the script file says."""

    def __init__(self, script: Path) -> None:
        self.script_path = script
        # The script as last read and NVML's initialisation state (read once now).
        self._file = ScriptFile(script)
        self._event_sets: dict[int, _EventSet] = {}
        self._next_set = 1

    def __repr__(self) -> str:
        return f"ScriptedNvml({str(self.script_path)!r})"

    def __getattr__(self, name: str) -> Any:
        # Constants and error classes are pynvml's own; an NVML function this double does not
        # script never falls through to the real library.
        if name.startswith(("NVML", "nvmlEventType", "nvmlClocks")) and hasattr(pynvml, name):
            return getattr(pynvml, name)
        raise AttributeError(
            f"ScriptedNvml does not script {name}; add it to agent/scripted_nvml.py."
        )

    # --- life-cycle ---------------------------------------------------------------------------

    def nvmlInit(self) -> None:
        self._file.enter("nvmlInit")
        with self._file.lock:
            failure = self._file.data.get("init_error")
            if failure:
                raise nvml_error(str(failure), "init_error")
            self._file.init_count += 1
            self._file.init_epoch = int(self._file.data.get("epoch", 0))

    def nvmlShutdown(self) -> None:
        self._file.enter("nvmlShutdown")
        with self._file.lock:
            self._file.init_count -= 1
            if self._file.init_count == 0:
                # As NVML: an event set does not outlive the library's initialisation.
                for events in self._event_sets.values():
                    events.freed = True

    def nvmlSystemGetDriverVersion(self) -> str:
        self._file.enter("nvmlSystemGetDriverVersion")
        return str(self._file.data.get("driver_version", "550.54.15"))

    def nvmlSystemGetCudaDriverVersion_v2(self) -> int:
        self._file.enter("nvmlSystemGetCudaDriverVersion_v2")
        return int(self._file.data.get("cuda_version", 12040))

    # --- devices ------------------------------------------------------------------------------

    def nvmlDeviceGetCount(self) -> int:
        self._file.enter("nvmlDeviceGetCount")
        return len(self._file.cards())

    def nvmlDeviceGetHandleByIndex(self, index: int) -> ScriptedHandle:
        self._file.enter("nvmlDeviceGetHandleByIndex")
        cards = self._file.cards()
        if not 0 <= index < len(cards):
            raise pynvml.NVMLError(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        handle = ScriptedHandle(cards[index]["uuid"])
        self._file.enter("nvmlDeviceGetHandleByIndex", handle)
        return handle

    def nvmlDeviceGetHandleByUUID(self, uuid: str | bytes) -> ScriptedHandle:
        self._file.enter("nvmlDeviceGetHandleByUUID")
        text = uuid.decode() if isinstance(uuid, bytes) else uuid
        for card in self._file.cards():
            if card["uuid"] == text:
                handle = ScriptedHandle(text)
                self._file.enter("nvmlDeviceGetHandleByUUID", handle)
                return handle
            for i, dev in enumerate(card.get("mig", {}).get("devices", []) or []):
                if dev.get("uuid") == text:
                    return ScriptedHandle(card["uuid"], i)
        raise pynvml.NVMLError(pynvml.NVML_ERROR_NOT_FOUND)

    def nvmlDeviceGetUUID(self, handle: ScriptedHandle) -> str:
        card = self._file.need(self._file.enter("nvmlDeviceGetUUID", handle))
        if handle.mig >= 0:
            return str(self._file.mig_device(card, handle)["uuid"])
        return str(card["uuid"])

    def nvmlDeviceGetName(self, handle: ScriptedHandle) -> str:
        card = self._file.need(self._file.enter("nvmlDeviceGetName", handle))
        name = str(card.get("name", "NVIDIA H200"))
        if handle.mig >= 0:
            dev = self._file.mig_device(card, handle)
            return str(dev.get("name", f"{name} MIG {dev.get('profile', '1g.10gb')}"))
        return name

    def nvmlDeviceGetMemoryInfo(self, handle: ScriptedHandle, version: Any = None) -> Any:
        card = self._file.need(self._file.enter("nvmlDeviceGetMemoryInfo", handle))
        if handle.mig >= 0:
            total = int(self._file.mig_device(card, handle).get("memory", 10 * 2**30))
            used = 0
        else:
            total = int(card.get("memory", 141 * 2**30))
            used = int(card.get("metrics", {}).get("memory_used", 0))
        return SimpleNamespace(total=total, used=used, free=total - used, reserved=0)

    def nvmlDeviceGetMinorNumber(self, handle: ScriptedHandle) -> int:
        card = self._file.need(self._file.enter("nvmlDeviceGetMinorNumber", handle))
        if "minor" in card:
            return int(card["minor"])
        return next(i for i, c in enumerate(self._file.cards()) if c["uuid"] == card["uuid"])

    def nvmlDeviceGetArchitecture(self, handle: ScriptedHandle) -> int:
        card = self._file.need(self._file.enter("nvmlDeviceGetArchitecture", handle))
        return self._file.architecture(card)

    def nvmlDeviceGetTotalEccErrors(
        self, handle: ScriptedHandle, error_type: int, counter: int
    ) -> int:
        card = self._file.need(self._file.enter("nvmlDeviceGetTotalEccErrors", handle))
        key = (
            "ecc_uncorrected"
            if error_type == pynvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED
            else "ecc_corrected"
        )
        return int(self._file.value(card, key, 0))

    def nvmlDeviceGetRemappedRows(self, handle: ScriptedHandle) -> tuple[int, int, int, int]:
        card = self._file.need(self._file.enter("nvmlDeviceGetRemappedRows", handle))
        if "remapped_rows" not in card and self._file.architecture(card) < ARCHITECTURES["ampere"]:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_NOT_SUPPORTED)
        corr, unc, pending, failure = self._file.value(card, "remapped_rows", [0, 0, 0, 0])
        return int(corr), int(unc), int(pending), int(failure)

    def nvmlDeviceGetRetiredPages(self, handle: ScriptedHandle, cause: int) -> list[int]:
        card = self._file.need(self._file.enter("nvmlDeviceGetRetiredPages", handle))
        key = (
            "double_bit"
            if cause == pynvml.NVML_PAGE_RETIREMENT_CAUSE_DOUBLE_BIT_ECC_ERROR
            else "single_bit"
        )
        return [int(a) for a in self._file.retired(card).get(key, [])]

    def nvmlDeviceGetRetiredPagesPendingStatus(self, handle: ScriptedHandle) -> int:
        card = self._file.need(self._file.enter("nvmlDeviceGetRetiredPagesPendingStatus", handle))
        return int(bool(self._file.retired(card).get("pending", False)))

    def nvmlDeviceGetMigMode(self, handle: ScriptedHandle) -> list[int]:
        card = self._file.need(self._file.enter("nvmlDeviceGetMigMode", handle))
        mig = self._file.mig(card)
        current = int(mig.get("current", 0))
        return [current, int(mig.get("pending", current))]

    def nvmlDeviceGetMaxMigDeviceCount(self, handle: ScriptedHandle) -> int:
        card = self._file.need(self._file.enter("nvmlDeviceGetMaxMigDeviceCount", handle))
        return max(7, len(self._file.mig(card).get("devices", [])))

    def nvmlDeviceGetMigDeviceHandleByIndex(self, handle: ScriptedHandle, index: int) -> Any:
        card = self._file.need(self._file.enter("nvmlDeviceGetMigDeviceHandleByIndex", handle))
        mig_handle = ScriptedHandle(card["uuid"], index)
        self._file.mig_device(card, mig_handle)
        return mig_handle

    def nvmlDeviceGetFieldValues(self, handle: ScriptedHandle, field_ids: list[Any]) -> list[Any]:
        card = self._file.need(self._file.enter("nvmlDeviceGetFieldValues", handle))
        values = []
        for field in field_ids:
            field_id = field[0] if isinstance(field, tuple) else int(field)
            value = SimpleNamespace(uiVal=0, ulVal=0, ullVal=0, sllVal=0, dVal=0.0)
            ret = pynvml.NVML_ERROR_NOT_SUPPORTED
            if field_id == pynvml.NVML_FI_DEV_GET_GPU_RECOVERY_ACTION and "recovery_action" in card:
                action = card["recovery_action"]
                code = _RECOVERY_ACTIONS.get(action) if isinstance(action, str) else int(action)
                if code is None:
                    raise ScriptError(
                        f"The scripted NVML file {self.script_path}: recovery_action {action!r} "
                        f"is not one of {', '.join(_RECOVERY_ACTIONS)}; use one or a number."
                    )
                value.uiVal = value.ulVal = value.ullVal = code
                ret = pynvml.NVML_SUCCESS
            values.append(
                SimpleNamespace(
                    fieldId=field_id,
                    scopeId=0,
                    timestamp=time.time_ns() // 1000,
                    latencyUsec=0,
                    valueType=pynvml.NVML_VALUE_TYPE_UNSIGNED_INT,
                    nvmlReturn=ret,
                    value=value,
                )
            )
        return values

    # --- metrics ------------------------------------------------------------------------------

    def _metric(self, name: str, handle: ScriptedHandle, key: str) -> int:
        card = self._file.need(self._file.enter(name, handle))
        metrics = card.get("metrics", {})
        if key in metrics and metrics[key] is None:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_NOT_SUPPORTED)
        return int(metrics.get(key, 0))

    def nvmlDeviceGetUtilizationRates(self, handle: ScriptedHandle) -> Any:
        gpu = self._metric("nvmlDeviceGetUtilizationRates", handle, "utilization_gpu")
        memory = self._metric("nvmlDeviceGetUtilizationRates", handle, "utilization_memory")
        return SimpleNamespace(gpu=gpu, memory=memory)

    def nvmlDeviceGetPowerUsage(self, handle: ScriptedHandle) -> int:
        return self._metric("nvmlDeviceGetPowerUsage", handle, "power_mw")

    def nvmlDeviceGetTemperature(self, handle: ScriptedHandle, sensor: int) -> int:
        return self._metric("nvmlDeviceGetTemperature", handle, "temperature_c")

    def nvmlDeviceGetClockInfo(self, handle: ScriptedHandle, clock: int) -> int:
        return self._metric("nvmlDeviceGetClockInfo", handle, "sm_clock_mhz")

    def nvmlDeviceGetCurrentClocksEventReasons(self, handle: ScriptedHandle) -> int:
        return self._metric(
            "nvmlDeviceGetCurrentClocksEventReasons", handle, "clocks_event_reasons"
        )

    def nvmlDeviceGetCurrentClocksThrottleReasons(self, handle: ScriptedHandle) -> int:
        return self._metric(
            "nvmlDeviceGetCurrentClocksThrottleReasons", handle, "clocks_event_reasons"
        )

    def nvmlDeviceGetComputeRunningProcesses(self, handle: ScriptedHandle) -> list[Any]:
        card = self._file.need(self._file.enter("nvmlDeviceGetComputeRunningProcesses", handle))
        return [
            SimpleNamespace(
                pid=int(p["pid"]),
                usedGpuMemory=int(p.get("used_memory", 0)),
                gpuInstanceId=0xFFFFFFFF,
                computeInstanceId=0xFFFFFFFF,
            )
            for p in card.get("metrics", {}).get("processes", [])
        ]

    # --- events -------------------------------------------------------------------------------

    def nvmlEventSetCreate(self) -> int:
        self._file.enter("nvmlEventSetCreate")
        with self._file.lock:
            number = self._next_set
            self._next_set += 1
            # As NVML: a new event set hears only of what happens after it exists.
            before = {str(x.get("id", i)) for i, x in enumerate(self._file.data.get("xids", []))}
            self._event_sets[number] = _EventSet(delivered=before)
        return number

    def _events(self, event_set: Any) -> _EventSet:
        events = self._event_sets.get(event_set) if isinstance(event_set, int) else None
        if events is None or events.freed:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        return events

    def nvmlEventSetFree(self, event_set: int) -> None:
        self._file.enter("nvmlEventSetFree", detail=str(event_set))
        with self._file.lock:
            self._events(event_set).freed = True

    def nvmlDeviceRegisterEvents(self, handle: ScriptedHandle, types: int, event_set: int) -> None:
        self._file.enter("nvmlDeviceRegisterEvents", handle, detail=f"{handle.card} {event_set}")
        with self._file.lock:
            self._events(event_set).cards.add(handle.card)

    def nvmlEventSetWait_v2(self, event_set: int, timeout_ms: int) -> Any:
        deadline = time.monotonic() + max(0, timeout_ms) / 1000
        while True:
            self._file.enter("nvmlEventSetWait_v2")
            with self._file.lock:
                events = self._events(event_set)
                for position, xid in enumerate(self._file.data.get("xids", [])):
                    key = str(xid.get("id", position))
                    card = str(xid.get("gpu", ""))
                    if key in events.delivered or card not in events.cards:
                        continue
                    events.delivered.add(key)
                    return SimpleNamespace(
                        device=ScriptedHandle(card),
                        eventType=pynvml.nvmlEventTypeXidCriticalError,
                        eventData=int(xid["xid"]),
                        gpuInstanceId=0xFFFFFFFF,
                        computeInstanceId=0xFFFFFFFF,
                    )
            if time.monotonic() >= deadline:
                raise pynvml.NVMLError(pynvml.NVML_ERROR_TIMEOUT)
            time.sleep(POLL_S)
