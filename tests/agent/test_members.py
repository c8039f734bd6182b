"""The member manager on a real journal, real files and real runner processes (no coordinator)."""

from __future__ import annotations

import base64
import hashlib
import os
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import attrs
import pytest
import trio

from tests.support import accounts
from tuneplane.agent import members_exits
from tuneplane.agent import messages as m
from tuneplane.agent.accounts import LEASE_FILE, read_lease
from tuneplane.agent.adapter import open_aio_host
from tuneplane.agent.config import WorkloadPolicy
from tuneplane.agent.inventory import Inventory, SimulatedGpus, simulated_inventory
from tuneplane.agent.journal import Journal
from tuneplane.agent.journal_records import MemberKey, NewMember
from tuneplane.agent.member_state import MemberState
from tuneplane.agent.members import MemberManager
from tuneplane.coordinator import capsule
from tuneplane.proto.contract import jobspec

S = MemberState
INV = simulated_inventory("node-a", SimulatedGpus("h200", 2))
KEY = MemberKey("run-1", 1, 0)


def make_spec(script: str, grace: int = 2) -> jobspec.JobSpec:
    return jobspec.JobSpec(
        api_version=jobspec.API_VERSION, project="p", experiment="e", method_id="custom/custom",
        recipe_digest="sha256:0", runtime_id="host:bash", entrypoint=("bash", "train.sh"),
        resources=jobspec.Resources(profile="h200", series="h200", gpus=1),
        grace_period_s=grace,
        source_files={"train.sh": base64.b64encode(script.encode()).decode()},
    )  # fmt: skip


def prepare(key: MemberKey, gpus: tuple[int, ...], script: str = "exit 0\n") -> m.Prepare:
    """A Prepare with a capsule sealed by the coordinator's own sealing code."""
    spec = make_spec(script)
    files = capsule.seal(spec, "member", key.run_id, key.attempt, 1)
    return m.Prepare(
        key, jobspec.canonical_json(spec), 1, gpus, True, capsule.digests(files),
        {name: text.encode() for name, text in files.items()},
    )  # fmt: skip


@attrs.define
class Harness:
    manager: MemberManager
    journal: Journal
    sent: list[m.Outgoing]
    # Where members' work and output directories live (reachable by the pool's accounts).
    roots: Path
    # What the Node's GPUs look like now: the last inventory and every fresh probe at launch.
    node: list[Inventory] = attrs.field(factory=lambda: [INV])

    async def state(self, key: MemberKey = KEY) -> MemberState | None:
        record = await self.journal.member(key)
        return None if record is None else record.state

    async def wait_state(self, want: MemberState, key: MemberKey = KEY) -> None:
        with trio.fail_after(20):
            while await self.state(key) is not want:
                await trio.sleep(0.05)

    def reports(self) -> list[str]:
        return [x.report.state.value for x in self.sent if isinstance(x, m.Report)]

    def replies(self) -> list[m.PrepareReply]:
        return [x for x in self.sent if isinstance(x, m.PrepareReply)]


@asynccontextmanager
async def harness(
    tmp_path: Path, pool: tuple[str, ...] | None = None, roots: Path | None = None
) -> AsyncIterator[Harness]:
    """A manager on ``tmp_path``'s journal; a second one on the same path is a restarted agent."""
    async with open_aio_host():
        journal = await Journal.open(tmp_path / "journal.db")
        sent: list[m.Outgoing] = []

        async def publish(message: m.Outgoing) -> None:
            sent.append(message)

        # As root, members run as a real pool of fresh accounts, as on a production Node.
        if pool is None:
            pool = tuple(accounts.make_pool(2)) if accounts.is_root() else ()
        policy = WorkloadPolicy("pool", pool) if pool else WorkloadPolicy("agent")
        if roots is None:
            roots = accounts.traversable_root("members") if pool else tmp_path
        try:
            async with trio.open_nursery() as nursery:
                node = [INV]

                async def probe() -> Inventory:
                    return node[0]

                manager = MemberManager(
                    journal, tmp_path / "members", roots / "out", lambda: node[0],
                    lambda: "127.0.0.1", publish, nursery,
                    work_root=roots / "work", policy=policy, refresh=probe,
                )  # fmt: skip
                yield Harness(manager, journal, sent, roots, node)
                nursery.cancel_scope.cancel()
        finally:
            await journal.close()


