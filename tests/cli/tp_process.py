"""Run the real ``tp`` as a child process, the way a researcher's shell does."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from tests.support.coordinator import CoordinatorProcess

TP = [sys.executable, "-m", "tuneplane.coordinator.cli.tp"]
# Variables that would point tp at some coordinator outside the test.
_CONNECTION_VARS = (
    "TUNEPLANE_CONTEXT",
    "TUNEPLANE_COORDINATOR",
    "TUNEPLANE_CA",
    "TUNEPLANE_TOKEN_FILE",
    "TUNEPLANE_RIDE_OUT",
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


def run_tp_as(
    coord: CoordinatorProcess, token_file: Path | None, *args: str, cwd: Path | None = None
) -> subprocess.CompletedProcess[str]:
    """``tp ARGS`` against ``coord`` as the user whose token is in ``token_file`` (the admin
    when ``None``), in ``cwd`` (the coordinator's state directory when ``None``)."""
    env = {"TUNEPLANE_CONTEXT": str(coord.context_path)}
    if token_file is not None:
        env["TUNEPLANE_TOKEN_FILE"] = str(token_file)
    return run_tp(*args, cwd=cwd or coord.state_dir, env=env)
