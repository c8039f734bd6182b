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
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any, TypeVar

import attrs

from tuneplane.agent.crashpoint import crashpoint
from tuneplane.proto.contract.derivation_source import ManifestSummary

from .. import launch
from .. import lifecycle as lc
from ..derivation import stored_manifest
from ..placement import NodeOffer, Placement
from ..values.fleet import NodeRecord
from ..values.jobs import (
    Attempt,
    Job,
    Member,
    MemberKey,
    Preview,
    QueuedJob,
    Receipt,
    StateChange,
)
from ..values.orders import (
    AbortOrder,
    CommitOrder,
    HeldMember,
    Inventory,
    Order,
    OutputsService,
    PrepareOrder,
    Report,
)
from .db import StoreDb
from .handle import Handle, IntegrityViolation
from .handle import SchemaTooNew as SchemaTooNew
from .handle import StoreError as StoreError
from .schema import MIGRATIONS

log = logging.getLogger(__name__)

DB_NAME = "coordinator.db"
T = TypeVar("T")


async def first_row(db: Handle, sql: str, args: Sequence[Any] = ()) -> Any:
    """The first row of a query, or None."""
    return await db.fetchone(sql, args)


async def _placed_uuids(db: Handle, node_id: str, gpu_indexes: Sequence[int]) -> tuple[str, ...]:
    """The UUIDs the Node's last inventory gives ``gpu_indexes`` ("" for an index it lacks)."""
    row = await first_row(db, "SELECT inventory_json FROM nodes WHERE id = ?", (node_id,))
    gpus = {g.index: g.uuid for g in Inventory.from_json(str(row[0])).gpus} if row else {}
    return tuple(gpus.get(i, "") for i in gpu_indexes)


class NotFound(StoreError):
    """The thing named does not exist (gRPC NOT_FOUND)."""


class Conflict(StoreError):
    """The request contradicts what is recorded (gRPC FAILED_PRECONDITION)."""


class EnrollRefused(StoreError):
    """The join token cannot enroll a Node (gRPC PERMISSION_DENIED)."""


@attrs.frozen
class ReportOutcome:
    """What :meth:`Store.apply_report` did with one MemberReport.

    ``applied``: the member moved. ``ended``: the member has ended (now or before), so its
    collector credential and failed-sibling handling follow. ``early``: the report overtook the
    ones before it; nothing was changed and it must not be acknowledged (the Node sends it again).
    ``refused``: the sentence sent back to the Node; nothing was changed.
    """

    applied: bool = False
    ended: bool = False
    early: bool = False
    refused: str = ""


