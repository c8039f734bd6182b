"""A collector given several telemetry gateways (coordinators sharing one store) follows
whichever answers, with real parts: the real collector process, real coordinators, a real
PostgreSQL store they share, and SIGKILL. Every point written reaches the store once."""

from __future__ import annotations

import asyncio
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from tests.collector.delivery import CollectorProcess, launch_member, stored_points, write_jsonl
from tests.coordinator.grpc_client import bearer, open_channel
from tests.support.coordinator import CoordinatorProcess, start_coordinator
from tests.support.postgres import PostgresServer
from tests.support.postgres import postgres_server as postgres_server
from tests.support.processes import track, untrack, wait_until
from tests.support.store_backend import StoreBackend, in_use, read, where_in
from tuneplane.coordinator.store.telemetry import TelemetryStore
from tuneplane.proto import v1

WRITER = (
    "import json, sys, time\n"
    "out = open(sys.argv[1], 'a')\n"
    "for step in range(int(sys.argv[2])):\n"
    "    out.write(json.dumps({'step': step, 'metrics': {'train/loss': step * 0.5,"
    " 'train/lr': 1.0}}) + '\\n')\n"
    "    if step % 500 == 0:\n"
    "        out.flush(); time.sleep(0.01)\n"
    "out.close()\n"
)


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def _gateways(collector: CollectorProcess, *addresses: str) -> None:
    """Give ``collector`` these gateways, in order, in place of the Commit's one."""
    argv = collector.argv
    at = argv.index("--gateway")
    del argv[at : at + 2]
    for address in reversed(addresses):
        argv[at:at] = ["--gateway", address]


def test_a_gateway_that_refuses_is_passed_over_at_once(tmp_path: Path) -> None:
    with start_coordinator(tmp_path / "coord") as coord:
        launched = launch_member(coord, "fallback")
        telemetry = tmp_path / "telemetry"
        write_jsonl(telemetry / "report.rank0.jsonl", 0, 300)
        collector = CollectorProcess(coord, launched, telemetry, tmp_path / "collector")
        dead = f"127.0.0.1:{_free_port()}"
        _gateways(collector, dead, coord.telemetry)
        collector.start()
        wait_until("the first points", lambda: len(stored_points(coord, launched.run_id)) == 300)
        write_jsonl(telemetry / "report.rank0.jsonl", 300, 200)
        collector.member_exited()
        assert collector.wait() == 0, collector.read_log()
        steps = sorted(step for _, _, step, _ in stored_points(coord, launched.run_id))
        assert steps == list(range(500))
        log = collector.read_log()
        # The refusing gateway is tried once, then the collector stays with the one that took
        # the points: no backoff, no second try of the first.
        assert log.count(f"telemetry gateway failed; trying the next one now gateway={dead}") == 1
        assert f"next={coord.telemetry}" in log
        assert "ship failed; retrying" not in log


def _shared_points(state_dir: Path, run_id: str) -> list[tuple[str, int, int, str, int, float]]:
    """Every stored point of the Job in the shared store: (source, offset, index, tag, step,
    value), duplicates included if there were any."""
    rows = read(
        where_in(state_dir, TelemetryStore),
        TelemetryStore,
        "SELECT s.source, p.source_offset, p.value_index, s.tag, p.step, p.value "
        "FROM metric_points p JOIN metric_series s ON s.id = p.series_id "
        "WHERE s.run_id = ? ORDER BY p.id",
        (run_id,),
    )
    return [(str(r[0]), int(r[1]), int(r[2]), str(r[3]), int(r[4]), float(r[5])) for r in rows]


def _second_coordinator(first: CoordinatorProcess, folder: Path) -> CoordinatorProcess:
    """Another coordinator on ``first``'s store: a copy of its state directory (the store's
    URL, the TLS certificate and CA, the admin token) without what one serve writes for itself."""
    shutil.copytree(
        first.state_dir,
        folder,
        ignore=shutil.ignore_patterns("serve.log", "endpoints.json", "tp-context.json"),
    )
    return CoordinatorProcess(folder, ["--heartbeat-interval", "0.5", "--heartbeat-timeout", "3"])


async def _ship_again(
    gateway: str, ca: Path, credential: str, member: v1.MemberRef, point: v1.MetricPoint
) -> v1.ShipReply:
    channel = open_channel(gateway, ca)
    try:
        stub = v1.TelemetryStub(channel, metadata=bearer(credential), timeout=10)
        return await stub.ship(v1.ShipRequest(member=member, points=[point]))
    finally:
        channel.close()


@pytest.mark.timeout(240)
def test_the_leader_killed_mid_ship_the_collector_moves_on_and_stores_each_point_once(
    postgres_server: PostgresServer, tmp_path: Path
) -> None:
    with (
        in_use(StoreBackend("postgresql", postgres_server)),
        start_coordinator(tmp_path / "a") as first,
    ):
        launched = launch_member(first, "leader")
        second = _second_coordinator(first, tmp_path / "b" / "coordinator")
        second_telemetry = f"127.0.0.1:{_free_port()}"
        telemetry = tmp_path / "telemetry"
        telemetry.mkdir()
        total = 8000
        writer = subprocess.Popen(
            [sys.executable, "-c", WRITER, str(telemetry / "metrics.jsonl"), str(total)]
        )
        track(writer)
        collector = CollectorProcess(first, launched, telemetry, tmp_path / "collector")
        _gateways(collector, first.telemetry, second_telemetry)
        try:
            collector.start()
            wait_until(
                "points stored through the first coordinator",
                lambda: len(_shared_points(first.state_dir, launched.run_id)) >= 2000,
            )
            # SIGKILL while the collector ships: a batch may be in flight, stored or not.
            first.kill()
            second.start(ports=(0, 0, int(second_telemetry.rsplit(":", 1)[1])))
            assert writer.wait(timeout=60) == 0
            untrack(writer)
            collector.member_exited()
            assert collector.wait(timeout=120) == 0, collector.read_log()
            points = _shared_points(first.state_dir, launched.run_id)
            by_tag: dict[str, list[int]] = {}
            for _, _, _, tag, step, _ in points:
                by_tag.setdefault(tag, []).append(step)
            # Nothing lost, nothing twice, whichever coordinator stored each point.
            assert sorted(by_tag) == ["train/loss", "train/lr"]
            for tag, steps in by_tag.items():
                assert sorted(steps) == list(range(total)), tag
            log = collector.read_log()
            assert f"trying the next one now gateway={first.telemetry}" in log, log
            assert f"shipping to telemetry gateway={second_telemetry}" in log, log
            # The dedup key is in the shared store: a point the first coordinator stored is a
            # duplicate to the second.
            source, offset, index, tag, step, value = points[0]
            again = v1.MetricPoint(
                source_id=source, offset=offset, index=index, tag=tag, step=step, value=value
            )
            reply = asyncio.run(
                _ship_again(
                    second.telemetry, second.ca_path, launched.credential, launched.member, again
                )
            )
            assert (reply.stored, reply.duplicates) == (0, 1)
        finally:
            if writer.poll() is None:
                writer.kill()
                writer.wait()
                untrack(writer)
            if collector.proc is not None and collector.proc.poll() is None:
                collector.kill()
            second.kill()
