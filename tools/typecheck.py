"""Run mypy --strict over every TunePlane package and the tests.

The top-level folders install as ``tuneplane.<folder>`` through a package-dir mapping that mypy
cannot follow, so this lays a tree of symbolic links (``build/typecheck/tuneplane/<name>``) with
the installed names and points mypy at it.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SHADOW = ROOT / "build" / "typecheck"
PACKAGES = {
    "agent": "agent",
    "coordinator": "coordinator",
    "collector": "collector",
    "runner": "runner",
    "report": "runner/report",
    "proto": "proto",
}


def main() -> int:
    if SHADOW.exists():
        shutil.rmtree(SHADOW)
    pkg_root = SHADOW / "tuneplane"
    pkg_root.mkdir(parents=True)
    for name, folder in PACKAGES.items():
        os.symlink(ROOT / folder, pkg_root / name)
    env = dict(os.environ, MYPYPATH=str(SHADOW))
    args = ["mypy", "--namespace-packages", "--explicit-package-bases"]
    for name in PACKAGES:
        args += ["-p", f"tuneplane.{name}"]
    rc = subprocess.run(
        [sys.executable, "-m", *args, *sys.argv[1:]], env=env, cwd=SHADOW
    ).returncode
    if rc:
        return rc
    tests = [sys.executable, "-m", "mypy", "tests", "bench"]
    return subprocess.run(tests, env=env, cwd=ROOT).returncode


if __name__ == "__main__":
    raise SystemExit(main())
