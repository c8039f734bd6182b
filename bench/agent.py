"""Agent latency and cost on loopback: a real coordinator, real agents, real runners.

Rules: every figure comes from real processes (``LocalCluster``). The payload is ``/bin/true``,
as in the launch goals (issue 13), except for one size that runs a trivial Python file per local
process, to show what an interpreter's start adds. Latencies are measured from just before the
Preview call (submit) to (a) the last local process having started (the kernel's start time of
each process, from the runner's ``runner.json``; 10 ms granular), (b) the last runner's exit
record (``exit.json``'s ``finished_at``) and (c) the coordinator showing the Job ``succeeded``.
Sizes: 1 member x 1 process on 1 agent, with ``/bin/true`` and with Python; 4 members x 8
simulated GPUs (32 processes) on 4 agents; 16 members x 1 process on 16 agents. With Slurm
installed, the ``/bin/true`` sizes of 1 and 32 processes alternate run by run with ``srun -n1
true`` and ``srun -n32 --overcommit true`` on a throwaway cluster of this machine
(``bench/_slurm.py``), printed beside ours with the ratio and its goal. Then the journal's
recovery time (open with its integrity check, then replay) at 100k events. The idle agent has
its own benchmark (``bench/idle.py``). As root, members run as throwaway accounts the bench
creates (two per agent, disjoint between agents) and removes when it ends; its folder is 0711
so they can pass through to their work and output roots.

Knobs (env, or flags when run as ``python -m bench.agent``): ``TUNEPLANE_BENCH_AGENT_RUNS``
(``--runs``, default 30, runs of the small size), ``TUNEPLANE_BENCH_AGENT_BIG_RUNS``
(``--big-runs``, default 5, runs of each big size; the output says when it is under 30) and
``TUNEPLANE_BENCH_AGENT_EVENTS`` (``--events``, default 100000).
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import json
import os
import shutil
import sqlite3
import statistics
import sys
import tempfile
import time
from pathlib import Path

import attrs
import psutil
import trio

from tuneplane.agent.adapter import open_aio_host
from tuneplane.agent.collectors import COLLECTORS_DIR, DRAINED_MARKER
from tuneplane.agent.config import default_policy
from tuneplane.agent.inventory import parse_simulate_gpus
from tuneplane.agent.inventory_source import InventorySource
from tuneplane.agent.journal import Journal
from tuneplane.agent.journal_records import Exit, MemberKey, NewMember
from tuneplane.agent.member_state import MemberEvent
from tuneplane.agent.members import MemberManager
from tuneplane.coordinator.catalogue import Catalogue
from tuneplane.coordinator.cli.api_client import ApiClient
from tuneplane.coordinator.cli.connection import resolve_connection
from tuneplane.coordinator.demo import accounts
from tuneplane.coordinator.demo.cluster import LocalCluster

from ._launch_trace import job_steps, trace_lines
from ._slurm import SlurmCluster, slurm_cluster
from ._slurm_runs import LAUNCH_GOALS, launch_lines

FULL_RUNS = 30
PAYLOAD = (
    "import os, time\n"
    "from pathlib import Path\n"
    "now = time.time()\n"
    "Path(os.environ['TUNEPLANE_OUT_DIR'], 'started-' + os.environ['RANK']).write_text(repr(now))\n"
)
TRUE = "/bin/true"
METHOD = "pytorch/process-group"
ACCOUNTS_PER_AGENT = 2
JOB_TIMEOUT_S = 120.0


@attrs.frozen
class Size:
    name: str
    agents: int
    gpus_per_agent: int
    members: int
    runs: int
    # Runs PAYLOAD under python3 when set, otherwise /bin/true.
    python: bool = False

    @property
    def processes(self) -> int:
        return self.members * self.gpus_per_agent


@attrs.frozen
class Sample:
    running_s: float
    exited_s: float
    succeeded_s: float
    # Each recorded step, ms after submit (bench/_launch_trace.py).
    steps: dict[str, float] = attrs.field(factory=dict, eq=False)
    run_id: str = attrs.field(default="", eq=False)


def _jobspec(size: Size, i: int) -> str:
    recipe = Catalogue.bundled().get(METHOD)
    assert recipe is not None, f"the Catalogue has no {METHOD}"
    return json.dumps(
        {
            "api_version": "tuneplane/v1",
            "project": "bench",
            "experiment": f"agent-{size.name}-{i}",
            "method_id": METHOD,
            "recipe_digest": recipe.digest,
            "runtime_id": "",
            "entrypoint": ["python3", "train.py"] if size.python else [TRUE],
            "resources": {
                "profile": "h200",
                "series": "h200",
                "gpus": size.processes,
                "members": size.members,
            },
            "parameters": {"script": "train.py"},
            "env": {},
            "source_files": {"train.py": base64.b64encode(PAYLOAD.encode()).decode()},
        }
    )


def _max_float(paths: list[Path], read: str) -> float:
    values = []
    for path in paths:
        text = path.read_text()
        values.append(float(json.loads(text)[read]) if read else float(text))
    return max(values)


def _boot_skew() -> float:
    """What to add to a process start time from psutil to make it wall-clock time.

    psutil counts from the boot time in /proc/stat, which is whole seconds; /proc/uptime has
    the fraction.
    """
    uptime = float(Path("/proc/uptime").read_text().split()[0])
    return time.time() - uptime - psutil.boot_time()


async def _one_job(cluster: LocalCluster, api: ApiClient, size: Size, i: int) -> Sample:
    spec = _jobspec(size, i)
    t0 = time.time()
    preview = await api.preview(spec)
    receipt = await api.commit(preview.preview_id, preview.digest, f"bench-{size.name}-{i}")
    run_id = receipt.run_id
    # Waited for on WatchJob, not by polling GetJob: a poll every 10 ms loaded the machine
    # during the very launch measured, and saw a change only at the next poll.
    job, seen = None, 0.0
    try:
        async with asyncio.timeout(JOB_TIMEOUT_S):
            # The watch ends by itself after the terminal Job.
            async for job in api.watch_job(run_id):
                if job.state in ("succeeded", "failed", "aborted"):
                    seen = time.time()
    except TimeoutError:
        state = "not shown yet" if job is None else f"{job.state} ({job.state_reason})"
        raise RuntimeError(
            f"benchmark Job {run_id} is still {state} after {JOB_TIMEOUT_S:g} s; read the "
            f"logs under {cluster.root / 'logs'}"
        ) from None
    if job is None or job.state not in ("succeeded", "failed", "aborted"):
        raise RuntimeError(f"benchmark Job {run_id}: its watch ended before the Job did")
    if job.state != "succeeded":
        raise RuntimeError(f"benchmark Job {run_id} ended {job.state}: {job.state_reason}")
    members = [p for a in cluster.agents for p in (a.state_dir / "members").glob(f"{run_id}.1.*")]
    exits = [m / "exit.json" for m in members if (m / "exit.json").exists()]
    if size.python:
        started = [
            p for a in cluster.agents for p in (a.out_root / run_id).glob("attempt-1/*/started-*")
        ]
        count, running = len(started), _max_float(started, "")
    else:
        times = [
            float(process["start_time"])
            for m in members
            for process in json.loads((m / "runner.json").read_text())["processes"]
        ]
        count, running = len(times), max(times, default=0.0) + _boot_skew()
    if count != size.processes or len(exits) != size.members:
        raise RuntimeError(
            f"benchmark Job {run_id} left {count} start records for {size.processes} "
            f"processes and {len(exits)} exit records for {size.members} members"
        )
    steps = job_steps(
        run_id, t0, cluster.coordinator_dir / "coordinator.db",
        [(a.name, a.state_dir) for a in cluster.agents], _boot_skew(),
    )  # fmt: skip
    steps["client: saw succeeded"] = (seen - t0) * 1000
    return Sample(
        running_s=running - t0,
        exited_s=_max_float(exits, "finished_at") - t0,
        succeeded_s=seen - t0,
        steps=steps,
        run_id=run_id,
    )


async def _wait_free(api: ApiClient, gpus: int) -> None:
    """Until the coordinator shows every GPU free again (the last reports were applied)."""
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        nodes = await api.list_nodes()
        if sum(1 for n in nodes for g in n.inventory.gpus if g.index not in n.held_by) >= gpus:
            return
        await asyncio.sleep(0.02)
    raise RuntimeError("the coordinator did not free every GPU within 30 s of the Job ending")


async def _wait_drained(cluster: LocalCluster, run_id: str) -> None:
    """Until every member of ``run_id`` has its collector's ``drained`` marker."""
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        folders = [
            folder
            for agent in cluster.agents
            for folder in (agent.state_dir / COLLECTORS_DIR).glob(f"{run_id}.*")
        ]
        if folders and all((folder / DRAINED_MARKER).exists() for folder in folders):
            return
        await asyncio.sleep(0.02)
    raise RuntimeError(
        f"the collectors of benchmark Job {run_id} did not drain within 30 s; read their "
        f"collector.log files under {cluster.root}"
    )


