"""A Slurm job Slurm requeued, as the coordinator reads its folders (no Slurm, real files): each
member's exit from the run that ended, never the first run's; each member stream as its runs'
log files one after the other, from any offset (a restarted coordinator's 0 included), bounded as
the log store is."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tuneplane.coordinator.server.slurm_executor import read_exits
from tuneplane.coordinator.server.slurm_logs import read_runs_from, run_files
from tuneplane.coordinator.slurm_attempt import MemberExit
from tuneplane.coordinator.store.logs import KEEP_BYTES
from tuneplane.proto.contract.slurm_attempt import member_dir, source_prefix
from tuneplane.runner.records import EXIT_FILE, ExitRecord


def test_each_run_has_its_member_folders_and_the_first_keeps_the_old_layout() -> None:
    folder = Path("/shared/run-1/attempt-2")
    assert member_dir(folder, 3) == folder / "member-3"
    assert member_dir(folder, 3, 0) == folder / "member-3"
    assert member_dir(folder, 3, 2) == folder / "restart-2" / "member-3"
    assert (source_prefix(0), source_prefix(2)) == ("", "restart-2/")
    with pytest.raises(ValueError, match="a restart count is 0 or more, not -1"):
        member_dir(folder, 0, -1)


def _exit(here: Path, code: int | None, signal: int | None, at: float) -> None:
    here.mkdir(parents=True, exist_ok=True)
    record = ExitRecord(code, signal, at, None, ())
    (here / EXIT_FILE).write_text(json.dumps(record.to_json()))


def test_the_exits_are_read_from_the_run_that_ended(tmp_path: Path) -> None:
    _exit(member_dir(tmp_path, 0), None, 15, 100.0)  # the first run, ended by the requeue
    _exit(member_dir(tmp_path, 1), None, 15, 100.0)
    _exit(member_dir(tmp_path, 0, 1), 0, None, 200.0)  # the requeued run
    assert read_exits(tmp_path, 2, 0) == [MemberExit(0, True, 0, 15, 100_000),
                                           MemberExit(1, True, 0, 15, 100_000)]  # fmt: skip
    # Member 1 left no record in the second run: none, not the first run's.
    assert read_exits(tmp_path, 2, 1) == [MemberExit(0, True, 0, 0, 200_000),
                                           MemberExit(1, False)]  # fmt: skip


def test_a_member_stream_is_its_runs_files_in_restart_order(tmp_path: Path) -> None:
    paths = run_files(tmp_path, 0, 2, "stdout")
    assert paths == [tmp_path / "member-0" / "stdout.log",
                     tmp_path / "restart-1" / "member-0" / "stdout.log",
                     tmp_path / "restart-2" / "member-0" / "stdout.log"]  # fmt: skip
    assert read_runs_from(paths, 0) == (0, b"")  # no run wrote anything yet
    paths[0].parent.mkdir(parents=True)
    paths[0].write_bytes(b"first\n")
    assert read_runs_from(paths, 0) == (0, b"first\n")
    assert read_runs_from(paths, 6) == (6, b"")
    # The run after it is requeued and has not started: nothing more; then it writes.
    paths[2].parent.mkdir(parents=True)
    paths[2].write_bytes(b"third\n")
    assert read_runs_from(paths, 6) == (6, b"third\n")
    # A coordinator that restarted reads from 0 again: the same bytes at the same offsets (the
    # log store keeps what is past its own offset only).
    assert read_runs_from(paths, 0) == (0, b"first\nthird\n")
    assert read_runs_from(paths, 3) == (3, b"st\nthird\n")
    assert read_runs_from(paths, 8) == (8, b"ird\n")


def test_a_member_stream_past_the_bound_gives_its_newest_bytes(tmp_path: Path) -> None:
    paths = run_files(tmp_path, 0, 1, "stderr")
    for path, fill in zip(paths, (b"a", b"b"), strict=True):
        path.parent.mkdir(parents=True)
        path.write_bytes(fill * (KEEP_BYTES - 10))
    start, data = read_runs_from(paths, 0)
    assert (start, len(data)) == (KEEP_BYTES - 20, KEEP_BYTES)
    assert data == b"a" * 10 + b"b" * (KEEP_BYTES - 10)
