"""A Job spanning several Slurm nodes, each a host of its own: real Slurm, a real coordinator,
the real `tp`, and the real Slurm step on every node.

How the cluster is built (docs/operator.md, "Slurm"): Debian's Slurm is not built with
``--enable-multiple-slurmd``, so one machine cannot run two slurmd as two nodes. Instead every
node is a network namespace of its own (tests/support/netns.py) with its own address, and its
slurmd runs in a UTS namespace whose host name is the node's name: hosts ``sn1`` and ``sn2``
are the Slurm nodes, host ``ctl`` runs slurmctld, slurmrestd and the coordinator (bound to
0.0.0.0, advertised as ``ctl``), and names resolve through each namespace's hosts file. The
nodes share this machine's file system, as a real cluster shares its Fleet's shared folder, and
munged's socket (a path).

- A process group of 2 members x 2 GPUs runs one member per node: four ranks with RANK,
  LOCAL_RANK, WORLD_SIZE, NODE_RANK and NNODES as on Nodes, all meeting at MASTER_ADDR (the
  first node, by name) across the bridge; each member's collector ships its points to the
  coordinator's advertised address, and each member's output is in `tp logs`.
- One rank failing on the second node fails the Job with that member's exit code, recorded for
  that member; Slurm stops the first node's member (``--kill-on-bad-exit``).
"""

from __future__ import annotations

import json
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import attrs
import pytest

from tests.agent.jobs import tp
from tests.support.coordinator import CoordinatorProcess, start_coordinator
from tests.support.netns import Network, open_network, require_netns
from tests.support.payloads import MEET_PY
from tests.support.processes import wait_until
from tests.support.slurm import SlurmCluster, SlurmHost, require_slurm, slurm_cluster

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

PROFILES = '\n[profiles.hpc]\nseries = "h200"\nfleet = "hpc"\n'
NODES = ("sn1", "sn2")
JOB_TIMEOUT_S = 120.0
ENDED = frozenset({"succeeded", "failed", "cancelled", "aborted"})

RANKS_PY = (
    MEET_PY
    + r"""
import json, os, socket, sys
from pathlib import Path
rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
if os.environ.get("TP_FAIL_RANK") == str(rank):
    print(f"rank {rank} fails", file=sys.stderr, flush=True)
    sys.exit(7)
addr = (os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]))
met = meet(rank, world, addr)
keys = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "NODE_RANK", "NNODES", "MASTER_ADDR", "MASTER_PORT",
        "CUDA_VISIBLE_DEVICES", "TUNEPLANE_MEMBER_INDEX")
seen = {k: os.environ.get(k) for k in keys}
seen.update(hostname=socket.gethostname(), master_ip=socket.gethostbyname(addr[0]), met=met)
out = Path(os.environ["TUNEPLANE_OUT_DIR"])
(out / f"rank-{rank}.json").write_text(json.dumps(seen))
with open(Path(os.environ["TUNEPLANE_TELEMETRY_DIR"]) / f"rank-{rank}.jsonl", "w") as points:
    points.write(json.dumps({"step": 1, "rank/seen": rank}) + "\n")
print(f"rank {rank} on {seen['hostname']} met {met}", flush=True)
if os.environ.get("TP_FAIL_RANK"):
    import time
    time.sleep(300)  # the failing rank's node stops this one (srun --kill-on-bad-exit)
"""
)


@attrs.frozen
class Site:
    """The cluster (controller on ``ctl``, nodes ``sn1`` and ``sn2``) and a coordinator on
    ``ctl`` with the Fleet ``hpc`` on it, whose shared folder is ``shared``."""

    net: Network
    cluster: SlurmCluster
    coord: CoordinatorProcess
    shared: Path

    def tp(self, *args: str, cwd: Path | None = None) -> str:
        """The real ``tp``, run on the coordinator's host (tp-context.json names ``ctl``)."""
        return tp(self.coord, *args, cwd=cwd, prefix=self.net.host("ctl").prefix())

    def submit(self, root: Path, env: dict[str, str] | None = None) -> str:
        """A 2-member pytorch/process-group Job (2 GPUs each) running RANKS_PY."""
        root.mkdir()
        self.tp("init", str(root), "--name", "slurmnodes", cwd=root)
        self.tp("new", "job", "--method", "pytorch/process-group", cwd=root)
        experiment = root / "experiments" / "job"
        (experiment / "train.py").write_text(RANKS_PY)
        sets = [arg for k, v in (env or {}).items() for arg in ("--env", f"{k}={v}")]
        out = self.tp("submit", "job", "--profile", "hpc:4", "--members", "2", *sets,
                      "--yes", "--json", cwd=root)  # fmt: skip
        return str(json.loads(out.strip().splitlines()[-1])["run_id"])

    def job(self, run_id: str) -> dict[str, Any]:
        shown: dict[str, Any] = json.loads(self.tp("job", "show", run_id, "--json"))
        return shown

    def wait_ended(self, run_id: str) -> dict[str, Any]:
        seen: dict[str, Any] = {}

        def ended() -> bool:
            seen.update(self.job(run_id))
            return seen["state"] in ENDED

        try:
            wait_until(f"job {run_id} to end", ended, JOB_TIMEOUT_S)
        except AssertionError as exc:
            raise AssertionError(
                f"{exc}\nlast seen: {seen}\n{self.coord.read_log()[-3000:]}\n{self.cluster.logs()}"
            ) from None
        return seen

    def member(self, run_id: str, index: int) -> Path:
        return self.shared / run_id / "attempt-1" / f"member-{index}"


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Site]:
    require_slurm()
    require_netns("to give each Slurm node a host (an address and a name) of its own")
    root = tmp_path_factory.mktemp("slurmnodes")
    with open_network(["ctl", *NODES]) as net:
        ctl = net.host("ctl")
        controller = SlurmHost("ctl", ctl.address, ctl.prefix())
        nodes = [SlurmHost(n, net.host(n).address, net.host(n).prefix()) for n in NODES]
        with slurm_cluster(controller, nodes) as cluster:
            shared = root / "shared"
            shared.mkdir()
            token = root / "slurm.token"
            token.write_text(f"SLURM_JWT={cluster.token()}\n")
            coord = start_coordinator(
                root, config=PROFILES, prefix_argv=ctl.prefix(), host="0.0.0.0", advertise="ctl"
            )
            try:
                made = coord.admin("fleet", "create", "hpc", "--kind", "slurm", "--slurmrestd",
                                   cluster.rest_url, "--token-file", str(token), "--partition",
                                   cluster.partition, "--shared-dir", str(shared), "--python",
                                   sys.executable, "--spool-dir", str(root / "spool"))  # fmt: skip
                assert made.returncode == 0, made.stderr
                yield Site(net, cluster, coord, shared)
            finally:
                coord.stop()


