"""The coordinator store's tables for Fleets of kind ``slurm`` (migrations 17 to 19 and 21 of
:mod:`.schema`, which applies them in its order; the same rules hold: never edited once
released, plain SQL that PostgreSQL also accepts).
"""

from __future__ import annotations

#: Migration 17.
SLURM_FLEETS: tuple[str, ...] = (
    # How a Fleet of kind 'slurm' reaches its cluster: slurmrestd's URL, the absolute
    # path of the file holding its JWT (read at each use, never copied here) and the
    # partition its Jobs run in. Exactly one row per Fleet of kind 'slurm'.
    """CREATE TABLE slurm_fleets (
                fleet TEXT PRIMARY KEY REFERENCES fleets(name),
                slurmrestd_url TEXT NOT NULL,
                token_file TEXT NOT NULL,
                partition_name TEXT NOT NULL
            )""",
)

#: Migration 18.
SLURM_ATTEMPTS: tuple[str, ...] = (
    # Where a Slurm Fleet's attempts live: a folder every Slurm node and the coordinator
    # see at the same path (capsule, member folders, exit records, logs), and the
    # interpreter (with TunePlane installed) that runs the Slurm step on the nodes. ''
    # for Fleets created before: their Jobs are refused at Preview until it is set.
    "ALTER TABLE slurm_fleets ADD COLUMN shared_dir TEXT NOT NULL DEFAULT ''",
    "ALTER TABLE slurm_fleets ADD COLUMN python TEXT NOT NULL DEFAULT 'python3'",
    # A folder on each Slurm node's own storage where members' collectors keep their
    # spools ('' : the node's temporary folder).
    "ALTER TABLE slurm_fleets ADD COLUMN spool_dir TEXT NOT NULL DEFAULT ''",
    # One row per attempt run as a Slurm job, written with the attempt before anything
    # is submitted. job_name (carrying the attempt) is the idempotency key: a submit
    # whose job id was never recorded is found again by name. slurm_job_id is NULL
    # until recorded; slurm_state is Slurm's last word ('' before the first answer);
    # reachable is 0 while slurmrestd does not answer. signalled_at_ms and
    # cancelled_at_ms record a cancel's SIGTERM and its cancel after the grace period.
    """CREATE TABLE slurm_attempts (
                run_id TEXT NOT NULL,
                attempt INTEGER NOT NULL,
                fleet TEXT NOT NULL REFERENCES fleets(name),
                job_name TEXT NOT NULL UNIQUE,
                members INTEGER NOT NULL,
                gpus_per_member INTEGER NOT NULL,
                slurm_job_id BIGINT,
                submitted_at_ms BIGINT,
                slurm_state TEXT NOT NULL DEFAULT '',
                slurm_reason TEXT NOT NULL DEFAULT '',
                reachable INTEGER NOT NULL DEFAULT 1,
                unreachable_why TEXT NOT NULL DEFAULT '',
                has_exit INTEGER NOT NULL DEFAULT 0,
                exit_code INTEGER NOT NULL DEFAULT 0,
                signal INTEGER NOT NULL DEFAULT 0,
                signalled_at_ms BIGINT,
                cancelled_at_ms BIGINT,
                updated_at_ms BIGINT NOT NULL,
                PRIMARY KEY (run_id, attempt),
                FOREIGN KEY (run_id, attempt) REFERENCES attempts(run_id, number)
            )""",
)

#: Migration 19.
SLURM_SERIES_AND_EXITS: tuple[str, ...] = (
    # How a Fleet of kind 'slurm' asks Slurm for each Series it maps: its GPUs as the
    # 'gpu' GRES of gres_type and/or its nodes by the node feature node_constraint ('':
    # not asked). A Fleet with no rows asks every Series as GPUs of any type.
    """CREATE TABLE slurm_fleet_series (
                fleet TEXT NOT NULL REFERENCES fleets(name),
                series TEXT NOT NULL,
                gres_type TEXT NOT NULL DEFAULT '',
                node_constraint TEXT NOT NULL DEFAULT '',
                PRIMARY KEY (fleet, series)
            )""",
    # What an attempt asked Slurm for, fixed when it was written (its Series' mapping
    # then); '' for attempts written before, which asked for GPUs of any type.
    "ALTER TABLE slurm_attempts ADD COLUMN gres_type TEXT NOT NULL DEFAULT ''",
    "ALTER TABLE slurm_attempts ADD COLUMN node_constraint TEXT NOT NULL DEFAULT ''",
    # How many times Slurm requeued the attempt's job (its restart_cnt) at the last poll.
    "ALTER TABLE slurm_attempts ADD COLUMN restarts INTEGER NOT NULL DEFAULT 0",
    # How each member of an attempt run as a Slurm job ended, read from the exit record
    # its runner wrote on the shared folder when the Slurm job ended (has_exit 0: it
    # left none, e.g. its node failed before the runner started). Written once, before
    # the job's end is recorded.
    """CREATE TABLE slurm_member_exits (
                run_id TEXT NOT NULL,
                attempt INTEGER NOT NULL,
                member_index INTEGER NOT NULL,
                has_exit INTEGER NOT NULL,
                exit_code INTEGER NOT NULL DEFAULT 0,
                signal INTEGER NOT NULL DEFAULT 0,
                ended_at_ms BIGINT NOT NULL DEFAULT 0,
                PRIMARY KEY (run_id, attempt, member_index),
                FOREIGN KEY (run_id, attempt) REFERENCES attempts(run_id, number)
            )""",
)

#: Migration 21.
SLURM_IMAGES: tuple[str, ...] = (
    # Where a Fleet of kind 'slurm' runs image runtimes: a folder on each Slurm node's own
    # storage where the step caches images ('' : the Fleet runs no images, and Preview
    # refuses them), and a TOML file on every node with node.toml's
    # [registries."host:port"] tables ('' : the system's CAs, no credentials).
    "ALTER TABLE slurm_fleets ADD COLUMN image_root TEXT NOT NULL DEFAULT ''",
    "ALTER TABLE slurm_fleets ADD COLUMN registries_file TEXT NOT NULL DEFAULT ''",
)
