"""A real multi-host install: the coordinator and each Node in a network namespace of its own.

Rules: every host has its own address on a bridge (tests/support/netns.py), names resolve
through the namespace's hosts file, and a lost link is made by taking an interface down, never
by killing a process. Needs root and ``ip netns``; skips with a sentence otherwise (fails under
``CI=true``).
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import attrs
import pytest

from tests.agent.jobs import TERMINAL, journal, tp
from tests.faults.jobs import runner_alive
from tests.support import accounts
from tests.support.agent import AgentProcess, start_agent, wait_until
from tests.support.coordinator import CoordinatorProcess, start_coordinator
from tests.support.netns import Network, open_network, require_netns
from tests.support.payloads import MEET_PY

pytestmark = pytest.mark.slow

_LISTEN = """
import socket, sys
s = socket.socket()
s.bind(("0.0.0.0", 0))
s.listen()
print(s.getsockname()[1], flush=True)
conn, peer = s.accept()
print(peer[0], conn.recv(16).decode(), flush=True)
"""

_DIAL = """
import socket, sys
with socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=5) as c:
    c.sendall(b"hello")
"""


def test_hosts_reach_each_other_by_name_and_a_cut_link_heals() -> None:
    require_netns("to give each host an address of its own")
    with open_network(["alpha", "beta"]) as net:
        alpha, beta = net.host("alpha"), net.host("beta")
        assert (alpha.address, beta.address) == ("10.77.0.1", "10.77.0.2")
        # The machine's own namespace holds none of these addresses.
        own = subprocess.run(["ip", "-o", "addr"], capture_output=True, text=True, check=True)
        assert "10.77.0." not in own.stdout
        listener = subprocess.Popen(
            alpha.argv(sys.executable, "-c", _LISTEN), stdout=subprocess.PIPE, text=True
        )
        try:
            assert listener.stdout is not None
            port = listener.stdout.readline().strip()
            dialled = beta.run(sys.executable, "-c", _DIAL, "alpha", port)
            assert dialled.returncode == 0, dialled.stderr
            out, _ = listener.communicate(timeout=10)
            assert out.split() == ["10.77.0.2", "hello"]
        finally:
            if listener.poll() is None:
                listener.kill()
            listener.wait()
        beta.cut()
        refused = beta.run(sys.executable, "-c", _DIAL, "alpha", port)
        assert refused.returncode != 0
        beta.heal()
        up = beta.run("ip", "-o", "addr", "show", "dev", "eth0")
        assert "10.77.0.2/24" in up.stdout
        names = [
            line.split()[0]
            for line in subprocess.run(
                ["ip", "netns", "list"], capture_output=True, text=True, check=True
            ).stdout.splitlines()
        ]
        assert alpha.netns in names and beta.netns in names
    after = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=True)
    assert alpha.netns not in after.stdout and net.switch not in after.stdout


# Rank 0 listens at MASTER_ADDR:MASTER_PORT, the other ranks connect (retrying until it is up)
# and say their rank; once all are in, rank 0 answers everyone and every rank trains alone: a
# metric and a log line per step, 40 steps, or (hold mode) until the release file appears.
TRAIN_PY = (
    MEET_PY
    + r"""
import os, sys, time
from pathlib import Path
from tuneplane.report import finish, init, log

rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
out = Path(os.environ["TUNEPLANE_OUT_DIR"])
mode = (Path.cwd() / "mode.txt").read_text().strip()
addr = (os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]))
met = meet(rank, world, addr)
print(f"rank {rank} met {met} at {addr[0]}:{addr[1]}", flush=True)
init({"lr": 0.1})
release = Path(mode[len("hold:"):]) if mode.startswith("hold:") else None
step = 0
while True:
    log({"train/loss": 1.0 / (step + 1)}, step=step)
    print(f"rank {rank} step {step}", flush=True)
    step += 1
    if release is None and step >= 40:
        break
    if release is not None:
        if release.exists() or step >= 3000:
            break
        time.sleep(0.05)
