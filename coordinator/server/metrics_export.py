"""The coordinator's Prometheus metrics as ``serve`` exposes them (served by
:mod:`tuneplane.agent.metrics_listener`): the store's gauges and every RPC's timing, added to
the counters of :mod:`~tuneplane.coordinator.counters`.

Rules:
- A scrape reads only memory (the listener serves it from its own threads). Counters
  and histograms move where things happen; the gauges that need the store come from a snapshot
  :func:`refresh_gauges` reads every :data:`REFRESH_S` (:mod:`~tuneplane.coordinator.store.gauges`:
  a few indexed counts), never from a query per scrape.
- Labels are bounded: an outcome, an RPC method (the fixed set of paths this coordinator
  serves), a gRPC code, a state. A run id, Node id or user name is never a label.
- Names follow Prometheus: ``tuneplane_coordinator_*`` (``tuneplane_node_*`` on a Node), base
  units (seconds), ``_total`` on counters. docs/operator.md ("Metrics") lists every one.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Iterator, Mapping
from typing import Any

import anyio
from grpclib import GRPCError
from grpclib.const import Handler
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from ..clock import now_ms
from ..counters import REGISTRY, RPC_DURATION, STORE_RETRIES
from ..store.core import Store
from ..store.db import StoreRetry
from ..store.gauges import (
    CONNECTIVITY,
    LIVE_JOB_STATES,
    StoreGauges,
    read_gauges,
)

log = logging.getLogger(__name__)

#: Seconds between two reads of the store's counts.
REFRESH_S = 5.0


def count_store_retry(event: StoreRetry) -> None:
    """A store's retry observer (:attr:`StoreDb.retry_observers`): count the re-run."""
    STORE_RETRIES.labels(event.store, event.reason).inc()


class _StoreGaugesCollector(Collector):
    """The store's counts as last read, turned into gauges at scrape time (no I/O)."""

    def __init__(self) -> None:
        self.latest: StoreGauges | None = None

    def collect(self) -> Iterator[Metric]:
        seen = self.latest
        jobs = GaugeMetricFamily(
            "tuneplane_coordinator_jobs",
            "Jobs in each state that is not an end (ended Jobs are not counted).",
            labels=["state"],
        )
        nodes = GaugeMetricFamily(
            "tuneplane_coordinator_nodes",
            "Enrolled Nodes by connectivity: connected, disconnected or revoked.",
            labels=["connectivity"],
        )
        for state in LIVE_JOB_STATES:
            jobs.add_metric([state], seen.jobs.get(state, 0) if seen else 0)
        for name in CONNECTIVITY:
            nodes.add_metric([name], seen.nodes.get(name, 0) if seen else 0)
        queue = seen.queue_length if seen else 0
        oldest = seen.oldest_queued_ms if seen else None
        age = 0.0 if oldest is None else max(0.0, time.time() - oldest / 1000)
        away = seen.longest_disconnected_ms / 1000 if seen else 0.0
        if seen is not None and seen.longest_disconnected_ms:
            # The snapshot is a few seconds old; the Node has been away that much longer.
            away += max(0.0, time.time() - seen.read_at_ms / 1000)
        yield jobs
        yield nodes
        yield GaugeMetricFamily(
            "tuneplane_coordinator_queue_length", "Jobs admitted and waiting for GPUs.", queue
        )
        yield GaugeMetricFamily(
            "tuneplane_coordinator_queue_oldest_age_seconds",
            "How long the longest-waiting queued Job has waited since it was admitted (0: the "
            "queue is empty).",
            age,
        )
        yield GaugeMetricFamily(
            "tuneplane_coordinator_node_disconnected_longest_seconds",
            "How long the longest-disconnected Node that is neither revoked nor cordoned has "
            "been away (0: every such Node is connected).",
            away,
        )
        yield GaugeMetricFamily(
            "tuneplane_coordinator_gauges_read_timestamp_seconds",
            "When the store's counts behind these gauges were last read (epoch seconds; 0: "
            "not yet).",
            seen.read_at_ms / 1000 if seen else 0.0,
        )


STORE_GAUGES = _StoreGaugesCollector()
REGISTRY.register(STORE_GAUGES)


async def refresh_gauges(store: Store, interval_s: float = REFRESH_S) -> None:
    """Read the store's counts now and every ``interval_s`` until cancelled."""
    while True:
        try:
            STORE_GAUGES.latest = await read_gauges(store, now_ms())
        except Exception as exc:  # a busy or failing store must not stop the coordinator
            log.warning("metrics gauges not read reason=%s", exc)
        await anyio.sleep(interval_s)


# --- RPC latency -------------------------------------------------------------------------------


def timed_handlers(services: list[Any]) -> list[Any]:
    """``services`` with every handler observed in :data:`RPC_DURATION`: the one place every
    call to this coordinator passes through (wrapped around the bounded handlers)."""
    return [
        _TimedService(
            {
                path: Handler(
                    _timed(path, handler.func),
                    handler.cardinality,
                    handler.request_type,
                    handler.reply_type,
                )
                for path, handler in service.__mapping__().items()
            }
        )
        for service in services
    ]


class _TimedService:
    def __init__(self, mapping: Mapping[str, Handler]) -> None:
        self._mapping = dict(mapping)

    def __mapping__(self) -> dict[str, Handler]:
        return self._mapping


def method_label(path: str) -> str:
    """``/tuneplane.v1.Api/Commit`` -> ``Api/Commit``."""
    service, _, method = path.lstrip("/").rpartition("/")
    return f"{service.rpartition('.')[2]}/{method}"


def _timed(path: str, func: Callable[[Any], Awaitable[None]]) -> Callable[[Any], Awaitable[None]]:
    method = method_label(path)

    async def timed(stream: Any) -> None:
        started = time.perf_counter()
        code = "OK"
        try:
            await func(stream)
        except GRPCError as exc:
            code = exc.status.name
            raise
        except asyncio.CancelledError:
            code = "CANCELLED"  # the caller went away, or the coordinator is stopping
            raise
        except BaseException:
            code = "UNKNOWN"
            raise
        finally:
            RPC_DURATION.labels(method, code).observe(time.perf_counter() - started)

    return timed