def test_a_process_group_runs_one_member_per_slurm_node_and_its_ranks_meet(
    site: Site, tmp_path: Path
) -> None:
    fleet = json.loads(site.tp("fleet", "show", "hpc", "--json"))
    assert sorted(n["name"] for n in fleet["slurm"]["nodes"]) == list(NODES), fleet
    run_id = site.submit(tmp_path / "proj")
    done = site.wait_ended(run_id)
    assert done["state"] == "succeeded", done
    ranks: dict[int, dict[str, Any]] = {}
    for index in (0, 1):
        out = site.member(run_id, index) / "out"
        for path in out.glob("rank-*.json"):
            seen = json.loads(path.read_text())
            ranks[int(seen["RANK"])] = seen
            # Each member ran on a node of its own, in member order.
            assert seen["TUNEPLANE_MEMBER_INDEX"] == str(index)
            assert seen["hostname"] == NODES[index]
    assert sorted(ranks) == [0, 1, 2, 3]
    first = site.net.host(NODES[0]).address
    for rank, seen in ranks.items():
        assert seen["LOCAL_RANK"] == str(rank % 2) == seen["CUDA_VISIBLE_DEVICES"]
        assert (seen["WORLD_SIZE"], seen["NNODES"], seen["NODE_RANK"]) == ("4", "2", str(rank // 2))
        # Every rank found the rendezvous by the first node's name, across the bridge.
        assert (seen["MASTER_ADDR"], seen["master_ip"]) == (NODES[0], first)
        assert seen["met"] == [0, 1, 2, 3]
    assert len({seen["MASTER_PORT"] for seen in ranks.values()}) == 1
    # Each member's output reached `tp logs`, and each node's collector shipped its points.
    for index in (0, 1):
        logged = site.tp("logs", run_id, "--member", str(index)).splitlines()
        assert sorted(logged) == sorted(
            f"rank {r} on {NODES[index]} met [0, 1, 2, 3]" for r in (2 * index, 2 * index + 1)
        ), logged

    # Each rank's point, shipped by its node's collector: one series per rank file.
    expected = {(r // 2, f"telemetry/rank-{r}.jsonl", float(r), 1) for r in range(4)}
    stored: set[tuple[int, str, float, int]] = set()

    def shipped() -> bool:
        tags = json.loads(site.tp("metrics", run_id, "--raw", "--json"))["tags"]
        stored.clear()
        stored.update(
            (t["member_index"], t["source"], t["last_value"], t["points"])
            for t in tags
            if t["tag"] == "rank/seen"
        )
        return stored == expected

    try:
        wait_until("every rank's point to be stored", shipped, 60)
    except AssertionError as exc:
        raise AssertionError(f"{exc}: {sorted(stored)}") from None


def test_a_rank_failing_on_the_second_node_fails_the_job_with_its_members_exit(
    site: Site, tmp_path: Path
) -> None:
    run_id = site.submit(tmp_path / "proj", env={"TP_FAIL_RANK": "3"})
    done = site.wait_ended(run_id)
    assert done["state"] == "failed", done
    assert "(member 1 failed first; it exited with code 7)" in done["state_reason"], done
    [attempt] = done["attempts"]
    members = {m["index"]: m for m in attempt["members"]}
    assert (members[1]["state"], members[1]["exit_code"], members[1]["signal"]) == (
        "exited", 7, 0
    ), members  # fmt: skip
    record = json.loads((site.member(run_id, 1) / "exit.json").read_text())
    assert record["exit_code"] == 7
    assert site.tp("logs", run_id, "--member", "1", "--stderr") == "rank 3 fails\n"
    # The first node's member did not run on: Slurm stopped it (SIGTERM) when the second one
    # failed, and its runner recorded that; it ended after member 1, so it is not the cause.
    assert (members[0]["state"], members[0]["has_exit"], members[0]["signal"]) == (
        "exited", True, 15
    ), members  # fmt: skip
    assert members[0]["ended_at_ms"] >= members[1]["ended_at_ms"]
