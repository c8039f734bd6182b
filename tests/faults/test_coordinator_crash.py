"""The coordinator killed at each of its crash points, then restarted: nothing lost, nothing twice.

Each test arms one point (``TUNEPLANE_CRASHPOINT``, agent/crashpoint.py's COORDINATOR_POINTS) in a
real ``tuneplane-coordinator serve``, lets a real Job on real agents reach it, sees the coordinator
die there with status 137 and what it left behind, starts it again unarmed on the same state and
ports, and checks the invariant: the Job ran exactly once (one start per member, in the output and
in each Node's journal), the decision the Nodes acted on is the one recorded, no GPU is left
reserved, a heartbeat batch is stored whole or not at all, a telemetry batch exactly once.
Each runs on both store backends, SQLite files and a PostgreSQL database (tests/coordinator's
``store_backend`` fixture). tests/faults/test_coordinator_crash_matrix.py crosses these points
with the agent's.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import signal
from pathlib import Path

import anyio
import pytest
from grpclib import GRPCError
from grpclib.exceptions import StreamTerminatedError

from tests.agent.jobs import journal, tp

# The coordinator suite's backend fixtures, so every point is tested on SQLite and PostgreSQL.
from tests.coordinator.conftest import store_backend as store_backend
from tests.coordinator.conftest import store_backend_name as store_backend_name
from tests.coordinator.grpc_client import enroll, node_stream
from tests.faults.coordinator_crashes import (
    armed,
    decisions_of,
    delivered_once,
    delivery,
    died_at,
    members_on,
    nothing_held,
    queue_job,
    ran_once,
    spawns,
    tag_points,
)
from tests.faults.jobs import node, pending_reports, wait_state
from tests.integration.test_system_series_e2e import collector_pid
from tests.support.agent import AgentProcess, start_agent, wait_until
from tests.support.coordinator import CoordinatorProcess, start_coordinator
from tests.support.postgres import postgres_server as postgres_server
from tuneplane.proto import v1

pytestmark = [pytest.mark.slow, pytest.mark.timeout(180)]


def test_a_crash_after_the_reservation_is_written_sends_its_prepare_after_the_restart(
    tmp_path: Path,
) -> None:
    with start_coordinator(tmp_path, env=armed("after-reservation-written")) as coord:
        run_id = queue_job(coord, tmp_path / "proj")
        agent = start_agent(tmp_path, coord)
        try:
            died_at(coord, "after-reservation-written")
            # Reserved and committed, never sent: the Node has heard of no member.
            assert members_on(agent) == []
            coord.restart()
            done = ran_once(coord, [agent], run_id)
            assert len(done["attempts"]) == 1
            assert len(decisions_of(coord, "reservation", run_id)) == 1
        finally:
            agent.stop()


def test_a_crash_after_the_commit_is_decided_sends_that_commit_to_every_member(
    tmp_path: Path,
) -> None:
    with start_coordinator(tmp_path, env=armed("after-commit-decided")) as coord:
        run_id = queue_job(coord, tmp_path / "proj", "h200:4")  # one member on each Node
        agents = [start_agent(tmp_path, coord, name) for name in ("node-a", "node-b")]
        try:
            died_at(coord, "after-commit-decided")
            # Decided, not sent: every member prepared on its Node, none started.
            for agent in agents:
                (member,) = members_on(agent)
                assert member["state"] == "prepared", member
            assert len(decisions_of(coord, "commit", run_id)) == 1
            coord.restart()
            done = ran_once(coord, agents, run_id)
            assert len(done["attempts"]) == 1 and len(done["attempts"][0]["members"]) == 2
            assert len(decisions_of(coord, "commit", run_id)) == 1
            assert decisions_of(coord, "abort", run_id) == []
        finally:
            for agent in agents:
                agent.stop()


def _break_work_root(agent: AgentProcess) -> None:
    """Replace the Node's work root by a plain file, as a mount gone wrong would leave it: its
    next Prepare cannot make the member's work directory and is refused."""
    shutil.rmtree(agent.work_root)
    agent.work_root.write_text("not a directory\n")


def _mend_work_root(agent: AgentProcess) -> None:
    agent.work_root.unlink()
    agent.work_root.mkdir(mode=0o711)


