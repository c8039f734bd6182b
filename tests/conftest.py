"""Session-wide test setup: agents started outside tests/support run members as real accounts.

Rules: as root, every ``tuneplane-node`` this test run starts without its own ``--config`` reads a
node.toml naming a pool of fresh accounts (``TUNEPLANE_NODE_CONFIG``), so no test ever runs a
workload as root; pytest's temporary folders (0700) are made passable (0711, never listable) so
those accounts reach their own work and output directories under them. tests/support's agents
and LocalCluster's (``accounts.cluster_pool``) each get a pool of their own; this shared pool
serves any other agent a test starts.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest
from hypothesis import settings

from tests.support import accounts

# No Hypothesis deadline anywhere: a test's speed is a benchmark's business (bench/), and on a
# loaded CI machine a 200 ms deadline fails correct code (seen in a parallel run).
settings.register_profile("tuneplane", deadline=None)
settings.load_profile("tuneplane")

SESSION_POOL_SIZE = 8


# Set with TUNEPLANE_NODE_CONFIG to the pid that made the pool: a pytest-xdist worker inherits
# both from the main process and makes a pool of its own, since an agent never leases an account
# another agent's member still runs as (agent/accounts.py: busy) and workers run side by side.
_POOL_OWNER = "TUNEPLANE_TEST_POOL_OWNER"


def pytest_configure(config: pytest.Config) -> None:
    if not accounts.is_root():
        return
    inherited = os.environ.get(_POOL_OWNER) not in (None, str(os.getpid()))
    if "TUNEPLANE_NODE_CONFIG" in os.environ and not inherited:
        return  # the caller named its own node.toml
    if not inherited:
        accounts.sweep_stale()  # once per run, in the main process: a killed run's leftovers
    pool = accounts.make_pool(SESSION_POOL_SIZE)
    path = accounts.traversable_root("session") / "node.toml"
    names = ", ".join(f'"{name}"' for name in pool)
    path.write_text(f'[accounts]\nmode = "pool"\npool = [{names}]\n')
    os.environ["TUNEPLANE_NODE_CONFIG"] = str(path)
    os.environ[_POOL_OWNER] = str(os.getpid())


def _passable(folder: Path) -> None:
    mode = folder.stat().st_mode & 0o777
    if mode & 0o001 == 0:
        folder.chmod(mode | 0o011)


@pytest.fixture(autouse=True)
def _members_can_reach_temporary_folders(
    tmp_path: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[None]:
    """Let member accounts pass through pytest's folders to their own (root only)."""
    if accounts.is_root():
        base = tmp_path_factory.getbasetemp()
        for folder in (base.parent, base, *(p for p in base.iterdir() if p.is_dir()), tmp_path):
            _passable(folder)
    yield
