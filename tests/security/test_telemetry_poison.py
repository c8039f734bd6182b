"""Telemetry cannot be poisoned, tried with real parts: a real coordinator, the real
``tuneplane-collector run`` process tailing a file while it is written, and hostile Ship calls
made with a member's real collector credential.

One bad line or point must cost exactly itself: it is refused on its own, counted as data loss
with its file and byte offset, and every good point around it arrives exactly once.
"""

from __future__ import annotations

import asyncio
import json
import math
import sqlite3
import subprocess
import time
from collections.abc import Iterator
from contextlib import closing
from pathlib import Path

import pytest
from grpclib.const import Status
from grpclib.exceptions import GRPCError
from tensorboardX.proto import event_pb2, summary_pb2

from tests.collector.delivery import (
    CollectorProcess,
    Launched,
    delivery_row,
    launch_member,
    stored_points,
)
from tests.coordinator.grpc_client import bearer, open_channel
from tests.support.coordinator import CoordinatorProcess, start_coordinator
from tests.support.processes import faketime_env, track, wait_until
from tuneplane.collector.ship_wire import columns
from tuneplane.collector.spool import SPOOL_FILE, Spool, SpooledPoint
from tuneplane.collector.tfrecord import frame
from tuneplane.proto import v1

WALL = 1.7e9

# Each poison line, and the kind of data-loss warning the collector must record for it.
POISON: list[tuple[bytes, str]] = [
    (b"[" * 200_000, "malformed-line"),  # nested deeper than any decoder allows
    (b'{"step": 1, "train/loss": ' + b"7" * 4400 + b"}", "malformed-line"),  # 4,400 digits
    (b'{"step": 1, "\\ud800": 1.0}', "malformed-line"),  # a lone surrogate as a tag
    (b'{"step": 1, "lo\\u0000ss": 1.0}', "malformed-line"),  # a NUL in a tag
    (b'{"step": 1, "train/loss": 1.0, "x": "\x00"}', "malformed-line"),  # a raw NUL byte
    (b'{"step": 1, "train/loss": \xff\xfe}', "malformed-line"),  # not UTF-8
    (b'{"step": 9223372036854775808, "train/loss": 1.0}', "not-shippable"),  # 2^63
    (b'{"step": -9223372036854775809, "train/loss": 1.0}', "not-shippable"),  # below int64
    (b'{"step": 1, "train/loss": 1.0, "wall_time": 1e300}', "not-shippable"),
    (b'{"step": 1, "train/loss": 1.0, "wall_time": NaN}', "not-shippable"),
    (b'{"step": 1, "train/loss": 1.0, "wall_time": 12.5}', "not-shippable"),  # before 2000
]


@pytest.fixture(scope="module")
def coord(tmp_path_factory: pytest.TempPathFactory) -> Iterator[CoordinatorProcess]:
    with start_coordinator(tmp_path_factory.mktemp("poison")) as c:
        yield c


def _good(step: int) -> bytes:
    return json.dumps(
        {"step": step, "metrics": {"train/loss": step * 0.5}, "wall_time": WALL + step}
    ).encode()


def _append(path: Path, lines: list[bytes]) -> list[int]:
    """Append ``lines`` (each with its newline, flushed); returns the byte offset of each."""
    offsets = []
    with open(path, "ab") as out:
        for line in lines:
            offsets.append(out.tell())
            out.write(line + b"\n")
            out.flush()
    return offsets


def _spool_warnings(state_dir: Path) -> list[tuple[str, int, str, int]]:
    path = state_dir / SPOOL_FILE
    with closing(sqlite3.connect(f"file:{path}?mode=ro", uri=True, timeout=10)) as db:
        rows = db.execute(
            "SELECT source, byte_offset, kind, data_loss FROM warnings ORDER BY byte_offset"
        ).fetchall()
    return [(str(r[0]), int(r[1]), str(r[2]), int(r[3])) for r in rows]


def _stored_steps(coord: CoordinatorProcess, run_id: str) -> list[int]:
    return sorted(step for _, _, step, _ in stored_points(coord, run_id))


