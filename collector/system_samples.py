"""A system sample's values and keys: :class:`Reading`, the series and their slots, the points,
and the sample numbers reserved on disk.

Rules:
- The values become points of the source ``system`` under tags ``system/...``; that namespace is
  the collector's own (``point_rules`` refuses a ``system/`` tag from any other source, and any
  other tag from the source ``system``), so a workload cannot write into it.
- Keys: a sample's number ``n`` is its points' step and byte offset, a tag's fixed slot their
  index: ``("system", n, slot)``. ``n`` is reserved durably (``system-samples.json``, fsync and
  rename) *before* the sample is spooled, so a restarted collector never reuses a number: a
  spooled sample is shipped once (the spool and the store dedup on the key), and a sample taken
  but never spooled was never a point.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Sequence
from pathlib import Path

import attrs

from tuneplane.agent.atomic_file import write_atomic

from .point_rules import SYSTEM_PREFIX, SYSTEM_SOURCE
from .points import ScalarPoint

log = logging.getLogger(__name__)

SEQUENCE_FILE = "system-samples.json"

PROCESS_SERIES = ("cpu_percent", "rss_bytes", "processes")
GPU_SERIES = (
    "utilization",
    "memory_utilization",
    "memory_used_bytes",
    "power_w",
    "temperature_c",
    "sm_clock_mhz",
    "throttle_reasons",
    "ecc_uncorrected",
    "ecc_corrected",
)
#: Slots 0..15 are the process series; GPU rank r's series start at 16 + 16 * r.
_GPU_BASE = 16
_GPU_SLOTS = 16


@attrs.frozen(slots=True)
class Reading:
    """One value of one system series in one sample; ``slot`` is the tag's fixed key index."""

    tag: str
    slot: int
    value: float


def process_reading(name: str, value: float) -> Reading:
    return Reading(SYSTEM_PREFIX + name, PROCESS_SERIES.index(name), value)


def gpu_reading(rank: int, name: str, value: float) -> Reading:
    """``system/gpu<rank>/<name>``; ``rank`` is the GPU's position in the member's list."""
    slot = _GPU_BASE + rank * _GPU_SLOTS + GPU_SERIES.index(name)
    return Reading(f"{SYSTEM_PREFIX}gpu{rank}/{name}", slot, value)


def sample_points(number: int, wall_time: float, readings: Sequence[Reading]) -> list[ScalarPoint]:
    """The points of sample ``number``: step and offset ``number``, index the tag's slot."""
    return [
        ScalarPoint(
            source=SYSTEM_SOURCE,
            tag=r.tag,
            step=number,
            wall_time=wall_time,
            value=r.value,
            offset=number,
            index=r.slot,
            source_id=SYSTEM_SOURCE,
        )
        for r in readings
    ]


class SampleNumbers:
    """The next sample number, reserved on disk before a sample is spooled (blocking)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.next = 0
        try:
            data = json.loads(path.read_bytes())
            self.next = int(data["next"])
            if self.next < 0:
                raise ValueError(f"next is {self.next}")
        except FileNotFoundError:
            pass
        except (OSError, ValueError, KeyError, TypeError) as exc:
            # Never reuse a number: the clock in milliseconds is past any count this file held.
            self.next = int(time.time() * 1000)
            log.error(
                "system sample numbers unreadable; continuing from the clock path=%s error=%s "
                "next=%d",
                path,
                exc,
                self.next,
            )

    def reserve(self) -> int:
        number = self.next
        write_atomic(self.path, json.dumps({"next": number + 1}).encode(), 0o600)
        self.next = number + 1
        return number
