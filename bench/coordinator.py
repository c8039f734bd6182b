"""Coordinator figures: admissions/s over real TLS, the pure scheduling pass, heartbeats/s.

1. A scheduling pass (:func:`plan_pass`, pure) over 10,000 queued Jobs and 1,000 Nodes.
2. Admissions (Preview + Commit) per second against a real ``tuneplane-coordinator serve``
   process over loopback TLS, one at a time and with several in flight.
3. Heartbeats handled per second with many Nodes (default 2,000), each enrolled for real and
   speaking the control protocol on its own Connect stream, spread over grpclib channels (at
   most 90 streams each) in a few load processes (``bench/_load.py``): acked/offered ratio and
   ack latency p50/p99 over every ack, with the coordinator's CPU% and RSS (psutil). Then the
   latency of a Preview against that Fleet (admission checks every Node's inventory). Then the
   reconnect storm (``bench/_storm.py``): the same Nodes connected again, reconnecting as real
   agents do (``bench/_storm_load.py``), the coordinator killed (-9) and served again on the
   same ports and store, and the time from its readiness until every Node is welcomed again,
   with Hellos/s, beside the first connect of the same Nodes in the same run.
4. ``tp metrics`` on a long series: a 1,000,000-point series shipped into a real telemetry store
   in 5,000-point Ships (rollups kept up as a collector's Ships keep them), then the bounded
   query (1000 buckets) read from rollups against the raw computation over every point, both
   on the same file in the same run: medians and the speed-up, and a check that they agree.

Every figure of 2-4 is measured on SQLite and on PostgreSQL (an embedded server the bench starts,
the same one ``tuneplane demo --store postgresql`` uses) in the same run, and the last table gives
each as a ratio to SQLite. Then admissions against real Slurm's ``sbatch`` on this machine
(``bench/_slurm_runs.py``), when Slurm is installed.

Knobs: ``TUNEPLANE_BENCH_NODES`` (5000), ``TUNEPLANE_BENCH_ADMISSIONS`` (200),
``TUNEPLANE_BENCH_WINDOW`` seconds of heartbeat measurement (10), ``TUNEPLANE_BENCH_LOADERS``
load processes (2), ``TUNEPLANE_BENCH_SERIES`` points in the long series (1,000,000). On a
2-core machine the load processes share the CPUs with the coordinator.
"""

from __future__ import annotations

import asyncio
import base64
import functools
import json
import os
import random
import select
import signal
import sqlite3
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from contextlib import closing
from pathlib import Path
from typing import Any

import psutil
from grpclib.client import Channel

from tuneplane.agent.client_tls import grpc_client_context
from tuneplane.coordinator.auth import JOIN_PREFIX, hash_credential, new_credential
from tuneplane.coordinator.catalogue import Catalogue
from tuneplane.coordinator.demo import postgres as embedded
from tuneplane.coordinator.placement import Request
from tuneplane.coordinator.queue_plan import NodeState, QueuedRequest, plan_pass
from tuneplane.coordinator.store.core import Store, db_path
from tuneplane.coordinator.store.postgres import create_database
from tuneplane.coordinator.store.series_reads import raw_buckets, rollup_buckets
from tuneplane.coordinator.store.telemetry import TelemetryStore
from tuneplane.coordinator.store_location import Where, parse_store_url
from tuneplane.coordinator.values.jobs import MemberKey
from tuneplane.coordinator.values.metrics import MetricSelector
from tuneplane.coordinator.values.telemetry import CollectorReport, ShippedPoint
from tuneplane.proto import v1

from ._rpc_floor import do_nothing_server, pairs_per_second
from ._slurm import SlurmCluster, slurm_cluster
from ._slurm_runs import compare_admissions
from ._storm import reconnect_storm

ADMIN = [sys.executable, "-m", "tuneplane.coordinator.cli.admin"]
# The serve default: what a production coordinator asks of its Nodes.
HEARTBEAT_INTERVAL_S = 5.0
# How long the load processes may take to have every Node welcomed once.
READY_TIMEOUT_S = 600.0
# Long, so a Node slowed down by the load machine is never closed for silence mid-measurement.
HEARTBEAT_TIMEOUT_S = 120.0


