"""Coordinators sharing one PostgreSQL store, as an operator sets them up (docs/operator.md).

Rules: the first coordinator is made by ``init --store`` and serves (it leads); each other one
gets a state directory of its own holding copies of the first one's ``tls/`` (the same CA, so
Nodes trust it), ``coordinator.toml`` (the same store and settings) and ``admin.token``, and
nothing else (no ``coordinator-id``: each has its own name), then serves as a standby.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Sequence
from pathlib import Path

from tests.support.coordinator import CoordinatorProcess
from tests.support.ports import quiet_ports
from tests.support.processes import wait_until

#: What a second coordinator copies from the first one's state directory.
SHARED = ("tls", "coordinator.toml", "admin.token")


def copy_state_dir(first: Path, second: Path) -> None:
    """Lay out ``second`` from ``first`` as docs/operator.md says."""
    second.mkdir(parents=True, mode=0o700)
    for name in SHARED:
        source = first / name
        if source.is_dir():
            shutil.copytree(source, second / name)
        else:
            shutil.copy2(source, second / name)


def start_standby(
    first: CoordinatorProcess, root: Path, prefix_argv: Sequence[str] = ()
) -> CoordinatorProcess:
    """A second coordinator under ``root/coordinator`` on ``first``'s store, serving with the
    same options; returns once it stands by."""
    state_dir = root / "coordinator"
    copy_state_dir(first.state_dir, state_dir)
    proc = CoordinatorProcess(state_dir, list(first.serve_args), prefix_argv)
    proc.start(standby=True)
    wait_listed(first, 2)
    return proc


def wait_listed(leader: CoordinatorProcess, count: int, timeout: float = 30) -> None:
    """Wait until ``leader`` hands out ``count`` coordinators (its roll call, read every few
    seconds, reached its tp-context.json): a Node welcomed from then on learns them all."""

    def listed() -> bool:
        try:
            context = json.loads(leader.context_path.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            return False
        return len(context.get("api_addresses", [])) >= count

    wait_until(f"the leader to list {count} coordinators", listed, timeout)


def free_ports(count: int) -> tuple[int, ...]:
    """``count`` distinct loopback ports free now: a standby's, chosen before it leads, so Nodes
    and ``tp`` can be told them (and an upgraded coordinator serves on its predecessor's)."""
    return quiet_ports(count)
