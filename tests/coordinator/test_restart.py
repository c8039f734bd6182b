"""Durability across a crash: the same confirmation after ``kill -9`` returns the same receipt."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

from tests.coordinator.grpc_client import api_client, jobspec
from tests.support.coordinator import start_coordinator
from tuneplane.proto import v1


def test_the_same_receipt_after_kill_and_restart(tmp_path: Path) -> None:
    with start_coordinator(tmp_path) as coord:
        old_ports = coord.ports()

        async def first() -> tuple[v1.PreviewReply, v1.Receipt]:
            async with api_client(coord.api, coord.ca_path, coord.admin_token) as api:
                preview = await api.preview(jobspec(project="crash"))
                return preview, await api.commit(preview, "key-crash")

        preview, receipt = asyncio.run(first())
        coord.kill()
        coord.restart()
        assert coord.ports() == old_ports
        assert json.loads((coord.state_dir / "endpoints.json").read_text())["pid"] == coord.pid

        async def again() -> tuple[v1.Receipt, v1.ListJobsReply]:
            async with api_client(coord.api, coord.ca_path, coord.admin_token) as api:
                repeat = await api.commit(preview, "key-crash")
                jobs = await api.stub.list_jobs(v1.ListJobsRequest(project="crash"))
                return repeat, jobs

        repeat, jobs = asyncio.run(again())
        assert not repeat.created
        assert (repeat.run_id, repeat.admitted_at_ms) == (receipt.run_id, receipt.admitted_at_ms)
        assert [j.run_id for j in jobs.jobs] == [receipt.run_id]


def test_sigterm_stops_the_coordinator_cleanly(tmp_path: Path) -> None:
    coord = start_coordinator(tmp_path)
    coord.stop()  # asserts exit status 0
    assert not (coord.state_dir / "endpoints.json").exists()
    assert "coordinator stopped" in coord.read_log()
