"""Real Unix accounts and traversable folders for tests that run members as an account pool.

Rules: accounts are created with ``useradd --system --no-create-home`` (root only) under names
unique to this test process (``tpt<pid>x<n>``) and removed with ``userdel`` when it exits, and
those of a test process that died without removing them are removed by the next run
(:func:`sweep_stale`); members' work and output
roots live under one folder in /tmp that the accounts can pass through (pytest's own temporary
folders are 0700 root), removed at exit too. Tests that need root skip outside root with a
sentence, except under ``CI=true``, where a missing prerequisite fails them.
"""

from __future__ import annotations

import atexit
import itertools
import os
import pwd
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from tuneplane.coordinator.demo import accounts as demo_accounts

_CREATED: list[str] = []
_ROOTS: list[Path] = []
_COUNTER = itertools.count()


def is_root() -> bool:
    return os.geteuid() == 0


def require(ok: bool, what: str) -> None:
    """Skip the test (fail it under CI=true) unless ``ok``; ``what`` says what is missing."""
    if ok:
        return
    if os.environ.get("CI") == "true":
        pytest.fail(f"CI must run this test, but {what}.")
    pytest.skip(f"this test needs {what}")


def require_root() -> None:
    require(is_root(), "root (it creates Unix accounts and runs members as them)")


def make_pool(count: int) -> list[str]:
    """``count`` fresh unprivileged accounts, removed when this test process exits."""
    names = [f"tpt{os.getpid()}x{next(_COUNTER)}" for _ in range(count)]
    _CREATED.extend(demo_accounts.create_missing(names))
    return names


def cluster_pool(agents: int, per_agent: int = 4) -> list[str]:
    """``member_pool`` of a LocalCluster of ``agents`` agents: fresh accounts as root, else none."""
    return make_pool(agents * per_agent) if is_root() else []


def traversable_root(prefix: str) -> Path:
    """A fresh folder under /tmp (0711) that accounts can pass through; removed at exit."""
    root = Path(tempfile.mkdtemp(prefix=f"tuneplane-{prefix}-", dir="/tmp"))
    os.chmod(root, 0o711)
    _ROOTS.append(root)
    return root


@atexit.register
def _remove_all() -> None:
    for root in _ROOTS:
        shutil.rmtree(root, ignore_errors=True)
    _ROOTS.clear()
    for name in _CREATED:
        # As the account itself, kill(-1) reaches only that account's own processes.
        subprocess.run(["kill", "-KILL", "-1"], user=name, group=name, extra_groups=[],
                       capture_output=True, check=False)  # fmt: skip
    for problem in demo_accounts.remove(_CREATED):
        print(problem, file=sys.stderr)
    _CREATED.clear()


_NAME = re.compile(r"^tpt(\d+)x\d+$")


def sweep_stale() -> None:
    """Remove accounts left by a test run whose process is gone (killed before its exit hooks
    ran): system account ids are few (about 900), and leftovers would use them up."""
    stale = []
    for entry in pwd.getpwall():
        match = _NAME.match(entry.pw_name)
        if match and not Path(f"/proc/{match.group(1)}").exists():
            stale.append(entry.pw_name)
    for problem in demo_accounts.remove(stale):
        print(problem, file=sys.stderr)


__all__ = [
    "cluster_pool",
    "is_root",
    "make_pool",
    "require",
    "require_root",
    "sweep_stale",
    "traversable_root",
]
