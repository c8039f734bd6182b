"""Telemetry delivery figures for ``python -m bench telemetry``.

- End to end: a real coordinator and agent on loopback run a Job whose workload appends JSONL
  points at a fixed rate with its own wall clock; a poller reads the coordinator's telemetry.db
  (read-only) and records when each step became queryable. Latency = that moment minus the
  wall time the workload wrote. Same machine, same clock.
- Downsampling: a 1M-point series written straight into a real telemetry store, then the
  store's bounded query (1000 buckets) timed, median of 3.
"""

from __future__ import annotations

import asyncio
import json
import sqlite3
import statistics
import time
from contextlib import closing
from pathlib import Path

from tuneplane.coordinator.demo import accounts
from tuneplane.coordinator.demo.cluster import LocalCluster
from tuneplane.coordinator.store import rollups as store_rollups
from tuneplane.coordinator.store.telemetry import TelemetryStore, telemetry_db_path
from tuneplane.coordinator.values.jobs import MemberKey
from tuneplane.coordinator.values.metrics import MetricSelector
from tuneplane.coordinator.values.telemetry import CollectorReport, ShippedPoint

WRITER = """python3 - <<'PY'
import json, os, time
rate, seconds = {rate}, {seconds}
path = os.path.join(os.environ["TUNEPLANE_TELEMETRY_DIR"], "metrics.jsonl")
fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
start = time.time()
step = 0
# Two tags per line: rate/2 lines a second, written in 100 small bursts a second.
per_burst = max(rate // 2 // 100, 1)
while step < rate // 2 * seconds:
    now = time.time()
    lines = "".join(
        json.dumps({{"step": step + i, "wall_time": now,
                    "metrics": {{"train/loss": 1.0 / (step + i + 1), "train/lr": 0.001}}}}) + "\\n"
        for i in range(per_burst)
    )
    os.write(fd, lines.encode())
    step += per_burst
    target = start + step / (rate / 2)
    delay = target - time.time()
    if delay > 0:
        time.sleep(delay)
os.close(fd)
PY
"""


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def end_to_end(root: Path, rate: int, seconds: int) -> dict[str, float]:
    """Run the writer Job and return latency figures (seconds) and the delivered count."""
    # As root, members run as throwaway accounts that pass through ``root`` to their roots in it.
    root.chmod(0o711)
    with (
        accounts.throwaway_pool("tpdelivery", 2) as pool,
        LocalCluster(
            root / "cluster", heartbeat_interval=0.5, heartbeat_timeout=5, member_pool=pool,
            accounts_per_agent=2,
        ) as cluster,
    ):  # fmt: skip
        cluster.start_coordinator()
        cluster.add_agent("node-a", "h200:1")
        cluster.wait_connected()
        project = root / "project"
        project.mkdir()
        for args in (
            ("init", str(project), "--name", "bench"),
            ("new", "writer", "--method", "custom/custom"),
        ):
            done = cluster.tp(*args, cwd=project)
            if done.returncode:
                raise RuntimeError(done.stderr)
        script = WRITER.format(rate=rate, seconds=seconds)
        (project / "experiments" / "writer" / "train.sh").write_text(script)
        done = cluster.tp("submit", "writer", "--profile", "h200:1", "--yes", "--json", cwd=project)
        if done.returncode:
            raise RuntimeError(done.stderr)
        run_id = json.loads(done.stdout.strip().splitlines()[-1])["run_id"]
        db_path = telemetry_db_path(cluster.coordinator_dir)
        lines = rate // 2 * seconds
        # step -> when it was first seen stored (poll every 20 ms).
        seen_at: list[tuple[int, float]] = []
        deadline = time.monotonic() + seconds + 120
        last = -1
        while last < lines - 1 and time.monotonic() < deadline:
            time.sleep(0.02)
            try:
                with closing(sqlite3.connect(f"file:{db_path}?mode=ro", uri=True)) as db:
                    row = db.execute(
                        "SELECT MAX(p.step) FROM metric_points p JOIN metric_series s "
                        "ON s.id = p.series_id WHERE s.run_id = ? AND s.tag = 'train/loss'",
                        (run_id,),
                    ).fetchone()
            except sqlite3.OperationalError:
                continue
            if row and row[0] is not None and row[0] > last:
                last = int(row[0])
                seen_at.append((last, time.time()))
        # Wall times of the steps as the workload wrote them.
        out_root = cluster.agents[0].out_root
        (metrics_file,) = out_root.rglob("metrics.jsonl")
        walls: dict[int, float] = {}
        with metrics_file.open() as handle:
            for line in handle:
                record = json.loads(line)
                walls[int(record["step"])] = float(record["wall_time"])
        latencies = []
        previous = -1
        for upto, at in seen_at:
            for step in range(previous + 1, upto + 1):
                latencies.append(at - walls[step])
            previous = upto
        with closing(sqlite3.connect(f"file:{db_path}?mode=ro", uri=True)) as db:
            # The workload's points only, not the collector's own system samples.
            (stored,) = db.execute(
                "SELECT COALESCE(SUM(points), 0) FROM metric_series WHERE source != 'system'"
            ).fetchone()
    if not latencies:
        raise RuntimeError("no point became queryable")
    return {
        "median": statistics.median(latencies),
        "p99": _percentile(latencies, 0.99),
        "max": max(latencies),
        "stored": float(stored),
        "written": float(lines * 2),
    }


async def _downsampling(path: Path, points: int, runs: int) -> list[float]:
    store = await TelemetryStore.open(path)
    member = MemberKey("run-bench", 1, 0)
    # One Ship makes the series and its delivery row the way a collector would.
    first = [ShippedPoint("metrics.jsonl", 0, 0, "train/loss", 0, 1.7e9, 1.0)]
    await store.ship(member, first, CollectorReport(), 0)
    await store.close()
    with closing(sqlite3.connect(path)) as db:
        (series_id,) = db.execute("SELECT id FROM metric_series").fetchone()
        db.executemany(
            "INSERT INTO metric_points (series_id, source_offset, value_index, step, wall_time, "
            "value) VALUES (?, ?, 0, ?, ?, ?)",
            (
                (series_id, step * 64, step, 1.7e9 + step, 1.0 / (step + 1))
                for step in range(1, points)
            ),
        )
        db.execute("UPDATE metric_series SET points = ? WHERE id = ?", (points, series_id))
        # Written around the store: its rollups are rebuilt as the migration builds them.
        db.execute("DELETE FROM metric_rollups")
        for sql in store_rollups.build_statements():
            db.execute(sql)
        db.commit()
    store = await TelemetryStore.open(path)
    times = []
    try:
        for _ in range(runs):
            start = time.perf_counter()
            result = await store.query_series(MetricSelector("run-bench"), "train/loss", 1000)
            times.append(time.perf_counter() - start)
            if result.total_points != points or len(result.buckets) > 1000:
                raise RuntimeError(f"the query returned {result.total_points} points")
    finally:
        await store.close()
    return times


def downsampling(root: Path, points: int, runs: int = 3) -> float:
    """Median seconds of a bounded (1000-bucket) query over a ``points``-point series."""
    return statistics.median(asyncio.run(_downsampling(root / "telemetry.db", points, runs)))