class Store(StoreDb):
    """The coordinator's durable state. Open with :meth:`open`; close with :meth:`close`."""

    LABEL = "store"
    VERSION_TABLE = "schema_version"
    SCHEMA = "tuneplane"
    MIGRATIONS = MIGRATIONS
    FOREIGN_KEYS = True

    async def log_decision(
        self,
        db: Handle,
        now: int,
        kind: str,
        detail: dict[str, Any],
        member: MemberKey | None = None,
        run_id: str | None = None,
        node_id: str | None = None,
    ) -> None:
        await db.execute(
            "INSERT INTO decisions (at_ms, kind, run_id, attempt, member_index, node_id, "
            "detail_json) VALUES (?, ?, ?, ?, ?, ?, ?)",
            (
                now,
                kind,
                member.run_id if member else run_id,
                member.attempt if member else None,
                member.member_index if member else None,
                node_id,
                json.dumps(detail, sort_keys=True),
            ),
        )

    # ----- fleets, users, join tokens ----------------------------------------------------------

    async def bootstrap(self, admin_token_hash: str, now: int) -> None:
        """Create the admin user and the Fleet ``default`` (kind ``node``). Run once by init."""

        async def work() -> None:
            async with self.transaction() as db:
                await db.execute(
                    "INSERT INTO users (name, token_hash, role, created_at_ms) "
                    "VALUES ('admin', ?, 'admin', ?)",
                    (admin_token_hash, now),
                )
                await db.execute(
                    "INSERT INTO fleets (name, kind, created_at_ms) VALUES ('default', 'node', ?)",
                    (now,),
                )
                await self.log_decision(db, now, "bootstrap", {"fleet": "default", "user": "admin"})

        await self.shielded(work)

    async def create_fleet(self, name: str, kind: str, now: int) -> None:
        async def work() -> None:
            async with self.transaction() as db:
                rows = await db.execute_fetchall("SELECT 1 FROM fleets WHERE name = ?", (name,))
                if list(rows):
                    raise Conflict(f"the Fleet {name!r} already exists. Pick another name.")
                await db.execute(
                    "INSERT INTO fleets (name, kind, created_at_ms) VALUES (?, ?, ?)",
                    (name, kind, now),
                )
                await self.log_decision(db, now, "fleet created", {"fleet": name, "kind": kind})

        await self.shielded(work)

    async def fleet_names(self) -> list[str]:
        rows = await self.reader.execute_fetchall("SELECT name FROM fleets ORDER BY name")
        return [str(r[0]) for r in rows]

    async def create_join_token(
        self,
        token_hash: str,
        fleet: str,
        now: int,
        expires_at_ms: int,
        for_node: str | None = None,
    ) -> None:
        """A one-time join token; with ``for_node``, one that only re-enrolls that Node."""

        async def work() -> None:
            async with self.transaction() as db:
                rows = await db.execute_fetchall("SELECT 1 FROM fleets WHERE name = ?", (fleet,))
                if not list(rows):
                    raise NotFound(
                        f"there is no Fleet {fleet!r}. Create it with "
                        f"`tuneplane-coordinator fleet create {fleet}`."
                    )
                await db.execute(
                    "INSERT INTO join_tokens (token_hash, fleet, created_at_ms, expires_at_ms, "
                    "for_node) VALUES (?, ?, ?, ?, ?)",
                    (token_hash, fleet, now, expires_at_ms, for_node),
                )
                detail: dict[str, Any] = {"fleet": fleet, "expires_at_ms": expires_at_ms}
                if for_node is not None:
                    detail["for_node"] = for_node
                await self.log_decision(db, now, "join token created", detail, node_id=for_node)

        await self.shielded(work)

    # ----- nodes -------------------------------------------------------------------------------

    async def enroll(
        self,
        join_token_hash: str,
        node_id: str,
        inventory: Inventory,
        credential_hash: str,
        now: int,
        credential_expires_at_ms: int | None = None,
    ) -> str:
        """Spend a join token on a new Node; returns its Fleet. Raises :class:`EnrollRefused`."""

        async def work() -> str:
            async with self.transaction() as db:
                fleet = await self.spend_join_token(db, join_token_hash, node_id, now)
                name = await free_node_name(db, fleet, inventory.hostname, node_id)
                await db.execute(
                    "INSERT INTO nodes (id, fleet, hostname, inventory_json, credential_hash, "
                    "enrolled_at_ms, disconnected_since_ms, credential_issued_at_ms, "
                    "credential_expires_at_ms, name) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                    (
                        node_id,
                        fleet,
                        inventory.hostname,
                        inventory.to_json(),
                        credential_hash,
                        now,
                        now,
                        now,
                        credential_expires_at_ms,
                        name,
                    ),
                )
                await self.log_decision(
                    db,
                    now,
                    "node enrolled",
                    {"fleet": fleet, "hostname": inventory.hostname, "name": name},
                    node_id=node_id,
                )
                return fleet

        return await self.shielded(work)

    async def spend_join_token(
        self,
        db: Handle,
        join_token_hash: str,
        node_id: str,
        now: int,
        reenrolling: bool = False,
    ) -> str:
        """Inside a transaction: mark a join token used by ``node_id``; returns its Fleet.

        A token made for one Node (``for_node``) only re-enrolls that Node; any other token only
        enrolls new Nodes, so a leaked join token cannot take over an existing Node's identity.
        """
        rows = list(
            await db.execute_fetchall(
                "SELECT fleet, expires_at_ms, used_at_ms, for_node FROM join_tokens "
                "WHERE token_hash = ?",
                (join_token_hash,),
            )
        )
        if not rows:
            raise EnrollRefused(
                "this join token is not known to the coordinator. Ask the coordinator's "
                "operator for a new one (`tuneplane-coordinator token create`)."
            )
        fleet, expires, used, for_node = rows[0]
        if reenrolling and for_node != node_id:
            raise EnrollRefused(
                f"this join token was not made for re-enrolling Node {node_id}. Make one that "
                f"is: `tuneplane-coordinator token create --node {node_id}`."
            )
        if not reenrolling and for_node is not None:
            raise EnrollRefused(
                f"this join token only re-enrolls Node {for_node} (`tuneplane-node enroll "
                "--re-enroll` on that machine). For a new Node use a token made without --node."
            )
        if used is not None:
            raise EnrollRefused(
                "this join token was already used to enroll a Node; a join token works "
                "once. Create a new one with `tuneplane-coordinator token create`."
            )
        if int(expires) <= now:
            raise EnrollRefused(
                "this join token has expired. Create a new one with "
                "`tuneplane-coordinator token create --ttl <duration>`."
            )
        await db.execute(
            "UPDATE join_tokens SET used_at_ms = ?, used_by_node = ? WHERE token_hash = ?",
            (now, node_id, join_token_hash),
        )
        return str(fleet)

    async def node(self, node_id: str) -> NodeRecord | None:
        rows = list(
            await self.reader.execute_fetchall(
                "SELECT id, fleet, hostname, connected FROM nodes WHERE id = ?",
                (node_id,),
            )
        )
        if not rows:
            return None
        r = rows[0]
        return NodeRecord(str(r[0]), str(r[1]), str(r[2]), bool(r[3]))

    async def mark_all_disconnected(self, now: int) -> None:
        """At start-up no Node is connected yet, whatever the store said when it stopped."""

        async def work() -> None:
            async with self.transaction() as db:
                rows = await db.execute_fetchall("SELECT id FROM nodes WHERE connected = 1")
                for (node_id,) in list(rows):
                    await self._disconnect(db, str(node_id), now, "the coordinator restarted")

        await self.shielded(work)

    async def node_connected(
        self,
        node_id: str,
        inventory: Inventory,
        held: Sequence[HeldMember],
        now: int,
        dialed_address: str = "",
        outputs: OutputsService | None = None,
    ) -> list[Order]:
        """Record a Hello: the Node is connected (at ``dialed_address``, the control address it
        dialed, serving outputs at ``outputs``, checked by the caller; None clears what an
        earlier Hello said); unknown members get their real state back.

        Returns the orders to (re)send: Prepare for members still waiting for one, and the
        decision for members whose attempt is already decided.
        """

        async def work() -> list[Order]:
            async with self.transaction() as db:
                await db.execute(
                    "UPDATE nodes SET connected = 1, disconnected_since_ms = NULL, "
                    "last_heartbeat_ms = ?, inventory_json = ?, hostname = ?, "
                    "dialed_address = ?, outputs_address = ?, outputs_cert_sha256 = ?, "
                    "outputs_grant_key = ? WHERE id = ?",
                    (
                        now,
                        inventory.to_json(),
                        inventory.hostname,
                        dialed_address,
                        outputs.address if outputs else "",
                        outputs.cert_sha256 if outputs else "",
                        outputs.grant_key.hex() if outputs else "",
                        node_id,
                    ),
                )
                detail = {"dialed": dialed_address} if dialed_address else {}
                if outputs:
                    detail["outputs"] = outputs.address
                await self.log_decision(db, now, "node connected", detail, node_id=node_id)
                held_states = {h.member: h.state for h in held}
                rows = list(
                    await db.execute_fetchall(
                        "SELECT m.run_id, m.attempt, m.member_index, m.known_state, a.decision "
                        "FROM members m JOIN attempts a ON a.run_id = m.run_id "
                        "AND a.number = m.attempt WHERE m.node_id = ? AND m.state = 'unknown'",
                        (node_id,),
                    )
                )
                touched: set[str] = set()
                for run_id, attempt, index, known, decision in rows:
                    key = MemberKey(str(run_id), int(attempt), int(index))
                    new_known = str(known)
                    reported = held_states.get(key)
                    if reported is not None:
                        # Judged like a report (lifecycle.held_after_hello): only this Node's
                        # members are read, and only a reachable state is taken.
                        moved = lc.held_after_hello(
                            new_known, reported, None if decision is None else str(decision)
                        )
                        new_known = moved or new_known
                    await self.set_member_state(
                        db, key, new_known, now, "its Node reconnected", known=new_known
                    )
                    touched.add(key.run_id)
                for run_id in sorted(touched):
                    await self.refresh_job(db, run_id, now)
                return await self._orders_to_resend(db, node_id)

        return await self.shielded(work)

    async def node_heartbeats(self, beats: Mapping[str, int]) -> None:
        """Store many Nodes' latest heartbeat times (node id -> ms) in one transaction.

        A heartbeat is not a decision: the gateway acks it from memory and a flusher calls this
        once per interval. A time only moves forward, so a late batch never rewinds a newer one.
        """

        async def work() -> None:
            async with self.transaction() as db:
                await db.executemany(
                    "UPDATE nodes SET last_heartbeat_ms = MAX(COALESCE(last_heartbeat_ms, 0), ?) "
                    "WHERE id = ?",
                    [(at, node_id) for node_id, at in sorted(beats.items())],
                )
                crashpoint("mid-heartbeat-batch", beats=beats)

        await self.shielded(work)

    async def node_inventory(self, node_id: str, inventory: Inventory, now: int) -> None:
        """A heartbeat carried a changed inventory: store it (and the heartbeat time) at once."""

        async def work() -> None:
            async with self.transaction() as db:
                await db.execute(
                    "UPDATE nodes SET inventory_json = ?, "
                    "last_heartbeat_ms = MAX(COALESCE(last_heartbeat_ms, 0), ?) WHERE id = ?",
                    (inventory.to_json(), now, node_id),
                )

        await self.shielded(work)

    async def session_replaced(
        self, node_id: str, old_peer: str, new_peer: str, old_opened_at_ms: int, now: int
    ) -> None:
        """Audit a second Connect of one Node that ended its live stream (the newer one wins).

        Nothing else changes: the Node stays connected and its members keep their states.
        """

        async def work() -> None:
            async with self.transaction() as db:
                await self.log_decision(
                    db, now, "control stream replaced",
                    {"old_peer": old_peer, "new_peer": new_peer,
                     "old_opened_at_ms": old_opened_at_ms},
                    node_id=node_id,
                )  # fmt: skip

        await self.shielded(work)

    async def node_disconnected(self, node_id: str, now: int, why: str) -> None:
        """The Node's stream ended: it is ``disconnected`` and its live members ``unknown``."""

        async def work() -> None:
            async with self.transaction() as db:
                await self._disconnect(db, node_id, now, why)

        await self.shielded(work)

    async def _disconnect(self, db: Handle, node_id: str, now: int, why: str) -> None:
        await db.execute(
            "UPDATE nodes SET connected = 0, disconnected_since_ms = ? WHERE id = ?",
            (now, node_id),
        )
        await self.log_decision(db, now, "node disconnected", {"why": why}, node_id=node_id)
        terminal = tuple(sorted(lc.TERMINAL_MEMBER_STATES))
        marks = ",".join("?" for _ in terminal)
        rows = list(
            await db.execute_fetchall(
                "SELECT run_id, attempt, member_index, known_state FROM members "
                f"WHERE node_id = ? AND state <> 'unknown' AND known_state NOT IN ({marks})",
                (node_id, *terminal),
            )
        )
        touched: set[str] = set()
        for run_id, attempt, index, known in rows:
            key = MemberKey(str(run_id), int(attempt), int(index))
            await self.set_member_state(
                db, key, lc.M_UNKNOWN, now, f"its Node disconnected ({why})", known=str(known)
            )
            touched.add(key.run_id)
        for run_id in sorted(touched):
            await self.refresh_job(db, run_id, now)

    # ----- previews and admission --------------------------------------------------------------

    async def save_preview(self, preview: Preview) -> None:
        async def work() -> None:
            async with self.transaction() as db:
                await db.execute(
                    "INSERT INTO previews (id, digest, resolved_json, summary_json, owner, "
                    "created_at_ms) VALUES (?, ?, ?, ?, ?, ?)",
                    (
                        preview.preview_id,
                        preview.digest,
                        preview.resolved_jobspec_json,
                        json.dumps(attrs.asdict(preview.summary), sort_keys=True),
                        preview.owner,
                        preview.created_at_ms,
                    ),
                )

        await self.shielded(work)

    async def commit(
        self, preview_id: str, digest: str, retry_key: str, owner: str, run_id: str, now: int
    ) -> Receipt:
        """Admit a preview as a Job, once per retry key (the UNIQUE constraint decides)."""

        async def work() -> Receipt:
            async with self.transaction() as db:
                earlier = await self._receipt_for_key(db, retry_key, owner)
                if earlier is not None:
                    if (earlier.preview_id, earlier.digest) != (preview_id, digest):
                        raise Conflict(
                            f"the retry key {retry_key!r} already confirmed preview "
                            f"{earlier.preview_id} (Job {earlier.run_id}); this confirmation "
                            "names a different preview or digest. Use a new retry key."
                        )
                    return earlier
                rows = list(
                    await db.execute_fetchall(
                        "SELECT digest, resolved_json, summary_json FROM previews "
                        "WHERE id = ? AND owner = ?",
                        (preview_id, owner),
                    )
                )
                # Another user's preview reads as absent: a preview is its author's intent,
                # and committing it would run their code (and show its output) as the caller.
                if not rows:
                    raise NotFound(
                        f"there is no preview {preview_id!r}. Run `tp submit --preview` again."
                    )
                stored_digest, resolved_json, summary_json = rows[0]
                if stored_digest != digest:
                    raise Conflict(
                        f"the digest {digest!r} does not match preview {preview_id} "
                        f"({stored_digest}): the intent changed since it was previewed. "
                        "Run `tp submit --preview` again and confirm the new preview."
                    )
                spec = json.loads(resolved_json)
                summary = json.loads(summary_json)
                res = spec["resources"]
                await db.execute(
                    "INSERT INTO jobs (run_id, preview_id, digest, retry_key, owner, project, "
                    "experiment, method_id, profile, fleet, series, gpus, members_wanted, "
                    "gpus_per_member, init_from, state, state_reason, created_at_ms, "
                    "updated_at_ms) VALUES "
                    "(?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                    (
                        run_id,
                        preview_id,
                        digest,
                        retry_key,
                        owner,
                        spec["project"],
                        spec["experiment"],
                        spec["method_id"],
                        res["profile"],
                        summary["fleet"],
                        res["series"],
                        res["gpus"],
                        res.get("members"),
                        res.get("gpus_per_member"),
                        spec.get("init_from"),
                        lc.QUEUED,
                        "admitted; waiting for free GPUs",
                        now,
                        now,
                    ),
                )
                await db.execute(
                    "INSERT INTO job_states (run_id, state, reason, at_ms) VALUES (?, ?, ?, ?)",
                    (run_id, lc.QUEUED, "admitted; waiting for free GPUs", now),
                )
                await self.log_decision(
                    db,
                    now,
                    "admission",
                    {"preview_id": preview_id, "digest": digest, "owner": owner},
                    run_id=run_id,
                )
                return Receipt(run_id, preview_id, digest, retry_key, now, created=True)

        try:
            return await self.shielded(work)
        except IntegrityViolation:
            # Another process admitted the same retry key between our read and our insert: the
            # UNIQUE constraint refused ours, so the earlier receipt is the answer.
            async with self.transaction() as db:
                earlier = await self._receipt_for_key(db, retry_key, owner)
            if earlier is None:
                raise
            return earlier

    async def _receipt_for_key(self, db: Handle, retry_key: str, owner: str) -> Receipt | None:
        """The receipt this owner already got for ``retry_key``; None when the key is unused.

        Another user's key is a Conflict that names no Job: answering with their receipt would
        hand a guesser someone else's run id.
        """
        rows = list(
            await db.execute_fetchall(
                "SELECT run_id, preview_id, digest, created_at_ms, owner FROM jobs "
                "WHERE retry_key = ?",
                (retry_key,),
            )
        )
        if not rows:
            return None
        r = rows[0]
        if r[4] != owner:
            raise Conflict(
                f"the retry key {retry_key!r} is already in use. Confirm with a new retry key."
            )
        return Receipt(str(r[0]), str(r[1]), str(r[2]), retry_key, int(r[3]), created=False)

    async def get_job(self, run_id: str) -> Job:
        rows = list(
            await self.reader.execute_fetchall(
                "SELECT run_id FROM jobs WHERE run_id = ?",
                (run_id,),
            )
        )
        if not rows:
            raise NotFound(f"there is no Job with run id {run_id!r}. Check it with `tp ls`.")
        return (await self.job_views([run_id], full=True))[0]

    async def list_jobs(
        self, project: str = "", state: str = "", owner: str = "", limit: int = 100
    ) -> list[Job]:
        clauses: list[str] = []
        args: list[Any] = []
        for column, value in (("project", project), ("state", state), ("owner", owner)):
            if value:
                clauses.append(f"{column} = ?")
                args.append(value)
        where = f"WHERE {' AND '.join(clauses)}" if clauses else ""
        rows = await self.reader.execute_fetchall(
            f"SELECT run_id FROM jobs {where} ORDER BY created_at_ms DESC, run_id LIMIT ?",
            (*args, limit),
        )
        return await self.job_views([str(r[0]) for r in rows], full=False)

    async def job_views(self, run_ids: Sequence[str], full: bool) -> list[Job]:
        views = []
        for run_id in run_ids:
            r = await first_row(
                self.reader,
                "SELECT run_id, project, experiment, owner, state, fleet, profile, method_id, "
                "preview_id, digest, init_from, created_at_ms, state_reason FROM jobs "
                "WHERE run_id = ?",
                (run_id,),
            )
            history: tuple[StateChange, ...] = ()
            attempts: tuple[Attempt, ...] = ()
            if full:
                history = await self._history(
                    "SELECT state, at_ms, reason FROM job_states WHERE run_id = ? ORDER BY id",
                    (run_id,),
                )
                attempts = await self._attempt_views(run_id)
            views.append(
                Job(
                    run_id=str(r[0]),
                    project=str(r[1]),
                    experiment=str(r[2]),
                    owner=str(r[3]),
                    state=str(r[4]),
                    fleet=str(r[5]),
                    profile=str(r[6]),
                    method_id=str(r[7]),
                    preview_id=str(r[8]),
                    digest=str(r[9]),
                    init_from=str(r[10] or ""),
                    created_at_ms=int(r[11]),
                    history=history,
                    attempts=attempts,
                    state_reason=str(r[12]),
                )
            )
        return views

    async def _history(self, sql: str, args: Iterable[Any]) -> tuple[StateChange, ...]:
        rows = await self.reader.execute_fetchall(sql, tuple(args))
        return tuple(StateChange(str(s), int(t), str(why)) for s, t, why in rows)

    async def _attempt_views(self, run_id: str) -> tuple[Attempt, ...]:
        attempts = []
        rows = await self.reader.execute_fetchall(
            "SELECT number, decision, master_addr, master_port, created_at_ms FROM attempts "
            "WHERE run_id = ? ORDER BY number",
            (run_id,),
        )
        for number, decision, addr, port, created in rows:
            members = []
            mrows = await self.reader.execute_fetchall(
                "SELECT m.member_index, m.node_id, m.state, m.has_exit, m.exit_code, m.signal, "
                "m.out_dir, m.gpu_indexes_json, m.ended_at_ms, n.name, m.output_manifest_json "
                "FROM members m "
                "LEFT JOIN nodes n ON n.id = m.node_id WHERE m.run_id = ? AND m.attempt = ? "
                "ORDER BY m.member_index",
                (run_id, number),
            )
            for idx, node_id, state, has_exit, code, sig, out_dir, gpus, ended, name, mf in mrows:
                history = await self._history(
                    "SELECT state, at_ms, reason FROM member_states WHERE run_id = ? AND "
                    "attempt = ? AND member_index = ? ORDER BY id",
                    (run_id, number, idx),
                )
                members.append(
                    Member(
                        index=int(idx),
                        node_id=str(node_id),
                        state=str(state),
                        has_exit=bool(has_exit),
                        exit_code=int(code),
                        signal=int(sig),
                        out_dir=str(out_dir),
                        gpu_indexes=tuple(json.loads(gpus)),
                        history=history,
                        ended_at_ms=int(ended),
                        node_name=str(name or ""),
                        output_manifest=ManifestSummary.from_json(str(mf or "")),
                    )
                )
            state = {None: "preparing", lc.COMMIT: "committed", lc.ABORT: "aborted"}[decision]
            if await first_row(
                self.reader,
                "SELECT 1 FROM attempt_stops WHERE run_id = ? AND attempt = ? AND kind = 'cancel'",
                (run_id, number),
            ):
                state = "cancelled"
            attempts.append(
                Attempt(int(number), state, tuple(members), str(addr), int(port), int(created))
            )
        return tuple(attempts)

    # ----- scheduling: reservation, prepare, commit/abort --------------------------------------

    async def queued_job(self, run_id: str) -> QueuedJob | None:
        """What a launch needs of one Job (its resolved JobSpec too); None unless queued.

        The scheduling pass reads the queue without the JobSpecs
        (:func:`~tuneplane.coordinator.store.fleet.queued_requests`) and this only for the Jobs
        it launches.
        """
        r = await first_row(
            self.reader,
            "SELECT j.run_id, j.fleet, j.series, j.gpus, j.members_wanted, j.gpus_per_member, "
            "p.resolved_json, j.digest, j.owner FROM jobs j JOIN previews p ON p.id = j.preview_id "
            "WHERE j.run_id = ? AND j.state = ?",
            (run_id, lc.QUEUED),
        )
        if r is None:
            return None
        return QueuedJob(
            run_id=str(r[0]),
            fleet=str(r[1]),
            series=str(r[2]),
            gpus=int(r[3]),
            members=None if r[4] is None else int(r[4]),
            gpus_per_member=None if r[5] is None else int(r[5]),
            resolved_json=str(r[6]),
            digest=str(r[7]),
            owner=str(r[8]),
        )

    async def offers(self, fleet: str, series: str) -> list[NodeOffer]:
        """Connected, schedulable Nodes of ``fleet`` and their free healthy GPUs of ``series``."""
        nodes = await self.reader.execute_fetchall(
            "SELECT id, inventory_json FROM nodes WHERE fleet = ? AND connected = 1 "
            "AND scheduling = 'schedulable' ORDER BY id",
            (fleet,),
        )
        offers = []
        for node_id, inventory_json in nodes:
            inventory = Inventory.from_json(str(inventory_json))
            taken = {
                int(r[0])
                for r in await self.reader.execute_fetchall(
                    "SELECT gpu_index FROM reservations WHERE node_id = ?", (node_id,)
                )
            }
            free = tuple(
                g.index
                for g in inventory.gpus
                if g.healthy and g.series == series and g.index not in taken
            )
            offers.append(NodeOffer(str(node_id), free))
        return offers

    async def reserve_launch(
        self,
        job: QueuedJob,
        placement: Placement,
        seal_capsule: Callable[[int], dict[str, str]],
        prepare_deadline_ms: int,
        now: int,
    ) -> list[PrepareOrder] | None:
        """Write the launch reservation, the attempt and its members in one transaction.

        ``seal_capsule(attempt number)`` returns the capsule files recorded with the attempt.

        Returns the Prepare orders, or None when the Job is no longer queued or a GPU was taken
        meanwhile (the primary key on reservations refused it; nothing was written).
        """

        async def work() -> list[PrepareOrder] | None:
            async with self.transaction() as db:
                row = await first_row(db, "SELECT state FROM jobs WHERE run_id = ?", (job.run_id,))
                if row is None or row[0] != lc.QUEUED:
                    return None
                (last,) = await first_row(
                    db,
                    "SELECT COALESCE(MAX(number), 0) FROM attempts WHERE run_id = ?",
                    (job.run_id,),
                )
                number = int(last) + 1
                capsule_files = seal_capsule(number)
                nonce = launch.new_nonce()
                await db.execute(
                    "INSERT INTO attempts (run_id, number, prepare_deadline_ms, capsule_json, "
                    "created_at_ms, rendezvous_nonce) VALUES (?, ?, ?, ?, ?, ?)",
                    (
                        job.run_id,
                        number,
                        prepare_deadline_ms,
                        json.dumps(capsule_files, sort_keys=True),
                        now,
                        nonce,
                    ),
                )
                for m in placement.members:
                    key = MemberKey(job.run_id, number, m.index)
                    uuids = await _placed_uuids(db, m.node_id, m.gpu_indexes)
                    await db.execute(
                        "INSERT INTO members (run_id, attempt, member_index, node_id, "
                        "gpu_indexes_json, gpu_uuids_json, state, known_state, updated_at_ms) "
                        "VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)",
                        (
                            job.run_id,
                            number,
                            m.index,
                            m.node_id,
                            json.dumps(list(m.gpu_indexes)),
                            json.dumps(list(uuids)),
                            lc.M_RESERVED,
                            lc.M_RESERVED,
                            now,
                        ),
                    )
                    await self._member_history(db, key, lc.M_RESERVED, "GPUs reserved", now)
                    for gpu in m.gpu_indexes:
                        await db.execute(
                            "INSERT INTO reservations (node_id, gpu_index, run_id, attempt, "
                            "member_index, created_at_ms) VALUES (?, ?, ?, ?, ?, ?)",
                            (m.node_id, gpu, job.run_id, number, m.index, now),
                        )
                await self.log_decision(
                    db,
                    now,
                    "reservation",
                    {
                        "members": [
                            {"index": m.index, "node": m.node_id, "gpus": list(m.gpu_indexes)}
                            for m in placement.members
                        ],
                        "prepare_deadline_ms": prepare_deadline_ms,
                    },
                    run_id=job.run_id,
                )
                await self.refresh_job(db, job.run_id, now)
                # The same decision issues member 0's Prepare (the others follow its
                # PrepareReply): it is in the store from now on, sent below, and sent again to a
                # Node that (re)connects or asks.
                facts = launch.Attempt(
                    tuple(launch.Member(m.index, m.node_id) for m in placement.members),
                    nonce=nonce,
                )
                step = launch.step(facts, launch.Reserved())
                orders = await self._apply_launch(db, job.run_id, number, facts, step, now)
                prepares = [o for o in orders if isinstance(o, PrepareOrder)]
                assert len(prepares) == len(orders), "a reservation sends only Prepares"
                return prepares

        try:
            return await self.shielded(work)
        except IntegrityViolation as exc:
            log.warning("reservation refused run_id=%s why=%s", job.run_id, exc)
            return None

    async def record_prepare_reply(
        self,
        node_id: str,
        member: MemberKey,
        ok: bool,
        reason: str,
        master_addr: str,
        master_port: int,
        now: int,
        rendezvous_held: bool = False,
    ) -> list[Order]:
        """Apply a PrepareReply; returns the Commit or Abort orders it caused (maybe none).

        A repeated reply for a decided attempt gets that decision again, for this member only.
        Member 0's reply says whether its Node holds the rendezvous listener; when it does not
        (an older agent) the attempt's nonce is dropped, so the other members' Prepares ask for
        no check they could never pass.
        """

        async def work() -> list[Order]:
            async with self.transaction() as db:
                facts = await self.attempt_facts(db, member.run_id, member.attempt)
                event: launch.Event
                if not ok:
                    event = launch.PrepareFailed(node_id, member.member_index, reason)
                else:
                    hostname = ""
                    if member.member_index == 0 and not master_addr:
                        # The Node left the address to us: its reported host name is the best bet.
                        (hostname,) = await first_row(
                            db, "SELECT hostname FROM nodes WHERE id = ?", (node_id,)
                        )
                    event = launch.Prepared(
                        node_id, member.member_index, master_addr, master_port,
                        rendezvous_held, str(hostname),
                    )  # fmt: skip
                step = launch.step(facts, event) if facts else None
                if facts is None or step is None or step.ignored == launch.NO_RECORD:
                    log.warning(
                        "prepare reply for a member this Node does not hold node=%s run_id=%s "
                        "attempt=%d member=%d",
                        node_id,
                        member.run_id,
                        member.attempt,
                        member.member_index,
                    )
                    return []
                if ok and member.member_index == 0 and not rendezvous_held and not facts.decision:
                    log.info(
                        "rendezvous not held by member 0's Node; not checked run_id=%s "
                        "attempt=%d node=%s", member.run_id, member.attempt, node_id,
                    )  # fmt: skip
                return await self._apply_launch(db, member.run_id, member.attempt, facts, step, now)

        return await self.shielded(work)

    async def launch_event(
        self, db: Handle, run_id: str, attempt: int, event: launch.Event, now: int
    ) -> list[Order]:
        """Inside a transaction: apply one launch event (coordinator/launch.py) to an attempt."""
        facts = await self.attempt_facts(db, run_id, attempt)
        if facts is None:
            return []
        return await self._apply_launch(db, run_id, attempt, facts, launch.step(facts, event), now)

    async def attempt_facts(self, db: Handle, run_id: str, attempt: int) -> launch.Attempt | None:
        """What :func:`launch.step` reads about an attempt; None when there is no such attempt."""
        row = await first_row(
            db,
            "SELECT decision, decision_reason, master_addr, master_port, rendezvous_nonce "
            "FROM attempts WHERE run_id = ? AND number = ?",
            (run_id, attempt),
        )
        if row is None:
            return None
        members = await db.execute_fetchall(
            "SELECT member_index, node_id, prepared, known_state FROM members "
            "WHERE run_id = ? AND attempt = ? ORDER BY member_index",
            (run_id, attempt),
        )
        return launch.Attempt(
            members=tuple(
                launch.Member(int(i), str(node), bool(prepared), str(known))
                for i, node, prepared, known in members
            ),
            decision=None if row[0] is None else str(row[0]),
            reason=str(row[1]),
            master_addr=str(row[2]),
            master_port=int(row[3]),
            nonce=str(row[4]),
        )

    async def _apply_launch(
        self,
        db: Handle,
        run_id: str,
        attempt: int,
        before: launch.Attempt,
        step: launch.Step,
        now: int,
    ) -> list[Order]:
        """Inside a transaction: persist what :func:`launch.step` returned, log its decision and
        build the orders it names. Nothing here decides anything."""
        after = step.attempt
        where = (run_id, attempt)
        if (after.master_addr, after.master_port, after.nonce) != (
            before.master_addr,
            before.master_port,
            before.nonce,
        ):
            await db.execute(
                "UPDATE attempts SET master_addr = ?, master_port = ?, rendezvous_nonce = ? "
                "WHERE run_id = ? AND number = ?",
                (after.master_addr, after.master_port, after.nonce, *where),
            )
        for old, new in zip(before.members, after.members, strict=True):
            if new.prepared != old.prepared:
                await db.execute(
                    "UPDATE members SET prepared = ? WHERE run_id = ? AND attempt = ? "
                    "AND member_index = ?",
                    (int(new.prepared), *where, new.index),
                )
        if step.decided == lc.ABORT:
            await self._decide(db, run_id, attempt, after, now)
        released = set(step.releases)
        for change in step.changes:
            key = MemberKey(run_id, attempt, change.member_index)
            await self.set_member_state(
                db, key, change.state, now, change.reason, known=change.state
            )
            if change.member_index in released:
                await self.release_member(db, key, now, "the launch was aborted")
        if step.decided == lc.COMMIT:
            await self._decide(db, run_id, attempt, after, now)
        if step.changes or step.decided:
            await self.refresh_job(db, run_id, now)
        prepares = {s.member_index for s in step.sends if s.kind == "prepare"}
        rows = await self._prepare_rows(db, run_id, attempt, prepares) if prepares else {}
        orders: list[Order] = []
        for send in step.sends:
            key = MemberKey(run_id, attempt, send.member_index)
            if send.kind == "prepare":
                orders.append(_prepare_order(send.node_id, key, rows[send.member_index]))
            else:
                orders.append(_order(key, send))
        return orders

    async def _decide(
        self, db: Handle, run_id: str, attempt: int, after: launch.Attempt, now: int
    ) -> None:
        """Record an attempt's decision and its ``decisions`` row."""
        await db.execute(
            "UPDATE attempts SET decision = ?, decision_reason = ?, decided_at_ms = ? "
            "WHERE run_id = ? AND number = ?",
            (after.decision, after.reason, now, run_id, attempt),
        )
        if after.decision == lc.COMMIT:
            detail: dict[str, Any] = {
                "attempt": attempt,
                "master_addr": after.master_addr,
                "master_port": after.master_port,
            }
        else:
            detail = {"attempt": attempt, "reason": after.reason}
        await self.log_decision(db, now, str(after.decision), detail, run_id=run_id)

    async def _prepare_rows(
        self, db: Handle, run_id: str, attempt: int, indexes: set[int]
    ) -> dict[int, Any]:
        """The rows :func:`_prepare_order` builds these members' Prepares from."""
        rows = await db.execute_fetchall(
            _PREPARE_ROWS + "WHERE m.run_id = ? AND m.attempt = ? ORDER BY m.member_index",
            (run_id, attempt),
        )
        return {int(r[2]): r for r in rows if int(r[2]) in indexes}

    async def abort_expired_prepares(self, now: int) -> list[Order]:
        """Abort every undecided attempt whose prepare deadline has passed."""
        # Every scheduling pass asks; a read answers "none" without taking the write lock.
        if not await first_row(
            self.reader,
            "SELECT 1 FROM attempts WHERE decision IS NULL AND prepare_deadline_ms <= ? LIMIT 1",
            (now,),
        ):
            return []

        async def work() -> list[Order]:
            async with self.transaction() as db:
                rows = list(
                    await db.execute_fetchall(
                        "SELECT run_id, number FROM attempts WHERE decision IS NULL "
                        "AND prepare_deadline_ms <= ?",
                        (now,),
                    )
                )
                orders: list[Order] = []
                for run_id, number in rows:
                    orders += await self.launch_event(
                        db, str(run_id), int(number), launch.PrepareTimedOut(), now
                    )
                return orders

        return await self.shielded(work)

    async def decision_for(self, node_id: str, member: MemberKey) -> Order | None:
        """The recorded decision for a member this Node holds; None while undecided.

        A member the coordinator has no record of (or that is another Node's) gets Abort, so the
        Node can release what it reserved.
        """
        facts = await self.attempt_facts(self.reader, member.run_id, member.attempt)
        query = launch.DecisionQueried(node_id, member.member_index)
        if facts is None:
            return AbortOrder(node_id, member, launch.NO_RECORD)
        sends = launch.step(facts, query).sends
        return _order(member, sends[0]) if sends else None

    async def _orders_to_resend(self, db: Handle, node_id: str) -> list[Order]:
        """What :func:`launch.step` sends a reconnected Node, over the attempts it holds members
        of that are undecided or committed and not yet past ``prepared`` there (the only ones the
        table can still owe it anything)."""
        attempts = await db.execute_fetchall(
            "SELECT DISTINCT m.run_id, m.attempt FROM members m JOIN attempts a "
            "ON a.run_id = m.run_id AND a.number = m.attempt WHERE m.node_id = ? "
            "AND (a.decision IS NULL OR m.known_state IN (?, ?, ?)) ORDER BY m.run_id, m.attempt",
            (node_id, *sorted(launch.BEFORE_COMMIT)),
        )
        orders: list[Order] = []
        for run_id, number in attempts:
            orders += await self.launch_event(
                db, str(run_id), int(number), launch.NodeReconnected(node_id), 0
            )
        return orders

    # ----- member reports ----------------------------------------------------------------------

    async def apply_report(self, node_id: str, report: Report, now: int) -> ReportOutcome:
        """Judge a Node's MemberReport (:func:`lifecycle.judge_report`) and apply what it allows.

        Report numbers decide nothing: a repeat or a late copy is stale by the member's own
        state, so a restarted journal or a forged number can never hide a true report. A refused
        report changes nothing but an audit row in ``decisions``.
        """

        async def work() -> ReportOutcome:
            async with self.transaction() as db:
                key = report.member
                row = await first_row(
                    db,
                    "SELECT m.node_id, m.state, m.known_state, m.out_dir, a.decision, "
                    "m.declared_lost FROM members m JOIN attempts a ON a.run_id = m.run_id "
                    "AND a.number = m.attempt "
                    "WHERE m.run_id = ? AND m.attempt = ? AND m.member_index = ?",
                    (key.run_id, key.attempt, key.member_index),
                )
                facts = lc.ReportFacts(
                    node_id=node_id,
                    member=f"{key.run_id} attempt {key.attempt} member {key.member_index}",
                    run_id=key.run_id,
                    attempt=key.attempt,
                    member_index=key.member_index,
                    reported=report.state,
                    has_exit=report.has_exit,
                    out_dir=report.out_dir,
                    placed_on=None if row is None else str(row[0]),
                    known=lc.M_RESERVED if row is None else str(row[2]),
                    decision=None if row is None or row[4] is None else str(row[4]),
                    recorded_out_dir="" if row is None else str(row[3]),
                    declared_lost="" if row is None else str(row[5]),
                )
                verdict = lc.judge_report(facts)
                if isinstance(verdict, lc.RefuseReport):
                    # Audited against the reporting Node only: the member it named may be
                    # another user's, and this row must not read as that Job's history.
                    await self.log_decision(
                        db, now, "report refused",
                        {"reason": verdict.reason, "member": str(key), "state": report.state,
                         "report_seq": report.report_seq, "journal_id": report.journal_id},
                        node_id=node_id,
                    )  # fmt: skip
                    return ReportOutcome(refused=verdict.reason)
                assert row is not None
                if isinstance(verdict, lc.EarlyReport):
                    return ReportOutcome(early=True)
                known = str(row[2])
                if isinstance(verdict, lc.StaleReport):
                    if str(row[1]) == lc.M_UNKNOWN:
                        # Its Node is talking again: the member shows its last real state.
                        await self.set_member_state(
                            db, key, known, now, f"reported {report.state} by its Node",
                            known=known,
                        )  # fmt: skip
                        await self.refresh_job(db, key.run_id, now)
                    return ReportOutcome(ended=known in lc.TERMINAL_MEMBER_STATES)
                moved = verdict.state
                why = report.reason or f"reported {moved} by its Node"
                await self.set_member_state(db, key, moved, now, why, known=moved)
                if report.has_exit and moved == lc.M_EXITED:
                    await db.execute(
                        "UPDATE members SET has_exit = 1, exit_code = ?, signal = ? "
                        "WHERE run_id = ? AND attempt = ? AND member_index = ?",
                        (report.exit_code, report.signal, key.run_id, key.attempt,
                         key.member_index),
                    )  # fmt: skip
                if report.out_dir:
                    await db.execute(
                        "UPDATE members SET out_dir = ? WHERE run_id = ? AND attempt = ? "
                        "AND member_index = ?",
                        (report.out_dir, key.run_id, key.attempt, key.member_index),
                    )
                if report.manifest is not None and moved == lc.M_EXITED:
                    await db.execute(
                        "UPDATE members SET output_manifest_json = ? WHERE run_id = ? AND "
                        "attempt = ? AND member_index = ?",
                        (stored_manifest(report.manifest).to_json(), key.run_id, key.attempt,
                         key.member_index),
                    )  # fmt: skip
                if moved in lc.TERMINAL_MEMBER_STATES:
                    await db.execute(
                        "UPDATE members SET ended_at_ms = ? WHERE run_id = ? AND attempt = ? "
                        "AND member_index = ?",
                        (report.at_ms or now, key.run_id, key.attempt, key.member_index),
                    )
                    await self.release_member(db, key, now, f"the member {moved}")
                await self.refresh_job(db, key.run_id, now)
                return ReportOutcome(applied=True, ended=moved in lc.TERMINAL_MEMBER_STATES)

        return await self.shielded(work)

    # ----- helpers inside a transaction --------------------------------------------------------

    async def _member_history(
        self, db: Handle, key: MemberKey, state: str, reason: str, now: int
    ) -> None:
        await db.execute(
            "INSERT INTO member_states (run_id, attempt, member_index, state, reason, at_ms) "
            "VALUES (?, ?, ?, ?, ?, ?)",
            (key.run_id, key.attempt, key.member_index, state, reason, now),
        )

    async def set_member_state(
        self,
        db: Handle,
        key: MemberKey,
        state: str,
        now: int,
        reason: str,
        known: str,
    ) -> None:
        await db.execute(
            "UPDATE members SET state = ?, known_state = ?, updated_at_ms = ? "
            "WHERE run_id = ? AND attempt = ? AND member_index = ?",
            (state, known, now, key.run_id, key.attempt, key.member_index),
        )
        await self._member_history(db, key, state, reason, now)

    async def release_member(self, db: Handle, key: MemberKey, now: int, why: str) -> None:
        cursor = await db.execute(
            "DELETE FROM reservations WHERE run_id = ? AND attempt = ? AND member_index = ?",
            (key.run_id, key.attempt, key.member_index),
        )
        if cursor.rowcount:
            await self.log_decision(
                db, now, "release", {"why": why, "gpus": cursor.rowcount}, member=key
            )

    async def refresh_job(self, db: Handle, run_id: str, now: int) -> None:
        """Derive the Job's state from its latest attempt; record a change with its reason."""
        (current,) = await first_row(db, "SELECT state FROM jobs WHERE run_id = ?", (run_id,))
        attempt = list(
            await db.execute_fetchall(
                "SELECT number, decision, decision_reason FROM attempts WHERE run_id = ? "
                "ORDER BY number DESC LIMIT 1",
                (run_id,),
            )
        )
        facts: list[lc.MemberFacts] = []
        decision: str | None = None
        decision_reason = ""
        cancel_reason: str | None = None
        if attempt:
            number, decision, decision_reason = attempt[0]
            # The reason of each member's latest state: a launch failure's sentence from its
            # Node becomes the Job's reason.
            for idx, state, has_exit, code, sig, why, lost in await db.execute_fetchall(
                "SELECT m.member_index, m.state, m.has_exit, m.exit_code, m.signal, "
                "(SELECT s.reason FROM member_states s WHERE s.run_id = m.run_id "
                " AND s.attempt = m.attempt AND s.member_index = m.member_index "
                " ORDER BY s.id DESC LIMIT 1), m.declared_lost "
                "FROM members m WHERE m.run_id = ? AND m.attempt = ? ORDER BY m.member_index",
                (run_id, number),
            ):
                facts.append(
                    lc.MemberFacts(
                        int(idx), str(state), bool(has_exit), code, sig, str(why or ""), str(lost)
                    )
                )
            cancel = await first_row(
                db,
                "SELECT reason FROM attempt_stops WHERE run_id = ? AND attempt = ? "
                "AND kind = 'cancel'",
                (run_id, number),
            )
            cancel_reason = None if cancel is None else str(cancel[0])
        derived, reason = lc.derive_job_state(decision, str(decision_reason), facts, cancel_reason)
        new = lc.next_job_state(str(current), derived)
        if new == current:
            return
        await db.execute(
            "UPDATE jobs SET state = ?, state_reason = ?, updated_at_ms = ? WHERE run_id = ?",
            (new, reason, now, run_id),
        )
        await db.execute(
            "INSERT INTO job_states (run_id, state, reason, at_ms) VALUES (?, ?, ?, ?)",
            (run_id, new, reason, now),
        )
        await self.log_decision(
            db, now, "state change", {"from": current, "to": new, "reason": reason}, run_id=run_id
        )
        log.info("job state run_id=%s from=%s to=%s reason=%s", run_id, current, new, reason)


