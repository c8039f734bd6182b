"""Member 0 first, then the rest with its rendezvous: over real gRPC, across coordinator crashes.

The test plays two Nodes against a real coordinator and kills the coordinator (SIGKILL) between
every step: what each Node is sent after a reconnect comes only from the store.
"""

from __future__ import annotations

import asyncio
from contextlib import AbstractAsyncContextManager
from pathlib import Path

from tests.coordinator.grpc_client import NodeStream, api_client, enroll, jobspec, node_stream
from tests.support.coordinator import CoordinatorProcess, start_coordinator
from tuneplane.proto import v1

PREPARED = v1.MemberState(v1.MemberState.PREPARED)
RENDEZVOUS = v1.Rendezvous(master_addr="127.0.0.1", master_port=40001)


async def _states(coord: CoordinatorProcess, run_id: str) -> list[str]:
    async with api_client(coord.api, coord.ca_path, coord.admin_token) as api:
        job = await api.job(run_id)
    return [m.state for m in job.attempts[-1].members]


def test_prepares_follow_member_0_and_survive_coordinator_crashes(tmp_path: Path) -> None:
    with start_coordinator(tmp_path, heartbeat_timeout=60, prepare_timeout=120) as coord:

        async def enroll_two() -> list[v1.EnrollReply]:
            return [
                await enroll(coord.control, coord.ca_path, coord.create_join_token(), name, 1)
                for name in ("rdv-a", "rdv-b")
            ]

        # Members are indexed by Node id: ``first`` holds member 0.
        first, second = sorted(asyncio.run(enroll_two()), key=lambda e: e.node_id)

        def connect(
            node: v1.EnrollReply, held: list[v1.HeldMember] | None = None
        ) -> AbstractAsyncContextManager[NodeStream]:
            return node_stream(
                coord.control, coord.ca_path, node.node_credential, node.node_id,
                hostname=node.node_id, gpus=1, held=held,
            )  # fmt: skip

        async def reserve() -> tuple[str, v1.Prepare]:
            async with connect(first) as a, connect(second):
                async with api_client(coord.api, coord.ca_path, coord.admin_token) as api:
                    receipt = await api.submit(jobspec(gpus=2, members=2), "key-rdv")
                    prepare: v1.Prepare = await a.expect("prepare")
                    await api.wait_for_state(receipt.run_id, "preparing")
                # Member 1 waits for member 0's rendezvous: its Prepare is not issued yet.
                assert await _states(coord, receipt.run_id) == ["preparing", "reserved"]
                return receipt.run_id, prepare

        run_id, prepare0 = asyncio.run(reserve())
        assert prepare0.member.member_index == 0 and prepare0.pick_rendezvous
        assert len(prepare0.rendezvous_nonce) == 64
        assert not prepare0.rendezvous.master_port
        nonce = prepare0.rendezvous_nonce
        coord.kill()
        coord.restart()

        async def member_0_prepares() -> v1.Prepare:
            async with connect(first) as a, connect(second) as b:
                again: v1.Prepare = await a.expect("prepare")
                assert again.member == prepare0.member and again.rendezvous_nonce == nonce
                await a.send(
                    prepare_reply=v1.PrepareReply(
                        member=again.member, ok=True, rendezvous=RENDEZVOUS, rendezvous_held=True
                    )
                )
                prepare1: v1.Prepare = await b.expect("prepare")
                assert await _states(coord, run_id) == ["prepared", "preparing"]
                return prepare1

        prepare1 = asyncio.run(member_0_prepares())
        assert prepare1.member.member_index == 1 and not prepare1.pick_rendezvous
        assert prepare1.rendezvous == RENDEZVOUS and prepare1.rendezvous_nonce == nonce
        coord.kill()
        coord.restart()

        async def member_1_prepares() -> None:
            held = [v1.HeldMember(member=prepare0.member, state=PREPARED)]
            async with connect(first, held) as a, connect(second) as b:
                again: v1.Prepare = await b.expect("prepare")
                assert again.rendezvous == RENDEZVOUS and again.rendezvous_nonce == nonce
                await b.send(prepare_reply=v1.PrepareReply(member=again.member, ok=True))
                # Member 0 is prepared: it gets no Prepare again, only the Commit.
                for node in (a, b):
                    commit: v1.Commit = await node.expect("commit")
                    assert commit.rendezvous == RENDEZVOUS
                assert await _states(coord, run_id) == ["prepared", "prepared"]
                async with api_client(coord.api, coord.ca_path, coord.admin_token) as api:
                    await api.wait_for_state(run_id, "starting")

        asyncio.run(member_1_prepares())


def test_an_older_member_0_node_gets_the_others_prepared_unchecked(tmp_path: Path) -> None:
    """A member 0 Node that holds no listener (an agent older than the check) says so by
    leaving rendezvous_held unset: the other members are told the rendezvous without a nonce,
    so they prepare as before instead of failing a check they could never pass."""
    with start_coordinator(tmp_path, heartbeat_timeout=60) as coord:

        async def scenario() -> v1.Prepare:
            enrolled = sorted(
                [
                    await enroll(coord.control, coord.ca_path, coord.create_join_token(), n, 1)
                    for n in ("old-a", "old-b")
                ],
                key=lambda e: e.node_id,
            )
            first, second = (
                node_stream(
                    coord.control, coord.ca_path, e.node_credential, e.node_id,
                    hostname=e.node_id, gpus=1,
                )
                for e in enrolled
            )  # fmt: skip
            async with first as a, second as b:
                async with api_client(coord.api, coord.ca_path, coord.admin_token) as api:
                    await api.submit(jobspec(gpus=2, members=2), "key-old")
                prepare0: v1.Prepare = await a.expect("prepare")
                assert prepare0.rendezvous_nonce  # a newer Node would hold a listener for it
                await a.send(
                    prepare_reply=v1.PrepareReply(
                        member=prepare0.member, ok=True, rendezvous=RENDEZVOUS
                    )
                )
                prepare1: v1.Prepare = await b.expect("prepare")
                await b.send(prepare_reply=v1.PrepareReply(member=prepare1.member, ok=True))
                for node in (a, b):
                    commit: v1.Commit = await node.expect("commit")
                    assert commit.rendezvous == RENDEZVOUS
                return prepare1

        prepare1 = asyncio.run(scenario())
        assert prepare1.rendezvous == RENDEZVOUS and prepare1.rendezvous_nonce == ""
