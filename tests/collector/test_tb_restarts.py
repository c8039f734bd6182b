"""Restarted TensorBoard writers and hparams, end to end with real parts: real event files
(tensorboardX's SummaryWriter with ``purge_step``, and a writer that never wrote
``file_version``), the real collector process, a real coordinator, and the real ``tp``. What
``tp metrics --json`` returns is compared, point for point, with TensorBoard's own reader."""

from __future__ import annotations

import json
import posixpath
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from tensorboardX import SummaryWriter
from tensorboardX.proto import event_pb2
from tensorboardX.record_writer import RecordWriter

from tests.cli.tp_process import run_tp_as
from tests.collector.delivery import CollectorProcess, launch_member
from tests.collector.tb_writers import tensorboard_scalars
from tests.support.coordinator import CoordinatorProcess, start_coordinator
from tuneplane.runner import report

pytestmark = pytest.mark.timeout(240)


@pytest.fixture(scope="module")
def coord(tmp_path_factory: pytest.TempPathFactory) -> Iterator[CoordinatorProcess]:
    with start_coordinator(tmp_path_factory.mktemp("tbrestart")) as c:
        yield c


def tp_json(coord: CoordinatorProcess, *args: str) -> Any:
    done = run_tp_as(coord, None, *args, "--json")
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def write_restarted_run(logdir: Path) -> None:
    """A writer started with a SessionLog.START at 0, killed after step 9, restarted at 5:
    TensorBoard purges steps 5..9 of every tag of the first writer (the run's second START)."""
    first = SummaryWriter(str(logdir), filename_suffix=".1", purge_step=0)
    for step in range(10):
        first.add_scalar("loss", 10.0 - step, step)
        first.add_scalar("acc", step / 10, step)
    first.close()
    second = SummaryWriter(str(logdir), filename_suffix=".2", purge_step=5)
    for step in range(5, 8):
        second.add_scalar("loss", 100.0 + step, step)
        second.add_scalar("acc", 0.5 + step / 100, step)
    second.add_hparams({"lr": 0.01, "optimizer": "adam", "layers": 4}, {"hp/acc": 0.6})
    second.close()


def write_single_start_run(logdir: Path) -> None:
    """torch's usual restart: only the restarted writer has a START, the run's first, which
    TensorBoard's reader does not treat as a restart, so both writers' steps 5..7 stay."""
    first = SummaryWriter(str(logdir), filename_suffix=".1")
    for step in range(10):
        first.add_scalar("loss", float(step), step)
    first.close()
    second = SummaryWriter(str(logdir), filename_suffix=".2", purge_step=5)
    for step in range(5, 8):
        second.add_scalar("loss", 50.0 + step, step)
    second.close()


def _old_event(step: int, **values: float) -> bytes:
    event = event_pb2.Event(step=step, wall_time=1.7e9 + step)
    for tag, value in values.items():
        event.summary.value.add(tag=tag, simple_value=value)
    return bytes(event.SerializeToString())


def write_old_writer_run(logdir: Path) -> None:
    """Files without file_version: a step going back orphans the later points of its tags only,
    within a file and across the run's next file."""
    logdir.mkdir(parents=True)
    one = RecordWriter(str(logdir / "events.out.tfevents.1000.old.1"))
    for step in range(10):
        one.write(_old_event(step, loss=float(step), acc=step * 2.0))
    for step in (4, 5, 6):
        one.write(_old_event(step, loss=100.0 + step))
    for step in (7, 8):
        one.write(_old_event(step, loss=200.0 + step, acc=200.0 + step))
    one.close()
    two = RecordWriter(str(logdir / "events.out.tfevents.1000.old.2"))
    for step in (2, 3):
        two.write(_old_event(step, loss=300.0 + step))
    two.close()


def our_series(coord: CoordinatorProcess, run_id: str) -> dict[tuple[str, str], list[Any]]:
    """(run directory, TensorBoard tag) -> sorted [(step, value)], read with `tp metrics`."""
    listed = tp_json(coord, "metrics", run_id, "--raw")
    out: dict[tuple[str, str], list[Any]] = {}
    for t in listed["tags"]:
        series = tp_json(
            coord, "metrics", run_id, "--raw", "--tag", t["tag"], "--source", t["source"]
        )
        assert not series["downsampled"]
        key = (posixpath.dirname(t["source"]), t["tag"].rsplit("/", 1)[-1])
        out.setdefault(key, []).extend((b["first_step"], b["last"]) for b in series["buckets"])
    return {k: sorted(v) for k, v in out.items()}


def tensorboards_series(root: Path, runs: list[str]) -> dict[tuple[str, str], list[Any]]:
    out: dict[tuple[str, str], list[Any]] = {}
    for run in runs:
        for tag, points in tensorboard_scalars(root / run, purge=True).items():
            out[(run, tag)] = sorted((step, value) for step, _, value in points)
    return out


