"""Declaring a Node lost is an admin's decision: every other caller is refused over real TLS, and
each refusal is checked to have changed nothing (Job state, GPUs, the Node, the decision log).
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from grpclib import GRPCError
from grpclib.const import Status

from tests.agent.jobs import job
from tests.coordinator.grpc_client import api_client
from tests.faults.jobs import node, project, submit
from tests.support.agent import AgentProcess, start_agent, wait_until
from tests.support.coordinator import CoordinatorProcess, start_coordinator
from tuneplane.proto import v1

pytestmark = pytest.mark.slow


@pytest.fixture
def coordinator(tmp_path: Path) -> Iterator[CoordinatorProcess]:
    with start_coordinator(tmp_path) as coord:
        yield coord


def _declare(coord: CoordinatorProcess, token: str, node_id: str, reason: str) -> GRPCError:
    """DeclareNodeLost with ``token``; the refusal it must get."""

    async def go() -> GRPCError:
        async with api_client(coord.api, coord.ca_path, token) as api:
            try:
                await api.stub.declare_node_lost(
                    v1.DeclareNodeLostRequest(node_id=node_id, reason=reason)
                )
            except GRPCError as exc:
                return exc
        raise AssertionError(f"DeclareNodeLost of {node_id} was not refused")

    return asyncio.run(go())


def _world(coord: CoordinatorProcess, agent: AgentProcess, run_id: str) -> dict[str, Any]:
    """What a refusal must leave as it was."""
    shown = node(coord, agent.node_id)
    return {
        "job": job(coord, run_id)["state"],
        "history": job(coord, run_id)["history"],
        "scheduling": shown["scheduling"],
        "held": [g["held_by"] for g in shown["gpus"]],
        "lost": coord.decisions("node declared lost") + coord.decisions("member declared lost"),
        "cordons": coord.decisions("node cordoned"),
    }


def test_only_an_admin_may_declare_a_node_lost_and_refusals_change_nothing(
    coordinator: CoordinatorProcess, tmp_path: Path
) -> None:
    agent = start_agent(tmp_path, coordinator)
    agent.wait_connected()
    release = tmp_path / "release"
    script = f'while [ ! -e "{release}" ]; do sleep 0.1; done\n'
    root = project(coordinator, tmp_path / "proj", "custom/custom", {"train.sh": script})
    run_id = submit(coordinator, root, "h200:1")
    try:
        wait_until("the Job to run", lambda: job(coordinator, run_id)["state"] == "running", 60)
        # Refused while connected, even for the admin: the Node speaks for its members.
        refused = _declare(coordinator, coordinator.admin_token, agent.node_id, "off")
        assert refused.status is Status.FAILED_PRECONDITION
        assert f"Node {agent.node_id} is connected" in (refused.message or "")
        agent.kill()
        wait_until("the Job to be unknown", lambda: job(coordinator, run_id)["state"] == "unknown")
        before = _world(coordinator, agent, run_id)
        assert before["held"] == [f"{run_id}/1/0", ""] or before["held"] == ["", f"{run_id}/1/0"]

        # A researcher is refused.
        bob = coordinator.create_user("bob")
        refused = _declare(coordinator, bob, agent.node_id, "I think it is off")
        assert refused.status is Status.PERMISSION_DENIED
        assert "may not declare Nodes lost; only an admin user may" in (refused.message or "")
        # The Node's own control credential is not a user token at all.
        refused = _declare(coordinator, agent.control_token(), agent.node_id, "off")
        assert refused.status is Status.UNAUTHENTICATED
        # A garbage token, and an admin without a reason or naming no Node.
        assert _declare(coordinator, "tpu_forged", agent.node_id, "off").status is (
            Status.UNAUTHENTICATED
        )
        refused = _declare(coordinator, coordinator.admin_token, agent.node_id, "  ")
        assert refused.status is Status.INVALID_ARGUMENT and "reason is empty" in (
            refused.message or ""
        )
        refused = _declare(coordinator, coordinator.admin_token, "", "off")
        assert refused.status is Status.INVALID_ARGUMENT
        refused = _declare(coordinator, coordinator.admin_token, "node-0000", "off")
        assert refused.status is Status.NOT_FOUND
        refused = _declare(coordinator, coordinator.admin_token, agent.node_id, "x" * 501)
        assert refused.status is Status.INVALID_ARGUMENT
        assert _world(coordinator, agent, run_id) == before

        # The admin, with a reason, is heard.
        async def admin_declares() -> v1.DeclareNodeLostReply:
            async with api_client(
                coordinator.api, coordinator.ca_path, coordinator.admin_token
            ) as api:
                return await api.stub.declare_node_lost(
                    v1.DeclareNodeLostRequest(node_id=agent.node_id, reason="off at the PDU")
                )

        reply = asyncio.run(admin_declares())
        assert [m.run_id for m in reply.lost] == [run_id]
        assert [(j.run_id, j.state) for j in reply.jobs] == [(run_id, "failed")]
        assert reply.node.scheduling == "cordoned"
    finally:
        release.write_text("go")  # the runners the killed agent left end their workloads
        agent.stop()