async def _run_size(
    cluster: LocalCluster, size: Size, slurm: SlurmCluster | None
) -> tuple[list[Sample], list[float]]:
    """Our samples and, alternating with them run by run, srun's seconds (with a cluster)."""
    endpoint = resolve_connection(cluster.context_path, None, None, None)
    async with ApiClient(endpoint) as api:
        samples, srun = [], []
        for i in range(size.runs):
            samples.append(await _one_job(cluster, api, size, i))
            await _wait_free(api, size.agents * size.gpus_per_agent)
            # Each member's collector ships what is left after the exit: wait for it, so that
            # neither srun's run nor our next one shares the machine with that work.
            await _wait_drained(cluster, samples[-1].run_id)
            if slurm is not None:
                srun.append(await asyncio.to_thread(slurm.srun, size.processes))
        return samples, srun


def _p(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))]


def _report(size: Size, samples: list[Sample], srun: list[float]) -> None:
    note = "" if size.runs >= FULL_RUNS else f"  (only {size.runs} runs: p99 is the slowest run)"
    print(
        f"{size.name}: {size.members} members x {size.gpus_per_agent} processes "
        f"({size.processes} processes, {'python3 train.py' if size.python else TRUE}) "
        f"on {size.agents} agents, {len(samples)} runs{note}"
    )
    for label, values in (
        ("submit -> all processes running", [s.running_s for s in samples]),
        ("submit -> all exited (runner)", [s.exited_s for s in samples]),
        ("submit -> Job succeeded (coordinator)", [s.succeeded_s for s in samples]),
    ):
        print(
            f"  {label:<40} median {statistics.median(values) * 1000:7.0f} ms"
            f"   p99 {_p(values, 0.99) * 1000:7.0f} ms"
        )
    if srun:
        print("\n".join(launch_lines(size.processes, [s.exited_s for s in samples], srun)))
    if size.members == 1:
        print("\n".join(trace_lines([s.steps for s in samples])))


