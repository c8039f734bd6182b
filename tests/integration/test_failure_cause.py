"""A failed Job points at its cause: `tp job show` names the member that failed first with its
exit and its stderr's last lines, `tp logs` defaults to that member, and `tp logs --follow`
keeps going through a coordinator stop and start.

One real coordinator and two real agents (one simulated h200 each) on loopback TLS; a 2-member
custom Job whose member 1 writes to stderr and exits 3 while member 0 waits to be stopped.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.agent.jobs import job, tp, wait_job
from tests.faults.jobs import project, submit
from tests.support.agent import AgentProcess, two_agents, wait_until
from tests.support.coordinator import CoordinatorProcess

pytestmark = pytest.mark.slow

NOISE = 30
FAILING = f"""
if [ "$TUNEPLANE_MEMBER_INDEX" = 1 ]; then
  echo "member 1 reading its data"
  for i in $(seq 1 {NOISE}); do echo "warning $i" >&2; done
  echo "FileNotFoundError: data.csv" >&2
  exit 3
fi
echo "member 0 waiting for its peer"
while true; do sleep 0.1; done
"""


@pytest.fixture(scope="module")
def cluster(
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[tuple[CoordinatorProcess, AgentProcess, AgentProcess]]:
    with two_agents(tmp_path_factory.mktemp("cause"), "h200:1") as cluster:
        yield cluster


def _tp(coord: CoordinatorProcess, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "tuneplane.coordinator.cli.tp", "--context",
         str(coord.context_path), *args],
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip


@pytest.fixture(scope="module")
def failed_job(
    cluster: tuple[CoordinatorProcess, AgentProcess, AgentProcess],
    tmp_path_factory: pytest.TempPathFactory,
) -> tuple[str, dict[str, Any]]:
    coord = cluster[0]
    root = project(coord, tmp_path_factory.mktemp("failing") / "p", "custom/custom",
                   {"train.sh": FAILING})  # fmt: skip
    run_id = submit(coord, root, "h200:2", "--members", "2")
    assert wait_job(coord, run_id, 90)["state"] == "failed"

    # Logs ship apart from reports: wait until the failed member's last stderr line is stored.
    def shown() -> dict[str, Any] | None:
        view = job(coord, run_id)
        failure = view.get("first_failure") or {}
        return view if "FileNotFoundError" in failure.get("stderr_tail", "") else None

    return run_id, wait_until("the failed member's stderr to be stored", shown, 60)


def test_job_show_names_the_member_that_failed_first(
    cluster: tuple[CoordinatorProcess, AgentProcess, AgentProcess],
    failed_job: tuple[str, dict[str, Any]],
) -> None:
    coord = cluster[0]
    run_id, view = failed_job
    failure = view["first_failure"]
    member1 = next(m for m in view["attempts"][0]["members"] if m["index"] == 1)
    member0 = next(m for m in view["attempts"][0]["members"] if m["index"] == 0)
    assert failure["member_index"] == 1 and failure["attempt"] == 1
    assert failure["node_id"] == member1["node_id"]
    assert (failure["has_exit"], failure["exit_code"], failure["signal"]) == (True, 3, 0)
    assert failure["what"] == "member 1 exited with code 3"
    # Its Node's time of the exit, and member 0 (stopped because of it) ended later.
    assert failure["at_ms"] == member1["ended_at_ms"] > 0
    assert member0["ended_at_ms"] == 0 or member0["ended_at_ms"] >= failure["at_ms"]
    lines = [f"warning {i}" for i in range(NOISE - 18, NOISE + 1)] + ["FileNotFoundError: data.csv"]
    assert failure["stderr_tail"].splitlines() == lines and failure["stderr_cut"] is True

    text = tp(coord, "job", "show", run_id)
    assert "\nMember  1 of attempt 1 (it failed first)\n" in text
    assert "\nExit    3 (exited)\nWhy     member 1 exited with code 3\n" in text
    assert f"\nNode    {failure['node_id']} ({member1['node_name']})\n" in text
    assert f"all of it: tp logs {run_id} --member 1 --stderr" in text
    assert "warning 11\n" not in text and "warning 12\n" in text
    assert "warning 30\nFileNotFoundError: data.csv\n" in text


def test_logs_default_to_the_failed_members_stderr(
    cluster: tuple[CoordinatorProcess, AgentProcess, AgentProcess],
    failed_job: tuple[str, dict[str, Any]],
) -> None:
    coord = cluster[0]
    run_id, _ = failed_job
    everything = "".join(f"warning {i}\n" for i in range(1, NOISE + 1))
    everything += "FileNotFoundError: data.csv\n"
    done = _tp(coord, "logs", run_id)
    assert done.returncode == 0, done.stderr
    assert done.stdout == everything
    assert done.stderr.strip().splitlines() == [
        f"tp: Job {run_id} failed; showing the stderr of member 1, which failed first (member 1 "
        "exited with code 3). Choose another with --member and --stdout/--stderr."
    ]
    stdout_of_1 = _tp(coord, "logs", run_id, "--stdout")
    assert stdout_of_1.stdout == "member 1 reading its data\n", stdout_of_1.stderr
    assert "showing the stdout of member 1" in stdout_of_1.stderr
    # An explicit member wins, with today's default stream, and nothing is said about it.
    member0 = _tp(coord, "logs", run_id, "--member", "0")
    assert (member0.returncode, member0.stdout) == (0, "member 0 waiting for its peer\n")
    assert member0.stderr == ""
    assert (
        _tp(coord, "logs", run_id, "--member", "1", "--tail", "1").stdout
        == "member 1 reading its data\n"
    )


def _read(path: Path) -> str:
    return path.read_text(encoding="utf-8") if path.exists() else ""


@pytest.mark.timeout(240)
def test_follow_goes_on_through_a_coordinator_restart(
    cluster: tuple[CoordinatorProcess, AgentProcess, AgentProcess], tmp_path: Path
) -> None:
    coord = cluster[0]
    release = tmp_path / "release"
    script = (
        'for i in 1 2 3 4 5; do echo "line $i"; done\n'
        f"while [ ! -e {release} ]; do sleep 0.1; done\n"
        'for i in 6 7 8 9 10; do echo "line $i"; done\n'
    )
    root = project(coord, tmp_path / "p", "custom/custom", {"train.sh": script})
    run_id = submit(coord, root, "h200:1")
    out, err = tmp_path / "follow.out", tmp_path / "follow.err"
    env = dict(os.environ, TUNEPLANE_CONTEXT=str(coord.context_path))
    with open(out, "wb") as out_file, open(err, "wb") as err_file:
        follower = subprocess.Popen(
            [sys.executable, "-m", "tuneplane.coordinator.cli.tp", "logs", run_id, "--follow",
             "--interval", "0.2"],
            stdout=out_file, stderr=err_file, env=env,
        )  # fmt: skip
    try:
        wait_until("the first lines to be followed", lambda: "line 5\n" in _read(out), 60)
        coord.stop()
        wait_until("tp logs to say it waits", lambda: "Waiting to go on from byte" in _read(err))
        release.touch()  # the rest is written while the coordinator is down
        assert follower.poll() is None, _read(err)
        coord.restart()
        assert follower.wait(timeout=120) == 0, _read(err)
    finally:
        if follower.poll() is None:
            follower.kill()
            follower.wait()
    assert _read(out) == "".join(f"line {i}\n" for i in range(1, 11))
    said = _read(err)
    assert "Waiting to go on from byte 35." in said, said  # 5 lines of 7 bytes
    assert said.count("Waiting to go on") == 1, said
    assert "the coordinator answers again; going on from byte" in said, said
    assert wait_job(coord, run_id, 60)["state"] == "succeeded"


@pytest.mark.timeout(240)
def test_follow_started_during_an_outage_waits_for_the_coordinator(
    cluster: tuple[CoordinatorProcess, AgentProcess, AgentProcess],
    failed_job: tuple[str, dict[str, Any]],
    tmp_path: Path,
) -> None:
    coord = cluster[0]
    run_id, _ = failed_job
    out, err = tmp_path / "follow.out", tmp_path / "follow.err"
    env = dict(os.environ, TUNEPLANE_CONTEXT=str(coord.context_path))
    coord.stop()
    try:
        with open(out, "wb") as out_file, open(err, "wb") as err_file:
            follower = subprocess.Popen(
                [sys.executable, "-m", "tuneplane.coordinator.cli.tp", "logs", run_id,
                 "--follow", "--interval", "0.2"],
                stdout=out_file, stderr=err_file, env=env,
            )  # fmt: skip
        wait_until("tp logs to say it retries", lambda: "Retrying every 0.2 s." in _read(err))
        assert follower.poll() is None and _read(out) == ""
    finally:
        coord.restart()
    try:
        assert follower.wait(timeout=120) == 0, _read(err)
    finally:
        if follower.poll() is None:
            follower.kill()
            follower.wait()
    everything = "".join(f"warning {i}\n" for i in range(1, NOISE + 1))
    assert _read(out) == everything + "FileNotFoundError: data.csv\n"
    said = _read(err)
    assert said.count("Retrying every") == 1 and said.count("showing the stderr of member 1") == 1
