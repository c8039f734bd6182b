"""Prometheus metrics of a real coordinator and a real agent, scraped over HTTP while a real Job
runs and after it ended, read with prometheus_client's own parser.

One coordinator and one agent (two simulated h200) as separate processes on loopback TLS, both
with ``[metrics] port = 0``; the Job reports points with ``tuneplane.report`` and then waits for
a file the test writes, so the scrape sees a member running.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import attrs
import pytest
import yaml

from tests.agent.jobs import job, submit, wait_job
from tests.support.agent import AgentProcess, start_agent
from tests.support.coordinator import CoordinatorProcess, start_coordinator
from tests.support.processes import wait_until
from tests.support.prometheus import Scrape, names_in, scrape

ROOT = Path(__file__).resolve().parents[2]
ALERTS = ROOT / "packaging" / "prometheus" / "tuneplane-alerts.yml"
OPERATOR_DOC = ROOT / "docs" / "operator.md"

METRICS = "[metrics]\nport = 0\n"
POINTS = 20
SCRIPT = f"""python3 - <<'PY'
from tuneplane.report import finish, init, log
init({{"lr": 0.1}})
for step in range({POINTS}):
    log({{"train/loss": 1.0 / (step + 1)}}, step=step)
finish()
PY
while [ ! -e "$TUNEPLANE_OUT_DIR/go" ]; do sleep 0.1; done
"""


@attrs.frozen
class Seen:
    """What the scrapes showed at each point of the scenario."""

    run_id: str
    node_id: str
    coordinator_before: Scrape
    coordinator_running: Scrape
    coordinator_queued: Scrape
    coordinator_after: Scrape
    node_running: Scrape
    node_after: Scrape
    secrets: tuple[str, ...]


def _until(address: str, what: str, check: Callable[[Scrape], bool], timeout: float = 60) -> Scrape:
    def scraped() -> Scrape | None:
        found = scrape(address)
        return found if check(found) else None

    result: Scrape = wait_until(what, scraped, timeout)
    return result


@pytest.fixture(scope="module")
def seen(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Seen]:
    root = tmp_path_factory.mktemp("prometheus")
    with start_coordinator(root, config=METRICS) as coord:
        agent = start_agent(root, coord, "node-a", node_toml=METRICS)
        try:
            yield _scenario(root, coord, agent)
        finally:
            if agent.alive():
                agent.stop()


def _scenario(root: Path, coord: CoordinatorProcess, agent: AgentProcess) -> Seen:
    endpoints = json.loads((coord.state_dir / "endpoints.json").read_text())
    coordinator = str(endpoints["metrics"])
    node = str(agent.wait_connected()["metrics_address"])
    before = _until(
        coordinator,
        "the coordinator to count its connected Node",
        lambda s: s.value("tuneplane_coordinator_nodes", connectivity="connected") == 1,
    )
    run_id = submit(coord, root / "project", SCRIPT)
    node_running = _until(
        node,
        "the Node's metrics to show its member running",
        lambda s: s.value("tuneplane_node_members", state="running") == 1,
    )
    coordinator_running = _until(
        coordinator,
        "the coordinator's metrics to show the Job running",
        lambda s: s.value("tuneplane_coordinator_jobs", state="running") == 1,
    )
    # A second Job wants both GPUs while the first holds one: it waits in the queue.
    second = _submit_more(coord, root / "project", "h200:2")
    queued = _until(
        coordinator,
        "the coordinator's metrics to show the second Job queued",
        lambda s: (
            s.value("tuneplane_coordinator_queue_length") == 1
            and (s.value("tuneplane_coordinator_queue_oldest_age_seconds") or 0) > 0
        ),
    )
    for each in (run_id, second):
        _wait_running(coord, each)
        out_dir = Path(job(coord, each)["attempts"][0]["members"][0]["out_dir"])
        (out_dir / "go").write_text("")
        assert wait_job(coord, each)["state"] == "succeeded"
    # A refused call, to see a code other than OK.
    missing = subprocess.run(
        [sys.executable, "-m", "tuneplane.coordinator.cli.tp", "--context",
         str(coord.context_path), "job", "show", "run-000000000000"],
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert missing.returncode != 0, missing.stdout
    after = _until(
        coordinator,
        "the coordinator to count the Job's points and see it end",
        lambda s: (
            (s.value("tuneplane_coordinator_points_ingested_total") or 0) >= 2 * POINTS
            and s.value("tuneplane_coordinator_jobs", state="running") == 0
        ),
    )
    node_after = _until(
        node,
        "the Node's metrics to show its member exited and its GPUs free",
        lambda s: (
            s.value("tuneplane_node_members", state="exited") == 2
            and s.value("tuneplane_node_gpus", state="free", health="healthy") == 2
            and s.value("tuneplane_node_reports_pending") == 0
        ),
    )
    secrets = (coord.admin_token, agent.control_token())
    return Seen(
        run_id, agent.node_id, before, coordinator_running, queued, after, node_running,
        node_after, secrets,
    )  # fmt: skip


def _wait_running(coord: CoordinatorProcess, run_id: str) -> None:
    wait_until(f"{run_id} to run", lambda: job(coord, run_id)["state"] == "running", 60)


def _submit_more(coord: CoordinatorProcess, project: Path, profile: str) -> str:
    """Submit the project's experiment again, with ``profile``; returns the new run id."""
    done = subprocess.run(
        [sys.executable, "-m", "tuneplane.coordinator.cli.tp", "--context",
         str(coord.context_path), "submit", "job", "--profile", profile, "--yes", "--json"],
        cwd=project, capture_output=True, text=True, timeout=60, check=True,
    )  # fmt: skip
    return str(json.loads(done.stdout.strip().splitlines()[-1])["run_id"])