def db_path(state_dir: Path) -> Path:
    return state_dir / DB_NAME


#: The members/attempts/jobs/previews join a Prepare is built from (:func:`_prepare_order`).
_PREPARE_ROWS = (
    "SELECT m.run_id, m.attempt, m.member_index, m.gpu_indexes_json, m.prepared, "
    "m.known_state, a.decision, a.decision_reason, a.master_addr, a.master_port, "
    "a.capsule_json, p.resolved_json, "
    "(SELECT COUNT(*) FROM members o WHERE o.run_id = m.run_id AND o.attempt = m.attempt), "
    "j.owner, m.gpu_uuids_json, a.rendezvous_nonce "
    "FROM members m JOIN attempts a ON a.run_id = m.run_id AND a.number = m.attempt "
    "JOIN jobs j ON j.run_id = m.run_id JOIN previews p ON p.id = j.preview_id "
)


def _order(key: MemberKey, send: launch.Send) -> Order:
    """A decision :func:`launch.step` sends, as the order the gateway delivers."""
    if send.kind == "commit":
        return CommitOrder(send.node_id, key, send.master_addr, send.master_port)
    return AbortOrder(send.node_id, key, send.reason)


def _prepare_order(node_id: str, key: MemberKey, r: Any) -> PrepareOrder:
    """A member's Prepare from a row of :data:`_PREPARE_ROWS` (the attempt's nonce 15th):
    member 0 picks the rendezvous, every other member is told it, to prove it can reach it."""
    first = key.member_index == 0
    return PrepareOrder(
        node_id=node_id,
        member=key,
        jobspec_json=str(r[11]),
        member_count=int(r[12]),
        gpu_indexes=tuple(json.loads(r[3])),
        pick_rendezvous=first,
        capsule_files=json.loads(r[10]),
        owner=str(r[13]),
        gpu_uuids=tuple(str(u) for u in json.loads(r[14])),
        rendezvous_nonce=str(r[15]),
        master_addr="" if first else str(r[8]),
        master_port=0 if first else int(r[9]),
    )


async def free_node_name(db: Handle, fleet: str, hostname: str, node_id: str) -> str:
    """Inside a transaction: the display name a Node enrolling into ``fleet`` gets. Its host
    name when no Node of the Fleet holds that name, else the first free of ``hostname-2``,
    ``hostname-3``, ...; the Node's id when it reported no host name. Names are unique per
    Fleet because they are chosen here, in the enrolling transaction."""
    if not hostname:
        return node_id
    taken = {
        str(row[0])
        for row in await db.execute_fetchall(
            "SELECT name FROM nodes WHERE fleet = ? AND substr(name, 1, ?) = ?",
            (fleet, len(hostname), hostname),
        )
    }
    number = 1
    while (name := hostname if number == 1 else f"{hostname}-{number}") in taken:
        number += 1
    return name
