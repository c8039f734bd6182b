"""``tp metrics`` against a real coordinator whose store was filled through the real Ship RPC:
tags, canonical merging, the raw inspector, bounds, NaN, CSV/JSON, delivery and refusals."""

from __future__ import annotations

import asyncio
import json
import math
from collections.abc import Iterator

import pytest

from tests.cli.tp_process import run_tp
from tests.collector.delivery import Launched, launch_member
from tests.coordinator.grpc_client import bearer, open_channel
from tests.support.coordinator import CoordinatorProcess, start_coordinator
from tests.support.store_backend import StoreBackend
from tuneplane.proto import v1


def _ship(
    coord: CoordinatorProcess, who: Launched, points: list[v1.MetricPoint], spool_points: int
) -> None:
    async def go() -> None:
        channel = open_channel(coord.telemetry, coord.ca_path)
        try:
            stub = v1.TelemetryStub(channel, metadata=bearer(who.credential), timeout=10)
            for start in range(0, len(points), 5000):
                await stub.ship(
                    v1.ShipRequest(
                        member=who.member,
                        points=points[start : start + 5000],
                        progress=v1.CollectorProgress(spool_points=spool_points),
                    )
                )
        finally:
            channel.close()

    asyncio.run(go())


def _point(
    source: str, tag: str, step: int, value: float, offset: int | None = None
) -> v1.MetricPoint:
    return v1.MetricPoint(
        source_id=source,
        offset=step * 10 if offset is None else offset,
        tag=tag,
        step=step,
        has_wall_time=True,
        wall_time=1.7e9 + step,
        value=value,
    )


@pytest.fixture(scope="module")
def filled(
    tmp_path_factory: pytest.TempPathFactory, module_store_backend: StoreBackend
) -> Iterator[tuple[CoordinatorProcess, str]]:
    with start_coordinator(tmp_path_factory.mktemp("metrics")) as coord:
        who = launch_member(coord, "metrics")
        loss = [_point("report.rank0.jsonl", "train/loss", s, 1.0 / (s + 1)) for s in range(5000)]
        loss[3210] = _point("report.rank0.jsonl", "train/loss", 3210, 50.0)
        other = [
            _point("events.out.tfevents.1", "train/loss", s, 2.0, offset=s) for s in range(100)
        ]
        nan = [_point("report.rank0.jsonl", "eval/nan", 0, math.nan, offset=999_999)]
        _ship(coord, who, loss + other + nan, spool_points=7)
        yield coord, who.run_id


def _tp(coord: CoordinatorProcess, *args: str) -> tuple[int, str, str]:
    done = run_tp("--context", str(coord.context_path), *args, cwd=coord.state_dir)
    return done.returncode, done.stdout, done.stderr


def test_tags_merge_sources_in_the_canonical_view_and_stay_apart_raw(
    filled: tuple[CoordinatorProcess, str],
) -> None:
    coord, run_id = filled
    rc, out, err = _tp(coord, "metrics", run_id, "--json")
    assert rc == 0, err
    listing = json.loads(out)
    tags = {t["tag"]: t for t in listing["tags"]}
    assert listing["attempt"] == 1
    assert tags["train/loss"]["points"] == 5100 and tags["train/loss"]["series"] == 2
    assert tags["train/loss"]["last_step"] == 4999
    rc, out, err = _tp(coord, "metrics", run_id, "--raw", "--json")
    assert rc == 0, err
    raw = json.loads(out)["tags"]
    assert sorted((t["tag"], t["source"], t["points"]) for t in raw) == [
        ("eval/nan", "report.rank0.jsonl", 1),
        ("train/loss", "events.out.tfevents.1", 100),
        ("train/loss", "report.rank0.jsonl", 5000),
    ]
    rc, out, _ = _tp(coord, "metrics", run_id)
    assert rc == 0 and "train/loss" in out and "5100" in out


def test_a_series_is_bounded_and_its_spike_survives(filled: tuple[CoordinatorProcess, str]) -> None:
    coord, run_id = filled
    rc, out, err = _tp(
        coord, "metrics", run_id, "--tag", "train/loss", "--max-points", "50", "--json"
    )
    assert rc == 0, err
    series = json.loads(out)
    assert series["downsampled"] and series["total_points"] == 5100
    assert len(series["buckets"]) <= 50
    assert sum(b["count"] for b in series["buckets"]) == 5100
    assert max(b["max"] for b in series["buckets"]) == 50.0
    rc, out, err = _tp(
        coord, "metrics", run_id, "--tag", "train/loss", "--max-points", "50", "--width", "80"
    )
    assert rc == 0, err
    assert "5100 points in" in out and "•" in out and "│" in out
    assert "50 ┤" in out  # the spike sets the top of the scale


def test_the_raw_inspector_returns_one_series_whole(filled: tuple[CoordinatorProcess, str]) -> None:
    coord, run_id = filled
    args = ("metrics", run_id, "--tag", "train/loss", "--raw", "--attempt", "1", "--member", "0",
            "--source", "events.out.tfevents.1")  # fmt: skip
    rc, out, err = _tp(coord, *args, "--csv")
    assert rc == 0, err
    lines = out.splitlines()
    assert lines[0] == "first_step,last_step,count,min,max,last"
    assert len(lines) == 101 and lines[1] == "0,0,1,2.0,2.0,2.0"
    rc, out, err = _tp(coord, *args)
    assert rc == 0, err
    assert "100 points" in out
    rc, out, err = _tp(coord, "metrics", run_id, "--tag", "eval/nan", "--json")
    assert rc == 0, err
    (bucket,) = json.loads(out)["buckets"]
    assert math.isnan(bucket["last"])


def test_delivery_is_reported_per_member(filled: tuple[CoordinatorProcess, str]) -> None:
    coord, run_id = filled
    rc, out, err = _tp(coord, "metrics", run_id, "--delivery", "--json")
    assert rc == 0, err
    (member,) = json.loads(out)["members"]
    assert (member["points_stored"], member["spool_points"], member["drained"]) == (5101, 7, False)
    rc, out, err = _tp(coord, "job", "show", run_id)
    assert rc == 0, err
    assert "telemetry delivery" in out and "5101" in out


def test_refusals_are_sentences(filled: tuple[CoordinatorProcess, str]) -> None:
    coord, run_id = filled
    rc, _, err = _tp(coord, "metrics", run_id, "--tag", "nope")
    assert rc == 1 and "has no metric 'nope'" in err
    rc, _, err = _tp(coord, "metrics", "run-missing")
    assert rc == 1 and "no Job with run id 'run-missing'" in err
    rc, _, err = _tp(coord, "metrics", run_id, "--member", "0")
    assert rc == 2 and "add --raw" in err
    rc, _, err = _tp(coord, "metrics", run_id, "--tag", "x", "--json", "--csv")
    assert rc == 2 and "pick one" in err
