"""The telemetry store: its database, its schema's migrations and the class that joins them.

:class:`TelemetryStore` holds collector credentials (:mod:`.collector_keys`), takes Ship
batches of metric points and delivery progress (:mod:`.metric_ingest`) and answers series
reads (:mod:`.series_reads`); this module opens it and numbers its schema.

Rules:
- Its own SQLite file (``telemetry.db``, WAL, ``synchronous=FULL``) or PostgreSQL schema
  (``tuneplane_telemetry``), with its own writer, apart from the coordinator store: metrics
  never decide a Job's state, and a Job's state never waits behind a batch of points. Its
  schema has its own numbered migrations (``telemetry_schema_version``).
- Writes run shielded (a caller's deadline never leaves half a transaction); the heavy read
  (:meth:`TelemetryStore.query_series`) runs in a worker thread on its own read-only connection,
  in one read transaction, so a million-point series never stalls the gateways.
"""

from __future__ import annotations

from pathlib import Path

from . import rollups as store_rollups
from .collector_keys import CollectorKeys
from .metric_ingest import MetricIngest
from .series_reads import SeriesReads

DB_NAME = "telemetry.db"

MIGRATIONS: tuple[tuple[int, tuple[str, ...]], ...] = (
    (
        1,
        (
            """CREATE TABLE collector_credentials (
                token_hash TEXT PRIMARY KEY,
                run_id TEXT NOT NULL,
                attempt INTEGER NOT NULL,
                member_index INTEGER NOT NULL,
                node_id TEXT NOT NULL,
                issued_at_ms BIGINT NOT NULL,
                expires_at_ms BIGINT NOT NULL,
                ended_at_ms BIGINT
            )""",
            "CREATE INDEX collector_credentials_by_node ON collector_credentials (node_id)",
            "CREATE INDEX collector_credentials_by_member ON collector_credentials "
            "(run_id, attempt, member_index)",
            """CREATE TABLE metric_series (
                id INTEGER PRIMARY KEY,
                run_id TEXT NOT NULL,
                attempt INTEGER NOT NULL,
                member_index INTEGER NOT NULL,
                source TEXT NOT NULL,
                tag TEXT NOT NULL,
                points BIGINT NOT NULL DEFAULT 0,
                last_step BIGINT,
                last_value DOUBLE PRECISION,
                last_wall_time DOUBLE PRECISION,
                UNIQUE (run_id, attempt, member_index, source, tag)
            )""",
            """CREATE TABLE metric_points (
                id INTEGER PRIMARY KEY,
                series_id INTEGER NOT NULL REFERENCES metric_series(id),
                source_offset BIGINT NOT NULL,
                value_index INTEGER NOT NULL,
                step BIGINT NOT NULL,
                wall_time DOUBLE PRECISION,
                value DOUBLE PRECISION,
                UNIQUE (series_id, source_offset, value_index)
            )""",
            "CREATE INDEX metric_points_by_step ON metric_points (series_id, step)",
            """CREATE TABLE telemetry_delivery (
                run_id TEXT NOT NULL,
                attempt INTEGER NOT NULL,
                member_index INTEGER NOT NULL,
                points_stored BIGINT NOT NULL DEFAULT 0,
                spool_points BIGINT NOT NULL DEFAULT 0,
                backpressure INTEGER NOT NULL DEFAULT 0,
                member_exited INTEGER NOT NULL DEFAULT 0,
                drained INTEGER NOT NULL DEFAULT 0,
                last_point_wall_ms BIGINT,
                last_contact_ms BIGINT NOT NULL,
                warnings BIGINT NOT NULL DEFAULT 0,
                data_loss_warnings BIGINT NOT NULL DEFAULT 0,
                PRIMARY KEY (run_id, attempt, member_index)
            )""",
        ),
    ),
    (
        2,
        (
            # Orphaned by a restarted TensorBoard writer: kept, never read (docs/telemetry.md).
            "ALTER TABLE metric_points ADD COLUMN orphaned INTEGER NOT NULL DEFAULT 0",
            "ALTER TABLE metric_series ADD COLUMN orphaned BIGINT NOT NULL DEFAULT 0",
            # Every read, the newest visible point and a restart's sweep look only at visible
            # points: an index of those alone keeps them from walking an orphaned stretch.
            "DROP INDEX metric_points_by_step",
            "CREATE INDEX metric_points_visible ON metric_points (series_id, step) "
            "WHERE orphaned = 0",
            """CREATE TABLE metric_restarts (
                run_id TEXT NOT NULL,
                attempt INTEGER NOT NULL,
                member_index INTEGER NOT NULL,
                source TEXT NOT NULL,
                source_offset BIGINT NOT NULL,
                step BIGINT NOT NULL,
                tags TEXT,
                wall_time DOUBLE PRECISION,
                UNIQUE (run_id, attempt, member_index, source, source_offset)
            )""",
            """CREATE TABLE run_hparams (
                run_id TEXT NOT NULL,
                attempt INTEGER NOT NULL,
                member_index INTEGER NOT NULL,
                source TEXT NOT NULL,
                name TEXT NOT NULL,
                value_json TEXT NOT NULL,
                source_offset BIGINT NOT NULL,
                value_index INTEGER NOT NULL,
                PRIMARY KEY (run_id, attempt, member_index, source, name)
            )""",
            """CREATE TABLE run_hparam_metrics (
                run_id TEXT NOT NULL,
                attempt INTEGER NOT NULL,
                member_index INTEGER NOT NULL,
                source TEXT NOT NULL,
                metric TEXT NOT NULL,
                PRIMARY KEY (run_id, attempt, member_index, source, metric)
            )""",
        ),
    ),
    # Rollups for bucketed reads, built from the points already stored (docs/telemetry.md).
    (3, store_rollups.migration()),
)


def telemetry_db_path(state_dir: Path) -> Path:
    return state_dir / DB_NAME


class TelemetryStore(CollectorKeys, MetricIngest, SeriesReads):
    """Open with :meth:`open`; close with :meth:`close`."""

    LABEL = "telemetry store"
    VERSION_TABLE = "telemetry_schema_version"
    SCHEMA = "tuneplane_telemetry"
    MIGRATIONS = MIGRATIONS
