"""Real gRPC clients over loopback TLS for the coordinator's tests, including a test-driven Node.

Rules: nothing here imitates the coordinator; it dials the real listeners with the real CA and
speaks the generated protocol. asyncio code: tests call it through ``asyncio.run``.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import ssl
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

import anyio
import betterproto
from grpclib.client import Channel
from grpclib.const import Cardinality
from grpclib.exceptions import StreamTerminatedError

from tuneplane.agent.client_tls import grpc_client_context
from tuneplane.coordinator.catalogue import Catalogue
from tuneplane.proto import v1

if TYPE_CHECKING:
    from tests.support.coordinator import CoordinatorProcess

TIMEOUT_S = 10.0


def open_channel(
    address: str, ca_path: Path | None = None, ctx: ssl.SSLContext | None = None
) -> Channel:
    host, _, port = address.rpartition(":")
    return Channel(host, int(port), ssl=ctx or grpc_client_context(ca_path))  # type: ignore[arg-type]


def bearer(token: str) -> dict[str, str]:
    return {"authorization": f"Bearer {token}"}


def recipe_digest(method_id: str) -> str:
    recipe = Catalogue.bundled().get(method_id)
    assert recipe is not None
    return recipe.digest


def jobspec(
    gpus: int = 2,
    profile: str = "h200",
    project: str = "demo",
    method_id: str = "custom/custom",
    **resources: Any,
) -> dict[str, Any]:
    """A JobSpec as `tp` would build it for a custom job."""
    return {
        "api_version": "tuneplane/v1",
        "project": project,
        "experiment": "hello",
        "method_id": method_id,
        "recipe_digest": recipe_digest(method_id),
        "runtime_id": "",
        "entrypoint": ["bash", "train.sh"],
        "resources": {"profile": profile, "series": "", "gpus": gpus, **resources},
        "parameters": {},
        "env": {},
        "source_files": {"train.sh": base64.b64encode(b"echo hello\n").decode()},
    }


class Api:
    """The researcher API with a token."""

    def __init__(self, channel: Channel, token: str) -> None:
        self.stub = v1.ApiStub(channel, metadata=bearer(token), timeout=TIMEOUT_S)

    async def preview(self, spec: dict[str, Any]) -> v1.PreviewReply:
        return await self.stub.preview(v1.PreviewRequest(jobspec_json=json.dumps(spec)))

    async def commit(self, reply: v1.PreviewReply, retry_key: str) -> v1.Receipt:
        return await self.stub.commit(
            v1.CommitRequest(preview_id=reply.preview_id, digest=reply.digest, retry_key=retry_key)
        )

    async def submit(self, spec: dict[str, Any], retry_key: str) -> v1.Receipt:
        return await self.commit(await self.preview(spec), retry_key)

    async def job(self, run_id: str) -> v1.Job:
        return await self.stub.get_job(v1.GetJobRequest(run_id=run_id))

    async def wait_for_state(self, run_id: str, state: str, timeout: float = 15.0) -> v1.Job:
        """Poll GetJob until the Job is in ``state``; fail with the last Job seen."""
        job = await self.job(run_id)
        with anyio.move_on_after(timeout):
            while job.state != state:
                await anyio.sleep(0.05)
                job = await self.job(run_id)
            return job
        raise AssertionError(f"Job {run_id} did not reach {state} in {timeout} s: {job.to_dict()}")


@asynccontextmanager
async def api_client(address: str, ca_path: Path, token: str) -> AsyncIterator[Api]:
    channel = open_channel(address, ca_path)
    try:
        yield Api(channel, token)
    finally:
        channel.close()


# What an admin sees listed: what a refusal is checked against to have changed nothing.


async def job_ids(coord: CoordinatorProcess) -> list[str]:
    """Every Job's run id, as ListJobs gives them to the admin."""
    async with api_client(coord.api, coord.ca_path, coord.admin_token) as api:
        return [j.run_id for j in (await api.stub.list_jobs(v1.ListJobsRequest())).jobs]


async def node_ids(coord: CoordinatorProcess) -> list[str]:
    """Every enrolled Node's id, sorted."""
    async with api_client(coord.api, coord.ca_path, coord.admin_token) as api:
        return sorted(n.id for n in (await api.stub.list_nodes(v1.ListNodesRequest())).nodes)


async def fleet_names(coord: CoordinatorProcess) -> list[str]:
    """Every Fleet's name, as ListFleets gives them to the admin."""
    async with api_client(coord.api, coord.ca_path, coord.admin_token) as api:
        return [f.name for f in (await api.stub.list_fleets(v1.ListFleetsRequest())).fleets]


def simulated_inventory(hostname: str, gpus: int, series: str = "h200") -> v1.Inventory:
    return v1.Inventory(
        hostname=hostname,
        cpu_count=8,
        memory_bytes=64 << 30,
        gpu_source="simulated",
        gpus=[
            v1.Gpu(index=i, uuid=f"GPU-{hostname}-{i}", name=series, series=series, healthy=True)
            for i in range(gpus)
        ],
    )