async def test_prepare_is_idempotent_and_owns_the_gpus(tmp_path: Path) -> None:
    async with harness(tmp_path) as h:
        await h.manager.handle(prepare(KEY, (1,)))
        await h.manager.handle(prepare(KEY, (1,)))
        first, again = h.replies()
        assert first.ok and first.rendezvous is not None
        assert first.rendezvous.master_addr == "127.0.0.1"
        assert again == first
        assert await h.journal.gpu_owners() == {1: KEY}
        work = h.roots / "work" / str(KEY)
        assert (work / "train.sh").read_text() == "exit 0\n"


async def test_a_busy_gpu_refuses_the_second_member(tmp_path: Path) -> None:
    async with harness(tmp_path) as h:
        await h.manager.handle(prepare(KEY, (0,)))
        other = MemberKey("run-2", 1, 0)
        await h.manager.handle(prepare(other, (0, 1)))
        refused = h.replies()[-1]
        assert not refused.ok and "GPU 0 is busy: member run-1.1.0 owns it" in refused.reason
        assert await h.state(other) is S.ABORTED
        assert await h.journal.gpu_owners() == {0: KEY}
        # A repeat of the refused Prepare gets the same refusal, never a second try.
        await h.manager.handle(prepare(other, (1,)))
        assert h.replies()[-1].reason == refused.reason


async def test_commit_runs_once_and_reports_in_order(tmp_path: Path) -> None:
    async with harness(tmp_path) as h:
        await h.manager.handle(prepare(KEY, (0,), 'echo ran >> "$TUNEPLANE_OUT_DIR/runs"\n'))
        commit = m.Commit(KEY, None)
        await h.manager.handle(commit)
        await h.wait_state(S.EXITED)
        await h.manager.handle(commit)
        await h.manager.handle(m.Abort(KEY, "too late"))
        record = await h.journal.member(KEY)
        assert record is not None and record.exit is not None and record.exit.exit_code == 0
        assert (Path(record.out_dir) / "runs").read_text() == "ran\n"
        assert h.reports() == ["committed", "starting", "running", "exited"]
        assert [r.state for r in await h.journal.pending_reports()] == [
            S.COMMITTED, S.STARTING, S.RUNNING, S.EXITED,
        ]  # fmt: skip
        assert await h.journal.gpu_owners() == {}


async def test_launch_refuses_a_gpu_that_fell_sick_after_prepare_and_frees_it(
    tmp_path: Path,
) -> None:
    async with harness(tmp_path) as h:
        await h.manager.handle(prepare(KEY, (0,), 'echo ran >> "$TUNEPLANE_OUT_DIR/runs"\n'))
        assert h.replies()[-1].ok
        record = await h.journal.member(KEY)
        assert record is not None and record.gpu_uuids == (INV.gpus[0].uuid,)
        sick = attrs.evolve(INV.gpus[0], healthy=False, health_reason="XID 79 at ...: lost")
        h.node[0] = attrs.evolve(INV, gpus=(sick, INV.gpus[1]))
        await h.manager.handle(m.Commit(KEY, None))
        record = await h.journal.member(KEY)
        assert record is not None and record.state is S.ABORTED
        assert record.reason == (
            "GPU 0 (GPU-sim-node-a-0) became unhealthy after it was prepared: XID 79 at ...: lost."
        )
        assert await h.journal.gpu_owners() == {}
        assert h.reports() == ["committed", "aborted"]
        # Nothing of the member started.
        assert not (h.roots / "out" / KEY.run_id).joinpath("attempt-1", "member-0", "runs").exists()


async def test_launch_refuses_when_the_gpu_order_changed_after_prepare(tmp_path: Path) -> None:
    async with harness(tmp_path) as h:
        await h.manager.handle(prepare(KEY, (1,)))
        assert h.replies()[-1].ok
        a, b = INV.gpus
        # The driver reloaded and listed the cards the other way round.
        h.node[0] = attrs.evolve(INV, gpus=(attrs.evolve(b, index=0), attrs.evolve(a, index=1)))
        await h.manager.handle(m.Commit(KEY, None))
        record = await h.journal.member(KEY)
        assert record is not None and record.state is S.ABORTED
        assert record.reason == (
            "GPU 1 was placed as GPU-sim-node-a-1 but this Node's GPU 1 is GPU-sim-node-a-0 now "
            "(that card is GPU 0 now); the GPU order changed, so the Job must be placed again."
        )
        assert await h.journal.gpu_owners() == {}


async def test_abort_releases_a_prepared_member(tmp_path: Path) -> None:
    async with harness(tmp_path) as h:
        await h.manager.handle(prepare(KEY, (0, 1)))
        await h.manager.handle(m.Abort(KEY, "member 1 refused"))
        assert await h.state() is S.ABORTED
        assert await h.journal.gpu_owners() == {}
        assert h.reports() == ["aborted"]
        await h.manager.handle(m.Commit(KEY, None))  # a late Commit starts nothing
        assert await h.state() is S.ABORTED and not (h.roots / "out").exists()