def bench_size(root: Path, size: Size, pool: list[str], slurm: SlurmCluster | None) -> None:
    with LocalCluster(
        root / size.name, heartbeat_interval=1.0, heartbeat_timeout=10.0, member_pool=pool,
        accounts_per_agent=ACCOUNTS_PER_AGENT,
    ) as cluster:  # fmt: skip
        cluster.start_coordinator()
        for n in range(size.agents):
            cluster.add_agent(f"node-{n:02d}", f"h200:{size.gpus_per_agent}")
        cluster.wait_connected(120)
        if size.processes not in LAUNCH_GOALS or size.python:
            slurm = None
        _report(size, *asyncio.run(_run_size(cluster, size, slurm)))


# --- journal recovery ---------------------------------------------------------------------------

_LIFE = (
    MemberEvent.PREPARE_SUCCEEDED,
    MemberEvent.COMMIT_RECEIVED,
    MemberEvent.SPAWN_REQUESTED,
    MemberEvent.RUNNER_STARTED,
)


async def _template(path: Path, root: Path) -> None:
    """One member's whole life, written by the real Journal, to copy from."""
    async with open_aio_host():
        journal = await Journal.open(path)
        key = MemberKey("run-template", 1, 0)
        new = NewMember(key, 1, (0,), str(root / "m"), str(root / "o"), 30)
        await journal.create_member(new, 1)
        for event in _LIFE:
            await journal.transition(key, event, 2)
        await journal.transition(key, MemberEvent.EXIT_OBSERVED, 3, exit=Exit(0, None))
        await journal.close()


