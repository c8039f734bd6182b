"""One session per Node, and reports a Node could not have made are refused (issue 8, Must 5).

A real coordinator and two real agents (``node-a``, ``node-b``) run as separate processes on
loopback TLS; researchers' Jobs go through the real ``tp``. The attacker is a hand-built gRPC
client speaking the Control service with ``node-b``'s control credential, read from its state
directory as a thief would. Each refusal is checked together with what must not have changed:
Job and member states, reserved GPUs, collector credentials, and the other Node's session.
"""

from __future__ import annotations

import asyncio
import json
import shutil
import sqlite3
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import anyio
import pytest
from grpclib import GRPCError
from grpclib.const import Status

from tests.agent.jobs import job, submit, tp
from tests.coordinator.grpc_client import NodeStream, api_client, node_stream
from tests.faults.jobs import wait_state
from tests.support.agent import AgentProcess, node_cli, two_agents, wait_until
from tests.support.coordinator import CoordinatorProcess
from tuneplane.proto import v1

pytestmark = pytest.mark.slow

EXITED = v1.MemberState(v1.MemberState.EXITED)
RUNNING = v1.MemberState(v1.MemberState.RUNNING)
STARTING = v1.MemberState(v1.MemberState.STARTING)
COMMITTED = v1.MemberState(v1.MemberState.COMMITTED)
ABORTED = v1.MemberState(v1.MemberState.ABORTED)
LOST = v1.MemberState(v1.MemberState.LOST)
HUGE_SEQ = 2**64 - 1
STREAM_TIMEOUT_S = 30.0


