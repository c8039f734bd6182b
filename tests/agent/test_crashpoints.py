"""Named crash points: SIGKILL-equivalent exits at each point, then a restart that must start
the member exactly once and still report its exit."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.agent.jobs import journal, submit, wait_job
from tests.support.agent import start_agent
from tests.support.coordinator import CoordinatorProcess, start_coordinator

pytestmark = pytest.mark.slow


@pytest.fixture
def coordinator(tmp_path: Path) -> Iterator[CoordinatorProcess]:
    with start_coordinator(tmp_path) as coord:
        yield coord


@pytest.mark.parametrize(
    "point",
    [
        "after-prepare-journaled",
        "after-commit-journaled",
        "after-spawn",
        "after-exit-observed",
        "after-report-sent",
    ],
)
def test_a_crash_at_a_named_point_starts_the_member_exactly_once(
    coordinator: CoordinatorProcess, tmp_path: Path, point: str
) -> None:
    agent = start_agent(tmp_path, coordinator, env={"TUNEPLANE_CRASHPOINT": point})
    agent.wait_connected()
    script = 'echo started >> "$TUNEPLANE_OUT_DIR/starts"\nsleep 1\n'
    run_id = submit(coordinator, tmp_path / "proj", script)
    assert agent.wait_exit(30) == 137
    assert f"point={point}" in agent.read_log()
    try:
        agent.restart()
        done = wait_job(coordinator, run_id)
        assert done["state"] == "succeeded", done
        (member,) = done["attempts"][0]["members"]
        assert (Path(member["out_dir"]) / "starts").read_text() == "started\n"
        # Not killed: the workload's own exit code 0, no signal, on both sides.
        assert member["has_exit"] and member["exit_code"] == 0 and not member["signal"]
        (record,) = journal(agent, "members", "--json")
        assert record["exit_code"] == 0 and record["signal"] is None
        key = f"{run_id}.1.0"
        kinds = [e["kind"] for e in journal(agent, "events", "--member", key, "--json")]
        assert kinds.count("spawn-requested") == 1 and kinds[-1] == "exit-observed"
    finally:
        agent.stop()