def _aborted_then_retried_once(
    coord: CoordinatorProcess, agents: list[AgentProcess], run_id: str, why: str
) -> None:
    """After the restart the recorded Abort is what every Node acted on: the Job aborted with
    ``why``, nothing started, nothing held; then ``tp job retry`` runs it exactly once."""
    aborted = wait_state(coord, run_id, "aborted")
    assert why in aborted["state_reason"], aborted
    (attempt,) = aborted["attempts"]
    assert {m["state"] for m in attempt["members"]} == {"aborted"}, attempt
    assert len(decisions_of(coord, "abort", run_id)) == 1
    assert decisions_of(coord, "commit", run_id) == []
    nothing_held(coord, agents)
    for agent in agents:
        for member in members_on(agent):
            assert member["state"] == "aborted", member
            assert spawns(agent, str(member["member"])) == 0
    tp(coord, "job", "retry", run_id)
    done = ran_once(coord, agents, run_id)
    assert len(done["attempts"]) == 2


def test_a_crash_after_a_refused_prepare_is_decided_aborts_every_member_after_the_restart(
    tmp_path: Path,
) -> None:
    with start_coordinator(tmp_path, env=armed("after-abort-decided")) as coord:
        agents = [start_agent(tmp_path, coord, name) for name in ("node-a", "node-b")]
        try:
            for agent in agents:
                agent.wait_connected()
            # Members are numbered in Node id order: member 0 is prepared on the first Node,
            # and the second refuses member 1.
            first, second = sorted(agents, key=lambda a: a.node_id)
            _break_work_root(second)
            try:
                run_id = queue_job(coord, tmp_path / "proj", "h200:4")
                died_at(coord, "after-abort-decided")
                (prepared,) = members_on(first)
                # On failure, the member's journal and both logs say why it is not prepared
                # (seen in CI, not reproduced in loaded runs); pytest.fail keeps them whole.
                if prepared["state"] != "prepared":
                    events = journal(first, "events", "--member", str(prepared["member"]), "--json")
                    pytest.fail(
                        f"member {prepared['member']} on {first.node_id} is "
                        f"{prepared['state']}, not prepared.\nits journal events:\n"
                        + "\n".join(json.dumps(e, sort_keys=True) for e in events)
                        + f"\ncoordinator log:\n{coord.read_log()[-6000:]}"
                        + f"\nagent log:\n{first.read_log()[-6000:]}"
                    )
                coord.restart()
                aborted = wait_state(coord, run_id, "aborted")
            finally:
                _mend_work_root(second)
            why = f"member 1 on Node {second.node_id} refused Prepare"
            assert str(second.work_root) in aborted["state_reason"], aborted
            _aborted_then_retried_once(coord, agents, run_id, why)
        finally:
            for agent in agents:
                agent.stop()


#: How long the agent's event loop blocks once its member is prepared: well past the prepare
#: deadline and the scheduler's next pass, so the deadline decides before the reply arrives.
HANG_S = 8
PREPARE_TIMEOUT_S = 2


def test_a_crash_after_a_prepare_deadline_abort_is_decided_aborts_after_the_restart(
    tmp_path: Path,
) -> None:
    with start_coordinator(
        tmp_path, env=armed("after-abort-decided"), prepare_timeout=PREPARE_TIMEOUT_S
    ) as coord:
        run_id = queue_job(coord, tmp_path / "proj")
        hang = {"TUNEPLANE_HANGPOINT": f"after-prepare-journaled:{HANG_S}"}
        agent = start_agent(tmp_path, coord, env=hang)
        try:
            died_at(coord, "after-abort-decided", timeout=HANG_S + 30)
            coord.restart()
            # The Node wakes holding a prepared member, and learns the recorded Abort.
            _aborted_then_retried_once(coord, [agent], run_id, "prepare deadline")
            assert "hang point over" in agent.read_log()
        finally:
            agent.stop()


def test_a_crash_after_a_report_is_applied_applies_the_repeat_once(tmp_path: Path) -> None:
    with start_coordinator(tmp_path, env=armed("after-report-applied")) as coord:
        run_id = queue_job(coord, tmp_path / "proj")
        agent = start_agent(tmp_path, coord)
        try:
            died_at(coord, "after-report-applied")
            coord.restart()
            done = ran_once(coord, [agent], run_id)
            # The report the crash left unacknowledged came again and moved nothing twice.
            (member,) = done["attempts"][0]["members"]
            reported = [h["state"] for h in member["history"] if h["reason"].startswith("reported")]
            assert len(reported) == len(set(reported)), member["history"]
            wait_until("every report to be acknowledged", lambda: not pending_reports(agent))
        finally:
            agent.stop()


#: What talking to a coordinator that just died raises.
_DEAD_PEER = (StreamTerminatedError, GRPCError, ConnectionError, OSError)


