"""The coordinator store: every decision and its effects in one transaction.

Rules:
- On SQLite (``coordinator.db``, WAL, ``synchronous=FULL``) or PostgreSQL (schema
  ``tuneplane``), through :mod:`~tuneplane.coordinator.store.db`: a returned call is durable,
  and the admin CLI opens the same store from another process while ``serve`` runs.
- Each public method is one write transaction (one writer at a time, across processes) and runs
  *shielded*: a caller's deadline may stop waiting for it, but never leaves half a transaction
  behind. The work is a zero-argument callable, so a transaction the database aborted for a
  conflict is run again whole.
- Every decision (admission, reservation, commit/abort, release, state change) appends a row to
  ``decisions`` in the same transaction as its effects. Retried messages are applied once.

The layers each live in their own module; this one composes them and is the store's front
door (:class:`Store`, its errors, :func:`db_path`).
"""

from __future__ import annotations

from pathlib import Path

from .admission import Admission
from .base import Conflict as Conflict
from .base import EnrollRefused as EnrollRefused
from .base import NotFound as NotFound
from .enrollment import Enrollment
from .handle import SchemaTooNew as SchemaTooNew
from .handle import StoreError as StoreError
from .job_reads import JobReads
from .launches import Launches
from .nodes import NodeConnections
from .reports import Reports
from .schema import MIGRATIONS

DB_NAME = "coordinator.db"


class Store(Enrollment, NodeConnections, Admission, JobReads, Launches, Reports):
    """The coordinator's durable state. Open with :meth:`open`; close with :meth:`close`.

    One class, one concern per layer (each its own module): :class:`Enrollment` (Fleets, join
    tokens, enrolling Nodes), :class:`NodeConnections` (Hello, heartbeats, disconnection),
    :class:`Admission` (previews, commit), :class:`JobReads` (Job views, the scheduler's reads),
    :class:`Launches` (reservation, PrepareReplies, prepare deadlines) over
    :class:`~tuneplane.coordinator.store.launch_steps.LaunchSteps` (the launch table's effects),
    and :class:`Reports` (MemberReports), all over
    :class:`~tuneplane.coordinator.store.member_states.MemberStates` (member and Job states) and
    :class:`~tuneplane.coordinator.store.base.StoreBase` (the decision log).
    """

    LABEL = "store"
    VERSION_TABLE = "schema_version"
    SCHEMA = "tuneplane"
    MIGRATIONS = MIGRATIONS
    FOREIGN_KEYS = True
    STATEMENTS_ON_LOOP = True


def db_path(state_dir: Path) -> Path:
    return state_dir / DB_NAME
