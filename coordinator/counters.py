"""The coordinator's Prometheus counters and histograms, moved where things happen.

Rules:
- One registry (:data:`REGISTRY`) per process; ``serve`` exposes it
  (:mod:`~tuneplane.coordinator.server.metrics_export` adds the store's gauges and the RPC
  timing, and serves it). Handlers in ``api/`` and ``gateways/`` and the scheduler only count.
- Labels are bounded: an outcome, an RPC method, a gRPC code, a store and a reason. A run id,
  Node id or user name is never a label. Every labelled series exists from the start at zero.
- Names follow Prometheus: ``tuneplane_coordinator_*``, base units (seconds), ``_total`` on
  counters. docs/operator.md ("Metrics") lists every one.
"""

from __future__ import annotations

from prometheus_client import Counter, Histogram

from tuneplane.agent.metrics_listener import new_registry

# Latencies from a loopback call (about a millisecond) to a long-lived stream (hours).
RPC_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 60, 3600)
PASS_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10)
ADMISSION_OUTCOMES = ("admitted", "repeated", "refused")


REGISTRY = new_registry()

ADMISSIONS = Counter(
    "tuneplane_coordinator_admissions",
    "Commit calls by outcome: admitted (a new Job), repeated (the same confirmation again, "
    "answered with the earlier receipt) or refused (unknown preview, changed digest, retry key "
    "reused for another preview).",
    ["outcome"],
    registry=REGISTRY,
)
for _outcome in ADMISSION_OUTCOMES:
    ADMISSIONS.labels(_outcome)

SCHEDULING_PASS = Histogram(
    "tuneplane_coordinator_scheduling_pass_seconds",
    "How long one scheduling pass took (abort expired Prepares, plan the queue, reserve).",
    buckets=PASS_BUCKETS,
    registry=REGISTRY,
)

STORE_RETRIES = Counter(
    "tuneplane_coordinator_store_retries",
    "Write transactions the database aborted for a conflict with another writer and that ran "
    "again, by store (store, telemetry store, log store) and reason (serialization, deadlock). "
    "Only a PostgreSQL store has them; a steady rise means something else writes to it.",
    ["store", "reason"],
    registry=REGISTRY,
)
for _store in ("store", "telemetry store", "log store"):
    for _reason in ("serialization", "deadlock"):
        STORE_RETRIES.labels(_store, _reason)

CONNECTS_QUEUED = Counter(
    "tuneplane_coordinator_connects_queued",
    "Connect streams told to wait in line for a turn (coordinator/hello_gate.py): their agents "
    "announced they can, so they wait for their Welcome instead of being refused as busy. Rises "
    "in a reconnect storm, never otherwise.",
    registry=REGISTRY,
)
CONNECTS_DEFERRED = Counter(
    "tuneplane_coordinator_connects_deferred",
    "Connect streams refused as busy (UNAVAILABLE) because the Hellos already in flight would "
    "take the coordinator its whole target to welcome (coordinator/hello_gate.py); their Nodes "
    "dial again after their backoff. Rises in a reconnect storm, never otherwise.",
    registry=REGISTRY,
)


RPC_DURATION = Histogram(
    "tuneplane_coordinator_rpc_duration_seconds",
    "How long each gRPC call took, by method (Service/Method) and gRPC status code; a stream "
    "(Control/Connect) is observed once, when it ends.",
    ["method", "code"],
    buckets=RPC_BUCKETS,
    registry=REGISTRY,
)

POINTS_INGESTED = Counter(
    "tuneplane_coordinator_points_ingested",
    "Telemetry points the telemetry gateway stored (a point shipped again is not counted).",
    registry=REGISTRY,
)
POINTS_DUPLICATE = Counter(
    "tuneplane_coordinator_points_duplicate",
    "Telemetry points shipped again after they were stored (a collector's retry), not stored.",
    registry=REGISTRY,
)
POINTS_REFUSED = Counter(
    "tuneplane_coordinator_points_refused",
    "Telemetry points the gateway refused for good (each with a reason sent back).",
    registry=REGISTRY,
)


def observe_ship(stored: int, duplicates: int, refused: int) -> None:
    """Count one Ship call's points."""
    POINTS_INGESTED.inc(stored)
    POINTS_DUPLICATE.inc(duplicates)
    POINTS_REFUSED.inc(refused)
