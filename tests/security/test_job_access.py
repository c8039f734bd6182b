"""Logs, metrics and Jobs belong to their Job's owner, tried with real parts: a real coordinator
on loopback TLS, the test playing a Node over a real Connect stream, points shipped with the
member's real collector credential, and the real ``tp`` run as three users and an admin.

alice owns two Jobs: one in a project that shares with nobody, one in a project whose
``tuneplane.yaml`` says ``share_with: [carol]``. bob may read neither; carol may read the shared
one (never change it); the admin may read both. Every refusal is checked to have changed nothing.
"""

from __future__ import annotations

import asyncio
import json
import sqlite3
import subprocess
from collections.abc import Iterator
from contextlib import closing
from pathlib import Path
from typing import Any

import attrs
import pytest
from grpclib.exceptions import GRPCError

from tests.cli.tp_process import run_tp_as
from tests.coordinator.grpc_client import (
    Api,
    NodeStream,
    api_client,
    bearer,
    enroll,
    jobspec,
    node_stream,
    open_channel,
)
from tests.support.coordinator import CoordinatorProcess, start_coordinator
from tuneplane.proto import v1

COMMITTED = v1.MemberState(v1.MemberState.COMMITTED)
STARTING = v1.MemberState(v1.MemberState.STARTING)
RUNNING = v1.MemberState(v1.MemberState.RUNNING)
SECRET = "alice's private output: the key is 1234\n"
SHARED = "team output\n"


@attrs.frozen
class World:
    coord: CoordinatorProcess
    tokens: dict[str, Path]
    private: str  # alice's Job that is shared with nobody
    shared: str  # alice's Job whose project shares it with carol


async def _launch(
    api: Api, node: NodeStream, spec: dict[str, Any], key: str, seq: int, output: str
) -> tuple[str, v1.Commit]:
    """Submit as the api's user, play the Node through Prepare, Commit and running, and ship
    ``output`` as the member's stdout."""
    receipt = await api.submit(spec, key)
    prepare: v1.Prepare = await node.expect("prepare")
    await node.send(prepare_reply=v1.PrepareReply(member=prepare.member, ok=True))
    commit: v1.Commit = await node.expect("commit")
    # The member's lifecycle as a Node reports it: committed, starting, running.
    for step, state in enumerate((COMMITTED, STARTING, RUNNING)):
        await node.report(seq + step, prepare.member, state)
    await api.wait_for_state(receipt.run_id, "running")
    await node.send(
        log_chunk=v1.LogChunk(
            member=prepare.member, stream="stdout", offset=0, data=output.encode()
        )
    )
    await node.expect("log_ack")
    return receipt.run_id, commit


async def _ship(coord: CoordinatorProcess, commit: v1.Commit, steps: int) -> None:
    channel = open_channel(coord.telemetry, coord.ca_path)
    try:
        stub = v1.TelemetryStub(channel, metadata=bearer(commit.collector_credential), timeout=10)
        points = [
            v1.MetricPoint(
                source_id="metrics.jsonl",
                offset=step * 50,
                tag="train/loss",
                step=step,
                has_wall_time=True,
                wall_time=1.7e9 + step,
                value=1.0 / (step + 1),
            )
            for step in range(steps)
        ]
        reply = await stub.ship(v1.ShipRequest(member=commit.member, points=points))
        assert reply.stored == steps
    finally:
        channel.close()


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> Iterator[World]:
    root = tmp_path_factory.mktemp("access")
    with start_coordinator(root, heartbeat_interval=0.5, heartbeat_timeout=120) as coord:
        tokens = {name: coord.user_token_file(name) for name in ("alice", "bob", "carol")}
        node = asyncio.run(
            enroll(coord.control, coord.ca_path, coord.create_join_token(), "host-a", 2)
        )
        alice = tokens["alice"].read_text().strip()

        async def go() -> tuple[str, str]:
            async with (
                api_client(coord.api, coord.ca_path, alice) as api,
                node_stream(
                    coord.control, coord.ca_path, node.node_credential, node.node_id, "host-a"
                ) as stream,
            ):
                private, commit_a = await _launch(
                    api, stream, jobspec(gpus=1, project="secret"), "k-private", 1, SECRET
                )
                spec = {**jobspec(gpus=1, project="team"), "share_with": ["carol"]}
                shared, commit_b = await _launch(api, stream, spec, "k-shared", 4, SHARED)
                await _ship(coord, commit_a, 30)
                await _ship(coord, commit_b, 20)
                return private, shared

        private, shared = asyncio.run(go())
        yield World(coord, tokens, private, shared)


