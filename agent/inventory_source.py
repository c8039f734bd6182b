"""One configured GPU source (simulated, scripted NVML or NVML) read with a time limit.

Rules:
- A source is exactly one of them (``--simulate-gpus`` and ``--scripted-nvml`` together are an
  :class:`~.inventory.InventoryError`), and one read runs at a time.
- :func:`probe` reads in a thread with a time limit; a hung NVML call is abandoned (never blocks
  shutdown) and every known GPU reads "NVML unresponsive" until a read completes again.
- An operator's release request (:data:`RELEASE_REQUEST`, ``tuneplane-node gpu release``) is
  read before each NVML read; while it is in force NVML is let go of.
"""

from __future__ import annotations

import json
import logging
import threading
from pathlib import Path

import attrs
import trio

from .inventory import (
    Inventory,
    InventoryError,
    SimulatedGpus,
    XidEvent,
    host_resources,
    simulated_inventory,
)
from .nvml_source import NvmlSource, load_nvml

log = logging.getLogger(__name__)

#: How long one probe may take before its GPUs read "NVML unresponsive".
PROBE_LIMIT_S = 20.0

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
            hostname, cpus, memory = host_resources(self.node_name)
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
