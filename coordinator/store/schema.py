"""The coordinator store's schema, as numbered migrations applied in order.

Rules:
- A migration is never edited once released; a change is a new migration with the next number.
  ``schema_version`` holds the version reached; each migration runs in its own transaction.
- Plain SQL that PostgreSQL also accepts: no ``INSERT OR ...``, no SQLite-only types.
- GPU over-commit is impossible by construction: a reservation's primary key is (node, GPU), and
  a Job has at most one member per Node (UNIQUE on run, attempt, node).
"""

from __future__ import annotations

from .schema_slurm import SLURM_ATTEMPTS, SLURM_FLEETS, SLURM_IMAGES, SLURM_SERIES_AND_EXITS

MIGRATIONS: tuple[tuple[int, tuple[str, ...]], ...] = (
    (
        1,
        (
            """CREATE TABLE fleets (
                name TEXT PRIMARY KEY,
                kind TEXT NOT NULL CHECK (kind IN ('node', 'kubernetes', 'slurm')),
                created_at_ms BIGINT NOT NULL
            )""",
            """CREATE TABLE users (
                name TEXT PRIMARY KEY,
                token_hash TEXT NOT NULL UNIQUE,
                role TEXT NOT NULL,
                created_at_ms BIGINT NOT NULL
            )""",
            """CREATE TABLE join_tokens (
                token_hash TEXT PRIMARY KEY,
                fleet TEXT NOT NULL REFERENCES fleets(name),
                created_at_ms BIGINT NOT NULL,
                expires_at_ms BIGINT NOT NULL,
                used_at_ms BIGINT,
                used_by_node TEXT
            )""",
            """CREATE TABLE nodes (
                id TEXT PRIMARY KEY,
                fleet TEXT NOT NULL REFERENCES fleets(name),
                hostname TEXT NOT NULL,
                inventory_json TEXT NOT NULL,
                scheduling TEXT NOT NULL DEFAULT 'schedulable',
                connected INTEGER NOT NULL DEFAULT 0,
                last_heartbeat_ms BIGINT,
                disconnected_since_ms BIGINT,
                last_report_seq BIGINT NOT NULL DEFAULT 0,
                credential_hash TEXT NOT NULL UNIQUE,
                enrolled_at_ms BIGINT NOT NULL
            )""",
        ),
    ),
    (
        2,
        (
            """CREATE TABLE previews (
                id TEXT PRIMARY KEY,
                digest TEXT NOT NULL,
                resolved_json TEXT NOT NULL,
                summary_json TEXT NOT NULL,
                owner TEXT NOT NULL,
                created_at_ms BIGINT NOT NULL
            )""",
            """CREATE TABLE jobs (
                run_id TEXT PRIMARY KEY,
                preview_id TEXT NOT NULL REFERENCES previews(id),
                digest TEXT NOT NULL,
                retry_key TEXT NOT NULL UNIQUE,
                owner TEXT NOT NULL,
                project TEXT NOT NULL,
                experiment TEXT NOT NULL,
                method_id TEXT NOT NULL,
                profile TEXT NOT NULL,
                fleet TEXT NOT NULL REFERENCES fleets(name),
                series TEXT NOT NULL,
                gpus INTEGER NOT NULL,
                members_wanted INTEGER,
                gpus_per_member INTEGER,
                init_from TEXT,
                state TEXT NOT NULL,
                state_reason TEXT NOT NULL,
                created_at_ms BIGINT NOT NULL,
                updated_at_ms BIGINT NOT NULL
            )""",
            "CREATE INDEX jobs_by_fleet_state ON jobs (fleet, state, created_at_ms)",
            """CREATE TABLE job_states (
                id INTEGER PRIMARY KEY,
                run_id TEXT NOT NULL REFERENCES jobs(run_id),
                state TEXT NOT NULL,
                reason TEXT NOT NULL,
                at_ms BIGINT NOT NULL
            )""",
            "CREATE INDEX job_states_by_run ON job_states (run_id, id)",
            """CREATE TABLE attempts (
                run_id TEXT NOT NULL REFERENCES jobs(run_id),
                number INTEGER NOT NULL,
                decision TEXT CHECK (decision IN ('commit', 'abort')),
                decision_reason TEXT NOT NULL DEFAULT '',
                decided_at_ms BIGINT,
                prepare_deadline_ms BIGINT NOT NULL,
                master_addr TEXT NOT NULL DEFAULT '',
                master_port INTEGER NOT NULL DEFAULT 0,
                capsule_json TEXT NOT NULL,
                created_at_ms BIGINT NOT NULL,
                PRIMARY KEY (run_id, number)
            )""",
            """CREATE TABLE members (
                run_id TEXT NOT NULL,
                attempt INTEGER NOT NULL,
                member_index INTEGER NOT NULL,
                node_id TEXT NOT NULL REFERENCES nodes(id),
                gpu_indexes_json TEXT NOT NULL,
                state TEXT NOT NULL,
                known_state TEXT NOT NULL,
                prepared INTEGER NOT NULL DEFAULT 0,
                has_exit INTEGER NOT NULL DEFAULT 0,
                exit_code INTEGER NOT NULL DEFAULT 0,
                signal INTEGER NOT NULL DEFAULT 0,
                out_dir TEXT NOT NULL DEFAULT '',
                updated_at_ms BIGINT NOT NULL,
                PRIMARY KEY (run_id, attempt, member_index),
                UNIQUE (run_id, attempt, node_id),
                FOREIGN KEY (run_id, attempt) REFERENCES attempts(run_id, number)
            )""",
            "CREATE INDEX members_by_node ON members (node_id, state)",
            """CREATE TABLE member_states (
                id INTEGER PRIMARY KEY,
                run_id TEXT NOT NULL,
                attempt INTEGER NOT NULL,
                member_index INTEGER NOT NULL,
                state TEXT NOT NULL,
                reason TEXT NOT NULL,
                at_ms BIGINT NOT NULL
            )""",
            "CREATE INDEX member_states_by_member ON member_states (run_id, attempt, member_index)",
            """CREATE TABLE reservations (
                node_id TEXT NOT NULL REFERENCES nodes(id),
                gpu_index INTEGER NOT NULL,
                run_id TEXT NOT NULL,
                attempt INTEGER NOT NULL,
                member_index INTEGER NOT NULL,
                created_at_ms BIGINT NOT NULL,
                PRIMARY KEY (node_id, gpu_index)
            )""",
            """CREATE TABLE decisions (
                id INTEGER PRIMARY KEY,
                at_ms BIGINT NOT NULL,
                kind TEXT NOT NULL,
                run_id TEXT,
                attempt INTEGER,
                member_index INTEGER,
                node_id TEXT,
                detail_json TEXT NOT NULL
            )""",
        ),
    ),
    (
        3,
        (
            # A stop request for one attempt: a person's cancel (kind 'cancel', which decides the
            # Job's state) or the coordinator stopping the siblings of a failed member (kind
            # 'stop-siblings', which does not). Recorded before any Cancel is sent, so a Node
            # that was away gets it again when it reconnects.
            """CREATE TABLE attempt_stops (
                run_id TEXT NOT NULL,
                attempt INTEGER NOT NULL,
                kind TEXT NOT NULL CHECK (kind IN ('cancel', 'stop-siblings')),
                reason TEXT NOT NULL,
                grace_period_s INTEGER NOT NULL,
                requested_by TEXT NOT NULL,
                requested_at_ms BIGINT NOT NULL,
                PRIMARY KEY (run_id, attempt, kind),
                FOREIGN KEY (run_id, attempt) REFERENCES attempts(run_id, number)
            )""",
        ),
    ),
    (
        4,
        (
            # Every scheduling pass reads the queue and the undecided attempts: indexes keep
            # those reads proportional to what is queued or preparing, not to all history.
            "CREATE INDEX jobs_by_state ON jobs (state, created_at_ms, run_id)",
            "CREATE INDEX attempts_by_decision ON attempts (decision, prepare_deadline_ms)",
        ),
    ),
    (
        5,
        (
            # Credentials that expire and can be revoked (hashes only, never values). A Node's
            # credential has a lifetime; during a rotation the issued-but-unconfirmed successor
            # sits in next_credential_* and both work until the Node proves it holds the new one.
            # NULL expiry: issued before credentials expired; its lifetime starts at next Connect.
            "ALTER TABLE nodes ADD COLUMN credential_issued_at_ms BIGINT",
            "ALTER TABLE nodes ADD COLUMN credential_expires_at_ms BIGINT",
            "ALTER TABLE nodes ADD COLUMN next_credential_hash TEXT",
            "ALTER TABLE nodes ADD COLUMN next_credential_issued_at_ms BIGINT",
            "ALTER TABLE nodes ADD COLUMN next_credential_expires_at_ms BIGINT",
            "ALTER TABLE nodes ADD COLUMN revoked_at_ms BIGINT",
            "CREATE UNIQUE INDEX nodes_by_next_credential ON nodes (next_credential_hash)",
            # A user token expires (NULL: never, as for the admin token init writes) and can be
            # revoked; both are checked on every call.
            "ALTER TABLE users ADD COLUMN expires_at_ms BIGINT",
            "ALTER TABLE users ADD COLUMN revoked_at_ms BIGINT",
        ),
    ),
    (
        6,
        (
            # A join token made for re-enrolling one existing Node (`token create --node`); only
            # such a token re-enrolls it, and it enrolls nothing else. NULL: a new Node's token.
            "ALTER TABLE join_tokens ADD COLUMN for_node TEXT",
        ),
    ),
    (
        7,
        (
            # Reports are judged by their member's recorded state, never by their number
            # (docs/security.md, "Report numbers decide nothing"); a highest number seen per Node
            # is no longer kept, so an on-call reading this table is not misled by one.
            "ALTER TABLE nodes DROP COLUMN last_report_seq",
        ),
    ),
    (
        8,
        (
            # The UUIDs of a member's GPUs as the Node's inventory named them at placement, in
            # the order of gpu_indexes_json; Prepare carries them so the Node can refuse a GPU
            # whose index now names another card. '[]': placed before UUIDs were recorded.
            "ALTER TABLE members ADD COLUMN gpu_uuids_json TEXT NOT NULL DEFAULT '[]'",
        ),
    ),
    (
        9,
        (
            # A member whose Node was declared lost (`node lost`, or a Fleet's max_disconnect):
            # the declaration's sentence ("declared lost by <who>: <reason>"); '' for every other
            # member. Its Node's later reports are refused with it, and a Node that comes back is
            # told to stop the member.
            "ALTER TABLE members ADD COLUMN declared_lost TEXT NOT NULL DEFAULT ''",
        ),
    ),
    (
        10,
        (
            # When a member ended, as its Node's exit report said (the report's at_ms, the Node's
            # clock); 0 when no Node reported the end (a lost member, or one that ended before
            # this was recorded). `tp job show` names the member that failed first by it.
            "ALTER TABLE members ADD COLUMN ended_at_ms BIGINT NOT NULL DEFAULT 0",
        ),
    ),
    (
        11,
        (
            # A member's output manifest as its Node's exit report carried it (JSON: files,
            # bytes, sha256 of the manifest file, or the problem that kept it from being
            # written); '' until then, and from a Node older than manifests. A Derivation
            # (--init-from) begins from member 0's, checked against that digest.
            "ALTER TABLE members ADD COLUMN output_manifest_json TEXT NOT NULL DEFAULT ''",
        ),
    ),
    (
        12,
        (
            # The attempt's rendezvous nonce (hex): member 0's Prepare carries it to the listener
            # its Node holds on the rendezvous port, every other member's Prepare carries it
            # with the rendezvous, and a Node is prepared only once that listener proved it
            # holds the nonce (agent/rendezvous.py). '' for attempts made before: not checked.
            "ALTER TABLE attempts ADD COLUMN rendezvous_nonce TEXT NOT NULL DEFAULT ''",
        ),
    ),
    (
        13,
        (
            # A Node's display name, chosen once at enrollment (enrollment.free_node_name): the
            # host name it reported, numbered within its Fleet in enrollment order when taken
            # (gpu-a, gpu-a-2). It stays when the host name later changes, so people and
            # scripts can keep using it. Nodes enrolled before are named by the same rule here.
            "ALTER TABLE nodes ADD COLUMN name TEXT NOT NULL DEFAULT ''",
            """UPDATE nodes SET name = (
                SELECT CASE WHEN r.n = 1 THEN r.hostname ELSE r.hostname || '-' || r.n END
                FROM (SELECT id, hostname, ROW_NUMBER() OVER (
                    PARTITION BY fleet, hostname ORDER BY enrolled_at_ms, id) AS n
                    FROM nodes) AS r
                WHERE r.id = nodes.id)""",
            "UPDATE nodes SET name = id WHERE name = ''",
            "CREATE INDEX nodes_by_name ON nodes (fleet, name)",
        ),
    ),
    (
        14,
        (
            # The control address Nodes are told to dial (`tuneplane-coordinator
            # control-address`); at most one row, none when unset. Each change is a decision.
            """CREATE TABLE control_address (
                id INTEGER PRIMARY KEY CHECK (id = 1),
                address TEXT NOT NULL,
                set_at_ms BIGINT NOT NULL,
                set_by TEXT NOT NULL
            )""",
            # The control address a Node dialed for its current or last stream (its Hello);
            # '' before it said (an older agent).
            "ALTER TABLE nodes ADD COLUMN dialed_address TEXT NOT NULL DEFAULT ''",
        ),
    ),
    (
        15,
        (
            # Where the Node serves its ended members' outputs to other Nodes, as its last Hello
            # said (Hello.outputs): HOST:PORT, the sha256 (hex) of its listener's certificate,
            # and the key (hex of 32 bytes) the coordinator signs fetch grants with. All three
            # '' when it serves none (listener off, an older agent, or a malformed report).
            "ALTER TABLE nodes ADD COLUMN outputs_address TEXT NOT NULL DEFAULT ''",
            "ALTER TABLE nodes ADD COLUMN outputs_cert_sha256 TEXT NOT NULL DEFAULT ''",
            "ALTER TABLE nodes ADD COLUMN outputs_grant_key TEXT NOT NULL DEFAULT ''",
        ),
    ),
    (
        16,
        (
            # The Job's runtime as admitted (the resolved JobSpec's runtime_id): an image is
            # pinned by digest at Preview, so this names the exact image. '' for Jobs admitted
            # before it was kept (their resolved JobSpec still says).
            "ALTER TABLE jobs ADD COLUMN runtime_id TEXT NOT NULL DEFAULT ''",
        ),
    ),
    (
        17,
        (*SLURM_FLEETS,),
    ),
    (
        18,
        (*SLURM_ATTEMPTS,),
    ),
    (
        19,
        (*SLURM_SERIES_AND_EXITS,),
    ),
    (
        20,
        (
            # One Job's decisions, newest first (the console's Job page, at most its newest 500
            # rows): read along this index instead of scanning the whole log back from its
            # newest row until enough of that Job's rows turn up.
            "CREATE INDEX decisions_by_run ON decisions (run_id, id)",
        ),
    ),
    (
        21,
        (*SLURM_IMAGES,),
    ),
)

LATEST_VERSION = MIGRATIONS[-1][0]
