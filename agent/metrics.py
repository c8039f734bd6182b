"""The Node's Prometheus metrics (``tuneplane_node_*``), served when node.toml has [metrics].

Rules:
- Loaded only when node.toml has [metrics]: the daemon reports what it observes through
  :mod:`tuneplane.agent.metric_hooks`, which :func:`serving` binds to the metrics here, so a
  Node without the listener never loads prometheus_client (issue 13, goal 4).
- A scrape reads memory only: prometheus_client's HTTP server answers it from its own thread
  (:mod:`tuneplane.agent.metrics_listener`), never from the Trio loop, and never touches
  the journal or a spool. Counters and histograms move where the agent observes something
  (a journal commit, a heartbeat acknowledged, a reconnect); the connection and the credential
  are read from the daemon's status at scrape time (plain attributes).
- Members, GPUs, pending reports and the collectors' spools are a :class:`NodeSnapshot` the
  daemon refreshes every :data:`SNAPSHOT_INTERVAL_S` (two COUNT queries on the journal and one
  on each undelivered spool, the spools in a worker thread) while the listener is on.
- Labels are bounded: a member state, a GPU state and health. No run id or member is a label;
  the spools are summed over the Node.
"""

from __future__ import annotations

import logging
import sqlite3
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path

import attrs
import trio
from prometheus_client import Counter, Gauge, Histogram
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from tuneplane.collector.spool import SPOOL_FILE

from .daemon_status import Status
from .inventory import Inventory
from .journal import Journal
from .member_state import MemberState
from .metric_hooks import MetricHooks, set_hooks
from .metrics_listener import MetricsListener, new_registry, start_listener

log = logging.getLogger(__name__)

#: Seconds between two refreshes of the snapshot behind the gauges.
SNAPSHOT_INTERVAL_S = 2.0
#: What marks a collector directory whose points were all delivered (agent/collectors.py).
_DRAINED = "drained"

GPU_STATES = ("free", "owned")
GPU_HEALTH = ("healthy", "unhealthy")

REGISTRY = new_registry()

JOURNAL_COMMIT = Histogram(
    "tuneplane_node_journal_commit_seconds",
    "How long one journal transaction's COMMIT took. The journal runs with synchronous=FULL, so "
    "this is the WAL fsync every state change waits for before the agent acts on it.",
    buckets=(0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5),
    registry=REGISTRY,
)
HEARTBEAT_RTT = Histogram(
    "tuneplane_node_heartbeat_rtt_seconds",
    "From sending a heartbeat on the control stream to its acknowledgement.",
    buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10),
    registry=REGISTRY,
)
RECONNECTS = Counter(
    "tuneplane_node_reconnects",
    "Control sessions that ended (refused, broken or timed out) and were dialled again.",
    registry=REGISTRY,
)
CONNECTED = Gauge(
    "tuneplane_node_connected",
    "1 while the control session with the coordinator is open (Welcome received), else 0.",
    registry=REGISTRY,
)
CREDENTIAL_EXPIRY = Gauge(
    "tuneplane_node_credential_expiry_timestamp_seconds",
    "When the Node's control credential expires, as the coordinator last stated it (epoch "
    "seconds; 0 until a coordinator said it).",
    registry=REGISTRY,
)


@attrs.frozen
class NodeSnapshot:
    """What the journal, the inventory and the spools said at ``read_at_s`` (epoch seconds)."""

    read_at_s: float
    members: Mapping[str, int]
    reports_pending: int
    # (state, health) -> GPUs: state is "owned" (a member holds it in the journal) or "free".
    gpus: Mapping[tuple[str, str], int]
    spools: int = 0
    spool_points: int = 0
    data_loss_warnings: int = 0


def gpu_counts(
    inventory: Inventory, owned_uuids: set[str], owned_indexes: set[int]
) -> dict[tuple[str, str], int]:
    """GPUs by (state, health); an owner recorded before UUIDs were journaled owns by index."""
    counts = {(s, h): 0 for s in GPU_STATES for h in GPU_HEALTH}
    for gpu in inventory.gpus:
        owned = gpu.uuid in owned_uuids or gpu.index in owned_indexes
        counts[("owned" if owned else "free", "healthy" if gpu.healthy else "unhealthy")] += 1
    return counts


@attrs.frozen
class SpoolFigures:
    spools: int = 0
    points: int = 0
    data_loss_warnings: int = 0


def read_spools(collectors_root: Path) -> SpoolFigures:
    """The undelivered spools under ``collectors_root``, summed (blocking: a worker thread).

    A collector directory without its ``drained`` marker still has points to deliver (running,
    or waiting for a restart); each spool is opened read-only. One that cannot be read now (being
    created, or gone) is skipped and counted at the next refresh.
    """
    spools = points = lost = 0
    try:
        folders = sorted(p for p in collectors_root.iterdir() if p.is_dir())
    except FileNotFoundError:
        return SpoolFigures()
    for folder in folders:
        spool = folder / SPOOL_FILE
        if (folder / _DRAINED).exists() or not spool.exists():
            continue
        try:
            db = sqlite3.connect(f"file:{spool}?mode=ro", uri=True, timeout=1.0)
            try:
                (waiting,) = db.execute("SELECT COUNT(*) FROM points").fetchone()
                (losses,) = db.execute(
                    "SELECT COALESCE(SUM(data_loss), 0) FROM warnings"
                ).fetchone()
            finally:
                db.close()
        except sqlite3.Error as exc:
            log.debug("spool not read path=%s reason=%s", spool, exc)
            continue
        spools += 1
        points += int(waiting)
        lost += int(losses)
    return SpoolFigures(spools, points, lost)


