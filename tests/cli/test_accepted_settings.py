"""Every setting ``tp`` accepts has an effect or is refused: ``tp job ls --limit``."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest

from tests.cli.tp_process import run_tp, run_tp_as
from tests.coordinator.grpc_client import api_client, jobspec
from tests.support.coordinator import start_coordinator
from tuneplane.coordinator.apimodel import JOB_LIST_MAX

pytestmark = pytest.mark.timeout(120)


@pytest.mark.parametrize("limit", ["0", "-1", str(JOB_LIST_MAX + 1)])
def test_job_ls_refuses_a_limit_it_cannot_honour(tmp_path: Path, limit: str) -> None:
    # Refused before any connection: no context is configured here at all.
    done = run_tp("job", "ls", "--limit", limit, cwd=tmp_path)
    assert done.returncode == 2, done
    assert f"give 1 to {JOB_LIST_MAX}" in done.stderr
    assert "0 does not mean all" in done.stderr


def test_job_ls_limit_returns_that_many_and_says_there_may_be_more(tmp_path: Path) -> None:
    with start_coordinator(tmp_path) as coord:

        async def submit_three() -> list[str]:
            async with api_client(coord.api, coord.ca_path, coord.admin_token) as api:
                return [(await api.submit(jobspec(gpus=1), f"limit-{n}")).run_id for n in range(3)]

        run_ids = asyncio.run(submit_three())

        two = run_tp_as(coord, None, "job", "ls", "--limit", "2", "--json")
        assert two.returncode == 0, two
        listed = [job["run_id"] for job in json.loads(two.stdout)]
        assert len(listed) == 2 and set(listed) <= set(run_ids)
        assert "Showing the newest 2 Jobs; there may be more" in two.stderr

        five = run_tp_as(coord, None, "job", "ls", "--limit", "5", "--json")
        assert five.returncode == 0, five
        assert sorted(job["run_id"] for job in json.loads(five.stdout)) == sorted(run_ids)
        assert "there may be more" not in five.stderr
