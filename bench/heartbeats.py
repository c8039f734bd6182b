"""The heartbeat goal alone: 10,000 Nodes heartbeating every 5 s against one coordinator.

A real ``tuneplane-coordinator serve`` (SQLite store, the serve default heartbeat interval of
5 s) and 10,000 Nodes enrolled for real, each on its own Connect stream over loopback TLS, played
by load processes (``bench/_load.py``, as in ``bench coordinator``). Over the window it prints
the acks per second against the heartbeats offered, the ack latency p50 and p99 over every ack
(measured by the load processes, so their own delays count too), and the coordinator's CPU (of
one core) and RSS, each against the goal: under one core, p99 at most 100 ms.

On a 2-core machine the load processes need about a core themselves, so the latency includes
their queueing as well as the coordinator's.

Knobs: ``TUNEPLANE_BENCH_NODES`` (10000), ``TUNEPLANE_BENCH_WINDOW`` seconds measured (60),
``TUNEPLANE_BENCH_LOADERS`` load processes (2).
"""

from __future__ import annotations

import tempfile
from pathlib import Path

from .coordinator import Coordinator, env_int, measure_heartbeats

GOAL_CPU = 1.0  # of one core
GOAL_P99_MS = 100.0


def main() -> int:
    count = env_int("TUNEPLANE_BENCH_NODES", 10_000)
    window = env_int("TUNEPLANE_BENCH_WINDOW", 60)
    loaders = env_int("TUNEPLANE_BENCH_LOADERS", 2)
    with tempfile.TemporaryDirectory(prefix="tp-bench-heartbeats-") as tmp:
        coord = Coordinator(Path(tmp))
        try:
            _, beats = measure_heartbeats(coord, Path(tmp), count, loaders, window)
        finally:
            coord.stop()
    cpu_ok = beats.cpu < GOAL_CPU
    p99_ok = beats.p99_ms <= GOAL_P99_MS
    print(
        f"goal, {count} Nodes: coordinator CPU {100 * beats.cpu:.0f}% of one core "
        f"(goal under {100 * GOAL_CPU:.0f}%: {'met' if cpu_ok else 'not met'}); ack p99 "
        f"{beats.p99_ms:.1f} ms (goal {GOAL_P99_MS:g} ms: {'met' if p99_ok else 'not met'}); "
        f"{beats.acked_per_offered:.2f} of the heartbeats offered acked in the window"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
