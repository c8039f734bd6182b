"""Only the Node's operator can put a GPU back: a workload's account running `gpu clear` is
refused with a sentence, and the journal (the XID that disables the card) is left as it was."""

from __future__ import annotations

import os
import site
import subprocess
import sys
from pathlib import Path

import trio

from tests.support import accounts
from tuneplane.agent.adapter import open_aio_host
from tuneplane.agent.journal import Journal
from tuneplane.agent.state_dir import StateDir
from tuneplane.agent.xid_book import judge

UUID = "GPU-0a0a0a0a-1111-2222-3333-444444444444"
# The test interpreter lives under /root, which an account cannot enter: the account runs the
# system's python of the same version with this environment's packages (read-only to it).
SYSTEM_PYTHON = Path(f"/usr/bin/python{sys.version_info.major}.{sys.version_info.minor}")
AS_ACCOUNT = (
    "import runpy, site, sys; site.addsitedir(sys.argv.pop(1)); "
    "runpy.run_module('tuneplane.agent.cli', run_name='__main__')"
)


async def _journal_with_an_xid(path: Path) -> None:
    async with open_aio_host():
        journal = await Journal.open(path)
        await journal.record_xids([judge(UUID, 79, 1_767_225_600_000)])
        await journal.close()


def test_a_workload_account_cannot_clear_a_gpu(tmp_path: Path) -> None:
    accounts.require_root()
    accounts.require(SYSTEM_PYTHON.exists(), f"{SYSTEM_PYTHON} to run the CLI as an account")
    (name,) = accounts.make_pool(1)
    root = accounts.traversable_root("gpu-clear")
    state = StateDir(root / "state")
    state.create()
    trio.run(_journal_with_an_xid, state.journal_path)
    before = state.journal_path.read_bytes()
    done = subprocess.run(
        [str(SYSTEM_PYTHON), "-c", AS_ACCOUNT, site.getsitepackages()[0], "gpu", "clear", UUID,
         "--reason", "mine now", "--state-dir", str(state.root)],
        user=name, group=name, extra_groups=[], capture_output=True, text=True, timeout=60,
        check=False, cwd=root, env={"PATH": os.environ["PATH"], "HOME": str(root)},
    )  # fmt: skip
    # The state directory is the operator's (0700): the command stops before opening anything.
    assert done.returncode == 2, (done.stdout, done.stderr)
    assert f"Directory '{state.root}' is not readable" in done.stderr
    assert "Traceback" not in done.stderr
    assert state.journal_path.read_bytes() == before
    # The operator's own read still says the card is disabled.
    listed = subprocess.run(
        [sys.executable, "-m", "tuneplane.agent.cli", "journal", "gpus", "--state-dir",
         str(state.root)],
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert "XID 79 at 2026-01-01T00:00:00Z" in listed.stdout, listed.stderr
