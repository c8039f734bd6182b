"""The idle agent (issue 13, goal 4): an agent's CPU and memory with default settings, 100
ended members in its journal, and nothing to do.

Rules: every figure comes from real processes (``LocalCluster``): a coordinator with its own
default heartbeat interval and timeout (read from ``tuneplane-coordinator serve``'s options),
one agent, 100 one-member Jobs of ``/bin/true`` run to their end one after the other. Once the
agent has no collector left (each drains and exits after its member ended) and a settling
period has passed, the agent's CPU time is read over the window and its RSS sampled every few
seconds in it. The runner and collector templates, children of the agent, are printed on their
own lines while they live (each ends after its idle time). With Slurm installed, the same number
of ``srun -n1 true`` runs go through a throwaway cluster first, and ``slurmd`` is measured over
the same window. Last, fresh interpreters that only import show what the agent's RSS is made of
(``bench/_import_floor.py``).

Knobs (env): ``TUNEPLANE_BENCH_IDLE_S`` (default 600, the goal's 10 minutes),
``TUNEPLANE_BENCH_IDLE_SETTLE_S`` (default 30) and ``TUNEPLANE_BENCH_IDLE_JOBS`` (default 100).
"""

from __future__ import annotations

import asyncio
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import attrs
import psutil

from tuneplane.coordinator.cli.admin_serve import serve_command
from tuneplane.coordinator.cli.api_client import ApiClient
from tuneplane.coordinator.cli.connection import resolve_connection
from tuneplane.coordinator.demo import accounts
from tuneplane.coordinator.demo.cluster import LocalCluster

from ._import_floor import import_floors
from ._slurm import SlurmCluster, slurm_cluster
from .agent import ACCOUNTS_PER_AGENT, Size, _one_job, _wait_free

#: The goal: at most this share of one core and this RSS (issue 13).
GOAL_CPU_PERCENT = 0.3
GOAL_RSS_MIB = 40.0
RSS_SAMPLE_S = 5.0
COLLECTORS_GONE_S = 120.0


@attrs.frozen
class Figures:
    cpu_percent: float
    rss_mib: float
    # Seconds into the window at which the process ended; None when it lived through it.
    ended_after_s: float | None


def _env_float(name: str, default: float) -> float:
    value = os.environ.get(name, "")
    return float(value) if value.strip() else default


def serve_default(name: str) -> float:
    """The default of one ``tuneplane-coordinator serve`` option, as an operator gets it."""
    for param in serve_command.params:
        if param.name == name and isinstance(param.default, int | float):
            return float(param.default)
    raise LookupError(f"tuneplane-coordinator serve has no numeric option {name!r}")


async def _jobs(cluster: LocalCluster, jobs: int) -> None:
    size = Size("idle", 1, 1, 1, jobs)
    endpoint = resolve_connection(cluster.context_path, None, None, None)
    async with ApiClient(endpoint) as api:
        for i in range(jobs):
            await _one_job(cluster, api, size, i)
            await _wait_free(api, 1)


def _collectors_gone(agent: psutil.Process) -> None:
    """Until no collector runs under the agent (the last members' collectors drained). The
    collector template, which outlives its last collector for its idle time, is not one: its
    forked collectors are its children."""
    deadline = time.monotonic() + COLLECTORS_GONE_S
    while time.monotonic() < deadline:
        collectors = [
            c
            for c in agent.children(recursive=True)
            if "tuneplane.collector" in " ".join(_cmdline(c)) and not _is_template(c, agent)
        ]
        if not collectors:
            return
        time.sleep(0.5)
    raise RuntimeError(f"collectors still run under the agent after {COLLECTORS_GONE_S:g} s")


def _is_template(proc: psutil.Process, agent: psutil.Process) -> bool:
    """The runner or collector template: a direct child of the agent that forks the others."""
    try:
        direct = proc.ppid() == agent.pid
    except psutil.Error:
        return False
    line = _cmdline(proc)
    return direct and ("--template" in line or "tuneplane.collector.template" in line)


def _cmdline(proc: psutil.Process) -> list[str]:
    try:
        return proc.cmdline()
    except psutil.Error:
        return []


def _cpu_s(proc: psutil.Process) -> float:
    times = proc.cpu_times()
    return float(times.user + times.system)