async def test_cancel_stops_a_running_member(tmp_path: Path) -> None:
    async with harness(tmp_path) as h:
        await h.manager.handle(prepare(KEY, (0,), "sleep 60\n"))
        await h.manager.handle(m.Commit(KEY, None))
        await h.wait_state(S.RUNNING)
        await h.manager.handle(m.Cancel(KEY, "the researcher cancelled", 1))
        assert await h.state() in (S.CANCELLING, S.EXITED)
        await h.wait_state(S.EXITED)
        record = await h.journal.member(KEY)
        assert record is not None and record.exit is not None
        assert record.exit.signal is not None or record.exit.exit_code != 0
        assert h.reports()[-2:] == ["cancelling", "exited"]
        assert await h.journal.gpu_owners() == {}


async def test_an_exit_is_seen_when_it_happens_not_at_the_next_look(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With the periodic looks an hour apart, only the runner's pidfd can tell its exit."""
    if not hasattr(os, "pidfd_open"):
        pytest.skip("needs os.pidfd_open (Linux 5.3 and Python 3.9 or later)")
    monkeypatch.setattr(members_exits, "WATCH_CHECK_S", 3600.0)
    monkeypatch.setattr(members_exits, "WATCH_INTERVAL_S", 3600.0)
    async with harness(tmp_path) as h:
        script = "while [ ! -e go ]; do sleep 0.02; done\n"
        await h.manager.handle(prepare(KEY, (0,), script))
        await h.manager.handle(m.Commit(KEY, None))
        await h.wait_state(S.RUNNING)
        (h.roots / "work" / str(KEY) / "go").touch()
        await h.wait_state(S.EXITED)


async def test_replay_refuses_a_prepare_cut_short(tmp_path: Path) -> None:
    async with harness(tmp_path) as h:
        await h.journal.create_member(
            NewMember(KEY, 1, (0,), str(tmp_path / "m"), str(tmp_path / "o"), 5), 1
        )
        await h.manager.replay()
        assert await h.state() is S.ABORTED
        record = await h.journal.member(KEY)
        assert record is not None and "stopped while preparing" in record.reason
        await h.manager.handle(prepare(KEY, (0,)))
        assert not h.replies()[-1].ok


async def test_a_capsule_without_a_launch_is_refused_at_prepare(tmp_path: Path) -> None:
    async with harness(tmp_path) as h:
        good = prepare(KEY, (0,))
        files = {"capsule.json": b'{"launcher": "torchrun-magic", "entrypoint": ["x"]}'}
        digests = {"capsule.json": "sha256:" + hashlib.sha256(files["capsule.json"]).hexdigest()}
        await h.manager.handle(attrs.evolve(good, capsule_digests=digests, capsule_files=files))
        (reply,) = h.replies()
        assert not reply.ok and "Launcher 'torchrun-magic' is not known" in reply.reason
        assert await h.state() is S.ABORTED and await h.journal.gpu_owners() == {}


async def test_a_runner_changed_between_prepare_and_commit_aborts_the_member(
    tmp_path: Path,
) -> None:
    async with harness(tmp_path) as h:
        await h.manager.handle(prepare(KEY, (0,), 'echo ran >> "$TUNEPLANE_OUT_DIR/runs"\n'))
        capsule_dir = tmp_path / "members" / str(KEY) / "work" / ".tuneplane" / "capsule"
        runner = capsule_dir / "runner.pyz"
        data = runner.read_bytes()
        prepared = [e for e in await h.journal.events(KEY) if e["kind"] == "prepare-succeeded"]
        assert prepared[0]["details"]["runner_sha256"] == hashlib.sha256(data).hexdigest()
        runner.write_bytes(data[:-1] + bytes([data[-1] ^ 1]))
        await h.manager.handle(m.Commit(KEY, None))
        await h.wait_state(S.ABORTED)
        record = await h.journal.member(KEY)
        assert record is not None and "it changed after Prepare" in record.reason
        assert not (Path(record.out_dir) / "runs").exists()
        assert await h.journal.gpu_owners() == {}


async def test_pool_leases_survive_a_restart_and_end_with_their_member(tmp_path: Path) -> None:
    accounts.require_root()
    pool, roots = tuple(accounts.make_pool(2)), accounts.traversable_root("leases")
    first, second, third = (MemberKey(f"run-{i}", 1, 0) for i in (1, 2, 3))
    members = tmp_path / "members"
    async with harness(tmp_path, pool, roots) as h:
        await h.manager.handle(prepare(first, (0,)))
    async with harness(tmp_path, pool, roots) as h:
        # A restarted agent knows the first lease from the journal and account.json alone.
        await h.manager.handle(prepare(second, (1,)))
        one, two = (read_lease(members / str(k)) for k in (first, second))
        assert one is not None and two is not None and one.account != two.account
        assert {one.account.name, two.account.name} == set(pool)
        assert one.work_dir.stat().st_uid == one.account.uid
        # An aborted member gives its account back.
        await h.manager.handle(m.Abort(second, "make room"))
        await h.manager.handle(prepare(third, (1,)))
        three = read_lease(members / str(third))
        # Its folder went back to root before the next member got the account.
        assert three is not None and three.account == two.account
        assert two.work_dir.stat().st_uid == 0 and two.work_dir.stat().st_mode & 0o777 == 0o700
        await h.manager.handle(prepare(MemberKey("run-4", 1, 0), (1,)))
        assert not h.replies()[-1].ok and "GPU 1 is busy" in h.replies()[-1].reason


async def test_a_prepare_reads_the_live_members_and_the_newly_ended_never_the_history(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    accounts.require_root()
    pool, roots = tuple(accounts.make_pool(2)), accounts.traversable_root("history")
    first, second, third = (MemberKey(f"run-{i}", 1, 0) for i in (1, 2, 3))
    members = tmp_path / "members"
    async with harness(tmp_path, pool, roots) as h:
        await h.manager.handle(prepare(first, (0,)))
        await h.manager.handle(m.Abort(first, "ended before it ran"))
        ended = read_lease(members / str(first))
        assert ended is not None and ended.work_dir.stat().st_uid == ended.account.uid
        # Unreadable from now on: every Prepare that reads this member's lease says so.
        (members / str(first) / LEASE_FILE).write_text("{not json")
        await h.manager.handle(prepare(second, (0,)))
        assert caplog.text.count(f"account lease unreadable member={first}") == 1
        await h.manager.handle(m.Abort(second, "ended before it ran"))
        await h.manager.handle(prepare(third, (0,)))
        # The second member, ended since, was read and its folder given back to root; the first
        # was not read again.
        assert caplog.text.count(f"account lease unreadable member={first}") == 1
        two = read_lease(members / str(second))
        assert two is not None and two.work_dir.stat().st_uid == 0
        assert h.replies()[-1].ok
    # A restarted agent's first Prepare reads every ended member once more.
    async with harness(tmp_path, pool, roots) as h:
        await h.manager.handle(m.Abort(third, "make room"))
        await h.manager.handle(prepare(MemberKey("run-4", 1, 0), (0,)))
        assert caplog.text.count(f"account lease unreadable member={first}") == 2


async def test_an_exhausted_pool_refuses_the_prepare_and_changes_nothing(tmp_path: Path) -> None:
    accounts.require_root()
    pool, roots = tuple(accounts.make_pool(1)), accounts.traversable_root("exhausted")
    async with harness(tmp_path, pool, roots) as h:
        await h.manager.handle(prepare(KEY, (0,)))
        other = MemberKey("run-2", 1, 0)
        await h.manager.handle(prepare(other, (1,)))
        refused = h.replies()[-1]
        assert not refused.ok and "Every account of this Node's pool" in refused.reason
        assert await h.state(other) is S.ABORTED
        assert await h.journal.gpu_owners() == {0: KEY}
        assert not (roots / "work" / str(other)).exists()


async def test_a_loader_variable_is_refused_at_prepare_even_past_the_coordinator(
    tmp_path: Path,
) -> None:
    # A coordinator refuses it at Preview unless coordinator.toml allows it; the Node does not
    # rely on that: its own runtime (here the default host:bash) has the final say.
    spec = attrs.evolve(make_spec("exit 0\n"), env={"SEED": "1", "LD_PRELOAD": "/tmp/evil.so"})
    files = capsule.seal(spec, "member", KEY.run_id, KEY.attempt, 1)
    cmd = m.Prepare(
        KEY, jobspec.canonical_json(spec), 1, (0,), True, capsule.digests(files),
        {name: text.encode() for name, text in files.items()},
    )  # fmt: skip
    async with harness(tmp_path) as h:
        await h.manager.handle(cmd)
        (reply,) = h.replies()
        assert not reply.ok and reply.reason.startswith("The Job's env.LD_PRELOAD is a loader")
        assert "allow_loader_env = true under [runtimes.bash] in node.toml" in reply.reason
        assert await h.state() is S.ABORTED and await h.journal.gpu_owners() == {}
        assert not (h.roots / "work" / str(KEY)).exists()
