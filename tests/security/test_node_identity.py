"""Node identity lifecycle and user tokens, attacked and exercised with real processes over TLS:
a real coordinator, real agents (enroll, run, kill -9, re-enroll) and the real `tp`.

Every refusal is checked as an attacker would meet it (a raw Connect with the credential) and
checked to have changed nothing. Lifetimes are seconds, set in coordinator.toml, never days.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from grpclib import GRPCError
from grpclib.const import Status

from tests.agent.jobs import job, journal, submit, tp, wait_job
from tests.cli.tp_process import run_tp_as
from tests.coordinator.grpc_client import api_client, node_stream
from tests.coordinator.grpc_client import enroll as grpc_enroll
from tests.faults.jobs import node
from tests.support.agent import AgentProcess, node_cli, start_agent, wait_until
from tests.support.coordinator import CoordinatorProcess, start_coordinator
from tuneplane.proto import v1

pytestmark = pytest.mark.slow

ROTATION_POINTS = [
    "after-credential-issued",
    "after-next-credential-stored",
    "after-credential-swapped",
    "after-credential-confirmed",
]


def identity_coordinator(tmp_path: Path, node_lifetime: str = "30d") -> CoordinatorProcess:
    """A coordinator whose coordinator.toml gives Node credentials ``node_lifetime``."""
    return start_coordinator(
        tmp_path, config=f'\n[credentials]\nnode_lifetime = "{node_lifetime}"\n'
    )


@pytest.fixture
def short_lived(tmp_path: Path) -> Iterator[CoordinatorProcess]:
    """Node credentials live 6 s: an agent renews 3-5.4 s after each one is issued."""
    with identity_coordinator(tmp_path, "6s") as coord:
        yield coord


@pytest.fixture
def half_minute(tmp_path: Path) -> Iterator[CoordinatorProcess]:
    """Node credentials live 30 s: an agent renews 15-27 s after each one is issued, so a kill
    in the middle of a rotation leaves the old credential at least 3 s for the restart (6 s
    credentials left as little as 0.6 s, less than a restart takes on a loaded machine)."""
    with identity_coordinator(tmp_path, "30s") as coord:
        yield coord


@pytest.fixture
def long_lived(tmp_path: Path) -> Iterator[CoordinatorProcess]:
    with identity_coordinator(tmp_path) as coord:
        yield coord


def connect_as(coord: CoordinatorProcess, credential: str, node_id: str) -> GRPCError | None:
    """Open Connect with ``credential`` as an attacker would; the refusal, or None if welcomed."""

    async def go() -> None:
        async with node_stream(coord.control, coord.ca_path, credential, node_id):
            return

    try:
        asyncio.run(asyncio.wait_for(go(), 20))
    except GRPCError as exc:
        return exc
    return None


def node_join_token(coord: CoordinatorProcess, node_id: str) -> str:
    """A join token that only re-enrolls ``node_id`` (`token create --node`)."""
    return coord.create_join_token(node=node_id)


def reenroll(
    agent: AgentProcess, coord: CoordinatorProcess, join_token: str = ""
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        node_cli("enroll", "--re-enroll", "--state-dir", str(agent.state_dir),
                 "--coordinator", coord.control, "--ca", str(coord.ca_path),
                 "--token", join_token or node_join_token(coord, agent.node_id)),
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip


def test_the_agent_renews_and_the_old_credential_is_then_refused(
    short_lived: CoordinatorProcess, tmp_path: Path
) -> None:
    coord = short_lived
    agent = start_agent(tmp_path, coord)
    try:
        agent.wait_connected()
        first = agent.control_token()
        wait_until(
            "the first rotation to be confirmed",
            lambda: agent.control_token() != first and coord.decisions("node credential rotated"),
            30,
        )
        second = agent.control_token()
        refused = connect_as(coord, first, agent.node_id)
        assert refused is not None and refused.status == Status.UNAUTHENTICATED
        assert "not enrolled" in (refused.message or "")
        # The agent stays connected with its new credential, and shows its life, never its value.
        wait_until("the agent to reconnect", lambda: agent.status().get("connected"))
        status = json.loads(agent.cli("status", "--json").stdout)
        assert status["credential"]["health"] == "ok"
        assert status["credential"]["expires_at_ms"] > int(time.time() * 1000)
        assert second not in json.dumps(status) and first not in json.dumps(status)
        doctor = agent.cli("doctor")
        assert "control credential issued" in doctor.stdout, doctor.stdout
        assert second not in doctor.stdout
        # The coordinator exports the expiry of the credential in use.
        shown = node(coord, agent.node_id)
        assert shown["credential_expires_at_ms"] > shown["credential_issued_at_ms"] > 0
        assert shown["revoked_at_ms"] == 0
        # Each rotation was issued before it was confirmed, and the journal notes it (no value).
        assert coord.decisions("node credential issued", agent.node_id)
        (cred,) = journal(agent, "export", "--json")["credentials"]
        assert cred["name"] == "control" and cred["rotated_at_ms"]
    finally:
        agent.stop()


@pytest.mark.parametrize("point", ROTATION_POINTS)
def test_a_kill_at_any_rotation_point_leaves_a_working_credential(
    half_minute: CoordinatorProcess, tmp_path: Path, point: str
) -> None:
    coord = half_minute
    agent = start_agent(tmp_path, coord, env={"TUNEPLANE_CRASHPOINT": point})
    try:
        agent.wait_connected()
        before = agent.control_token()
        assert agent.wait_exit(60) == 137
        assert f"point={point}" in agent.read_log()
        # What the kill left on disk: nothing new, a whole successor beside the old credential,
        # or the successor in place.
        successor_file = agent.state_dir / "credentials" / "control.token.next"
        successor = ""
        if point == "after-credential-issued":
            assert agent.control_token() == before and not successor_file.exists()
        elif point == "after-next-credential-stored":
            assert agent.control_token() == before
            successor = successor_file.read_text().strip()
        else:
            successor = agent.control_token()
            assert successor != before and not successor_file.exists()
        agent.restart()
        agent.wait_connected()
        if successor:
            # The agent came back with the successor it had stored, not the old credential.
            assert agent.control_token() == successor or coord.decisions(
                "node credential rotated", agent.node_id
            )
        if point in ("after-next-credential-stored", "after-credential-swapped"):
            # The coordinator never heard CredentialStored: the Connect itself confirmed it.
            vias = [d["detail"]["via"] for d in coord.decisions("node credential rotated")]
            assert vias and vias[0] == "Connect", vias
        # Whatever the kill left, the agent connected with what is on disk, and the rotation is
        # eventually confirmed (by CredentialStored, by the next Connect, or by a new renewal).
        wait_until(
            "a confirmed rotation away from the credential before the kill",
            lambda: (
                agent.control_token() != before
                and coord.decisions("node credential rotated", agent.node_id)
                and not (agent.state_dir / "credentials" / "control.token.next").exists()
            ),
            40,
        )
        wait_until("the agent to be connected", lambda: agent.status().get("connected"))
        refused = connect_as(coord, before, agent.node_id)
        assert refused is not None and refused.status == Status.UNAUTHENTICATED
    finally:
        agent.stop()


def test_revoke_ends_the_live_stream_and_a_stolen_credential_changes_nothing_then_re_enroll(
    long_lived: CoordinatorProcess, tmp_path: Path
) -> None:
    coord = long_lived
    agent = start_agent(tmp_path, coord)
    try:
        agent.wait_connected()
        script = 'echo started >> "$TUNEPLANE_OUT_DIR/starts"\nsleep 15\n'
        run_id = submit(coord, tmp_path / "proj", script)
        wait_until(
            "the Job to run",
            lambda: job(coord, run_id)["state"] == "running",
        )
        stolen = agent.control_token()

        started = time.monotonic()
        out = coord.admin("node", "revoke", agent.node_id, "--reason", "credential leaked")
        assert out.returncode == 0, out.stderr
        assert "--re-enroll" in out.stdout
        wait_until("the live stream to end", lambda: not agent.status().get("connected"), 5)
        ended_after = time.monotonic() - started
        (decision,) = coord.decisions("node revoked", agent.node_id)
        assert decision["detail"]["reason"] == "credential leaked"

        # The thief (and the agent itself) is refused with the sentence to re-enroll ...
        before = job(coord, run_id)
        node_before = node(coord, agent.node_id)
        refused = connect_as(coord, stolen, agent.node_id)
        assert refused is not None and refused.status == Status.UNAUTHENTICATED
        assert "revoked" in (refused.message or "") and "--re-enroll" in (refused.message or "")
        # ... and changed nothing: the Job, its member, its GPUs and the Node's record.
        after = job(coord, run_id)
        assert after["state"] == before["state"]
        assert after["attempts"] == before["attempts"]
        node_after = node(coord, agent.node_id)
        assert node_after["gpus"] == node_before["gpus"]
        assert node_after["connected"] is False and node_after["revoked_at_ms"] > 0
        wait_until(
            "the agent to log the refusal",
            lambda: "revoked" in agent.status().get("last_error", ""),
            30,
        )
        assert ended_after < 5

        # Re-enrolling keeps the Node's id and journal; its running member re-attaches. Only a
        # join token made for this Node does it: an ordinary one (a leaked one, say) cannot take
        # an existing Node's identity, and a Node's token enrolls no other machine.
        agent.stop()
        generic = reenroll(agent, coord, coord.create_join_token())
        assert generic.returncode == 1
        assert f"token create --node {agent.node_id}" in generic.stderr
        bound = node_join_token(coord, agent.node_id)
        other = subprocess.run(
            node_cli("enroll", "--state-dir", str(tmp_path / "other"), "--coordinator",
                     coord.control, "--ca", str(coord.ca_path), "--token", bound),
            capture_output=True, text=True, timeout=60, check=False,
        )  # fmt: skip
        assert other.returncode == 1 and "only re-enrolls Node" in other.stderr
        assert not coord.decisions("node re-enrolled")
        assert len(coord.decisions("node enrolled")) == 1
        done = reenroll(agent, coord, bound)
        assert done.returncode == 0, done.stderr
        assert json.loads((agent.state_dir / "node.json").read_text())["node_id"] == agent.node_id
        assert connect_as(coord, stolen, agent.node_id) is not None
        agent.start()
        agent.wait_connected()
        finished = wait_job(coord, run_id, 90)
        assert finished["state"] == "succeeded", finished
        (member,) = finished["attempts"][0]["members"]
        assert (Path(member["out_dir"]) / "starts").read_text() == "started\n"
        assert coord.decisions("node re-enrolled", agent.node_id)
        kinds = [e["kind"] for e in journal(agent, "events", "--json")]
        assert "enrolled" in kinds and "re-enrolled" in kinds
        assert node(coord, agent.node_id)["revoked_at_ms"] == 0
    finally:
        agent.stop()


def test_a_node_offline_past_expiry_is_refused_until_re_enrolled(tmp_path: Path) -> None:
    with identity_coordinator(tmp_path, "6s") as coord:
        agent = start_agent(tmp_path, coord, simulate_gpus="h200:1")
        agent.wait_connected()
        agent.stop()
        stopped_ms = time.time() * 1000
        credential = agent.control_token()
        life = json.loads((agent.state_dir / "credentials" / "control.json").read_text())
        # Past the expiry of the credential on disk and of any successor issued before the stop.
        wait_until(
            "the credential to expire",
            lambda: time.time() * 1000 > max(life["expires_at_ms"], stopped_ms + 6000) + 200,
            20,
        )
        connected_before = len(coord.decisions("node connected", agent.node_id))
        refused = connect_as(coord, credential, agent.node_id)
        assert refused is not None and refused.status == Status.UNAUTHENTICATED
        message = refused.message or ""
        assert "expired" in message and "--re-enroll" in message and "join token" in message
        assert len(coord.decisions("node connected", agent.node_id)) == connected_before
        # Offline, the Node's own tools say so too, never showing the credential.
        doctor = agent.cli("doctor")
        assert doctor.returncode == 1 and "EXPIRED" in doctor.stdout, doctor.stdout
        assert credential not in doctor.stdout
        again = subprocess.run(
            node_cli("enroll", "--state-dir", str(agent.state_dir), "--coordinator",
                     coord.control, "--ca", str(coord.ca_path), "--token",
                     coord.create_join_token()),
            capture_output=True, text=True, timeout=60, check=False,
        )  # fmt: skip
        assert again.returncode == 1 and "--re-enroll" in again.stderr
        # The agent, started again, is refused and says why; re-enrolling it while it runs
        # lets it in at once, without a restart.
        agent.start()
        try:
            wait_until(
                "the agent to report the expiry",
                lambda: "expired" in agent.status().get("last_error", ""),
                30,
            )
            done = reenroll(agent, coord)
            assert done.returncode == 0, done.stderr
            agent.wait_connected(10)
            assert json.loads(agent.cli("status", "--json").stdout)["credential"]["health"] == "ok"
        finally:
            agent.stop()


def test_user_tokens_expire_and_can_be_revoked_at_once(
    long_lived: CoordinatorProcess, tmp_path: Path
) -> None:
    coord = long_lived
    made = coord.admin("user", "create", "ada", "--expires-in", "3s", "--json")
    assert made.returncode == 0, made.stderr
    ada = json.loads(made.stdout)
    ada_file = tmp_path / "ada.token"
    ada_file.write_text(ada["token"] + "\n")
    assert run_tp_as(coord, ada_file, "fleet", "ls").returncode == 0
    wait_until("ada's token to expire", lambda: time.time() * 1000 > ada["expires_at_ms"], 10)
    refused = run_tp_as(coord, ada_file, "fleet", "ls")
    assert refused.returncode != 0
    assert "expired" in refused.stderr and "user token ada" in refused.stderr

    made = coord.admin("user", "create", "bob", "--json")
    bob = json.loads(made.stdout)
    assert bob["expires_at_ms"] > (time.time() + 89 * 86400) * 1000  # the 90-day default
    bob_file = tmp_path / "bob.token"
    bob_file.write_text(bob["token"] + "\n")
    assert run_tp_as(coord, bob_file, "node", "ls").returncode == 0
    out = coord.admin("user", "revoke", "bob")
    assert out.returncode == 0, out.stderr
    refused = run_tp_as(coord, bob_file, "node", "ls")
    assert refused.returncode != 0 and "revoked" in refused.stderr
    # Nothing was done with the revoked token: a Preview/commit never got through, no Job exists.
    assert json.loads(tp(coord, "job", "ls", "--json")) == []
    assert len(coord.decisions("user revoked")) == 1
    again = coord.admin("user", "revoke", "bob")
    assert "already revoked" in again.stdout
    assert len(coord.decisions("user revoked")) == 1
    # A new token for bob works; the revoked one stays refused.
    fresh = coord.admin("user", "token", "bob", "--json")
    assert fresh.returncode == 0, fresh.stderr
    fresh_file = tmp_path / "bob2.token"
    fresh_file.write_text(json.loads(fresh.stdout)["token"] + "\n")
    assert run_tp_as(coord, fresh_file, "node", "ls").returncode == 0
    assert run_tp_as(coord, bob_file, "node", "ls").returncode != 0
    # The operator sees each token's state, never a token.
    listed = coord.admin("user", "ls")
    lines = {line.split()[0]: line for line in listed.stdout.splitlines()}
    assert "never expires" in lines["admin"]
    assert "EXPIRED" in lines["ada"] and "expires" in lines["bob"]
    assert ada["token"] not in listed.stdout and bob["token"] not in listed.stdout
    rows = {r["name"]: r for r in json.loads(coord.admin("user", "ls", "--json").stdout)}
    assert rows["bob"]["revoked_at_ms"] is None and rows["ada"]["expires_at_ms"] > 0


def test_a_live_stream_does_not_outlive_its_credential(tmp_path: Path) -> None:
    """A Node that never renews (an old or a forged agent) loses its stream at expiry."""
    with identity_coordinator(tmp_path, "3s") as coord:
        reply = asyncio.run(
            grpc_enroll(coord.control, coord.ca_path, coord.create_join_token(), "old", 1)
        )
        assert reply.credential_expires_at_ms - reply.credential_issued_at_ms == 3000

        async def go() -> tuple[str, float]:
            async with node_stream(
                coord.control, coord.ca_path, reply.node_credential, reply.node_id
            ) as node:
                seq = 0
                while True:
                    seq += 1
                    await node.send(heartbeat=v1.Heartbeat(seq=seq))
                    with contextlib.suppress(TimeoutError):
                        kind, _ = await node.recv(timeout=0.5)
                        if kind == "end":
                            return kind, time.time() * 1000
            raise AssertionError("unreachable")

        with pytest.raises(GRPCError) as ended:
            asyncio.run(asyncio.wait_for(go(), 20))
        assert ended.value.status == Status.UNAVAILABLE
        assert "credential expired" in (ended.value.message or "")
        assert time.time() * 1000 >= reply.credential_expires_at_ms
        refused = connect_as(coord, reply.node_credential, reply.node_id)
        assert refused is not None and refused.status == Status.UNAUTHENTICATED


def test_revoke_while_the_coordinator_is_stopped_is_kept_and_enforced(
    long_lived: CoordinatorProcess, tmp_path: Path
) -> None:
    coord = long_lived
    reply = asyncio.run(
        grpc_enroll(coord.control, coord.ca_path, coord.create_join_token(), "spare", 1)
    )
    coord.stop()
    out = coord.admin("node", "revoke", reply.node_id, "--reason", "decommissioned")
    assert out.returncode == 0, out.stderr
    assert "not serving" in out.stdout
    again = coord.admin("node", "revoke", reply.node_id)
    assert "already revoked" in again.stdout
    missing = coord.admin("node", "revoke", "node-nope")
    assert missing.returncode == 1 and "no Node 'node-nope'" in missing.stderr
    coord.restart()
    refused = connect_as(coord, reply.node_credential, reply.node_id)
    assert refused is not None and refused.status == Status.UNAUTHENTICATED
    assert "revoked" in (refused.message or "")
    assert len(coord.decisions("node revoked", reply.node_id)) == 1


def test_only_an_admin_may_revoke_a_node(long_lived: CoordinatorProcess, tmp_path: Path) -> None:
    coord = long_lived
    reply = asyncio.run(
        grpc_enroll(coord.control, coord.ca_path, coord.create_join_token(), "gpu-1", 1)
    )
    eve = json.loads(coord.admin("user", "create", "eve", "--json").stdout)["token"]

    async def revoke_as(token: str) -> None:
        async with api_client(coord.api, coord.ca_path, token) as api:
            await api.stub.revoke_node(v1.RevokeNodeRequest(node_id=reply.node_id, reason="x"))

    with pytest.raises(GRPCError) as denied:
        asyncio.run(revoke_as(eve))
    assert denied.value.status == Status.PERMISSION_DENIED
    assert "only an admin user may" in (denied.value.message or "")
    with pytest.raises(GRPCError) as unknown:
        asyncio.run(revoke_as(reply.node_credential))  # a Node credential is no user token
    assert unknown.value.status == Status.UNAUTHENTICATED
    # Nothing changed: no decision, and the Node's credential still opens Connect.
    assert coord.decisions("node revoked") == []
    assert connect_as(coord, reply.node_credential, reply.node_id) is None
