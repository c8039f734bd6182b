"""The demo's LocalCluster as root: each agent its own node.toml, pool and roots; never root.

The cluster sits under a 0700 folder, as ``tuneplane demo`` run from ``/root`` does, so the
members' roots must move to a folder their accounts can pass through.
"""

from __future__ import annotations

import os
import pwd
import shutil
import tempfile
import tomllib
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.integration.lifecycle_support import project, submit, wait_state
from tests.support import accounts
from tuneplane.coordinator.demo.cli import MARKER, MEMBERS_LINE, prepare_workdir
from tuneplane.coordinator.demo.cluster import (
    MEMBER_ROOT_PREFIX,
    SPARE_MEMBER_PARENT,
    LocalCluster,
    node_toml,
)

WHOAMI = 'id -un > "$TUNEPLANE_OUT_DIR/whoami"\npwd > "$TUNEPLANE_OUT_DIR/cwd"\n'


@pytest.fixture
def closed_cluster(tmp_path: Path) -> Iterator[LocalCluster]:
    accounts.require_root()
    closed = tmp_path / "closed"
    closed.mkdir(mode=0o700)
    closed.chmod(0o700)
    pool = accounts.cluster_pool(2, per_agent=2)
    cluster = LocalCluster(
        closed / "cluster", heartbeat_interval=0.5, heartbeat_timeout=3, member_pool=pool,
        accounts_per_agent=2,
    )  # fmt: skip
    try:
        with cluster:
            cluster.start_coordinator()
            cluster.add_agent("node-a", "h200:2")
            cluster.add_agent("node-b", "h200:2")
            cluster.wait_connected()
            yield cluster
    finally:
        if cluster.member_root is not None:
            shutil.rmtree(cluster.member_root, ignore_errors=True)


def test_each_agent_runs_members_as_its_own_pool_where_they_can_reach(
    closed_cluster: LocalCluster, tmp_path: Path
) -> None:
    a, b = closed_cluster.agents
    # Each agent reads its own node.toml: disjoint pools, its own roots.
    configs = [tomllib.loads(agent.config_path.read_text()) for agent in (a, b)]
    assert [c["accounts"]["pool"] for c in configs] == [list(a.pool), list(b.pool)]
    assert len(a.pool) == len(b.pool) == 2 and not set(a.pool) & set(b.pool)
    assert {c["out_root"] for c in configs} == {str(a.out_root), str(b.out_root)}
    assert len({a.out_root, b.out_root, a.work_root, b.work_root}) == 4
    # The folder above the cluster is closed, so the roots live in a fresh 0711 folder in /var/tmp.
    root = closed_cluster.member_root
    assert root is not None and root.parent == SPARE_MEMBER_PARENT
    assert str(tmp_path / "closed") in str(closed_cluster.member_root_note)
    assert root.stat().st_mode & 0o777 == 0o711
    for agent in (a, b):
        assert root in agent.out_root.parents and root in agent.work_root.parents

    run_id = submit(closed_cluster, project(closed_cluster, tmp_path / "proj", WHOAMI),
                    profile="h200:4")  # fmt: skip
    job = wait_state(closed_cluster, run_id, "succeeded", "failed", "aborted", timeout=90)
    assert job["state"] == "succeeded", job
    members = job["attempts"][-1]["members"]
    assert len(members) == 2, members
    ran_as: dict[str, str] = {}
    for member in members:
        out_dir = Path(member["out_dir"])
        (agent,) = [x for x in (a, b) if x.out_root in out_dir.parents]
        who = (out_dir / "whoami").read_text().strip()
        assert who in agent.pool, (who, agent.pool)
        assert pwd.getpwnam(who).pw_uid != 0
        assert agent.work_root in Path((out_dir / "cwd").read_text().strip()).parents
        ran_as[agent.name] = who
    assert sorted(ran_as) == ["node-a", "node-b"]
    # The cluster never opened a folder above its own.
    assert os.stat(tmp_path / "closed").st_mode & 0o777 == 0o700


def test_a_cluster_agent_that_is_not_root_runs_members_as_itself() -> None:
    text = node_toml(Path("/w/out"), Path("/w/work"), ())
    assert tomllib.loads(text) == {
        "out_root": "/w/out",
        "work_root": "/w/work",
        "outputs": {"listen": "127.0.0.1:0"},
        "accounts": {"mode": "agent"},
    }


def test_a_rerun_removes_only_its_own_member_folder(tmp_path: Path) -> None:
    """The marker may name anything and /var/tmp is shared: links and others' folders stay."""
    accounts.require_root()
    target = tmp_path / "precious"
    target.mkdir()
    (target / "keep").write_text("keep\n")
    link = Path(tempfile.mkdtemp(prefix=MEMBER_ROOT_PREFIX, dir=SPARE_MEMBER_PARENT))
    link.rmdir()
    link.symlink_to(target)
    foreign = Path(tempfile.mkdtemp(prefix=MEMBER_ROOT_PREFIX, dir=SPARE_MEMBER_PARENT))
    os.chown(foreign, 65534, 65534)
    own = Path(tempfile.mkdtemp(prefix=MEMBER_ROOT_PREFIX, dir=SPARE_MEMBER_PARENT))
    try:
        for named in (link, foreign, target, own):
            workdir = tmp_path / f"demo-{named.name}"
            workdir.mkdir()
            (workdir / MARKER).write_text(f"made by tuneplane demo\n{MEMBERS_LINE}{named}\n")
            prepare_workdir(workdir)
            assert (workdir / MARKER).exists()
        assert (target / "keep").read_text() == "keep\n"
        assert link.is_symlink() and foreign.is_dir()
        assert not own.exists()
    finally:
        link.unlink(missing_ok=True)
        shutil.rmtree(foreign, ignore_errors=True)
        shutil.rmtree(own, ignore_errors=True)