finish()
(out / f"steps-{rank}.txt").write_text(str(step))
"""
)

HEARTBEAT_TIMEOUT_S = 3.0


@attrs.frozen
class Site:
    """The coordinator on host ``coord`` (bound to 0.0.0.0, advertised as ``coord``) and two
    Nodes on hosts ``node-a`` and ``node-b``, each enrolled by that name."""

    net: Network
    coord: CoordinatorProcess
    agents: dict[str, AgentProcess]

    def tp(self, *args: str, cwd: Path | None = None) -> str:
        """The real ``tp``, run on the coordinator's host (tp-context.json names ``coord``)."""
        return tp(self.coord, *args, cwd=cwd, prefix=self.net.host("coord").prefix())

    def tp_json(self, *args: str) -> Any:
        return json.loads(self.tp(*args, "--json"))

    def submit(self, root: Path, mode: str) -> str:
        """A 2-member pytorch/process-group Job (1 GPU each) running TRAIN_PY in ``mode``."""
        root.mkdir()
        self.tp("init", str(root), "--name", "multihost", cwd=root)
        self.tp("new", "job", "--method", "pytorch/process-group", cwd=root)
        experiment = root / "experiments" / "job"
        (experiment / "train.py").write_text(TRAIN_PY)
        (experiment / "mode.txt").write_text(mode + "\n")
        out = self.tp(
            "submit", "job", "--profile", "h200:2", "--members", "2", "--yes", "--json", cwd=root
        )
        return str(json.loads(out.strip().splitlines()[-1])["run_id"])

    def job(self, run_id: str) -> dict[str, Any]:
        data: dict[str, Any] = self.tp_json("job", "show", run_id)
        return data

    def wait_state(self, run_id: str, states: set[str], timeout: float) -> dict[str, Any]:
        found: dict[str, Any] = wait_until(
            f"job {run_id} to be {' or '.join(sorted(states))}",
            lambda: (j := self.job(run_id))["state"] in states and j,
            timeout,
        )
        return found

    def member(self, run_id: str, index: int) -> tuple[AgentProcess, dict[str, Any]]:
        """The agent that runs member ``index`` of ``run_id`` and its journal row."""
        for agent in self.agents.values():
            for row in journal(agent, "members", "--json"):
                if row["run_id"] == run_id and row["member_index"] == index:
                    return agent, row
        raise AssertionError(f"no Node journals member {index} of {run_id}")

    def wait_delivered(self, run_id: str, timeout: float = 60) -> list[dict[str, Any]]:
        def drained() -> list[dict[str, Any]] | None:
            members: list[dict[str, Any]] = self.tp_json("metrics", run_id, "--delivery")["members"]
            done = len(members) == 2 and all(m["drained"] for m in members)
            return members if done else None

        found: list[dict[str, Any]] = wait_until("both collectors to drain", drained, timeout)
        return found

    def loss_points(self, run_id: str, member: int) -> tuple[int, int]:
        """(points stored, last step) of member ``member``'s train/loss."""
        tags = self.tp_json("metrics", run_id, "--raw", "--member", str(member))["tags"]
        (loss,) = [t for t in tags if t["tag"] == "train/loss"]
        return int(loss["points"]), int(loss["last_step"])

    def loss_points_or_zero(self, run_id: str, member: int) -> int:
        """How many train/loss points of member ``member`` the coordinator holds (0: none)."""
        tags = self.tp_json("metrics", run_id, "--raw", "--member", str(member))["tags"]
        return sum(int(t["points"]) for t in tags if t["tag"] == "train/loss")

    def explain(self, run_id: str, agent: AgentProcess) -> str:
        """What the coordinator and ``agent`` say, for a failed wait's message."""
        return (
            f"job: {self.job(run_id)}\n"
            f"node: {self.tp_json('node', 'show', agent.node_id)}\n"
            f"coordinator log (end):\n{self.coord.read_log()[-4000:]}\n"
            f"agent log (end):\n{agent.read_log()[-4000:]}"
        )

    def stdout(self, run_id: str, member: int) -> list[str]:
        return self.tp("logs", run_id, "--member", str(member)).splitlines()


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Site]:
    require_netns("to put the coordinator and each Node on a host of its own")
    root = tmp_path_factory.mktemp("multihost")
    with open_network(["coord", "node-a", "node-b"]) as net:
        coord = start_coordinator(
            root,
            heartbeat_timeout=HEARTBEAT_TIMEOUT_S,
            prefix_argv=net.host("coord").prefix(),
            host="0.0.0.0",
            advertise="coord",
        )
        agents: dict[str, AgentProcess] = {}
        try:
            for name in ("node-a", "node-b"):
                agents[name] = start_agent(
                    root, coord, name, "h200:1", prefix_argv=net.host(name).prefix()
                )
            for agent in agents.values():
                agent.wait_connected()
            yield Site(net, coord, agents)
        finally:
            for name, agent in agents.items():
                net.host(name).heal()
                if agent.alive():
                    agent.stop()
            coord.stop()