async def enroll(
    control: str, ca_path: Path, join_token: str, hostname: str, gpus: int
) -> v1.EnrollReply:
    channel = open_channel(control, ca_path)
    try:
        stub = v1.ControlStub(channel, timeout=TIMEOUT_S)
        return await stub.enroll(
            v1.EnrollRequest(
                join_token=join_token,
                hostname=hostname,
                inventory=simulated_inventory(hostname, gpus),
            )
        )
    finally:
        channel.close()


class NodeStream:
    """The test playing a Node on one Connect stream."""

    def __init__(self, stream: Any) -> None:
        self.stream = stream
        self.welcome: v1.Welcome | None = None

    async def send(self, **body: Any) -> None:
        await self.stream.send_message(v1.NodeMessage(**body))

    async def recv(self, timeout: float = 10.0) -> tuple[str, Any]:
        """The next message that is not a HeartbeatAck, as (kind, body)."""
        with anyio.fail_after(timeout):
            while True:
                message = await self.stream.recv_message()
                if message is None:
                    # The coordinator ended the stream: its status (an error) is in the trailers.
                    # grpclib reads them only once our side is ended too, so end it first.
                    if not self.stream._end_done:  # no public "already ended" check
                        with contextlib.suppress(StreamTerminatedError):
                            await self.stream.end()
                    await self.stream.recv_trailing_metadata()
                    return "end", None
                kind, body = betterproto.which_one_of(message, "body")
                if kind != "heartbeat_ack":
                    return kind, body

    async def expect(self, kind: str, timeout: float = 10.0) -> Any:
        got, body = await self.recv(timeout)
        assert got == kind, f"expected {kind}, got {got}: {body}"
        return body

    async def report(
        self, seq: int, member: v1.MemberRef, state: v1.MemberState, **extra: Any
    ) -> int:
        await self.send(report=v1.MemberReport(report_seq=seq, member=member, state=state, **extra))
        ack = await self.expect("report_ack")
        return int(ack.report_seq)

    async def report_running(self, seq: int, member: v1.MemberRef) -> int:
        """Report a committed member committed, starting, then running (``seq`` on), as a real
        Node does: the coordinator applies only one lifecycle step at a time. Returns the last
        sequence number used."""
        for offset, name in enumerate(("COMMITTED", "STARTING", "RUNNING")):
            ack = await self.report(seq + offset, member, v1.MemberState[name])
            assert ack == seq + offset
        return seq + 2


def connect_request(
    channel: Channel, credential: str, metadata: dict[str, str] | None = None
) -> Any:
    """A Connect stream on ``channel`` with the Node's credential (and ``metadata``), not yet
    opened: ``async with`` it, then ``send_request``."""
    return channel.request(
        "/tuneplane.v1.Control/Connect",
        Cardinality.STREAM_STREAM,
        v1.NodeMessage,
        v1.CoordinatorMessage,
        metadata=bearer(credential) | (metadata or {}),
    )


def enrolled_node(coord: CoordinatorProcess, hostname: str, gpus: int = 2) -> v1.EnrollReply:
    """A Node enrolled for real with a fresh join token (no agent runs for it)."""
    token = coord.create_join_token()
    return asyncio.run(enroll(coord.control, coord.ca_path, token, hostname, gpus))


@asynccontextmanager
async def node_stream(
    control: str,
    ca_path: Path,
    credential: str,
    node_id: str,
    hostname: str = "node-a",
    gpus: int = 2,
    held: list[v1.HeldMember] | None = None,
    inventory: v1.Inventory | None = None,
    outputs: v1.OutputsService | None = None,
    protocol: int = 0,
    capabilities: tuple[str, ...] = (),
    agent_version: str = "test",
) -> AsyncIterator[NodeStream]:
    """Connect, send Hello with ``inventory`` (default: ``gpus`` simulated GPUs) and, when
    given, the outputs listener it reports, and check the Welcome (kept as ``welcome``).
    ``protocol`` 0 and no ``capabilities`` is an unversioned (0.1.x) agent's Hello."""
    channel = open_channel(control, ca_path)
    try:
        async with connect_request(channel, credential) as stream:
            await stream.send_request()
            node = NodeStream(stream)
            hello = v1.Hello(
                node_id=node_id,
                agent_version=agent_version,
                inventory=inventory or simulated_inventory(hostname, gpus),
                held=held or [],
                protocol=protocol,
                capabilities=list(capabilities),
            )
            if outputs is not None:
                hello.outputs = outputs
            await node.send(hello=hello)
            node.welcome = await node.expect("welcome")
            yield node
            # The coordinator may have closed the stream first; its status is raised on exit.
            if not stream._end_done:  # grpclib offers no public "already ended" check
                with contextlib.suppress(StreamTerminatedError):
                    await stream.end()
    finally:
        channel.close()
