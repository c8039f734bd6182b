"""Real parts for the delivery tests: a launched member's collector credential, the real
``tuneplane-collector run`` process, and reads of the coordinator's real telemetry store.

Rules: the test plays the Node over real gRPC (enroll, Prepare, Commit) so the credential is
the one the coordinator minted; the collector is the real CLI in its own process, reaped by
whoever started it; store reads open ``telemetry.db`` read-only with plain sqlite3.
"""

from __future__ import annotations

import asyncio
import json
import signal
import sqlite3
import subprocess
import sys
from collections.abc import Iterator
from contextlib import closing, contextmanager
from pathlib import Path
from typing import Any

import attrs
import psutil

from tests.coordinator.grpc_client import api_client, enroll, jobspec, node_stream
from tests.support.coordinator import CoordinatorProcess
from tests.support.processes import track, untrack
from tuneplane.proto import v1
from tuneplane.runner.durable import write_json_atomic
from tuneplane.runner.records import RUNNER_FILE


@attrs.frozen
class Launched:
    """A member the coordinator committed, as the Node received it."""

    run_id: str
    member: v1.MemberRef
    credential: str
    telemetry_address: str
    node_id: str
    node_credential: str


def launch_member(coord: CoordinatorProcess, name: str) -> Launched:
    """Enroll a Node ``name``, submit a one-member Job, prepare it, and return its Commit."""
    token = coord.create_join_token()
    enrolled = asyncio.run(enroll(coord.control, coord.ca_path, token, name, 1))

    async def go() -> Launched:
        async with (
            api_client(coord.api, coord.ca_path, coord.admin_token) as api,
            node_stream(
                coord.control,
                coord.ca_path,
                enrolled.node_credential,
                enrolled.node_id,
                hostname=name,
                gpus=1,
            ) as node,
        ):
            receipt = await api.submit(jobspec(gpus=1, project=name), f"key-{name}")
            prepare: v1.Prepare = await node.expect("prepare")
            await node.send(prepare_reply=v1.PrepareReply(member=prepare.member, ok=True))
            commit: v1.Commit = await node.expect("commit")
            return Launched(
                receipt.run_id,
                commit.member,
                commit.collector_credential,
                commit.telemetry_address,
                enrolled.node_id,
                enrolled.node_credential,
            )

    return asyncio.run(go())


class CollectorProcess:
    """``tuneplane-collector run`` for one member; its log is ``<state_dir>/collector.log``."""

    def __init__(
        self,
        coord: CoordinatorProcess,
        launched: Launched,
        telemetry_dir: Path,
        state_dir: Path,
        *extra: str,
    ) -> None:
        self.state_dir = state_dir
        self.telemetry_dir = telemetry_dir
        self.credential_file = state_dir.parent / f"{state_dir.name}.credential"
        state_dir.mkdir(parents=True, exist_ok=True)
        self.credential_file.write_text(launched.credential + "\n")
        self.credential_file.chmod(0o600)
        self.log_path = state_dir / "collector.log"
        self.argv = [
            sys.executable,
            "-m",
            "tuneplane.collector.cli",
            "run",
            "--telemetry-dir",
            str(telemetry_dir),
            "--state-dir",
            str(state_dir),
            "--gateway",
            launched.telemetry_address or coord.telemetry,
            "--ca",
            str(coord.ca_path),
            "--credential-file",
            str(self.credential_file),
            "--run-id",
            launched.member.run_id,
            "--attempt",
            str(launched.member.attempt),
            "--member",
            str(launched.member.member_index),
            "--poll-interval",
            "0.1",
            *extra,
        ]
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(self.argv, stdout=log, stderr=subprocess.STDOUT)
        track(self.proc)

    def kill(self) -> None:
        """SIGKILL: the crash the spool and checkpoint must survive."""
        assert self.proc is not None
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait()
        untrack(self.proc)

    def member_exited(self) -> None:
        (self.state_dir / "member-exited").write_text("exited\n")

    def wait(self, timeout: float = 60.0) -> int:
        assert self.proc is not None
        try:
            rc = self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            raise AssertionError(f"the collector did not finish:\n{self.read_log()}") from None
        untrack(self.proc)
        return rc

    def read_log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def spool_depth(self) -> int:
        path = self.state_dir / "spool.db"
        if not path.exists():
            return 0
        with closing(sqlite3.connect(f"file:{path}?mode=ro", uri=True, timeout=10)) as db:
            try:
                return int(db.execute("SELECT COUNT(*) FROM points").fetchone()[0])
            except sqlite3.OperationalError:
                return 0


def stored_points(coord: CoordinatorProcess, run_id: str) -> list[tuple[str, str, int, float]]:
    """Every stored point of the Job: (source, tag, step, value), with duplicates if any."""
    path = coord.state_dir / "telemetry.db"
    with closing(sqlite3.connect(f"file:{path}?mode=ro", uri=True, timeout=10)) as db:
        rows = db.execute(
            "SELECT s.source, s.tag, p.step, p.value FROM metric_points p "
            "JOIN metric_series s ON s.id = p.series_id WHERE s.run_id = ? ORDER BY p.id",
            (run_id,),
        ).fetchall()
    return [(str(r[0]), str(r[1]), int(r[2]), float(r[3])) for r in rows]


def delivery_row(coord: CoordinatorProcess, run_id: str) -> dict[str, Any] | None:
    path = coord.state_dir / "telemetry.db"
    with closing(sqlite3.connect(f"file:{path}?mode=ro", uri=True, timeout=10)) as db:
        db.row_factory = sqlite3.Row
        row = db.execute("SELECT * FROM telemetry_delivery WHERE run_id = ?", (run_id,)).fetchone()
    return None if row is None else dict(row)


def write_jsonl(path: Path, first: int, count: int, tag: str = "train/loss") -> None:
    """Append ``count`` lines (steps ``first``..) the way tuneplane.report writes them."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as out:
        for step in range(first, first + count):
            record = {"step": step, "metrics": {tag: step * 0.5}, "wall_time": 1.7e9 + step}
            out.write(json.dumps(record) + "\n")


@contextmanager
def standing_runner(tmp_path: Path) -> Iterator[Path]:
    """A member directory whose real ``runner.json`` names a real, live process standing for
    the member's runner (what a collector samples); the process is killed on exit."""
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)"])
    track(proc)
    member_dir = tmp_path / "member"
    member_dir.mkdir()
    start = psutil.Process(proc.pid).create_time()
    write_json_atomic(member_dir / RUNNER_FILE, {"pid": proc.pid, "start_time": start,
                                                 "processes": []})  # fmt: skip
    try:
        yield member_dir
    finally:
        proc.kill()
        proc.wait()
        untrack(proc)