def test_the_coordinator_on_0_0_0_0_hands_out_its_advertised_name(site: Site) -> None:
    endpoints = json.loads((site.coord.state_dir / "endpoints.json").read_text())
    for listener in ("api", "control", "telemetry"):
        assert endpoints[listener].startswith("coord:"), endpoints
    context = json.loads(site.coord.context_path.read_text())
    assert context["coordinator"] == endpoints["api"]
    # Each Node enrolled by that name.
    for agent in site.agents.values():
        assert (
            json.loads((agent.state_dir / "node.json").read_text())["coordinator"]
            == (endpoints["control"])
        )
    # The dev CA's server certificate was reissued to cover the advertised name.
    assert "DNS:coord" in subprocess.run(
        ["openssl", "x509", "-noout", "-ext", "subjectAltName", "-in",
         str(site.coord.state_dir / "tls" / "server.pem")],
        capture_output=True, text=True, check=True,
    ).stdout  # fmt: skip


def test_a_process_group_job_across_hosts_ships_logs_and_metrics_from_both(
    site: Site, tmp_path: Path
) -> None:
    run_id = site.submit(tmp_path / "proj", "short")
    done = site.wait_state(run_id, TERMINAL, 120)
    assert done["state"] == "succeeded", done
    agent0, member0 = site.member(run_id, 0)
    agent1, _ = site.member(run_id, 1)
    assert {agent0.node_id, agent1.node_id} == {a.node_id for a in site.agents.values()}
    rendezvous = member0["rendezvous"]
    # Member 0's Node picked an address of its own host, not loopback.
    host0 = next(n for n, a in site.agents.items() if a is agent0)
    assert rendezvous.startswith(site.net.host(host0).address + ":"), rendezvous
    # Metrics arrive from both hosts: every step exactly once (the collectors ship to the
    # coordinator's advertised telemetry address, not to their own loopback).
    site.wait_delivered(run_id)
    for member in (0, 1):
        assert site.loss_points(run_id, member) == (40, 39)
        lines = site.stdout(run_id, member)
        assert lines[0] == f"rank {member} met [0, 1] at {rendezvous}", lines[:3]
        assert lines[1:] == [f"rank {member} step {s}" for s in range(40)]


def test_a_cut_link_makes_the_job_unknown_and_the_heal_loses_nothing(
    site: Site, tmp_path: Path
) -> None:
    # Where the member accounts can look (pytest's own folders are not theirs to pass through).
    release = accounts.traversable_root("multihost") / "release"
    run_id = site.submit(tmp_path / "proj", f"hold:{release}")
    try:
        site.wait_state(run_id, {"running"}, 120)
        agent1, member1 = site.member(run_id, 1)
        host1 = next(n for n, a in site.agents.items() if a is agent1)
        member_dir = Path(member1["member_dir"])
        # Let both members ship some points before the cut.
        wait_until("member 1's first points", lambda: site.loss_points_or_zero(run_id, 1) > 5)

        site.net.host(host1).cut()
        try:
            try:
                shown = site.wait_state(run_id, {"unknown"}, 30)
            except AssertionError:
                raise AssertionError(site.explain(run_id, agent1)) from None
            assert "disconnected" in shown["state_reason"], shown
            assert not site.tp_json("node", "show", agent1.node_id)["connected"]
            # The member runs on, and goes on writing points its collector cannot ship yet.
            assert runner_alive(member_dir), "a cut link must not touch the member"
            out = Path(member1["out_dir"])
            steps_at_cut = site.loss_points_or_zero(run_id, 1)
            wait_until(
                "member 1 to log steps the coordinator cannot have",
                lambda: _logged_steps(out) > steps_at_cut + 20,
            )
            assert site.loss_points_or_zero(run_id, 1) == steps_at_cut
        finally:
            site.net.host(host1).heal()
        agent1.wait_connected(60)
        site.wait_state(run_id, {"running"}, 30)
        assert runner_alive(member_dir)
    finally:
        release.write_text("go\n")
    done = site.wait_state(run_id, TERMINAL, 60)
    assert done["state"] == "succeeded", done
    assert "failed" not in [change["state"] for change in done["history"]]
    site.wait_delivered(run_id)
    for member in (0, 1):
        _, row = site.member(run_id, member)
        steps = int((Path(row["out_dir"]) / f"steps-{member}.txt").read_text())
        # Every step exactly once, and the whole log, the cut notwithstanding.
        assert site.loss_points(run_id, member) == (steps, steps - 1)
        lines = site.stdout(run_id, member)
        assert lines[1:] == [f"rank {member} step {s}" for s in range(steps)]


def _logged_steps(out: Path) -> int:
    """How many train/loss points the SDK wrote under ``out`` (its JSONL files)."""
    count = 0
    for path in out.rglob("*.jsonl"):
        count += path.read_text(errors="replace").count('"train/loss"')
    return count
