"""Every accepted setting has an effect or is refused: ``tp job ls --limit`` and the retired
Series keys of ``coordinator.toml``."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest
from grpclib import GRPCError
from grpclib.const import Status

from tests.cli.tp_process import run_tp, run_tp_as
from tests.coordinator.grpc_client import api_client, jobspec
from tests.support.coordinator import start_coordinator
from tuneplane.coordinator.config import DEFAULT_CONFIG, parse_config
from tuneplane.coordinator.values.jobs import JOB_LIST_DEFAULT, JOB_LIST_MAX
from tuneplane.proto import v1

pytestmark = pytest.mark.timeout(120)


@pytest.mark.parametrize("limit", ["0", "-1", str(JOB_LIST_MAX + 1)])
def test_job_ls_refuses_a_limit_it_cannot_honour(tmp_path: Path, limit: str) -> None:
    # Refused before any connection: no context is configured here at all.
    done = run_tp("job", "ls", "--limit", limit, cwd=tmp_path)
    assert done.returncode == 2, done
    assert f"give 1 to {JOB_LIST_MAX}" in done.stderr
    assert "0 does not mean all" in done.stderr


def test_job_ls_lists_the_default_then_more_on_request_and_says_when_it_may_be_cut(
    tmp_path: Path,
) -> None:
    total = JOB_LIST_DEFAULT + 1
    with start_coordinator(tmp_path) as coord:

        async def submit_all() -> list[str]:
            async with api_client(coord.api, coord.ca_path, coord.admin_token) as api:
                return [
                    (await api.submit(jobspec(gpus=1), f"limit-{n}")).run_id for n in range(total)
                ]

        run_ids = asyncio.run(submit_all())

        def listed(*args: str) -> tuple[list[str], str]:
            done = run_tp_as(coord, None, "job", "ls", "--json", *args)
            assert done.returncode == 0, done
            return [job["run_id"] for job in json.loads(done.stdout)], done.stderr

        shown, said = listed()
        assert len(shown) == JOB_LIST_DEFAULT and set(shown) < set(run_ids)
        assert f"Showing the newest {JOB_LIST_DEFAULT} Jobs; there may be more" in said
        assert f"raise --limit (at most {JOB_LIST_MAX})" in said

        shown, said = listed("--limit", "2")
        assert len(shown) == 2 and "Showing the newest 2 Jobs" in said

        shown, said = listed("--limit", str(total + 1))
        assert sorted(shown) == sorted(run_ids)
        assert "there may be more" not in said


# coordinator.toml: Series keys placement never read are retired, loudly.


def test_a_fresh_config_no_longer_has_the_retired_series_keys(tmp_path: Path) -> None:
    config = parse_config(DEFAULT_CONFIG, tmp_path / "coordinator.toml")
    assert config.warnings == ()
    assert "card_memory_gib" not in DEFAULT_CONFIG and "scheduling_pin" not in DEFAULT_CONFIG


def test_a_config_with_retired_series_keys_serves_and_warns_naming_them(tmp_path: Path) -> None:
    old = '[series.a100]\ncard_memory_gib = 80\nscheduling_pin = "a100"\ncards = 0\n'
    old += "accelerator = true\n"
    with start_coordinator(tmp_path, config="\n" + old) as coord:
        # Serving proves the config loaded; the log names each key and its table.
        logged = coord.read_log()
    for key in ("card_memory_gib", "scheduling_pin"):
        assert f"[series.a100] {key} is no longer used and is ignored" in logged, logged
    assert "Delete the line to silence this warning" in logged


def test_list_jobs_refuses_a_limit_over_the_most_and_keeps_serving(tmp_path: Path) -> None:
    with start_coordinator(tmp_path) as coord:

        async def scenario() -> tuple[GRPCError, int]:
            async with api_client(coord.api, coord.ca_path, coord.admin_token) as api:
                await api.submit(jobspec(gpus=1), "limit-api")
                with pytest.raises(GRPCError) as refused:
                    await api.stub.list_jobs(v1.ListJobsRequest(limit=JOB_LIST_MAX + 1))
                served = await api.stub.list_jobs(v1.ListJobsRequest(limit=JOB_LIST_MAX))
                return refused.value, len(served.jobs)

        refused, served = asyncio.run(scenario())
    assert refused.status == Status.INVALID_ARGUMENT
    assert refused.message == (
        f"ListJobsRequest.limit is {JOB_LIST_MAX + 1}, over the {JOB_LIST_MAX} Jobs one call "
        f"returns. Ask for at most {JOB_LIST_MAX}, or 0 for the default of {JOB_LIST_DEFAULT}, "
        "and narrow the list by project, state or mine."
    )
    assert served == 1
