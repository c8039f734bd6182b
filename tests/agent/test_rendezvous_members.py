"""The member manager's side of the rendezvous check, on a real journal and real sockets.

Member 0's Prepare holds the rendezvous port (a listener that answers for the attempt's nonce)
until Abort or launch, and again after an agent restart; another member's Prepare is refused,
journaled and answered the same way on a repeat when the rendezvous cannot be reached.
"""

from __future__ import annotations

import socket
from pathlib import Path

import attrs
import trio

from tests.agent.test_members import KEY, harness, prepare
from tuneplane.agent import messages as m
from tuneplane.agent import rendezvous as rdv
from tuneplane.agent.journal_records import MemberKey
from tuneplane.agent.member_state import MemberState

S = MemberState
NONCE = "c0ffee" * 10 + "beef"


def _port_free(port: int) -> bool:
    with socket.socket() as sock:
        try:
            sock.bind(("0.0.0.0", port))
        except OSError:
            return False
    return True


def _member_0(gpus: tuple[int, ...] = (0,), script: str = "exit 0\n") -> m.Prepare:
    return attrs.evolve(prepare(KEY, gpus, script), rendezvous_nonce=NONCE)


async def _held_port(h_replies: list[m.PrepareReply]) -> int:
    (reply,) = h_replies
    assert reply.ok and reply.rendezvous is not None and reply.rendezvous_held, reply
    return reply.rendezvous.master_port


async def test_member_0_holds_the_port_until_abort(tmp_path: Path) -> None:
    async with harness(tmp_path) as h:
        await h.manager.handle(_member_0())
        port = await _held_port(h.replies())
        assert not _port_free(port)
        with trio.fail_after(20):
            await rdv.probe("127.0.0.1", port, NONCE)
        await h.manager.handle(m.Abort(KEY, "member 1 refused Prepare"))
        assert await h.state() is S.ABORTED
        assert _port_free(port)


async def test_a_restarted_agent_holds_a_prepared_member_0s_port_again(tmp_path: Path) -> None:
    async with harness(tmp_path) as h:
        await h.manager.handle(_member_0())
        port = await _held_port(h.replies())
    # The agent is gone (its listener with it); a new one replays the same journal.
    async with harness(tmp_path) as h:
        await h.manager.replay()
        assert await h.state() is S.PREPARED
        with trio.fail_after(20):
            await rdv.probe("127.0.0.1", port, NONCE)
        # A repeated Prepare gets the same rendezvous: the port the members are probing.
        await h.manager.handle(_member_0())
        (again,) = h.replies()
        assert again.rendezvous == m.Rendezvous("127.0.0.1", port)
        await h.manager.handle(m.Abort(KEY, "done"))
        assert _port_free(port)


async def test_launch_releases_the_port_for_rank_0(tmp_path: Path) -> None:
    async with harness(tmp_path) as h:
        await h.manager.handle(_member_0(script="sleep 30\n"))
        port = await _held_port(h.replies())
        await h.manager.handle(m.Commit(KEY, m.Rendezvous("127.0.0.1", port)))
        await h.wait_state(S.RUNNING)
        assert _port_free(port)
        await h.manager.handle(m.Cancel(KEY, "test over", 1))
        await h.wait_state(S.EXITED)


async def test_an_unreachable_rendezvous_refuses_prepare_and_holds_no_gpu(tmp_path: Path) -> None:
    member_1 = MemberKey(KEY.run_id, KEY.attempt, 1)
    with socket.socket() as closed:
        closed.bind(("127.0.0.1", 0))  # bound, never listening: every connection is refused
        port = closed.getsockname()[1]
        cmd = attrs.evolve(
            prepare(member_1, (1,)),
            pick_rendezvous=False,
            rendezvous=m.Rendezvous("127.0.0.1", port),
            rendezvous_nonce=NONCE,
        )
        async with harness(tmp_path) as h:
            with trio.fail_after(60):
                await h.manager.handle(cmd)
            (refused,) = h.replies()
            assert not refused.ok and refused.rendezvous is None
            assert f"cannot reach the rendezvous 127.0.0.1:{port}" in refused.reason
            assert "from interface" in refused.reason
            assert await h.state(member_1) is S.ABORTED
            assert await h.journal.gpu_owners() == {}
            # A repeat is answered from the journal, without probing for another 10 s.
            with trio.fail_after(rdv.PROBE_TIMEOUT_S / 2):
                await h.manager.handle(cmd)
            assert h.replies()[-1] == refused
