"""``tuneplane-coordinator serve`` sets its garbage-collector thresholds before it serves.

Run in a fresh interpreter, as the command is: the serve command is called on a state directory
that was never initialised, so it stops with its sentence right after the point where serving
would begin, and the process then says which thresholds it holds.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from tuneplane.coordinator.server.gc_settings import THRESHOLDS

PROBE = """
import gc, sys
from tuneplane.coordinator.cli.admin import main
before = gc.get_threshold()
try:
    main(["serve", "--state-dir", sys.argv[1]])
except SystemExit as exc:
    print("exit", exc.code)
print("before", before)
print("after", gc.get_threshold())
"""


def test_serve_sets_the_thresholds_before_it_serves(tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, "-c", PROBE, str(tmp_path / "never-initialised")],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    lines = dict(line.split(" ", 1) for line in done.stdout.splitlines() if " " in line)
    assert lines.get("exit") not in (None, "0"), done.stdout + done.stderr
    assert "init" in done.stderr, done.stderr  # the sentence says to initialise it first
    assert lines["before"] == "(700, 10, 10)"  # CPython's defaults, until serve runs
    assert lines["after"] == str(THRESHOLDS)
