"""What this Node has to offer, as a value: host CPU and memory, and GPUs from one named source.

Rules:
- GPUs come from NVML (``gpu_source="nvml"``), from the scripted NVML test double
  (``"scripted-nvml"``, only with ``--scripted-nvml FILE``), from an explicit ``--simulate-gpus
  SERIES:N`` (``"simulated"``), or there are none (``"none"``: the NVML library is not on this
  machine). A missing NVML never turns into a fake GPU, and a broken driver is not "none": it is
  reported in ``Inventory.problem``. Reading a source is :mod:`.inventory_source`'s; reading NVML
  is :mod:`.nvml_source`'s.
- ``health_reason`` is what the probe found (errors, ECC, remapped rows, retired pages, lost, MIG,
  unresponsive, released); XIDs are judged elsewhere (agent/xid_book.py).
"""

from __future__ import annotations

import re
import socket

import attrs
import psutil

# Per-card memory of a simulated GPU, by Series; anything else gets 80 GiB.
_SIMULATED_MEMORY = {"h200": 141 * 2**30, "h100": 80 * 2**30, "a100": 80 * 2**30}
_SERIES = re.compile(r"^[a-z][a-z0-9-]{0,31}$")


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


def host_resources(hostname: str) -> tuple[str, int, int]:
    """The host part of an inventory: its name, logical CPUs and memory."""
    return hostname, psutil.cpu_count(logical=True) or 1, int(psutil.virtual_memory().total)


def simulated_inventory(node_name: str, sim: SimulatedGpus) -> Inventory:
    """The host as it is, plus ``sim.count`` GPUs named as simulated (never mistaken for real)."""
    hostname, cpus, memory = host_resources(node_name)
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


def default_node_name() -> str:
    return socket.gethostname()