def _measure(procs: dict[str, psutil.Process], window_s: float) -> dict[str, Figures]:
    """Each process's CPU% of one core over the window (or until it ended) and its median RSS
    (MiB) in it; the templates end by themselves after their idle time."""
    began = time.monotonic()
    start = {name: _cpu_s(p) for name, p in procs.items()}
    last = dict(start)
    ended: dict[str, float] = {}
    rss: dict[str, list[float]] = {name: [] for name in procs}
    while (left := window_s - (time.monotonic() - began)) > 0:
        for name, proc in procs.items():
            if name in ended:
                continue
            try:
                rss[name].append(proc.memory_info().rss / 2**20)
                last[name] = _cpu_s(proc)
            except psutil.NoSuchProcess:
                ended[name] = time.monotonic() - began
        time.sleep(min(RSS_SAMPLE_S, left))
    elapsed = time.monotonic() - began
    for name, proc in procs.items():
        if name not in ended:
            try:
                last[name] = _cpu_s(proc)
            except psutil.NoSuchProcess:
                ended[name] = elapsed
    return {
        name: Figures(
            (last[name] - start[name]) / ended.get(name, elapsed) * 100,
            statistics.median(rss[name]) if rss[name] else 0.0,
            ended.get(name),
        )
        for name in procs
    }


def _slurmd(slurm: SlurmCluster | None, jobs: int) -> psutil.Process | None:
    if slurm is None:
        return None
    for _ in range(jobs):
        slurm.srun(1)
    return psutil.Process(slurm.slurmd_pid())


def run(window_s: float, settle_s: float, jobs: int) -> int:
    interval = serve_default("heartbeat_interval")
    timeout = serve_default("heartbeat_timeout")
    root = Path(tempfile.mkdtemp(prefix="tp-bench-idle-"))
    root.chmod(0o711)  # members' accounts pass through to their roots inside it
    with (
        accounts.throwaway_pool("tpbench", ACCOUNTS_PER_AGENT) as pool,
        slurm_cluster() as slurm,
        LocalCluster(
            root / "cluster", heartbeat_interval=interval, heartbeat_timeout=timeout,
            member_pool=pool, accounts_per_agent=ACCOUNTS_PER_AGENT,
        ) as cluster,
    ):  # fmt: skip
        cluster.start_coordinator()
        cluster.add_agent("node-00", "h200:1")
        cluster.wait_connected(120)
        agent = psutil.Process(cluster.agents[0].process.popen.pid)
        asyncio.run(_jobs(cluster, jobs))
        slurmd = _slurmd(slurm, jobs)
        _collectors_gone(agent)
        time.sleep(settle_s)
        procs = {"agent": agent}
        for child in agent.children():
            if _is_template(child, agent):
                runner = "--template" in _cmdline(child)
                procs["runner template" if runner else "collector template"] = child
        if slurmd is not None:
            procs["slurmd"] = slurmd
        figures = _measure(procs, window_s)
    shutil.rmtree(root)
    print(
        f"idle agent: {jobs} ended members in its journal, heartbeats every {interval:g} s, "
        f"settled {settle_s:g} s, measured over {window_s:g} s"
    )
    for name, got in figures.items():
        ended = "" if got.ended_after_s is None else f"   (ended after {got.ended_after_s:.0f} s)"
        print(
            f"  {name:<16} CPU {got.cpu_percent:6.3f}% of a core   RSS {got.rss_mib:6.1f} MiB "
            f"(median){ended}"
        )
    cpu, rss = figures["agent"].cpu_percent, figures["agent"].rss_mib
    print(
        f"  agent / goal     CPU {cpu / GOAL_CPU_PERCENT:6.2f}x of {GOAL_CPU_PERCENT:g}%"
        f"   RSS {rss / GOAL_RSS_MIB:6.2f}x of {GOAL_RSS_MIB:g} MiB"
    )
    if "slurmd" in figures:
        print(f"  agent / slurmd   RSS {rss / figures['slurmd'].rss_mib:6.2f}x")
    print("fresh interpreters that only import (median of 3 each):")
    for imported in import_floors():
        print(f"  {imported.what:<58} RSS {imported.rss_mib:6.1f} MiB ({imported.modules} modules)")
    return 0


def main() -> int:
    return run(
        _env_float("TUNEPLANE_BENCH_IDLE_S", 600.0),
        _env_float("TUNEPLANE_BENCH_IDLE_SETTLE_S", 30.0),
        int(_env_float("TUNEPLANE_BENCH_IDLE_JOBS", 100)),
    )


if __name__ == "__main__":
    raise SystemExit(main())
