"""A real process group across two Nodes: 2 members x 2 simulated GPUs, four processes that meet
over TCP at the rendezvous member 0's Node picked at Prepare and the Commit carried to the other."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.agent.jobs import job, journal, wait_job
from tests.faults.jobs import held_gpus, project, submit
from tests.support.agent import AgentProcess, two_agents, wait_until
from tests.support.coordinator import CoordinatorProcess
from tests.support.payloads import MEET_PY

pytestmark = pytest.mark.slow

# Rank 0 listens at MASTER_ADDR:MASTER_PORT; every other rank connects (retrying until rank 0
# is up) and says its rank; rank 0 answers everyone with the sorted list once all WORLD_SIZE
# ranks are in. Every process records its environment, so the test can check what it saw.
TRAIN_PY = (
    MEET_PY
    + r"""
import json, os, sys, time
from pathlib import Path

NAMES = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "NODE_RANK", "NNODES",
         "MASTER_ADDR", "MASTER_PORT", "CUDA_VISIBLE_DEVICES", "TUNEPLANE_RUN_ID",
         "TUNEPLANE_ATTEMPT", "TUNEPLANE_OUT_DIR")
env = {name: os.environ.get(name) for name in NAMES}
rank, world = int(env["RANK"]), int(env["WORLD_SIZE"])
out = Path(env["TUNEPLANE_OUT_DIR"])
(out / f"env-{rank}.json").write_text(json.dumps(dict(env, pid=os.getpid())))
mode = (Path.cwd() / "mode.txt").read_text().strip() if (Path.cwd() / "mode.txt").exists() else ""
if mode == "fail":
    if rank == 1:
        # Fail only once rank 0 is recorded, or the runner may stop it before it says its pid.
        deadline = time.monotonic() + 30
        recorded = out / "env-0.json"
        while not (recorded.exists() and recorded.stat().st_size) and time.monotonic() < deadline:
            time.sleep(0.02)
        sys.exit(5)
    if rank == 0:
        time.sleep(300)  # a sibling that would wait forever: the runner must stop it
    sys.exit(0)
addr = (env["MASTER_ADDR"], int(env["MASTER_PORT"]))
result = meet(rank, world, addr)
(out / f"met-{rank}.json").write_text(json.dumps(result))
"""
)


@pytest.fixture(scope="module")
def two_nodes(
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[tuple[CoordinatorProcess, AgentProcess, AgentProcess]]:
    with two_agents(tmp_path_factory.mktemp("pg"), "h200:2") as cluster:
        yield cluster


def _members_by_index(agents: tuple[AgentProcess, ...], run_id: str) -> dict[int, dict[str, Any]]:
    found: dict[int, dict[str, Any]] = {}
    for agent in agents:
        for member in journal(agent, "members", "--json"):
            if member["run_id"] == run_id:
                found[member["member_index"]] = dict(member, node_id=agent.node_id)
    return found


def test_four_processes_on_two_nodes_meet_and_exit_zero(
    two_nodes: tuple[CoordinatorProcess, AgentProcess, AgentProcess], tmp_path: Path
) -> None:
    coord, a, b = two_nodes
    root = project(coord, tmp_path / "proj", "pytorch/process-group", {"train.py": TRAIN_PY})
    run_id = submit(coord, root, "h200:4", "--members", "2")
    done = wait_job(coord, run_id, 90)
    assert done["state"] == "succeeded", done
    attempt = done["attempts"][0]
    members = _members_by_index((a, b), run_id)
    assert sorted(members) == [0, 1]
    assert {members[0]["node_id"], members[1]["node_id"]} == {a.node_id, b.node_id}

    # Member 0's Node picked the rendezvous at Prepare; the other member only got it by Commit.
    rendezvous = members[0]["rendezvous"]
    assert rendezvous and members[1]["rendezvous"] == rendezvous
    assert f"{attempt['master_addr']}:{attempt['master_port']}" == rendezvous
    inventories = {
        agent.node_id: {g["index"]: g["uuid"] for g in agent.status()["inventory"]["gpus"]}
        for agent in (a, b)
    }

    for index, member in members.items():
        out = Path(member["out_dir"])
        uuids = [inventories[member["node_id"]][i] for i in member["gpu_indexes"]]
        assert len(uuids) == 2
        for local_rank in range(2):
            rank = index * 2 + local_rank
            env = json.loads((out / f"env-{rank}.json").read_text())
            assert env["RANK"] == str(rank) and env["LOCAL_RANK"] == str(local_rank)
            assert env["WORLD_SIZE"] == "4" and env["LOCAL_WORLD_SIZE"] == "2"
            assert env["NODE_RANK"] == str(index) and env["NNODES"] == "2"
            assert env["CUDA_VISIBLE_DEVICES"] == uuids[local_rank]
            assert f"{env['MASTER_ADDR']}:{env['MASTER_PORT']}" == rendezvous
            assert env["TUNEPLANE_RUN_ID"] == run_id and env["TUNEPLANE_ATTEMPT"] == "1"
            assert env["TUNEPLANE_OUT_DIR"] == str(out)
            assert json.loads((out / f"met-{rank}.json").read_text()) == [0, 1, 2, 3]
        assert member["state"] == "exited" and member["exit_code"] == 0
    for shown in attempt["members"]:
        assert shown["has_exit"] and shown["exit_code"] == 0


def test_a_failing_local_process_fails_its_member_and_stops_its_sibling(
    two_nodes: tuple[CoordinatorProcess, AgentProcess, AgentProcess], tmp_path: Path
) -> None:
    coord, a, b = two_nodes
    files = {"train.py": TRAIN_PY, "mode.txt": "fail\n"}
    root = project(coord, tmp_path / "proj", "pytorch/process-group", files)
    run_id = submit(coord, root, "h200:4", "--members", "2")
    done = wait_job(coord, run_id, 60)
    assert done["state"] == "failed", done
    assert "member 0 exited with code 5" in done["state_reason"]
    shown = {m["index"]: m for m in done["attempts"][0]["members"]}
    assert shown[0]["has_exit"] and shown[0]["exit_code"] == 5
    members = _members_by_index((a, b), run_id)
    assert members[0]["exit_code"] == 5
    # Rank 0 would have slept for 300 s: the runner stopped it when its sibling failed.
    sibling = json.loads((Path(members[0]["out_dir"]) / "env-0.json").read_text())
    try:
        os.kill(int(sibling["pid"]), 0)
        alive = True
    except ProcessLookupError:
        alive = False
    assert not alive, "the failed member's sibling process must be stopped"
    for agent in (a, b):
        wait_until(f"{agent.node_id} to release its GPUs", lambda a=agent: not held_gpus(a))
    assert job(coord, run_id)["state"] == "failed"
