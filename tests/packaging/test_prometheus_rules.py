"""The example alert rules, checked by Prometheus's own promtool (no Prometheus server needed).

``promtool check rules`` loads the file as Prometheus would (PromQL, templates, durations);
``promtool test rules`` evaluates each rule over synthetic series and checks that it fires on
the situation it is named for and stays quiet on a healthy Node or coordinator. The annotations
are left out of the copy under test (promtool compares them word for word; their templates are
checked by ``check rules``). promtool comes with Debian's prometheus package; without it the
tests skip with a sentence (under CI=true they fail: the noxfile's tests session installs it).
Which metrics the rules name is checked against real scrapes in
tests/integration/test_prometheus_metrics.py.
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path
from typing import Any

import yaml

from tests.support.accounts import require

RULES = Path(__file__).resolve().parents[2] / "packaging" / "prometheus" / "tuneplane-alerts.yml"
DAY = 86400


def _promtool() -> str:
    found = shutil.which("promtool")
    require(found is not None, "promtool (Debian's prometheus package)")
    assert found is not None
    return found


def test_promtool_accepts_the_example_rules() -> None:
    done = subprocess.run(
        [_promtool(), "check", "rules", str(RULES)],
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    assert "SUCCESS: 7 rules found" in done.stdout


def _alert(name: str, at: str, *fired: dict[str, str]) -> dict[str, Any]:
    return {
        "eval_time": at,
        "alertname": name,
        "exp_alerts": [{"exp_labels": labels} for labels in fired],
    }


def _series(name: str, values: str) -> dict[str, str]:
    return {"series": name, "values": values}


# Each situation: the series (sampled every minute from time 0) and what each rule says when.
TESTS: list[dict[str, Any]] = [
    {
        "interval": "1m",
        "input_series": [
            # The longest disconnection grows from minute 2 on: 60 s a minute.
            _series("tuneplane_coordinator_node_disconnected_longest_seconds", "0 0 60+60x10"),
        ],
        "alert_rule_test": [
            _alert("TunePlaneNodeDisconnected", "6m"),  # 300 s: not yet
            _alert("TunePlaneNodeDisconnected", "8m", {"severity": "warning"}),
        ],
    },
    {
        "interval": "1m",
        "input_series": [
            _series('tuneplane_node_connected{instance="n1"}', "0x10"),
            _series('tuneplane_node_connected{instance="n2"}', "1x10"),
        ],
        "alert_rule_test": [
            _alert("TunePlaneAgentNotConnected", "3m"),
            _alert("TunePlaneAgentNotConnected", "6m", {"severity": "warning", "instance": "n1"}),
        ],
    },
    {
        "interval": "1m",
        "input_series": [
            # n1 holds 500 points and never ships; n2 ships every other minute; n3 drains a
            # large backlog slowly (never empty, but shrinking); n4 is idle.
            _series('tuneplane_node_collector_spool_points{instance="n1"}', "500x40"),
            _series(
                'tuneplane_node_collector_spool_points{instance="n2"}', " ".join(["0 300"] * 20)
            ),
            _series('tuneplane_node_collector_spool_points{instance="n3"}', "4000-50x40"),
            _series('tuneplane_node_collector_spool_points{instance="n4"}', "0x40"),
        ],
        "alert_rule_test": [
            _alert("TunePlaneCollectorSpoolStuck", "10m"),
            _alert(
                "TunePlaneCollectorSpoolStuck", "20m", {"severity": "warning", "instance": "n1"}
            ),
        ],
    },
    {
        "interval": "1m",
        "input_series": [
            _series('tuneplane_node_collector_data_loss_warnings{instance="n1"}', "0 0 0 2x10"),
            _series('tuneplane_node_collector_data_loss_warnings{instance="n2"}', "0x12"),
        ],
        "alert_rule_test": [
            _alert("TunePlaneTelemetryDataLoss", "2m"),
            _alert("TunePlaneTelemetryDataLoss", "5m", {"severity": "info", "instance": "n1"}),
        ],
    },
    {
        "interval": "1m",
        "input_series": [
            # time() is the evaluation time: seconds since the test's epoch 0.
            _series(
                'tuneplane_node_credential_expiry_timestamp_seconds{instance="n1"}',
                f"{2 * DAY}x10",
            ),
            _series(
                'tuneplane_node_credential_expiry_timestamp_seconds{instance="n2"}',
                f"{30 * DAY}x10",
            ),
            # Not stated yet (0): no alert, though 0 - time() is below any threshold.
            _series('tuneplane_node_credential_expiry_timestamp_seconds{instance="n3"}', "0x10"),
        ],
        "alert_rule_test": [
            _alert("TunePlaneCredentialExpiring", "5m", {"severity": "critical", "instance": "n1"}),
        ],
    },
    {
        "interval": "1m",
        "input_series": [
            _series('tuneplane_coordinator_jobs{state="unknown"}', "0 0 1x20"),
            _series('tuneplane_coordinator_jobs{state="running"}', "3x22"),
        ],
        "alert_rule_test": [
            _alert("TunePlaneJobUnknown", "8m"),  # unknown for 6 minutes: not yet
            _alert("TunePlaneJobUnknown", "15m", {"severity": "warning", "state": "unknown"}),
        ],
    },
    {
        "interval": "1m",
        "input_series": [
            _series('tuneplane_node_reports_pending{instance="n1"}', "2x30"),
            _series('tuneplane_node_reports_pending{instance="n2"}', " ".join(["1 0"] * 15)),
        ],
        "alert_rule_test": [
            _alert("TunePlaneReportsPending", "20m", {"severity": "info", "instance": "n1"}),
        ],
    },
]


def test_each_rule_fires_on_its_situation_and_not_on_a_healthy_fleet(tmp_path: Path) -> None:
    promtool = _promtool()
    rules = yaml.safe_load(RULES.read_text())
    for group in rules["groups"]:
        for rule in group["rules"]:
            rule.pop("annotations")
    tested = {t["alertname"] for case in TESTS for t in case["alert_rule_test"]}
    assert tested == {r["alert"] for g in rules["groups"] for r in g["rules"]}
    (tmp_path / "rules.yml").write_text(yaml.safe_dump(rules))
    (tmp_path / "tests.yml").write_text(
        yaml.safe_dump({"rule_files": ["rules.yml"], "evaluation_interval": "1m", "tests": TESTS})
    )
    done = subprocess.run(
        [promtool, "test", "rules", "tests.yml"],
        cwd=tmp_path, capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    assert "SUCCESS" in done.stdout