def env_int(name: str, default: int) -> int:
    return int(os.environ.get(name, default))


# ----- 1. the pure scheduling pass --------------------------------------------------------------


def bench_plan() -> None:
    rng = random.Random(7)
    nodes = [
        NodeState(
            f"node-{i:04d}",
            "default",
            True,
            "cordoned" if i % 50 == 0 else "schedulable",
            {"h200": tuple(g for g in range(8) if rng.random() < 0.5)},
        )
        for i in range(1000)
    ]
    queue = [
        QueuedRequest(f"run-{i:05d}", "default", "h200", Request(rng.choice((1, 2, 4, 8, 16))))
        for i in range(10_000)
    ]
    quotas = {("default", "h200"): 3000}
    times = []
    for _ in range(5):
        started = time.perf_counter()
        plan = plan_pass(queue, nodes, {}, quotas)
        times.append(time.perf_counter() - started)
    median = statistics.median(times)
    print(
        f"scheduling pass (pure): 10000 queued Jobs x 1000 Nodes: median {median * 1000:.1f} ms "
        f"({median / len(queue) * 1e6:.1f} us per Job), {len(plan.launches)} launches, "
        f"{len(plan.waiting)} waiting"
    )


# ----- 4. tp metrics on a long series -----------------------------------------------------------

SHIP_POINTS = 5000


async def _ship_series(where: Where, points: int) -> float:
    """Ship a ``points``-point series as a collector would; seconds spent in the Ships."""
    rng = random.Random(3)
    store = await TelemetryStore.open(where)
    member = MemberKey("run-bench", 1, 0)
    spent = 0.0
    try:
        # Steps 1..points: 1000 buckets then never line up with the rollup blocks.
        for start in range(1, points + 1, SHIP_POINTS):
            batch = [
                ShippedPoint(
                    "metrics.jsonl",
                    step * 64,
                    0,
                    "train/loss",
                    step,
                    1.7e9 + step,
                    50.0 if step == 654_321 else 1.0 / step + rng.random() * 0.01,
                )
                for step in range(start, min(start + SHIP_POINTS, points + 1))
            ]
            started = time.perf_counter()
            await store.ship(member, batch, CollectorReport(), 0)
            spent += time.perf_counter() - started
    finally:
        await store.close()
    return spent


async def _store_queries(where: Where, runs: int) -> list[float]:
    store = await TelemetryStore.open(where)
    times = []
    try:
        for _ in range(runs):
            started = time.perf_counter()
            await store.query_series(MetricSelector("run-bench"), "train/loss", 1000)
            times.append(time.perf_counter() - started)
    finally:
        await store.close()
    return times


def bench_metric_query(figures: Figures, backend: Backend, runs: int = 7) -> None:
    points = env_int("TUNEPLANE_BENCH_SERIES", 1_000_000)
    with tempfile.TemporaryDirectory(prefix="tp-bench-metrics-") as tmp:
        path = Path(tmp) / "telemetry.db"
        where: Where = path if backend.url is None else parse_store_url(backend.fresh(), "bench")
        shipping = asyncio.run(_ship_series(where, points))
        served = asyncio.run(_store_queries(where, runs))
        if backend.url is None:
            _raw_against_rollups(path, runs)
    store_s = statistics.median(served)
    print(f"  {backend.name}: shipped {points:,} points in {points // SHIP_POINTS} Ships of "
          f"{SHIP_POINTS}: {shipping:.1f} s; store.query_series (1000 buckets) median of "
          f"{runs}: {store_s * 1000:.1f} ms")  # fmt: skip
    figures.add(f"ship {points:,} points (s)", backend, shipping)
    figures.add(f"query a {points:,}-point series, 1000 buckets (ms)", backend, store_s * 1000)


