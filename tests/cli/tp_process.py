"""Run the real ``tp`` as a child process, the way a researcher's shell does."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

TP = [sys.executable, "-m", "tuneplane.coordinator.cli.tp"]
# Variables that would point tp at some coordinator outside the test.
_CONNECTION_VARS = (
    "TUNEPLANE_CONTEXT",
    "TUNEPLANE_COORDINATOR",
    "TUNEPLANE_CA",
    "TUNEPLANE_TOKEN_FILE",
)


def run_tp(
    *args: str, cwd: Path, env: dict[str, str] | None = None, timeout: float = 60
) -> subprocess.CompletedProcess[str]:
    """``tp ARGS`` in ``cwd`` with a clean connection environment plus ``env``."""
    full = {k: v for k, v in os.environ.items() if k not in _CONNECTION_VARS}
    full.update(env or {})
    return subprocess.run(
        [*TP, *args],
        cwd=cwd,
        env=full,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )
