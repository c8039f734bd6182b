"""A Fleet of kind slurm in the store (SQLite and PostgreSQL): its settings are written with the
Fleet in one transaction and read back; a slurm Fleet without settings, or settings on another
kind, never reach the database."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from tests.support.store_backend import current
from tuneplane.coordinator.store.base import Conflict
from tuneplane.coordinator.store.core import Store
from tuneplane.coordinator.values.fleet import SlurmSettings

SETTINGS = SlurmSettings("http://slurm.example:6820", "/srv/tp/slurm.token", "gpu")

pytestmark = pytest.mark.timeout(60)


def test_slurm_settings_are_stored_with_the_fleet(tmp_path: Path) -> None:
    async def go() -> tuple[SlurmSettings | None, SlurmSettings | None, list[str]]:
        store = await Store.open(current().where(tmp_path / "coordinator.db"))
        try:
            await store.create_fleet("hpc", "slurm", 1, slurm=SETTINGS)
            await store.create_fleet("boxes", "node", 2)
            with pytest.raises(Conflict, match="already exists"):
                await store.create_fleet("hpc", "slurm", 3, slurm=SETTINGS)
            return (
                await store.slurm_settings("hpc"),
                await store.slurm_settings("boxes"),
                await store.fleet_names(),
            )
        finally:
            await store.close()

    hpc, boxes, names = asyncio.run(go())
    assert hpc == SETTINGS and boxes is None and names == ["boxes", "hpc"]


@pytest.mark.parametrize(
    ("kind", "slurm", "says"),
    [("slurm", None, "needs Slurm settings"), ("node", SETTINGS, "takes no Slurm settings")],
)
def test_kind_and_settings_must_agree(
    tmp_path: Path, kind: str, slurm: SlurmSettings | None, says: str
) -> None:
    async def go() -> list[str]:
        store = await Store.open(current().where(tmp_path / "coordinator.db"))
        try:
            with pytest.raises(ValueError, match=says):
                await store.create_fleet("x", kind, 1, slurm=slurm)
            return await store.fleet_names()
        finally:
            await store.close()

    assert "x" not in asyncio.run(go())
