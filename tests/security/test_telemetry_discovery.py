"""Following a member's whole output directory as a workload could abuse it, with real
processes: links to another member's files, a directory swapped for a link, a FIFO named like
telemetry; and the variables TunePlane sets, which a Job cannot set."""

from __future__ import annotations

import asyncio
import json
import os
import sqlite3
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from grpclib import GRPCError
from grpclib.const import Status

from tests.collector.delivery import (
    CollectorProcess,
    delivery_row,
    launch_member,
    stored_points,
    write_jsonl,
)
from tests.coordinator.grpc_client import api_client, jobspec
from tests.support.coordinator import CoordinatorProcess, start_coordinator

TP = [sys.executable, "-m", "tuneplane.coordinator.cli.tp"]


@pytest.fixture(scope="module")
def coord(tmp_path_factory: pytest.TempPathFactory) -> Iterator[CoordinatorProcess]:
    with start_coordinator(tmp_path_factory.mktemp("discovery")) as c:
        yield c


def test_links_and_fifos_under_the_output_dir_are_never_read(
    coord: CoordinatorProcess, tmp_path: Path
) -> None:
    # Another member's telemetry on the same Node, which this workload must not ship as its own.
    other = tmp_path / "other-member"
    write_jsonl(other / "telemetry" / "report.rank0.jsonl", 0, 50, tag="other/secret")
    before = (other / "telemetry" / "report.rank0.jsonl").read_bytes()
    launched = launch_member(coord, "links")
    out = tmp_path / "out"
    telemetry = out / "telemetry"
    write_jsonl(telemetry / "report.rank0.jsonl", 0, 20)
    os.symlink(other / "telemetry" / "report.rank0.jsonl", telemetry / "report.rank1.jsonl")
    os.symlink(other / "telemetry", out / "tensorboard")  # the TensorBoard directory, a link
    os.symlink(other, out / "tb")
    os.mkfifo(telemetry / "pipe.jsonl")  # opening it for reading would block a reader
    collector = CollectorProcess(
        coord, launched, telemetry, tmp_path / "collector", "--out-dir", str(out)
    )
    collector.start()
    collector.member_exited()
    assert collector.wait() == 0, collector.read_log()
    points = stored_points(coord, launched.run_id)
    assert {(source, tag) for source, tag, _, _ in points} == {
        ("telemetry/report.rank0.jsonl", "train/loss")
    }
    assert sorted(step for _, _, step, _ in points) == list(range(20))
    row = delivery_row(coord, launched.run_id)
    assert row is not None and row["data_loss_warnings"] == 0
    assert (other / "telemetry" / "report.rank0.jsonl").read_bytes() == before


def _tp(root: Path, context: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*TP, "--context", str(context), *args],
        cwd=root, capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip


def _previews(coord: CoordinatorProcess) -> int:
    with sqlite3.connect(coord.state_dir / "coordinator.db", timeout=10) as db:
        count: int = db.execute("SELECT count(*) FROM previews").fetchone()[0]
    return count


def _jobs(root: Path, coord: CoordinatorProcess) -> list[str]:
    done = _tp(root, coord.context_path, "job", "ls", "--json")
    assert done.returncode == 0, done.stderr
    return sorted(job["run_id"] for job in json.loads(done.stdout))


def test_variables_tuneplane_sets_are_refused_with_what_to_do_instead(
    coord: CoordinatorProcess, tmp_path: Path
) -> None:
    root = tmp_path / "proj"
    root.mkdir()
    for args in (
        ("init", str(root), "--name", "tbenv"),
        ("new", "job", "--method", "custom/custom"),
    ):
        assert _tp(root, coord.context_path, *args).returncode == 0
    previews, jobs = _previews(coord), _jobs(root, coord)
    for name in ("TUNEPLANE_TENSORBOARD_DIR", "TENSORBOARD_LOGDIR", "AIP_TENSORBOARD_LOG_DIR"):
        done = _tp(
            root, coord.context_path,
            "submit", "job", "--profile", "cpu:0", "--env", f"{name}=/tmp/tb", "--preview",
        )  # fmt: skip
        assert done.returncode != 0
        assert f"--env {name}" in done.stderr, done.stderr
        assert "TunePlane sets it for every member" in done.stderr
        assert "$TENSORBOARD_LOGDIR" in done.stderr and "are collected" in done.stderr
    # A JobSpec built by hand, past tp, is refused by the coordinator with the same sentence.
    spec = jobspec(gpus=1, project="tbenv")
    spec["env"] = {"TENSORBOARD_LOGDIR": "/tmp/tb"}

    async def preview() -> None:
        async with api_client(coord.api, coord.ca_path, coord.admin_token) as api:
            await api.preview(spec)

    with pytest.raises(GRPCError) as caught:
        asyncio.run(preview())
    assert caught.value.status is Status.INVALID_ARGUMENT
    assert "'env.TENSORBOARD_LOGDIR' = '/tmp/tb': cannot be set by a Job" in (
        caught.value.message or ""
    )
    assert "TunePlane sets it for every member" in (caught.value.message or "")
    assert _previews(coord) == previews
    assert _jobs(root, coord) == jobs
