"""A Derivation fetched from the Node that holds it, over real gRPC against a real coordinator.

The test plays the holder Node (no shared output root): its Hello reports an outputs listener,
its run ends with a manifest, and the Prepare of a run that begins from it carries InitFromFetch
with a grant the holder's own key accepts for that source member. A reconnect gets a fresh grant;
a Hello that serves nothing, or reports a malformed listener, keeps the stream, stores nothing of
it, and the next Prepare goes without (Preview then refuses, saying why).
"""

from __future__ import annotations

import asyncio
import json
import secrets
import time
from pathlib import Path
from typing import Any

import betterproto
import pytest
from grpclib import GRPCError
from grpclib.const import Status

from tests.coordinator.grpc_client import api_client, enroll, jobspec, node_stream
from tests.support.coordinator import CoordinatorProcess, start_coordinator, stored_outputs_service
from tuneplane.coordinator.derivation import GRANT_TTL_MS
from tuneplane.proto import v1
from tuneplane.proto.contract.outputs_grant import grant_valid

pytestmark = pytest.mark.timeout(120)

EXITED = v1.MemberState(v1.MemberState.EXITED)
KEY = secrets.token_bytes(32)
DIGEST = "cd" * 32
OUTPUTS = v1.OutputsService(address="127.0.0.1:7463", cert_sha256=DIGEST, grant_key=KEY)


def _now_ms() -> int:
    return time.time_ns() // 1_000_000


async def _outputs_address(coord: CoordinatorProcess, node_id: str) -> str:
    async with api_client(coord.api, coord.ca_path, coord.admin_token) as api:
        nodes = (await api.stub.list_nodes(v1.ListNodesRequest())).nodes
    return next(n.outputs_address for n in nodes if n.id == node_id)


def _check_fetch(prepare: v1.Prepare, source: str, before: int, after: int) -> v1.InitFromFetch:
    assert betterproto.serialized_on_wire(prepare.init_from_fetch), prepare
    fetch = prepare.init_from_fetch
    assert (fetch.address, fetch.cert_sha256) == (OUTPUTS.address, DIGEST)
    assert before + GRANT_TTL_MS <= fetch.grant_expires_at_ms <= after + GRANT_TTL_MS
    expires = fetch.grant_expires_at_ms
    assert grant_valid(KEY, fetch.grant, source, 1, 0, expires, after)
    assert not grant_valid(KEY, fetch.grant, source, 1, 1, expires, after)
    assert not grant_valid(secrets.token_bytes(32), fetch.grant, source, 1, 0, expires, after)
    return fetch


def test_a_prepare_fetching_from_the_holder_carries_a_grant_its_key_accepts(
    tmp_path: Path,
) -> None:
    with start_coordinator(tmp_path, heartbeat_timeout=60, prepare_timeout=120) as coord:
        holder = asyncio.run(
            enroll(coord.control, coord.ca_path, coord.create_join_token(), "holder", 1)
        )

        def connect(outputs: v1.OutputsService | None = None) -> Any:
            return node_stream(
                coord.control, coord.ca_path, holder.node_credential, holder.node_id,
                hostname="holder", gpus=1, outputs=outputs,
            )  # fmt: skip

        async def source_then_derived() -> tuple[str, str, v1.InitFromFetch]:
            async with (
                connect(OUTPUTS) as node,
                api_client(coord.api, coord.ca_path, coord.admin_token) as api,
            ):
                receipt = await api.submit(jobspec(gpus=1, project="src"), "key-src")
                prepare: v1.Prepare = await node.expect("prepare")
                assert not betterproto.serialized_on_wire(prepare.init_from_fetch)
                await node.send(prepare_reply=v1.PrepareReply(member=prepare.member, ok=True))
                await node.expect("commit")
                seq = await node.report_running(1, prepare.member)
                out_dir = f"/var/lib/tuneplane/outputs/{receipt.run_id}/attempt-1/member-0"
                manifest = v1.OutputManifest(files=2, bytes=4096, sha256="ab" * 32)
                await node.report(
                    seq + 1, prepare.member, EXITED, has_exit=True, exit_code=0,
                    out_dir=out_dir, output_manifest=manifest,
                )  # fmt: skip
                await api.wait_for_state(receipt.run_id, "succeeded")
                assert await _outputs_address(coord, holder.node_id) == OUTPUTS.address

                derived = {**jobspec(gpus=1, project="derived"), "init_from": receipt.run_id}
                preview = await api.preview(derived)
                source = json.loads(preview.resolved_jobspec_json)["init_from_source"]
                assert source["node_id"] == holder.node_id and source["out_dir"] == out_dir
                before = _now_ms()
                second = await api.commit(preview, "key-derived")
                prepare = await node.expect("prepare")
                fetch = _check_fetch(prepare, receipt.run_id, before, _now_ms())
                assert prepare.member.run_id == second.run_id
                return receipt.run_id, second.run_id, fetch

        source_id, derived_id, first = asyncio.run(source_then_derived())

        async def resent() -> None:
            # A reconnect resends the Prepare with a fresh grant and the current address.
            before = _now_ms()
            async with connect(OUTPUTS) as node:
                prepare: v1.Prepare = await node.expect("prepare")
                assert prepare.member.run_id == derived_id
                again = _check_fetch(prepare, source_id, before, _now_ms())
                assert again.grant != first.grant
                assert again.grant_expires_at_ms > first.grant_expires_at_ms

        asyncio.run(resent())

        bad = v1.OutputsService(address=OUTPUTS.address, cert_sha256=DIGEST, grant_key=b"short")

        async def malformed_then_none(outputs: v1.OutputsService | None) -> None:
            async with connect(outputs) as node:
                # The stream survives: heartbeats are acked, the Prepare still comes.
                await node.send(heartbeat=v1.Heartbeat(seq=1))
                prepare: v1.Prepare = await node.expect("prepare")
                assert prepare.member.run_id == derived_id
                assert not betterproto.serialized_on_wire(prepare.init_from_fetch)
                assert await _outputs_address(coord, holder.node_id) == ""
                # A holder serving nothing cannot seed a new Derivation.
                async with api_client(coord.api, coord.ca_path, coord.admin_token) as api:
                    spec = {**jobspec(gpus=1, project="derived-2"), "init_from": source_id}
                    with pytest.raises(GRPCError) as refused:
                        await api.preview(spec)
                assert refused.value.status == Status.INVALID_ARGUMENT
                assert "which serves no outputs to other Nodes" in str(refused.value.message)
                assert f"({holder.node_id})" in str(refused.value.message)

        asyncio.run(malformed_then_none(bad))
        assert stored_outputs_service(coord.state_dir, holder.node_id) == ("", "", "")
        assert f"outputs service refused node={holder.node_id}" in coord.read_log()
        asyncio.run(malformed_then_none(None))
        assert stored_outputs_service(coord.state_dir, holder.node_id) == ("", "", "")
        # The grant key is a secret shared with the coordinator only: it is never logged.
        assert KEY.hex() not in coord.read_log()