def test_tp_metrics_gives_the_series_tensorboards_reader_gives(
    coord: CoordinatorProcess, tmp_path: Path
) -> None:
    launched = launch_member(coord, "tbrestart")
    telemetry = tmp_path / "telemetry"
    runs = ["tb/restarted", "tb/single", "tb/old"]
    write_restarted_run(telemetry / runs[0])
    write_single_start_run(telemetry / runs[1])
    write_old_writer_run(telemetry / runs[2])
    report.init({"batch_size": 32, "schedule": "cosine"}, dir=telemetry)
    report.log({"train/loss": 1.5}, step=1)
    report.finish()

    collector = CollectorProcess(coord, launched, telemetry, tmp_path / "collector")
    collector.start()
    collector.member_exited()
    assert collector.wait() == 0, collector.read_log()

    expected = tensorboards_series(telemetry, runs)
    got = our_series(coord, launched.run_id)
    for key, points in expected.items():
        assert got.get(key) == points, key
    # The scenario really purges: TensorBoard dropped the first writer's 5..9 and the old
    # writer's overtaken points, and kept both writers' 5..7 where the START was the first.
    assert [s for s, _ in expected[("tb/restarted", "loss")]] == [0, 1, 2, 3, 4, 5, 6, 7]
    assert expected[("tb/old", "loss")] == [(0, 0.0), (1, 1.0), (2, 302.0), (3, 303.0)]
    assert len(expected[("tb/old", "acc")]) == 12
    assert [s for s, _ in expected[("tb/single", "loss")]].count(6) == 2

    # The canonical (merged) view and its summary honour the same purge.
    merged = tp_json(coord, "metrics", launched.run_id)
    loss = [t for t in merged["tags"] if t["tag"].endswith("restarted/loss")]
    assert len(loss) == 1, merged["tags"]
    assert (loss[0]["points"], loss[0]["last_step"], loss[0]["last_value"]) == (8, 7, 107.0)
    whole = tp_json(coord, "metrics", launched.run_id, "--tag", loss[0]["tag"])
    assert (
        sorted((b["first_step"], b["last"]) for b in whole["buckets"])
        == expected[("tb/restarted", "loss")]
    )

    # A bounded, downsampled read skips orphaned points too: counts, minima and maxima are
    # those of the points TensorBoard keeps.
    for t in tp_json(coord, "metrics", launched.run_id, "--raw")["tags"]:
        key = (posixpath.dirname(t["source"]), t["tag"].rsplit("/", 1)[-1])
        full = tp_json(
            coord, "metrics", launched.run_id, "--raw", "--tag", t["tag"], "--source", t["source"]
        )
        small = tp_json(
            coord, "metrics", launched.run_id, "--raw", "--tag", t["tag"],
            "--source", t["source"], "--max-points", "2",
        )  # fmt: skip
        values = [b["last"] for b in full["buckets"]]
        assert small["total_points"] == len(values), key
        assert min(b["min"] for b in small["buckets"]) == min(values), key
        assert max(b["max"] for b in small["buckets"]) == max(values), key

    visible = sum(len(v) for v in got.values())
    orphaned = _stored(coord, launched.run_id) - visible
    assert orphaned > 0
    delivery = tp_json(coord, "metrics", launched.run_id, "--delivery")
    assert delivery["members"][0]["orphaned_points"] == orphaned

    # hparams: TensorBoard's plugin data and tuneplane.report's record, in tp job show.
    shown = tp_json(coord, "job", "show", launched.run_id)
    by_source = {h["source"]: h for h in shown["hparams"]}
    tb = [h for s, h in by_source.items() if s.startswith("tb/restarted/")]
    assert len(tb) == 1
    assert tb[0]["hparams"] == {"lr": 0.01, "optimizer": "adam", "layers": 4.0}
    # Named as tp metrics names the run's tags (the run's directory in front, when it has one).
    assert [m.rsplit("/", 2)[-2:] for m in tb[0]["metrics"]] == [["hp", "acc"]]
    sdk = [h for s, h in by_source.items() if s.endswith(".jsonl")]
    assert [h["hparams"] for h in sdk] == [{"batch_size": 32, "schedule": "cosine"}]
    text = run_tp_as(coord, None, "job", "show", launched.run_id)
    assert text.returncode == 0, text.stderr
    assert "hparams" in text.stdout
    assert 'optimizer="adam"' in text.stdout
    assert "batch_size=32" in text.stdout


def _stored(coord: CoordinatorProcess, run_id: str) -> int:
    import sqlite3
    from contextlib import closing

    path = coord.state_dir / "telemetry.db"
    with closing(sqlite3.connect(f"file:{path}?mode=ro", uri=True, timeout=10)) as db:
        (count,) = db.execute(
            "SELECT COUNT(*) FROM metric_points p JOIN metric_series s ON s.id = p.series_id "
            "WHERE s.run_id = ?",
            (run_id,),
        ).fetchone()
    return int(count)
