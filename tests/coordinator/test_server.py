"""A real coordinator process and real gRPC clients over TLS: security, admission, idempotency."""

from __future__ import annotations

import asyncio
import json
import ssl
import stat
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from grpclib import GRPCError
from grpclib.const import Status

from tests.coordinator.grpc_client import (
    api_client,
    bearer,
    enroll,
    jobspec,
    node_stream,
    open_channel,
)
from tests.support.coordinator import CoordinatorProcess, start_coordinator
from tests.support.processes import faketime_env
from tests.support.store_backend import StoreBackend
from tuneplane.agent.client_tls import grpc_client_context
from tuneplane.coordinator.server.tls import create_dev_ca
from tuneplane.proto import v1


@pytest.fixture(scope="module")
def coord(
    tmp_path_factory: pytest.TempPathFactory, module_store_backend: StoreBackend
) -> Iterator[CoordinatorProcess]:
    with start_coordinator(
        tmp_path_factory.mktemp("server"), heartbeat_interval=0.5, heartbeat_timeout=1.5
    ) as c:
        yield c


def test_init_lays_out_the_state_directory(coord: CoordinatorProcess) -> None:
    d = coord.state_dir
    for secret in ("admin.token", "tls/ca.key", "tls/server.key"):
        assert stat.S_IMODE((d / secret).stat().st_mode) == 0o600, secret
    context = json.loads(coord.context_path.read_text())
    assert context == {
        "coordinator": coord.api,
        "api_addresses": [coord.api],  # alone: just this one (several share a store: all)
        "ca": str(coord.ca_path),
        "token_file": str(d / "admin.token"),
    }
    endpoints = json.loads((d / "endpoints.json").read_text())
    assert endpoints["pid"] == coord.pid
    assert endpoints["ca"] == str(coord.ca_path)


def test_init_refuses_an_initialised_directory(coord: CoordinatorProcess) -> None:
    out = coord.admin("init")
    assert out.returncode == 1
    assert "already holds a coordinator" in out.stderr


def test_a_client_with_the_wrong_ca_is_refused(coord: CoordinatorProcess, tmp_path: Path) -> None:
    other = create_dev_ca(tmp_path, ["localhost", "127.0.0.1"])

    async def call() -> None:
        channel = open_channel(coord.api, ctx=grpc_client_context(other.ca_cert))
        try:
            await v1.ApiStub(channel, metadata=bearer(coord.admin_token), timeout=5).list_jobs(
                v1.ListJobsRequest()
            )
        finally:
            channel.close()

    with pytest.raises(ssl.SSLCertVerificationError):
        asyncio.run(call())


@pytest.mark.parametrize("token", [None, "tpa_not-a-token"])
def test_unauthenticated_api_calls_are_refused(
    coord: CoordinatorProcess, token: str | None
) -> None:
    async def call() -> None:
        channel = open_channel(coord.api, coord.ca_path)
        try:
            stub = v1.ApiStub(channel, metadata=bearer(token) if token else None, timeout=5)
            await stub.list_jobs(v1.ListJobsRequest())
        finally:
            channel.close()

    with pytest.raises(GRPCError) as err:
        asyncio.run(call())
    assert err.value.status == Status.UNAUTHENTICATED
    assert err.value.message and "token" in err.value.message


def test_telemetry_ping_refuses_a_user_token(coord: CoordinatorProcess) -> None:
    """A credential for one listener is refused on the others: the admin token on the
    telemetry listener's Ping is UNAUTHENTICATED, with the sentence saying what to use."""

    async def call() -> v1.PingReply:
        channel = open_channel(coord.telemetry, coord.ca_path)
        try:
            stub = v1.TelemetryStub(channel, metadata=bearer(coord.admin_token), timeout=5)
            return await stub.ping(v1.PingRequest(note="hi"))
        finally:
            channel.close()

    with pytest.raises(GRPCError) as err:
        asyncio.run(call())
    assert err.value.status == Status.UNAUTHENTICATED
    assert "tuneplane-node doctor" in (err.value.message or "")


def test_enroll_spends_a_join_token_once(coord: CoordinatorProcess) -> None:
    token = coord.create_join_token()
    reply = asyncio.run(enroll(coord.control, coord.ca_path, token, "node-once", 2))
    assert reply.node_id.startswith("node-")
    assert reply.fleet == "default"
    assert reply.node_credential.startswith("tpn_")
    with pytest.raises(GRPCError) as err:
        asyncio.run(enroll(coord.control, coord.ca_path, token, "node-twice", 2))
    assert err.value.status == Status.PERMISSION_DENIED
    assert "already used" in (err.value.message or "")