def _tp(
    world: World, who: str, *args: str, cwd: Path | None = None
) -> subprocess.CompletedProcess[str]:
    token = None if who == "admin" else world.tokens[who]
    return run_tp_as(world.coord, token, *args, cwd=cwd)


def _ok(world: World, who: str, *args: str) -> str:
    done = _tp(world, who, *args)
    assert done.returncode == 0, f"tp {' '.join(args)} as {who}: {done.stderr}"
    return done.stdout


def _refused(world: World, who: str, *args: str) -> str:
    done = _tp(world, who, *args)
    assert done.returncode != 0, f"tp {' '.join(args)} as {who} was allowed: {done.stdout}"
    assert done.stderr.startswith("error: the Job run-"), done.stderr
    assert "belongs to alice" in done.stderr, done.stderr
    assert f"does not share it with {who}" in done.stderr, done.stderr
    assert "Traceback" not in done.stderr
    return done.stderr


def _listed(world: World, who: str, *args: str) -> set[str]:
    return {job["run_id"] for job in json.loads(_ok(world, who, "job", "ls", "--json", *args))}


def _snapshot(world: World) -> dict[str, Any]:
    """What a refused read must leave as it was: Job states, reserved GPUs, stored points,
    stored log bytes, the decision log."""
    state = world.coord.state_dir

    def rows(db_name: str, sql: str) -> list[tuple[Any, ...]]:
        path = state / db_name
        with closing(sqlite3.connect(f"file:{path}?mode=ro", uri=True, timeout=10)) as db:
            return sorted(tuple(r) for r in db.execute(sql).fetchall())

    return {
        "jobs": rows("coordinator.db", "SELECT run_id, state, updated_at_ms FROM jobs ORDER BY 1"),
        "decisions": rows("coordinator.db", "SELECT COUNT(*) FROM decisions"),
        "gpus": rows("coordinator.db", "SELECT node_id, gpu_index, run_id FROM reservations"),
        "points": rows("telemetry.db", "SELECT series_id, step, value FROM metric_points"),
        "logs": rows("logs.db", "SELECT run_id, stream, next_offset, kept_bytes FROM log_streams"),
    }


def test_another_user_can_read_none_of_a_job_and_nothing_changes(world: World) -> None:
    before = _snapshot(world)
    for run_id in (world.private, world.shared):
        _refused(world, "bob", "logs", run_id)
        _refused(world, "bob", "logs", run_id, "--stderr")
        _refused(world, "bob", "metrics", run_id)
        _refused(world, "bob", "metrics", run_id, "--tag", "train/loss")
        _refused(world, "bob", "metrics", run_id, "--raw")
        _refused(world, "bob", "metrics", run_id, "--delivery")
        _refused(world, "bob", "job", "show", run_id)
    # Listing never shows them either, whatever the filter.
    assert _listed(world, "bob") == set()
    assert _listed(world, "bob", "--project", "secret") == set()
    assert _listed(world, "bob", "--state", "running") == set()
    # A read that is refused changes nothing, and neither does a refused change.
    cancel = _tp(world, "bob", "job", "cancel", world.private)
    assert cancel.returncode != 0 and "belongs to alice" in cancel.stderr
    assert _snapshot(world) == before


