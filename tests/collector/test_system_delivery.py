"""A hung or failing NVML never holds up a collector, tried with real parts: a real coordinator,
the real ``tuneplane-collector run`` process on the scripted NVML, a real process tree.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.collector.delivery import (
    CollectorProcess,
    launch_member,
    standing_runner,
    stored_points,
    write_jsonl,
)
from tests.support.coordinator import CoordinatorProcess, start_coordinator
from tests.support.processes import wait_until
from tuneplane.agent.scripted_nvml import write_script

UUID = "GPU-8d8d8d8d-1111-2222-3333-444444444444"


@pytest.fixture(scope="module")
def coord(tmp_path_factory: pytest.TempPathFactory) -> Iterator[CoordinatorProcess]:
    with start_coordinator(tmp_path_factory.mktemp("system-delivery")) as c:
        yield c


@pytest.fixture
def runner(tmp_path: Path) -> Iterator[Path]:
    with standing_runner(tmp_path) as member_dir:
        yield member_dir


@pytest.mark.parametrize("trouble", ["hang", "error"])
def test_nvml_trouble_costs_only_the_gpu_values(
    coord: CoordinatorProcess, tmp_path: Path, runner: Path, trouble: str
) -> None:
    launched = launch_member(coord, f"nvml-{trouble}")
    script = tmp_path / "nvml.json"
    card = {"uuid": UUID, "metrics": {"utilization_gpu": 61}}
    if trouble == "hang":
        # Every utilisation read blocks, for as long as the collector runs.
        card["hang"] = ["nvmlDeviceGetUtilizationRates"]
    else:
        card["errors"] = {"nvmlDeviceGetUtilizationRates": "UNKNOWN"}
    write_script(script, {"gpus": [card]})
    telemetry = tmp_path / "telemetry"
    write_jsonl(telemetry / "metrics.jsonl", 0, 50)
    collector = CollectorProcess(
        coord, launched, telemetry, tmp_path / "state",
        "--system-interval", "0.1", "--member-dir", str(runner), "--gpu", UUID,
        "--scripted-nvml", str(script),
    )  # fmt: skip
    collector.start()

    def tags() -> list[str]:
        return [t for _, t, _, _ in stored_points(coord, launched.run_id)]

    wait_until("process samples to be stored", lambda: tags().count("system/rss_bytes") >= 5)
    write_jsonl(telemetry / "metrics.jsonl", 50, 50)
    wait_until("the file's points", lambda: tags().count("train/loss") == 100)
    started = time.monotonic()
    collector.member_exited()
    assert collector.wait(timeout=30) == 0, collector.read_log()
    assert time.monotonic() - started < 15
    assert (tmp_path / "state" / "drained").exists()

    found = tags()
    assert found.count("train/loss") == 100
    assert "system/gpu0/utilization" not in found
    log = collector.read_log()
    if trouble == "hang":
        # The first read past the limit is abandoned; no later read piles up behind it.
        assert log.count("NVML did not answer within") == 1, log
        assert "system/gpu0/power_w" not in found
    else:
        # The other readings of the card still arrive; the failure is logged once.
        assert "system/gpu0/power_w" in found
        assert log.count("reading=utilization error=") == 1, log
