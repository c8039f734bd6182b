"""The rendezvous check on a real multi-host network: the coordinator and two Nodes each in a
network namespace of its own (tests/support/netns.py), every Node with two interfaces: ``eth0``
on the shared LAN, with the default route, and ``eth1`` on a segment of its own that no other
host is on (unrouted from anywhere else).

- A process-group Job meets at the LAN address member 0's Node reaches the coordinator from,
  and every rank gets NCCL_SOCKET_IFNAME and GLOO_SOCKET_IFNAME = ``eth0``, never ``eth1`` or
  ``lo``.
- When member 0's Node advertises its ``eth1`` address (the agent's test setting), the other
  Node (whose default route goes through the coordinator's host, which forwards nothing) cannot
  reach it, and its Prepare is refused naming that address, the port and ``eth0``, the
  interface it tried from; the attempt is aborted, every GPU freed, nothing started.

Needs root and ``ip netns``; skips with a sentence otherwise (fails under ``CI=true``).
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.agent.jobs import TERMINAL, journal
from tests.faults.jobs import held_gpus
from tests.support.agent import AgentProcess, start_agent, wait_until
from tests.support.coordinator import CoordinatorProcess, admin_argv, start_coordinator
from tests.support.netns import Network, open_network, require_netns
from tests.support.payloads import MEET_PY
from tuneplane.agent import rendezvous as rdv

pytestmark = pytest.mark.slow

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


class Site:
    """The namespaces, the coordinator in ``coord`` and the two agents in ``node-a``/``node-b``."""

    def __init__(
        self, net: Network, coord: CoordinatorProcess, agents: dict[str, AgentProcess]
    ) -> None:
        self.net = net
        self.coord = coord
        self.agents = agents

    def tp(self, *args: str, cwd: Path | None = None) -> str:
        """The real ``tp``, run on the coordinator's host (where its advertised name resolves)."""
        done = subprocess.run(
            self.net.host("coord").argv(
                sys.executable, "-m", "tuneplane.coordinator.cli.tp", "--context",
                str(self.coord.context_path), *args,
            ),
            cwd=cwd, capture_output=True, text=True, timeout=60, check=False,
        )  # fmt: skip
        assert done.returncode == 0, done.stderr
        return done.stdout

    def job(self, run_id: str) -> dict[str, Any]:
        data: dict[str, Any] = json.loads(self.tp("job", "show", run_id, "--json"))
        return data

    def submit(self, root: Path) -> str:
        root.mkdir()
        self.tp("init", str(root), "--name", "rdv", cwd=root)
        self.tp("new", "job", "--method", "pytorch/process-group", cwd=root)
        (root / "experiments" / "job" / "train.py").write_text(TRAIN_PY)
        out = self.tp(
            "submit", "job", "--profile", "h200:2", "--members", "2", "--yes", "--json", cwd=root
        )
        return str(json.loads(out.strip().splitlines()[-1])["run_id"])

    def wait_ended(self, run_id: str) -> dict[str, Any]:
        ended: dict[str, Any] = wait_until(
            f"job {run_id} to end",
            lambda: (j := self.job(run_id))["state"] in TERMINAL and j,
            120,
        )
        return ended

    def by_member(self, run_id: str) -> dict[int, dict[str, Any]]:
        found: dict[int, dict[str, Any]] = {}
        for name, agent in self.agents.items():
            for member in journal(agent, "members", "--json"):
                if member["run_id"] == run_id:
                    found[member["member_index"]] = dict(member, host=name)
        return found

    def member_0_host(self) -> str:
        """Members are indexed by Node id: member 0 lands on the Node with the smaller id."""
        return min(self.agents, key=lambda name: self.agents[name].node_id)


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Site]:
    require_netns("to give the coordinator and each Node a host and interfaces of their own")
    root = tmp_path_factory.mktemp("rdv-netns")
    with open_network(["coord", "node-a", "node-b"]) as net:
        for n, name in enumerate(("node-a", "node-b")):
            net.add_segment(f"dark-{name}", f"10.{80 + n}.0")
            net.attach(name, f"dark-{name}")  # eth1: on a segment no other host is on
            # The default route goes through the coordinator's host, which forwards nothing: a
            # packet for another Node's eth1 leaves by eth0 and is dropped there. (A route that
            # sends it straight onto the LAN would reach it: Linux answers for every address
            # of a host on every interface.)
            done = net.host(name).run(
                "ip", "route", "add", "default", "via", net.host("coord").address, "dev", "eth0"
            )
            assert done.returncode == 0, done.stderr
        state_dir = root / "coordinator"
        subprocess.run(
            admin_argv("init", "--state-dir", str(state_dir), "--san", "coord"),
            check=True, capture_output=True, timeout=60,
        )  # fmt: skip
        with start_coordinator(
            root, prefix_argv=net.host("coord").prefix(), host="0.0.0.0", advertise="coord"
        ) as coord:
            agents = {
                name: start_agent(root, coord, name, "h200:1", prefix_argv=net.host(name).prefix())
                for name in ("node-a", "node-b")
            }
            try:
                for agent in agents.values():
                    agent.wait_connected()
                yield Site(net, coord, agents)
            finally:
                for agent in agents.values():
                    if agent.alive():
                        agent.stop()


def test_ranks_meet_on_the_routed_interface_and_name_it(site: Site, tmp_path: Path) -> None:
    run_id = site.submit(tmp_path / "ok")
    done = site.wait_ended(run_id)
    assert done["state"] == "succeeded", done
    attempt = done["attempts"][0]
    first = site.member_0_host()
    # Member 0's Node advertised its LAN address: the one it reaches the coordinator from.
    assert attempt["master_addr"] == site.net.host(first).addresses["lan"]
    for index, member in site.by_member(run_id).items():
        env = json.loads((Path(member["out_dir"]) / f"env-{index}.json").read_text())
        assert env["NCCL_SOCKET_IFNAME"] == "eth0", (member["host"], env)
        assert env["GLOO_SOCKET_IFNAME"] == "eth0", (member["host"], env)


def test_a_rendezvous_on_the_unrouted_interface_refuses_prepare(site: Site, tmp_path: Path) -> None:
    first = site.member_0_host()
    other = next(name for name in site.agents if name != first)
    dark = site.net.host(first).addresses[f"dark-{first}"]
    agent = site.agents[first]
    try:
        agent.restart({rdv.TEST_ADDRESS_VARIABLE: dark})
        agent.wait_connected()
        run_id = site.submit(tmp_path / "dark")
        done = site.wait_ended(run_id)
        assert done["state"] == "aborted", done
        port = done["attempts"][0]["master_port"]
        reason = done["state_reason"]
        other_id = site.agents[other].node_id
        assert f"member 1 on Node {other_id} refused Prepare" in reason, reason
        assert f"cannot reach the rendezvous {dark}:{port}" in reason, reason
        lan = site.net.host(other).addresses["lan"]
        assert f"It tried from interface eth0 (local address {lan})" in reason, reason
        shown = site.tp("job", "show", run_id)
        assert f"{dark}:{port}" in " ".join(shown.split()), shown

        members = site.by_member(run_id)
        assert sorted(members) == [0, 1]
        for member in members.values():
            assert member["state"] == "aborted", member
            assert not (Path(member["member_dir"]) / "runner.json").exists(), member
        for name, each in site.agents.items():
            wait_until(f"{name} to free its GPUs", lambda a=each: not held_gpus(a))
    finally:
        agent.restart()
        agent.wait_connected()
