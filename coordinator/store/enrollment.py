"""Joining the fleet: the first admin user and Fleet, Fleets, one-time join tokens, and
enrolling a Node with one.

Rules:
- A join token works once; one made for a Node (``for_node``) only re-enrolls that Node, so a
  leaked token cannot take over an existing Node's identity.
- A Node's display name is chosen in its enrolling transaction (:func:`free_node_name`), so
  names are unique per Fleet.
"""

from __future__ import annotations

from typing import Any

from ..values.fleet import SlurmSeries, SlurmSettings
from ..values.orders import Inventory
from .base import Conflict, EnrollRefused, NotFound, StoreBase
from .handle import Handle


class Enrollment(StoreBase):
    """Fleets, join tokens and Node enrollment."""

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

    async def create_fleet(
        self, name: str, kind: str, now: int, slurm: SlurmSettings | None = None
    ) -> None:
        """Create a Fleet; one of kind ``slurm`` needs its ``slurm`` settings (and no other kind
        takes them), written in the same transaction."""
        if (kind == "slurm") != (slurm is not None):
            verb = "needs" if kind == "slurm" else "takes no"
            raise ValueError(f"a Fleet of kind {kind!r} {verb} Slurm settings")

        async def work() -> None:
            async with self.transaction() as db:
                rows = await db.execute_fetchall("SELECT 1 FROM fleets WHERE name = ?", (name,))
                if list(rows):
                    raise Conflict(f"the Fleet {name!r} already exists. Pick another name.")
                await db.execute(
                    "INSERT INTO fleets (name, kind, created_at_ms) VALUES (?, ?, ?)",
                    (name, kind, now),
                )
                detail: dict[str, Any] = {"fleet": name, "kind": kind}
                if slurm is not None:
                    await db.execute(
                        "INSERT INTO slurm_fleets (fleet, slurmrestd_url, token_file, "
                        "partition_name, shared_dir, python, spool_dir, image_root, "
                        "registries_file) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)",
                        (name, slurm.slurmrestd, slurm.token_file, slurm.partition,
                         slurm.shared_dir, slurm.python, slurm.spool_dir, slurm.image_root,
                         slurm.registries_file),
                    )  # fmt: skip
                    for m in slurm.series:
                        await db.execute(
                            "INSERT INTO slurm_fleet_series (fleet, series, gres_type, "
                            "node_constraint) VALUES (?, ?, ?, ?)",
                            (name, m.series, m.gres_type, m.constraint),
                        )
                    detail.update(slurmrestd=slurm.slurmrestd, token_file=slurm.token_file,
                                  partition=slurm.partition, shared_dir=slurm.shared_dir,
                                  python=slurm.python, spool_dir=slurm.spool_dir,
                                  image_root=slurm.image_root,
                                  registries_file=slurm.registries_file,
                                  series={m.series: [m.gres_type, m.constraint]
                                          for m in slurm.series})  # fmt: skip
                await self.log_decision(db, now, "fleet created", detail)

        await self.shielded(work)

    async def slurm_settings(self, fleet: str) -> SlurmSettings | None:
        """How the Fleet ``fleet`` reaches its Slurm cluster; None unless it is of kind slurm."""
        rows = await self.reader.execute_fetchall(
            "SELECT slurmrestd_url, token_file, partition_name, shared_dir, python, spool_dir, "
            "image_root, registries_file FROM slurm_fleets WHERE fleet = ?",
            (fleet,),
        )
        found = list(rows)
        if not found:
            return None
        url, token_file, partition, shared_dir, python, spool_dir, image_root, registries = found[0]
        mapped = await self.reader.execute_fetchall(
            "SELECT series, gres_type, node_constraint FROM slurm_fleet_series WHERE fleet = ? "
            "ORDER BY series",
            (fleet,),
        )
        series = tuple(SlurmSeries(str(s), str(g), str(c)) for s, g, c in mapped)
        return SlurmSettings(
            str(url), str(token_file), str(partition), str(shared_dir), str(python),
            str(spool_dir), series, str(image_root), str(registries),
        )  # fmt: skip

    async def fleet_names(self) -> list[str]:
        # A site has a handful of Fleets: read like a row by key.
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
