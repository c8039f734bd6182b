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
import os
import threading
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import attrs
import pynvml

from .atomic_file import write_atomic
from .inventory import InventoryError

# Calls recorded in ``calls_log`` (what a test needs to see the agent let go of NVML).
_LOGGED = frozenset(
    {
        "nvmlInit",
        "nvmlShutdown",
        "nvmlEventSetCreate",
        "nvmlEventSetFree",
        "nvmlDeviceRegisterEvents",
    }
)
_ARCHITECTURES = {
    "kepler": pynvml.NVML_DEVICE_ARCH_KEPLER,
    "maxwell": pynvml.NVML_DEVICE_ARCH_MAXWELL,
    "pascal": pynvml.NVML_DEVICE_ARCH_PASCAL,
    "volta": pynvml.NVML_DEVICE_ARCH_VOLTA,
    "turing": pynvml.NVML_DEVICE_ARCH_TURING,
    "ampere": pynvml.NVML_DEVICE_ARCH_AMPERE,
    "ada": pynvml.NVML_DEVICE_ARCH_ADA,
    "hopper": pynvml.NVML_DEVICE_ARCH_HOPPER,
    "blackwell": pynvml.NVML_DEVICE_ARCH_BLACKWELL,
}
_RECOVERY_ACTIONS = {
    "none": pynvml.NVML_GPU_RECOVERY_ACTION_NONE,
    "gpu_reset": pynvml.NVML_GPU_RECOVERY_ACTION_GPU_RESET,
    "node_reboot": pynvml.NVML_GPU_RECOVERY_ACTION_NODE_REBOOT,
    "drain_p2p": pynvml.NVML_GPU_RECOVERY_ACTION_DRAIN_P2P,
    "drain_and_reset": pynvml.NVML_GPU_RECOVERY_ACTION_DRAIN_AND_RESET,
}
_POLL_S = 0.02


class ScriptError(InventoryError):
    """The script file cannot be used. ``str()`` names the file, what is wrong and the fix."""


def write_script(path: Path, script: dict[str, Any]) -> None:
    """Replace the script atomically, so a running process never reads half of it."""
    write_atomic(path, json.dumps(script, indent=1).encode())


def _error(name: str, where: str) -> pynvml.NVMLError:
    code = getattr(pynvml, f"NVML_ERROR_{name}", None)
    if not isinstance(code, int):
        raise ScriptError(
            f"{where}: {name!r} is not an NVML error name; write the NVML_ERROR_ suffix, for "
            "example GPU_IS_LOST, UNKNOWN or NOT_SUPPORTED."
        )
    return pynvml.NVMLError(code)


@attrs.frozen
class ScriptedHandle:
    """A device handle: a card by its scripted UUID, or MIG device ``mig`` of that card."""

    card: str
    mig: int = -1


@attrs.define
class _EventSet:
    cards: set[str] = attrs.field(factory=set)
    delivered: set[str] = attrs.field(factory=set)
    freed: bool = False


