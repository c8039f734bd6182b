"""An unexpected error inside a call is INTERNAL with an error id that is in the log (issue 8,
must have 7), with a real coordinator.

The coordinator is started with ``TUNEPLANE_FAULTPOINT=list-fleets``
(``coordinator/faultpoint.py``), so its first ListFleets raises an error nobody expects,
after authentication and before the store is read. The caller gets INTERNAL with a sentence holding
an error id; the same id is in serve.log with the traceback; the coordinator keeps serving (the
next ListFleets, a GetNode, a Node's stream that stays connected) and nothing it holds changed.
"""

from __future__ import annotations

import asyncio
import re
from pathlib import Path
from typing import Any

import anyio
import pytest
from grpclib.const import Status

from tests.coordinator.grpc_client import (
    api_client,
    enroll,
    fleet_names,
    job_ids,
    node_ids,
    node_stream,
)
from tests.security.raw_calls import call
from tests.support.coordinator import start_coordinator
from tuneplane.coordinator.faultpoint import ENV
from tuneplane.proto import v1

LIST_FLEETS = "/tuneplane.v1.Api/ListFleets"
TEST_TIMEOUT_S = 60


def _node_view(node: v1.Node) -> dict[str, Any]:
    """What the coordinator holds about a Node, less the live heartbeat time."""
    shown = node.to_dict()
    shown.pop("lastHeartbeatMs", None)
    return shown


def test_an_unexpected_error_is_internal_with_an_id_in_the_log_and_serving_goes_on(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(ENV, "list-fleets")
    with start_coordinator(tmp_path) as coord:
        monkeypatch.delenv(ENV)
        token = coord.create_join_token()
        node = asyncio.run(enroll(coord.control, coord.ca_path, token, "node-a", 2))

        async def scenario() -> None:
            with anyio.fail_after(TEST_TIMEOUT_S):
                async with (
                    node_stream(
                        coord.control, coord.ca_path, node.node_credential, node.node_id
                    ) as stream,
                    api_client(coord.api, coord.ca_path, coord.admin_token) as api,
                ):
                    request = v1.GetNodeRequest(node_id=node.node_id)
                    before = _node_view(await api.stub.get_node(request))
                    jobs_before = await job_ids(coord)

                    answer = await call(
                        coord.api,
                        coord.ca_path,
                        LIST_FLEETS,
                        bytes(v1.ListFleetsRequest()),
                        coord.admin_token,
                    )
                    assert answer.status == Status.INTERNAL, answer
                    found = re.search(r"\(error id ([0-9a-f]{12})\)", answer.message)
                    assert found, answer.message
                    assert answer.message.startswith("The coordinator failed unexpectedly")
                    assert answer.message.rstrip().endswith("."), answer.message
                    assert "FaultPointReached" not in answer.message  # no internals leak
                    error_id = found.group(1)

                    log = coord.read_log()
                    assert f"error_id={error_id}" in log, log
                    after_id = log[log.index(f"error_id={error_id}") :]
                    assert "Traceback (most recent call last)" in after_id, log
                    assert "FaultPointReached" in after_id, log

                    # It keeps serving: the same call, other calls, the Node's stream.
                    assert await fleet_names(coord) == ["default"]
                    assert _node_view(await api.stub.get_node(request)) == before
                    assert await job_ids(coord) == jobs_before
                    await stream.send(heartbeat=v1.Heartbeat(seq=7))
                    ack = await stream.stream.recv_message()
                    assert ack is not None and ack.heartbeat_ack.seq == 7, ack

        asyncio.run(scenario())
        assert asyncio.run(node_ids(coord)) == [node.node_id]
        assert coord.read_log().count("error_id=") == 1