@pytest.mark.timeout(240)
def test_coordinator_metrics_move_with_a_real_job(seen: Seen) -> None:
    before, running, after = (
        seen.coordinator_before,
        seen.coordinator_running,
        seen.coordinator_after,
    )
    admitted = "tuneplane_coordinator_admissions_total"
    assert before.value(admitted, outcome="admitted") == 0
    assert after.value(admitted, outcome="admitted") == 2
    assert after.value(admitted, outcome="refused") == 0
    assert running.value("tuneplane_coordinator_jobs", state="running") == 1
    queued = seen.coordinator_queued
    assert queued.value("tuneplane_coordinator_jobs", state="queued") == 1
    assert queued.value("tuneplane_coordinator_queue_length") == 1
    assert 0 < (queued.value("tuneplane_coordinator_queue_oldest_age_seconds") or 0) < 120
    assert after.value("tuneplane_coordinator_jobs", state="unknown") == 0
    assert after.value("tuneplane_coordinator_queue_length") == 0
    assert after.value("tuneplane_coordinator_queue_oldest_age_seconds") == 0
    assert after.value("tuneplane_coordinator_nodes", connectivity="connected") == 1
    assert after.value("tuneplane_coordinator_node_disconnected_longest_seconds") == 0
    passes = after.value("tuneplane_coordinator_scheduling_pass_seconds_count")
    assert passes is not None and passes > (
        before.value("tuneplane_coordinator_scheduling_pass_seconds_count") or 0
    )
    rpc = "tuneplane_coordinator_rpc_duration_seconds_count"
    assert after.value(rpc, method="Api/Commit", code="OK") == 2
    assert (after.value(rpc, method="Api/GetJob", code="OK") or 0) >= 1
    assert (after.value(rpc, method="Api/GetJob", code="NOT_FOUND") or 0) >= 1
    assert (after.value(rpc, method="Telemetry/Ship", code="OK") or 0) >= 1
    ingested = after.value("tuneplane_coordinator_points_ingested_total")
    assert ingested is not None and ingested >= POINTS
    assert after.value("tuneplane_coordinator_points_refused_total") == 0
    # The process metrics every Prometheus client exposes are there too.
    assert (after.value("process_resident_memory_bytes") or 0) > 0


@pytest.mark.timeout(240)
def test_node_metrics_move_with_a_real_job(seen: Seen) -> None:
    running, after = seen.node_running, seen.node_after
    assert running.value("tuneplane_node_gpus", state="owned", health="healthy") == 1
    assert running.value("tuneplane_node_gpus", state="free", health="healthy") == 1
    assert after.value("tuneplane_node_members", state="running") == 0
    assert after.value("tuneplane_node_connected") == 1
    assert after.value("tuneplane_node_reconnects_total") == 0
    expiry = after.value("tuneplane_node_credential_expiry_timestamp_seconds")
    assert expiry is not None and expiry > time.time()
    commits = after.value("tuneplane_node_journal_commit_seconds_count")
    assert commits is not None and commits > (
        running.value("tuneplane_node_journal_commit_seconds_count") or 0
    )
    assert (after.value("tuneplane_node_heartbeat_rtt_seconds_count") or 0) >= 1
    assert after.value("tuneplane_node_collector_data_loss_warnings") == 0
    assert after.value("tuneplane_node_collector_spool_points") is not None
    assert (after.value("tuneplane_node_snapshot_timestamp_seconds") or 0) > time.time() - 60


@pytest.mark.timeout(240)
def test_no_identifier_or_credential_is_exposed(seen: Seen) -> None:
    """Labels are bounded: no run id or Node id; and no credential is ever in a scrape."""
    for found in (seen.coordinator_after, seen.coordinator_running, seen.node_running):
        for secret in (seen.run_id, seen.node_id, *seen.secrets):
            assert secret not in found.text


