"""Restart and hparams marks cannot be used against the store, tried with real parts: a real
coordinator and hostile Ship calls made with members' real collector credentials.

A bad mark is refused on its own, named in the reply, and changes nothing: no restart is
recorded, no point is orphaned, no hparam is stored. A mark only ever touches the points of the
member whose credential shipped it.
"""

from __future__ import annotations

import asyncio
import json
import sqlite3
from collections.abc import Iterator
from contextlib import closing
from pathlib import Path
from typing import Any

import pytest
from grpclib.const import Status
from grpclib.exceptions import GRPCError
from tensorboard.plugins.hparams import api_pb2, plugin_data_pb2
from tensorboardX.proto import event_pb2, summary_pb2
from tensorboardX.record_writer import RecordWriter

from tests.collector.delivery import CollectorProcess, Launched, launch_member
from tests.coordinator.grpc_client import bearer, open_channel
from tests.support.coordinator import CoordinatorProcess, start_coordinator
from tuneplane.proto import v1

SOURCE = "tb/run/events.out.tfevents.1"
WALL = 1.7e9


@pytest.fixture(scope="module")
def coord(tmp_path_factory: pytest.TempPathFactory) -> Iterator[CoordinatorProcess]:
    with start_coordinator(tmp_path_factory.mktemp("marks")) as c:
        yield c


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


def _points(who: Launched, source: str = SOURCE) -> v1.ShipRequest:
    return v1.ShipRequest(
        member=who.member,
        points=[
            v1.MetricPoint(
                source_id=source,
                offset=100 * step,
                tag="loss",
                step=step,
                has_wall_time=True,
                wall_time=WALL + step,
                value=float(step),
            )
            for step in range(10)
        ],
    )


def _restart(step: int, offset: int = 5000, **fields: Any) -> v1.RestartMark:
    values: dict[str, Any] = {"source_id": "tb/run/events.out.tfevents.2", "all_tags": True}
    values.update(fields)
    return v1.RestartMark(offset=offset, step=step, **values)


def _store(coord: CoordinatorProcess, sql: str, *args: Any) -> list[Any]:
    path = coord.state_dir / "telemetry.db"
    with closing(sqlite3.connect(f"file:{path}?mode=ro", uri=True, timeout=10)) as db:
        return db.execute(sql, args).fetchall()


def _state(coord: CoordinatorProcess, run_id: str) -> dict[str, Any]:
    """Everything a mark could change for ``run_id``."""
    return {
        "points": _store(
            coord,
            "SELECT p.step, p.orphaned FROM metric_points p JOIN metric_series s "
            "ON s.id = p.series_id WHERE s.run_id = ? ORDER BY p.step",
            run_id,
        ),
        "series": _store(
            coord,
            "SELECT points, orphaned, last_step, last_value FROM metric_series WHERE run_id = ?",
            run_id,
        ),
        "restarts": _store(coord, "SELECT * FROM metric_restarts WHERE run_id = ?", run_id),
        "hparams": _store(coord, "SELECT * FROM run_hparams WHERE run_id = ?", run_id),
        "metrics": _store(coord, "SELECT * FROM run_hparam_metrics WHERE run_id = ?", run_id),
    }


