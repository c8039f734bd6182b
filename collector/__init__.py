"""``tuneplane-collector``: TensorBoard and JSONL readers and the tailer.

The public names are re-exported here; the readers are sans-IO and the tailer is a Trio shell
over them (see docs/telemetry.md).
"""

from tuneplane.collector.checkpoint import CheckpointError as CheckpointError
from tuneplane.collector.files import Layout as Layout
from tuneplane.collector.files import ScanLimits as ScanLimits
from tuneplane.collector.files import TelemetryPathError as TelemetryPathError
from tuneplane.collector.files import discover as discover
from tuneplane.collector.files import read_file as read_file
from tuneplane.collector.files import telemetry_files as telemetry_files
from tuneplane.collector.jsonl import JsonlDecoder as JsonlDecoder
from tuneplane.collector.points import Decoded as Decoded
from tuneplane.collector.points import ReadWarning as ReadWarning
from tuneplane.collector.points import ScalarPoint as ScalarPoint
from tuneplane.collector.tailer import Batch as Batch
from tuneplane.collector.tailer import Position as Position
from tuneplane.collector.tailer import Tailer as Tailer
from tuneplane.collector.tailer import TailerStatistics as TailerStatistics
from tuneplane.collector.tfevent import TFEventDecoder as TFEventDecoder
