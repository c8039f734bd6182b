"""Which coordinator leads, as Prometheus gauges of this process (memory only).

Rules: read at scrape time from :class:`~.leadership.LeaderView`, which the lease's shell keeps
up to date; a standby reports the leader it last read. docs/operator.md ("Metrics") lists them:
``tuneplane_coordinator_leader`` (1 while this coordinator leads), ``..._lease_term``,
``..._lease_expires_timestamp_seconds``, ``..._leader_since_timestamp_seconds``,
``..._standbys`` (as the leader last read the roll call) and ``..._takeovers_total`` (leases this
process took).
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from ..counters import REGISTRY
from .leadership import LeaderView


class _LeadershipCollector(Collector):
    def __init__(self) -> None:
        self.view: LeaderView | None = None

    def collect(self) -> Iterator[Metric]:
        view = self.view
        if view is None:
            return
        yield GaugeMetricFamily(
            "tuneplane_coordinator_leader",
            "1 while this coordinator leads (holds the lease, or is alone on SQLite), else 0.",
            value=1.0 if view.role in ("leader", "single") else 0.0,
        )
        yield GaugeMetricFamily(
            "tuneplane_coordinator_lease_term",
            "The lease term this coordinator leads with, or the leader's as last read.",
            value=float(view.term),
        )
        yield GaugeMetricFamily(
            "tuneplane_coordinator_lease_expires_timestamp_seconds",
            "When the leader's lease expires unless renewed (0 on SQLite).",
            value=view.lease_expires_ms / 1000,
        )
        yield GaugeMetricFamily(
            "tuneplane_coordinator_leader_since_timestamp_seconds",
            "When the current leader took the lease (0 on SQLite or before any was read).",
            value=view.leader_since_ms / 1000,
        )
        yield GaugeMetricFamily(
            "tuneplane_coordinator_standbys",
            "Other coordinators in the roll call, as the leader last read it.",
            value=float(len(view.standbys)),
        )
        yield CounterMetricFamily(
            "tuneplane_coordinator_takeovers",
            "Leases this coordinator process took (its first included).",
            value=float(view.takeovers),
        )


_COLLECTOR = _LeadershipCollector()
REGISTRY.register(_COLLECTOR)


def watch_leadership(view: LeaderView) -> None:
    """Report ``view`` from now on (one view per process: the latest ``serve``'s)."""
    _COLLECTOR.view = view
