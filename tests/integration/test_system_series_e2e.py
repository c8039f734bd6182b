"""What the GPUs did, per Job, end to end: scripted GPU values reach `tp metrics` exactly once.

A real coordinator and a real agent on loopback TLS; the agent reads its two GPUs through the
scripted NVML (``--scripted-nvml FILE``) and passes the file to the collector it starts for the
member, which samples every 0.2 s. The two cards report different utilisations, so the values
stored under ``system/gpu0/...`` prove the member's own card was read; the test changes the
utilisation while the member runs, and SIGKILLs the collector twice mid-run: no sample is
stored twice, and a sample number is missing only where a kill fell between reserving it and
spooling the sample (at most one per kill).
"""

from __future__ import annotations

import json
import signal
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest

from tests.agent.jobs import submit, tp, wait_job
from tests.support.agent import AgentProcess, start_agent, wait_until
from tests.support.coordinator import CoordinatorProcess, start_coordinator
from tuneplane.agent.scripted_nvml import write_script

pytestmark = pytest.mark.slow

UUIDS = ("GPU-5a5a5a5a-1111-2222-3333-444444444444", "GPU-6b6b6b6b-1111-2222-3333-444444444444")
UTILIZATION = {UUIDS[0]: 77, UUIDS[1]: 33}
HOLD = (
    'echo "$CUDA_VISIBLE_DEVICES" > "$TUNEPLANE_OUT_DIR/gpus"\n'
    'while [ ! -e "$TUNEPLANE_OUT_DIR/release" ]; do sleep 0.1; done\n'
)
KILLS = 2


def card(uuid: str, utilization: int) -> dict[str, Any]:
    return {
        "uuid": uuid, "name": "NVIDIA H200", "memory": 150_754_820_096,
        "architecture": "hopper", "ecc_uncorrected": 0, "ecc_corrected": 3,
        "remapped_rows": [0, 0, 0, 0], "recovery_action": "none",
        "metrics": {"utilization_gpu": utilization, "utilization_memory": 20,
                    "memory_used": 5 * 2**30, "power_mw": 250_000, "temperature_c": 55,
                    "sm_clock_mhz": 1755, "clocks_event_reasons": 0},
    }  # fmt: skip


def write(path: Path, utilization: dict[str, int]) -> None:
    cards = [card(u, utilization[u]) for u in UUIDS]
    write_script(path, {"driver_version": "550.54.15", "gpus": cards})


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[tuple[CoordinatorProcess, AgentProcess, Path]]:
    script = tmp_path / "nvml.json"
    write(script, UTILIZATION)
    with start_coordinator(tmp_path / "coord") as coord:
        agent = start_agent(
            tmp_path, coord, "node-a", simulate_gpus=None,
            run_args=("--scripted-nvml", str(script), "--system-interval", "0.2"),
        )  # fmt: skip
        try:
            agent.wait_connected()
            yield coord, agent, script
        finally:
            agent.stop()


def collector_pid(agent: AgentProcess, other_than: int = 0) -> int:
    def find() -> int:
        return next((pid for pid in agent.collector_pids() if pid != other_than), 0)

    pid: int = wait_until("the member's collector to run", find)
    return pid


def reserved(folder: Path) -> int:
    """How many sample numbers the collector reserved so far."""
    try:
        return int(json.loads((folder / "system-samples.json").read_text())["next"])
    except (OSError, ValueError):
        return 0


def series(coord: CoordinatorProcess, run_id: str, tag: str) -> list[dict[str, Any]]:
    out = tp(coord, "metrics", run_id, "--raw", "--member", "0", "--source", "system",
             "--tag", tag, "--max-points", "10000", "--json")  # fmt: skip
    data = json.loads(out)
    assert not data["downsampled"], data
    buckets: list[dict[str, Any]] = data["buckets"]
    return buckets


def test_scripted_gpu_values_reach_tp_metrics_once_across_collector_kills(
    cluster: tuple[CoordinatorProcess, AgentProcess, Path], tmp_path: Path
) -> None:
    coord, agent, script = cluster
    run_id = submit(coord, tmp_path / "job", HOLD)
    out_dir = agent.out_root / run_id / "attempt-1" / "member-0"
    mine: str = wait_until(
        "the member to start",
        lambda: (out_dir / "gpus").exists() and (out_dir / "gpus").read_text().strip(),
    )
    assert mine in UUIDS
    folder = agent.state_dir / "collectors" / f"{run_id}.1.0"

    # Samples flow; then the collector is killed twice, each time after a few more samples.
    pid = collector_pid(agent)
    for _ in range(KILLS):
        mark = reserved(folder)
        wait_until("more samples", lambda mark=mark: reserved(folder) >= mark + 5)
        psutil.Process(pid).send_signal(signal.SIGKILL)
        pid = collector_pid(agent, other_than=pid)
    # The card's utilisation changes while the member runs.
    write(script, {u: v + 10 for u, v in UTILIZATION.items()})
    mark = reserved(folder)
    wait_until("samples after the change", lambda: reserved(folder) >= mark + 5)
    (out_dir / "release").write_text("")
    assert wait_job(coord, run_id)["state"] == "succeeded"
    wait_until("the collector to drain", lambda: (folder / "drained").exists(), 120)

    utilization = series(coord, run_id, "system/gpu0/utilization")
    steps = [b["first_step"] for b in utilization]
    assert all(b["count"] == 1 for b in utilization) and len(set(steps)) == len(steps)
    # Only this member's card, before and after the change; never the other card's value.
    values = {b["last"] for b in utilization}
    assert values == {UTILIZATION[mine], UTILIZATION[mine] + 10}, values
    assert [b["last"] for b in utilization] == sorted(b["last"] for b in utilization)
    # Each sample once; the only missing numbers are samples killed before they were spooled.
    total = reserved(folder)
    rss = series(coord, run_id, "system/rss_bytes")
    rss_steps = [b["first_step"] for b in rss]
    assert len(set(rss_steps)) == len(rss_steps)
    assert set(rss_steps) <= set(range(total))
    assert total - len(rss_steps) <= KILLS, (total, rss_steps)
    assert not [b for b in rss if not b["last"] > 0]
    for tag, value in {
        "system/gpu0/power_w": 250.0, "system/gpu0/temperature_c": 55.0,
        "system/gpu0/sm_clock_mhz": 1755.0, "system/gpu0/memory_used_bytes": float(5 * 2**30),
        "system/gpu0/ecc_corrected": 3.0, "system/gpu0/throttle_reasons": 0.0,
    }.items():  # fmt: skip
        assert {b["last"] for b in series(coord, run_id, tag)} == {value}, tag
    listing = json.loads(tp(coord, "metrics", run_id, "--raw", "--source", "system", "--json"))
    assert all(t["tag"].startswith("system/") for t in listing["tags"])
    assert not any(t["tag"].startswith("system/gpu1/") for t in listing["tags"])