class ScriptedNvml:
    """Behaves like the ``pynvml`` module, as the script file says."""

    def __init__(self, script: Path) -> None:
        self.script_path = script
        self._lock = threading.Lock()
        self._stamp: tuple[int, int, int] | None = None
        self._script: dict[str, Any] = {}
        self._init_count = 0
        self._init_epoch = 0
        self._event_sets: dict[int, _EventSet] = {}
        self._next_set = 1
        with self._lock:
            self._reload()

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

    # --- script -------------------------------------------------------------------------------

    def _reload(self) -> None:
        try:
            st = os.stat(self.script_path)
        except OSError as exc:
            raise ScriptError(
                f"The scripted NVML file {self.script_path} cannot be read ({exc.strerror}); "
                "create it or pass another --scripted-nvml FILE."
            ) from exc
        stamp = (st.st_mtime_ns, st.st_size, st.st_ino)
        if stamp == self._stamp:
            return
        try:
            data = json.loads(self.script_path.read_bytes())
        except (OSError, ValueError) as exc:
            raise ScriptError(
                f"The scripted NVML file {self.script_path} is not valid JSON ({exc}); fix it "
                "(the format is in agent/scripted_nvml.py)."
            ) from exc
        if not isinstance(data, dict) or not isinstance(data.get("gpus", []), list):
            raise ScriptError(
                f"The scripted NVML file {self.script_path} must hold an object whose 'gpus' is "
                "a list; fix it (the format is in agent/scripted_nvml.py)."
            )
        for i, card in enumerate(data.get("gpus", [])):
            if not isinstance(card, dict) or not isinstance(card.get("uuid"), str):
                raise ScriptError(
                    f"The scripted NVML file {self.script_path}: gpus[{i}] needs a 'uuid' "
                    "string; add one."
                )
        self._script = data
        self._stamp = stamp

    def _cards(self) -> list[dict[str, Any]]:
        cards: list[dict[str, Any]] = self._script.get("gpus", [])
        return cards

    def _card(self, handle: Any) -> dict[str, Any] | None:
        if not isinstance(handle, ScriptedHandle):
            raise pynvml.NVMLError(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        return next((c for c in self._cards() if c["uuid"] == handle.card), None)

    def _log(self, name: str, detail: str) -> None:
        target = self._script.get("calls_log")
        if name in _LOGGED and isinstance(target, str):
            with open(target, "a", encoding="utf-8") as f:
                f.write(f"{name} {detail}".rstrip() + "\n")

    def _enter(self, name: str, handle: Any = None, detail: str = "") -> dict[str, Any] | None:
        """The checks every call makes; returns the handle's card (None for global calls)."""
        while True:
            with self._lock:
                self._reload()
                card = None if handle is None else self._card(handle)
                hanging = name in self._script.get("hang", []) or (
                    card is not None and name in card.get("hang", [])
                )
                if not hanging:
                    self._log(name, detail)
                    break
            time.sleep(_POLL_S)
        with self._lock:
            if name != "nvmlInit":
                if self._init_count == 0:
                    raise pynvml.NVMLError(pynvml.NVML_ERROR_UNINITIALIZED)
                if self._script.get("epoch", 0) != self._init_epoch and name != "nvmlShutdown":
                    raise _error(str(self._script.get("epoch_error", "UNINITIALIZED")), name)
            failure = self._script.get("errors", {}).get(name)
            if failure is not None:
                raise _error(str(failure), f"errors.{name}")
            if handle is None:
                return None
            if card is None:
                raise pynvml.NVMLError(pynvml.NVML_ERROR_GPU_IS_LOST)
            if card.get("lost"):
                raise pynvml.NVMLError(pynvml.NVML_ERROR_GPU_IS_LOST)
            failure = card.get("errors", {}).get(name)
            if failure is not None:
                raise _error(str(failure), f"gpus[{card['uuid']}].errors.{name}")
            return card

    def _need(self, card: dict[str, Any] | None) -> dict[str, Any]:
        if card is None:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        return card

    @staticmethod
    def _value(card: dict[str, Any], key: str, default: Any) -> Any:
        """``card[key]``, the default when absent; NOT_SUPPORTED when the script says null."""
        if key in card and card[key] is None:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_NOT_SUPPORTED)
        return card.get(key, default)

    def _architecture(self, card: dict[str, Any]) -> int:
        arch = card.get("architecture", pynvml.NVML_DEVICE_ARCH_HOPPER)
        if isinstance(arch, str):
            if arch.lower() not in _ARCHITECTURES:
                raise ScriptError(
                    f"The scripted NVML file {self.script_path}: architecture {arch!r} is not "
                    f"one of {', '.join(_ARCHITECTURES)}; use one of them or its number."
                )
            return int(_ARCHITECTURES[arch.lower()])
        return int(arch)

    def _mig(self, card: dict[str, Any]) -> dict[str, Any]:
        mig = card.get("mig")
        if not isinstance(mig, dict):
            raise pynvml.NVMLError(pynvml.NVML_ERROR_NOT_SUPPORTED)
        return mig

    # --- life-cycle ---------------------------------------------------------------------------

    def nvmlInit(self) -> None:
        self._enter("nvmlInit")
        with self._lock:
            failure = self._script.get("init_error")
            if failure:
                raise _error(str(failure), "init_error")
            self._init_count += 1
            self._init_epoch = int(self._script.get("epoch", 0))

    def nvmlShutdown(self) -> None:
        self._enter("nvmlShutdown")
        with self._lock:
            self._init_count -= 1
            if self._init_count == 0:
                # As NVML: an event set does not outlive the library's initialisation.
                for events in self._event_sets.values():
                    events.freed = True

    def nvmlSystemGetDriverVersion(self) -> str:
        self._enter("nvmlSystemGetDriverVersion")
        return str(self._script.get("driver_version", "550.54.15"))

    def nvmlSystemGetCudaDriverVersion_v2(self) -> int:
        self._enter("nvmlSystemGetCudaDriverVersion_v2")
        return int(self._script.get("cuda_version", 12040))

    # --- devices ------------------------------------------------------------------------------

    def nvmlDeviceGetCount(self) -> int:
        self._enter("nvmlDeviceGetCount")
        return len(self._cards())

    def nvmlDeviceGetHandleByIndex(self, index: int) -> ScriptedHandle:
        self._enter("nvmlDeviceGetHandleByIndex")
        cards = self._cards()
        if not 0 <= index < len(cards):
            raise pynvml.NVMLError(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        handle = ScriptedHandle(cards[index]["uuid"])
        self._enter("nvmlDeviceGetHandleByIndex", handle)
        return handle

    def nvmlDeviceGetHandleByUUID(self, uuid: str | bytes) -> ScriptedHandle:
        self._enter("nvmlDeviceGetHandleByUUID")
        text = uuid.decode() if isinstance(uuid, bytes) else uuid
        for card in self._cards():
            if card["uuid"] == text:
                handle = ScriptedHandle(text)
                self._enter("nvmlDeviceGetHandleByUUID", handle)
                return handle
            for i, dev in enumerate(card.get("mig", {}).get("devices", []) or []):
                if dev.get("uuid") == text:
                    return ScriptedHandle(card["uuid"], i)
        raise pynvml.NVMLError(pynvml.NVML_ERROR_NOT_FOUND)

    def _mig_device(self, card: dict[str, Any], handle: ScriptedHandle) -> dict[str, Any]:
        devices = self._mig(card).get("devices", [])
        if not 0 <= handle.mig < len(devices):
            raise pynvml.NVMLError(pynvml.NVML_ERROR_NOT_FOUND)
        device: dict[str, Any] = devices[handle.mig]
        return device

    def nvmlDeviceGetUUID(self, handle: ScriptedHandle) -> str:
        card = self._need(self._enter("nvmlDeviceGetUUID", handle))
        if handle.mig >= 0:
            return str(self._mig_device(card, handle)["uuid"])
        return str(card["uuid"])

    def nvmlDeviceGetName(self, handle: ScriptedHandle) -> str:
        card = self._need(self._enter("nvmlDeviceGetName", handle))
        name = str(card.get("name", "NVIDIA H200"))
        if handle.mig >= 0:
            dev = self._mig_device(card, handle)
            return str(dev.get("name", f"{name} MIG {dev.get('profile', '1g.10gb')}"))
        return name

    def nvmlDeviceGetMemoryInfo(self, handle: ScriptedHandle, version: Any = None) -> Any:
        card = self._need(self._enter("nvmlDeviceGetMemoryInfo", handle))
        if handle.mig >= 0:
            total = int(self._mig_device(card, handle).get("memory", 10 * 2**30))
            used = 0
        else:
            total = int(card.get("memory", 141 * 2**30))
            used = int(card.get("metrics", {}).get("memory_used", 0))
        return SimpleNamespace(total=total, used=used, free=total - used, reserved=0)

    def nvmlDeviceGetMinorNumber(self, handle: ScriptedHandle) -> int:
        card = self._need(self._enter("nvmlDeviceGetMinorNumber", handle))
        if "minor" in card:
            return int(card["minor"])
        return next(i for i, c in enumerate(self._cards()) if c["uuid"] == card["uuid"])

    def nvmlDeviceGetArchitecture(self, handle: ScriptedHandle) -> int:
        card = self._need(self._enter("nvmlDeviceGetArchitecture", handle))
        return self._architecture(card)

    def nvmlDeviceGetTotalEccErrors(
        self, handle: ScriptedHandle, error_type: int, counter: int
    ) -> int:
        card = self._need(self._enter("nvmlDeviceGetTotalEccErrors", handle))
        key = (
            "ecc_uncorrected"
            if error_type == pynvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED
            else "ecc_corrected"
        )
        return int(self._value(card, key, 0))

    def nvmlDeviceGetRemappedRows(self, handle: ScriptedHandle) -> tuple[int, int, int, int]:
        card = self._need(self._enter("nvmlDeviceGetRemappedRows", handle))
        if "remapped_rows" not in card and self._architecture(card) < _ARCHITECTURES["ampere"]:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_NOT_SUPPORTED)
        corr, unc, pending, failure = self._value(card, "remapped_rows", [0, 0, 0, 0])
        return int(corr), int(unc), int(pending), int(failure)

    def _retired(self, card: dict[str, Any]) -> dict[str, Any]:
        if "retired_pages" not in card and self._architecture(card) >= _ARCHITECTURES["ampere"]:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_NOT_SUPPORTED)
        pages: dict[str, Any] = self._value(card, "retired_pages", {})
        return pages

    def nvmlDeviceGetRetiredPages(self, handle: ScriptedHandle, cause: int) -> list[int]:
        card = self._need(self._enter("nvmlDeviceGetRetiredPages", handle))
        key = (
            "double_bit"
            if cause == pynvml.NVML_PAGE_RETIREMENT_CAUSE_DOUBLE_BIT_ECC_ERROR
            else "single_bit"
        )
        return [int(a) for a in self._retired(card).get(key, [])]

    def nvmlDeviceGetRetiredPagesPendingStatus(self, handle: ScriptedHandle) -> int:
        card = self._need(self._enter("nvmlDeviceGetRetiredPagesPendingStatus", handle))
        return int(bool(self._retired(card).get("pending", False)))

    def nvmlDeviceGetMigMode(self, handle: ScriptedHandle) -> list[int]:
        card = self._need(self._enter("nvmlDeviceGetMigMode", handle))
        mig = self._mig(card)
        current = int(mig.get("current", 0))
        return [current, int(mig.get("pending", current))]

    def nvmlDeviceGetMaxMigDeviceCount(self, handle: ScriptedHandle) -> int:
        card = self._need(self._enter("nvmlDeviceGetMaxMigDeviceCount", handle))
        return max(7, len(self._mig(card).get("devices", [])))

    def nvmlDeviceGetMigDeviceHandleByIndex(self, handle: ScriptedHandle, index: int) -> Any:
        card = self._need(self._enter("nvmlDeviceGetMigDeviceHandleByIndex", handle))
        mig_handle = ScriptedHandle(card["uuid"], index)
        self._mig_device(card, mig_handle)
        return mig_handle

    def nvmlDeviceGetFieldValues(self, handle: ScriptedHandle, field_ids: list[Any]) -> list[Any]:
        card = self._need(self._enter("nvmlDeviceGetFieldValues", handle))
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
        card = self._need(self._enter(name, handle))
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
        card = self._need(self._enter("nvmlDeviceGetComputeRunningProcesses", handle))
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
        self._enter("nvmlEventSetCreate")
        with self._lock:
            number = self._next_set
            self._next_set += 1
            # As NVML: a new event set hears only of what happens after it exists.
            before = {str(x.get("id", i)) for i, x in enumerate(self._script.get("xids", []))}
            self._event_sets[number] = _EventSet(delivered=before)
        return number

    def _events(self, event_set: Any) -> _EventSet:
        events = self._event_sets.get(event_set) if isinstance(event_set, int) else None
        if events is None or events.freed:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        return events

    def nvmlEventSetFree(self, event_set: int) -> None:
        self._enter("nvmlEventSetFree", detail=str(event_set))
        with self._lock:
            self._events(event_set).freed = True

    def nvmlDeviceRegisterEvents(self, handle: ScriptedHandle, types: int, event_set: int) -> None:
        self._enter("nvmlDeviceRegisterEvents", handle, detail=f"{handle.card} {event_set}")
        with self._lock:
            self._events(event_set).cards.add(handle.card)

    def nvmlEventSetWait_v2(self, event_set: int, timeout_ms: int) -> Any:
        deadline = time.monotonic() + max(0, timeout_ms) / 1000
        while True:
            self._enter("nvmlEventSetWait_v2")
            with self._lock:
                events = self._events(event_set)
                for position, xid in enumerate(self._script.get("xids", [])):
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
            time.sleep(_POLL_S)