def test_an_expired_join_token_is_refused(coord: CoordinatorProcess) -> None:
    # Made an hour ago (the admin command's clock moved back), valid for a minute.
    past = faketime_env("-1h", "to make a join token an hour in the past")
    token = coord.create_join_token(ttl="1m", env=past)
    with pytest.raises(GRPCError) as err:
        asyncio.run(enroll(coord.control, coord.ca_path, token, "node-late", 2))
    assert err.value.status == Status.PERMISSION_DENIED
    assert "expired" in (err.value.message or "")


def test_an_unknown_join_token_is_refused(coord: CoordinatorProcess) -> None:
    with pytest.raises(GRPCError) as err:
        asyncio.run(enroll(coord.control, coord.ca_path, "tpj_made-up", "node-x", 2))
    assert err.value.status == Status.PERMISSION_DENIED
    assert "not known" in (err.value.message or "")


def test_token_create_refuses_an_unknown_fleet(coord: CoordinatorProcess) -> None:
    out = coord.admin("token", "create", "--fleet", "nowhere")
    assert out.returncode == 1
    assert "no Fleet 'nowhere'" in out.stderr
    created = coord.admin("fleet", "create", "lab")
    assert created.returncode == 0, created.stderr
    assert coord.create_join_token(fleet="lab").startswith("tpj_")


def test_connect_with_an_unknown_credential_is_refused(coord: CoordinatorProcess) -> None:
    async def go() -> None:
        async with node_stream(coord.control, coord.ca_path, "tpn_unknown", "node-x"):
            raise AssertionError("the coordinator accepted an unknown credential")

    with pytest.raises(GRPCError) as err:
        asyncio.run(go())
    assert err.value.status == Status.UNAUTHENTICATED
    assert "not enrolled" in (err.value.message or "")


def test_hello_naming_another_node_is_refused(coord: CoordinatorProcess) -> None:
    reply = asyncio.run(enroll(coord.control, coord.ca_path, coord.create_join_token(), "n", 1))

    async def go() -> None:
        async with node_stream(coord.control, coord.ca_path, reply.node_credential, "node-other"):
            raise AssertionError("the coordinator accepted a Hello for another Node")

    with pytest.raises(GRPCError) as err:
        asyncio.run(go())
    assert err.value.status == Status.PERMISSION_DENIED


def test_a_silent_stream_is_closed_after_the_heartbeat_timeout(coord: CoordinatorProcess) -> None:
    reply = asyncio.run(enroll(coord.control, coord.ca_path, coord.create_join_token(), "q", 1))

    started = time.monotonic()

    async def go() -> None:
        async with node_stream(
            coord.control, coord.ca_path, reply.node_credential, reply.node_id
        ) as node:
            # Send nothing: the coordinator must give up on us by silence alone.
            await node.recv(timeout=10)

    with pytest.raises(GRPCError) as err:
        asyncio.run(go())
    assert err.value.status == Status.UNAVAILABLE
    assert "heartbeat timeout" in (err.value.message or "")
    # node.recv gives up after 10 s, so reaching here means the coordinator closed it first.
    assert time.monotonic() - started > 1.0


def test_heartbeats_keep_a_stream_open_and_are_acked(coord: CoordinatorProcess) -> None:
    reply = asyncio.run(enroll(coord.control, coord.ca_path, coord.create_join_token(), "h", 1))

    async def go() -> list[int]:
        acks = []
        async with node_stream(
            coord.control, coord.ca_path, reply.node_credential, reply.node_id
        ) as node:
            for seq in range(1, 6):  # 5 x 0.5 s: longer than the 1.5 s timeout
                await node.send(heartbeat=v1.Heartbeat(seq=seq))
                message = await node.stream.recv_message()
                acks.append(message.heartbeat_ack.seq)
                await asyncio.sleep(0.5)
        return acks

    assert asyncio.run(go()) == [1, 2, 3, 4, 5]


def _submit_same_key(coord: CoordinatorProcess, spec: dict[str, Any], key: str, n: int) -> Any:
    async def go() -> list[v1.Receipt]:
        async with api_client(coord.api, coord.ca_path, coord.admin_token) as api:
            preview = await api.preview(spec)
            return list(await asyncio.gather(*(api.commit(preview, key) for _ in range(n))))

    return asyncio.run(go())


def test_commit_returns_the_same_receipt_on_repeat(coord: CoordinatorProcess) -> None:
    async def go() -> tuple[v1.PreviewReply, v1.Receipt, v1.Receipt, v1.Job]:
        async with api_client(coord.api, coord.ca_path, coord.admin_token) as api:
            preview = await api.preview(jobspec(project="repeat"))
            first = await api.commit(preview, "key-repeat")
            second = await api.commit(preview, "key-repeat")
            return preview, first, second, await api.job(first.run_id)

    preview, first, second, job = asyncio.run(go())
    assert preview.summary.fleet == "default"
    assert preview.summary.backend == "node"
    assert preview.summary.series == "h200"
    resolved = json.loads(preview.resolved_jobspec_json)
    assert resolved["resources"]["series"] == "h200"
    assert resolved["runtime_id"] == "host:bash"
    assert first.created and not second.created
    assert (first.run_id, first.admitted_at_ms) == (second.run_id, second.admitted_at_ms)
    assert job.state == "queued"
    assert job.owner == "admin"
    assert job.digest == preview.digest


