"""What a member's GPU and process samples cost its collector, per sample.

A real process tree stands for the member: a runner with ``TUNEPLANE_BENCH_SAMPLE_RANKS``
children (8), named by a real ``runner.json``. The GPUs are read through the scripted NVML
(``TUNEPLANE_BENCH_SAMPLE_GPUS`` cards, 8), or through the real NVML when
``TUNEPLANE_BENCH_REAL_NVML=1`` (every GPU of the machine, by UUID). Each part is timed on its
own over ``TUNEPLANE_BENCH_SAMPLES`` samples (200): CPU time (this process, all threads) and
wall time per sample, medians of 5 rounds, then a whole sample as the collector takes it
(readers, the sample number reserved with fsync, the spool's SQLite transaction with fsync).
The scripted NVML re-checks its file at every call, so its figure is an upper bound of the
Python side of real NVML calls, which take tens of microseconds each in the driver.
"""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import psutil
import trio

from tuneplane.agent.nvml_source import load_nvml
from tuneplane.agent.scripted_nvml import write_script
from tuneplane.collector.defaults import SYSTEM_INTERVAL_S
from tuneplane.collector.gpu_reader import GpuReader
from tuneplane.collector.points import ScalarPoint
from tuneplane.collector.process_reader import ProcessReader
from tuneplane.collector.spool import Spool
from tuneplane.collector.system_sampler import SystemOptions, SystemSampling
from tuneplane.collector.system_samples import SampleNumbers
from tuneplane.runner.durable import write_json_atomic
from tuneplane.runner.records import RUNNER_FILE

ROUNDS = 5


def _knob(name: str, default: int) -> int:
    return int(os.environ.get(name, default))


def _tree(member_dir: Path, ranks: int) -> subprocess.Popen[str]:
    code = (
        "import subprocess, sys, time\n"
        f"kids = [subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)'])"
        f" for _ in range({ranks})]\n"
        "print('ready', flush=True)\n"
        "time.sleep(600)\n"
    )
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    proc.stdout.readline()
    start = psutil.Process(proc.pid).create_time()
    write_json_atomic(member_dir / RUNNER_FILE, {"pid": proc.pid, "start_time": start,
                                                 "processes": []})  # fmt: skip
    return proc


def _scripted(path: Path, gpus: int) -> tuple[str, ...]:
    uuids = tuple(f"GPU-{i:08x}-0000-0000-0000-000000000000" for i in range(gpus))
    cards = [
        {"uuid": u, "ecc_uncorrected": 0, "ecc_corrected": 0,
         "metrics": {"utilization_gpu": 50, "utilization_memory": 20, "memory_used": 2**34,
                     "power_mw": 400_000, "temperature_c": 60, "sm_clock_mhz": 1980,
                     "clocks_event_reasons": 0}}
        for u in uuids
    ]  # fmt: skip
    write_script(path, {"gpus": cards})
    return uuids


def _real_uuids() -> tuple[str, ...]:
    nvml: Any = load_nvml(None)
    nvml.nvmlInit()
    try:
        count = nvml.nvmlDeviceGetCount()
        return tuple(
            str(nvml.nvmlDeviceGetUUID(nvml.nvmlDeviceGetHandleByIndex(i))) for i in range(count)
        )
    finally:
        nvml.nvmlShutdown()


def _per_sample(work: Callable[[], Any], samples: int) -> tuple[float, float, Any]:
    """Median (CPU ms, wall ms) per call over ROUNDS rounds of ``samples`` calls."""
    cpu: list[float] = []
    wall: list[float] = []
    result: Any = None
    for _ in range(ROUNDS):
        c0, w0 = time.process_time(), time.perf_counter()
        for _ in range(samples):
            result = work()
        cpu.append((time.process_time() - c0) * 1000 / samples)
        wall.append((time.perf_counter() - w0) * 1000 / samples)
    return statistics.median(cpu), statistics.median(wall), result


def main() -> int:
    samples = _knob("TUNEPLANE_BENCH_SAMPLES", 200)
    ranks = _knob("TUNEPLANE_BENCH_SAMPLE_RANKS", 8)
    real = os.environ.get("TUNEPLANE_BENCH_REAL_NVML") == "1"
    with tempfile.TemporaryDirectory(prefix="tp-bench-sampling-") as tmp:
        root = Path(tmp)
        member_dir = root / "member"
        member_dir.mkdir()
        tree = _tree(member_dir, ranks)
        try:
            if real:
                script = None
                uuids = _real_uuids()
                source = "real NVML"
            else:
                script = root / "nvml.json"
                uuids = _scripted(script, _knob("TUNEPLANE_BENCH_SAMPLE_GPUS", 8))
                source = "scripted NVML"
            processes = ProcessReader(member_dir)
            cpu, wall, found = _per_sample(processes.read, samples)
            print(f"process tree ({ranks + 1} processes, psutil): {cpu:.3f} ms CPU, "
                  f"{wall:.3f} ms wall per sample ({len(found or [])} values)")  # fmt: skip
            gpus = GpuReader(lambda: load_nvml(script), uuids)
            cpu_g, wall_g, values = _per_sample(gpus.read, samples)
            gpus.close()
            print(f"{len(uuids)} GPUs ({source}): {cpu_g:.3f} ms CPU, {wall_g:.3f} ms wall "
                  f"per sample ({len(values)} values)")  # fmt: skip
            cpu_w, wall_w, points = _whole(root, member_dir, uuids, script, samples)
            share = cpu_w / (SYSTEM_INTERVAL_S * 1000) * 100
            print(f"whole sample (readers in worker threads, number fsynced, spooled): "
                  f"{cpu_w:.3f} ms CPU, {wall_w:.3f} ms wall per sample ({points} points); "
                  f"every {SYSTEM_INTERVAL_S:g} s that is {share:.4f} % of one core")  # fmt: skip
        finally:
            tree.kill()
            tree.wait()
            for child in psutil.Process().children(recursive=True):
                child.kill()
    return 0


def _whole(
    root: Path, member_dir: Path, uuids: tuple[str, ...], script: Path | None, samples: int
) -> tuple[float, float, int]:
    state = root / "state"
    state.mkdir()
    spool = Spool.open(state / "spool.db")
    opts = SystemOptions(
        interval_s=SYSTEM_INTERVAL_S, gpu_uuids=uuids, member_dir=member_dir,
        scripted_nvml=script,
    )  # fmt: skip
    spooled: list[int] = []

    async def to_spool(points: list[ScalarPoint]) -> None:
        await trio.to_thread.run_sync(spool.append, points, [])
        spooled.append(len(points))

    sampling = SystemSampling(opts, state, to_spool, spool.full)
    numbers = SampleNumbers(state / "system-samples.json")

    async def go() -> tuple[float, float]:
        cpu: list[float] = []
        wall: list[float] = []
        for _ in range(ROUNDS):
            c0, w0 = time.process_time(), time.perf_counter()
            for _ in range(samples):
                await sampling.sample(numbers)
            cpu.append((time.process_time() - c0) * 1000 / samples)
            wall.append((time.perf_counter() - w0) * 1000 / samples)
        return statistics.median(cpu), statistics.median(wall)

    try:
        cpu, wall = trio.run(go)
    finally:
        sampling.gpus.close()
        spool.close()
    return cpu, wall, spooled[-1] if spooled else 0


if __name__ == "__main__":
    sys.exit(main())
