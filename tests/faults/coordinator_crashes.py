"""Helpers for the coordinator's crash-point tests (agent/crashpoint.py, COORDINATOR_POINTS).

A scenario arms a point with ``TUNEPLANE_CRASHPOINT`` in a real ``tuneplane-coordinator serve``
(and maybe another in a real agent), lets a real Job reach it, sees each process die there with
status 137, starts it again unarmed on the same state, and ends with the checks every scenario
shares: the Job ran exactly once (one start per member, in the workload's own output and in each
Node's journal) and no GPU is left reserved on either side. Everything is read through the
commands an operator would run (``tp``, ``tuneplane-node journal``), never from the store.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Protocol

from tests.agent.jobs import journal, tp
from tests.faults.jobs import held_gpus, node, project, submit, wait_state
from tests.support.agent import AgentProcess, wait_until
from tests.support.coordinator import CoordinatorProcess
from tuneplane.agent.crashpoint import CRASH_ENV

#: The workload of every scenario: one line per start, then one metric for the collector to ship.
STARTS_SCRIPT = (
    'echo started >> "$TUNEPLANE_OUT_DIR/starts"\n'
    'echo \'{"step": 1, "loss": 0.5}\' > "$TUNEPLANE_TELEMETRY_DIR/m.jsonl"\n'
)


def armed(point: str) -> dict[str, str]:
    """The environment that arms crash point ``point`` in the process it is given to."""
    return {CRASH_ENV: point}


class _Crashable(Protocol):
    def wait_exit(self, timeout: float = ...) -> int: ...

    def read_log(self) -> str: ...


def crash_line(log_text: str, point: str) -> dict[str, str]:
    """The ``key=value`` fields of the line a process logged as it died at ``point``."""
    for line in log_text.splitlines():
        if "crash point reached, exiting" in line and f"point={point} " in f"{line} ":
            return dict(re.findall(r"(\w+)=(\S+)", line))
    raise AssertionError(f"no crash line for point {point} in the log:\n{log_text[-4000:]}")


def died_at(proc: _Crashable, point: str, timeout: float = 60) -> dict[str, str]:
    """Wait for ``proc`` to die at ``point`` (status 137, its crash line logged); the line's
    fields."""
    code = proc.wait_exit(timeout)
    assert code == 137, f"exit status {code}, not the crash point's 137:\n{proc.read_log()[-4000:]}"
    return crash_line(proc.read_log(), point)


def queue_job(
    coord: CoordinatorProcess, root: Path, profile: str = "h200:1", script: str = STARTS_SCRIPT
) -> str:
    """Submit a custom Job running ``script`` (before any Node runs it, so a reply to ``tp`` never
    races a crash); its run id."""
    project(coord, root, "custom/custom", {"train.sh": script})
    return submit(coord, root, profile)


def members_on(agent: AgentProcess) -> list[dict[str, Any]]:
    """The members this Node's journal holds (``tuneplane-node journal members``)."""
    rows: list[dict[str, Any]] = journal(agent, "members", "--json")
    return rows


def spawns(agent: AgentProcess, key: str) -> int:
    """How many times this Node's journal records starting member ``key``."""
    events = journal(agent, "events", "--member", key, "--json")
    return [e["kind"] for e in events].count("spawn-requested")


def gpus_reserved_by_coordinator(coord: CoordinatorProcess, agent: AgentProcess) -> list[Any]:
    """The GPUs ``tp node show`` says a member holds on this Node."""
    return [g for g in node(coord, agent.node_id)["gpus"] if g["held_by"]]


def nothing_held(coord: CoordinatorProcess, agents: Sequence[AgentProcess]) -> None:
    """No GPU is reserved for anyone: not in any Node's journal, not in the coordinator."""
    for agent in agents:
        wait_until(f"{agent.node_id}'s journal to hold no GPU", lambda a=agent: not held_gpus(a))
        wait_until(
            f"the coordinator to hold no GPU on {agent.node_id}",
            lambda a=agent: not gpus_reserved_by_coordinator(coord, a),
        )