@pytest.fixture(scope="module")
def cluster(
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[tuple[CoordinatorProcess, AgentProcess, AgentProcess]]:
    with two_agents(tmp_path_factory.mktemp("sessions")) as cluster:
        yield cluster


def journal_id(path: Path) -> str:
    with sqlite3.connect(f"file:{path}?mode=ro", uri=True) as db:
        (value,) = db.execute("SELECT value FROM meta WHERE key = 'journal_id'").fetchone()
    return str(value)


def snapshot(coord: CoordinatorProcess) -> dict[str, Any]:
    """What a refused report must leave as it was, read from the coordinator's own files."""
    state = coord.state_dir
    with sqlite3.connect(f"file:{state / 'coordinator.db'}?mode=ro", uri=True) as db:
        jobs = db.execute("SELECT run_id, state, state_reason FROM jobs ORDER BY run_id").fetchall()
        members = db.execute(
            "SELECT run_id, attempt, member_index, node_id, state, known_state, has_exit, "
            "exit_code, out_dir FROM members ORDER BY run_id, attempt, member_index"
        ).fetchall()
        gpus = db.execute(
            "SELECT node_id, gpu_index, run_id, attempt, member_index FROM reservations "
            "ORDER BY node_id, gpu_index"
        ).fetchall()
        stops = db.execute("SELECT run_id, attempt, kind FROM attempt_stops").fetchall()
    with sqlite3.connect(f"file:{state / 'telemetry.db'}?mode=ro", uri=True) as db:
        credentials = db.execute(
            "SELECT token_hash, run_id, member_index, ended_at_ms FROM collector_credentials "
            "ORDER BY token_hash"
        ).fetchall()
    return {
        "jobs": jobs,
        "members": members,
        "gpus": gpus,
        "stops": stops,
        "collector_credentials": credentials,
    }


def member_ref(run_id: str, attempt: int = 1, index: int = 0) -> v1.MemberRef:
    return v1.MemberRef(run_id=run_id, attempt=attempt, member_index=index)


def placed_on(coord: CoordinatorProcess, run_id: str) -> str:
    return str(job(coord, run_id)["attempts"][-1]["members"][0]["node_id"])


@contextmanager
def only_on(coord: CoordinatorProcess, target: AgentProcess, other: AgentProcess) -> Iterator[None]:
    """New members go to ``target`` only: ``other`` is cordoned meanwhile, as an operator does."""
    tp(coord, "node", "cordon", other.node_id, "--reason", "placement for a security test")
    try:
        yield
    finally:
        tp(coord, "node", "uncordon", other.node_id)


def waiting_job(coord: CoordinatorProcess, root: Path) -> tuple[str, Path]:
    """Submit a Job whose workload runs until the file it names exists."""
    release = root.with_suffix(".release")
    script = f'while [ ! -e "{release}" ]; do sleep 0.1; done\n'
    return submit(coord, root, script), release


def running_on(
    coord: CoordinatorProcess, target: AgentProcess, other: AgentProcess, root: Path
) -> tuple[str, Path]:
    """A :func:`waiting_job` placed on ``target`` and running; its run id and release file."""
    with only_on(coord, target, other):
        run_id, release = waiting_job(coord, root)
        wait_state(coord, run_id, "running", timeout=60)
    assert placed_on(coord, run_id) == target.node_id
    return run_id, release


def ran_on(
    coord: CoordinatorProcess, target: AgentProcess, other: AgentProcess, root: Path, script: str
) -> Any:
    """Run ``script`` as a Job on ``target`` until it succeeds; return the finished Job."""
    with only_on(coord, target, other):
        run_id = submit(coord, root, script)
        done = wait_state(coord, run_id, "succeeded", timeout=60)
    assert placed_on(coord, run_id) == target.node_id
    return done


async def send_report(
    node: NodeStream, seq: int, member: v1.MemberRef, state: v1.MemberState, **extra: Any
) -> v1.ReportAck:
    await node.send(report=v1.MemberReport(report_seq=seq, member=member, state=state, **extra))
    ack: v1.ReportAck = await node.expect("report_ack")
    assert ack.report_seq == seq
    return ack


def as_thief(
    coord: CoordinatorProcess,
    victim_node: AgentProcess,
    attack: Any,
    held: list[v1.HeldMember] | None = None,
) -> Any:
    """Run ``attack(node_stream)`` on a Connect opened with ``victim_node``'s stolen credential
    (its Hello claiming to hold ``held``, and the inventory the real Node last reported: a thief
    who copies it gets Prepares the real Node accepts once it is back)."""

    async def go() -> Any:
        with anyio.fail_after(STREAM_TIMEOUT_S):
            async with api_client(coord.api, coord.ca_path, coord.admin_token) as api:
                shown = await api.stub.get_node(v1.GetNodeRequest(node_id=victim_node.node_id))
            async with node_stream(
                coord.control,
                coord.ca_path,
                victim_node.control_token(),
                victim_node.node_id,
                hostname=victim_node.state_dir.name,
                held=held,
                inventory=shown.inventory,
            ) as node:
                return await attack(node)

    return asyncio.run(go())


def test_a_report_about_another_nodes_member_is_refused_and_changes_nothing(
    cluster: tuple[CoordinatorProcess, AgentProcess, AgentProcess], tmp_path: Path
) -> None:
    coord, a, b = cluster
    run_id, release = running_on(coord, a, b, tmp_path / "victim")
    victim = member_ref(run_id)
    a_reconnects = a.status()["reconnects"]
    b.stop()  # the thief uses node-b's credential while node-b is down
    try:
        before = snapshot(coord)

        async def attack(node: NodeStream) -> list[v1.ReportAck]:
            return [
                await send_report(
                    node,
                    HUGE_SEQ,
                    victim,
                    EXITED,
                    has_exit=True,
                    exit_code=0,
                    out_dir="/etc",
                    journal_id="f" * 32,
                    reason="finished early",
                ),
                await send_report(node, HUGE_SEQ - 1, victim, ABORTED, reason="aborted"),
                await send_report(node, 7, victim, LOST, reason="lost"),
            ]

        acks = as_thief(coord, b, attack)
        for ack in acks:
            assert f"Node {b.node_id} reported {run_id} attempt 1 member 0" in ack.refused
            assert "not placed on this Node" in ack.refused
            assert ack.refused.endswith("The report was refused and changed nothing.")
            assert a.node_id not in ack.refused
        # The thief's stream ended, so node-b is disconnected: that touches only node-b's rows.
        assert snapshot(coord) == before
        refused = coord.decisions("report refused")
        assert len([r for r in refused if r["node_id"] == b.node_id]) >= 3
        assert all(r["run_id"] is None for r in refused), "audited against the Node, not the Job"
        # node-a's session was never touched.
        status = a.status()
        assert status["connected"] and status["reconnects"] == a_reconnects
        # The true reports still count: the workload finishes and the Job succeeds.
        release.touch()
        done = wait_state(coord, run_id, "succeeded", timeout=60)
        assert done["attempts"][-1]["members"][0]["out_dir"] != "/etc"
    finally:
        b.start()
        b.wait_connected()


def test_a_forged_sequence_number_cannot_hide_true_reports(
    cluster: tuple[CoordinatorProcess, AgentProcess, AgentProcess], tmp_path: Path
) -> None:
    coord, a, b = cluster
    real_journal = journal_id(b.journal_path)
    b.stop()
    try:
        before = snapshot(coord)

        async def attack(node: NodeStream) -> v1.ReportAck:
            # The largest number there is, under the real journal's own id.
            return await send_report(
                node, HUGE_SEQ, member_ref("r-forged"), EXITED, has_exit=True,
                journal_id=real_journal,
            )  # fmt: skip

        ack = as_thief(coord, b, attack)
        assert "holds no such member" in ack.refused
        assert snapshot(coord) == before
    finally:
        b.start()
        b.wait_connected()
    # The real agent's next reports have small numbers from the same journal: all applied.
    done = ran_on(coord, b, a, tmp_path / "after-forgery", "echo fine\n")
    assert [h["state"] for h in done["attempts"][-1]["members"][0]["history"]][-3:] == [
        "starting",
        "running",
        "exited",
    ]


def test_moves_the_lifecycle_forbids_are_refused_on_the_nodes_own_members(
    cluster: tuple[CoordinatorProcess, AgentProcess, AgentProcess], tmp_path: Path
) -> None:
    coord, a, b = cluster
    b.stop()
    try:
        with only_on(coord, b, a):
            # node-b is down and node-a cordoned: the Job waits for a Node, and the thief's
            # Connect as node-b gets its Prepare.
            run_id, release = waiting_job(coord, tmp_path / "own")
            member = member_ref(run_id)

            async def before_commit(node: NodeStream) -> tuple[dict[str, Any], list[str]]:
                prepare: v1.Prepare = await node.expect("prepare", timeout=STREAM_TIMEOUT_S)
                assert prepare.member == member
                seen = snapshot(coord)
                refusals = [
                    (await send_report(node, 1, member, s, has_exit=True)).refused
                    for s in (EXITED, RUNNING, COMMITTED)
                ]
                assert snapshot(coord) == seen
                return seen, refusals

            seen, refusals = as_thief(coord, b, before_commit)
            for refused in refusals:
                assert "its attempt is not committed, so nothing of it can have started" in refused
            members = [m for m in seen["members"] if m[0] == run_id]
            assert [m[4] for m in members] == ["preparing"]
            assert [g for g in seen["gpus"] if g[2] == run_id], "its GPUs stay reserved"

            # A Hello claiming the member runs is judged too: nothing starts before Commit.
            async def claim(node: NodeStream) -> dict[str, Any]:
                await node.expect("prepare", timeout=STREAM_TIMEOUT_S)  # sent again, unanswered
                return snapshot(coord)

            claimed = as_thief(coord, b, claim, held=[v1.HeldMember(member=member, state=RUNNING)])
            assert [m[4:6] for m in claimed["members"] if m[0] == run_id] == [
                ("preparing", "preparing")
            ]
            assert [j[1] for j in claimed["jobs"] if j[0] == run_id] == ["preparing"]
            # The real Node takes the Prepare now and runs the member.
            b.start()
            b.wait_connected()
            wait_state(coord, run_id, "running", timeout=60)
        b.stop()  # the workload keeps running under its runner; the thief takes over again
        before = snapshot(coord)

        async def after_start(node: NodeStream) -> list[str]:
            return [
                (await send_report(node, 9, member, EXITED, has_exit=True, out_dir="/etc")).refused,
                (await send_report(node, 10, member, EXITED)).refused,  # no exit code
                (await send_report(node, 11, member, ABORTED)).refused,  # running never aborts
                (await send_report(node, 12, member, STARTING)).refused,  # stale: acked only
            ]

        out_dir, no_exit, aborted, stale = as_thief(coord, b, after_start)
        assert "its out dir '/etc' is not an absolute, normalised path" in out_dir
        assert "must carry its exit code or signal" in no_exit
        assert "the member is running and can only move to" in aborted
        assert stale == ""
        after = snapshot(coord)
        # The thief's stream ended and the Node is away: its member shows unknown, keeping what
        # was known. Nothing else moved.
        assert [m for m in after["members"] if m[0] != run_id] == [
            m for m in before["members"] if m[0] != run_id
        ]
        (row,) = [m for m in after["members"] if m[0] == run_id]
        assert row[5] == "running" and row[6] == 0 and row[8] != "/etc"
        for key in ("gpus", "stops", "collector_credentials"):
            assert after[key] == before[key], key
    finally:
        if not b.alive():
            b.start()
        b.wait_connected()
    release.touch()
    wait_state(coord, run_id, "succeeded", timeout=60)


def test_a_second_connect_ends_the_first_and_every_takeover_is_audited(
    cluster: tuple[CoordinatorProcess, AgentProcess, AgentProcess], tmp_path: Path
) -> None:
    coord, a, b = cluster
    run_id, release = running_on(coord, b, a, tmp_path / "takeover")
    reconnects = b.status()["reconnects"]
    replaced_before = len(coord.decisions("control stream replaced"))
    before = snapshot(coord)

    async def hold(node: NodeStream) -> str:
        # The real agent finds its stream ended, reconnects, and ends this one in turn.
        kind, _ = await node.recv(timeout=STREAM_TIMEOUT_S)
        return str(kind)

    with pytest.raises(GRPCError) as ended:
        as_thief(coord, b, hold)
    assert ended.value.status is Status.UNAVAILABLE
    assert "a newer Connect with this Node's credential replaced this stream" in str(
        ended.value.message
    )
    wait_until("node-b to reconnect", lambda: b.status().get("reconnects", 0) > reconnects)
    b.wait_connected()
    replaced = coord.decisions("control stream replaced")[replaced_before:]
    assert len(replaced) >= 2, replaced  # the thief's takeover and the real Node's
    assert {r["node_id"] for r in replaced} == {b.node_id}
    assert all(r["detail"]["new_peer"].startswith("127.0.0.1:") for r in replaced)
    assert f"control stream replaced node={b.node_id}" in coord.read_log()
    # A takeover is not a disconnect: the member never went unknown, nothing was released.
    after = snapshot(coord)
    assert after["gpus"] == before["gpus"]
    assert after["collector_credentials"] == before["collector_credentials"]
    history = job(coord, run_id)["attempts"][-1]["members"][0]["history"]
    assert "unknown" not in [h["state"] for h in history]
    release.touch()
    wait_state(coord, run_id, "succeeded", timeout=60)


def test_a_fresh_journal_after_the_safe_mode_recovery_runs_new_jobs(
    cluster: tuple[CoordinatorProcess, AgentProcess, AgentProcess], tmp_path: Path
) -> None:
    """docs/on-call.md, "The journal is corrupt: safe mode", steps 2 and 3, on node-b."""
    coord, a, b = cluster
    # The old journal has numbered a few reports.
    ran_on(coord, b, a, tmp_path / "before", "echo old journal\n")
    old_id = journal_id(b.journal_path)
    tp(coord, "node", "cordon", b.node_id, "--reason", "journal moved aside")
    b.stop()
    aside = tmp_path / "journal-post-mortem"
    aside.mkdir()
    for suffix in ("", "-wal", "-shm"):
        path = b.journal_path.with_name(b.journal_path.name + suffix)
        if path.exists():
            shutil.move(path, aside / path.name)
    b.start()
    b.wait_connected()
    tp(coord, "node", "uncordon", b.node_id)
    new_id = journal_id(b.journal_path)
    assert new_id != old_id
    # The old journal had numbered many reports; the new one starts at 1 and is not dropped.
    with sqlite3.connect(aside / "journal.db") as db:
        (old_next,) = db.execute("SELECT value FROM meta WHERE key = 'next_report_seq'").fetchone()
    assert int(old_next) > 3
    done = ran_on(coord, b, a, tmp_path / "fresh", "echo fresh journal\n")
    assert done["attempts"][-1]["members"][0]["exit_code"] == 0


def test_a_re_enrolled_node_keeps_its_journal_and_its_reports_still_count(
    cluster: tuple[CoordinatorProcess, AgentProcess, AgentProcess], tmp_path: Path
) -> None:
    coord, a, b = cluster
    old_credential = b.control_token()
    run_id, release = running_on(coord, b, a, tmp_path / "across")
    journal_before = journal_id(b.journal_path)
    b.stop()  # the workload runs on under its runner while the Node is re-enrolled
    done = subprocess.run(
        node_cli(
            "enroll", "--re-enroll", "--state-dir", str(b.state_dir),
            "--coordinator", coord.control, "--ca", str(coord.ca_path),
            "--token", coord.create_join_token(node=b.node_id), "--simulate-gpus", "h200:2",
        ),
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert json.loads((b.state_dir / "node.json").read_text())["node_id"] == b.node_id
    assert b.control_token() != old_credential
    b.start()
    b.wait_connected()
    assert journal_id(b.journal_path) == journal_before
    # The member's end, reported after the re-enrolment, is applied to the same Job.
    release.touch()
    wait_state(coord, run_id, "succeeded", timeout=60)
    ran_on(coord, b, a, tmp_path / "after-re-enroll", "echo again\n")

    # The credential it had before is void: it no longer opens this Node's session.
    async def connect_with_old() -> None:
        with anyio.fail_after(STREAM_TIMEOUT_S):
            async with node_stream(coord.control, coord.ca_path, old_credential, b.node_id):
                pass

    with pytest.raises(GRPCError) as refused:
        asyncio.run(connect_with_old())
    assert refused.value.status is Status.UNAUTHENTICATED
