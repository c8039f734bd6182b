"""The system sampler against the scripted NVML and real processes: values, NVML failures, keys.

The GPU reader reads a real ScriptedNvml file (agent/scripted_nvml.py) that the tests rewrite
between reads; the process reader reads a real process tree named by a real ``runner.json``.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest
import trio

from tuneplane.agent.nvml_source import load_nvml
from tuneplane.agent.scripted_nvml import write_script
from tuneplane.collector.gpu_reader import GpuReader
from tuneplane.collector.point_rules import REFUSED_KIND, PointScreen
from tuneplane.collector.points import ScalarPoint
from tuneplane.collector.process_reader import ProcessReader
from tuneplane.collector.system_sampler import SystemOptions, SystemSampling
from tuneplane.collector.system_samples import (
    GPU_SERIES,
    PROCESS_SERIES,
    Reading,
    SampleNumbers,
    gpu_reading,
    process_reading,
    sample_points,
)
from tuneplane.runner.durable import write_json_atomic
from tuneplane.runner.records import RUNNER_FILE

UUID_A = "GPU-aaaaaaaa-1111-2222-3333-444444444444"
UUID_B = "GPU-bbbbbbbb-1111-2222-3333-444444444444"
NOW = 1_750_000_000.0


def card(uuid: str, **metrics: Any) -> dict[str, Any]:
    values = {
        "utilization_gpu": 87, "utilization_memory": 41, "memory_used": 3 * 2**30,
        "power_mw": 312_500, "temperature_c": 64, "sm_clock_mhz": 1980,
        "clocks_event_reasons": 4, **metrics,
    }  # fmt: skip
    return {"uuid": uuid, "ecc_uncorrected": 2, "ecc_corrected": 7, "metrics": values}


class Script:
    def __init__(self, path: Path) -> None:
        self.path = path
        self.data: dict[str, Any] = {"gpus": [card(UUID_A), card(UUID_B, utilization_gpu=5)]}
        self.write()

    def write(self) -> None:
        write_script(self.path, self.data)


@pytest.fixture
def script(tmp_path: Path) -> Script:
    return Script(tmp_path / "nvml.json")


def reader(script: Script, *uuids: str, release: Path | None = None) -> GpuReader:
    return GpuReader(lambda: load_nvml(script.path), uuids, release)


def values(readings: list[Reading]) -> dict[str, float]:
    return {r.tag: r.value for r in readings}


def gpu_warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]


def test_every_series_of_each_gpu_in_the_members_order(script: Script) -> None:
    # The member was given B then A: rank 0 is B, whatever NVML's index order.
    got = values(reader(script, UUID_B, UUID_A).read())
    assert got == {
        "system/gpu0/utilization": 5.0, "system/gpu0/memory_utilization": 41.0,
        "system/gpu0/memory_used_bytes": float(3 * 2**30), "system/gpu0/power_w": 312.5,
        "system/gpu0/temperature_c": 64.0, "system/gpu0/sm_clock_mhz": 1980.0,
        "system/gpu0/throttle_reasons": 4.0, "system/gpu0/ecc_uncorrected": 2.0,
        "system/gpu0/ecc_corrected": 7.0,
        "system/gpu1/utilization": 87.0, "system/gpu1/memory_utilization": 41.0,
        "system/gpu1/memory_used_bytes": float(3 * 2**30), "system/gpu1/power_w": 312.5,
        "system/gpu1/temperature_c": 64.0, "system/gpu1/sm_clock_mhz": 1980.0,
        "system/gpu1/throttle_reasons": 4.0, "system/gpu1/ecc_uncorrected": 2.0,
        "system/gpu1/ecc_corrected": 7.0,
    }  # fmt: skip


def test_a_value_changes_while_the_reader_runs(script: Script) -> None:
    gpus = reader(script, UUID_A)
    assert values(gpus.read())["system/gpu0/utilization"] == 87.0
    script.data["gpus"][0]["metrics"]["utilization_gpu"] = 12
    script.write()
    assert values(gpus.read())["system/gpu0/utilization"] == 12.0


def test_not_supported_is_no_value_and_no_warning(
    script: Script, caplog: pytest.LogCaptureFixture
) -> None:
    script.data["gpus"][0]["metrics"]["power_mw"] = None
    script.data["gpus"][0]["ecc_uncorrected"] = None
    script.write()
    with caplog.at_level(logging.INFO):
        got = values(reader(script, UUID_A).read())
    assert "system/gpu0/power_w" not in got and "system/gpu0/ecc_uncorrected" not in got
    assert got["system/gpu0/utilization"] == 87.0 and got["system/gpu0/ecc_corrected"] == 7.0
    assert gpu_warnings(caplog) == []


def test_another_error_skips_that_value_with_one_warning_until_it_recovers(
    script: Script, caplog: pytest.LogCaptureFixture
) -> None:
    script.data["gpus"][0]["errors"] = {"nvmlDeviceGetTemperature": "UNKNOWN"}
    script.write()
    gpus = reader(script, UUID_A, UUID_B)
    with caplog.at_level(logging.INFO):
        for _ in range(3):
            got = values(gpus.read())
            assert "system/gpu0/temperature_c" not in got
            assert got["system/gpu0/power_w"] == 312.5 and got["system/gpu1/temperature_c"] == 64
        (warning,) = gpu_warnings(caplog)
        assert f"gpu={UUID_A} reading=temperature_c" in warning
        assert "NVML_ERROR_UNKNOWN" in warning
        script.data["gpus"][0]["errors"] = {}
        script.write()
        assert values(gpus.read())["system/gpu0/temperature_c"] == 64.0
    assert any("works again" in r.getMessage() for r in caplog.records)


def test_a_lost_card_costs_only_its_own_values(
    script: Script, caplog: pytest.LogCaptureFixture
) -> None:
    gpus = reader(script, UUID_A, UUID_B)
    assert len(gpus.read()) == 2 * len(GPU_SERIES)
    script.data["gpus"][0]["lost"] = True
    script.write()
    with caplog.at_level(logging.WARNING):
        for _ in range(2):
            got = values(gpus.read())
            assert not any(tag.startswith("system/gpu0/") for tag in got)
            assert got["system/gpu1/utilization"] == 5.0
    assert len(gpu_warnings(caplog)) == 1 and "GPU_IS_LOST" in gpu_warnings(caplog)[0]
    script.data["gpus"][0]["lost"] = False
    script.write()
    assert values(gpus.read())["system/gpu0/utilization"] == 87.0


def test_a_driver_reload_initialises_nvml_again(script: Script) -> None:
    gpus = reader(script, UUID_A)
    assert gpus.read()
    script.data["epoch"] = 1  # calls under the old initialisation now fail UNINITIALIZED
    script.write()
    gpus.read()
    assert values(gpus.read())["system/gpu0/utilization"] == 87.0


def test_the_operators_release_lets_go_of_nvml(script: Script, tmp_path: Path) -> None:
    calls = tmp_path / "calls.log"
    script.data["calls_log"] = str(calls)
    script.write()
    release = tmp_path / "gpu-release.json"
    gpus = reader(script, UUID_A, release=release)
    assert gpus.read()
    write_json_atomic(release, {"until_ms": int(time.time() * 1000) + 60_000})
    assert gpus.read() == [] and gpus.read() == []
    assert calls.read_text().splitlines() == ["nvmlInit", "nvmlShutdown"]
    write_json_atomic(release, {"until_ms": int(time.time() * 1000) - 1})
    assert values(gpus.read())["system/gpu0/utilization"] == 87.0
    assert calls.read_text().splitlines()[-1] == "nvmlInit"


def test_a_broken_script_is_a_warning_not_a_crash(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    path = tmp_path / "nvml.json"
    path.write_text("{not json")
    gpus = GpuReader(lambda: load_nvml(path), (UUID_A,))
    with caplog.at_level(logging.WARNING):
        assert gpus.read() == [] and gpus.read() == []
    (warning,) = gpu_warnings(caplog)
    assert "not valid JSON" in warning


@pytest.fixture
def runner_tree(tmp_path: Path) -> Iterator[tuple[Path, psutil.Process]]:
    """A real "runner" whose child spins a core, named by a real runner.json."""
    code = (
        "import subprocess, sys, time\n"
        "child = subprocess.Popen([sys.executable, '-c', 'while True: pass'])\n"
        "print(child.pid, flush=True)\n"
        "time.sleep(120)\n"
    )
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    child = psutil.Process(int(proc.stdout.readline()))
    member_dir = tmp_path / "member"
    member_dir.mkdir()
    runner = psutil.Process(proc.pid)
    record = {"pid": proc.pid, "start_time": runner.create_time(), "processes": []}
    write_json_atomic(member_dir / RUNNER_FILE, record)
    try:
        yield member_dir, runner
    finally:
        child.kill()
        proc.kill()
        proc.wait(timeout=10)


def test_the_process_tree_cpu_and_memory(runner_tree: tuple[Path, psutil.Process]) -> None:
    member_dir, runner = runner_tree
    processes = ProcessReader(member_dir)
    first = values(processes.read() or [])
    # No interval yet: no CPU figure on the first sample, but memory and the count.
    assert "system/cpu_percent" not in first
    assert first["system/processes"] == 2.0 and first["system/rss_bytes"] > 2**20
    time.sleep(1.0)
    second = values(processes.read() or [])
    # The child spins one core (two CPUs are shared with other tests: allow for it).
    assert 20.0 < second["system/cpu_percent"] < 210.0, second
    assert (
        second["system/rss_bytes"]
        >= sum(p.memory_info().rss for p in [runner, *runner.children()]) * 0.5
    )


def test_no_runner_or_a_reused_pid_gives_no_sample(tmp_path: Path) -> None:
    member_dir = tmp_path / "member"
    member_dir.mkdir()
    assert ProcessReader(member_dir).read() is None
    # A record whose pid now belongs to another process (this test) is not the runner.
    record = {"pid": os.getpid(), "start_time": 1_000_000.0, "processes": []}
    write_json_atomic(member_dir / RUNNER_FILE, record)
    assert ProcessReader(member_dir).read() is None
    # A runner that ended but was not reaped yet (a zombie) is not running.
    ended = subprocess.Popen([sys.executable, "-c", "pass"])
    try:
        start = psutil.Process(ended.pid).create_time()
        record = {"pid": ended.pid, "start_time": start, "processes": []}
        write_json_atomic(member_dir / RUNNER_FILE, record)
        wait_zombie = time.monotonic() + 10
        while psutil.Process(ended.pid).status() != psutil.STATUS_ZOMBIE:
            assert time.monotonic() < wait_zombie, "the child did not exit"
            time.sleep(0.02)
        assert ProcessReader(member_dir).read() is None
    finally:
        ended.wait(timeout=10)


def test_sample_keys_are_fixed_per_tag_and_unique() -> None:
    readings = [process_reading(name, 1.0) for name in PROCESS_SERIES]
    readings += [gpu_reading(rank, name, 1.0) for rank in range(8) for name in GPU_SERIES]
    points = sample_points(41, NOW, readings)
    assert {p.dedup_key[:2] for p in points} == {("system", 41)}
    assert len({p.dedup_key for p in points}) == len(points)
    assert all(p.step == 41 and p.wall_time == NOW and p.source == "system" for p in points)
    # The same tag always has the same index, whatever else the sample holds.
    alone = sample_points(42, NOW, [gpu_reading(3, "power_w", 9.0)])[0]
    again = next(p for p in points if p.tag == "system/gpu3/power_w")
    assert alone.index == again.index
    good, refused = PointScreen().screen(points, NOW)
    assert len(good) == len(points) and refused == []


def test_sample_numbers_survive_a_restart_and_a_damaged_file(tmp_path: Path) -> None:
    path = tmp_path / "system-samples.json"
    numbers = SampleNumbers(path)
    assert [numbers.reserve() for _ in range(3)] == [0, 1, 2]
    assert SampleNumbers(path).reserve() == 3
    path.write_text("{damaged")
    assert SampleNumbers(path).reserve() > 3


def test_a_workload_cannot_write_system_series() -> None:
    forged = [
        ScalarPoint("metrics.jsonl", "system/gpu0/utilization", 1, NOW, 0.0, 0, 0,
                    "metrics.jsonl"),
        ScalarPoint("system", "train/loss", 1, NOW, 0.0, 0, 0, "system"),
    ]  # fmt: skip
    good, refused = PointScreen().screen(forged, NOW)
    assert good == []
    assert [w.kind for w in refused] == [REFUSED_KIND, REFUSED_KIND]
    assert "only the collector's own" in refused[0].message
    assert "carries only system/ tags" in refused[1].message


def test_a_hung_nvml_call_does_not_hold_the_sample(
    script: Script, runner_tree: tuple[Path, psutil.Process], tmp_path: Path
) -> None:
    member_dir, _ = runner_tree
    script.data["gpus"][0]["hang"] = ["nvmlDeviceGetPowerUsage"]
    script.write()
    spooled: list[list[ScalarPoint]] = []

    async def spool(points: list[ScalarPoint]) -> None:
        spooled.append(points)

    opts = SystemOptions(
        interval_s=0.1, gpu_uuids=(UUID_A,), member_dir=member_dir,
        scripted_nvml=script.path, nvml_limit_s=1.0,
    )  # fmt: skip
    sampling = SystemSampling(opts, tmp_path / "state", spool, lambda: False)
    (tmp_path / "state").mkdir()
    numbers = SampleNumbers(tmp_path / "state" / "numbers.json")

    async def main() -> list[float]:
        took = []
        for _ in range(3):
            started = time.monotonic()
            with trio.fail_after(10):
                await sampling.sample(numbers)
            took.append(time.monotonic() - started)
        script.data["gpus"][0]["hang"] = []
        script.write()
        with trio.fail_after(10):
            while not any(p.tag == "system/gpu0/power_w" for p in spooled[-1]):
                await trio.sleep(0.05)
                await sampling.sample(numbers)
        return took

    took = trio.run(main)
    # The first sample waited for the limit; the next ones did not wait for the hung call.
    assert 1.0 <= took[0] < 4.0 and max(took[1:]) < 0.9, took
    assert all(not any(p.tag.startswith("system/gpu") for p in s) for s in spooled[:3])
    assert all(any(p.tag == "system/rss_bytes" for p in s) for s in spooled[:3])
    assert [s[0].step for s in spooled] == list(range(len(spooled)))


def test_series_names_are_documented() -> None:
    doc = (Path(__file__).parents[2] / "docs" / "telemetry.md").read_text()
    for name in GPU_SERIES:
        assert f"system/gpu<r>/{name}" in doc, name
    for name in PROCESS_SERIES:
        assert f"system/{name}" in doc, name
    assert "source `system`" in doc
