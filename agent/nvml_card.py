"""What one card's NVML answers say: errors named, failed calls as reasons, memory and MIG judged.

Rules:
- Only ``NVML_ERROR_NOT_SUPPORTED`` means "no data". Any other error on a per-GPU call is a
  reason the GPU is unhealthy, with the error named (:class:`CardRead`); GPU_IS_LOST stops the
  questions to that card (:class:`CardLost`), and UNINITIALIZED, DRIVER_NOT_LOADED or
  LIB_RM_VERSION_MISMATCH ask for NVML to be initialised again (:class:`NeedsReinit`).
- A MIG-enabled GPU is refused (unhealthy, with how to disable MIG): a Resource Pool is whole,
  identical GPUs. Its MIG devices are still inventoried (``MIG-`` UUID, memory, profile).
- The memory verdict is pure (:func:`memory_reasons`: the counters in, sentences out).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

import attrs
import pynvml

from .inventory import InventoryError, MigDevice

#: Errors after which NVML is shut down and initialised again (a driver reload or upgrade).
REINIT_ERRORS = frozenset(
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


def nvml_error_text(exc: pynvml.NVMLError) -> str:
    """``GPU is lost (NVML_ERROR_GPU_IS_LOST)``: NVML's words and the code's name."""
    try:
        words = str(exc)
    except Exception:  # pynvml asks the library for unknown codes; it may not be loaded
        words = "NVML error"
    name = _ERROR_NAMES.get(getattr(exc, "value", None), f"code {getattr(exc, 'value', '?')}")
    return f"{words} ({name})"


def nvml_text(value: Any) -> str:
    """An NVML string answer as text (older bindings return bytes)."""
    return value.decode() if isinstance(value, bytes) else str(value)


class NeedsReinit(Exception):
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


class CardLost(Exception):
    """The card answered GPU_IS_LOST: nothing more is asked of it in this read."""


UNSUPPORTED = object()


class CardRead:
    """One card's answers, and every reason it cannot be trusted."""

    def __init__(self, of_card: bool = True) -> None:
        # False for system-wide calls (driver version): GPU_IS_LOST there is one more failure,
        # not a card to stop asking.
        self.of_card = of_card
        self.reasons: list[str] = []

    def failed(self, what: str, exc: pynvml.NVMLError) -> None:
        self.reasons.append(f"NVML could not read its {what}: {nvml_error_text(exc)}")

    def ask(self, what: str, fn: Callable[..., Any], *args: Any, need: bool = False) -> Any:
        """NVML's answer; ``UNSUPPORTED`` for NOT_SUPPORTED; None when it failed (a reason).

        ``need``: the card cannot be used without the answer (handle, UUID, name, memory), so
        NOT_SUPPORTED is a failure too.
        """
        try:
            return fn(*args)
        except pynvml.NVMLError as exc:
            if exc.value == pynvml.NVML_ERROR_NOT_SUPPORTED and not need:
                return UNSUPPORTED
            if exc.value in REINIT_ERRORS:
                raise NeedsReinit(exc) from exc
            self.failed(what, exc)
            if exc.value == pynvml.NVML_ERROR_GPU_IS_LOST and self.of_card:
                raise CardLost from exc
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


def check_memory(nvml: Any, card: CardRead, handle: Any, arch: Any) -> None:
    """ECC counters, remapped rows (Ampere on) or retired pages (before Ampere)."""
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
    if pre_ampere or rows is UNSUPPORTED:
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


def read_mig(
    nvml: Any, card: CardRead, handle: Any, gpu: str
) -> tuple[bool, tuple[MigDevice, ...]]:
    """Whether MIG is enabled on the card (a reason it is refused) and its MIG devices."""
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
            if exc.value in REINIT_ERRORS:
                raise NeedsReinit(exc) from exc
            card.failed("MIG devices", exc)
            break
        mig_uuid = card.ask("MIG device UUID", nvml.nvmlDeviceGetUUID, mig)
        mig_memory = card.ask("MIG device memory", nvml.nvmlDeviceGetMemoryInfo, mig)
        mig_name = card.ask("MIG device name", nvml.nvmlDeviceGetName, mig)
        if not isinstance(mig_uuid, (str, bytes)):
            continue
        profile = ""
        if isinstance(mig_name, (str, bytes)) and (m := _MIG_PROFILE.search(nvml_text(mig_name))):
            profile = m.group(1)
        size = getattr(mig_memory, "total", 0)
        devices.append(MigDevice(nvml_text(mig_uuid), int(size), profile))
    return True, tuple(devices)


def read_recovery(nvml: Any, card: CardRead, handle: Any) -> str:
    """NVML's recovery action for the card ("none", "gpu_reset", ...); "" when unknown."""
    values = card.ask(
        "recovery action", nvml.nvmlDeviceGetFieldValues, handle, [_FI_RECOVERY_ACTION]
    )
    if values is None or values is UNSUPPORTED:
        return ""
    field = values[0]
    ret = int(field.nvmlReturn)
    if ret == pynvml.NVML_SUCCESS:
        code = int(field.value.uiVal)
        return _RECOVERY_NAMES.get(code, f"action-{code}")
    if ret != pynvml.NVML_ERROR_NOT_SUPPORTED:
        card.failed("recovery action", pynvml.NVMLError(ret))
    return ""
