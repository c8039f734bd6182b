"""Telemetry where researchers put it, with real parts: a real coordinator, the real collector
process following a member's whole output directory, real TensorBoard and ``tuneplane.report``
writers making new directories while it runs, SIGKILL, and the file cap."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.collector.delivery import (
    CollectorProcess,
    delivery_row,
    launch_member,
    stored_points,
    write_jsonl,
)
from tests.collector.tb_writers import tensorboard_scalars
from tests.support.coordinator import CoordinatorProcess, start_coordinator
from tests.support.processes import track, untrack, wait_until

STEPS = 300
TP = [sys.executable, "-m", "tuneplane.coordinator.cli.tp"]

# TensorBoard runs appear one after the other (a new directory every 100 steps) in the script's
# own log directory and under TENSORBOARD_LOGDIR; tuneplane.report writes beside them.
WRITER = textwrap.dedent(
    """
    import os, sys, time
    from tensorboardX import SummaryWriter
    from tuneplane.report import finish, init, log

    out, steps = sys.argv[1], int(sys.argv[2])
    init(dir=os.path.join(out, "eval"))
    writers = {}
    for step in range(steps):
        run = f"run{step // 100}"
        if run not in writers:
            writers[run] = (SummaryWriter(f"{out}/tb/{run}", flush_secs=3600),
                            SummaryWriter(f"{out}/tensorboard/{run}", flush_secs=3600))
        mine, logdir = writers[run]
        mine.add_scalar("loss", 1.0 / (step + 1), step)
        logdir.add_scalar("loss", 2.0 / (step + 1), step)
        log({"acc": step / steps}, step=step)
        if step % 10 == 9:
            mine.flush()
            logdir.flush()
            time.sleep(0.05)
    for mine, logdir in writers.values():
        mine.close()
        logdir.close()
    finish()
    """
)


@pytest.fixture(scope="module")
def coord(tmp_path_factory: pytest.TempPathFactory) -> Iterator[CoordinatorProcess]:
    with start_coordinator(tmp_path_factory.mktemp("out_dir")) as c:
        yield c


def collector_for(
    coord: CoordinatorProcess, name: str, out: Path, state: Path, *extra: str
) -> tuple[str, CollectorProcess]:
    launched = launch_member(coord, name)
    (out / "telemetry").mkdir(parents=True)
    collector = CollectorProcess(
        coord, launched, out / "telemetry", state, "--out-dir", str(out), *extra
    )
    return launched.run_id, collector


def test_new_runs_under_the_output_dir_arrive_once_through_kill_9(
    coord: CoordinatorProcess, tmp_path: Path
) -> None:
    out = tmp_path / "out"
    run_id, collector = collector_for(coord, "outdir", out, tmp_path / "collector")
    collector.start()
    # The writer starts after the collector: every directory and file is new to it.
    writer = subprocess.Popen([sys.executable, "-c", WRITER, str(out), str(STEPS)])
    track(writer)
    try:
        for floor in (150, 450):

            def reached(floor: int = floor) -> bool:
                return len(stored_points(coord, run_id)) >= floor

            wait_until(f"{floor} points stored before a kill", reached)
            collector.kill()
            collector.start()
        assert writer.wait(timeout=60) == 0
        untrack(writer)
        collector.member_exited()
        assert collector.wait() == 0, collector.read_log()
    finally:
        if writer.poll() is None:
            writer.kill()
            writer.wait()
    points = stored_points(coord, run_id)
    # Nothing lost, nothing twice: one point per (source, tag, step).
    keys = Counter((source, tag, step) for source, tag, step, _ in points)
    assert max(keys.values()) == 1
    by_tag: dict[str, list[tuple[int, float]]] = {}
    for _, tag, step, value in points:
        by_tag.setdefault(tag, []).append((step, value))
    runs = [f"run{i}" for i in range(STEPS // 100)]
    assert sorted(by_tag) == sorted(
        ["eval/acc", *(f"tb/{r}/loss" for r in runs), *(f"{r}/loss" for r in runs)]
    )
    for run in runs:
        for tag, logdir in (
            (f"tb/{run}/loss", out / "tb" / run),
            (f"{run}/loss", out / "tensorboard" / run),
        ):
            expected = [(s, v) for s, _, v in tensorboard_scalars(logdir)["loss"]]
            assert sorted(by_tag[tag]) == expected, tag
    assert sorted(s for s, _ in by_tag["eval/acc"]) == list(range(STEPS))
    sources = {source for source, tag, _, _ in points if tag == "eval/acc"}
    assert sources == {"eval/report.rank0.jsonl"}
    row = delivery_row(coord, run_id)
    assert row is not None and row["data_loss_warnings"] == 0 and row["drained"] == 1


def test_the_file_cap_is_said_once_in_the_log_and_in_the_delivery_status(
    coord: CoordinatorProcess, tmp_path: Path
) -> None:
    out = tmp_path / "out"
    run_id, collector = collector_for(coord, "cap", out, tmp_path / "collector", "--max-files", "2")
    for run in ("a", "b", "c"):
        # Each its own tag: files with the same first bytes would be taken for copies.
        write_jsonl(out / "telemetry" / run / "report.rank0.jsonl", 0, 10, tag=f"{run}_loss")
    collector.start()
    wait_until("the followed files' points", lambda: len(stored_points(coord, run_id)) >= 20)
    wait_until("the cap in the log", lambda: "telemetry files not followed" in collector.read_log())
    # Restarted after a crash: the same two files are followed, the cap is not said again.
    collector.kill()
    collector.start()
    write_jsonl(out / "telemetry" / "a" / "report.rank0.jsonl", 10, 5, tag="a_loss")
    collector.member_exited()
    assert collector.wait() == 0, collector.read_log()
    points = stored_points(coord, run_id)
    assert Counter(tag for _, tag, _, _ in points) == {"a/a_loss": 15, "b/b_loss": 10}
    assert collector.read_log().count("telemetry files not followed") == 1
    row = delivery_row(coord, run_id)
    assert row is not None
    # One data-loss warning for the files that are not read, and `tp job show` says it.
    assert (row["data_loss_warnings"], row["drained"]) == (1, 1)
    shown = subprocess.run(
        [*TP, "--context", str(coord.context_path), "job", "show", run_id],
        capture_output=True, text=True, timeout=60, check=False,
        env={**os.environ, "COLUMNS": "200"},
    )  # fmt: skip
    assert shown.returncode == 0, shown.stderr
    assert "1 data-loss warning (values or files not read)" in shown.stdout, shown.stdout


def test_a_checkpoint_of_the_telemetry_dir_alone_is_kept_after_an_upgrade(
    coord: CoordinatorProcess, tmp_path: Path
) -> None:
    out = tmp_path / "out"
    run_id, collector = collector_for(coord, "upgrade", out, tmp_path / "collector")
    telemetry = out / "telemetry"
    # A collector from before --out-dir followed the telemetry directory alone, then stopped.
    upgraded_argv = collector.argv
    collector.argv = [a for a in upgraded_argv if a not in ("--out-dir", str(out))]
    write_jsonl(telemetry / "report.rank0.jsonl", 0, 100)
    collector.start()
    wait_until("the first points", lambda: len(stored_points(coord, run_id)) == 100)
    collector.kill()
    collector.argv = upgraded_argv
    # The upgraded one resumes its checkpoint: same stream names, nothing read twice. For this
    # member it keeps following the telemetry directory alone, so a report file elsewhere in
    # the output directory is not read (the next member's collector follows all of it).
    write_jsonl(telemetry / "report.rank0.jsonl", 100, 50)
    write_jsonl(out / "eval" / "report.rank0.jsonl", 0, 10, tag="eval/acc")
    collector.start()
    collector.member_exited()
    assert collector.wait() == 0, collector.read_log()
    points = stored_points(coord, run_id)
    assert sorted(step for _, _, step, _ in points) == list(range(150))
    assert {(source, tag) for source, tag, _, _ in points} == {("report.rank0.jsonl", "train/loss")}
    assert "the checkpoint follows the telemetry directory only" in collector.read_log()
