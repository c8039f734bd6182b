"""Node display names (docs/operator.md, "Names"), on a real store (SQLite, PostgreSQL): chosen
once at enrollment, unique per Fleet, kept across re-enrollment and host-name changes, given to
Nodes enrolled before names were stored by the schema migration, and accepted by commands in
place of the id."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import TypeVar

import anyio
import pytest

from tests.support.store_backend import current, open_at_version, write
from tuneplane.coordinator.store.core import Conflict, NotFound, Store
from tuneplane.coordinator.store.fleet_views import node_views, resolve_node
from tuneplane.coordinator.store.schema import MIGRATIONS
from tuneplane.coordinator.values.orders import Gpu, Inventory

T = TypeVar("T")
NOW = 1000


def _run(work: Callable[[Store], Awaitable[T]], path: Path) -> T:
    async def go() -> T:
        store = await Store.open(current().where(path))
        try:
            return await work(store)
        finally:
            await store.close()

    return anyio.run(go)


def _inventory(hostname: str) -> Inventory:
    return Inventory(
        hostname=hostname, gpus=(Gpu(0, "h200", True, f"GPU-{hostname}"),), gpu_source="sim"
    )


async def _enroll(store: Store, node_id: str, hostname: str, fleet: str = "default") -> None:
    await store.create_join_token(f"join-{node_id}", fleet, NOW, NOW + 60_000)
    await store.enroll(f"join-{node_id}", node_id, _inventory(hostname), f"cred-{node_id}", NOW)


async def _names(store: Store) -> dict[str, str]:
    return {n.id: n.name for n in await node_views(store)}


def test_names_are_host_names_numbered_per_fleet_in_enrollment_order(tmp_path: Path) -> None:
    async def work(store: Store) -> dict[str, str]:
        await store.bootstrap("admin-hash", NOW)
        await store.create_fleet("b", "node", NOW)
        await _enroll(store, "node-1", "gpu")
        await _enroll(store, "node-2", "gpu", fleet="b")  # another Fleet: its own names
        await _enroll(store, "node-3", "gpu-2")  # a host really named gpu-2
        await _enroll(store, "node-4", "gpu")  # gpu and gpu-2 are taken
        await _enroll(store, "node-5", "")  # no host name: the id
        # A later host-name change (seen at Hello) does not rename the Node.
        await store.node_connected("node-1", _inventory("renamed"), [], NOW + 1)
        return await _names(store)

    assert _run(work, tmp_path / "c.db") == {
        "node-1": "gpu",
        "node-2": "gpu",
        "node-3": "gpu-2",
        "node-4": "gpu-3",
        "node-5": "node-5",
    }


def test_commands_accept_a_name_a_fleet_slash_name_or_the_id(tmp_path: Path) -> None:
    async def work(store: Store) -> None:
        await store.bootstrap("admin-hash", NOW)
        await store.create_fleet("b", "node", NOW)
        await _enroll(store, "node-1", "gpu")
        await _enroll(store, "node-2", "gpu", fleet="b")
        await _enroll(store, "node-3", "only")
        assert await resolve_node(store, "node-1") == "node-1"
        assert await resolve_node(store, "only") == "node-3"
        assert await resolve_node(store, "b/gpu") == "node-2"
        assert await resolve_node(store, "default/gpu") == "node-1"
        with pytest.raises(Conflict) as both:
            await resolve_node(store, "gpu")
        assert "name one of b/gpu, default/gpu, or its id" in str(both.value)
        with pytest.raises(NotFound) as none:
            await resolve_node(store, "b/only")
        assert "there is no Node 'b/only'" in str(none.value)

    _run(work, tmp_path / "c.db")


def test_the_migration_names_nodes_enrolled_before_names_were_stored(tmp_path: Path) -> None:
    """A store at the schema before names: the migration names its Nodes by the enrollment
    rule, and the Nodes keep those names when the store is opened again."""
    path = tmp_path / "old.db"
    where = current().where(path)
    named_at = next(v for v, statements in MIGRATIONS if "ADD COLUMN name" in statements[0])

    async def older() -> None:
        await (await open_at_version(Store, where, named_at - 1)).close()

    anyio.run(older)
    write(
        where, Store, "INSERT INTO fleets (name, kind, created_at_ms) VALUES ('default', 'node', 1)"
    )
    for node_id, host, at in (("node-b", "gpu", 20), ("node-a", "gpu", 10), ("node-c", "", 30)):
        write(
            where,
            Store,
            "INSERT INTO nodes (id, fleet, hostname, inventory_json, credential_hash, "
            "enrolled_at_ms) VALUES (?, 'default', ?, ?, ?, ?)",
            (node_id, host, _inventory(host).to_json(), f"h-{node_id}", at),
        )

    async def work(store: Store) -> dict[str, str]:
        return await _names(store)

    assert _run(work, path) == {"node-a": "gpu", "node-b": "gpu-2", "node-c": "node-c"}
