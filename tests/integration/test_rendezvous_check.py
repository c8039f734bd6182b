"""Rendezvous checked before Commit, with a real coordinator and two real agents on loopback.

Member 0's Node holds a listener on the rendezvous port from Prepare until the workload starts;
the other member's Node proves at its own Prepare that it reaches it. When member 0's Node
advertises an address the other cannot reach (here a documented TEST-NET-3 address, through
the agent's clearly named test setting), the Prepare is refused naming the address, the port
and the interface, the attempt is aborted, every GPU is freed and nothing starts. When it can,
every rank runs with NCCL_SOCKET_IFNAME and GLOO_SOCKET_IFNAME naming the interface that
routes to the rendezvous (loopback here), unless the Job's env names one.
"""

from __future__ import annotations

import json
import socket
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.agent.jobs import job, journal, tp, wait_job
from tests.faults.jobs import held_gpus, project, submit
from tests.support.agent import AgentProcess, start_agent, wait_until
from tests.support.coordinator import CoordinatorProcess, start_coordinator
from tests.support.payloads import MEET_PY
from tuneplane.agent import rendezvous as rdv

pytestmark = pytest.mark.slow

UNREACHABLE = "203.0.113.7"  # TEST-NET-3 (RFC 5737): routed nowhere that answers

# The ranks meet at the rendezvous (rank 0 binds its port, free again once the Node's listener let
# go of it); each records what it saw.
TRAIN_PY = (
    MEET_PY
    + r"""
import json, os
from pathlib import Path

NAMES = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "NCCL_SOCKET_IFNAME",
         "GLOO_SOCKET_IFNAME")
env = {name: os.environ.get(name) for name in NAMES}
rank, world = int(env["RANK"]), int(env["WORLD_SIZE"])
meet(rank, world, (env["MASTER_ADDR"], int(env["MASTER_PORT"])))
Path(os.environ["TUNEPLANE_OUT_DIR"], f"env-{rank}.json").write_text(json.dumps(env))
"""
)


@pytest.fixture(scope="module")
def cluster(
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[tuple[CoordinatorProcess, AgentProcess, AgentProcess]]:
    root = tmp_path_factory.mktemp("rdv")
    with start_coordinator(root) as coord:
        a = start_agent(root, coord, "node-a", "h200:1")
        b = start_agent(root, coord, "node-b", "h200:1")
        try:
            a.wait_connected()
            b.wait_connected()
            yield coord, a, b
        finally:
            for agent in (a, b):
                if agent.alive():
                    agent.stop()


def _members(agents: tuple[AgentProcess, ...], run_id: str) -> dict[int, dict[str, Any]]:
    found: dict[int, dict[str, Any]] = {}
    for agent in agents:
        for member in journal(agent, "members", "--json"):
            if member["run_id"] == run_id:
                found[member["member_index"]] = dict(member, agent=agent)
    return found


def _port_free(port: int) -> bool:
    with socket.socket() as sock:
        try:
            sock.bind(("0.0.0.0", port))
        except OSError:
            return False
    return True


def test_an_unreachable_rendezvous_refuses_prepare_and_starts_nothing(
    cluster: tuple[CoordinatorProcess, AgentProcess, AgentProcess], tmp_path: Path
) -> None:
    coord, a, b = cluster
    try:
        for agent in (a, b):
            agent.restart({rdv.TEST_ADDRESS_VARIABLE: UNREACHABLE})
            agent.wait_connected()
        root = project(coord, tmp_path / "proj", "pytorch/process-group", {"train.py": TRAIN_PY})
        run_id = submit(coord, root, "h200:2", "--members", "2")
        done = wait_job(coord, run_id, 90)
        assert done["state"] == "aborted", done
        attempt = done["attempts"][0]
        assert attempt["master_addr"] == UNREACHABLE
        port = attempt["master_port"]
        members = _members((a, b), run_id)
        assert sorted(members) == [0, 1]
        route = rdv.route_to(UNREACHABLE)
        tried = f"from interface {route.interface}" if route else "no interface of this Node"
        reason = done["state_reason"]
        assert f"member 1 on Node {members[1]['agent'].node_id} refused Prepare" in reason
        assert f"cannot reach the rendezvous {UNREACHABLE}:{port}" in reason, reason
        assert tried in reason, reason
        # `tp job show` tells the researcher the same sentence.
        shown = tp(coord, "job", "show", run_id)
        assert f"{UNREACHABLE}:{port}" in " ".join(shown.split()), shown

        # Nothing started: both members ended aborted without a runner; every GPU is free and
        # member 0's Node let go of the port it held.
        for index, member in members.items():
            assert member["state"] == "aborted", member
            assert not (Path(member["member_dir"]) / "runner.json").exists(), index
        assert "cannot reach the rendezvous" in members[1]["reason"]
        for agent in (a, b):
            wait_until(f"{agent.node_id} to free its GPUs", lambda a=agent: not held_gpus(a))
        wait_until(f"port {port} to be released", lambda: _port_free(port))
        assert job(coord, run_id)["state"] == "aborted"
    finally:
        for agent in (a, b):
            agent.restart()
            agent.wait_connected()


def test_a_reachable_rendezvous_launches_with_the_interface_variables(
    cluster: tuple[CoordinatorProcess, AgentProcess, AgentProcess], tmp_path: Path
) -> None:
    coord, a, b = cluster
    lo = rdv.interface_of("127.0.0.1", rdv.local_interfaces())
    root = project(coord, tmp_path / "proj", "pytorch/process-group", {"train.py": TRAIN_PY})
    run_id = submit(coord, root, "h200:2", "--members", "2")
    done = wait_job(coord, run_id, 90)
    assert done["state"] == "succeeded", done
    members = _members((a, b), run_id)
    attempt = done["attempts"][0]
    rendezvous = f"{attempt['master_addr']}:{attempt['master_port']}"
    for index, member in members.items():
        env = json.loads((Path(member["out_dir"]) / f"env-{index}.json").read_text())
        assert f"{env['MASTER_ADDR']}:{env['MASTER_PORT']}" == rendezvous
        assert env["NCCL_SOCKET_IFNAME"] == lo and env["GLOO_SOCKET_IFNAME"] == lo, env

    # The Job's own choice wins over the Node's.
    root = project(coord, tmp_path / "own", "pytorch/process-group", {"train.py": TRAIN_PY})
    run_id = submit(coord, root, "h200:2", "--members", "2", "--env", "NCCL_SOCKET_IFNAME=ib9")
    done = wait_job(coord, run_id, 90)
    assert done["state"] == "succeeded", done
    for index, member in _members((a, b), run_id).items():
        env = json.loads((Path(member["out_dir"]) / f"env-{index}.json").read_text())
        assert env["NCCL_SOCKET_IFNAME"] == "ib9" and env["GLOO_SOCKET_IFNAME"] == lo, env
