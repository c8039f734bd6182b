"""The scripted NVML's script file: read again whenever it changes, and the checks every call makes.

:class:`ScriptFile` is what :class:`~.scripted_nvml.ScriptedNvml` (the format is in
agent/scripted_nvml.py) keeps between calls: the script, and NVML's initialisation count and
epoch. Every scripted call starts with :meth:`ScriptFile.enter`, which re-reads the file, waits
while the script says the call hangs, and raises what the script says it raises.

Rules: a script that cannot be used is a :class:`ScriptError` that names the file, what is
wrong and the fix; an NVML failure is the real ``pynvml.NVMLError`` with the real code.
"""

from __future__ import annotations

import json
import os
import threading
import time
from pathlib import Path
from typing import Any

import attrs
import pynvml

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
ARCHITECTURES = {
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
POLL_S = 0.02


class ScriptError(InventoryError):
    """The script file cannot be used. ``str()`` names the file, what is wrong and the fix."""


def nvml_error(name: str, where: str) -> pynvml.NVMLError:
    """The NVMLError the script names (an ``NVML_ERROR_`` suffix); a ScriptError if none."""
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


class ScriptFile:
    """The script as last read and NVML's initialisation state; hold :attr:`lock` to use it."""

    def __init__(self, script: Path) -> None:
        self.script_path = script
        self.lock = threading.Lock()
        self._stamp: tuple[int, int, int] | None = None
        self.data: dict[str, Any] = {}
        self.init_count = 0
        self.init_epoch = 0
        with self.lock:
            self.reload()

    def reload(self) -> None:
        """Read the file again if it changed since the last read (the caller holds the lock)."""
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
        self.data = data
        self._stamp = stamp

    def cards(self) -> list[dict[str, Any]]:
        """The scripted cards, in NVML index order."""
        cards: list[dict[str, Any]] = self.data.get("gpus", [])
        return cards

    def card(self, handle: Any) -> dict[str, Any] | None:
        """The card a handle names; None when it has left the script."""
        if not isinstance(handle, ScriptedHandle):
            raise pynvml.NVMLError(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        return next((c for c in self.cards() if c["uuid"] == handle.card), None)

    def log(self, name: str, detail: str) -> None:
        """Append the call to ``calls_log`` when it is one of the calls recorded there."""
        target = self.data.get("calls_log")
        if name in _LOGGED and isinstance(target, str):
            with open(target, "a", encoding="utf-8") as f:
                f.write(f"{name} {detail}".rstrip() + "\n")

    def enter(self, name: str, handle: Any = None, detail: str = "") -> dict[str, Any] | None:
        """The checks every call makes; returns the handle's card (None for global calls)."""
        while True:
            with self.lock:
                self.reload()
                card = None if handle is None else self.card(handle)
                hanging = name in self.data.get("hang", []) or (
                    card is not None and name in card.get("hang", [])
                )
                if not hanging:
                    self.log(name, detail)
                    break
            time.sleep(POLL_S)
        with self.lock:
            if name != "nvmlInit":
                if self.init_count == 0:
                    raise pynvml.NVMLError(pynvml.NVML_ERROR_UNINITIALIZED)
                if self.data.get("epoch", 0) != self.init_epoch and name != "nvmlShutdown":
                    raise nvml_error(str(self.data.get("epoch_error", "UNINITIALIZED")), name)
            failure = self.data.get("errors", {}).get(name)
            if failure is not None:
                raise nvml_error(str(failure), f"errors.{name}")
            if handle is None:
                return None
            if card is None:
                raise pynvml.NVMLError(pynvml.NVML_ERROR_GPU_IS_LOST)
            if card.get("lost"):
                raise pynvml.NVMLError(pynvml.NVML_ERROR_GPU_IS_LOST)
            failure = card.get("errors", {}).get(name)
            if failure is not None:
                raise nvml_error(str(failure), f"gpus[{card['uuid']}].errors.{name}")
            return card

    def need(self, card: dict[str, Any] | None) -> dict[str, Any]:
        """The card of a per-device call (INVALID_ARGUMENT for none)."""
        if card is None:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        return card

    @staticmethod
    def value(card: dict[str, Any], key: str, default: Any) -> Any:
        """``card[key]``, the default when absent; NOT_SUPPORTED when the script says null."""
        if key in card and card[key] is None:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_NOT_SUPPORTED)
        return card.get(key, default)

    def architecture(self, card: dict[str, Any]) -> int:
        """The card's NVML architecture number (Hopper unless the script says otherwise)."""
        arch = card.get("architecture", pynvml.NVML_DEVICE_ARCH_HOPPER)
        if isinstance(arch, str):
            if arch.lower() not in ARCHITECTURES:
                raise ScriptError(
                    f"The scripted NVML file {self.script_path}: architecture {arch!r} is not "
                    f"one of {', '.join(ARCHITECTURES)}; use one of them or its number."
                )
            return int(ARCHITECTURES[arch.lower()])
        return int(arch)

    def mig(self, card: dict[str, Any]) -> dict[str, Any]:
        """The card's ``mig`` table; NOT_SUPPORTED for a card that is not MIG-capable."""
        mig = card.get("mig")
        if not isinstance(mig, dict):
            raise pynvml.NVMLError(pynvml.NVML_ERROR_NOT_SUPPORTED)
        return mig

    def mig_device(self, card: dict[str, Any], handle: ScriptedHandle) -> dict[str, Any]:
        """The MIG device a MIG handle names; NOT_FOUND for an empty slot."""
        devices = self.mig(card).get("devices", [])
        if not 0 <= handle.mig < len(devices):
            raise pynvml.NVMLError(pynvml.NVML_ERROR_NOT_FOUND)
        device: dict[str, Any] = devices[handle.mig]
        return device

    def retired(self, card: dict[str, Any]) -> dict[str, Any]:
        """The card's ``retired_pages``; NOT_SUPPORTED on Ampere and later unless scripted."""
        if "retired_pages" not in card and self.architecture(card) >= ARCHITECTURES["ampere"]:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_NOT_SUPPORTED)
        pages: dict[str, Any] = self.value(card, "retired_pages", {})
        return pages