def _raw_against_rollups(path: Path, runs: int) -> None:
    """On the SQLite file: the rollup read against the raw computation, interleaved."""
    raw: list[float] = []
    rollup: list[float] = []
    with closing(sqlite3.connect(f"file:{path}?mode=ro", uri=True)) as db:
        (series_id,) = db.execute("SELECT id FROM metric_series").fetchone()
        for _ in range(runs):  # interleaved, so both see the same machine
            started = time.perf_counter()
            want = raw_buckets(db, [series_id], 1000)
            raw.append(time.perf_counter() - started)
            started = time.perf_counter()
            got = rollup_buckets(db, [series_id], 1000)
            rollup.append(time.perf_counter() - started)
            if got != want:
                raise RuntimeError("the rollup buckets differ from the raw computation")
    raw_s, rollup_s = statistics.median(raw), statistics.median(rollup)
    print(f"  sqlite: raw path (every point) {raw_s * 1000:.1f} ms, rollups "
          f"{rollup_s * 1000:.1f} ms ({raw_s / rollup_s:.0f}x faster), "
          f"the same {len(want)} buckets")  # fmt: skip


# ----- the two backends -------------------------------------------------------------------------


class Backend:
    """Where a phase's stores live: SQLite files (``url`` None) or a fresh database of the
    bench's embedded PostgreSQL."""

    def __init__(self, name: str, server: embedded.EmbeddedPostgres | None = None) -> None:
        self.name = name
        self.server = server
        self.url = None if server is None else server.url
        self._made = 0

    def fresh(self) -> str:
        """A new empty database on the server, by URL."""
        assert self.server is not None
        self._made += 1
        name = f"bench{self._made}"
        asyncio.run(create_database(str(self.server.server.get_uri()), name))
        assert self.url is not None
        return _with_database(self.url, name)


def _with_database(url: str, name: str) -> str:
    base, _, query = url.partition("?")
    return f"{base.rsplit('/', 1)[0]}/{name}" + (f"?{query}" if query else "")


class Figures:
    """Each figure per backend, printed at the end as ratios to SQLite."""

    def __init__(self) -> None:
        self.values: dict[str, dict[str, float]] = {}

    def add(self, what: str, backend: Backend, value: float) -> None:
        self.values.setdefault(what, {})[backend.name] = value

    def report(self) -> None:
        print("\nPostgreSQL against SQLite, same run (ratio = postgresql / sqlite):")
        print(f"  {'figure':<58} {'sqlite':>10} {'postgresql':>11} {'ratio':>6}")
        for what, by in self.values.items():
            lite, pg = by.get("sqlite"), by.get("postgresql")
            if lite is None or pg is None:
                continue
            print(f"  {what:<58} {lite:>10.1f} {pg:>11.1f} {pg / lite:>6.2f}")


# ----- a real coordinator -----------------------------------------------------------------------


