"""``tuneplane-collector``: TensorBoard and JSONL readers and the tailer.

The public names are re-exported here; the readers are sans-IO and the tailer is a Trio shell
over them (see docs/telemetry.md).
"""

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
