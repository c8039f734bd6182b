"""A workload cannot forge its system series, tried with real parts: a real coordinator, the real
``tuneplane-collector run`` process sampling a real process tree through the scripted NVML while
it tails the workload's file, and hostile Ship calls made with a member's real credential.

The ``system/`` namespace is the collector's own: a JSONL value tagged ``system/...`` is refused
(a ``not-shippable`` data-loss warning with its file and offset), the gateway refuses such a
point from any source but ``system`` (and anything else from ``system``), and the stored system
series hold only what NVML and psutil said.
"""

from __future__ import annotations

import asyncio
import json
import sqlite3
from collections.abc import Iterator
from contextlib import closing
from pathlib import Path

import pytest

from tests.collector.delivery import (
    CollectorProcess,
    Launched,
    delivery_row,
    launch_member,
    standing_runner,
    stored_points,
)
from tests.coordinator.grpc_client import bearer, open_channel
from tests.support.coordinator import CoordinatorProcess, start_coordinator
from tests.support.processes import wait_until
from tuneplane.agent.scripted_nvml import write_script
from tuneplane.collector.spool import SPOOL_FILE
from tuneplane.proto import v1

UUID = "GPU-7c7c7c7c-1111-2222-3333-444444444444"
WALL = 1.7e9


@pytest.fixture(scope="module")
def coord(tmp_path_factory: pytest.TempPathFactory) -> Iterator[CoordinatorProcess]:
    with start_coordinator(tmp_path_factory.mktemp("system-series")) as c:
        yield c


@pytest.fixture
def runner(tmp_path: Path) -> Iterator[Path]:
    with standing_runner(tmp_path) as member_dir:
        yield member_dir


def test_a_workload_line_claiming_system_series_is_refused_and_stores_nothing(
    coord: CoordinatorProcess, tmp_path: Path, runner: Path
) -> None:
    launched = launch_member(coord, "forged-system")
    script = tmp_path / "nvml.json"
    write_script(script, {"gpus": [{"uuid": UUID, "metrics": {"utilization_gpu": 42}}]})
    telemetry = tmp_path / "telemetry"
    telemetry.mkdir()
    lines = [
        {"step": 0, "train/loss": 1.0, "wall_time": WALL},
        {"step": 1, "system/gpu0/utilization": 999.0, "train/loss": 0.5, "wall_time": WALL},
        {"step": 2, "metrics": {"system/rss_bytes": 1.0}, "wall_time": WALL},
    ]
    offsets = []
    with open(telemetry / "metrics.jsonl", "w") as out:
        for line in lines:
            offsets.append(out.tell())
            out.write(json.dumps(line) + "\n")
    collector = CollectorProcess(
        coord, launched, telemetry, tmp_path / "state",
        "--system-interval", "0.1", "--member-dir", str(runner), "--gpu", UUID,
        "--scripted-nvml", str(script),
    )  # fmt: skip
    collector.start()
    wait_until(
        "system samples to be stored",
        lambda: sum(t == "system/gpu0/utilization" for _, t, _, _ in stored(coord, launched)) >= 3,
    )
    collector.member_exited()
    assert collector.wait() == 0, collector.read_log()

    points = stored(coord, launched)
    from_file = sorted((t, s, v) for src, t, s, v in points if src == "metrics.jsonl")
    assert from_file == [("train/loss", 0, 1.0), ("train/loss", 1, 0.5)]
    assert {src for src, t, _, _ in points if t.startswith("system/")} == {"system"}
    assert {v for _, t, _, v in points if t == "system/gpu0/utilization"} == {42.0}
    assert all(v > 1.0 for _, t, _, v in points if t == "system/rss_bytes")

    path = tmp_path / "state" / SPOOL_FILE
    with closing(sqlite3.connect(f"file:{path}?mode=ro", uri=True, timeout=10)) as db:
        warnings = db.execute(
            "SELECT source, byte_offset, kind, message FROM warnings ORDER BY byte_offset"
        ).fetchall()
    assert [(w[0], w[1], w[2]) for w in warnings] == [
        ("metrics.jsonl", offsets[1], "not-shippable"),
        ("metrics.jsonl", offsets[2], "not-shippable"),
    ]
    assert all("system/ namespace" in w[3] for w in warnings)
    row = delivery_row(coord, launched.run_id)
    assert row is not None and row["data_loss_warnings"] == 2


def stored(coord: CoordinatorProcess, launched: Launched) -> list[tuple[str, str, int, float]]:
    return stored_points(coord, launched.run_id)


def _ship(coord: CoordinatorProcess, who: Launched, points: list[v1.MetricPoint]) -> v1.ShipReply:
    async def go() -> v1.ShipReply:
        channel = open_channel(coord.telemetry, coord.ca_path)
        try:
            stub = v1.TelemetryStub(channel, metadata=bearer(who.credential), timeout=10)
            request = v1.ShipRequest(member=who.member, points=points)
            reply: v1.ShipReply = await stub.ship(request)
            return reply
        finally:
            channel.close()

    return asyncio.run(go())


def _point(source: str, tag: str, offset: int) -> v1.MetricPoint:
    return v1.MetricPoint(
        source_id=source, offset=offset, tag=tag, step=offset, has_wall_time=True,
        wall_time=WALL, value=999.0,
    )  # fmt: skip


def test_the_gateway_refuses_system_tags_from_a_file_and_other_tags_from_system(
    coord: CoordinatorProcess,
) -> None:
    who = launch_member(coord, "hostile-system")
    forged = [
        _point("metrics.jsonl", "system/gpu0/utilization", 1),
        _point("events.out.tfevents.1", "system/cpu_percent", 2),
        _point("system", "train/loss", 3),
    ]
    honest = [_point("metrics.jsonl", "train/loss", 4), _point("system", "system/gpu0/power_w", 5)]
    reply = _ship(coord, who, [*forged, *honest])
    assert (reply.stored, reply.duplicates) == (2, 0)
    refused = {(r.source_id, r.offset): r.reason for r in reply.refused}
    assert set(refused) == {(p.source_id, p.offset) for p in forged}
    assert "system/ namespace" in refused[("metrics.jsonl", 1)]
    assert "carries only system/ tags" in refused[("system", 3)]
    # Nothing of the forged points is stored, under any name.
    assert sorted(stored(coord, who)) == [
        ("metrics.jsonl", "train/loss", 4, 999.0),
        ("system", "system/gpu0/power_w", 5, 999.0),
    ]