def test_poison_lines_cost_only_themselves_and_are_counted_with_file_and_offset(
    coord: CoordinatorProcess, tmp_path: Path
) -> None:
    launched = launch_member(coord, "poison-lines")
    telemetry = tmp_path / "telemetry"
    telemetry.mkdir()
    metrics = telemetry / "metrics.jsonl"
    _append(metrics, [_good(s) for s in range(0, 100)])
    collector = CollectorProcess(coord, launched, telemetry, tmp_path / "collector")
    collector.start()
    wait_until("the first good points", lambda: len(stored_points(coord, launched.run_id)) == 100)
    # While the collector tails the file: poison lines, each between good lines.
    expected: list[tuple[str, int, str, int]] = []
    step = 100
    for line, kind in POISON:
        _append(metrics, [_good(step)])
        (offset,) = _append(metrics, [line])
        expected.append(("metrics.jsonl", offset, kind, 1))
        step += 1
    _append(metrics, [_good(s) for s in range(step, step + 100)])
    last = step + 100
    wait_until(
        "every good point behind the poison",
        lambda: len(stored_points(coord, launched.run_id)) == last,
    )
    collector.member_exited()
    assert collector.wait() == 0, collector.read_log()

    # Every good point exactly once, none of the poison.
    assert _stored_steps(coord, launched.run_id) == list(range(last))
    assert {tag for _, tag, _, _ in stored_points(coord, launched.run_id)} == {"train/loss"}
    # Each poison line is one data-loss record naming the file and the line's byte offset.
    assert _spool_warnings(collector.state_dir) == expected
    log = collector.read_log()
    for _, offset, kind, _ in expected:
        assert f"telemetry data loss source=metrics.jsonl offset={offset} kind={kind}" in log
    assert "Traceback" not in log
    assert "ship failed" not in log  # nothing was ever refused whole and retried
    row = delivery_row(coord, launched.run_id)
    assert row is not None
    assert (row["points_stored"], row["drained"]) == (last, 1)
    assert row["data_loss_warnings"] == len(POISON)
    assert row["last_point_wall_ms"] == int((WALL + last - 1) * 1000)


def _point(
    step: int,
    *,
    tag: str = "train/loss",
    source: str = "metrics.jsonl",
    wall: float | None = None,
    offset: int | None = None,
) -> v1.MetricPoint:
    when = WALL + step if wall is None else wall
    return v1.MetricPoint(
        source_id=source,
        offset=step * 100 if offset is None else offset,
        tag=tag,
        step=step,
        has_wall_time=True,
        wall_time=when,
        value=step * 0.5,
    )


def _ship(coord: CoordinatorProcess, who: Launched, request: v1.ShipRequest) -> v1.ShipReply:
    async def go() -> v1.ShipReply:
        channel = open_channel(coord.telemetry, coord.ca_path)
        try:
            stub = v1.TelemetryStub(channel, metadata=bearer(who.credential), timeout=10)
            reply: v1.ShipReply = await stub.ship(request)
            return reply
        finally:
            channel.close()

    return asyncio.run(go())