async def _heartbeat_until_it_dies(
    coord: CoordinatorProcess, nodes: list[v1.EnrollReply], every_s: float = 0.05
) -> None:
    """Be ``nodes`` (GPU-less Nodes the test plays over the real protocol) on the coordinator,
    heartbeating every ``every_s``, far more often than it flushes, so that every batch after
    the first holds a time newer than each one's connect, until the coordinator dies."""
    stack = contextlib.AsyncExitStack()
    try:
        with contextlib.suppress(*_DEAD_PEER):
            streams = [
                await stack.enter_async_context(
                    node_stream(coord.control, coord.ca_path, n.node_credential, n.node_id, gpus=0)
                )
                for n in nodes
            ]
            seq = 0
            with anyio.fail_after(60):
                while coord.alive():
                    seq += 1
                    for stream in streams:
                        await stream.send(heartbeat=v1.Heartbeat(seq=seq))
                    await anyio.sleep(every_s)
    finally:
        # Ending a stream whose peer died: CPython 3.11's TLS transport raises AttributeError
        # for the write once the connection is gone.
        with contextlib.suppress(*_DEAD_PEER, AttributeError):
            await stack.aclose()
    assert not coord.alive(), "the heartbeats stopped before the coordinator died"


def test_a_crash_inside_a_heartbeat_batch_stores_none_of_it(tmp_path: Path) -> None:
    with start_coordinator(tmp_path, heartbeat_interval=1.0, heartbeat_timeout=5) as coord:
        release = tmp_path / "release"
        run_id = queue_job(
            coord,
            tmp_path / "proj",
            script=(
                'echo started >> "$TUNEPLANE_OUT_DIR/starts"\n'
                f'while [ ! -e "{release}" ]; do sleep 0.1; done\n'
            ),
        )
        agent = start_agent(tmp_path, coord)
        try:
            wait_state(coord, run_id, "running")
            # Nodes without GPUs: no Job is placed on them (enrolled after the Job was admitted,
            # which a Fleet of them alone would refuse).
            played = [
                asyncio.run(enroll(coord.control, coord.ca_path, coord.create_join_token(), n, 0))
                for n in ("played-x", "played-y")
            ]
            coord.kill()
            # The third batch: the played Nodes' connects fill at most the first two, so it
            # holds heartbeats newer than what the store has for both of them.
            coord.restart(env=armed("mid-heartbeat-batch@3"))
            asyncio.run(_heartbeat_until_it_dies(coord, played))
            line = died_at(coord, "mid-heartbeat-batch")
            batch = {
                node_id: int(at) for node_id, at in (b.split(":") for b in line["beats"].split(","))
            }
            coord.restart()
            for enrolled in played:
                node_id = enrolled.node_id
                (connected,) = coord.decisions("node connected", node_id)[-1:]
                assert batch[node_id] > connected["at_ms"], (batch, connected)
                stored = node(coord, node_id)["last_heartbeat_ms"]
                assert stored < batch[node_id], (node_id, stored, batch)
            release.write_text("")
            ran_once(coord, [agent], run_id)
        finally:
            agent.stop()


def test_a_crash_inside_a_telemetry_batch_stores_it_once_when_the_collector_sends_it_again(
    tmp_path: Path,
) -> None:
    steps = 20
    lines = "".join(f'{{"step": {s}, "loss": {1 / (s + 1)}}}\\n' for s in range(steps))
    script = (
        'echo started >> "$TUNEPLANE_OUT_DIR/starts"\n'
        f"printf '{lines}' > \"$TUNEPLANE_TELEMETRY_DIR/m.jsonl\"\n"
    )
    with start_coordinator(tmp_path, env=armed("mid-telemetry-ingest")) as coord:
        run_id = queue_job(coord, tmp_path / "proj", script=script)
        agent = start_agent(tmp_path, coord)
        try:
            died_at(coord, "mid-telemetry-ingest")
            # Hold the collector (it was never acknowledged, so it still has the batch) while
            # the store is read: the batch the crash cut is not in it, not even in part.
            collector = collector_pid(agent)
            os.kill(collector, signal.SIGSTOP)
            try:
                coord.restart()
                assert tag_points(coord, run_id) == {}
                assert all(m["points_stored"] == 0 for m in delivery(coord, run_id))
            finally:
                os.kill(collector, signal.SIGCONT)
            ran_once(coord, [agent], run_id)
            delivered_once(coord, run_id, {"loss": steps})
        finally:
            agent.stop()
