"""Credential rotation under load: 1,000 Nodes renewing their control credentials in one window.

Each Node is enrolled for real and holds a real Connect stream (heartbeats at the serve default),
spread over load processes (``bench/_rotation_load.py``). On "go" every Node sends
CredentialRenewal at a uniformly random moment of the window, waits for CredentialIssued and
answers CredentialStored, as the agent does once the successor is on disk. Reported: renewal
latency p50/p99 (CredentialRenewal sent -> CredentialIssued received), the coordinator's CPU% and
RSS over the window (psutil), and how many rotations the store recorded as confirmed.

Knobs: ``TUNEPLANE_BENCH_NODES`` (1000), ``TUNEPLANE_BENCH_WINDOW`` seconds in which all renew
(10), ``TUNEPLANE_BENCH_LOADERS`` load processes (2).
"""

from __future__ import annotations

import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil

from bench.coordinator import ADMIN, HEARTBEAT_INTERVAL_S, Coordinator, _enroll_all

GRACE_S = 60


def _env_int(name: str, default: int) -> int:
    return int(os.environ.get(name, default))


def _rotation_decisions(state_dir: Path) -> tuple[int, int]:
    """(credentials issued, rotations confirmed) as the decision log records them."""
    out = subprocess.run(
        [*ADMIN, "decisions", "--state-dir", str(state_dir), "--json"],
        check=True, capture_output=True, text=True,
    )  # fmt: skip
    kinds = [json.loads(line)["kind"] for line in out.stdout.splitlines() if line.strip()]
    return kinds.count("node credential issued"), kinds.count("node credential rotated")


def bench_rotation(coord: Coordinator, root: Path) -> None:
    count = _env_int("TUNEPLANE_BENCH_NODES", 1000)
    window = _env_int("TUNEPLANE_BENCH_WINDOW", 10)
    loaders = _env_int("TUNEPLANE_BENCH_LOADERS", 2)
    started = time.perf_counter()
    nodes = asyncio.run(_enroll_all(coord, count))
    print(f"enrolled {count} Nodes for real in {time.perf_counter() - started:.1f} s")
    procs = []
    for k in range(loaders):
        config = root / f"rotation-{k}.json"
        mine = nodes[k::loaders]
        config.write_text(
            json.dumps(
                {
                    "control": coord.control,
                    "ca": str(coord.ca),
                    "channels": max(4, -(-len(mine) // 90)),
                    "window_s": window,
                    "grace_s": GRACE_S,
                    "nodes": mine,
                }
            )
        )
        procs.append(
            subprocess.Popen(
                [sys.executable, "-m", "bench._rotation_load", str(config)],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                text=True,
            )
        )
    for p in procs:
        line = p.stdout.readline() if p.stdout else ""
        if not line.startswith("ready"):
            raise RuntimeError(f"a load process failed before it was ready: {line!r}")
    time.sleep(2 * HEARTBEAT_INTERVAL_S)  # let every stream settle into its heartbeat rhythm
    server = psutil.Process(coord.proc.pid)
    cpu_before = server.cpu_times()
    wall_before = time.perf_counter()
    for p in procs:
        assert p.stdin is not None
        p.stdin.write("go\n")
        p.stdin.flush()
    results = [
        json.loads(p.communicate(timeout=window + GRACE_S + 60)[0].splitlines()[-1]) for p in procs
    ]
    wall = time.perf_counter() - wall_before
    cpu_after = server.cpu_times()
    rss = server.memory_info().rss
    busy = (cpu_after.user - cpu_before.user) + (cpu_after.system - cpu_before.system)
    renewed = sum(r["renewed"] for r in results)
    latencies = sorted(x for r in results for x in r["latencies_ms"])
    p50 = latencies[len(latencies) // 2] if latencies else float("nan")
    p99 = latencies[int(len(latencies) * 0.99)] if latencies else float("nan")
    issued, confirmed = _rotation_decisions(coord.state_dir)
    print(
        f"rotation: {count} Nodes renewing within {window} s: {renewed} renewed; renewal latency "
        f"p50 {p50:.1f} ms, p99 {p99:.1f} ms, max {latencies[-1] if latencies else 0:.1f} ms"
    )
    print(
        f"coordinator over {wall:.1f} s (window and drain): CPU {100 * busy / wall:.0f}% of one "
        f"core ({busy:.1f} CPU s, {1000 * busy / max(renewed, 1):.2f} ms per renewal), RSS "
        f"{rss / (1 << 20):.0f} MiB; decision log: {issued} issued, {confirmed} confirmed"
    )
    print(f"(mean renewal latency {statistics.fmean(latencies) if latencies else 0:.1f} ms)")


def main() -> int:
    with tempfile.TemporaryDirectory(prefix="tp-bench-rotation-") as tmp:
        root = Path(tmp)
        coord = Coordinator(root)
        try:
            bench_rotation(coord, root)
        finally:
            coord.stop()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