def ran_once(
    coord: CoordinatorProcess, agents: Sequence[AgentProcess], run_id: str, timeout: float = 60
) -> dict[str, Any]:
    """The Job succeeded with each member started exactly once (its output and its Node's
    journal say so), and nothing is left reserved; the Job as ``tp job show`` gives it."""
    done: dict[str, Any] = wait_state(coord, run_id, "succeeded", timeout)
    attempt = done["attempts"][-1]
    keys = set()
    for member in attempt["members"]:
        assert (Path(member["out_dir"]) / "starts").read_text() == "started\n", member
        assert member["has_exit"] and member["exit_code"] == 0 and not member["signal"], member
        keys.add(f"{run_id}.{attempt['number']}.{member['index']}")
    seen = set()
    for agent in agents:
        for record in members_on(agent):
            key = str(record["member"])
            if key in keys:
                assert spawns(agent, key) == 1, (agent.node_id, key)
                seen.add(key)
    assert seen == keys, f"members {sorted(keys - seen)} are in no Node's journal"
    nothing_held(coord, agents)
    return done


def decisions_of(coord: CoordinatorProcess, kind: str, run_id: str) -> list[dict[str, Any]]:
    """The decision log's rows of ``kind`` about Job ``run_id``."""
    return [r for r in coord.decisions(kind) if r.get("run_id") == run_id]


def delivery(coord: CoordinatorProcess, run_id: str) -> list[dict[str, Any]]:
    """``tp metrics RUN --delivery``: each member's telemetry delivery."""
    members: list[dict[str, Any]] = json.loads(
        tp(coord, "metrics", run_id, "--delivery", "--json")
    )["members"]
    return members


def tag_points(coord: CoordinatorProcess, run_id: str) -> dict[str, int]:
    """How many points ``tp metrics RUN`` holds per tag of the workload's files (system
    samples, which the collector takes on its own, left out)."""
    tags = json.loads(tp(coord, "metrics", run_id, "--json"))["tags"]
    return {t["tag"]: int(t["points"]) for t in tags if not t["tag"].startswith("system/")}


def system_points(coord: CoordinatorProcess, run_id: str) -> int:
    """How many samples of the collector's own (source ``system``) the store holds."""
    tags = json.loads(tp(coord, "metrics", run_id, "--raw", "--source", "system", "--json"))
    return sum(int(t["points"]) for t in tags["tags"])


def delivered_once(coord: CoordinatorProcess, run_id: str, expected: dict[str, int]) -> None:
    """Every point the workload wrote is stored exactly once: the tags hold ``expected`` and
    the store counted no point twice (points_stored is the files' and the samples' points)."""

    def drained() -> list[dict[str, Any]] | None:
        members = delivery(coord, run_id)
        return members if members and all(m["drained"] for m in members) else None

    members = wait_until("the collectors to deliver everything", drained, 60)
    assert tag_points(coord, run_id) == expected
    stored = sum(int(m["points_stored"]) for m in members)
    assert stored == sum(expected.values()) + system_points(coord, run_id), members


def revive_after_both(
    coord: CoordinatorProcess,
    agent: AgentProcess,
    coordinator_point: str,
    agent_point: str,
    timeout: float = 120,
) -> None:
    """Wait until the coordinator has died at ``coordinator_point`` and the agent at
    ``agent_point``, in whatever order the Job reaches them, starting each again unarmed as
    soon as it died (the other one may still be running, or dead)."""
    waiting = {"coordinator": coordinator_point, "agent": agent_point}

    def revive() -> bool:
        if "coordinator" in waiting and not coord.alive():
            died_at(coord, waiting.pop("coordinator"), timeout=5)
            coord.restart()
        if "agent" in waiting and not agent.alive():
            died_at(agent, waiting.pop("agent"), timeout=5)
            agent.restart()
        return not waiting

    wait_until(f"the crash points {waiting} to be reached", revive, timeout)
