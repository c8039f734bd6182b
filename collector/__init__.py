"""``tuneplane-collector``: TensorBoard and JSONL readers and the tailer.

The public names are re-exported here; the readers are sans-IO and the tailer is a Trio shell
over them (see docs/telemetry.md).

Each public name loads its module when first used (PEP 562), so a process that needs one part
(the coordinator's point rules, the agent's settings) does not import the Trio tailer with it.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .batches import Batch as Batch
    from .batches import Position as Position
    from .batches import TailerStatistics as TailerStatistics
    from .checkpoint import CheckpointError as CheckpointError
    from .files import Layout as Layout
    from .files import ScanLimits as ScanLimits
    from .files import TelemetryPathError as TelemetryPathError
    from .files import discover as discover
    from .files import read_file as read_file
    from .files import telemetry_files as telemetry_files
    from .jsonl import JsonlDecoder as JsonlDecoder
    from .points import Decoded as Decoded
    from .points import ReadWarning as ReadWarning
    from .points import ScalarPoint as ScalarPoint
    from .tailer import Tailer as Tailer
    from .tfevent import TFEventDecoder as TFEventDecoder

# Each public name and the module beside this one that holds it.
_EXPORTS = {
    "Batch": "batches",
    "Position": "batches",
    "TailerStatistics": "batches",
    "CheckpointError": "checkpoint",
    "Layout": "files",
    "ScanLimits": "files",
    "TelemetryPathError": "files",
    "discover": "files",
    "read_file": "files",
    "telemetry_files": "files",
    "JsonlDecoder": "jsonl",
    "Decoded": "points",
    "ReadWarning": "points",
    "ScalarPoint": "points",
    "Tailer": "tailer",
    "TFEventDecoder": "tfevent",
}


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{module}", __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_EXPORTS})