class _SnapshotCollector(Collector):
    """The latest :class:`NodeSnapshot` as gauges (no I/O at scrape time)."""

    def __init__(self) -> None:
        self.latest: NodeSnapshot | None = None

    def collect(self) -> Iterator[Metric]:
        seen = self.latest
        members = GaugeMetricFamily(
            "tuneplane_node_members",
            "Members in this Node's journal by state (ended ones too, while the journal holds "
            "them).",
            labels=["state"],
        )
        for member_state in MemberState:
            name = member_state.value
            members.add_metric([name], seen.members.get(name, 0) if seen else 0)
        gpus = GaugeMetricFamily(
            "tuneplane_node_gpus",
            "GPUs in the inventory by state (owned by a member in the journal, or free) and "
            "health (the probe and the XID book).",
            labels=["state", "health"],
        )
        for state in GPU_STATES:
            for health in GPU_HEALTH:
                gpus.add_metric([state, health], seen.gpus.get((state, health), 0) if seen else 0)
        yield members
        yield gpus
        yield GaugeMetricFamily(
            "tuneplane_node_reports_pending",
            "Member reports journaled and not yet acknowledged by the coordinator.",
            seen.reports_pending if seen else 0,
        )
        yield GaugeMetricFamily(
            "tuneplane_node_collector_spools",
            "Collector spools with points still to deliver (members whose telemetry is not "
            "drained).",
            seen.spools if seen else 0,
        )
        yield GaugeMetricFamily(
            "tuneplane_node_collector_spool_points",
            "Telemetry points waiting in those spools for the gateway, summed over members.",
            seen.spool_points if seen else 0,
        )
        yield GaugeMetricFamily(
            "tuneplane_node_collector_data_loss_warnings",
            "Data-loss warnings (points that can never be delivered) recorded by those spools, "
            "summed over members.",
            seen.data_loss_warnings if seen else 0,
        )
        yield GaugeMetricFamily(
            "tuneplane_node_snapshot_timestamp_seconds",
            "When the journal and spools behind these gauges were last read (epoch seconds; 0: "
            "not yet).",
            seen.read_at_s if seen else 0.0,
        )


SNAPSHOT = _SnapshotCollector()
REGISTRY.register(SNAPSHOT)


def publish_snapshot(snapshot: NodeSnapshot) -> None:
    """Make ``snapshot`` what the next scrape reads (one reference assignment)."""
    SNAPSHOT.latest = snapshot


@contextmanager
def serving(listener: MetricsListener, status: Status) -> Iterator[str]:
    """Serve the Node's metrics on ``listener`` for the ``with`` block, with the daemon's
    hooks (agent/metric_hooks.py) bound to them; yields the listener's address.
    The connection and the credential's expiry are read from ``status`` at scrape time, from
    the listener's thread (two plain attributes)."""
    CONNECTED.set_function(lambda: float(status.connected))
    CREDENTIAL_EXPIRY.set_function(lambda: status.credential_expires_at_ms / 1000)
    running = start_listener(listener, REGISTRY, "[metrics] in node.toml")
    unbound = set_hooks(MetricHooks(JOURNAL_COMMIT.observe, HEARTBEAT_RTT.observe, RECONNECTS.inc))
    try:
        yield running.address
    finally:
        set_hooks(unbound)
        running.close()


async def refresh_snapshot(
    journal: Journal | None, inventory: Inventory, collectors_root: Path
) -> bool:
    """Read what the gauges show (the journal's counts, the spools in a worker thread) and
    publish it. A read that fails is logged and leaves the last snapshot in place: metrics never
    stop the agent. Returns whether a new snapshot was published."""
    members: dict[str, int] = {}
    pending = 0
    uuids: Mapping[str, object] = {}
    indexes: Mapping[int, object] = {}
    try:
        if journal is not None:
            members, pending = await journal.counts()
            uuids, indexes = await journal.gpu_owners_by_uuid()
        spools = await trio.to_thread.run_sync(read_spools, collectors_root)
    except Exception as exc:  # a journal or disk error is the journal's to report, not ours
        log.warning("metrics snapshot not refreshed reason=%s", exc)
        return False
    publish_snapshot(
        NodeSnapshot(
            read_at_s=time.time(),
            members=members,
            reports_pending=pending,
            gpus=gpu_counts(inventory, set(uuids), set(indexes)),
            spools=spools.spools,
            spool_points=spools.points,
            data_loss_warnings=spools.data_loss_warnings,
        )
    )
    return True
