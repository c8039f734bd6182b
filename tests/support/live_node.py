"""A Node the test plays on a thread of its own, its Connect stream held open, so that a page a
browser shows (driven from the test's thread) can follow what the Node reports: a Job placed
on it and running, and its member's log growing.

Rules: real parts only (a Node enrolled with a join token, Prepare, Commit, member reports and
log chunks over the real control stream; Jobs submitted over the gRPC Api); the thread runs a
plain asyncio loop of its own, so it neither meets Playwright's loop nor trio_asyncio's.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import Coroutine, Iterator
from typing import Any, TypeVar

import attrs

from tests.coordinator.grpc_client import (
    Api,
    NodeStream,
    api_client,
    enroll,
    jobspec,
    node_stream,
)
from tests.support.coordinator import CoordinatorProcess
from tuneplane.proto import v1

T = TypeVar("T")
CALL_TIMEOUT_S = 60.0


@attrs.define(eq=False)
class LiveNode:
    """The Node, and the owner's Api client, living on ``loop`` (call them through
    :meth:`call`)."""

    coord: CoordinatorProcess
    hostname: str
    token: str  # the user whose Jobs this Node runs
    # The outputs listener its Hello reports (so it can hold a Derivation's source); None: none.
    outputs: v1.OutputsService | None = None
    loop: asyncio.AbstractEventLoop = attrs.field(factory=asyncio.SelectorEventLoop)
    stack: contextlib.AsyncExitStack = attrs.field(factory=contextlib.AsyncExitStack)
    node: NodeStream | None = None
    node_id: str = ""
    api: Api | None = None
    seq: int = 1
    offsets: dict[tuple[str, int, int, str], int] = attrs.field(factory=dict)

    def call(self, work: Coroutine[Any, Any, T]) -> T:
        """Run ``work`` on the Node's loop and wait for its result."""
        return asyncio.run_coroutine_threadsafe(work, self.loop).result(CALL_TIMEOUT_S)

    async def open(self) -> None:
        join = self.coord.create_join_token()
        enrolled = await enroll(self.coord.control, self.coord.ca_path, join, self.hostname, 1)
        self.node_id = enrolled.node_id
        self.node = await self.stack.enter_async_context(
            node_stream(
                self.coord.control,
                self.coord.ca_path,
                enrolled.node_credential,
                enrolled.node_id,
                hostname=self.hostname,
                gpus=1,
                outputs=self.outputs,
            )
        )
        self.api = await self.stack.enter_async_context(
            api_client(self.coord.api, self.coord.ca_path, self.token)
        )

    async def run_job(self, project: str, key: str) -> v1.MemberRef:
        """Submit a one-GPU Job as the owner and play it through Prepare and Commit to running
        here; its member."""
        assert self.node is not None and self.api is not None
        receipt = await self.api.submit(jobspec(gpus=1, project=project), key)
        prepare: v1.Prepare = await self.node.expect("prepare")
        assert prepare.member.run_id == receipt.run_id, prepare
        await self.node.send(prepare_reply=v1.PrepareReply(member=prepare.member, ok=True))
        await self.node.expect("commit")
        self.seq = await self.node.report_running(self.seq, prepare.member) + 1
        await self.api.wait_for_state(receipt.run_id, "running")
        return prepare.member

    async def succeed(
        self, member: v1.MemberRef, out_dir: str, manifest: v1.OutputManifest
    ) -> None:
        """Report the running member exited 0, its outputs in ``out_dir`` as ``manifest``
        says (what a Derivation begins from), and wait for its Job to have succeeded."""
        assert self.node is not None and self.api is not None
        exited = v1.MemberState(v1.MemberState.EXITED)
        self.seq = await self.node.report(
            self.seq, member, exited, has_exit=True, exit_code=0, out_dir=out_dir,
            output_manifest=manifest,
        ) + 1  # fmt: skip
        await self.api.wait_for_state(member.run_id, "succeeded")

    async def log(self, member: v1.MemberRef, text: str, stream: str = "stdout") -> None:
        """Ship ``text`` as the next bytes of the member's ``stream``, acknowledged."""
        assert self.node is not None
        key = (member.run_id, member.attempt, member.member_index, stream)
        data = text.encode()
        offset = self.offsets.get(key, 0)
        chunk = v1.LogChunk(member=member, stream=stream, offset=offset, data=data)
        await self.node.send(log_chunk=chunk)
        await self.node.expect("log_ack")
        self.offsets[key] = offset + len(data)


@contextlib.contextmanager
def live_node(
    coord: CoordinatorProcess,
    hostname: str,
    token: str,
    outputs: v1.OutputsService | None = None,
) -> Iterator[LiveNode]:
    """A connected Node with one GPU running ``token``'s Jobs, until the block ends; with
    ``outputs``, serving its ended members' outputs to other Nodes."""
    found = LiveNode(coord, hostname, token, outputs)
    thread = threading.Thread(target=found.loop.run_forever, name=f"node-{hostname}", daemon=True)
    thread.start()
    try:
        found.call(found.open())
        yield found
    finally:
        with contextlib.suppress(Exception):
            found.call(found.stack.aclose())
        found.loop.call_soon_threadsafe(found.loop.stop)
        thread.join(CALL_TIMEOUT_S)
        found.loop.close()