def test_bad_marks_are_refused_one_by_one_and_change_nothing(coord: CoordinatorProcess) -> None:
    who = launch_member(coord, "bad-marks")
    assert _ship(coord, who, _points(who)).stored == 10
    before = _state(coord, who.run_id)
    assert [o for _, o in before["points"]] == [0] * 10
    bad_restarts = {
        "system source": _restart(0, offset=1, source_id="system"),
        "empty source": _restart(0, offset=2, source_id=""),
        "too many tags": _restart(0, offset=3, all_tags=False, tags=[f"t{n}" for n in range(300)]),
        "empty tag": _restart(0, offset=4, all_tags=False, tags=[""]),
        "all tags and tags": _restart(0, offset=5, tags=["loss"]),
        "offset beyond int64": _restart(0, offset=2**63),
    }
    bad_hparams = {
        "long value": v1.HParamsMark(
            source_id=SOURCE, offset=7, hparams=[v1.HParam("lr", '"' + "x" * 2000 + '"')]
        ),
        "empty name": v1.HParamsMark(source_id=SOURCE, offset=8, hparams=[v1.HParam("", "1")]),
        "system source": v1.HParamsMark(
            source_id="system", offset=9, hparams=[v1.HParam("lr", "1")]
        ),
        "too many names": v1.HParamsMark(
            source_id=SOURCE, offset=10, metrics=[f"m{n}" for n in range(300)]
        ),
    }
    reply = _ship(
        coord,
        who,
        v1.ShipRequest(
            member=who.member,
            restarts=list(bad_restarts.values()),
            hparams=list(bad_hparams.values()),
        ),
    )
    refused = {(r.source_id, r.offset): r.reason for r in reply.refused}
    assert set(refused) == {(m.source_id, m.offset) for m in bad_restarts.values()} | {
        (m.source_id, m.offset) for m in bad_hparams.values()
    }
    for m in bad_restarts.values():
        assert refused[(m.source_id, m.offset)].endswith("; the restart mark is not stored")
    for h in bad_hparams.values():
        assert refused[(h.source_id, h.offset)].endswith("; the hparams record is not stored")
    assert "more than 256" in refused[("tb/run/events.out.tfevents.2", 3)]
    assert "more than 1024" in refused[(SOURCE, 7)]
    assert _state(coord, who.run_id) == before

    # Too many marks in one call is refused whole, before decoding when one field holds too
    # many, after when the two together do; either way it stores nothing.
    flood = v1.ShipRequest(member=who.member, restarts=[_restart(0, offset=n) for n in range(1001)])
    with pytest.raises(GRPCError) as caught:
        _ship(coord, who, flood)
    assert caught.value.status is Status.RESOURCE_EXHAUSTED
    assert "ShipRequest.restarts holds more than 1000" in (caught.value.message or "")
    both = v1.ShipRequest(
        member=who.member,
        restarts=[_restart(0, offset=n) for n in range(600)],
        hparams=[
            v1.HParamsMark(source_id=SOURCE, offset=n, hparams=[v1.HParam("lr", "1")])
            for n in range(600)
        ],
    )
    with pytest.raises(GRPCError) as caught:
        _ship(coord, who, both)
    assert caught.value.status is Status.INVALID_ARGUMENT
    assert "1200 restart and hparams marks, more than 1000" in (caught.value.message or "")
    assert _state(coord, who.run_id) == before

    # The positive control: a good mark does orphan (so the checks above could have failed).
    reply = _ship(coord, who, v1.ShipRequest(member=who.member, restarts=[_restart(6)]))
    assert not reply.refused
    after = _state(coord, who.run_id)
    assert [o for _, o in after["points"]] == [0] * 6 + [1] * 4
    assert after["series"] == [(6, 4, 5, 5.0)]


def test_a_mark_touches_only_the_shipping_members_points(coord: CoordinatorProcess) -> None:
    victim = launch_member(coord, "mark-victim")
    attacker = launch_member(coord, "mark-attacker")
    assert _ship(coord, victim, _points(victim)).stored == 10
    before = _state(coord, victim.run_id)

    # The attacker names the victim's source in a START and in hparams, under its own member.
    reply = _ship(
        coord,
        attacker,
        v1.ShipRequest(
            member=attacker.member,
            restarts=[_restart(0)],
            hparams=[v1.HParamsMark(source_id=SOURCE, offset=1, hparams=[v1.HParam("lr", "9")])],
        ),
    )
    assert not reply.refused
    assert _state(coord, victim.run_id) == before

    # Naming the victim's member outright is refused before anything is read.
    with pytest.raises(GRPCError) as caught:
        _ship(
            coord,
            attacker,
            v1.ShipRequest(member=victim.member, restarts=[_restart(0, offset=6000)]),
        )
    assert caught.value.status is Status.PERMISSION_DENIED
    assert _state(coord, victim.run_id) == before