def test_a_hostile_ship_stores_the_good_points_and_refuses_each_bad_one(
    coord: CoordinatorProcess,
) -> None:
    who = launch_member(coord, "hostile-ship")
    good = [_point(s) for s in range(10)]
    bad = {
        "wall time 1e300": _point(20, wall=1e300),
        "infinite wall time": _point(21, wall=math.inf),
        "NaN wall time": _point(22, wall=math.nan),
        "wall time in 1970": _point(23, wall=12.5),
        "wall time a week ahead": _point(24, wall=time.time() + 7 * 86_400),
        "offset beyond int64": _point(25, offset=2**63),
        "empty tag": _point(27, tag=""),
        "tag of 2000 characters": _point(28, tag="t" * 2000),
        "empty source": _point(29, source=""),
    }
    points = [*good[:5], *bad.values(), *good[5:]]
    request = v1.ShipRequest(
        member=who.member, points=points, progress=v1.CollectorProgress(spool_points=len(points))
    )
    reply = _ship(coord, who, request)
    assert (reply.stored, reply.duplicates) == (10, 0)
    refused = {(r.source_id, r.offset, r.index): r.reason for r in reply.refused}
    assert set(refused) == {(p.source_id, p.offset, p.index) for p in bad.values()}
    for reason in refused.values():
        assert reason.endswith("; the point is not stored"), reason
    assert "2000-01-01" in refused[("metrics.jsonl", 2300, 0)]
    assert "more than a day" in refused[("metrics.jsonl", 2000, 0)]
    assert "empty" in refused[("metrics.jsonl", 2700, 0)]
    assert _stored_steps(coord, who.run_id) == list(range(10))

    # The same batch again (a collector that did not listen): nothing new is stored, the same
    # points are refused, and the store is unchanged.
    again = _ship(coord, who, request)
    assert (again.stored, again.duplicates) == (0, 10)
    assert {(r.source_id, r.offset, r.index) for r in again.refused} == set(refused)
    assert _stored_steps(coord, who.run_id) == list(range(10))
    row = delivery_row(coord, who.run_id)
    assert row is not None
    assert row["points_stored"] == 10
    assert row["last_point_wall_ms"] == int((WALL + 9) * 1000)

    # A NUL in any string of the call is refused whole, naming the field, by the listener's
    # check of every decoded string; an honest collector never sends one (it refuses such a
    # name before spooling), so no honest batch can be blocked by it.
    nul = v1.ShipRequest(member=who.member, points=[_point(50), _point(51, tag="lo\x00ss")])
    with pytest.raises(GRPCError) as caught:
        _ship(coord, who, nul)
    assert caught.value.status is Status.INVALID_ARGUMENT
    assert "points[1].tag" in (caught.value.message or "")
    assert _stored_steps(coord, who.run_id) == list(range(10))

    # The compact column form is held to the same rule.
    columns = v1.ShipRequest(
        member=who.member,
        columns=_columns([_point(40), _point(41, wall=1e300), _point(42)]),
    )
    reply = _ship(coord, who, columns)
    assert reply.stored == 2
    assert [(r.offset, r.index) for r in reply.refused] == [(4100, 0)]
    assert _stored_steps(coord, who.run_id) == [*range(10), 40, 42]


def _columns(points: list[v1.MetricPoint]) -> v1.PointColumns:
    return columns(
        [
            SpooledPoint(n, p.source_id, p.offset, p.index, p.tag, p.step, p.wall_time, p.value)
            for n, p in enumerate(points, 1)
        ]
    )


def test_a_spool_written_before_the_rule_holds_nothing_back(
    coord: CoordinatorProcess, tmp_path: Path
) -> None:
    """A spool written before these rules (an upgraded Node) holds points no gateway takes:
    the collector records each with its file and offset, drops it, and delivers the rest."""
    launched = launch_member(coord, "old-spool")
    state_dir = tmp_path / "collector"
    state_dir.mkdir()
    spool = Spool.open(state_dir / SPOOL_FILE)
    spool.close()
    with closing(sqlite3.connect(state_dir / SPOOL_FILE, isolation_level=None)) as db:
        db.executemany(
            "INSERT INTO points (source_id, byte_offset, value_index, tag, step, wall_time, "
            "value) VALUES (?, ?, ?, ?, ?, ?, ?)",
            [
                ("old.jsonl", 0, 0, "train/loss", 0, WALL, 0.0),
                ("old.jsonl", 64, 0, "train/loss", 1, 1e300, 0.5),
                ("old.jsonl", 96, 0, "train\x00loss", 1, WALL + 1, 0.5),
                ("old.jsonl", 128, 0, "train/loss", 2, WALL + 2, 1.0),
            ],
        )
    telemetry = tmp_path / "telemetry"
    telemetry.mkdir()
    _append(telemetry / "metrics.jsonl", [_good(s) for s in range(3, 50)])
    collector = CollectorProcess(coord, launched, telemetry, state_dir)
    collector.start()
    collector.member_exited()
    assert collector.wait() == 0, collector.read_log()
    assert _stored_steps(coord, launched.run_id) == [0, *range(2, 50)]
    assert collector.spool_depth() == 0
    # Neither goes on the wire: the collector applies the rule to what it ships, too.
    assert _spool_warnings(state_dir) == [
        ("old.jsonl", 64, "not-shippable", 1),
        ("old.jsonl", 96, "not-shippable", 1),
    ]
    log = collector.read_log()
    for offset in (64, 96):
        assert f"telemetry data loss source=old.jsonl offset={offset} kind=not-shippable" in log
    assert "ship failed" not in log
    row = delivery_row(coord, launched.run_id)
    assert row is not None
    assert (row["drained"], row["data_loss_warnings"]) == (1, 2)


