"""Names and defaults the agent shares with the collector: where a member's telemetry lives,
the bounds on one member's discovery and how often its system series are sampled.

Rules: constants only, importing nothing, so the agent (which passes them to each collector it
starts, and offers them as ``tuneplane-node run`` options) reads them without loading the
collector's readers and samplers (issue 13, goal 4: the idle agent's memory).
"""

from __future__ import annotations

#: ``$TUNEPLANE_TELEMETRY_DIR`` and ``$TENSORBOARD_LOGDIR`` of a member: these directories
#: under ``$TUNEPLANE_OUT_DIR``.
TELEMETRY_SUBDIR = "telemetry"
TENSORBOARD_SUBDIR = "tensorboard"
#: Defaults of the bounds on one member's discovery (``tuneplane-collector run`` options).
DEFAULT_MAX_FILES = 256
DEFAULT_MAX_DEPTH = 8
DEFAULT_MAX_ENTRIES = 20_000
#: Seconds between two samples of a member's GPUs and processes (``system/*`` series).
SYSTEM_INTERVAL_S = 5.0
