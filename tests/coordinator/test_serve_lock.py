"""The serve lock (coordinator/server/serve_lock.py): real flocks on a real state directory.

A flock belongs to an open file, so two holders in this one process exclude each other exactly
as two processes would; tests/integration/test_migrate_store.py checks it across real ones.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tuneplane.coordinator.server.serve_lock import StateDirBusy, alone, serving
from tuneplane.coordinator.server.state_dir import SERVE_LOCK


def test_serves_share_the_directory_and_a_command_that_must_run_alone_is_refused(
    tmp_path: Path,
) -> None:
    (tmp_path / "endpoints.json").write_text(json.dumps({"pid": 4242}))
    with (
        serving(tmp_path),
        serving(tmp_path),
        pytest.raises(StateDirBusy) as caught,
        alone(tmp_path, "migrate-store"),
    ):
        pass
    message = str(caught.value)
    assert f"A coordinator serve (pid 4242) is running on {tmp_path}" in message
    assert "migrate-store must run alone" in message and "Nothing was changed" in message
    # Once every serve stopped, the command runs; a second one meanwhile is refused.
    with (
        alone(tmp_path, "migrate-store"),
        pytest.raises(StateDirBusy),
        alone(tmp_path, "migrate-store"),
    ):
        pass


def test_serve_is_refused_while_a_command_holds_the_directory_naming_it(tmp_path: Path) -> None:
    with (
        alone(tmp_path, "migrate-store"),
        pytest.raises(StateDirBusy) as caught,
        serving(tmp_path),
    ):
        pass
    assert str(caught.value) == (
        f"`tuneplane-coordinator migrate-store` (pid {os.getpid()}) holds the state directory "
        f"{tmp_path} and must run alone; wait for it to finish, then start serve again."
    )
    with serving(tmp_path):
        pass
    assert (tmp_path / SERVE_LOCK).stat().st_mode & 0o777 == 0o600


def test_a_holder_that_dies_releases_the_lock(tmp_path: Path) -> None:
    """SIGKILL leaves no stale lock: the kernel drops it with the process."""
    code = (
        "import sys, time\n"
        "from pathlib import Path\n"
        "from tuneplane.coordinator.server.serve_lock import serving\n"
        f"with serving(Path({str(tmp_path)!r})):\n"
        "    print('held', flush=True)\n"
        "    time.sleep(60)\n"
    )
    holder = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout is not None and holder.stdout.readline() == "held\n"
        with pytest.raises(StateDirBusy), alone(tmp_path, "migrate-store"):
            pass
    finally:
        holder.kill()
        holder.wait(10)
    with alone(tmp_path, "migrate-store"):
        pass
