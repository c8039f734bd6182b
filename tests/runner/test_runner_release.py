"""A member run as a pool account gives it back whole: what it left running is killed and
reaped, and its folders belong to root again, before exit.json says it ended (real runner, real
account, a real daemon that left the workload's process group and session)."""

from __future__ import annotations

import os
import pwd
import subprocess
import sys

import attrs
import psutil
import pytest
import trio

from tests.runner.members import member_launch, prepared, wait_observation
from tests.support import accounts
from tuneplane.agent.supervision import Exited
from tuneplane.runner.exit_codes import EXIT_STARTED
from tuneplane.runner.member_file import Account
from tuneplane.runner.member_runner import has_children

# Starts a daemon in a session of its own (out of the workload's process group, which the
# runner kills anyway), records its pid, and exits 0 at once.
LEAVES_A_DAEMON = """\
setsid sleep 600 < /dev/null > /dev/null 2>&1 &
echo $! > "$TUNEPLANE_OUT_DIR/daemon.pid"
touch "$TUNEPLANE_OUT_DIR/written-by-the-member"
"""
LEAVES_NOTHING = 'touch "$TUNEPLANE_OUT_DIR/written-by-the-member"\n'


def _running_as(uid: int) -> list[str]:
    return [
        f"{p.pid} {p.info['name']} {p.info['status']}"
        for p in psutil.process_iter(["uids", "name", "status"])
        if p.info["uids"] is not None and p.info["uids"].real == uid
    ]


@pytest.mark.parametrize("script", [LEAVES_A_DAEMON, LEAVES_NOTHING], ids=["daemon", "nothing"])
async def test_a_pool_account_is_given_back_with_nothing_running_and_root_owning_its_folders(
    script: str,
) -> None:
    accounts.require_root()
    account = pwd.getpwnam(accounts.make_pool(1)[0])
    root = accounts.traversable_root("release")
    launch = member_launch(root, [["/bin/sh", "-c", script]], grace_period_s=1)
    work = root / "work"
    for folder in (work, launch.out_dir):
        folder.mkdir(parents=True, exist_ok=True)
        os.chown(folder, account.pw_uid, account.pw_gid)
    run_as = Account(
        account.pw_name, account.pw_uid, account.pw_gid, (), reap=True,
        release_paths=(str(work), str(launch.out_dir)),
    )  # fmt: skip
    member_dir = prepared(attrs.evolve(launch, run_as=run_as))
    with trio.fail_after(30):
        started = await trio.run_process(
            [sys.executable, "-m", "tuneplane.runner", str(member_dir)],
            capture_stdout=True, capture_stderr=True, check=False, stdin=subprocess.DEVNULL,
        )  # fmt: skip
        assert started.returncode == EXIT_STARTED, started.stderr
        ended = await wait_observation(member_dir, Exited, timeout_s=30)
    assert isinstance(ended, Exited) and ended.exit_code == 0, ended
    # By the time exit.json exists, nothing of the account runs, zombies included.
    assert _running_as(account.pw_uid) == []
    daemon_pid = launch.out_dir / "daemon.pid"
    if script == LEAVES_A_DAEMON:
        assert not psutil.pid_exists(int(daemon_pid.read_text()))
    else:
        assert not daemon_pid.exists()
    # Everything the member wrote, and its folders, are root's again.
    for path in (work, launch.out_dir, launch.out_dir / "written-by-the-member"):
        assert (path.stat().st_uid, path.stat().st_gid) == (0, 0), path


def test_has_children_sees_a_running_child_and_a_zombie_and_none_once_reaped() -> None:
    before = has_children()
    child = subprocess.Popen(["/bin/sleep", "30"])
    try:
        assert has_children()
        child.kill()
        # Killed but not reaped: a zombie is still a child (waitid's WNOWAIT only looks).
        os.waitid(os.P_PID, child.pid, os.WEXITED | os.WNOWAIT)
        assert has_children()
    finally:
        child.kill()
        child.wait()
    assert has_children() is before
