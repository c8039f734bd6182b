"""The journal's schema: the SQL migrations that build it, one per version.

Rules: migration n brings a journal from version n-1 to n, in one transaction that also moves
``PRAGMA user_version`` (:mod:`tuneplane.agent.journal_db` applies them at open). Append only;
never edit a shipped one. The tables are documented in docs/journal.md.
"""

from __future__ import annotations

from collections.abc import Sequence

SCHEMA_VERSION = 4

# Migration n brings a journal from version n-1 to n. Append only; never edit a shipped one.
MIGRATIONS: Sequence[str] = (
    """
    CREATE TABLE meta (
        key TEXT PRIMARY KEY,
        value TEXT NOT NULL
    );
    CREATE TABLE members (
        member_key TEXT PRIMARY KEY,
        run_id TEXT NOT NULL,
        attempt INTEGER NOT NULL,
        member_index INTEGER NOT NULL,
        state TEXT NOT NULL,
        created_at_ms INTEGER NOT NULL,
        updated_at_ms INTEGER NOT NULL,
        member_count INTEGER NOT NULL,
        gpu_indexes TEXT NOT NULL,
        master_addr TEXT NOT NULL DEFAULT '',
        master_port INTEGER NOT NULL DEFAULT 0,
        member_dir TEXT NOT NULL,
        out_dir TEXT NOT NULL,
        grace_period_s INTEGER NOT NULL,
        exit_code INTEGER,
        signal INTEGER,
        reason TEXT NOT NULL DEFAULT ''
    );
    CREATE TABLE events (
        id INTEGER PRIMARY KEY AUTOINCREMENT,
        at_ms INTEGER NOT NULL,
        member_key TEXT,
        kind TEXT NOT NULL,
        from_state TEXT,
        to_state TEXT,
        reason TEXT NOT NULL DEFAULT '',
        details TEXT NOT NULL DEFAULT '{}'
    );
    CREATE INDEX events_member ON events (member_key, id);
    CREATE TABLE gpu_ownership (
        gpu_index INTEGER PRIMARY KEY,
        member_key TEXT NOT NULL REFERENCES members (member_key),
        since_ms INTEGER NOT NULL
    );
    CREATE TABLE pending_reports (
        report_seq INTEGER PRIMARY KEY,
        member_key TEXT NOT NULL REFERENCES members (member_key),
        state TEXT NOT NULL,
        at_ms INTEGER NOT NULL,
        reason TEXT NOT NULL DEFAULT '',
        has_exit INTEGER NOT NULL DEFAULT 0,
        exit_code INTEGER NOT NULL DEFAULT 0,
        signal INTEGER NOT NULL DEFAULT 0,
        out_dir TEXT NOT NULL DEFAULT ''
    );
    CREATE TABLE credentials (
        name TEXT PRIMARY KEY,
        created_at_ms INTEGER NOT NULL,
        rotated_at_ms INTEGER
    );
    INSERT INTO meta (key, value) VALUES ('next_report_seq', '1');
    """,
    # 2: the journal's identity. Random, made once, here: a new journal gets it as it is created
    # (after migration 1) and an existing one as it is opened by this agent for the first time.
    """
    INSERT INTO meta (key, value) VALUES ('journal_id', lower(hex(randomblob(16))));
    """,
    # 3: GPUs by UUID, and what the driver said about them. Reservations are keyed by the GPU's
    # UUID (the index is kept for reading); rows an older agent wrote get uuid "" and stay
    # unique by index until the daemon fills them in from its inventory (fill_member_uuids).
    """
    CREATE TABLE gpu_ownership_v3 (
        gpu_uuid TEXT NOT NULL,
        gpu_index INTEGER NOT NULL,
        member_key TEXT NOT NULL REFERENCES members (member_key),
        since_ms INTEGER NOT NULL
    );
    INSERT INTO gpu_ownership_v3 (gpu_uuid, gpu_index, member_key, since_ms)
        SELECT '', gpu_index, member_key, since_ms FROM gpu_ownership;
    DROP TABLE gpu_ownership;
    ALTER TABLE gpu_ownership_v3 RENAME TO gpu_ownership;
    CREATE UNIQUE INDEX gpu_ownership_uuid ON gpu_ownership (gpu_uuid) WHERE gpu_uuid != '';
    CREATE UNIQUE INDEX gpu_ownership_unnamed ON gpu_ownership (gpu_index) WHERE gpu_uuid = '';
    CREATE INDEX gpu_ownership_member ON gpu_ownership (member_key);
    ALTER TABLE members ADD COLUMN gpu_uuids TEXT NOT NULL DEFAULT '[]';
    CREATE TABLE gpu_xids (
        id INTEGER PRIMARY KEY AUTOINCREMENT,
        gpu_uuid TEXT NOT NULL,
        xid INTEGER NOT NULL,
        at_ms INTEGER NOT NULL,
        application INTEGER NOT NULL
    );
    CREATE INDEX gpu_xids_uuid ON gpu_xids (gpu_uuid, id);
    CREATE TABLE gpu_health_events (
        id INTEGER PRIMARY KEY AUTOINCREMENT,
        gpu_uuid TEXT NOT NULL,
        at_ms INTEGER NOT NULL,
        kind TEXT NOT NULL,
        actor TEXT NOT NULL,
        reason TEXT NOT NULL DEFAULT '',
        through_xid_id INTEGER NOT NULL DEFAULT 0,
        recovery_action TEXT NOT NULL DEFAULT ''
    );
    CREATE INDEX gpu_health_events_uuid ON gpu_health_events (gpu_uuid, id);
    """,
    # 4: an ended member's output manifest, as the exit report carries it to the coordinator
    # (ManifestSummary JSON: files, bytes, sha256 of the manifest file, or the problem that
    # kept it from being written); '' on every other report.
    """
    ALTER TABLE pending_reports ADD COLUMN manifest TEXT NOT NULL DEFAULT '';
    """,
)