@pytest.mark.timeout(240)
def test_example_alert_rules_name_only_metrics_a_real_scrape_exposes(seen: Seen) -> None:
    rules = yaml.safe_load(ALERTS.read_text())
    exprs = [r["expr"] for group in rules["groups"] for r in group["rules"]]
    alerts = {r["alert"] for group in rules["groups"] for r in group["rules"]}
    assert len(alerts) == len(exprs)
    exposed = seen.coordinator_after.names() | seen.node_after.names()
    named = names_in(exprs)
    assert named, "the example rules name no TunePlane metric"
    assert named <= exposed, f"rules name metrics nobody exposes: {sorted(named - exposed)}"
    # The four situations the operator guide promises rules for.
    wanted = {
        "tuneplane_coordinator_node_disconnected_longest_seconds",
        "tuneplane_node_collector_spool_points",
        "tuneplane_node_credential_expiry_timestamp_seconds",
        "tuneplane_coordinator_jobs",
    }
    assert wanted <= named
    assert any('state="unknown"' in e for e in exprs)
    for group in rules["groups"]:
        for rule in group["rules"]:
            assert rule["annotations"]["summary"] and rule["annotations"]["description"]


@pytest.mark.timeout(240)
def test_operator_guide_lists_every_tuneplane_metric(seen: Seen) -> None:
    doc = OPERATOR_DOC.read_text()
    section = doc[doc.index("## Metrics") :]
    section = section[: m.start()] if (m := re.search(r"\n## (?!Metrics)", section)) else section
    exposed = {f for s in (seen.coordinator_after, seen.node_after) for f in s.families}
    ours = {f for f in exposed if f.startswith("tuneplane_")}
    listed = {_family(n) for n in names_in([section])}
    missing = ours - listed
    assert not missing, f"docs/operator.md (Metrics) does not list {sorted(missing)}"
    stale = listed - exposed
    assert not stale, f"docs/operator.md (Metrics) lists metrics nobody exposes: {sorted(stale)}"


def _family(name: str) -> str:
    """A sample name's family: without ``_total`` (counters), ``_bucket``/``_count``/``_sum``."""
    for suffix in ("_total", "_bucket", "_count", "_sum"):
        if name.endswith(suffix):
            return name.removesuffix(suffix)
    return name


@pytest.mark.timeout(240)
def test_a_silent_node_shows_as_disconnected_with_its_job_unknown_then_recovers(
    tmp_path: Path,
) -> None:
    """What the example alerts read: the Node's disconnection, its Job ``unknown``, and the
    agent's reconnect, through a real cut (the agent stopped with SIGSTOP past the timeout)."""
    with start_coordinator(tmp_path, config=METRICS) as coord:
        agent = start_agent(tmp_path, coord, "node-a", node_toml=METRICS)
        release = tmp_path / "release"
        try:
            node = str(agent.wait_connected()["metrics_address"])
            coordinator = str(
                json.loads((coord.state_dir / "endpoints.json").read_text())["metrics"]
            )
            run_id = submit(
                coord, tmp_path / "project", f'while [ ! -e "{release}" ]; do sleep 0.1; done\n'
            )
            _until(
                node,
                "the member to run",
                lambda s: s.value("tuneplane_node_members", state="running") == 1,
            )
            os.kill(agent.pid, signal.SIGSTOP)
            try:
                cut = _until(
                    coordinator,
                    "the Job to be unknown and its Node disconnected",
                    lambda s: (
                        s.value("tuneplane_coordinator_jobs", state="unknown") == 1
                        and s.value("tuneplane_coordinator_nodes", connectivity="disconnected") == 1
                        and (
                            s.value("tuneplane_coordinator_node_disconnected_longest_seconds") or 0
                        )
                        > 0
                    ),
                )
            finally:
                os.kill(agent.pid, signal.SIGCONT)
            assert cut.value("tuneplane_coordinator_jobs", state="running") == 0
            back = _until(
                node,
                "the agent to reconnect",
                lambda s: (
                    (s.value("tuneplane_node_reconnects_total") or 0) >= 1
                    and s.value("tuneplane_node_connected") == 1
                ),
            )
            assert back.value("tuneplane_node_members", state="running") == 1
            release.write_text("go")
            assert wait_job(coord, run_id)["state"] == "succeeded"
            healed = _until(
                coordinator,
                "the Node connected again and nothing unknown",
                lambda s: (
                    s.value("tuneplane_coordinator_jobs", state="unknown") == 0
                    and s.value("tuneplane_coordinator_nodes", connectivity="connected") == 1
                    and s.value("tuneplane_coordinator_node_disconnected_longest_seconds") == 0
                ),
            )
            # The cut control stream ended, and was observed when it did.
            ended = [
                s
                for s in healed.samples
                if s.name == "tuneplane_coordinator_rpc_duration_seconds_count"
                and s.labels["method"] == "Control/Connect"
            ]
            assert sum(s.value for s in ended) >= 1
        finally:
            release.write_text("go")
            agent.stop()