class Coordinator:
    def __init__(self, root: Path, store_url: str | None = None) -> None:
        self.state_dir = root / "coordinator"
        self.store_url = store_url
        store = ["--store", store_url] if store_url else []
        subprocess.run(
            [*ADMIN, "init", "--state-dir", str(self.state_dir), *store],
            check=True,
            capture_output=True,
        )
        config = self.state_dir / "coordinator.toml"
        # A Fleet with no Nodes: admitted bench Jobs stay queued and never touch the Nodes.
        # Every bench Node enrolls from this one address: the per-address Enroll limit is off.
        config.write_text(
            config.read_text()
            + '\n[profiles.bench]\nseries = "h200"\nfleet = "empty"\n'
            + "\n[limits]\nenroll_burst = 0\n"
        )
        subprocess.run(
            [*ADMIN, "fleet", "create", "empty", "--state-dir", str(self.state_dir)],
            check=True,
            capture_output=True,
        )
        self.log = open(root / "serve.log", "ab")  # noqa: SIM115 - closed in stop()
        self.root = root
        # Free ports, not the fixed defaults, so a bench never collides with a coordinator.
        self.ready_at = self._serve(0, 0, 0)
        self.token = (self.state_dir / "admin.token").read_text().strip()

    def _serve(self, api: int, control: int, telemetry: int) -> float:
        """Start ``serve`` on these ports (0: any free one); the wall-clock time it was ready
        (its endpoints.json names its pid)."""
        self.proc = subprocess.Popen(
            [
                *ADMIN,
                "serve",
                "--state-dir",
                str(self.state_dir),
                "--heartbeat-interval",
                str(HEARTBEAT_INTERVAL_S),
                "--heartbeat-timeout",
                str(HEARTBEAT_TIMEOUT_S),
                "--api-port",
                str(api),
                "--control-port",
                str(control),
                "--telemetry-port",
                str(telemetry),
            ],
            stdout=self.log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        deadline = time.monotonic() + 60
        endpoints = self.state_dir / "endpoints.json"
        while True:
            try:
                data = json.loads(endpoints.read_text())
                if data.get("pid") == self.proc.pid:
                    ready_at = time.time()
                    break
            except (FileNotFoundError, ValueError):
                pass
            if time.monotonic() > deadline or self.proc.poll() is not None:
                raise RuntimeError(f"the coordinator did not start; see {self.root / 'serve.log'}")
            time.sleep(0.02)
        self.api, self.control, self.ca = data["api"], data["control"], Path(data["ca"])
        self.telemetry = data.get("telemetry", "")
        return ready_at

    def restart(self) -> float:
        """kill -9 the coordinator (as a crash or a lost machine would) and serve again on the
        same ports and store; the wall-clock time the new one was ready."""
        self.proc.kill()
        self.proc.wait()
        ports = [int(a.rpartition(":")[2]) if a else 0 for a in (self.api, self.control)]
        telemetry = int(self.telemetry.rpartition(":")[2]) if self.telemetry else 0
        self.ready_at = self._serve(ports[0], ports[1], telemetry)
        return self.ready_at

    def where(self) -> Where:
        """The coordinator's store, for the bench to open beside it (as the admin CLI does)."""
        if self.store_url is None:
            return db_path(self.state_dir)
        return parse_store_url(self.store_url, "bench")

    def channel(self, address: str) -> Channel:
        host, _, port = address.rpartition(":")
        return Channel(host, int(port), ssl=grpc_client_context(self.ca))

    def stop(self) -> None:
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.log.close()


def with_coordinator(
    phase: Callable[[Coordinator, Path], None], prefix: str, store_url: str | None = None
) -> None:
    """Run ``phase`` against a fresh coordinator (its stores in SQLite files, or in the
    PostgreSQL database ``store_url``) in a throwaway folder; stop it afterwards."""
    with tempfile.TemporaryDirectory(prefix=prefix) as tmp:
        coord = Coordinator(Path(tmp), store_url)
        try:
            phase(coord, Path(tmp))
        finally:
            coord.stop()


# ----- 2. admissions ----------------------------------------------------------------------------


@functools.cache
def _custom_digest() -> str:
    """The bundled ``custom/custom`` recipe's digest, read once per bench process as ``tp submit``
    reads it once per submission (reading it per admission would time the client's disk reads)."""
    recipe = Catalogue.bundled().get("custom/custom")
    assert recipe is not None
    return recipe.digest


def _jobspec(i: int, profile: str = "bench") -> str:
    return json.dumps(
        {
            "api_version": "tuneplane/v1",
            "project": "bench",
            "experiment": f"e{i}",
            "method_id": "custom/custom",
            "recipe_digest": _custom_digest(),
            "runtime_id": "",
            "entrypoint": ["bash", "train.sh"],
            "resources": {"profile": profile, "series": "", "gpus": 1},
            "parameters": {},
            "env": {},
            "source_files": {"train.sh": base64.b64encode(b"echo hi\n").decode()},
        }
    )


async def _admissions(coord: Coordinator, count: int, in_flight: int) -> float:
    channel = coord.channel(coord.api)
    stub = v1.ApiStub(channel, metadata={"authorization": f"Bearer {coord.token}"}, timeout=60)
    gate = asyncio.Semaphore(in_flight)
    tag = f"{in_flight}-{time.monotonic_ns()}"

    async def one(i: int) -> None:
        async with gate:
            preview = await stub.preview(v1.PreviewRequest(jobspec_json=_jobspec(i)))
            receipt = await stub.commit(
                v1.CommitRequest(preview.preview_id, preview.digest, f"rk-{tag}-{i}")
            )
            assert receipt.created

    try:
        await one(-1)  # warm the connection
        started = time.perf_counter()
        await asyncio.gather(*(one(i) for i in range(count)))
        return count / (time.perf_counter() - started)
    finally:
        channel.close()


def bench_admissions(coord: Coordinator, root: Path, figures: Figures, backend: Backend) -> None:
    count = env_int("TUNEPLANE_BENCH_ADMISSIONS", 200)
    for in_flight in (1, 8):
        rates = [asyncio.run(_admissions(coord, count, in_flight)) for _ in range(3)]
        runs = ", ".join(f"{r:.0f}" for r in rates)
        print(
            f"  {backend.name}: admissions (Preview+Commit over TLS), {in_flight} in flight: "
            f"median {statistics.median(rates):.0f}/s (runs: {runs})"
        )
        figures.add(f"admissions/s, {in_flight} in flight", backend, statistics.median(rates))


def against_slurm(slurm: SlurmCluster, coord: Coordinator, root: Path) -> None:
    """Admissions alternating run by run with Slurm's sbatch on this machine (SQLite store)."""
    count = env_int("TUNEPLANE_BENCH_ADMISSIONS", 200)
    with do_nothing_server(coord.state_dir) as port:
        compare_admissions(
            slurm,
            lambda n, k: asyncio.run(_admissions(coord, n, k)),
            count,
            lambda n, k: asyncio.run(pairs_per_second(port, coord.ca, _jobspec(0), n, k)),
        )


# ----- 3. heartbeats ----------------------------------------------------------------------------


async def enroll_all(coord: Coordinator, count: int) -> list[dict[str, str]]:
    tokens = [new_credential(JOIN_PREFIX) for _ in range(count)]
    store = await Store.open(coord.where())
    try:
        expires = int(time.time() * 1000) + 3_600_000
        for t in tokens:
            await store.create_join_token(
                hash_credential(t), "default", int(time.time() * 1000), expires
            )
    finally:
        await store.close()
    channel = coord.channel(coord.control)
    stub = v1.ControlStub(channel, timeout=120)
    gate = asyncio.Semaphore(32)

    async def one(i: int, token: str) -> dict[str, str]:
        async with gate:
            reply = await stub.enroll(
                v1.EnrollRequest(
                    join_token=token, hostname=f"bench-{i:05d}", inventory=v1.Inventory()
                )
            )
            return {"id": reply.node_id, "credential": reply.node_credential}

    try:
        return list(await asyncio.gather(*(one(i, t) for i, t in enumerate(tokens))))
    finally:
        channel.close()


class Window:
    """What the load processes measured over one window, and what the coordinator spent on it."""

    def __init__(self, results: list[dict[str, Any]], wall: float, busy: float, rss: int) -> None:
        self.results = results
        self.wall = wall  # seconds from "go" until the last load process reported
        self.busy = busy  # the coordinator's CPU seconds (user + system) in that time
        self.rss = rss  # the coordinator's resident memory at the end, bytes
        self.latencies = sorted(x for r in results for x in r["latencies_ms"])

    def percentile(self, q: float) -> float:
        """The ``q`` quantile of every reported latency in ms; NaN when none was reported."""
        return self.latencies[int(len(self.latencies) * q)] if self.latencies else float("nan")


def start_loaders(
    coord: Coordinator,
    root: Path,
    module: str,
    nodes: list[dict[str, str]],
    loaders: int,
    **settings: Any,
) -> list[subprocess.Popen[str]]:
    """Spread ``nodes`` over ``loaders`` processes of ``python -m bench.<module>``; wait for ready.

    Each process is one load driver (``bench/_load.py``) with its share of the Nodes and
    ``settings`` in its config.
    """
    procs = []
    for k in range(loaders):
        config = root / f"{module}-{k}.json"
        mine = nodes[k::loaders]
        config.write_text(
            json.dumps(
                {
                    "control": coord.control,
                    "ca": str(coord.ca),
                    # grpclib's server allows 100 concurrent streams per HTTP/2 connection.
                    "channels": max(4, -(-len(mine) // 90)),
                    "nodes": mine,
                    **settings,
                }
            )
        )
        procs.append(
            subprocess.Popen(
                [sys.executable, "-m", f"bench.{module}", str(config)],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                text=True,
            )
        )
    deadline = time.monotonic() + READY_TIMEOUT_S
    for p in procs:
        assert p.stdout is not None
        left = deadline - time.monotonic()
        line = p.stdout.readline() if select.select([p.stdout], [], [], max(left, 0))[0] else ""
        if not line.startswith("ready"):
            for q in procs:
                q.kill()
                q.wait()
            raise RuntimeError(
                f"the load processes' Nodes were not all welcomed within {READY_TIMEOUT_S:g} s "
                f"(a load process said {line!r}); on a machine this loaded, try fewer Nodes "
                "(TUNEPLANE_BENCH_NODES)."
            )
    return procs


def measure_window(
    coord: Coordinator, procs: list[subprocess.Popen[str]], timeout: float
) -> Window:
    """Say "go" to every load process and collect their results, with the coordinator's CPU/RSS."""
    time.sleep(2 * HEARTBEAT_INTERVAL_S)  # let every stream settle into its heartbeat rhythm
    server = psutil.Process(coord.proc.pid)
    cpu_before = server.cpu_times()
    wall_before = time.perf_counter()
    for p in procs:
        assert p.stdin is not None
        p.stdin.write("go\n")
        p.stdin.flush()
    results = [json.loads(p.communicate(timeout=timeout)[0].splitlines()[-1]) for p in procs]
    wall = time.perf_counter() - wall_before
    cpu_after = server.cpu_times()
    busy = (cpu_after.user - cpu_before.user) + (cpu_after.system - cpu_before.system)
    return Window(results, wall, busy, server.memory_info().rss)


class Heartbeats:
    """One heartbeat window's figures (:func:`measure_heartbeats`)."""

    def __init__(self, count: int, window: Window) -> None:
        acks = sum(r["acks"] for r in window.results)
        elapsed = statistics.median(r["elapsed_s"] for r in window.results)
        self.count = count
        # Above 1: acks for heartbeats sent before the window were still arriving.
        self.acked_per_offered = acks / elapsed / (count / HEARTBEAT_INTERVAL_S)
        self.acked_per_s = acks / elapsed
        self.p50_ms = window.percentile(0.5)
        self.p99_ms = window.percentile(0.99)
        self.cpu = window.busy / window.wall  # of one core
        self.acks = len(window.latencies)


def measure_heartbeats(
    coord: Coordinator, root: Path, count: int, loaders: int, window_s: int
) -> tuple[list[dict[str, str]], Heartbeats]:
    """Enroll ``count`` Nodes, connect them from ``loaders`` load processes, measure a window of
    ``window_s`` seconds of heartbeats; the Nodes (id, credential) and the figures, printed."""
    started = time.perf_counter()
    nodes = asyncio.run(enroll_all(coord, count))
    enrolled_s = time.perf_counter() - started
    print(f"enrolled {count} Nodes for real (join token + Enroll) in {enrolled_s:.1f} s")
    started = time.perf_counter()
    procs = start_loaders(coord, root, "_load", nodes, loaders, window_s=window_s)
    print(f"{count} Connect streams welcomed in {time.perf_counter() - started:.1f} s")
    measured = measure_window(coord, procs, timeout=window_s + 120)
    beats = Heartbeats(count, measured)
    offered = count / HEARTBEAT_INTERVAL_S
    print(
        f"heartbeats: {count} Nodes at 1 per {HEARTBEAT_INTERVAL_S:g} s each: "
        f"{beats.acked_per_s:.0f} acked/s of {offered:.0f}/s offered "
        f"(ratio acked/offered {beats.acked_per_offered:.2f}); ack latency over "
        f"{beats.acks} acks: p50 {beats.p50_ms:.1f} ms, p99 {beats.p99_ms:.1f} ms"
    )
    print(
        f"coordinator during the window: CPU {100 * beats.cpu:.0f}% of one "
        f"core, RSS {measured.rss / (1 << 20):.0f} MiB"
    )
    return nodes, beats


def bench_heartbeats(coord: Coordinator, root: Path, figures: Figures, backend: Backend) -> None:
    count = env_int("TUNEPLANE_BENCH_NODES", 5000)
    print(f"  {backend.name}:")
    window = env_int("TUNEPLANE_BENCH_WINDOW", 10)
    loaders = env_int("TUNEPLANE_BENCH_LOADERS", 2)
    nodes, beats = measure_heartbeats(coord, root, count, loaders, window)
    figures.add(f"heartbeats acked/offered, {count} Nodes", backend, beats.acked_per_offered)
    figures.add(f"heartbeat ack p50 (ms), {count} Nodes", backend, beats.p50_ms)
    figures.add(f"heartbeat ack p99 (ms), {count} Nodes", backend, beats.p99_ms)
    times = asyncio.run(_previews(coord, 20))
    figures.add(f"Preview against {count} Nodes (ms)", backend, 1000 * statistics.median(times))
    print(
        f"Preview against the Fleet of {count} Nodes (it reads every Node's inventory): "
        f"median {1000 * statistics.median(times):.1f} ms over {len(times)}"
    )
    # The same Nodes again, for the storm: once the coordinator has recorded the heartbeat
    # load's streams as ended, so their disconnections are not part of the first connect.
    asyncio.run(_until_none_connected(coord))
    reconnect_storm(coord, root, figures, backend, nodes, loaders, start_loaders)


async def _until_none_connected(coord: Coordinator, timeout: float = 300) -> None:
    store = await Store.open(coord.where())
    try:
        deadline = time.monotonic() + timeout
        while await store.reader.fetchone("SELECT 1 FROM nodes WHERE connected = 1 LIMIT 1"):
            if time.monotonic() > deadline:
                raise RuntimeError(f"Nodes still read connected {timeout:g} s after they left")
            await asyncio.sleep(0.2)
    finally:
        await store.close()


async def _previews(coord: Coordinator, count: int) -> list[float]:
    channel = coord.channel(coord.api)
    stub = v1.ApiStub(channel, metadata={"authorization": f"Bearer {coord.token}"}, timeout=60)
    times = []
    try:
        for i in range(count):
            started = time.perf_counter()
            await stub.preview(v1.PreviewRequest(jobspec_json=_jobspec(i, profile="h200")))
            times.append(time.perf_counter() - started)
    finally:
        channel.close()
    return times


def _run(
    phase: Callable[[Coordinator, Path, Figures, Backend], None],
    figures: Figures,
    backend: Backend,
    coord: Coordinator,
    root: Path,
) -> None:
    phase(coord, root, figures, backend)


def main() -> int:
    bench_plan()
    figures = Figures()
    with tempfile.TemporaryDirectory(prefix="tp-bench-postgres-") as tmp:
        server = embedded.start(Path(tmp))
        try:
            backends = (Backend("sqlite"), Backend("postgresql", server))
            print("tp metrics on a long series:")
            for backend in backends:
                bench_metric_query(figures, backend)
            # A coordinator per phase: the admitted bench Jobs stay queued, and a queue that long
            # would make every scheduling pass (woken by each Hello) part of the heartbeat figure.
            for phase in (bench_admissions, bench_heartbeats):
                print(f"{phase.__name__.removeprefix('bench_')}:")
                for backend in backends:
                    url = backend.fresh() if backend.url is not None else None
                    with_coordinator(
                        functools.partial(_run, phase, figures, backend), "tp-bench-", url
                    )
        finally:
            server.stop()
    print("admissions against real Slurm on this machine (SQLite store):")
    with slurm_cluster() as slurm:
        if slurm is not None:
            with_coordinator(functools.partial(against_slurm, slurm), "tp-bench-slurm-")
    figures.report()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
