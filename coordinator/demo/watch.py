"""Following the demo's Job through `tp`: its history as it happens, its members, its chart.

Everything here asks the real ``tp`` of the cluster (``tp job show``, ``tp metrics``), so what the
demo prints is what a researcher would see; it polls because a person's `tp` would too.
"""

from __future__ import annotations

import json
import time
from typing import Any

import attrs
from rich.console import Console
from rich.table import Table

from tuneplane.collector.point_rules import SYSTEM_SOURCE

from .cluster import ClusterError, LocalCluster

TERMINAL = {"succeeded", "failed", "aborted", "cancelled"}


def show_job(cluster: LocalCluster, run_id: str) -> dict[str, Any]:
    done = cluster.tp("job", "show", run_id, "--json")
    if done.returncode != 0:
        raise ClusterError(f"tp job show failed: {done.stderr.strip()}")
    job: dict[str, Any] = json.loads(done.stdout)
    return job


def members_table(job: dict[str, Any]) -> Table:
    table = Table(title=f"Job {job['run_id']} — {job['state']}")
    for column in ("attempt", "member (node rank)", "node", "GPUs", "state", "exit"):
        table.add_column(column)
    for attempt in job.get("attempts", []):
        for member in attempt.get("members", []):
            exit_text = ""
            if member.get("has_exit"):
                signum = member.get("signal")
                exit_text = f"signal {signum}" if signum else str(member["exit_code"])
            table.add_row(
                str(attempt["number"]),
                str(member["index"]),
                str(member["node_id"]),
                ",".join(str(g) for g in member.get("gpu_indexes", [])),
                str(member["state"]),
                exit_text,
            )
    return table


def chart(console: Console, cluster: LocalCluster, run_id: str, timeout: float) -> bool:
    """Wait until the collectors delivered every point, then draw train/loss from the store."""
    deadline = time.monotonic() + timeout
    members: list[dict[str, Any]] = []
    while time.monotonic() < deadline:
        done = cluster.tp("metrics", run_id, "--delivery", "--json")
        if done.returncode != 0:
            raise ClusterError(f"tp metrics --delivery failed: {done.stderr.strip()}")
        members = json.loads(done.stdout)["members"]
        if members and all(m["drained"] for m in members):
            break
        time.sleep(0.3)
    else:
        console.print(f"[red]telemetry of {run_id} was not delivered within {timeout:.0f} s[/]")
        return False
    stored = sum(int(m["points_stored"]) for m in members)
    # The collectors' own samples of the members' processes (system/...) depend on how long the
    # Job ran; the Job's own points do not.
    listed = cluster.tp("metrics", run_id, "--raw", "--json")
    if listed.returncode != 0:
        raise ClusterError(f"tp metrics --raw failed: {listed.stderr.strip()}")
    system = sum(
        int(t["points"]) for t in json.loads(listed.stdout)["tags"] if t["source"] == SYSTEM_SOURCE
    )
    console.print(
        f"telemetry delivered: {stored - system} points from the Job and {system} system "
        f"samples, from {len(members)} member(s)"
    )
    console.print(f"$ tp metrics {run_id} --tag train/loss")
    done = cluster.tp("metrics", run_id, "--tag", "train/loss", "--width", str(console.width))
    console.print(done.stdout.rstrip(), markup=False, highlight=False, crop=False)
    if done.returncode != 0:
        raise ClusterError(f"tp metrics failed: {done.stderr.strip()}")
    return True


def find_run_id(text: str) -> str:
    for word in text.replace(",", " ").split():
        if word.startswith("run-"):
            return word.strip(".")
    raise ClusterError(f"no run id in tp's receipt: {text!r}")


@attrs.define(eq=False)
class JobHistory:
    """Prints each change of a Job's state once, as :meth:`poll` sees it in `tp job show`."""

    console: Console
    cluster: LocalCluster
    run_id: str
    seen: set[tuple[str, str]] = attrs.field(factory=set)

    def poll(self) -> dict[str, Any]:
        """The Job now, after printing the changes not printed before."""
        job = show_job(self.cluster, self.run_id)
        for change in job.get("history", []):
            key = (change["state"], str(change["at_ms"]))
            if key not in self.seen:
                self.seen.add(key)
                reason = f" — {change['reason']}" if change.get("reason") else ""
                self.console.print(f"  job {change['state']}{reason}")
        return job


def watch(history: JobHistory, timeout: float) -> bool:
    """Follow the Job until it ends (or ``timeout``), then show its members and outputs; True
    when it succeeded."""
    console, cluster, run_id = history.console, history.cluster, history.run_id
    deadline = time.monotonic() + timeout
    job = history.poll()
    while job["state"] not in TERMINAL and time.monotonic() < deadline:
        time.sleep(0.3)
        job = history.poll()
    if job["state"] not in TERMINAL:
        console.print(f"[red]Job {run_id} did not finish within {timeout:.0f} s[/]")
    console.print(members_table(job))
    for agent in cluster.agents:
        outputs = sorted(p for p in agent.out_root.rglob("*") if p.is_file())
        for path in outputs:
            console.print(f"output on {agent.name}: {path}")
    return bool(job["state"] == "succeeded")
