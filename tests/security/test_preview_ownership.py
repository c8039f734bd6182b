"""A preview and a retry key belong to the user who made them, tried against a real coordinator
over loopback TLS with two real user tokens.

bob learns alice's preview id and digest (they are printed, and a preview file may be shared by
mistake) and tries to commit it: that would run alice's code as bob and let him read its output.
He also replays alice's retry key, hoping for her receipt. Both are refused, and nothing changes:
the Jobs table holds only what alice admitted, and her own repeat still gets her receipt.
"""

from __future__ import annotations

import asyncio
import sqlite3
from contextlib import closing
from pathlib import Path

import pytest
from grpclib.const import Status
from grpclib.exceptions import GRPCError

from tests.coordinator.grpc_client import api_client, jobspec
from tests.support.coordinator import CoordinatorProcess, start_coordinator


def _jobs(coord: CoordinatorProcess) -> list[tuple[str, str, str]]:
    path = coord.state_dir / "coordinator.db"
    with closing(sqlite3.connect(f"file:{path}?mode=ro", uri=True)) as db:
        return [
            (str(r[0]), str(r[1]), str(r[2]))
            for r in db.execute("SELECT run_id, owner, retry_key FROM jobs ORDER BY run_id")
        ]


def test_another_users_preview_and_retry_key_are_refused(tmp_path: Path) -> None:
    with start_coordinator(tmp_path) as coord:
        alice, bob = coord.create_user("alice"), coord.create_user("bob")

        async def go() -> None:
            async with (
                api_client(coord.api, coord.ca_path, alice) as as_alice,
                api_client(coord.api, coord.ca_path, bob) as as_bob,
            ):
                preview = await as_alice.preview(jobspec(gpus=1))
                receipt = await as_alice.commit(preview, "alice-key-1")
                before = _jobs(coord)
                assert before == [(receipt.run_id, "alice", "alice-key-1")]

                # bob commits alice's preview, with its real id and digest.
                with pytest.raises(GRPCError) as stolen:
                    await as_bob.commit(preview, "bob-key-1")
                assert stolen.value.status is Status.NOT_FOUND
                assert preview.preview_id in (stolen.value.message or "")
                assert _jobs(coord) == before

                # bob replays alice's retry key with a preview of his own.
                mine = await as_bob.preview(jobspec(gpus=1))
                with pytest.raises(GRPCError) as replayed:
                    await as_bob.commit(mine, "alice-key-1")
                assert replayed.value.status is Status.FAILED_PRECONDITION
                message = replayed.value.message or ""
                assert "already in use" in message
                assert receipt.run_id not in message
                assert _jobs(coord) == before

                # ... and with alice's own preview: still no receipt of hers.
                with pytest.raises(GRPCError) as both:
                    await as_bob.commit(preview, "alice-key-1")
                assert receipt.run_id not in (both.value.message or "")
                assert _jobs(coord) == before

                # alice's repeat is unharmed: the same receipt, still one Job.
                again = await as_alice.commit(preview, "alice-key-1")
                assert again.run_id == receipt.run_id
                assert _jobs(coord) == before

                # bob's own preview admits normally under his own key.
                his = await as_bob.commit(mine, "bob-key-2")
                assert (his.run_id, "bob", "bob-key-2") in _jobs(coord)

        asyncio.run(asyncio.wait_for(go(), 60))
