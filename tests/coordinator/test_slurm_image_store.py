"""Migration 21: a Fleet of kind slurm keeps where its Slurm step caches images and the
registries file its nodes read, on SQLite and on PostgreSQL (tests/coordinator/conftest.py runs
this module on both).

A Fleet made before (at version 20) is migrated with neither set, so Preview refuses its image
runtimes until the operator makes the Fleet again with --image-root; a Fleet made now keeps both.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from tests.support.store_backend import StoreBackend, open_at_version, write
from tuneplane.coordinator.store.core import Store
from tuneplane.coordinator.store.schema import LATEST_VERSION
from tuneplane.coordinator.values.fleet import SlurmSettings

pytestmark = pytest.mark.timeout(120)


def test_an_old_slurm_fleet_runs_no_images_and_a_new_one_keeps_its_image_settings(
    store_backend: StoreBackend, tmp_path: Path
) -> None:
    where = store_backend.where(tmp_path / "coordinator.db")

    async def old() -> None:
        store = await open_at_version(Store, where, 20)
        await store.close()

    asyncio.run(old())
    write(where, Store, "INSERT INTO fleets (name, kind, created_at_ms) VALUES (?, ?, ?)",
          ("old", "slurm", 1))  # fmt: skip
    write(
        where,
        Store,
        "INSERT INTO slurm_fleets (fleet, slurmrestd_url, token_file, partition_name, "
        "shared_dir) VALUES (?, ?, ?, ?, ?)",
        ("old", "http://127.0.0.1:6820", "/etc/tp/slurm.token", "gpu", "/shared/tp"),
    )
    made = SlurmSettings(
        "http://127.0.0.1:6820", "/etc/tp/slurm.token", "gpu", "/shared/tp",
        image_root="/var/cache/tp-images", registries_file="/etc/tp/registries.toml",
    )  # fmt: skip

    async def migrated() -> tuple[int, SlurmSettings | None, SlurmSettings | None]:
        store = await Store.open(where)
        try:
            await store.create_fleet("new", "slurm", 2, slurm=made)
            return (
                await store.schema_version(),
                await store.slurm_settings("old"),
                await store.slurm_settings("new"),
            )
        finally:
            await store.close()

    version, old_fleet, new_fleet = asyncio.run(migrated())
    assert version == LATEST_VERSION
    assert old_fleet is not None and new_fleet is not None
    assert (old_fleet.image_root, old_fleet.registries_file) == ("", "")
    assert old_fleet.shared_dir == "/shared/tp"
    assert new_fleet == made