def test_points_the_gateway_refuses_are_dropped_as_data_loss_not_retried(
    coord: CoordinatorProcess, tmp_path: Path
) -> None:
    """The Node's clock runs a day ahead of the coordinator's (libfaketime on the collector).
    Points stamped 36 h ahead of real time pass the collector's rule and fail the gateway's:
    the gateway stores the rest of each batch and names them; the collector records them as
    refused-by-gateway data loss with file and offset and never sends them again."""
    env = faketime_env("+1d", "to run the collector with a clock a day ahead")
    launched = launch_member(coord, "skewed-node")
    telemetry = tmp_path / "telemetry"
    telemetry.mkdir()
    ahead = time.time() + 36 * 3600
    lines: list[bytes] = []
    for step in range(60):
        wall = ahead if step % 20 == 7 else WALL + step
        lines.append(
            json.dumps({"step": step, "metrics": {"train/loss": 0.5}, "wall_time": wall}).encode()
        )
    offsets = _append(telemetry / "metrics.jsonl", lines)
    collector = CollectorProcess(coord, launched, telemetry, tmp_path / "collector")
    with open(collector.log_path, "ab") as log_file:
        collector.proc = subprocess.Popen(
            collector.argv, stdout=log_file, stderr=subprocess.STDOUT, env=env
        )
    track(collector.proc)
    collector.member_exited()
    assert collector.wait() == 0, collector.read_log()

    refused = [7, 27, 47]
    assert _stored_steps(coord, launched.run_id) == [s for s in range(60) if s not in refused]
    assert _spool_warnings(collector.state_dir) == [
        ("metrics.jsonl", offsets[s], "refused-by-gateway", 1) for s in refused
    ]
    log = collector.read_log()
    for s in refused:
        assert (
            f"telemetry data loss source=metrics.jsonl offset={offsets[s]} "
            "kind=refused-by-gateway reason=the wall time"
        ) in log
    assert "ship failed" not in log
    assert collector.spool_depth() == 0
    row = delivery_row(coord, launched.run_id)
    assert row is not None
    assert (row["points_stored"], row["drained"], row["data_loss_warnings"]) == (57, 1, 3)


def test_an_event_file_record_out_of_range_costs_only_itself(
    coord: CoordinatorProcess, tmp_path: Path
) -> None:
    """The same rule holds for TensorBoard event files: a record with a wall time of 1e300 or
    a negative one is refused on its own, the records around it arrive."""
    launched = launch_member(coord, "poison-events")
    telemetry = tmp_path / "telemetry"
    telemetry.mkdir()
    bad_walls = {5: 1e300, 9: -3.0}
    data = b""
    offsets: dict[int, int] = {}
    for step in range(12):
        event = event_pb2.Event(
            wall_time=bad_walls.get(step, WALL + step),
            step=step,
            summary=summary_pb2.Summary(
                value=[summary_pb2.Summary.Value(tag="eval/acc", simple_value=step / 10)]
            ),
        )
        offsets[step] = len(data)
        data += frame(event.SerializeToString())
    name = "events.out.tfevents.1700000000.host"
    (telemetry / name).write_bytes(data)
    collector = CollectorProcess(coord, launched, telemetry, tmp_path / "collector")
    collector.start()
    collector.member_exited()
    assert collector.wait() == 0, collector.read_log()
    assert _stored_steps(coord, launched.run_id) == [s for s in range(12) if s not in bad_walls]
    assert _spool_warnings(collector.state_dir) == [
        (name, offsets[s], "not-shippable", 1) for s in sorted(bad_walls)
    ]