def build_journal(path: Path, events: int, root: Path) -> int:
    """A journal of ``events`` events (members with the agent's own rows, copied); members."""
    trio.run(_template, path, root)
    db = sqlite3.connect(path, isolation_level=None)
    try:
        (member,) = db.execute("SELECT * FROM members").fetchall()
        history = db.execute(
            "SELECT at_ms, kind, from_state, to_state, reason, details FROM events "
            "WHERE member_key = 'run-template.1.0' ORDER BY id"
        ).fetchall()
        count = max(1, events // len(history))
        db.execute("BEGIN")
        for i in range(1, count):
            key = f"run-{i:08d}.1.0"
            db.execute(
                f"INSERT INTO members VALUES ({', '.join('?' * len(member))})",
                (key, f"run-{i:08d}", *member[2:]),
            )
            db.executemany(
                "INSERT INTO events (at_ms, member_key, kind, from_state, to_state, reason, "
                "details) VALUES (?, ?, ?, ?, ?, ?, ?)",
                [(row[0], key, *row[1:]) for row in history],
            )
        db.execute("DELETE FROM pending_reports")
        db.execute("COMMIT")
        db.execute("PRAGMA wal_checkpoint(TRUNCATE)")
        total = int(db.execute("SELECT count(*) FROM events").fetchone()[0])
    finally:
        db.close()
    return total


async def _recover(path: Path, root: Path) -> float:
    inventory = InventorySource("bench", parse_simulate_gpus("h200:8")).collect()

    async def publish(message: object) -> None:
        return None

    async with open_aio_host():
        started = time.perf_counter()
        journal = await Journal.open(path)
        async with trio.open_nursery() as nursery:
            manager = MemberManager(
                journal, root / "members", root / "outputs", lambda: inventory,
                lambda: "127.0.0.1", publish, nursery,
                work_root=root / "work", policy=default_policy(os.geteuid()),
            )  # fmt: skip
            await manager.replay()
            elapsed = time.perf_counter() - started
        await journal.close()
    return elapsed


def bench_recovery(root: Path, events: int) -> None:
    path = root / "journal.db"
    total = build_journal(path, events, root)
    size = path.stat().st_size
    times = [trio.run(_recover, path, root) for _ in range(3)]
    print(
        f"journal recovery: {total} events ({size / 2**20:.1f} MiB, every member exited): "
        f"open + integrity check + replay median {statistics.median(times) * 1000:.0f} ms "
        f"(of {len(times)})"
    )


def _env_int(name: str, default: int) -> int:
    value = os.environ.get(name, "")
    return int(value) if value.strip() else default


def run(runs: int, big_runs: int, events: int) -> int:
    sizes = [
        Size("small", 1, 1, 1, runs),
        Size("small-python", 1, 1, 1, max(3, runs // 3), python=True),
        Size("wide", 4, 8, 4, big_runs),
        Size("many", 16, 1, 16, big_runs),
    ]
    root = Path(tempfile.mkdtemp(prefix="tp-bench-agent-"))
    # Members' accounts pass through (never list) to their roots inside it.
    root.chmod(0o711)
    agents = max(size.agents for size in sizes)
    with (
        accounts.throwaway_pool("tpbench", agents * ACCOUNTS_PER_AGENT) as pool,
        slurm_cluster() as slurm,
    ):
        # Kept when a size fails, so its processes' logs can be read; removed after a clean run.
        for size in sizes:
            bench_size(root, size, pool, slurm)
        bench_recovery(root, events)
    shutil.rmtree(root)
    return 0


def main() -> int:
    return run(
        _env_int("TUNEPLANE_BENCH_AGENT_RUNS", FULL_RUNS),
        _env_int("TUNEPLANE_BENCH_AGENT_BIG_RUNS", 5),
        _env_int("TUNEPLANE_BENCH_AGENT_EVENTS", 100_000),
    )


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=FULL_RUNS, help="runs of the small size")
    parser.add_argument("--big-runs", type=int, default=5, help="runs of each big size")
    parser.add_argument("--events", type=int, default=100_000, help="journal events")
    args = parser.parse_args()
    sys.exit(run(args.runs, args.big_runs, args.events))
