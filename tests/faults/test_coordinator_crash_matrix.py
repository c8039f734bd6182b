"""A coordinator crash point crossed with an agent crash point: each pair ends with the Job done
exactly once.

Both processes are armed from their first start (``TUNEPLANE_CRASHPOINT``); a Job runs into both
points in whatever order they come, and each process is started again unarmed as soon as it died.
Every pair must end with the Job succeeded, its member started exactly once (its output and the
Node's journal), its one metric stored exactly once, and no GPU held by anyone. On SQLite only:
twelve real crash-and-restart scenarios take minutes; tests/faults/test_coordinator_crash.py checks
each coordinator point on its own, in more detail, on both backends.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.faults.coordinator_crashes import (
    armed,
    delivered_once,
    queue_job,
    ran_once,
    revive_after_both,
)
from tests.support.agent import start_agent
from tests.support.coordinator import start_coordinator

pytestmark = [pytest.mark.slow, pytest.mark.timeout(180)]

COORDINATOR_POINTS = (
    "after-reservation-written",
    "after-commit-decided",
    "after-report-applied",
    "mid-telemetry-ingest",
)
AGENT_POINTS = ("after-prepare-journaled", "after-commit-journaled", "after-report-sent")


@pytest.mark.parametrize("agent_point", AGENT_POINTS)
@pytest.mark.parametrize("coordinator_point", COORDINATOR_POINTS)
def test_a_job_survives_a_crash_of_each_side_and_runs_exactly_once(
    tmp_path: Path, coordinator_point: str, agent_point: str
) -> None:
    with start_coordinator(tmp_path, env=armed(coordinator_point)) as coord:
        run_id = queue_job(coord, tmp_path / "proj")
        agent = start_agent(tmp_path, coord, env=armed(agent_point))
        try:
            revive_after_both(coord, agent, coordinator_point, agent_point)
            ran_once(coord, [agent], run_id)
            delivered_once(coord, run_id, {"loss": 1})
        finally:
            agent.stop()
