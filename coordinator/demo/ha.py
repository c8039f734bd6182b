"""``tuneplane demo --ha``: a standby coordinator on the same PostgreSQL store, and the leader
killed with SIGKILL while the Job runs.

Rules:
- The standby is set up exactly as docs/operator.md tells an operator: a state directory of its
  own holding copies of the leader's ``tls/`` (the same CA, so Nodes trust it),
  ``coordinator.toml`` (the same store) and ``admin.token``, and nothing else, then ``serve``.
  It stands by (refusing connections) until it takes the lease over.
- The leader is killed only once the Nodes know both coordinators (the leader's Welcome lists
  them; each Node keeps them in its node.json), so what follows is what production does.
- Every time is counted from the kill and read from what the processes write: the standby leads
  when its ``endpoints.json`` names its pid (all its listeners accept); a Node is back when its
  ``status.json`` says it is connected to the standby's control address.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

import attrs
from rich.console import Console

from .cluster import COORDINATOR, ClusterError, LocalCluster, ManagedProcess
from .watch import TERMINAL, JobHistory

#: What the standby copies from the leader's state directory (docs/operator.md).
SHARED = ("tls", "coordinator.toml", "admin.token")
#: The standby's state directory, beside the leader's ``coordinator/``.
STANDBY = "coordinator-b"
#: The Job's environment under --ha: rank 0 paces its metric steps (300 x 0.04 s), so the Job
#: is still running when the leader is killed.
PACED = "DEMO_STEP_DELAY_S=0.04"
WAIT_S = 60.0

T = TypeVar("T")


def _until(what: str, check: Callable[[], T | None], timeout: float = WAIT_S) -> T:
    """Poll ``check`` until it returns something; :class:`ClusterError` naming ``what`` if not."""
    deadline = time.monotonic() + timeout
    while True:
        found = check()
        if found is not None:
            return found
        if time.monotonic() > deadline:
            raise ClusterError(f"{what} did not happen within {timeout:.0f} s")
        time.sleep(0.02)


def _read_json(path: Path) -> dict[str, object]:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def _log_has(proc: ManagedProcess, text: str) -> bool | None:
    if not proc.alive():
        raise ClusterError(
            f"{proc.name} exited with {proc.popen.returncode}; its log: {proc.log_path}"
        )
    try:
        return True if text in proc.log_path.read_text(errors="replace") else None
    except FileNotFoundError:
        return None


def start_standby(cluster: LocalCluster) -> ManagedProcess:
    """A second coordinator on the leader's store; returns once it stands by."""
    second = cluster.root / STANDBY
    second.mkdir(mode=0o700)
    for name in SHARED:
        source = cluster.coordinator_dir / name
        if source.is_dir():
            shutil.copytree(source, second / name)
        else:
            shutil.copy2(source, second / name)
    proc = cluster.serve(STANDBY)
    cluster.others.append(proc)
    _until(f"{STANDBY} standing by", lambda: _log_has(proc, "standing by"))
    return proc


def wait_nodes_know(cluster: LocalCluster, count: int) -> None:
    """Until every agent's node.json lists ``count`` coordinators (from the leader's Welcome)."""
    for agent in cluster.agents:

        def known(path: Path = agent.state_dir / "node.json") -> bool | None:
            listed = _read_json(path).get("coordinators")
            return True if isinstance(listed, list) and len(listed) >= count else None

        _until(f"{agent.name} learning of {count} coordinators", known)


def status_lines(cluster: LocalCluster) -> str:
    """What ``tuneplane-coordinator status`` says now (it reads the lease from the store)."""
    done = subprocess.run(
        [*COORDINATOR, "status", "--state-dir", str(cluster.coordinator_dir)],
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    if done.returncode != 0:
        raise ClusterError(f"tuneplane-coordinator status failed: {done.stderr.strip()}")
    return done.stdout.rstrip()


@attrs.frozen
class Takeover:
    """Seconds from the kill until the standby led and until every Node was connected to it."""

    leads_s: float
    nodes_back_s: float


def kill_leader(cluster: LocalCluster, standby: ManagedProcess) -> Takeover:
    """SIGKILL the leading coordinator; wait for ``standby`` to lead and the Nodes to follow.

    Afterwards the cluster goes through the new leader (its state directory, its tp context)."""
    old = cluster.coordinator
    assert old is not None
    old.kill()
    killed = time.monotonic()
    cluster.others.remove(standby)
    cluster.others.append(old)
    endpoints_path = cluster.root / STANDBY / "endpoints.json"

    def leading() -> dict[str, object] | None:
        if not standby.alive():
            raise ClusterError(f"{standby.name} exited; its log: {standby.log_path}")
        data = _read_json(endpoints_path)
        return data if data.get("pid") == standby.popen.pid else None

    endpoints = _until(f"{STANDBY} taking the lease over", leading)
    leads_s = time.monotonic() - killed
    cluster.coordinator, cluster.coordinator_name, cluster.endpoints = standby, STANDBY, endpoints
    for agent in cluster.agents:

        def back(path: Path = agent.state_dir / "status.json") -> bool | None:
            status = _read_json(path)
            ok = status.get("connected") and status.get("coordinator") == endpoints["control"]
            return True if ok else None

        _until(f"{agent.name} reconnecting to {STANDBY}", back)
    return Takeover(leads_s, time.monotonic() - killed)


def ride_out(console: Console, cluster: LocalCluster, history: JobHistory) -> None:
    """Once the Job runs, kill the leader and tell what happens until the Nodes are back."""
    standby = next(p for p in cluster.others if p.name == STANDBY)

    def running() -> bool | None:
        state = history.poll()["state"]
        if state in TERMINAL:
            raise ClusterError(
                f"Job {history.run_id} ended ({state}) before the demo could kill the leader."
            )
        return True if state == "running" else None

    _until(f"Job {history.run_id} running", running, timeout=120)
    old = cluster.coordinator
    assert old is not None
    console.print(
        f"[bold]$ kill -9 {old.popen.pid}[/]  (the leading coordinator, while the Job runs)"
    )
    killed_dir = cluster.coordinator_dir
    took = kill_leader(cluster, standby)
    console.print(
        f"{STANDBY} took the lease over {took.leads_s:.2f} s after the kill and serves: api "
        f"{cluster.endpoints['api']}, control {cluster.endpoints['control']}"
    )
    console.print(
        f"both Nodes reconnected to it {took.nodes_back_s:.2f} s after the kill; "
        "the members kept running"
    )
    console.print("$ tuneplane-coordinator status")
    console.print(status_lines(cluster), markup=False, highlight=False, crop=False)
    try:
        killed = (killed_dir / "coordinator-id").read_text().strip()
    except OSError:
        killed = "the killed coordinator"
    console.print(
        f"({killed} is the one killed: status lists it until it has not been seen for three "
        "lease times, then marks it gone?)"
    )
