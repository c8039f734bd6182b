"""Exactly-once delivery with real parts: a real coordinator, the real collector process, real
files, SIGKILL and a stopped gateway. Every point written reaches the store once."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from grpclib.const import Status
from grpclib.exceptions import GRPCError

from tests.collector.delivery import (
    CollectorProcess,
    delivery_row,
    launch_member,
    stored_points,
    write_jsonl,
)
from tests.coordinator.grpc_client import bearer, node_stream, open_channel
from tests.support.coordinator import CoordinatorProcess, start_coordinator
from tests.support.processes import wait_until
from tuneplane.proto import v1


@pytest.fixture(scope="module")
def coord(tmp_path_factory: pytest.TempPathFactory) -> Iterator[CoordinatorProcess]:
    with start_coordinator(tmp_path_factory.mktemp("delivery")) as c:
        yield c


def _steps(points: list[tuple[str, str, int, float]]) -> list[int]:
    return sorted(step for _, _, step, _ in points)


def test_every_point_is_stored_once_and_the_collector_drains(
    coord: CoordinatorProcess, tmp_path: Path
) -> None:
    launched = launch_member(coord, "drain")
    assert launched.credential.startswith("tpc_")
    assert launched.telemetry_address == coord.telemetry
    telemetry = tmp_path / "telemetry"
    write_jsonl(telemetry / "report.rank0.jsonl", 0, 500)
    collector = CollectorProcess(coord, launched, telemetry, tmp_path / "collector")
    collector.start()
    wait_until("the first points", lambda: len(stored_points(coord, launched.run_id)) == 500)
    write_jsonl(telemetry / "report.rank0.jsonl", 500, 250)
    collector.member_exited()
    assert collector.wait() == 0, collector.read_log()
    points = stored_points(coord, launched.run_id)
    assert _steps(points) == list(range(750))
    assert {(src, tag) for src, tag, _, _ in points} == {("report.rank0.jsonl", "train/loss")}
    assert all(value == step * 0.5 for _, _, step, value in points)
    assert (tmp_path / "collector" / "drained").exists()
    assert collector.spool_depth() == 0
    row = delivery_row(coord, launched.run_id)
    assert row is not None
    assert (row["points_stored"], row["spool_points"], row["drained"]) == (750, 0, 1)
    assert row["last_point_wall_ms"] == int((1.7e9 + 749) * 1000)


def test_kill_9_mid_batch_loses_nothing_and_stores_nothing_twice(
    coord: CoordinatorProcess, tmp_path: Path
) -> None:
    launched = launch_member(coord, "kill9")
    telemetry = tmp_path / "telemetry"
    # A real writer process keeps appending while the collector is killed and restarted.
    total = 12_000
    writer = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import json, sys, time\n"
            "out = open(sys.argv[1], 'a')\n"
            "for step in range(int(sys.argv[2])):\n"
            "    out.write(json.dumps({'step': step, 'metrics': {'train/loss': step * 0.5,"
            " 'train/lr': 1.0}}) + '\\n')\n"
            "    if step % 500 == 0:\n"
            "        out.flush(); time.sleep(0.01)\n"
            "out.close()\n",
            str(telemetry / "metrics.jsonl"),
            str(total),
        ]
    )
    telemetry.mkdir(parents=True)
    collector = CollectorProcess(coord, launched, telemetry, tmp_path / "collector")
    try:
        for round_ in range(4):
            collector.start()
            floor = (round_ + 1) * 2000

            def reached(floor: int = floor) -> bool:
                return len(stored_points(coord, launched.run_id)) >= floor

            wait_until(f"{floor} points stored before kill {round_}", reached)
            collector.kill()
        assert writer.wait(timeout=60) == 0
        collector.start()
        collector.member_exited()
        assert collector.wait() == 0, collector.read_log()
    finally:
        if writer.poll() is None:
            writer.kill()
            writer.wait()
    points = stored_points(coord, launched.run_id)
    by_tag: dict[str, list[int]] = {}
    for _, tag, step, _ in points:
        by_tag.setdefault(tag, []).append(step)
    # Nothing lost, nothing twice: each tag has exactly one point per step.
    assert sorted(by_tag) == ["train/loss", "train/lr"]
    for tag, steps in by_tag.items():
        assert sorted(steps) == list(range(total)), tag
    assert len(points) == 2 * total


def test_gateway_down_the_spool_grows_then_drains_after_restart(
    tmp_path: Path,
) -> None:
    with start_coordinator(tmp_path / "coord") as coord:
        launched = launch_member(coord, "outage")
        telemetry = tmp_path / "telemetry"
        write_jsonl(telemetry / "report.rank0.jsonl", 0, 100)
        collector = CollectorProcess(coord, launched, telemetry, tmp_path / "collector")
        collector.start()
        wait_until("the first points", lambda: len(stored_points(coord, launched.run_id)) == 100)
        coord.stop()
        write_jsonl(telemetry / "report.rank0.jsonl", 100, 900)
        wait_until("the spool to hold what the gateway could not take",
                   lambda: collector.spool_depth() == 900)  # fmt: skip
        assert collector.proc is not None and collector.proc.poll() is None
        coord.restart()
        wait_until("the spool to drain", lambda: collector.spool_depth() == 0, timeout=60)
        collector.member_exited()
        assert collector.wait() == 0, collector.read_log()
        assert _steps(stored_points(coord, launched.run_id)) == list(range(1000))
        assert "ship failed; retrying" in collector.read_log()


def test_a_collector_credential_opens_only_its_own_member_on_the_telemetry_gateway(
    coord: CoordinatorProcess,
) -> None:
    a = launch_member(coord, "scope-a")
    b = launch_member(coord, "scope-b")
    point = v1.MetricPoint(source_id="m.jsonl", offset=0, tag="x", step=1, value=1.0)

    async def ship(token: str, member: v1.MemberRef) -> v1.ShipReply:
        channel = open_channel(coord.telemetry, coord.ca_path)
        try:
            stub = v1.TelemetryStub(channel, metadata=bearer(token), timeout=10)
            return await stub.ship(v1.ShipRequest(member=member, points=[point]))
        finally:
            channel.close()

    async def ping(token: str) -> v1.PingReply:
        channel = open_channel(coord.telemetry, coord.ca_path)
        try:
            return await v1.TelemetryStub(channel, metadata=bearer(token), timeout=10).ping(
                v1.PingRequest()
            )
        finally:
            channel.close()

    def refused(token: str, member: v1.MemberRef) -> GRPCError:
        with pytest.raises(GRPCError) as caught:
            asyncio.run(ship(token, member))
        return caught.value

    # Its own member: stored once, a retry stores nothing more.
    assert asyncio.run(ship(a.credential, a.member)).stored == 1
    again = asyncio.run(ship(a.credential, a.member))
    assert (again.stored, again.duplicates) == (0, 1)
    # Another member's points: refused, naming whose credential it is.
    other = refused(a.credential, b.member)
    assert other.status is Status.PERMISSION_DENIED
    assert f"{a.run_id}/attempt-1/member-0" in (other.message or "")
    # Node and user credentials cannot ship at all.
    for token in (a.node_credential, coord.admin_token):
        err = refused(token, a.member)
        assert err.status is Status.UNAUTHENTICATED
        assert "collector credential" in (err.message or "")
    assert refused("tpc_forged", a.member).status is Status.UNAUTHENTICATED
    assert asyncio.run(ping(a.credential)).principal == (f"collector:{a.run_id}/attempt-1/member-0")
    # A credential for another listener is refused on this one, Ping included.
    for token in (a.node_credential, coord.admin_token):
        with pytest.raises(GRPCError) as pinged:
            asyncio.run(ping(token))
        assert pinged.value.status is Status.UNAUTHENTICATED
        assert "only collector credentials" in (pinged.value.message or "")
    assert len(stored_points(coord, a.run_id)) == 1
    assert stored_points(coord, b.run_id) == []


def test_the_control_gateway_refuses_a_collector_credential(coord: CoordinatorProcess) -> None:
    launched = launch_member(coord, "not-control")

    async def connect() -> None:
        async with node_stream(coord.control, coord.ca_path, launched.credential, launched.node_id):
            raise AssertionError("the control gateway accepted a collector credential")

    with pytest.raises(GRPCError) as caught:
        asyncio.run(connect())
    assert caught.value.status is Status.PERMISSION_DENIED
    assert "only the telemetry gateway" in (caught.value.message or "")


def test_a_full_spool_pauses_reading_and_loses_nothing(tmp_path: Path) -> None:
    with start_coordinator(tmp_path / "coord") as coord:
        launched = launch_member(coord, "full")
        telemetry = tmp_path / "telemetry"
        telemetry.mkdir()
        collector = CollectorProcess(
            coord, launched, telemetry, tmp_path / "collector", "--max-spool-points", "200"
        )
        coord.stop()
        collector.start()
        # Small appends, each read as its own batch, while the gateway is unreachable.
        for round_ in range(10):
            write_jsonl(telemetry / "report.rank0.jsonl", round_ * 100, 100)
            # Each append read as its own batch: wait until it is spooled, or reading paused.
            wanted = (round_ + 1) * 100

            def spooled_or_paused(wanted: int = wanted) -> bool:
                return collector.spool_depth() >= wanted or "spool full" in collector.read_log()

            wait_until(f"append {round_} to be spooled or reading to pause", spooled_or_paused)
        wait_until("the collector to say it paused", lambda: "spool full" in collector.read_log())
        time.sleep(1.0)  # not a wait for an event: a paused collector must read nothing more
        # Paused, not dropping: at most one batch over the limit, the rest still in the file.
        assert 200 <= collector.spool_depth() <= 300
        coord.restart()
        collector.member_exited()
        assert collector.wait() == 0, collector.read_log()
        assert _steps(stored_points(coord, launched.run_id)) == list(range(1000))
        assert "reading resumed" in collector.read_log()