def test_the_project_shares_reading_with_the_users_it_names_and_nothing_more(
    world: World,
) -> None:
    assert _ok(world, "carol", "logs", world.shared) == SHARED
    assert "train/loss" in _ok(world, "carol", "metrics", world.shared)
    assert world.shared in _ok(world, "carol", "job", "show", world.shared)
    assert _listed(world, "carol") == {world.shared}
    assert _listed(world, "carol", "--mine") == set()
    # The other project shares nothing with carol.
    _refused(world, "carol", "logs", world.private)
    _refused(world, "carol", "metrics", world.private)
    _refused(world, "carol", "job", "show", world.private)
    # Reading is all it shares: carol cannot cancel the Job she may read.
    before = _snapshot(world)
    cancel = _tp(world, "carol", "job", "cancel", world.shared)
    assert cancel.returncode != 0 and "only its owner or an admin" in cancel.stderr
    assert _snapshot(world) == before


def test_the_owner_and_an_admin_read_everything(world: World) -> None:
    for who in ("alice", "admin"):
        assert _ok(world, who, "logs", world.private) == SECRET
        assert _ok(world, who, "logs", world.shared) == SHARED
        rows = json.loads(_ok(world, who, "metrics", world.private, "--json"))
        assert json.dumps(rows).count("train/loss") >= 1
        assert world.private in _ok(world, who, "job", "show", world.private)
        assert _listed(world, who) >= {world.private, world.shared}
    assert _listed(world, "alice", "--mine") == {world.private, world.shared}
    assert _listed(world, "admin", "--mine") == set()


def test_a_share_list_is_validated_before_anything_is_stored(world: World) -> None:
    """A JobSpec whose share_with is not a list of user names is refused at Preview."""
    alice = world.tokens["alice"].read_text().strip()
    before = _snapshot(world)

    async def preview(share: object) -> str:
        async with api_client(world.coord.api, world.coord.ca_path, alice) as api:
            try:
                await api.preview({**jobspec(gpus=1, project="team"), "share_with": share})
            except GRPCError as exc:
                return f"{exc.status.name}: {exc.message}"
            return "accepted"

    for share in ("carol", ["Carol"], [1]):
        refused = asyncio.run(preview(share))
        assert "INVALID_ARGUMENT" in refused and "share_with" in refused, refused
    assert _snapshot(world) == before


def test_share_with_in_tuneplane_yaml_reaches_the_job(world: World, tmp_path: Path) -> None:
    """The whole path a researcher takes: tuneplane.yaml, `tp submit`, then who may read."""
    root = tmp_path / "team2"
    made = _tp(world, "alice", "init", str(root), "--name", "team2", cwd=tmp_path)
    assert made.returncode == 0, made.stderr
    made = _tp(world, "alice", "new", "job", "--method", "custom/custom", cwd=root)
    assert made.returncode == 0, made.stderr
    project_file = root / "tuneplane.yaml"
    plain = project_file.read_text()

    # A share list that is not user names is refused by tp, naming the file and key; no Job.
    before = _snapshot(world)
    project_file.write_text(plain + "share_with: carol\n")
    bad = _tp(world, "alice", "submit", "job", "--profile", "h200:1", "--yes", "--json", cwd=root)
    assert bad.returncode != 0
    assert "tuneplane.yaml key 'share_with' must be a list" in bad.stderr, bad.stderr
    assert _snapshot(world) == before

    project_file.write_text(plain + "share_with: [carol]\n")
    done = _tp(world, "alice", "submit", "job", "--profile", "h200:1", "--yes", "--json", cwd=root)
    assert done.returncode == 0, done.stderr
    run_id = str(json.loads(done.stdout.strip().splitlines()[-1])["run_id"])
    assert run_id in _ok(world, "carol", "job", "show", run_id)
    assert run_id in _listed(world, "carol")
    _refused(world, "bob", "job", "show", run_id)
    assert run_id not in _listed(world, "bob")
