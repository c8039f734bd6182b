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
import statistics
import subprocess
import time
from pathlib import Path

from bench.coordinator import (
    ADMIN,
    Coordinator,
    enroll_all,
    env_int,
    measure_window,
    start_loaders,
    with_coordinator,
)

GRACE_S = 60


def _rotation_decisions(state_dir: Path) -> tuple[int, int]:
    """(credentials issued, rotations confirmed) as the decision log records them."""
    out = subprocess.run(
        [*ADMIN, "decisions", "--state-dir", str(state_dir), "--json"],
        check=True, capture_output=True, text=True,
    )  # fmt: skip
    kinds = [json.loads(line)["kind"] for line in out.stdout.splitlines() if line.strip()]
    return kinds.count("node credential issued"), kinds.count("node credential rotated")


def bench_rotation(coord: Coordinator, root: Path) -> None:
    count = env_int("TUNEPLANE_BENCH_NODES", 1000)
    window = env_int("TUNEPLANE_BENCH_WINDOW", 10)
    loaders = env_int("TUNEPLANE_BENCH_LOADERS", 2)
    started = time.perf_counter()
    nodes = asyncio.run(enroll_all(coord, count))
    print(f"enrolled {count} Nodes for real in {time.perf_counter() - started:.1f} s")
    procs = start_loaders(
        coord, root, "_rotation_load", nodes, loaders, window_s=window, grace_s=GRACE_S
    )
    measured = measure_window(coord, procs, timeout=window + GRACE_S + 60)
    busy, wall, latencies = measured.busy, measured.wall, measured.latencies
    renewed = sum(r["renewed"] for r in measured.results)
    issued, confirmed = _rotation_decisions(coord.state_dir)
    print(
        f"rotation: {count} Nodes renewing within {window} s: {renewed} renewed; renewal latency "
        f"p50 {measured.percentile(0.5):.1f} ms, p99 {measured.percentile(0.99):.1f} ms, "
        f"max {latencies[-1] if latencies else 0:.1f} ms"
    )
    print(
        f"coordinator over {wall:.1f} s (window and drain): CPU {100 * busy / wall:.0f}% of one "
        f"core ({busy:.1f} CPU s, {1000 * busy / max(renewed, 1):.2f} ms per renewal), RSS "
        f"{measured.rss / (1 << 20):.0f} MiB; decision log: {issued} issued, {confirmed} confirmed"
    )
    print(f"(mean renewal latency {statistics.fmean(latencies) if latencies else 0:.1f} ms)")


def main() -> int:
    with_coordinator(bench_rotation, "tp-bench-rotation-")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