def test_fifty_concurrent_commits_with_one_key_make_one_job(coord: CoordinatorProcess) -> None:
    receipts = _submit_same_key(coord, jobspec(project="concurrent"), "key-concurrent", 50)
    assert len(receipts) == 50 and len({r.run_id for r in receipts}) == 1
    assert sum(r.created for r in receipts) == 1

    async def count() -> int:
        async with api_client(coord.api, coord.ca_path, coord.admin_token) as api:
            reply = await api.stub.list_jobs(v1.ListJobsRequest(project="concurrent"))
            return len(reply.jobs)

    assert asyncio.run(count()) == 1


def test_a_different_digest_is_refused(coord: CoordinatorProcess) -> None:
    async def go() -> None:
        async with api_client(coord.api, coord.ca_path, coord.admin_token) as api:
            preview = await api.preview(jobspec(project="digest"))
            await api.stub.commit(
                v1.CommitRequest(
                    preview_id=preview.preview_id, digest="sha256:" + "0" * 64, retry_key="k-dg"
                )
            )

    with pytest.raises(GRPCError) as err:
        asyncio.run(go())
    assert err.value.status == Status.FAILED_PRECONDITION
    assert "does not match preview" in (err.value.message or "")


def test_a_retry_key_reused_for_another_preview_is_refused(coord: CoordinatorProcess) -> None:
    async def go() -> None:
        async with api_client(coord.api, coord.ca_path, coord.admin_token) as api:
            await api.submit(jobspec(project="reuse"), "k-reuse")
            await api.submit(jobspec(project="reuse", gpus=4), "k-reuse")

    with pytest.raises(GRPCError) as err:
        asyncio.run(go())
    assert err.value.status == Status.FAILED_PRECONDITION
    assert "already confirmed" in (err.value.message or "")


def _stale(spec: dict[str, Any]) -> dict[str, Any]:
    spec["recipe_digest"] = "sha256:" + "1" * 64
    return spec


def _param(spec: dict[str, Any]) -> dict[str, Any]:
    spec.update(
        method_id="pytorch/process-group",
        recipe_digest=jobspec(method_id="pytorch/process-group")["recipe_digest"],
        parameters={"steps": 0},
    )
    return spec


def _wrong_type(spec: dict[str, Any]) -> dict[str, Any]:
    spec["resources"]["gpus"] = "2"
    return spec


def _unknown_key(spec: dict[str, Any]) -> dict[str, Any]:
    spec["colour"] = "blue"
    return spec


def _too_many(spec: dict[str, Any]) -> dict[str, Any]:
    spec["resources"].update(gpus=33, members=33)
    return spec


def _profile(spec: dict[str, Any]) -> dict[str, Any]:
    spec["resources"]["profile"] = "a100"
    return spec


@pytest.mark.parametrize(
    ("edit", "field", "words"),
    [
        (_wrong_type, "resources.gpus", "expected int"),
        (_unknown_key, "colour", "is not a JobSpec field"),
        (_too_many, "resources.members", "1 to 32 members"),
        (_profile, "resources.profile", "not a Profile"),
        (_stale, "recipe_digest", "tp recipe upgrade hello"),
        (_param, "parameters.steps", "minimum"),
    ],
)
def test_bad_jobspecs_get_their_own_error_and_leave_no_job(
    coord: CoordinatorProcess, edit: Any, field: str, words: str
) -> None:
    spec = edit(jobspec(project="bad"))

    async def go() -> tuple[GRPCError, int]:
        async with api_client(coord.api, coord.ca_path, coord.admin_token) as api:
            try:
                await api.preview(spec)
            except GRPCError as exc:
                error = exc
            else:
                raise AssertionError("the bad JobSpec was accepted")
            jobs = await api.stub.list_jobs(v1.ListJobsRequest(project="bad"))
            return error, len(jobs.jobs)

    error, jobs = asyncio.run(go())
    assert error.status == Status.INVALID_ARGUMENT
    assert f"'{field}'" in (error.message or ""), error.message
    assert words in (error.message or ""), error.message
    assert jobs == 0


def test_get_job_for_an_unknown_run_id_is_not_found(coord: CoordinatorProcess) -> None:
    async def go() -> None:
        async with api_client(coord.api, coord.ca_path, coord.admin_token) as api:
            await api.job("run-000000000000")

    with pytest.raises(GRPCError) as err:
        asyncio.run(go())
    assert err.value.status == Status.NOT_FOUND