def _summary_event(step: int, values: list[summary_pb2.Summary.Value]) -> bytes:
    event = event_pb2.Event(step=step, wall_time=WALL + step)
    event.summary.value.extend(values)
    return bytes(event.SerializeToString())


def _hparams_value(metric_tags: list[str], hparams: dict[str, str]) -> summary_pb2.Summary.Value:
    if metric_tags:
        data = plugin_data_pb2.HParamsPluginData(
            version=0,
            experiment=api_pb2.Experiment(
                metric_infos=[
                    api_pb2.MetricInfo(name=api_pb2.MetricName(tag=t)) for t in metric_tags
                ]
            ),
        )
        tag = "_hparams_/experiment"
    else:
        info = plugin_data_pb2.SessionStartInfo()
        for name, value in hparams.items():
            info.hparams[name].string_value = value
        data = plugin_data_pb2.HParamsPluginData(version=0, session_start_info=info)
        tag = "_hparams_/session_start_info"
    metadata = summary_pb2.SummaryMetadata(
        plugin_data=summary_pb2.SummaryMetadata.PluginData(
            plugin_name="hparams", content=data.SerializeToString()
        )
    )
    return summary_pb2.Summary.Value(tag=tag, metadata=metadata)


def test_a_file_with_unshippable_names_in_its_marks_still_drains(
    coord: CoordinatorProcess, tmp_path: Path
) -> None:
    """A NUL in a tag or an hparam name would make the gateway refuse the whole call, so the
    collector drops such names from its marks before spooling: the member's telemetry still
    drains, the restart still applies to the good tag, and the rest of the hparams arrive."""
    who = launch_member(coord, "nul-marks")
    telemetry = tmp_path / "telemetry"
    run = telemetry / "old"
    run.mkdir(parents=True)
    writer = RecordWriter(str(run / "events.out.tfevents.1000.host"))
    for step in range(6):
        value = summary_pb2.Summary.Value(tag="loss", simple_value=float(step))
        writer.write(_summary_event(step, [value]))
    # A step going back (no file_version), naming a good tag and one holding a NUL.
    back = [
        summary_pb2.Summary.Value(tag="loss", simple_value=100.0),
        summary_pb2.Summary.Value(tag="lo\x00ss", simple_value=1.0),
    ]
    writer.write(_summary_event(2, back))
    writer.write(_summary_event(3, [_hparams_value(["acc", "ac\x00c"], {})]))
    writer.write(_summary_event(3, [_hparams_value([], {"opt": "adam", "b\x00ad": "x"})]))
    writer.close()

    collector = CollectorProcess(coord, who, telemetry, tmp_path / "collector")
    collector.start()
    collector.member_exited()
    assert collector.wait() == 0, collector.read_log()
    state = _state(coord, who.run_id)
    visible = sorted(step for step, orphaned in state["points"] if not orphaned)
    assert visible == [0, 1, 2]  # 2..5 of the first writing orphaned; the new 2 kept
    restarts = [(r[5], json.loads(r[6])) for r in state["restarts"]]
    assert [(step, [t.rsplit("/", 1)[-1] for t in tags]) for step, tags in restarts] == [
        (2, ["loss"])
    ]
    assert [(r[4], r[5]) for r in state["hparams"]] == [("opt", '"adam"')]
    assert [r[4].rsplit("/", 1)[-1] for r in state["metrics"]] == ["acc"]
    warnings = _store_spool_warnings(tmp_path / "collector")
    assert "hparam-skipped" in {kind for _, kind in warnings}


def _store_spool_warnings(state_dir: Path) -> list[tuple[int, str]]:
    path = state_dir / "spool.db"
    with closing(sqlite3.connect(f"file:{path}?mode=ro", uri=True, timeout=10)) as db:
        rows = db.execute("SELECT byte_offset, kind FROM warnings").fetchall()
    return [(int(r[0]), str(r[1])) for r in rows]
